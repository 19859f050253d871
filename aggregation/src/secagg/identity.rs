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

/// One signature to check with [`verify_all`].
#[derive(Debug, Clone, Copy)]
pub struct Signed<'a> {
    /// The signer's registered public key.
    pub public: &'a [u8; PUBLIC_KEY_BYTES],
    /// What it signed.
    pub statement: &'a Statement,
    /// The signature.
    pub signature: &'a [u8; SIGNATURE_BYTES],
    /// The signer's index in the round, named when its signature fails.
    pub index: u32,
}

/// Checks every signature, as [`verify`] would one by one, in one batch equation
/// (ed25519-dalek's random linear combination): a client checks forty neighbours'
/// signatures twice a round, and a batch costs a third of forty single checks.
///
/// When the batch fails, each signature is checked alone with [`verify`] and the first
/// that fails is named; if none does, the set is accepted. So every set that passes one
/// by one passes here, and a signature that does not verify alone can pass only as part
/// of a batch whose combination cancels: for a key without a small-order component a
/// forgery, which a batch equation admits with probability 2^-128, and otherwise a
/// signature its key's holder crafted on purpose (the batch and single equations treat
/// torsion differently), which lets it only say what it could have signed anyway.
pub fn verify_all(signed: &[Signed<'_>]) -> Result<(), IdentityError> {
    if signed.len() > 1 && batch_verifies(signed) {
        return Ok(());
    }
    signed
        .iter()
        .try_for_each(|s| verify(s.public, s.statement, s.signature, s.index))
}

fn batch_verifies(signed: &[Signed<'_>]) -> bool {
    let keys: Result<Vec<ed25519_dalek::VerifyingKey>, _> = signed
        .iter()
        .map(|s| ed25519_dalek::VerifyingKey::from_bytes(s.public))
        .collect();
    let Ok(keys) = keys else {
        return false;
    };
    let signatures: Vec<ed25519_dalek::Signature> = signed
        .iter()
        .map(|s| ed25519_dalek::Signature::from_bytes(s.signature))
        .collect();
    let messages: Vec<&[u8]> = signed.iter().map(|s| &s.statement.bytes[..]).collect();
    ed25519_dalek::verify_batch(&messages, &signatures, &keys).is_ok()
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
    fn a_batch_passes_exactly_when_every_signature_does_and_names_the_first_bad_one() {
        let people: Vec<Identity> = (0..40u8)
            .map(|i| Identity::from_seed(&[i; 32]).unwrap())
            .collect();
        let statements: Vec<Statement> = (0..40u64).map(statement).collect();
        let mut signatures: Vec<[u8; SIGNATURE_BYTES]> = people
            .iter()
            .zip(&statements)
            .map(|(p, s)| p.sign(s))
            .collect();
        let publics: Vec<[u8; PUBLIC_KEY_BYTES]> = people.iter().map(Identity::public).collect();
        let check = |signatures: &[[u8; SIGNATURE_BYTES]], publics: &[[u8; PUBLIC_KEY_BYTES]]| {
            let signed: Vec<Signed<'_>> = (0..40)
                .map(|i| Signed {
                    public: &publics[i],
                    statement: &statements[i],
                    signature: &signatures[i],
                    index: 100 + i as u32,
                })
                .collect();
            verify_all(&signed)
        };
        assert_eq!(check(&signatures, &publics), Ok(()));
        assert_eq!(verify_all(&[]), Ok(()));
        // One flipped bit anywhere, in R, in s, or a signature moved to another key.
        signatures[17][3] ^= 1;
        signatures[30][40] ^= 0x80;
        assert_eq!(
            check(&signatures, &publics),
            Err(IdentityError::BadSignature(117))
        );
        signatures[17][3] ^= 1;
        assert_eq!(
            check(&signatures, &publics),
            Err(IdentityError::BadSignature(130))
        );
        signatures[30][40] ^= 0x80;
        let mut swapped = publics.clone();
        swapped.swap(2, 9);
        assert_eq!(
            check(&signatures, &swapped),
            Err(IdentityError::BadSignature(102))
        );
        // A key that is not a curve point fails alone, not the batch's parsing.
        let mut bad_key = publics.clone();
        bad_key[5] = [0xff; PUBLIC_KEY_BYTES];
        assert_eq!(
            check(&signatures, &bad_key),
            Err(IdentityError::BadSignature(105))
        );
        // s past the group order (malleated) is refused as ring refuses it.
        let mut malleated = signatures.clone();
        malleated[8][63] |= 0xf0;
        assert_eq!(
            check(&malleated, &publics),
            Err(IdentityError::BadSignature(108))
        );
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
