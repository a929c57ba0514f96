//! The RabbitMQ failover drill (issue 25, item 3), as `failover.rs` has it for JetStream: a
//! three-node RabbitMQ cluster on loopback (three private nodes of the machine's RabbitMQ,
//! each with its own ports, data directory and an Erlang cookie of the drill's own, never
//! the shared node on 5672), the consumers' **quorum queues** replicated on all three, two
//! `sealpost dispatch` processes and two `sealpost consume` processes given all three nodes
//! (`[rabbitmq] url` comma-separated). Producers commit throughout; mid-run the drill kills
//! the node that leads the first consumer's quorum queue with SIGKILL. The publishes in
//! flight to it end as unknown outcomes (a lost connection, or a `basic.nack` while the
//! queue has no leader), the dispatchers and consumers connected to it reconnect to a
//! surviving node, the queue elects a new leader among the two survivors, and what the
//! majority confirmed survives. At the end: every event `PUBLISHED`, no row in any other
//! state, each consumer applied each event exactly once, the reconciliation report clean.
//! It prints what it measured: how long until the queue had a new leader, how many
//! unknowns arose and how long the run took to converge after the kill.
//!
//! The drill has its own database (dropped at the end); the nodes and their directory are
//! removed even when it fails.

use crate::common;

use common::count;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sealpost::runtime;
use sealpost::store;
use sealpost_rabbitmq::Rabbit;

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
/// The cluster identity frozen into this drill's destinations.
const CLUSTER: &str = "rabbitmq-failover";
const NODES: usize = 3;

/// One private RabbitMQ node.
struct Node {
    name: String,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Node {
    /// The OS pid of the node's Erlang VM (its pid file), once it has started.
    fn vm_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

/// Three clustered nodes. Dropping it stops them, kills what is left and removes the
/// directory.
struct RabbitCluster {
    base: PathBuf,
    nodes: Vec<Node>,
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            if self.nodes[i].child.is_none() {
                continue;
            }
            let _ = self.ctl(i, &["stop"]);
            if let Some(pid) = self.nodes[i].vm_pid() {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
            if let Some(mut c) = self.nodes[i].child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// [`RabbitCluster::env`] for the cluster whose directory is `base`.
fn env_of(base: &Path, cmd: &mut Command) {
    cmd.env("HOME", base.join("home"))
        // An Erlang VM that fails to start writes its crash dump here, not into the clone.
        .env("ERL_CRASH_DUMP", base.join("erl_crash.dump"))
        .env("RABBITMQ_CONF_ENV_FILE", base.join("rabbitmq-env.conf"))
        .env(
            "RABBITMQ_ENABLED_PLUGINS_FILE",
            base.join("enabled_plugins"),
        );
}

/// `rabbitmqctl -n node args` against the cluster whose directory is `base`.
fn ctl_at(base: &Path, node: &str, args: &[&str]) -> Result<String, String> {
    let mut cmd = Command::new(CTL);
    env_of(base, &mut cmd);
    let out = cmd
        .args(["-q", "-n", node])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{CTL}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "rabbitmqctl -n {node} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The node that leads quorum queue `queue`, asked of `node`.
fn leader_at(base: &Path, node: &str, queue: &str) -> Option<String> {
    let out = ctl_at(
        base,
        node,
        &["list_queues", "name", "leader", "--no-table-headers"],
    )
    .ok()?;
    out.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        (f.next()? == queue).then(|| f.next().map(str::to_string))?
    })
}

/// `k` distinct free loopback ports, none in the range RabbitMQ's command line tools take
/// for their own distribution port (35672–35682).
fn free_ports(k: usize) -> Vec<u16> {
    let mut held = Vec::new();
    while held.len() < k {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let p = l.local_addr().unwrap().port();
        if !(35_600..=35_700).contains(&p) {
            held.push(l);
        }
    }
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

impl RabbitCluster {
    /// The environment every node and every `rabbitmqctl` call of this cluster shares: the
    /// cookie's home, no machine-wide env file (it names the shared node), no plugins.
    fn env(&self, cmd: &mut Command) {
        env_of(&self.base, cmd);
    }

    fn ctl(&self, i: usize, args: &[&str]) -> Result<String, String> {
        ctl_at(&self.base, &self.nodes[i].name, args)
    }

    /// Starts three nodes and joins the second and third to the first. `None` (after
    /// printing "skipped") where RabbitMQ is not installed, except under CI.
    fn start() -> Option<RabbitCluster> {
        if !Path::new(SERVER).exists() {
            assert!(
                std::env::var("CI").is_err(),
                "{SERVER} is missing: the RabbitMQ failover drill needs the machine's RabbitMQ"
            );
            eprintln!("skipped: no {SERVER}");
            return None;
        }
        let base =
            std::env::temp_dir().join(format!("sealpost-rmq-cluster-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("home")).unwrap();
        let cookie = base.join("home/.erlang.cookie");
        std::fs::write(&cookie, format!("sealpostdrill{}", runtime::owner_id())).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cookie, std::fs::Permissions::from_mode(0o400)).unwrap();
        std::fs::write(base.join("rabbitmq-env.conf"), "").unwrap();
        std::fs::write(base.join("enabled_plugins"), "[].\n").unwrap();
        let ports = free_ports(2 * NODES);
        let mut cluster = RabbitCluster {
            base: base.clone(),
            nodes: Vec::new(),
        };
        for k in 0..NODES {
            let (port, dist) = (ports[2 * k], ports[2 * k + 1]);
            let name = format!("sp{}n{k}@localhost", std::process::id());
            let dir = base.join(format!("n{k}"));
            std::fs::create_dir_all(dir.join("log")).unwrap();
            std::fs::write(
                dir.join("rabbitmq.conf"),
                format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n"),
            )
            .unwrap();
            std::fs::write(dir.join("advanced.config"), "[].\n").unwrap();
            let log = std::fs::File::create(dir.join("stdout.log")).unwrap();
            let mut cmd = Command::new(SERVER);
            cluster.env(&mut cmd);
            cmd.env("RABBITMQ_NODENAME", &name)
                .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
                .env("RABBITMQ_NODE_PORT", port.to_string())
                .env("RABBITMQ_DIST_PORT", dist.to_string())
                .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
                .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
                .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
                .env("RABBITMQ_LOG_BASE", dir.join("log"))
                .env("RABBITMQ_PID_FILE", dir.join("pid"))
                .env(
                    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                    "-kernel inet_dist_use_interface {127,0,0,1}",
                )
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log);
            let child = cmd.spawn().expect("spawn rabbitmq-server");
            cluster.nodes.push(Node {
                name,
                port,
                dir,
                child: Some(child),
            });
        }
        for k in 0..NODES {
            let deadline = Instant::now() + Duration::from_secs(120);
            while std::net::TcpStream::connect(("127.0.0.1", cluster.nodes[k].port)).is_err() {
                if let Some(Ok(Some(status))) =
                    cluster.nodes[k].child.as_mut().map(|c| c.try_wait())
                {
                    let out = std::fs::read_to_string(cluster.nodes[k].dir.join("stdout.log"))
                        .unwrap_or_default();
                    panic!("private RabbitMQ node {k} exited ({status}) before listening:\n{out}");
                }
                assert!(
                    Instant::now() < deadline,
                    "private RabbitMQ node {k} never listened on {}",
                    cluster.nodes[k].port
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            cluster
                .ctl(k, &["await_startup", "--timeout", "120"])
                .unwrap();
        }
        let first = cluster.nodes[0].name.clone();
        for k in 1..NODES {
            for args in [
                vec!["stop_app"],
                vec!["join_cluster", &first],
                vec!["start_app"],
            ] {
                cluster.ctl(k, &args).unwrap();
            }
        }
        cluster
            .ctl(
                0,
                &["await_online_nodes", &NODES.to_string(), "--timeout", "60"],
            )
            .unwrap();
        Some(cluster)
    }

    /// Every node's AMQP URL, comma-separated: what the processes are given.
    fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node that leads quorum queue `queue`, asked of node `via`.
    fn leader(&self, via: usize, queue: &str) -> Option<String> {
        leader_at(&self.base, &self.nodes[via].name, queue)
    }

    /// Kills node `i`'s Erlang VM with SIGKILL.
    fn kill(&mut self, i: usize) {
        let pid = self.nodes[i].vm_pid().expect("the node's pid file");
        let ok = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -9 {pid}");
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.wait();
        }
    }
}

/// Sealpost processes; killed when dropped.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queue_leader_killed_mid_run() {
    let Some(mut cluster) = RabbitCluster::start() else {
        return;
    };
    let url = cluster.url();
    let r = runtime::owner_id() % 1_000_000_000;
    let db = common::fresh_database(&format!("sealpost_rmq_failover_{r}")).await;
    let mut pg = runtime::pg_connect(&db.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let topic = format!("sp-failover-{r}");
    store::set_route(&pg, "orders", CLUSTER, &topic)
        .await
        .unwrap();
    let consumers = ["c1".to_string(), "c2".to_string()];
    let rabbit = Rabbit::connect(
        &url,
        CLUSTER,
        Duration::from_secs(5),
        "sealpost-test-failover",
    )
    .await
    .expect("the private cluster");
    rabbit.ensure_destination(&topic, &consumers).await.unwrap();
    drop(rabbit);
    let queue = sealpost_rabbitmq::queue_name(&topic, "c1");
    let members = cluster
        .ctl(0, &["list_queues", "name", "members", "--no-table-headers"])
        .unwrap();
    assert_eq!(
        members
            .lines()
            .find(|l| l.starts_with(&queue))
            .map(|l| l.matches('@').count()),
        Some(NODES),
        "the quorum queue is replicated on every node: {members}"
    );

    let dir = std::env::temp_dir().join(format!("sealpost-rmq-failover-{r}"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut procs = Procs(Vec::new());
    let spawn = |procs: &mut Procs, args: &[&str]| {
        let k = procs.0.len();
        let path = dir.join(format!("p{k}.toml"));
        std::fs::write(
            &path,
            format!(
                "database_url = \"{}\"\nbroker = \"rabbitmq\"\nlease_ms = 2000\nack_timeout_ms = 1000\n[rabbitmq]\nurl = \"{url}\"\ncluster = \"{CLUSTER}\"\n",
                db.database_url
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join(format!("p{k}-{}.log", args[0]))).unwrap();
        procs.0.push(
            Command::new(env!("CARGO_BIN_EXE_sealpost"))
                .arg("--config")
                .arg(&path)
                .args(args)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn sealpost"),
        );
    };
    spawn(&mut procs, &["dispatch", "--broker", "rabbitmq"]);
    spawn(
        &mut procs,
        &["dispatch", "--no-reconciler", "--broker", "rabbitmq"],
    );
    for c in &consumers {
        spawn(
            &mut procs,
            &[
                "consume",
                "--consumer",
                c,
                "--topic",
                &topic,
                "--broker",
                "rabbitmq",
            ],
        );
    }

    // Producers: 100 orders every 100 ms for 12 s; the leader is killed at 5 s.
    let payload = br#"{"order_id":"x","total_cents":1}"#.to_vec();
    let started = Instant::now();
    let mut n = 0usize;
    let mut killed: Option<(String, Instant)> = None;
    let mut watcher = None;
    let mut max_unknown = 0i64;
    while started.elapsed() < Duration::from_secs(12) {
        let keys: Vec<String> = (n..n + 100).map(|k| format!("o-{k}")).collect();
        let events = sealpost_cli::demo::order_batch(&keys, &payload);
        let tx = pg.transaction().await.unwrap();
        store::enqueue_many(&tx, "orders", &events).await.unwrap();
        tx.commit().await.unwrap();
        n += 100;
        if killed.is_none() && started.elapsed() >= Duration::from_secs(5) {
            let leader = cluster.leader(0, &queue).expect("the queue's leader");
            let i = cluster
                .nodes
                .iter()
                .position(|nd| nd.name == leader)
                .unwrap_or_else(|| panic!("leader {leader} is not one of the drill's nodes"));
            let published = count(
                &pg,
                "SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'",
            )
            .await;
            assert!(published > 0, "nothing was published before the kill");
            eprintln!("killing {leader}, the leader of {queue}, with {published} of {n} published");
            cluster.kill(i);
            let at = Instant::now();
            // A watcher asks a survivor for the queue's leader until it is another node.
            let survivor = cluster
                .nodes
                .iter()
                .find(|nd| nd.child.is_some())
                .map(|nd| nd.name.clone())
                .unwrap();
            let (base, q, old) = (cluster.base.clone(), queue.clone(), leader.clone());
            watcher = Some(std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                while Instant::now() < deadline {
                    if let Some(l) = leader_at(&base, &survivor, &q).filter(|l| *l != old) {
                        return Some((l, at.elapsed()));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                None
            }));
            killed = Some((leader, at));
        }
        if killed.is_some() {
            max_unknown = max_unknown.max(
                count(
                    &pg,
                    "SELECT count(*) FROM sealpost.outbox WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING')",
                )
                .await,
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, at) = killed.expect("the leader was killed");
    let stopped = Instant::now();
    let (new_leader, elected) = tokio::task::spawn_blocking(move || watcher.unwrap().join())
        .await
        .unwrap()
        .unwrap()
        .expect("the queue elected a new leader among the survivors within 60 s");
    let elected_s = elected.as_secs_f64();

    // Convergence: every event published, each consumer applied each once.
    let n = n as i64;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let published = count(
            &pg,
            "SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'",
        )
        .await;
        let unknown = count(
            &pg,
            "SELECT count(*) FROM sealpost.outbox WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING')",
        )
        .await;
        max_unknown = max_unknown.max(unknown);
        let mut applied = Vec::new();
        for c in &consumers {
            applied.push(
                count(
                    &pg,
                    &format!("SELECT count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = '{c}'"),
                )
                .await,
            );
        }
        if published == n && applied.iter().all(|a| *a == n) {
            break;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .filter_map(|e| e.ok())
                .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
                .map(|e| {
                    let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(20).collect();
                    format!(
                        "{}:\n{}",
                        e.path().display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    )
                })
                .collect();
            panic!(
                "not converged 180 s after the kill: {published} of {n} published, applied {applied:?}\n{}",
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let converged_s = at.elapsed().as_secs_f64();
    let after_producers_s = stopped.elapsed().as_secs_f64();
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.outbox WHERE state <> 'PUBLISHED'"
        )
        .await,
        0
    );
    for c in &consumers {
        assert_eq!(
            count(
                &pg,
                &format!("SELECT count(*) FROM demo_fulfilment WHERE consumer_id = '{c}'")
            )
            .await,
            n,
            "consumer {c} applied every event exactly once"
        );
    }
    let attempts = count(&pg, "SELECT count(*) FROM sealpost.attempts").await;
    let opts = sealpost_cli::ops::ReconcileOptions {
        pending_age_s: 60,
        unconsumed_age_s: 0,
        unknown_age_s: 900,
        consumers: consumers.to_vec(),
        streams: Vec::new(),
        scan_max: 0,
    };
    let report = sealpost_cli::ops::reconcile(&pg, None::<&sealpost::ops::NoScan>, &opts)
        .await
        .unwrap();
    assert!(report.findings.is_empty(), "{:?}", report.findings);
    eprintln!(
        "RabbitMQ failover: {n} events, {attempts} attempts ({} sent again after an unknown outcome, at most {max_unknown} unknown at once); new leader of {queue} ({new_leader}) seen {elected_s:.1} s after the kill; converged {converged_s:.1} s after it ({after_producers_s:.1} s after the producers stopped)",
        report.resent_after_unknown,
    );
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
}
