//! A coordinator that deviates from the protocol. The honest clients are the real
//! [`ClientSession`]s, the code the edge client runs; the coordinator is this test code,
//! which routes the honest clients' messages, keeps everything they send it, and tampers
//! with what it sends them. Each test is one attack: the honest clients refuse it (the
//! error they return is asserted), and where the attack aims at an update, what the
//! coordinator collected is counted: it never holds `t` shares of a victim's self-mask
//! seed and `t` shares of its mask key, the pair that would unmask the victim's input.
//! Where an attack needs a lever (a key whose private half the coordinator knows, a graph
//! it could choose), the test shows the lever is real, so that the refusal is what stops
//! it.

use std::collections::{BTreeMap, BTreeSet};

use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use super::crypto::{self, KeyPair};
use super::identity::IdentityError;
use super::local::{ClientInput, run_round};
use super::messages::SHARE_PLAINTEXT_BYTES;
use super::prg::{self, Mask, MaskSign};
use super::shamir::{self, SHARE_BYTES, Share};
use super::tests::{Round, advertise_and_reveal, config, join, study_floors, update_of};
use super::*;

/// The shares of each client's two secrets that honest clients revealed to the
/// coordinator, by owner, whether or not the protocol would have used them.
#[derive(Default)]
struct Loot {
    seeds: BTreeMap<u32, Vec<Share>>,
    keys: BTreeMap<u32, Vec<Share>>,
}

impl Loot {
    /// Keeps an honest client's answer to an unmask request.
    fn take(&mut self, reply: &UnmaskShares) {
        for (kind, revealed) in [
            (&mut self.seeds, &reply.seed_shares),
            (&mut self.keys, &reply.key_shares),
        ] {
            for r in revealed {
                keep(kind, r.owner, Share::from_bytes(&r.share).unwrap());
            }
        }
    }

    /// Keeps a share pair the coordinator decrypted itself (dealt to a neighbour it
    /// impersonates).
    fn take_pair(&mut self, owner: u32, seed: Share, key: Share) {
        keep(&mut self.seeds, owner, seed);
        keep(&mut self.keys, owner, key);
    }

    fn seed_shares(&self, owner: u32) -> usize {
        self.seeds.get(&owner).map_or(0, Vec::len)
    }

    fn key_shares(&self, owner: u32) -> usize {
        self.keys.get(&owner).map_or(0, Vec::len)
    }

    /// `owner`'s self-mask seed, when `t` of the shares rebuild the seed it committed to.
    fn seed(&self, cfg: &RoundConfig, owner: u32, commitment: &[u8; 32]) -> Option<[u8; 32]> {
        let shares = self.seeds.get(&owner)?;
        let seed = shamir::combine(shares, cfg.threshold).ok()?;
        (crypto::seed_commitment(&cfg.session, owner, &seed) == *commitment).then_some(seed)
    }

    /// `owner`'s mask key pair, when `t` of the shares rebuild the key it advertised.
    fn mask_key(&self, cfg: &RoundConfig, owner: u32, public: &[u8; 32]) -> Option<KeyPair> {
        let shares = self.keys.get(&owner)?;
        let key = KeyPair::from_secret_bytes(shamir::combine(shares, cfg.threshold).ok()?);
        (key.public() == *public).then_some(key)
    }

    /// The protocol's promise: the coordinator cannot rebuild both of `owner`'s secrets.
    fn assert_cannot_unmask(&self, round: &Masked, owner: u32) {
        let (seeds, keys) = (self.seed_shares(owner), self.key_shares(owner));
        let t = round.cfg.threshold;
        assert!(
            seeds < t || keys < t,
            "the coordinator holds {seeds} seed shares and {keys} key shares of client {owner}"
        );
        let seed = self.seed(&round.cfg, owner, &round.shares[&owner].seed_commitment);
        let key = self.mask_key(&round.cfg, owner, &round.keys[&owner].mask_pk);
        assert!(seed.is_none() || key.is_none());
        // The counts above cover one route; the attempt covers every one, the
        // neighbours' mask keys included.
        if round.inputs.contains_key(&owner) {
            assert_eq!(self.try_unmask_upload(round, owner), None, "client {owner}");
        }
    }

    /// The coordinator's attempt on `victim`'s masked `input` with every secret this loot
    /// rebuilds: the victim's self-mask seed, and for each neighbour it masked with
    /// (`masked_with`, those whose shares the coordinator forwarded it) the pair's mask
    /// seed, from either end's rebuilt mask key. `keys` are the keys as the victim was
    /// shown them, `shares` the share messages (for the seed commitment). `None` when a
    /// secret is missing; otherwise the input with every mask the victim added removed.
    fn try_unmask(
        &self,
        cfg: &RoundConfig,
        victim: u32,
        input: &[u32],
        masked_with: &[u32],
        keys: &BTreeMap<u32, AdvertiseKeys>,
        shares: &BTreeMap<u32, ShareKeys>,
    ) -> Option<Vec<u32>> {
        let victim_pk = keys.get(&victim)?.mask_pk;
        let self_seed = self.seed(cfg, victim, &shares.get(&victim)?.seed_commitment)?;
        let victim_key = self.mask_key(cfg, victim, &victim_pk);
        let mut pair_seeds = Vec::with_capacity(masked_with.len());
        for &v in masked_with {
            let v_pk = keys.get(&v)?.mask_pk;
            let shared = match &victim_key {
                Some(key) => key.agree(&v_pk).ok()?,
                None => self.mask_key(cfg, v, &v_pk)?.agree(&victim_pk).ok()?,
            };
            // The victim added +PRG(s) towards a higher index and -PRG(s) towards a lower.
            let undo = if victim < v {
                MaskSign::Subtract
            } else {
                MaskSign::Add
            };
            pair_seeds.push((
                crypto::pairwise_mask_seed(&shared, &cfg.session, victim, v),
                undo,
            ));
        }
        let mut masks = vec![Mask {
            seed: &self_seed,
            sign: MaskSign::Subtract,
        }];
        masks.extend(
            pair_seeds
                .iter()
                .map(|(seed, sign)| Mask { seed, sign: *sign }),
        );
        let mut words = input.to_vec();
        prg::apply_masks(&masks, 0, &mut words).ok()?;
        Some(words)
    }

    /// [`try_unmask`](Self::try_unmask) on what `round` kept of `victim`'s upload.
    fn try_unmask_upload(&self, round: &Masked, victim: u32) -> Option<Vec<u32>> {
        self.try_unmask(
            &round.cfg,
            victim,
            &round.inputs[&victim],
            &round.masked_with[&victim],
            &round.keys,
            &round.shares,
        )
    }
}

/// Adds a share unless its holder already gave one of the same secret: the same round
/// replayed gives the same share again, and a repeated holder would spoil the combining.
fn keep(kind: &mut BTreeMap<u32, Vec<Share>>, owner: u32, share: Share) {
    let held = kind.entry(owner).or_default();
    if !held.iter().any(|s| s.holder == share.holder) {
        held.push(share);
    }
}

/// A round by the book through masking: every client advertised, revealed, shared and
/// uploaded its masked input, but those in `absent`, which leave after sharing; the
/// coordinator kept every message.
struct Masked {
    cfg: RoundConfig,
    server: ServerSession,
    clients: BTreeMap<u32, ClientSession>,
    identities: BTreeMap<u32, Identity>,
    keys: BTreeMap<u32, AdvertiseKeys>,
    shares: BTreeMap<u32, ShareKeys>,
    /// Each uploader's quantised input, before masking: what an attack must not recover.
    quantized: BTreeMap<u32, Vec<u32>>,
    /// Each uploader's masked input, as the coordinator received it.
    inputs: BTreeMap<u32, Vec<u32>>,
    /// For each uploader, the neighbours whose shares it was forwarded, and so masked
    /// with.
    masked_with: BTreeMap<u32, Vec<u32>>,
}

fn through_masking(cfg: &RoundConfig, seed: u64) -> Masked {
    through_masking_without(cfg, seed, &[])
}

fn through_masking_without(cfg: &RoundConfig, seed: u64, absent: &[u32]) -> Masked {
    let Round {
        mut server,
        mut clients,
        identities,
        keys,
        mut rng,
        ..
    } = advertise_and_reveal(cfg, seed);
    let mut shares = BTreeMap::new();
    for (&u, c) in clients.iter_mut() {
        let m = c
            .share_keys(&server.directory_for(u).unwrap(), &mut rng)
            .unwrap();
        server.receive_shares(u, &m).unwrap();
        shares.insert(u, m);
    }
    server.close_sharing().unwrap();
    let (mut quantized, mut inputs, mut masked_with) =
        (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for (&u, c) in clients.iter_mut().filter(|(u, _)| !absent.contains(u)) {
        let f = server.forwarded_for(u).unwrap();
        // What `mask` does, in two steps (drawing the same randomness), to keep the
        // quantised input.
        let q = c
            .quantizer()
            .encode(&update_of(u, cfg.dimension, seed), 1, 0.0, &mut rng)
            .unwrap();
        let m = c.mask_quantized(&f, q.clone()).unwrap();
        server.receive_masked(u, &m).unwrap();
        quantized.insert(u, q);
        inputs.insert(u, m);
        masked_with.insert(u, f.shares.iter().map(|s| s.from).collect());
    }
    Masked {
        cfg: cfg.clone(),
        server,
        clients,
        identities,
        keys,
        shares,
        quantized,
        inputs,
        masked_with,
    }
}

/// The survivor list the coordinator tells some clients: every client but `dropped`.
fn list_without(list: &UnmaskRequest, dropped: u32) -> UnmaskRequest {
    UnmaskRequest {
        survivors: list
            .survivors
            .iter()
            .copied()
            .filter(|&u| u != dropped)
            .collect(),
        signatures: vec![],
    }
}

/// How one honest client answered the coordinator's unmask request.
#[derive(Debug, PartialEq)]
enum Answer {
    /// It revealed its shares.
    Revealed,
    /// It refused.
    Refused(SecAggError),
}

/// The split-list attack on `victim`, with the consistency check: the clients in
/// `told_alive` (the victim among them) are sent the true survivor list, every other
/// client the list without the victim, and each signs the list it was sent. The
/// coordinator then asks each client to unmask, first with every signature it holds from
/// the client's neighbours on the client's list (over either list), then with only those
/// over the client's own list. Returns what the coordinator collected and each client's
/// final answer.
fn split_lists(
    round: &mut Masked,
    victim: u32,
    told_alive: &BTreeSet<u32>,
) -> (Loot, BTreeMap<u32, Answer>) {
    assert!(round.cfg.consistency_check && told_alive.contains(&victim));
    let alive = round.server.close_collection().unwrap();
    let dropped = list_without(&alive, victim);
    let list_of = |u: u32| {
        if told_alive.contains(&u) {
            &alive
        } else {
            &dropped
        }
    };
    let mut signed = BTreeMap::new();
    for (&u, c) in round.clients.iter_mut() {
        let confirmation = c.confirm(list_of(u), &round.identities[&u]).unwrap();
        signed.insert(
            u,
            SurvivorSignature {
                index: u,
                signature: confirmation.signature,
            },
        );
        // A client signs one list per round: the other gathers no second signature.
        let other = if told_alive.contains(&u) {
            &dropped
        } else {
            &alive
        };
        assert!(matches!(
            c.confirm(other, &round.identities[&u]),
            Err(SecAggError::WrongStage { .. })
        ));
    }
    let t = round.cfg.threshold;
    let mut loot = Loot::default();
    let mut answers = BTreeMap::new();
    for (&u, c) in round.clients.iter_mut() {
        let mine = list_of(u);
        let on_my_list: Vec<u32> = round
            .server
            .neighbours(u)
            .unwrap()
            .into_iter()
            .filter(|v| mine.survivors.binary_search(v).is_ok())
            .collect();
        let request = |signers: &mut dyn Iterator<Item = &u32>| UnmaskRequest {
            signatures: signers.map(|v| signed[v].clone()).collect(),
            ..mine.clone()
        };
        let same_list = |v: &&u32| told_alive.contains(v) == told_alive.contains(&u);
        // Signatures over the other list do not verify over this one.
        if let Some(&other) = on_my_list.iter().find(|v| !same_list(v)) {
            assert_eq!(
                c.unmask(&request(&mut on_my_list.iter())),
                Err(IdentityError::BadSignature(other).into()),
                "client {u}"
            );
        }
        let valid: Vec<u32> = on_my_list.iter().filter(same_list).copied().collect();
        let answer = match c.unmask(&request(&mut valid.iter())) {
            Ok(reply) => {
                assert!(valid.len() >= t);
                loot.take(&reply);
                Answer::Revealed
            }
            Err(e) => {
                assert_eq!(
                    e,
                    SecAggError::TooFewConfirmations {
                        client: u,
                        have: valid.len(),
                        need: t
                    }
                );
                Answer::Refused(e)
            }
        };
        answers.insert(u, answer);
    }
    (loot, answers)
}

/// Tells each client `lists[u]` and asks it to unmask. Without the consistency check
/// the list goes alone; with it, each client first signs its list, and is then sent the
/// signatures of its listed neighbours, first all of them (refused on the first over
/// another list), then only those over its own. Returns what the coordinator collected
/// and each client's final answer.
fn tell_lists(
    round: &mut Masked,
    lists: &BTreeMap<u32, UnmaskRequest>,
) -> (Loot, BTreeMap<u32, Answer>) {
    let mut loot = Loot::default();
    let mut answers = BTreeMap::new();
    if !round.cfg.consistency_check {
        for (&u, c) in round.clients.iter_mut() {
            let answer = match c.unmask(&lists[&u]) {
                Ok(reply) => {
                    loot.take(&reply);
                    Answer::Revealed
                }
                Err(e) => Answer::Refused(e),
            };
            answers.insert(u, answer);
        }
        return (loot, answers);
    }
    let mut signed = BTreeMap::new();
    for (&u, c) in round.clients.iter_mut() {
        let confirmation = c.confirm(&lists[&u], &round.identities[&u]).unwrap();
        signed.insert(
            u,
            SurvivorSignature {
                index: u,
                signature: confirmation.signature,
            },
        );
    }
    for (&u, c) in round.clients.iter_mut() {
        let mine = &lists[&u];
        let on_my_list: Vec<u32> = round
            .server
            .neighbours(u)
            .unwrap()
            .into_iter()
            .filter(|v| mine.survivors.binary_search(v).is_ok())
            .collect();
        let request = |signers: &[u32]| UnmaskRequest {
            signatures: signers.iter().map(|v| signed[v].clone()).collect(),
            ..mine.clone()
        };
        let same_list = |v: &u32| lists[v].survivors == mine.survivors;
        if let Some(&other) = on_my_list.iter().find(|v| !same_list(v)) {
            assert_eq!(
                c.unmask(&request(&on_my_list)),
                Err(IdentityError::BadSignature(other).into()),
                "client {u}"
            );
        }
        let valid: Vec<u32> = on_my_list.iter().copied().filter(same_list).collect();
        let answer = match c.unmask(&request(&valid)) {
            Ok(reply) => {
                loot.take(&reply);
                Answer::Revealed
            }
            Err(e) => Answer::Refused(e),
        };
        answers.insert(u, answer);
    }
    (loot, answers)
}

/// For each client, the clients it is told dropped.
type Plan = BTreeMap<u32, BTreeSet<u32>>;

/// Each client's neighbours.
type Graph = BTreeMap<u32, Vec<u32>>;

/// The neighbours' route to `victim`'s input: for each neighbour `v`, `t` of `v`'s own
/// neighbours told "v dropped" (to reveal shares of `v`'s mask key), no client told
/// that more than `k - t` of its neighbours dropped (more and it refuses), and nobody
/// told that the victim dropped (so that its holders reveal its seed). Returns, for each
/// client, the neighbours of the victim it is told dropped, or `None` when the graph
/// admits no such plan.
fn neighbour_key_plan(graph: &BTreeMap<u32, Vec<u32>>, victim: u32, t: usize) -> Option<Plan> {
    fn place(
        targets: &[u32],
        graph: &BTreeMap<u32, Vec<u32>>,
        t: usize,
        drops: &mut BTreeMap<u32, BTreeSet<u32>>,
    ) -> bool {
        let Some((&v, rest)) = targets.split_first() else {
            return true;
        };
        let holders = &graph[&v];
        for bits in 0u32..1 << holders.len() {
            if bits.count_ones() as usize != t {
                continue;
            }
            let chosen: Vec<u32> = (0..holders.len())
                .filter(|i| bits >> i & 1 == 1)
                .map(|i| holders[i])
                .collect();
            if chosen
                .iter()
                .any(|h| drops.get(h).map_or(0, BTreeSet::len) + t >= graph[h].len())
            {
                continue;
            }
            for &h in &chosen {
                drops.entry(h).or_default().insert(v);
            }
            if place(rest, graph, t, drops) {
                return true;
            }
            for &h in &chosen {
                drops.get_mut(&h).unwrap().remove(&v);
            }
        }
        false
    }
    let mut drops = BTreeMap::new();
    place(&graph[&victim], graph, t, &mut drops).then_some(drops)
}

/// The survivor lists of a [`neighbour_key_plan`]: each client is told the true list
/// less the clients the plan has it told dropped.
fn plan_lists(alive: &UnmaskRequest, plan: &Plan) -> BTreeMap<u32, UnmaskRequest> {
    alive
        .survivors
        .iter()
        .map(|&u| {
            let gone = plan.get(&u).cloned().unwrap_or_default();
            let list = UnmaskRequest {
                survivors: alive
                    .survivors
                    .iter()
                    .copied()
                    .filter(|v| !gone.contains(v))
                    .collect(),
                signatures: vec![],
            };
            (u, list)
        })
        .collect()
}

/// A round of `cfg` and a victim whose graph admits a [`neighbour_key_plan`]: the first
/// found over `seeds`, with the graph, or `None`.
fn round_with_a_plan(
    cfg: &RoundConfig,
    seeds: std::ops::Range<u64>,
) -> Option<(u64, u32, Graph, Plan)> {
    for seed in seeds {
        let round = through_masking(cfg, seed);
        let graph: Graph = (1..=cfg.parties)
            .map(|u| (u, round.server.neighbours(u).unwrap()))
            .collect();
        for victim in 1..=cfg.parties {
            if let Some(plan) = neighbour_key_plan(&graph, victim, cfg.threshold) {
                return Some((seed, victim, graph, plan));
            }
        }
    }
    None
}

/// The control for every `try_unmask` that comes back `None`: given both kinds of
/// secret, which no honest client gives, it recovers the victim's exact quantised input,
/// through the victim's own mask key or through every neighbour's, and not with one
/// secret short. The secrets come from replays of one deterministic round, each told
/// another survivor list, as if the holders answered more than once.
#[test]
fn try_unmask_recovers_the_exact_input_once_it_holds_every_secret_and_not_before() {
    let cfg = config(7, 6, 4, 3);
    // In the middle, so that it added some pairwise masks and subtracted others.
    let victim = 4;
    let replay = |dropped: Option<u32>, loot: &mut Loot| -> Masked {
        let mut round = through_masking(&cfg, 50);
        let alive = round.server.close_collection().unwrap();
        let list = dropped.map_or_else(|| alive.clone(), |d| list_without(&alive, d));
        for (_, c) in round
            .clients
            .iter_mut()
            .filter(|(u, _)| Some(**u) != dropped)
        {
            loot.take(&c.unmask(&list).unwrap());
        }
        round
    };
    // By the book, every client survived: the coordinator rebuilds every seed and no
    // key, and unmasks no one.
    let mut by_the_book = Loot::default();
    let round = replay(None, &mut by_the_book);
    for u in 1..=7 {
        assert_eq!(by_the_book.try_unmask_upload(&round, u), None, "client {u}");
    }
    let expected = &round.quantized[&victim];
    assert_ne!(&round.inputs[&victim], expected);
    // Through the victim's own key: the key alone is not enough, with the seed it is.
    let mut own = Loot::default();
    let replayed = replay(Some(victim), &mut own);
    assert_eq!(
        replayed.inputs, round.inputs,
        "the replay is the same round"
    );
    assert_eq!(own.try_unmask_upload(&round, victim), None);
    replay(None, &mut own);
    assert_eq!(
        own.try_unmask_upload(&round, victim).as_ref(),
        Some(expected)
    );
    // Through the neighbours' keys: the seed and all but one of them is not enough.
    let mut theirs = Loot::default();
    replay(None, &mut theirs);
    let neighbours: Vec<u32> = (1..=7).filter(|&v| v != victim).collect();
    for &v in &neighbours {
        assert_eq!(theirs.try_unmask_upload(&round, victim), None, "before {v}");
        replay(Some(v), &mut theirs);
    }
    assert_eq!(theirs.key_shares(victim), 0);
    assert_eq!(
        theirs.try_unmask_upload(&round, victim).as_ref(),
        Some(expected)
    );
}

/// Attack (f), the neighbours' route, on a sparse graph with the consistency check: the
/// victim's input is unmasked by its seed and, instead of its own mask key, the mask
/// key of every neighbour. The coordinator tells the victim's holders that it survived
/// and each neighbour's other holders that that neighbour dropped, each holder the list
/// that suits it, on a graph where such lists exist. Its levers are refused first: a
/// neighbour will not sign a list without itself (`NotInRound`), a client not one that
/// drops more than `k - t` of its neighbours (`TooFewNeighbours`). Then the plan's
/// lists fall apart on the check (`BadSignature`, `TooFewConfirmations`): a neighbour
/// that reveals a share of the victim's seed had `t` of its neighbours sign its list,
/// which names it, and a share of its own key needs `t` others to answer lists without
/// it; `2t > k` neighbours would have to sign two lists. Every neighbour that reveals
/// for the victim keeps its own key, and the victim's input stays masked.
#[test]
fn in_a_sparse_graph_the_neighbours_mask_keys_route_is_refused_with_the_consistency_check() {
    let cfg = RoundConfig {
        consistency_check: true,
        ..config(20, 6, 4, 2)
    };
    let t = cfg.threshold;
    let (seed, victim, graph, plan) = round_with_a_plan(&cfg, 60..61).unwrap();
    let mut round = through_masking(&cfg, seed);
    let alive = round.server.close_collection().unwrap();
    let targets = graph[&victim].clone();
    for &v in &targets {
        let c = round.clients.get_mut(&v).unwrap();
        assert_eq!(
            c.confirm(&list_without(&alive, v), &round.identities[&v]),
            Err(SecAggError::NotInRound(v))
        );
        assert_eq!(c.stage(), Some(Stage::Confirm));
    }
    let all_gone = UnmaskRequest {
        survivors: alive
            .survivors
            .iter()
            .copied()
            .filter(|v| !targets.contains(v))
            .collect(),
        signatures: vec![],
    };
    let c = round.clients.get_mut(&victim).unwrap();
    assert_eq!(
        c.confirm(&all_gone, &round.identities[&victim]),
        Err(SecAggError::TooFewNeighbours {
            client: victim,
            have: 0,
            need: t
        })
    );
    assert_eq!(c.stage(), Some(Stage::Confirm));
    let lists = plan_lists(&alive, &plan);
    let (loot, answers) = tell_lists(&mut round, &lists);
    // Each client answers by its own rule: t of its neighbours signed its list.
    for (&u, answer) in &answers {
        let have = graph[&u]
            .iter()
            .filter(|w| lists[w].survivors == lists[&u].survivors)
            .count();
        let expected = if have >= t {
            Answer::Revealed
        } else {
            Answer::Refused(SecAggError::TooFewConfirmations {
                client: u,
                have,
                need: t,
            })
        };
        assert_eq!(*answer, expected, "client {u}");
    }
    for &v in &targets {
        if answers[&v] == Answer::Revealed {
            assert!(loot.mask_key(&cfg, v, &round.keys[&v].mask_pk).is_none());
        }
    }
    assert!(
        answers.values().any(|a| *a != Answer::Revealed),
        "the plan went through"
    );
    assert_eq!(loot.try_unmask_upload(&round, victim), None);
    for u in 1..=cfg.parties {
        loot.assert_cannot_unmask(&round, u);
    }
}

/// Attack (f) without the consistency check, the same plan on the same graph.
///
/// Why every client requires the consistency check by default. Without it this attack
/// succeeds: on the ring graph with k = 6 and t = 4 (20 clients), every client is told a
/// list that drops at most k - t = 2 of its neighbours, so each one answers; the victim's
/// holders all list it (seed rebuilt), and each of its 6 neighbours is dropped by 4 of
/// its own neighbours (mask key rebuilt), so `try_unmask` returns the victim's exact
/// quantised input. The one-kind-per-holder rule protects only the victim's own pair of
/// secrets, not its neighbours' keys. (With k = 4, t = 3 the ring admits no plan: 12
/// drops needed, 9 available.) So a client with the default floors refuses such a round
/// before it makes a key, and only one run with `--allow-no-consistency-check` is
/// exposed, as this test shows.
#[test]
fn without_the_consistency_check_the_neighbours_mask_keys_route_unmasks_so_clients_refuse_it() {
    assert!(round_with_a_plan(&config(12, 4, 3, 2), 60..62).is_none());
    let cfg = config(20, 6, 4, 2);
    assert!(!cfg.consistency_check);
    let mut rng = ChaCha20Rng::seed_from_u64(7);
    let identity = Identity::from_rng(&mut rng);
    let refused = ClientSession::new(cfg.clone(), 1, &identity, &mut rng).unwrap_err();
    assert!(
        matches!(&refused, SecAggError::BelowFloor(f) if f.flag == "--allow-no-consistency-check"),
        "{refused}"
    );
    // Clients that allow it (the study floors) are exposed.
    let (seed, victim, _, plan) = round_with_a_plan(&cfg, 60..61).unwrap();
    let mut round = through_masking(&cfg, seed);
    let alive = round.server.close_collection().unwrap();
    let lists = plan_lists(&alive, &plan);
    let (loot, answers) = tell_lists(&mut round, &lists);
    assert!(answers.values().all(|a| *a == Answer::Revealed));
    assert_eq!(
        loot.try_unmask_upload(&round, victim).as_ref(),
        Some(&round.quantized[&victim]),
        "the attack this floor exists for"
    );
}

/// Attack (a): the coordinator puts keys it made, whose private halves it holds, in
/// place of a neighbour's, to decrypt the shares the victim deals that neighbour and to
/// compute its pairwise mask. It cannot sign them as the neighbour: the victim refuses
/// the directory before it draws a secret.
#[test]
fn a_neighbours_keys_swapped_for_the_coordinators_are_refused_for_their_signature() {
    let cfg = config(8, 4, 3, 2);
    let Round {
        server,
        mut clients,
        identities,
        keys,
        mut rng,
        ..
    } = advertise_and_reveal(&cfg, 31);
    let directory = server.directory_for(1).unwrap();
    let v = server.neighbours(1).unwrap()[1];
    let (cipher, mask) = (KeyPair::generate(&mut rng), KeyPair::generate(&mut rng));
    // The lever: with its own key in the directory, the coordinator would derive the key
    // the victim encrypts that neighbour's shares under.
    let victim_pk = keys[&1].cipher_pk;
    assert_ne!(
        cipher.agree(&victim_pk).unwrap(),
        KeyPair::generate(&mut rng).agree(&victim_pk).unwrap()
    );
    let victim = clients.get_mut(&1).unwrap();
    let swap = |cipher_pk: Option<[u8; 32]>, mask_pk: Option<[u8; 32]>| {
        let mut forged = directory.clone();
        let entry = forged.entries.iter_mut().find(|e| e.index == v).unwrap();
        entry.keys.cipher_pk = cipher_pk.unwrap_or(entry.keys.cipher_pk);
        entry.keys.mask_pk = mask_pk.unwrap_or(entry.keys.mask_pk);
        forged
    };
    for forged in [
        swap(Some(cipher.public()), None),
        swap(None, Some(mask.public())),
        swap(Some(cipher.public()), Some(mask.public())),
    ] {
        assert_eq!(
            victim.share_keys(&forged, &mut rng),
            Err(IdentityError::BadSignature(v).into())
        );
    }
    // Signed by the coordinator's own identity but presented under the neighbour's
    // registered one, or under the victim's own: the signature is not theirs.
    let coordinator = Identity::from_rng(&mut rng);
    let mut forged = swap(Some(cipher.public()), Some(mask.public()));
    let entry = forged.entries.iter_mut().find(|e| e.index == v).unwrap();
    entry.keys.signature = coordinator.sign(&cfg.advertise_statement(
        v,
        &cipher.public(),
        &mask.public(),
        &entry.keys.graph_commitment,
    ));
    assert_eq!(
        victim.share_keys(&forged, &mut rng),
        Err(IdentityError::BadSignature(v).into())
    );
    let entry = forged.entries.iter_mut().find(|e| e.index == v).unwrap();
    entry.identity = identities[&1].public();
    assert_eq!(
        victim.share_keys(&forged, &mut rng),
        Err(IdentityError::BadSignature(v).into())
    );
    // The neighbour's real keys, signed, but moved to another neighbour's place.
    let w = server.neighbours(1).unwrap()[2];
    let mut moved = directory.clone();
    let real = moved.entries.iter().find(|e| e.index == v).unwrap().clone();
    let entry = moved.entries.iter_mut().find(|e| e.index == w).unwrap();
    (entry.keys, entry.identity) = (real.keys, real.identity);
    assert!(matches!(
        victim.share_keys(&moved, &mut rng),
        Err(SecAggError::BadMessage(_) | SecAggError::Identity(_))
    ));
    // Nothing changed: the true directory is taken, and the victim deals v a share.
    let shares = victim.share_keys(&directory, &mut rng).unwrap();
    assert!(shares.shares.iter().any(|s| s.to == v));
}

/// Attack (a), with identities: the coordinator signs its keys with an identity of its
/// own and presents it for two of the victim's neighbours (one fabricated identity is
/// one more client it controls; two places in one neighbourhood need two). The victim
/// refuses an identity presented twice, as the coordinator's own server refuses it at
/// advertising.
#[test]
fn one_fabricated_identity_presented_for_two_neighbours_is_refused_as_shared() {
    let cfg = config(8, 4, 3, 2);
    let Round {
        mut server,
        mut clients,
        identities,
        keys,
        mut rng,
        ..
    } = advertise_and_reveal(&cfg, 32);
    let directory = server.directory_for(1).unwrap();
    let neighbours = server.neighbours(1).unwrap();
    let (v, w) = (neighbours[0], neighbours[3]);
    let coordinator = Identity::from_rng(&mut rng);
    let mut forged = directory.clone();
    for entry in forged
        .entries
        .iter_mut()
        .filter(|e| e.index == v || e.index == w)
    {
        let (cipher, mask) = (KeyPair::generate(&mut rng), KeyPair::generate(&mut rng));
        entry.keys.cipher_pk = cipher.public();
        entry.keys.mask_pk = mask.public();
        entry.keys.signature = coordinator.sign(&cfg.advertise_statement(
            entry.index,
            &cipher.public(),
            &mask.public(),
            &entry.keys.graph_commitment,
        ));
        entry.identity = coordinator.public();
    }
    let victim = clients.get_mut(&1).unwrap();
    assert_eq!(
        victim.share_keys(&forged, &mut rng),
        Err(IdentityError::SharedIdentity(v.min(w), v.max(w)).into())
    );
    // The victim's own identity is not one a neighbour may present either, even with a
    // signature that verifies: the victim's own keys, signed by it, in v's place.
    let mut mine = directory.clone();
    let own = mine.entries.iter().find(|e| e.index == 1).unwrap().clone();
    let entry = mine.entries.iter_mut().find(|e| e.index == v).unwrap();
    entry.identity = own.identity;
    entry.keys = AdvertiseKeys {
        signature: identities[&1].sign(&cfg.advertise_statement(
            v,
            &own.keys.cipher_pk,
            &own.keys.mask_pk,
            &entry.keys.graph_commitment,
        )),
        graph_commitment: entry.keys.graph_commitment,
        ..own.keys
    };
    // (The victim would never sign that statement; the test signs it to show that the
    // identity alone is refused.)
    assert_eq!(
        victim.share_keys(&mine, &mut rng),
        Err(IdentityError::SharedIdentity(1.min(v), 1.max(v)).into())
    );
    // The coordinator's own server, run by the book, refuses the same identity twice.
    let mut honest = ServerSession::new(cfg.clone()).unwrap();
    honest
        .receive_keys(1, &keys[&1], &identities[&1].public())
        .unwrap();
    let mut twice = keys[&2].clone();
    twice.signature = identities[&1].sign(&cfg.advertise_statement(
        2,
        &twice.cipher_pk,
        &twice.mask_pk,
        &twice.graph_commitment,
    ));
    assert_eq!(
        honest.receive_keys(2, &twice, &identities[&1].public()),
        Err(IdentityError::SharedIdentity(1, 2).into())
    );
    // Refused without a change: the true directory is taken.
    let m = victim.share_keys(&directory, &mut rng).unwrap();
    server.receive_shares(1, &m).unwrap();
}

/// The limit the module documents, measured: a coordinator that enrols an identity of
/// its own (exposed only by fingerprints checked out of band) can stand in for one of
/// the victim's neighbours, and decrypts the share pair the victim deals it. That is one
/// seed share and one key share; every honest neighbour reveals one kind or the other,
/// never both, so with `t > k / 2` no split of the honest neighbours between "the victim
/// survived" and "the victim dropped" gives `t` of both, even without the consistency
/// check.
#[test]
fn a_neighbour_impersonated_under_an_enrolled_identity_is_one_share_pair_short_of_enough() {
    let cfg = config(7, 6, 4, 2);
    let (victim, impostor) = (1, 2);
    let honest: Vec<u32> = (3..=7).collect();
    for told_alive in 0..=honest.len() {
        let Round {
            mut server,
            mut clients,
            keys,
            mut rng,
            ..
        } = advertise_and_reveal(&cfg, 33);
        let enrolled = Identity::from_rng(&mut rng);
        let (cipher, mask) = (KeyPair::generate(&mut rng), KeyPair::generate(&mut rng));
        let mut directory = server.directory_for(victim).unwrap();
        let entry = directory
            .entries
            .iter_mut()
            .find(|e| e.index == impostor)
            .unwrap();
        entry.keys.cipher_pk = cipher.public();
        entry.keys.mask_pk = mask.public();
        entry.keys.signature = enrolled.sign(&cfg.advertise_statement(
            impostor,
            &cipher.public(),
            &mask.public(),
            &entry.keys.graph_commitment,
        ));
        entry.identity = enrolled.public();
        let mut shares = BTreeMap::new();
        for (&u, c) in clients.iter_mut() {
            let mine = if u == victim {
                directory.clone()
            } else {
                server.directory_for(u).unwrap()
            };
            let m = c.share_keys(&mine, &mut rng).unwrap();
            server.receive_shares(u, &m).unwrap();
            shares.insert(u, m);
        }
        server.close_sharing().unwrap();
        // The coordinator opens the pair the victim dealt "the impostor".
        let mut loot = Loot::default();
        let dealt = shares[&victim]
            .shares
            .iter()
            .find(|s| s.to == impostor)
            .unwrap();
        let key = crypto::share_key(
            &cipher.agree(&keys[&victim].cipher_pk).unwrap(),
            &cfg.session,
            victim,
            impostor,
        );
        let plain = crypto::open(&key, &cfg.session, victim, impostor, &dealt.ciphertext).unwrap();
        assert_eq!(plain.len(), SHARE_PLAINTEXT_BYTES);
        let (seed_share, key_share) = plain[8..].split_at(SHARE_BYTES);
        loot.take_pair(
            victim,
            Share::from_bytes(seed_share).unwrap(),
            Share::from_bytes(key_share).unwrap(),
        );
        // Between the victim and the real client 2 the shares no longer open: the
        // coordinator drops them, and each still holds t.
        let (mut upload, mut masked_with) = (Vec::new(), Vec::new());
        for (&u, c) in clients.iter_mut() {
            let mut f = server.forwarded_for(u).unwrap();
            f.shares.retain(|s| {
                !(s.from == victim && u == impostor || s.from == impostor && u == victim)
            });
            let m = c.mask(&f, &update_of(u, 2, 33), 1, 0.0, &mut rng).unwrap();
            server.receive_masked(u, &m).unwrap();
            if u == victim {
                upload = m;
                masked_with = f.shares.iter().map(|s| s.from).collect();
            }
        }
        let alive = server.close_collection().unwrap();
        let dropped = list_without(&alive, victim);
        for (i, &u) in honest.iter().enumerate() {
            let list = if i < told_alive { &alive } else { &dropped };
            loot.take(&clients.get_mut(&u).unwrap().unmask(list).unwrap());
        }
        let (seeds, keys_) = (loot.seed_shares(victim), loot.key_shares(victim));
        assert_eq!(
            (seeds, keys_),
            (1 + told_alive, 1 + honest.len() - told_alive)
        );
        assert!(
            seeds < cfg.threshold || keys_ < cfg.threshold,
            "{seeds} and {keys_}"
        );
        // The counted shares are real: where t of one kind were collected, they rebuild
        // the victim's secret of that kind.
        let seed = loot.seed(&cfg, victim, &shares[&victim].seed_commitment);
        let mask_key = loot.mask_key(&cfg, victim, &keys[&victim].mask_pk);
        assert_eq!(seed.is_some(), seeds >= cfg.threshold);
        assert_eq!(mask_key.is_some(), keys_ >= cfg.threshold);
        assert!(seed.is_none() || mask_key.is_none());
        // The keys as the victim was shown them, the impostor's among them.
        let mut shown = keys.clone();
        shown.extend(directory.entries.iter().map(|e| (e.index, e.keys.clone())));
        assert_eq!(
            loot.try_unmask(&cfg, victim, &upload, &masked_with, &shown, &shares),
            None,
            "{told_alive} told alive"
        );
    }
}

/// Attack (b), on the complete graph: the coordinator tells some of the victim's
/// neighbours that it survived and the others that it dropped, hoping for seed shares
/// from the first and key shares from the others. Each client signs the one list it was
/// sent; one given its neighbours' signatures over the other list refuses them
/// (`BadSignature`), one given fewer than `t` over its own refuses to answer
/// (`TooFewConfirmations`). For every split, one side falls short: the coordinator
/// rebuilds the seed of a victim that survived, or the key of one that dropped, as the
/// protocol intends, never both.
#[test]
fn survivor_lists_that_differ_between_neighbours_never_give_t_shares_of_both_kinds() {
    let cfg = RoundConfig {
        consistency_check: true,
        ..config(7, 6, 4, 2)
    };
    let t = cfg.threshold;
    let victim = 1;
    let neighbours: Vec<u32> = (2..=7).collect();
    for told_alive in 0..=neighbours.len() {
        let mut round = through_masking(&cfg, 34);
        let alive_side: BTreeSet<u32> = std::iter::once(victim)
            .chain(neighbours[..told_alive].iter().copied())
            .collect();
        let (loot, answers) = split_lists(&mut round, victim, &alive_side);
        // A neighbour told "alive" has the others told so, and the victim, signing with
        // it; one told "dropped" has the others told so.
        let alive_answer = told_alive >= t;
        let dropped_answer = neighbours.len() - told_alive > t;
        for (&u, answer) in &answers {
            let expected = if alive_side.contains(&u) {
                alive_answer
            } else {
                dropped_answer
            };
            assert_eq!(
                *answer == Answer::Revealed,
                expected,
                "client {u} with {told_alive} told alive: {answer:?}"
            );
        }
        let seeds = if alive_answer { told_alive } else { 0 };
        let keys = if dropped_answer {
            neighbours.len() - told_alive
        } else {
            0
        };
        assert_eq!(
            (loot.seed_shares(victim), loot.key_shares(victim)),
            (seeds, keys)
        );
        loot.assert_cannot_unmask(&round, victim);
        let seed = loot.seed(&cfg, victim, &round.shares[&victim].seed_commitment);
        assert_eq!(seed.is_some(), seeds >= t);
        let key = loot.mask_key(&cfg, victim, &round.keys[&victim].mask_pk);
        assert_eq!(key.is_some(), keys >= t);
        // No client's secrets, the victim's or another's, are exposed.
        for u in 1..=7 {
            loot.assert_cannot_unmask(&round, u);
        }
    }
}

/// Attack (b), the count itself: the coordinator cannot make up for missing signatures
/// by repeating one, or by relabelling a signature as another neighbour's; and a client
/// that signed one list does not answer for another.
#[test]
fn survivor_signatures_cannot_be_repeated_relabelled_or_moved_to_another_list() {
    let cfg = RoundConfig {
        consistency_check: true,
        ..config(7, 6, 4, 2)
    };
    let mut round = through_masking(&cfg, 35);
    let list = round.server.close_collection().unwrap();
    let mut signed = BTreeMap::new();
    for (&u, c) in round.clients.iter_mut() {
        let m = c.confirm(&list, &round.identities[&u]).unwrap();
        signed.insert(u, m.signature);
    }
    let signature = |index: u32, of: u32| SurvivorSignature {
        index,
        signature: signed[&of],
    };
    let request = |signatures| UnmaskRequest {
        signatures,
        ..list.clone()
    };
    let c1 = round.clients.get_mut(&1).unwrap();
    assert_eq!(
        c1.unmask(&request(vec![
            signature(2, 2),
            signature(3, 3),
            signature(3, 3)
        ])),
        Err(SecAggError::Duplicate(3))
    );
    assert_eq!(
        c1.unmask(&request(vec![
            signature(2, 2),
            signature(3, 3),
            signature(4, 3)
        ])),
        Err(IdentityError::BadSignature(4).into())
    );
    assert_eq!(
        c1.unmask(&request(vec![
            signature(2, 2),
            signature(3, 3),
            signature(4, 4)
        ])),
        Err(SecAggError::TooFewConfirmations {
            client: 1,
            have: 3,
            need: 4
        })
    );
    // Its own signature does not count for it.
    assert_eq!(
        c1.unmask(&request(vec![
            signature(2, 2),
            signature(3, 3),
            signature(1, 1)
        ])),
        Err(SecAggError::NotNeighbour { from: 1, to: 1 })
    );
    // The list it signed, and no other, even with valid signatures over the other.
    let other = list_without(&list, 7);
    assert!(matches!(
        c1.unmask(&UnmaskRequest {
            signatures: vec![],
            ..other
        }),
        Err(SecAggError::BadMessage(_))
    ));
    let all: Vec<SurvivorSignature> = (2..=7).map(|u| signature(u, u)).collect();
    assert!(c1.unmask(&request(all)).is_ok());
}

/// Attack (b) on a sparse graph, where the check is weaker than on the complete graph:
/// each client counts signatures from its own neighbours, and two of the victim's
/// neighbours whose other neighbourhoods barely meet can each gather `t` over different
/// lists. The coordinator then does get seed shares from one side and key shares from
/// the other; what still protects the victim is that each holder reveals one kind, and
/// `t > k / 2`. The test searches every way of telling the clients the two lists for the
/// one that gets the most of both kinds, runs it with the real clients, and counts.
#[test]
fn in_a_sparse_graph_neighbours_can_be_told_different_lists_but_never_give_t_of_both_kinds() {
    let cfg = RoundConfig {
        consistency_check: true,
        ..config(12, 4, 3, 2)
    };
    let t = cfg.threshold;
    let victim = 1;
    let graph: BTreeMap<u32, Vec<u32>> = {
        let round = through_masking(&cfg, 36);
        (1..=12)
            .map(|u| (u, round.server.neighbours(u).unwrap()))
            .collect()
    };
    // Who answers, by the clients' rule: t of its neighbours signed its own list.
    let answering = |alive_side: &BTreeSet<u32>| -> (usize, usize) {
        let answers = |u: u32| {
            let mine = alive_side.contains(&u);
            graph[&u]
                .iter()
                .filter(|v| alive_side.contains(v) == mine)
                .count()
                >= t
        };
        let seeds = graph[&victim]
            .iter()
            .filter(|&&v| alive_side.contains(&v) && answers(v))
            .count();
        let keys = graph[&victim]
            .iter()
            .filter(|&&v| !alive_side.contains(&v) && answers(v))
            .count();
        (seeds, keys)
    };
    let mut best: Option<(BTreeSet<u32>, (usize, usize))> = None;
    for bits in 0u32..1 << 11 {
        let alive_side: BTreeSet<u32> = std::iter::once(victim)
            .chain((2..=12).filter(|u| bits >> (u - 2) & 1 == 1))
            .collect();
        let got = answering(&alive_side);
        assert!(got.0 < t || got.1 < t, "{alive_side:?} gives {got:?}");
        let score = |(s, k): (usize, usize)| (s.min(k), s + k);
        if best.as_ref().is_none_or(|(_, b)| score(got) > score(*b)) {
            best = Some((alive_side, got));
        }
    }
    let (alive_side, predicted) = best.unwrap();
    assert!(
        predicted.0 >= 1 && predicted.1 >= 1,
        "no split found: {predicted:?}"
    );
    let mut round = through_masking(&cfg, 36);
    let (loot, _) = split_lists(&mut round, victim, &alive_side);
    assert_eq!(
        (loot.seed_shares(victim), loot.key_shares(victim)),
        predicted
    );
    for u in 1..=12 {
        loot.assert_cannot_unmask(&round, u);
    }
}

/// Attack (c): with every nonce in hand, the coordinator would like to choose the graph
/// (a neighbourhood of clients it controls around a victim) by changing, or leaving out,
/// one member's nonce. Each client checks every nonce against the commitment it saw
/// before it revealed its own, and the member list against the roster's.
#[test]
fn a_directory_whose_nonces_or_members_differ_from_the_roster_is_refused() {
    let cfg = config(10, 4, 3, 2);
    let Round {
        server,
        mut clients,
        roster,
        reveals,
        mut rng,
        ..
    } = advertise_and_reveal(&cfg, 37);
    let directory = server.directory_for(1).unwrap();
    let victim = clients.get_mut(&1).unwrap();
    // The lever: other nonces for member 5 draw other neighbourhoods for the victim.
    let draw = |reveals: &[[u8; 32]]| {
        let seed = crypto::graph_seed(&cfg.session, &roster.members, reveals);
        NeighbourGraph::new(&roster.members, &seed, cfg.neighbours)
            .unwrap()
            .neighbours(1)
            .unwrap()
    };
    let honest = draw(&directory.reveals);
    let mut other_graphs = 0;
    for candidate in 0u8..32 {
        let mut ground = directory.clone();
        ground.reveals[4] = [candidate; 32];
        if draw(&ground.reveals) != honest {
            other_graphs += 1;
        }
        let err = victim.share_keys(&ground, &mut rng).unwrap_err();
        assert_eq!(
            err,
            SecAggError::BadMessage("client 5's graph nonce does not match its commitment".into())
        );
    }
    assert!(
        other_graphs > 16,
        "{other_graphs} of 32 nonces draw another graph"
    );
    // Two members' nonces swapped.
    let mut swapped = directory.clone();
    swapped.reveals.swap(2, 3);
    assert!(matches!(
        victim.share_keys(&swapped, &mut rng),
        Err(SecAggError::BadMessage(_))
    ));
    // A member left out (it "dropped" after the others revealed), with or without its
    // nonce, or its nonce alone.
    let mut without = directory.clone();
    without.members.remove(4);
    without.reveals.remove(4);
    without.entries.retain(|e| e.index != 5);
    assert_eq!(
        victim.share_keys(&without, &mut rng),
        Err(SecAggError::BadMessage(
            "the directory's members are not the roster's".into()
        ))
    );
    let mut nonce_missing = directory.clone();
    nonce_missing.reveals.remove(4);
    assert!(matches!(
        victim.share_keys(&nonce_missing, &mut rng),
        Err(SecAggError::WrongLength { .. })
    ));
    // A member added: a stranger with a nonce of the coordinator's.
    let mut added = directory.clone();
    added.members.push(11);
    added.reveals.push([0; 32]);
    assert!(matches!(
        victim.share_keys(&added, &mut rng),
        Err(SecAggError::BadMessage(_))
    ));
    // And the server cannot leave a silent member out either: the attempt fails.
    let mut server = ServerSession::new(cfg.clone()).unwrap();
    let (mut fresh, identities, keys) = join(&cfg, 1..=10, &mut rng);
    for (&u, k) in &keys {
        server.receive_keys(u, k, &identities[&u].public()).unwrap();
    }
    let fresh_roster = server.close_advertise().unwrap();
    for (&u, c) in fresh.iter_mut().filter(|(u, _)| **u != 5) {
        server
            .receive_reveal(u, &c.reveal(&fresh_roster).unwrap())
            .unwrap();
    }
    assert_eq!(
        server.close_reveal(),
        Err(SecAggError::MissingReveals(vec![5]))
    );
    assert_eq!(server.directory(), None);
    assert_eq!(server.dropouts().reveal, vec![5]);
    // Refused without a change: the true directory is taken.
    assert_eq!(reveals[&5].nonce, directory.reveals[4]);
    victim.share_keys(&directory, &mut rng).unwrap();
}

/// Attack (c), earlier: the coordinator sends a roster before any nonce is revealed. One
/// without the client's own commitment (so that the client's nonce would not count), or
/// without the client, is refused before the client reveals anything; one that swaps
/// another member's commitment for one the coordinator can open is refused once that
/// member's signed keys arrive.
#[test]
fn a_roster_without_the_clients_own_commitment_is_refused_before_it_reveals() {
    let cfg = config(6, 5, 3, 2);
    let mut server = ServerSession::new(cfg.clone()).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(38);
    let (mut clients, identities, keys) = join(&cfg, 1..=6, &mut rng);
    for (&u, k) in &keys {
        server.receive_keys(u, k, &identities[&u].public()).unwrap();
    }
    let roster = server.close_advertise().unwrap();
    let nonce = [0x42; 32];
    let chosen = crypto::graph_commitment(&cfg.session, 1, &nonce);
    let victim = clients.get_mut(&1).unwrap();
    let mut not_mine = roster.clone();
    not_mine.commitments[0] = chosen;
    assert_eq!(
        victim.reveal(&not_mine),
        Err(SecAggError::BadMessage(
            "the roster does not hold this client's own graph commitment".into()
        ))
    );
    let mut without_me = roster.clone();
    without_me.members.remove(0);
    without_me.commitments.remove(0);
    assert_eq!(victim.reveal(&without_me), Err(SecAggError::NotInRound(1)));
    assert_eq!(
        victim.stage(),
        Some(Stage::Reveal),
        "no nonce left the client"
    );
    // Member 4's commitment swapped for one the coordinator can open with a nonce of
    // its choosing, once it has seen the victim's.
    let mut swapped = roster.clone();
    swapped.commitments[3] = crypto::graph_commitment(&cfg.session, 4, &nonce);
    let revealed = victim.reveal(&swapped).unwrap();
    server.receive_reveal(1, &revealed).unwrap();
    for (&u, c) in clients.iter_mut().filter(|(u, _)| **u != 1) {
        server
            .receive_reveal(u, &c.reveal(&roster).unwrap())
            .unwrap();
    }
    server.close_reveal().unwrap();
    let mut ground = server.directory_for(1).unwrap();
    ground.reveals[3] = nonce;
    assert_eq!(
        clients.get_mut(&1).unwrap().share_keys(&ground, &mut rng),
        Err(SecAggError::BadMessage(
            "client 4's keys carry another graph commitment than the roster's".into()
        ))
    );
}

/// Attack (d): keys a client signed for one attempt, replayed in another. A neighbour
/// that dropped after sharing in attempt 1 had its mask key rebuilt by the coordinator,
/// as the protocol intends; replaying that neighbour's attempt-1 keys (and nonce) in
/// attempt 2 would give the coordinator the private half of a key the victim masks
/// with. The signature names the attempt, so the victim refuses it; so does a server,
/// for keys of another attempt, session, round or experiment.
#[test]
fn keys_signed_for_one_attempt_are_refused_in_the_next() {
    let first = config(5, 4, 3, 2);
    let (victim, replayed) = (1, 3);
    let mut attempt1 = through_masking_without(&first, 39, &[replayed]);
    let list = attempt1.server.close_collection().unwrap();
    assert!(!list.survivors.contains(&replayed));
    let mut loot = Loot::default();
    for (_, c) in attempt1.clients.iter_mut().filter(|(u, _)| **u != replayed) {
        loot.take(&c.unmask(&list).unwrap());
    }
    // Rebuilding the leaver's key is the protocol working; it unmasks no one's input.
    for &u in attempt1.inputs.keys() {
        assert_eq!(loot.try_unmask_upload(&attempt1, u), None, "client {u}");
    }
    // The lever: the coordinator holds the private half of the replayed mask key.
    let old_keys = attempt1.keys[&replayed].clone();
    let rebuilt = loot
        .mask_key(&first, replayed, &old_keys.mask_pk)
        .expect("rebuilt from the survivors' key shares");
    assert_eq!(rebuilt.public(), old_keys.mask_pk);
    // Attempt 2 under the same session (the coordinator picks it), same identities.
    let second = RoundConfig {
        context: RoundContext {
            attempt: 2,
            ..first.context.clone()
        },
        ..first.clone()
    };
    let mut server = ServerSession::new(second.clone()).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(40);
    let mut clients = BTreeMap::new();
    let mut keys = BTreeMap::new();
    for (&u, identity) in &attempt1.identities {
        let (c, k) =
            ClientSession::with_floors(second.clone(), u, study_floors(), identity, &mut rng)
                .unwrap();
        server.receive_keys(u, &k, &identity.public()).unwrap();
        clients.insert(u, c);
        keys.insert(u, k);
    }
    let mut roster = server.close_advertise().unwrap();
    let mut reveals = BTreeMap::new();
    for (&u, c) in clients.iter_mut().filter(|(u, _)| **u != victim) {
        let r = c.reveal(&roster).unwrap();
        server.receive_reveal(u, &r).unwrap();
        reveals.insert(u, r);
    }
    // The victim is shown the replayed member's attempt-1 commitment, and later its
    // attempt-1 nonce (revealed in attempt 1) and keys, signed by its real identity.
    let old_reveal = {
        // Attempt 1's nonces are public once its directory went out.
        let dir = attempt1.server.directory_for(victim).unwrap();
        dir.reveals[dir.members.binary_search(&replayed).unwrap()]
    };
    let position = roster.members.binary_search(&replayed).unwrap();
    roster.commitments[position] = old_keys.graph_commitment;
    let victim_client = clients.get_mut(&victim).unwrap();
    let r = victim_client.reveal(&roster).unwrap();
    server.receive_reveal(victim, &r).unwrap();
    server.close_reveal().unwrap();
    let mut directory = server.directory_for(victim).unwrap();
    directory.reveals[position] = old_reveal;
    let entry = directory
        .entries
        .iter_mut()
        .find(|e| e.index == replayed)
        .unwrap();
    entry.keys = old_keys.clone();
    assert_eq!(
        victim_client.share_keys(&directory, &mut rng),
        Err(IdentityError::BadSignature(replayed).into())
    );
    // A server refuses keys from another attempt, session, round or experiment.
    let mut others = vec![second.clone()];
    let mut session = first.clone();
    session.session[0] ^= 1;
    others.push(session);
    let mut round = first.clone();
    round.context.round += 1;
    others.push(round);
    let mut experiment = first.clone();
    experiment.context.experiment.push_str("-other");
    others.push(experiment);
    for other in others {
        let mut fresh = ServerSession::new(other).unwrap();
        assert_eq!(
            fresh.receive_keys(
                replayed,
                &old_keys,
                &attempt1.identities[&replayed].public()
            ),
            Err(IdentityError::BadSignature(replayed).into())
        );
    }
}

/// Attack (e): a survivor list that "drops" enough of a client's neighbours that fewer
/// than `t` of them remain, while the list as a whole looks fine (well over `t`
/// survivors, every other client content with it). The client refuses to sign it, with
/// the consistency check, or to answer it, without; the refusal leaves it able to take
/// the true list.
#[test]
fn a_survivor_list_with_fewer_than_t_of_a_clients_neighbours_is_refused() {
    for consistency_check in [false, true] {
        let cfg = RoundConfig {
            consistency_check,
            ..config(12, 4, 3, 2)
        };
        let mut round = through_masking(&cfg, 41);
        let victim = 1;
        let neighbours = round.server.neighbours(victim).unwrap();
        let list = round.server.close_collection().unwrap();
        let gone = &neighbours[..2];
        let short = UnmaskRequest {
            survivors: list
                .survivors
                .iter()
                .copied()
                .filter(|u| !gone.contains(u))
                .collect(),
            signatures: vec![],
        };
        assert_eq!(short.survivors.len(), 10);
        let refused = SecAggError::TooFewNeighbours {
            client: victim,
            have: 2,
            need: 3,
        };
        // A client none of whose neighbours the list drops takes it: only the victim's
        // own count stops it.
        let content = (2..=12)
            .find(|u| {
                !gone.contains(u)
                    && !round
                        .server
                        .neighbours(*u)
                        .unwrap()
                        .iter()
                        .any(|v| gone.contains(v))
            })
            .unwrap();
        let identity = &round.identities[&victim];
        let c = round.clients.get_mut(&victim).unwrap();
        if consistency_check {
            assert_eq!(c.confirm(&short, identity), Err(refused));
            assert_eq!(c.stage(), Some(Stage::Confirm));
            c.confirm(&list, identity).unwrap();
            let other = round.clients.get_mut(&content).unwrap();
            other.confirm(&short, &round.identities[&content]).unwrap();
        } else {
            assert_eq!(c.unmask(&short), Err(refused));
            assert_eq!(c.stage(), Some(Stage::Unmask));
            c.unmask(&list).unwrap();
            let other = round.clients.get_mut(&content).unwrap();
            other.unmask(&short).unwrap();
        }
    }
}

/// The protocol's own dropout handling with the consistency check on, the control for
/// the attacks above: one client leaving at each stage in turn, and one round with a
/// client leaving at every stage but the reveal. A client that leaves at the reveal
/// stage fails the attempt (its nonce is part of the graph); elsewhere the decoded mean
/// is the mean of the survivors' inputs, a client that uploaded counts even if it leaves
/// afterwards, and each leaver is reported at its stage.
#[test]
fn an_honest_round_with_the_consistency_check_survives_a_dropout_at_every_stage() {
    let cfg = RoundConfig {
        consistency_check: true,
        ..config(12, 11, 6, 5)
    };
    let input = |u: u32| ClientInput::Update {
        values: update_of(u, 5, 42),
        weight: 1,
        loss: 0.25,
    };
    let check = |drop_at: BTreeMap<u32, Stage>| {
        let round = run_round(&cfg, [42; 32], &drop_at, false, input);
        let out = round.result.unwrap();
        let uploaded: Vec<u32> = (1..=12)
            .filter(|u| drop_at.get(u).is_none_or(|&s| s > Stage::Masked))
            .collect();
        assert_eq!(out.survivors, uploaded);
        for j in 0..5 {
            let mean = uploaded
                .iter()
                .map(|&u| f64::from(update_of(u, 5, 42)[j]))
                .sum::<f64>()
                / uploaded.len() as f64;
            let got = f64::from(out.decoded.mean[j]);
            assert!(
                (got - mean).abs() <= out.decoded.error_bound,
                "{drop_at:?}, coordinate {j}: {got} vs {mean}"
            );
        }
        assert_eq!(out.decoded.total_weight, uploaded.len() as u64);
        let listed = |stage: Stage| -> Vec<u32> {
            drop_at
                .iter()
                .filter(|(_, s)| **s == stage)
                .map(|(u, _)| *u)
                .collect()
        };
        let d = &out.dropouts;
        assert_eq!(d.advertise, listed(Stage::Advertise));
        assert_eq!(d.reveal, listed(Stage::Reveal));
        assert_eq!(d.share, listed(Stage::Share));
        assert_eq!(d.masked, listed(Stage::Masked));
        assert_eq!(d.confirm, listed(Stage::Confirm));
        assert_eq!(d.unmask, listed(Stage::Unmask));
        assert!(round.aborted.is_empty(), "{:?}", round.aborted);
    };
    for stage in Stage::ALL {
        let drop_at: BTreeMap<u32, Stage> = [(4, stage)].into();
        if stage == Stage::Reveal {
            let round = run_round(&cfg, [42; 32], &drop_at, false, input);
            assert_eq!(
                round.result.unwrap_err(),
                SecAggError::MissingReveals(vec![4])
            );
            assert!(round.timings.client_share.is_empty(), "nothing was shared");
        } else {
            check(drop_at);
        }
    }
    check(
        [
            (2, Stage::Advertise),
            (5, Stage::Share),
            (7, Stage::Masked),
            (9, Stage::Confirm),
            (11, Stage::Unmask),
        ]
        .into(),
    );
}
