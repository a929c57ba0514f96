//! One simulated trace: a seeded world of business writers, dispatchers, a broker, a
//! reconciler, consumers and cleanup, driven through virtual time that jumps to the next
//! wake-up. Every protocol decision is a call into `sealpost-core` through
//! [`crate::protocol::Protocol`]; this file only models the IO around it (network, broker,
//! crashes) and the ghost knowledge the checkers compare against.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::rc::Rc;
use std::sync::OnceLock;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

use sealpost_core::cdc::{
    ClaimFrom, ClaimSource, LogWindow, RowCheck, RowKey, ROW_BYTES, TXN_BYTES,
};
use sealpost_core::claim::{apply_release_quarantine, ClaimToken, SendOutcome};
use sealpost_core::cleanup::{
    apply_retention, PurgeRefusal, RetentionDecision, RetentionPolicy, Watermark,
};
use sealpost_core::contract::apache_avro::schema::Schema;
use sealpost_core::contract::apache_avro::types::Value;
use sealpost_core::contract::{self, ContractError, Reader, SchemaVersion};
use sealpost_core::delivery_set::{CompletionRule, SetStatus, MEMBERS_MAX};
use sealpost_core::dispatcher::{
    Claimed, ClaimedSend, DispatchAction, DispatcherConfig, DispatcherMachine, Horizon,
    OutcomeReport, Submission,
};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{
    Destination, EventId, EventOrdering, PartitionAlgorithm, RoutePolicy, PAYLOAD_DOMAIN,
};
use sealpost_core::inbox::{ApplyOrder, Failure, InboxDecision, InboxRecord, RedeliveryPolicy};
use sealpost_core::lease::{self, LeasedSend};
use sealpost_core::migration::{apply_migration, decide_migration};
use sealpost_core::port::{
    Capabilities, NeverSentReason, RefusalKind, SendRequest, SendResult, WireEnvelope,
};
use sealpost_core::receipt::{Receipt, ReceiptSource, ReceiptVerdict};
use sealpost_core::reconcile::{
    decide_reconcile_missing, Lookup, LookupScan, ReconcileDecision, ReconcilePolicy, ScanReach,
};
use sealpost_core::reconciler::{
    verify_window_rows, ReconcileAction, ReconcileItem, ReconcilerConfig, ReconcilerMachine,
    VerifyItem,
};
use sealpost_core::rollout::{
    self, share_bucket, Alias, AliasCheck, ClaimFacts, Implementation, Stage, Switch,
};
use sealpost_core::row::{AttemptStatus, EventRow};
use sealpost_core::signature::{
    present, Crypto, FoundCopy, SignatureHeader, SignaturePolicy, SignedClaim, COPIES_MAX,
    SIGNATURE_LEN,
};
use sealpost_core::state::{transition, Phase, State};
use sealpost_core::step::{
    self, Acceptance, Authorised, ClaimInput, Pick, PickOutcome, Served, UnknownPick,
};
use sealpost_core::subscription::{Processed, Settlement};
use sealpost_core::QuarantineReason;

use crate::protocol::Protocol;
use crate::stats::{Fault, TraceStats, Violation};

const CLUSTERS: [&str; 2] = ["nats-a", "nats-b"];
const TOPICS: [&str; 3] = ["ORDERS", "ORDERS_V2", "BILLING"];

const LEASE_MS: u64 = 10_000;
const ACK_TIMEOUT_MS: u64 = 3_000;
const DISPATCH_IDLE_POLL_MS: u64 = 20_000;
const CLAIM_BATCH_MAX: usize = 3;
const RECONCILE_IDLE_POLL_MS: u64 = 15_000;
const RECONCILE_LEASE_MS: u64 = 5_000;
const CONSUMER_IDLE_POLL_MS: u64 = 30_000;
const CONSUMER_BATCH_MAX: usize = 4;
/// The simulated consumers' redelivery policy (the production default).
const SIM_REDELIVERY: RedeliveryPolicy = RedeliveryPolicy {
    max_deliveries: 10,
    backoff_first_ms: 100,
    backoff_max_ms: 30_000,
};
const CLEANUP_EVERY_MS: u64 = 30_000;
const DEDUP_WINDOW_MS: u64 = 120_000;
const STREAM_DELETED_MAX_MS: u64 = 300_000;
/// Retry budget (R28: every failure window has a retry limit): send attempts one row may
/// register in a trace. With the backoff, a ten-minute outage costs about fifteen.
const ATTEMPTS_PER_ROW_MAX: usize = 100;
/// Lookup budget: broker lookups of one row in a trace. With the per-row backoff (1 s
/// doubling to 30 s) a ten-minute outage costs about twenty-five.
const LOOKUPS_PER_ROW_MAX: u32 = 200;
/// Broker refusals of one row without a single quarantine: poison must reach its quarantine
/// (R6: a retry limit and an operator exit, never an infinite loop).
const REFUSALS_UNQUARANTINED_MAX: u32 = 4 * REJECTION_LIMIT;
const REPLAY_WINDOW_MS: u64 = 60_000;
const REJECTION_LIMIT: u32 = 3;
const DRAIN_MAX_MS: u64 = 3_600_000;
const STEPS_MAX: u32 = 60_000;
const BROKER_OUTAGE_MAX_MS: u64 = 600_000;
/// Per mille of the traces with a CDC publisher (R32), and of those, without a polling
/// dispatcher (the publisher alone).
const CDC_TRACES: u32 = 300;
const CDC_ALONE: u32 = 250;
/// Actions a dispatcher machine takes at one instant before the simulator calls it a
/// loop (a handful is normal: a claim, a send, a submission).
const DRIVE_ACTIONS_MAX: u32 = 1_000;
/// Per mille of the traces whose writers sometimes commit late (draw positions, commit
/// after others that drew higher ones).
const LATE_COMMIT_TRACES: u32 = 333;
/// The CDC publisher's owner id (its dispatcher machine's claims).
const CDC_OWNER: u64 = 900;

/// Every reader (consumers, the reconciler, the verification pass) requires a valid signature
/// in every trace, and the forging adversary runs in every trace: under `off` or `if-present`
/// a forged message is *meant* to be trusted (that is the vulnerability those policies
/// accept), so a trace under them could only show the forgery working.
const SIM_POLICY: SignaturePolicy = SignaturePolicy::Require;
/// The dispatchers' key id in the model.
const SIM_KEY_ID: &str = "sim-dispatcher";
/// The model of the dispatchers' private key: a signature over digest `d` is `d`'s 32 bytes
/// followed by these 32. Nothing but a dispatcher writes them, so the adversary can only
/// make up other bytes or copy a whole genuine signature (a replay, over other facts).
const SIM_SECRET: [u8; 32] = *b"sealpost-sim dispatcher key 2026";
/// The event types a message's envelope may name (each fact has one; a takeover lists a
/// non-empty subset of them).
const EVENT_TYPES: [&str; 2] = ["order.placed.v1", "order.cancelled.v1"];
/// The aggregate type of every fact (its id is `o-<aggregate>`): the share bucket's input.
const AGGREGATE_TYPE: &str = "order";
/// R25: the two dispatcher implementations of a rollout. Dispatchers alternate between
/// them (dispatcher `i` runs `IMPLEMENTATIONS[i % 2]`); "a" is the first incumbent.
const IMPLEMENTATIONS: [&str; 2] = ["a", "b"];
/// Per mille of the traces with polling dispatchers that run a rollout (from the rollout
/// model's own randomness). Such a trace has at least two polling dispatchers, and the
/// first two (one of each implementation) serve every cluster.
const ROLLOUT_TRACES: u32 = 800;
/// The rows one shadow read compares at most per route (the shadow's page).
const SHADOW_PAGE: usize = 4;

/// Per mille of the traces whose routes require contracts (R26), from the contract model's
/// own randomness.
const CONTRACT_TRACES: u32 = 300;
/// R26: the payload schemas of a trace with contracts (the same texts for every event type).
/// The first three are compatible both ways with each other, in any registration order; each
/// of the others breaks one rule of the table against them (a rename, a changed unit in the
/// same type, a narrowing). The registrar tries them all; producers write with them.
const CONTRACT_SCHEMAS: [&str; 6] = [
    r#"{"type":"record","name":"Order","fields":[
        {"name":"order_id","type":"string","contract":{"unique":true,"ordering_key":true}},
        {"name":"total","type":"long","contract":{"unit":"cents"}}]}"#,
    r#"{"type":"record","name":"Order","fields":[
        {"name":"order_id","type":"string","contract":{"unique":true,"ordering_key":true}},
        {"name":"total","type":"long","contract":{"unit":"cents"}},
        {"name":"currency","type":"string","default":"EUR"}]}"#,
    r#"{"type":"record","name":"Order","fields":[
        {"name":"order_id","type":"string","contract":{"unique":true,"ordering_key":true}},
        {"name":"total","type":"long","contract":{"unit":"cents"}},
        {"name":"channel","type":{"type":"enum","name":"Channel","symbols":["WEB","STORE"],"default":"WEB"},"default":"WEB"}]}"#,
    r#"{"type":"record","name":"Order","fields":[
        {"name":"order_id","type":"string","contract":{"unique":true,"ordering_key":true}},
        {"name":"amount","type":"long","contract":{"unit":"cents"}}]}"#,
    r#"{"type":"record","name":"Order","fields":[
        {"name":"order_id","type":"string","contract":{"unique":true,"ordering_key":true}},
        {"name":"total","type":"long","contract":{"unit":"euros"}}]}"#,
    r#"{"type":"record","name":"Order","fields":[
        {"name":"order_id","type":"string","contract":{"unique":true,"ordering_key":true}},
        {"name":"total","type":"int","contract":{"unit":"cents"}}]}"#,
];
/// How many of [`CONTRACT_SCHEMAS`] are compatible with each other.
const CONTRACT_COMPATIBLE: usize = 3;

/// [`CONTRACT_SCHEMAS`] parsed by the core for each event type (`contract::parse`, version
/// 0: candidates), once per process.
fn contract_catalogue() -> &'static [Vec<SchemaVersion>] {
    static CATALOGUE: OnceLock<Vec<Vec<SchemaVersion>>> = OnceLock::new();
    CATALOGUE.get_or_init(|| {
        EVENT_TYPES
            .iter()
            .map(|t| {
                CONTRACT_SCHEMAS
                    .iter()
                    .map(|text| contract::parse(t, text).expect("the catalogue parses"))
                    .collect()
            })
            .collect()
    })
}

/// The `unit` annotation of field `name` of `s` (the core's [`SchemaVersion::annotation`]).
fn unit_of<'a>(s: &'a SchemaVersion, name: &str) -> Option<&'a str> {
    s.annotation(name, "unit")?.as_str()
}

/// What the producer of fact `fact` means by its total, in cents (a multiple of 100).
fn cents_of(fact: u32) -> i64 {
    (i64::from(fact) + 1) * 100
}

/// The payload of fact `fact` as one datum of `s`: its order id, and its total in the unit
/// `s` annotates (the producer writes the meaning its schema declares).
fn contract_payload(
    s: &SchemaVersion,
    fact: u32,
    aggregate: u32,
) -> Result<Vec<u8>, ContractError> {
    let Schema::Record(r) = s.schema() else {
        unreachable!("a contract is a record")
    };
    let cents = cents_of(fact);
    let fields = r
        .fields
        .iter()
        .map(|f| {
            let v = match &f.schema {
                Schema::String if f.name == "order_id" => Value::String(format!("o-{aggregate}")),
                Schema::String => Value::String("EUR".into()),
                Schema::Long | Schema::Int => {
                    let n = match unit_of(s, &f.name) {
                        Some("euros") => cents / 100,
                        _ => cents,
                    };
                    if matches!(f.schema, Schema::Int) {
                        Value::Int(n as i32)
                    } else {
                        Value::Long(n)
                    }
                }
                Schema::Enum(e) => Value::Enum(0, e.symbols[0].clone()),
                other => unreachable!("no such field type in the catalogue: {other:?}"),
            };
            (f.name.clone(), v)
        })
        .collect();
    s.encode(Value::Record(fields))
}

/// The total a reader at version `reader` takes `value` (read as its version) to mean, in
/// cents, by its own `unit` annotation.
fn read_cents(reader: &SchemaVersion, value: &Value) -> Option<i64> {
    let Value::Record(fields) = value else {
        return None;
    };
    let n = match &fields.iter().find(|(k, _)| k == "total")?.1 {
        Value::Long(n) => *n,
        Value::Int(n) => i64::from(*n),
        _ => return None,
    };
    match unit_of(reader, "total") {
        Some("euros") => Some(n * 100),
        _ => Some(n),
    }
}

/// A consumer's contract reader, and the length of the registry it was loaded from.
type LoadedReader = (usize, Rc<Reader>);

/// The contract model of a trace (R26): every route requires contracts. The registry is
/// database state ([`Db::registry`]); the registrar's attempts are events; each fact's
/// producer writes with a catalogue schema; consumer 0 reads with version 1 (an old reader
/// of new events), consumer 1 with the newest version registered when its reader loaded (a
/// new reader of history).
struct Contracts {
    /// Each fact's catalogue entry (index into [`CONTRACT_SCHEMAS`]) its producer writes with.
    writes: Vec<u8>,
    /// Each committed fact's payload: the version it names and its bytes.
    payloads: Vec<Option<(u32, Rc<[u8]>)>>,
    /// Per consumer and event type: the reader it loaded, and the registry's length then.
    readers: Vec<Vec<Option<LoadedReader>>>,
    /// Ghost: every registration the registrar made, in order (after a restore, the
    /// operator registers again what the restored registry lacks, in the same order, so
    /// every version keeps its number).
    made: Vec<(u8, u8)>,
}

/// The simulated implementation `i` (an index into [`IMPLEMENTATIONS`]).
fn implementation(i: u8) -> &'static Implementation {
    static IMPLS: OnceLock<[Implementation; 2]> = OnceLock::new();
    &IMPLS.get_or_init(|| IMPLEMENTATIONS.map(|id| Implementation::new(id).expect("a valid id")))
        [usize::from(i)]
}

/// The index of implementation `id` (the other ids never occur).
fn implementation_index(id: &str) -> u8 {
    u8::from(id == IMPLEMENTATIONS[1])
}

/// A destination on stream (`cluster`, `topic`): what an alias record covers.
fn stream_destination(cluster: u8, topic: u8) -> Destination {
    let mut p = policy_for(0, 0);
    p.cluster = CLUSTERS[usize::from(cluster)].to_string();
    p.topic = TOPICS[usize::from(topic)].to_string();
    p.resolve("rollout")
}

/// The route name of the alias record of stream (`cluster`, `topic`).
fn route_name(cluster: u8, topic: u8) -> String {
    format!(
        "{}.{}",
        CLUSTERS[usize::from(cluster)],
        TOPICS[usize::from(topic)].to_ascii_lowercase()
    )
}
/// The wire envelope a message describes (the simulated envelope: its event type only).
fn wire_envelope(event_type: u8) -> WireEnvelope {
    WireEnvelope {
        event_type: EVENT_TYPES[usize::from(event_type)].to_string(),
        ..WireEnvelope::default()
    }
}

/// The model dispatcher key's signature over a claim digest.
fn model_signature(digest: &Digest) -> [u8; SIGNATURE_LEN] {
    let mut sig = [0u8; SIGNATURE_LEN];
    sig[..32].copy_from_slice(&digest.0);
    sig[32..].copy_from_slice(&SIM_SECRET);
    sig
}

/// A dispatcher signs a request: the core's claim and header, the model key's bytes.
fn sim_sign(claim: &SignedClaim) -> String {
    SignatureHeader {
        key_id: SIM_KEY_ID.to_string(),
        signature: model_signature(&claim.digest()),
    }
    .format()
}

/// The readers' keyring in the model: the crypto answer and nothing else (what a reader then
/// trusts is the core's `present` and `decide_seal`).
fn sim_verify(kid: &str, sig: &[u8; SIGNATURE_LEN], digest: &Digest) -> Crypto {
    if kid != SIM_KEY_ID {
        Crypto::UnknownKey
    } else if *sig == model_signature(digest) {
        Crypto::Valid
    } else {
        Crypto::Invalid
    }
}

/// Knobs of one trace, drawn from its seed.
#[derive(Clone, Debug)]
struct Config {
    facts: usize,
    dispatchers: usize,
    consumers: usize,
    /// What the broker adapter declares (NATS-like, lookup only, or cannot be asked).
    caps: Capabilities,
    /// The broker's duplicate window: often shorter than a restore's gap.
    dup_window_ms: u64,
    fault_end_ms: u64,
    /// Per batch: the dispatcher stalls between its claim and the send.
    p_stall: u32,
    p_ack_loss: u32,
    p_ack_dup: u32,
    p_ack_late: u32,
    p_req_loss: u32,
    p_receipt_rollback: u32,
    p_writer_crash: u32,
    p_consumer_crash: u32,
    p_redeliver: u32,
    /// Per mille: a consumer's effect fails (a downstream error) on a delivery.
    p_effect_fail: u32,
    /// Per mille: a dispatcher's or the reconciler's transaction cannot reach the database.
    p_db_unreachable: u32,
    /// Records one bulk lookup scan reads at most (brokers that declare `lookup_scan`).
    scan_max: usize,
    p_seq0: u32,
    p_forge: u32,
    /// Adversary, per mille per request that leaves: a forged copy of it reaches its subject
    /// first.
    p_forge_copy_first: u32,
    /// Adversary, per mille per lookup: a forged copy of the event is published at its
    /// subject just before the lookup reads it.
    p_forge_copy_lookup: u32,
    /// Per-aggregate ordering of the route (R29): 0 never, 1 every policy generation, 2 the
    /// even generations only (a revision turns it on or off between an aggregate's events).
    ordering_mode: u8,
    /// Facts share this many aggregates (fact `f` is version `f / aggregates + 1` of
    /// aggregate `f % aggregates`).
    aggregates: u32,
}

/// A publish request on the wire.
#[derive(Clone, Debug)]
struct PubReq {
    d: u8,
    inc: u32,
    batch: u32,
    slot: u16,
    row: u32,
    /// Ghost: the lease end of the claim the request was made under.
    lease_until_ms: u64,
    event_id: EventId,
    member: u16,
    envelope_generation: u32,
    attempt_id: u64,
    payload_digest: Digest,
    destination_digest: Digest,
    stream: u8,
    /// The adapter asks the broker to refuse a second copy.
    create_if_absent: bool,
    /// The destination keeps per-aggregate order (R29; on the wire: a header).
    ordered: bool,
    /// The envelope's event type (index into [`EVENT_TYPES`]).
    event_type: u8,
    /// The `Sealpost-Signature` header the dispatcher put on it.
    signature: Option<Rc<str>>,
}

impl PubReq {
    /// The claim the dispatcher signed for this request.
    fn claim(&self) -> SignedClaim {
        SignedClaim {
            event_id: self.event_id,
            member: self.member,
            envelope_generation: self.envelope_generation,
            payload_digest: self.payload_digest,
            destination_digest: self.destination_digest,
            envelope: wire_envelope(self.event_type),
        }
    }
}

/// A batch handed to the adapter model, until every message has an outcome.
#[derive(Clone, Debug)]
struct Batch {
    id: u32,
    reqs: Vec<PubReq>,
    results: Vec<Option<SendResult>>,
    deadline_ms: u64,
    /// The mutant `refusal-fails-batch` unwound the adapter's send: every message of the
    /// batch ends as "no answer".
    unwound: bool,
}

#[derive(Clone, Debug)]
enum Ev {
    WriterCommit {
        fact: u32,
    },
    /// A writer's transaction that drew its positions earlier ends (commits, or rolls back
    /// if its writer is killed first).
    WriterLateCommit {
        fact: u32,
        epoch: u32,
    },
    DispatchWake {
        d: u8,
        inc: u32,
    },
    Leave {
        d: u8,
        inc: u32,
        batch: u32,
    },
    BrokerReceive {
        req: Box<PubReq>,
    },
    AckArrive {
        d: u8,
        inc: u32,
        batch: u32,
        slot: u16,
        result: Box<SendResult>,
    },
    BatchTimeout {
        d: u8,
        inc: u32,
        batch: u32,
    },
    DispatcherRestart {
        d: u8,
    },
    ReconcileWake {
        epoch: u32,
    },
    LookupDone {
        epoch: u32,
        item: Box<ReconcileItem>,
        lookup: Box<Lookup>,
        verify: bool,
    },
    /// One bulk scan's answers, one per row of the group.
    ScanDone {
        epoch: u32,
        group: Vec<ReconcileItem>,
        lookups: Vec<Lookup>,
    },
    ConsumerTick {
        c: u8,
        inc: u32,
    },
    ConsumerRestart {
        c: u8,
    },
    /// Adversary: a forged new event on some stream.
    ForgeNewEvent,
    /// Adversary: a genuine message's signature replayed onto other facts.
    ReplaySignature,
    CleanupTick,
    PolicyRevision,
    MigrationRequest,
    EarlyPurgeAttempt,
    BrokerDown {
        cluster: u8,
        until: u64,
    },
    StreamDeleted {
        stream: u8,
        until: u64,
    },
    /// The publish grant on `stream` revoked until `until`.
    GrantRevoked {
        stream: u8,
        until: u64,
    },
    PauseDispatcher {
        d: u8,
        until: u64,
    },
    KillDispatcher {
        d: u8,
    },
    Snapshot,
    Restore,
    FaultsEnd,
    OperatorRelease,
    /// The CDC log reader's next step (read, check, confirm).
    CdcTick {
        inc: u32,
    },
    /// The CDC publisher dies (reader and dispatcher machine), or its stream breaks.
    CdcCrash,
    /// The CDC publisher starts (again): a new window from the slot, or a new slot.
    CdcRestart,
    /// The CDC log reader stalls (the dispatcher machine goes on).
    CdcStall {
        until: u64,
    },
    /// The replication slot is dropped or invalidated.
    CdcSlotLost,
    /// R25: an operator's rollout command on one alias record.
    RolloutSwitch,
    /// R26: the registrar tries to register catalogue entry `entry` for `event_type`.
    Register {
        event_type: u8,
        entry: u8,
    },
    /// R25: the candidate's shadow reader reads back what the other implementation
    /// published on the routes at stage shadow or takeover.
    ShadowRead,
}

#[derive(Clone, Debug)]
struct Fact {
    event_id: EventId,
    members: u16,
    /// The completion rule of a delivery set (`members > 1`), half `all`, half `any`.
    rule: Option<CompletionRule>,
    poison: bool,
    /// The adapter cannot encode it (a header value its wire cannot carry, written before
    /// `enqueue` checked producer strings) while faults are on; afterwards the operator
    /// has repaired it (e.g. a limit raised) and releases it from quarantine.
    unencodable: bool,
    /// Committed at least once (a client got "ok").
    committed: bool,
    /// The aggregate it belongs to, and its version there (1, 2, ... without holes).
    aggregate: u32,
    version: u64,
    /// Its event type (index into [`EVENT_TYPES`]).
    event_type: u8,
    /// Its aggregate's share bucket (the core's `share_bucket`, R25).
    bucket: u8,
}

#[derive(Clone, Debug, Default)]
struct Db {
    rows: Vec<EventRow>,
    row_fact: Vec<u32>,
    /// Each row's commit position, drawn from the position sequence when the row was
    /// inserted (`rows` is in commit order: a transaction that drew its positions and
    /// committed later has rows after higher positions).
    row_position: Vec<u64>,
    /// The rows in commit-position order: the claim index's order.
    by_position: Vec<u32>,
    /// The position sequence: the next value it gives (a rolled-back transaction's
    /// positions are never given again; a restore takes it back with the rows).
    next_position: u64,
    business: Vec<u32>,
    duplicates: Vec<(u32, Receipt)>,
    next_attempt_id: u64,
    policy: u64,
    /// The database log (CDC): every enqueue transaction, in commit order, with the rows the
    /// CDC publisher's publication names (a restore takes it back with the rows).
    log: Vec<LogTxn>,
    /// The end position of the log transaction that inserted each row.
    row_lsn: Vec<u64>,
    /// The delivery sets (R16), written in their rows' transaction (a restore takes them
    /// back with the rows).
    sets: Vec<SetRows>,
    /// The rollout records (R25): at most one alias per stream (cluster and topic). Database
    /// state: a switch is a transaction, a restore takes them back with the rows.
    aliases: Rc<[Alias]>,
    /// Which implementation registered each attempt (event id, member, attempt id,
    /// implementation index), in rollout traces: the model of the store's record of the
    /// attempt's owner and its announced implementation (the shadow reads the rows the
    /// other implementation published). A restore takes it back with the rows.
    attempt_impl: Vec<(EventId, u16, u64, u8)>,
    /// R26: the contract registry, per event type: the catalogue entries of its versions in
    /// version order (version `k` is entry `registry[t][k - 1]`). Empty without contracts.
    registry: Vec<Vec<u8>>,
    /// Migration 12's batch leases (`sealpost_core::lease`): a claim records the first sends
    /// it authorised in one lease instead of writing their rows. `rows` holds the rows as
    /// they reads through their lease (the store's loads); each lease keeps the rows as
    /// stored when it was taken, so that dropping it shows what the store would read then.
    leases: Vec<SimLease>,
    /// Every attempt the store registered, as (row, attempt id): the evidence R8 keeps.
    registered: Vec<(u32, u64)>,
}

/// One batch lease: the dispatcher whose claim took it, its end, and per row the row as
/// stored (never claimed) and what the lease records of it.
#[derive(Clone, Debug)]
struct SimLease {
    dispatcher: u8,
    until_ms: u64,
    rows: Vec<(u32, EventRow, LeasedSend)>,
}

/// One committed delivery set: its fact, completion rule and member rows (member `k` is
/// `rows[k]`).
#[derive(Clone, Debug)]
struct SetRows {
    fact: u32,
    rule: CompletionRule,
    rows: Vec<u32>,
}

/// One committed transaction as the log carries it.
#[derive(Clone, Debug)]
struct LogTxn {
    end_lsn: u64,
    commit_ms: u64,
    rows: Vec<RowKey>,
}

/// The CDC publisher (R32): one process of a dispatcher machine (`dispatchers[d]`) whose
/// claims take the rows the log window offers first, and a log reader that fills the window
/// from the replication slot, checks the offered rows' states and confirms the slot's
/// position through the core's [`LogWindow`].
#[derive(Clone, Debug)]
struct Cdc {
    /// The publisher's dispatcher machine.
    d: u8,
    /// The clusters its publication (and its claims) cover.
    clusters: Vec<String>,
    /// The reader's window (lost with the process).
    window: LogWindow,
    /// Reader incarnation: a crash, reconnect or lost slot ends the old one's ticks.
    inc: u32,
    /// The process runs.
    alive: bool,
    /// The next log transaction the stream delivers (index into `db.log`).
    read_at: usize,
    /// The replication slot's confirmed position (`None`: the slot is lost). Survives every
    /// crash of the publisher.
    slot: Option<u64>,
    /// Where the slot was created: rows committed at or before it were never named by this
    /// slot (a sweep publishes them).
    slot_floor: u64,
    /// This process saw its slot lost: its reader ended (its claims scan: `source`).
    log_lost: bool,
    /// Where the claims come from: the core's rule, one per process (a restart, with or
    /// without a recreated slot, starts a new one catching up).
    source: ClaimSource,
    stalled_until: u64,
    tick_at: Option<u64>,
    /// Ghost: the highest transaction end the log ever delivered (repeats are at or below).
    delivered_max: u64,
    /// The reader stopped on a full window.
    full: bool,
    bytes_max: usize,
    check_every_ms: u64,
    sweep_every_ms: u64,
    /// Per mille per reader step: the confirmed position reaches the slot now (the status
    /// report is periodic: the slot lags the window).
    p_slot_write: u32,
    /// Per mille per reader step: the process dies between reading and checking.
    p_crash: u32,
}

#[derive(Clone, Debug)]
struct Msg {
    /// Sent to a per-aggregate-ordered destination.
    ordered: bool,
    event_id: EventId,
    member: u16,
    envelope_generation: u32,
    attempt_id: u64,
    payload_digest: Digest,
    destination_digest: Digest,
    /// The envelope's event type (index into [`EVENT_TYPES`]).
    event_type: u8,
    /// The `Sealpost-Signature` header it carries.
    signature: Option<Rc<str>>,
    /// Ghost: published by the adversary, and not a dispatcher's signature over this very
    /// claim (an exact replay of a genuine message is the genuine message).
    forged: bool,
}

impl Msg {
    /// The claim a reader rebuilds from the message (its headers and payload digest).
    fn claim(&self) -> SignedClaim {
        SignedClaim {
            event_id: self.event_id,
            member: self.member,
            envelope_generation: self.envelope_generation,
            payload_digest: self.payload_digest,
            destination_digest: self.destination_digest,
            envelope: wire_envelope(self.event_type),
        }
    }

    /// What a lookup reads of the message at `sequence`: a receipt and its seal, unjudged.
    fn found_copy(&self, cluster: &str, topic: &str, sequence: u64) -> FoundCopy {
        FoundCopy::read(
            Receipt {
                event_id: self.event_id,
                member: self.member,
                envelope_generation: self.envelope_generation,
                attempt_id: self.attempt_id,
                payload_digest: self.payload_digest,
                destination_digest: self.destination_digest,
                cluster: cluster.to_string(),
                stream: topic.to_string(),
                partition: None,
                sequence,
                broker_duplicate: false,
                source: ReceiptSource::Lookup,
            },
            Some(wire_envelope(self.event_type)),
            self.signature.as_deref().map(str::to_string),
        )
    }
}

#[derive(Clone, Debug)]
struct Stream {
    cluster: u8,
    topic: u8,
    msgs: Vec<Msg>,
    dedup: Vec<(EventId, u16, u64, u64)>,
}

#[derive(Clone, Debug)]
struct Dispatcher {
    inc: u32,
    alive: bool,
    paused_until: u64,
    owner: u64,
    /// The clusters this process is connected to and claims rows for.
    clusters: Vec<String>,
    /// The production state machine.
    machine: DispatcherMachine,
    /// The batch on the wire.
    batch: Option<Batch>,
    next_batch: u32,
    /// Row, stream and claim of each send of the last claim, in order.
    /// Per claimed row: row, stream, claim token and the lease end it was claimed under.
    claim_meta: Vec<(u32, u8, ClaimToken, u64)>,
    /// The highest position this dispatcher's claim scans reached (the mutant's cursor).
    scan_high_water: u64,
    /// The machine's full scan count at its previous claim.
    full_scans_seen: u64,
    /// The earliest wake-up already queued.
    wake_at: Option<u64>,
    /// The rows this process's claims wrote, as they wrote them (`store::Held`): an ordinary
    /// ACK for one of them takes the guarded fast path while the row is still exactly that.
    held: Vec<(u32, EventRow)>,
    /// The implementation it runs (index into [`IMPLEMENTATIONS`]).
    implementation: u8,
    /// The rollout aliases as this process last read them (when it started, then at each
    /// claim): only the `claim-without-alias-fence` mutant claims with this copy.
    aliases_read: Rc<[Alias]>,
}

#[derive(Clone, Debug)]
struct Reconciler {
    machine: ReconcilerMachine,
    wake_at: Option<u64>,
    /// Rolling verification cursor (row index).
    verify_after: usize,
}

/// The dispatchers' full scan period unless a trace sets another (the default setting).
const RESCAN_EVERY_MS: u64 = 1_000;

fn dispatcher_config(rescan_every_ms: u64) -> DispatcherConfig {
    DispatcherConfig {
        batch_size_max: CLAIM_BATCH_MAX,
        lease_ms: LEASE_MS,
        send_margin_ms: ACK_TIMEOUT_MS,
        idle_poll_ms: DISPATCH_IDLE_POLL_MS,
        error_backoff_ms: 500,
        error_backoff_max_ms: 8_000,
        submit_tries_max: 5,
        rescan_every_ms,
    }
}

fn reconciler(caps: Capabilities, now_ms: u64) -> Reconciler {
    let cfg = ReconcilerConfig {
        batch_max: 8,
        lease_ms: RECONCILE_LEASE_MS,
        lookups_in_flight_max: 4,
        idle_poll_ms: RECONCILE_IDLE_POLL_MS,
        error_backoff_ms: 1_000,
        error_backoff_max_ms: 8_000,
        unknown_alert_ms: 900_000,
        age_check_every_ms: 300_000,
        verify_every_ms: 60_000,
        verify_batch_max: 3,
    };
    Reconciler {
        machine: ReconcilerMachine::new(cfg, caps, now_ms),
        wake_at: None,
        verify_after: 0,
    }
}

#[derive(Clone, Debug, Default)]
struct Consumer {
    inc: u32,
    alive: bool,
    /// Per stream: contiguous consumed prefix (the committed broker position).
    watermark: Vec<u64>,
    /// Per stream: positions above the watermark already acked.
    acked_above: Vec<Vec<u64>>,
    /// The consumer's own database: inbox rows and effects, keyed by event id.
    inbox: Vec<(EventId, InboxRecord)>,
    effects: Vec<(EventId, u32)>,
    next_receipt: u64,
    tick_scheduled: bool,
    /// The consumer's own database: the versions applied per aggregate (committed with the
    /// effect); the gap rule reads the contiguous prefix.
    applied_versions: Vec<(u32, Vec<u64>)>,
    /// Ghost: the highest version applied per aggregate among ordered messages.
    ordered_applied: Vec<(u32, u64)>,
    /// The broker's delivery count per (stream, position): it survives a consumer crash.
    delivered: Vec<((usize, u64), u64)>,
    /// The consumer's own database: events it dead-lettered (recorded, then acked).
    dead_letters: Vec<EventId>,
}

/// Runs one trace.
pub struct World {
    rng: ChaCha8Rng,
    /// The adversary's own randomness (a separate stream: traces without a forgery draw
    /// exactly what they drew before the adversary existed).
    adv: ChaCha8Rng,
    cfg: Config,
    proto: Protocol,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    evs: Vec<Option<Ev>>,
    facts: Vec<Fact>,
    db: Db,
    snapshot: Option<Db>,
    /// When the backup in `snapshot` was taken: the restore point while it may be restored.
    snapshot_at_ms: u64,
    streams: Vec<Stream>,
    broker_down_until: [u64; 2],
    stream_deleted_until: Vec<u64>,
    /// Until when the dispatchers may not publish to each stream (a revoked grant).
    grant_revoked_until: Vec<u64>,
    dispatchers: Vec<Dispatcher>,
    reconciler: Reconciler,
    consumers: Vec<Consumer>,
    faults_on: bool,
    /// Ghost: receipts the store accepted (row, stream, sequence), to check none vanish.
    accepted: Vec<(u32, u8, u64, u64)>,
    /// Ghost: when each row's current unknown episode began.
    unknown_since: Vec<Option<u64>>,
    /// Ghost: messages (index into the stream) that were genuinely published per row.
    pub stats: TraceStats,
    log: Option<Vec<String>>,
    steps: u32,
    /// Database incarnation: bumped by a restore.
    epoch: u32,
    /// Ghost: broker lookups per row (the lookup budget).
    lookups: Vec<u32>,
    /// Ghost: per row, "never sent" reports that sent it back to `PENDING`, and the earliest
    /// time the backoff lets it be claimed again (R28: a retry limit, never a hot loop).
    never_sent_ghost: Vec<(u32, u64)>,
    /// Ghost: broker refusals per row, and whether the row was ever quarantined.
    refusals: Vec<(u32, bool)>,
    /// Bumped by every step that may change the store; the checkers run when it moved.
    db_version: u64,
    checked_version: u64,
    /// Ghost: rows parked in `QUARANTINED` as a conflict (a contradicting copy at a
    /// create-if-absent destination), waiting for an operator's migration.
    conflicts: Vec<u32>,
    /// (class, subject) pairs already counted in this trace.
    reported: Vec<(Violation, u32)>,
    /// Ghost: the first stored copy of each event of an ordered destination, in broker
    /// order: (aggregate, version, event id).
    ordered_stored: Vec<(u32, u64, EventId)>,
    /// Ghost: aggregates a restore set back behind a committed version (its business rows
    /// and envelopes lost): their later versions were written against a history the
    /// database no longer has, so the order checkers skip them (see docs/simulator.md).
    restore_broken: Vec<u32>,
    /// Ghost: the digests of every claim a dispatcher signed.
    signed: Vec<Digest>,
    /// The CDC publisher, in the traces that have one.
    cdc: Option<Box<Cdc>>,
    /// The CDC model's own randomness (traces without a publisher draw what they drew
    /// before it existed).
    crng: ChaCha8Rng,
    /// The log's insert position (never goes back, not even with a restore).
    next_lsn: u64,
    /// Ghost: per row, it has been seen outside the dispatchable phase (a reconciler's retry
    /// or an operator's release may bring a settled row back: the scans' work, not the log's).
    cdc_left: Vec<bool>,
    /// The rollout model's own randomness (R25).
    rrng: ChaCha8Rng,
    /// This trace runs a rollout: switches of the alias records between the implementations.
    rollout: bool,
    /// R25: how often the candidate's shadow reader reads (drawn per trace from its own
    /// randomness, so the other models draw what they drew before it existed).
    shadow_every_ms: u64,
    /// A shadow read is queued.
    shadow_scheduled: bool,
    /// Ghost: the comparisons made (row, primary attempt id, database incarnation): each
    /// row is compared once per primary receipt, as the shadow's cursor passes it once.
    shadow_done: Vec<(u32, u64, u32)>,
    /// The contract model's own randomness (R26).
    krng: ChaCha8Rng,
    /// R26: the contract model, in traces whose routes require contracts.
    contracts: Option<Box<Contracts>>,
    /// The late-commit model's own randomness (traces without late commits draw what they
    /// drew before it existed).
    lrng: ChaCha8Rng,
    /// Per mille of the writers' transactions that insert their rows (drawing positions)
    /// and commit later, while others commit (0: none in this trace).
    p_late_commit: u32,
    /// The dispatchers' full scan period (`DispatcherConfig::rescan_every_ms`).
    rescan_every_ms: u64,
    /// The writers' transactions in progress: they hold a transaction id and drew
    /// positions, and their rows are not visible yet.
    open_txns: Vec<OpenTxn>,
    /// A dispatcher machine looped without waiting: the trace stops after this step.
    halted: bool,
    /// Ghost: rows that committed behind a dispatcher's scan (a scan already passed their
    /// position), not yet claimed.
    late_behind: Vec<u32>,
}

/// A writer's transaction in progress (the late-commit model).
#[derive(Clone, Copy, Debug)]
struct OpenTxn {
    fact: u32,
    /// Its transaction id (the store version when it began: ids are the store's versions).
    txid: u64,
    /// The first of the positions its rows drew (one per member).
    first_position: u64,
    /// The database incarnation it began in (a restore ends it).
    epoch: u32,
}

fn chance(rng: &mut ChaCha8Rng, per_mille: u32) -> bool {
    (rng.next_u32() % 1000) < per_mille
}

fn range(rng: &mut ChaCha8Rng, lo: u64, hi: u64) -> u64 {
    lo + rng.next_u64() % (hi - lo + 1)
}

fn ordered_at(generation: u64, mode: u8) -> bool {
    mode == 1 || (mode == 2 && generation.is_multiple_of(2))
}

fn policy_for(generation: u64, mode: u8) -> RoutePolicy {
    let g = generation as usize;
    RoutePolicy {
        generation,
        cluster: CLUSTERS[g % 2].to_string(),
        topic: TOPICS[g % 3].to_string(),
        partition_algorithm: PartitionAlgorithm::None,
        serializer: "json.v1".to_string(),
        durability: "file".to_string(),
        required_ack: "stream".to_string(),
        ordering: if ordered_at(generation, mode) {
            EventOrdering::PerAggregate
        } else {
            EventOrdering::Unordered
        },
    }
}

fn member_destination(generation: u64, mode: u8, aggregate: u32, member: u16) -> Destination {
    // Member 1 of a delivery set goes to the billing stream of the other cluster.
    let mut p = policy_for(generation, mode);
    if member > 0 {
        p.cluster = CLUSTERS[(generation as usize + 1) % 2].to_string();
        p.topic = TOPICS[2].to_string();
    }
    p.resolve(&format!("tenant-1.order.o-{aggregate}"))
}

impl World {
    /// Builds the world of one trace from its seed.
    pub fn new(trace_seed: u64, proto: Protocol, log: bool) -> World {
        let mut rng = ChaCha8Rng::seed_from_u64(trace_seed);
        let cfg = Config {
            facts: range(&mut rng, 1, 4) as usize,
            dispatchers: range(&mut rng, 1, 3) as usize,
            consumers: 2,
            caps: match range(&mut rng, 0, 9) {
                // NATS JetStream: lookup by subject, duplicate window, create-if-absent.
                0..=3 => Capabilities {
                    lookup_by_event_id: true,
                    duplicate_window_ms: Some(DEDUP_WINDOW_MS),
                    create_if_absent: true,
                    per_key_ordering: false,
                    handover_margin_ms: 0,
                    lookup_scan: None,
                },
                // A broker that can be asked but does not refuse second copies, with a client
                // that may still transmit after the handover (Kafka: 1.5 s).
                // Half of them answer unknowns in bulk: one bounded scan per group of a
                // partition and time window (Kafka's lookup).
                4..=6 => Capabilities {
                    lookup_by_event_id: true,
                    duplicate_window_ms: Some(DEDUP_WINDOW_MS),
                    create_if_absent: false,
                    per_key_ordering: false,
                    handover_margin_ms: 1_500,
                    lookup_scan: chance(&mut rng, 500).then(|| LookupScan {
                        events_max: range(&mut rng, 2, 12) as usize,
                        window_ms: range(&mut rng, 1_000, 120_000),
                    }),
                },
                // A broker that cannot be asked (RabbitMQ): retries, inboxes dedupe.
                _ => Capabilities {
                    lookup_by_event_id: false,
                    duplicate_window_ms: Some(DEDUP_WINDOW_MS),
                    create_if_absent: false,
                    per_key_ordering: false,
                    handover_margin_ms: 0,
                    lookup_scan: None,
                },
            },
            dup_window_ms: if chance(&mut rng, 500) {
                DEDUP_WINDOW_MS
            } else {
                range(&mut rng, 2_000, 30_000)
            },
            fault_end_ms: range(&mut rng, 20_000, 240_000),
            p_stall: range(&mut rng, 0, 120) as u32,
            p_ack_loss: range(&mut rng, 0, 250) as u32,
            p_ack_dup: range(&mut rng, 0, 200) as u32,
            p_ack_late: range(&mut rng, 0, 300) as u32,
            p_req_loss: range(&mut rng, 0, 150) as u32,
            p_receipt_rollback: range(&mut rng, 0, 200) as u32,
            p_writer_crash: range(&mut rng, 0, 300) as u32,
            p_consumer_crash: range(&mut rng, 0, 250) as u32,
            p_redeliver: range(&mut rng, 0, 300) as u32,
            p_seq0: range(&mut rng, 0, 300) as u32,
            p_forge: range(&mut rng, 0, 80) as u32,
            p_forge_copy_first: 0,
            p_forge_copy_lookup: 0,
            p_effect_fail: range(&mut rng, 0, 250) as u32,
            p_db_unreachable: range(&mut rng, 0, 150) as u32,
            scan_max: range(&mut rng, 2, 60) as usize,
            ordering_mode: range(&mut rng, 0, 2) as u8,
            aggregates: 0,
        };
        let mut cfg = cfg;
        let mut adv = ChaCha8Rng::seed_from_u64(trace_seed ^ 0x5EA1_F0E6_ADFE_25A1);
        // A third of the traces have no copy forger; the others one of up to 15% of the
        // requests and up to 20% of the lookups.
        if !chance(&mut adv, 333) {
            cfg.p_forge_copy_first = range(&mut adv, 0, 150) as u32;
            cfg.p_forge_copy_lookup = range(&mut adv, 0, 200) as u32;
        }
        // Half the traces give several facts to one aggregate (its versions 1, 2, ...).
        cfg.aggregates = if chance(&mut rng, 500) {
            range(&mut rng, 1, cfg.facts as u64) as u32
        } else {
            cfg.facts as u32
        };
        let mut crng = ChaCha8Rng::seed_from_u64(trace_seed ^ 0x0CDC_10C5_EA1F_0A57);
        let with_cdc = chance(&mut crng, CDC_TRACES);
        let cdc_alone = with_cdc && chance(&mut crng, CDC_ALONE);
        if cdc_alone {
            cfg.dispatchers = 0;
        }
        // The rollout (R25), from the rollout model's own randomness: two implementations,
        // the alias records (none, or the incumbent "a" on every stream) and switches.
        let mut rrng = ChaCha8Rng::seed_from_u64(trace_seed ^ 0x0A11_A5E5_2025_0B0B);
        let rollout = cfg.dispatchers > 0 && chance(&mut rrng, ROLLOUT_TRACES);
        if rollout {
            cfg.dispatchers = cfg.dispatchers.max(2);
        }
        let aliases: Rc<[Alias]> = if rollout && chance(&mut rrng, 500) {
            let mut v = Vec::new();
            for cluster in 0..CLUSTERS.len() as u8 {
                for topic in 0..TOPICS.len() as u8 {
                    v.push(Alias::new(
                        &route_name(cluster, topic),
                        CLUSTERS[usize::from(cluster)],
                        TOPICS[usize::from(topic)],
                        IMPLEMENTATIONS[0],
                    ));
                }
            }
            v.into()
        } else {
            Rc::from(Vec::new())
        };
        let mut streams = Vec::new();
        for cluster in 0..CLUSTERS.len() as u8 {
            for topic in 0..TOPICS.len() as u8 {
                streams.push(Stream {
                    cluster,
                    topic,
                    msgs: Vec::new(),
                    dedup: Vec::new(),
                });
            }
        }
        let n = cfg.dispatchers;
        // Late commits, from the model's own randomness: in a third of the traces, some
        // writers' transactions insert their rows and commit up to a minute later, and in
        // half of those the dispatchers' full scan comes every ten minutes instead of every
        // second (`rescan_every_ms`), so that a scan from behind finds most late rows.
        let mut lrng = ChaCha8Rng::seed_from_u64(trace_seed ^ 0x1A7E_C033_17A5_0C1D);
        let (p_late_commit, rescan_every_ms) = if chance(&mut lrng, LATE_COMMIT_TRACES) {
            let rescan = if chance(&mut lrng, 500) {
                RESCAN_EVERY_MS
            } else {
                600_000
            };
            (range(&mut lrng, 200, 1000) as u32, rescan)
        } else {
            (0, RESCAN_EVERY_MS)
        };
        let dispatchers = (0..n)
            .map(|i| {
                // Dispatcher 0 serves every cluster; others may serve one only, so rows of
                // clusters a process does not serve are always present.
                // In a rollout the first dispatcher of each implementation serves every
                // cluster, so every row always has a claimant.
                let clusters = match (i, range(&mut rng, 0, 2)) {
                    (0, _) | (_, 0) => CLUSTERS.iter().map(|c| c.to_string()).collect(),
                    (1, _) if rollout => CLUSTERS.iter().map(|c| c.to_string()).collect(),
                    (_, k) => vec![CLUSTERS[(k - 1) as usize].to_string()],
                };
                Dispatcher {
                    inc: 0,
                    alive: true,
                    paused_until: 0,
                    owner: 100 + i as u64,
                    clusters,
                    machine: DispatcherMachine::new(dispatcher_config(rescan_every_ms), 0),
                    batch: None,
                    next_batch: 0,
                    claim_meta: Vec::new(),
                    scan_high_water: 0,
                    full_scans_seen: 0,
                    wake_at: None,
                    held: Vec::new(),
                    implementation: (i % 2) as u8,
                    aliases_read: Rc::clone(&aliases),
                }
            })
            .collect();
        let mut dispatchers: Vec<Dispatcher> = dispatchers;
        let cdc = with_cdc.then(|| {
            let d = dispatchers.len() as u8;
            // The publisher alone covers every cluster; beside polling dispatchers it may
            // cover one (its publication names that cluster's rows only).
            let clusters: Vec<String> = if cdc_alone || chance(&mut crng, 500) {
                CLUSTERS.iter().map(|c| c.to_string()).collect()
            } else {
                vec![CLUSTERS[range(&mut crng, 0, 1) as usize].to_string()]
            };
            dispatchers.push(Dispatcher {
                inc: 0,
                alive: true,
                paused_until: 0,
                owner: CDC_OWNER,
                clusters: clusters.clone(),
                machine: DispatcherMachine::new(dispatcher_config(rescan_every_ms), 0),
                batch: None,
                next_batch: 0,
                claim_meta: Vec::new(),
                scan_high_water: 0,
                full_scans_seen: 0,
                wake_at: None,
                held: Vec::new(),
                implementation: d % 2,
                aliases_read: Rc::clone(&aliases),
            });
            // A small window in some traces, so it fills.
            let bytes_max = if chance(&mut crng, 400) {
                range(&mut crng, 1, 3) as usize * (TXN_BYTES + ROW_BYTES)
            } else {
                8 << 20
            };
            let check_every_ms = range(&mut crng, 200, 2_000);
            let sweep_every_ms = range(&mut crng, 2_000, 20_000);
            Box::new(Cdc {
                d,
                clusters,
                window: LogWindow::new(0, bytes_max),
                inc: 0,
                alive: true,
                read_at: 0,
                slot: Some(0),
                slot_floor: 0,
                log_lost: false,
                source: ClaimSource::new(sweep_every_ms),
                stalled_until: 0,
                tick_at: None,
                delivered_max: 0,
                full: false,
                bytes_max,
                check_every_ms,
                sweep_every_ms,
                p_slot_write: range(&mut crng, 200, 1000) as u32,
                p_crash: range(&mut crng, 0, 30) as u32,
            })
        });
        let mut krng = ChaCha8Rng::seed_from_u64(trace_seed ^ 0x0C0A_7AC7_2026_0B26);
        let contracts = chance(&mut krng, CONTRACT_TRACES).then(|| {
            Box::new(Contracts {
                writes: Vec::new(),
                payloads: Vec::new(),
                readers: vec![vec![None; EVENT_TYPES.len()]; cfg.consumers],
                made: Vec::new(),
            })
        });
        // Version 1 of every event type is registered before the trace starts.
        let registry = if contracts.is_some() {
            vec![vec![0]; EVENT_TYPES.len()]
        } else {
            Vec::new()
        };
        let reconciler = reconciler(cfg.caps, 0);
        let consumers = (0..cfg.consumers)
            .map(|_| Consumer {
                alive: true,
                watermark: vec![0; streams.len()],
                acked_above: vec![Vec::new(); streams.len()],
                ..Consumer::default()
            })
            .collect();
        let mut w = World {
            rng,
            adv,
            cfg,
            proto,
            now: 0,
            seq: 0,
            queue: BinaryHeap::with_capacity(64),
            evs: Vec::with_capacity(512),
            facts: Vec::new(),
            db: Db {
                next_attempt_id: 1,
                aliases,
                registry,
                ..Db::default()
            },
            snapshot: None,
            snapshot_at_ms: 0,
            stream_deleted_until: vec![0; streams.len()],
            grant_revoked_until: vec![0; streams.len()],
            streams,
            broker_down_until: [0; 2],
            dispatchers,
            reconciler,
            consumers,
            faults_on: true,
            accepted: Vec::new(),
            unknown_since: Vec::new(),
            stats: TraceStats::default(),
            log: if log { Some(Vec::new()) } else { None },
            steps: 0,
            epoch: 0,
            lookups: Vec::new(),
            never_sent_ghost: Vec::new(),
            refusals: Vec::new(),
            db_version: 0,
            checked_version: u64::MAX,
            conflicts: Vec::new(),
            reported: Vec::new(),
            ordered_stored: Vec::new(),
            restore_broken: Vec::new(),
            signed: Vec::new(),
            cdc,
            crng,
            next_lsn: 0,
            cdc_left: Vec::new(),
            rrng,
            rollout,
            shadow_every_ms: range(
                &mut ChaCha8Rng::seed_from_u64(trace_seed ^ 0x05AD_0E5E_AD02_5B0B),
                2_000,
                10_000,
            ),
            shadow_scheduled: false,
            shadow_done: Vec::new(),
            krng,
            contracts,
            p_late_commit,
            rescan_every_ms,
            lrng,
            open_txns: Vec::new(),
            halted: false,
            late_behind: Vec::new(),
        };
        w.stats.late.traces = u64::from(p_late_commit > 0);
        w.stats.contracts.traces = u64::from(w.contracts.is_some());
        w.stats.rollout.traces = u64::from(rollout);
        if w.cdc.is_some() {
            w.stats.cdc.traces = 1;
            w.stats.cdc.alone = u64::from(cdc_alone);
        }
        w.plan();
        w
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        let idx = self.evs.len();
        self.evs.push(Some(ev));
        self.queue.push(Reverse((t, self.seq, idx)));
    }

    fn note(&mut self, f: impl FnOnce() -> String) {
        if let Some(l) = self.log.as_mut() {
            l.push(format!("t={:>9}ms {}", self.now, f()));
        }
    }

    /// The step-by-step log, when built with `log = true`.
    pub fn take_log(&mut self) -> Vec<String> {
        self.log.take().unwrap_or_default()
    }

    fn plan(&mut self) {
        let end = self.cfg.fault_end_ms;
        for f in 0..self.cfg.facts {
            let members = if chance(&mut self.rng, 150) { 2 } else { 1 };
            let poison = chance(&mut self.rng, 40);
            let mut random = [0u8; 10];
            self.rng.fill_bytes(&mut random);
            // From bytes already drawn (no new draw: every other trace stays as it was).
            let unencodable = !poison && random[9] % 64 == 0;
            let rule = (members > 1).then_some(if random[8] % 2 == 0 {
                CompletionRule::All
            } else {
                CompletionRule::Any
            });
            let t = range(&mut self.rng, 0, end * 3 / 4);
            // R3: the id is minted once, when the command is first accepted; every retry
            // of the command carries it.
            self.facts.push(Fact {
                event_id: EventId::mint(1_700_000_000_000 + t, random),
                members,
                rule,
                poison,
                unencodable,
                committed: false,
                aggregate: f as u32 % self.cfg.aggregates,
                version: (f as u32 / self.cfg.aggregates) as u64 + 1,
                // From a byte already drawn, like `unencodable`.
                event_type: random[7] % EVENT_TYPES.len() as u8,
                bucket: share_bucket(
                    AGGREGATE_TYPE,
                    &format!("o-{}", f as u32 % self.cfg.aggregates),
                ),
            });
            self.at(t, Ev::WriterCommit { fact: f as u32 });
        }
        for d in 0..self.cfg.dispatchers as u8 {
            let t = range(&mut self.rng, 0, DISPATCH_IDLE_POLL_MS);
            self.at(t, Ev::DispatchWake { d, inc: 0 });
            self.dispatchers[d as usize].wake_at = Some(t);
        }
        for c in 0..self.cfg.consumers as u8 {
            let t = range(&mut self.rng, 0, 1000);
            self.at(t, Ev::ConsumerTick { c, inc: 0 });
            self.consumers[c as usize].tick_scheduled = true;
        }
        self.at(RECONCILE_IDLE_POLL_MS, Ev::ReconcileWake { epoch: 0 });
        self.reconciler.wake_at = Some(RECONCILE_IDLE_POLL_MS);
        self.at(CLEANUP_EVERY_MS, Ev::CleanupTick);
        self.at(end, Ev::FaultsEnd);
        // Faults with a time of their own.
        let n = range(&mut self.rng, 0, 2);
        for _ in 0..n {
            let t = range(&mut self.rng, 0, end);
            self.at(t, Ev::PolicyRevision);
        }
        for _ in 0..range(&mut self.rng, 0, 2) {
            let t = range(&mut self.rng, 0, end);
            self.at(t, Ev::MigrationRequest);
        }
        for _ in 0..range(&mut self.rng, 0, 2) {
            let t = range(&mut self.rng, 0, end + 120_000);
            self.at(t, Ev::EarlyPurgeAttempt);
        }
        if chance(&mut self.rng, 200) {
            let stream = (self.rng.next_u32() as usize % self.streams.len()) as u8;
            let t = range(&mut self.rng, 0, end);
            let until = t + range(&mut self.rng, 1_000, STREAM_DELETED_MAX_MS);
            self.at(t, Ev::StreamDeleted { stream, until });
        }
        if chance(&mut self.rng, 200) {
            let stream = (self.rng.next_u32() as usize % self.streams.len()) as u8;
            let t = range(&mut self.rng, 0, end);
            let until = t + range(&mut self.rng, 1_000, STREAM_DELETED_MAX_MS);
            self.at(t, Ev::GrantRevoked { stream, until });
        }
        if chance(&mut self.rng, 350) {
            let cluster = (self.rng.next_u32() % 2) as u8;
            let t = range(&mut self.rng, 0, end);
            let until = t + range(&mut self.rng, 1_000, BROKER_OUTAGE_MAX_MS);
            self.at(t, Ev::BrokerDown { cluster, until });
        }
        for d in 0..self.cfg.dispatchers as u8 {
            if chance(&mut self.rng, 450) {
                let t = range(&mut self.rng, 0, end);
                let until = t + range(&mut self.rng, 1_000, 3 * LEASE_MS);
                self.at(t, Ev::PauseDispatcher { d, until });
            }
            if chance(&mut self.rng, 200) {
                let t = range(&mut self.rng, 0, end);
                self.at(t, Ev::KillDispatcher { d });
            }
        }
        if chance(&mut self.rng, 150) {
            let t1 = range(&mut self.rng, 0, end / 2);
            let t2 = range(&mut self.rng, t1 + 1, end);
            self.at(t1, Ev::Snapshot);
            self.at(t2, Ev::Restore);
        }
        // The adversary's own events, from its own randomness.
        for _ in 0..range(&mut self.adv, 0, 2) {
            let t = range(&mut self.adv, 0, end);
            self.at(t, Ev::ForgeNewEvent);
        }
        for _ in 0..range(&mut self.adv, 0, 2) {
            let t = range(&mut self.adv, 0, end);
            self.at(t, Ev::ReplaySignature);
        }
        // The rollout's switches, from the rollout model's own randomness.
        if self.rollout {
            for _ in 0..range(&mut self.rrng, 2, 8) {
                let t = range(&mut self.rrng, 0, end);
                self.at(t, Ev::RolloutSwitch);
            }
        }
        // The registrar's attempts and the producers' schemas, from the contract model's own
        // randomness: each event type's compatible versions and one breaking candidate, at
        // random times; most producers write a compatible version (registered yet or not),
        // one in eight a breaking one.
        if let Some(k) = self.contracts.as_mut() {
            let mut plan = Vec::new();
            for t in 0..EVENT_TYPES.len() as u8 {
                let breaking = range(
                    &mut self.krng,
                    CONTRACT_COMPATIBLE as u64,
                    CONTRACT_SCHEMAS.len() as u64 - 1,
                );
                for entry in [1, 2, breaking as u8] {
                    plan.push((range(&mut self.krng, 0, end), t, entry));
                }
            }
            k.writes = (0..self.facts.len())
                .map(|_| {
                    if chance(&mut self.krng, 125) {
                        range(
                            &mut self.krng,
                            CONTRACT_COMPATIBLE as u64,
                            CONTRACT_SCHEMAS.len() as u64 - 1,
                        ) as u8
                    } else {
                        range(&mut self.krng, 0, CONTRACT_COMPATIBLE as u64 - 1) as u8
                    }
                })
                .collect();
            k.payloads = vec![None; self.facts.len()];
            for (t, event_type, entry) in plan {
                self.at(t, Ev::Register { event_type, entry });
            }
        }
        // The CDC publisher's start and faults, from the CDC model's own randomness.
        if let Some(c) = self.cdc.as_ref() {
            let d = c.d;
            let t = range(&mut self.crng, 0, DISPATCH_IDLE_POLL_MS);
            self.at(t, Ev::DispatchWake { d, inc: 0 });
            self.dispatchers[d as usize].wake_at = Some(t);
            self.at(0, Ev::CdcTick { inc: 0 });
            for _ in 0..range(&mut self.crng, 0, 3) {
                let t = range(&mut self.crng, 0, end);
                self.at(t, Ev::CdcCrash);
            }
            for _ in 0..range(&mut self.crng, 0, 2) {
                let t = range(&mut self.crng, 0, end);
                let until = t + range(&mut self.crng, 1_000, 6 * LEASE_MS);
                self.at(t, Ev::CdcStall { until });
            }
            if chance(&mut self.crng, 250) {
                let t = range(&mut self.crng, 0, end);
                self.at(t, Ev::CdcSlotLost);
            }
        }
    }

    /// Runs the trace to quiescence (or its bound) and checks liveness.
    pub fn run(mut self) -> (TraceStats, Vec<String>) {
        while let Some(Reverse((t, _, idx))) = self.queue.pop() {
            let Some(ev) = self.evs[idx].take() else {
                continue;
            };
            self.now = t;
            self.steps += 1;
            self.step(ev);
            if self.db_version != self.checked_version {
                self.checked_version = self.db_version;
                self.check_rows();
            }
            if !self.faults_on
                && (self.now > self.cfg.fault_end_ms + DRAIN_MAX_MS || self.quiescent())
            {
                break;
            }
            if self.steps >= STEPS_MAX || self.halted {
                break;
            }
        }
        self.finish();
        self.stats.steps = u64::from(self.steps);
        let log = self.take_log();
        (self.stats, log)
    }

    /// Records a violation of class `v` about `subject` (a row, consumer or message); each
    /// (class, subject) pair counts once per trace however many steps it persists.
    fn violation_of(&mut self, v: Violation, subject: u32, why: impl FnOnce() -> String) {
        if self.reported.contains(&(v, subject)) {
            return;
        }
        self.reported.push((v, subject));
        self.stats.violations.add(v);
        if let Some(l) = self.log.as_mut() {
            l.push(format!("t={:>9}ms VIOLATION {:?}: {}", self.now, v, why()));
        }
    }

    fn violation(&mut self, v: Violation, why: impl FnOnce() -> String) {
        let subject = u32::MAX - self.reported.len() as u32;
        self.violation_of(v, subject, why);
    }

    fn stream_of(&self, d: &Destination) -> Option<u8> {
        let c = CLUSTERS.iter().position(|x| *x == d.cluster)?;
        let t = TOPICS.iter().position(|x| *x == d.topic)?;
        self.streams
            .iter()
            .position(|s| s.cluster as usize == c && s.topic as usize == t)
            .map(|i| i as u8)
    }

    fn fault(&mut self, f: Fault) {
        self.stats.faults.add(f);
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::WriterCommit { fact } => self.writer_commit(fact),
            Ev::WriterLateCommit { fact, epoch } => self.writer_late_commit(fact, epoch),
            Ev::DispatchWake { d, inc } => self.dispatch_wake(d, inc),
            Ev::Leave { d, inc, batch } => self.leave(d, inc, batch),
            Ev::BrokerReceive { req } => self.broker_receive(*req),
            Ev::AckArrive {
                d,
                inc,
                batch,
                slot,
                result,
            } => self.ack_arrive(d, inc, batch, slot, *result),
            Ev::BatchTimeout { d, inc, batch } => self.batch_timeout(d, inc, batch),
            Ev::DispatcherRestart { d } => self.restart_dispatcher(d),
            Ev::ReconcileWake { epoch } => self.reconcile_wake(epoch),
            Ev::LookupDone {
                epoch,
                item,
                lookup,
                verify,
            } => self.lookup_done(epoch, *item, *lookup, verify),
            Ev::ScanDone {
                epoch,
                group,
                lookups,
            } => {
                if epoch == self.epoch {
                    self.reconciler.machine.handle_lookups(group, lookups);
                    self.drive_reconciler();
                }
            }
            Ev::ConsumerTick { c, inc } => self.consumer_tick(c, inc),
            Ev::ConsumerRestart { c } => {
                let con = &mut self.consumers[c as usize];
                con.alive = true;
                con.inc += 1;
                let inc = con.inc;
                con.tick_scheduled = true;
                self.at(self.now, Ev::ConsumerTick { c, inc });
            }
            Ev::ForgeNewEvent => self.forge_new_event(),
            Ev::ReplaySignature => self.replay_signature(),
            Ev::CleanupTick => {
                self.cleanup(None);
                self.at(self.now + CLEANUP_EVERY_MS, Ev::CleanupTick);
            }
            Ev::PolicyRevision => {
                self.fault(Fault::RoutePolicyRevision);
                self.db.policy += 1;
                let p = self.db.policy;
                self.note(|| format!("route policy -> generation {p}"));
            }
            Ev::MigrationRequest => self.migration_request(),
            Ev::EarlyPurgeAttempt => {
                if !self.db.rows.is_empty() {
                    let r = (self.rng.next_u32() as usize % self.db.rows.len()) as u32;
                    self.fault(Fault::EarlyPurgeAttempt);
                    self.cleanup(Some(r));
                }
            }
            Ev::BrokerDown { cluster, until } => {
                self.fault(Fault::BrokerDown);
                self.broker_down_until[cluster as usize] =
                    until.min(self.cfg.fault_end_ms.max(until));
                self.note(|| format!("broker {} down until {until}", CLUSTERS[cluster as usize]));
            }
            Ev::StreamDeleted { stream, until } => {
                if self.faults_on {
                    self.fault(Fault::StreamDeleted);
                    self.stream_deleted_until[stream as usize] = until;
                    self.note(|| format!("stream {stream} deleted until {until}"));
                }
            }
            Ev::GrantRevoked { stream, until } => {
                if self.faults_on {
                    self.grant_revoked_until[stream as usize] = until;
                    self.note(|| format!("publish grant on stream {stream} revoked until {until}"));
                }
            }
            Ev::PauseDispatcher { d, until } => {
                if self.faults_on {
                    self.fault(Fault::DispatcherPaused);
                    self.dispatchers[d as usize].paused_until = until;
                    self.note(|| format!("dispatcher {d} paused until {until}"));
                }
            }
            Ev::KillDispatcher { d } => {
                let disp = &mut self.dispatchers[d as usize];
                if disp.alive && self.faults_on {
                    disp.alive = false;
                    disp.inc += 1;
                    self.fault(Fault::DispatcherKilled);
                    let t = self.now + range(&mut self.rng, 1_000, 30_000);
                    self.at(t, Ev::DispatcherRestart { d });
                    self.note(|| format!("dispatcher {d} killed"));
                }
            }
            Ev::Snapshot => {
                self.snapshot = Some(self.db.clone());
                self.snapshot_at_ms = self.now;
                self.note(|| "database backup taken".into());
            }
            Ev::Restore => self.restore(),
            Ev::FaultsEnd => {
                self.faults_on = false;
                self.broker_down_until = [0; 2];
                self.stream_deleted_until.iter_mut().for_each(|u| *u = 0);
                self.grant_revoked_until.iter_mut().for_each(|u| *u = 0);
                for d in &mut self.dispatchers {
                    d.paused_until = 0;
                }
                if let Some(c) = self.cdc.as_mut() {
                    c.stalled_until = 0;
                }
                self.operator_release();
                self.note(|| "faults end; draining".into());
            }
            Ev::OperatorRelease => self.operator_release(),
            Ev::CdcTick { inc } => self.cdc_tick(inc),
            Ev::RolloutSwitch => {
                if self.faults_on {
                    self.rollout_switch();
                    self.schedule_shadow();
                }
            }
            Ev::ShadowRead => self.shadow_read(),
            Ev::Register { event_type, entry } => self.contract_register(event_type, entry),
            Ev::CdcCrash => {
                if self.faults_on {
                    self.cdc_crash();
                }
            }
            Ev::CdcRestart => self.cdc_restart(),
            Ev::CdcStall { until } => {
                if let Some(c) = self.cdc.as_mut().filter(|_| self.faults_on) {
                    c.stalled_until = until;
                    self.stats.cdc.stalls += 1;
                    self.note(|| format!("CDC reader stalls until {until}"));
                }
            }
            Ev::CdcSlotLost => {
                if self.faults_on {
                    self.cdc_slot_lost();
                    // The operator starts the publisher again after the ALERT: the next start
                    // creates the slot at the log's end and catches up by scanning.
                    let t = self.now + range(&mut self.crng, 5_000, 60_000);
                    self.at(t, Ev::CdcRestart);
                }
            }
        }
    }

    /// The operator's exit path for poison (R6), once faults stop: release quarantined rows
    /// (`sealpost release`), and look again a minute later while anything is unpublished
    /// (a refusal decided before the faults ended may be reported after).
    fn operator_release(&mut self) {
        self.db_version += 1;
        for i in 0..self.db.rows.len() {
            if self.db.rows[i].state == State::Quarantined && !self.conflicts.contains(&(i as u32))
            {
                if let Some(g) = self.never_sent_ghost.get_mut(i) {
                    *g = (0, 0);
                }
                match apply_release_quarantine(&mut self.db.rows[i]) {
                    Ok(()) => self.stats.quarantine_released += 1,
                    Err(e) => self.violation(Violation::Liveness, || e.to_string()),
                }
            }
        }
        self.wake_dispatchers();
        let waiting = (0..self.db.rows.len()).any(|i| {
            !self.db.rows[i].state.is_published() && !self.conflicts.contains(&(i as u32))
        });
        if waiting {
            self.at(self.now + 60_000, Ev::OperatorRelease);
        }
    }

    // ---------------------------------------------------------------- business writers

    fn writer_commit(&mut self, fact: u32) {
        self.db_version += 1;
        let f = fact as usize;
        if self.db.business.contains(&fact) {
            return; // a retried command finds its committed fact: no second id (R3)
        }
        if self.open_txns.iter().any(|t| t.fact == fact) {
            return; // its transaction is still open: it commits or retries itself
        }
        // The producer writes version v of an aggregate after reading version v - 1 under
        // the aggregate's lock: a later version never commits before an earlier one.
        let (agg, version) = (self.facts[f].aggregate, self.facts[f].version);
        let predecessor = self
            .facts
            .iter()
            .position(|x| x.aggregate == agg && x.version + 1 == version);
        // (A restore may lose the predecessor's commit afterwards, with its business row:
        // then the producer's later version stands alone, as it would in production.)
        if predecessor.is_some_and(|p| !self.facts[p].committed) {
            let t = self.now + range(&mut self.rng, 100, 2_000);
            self.at(t, Ev::WriterCommit { fact });
            return;
        }
        if self.faults_on && chance(&mut self.rng, self.cfg.p_writer_crash) {
            // F1: killed before the commit; the client retries with the same command.
            self.fault(Fault::CrashBeforeCommit);
            let t = self.now + range(&mut self.rng, 500, 5_000);
            self.at(t, Ev::WriterCommit { fact });
            return;
        }
        if !self.contract_enqueue(fact) {
            // R26: `enqueue` refused the payload; the transaction rolled back, and the
            // producer writes again (with the newest registered version) a little later.
            let t = self.now + range(&mut self.krng, 500, 5_000);
            self.at(t, Ev::WriterCommit { fact });
            return;
        }
        let members = u64::from(self.facts[f].members);
        // The enqueue statement: the transaction has its id (`txid_current()`, the store
        // version here) before the rows draw their positions.
        let first_position = self.db.next_position;
        self.db.next_position += members;
        if self.p_late_commit > 0 && chance(&mut self.lrng, self.p_late_commit) {
            // The transaction stays open: its rows are not visible, its id holds the
            // horizon back, and it commits (or is killed) later.
            self.open_txns.push(OpenTxn {
                fact,
                txid: self.db_version,
                first_position,
                epoch: self.epoch,
            });
            let t = self.now + range(&mut self.lrng, 20, 60_000);
            let epoch = self.epoch;
            self.at(t, Ev::WriterLateCommit { fact, epoch });
            self.note(|| {
                format!("fact {fact}'s transaction drew position(s) from {first_position}; it commits at {t}")
            });
            return;
        }
        self.writer_insert(fact, first_position);
    }

    /// The end of a transaction that drew its positions earlier: it commits, unless its
    /// writer is killed first (F1: the positions are lost, the client retries) or a restore
    /// ended it (the database it ran in is gone: the client retries).
    fn writer_late_commit(&mut self, fact: u32, epoch: u32) {
        self.db_version += 1;
        let found = self
            .open_txns
            .iter()
            .position(|t| t.fact == fact && t.epoch == epoch);
        let txn = match found {
            Some(k) => self.open_txns.remove(k),
            None => {
                // A restore ended it: the client's commit fails and it retries the command.
                let t = self.now + range(&mut self.lrng, 500, 5_000);
                self.at(t, Ev::WriterCommit { fact });
                return;
            }
        };
        if self.faults_on && chance(&mut self.lrng, self.cfg.p_writer_crash) {
            self.fault(Fault::CrashBeforeCommit);
            self.note(|| format!("fact {fact}'s transaction rolls back (writer killed)"));
            let t = self.now + range(&mut self.lrng, 500, 5_000);
            self.at(t, Ev::WriterCommit { fact });
            return;
        }
        self.stats.late.commits += 1;
        let behind = (0..self.dispatchers.len()).any(|d| {
            self.dispatchers[d].alive && self.dispatchers[d].scan_high_water > txn.first_position
        });
        let first_row = self.db.rows.len() as u32;
        self.writer_insert(fact, txn.first_position);
        if behind {
            let n = self.db.rows.len() as u32 - first_row;
            self.stats.late.behind_scan += u64::from(n);
            self.late_behind.extend(first_row..first_row + n);
        }
    }

    /// The rows of a transaction become visible (it commits): the business row, every
    /// member's `PENDING` envelope at the positions it drew, the delivery set.
    fn writer_insert(&mut self, fact: u32, first_position: u64) {
        let f = fact as usize;
        let facts = &self.facts[f];
        let event_id = facts.event_id;
        let agg = facts.aggregate;
        let payload = Digest::of_bytes(PAYLOAD_DOMAIN, &fact.to_be_bytes());
        let members = facts.members;
        let rule = facts.rule;
        // One transaction: business row and every member's PENDING envelope (R4), and the
        // delivery set naming them (R16).
        self.db.business.push(fact);
        let first_row = self.db.rows.len() as u32;
        let mut named = Vec::new();
        let end_lsn = self.next_lsn + 16 + 8 * u64::from(members);
        for m in 0..members {
            let dest = member_destination(self.db.policy, self.cfg.ordering_mode, agg, m);
            if let Some(c) = self.cdc.as_ref() {
                // The log carries the insert; the publication names it if it is bound for
                // one of the publisher's clusters (`row_lsn` 0: a row it never names).
                let lsn = if c.clusters.contains(&dest.cluster) {
                    named.push((event_id, m));
                    end_lsn
                } else {
                    0
                };
                self.db.row_lsn.push(lsn);
            }
            let row = self.db.rows.len() as u32;
            let position = first_position + u64::from(m);
            self.db
                .rows
                .push(EventRow::new_pending(event_id, m, payload, dest));
            self.db.row_fact.push(fact);
            self.db.row_position.push(position);
            let (order, positions) = (&self.db.by_position, &self.db.row_position);
            let at = order.partition_point(|&r| positions[r as usize] < position);
            self.db.by_position.insert(at, row);
            self.unknown_since.push(None);
        }
        if let Some(rule) = rule {
            self.db.sets.push(SetRows {
                fact,
                rule,
                rows: (first_row..first_row + u32::from(members)).collect(),
            });
        }
        self.facts[f].committed = true;
        if self.cdc.is_some() {
            self.next_lsn = end_lsn;
            self.db.log.push(LogTxn {
                end_lsn,
                commit_ms: self.now,
                rows: named,
            });
            self.cdc_log_grew();
        }
        self.note(|| format!("commit fact {fact} as {event_id} ({members} member(s))"));
        if self.faults_on && chance(&mut self.rng, self.cfg.p_writer_crash) {
            // F1: killed after the commit, before the response: the client retries.
            self.fault(Fault::CrashAfterCommit);
            let t = self.now + range(&mut self.rng, 500, 5_000);
            self.at(t, Ev::WriterCommit { fact });
        }
        self.wake_dispatchers();
    }

    fn wake_dispatchers(&mut self) {
        // LISTEN/NOTIFY: a commit wakes the idle dispatchers soon.
        let t = self.now + 5;
        for d in 0..self.dispatchers.len() {
            if self.cdc.as_ref().is_some_and(|c| c.d as usize == d) {
                continue; // the CDC publisher is woken by its log reader
            }
            let disp = &mut self.dispatchers[d];
            if disp.alive && disp.machine.is_idle() {
                disp.machine.handle_notify(t);
                if disp.wake_at.is_none_or(|w| t < w) {
                    disp.wake_at = Some(t);
                    let inc = disp.inc;
                    self.at(t, Ev::DispatchWake { d: d as u8, inc });
                }
            }
        }
    }

    /// A new dispatcher process: a fresh machine, nothing in flight.
    fn restart_dispatcher(&mut self, d: u8) {
        let now = self.now;
        let disp = &mut self.dispatchers[d as usize];
        disp.alive = true;
        disp.inc += 1;
        disp.machine = DispatcherMachine::new(dispatcher_config(self.rescan_every_ms), now);
        disp.full_scans_seen = 0;
        disp.batch = None;
        disp.claim_meta.clear();
        disp.held.clear();
        disp.aliases_read = Rc::clone(&self.db.aliases);
        disp.wake_at = Some(now);
        let inc = disp.inc;
        self.at(now, Ev::DispatchWake { d, inc });
    }

    // ---------------------------------------------------------------- dispatchers
    //
    // Each dispatcher is a `DispatcherMachine` from the core, the same one the tokio shell
    // drives: this section only performs its actions against the simulated store, adapter,
    // network and broker, and feeds it the answers at virtual times.

    /// True if the event must wait (dispatcher paused), re-queued at the pause end.
    fn deferred(&mut self, d: u8, ev: &Ev) -> bool {
        let until = self.dispatchers[d as usize].paused_until;
        if until > self.now {
            self.at(until, ev.clone());
            return true;
        }
        false
    }

    fn live(&self, d: u8, inc: u32) -> bool {
        let disp = &self.dispatchers[d as usize];
        disp.alive && disp.inc == inc
    }

    fn dispatch_wake(&mut self, d: u8, inc: u32) {
        if !self.live(d, inc) {
            return;
        }
        if self.deferred(d, &Ev::DispatchWake { d, inc }) {
            return;
        }
        if self.dispatchers[d as usize]
            .wake_at
            .is_some_and(|w| w > self.now)
        {
            return; // superseded by a later-scheduled, earlier wake-up that already ran
        }
        self.dispatchers[d as usize].wake_at = None;
        self.drive_dispatcher(d);
    }

    /// Polls the machine and performs its actions until it waits. A machine that never
    /// waits (claims in a loop at one instant) is a liveness violation: the shell would
    /// spin on the database.
    fn drive_dispatcher(&mut self, d: u8) {
        let di = d as usize;
        let mut actions = 0;
        while let Some(action) = self.dispatchers[di].machine.poll_action(self.now) {
            self.dispatch_action(d, action);
            actions += 1;
            if actions == DRIVE_ACTIONS_MAX {
                self.violation(Violation::Liveness, || {
                    format!("d{d} took {DRIVE_ACTIONS_MAX} actions without waiting (a claim loop)")
                });
                // It would loop at every wake-up: the trace ends here.
                self.halted = true;
                break;
            }
        }
        if let Some(t) = self.dispatchers[di].machine.poll_timeout() {
            let t = t.max(self.now);
            if self.dispatchers[di].wake_at.is_none_or(|w| t < w) {
                self.dispatchers[di].wake_at = Some(t);
                let inc = self.dispatchers[di].inc;
                self.at(t, Ev::DispatchWake { d, inc });
            }
        }
    }

    fn dispatch_action(&mut self, d: u8, action: DispatchAction) {
        match action {
            DispatchAction::Claim {
                batch_size_max,
                from_position,
            } => {
                let now = self.now;
                // The CDC publisher chooses before its transaction (a failed transaction
                // leaves the rows offered: the check reopens them).
                let from = self.cdc_choose(d, batch_size_max);
                if self.database_unreachable() {
                    self.dispatchers[d as usize]
                        .machine
                        .handle_claim_failed(now);
                    return;
                }
                let claimed = match from {
                    Some(from) => self.cdc_claim(d, batch_size_max, from_position, from),
                    None => self.store_claim(d, batch_size_max, from_position, None),
                };
                if let Some(send) = self.dispatchers[d as usize]
                    .machine
                    .handle_claimed(now, claimed)
                {
                    self.dispatch_action(d, send);
                }
            }
            DispatchAction::Send { batch, deadline_ms } => self.start_send(d, batch, deadline_ms),
            DispatchAction::Submit(sub) => {
                let now = self.now;
                if self.database_unreachable() {
                    self.dispatchers[d as usize]
                        .machine
                        .handle_submit_unreachable(now);
                    return;
                }
                let ok = self.store_submit(d, &sub);
                self.dispatchers[d as usize]
                    .machine
                    .handle_submitted(now, ok);
            }
        }
    }

    /// The store's claim transaction (`store::claim_batch`): the scan picks, in commit order
    /// (row index = commit position) from `from_position`, the rows of this dispatcher's
    /// clusters that the core's [`step::picks`] takes, up to the batch (the store's `LIMIT`),
    /// with the fact "an earlier version is unresolved" and an attempt id drawn per picked
    /// row; then the core's claim step, the one the store runs, decides every row.
    fn store_claim(
        &mut self,
        d: u8,
        max: usize,
        from_position: u64,
        only: Option<&[RowKey]>,
    ) -> Claimed {
        self.db_version += 1;
        let di = d as usize;
        // Whether this is the machine's full scan (for the late-commit counts).
        let full_scan = {
            let m = &mut self.dispatchers[di];
            let n = m.machine.counts().full_scans;
            std::mem::replace(&mut m.full_scans_seen, n) < n
        };
        let owner = self.dispatchers[di].owner;
        let clusters = std::mem::take(&mut self.dispatchers[di].clusters);
        let now = self.now;
        let mut claimed = Claimed {
            claim_started_ms: now,
            db_now_ms: now,
            sends: Vec::new(),
            last_position: None,
            ordered_from: None,
            // The claim's first round trip: a snapshot (the store versions stand for the
            // transaction ids: every one below this claim's has ended, except the writers'
            // transactions still open), then the position sequence. A claim of named rows
            // reads none.
            horizon: only.is_none().then(|| Horizon {
                xmin: self
                    .open_txns
                    .iter()
                    .map(|t| t.txid)
                    .fold(self.db_version, u64::min),
                xmax: self.db_version,
                last_position: self.db.next_position.saturating_sub(1),
            }),
        };
        // A claim of named rows (the CDC publisher's) is no scan: it starts at 0.
        let from = match only {
            Some(_) => 0,
            None => self
                .proto
                .scan_from(from_position, self.dispatchers[di].scan_high_water),
        };
        let served = Served::Only(&clusters);
        // R25: the aliases read in the claim's own transaction (a switch conflicts with the
        // lock the claim takes on them), or with the mutant the copy read earlier. The scan
        // filters by them and the claim step checks every picked row against the same.
        let me = implementation(self.dispatchers[di].implementation);
        let aliases = self
            .proto
            .claim_aliases(&self.db.aliases, &self.dispatchers[di].aliases_read)
            .clone();
        self.dispatchers[di].aliases_read = Rc::clone(&self.db.aliases);
        let check = AliasCheck {
            implementation: me,
            aliases: &aliases,
        };
        let rows = &self.db.rows;
        let named = |i: usize| only.is_none_or(|o| o.contains(&(rows[i].event_id, rows[i].member)));
        let mut skipped = 0;
        // The claim index, in commit-position order from `from`.
        let positions = &self.db.row_position;
        let start = self
            .db
            .by_position
            .partition_point(|&r| positions[r as usize] < from);
        let idx: Vec<usize> = self.db.by_position[start..]
            .iter()
            .map(|&r| r as usize)
            .filter(|&i| named(i) && step::picks(&self.db.rows[i], served, now))
            .filter(|&i| {
                let mine =
                    rollout::may_claim(check, &self.db.rows[i].destination, self.claim_facts(i))
                        .is_ok();
                skipped += u64::from(!mine);
                mine
            })
            .take(max)
            .collect();
        self.stats.rollout.skipped += skipped;
        let picked: Vec<Pick> = idx
            .iter()
            .enumerate()
            .map(|(k, &i)| Pick {
                position: self.db.row_position[i],
                earlier_unresolved: self.earlier_unresolved(i),
                attempt_id: self.db.next_attempt_id + k as u64,
                facts: self.claim_facts(i),
            })
            .collect();
        // Like a sequence, an id drawn for a row that was not sent is not given out again.
        self.db.next_attempt_id += idx.len() as u64;
        let input = ClaimInput {
            owner,
            served,
            now_ms: now,
            lease_ms: LEASE_MS,
            batch_max: max,
            alias: check,
        };
        let (policy, mode) = (self.db.policy, self.cfg.ordering_mode);
        let (facts, row_fact) = (&self.facts, &self.db.row_fact);
        let rng = &mut self.rng;
        // The picked rows, in the claim's (position) order.
        let mut rows: Vec<&mut EventRow> = {
            let mut by_index: Vec<(usize, usize)> =
                idx.iter().enumerate().map(|(k, &i)| (i, k)).collect();
            by_index.sort_unstable();
            let mut slots: Vec<Option<&mut EventRow>> = (0..idx.len()).map(|_| None).collect();
            let mut want = by_index.into_iter().peekable();
            for (i, r) in self.db.rows.iter_mut().enumerate() {
                if let Some(&(_, k)) = want.peek().filter(|(wi, _)| *wi == i) {
                    slots[k] = Some(r);
                    want.next();
                }
            }
            slots.into_iter().flatten().collect()
        };
        let members: Vec<u16> = rows.iter().map(|r| r.member).collect();
        let before: Vec<EventRow> = rows.iter().map(|r| (**r).clone()).collect();
        let step = self.proto.step_claim(
            &mut rows,
            &picked,
            &input,
            |k| {
                let agg = facts[row_fact[idx[k]] as usize].aggregate;
                member_destination(policy, mode, agg, members[k]).digest()
            },
            || {
                let mut random = [0u8; 10];
                rng.fill_bytes(&mut random);
                EventId::mint(1_800_000_000_000 + now, random)
            },
        );
        drop(rows);
        let step = match step {
            Ok(step) => step,
            Err(e) => {
                self.violation(Violation::Liveness, || format!("claim step: {e}"));
                self.dispatchers[di].clusters = clusters;
                return claimed;
            }
        };
        // The store registers every authorised attempt in the claim's transaction: a first
        // send in the claim's lease, any other in its row.
        let mut leased = Vec::new();
        for (k, outcome) in step.outcomes.iter().enumerate() {
            if let PickOutcome::Send(sent) = outcome {
                let i = idx[k];
                self.db.registered.push((i as u32, sent.attempt_id));
                let protocol = self.claim_facts(i).protocol;
                if let Some(send) = lease::lease_entry_of(&before[k], &self.db.rows[i], protocol) {
                    leased.push((i as u32, before[k].clone(), send));
                }
            }
        }
        if let Some(until_ms) = leased.first().map(|l| l.2.lease_until_ms) {
            self.stats.leases_taken += 1;
            self.stats.leased_sends += leased.len() as u64;
            self.db.leases.push(SimLease {
                dispatcher: d,
                until_ms,
                rows: leased,
            });
        }
        // Expired leases that stand for no row any more (this claim's expiries among them).
        self.drop_leases(|l| (l.until_ms <= now).then_some(false));
        let mut meta = Vec::new();
        for (k, outcome) in step.outcomes.iter().enumerate() {
            let i = idx[k];
            match *outcome {
                PickOutcome::Waits => self.stats.ordering_waits += 1,
                PickOutcome::ExpiredToUnknown => {
                    // F3: a claim whose send may still be in flight is superseded; the row
                    // is unknown and races the reconciler's retry.
                    self.fault(Fault::ClaimSuperseded);
                    self.note(|| format!("d{d} expires SENDING row {i} -> DISPATCH_UNKNOWN"));
                }
                PickOutcome::Send(sent) => {
                    if sent.was_pending {
                        if let Some(&(n, not_before)) = self.never_sent_ghost.get(i) {
                            if now < not_before {
                                let early = not_before - now;
                                self.violation_of(Violation::Liveness, 5_000_000 + i as u32, || {
                                    format!("row {i} claimed again {early} ms before the backoff of its {n} never-sent outcome(s) ended")
                                });
                            }
                        }
                    }
                    if sent.superseding {
                        self.fault(Fault::ClaimSuperseded);
                    }
                    self.check_alias(d, i, &sent);
                    if let Some((req, stream)) = self.sent(d, i, &sent) {
                        meta.push((i as u32, stream, sent.token, sent.lease_until_ms));
                        claimed.sends.push(ClaimedSend {
                            request: req,
                            token: sent.token,
                            db_lease_until_ms: sent.lease_until_ms,
                        });
                    }
                }
            }
        }
        claimed.last_position = step.last_position;
        if !self.late_behind.is_empty() {
            for &(r, ..) in &meta {
                if let Some(k) = self.late_behind.iter().position(|&x| x == r) {
                    self.late_behind.swap_remove(k);
                    let late = &mut self.stats.late;
                    match (only.is_some(), full_scan) {
                        (true, _) => late.found_by_log += 1,
                        (false, true) => late.found_by_full_scan += 1,
                        (false, false) => late.found_by_scan_from_behind += 1,
                    }
                }
            }
        }
        claimed.ordered_from = step.ordered_from;
        for &(r, ..) in &meta {
            let row = self.db.rows[r as usize].clone();
            let held = &mut self.dispatchers[di].held;
            held.retain(|(h, _)| *h != r);
            held.push((r, row));
        }
        self.dispatchers[di].claim_meta = meta;
        self.dispatchers[di].clusters = clusters;
        if let Some(p) = claimed.last_position.filter(|_| only.is_none()) {
            let hw = &mut self.dispatchers[di].scan_high_water;
            *hw = (*hw).max(p + 1);
        }
        claimed
    }

    /// What the claim reads beside row `i` to apply the alias (R25): its fact's event type,
    /// its aggregate's share bucket and the protocol it was written under (this build's).
    fn claim_facts(&self, i: usize) -> ClaimFacts<'static> {
        let f = &self.facts[self.db.row_fact[i] as usize];
        ClaimFacts {
            event_type: EVENT_TYPES[usize::from(f.event_type)],
            share_bucket: f.bucket,
            protocol: rollout::PROTOCOL_VERSION,
        }
    }

    /// Checker `send_without_alias` (R25), apart from the claim step: the aliases current
    /// when the claim commits (the simulated database's, now) name the claiming
    /// implementation as the claimant of row `i`.
    fn check_alias(&mut self, d: u8, i: usize, sent: &Authorised) {
        let k = self.dispatchers[d as usize].implementation;
        if self.rollout {
            self.stats.rollout.sends[usize::from(k)] += 1;
            let row = &self.db.rows[i];
            self.db
                .attempt_impl
                .push((row.event_id, row.member, sent.attempt_id, k));
        }
        let now_aliases = AliasCheck {
            implementation: implementation(k),
            aliases: &self.db.aliases,
        };
        if let Err(why) = rollout::may_claim(
            now_aliases,
            &self.db.rows[i].destination,
            self.claim_facts(i),
        ) {
            let attempt = sent.attempt_id;
            self.violation_of(
                Violation::SendWithoutAlias,
                6_000_000 + attempt as u32,
                || {
                    format!(
                        "d{d} ({}) authorised attempt {attempt} of row {i}, which the current alias refuses it: {why:?}",
                        IMPLEMENTATIONS[usize::from(k)]
                    )
                },
            );
        }
    }

    /// R25: an operator's rollout command (`sealpost rollout ...`) on one alias record, in
    /// its own transaction, through the core's `Alias` methods. The record is the current
    /// route policy's stream most often, else a row's, else any; a stream without a record
    /// gets one (incumbent "a") from the first command that moves it. The command: shadow
    /// or takeover (a non-empty subset of the event types, share 1..=100) of the
    /// implementation that does not claim the route now (one time in ten, to be refused,
    /// of the one that does), promote or rollback, drawn with weights by stage. After a
    /// promotion the other implementation is the old incumbent, so a shadow of it starts
    /// the way back (the roles swap).
    fn rollout_switch(&mut self) {
        self.db_version += 1;
        let nstreams = self.streams.len() as u64;
        let s = match range(&mut self.rrng, 0, 9) {
            0..=5 => {
                let p = policy_for(self.db.policy, self.cfg.ordering_mode);
                Some(self.stream_index(&p.cluster, &p.topic))
            }
            6..=8 if !self.db.rows.is_empty() => {
                let r = range(&mut self.rrng, 0, self.db.rows.len() as u64 - 1) as usize;
                self.stream_of(&self.db.rows[r].destination)
            }
            _ => None,
        };
        let s = usize::from(s.unwrap_or(range(&mut self.rrng, 0, nstreams - 1) as u8));
        let (cluster, topic) = (self.streams[s].cluster, self.streams[s].topic);
        let dest = stream_destination(cluster, topic);
        let k = self.db.aliases.iter().position(|a| a.covers(&dest));
        let cur = match k {
            Some(k) => self.db.aliases[k].clone(),
            None => Alias::new(
                &route_name(cluster, topic),
                &dest.cluster,
                &dest.topic,
                IMPLEMENTATIONS[0],
            ),
        };
        let claims = match (cur.stage, &cur.candidate) {
            (Stage::Promoted, Some(c)) => implementation_index(c),
            _ => implementation_index(&cur.incumbent),
        };
        let target = if chance(&mut self.rrng, 100) {
            claims
        } else {
            1 - claims
        };
        let target = IMPLEMENTATIONS[usize::from(target)];
        // Every command in every stage, weighted so that rollouts move along their stages
        // (shadow, takeover, promote) and back (rollback, or a shadow of the other
        // implementation after a promotion); the rest is refused or changes nothing.
        let weights: [u64; 4] = match cur.stage {
            Stage::Incumbent => [7, 1, 1, 1],
            Stage::Shadow => [1, 6, 1, 2],
            Stage::Takeover => [1, 3, 4, 2],
            Stage::Promoted => [4, 1, 1, 4],
        };
        let mut x = range(&mut self.rrng, 0, weights.iter().sum::<u64>() - 1);
        let mut command = 0;
        while x >= weights[command] {
            x -= weights[command];
            command += 1;
        }
        let result = match command {
            0 => cur.shadow(target),
            1 => {
                let types: Vec<String> = match range(&mut self.rrng, 0, 2) {
                    0 => vec![EVENT_TYPES[0].to_string()],
                    1 => vec![EVENT_TYPES[1].to_string()],
                    _ => EVENT_TYPES.iter().map(|t| t.to_string()).collect(),
                };
                let share = range(&mut self.rrng, 1, 100) as u32;
                cur.takeover(target, &types, share)
            }
            2 => cur.promote(),
            _ => Ok(cur.rollback()),
        };
        let route = cur.route.clone();
        match result {
            Ok(Switch::To(next)) => {
                self.fault(Fault::RolloutSwitch);
                self.stats.rollout.switches += 1;
                let st = match next.stage {
                    Stage::Shadow => 0,
                    Stage::Takeover => 1,
                    Stage::Promoted => 2,
                    Stage::Incumbent => 3,
                };
                self.stats.rollout.to_stage[st] += 1;
                self.note(|| {
                    format!(
                        "rollout {route}: {} (incumbent {}, candidate {:?}, types {:?}, share {}, generation {})",
                        next.stage, next.incumbent, next.candidate, next.types, next.share, next.generation
                    )
                });
                let mut v = self.db.aliases.to_vec();
                match k {
                    Some(k) => v[k] = next,
                    None => v.push(next),
                }
                self.db.aliases = v.into();
            }
            Ok(Switch::Unchanged) => self.stats.rollout.unchanged += 1,
            Err(e) => {
                self.stats.rollout.refused += 1;
                self.note(|| format!("rollout {route}: command {command} refused: {e}"));
            }
        }
    }

    /// Is some route at stage shadow or takeover (a candidate's shadow reader has work)?
    fn shadowing(&self) -> bool {
        self.db
            .aliases
            .iter()
            .any(|a| a.candidate.is_some() && matches!(a.stage, Stage::Shadow | Stage::Takeover))
    }

    /// Queues the next shadow read while some route is shadowed.
    fn schedule_shadow(&mut self) {
        if !self.shadow_scheduled && self.shadowing() {
            self.shadow_scheduled = true;
            self.at(self.now + self.shadow_every_ms, Ev::ShadowRead);
        }
    }

    /// R25: the shadow reader (`sealpost::runtime::shadow_round`). For every route at stage
    /// shadow or takeover whose candidate C has a live process connected to the route's
    /// cluster: up to [`SHADOW_PAGE`] published rows of the route's stream whose primary
    /// receipt's attempt the other implementation sent, each once, are read back from the
    /// broker model (every copy at the event's subject, oldest first; the one with the
    /// primary's attempt id, else the first), and the core's `shadow_compare` (through the
    /// protocol) compares the row and its envelope description with that copy: the copy's
    /// receipt fields, its envelope headers, and "an earlier version of the aggregate bound
    /// for the same destination was stored after this one or is not stored" as the store's
    /// SQL reads it (the rows' primary sequences). A broker that cannot be asked compares
    /// nothing; one that is down ends the route's read. Read-only: it writes no row.
    ///
    /// Checkers: `shadow_false_divergence` (a divergence for the copy the protocol sent for
    /// the row, or an ordering divergence while the first stored copies were in order) and
    /// `shadow_missed_divergence` (no divergence for a copy that differs from the sealed
    /// envelope).
    fn shadow_read(&mut self) {
        self.shadow_scheduled = false;
        let aliases = Rc::clone(&self.db.aliases);
        for a in aliases.iter() {
            let Some(candidate) = a
                .candidate
                .as_deref()
                .filter(|_| matches!(a.stage, Stage::Shadow | Stage::Takeover))
            else {
                continue;
            };
            let c = implementation_index(candidate);
            let now = self.now;
            let up = self.dispatchers.iter().any(|d| {
                d.alive
                    && d.paused_until <= now
                    && d.implementation == c
                    && d.clusters.contains(&a.cluster)
            });
            if !up {
                continue;
            }
            self.stats.rollout.shadow_reads += 1;
            let mut page = 0;
            for i in 0..self.db.rows.len() {
                if page >= SHADOW_PAGE {
                    break;
                }
                let row = &self.db.rows[i];
                let Some(p) = row.primary.as_ref() else {
                    continue;
                };
                if !row.state.is_published() || !a.covers(&row.destination) {
                    continue;
                }
                let done = (i as u32, p.attempt_id, self.epoch);
                if self.shadow_done.contains(&done) {
                    continue;
                }
                let sender = self
                    .db
                    .attempt_impl
                    .iter()
                    .find(|x| x.0 == row.event_id && x.1 == row.member && x.2 == p.attempt_id)
                    .map(|x| x.3);
                if sender != Some(1 - c) {
                    continue;
                }
                if !self.cfg.caps.lookup_by_event_id {
                    break; // Unqueryable: nothing to compare on this route
                }
                let Some(s) = self.stream_of(&row.destination) else {
                    break;
                };
                let st = &self.streams[s as usize];
                if self.broker_down_until[st.cluster as usize] > now
                    || self.stream_deleted_until[s as usize] > now
                {
                    break; // Unavailable: read again next time
                }
                page += 1;
                self.shadow_done.push(done);
                let copies: Vec<usize> = st
                    .msgs
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.event_id == row.event_id && m.member == row.member)
                    .take(COPIES_MAX)
                    .map(|(k, _)| k)
                    .collect();
                let Some(&k) = copies
                    .iter()
                    .find(|&&k| st.msgs[k].attempt_id == p.attempt_id)
                    .or(copies.first())
                else {
                    continue; // Absent: nothing to compare
                };
                let m = st.msgs[k].clone();
                let copy = m.found_copy(&a.cluster, &a.topic, k as u64 + 1);
                let fact = &self.facts[self.db.row_fact[i] as usize];
                let (agg, version, event_type) = (fact.aggregate, fact.version, fact.event_type);
                // As the store's SQL reads it: an earlier version of the aggregate bound
                // for the same destination whose primary is later, or absent.
                let earlier: Vec<usize> = (0..self.db.rows.len())
                    .filter(|&j| {
                        let x = &self.facts[self.db.row_fact[j] as usize];
                        let d = &self.db.rows[j].destination;
                        x.aggregate == agg
                            && x.version < version
                            && d.cluster == row.destination.cluster
                            && d.topic == row.destination.topic
                    })
                    .collect();
                let earlier_stored_later = earlier.iter().any(|&j| {
                    self.db.rows[j]
                        .primary
                        .as_ref()
                        .is_none_or(|q| q.sequence > p.sequence)
                });
                let envelope = wire_envelope(event_type);
                let headers = copy.seal.claim.as_ref().map(|x| &x.envelope);
                let ds = self.proto.shadow_compare(
                    row,
                    &envelope,
                    rollout::Observed {
                        receipt: &copy.receipt,
                        headers: match headers {
                            Some(h) => rollout::SeenHeaders::Read(h),
                            None => rollout::SeenHeaders::Missing,
                        },
                        earlier_stored_later,
                    },
                    p,
                );
                // Ghost: is the copy the sealed envelope of this row (what a dispatcher of
                // either implementation sends for it)?
                let genuine = m.event_id == row.event_id
                    && m.member == row.member
                    && m.envelope_generation == row.envelope_generation
                    && m.payload_digest == row.payload_digest
                    && m.destination_digest == row.destination.digest()
                    && m.event_type == event_type;
                let content = ds
                    .iter()
                    .filter(|d| d.kind != rollout::DivergenceKind::Ordering)
                    .count();
                let ordering = ds.len() > content;
                // Ghost: every earlier version bound for this stream had its first copy
                // stored before this event's first copy (the ordering checker's record), and
                // in this stream too: a restore that undid a migration sends an earlier
                // version to its old stream again, after a later version's copy there.
                let first_here = |e: EventId| st.msgs.iter().position(|x| x.event_id == e);
                let in_order = !self.restore_broken.contains(&agg)
                    && self
                        .ordered_stored
                        .iter()
                        .position(|e| e.2 == row.event_id)
                        .is_some_and(|at| {
                            earlier.iter().all(|&j| {
                                let e = self.db.rows[j].event_id;
                                self.ordered_stored[..at].iter().any(|x| x.2 == e)
                            })
                        })
                    && first_here(row.event_id).is_some_and(|at| {
                        earlier
                            .iter()
                            .all(|&j| first_here(self.db.rows[j].event_id).is_some_and(|x| x < at))
                    });
                let (event_id, seq) = (row.event_id, k + 1);
                let r = &mut self.stats.rollout;
                r.shadow_compared += 1;
                r.shadow_divergences += ds.len() as u64;
                r.shadow_foreign += u64::from(!genuine);
                self.note(|| {
                    format!(
                        "shadow ({candidate}) compares row {i} ({event_id}) with the copy at stream {s}#{seq}: {} divergence(s) {:?}",
                        ds.len(),
                        ds.iter().map(|d| d.kind.name()).collect::<Vec<_>>()
                    )
                });
                if genuine && (content > 0 || (ordering && in_order)) {
                    self.violation_of(Violation::ShadowFalseDivergence, 10_000_000 + i as u32, || {
                        format!("shadow reported {ds:?} for row {i}'s own sealed copy at stream {s}#{seq}")
                    });
                }
                if !genuine && content == 0 {
                    self.violation_of(Violation::ShadowMissedDivergence, 11_000_000 + i as u32, || {
                        format!("shadow reported no divergence for row {i}'s copy at stream {s}#{seq}, which is not its sealed envelope")
                    });
                }
            }
        }
        self.schedule_shadow();
    }

    /// The fact the store reads for an ordered claim: an earlier version of row `i`'s
    /// aggregate, bound for an ordered destination, is not published.
    fn earlier_unresolved(&self, i: usize) -> bool {
        let Some(&f) = self.db.row_fact.get(i) else {
            return false;
        };
        let (agg, version) = (
            self.facts[f as usize].aggregate,
            self.facts[f as usize].version,
        );
        self.db.rows.iter().zip(&self.db.row_fact).any(|(r, &g)| {
            let x = &self.facts[g as usize];
            x.aggregate == agg
                && x.version < version
                && r.destination.ordering == EventOrdering::PerAggregate
                && !r.state.is_published()
        })
    }

    /// True when row `i` is an ordered event behind a row parked as a conflict (it waits
    /// with it for the operator's exit).
    fn behind_conflict(&self, i: usize) -> bool {
        let Some(&f) = self.db.row_fact.get(i) else {
            return false;
        };
        let (agg, version) = (
            self.facts[f as usize].aggregate,
            self.facts[f as usize].version,
        );
        self.conflicts.iter().any(|&c| {
            let x = &self.facts[self.db.row_fact[c as usize] as usize];
            x.aggregate == agg && x.version < version
        })
    }

    /// The checks and the message of a send the claim step authorised (its attempt is
    /// registered, the row `SENDING`).
    fn sent(&mut self, d: u8, r: usize, sent: &Authorised) -> Option<(SendRequest, u8)> {
        let fact = self.db.row_fact[r];
        let agg = self.facts[fact as usize].aggregate;
        let mode = self.cfg.ordering_mode;
        let (policy, member) = (self.db.policy, self.db.rows[r].member);
        let (begin, token, attempt_id) = (sent.begin, sent.token, sent.attempt_id);
        // Checker: a row that cannot leave is retried with a backoff, not in a hot loop that
        // starves the rows behind it.
        if self.db.rows[r].attempts.len() > ATTEMPTS_PER_ROW_MAX {
            self.violation_of(Violation::Liveness, r as u32, || {
                format!("row {r} registered more than {ATTEMPTS_PER_ROW_MAX} attempts")
            });
        }
        // Checker: a send goes only to the row's frozen destination, and never elsewhere
        // while another attempt's outcome is open (R14-R15).
        let row_ref = &self.db.rows[r];
        let elsewhere = begin.destination_digest != row_ref.destination_digest
            || row_ref.attempts.iter().any(|a| {
                a.id != attempt_id
                    && matches!(a.status, AttemptStatus::Sending | AttemptStatus::Unknown)
                    && a.destination_digest != begin.destination_digest
            });
        if elsewhere {
            self.violation_of(
                Violation::CrossDestinationRetries,
                2_000_000 + attempt_id as u32,
                || format!("row {r} attempt {attempt_id} sent off its frozen destination"),
            );
        }
        // The message goes where the digest it carries says.
        let destination = if begin.destination_digest == self.db.rows[r].destination_digest {
            self.db.rows[r].destination.clone()
        } else {
            member_destination(policy, mode, agg, member)
        };
        let Some(stream) = self.stream_of(&destination) else {
            self.violation(Violation::Liveness, || "destination has no stream".into());
            return None;
        };
        self.note(|| {
            format!(
                "d{d} claims row {r} gen {}, registers attempt {attempt_id} (attempt gen {})",
                token.generation, begin.attempt_generation
            )
        });
        let row_ref = &self.db.rows[r];
        let mut req = SendRequest {
            event_id: begin.event_id,
            member: row_ref.member,
            envelope_generation: begin.envelope_generation,
            attempt_id,
            payload_digest: row_ref.payload_digest,
            destination,
            destination_digest: begin.destination_digest,
            payload: Vec::new(),
            envelope: wire_envelope(self.facts[fact as usize].event_type),
            signature: None,
        };
        // The dispatcher signs what it sends (the core's claim of the request).
        let claim = SignedClaim::of_request(&req);
        req.signature = Some(sim_sign(&claim));
        self.signed.push(claim.digest());
        Some((req, stream))
    }

    /// Hands a batch to the adapter model. It leaves after a stall: in-flight permits, a
    /// 10,000-row batch being encoded, a GC pause — or a paused process.
    fn start_send(&mut self, d: u8, batch: Vec<SendRequest>, deadline_ms: u64) {
        let di = d as usize;
        let meta = std::mem::take(&mut self.dispatchers[di].claim_meta);
        debug_assert_eq!(meta.len(), batch.len());
        let id = self.dispatchers[di].next_batch;
        self.dispatchers[di].next_batch += 1;
        let inc = self.dispatchers[di].inc;
        let create_if_absent = self.proto.create_if_absent(self.cfg.caps.create_if_absent);
        let reqs: Vec<PubReq> = batch
            .into_iter()
            .zip(meta)
            .enumerate()
            .map(
                |(slot, (s, (row, stream, _token, lease_until_ms)))| PubReq {
                    d,
                    inc,
                    batch: id,
                    slot: slot as u16,
                    row,
                    // The lease the claim was granted (a pipelined batch may wait for the wire
                    // while a late ACK settles its row; its lease still bounds the send).
                    lease_until_ms,
                    event_id: s.event_id,
                    member: s.member,
                    envelope_generation: s.envelope_generation,
                    attempt_id: s.attempt_id,
                    payload_digest: s.payload_digest,
                    destination_digest: s.destination_digest,
                    stream,
                    create_if_absent,
                    ordered: s.destination.ordering == EventOrdering::PerAggregate,
                    event_type: EVENT_TYPES
                        .iter()
                        .position(|t| *t == s.envelope.event_type)
                        .unwrap_or(0) as u8,
                    signature: s.signature.map(Rc::from),
                },
            )
            .collect();
        let n = reqs.len();
        self.dispatchers[di].batch = Some(Batch {
            id,
            reqs,
            results: vec![None; n],
            deadline_ms,
            unwound: false,
        });
        let stall = if self.faults_on && chance(&mut self.rng, self.cfg.p_stall) {
            self.fault(Fault::StallBeforeSend);
            range(&mut self.rng, 1_000, 3 * LEASE_MS)
        } else {
            range(&mut self.rng, 0, 20)
        };
        self.at(self.now + stall, Ev::Leave { d, inc, batch: id });
    }

    /// The batch leaves the process: the adapter's deadline check, then the network.
    fn leave(&mut self, d: u8, inc: u32, batch: u32) {
        if !self.live(d, inc) {
            return;
        }
        if self.deferred(d, &Ev::Leave { d, inc, batch }) {
            return;
        }
        let di = d as usize;
        let Some(b) = self.dispatchers[di].batch.clone() else {
            return;
        };
        if b.id != batch {
            return;
        }
        for req in &b.reqs {
            let slot = req.slot as usize;
            let result = if !self
                .proto
                .may_leave(self.now, b.deadline_ms, &self.cfg.caps)
            {
                self.fault(Fault::DeadlineRefused);
                Some(SendResult::NeverSent(NeverSentReason::DeadlinePassed))
            } else {
                if self.now >= req.lease_until_ms {
                    // Checker (R9): nothing leaves once the claim it was made under is over.
                    let (a, r) = (req.attempt_id, req.row);
                    self.violation_of(Violation::SendsPastLease, 4_000_000 + a as u32, || {
                        format!("row {r} attempt {a} left after its lease ended")
                    });
                }
                let s = req.stream as usize;
                let cluster = self.streams[s].cluster as usize;
                let fact = self.db.row_fact.get(req.row as usize).copied();
                let unencodable =
                    self.faults_on && fact.is_some_and(|f| self.facts[f as usize].unencodable);
                // The adapter encodes each message through the core's containment, as the
                // production adapters do.
                let encoded = sealpost_core::port::contain(|| {
                    if unencodable {
                        Err("NATS cannot carry header `Sealpost-Aggregate-Id`".to_string())
                    } else {
                        Ok(())
                    }
                });
                if unencodable {
                    self.fault(Fault::Unencodable);
                    let r = req.row as usize;
                    if self.refusals.len() <= r {
                        self.refusals.resize(r + 1, (0, false));
                    }
                    self.refusals[r].0 += 1;
                }
                if let Err(refused) = encoded {
                    if self.proto.refusal_fails_batch() {
                        if let Some(bb) = self.dispatchers[di].batch.as_mut() {
                            bb.unwound = true;
                        }
                        break; // the panic unwinds the rest of the batch
                    }
                    Some(SendResult::from(refused))
                } else if self.broker_down_until[cluster] > self.now {
                    Some(SendResult::NeverSent(NeverSentReason::NotConnected(
                        "connection refused".into(),
                    )))
                } else if self.stream_deleted_until[s] > self.now {
                    Some(SendResult::NeverSent(NeverSentReason::NoSuchDestination(
                        "stream not found".into(),
                    )))
                } else if self.faults_on && chance(&mut self.rng, self.cfg.p_req_loss) {
                    self.fault(Fault::PartitionMidSend);
                    None
                } else {
                    if self.faults_on && chance(&mut self.adv, self.cfg.p_forge_copy_first) {
                        self.forge_copy_first(req);
                    }
                    let t = self.now + range(&mut self.rng, 1, 40);
                    self.at(
                        t,
                        Ev::BrokerReceive {
                            req: Box::new(req.clone()),
                        },
                    );
                    None
                }
            };
            if let Some(result) = result {
                if let Some(bb) = self.dispatchers[di].batch.as_mut() {
                    bb.results[slot] = Some(result);
                }
            }
        }
        self.note(|| format!("d{d} batch {batch} leaves ({} request(s))", b.reqs.len()));
        self.at(
            self.now + ACK_TIMEOUT_MS,
            Ev::BatchTimeout { d, inc, batch },
        );
        self.settle_if_complete(d);
    }

    fn settle_if_complete(&mut self, d: u8) {
        let di = d as usize;
        let complete = self.dispatchers[di]
            .batch
            .as_ref()
            .is_some_and(|b| b.results.iter().all(Option::is_some));
        if complete {
            self.settle(d);
        }
    }

    /// Every message of the open batch has an outcome: the machine turns them into one
    /// submission (receipts and reports in one transaction).
    fn settle(&mut self, d: u8) {
        let di = d as usize;
        let Some(b) = self.dispatchers[di].batch.take() else {
            return;
        };
        let unwound = b.unwound;
        let results: Vec<SendResult> = b
            .results
            .into_iter()
            .map(|r| match r {
                Some(r) if !unwound => r,
                _ => SendResult::NoAnswer,
            })
            .collect();
        let now = self.now;
        if let Some(action) = self.dispatchers[di].machine.handle_sent(now, results) {
            self.dispatch_action(d, action);
        }
        self.drive_dispatcher(d);
    }

    fn batch_timeout(&mut self, d: u8, inc: u32, batch: u32) {
        if !self.live(d, inc) {
            return;
        }
        if self.deferred(d, &Ev::BatchTimeout { d, inc, batch }) {
            return;
        }
        if self.dispatchers[d as usize]
            .batch
            .as_ref()
            .is_some_and(|b| b.id == batch)
        {
            self.settle(d);
        }
    }

    /// The broker's answer reaches the dispatcher (or is late for its batch).
    fn ack_arrive(&mut self, d: u8, inc: u32, batch: u32, slot: u16, result: SendResult) {
        if !self.live(d, inc) {
            return;
        }
        let ev = Ev::AckArrive {
            d,
            inc,
            batch,
            slot,
            result: Box::new(result),
        };
        if self.deferred(d, &ev) {
            return;
        }
        let Ev::AckArrive { result, .. } = ev else {
            unreachable!()
        };
        let di = d as usize;
        match self.dispatchers[di].batch.as_mut() {
            Some(b) if b.id == batch && b.results[slot as usize].is_none() => {
                b.results[slot as usize] = Some(*result);
                self.settle_if_complete(d);
            }
            _ => {
                // Late: the batch was settled (its outcome reported unknown). A receipt still
                // goes to the acceptance point (R11); anything else is no news.
                if let SendResult::Receipt(r) = *result {
                    self.dispatchers[di].machine.handle_late_receipt(r);
                    self.drive_dispatcher(d);
                }
            }
        }
    }

    /// The store's submission transaction: every receipt through the acceptance point and
    /// every outcome report, all or nothing.
    /// Whether this transaction cannot reach the database (a fault while faults are on).
    fn database_unreachable(&mut self) -> bool {
        if self.faults_on && chance(&mut self.rng, self.cfg.p_db_unreachable) {
            self.fault(Fault::DatabaseUnreachable);
            return true;
        }
        false
    }

    fn store_submit(&mut self, d: u8, sub: &Submission) -> bool {
        self.db_version += 1;
        if self.faults_on && chance(&mut self.rng, self.cfg.p_receipt_rollback) {
            // F7: the transaction rolls back; the machine retries it.
            self.fault(Fault::ReceiptRollback);
            return false;
        }
        let held = std::mem::take(&mut self.dispatchers[d as usize].held);
        for receipt in &sub.receipts {
            match self.row_of(receipt.event_id, receipt.member) {
                Some(r) => {
                    let genuine = self.genuine(receipt);
                    // The guarded fast path (`store::submit_held`): the core's guarded step on
                    // the row as this dispatcher's claim left it, written only if the row is
                    // still exactly that (the store's `xmin` guard).
                    let for_row = sub
                        .receipts
                        .iter()
                        .filter(|x| (x.event_id, x.member) == (receipt.event_id, receipt.member))
                        .count();
                    let snapshot = held
                        .iter()
                        .find(|(h, _)| *h == r)
                        .map(|(_, row)| row)
                        .filter(|row| self.proto.guard_holds(row, &self.db.rows[r as usize]));
                    let guarded = snapshot.and_then(|row| {
                        step::step_guarded(row, receipt, for_row, self.now, |row, x| {
                            self.proto.decide_receipt(row, x, self.now).verdict
                        })
                        .unwrap_or(None)
                    });
                    self.accept(r, receipt, genuine, guarded);
                }
                None => self.stats.rejected_receipts += 1,
            }
        }
        for rep in &sub.reports {
            let Some(r) = self.row_of(rep.event_id, rep.member) else {
                continue;
            };
            self.report_outcome(d, r, rep);
        }
        // Answered rows are no longer held; the rest stay for a later submission.
        let mut held = held;
        held.retain(|(r, _)| {
            let row = &self.db.rows[*r as usize];
            let answered = |e: EventId, m: u16| (e, m) == (row.event_id, row.member);
            !sub.receipts.iter().any(|x| answered(x.event_id, x.member))
                && !sub.reports.iter().any(|x| answered(x.event_id, x.member))
        });
        // A lease all of whose rows this dispatcher answered is dropped, if the rule allows.
        self.drop_leases(|l| {
            (l.dispatcher == d
                && l.rows
                    .iter()
                    .all(|(r, ..)| !held.iter().any(|(h, _)| h == r)))
            .then_some(true)
        });
        self.dispatchers[d as usize].held = held;
        true
    }

    /// How many of a lease's rows it still stands for: rows not written since it was taken.
    fn lease_open(&self, l: &SimLease) -> usize {
        l.rows
            .iter()
            .filter(|(r, stored, send)| self.leased(*r, stored, send))
            .count()
    }

    /// Whether row `r` still reads through its lease entry (not written since).
    fn leased(&self, r: u32, stored: &EventRow, send: &LeasedSend) -> bool {
        lease::leased_view(stored, send).as_ref() == Some(&self.db.rows[r as usize])
    }

    /// Drops the leases `which` names (`Some(answered)`: its dispatcher answered every row
    /// of it) where the protocol allows it. A row a dropped lease still stood for reads as
    /// stored again: `PENDING`, never claimed, its attempt gone.
    fn drop_leases(&mut self, which: impl Fn(&SimLease) -> Option<bool>) {
        let leases = std::mem::take(&mut self.db.leases);
        let mut keep = Vec::with_capacity(leases.len());
        for l in leases {
            let Some(answered) = which(&l) else {
                keep.push(l);
                continue;
            };
            if !self.proto.may_drop_lease(self.lease_open(&l), answered) {
                keep.push(l);
                continue;
            }
            self.stats.leases_dropped += 1;
            for (r, stored, send) in &l.rows {
                if self.leased(*r, stored, send) {
                    self.note(|| format!("row {r} reads as never sent: its lease was dropped"));
                    self.db.rows[*r as usize] = stored.clone();
                }
            }
        }
        self.db.leases = keep;
    }

    fn row_of(&self, event_id: EventId, member: u16) -> Option<u32> {
        self.db
            .rows
            .iter()
            .position(|r| r.event_id == event_id && r.member == member)
            .map(|i| i as u32)
    }

    /// Ghost knowledge: does the broker hold this very message at the receipt's position?
    fn genuine(&self, r: &Receipt) -> bool {
        let s = self.stream_index(&r.cluster, &r.stream) as usize;
        self.streams
            .get(s)
            .and_then(|st| st.msgs.get((r.sequence as usize).wrapping_sub(1)))
            .is_some_and(|m| {
                !m.forged
                    && m.event_id == r.event_id
                    && m.member == r.member
                    && m.payload_digest == r.payload_digest
            })
    }

    fn report_outcome(&mut self, d: u8, row: u32, rep: &OutcomeReport) {
        self.db_version += 1;
        let r = row as usize;
        let now = self.now;
        // The store's report step on this one row.
        let decision = match self.proto.step_report(
            std::slice::from_mut(&mut self.db.rows[r]),
            std::slice::from_ref(rep),
            REJECTION_LIMIT,
            now,
        ) {
            Ok(out) => out[0].decision,
            Err(e) => {
                self.violation(Violation::Liveness, || format!("send outcome: {e}"));
                return;
            }
        };
        if rep.outcome == SendOutcome::NeverSent {
            self.stats.never_sent += 1;
        }
        if decision == sealpost_core::SendOutcomeDecision::ToQuarantine {
            if self.refusals.len() <= r {
                self.refusals.resize(r + 1, (0, false));
            }
            if self.refusals[r].0 == 0 {
                // Poison is what the broker or the adapter refused for the message itself;
                // a row never so refused is deliverable (a revoked grant refuses anything).
                self.violation(Violation::Liveness, || {
                    format!(
                        "row {r} quarantined as poison, but nothing refused the message itself: {}",
                        rep.detail
                    )
                });
            }
            self.refusals[r].1 = true;
        }
        if rep.outcome == SendOutcome::NeverSent
            && decision == sealpost_core::SendOutcomeDecision::ToPending
        {
            if self.never_sent_ghost.len() <= r {
                self.never_sent_ghost.resize(r + 1, (0, 0));
            }
            let g = &mut self.never_sent_ghost[r];
            g.0 += 1;
            g.1 = now + sealpost_core::claim::never_sent_backoff_ms(g.0);
        }
        let (outcome, attempt) = (rep.outcome, rep.attempt_id);
        self.note(|| {
            format!("d{d} reports {outcome:?} for attempt {attempt} on row {r}: {decision:?}")
        });
    }

    fn broker_receive(&mut self, req: PubReq) {
        let s = req.stream as usize;
        let cluster = self.streams[s].cluster as usize;
        if self.broker_down_until[cluster] > self.now {
            self.note(|| format!("broker down: request for attempt {} lost", req.attempt_id));
            return;
        }
        let (d, inc, batch, slot) = (req.d, req.inc, req.batch, req.slot);
        let answer_at = self.now + range(&mut self.rng, 1, 40);
        if self.grant_revoked_until[s] > self.now {
            // The broker refuses the publish for lack of permission: nothing stored.
            self.fault(Fault::GrantRevoked);
            let result = SendResult::Refused {
                kind: self.proto.permission_refusal(),
                detail: "Permissions Violation for Publish".into(),
            };
            self.at(
                answer_at,
                Ev::AckArrive {
                    d,
                    inc,
                    batch,
                    slot,
                    result: Box::new(result),
                },
            );
            return;
        }
        let fact = self.db.row_fact.get(req.row as usize).copied();
        let poison = fact.is_some_and(|f| self.facts[f as usize].poison) && self.faults_on;
        if poison {
            // A definite, permanent refusal (e.g. over the size limit): nothing stored.
            self.fault(Fault::PoisonRejected);
            let r = req.row as usize;
            if self.refusals.len() <= r {
                self.refusals.resize(r + 1, (0, false));
            }
            self.refusals[r].0 += 1;
            if !self.proto.reports_refusals() {
                return; // the mutant's adapter turns the refusal into "no answer"
            }
            let result = SendResult::Refused {
                kind: RefusalKind::Rejected,
                detail: "schema not registered".into(),
            };
            self.at(
                answer_at,
                Ev::AckArrive {
                    d,
                    inc,
                    batch,
                    slot,
                    result: Box::new(result),
                },
            );
            return;
        }
        // Checker: no second logical id; every stored id belongs to a fact.
        if !self.facts.iter().any(|f| f.event_id == req.event_id) {
            self.violation_of(
                Violation::SecondEventIds,
                3_000_000 + req.attempt_id as u32,
                || format!("broker stored unknown event id {}", req.event_id),
            );
        }
        let now = self.now;
        let window = self.cfg.dup_window_ms;
        let stream = &mut self.streams[s];
        stream.dedup.retain(|e| e.3 + window > now);
        let dedup_hit = stream
            .dedup
            .iter()
            .find(|e| e.0 == req.event_id && e.1 == req.member)
            .map(|e| e.2);
        let held = stream
            .msgs
            .iter()
            .any(|m| m.event_id == req.event_id && m.member == req.member);
        let held_genuine = stream
            .msgs
            .iter()
            .any(|m| !m.forged && m.event_id == req.event_id && m.member == req.member);
        // The answer "a copy is already stored" to this request (a lookup away).
        let already_stored = |w: &mut Self| {
            w.at(
                answer_at,
                Ev::AckArrive {
                    d,
                    inc,
                    batch,
                    slot,
                    result: Box::new(SendResult::AlreadyStored),
                },
            )
        };
        let (seq, duplicate) = if let Some(seq) = dedup_hit {
            if !self.duplicate_is_this_message(s, seq, &req) {
                // The copy the broker calls the original is not the message sent (a forger
                // published first under its duplicate id): not a receipt of this send, whose
                // outcome is a lookup away.
                self.stats.duplicate_acks_not_this_message += 1;
                self.note(|| {
                    format!(
                        "duplicate ACK for attempt {} names another message",
                        req.attempt_id
                    )
                });
                already_stored(self);
                return;
            }
            (seq, true)
        } else if req.create_if_absent && held {
            // The broker itself refuses a second copy (NATS: wrong last subject sequence).
            self.fault(Fault::CopyRefused);
            self.note(|| format!("broker refuses attempt {}: a copy exists", req.attempt_id));
            already_stored(self);
            return;
        } else {
            let first = !stream
                .msgs
                .iter()
                .any(|m| !m.forged && m.event_id == req.event_id);
            stream.msgs.push(Msg {
                ordered: req.ordered,
                event_id: req.event_id,
                member: req.member,
                envelope_generation: req.envelope_generation,
                attempt_id: req.attempt_id,
                payload_digest: req.payload_digest,
                destination_digest: req.destination_digest,
                event_type: req.event_type,
                signature: req.signature.clone(),
                forged: false,
            });
            let seq = stream.msgs.len() as u64;
            stream.dedup.push((req.event_id, req.member, seq, now));
            if first {
                self.check_broker_order(&req);
            }
            (seq, false)
        };
        if held && !duplicate {
            self.stats.second_copies += 1;
            if self.cfg.caps.create_if_absent && held_genuine {
                let a = req.attempt_id;
                self.violation_of(Violation::SecondCopies, 5_000_000 + a as u32, || {
                    format!("a create-if-absent broker stored a second copy (attempt {a})")
                });
            }
        }
        self.wake_consumers();
        let mut sequence = seq;
        if duplicate && self.faults_on && chance(&mut self.rng, self.cfg.p_seq0) {
            self.fault(Fault::DuplicateSeqZero);
            sequence = 0;
        }
        let receipt = Receipt {
            event_id: req.event_id,
            member: req.member,
            envelope_generation: req.envelope_generation,
            attempt_id: req.attempt_id,
            payload_digest: req.payload_digest,
            destination_digest: req.destination_digest,
            cluster: CLUSTERS[self.streams[s].cluster as usize].to_string(),
            stream: TOPICS[self.streams[s].topic as usize].to_string(),
            partition: None,
            sequence,
            broker_duplicate: duplicate,
            source: ReceiptSource::Ack,
        };
        self.note(|| {
            format!(
                "broker stores attempt {} at {}#{seq} (duplicate: {duplicate})",
                req.attempt_id, receipt.stream
            )
        });
        if self.faults_on && chance(&mut self.rng, self.cfg.p_ack_loss) {
            self.fault(Fault::AckLost);
            return;
        }
        let mut delay = range(&mut self.rng, 1, 40);
        if self.faults_on && chance(&mut self.rng, self.cfg.p_ack_late) {
            self.fault(Fault::AckLate);
            delay += range(&mut self.rng, ACK_TIMEOUT_MS, 4 * LEASE_MS);
        }
        let ack = |result: SendResult| Ev::AckArrive {
            d,
            inc,
            batch,
            slot,
            result: Box::new(result),
        };
        if self.faults_on && chance(&mut self.rng, self.cfg.p_forge) {
            // An ACK for an attempt the store never registered, naming a position that does
            // not hold this event, arrives first.
            self.fault(Fault::ForgedAck);
            let mut forged = receipt.clone();
            forged.attempt_id = 9_000_000 + u64::from(self.rng.next_u32() % 1000);
            forged.sequence = seq + 1000;
            forged.broker_duplicate = false;
            self.at(self.now + 1, ack(SendResult::Receipt(forged)));
        }
        if self.faults_on && chance(&mut self.rng, self.cfg.p_forge) {
            // The ACK is corrupted on its way back: its payload digest no longer matches.
            self.fault(Fault::CorruptAck);
            let mut bad = receipt;
            bad.payload_digest = Digest([0xee; 32]);
            self.at(self.now + delay, ack(SendResult::Receipt(bad)));
            return;
        }
        if self.faults_on && chance(&mut self.rng, self.cfg.p_ack_dup) {
            self.fault(Fault::AckDuplicated);
            let t = self.now + range(&mut self.rng, 1, 5_000);
            self.at(t, ack(SendResult::Receipt(receipt.clone())));
        }
        let t = self.now + delay;
        self.at(t, ack(SendResult::Receipt(receipt)));
    }
    /// The acceptance point for one receipt: the locked path, or with `guarded` the row the
    /// guarded step computed on the dispatcher's held copy (a `Primary` verdict).
    fn accept(&mut self, row: u32, receipt: &Receipt, genuine: bool, guarded: Option<EventRow>) {
        self.db_version += 1;
        let r = row as usize;
        if r >= self.db.rows.len() || self.db.rows[r].event_id != receipt.event_id {
            // The store has no such row (restored away, or a forged id): audit.
            self.stats.rejected_receipts += 1;
            return;
        }
        let pre = self.before_accept(r, receipt, genuine);
        let now = self.now;
        // The guarded step already ran on the dispatcher's copy; otherwise the store's locked
        // acceptance step on this one row.
        let verdict = match guarded {
            Some(after) => {
                self.stats.guarded_accepts += 1;
                self.db.rows[r] = after;
                ReceiptVerdict::Primary
            }
            None => {
                match self.proto.step_accept(
                    std::slice::from_mut(&mut self.db.rows[r]),
                    std::slice::from_ref(receipt),
                    now,
                ) {
                    Ok(j) => match j.first() {
                        Some(&Acceptance::Judged { verdict, .. }) => verdict,
                        _ => {
                            self.stats.rejected_receipts += 1;
                            return;
                        }
                    },
                    Err(e) => {
                        self.violation(Violation::Liveness, || format!("accept: {e}"));
                        return;
                    }
                }
            }
        };
        self.after_accept(row, receipt, verdict, pre);
    }

    /// What the checkers need of a row before a receipt is judged on it: whether the receipt
    /// is a late ACK (G2: a genuine ACK of a registered attempt whose claim is no longer the
    /// current, unexpired one) and whether the slot was empty.
    fn before_accept(&self, r: usize, receipt: &Receipt, genuine: bool) -> (bool, bool) {
        let snapshot_row = &self.db.rows[r];
        let late = genuine
            && receipt.source == ReceiptSource::Ack
            && receipt.sequence != 0
            && snapshot_row.state != State::Purged
            && snapshot_row.attempt(receipt.attempt_id).is_some_and(|a| {
                snapshot_row.claim.as_ref().is_none_or(|c| {
                    c.generation != a.claim_generation || c.lease_until_ms <= self.now
                })
            });
        (late, snapshot_row.primary.is_none())
    }

    /// The checkers' bookkeeping once the acceptance point judged `receipt` on `row`.
    fn after_accept(
        &mut self,
        row: u32,
        receipt: &Receipt,
        verdict: ReceiptVerdict,
        (late, slot_was_empty): (bool, bool),
    ) {
        let r = row as usize;
        if late {
            self.stats.late_acks += 1;
            if matches!(
                verdict,
                ReceiptVerdict::Primary | ReceiptVerdict::Duplicate(_)
            ) {
                self.stats.late_acks_converged += 1;
            }
        }
        match verdict {
            ReceiptVerdict::Primary | ReceiptVerdict::Duplicate(_) => {
                if matches!(verdict, ReceiptVerdict::Duplicate(_)) {
                    self.db.duplicates.push((row, receipt.clone()));
                    self.stats.duplicate_receipts += 1;
                }
                let s = self.stream_index(&receipt.cluster, &receipt.stream);
                self.accepted
                    .push((row, s, receipt.sequence, receipt.attempt_id));
                if slot_was_empty && self.proto.purge_on_accept() {
                    self.cleanup(Some(row));
                }
            }
            ReceiptVerdict::Quarantine(_) => self.stats.quarantined_receipts += 1,
            ReceiptVerdict::Reject(_) => self.stats.rejected_receipts += 1,
        }
        self.note(|| {
            format!(
                "accept attempt {} seq {} on row {r}: {:?}{}",
                receipt.attempt_id,
                receipt.sequence,
                verdict,
                if late { " (late ACK)" } else { "" }
            )
        });
    }

    fn stream_index(&self, cluster: &str, topic: &str) -> u8 {
        let c = CLUSTERS
            .iter()
            .position(|x| *x == cluster)
            .unwrap_or(usize::MAX);
        let t = TOPICS
            .iter()
            .position(|x| *x == topic)
            .unwrap_or(usize::MAX);
        self.streams
            .iter()
            .position(|s| s.cluster as usize == c && s.topic as usize == t)
            .map_or(u8::MAX, |i| i as u8)
    }

    // ---------------------------------------------------------------- reconciler
    //
    // One reconciler process: the core's `ReconcilerMachine`, driven like the dispatchers.
    // A database restore restarts it (epoch): answers for the old incarnation are dropped.

    fn reconcile_wake(&mut self, epoch: u32) {
        if epoch != self.epoch || self.reconciler.wake_at.is_some_and(|w| w > self.now) {
            return;
        }
        self.reconciler.wake_at = None;
        self.drive_reconciler();
    }

    fn drive_reconciler(&mut self) {
        while let Some(action) = self.reconciler.machine.poll_action(self.now) {
            self.reconcile_action(action);
        }
        if let Some(t) = self.reconciler.machine.poll_timeout() {
            let t = t.max(self.now);
            if self.reconciler.wake_at.is_none_or(|w| t < w) {
                self.reconciler.wake_at = Some(t);
                let epoch = self.epoch;
                self.at(t, Ev::ReconcileWake { epoch });
            }
        }
    }

    fn reconcile_action(&mut self, action: ReconcileAction) {
        let epoch = self.epoch;
        match action {
            ReconcileAction::ClaimUnknown { max } => {
                let now = self.now;
                if self.database_unreachable() {
                    self.reconciler.machine.handle_claim_failed(now);
                    return;
                }
                let items = self.claim_unknown(max);
                self.reconciler.machine.handle_claimed(now, items);
            }
            ReconcileAction::LookupMany(group) => {
                for item in &group {
                    self.count_lookup(item);
                    self.forge_copy_at_lookup(&item.destination, item.event_id, item.member);
                }
                let lookups = self.broker_scan(&group);
                let t = self.now + range(&mut self.rng, 1, 200);
                self.at(
                    t,
                    Ev::ScanDone {
                        epoch,
                        group,
                        lookups,
                    },
                );
            }
            ReconcileAction::Lookup(item) => {
                self.count_lookup(&item);
                self.forge_copy_at_lookup(&item.destination, item.event_id, item.member);
                let lookup = self.broker_lookup(&item.destination, item.event_id, item.member);
                let t = self.now + range(&mut self.rng, 1, 200);
                self.at(
                    t,
                    Ev::LookupDone {
                        epoch,
                        item: Box::new(item),
                        lookup: Box::new(lookup),
                        verify: false,
                    },
                );
            }
            ReconcileAction::Finish(item, lookup) => {
                self.reconcile_decide(&item, lookup);
                let now = self.now;
                self.reconciler.machine.handle_finished(now);
            }
            ReconcileAction::CheckUnknownAge => {
                let now = self.now;
                let unknown = self.db.rows.iter().filter(|r| r.state.is_unknown());
                let (n, oldest) = unknown.fold((0u64, 0u64), |(n, o), r| {
                    (
                        n + 1,
                        o.max(now - r.unknown_since_ms.unwrap_or(now).min(now)),
                    )
                });
                self.reconciler.machine.handle_unknown_age(now, n, oldest);
            }
            ReconcileAction::Alert { .. } => self.stats.unknown_alerts += 1,
            ReconcileAction::LoadPublished { max } => {
                // The store's window (`store::published_after_cursor`): the published rows
                // among the next `verify_window_rows(max)` rows after the cursor, at most `max`.
                let start = self.reconciler.verify_after;
                let window = verify_window_rows(max);
                let examined = self.db.rows.len().saturating_sub(start).min(window);
                let found: Vec<(usize, VerifyItem)> = self
                    .db
                    .rows
                    .iter()
                    .enumerate()
                    .skip(start)
                    .take(window)
                    .filter(|(_, r)| r.state == State::Published)
                    .take(max)
                    .filter_map(|(i, r)| {
                        let p = r.primary.as_ref()?;
                        Some((
                            i,
                            VerifyItem {
                                event_id: r.event_id,
                                member: r.member,
                                destination: r.destination.clone(),
                                sequence: p.sequence,
                            },
                        ))
                    })
                    .collect();
                self.reconciler.verify_after = if examined == 0 {
                    0
                } else if found.len() == max {
                    found.last().map_or(0, |(i, _)| i + 1)
                } else {
                    start + examined
                };
                let items: Vec<VerifyItem> = found.into_iter().map(|(_, v)| v).collect();
                let now = self.now;
                self.reconciler.machine.handle_verify_batch(now, items);
            }
            ReconcileAction::VerifyLookup(v) => {
                self.forge_copy_at_lookup(&v.destination, v.event_id, v.member);
                let lookup = self.broker_lookup(&v.destination, v.event_id, v.member);
                if let Lookup::Found(r) = &lookup {
                    // Checker: the verification pass counts only a sealed copy present.
                    let s = self.stream_index(&r.cluster, &r.stream) as usize;
                    let forged = self
                        .streams
                        .get(s)
                        .and_then(|st| st.msgs.get((r.sequence as usize).wrapping_sub(1)))
                        .is_some_and(|m| m.forged);
                    if forged {
                        let e = v.event_id;
                        self.violation(Violation::ForgedCopyAdopted, || {
                            format!("verification counted a forged copy of {e} present")
                        });
                    }
                }
                let item = ReconcileItem {
                    event_id: v.event_id,
                    member: v.member,
                    token: ClaimToken {
                        owner: 0,
                        generation: v.sequence,
                    },
                    destination: v.destination,
                };
                let t = self.now + range(&mut self.rng, 1, 200);
                self.at(
                    t,
                    Ev::LookupDone {
                        epoch,
                        item: Box::new(item),
                        lookup: Box::new(lookup),
                        verify: true,
                    },
                );
            }
            ReconcileAction::ReportMissing(v) => {
                // Checker: the simulated brokers never lose a stored message, so a
                // "published but missing" finding here is a false alarm, unless a forged
                // copy sits at the event's subject and no genuine copy among those a lookup
                // reads (the lookup refuses the forgery's seal): a true finding for the
                // operator.
                let s = self.stream_of(&v.destination);
                if self.forged_on(s, v.event_id, v.member)
                    && !self.genuine_visible(s, v.event_id, v.member)
                {
                    self.stats.forgeries_reported += 1;
                } else {
                    self.violation(Violation::LostEvents, || {
                        format!("verification reported {} missing at the broker", v.event_id)
                    });
                }
            }
        }
    }

    fn lookup_done(&mut self, epoch: u32, item: ReconcileItem, lookup: Lookup, verify: bool) {
        if epoch != self.epoch {
            return;
        }
        let now = self.now;
        if verify {
            self.stats.verified += 1;
            let v = VerifyItem {
                event_id: item.event_id,
                member: item.member,
                destination: item.destination,
                sequence: item.token.generation,
            };
            self.reconciler
                .machine
                .handle_verify_lookup(now, v, &lookup);
        } else {
            self.reconciler.machine.handle_lookup(item, lookup);
        }
        self.drive_reconciler();
    }

    /// The store's reconciler claim (`store::claim_unknown`), picking as its SQL does: the
    /// due unknown rows in the order their lookups fell due, up to the batch, and the expired
    /// `SENDING` rows among the front of the claim order (`step::EXPIRY_FRONT_PER_BATCH`
    /// batches of the dispatchable rows, by cluster and commit position), up to the batch;
    /// then the core's `step::step_claim_unknown` decides them.
    fn claim_unknown(&mut self, max: usize) -> Vec<ReconcileItem> {
        self.db_version += 1;
        let owner = 1;
        let now = self.now;
        let rows = &self.db.rows;
        let mut due: Vec<(u64, usize)> = (0..rows.len())
            .filter(|&i| rows[i].state.is_unknown() && step::picks_for_reconcile(&rows[i], now))
            .map(|i| (rows[i].pacing.next_lookup_at_ms, i))
            .collect();
        due.sort_unstable();
        due.truncate(max);
        let positions = &self.db.row_position;
        let mut front: Vec<(&str, u64, usize)> = (0..rows.len())
            .filter(|&i| rows[i].state.phase() == Phase::Dispatchable)
            .map(|i| (rows[i].destination.cluster.as_str(), positions[i], i))
            .collect();
        front.sort_unstable();
        front.truncate(max * step::EXPIRY_FRONT_PER_BATCH);
        let mut picked: Vec<usize> = due.into_iter().map(|(_, i)| i).collect();
        picked.extend(
            front
                .into_iter()
                .map(|(_, _, i)| i)
                .filter(|&i| {
                    rows[i].state == State::Sending && step::picks_for_reconcile(&rows[i], now)
                })
                .take(max),
        );
        // The rows of expired leases that they still stand for, wherever they are in the
        // claim order (the store's third pick), up to the batch.
        let mut from_leases = Vec::new();
        for l in self.db.leases.iter().filter(|l| l.until_ms <= now) {
            for (r, stored, send) in &l.rows {
                let i = *r as usize;
                if from_leases.len() < max
                    && self.leased(*r, stored, send)
                    && !picked.contains(&i)
                    && step::picks_for_reconcile(&self.db.rows[i], now)
                {
                    from_leases.push(i);
                }
            }
        }
        picked.extend(from_leases);
        let mut batch: Vec<EventRow> = picked.iter().map(|&i| self.db.rows[i].clone()).collect();
        let outcomes = match step::step_claim_unknown(&mut batch, owner, now, RECONCILE_LEASE_MS) {
            Ok(o) => o,
            Err(e) => {
                self.violation(Violation::Liveness, || format!("reconcile claim: {e}"));
                return Vec::new();
            }
        };
        let mut items = Vec::with_capacity(picked.len());
        for ((&i, row), outcome) in picked.iter().zip(batch).zip(outcomes) {
            self.db.rows[i] = row;
            match outcome {
                UnknownPick::ExpiredToUnknown => self.fault(Fault::ClaimSuperseded),
                UnknownPick::Claimed { token, superseding } => {
                    if superseding {
                        self.fault(Fault::ClaimSuperseded);
                    }
                    let row = &self.db.rows[i];
                    items.push(ReconcileItem {
                        event_id: row.event_id,
                        member: row.member,
                        token,
                        destination: row.destination.clone(),
                    });
                }
            }
        }
        self.drop_leases(|l| (l.until_ms <= now).then_some(false));
        items
    }

    /// The lookup budget: a row looked up more than [`LOOKUPS_PER_ROW_MAX`] times in a trace
    /// means the reconciler spins.
    fn count_lookup(&mut self, item: &ReconcileItem) {
        if let Some(r) = self.row_of(item.event_id, item.member) {
            let r = r as usize;
            if self.lookups.len() <= r {
                self.lookups.resize(r + 1, 0);
            }
            self.lookups[r] += 1;
            if self.lookups[r] > LOOKUPS_PER_ROW_MAX {
                self.violation_of(Violation::Liveness, 6_000_000 + r as u32, || {
                    format!("row {r} looked up more than {LOOKUPS_PER_ROW_MAX} times: the reconciler spins")
                });
            }
        }
    }

    /// One bulk lookup against the simulated broker, as a Kafka scan does it: from the first
    /// message minted no earlier than the group's earliest event (the broker's record
    /// timestamps are send times, never before the mint) to the end fixed when it starts, at
    /// most `scan_max` records; the answers are the core's (`decide_scanned`, through the
    /// protocol). Checker: no event is answered "absent" while the broker holds it.
    fn broker_scan(&mut self, group: &[ReconcileItem]) -> Vec<Lookup> {
        let unavailable = || vec![Lookup::Unavailable; group.len()];
        let Some(dest) = group.first().map(|i| i.destination.clone()) else {
            return Vec::new();
        };
        let Some(s) = self.stream_of(&dest) else {
            return unavailable();
        };
        let stream = &self.streams[s as usize];
        if self.broker_down_until[stream.cluster as usize] > self.now
            || self.stream_deleted_until[s as usize] > self.now
        {
            return unavailable();
        }
        let from_ms = group
            .iter()
            .filter_map(|i| i.event_id.minted_unix_ms())
            .min()
            .unwrap_or(0);
        let end = stream.msgs.len();
        let start = stream
            .msgs
            .iter()
            .position(|m| m.event_id.minted_unix_ms().unwrap_or(0) >= from_ms)
            .unwrap_or(end);
        // While faults are on, a scan reads at most `scan_max` records (cut short: a bound,
        // a time limit, a fetch error); afterwards it reads to its end, as a scan with a
        // bound raised by the operator does.
        let read_to = if self.faults_on {
            end.min(start + self.cfg.scan_max)
        } else {
            end
        };
        let cut_short = read_to < end;
        let read = &stream.msgs[start..read_to];
        let reach = ScanReach {
            finished: !cut_short,
            start_deleted: false,
        };
        let events: Vec<(EventId, u16)> = group.iter().map(|i| (i.event_id, i.member)).collect();
        let topic = dest.topic.clone();
        let cluster = dest.cluster.clone();
        let lookups = self.proto.decide_scanned(
            &events,
            |event_id, member| {
                read.iter()
                    .enumerate()
                    .filter(|(_, m)| m.event_id == event_id && m.member == member)
                    .take(COPIES_MAX)
                    .map(|(k, m)| m.found_copy(&cluster, &topic, (start + k) as u64 + 1))
                    .collect()
            },
            reach,
        );
        let false_absences: Vec<EventId> = events
            .iter()
            .zip(&lookups)
            .filter(|((event_id, member), l)| {
                **l == Lookup::Absent
                    && stream
                        .msgs
                        .iter()
                        .any(|m| m.event_id == *event_id && m.member == *member)
            })
            .map(|((event_id, _), _)| *event_id)
            .collect();
        if cut_short {
            self.fault(Fault::ScanCutShort);
        }
        for event_id in false_absences {
            self.violation(Violation::FalseAbsences, || {
                format!("a scan answered {event_id} absent while the broker holds it")
            });
        }
        lookups.into_iter().map(|l| self.judge(l)).collect()
    }

    /// "Did you store event X at destination D?" against the simulated broker: every message
    /// on the event's own subject (a subject per event id), oldest first, as `sealpost-nats`
    /// reads them (at most `COPIES_MAX`).
    fn broker_lookup(&mut self, dest: &Destination, event_id: EventId, member: u16) -> Lookup {
        if !self.cfg.caps.lookup_by_event_id {
            return Lookup::Unqueryable;
        }
        let Some(s) = self.stream_of(dest) else {
            return Lookup::Unavailable;
        };
        let stream = &self.streams[s as usize];
        if self.broker_down_until[stream.cluster as usize] > self.now
            || self.stream_deleted_until[s as usize] > self.now
        {
            return Lookup::Unavailable;
        }
        let copies: Vec<FoundCopy> = stream
            .msgs
            .iter()
            .enumerate()
            .filter(|(_, m)| m.event_id == event_id && m.member == member)
            .take(COPIES_MAX)
            .map(|(i, m)| m.found_copy(&dest.cluster, &dest.topic, i as u64 + 1))
            .collect();
        let lookup = if copies.is_empty() {
            Lookup::Absent
        } else {
            Lookup::Copies(copies)
        };
        self.judge(lookup)
    }

    /// The reader judges a lookup's copy (the core's `judge_copy` through the protocol) right
    /// where the adapter's answer comes back.
    fn judge(&mut self, lookup: Lookup) -> Lookup {
        let judged = self.proto.judge_copy(lookup, SIM_POLICY, sim_verify);
        if matches!(judged, Lookup::Unsealed { .. }) {
            self.stats.copies_unsealed += 1;
        }
        judged
    }

    /// The adapter reads the copy a duplicate ACK names (stream `s`, `seq`) and compares it
    /// with the message it sent (the core's `is_this_message`, through the protocol).
    fn duplicate_is_this_message(&mut self, s: usize, seq: u64, req: &PubReq) -> bool {
        let st = &self.streams[s];
        let Some(m) = st.msgs.get((seq as usize).wrapping_sub(1)) else {
            return false;
        };
        let copy = m.found_copy(
            CLUSTERS[st.cluster as usize],
            TOPICS[st.topic as usize],
            seq,
        );
        self.proto
            .is_this_message(&req.claim(), req.signature.as_deref(), &copy)
    }

    /// Ghost: is a genuine copy of this event among the first `COPIES_MAX` messages a lookup
    /// reads for it on stream `s`?
    fn genuine_visible(&self, s: Option<u8>, event_id: EventId, member: u16) -> bool {
        s.and_then(|s| self.streams.get(s as usize))
            .is_some_and(|st| {
                st.msgs
                    .iter()
                    .filter(|m| m.event_id == event_id && m.member == member)
                    .take(COPIES_MAX)
                    .any(|m| !m.forged)
            })
    }

    /// Ghost: does stream `s` hold a genuine copy of this event (anywhere: the simulated
    /// brokers never lose a stored message)?
    fn genuine_held(&self, s: Option<u8>, event_id: EventId, member: u16) -> bool {
        s.and_then(|s| self.streams.get(s as usize))
            .is_some_and(|st| {
                st.msgs
                    .iter()
                    .any(|m| !m.forged && m.event_id == event_id && m.member == member)
            })
    }

    /// Ghost: does stream `s` hold a forged message under this event id and member?
    fn forged_on(&self, s: Option<u8>, event_id: EventId, member: u16) -> bool {
        s.and_then(|s| self.streams.get(s as usize))
            .is_some_and(|st| {
                st.msgs
                    .iter()
                    .any(|m| m.forged && m.event_id == event_id && m.member == member)
            })
    }

    // ---------------------------------------------------------------- the adversary
    //
    // Anyone with publish rights on a stream: it sees what crosses the wire (headers,
    // payloads, signatures) but holds no dispatcher key. Every message it publishes is
    // ghost-marked `forged`; the checkers count one applied or adopted.

    /// A signature header for a message the adversary makes up: none, a malformed one, an
    /// unknown key's, made-up bytes under the dispatchers' key id, or a genuine signature
    /// copied from a message on the streams (a replay over other facts).
    fn forged_signature(&mut self) -> Option<Rc<str>> {
        let mut bytes = [0u8; SIGNATURE_LEN];
        self.adv.fill_bytes(&mut bytes);
        let header = |kid: &str| -> Option<Rc<str>> {
            Some(Rc::from(
                SignatureHeader {
                    key_id: kid.to_string(),
                    signature: bytes,
                }
                .format(),
            ))
        };
        match self.adv.next_u32() % 5 {
            0 => None,
            1 => Some(Rc::from("ed25519 kid=sim-dispatcher sig=forged")),
            2 => header("stolen-laptop"),
            3 => header(SIM_KEY_ID),
            _ => {
                let n: usize = self.streams.iter().map(|st| st.msgs.len()).sum();
                if n == 0 {
                    return None;
                }
                let mut k = self.adv.next_u32() as usize % n;
                for st in &self.streams {
                    if k < st.msgs.len() {
                        return st.msgs[k].signature.clone();
                    }
                    k -= st.msgs.len();
                }
                None
            }
        }
    }

    /// The adversary publishes `m` on stream `s` as any client may: without create-if-absent;
    /// with `msg_id` it sets the event id as the broker's duplicate id (and is dropped as a
    /// duplicate inside the window of a stored one). True when the broker stored it.
    fn forge_publish(&mut self, s: usize, mut m: Msg, msg_id: bool) -> bool {
        // Ghost: forged unless it carries a dispatcher's signature over its very claim.
        let digest = m.claim().digest();
        m.forged = !(self.signed.contains(&digest)
            && m.signature.as_deref()
                == Some(
                    SignatureHeader {
                        key_id: SIM_KEY_ID.to_string(),
                        signature: model_signature(&digest),
                    }
                    .format()
                    .as_str(),
                ));
        let cluster = self.streams[s].cluster as usize;
        if self.broker_down_until[cluster] > self.now || self.stream_deleted_until[s] > self.now {
            return false;
        }
        let now = self.now;
        let window = self.cfg.dup_window_ms;
        let stream = &mut self.streams[s];
        if msg_id {
            stream.dedup.retain(|e| e.3 + window > now);
            if stream
                .dedup
                .iter()
                .any(|e| e.0 == m.event_id && e.1 == m.member)
            {
                return false;
            }
        }
        let (event_id, member) = (m.event_id, m.member);
        stream.msgs.push(m);
        let seq = stream.msgs.len() as u64;
        if msg_id {
            stream.dedup.push((event_id, member, seq, now));
        }
        self.note(|| format!("adversary stores a forged {event_id} at stream {s}#{seq}"));
        self.wake_consumers();
        true
    }

    /// Fault: a forged new event (a fresh event id) on a random stream.
    fn forge_new_event(&mut self) {
        if !self.faults_on {
            return;
        }
        let s = self.adv.next_u32() as usize % self.streams.len();
        let mut random = [0u8; 10];
        self.adv.fill_bytes(&mut random);
        let mut digest = [0u8; 32];
        self.adv.fill_bytes(&mut digest);
        let m = Msg {
            ordered: false,
            event_id: EventId::mint(1_700_000_000_000 + self.now, random),
            member: 0,
            envelope_generation: 1,
            attempt_id: 9_500_000 + u64::from(self.adv.next_u32() % 1000),
            payload_digest: Digest(digest),
            destination_digest: Digest([0x5a; 32]),
            event_type: (self.adv.next_u32() % 2) as u8,
            signature: self.forged_signature(),
            forged: true,
        };
        if self.forge_publish(s, m, true) {
            self.fault(Fault::ForgedNewEvent);
        }
    }

    /// Fault: a genuine message's signature replayed onto another event id, payload or
    /// event type (the rest of its headers copied).
    fn replay_signature(&mut self) {
        if !self.faults_on {
            return;
        }
        let genuine: Vec<(usize, usize)> = (0..self.streams.len())
            .flat_map(|s| {
                self.streams[s]
                    .msgs
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| !m.forged)
                    .map(move |(k, _)| (s, k))
            })
            .collect();
        if genuine.is_empty() {
            // Nothing to copy yet: the adversary waits for traffic.
            let t = self.now + range(&mut self.adv, 1_000, 10_000);
            self.at(t, Ev::ReplaySignature);
            return;
        }
        let (s, k) = genuine[self.adv.next_u32() as usize % genuine.len()];
        let mut m = self.streams[s].msgs[k].clone();
        m.forged = true;
        match self.adv.next_u32() % 3 {
            0 => {
                let mut random = [0u8; 10];
                self.adv.fill_bytes(&mut random);
                m.event_id = EventId::mint(1_700_000_000_000 + self.now, random);
            }
            1 => m.payload_digest = Digest([0xad; 32]),
            _ => m.event_type = 1 - m.event_type,
        }
        let msg_id = self.adv.next_u32().is_multiple_of(2);
        if self.forge_publish(s, m, msg_id) {
            self.fault(Fault::ReplayedSignature);
        }
    }

    /// Fault: the adversary saw `req` leave and gets its own copy (the request's headers,
    /// sometimes another payload, no valid signature) to the subject first.
    fn forge_copy_first(&mut self, req: &PubReq) {
        let m = Msg {
            ordered: req.ordered,
            event_id: req.event_id,
            member: req.member,
            envelope_generation: req.envelope_generation,
            attempt_id: req.attempt_id,
            payload_digest: if self.adv.next_u32().is_multiple_of(3) {
                Digest([0xf0; 32])
            } else {
                req.payload_digest
            },
            destination_digest: req.destination_digest,
            event_type: req.event_type,
            signature: self.forged_signature(),
            forged: true,
        };
        let msg_id = !self.adv.next_u32().is_multiple_of(4);
        if self.forge_publish(req.stream as usize, m, msg_id) {
            self.fault(Fault::ForgedCopyFirst);
        }
    }

    /// Fault (before a lookup of `event_id`/`member` at `dest`): the adversary publishes a
    /// copy of the row's latest attempt (its headers, no valid signature) at the subject.
    fn forge_copy_at_lookup(&mut self, dest: &Destination, event_id: EventId, member: u16) {
        if !self.faults_on || !chance(&mut self.adv, self.cfg.p_forge_copy_lookup) {
            return;
        }
        let (Some(r), Some(s)) = (self.row_of(event_id, member), self.stream_of(dest)) else {
            return;
        };
        let signature = self.forged_signature();
        let row = &self.db.rows[r as usize];
        let m = Msg {
            ordered: false,
            event_id,
            member,
            envelope_generation: row.envelope_generation,
            attempt_id: row.attempts.last().map_or(1, |a| a.id),
            payload_digest: row.payload_digest,
            destination_digest: row.destination_digest,
            event_type: self.facts[self.db.row_fact[r as usize] as usize].event_type,
            signature,
            forged: true,
        };
        if self.forge_publish(s as usize, m, false) {
            self.fault(Fault::ForgedCopyAtLookup);
        }
    }

    fn reconcile_decide(&mut self, item: &ReconcileItem, lookup: Lookup) {
        self.db_version += 1;
        let Some(row) = self.row_of(item.event_id, item.member) else {
            // Restored away: the same verdict the store gives.
            if matches!(decide_reconcile_missing(), ReconcileDecision::Fenced(_)) {
                self.stats.fenced_writes += 1;
            }
            return;
        };
        let r = row as usize;
        // The store's finish step (`step::step_finish_reconcile`) with this protocol's hooks.
        let pre = match &lookup {
            Lookup::Found(found) => {
                let genuine = self.genuine(found);
                Some(self.before_accept(r, found, genuine))
            }
            _ => None,
        };
        let now = self.now;
        let finished = match self.proto.step_finish_reconcile(
            &mut self.db.rows[r],
            item.token,
            &lookup,
            ReconcilePolicy::for_capabilities(self.cfg.caps),
            now,
        ) {
            Ok(f) => f,
            Err(e) => {
                self.violation(Violation::Liveness, || format!("reconcile: {e}"));
                return;
            }
        };
        let decision = finished.decision;
        self.note(|| {
            format!(
                "reconcile row {r} lookup {:?}: {decision:?}",
                std::mem::discriminant(&lookup)
            )
        });
        match &decision {
            ReconcileDecision::Accept(receipt) => match (finished.accepted, pre) {
                (Some(Acceptance::Judged { verdict, .. }), Some(pre)) => {
                    self.after_accept(row, receipt, verdict, pre)
                }
                _ => self.stats.rejected_receipts += 1,
            },
            ReconcileDecision::Fenced(_) => self.stats.fenced_writes += 1,
            // The step applied these to the row already.
            ReconcileDecision::RetrySameDestination { quarantine, .. } => {
                if quarantine.is_some() {
                    self.stats.quarantined_receipts += 1;
                }
                self.wake_dispatchers();
            }
            ReconcileDecision::StayUnknown => {}
            ReconcileDecision::Conflict(reason) => {
                self.stats.quarantined_receipts += 1;
                // Checker: a row parks as an unsealed copy only where a forgery sits at its
                // subject.
                let s = self.stream_of(&self.db.rows[r].destination);
                if *reason == QuarantineReason::UnsealedCopy
                    && !self.forged_on(s, item.event_id, item.member)
                {
                    self.violation_of(Violation::Liveness, r as u32, || {
                        format!("row {r} parked as an unsealed copy without a forgery")
                    });
                }
                // Checker: nor while its genuine copy is among those a lookup reads (a
                // look-alike beside it must not hide it).
                if *reason == QuarantineReason::UnsealedCopy
                    && self.genuine_visible(s, item.event_id, item.member)
                {
                    self.violation_of(Violation::Liveness, r as u32, || {
                        format!("row {r} parked as an unsealed copy although its genuine copy is stored")
                    });
                }
                // Ghost: this row waits for an operator who must move it elsewhere; the
                // simulated operator only releases poison.
                if !self.conflicts.contains(&row) {
                    self.conflicts.push(row);
                }
            }
        }
    }

    // ---------------------------------------------------------------- migration

    fn migration_request(&mut self) {
        self.db_version += 1;
        if self.db.rows.is_empty() {
            return;
        }
        let r = self.rng.next_u32() as usize % self.db.rows.len();
        let fact = self.db.row_fact[r];
        let agg = self.facts[fact as usize].aggregate;
        let to = member_destination(
            self.db.policy + 1,
            self.cfg.ordering_mode,
            agg,
            self.db.rows[r].member,
        );
        match decide_migration(&self.db.rows[r], &to) {
            Ok(grant) => {
                if let Some(g) = self.never_sent_ghost.get_mut(r) {
                    // A new destination is tried at once, without the old one's backoff.
                    *g = (0, 0);
                }
                if let Err(e) = apply_migration(&mut self.db.rows[r], &grant, to) {
                    self.violation(Violation::Liveness, || format!("migration: {e}"));
                    return;
                }
                self.stats.migrations_granted += 1;
                self.note(|| {
                    format!(
                        "row {r} migrated to envelope generation {}",
                        grant.envelope_generation
                    )
                });
            }
            Err(refusal) => {
                if self.db.rows[r].state.is_unknown() && !self.cfg.caps.lookup_by_event_id {
                    self.fault(Fault::MigrationWhileUnknownUnqueryable);
                }
                self.stats.migrations_refused += 1;
                self.note(|| format!("migration of row {r} refused: {refusal}"));
            }
        }
    }

    // ---------------------------------------------------------------- consumers

    fn wake_consumers(&mut self) {
        for c in 0..self.consumers.len() {
            if self.consumers[c].alive && !self.consumers[c].tick_scheduled {
                self.consumers[c].tick_scheduled = true;
                let inc = self.consumers[c].inc;
                let t = self.now + range(&mut self.rng, 1, 50);
                self.at(t, Ev::ConsumerTick { c: c as u8, inc });
            }
        }
    }

    fn consumer_tick(&mut self, c: u8, inc: u32) {
        let ci = c as usize;
        if self.consumers[ci].inc != inc || !self.consumers[ci].alive {
            return;
        }
        self.consumers[ci].tick_scheduled = false;
        let mut more = false;
        'streams: for s in 0..self.streams.len() {
            if self.broker_down_until[self.streams[s].cluster as usize] > self.now {
                more = true;
                continue;
            }
            let wm = self.consumers[ci].watermark[s];
            let total = self.streams[s].msgs.len() as u64;
            if total <= wm {
                continue;
            }
            // Fetch a batch above the committed position (redelivering anything not yet
            // covered by it), possibly reordered and duplicated (F8).
            let mut batch: Vec<u64> = ((wm + 1)..=total)
                .filter(|p| !self.consumers[ci].acked_above[s].contains(p))
                .take(CONSUMER_BATCH_MAX)
                .collect();
            if total - wm > batch.len() as u64 {
                more = true;
            }
            if self.faults_on && batch.len() > 1 && chance(&mut self.rng, self.cfg.p_redeliver) {
                self.fault(Fault::ReorderedDuplicated);
                batch.reverse();
                let dup = batch[self.rng.next_u32() as usize % batch.len()];
                batch.push(dup);
            }
            for pos in batch {
                if !self.consume_one(ci, s, pos) {
                    break 'streams;
                }
            }
        }
        if !self.consumers[ci].alive {
            return;
        }
        let next = if more { 500 } else { CONSUMER_IDLE_POLL_MS };
        self.consumers[ci].tick_scheduled = true;
        let t = self.now + next;
        self.at(t, Ev::ConsumerTick { c, inc });
    }

    /// Processes one delivered message; false if the consumer crashed.
    fn consume_one(&mut self, ci: usize, s: usize, pos: u64) -> bool {
        let m = self.streams[s].msgs[(pos - 1) as usize].clone();
        if self.faults_on && chance(&mut self.rng, self.cfg.p_consumer_crash / 2) {
            self.fault(Fault::ConsumerCrashBeforeCommit);
            self.crash_consumer(ci);
            return false;
        }
        let existing = self.consumers[ci]
            .inbox
            .iter()
            .find(|(e, _)| *e == m.event_id)
            .map(|(_, r)| *r);
        let decision = self.proto.decide_inbox(existing, m.payload_digest);
        let agg_version = self.aggregate_version(m.event_id);
        // The highest version up to which every version of the aggregate was applied
        // (unordered versions too: a route revision may have sent some of them unordered).
        let last = agg_version.and_then(|(a, _)| {
            let vs = &self.consumers[ci]
                .applied_versions
                .iter()
                .find(|e| e.0 == a)?
                .1;
            let mut prefix = 0;
            while vs.contains(&(prefix + 1)) {
                prefix += 1;
            }
            (prefix > 0).then_some(prefix)
        });
        let delivered = {
            let con = &mut self.consumers[ci];
            match con.delivered.iter_mut().find(|e| e.0 == (s, pos)) {
                Some(e) => {
                    e.1 += 1;
                    e.1
                }
                None => {
                    con.delivered.push(((s, pos), 1));
                    1
                }
            }
        };
        // The delivery check before the inbox (the core's `decide_delivery` through the
        // protocol): the signature verified over the claim rebuilt from the message.
        let claim = m.claim();
        let presented = present(m.signature.as_deref(), Some(&claim), sim_verify);
        if let Err(refusal) =
            self.proto
                .decide_delivery(m.payload_digest, m.payload_digest, SIM_POLICY, &presented)
        {
            // Recorded in the consumer's quarantine, then acked: never applied.
            self.stats.deliveries_unsealed += 1;
            if !m.forged {
                self.violation(Violation::Liveness, || {
                    format!("consumer {ci} refused a genuine message: {refusal}")
                });
            }
            match self
                .proto
                .decide_settlement(Processed::Quarantined, delivered, SIM_REDELIVERY)
            {
                Settlement::Ack => self.ack_position(ci, s, pos),
                other => self.violation(Violation::Liveness, || {
                    format!("consumer {ci}: a refused delivery settled as {other:?}")
                }),
            }
            return true;
        }
        if decision == InboxDecision::Apply {
            if let Some((_, version)) = agg_version.filter(|_| m.ordered) {
                if self.proto.decide_apply_order(last, version) == ApplyOrder::Hold {
                    // Not applied, not acked: delivered again after the earlier version.
                    self.stats.ordering_holds += 1;
                    return true;
                }
            }
            if self.faults_on && chance(&mut self.rng, self.cfg.p_effect_fail) {
                // The effect failed: rolled back alone (no inbox row, no effect); the core
                // decides how the delivery is settled.
                self.fault(Fault::EffectFailed);
                let processed = Processed::Failed(Failure::Message);
                return match self
                    .proto
                    .decide_settlement(processed, delivered, SIM_REDELIVERY)
                {
                    Settlement::Ack => {
                        self.ack_position(ci, s, pos);
                        true
                    }
                    // Not acked: fetched again on a later tick, after the delay at least.
                    Settlement::RetryAfter { .. } => {
                        self.stats.effect_retries += 1;
                        true
                    }
                    Settlement::Terminate => {
                        // The dead letter commits in the consumer's database, then the ack.
                        self.stats.dead_lettered += 1;
                        self.consumers[ci].dead_letters.push(m.event_id);
                        self.ack_position(ci, s, pos);
                        true
                    }
                };
            }
            if let Some((agg, version)) = agg_version.filter(|_| m.ordered) {
                // Checker (R29): the consumer applies an ordered aggregate's versions in order
                // (an unordered version, from a route revision, promises nothing).
                let con = &mut self.consumers[ci];
                let seen = con.ordered_applied.iter_mut().find(|e| e.0 == agg);
                let later = seen.as_ref().map_or(0, |e| e.1);
                match seen {
                    Some(e) => e.1 = e.1.max(version),
                    None => con.ordered_applied.push((agg, version)),
                }
                if later > version && !self.restore_broken.contains(&agg) {
                    self.violation_of(Violation::Ordering, 8_000_000 + agg, || {
                        format!("consumer {ci} applied version {version} of aggregate {agg} after version {later}")
                    });
                }
            }
        }
        match decision {
            InboxDecision::Apply => {
                if let Some((agg, version)) = agg_version {
                    let con = &mut self.consumers[ci];
                    match con.applied_versions.iter_mut().find(|e| e.0 == agg) {
                        Some(e) => e.1.push(version),
                        None => con.applied_versions.push((agg, vec![version])),
                    }
                }
                let in_tx = self.proto.inbox_in_effect_tx();
                if !m.forged {
                    self.contract_read(ci, m.event_id);
                }
                self.apply_effect(ci, &m);
                if !in_tx && self.faults_on && chance(&mut self.rng, self.cfg.p_consumer_crash) {
                    // Mutant: the effect committed alone; the inbox row never did.
                    self.crash_consumer(ci);
                    return false;
                }
                let con = &mut self.consumers[ci];
                con.next_receipt += 1;
                let rec = InboxRecord {
                    payload_digest: m.payload_digest,
                    receipt_id: con.next_receipt,
                };
                con.inbox.push((m.event_id, rec));
            }
            InboxDecision::Duplicate { .. } => self.stats.inbox_duplicates += 1,
            InboxDecision::Quarantine => self.stats.inbox_quarantined += 1,
        }
        if self.faults_on && chance(&mut self.rng, self.cfg.p_consumer_crash / 2) {
            // F9: committed, then crashed before acking the broker.
            self.fault(Fault::ConsumerCrashAfterCommit);
            self.crash_consumer(ci);
            return false;
        }
        let processed = match decision {
            InboxDecision::Apply => Processed::Applied,
            InboxDecision::Duplicate { .. } => Processed::Duplicate,
            InboxDecision::Quarantine => Processed::Quarantined,
        };
        match self
            .proto
            .decide_settlement(processed, delivered, SIM_REDELIVERY)
        {
            Settlement::Ack => self.ack_position(ci, s, pos),
            other => self.violation(Violation::Liveness, || {
                format!("consumer {ci}: a committed delivery settled as {other:?}")
            }),
        }
        true
    }

    /// The consumer acks `pos` of stream `s`; the committed broker position advances over
    /// the contiguous acked prefix.
    fn ack_position(&mut self, ci: usize, s: usize, pos: u64) {
        let con = &mut self.consumers[ci];
        con.acked_above[s].push(pos);
        while let Some(i) = con.acked_above[s]
            .iter()
            .position(|p| *p == con.watermark[s] + 1)
        {
            con.acked_above[s].swap_remove(i);
            con.watermark[s] += 1;
        }
    }

    /// Checker (R29): the first stored copy of an ordered event comes after every earlier
    /// version and before every later version of its aggregate stored for an ordered
    /// destination.
    fn check_broker_order(&mut self, req: &PubReq) {
        let Some((agg, version)) = self.aggregate_version(req.event_id).filter(|_| req.ordered)
        else {
            return;
        };
        if self.ordered_stored.iter().any(|e| e.2 == req.event_id)
            || self.restore_broken.contains(&agg)
        {
            return;
        }
        if let Some(&(_, later, _)) = self
            .ordered_stored
            .iter()
            .find(|e| e.0 == agg && e.1 > version)
        {
            self.violation_of(Violation::Ordering, 7_000_000 + agg, || {
                format!("broker stored version {version} of aggregate {agg} after version {later}")
            });
        }
        self.ordered_stored.push((agg, version, req.event_id));
    }

    /// The aggregate and version of an event (the headers on the wire say it).
    fn aggregate_version(&self, event_id: EventId) -> Option<(u32, u64)> {
        let x = self.facts.iter().find(|f| f.event_id == event_id)?;
        Some((x.aggregate, x.version))
    }

    /// True when consumer `c` dead-lettered an earlier version of this event's aggregate: an
    /// ordered consumer holds this one until its owner resolves the dead letter.
    fn behind_dead_letter(&self, c: usize, event_id: EventId) -> bool {
        let Some((agg, version)) = self.aggregate_version(event_id) else {
            return false;
        };
        self.consumers[c].dead_letters.iter().any(|d| {
            self.aggregate_version(*d)
                .is_some_and(|(a, v)| a == agg && v < version)
        })
    }

    /// True when a consumer waits in vain for an earlier version of this event's aggregate:
    /// a database restore lost it with its business row before it reached the broker. The
    /// consumer's owner seeds the aggregate's version past the gap (the documented exit).
    fn behind_lost(&self, event_id: EventId) -> bool {
        let Some((agg, version)) = self.aggregate_version(event_id) else {
            return false;
        };
        self.facts.iter().enumerate().any(|(f, x)| {
            x.aggregate == agg
                && x.version < version
                && !self.db.business.contains(&(f as u32))
                && !self
                    .streams
                    .iter()
                    .any(|s| s.msgs.iter().any(|m| !m.forged && m.event_id == x.event_id))
        })
    }

    fn apply_effect(&mut self, ci: usize, m: &Msg) {
        if m.forged {
            let e = m.event_id;
            self.violation(Violation::ForgeryApplied, || {
                format!("consumer {ci} applied a forged message under {e}")
            });
        }
        // Checker: the effect's payload is the sealed one.
        let sealed = self
            .db
            .rows
            .iter()
            .find(|r| r.event_id == m.event_id)
            .map(|r| r.payload_digest)
            .or_else(|| {
                self.facts
                    .iter()
                    .position(|f| f.event_id == m.event_id)
                    .map(|f| Digest::of_bytes(PAYLOAD_DOMAIN, &(f as u32).to_be_bytes()))
            });
        if sealed.is_some_and(|d| d != m.payload_digest) {
            self.violation(Violation::DivergentPayloads, || {
                format!(
                    "consumer {ci} applied a divergent payload for {}",
                    m.event_id
                )
            });
        }
        let con = &mut self.consumers[ci];
        let count = match con.effects.iter_mut().find(|(e, _)| *e == m.event_id) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                con.effects.push((m.event_id, 1));
                1
            }
        };
        if count > 1 {
            self.violation(Violation::DuplicateEffects, || {
                format!("consumer {ci} applied {} {count} times", m.event_id)
            });
        }
    }

    fn crash_consumer(&mut self, ci: usize) {
        let con = &mut self.consumers[ci];
        con.alive = false;
        con.inc += 1;
        con.tick_scheduled = false;
        con.acked_above.iter_mut().for_each(Vec::clear);
        let t = self.now + range(&mut self.rng, 500, 10_000);
        self.at(t, Ev::ConsumerRestart { c: ci as u8 });
    }

    // ---------------------------------------------------------------- cleanup and restore

    fn watermarks_for(&self, row: &EventRow) -> Vec<Watermark> {
        let s = self
            .stream_of(&row.destination)
            .map_or(usize::MAX, usize::from);
        (0..self.consumers.len())
            .map(|c| Watermark {
                consumer: c as u32,
                watermark: self.consumers[c]
                    .watermark
                    .get(s)
                    .copied()
                    .filter(|w| *w > 0),
            })
            .collect()
    }

    fn cleanup(&mut self, only: Option<u32>) {
        self.db_version += 1;
        // The oldest backup that may still be restored is the restore point: rows published
        // at or after it are kept (a consumer restored with it may need them replayed).
        let restore_point = self.snapshot.as_ref().map(|_| self.snapshot_at_ms);
        let policy = RetentionPolicy {
            replay_window_ms: REPLAY_WINDOW_MS,
            restore_point_ms: restore_point,
        };
        for i in 0..self.db.rows.len() {
            if only.is_some_and(|o| o as usize != i) {
                continue;
            }
            let marks = self.watermarks_for(&self.db.rows[i]);
            match self
                .proto
                .decide_purge(&self.db.rows[i], self.now, policy, &marks)
            {
                Ok(()) => {
                    // Checker: every required consumer applied it and the window passed.
                    let row = &self.db.rows[i];
                    let eid = row.event_id;
                    let early_window = row
                        .published_at_ms
                        .is_none_or(|p| p + REPLAY_WINDOW_MS > self.now);
                    let unconsumed = self.consumers.iter().any(|c| {
                        !c.effects.iter().any(|(e, _)| *e == eid) && !c.dead_letters.contains(&eid)
                    });
                    // Checker: nothing published after a backup that may still be restored.
                    let after_backup =
                        restore_point.is_some_and(|b| row.published_at_ms.is_none_or(|p| p >= b));
                    if early_window || unconsumed || after_backup {
                        self.violation(Violation::EarlyPurges, || format!("row {i} purged early (window: {early_window}, unconsumed: {unconsumed}, published after the restorable backup: {after_backup})"));
                    }
                    let st = self.db.rows[i].state;
                    match transition(st, State::Purged) {
                        Ok(s) => self.db.rows[i].state = s,
                        Err(_) => {
                            // The mutant may purge from any published-ish state.
                            self.db.rows[i].state = State::Purged;
                        }
                    }
                    self.stats.purged += 1;
                }
                Err(PurgeRefusal::ReplayWindow { .. } | PurgeRefusal::RestorePoint { .. })
                    if self.db.rows[i].state == State::Published =>
                {
                    let d = RetentionDecision::Retain;
                    if let Err(e) = apply_retention(&mut self.db.rows[i], d) {
                        self.violation(Violation::Liveness, || format!("retain: {e}"));
                    }
                }
                Err(_) => {
                    if only.is_some() {
                        self.stats.purges_refused += 1;
                    }
                }
            }
        }
    }

    fn restore(&mut self) {
        self.db_version += 1;
        let Some(snap) = self.snapshot.take() else {
            return;
        };
        self.fault(Fault::DatabaseRestored);
        self.db = snap;
        // The writers' open transactions died with the old database (their clients retry
        // when the late commit finds them gone); the late rows it lost are not waiting.
        self.open_txns.clear();
        let n = self.db.rows.len() as u32;
        self.late_behind.retain(|&r| r < n);
        self.contract_reregister();
        // The restored aliases may put a route back in shadow.
        self.schedule_shadow();
        for f in 0..self.facts.len() {
            let a = self.facts[f].aggregate;
            if self.facts[f].committed
                && !self.db.business.contains(&(f as u32))
                && !self.restore_broken.contains(&a)
            {
                self.restore_broken.push(a);
            }
        }
        self.epoch += 1;
        // A conflict found later is re-found from the restored rows.
        self.conflicts.clear();
        self.unknown_since.truncate(self.db.rows.len());
        for i in 0..self.unknown_since.len() {
            if !self.db.rows[i].state.is_unknown() {
                self.unknown_since[i] = None;
            }
        }
        // The accepted-receipt ghost follows the restored store.
        self.accepted
            .retain(|(r, _, _, _)| (*r as usize) < self.db.rows.len());
        let rows = &self.db.rows;
        let dups = &self.db.duplicates;
        self.accepted.retain(|(r, _, seq, a)| {
            rows[*r as usize]
                .primary
                .as_ref()
                .is_some_and(|p| p.sequence == *seq && p.attempt_id == *a)
                || dups
                    .iter()
                    .any(|(dr, d)| dr == r && d.sequence == *seq && d.attempt_id == *a)
        });
        // Operating procedure: dispatchers restart after a restore (their claims died with
        // the old database).
        for d in 0..self.dispatchers.len() {
            self.restart_dispatcher(d as u8);
        }
        // So does the reconciler (the epoch drops its outstanding answers).
        self.reconciler = reconciler(self.cfg.caps, self.now);
        self.reconciler.wake_at = Some(self.now);
        let epoch = self.epoch;
        self.at(self.now, Ev::ReconcileWake { epoch });
        self.note(|| "database restored from backup".into());
        // The rows' backoff went back with them; the ghost starts counting again.
        self.never_sent_ghost.clear();
        if self.cdc.is_some() {
            // The restored database has no slot (its progress row outlived it): the
            // publisher starts again, creates one at the log's end and scans first.
            self.cdc_slot_lost();
            self.cdc_restart();
            self.cdc_left = self
                .db
                .rows
                .iter()
                .map(|r| r.state.phase() != Phase::Dispatchable)
                .collect();
        }
    }

    // ---------------------------------------------------------------- contracts (R26)
    //
    // The registry's decision is the core's `contract::Check` (through
    // `Protocol::register_contract`), `enqueue`'s the core's `contract::check_payload`
    // (through `Protocol::check_payload`), and a consumer reads with the core's
    // `contract::Reader`: the same functions `sealpost::contract` and both store flavours run.

    /// The registered versions of event type `t`, oldest first.
    fn registered_versions(&self, t: u8) -> Vec<SchemaVersion> {
        let catalogue = &contract_catalogue()[usize::from(t)];
        self.db.registry[usize::from(t)]
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut v = catalogue[usize::from(*e)].clone();
                v.version = i as u32 + 1;
                v
            })
            .collect()
    }

    /// The registrar registers catalogue entry `entry` for event type `t` (one transaction:
    /// the registered versions read under the event type's lock, the decision, the insert).
    fn contract_register(&mut self, t: u8, entry: u8) {
        if self.contracts.is_none() {
            return;
        }
        match self.register_entry(t, entry) {
            Ok(new) => {
                if new {
                    if let Some(k) = self.contracts.as_mut() {
                        k.made.push((t, entry));
                    }
                    let version = self.db.registry[usize::from(t)].len();
                    self.note(|| format!("registered version {version} (entry {entry})"));
                }
            }
            Err(e) => {
                self.stats.contracts.refused += 1;
                self.note(|| format!("registration of entry {entry} refused: {e}"));
            }
        }
    }

    /// One registration transaction of catalogue entry `entry` for event type `t`: stored
    /// when the decision allows a new version (true), nothing when it is already registered
    /// (false) or refused.
    fn register_entry(&mut self, t: u8, entry: u8) -> Result<bool, ContractError> {
        let registered = self.registered_versions(t);
        let candidate = contract_catalogue()[usize::from(t)][usize::from(entry)].clone();
        let (_, new) = self.proto.register_contract(&registered, candidate)?;
        if new {
            self.db.registry[usize::from(t)].push(entry);
            self.stats.contracts.registered += 1;
        }
        Ok(new)
    }

    /// After a restore: the operator registers again, in their order, the versions the
    /// restored registry lacks (so every version keeps its number).
    fn contract_reregister(&mut self) {
        let Some(made) = self.contracts.as_ref().map(|k| k.made.clone()) else {
            return;
        };
        let mut present = vec![0usize; EVENT_TYPES.len()];
        for (t, entry) in made {
            let ti = usize::from(t);
            if self.db.registry[ti].get(present[ti]) == Some(&entry)
                || matches!(self.register_entry(t, entry), Ok(true))
            {
                present[ti] += 1;
            }
        }
    }

    /// `enqueue`'s contract check of fact `fact` on a route that requires contracts: its
    /// producer names the version its schema was registered as (the next number if it was
    /// not), and the core checks the payload against the registered text. False when it is
    /// refused: the producer then falls back to the newest registered version.
    fn contract_enqueue(&mut self, fact: u32) -> bool {
        let Some(k) = self.contracts.as_ref() else {
            return true;
        };
        let f = fact as usize;
        let t = self.facts[f].event_type;
        let ti = usize::from(t);
        let entry = k.writes[f];
        let catalogue = &contract_catalogue()[ti];
        let registry = &self.db.registry[ti];
        let version = registry
            .iter()
            .position(|e| *e == entry)
            .map_or(registry.len() + 1, |i| i + 1) as u32;
        let text = registry
            .get(version as usize - 1)
            .map(|e| catalogue[usize::from(*e)].text.as_str());
        let payload = contract_payload(
            &catalogue[usize::from(entry)],
            fact,
            self.facts[f].aggregate,
        )
        .expect("a catalogue payload encodes");
        let id = contract::schema_id(EVENT_TYPES[ti], version);
        match self
            .proto
            .check_payload(EVENT_TYPES[ti], &id, text, &payload)
        {
            Ok(()) => {
                if let Some(k) = self.contracts.as_mut() {
                    k.payloads[f] = Some((version, payload.into()));
                }
                true
            }
            Err(e) => {
                self.stats.contracts.enqueue_refused += 1;
                self.note(|| format!("enqueue of fact {fact} refused: {e}"));
                let newest = *self.db.registry[ti]
                    .last()
                    .expect("version 1 is registered");
                if let Some(k) = self.contracts.as_mut() {
                    k.writes[f] = newest;
                }
                false
            }
        }
    }

    /// Consumer `ci`'s handler reads the payload of `event_id` with its `contract::Reader`
    /// (loaded again when the registry grew). Checker: the reader accepts every registered
    /// version, resolves the writer's, decodes the payload, and takes the total to mean
    /// what the producer meant.
    fn contract_read(&mut self, ci: usize, event_id: EventId) {
        let Some(k) = self.contracts.as_ref() else {
            return;
        };
        let Some(f) = self.facts.iter().position(|x| x.event_id == event_id) else {
            return;
        };
        let Some((version, payload)) = k.payloads[f].clone() else {
            return;
        };
        let t = self.facts[f].event_type;
        let ti = usize::from(t);
        let len = self.db.registry[ti].len();
        let reader = match &k.readers[ci][ti] {
            Some((n, r)) if *n == len => Ok(Rc::clone(r)),
            _ => {
                // Consumer 0 stays at version 1; consumer 1 moves to the newest.
                let at = if ci == 0 { 1 } else { len as u32 };
                Reader::new(EVENT_TYPES[ti], at, self.registered_versions(t)).map(Rc::new)
            }
        };
        let reader = match reader {
            Ok(r) => r,
            Err(e) => {
                self.violation(Violation::UnreadableEvents, || {
                    format!(
                        "consumer {ci} cannot load its reader of {}: {e}",
                        EVENT_TYPES[ti]
                    )
                });
                return;
            }
        };
        if let Some(k) = self.contracts.as_mut() {
            k.readers[ci][ti] = Some((len, Rc::clone(&reader)));
        }
        let id = contract::schema_id(EVENT_TYPES[ti], version);
        let digest = Digest::of_bytes(sealpost_core::envelope::SCHEMA_DOMAIN, id.as_bytes());
        match reader.read(&digest, &payload) {
            Ok((writer, value)) => {
                self.stats.contracts.reads += 1;
                if writer != reader.version().version {
                    self.stats.contracts.reads_across_versions += 1;
                }
                let meant = cents_of(f as u32);
                let read = read_cents(reader.version(), &value);
                if read != Some(meant) {
                    self.violation(Violation::UnreadableEvents, || {
                        format!(
                            "consumer {ci} read {id} of {event_id} as version {} and took its total for {read:?} cents, the producer meant {meant}",
                            reader.version().version
                        )
                    });
                }
            }
            Err(e) => self.violation(Violation::UnreadableEvents, || {
                format!("consumer {ci} cannot read {id} of {event_id}: {e}")
            }),
        }
    }

    // ---------------------------------------------------------------- CDC publisher
    //
    // The log reader and the publisher's claims (`sealpost::cdc`): the window is the core's
    // `LogWindow`, the state check the core's `check_of` (through `Protocol::cdc_check`), the
    // claim the same claim step as every dispatcher's, restricted to the offered rows.

    /// A transaction was appended to the log: an idle reader reads it soon.
    fn cdc_log_grew(&mut self) {
        let t = self.now + range(&mut self.crng, 1, 50);
        let Some(c) = self.cdc.as_deref_mut() else {
            return;
        };
        if !c.alive || c.log_lost || c.tick_at.is_some_and(|w| w <= t) {
            return;
        }
        c.tick_at = Some(t);
        let inc = c.inc;
        self.at(t, Ev::CdcTick { inc });
    }

    /// The reader's `ready.notify_one()`: wakes the publisher's dispatcher machine.
    fn cdc_notify(&mut self) {
        let Some(d) = self.cdc.as_ref().map(|c| c.d) else {
            return;
        };
        let di = d as usize;
        if !self.dispatchers[di].alive {
            return;
        }
        let t = self.now + 1;
        self.dispatchers[di].machine.handle_notify(t);
        if self.dispatchers[di].wake_at.is_none_or(|w| t < w) {
            self.dispatchers[di].wake_at = Some(t);
            let inc = self.dispatchers[di].inc;
            self.at(t, Ev::DispatchWake { d, inc });
        }
    }

    /// For the publisher's claim: where it comes from, by the core's [`ClaimSource`]
    /// (through `Protocol::cdc_choose`, as `LogScope::claim`; `None`: `d` is a polling
    /// dispatcher).
    fn cdc_choose(&mut self, d: u8, max: usize) -> Option<ClaimFrom> {
        let now = self.now;
        let c = self.cdc.as_deref_mut().filter(|c| c.d == d)?;
        Some(self.proto.cdc_choose(&c.source, now, &mut c.window, max))
    }

    /// `LogScope::claim`: the log's rows through the claim step (restricted to them), a
    /// scan of the claim index (the machine's own request; the source learns whether it
    /// found work), or nothing.
    fn cdc_claim(&mut self, d: u8, max: usize, from_position: u64, from: ClaimFrom) -> Claimed {
        let now = self.now;
        match from {
            ClaimFrom::Log(offered) => {
                let mut claimed = self.store_claim(d, max, 0, Some(&offered));
                // A claim of named rows says nothing about the scan position.
                claimed.last_position = None;
                claimed.ordered_from = None;
                let n = claimed.sends.len();
                self.stats.cdc.claimed_from_log += n as u64;
                self.note(|| format!("cdc claims {n} of {} offered row(s)", offered.len()));
                claimed
            }
            ClaimFrom::Nothing => Claimed {
                claim_started_ms: now,
                db_now_ms: now,
                sends: Vec::new(),
                last_position: None,
                ordered_from: None,
                horizon: None,
            },
            ClaimFrom::Scan => {
                self.stats.cdc.sweeps += 1;
                let claimed = self.store_claim(d, max, from_position, None);
                let found = !claimed.sends.is_empty() || claimed.last_position.is_some();
                let c = self.cdc.as_deref_mut().expect("the publisher's claim");
                c.source.scanned(now, found);
                claimed
            }
        }
    }

    /// What the state check finds for an offered row (a row that is not there has nothing
    /// to send).
    fn cdc_row_check(&self, k: RowKey) -> RowCheck {
        let seen = self.row_of(k.0, k.1).map(|r| {
            let row = &self.db.rows[r as usize];
            sealpost_core::cdc::Seen {
                phase: row.state.phase().code(),
                state: row.state.as_str(),
                lease_until_ms: row.claim.as_ref().map(|c| c.lease_until_ms),
            }
        });
        self.proto.cdc_check(seen, self.now)
    }

    /// One step of the log reader (`stream_once`): read what the window has room for, check
    /// the offered rows, confirm, report the position to the slot (now and then: it lags).
    fn cdc_tick(&mut self, inc: u32) {
        let now = self.now;
        let Some(c) = self.cdc.as_deref_mut() else {
            return;
        };
        if !c.alive || c.inc != inc || c.log_lost || c.tick_at.is_some_and(|t| t > now) {
            return;
        }
        c.tick_at = None;
        if c.stalled_until > now {
            let t = c.stalled_until;
            c.tick_at = Some(t);
            self.at(t, Ev::CdcTick { inc });
            return;
        }
        let (p_crash, p_write) = (c.p_crash, c.p_slot_write);
        let n = range(&mut self.crng, 1, 4) as usize;
        let keepalive = chance(&mut self.crng, 500);
        let crash = self.faults_on && chance(&mut self.crng, p_crash);
        let write = chance(&mut self.crng, p_write);
        let gap = range(&mut self.crng, 1, 20);
        // Read.
        let c = self.cdc.as_deref_mut().expect("checked");
        let log = &self.db.log;
        let (mut named, mut repeats, mut full_now) = (false, 0, false);
        for _ in 0..n {
            if !c.window.has_room() || c.read_at >= log.len() {
                break;
            }
            let t = &log[c.read_at];
            if t.end_lsn <= c.delivered_max {
                repeats += 1;
            }
            c.delivered_max = c.delivered_max.max(t.end_lsn);
            named |= !t.rows.is_empty();
            c.window.push(t.end_lsn, t.commit_ms, t.rows.clone());
            c.read_at += 1;
        }
        let behind = c.read_at < log.len();
        if behind && !c.window.has_room() {
            full_now = !c.full;
            c.full = true;
        } else {
            c.full = false;
        }
        if !behind && keepalive {
            c.window.idle_up_to(self.next_lsn);
        }
        self.stats.cdc.repeats += repeats;
        self.stats.cdc.window_full += u64::from(full_now);
        if named {
            self.cdc_notify();
        }
        if crash {
            // Killed between reading and checking.
            self.cdc_crash();
            return;
        }
        // Check the offered rows, confirm.
        let offered = self.cdc.as_deref().expect("checked").window.offered(1_000);
        let results: Vec<(RowKey, RowCheck)> = offered
            .iter()
            .map(|&k| (k, self.cdc_row_check(k)))
            .collect();
        let reopened = results.iter().any(|(_, r)| *r == RowCheck::Waiting);
        let c = self.cdc.as_deref_mut().expect("checked");
        if !results.is_empty() {
            c.window.checked(&results);
        }
        c.window.confirm();
        let confirmed = c.window.confirmed_lsn();
        let moved = write && c.slot.is_some_and(|s| s < confirmed);
        if moved {
            c.slot = Some(confirmed);
        }
        let log_len = self.db.log.len();
        let next = if c.read_at < log_len && c.window.has_room() {
            Some(now + gap)
        } else if c.read_at < log_len
            || c.window.figures().txns > 0
            || c.slot.is_some_and(|s| s < confirmed)
        {
            Some(now + c.check_every_ms)
        } else {
            None // idle until the log grows
        };
        c.tick_at = next;
        if moved {
            self.db_version += 1;
            self.stats.cdc.confirms += 1;
            self.note(|| format!("cdc slot confirmed at {confirmed}"));
        }
        if reopened {
            self.cdc_notify();
        }
        if let Some(t) = next {
            self.at(t, Ev::CdcTick { inc });
        }
    }

    /// The publisher dies (window and dispatcher machine lost, the slot kept), or only its
    /// replication stream breaks (the reader reconnects from the window's position; what it
    /// reads again the window ignores).
    fn cdc_crash(&mut self) {
        let stream_only = chance(&mut self.crng, 400);
        let backoff = range(&mut self.crng, 500, 8_000);
        let restart = range(&mut self.crng, 1_000, 30_000);
        let now = self.now;
        let Some(c) = self.cdc.as_deref_mut() else {
            return;
        };
        if !c.alive {
            return;
        }
        c.inc += 1;
        let inc = c.inc;
        if stream_only && !c.log_lost {
            let from = c.window.confirmed_lsn();
            c.read_at = self
                .db
                .log
                .iter()
                .position(|t| t.end_lsn > from)
                .unwrap_or(self.db.log.len());
            c.tick_at = Some(now + backoff);
            self.stats.cdc.reconnects += 1;
            self.at(now + backoff, Ev::CdcTick { inc });
            self.note(|| "cdc stream broken; reconnecting from the window's position".into());
            return;
        }
        c.alive = false;
        c.tick_at = None;
        let disp = &mut self.dispatchers[c.d as usize];
        disp.alive = false;
        disp.inc += 1;
        self.at(now + restart, Ev::CdcRestart);
        self.note(|| "cdc publisher killed".into());
    }

    /// The publisher starts: the slot is created at the log's end if it is missing; a new
    /// window from the slot's confirmed position; the first claims scan.
    fn cdc_restart(&mut self) {
        let (now, end) = (self.now, self.next_lsn);
        let Some(c) = self.cdc.as_deref_mut() else {
            return;
        };
        let created = c.slot.is_none();
        if created {
            c.slot = Some(end);
            c.slot_floor = end;
        }
        let slot = c.slot.unwrap_or(end);
        c.alive = true;
        c.inc += 1;
        c.window = LogWindow::new(slot, c.bytes_max);
        c.read_at = self
            .db
            .log
            .iter()
            .position(|t| t.end_lsn > slot)
            .unwrap_or(self.db.log.len());
        c.log_lost = false;
        c.source = ClaimSource::new(c.sweep_every_ms);
        c.full = false;
        c.stalled_until = 0;
        c.tick_at = Some(now);
        let (d, inc) = (c.d, c.inc);
        self.stats.cdc.restarts += 1;
        if created {
            self.db_version += 1;
        }
        self.note(|| format!("cdc publisher starts from {slot} (slot created: {created})"));
        self.restart_dispatcher(d);
        self.at(now, Ev::CdcTick { inc });
    }

    /// The slot is gone (dropped, invalidated, or not in a restored database): the reader
    /// ends, every claim of the publisher scans from now on.
    fn cdc_slot_lost(&mut self) {
        let Some(c) = self.cdc.as_deref_mut() else {
            return;
        };
        if c.slot.is_none() {
            return;
        }
        c.slot = None;
        c.log_lost = true;
        c.source.lose_log();
        c.inc += 1;
        c.tick_at = None;
        self.stats.cdc.slot_losses += 1;
        self.db_version += 1;
        self.note(|| "cdc slot lost".into());
        self.cdc_notify();
    }

    // ---------------------------------------------------------------- checkers

    fn check_rows(&mut self) {
        // R8: every registered attempt stays on record with its row.
        for k in 0..self.db.registered.len() {
            let (r, id) = self.db.registered[k];
            if !self.db.rows[r as usize].attempts.iter().any(|a| a.id == id) {
                self.violation_of(Violation::LostAttempts, r, || {
                    format!("row {r} no longer records its attempt {id}")
                });
            }
        }
        // Unknown episodes (G3) and traceability of every UNKNOWN.
        for i in 0..self.db.rows.len() {
            let row = &self.db.rows[i];
            let unknown = row.state.is_unknown();
            if unknown {
                let traceable = row
                    .attempts
                    .iter()
                    .any(|a| matches!(a.status, AttemptStatus::Unknown | AttemptStatus::Sending));
                if !traceable {
                    self.violation_of(Violation::UntraceableUnknowns, i as u32, || {
                        format!("row {i} unknown without an open attempt")
                    });
                }
                if self.unknown_since[i].is_none() {
                    self.unknown_since[i] = Some(self.now);
                }
            } else if let Some(since) = self.unknown_since[i] {
                self.unknown_since[i] = None;
                self.stats.unknown.record_ms(self.now - since);
            }
            // Divergence: accepted receipts carry the sealed digests.
            let row = &self.db.rows[i];
            if let Some(p) = &row.primary {
                let diverges = p.payload_digest != row.payload_digest
                    || p.destination_digest != row.destination_digest;
                // Lost: a PUBLISHED row whose primary names a position not holding it.
                let s = self.stream_index(&p.cluster, &p.stream) as usize;
                let held = self
                    .streams
                    .get(s)
                    .and_then(|st| st.msgs.get((p.sequence as usize).wrapping_sub(1)));
                let not_held =
                    !held.is_some_and(|m| m.event_id == row.event_id && m.member == row.member);
                if held.is_some_and(|m| m.forged) {
                    self.violation_of(Violation::ForgedCopyAdopted, i as u32, || {
                        format!("row {i}'s primary receipt points at a forged copy")
                    });
                }
                if diverges {
                    self.violation_of(Violation::DivergentPayloads, i as u32, || {
                        format!("row {i} primary receipt diverges from the envelope")
                    });
                }
                if not_held {
                    self.violation_of(Violation::LostEvents, i as u32, || {
                        format!("row {i} published at a position that does not hold it")
                    });
                }
            }
        }
        // Lost: a committed business fact without its envelope rows (R4).
        for k in 0..self.db.business.len() {
            let f = self.db.business[k];
            let n = self.db.row_fact.iter().filter(|rf| **rf == f).count();
            if n != usize::from(self.facts[f as usize].members) {
                self.violation_of(Violation::LostEvents, 1_000_000 + f, || {
                    format!("fact {f} committed without its envelope")
                });
            }
        }
        // Lost: an accepted receipt vanished from the store.
        let mut vanished = 0;
        for &(r, s, seq, a) in &self.accepted {
            let row = &self.db.rows[r as usize];
            let in_primary = row.primary.as_ref().is_some_and(|p| {
                p.sequence == seq
                    && p.attempt_id == a
                    && self.stream_index(&p.cluster, &p.stream) == s
            });
            let in_dups = self
                .db
                .duplicates
                .iter()
                .any(|(dr, d)| *dr == r && d.sequence == seq && d.attempt_id == a);
            if !in_primary && !in_dups {
                vanished += 1;
            }
        }
        if vanished > 0 {
            self.accepted.retain(|_| false);
            self.violation(Violation::LostEvents, || {
                format!("{vanished} accepted receipt(s) vanished from the store")
            });
        }
        self.check_cdc();
        self.check_sets();
    }

    /// The member states of delivery set `k` (the first `members` entries).
    fn set_states(&self, k: usize) -> ([State; MEMBERS_MAX], usize) {
        let mut states = [State::Pending; MEMBERS_MAX];
        let rows = &self.db.sets[k].rows;
        for (s, &r) in states.iter_mut().zip(rows) {
            *s = self.db.rows[r as usize].state;
        }
        (states, rows.len())
    }

    /// R16: every committed delivery set's status, as the protocol reports it
    /// (`delivery_set::set_status`), against the brokers: a set reported complete has at
    /// least as many members genuinely stored at their destinations as its rule needs; a
    /// set reported blocked has quarantined members, and too many for the rule.
    fn check_sets(&mut self) {
        for k in 0..self.db.sets.len() {
            let (states, n) = self.set_states(k);
            let states = &states[..n];
            let (fact, rule) = (self.db.sets[k].fact, self.db.sets[k].rule);
            let needed = rule.needed(n as u16);
            match self.proto.set_status(states, rule) {
                SetStatus::Complete => {
                    let held = self.db.sets[k]
                        .rows
                        .iter()
                        .filter(|&&r| {
                            let row = &self.db.rows[r as usize];
                            let s = self.stream_of(&row.destination);
                            self.genuine_held(s, row.event_id, row.member)
                        })
                        .count() as u16;
                    if held < needed {
                        let eid = self.facts[fact as usize].event_id;
                        self.violation_of(Violation::SetCompletedEarly, fact, || {
                            format!(
                                "set {eid} (rule {}) reported complete with {held} of {n} \
                                 members held at their brokers, {needed} needed; states {states:?}",
                                rule.name()
                            )
                        });
                    }
                }
                SetStatus::Blocked => {
                    let parked = states.iter().filter(|s| **s == State::Quarantined).count();
                    if parked == 0 || n - parked >= usize::from(needed) {
                        let eid = self.facts[fact as usize].event_id;
                        self.violation_of(Violation::Liveness, 9_000_000 + fact, || {
                            format!(
                                "set {eid} (rule {}) reported blocked with {parked} of {n} \
                                 members quarantined; states {states:?}",
                                rule.name()
                            )
                        });
                    }
                }
                SetStatus::InProgress { .. } => {}
            }
        }
    }

    /// CDC: the slot's confirmed position never passes a row its log named that has not
    /// left the dispatchable phase (a row that left it once and came back, by a reconciler's
    /// retry or an operator's release, is the scans' work).
    fn check_cdc(&mut self) {
        let Some(c) = self.cdc.as_deref() else {
            return;
        };
        let (floor, Some(slot)) = (c.slot_floor, c.slot) else {
            return;
        };
        let n = self.db.rows.len();
        self.cdc_left.resize(n, false);
        for i in 0..n {
            if self.db.rows[i].state.phase() != Phase::Dispatchable {
                self.cdc_left[i] = true;
                continue;
            }
            let lsn = self.db.row_lsn[i];
            if !self.cdc_left[i] && lsn > floor && lsn <= slot {
                let st = self.db.rows[i].state;
                self.violation_of(Violation::CdcConfirmedUnsettled, i as u32, || {
                    format!("slot confirmed at {slot} past row {i} (at {lsn}), still {st}")
                });
            }
        }
    }

    fn quiescent(&self) -> bool {
        let rows_done = self.db.rows.iter().all(|r| r.state == State::Purged);
        let facts_done = self.facts.iter().all(|f| f.committed);
        let consumers_done = self.consumers.iter().all(|c| {
            c.alive
                && c.watermark
                    .iter()
                    .zip(&self.streams)
                    .all(|(w, s)| *w == s.msgs.len() as u64)
        });
        rows_done && facts_done && consumers_done
    }

    fn finish(&mut self) {
        // Liveness: once faults stop, every committed event is published and every critical
        // consumer applied it exactly once.
        for i in 0..self.db.rows.len() {
            let row = &self.db.rows[i];
            if row.state == State::Quarantined && self.conflicts.contains(&(i as u32)) {
                // Parked with its evidence for an operator (R28: a manual exit), not lost.
                self.stats.conflicts_parked += 1;
                let s = self.stream_of(&row.destination);
                if self.forged_on(s, row.event_id, row.member) {
                    self.stats.unsealed_parked += 1;
                }
                continue;
            }
            if self.behind_conflict(i) {
                // Ordered behind a parked conflict: it waits with it (R29), not lost.
                self.stats.conflicts_parked += 1;
                continue;
            }
            if !row.state.is_published() {
                let st = row.state;
                // R25: who may claim it now, and whether a dispatcher of that implementation
                // serves its cluster (the sim gives every implementation one that serves all).
                let facts = self.claim_facts(i);
                let claimants: Vec<String> = (0..IMPLEMENTATIONS.len() as u8)
                    .filter(|&k| {
                        let check = AliasCheck {
                            implementation: implementation(k),
                            aliases: &self.db.aliases,
                        };
                        rollout::may_claim(check, &row.destination, facts).is_ok()
                    })
                    .map(|k| {
                        let serving = self.dispatchers.iter().any(|d| {
                            d.implementation == k && d.clusters.contains(&row.destination.cluster)
                        });
                        format!("{} (serving: {serving})", IMPLEMENTATIONS[usize::from(k)])
                    })
                    .collect();
                self.violation(Violation::Liveness, || {
                    format!("row {i} ended {st}; may claim it: {claimants:?}")
                });
                continue;
            }
            let eid = row.event_id;
            for c in 0..self.consumers.len() {
                let n = self.consumers[c]
                    .effects
                    .iter()
                    .find(|(e, _)| *e == eid)
                    .map_or(0, |(_, n)| *n);
                if n == 0 && self.behind_lost(eid) {
                    self.stats.ordering_gaps_parked += 1;
                    continue;
                }
                if n == 0 && self.consumers[c].dead_letters.contains(&eid) {
                    // Dead-lettered with its record: the consumer owner's manual exit.
                    continue;
                }
                if n == 0 && self.behind_dead_letter(c, eid) {
                    // An ordered consumer holds the later versions of an aggregate whose
                    // earlier version it dead-lettered, until the owner resolves that dead
                    // letter (the same exit): waiting, not lost.
                    self.stats.ordering_gaps_parked += 1;
                    continue;
                }
                if n != 1 {
                    self.violation(Violation::Liveness, || {
                        format!("consumer {c} applied {eid} {n} times")
                    });
                }
            }
        }
        for i in 0..self.refusals.len() {
            let (refused, quarantined) = self.refusals[i];
            if refused > REFUSALS_UNQUARANTINED_MAX && !quarantined {
                self.violation(Violation::Liveness, || {
                    format!("row {i} was refused {refused} times and never quarantined")
                });
            }
        }
        for (i, since) in self.unknown_since.iter().enumerate() {
            if let Some(since) = since {
                if self.db.rows.get(i).is_some_and(|r| r.state.is_unknown()) {
                    let _ = since;
                    self.stats.unknown.unresolved += 1;
                }
            }
        }
        if self.facts.iter().any(|f| !f.committed) {
            self.stats.violations.add(Violation::Liveness);
        }
        self.finish_sets();
    }

    /// R16 at the end: every committed set whose members are all published is complete, and
    /// a set that is not complete waits for a member parked for an operator (a conflict, or
    /// ordered behind one): the exits the row check above excuses.
    fn finish_sets(&mut self) {
        for k in 0..self.db.sets.len() {
            let (states, n) = self.set_states(k);
            let states = &states[..n];
            let (fact, rule) = (self.db.sets[k].fact, self.db.sets[k].rule);
            let status = self.proto.set_status(states, rule);
            self.stats.sets += 1;
            match status {
                SetStatus::Complete => {
                    self.stats.sets_complete += 1;
                    continue;
                }
                SetStatus::Blocked => self.stats.sets_blocked += 1,
                SetStatus::InProgress { .. } => {}
            }
            let eid = self.facts[fact as usize].event_id;
            if states.iter().all(|s| s.is_published()) {
                self.violation_of(Violation::Liveness, 9_100_000 + fact, || {
                    format!(
                        "set {eid} (rule {}) ended {} with every member published",
                        rule.name(),
                        status.name()
                    )
                });
                continue;
            }
            let waits = self.db.sets[k].rows.iter().any(|&r| {
                (self.db.rows[r as usize].state == State::Quarantined
                    && self.conflicts.contains(&r))
                    || self.behind_conflict(r as usize)
            });
            if !waits {
                self.violation_of(Violation::Liveness, 9_100_000 + fact, || {
                    format!(
                        "set {eid} (rule {}) ended {} with no member parked for an operator; \
                         states {states:?}",
                        rule.name(),
                        status.name()
                    )
                });
            }
        }
    }
}
