//! Secure aggregation: the coordinator learns the sum of the clients' updates and
//! nothing about any single one (SecAgg, Bonawitz et al. 2017, with the sparse neighbour
//! graph of SecAgg+, Bell et al. 2020).
//!
//! The protocol is two pure state machines, [`ClientSession`] and [`ServerSession`],
//! exchanging the typed messages of [`messages`]; moving the messages is the caller's
//! job (HTTP for `cohort serve`, function calls for `cohort simulate`). A round has up to
//! six stages, each with its own set of clients still present:
//!
//! 1. **Advertise keys** (`U1`): each client sends two X25519 public keys and a
//!    commitment to a fresh 32-byte graph nonce, signed with its long-term Ed25519
//!    identity ([`identity`]), which the coordinator registered at enrolment.
//! 2. **Reveal**: the server sends every member the list `U1` with every member's
//!    commitment; only then does each client reveal its nonce. The neighbour graph's
//!    seed is the hash of the session and all the nonces, so no party, the coordinator
//!    included, can choose the graph; a member that does not reveal fails the attempt
//!    (dropping it would let the coordinator choose among seeds).
//! 3. **Share keys** (`U2`): the server publishes the nonces and each client's
//!    neighbourhood keys with their signatures and identities. Each client checks every
//!    nonce against its commitment, derives the random `k`-regular graph ([`graph`]),
//!    and checks each neighbour's signature under a distinct registered identity, so the
//!    coordinator cannot substitute keys. It then draws a self-mask seed `b`,
//!    Shamir-shares `b` and its mask private key among its `k` neighbours with threshold
//!    `t` ([`shamir`]), and sends each neighbour its pair of shares under
//!    ChaCha20-Poly1305 with a key from X25519 and HKDF-SHA256 ([`crypto`]), through the
//!    server.
//! 4. **Masked input** (`U3`): each client quantises its update into `Z_2^32`
//!    ([`quantize`]) and adds the self mask `PRG(b)` and, for every neighbour `v` in
//!    `U2`, `+PRG(s_uv)` or `-PRG(s_uv)` (by index order), where `s_uv` comes from the
//!    pair's X25519 agreement; PRG is ChaCha20 ([`prg`]). The server adds the vectors.
//! 5. **Confirm** (with [`RoundConfig::consistency_check`]): the server names `U3`; each
//!    survivor signs the list it was sent, once. A survivor goes on only when it holds
//!    at least `t` valid signatures over the same list from its own neighbours: within
//!    one neighbourhood two different lists cannot both gather `t > k/2` signatures
//!    from honest clients. That is what stops the server from rebuilding a client's
//!    self-mask seed from holders told it survived and its neighbours' mask keys from
//!    holders told they dropped: a neighbour that reveals a share of the client's seed
//!    had `t` of its neighbours sign a list naming it, and its own key would need `t`
//!    others to answer a list without it, `2t > k` signers in all. Without the check
//!    that route works on sparse graphs (`attacks` shows a victim's exact input
//!    rebuilt), so [`ClientFloors`] refuse such rounds by default.
//! 6. **Unmask**: each surviving client reveals, for each neighbour in `U2`, the share of
//!    its seed if it is in `U3` and of its mask key if it is not, never both. The server
//!    rebuilds the seeds of `U3` and the keys of `U2 \ U3`, removes their masks, and
//!    decodes the weighted mean.
//!
//! Double masking is what makes a late client safe: if its input arrives after the
//! server declared it dropped, the server holds its pairwise masks but never its self
//! mask.
//!
//! # Security parameters
//!
//! | parameter | value | literature |
//! |---|---|---|
//! | self-mask seed, pairwise seeds, AEAD keys | 256 bits | Flower: 32-bit PRG seed; Bonawitz: 128+ bits |
//! | key agreement | X25519 (128-bit security) | Bonawitz: ECDH; Flower: P-384 |
//! | signatures on keys and survivor lists | Ed25519 under identities registered at enrolment | Bonawitz: signatures under a PKI |
//! | mask PRG | ChaCha20, RFC 8439 | Flower: MT19937 |
//! | share encryption | ChaCha20-Poly1305, one key per direction and round | Flower: Fernet |
//! | secret sharing | Shamir over GF(2^61 - 1), perfect secrecy per limb | Flower: GF(2^128) |
//! | threshold | `t > k / 2` of each neighbourhood, enforced | Bell et al.: `t > k/2` |
//! | neighbours | `k` configurable; by default `O(log n)`, sized so that 10% dropout fails a round with probability at most 10^-3 ([`default_neighbours`]) | Bell et al.: `O(log n)` |
//! | neighbour graph | drawn from every member's committed nonce | Bell et al.: a trusted or jointly drawn graph |
//!
//! The threshold above half a neighbourhood means the server cannot collect `t` seed
//! shares and `t` key shares of one client from disjoint sets of honest neighbours. With
//! signed keys, a jointly drawn graph and the consistency check, this holds against a
//! server that deviates from the protocol too, as long as it controls fewer clients in
//! a neighbourhood than [`sizing`] allows for; a server that enrols fake clients is
//! bounded by that fraction and exposed by identity fingerprints checked out of band.

pub mod client;
pub mod crypto;
pub mod floors;
pub mod graph;
pub mod identity;
pub mod local;
pub mod messages;
pub mod prg;
pub mod quantize;
pub mod server;
pub mod shamir;
pub mod sizing;

#[cfg(test)]
mod attacks;
#[cfg(test)]
mod tests;

use std::fmt;

pub use client::ClientSession;
pub use floors::{BelowFloor, ClientFloors};
pub use graph::{NeighbourGraph, effective_degree};
pub use identity::Identity;
pub use messages::{
    AdvertiseKeys, Confirmation, DirectoryEntry, EncryptedShare, ForwardedShare, ForwardedShares,
    GraphReveal, KeyDirectory, RevealedShare, Roster, RoundConfig, RoundContext, ShareKeys,
    SurvivorSignature, UnmaskRequest, UnmaskShares,
};
pub use quantize::{Decoded, EXTRA_WORDS, QuantizationParams, Quantizer};
pub use server::{Dropouts, ServerSession, ServerStage, Unmasked};

/// The stages of a secure round, named as `--dropout-stage` spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Advertise public keys and a graph commitment.
    Advertise,
    /// Reveal the graph nonce.
    Reveal,
    /// Share keys.
    Share,
    /// Masked input collection.
    Masked,
    /// Sign the survivor list (with the consistency check).
    Confirm,
    /// Unmasking.
    Unmask,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 6] = [
        Stage::Advertise,
        Stage::Reveal,
        Stage::Share,
        Stage::Masked,
        Stage::Confirm,
        Stage::Unmask,
    ];

    /// `advertise`, `reveal`, `share`, `masked`, `confirm` or `unmask`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Advertise => "advertise",
            Stage::Reveal => "reveal",
            Stage::Share => "share",
            Stage::Masked => "masked",
            Stage::Confirm => "confirm",
            Stage::Unmask => "unmask",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Stage {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Stage::ALL
            .into_iter()
            .find(|st| st.as_str() == s.trim())
            .ok_or_else(|| {
                format!(
                    "unknown stage `{s}`: expected advertise, reveal, share, masked, confirm \
                     or unmask"
                )
            })
    }
}

/// Why a secure-aggregation step was refused or a round failed. A refused message
/// changes nothing; a failed round accepts nothing more.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SecAggError {
    /// A round setting is out of range.
    #[error("invalid secure aggregation setting: {0}")]
    InvalidConfig(String),
    /// A message for another stage.
    #[error("expected a {expected} message, the round is at {}", actual.map_or("its end".to_string(), |s| s.to_string()))]
    WrongStage {
        /// The stage the message belongs to.
        expected: Stage,
        /// Where the round is (`None`: finished).
        actual: Option<Stage>,
    },
    /// A client index outside `1..=n`.
    #[error("client {0} is not one of the round's clients")]
    UnknownClient(u32),
    /// A client that is not (or no longer) in the round at this stage.
    #[error("client {0} is not in the round at this stage")]
    NotInRound(u32),
    /// A second message from one client, or a client named twice.
    #[error("client {0} appears twice")]
    Duplicate(u32),
    /// A share for, or from, a client outside the neighbourhood.
    #[error("clients {from} and {to} are not neighbours")]
    NotNeighbour {
        /// The sender (or owner).
        from: u32,
        /// The recipient (or holder).
        to: u32,
    },
    /// A vector or ciphertext of the wrong length.
    #[error("expected {expected} items, got {found}")]
    WrongLength {
        /// The right length.
        expected: usize,
        /// The length given.
        found: usize,
    },
    /// A list that must be strictly ascending is not.
    #[error("client lists must be strictly ascending")]
    Unsorted,
    /// A message that is well-formed but inconsistent with the round.
    #[error("{0}")]
    BadMessage(String),
    /// Too few clients remain after a stage for the threshold: the round fails before
    /// anything more is revealed.
    #[error("only {have} clients after the {stage} stage, {need} needed")]
    TooFewParticipants {
        /// The stage that closed.
        stage: Stage,
        /// Clients remaining.
        have: usize,
        /// Clients needed.
        need: usize,
    },
    /// A client with fewer than `t` neighbours left: its secrets could not be rebuilt.
    #[error("client {client} has {have} neighbours left, {need} needed")]
    TooFewNeighbours {
        /// The client.
        client: u32,
        /// Neighbours left.
        have: usize,
        /// The threshold.
        need: usize,
    },
    /// Fewer than `t` shares of a secret arrived: the sum cannot be unmasked.
    #[error("only {have} shares of client {client}'s secret, {need} needed")]
    CannotRecover {
        /// Whose secret.
        client: u32,
        /// Shares received.
        have: usize,
        /// The threshold.
        need: usize,
    },
    /// The shares of a secret combine to something that fails its check (a commitment
    /// or public key): a client sent a wrong share.
    #[error("the shares of client {client}'s secret are inconsistent")]
    ReconstructionFailed {
        /// Whose secret.
        client: u32,
    },
    /// A share revealed in stage 4 that is not the one its owner dealt (it does not
    /// match the owner's commitment): the holder forged or corrupted it. The holder's
    /// answer is refused and the holder excluded from the round's unmasking; the
    /// secret is rebuilt from the other holders' shares.
    #[error(
        "client {holder} revealed a share of client {owner}'s secret that its owner never dealt"
    )]
    WrongShare {
        /// Who revealed it.
        holder: u32,
        /// Whose secret it claims to be a share of.
        owner: u32,
    },
    /// A client excluded earlier in the round for a forged share.
    #[error("client {0} was excluded from this round for revealing a forged share")]
    Excluded(u32),
    /// Members that advertised keys but never revealed their graph nonce: the graph
    /// cannot be drawn without every committed nonce, so the attempt fails (a server
    /// free to leave nonces out could choose among graphs).
    #[error("clients {0:?} never revealed their graph nonce")]
    MissingReveals(Vec<u32>),
    /// A signature that does not verify under the signer's registered identity, or an
    /// identity that is not distinct: the message is refused and a client aborts the
    /// round.
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    /// Too few valid signatures over the survivor list from a client's neighbours: the
    /// client reveals nothing.
    #[error("only {have} of client {client}'s neighbours signed the survivor list, {need} needed")]
    TooFewConfirmations {
        /// The client.
        client: u32,
        /// Valid signatures from its neighbours.
        have: usize,
        /// The threshold.
        need: usize,
    },
    /// A round setting below the client's floor: the client refuses the round.
    #[error(transparent)]
    BelowFloor(#[from] floors::BelowFloor),
    /// The round failed earlier with this error.
    #[error("the round failed: {0}")]
    RoundFailed(Box<SecAggError>),
    /// Key agreement or decryption failed.
    #[error(transparent)]
    Crypto(#[from] crypto::CryptoError),
    /// Secret sharing failed.
    #[error(transparent)]
    Shamir(#[from] shamir::ShamirError),
    /// The neighbour graph could not be built.
    #[error(transparent)]
    Graph(#[from] graph::GraphError),
    /// Quantisation or decoding failed.
    #[error(transparent)]
    Quantize(#[from] quantize::QuantizeError),
    /// The mask generator refused (a vector too long for one keystream).
    #[error(transparent)]
    Prg(#[from] prg::PrgError),
    /// The reducer (a device backend) failed.
    #[error("reducer: {0}")]
    Reducer(String),
}

/// Largest model a secure round takes: `2^28` parameters, as for plain models.
pub const MAX_DIMENSION: usize = 1 << 28;

/// The dropout rate the default neighbourhood is sized for: each client leaves the
/// round, at any stage, with this probability.
pub const DESIGN_DROPOUT: f64 = 0.1;

/// The round failure probability the default neighbourhood is sized to stay under at
/// [`DESIGN_DROPOUT`].
pub const DESIGN_FAILURE: f64 = 1e-3;

/// `P[X < t]` for `X ~ Binomial(k, p)`.
fn binomial_below(k: usize, p: f64, t: usize) -> f64 {
    let mut pmf = (1.0 - p).powi(k as i32); // P[X = 0]
    let mut sum = 0.0;
    for x in 0..t.min(k + 1) {
        sum += pmf;
        // P[X = x + 1] from P[X = x].
        pmf *= (k - x) as f64 / (x + 1) as f64 * p / (1.0 - p);
    }
    sum.min(1.0)
}

/// An upper bound (the union bound over clients) on the probability that a round of `n`
/// clients with `k` neighbours and threshold `t` cannot be unmasked when each client drops
/// out independently with probability `dropout`: some client's secret finds fewer than
/// `t` of its `k` neighbours to reveal shares.
pub fn failure_bound(n: usize, k: usize, t: usize, dropout: f64) -> f64 {
    let k = effective_degree(n, k);
    (n as f64 * binomial_below(k, 1.0 - dropout, t)).min(1.0)
}

/// The default neighbours for `n` clients: the smallest even `k >= 2 * ceil(log2 n)`
/// (the usual SecAgg+ choice, `O(log n)`) for which, with the default threshold, a round
/// fails with probability at most [`DESIGN_FAILURE`] when clients drop out at
/// [`DESIGN_DROPOUT`]; the complete graph when that is no smaller. 20 for 100 clients,
/// 24 for 500, the complete graph for 10.
pub fn default_neighbours(n: usize) -> usize {
    if n < 2 {
        return 1;
    }
    let log = (usize::BITS - (n - 1).leading_zeros()) as usize;
    let mut k = (2 * log).max(2);
    while k < n - 1 {
        let t = effective_degree(n, k) / 2 + 1;
        if failure_bound(n, k, t, DESIGN_DROPOUT) <= DESIGN_FAILURE {
            return k;
        }
        k += 2;
    }
    n - 1
}

/// The default threshold for `k` neighbours among `n` clients: just over half the
/// effective neighbourhood, `floor(k' / 2) + 1`.
pub fn default_threshold(n: usize, k: usize) -> usize {
    effective_degree(n, k) / 2 + 1
}

impl RoundConfig {
    /// Checks every setting and returns the round's quantiser.
    pub fn validate(&self) -> Result<Quantizer, SecAggError> {
        let bad = |m: String| Err(SecAggError::InvalidConfig(m));
        if self.parties < 2 {
            return bad(format!(
                "secure aggregation needs at least 2 clients, got {}",
                self.parties
            ));
        }
        if self.neighbours == 0 {
            return bad("neighbours must be at least 1".into());
        }
        let k = effective_degree(self.parties as usize, self.neighbours);
        if self.threshold == 0 || 2 * self.threshold <= k || self.threshold > k {
            return bad(format!(
                "threshold must be more than half of the {k} neighbours and at most {k} \
                 (between {} and {k}), got {}",
                k / 2 + 1,
                self.threshold
            ));
        }
        if self.dimension == 0 || self.dimension > MAX_DIMENSION {
            return bad(format!(
                "dimension must be between 1 and {MAX_DIMENSION}, got {}",
                self.dimension
            ));
        }
        Ok(Quantizer::new(self.quantization, self.parties)?)
    }
}

/// Checks that `list` is strictly ascending with every index in `1..=parties`.
pub(crate) fn check_ascending(list: &[u32], parties: u32) -> Result<(), SecAggError> {
    if list.windows(2).any(|w| w[0] >= w[1]) {
        return Err(SecAggError::Unsorted);
    }
    if let Some(&u) = list.iter().find(|&&u| u == 0 || u > parties) {
        return Err(SecAggError::UnknownClient(u));
    }
    Ok(())
}
