//! The server side of a secure round, as a state machine. It routes messages, folds
//! masked inputs into a running sum as they arrive, and at the end rebuilds just the
//! secrets it is owed: the self-mask seeds of the survivors and the mask keys of the
//! clients that dropped after sharing. It never holds an unmasked input.
//!
//! Every `receive_*` checks its message completely and changes nothing when it refuses
//! it. A `close_*` that finds too few clients ends the round in the failed stage, before
//! anything more is revealed.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use std::sync::Arc;

use rayon::prelude::*;

use crate::reduce::Reducer;

use super::crypto::{self, KEY_BYTES, KeyPair, SecretKind};
use super::graph::{NeighbourGraph, effective_degree};
use super::identity::{self, IdentityError, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Statement};
use super::messages::{
    AdvertiseKeys, Confirmation, DirectoryEntry, ForwardedShare, ForwardedShares, GraphReveal,
    KeyDirectory, Roster, RoundConfig, SHARE_CIPHERTEXT_BYTES, ShareKeys, SurvivorSignature,
    UnmaskRequest, UnmaskShares,
};
use super::prg::{Mask, MaskSign};
use super::quantize::{Decoded, EXTRA_WORDS, Quantizer};
use super::shamir::{Interpolator, Share};
use super::{SecAggError, Stage};

/// Where the server is in a round.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerStage {
    /// Collecting public keys.
    Advertise,
    /// Collecting graph nonces.
    Reveal,
    /// Collecting encrypted shares.
    Share,
    /// Collecting masked inputs.
    Masked,
    /// Collecting signatures over the survivor list (consistency check).
    Confirm,
    /// Collecting revealed shares.
    Unmask,
    /// The sum is unmasked.
    Finished,
    /// The round failed; nothing more is accepted.
    Failed(SecAggError),
}

/// Who dropped out at which stage: selected clients missing from each stage's set.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Dropouts {
    /// Selected, never advertised keys.
    pub advertise: Vec<u32>,
    /// Advertised, never revealed a graph nonce (the attempt failed for it).
    pub reveal: Vec<u32>,
    /// Revealed, never sent shares.
    pub share: Vec<u32>,
    /// Sent shares, never sent a masked input.
    pub masked: Vec<u32>,
    /// Sent a masked input, never signed the survivor list (consistency check; its input
    /// still counts).
    pub confirm: Vec<u32>,
    /// Sent a masked input (and signed the survivor list), never answered the unmask
    /// request (its input still counts).
    pub unmask: Vec<u32>,
}

/// The result of a round: what the server learns, and nothing more.
#[derive(Debug, Clone, PartialEq)]
pub struct Unmasked {
    /// The unmasked sum of the survivors' quantised vectors (`d + 2` words).
    pub sum: Vec<u32>,
    /// The decoded weighted mean, total weight, mean loss and error bound.
    pub decoded: Decoded,
    /// The clients whose inputs are in the sum (`U3`).
    pub survivors: Vec<u32>,
    /// Who dropped where.
    pub dropouts: Dropouts,
    /// Survivors excluded from unmasking for revealing a forged share (their inputs are
    /// in the sum; none of their shares was used).
    pub excluded: Vec<u32>,
    /// Masks the server expanded and removed: one self mask per survivor and one
    /// pairwise mask per (dropped client, surviving neighbour) pair.
    pub masks_removed: usize,
    /// Seconds spent expanding and removing those masks (the rest of unmasking is
    /// rebuilding secrets, key agreements and decoding).
    pub mask_seconds: f64,
}

/// The server's part in one secure round.
pub struct ServerSession {
    config: RoundConfig,
    quantizer: Quantizer,
    stage: ServerStage,
    keys: BTreeMap<u32, AdvertiseKeys>,
    /// The registered identity each member's keys were checked under.
    identities: BTreeMap<u32, [u8; PUBLIC_KEY_BYTES]>,
    reveals: BTreeMap<u32, [u8; KEY_BYTES]>,
    graph: Option<NeighbourGraph>,
    shared: BTreeMap<u32, ShareKeys>,
    masked: BTreeSet<u32>,
    /// Stages closed so far: 1 after advertising, 2 after revealing, 3 after sharing, 4
    /// after collecting, 5 after confirming (or collecting, without the consistency
    /// check), 6 when finished.
    closed: u8,
    /// Survivors' signatures over the survivor list (consistency check).
    confirmations: BTreeMap<u32, [u8; SIGNATURE_BYTES]>,
    /// What every survivor signs in the consistency check, made once when collection
    /// closes: rebuilt for each confirmation it hashed the whole list again (9,000
    /// survivors: 9,000 hashes of 36 KB).
    survivors_statement: Option<Statement>,
    sum: Vec<u32>,
    /// True once a masked input was recorded without its vector: the caller folds the
    /// inputs itself and hands the sum to [`ServerSession::finish_with`].
    external_sum: bool,
    revealed: BTreeMap<u32, Revealed>,
    /// Survivors whose stage 4 answer held a forged share.
    excluded: BTreeSet<u32>,
    reducer: Arc<dyn Reducer>,
}

impl std::fmt::Debug for ServerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerSession")
            .field("stage", &self.stage)
            .field("advertised", &self.keys.len())
            .field("shared", &self.shared.len())
            .field("masked", &self.masked.len())
            .field("revealed", &self.revealed.len())
            .finish_non_exhaustive()
    }
}

/// One client's stage 4 answer, parsed.
struct Revealed {
    seeds: BTreeMap<u32, Share>,
    keys: BTreeMap<u32, Share>,
}

/// A secret rebuilt from its shares at unmasking: a survivor's self-mask seed (wiped when
/// dropped), or a dropped client's mask key pair.
enum Rebuilt {
    Seed(zeroize::Zeroizing<[u8; KEY_BYTES]>),
    Key(u32, KeyPair),
}

impl ServerSession {
    /// A round with the given public settings, collecting keys.
    pub fn new(config: RoundConfig) -> Result<Self, SecAggError> {
        let quantizer = config.validate()?;
        Ok(Self {
            config,
            quantizer,
            stage: ServerStage::Advertise,
            keys: BTreeMap::new(),
            identities: BTreeMap::new(),
            reveals: BTreeMap::new(),
            graph: None,
            shared: BTreeMap::new(),
            masked: BTreeSet::new(),
            closed: 0,
            confirmations: BTreeMap::new(),
            survivors_statement: None,
            sum: Vec::new(),
            external_sum: false,
            revealed: BTreeMap::new(),
            excluded: BTreeSet::new(),
            reducer: crate::reduce::cpu(),
        })
    }

    /// Runs the sums and the mask removal on `reducer` (the CPU's cores by default).
    pub fn set_reducer(&mut self, reducer: Arc<dyn Reducer>) {
        self.reducer = reducer;
    }

    /// The round's settings.
    pub fn config(&self) -> &RoundConfig {
        &self.config
    }

    /// The stage.
    pub fn stage(&self) -> &ServerStage {
        &self.stage
    }

    /// The round's quantiser (for its error bound).
    pub fn quantizer(&self) -> &Quantizer {
        &self.quantizer
    }

    fn expect(&self, stage: Stage) -> Result<(), SecAggError> {
        let now = match self.stage {
            ServerStage::Advertise => Some(Stage::Advertise),
            ServerStage::Reveal => Some(Stage::Reveal),
            ServerStage::Share => Some(Stage::Share),
            ServerStage::Masked => Some(Stage::Masked),
            ServerStage::Confirm => Some(Stage::Confirm),
            ServerStage::Unmask => Some(Stage::Unmask),
            ServerStage::Finished => None,
            ServerStage::Failed(ref e) => {
                return Err(SecAggError::RoundFailed(Box::new(e.clone())));
            }
        };
        if now == Some(stage) {
            Ok(())
        } else {
            Err(SecAggError::WrongStage {
                expected: stage,
                actual: now,
            })
        }
    }

    fn fail(&mut self, error: SecAggError) -> SecAggError {
        self.stage = ServerStage::Failed(error.clone());
        error
    }

    fn graph(&self) -> &NeighbourGraph {
        self.graph.as_ref().expect("built when revealing closed")
    }

    /// `U1`: clients whose keys were accepted.
    pub fn advertised(&self) -> impl Iterator<Item = u32> + '_ {
        self.keys.keys().copied()
    }

    /// `U2`: clients whose shares were accepted.
    pub fn shared(&self) -> impl Iterator<Item = u32> + '_ {
        self.shared.keys().copied()
    }

    /// `U3`: clients whose masked inputs are in the sum.
    pub fn masked(&self) -> impl Iterator<Item = u32> + '_ {
        self.masked.iter().copied()
    }

    /// Clients whose stage 4 answers were accepted.
    pub fn unmasked(&self) -> impl Iterator<Item = u32> + '_ {
        self.revealed.keys().copied()
    }

    /// Stage 1: accepts client `from`'s public keys, signed by its registered
    /// `identity`. A bad signature, or an identity another member already presented, is
    /// refused here, where it costs the sender alone (every client checks its neighbours'
    /// signatures itself too: this check protects the round, theirs protect them).
    pub fn receive_keys(
        &mut self,
        from: u32,
        keys: &AdvertiseKeys,
        identity: &[u8; PUBLIC_KEY_BYTES],
    ) -> Result<(), SecAggError> {
        self.check_keys(from, keys, identity)?;
        self.keys.insert(from, keys.clone());
        self.identities.insert(from, *identity);
        Ok(())
    }

    /// The checks of [`receive_keys`](Self::receive_keys) without recording anything.
    pub fn check_keys(
        &self,
        from: u32,
        keys: &AdvertiseKeys,
        identity: &[u8; PUBLIC_KEY_BYTES],
    ) -> Result<(), SecAggError> {
        self.expect(Stage::Advertise)?;
        if from == 0 || from > self.config.parties {
            return Err(SecAggError::UnknownClient(from));
        }
        if self.keys.contains_key(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        let statement = self.config.advertise_statement(
            from,
            &keys.cipher_pk,
            &keys.mask_pk,
            &keys.graph_commitment,
        );
        identity::verify(identity, &statement, &keys.signature, from)?;
        if let Some((&other, _)) = self.identities.iter().find(|(_, id)| *id == identity) {
            return Err(IdentityError::SharedIdentity(other.min(from), other.max(from)).into());
        }
        // A low-order key would make every neighbour's agreement fail (or be public);
        // refuse it here, where it costs the sender alone.
        let probe = KeyPair::from_secret_bytes([0x5a; KEY_BYTES]);
        probe.agree(&keys.cipher_pk)?;
        probe.agree(&keys.mask_pk)?;
        Ok(())
    }

    /// Stage 1 for keys this server already accepted with
    /// [`receive_keys`](Self::receive_keys) and stored: a coordinator rebuilding a round
    /// from its database skips the key checks it has done once.
    pub fn restore_keys(
        &mut self,
        from: u32,
        keys: &AdvertiseKeys,
        identity: &[u8; PUBLIC_KEY_BYTES],
    ) -> Result<(), SecAggError> {
        self.expect(Stage::Advertise)?;
        if from == 0 || from > self.config.parties {
            return Err(SecAggError::UnknownClient(from));
        }
        if self.keys.contains_key(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        self.keys.insert(from, keys.clone());
        self.identities.insert(from, *identity);
        Ok(())
    }

    /// Ends stage 1 and returns the roster (`U1` and its graph commitments) for every
    /// member, or fails the round when too few advertised for every client to have `t`
    /// neighbours.
    pub fn close_advertise(&mut self) -> Result<Roster, SecAggError> {
        self.expect(Stage::Advertise)?;
        let members = self.keys.len();
        let t = self.config.threshold;
        if members < 2 || effective_degree(members, self.config.neighbours) < t {
            return Err(self.fail(SecAggError::TooFewParticipants {
                stage: Stage::Advertise,
                have: members,
                need: t + 1,
            }));
        }
        self.stage = ServerStage::Reveal;
        self.closed = 1;
        Ok(self.roster().expect("just closed"))
    }

    /// The roster, once stage 1 has closed.
    pub fn roster(&self) -> Option<Roster> {
        if matches!(self.stage, ServerStage::Advertise) {
            return None;
        }
        Some(Roster {
            members: self.keys.keys().copied().collect(),
            commitments: self.keys.values().map(|k| k.graph_commitment).collect(),
        })
    }

    /// Stage 2: accepts client `from`'s graph nonce, which must match its commitment.
    pub fn receive_reveal(&mut self, from: u32, reveal: &GraphReveal) -> Result<(), SecAggError> {
        self.check_reveal(from, reveal)?;
        self.reveals.insert(from, reveal.nonce);
        Ok(())
    }

    /// The checks of [`receive_reveal`](Self::receive_reveal) without recording
    /// anything.
    pub fn check_reveal(&self, from: u32, reveal: &GraphReveal) -> Result<(), SecAggError> {
        self.expect(Stage::Reveal)?;
        let Some(keys) = self.keys.get(&from) else {
            return Err(SecAggError::NotInRound(from));
        };
        if self.reveals.contains_key(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        if crypto::graph_commitment(&self.config.session, from, &reveal.nonce)
            != keys.graph_commitment
        {
            return Err(SecAggError::BadMessage(format!(
                "client {from}'s graph nonce does not match its commitment"
            )));
        }
        Ok(())
    }

    /// Ends stage 2: draws the neighbour graph from every member's nonce, or fails the
    /// round when a member's nonce is missing.
    pub fn close_reveal(&mut self) -> Result<(), SecAggError> {
        self.expect(Stage::Reveal)?;
        let missing: Vec<u32> = self
            .keys
            .keys()
            .filter(|u| !self.reveals.contains_key(u))
            .copied()
            .collect();
        if !missing.is_empty() {
            return Err(self.fail(SecAggError::MissingReveals(missing)));
        }
        let members: Vec<u32> = self.keys.keys().copied().collect();
        let reveals: Vec<[u8; KEY_BYTES]> = self.reveals.values().copied().collect();
        let seed = crypto::graph_seed(&self.config.session, &members, &reveals);
        let graph = NeighbourGraph::new(&members, &seed, self.config.neighbours)?;
        self.graph = Some(graph);
        self.stage = ServerStage::Share;
        self.closed = 2;
        Ok(())
    }

    /// The whole key directory (`U1` with every member's nonce and keys), once stage 2
    /// has closed.
    pub fn directory(&self) -> Option<KeyDirectory> {
        self.graph.as_ref()?;
        Some(self.directory_of(self.keys.keys().copied().collect()))
    }

    /// Client `u`'s directory, once stage 2 has closed: `U1` with every member's nonce,
    /// and the keys of `u` and its neighbours only. `None` before, or for a client not in
    /// `U1`.
    pub fn directory_for(&self, u: u32) -> Option<KeyDirectory> {
        let graph = self.graph.as_ref()?;
        let mut wanted = graph.neighbours(u)?;
        wanted.push(u);
        wanted.sort_unstable();
        Some(self.directory_of(wanted))
    }

    fn directory_of(&self, wanted: Vec<u32>) -> KeyDirectory {
        KeyDirectory {
            members: self.keys.keys().copied().collect(),
            reveals: self.reveals.values().copied().collect(),
            entries: wanted
                .into_iter()
                .map(|index| DirectoryEntry {
                    index,
                    keys: self.keys[&index].clone(),
                    identity: self.identities[&index],
                })
                .collect(),
        }
    }

    /// The neighbours of `u` in the round's graph (after stage 1).
    pub fn neighbours(&self, u: u32) -> Option<Vec<u32>> {
        self.graph.as_ref()?.neighbours(u)
    }

    /// Stage 2: accepts client `from`'s encrypted shares: exactly one per neighbour, each
    /// of the right size.
    pub fn receive_shares(&mut self, from: u32, shares: &ShareKeys) -> Result<(), SecAggError> {
        self.check_shares(from, shares)?;
        self.shared.insert(from, shares.clone());
        Ok(())
    }

    /// The checks of [`receive_shares`](Self::receive_shares) without recording
    /// anything: a server that keeps the round's state elsewhere (a database) validates
    /// a message against a shared snapshot of the closed stages instead of a copy.
    pub fn check_shares(&self, from: u32, shares: &ShareKeys) -> Result<(), SecAggError> {
        self.expect(Stage::Share)?;
        if !self.keys.contains_key(&from) {
            return Err(SecAggError::NotInRound(from));
        }
        if self.shared.contains_key(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        let neighbours = self.graph().neighbours(from).expect("a member of U1");
        let recipients: Vec<u32> = shares.shares.iter().map(|s| s.to).collect();
        if recipients != neighbours {
            if let Some(&to) = recipients.iter().find(|to| !neighbours.contains(to)) {
                return Err(SecAggError::NotNeighbour { from, to });
            }
            return Err(SecAggError::BadMessage(format!(
                "client {from} must send exactly one share to each of its {} neighbours, \
                 in ascending order",
                neighbours.len()
            )));
        }
        if let Some(s) = shares
            .shares
            .iter()
            .find(|s| s.ciphertext.len() != SHARE_CIPHERTEXT_BYTES)
        {
            return Err(SecAggError::WrongLength {
                expected: SHARE_CIPHERTEXT_BYTES,
                found: s.ciphertext.len(),
            });
        }
        Ok(())
    }

    /// Ends stage 2, or fails the round with fewer than `t` clients in `U2`.
    pub fn close_sharing(&mut self) -> Result<(), SecAggError> {
        self.expect(Stage::Share)?;
        let t = self.config.threshold;
        if self.shared.len() < t {
            return Err(self.fail(SecAggError::TooFewParticipants {
                stage: Stage::Share,
                have: self.shared.len(),
                need: t,
            }));
        }
        self.stage = ServerStage::Masked;
        self.closed = 3;
        Ok(())
    }

    /// The shares for client `to` from its neighbours in `U2`, once stage 2 has closed.
    pub fn forwarded_for(&self, to: u32) -> Result<ForwardedShares, SecAggError> {
        let before = match self.stage {
            ServerStage::Advertise => Some(Stage::Advertise),
            ServerStage::Reveal => Some(Stage::Reveal),
            ServerStage::Share => Some(Stage::Share),
            _ => None,
        };
        if let Some(actual) = before {
            return Err(SecAggError::WrongStage {
                expected: Stage::Masked,
                actual: Some(actual),
            });
        }
        if !self.shared.contains_key(&to) {
            return Err(SecAggError::NotInRound(to));
        }
        let neighbours = self.graph().neighbours(to).expect("a member of U1");
        let shares = neighbours
            .iter()
            .filter_map(|from| {
                let message = self.shared.get(from)?;
                let share = message.shares.iter().find(|s| s.to == to)?;
                Some(ForwardedShare {
                    from: *from,
                    ciphertext: share.ciphertext.clone(),
                    seed_share_commitment: share.seed_share_commitment,
                    key_share_commitment: share.key_share_commitment,
                })
            })
            .collect();
        Ok(ForwardedShares { shares })
    }

    /// Words of a masked input: `d + 2`.
    pub fn input_words(&self) -> usize {
        self.config.dimension + EXTRA_WORDS
    }

    /// Stage 3: folds client `from`'s masked input into the running sum (mod 2^32).
    pub fn receive_masked(&mut self, from: u32, masked: &[u32]) -> Result<(), SecAggError> {
        self.expect(Stage::Masked)?;
        if !self.shared.contains_key(&from) {
            return Err(SecAggError::NotInRound(from));
        }
        if self.masked.contains(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        if masked.len() != self.input_words() {
            return Err(SecAggError::WrongLength {
                expected: self.input_words(),
                found: masked.len(),
            });
        }
        if self.sum.is_empty() {
            self.sum = masked.to_vec();
        } else {
            crate::reduce::modular_sum_into(&mut self.sum, &[masked])
                .map_err(|e| SecAggError::Reducer(e.to_string()))?;
        }
        self.masked.insert(from);
        Ok(())
    }

    /// Stage 3 without the vector: records that client `from`'s masked input (of the
    /// right length, checked by the caller) arrived. A coordinator that keeps inputs on
    /// disk folds them itself and passes the sum to [`finish_with`](Self::finish_with).
    pub fn restore_masked(&mut self, from: u32) -> Result<(), SecAggError> {
        self.expect(Stage::Masked)?;
        if !self.shared.contains_key(&from) {
            return Err(SecAggError::NotInRound(from));
        }
        if self.masked.contains(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        self.masked.insert(from);
        self.external_sum = true;
        Ok(())
    }

    /// Ends stage 3 and returns the survivors (`U3`) to send to them, or fails the round
    /// with fewer than `t`: then no share is ever asked for, and nothing is revealed.
    pub fn close_collection(&mut self) -> Result<UnmaskRequest, SecAggError> {
        self.expect(Stage::Masked)?;
        let t = self.config.threshold;
        if self.masked.len() < t {
            return Err(self.fail(SecAggError::TooFewParticipants {
                stage: Stage::Masked,
                have: self.masked.len(),
                need: t,
            }));
        }
        (self.stage, self.closed) = if self.config.consistency_check {
            let survivors: Vec<u32> = self.masked.iter().copied().collect();
            self.survivors_statement = Some(self.config.survivors_statement(&survivors));
            (ServerStage::Confirm, 4)
        } else {
            (ServerStage::Unmask, 5)
        };
        Ok(self.survivor_list().expect("just closed"))
    }

    /// The bare survivor list (`U3`), once stage 3 has closed: what the survivors sign
    /// in the consistency check, or (without it) what they answer.
    pub fn survivor_list(&self) -> Option<UnmaskRequest> {
        match self.stage {
            ServerStage::Confirm | ServerStage::Unmask | ServerStage::Finished => {
                Some(UnmaskRequest {
                    survivors: self.masked.iter().copied().collect(),
                    signatures: Vec::new(),
                })
            }
            _ => None,
        }
    }

    /// Consistency check: accepts survivor `from`'s signature over the survivor list.
    pub fn receive_confirmation(
        &mut self,
        from: u32,
        confirmation: &Confirmation,
    ) -> Result<(), SecAggError> {
        self.check_confirmation(from, confirmation)?;
        self.confirmations.insert(from, confirmation.signature);
        Ok(())
    }

    /// The checks of [`receive_confirmation`](Self::receive_confirmation) without
    /// recording anything.
    pub fn check_confirmation(
        &self,
        from: u32,
        confirmation: &Confirmation,
    ) -> Result<(), SecAggError> {
        self.expect(Stage::Confirm)?;
        if !self.masked.contains(&from) {
            return Err(SecAggError::NotInRound(from));
        }
        if self.confirmations.contains_key(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        let statement = self
            .survivors_statement
            .as_ref()
            .expect("the statement is made when the confirm stage opens");
        identity::verify(
            &self.identities[&from],
            statement,
            &confirmation.signature,
            from,
        )?;
        Ok(())
    }

    /// Ends the consistency check, or fails the round with fewer than `t` signatures.
    pub fn close_confirm(&mut self) -> Result<(), SecAggError> {
        self.expect(Stage::Confirm)?;
        let t = self.config.threshold;
        if self.confirmations.len() < t {
            return Err(self.fail(SecAggError::TooFewParticipants {
                stage: Stage::Confirm,
                have: self.confirmations.len(),
                need: t,
            }));
        }
        self.stage = ServerStage::Unmask;
        self.closed = 5;
        Ok(())
    }

    /// Survivors that signed the survivor list (consistency check).
    pub fn confirmed(&self) -> impl Iterator<Item = u32> + '_ {
        self.confirmations.keys().copied()
    }

    /// What survivor `u` is asked to answer, once the stage before unmasking closed: the
    /// survivor list and, with the consistency check, the signatures of `u`'s neighbours
    /// over it. `None` before, or for a client that is not a survivor.
    pub fn unmask_request_for(&self, u: u32) -> Option<UnmaskRequest> {
        if !matches!(self.stage, ServerStage::Unmask | ServerStage::Finished)
            || !self.masked.contains(&u)
        {
            return None;
        }
        let mut request = self.survivor_list()?;
        if self.config.consistency_check {
            request.signatures = self
                .graph()
                .neighbours(u)
                .expect("a member")
                .into_iter()
                .filter_map(|v| {
                    Some(SurvivorSignature {
                        index: v,
                        signature: *self.confirmations.get(&v)?,
                    })
                })
                .collect();
        }
        Some(request)
    }

    /// Stage 4: accepts client `from`'s revealed shares: seed shares only of surviving
    /// neighbours, key shares only of neighbours that dropped after sharing, each share
    /// held by `from`.
    ///
    /// A share that does not match its owner's commitment is the one refusal that
    /// leaves a mark: the holder is excluded ([`SecAggError::WrongShare`]), any later
    /// answer from it is refused, and [`Unmasked::excluded`] names it. Its own input stays
    /// in the sum (its neighbours revealed its seed shares), but none of its shares is
    /// used, so a forged share can no longer fail the round or blame the share's owner.
    pub fn receive_unmask(&mut self, from: u32, reply: &UnmaskShares) -> Result<(), SecAggError> {
        self.receive_unmasks(&[(from, reply)])
    }

    /// [`receive_unmask`](Self::receive_unmask) for many replies: the same outcome as
    /// receiving them one by one in this order and stopping at the first refusal (a
    /// forged share excludes its holder, and the replies before it are kept), with the
    /// checks, a share commitment for every share, run on every core. A round of
    /// 10,000 clients has 9,000 replies of 40 shares each to check when it unmasks, and
    /// a replica that rebuilds the round from the store checks them all again.
    pub fn receive_unmasks(&mut self, replies: &[(u32, &UnmaskShares)]) -> Result<(), SecAggError> {
        let parsed: Vec<Result<Revealed, SecAggError>> = replies
            .par_iter()
            .map(|&(from, reply)| self.parse_unmask(from, reply))
            .collect();
        for (&(from, _), parsed) in replies.iter().zip(parsed) {
            // Each reply was checked against the session before this batch; a sender's
            // second reply in it is the one check that depends on the first.
            let parsed = if self.revealed.contains_key(&from) {
                Err(SecAggError::Duplicate(from))
            } else {
                parsed
            };
            match parsed {
                Ok(revealed) => {
                    self.revealed.insert(from, revealed);
                }
                Err(e @ SecAggError::WrongShare { .. }) => {
                    self.excluded.insert(from);
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Excludes client `from` from unmasking for a forged share found by
    /// [`check_unmask`](Self::check_unmask): what [`receive_unmask`](Self::receive_unmask)
    /// records itself, for a server that keeps the round's state elsewhere.
    pub fn exclude(&mut self, from: u32) -> Result<(), SecAggError> {
        self.expect(Stage::Unmask)?;
        if !self.masked.contains(&from) {
            return Err(SecAggError::NotInRound(from));
        }
        if self.revealed.contains_key(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        self.excluded.insert(from);
        Ok(())
    }

    /// Clients excluded for forged shares.
    pub fn excluded(&self) -> impl Iterator<Item = u32> + '_ {
        self.excluded.iter().copied()
    }

    /// The checks of [`receive_unmask`](Self::receive_unmask) without recording
    /// anything (see [`check_shares`](Self::check_shares)).
    pub fn check_unmask(&self, from: u32, reply: &UnmaskShares) -> Result<(), SecAggError> {
        self.parse_unmask(from, reply).map(drop)
    }

    fn parse_unmask(&self, from: u32, reply: &UnmaskShares) -> Result<Revealed, SecAggError> {
        self.expect(Stage::Unmask)?;
        if !self.masked.contains(&from) {
            return Err(SecAggError::NotInRound(from));
        }
        if self.excluded.contains(&from) {
            return Err(SecAggError::Excluded(from));
        }
        if self.config.consistency_check && !self.confirmations.contains_key(&from) {
            return Err(SecAggError::BadMessage(format!(
                "client {from} never signed the survivor list"
            )));
        }
        if self.revealed.contains_key(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        let graph = self.graph();
        let session = &self.config.session;
        let parse = |owner: u32, bytes: &[u8], survived: bool| -> Result<Share, SecAggError> {
            let not_neighbour = SecAggError::NotNeighbour {
                from: owner,
                to: from,
            };
            let (Some(dealt), Some(rank)) =
                (self.shared.get(&owner), graph.neighbour_rank(owner, from))
            else {
                return Err(not_neighbour);
            };
            if self.masked.contains(&owner) != survived {
                return Err(SecAggError::BadMessage(format!(
                    "client {from} revealed the wrong kind of share of client {owner}"
                )));
            }
            let share = Share::from_bytes(bytes)?;
            if share.holder != from {
                return Err(SecAggError::BadMessage(format!(
                    "client {from} sent a share held by client {}",
                    share.holder
                )));
            }
            // Shares are dealt to the neighbours in ascending order (`check_shares`).
            let dealt = dealt
                .shares
                .get(rank)
                .filter(|s| s.to == from)
                .ok_or(not_neighbour)?;
            let (kind, commitment) = if survived {
                (SecretKind::Seed, &dealt.seed_share_commitment)
            } else {
                (SecretKind::MaskKey, &dealt.key_share_commitment)
            };
            if crypto::share_commitment(session, owner, from, kind, bytes) != *commitment {
                return Err(SecAggError::WrongShare {
                    holder: from,
                    owner,
                });
            }
            Ok(share)
        };
        let mut seeds = BTreeMap::new();
        for r in &reply.seed_shares {
            let share = parse(r.owner, &r.share, true)?;
            if seeds.insert(r.owner, share).is_some() {
                return Err(SecAggError::Duplicate(r.owner));
            }
        }
        let mut keys = BTreeMap::new();
        for r in &reply.key_shares {
            let share = parse(r.owner, &r.share, false)?;
            if keys.insert(r.owner, share).is_some() {
                return Err(SecAggError::Duplicate(r.owner));
            }
        }
        Ok(Revealed { seeds, keys })
    }

    /// Secrets that do not have `t` shares yet: `(owner, true)` for a survivor's seed,
    /// `(owner, false)` for a dropped client's key. Empty means [`finish`](Self::finish)
    /// can unmask.
    pub fn missing_secrets(&self) -> Vec<(u32, bool)> {
        let t = self.config.threshold;
        let mut counts: BTreeMap<(u32, bool), usize> = BTreeMap::new();
        for r in self.revealed.values() {
            for &o in r.seeds.keys() {
                *counts.entry((o, true)).or_default() += 1;
            }
            for &o in r.keys.keys() {
                *counts.entry((o, false)).or_default() += 1;
            }
        }
        self.shared
            .keys()
            .map(|&u| (u, self.masked.contains(&u)))
            .filter(|k| counts.get(k).copied().unwrap_or(0) < t)
            .collect()
    }

    /// Who dropped at which stage, as far as the round has got.
    pub fn dropouts(&self) -> Dropouts {
        let closed = self.closed;
        let missing = |all: &mut dyn Iterator<Item = u32>, have: &dyn Fn(u32) -> bool| {
            all.filter(|&u| !have(u)).collect::<Vec<u32>>()
        };
        let failed_at_reveal = matches!(
            &self.stage,
            ServerStage::Failed(SecAggError::MissingReveals(_))
        );
        Dropouts {
            advertise: if closed >= 1 {
                missing(&mut (1..=self.config.parties), &|u| {
                    self.keys.contains_key(&u)
                })
            } else {
                Vec::new()
            },
            reveal: if closed >= 2 || failed_at_reveal {
                missing(&mut self.keys.keys().copied(), &|u| {
                    self.reveals.contains_key(&u)
                })
            } else {
                Vec::new()
            },
            share: if closed >= 3 {
                missing(&mut self.keys.keys().copied(), &|u| {
                    self.shared.contains_key(&u)
                })
            } else {
                Vec::new()
            },
            masked: if closed >= 4 {
                missing(&mut self.shared.keys().copied(), &|u| {
                    self.masked.contains(&u)
                })
            } else {
                Vec::new()
            },
            confirm: if closed >= 5 && self.config.consistency_check {
                missing(&mut self.masked.iter().copied(), &|u| {
                    self.confirmations.contains_key(&u)
                })
            } else {
                Vec::new()
            },
            unmask: if closed >= 6 {
                // Asked to unmask: every survivor, or with the consistency check those
                // that signed the list (the others are listed under `confirm` alone).
                missing(
                    &mut self.masked.iter().copied().filter(|u| {
                        !self.config.consistency_check || self.confirmations.contains_key(u)
                    }),
                    &|u| self.revealed.contains_key(&u),
                )
            } else {
                Vec::new()
            },
        }
    }

    /// Rebuilds the survivors' seeds and the dropped clients' mask keys from `t` shares
    /// each, checks them against the seed commitments and advertised keys, removes every
    /// mask from the sum and decodes the weighted mean. A secret without `t` shares, or
    /// one that fails its check, fails the round.
    pub fn finish(&mut self) -> Result<Unmasked, SecAggError> {
        self.expect(Stage::Unmask)?;
        if self.external_sum {
            return Err(SecAggError::BadMessage(
                "the masked inputs were folded by the caller: use finish_with".into(),
            ));
        }
        // The sum is unmasked in place; the session is finished or failed afterwards,
        // so it never needs the masked sum again.
        let sum = std::mem::take(&mut self.sum);
        self.finish_sum(sum)
    }

    /// [`finish`](Self::finish) for a round whose masked inputs the caller folded itself
    /// (the wrapping sum of every input recorded with
    /// [`restore_masked`](Self::restore_masked) or
    /// [`receive_masked`](Self::receive_masked)).
    pub fn finish_with(&mut self, sum: Vec<u32>) -> Result<Unmasked, SecAggError> {
        self.expect(Stage::Unmask)?;
        if sum.len() != self.input_words() {
            return Err(SecAggError::WrongLength {
                expected: self.input_words(),
                found: sum.len(),
            });
        }
        self.finish_sum(sum)
    }

    fn finish_sum(&mut self, mut sum: Vec<u32>) -> Result<Unmasked, SecAggError> {
        match self.unmask_sum(&mut sum) {
            Ok((masks_removed, mask_seconds)) => {
                self.quantizer.narrow_words(&mut sum);
                let survivors: Vec<u32> = self.masked.iter().copied().collect();
                let decoded = match self.quantizer.decode(&sum, survivors.len()) {
                    Ok(d) => d,
                    Err(e) => return Err(self.fail(e.into())),
                };
                self.stage = ServerStage::Finished;
                self.closed = 6;
                Ok(Unmasked {
                    sum,
                    decoded,
                    survivors,
                    dropouts: self.dropouts(),
                    excluded: self.excluded.iter().copied().collect(),
                    masks_removed,
                    mask_seconds,
                })
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Every survivor's self-mask seed and every dropped client's mask key pair, rebuilt
    /// from the revealed shares and checked against what their owners committed to.
    fn rebuild_secrets(&self) -> Result<Vec<Rebuilt>, SecAggError> {
        let t = self.config.threshold;
        let session = &self.config.session;
        // Every secret's shares from the first t holders (by index) that revealed one, in
        // one pass over the replies: looking each secret up in every reply was quadratic
        // in the clients (10,000 clients: 10^8 lookups, most of the server's unmasking).
        let mut seed_shares: HashMap<u32, Vec<&Share>> = HashMap::new();
        let mut key_shares: HashMap<u32, Vec<&Share>> = HashMap::new();
        for reply in self.revealed.values() {
            for (found, into) in [
                (&reply.seeds, &mut seed_shares),
                (&reply.keys, &mut key_shares),
            ] {
                for (&owner, share) in found {
                    let shares = into.entry(owner).or_default();
                    if shares.len() < t {
                        shares.push(share);
                    }
                }
            }
        }
        // Every secret to rebuild: each survivor's self-mask seed, each dropped client's
        // mask key, with the shares it is rebuilt from.
        let wanted: Vec<(u32, bool)> = self
            .masked
            .iter()
            .map(|&u| (u, true))
            .chain(
                self.shared
                    .keys()
                    .filter(|u| !self.masked.contains(u))
                    .map(|&u| (u, false)),
            )
            .collect();
        let mut secrets = Vec::with_capacity(wanted.len());
        for &(owner, survived) in &wanted {
            let shares: &[&Share] = if survived {
                seed_shares.get(&owner)
            } else {
                key_shares.get(&owner)
            }
            .map_or(&[], Vec::as_slice);
            if shares.len() < t {
                return Err(SecAggError::CannotRecover {
                    client: owner,
                    have: shares.len(),
                    need: t,
                });
            }
            let holders: Vec<u32> = shares.iter().map(|s| s.holder).collect();
            secrets.push((owner, survived, shares, holders));
        }
        // One interpolator per distinct set of holders (a full graph's hundreds of
        // secrets share one), then every secret rebuilt and checked against what its
        // owner committed to, all on every core: at 10,000 clients the rebuilds were a
        // serial tenth of the unmasking.
        let mut sets: Vec<Vec<u32>> = secrets
            .iter()
            .map(|(_, _, _, holders)| holders.clone())
            .collect();
        sets.sort_unstable();
        sets.dedup();
        let interpolators: HashMap<Vec<u32>, Interpolator> = sets
            .into_par_iter()
            .map(|holders| Interpolator::new(&holders).map(|i| (holders, i)))
            .collect::<Result<_, _>>()?;
        secrets
            .par_iter()
            .map(|(owner, survived, shares, holders)| {
                let (owner, survived) = (*owner, *survived);
                let secret = zeroize::Zeroizing::new(
                    interpolators[holders]
                        .combine(shares)
                        .map_err(|_| SecAggError::ReconstructionFailed { client: owner })?,
                );
                if survived {
                    if crypto::seed_commitment(session, owner, &secret)
                        != self.shared[&owner].seed_commitment
                    {
                        return Err(SecAggError::ReconstructionFailed { client: owner });
                    }
                    Ok(Rebuilt::Seed(secret))
                } else {
                    let key = KeyPair::from_secret_bytes(*secret);
                    if key.public() != self.keys[&owner].mask_pk {
                        return Err(SecAggError::ReconstructionFailed { client: owner });
                    }
                    Ok(Rebuilt::Key(owner, key))
                }
            })
            .collect()
    }

    fn unmask_sum(&self, sum: &mut [u32]) -> Result<(usize, f64), SecAggError> {
        let session = &self.config.session;
        // The rebuilt secrets unmask single inputs: wiped as soon as the masks are off.
        let mut self_seeds = Vec::with_capacity(self.masked.len());
        let mut dropped_keys = Vec::new();
        for secret in self.rebuild_secrets()? {
            match secret {
                Rebuilt::Seed(seed) => self_seeds.push(seed),
                Rebuilt::Key(u, key) => dropped_keys.push((u, key)),
            }
        }
        // The pairwise masks between each dropped client and its surviving neighbours,
        // which those neighbours added with the opposite sign to the one removed here.
        let graph = self.graph();
        let pairs: Vec<(u32, u32)> = dropped_keys
            .iter()
            .enumerate()
            .flat_map(|(i, &(u, _))| {
                graph
                    .neighbours(u)
                    .expect("a member")
                    .into_iter()
                    .filter(|v| self.masked.contains(v))
                    .map(move |v| (i as u32, v))
            })
            .collect();
        let pair_seeds: Vec<(zeroize::Zeroizing<[u8; KEY_BYTES]>, MaskSign)> = pairs
            .par_iter()
            .map(|&(i, v)| {
                let (u, key) = &dropped_keys[i as usize];
                let shared = zeroize::Zeroizing::new(key.agree(&self.keys[&v].mask_pk)?);
                let seed =
                    zeroize::Zeroizing::new(crypto::pairwise_mask_seed(&shared, session, *u, v));
                // v added +PRG when v < u, -PRG otherwise; undo it.
                let sign = if v < *u {
                    MaskSign::Subtract
                } else {
                    MaskSign::Add
                };
                Ok((seed, sign))
            })
            .collect::<Result<_, SecAggError>>()?;
        let mut masks: Vec<Mask<'_>> = self_seeds
            .iter()
            .map(|seed| Mask {
                seed,
                sign: MaskSign::Subtract,
            })
            .collect();
        masks.extend(
            pair_seeds
                .iter()
                .map(|(seed, sign)| Mask { seed, sign: *sign }),
        );
        let started = std::time::Instant::now();
        self.reducer
            .apply_masks(&masks, 0, sum)
            .map_err(|e| match e {
                crate::reduce::ReduceError::Prg(p) => SecAggError::Prg(p),
                other => SecAggError::Reducer(other.to_string()),
            })?;
        Ok((masks.len(), started.elapsed().as_secs_f64()))
    }
}
