//! How a NATS connection is secured and authenticated ([`NatsOptions`], passed to
//! [`Nats::connect_with`](crate::Nats::connect_with)): TLS with a CA of one's own, a client
//! certificate, TLS demanded even where the server does not ask for it, and one way to prove
//! who we are — a `.creds` file (JWT and nkey seed), an nkey seed, a user and password, or a
//! token. Secrets are read from files, so they stay out of configuration files, command lines
//! and process listings. The files are checked before connecting, so a wrong path is named
//! as such, not as a TLS failure; a failed connect is explained in terms of these options
//! ([`hint`]).

use std::path::{Path, PathBuf};

use async_nats::rustls;

use crate::NatsError;

/// TLS and credentials of a NATS connection. The default is what [`Nats::connect`] does:
/// TLS only if the URL says `tls://` or the server demands it, checked against the system's
/// roots; no credentials.
///
/// [`Nats::connect`]: crate::Nats::connect
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsOptions {
    /// PEM file of the CA(s) that sign the server's certificate; replaces the system's roots.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate, for a server whose `tls` block says `verify: true`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Refuse to talk to a server that does not do TLS (no fallback to plaintext).
    pub require_tls: bool,
    /// A `.creds` file (user JWT and nkey seed, as `nsc` writes them).
    pub creds_file: Option<PathBuf>,
    /// A file holding an nkey user seed (`SU...`).
    pub nkey_seed_file: Option<PathBuf>,
    /// User name for user/password authentication (with `password_file`).
    pub user: Option<String>,
    /// A file holding the password of `user`.
    pub password_file: Option<PathBuf>,
    /// A file holding an authentication token.
    pub token_file: Option<PathBuf>,
}

fn invalid(key: &'static str, message: impl Into<String>) -> NatsError {
    NatsError::Options {
        key,
        message: message.into(),
    }
}

fn read(key: &'static str, path: &Path) -> Result<String, NatsError> {
    std::fs::read_to_string(path).map_err(|source| NatsError::Read {
        key,
        path: path.to_path_buf(),
        source,
    })
}

/// A secret from a file: the whole file but its trailing line break, not empty.
fn secret(key: &'static str, path: &Path) -> Result<String, NatsError> {
    let text = read(key, path)?;
    let value = text.trim_end_matches(['\n', '\r']);
    if value.is_empty() {
        return Err(invalid(key, format!("{} is empty", path.display())));
    }
    Ok(value.to_string())
}

/// Checks that a PEM file holds at least one certificate (or, for a key, a private key).
fn check_pem(key: &'static str, path: &Path, private_key: bool) -> Result<(), NatsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let text = read(key, path)?;
    let found = if private_key {
        PrivateKeyDer::from_pem_slice(text.as_bytes()).is_ok()
    } else {
        CertificateDer::pem_slice_iter(text.as_bytes()).any(|c| c.is_ok())
    };
    if !found {
        let what = if private_key {
            "PEM private key (-----BEGIN PRIVATE KEY-----, unencrypted)"
        } else {
            "PEM certificate (-----BEGIN CERTIFICATE-----)"
        };
        return Err(invalid(
            key,
            format!("{} holds no {what}; give a PEM file", path.display()),
        ));
    }
    Ok(())
}

impl NatsOptions {
    /// Applies the options to the client's, reading and checking every file first.
    pub(crate) async fn apply(
        &self,
        mut o: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, NatsError> {
        if let Some(ca) = &self.tls_ca_file {
            check_pem("nats.security.tls_ca_file", ca, false)?;
            o = o.add_root_certificates(ca.clone());
        }
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => {
                check_pem("nats.security.tls_cert_file", cert, false)?;
                check_pem("nats.security.tls_key_file", key, true)?;
                o = o.add_client_certificate(cert.clone(), key.clone());
            }
            (Some(_), None) => {
                return Err(invalid(
                    "nats.security.tls_key_file",
                    "nats.security.tls_cert_file is set but its key is not; set both or neither",
                ))
            }
            (None, Some(_)) => return Err(invalid(
                "nats.security.tls_cert_file",
                "nats.security.tls_key_file is set but its certificate is not; set both or neither",
            )),
            (None, None) => {}
        }
        if self.require_tls {
            o = o.require_tls(true);
        }
        let ways = [
            self.creds_file.is_some(),
            self.nkey_seed_file.is_some(),
            self.user.is_some() || self.password_file.is_some(),
            self.token_file.is_some(),
        ];
        if ways.iter().filter(|w| **w).count() > 1 {
            return Err(invalid(
                "nats.security.creds_file, nats.security.nkey_seed_file, nats.security.user or nats.security.token_file",
                "more than one way to authenticate is set (creds file, nkey seed file, user and password, token file); keep the one the server expects",
            ));
        }
        if let Some(path) = &self.creds_file {
            read("nats.security.creds_file", path)?;
            o = o
                .credentials_file(path)
                .await
                .map_err(|e| invalid("nats.security.creds_file", format!("{}: {e}; expected a .creds file with a user JWT and an nkey seed (nsc generate creds)", path.display())))?;
        }
        if let Some(path) = &self.nkey_seed_file {
            let seed = secret("nats.security.nkey_seed_file", path)?;
            let seed = seed.trim();
            if !seed.starts_with("SU") {
                return Err(invalid(
                    "nats.security.nkey_seed_file",
                    format!(
                        "{} does not hold an nkey user seed (one line starting with SU)",
                        path.display()
                    ),
                ));
            }
            o = o.nkey(seed.to_string());
        }
        match (&self.user, &self.password_file) {
            (Some(user), Some(path)) => {
                let password = secret("nats.security.password_file", path)?;
                o = o.user_and_password(user.clone(), password);
            }
            (Some(_), None) => return Err(invalid(
                "nats.security.password_file",
                "nats.security.user is set but no password file; set nats.security.password_file",
            )),
            (None, Some(_)) => {
                return Err(invalid(
                    "nats.security.user",
                    "nats.security.password_file is set but no user; set nats.security.user",
                ))
            }
            (None, None) => {}
        }
        if let Some(path) = &self.token_file {
            let token = secret("nats.security.token_file", path)?;
            o = o.token(token.trim().to_string());
        }
        Ok(o)
    }

    /// What to check after a failed connect, in terms of these options.
    pub(crate) fn hint(&self, e: &async_nats::ConnectError) -> String {
        use async_nats::ConnectErrorKind as K;
        if let Some(r) = rustls_error(e) {
            return self.tls_hint(r);
        }
        match e.kind() {
            K::AuthorizationViolation | K::Authentication => "the server refused our credentials; check nats.security.creds_file, nats.security.nkey_seed_file, nats.security.user and nats.security.password_file, or nats.security.token_file against the server's authorization".to_string(),
            K::Tls => "check nats.security.tls_ca_file, nats.security.tls_cert_file and nats.security.tls_key_file, and that the server's URL host is a name its certificate carries".to_string(),
            _ => "is nats-server running with JetStream (-js)?".to_string(),
        }
    }

    fn tls_hint(&self, e: &rustls::Error) -> String {
        use rustls::{AlertDescription as A, CertificateError as C};
        let ca = match &self.tls_ca_file {
            Some(p) => format!("the CA in {} (nats.security.tls_ca_file)", p.display()),
            None => "a CA this machine trusts (no nats.security.tls_ca_file is set)".to_string(),
        };
        match e {
            rustls::Error::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => {
                "the server's certificate does not name the host in nats.url; connect with a host name the certificate carries".to_string()
            }
            rustls::Error::InvalidCertificate(
                C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. },
            ) => "the server's certificate is outside its validity period; renew it, or check this machine's clock".to_string(),
            rustls::Error::InvalidCertificate(_) => format!(
                "the server's certificate is not signed by {ca}; set nats.security.tls_ca_file to the CA that signed the server's certificate"
            ),
            rustls::Error::AlertReceived(
                A::CertificateRequired | A::BadCertificate | A::UnknownCA | A::CertificateUnknown,
            ) => match &self.tls_cert_file {
                Some(p) => format!(
                    "the server refused our client certificate {} (nats.security.tls_cert_file); it must be signed by the CA in the server's tls ca_file",
                    p.display()
                ),
                None => "the server asks for a client certificate (tls verify: true); set nats.security.tls_cert_file and nats.security.tls_key_file".to_string(),
            },
            rustls::Error::InvalidMessage(_) => {
                "the server did not answer in TLS: does its configuration have a tls block? nats.security.require_tls never falls back to plaintext".to_string()
            }
            _ => "check nats.security.tls_ca_file, nats.security.tls_cert_file and nats.security.tls_key_file".to_string(),
        }
    }
}

/// The rustls error behind a connect error (tokio-rustls wraps it in an `io::Error`, whose
/// `source` skips it).
fn rustls_error(e: &async_nats::ConnectError) -> Option<&rustls::Error> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
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
