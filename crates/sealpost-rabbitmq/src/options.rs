//! How a RabbitMQ connection is secured and authenticated ([`RabbitOptions`], passed to
//! [`Rabbit::connect_with`](crate::Rabbit::connect_with) and [`open_connection`]): TLS
//! (`amqps://`) checked against a CA file of one's own, a client certificate for a broker that
//! verifies its peers, and the password read from a file, so it stays out of the URL, the
//! configuration file and process listings. The files are read and checked before
//! connecting, so a wrong path is named as such, not as a TLS failure; a refused connect is
//! explained in terms of these options ([`RabbitOptions::hint`]).
//!
//! TLS is rustls with the ring provider, TLS 1.2 or 1.3. The CA file is the **only** trust
//! anchor (no system roots are added): for a broker with a publicly signed certificate, name
//! the system's bundle (e.g. `/etc/ssl/certs/ca-certificates.crt`). The certificate must name
//! the URL's host.

// `RabbitError` carries lapin's error (over 100 bytes); these functions run once per connect,
// where the size of an error costs nothing.
#![allow(clippy::result_large_err)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::RabbitError;

/// TLS and credentials of a RabbitMQ connection. The default is what
/// [`Rabbit::connect`](crate::Rabbit::connect) does: the URL alone (an `amqps://` URL then
/// has no CA to check the broker against and is refused).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RabbitOptions {
    /// PEM file of the CA(s) that sign the broker's certificate; required by `amqps://`.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate, for a broker with `ssl_options.verify = verify_peer` and
    /// `fail_if_no_peer_cert = true`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file` (unencrypted; PKCS#8, PKCS#1 or SEC1).
    pub tls_key_file: Option<PathBuf>,
    /// A file holding the password of the URL's user (the URL then carries no password).
    pub password_file: Option<PathBuf>,
}

/// What a connection goes to: the URL with the password from its file, and the TLS settings
/// with the files' contents. Prepared once, by `connect_with`; reconnects reuse it.
#[derive(Clone)]
pub(crate) struct Target {
    /// The nodes of one cluster, in the order the URL names them; a connect tries each in
    /// turn ([`dial`]).
    pub(crate) nodes: Vec<NodeTarget>,
    pub(crate) tls: OwnedTLSConfig,
    /// The URL without its passwords, for messages.
    pub(crate) shown: String,
    pub(crate) options: RabbitOptions,
    /// The node the next connect tries first: the one after the last that took a
    /// connection, so a reconnect (its connection was lost) starts elsewhere.
    next: std::sync::Arc<AtomicUsize>,
}

/// One node of a [`Target`].
#[derive(Clone)]
pub(crate) struct NodeTarget {
    pub(crate) uri: AMQPUri,
    /// Its URL without a password.
    pub(crate) shown: String,
}

fn invalid(option: &'static str, detail: impl Into<String>) -> RabbitError {
    RabbitError::Setting {
        option,
        detail: detail.into(),
    }
}

fn read(option: &'static str, path: &Path) -> Result<Vec<u8>, RabbitError> {
    std::fs::read(path).map_err(|e| invalid(option, format!("cannot read {}: {e}", path.display())))
}

/// A secret from a file: the whole file but its trailing line break, not empty. Errors name
/// the file, never its contents.
fn secret(option: &'static str, path: &Path) -> Result<String, RabbitError> {
    let bytes = read(option, path)?;
    let text = String::from_utf8(bytes)
        .map_err(|_| invalid(option, format!("{} is not UTF-8 text", path.display())))?;
    let value = text.trim_end_matches(['\n', '\r']);
    if value.is_empty() {
        return Err(invalid(option, format!("{} is empty", path.display())));
    }
    Ok(value.to_string())
}

/// A PEM file that holds at least one certificate (or, for a key, a private key).
fn pem(option: &'static str, path: &Path, private_key: bool) -> Result<Vec<u8>, RabbitError> {
    let bytes = read(option, path)?;
    let found = if private_key {
        PrivateKeyDer::from_pem_slice(&bytes).is_ok()
    } else {
        CertificateDer::pem_slice_iter(&bytes).any(|c| c.is_ok())
    };
    if !found {
        let what = if private_key {
            "PEM private key (-----BEGIN PRIVATE KEY-----, unencrypted)"
        } else {
            "PEM certificate (-----BEGIN CERTIFICATE-----)"
        };
        return Err(invalid(
            option,
            format!("{} holds no {what}; give a PEM file", path.display()),
        ));
    }
    Ok(bytes)
}

/// Whether `url` carries a password (`scheme://user:password@host`).
fn has_password(url: &str) -> bool {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => url[s + 3..at].contains(':'),
        _ => false,
    }
}

impl RabbitOptions {
    /// Reads and checks every file and joins them to `url`: one node's URL, or the nodes of
    /// one cluster comma-separated (`amqp://a:5672/%2f,amqp://b:5672/%2f`).
    pub(crate) fn prepare(&self, url: &str) -> Result<Target, RabbitError> {
        let parts: Vec<&str> = url
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .collect();
        if parts.is_empty() {
            return Err(invalid(
                "rabbitmq.url",
                "is empty: name a node, `amqp://host:5672/%2f`, or several comma-separated",
            ));
        }
        let mut nodes = Vec::with_capacity(parts.len());
        let mut tls = OwnedTLSConfig::default();
        for part in parts {
            let (uri, t, shown) = self.prepare_node(part)?;
            tls = t;
            nodes.push(NodeTarget { uri, shown });
        }
        Ok(Target {
            shown: nodes
                .iter()
                .map(|n| n.shown.as_str())
                .collect::<Vec<_>>()
                .join(","),
            nodes,
            tls,
            options: self.clone(),
            next: Default::default(),
        })
    }

    /// One node's URL with the files joined to it.
    fn prepare_node(&self, url: &str) -> Result<(AMQPUri, OwnedTLSConfig, String), RabbitError> {
        let shown = sealpost_core::secret::redact_url(url);
        let mut uri: AMQPUri = url
            .parse()
            .map_err(|e| invalid("rabbitmq.url", format!("{shown}: {e}")))?;
        let tls_files = self.tls_ca_file.is_some()
            || self.tls_cert_file.is_some()
            || self.tls_key_file.is_some();
        match uri.scheme {
            AMQPScheme::AMQP if tls_files => {
                return Err(invalid(
                    "rabbitmq.url",
                    format!("{shown} is plaintext (amqp://) but TLS files are set; use amqps:// (never a silent plaintext connection)"),
                ))
            }
            AMQPScheme::AMQPS if self.tls_ca_file.is_none() => {
                return Err(invalid(
                    "rabbitmq.security.tls_ca_file",
                    format!("{shown} is amqps:// but no CA file is set; name the CA that signs the broker's certificate (for a publicly signed one, the system's bundle, e.g. /etc/ssl/certs/ca-certificates.crt)"),
                ))
            }
            _ => {}
        }
        let mut tls = OwnedTLSConfig::default();
        if let Some(ca) = &self.tls_ca_file {
            let bytes = pem("rabbitmq.security.tls_ca_file", ca, false)?;
            tls.cert_chain = Some(String::from_utf8(bytes).map_err(|_| {
                invalid(
                    "rabbitmq.security.tls_ca_file",
                    format!("{} is not UTF-8 text", ca.display()),
                )
            })?);
        }
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => {
                tls.identity = Some(OwnedIdentity::PKCS8 {
                    pem: pem("rabbitmq.security.tls_cert_file", cert, false)?,
                    key: pem("rabbitmq.security.tls_key_file", key, true)?,
                });
            }
            (Some(_), None) => {
                return Err(invalid(
                    "rabbitmq.security.tls_key_file",
                    "rabbitmq.security.tls_cert_file is set but its key is not; set both or neither",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "rabbitmq.security.tls_cert_file",
                    "rabbitmq.security.tls_key_file is set but its certificate is not; set both or neither",
                ))
            }
            (None, None) => {}
        }
        if let Some(path) = &self.password_file {
            if has_password(url) {
                return Err(invalid(
                    "rabbitmq.security.password_file",
                    format!("{shown} carries a password and rabbitmq.security.password_file is set; remove the password from the URL"),
                ));
            }
            uri.authority.userinfo.password = secret("rabbitmq.security.password_file", path)?;
        }
        Ok((uri, tls, shown))
    }

    /// What to check after a refused connect, in terms of these options.
    pub(crate) fn hint(&self, e: &lapin::Error) -> String {
        if let Some(r) = rustls_error(e) {
            return self.tls_hint(r);
        }
        if self.tls_ca_file.is_some() && closed_by_peer(e) {
            // Under TLS 1.3 the server checks the client certificate after the client has
            // finished its handshake: a refusal may reach us as a reset rather than an alert.
            return match &self.tls_cert_file {
                Some(p) => format!(
                    "TLS: the broker closed the connection; check that it takes our client certificate {} (rabbitmq.security.tls_cert_file, signed by the CA in its ssl_options.cacertfile) and that rabbitmq-server is running",
                    p.display()
                ),
                None => "TLS: the broker closed the connection; if it asks for a client certificate (ssl_options.fail_if_no_peer_cert), set rabbitmq.security.tls_cert_file and rabbitmq.security.tls_key_file, else check that rabbitmq-server is running".to_string(),
            };
        }
        let text = e.to_string();
        if text.contains("ACCESS_REFUSED") || text.contains("403") {
            return match &self.password_file {
                Some(p) => format!(
                    "the broker refused the user and the password in {} (rabbitmq.security.password_file)",
                    p.display()
                ),
                None => "the broker refused the URL's user and password".to_string(),
            };
        }
        "is rabbitmq-server running, and are the URL's user, password and vhost right?".to_string()
    }

    fn tls_hint(&self, e: &rustls::Error) -> String {
        use rustls::{AlertDescription as A, CertificateError as C};
        let ca = match &self.tls_ca_file {
            Some(p) => format!("the CA in {} (rabbitmq.security.tls_ca_file)", p.display()),
            None => "the CA file (none is set)".to_string(),
        };
        match e {
            rustls::Error::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => {
                "TLS: the broker's certificate does not name the host in rabbitmq.url; connect with a host name the certificate carries".to_string()
            }
            rustls::Error::InvalidCertificate(
                C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. },
            ) => "TLS: the broker's certificate is outside its validity period; renew it, or check this machine's clock".to_string(),
            rustls::Error::InvalidCertificate(_) => format!(
                "TLS: the broker's certificate is not signed by {ca}; set rabbitmq.security.tls_ca_file to the CA that signed it"
            ),
            rustls::Error::AlertReceived(
                A::CertificateRequired | A::HandshakeFailure | A::BadCertificate | A::UnknownCA | A::CertificateUnknown,
            ) => match &self.tls_cert_file {
                Some(p) => format!(
                    "TLS: the broker refused our client certificate {} (rabbitmq.security.tls_cert_file); it must be signed by the CA in the broker's ssl_options.cacertfile",
                    p.display()
                ),
                None => "TLS: the broker asks for a client certificate (ssl_options.fail_if_no_peer_cert); set rabbitmq.security.tls_cert_file and rabbitmq.security.tls_key_file".to_string(),
            },
            rustls::Error::InvalidMessage(_) => {
                "TLS: the broker did not answer in TLS: is the URL's port its TLS listener (listeners.ssl)?".to_string()
            }
            _ => "TLS: check rabbitmq.security.tls_ca_file, rabbitmq.security.tls_cert_file and rabbitmq.security.tls_key_file".to_string(),
        }
    }
}

/// Whether the connection was closed under us (reset, aborted or cut short): what a TLS 1.3
/// server's refusal of the client's certificate looks like when the client writes first.
fn closed_by_peer(e: &lapin::Error) -> bool {
    use std::io::ErrorKind as K;
    match e.kind() {
        lapin::ErrorKind::IOError(io) => matches!(
            io.kind(),
            K::ConnectionReset | K::ConnectionAborted | K::UnexpectedEof | K::BrokenPipe
        ),
        _ => false,
    }
}

/// The rustls error behind a lapin error (the TLS stream wraps it in an `io::Error`).
fn rustls_error(e: &lapin::Error) -> Option<&rustls::Error> {
    let lapin::ErrorKind::IOError(io) = e.kind() else {
        return None;
    };
    let mut next: Option<&(dyn std::error::Error + 'static)> = io.get_ref().map(|x| x as _);
    while let Some(err) = next {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(r) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(r);
        }
        next = err.source();
    }
    None
}

/// Opens a connection to `target` (TLS and password applied).
pub(crate) async fn dial(
    target: &Target,
    properties: ConnectionProperties,
) -> Result<Connection, RabbitError> {
    let n = target.nodes.len();
    let first = target.next.load(Ordering::Relaxed);
    let mut last = None;
    for k in 0..n {
        let i = (first + k) % n;
        let node = &target.nodes[i];
        let runtime = lapin::runtime::default_runtime().map_err(|source| RabbitError::Connect {
            url: node.shown.clone(),
            hint: "no tokio runtime".into(),
            source,
        })?;
        let connect = Connection::connect_uri_with_config(
            node.uri.clone(),
            properties.clone(),
            target.tls.clone(),
            runtime,
        );
        let err = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(c)) => {
                target.next.store((i + 1) % n, Ordering::Relaxed);
                if n > 1 {
                    tracing::debug!(node = %node.shown, "RabbitMQ: connected");
                }
                return Ok(c);
            }
            Ok(Err(source)) => RabbitError::Connect {
                url: node.shown.clone(),
                hint: target.options.hint(&source),
                source,
            },
            Err(_) => RabbitError::Connect {
                url: node.shown.clone(),
                hint: format!(
                    "no answer within {CONNECT_TIMEOUT:?}; check that the node runs and is reachable"
                ),
                source: lapin::Error::from(std::io::Error::from(std::io::ErrorKind::TimedOut)),
            },
        };
        if n > 1 {
            tracing::warn!(node = %node.shown, error = %err, "RabbitMQ: a node refused the connection; trying the next");
        }
        last = Some(err);
    }
    Err(last.expect("a target has at least one node"))
}

/// How long one node may take to accept a connection before the next is tried.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens a plain lapin connection to `url` with `options` (TLS, client certificate, password
/// file), for a caller that consumes on its own channels (`sealpost consume`).
pub async fn open_connection(
    url: &str,
    options: &RabbitOptions,
    properties: ConnectionProperties,
) -> Result<Connection, RabbitError> {
    dial(&options.prepare(url)?, properties).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_in_the_url_is_seen() {
        assert!(has_password("amqp://u:p@h:5672/%2f"));
        assert!(!has_password("amqp://u@h:5672/%2f"));
        assert!(!has_password("amqps://h:5671"));
    }

    #[test]
    fn a_tls_connection_reset_names_the_client_certificate() {
        let reset = lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        let tls = RabbitOptions {
            tls_ca_file: Some("/ca.pem".into()),
            ..Default::default()
        };
        let hint = tls.hint(&reset);
        assert!(hint.contains("rabbitmq.security.tls_cert_file"), "{hint}");
        assert!(hint.contains("fail_if_no_peer_cert"), "{hint}");
        let with_cert = RabbitOptions {
            tls_cert_file: Some("/client.pem".into()),
            ..tls
        };
        let hint = with_cert.hint(&reset);
        assert!(hint.contains("/client.pem"), "{hint}");
        // Plain AMQP: a reset says nothing about certificates.
        let hint = RabbitOptions::default().hint(&reset);
        assert!(!hint.contains("tls_cert_file"), "{hint}");
    }

    #[test]
    fn the_nodes_of_one_cluster_are_each_checked_and_shown_without_passwords() {
        let o = RabbitOptions::default();
        let t = o
            .prepare("amqp://u:pw1@a:5672/%2f, amqp://u:pw2@b:5673/%2f,")
            .unwrap();
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.nodes[1].uri.authority.port, 5673);
        assert!(
            !t.shown.contains("pw1") && !t.shown.contains("pw2"),
            "{}",
            t.shown
        );
        assert!(t.shown.contains("a:5672") && t.shown.contains("b:5673"));
        // Each node is held to the same rules: an amqps:// node without a CA is refused.
        let m = o
            .prepare("amqp://u@a:5672/%2f,amqps://u@b:5671/%2f")
            .err()
            .unwrap()
            .to_string();
        assert!(m.contains("rabbitmq.security.tls_ca_file"), "{m}");
        let m = o.prepare(" , ").err().unwrap().to_string();
        assert!(m.contains("rabbitmq.url") && m.contains("empty"), "{m}");
    }

    #[test]
    fn settings_that_do_not_go_together_are_named() {
        let dir = std::env::temp_dir().join(format!("sealpost-rabbit-opt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pw = dir.join("pw");
        std::fs::write(&pw, "s3cret-value\n").unwrap();
        let e = |o: &RabbitOptions, url: &str| o.prepare(url).err().unwrap().to_string();
        // amqps without a CA.
        let m = e(&RabbitOptions::default(), "amqps://u@localhost:5671/%2f");
        assert!(m.contains("rabbitmq.security.tls_ca_file"), "{m}");
        // TLS files on a plaintext URL.
        let o = RabbitOptions {
            tls_ca_file: Some(dir.join("ca.pem")),
            ..Default::default()
        };
        let m = e(&o, "amqp://u@localhost:5672/%2f");
        assert!(m.contains("amqps://"), "{m}");
        // A CA file that is not there is named as such.
        let m = e(&o, "amqps://u@localhost:5671/%2f");
        assert!(m.contains("ca.pem") && m.contains("cannot read"), "{m}");
        // A password both in the URL and in a file; the secret never appears.
        let o = RabbitOptions {
            password_file: Some(pw.clone()),
            ..Default::default()
        };
        let m = e(&o, "amqp://u:other@localhost:5672/%2f");
        assert!(
            m.contains("rabbitmq.security.password_file") && !m.contains("other"),
            "{m}"
        );
        // The password file's line break is dropped.
        let t = o.prepare("amqp://u@localhost:5672/%2f").unwrap();
        assert_eq!(t.nodes[0].uri.authority.userinfo.password, "s3cret-value");
        assert!(!t.shown.contains("s3cret"));
        // A certificate without its key.
        let o = RabbitOptions {
            tls_ca_file: Some(pw.clone()),
            tls_cert_file: Some(pw.clone()),
            ..Default::default()
        };
        let m = e(&o, "amqps://u@localhost:5671/%2f");
        assert!(
            m.contains("PEM certificate") && !m.contains("s3cret"),
            "{m}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
