//! Payload encryption with a key per data subject, and erasure by destroying the key (R34,
//! `docs/data-lifecycle.md`).
//!
//! A route whose policy says `payload_key = aggregate` (or `tenant`) has `enqueue` encrypt the
//! producer's bytes with the subject's key (XChaCha20-Poly1305, a fresh random 24-byte nonce
//! per event) before sealing: the envelope, every broker copy and every dead letter hold only
//! the ciphertext, and the envelope's digests are the ciphertext's, so reconciliation and the
//! R31 verification still hold after an erasure. The library consumer opens the payload with
//! the key before the handler sees it. `sealpost erase order/o-42` destroys the key: every
//! copy of that subject's events, wherever it lies (outbox, streams, topics, queues, dead
//! letters, backups taken after the erasure), then reads as erased.
//!
//! The encrypted payload is framed so that a reader can tell whose key opens it:
//! `MAGIC | scope (1 byte) | u16 BE length + aggregate type | u16 BE length + subject id |
//! nonce (24 bytes) | ciphertext and tag`. Everything before the nonce is the AEAD's
//! associated data, so a frame moved to another subject does not open.

use std::collections::HashMap;
use std::fmt;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand_core::{OsRng, RngCore};
use sealpost_core::envelope::NewEvent;
use tokio_postgres::GenericClient;

/// The first bytes of every encrypted payload. A route that does not encrypt refuses a
/// payload that begins with them (a consumer would take it for a frame).
pub const MAGIC: &[u8] = b"\0sealpost.payload-key.v1\0";

const NONCE_BYTES: usize = 24;
const TAG_BYTES: usize = 16;

/// Bytes a frame adds to the payload, at most (two wire strings of at most 255 bytes).
pub const FRAME_OVERHEAD_MAX: usize = MAGIC.len() + 1 + 2 + 255 + 2 + 255 + NONCE_BYTES + TAG_BYTES;

/// What a route keys its payloads by (`sealpost.route_policy.payload_key`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keying {
    /// Payloads are sent as the producer wrote them.
    None,
    /// One key per aggregate (aggregate type and id).
    Aggregate,
    /// One key per tenant.
    Tenant,
}

impl Keying {
    /// The column's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Keying::None => "none",
            Keying::Aggregate => "aggregate",
            Keying::Tenant => "tenant",
        }
    }

    /// Parses the column's spelling.
    pub fn parse(s: &str) -> Option<Keying> {
        match s {
            "none" => Some(Keying::None),
            "aggregate" => Some(Keying::Aggregate),
            "tenant" => Some(Keying::Tenant),
            _ => None,
        }
    }
}

/// A data subject: whose key encrypts a payload, and what `sealpost erase` names.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Subject {
    /// An aggregate (`order/o-42`).
    Aggregate {
        /// Aggregate type.
        aggregate_type: String,
        /// Aggregate id.
        id: String,
    },
    /// A tenant (`tenant:acme`).
    Tenant(String),
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Subject::Aggregate { aggregate_type, id } => write!(f, "{aggregate_type}/{id}"),
            Subject::Tenant(t) => write!(f, "tenant:{t}"),
        }
    }
}

impl Subject {
    /// The subject an event's payload is keyed by under `keying` (`None` for a route that
    /// does not encrypt). A tenant-keyed route refuses an event without a tenant.
    pub fn of(keying: Keying, ev: &NewEvent<'_>) -> Result<Option<Subject>, KeyError> {
        Ok(match keying {
            Keying::None => None,
            Keying::Aggregate
                if ev.aggregate_type.contains('/') || ev.aggregate_type.starts_with("tenant:") =>
            {
                return Err(KeyError::UnnameableType(ev.aggregate_type.to_string()))
            }
            Keying::Aggregate => Some(Subject::Aggregate {
                aggregate_type: ev.aggregate_type.to_string(),
                id: ev.aggregate_id.to_string(),
            }),
            Keying::Tenant if ev.tenant.is_empty() => return Err(KeyError::NoTenant),
            Keying::Tenant => Some(Subject::Tenant(ev.tenant.to_string())),
        })
    }

    /// Parses what an operator types: `tenant:ID` for a tenant, `TYPE/ID` for an aggregate
    /// (split at the first `/`: an aggregate type holds none).
    pub fn parse(s: &str) -> Result<Subject, KeyError> {
        if let Some(t) = s.strip_prefix("tenant:") {
            if !t.is_empty() {
                return Ok(Subject::Tenant(t.to_string()));
            }
        } else if let Some((ty, id)) = s.split_once('/') {
            if !ty.is_empty() && !id.is_empty() {
                return Ok(Subject::Aggregate {
                    aggregate_type: ty.to_string(),
                    id: id.to_string(),
                });
            }
        }
        Err(KeyError::BadSubject(s.to_string()))
    }

    /// The key table's columns: scope, aggregate type ('' for a tenant), subject id (shared
    /// with the sqlx flavour).
    pub(crate) fn columns(&self) -> (&'static str, &str, &str) {
        match self {
            Subject::Aggregate { aggregate_type, id } => ("aggregate", aggregate_type, id),
            Subject::Tenant(t) => ("tenant", "", t),
        }
    }

    fn from_columns(scope: &str, aggregate_type: &str, id: &str) -> Option<Subject> {
        match scope {
            "aggregate" => Some(Subject::Aggregate {
                aggregate_type: aggregate_type.to_string(),
                id: id.to_string(),
            }),
            "tenant" => Some(Subject::Tenant(id.to_string())),
            _ => None,
        }
    }
}

/// Why a payload could not be encrypted, named or opened.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// A tenant-keyed route was given an event without a tenant.
    #[error("the route encrypts payloads per tenant and this event has no tenant; set NewEvent::tenant or key the route by aggregate")]
    NoTenant,
    /// An aggregate type an operator could not name unambiguously in `sealpost erase`.
    #[error("aggregate type `{0}` contains `/` or begins with `tenant:`, so `sealpost erase TYPE/ID` could not name its aggregates; the route keys payloads per aggregate: rename the type")]
    UnnameableType(String),
    /// The subject was erased: no key exists for it any more, and none is made again.
    #[error("data subject {0} was erased (sealpost erase); its events cannot be encrypted again: send what must still be said about it on a route that does not encrypt, without personal data")]
    Erased(String),
    /// An operator's subject name does not parse.
    #[error("`{0}` names no data subject: write TYPE/ID for an aggregate (order/o-42) or tenant:ID for a tenant")]
    BadSubject(String),
    /// A payload on a route that does not encrypt begins with the frame's magic bytes.
    #[error("the payload begins with Sealpost's encryption frame marker, which a consumer would take for an encrypted payload; this route does not encrypt: change the payload's first bytes or key the route")]
    LooksFramed,
    /// The frame is cut short or malformed.
    #[error("encrypted payload frame is malformed: {0}")]
    Malformed(&'static str),
}

/// A payload's frame, read without its key.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// Whose key opens it.
    pub subject: Subject,
    header: &'a [u8],
    nonce: &'a [u8],
    sealed: &'a [u8],
}

/// Reads the frame of an encrypted payload: `None` for a payload that is not one.
pub fn frame(payload: &[u8]) -> Option<Result<Frame<'_>, KeyError>> {
    let rest = payload.strip_prefix(MAGIC)?;
    Some(parse_frame(payload, rest))
}

fn parse_frame<'a>(payload: &'a [u8], rest: &'a [u8]) -> Result<Frame<'a>, KeyError> {
    let (&scope, rest) = rest.split_first().ok_or(KeyError::Malformed("no scope"))?;
    let (ty, rest) = string(rest)?;
    let (id, rest) = string(rest)?;
    let header_len = payload.len() - rest.len();
    if rest.len() < NONCE_BYTES + TAG_BYTES {
        return Err(KeyError::Malformed("shorter than its nonce and tag"));
    }
    let subject = match scope {
        1 => Subject::Aggregate {
            aggregate_type: ty.to_string(),
            id: id.to_string(),
        },
        2 if ty.is_empty() => Subject::Tenant(id.to_string()),
        _ => return Err(KeyError::Malformed("unknown scope")),
    };
    Ok(Frame {
        subject,
        header: &payload[..header_len],
        nonce: &rest[..NONCE_BYTES],
        sealed: &rest[NONCE_BYTES..],
    })
}

fn string(b: &[u8]) -> Result<(&str, &[u8]), KeyError> {
    if b.len() < 2 {
        return Err(KeyError::Malformed("cut short"));
    }
    let n = usize::from(u16::from_be_bytes([b[0], b[1]]));
    let body = b.get(2..2 + n).ok_or(KeyError::Malformed("cut short"))?;
    let s = std::str::from_utf8(body).map_err(|_| KeyError::Malformed("subject is not UTF-8"))?;
    Ok((s, &b[2 + n..]))
}

/// A subject's key: 32 random bytes.
pub type Key = [u8; 32];

/// Draws a fresh key from the operating system's generator.
pub fn fresh_key() -> Key {
    let mut k = [0u8; 32];
    OsRng.fill_bytes(&mut k);
    k
}

/// Encrypts `plaintext` for `subject` under `key`, framed.
pub fn seal(subject: &Subject, key: &Key, plaintext: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    let (scope, ty, id) = match subject {
        Subject::Aggregate { aggregate_type, id } => (1u8, aggregate_type.as_str(), id.as_str()),
        Subject::Tenant(t) => (2u8, "", t.as_str()),
    };
    out.push(scope);
    for s in [ty, id] {
        // Wire strings are at most 255 bytes (`check_new_event` ran first).
        out.extend_from_slice(&(s.len() as u16).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let header_len = out.len();
    let mut nonce = [0u8; NONCE_BYTES];
    OsRng.fill_bytes(&mut nonce);
    let sealed = XChaCha20Poly1305::new(key.into())
        .encrypt(
            XNonce::from_slice(&nonce),
            Payload {
                msg: plaintext,
                aad: &out[..header_len],
            },
        )
        .expect("XChaCha20-Poly1305 encrypts any payload under 256 GiB");
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    out
}

/// Opens a frame with its subject's key; `None` when the bytes were not sealed under that
/// key for that subject (tampered, or another key).
pub fn open(frame: &Frame<'_>, key: &Key) -> Option<Vec<u8>> {
    XChaCha20Poly1305::new(key.into())
        .decrypt(
            XNonce::from_slice(frame.nonce),
            Payload {
                msg: frame.sealed,
                aad: frame.header,
            },
        )
        .ok()
}

/// A subject's key as the database holds it. Its `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub enum KeyState {
    /// The key.
    Live(Key),
    /// Destroyed by `sealpost erase` at this time (database clock, ms).
    Erased {
        /// When.
        at_ms: i64,
    },
}

impl fmt::Debug for KeyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyState::Live(_) => f.write_str("Live(<key>)"),
            KeyState::Erased { at_ms } => write!(f, "Erased {{ at_ms: {at_ms} }}"),
        }
    }
}

/// The subject's key, made from the fresh bytes `$4` when it has none; NULL once erased
/// (shared with the sqlx flavour).
pub(crate) const KEY_FOR_ENQUEUE_SQL: &str =
    "SELECT sealpost.subject_key_for_enqueue($1, $2, $3, $4)";

/// The subject's key for `enqueue`, created in the caller's transaction when it has none
/// (`sealpost.subject_key_for_enqueue`). Fails with [`KeyError::Erased`] for an erased
/// subject.
pub async fn key_for_enqueue(
    client: &impl GenericClient,
    subject: &Subject,
) -> Result<Result<Key, KeyError>, tokio_postgres::Error> {
    let (scope, ty, id) = subject.columns();
    let fresh = fresh_key();
    let row = client
        .query_one(KEY_FOR_ENQUEUE_SQL, &[&scope, &ty, &id, &fresh.as_slice()])
        .await?;
    Ok(key_of_bytes(subject, row.get::<_, Option<Vec<u8>>>(0)))
}

/// The key bytes the key function returned, checked.
pub(crate) fn key_of_bytes(subject: &Subject, bytes: Option<Vec<u8>>) -> Result<Key, KeyError> {
    bytes
        .and_then(|b| Key::try_from(b.as_slice()).ok())
        .ok_or_else(|| KeyError::Erased(subject.to_string()))
}

/// The keys of `subjects` (`sealpost.subject_keys`); a subject the database never keyed is
/// absent from the map.
pub async fn keys_of(
    client: &impl GenericClient,
    subjects: &[Subject],
) -> Result<HashMap<Subject, KeyState>, tokio_postgres::Error> {
    let mut scopes = Vec::with_capacity(subjects.len());
    let mut types = Vec::with_capacity(subjects.len());
    let mut ids = Vec::with_capacity(subjects.len());
    for s in subjects {
        let (scope, ty, id) = s.columns();
        scopes.push(scope);
        types.push(ty);
        ids.push(id);
    }
    let rows = client
        .query(
            "SELECT scope, aggregate_type, subject_id, key, erased_at_ms
               FROM sealpost.subject_keys($1, $2, $3)",
            &[&scopes, &types, &ids],
        )
        .await?;
    let mut out = HashMap::with_capacity(rows.len());
    for r in rows {
        let Some(subject) = Subject::from_columns(r.get(0), r.get(1), r.get(2)) else {
            continue;
        };
        let key: Option<Vec<u8>> = r.get(3);
        let state = match key.and_then(|b| Key::try_from(b.as_slice()).ok()) {
            Some(k) => KeyState::Live(k),
            None => KeyState::Erased {
                at_ms: r.get::<_, Option<i64>>(4).unwrap_or(0),
            },
        };
        out.insert(subject, state);
    }
    Ok(out)
}

/// Destroys `subject`'s key (`sealpost.erase_subject`, recorded in
/// `sealpost.subject_erasure`); returns how many envelopes of the subject the outbox holds.
/// Erasing twice, or a subject that never had a key, is harmless: no key is made for it
/// afterwards.
pub async fn erase(
    client: &impl GenericClient,
    subject: &Subject,
) -> Result<u64, tokio_postgres::Error> {
    let (scope, ty, id) = subject.columns();
    let row = client
        .query_one(
            "SELECT sealpost.erase_subject($1, $2, $3)",
            &[&scope, &ty, &id],
        )
        .await?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// What a reader gets from a payload as it was sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opened {
    /// Not encrypted: the bytes as sent.
    Plain,
    /// Encrypted and opened: the producer's bytes.
    Opened(Vec<u8>),
    /// Encrypted for a subject whose key was destroyed.
    Erased(Subject),
    /// Encrypted, but it cannot be opened: why.
    Unreadable(String),
}

/// Opens `payload` with the keys in `keys` (from [`keys_of`]).
pub fn open_with(payload: &[u8], keys: &HashMap<Subject, KeyState>) -> Opened {
    match frame(payload) {
        None => Opened::Plain,
        Some(Err(e)) => Opened::Unreadable(e.to_string()),
        Some(Ok(f)) => match keys.get(&f.subject) {
            None => Opened::Unreadable(format!(
                "no key for data subject {} in this database (sealpost.subject_keys)",
                f.subject
            )),
            Some(KeyState::Erased { .. }) => Opened::Erased(f.subject),
            Some(KeyState::Live(k)) => match open(&f, k) {
                Some(p) => Opened::Opened(p),
                None => Opened::Unreadable(format!(
                    "the payload does not open with data subject {}'s key (altered, or sealed under another key)",
                    f.subject
                )),
            },
        },
    }
}

/// The subjects whose keys the payloads need, each once.
pub fn subjects_of<'a>(payloads: impl IntoIterator<Item = &'a [u8]>) -> Vec<Subject> {
    let mut out: Vec<Subject> = Vec::new();
    for p in payloads {
        if let Some(Ok(f)) = frame(p) {
            if !out.contains(&f.subject) {
                out.push(f.subject);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order() -> Subject {
        Subject::Aggregate {
            aggregate_type: "order".into(),
            id: "o-42".into(),
        }
    }

    #[test]
    fn a_sealed_payload_opens_with_its_key_only() {
        let k = fresh_key();
        let sealed = seal(&order(), &k, b"{\"email\":\"a@b\"}");
        assert!(sealed.starts_with(MAGIC));
        assert!(!sealed.windows(5).any(|w| w == b"email"));
        let f = frame(&sealed).unwrap().unwrap();
        assert_eq!(f.subject, order());
        assert_eq!(open(&f, &k).unwrap(), b"{\"email\":\"a@b\"}");
        assert_eq!(open(&f, &fresh_key()), None);
        assert!(sealed.len() <= 15 + FRAME_OVERHEAD_MAX);
    }

    #[test]
    fn a_frame_moved_to_another_subject_or_altered_does_not_open() {
        let k = fresh_key();
        let sealed = seal(&order(), &k, b"payload");
        // Same length subject id, another aggregate.
        let moved = String::from_utf8_lossy(&sealed).replace("o-42", "o-43");
        let moved = moved.as_bytes();
        if let Some(Ok(f)) = frame(moved) {
            assert_eq!(open(&f, &k), None);
        }
        let mut flipped = sealed.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(open(&frame(&flipped).unwrap().unwrap(), &k), None);
        assert!(matches!(
            frame(&sealed[..MAGIC.len() + 3]),
            Some(Err(KeyError::Malformed(_)))
        ));
        assert!(frame(b"{\"plain\":1}").is_none());
    }

    #[test]
    fn operators_name_subjects_as_the_display_writes_them() {
        for s in [order(), Subject::Tenant("acme".into())] {
            assert_eq!(Subject::parse(&s.to_string()).unwrap(), s);
        }
        assert_eq!(
            Subject::parse("order/o/42").unwrap(),
            Subject::Aggregate {
                aggregate_type: "order".into(),
                id: "o/42".into()
            }
        );
        for bad in ["order", "/x", "order/", "tenant:", ""] {
            assert!(Subject::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn open_with_tells_erased_unknown_and_plain_apart() {
        let k = fresh_key();
        let sealed = seal(&order(), &k, b"p");
        let mut keys = HashMap::new();
        assert!(matches!(open_with(&sealed, &keys), Opened::Unreadable(_)));
        keys.insert(order(), KeyState::Live(k));
        assert_eq!(open_with(&sealed, &keys), Opened::Opened(b"p".to_vec()));
        keys.insert(order(), KeyState::Erased { at_ms: 1 });
        assert_eq!(open_with(&sealed, &keys), Opened::Erased(order()));
        assert_eq!(open_with(b"plain", &keys), Opened::Plain);
        assert_eq!(format!("{:?}", KeyState::Live(k)), "Live(<key>)");
        assert_eq!(
            subjects_of([sealed.as_slice(), b"x", sealed.as_slice()]),
            vec![order()]
        );
    }
}
