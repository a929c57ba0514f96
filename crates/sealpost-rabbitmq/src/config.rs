//! The RabbitMQ adapter's configuration ([`RabbitConfig`]): the broker's URL, the cluster
//! identity destinations are frozen with, and how the connection is secured
//! ([`RabbitOptions`]). A service builds it in code, reads it from the environment
//! ([`RabbitConfig::from_env`]) or deserializes it (the `sealpost` command's `[rabbitmq]`
//! table, with `[rabbitmq.security]`).

use std::path::PathBuf;
use std::time::Duration;

use crate::{LookupStream, Rabbit, RabbitError, RabbitOptions};

/// Where and how to reach RabbitMQ. Its `Debug` shows the URL without a password.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RabbitConfig {
    /// AMQP URL, `amqp://` or `amqps://` (`RABBITMQ_URL`).
    pub url: String,
    /// Cluster identity frozen into destinations (`RABBITMQ_CLUSTER`).
    pub cluster: String,
    /// TLS and the password file (`RABBITMQ_TLS_CA_FILE`, `RABBITMQ_TLS_CERT_FILE`,
    /// `RABBITMQ_TLS_KEY_FILE`, `RABBITMQ_PASSWORD_FILE`).
    pub security: RabbitOptions,
    /// The lookup stream (`[rabbitmq.lookup]`, `RABBITMQ_LOOKUP_STREAM`): whether the broker
    /// can be asked, and how ([`LookupStream`]).
    pub lookup: LookupStream,
}

impl Default for RabbitConfig {
    fn default() -> Self {
        RabbitConfig {
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".to_string(),
            cluster: "rabbitmq-local".to_string(),
            security: RabbitOptions::default(),
            lookup: LookupStream::default(),
        }
    }
}

impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &sealpost_core::secret::redact_url(&self.url))
            .field("cluster", &self.cluster)
            .field("security", &self.security)
            .field("lookup", &self.lookup)
            .finish()
    }
}

impl RabbitConfig {
    /// The defaults with the environment applied ([`RabbitConfig::apply_env`]).
    pub fn from_env() -> RabbitConfig {
        let mut c = RabbitConfig::default();
        c.apply_env();
        c
    }

    /// Applies the `RABBITMQ_*` variables that are set over what the configuration says.
    pub fn apply_env(&mut self) {
        let var = |name: &str| std::env::var(name).ok();
        if let Some(v) = var("RABBITMQ_URL") {
            self.url = v;
        }
        if let Some(v) = var("RABBITMQ_CLUSTER") {
            self.cluster = v;
        }
        if let Some(v) = var("RABBITMQ_LOOKUP_STREAM") {
            self.lookup.enabled = matches!(v.trim(), "1" | "true" | "on" | "yes");
        }
        let s = &mut self.security;
        for (name, slot) in [
            ("RABBITMQ_TLS_CA_FILE", &mut s.tls_ca_file),
            ("RABBITMQ_TLS_CERT_FILE", &mut s.tls_cert_file),
            ("RABBITMQ_TLS_KEY_FILE", &mut s.tls_key_file),
            ("RABBITMQ_PASSWORD_FILE", &mut s.password_file),
        ] {
            if let Some(v) = var(name) {
                *slot = (!v.is_empty()).then(|| PathBuf::from(v));
            }
        }
    }

    /// Connects ([`Rabbit::connect_with`]); `ack_timeout` bounds one publish's confirm, and
    /// `name` names the connection at the broker so an operator can find it.
    pub async fn connect(&self, ack_timeout: Duration, name: &str) -> Result<Rabbit, RabbitError> {
        if self.lookup.enabled {
            self.lookup.check()?;
        }
        Ok(
            Rabbit::connect_with(&self.url, &self.cluster, ack_timeout, name, &self.security)
                .await?
                .with_lookup_stream(self.lookup.clone()),
        )
    }
}
