//! The coordinator killed with SIGKILL at every stage of a round, on PostgreSQL, with
//! plain and with secure (SecAgg+) rounds, and started again on the same database and
//! data directory each time.
//!
//! Each kill happens at a named crash point (`COHORT_FAULT_PAUSE`, see
//! `cohort_coordinator::fault`): the process stops right there (clients chosen but not
//! stored; keys or shares all in but the stage not moved on; an upload committed but not
//! answered; collection complete; shares revealed; an aggregation job claimed with its
//! lease held; the new model written but not published) and the test kills it. Real
//! `cohort edge` processes keep retrying through every outage.
//!
//! What it protects:
//! - every round completes and the experiment finishes;
//! - every upload an edge client saw acknowledged is an `uploaded` participation, and no
//!   contribution counts twice (each round's `reported` equals its distinct uploaders,
//!   and no client has two uploads in a round);
//! - with fixed seeds, the final model is byte for byte the model of the same experiment
//!   run without a single crash;
//! - with an adaptive server optimizer (FedAdam, FedYogi, FedAdagrad), whose moments are
//!   stored with each published model, the final model is also the one a single
//!   optimizer kept in memory makes from the same rounds' uploads: a restarted
//!   coordinator continued the moments rather than starting them afresh.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_aggregation::{WeightedMean, wire};
use cohort_coordinator::blobs::BlobStore;
use cohort_coordinator::blobs::object::ObjectBlobs;
use cohort_coordinator::demo::write_digits_partitions;
use cohort_coordinator::fault::FaultPoint;
use cohort_coordinator::store::{ParticipationState, RoundStage, Store};
use cohort_edge::model::{ModelKind, ModelSpec};
use cohort_edge::partition::PartitionScheme;
use common::{admin, free_port, wait_healthy};
use reqwest::Method;

const CLIENTS: usize = 4;
const ROUNDS: u32 = 4;

/// A `cohort serve` on PostgreSQL with dev TLS, its stderr in `log`, stopping at `pause`.
fn spawn_serve(
    data_dir: &Path,
    port: u16,
    url: &str,
    pause: Option<FaultPoint>,
    log: &Path,
    blobs: &Blobs,
) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
    if let Blobs::Bucket { env, url } = blobs {
        command
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .env("COHORT_BLOB_STORE", url);
    }
    command
        .args(["serve", "--dev-tls", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(data_dir)
        .arg("--database-url")
        .arg(url)
        // The kill at `job-claimed` leaves a lease behind: keep its wait short.
        .env("COHORT_JOB_LEASE_SECONDS", "3")
        .env("COHORT_ADMIN_TOKEN", common::ADMIN)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    if let Some(point) = pause {
        command.env("COHORT_FAULT_PAUSE", point.as_str());
    }
    command.spawn().expect("cohort serve starts")
}

/// Where a run keeps its blobs.
#[derive(Debug, Clone)]
enum Blobs {
    /// `DATA_DIR/blobs`.
    Dir,
    /// An object store at `url`, reached with `env`.
    Bucket {
        env: Vec<(&'static str, String)>,
        url: String,
    },
}

impl Blobs {
    /// The store as the coordinator sees it, for reading what it wrote.
    async fn open(&self, data_dir: &Path) -> BlobStore {
        match self {
            Blobs::Dir => BlobStore::open(&data_dir.join("blobs")).unwrap(),
            Blobs::Bucket { env, url } => {
                let vars: Vec<(String, String)> = env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect();
                let url = url.clone();
                let runtime = tokio::runtime::Handle::current();
                tokio::task::spawn_blocking(move || {
                    ObjectBlobs::open_with(&url, vars, runtime).map(BlobStore::Object)
                })
                .await
                .unwrap()
                .unwrap()
            }
        }
    }
}

/// Kills every child left when the test ends, passing or not.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `(experiment, round, attempt)` of every upload an edge client's log says was
/// acknowledged (plain) or stored (a masked input).
fn acknowledged(log: &str) -> Vec<(String, i64, i64)> {
    log.lines()
        .filter_map(|l| {
            l.strip_prefix("cohort-edge: acknowledged ")
                .or_else(|| l.strip_prefix("cohort-edge: secagg uploaded masked input "))
        })
        .map(|rest| {
            let field = |name: &str| {
                rest.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(name))
                    .unwrap()
                    .to_string()
            };
            (
                field("experiment="),
                field("round=").parse().unwrap(),
                field("attempt=").parse().unwrap(),
            )
        })
        .collect()
}

/// What one run of the experiment left: the final model's bytes, the number of
/// acknowledged uploads checked, the crash points actually reached, and (plain rounds)
/// the final model replayed from the published rounds' uploads by one optimizer that
/// lived through the whole run in memory.
struct RunOutcome {
    model: Vec<u8>,
    checked: usize,
    reached: Vec<FaultPoint>,
    replayed: Option<Vec<f32>>,
}

/// Runs the experiment on its own schema and data directory, killing the coordinator
/// once at each of `points` in turn; `secure` chooses SecAgg+ rounds, `strategy` the
/// server's strategy.
async fn run(
    work: &Path,
    csvs: &[PathBuf],
    secure: bool,
    strategy: &str,
    points: &[FaultPoint],
    blobs: &Blobs,
) -> Option<RunOutcome> {
    let (pg, schema, url) = common::postgres_schema("cohort_crash").await?;
    std::fs::create_dir_all(work).unwrap();
    let data_dir = work.join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut children = Children(Vec::new());
    let log = |n: usize| work.join(format!("serve-{n}.log"));
    children
        .0
        .push(spawn_serve(&data_dir, port, &url, None, &log(0), blobs));
    let http = wait_healthy(&base, &ca).await;

    let mut spec = serde_json::json!({
        "name": "crash", "features": 64, "classes": 10, "model": "logreg",
        "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": CLIENTS,
        "collect_deadline_seconds": 120, "seed": 11, "strategy": strategy
    });
    if secure {
        spec["secure_aggregation"] = serde_json::json!({
            "advertise_seconds": 120, "share_seconds": 120, "unmask_seconds": 120
        });
    }
    let exp = admin(&http, &base, Method::POST, "/experiments", Some(spec)).await;
    let id = exp["id"].as_str().unwrap().to_string();
    let mut edge_logs = Vec::new();
    for (site, csv) in csvs.iter().enumerate() {
        let token = common::issue_token(&http, &base, &format!("site-{site}")).await;
        let log = work.join(format!("edge-{site}.log"));
        let child = common::edge_command(site, &base, &ca, csv, work, &token, 60)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("cohort edge starts");
        children.0.push(child);
        edge_logs.push(log);
    }
    common::wait_checked_in(&http, &base, CLIENTS, Duration::from_secs(60)).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;

    // Each crash point armed in a fresh process, which is killed where it stops.
    let mut reached = Vec::new();
    for (n, point) in points.iter().enumerate() {
        let server = &mut children.0[0];
        server.kill().unwrap(); // SIGKILL on Unix
        server.wait().unwrap();
        let log = log(n + 1);
        children.0[0] = spawn_serve(&data_dir, port, &url, Some(*point), &log, blobs);
        let started = Instant::now();
        let line = format!("cohort: fault point {} reached", point.as_str());
        loop {
            if std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains(&line)
            {
                reached.push(*point);
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(90),
                "the coordinator never reached {}: {}",
                point.as_str(),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let server = &mut children.0[0];
    server.kill().unwrap();
    server.wait().unwrap();
    children.0[0] = spawn_serve(&data_dir, port, &url, None, &log(points.len() + 1), blobs);
    let http = wait_healthy(&base, &ca).await;
    common::wait_finished(&http, &base, &id, Duration::from_secs(240)).await;

    let rounds = common::rounds(&http, &base, &id).await;
    let published: HashSet<i64> = rounds
        .iter()
        .filter(|r| r["stage"] == "published")
        .map(|r| r["round"].as_i64().unwrap())
        .collect();
    assert_eq!(
        published.len(),
        ROUNDS as usize,
        "every round completed: {rounds:?}"
    );
    let model = http
        .get(format!("{base}/api/v1/admin/experiments/{id}/model"))
        .bearer_auth(common::ADMIN)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();

    // The acknowledged uploads and the counts, read from the database itself.
    let store = Store::connect(&url, &data_dir).await.unwrap();
    let exp_id = uuid::Uuid::parse_str(&id).unwrap();
    for round in store.rounds(exp_id).await.unwrap() {
        let parts = store
            .participations(exp_id, round.round, round.attempt)
            .await
            .unwrap();
        let uploaders: HashSet<uuid::Uuid> = parts
            .iter()
            .filter(|p| p.state == ParticipationState::Uploaded)
            .map(|p| p.client_id)
            .collect();
        let uploads = store
            .uploads(exp_id, round.round, round.attempt)
            .await
            .unwrap();
        let distinct: HashSet<uuid::Uuid> = uploads.iter().map(|u| u.client_id).collect();
        assert_eq!(
            distinct.len(),
            uploads.len(),
            "round {} attempt {}: a client's upload stored twice",
            round.round,
            round.attempt
        );
        if round.stage == RoundStage::Published {
            assert_eq!(
                round.reported as usize,
                uploaders.len(),
                "round {}: reported counts each uploader once",
                round.round
            );
            assert_eq!(uploads.len(), uploaders.len());
            assert_eq!(
                uploaders.len(),
                CLIENTS,
                "round {}: every client in the model",
                round.round
            );
        }
    }
    let replayed = if secure {
        None
    } else {
        let store_of_blobs = blobs.open(&data_dir).await;
        Some(replay(&store, &store_of_blobs, exp_id, strategy).await)
    };
    let clients = store.clients().await.unwrap();
    let mut checked = 0;
    for (site, log) in edge_logs.iter().enumerate() {
        let text = std::fs::read_to_string(log).unwrap();
        let client = clients
            .iter()
            .find(|c| c.label == format!("site-{site}"))
            .unwrap()
            .id;
        for (exp, round, attempt) in acknowledged(&text) {
            assert_eq!(exp, id);
            let parts = store.participations(exp_id, round, attempt).await.unwrap();
            let mine = parts
                .iter()
                .find(|p| p.client_id == client)
                .expect("an acknowledged upload has its participation");
            assert_eq!(
                mine.state,
                ParticipationState::Uploaded,
                "site-{site} round {round} attempt {attempt}: acknowledged, then lost"
            );
            checked += 1;
        }
    }
    drop(children);
    store.close().await;
    common::drop_schema(&pg, &schema).await;
    Some(RunOutcome {
        model,
        checked,
        reached,
        replayed,
    })
}

/// The final model of a plain experiment rebuilt from its published rounds' uploads in
/// the store: each round's weighted mean (folded in the driver's order) stepped by one
/// server optimizer kept in memory from the first round to the last, as `simulate`
/// keeps it.
async fn replay(store: &Store, blobs: &BlobStore, exp: uuid::Uuid, strategy: &str) -> Vec<f32> {
    let strategy: cohort_aggregation::Strategy = strategy.parse().unwrap();
    let spec = ModelSpec::new(&ModelKind::LogReg, 64, 10).unwrap();
    let layout = spec.layout().clone();
    // The store's interface blocks: off the async worker for the read.
    let read = |path: &str| {
        let bytes = tokio::task::block_in_place(|| blobs.get(path)).unwrap();
        wire::decode(&layout, &bytes).unwrap()
    };
    let mut global = read(&format!("models/{exp}/round-0.bin"));
    let mut optimizer = strategy.server_optimizer(None).unwrap();
    let mut rounds: Vec<_> = store
        .rounds(exp)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.stage == RoundStage::Published)
        .collect();
    rounds.sort_by_key(|r| r.round);
    for round in rounds {
        let mut uploads = store
            .uploads(exp, round.round, round.attempt)
            .await
            .unwrap();
        uploads.sort_by(|a, b| a.sha256.cmp(&b.sha256).then(a.id.cmp(&b.id)));
        let updates: Vec<_> = uploads
            .iter()
            .map(|u| (read(&u.blob_path), u.num_samples.min(1000) as f64))
            .collect();
        let mut mean = WeightedMean::new(layout.clone());
        let pairs: Vec<_> = updates.iter().map(|(u, w)| (u, *w)).collect();
        mean.fold_batch(&pairs).unwrap();
        optimizer
            .step(&mut global, &mean.finish().unwrap())
            .unwrap();
    }
    global.into_values()
}

async fn crash_at_every_stage(secure: bool, points: &[FaultPoint]) {
    crash_at_every_stage_with("fedavg", secure, points, &Blobs::Dir).await;
}

async fn crash_at_every_stage_with(
    strategy: &str,
    secure: bool,
    points: &[FaultPoint],
    blobs: &Blobs,
) {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let (csvs, _) = write_digits_partitions(
        &dir.path().join("sites"),
        CLIENTS,
        &PartitionScheme::Dirichlet { alpha: 1.0 },
        0,
    )
    .unwrap();
    let Some(reference) = run(
        &dir.path().join("reference"),
        &csvs,
        secure,
        strategy,
        &[],
        &Blobs::Dir,
    )
    .await
    else {
        return;
    };
    let crashed = run(
        &dir.path().join("crashed"),
        &csvs,
        secure,
        strategy,
        points,
        blobs,
    )
    .await
    .expect("PostgreSQL is still configured");
    if let Blobs::Bucket { .. } = blobs {
        assert!(
            !dir.path().join("crashed/coordinator/blobs").exists(),
            "no blob directory beside the bucket"
        );
    }
    assert_eq!(crashed.reached, points, "every crash point was reached");
    assert!(
        crashed.checked >= (ROUNDS as usize) * CLIENTS,
        "only {} acknowledged uploads",
        crashed.checked
    );
    assert_eq!(reference.model.len(), crashed.model.len());
    let differing = reference
        .model
        .iter()
        .zip(&crashed.model)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(
        differing,
        0,
        "the final model after {} crashes differs from the uninterrupted run's in {differing} bytes",
        points.len()
    );
    if let Some(replayed) = &crashed.replayed {
        let served = wire::decode(
            ModelSpec::new(&ModelKind::LogReg, 64, 10).unwrap().layout(),
            &crashed.model,
        )
        .unwrap();
        let worst = served
            .values()
            .iter()
            .zip(replayed)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-6,
            "{strategy}: the served model is {worst} away from one optimizer's replay of the same rounds"
        );
    }
    eprintln!(
        "{strategy}, {} rounds, {} crashes at {:?}: {} acknowledged uploads all recorded, final model \
         identical to the uninterrupted run ({} bytes)",
        if secure { "secure" } else { "plain" },
        points.len(),
        points.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
        crashed.checked,
        crashed.model.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_rounds_survive_a_crash_at_every_stage() {
    crash_at_every_stage(
        false,
        &[
            FaultPoint::Selection,
            FaultPoint::UploadStored,
            FaultPoint::Collected,
            FaultPoint::JobClaimed,
            FaultPoint::Publishing,
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secure_rounds_survive_a_crash_at_every_stage() {
    crash_at_every_stage(true, &FaultPoint::ALL).await;
}

/// The adaptive server optimizers through the crash points where their state matters
/// most: a job claimed and killed (run again by the next coordinator, from the state
/// stored with the last published model) and a model and state written but not
/// published (written again, to the same bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adaptive_optimizers_continue_their_moments_across_crashes() {
    for strategy in ["fedadam", "fedyogi", "fedadagrad"] {
        crash_at_every_stage_with(
            strategy,
            false,
            &[
                FaultPoint::Collected,
                FaultPoint::JobClaimed,
                FaultPoint::Publishing,
            ],
            &Blobs::Dir,
        )
        .await;
    }
}

/// The same crashes with every upload and model in an S3 bucket (moto's server) and no
/// blob directory: acknowledged uploads survive, and the final model is the
/// uninterrupted run's (kept on disk) byte for byte, and one optimizer's replay of the
/// uploads read back from the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_rounds_survive_a_crash_at_every_stage_with_blobs_in_a_bucket() {
    let Some(s3) = common::S3::with_bucket("crash").await else {
        return;
    };
    let blobs = Blobs::Bucket {
        env: s3.env(),
        url: "s3://crash/stages".into(),
    };
    crash_at_every_stage_with(
        "fedavg",
        false,
        &[
            FaultPoint::Selection,
            FaultPoint::UploadStored,
            FaultPoint::Collected,
            FaultPoint::JobClaimed,
            FaultPoint::Publishing,
        ],
        &blobs,
    )
    .await;
}

/// Secure rounds crashed at every stage with every blob (masked inputs, models) in the
/// bucket: the final model is the uninterrupted run's byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secure_rounds_survive_a_crash_at_every_stage_with_blobs_in_a_bucket() {
    let Some(s3) = common::S3::with_bucket("crash").await else {
        return;
    };
    let blobs = Blobs::Bucket {
        env: s3.env(),
        url: "s3://crash/secure".into(),
    };
    crash_at_every_stage_with("fedavg", true, &FaultPoint::ALL, &blobs).await;
}
