//! Where a message's JetStream cost goes: publishes N messages of 200 bytes three ways, in
//! batches of 1,000 with every acknowledgement awaited together (as a dispatcher and the
//! careful relay do), each into a fresh stream, and prints per message the wall time, the
//! CPU of the `nats-server` process and of this process (from `/proc`, so on Linux with
//! the server on this machine):
//!
//! - `relay`: one subject per stream, `Nats-Msg-Id` only (the careful relay's message);
//! - `subject per event`: a subject per event with `Nats-Msg-Id` and
//!   `Nats-Expected-Last-Subject-Sequence: 0` (create-if-absent), no other header;
//! - `adapter`: [`Nats::send_batch`] as the dispatcher calls it (the same subject per event,
//!   and Sealpost's headers);
//! - `atomic batch` (NATS 2.12 and later; skipped on an older server): the `subject per event`
//!   messages without `Nats-Msg-Id` (a batch refuses it), each batch of 1,000 sent as one
//!   atomic batch (`Nats-Batch-Id`, `Nats-Batch-Sequence`, the first message and the commit
//!   as requests, the rest plain publishes) into a stream with `allow_atomic`.
//!
//! Before the rates, on a 2.12+ server, it shows what an atomic batch does with
//! create-if-absent messages (`Nats-Expected-Last-Subject-Sequence: 0`): a batch of new
//! subjects, a batch with one subject already stored, and a batch carrying `Nats-Msg-Id`.
//! For each: the server's answer to the commit, and which of the subjects the stream holds
//! afterwards, at which sequences.
//!
//! ```text
//! cargo run --release -p sealpost-cli --example nats_cost -- 100000
//! ```
//!
//! `NATS_URL` (default `nats://127.0.0.1:4222`) names the server; streams `COST<tag><n>`
//! are created and deleted.

use std::time::{Duration, Instant};

use async_nats::header::{NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
use async_nats::jetstream;
use async_nats::HeaderMap;
use sealpost_cli::bench::OrderMessages;
use sealpost_cli::cpu;
use sealpost_core::envelope::EventId;
use sealpost_core::port::{Broker, SendRequest, SendResult};
use sealpost_nats::{subject, Nats};

/// The `sealpost` binary's allocator, so that the process CPU is what a dispatcher spends.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BATCH: usize = 1_000;
const PAYLOAD: [u8; 200] = [b'x'; 200];

fn event_id(n: usize) -> EventId {
    let mut id = *uuid::Uuid::now_v7().as_bytes();
    id[8..16].copy_from_slice(&(n as u64).to_be_bytes());
    EventId(id)
}

#[derive(Clone, Copy, PartialEq)]
enum Way {
    Relay,
    PerEventSubject,
    Adapter,
    AtomicBatch,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::Relay => "relay",
            Way::PerEventSubject => "subject per event",
            Way::Adapter => "adapter",
            Way::AtomicBatch => "atomic batch",
        }
    }
}

/// Publishes `n` messages `way` into a fresh stream, deleted afterwards (also when a publish
/// failed); returns the wall time and the CPU per message.
async fn run(nats: &Nats, way: Way, n: usize, tag: &str) -> Result<(f64, cpu::PerEvent), String> {
    let topic = format!("COST{tag}{}", std::process::id());
    let _ = nats.js.delete_stream(&topic).await;
    nats.ensure_stream(&topic)
        .await
        .map_err(|e| e.to_string())?;
    if way == Way::AtomicBatch {
        allow_atomic(nats, &topic).await?;
    }
    let out = publish(nats, way, n, &topic).await;
    let _ = nats.js.delete_stream(&topic).await;
    out
}

async fn publish(
    nats: &Nats,
    way: Way,
    n: usize,
    topic: &str,
) -> Result<(f64, cpu::PerEvent), String> {
    // The adapter's requests (the structs a dispatcher builds from its claim) are built
    // before the clock starts; building each message's headers is the adapter's, inside it,
    // as the other two ways build theirs inside it.
    let messages = OrderMessages::new(&nats.cluster, topic, &PAYLOAD);
    let mut requests: Vec<Vec<SendRequest>> = match way {
        Way::Adapter => (0..n)
            .step_by(BATCH)
            .map(|from| {
                (from..(from + BATCH).min(n))
                    .map(|i| {
                        messages.request(
                            event_id(i),
                            i as u64 + 1,
                            format!("o-{i}"),
                            PAYLOAD.to_vec(),
                        )
                    })
                    .collect()
            })
            .collect(),
        _ => Vec::new(),
    };
    requests.reverse();
    let (cpu0, t0) = (cpu::sample(), Instant::now());
    let mut sent = 0;
    while sent < n {
        let upto = (sent + BATCH).min(n);
        match way {
            Way::Adapter => {
                let batch = requests.pop().ok_or("fewer batches than messages")?;
                let later = Instant::now() + Duration::from_secs(30);
                for r in nats.send_batch(batch, later).await {
                    if !matches!(r, SendResult::Receipt(_)) {
                        return Err(format!("the adapter answered {r:?}"));
                    }
                }
            }
            Way::AtomicBatch => {
                let messages: Vec<(String, HeaderMap)> = (sent..upto)
                    .map(|i| {
                        let id = event_id(i);
                        let mut headers = HeaderMap::new();
                        headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
                        (subject(topic, id, 0), headers)
                    })
                    .collect();
                let answer = atomic_batch(nats, messages).await?;
                if answer.get("count").is_none() {
                    return Err(format!("the batch's commit was answered {answer}"));
                }
            }
            Way::Relay | Way::PerEventSubject => {
                let mut acks = Vec::with_capacity(upto - sent);
                for i in sent..upto {
                    let id = event_id(i);
                    let mut headers = HeaderMap::new();
                    headers.insert(NATS_MESSAGE_ID, id.to_string().as_str());
                    let subj = match way {
                        Way::Relay => format!("sp.{topic}.all"),
                        _ => {
                            headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
                            subject(topic, id, 0)
                        }
                    };
                    let publish = jetstream::message::PublishMessage::build()
                        .payload(PAYLOAD.to_vec().into())
                        .headers(headers);
                    acks.push(
                        nats.js
                            .send_publish(subj, publish)
                            .await
                            .map_err(|e| e.to_string())?,
                    );
                }
                for a in futures::future::join_all(acks.into_iter().map(|a| async move { a.await }))
                    .await
                {
                    a.map_err(|e| e.to_string())?;
                }
            }
        }
        sent = upto;
    }
    Ok((
        t0.elapsed().as_secs_f64(),
        cpu0.per_event_until(&cpu::sample(), n as u64),
    ))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .map_err(|e| format!("messages must be a number ({s:?}: {e})"))?,
        None => 100_000,
    };
    if n == 0 {
        return Err("messages must be at least 1".into());
    }
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let nats = Nats::connect(&url, "nats-local", Duration::from_secs(10))
        .await
        .map_err(|e| format!("{e} (is nats-server running with -js at {url}?)"))?;
    if cpu::sample().nats_s.is_none() {
        eprintln!("no nats-server process on this machine: its CPU is not shown");
    }
    // An optional second argument runs one way only (for a profiler): relay, subject, adapter.
    let only = std::env::args().nth(2);
    println!(
        "{n} messages of {} bytes, batches of {BATCH}",
        PAYLOAD.len()
    );
    let version = nats.client.server_info().version;
    let atomic = at_least(&version, 2, 12);
    if atomic {
        atomic_semantics(&nats).await?;
    } else {
        println!("nats-server {version}: no atomic batches (2.12 and later), that way is skipped");
    }
    // Twice each, interleaved, so a warming server or page cache does not favour one way.
    for round in 0..2 {
        for (k, way) in [
            Way::Relay,
            Way::PerEventSubject,
            Way::Adapter,
            Way::AtomicBatch,
        ]
        .into_iter()
        .enumerate()
        {
            if way == Way::AtomicBatch && !atomic {
                continue;
            }
            if only.as_deref().is_some_and(|o| !way.name().starts_with(o)) {
                continue;
            }
            let (wall, cpu) = run(&nats, way, n, &format!("{round}{k}")).await?;
            let us = |v: Option<f64>| v.map_or("?".into(), |v| format!("{v:.1}"));
            println!(
                "{:<18} {:>7.0} msg/s   wall {:>5.1} us/msg   nats-server cpu {:>5} us/msg   this process cpu {:>5} us/msg",
                way.name(),
                n as f64 / wall,
                wall * 1e6 / n as f64,
                us(cpu.nats_us),
                us(cpu.process_us)
            );
        }
    }
    Ok(())
}

/// Whether a `nats-server` version string is at least `major.minor`.
fn at_least(version: &str, major: u64, minor: u64) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().unwrap_or(0));
    let (a, b) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

/// Turns on atomic batch publishes for the stream `topic` (`allow_atomic`, 2.12+).
async fn allow_atomic(nats: &Nats, topic: &str) -> Result<(), String> {
    let mut stream = nats.js.get_stream(topic).await.map_err(|e| e.to_string())?;
    let mut config = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .config
        .clone();
    config.allow_atomic_publish = true;
    nats.js
        .update_stream(config)
        .await
        .map_err(|e| format!("allow_atomic on {topic}: {e}"))?;
    Ok(())
}

/// Sends `messages` (subject, headers) as one atomic batch of a fresh id: the first message
/// and the commit as requests, the rest as plain publishes. Returns the server's answer to
/// the commit, or to the first message if that was an error.
async fn atomic_batch(
    nats: &Nats,
    messages: Vec<(String, HeaderMap)>,
) -> Result<serde_json::Value, String> {
    let batch_id = uuid::Uuid::new_v4().simple().to_string();
    let last = messages.len();
    for (k, (subj, mut headers)) in messages.into_iter().enumerate() {
        let seq = k + 1;
        headers.insert("Nats-Batch-Id", batch_id.as_str());
        headers.insert("Nats-Batch-Sequence", seq.to_string().as_str());
        if seq == last {
            headers.insert("Nats-Batch-Commit", "1");
        }
        let payload = PAYLOAD.to_vec().into();
        if seq == 1 || seq == last {
            let answer = nats
                .client
                .request_with_headers(subj, headers, payload)
                .await
                .map_err(|e| e.to_string())?;
            // The server answers the first message with nothing when it takes it.
            if seq < last && answer.payload.is_empty() {
                continue;
            }
            let answer: serde_json::Value = serde_json::from_slice(&answer.payload)
                .map_err(|e| format!("the server's answer to a batch is not JSON: {e}"))?;
            if seq == last || answer.get("error").is_some() {
                return Ok(answer);
            }
        } else {
            nats.client
                .publish_with_headers(subj, headers, payload)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    Err("an empty batch".into())
}

/// What an atomic batch does with create-if-absent messages, printed: new subjects, one
/// subject already stored, and `Nats-Msg-Id` in a batch.
async fn atomic_semantics(nats: &Nats) -> Result<(), String> {
    let topic = format!("COSTATOMIC{}", std::process::id());
    let _ = nats.js.delete_stream(&topic).await;
    nats.ensure_stream(&topic)
        .await
        .map_err(|e| e.to_string())?;
    allow_atomic(nats, &topic).await?;
    let out = async {
        let ids: Vec<EventId> = (0..9).map(event_id).collect();
        let create = |i: usize, msg_id: bool| {
            let mut headers = HeaderMap::new();
            headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
            if msg_id {
                headers.insert(NATS_MESSAGE_ID, ids[i].to_string().as_str());
            }
            (subject(&topic, ids[i], 0), headers)
        };
        let cases: [(&str, Vec<(String, HeaderMap)>); 3] = [
            ("5 new subjects", (0..5).map(|i| create(i, false)).collect()),
            (
                "2 new, then 1 already stored, then 2 new",
                [5, 6, 2, 7, 3].iter().map(|&i| create(i, false)).collect(),
            ),
            ("1 new with Nats-Msg-Id", vec![create(8, true)]),
        ];
        let mut stream = nats
            .js
            .get_stream(&topic)
            .await
            .map_err(|e| e.to_string())?;
        for (name, messages) in cases {
            let subjects: Vec<String> = messages.iter().map(|m| m.0.clone()).collect();
            let answer = atomic_batch(nats, messages).await?;
            let mut held = Vec::new();
            for (k, subj) in subjects.iter().enumerate() {
                held.push(match stream.get_last_raw_message_by_subject(subj).await {
                    Ok(m) => format!("#{} at {}", k + 1, m.sequence),
                    Err(_) => format!("#{} absent", k + 1),
                });
            }
            let messages = stream
                .info()
                .await
                .map_err(|e| e.to_string())?
                .state
                .messages;
            println!("atomic batch, {name}: commit answered {answer}");
            println!(
                "  the stream holds {messages} messages; {}",
                held.join(", ")
            );
        }
        Ok(())
    }
    .await;
    let _ = nats.js.delete_stream(&topic).await;
    out
}
