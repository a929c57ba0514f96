//! Which broker the `sealpost` command talks to (config key `broker`, flag `--broker`), and
//! connecting to it. The loops are generic over the broker port; only this file and the
//! per-broker consumers know which adapters exist.

use std::time::Duration;

use sealpost::runtime::{Config, RunError};
use sealpost_kafka::{Kafka, KafkaConfig};
use sealpost_nats::{Nats, NatsOptions};
use sealpost_rabbitmq::{Rabbit, RabbitOptions};

/// A broker the command can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// NATS JetStream (`nats_url`, `nats_cluster`).
    Nats,
    /// RabbitMQ (`rabbitmq_url`, `rabbitmq_cluster`).
    Rabbitmq,
    /// Kafka (`kafka_brokers`, `kafka_cluster`).
    Kafka,
}

impl BrokerKind {
    /// The broker named by `--broker` if given, else by the config key `broker`.
    pub fn choose(flag: Option<&str>, cfg: &Config) -> Result<BrokerKind, String> {
        let (name, from) = match flag {
            Some(f) => (f, "--broker"),
            None => (cfg.broker.as_str(), "config key `broker`"),
        };
        match name {
            "nats" => Ok(BrokerKind::Nats),
            "rabbitmq" => Ok(BrokerKind::Rabbitmq),
            "kafka" => Ok(BrokerKind::Kafka),
            other => Err(format!(
                "{from}: unknown broker `{other}`; expected `nats`, `rabbitmq` or `kafka`"
            )),
        }
    }

    /// The cluster identity destinations on this broker are frozen with.
    pub fn cluster(self, cfg: &Config) -> &str {
        match self {
            BrokerKind::Nats => &cfg.nats_cluster,
            BrokerKind::Rabbitmq => &cfg.rabbitmq_cluster,
            BrokerKind::Kafka => &cfg.kafka_cluster,
        }
    }
}

/// The NATS TLS and credential options of the configuration (`nats_tls_*`,
/// `nats_require_tls`, `nats_creds_file`, `nats_nkey_seed_file`, `nats_user`,
/// `nats_password_file`, `nats_token_file`; empty strings are unset).
pub fn nats_options(cfg: &Config) -> NatsOptions {
    let path = |s: &str| (!s.is_empty()).then(|| std::path::PathBuf::from(s));
    NatsOptions {
        tls_ca_file: path(&cfg.nats_tls_ca_file),
        tls_cert_file: path(&cfg.nats_tls_cert_file),
        tls_key_file: path(&cfg.nats_tls_key_file),
        require_tls: cfg.nats_require_tls,
        creds_file: path(&cfg.nats_creds_file),
        nkey_seed_file: path(&cfg.nats_nkey_seed_file),
        user: (!cfg.nats_user.is_empty()).then(|| cfg.nats_user.clone()),
        password_file: path(&cfg.nats_password_file),
        token_file: path(&cfg.nats_token_file),
    }
}

/// The NATS adapter for the configured cluster, with its TLS and credentials
/// ([`nats_options`]; the error says what to check).
pub async fn connect_nats(cfg: &Config) -> Result<Nats, RunError> {
    Nats::connect_with(
        &cfg.nats_url,
        &cfg.nats_cluster,
        Duration::from_millis(cfg.ack_timeout_ms),
        &nats_options(cfg),
    )
    .await
    .map_err(RunError::broker)
}

/// The RabbitMQ TLS and credential options of the configuration (`rabbitmq_tls_ca_file`,
/// `rabbitmq_tls_cert_file`, `rabbitmq_tls_key_file`, `rabbitmq_password_file`; empty strings
/// are unset).
pub fn rabbitmq_options(cfg: &Config) -> RabbitOptions {
    let path = |s: &str| (!s.is_empty()).then(|| std::path::PathBuf::from(s));
    RabbitOptions {
        tls_ca_file: path(&cfg.rabbitmq_tls_ca_file),
        tls_cert_file: path(&cfg.rabbitmq_tls_cert_file),
        tls_key_file: path(&cfg.rabbitmq_tls_key_file),
        password_file: path(&cfg.rabbitmq_password_file),
    }
}

/// The RabbitMQ adapter for the configured cluster, with its TLS and credentials
/// ([`rabbitmq_options`]); `role` names the connection at the broker
/// (`sealpost-<role>-<pid>`), so an operator can find and close it.
pub async fn connect_rabbitmq(cfg: &Config, role: &str) -> Result<Rabbit, RunError> {
    Rabbit::connect_with(
        &cfg.rabbitmq_url,
        &cfg.rabbitmq_cluster,
        Duration::from_millis(cfg.ack_timeout_ms),
        &format!("sealpost-{role}-{}", std::process::id()),
        &rabbitmq_options(cfg),
    )
    .await
    .map_err(RunError::broker)
}

/// The Kafka adapter for the configured cluster; `role` names the client at the broker
/// (`sealpost-<role>-<pid>`).
pub async fn connect_kafka(cfg: &Config, role: &str) -> Result<Kafka, RunError> {
    Kafka::connect(kafka_config(cfg, role)?)
        .await
        .map_err(RunError::broker)
}

/// The Kafka adapter's settings from the runtime configuration; `role` names the client.
pub fn kafka_config(cfg: &Config, role: &str) -> Result<KafkaConfig, RunError> {
    let mut k = KafkaConfig::new(
        &cfg.kafka_brokers,
        &cfg.kafka_cluster,
        Duration::from_millis(cfg.ack_timeout_ms),
    );
    k.lookup_clock_margin_ms = cfg.kafka_lookup_clock_margin_ms;
    k.lookup_scan_max = cfg.kafka_lookup_scan_max;
    k.client_id = format!("sealpost-{role}-{}", std::process::id());
    k.client_properties =
        sealpost_kafka::parse_properties(&cfg.kafka_client_properties).map_err(|e| {
            RunError::broker(std::io::Error::other(format!(
                "config key `kafka_client_properties` (or KAFKA_CLIENT_PROPERTIES): {e}"
            )))
        })?;
    k.sasl_password_file = (!cfg.kafka_sasl_password_file.is_empty())
        .then(|| cfg.kafka_sasl_password_file.clone().into());
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_and_unknown_names_are_named() {
        let mut cfg = Config::default();
        assert_eq!(BrokerKind::choose(None, &cfg), Ok(BrokerKind::Nats));
        cfg.broker = "rabbitmq".into();
        assert_eq!(BrokerKind::choose(None, &cfg), Ok(BrokerKind::Rabbitmq));
        assert_eq!(BrokerKind::choose(Some("nats"), &cfg), Ok(BrokerKind::Nats));
        let e = BrokerKind::choose(Some("kafkaa"), &cfg).unwrap_err();
        assert!(e.contains("kafkaa") && e.contains("--broker"), "{e}");
        assert_eq!(BrokerKind::Rabbitmq.cluster(&cfg), "rabbitmq-local");
        assert_eq!(
            BrokerKind::choose(Some("kafka"), &cfg),
            Ok(BrokerKind::Kafka)
        );
        assert_eq!(BrokerKind::Kafka.cluster(&cfg), "kafka-local");
    }
}
