//! The Sealpost protocol core: envelopes, canonical digests, the state table and every
//! outbox decision as a pure function of a row snapshot, an input and an injected `now`.
//!
//! Nothing in this crate performs IO or reads a clock. The Postgres store, the broker
//! adapters and the deterministic simulator are shells that load a snapshot, call one of the
//! `decide_*` functions here and persist what it returns. One decision, one place: the
//! simulator proves exactly the code that production runs.

pub mod cdc;
pub mod claim;
pub mod cleanup;
pub mod contract;
pub mod delivery_set;
pub mod dispatcher;
pub mod encoding;
pub mod envelope;
pub mod inbox;
pub mod lease;
pub mod migration;
pub mod port;
pub mod receipt;
pub mod reconcile;
pub mod reconciler;
pub mod rollout;
pub mod row;
pub mod secret;
pub mod signature;
pub mod state;
pub mod step;
pub mod subscription;
pub mod wire;

pub use claim::{ClaimDecision, ClaimToken, SendOutcome, SendOutcomeDecision};
pub use encoding::{Digest, DIGEST_LEN};
pub use envelope::{Destination, EventId, RoutePolicy, SealedEnvelope};
pub use receipt::{DuplicateKind, QuarantineReason, Receipt, ReceiptVerdict, RejectReason};
pub use row::{Attempt, AttemptStatus, Claim, EventRow, Pacing};
pub use state::{Phase, State, TransitionError};
