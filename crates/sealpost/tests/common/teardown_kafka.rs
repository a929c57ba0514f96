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

/// Deletes `topic` from the cluster `cfg` reaches when dropped; a topic already gone is fine.
pub fn topic(cfg: &KafkaConfig, topic: &str) -> Teardown {
    let cfg = cfg.clone();
    let topic = topic.to_string();
    Teardown::new(format!("Kafka topic {topic}"), move || async move {
        let kafka = Kafka::connect(cfg).await.map_err(|e| e.to_string())?;
        kafka.delete_topic(&topic).await.map_err(|e| e.to_string())
    })
}
