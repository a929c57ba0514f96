//! Ed25519 keys for signed envelopes (`sealpost_core::signature`): the dispatcher's
//! [`Signer`], the readers' [`Keyring`] (consumers, the reconciler and the verification
//! pass), and [`generate`] for `sealpost keygen`.
//!
//! Why Ed25519 and not an HMAC: a reader holds only public keys, so no consumer, and nobody
//! who steals a consumer's configuration, can sign an event (seed 003: a consumer must not be
//! able to forge upstream events). An HMAC key would let every verifier forge.
//!
//! Keys are PKCS#8 PEM files, the format `openssl genpkey -algorithm ed25519` writes; a key's
//! id is its file name without `.pem` (private) or `.pub.pem` (public), 1 to 64 of
//! `A-Z a-z 0-9 . _ -`. The keyring reads every `*.pub.pem` of one directory and reads it
//! again (at most once every [`RELOAD_EVERY`]) when a message names a key it does not hold,
//! so a new key is picked up without a restart.
//!
//! Rotation without stopping anything: put the new public key in every reader's directory;
//! switch the dispatchers' `signing_key_file` to the new private key one process at a time;
//! once every message signed with the old key has been read (the consumers' watermarks are
//! past it), delete the old public key. Messages signed by a deleted key are refused as
//! `UnknownKey` from then on.
//!
//! No key material is ever printed, logged or put in an error.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use sealpost_core::encoding::Digest;
use sealpost_core::port::SendRequest;
use sealpost_core::reconcile::Lookup;
use sealpost_core::signature::{
    judge_copy, valid_key_id, Crypto, Presented, SignatureHeader, SignaturePolicy, SignedClaim,
    SIGNATURE_LEN,
};
use sealpost_core::subscription::SealpostHeaders;

/// How often at most the keyring reads its directory again for a key it does not hold.
pub const RELOAD_EVERY: Duration = Duration::from_secs(10);

/// A key that could not be read or written: which file, what is wrong, what to do. Never
/// holds key material.
#[derive(Debug, thiserror::Error)]
#[error("signing key `{path}`: {problem}; {hint}")]
pub struct KeyError {
    /// The file or directory.
    pub path: String,
    /// What is wrong.
    pub problem: String,
    /// What to do.
    pub hint: &'static str,
}

fn key_error(path: &Path, problem: impl Into<String>, hint: &'static str) -> KeyError {
    KeyError {
        path: path.display().to_string(),
        problem: problem.into(),
        hint,
    }
}

const PRIVATE_HINT: &str = "give a PKCS#8 PEM Ed25519 private key named <key-id>.pem \
    (`sealpost keygen --dir DIR --key-id ID`, or `openssl genpkey -algorithm ed25519 -out ID.pem`)";
const PUBLIC_HINT: &str = "give PKCS#8 PEM Ed25519 public keys named <key-id>.pub.pem \
    (`sealpost keygen` writes one beside the private key; `openssl pkey -in ID.pem -pubout -out ID.pub.pem`)";

/// The key id a key file's name gives (`k1.pem` and `k1.pub.pem` are key `k1`).
fn key_id_of(path: &Path, suffix: &str) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let kid = name.strip_suffix(suffix)?;
    valid_key_id(kid).then(|| kid.to_string())
}

/// The dispatcher's signing key.
pub struct Signer {
    key_id: String,
    key: SigningKey,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// A signer from a PKCS#8 PEM private key file `<key-id>.pem`.
    pub fn from_pem_file(path: &Path) -> Result<Signer, KeyError> {
        let key_id = key_id_of(path, ".pem")
            .filter(|k| !k.ends_with(".pub"))
            .ok_or_else(|| {
                key_error(
                    path,
                    "the file name is not <key-id>.pem with a key id of 1 to 64 of A-Z a-z 0-9 . _ -",
                    PRIVATE_HINT,
                )
            })?;
        let pem = std::fs::read_to_string(path)
            .map_err(|e| key_error(path, format!("cannot read it: {e}"), PRIVATE_HINT))?;
        let key = SigningKey::from_pkcs8_pem(&pem)
            .map_err(|_| key_error(path, "not a PKCS#8 PEM Ed25519 private key", PRIVATE_HINT))?;
        Ok(Signer { key_id, key })
    }

    /// A signer from a key held in memory (tests, a service's own secret store).
    pub fn from_key(key_id: &str, key: SigningKey) -> Option<Signer> {
        valid_key_id(key_id).then(|| Signer {
            key_id: key_id.to_string(),
            key,
        })
    }

    /// The key id written into every signature.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The public half, for the readers' keyrings.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }

    /// The `Sealpost-Signature` value for `claim`.
    pub fn sign(&self, claim: &SignedClaim) -> String {
        let signature = self.key.sign(&claim.digest().0);
        SignatureHeader {
            key_id: self.key_id.clone(),
            signature: signature.to_bytes(),
        }
        .format()
    }

    /// Signs a message about to be sent.
    pub fn sign_request(&self, r: &mut SendRequest) {
        r.signature = Some(self.sign(&SignedClaim::of_request(r)));
    }
}

/// What a reader trusts: its [`SignaturePolicy`] and the public keys it holds.
pub struct Keyring {
    policy: SignaturePolicy,
    dir: Option<PathBuf>,
    keys: RwLock<HashMap<String, VerifyingKey>>,
    last_read: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("policy", &self.policy.name())
            .field("dir", &self.dir)
            .field("key_ids", &self.key_ids())
            .finish()
    }
}

impl Keyring {
    /// No keys, nothing checked ([`SignaturePolicy::Off`]).
    pub fn off() -> Keyring {
        Keyring::from_keys(SignaturePolicy::Off, Vec::new())
    }

    /// A keyring of keys held in memory.
    pub fn from_keys(policy: SignaturePolicy, keys: Vec<(String, VerifyingKey)>) -> Keyring {
        Keyring {
            policy,
            dir: None,
            keys: RwLock::new(keys.into_iter().collect()),
            last_read: Mutex::new(None),
        }
    }

    /// A keyring of every `<key-id>.pub.pem` in `dir`. An unreadable or malformed file is an
    /// error (a key silently missing would refuse every message it signed); a directory
    /// without keys is one too, unless `policy` is [`SignaturePolicy::Off`].
    pub fn from_dir(dir: &Path, policy: SignaturePolicy) -> Result<Keyring, KeyError> {
        let keys = read_public_keys(dir)?;
        if keys.is_empty() && policy != SignaturePolicy::Off {
            return Err(key_error(
                dir,
                "holds no <key-id>.pub.pem file",
                PUBLIC_HINT,
            ));
        }
        Ok(Keyring {
            policy,
            dir: Some(dir.to_path_buf()),
            keys: RwLock::new(keys),
            last_read: Mutex::new(Some(Instant::now())),
        })
    }

    /// The policy readers apply.
    pub fn policy(&self) -> SignaturePolicy {
        self.policy
    }

    /// The key ids held now, sorted.
    pub fn key_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    /// The crypto answer for one signature: reads the directory again (at most once every
    /// [`RELOAD_EVERY`]) when the key is not held.
    pub fn crypto(&self, key_id: &str, signature: &[u8; SIGNATURE_LEN], digest: &Digest) -> Crypto {
        let verify = |k: &VerifyingKey| {
            if k.verify_strict(&digest.0, &Signature::from_bytes(signature))
                .is_ok()
            {
                Crypto::Valid
            } else {
                Crypto::Invalid
            }
        };
        if let Some(k) = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key_id)
        {
            return verify(k);
        }
        if self.reload() {
            if let Some(k) = self
                .keys
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .get(key_id)
            {
                return verify(k);
            }
        }
        Crypto::UnknownKey
    }

    /// Reads the directory again if it is time; true if it did.
    fn reload(&self) -> bool {
        let Some(dir) = &self.dir else {
            return false;
        };
        {
            let mut last = self.last_read.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t.elapsed() < RELOAD_EVERY) {
                return false;
            }
            *last = Some(Instant::now());
        }
        match read_public_keys(dir) {
            Ok(keys) => {
                tracing::info!(dir = %dir.display(), keys = keys.len(), "signature keyring read again");
                *self.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "signature keyring: reading the directory again failed; the keys held are kept");
                false
            }
        }
    }

    /// What a delivered message presents, its payload digested from the bytes received.
    pub fn presented(&self, headers: &SealpostHeaders, payload_digest: Digest) -> Presented {
        if self.policy == SignaturePolicy::Off {
            // Nothing is checked; the policy admits everything anyway.
            return Presented::Missing;
        }
        headers.presented(payload_digest, |k, s, d| self.crypto(k, s, d))
    }

    /// Judges a lookup's copy ([`judge_copy`]) under this keyring.
    pub fn judge(&self, lookup: Lookup) -> Lookup {
        judge_copy(lookup, self.policy, |k, s, d| self.crypto(k, s, d))
    }
}

fn read_public_keys(dir: &Path) -> Result<HashMap<String, VerifyingKey>, KeyError> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| key_error(dir, format!("cannot read the directory: {e}"), PUBLIC_HINT))?;
    let mut keys = HashMap::new();
    for entry in entries {
        let path = entry
            .map_err(|e| key_error(dir, format!("cannot read the directory: {e}"), PUBLIC_HINT))?
            .path();
        let Some(kid) = key_id_of(&path, ".pub.pem") else {
            continue;
        };
        let pem = std::fs::read_to_string(&path)
            .map_err(|e| key_error(&path, format!("cannot read it: {e}"), PUBLIC_HINT))?;
        let key = VerifyingKey::from_public_key_pem(&pem)
            .map_err(|_| key_error(&path, "not a PKCS#8 PEM Ed25519 public key", PUBLIC_HINT))?;
        keys.insert(kid, key);
    }
    Ok(keys)
}

/// Writes a new key pair `<dir>/<key_id>.pem` (private, mode 0600) and
/// `<dir>/<key_id>.pub.pem`; refuses to overwrite either. Returns both paths.
pub fn generate(dir: &Path, key_id: &str) -> Result<(PathBuf, PathBuf), KeyError> {
    if !valid_key_id(key_id) {
        return Err(key_error(
            dir,
            format!("`{key_id}` is not a key id"),
            "use 1 to 64 of A-Z a-z 0-9 . _ -",
        ));
    }
    let private = dir.join(format!("{key_id}.pem"));
    let public = dir.join(format!("{key_id}.pub.pem"));
    const HINT: &str = "choose another --key-id or directory; keys are never overwritten";
    for p in [&private, &public] {
        if p.exists() {
            return Err(key_error(p, "exists already", HINT));
        }
    }
    let key = SigningKey::generate(&mut rand_core::OsRng);
    let pem = key
        .to_pkcs8_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
        .map_err(|e| key_error(&private, format!("cannot encode it: {e}"), HINT))?;
    let pub_pem = key
        .verifying_key()
        .to_public_key_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
        .map_err(|e| key_error(&public, format!("cannot encode it: {e}"), HINT))?;
    write_new(&private, pem.as_bytes(), 0o600)?;
    write_new(&public, pub_pem.as_bytes(), 0o644)?;
    Ok((private, public))
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), KeyError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    const HINT: &str = "check the directory exists and is writable";
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| key_error(path, format!("cannot create it: {e}"), HINT))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| key_error(path, format!("cannot write it: {e}"), HINT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealpost_core::envelope::EventId;
    use sealpost_core::port::WireEnvelope;

    fn claim() -> SignedClaim {
        SignedClaim {
            event_id: EventId([9; 16]),
            member: 0,
            envelope_generation: 1,
            payload_digest: Digest([1; 32]),
            destination_digest: Digest([2; 32]),
            envelope: WireEnvelope::default(),
        }
    }

    /// What signing and checking cost per message, against the claim digest alone in the
    /// same process: `cargo test --release -p sealpost --lib -- --ignored --nocapture
    /// signing_cost`. Prints figures; never fails on time.
    #[test]
    #[ignore]
    fn signing_cost_per_message() {
        const N: u32 = 20_000;
        let signer = Signer::from_key("k1", SigningKey::from_bytes(&[7; 32])).unwrap();
        let ring = Keyring::from_keys(
            SignaturePolicy::Require,
            vec![("k1".into(), signer.verifying_key())],
        );
        let mut c = claim();
        let t = Instant::now();
        let mut sink = 0u8;
        for i in 0..N {
            c.member = i as u16;
            sink ^= c.digest().0[0];
        }
        let digest_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        let t = Instant::now();
        let mut headers = Vec::with_capacity(N as usize);
        for i in 0..N {
            c.member = i as u16;
            headers.push(signer.sign(&c));
        }
        let sign_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        let t = Instant::now();
        for (i, h) in headers.iter().enumerate() {
            c.member = i as u16;
            let p = sealpost_core::signature::present(Some(h), Some(&c), |k, s, d| {
                ring.crypto(k, s, d)
            });
            assert!(matches!(p, Presented::Valid(_)));
        }
        let verify_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        println!(
            "per message ({N}): claim digest {digest_us:.2} us, sign {sign_us:.2} us ({:.1}x), verify {verify_us:.2} us ({:.1}x) [{sink}]",
            sign_us / digest_us,
            verify_us / digest_us
        );
    }

    #[test]
    fn a_generated_pair_signs_and_verifies_and_a_changed_claim_does_not() {
        let dir = std::env::temp_dir().join(format!("sealpost-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (private, public) = generate(&dir, "k1").unwrap();
        assert!(generate(&dir, "k1").is_err(), "never overwrites");
        let mode = std::fs::metadata(&private).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        assert!(public.exists());
        let signer = Signer::from_pem_file(&private).unwrap();
        let ring = Keyring::from_dir(&dir, SignaturePolicy::Require).unwrap();
        assert_eq!(ring.key_ids(), vec!["k1".to_string()]);
        let header = SignatureHeader::parse(&signer.sign(&claim())).unwrap();
        assert_eq!(header.key_id, "k1");
        let c = claim();
        assert_eq!(
            ring.crypto("k1", &header.signature, &c.digest()),
            Crypto::Valid
        );
        let mut other = claim();
        other.envelope.event_type = "order.cancelled.v1".into();
        assert_eq!(
            ring.crypto("k1", &header.signature, &other.digest()),
            Crypto::Invalid
        );
        assert_eq!(
            ring.crypto("k2", &header.signature, &c.digest()),
            Crypto::UnknownKey
        );
        // A public key file is not a signing key, and an error never shows key material.
        let e = Signer::from_pem_file(&public).unwrap_err().to_string();
        assert!(e.contains("k1.pub.pem"), "{e}");
        assert!(!e.contains("BEGIN"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
