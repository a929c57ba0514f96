//! Signed envelopes: what a dispatcher's signature vouches for, how it travels, and what a
//! consumer, the reconciler and the verification pass (R31) do with what they find.
//!
//! Anyone who may publish to a destination can put a message there that *looks* like
//! Sealpost's: the headers are only text, and a payload digest header is as easy to compute
//! as to copy. A signature over the facts a reader relies on closes that: the dispatcher
//! signs each message it sends with a key only dispatchers hold, and every reader checks the
//! signature before it trusts the message (a consumer before the effect, the reconciler
//! before it adopts a copy a lookup found, the verification pass before it counts a copy as
//! present).
//!
//! The crypto is the shells' (`sealpost::signing`, Ed25519: a reader holds only public keys,
//! so no consumer can forge an upstream event); this module has no key and reads no clock.
//! It defines:
//! * [`SignedClaim`]: the facts a signature covers, and their canonical digest (the signed
//!   message). A reader rebuilds the claim from what it received (the headers it will act on
//!   and the digest of the payload bytes it holds), never from what a header says the digest
//!   is.
//! * [`SignatureHeader`]: the `Sealpost-Signature` header's text, `ed25519 kid=K sig=HEX`.
//! * [`Presented`]: what checking a message's signature found (the shell's crypto answer),
//!   and [`decide_seal`]: the one rule of what a reader may trust, under the reader's
//!   [`SignaturePolicy`].
//! * [`judge_copy`]: the copies a lookup found become adoptable evidence ([`Lookup::Found`])
//!   only through a copy whose seal is admitted; otherwise [`Lookup::Unsealed`].
//! * [`is_this_message`]: whether a copy a broker calls the original of a send is that very
//!   message (a duplicate acknowledgement is a receipt only then).

use crate::encoding::{Canonical, Digest};
use crate::envelope::EventId;
use crate::port::{SendRequest, WireEnvelope};
use crate::receipt::Receipt;
use crate::reconcile::Lookup;

/// Canonical-encoding domain of the signed claim.
pub const SIGNATURE_DOMAIN: &str = "sealpost.signature.v1";

/// The header that carries a message's signature ([`SignatureHeader`]).
pub const H_SIGNATURE: &str = "Sealpost-Signature";

/// The signature scheme named in the header.
pub const SCHEME: &str = "ed25519";

/// Length of an Ed25519 signature in bytes.
pub const SIGNATURE_LEN: usize = 64;

/// Longest key id.
pub const KEY_ID_MAX: usize = 64;

/// What a dispatcher's signature vouches for: the event's identity and delivery member, the
/// envelope generation sent, the digest of the payload bytes, the frozen destination's digest
/// and the envelope's description (R30: what a handler routes by). A reader rebuilds it from
/// the message it holds; one changed byte anywhere gives another digest, and the signature
/// no longer verifies.
///
/// The sealed envelope's own digest is not part of it: it also covers fields that never go
/// on the wire (the creating transaction), so a reader could not rebuild it, and everything a
/// reader acts on is covered here field by field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedClaim {
    /// Event id.
    pub event_id: EventId,
    /// Delivery-set member.
    pub member: u16,
    /// Envelope generation.
    pub envelope_generation: u32,
    /// Digest of the payload bytes (a reader digests the bytes it received).
    pub payload_digest: Digest,
    /// Digest of the frozen destination.
    pub destination_digest: Digest,
    /// The envelope's description as sent in the headers.
    pub envelope: WireEnvelope,
}

impl SignedClaim {
    /// The claim of a message about to be sent.
    pub fn of_request(r: &SendRequest) -> SignedClaim {
        SignedClaim {
            event_id: r.event_id,
            member: r.member,
            envelope_generation: r.envelope_generation,
            payload_digest: r.payload_digest,
            destination_digest: r.destination_digest,
            envelope: r.envelope.clone(),
        }
    }

    /// The signed message: the canonical digest of every field (`docs/encoding.md`).
    pub fn digest(&self) -> Digest {
        let e = &self.envelope;
        Canonical::new(SIGNATURE_DOMAIN)
            .bytes(1, &self.event_id.0)
            .u64(2, u64::from(self.member))
            .u64(3, u64::from(self.envelope_generation))
            .bytes(4, &self.payload_digest.0)
            .bytes(5, &self.destination_digest.0)
            .str(6, &e.event_type)
            .str(7, &e.aggregate_type)
            .str(8, &e.aggregate_id)
            .u64(9, e.aggregate_version)
            .u64(10, e.occurred_at_ms)
            .str(11, &e.tenant)
            .bytes(12, &e.payload_schema_digest.0)
            .finish()
    }
}

/// Is `kid` a usable key id: 1 to [`KEY_ID_MAX`] ASCII letters, digits, `.`, `_` or `-`
/// (it names a key file and travels in a header).
pub fn valid_key_id(kid: &str) -> bool {
    !kid.is_empty()
        && kid.len() <= KEY_ID_MAX
        && kid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The `Sealpost-Signature` header: `ed25519 kid=<key id> sig=<128 hex digits>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignatureHeader {
    /// Which key signed (a reader looks it up in its keyring).
    pub key_id: String,
    /// The Ed25519 signature over [`SignedClaim::digest`].
    pub signature: [u8; SIGNATURE_LEN],
}

impl SignatureHeader {
    /// The header's value.
    pub fn format(&self) -> String {
        let mut s = String::with_capacity(32 + self.key_id.len() + 2 * SIGNATURE_LEN);
        s.push_str(SCHEME);
        s.push_str(" kid=");
        s.push_str(&self.key_id);
        s.push_str(" sig=");
        for b in self.signature {
            s.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
            s.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
        }
        s
    }

    /// Reads a header value; the error says what is wrong with it.
    pub fn parse(value: &str) -> Result<SignatureHeader, String> {
        let mut parts = value.split(' ');
        let scheme = parts.next().unwrap_or_default();
        if scheme != SCHEME {
            return Err(format!("scheme `{scheme}` is not `{SCHEME}`"));
        }
        let kid = parts
            .next()
            .and_then(|p| p.strip_prefix("kid="))
            .ok_or("no `kid=` after the scheme")?;
        if !valid_key_id(kid) {
            return Err("the key id is not 1 to 64 of A-Z a-z 0-9 . _ -".into());
        }
        let hex = parts
            .next()
            .and_then(|p| p.strip_prefix("sig="))
            .ok_or("no `sig=` after the key id")?;
        if parts.next().is_some() {
            return Err("text after the signature".into());
        }
        if hex.len() != 2 * SIGNATURE_LEN {
            return Err(format!(
                "the signature has {} hex digits, not {}",
                hex.len(),
                2 * SIGNATURE_LEN
            ));
        }
        let mut signature = [0u8; SIGNATURE_LEN];
        for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
            let digit = |c: u8| char::from(c).to_digit(16);
            match (digit(pair[0]), digit(pair[1])) {
                (Some(h), Some(l)) => signature[i] = (h * 16 + l) as u8,
                _ => return Err("the signature is not hex".into()),
            }
        }
        Ok(SignatureHeader {
            key_id: kid.to_string(),
            signature,
        })
    }
}

/// What checking a message's signature found: the shell's crypto answer, before any policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Presented {
    /// No signature header.
    Missing,
    /// A signature header that does not parse (the reason).
    Malformed(String),
    /// Signed with a key this reader does not hold (never had, or retired).
    UnknownKey(String),
    /// A known key's signature that does not verify over the claim rebuilt from the message:
    /// forged, or a genuine signature moved onto other facts (a replay).
    Invalid(String),
    /// Verified with this key.
    Valid(String),
}

/// What a reader demands of signatures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SignaturePolicy {
    /// No keyring: nothing is checked (messages are trusted by their digest alone; anyone
    /// who may publish can forge). The default only because keys must be distributed first.
    #[default]
    Off,
    /// The migration step while dispatchers start signing: an unsigned message is accepted,
    /// a signed one must verify. Not a protection against forgery (a forger omits the
    /// header); move to `Require` once no unsigned message is left to read.
    IfPresent,
    /// Only a message whose signature verifies with a held key is trusted.
    Require,
}

impl SignaturePolicy {
    /// The policy's name in configuration.
    pub fn name(self) -> &'static str {
        match self {
            SignaturePolicy::Off => "off",
            SignaturePolicy::IfPresent => "if-present",
            SignaturePolicy::Require => "require",
        }
    }

    /// Reads a policy name.
    pub fn parse(s: &str) -> Option<SignaturePolicy> {
        match s {
            "off" => Some(SignaturePolicy::Off),
            "if-present" => Some(SignaturePolicy::IfPresent),
            "require" => Some(SignaturePolicy::Require),
            _ => None,
        }
    }
}

/// Why a reader does not trust a message: recorded with a quarantined delivery, an unsealed
/// copy or a verification finding.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealRefusal {
    /// Signatures are required and the message has none.
    #[error("unsigned message where a signature is required (forged, or sent before signing was enabled)")]
    Unsigned,
    /// The header does not parse.
    #[error("malformed Sealpost-Signature header: {0}")]
    Malformed(String),
    /// The key is not in the reader's keyring.
    #[error("signed with key `{0}`, which this reader does not hold (unknown or retired)")]
    UnknownKey(String),
    /// The signature does not verify.
    #[error("the signature of key `{0}` does not verify over this message (forged or replayed)")]
    Invalid(String),
}

/// The one rule of what a reader trusts (a consumer before the effect, the reconciler before
/// it adopts a copy, the verification pass before it counts one present): under `Off`
/// everything, under `IfPresent` an unsigned message or a valid signature, under `Require`
/// only a valid signature.
pub fn decide_seal(policy: SignaturePolicy, presented: &Presented) -> Result<(), SealRefusal> {
    match (policy, presented) {
        (SignaturePolicy::Off, _) => Ok(()),
        (_, Presented::Valid(_)) => Ok(()),
        (SignaturePolicy::IfPresent, Presented::Missing) => Ok(()),
        (SignaturePolicy::Require, Presented::Missing) => Err(SealRefusal::Unsigned),
        (_, Presented::Malformed(why)) => Err(SealRefusal::Malformed(why.clone())),
        (_, Presented::UnknownKey(k)) => Err(SealRefusal::UnknownKey(k.clone())),
        (_, Presented::Invalid(k)) => Err(SealRefusal::Invalid(k.clone())),
    }
}

/// What a lookup found besides the receipt: the claim rebuilt from the copy's headers and
/// the digest of its stored bytes, and its signature header, for the reader to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopySeal {
    /// The claim as the copy states it (payload digest: of the stored bytes); `None` when its
    /// headers lack a part of it.
    pub claim: Option<SignedClaim>,
    /// The copy's `Sealpost-Signature` header, if any.
    pub signature: Option<String>,
}

/// A copy a lookup found, before its seal was judged ([`judge_copy`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundCopy {
    /// The copy as a receipt (source `Lookup`; payload digest of the stored bytes).
    pub receipt: Receipt,
    /// What its signature is to be checked against.
    pub seal: CopySeal,
}

impl FoundCopy {
    /// A copy as an adapter read it: `receipt` from its headers (its payload digest of the
    /// stored bytes), the envelope description and the signature header it carries.
    pub fn read(
        receipt: Receipt,
        envelope: Option<WireEnvelope>,
        signature: Option<String>,
    ) -> FoundCopy {
        let claim = envelope.map(|envelope| SignedClaim {
            event_id: receipt.event_id,
            member: receipt.member,
            envelope_generation: receipt.envelope_generation,
            payload_digest: receipt.payload_digest,
            destination_digest: receipt.destination_digest,
            envelope,
        });
        FoundCopy {
            receipt,
            seal: CopySeal { claim, signature },
        }
    }
}

/// The crypto's answer for one signature: the shell's keyring (or the simulator's model of
/// an unforgeable signature) answers this and nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crypto {
    /// The key id names a key this reader holds and the signature verifies over the digest.
    Valid,
    /// The key is held; the signature does not verify.
    Invalid,
    /// No such key here.
    UnknownKey,
}

/// What a message presents: its signature header (if any) checked by `verify` over the claim
/// rebuilt from what the reader holds (`None`: the headers are too incomplete to rebuild it,
/// which no genuine message is).
pub fn present(
    signature: Option<&str>,
    claim: Option<&SignedClaim>,
    verify: impl FnOnce(&str, &[u8; SIGNATURE_LEN], &Digest) -> Crypto,
) -> Presented {
    let Some(text) = signature else {
        return Presented::Missing;
    };
    let header = match SignatureHeader::parse(text) {
        Ok(h) => h,
        Err(why) => return Presented::Malformed(why),
    };
    let Some(claim) = claim else {
        return Presented::Invalid(header.key_id);
    };
    match verify(&header.key_id, &header.signature, &claim.digest()) {
        Crypto::Valid => Presented::Valid(header.key_id),
        Crypto::Invalid => Presented::Invalid(header.key_id),
        Crypto::UnknownKey => Presented::UnknownKey(header.key_id),
    }
}

/// Copies of one event at one destination a lookup reads at most. A genuine copy is the
/// first on its subject at a create-if-absent broker (NATS refuses the genuine send once
/// anything holds the subject), so only a forger's flood reaches the bound, and what the
/// bound costs is then liveness (the row stays unknown or is retried), never a forged copy
/// adopted.
pub const COPIES_MAX: usize = 16;

/// Judges the seals of the copies a lookup found: [`Lookup::Copies`] becomes
/// [`Lookup::Found`] with the first (oldest) copy whose seal [`decide_seal`] admits
/// ([`present`] with the shell's `verify`), and [`Lookup::Unsealed`] with the first copy and
/// its refusal when none is admitted; every other answer is returned as it is. The
/// reconciler and the verification pass call this before they decide anything on a copy.
pub fn judge_copy(
    lookup: Lookup,
    policy: SignaturePolicy,
    mut verify: impl FnMut(&str, &[u8; SIGNATURE_LEN], &Digest) -> Crypto,
) -> Lookup {
    match lookup {
        Lookup::Copies(copies) => {
            let mut first_refused = None;
            for FoundCopy { receipt, seal } in copies {
                let presented =
                    present(seal.signature.as_deref(), seal.claim.as_ref(), &mut verify);
                match decide_seal(policy, &presented) {
                    Ok(()) => return Lookup::Found(receipt),
                    Err(refusal) => {
                        first_refused.get_or_insert(Lookup::Unsealed { receipt, refusal });
                    }
                }
            }
            // An empty list is no answer at all: nothing learned.
            first_refused.unwrap_or(Lookup::Unavailable)
        }
        other => other,
    }
}

/// Whether `copy` is the very message a sender put on the wire under `claim` and
/// `signature`: the same claim (rebuilt from the copy's headers and the digest of its stored
/// bytes) and the same signature header, byte for byte. A broker that answers a send with
/// "duplicate of the message stored at N" (NATS within its duplicate window) names whatever
/// was published first under the event's duplicate id, possibly a forger's look-alike: the
/// send is a receipt only when the copy at N is this message; otherwise its outcome is a
/// lookup away ([`crate::port::SendResult::AlreadyStored`]). Ed25519 signatures are
/// deterministic, so an earlier attempt's copy under the same key compares equal; one signed
/// under a key rotated since does not, and goes to the reconciler, whose keyring judges it.
pub fn is_this_message(claim: &SignedClaim, signature: Option<&str>, copy: &FoundCopy) -> bool {
    copy.seal.claim.as_ref() == Some(claim) && copy.seal.signature.as_deref() == signature
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> SignedClaim {
        SignedClaim {
            event_id: EventId([7; 16]),
            member: 0,
            envelope_generation: 1,
            payload_digest: Digest([1; 32]),
            destination_digest: Digest([2; 32]),
            envelope: WireEnvelope {
                event_type: "order.created.v1".into(),
                aggregate_type: "order".into(),
                aggregate_id: "o-42".into(),
                aggregate_version: 1,
                occurred_at_ms: 1_700_000_000_000,
                tenant: "t-1".into(),
                payload_schema_digest: Digest([3; 32]),
            },
        }
    }

    #[test]
    fn every_field_changes_the_signed_digest() {
        let base = claim().digest();
        let mut variants = Vec::new();
        let mut c = claim();
        c.event_id.0[15] ^= 1;
        variants.push(c);
        let mut c = claim();
        c.member = 1;
        variants.push(c);
        let mut c = claim();
        c.envelope_generation = 2;
        variants.push(c);
        let mut c = claim();
        c.payload_digest.0[0] ^= 1;
        variants.push(c);
        let mut c = claim();
        c.destination_digest.0[0] ^= 1;
        variants.push(c);
        let mut c = claim();
        c.envelope.event_type = "order.cancelled.v1".into();
        variants.push(c);
        let mut c = claim();
        c.envelope.aggregate_type = "orders".into();
        variants.push(c);
        let mut c = claim();
        c.envelope.aggregate_id = "o-43".into();
        variants.push(c);
        let mut c = claim();
        c.envelope.aggregate_version = 2;
        variants.push(c);
        let mut c = claim();
        c.envelope.occurred_at_ms += 1;
        variants.push(c);
        let mut c = claim();
        c.envelope.tenant = "t-2".into();
        variants.push(c);
        let mut c = claim();
        c.envelope.payload_schema_digest.0[0] ^= 1;
        variants.push(c);
        for v in &variants {
            assert_ne!(v.digest(), base, "{v:?}");
        }
    }

    #[test]
    fn the_header_round_trips_and_refuses_what_is_not_one() {
        let h = SignatureHeader {
            key_id: "k-2026.1".into(),
            signature: [0xab; SIGNATURE_LEN],
        };
        let text = h.format();
        assert!(text.starts_with("ed25519 kid=k-2026.1 sig=abab"));
        assert_eq!(SignatureHeader::parse(&text), Ok(h));
        for bad in [
            "",
            "rsa kid=k sig=00",
            "ed25519",
            "ed25519 kid= sig=00",
            "ed25519 kid=k/../x sig=00",
            "ed25519 kid=k sig=00",
            &format!("ed25519 kid=k sig={}", "zz".repeat(64)),
            &format!("ed25519 kid=k sig={} more", "00".repeat(64)),
        ] {
            assert!(SignatureHeader::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_policy_decides_what_is_trusted() {
        use Presented::*;
        let all = [
            Missing,
            Malformed("x".into()),
            UnknownKey("k".into()),
            Invalid("k".into()),
            Valid("k".into()),
        ];
        for p in &all {
            assert!(decide_seal(SignaturePolicy::Off, p).is_ok());
            assert_eq!(
                decide_seal(SignaturePolicy::Require, p).is_ok(),
                matches!(p, Valid(_)),
                "{p:?}"
            );
            assert_eq!(
                decide_seal(SignaturePolicy::IfPresent, p).is_ok(),
                matches!(p, Valid(_) | Missing),
                "{p:?}"
            );
        }
        for p in ["off", "if-present", "require"] {
            assert_eq!(SignaturePolicy::parse(p).map(|x| x.name()), Some(p));
        }
    }
}
