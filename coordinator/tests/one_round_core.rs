//! One round core, two drivers. Random event sequences (uploads, failed trainers, late
//! uploads, silent clients past their deadline, revocations, and coordinators killed at
//! random moments of a driver step, then restarted) are run through `simulate`'s in-memory
//! driver (`RoundEngine`) and through `serve`'s driver over the SQLite store. Both ask the
//! core for the same rules (the cohort, when collection closes, the quorum, what follows
//! a failed attempt), so both must reach the same attempts with the same outcomes, and
//! publish the same model, byte for byte.
//!
//! This protects the claim that `serve` and `simulate` are one system: a rule changed on
//! one side only, or a state lost in a restart, shows up here as a different outcome or
//! a different model.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use cohort_aggregation::{Finite, ModelVector, Strategy, wire};
use cohort_coordinator::blobs::BlobStore;
use cohort_coordinator::engine::{ClientId, ClientUpdate, EngineConfig, EngineError, RoundEngine};
use cohort_coordinator::server::AppState;
use cohort_coordinator::server::auth::AdminToken;
use cohort_coordinator::server::driver::model::ExperimentModel;
use cohort_coordinator::server::driver::{experiment_model, tick_at};
use cohort_coordinator::server::settings::{Secret, ServeFlags, ServeSettings};
use cohort_coordinator::store::{
    ExperimentState, NewUpload, RoundStage, Store, StoreError, TaskFailure,
};
use cohort_core::round::{UploadRefusal, selection_seed};
use cohort_edge::train::TrainConfig;
use proptest::prelude::*;
use proptest::strategy::Strategy as _;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uuid::Uuid;

/// What a selected client does in the attempt it was selected for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Act {
    /// Uploads its update, trained on this many samples.
    Upload(u16),
    /// Reports that its trainer failed.
    Fail,
    /// Uploads only after the deadline (refused as late).
    Late,
    /// Never answers.
    Silent,
    /// Is revoked by an admin while the attempt collects.
    Revoked,
}

fn act() -> impl proptest::strategy::Strategy<Value = Act> {
    prop_oneof![
        6 => (1u16..500).prop_map(Act::Upload),
        1 => Just(Act::Fail),
        1 => Just(Act::Late),
        1 => Just(Act::Silent),
        1 => Just(Act::Revoked),
    ]
}

/// One generated experiment and the events it meets.
#[derive(Debug, Clone)]
struct Case {
    clients: usize,
    clients_per_round: usize,
    min_participants: usize,
    max_round_attempts: u32,
    rounds: u32,
    adaptive: bool,
    selection_seed: u64,
    /// Taken in turn by every selected client of every attempt, in the order both
    /// drivers see them (attempt by attempt, clients in id order).
    acts: Vec<Act>,
    /// Read at every step of `serve`'s run: `Some(us)` kills the coordinator that many
    /// microseconds into the step (mid-transaction, mid-aggregation, holding a job's
    /// lease, or after the step finished) and starts another on the same files.
    crashes: Vec<Option<u16>>,
}

fn case() -> impl proptest::strategy::Strategy<Value = Case> {
    (3usize..=6, 1u32..=3, 1u32..=3, any::<bool>(), any::<u64>()).prop_flat_map(
        |(clients, max_round_attempts, rounds, adaptive, seed)| {
            (1..=clients).prop_flat_map(move |k| {
                (
                    1..=k,
                    prop::collection::vec(act(), 64),
                    prop::collection::vec(prop::option::weighted(0.2, 0u16..3_000), 64),
                )
                    .prop_map(move |(quorum, acts, crashes)| Case {
                        clients,
                        clients_per_round: k,
                        min_participants: quorum,
                        max_round_attempts,
                        rounds,
                        adaptive,
                        selection_seed: seed,
                        acts,
                        crashes,
                    })
            })
        },
    )
}

/// What one attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Attempt {
    round: i64,
    attempt: i64,
    published: bool,
    /// The cohort, as client numbers (their rank among the enrolled ids).
    cohort: Vec<usize>,
    selected: usize,
    participants: usize,
    dropped: usize,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Every round published or the experiment finished.
    Finished,
    /// A round failed its last attempt.
    Failed,
    /// Too few clients are left to open the next attempt: it waits.
    Waiting,
}

/// Everything a run is compared on.
#[derive(Debug, PartialEq)]
struct Run {
    attempts: Vec<Attempt>,
    end: End,
    /// The published model's wire bytes.
    model: Vec<u8>,
}

const DEADLINE_SECONDS: u64 = 30;
const LEASE_SECONDS: u64 = 5;

fn spec(case: &Case) -> serde_json::Value {
    serde_json::json!({
        "name": "one core",
        "model": "logreg",
        "features": 3,
        "classes": 2,
        "seed": 11,
        "strategy": if case.adaptive { "fedadam" } else { "fedavg" },
        "rounds": case.rounds,
        "clients_per_round": case.clients_per_round,
        "min_participants": case.min_participants,
        "max_round_attempts": case.max_round_attempts,
        "collect_deadline_seconds": DEADLINE_SECONDS,
    })
}

/// A client's update in an attempt: the same values on both sides, different for every
/// client, round and attempt.
fn update(len: usize, client: usize, round: i64, attempt: i64) -> Vec<f32> {
    let seed = (client as u64) << 32 | (round as u64) << 16 | attempt as u64;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn sha256(bytes: &[u8]) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .to_vec()
}

/// The acts, taken in turn.
struct Script<'a> {
    acts: &'a [Act],
    next: usize,
}

impl Script<'_> {
    fn take(&mut self) -> Act {
        let act = self.acts[self.next % self.acts.len()];
        self.next += 1;
        act
    }
}

/// `simulate`'s driver: the engine in memory, asking the core for the cohort and, as
/// `serve` does, running a failed round again up to its attempts.
fn in_memory(
    case: &Case,
    initial: ModelVector,
    policy: cohort_core::round::FailedAttemptPolicy,
) -> Run {
    let strategy = if case.adaptive {
        Strategy::FedAdam
    } else {
        Strategy::FedAvg
    };
    let len = initial.len();
    let mut engine = RoundEngine::new(
        initial,
        EngineConfig {
            clients_per_round: case.clients_per_round,
            min_participants: case.min_participants,
            train: TrainConfig::default(),
            strategy,
            server_lr: None,
            failed_attempts: policy,
        },
    )
    .expect("the case's settings are valid");
    let mut available: BTreeSet<ClientId> = (0..case.clients as u64).map(ClientId).collect();
    let mut script = Script {
        acts: &case.acts,
        next: 0,
    };
    let mut attempts = Vec::new();
    let end = loop {
        if engine.experiment_failed() {
            break End::Failed;
        }
        if engine.rounds_closed() >= case.rounds {
            break End::Finished;
        }
        let round = i64::from(engine.rounds_closed() + 1);
        let attempt = i64::from(engine.attempt());
        let mut rng =
            ChaCha8Rng::seed_from_u64(selection_seed(case.selection_seed, round, attempt));
        let pool: Vec<ClientId> = available.iter().copied().collect();
        let plan = match engine.open_round(&pool, &mut rng) {
            Ok(plan) => plan,
            Err(EngineError::NotEnoughClients { .. }) => break End::Waiting,
            Err(e) => panic!("the engine refused to open: {e}"),
        };
        let mut uploads = Vec::new();
        for &client in &plan.selected {
            match script.take() {
                Act::Upload(samples) => {
                    let values = update(len, client.0 as usize, round, attempt);
                    let bytes = wire::encode(&ModelVector::from_flat(values.clone()));
                    uploads.push((sha256(&bytes), client, values, u64::from(samples)));
                }
                Act::Revoked => {
                    available.remove(&client);
                }
                Act::Fail | Act::Late | Act::Silent => {}
            }
        }
        // `serve` folds a round's uploads in the order of their contents' hashes.
        uploads.sort_by(|a, b| a.0.cmp(&b.0));
        let batch: Vec<(ClientId, ClientUpdate<'_>)> = uploads
            .iter()
            .map(|(_, client, values, samples)| {
                (
                    *client,
                    ClientUpdate {
                        params: Finite::check(values).expect("updates are finite"),
                        num_samples: *samples,
                        train_loss: 1.0,
                    },
                )
            })
            .collect();
        if !batch.is_empty() {
            engine
                .submit_batch(&batch)
                .expect("the engine takes the uploads");
        }
        let outcome = engine.close_round().expect("a round is open");
        attempts.push(Attempt {
            round,
            attempt,
            published: outcome.status.published(),
            cohort: plan.selected.iter().map(|c| c.0 as usize).collect(),
            selected: outcome.selected,
            participants: outcome.participants,
            dropped: outcome.dropped,
        });
    };
    Run {
        attempts,
        end,
        model: wire::encode(engine.global()),
    }
}

/// A coordinator over the case's data directory, as `cohort serve` builds it.
async fn coordinator(dir: &Path, seed: u64) -> AppState {
    let settings = ServeSettings::from_sources(
        None,
        &HashMap::new(),
        ServeFlags {
            data_dir: Some(dir.to_path_buf()),
            insecure_http: true,
            selection_seed: Some(seed),
            job_lease_seconds: Some(LEASE_SECONDS),
            ..ServeFlags::default()
        },
    )
    .expect("settings are valid");
    let store = Store::connect("sqlite://store/cohort.db", dir)
        .await
        .expect("the store opens");
    let blobs = BlobStore::open(&dir.join("blobs")).expect("the blob directory opens");
    AppState::new(
        settings,
        AdminToken::from_secret(&Secret::new("x".repeat(40))),
        store,
        blobs,
        cohort_aggregation::reduce::cpu(),
    )
}

/// Creates the experiment of `spec` (named by its `name`) and starts it.
async fn running(
    state: &AppState,
    spec: &serde_json::Value,
) -> cohort_coordinator::store::Experiment {
    let name = spec["name"].as_str().expect("the spec has a name");
    let exp = state.store.create_experiment(name, spec).await.unwrap();
    state
        .store
        .set_experiment_state(exp.id, ExperimentState::Running, "admin")
        .await
        .unwrap();
    exp
}

/// Enrols `n` clients at `now`; their ids, in enrolment order.
async fn enrolled(state: &AppState, n: usize, now: i64) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for i in 0..n {
        let token = format!("token {i}");
        state
            .store
            .create_enrolment_token(token.as_bytes(), "site", None)
            .await
            .unwrap();
        let client = state
            .store
            .enrol(token.as_bytes(), b"secret", now)
            .await
            .unwrap();
        ids.push(client.id);
    }
    ids
}

/// `serve`'s driver over SQLite, its clock stepped by the test: the events reach the
/// store as the upload and failure routes deliver them.
async fn served(case: &Case) -> (Run, ModelVector, cohort_core::round::FailedAttemptPolicy) {
    let dir = tempfile::tempdir().unwrap();
    let mut state = coordinator(dir.path(), case.selection_seed).await;
    let mut now = cohort_coordinator::store::now_millis();
    // Enrolled clients, in id order: client i of the in-memory run is the i-th.
    let mut ids = enrolled(&state, case.clients, now).await;
    ids.sort();
    let rank: BTreeMap<Uuid, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let exp = running(&state, &spec(case)).await;
    let (spec, model) = experiment_model(&state.store.experiment(exp.id).await.unwrap()).unwrap();
    let ExperimentModel::BuiltIn(built_in) = &model else {
        panic!("logreg is built in");
    };
    let initial = built_in.init(spec.seed);
    let layout = model.layout().clone();
    let mut revoked = BTreeSet::new();
    let mut script = Script {
        acts: &case.acts,
        next: 0,
    };
    let mut scripted = BTreeSet::new();
    let mut crashes = case.crashes.iter().cycle();
    let mut incarnation = 0;
    let mut last = None;
    for _ in 0..300 {
        now += 1_000;
        for id in &ids {
            if !revoked.contains(id) {
                state.store.touch_client(*id, now).await.unwrap();
            }
        }
        let worker = format!("coordinator-{incarnation}");
        match crashes.next().unwrap() {
            None => tick_at(&state, &worker, now).await.unwrap(),
            Some(after_us) => {
                // Killed part-way: what it committed stays, the rest is rolled back, a
                // job it claimed stays leased to it until the lease runs out.
                let dying = state.clone();
                let step = tokio::spawn(async move { tick_at(&dying, &worker, now).await });
                tokio::time::sleep(std::time::Duration::from_micros(u64::from(*after_us))).await;
                step.abort();
                let _ = step.await;
                state.store.close().await;
                incarnation += 1;
                state = coordinator(dir.path(), case.selection_seed).await;
                continue;
            }
        }
        let exp_now = state.store.experiment(exp.id).await.unwrap();
        if exp_now.state != ExperimentState::Running {
            break;
        }
        let Some(round) = state.store.latest_round(exp.id).await.unwrap() else {
            continue;
        };
        let key = (round.round, round.attempt);
        match round.stage {
            RoundStage::Collecting if scripted.insert(key) => {
                let mut parts = state
                    .store
                    .participations(exp.id, round.round, round.attempt)
                    .await
                    .unwrap();
                parts.sort_by_key(|p| p.client_id);
                let mut late = Vec::new();
                let mut wait = false;
                for p in &parts {
                    let client = rank[&p.client_id];
                    match script.take() {
                        Act::Upload(samples) => {
                            let values = update(layout.len(), client, round.round, round.attempt);
                            let bytes =
                                wire::encode(&ModelVector::new(layout.clone(), values).unwrap());
                            upload(&state, exp.id, &round, p.client_id, &bytes, samples, now)
                                .await
                                .expect("an upload in time is taken");
                        }
                        Act::Fail => state
                            .store
                            .record_task_failure(
                                exp.id,
                                &TaskFailure {
                                    round: round.round,
                                    attempt: round.attempt,
                                    client_id: p.client_id,
                                    reason: "out of memory".into(),
                                    at: now,
                                },
                            )
                            .await
                            .unwrap(),
                        Act::Revoked => {
                            state.store.revoke_client(p.client_id).await.unwrap();
                            revoked.insert(p.client_id);
                        }
                        Act::Late => {
                            late.push(p.client_id);
                            wait = true;
                        }
                        Act::Silent => wait = true,
                    }
                }
                if wait {
                    let deadline = round.stage_deadline.expect("a plain round has a deadline");
                    now = deadline + 1;
                    for client in late {
                        let values =
                            update(layout.len(), rank[&client], round.round, round.attempt);
                        let bytes =
                            wire::encode(&ModelVector::new(layout.clone(), values).unwrap());
                        let refused = upload(&state, exp.id, &round, client, &bytes, 10, now).await;
                        assert!(
                            matches!(
                                refused,
                                Err(StoreError::Refused(UploadRefusal::DeadlinePassed { .. }))
                            ),
                            "a late upload is refused as late: {refused:?}"
                        );
                    }
                }
            }
            // Nothing moved in a whole step: the next attempt is waiting for clients.
            RoundStage::Published | RoundStage::Failed if last == Some((key, round.stage)) => {
                break;
            }
            _ => {}
        }
        last = Some((key, round.stage));
    }
    let exp_now = state.store.experiment(exp.id).await.unwrap();
    let end = match exp_now.state {
        ExperimentState::Finished => End::Finished,
        ExperimentState::Failed => End::Failed,
        ExperimentState::Running => End::Waiting,
        other => panic!("the experiment ended {other:?}"),
    };
    let mut attempts = Vec::new();
    for r in state.store.rounds(exp.id).await.unwrap() {
        let mut cohort: Vec<usize> = state
            .store
            .participations(exp.id, r.round, r.attempt)
            .await
            .unwrap()
            .iter()
            .map(|p| rank[&p.client_id])
            .collect();
        cohort.sort_unstable();
        assert!(
            matches!(r.stage, RoundStage::Published | RoundStage::Failed),
            "attempt {}/{} ended {}",
            r.round,
            r.attempt,
            r.stage
        );
        attempts.push(Attempt {
            round: r.round,
            attempt: r.attempt,
            published: r.stage == RoundStage::Published,
            cohort,
            selected: r.selected as usize,
            participants: r.reported as usize,
            dropped: r.dropped as usize,
        });
    }
    let latest = state.store.latest_model(exp.id).await.unwrap().unwrap();
    let model_bytes = state.blobs.get(&latest.blob_path).unwrap();
    state.store.close().await;
    let policy = spec.failed_attempt_policy();
    (
        Run {
            attempts,
            end,
            model: model_bytes,
        },
        initial,
        policy,
    )
}

/// An upload as the route stores it: the blob first, then the row, under the round's rules.
async fn upload(
    state: &AppState,
    experiment: Uuid,
    round: &cohort_coordinator::store::Round,
    client: Uuid,
    bytes: &[u8],
    samples: u16,
    now: i64,
) -> Result<(), StoreError> {
    let path = format!(
        "uploads/{experiment}/{}-{}/{client}-{}.bin",
        round.round,
        round.attempt,
        Uuid::new_v4().simple()
    );
    let info = state.blobs.put(&path, bytes).unwrap();
    state
        .store
        .record_upload(
            experiment,
            round.round,
            round.attempt,
            &NewUpload {
                client_id: client,
                blob_path: &path,
                bytes: bytes.len() as i64,
                sha256: &info.sha256,
                num_samples: i64::from(samples),
                claimed_samples: None,
                train_loss: Some(1.0),
                client_upload_id: None,
                wire_bytes: None,
            },
            now,
        )
        .await
        .map(|_| ())
}

/// Runs `case` through `serve`'s driver on a runtime of its own.
fn serve_case(case: &Case) -> (Run, ModelVector, cohort_core::round::FailedAttemptPolicy) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(served(case))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Both drivers, one event sequence: the same attempts with the same outcomes, the
    /// same end and the same model bytes.
    #[test]
    fn serve_and_the_in_memory_driver_reach_the_same_rounds_and_model(case in case()) {
        let (served, initial, policy) = serve_case(&case);
        let simulated = in_memory(&case, initial, policy);
        prop_assert_eq!(&served.attempts, &simulated.attempts);
        prop_assert_eq!(served.end, simulated.end);
        prop_assert!(served.model == simulated.model, "the published models differ");
    }
}

/// The property above must not pass by running nothing: a plain case publishes every
/// round on both sides.
#[test]
fn a_case_where_everyone_uploads_publishes_every_round_on_both_sides() {
    let case = Case {
        clients: 4,
        clients_per_round: 3,
        min_participants: 2,
        max_round_attempts: 2,
        rounds: 3,
        adaptive: true,
        selection_seed: 5,
        acts: vec![Act::Upload(20), Act::Upload(30), Act::Silent],
        crashes: vec![None, Some(0), None, None, Some(2_000)],
    };
    let (served, initial, policy) = serve_case(&case);
    let simulated = in_memory(&case, initial.clone(), policy);
    assert_eq!(served.end, End::Finished);
    assert_eq!(served.attempts.len(), 3);
    assert!(
        served
            .attempts
            .iter()
            .all(|a| a.published && a.participants == 2)
    );
    assert_ne!(served.model, wire::encode(&initial), "the model moved");
    assert_eq!(served, simulated);
}

/// Only clients waiting for work are selected: one in a check-in now is, one last seen
/// longer ago than the availability window (and gone since) is not, so a round never
/// waits until its deadline for a client that is not there.
#[tokio::test]
async fn clients_seen_longer_ago_than_the_window_are_not_selected() {
    use cohort_coordinator::server::driver::AVAILABILITY_WINDOW_MS;
    let dir = tempfile::tempdir().unwrap();
    let state = coordinator(dir.path(), 5).await;
    let now = cohort_coordinator::store::now_millis();
    let ids = enrolled(&state, 3, now).await;
    let (waiting, gone, long_gone) = (ids[0], ids[1], ids[2]);
    state.store.touch_client(waiting, now).await.unwrap();
    state
        .store
        .touch_client(gone, now - AVAILABILITY_WINDOW_MS - 1_000)
        .await
        .unwrap();
    state
        .store
        .touch_client(long_gone, now - 59_000)
        .await
        .unwrap();
    // Up to three wanted, one needed: every available client is selected.
    let exp = running(
        &state,
        &serde_json::json!({
            "name": "availability", "model": "logreg", "features": 3, "classes": 2,
            "rounds": 1, "clients_per_round": 1, "min_participants": 1,
            "over_selection": 3.0, "collect_deadline_seconds": DEADLINE_SECONDS,
        }),
    )
    .await;
    tick_at(&state, "coordinator", now).await.unwrap();
    let round = state
        .store
        .latest_round(exp.id)
        .await
        .unwrap()
        .expect("a round opened");
    let selected: Vec<Uuid> = state
        .store
        .participations(exp.id, round.round, round.attempt)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.client_id)
        .collect();
    assert_eq!(selected, vec![waiting]);
}
