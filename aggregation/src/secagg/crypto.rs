//! The protocol's cryptography: X25519 key pairs, HKDF-SHA256 derivations bound to the
//! round, ChaCha20-Poly1305 for the shares that travel through the coordinator, and the
//! commitment to a self-mask seed.
//!
//! Every derived key is bound to the round's 32-byte session id (the HKDF salt) and to
//! the client indices it serves (the HKDF info), so keys from one round, one pair or one
//! direction are useless for any other.

use ring::{aead, digest, hkdf};
use x25519_dalek::{PublicKey, StaticSecret};

/// Bytes of an X25519 public or private key, of seeds and of derived keys.
pub const KEY_BYTES: usize = 32;

/// Why a key agreement or decryption failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CryptoError {
    /// The peer's public key is a low-order point: the shared secret would be all zeros,
    /// known to anyone.
    #[error("public key is a low-order point")]
    WeakPublicKey,
    /// The ciphertext was not produced under this key for this sender and recipient, or
    /// was altered.
    #[error("ciphertext does not authenticate")]
    Unauthenticated,
}

/// An X25519 key pair. The private half can be exported, because SecAgg Shamir-shares
/// the mask key so that the server can rebuild a dropped client's pairwise masks.
pub struct KeyPair {
    secret: StaticSecret,
    public: [u8; KEY_BYTES],
}

// x25519-dalek wipes the private key on drop (its `zeroize` feature).
impl zeroize::ZeroizeOnDrop for KeyPair {}

impl std::fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyPair")
            .field("public", &hex(&self.public))
            .finish_non_exhaustive()
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl KeyPair {
    /// A fresh key pair from a cryptographic RNG.
    pub fn generate<R: rand_core::CryptoRng + ?Sized>(rng: &mut R) -> Self {
        let mut bytes = [0u8; KEY_BYTES];
        rng.fill_bytes(&mut bytes);
        Self::from_secret_bytes(bytes)
    }

    /// The key pair of a private key (clamped by X25519 itself).
    pub fn from_secret_bytes(bytes: [u8; KEY_BYTES]) -> Self {
        let secret = StaticSecret::from(bytes);
        let public = PublicKey::from(&secret).to_bytes();
        Self { secret, public }
    }

    /// The private key's bytes, to be secret-shared.
    pub fn secret_bytes(&self) -> [u8; KEY_BYTES] {
        self.secret.to_bytes()
    }

    /// The public key.
    pub fn public(&self) -> [u8; KEY_BYTES] {
        self.public
    }

    /// The X25519 shared secret with `peer`, refusing a low-order peer key.
    pub fn agree(&self, peer: &[u8; KEY_BYTES]) -> Result<[u8; KEY_BYTES], CryptoError> {
        #[cfg(target_arch = "x86_64")]
        if fast_x25519::available() {
            let secret = zeroize::Zeroizing::new(self.secret.to_bytes());
            return fast_x25519::agree(&secret, peer);
        }
        self.agree_portably(peer)
    }

    /// [`agree`](Self::agree) with x25519-dalek, on every CPU.
    fn agree_portably(&self, peer: &[u8; KEY_BYTES]) -> Result<[u8; KEY_BYTES], CryptoError> {
        let shared = self.secret.diffie_hellman(&PublicKey::from(*peer));
        if !shared.was_contributory() {
            return Err(CryptoError::WeakPublicKey);
        }
        Ok(shared.to_bytes())
    }
}

/// X25519 with graviola's assembly. X25519 is a function of its two inputs alone, so the
/// two implementations agree bit for bit (tested), and parties may use either.
#[cfg(target_arch = "x86_64")]
mod fast_x25519 {
    use std::sync::OnceLock;

    use graviola::key_agreement::x25519::{PublicKey, StaticPrivateKey};

    use super::{CryptoError, KEY_BYTES};

    /// Whether this CPU has every feature graviola asserts on first use (it panics
    /// without them, and valgrind hides ADX).
    pub(super) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("aes")
                && is_x86_feature_detected!("pclmulqdq")
                && is_x86_feature_detected!("bmi1")
                && is_x86_feature_detected!("bmi2")
                && is_x86_feature_detected!("adx")
                && is_x86_feature_detected!("avx")
                && is_x86_feature_detected!("avx2")
        })
    }

    pub(super) fn agree(
        secret: &[u8; KEY_BYTES],
        peer: &[u8; KEY_BYTES],
    ) -> Result<[u8; KEY_BYTES], CryptoError> {
        // The key wipes its copy of the secret when dropped, the shared secret its own.
        let key = StaticPrivateKey::from_array(secret);
        match key.diffie_hellman(&PublicKey::from_array(peer)) {
            Ok(shared) => Ok(shared.0),
            // Its only failure: an all-zero result, i.e. a low-order peer key.
            Err(_) => Err(CryptoError::WeakPublicKey),
        }
    }
}

struct Len32;

impl hkdf::KeyType for Len32 {
    fn len(&self) -> usize {
        KEY_BYTES
    }
}

fn hkdf32(ikm: &[u8], salt: &[u8; KEY_BYTES], info: &[&[u8]]) -> [u8; KEY_BYTES] {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(ikm);
    let mut out = [0u8; KEY_BYTES];
    prk.expand(info, Len32)
        .and_then(|okm| okm.fill(&mut out))
        .expect("32 bytes is far below HKDF-SHA256's output limit");
    out
}

/// The ChaCha20 key of the pairwise mask between clients `a` and `b`: the same for both
/// (the indices enter in ascending order), different for every pair and round.
pub fn pairwise_mask_seed(
    shared: &[u8; KEY_BYTES],
    session: &[u8; KEY_BYTES],
    a: u32,
    b: u32,
) -> [u8; KEY_BYTES] {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    hkdf32(
        shared,
        session,
        &[
            b"cohort secagg pairwise mask v1",
            &lo.to_le_bytes(),
            &hi.to_le_bytes(),
        ],
    )
}

/// The AEAD key for shares sent by `from` to `to`. Directional, so that the two shares a
/// pair exchanges never use one key (and nonce) twice.
pub fn share_key(
    shared: &[u8; KEY_BYTES],
    session: &[u8; KEY_BYTES],
    from: u32,
    to: u32,
) -> [u8; KEY_BYTES] {
    hkdf32(
        shared,
        session,
        &[
            b"cohort secagg share encryption v1",
            &from.to_le_bytes(),
            &to.to_le_bytes(),
        ],
    )
}

/// A key for some public purpose derived from the session id alone (the neighbour
/// graph's shuffle, for example): every party computes the same.
pub fn public_derivation(session: &[u8; KEY_BYTES], label: &[u8]) -> [u8; KEY_BYTES] {
    hkdf32(
        session,
        &[0u8; KEY_BYTES],
        &[b"cohort secagg public v1", label],
    )
}

fn aad(session: &[u8; KEY_BYTES], from: u32, to: u32) -> [u8; KEY_BYTES + 8] {
    let mut out = [0u8; KEY_BYTES + 8];
    out[..KEY_BYTES].copy_from_slice(session);
    out[KEY_BYTES..KEY_BYTES + 4].copy_from_slice(&from.to_le_bytes());
    out[KEY_BYTES + 4..].copy_from_slice(&to.to_le_bytes());
    out
}

fn aead_key(key: &[u8; KEY_BYTES]) -> aead::LessSafeKey {
    aead::LessSafeKey::new(
        aead::UnboundKey::new(&aead::CHACHA20_POLY1305, key).expect("a 32-byte key"),
    )
}

/// Bytes ChaCha20-Poly1305 adds to a plaintext.
pub const TAG_BYTES: usize = 16;

/// Encrypts `plaintext` from `from` to `to`. The key is used for this one message, so
/// the all-zero nonce is never repeated under it.
pub fn seal(
    key: &[u8; KEY_BYTES],
    session: &[u8; KEY_BYTES],
    from: u32,
    to: u32,
    plaintext: &[u8],
) -> Vec<u8> {
    let mut buf = plaintext.to_vec();
    aead_key(key)
        .seal_in_place_append_tag(
            aead::Nonce::assume_unique_for_key([0; 12]),
            aead::Aad::from(aad(session, from, to)),
            &mut buf,
        )
        .expect("plaintexts of a few hundred bytes are far below the AEAD limit");
    buf
}

/// Decrypts what [`seal`] made for the same key, session, sender and recipient.
pub fn open(
    key: &[u8; KEY_BYTES],
    session: &[u8; KEY_BYTES],
    from: u32,
    to: u32,
    ciphertext: &[u8],
) -> Result<Vec<u8>, CryptoError> {
    let mut buf = ciphertext.to_vec();
    let plain = aead_key(key)
        .open_in_place(
            aead::Nonce::assume_unique_for_key([0; 12]),
            aead::Aad::from(aad(session, from, to)),
            &mut buf,
        )
        .map_err(|_| CryptoError::Unauthenticated)?;
    let len = plain.len();
    buf.truncate(len);
    Ok(buf)
}

/// A binding commitment to client `owner`'s self-mask seed. It hides the seed (which is
/// 256 random bits) and lets the server check the seed it rebuilds from shares.
pub fn seed_commitment(
    session: &[u8; KEY_BYTES],
    owner: u32,
    seed: &[u8; KEY_BYTES],
) -> [u8; KEY_BYTES] {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(b"cohort secagg self-mask commitment v1");
    ctx.update(session);
    ctx.update(&owner.to_le_bytes());
    ctx.update(seed);
    sha256_of(ctx)
}

/// Which of a client's two secrets a share belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// The self-mask seed, revealed for a client that survived.
    Seed,
    /// The pairwise mask key, revealed for a client that dropped.
    MaskKey,
}

/// A binding commitment to one share: the share `owner` dealt to `holder` of one of its
/// secrets. The owner sends it in the clear with the encrypted share, so that the
/// server can tell a share revealed in stage 4 from a forged one and name the holder
/// that forged it, instead of failing the round on the owner's secret. It hides the
/// share: a share is five uniform field limbs (305 random bits), nothing to guess.
pub fn share_commitment(
    session: &[u8; KEY_BYTES],
    owner: u32,
    holder: u32,
    kind: SecretKind,
    share: &[u8],
) -> [u8; KEY_BYTES] {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(b"cohort secagg share commitment v1");
    ctx.update(session);
    ctx.update(&owner.to_le_bytes());
    ctx.update(&holder.to_le_bytes());
    ctx.update(&[match kind {
        SecretKind::Seed => 1,
        SecretKind::MaskKey => 2,
    }]);
    ctx.update(share);
    sha256_of(ctx)
}

/// The 32 bytes of a finished SHA-256.
fn sha256_of(ctx: digest::Context) -> [u8; KEY_BYTES] {
    ctx.finish()
        .as_ref()
        .try_into()
        .expect("SHA-256 gives 32 bytes")
}

/// A client's commitment to its graph nonce, sent with its keys. Binding the index and
/// session means a commitment cannot be copied from another client or round.
pub fn graph_commitment(
    session: &[u8; KEY_BYTES],
    index: u32,
    nonce: &[u8; KEY_BYTES],
) -> [u8; KEY_BYTES] {
    GraphCommitments::new(session).of(index, nonce)
}

/// [`graph_commitment`] for many members of one session. Every client checks every
/// member's nonce against its commitment (ten thousand hashes each in a round of ten
/// thousand); the label and the session fill the hash's first block, so it is hashed
/// once here and each commitment costs one more block instead of two.
#[derive(Clone)]
pub struct GraphCommitments {
    prefix: digest::Context,
}

impl GraphCommitments {
    /// The commitments of round `session`.
    pub fn new(session: &[u8; KEY_BYTES]) -> Self {
        let mut prefix = digest::Context::new(&digest::SHA256);
        prefix.update(b"cohort secagg graph commitment v1");
        prefix.update(session);
        Self { prefix }
    }

    /// Client `index`'s commitment to `nonce`.
    pub fn of(&self, index: u32, nonce: &[u8; KEY_BYTES]) -> [u8; KEY_BYTES] {
        let mut ctx = self.prefix.clone();
        ctx.update(&index.to_le_bytes());
        ctx.update(nonce);
        sha256_of(ctx)
    }
}

/// The seed of the neighbour graph: a hash of the session and every member's revealed
/// nonce, in member order. One honest member's nonce, committed before any other was
/// revealed, makes it uniform to everyone else, the coordinator included.
pub fn graph_seed(
    session: &[u8; KEY_BYTES],
    members: &[u32],
    reveals: &[[u8; KEY_BYTES]],
) -> [u8; KEY_BYTES] {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(b"cohort secagg graph seed v1");
    ctx.update(session);
    ctx.update(&(members.len() as u64).to_le_bytes());
    for (index, nonce) in members.iter().zip(reveals) {
        ctx.update(&index.to_le_bytes());
        ctx.update(nonce);
    }
    sha256_of(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    fn unhex(text: &str) -> [u8; KEY_BYTES] {
        let mut out = [0u8; KEY_BYTES];
        for (o, pair) in out.iter_mut().zip(text.as_bytes().chunks(2)) {
            *o = u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap();
        }
        out
    }

    #[test]
    fn x25519_gives_the_rfc_7748_results_on_either_implementation() {
        // RFC 7748 section 5.2; the second point has its top bit set, which X25519 must
        // ignore.
        for (scalar, point, expected) in [
            (
                "a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
                "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c",
                "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552",
            ),
            (
                "4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",
                "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493",
                "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957",
            ),
        ] {
            let pair = KeyPair::from_secret_bytes(unhex(scalar));
            assert_eq!(pair.agree(&unhex(point)), Ok(unhex(expected)));
            assert_eq!(pair.agree_portably(&unhex(point)), Ok(unhex(expected)));
        }
    }

    #[test]
    fn low_order_points_are_refused_by_either_implementation() {
        let pair = KeyPair::from_secret_bytes([0x42; KEY_BYTES]);
        let mut one = [0u8; KEY_BYTES];
        one[0] = 1;
        for point in [
            [0u8; KEY_BYTES],
            one,
            // A point of order 8 (from the libsodium blocklist).
            unhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
            unhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
        ] {
            assert_eq!(pair.agree(&point), Err(CryptoError::WeakPublicKey));
            assert_eq!(pair.agree_portably(&point), Err(CryptoError::WeakPublicKey));
        }
    }

    proptest::proptest! {
        /// A client on a CPU with graviola's features and one without must derive the
        /// same pair keys, or their masks would not cancel.
        #[test]
        fn both_x25519_implementations_agree(
            secret in proptest::prelude::any::<[u8; KEY_BYTES]>(),
            peer in proptest::prelude::any::<[u8; KEY_BYTES]>(),
        ) {
            let pair = KeyPair::from_secret_bytes(secret);
            proptest::prop_assert_eq!(pair.agree(&peer), pair.agree_portably(&peer));
            let other = KeyPair::from_secret_bytes(peer);
            proptest::prop_assert_eq!(pair.agree(&other.public()), other.agree(&pair.public()));
        }
    }

    #[test]
    fn a_commitment_is_the_hash_of_label_session_index_and_nonce() {
        // The shared first block must not change what is hashed: parties of other
        // versions compute the commitment in one pass.
        let session = [7u8; KEY_BYTES];
        let nonce = [9u8; KEY_BYTES];
        let mut whole = Vec::new();
        whole.extend_from_slice(b"cohort secagg graph commitment v1");
        whole.extend_from_slice(&session);
        whole.extend_from_slice(&1234u32.to_le_bytes());
        whole.extend_from_slice(&nonce);
        let expected = digest::digest(&digest::SHA256, &whole);
        let many = GraphCommitments::new(&session);
        assert_eq!(many.of(1234, &nonce).as_slice(), expected.as_ref());
        assert_eq!(
            graph_commitment(&session, 1234, &nonce),
            many.of(1234, &nonce)
        );
        assert_ne!(many.of(1235, &nonce), many.of(1234, &nonce));
        assert_ne!(
            GraphCommitments::new(&[8; KEY_BYTES]).of(1234, &nonce),
            many.of(1234, &nonce)
        );
    }

    #[test]
    fn both_sides_derive_the_same_pairwise_seed_and_only_they() {
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let (a, b, c) = (
            KeyPair::generate(&mut rng),
            KeyPair::generate(&mut rng),
            KeyPair::generate(&mut rng),
        );
        let s = [5; 32];
        let ab = pairwise_mask_seed(&a.agree(&b.public()).unwrap(), &s, 1, 2);
        let ba = pairwise_mask_seed(&b.agree(&a.public()).unwrap(), &s, 2, 1);
        assert_eq!(ab, ba);
        let ac = pairwise_mask_seed(&a.agree(&c.public()).unwrap(), &s, 1, 3);
        assert_ne!(ab, ac);
        let other_round = pairwise_mask_seed(&a.agree(&b.public()).unwrap(), &[6; 32], 1, 2);
        assert_ne!(ab, other_round);
        // A private key rebuilt from its bytes agrees on the same secrets.
        let a2 = KeyPair::from_secret_bytes(a.secret_bytes());
        assert_eq!(a2.public(), a.public());
        assert_eq!(a2.agree(&b.public()), a.agree(&b.public()));
    }

    #[test]
    fn low_order_public_keys_are_refused() {
        let a = KeyPair::generate(&mut ChaCha20Rng::seed_from_u64(2));
        assert_eq!(a.agree(&[0; 32]), Err(CryptoError::WeakPublicKey));
        let mut one = [0u8; 32];
        one[0] = 1;
        assert_eq!(a.agree(&one), Err(CryptoError::WeakPublicKey));
    }

    #[test]
    fn sealed_shares_open_only_for_their_sender_recipient_and_round() {
        let key = [9; 32];
        let s = [1; 32];
        let ct = seal(&key, &s, 3, 4, b"share bytes");
        assert_eq!(ct.len(), 11 + TAG_BYTES);
        assert_eq!(open(&key, &s, 3, 4, &ct).unwrap(), b"share bytes");
        assert!(open(&key, &s, 4, 3, &ct).is_err());
        assert!(open(&key, &[2; 32], 3, 4, &ct).is_err());
        assert!(open(&[8; 32], &s, 3, 4, &ct).is_err());
        let mut flipped = ct.clone();
        flipped[0] ^= 1;
        assert!(open(&key, &s, 3, 4, &flipped).is_err());
        assert!(open(&key, &s, 3, 4, &ct[..5]).is_err());
        assert_ne!(share_key(&key, &s, 3, 4), share_key(&key, &s, 4, 3));
    }

    #[test]
    fn commitments_bind_owner_seed_and_round() {
        let c = seed_commitment(&[1; 32], 7, &[2; 32]);
        assert_ne!(c, seed_commitment(&[1; 32], 8, &[2; 32]));
        assert_ne!(c, seed_commitment(&[1; 32], 7, &[3; 32]));
        assert_ne!(c, seed_commitment(&[0; 32], 7, &[2; 32]));
        let s = share_commitment(&[1; 32], 7, 8, SecretKind::Seed, &[3; 44]);
        assert_ne!(
            s,
            share_commitment(&[1; 32], 7, 8, SecretKind::MaskKey, &[3; 44])
        );
        assert_ne!(
            s,
            share_commitment(&[1; 32], 8, 7, SecretKind::Seed, &[3; 44])
        );
        assert_ne!(
            s,
            share_commitment(&[1; 32], 7, 8, SecretKind::Seed, &[4; 44])
        );
        assert_ne!(
            s,
            share_commitment(&[2; 32], 7, 8, SecretKind::Seed, &[3; 44])
        );
    }
}
