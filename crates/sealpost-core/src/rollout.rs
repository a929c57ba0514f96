//! Rollout of a new dispatcher implementation (R25): which implementation may claim which
//! rows of a route, and how that *alias* moves.
//!
//! Every dispatcher announces an [`Implementation`]: an id and the protocol versions it
//! speaks. A route with a rollout record has an [`Alias`]: the incumbent implementation, an
//! optional candidate, the [`Stage`] and a generation that every switch raises. The stages
//! follow the seed's rollout (and LaunchDarkly's migration stages):
//!
//! * [`Stage::Incumbent`]: the incumbent claims every row (also the state after a rollback);
//! * [`Stage::Shadow`]: the incumbent still claims every row; the candidate claims nothing;
//! * [`Stage::Takeover`]: the candidate claims the rows of the listed event types whose
//!   aggregate falls in the first `share` percent ([`share_bucket`]); the incumbent the rest;
//! * [`Stage::Promoted`]: the candidate claims every row; the incumbent is kept as the
//!   rollback target.
//!
//! A rollback switches the alias back to the incumbent and changes nothing else: rows
//! already sent under the candidate converge into their publish slot like any send.
//!
//! The claim reads the alias in its own transaction (the store locks the rollout table
//! against a concurrent switch), so a claim never starts a send under an alias that was
//! already switched away from its implementation: the alias generation fences claims the
//! way a claim generation fences writes. [`may_claim`] is the rule the claim step checks
//! for every picked row; [`slices`] is the same rule as the store's SQL filter takes it.

use crate::envelope::Destination;
use sha2::{Digest as _, Sha256};
use std::fmt;

/// The protocol version of the rows this build writes: what a dispatcher must understand
/// to send one (the sealed envelope, the frozen destination, attempt generations and the
/// shared publish slot). A later build that changes any of it writes a higher version.
///
/// Version 2 (migration 12): the first claim of a row may live in a batch lease instead of
/// the row ([`crate::lease`]); a dispatcher that does not know leases would read such a row
/// as never claimed, so it must not claim rows of version 2.
pub const PROTOCOL_VERSION: u16 = 2;

/// The lowest row protocol this build can send.
pub const PROTOCOL_MIN: u16 = 1;

/// The longest implementation id.
pub const ID_MAX: usize = 64;

/// A dispatcher implementation as it announces itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Implementation {
    /// The implementation id (`[A-Za-z0-9._-]`, at most [`ID_MAX`] bytes).
    pub id: String,
    /// The lowest row protocol it sends.
    pub protocol_min: u16,
    /// The highest row protocol it sends.
    pub protocol_max: u16,
}

impl Implementation {
    /// The implementation id of this build when none is configured: `sealpost-<version>`.
    pub fn default_id(version: &str) -> String {
        format!("sealpost-{version}")
    }

    /// An implementation named `id` that speaks what this build speaks.
    pub fn new(id: &str) -> Result<Implementation, RolloutError> {
        check_id(id)?;
        Ok(Implementation {
            id: id.to_string(),
            protocol_min: PROTOCOL_MIN,
            protocol_max: PROTOCOL_VERSION,
        })
    }

    /// This build under its default id ([`Implementation::default_id`] of the crate
    /// version): what a dispatcher announces when no implementation id is configured.
    pub fn this_build() -> &'static Implementation {
        static THIS: std::sync::OnceLock<Implementation> = std::sync::OnceLock::new();
        THIS.get_or_init(|| Implementation {
            id: Implementation::default_id(env!("CARGO_PKG_VERSION")),
            protocol_min: PROTOCOL_MIN,
            protocol_max: PROTOCOL_VERSION,
        })
    }

    /// Does it send rows written under `protocol`?
    pub fn speaks(&self, protocol: u16) -> bool {
        (self.protocol_min..=self.protocol_max).contains(&protocol)
    }
}

/// Refuses an implementation id that is empty, too long, or holds anything but ASCII
/// letters, digits, `.`, `_` and `-` (ids appear in logs, the page and SQL parameters).
pub fn check_id(id: &str) -> Result<(), RolloutError> {
    let ok = !id.is_empty()
        && id.len() <= ID_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(RolloutError::BadId(id.escape_debug().to_string()))
    }
}

/// Where a route's rollout stands (serialized as its [`Stage::name`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// The incumbent claims every row.
    Incumbent,
    /// The incumbent claims every row; the candidate claims nothing.
    Shadow,
    /// The candidate claims a share of the listed types; the incumbent the rest.
    Takeover,
    /// The candidate claims every row; the incumbent is the rollback target.
    Promoted,
}

impl Stage {
    /// Every stage.
    pub const ALL: [Stage; 4] = [
        Stage::Incumbent,
        Stage::Shadow,
        Stage::Takeover,
        Stage::Promoted,
    ];

    /// The stored name.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Incumbent => "incumbent",
            Stage::Shadow => "shadow",
            Stage::Takeover => "takeover",
            Stage::Promoted => "promoted",
        }
    }

    /// The stage a stored name names.
    pub fn parse(s: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|st| st.name() == s)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a rollout command was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RolloutError {
    /// An implementation id that is not one.
    #[error("implementation id \"{0}\" is not valid: use 1 to 64 ASCII letters, digits, '.', '_' or '-'")]
    BadId(String),
    /// The candidate is the implementation already claiming.
    #[error("\"{0}\" already claims this route: a candidate must be another implementation")]
    CandidateIsIncumbent(String),
    /// Another candidate's rollout is under way.
    #[error("the route is rolling out \"{current}\" ({stage}); roll it back or promote it before starting \"{asked}\"")]
    OtherCandidate {
        /// The candidate under way.
        current: String,
        /// Its stage.
        stage: Stage,
        /// The candidate asked for.
        asked: String,
    },
    /// A takeover of a candidate that was never shadowed.
    #[error("\"{0}\" has not run in shadow on this route: run `sealpost rollout shadow` first")]
    NotShadowed(String),
    /// A takeover without event types.
    #[error("a takeover names at least one event type (--types)")]
    NoTypes,
    /// A share outside 1..=100.
    #[error("share {0} is not a percentage from 1 to 100")]
    BadShare(u32),
    /// A promotion before a takeover.
    #[error("nothing to promote: the route is at stage {0}; promote follows a takeover")]
    NothingToPromote(Stage),
}

/// A route's alias: who claims its rows. The record the store keeps per route (its columns
/// are these fields' names, so `sealpost.rollout_aliases()`'s JSON deserializes into it).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Alias {
    /// The route name.
    pub route: String,
    /// The destination cluster of the route's rows.
    pub cluster: String,
    /// The destination topic (stream, exchange) of the route's rows.
    pub topic: String,
    /// The implementation that claims unless the stage says otherwise.
    pub incumbent: String,
    /// The implementation being rolled out, if any.
    pub candidate: Option<String>,
    /// The stage.
    pub stage: Stage,
    /// The event types a takeover covers.
    pub types: Vec<String>,
    /// The percentage of aggregates a takeover covers (1..=100).
    pub share: u8,
    /// Raised by every switch.
    pub generation: u64,
}

/// What a rollout command did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Switch {
    /// The alias moved: the new record, generation raised by one.
    To(Alias),
    /// The alias already was what the command asks (the command is idempotent).
    Unchanged,
}

impl Alias {
    /// The record of a route before any rollout, for its destination's `cluster` and
    /// `topic`: `incumbent` claims every row.
    pub fn new(route: &str, cluster: &str, topic: &str, incumbent: &str) -> Alias {
        Alias {
            route: route.to_string(),
            cluster: cluster.to_string(),
            topic: topic.to_string(),
            incumbent: incumbent.to_string(),
            candidate: None,
            stage: Stage::Incumbent,
            types: Vec::new(),
            share: 100,
            generation: 0,
        }
    }

    /// Is `destination` this route's (cluster and topic)?
    pub fn covers(&self, destination: &Destination) -> bool {
        self.cluster == destination.cluster && self.topic == destination.topic
    }

    /// Is a row of `event_type` in aggregate bucket `bucket` in the takeover's share?
    pub fn in_share(&self, event_type: &str, bucket: u8) -> bool {
        self.types.iter().any(|t| t == event_type) && bucket < self.share
    }

    /// The implementation that claims a row of `event_type` whose aggregate falls in
    /// `bucket` ([`share_bucket`]).
    pub fn claimant(&self, event_type: &str, bucket: u8) -> &str {
        let candidate = self.candidate.as_deref().unwrap_or(&self.incumbent);
        match self.stage {
            Stage::Incumbent | Stage::Shadow => &self.incumbent,
            Stage::Takeover if self.in_share(event_type, bucket) => candidate,
            Stage::Takeover => &self.incumbent,
            Stage::Promoted => candidate,
        }
    }

    fn switched(&self, f: impl FnOnce(&mut Alias)) -> Switch {
        let mut next = self.clone();
        f(&mut next);
        if next == *self {
            return Switch::Unchanged;
        }
        next.generation = self.generation + 1;
        Switch::To(next)
    }

    /// `sealpost rollout shadow`: `candidate` runs beside the incumbent and claims nothing.
    /// After a promotion the promoted implementation becomes the incumbent first.
    pub fn shadow(&self, candidate: &str) -> Result<Switch, RolloutError> {
        check_id(candidate)?;
        let incumbent = match (self.stage, &self.candidate) {
            (Stage::Promoted, Some(c)) => c.clone(),
            _ => self.incumbent.clone(),
        };
        if candidate == incumbent {
            return Err(RolloutError::CandidateIsIncumbent(incumbent));
        }
        if let (Stage::Shadow | Stage::Takeover, Some(c)) = (self.stage, &self.candidate) {
            if c != candidate {
                return Err(RolloutError::OtherCandidate {
                    current: c.clone(),
                    stage: self.stage,
                    asked: candidate.to_string(),
                });
            }
            if self.stage == Stage::Takeover {
                // Back from a takeover to shadow: the candidate stops claiming.
                return Ok(self.switched(|a| {
                    a.stage = Stage::Shadow;
                    a.types.clear();
                    a.share = 100;
                }));
            }
            return Ok(Switch::Unchanged);
        }
        Ok(self.switched(|a| {
            a.incumbent = incumbent;
            a.candidate = Some(candidate.to_string());
            a.stage = Stage::Shadow;
            a.types.clear();
            a.share = 100;
        }))
    }

    /// `sealpost rollout takeover`: the shadowed `candidate` claims the rows of `types`
    /// whose aggregate is in the first `share` percent. Repeating it changes the types or
    /// the share.
    pub fn takeover(
        &self,
        candidate: &str,
        types: &[String],
        share: u32,
    ) -> Result<Switch, RolloutError> {
        check_id(candidate)?;
        if types.is_empty() {
            return Err(RolloutError::NoTypes);
        }
        if !(1..=100).contains(&share) {
            return Err(RolloutError::BadShare(share));
        }
        match (self.stage, &self.candidate) {
            (Stage::Shadow | Stage::Takeover, Some(c)) if c == candidate => {}
            (Stage::Shadow | Stage::Takeover, Some(c)) => {
                return Err(RolloutError::OtherCandidate {
                    current: c.clone(),
                    stage: self.stage,
                    asked: candidate.to_string(),
                })
            }
            _ => return Err(RolloutError::NotShadowed(candidate.to_string())),
        }
        let mut types = types.to_vec();
        types.sort();
        types.dedup();
        Ok(self.switched(|a| {
            a.stage = Stage::Takeover;
            a.types = types;
            a.share = share as u8;
        }))
    }

    /// `sealpost rollout promote`: the candidate claims every row.
    pub fn promote(&self) -> Result<Switch, RolloutError> {
        match self.stage {
            Stage::Takeover => Ok(self.switched(|a| a.stage = Stage::Promoted)),
            Stage::Promoted => Ok(Switch::Unchanged),
            s => Err(RolloutError::NothingToPromote(s)),
        }
    }

    /// `sealpost rollout rollback`: the incumbent claims every row again. Nothing else
    /// changes; what the candidate sent converges into the publish slot.
    pub fn rollback(&self) -> Switch {
        self.switched(|a| {
            a.stage = Stage::Incumbent;
            a.candidate = None;
            a.types.clear();
            a.share = 100;
        })
    }
}

/// The share bucket (0..=99) of an aggregate: the first 28 bits of
/// SHA-256(`aggregate_type` `/` `aggregate_id`), modulo 100. Every event of an aggregate
/// falls in the same bucket, so a takeover moves whole aggregates. (The store's claim filter
/// computes the same in SQL; the claim step checks every row it picked against this one.)
pub fn share_bucket(aggregate_type: &str, aggregate_id: &str) -> u8 {
    let mut h = Sha256::new();
    h.update(aggregate_type.as_bytes());
    h.update(b"/");
    h.update(aggregate_id.as_bytes());
    let d = h.finalize();
    let first = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) >> 4;
    (first % 100) as u8
}

/// What a claim reads beside a row to apply the alias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimFacts<'a> {
    /// The event type.
    pub event_type: &'a str,
    /// The aggregate's [`share_bucket`].
    pub share_bucket: u8,
    /// The protocol version the row was written under.
    pub protocol: u16,
}

impl ClaimFacts<'_> {
    /// Facts of a row written by this build, outside any takeover's types.
    pub const PLAIN: ClaimFacts<'static> = ClaimFacts {
        event_type: "",
        share_bucket: 0,
        protocol: PROTOCOL_VERSION,
    };
}

/// The alias as a claim applies it: the claiming implementation and the aliases read in
/// the claim's transaction.
#[derive(Clone, Copy, Debug)]
pub struct AliasCheck<'a> {
    /// The claiming implementation.
    pub implementation: &'a Implementation,
    /// Every rollout record.
    pub aliases: &'a [Alias],
}

/// Why a claim may not take a row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotMine {
    /// The implementation does not speak the row's protocol.
    Protocol(u16),
    /// The alias gives the row to another implementation.
    Alias {
        /// The route.
        route: String,
        /// Who claims it.
        claimant: String,
        /// The alias generation.
        generation: u64,
    },
}

/// May `check.implementation` claim a row bound for `destination` with `facts`? It must
/// speak the row's protocol, and a route whose alias covers the destination must name it
/// as the claimant. A destination without a rollout record is claimed by any
/// implementation (as before rollouts existed).
pub fn may_claim(
    check: AliasCheck<'_>,
    destination: &Destination,
    facts: ClaimFacts<'_>,
) -> Result<(), NotMine> {
    if !check.implementation.speaks(facts.protocol) {
        return Err(NotMine::Protocol(facts.protocol));
    }
    for a in check.aliases.iter().filter(|a| a.covers(destination)) {
        let claimant = a.claimant(facts.event_type, facts.share_bucket);
        if claimant != check.implementation.id {
            return Err(NotMine::Alias {
                route: a.route.clone(),
                claimant: claimant.to_string(),
                generation: a.generation,
            });
        }
    }
    Ok(())
}

/// Which rows of one destination an implementation claims, as the store's SQL filter
/// takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Side {
    /// None of them.
    Nothing,
    /// Those of `types` whose bucket is below `share`.
    Within {
        /// Event types.
        types: Vec<String>,
        /// Buckets below this.
        share: u8,
    },
    /// All but those of `types` whose bucket is below `share`.
    Outside {
        /// Event types.
        types: Vec<String>,
        /// Buckets below this.
        share: u8,
    },
}

impl Side {
    /// The filter's reading: does this side take a row of `event_type` in `bucket`?
    pub fn takes(&self, event_type: &str, bucket: u8) -> bool {
        let within =
            |types: &[String], share: u8| types.iter().any(|t| t == event_type) && bucket < share;
        match self {
            Side::Nothing => false,
            Side::Within { types, share } => within(types, *share),
            Side::Outside { types, share } => !within(types, *share),
        }
    }

    /// The stored name of the side (`nothing`, `within`, `outside`).
    pub fn name(&self) -> &'static str {
        match self {
            Side::Nothing => "nothing",
            Side::Within { .. } => "within",
            Side::Outside { .. } => "outside",
        }
    }
}

/// A destination whose rows an implementation claims only in part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    /// Cluster.
    pub cluster: String,
    /// Topic.
    pub topic: String,
    /// What it takes there.
    pub side: Side,
}

/// The alias as the claim's SQL filter takes it: for every destination with a rollout
/// record where `implementation` does not claim every row, what it does claim. (Where it
/// claims everything there is no slice; the protocol range is a separate filter.)
pub fn slices(aliases: &[Alias], implementation: &Implementation) -> Vec<Slice> {
    let me = implementation.id.as_str();
    let mut out = Vec::new();
    for a in aliases {
        // As `claimant` reads a record without a candidate: the incumbent stands in.
        let candidate = a.candidate.as_deref().unwrap_or(&a.incumbent);
        let (cand, inc) = (candidate == me, a.incumbent == me);
        let side = match a.stage {
            Stage::Incumbent | Stage::Shadow if inc => continue,
            Stage::Promoted if cand => continue,
            Stage::Takeover if cand && inc => continue,
            Stage::Takeover if cand => Side::Within {
                types: a.types.clone(),
                share: a.share,
            },
            Stage::Takeover if inc => Side::Outside {
                types: a.types.clone(),
                share: a.share,
            },
            _ => Side::Nothing,
        };
        out.push(Slice {
            cluster: a.cluster.clone(),
            topic: a.topic.clone(),
            side,
        });
    }
    out
}

/// What a shadow compares ([`shadow_compare`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DivergenceKind {
    /// The destination digest the message carries is not the one the candidate computes
    /// from the frozen destination.
    DestinationDigest,
    /// The payload digest differs from the sealed one.
    PayloadDigest,
    /// The envelope generation differs.
    EnvelopeGeneration,
    /// An envelope header differs (or is missing).
    Headers,
    /// The incumbent stored a version of an aggregate before an earlier one, on a
    /// destination that keeps per-aggregate order: the candidate would have waited (R29).
    Ordering,
}

impl DivergenceKind {
    /// Every kind.
    pub const ALL: [DivergenceKind; 5] = [
        DivergenceKind::DestinationDigest,
        DivergenceKind::PayloadDigest,
        DivergenceKind::EnvelopeGeneration,
        DivergenceKind::Headers,
        DivergenceKind::Ordering,
    ];

    /// The stored name.
    pub fn name(self) -> &'static str {
        match self {
            DivergenceKind::DestinationDigest => "destination_digest",
            DivergenceKind::PayloadDigest => "payload_digest",
            DivergenceKind::EnvelopeGeneration => "envelope_generation",
            DivergenceKind::Headers => "headers",
            DivergenceKind::Ordering => "ordering",
        }
    }

    /// The kind a stored name names.
    pub fn parse(s: &str) -> Option<DivergenceKind> {
        DivergenceKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// One difference between what the incumbent sent and what the candidate would have sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// What differs.
    pub kind: DivergenceKind,
    /// The incumbent's value (as stored at the broker).
    pub incumbent: String,
    /// The candidate's value.
    pub candidate: String,
}

/// The envelope headers of a copy, as the adapter read them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeenHeaders<'a> {
    /// Read and well formed.
    Read(&'a crate::port::WireEnvelope),
    /// The adapter reads headers, and this copy's are missing or malformed: a divergence.
    Missing,
    /// The adapter does not read headers back: only the digests are compared.
    NotRead,
}

/// What the shadow read of one message the incumbent published.
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    /// The stored copy's receipt (the digests and generation the message carries).
    pub receipt: &'a crate::receipt::Receipt,
    /// The envelope headers the copy carries.
    pub headers: SeenHeaders<'a>,
    /// An earlier version of the aggregate, bound for the same destination, was stored
    /// after this message (or is not stored yet): the incumbent did not wait for it.
    pub earlier_stored_later: bool,
}

/// The shadow's comparison (R25): what the candidate would have sent for `row` (its
/// envelope description `envelope`), decided by this build's code, against what the
/// incumbent's message carries. Empty: they match.
pub fn shadow_compare(
    row: &crate::row::EventRow,
    envelope: &crate::port::WireEnvelope,
    observed: Observed<'_>,
) -> Vec<Divergence> {
    let mut out = Vec::new();
    let mut differ = |kind, incumbent: String, candidate: String| {
        if incumbent != candidate {
            out.push(Divergence {
                kind,
                incumbent,
                candidate,
            });
        }
    };
    let r = observed.receipt;
    differ(
        DivergenceKind::DestinationDigest,
        r.destination_digest.to_prefixed_hex(),
        row.destination.digest().to_prefixed_hex(),
    );
    differ(
        DivergenceKind::PayloadDigest,
        r.payload_digest.to_prefixed_hex(),
        row.payload_digest.to_prefixed_hex(),
    );
    differ(
        DivergenceKind::EnvelopeGeneration,
        r.envelope_generation.to_string(),
        row.envelope_generation.to_string(),
    );
    match observed.headers {
        SeenHeaders::Read(h) => {
            for ((name, theirs), (_, ours)) in h.headers().into_iter().zip(envelope.headers()) {
                differ(
                    DivergenceKind::Headers,
                    format!("{name}: {theirs}"),
                    format!("{name}: {ours}"),
                );
            }
        }
        SeenHeaders::Missing => differ(
            DivergenceKind::Headers,
            "no well-formed Sealpost-* envelope headers".to_string(),
            "the seven Sealpost-* envelope headers".to_string(),
        ),
        SeenHeaders::NotRead => {}
    }
    if row.destination.ordering == crate::envelope::EventOrdering::PerAggregate
        && observed.earlier_stored_later
    {
        differ(
            DivergenceKind::Ordering,
            format!(
                "sent version {} before an earlier one",
                envelope.aggregate_version
            ),
            "waits for the earlier version".to_string(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EventOrdering, PartitionAlgorithm};

    fn dest(cluster: &str, topic: &str) -> Destination {
        Destination {
            cluster: cluster.into(),
            topic: topic.into(),
            routing_key: "k".into(),
            partition_algorithm: PartitionAlgorithm::None,
            route_policy_generation: 1,
            serializer: "json.v1".into(),
            durability: "file".into(),
            required_ack: "stream".into(),
            ordering: EventOrdering::Unordered,
        }
    }

    fn imp(id: &str) -> Implementation {
        Implementation::new(id).unwrap()
    }

    fn switched(s: Result<Switch, RolloutError>) -> Alias {
        match s.unwrap() {
            Switch::To(a) => a,
            Switch::Unchanged => panic!("expected a switch"),
        }
    }

    fn every_stage() -> Vec<Alias> {
        let a0 = Alias::new("orders", "c", "t", "old");
        let shadow = switched(a0.shadow("new"));
        let takeover = switched(shadow.takeover("new", &["order.created".into()], 30));
        let promoted = switched(takeover.promote());
        let back = match promoted.rollback() {
            Switch::To(a) => a,
            Switch::Unchanged => panic!(),
        };
        vec![a0, shadow, takeover, promoted, back]
    }

    #[test]
    fn the_stages_move_the_claimant_and_raise_the_generation() {
        let v = every_stage();
        let gens: Vec<u64> = v.iter().map(|a| a.generation).collect();
        assert_eq!(gens, vec![0, 1, 2, 3, 4]);
        let who = |a: &Alias, t: &str, b: u8| a.claimant(t, b).to_string();
        assert_eq!(who(&v[0], "order.created", 0), "old");
        assert_eq!(
            who(&v[1], "order.created", 0),
            "old",
            "shadow claims nothing"
        );
        assert_eq!(who(&v[2], "order.created", 29), "new");
        assert_eq!(who(&v[2], "order.created", 30), "old");
        assert_eq!(who(&v[2], "order.paid", 0), "old");
        assert_eq!(who(&v[3], "order.paid", 99), "new");
        assert_eq!(who(&v[4], "order.created", 0), "old", "rollback");
        assert_eq!(v[4].candidate, None);
    }

    #[test]
    fn commands_refuse_what_the_seed_forbids_and_repeat_idempotently() {
        let v = every_stage();
        let (a0, shadow, takeover) = (&v[0], &v[1], &v[2]);
        assert_eq!(
            a0.shadow("old"),
            Err(RolloutError::CandidateIsIncumbent("old".into()))
        );
        assert!(matches!(
            a0.takeover("new", &["x".into()], 5),
            Err(RolloutError::NotShadowed(_))
        ));
        assert_eq!(
            a0.promote(),
            Err(RolloutError::NothingToPromote(Stage::Incumbent))
        );
        assert_eq!(
            shadow.promote(),
            Err(RolloutError::NothingToPromote(Stage::Shadow))
        );
        assert!(matches!(
            shadow.shadow("other"),
            Err(RolloutError::OtherCandidate { .. })
        ));
        assert!(matches!(
            takeover.takeover("other", &["x".into()], 5),
            Err(RolloutError::OtherCandidate { .. })
        ));
        assert_eq!(shadow.shadow("new"), Ok(Switch::Unchanged));
        assert_eq!(
            takeover.takeover("new", &["order.created".into()], 30),
            Ok(Switch::Unchanged)
        );
        assert_eq!(shadow.takeover("new", &[], 5), Err(RolloutError::NoTypes));
        assert_eq!(
            shadow.takeover("new", &["x".into()], 0),
            Err(RolloutError::BadShare(0))
        );
        assert_eq!(
            shadow.takeover("new", &["x".into()], 101),
            Err(RolloutError::BadShare(101))
        );
        assert_eq!(a0.rollback(), Switch::Unchanged);
        // Back to shadow from a takeover.
        let back = switched(takeover.shadow("new"));
        assert_eq!(back.stage, Stage::Shadow);
        assert_eq!(back.claimant("order.created", 0), "old");
        // After a promotion the next rollout starts from the promoted implementation.
        let next = switched(v[3].shadow("newer"));
        assert_eq!(next.incumbent, "new");
        assert_eq!(next.claimant("order.created", 0), "new");
        assert_eq!(
            v[3].shadow("new"),
            Err(RolloutError::CandidateIsIncumbent("new".into()))
        );
        for bad in ["", "a b", "x\ny", &"x".repeat(65), "é"] {
            assert!(
                matches!(check_id(bad), Err(RolloutError::BadId(_))),
                "{bad:?}"
            );
        }
        assert!(check_id("sealpost-0.1.0_rc.1").is_ok());
    }

    #[test]
    fn the_sql_slices_take_exactly_what_may_claim_allows() {
        let mut aliases = every_stage();
        // Each on its own destination so they do not overlap.
        for (i, a) in aliases.iter_mut().enumerate() {
            a.topic = format!("t{i}");
        }
        aliases.push({
            let mut a = Alias::new("other", "c", "solo", "old");
            a.topic = "solo".into();
            a
        });
        // Records the store's checks forbid (a takeover or promotion without a candidate):
        // the SQL's reading still agrees with the core's.
        for (i, stage) in [Stage::Takeover, Stage::Promoted].into_iter().enumerate() {
            let mut a = Alias::new("odd", "c", &format!("odd{i}"), "old");
            a.stage = stage;
            a.types = vec!["order.created".into()];
            a.share = 50;
            aliases.push(a);
        }
        let types = ["order.created", "order.paid"];
        for me in ["old", "new", "third"] {
            let i = imp(me);
            let sl = slices(&aliases, &i);
            for a in &aliases {
                let d = dest(&a.cluster, &a.topic);
                for t in types {
                    for b in 0..100u8 {
                        let facts = ClaimFacts {
                            event_type: t,
                            share_bucket: b,
                            protocol: PROTOCOL_VERSION,
                        };
                        let allowed = may_claim(
                            AliasCheck {
                                implementation: &i,
                                aliases: &aliases,
                            },
                            &d,
                            facts,
                        )
                        .is_ok();
                        let by_sql = sl
                            .iter()
                            .find(|s| s.cluster == a.cluster && s.topic == a.topic)
                            .is_none_or(|s| s.side.takes(t, b));
                        assert_eq!(allowed, by_sql, "{me} {} {t} {b}", a.stage);
                    }
                }
            }
        }
        // A destination without a record is anyone's; a foreign protocol is no one's.
        let i = imp("third");
        let free = dest("c", "free");
        let check = AliasCheck {
            implementation: &i,
            aliases: &aliases,
        };
        assert!(may_claim(check, &free, ClaimFacts::PLAIN).is_ok());
        let later = ClaimFacts {
            protocol: PROTOCOL_VERSION + 1,
            ..ClaimFacts::PLAIN
        };
        assert_eq!(
            may_claim(check, &free, later),
            Err(NotMine::Protocol(PROTOCOL_VERSION + 1))
        );
    }

    #[test]
    fn the_shadow_names_each_difference_and_nothing_else() {
        use crate::envelope::EventId;
        use crate::port::WireEnvelope;
        use crate::receipt::{Receipt, ReceiptSource};
        let mut d = dest("c", "t");
        let row = crate::row::EventRow::new_pending(
            EventId([1; 16]),
            0,
            crate::Digest([2; 32]),
            d.clone(),
        );
        let env = WireEnvelope {
            event_type: "order.created".into(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            aggregate_version: 2,
            occurred_at_ms: 5,
            tenant: "t1".into(),
            payload_schema_digest: crate::Digest([3; 32]),
        };
        let receipt = Receipt {
            event_id: row.event_id,
            member: 0,
            envelope_generation: row.envelope_generation,
            attempt_id: 1,
            payload_digest: row.payload_digest,
            destination_digest: row.destination_digest,
            cluster: "c".into(),
            stream: "t".into(),
            partition: None,
            sequence: 9,
            broker_duplicate: false,
            source: ReceiptSource::Lookup,
        };
        let same = Observed {
            receipt: &receipt,
            headers: SeenHeaders::Read(&env),
            earlier_stored_later: false,
        };
        assert_eq!(shadow_compare(&row, &env, same), vec![]);
        let other = WireEnvelope {
            tenant: "t2".into(),
            ..env.clone()
        };
        let dv = shadow_compare(
            &row,
            &env,
            Observed {
                headers: SeenHeaders::Read(&other),
                ..same
            },
        );
        assert_eq!(dv.len(), 1);
        assert_eq!(dv[0].kind, DivergenceKind::Headers);
        assert_eq!(dv[0].incumbent, "Sealpost-Tenant: t2");
        assert_eq!(dv[0].candidate, "Sealpost-Tenant: t1");
        let bad = Receipt {
            destination_digest: crate::Digest([9; 32]),
            envelope_generation: 7,
            ..receipt.clone()
        };
        let kinds: Vec<_> = shadow_compare(
            &row,
            &env,
            Observed {
                receipt: &bad,
                headers: SeenHeaders::NotRead,
                earlier_stored_later: true,
            },
        )
        .into_iter()
        .map(|d| d.kind)
        .collect();
        // Out of order only counts on an ordered destination.
        assert_eq!(
            kinds,
            vec![
                DivergenceKind::DestinationDigest,
                DivergenceKind::EnvelopeGeneration
            ]
        );
        d.ordering = EventOrdering::PerAggregate;
        let mut ordered = row.clone();
        ordered.destination = d;
        ordered.destination_digest = ordered.destination.digest();
        let r2 = Receipt {
            destination_digest: ordered.destination_digest,
            ..receipt.clone()
        };
        let dv = shadow_compare(
            &ordered,
            &env,
            Observed {
                receipt: &r2,
                headers: SeenHeaders::Read(&env),
                earlier_stored_later: true,
            },
        );
        assert_eq!(
            dv.iter().map(|d| d.kind).collect::<Vec<_>>(),
            vec![DivergenceKind::Ordering]
        );
        let missing = shadow_compare(
            &row,
            &env,
            Observed {
                headers: SeenHeaders::Missing,
                ..same
            },
        );
        assert_eq!(missing.len(), 1);
        assert_eq!(missing[0].kind, DivergenceKind::Headers);
        for k in DivergenceKind::ALL {
            assert_eq!(DivergenceKind::parse(k.name()), Some(k));
        }
    }

    #[test]
    fn share_buckets_are_stable_and_spread() {
        assert_eq!(share_bucket("order", "1"), share_bucket("order", "1"));
        let mut counts = [0u32; 100];
        for i in 0..100_000 {
            counts[share_bucket("order", &i.to_string()) as usize] += 1;
        }
        // Each bucket near 1,000 (binomial sd about 31).
        assert!(
            counts.iter().all(|&c| (850..1150).contains(&c)),
            "{counts:?}"
        );
        // Pinned values (also what the store's SQL twin computes, checked in its tests).
        assert_eq!(share_bucket("order", "o-1"), 81);
        assert_eq!(share_bucket("order", "42"), 97);
        assert_eq!(share_bucket("x", ""), 18);
    }
}
