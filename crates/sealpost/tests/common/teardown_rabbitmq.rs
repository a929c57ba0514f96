//! RabbitMQ exchanges and queues a test creates, deleted when their guard drops (also when
//! the test fails). Included by path by the tests of crates that depend on
//! `sealpost-rabbitmq`. Everything is in the vhost `/`, but for the rights tests of
//! `sealpost-rabbitmq`, which make a vhost and users of their own and remove them with a
//! `Teardown` of their own.

#![allow(dead_code, unused_imports)]

// Each flavour brings the guard type along, so a test crate includes only the files whose
// client it depends on; a crate that includes several (or `mod.rs` too) gets several copies
// of the same small module, which is harmless.
#[allow(clippy::duplicate_mod)]
#[path = "teardown.rs"]
mod teardown;
pub use teardown::Teardown;

use std::time::Duration;

use sealpost_rabbitmq::Rabbit;

/// The shared RabbitMQ of the tests.
pub const RABBITMQ_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Deletes exchange `topic` and the queues of `consumers` on it ([`sealpost_rabbitmq::queue_name`])
/// at `url` when dropped; ones already gone are fine (RabbitMQ's deletes are idempotent).
pub fn destination(url: &str, topic: &str, consumers: &[impl AsRef<str>]) -> Teardown {
    let url = url.to_string();
    let topic = topic.to_string();
    let consumers: Vec<String> = consumers.iter().map(|c| c.as_ref().to_string()).collect();
    Teardown::new(
        format!("RabbitMQ exchange {topic} and the queues of {consumers:?}"),
        move || async move {
            let rabbit = Rabbit::connect(
                &url,
                "teardown",
                Duration::from_secs(10),
                &format!("sealpost-test-teardown-{topic}"),
            )
            .await
            .map_err(|e| e.to_string())?;
            rabbit
                .delete_destination(&topic, &consumers)
                .await
                .map_err(|e| e.to_string())
        },
    )
}
