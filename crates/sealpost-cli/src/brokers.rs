//! Which broker the `sealpost` command talks to (config key `broker`, flag `--broker`), and
//! connecting to it. The loops are generic over the broker port; only this file and the
//! per-broker consumers know which adapters exist.

use std::time::Duration;

use sealpost::runtime::RunError;
use sealpost_kafka::{Kafka, KafkaConfig};
use sealpost_nats::Nats;
use sealpost_rabbitmq::Rabbit;

use crate::config::Settings;

/// A broker the command can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// NATS JetStream (`[nats]`).
    Nats,
    /// RabbitMQ (`[rabbitmq]`).
    Rabbitmq,
    /// Kafka (`[kafka]`).
    Kafka,
}

impl BrokerKind {
    /// The broker named by `--broker` if given, else by the config key `broker`.
    pub fn choose(flag: Option<&str>, cfg: &Settings) -> Result<BrokerKind, String> {
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
    pub fn cluster(self, cfg: &Settings) -> &str {
        match self {
            BrokerKind::Nats => &cfg.nats.cluster,
            BrokerKind::Rabbitmq => &cfg.rabbitmq.cluster,
            BrokerKind::Kafka => &cfg.kafka.cluster,
        }
    }
}

/// The NATS adapter for the configured cluster, with its TLS and credentials (the error
/// says what to check).
pub async fn connect_nats(cfg: &Settings) -> Result<Nats, RunError> {
    cfg.nats
        .connect(Duration::from_millis(cfg.ack_timeout_ms))
        .await
        .map_err(RunError::broker)
}

/// The RabbitMQ adapter for the configured cluster, with its TLS and credentials; `role`
/// names the connection at the broker (`sealpost-<role>-<pid>`), so an operator can find
/// and close it.
pub async fn connect_rabbitmq(cfg: &Settings, role: &str) -> Result<Rabbit, RunError> {
    cfg.rabbitmq
        .connect(
            Duration::from_millis(cfg.ack_timeout_ms),
            &format!("sealpost-{role}-{}", std::process::id()),
        )
        .await
        .map_err(RunError::broker)
}

/// The Kafka adapter for the configured cluster; `role` names the client at the broker
/// (`sealpost-<role>-<pid>`).
pub async fn connect_kafka(cfg: &Settings, role: &str) -> Result<Kafka, RunError> {
    Kafka::connect(kafka_config(cfg, role))
        .await
        .map_err(RunError::broker)
}

/// The Kafka adapter's settings, the client named for `role`.
pub fn kafka_config(cfg: &Settings, role: &str) -> KafkaConfig {
    KafkaConfig {
        ack_timeout: Duration::from_millis(cfg.ack_timeout_ms),
        client_id: format!("sealpost-{role}-{}", std::process::id()),
        ..cfg.kafka.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_and_unknown_names_are_named() {
        let mut cfg = Settings::default();
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
