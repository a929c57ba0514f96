//! A real network between the parts (issue 25, item 4): a dispatcher and a consumer run in a
//! network namespace of the test's own, reaching PostgreSQL over one veth link and the broker
//! over another, while a second dispatcher (with the reconciler) and a second consumer run
//! beside the services. Mid-run the test takes the broker link down, then the database link,
//! then both (`ip link set ... down`: packets are dropped, no connection is reset, as when a
//! cable or a switch goes), each for longer than the lease and the ack timeout, while
//! producers keep committing; then it heals them. Afterwards every event is `PUBLISHED`, each
//! consumer applied each event once, no unknown is left, and on NATS nothing is stored twice.
//!
//! The machine's services listen on loopback only, so the test forwards each service from an
//! address on the host's end of a link (a TCP relay in the test process); the processes in
//! the namespace connect to those addresses, and everything they send crosses the link. A
//! Kafka broker names its own address in its metadata, so the Kafka drill starts a private
//! tansu (the binary `.ci/run` caches) listening on the broker link's host address instead.
//! Making namespaces needs root (CI runs as root): elsewhere the tests print "skipped".

use crate::common;
use crate::teardown_kafka;
use crate::teardown_nats;
use crate::teardown_rabbitmq;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use sealpost::runtime;
use sealpost::store;
use sealpost_core::envelope::{EventOrdering, PartitionAlgorithm};
use tokio::net::{TcpListener, TcpStream};

/// Links made by this process so far (each gets its own /30).
static LINKS: AtomicU32 = AtomicU32::new(0);

/// One drill at a time: each runs two dispatchers and two consumers against shared services.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace with veth links to the host; removed (links and all) on drop.
struct Netns {
    name: String,
    links: Vec<Link>,
}

/// One veth pair: `host_if` (address `host_ip`) in the host, its peer in the namespace.
struct Link {
    host_if: String,
    host_ip: String,
}

impl Netns {
    /// A namespace named after `tag` with its loopback up; `None` ("skipped") without root
    /// outside CI, where making one is not allowed.
    fn new(tag: &str) -> Option<Netns> {
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        if !root {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs as root: the network tests must run"
            );
            eprintln!("skipped: network namespaces need root");
            return None;
        }
        let name = format!("sp-{tag}-{}", std::process::id() % 100_000);
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        ip(&["netns", "exec", &name, "ip", "link", "set", "lo", "up"]);
        Some(Netns {
            name,
            links: Vec::new(),
        })
    }

    /// A new link; its index.
    fn link(&mut self) -> usize {
        let n = LINKS.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let (host_if, ns_if) = (
            format!("sph{}x{n}", pid % 100_000),
            format!("spn{}x{n}", pid % 100_000),
        );
        // 10.<200 + pid % 50>.<n>.0/30: distinct per process and per link.
        let net = format!("10.{}.{}", 200 + pid % 50, n % 250);
        let (host_ip, ns_ip) = (format!("{net}.1"), format!("{net}.2"));
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
        ]);
        ip(&["link", "set", &ns_if, "netns", &self.name]);
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "netns",
            "exec",
            &self.name,
            "ip",
            "addr",
            "add",
            &format!("{ns_ip}/30"),
            "dev",
            &ns_if,
        ]);
        ip(&[
            "netns", "exec", &self.name, "ip", "link", "set", &ns_if, "up",
        ]);
        self.links.push(Link { host_if, host_ip });
        self.links.len() - 1
    }

    fn host_ip(&self, link: usize) -> &str {
        &self.links[link].host_ip
    }

    /// Takes link `i` down: what crosses it is dropped from now on.
    fn cut(&self, i: usize) {
        ip(&["link", "set", &self.links[i].host_if, "down"]);
    }

    fn heal(&self, i: usize) {
        ip(&["link", "set", &self.links[i].host_if, "up"]);
    }

    /// `program` run inside the namespace.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for l in &self.links {
            let _ = Command::new("ip")
                .args(["link", "del", &l.host_if])
                .output();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Relays every connection made to `host_ip:<port>` (a free port, returned) to
/// `127.0.0.1:target`, until the test process ends.
async fn forward(host_ip: &str, target: u16) -> u16 {
    let listener = TcpListener::bind((host_ip, 0)).await.expect("bind relay");
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target)).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    port
}

/// Where `.ci/run` caches tansu (`TANSU_BIN` overrides it).
fn tansu_bin() -> std::path::PathBuf {
    std::env::var_os("TANSU_BIN")
        .map(Into::into)
        .unwrap_or_else(|| "/var/cache/sealpost/tansu/bin/tansu".into())
}

/// A private tansu listening on `host:port` (memory storage), killed on drop.
struct Tansu(Child);

impl Tansu {
    fn start(host: &str, dir: &std::path::Path) -> Option<(Tansu, u16)> {
        let bin = tansu_bin();
        if !bin.exists() {
            assert!(
                std::env::var_os("CI").is_none(),
                "no tansu at {}: .ci/run installs it",
                bin.display()
            );
            eprintln!("skipped: no tansu at {}", bin.display());
            return None;
        }
        let port = std::net::TcpListener::bind((host, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("tcp://{host}:{port}");
        let child = Command::new(bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("tansu.txt")).unwrap())
            .spawn()
            .expect("start tansu");
        let t = Tansu(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect((host, port)).is_err() {
            assert!(Instant::now() < deadline, "tansu never listened on {url}");
            std::thread::sleep(Duration::from_millis(100));
        }
        Some((t, port))
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// tansu 0.6 needs one record per batch and no idempotence (`.ci/run`, docs/operations.md).
const TANSU_PROPERTIES: &str = "batch.num.messages=1,enable.idempotence=false";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Nats,
    Rabbitmq,
    Kafka,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Nats => "nats",
            Kind::Rabbitmq => "rabbitmq",
            Kind::Kafka => "kafka",
        }
    }

    fn cluster(self) -> &'static str {
        match self {
            Kind::Nats => common::NATS_CLUSTER,
            Kind::Rabbitmq => common::RABBITMQ_CLUSTER,
            Kind::Kafka => common::KAFKA_CLUSTER,
        }
    }

    fn port(self) -> u16 {
        match self {
            Kind::Nats => 4222,
            Kind::Rabbitmq => 5672,
            Kind::Kafka => unreachable!("the Kafka drill's tansu is its own"),
        }
    }

    /// The `[nats]` or `[rabbitmq]` table for a broker at `host:port`.
    fn table(self, host: &str, port: u16) -> String {
        match self {
            Kind::Nats => format!(
                "[nats]\nurl = \"nats://{host}:{port}\"\ncluster = \"{}\"\n",
                self.cluster()
            ),
            Kind::Rabbitmq => format!(
                "[rabbitmq]\nurl = \"amqp://guest:guest@{host}:{port}/%2f\"\ncluster = \"{}\"\n",
                self.cluster()
            ),
            Kind::Kafka => format!(
                "[kafka]\nbrokers = \"{host}:{port}\"\ncluster = \"{}\"\nclient_properties = \"{TANSU_PROPERTIES}\"\n",
                self.cluster()
            ),
        }
    }
}

/// The drill's processes, database and destination; processes are killed on drop.
struct Drill {
    kind: Kind,
    db: common::TestDb,
    pg: tokio_postgres::Client,
    topic: String,
    dir: std::path::PathBuf,
    children: Vec<Child>,
    produced: usize,
}

impl Drop for Drill {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How the processes reach PostgreSQL and the broker.
struct Reach {
    pg: (String, u16),
    broker: (String, u16),
}

impl Kind {
    /// Leases and timeouts shorter than the cuts (6 s). tansu takes about a record per
    /// millisecond here, so a Kafka batch gets a longer ack timeout (and the lease stays
    /// above it by more than Kafka's 1.5 s handover margin).
    fn timing(self) -> &'static str {
        match self {
            Kind::Kafka => {
                "lease_ms = 5000\nack_timeout_ms = 3000\nbatch_size_max = 100\n\
                 reconcile_every_ms = 500\nerror_backoff_max_ms = 1000\n"
            }
            _ => {
                "lease_ms = 3000\nack_timeout_ms = 1000\nbatch_size_max = 100\n\
                 reconcile_every_ms = 500\nerror_backoff_max_ms = 1000\n"
            }
        }
    }
}

impl Drill {
    /// Starts `sealpost <args>` (through `wrap`, the namespace, when given) reaching the
    /// services as `reach` says; its stderr goes to a log file printed if the drill fails.
    fn spawn(&mut self, ns: Option<&Netns>, reach: &Reach, args: &[&str]) {
        let i = self.children.len();
        let path = self.dir.join(format!("p{i}.toml"));
        let url = format!(
            "host={} port={} user=postgres dbname={} connect_timeout=5",
            reach.pg.0,
            reach.pg.1,
            self.db.name()
        );
        std::fs::write(
            &path,
            format!(
                "database_url = \"{url}\"\nbroker = \"{}\"\n{}{}",
                self.kind.name(),
                self.kind.timing(),
                self.kind.table(&reach.broker.0, reach.broker.1)
            ),
        )
        .unwrap();
        let bin = env!("CARGO_BIN_EXE_sealpost");
        let mut c = match ns {
            Some(ns) => ns.command(bin),
            None => Command::new(bin),
        };
        let log = std::fs::File::create(self.dir.join(format!("p{i}-{}.log", args[0]))).unwrap();
        let child = c
            .arg("--config")
            .arg(&path)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn sealpost");
        self.children.push(child);
    }

    async fn count(&self, sql: &str) -> i64 {
        common::count(&self.pg, sql).await
    }

    /// Commits `n` more orders.
    async fn produce(&mut self, n: usize) {
        let keys: Vec<String> = (self.produced..self.produced + n)
            .map(|k| format!("o-{k}"))
            .collect();
        self.produced += n;
        let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"x","total_cents":1}"#);
        let tx = self.pg.transaction().await.unwrap();
        store::enqueue_many(&tx, "orders", &events).await.unwrap();
        tx.commit().await.unwrap();
    }

    /// The last lines of every process's log.
    fn logs(&self) -> String {
        let mut out = String::new();
        let mut names: Vec<_> = std::fs::read_dir(&self.dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        names.sort();
        for p in names
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
        {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {} ({} lines)\n", p.display(), lines.len()));
            for l in &lines[lines.len().saturating_sub(15)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

/// Runs the drill on `kind`: see the module's documentation.
async fn links_cut_and_healed(kind: Kind) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(mut ns) = Netns::new(&kind.name()[..2]) else {
        return;
    };
    let (pg_link, broker_link) = (ns.link(), ns.link());
    let pg_port = forward(ns.host_ip(pg_link), 5432).await;
    let r = runtime::owner_id() % 1_000_000_000;
    let dir = std::env::temp_dir().join(format!("sealpost-net-{}-{r}", kind.name()));
    std::fs::create_dir_all(&dir).unwrap();
    // The broker: the machine's, relayed over the link; for Kafka a private tansu on the
    // link's host address, which the processes beside the services reach too.
    let (_tansu, broker_port, host_broker) = match kind {
        Kind::Kafka => {
            let Some((t, port)) = Tansu::start(ns.host_ip(broker_link), &dir) else {
                return;
            };
            (Some(t), port, (ns.host_ip(broker_link).to_string(), port))
        }
        _ => (
            None,
            forward(ns.host_ip(broker_link), kind.port()).await,
            ("127.0.0.1".to_string(), kind.port()),
        ),
    };

    let db = common::fresh_database(&format!("sealpost_net_{}_{r}", kind.name())).await;
    let pg = runtime::pg_connect(&db.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let topic = format!("spnet{}{r}", kind.name());
    store::set_route(&pg, "orders", kind.cluster(), &topic)
        .await
        .unwrap();
    let consumers = [format!("c-host-{r}"), format!("c-ns-{r}")];
    // Two teardown types (each module carries its own): held as one box.
    let _destination: Box<dyn std::any::Any> = match kind {
        Kind::Nats => {
            let n = sealpost_nats::Nats::connect(
                &common::nats_url(),
                common::NATS_CLUSTER,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            n.ensure_stream(&topic).await.unwrap();
            Box::new(teardown_nats::stream(&common::nats_url(), &topic))
        }
        Kind::Rabbitmq => {
            let rabbit = sealpost_rabbitmq::Rabbit::connect(
                &common::rabbitmq_url(),
                common::RABBITMQ_CLUSTER,
                Duration::from_secs(5),
                &format!("sealpost-net-{r}"),
            )
            .await
            .unwrap();
            rabbit.ensure_destination(&topic, &consumers).await.unwrap();
            Box::new(teardown_rabbitmq::destination(
                &common::rabbitmq_url(),
                &topic,
                &consumers,
            ))
        }
        Kind::Kafka => {
            store::set_route_ordering(
                &pg,
                "orders",
                common::KAFKA_CLUSTER,
                &topic,
                EventOrdering::Unordered,
            )
            .await
            .unwrap();
            store::set_route_partitions(
                &pg,
                "orders",
                PartitionAlgorithm::KafkaMurmur2 { partitions: 4 },
            )
            .await
            .unwrap();
            let kcfg = teardown_kafka::config(
                &format!("{}:{}", host_broker.0, host_broker.1),
                common::KAFKA_CLUSTER,
                TANSU_PROPERTIES,
            );
            let kafka = sealpost_kafka::Kafka::connect(kcfg).await.unwrap();
            assert_eq!(kafka.ensure_topic(&topic, 4).await.unwrap(), 4);
            // The private broker goes with its records.
            Box::new(())
        }
    };
    let mut d = Drill {
        kind,
        db,
        pg,
        topic,
        dir,
        children: Vec::new(),
        produced: 0,
    };
    let host = Reach {
        pg: ("127.0.0.1".into(), 5432),
        broker: host_broker,
    };
    let inside = Reach {
        pg: (ns.host_ip(pg_link).into(), pg_port),
        broker: (ns.host_ip(broker_link).into(), broker_port),
    };
    d.produce(2_000).await;
    let topic = d.topic.clone();
    d.spawn(
        None,
        &host,
        &["consume", "--consumer", &consumers[0], "--topic", &topic],
    );
    d.spawn(
        Some(&ns),
        &inside,
        &["consume", "--consumer", &consumers[1], "--topic", &topic],
    );
    d.spawn(Some(&ns), &inside, &["dispatch", "--no-reconciler"]);
    d.spawn(None, &host, &["dispatch"]);

    let mut peak_unknown = 0;
    for (what, links) in [
        ("the broker link", vec![broker_link]),
        ("the database link", vec![pg_link]),
        ("both links", vec![broker_link, pg_link]),
    ] {
        // Flow first, so the namespace's dispatcher is mid-send when the link goes.
        for _ in 0..4 {
            d.produce(100).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        eprintln!("cutting {what} ({} events so far)", d.produced);
        for &l in &links {
            ns.cut(l);
        }
        // Longer than the lease and the ack timeout, producers still committing.
        let cut_at = Instant::now();
        while cut_at.elapsed() < Duration::from_secs(6) {
            d.produce(100).await;
            peak_unknown = peak_unknown.max(
                d.count("SELECT count(*) FROM sealpost.work WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING')")
                    .await,
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for &l in &links {
            ns.heal(l);
        }
        eprintln!("healed {what}");
    }
    let n = d.produced as i64;
    // Converges within 2 minutes of the last heal.
    let healed = Instant::now();
    loop {
        let published = d
            .count("SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'")
            .await;
        let mut applied = Vec::new();
        for c in &consumers {
            applied.push(
                d.count(&format!(
                    "SELECT count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = '{c}'"
                ))
                .await,
            );
        }
        if published == n && applied.iter().all(|&a| a == n) {
            eprintln!(
                "converged {:.1} s after the last heal; most unknown at once during the cuts: {peak_unknown}",
                healed.elapsed().as_secs_f64()
            );
            break;
        }
        if healed.elapsed() > Duration::from_secs(120) {
            panic!(
                "not converged 120 s after the last heal: {published} of {n} published, applied {applied:?}\n{}",
                d.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.work WHERE state <> 'PUBLISHED'")
            .await,
        0,
        "no unknown left, nothing quarantined"
    );
    for c in &consumers {
        assert_eq!(
            d.count(&format!(
                "SELECT count(*) FROM demo_fulfilment WHERE consumer_id = '{c}'"
            ))
            .await,
            n,
            "consumer {c} applied each event once"
        );
    }
    let owners = d
        .count("SELECT count(DISTINCT owner) FROM sealpost.attempts")
        .await;
    assert!(owners >= 2, "both dispatchers sent ({owners} owner(s))");
    let attempts = d.count("SELECT count(*) FROM sealpost.attempts").await;
    if kind == Kind::Nats {
        let n_msgs = {
            let nats = sealpost_nats::Nats::connect(
                &common::nats_url(),
                common::NATS_CLUSTER,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            let mut s = nats.js.get_stream(&d.topic).await.unwrap();
            s.info().await.unwrap().state.messages
        };
        assert_eq!(n_msgs, n as u64, "nothing stored twice at the broker");
    }
    eprintln!("{n} events, {attempts} attempts by {owners} dispatchers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_links_cut_mid_send_and_healed_lose_nothing_and_store_nothing_twice() {
    links_cut_and_healed(Kind::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_links_cut_mid_send_and_healed_lose_nothing_and_apply_each_once() {
    links_cut_and_healed(Kind::Rabbitmq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_links_cut_mid_send_and_healed_lose_nothing_and_apply_each_once() {
    links_cut_and_healed(Kind::Kafka).await;
}
