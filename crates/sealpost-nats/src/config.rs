//! The NATS adapter's configuration ([`NatsConfig`]): where the servers are, the cluster
//! identity destinations are frozen with, and how the connection is secured
//! ([`NatsOptions`]). A service builds it in code, reads it from the environment
//! ([`NatsConfig::from_env`]) or deserializes it (the `sealpost` command's `[nats]` table,
//! with `[nats.security]`).

use std::path::PathBuf;
use std::time::Duration;

use crate::{Nats, NatsError, NatsOptions};

/// Where and how to reach NATS. Its `Debug` shows the URL without a password.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated (`NATS_URL`).
    pub url: String,
    /// Cluster identity frozen into destinations (`NATS_CLUSTER`): rows frozen for another
    /// cluster are never sent here.
    pub cluster: String,
    /// TLS and credentials (`NATS_TLS_CA_FILE`, `NATS_TLS_CERT_FILE`, `NATS_TLS_KEY_FILE`,
    /// `NATS_REQUIRE_TLS`, `NATS_CREDS_FILE`, `NATS_NKEY_SEED_FILE`, `NATS_USER`,
    /// `NATS_PASSWORD_FILE`, `NATS_TOKEN_FILE`).
    pub security: NatsOptions,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: "nats://127.0.0.1:4222".to_string(),
            cluster: "nats-local".to_string(),
            security: NatsOptions::default(),
        }
    }
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &sealpost_core::secret::redact_url(&self.url))
            .field("cluster", &self.cluster)
            .field("security", &self.security)
            .finish()
    }
}

impl NatsConfig {
    /// The defaults with the environment applied ([`NatsConfig::apply_env`]).
    pub fn from_env() -> NatsConfig {
        let mut c = NatsConfig::default();
        c.apply_env();
        c
    }

    /// Applies the `NATS_*` variables that are set over what the configuration says.
    pub fn apply_env(&mut self) {
        let var = |name: &str| std::env::var(name).ok();
        let file = |name: &str| var(name).map(|v| (!v.is_empty()).then(|| PathBuf::from(v)));
        if let Some(v) = var("NATS_URL") {
            self.url = v;
        }
        if let Some(v) = var("NATS_CLUSTER") {
            self.cluster = v;
        }
        let s = &mut self.security;
        for (name, slot) in [
            ("NATS_TLS_CA_FILE", &mut s.tls_ca_file),
            ("NATS_TLS_CERT_FILE", &mut s.tls_cert_file),
            ("NATS_TLS_KEY_FILE", &mut s.tls_key_file),
            ("NATS_CREDS_FILE", &mut s.creds_file),
            ("NATS_NKEY_SEED_FILE", &mut s.nkey_seed_file),
            ("NATS_PASSWORD_FILE", &mut s.password_file),
            ("NATS_TOKEN_FILE", &mut s.token_file),
        ] {
            if let Some(v) = file(name) {
                *slot = v;
            }
        }
        if let Some(v) = var("NATS_USER") {
            s.user = (!v.is_empty()).then_some(v);
        }
        if let Some(v) = var("NATS_REQUIRE_TLS") {
            // Anything but an explicit "off" keeps TLS required (fails closed).
            s.require_tls = !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "" | "0" | "false" | "no" | "off"
            );
        }
    }

    /// Connects ([`Nats::connect_with`]); `ack_timeout` bounds one publish's answer.
    pub async fn connect(&self, ack_timeout: Duration) -> Result<Nats, NatsError> {
        Nats::connect_with(&self.url, &self.cluster, ack_timeout, &self.security).await
    }
}
