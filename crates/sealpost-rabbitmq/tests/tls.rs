//! TLS and credentials of the RabbitMQ adapter ([`RabbitOptions`], [`Rabbit::connect_with`])
//! against PRIVATE RabbitMQ nodes (never the shared one on 5672): each test starts its own
//! node (`sp_tls_<pid>_<tag>@localhost`) on free ports with only a TLS listener, a CA and
//! certificates made here with rcgen, its own data, log and config directory and no plugins.
//! Proven: a publish over `amqps://` with the right CA gets its confirm (the password read
//! from a file); a wrong CA is refused with a message naming `rabbitmq.security.tls_ca_file`; a wrong
//! password file is refused; a node that demands client certificates refuses a client
//! without one and accepts one with it. Each node is stopped (`rabbitmqctl -n NODE stop`,
//! then its process killed) and its directory removed by a drop guard, also when a test
//! fails. Without `/usr/lib/rabbitmq/bin/rabbitmq-server` the tests print "skipped" and pass.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use sealpost_core::envelope::{Destination, EventId, PartitionAlgorithm, PAYLOAD_DOMAIN};
use sealpost_core::port::{Broker, SendRequest, SendResult};
use sealpost_core::Digest;
use sealpost_rabbitmq::{Rabbit, RabbitError, RabbitOptions};

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
const CLUSTER: &str = "rabbitmq-tls";

fn new_ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "sealpost-test");
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A directory of the test's own, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("sealpost-rabbit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The test CA, a server certificate for `localhost` and `127.0.0.1`, a client certificate,
/// a second CA that signed neither, and the guest password, as files.
struct Pki {
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    password: PathBuf,
    wrong_password: PathBuf,
}

fn pki(dir: &TempDir) -> Pki {
    let (ca_pem, issuer) = new_ca("Sealpost test CA");
    let (server_cert, server_key) = leaf(
        &issuer,
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(&issuer, &[], ExtendedKeyUsagePurpose::ClientAuth);
    Pki {
        ca: dir.file("ca.crt", &ca_pem),
        other_ca: dir.file("other-ca.crt", &new_ca("Someone else's CA").0),
        server_cert: dir.file("server.crt", &server_cert),
        server_key: dir.file("server.key", &server_key),
        client_cert: dir.file("client.crt", &client_cert),
        client_key: dir.file("client.key", &client_key),
        password: dir.file("password", "guest\n"),
        wrong_password: dir.file("wrong-password", "not-the-password-7731\n"),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A private RabbitMQ node; dropping it stops it, kills what is left and removes its
/// directory.
struct Node {
    name: String,
    child: Child,
    /// Configuration, data and logs; removed after the node is gone.
    dir: TempDir,
    tls_port: u16,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = Command::new(CTL)
            .args(["-n", &self.name, "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a node with a TLS listener only, the test's server certificate, and
/// `ssl_options.verify = verify_peer`; `fail_if_no_peer_cert` demands a client certificate.
/// `None` (after printing "skipped") where RabbitMQ is not installed.
fn node(tag: &str, p: &Pki, fail_if_no_peer_cert: bool) -> Option<Node> {
    if !Path::new(SERVER).exists() {
        eprintln!("skipped: no {SERVER}");
        return None;
    }
    let dir = TempDir::new(&format!("node-{tag}"));
    let (node_port, dist_port, tls_port) = (free_port(), free_port(), free_port());
    dir.file(
        "rabbitmq.conf",
        &format!(
            "listeners.tcp = none\n\
             listeners.ssl.default = 127.0.0.1:{tls_port}\n\
             ssl_options.cacertfile = {}\n\
             ssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = {fail_if_no_peer_cert}\n",
            p.ca.display(),
            p.server_cert.display(),
            p.server_key.display()
        ),
    );
    dir.file("enabled_plugins", "[].\n");
    let name = format!("sp_tls_{}_{tag}@localhost", std::process::id());
    let log = std::fs::File::create(dir.0.join("stdout.log")).unwrap();
    let child = Command::new(SERVER)
        .env("RABBITMQ_NODENAME", &name)
        .env("RABBITMQ_NODE_PORT", node_port.to_string())
        .env("RABBITMQ_DIST_PORT", dist_port.to_string())
        .env("RABBITMQ_MNESIA_BASE", dir.0.join("mnesia"))
        .env("RABBITMQ_LOG_BASE", dir.0.join("log"))
        .env("RABBITMQ_CONFIG_FILE", dir.0.join("rabbitmq"))
        .env(
            "RABBITMQ_ENABLED_PLUGINS_FILE",
            dir.0.join("enabled_plugins"),
        )
        .env("RABBITMQ_PID_FILE", dir.0.join("pid"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn rabbitmq-server");
    let mut n = Node {
        name,
        child,
        dir,
        tls_port,
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    while std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_err() {
        if let Ok(Some(status)) = n.child.try_wait() {
            let out = std::fs::read_to_string(n.dir.0.join("stdout.log")).unwrap_or_default();
            panic!("private RabbitMQ node exited ({status}) before listening:\n{out}");
        }
        assert!(
            Instant::now() < deadline,
            "private RabbitMQ node never listened on {tls_port}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Some(n)
}

impl Node {
    /// The node's TLS URL for the guest user, without a password.
    fn url(&self) -> String {
        format!("amqps://guest@localhost:{}/%2f", self.tls_port)
    }
}

fn destination(topic: &str) -> Destination {
    Destination {
        cluster: CLUSTER.into(),
        topic: topic.into(),
        routing_key: "k".into(),
        partition_algorithm: PartitionAlgorithm::None,
        route_policy_generation: 1,
        serializer: "json.v1".into(),
        durability: "quorum".into(),
        required_ack: "confirm".into(),
        ordering: sealpost_core::envelope::EventOrdering::Unordered,
    }
}

fn request(destination: &Destination, payload: &[u8]) -> SendRequest {
    SendRequest {
        event_id: EventId(*uuid::Uuid::now_v7().as_bytes()),
        member: 0,
        envelope_generation: 1,
        attempt_id: 1,
        payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, payload),
        destination: destination.clone(),
        destination_digest: destination.digest(),
        payload: payload.to_vec(),
        envelope: Default::default(),
        signature: None,
    }
}

async fn connect(url: &str, options: &RabbitOptions) -> Result<Rabbit, RabbitError> {
    tokio::time::timeout(
        Duration::from_secs(20),
        Rabbit::connect_with(url, CLUSTER, Duration::from_secs(5), "sp-tls-test", options),
    )
    .await
    .expect("a connect answers within 20 s")
}

/// Publishes one message to a fresh exchange with a bound quorum queue and expects its
/// confirm.
async fn publish_confirmed(rabbit: &Rabbit) {
    let topic = "sp-tls-orders";
    rabbit
        .ensure_destination(topic, &["c1".to_string()])
        .await
        .expect("declare over TLS");
    let out = rabbit
        .send_batch(
            vec![request(&destination(topic), b"{\"tls\":true}")],
            Instant::now() + Duration::from_secs(30),
        )
        .await;
    assert!(
        matches!(out.as_slice(), [SendResult::Receipt(_)]),
        "a confirm over amqps://, got {out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_the_right_ca_confirms_a_wrong_ca_or_password_is_refused() {
    let dir = TempDir::new("pki-server");
    let p = pki(&dir);
    let Some(n) = node("srv", &p, false) else {
        return;
    };
    let right = RabbitOptions {
        tls_ca_file: Some(p.ca.clone()),
        password_file: Some(p.password.clone()),
        ..Default::default()
    };
    let rabbit = connect(&n.url(), &right)
        .await
        .expect("amqps with the right CA");
    publish_confirmed(&rabbit).await;

    // Someone else's CA: refused, and the message says which option to change.
    let wrong_ca = RabbitOptions {
        tls_ca_file: Some(p.other_ca.clone()),
        ..right.clone()
    };
    let e = connect(&n.url(), &wrong_ca)
        .await
        .err()
        .expect("a wrong CA is refused")
        .to_string();
    assert!(
        e.contains("rabbitmq.security.tls_ca_file") && e.contains("not signed by"),
        "{e}"
    );
    eprintln!("wrong CA: {e}");

    // A wrong password from its file: refused, and the secret is not in the message.
    let wrong_pw = RabbitOptions {
        password_file: Some(p.wrong_password.clone()),
        ..right.clone()
    };
    let e = connect(&n.url(), &wrong_pw)
        .await
        .err()
        .expect("a wrong password is refused")
        .to_string();
    assert!(!e.contains("not-the-password-7731"), "{e}");
    assert!(e.contains("rabbitmq.security.password_file"), "{e}");
    eprintln!("wrong password: {e}");

    // Plaintext to the TLS port with TLS files set is refused before connecting.
    let plain = format!("amqp://guest@localhost:{}/%2f", n.tls_port);
    let e = connect(&plain, &right).await.err().unwrap().to_string();
    assert!(e.contains("amqps://"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_demands_client_certificates_takes_only_a_client_with_one() {
    let dir = TempDir::new("pki-mtls");
    let p = pki(&dir);
    let Some(n) = node("mtls", &p, true) else {
        return;
    };
    let without = RabbitOptions {
        tls_ca_file: Some(p.ca.clone()),
        password_file: Some(p.password.clone()),
        ..Default::default()
    };
    let e = connect(&n.url(), &without)
        .await
        .err()
        .expect("no client certificate: refused")
        .to_string();
    assert!(e.contains("rabbitmq.security.tls_cert_file"), "{e}");
    eprintln!("without a client certificate: {e}");
    let with = RabbitOptions {
        tls_cert_file: Some(p.client_cert.clone()),
        tls_key_file: Some(p.client_key.clone()),
        ..without
    };
    let rabbit = connect(&n.url(), &with)
        .await
        .expect("with a client certificate signed by the node's CA");
    publish_confirmed(&rabbit).await;
}
