//! TLS and SASL of the Kafka adapter, with no Kafka broker (tansu, the test broker here, has
//! no TLS listener): librdkafka is built with OpenSSL, so a client with
//! `security.protocol=SASL_SSL`, `sasl.mechanism=SCRAM-SHA-512` and `ssl.ca.location` can be
//! created (without the `ssl` feature librdkafka refuses `SASL_SSL`); its TLS handshake
//! against a private TLS listener made here (rustls, certificates from rcgen) succeeds with
//! the right CA and fails with a certificate verification error, named in
//! [`Kafka::connect`]'s error, with a wrong one; the SASL password read from
//! `sasl_password_file` appears in no error and no `Debug` output.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use sealpost_kafka::rdkafka::config::ClientConfig;
use sealpost_kafka::rdkafka::error::KafkaError;
use sealpost_kafka::rdkafka::producer::BaseProducer;
use sealpost_kafka::rdkafka::types::RDKafkaConfRes;
use sealpost_kafka::{create_client, scrub, with_secrets, Kafka, KafkaConfig};
use tokio::io::AsyncReadExt;
use tokio_rustls::rustls;

const SECRET: &str = "scram-secret-4711";

fn new_ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

/// A directory of the test's own, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("sealpost-kafka-{tag}-{}", std::process::id()));
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

/// The test CA and a second CA, as files, and the server's certificate and key.
struct Pki {
    ca: PathBuf,
    other_ca: PathBuf,
    server: rustls::ServerConfig,
}

fn pki(dir: &TempDir) -> Pki {
    let (ca_pem, issuer) = new_ca("Sealpost test CA");
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .unwrap();
    Pki {
        ca: dir.file("ca.crt", &ca_pem),
        other_ca: dir.file("other-ca.crt", &new_ca("Someone else's CA").0),
        server,
    }
}

/// A TLS listener on a free port that reports each handshake's outcome and then holds the
/// connection open without answering (it is not a Kafka broker).
async fn tls_listener(
    server: rustls::ServerConfig,
) -> (
    u16,
    tokio::sync::mpsc::UnboundedReceiver<Result<(), String>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                match acceptor.accept(tcp).await {
                    Ok(mut tls) => {
                        let _ = tx.send(Ok(()));
                        let mut buf = [0u8; 4096];
                        while matches!(tls.read(&mut buf).await, Ok(n) if n > 0) {}
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                    }
                }
            });
        }
    });
    (port, rx)
}

fn sasl_ssl(ca: &std::path::Path) -> Vec<(String, String)> {
    [
        ("security.protocol", "SASL_SSL"),
        ("sasl.mechanism", "SCRAM-SHA-512"),
        ("sasl.username", "sealpost"),
        ("ssl.ca.location", ca.to_str().unwrap()),
        // One attempt per broker is enough here.
        ("reconnect.backoff.ms", "500"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

#[test]
fn a_sasl_ssl_scram_client_with_a_ca_is_created() {
    let dir = TempDir::new("create");
    let p = pki(&dir);
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", "127.0.0.1:1");
    let pw = dir.file("password", &format!("{SECRET}\n"));
    for (k, v) in with_secrets(&sasl_ssl(&p.ca), Some(&pw)).unwrap() {
        c.set(k, v);
    }
    let made: Result<BaseProducer, KafkaError> = create_client(&c);
    assert!(
        made.is_ok(),
        "librdkafka must be built with OpenSSL (rdkafka feature `ssl`): {}",
        made.err().unwrap()
    );
    // And the other TLS protocol, plain SSL with a client certificate path unset.
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", "127.0.0.1:1")
        .set("security.protocol", "SSL")
        .set("ssl.ca.location", p.ca.to_str().unwrap());
    create_client::<BaseProducer>(&c).expect("security.protocol=SSL");
}

#[test]
fn a_secret_is_never_shown() {
    let dir = TempDir::new("secrets");
    // rdkafka's configuration error carries the refused value; scrubbed for a secret key.
    let e = scrub(KafkaError::ClientConfig(
        RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
        "refused".into(),
        "sasl.password".into(),
        SECRET.into(),
    ));
    assert!(!e.to_string().contains(SECRET), "{e}");
    let e = scrub(KafkaError::ClientConfig(
        RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
        "refused".into(),
        "linger.ms".into(),
        "abc".into(),
    ));
    assert!(e.to_string().contains("abc"), "other values stay: {e}");
    // Debug of the configuration.
    let mut cfg = KafkaConfig::new("127.0.0.1:1", "k", Duration::from_secs(5));
    cfg.client_properties = vec![
        ("sasl.password".into(), SECRET.into()),
        ("ssl.key.password".into(), SECRET.into()),
        ("security.protocol".into(), "SASL_SSL".into()),
    ];
    let shown = format!("{cfg:?}");
    assert!(
        !shown.contains(SECRET) && shown.contains("SASL_SSL"),
        "{shown}"
    );
    // The password file: errors name the file, never its contents.
    let missing = dir.0.join("no-such-password");
    let e = with_secrets(&[], Some(&missing)).unwrap_err().to_string();
    assert!(
        e.contains("kafka.sasl_password_file") && e.contains("no-such-password"),
        "{e}"
    );
    let empty = dir.file("empty", "\n");
    let e = with_secrets(&[], Some(&empty)).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    let pw = dir.file("password", &format!("{SECRET}\r\n"));
    let e = with_secrets(&cfg.client_properties, Some(&pw))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sasl.password") && !e.contains(SECRET), "{e}");
    let props = with_secrets(&[], Some(&pw)).unwrap();
    assert_eq!(props, vec![("sasl.password".into(), SECRET.into())]);
}

async fn connect(port: u16, ca: &std::path::Path, password: &std::path::Path) -> String {
    let mut cfg = KafkaConfig::new(&format!("localhost:{port}"), "k", Duration::from_secs(5));
    cfg.client_properties = sasl_ssl(ca);
    cfg.sasl_password_file = Some(password.to_path_buf());
    match Kafka::connect(cfg).await {
        Ok(_) => panic!("the listener is not a Kafka broker"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_fails_the_handshake_with_a_certificate_verification_error() {
    let dir = TempDir::new("wrong-ca");
    let p = pki(&dir);
    let pw = dir.file("password", SECRET);
    let (port, mut seen) = tls_listener(p.server.clone()).await;
    let e = connect(port, &p.other_ca, &pw).await;
    eprintln!("wrong CA: {e}");
    assert!(e.contains("certificate verify failed"), "{e}");
    assert!(!e.contains(SECRET), "{e}");
    let server_side = tokio::time::timeout(Duration::from_secs(5), seen.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        server_side.is_err(),
        "no handshake completed: {server_side:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_ca_completes_the_handshake() {
    let dir = TempDir::new("right-ca");
    let p = pki(&dir);
    let pw = dir.file("password", SECRET);
    let (port, mut seen) = tls_listener(p.server.clone()).await;
    let e = connect(port, &p.ca, &pw).await;
    eprintln!("right CA (no Kafka behind the listener): {e}");
    assert!(!e.contains("certificate verify failed"), "{e}");
    assert!(!e.contains(SECRET), "{e}");
    let server_side = tokio::time::timeout(Duration::from_secs(5), seen.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        server_side,
        Ok(()),
        "librdkafka completed the TLS handshake"
    );
}
