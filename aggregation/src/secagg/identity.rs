//! Long-term client identities: an Ed25519 key pair per client, whose public half the
//! coordinator registers at enrolment and shows to the admin, so that sites can compare
//! fingerprints out of band.
//!
//! A secure round's messages that other clients rely on are signed with it: a client
//! that checks its neighbours' signatures knows that the keys it encrypts its shares to
//! are theirs and not the coordinator's, which is what stops a coordinator from
//! substituting keys and decrypting both kinds of share of one client (Bonawitz et al.
//! 2017, the active-adversary variant).
//!
//! What is signed is a [`Statement`]: a domain label and length-prefixed fields, so that
//! no signed byte string can be read as another statement, another round or another
//! client's.

use ring::rand::SecureRandom;
use ring::signature::{self, KeyPair as _};
use zeroize::Zeroizing;

/// Bytes of an Ed25519 public key.
pub const PUBLIC_KEY_BYTES: usize = 32;
/// Bytes of an Ed25519 signature.
pub const SIGNATURE_BYTES: usize = 64;
/// Bytes of the seed an identity is made from (and stored as).
pub const SEED_BYTES: usize = 32;

/// Why an identity could not be made or a signature not checked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The bytes are not an Ed25519 seed.
    #[error("not an Ed25519 identity seed")]
    BadSeed,
    /// The operating system's random generator failed.
    #[error("no randomness for a new identity")]
    NoRandomness,
    /// The signature is not the named client's over this statement.
    #[error("the signature of client {0} does not verify")]
    BadSignature(u32),
    /// Two clients of one round present the same identity (one client cannot hold two
    /// places in a neighbourhood).
    #[error("clients {0} and {1} present the same identity")]
    SharedIdentity(u32, u32),
}

/// A client's long-term signing key. The seed is wiped when the key is dropped.
pub struct Identity {
    seed: Zeroizing<[u8; SEED_BYTES]>,
    pair: signature::Ed25519KeyPair,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("fingerprint", &fingerprint(&self.public()))
            .finish_non_exhaustive()
    }
}

impl Identity {
    /// A fresh identity from the operating system's random generator.
    pub fn generate() -> Result<Self, IdentityError> {
        let mut seed = Zeroizing::new([0u8; SEED_BYTES]);
        ring::rand::SystemRandom::new()
            .fill(seed.as_mut())
            .map_err(|_| IdentityError::NoRandomness)?;
        Self::from_seed(seed.as_ref())
    }

    /// An identity drawn from `rng`: for simulated clients, whose runs must repeat.
    pub fn from_rng<R: rand_core::CryptoRng + ?Sized>(rng: &mut R) -> Self {
        let mut seed = Zeroizing::new([0u8; SEED_BYTES]);
        rng.fill_bytes(seed.as_mut());
        Self::from_seed(seed.as_ref()).expect("any 32 bytes are an Ed25519 seed")
    }

    /// The identity stored as `seed` ([`seed`](Self::seed)).
    pub fn from_seed(seed: &[u8]) -> Result<Self, IdentityError> {
        let seed: [u8; SEED_BYTES] = seed.try_into().map_err(|_| IdentityError::BadSeed)?;
        let pair = signature::Ed25519KeyPair::from_seed_unchecked(&seed)
            .map_err(|_| IdentityError::BadSeed)?;
        Ok(Self {
            seed: Zeroizing::new(seed),
            pair,
        })
    }

    /// The seed to store (privately: it is the identity).
    pub fn seed(&self) -> &[u8; SEED_BYTES] {
        &self.seed
    }

    /// The public key, registered with the coordinator at enrolment.
    pub fn public(&self) -> [u8; PUBLIC_KEY_BYTES] {
        self.pair
            .public_key()
            .as_ref()
            .try_into()
            .expect("an Ed25519 public key is 32 bytes")
    }

    /// Signs a statement.
    pub fn sign(&self, statement: &Statement) -> [u8; SIGNATURE_BYTES] {
        self.pair
            .sign(&statement.bytes)
            .as_ref()
            .try_into()
            .expect("an Ed25519 signature is 64 bytes")
    }
}

/// Checks that `signature` is client `index`'s (whose public key is `public`) over
/// `statement`.
pub fn verify(
    public: &[u8; PUBLIC_KEY_BYTES],
    statement: &Statement,
    signature: &[u8; SIGNATURE_BYTES],
    index: u32,
) -> Result<(), IdentityError> {
    signature::UnparsedPublicKey::new(&signature::ED25519, public)
        .verify(&statement.bytes, signature)
        .map_err(|_| IdentityError::BadSignature(index))
}

/// A public key's fingerprint as people compare it: the first 16 bytes of its SHA-256
/// in hex, in groups of four (`3f2a 9c01 ...`).
pub fn fingerprint(public: &[u8; PUBLIC_KEY_BYTES]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, public);
    digest.as_ref()[..16]
        .chunks(2)
        .map(|pair| format!("{:02x}{:02x}", pair[0], pair[1]))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The bytes a signature covers: a label naming the kind of statement, then each field
/// with its length, so that two different statements never share a byte string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    bytes: Vec<u8>,
}

impl Statement {
    /// A statement of the kind `label` (a fixed, versioned string per message kind).
    pub fn new(label: &str) -> Self {
        let mut s = Self { bytes: Vec::new() };
        s.bytes
            .extend_from_slice(b"cohort secagg signed statement v1\0");
        s.field(label.as_bytes())
    }

    /// Appends a field.
    pub fn field(mut self, bytes: &[u8]) -> Self {
        self.bytes
            .extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        self.bytes.extend_from_slice(bytes);
        self
    }

    /// Appends an integer field.
    pub fn number(self, n: u64) -> Self {
        self.field(&n.to_le_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn statement(round: u64) -> Statement {
        Statement::new("advertise keys")
            .number(round)
            .field(b"keys")
    }

    #[test]
    fn a_signature_verifies_only_for_its_key_and_statement() {
        let a = Identity::from_seed(&[1; 32]).unwrap();
        let b = Identity::from_seed(&[2; 32]).unwrap();
        let sig = a.sign(&statement(7));
        assert_eq!(verify(&a.public(), &statement(7), &sig, 1), Ok(()));
        assert_eq!(
            verify(&b.public(), &statement(7), &sig, 2),
            Err(IdentityError::BadSignature(2))
        );
        assert!(verify(&a.public(), &statement(8), &sig, 1).is_err());
        let mut flipped = sig;
        flipped[5] ^= 1;
        assert!(verify(&a.public(), &statement(7), &flipped, 1).is_err());
        // Ed25519 is deterministic: the same key signs a statement the same way.
        assert_eq!(sig, a.sign(&statement(7)));
    }

    #[test]
    fn fields_are_length_prefixed_so_statements_cannot_be_confused() {
        let ab_c = Statement::new("x").field(b"ab").field(b"c");
        let a_bc = Statement::new("x").field(b"a").field(b"bc");
        assert_ne!(ab_c, a_bc);
        assert_ne!(
            Statement::new("advertise").field(b""),
            Statement::new("advertis").field(b"e")
        );
    }

    #[test]
    fn identities_round_trip_through_their_seed_and_refuse_bad_ones() {
        let fresh = Identity::generate().unwrap();
        let again = Identity::from_seed(fresh.seed()).unwrap();
        assert_eq!(fresh.public(), again.public());
        assert_ne!(fresh.public(), Identity::generate().unwrap().public());
        assert_eq!(
            Identity::from_seed(&[0; 31]).unwrap_err(),
            IdentityError::BadSeed
        );
        let f = fingerprint(&fresh.public());
        assert_eq!(f.len(), 8 * 4 + 7, "{f}");
        assert!(!format!("{fresh:?}").contains(&format!("{:?}", fresh.seed())));
    }
}
