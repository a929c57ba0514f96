//! JetStream streams a test creates, deleted when their guard drops (also when the test
//! fails). Included by path by the tests of crates that depend on `async-nats`
//! (`sealpost-nats`, `sealpost-cli`).

#![allow(dead_code, unused_imports)]

// Each flavour brings the guard type along, so a test crate includes only the files whose
// client it depends on; a crate that includes several (or `mod.rs` too) gets several copies
// of the same small module, which is harmless.
#[allow(clippy::duplicate_mod)]
#[path = "teardown.rs"]
mod teardown;
pub use teardown::Teardown;

use async_nats::jetstream::{self, context::GetStreamErrorKind, ErrorCode};

/// The shared NATS server of the tests.
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// Deletes stream `name` on the NATS server at `url` when dropped; a stream that is already
/// gone is fine.
pub fn stream(url: &str, name: &str) -> Teardown {
    let (url, name) = (url.to_string(), name.to_string());
    Teardown::new(
        format!("JetStream stream {name} at {url}"),
        move || async move {
            // A drill may have just restarted the server: wait for it a little.
            let mut tries = 0;
            let client = loop {
                match async_nats::connect(&url).await {
                    Ok(c) => break c,
                    Err(e) if tries == 40 => return Err(format!("cannot connect: {e}")),
                    Err(_) => {
                        tries += 1;
                        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                    }
                }
            };
            let js = jetstream::new(client.clone());
            let mut tries = 0;
            let r = loop {
                match js.delete_stream(&name).await {
                    Ok(_) => break Ok(()),
                    Err(e) => match e.kind() {
                        GetStreamErrorKind::JetStream(j)
                            if j.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                        {
                            break Ok(())
                        }
                        // JetStream not answering yet (a restarted server): ask again.
                        GetStreamErrorKind::Request if tries < 20 => {
                            tries += 1;
                            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                        }
                        _ => break Err(e.to_string()),
                    },
                }
            };
            let _ = client.drain().await;
            r
        },
    )
}

/// [`stream`] on the shared server.
pub fn shared_stream(name: &str) -> Teardown {
    stream(NATS_URL, name)
}
