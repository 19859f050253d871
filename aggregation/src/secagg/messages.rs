//! The typed messages of one secure round and the public round settings, with their JSON
//! form (bytes as unpadded base64url) for transports that carry JSON.
//!
//! Client indices are `1..=n` for the round's `n` selected clients: they are the Shamir
//! points and the graph's node names, so they are public and small.

use serde::{Deserialize, Serialize};

use super::crypto::KEY_BYTES;
use super::identity::{PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Statement};
use super::quantize::QuantizationParams;
use super::shamir::SHARE_BYTES;

/// Public settings of one secure round, fixed by the coordinator when it selects the
/// clients and sent to each of them with its task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RoundConfig {
    /// 32 random bytes naming this round attempt. Every key derivation, AEAD and
    /// commitment is bound to it, and the neighbour graph is derived from it.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub session: [u8; KEY_BYTES],
    /// Which experiment, round and attempt this is. Every signature a client makes is
    /// bound to it, so a signed message of one round cannot be replayed in another.
    #[serde(default)]
    pub context: RoundContext,
    /// Clients selected; their indices are `1..=parties`.
    pub parties: u32,
    /// Shares needed to rebuild a secret (`t`); more than half of a neighbourhood.
    pub threshold: usize,
    /// Neighbours per client (`k`; rounded up to even, complete graph when `>= n - 1`).
    pub neighbours: usize,
    /// Model parameters `d` of the update.
    pub dimension: usize,
    /// How updates are quantised.
    pub quantization: QuantizationParams,
    /// Whether survivors run the consistency check before they reveal anything: each
    /// signs the survivor list it was sent, and reveals its shares only after seeing at
    /// least `threshold` valid signatures over the same list from its own neighbours, so
    /// a list the coordinator shows to one client alone (to learn which of its
    /// neighbours' shares it reveals) gathers nothing. One neighbourhood cannot be split
    /// between two lists without colluding clients signing both.
    #[serde(default)]
    pub consistency_check: bool,
}

/// Names one attempt of one round, as the coordinator's records do.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RoundContext {
    /// The experiment's id (empty in simulations).
    pub experiment: String,
    /// The round number.
    pub round: u64,
    /// The attempt of the round (a failed attempt runs again with fresh keys).
    pub attempt: u64,
}

impl RoundConfig {
    /// What a client signs when it advertises its keys: the round (session and context)
    /// and its index, keys and graph commitment.
    pub fn advertise_statement(
        &self,
        index: u32,
        cipher_pk: &[u8; KEY_BYTES],
        mask_pk: &[u8; KEY_BYTES],
        graph_commitment: &[u8; KEY_BYTES],
    ) -> Statement {
        self.statement("advertise keys v2")
            .number(index.into())
            .field(cipher_pk)
            .field(mask_pk)
            .field(graph_commitment)
    }

    /// What a survivor signs in the consistency check: the round and the survivor list
    /// it was sent, as the list's length and SHA-256.
    ///
    /// The digest rather than the list: Ed25519 hashes what it signs once per signature,
    /// and a client checks each of its neighbours' signatures, so with the list itself a
    /// round of 10,000 clients hashed 40 KB per signature, 40 signatures per client (most
    /// of a client's unmasking, and of the round's time in one process).
    pub fn survivors_statement(&self, survivors: &[u32]) -> Statement {
        let bytes: Vec<u8> = survivors.iter().flat_map(|i| i.to_le_bytes()).collect();
        let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
        self.statement("survivors v3")
            .number(survivors.len() as u64)
            .field(digest.as_ref())
    }

    fn statement(&self, label: &str) -> Statement {
        Statement::new(label)
            .field(&self.session)
            .field(self.context.experiment.as_bytes())
            .number(self.context.round)
            .number(self.context.attempt)
            .number(self.parties.into())
    }
}

/// Stage 1, client to server: the client's two public keys and its commitment to the
/// nonce it contributes to the neighbour graph, signed with its long-term identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AdvertiseKeys {
    /// X25519 key for the share encryption keys.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub cipher_pk: [u8; KEY_BYTES],
    /// X25519 key for the pairwise masks.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub mask_pk: [u8; KEY_BYTES],
    /// [`graph_commitment`](super::crypto::graph_commitment) to the client's graph
    /// nonce, revealed only once every member's commitment is fixed.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub graph_commitment: [u8; KEY_BYTES],
    /// Ed25519 signature by the client's registered identity over
    /// [`RoundConfig::advertise_statement`].
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub signature: [u8; SIGNATURE_BYTES],
}

/// Server to each member after stage 1: who advertised keys (`U1`) and every member's
/// graph commitment. A client reveals its graph nonce only after it holds this list, so
/// no nonce can be chosen after another is known: the neighbour graph is drawn from
/// randomness no single party (the coordinator included) controls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Roster {
    /// `U1`, in ascending order.
    pub members: Vec<u32>,
    /// Each member's graph commitment, in the order of `members`.
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<String>))]
    #[serde(with = "b64_arrays")]
    pub commitments: Vec<[u8; KEY_BYTES]>,
}

/// Stage 1b, client to server: the nonce behind the client's graph commitment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GraphReveal {
    /// 32 random bytes, fresh for the attempt.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub nonce: [u8; KEY_BYTES],
}

/// One client's entry in the key directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DirectoryEntry {
    /// The client's index.
    pub index: u32,
    /// Its keys as advertised, with their signature.
    #[serde(flatten)]
    pub keys: AdvertiseKeys,
    /// The Ed25519 public key the client registered at enrolment, which its signature
    /// must verify under.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub identity: [u8; PUBLIC_KEY_BYTES],
}

/// Server to a client once every member revealed its graph nonce: who advertised keys
/// (the set `U1`), every member's nonce (from which every party derives the same
/// neighbour graph) and the signed keys the client needs: its own and its neighbours'. A
/// client's directory grows with `n` by 36 bytes a member, not by a member's keys, so a
/// round's directories cost `O(n (36 + k * 200))` bytes, not `O(n^2)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct KeyDirectory {
    /// `U1`, in ascending order.
    pub members: Vec<u32>,
    /// Each member's graph nonce, in the order of `members`.
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<String>))]
    #[serde(with = "b64_arrays")]
    pub reveals: Vec<[u8; KEY_BYTES]>,
    /// The keys of the recipient and its neighbours, in ascending index order (a
    /// directory with more entries, every member's, is accepted too).
    pub entries: Vec<DirectoryEntry>,
}

/// A share pair (self-mask seed and mask key) encrypted for one neighbour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EncryptedShare {
    /// The neighbour it is for.
    pub to: u32,
    /// ChaCha20-Poly1305 of `from || to || seed share || key share`.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_vec")]
    pub ciphertext: Vec<u8>,
    /// [`share_commitment`](super::crypto::share_commitment) to the seed share inside.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub seed_share_commitment: [u8; KEY_BYTES],
    /// [`share_commitment`](super::crypto::share_commitment) to the mask key share
    /// inside.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub key_share_commitment: [u8; KEY_BYTES],
}

/// Bytes of an [`EncryptedShare`]'s plaintext.
pub const SHARE_PLAINTEXT_BYTES: usize = 8 + 2 * SHARE_BYTES;
/// Bytes of an [`EncryptedShare`]'s ciphertext.
pub const SHARE_CIPHERTEXT_BYTES: usize = SHARE_PLAINTEXT_BYTES + super::crypto::TAG_BYTES;

/// Stage 2, client to server: one encrypted share pair per neighbour with commitments
/// to both shares, and a commitment to the self-mask seed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ShareKeys {
    /// SHA-256 commitment to the self-mask seed, checked when the server rebuilds it.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub seed_commitment: [u8; KEY_BYTES],
    /// Exactly one per neighbour.
    pub shares: Vec<EncryptedShare>,
}

/// A ciphertext forwarded to its recipient.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForwardedShare {
    /// Who encrypted it.
    pub from: u32,
    /// The ciphertext as sent.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_vec")]
    pub ciphertext: Vec<u8>,
    /// The sender's commitment to the seed share inside, as sent: the recipient checks
    /// the share it decrypts against it, so that the share it may reveal later is one
    /// the server can check too.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub seed_share_commitment: [u8; KEY_BYTES],
    /// The sender's commitment to the mask key share inside, as sent.
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub key_share_commitment: [u8; KEY_BYTES],
}

/// Server to one client after stage 2: the shares its neighbours in `U2` (those that
/// completed stage 2) encrypted for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForwardedShares {
    /// One per neighbour in `U2`, in ascending sender order.
    pub shares: Vec<ForwardedShare>,
}

/// Server to the survivors after stage 3: who delivered a masked input (`U3`), in
/// ascending order. With the consistency check, the list is sent twice: first bare, for
/// the survivor to sign ([`Confirmation`]), then with the signatures of the survivor's
/// neighbours over the same list, before it reveals anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct UnmaskRequest {
    /// The set `U3`.
    pub survivors: Vec<u32>,
    /// With the consistency check, in the second sending: the recipient's neighbours'
    /// signatures over [`RoundConfig::survivors_statement`] of `survivors`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signatures: Vec<SurvivorSignature>,
}

/// One survivor's signature over the survivor list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SurvivorSignature {
    /// Who signed.
    pub index: u32,
    /// Ed25519 over [`RoundConfig::survivors_statement`].
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub signature: [u8; SIGNATURE_BYTES],
}

/// Consistency check, client to server: the survivor's signature over the survivor
/// list it was sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Confirmation {
    /// Ed25519 over [`RoundConfig::survivors_statement`].
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_array")]
    pub signature: [u8; SIGNATURE_BYTES],
}

/// One share revealed in stage 4.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RevealedShare {
    /// Whose secret it is a share of.
    pub owner: u32,
    /// The share ([`super::shamir::Share::to_bytes`]).
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = r"^[A-Za-z0-9_-]*$"))]
    #[serde(with = "b64_vec")]
    pub share: Vec<u8>,
}

/// Stage 4, client to server: for each neighbour in `U2`, the share of its self-mask seed
/// when it survived, or of its mask key when it dropped. Never both for one neighbour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct UnmaskShares {
    /// Shares of the self-mask seeds of surviving neighbours.
    pub seed_shares: Vec<RevealedShare>,
    /// Shares of the mask keys of neighbours that dropped after stage 2.
    pub key_shares: Vec<RevealedShare>,
}

/// The masked input of stage 3 as little-endian bytes, the form it travels and is stored
/// in.
pub fn encode_words(words: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(words.len() * 4);
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    out
}

/// Parses [`encode_words`]'s form, refusing a length that is not `expected` words.
pub fn decode_words(bytes: &[u8], expected: usize) -> Result<Vec<u32>, super::SecAggError> {
    if bytes.len() != expected * 4 {
        return Err(super::SecAggError::WrongLength {
            expected,
            found: bytes.len() / 4,
        });
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The masked input of stage 3 as it travels: the `dimension` model words in
/// `word_bits` (8, 16 or 32; [`super::Quantizer::word_bits`]) little-endian each, then
/// the weight and loss words in 32 bits. With 32-bit model words it is
/// [`encode_words`]'s form.
pub fn encode_masked(words: &[u32], dimension: usize, word_bits: u32) -> Vec<u8> {
    let bytes = (word_bits / 8) as usize;
    let mut out = Vec::with_capacity(dimension * bytes + (words.len() - dimension) * 4);
    for w in &words[..dimension] {
        out.extend_from_slice(&w.to_le_bytes()[..bytes]);
    }
    for w in &words[dimension..] {
        out.extend_from_slice(&w.to_le_bytes());
    }
    out
}

/// Parses [`encode_masked`]'s form into `dimension + EXTRA_WORDS` words, refusing any
/// other length.
pub fn decode_masked(
    bytes: &[u8],
    dimension: usize,
    word_bits: u32,
) -> Result<Vec<u32>, super::SecAggError> {
    let width = (word_bits / 8) as usize;
    let extra = super::quantize::EXTRA_WORDS;
    let expected = dimension * width + extra * 4;
    if !matches!(word_bits, 8 | 16 | 32) || bytes.len() != expected {
        return Err(super::SecAggError::BadMessage(format!(
            "masked input is {} bytes; {dimension} parameters in {word_bits}-bit words and \
             {extra} 32-bit words take {expected}",
            bytes.len()
        )));
    }
    let (model, tail) = bytes.split_at(dimension * width);
    let mut out: Vec<u32> = model
        .chunks_exact(width)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..width].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect();
    out.extend(
        tail.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
    Ok(out)
}

mod b64_vec {
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&URL_SAFE_NO_PAD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        URL_SAFE_NO_PAD
            .decode(text.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

mod b64_arrays {
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use serde::ser::SerializeSeq;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer, const N: usize>(
        list: &[[u8; N]],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(list.len()))?;
        for bytes in list {
            seq.serialize_element(&URL_SAFE_NO_PAD.encode(bytes))?;
        }
        seq.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>, const N: usize>(
        d: D,
    ) -> Result<Vec<[u8; N]>, D::Error> {
        let texts = <Vec<std::borrow::Cow<'de, str>>>::deserialize(d)?;
        texts
            .iter()
            .map(|text| {
                let v = URL_SAFE_NO_PAD
                    .decode(text.as_bytes())
                    .map_err(serde::de::Error::custom)?;
                let len = v.len();
                v.try_into()
                    .map_err(|_| serde::de::Error::custom(format!("expected {N} bytes, got {len}")))
            })
            .collect()
    }
}

mod b64_array {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer, const N: usize>(
        bytes: &[u8; N],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        super::b64_vec::serialize(bytes, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>, const N: usize>(
        d: D,
    ) -> Result<[u8; N], D::Error> {
        let v = super::b64_vec::deserialize(d)?;
        let len = v.len();
        v.try_into()
            .map_err(|_| serde::de::Error::custom(format!("expected {N} bytes, got {len}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_json_and_refuse_bad_bytes() {
        let keys = AdvertiseKeys {
            cipher_pk: [1; 32],
            mask_pk: [2; 32],
            graph_commitment: [3; 32],
            signature: [4; 64],
        };
        let json = serde_json::to_string(&keys).unwrap();
        assert_eq!(serde_json::from_str::<AdvertiseKeys>(&json).unwrap(), keys);
        assert!(json.len() < 300, "{json}");
        let mut value = serde_json::to_value(&keys).unwrap();
        // 1 byte is not a key, `!!!` not base64, and nothing may be added or left out.
        value["cipher_pk"] = "AQ".into();
        assert!(serde_json::from_value::<AdvertiseKeys>(value.clone()).is_err());
        value["cipher_pk"] = "!!!".into();
        assert!(serde_json::from_value::<AdvertiseKeys>(value).is_err());
        let mut extra = serde_json::to_value(&keys).unwrap();
        extra["x"] = 1.into();
        assert!(serde_json::from_value::<AdvertiseKeys>(extra).is_err());
        let mut unsigned = serde_json::to_value(&keys).unwrap();
        unsigned.as_object_mut().unwrap().remove("signature");
        assert!(serde_json::from_value::<AdvertiseKeys>(unsigned).is_err());
        let mut short_signature = serde_json::to_value(&keys).unwrap();
        short_signature["signature"] = serde_json::to_value(&keys).unwrap()["mask_pk"].clone();
        assert!(serde_json::from_value::<AdvertiseKeys>(short_signature).is_err());
        let dir = KeyDirectory {
            members: vec![3],
            reveals: vec![[5; 32]],
            entries: vec![DirectoryEntry {
                index: 3,
                keys,
                identity: [6; 32],
            }],
        };
        let json = serde_json::to_value(&dir).unwrap();
        assert_eq!(json["entries"][0]["index"], 3);
        assert!(
            json["entries"][0]["signature"].is_string(),
            "flattened keys"
        );
        assert_eq!(serde_json::from_value::<KeyDirectory>(json).unwrap(), dir);
        let roster = Roster {
            members: vec![1, 3],
            commitments: vec![[7; 32], [8; 32]],
        };
        let json = serde_json::to_value(&roster).unwrap();
        assert_eq!(
            serde_json::from_value::<Roster>(json.clone()).unwrap(),
            roster
        );
        let mut bad = json;
        bad["commitments"][1] = "AQ".into();
        assert!(serde_json::from_value::<Roster>(bad).is_err());
        let reveal = GraphReveal { nonce: [9; 32] };
        let json = serde_json::to_string(&reveal).unwrap();
        assert_eq!(serde_json::from_str::<GraphReveal>(&json).unwrap(), reveal);
        let confirmation = Confirmation {
            signature: [10; 64],
        };
        let json = serde_json::to_string(&confirmation).unwrap();
        assert_eq!(
            serde_json::from_str::<Confirmation>(&json).unwrap(),
            confirmation
        );
    }

    #[test]
    fn words_round_trip_and_wrong_lengths_are_refused() {
        let w = vec![0, 1, u32::MAX, 0x0102_0304];
        let b = encode_words(&w);
        assert_eq!(&b[12..], &[4, 3, 2, 1]);
        assert_eq!(decode_words(&b, 4).unwrap(), w);
        assert!(decode_words(&b, 3).is_err());
        assert!(decode_words(&b[..15], 4).is_err());
    }

    /// A masked upload in 16-bit words is half of today's 32-bit one (plus the two
    /// 32-bit weight and loss words), and reads back as the same words.
    #[test]
    fn narrow_masked_inputs_round_trip_at_half_the_size() {
        let d = 784 * 128 + 128 + 128 * 10 + 10;
        let words: Vec<u32> = (0..d as u32 + 2)
            .map(|i| {
                if (i as usize) < d {
                    (i * 7) & 0xffff
                } else {
                    u32::MAX - i
                }
            })
            .collect();
        let wide = encode_masked(&words, d, 32);
        assert_eq!(wide, encode_words(&words));
        let narrow = encode_masked(&words, d, 16);
        assert!((narrow.len() as f64) / (wide.len() as f64) < 0.5001);
        assert_eq!(decode_masked(&narrow, d, 16).unwrap(), words);
        let byte_words: Vec<u32> = words
            .iter()
            .enumerate()
            .map(|(i, w)| if i < d { w & 0xff } else { *w })
            .collect();
        assert_eq!(
            decode_masked(&encode_masked(&byte_words, d, 8), d, 8).unwrap(),
            byte_words
        );
        let short = decode_masked(&narrow[1..], d, 16).unwrap_err().to_string();
        assert!(short.contains("in 16-bit words"), "{short}");
        assert!(decode_masked(&narrow, d, 32).is_err());
    }
}
