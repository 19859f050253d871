//! Whole-protocol tests: random rounds with dropouts at every stage against a plain
//! oracle, the failure cases, refused messages, and the masked vector's uniformity.
//! Attacks by a coordinator that deviates from the protocol are in `attacks.rs`.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use super::identity::IdentityError;
use super::local::{ClientInput, run_round};
use super::*;

/// The default floors, but taking rounds without the consistency check: the tests
/// study both kinds of round (the edge client refuses the second by default).
pub(super) fn study_floors() -> ClientFloors {
    ClientFloors {
        require_consistency_check: false,
        ..ClientFloors::default()
    }
}

pub(super) fn config(
    parties: u32,
    neighbours: usize,
    threshold: usize,
    dimension: usize,
) -> RoundConfig {
    RoundConfig {
        session: [7; 32],
        context: RoundContext {
            experiment: "tests".into(),
            round: 1,
            attempt: 1,
        },
        parties,
        threshold,
        neighbours,
        dimension,
        quantization: QuantizationParams::default(),
        consistency_check: false,
    }
}

/// Deterministic pseudo-random update values in [-3, 3] for client `u`.
pub(super) fn update_of(u: u32, d: usize, salt: u64) -> Vec<f32> {
    let mut s = (u64::from(u) << 20) ^ salt ^ 0x9e37_79b9_7f4a_7c15;
    (0..d)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 6001) as f32 / 1000.0 - 3.0
        })
        .collect()
}

fn weight_of(u: u32) -> u64 {
    1 + u64::from(u * 37 % 500)
}

/// A round by the book up to the share stage: every client's identity, keys and graph
/// nonce, with the server holding all of them. Tests drive the later stages by hand.
pub(super) struct Round {
    pub server: ServerSession,
    pub clients: BTreeMap<u32, ClientSession>,
    pub identities: BTreeMap<u32, Identity>,
    pub keys: BTreeMap<u32, AdvertiseKeys>,
    pub roster: Roster,
    pub reveals: BTreeMap<u32, GraphReveal>,
    pub rng: ChaCha20Rng,
}

/// Clients `members` of `cfg`, each with an identity and keys drawn from `rng`: what
/// each would send in stage 1, nothing sent yet.
pub(super) fn join(
    cfg: &RoundConfig,
    members: impl IntoIterator<Item = u32>,
    rng: &mut ChaCha20Rng,
) -> (
    BTreeMap<u32, ClientSession>,
    BTreeMap<u32, Identity>,
    BTreeMap<u32, AdvertiseKeys>,
) {
    let (mut clients, mut identities, mut keys) =
        (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for u in members {
        let identity = Identity::from_rng(rng);
        let (c, k) =
            ClientSession::with_floors(cfg.clone(), u, study_floors(), &identity, rng).unwrap();
        clients.insert(u, c);
        identities.insert(u, identity);
        keys.insert(u, k);
    }
    (clients, identities, keys)
}

/// Stage 2 by the book for clients that advertised and a server whose stage 1 is
/// closed: each client checks the roster and reveals its nonce, then the stage closes.
pub(super) fn reveal_all(
    server: &mut ServerSession,
    clients: &mut BTreeMap<u32, ClientSession>,
) -> (Roster, BTreeMap<u32, GraphReveal>) {
    let roster = server.roster().expect("stage 1 is closed");
    let mut reveals = BTreeMap::new();
    for (&u, c) in clients.iter_mut() {
        let r = c.reveal(&roster).unwrap();
        server.receive_reveal(u, &r).unwrap();
        reveals.insert(u, r);
    }
    server.close_reveal().unwrap();
    (roster, reveals)
}

/// Stages 1 and 2 by the book for clients `1..=cfg.parties`, keys and randomness from
/// `seed`: every client advertises signed keys and reveals its graph nonce, and both
/// stages are closed.
pub(super) fn advertise_and_reveal(cfg: &RoundConfig, seed: u64) -> Round {
    let mut server = ServerSession::new(cfg.clone()).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let (mut clients, identities, keys) = join(cfg, 1..=cfg.parties, &mut rng);
    for (&u, k) in &keys {
        server.receive_keys(u, k, &identities[&u].public()).unwrap();
    }
    server.close_advertise().unwrap();
    let (roster, reveals) = reveal_all(&mut server, &mut clients);
    Round {
        server,
        clients,
        identities,
        keys,
        roster,
        reveals,
        rng,
    }
}

/// [`advertise_and_reveal`], then every client shares keys with its own directory and
/// sharing closes.
pub(super) fn through_sharing(cfg: &RoundConfig, seed: u64) -> Round {
    let mut round = advertise_and_reveal(cfg, seed);
    for (&u, c) in round.clients.iter_mut() {
        let directory = round.server.directory_for(u).unwrap();
        let m = c.share_keys(&directory, &mut round.rng).unwrap();
        round.server.receive_shares(u, &m).unwrap();
    }
    round.server.close_sharing().unwrap();
    round
}

/// Client `u`'s generator in `local::run_round` with `seed` (as `local.rs` derives it),
/// from which it draws its identity, keys and graph nonce.
fn local_rng(seed: [u8; 32], u: u32) -> ChaCha20Rng {
    let mut s = seed;
    for (b, x) in s.iter_mut().zip(u.to_le_bytes()) {
        *b ^= x;
    }
    s[31] ^= 0xa5;
    ChaCha20Rng::from_seed(s)
}

/// The neighbour graph `local::run_round` with `seed` draws among `members`: from the
/// graph nonces its clients reveal.
fn local_graph(cfg: &RoundConfig, seed: [u8; 32], members: &[u32]) -> NeighbourGraph {
    let mut sessions = Vec::new();
    let mut commitments = Vec::new();
    for &u in members {
        let mut rng = local_rng(seed, u);
        let identity = Identity::from_rng(&mut rng);
        let (c, k) =
            ClientSession::with_floors(cfg.clone(), u, study_floors(), &identity, &mut rng)
                .unwrap();
        sessions.push(c);
        commitments.push(k.graph_commitment);
    }
    let roster = Roster {
        members: members.to_vec(),
        commitments,
    };
    let reveals: Vec<[u8; 32]> = sessions
        .iter_mut()
        .map(|c| c.reveal(&roster).unwrap().nonce)
        .collect();
    let seed = crypto::graph_seed(&cfg.session, members, &reveals);
    NeighbourGraph::new(members, &seed, cfg.neighbours).unwrap()
}

/// What the oracle expects of a round.
#[derive(Debug, PartialEq)]
enum Expected {
    /// The round unmasks the survivors' sum.
    Success,
    /// Members that advertised keys never revealed their nonces: the attempt fails.
    MissingReveals(Vec<u32>),
    /// The round fails cleanly at a close or at unmasking.
    Failure,
}

/// The oracle: whether the round `local::run_round` runs with `seed` can succeed, from
/// the sets alone.
fn expected_outcome(cfg: &RoundConfig, seed: [u8; 32], drop_at: &BTreeMap<u32, Stage>) -> Expected {
    let t = cfg.threshold;
    let present = |u: u32, stage: Stage| drop_at.get(&u).is_none_or(|&d| d > stage);
    let u1: Vec<u32> = (1..=cfg.parties)
        .filter(|&u| present(u, Stage::Advertise))
        .collect();
    if u1.len() < 2 || effective_degree(u1.len(), cfg.neighbours) < t {
        return Expected::Failure;
    }
    let silent: Vec<u32> = u1
        .iter()
        .copied()
        .filter(|&u| !present(u, Stage::Reveal))
        .collect();
    if !silent.is_empty() {
        return Expected::MissingReveals(silent);
    }
    let graph = local_graph(cfg, seed, &u1);
    let u2: BTreeSet<u32> = u1
        .iter()
        .copied()
        .filter(|&u| present(u, Stage::Share))
        .collect();
    if u2.len() < t {
        return Expected::Failure;
    }
    let neighbours_in = |u: u32, set: &BTreeSet<u32>| {
        graph
            .neighbours(u)
            .unwrap()
            .iter()
            .filter(|v| set.contains(v))
            .count()
    };
    // A client with fewer than t neighbours in U2 refuses to mask.
    let u3: BTreeSet<u32> = u2
        .iter()
        .copied()
        .filter(|&u| present(u, Stage::Masked) && neighbours_in(u, &u2) >= t)
        .collect();
    if u3.len() < t {
        return Expected::Failure;
    }
    let responders: BTreeSet<u32> = if cfg.consistency_check {
        // A survivor signs only a list with t of its neighbours on it, and answers only
        // with t signatures of its neighbours over it.
        let signers: BTreeSet<u32> = u3
            .iter()
            .copied()
            .filter(|&u| present(u, Stage::Confirm) && neighbours_in(u, &u3) >= t)
            .collect();
        if signers.len() < t {
            return Expected::Failure;
        }
        signers
            .iter()
            .copied()
            .filter(|&u| present(u, Stage::Unmask) && neighbours_in(u, &signers) >= t)
            .collect()
    } else {
        u3.iter()
            .copied()
            .filter(|&u| present(u, Stage::Unmask))
            .collect()
    };
    if u2.iter().all(|&u| neighbours_in(u, &responders) >= t) {
        Expected::Success
    } else {
        Expected::Failure
    }
}

/// A client's dropout stage: none with weight `stay`, each stage with weight 1 but the
/// reveal stage, where a single dropout fails the round (see [`round_strategy`]).
fn stage_strategy(stay: u32) -> impl Strategy<Value = Option<Stage>> {
    prop_oneof![
        stay => Just(None),
        1 => Just(Some(Stage::Advertise)),
        1 => Just(Some(Stage::Share)),
        1 => Just(Some(Stage::Masked)),
        1 => Just(Some(Stage::Confirm)),
        1 => Just(Some(Stage::Unmask)),
    ]
}

/// n, k, t, d and a dropout stage per client; full graphs only for small n. `stay`
/// weighs staying against dropping at each of the other stages. In about one round in
/// eight one client drops at the reveal stage instead (any more would fail nearly every
/// round there).
fn round_strategy(
    stay: u32,
) -> impl Strategy<Value = (u32, usize, usize, usize, Vec<Option<Stage>>)> {
    (3u32..=200)
        .prop_flat_map(|n| {
            let kmax = if n <= 40 { n as usize - 1 } else { 24 };
            (Just(n), 1usize..=kmax)
        })
        .prop_flat_map(move |(n, k)| {
            let keff = effective_degree(n as usize, k);
            (
                Just(n),
                Just(k),
                (keff / 2 + 1)..=keff,
                1usize..24,
                prop::collection::vec(stage_strategy(stay), n as usize),
                prop::option::weighted(0.125, 0..n as usize),
            )
        })
        .prop_map(|(n, k, t, d, mut stages, silent)| {
            if let Some(i) = silent {
                stages[i] = Some(Stage::Reveal);
            }
            (n, k, t, d, stages)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The heart of the protocol: whoever drops wherever, with or without the
    /// consistency check, the unmasked sum is exactly the survivors' quantised inputs,
    /// the mean is FedAvg within the documented bound, and a round that cannot be
    /// completed fails with an error, not a wrong sum.
    #[test]
    fn unmasked_sum_is_exactly_the_survivors_sum(
        (n, k, t, d, stages) in round_strategy(12),
        salt in any::<u64>(),
        consistency_check in any::<bool>(),
    ) {
        check_round((n, k, t, d), &stages, salt, consistency_check, QuantizationParams::default())?;
    }

    /// Compression under secure aggregation: with a fixed 1, 2, 4 or 8 bits per value
    /// the model words travel in the narrowest of 8, 16 or 32 bits that holds the sum of
    /// every selected client's values, the masks live in that ring, and the unmasked sum
    /// is still exactly the plain sum of the survivors' quantised (rotated) updates.
    #[test]
    fn a_compressed_round_sums_exactly_in_its_narrow_ring(
        (n, k, t, d, stages) in round_strategy(12),
        bits in prop::sample::select(vec![1u32, 2, 4, 8]),
        salt in any::<u64>(),
    ) {
        let quantization = QuantizationParams {
            // Updates are within [-3, 3] and d < 24: no rotated coordinate passes 15.
            clip: 16.0,
            bits: Some(bits),
            rotation_seed: Some(salt),
            ..QuantizationParams::default()
        };
        let quantizer = Quantizer::new(quantization, n).unwrap();
        let levels = (1u64 << bits) - 1;
        let narrowest = [8u32, 16, 32].into_iter().find(|w| u64::from(n) * levels < 1 << w).unwrap();
        prop_assert_eq!(quantizer.word_bits(), narrowest);
        check_round((n, k, t, d), &stages, salt, true, quantization)?;
    }

    /// The same with heavy dropout (about 60% of clients leave at some stage), where
    /// most rounds cannot complete: each must then fail with a clean error, and one
    /// with fewer than t survivors must fail before any share is revealed.
    #[test]
    fn rounds_with_too_few_survivors_fail_cleanly(
        (n, k, t, d, stages) in round_strategy(3),
        salt in any::<u64>(),
        consistency_check in any::<bool>(),
    ) {
        check_round((n, k, t, d), &stages, salt, consistency_check, QuantizationParams::default())?;
    }
}

/// Runs one round of `(n, k, t, d)` with the clients dropping at `stages` and checks
/// its outcome against the oracle.
fn check_round(
    (n, k, t, d): (u32, usize, usize, usize),
    stages: &[Option<Stage>],
    salt: u64,
    consistency_check: bool,
    quantization: QuantizationParams,
) -> Result<(), TestCaseError> {
    {
        let cfg = RoundConfig {
            consistency_check,
            quantization,
            ..config(n, k, t, d)
        };
        let drop_at: BTreeMap<u32, Stage> = stages
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.map(|s| (i as u32 + 1, s)))
            .collect();
        let quantizer = cfg.validate().unwrap();
        let quantized: BTreeMap<u32, Vec<u32>> = (1..=n)
            .map(|u| {
                let mut rng = ChaCha20Rng::seed_from_u64(salt ^ u64::from(u));
                let q = quantizer
                    .encode(
                        &update_of(u, d, salt),
                        weight_of(u),
                        f64::from(u % 5),
                        &mut rng,
                    )
                    .unwrap();
                (u, q)
            })
            .collect();
        let seed = [salt as u8; 32];
        let round = run_round(&cfg, seed, &drop_at, true, |u| {
            ClientInput::Quantized(quantized[&u].clone())
        });
        let expected = expected_outcome(&cfg, seed, &drop_at);
        match round.result {
            Ok(out) => {
                prop_assert_eq!(
                    &expected,
                    &Expected::Success,
                    "the oracle says this round cannot succeed"
                );
                let mut plain = vec![0u32; d + EXTRA_WORDS];
                for u in &out.survivors {
                    for (p, q) in plain.iter_mut().zip(&quantized[u]) {
                        *p = p.checked_add(*q).expect("no wrap");
                    }
                }
                prop_assert_eq!(&out.sum, &plain);
                // FedAvg of the survivors, within the bound.
                let clip = f64::from(cfg.quantization.clip);
                let cap = u64::from(cfg.quantization.max_weight);
                let total: u64 = out.survivors.iter().map(|&u| weight_of(u).min(cap)).sum();
                prop_assert_eq!(out.decoded.total_weight, total);
                let fedavg: Vec<f64> = (0..d)
                    .map(|j| {
                        out.survivors
                            .iter()
                            .map(|&u| {
                                weight_of(u).min(cap) as f64
                                    * f64::from(update_of(u, d, salt)[j]).clamp(-clip, clip)
                            })
                            .sum::<f64>()
                            / total as f64
                    })
                    .collect();
                if cfg.quantization.rotation_seed.is_some() {
                    // Rotating back keeps the error's norm: within sqrt(d) bounds.
                    let err = fedavg
                        .iter()
                        .zip(&out.decoded.mean)
                        .map(|(a, b)| (a - f64::from(*b)).powi(2))
                        .sum::<f64>()
                        .sqrt();
                    let bound = (d as f64).sqrt() * out.decoded.error_bound + 1e-5;
                    prop_assert!(err <= bound, "error {} above {}", err, bound);
                } else {
                    for (j, fedavg) in fedavg.iter().enumerate() {
                        let got = f64::from(out.decoded.mean[j]);
                        prop_assert!(
                            (got - fedavg).abs() <= out.decoded.error_bound + 1e-12,
                            "coordinate {}: {} vs {} (bound {})",
                            j,
                            got,
                            fedavg,
                            out.decoded.error_bound
                        );
                    }
                }
                // Dropouts are reported at the stage they happened (without the
                // consistency check, a client that leaves at its stage leaves at
                // unmasking).
                for (&u, &stage) in &drop_at {
                    let listed = match stage {
                        Stage::Advertise => &out.dropouts.advertise,
                        Stage::Reveal => &out.dropouts.reveal,
                        Stage::Share => &out.dropouts.share,
                        Stage::Masked => &out.dropouts.masked,
                        Stage::Confirm if consistency_check => &out.dropouts.confirm,
                        Stage::Confirm | Stage::Unmask => &out.dropouts.unmask,
                    };
                    prop_assert!(listed.contains(&u), "{} dropped at {}", u, stage);
                }
                if !consistency_check {
                    prop_assert!(out.dropouts.confirm.is_empty());
                }
            }
            Err(e) => {
                prop_assert_ne!(
                    &expected,
                    &Expected::Success,
                    "the round should have succeeded: {}",
                    e
                );
                if let Expected::MissingReveals(silent) = &expected {
                    prop_assert_eq!(&e, &SecAggError::MissingReveals(silent.clone()));
                    prop_assert!(round.timings.client_share.is_empty(), "nothing was shared");
                }
                prop_assert!(
                    matches!(
                        e,
                        SecAggError::TooFewParticipants { .. }
                            | SecAggError::CannotRecover { .. }
                            | SecAggError::MissingReveals(_)
                    ),
                    "a clean failure, got {}",
                    e
                );
                if matches!(e, SecAggError::TooFewParticipants { .. }) {
                    // Failed at a close before unmasking: no client was asked for, or
                    // timed, a single revealed share.
                    prop_assert!(round.timings.client_unmask.is_empty());
                }
            }
        }
    }
    Ok(())
}

/// A coordinator keeps masked inputs on disk and rebuilds the session from stored
/// messages (`restore_keys`, the stored reveals and confirmations, `restore_masked`) and
/// folds the inputs itself (`finish_with`): the result is the live session's, exactly,
/// with and without the consistency check.
#[test]
fn a_session_rebuilt_from_stored_messages_unmasks_the_same_sum() {
    for consistency_check in [false, true] {
        let cfg = RoundConfig {
            consistency_check,
            ..config(12, 8, 5, 9)
        };
        let Round {
            server: mut live,
            mut clients,
            identities,
            keys,
            reveals,
            mut rng,
            ..
        } = advertise_and_reveal(&cfg, 11);
        let mut shares = BTreeMap::new();
        for (&u, c) in clients.iter_mut().filter(|(u, _)| **u != 5) {
            let m = c
                .share_keys(&live.directory_for(u).unwrap(), &mut rng)
                .unwrap();
            live.receive_shares(u, &m).unwrap();
            shares.insert(u, m);
        }
        live.close_sharing().unwrap();
        let mut inputs = BTreeMap::new();
        for (&u, c) in clients.iter_mut().filter(|(u, _)| ![5, 8].contains(*u)) {
            let f = live.forwarded_for(u).unwrap();
            let m = c
                .mask(&f, &update_of(u, 9, 3), weight_of(u), 1.0, &mut rng)
                .unwrap();
            live.receive_masked(u, &m).unwrap();
            inputs.insert(u, m);
        }
        let list = live.close_collection().unwrap();
        let mut confirmations = BTreeMap::new();
        if consistency_check {
            for (&u, c) in clients.iter_mut().filter(|(u, _)| inputs.contains_key(*u)) {
                let m = c.confirm(&list, &identities[&u]).unwrap();
                live.receive_confirmation(u, &m).unwrap();
                confirmations.insert(u, m);
            }
            live.close_confirm().unwrap();
        }
        let mut replies = BTreeMap::new();
        for (&u, c) in clients
            .iter_mut()
            .filter(|(u, _)| inputs.contains_key(*u) && **u != 2)
        {
            let r = c.unmask(&live.unmask_request_for(u).unwrap()).unwrap();
            live.receive_unmask(u, &r).unwrap();
            replies.insert(u, r);
        }
        let expected = live.finish().unwrap();

        let mut rebuilt = ServerSession::new(cfg).unwrap();
        for (&u, k) in &keys {
            rebuilt
                .restore_keys(u, k, &identities[&u].public())
                .unwrap();
        }
        rebuilt.close_advertise().unwrap();
        for (&u, r) in &reveals {
            rebuilt.receive_reveal(u, r).unwrap();
        }
        rebuilt.close_reveal().unwrap();
        assert_eq!(rebuilt.directory(), live.directory(), "the same graph");
        for (&u, m) in &shares {
            rebuilt.receive_shares(u, m).unwrap();
        }
        rebuilt.close_sharing().unwrap();
        let mut sum = vec![0u32; 9 + EXTRA_WORDS];
        for (&u, m) in &inputs {
            rebuilt.restore_masked(u).unwrap();
            for (s, w) in sum.iter_mut().zip(m) {
                *s = s.wrapping_add(*w);
            }
        }
        assert_eq!(rebuilt.close_collection().unwrap(), list);
        if consistency_check {
            for (&u, m) in &confirmations {
                rebuilt.receive_confirmation(u, m).unwrap();
            }
            rebuilt.close_confirm().unwrap();
        }
        for (&u, r) in &replies {
            assert_eq!(rebuilt.unmask_request_for(u), live.unmask_request_for(u));
            rebuilt.receive_unmask(u, r).unwrap();
        }
        assert!(
            matches!(rebuilt.finish(), Err(SecAggError::BadMessage(_))),
            "the sum is the caller's"
        );
        let got = rebuilt.finish_with(sum).unwrap();
        // Everything but the timing.
        assert_eq!(
            (
                &got.sum,
                &got.decoded,
                &got.survivors,
                &got.dropouts,
                got.masks_removed
            ),
            (
                &expected.sum,
                &expected.decoded,
                &expected.survivors,
                &expected.dropouts,
                expected.masks_removed
            )
        );
        assert_eq!(got.dropouts.share, vec![5]);
        assert_eq!(got.dropouts.masked, vec![8]);
        assert_eq!(got.dropouts.unmask, vec![2]);
    }
}

#[test]
fn a_round_with_every_kind_of_dropout_recovers() {
    for consistency_check in [false, true] {
        let cfg = RoundConfig {
            consistency_check,
            ..config(30, 8, 5, 16)
        };
        let drop_at: BTreeMap<u32, Stage> = [
            (3, Stage::Advertise),
            (7, Stage::Share),
            (11, Stage::Masked),
            (15, Stage::Confirm),
            (19, Stage::Unmask),
        ]
        .into();
        let round = run_round(&cfg, [1; 32], &drop_at, false, |u| ClientInput::Update {
            values: update_of(u, 16, 9),
            weight: weight_of(u),
            loss: 0.5,
        });
        let out = round.result.unwrap();
        assert_eq!(
            out.survivors.len(),
            27,
            "15 and 19 still count: they uploaded"
        );
        assert!(out.survivors.contains(&15) && out.survivors.contains(&19));
        assert_eq!(out.dropouts.advertise, vec![3]);
        assert_eq!(out.dropouts.reveal, Vec::<u32>::new());
        assert_eq!(out.dropouts.share, vec![7]);
        assert_eq!(out.dropouts.masked, vec![11]);
        if consistency_check {
            assert_eq!(out.dropouts.confirm, vec![15]);
            assert_eq!(out.dropouts.unmask, vec![19]);
        } else {
            // Without the check there is no confirm stage: 15 leaves at unmasking.
            assert_eq!(out.dropouts.confirm, Vec::<u32>::new());
            assert_eq!(out.dropouts.unmask, vec![15, 19]);
        }
        assert!((out.decoded.mean_loss.unwrap() - 0.5).abs() < 1e-3);
        // Every client sent a masked vector of d + 2 words plus small messages.
        let b = round.bytes_sent[&1];
        assert!(b > 18 * 4 && b < 18 * 4 + 4000, "{b}");
    }
}

#[test]
fn fewer_than_t_survivors_fail_cleanly_and_reveal_nothing() {
    // 6 clients, full graph, t = 4; three drop before masking.
    let cfg = config(6, 5, 4, 4);
    let Round {
        mut server,
        mut clients,
        mut rng,
        ..
    } = through_sharing(&cfg, 5);
    for u in 1..=3 {
        let f = server.forwarded_for(u).unwrap();
        let masked = clients
            .get_mut(&u)
            .unwrap()
            .mask(&f, &[0.5; 4], 10, 0.1, &mut rng)
            .unwrap();
        server.receive_masked(u, &masked).unwrap();
    }
    let err = server.close_collection().unwrap_err();
    assert_eq!(
        err,
        SecAggError::TooFewParticipants {
            stage: Stage::Masked,
            have: 3,
            need: 4
        }
    );
    assert!(server.survivor_list().is_none(), "no shares are asked for");
    assert!(server.unmask_request_for(1).is_none());
    assert!(matches!(server.stage(), ServerStage::Failed(_)));
    assert!(matches!(server.finish(), Err(SecAggError::RoundFailed(_))));
    // A server that asks anyway, naming too few survivors, gets nothing from a client.
    let c1 = clients.get_mut(&1).unwrap();
    let refused = c1.unmask(&UnmaskRequest {
        survivors: vec![1, 2, 3],
        signatures: vec![],
    });
    assert!(matches!(
        refused,
        Err(SecAggError::TooFewParticipants {
            have: 3,
            need: 4,
            ..
        })
    ));
    // ... and the refusal did not use up its one answer: still at the unmask stage.
    assert_eq!(c1.stage(), Some(Stage::Unmask));
}

#[test]
fn a_client_answers_one_unmask_request_only() {
    // A server that tries two survivor lists (to get both shares of client 4) gets the
    // second refused.
    let cfg = config(5, 4, 3, 2);
    let Round {
        server,
        mut clients,
        mut rng,
        ..
    } = through_sharing(&cfg, 6);
    let c1 = clients.get_mut(&1).unwrap();
    let f = server.forwarded_for(1).unwrap();
    c1.mask(&f, &[1.0, 2.0], 3, 0.0, &mut rng).unwrap();
    let first = c1
        .unmask(&UnmaskRequest {
            survivors: vec![1, 2, 3, 4],
            signatures: vec![],
        })
        .unwrap();
    assert_eq!(first.seed_shares.len(), 3);
    assert_eq!(first.key_shares.len(), 1, "client 5 dropped: its key share");
    let second = c1.unmask(&UnmaskRequest {
        survivors: vec![1, 2, 3, 5],
        signatures: vec![],
    });
    assert!(matches!(second, Err(SecAggError::WrongStage { .. })));
}

/// Everything a server can observe before unmasking (the stage messages and the sum so
/// far) is the same whether or not it is later refused a message; refused messages
/// change nothing.
#[test]
fn refused_messages_change_nothing() {
    let cfg = config(8, 4, 3, 3);
    let mut server = ServerSession::new(cfg.clone()).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(7);
    let (mut clients, identities, keys) = join(&cfg, 1..=8, &mut rng);
    let id = |u: u32| identities[&u].public();
    // Stage 1: unknown index, duplicate, weak key, bad signature, shared identity,
    // wrong stage.
    assert_eq!(
        server.receive_keys(0, &keys[&1], &id(1)),
        Err(SecAggError::UnknownClient(0))
    );
    assert_eq!(
        server.receive_keys(9, &keys[&1], &id(1)),
        Err(SecAggError::UnknownClient(9))
    );
    // A low-order key, properly signed, is still refused.
    let mut weak = AdvertiseKeys {
        cipher_pk: [0; 32],
        ..keys[&1].clone()
    };
    weak.signature = identities[&1].sign(&cfg.advertise_statement(
        1,
        &weak.cipher_pk,
        &weak.mask_pk,
        &weak.graph_commitment,
    ));
    assert!(matches!(
        server.receive_keys(1, &weak, &id(1)),
        Err(SecAggError::Crypto(_))
    ));
    // Client 1's keys are not client 2's, nor signed by 2's identity.
    assert_eq!(
        server.receive_keys(2, &keys[&1], &id(1)),
        Err(IdentityError::BadSignature(2).into())
    );
    assert_eq!(
        server.receive_keys(1, &keys[&1], &id(2)),
        Err(IdentityError::BadSignature(1).into())
    );
    assert_eq!(
        server.check_keys(1, &keys[&1], &id(2)),
        Err(IdentityError::BadSignature(1).into())
    );
    assert_eq!(server.advertised().count(), 0, "nothing was accepted");
    for u in 1..=8 {
        server.receive_keys(u, &keys[&u], &id(u)).unwrap();
    }
    assert_eq!(
        server.receive_keys(1, &keys[&1], &id(1)),
        Err(SecAggError::Duplicate(1))
    );
    assert!(matches!(
        server.receive_shares(
            1,
            &ShareKeys {
                seed_commitment: [0; 32],
                shares: vec![]
            }
        ),
        Err(SecAggError::WrongStage { .. })
    ));
    assert!(matches!(
        server.receive_reveal(1, &GraphReveal { nonce: [0; 32] }),
        Err(SecAggError::WrongStage { .. })
    ));
    let roster = server.close_advertise().unwrap();
    assert_eq!(roster.members, (1..=8).collect::<Vec<_>>());
    assert_eq!(
        roster.commitments,
        (1..=8)
            .map(|u| keys[&u].graph_commitment)
            .collect::<Vec<_>>()
    );
    assert_eq!(server.directory(), None, "no directory before every nonce");
    // A client refuses a roster without itself, unsorted, or out of step.
    let c2 = clients.get_mut(&2).unwrap();
    let mut without_me = roster.clone();
    without_me.members.remove(1);
    without_me.commitments.remove(1);
    assert_eq!(c2.reveal(&without_me), Err(SecAggError::NotInRound(2)));
    let mut unsorted = roster.clone();
    unsorted.members.swap(0, 1);
    unsorted.commitments.swap(0, 1);
    assert_eq!(c2.reveal(&unsorted), Err(SecAggError::Unsorted));
    let mut short = roster.clone();
    short.commitments.pop();
    assert!(matches!(
        c2.reveal(&short),
        Err(SecAggError::WrongLength { .. })
    ));
    assert_eq!(
        c2.stage(),
        Some(Stage::Reveal),
        "the refusals changed nothing"
    );
    // Stage 2: a nonce that is not the committed one, a stranger's, a duplicate.
    let mut reveals = BTreeMap::new();
    for (&u, c) in clients.iter_mut() {
        reveals.insert(u, c.reveal(&roster).unwrap());
    }
    assert!(matches!(
        server.receive_reveal(1, &reveals[&2]),
        Err(SecAggError::BadMessage(_))
    ));
    assert_eq!(
        server.receive_reveal(9, &reveals[&1]),
        Err(SecAggError::NotInRound(9))
    );
    for u in 1..=8 {
        server.receive_reveal(u, &reveals[&u]).unwrap();
    }
    assert_eq!(
        server.receive_reveal(1, &reveals[&1]),
        Err(SecAggError::Duplicate(1))
    );
    server.close_reveal().unwrap();
    let dir = server.directory().unwrap();
    assert_eq!(dir.entries.len(), 8);
    // A client refuses a directory without its own keys, or unsorted, or with a bad index.
    let c2 = clients.get_mut(&2).unwrap();
    let mut without_me = dir.clone();
    without_me.members.retain(|&u| u != 2);
    without_me.reveals.remove(1);
    without_me.entries.retain(|e| e.index != 2);
    assert!(matches!(
        c2.share_keys(&without_me, &mut rng),
        Err(SecAggError::BadMessage(_))
    ));
    let mut without_my_keys = dir.clone();
    without_my_keys.entries.retain(|e| e.index != 2);
    assert!(matches!(
        c2.share_keys(&without_my_keys, &mut rng),
        Err(SecAggError::BadMessage(_))
    ));
    let mut without_a_neighbour = server.directory_for(2).unwrap();
    let gone = server.neighbours(2).unwrap()[0];
    without_a_neighbour.entries.retain(|e| e.index != gone);
    assert!(matches!(
        c2.share_keys(&without_a_neighbour, &mut rng),
        Err(SecAggError::BadMessage(_))
    ));
    let mut unsorted = dir.clone();
    unsorted.entries.swap(0, 1);
    assert_eq!(
        c2.share_keys(&unsorted, &mut rng),
        Err(SecAggError::Unsorted)
    );
    let mut swapped_keys = dir.clone();
    swapped_keys.entries[1].keys = keys[&3].clone();
    assert!(matches!(
        c2.share_keys(&swapped_keys, &mut rng),
        Err(SecAggError::BadMessage(_))
    ));
    // Sharing: the refused directories left client 2 able to share.
    let mut messages = BTreeMap::new();
    for (&u, c) in clients.iter_mut() {
        messages.insert(u, c.share_keys(&dir, &mut rng).unwrap());
    }
    let m1 = &messages[&1];
    let mut missing = m1.clone();
    missing.shares.pop();
    assert!(server.receive_shares(1, &missing).is_err());
    let mut foreign = m1.clone();
    let outsider = (2..=8)
        .find(|v| !server.neighbours(1).unwrap().contains(v))
        .unwrap();
    foreign.shares[0].to = outsider;
    assert!(server.receive_shares(1, &foreign).is_err());
    let mut short = m1.clone();
    short.shares[0].ciphertext.pop();
    assert!(matches!(
        server.receive_shares(1, &short),
        Err(SecAggError::WrongLength { .. })
    ));
    assert_eq!(server.shared().count(), 0, "nothing was accepted");
    for (&u, m) in &messages {
        server.receive_shares(u, m).unwrap();
    }
    assert_eq!(server.receive_shares(1, m1), Err(SecAggError::Duplicate(1)));
    server.close_sharing().unwrap();
    // Masking: a client refuses a forwarded share that was tampered with.
    let f1 = server.forwarded_for(1).unwrap();
    let mut tampered = f1.clone();
    tampered.shares[0].ciphertext[3] ^= 1;
    let c1 = clients.get_mut(&1).unwrap();
    assert!(matches!(
        c1.mask(&tampered, &[0.0; 3], 1, 0.0, &mut rng),
        Err(SecAggError::Crypto(_))
    ));
    let mut duplicated = f1.clone();
    duplicated.shares.push(f1.shares[0].clone());
    assert!(c1.mask(&duplicated, &[0.0; 3], 1, 0.0, &mut rng).is_err());
    assert!(
        c1.mask(&f1, &[0.0; 2], 1, 0.0, &mut rng).is_err(),
        "wrong d"
    );
    assert!(c1.mask(&f1, &[f32::NAN; 3], 1, 0.0, &mut rng).is_err());
    let mut masked = BTreeMap::new();
    for (&u, c) in clients.iter_mut() {
        let f = server.forwarded_for(u).unwrap();
        masked.insert(
            u,
            c.mask(&f, &[u as f32 / 10.0; 3], 5, 0.0, &mut rng).unwrap(),
        );
    }
    assert!(server.receive_masked(1, &masked[&1][..4]).is_err());
    assert!(server.receive_masked(99, &masked[&1]).is_err());
    for u in 1..=7 {
        server.receive_masked(u, &masked[&u]).unwrap();
    }
    assert_eq!(
        server.receive_masked(1, &masked[&1]),
        Err(SecAggError::Duplicate(1))
    );
    let request = server.close_collection().unwrap();
    // Client 8 is late: its input is refused, and double masking keeps it private: the
    // server will learn 8's mask key (to cancel its pairwise masks) but honest clients
    // never reveal its self-mask seed.
    assert!(matches!(
        server.receive_masked(8, &masked[&8]),
        Err(SecAggError::WrongStage { .. })
    ));
    let mut replies = BTreeMap::new();
    for u in 1..=7 {
        let reply = clients.get_mut(&u).unwrap().unmask(&request).unwrap();
        assert!(reply.seed_shares.iter().all(|s| s.owner != 8));
        replies.insert(u, reply);
    }
    // Unmasking: shares of the wrong kind, or held by someone else, are refused.
    let r1 = &replies[&1];
    if let Some(first) = r1.seed_shares.first() {
        let mut wrong_kind = r1.clone();
        wrong_kind.key_shares.push(first.clone());
        assert!(server.receive_unmask(1, &wrong_kind).is_err());
    }
    let mut stolen = r1.clone();
    stolen.seed_shares = replies[&2].seed_shares.clone();
    assert!(server.receive_unmask(1, &stolen).is_err());
    assert!(server.receive_unmask(8, r1).is_err(), "8 is not a survivor");
    for (&u, r) in &replies {
        server.receive_unmask(u, r).unwrap();
    }
    assert!(server.missing_secrets().is_empty());
    let out = server.finish().unwrap();
    let expect = (1..=7).map(|u| u as f64 / 10.0).sum::<f64>() / 7.0;
    assert!((f64::from(out.decoded.mean[0]) - expect).abs() <= out.decoded.error_bound);
    assert_eq!(out.dropouts.masked, vec![8]);
}

/// Finding 5 of the security review: one forged share used to fail the round and name
/// the share's owner (`ReconstructionFailed { client: 2 }`). Each share is committed to
/// by its owner, so the forger is named, excluded, and the round finishes from the
/// honest holders' shares.
#[test]
fn a_forged_share_excludes_its_holder_and_the_round_still_unmasks() {
    let Round {
        mut server,
        mut clients,
        mut rng,
        ..
    } = through_sharing(&config(6, 5, 3, 2), 8);
    for (&u, c) in clients.iter_mut() {
        let f = server.forwarded_for(u).unwrap();
        let m = c.mask(&f, &[1.0, -1.0], 2, 0.0, &mut rng).unwrap();
        server.receive_masked(u, &m).unwrap();
    }
    server.close_collection().unwrap();
    for (&u, c) in clients.iter_mut() {
        let mut reply = c.unmask(&server.unmask_request_for(u).unwrap()).unwrap();
        if u == 1 {
            // Client 1 lies about its share of client 2's seed: the limb bytes change,
            // the share still parses.
            let forged = reply.seed_shares.iter_mut().find(|s| s.owner == 2).unwrap();
            forged.share[10] ^= 0x40;
            assert_eq!(
                server.check_unmask(u, &reply),
                Err(SecAggError::WrongShare {
                    holder: 1,
                    owner: 2
                })
            );
            assert_eq!(
                server.receive_unmask(u, &reply),
                Err(SecAggError::WrongShare {
                    holder: 1,
                    owner: 2
                })
            );
            // Excluded: not even its honest answer is taken now.
            let honest = {
                let mut r = reply.clone();
                r.seed_shares
                    .iter_mut()
                    .find(|s| s.owner == 2)
                    .unwrap()
                    .share[10] ^= 0x40;
                r
            };
            assert_eq!(
                server.receive_unmask(u, &honest),
                Err(SecAggError::Excluded(1))
            );
            continue;
        }
        server.receive_unmask(u, &reply).unwrap();
    }
    let out = server.finish().unwrap();
    assert_eq!(out.excluded, vec![1]);
    assert_eq!(
        out.survivors,
        vec![1, 2, 3, 4, 5, 6],
        "1's input stays in the sum"
    );
    assert!((f64::from(out.decoded.mean[0]) - 1.0).abs() <= out.decoded.error_bound);
    assert!((f64::from(out.decoded.mean[1]) + 1.0).abs() <= out.decoded.error_bound);
}

/// Replies received all at once (checked on every core) end as received one by one in
/// the same order: the replies before a forged share are kept, its holder is excluded,
/// the same refusal comes back, a second reply from one sender is a duplicate, and the
/// round finishes with the same sum.
#[test]
fn replies_received_at_once_end_as_received_one_by_one() {
    // Two sessions of one round, driven alike (each party's randomness is seeded).
    let drive = || {
        let Round {
            mut server,
            mut clients,
            mut rng,
            ..
        } = through_sharing(&config(6, 5, 3, 2), 21);
        for (&u, c) in clients.iter_mut() {
            let f = server.forwarded_for(u).unwrap();
            let m = c.mask(&f, &[u as f32, -1.0], 2, 0.0, &mut rng).unwrap();
            server.receive_masked(u, &m).unwrap();
        }
        server.close_collection().unwrap();
        let replies: Vec<(u32, UnmaskShares)> = clients
            .iter_mut()
            .map(|(&u, c)| (u, c.unmask(&server.unmask_request_for(u).unwrap()).unwrap()))
            .collect();
        (server, replies)
    };
    let (mut one_by_one, replies) = drive();
    let (mut at_once, same_replies) = drive();
    assert_eq!(replies, same_replies, "the two sessions are one round");
    let mut forged = replies[3].1.clone();
    let owner = forged.seed_shares[0].owner;
    forged.seed_shares[0].share[10] ^= 0x40;
    let holder = replies[3].0;
    // Two honest replies, a duplicate of the first, then the forged one.
    let batch = [
        (replies[0].0, &replies[0].1),
        (replies[1].0, &replies[1].1),
        (replies[0].0, &replies[0].1),
    ];
    let mut sequential = None;
    for &(u, r) in &batch {
        if let Err(e) = one_by_one.receive_unmask(u, r) {
            sequential = Some(e);
            break;
        }
    }
    assert_eq!(sequential, Some(SecAggError::Duplicate(replies[0].0)));
    assert_eq!(
        at_once.receive_unmasks(&batch),
        Err(SecAggError::Duplicate(replies[0].0))
    );
    let forged_batch = [(replies[2].0, &replies[2].1), (holder, &forged)];
    let wrong = SecAggError::WrongShare { holder, owner };
    for &(u, r) in &forged_batch {
        if let Err(e) = one_by_one.receive_unmask(u, r) {
            assert_eq!(e, wrong);
        }
    }
    assert_eq!(at_once.receive_unmasks(&forged_batch), Err(wrong));
    assert_eq!(
        at_once.excluded().collect::<Vec<_>>(),
        one_by_one.excluded().collect::<Vec<_>>()
    );
    assert_eq!(at_once.excluded().collect::<Vec<_>>(), vec![holder]);
    let rest: Vec<(u32, &UnmaskShares)> = replies[4..].iter().map(|(u, r)| (*u, r)).collect();
    for &(u, r) in &rest {
        one_by_one.receive_unmask(u, r).unwrap();
    }
    at_once.receive_unmasks(&rest).unwrap();
    let (a, b) = (one_by_one.finish().unwrap(), at_once.finish().unwrap());
    assert_eq!(a.sum, b.sum);
    assert_eq!(a.excluded, vec![holder]);
    assert_eq!(b.excluded, vec![holder]);
}

/// A share that does not match the commitment sent with it is refused by its recipient
/// in stage 3, before the recipient masks against a neighbour whose secret it could not
/// help rebuild.
#[test]
fn a_share_that_does_not_match_its_commitment_is_refused_on_arrival() {
    let Round {
        server,
        mut clients,
        mut rng,
        ..
    } = through_sharing(&config(4, 3, 2, 1), 9);
    let mut forwarded = server.forwarded_for(1).unwrap();
    forwarded.shares[0].key_share_commitment[0] ^= 1;
    let client = clients.get_mut(&1).unwrap();
    let err = client
        .mask(&forwarded, &[0.5], 1, 0.0, &mut rng)
        .unwrap_err();
    assert!(err.to_string().contains("commitments"), "{err}");
    // Refused without a change: the true message is still taken.
    let forwarded = server.forwarded_for(1).unwrap();
    client.mask(&forwarded, &[0.5], 1, 0.0, &mut rng).unwrap();
}

/// The default graph keeps rounds alive at the design dropout rate, and the bound that
/// sizes it matches what simulated rounds show.
#[test]
fn default_neighbourhoods_survive_the_design_dropout() {
    for n in [4, 10, 20, 50, 100, 500, 1000, 5000] {
        let k = default_neighbours(n);
        let t = default_threshold(n, k);
        assert!(k < n);
        if k < n - 1 {
            // (A tiny round can miss the target even with the complete graph.)
            assert!(
                failure_bound(n, k, t, DESIGN_DROPOUT) <= DESIGN_FAILURE,
                "n={n} k={k}"
            );
            assert!(
                k >= 2 * (usize::BITS - (n - 1).leading_zeros()) as usize,
                "n={n}"
            );
            // ... and it is the smallest even such k.
            let smaller = default_threshold(n, k - 2);
            assert!(
                failure_bound(n, k - 2, smaller, DESIGN_DROPOUT) > DESIGN_FAILURE
                    || k - 2 < 2 * (usize::BITS - (n - 1).leading_zeros()) as usize
            );
        }
    }
    // The Flower harness's 2 * ceil(log2 n) = 14 for 100 clients fails about one round
    // in 50 at 10% dropout; 20 neighbours about one in 1,600.
    let b14 = failure_bound(100, 14, 8, 0.1);
    assert!((0.01..0.03).contains(&b14), "{b14}");
    assert!(failure_bound(100, 20, 11, 0.1) < 1e-3);
    // Binomial tail against a hand-computed value: P[Bin(4, 0.5) < 2] = 5/16.
    assert!((super::binomial_below(4, 0.5, 2) - 5.0 / 16.0).abs() < 1e-12);
    assert!((super::binomial_below(3, 0.9, 4) - 1.0).abs() < 1e-12);
    assert_eq!(
        failure_bound(5, 4, 2, 0.5),
        1.0,
        "the union bound is capped at 1"
    );
}

#[test]
fn config_checks_name_the_setting() {
    assert!(config(10, 4, 3, 5).validate().is_ok());
    for (bad, word) in [
        (config(1, 4, 3, 5), "at least 2"),
        (config(10, 0, 1, 5), "neighbours"),
        (config(10, 4, 2, 5), "threshold"),
        (config(10, 4, 5, 5), "threshold"),
        (config(10, 4, 3, 0), "dimension"),
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(word), "{e}");
    }
    assert_eq!(default_neighbours(100), 20);
    assert_eq!(default_neighbours(500), 24);
    assert_eq!(
        default_neighbours(10),
        9,
        "small rounds use the complete graph"
    );
    assert_eq!(default_neighbours(3), 2);
    assert_eq!(default_neighbours(2), 1);
    assert_eq!(default_threshold(100, 14), 8);
    assert_eq!(default_threshold(10, 9), 5);
    assert_eq!("unmask".parse::<Stage>(), Ok(Stage::Unmask));
    assert!("later".parse::<Stage>().is_err());
    // Every stage reads back from the name `--dropout-stage` spells, in order.
    for (i, stage) in Stage::ALL.into_iter().enumerate() {
        assert_eq!(stage.as_str().parse::<Stage>(), Ok(stage));
        assert!(i == 0 || Stage::ALL[i - 1] < stage);
    }
    assert_eq!(
        Stage::ALL.map(Stage::as_str),
        [
            "advertise",
            "reveal",
            "share",
            "masked",
            "confirm",
            "unmask"
        ]
    );
}

/// The regularised upper incomplete gamma function Q(a, x) (Numerical Recipes' gammq):
/// the chi-square survival function is Q(df / 2, x / 2).
fn gamma_q(a: f64, x: f64) -> f64 {
    fn ln_gamma(x: f64) -> f64 {
        let c = [
            76.180_091_729_471_46,
            -86.505_320_329_416_77,
            24.014_098_240_830_91,
            -1.231_739_572_450_155,
            0.120_865_097_386_617_9e-2,
            -0.539_523_938_495_3e-5,
        ];
        let mut y = x;
        let tmp = x + 5.5 - (x + 0.5) * (x + 5.5).ln();
        let mut ser = 1.000_000_000_190_015;
        for c in c {
            y += 1.0;
            ser += c / y;
        }
        -tmp + (2.506_628_274_631_000_5 * ser / x).ln()
    }
    let gln = ln_gamma(a);
    if x < a + 1.0 {
        let (mut sum, mut del, mut ap) = (1.0 / a, 1.0 / a, a);
        for _ in 0..10_000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - gln).exp()
    } else {
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / 1e-300;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < 1e-300 {
                d = 1e-300;
            }
            c = b + an / c;
            if c.abs() < 1e-300 {
                c = 1e-300;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - gln).exp() * h
    }
}

/// Chi-square statistic of `words` spread over `2^bits` bins by the bits at `shift`.
fn chi_square_stat(words: &[u32], shift: u32, bits: u32) -> f64 {
    let mut bins = vec![0u64; 1 << bits];
    let mask = (1u32 << bits) - 1;
    for w in words {
        bins[((w >> shift) & mask) as usize] += 1;
    }
    let expected = words.len() as f64 / bins.len() as f64;
    bins.iter()
        .map(|&o| (o as f64 - expected).powi(2) / expected)
        .sum()
}

/// The complementary error function (Numerical Recipes' erfcc, relative error < 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// Chi-square survival function: exact (incomplete gamma) for small degrees of freedom,
/// Wilson-Hilferty's normal approximation (very accurate there) for large ones.
fn chi_square_p(stat: f64, df: f64) -> f64 {
    if df <= 1000.0 {
        return gamma_q(df / 2.0, stat / 2.0);
    }
    let v = 2.0 / (9.0 * df);
    let z = ((stat / df).cbrt() - (1.0 - v)) / v.sqrt();
    0.5 * erfc(z / std::f64::consts::SQRT_2)
}

/// Kolmogorov-Smirnov p-value that `samples` are uniform on [0, 1].
fn ks_uniform_p(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    let n = samples.len() as f64;
    let d = samples
        .iter()
        .enumerate()
        .map(|(i, &p)| (p - i as f64 / n).max((i + 1) as f64 / n - p))
        .fold(0.0, f64::max);
    let lambda = (n.sqrt() + 0.12 + 0.11 / n.sqrt()) * d;
    let q: f64 = (1..100)
        .map(|j| {
            let j = f64::from(j);
            2.0 * (-1f64).powf(j - 1.0) * (-2.0 * j * j * lambda * lambda).exp()
        })
        .sum();
    q.clamp(0.0, 1.0)
}

#[test]
fn statistics_helpers_match_known_values() {
    // chi2(255): median about 254.33, 0.999 quantile about 330.5.
    assert!((gamma_q(127.5, 254.33 / 2.0) - 0.5).abs() < 0.01);
    assert!((chi_square_p(330.52, 255.0) - 0.001).abs() < 0.0003);
    assert!((gamma_q(1.0, 2.0) - (-2f64).exp()).abs() < 1e-12);
    // chi2(51000): mean 51000, sd sqrt(102000) = 319.4; +3.09 sd is the 0.001 tail.
    assert!((chi_square_p(51_000.0, 51_000.0) - 0.5).abs() < 0.01);
    assert!((chi_square_p(51_000.0 + 3.09 * 319.37, 51_000.0) - 0.001).abs() < 0.0003);
    assert!((erfc(0.0) - 1.0).abs() < 1e-7);
    assert!((erfc(1.0) - 0.157_299_207).abs() < 1e-7);
    let mut uniform: Vec<f64> = (0..1000).map(|i| (f64::from(i) + 0.5) / 1000.0).collect();
    assert!(ks_uniform_p(&mut uniform) > 0.99);
    let mut skewed: Vec<f64> = (0..1000).map(|i| (f64::from(i) / 1000.0).powi(2)).collect();
    assert!(ks_uniform_p(&mut skewed) < 1e-6);
}

/// Runs a 4-client round up to stage 3 and returns client 1's unmasked and masked
/// vectors for an all-zero update, the most structured input there is.
fn masked_zero_update(seed: u64, d: usize) -> (Vec<u32>, Vec<u32>) {
    let mut cfg = config(4, 3, 2, d);
    cfg.session = [0; 32];
    cfg.session[..8].copy_from_slice(&seed.to_le_bytes());
    let Round {
        server,
        mut clients,
        mut rng,
        ..
    } = through_sharing(&cfg, seed);
    let f = server.forwarded_for(1).unwrap();
    let client = clients.get_mut(&1).unwrap();
    let quantized = client
        .quantizer()
        .encode(&vec![0.0f32; d], 10, 0.0, &mut rng)
        .unwrap();
    let masked = client.mask_quantized(&f, quantized.clone()).unwrap();
    (quantized, masked)
}

/// A client's masked vector is indistinguishable from uniform 32-bit words. For 200
/// seeds (4096 words each, all-zero updates) and each of the four bytes of a word: the
/// per-seed chi-square p-values are uniform (Kolmogorov-Smirnov) and the sum of the
/// per-seed statistics passes as chi-square with 200 x 255 degrees of freedom; over all
/// seeds pooled, the top 16 bits pass on 65536 bins. Every test must give p > 0.001. The
/// same tests reject the unmasked quantised input outright, so they can tell.
#[test]
fn masked_vectors_are_indistinguishable_from_uniform() {
    let d = 4096 - EXTRA_WORDS;
    let seeds = 200u64;
    let mut per_seed: [Vec<f64>; 4] = Default::default();
    let mut stat_sums = [0.0f64; 4];
    let mut all = Vec::with_capacity(seeds as usize * 4096);
    for seed in 0..seeds {
        let (quantized, masked) = masked_zero_update(seed, d);
        if seed == 0 {
            for shift in [0, 8, 16, 24] {
                let p = chi_square_p(chi_square_stat(&quantized, shift, 8), 255.0);
                assert!(
                    p < 1e-12,
                    "the unmasked input is far from uniform (p = {p})"
                );
            }
        }
        for (b, shift) in [0, 8, 16, 24].into_iter().enumerate() {
            let stat = chi_square_stat(&masked, shift, 8);
            stat_sums[b] += stat;
            per_seed[b].push(chi_square_p(stat, 255.0));
        }
        all.extend_from_slice(&masked);
    }
    for b in 0..4 {
        let pooled = chi_square_p(stat_sums[b], seeds as f64 * 255.0);
        let ks = ks_uniform_p(&mut per_seed[b]);
        let smallest = per_seed[b].iter().copied().fold(1.0, f64::min);
        eprintln!(
            "byte {b}: summed chi-square p = {pooled:.4}, KS p = {ks:.4}, smallest per-seed p = {smallest:.4}"
        );
        assert!(pooled > 0.001, "byte {b}: summed chi-square p = {pooled}");
        assert!(
            ks > 0.001,
            "byte {b}: per-seed p-values not uniform, KS p = {ks}"
        );
    }
    let top16 = chi_square_p(chi_square_stat(&all, 16, 16), 65_535.0);
    eprintln!("top 16 bits over {} words: p = {top16:.4}", all.len());
    assert!(top16 > 0.001, "top 16 bits: p = {top16}");
}

fn noisy_config(parties: u32, dimension: usize, noise_multiplier: f64) -> RoundConfig {
    let mut cfg = config(
        parties,
        parties as usize - 1,
        parties as usize / 2 + 1,
        dimension,
    );
    cfg.quantization.distributed_noise = Some(crate::privacy::distributed::DistributedNoise {
        l2_clip: 1.0,
        noise_multiplier,
    });
    cfg
}

/// Sample variance of the unmasked sum's words read as signed integers.
fn signed_variance(words: &[u32]) -> f64 {
    let values: Vec<f64> = words.iter().map(|&w| f64::from(w as i32)).collect();
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (values.len() - 1) as f64
}

/// Protects the calibration of distributed differential privacy: the sum of the
/// survivors' noise shares, as the coordinator unmasks it, has variance `m * mu` (the
/// configured `(z * Delta)^2` when every selected client survives), and the decoded
/// result reports that noise.
#[test]
fn the_sum_of_distributed_noise_shares_has_the_configured_variance() {
    let d = 6000;
    let z = 0.8;
    for (dropping, seed) in [(0u32, 1u8), (5, 2)] {
        let cfg = RoundConfig {
            session: [seed; 32],
            ..noisy_config(20, d, z)
        };
        let scale = cfg.validate().unwrap().distributed_noise().unwrap().clone();
        let drop_at: BTreeMap<u32, Stage> = (1..=dropping).map(|u| (u, Stage::Masked)).collect();
        let out = run_round(&cfg, [seed; 32], &drop_at, true, |_| ClientInput::Update {
            values: vec![0.0; d],
            weight: 7,
            loss: 1.0,
        })
        .result
        .unwrap();
        let m = out.survivors.len();
        assert_eq!(m, 20 - dropping as usize);
        assert_eq!(out.sum[d] as usize, m, "the count word");
        let expected = m as f64 * scale.share_variance(d);
        if dropping == 0 {
            let configured = (z * scale.sensitivity(d)).powi(2);
            assert!((expected / configured - 1.0).abs() < 1e-12);
        }
        // Zero updates round to exactly 0: the words are the noise alone. The sample
        // variance of 6000 draws has a relative standard error of sqrt(2 / 6000) = 1.8%;
        // 5 standard errors is 9%.
        let var = signed_variance(&out.sum[..d]);
        assert!(
            (var / expected - 1.0).abs() < 0.09,
            "{m} survivors: variance {var:.4e}, expected {expected:.4e}"
        );
        let reported = out.decoded.noise_std * m as f64 * scale.gamma();
        assert!((reported / expected.sqrt() - 1.0).abs() < 1e-9);
        assert!((scale.effective_noise_multiplier(m) - z * (m as f64 / 20.0).sqrt()).abs() < 1e-12);
        assert_eq!(out.decoded.mean_loss, None, "no loss is released under DP");
    }
}

/// Protects the mean under distributed noise: updates are clipped to the L2 norm, weigh
/// equally, and without noise the decoded mean is the mean of the clipped updates within
/// the rounding bound.
#[test]
fn distributed_noise_rounds_decode_the_mean_of_clipped_updates() {
    let d = 40;
    let cfg = noisy_config(9, d, 0.0);
    let update = |u: u32| update_of(u, d, 5);
    let out = run_round(&cfg, [3; 32], &BTreeMap::new(), false, |u| {
        ClientInput::Update {
            values: update(u),
            weight: weight_of(u),
            loss: 0.0,
        }
    })
    .result
    .unwrap();
    let clipped: Vec<Vec<f64>> = (1..=9)
        .map(|u| {
            let x = update(u);
            let norm = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            x.iter().map(|v| f64::from(*v) / norm.max(1.0)).collect()
        })
        .collect();
    for j in 0..d {
        let exact = clipped.iter().map(|c| c[j]).sum::<f64>() / 9.0;
        assert!(
            (f64::from(out.decoded.mean[j]) - exact).abs() <= out.decoded.error_bound,
            "coordinate {j}"
        );
    }
    assert_eq!(out.decoded.total_weight, 9, "clients weigh equally");
}

/// Everything the coordinator sees of a hand-driven distributed-noise round: every
/// message as JSON except client 1's masked vector, then the unmasked sum. Every client
/// draws its keys from one generator of `key_seed`; client 1 draws its masking-stage
/// randomness (rounding and noise share) from `noise_seed`.
fn coordinator_view(key_seed: u64, noise_seed: u64, d: usize) -> (Vec<String>, Vec<u32>) {
    let cfg = RoundConfig {
        consistency_check: true,
        ..noisy_config(6, d, 1.0)
    };
    let mut server = ServerSession::new(cfg.clone()).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(key_seed);
    let mut client_one = ChaCha20Rng::seed_from_u64(noise_seed);
    let mut seen = Vec::new();
    fn json<T: serde::Serialize>(v: &T) -> String {
        serde_json::to_string(v).unwrap()
    }
    let (mut clients, identities, keys) = join(&cfg, 1..=6, &mut rng);
    for (&u, k) in &keys {
        seen.push(json(k));
        server.receive_keys(u, k, &identities[&u].public()).unwrap();
    }
    server.close_advertise().unwrap();
    let (_, reveals) = reveal_all(&mut server, &mut clients);
    seen.extend(reveals.values().map(json));
    for (&u, c) in &mut clients {
        let m = c
            .share_keys(&server.directory_for(u).unwrap(), &mut rng)
            .unwrap();
        seen.push(json(&m));
        server.receive_shares(u, &m).unwrap();
    }
    server.close_sharing().unwrap();
    // Client 6 drops after sharing, so the coordinator also learns its mask key.
    for (&u, c) in clients.iter_mut().filter(|(u, _)| **u != 6) {
        let f = server.forwarded_for(u).unwrap();
        seen.push(json(&f));
        let values = vec![0.01 * u as f32; d];
        let masked = if u == 1 {
            c.mask(&f, &values, 1, 0.0, &mut client_one).unwrap()
        } else {
            let m = c.mask(&f, &values, 1, 0.0, &mut rng).unwrap();
            seen.push(format!("{m:?}"));
            m
        };
        server.receive_masked(u, &masked).unwrap();
    }
    let list = server.close_collection().unwrap();
    seen.push(json(&list));
    for (&u, c) in clients.iter_mut().filter(|(u, _)| **u != 6) {
        let m = c.confirm(&list, &identities[&u]).unwrap();
        seen.push(json(&m));
        server.receive_confirmation(u, &m).unwrap();
    }
    server.close_confirm().unwrap();
    for (&u, c) in clients.iter_mut().filter(|(u, _)| **u != 6) {
        let r = c.unmask(&server.unmask_request_for(u).unwrap()).unwrap();
        seen.push(json(&r));
        server.receive_unmask(u, &r).unwrap();
    }
    (seen, server.finish().unwrap().sum)
}

/// Protects "the coordinator cannot remove a client's noise share": with the same keys,
/// masks and updates, two rounds in which client 1 draws a different noise share give the
/// coordinator byte-identical messages — the keys, the encrypted shares, the other
/// clients' masked vectors and every share revealed at unmasking, including the
/// reconstructed secrets of the dropped client — so nothing it holds besides client 1's
/// masked vector (uniform under the masks, see above) depends on the share. Yet the
/// unmasked sums differ by the share: by noise of twice a share's variance, not by
/// anything the coordinator could compute and subtract.
#[test]
fn no_message_to_the_coordinator_reveals_a_clients_noise_share() {
    let d = 4000;
    let (view_a, sum_a) = coordinator_view(17, 100, d);
    let (view_b, sum_b) = coordinator_view(17, 200, d);
    assert_eq!(
        view_a, view_b,
        "the coordinator's view apart from client 1's input"
    );
    let diff: Vec<u32> = sum_a
        .iter()
        .zip(&sum_b)
        .map(|(a, b)| a.wrapping_sub(*b))
        .collect();
    assert_eq!(&diff[d..], &[0, 0], "same count and loss words");
    let scale = noisy_config(6, d, 1.0)
        .validate()
        .unwrap()
        .distributed_noise()
        .unwrap()
        .clone();
    // Two independent shares (plus rounding of at most 1 each) differ with variance
    // 2 mu; 4000 draws give a relative standard error of 2.2%.
    let expected = 2.0 * scale.share_variance(d);
    let var = signed_variance(&diff[..d]);
    assert!(
        (var / expected - 1.0).abs() < 0.12,
        "variance {var:.4e}, expected {expected:.4e}"
    );
    // And the same noise seed gives the same sum: the difference is the share alone.
    assert_eq!(coordinator_view(17, 100, d).1, sum_a);
}

/// A coordinator checks each client message against a shared snapshot of the closed
/// stages (`check_*`) and records it in its database: the checks must refuse exactly
/// what `receive_*` refuses, and record nothing themselves.
#[test]
fn checks_refuse_what_receive_refuses_and_record_nothing() {
    let cfg = RoundConfig {
        consistency_check: true,
        ..config(6, 5, 4, 4)
    };
    let mut live = ServerSession::new(cfg.clone()).unwrap();
    let mut snapshot = ServerSession::new(cfg.clone()).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(11);
    let (mut clients, identities, keys) = join(&cfg, 1..=6, &mut rng);
    let id = |u: u32| identities[&u].public();
    // Bad keys: another client's, signed under another identity, a stranger's.
    for (from, bad, identity) in [
        (2, &keys[&1], id(1)),
        (1, &keys[&1], id(2)),
        (7, &keys[&1], id(1)),
    ] {
        let checked = snapshot.check_keys(from, bad, &identity).unwrap_err();
        assert_eq!(
            live.receive_keys(from, bad, &identity).unwrap_err(),
            checked
        );
    }
    for (&u, k) in &keys {
        snapshot.check_keys(u, k, &id(u)).unwrap();
        live.receive_keys(u, k, &id(u)).unwrap();
    }
    assert_eq!(snapshot.advertised().count(), 0, "a check records nothing");
    assert_eq!(
        live.check_keys(1, &keys[&1], &id(1)).unwrap_err(),
        SecAggError::Duplicate(1)
    );
    for (&u, k) in &keys {
        snapshot.restore_keys(u, k, &id(u)).unwrap();
    }
    let roster = live.close_advertise().unwrap();
    assert_eq!(snapshot.close_advertise().unwrap(), roster);
    let reveals: BTreeMap<u32, GraphReveal> = clients
        .iter_mut()
        .map(|(&u, c)| (u, c.reveal(&roster).unwrap()))
        .collect();
    // Bad nonces: another client's, a stranger's.
    for (from, bad) in [(1, &reveals[&2]), (9, &reveals[&1])] {
        let checked = snapshot.check_reveal(from, bad).unwrap_err();
        assert_eq!(live.receive_reveal(from, bad).unwrap_err(), checked);
    }
    for (&u, r) in &reveals {
        snapshot.check_reveal(u, r).unwrap();
        live.receive_reveal(u, r).unwrap();
    }
    assert_eq!(
        live.check_reveal(1, &reveals[&1]).unwrap_err(),
        SecAggError::Duplicate(1)
    );
    // The snapshot recorded no nonce: it cannot draw the graph.
    let mut unrevealed = ServerSession::new(cfg.clone()).unwrap();
    for (&u, k) in &keys {
        unrevealed.restore_keys(u, k, &id(u)).unwrap();
    }
    unrevealed.close_advertise().unwrap();
    for (&u, r) in &reveals {
        unrevealed.check_reveal(u, r).unwrap();
    }
    assert_eq!(
        unrevealed.close_reveal().unwrap_err(),
        SecAggError::MissingReveals((1..=6).collect())
    );
    for (&u, r) in &reveals {
        snapshot.receive_reveal(u, r).unwrap();
    }
    live.close_reveal().unwrap();
    snapshot.close_reveal().unwrap();
    let mut messages = BTreeMap::new();
    for (&u, c) in clients.iter_mut() {
        let directory = live.directory_for(u).unwrap();
        assert_eq!(snapshot.directory_for(u).unwrap(), directory);
        messages.insert(u, c.share_keys(&directory, &mut rng).unwrap());
    }
    // Bad messages: a share cut short, shares out of order, a stranger's message.
    let mut short = messages[&1].clone();
    short.shares[0].ciphertext.pop();
    let mut reordered = messages[&2].clone();
    reordered.shares.swap(0, 1);
    for (from, bad) in [(1, &short), (2, &reordered), (9, &messages[&3])] {
        let checked = snapshot.check_shares(from, bad).unwrap_err();
        assert_eq!(live.receive_shares(from, bad).unwrap_err(), checked);
    }
    for (&u, m) in &messages {
        snapshot.check_shares(u, m).unwrap();
        live.receive_shares(u, m).unwrap();
    }
    assert_eq!(snapshot.shared().count(), 0, "a check records nothing");
    assert_eq!(
        live.check_shares(1, &messages[&1]).unwrap_err(),
        SecAggError::Duplicate(1)
    );
    live.close_sharing().unwrap();
    for u in 1..=5 {
        let f = live.forwarded_for(u).unwrap();
        let masked = clients
            .get_mut(&u)
            .unwrap()
            .mask(&f, &[0.5; 4], 10, 0.1, &mut rng)
            .unwrap();
        live.receive_masked(u, &masked).unwrap();
    }
    let list = live.close_collection().unwrap();
    let confirmations: BTreeMap<u32, Confirmation> = (1..=5)
        .map(|u| {
            let c = clients.get_mut(&u).unwrap();
            (u, c.confirm(&list, &identities[&u]).unwrap())
        })
        .collect();
    // Bad signatures: another client's, a client that never uploaded.
    assert_eq!(
        live.check_confirmation(1, &confirmations[&2]).unwrap_err(),
        IdentityError::BadSignature(1).into()
    );
    assert_eq!(
        live.check_confirmation(6, &confirmations[&1]).unwrap_err(),
        SecAggError::NotInRound(6)
    );
    for (&u, c) in &confirmations {
        live.check_confirmation(u, c).unwrap();
        assert_eq!(
            live.confirmed().count(),
            (u - 1) as usize,
            "a check records nothing"
        );
        live.receive_confirmation(u, c).unwrap();
    }
    assert_eq!(
        live.check_confirmation(1, &confirmations[&1]).unwrap_err(),
        SecAggError::Duplicate(1)
    );
    live.close_confirm().unwrap();
    let replies: BTreeMap<u32, UnmaskShares> = (1..=5)
        .map(|u| {
            let request = live.unmask_request_for(u).unwrap();
            assert_eq!(
                request.signatures.len(),
                4,
                "its four neighbours that signed"
            );
            (u, clients.get_mut(&u).unwrap().unmask(&request).unwrap())
        })
        .collect();
    // Client 6 dropped before masking: its seed share is the wrong kind of share.
    let mut wrong_kind = replies[&1].clone();
    let six = wrong_kind.key_shares.remove(0);
    assert_eq!(six.owner, 6);
    wrong_kind.seed_shares.push(six);
    let checked = live.check_unmask(1, &wrong_kind).unwrap_err();
    assert!(matches!(checked, SecAggError::BadMessage(_)), "{checked:?}");
    assert_eq!(
        live.check_unmask(6, &replies[&2]).unwrap_err(),
        SecAggError::NotInRound(6)
    );
    for (&u, reply) in &replies {
        live.check_unmask(u, reply).unwrap();
        assert_eq!(
            live.unmasked().count(),
            (u - 1) as usize,
            "a check records nothing"
        );
        live.receive_unmask(u, reply).unwrap();
    }
    assert_eq!(
        live.check_unmask(1, &replies[&1]).unwrap_err(),
        SecAggError::Duplicate(1)
    );
    assert!(live.missing_secrets().is_empty());
}

/// Finding 12 of the security review: the self-mask seed, pair keys, Shamir coefficients
/// and revealed shares stayed in freed memory. The types that hold them now wipe
/// themselves when dropped (this does not compile where one of them does not).
#[test]
fn the_types_that_hold_secrets_wipe_them_when_dropped() {
    fn wiped_on_drop<T: zeroize::ZeroizeOnDrop>() {}
    wiped_on_drop::<super::shamir::Share>();
    wiped_on_drop::<super::crypto::KeyPair>();
    wiped_on_drop::<ClientSession>();
    // And a dropped share really is zero where it lay.
    let mut share =
        super::shamir::split(&[7; 32], 2, &[1, 2, 3], &mut ChaCha20Rng::seed_from_u64(1))
            .unwrap()
            .remove(0);
    assert_ne!(share.to_bytes()[4..], [0; 40]);
    zeroize::Zeroize::zeroize(&mut share);
    assert_eq!(share.to_bytes(), [0; super::shamir::SHARE_BYTES]);
}

/// Finding 10 of the security review: every client fetched the whole key directory,
/// `O(n)` keys each and `O(n^2)` bytes a round. A client's directory now holds the
/// member list and only its own and its neighbours' keys, and the round works with it.
#[test]
fn each_client_gets_only_its_neighbourhood_keys_and_the_round_unmasks() {
    let cfg = config(60, 8, 5, 3);
    let Round {
        mut server,
        mut clients,
        mut rng,
        ..
    } = advertise_and_reveal(&cfg, 21);
    let full = server.directory().unwrap();
    let full_bytes = serde_json::to_vec(&full).unwrap().len();
    let entry_bytes = serde_json::to_vec(&full.entries[0]).unwrap().len();
    for (&u, c) in clients.iter_mut() {
        let mine = server.directory_for(u).unwrap();
        assert_eq!(mine.members.len(), 60);
        assert_eq!(mine.reveals.len(), 60);
        assert_eq!(mine.entries.len(), 8 + 1, "its 8 neighbours and itself");
        // Each member beyond the neighbourhood costs its index and nonce (under 50
        // bytes of JSON), not its keys.
        let bytes = serde_json::to_vec(&mine).unwrap().len();
        assert!(bytes < 9 * (entry_bytes + 8) + 60 * 50, "{bytes}");
        assert!(bytes * 3 < full_bytes, "{bytes} of {full_bytes}");
        let m = c.share_keys(&mine, &mut rng).unwrap();
        server.receive_shares(u, &m).unwrap();
    }
    assert_eq!(server.directory_for(61), None);
    server.close_sharing().unwrap();
    for (&u, c) in clients.iter_mut() {
        let f = server.forwarded_for(u).unwrap();
        let m = c.mask(&f, &[0.25, -0.5, 1.0], 3, 0.0, &mut rng).unwrap();
        server.receive_masked(u, &m).unwrap();
    }
    server.close_collection().unwrap();
    for (&u, c) in clients.iter_mut() {
        let request = server.unmask_request_for(u).unwrap();
        server
            .receive_unmask(u, &c.unmask(&request).unwrap())
            .unwrap();
    }
    let out = server.finish().unwrap();
    for (got, want) in out.decoded.mean.iter().zip([0.25f32, -0.5, 1.0]) {
        assert!((f64::from(*got) - f64::from(want)).abs() <= out.decoded.error_bound);
    }
}

#[test]
fn a_survivor_list_without_signatures_is_the_bare_list() {
    let bare = UnmaskRequest {
        survivors: vec![1, 2, 4],
        signatures: vec![],
    };
    let json = serde_json::to_string(&bare).unwrap();
    assert_eq!(json, r#"{"survivors":[1,2,4]}"#);
    assert_eq!(serde_json::from_str::<UnmaskRequest>(&json).unwrap(), bare);
    let signed = UnmaskRequest {
        signatures: vec![SurvivorSignature {
            index: 2,
            signature: [1; 64],
        }],
        ..bare
    };
    let json = serde_json::to_value(&signed).unwrap();
    assert_eq!(json["signatures"][0]["index"], 2);
    assert_eq!(
        serde_json::from_value::<UnmaskRequest>(json).unwrap(),
        signed
    );
}

/// Settings written before the round context and the consistency check existed still
/// read, as the first attempt of nothing, without the check.
#[test]
fn round_settings_default_their_context_and_consistency_check() {
    let config = RoundConfig {
        session: [1; 32],
        context: RoundContext::default(),
        parties: 5,
        threshold: 3,
        neighbours: 4,
        dimension: 2,
        quantization: QuantizationParams::default(),
        consistency_check: false,
    };
    let mut json = serde_json::to_value(&config).unwrap();
    let object = json.as_object_mut().unwrap();
    object.remove("context");
    object.remove("consistency_check");
    assert_eq!(serde_json::from_value::<RoundConfig>(json).unwrap(), config);
    let checked = RoundConfig {
        context: RoundContext {
            experiment: "e".into(),
            round: 3,
            attempt: 2,
        },
        consistency_check: true,
        ..config.clone()
    };
    let json = serde_json::to_value(&checked).unwrap();
    assert_eq!(json["context"]["attempt"], 2);
    assert_eq!(
        serde_json::from_value::<RoundConfig>(json).unwrap(),
        checked
    );
}

/// Every signed statement names the round (session, experiment, round, attempt and
/// size), so that no signature carries over to another round or attempt.
#[test]
fn statements_bind_the_round_and_its_attempt() {
    let config = RoundConfig {
        session: [1; 32],
        context: RoundContext {
            experiment: "e".into(),
            round: 3,
            attempt: 1,
        },
        parties: 5,
        threshold: 3,
        neighbours: 4,
        dimension: 2,
        quantization: QuantizationParams::default(),
        consistency_check: true,
    };
    let keys = |c: &RoundConfig| c.advertise_statement(2, &[1; 32], &[2; 32], &[3; 32]);
    let list = |c: &RoundConfig| c.survivors_statement(&[1, 2, 3]);
    let mut others = Vec::new();
    for change in 0..5 {
        let mut other = config.clone();
        match change {
            0 => other.session[0] ^= 1,
            1 => other.context.experiment.push('x'),
            2 => other.context.round += 1,
            3 => other.context.attempt += 1,
            _ => other.parties += 1,
        }
        others.push(other);
    }
    for other in &others {
        assert_ne!(keys(other), keys(&config));
        assert_ne!(list(other), list(&config));
    }
    assert_ne!(
        config.advertise_statement(3, &[1; 32], &[2; 32], &[3; 32]),
        keys(&config)
    );
    assert_ne!(config.survivors_statement(&[1, 2]), list(&config));
}
