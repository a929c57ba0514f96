//! TLS and credentials of the NATS adapter ([`NatsOptions`], [`Nats::connect_with`]) against
//! private `nats-server`s on free ports (JetStream on, `-js -sd <tmp>`), with a CA and
//! certificates made here with rcgen: a connect with the right CA publishes and gets its
//! JetStream acknowledgement, a wrong CA and a missing client certificate are refused with a
//! message naming the option to check, `require_tls` never talks plaintext, and a user and
//! password or a token read from files authenticate. Each server is killed and its directory
//! removed by a drop guard, also when a test fails. Without `/usr/sbin/nats-server` the server
//! tests print "skipped" and pass.

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
use sealpost_nats::{Nats, NatsError, NatsOptions};

const BIN: &str = "/usr/sbin/nats-server";
const CLUSTER: &str = "nats-tls";

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
        let d = std::env::temp_dir().join(format!("sealpost-nats-{tag}-{}", std::process::id()));
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
/// and a second CA that signed neither, as files.
struct Pki {
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
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
    }
}

/// A private nats-server; dropping it kills it and removes its directory.
struct Server {
    child: Child,
    /// Configuration and JetStream store; removed after the server is killed.
    _dir: TempDir,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts nats-server with JetStream and `conf` (its `listen` line added here). `None`
/// (after printing "skipped") where nats-server is not installed.
fn server(tag: &str, conf: &str) -> Option<Server> {
    if !Path::new(BIN).exists() {
        eprintln!("skipped: no {BIN}");
        return None;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = TempDir::new(&format!("server-{tag}"));
    let file = dir.file("server.conf", &format!("listen: 127.0.0.1:{port}\n{conf}"));
    let child = Command::new(BIN)
        .arg("-c")
        .arg(&file)
        .arg("-js")
        .arg("-sd")
        .arg(dir.0.join("js"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn nats-server");
    let s = Server {
        child,
        _dir: dir,
        url: format!("nats://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "private nats-server never listened"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(s)
}

/// A `tls` block with the test's server certificate; `verify: true` asks every client for a
/// certificate signed by the test CA.
fn tls_block(p: &Pki, verify: bool) -> String {
    format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: {verify}\n  timeout: 5\n}}\n",
        p.server_cert.display(),
        p.server_key.display(),
        p.ca.display()
    )
}

fn destination(topic: &str) -> Destination {
    Destination {
        cluster: CLUSTER.into(),
        topic: topic.into(),
        routing_key: "k".into(),
        partition_algorithm: PartitionAlgorithm::None,
        route_policy_generation: 1,
        serializer: "json.v1".into(),
        durability: "file".into(),
        required_ack: "stream".into(),
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

async fn connect(url: &str, options: &NatsOptions) -> Result<Nats, NatsError> {
    tokio::time::timeout(
        Duration::from_secs(30),
        Nats::connect_with(url, CLUSTER, Duration::from_secs(5), options),
    )
    .await
    .expect("connect_with did not return within 30 s")
}

/// One event through `send_batch`: a JetStream acknowledgement.
async fn publishes(nats: &Nats, topic: &str) {
    nats.ensure_stream(topic).await.expect("stream");
    let d = destination(topic);
    let r = request(&d, b"{\"tls\":true}");
    let deadline = Instant::now() + Duration::from_secs(30);
    match nats.send_batch(vec![r.clone()], deadline).await.remove(0) {
        SendResult::Receipt(rec) => {
            assert_eq!((rec.event_id, rec.stream.as_str()), (r.event_id, topic));
            assert!(rec.sequence > 0 && !rec.broker_duplicate);
        }
        other => panic!("no receipt: {other:?}"),
    }
}

fn refused(r: Result<Nats, NatsError>) -> String {
    match r {
        Ok(_) => panic!("connected, but should have been refused"),
        Err(e @ NatsError::Connect { .. }) => e.to_string(),
        Err(other) => panic!("refused, but not at connect: {other}"),
    }
}

#[tokio::test]
async fn the_right_ca_publishes_and_a_wrong_one_is_refused() {
    let files = TempDir::new("ca");
    let p = pki(&files);
    let Some(s) = server("ca", &tls_block(&p, false)) else {
        return;
    };
    let right = NatsOptions {
        tls_ca_file: Some(p.ca.clone()),
        require_tls: true,
        ..Default::default()
    };
    let nats = connect(&s.url, &right).await.expect("the right CA");
    assert!(nats.client.server_info().tls_required);
    publishes(&nats, "TLSCA").await;

    let wrong = NatsOptions {
        tls_ca_file: Some(p.other_ca.clone()),
        ..Default::default()
    };
    let e = refused(connect(&s.url, &wrong).await);
    assert!(
        e.contains(&format!(
            "the server's certificate is not signed by the CA in {} (nats.security.tls_ca_file)",
            p.other_ca.display()
        )),
        "{e}"
    );
    assert!(e.contains("set nats.security.tls_ca_file"), "{e}");
    // No CA of ours: the system's roots do not know the test CA either.
    let e = refused(connect(&s.url, &NatsOptions::default()).await);
    assert!(e.contains("not signed by a CA this machine trusts"), "{e}");
}

#[tokio::test]
async fn require_tls_refuses_a_plaintext_server() {
    let Some(s) = server("plain", "") else {
        return;
    };
    let nats = connect(&s.url, &NatsOptions::default())
        .await
        .expect("plaintext without require_tls");
    publishes(&nats, "TLSPLAIN").await;
    let e = refused(
        connect(
            &s.url,
            &NatsOptions {
                require_tls: true,
                ..Default::default()
            },
        )
        .await,
    );
    assert!(
        e.contains("the server did not answer in TLS") && e.contains("never falls back"),
        "{e}"
    );
}

#[tokio::test]
async fn a_server_that_verifies_clients_wants_our_certificate() {
    let files = TempDir::new("verify");
    let p = pki(&files);
    let Some(s) = server("verify", &tls_block(&p, true)) else {
        return;
    };
    let without = NatsOptions {
        tls_ca_file: Some(p.ca.clone()),
        ..Default::default()
    };
    let e = refused(connect(&s.url, &without).await);
    assert!(e.contains("nats.security.tls_cert_file"), "{e}");
    let with = NatsOptions {
        tls_cert_file: Some(p.client_cert.clone()),
        tls_key_file: Some(p.client_key.clone()),
        ..without
    };
    let nats = connect(&s.url, &with)
        .await
        .expect("with the client certificate");
    publishes(&nats, "TLSVERIFY").await;
}

#[tokio::test]
async fn user_password_and_token_come_from_files() {
    let files = TempDir::new("auth");
    let Some(s) = server(
        "userpass",
        "authorization {\n  users: [ { user: sealpost, password: \"pa ss\" } ]\n}\n",
    ) else {
        return;
    };
    let good = NatsOptions {
        user: Some("sealpost".into()),
        password_file: Some(files.file("password", "pa ss\n")),
        ..Default::default()
    };
    publishes(
        &connect(&s.url, &good).await.expect("user and password"),
        "TLSUSER",
    )
    .await;
    let bad = NatsOptions {
        password_file: Some(files.file("wrong", "nope\n")),
        ..good
    };
    let e = refused(connect(&s.url, &bad).await);
    assert!(e.contains("the server refused our credentials"), "{e}");

    let Some(s) = server("token", "authorization {\n  token: \"t0ken\"\n}\n") else {
        return;
    };
    let token = NatsOptions {
        token_file: Some(files.file("token", "t0ken\n")),
        ..Default::default()
    };
    publishes(&connect(&s.url, &token).await.expect("token"), "TLSTOKEN").await;
}

#[tokio::test]
async fn unusable_options_are_named_before_connecting() {
    let files = TempDir::new("options");
    let p = pki(&files);
    // No server at all: each of these fails before a connection is tried.
    let url = "nats://127.0.0.1:1";
    let cases: Vec<(NatsOptions, &str)> = vec![
        (
            NatsOptions {
                tls_ca_file: Some(files.0.join("missing.crt")),
                ..Default::default()
            },
            "cannot read the nats.security.tls_ca_file file",
        ),
        (
            NatsOptions {
                tls_ca_file: Some(p.client_key.clone()),
                ..Default::default()
            },
            "holds no PEM certificate",
        ),
        (
            NatsOptions {
                tls_cert_file: Some(p.client_cert.clone()),
                ..Default::default()
            },
            "nats.security.tls_cert_file is set but its key is not",
        ),
        (
            NatsOptions {
                token_file: Some(files.file("token", "t\n")),
                user: Some("u".into()),
                password_file: Some(files.file("pw", "p\n")),
                ..Default::default()
            },
            "more than one way to authenticate",
        ),
        (
            NatsOptions {
                user: Some("u".into()),
                ..Default::default()
            },
            "nats.security.user is set but no password file",
        ),
        (
            NatsOptions {
                token_file: Some(files.file("empty", "\n")),
                ..Default::default()
            },
            "is empty",
        ),
        (
            NatsOptions {
                nkey_seed_file: Some(files.file("seed", "not a seed\n")),
                ..Default::default()
            },
            "does not hold an nkey user seed",
        ),
        (
            NatsOptions {
                creds_file: Some(files.file("creds", "garbage\n")),
                ..Default::default()
            },
            "expected a .creds file",
        ),
    ];
    for (options, expected) in cases {
        let e = match connect(url, &options).await {
            Ok(_) => panic!("connected with {options:?}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(expected), "{options:?}: {e}");
        assert!(!e.contains("cannot connect"), "tried to connect: {e}");
    }
}
