//! The subscription port: what a consumer needs from a broker, beside the producer's
//! [`crate::port::Broker`]. A subscription fetches a batch bounded in messages and bytes,
//! says what each delivered message is ([`Received`]: its position, its delivery count and
//! what its Sealpost headers claim), settles each message ([`Settlement`]: ack, send back
//! after a delay, or terminate) and reports the contiguous watermark every position up to
//! which is settled. Adapters implement it (`sealpost-nats`, `sealpost-kafka`,
//! `sealpost-rabbitmq`); the library's consumer (`sealpost::consumer::run`) drives it.
//!
//! The decisions are here, pure: [`decide_settlement`] turns what the inbox did with a
//! message (or why it could not) into its settlement, under the consumer's
//! [`RedeliveryPolicy`]; [`reconnect_backoff_ms`] paces a consumer whose broker went away;
//! [`decide_drained_watermark`] is the rule for a broker without an ack floor (a queue).
//! The shells execute them and decide nothing.

use std::future::Future;

use crate::encoding::Digest;
use crate::envelope::EventId;
use crate::inbox::{decide_failed_delivery, FailedDelivery, Failure, RedeliveryPolicy};
use crate::port::WireEnvelope;
use crate::signature::{present, Crypto, Presented, SignedClaim, SIGNATURE_LEN};

/// How much one fetch may return: at most `messages_max` messages and, past the first, at
/// most `bytes_max` payload bytes; waiting at most `wait_ms` for the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FetchLimits {
    /// Messages per batch at most (at least 1).
    pub messages_max: usize,
    /// Payload bytes per batch at most; a single larger message is still fetched alone.
    pub bytes_max: usize,
    /// How long a fetch waits for its first message.
    pub wait_ms: u64,
}

impl Default for FetchLimits {
    fn default() -> Self {
        FetchLimits {
            messages_max: 500,
            bytes_max: 8 << 20,
            wait_ms: 300,
        }
    }
}

impl FetchLimits {
    /// May a message of `size` bytes join a batch that holds `count` messages of `bytes`?
    /// The first message always may (a batch is never empty because of one large message).
    pub fn admits(&self, count: usize, bytes: usize, size: usize) -> bool {
        count == 0
            || (count < self.messages_max.max(1) && bytes.saturating_add(size) <= self.bytes_max)
    }
}

/// What a delivered message's Sealpost headers claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealpostHeaders {
    /// Event id.
    pub event_id: EventId,
    /// Delivery-set member.
    pub member: u16,
    /// The payload digest the headers claim (the consumer digests the payload itself).
    pub claimed_digest: Digest,
    /// The envelope's description (R30), when the headers carry it.
    pub envelope: Option<WireEnvelope>,
    /// The envelope generation the headers carry, if they do.
    pub envelope_generation: Option<u32>,
    /// The destination digest the headers carry, if they do.
    pub destination_digest: Option<Digest>,
    /// The `Sealpost-Signature` header, if any.
    pub signature: Option<String>,
}

/// Header: envelope generation (decimal), as every adapter writes it.
pub const H_ENVELOPE_GENERATION: &str = "Sealpost-Envelope-Generation";
/// Header: destination digest (`sha256:` hex), as every adapter writes it.
pub const H_DESTINATION_DIGEST: &str = "Sealpost-Destination-Digest";

impl SealpostHeaders {
    /// The headers a message's seal is checked with, read by an adapter's header getter:
    /// the envelope description, generation, destination digest and signature (each `None`
    /// when missing or malformed).
    pub fn with_seal<'a>(mut self, get: impl Fn(&str) -> Option<&'a str>) -> SealpostHeaders {
        self.envelope = WireEnvelope::from_headers(&get);
        self.envelope_generation = get(H_ENVELOPE_GENERATION).and_then(|v| v.parse().ok());
        self.destination_digest = get(H_DESTINATION_DIGEST).and_then(Digest::from_hex);
        self.signature = get(crate::signature::H_SIGNATURE).map(str::to_string);
        self
    }

    /// The claim a signature over this message must cover, rebuilt from these headers and the
    /// digest of the payload bytes actually received (`None` when the headers lack a part of
    /// it, which no message Sealpost sends does).
    pub fn claim(&self, payload_digest: Digest) -> Option<SignedClaim> {
        Some(SignedClaim {
            event_id: self.event_id,
            member: self.member,
            envelope_generation: self.envelope_generation?,
            payload_digest,
            destination_digest: self.destination_digest?,
            envelope: self.envelope.clone()?,
        })
    }

    /// What this message presents for `payload_digest` (the bytes received), its signature
    /// checked by the reader's `verify` ([`crate::signature::present`]).
    pub fn presented(
        &self,
        payload_digest: Digest,
        verify: impl FnOnce(&str, &[u8; SIGNATURE_LEN], &Digest) -> Crypto,
    ) -> Presented {
        present(
            self.signature.as_deref(),
            self.claim(payload_digest).as_ref(),
            verify,
        )
    }
}

/// One delivered message, as its adapter reads it.
#[derive(Clone, Debug)]
pub struct Received<'m> {
    /// The Sealpost headers, or what is wrong with them (in words for the dead letter).
    pub headers: Result<SealpostHeaders, String>,
    /// The position's stream, as the consumer's inbox records it (NATS: the stream; Kafka:
    /// `<topic>/<partition>`; RabbitMQ: the exchange).
    pub stream: String,
    /// The position in that stream (NATS: the stream sequence; Kafka: offset + 1; RabbitMQ:
    /// the attempt id). The receipt's numbers.
    pub sequence: u64,
    /// The broker subject or routing key.
    pub subject: String,
    /// How many times the broker delivered it, this delivery included (at least 1).
    pub delivered: u64,
    /// The payload as received.
    pub payload: &'m [u8],
}

/// What the consumer tells the broker about one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// Done (applied, a duplicate, refused or dead-lettered with its record committed):
    /// never deliver it again.
    Ack,
    /// Not done: deliver it again after `delay_ms`.
    RetryAfter {
        /// Delay before the redelivery.
        delay_ms: u64,
    },
    /// Record a dead letter first; once it is committed, tell the broker never to deliver
    /// it again (`Terminate` reaches the adapter only after the record commits).
    Terminate,
}

/// What became of a delivered message before it is settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Processed {
    /// Applied: the effect and the inbox row committed.
    Applied,
    /// Seen before: nothing ran.
    Duplicate,
    /// Refused and recorded in the consumer's quarantine: never applied.
    Quarantined,
    /// Not applied and nothing recorded: the effect failed on its own
    /// ([`Failure::Message`]), or the whole transaction failed ([`Failure::Transaction`]).
    Failed(Failure),
    /// Its Sealpost headers are missing or do not parse.
    Unreadable,
}

/// Decides how a message is settled given what processing it did, its delivery count
/// (`delivered`, 1 = first) and the consumer's policy: everything committed is acked; a
/// failure goes back with the core's growing delay and, when the message itself failed at
/// the policy's limit, is dead-lettered ([`Settlement::Terminate`]); a message with
/// unreadable headers is dead-lettered at once. A failed transaction never terminates.
///
/// *Never*: a message whose effect failed is acked (its event would be lost to this
/// consumer, with no record).
pub fn decide_settlement(
    processed: Processed,
    delivered: u64,
    policy: RedeliveryPolicy,
) -> Settlement {
    let failed = |f: FailedDelivery| match f {
        FailedDelivery::Retry { delay_ms } => Settlement::RetryAfter { delay_ms },
        FailedDelivery::DeadLetter => Settlement::Terminate,
    };
    match processed {
        Processed::Applied | Processed::Duplicate | Processed::Quarantined => Settlement::Ack,
        Processed::Failed(f) => failed(decide_failed_delivery(delivered, f, policy)),
        Processed::Unreadable => failed(crate::inbox::decide_unreadable_delivery()),
    }
}

/// First delay before reconnecting a subscription (or a database) that went away.
pub const RECONNECT_FIRST_MS: u64 = 100;
/// Longest delay between reconnect attempts.
pub const RECONNECT_MAX_MS: u64 = 30_000;

/// How long a consumer waits before its `failures`-th consecutive reconnect attempt (1 =
/// the first): 100 ms doubling to 30 s. Never zero: a broker that refuses at once is not
/// hammered.
pub fn reconnect_backoff_ms(failures: u32) -> u64 {
    backoff_ms(RECONNECT_FIRST_MS, RECONNECT_MAX_MS, failures)
}

/// The wait before the `failures`-th consecutive try (1 = the first retry): `first_ms`,
/// doubling with each further failure, never above `max_ms` (and never below 1 ms). The one
/// backoff rule of the consumer's reconnects and of the dispatcher's and reconciler's
/// database errors.
pub fn backoff_ms(first_ms: u64, max_ms: u64, failures: u32) -> u64 {
    let doublings = failures.saturating_sub(1).min(32);
    first_ms
        .max(1)
        .saturating_mul(1u64 << doublings)
        .min(max_ms.max(1))
}

/// A queue's watermark candidate: the highest position the consumer had seen at `seen_at_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainCandidate {
    /// The highest position (attempt id) seen.
    pub position: u64,
    /// When it was seen (the consumer's clock).
    pub seen_at_ms: u64,
}

/// The watermark rule for a broker without an ack floor (RabbitMQ: a queue forgets what it
/// delivered), whose positions are attempt ids allocated in increasing order when a claim
/// registers them. An attempt id at or below `candidate.position` was registered before
/// that position was seen, so its message reached the queue (if it ever did) within
/// `settle_ms` after `candidate.seen_at_ms` (the dispatcher's lease bounds when a message
/// may leave, R9; `settle_ms` adds the network's share). If the queue is `drained` now —
/// nothing ready, no other consumer, nothing held unsettled by this one — and `settle_ms`
/// has passed since, every such message was settled: the candidate's position is the
/// watermark. Otherwise there is none yet.
pub fn decide_drained_watermark(
    candidate: DrainCandidate,
    now_ms: u64,
    settle_ms: u64,
    drained: bool,
) -> Option<u64> {
    (drained && now_ms >= candidate.seen_at_ms.saturating_add(settle_ms))
        .then_some(candidate.position)
}

/// A broker subscription: the consumer side of an adapter. A subscription knows its broker's
/// wire format and nothing about SQL; what each answer means is decided by this module's
/// functions, executed by `sealpost::consumer::run`.
pub trait Subscription: Send {
    /// One delivered message, held until it is settled.
    type Message: Send + Sync;
    /// A broker failure (the consumer reconnects with [`reconnect_backoff_ms`]).
    type Error: std::error::Error + Send + Sync + 'static;

    /// Fetches the next batch within `limits`: empty when nothing arrived in time.
    fn fetch(
        &mut self,
        limits: FetchLimits,
    ) -> impl Future<Output = Result<Vec<Self::Message>, Self::Error>> + Send;

    /// What a delivered message is: its position, delivery count, headers and payload.
    fn read<'m>(&self, message: &'m Self::Message) -> Received<'m>;

    /// Settles a fetched batch, each message once, in the order it was fetched.
    /// [`Settlement::Terminate`] is passed only after the message's dead letter committed.
    fn settle(
        &mut self,
        batch: Vec<(Self::Message, Settlement)>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The contiguous watermark per stream as the outbox's `consumer_progress` records it
    /// (the stream the receipts name): every position up to it is settled for good. Empty
    /// when there is none to report yet.
    fn watermarks(
        &mut self,
    ) -> impl Future<Output = Result<Vec<(String, u64)>, Self::Error>> + Send;

    /// Messages the broker holds for this consumer that it has not settled, if the broker
    /// can tell.
    fn lag(&mut self) -> impl Future<Output = Option<u64>> + Send;

    /// Opens the subscription again after a failure; what was unsettled comes back.
    fn reconnect(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settlements() {
        let p = RedeliveryPolicy {
            max_deliveries: 3,
            backoff_first_ms: 100,
            backoff_max_ms: 30_000,
        };
        for ok in [
            Processed::Applied,
            Processed::Duplicate,
            Processed::Quarantined,
        ] {
            assert_eq!(decide_settlement(ok, 1, p), Settlement::Ack);
            assert_eq!(decide_settlement(ok, 9, p), Settlement::Ack);
        }
        let m = Processed::Failed(Failure::Message);
        assert_eq!(
            decide_settlement(m, 1, p),
            Settlement::RetryAfter { delay_ms: 100 }
        );
        assert_eq!(
            decide_settlement(m, 2, p),
            Settlement::RetryAfter { delay_ms: 200 }
        );
        assert_eq!(decide_settlement(m, 3, p), Settlement::Terminate);
        // A failed effect is never acked; a failed transaction never terminates.
        for n in 1..20 {
            assert_ne!(decide_settlement(m, n, p), Settlement::Ack);
            let t = decide_settlement(Processed::Failed(Failure::Transaction), n, p);
            assert!(matches!(t, Settlement::RetryAfter { .. }), "{t:?}");
        }
        assert_eq!(
            decide_settlement(Processed::Unreadable, 1, p),
            Settlement::Terminate
        );
    }

    #[test]
    fn reconnects_back_off_from_100_ms_to_30_s() {
        assert_eq!(reconnect_backoff_ms(0), 100);
        assert_eq!(reconnect_backoff_ms(1), 100);
        assert_eq!(reconnect_backoff_ms(2), 200);
        assert_eq!(reconnect_backoff_ms(9), 25_600);
        assert_eq!(reconnect_backoff_ms(10), 30_000);
        assert_eq!(reconnect_backoff_ms(u32::MAX), 30_000);
    }

    #[test]
    fn fetch_limits_bound_messages_and_bytes() {
        let l = FetchLimits {
            messages_max: 2,
            bytes_max: 100,
            wait_ms: 1,
        };
        assert!(l.admits(0, 0, 1_000), "one large message is fetched alone");
        assert!(l.admits(1, 50, 50));
        assert!(!l.admits(1, 50, 51));
        assert!(!l.admits(2, 0, 0));
    }

    #[test]
    fn a_queue_watermark_needs_a_drained_moment_after_the_settle_time() {
        let c = DrainCandidate {
            position: 42,
            seen_at_ms: 1_000,
        };
        assert_eq!(decide_drained_watermark(c, 1_500, 1_000, true), None);
        assert_eq!(decide_drained_watermark(c, 2_000, 1_000, false), None);
        assert_eq!(decide_drained_watermark(c, 2_000, 1_000, true), Some(42));
    }
}
