//! The client side of a secure round, as a state machine: each method checks the
//! server's message completely before it changes anything, and a refused message leaves
//! the client where it was.

use std::collections::{BTreeMap, BTreeSet};

use zeroize::Zeroizing;

use super::crypto::{self, KEY_BYTES, KeyPair, SecretKind};
use super::floors::ClientFloors;
use super::graph::{NeighbourGraph, effective_degree};
use super::identity::{self, Identity, IdentityError, PUBLIC_KEY_BYTES};
use super::messages::{
    AdvertiseKeys, Confirmation, EncryptedShare, ForwardedShares, GraphReveal, KeyDirectory,
    RevealedShare, Roster, RoundConfig, SHARE_CIPHERTEXT_BYTES, SHARE_PLAINTEXT_BYTES, ShareKeys,
    UnmaskRequest, UnmaskShares,
};
use super::prg::{self, Mask, MaskSign};
use super::quantize::{EXTRA_WORDS, Quantizer};
use super::shamir::{self, SHARE_BYTES, Share};
use super::{SecAggError, Stage, check_ascending};

/// One client's part in one secure round.
pub struct ClientSession {
    config: RoundConfig,
    quantizer: Quantizer,
    floors: ClientFloors,
    me: u32,
    /// This client's registered identity (public half): no neighbour may present it.
    identity: [u8; PUBLIC_KEY_BYTES],
    cipher: KeyPair,
    mask: KeyPair,
    /// The nonce this client contributes to the neighbour graph.
    graph_nonce: [u8; KEY_BYTES],
    graph_commitment: [u8; KEY_BYTES],
    state: ClientState,
}

// Every secret a session holds wipes itself when dropped: the key pairs
// (x25519-dalek's `zeroize`), the self-mask seed, the pair keys and the shares held.
impl zeroize::ZeroizeOnDrop for ClientSession {}

impl std::fmt::Debug for ClientSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientSession")
            .field("me", &self.me)
            .field("stage", &self.stage())
            .finish_non_exhaustive()
    }
}

/// What this client derived for one neighbour in stage 2. Wiped when dropped.
#[derive(zeroize::Zeroize, zeroize::ZeroizeOnDrop)]
struct PairKeys {
    /// Opens the share the neighbour encrypted for this client.
    incoming: [u8; KEY_BYTES],
    /// Seeds the pairwise mask.
    mask_seed: [u8; KEY_BYTES],
}

enum ClientState {
    /// Keys advertised; waiting for the roster.
    Advertised,
    /// Graph nonce revealed; waiting for the directory, which must list the same members
    /// with nonces matching these commitments.
    Revealed {
        members: Vec<u32>,
        commitments: Vec<[u8; KEY_BYTES]>,
    },
    /// Shares sent; waiting for the neighbours' shares.
    Shared {
        /// The neighbours' registered identities, for the consistency check.
        identities: BTreeMap<u32, [u8; PUBLIC_KEY_BYTES]>,
        /// The neighbours in the graph over `U1`, each with the key that opens its share
        /// for this client and the pair's mask seed (agreed once, used in stage 3).
        neighbours: BTreeMap<u32, PairKeys>,
        self_seed: Zeroizing<[u8; KEY_BYTES]>,
    },
    /// Masked input sent; holding the neighbours' shares until the unmask request.
    Masked {
        /// All neighbours in the graph over `U1`, with their registered identities.
        neighbours: BTreeMap<u32, [u8; PUBLIC_KEY_BYTES]>,
        /// Neighbours in `U2` and the (seed, key) shares each gave this client.
        held: BTreeMap<u32, (Share, Share)>,
    },
    /// The survivor list signed (consistency check); waiting for the neighbours'
    /// signatures over it.
    Confirmed {
        neighbours: BTreeMap<u32, [u8; PUBLIC_KEY_BYTES]>,
        held: BTreeMap<u32, (Share, Share)>,
        survivors: Vec<u32>,
    },
    /// Shares revealed; the session answers nothing more.
    Done,
}

impl ClientSession {
    /// Joins a round as client `me` (in `1..=config.parties`) with its registered
    /// `identity`: makes the two key pairs and the graph nonce and returns the signed
    /// stage 1 message. The settings must meet [`ClientFloors::default`]; see
    /// [`with_floors`](Self::with_floors).
    pub fn new<R: rand_core::CryptoRng + ?Sized>(
        config: RoundConfig,
        me: u32,
        identity: &Identity,
        rng: &mut R,
    ) -> Result<(Self, AdvertiseKeys), SecAggError> {
        Self::with_floors(config, me, ClientFloors::default(), identity, rng)
    }

    /// [`new`](Self::new) for a client with its own floors: a round whose settings fall
    /// below them is refused here ([`SecAggError::BelowFloor`]), and an unmask request
    /// whose survivors fall below them is refused in stage 4.
    pub fn with_floors<R: rand_core::CryptoRng + ?Sized>(
        config: RoundConfig,
        me: u32,
        floors: ClientFloors,
        identity: &Identity,
        rng: &mut R,
    ) -> Result<(Self, AdvertiseKeys), SecAggError> {
        floors.validate().map_err(SecAggError::InvalidConfig)?;
        let quantizer = config.validate()?;
        floors.check(&config)?;
        if me == 0 || me > config.parties {
            return Err(SecAggError::UnknownClient(me));
        }
        let cipher = KeyPair::generate(rng);
        let mask = KeyPair::generate(rng);
        let mut graph_nonce = [0u8; KEY_BYTES];
        rng.fill_bytes(&mut graph_nonce);
        let graph_commitment = crypto::graph_commitment(&config.session, me, &graph_nonce);
        let (cipher_pk, mask_pk) = (cipher.public(), mask.public());
        let statement = config.advertise_statement(me, &cipher_pk, &mask_pk, &graph_commitment);
        let advertised = AdvertiseKeys {
            cipher_pk,
            mask_pk,
            graph_commitment,
            signature: identity.sign(&statement),
        };
        Ok((
            Self {
                config,
                quantizer,
                floors,
                me,
                identity: identity.public(),
                cipher,
                mask,
                graph_nonce,
                graph_commitment,
                state: ClientState::Advertised,
            },
            advertised,
        ))
    }

    /// This client's index.
    pub fn index(&self) -> u32 {
        self.me
    }

    /// The round's settings.
    pub fn config(&self) -> &RoundConfig {
        &self.config
    }

    /// The stage whose server message the client waits for next (`None` when done).
    pub fn stage(&self) -> Option<Stage> {
        match self.state {
            ClientState::Advertised => Some(Stage::Reveal),
            ClientState::Revealed { .. } => Some(Stage::Share),
            ClientState::Shared { .. } => Some(Stage::Masked),
            ClientState::Masked { .. } if self.config.consistency_check => Some(Stage::Confirm),
            ClientState::Masked { .. } | ClientState::Confirmed { .. } => Some(Stage::Unmask),
            ClientState::Done => None,
        }
    }

    fn wrong_stage(&self, expected: Stage) -> SecAggError {
        SecAggError::WrongStage {
            expected,
            actual: self.stage(),
        }
    }

    /// Stage 2: checks the roster (`U1` and every member's graph commitment) and reveals
    /// this client's graph nonce. The roster is kept: the directory must list the same
    /// members, with nonces that match these commitments.
    pub fn reveal(&mut self, roster: &Roster) -> Result<GraphReveal, SecAggError> {
        if !matches!(self.state, ClientState::Advertised) {
            return Err(self.wrong_stage(Stage::Reveal));
        }
        check_ascending(&roster.members, self.config.parties)?;
        if roster.commitments.len() != roster.members.len() {
            return Err(SecAggError::WrongLength {
                expected: roster.members.len(),
                found: roster.commitments.len(),
            });
        }
        let Ok(position) = roster.members.binary_search(&self.me) else {
            return Err(SecAggError::NotInRound(self.me));
        };
        if roster.commitments[position] != self.graph_commitment {
            return Err(SecAggError::BadMessage(
                "the roster does not hold this client's own graph commitment".into(),
            ));
        }
        let t = self.config.threshold;
        let k = effective_degree(roster.members.len(), self.config.neighbours);
        if k < t {
            return Err(SecAggError::TooFewParticipants {
                stage: Stage::Advertise,
                have: roster.members.len(),
                need: t + 1,
            });
        }
        self.state = ClientState::Revealed {
            members: roster.members.clone(),
            commitments: roster.commitments.clone(),
        };
        Ok(GraphReveal {
            nonce: self.graph_nonce,
        })
    }

    /// Stage 3's checks of the key directory before anything is derived from it: the
    /// roster's members, every member's graph nonce against its commitment, entries for
    /// members only (ascending), and this client's own keys as it advertised them.
    /// Returns the indices the directory has keys for.
    fn check_directory(
        &self,
        directory: &KeyDirectory,
        members: &[u32],
        commitments: &[[u8; KEY_BYTES]],
    ) -> Result<Vec<u32>, SecAggError> {
        if directory.members != *members {
            return Err(SecAggError::BadMessage(
                "the directory's members are not the roster's".into(),
            ));
        }
        if directory.reveals.len() != members.len() {
            return Err(SecAggError::WrongLength {
                expected: members.len(),
                found: directory.reveals.len(),
            });
        }
        let committed = crypto::GraphCommitments::new(&self.config.session);
        if let Some((&v, _)) = members
            .iter()
            .zip(directory.reveals.iter().zip(commitments))
            .find(|(v, (nonce, c))| committed.of(**v, nonce) != **c)
        {
            return Err(SecAggError::BadMessage(format!(
                "client {v}'s graph nonce does not match its commitment"
            )));
        }
        let indices: Vec<u32> = directory.entries.iter().map(|e| e.index).collect();
        check_ascending(&indices, self.config.parties)?;
        if let Some(&v) = indices.iter().find(|v| members.binary_search(v).is_err()) {
            return Err(SecAggError::BadMessage(format!(
                "the directory has keys for client {v}, who is not a member"
            )));
        }
        let mine = directory
            .entries
            .iter()
            .find(|e| e.index == self.me)
            .ok_or_else(|| {
                SecAggError::BadMessage("the directory does not hold this client's keys".into())
            })?;
        if mine.keys.cipher_pk != self.cipher.public()
            || mine.keys.mask_pk != self.mask.public()
            || mine.identity != self.identity
        {
            return Err(SecAggError::BadMessage(
                "the directory does not hold this client's own keys".into(),
            ));
        }
        Ok(indices)
    }

    /// Each neighbour's keys must carry the roster's graph commitment and its signature
    /// under a registered identity that no other party of this neighbourhood (this
    /// client included) presents: keys the coordinator made itself would fail here.
    /// Returns each neighbour's identity.
    fn verify_neighbour_keys(
        &self,
        directory: &KeyDirectory,
        indices: &[u32],
        members: &[u32],
        commitments: &[[u8; KEY_BYTES]],
        neighbours: &[u32],
    ) -> Result<BTreeMap<u32, [u8; PUBLIC_KEY_BYTES]>, SecAggError> {
        let mut identities: BTreeMap<u32, [u8; PUBLIC_KEY_BYTES]> = BTreeMap::new();
        let mut seen: BTreeMap<[u8; PUBLIC_KEY_BYTES], u32> = BTreeMap::new();
        seen.insert(self.identity, self.me);
        let mut statements = Vec::with_capacity(neighbours.len());
        for &v in neighbours {
            let entry = &directory.entries[indices.binary_search(&v).expect("checked")];
            let position = members.binary_search(&v).expect("a member");
            if entry.keys.graph_commitment != commitments[position] {
                return Err(SecAggError::BadMessage(format!(
                    "client {v}'s keys carry another graph commitment than the roster's"
                )));
            }
            statements.push((
                entry,
                self.config.advertise_statement(
                    v,
                    &entry.keys.cipher_pk,
                    &entry.keys.mask_pk,
                    &entry.keys.graph_commitment,
                ),
            ));
        }
        // Signatures before shared identities: keys presented under an identity that
        // did not sign them are named as such, whoever else holds it.
        let signed: Vec<identity::Signed<'_>> = statements
            .iter()
            .map(|(entry, statement)| identity::Signed {
                public: &entry.identity,
                statement,
                signature: &entry.keys.signature,
                index: entry.index,
            })
            .collect();
        identity::verify_all(&signed)?;
        for (entry, _) in &statements {
            let v = entry.index;
            if let Some(&other) = seen.get(&entry.identity) {
                return Err(IdentityError::SharedIdentity(other.min(v), other.max(v)).into());
            }
            seen.insert(entry.identity, v);
            identities.insert(v, entry.identity);
        }
        Ok(identities)
    }

    /// Stage 3: checks the key directory (the roster's members, every member's graph
    /// nonce against its commitment, and each neighbour's keys against its signature
    /// under a distinct registered identity), derives the neighbour graph,
    /// secret-shares the self-mask seed and the mask key among this client's neighbours,
    /// and encrypts each neighbour's pair.
    pub fn share_keys<R: rand_core::CryptoRng + ?Sized>(
        &mut self,
        directory: &KeyDirectory,
        rng: &mut R,
    ) -> Result<ShareKeys, SecAggError> {
        let ClientState::Revealed {
            members,
            commitments,
        } = &self.state
        else {
            return Err(self.wrong_stage(Stage::Share));
        };
        let indices = self.check_directory(directory, members, commitments)?;
        let session = &self.config.session;
        let seed = crypto::graph_seed(session, members, &directory.reveals);
        let graph = NeighbourGraph::new(members, &seed, self.config.neighbours)?;
        let neighbours = graph.neighbours(self.me).expect("a member");
        if let Some(&v) = neighbours
            .iter()
            .find(|v| indices.binary_search(v).is_err())
        {
            return Err(SecAggError::BadMessage(format!(
                "the directory lacks the keys of neighbour {v}"
            )));
        }
        let t = self.config.threshold;
        if neighbours.len() < t {
            return Err(SecAggError::TooFewNeighbours {
                client: self.me,
                have: neighbours.len(),
                need: t,
            });
        }
        let identities =
            self.verify_neighbour_keys(directory, &indices, members, commitments, &neighbours)?;
        let directory: BTreeMap<u32, &AdvertiseKeys> = directory
            .entries
            .iter()
            .map(|e| (e.index, &e.keys))
            .collect();
        // Agree with every neighbour first: a weak key anywhere refuses the directory
        // before any secret is drawn.
        let mut keys = Vec::with_capacity(neighbours.len());
        let mut pairs = BTreeMap::new();
        for &v in &neighbours {
            let shared = Zeroizing::new(self.cipher.agree(&directory[&v].cipher_pk)?);
            let masked = Zeroizing::new(self.mask.agree(&directory[&v].mask_pk)?);
            keys.push(crypto::share_key(&shared, session, self.me, v));
            pairs.insert(
                v,
                PairKeys {
                    incoming: crypto::share_key(&shared, session, v, self.me),
                    mask_seed: crypto::pairwise_mask_seed(&masked, session, self.me, v),
                },
            );
        }
        let mut self_seed = Zeroizing::new([0u8; KEY_BYTES]);
        rng.fill_bytes(self_seed.as_mut());
        let seed_shares = shamir::split(&self_seed, t, &neighbours, rng)?;
        let mask_secret = Zeroizing::new(self.mask.secret_bytes());
        let key_shares = shamir::split(&mask_secret, t, &neighbours, rng)?;
        let shares = neighbours
            .iter()
            .zip(&keys)
            .zip(seed_shares.iter().zip(&key_shares))
            .map(|((&v, key), (s, k))| {
                let (s, k) = (Zeroizing::new(s.to_bytes()), Zeroizing::new(k.to_bytes()));
                let mut plain = Zeroizing::new(Vec::with_capacity(SHARE_PLAINTEXT_BYTES));
                plain.extend_from_slice(&self.me.to_le_bytes());
                plain.extend_from_slice(&v.to_le_bytes());
                plain.extend_from_slice(s.as_ref());
                plain.extend_from_slice(k.as_ref());
                let commit =
                    |kind, share: &[u8]| crypto::share_commitment(session, self.me, v, kind, share);
                EncryptedShare {
                    to: v,
                    ciphertext: crypto::seal(key, session, self.me, v, &plain),
                    seed_share_commitment: commit(SecretKind::Seed, s.as_ref()),
                    key_share_commitment: commit(SecretKind::MaskKey, k.as_ref()),
                }
            })
            .collect();
        let message = ShareKeys {
            seed_commitment: crypto::seed_commitment(&self.config.session, self.me, &self_seed),
            shares,
        };
        self.state = ClientState::Shared {
            identities,
            neighbours: pairs,
            self_seed,
        };
        Ok(message)
    }

    /// Stage 3: decrypts the neighbours' shares (`U2`), quantises the update (clipped,
    /// weighted by `weight` samples, with the training `loss`) and returns it masked: plus
    /// the self mask, plus or minus the pairwise mask of every neighbour in `U2`. This
    /// vector of `d + 2` words is all that leaves the client.
    pub fn mask<R: rand_core::CryptoRng + ?Sized>(
        &mut self,
        forwarded: &ForwardedShares,
        update: &[f32],
        weight: u64,
        loss: f64,
        rng: &mut R,
    ) -> Result<Vec<u32>, SecAggError> {
        if !matches!(self.state, ClientState::Shared { .. }) {
            return Err(self.wrong_stage(Stage::Masked));
        }
        if update.len() != self.config.dimension {
            return Err(SecAggError::WrongLength {
                expected: self.config.dimension,
                found: update.len(),
            });
        }
        let held = self.open_shares(forwarded)?;
        let words = self.quantizer.encode(update, weight, loss, rng)?;
        self.apply_masks(held, words)
    }

    /// Stage 3 for a vector the caller quantised itself with [`Quantizer::encode`] (the
    /// round's quantiser is [`quantizer`](Self::quantizer)): `d + 2` words, each within
    /// the quantiser's range. For tests and benchmarks that need the exact input.
    pub fn mask_quantized(
        &mut self,
        forwarded: &ForwardedShares,
        quantized: Vec<u32>,
    ) -> Result<Vec<u32>, SecAggError> {
        if !matches!(self.state, ClientState::Shared { .. }) {
            return Err(self.wrong_stage(Stage::Masked));
        }
        let expected = self.config.dimension + EXTRA_WORDS;
        if quantized.len() != expected {
            return Err(SecAggError::WrongLength {
                expected,
                found: quantized.len(),
            });
        }
        let held = self.open_shares(forwarded)?;
        self.apply_masks(held, quantized)
    }

    /// The round's quantiser.
    pub fn quantizer(&self) -> &Quantizer {
        &self.quantizer
    }

    /// Decrypts and checks the forwarded shares; `U2`'s neighbours must number at least t.
    fn open_shares(
        &self,
        forwarded: &ForwardedShares,
    ) -> Result<BTreeMap<u32, (Share, Share)>, SecAggError> {
        let ClientState::Shared { neighbours, .. } = &self.state else {
            return Err(self.wrong_stage(Stage::Masked));
        };
        let session = &self.config.session;
        let mut held = BTreeMap::new();
        for f in &forwarded.shares {
            let Some(pair) = neighbours.get(&f.from) else {
                return Err(SecAggError::NotNeighbour {
                    from: f.from,
                    to: self.me,
                });
            };
            if held.contains_key(&f.from) {
                return Err(SecAggError::Duplicate(f.from));
            }
            if f.ciphertext.len() != SHARE_CIPHERTEXT_BYTES {
                return Err(SecAggError::WrongLength {
                    expected: SHARE_CIPHERTEXT_BYTES,
                    found: f.ciphertext.len(),
                });
            }
            let plain = Zeroizing::new(crypto::open(
                &pair.incoming,
                session,
                f.from,
                self.me,
                &f.ciphertext,
            )?);
            let from = u32::from_le_bytes(plain[..4].try_into().expect("4 bytes"));
            let to = u32::from_le_bytes(plain[4..8].try_into().expect("4 bytes"));
            if from != f.from || to != self.me {
                return Err(SecAggError::BadMessage(format!(
                    "share from {} names sender {from} and recipient {to}",
                    f.from
                )));
            }
            let (seed_bytes, key_bytes) = plain[8..].split_at(SHARE_BYTES);
            let committed = |kind, share: &[u8], commitment: &[u8; KEY_BYTES]| {
                crypto::share_commitment(session, f.from, self.me, kind, share) == *commitment
            };
            // A share that does not match its commitment could never be revealed: the
            // server would refuse it, and the sender's secret would be short a share.
            if !committed(SecretKind::Seed, seed_bytes, &f.seed_share_commitment)
                || !committed(SecretKind::MaskKey, key_bytes, &f.key_share_commitment)
            {
                return Err(SecAggError::BadMessage(format!(
                    "the shares from client {} do not match their commitments",
                    f.from
                )));
            }
            let seed_share = Share::from_bytes(seed_bytes)?;
            let key_share = Share::from_bytes(key_bytes)?;
            if seed_share.holder != self.me || key_share.holder != self.me {
                return Err(SecAggError::BadMessage(format!(
                    "share from {} is for another holder",
                    f.from
                )));
            }
            held.insert(f.from, (seed_share, key_share));
        }
        let t = self.config.threshold;
        if held.len() < t {
            // Fewer than t neighbours will be asked for this client's shares: its masks
            // could never be removed, so it stops here rather than upload.
            return Err(SecAggError::TooFewNeighbours {
                client: self.me,
                have: held.len(),
                need: t,
            });
        }
        Ok(held)
    }

    fn apply_masks(
        &mut self,
        held: BTreeMap<u32, (Share, Share)>,
        mut words: Vec<u32>,
    ) -> Result<Vec<u32>, SecAggError> {
        let ClientState::Shared {
            identities,
            neighbours,
            self_seed,
        } = &self.state
        else {
            return Err(self.wrong_stage(Stage::Masked));
        };
        let mut masks = Vec::with_capacity(held.len() + 1);
        masks.push(Mask {
            seed: self_seed,
            sign: MaskSign::Add,
        });
        masks.extend(held.keys().map(|v| Mask {
            seed: &neighbours[v].mask_seed,
            sign: if self.me < *v {
                MaskSign::Add
            } else {
                MaskSign::Subtract
            },
        }));
        prg::apply_masks_parallel(&masks, 0, &mut words)?;
        // Narrow words travel modulo 2^w: the masks still cancel in that ring.
        self.quantizer.narrow_words(&mut words);
        let neighbours = identities.clone();
        self.state = ClientState::Masked { neighbours, held };
        Ok(words)
    }

    /// Checks a survivor list against this client's view: strictly ascending, naming
    /// this client, above the floors, with at least `t` of this client's neighbours (the
    /// holders of its own shares), and naming no neighbour that never shared keys.
    fn check_survivors(
        &self,
        neighbours: &BTreeMap<u32, [u8; PUBLIC_KEY_BYTES]>,
        held: &BTreeMap<u32, (Share, Share)>,
        survivors: &[u32],
    ) -> Result<(), SecAggError> {
        check_ascending(survivors, self.config.parties)?;
        let listed = |v: &u32| survivors.binary_search(v).is_ok();
        if !listed(&self.me) {
            return Err(SecAggError::NotInRound(self.me));
        }
        let t = self.config.threshold;
        if survivors.len() < t {
            return Err(SecAggError::TooFewParticipants {
                stage: Stage::Masked,
                have: survivors.len(),
                need: t,
            });
        }
        self.floors.check_survivors(&self.config, survivors.len())?;
        // This client's own seed is rebuilt from its surviving neighbours' shares: with
        // fewer than t of them the round cannot finish, so nothing is revealed for it.
        let holders = neighbours.keys().filter(|v| listed(v)).count();
        if holders < t {
            return Err(SecAggError::TooFewNeighbours {
                client: self.me,
                have: holders,
                need: t,
            });
        }
        // A surviving neighbour must have shared keys with this client (be in `U2`);
        // anything else means the server's lists disagree.
        if let Some(&v) = neighbours
            .keys()
            .find(|v| listed(v) && !held.contains_key(v))
        {
            return Err(SecAggError::BadMessage(format!(
                "survivor {v} never shared keys with client {}",
                self.me
            )));
        }
        Ok(())
    }

    /// Consistency check: checks the survivor list (`U3`) as [`unmask`](Self::unmask)
    /// would and signs it with this client's identity. Answers once: the client signs
    /// one survivor list per round, so no two lists can both gather its signature.
    pub fn confirm(
        &mut self,
        request: &UnmaskRequest,
        identity: &Identity,
    ) -> Result<Confirmation, SecAggError> {
        if !self.config.consistency_check {
            return Err(SecAggError::BadMessage(
                "this round runs without the consistency check".into(),
            ));
        }
        let ClientState::Masked { neighbours, held } = &self.state else {
            return Err(self.wrong_stage(Stage::Confirm));
        };
        if identity.public() != self.identity {
            return Err(SecAggError::BadMessage(
                "signing with another identity than the one this client joined with".into(),
            ));
        }
        self.check_survivors(neighbours, held, &request.survivors)?;
        let signature = identity.sign(&self.config.survivors_statement(&request.survivors));
        let ClientState::Masked { neighbours, held } =
            std::mem::replace(&mut self.state, ClientState::Done)
        else {
            unreachable!("matched above")
        };
        self.state = ClientState::Confirmed {
            neighbours,
            held,
            survivors: request.survivors.clone(),
        };
        Ok(Confirmation { signature })
    }

    /// The last stage: checks the survivor list (`U3`) and reveals, for each neighbour
    /// in `U2`, its seed share if it survived and its key share if it dropped. With the
    /// consistency check, the list must be the one this client signed, and at least `t`
    /// of this client's neighbours must have signed it too (their signatures are in the
    /// request; a bad one aborts). Answers once: a second request (which could name
    /// other survivors) is refused, so the server can never get both shares of one
    /// neighbour from this client.
    pub fn unmask(&mut self, request: &UnmaskRequest) -> Result<UnmaskShares, SecAggError> {
        let (neighbours, held) = match &self.state {
            ClientState::Masked { neighbours, held } if !self.config.consistency_check => {
                self.check_survivors(neighbours, held, &request.survivors)?;
                (neighbours, held)
            }
            ClientState::Confirmed {
                neighbours,
                held,
                survivors,
            } => {
                if request.survivors != *survivors {
                    return Err(SecAggError::BadMessage(
                        "the survivor list is not the one this client signed".into(),
                    ));
                }
                let statement = self.config.survivors_statement(survivors);
                let mut signers = BTreeSet::new();
                let mut signed = Vec::with_capacity(request.signatures.len());
                for s in &request.signatures {
                    let Some(public) = neighbours.get(&s.index) else {
                        return Err(SecAggError::NotNeighbour {
                            from: s.index,
                            to: self.me,
                        });
                    };
                    if survivors.binary_search(&s.index).is_err() {
                        return Err(SecAggError::BadMessage(format!(
                            "client {} signed a survivor list without being on it",
                            s.index
                        )));
                    }
                    if !signers.insert(s.index) {
                        return Err(SecAggError::Duplicate(s.index));
                    }
                    signed.push(identity::Signed {
                        public,
                        statement: &statement,
                        signature: &s.signature,
                        index: s.index,
                    });
                }
                identity::verify_all(&signed)?;
                let t = self.config.threshold;
                if signers.len() < t {
                    return Err(SecAggError::TooFewConfirmations {
                        client: self.me,
                        have: signers.len(),
                        need: t,
                    });
                }
                (neighbours, held)
            }
            _ => return Err(self.wrong_stage(Stage::Unmask)),
        };
        let _ = neighbours;
        // Ascending, as checked above: no set of thousands of survivors per client.
        let survived = |owner: &u32| request.survivors.binary_search(owner).is_ok();
        let mut reply = UnmaskShares {
            seed_shares: Vec::new(),
            key_shares: Vec::new(),
        };
        for (&owner, (seed_share, key_share)) in held {
            if survived(&owner) {
                reply.seed_shares.push(RevealedShare {
                    owner,
                    share: seed_share.to_bytes().to_vec(),
                });
            } else {
                reply.key_shares.push(RevealedShare {
                    owner,
                    share: key_share.to_bytes().to_vec(),
                });
            }
        }
        self.state = ClientState::Done;
        Ok(reply)
    }
}
