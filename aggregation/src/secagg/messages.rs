//! The typed messages of one secure round and the public round settings, with their JSON
//! form (bytes as unpadded base64url) for transports that carry JSON.
//!
//! Client indices are `1..=n` for the round's `n` selected clients: they are the Shamir
//! points and the graph's node names, so they are public and small.

use serde::{Deserialize, Serialize};

use super::crypto::KEY_BYTES;
use super::quantize::QuantizationParams;
use super::shamir::SHARE_BYTES;

/// Public settings of one secure round, fixed by the coordinator when it selects the
/// clients and sent to each of them with its task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoundConfig {
    /// 32 random bytes naming this round attempt. Every key derivation, AEAD and
    /// commitment is bound to it, and the neighbour graph is derived from it.
    #[serde(with = "b64_array")]
    pub session: [u8; KEY_BYTES],
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
}

/// Stage 1, client to server: the client's two public keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvertiseKeys {
    /// X25519 key for the share encryption keys.
    #[serde(with = "b64_array")]
    pub cipher_pk: [u8; KEY_BYTES],
    /// X25519 key for the pairwise masks.
    #[serde(with = "b64_array")]
    pub mask_pk: [u8; KEY_BYTES],
}

/// One client's entry in the key directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirectoryEntry {
    /// The client's index.
    pub index: u32,
    /// Its keys as advertised.
    #[serde(flatten)]
    pub keys: AdvertiseKeys,
}

/// Server to a client after stage 1: who advertised keys (the set `U1`, from which every
/// party derives the same neighbour graph) and the keys the client needs: its own and its
/// neighbours'. A client's directory grows with `n` by 4 bytes a member, not by a member's
/// keys, so a round's directories cost `O(n (4 + k * 88))` bytes, not `O(88 n^2)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyDirectory {
    /// `U1`, in ascending order.
    pub members: Vec<u32>,
    /// The keys of the recipient and its neighbours, in ascending index order (a
    /// directory with more entries, every member's, is accepted too).
    pub entries: Vec<DirectoryEntry>,
}

/// A share pair (self-mask seed and mask key) encrypted for one neighbour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncryptedShare {
    /// The neighbour it is for.
    pub to: u32,
    /// ChaCha20-Poly1305 of `from || to || seed share || key share`.
    #[serde(with = "b64_vec")]
    pub ciphertext: Vec<u8>,
    /// [`share_commitment`](super::crypto::share_commitment) to the seed share inside.
    #[serde(with = "b64_array")]
    pub seed_share_commitment: [u8; KEY_BYTES],
    /// [`share_commitment`](super::crypto::share_commitment) to the mask key share
    /// inside.
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
#[serde(deny_unknown_fields)]
pub struct ShareKeys {
    /// SHA-256 commitment to the self-mask seed, checked when the server rebuilds it.
    #[serde(with = "b64_array")]
    pub seed_commitment: [u8; KEY_BYTES],
    /// Exactly one per neighbour.
    pub shares: Vec<EncryptedShare>,
}

/// A ciphertext forwarded to its recipient.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardedShare {
    /// Who encrypted it.
    pub from: u32,
    /// The ciphertext as sent.
    #[serde(with = "b64_vec")]
    pub ciphertext: Vec<u8>,
    /// The sender's commitment to the seed share inside, as sent: the recipient checks
    /// the share it decrypts against it, so that the share it may reveal later is one
    /// the server can check too.
    #[serde(with = "b64_array")]
    pub seed_share_commitment: [u8; KEY_BYTES],
    /// The sender's commitment to the mask key share inside, as sent.
    #[serde(with = "b64_array")]
    pub key_share_commitment: [u8; KEY_BYTES],
}

/// Server to one client after stage 2: the shares its neighbours in `U2` (those that
/// completed stage 2) encrypted for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardedShares {
    /// One per neighbour in `U2`, in ascending sender order.
    pub shares: Vec<ForwardedShare>,
}

/// Server to the survivors after stage 3: who delivered a masked input (`U3`), in
/// ascending order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnmaskRequest {
    /// The set `U3`.
    pub survivors: Vec<u32>,
}

/// One share revealed in stage 4.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevealedShare {
    /// Whose secret it is a share of.
    pub owner: u32,
    /// The share ([`super::shamir::Share::to_bytes`]).
    #[serde(with = "b64_vec")]
    pub share: Vec<u8>,
}

/// Stage 4, client to server: for each neighbour in `U2`, the share of its self-mask seed
/// when it survived, or of its mask key when it dropped. Never both for one neighbour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
        };
        let json = serde_json::to_string(&keys).unwrap();
        assert_eq!(serde_json::from_str::<AdvertiseKeys>(&json).unwrap(), keys);
        assert!(json.len() < 120, "{json}");
        // 31 bytes is not a key.
        let short = serde_json::json!({"cipher_pk": "AQ", "mask_pk": "AQ"});
        assert!(serde_json::from_value::<AdvertiseKeys>(short).is_err());
        let not_b64 = serde_json::json!({"cipher_pk": "!!!", "mask_pk": "AQ"});
        assert!(serde_json::from_value::<AdvertiseKeys>(not_b64).is_err());
        let extra = serde_json::json!({"cipher_pk": "AQ", "mask_pk": "AQ", "x": 1});
        assert!(serde_json::from_value::<AdvertiseKeys>(extra).is_err());
        let dir = KeyDirectory {
            members: vec![3],
            entries: vec![DirectoryEntry { index: 3, keys }],
        };
        let json = serde_json::to_value(&dir).unwrap();
        assert_eq!(json["entries"][0]["index"], 3);
        assert_eq!(serde_json::from_value::<KeyDirectory>(json).unwrap(), dir);
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
}
