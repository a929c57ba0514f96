//! PostgreSQL over TLS with libpq's `sslmode` meanings (`sealpost::tls`, used by
//! `runtime::pg_connect`), against private clusters this test starts: `initdb` as `postgres`
//! into a temporary directory, on 127.0.0.1 and a free port, with a CA, a server certificate
//! (SAN `localhost`, `127.0.0.1`) and a client certificate made here with rcgen. Each cluster is
//! stopped (`pg_ctl stop -m immediate`) and removed by a drop guard, also when a test fails.
//! Without the PostgreSQL 15 binaries the cluster tests print "skipped" and pass.
//!
//! The connection-string tests need no server: which keys are taken out of either form, and
//! what each misconfiguration says.

#[path = "common/cluster.rs"]
mod cluster;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use cluster::{write, Cluster};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use sealpost::runtime::{pg_connect, RunError};
use sealpost::tls::{pg_tls_with_env, SslMode, TlsError};

// ---------------------------------------------------------------------------------------
// Certificates.

/// A CA and what it signed, as PEM files in a directory of the test's (owned by the test).
struct Pki {
    ca: PathBuf,
    server_cert: String,
    server_key: String,
    client_cert: PathBuf,
    client_key: PathBuf,
}

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
    common_name: &str,
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A CA, a server certificate for `localhost` and `127.0.0.1`, and a client certificate for
/// the role `certuser`, written into `dir`.
fn pki(dir: &Path) -> Pki {
    let (ca_pem, issuer) = new_ca("Sealpost test CA");
    let (server_cert, server_key) = leaf(
        &issuer,
        &["localhost", "127.0.0.1"],
        "localhost",
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert_pem, client_key_pem) = leaf(
        &issuer,
        &[],
        "certuser",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let p = Pki {
        ca: dir.join("ca.crt"),
        server_cert,
        server_key,
        client_cert: dir.join("client.crt"),
        client_key: dir.join("client.key"),
    };
    write(&p.ca, &ca_pem, 0o644);
    write(&p.client_cert, &client_cert_pem, 0o644);
    write(&p.client_key, &client_key_pem, 0o600);
    p
}

/// A directory of the test's own, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("sealpost-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------
// A private cluster.

/// Starts a cluster with `ssl` on or off (its server certificate and key from `pki`, and
/// `ssl_ca_file` = the test CA, so client certificates are asked for) and `hba` as its
/// pg_hba.conf. `None` (after printing "skipped") where PostgreSQL 15 is not installed.
fn cluster(tag: &str, ssl: bool, hba: &str, pki: &Pki) -> Option<Cluster> {
    let conf = format!(
        "ssl = {ssl}\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
         ssl_ca_file = 'ca.crt'\n",
        ssl = if ssl { "on" } else { "off" },
    );
    let ca = std::fs::read_to_string(&pki.ca).unwrap();
    Cluster::start(
        &format!("tls-{tag}"),
        &conf,
        &[
            ("server.crt", &pki.server_cert, 0o644),
            ("server.key", &pki.server_key, 0o600),
            ("ca.crt", &ca, 0o644),
            ("pg_hba.conf", hba, 0o600),
        ],
    )
}

/// The base connection string of a cluster, as key=value pairs.
fn dsn(c: &Cluster, host: &str, extra: &str) -> String {
    format!(
        "host={host} hostaddr=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=10 {extra}",
        c.port
    )
}

/// Whether the session of `pg` runs over TLS, by the server's own account.
async fn ssl_in_use(pg: &tokio_postgres::Client) -> bool {
    pg.query_one(
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

async fn refused(dsn: &str) -> String {
    match pg_connect(dsn).await {
        Ok(_) => panic!("connected, but should have been refused: {dsn}"),
        Err(e) => e.to_string(),
    }
}

const TLS_HBA: &str = "\
hostssl all certuser 127.0.0.1/32 cert
hostssl all all 127.0.0.1/32 trust
local all postgres trust
";

#[tokio::test]
async fn verified_tls_connects_and_every_wrong_certificate_is_refused_with_the_cause() {
    let files = TempDir::new("verify");
    let pki = pki(&files.0);
    let Some(c) = cluster("verify", true, TLS_HBA, &pki) else {
        return;
    };
    let ca = pki.ca.display().to_string();

    // verify-full with the right CA: connected, and the server says the session is TLS.
    let pg = pg_connect(&dsn(
        &c,
        "localhost",
        &format!("sslmode=verify-full sslrootcert={ca}"),
    ))
    .await
    .expect("verify-full with the right CA");
    let one: i32 = pg.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
    assert!(ssl_in_use(&pg).await, "pg_stat_ssl says ssl = false");
    // The same over the URL form, with the IP address the certificate also names.
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}&connect_timeout=10",
        c.port,
        ca.replace('/', "%2F")
    );
    let pg = pg_connect(&url).await.expect("the URL form, verify-full");
    assert!(ssl_in_use(&pg).await);

    // A CA that did not sign the server's certificate: refused, naming the CA file.
    let other = files.0.join("other-ca.crt");
    write(&other, &ca_pem_only("Someone else's CA"), 0o644);
    for mode in ["verify-full", "verify-ca", "require"] {
        let e = refused(&dsn(
            &c,
            "localhost",
            &format!("sslmode={mode} sslrootcert={}", other.display()),
        ))
        .await;
        assert!(
            e.contains(&format!(
                "the server's certificate is not signed by the CA in {} (sslrootcert)",
                other.display()
            )),
            "{mode}: {e}"
        );
        assert!(e.contains("check sslrootcert"), "{mode}: {e}");
        assert!(e.contains(&format!("sslmode={mode}")), "{mode}: {e}");
    }

    // A host name the certificate does not carry: verify-full refuses, verify-ca connects.
    let e = refused(&dsn(
        &c,
        "db.example.org",
        &format!("sslmode=verify-full sslrootcert={ca}"),
    ))
    .await;
    assert!(
        e.contains("the server's certificate does not name the host `db.example.org`"),
        "{e}"
    );
    assert!(e.contains("use sslmode=verify-ca"), "{e}");
    let pg = pg_connect(&dsn(
        &c,
        "db.example.org",
        &format!("sslmode=verify-ca sslrootcert={ca}"),
    ))
    .await
    .expect("verify-ca ignores the host name");
    assert!(ssl_in_use(&pg).await);

    // Only hostaddr: TLS against the address, which the certificate names.
    let pg = pg_connect(&format!(
        "hostaddr=127.0.0.1 port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert={ca}",
        c.port
    ))
    .await
    .expect("verify-full with hostaddr alone");
    assert!(ssl_in_use(&pg).await);

    // require without a CA: TLS, no certificate check; prefer takes TLS when offered.
    for mode in ["require", "prefer"] {
        let pg = pg_connect(&dsn(&c, "db.example.org", &format!("sslmode={mode}")))
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert!(ssl_in_use(&pg).await, "{mode}");
    }
    // disable: the server's pg_hba has only hostssl lines, so plaintext is turned away.
    match pg_connect(&dsn(&c, "localhost", "sslmode=disable")).await {
        Err(RunError::Connect { source, .. }) => {
            let m = source.as_db_error().map(|d| d.message()).unwrap_or("");
            assert!(m.contains("no encryption"), "{source:?}");
        }
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("plaintext connected to a hostssl-only server"),
    }

    // A client certificate for `cert` authentication: accepted with the certificate,
    // refused without it.
    let admin = pg_connect(&dsn(&c, "localhost", "sslmode=require"))
        .await
        .unwrap();
    admin
        .batch_execute("CREATE ROLE certuser LOGIN")
        .await
        .unwrap();
    let cert_dsn = |extra: &str| {
        format!(
            "host=localhost hostaddr=127.0.0.1 port={} user=certuser dbname=postgres sslmode=verify-full sslrootcert={ca} {extra}",
            c.port
        )
    };
    let pg = pg_connect(&cert_dsn(&format!(
        "sslcert={} sslkey={}",
        pki.client_cert.display(),
        pki.client_key.display()
    )))
    .await
    .expect("the client certificate is accepted");
    let who: String = pg
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "certuser");
    match pg_connect(&cert_dsn("")).await {
        Err(RunError::Connect { source, .. }) => {
            let m = source.as_db_error().map(|d| d.message()).unwrap_or("");
            assert!(
                m.contains("requires a valid client certificate"),
                "{source:?}"
            );
        }
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("cert authentication without a certificate"),
    }
    // The environment variables name the same files when the string does not.
    let t = pg_tls_with_env(&cert_dsn(""), |k| match k {
        "PGSSLCERT" => Some(pki.client_cert.display().to_string()),
        "PGSSLKEY" => Some(pki.client_key.display().to_string()),
        _ => None,
    })
    .unwrap();
    let (pg, conn) = t.config.connect(t.connector.clone()).await.unwrap();
    tokio::spawn(conn);
    let who: String = pg
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "certuser");
}

fn ca_pem_only(name: &str) -> String {
    new_ca(name).0
}

#[tokio::test]
async fn require_never_falls_back_to_plaintext_while_prefer_does() {
    let files = TempDir::new("plain");
    let pki = pki(&files.0);
    let hba = "host all all 127.0.0.1/32 trust\nlocal all postgres trust\n";
    let Some(c) = cluster("plain", false, hba, &pki) else {
        return;
    };
    let ca = pki.ca.display().to_string();
    for extra in [
        "sslmode=require".to_string(),
        format!("sslmode=verify-ca sslrootcert={ca}"),
        format!("sslmode=verify-full sslrootcert={ca}"),
    ] {
        let e = refused(&dsn(&c, "localhost", &extra)).await;
        assert!(
            e.contains(&format!(
                "the PostgreSQL server at localhost:{} does not accept TLS connections",
                c.port
            )),
            "{extra}: {e}"
        );
        assert!(e.contains("never falls back to plaintext"), "{extra}: {e}");
    }
    for mode in ["prefer", "disable"] {
        let pg = pg_connect(&dsn(&c, "localhost", &format!("sslmode={mode}")))
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert!(
            !ssl_in_use(&pg).await,
            "{mode}: TLS on a server with ssl=off?"
        );
    }
    // No sslmode at all is libpq's default, prefer.
    let pg = pg_connect(&dsn(&c, "localhost", "")).await.unwrap();
    assert!(!ssl_in_use(&pg).await);
}

// ---------------------------------------------------------------------------------------
// The connection string, without a server.

fn no_env(_: &str) -> Option<String> {
    None
}

fn setup_error(dsn: &str) -> String {
    match pg_tls_with_env(dsn, no_env) {
        Ok(t) => panic!("accepted: {t:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn our_keys_are_taken_out_of_both_forms_and_the_rest_reaches_tokio_postgres() {
    let files = TempDir::new("dsn");
    let pki = pki(&files.0);
    let ca = pki.ca.display().to_string();
    // key=value, with quoting, escapes and spaces around `=`.
    let t = pg_tls_with_env(
        &format!(
            "host=db.example.org port = 6543 user=app password='p w\\'d' sslmode = verify-ca sslrootcert='{ca}' dbname=orders application_name=a\\ b"
        ),
        no_env,
    )
    .unwrap();
    assert_eq!(t.mode, SslMode::VerifyCa);
    assert_eq!(
        t.config.get_ssl_mode(),
        tokio_postgres::config::SslMode::Require
    );
    assert_eq!(t.config.get_password(), Some(&b"p w'd"[..]));
    assert_eq!(t.config.get_dbname(), Some("orders"));
    assert_eq!(t.config.get_application_name(), Some("a b"));
    assert_eq!(t.config.get_ports(), &[6543]);
    assert_eq!(t.servers(), "db.example.org:6543");
    // The URL form: percent-encoded values, our keys anywhere among the others.
    let t = pg_tls_with_env(
        &format!(
            "postgresql://app:s%40cret@db.example.org:6543/orders?application_name=x&sslrootcert={}&sslmode=verify-full&connect_timeout=5",
            ca.replace('/', "%2F")
        ),
        no_env,
    )
    .unwrap();
    assert_eq!(t.mode, SslMode::VerifyFull);
    assert_eq!(t.config.get_password(), Some(&b"s@cret"[..]));
    assert_eq!(t.config.get_application_name(), Some("x"));
    assert_eq!(
        t.config.get_connect_timeout(),
        Some(&std::time::Duration::from_secs(5))
    );
    // Only our keys: the URL keeps no `?`.
    let t = pg_tls_with_env("postgres://app@h/db?sslmode=require", no_env).unwrap();
    assert_eq!(t.mode, SslMode::Require);
    // Nothing said: libpq's default, prefer; PGSSLMODE when the string says nothing.
    let t = pg_tls_with_env("host=h user=u", no_env).unwrap();
    assert_eq!(
        (t.mode, t.config.get_ssl_mode()),
        (SslMode::Prefer, tokio_postgres::config::SslMode::Prefer)
    );
    let env = |k: &str| (k == "PGSSLMODE").then(|| "disable".to_string());
    let t = pg_tls_with_env("host=h user=u", env).unwrap();
    assert_eq!(
        t.config.get_ssl_mode(),
        tokio_postgres::config::SslMode::Disable
    );
    let t = pg_tls_with_env("host=h user=u sslmode=require", env).unwrap();
    assert_eq!(t.mode, SslMode::Require, "the string wins over PGSSLMODE");
    // Unix-domain sockets carry no TLS, whatever the mode (libpq ignores it there too).
    let t = pg_tls_with_env(
        &format!("host=/var/run/postgresql sslmode=verify-full sslrootcert={ca}"),
        no_env,
    )
    .unwrap();
    assert_eq!(
        (t.mode, t.config.get_ssl_mode()),
        (
            SslMode::VerifyFull,
            tokio_postgres::config::SslMode::Disable
        )
    );
    // Only hostaddr: the address is the host name TLS checks.
    let t = pg_tls_with_env("hostaddr=10.1.2.3 port=5433 sslmode=require", no_env).unwrap();
    assert_eq!(t.servers(), "10.1.2.3:5433");
    // Disabled: no file is read, so a missing one does not matter.
    let t = pg_tls_with_env("host=h sslmode=disable sslrootcert=/nonexistent", no_env).unwrap();
    assert_eq!(t.mode, SslMode::Disable);
}

#[test]
fn each_misconfiguration_names_the_cause_and_what_to_do() {
    let files = TempDir::new("errors");
    let pki = pki(&files.0);
    let ca = pki.ca.display().to_string();
    let e = setup_error("host=h sslmode=verify-full");
    assert!(
        e.contains("sslmode=verify-full checks the server's certificate and needs the CA"),
        "{e}"
    );
    assert!(e.contains("set sslrootcert="), "{e}");
    let e = setup_error("host=h sslmode=verify_full");
    assert!(e.contains("sslmode `verify_full`"), "{e}");
    assert!(e.contains("verify-full"), "{e}");
    let e = setup_error("host=h sslmode=allow");
    assert!(e.contains("sslmode=allow is not supported"), "{e}");
    let e = setup_error("host=h sslmode=require sslrootcert=system");
    assert!(e.contains("use sslmode=verify-full"), "{e}");
    let e = setup_error("host=h sslmode=verify-ca sslrootcert=/nonexistent/ca.pem");
    assert!(
        e.contains("cannot read the sslrootcert file /nonexistent/ca.pem"),
        "{e}"
    );
    let e = setup_error(&format!(
        "host=h sslmode=verify-ca sslrootcert={}",
        pki.client_key.display()
    ));
    assert!(e.contains("holds no PEM certificate"), "{e}");
    let e = setup_error(&format!(
        "host=h sslmode=require sslcert={}",
        pki.client_cert.display()
    ));
    assert!(e.contains("sslcert is set but sslkey is not"), "{e}");
    let loose = files.0.join("loose.key");
    std::fs::copy(&pki.client_key, &loose).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = setup_error(&format!(
        "host=h sslmode=require sslcert={} sslkey={}",
        pki.client_cert.display(),
        loose.display()
    ));
    assert!(e.contains("may be read by other users (mode 644)"), "{e}");
    assert!(e.contains("chmod 600"), "{e}");
    // A key of another certificate.
    let (_, other_issuer) = new_ca("x");
    let (_, other_key) = leaf(&other_issuer, &[], "x", ExtendedKeyUsagePurpose::ClientAuth);
    let wrong = files.0.join("wrong.key");
    write(&wrong, &other_key, 0o600);
    let e = setup_error(&format!(
        "host=h sslmode=require sslrootcert={ca} sslcert={} sslkey={}",
        pki.client_cert.display(),
        wrong.display()
    ));
    assert!(
        e.contains("check that the key belongs to the certificate"),
        "{e}"
    );
    // tokio-postgres's own parse errors, without the password.
    let e = setup_error("host=h password=hunter2 no_such_key=1");
    assert!(e.contains("no_such_key") && !e.contains("hunter2"), "{e}");
    assert!(matches!(
        pg_tls_with_env("host=h sslmode=nope", no_env),
        Err(TlsError::Mode { .. })
    ));
}
