//! TLS to PostgreSQL, with libpq's meanings, so that a connection string that works with
//! `psql` works here and a managed database that demands TLS is reachable.
//!
//! tokio-postgres parses the connection string (key=value pairs or a `postgres://` URL) but
//! knows only `sslmode=disable|prefer|require` and none of the certificate options, so
//! [`pg_tls`] first takes out the keys it reads itself, as libpq spells them, in either form:
//!
//! | key | environment | meaning |
//! |---|---|---|
//! | `sslmode` | `PGSSLMODE` | see [`SslMode`]; default `prefer` (`verify-full` with `sslrootcert=system`) |
//! | `sslrootcert` | `PGSSLROOTCERT` | PEM file of the CA(s) that sign the server's certificate, or `system` for the system's trusted roots |
//! | `sslcert`, `sslkey` | `PGSSLCERT`, `PGSSLKEY` | PEM client certificate (chain) and its private key, for `cert` authentication |
//!
//! A key in the connection string wins over its environment variable. Unlike libpq, nothing is
//! read from `~/.postgresql/`: name the files. As in libpq, `sslmode` does not apply to
//! Unix-domain sockets, and with `hostaddr` but no `host` the address is the name checked. A named CA is used in every TLS mode (libpq
//! does so for `require`): the server's chain must end at it; `verify-full` also checks the
//! host name. The TLS stack is rustls with the ring provider, TLS 1.2 or 1.3, offering the
//! ALPN protocol `postgresql` like libpq 17.
//!
//! A certificate the check refuses fails the handshake with a message that names the cause and
//! the option to change ([`TlsError::Handshake`]); [`PgTls::explain`] turns a failed connect
//! into that error. No message here carries the connection string or its password.

use std::error::Error as StdError;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use percent_encoding::percent_decode_str;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, verify_server_name};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{
    AlertDescription, CertificateError, DigitallySignedStruct, OtherError, RootCertStore,
    SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode`, the five values Sealpost implements (`allow` is refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS if the server offers it, else plaintext. No protection against an active attacker:
    /// whoever sits between client and server can answer "no TLS here" and read everything.
    Prefer,
    /// TLS or no connection; the certificate is not checked (unless `sslrootcert` names a
    /// CA), so it protects against eavesdropping, not against an impostor.
    Require,
    /// TLS with the server's certificate chain checked against `sslrootcert`; any host name.
    VerifyCa,
    /// TLS with the chain checked and the certificate naming the host connected to.
    VerifyFull,
}

impl SslMode {
    /// The mode libpq spells `s`, if Sealpost implements it.
    pub fn parse(s: &str) -> Option<SslMode> {
        Some(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// libpq's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether the mode checks the server's certificate, and so needs a CA.
    fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a PostgreSQL connection string could not be turned into a TLS setup, or why the TLS
/// part of a connect failed. None of them prints the connection string.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The connection string (without the keys Sealpost reads) does not parse.
    #[error("the PostgreSQL connection string does not parse: {detail}; check DATABASE_URL (key=value pairs or a postgres:// URL; besides tokio-postgres's keys Sealpost reads sslmode, sslrootcert, sslcert and sslkey)")]
    Dsn {
        /// tokio-postgres's parse error and its cause (they name the key, not the value).
        detail: String,
        /// tokio-postgres's parse error.
        source: tokio_postgres::Error,
    },
    /// An `sslmode` that is not one of libpq's.
    #[error("sslmode `{value}` ({from}) is not one of disable, prefer, require, verify-ca, verify-full; fix the value")]
    Mode {
        /// The value given.
        value: String,
        /// Where it came from.
        from: &'static str,
    },
    /// A libpq setting Sealpost does not implement.
    #[error("{what} is not supported; {instead}")]
    Unsupported {
        /// The setting.
        what: String,
        /// What to use instead.
        instead: &'static str,
    },
    /// `sslrootcert=system` with a mode weaker than `verify-full` (libpq refuses it too).
    #[error("sslmode={mode} may not be used with sslrootcert=system: the system's roots vouch for a name, so only verify-full checks anything; use sslmode=verify-full")]
    WeakModeWithSystemRoots {
        /// The mode given.
        mode: SslMode,
    },
    /// A verifying mode without a CA to verify against.
    #[error("sslmode={mode} checks the server's certificate and needs the CA that signed it: set sslrootcert=/path/to/ca.pem in the connection string (or PGSSLROOTCERT), sslrootcert=system for the system's trusted roots, or use sslmode=require to encrypt without checking")]
    NoRootCert {
        /// The mode given.
        mode: SslMode,
    },
    /// A TLS file could not be read.
    #[error("cannot read the {key} file {}: {source}; check the path and that this process may read it", path.display())]
    Read {
        /// The option naming the file (`sslrootcert`, `PGSSLKEY`, ...).
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// A TLS file holds nothing usable.
    #[error("the {key} file {}: {detail}", path.display())]
    Pem {
        /// The option naming the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong and what is expected.
        detail: String,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error("{given} is set but {missing} is not: a client certificate needs both the certificate (sslcert or PGSSLCERT) and its key (sslkey or PGSSLKEY); set both or neither")]
    ClientPair {
        /// The one given.
        given: &'static str,
        /// The one missing.
        missing: &'static str,
    },
    /// A private key that other users may read (libpq refuses such a key too).
    #[error("the {key} file {} may be read by other users (mode {mode:o}); chmod 600 it (0640 if root owns it)", path.display())]
    KeyPermissions {
        /// The option naming the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// rustls refused the client certificate and key (usually: the key is not the
    /// certificate's).
    #[error("the client certificate {} and key {} cannot be used: {source}; check that the key belongs to the certificate", cert.display(), key.display())]
    ClientAuth {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason.
        source: rustls::Error,
    },
    /// The TLS configuration could not be built (the crypto provider offers no protocol
    /// version; not expected with ring).
    #[error("cannot set up TLS: {0}; this is a bug in Sealpost's TLS setup, please report it")]
    Setup(rustls::Error),
    /// The server answered that it does not do TLS, and the mode forbids plaintext.
    #[error("the PostgreSQL server at {server} does not accept TLS connections, and sslmode={mode} never falls back to plaintext; turn on ssl in the server's postgresql.conf, or use sslmode=prefer if plaintext on this network is acceptable")]
    ServerWithoutTls {
        /// `host:port` of the server(s) tried.
        server: String,
        /// The mode.
        mode: SslMode,
    },
    /// The TLS handshake failed: the server's certificate was refused, or the server refused
    /// ours.
    #[error("TLS with the PostgreSQL server at {server} (sslmode={mode}) failed: {detail}")]
    Handshake {
        /// `host:port` of the server(s) tried.
        server: String,
        /// The mode.
        mode: SslMode,
        /// The cause and what to do.
        detail: String,
    },
}

/// A connection string made ready for tokio-postgres: its parsed configuration, with
/// tokio-postgres's own `sslmode` set from [`PgTls::mode`], and the rustls connector that
/// checks the server the way the mode says.
#[derive(Clone)]
pub struct PgTls {
    /// The parsed connection string (host, port, user, password, ...).
    pub config: tokio_postgres::Config,
    /// The TLS connector to pass to [`tokio_postgres::Config::connect`].
    pub connector: MakeRustlsConnect,
    /// The mode in force.
    pub mode: SslMode,
    /// The client certificate presented, if any (for messages).
    client_cert: Option<PathBuf>,
}

impl fmt::Debug for PgTls {
    /// Leaves the configuration out: it holds the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTls")
            .field("servers", &self.servers())
            .field("mode", &self.mode)
            .field("client_cert", &self.client_cert)
            .finish_non_exhaustive()
    }
}

/// The TLS setup of a PostgreSQL connection string (either form), with `PGSSLMODE`,
/// `PGSSLROOTCERT`, `PGSSLCERT` and `PGSSLKEY` from the environment where the string has no
/// such key. Reads the certificate files now, so a wrong path is an error here, not at
/// connect time.
pub fn pg_tls(dsn: &str) -> Result<PgTls, TlsError> {
    pg_tls_with_env(dsn, |name| std::env::var(name).ok())
}

/// [`pg_tls`] with the environment given as a lookup (for tests and for services that keep
/// their settings elsewhere).
pub fn pg_tls_with_env(dsn: &str, env: impl Fn(&str) -> Option<String>) -> Result<PgTls, TlsError> {
    let (rest, keys) = split_dsn(dsn);
    let mut config: tokio_postgres::Config =
        rest.parse()
            .map_err(|source: tokio_postgres::Error| TlsError::Dsn {
                detail: with_causes(&source),
                source,
            })?;
    let env = |name: &str| env(name).filter(|v| !v.is_empty());

    let root = pick(
        keys.sslrootcert,
        "sslrootcert",
        env("PGSSLROOTCERT"),
        "PGSSLROOTCERT",
    );
    let system_roots = root.as_ref().is_some_and(|(v, _)| v == "system");
    let (mode_text, mode_from) = match (keys.sslmode, env("PGSSLMODE")) {
        (Some(m), _) => (m, "sslmode in the connection string"),
        (None, Some(m)) => (m, "PGSSLMODE"),
        (None, None) if system_roots => ("verify-full".to_string(), "the default"),
        (None, None) => ("prefer".to_string(), "the default"),
    };
    let mode = match SslMode::parse(&mode_text) {
        Some(m) => m,
        None if mode_text == "allow" => {
            return Err(TlsError::Unsupported {
                what: "sslmode=allow".into(),
                instead: "use sslmode=prefer (TLS when offered) or sslmode=disable",
            })
        }
        None => {
            return Err(TlsError::Mode {
                value: mode_text,
                from: mode_from,
            })
        }
    };
    if system_roots && mode != SslMode::VerifyFull {
        return Err(TlsError::WeakModeWithSystemRoots { mode });
    }
    // Only `hostaddr`: its address is the name TLS checks (tokio-postgres would refuse TLS
    // without a host name).
    if config.get_hosts().is_empty() {
        for addr in config.get_hostaddrs().to_vec() {
            config.host(addr.to_string());
        }
    }
    // Unix-domain sockets carry no TLS; libpq ignores sslmode there.
    #[cfg(unix)]
    let unix_only = !config.get_hosts().is_empty()
        && config
            .get_hosts()
            .iter()
            .all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)));
    #[cfg(not(unix))]
    let unix_only = false;
    config.ssl_mode(match mode {
        _ if unix_only => tokio_postgres::config::SslMode::Disable,
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    });

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let algorithms = provider.signature_verification_algorithms;
    // A disabled mode never uses the connector: read no file for it.
    let (roots, ca) = match (&root, mode) {
        (_, SslMode::Disable) | (None, _) => (None, String::new()),
        (Some((v, _)), _) if v == "system" => (
            Some(system_root_store()?),
            "the system's trusted roots (sslrootcert=system)".to_string(),
        ),
        (Some((path, key)), _) => {
            let path = PathBuf::from(path);
            let store = root_store(key, &path)?;
            (Some(store), format!("{} ({key})", path.display()))
        }
    };
    if roots.is_none() && mode.verifies() {
        return Err(TlsError::NoRootCert { mode });
    }
    let check = ServerCheck {
        roots: roots.map(Arc::new),
        ca,
        check_name: mode == SslMode::VerifyFull,
        algorithms,
    };

    let cert = pick(keys.sslcert, "sslcert", env("PGSSLCERT"), "PGSSLCERT");
    let key = pick(keys.sslkey, "sslkey", env("PGSSLKEY"), "PGSSLKEY");
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Setup)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(check));
    let (mut tls, client_cert) = match (cert, key) {
        _ if mode == SslMode::Disable => (builder.with_no_client_auth(), None),
        (None, None) => (builder.with_no_client_auth(), None),
        (Some((_, given)), None) => {
            return Err(TlsError::ClientPair {
                given,
                missing: "sslkey",
            })
        }
        (None, Some((_, given))) => {
            return Err(TlsError::ClientPair {
                given,
                missing: "sslcert",
            })
        }
        (Some((cert, cert_key)), Some((key, key_key))) => {
            let (cert, key) = (PathBuf::from(cert), PathBuf::from(key));
            let chain = certificates(cert_key, &cert)?;
            let private = private_key(key_key, &key)?;
            let tls = builder
                .with_client_auth_cert(chain, private)
                .map_err(|source| TlsError::ClientAuth {
                    cert: cert.clone(),
                    key,
                    source,
                })?;
            (tls, Some(cert))
        }
    };
    tls.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(PgTls {
        config,
        connector: MakeRustlsConnect::new(tls),
        mode,
        client_cert,
    })
}

impl PgTls {
    /// `host:port` of each server the configuration names, comma-separated.
    pub fn servers(&self) -> String {
        let ports = self.config.get_ports();
        self.config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match h {
                    tokio_postgres::config::Host::Tcp(h) => format!("{h}:{port}"),
                    #[cfg(unix)]
                    tokio_postgres::config::Host::Unix(p) => format!("{}:{port}", p.display()),
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The TLS error behind a failed connect, if TLS was the cause: the server would not do
    /// TLS, refused our certificate, or presented one the check refused. `None` for any
    /// other failure (refused connection, authentication, ...).
    pub fn explain(&self, e: &tokio_postgres::Error) -> Option<TlsError> {
        let (server, mode) = (self.servers(), self.mode);
        let mut next: Option<&(dyn StdError + 'static)> = e.source();
        while let Some(err) = next {
            if let Some(r) = rustls_error(err) {
                return Some(TlsError::Handshake {
                    server,
                    mode,
                    detail: self.describe(r),
                });
            }
            // tokio-postgres's words when the server answers the TLS request with "no".
            if err.to_string() == "server does not support TLS" {
                return Some(TlsError::ServerWithoutTls { server, mode });
            }
            next = err.source();
        }
        None
    }

    /// What a rustls error means here and what to do.
    fn describe(&self, e: &rustls::Error) -> String {
        match e {
            rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(inner))) => {
                match inner.downcast_ref::<CertificateRefused>() {
                    Some(refused) => refused.0.clone(),
                    None => format!("the server's certificate was refused: {inner}"),
                }
            }
            rustls::Error::AlertReceived(
                alert @ (AlertDescription::CertificateRequired
                | AlertDescription::BadCertificate
                | AlertDescription::UnknownCA
                | AlertDescription::CertificateUnknown
                | AlertDescription::CertificateExpired
                | AlertDescription::AccessDenied),
            ) => match &self.client_cert {
                Some(cert) => format!(
                    "the server refused the client certificate {} (TLS alert {alert:?}); check sslcert and sslkey: the server accepts certificates signed by the CA in its ssl_ca_file",
                    cert.display()
                ),
                None => format!(
                    "the server asks for a client certificate (TLS alert {alert:?}); set sslcert and sslkey (or PGSSLCERT and PGSSLKEY)"
                ),
            },
            other => format!(
                "{other}; check the server's TLS settings (ssl_min_protocol_version, ssl_ciphers) and sslmode"
            ),
        }
    }
}

/// An error and its causes, `: `-separated (tokio-postgres's `Display` leaves the cause out).
fn with_causes(e: &(dyn StdError + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

/// The rustls error inside `err`: tokio-rustls wraps it in an `io::Error`, whose `source`
/// skips it, so look inside.
fn rustls_error<'a>(err: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    if let Some(r) = err.downcast_ref::<rustls::Error>() {
        return Some(r);
    }
    err.downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

/// A value from the connection string, else from the environment, with the name it came by.
fn pick(
    dsn: Option<String>,
    dsn_key: &'static str,
    env: Option<String>,
    env_key: &'static str,
) -> Option<(String, &'static str)> {
    dsn.map(|v| (v, dsn_key)).or(env.map(|v| (v, env_key)))
}

fn read(key: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        key,
        path: path.to_path_buf(),
        source,
    })
}

/// Every PEM certificate of a file (at least one).
fn certificates(key: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(key, path)?;
    let bad = |detail: String| TlsError::Pem {
        key,
        path: path.to_path_buf(),
        detail,
    };
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("{e}; expected PEM certificates")))?;
    if certs.is_empty() {
        return Err(bad(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----); give a PEM file".into(),
        ));
    }
    Ok(certs)
}

/// The CA certificates of `sslrootcert`.
fn root_store(key: &'static str, path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(key, path)? {
        store.add(cert).map_err(|e| TlsError::Pem {
            key,
            path: path.to_path_buf(),
            detail: format!("holds a certificate that cannot be a trust anchor: {e}"),
        })?;
    }
    Ok(store)
}

/// The system's trusted roots (`sslrootcert=system`).
fn system_root_store() -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    let (added, _ignored) = store.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; ");
        return Err(TlsError::Unsupported {
            what: format!("sslrootcert=system found no trusted root on this machine ({why})"),
            instead: "install the system's CA certificates (ca-certificates) or name a CA file with sslrootcert=/path/to/ca.pem",
        });
    }
    Ok(store)
}

/// The private key of `sslkey`, refused when other users may read it (like libpq).
fn private_key(key: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if let Ok(meta) = std::fs::metadata(path) {
            let mode = meta.permissions().mode() & 0o777;
            // libpq: at most 0600, or 0640 when root owns the file.
            let forbidden = if meta.uid() == 0 { 0o037 } else { 0o077 };
            if mode & forbidden != 0 {
                return Err(TlsError::KeyPermissions {
                    key,
                    path: path.to_path_buf(),
                    mode,
                });
            }
        }
    }
    let bytes = read(key, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
        key,
        path: path.to_path_buf(),
        detail: format!("{e}; expected a PEM private key (PKCS#8, PKCS#1 or SEC1), unencrypted"),
    })
}

/// The message a refused server certificate carries through rustls and tokio-postgres up to
/// [`PgTls::explain`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct CertificateRefused(String);

/// The server certificate check of one mode: none (`prefer`/`require` without a CA), the
/// chain (`verify-ca`, or any mode with a CA), or the chain and the name (`verify-full`).
/// The handshake's signatures are always checked against the presented certificate.
#[derive(Debug)]
struct ServerCheck {
    /// Trust anchors the chain must end at; `None`: the certificate is not checked.
    roots: Option<Arc<RootCertStore>>,
    /// Where the anchors came from, for messages.
    ca: String,
    /// Whether the certificate must name the host connected to.
    check_name: bool,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCheck {
    fn refuse(&self, e: rustls::Error, host: &ServerName<'_>) -> rustls::Error {
        let host = host.to_str();
        let why = match &e {
            rustls::Error::InvalidCertificate(c) => c.to_string(),
            other => other.to_string(),
        };
        let message = match &e {
            rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            ) => format!(
                "the server's certificate does not name the host `{host}` ({why}); connect with a host name the certificate carries, or use sslmode=verify-ca to check the CA only"
            ),
            rustls::Error::InvalidCertificate(
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. },
            ) => format!(
                "the server's certificate is outside its validity period ({why}); renew it on the server, or check this machine's clock"
            ),
            rustls::Error::InvalidCertificate(
                CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. },
            ) => format!(
                "the server's certificate is not one for a TLS server ({why}); the server needs a certificate with the serverAuth extended key usage"
            ),
            _ => format!(
                "the server's certificate is not signed by the CA in {}: {why}; check sslrootcert, or use sslmode=require without sslrootcert to encrypt without checking the certificate",
                self.ca
            ),
        };
        rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(
            CertificateRefused(message),
        ))))
    }
}

impl ServerCertVerifier for ServerCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(roots) = &self.roots else {
            return Ok(ServerCertVerified::assertion());
        };
        let cert =
            ParsedCertificate::try_from(end_entity).map_err(|e| self.refuse(e, server_name))?;
        verify_server_cert_signed_by_trust_anchor(
            &cert,
            roots,
            intermediates,
            now,
            self.algorithms.all,
        )
        .map_err(|e| self.refuse(e, server_name))?;
        if self.check_name {
            verify_server_name(&cert, server_name).map_err(|e| self.refuse(e, server_name))?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The keys of a connection string that Sealpost reads itself, as written (decoded).
#[derive(Debug, Default)]
struct TlsKeys {
    sslmode: Option<String>,
    sslrootcert: Option<String>,
    sslcert: Option<String>,
    sslkey: Option<String>,
}

impl TlsKeys {
    /// Keeps `value` if `key` is one of ours (the last one wins, as in libpq).
    fn take(&mut self, key: &str, value: String) -> bool {
        let slot = match key {
            "sslmode" => &mut self.sslmode,
            "sslrootcert" => &mut self.sslrootcert,
            "sslcert" => &mut self.sslcert,
            "sslkey" => &mut self.sslkey,
            _ => return false,
        };
        *slot = Some(value);
        true
    }
}

/// Splits a connection string into what tokio-postgres parses (everything but our keys,
/// byte for byte) and our keys. A string that does not tokenize is returned whole, for
/// tokio-postgres to report.
fn split_dsn(dsn: &str) -> (String, TlsKeys) {
    let split = if dsn.starts_with("postgres://") || dsn.starts_with("postgresql://") {
        split_url(dsn)
    } else {
        split_key_value(dsn)
    };
    split.unwrap_or_else(|| (dsn.to_string(), TlsKeys::default()))
}

/// The URL form, parsed the way tokio-postgres does: the credentials end at the first `@`,
/// the parameters start at the first `?` after them, `key=value` pairs separated by `&`,
/// percent-decoded.
fn split_url(dsn: &str) -> Option<(String, TlsKeys)> {
    let after_credentials = dsn.find('@').map_or(0, |i| i + 1);
    let Some(q) = dsn[after_credentials..].find('?') else {
        return Some((dsn.to_string(), TlsKeys::default()));
    };
    let (head, mut query) = (
        &dsn[..after_credentials + q],
        &dsn[after_credentials + q + 1..],
    );
    let mut keys = TlsKeys::default();
    let mut kept: Vec<&str> = Vec::new();
    while !query.is_empty() {
        let Some(eq) = query.find('=') else {
            kept.push(query);
            break;
        };
        let end = query[eq..].find('&').map_or(query.len(), |i| eq + i);
        let (pair, key, value) = (&query[..end], &query[..eq], &query[eq + 1..end]);
        query = query.get(end + 1..).unwrap_or("");
        let key = percent_decode_str(key).decode_utf8_lossy();
        let value = percent_decode_str(value).decode_utf8_lossy().into_owned();
        if !keys.take(&key, value) {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() {
        head.to_string()
    } else {
        format!("{head}?{}", kept.join("&"))
    };
    Some((rest, keys))
}

/// The key=value form, tokenized as [`crate::secret::key_value_pairs`] does (the way
/// tokio-postgres and libpq do); a bare empty value (`key=` at the end) does not tokenize.
fn split_key_value(dsn: &str) -> Option<(String, TlsKeys)> {
    let mut keys = TlsKeys::default();
    let mut kept: Vec<&str> = Vec::new();
    for p in crate::secret::key_value_pairs(dsn)? {
        if p.value.is_empty() && !p.text.ends_with('\'') {
            return None;
        }
        if !keys.take(p.key, p.value) {
            kept.push(p.text);
        }
    }
    Some((kept.join(" "), keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_value_form_keeps_what_is_not_tls_and_refuses_a_bare_empty_value() {
        let (rest, _) = split_key_value("host=h sslmode=require password='a b' dbname=x").unwrap();
        assert_eq!(rest, "host=h password='a b' dbname=x");
        assert!(split_key_value("host=h dbname=").is_none());
        assert_eq!(split_key_value("host=''").unwrap().0, "host=''");
    }
}
