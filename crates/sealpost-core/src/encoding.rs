//! Canonical encoding and SHA-256 digests.
//!
//! Every digest Sealpost stores is `SHA-256(domain || fields)` where `domain` is a versioned,
//! NUL-terminated ASCII tag (for example `sealpost.destination.v1\0`) and each field is
//! encoded as a one-byte tag, a four-byte big-endian length and the raw bytes. Strings are
//! their UTF-8 bytes, integers are eight bytes big-endian, absent optionals are omitted
//! entirely. Fields appear in ascending tag order. `docs/encoding.md` specifies the format
//! and lists fixed vectors that the tests in this module check byte for byte.

use sha2::{Digest as _, Sha256};

/// Length of a digest in bytes.
pub const DIGEST_LEN: usize = 32;

/// A SHA-256 digest over a canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Digest(pub [u8; DIGEST_LEN]);

impl Digest {
    /// Lower-case hex, prefixed `sha256:` as stored in headers and docs.
    pub fn to_prefixed_hex(&self) -> String {
        let mut s = String::with_capacity(7 + DIGEST_LEN * 2);
        s.push_str("sha256:");
        self.push_hex(&mut s);
        s
    }

    /// Lower-case hex without prefix.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(DIGEST_LEN * 2);
        self.push_hex(&mut s);
        s
    }

    fn push_hex(&self, s: &mut String) {
        for b in self.0 {
            s.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
            s.push(char::from_digit(u32::from(b & 0xf), 16).unwrap_or('0'));
        }
    }

    /// Parses 64 hex characters, with or without the `sha256:` prefix.
    pub fn from_hex(s: &str) -> Option<Digest> {
        let s = s.strip_prefix("sha256:").unwrap_or(s);
        if s.len() != DIGEST_LEN * 2 {
            return None;
        }
        let mut out = [0u8; DIGEST_LEN];
        for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
            let hi = (chunk[0] as char).to_digit(16)?;
            let lo = (chunk[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(Digest(out))
    }

    /// SHA-256 of raw bytes (used for payload digests: the payload bytes are already the
    /// canonical serialization chosen by the destination's serializer).
    pub fn of_bytes(domain: &str, bytes: &[u8]) -> Digest {
        let mut c = Canonical::new(domain);
        c.bytes(1, bytes);
        c.finish()
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", &self.to_hex()[..12])
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_prefixed_hex())
    }
}

/// Builder for a canonical encoding. Tags must be added in strictly ascending order; a
/// violation is a programming error and panics (it would silently change every digest).
pub struct Canonical {
    hasher: Sha256,
    last_tag: u8,
}

impl Canonical {
    /// Starts an encoding under a versioned domain tag such as `sealpost.destination.v1`.
    pub fn new(domain: &str) -> Canonical {
        let mut hasher = Sha256::new();
        hasher.update(domain.as_bytes());
        hasher.update([0u8]);
        Canonical {
            hasher,
            last_tag: 0,
        }
    }

    /// Adds a raw byte field.
    pub fn bytes(&mut self, tag: u8, value: &[u8]) -> &mut Self {
        assert!(
            tag > self.last_tag,
            "canonical tags must ascend: {tag} after {}",
            self.last_tag
        );
        self.last_tag = tag;
        let len = u32::try_from(value.len()).expect("canonical field longer than 4 GiB");
        self.hasher.update([tag]);
        self.hasher.update(len.to_be_bytes());
        self.hasher.update(value);
        self
    }

    /// Adds a UTF-8 string field.
    pub fn str(&mut self, tag: u8, value: &str) -> &mut Self {
        self.bytes(tag, value.as_bytes())
    }

    /// Adds an unsigned integer field (eight bytes, big-endian).
    pub fn u64(&mut self, tag: u8, value: u64) -> &mut Self {
        self.bytes(tag, &value.to_be_bytes())
    }

    /// Finishes the encoding.
    pub fn finish(&mut self) -> Digest {
        let out = std::mem::take(&mut self.hasher).finalize();
        let mut d = [0u8; DIGEST_LEN];
        d.copy_from_slice(&out);
        Digest(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let d = Digest::of_bytes("sealpost.payload.v1", b"{}");
        assert_eq!(Digest::from_hex(&d.to_prefixed_hex()), Some(d));
        assert_eq!(Digest::from_hex(&d.to_hex()), Some(d));
        assert_eq!(Digest::from_hex("sha256:zz"), None);
    }

    #[test]
    fn empty_domain_vector() {
        // SHA-256("sealpost.payload.v1\0" || 0x01 || 00000000) -- the empty payload.
        let d = Digest::of_bytes("sealpost.payload.v1", b"");
        let mut h = Sha256::new();
        h.update(b"sealpost.payload.v1\0\x01\x00\x00\x00\x00");
        assert_eq!(d.0.as_slice(), h.finalize().as_slice());
    }

    #[test]
    #[allow(clippy::should_panic_without_expect)]
    fn field_order_is_enforced() {
        let r = std::panic::catch_unwind(|| {
            let mut c = Canonical::new("x");
            c.u64(2, 1).u64(1, 1);
        });
        assert!(r.is_err(), "descending tags must be refused");
    }
}
