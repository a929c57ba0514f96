//! Kafka topics a test creates, deleted when their guard drops (also when the test fails).
//! Included by path by the tests of crates that depend on `sealpost-kafka`.

#![allow(dead_code, unused_imports)]

// Each flavour brings the guard type along, so a test crate includes only the files whose
// client it depends on; a crate that includes several (or `mod.rs` too) gets several copies
// of the same small module, which is harmless.
#[allow(clippy::duplicate_mod)]
#[path = "teardown.rs"]
mod teardown;
pub use teardown::Teardown;

use sealpost_kafka::{Kafka, KafkaConfig};

/// A Kafka adapter config for `brokers` as `cluster`, with the librdkafka `properties`
/// (`key=value,...`, as `KAFKA_CLIENT_PROPERTIES` gives them) and a 5 s ack timeout: callers
/// pass `common::kafka_brokers()`, `common::KAFKA_CLUSTER`, `common::kafka_client_properties()`.
pub fn config(brokers: &str, cluster: &str, properties: &str) -> KafkaConfig {
    let mut cfg = KafkaConfig::new(brokers, cluster, std::time::Duration::from_secs(5));
    cfg.client_properties = sealpost_kafka::parse_properties(properties)
        .expect("KAFKA_CLIENT_PROPERTIES must be key=value pairs separated by commas");
    cfg
}

/// Deletes `topic` from the cluster `cfg` reaches when dropped; a topic already gone is fine.
pub fn topic(cfg: &KafkaConfig, topic: &str) -> Teardown {
    let cfg = cfg.clone();
    let topic = topic.to_string();
    Teardown::new(format!("Kafka topic {topic}"), move || async move {
        let kafka = Kafka::connect(cfg).await.map_err(|e| e.to_string())?;
        kafka.delete_topic(&topic).await.map_err(|e| e.to_string())
    })
}
