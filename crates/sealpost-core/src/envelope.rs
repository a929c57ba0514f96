//! `outboxEnvelope.v1` and `destination.v1` (R1–R3): the sealed facts that commit with the
//! business change and never change afterwards.

use crate::encoding::{Canonical, Digest};

/// Domain tag of the destination digest.
pub const DESTINATION_DOMAIN: &str = "sealpost.destination.v1";
/// Domain tag of the payload digest.
pub const PAYLOAD_DOMAIN: &str = "sealpost.payload.v1";

/// The payload digest of `payload`: what the sealed envelope holds for it, and what a copy
/// found at a broker is judged by. A lookup's receipt carries this digest of the bytes the
/// broker holds, never the digest a header claims: anyone who may publish can write any
/// header, so a header is no proof (a forged copy with a matching header would be adopted).
pub fn payload_digest(payload: &[u8]) -> Digest {
    Digest::of_bytes(PAYLOAD_DOMAIN, payload)
}
/// Domain tag of the payload schema digest.
pub const SCHEMA_DOMAIN: &str = "sealpost.schema.v1";
/// Domain tag of the envelope digest.
pub const ENVELOPE_DOMAIN: &str = "sealpost.envelope.v1";

/// The one identity of a fact for its whole life (R3): a UUIDv7 minted when the business
/// command is first accepted. There is deliberately no other constructor that produces a
/// fresh id: retries, reconcilers and consumers only ever copy an existing one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EventId(pub [u8; 16]);

impl EventId {
    /// Mints a UUIDv7 from a unix-millisecond timestamp and 10 random bytes, both injected
    /// (the core reads no clock and no entropy source).
    pub fn mint(unix_ms: u64, random: [u8; 10]) -> EventId {
        let mut b = [0u8; 16];
        b[..6].copy_from_slice(&unix_ms.to_be_bytes()[2..8]);
        b[6..].copy_from_slice(&random);
        b[6] = 0x70 | (b[6] & 0x0f); // version 7
        b[8] = 0x80 | (b[8] & 0x3f); // RFC 4122 variant
        EventId(b)
    }

    /// The unix-millisecond time a UUIDv7 id was minted at (`None` for another version):
    /// where a broker that can be read by time (Kafka) starts looking for it.
    pub fn minted_unix_ms(self) -> Option<u64> {
        if self.0[6] >> 4 != 7 {
            return None;
        }
        let mut b = [0u8; 8];
        b[2..].copy_from_slice(&self.0[..6]);
        Some(u64::from_be_bytes(b))
    }

    /// Parses the hyphenated form.
    pub fn parse(s: &str) -> Option<EventId> {
        let hex: String = s.chars().filter(|c| *c != '-').collect();
        if hex.len() != 32 {
            return None;
        }
        let mut b = [0u8; 16];
        for (i, chunk) in hex.as_bytes().chunks(2).enumerate() {
            let hi = (chunk[0] as char).to_digit(16)?;
            let lo = (chunk[1] as char).to_digit(16)?;
            b[i] = (hi * 16 + lo) as u8;
        }
        Some(EventId(b))
    }
}

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Into a buffer on the stack, written once: a dispatcher formats every event id it
        // sends (header, message id, subject).
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 36];
        let mut o = 0;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                out[o] = b'-';
                o += 1;
            }
            out[o] = HEX[usize::from(b >> 4)];
            out[o + 1] = HEX[usize::from(b & 0xf)];
            o += 2;
        }
        f.write_str(std::str::from_utf8(&out).map_err(|_| std::fmt::Error)?)
    }
}

impl std::fmt::Debug for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

/// How a routing key maps to a partition. Frozen with the destination so that a later
/// change of algorithm cannot move an existing event to another partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PartitionAlgorithm {
    /// The broker has no partitions (NATS JetStream subjects): the receipt names none.
    None,
    /// FNV-1a 32-bit of the routing key modulo the partition count.
    Fnv1a32 {
        /// Number of partitions when the destination was frozen.
        partitions: u32,
    },
    /// Kafka's default partitioner for keyed records: the positive part of murmur2 (seed
    /// `0x9747b28c`) of the routing key's UTF-8 bytes, modulo the partition count frozen with
    /// the destination. A Java producer or consumer computes the same partition for the key
    /// with the same count; adding partitions to the topic later moves no frozen event.
    KafkaMurmur2 {
        /// Number of partitions when the destination was frozen.
        partitions: u32,
    },
}

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`), as a `u32`.
pub fn kafka_murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = 0x9747_b28c ^ (data.len() as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        for (i, b) in rest.iter().enumerate().rev() {
            h ^= u32::from(*b) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

impl PartitionAlgorithm {
    /// The partition a routing key maps to, if the destination is partitioned.
    pub fn partition_of(&self, routing_key: &str) -> Option<u32> {
        match self {
            PartitionAlgorithm::None => None,
            PartitionAlgorithm::Fnv1a32 { partitions } => {
                let mut h: u32 = 0x811c_9dc5;
                for b in routing_key.as_bytes() {
                    h ^= u32::from(*b);
                    h = h.wrapping_mul(0x0100_0193);
                }
                Some(h % (*partitions).max(1))
            }
            PartitionAlgorithm::KafkaMurmur2 { partitions } => {
                Some((kafka_murmur2(routing_key.as_bytes()) & 0x7fff_ffff) % (*partitions).max(1))
            }
        }
    }

    /// Stable name used in the canonical encoding and the database.
    pub fn name(&self) -> String {
        match self {
            PartitionAlgorithm::None => "none".to_string(),
            PartitionAlgorithm::Fnv1a32 { partitions } => format!("fnv1a32/{partitions}"),
            PartitionAlgorithm::KafkaMurmur2 { partitions } => {
                format!("kafka-murmur2/{partitions}")
            }
        }
    }

    /// Parses [`PartitionAlgorithm::name`].
    pub fn parse(s: &str) -> Option<PartitionAlgorithm> {
        if s == "none" {
            return Some(PartitionAlgorithm::None);
        }
        if let Some(n) = s.strip_prefix("kafka-murmur2/") {
            let partitions: u32 = n.parse().ok()?;
            return (partitions > 0).then_some(PartitionAlgorithm::KafkaMurmur2 { partitions });
        }
        let n = s.strip_prefix("fnv1a32/")?.parse().ok()?;
        Some(PartitionAlgorithm::Fnv1a32 { partitions: n })
    }
}

/// Whether a route keeps each aggregate's events in order (R29). Frozen with the destination,
/// so a route revision cannot change it under an event that is already committed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EventOrdering {
    /// Events leave in whatever order the claims find them (the default).
    #[default]
    Unordered,
    /// An aggregate's events reach the broker in `aggregate_version` order: a later event is
    /// not sent while an earlier one of the same aggregate is unresolved (pending, claimed,
    /// sending, unknown, reconciling or quarantined). See `claim::decide_dispatch_claim_with`.
    PerAggregate,
}

impl EventOrdering {
    /// Stable name used in the canonical encoding, the database and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            EventOrdering::Unordered => "none",
            EventOrdering::PerAggregate => "per_aggregate",
        }
    }

    /// Parses [`EventOrdering::name`] (also `per-aggregate`).
    pub fn parse(s: &str) -> Option<EventOrdering> {
        match s {
            "none" | "unordered" => Some(EventOrdering::Unordered),
            "per_aggregate" | "per-aggregate" => Some(EventOrdering::PerAggregate),
            _ => None,
        }
    }
}

/// The key under which a per-aggregate-ordered event waits for its predecessors: aggregate
/// type and id (`None` for an unordered destination). A length prefix keeps `("a:b", "c")`
/// and `("a", "b:c")` apart.
pub fn ordering_key(
    ordering: EventOrdering,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Option<String> {
    match ordering {
        EventOrdering::Unordered => None,
        EventOrdering::PerAggregate => Some(format!(
            "{}:{aggregate_type}/{aggregate_id}",
            aggregate_type.len()
        )),
    }
}

/// `destination.v1` (R2): where an event goes, frozen inside the committing transaction.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Destination {
    /// Broker cluster identity (e.g. `nats-local`).
    pub cluster: String,
    /// Topic or JetStream stream name.
    pub topic: String,
    /// Routing (partition / subject) key.
    pub routing_key: String,
    /// Maps the routing key to a partition.
    pub partition_algorithm: PartitionAlgorithm,
    /// Generation of the route policy this was resolved from.
    pub route_policy_generation: u64,
    /// Serializer name, e.g. `json.v1`.
    pub serializer: String,
    /// Durability asked of the broker, e.g. `file`.
    pub durability: String,
    /// Required acknowledgement level, e.g. `stream` or `all`.
    pub required_ack: String,
    /// Per-aggregate ordering (R29); `Unordered` is encoded by omission, so the digests of
    /// destinations frozen before ordering existed are unchanged.
    pub ordering: EventOrdering,
}

impl Destination {
    /// The destination digest (canonical encoding, see `docs/encoding.md`).
    pub fn digest(&self) -> Digest {
        let mut c = Canonical::new(DESTINATION_DOMAIN);
        c.str(1, &self.cluster)
            .str(2, &self.topic)
            .str(3, &self.routing_key)
            .str(4, &self.partition_algorithm.name())
            .u64(5, self.route_policy_generation)
            .str(6, &self.serializer)
            .str(7, &self.durability)
            .str(8, &self.required_ack);
        if self.ordering != EventOrdering::Unordered {
            c.str(9, self.ordering.name());
        }
        c.finish()
    }

    /// The partition this destination's routing key maps to, if partitioned.
    pub fn partition(&self) -> Option<u32> {
        self.partition_algorithm.partition_of(&self.routing_key)
    }
}

/// A route policy revision: resolves an event type to a destination template. Policies are
/// versioned by `generation`; resolving freezes the generation into the destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutePolicy {
    /// Monotonic generation of this revision.
    pub generation: u64,
    /// Broker cluster identity.
    pub cluster: String,
    /// Topic or stream.
    pub topic: String,
    /// Partitioning.
    pub partition_algorithm: PartitionAlgorithm,
    /// Serializer name.
    pub serializer: String,
    /// Durability.
    pub durability: String,
    /// Required ACK level.
    pub required_ack: String,
    /// Per-aggregate ordering, frozen into each destination resolved from this revision.
    pub ordering: EventOrdering,
}

impl RoutePolicy {
    /// Freezes a destination for one event (R2). `routing_key` is chosen by the caller,
    /// typically tenant + aggregate id.
    pub fn resolve(&self, routing_key: &str) -> Destination {
        Destination {
            cluster: self.cluster.clone(),
            topic: self.topic.clone(),
            routing_key: routing_key.to_string(),
            partition_algorithm: self.partition_algorithm,
            route_policy_generation: self.generation,
            serializer: self.serializer.clone(),
            durability: self.durability.clone(),
            required_ack: self.required_ack.clone(),
            ordering: self.ordering,
        }
    }
}

/// The business-side description of a fact, before sealing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewEvent<'a> {
    /// Aggregate type, e.g. `order`.
    pub aggregate_type: &'a str,
    /// Aggregate id, e.g. `o-42`.
    pub aggregate_id: &'a str,
    /// Aggregate version after the change.
    pub aggregate_version: u64,
    /// Event type, e.g. `order.created.v1`.
    pub event_type: &'a str,
    /// Identifier of the payload schema (its canonical text or registry id).
    pub payload_schema: &'a str,
    /// The payload bytes as serialized at commit (the relay never rebuilds them).
    pub payload: &'a [u8],
    /// Tenant.
    pub tenant: &'a str,
    /// Unix milliseconds when the fact occurred.
    pub occurred_at_ms: u64,
    /// Identifier of the creating database transaction (e.g. `txid_current()`).
    pub creating_txid: u64,
}

/// `outboxEnvelope.v1` (R1): the sealed, immutable description of one fact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedEnvelope {
    /// The event's identity for life.
    pub event_id: EventId,
    /// Starts at 1; only an explicit migration (R15) creates generation 2 and later.
    pub envelope_generation: u32,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Aggregate version.
    pub aggregate_version: u64,
    /// Event type.
    pub event_type: String,
    /// Digest of the payload schema.
    pub payload_schema_digest: Digest,
    /// Digest of the payload bytes.
    pub payload_digest: Digest,
    /// Tenant.
    pub tenant: String,
    /// Unix milliseconds.
    pub occurred_at_ms: u64,
    /// Creating transaction id.
    pub creating_txid: u64,
    /// Frozen destination.
    pub destination: Destination,
    /// Digest of `destination`.
    pub destination_digest: Digest,
}

impl SealedEnvelope {
    /// Seals a new event: computes every digest and freezes the destination from `policy`.
    /// The `event_id` must have been minted when the business command was first accepted.
    pub fn seal(
        event_id: EventId,
        ev: &NewEvent<'_>,
        policy: &RoutePolicy,
        routing_key: &str,
    ) -> SealedEnvelope {
        let destination = policy.resolve(routing_key);
        let destination_digest = destination.digest();
        SealedEnvelope {
            event_id,
            envelope_generation: 1,
            aggregate_type: ev.aggregate_type.to_string(),
            aggregate_id: ev.aggregate_id.to_string(),
            aggregate_version: ev.aggregate_version,
            event_type: ev.event_type.to_string(),
            payload_schema_digest: Digest::of_bytes(SCHEMA_DOMAIN, ev.payload_schema.as_bytes()),
            payload_digest: payload_digest(ev.payload),
            tenant: ev.tenant.to_string(),
            occurred_at_ms: ev.occurred_at_ms,
            creating_txid: ev.creating_txid,
            destination,
            destination_digest,
        }
    }

    /// Digest over every envelope field (and the destination digest): two implementations
    /// that agree on this agree on the whole envelope.
    pub fn digest(&self) -> Digest {
        Canonical::new(ENVELOPE_DOMAIN)
            .bytes(1, &self.event_id.0)
            .u64(2, u64::from(self.envelope_generation))
            .str(3, &self.aggregate_type)
            .str(4, &self.aggregate_id)
            .u64(5, self.aggregate_version)
            .str(6, &self.event_type)
            .bytes(7, &self.payload_schema_digest.0)
            .bytes(8, &self.payload_digest.0)
            .str(9, &self.tenant)
            .u64(10, self.occurred_at_ms)
            .u64(11, self.creating_txid)
            .bytes(12, &self.destination_digest.0)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_id_displays_as_a_hyphenated_lower_case_uuid() {
        let id = EventId([
            0x01, 0x8f, 0x3a, 0xbc, 0x7d, 0x2e, 0x7f, 0x00, 0x9a, 0xbc, 0xde, 0xf0, 0x12, 0x34,
            0x56, 0x78,
        ]);
        assert_eq!(id.to_string(), "018f3abc-7d2e-7f00-9abc-def012345678");
    }

    /// Kafka's own vectors (`UtilsTest.testMurmur2`, as Java's signed ints).
    #[test]
    fn kafka_murmur2_matches_the_java_client() {
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ];
        for (data, want) in cases {
            assert_eq!(kafka_murmur2(data), want as u32, "{data:?}");
        }
        let alg = PartitionAlgorithm::KafkaMurmur2 { partitions: 12 };
        assert_eq!(
            alg.partition_of("foobar"),
            Some(((-790_332_482i32 & 0x7fff_ffff) % 12) as u32)
        );
        assert_eq!(PartitionAlgorithm::parse(&alg.name()), Some(alg));
        assert_eq!(alg.name(), "kafka-murmur2/12");
        assert_eq!(PartitionAlgorithm::parse("kafka-murmur2/0"), None);
        assert_eq!(PartitionAlgorithm::parse("kafka-murmur2/x"), None);
    }

    pub(crate) fn policy(generation: u64) -> RoutePolicy {
        RoutePolicy {
            generation,
            cluster: "nats-local".into(),
            topic: "ORDERS".into(),
            partition_algorithm: PartitionAlgorithm::None,
            serializer: "json.v1".into(),
            durability: "file".into(),
            required_ack: "stream".into(),
            ordering: EventOrdering::Unordered,
        }
    }

    #[test]
    fn event_id_is_uuid_v7_and_round_trips() {
        let id = EventId::mint(0x0190_0000_0000, [0xff; 10]);
        let s = id.to_string();
        assert_eq!(s, "01900000-0000-7fff-bfff-ffffffffffff");
        assert_eq!(EventId::parse(&s), Some(id));
        assert_eq!(EventId::parse("not-an-id"), None);
    }

    /// Fixed vectors, also printed in `docs/encoding.md`. A change here is a breaking change
    /// of the wire contract and needs a new domain version.
    #[test]
    fn fixed_vectors() {
        let d = policy(19).resolve("tenant-7.order.o-42");
        assert_eq!(
            d.digest().to_hex(),
            "241e7b3c7b76aaf65e38527c2752e987527d12e5940669268e4e4f1b63e26bb0"
        );
        let p = Digest::of_bytes(PAYLOAD_DOMAIN, br#"{"order":"o-42","total_cents":1999}"#);
        assert_eq!(
            p.to_hex(),
            "1b8ce4c58cb6085411913889c682cb9920d0d78e7a5966c049b7a50ea727b690"
        );
        let ev = NewEvent {
            aggregate_type: "order",
            aggregate_id: "o-42",
            aggregate_version: 17,
            event_type: "order.created.v1",
            payload_schema: "order.created.v1",
            payload: br#"{"order":"o-42","total_cents":1999}"#,
            tenant: "tenant-7",
            occurred_at_ms: 1_700_000_000_000,
            creating_txid: 4242,
        };
        let id = EventId::parse("01900000-0000-7fff-bfff-ffffffffffff").unwrap();
        let env = SealedEnvelope::seal(id, &ev, &policy(19), "tenant-7.order.o-42");
        assert_eq!(
            env.digest().to_hex(),
            "4678711fcd7f0b05dcb9bf79c9dc329dc74a6686baa5f3d22b36c5c9025fe2d3"
        );
        // The signed claim of its first copy (`signature.rs`).
        let claim = crate::signature::SignedClaim {
            event_id: env.event_id,
            member: 0,
            envelope_generation: env.envelope_generation,
            payload_digest: env.payload_digest,
            destination_digest: env.destination_digest,
            envelope: crate::port::WireEnvelope {
                event_type: env.event_type.clone(),
                aggregate_type: env.aggregate_type.clone(),
                aggregate_id: env.aggregate_id.clone(),
                aggregate_version: env.aggregate_version,
                occurred_at_ms: env.occurred_at_ms,
                tenant: env.tenant.clone(),
                payload_schema_digest: env.payload_schema_digest,
            },
        };
        assert_eq!(
            claim.digest().to_hex(),
            "5b8e2e72635c8fe61c84b98f1f562dd653bb421a85eda4f74a95ec89820fdd31"
        );
    }

    #[test]
    fn policy_revision_changes_digest_not_existing_envelopes() {
        let a = policy(1).resolve("k");
        let b = policy(2).resolve("k");
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a.digest(), policy(1).resolve("k").digest());
    }

    /// Ordering is field 9, present only when ordered: unordered digests keep their vectors.
    #[test]
    fn ordering_is_frozen_in_the_digest_only_when_asked() {
        let unordered = policy(19).resolve("tenant-7.order.o-42");
        let mut p = policy(19);
        p.ordering = EventOrdering::PerAggregate;
        let ordered = p.resolve("tenant-7.order.o-42");
        assert_eq!(ordered.ordering, EventOrdering::PerAggregate);
        assert_ne!(ordered.digest(), unordered.digest());
        assert_eq!(
            EventOrdering::parse(EventOrdering::PerAggregate.name()),
            Some(EventOrdering::PerAggregate)
        );
        assert_eq!(ordering_key(EventOrdering::Unordered, "order", "o-1"), None);
        assert_ne!(
            ordering_key(EventOrdering::PerAggregate, "a:b", "c"),
            ordering_key(EventOrdering::PerAggregate, "a", "b:c")
        );
    }

    #[test]
    fn partition_is_stable() {
        let alg = PartitionAlgorithm::Fnv1a32 { partitions: 12 };
        assert_eq!(alg.partition_of("o-42"), alg.partition_of("o-42"));
        assert!(alg.partition_of("o-42").unwrap() < 12);
        assert_eq!(PartitionAlgorithm::parse(&alg.name()), Some(alg));
        assert_eq!(PartitionAlgorithm::None.partition_of("x"), None);
    }
}
