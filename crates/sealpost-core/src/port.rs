//! The broker port: what Sealpost needs from a broker, as one small trait, and what an
//! adapter declares it can do, as data. NATS JetStream is the first adapter
//! (`sealpost-nats`); Kafka and RabbitMQ follow behind the same trait.
//!
//! The trait has two questions and nothing else:
//! * "send this batch before this deadline" — each message ends as a receipt, provably never
//!   sent, permanently refused (with a reason), already stored (the broker itself refused a
//!   second copy), or no answer;
//! * "did you store event X at destination D?" — found (with its receipt), absent,
//!   unavailable, or cannot be asked ([`Lookup`]).
//!
//! The adapter's limits are [`Capabilities`], read by the dispatcher and reconciler machines
//! and by the core's decisions; a caller never guesses them from behaviour.
//!
//! *Invariant:* an adapter never sends a message once its batch deadline has passed (less
//! its declared handover margin, [`may_leave`]): it answers [`SendResult::NeverSent`] with
//! [`NeverSentReason::DeadlinePassed`] instead. The
//! deadline is derived from the claim's lease on the database clock
//! ([`crate::dispatcher::send_deadline_ms`]), so a send can never leave after another
//! dispatcher or the reconciler may have taken the row over (R9).

use std::future::Future;

use crate::encoding::Digest;
use crate::envelope::{Destination, EventId};
use crate::receipt::Receipt;
pub use crate::reconcile::Lookup;
pub use crate::subscription::{
    decide_settlement, FetchLimits, Processed, Received, SealpostHeaders, Settlement, Subscription,
};

/// What an adapter can do, declared once. The core's decisions take these into account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// The broker can answer "did you store event X at destination D?" (R13). Without it the
    /// reconciler may only retry to the same destination (R14).
    pub lookup_by_event_id: bool,
    /// The broker drops a re-publish of the same message id within this window, answering
    /// with the original position. `None`: no deduplication by id.
    pub duplicate_window_ms: Option<u64>,
    /// The broker itself refuses a second copy of an event forever (NATS
    /// `Nats-Expected-Last-Subject-Sequence: 0` on a per-event subject). A second stored copy
    /// at such a broker is a protocol violation, not a consumer's problem.
    pub create_if_absent: bool,
    /// Messages with the same routing key keep their order (Kafka partitions).
    pub per_key_ordering: bool,
    /// A message is handed to the broker client only while the batch deadline is more than
    /// this far away: the time the client may still spend transmitting it after the handover
    /// (librdkafka retries a record inside the client and enforces its timeout about once a
    /// second: Kafka declares 1,500 ms; a client that sends at once declares 0). See
    /// [`may_leave`].
    pub handover_margin_ms: u64,
    /// The lookup is a scan that can answer many unknown events of one partition and time
    /// window at once ([`Broker::lookup_many`]); `None`: one event per lookup.
    pub lookup_scan: Option<crate::reconcile::LookupScan>,
}

/// The deadline rule, the one copy every adapter and the simulator call: may a message be
/// handed to the broker client with `time_left` until its batch deadline? Only while more
/// than the adapter's declared [`Capabilities::handover_margin_ms`] is left, so that no
/// transmission of it can happen after the claim's lease (R9).
pub fn may_leave(time_left: std::time::Duration, caps: &Capabilities) -> bool {
    time_left > std::time::Duration::from_millis(caps.handover_margin_ms)
}

/// The sealed envelope's description of the event, carried on the wire as headers by every
/// adapter ([`WireEnvelope::headers`], the same names on every broker), so a consumer can
/// route by type, check the schema and detect a gap in an aggregate's versions without
/// reading the payload. Informative: what a consumer *trusts* is the payload digest and the
/// inbox, not these.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WireEnvelope {
    /// Event type, e.g. `order.created.v1`.
    pub event_type: String,
    /// Aggregate type, e.g. `order`.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Aggregate version (per-aggregate ordering sends versions in this order, R29).
    pub aggregate_version: u64,
    /// When the business fact happened (unix ms, the producer's clock).
    pub occurred_at_ms: u64,
    /// Tenant.
    pub tenant: String,
    /// Digest of the payload schema name.
    pub payload_schema_digest: Digest,
}

/// Header: event type ([`WireEnvelope`]).
pub const H_EVENT_TYPE: &str = "Sealpost-Event-Type";
/// Header: aggregate type.
pub const H_AGGREGATE_TYPE: &str = "Sealpost-Aggregate-Type";
/// Header: aggregate id.
pub const H_AGGREGATE_ID: &str = "Sealpost-Aggregate-Id";
/// Header: aggregate version (decimal).
pub const H_AGGREGATE_VERSION: &str = "Sealpost-Aggregate-Version";
/// Header: occurred at (unix ms, decimal).
pub const H_OCCURRED_AT_MS: &str = "Sealpost-Occurred-At-Ms";
/// Header: tenant.
pub const H_TENANT: &str = "Sealpost-Tenant";
/// Header: payload schema digest (`sha256:` hex).
pub const H_PAYLOAD_SCHEMA: &str = "Sealpost-Payload-Schema";

impl WireEnvelope {
    /// The headers every adapter writes, as (name, value) pairs.
    pub fn headers(&self) -> [(&'static str, String); 7] {
        [
            (H_EVENT_TYPE, self.event_type.clone()),
            (H_AGGREGATE_TYPE, self.aggregate_type.clone()),
            (H_AGGREGATE_ID, self.aggregate_id.clone()),
            (H_AGGREGATE_VERSION, self.aggregate_version.to_string()),
            (H_OCCURRED_AT_MS, self.occurred_at_ms.to_string()),
            (H_TENANT, self.tenant.clone()),
            (
                H_PAYLOAD_SCHEMA,
                self.payload_schema_digest.to_prefixed_hex(),
            ),
        ]
    }

    /// Reads them back (a consumer's side); `None` when a header is missing or malformed
    /// (a message from before these headers existed, or from another producer).
    pub fn from_headers<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<WireEnvelope> {
        Some(WireEnvelope {
            event_type: get(H_EVENT_TYPE)?.to_string(),
            aggregate_type: get(H_AGGREGATE_TYPE)?.to_string(),
            aggregate_id: get(H_AGGREGATE_ID)?.to_string(),
            aggregate_version: get(H_AGGREGATE_VERSION)?.parse().ok()?,
            occurred_at_ms: get(H_OCCURRED_AT_MS)?.parse().ok()?,
            tenant: get(H_TENANT)?.to_string(),
            payload_schema_digest: Digest::from_hex(get(H_PAYLOAD_SCHEMA)?)?,
        })
    }
}

/// One message of a batch: an attempt registered in the store before it leaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendRequest {
    /// The event's one id (R3).
    pub event_id: EventId,
    /// Delivery-set member.
    pub member: u16,
    /// Envelope generation sent.
    pub envelope_generation: u32,
    /// The registered attempt.
    pub attempt_id: u64,
    /// Sealed payload digest (carried as a header).
    pub payload_digest: Digest,
    /// The frozen destination; the only place this message may go.
    pub destination: Destination,
    /// Its digest (carried as a header).
    pub destination_digest: Digest,
    /// Payload bytes as sealed.
    pub payload: Vec<u8>,
    /// The envelope's description of the event, sent as headers.
    pub envelope: WireEnvelope,
    /// The dispatcher's signature over the message ([`crate::signature::SignedClaim`]), the
    /// `Sealpost-Signature` header's value; `None` when the dispatcher holds no signing key.
    pub signature: Option<String>,
}

/// Why a message provably never left the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NeverSentReason {
    /// The batch deadline (lease end minus margin) passed before the message could leave.
    DeadlinePassed,
    /// The destination names a cluster this adapter is not connected to.
    WrongCluster(String),
    /// No connection to the broker when the message would have left.
    NotConnected(String),
    /// The destination does not exist at the broker (e.g. the stream was deleted); the
    /// broker answered before storing anything. An operator alert, not a hot loop.
    NoSuchDestination(String),
}

/// Why the broker permanently refused a message (it will refuse it again): poison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefusalKind {
    /// The payload is over the broker's size limit.
    PayloadTooLarge,
    /// The producer has no permission to publish there. Nothing was stored, and the fault is
    /// the deployment's, not the message's: the dispatcher reports it as never sent (the
    /// event waits under backoff for the grant) and never counts it toward quarantine.
    NotPermitted,
    /// Any other definite, repeatable "no" (an unroutable message, a rejected schema).
    Rejected,
    /// The adapter could not put the message on the wire (a header value the broker's
    /// protocol cannot carry, an encoder that failed or panicked); nothing left the process.
    /// Refused alone: the rest of its batch is sent ([`encode_request`]).
    Unencodable,
}

/// The outcome of one message of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendResult {
    /// The broker's receipt (its position). A receipt without a position is not proof of
    /// anything; the dispatcher machine treats it as no answer.
    Receipt(Receipt),
    /// Provably not stored and never left.
    NeverSent(NeverSentReason),
    /// The broker said a definite, permanent no; nothing was stored.
    Refused {
        /// Kind of refusal.
        kind: RefusalKind,
        /// The broker's own words.
        detail: String,
    },
    /// The broker refused because a copy of this event is already stored
    /// (create-if-absent). The outcome is a lookup away.
    AlreadyStored,
    /// No answer in time: the message may or may not be stored.
    NoAnswer,
}

/// Encodes one message of a batch on its own, so that a message that cannot be put on the
/// wire is refused alone (counted toward the rejection limit, then quarantined with the
/// reason) and never turns its batch into unknown outcomes: the strings it carries are
/// checked first ([`crate::wire::check_request`]), then the adapter's `encode` runs with a
/// panic contained. Every adapter builds each message through this before it leaves.
pub fn encode_request<T>(
    r: &mut SendRequest,
    encode: impl FnOnce(&mut SendRequest) -> Result<T, String>,
) -> Result<T, Unencodable> {
    if let Err(e) = crate::wire::check_request(r) {
        return Err(Unencodable(e.to_string()));
    }
    contain(|| encode(r))
}

/// A message the adapter could not put on the wire, and why. It becomes that message's
/// [`SendResult::Refused`] with [`RefusalKind::Unencodable`] (`SendResult::from`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unencodable(pub String);

impl From<Unencodable> for SendResult {
    fn from(u: Unencodable) -> SendResult {
        SendResult::Refused {
            kind: RefusalKind::Unencodable,
            detail: format!("{}; nothing was sent (the rest of the batch was)", u.0),
        }
    }
}

/// Runs an adapter's encoder with a panic contained: a panic or an error becomes a refusal of
/// that message ([`RefusalKind::Unencodable`]). The simulator's adapter encodes through it
/// too.
pub fn contain<T>(encode: impl FnOnce() -> Result<T, String>) -> Result<T, Unencodable> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(encode)) {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(why)) => Err(Unencodable(why)),
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            Err(Unencodable(format!(
                "the adapter's encoder panicked: {why}"
            )))
        }
    }
}

/// A broker adapter. Implementations know the broker's wire format and nothing of SQL.
pub trait Broker: Send + Sync + 'static {
    /// Cluster identity this adapter is connected to (matches `Destination::cluster`).
    fn cluster(&self) -> &str;

    /// What the adapter can do.
    fn capabilities(&self) -> Capabilities;

    /// Sends every request of `batch`, in order, none after `deadline`; returns one result
    /// per request, in the same order.
    fn send_batch(
        &self,
        batch: Vec<SendRequest>,
        deadline: std::time::Instant,
    ) -> impl Future<Output = Vec<SendResult>> + Send;

    /// "Did you store event `event_id` (member `member`) at `destination`?" (R13).
    fn lookup(
        &self,
        destination: &Destination,
        event_id: EventId,
        member: u16,
    ) -> impl Future<Output = Lookup> + Send;

    /// The same question for every event of `events`, all frozen to the partition of
    /// `destination` and grouped by the core ([`crate::reconcile::shares_scan`]); one answer
    /// per event, in order. An adapter that declares [`Capabilities::lookup_scan`] answers
    /// them with one scan ([`crate::reconcile::decide_scanned`]); the default asks one by
    /// one.
    fn lookup_many(
        &self,
        destination: &Destination,
        events: &[(EventId, u16)],
    ) -> impl Future<Output = Vec<Lookup>> + Send {
        async move {
            let mut out = Vec::with_capacity(events.len());
            for &(event_id, member) in events {
                out.push(self.lookup(destination, event_id, member).await);
            }
            out
        }
    }
}

/// One message read back by a stream scan: a Sealpost event (its id from the envelope
/// headers) or a message without them (described by the adapter, e.g. its subject).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScannedMessage {
    /// A message carrying a Sealpost event id.
    Event(EventId),
    /// A message without Sealpost headers: something published out of band.
    Foreign(String),
}

/// Reads a destination stream from its start, for the reconciliation report's fourth set
/// (R19: event ids at the broker that the outbox never committed). Optional: an adapter
/// that cannot read a stream back does not implement it.
pub trait StreamScan: Send + Sync {
    /// A cursor over one stream.
    type Cursor: StreamCursor;

    /// Opens a cursor at the start of `stream`; `None` when the stream does not exist or
    /// cannot be read.
    fn open_scan(&self, stream: &str) -> impl Future<Output = Option<Self::Cursor>> + Send;
}

/// A cursor of [`StreamScan`].
pub trait StreamCursor: Send {
    /// The next message and how many the stream held after it when it was read (0: this
    /// was the last); `None` at the end or when nothing came within the adapter's wait.
    fn next_message(&mut self) -> impl Future<Output = Option<(ScannedMessage, u64)>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EventOrdering, PartitionAlgorithm, RoutePolicy};

    fn request(aggregate_id: &str) -> SendRequest {
        let destination = RoutePolicy {
            generation: 1,
            cluster: "c".into(),
            topic: "T".into(),
            partition_algorithm: PartitionAlgorithm::None,
            serializer: "json.v1".into(),
            durability: "file".into(),
            required_ack: "stream".into(),
            ordering: EventOrdering::Unordered,
        }
        .resolve("k");
        SendRequest {
            event_id: EventId([1; 16]),
            member: 0,
            envelope_generation: 1,
            attempt_id: 1,
            payload_digest: Digest([1; 32]),
            destination_digest: destination.digest(),
            destination,
            payload: b"{}".to_vec(),
            envelope: WireEnvelope {
                event_type: "order.created.v1".into(),
                aggregate_type: "order".into(),
                aggregate_id: aggregate_id.into(),
                ..Default::default()
            },
            signature: None,
        }
    }

    #[test]
    fn a_message_leaves_only_while_more_than_the_declared_margin_is_left() {
        use std::time::Duration;
        let caps = |handover_margin_ms| Capabilities {
            lookup_by_event_id: true,
            duplicate_window_ms: None,
            create_if_absent: false,
            per_key_ordering: true,
            handover_margin_ms,
            lookup_scan: None,
        };
        assert!(may_leave(Duration::from_millis(1), &caps(0)));
        assert!(
            !may_leave(Duration::ZERO, &caps(0)),
            "at the deadline: never"
        );
        assert!(may_leave(Duration::from_millis(1_501), &caps(1_500)));
        assert!(!may_leave(Duration::from_millis(1_500), &caps(1_500)));
        assert!(!may_leave(Duration::from_millis(200), &caps(1_500)));
    }

    fn refusal(r: Result<(), Unencodable>) -> String {
        match r.map_err(SendResult::from) {
            Err(SendResult::Refused {
                kind: RefusalKind::Unencodable,
                detail,
            }) => detail,
            other => panic!("expected an Unencodable refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_string_the_wire_cannot_carry_is_refused_before_the_encoder_runs() {
        let mut ran = false;
        let d = refusal(encode_request(&mut request("o-1\r\n"), |_| {
            ran = true;
            Ok(())
        }));
        assert!(!ran, "the encoder must not see the message");
        assert!(
            d.contains("`aggregate_id` contains the control character U+000D"),
            "{d}"
        );
        assert!(d.contains("the rest of the batch was"), "{d}");
    }

    #[test]
    fn an_encoder_that_fails_or_panics_refuses_its_message_and_nothing_else() {
        let d = refusal(encode_request(&mut request("o-1"), |_| {
            Err::<(), _>("header too large".to_string())
        }));
        assert!(d.starts_with("header too large"), "{d}");
        let d = refusal(encode_request(
            &mut request("o-1"),
            |_| -> Result<(), String> { panic!("invalid header value") },
        ));
        assert!(
            d.contains("the adapter's encoder panicked: invalid header value"),
            "{d}"
        );
        // An ordinary message is encoded and handed back.
        assert_eq!(
            encode_request(&mut request("o-1"), |r| Ok(r.envelope.aggregate_id.clone())),
            Ok::<_, Unencodable>("o-1".to_string())
        );
    }
}
