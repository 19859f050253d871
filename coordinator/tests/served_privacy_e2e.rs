//! Differential privacy and robust rules in `cohort serve`, end to end: the real server
//! over TLS and real `cohort edge` processes on Dirichlet(0.5) partitions of digits.
//!
//! What it protects:
//! - central noise: the published model of round 1 is the initial model plus the sum of
//!   the L2-clipped updates (recomputed here from the same data and seeds) over the fixed
//!   denominator, plus noise whose standard deviation on the sum is `z * clip`; epsilon
//!   per round is the accountant's; the round that would pass the budget never opens
//!   and the experiment finishes, saying so; no un-noised training loss is published;
//! - distributed noise under secure aggregation: the clients' Skellam shares sum to the
//!   configured noise (`z` times the sensitivity) on the unmasked sum, which the
//!   coordinator never sees without it;
//! - a robust rule (coordinate-wise median) is what a served plaintext round publishes.

mod common;

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use cohort_aggregation::privacy::distributed::SkellamScale;
use cohort_aggregation::privacy::rdp;
use cohort_coordinator::blobs::BlobStore;
use cohort_coordinator::demo::write_digits_partitions;
use cohort_edge::agent::{experiment_labels, task_seed};
use cohort_edge::model::{ModelKind, ModelSpec};
use cohort_edge::partition::PartitionScheme;
use cohort_edge::train::{LocalModel, TrainConfig, Trainer};
use common::{admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

/// A coordinator and `n` edge clients, all checked in.
struct Federation {
    server: Child,
    edges: Vec<Child>,
    http: reqwest::Client,
    state: PathBuf,
    base: String,
    data_dir: PathBuf,
    csvs: Vec<PathBuf>,
    _dir: tempfile::TempDir,
}

impl Federation {
    async fn start(n: usize) -> Self {
        Self::start_with(n, &[]).await
    }

    /// `n` edge clients with `edge_args` added to their command lines.
    async fn start_with(n: usize, edge_args: &[&str]) -> Self {
        cohort_coordinator::server::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().join("coordinator");
        let ca = data_dir.join("tls/ca.pem");
        let port = free_port();
        let base = format!("https://127.0.0.1:{port}");
        let server = spawn_serve(&data_dir, port, None);
        let http = wait_healthy(&base, &ca).await;
        let (csvs, _) = write_digits_partitions(
            &dir.path().join("sites"),
            n,
            &PartitionScheme::Dirichlet { alpha: 0.5 },
            0,
        )
        .unwrap();
        let mut edges = Vec::new();
        for (site, csv) in csvs.iter().enumerate() {
            let issued = admin(
                &http,
                &base,
                Method::POST,
                "/enrolment-tokens",
                Some(serde_json::json!({"label": format!("site-{site}")})),
            )
            .await;
            let token = issued["token"].as_str().unwrap();
            let child = common::edge_command(site, &base, &ca, csv, dir.path(), token, 60)
                .args(edge_args)
                .stderr(Stdio::null())
                .spawn()
                .expect("cohort edge starts");
            edges.push(child);
        }
        // A round samples among the clients available when it opens: start once all
        // have checked in, so that the sampling rate is 1 and every client is in round 1.
        let start = Instant::now();
        loop {
            let clients = admin(&http, &base, Method::GET, "/clients", None).await;
            let seen = clients
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| !c["last_seen_at"].is_null())
                .count();
            if seen == n {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "only {seen} clients checked in"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self {
            server,
            edges,
            http,
            state: dir.path().to_path_buf(),
            base,
            data_dir,
            csvs,
            _dir: dir,
        }
    }

    /// Creates and starts an experiment; its id.
    async fn run(&self, spec: serde_json::Value) -> String {
        let exp = admin(
            &self.http,
            &self.base,
            Method::POST,
            "/experiments",
            Some(spec),
        )
        .await;
        let id = exp["id"].as_str().unwrap().to_string();
        admin(
            &self.http,
            &self.base,
            Method::POST,
            &format!("/experiments/{id}/start"),
            None,
        )
        .await;
        id
    }

    /// Waits until the experiment is finished, showing its rounds if it does not.
    async fn finished(&self, id: &str) -> Vec<serde_json::Value> {
        let start = Instant::now();
        loop {
            let exp = admin(
                &self.http,
                &self.base,
                Method::GET,
                &format!("/experiments/{id}"),
                None,
            )
            .await;
            let rounds = common::rounds(&self.http, &self.base, id).await;
            if exp["state"] == "finished" {
                return rounds;
            }
            assert!(
                exp["state"] == "running" && start.elapsed() < Duration::from_secs(180),
                "experiment is {}: {rounds:#?}",
                exp["state"]
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn round_model(&self, id: &str, round: i64) -> Vec<f32> {
        let blobs = BlobStore::open(&self.data_dir.join("blobs")).unwrap();
        blobs
            .get(&format!("models/{id}/round-{round}.bin"))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Each site's round-1 update (its difference from the initial model), recomputed
    /// as its edge client trained it: the experiment's model and settings, the site's
    /// data, and the seed the agent trains round 1 with (`task_seed(--seed, 1)`).
    fn first_updates(&self, spec: &ModelSpec, train: &TrainConfig) -> (Vec<f32>, Vec<Vec<f32>>) {
        let initial = spec.init(0);
        let updates = self
            .csvs
            .iter()
            .enumerate()
            .map(|(site, csv)| {
                let data = cohort_edge::data::load_csv(csv).unwrap();
                let labels = experiment_labels(&data, 10).unwrap();
                let local =
                    LocalModel::from_parts(spec.clone(), data.features.clone(), labels).unwrap();
                let u = local
                    .train(&initial, train, task_seed(site as u64, 1))
                    .unwrap();
                u.params
                    .values()
                    .iter()
                    .zip(initial.values())
                    .map(|(p, g)| p - g)
                    .collect()
            })
            .collect();
        (initial.values().to_vec(), updates)
    }

    fn stop(mut self) {
        for child in &mut self.edges {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.server.kill().unwrap();
        self.server.wait().unwrap();
    }
}

fn mlp() -> ModelSpec {
    ModelSpec::new(&ModelKind::Mlp { hidden: vec![32] }, 64, 10).unwrap()
}

/// `(published - initial - sum / denominator) * denominator`: the noise on the sum, per
/// coordinate, given the clipped updates.
fn noise_on_sum(
    published: &[f32],
    initial: &[f32],
    clipped: &[Vec<f32>],
    denominator: f64,
) -> Vec<f64> {
    (0..initial.len())
        .map(|i| {
            let sum: f64 = clipped.iter().map(|u| f64::from(u[i])).sum();
            (f64::from(published[i]) - f64::from(initial[i]) - sum / denominator) * denominator
        })
        .collect()
}

/// Asserts that `noise` (one draw per coordinate) has mean 0 and standard deviation
/// `configured`, each within 5 standard errors: `std / sqrt(d)` for the mean, about
/// `std / sqrt(2 d)` for the standard deviation.
fn assert_noise_scale(what: &str, noise: &[f64], configured: f64) {
    let d = noise.len() as f64;
    let mean = noise.iter().sum::<f64>() / d;
    let std = (noise.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (d - 1.0)).sqrt();
    eprintln!("{what} noise on the sum: mean {mean:.4}, std {std:.4} (configured {configured:.4})");
    assert!(mean.abs() < 5.0 * configured / d.sqrt(), "mean {mean}");
    assert!(
        (std / configured - 1.0).abs() < 5.0 / (2.0 * d).sqrt(),
        "std {std}, configured {configured}"
    );
}

fn clipped(updates: &[Vec<f32>], clip: f32) -> Vec<Vec<f32>> {
    updates
        .iter()
        .map(|u| {
            let mut u = u.clone();
            cohort_aggregation::privacy::clip::clip_l2(&mut u, clip);
            u
        })
        .collect()
}

const Z: f64 = 1.0;
const CLIP: f64 = 0.5;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn central_noise_is_calibrated_accounted_and_stops_at_the_budget() {
    const CLIENTS: usize = 10;
    let f = Federation::start(CLIENTS).await;
    // Every client is sampled (q = 1); the budget lies between two and three rounds.
    let eps = |rounds: u64| rdp::epsilon(1.0, Z, rounds, 1e-5).unwrap();
    let budget = (eps(2) + eps(3)) / 2.0;
    let id = f
        .run(serde_json::json!({
            "name": "central dp", "features": 64, "classes": 10, "model": "mlp:32",
            "rounds": 10, "clients_per_round": CLIENTS, "min_participants": CLIENTS,
            "collect_deadline_seconds": 60,
            "privacy": {"noise_multiplier": Z, "clip": CLIP, "epsilon_budget": budget}
        }))
        .await;
    let rounds = f.finished(&id).await;
    let published: Vec<&serde_json::Value> = rounds
        .iter()
        .filter(|r| r["stage"] == "published")
        .collect();
    assert_eq!(
        published.len(),
        2,
        "the budget allows two rounds: {rounds:#?}"
    );
    assert_eq!(rounds.len(), 2, "the third round never opened: {rounds:#?}");
    for (i, r) in published.iter().enumerate() {
        let spent = r["epsilon"].as_f64().unwrap();
        let expected = eps(i as u64 + 1);
        assert!(
            (spent - expected).abs() < 1e-9 * expected,
            "round {}: epsilon {spent}, accountant {expected}",
            i + 1
        );
        assert!(
            r["train_loss"].is_null(),
            "an un-noised loss was published: {r}"
        );
        assert_eq!(r["privacy"]["sampling_rate"], 1.0);
        assert_eq!(r["privacy"]["mechanism"], "central");
    }
    let report = admin(
        &f.http,
        &f.base,
        Method::GET,
        &format!("/experiments/{id}/privacy"),
        None,
    )
    .await;
    assert_eq!(report["budget_exhausted"], true, "{report}");
    assert_eq!(report["attempts_charged"], 2, "{report}");
    assert!((report["epsilon_spent"].as_f64().unwrap() - eps(2)).abs() < 1e-9);

    // Round 1: the initial model plus the clipped sum over the fixed denominator (10),
    // plus N(0, (z C)^2) on the sum.
    let (initial, updates) = f.first_updates(&mlp(), &TrainConfig::default());
    let noise = noise_on_sum(
        &f.round_model(&id, 1),
        &initial,
        &clipped(&updates, CLIP as f32),
        CLIENTS as f64,
    );
    assert_noise_scale("central", &noise, Z * CLIP);
    f.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn distributed_noise_under_secure_aggregation_has_the_configured_scale() {
    const CLIENTS: usize = 10;
    let f = Federation::start(CLIENTS).await;
    let id = f
        .run(serde_json::json!({
            "name": "distributed dp", "features": 64, "classes": 10, "model": "mlp:32",
            "rounds": 1, "clients_per_round": CLIENTS, "min_participants": 8,
            "collect_deadline_seconds": 60,
            "secure_aggregation": {"advertise_seconds": 15, "share_seconds": 20, "unmask_seconds": 20},
            "privacy": {"noise_multiplier": Z, "clip": CLIP, "epsilon_budget": 50}
        }))
        .await;
    let rounds = f.finished(&id).await;
    assert_eq!(rounds.len(), 1, "{rounds:#?}");
    let r = &rounds[0];
    assert_eq!(r["stage"], "published", "{r}");
    assert_eq!(r["reported"], CLIENTS, "every client survived: {r}");
    assert_eq!(r["privacy"]["mechanism"], "distributed");
    assert!(r["train_loss"].is_null(), "{r}");
    // All ten survived, so the round is charged at the full multiplier.
    let expected = rdp::epsilon(1.0, Z, 1, 1e-5).unwrap();
    assert!((r["epsilon"].as_f64().unwrap() - expected).abs() < 1e-9 * expected);

    // The noise on the sum is the sum of ten Skellam shares: standard deviation z times
    // the sensitivity, in the integer domain, over the scale gamma.
    let spec = mlp();
    let scale = SkellamScale::new(
        cohort_aggregation::privacy::distributed::DistributedNoise {
            l2_clip: CLIP as f32,
            noise_multiplier: Z,
        },
        CLIENTS as u32,
    )
    .unwrap();
    let configured = Z * scale.sensitivity(spec.num_params()) / scale.gamma();
    let (initial, updates) = f.first_updates(&spec, &TrainConfig::default());
    let noise = noise_on_sum(
        &f.round_model(&id, 1),
        &initial,
        &clipped(&updates, CLIP as f32),
        CLIENTS as f64,
    );
    assert_noise_scale("distributed", &noise, configured);
    f.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_served_median_round_publishes_the_coordinate_wise_median() {
    const CLIENTS: usize = 5;
    let f = Federation::start(CLIENTS).await;
    let id = f
        .run(serde_json::json!({
            "name": "median", "features": 64, "classes": 10, "model": "mlp:32",
            "rounds": 1, "clients_per_round": CLIENTS, "min_participants": CLIENTS,
            "collect_deadline_seconds": 60, "aggregator": "median"
        }))
        .await;
    let rounds = f.finished(&id).await;
    assert_eq!(rounds[0]["stage"], "published", "{rounds:#?}");
    let (initial, updates) = f.first_updates(&mlp(), &TrainConfig::default());
    let published = f.round_model(&id, 1);
    let mut worst = 0.0f32;
    let mut off_mean = 0;
    for i in 0..initial.len() {
        let mut column: Vec<f32> = updates.iter().map(|u| u[i]).collect();
        column.sort_by(f32::total_cmp);
        let median = initial[i] + column[CLIENTS / 2];
        worst = worst.max((published[i] - median).abs());
        let mean = initial[i] + column.iter().sum::<f32>() / CLIENTS as f32;
        off_mean += usize::from((published[i] - mean).abs() > 1e-4);
    }
    assert!(
        worst < 1e-5,
        "the published model is not the median ({worst})"
    );
    assert!(
        off_mean > initial.len() / 4,
        "indistinguishable from the mean"
    );
    f.stop();
}

/// Adaptive clipping in a served experiment: each round clips at the bound the last one
/// moved to, the bound moves, and the run spends what the Gaussian mechanism at the
/// configured multiplier alone would (the count takes its share of the noise from the
/// update, not extra budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adaptive_clipping_moves_the_bound_round_by_round_at_the_same_cost() {
    const CLIENTS: usize = 5;
    const ROUNDS: usize = 3;
    let f = Federation::start(CLIENTS).await;
    // Start far above every update's norm, so that all are within the bound and the
    // rule must pull it down (towards the median norm).
    let (_, updates) = f.first_updates(&mlp(), &TrainConfig::default());
    let largest = updates
        .iter()
        .map(|u| u.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt())
        .fold(0.0, f64::max);
    let initial = f64::from((10.0 * largest) as f32);
    let id = f
        .run(serde_json::json!({
            "name": "adaptive", "features": 64, "classes": 10, "model": "mlp:32",
            "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": CLIENTS,
            "collect_deadline_seconds": 60,
            "privacy": {"noise_multiplier": Z, "clip": initial, "epsilon_budget": 100,
                        "clip_quantile": 0.5, "clip_count_noise": 0.6}
        }))
        .await;
    let rounds = f.finished(&id).await;
    assert_eq!(rounds.len(), ROUNDS, "{rounds:#?}");
    let mut bound = initial;
    for (i, r) in rounds.iter().enumerate() {
        assert_eq!(r["stage"], "published", "{r}");
        let p = &r["privacy"];
        assert_eq!(p["clip"].as_f64().unwrap(), bound, "round {}: {p}", i + 1);
        let next = p["next_clip"]
            .as_f64()
            .expect("an adaptive round moves the bound");
        assert!(next > 0.0 && next != bound, "{p}");
        bound = next;
        let expected = rdp::epsilon(1.0, Z, i as u64 + 1, 1e-5).unwrap();
        assert!((r["epsilon"].as_f64().unwrap() - expected).abs() < 1e-9 * expected);
    }
    // Round 1 trains from the initial model, so every update is within the bound: the
    // step is exp(-0.2 (fraction within - 0.5)) with the fraction near 1, and the bound
    // falls unless the count's noise (standard deviation 0.6, just above z/2) is below
    // -2.5, a 4-sigma draw. (Later rounds
    // train from a model with noise of that large a clip in it, so their norms are
    // anyone's guess.)
    let first = rounds[0]["privacy"]["next_clip"].as_f64().unwrap();
    assert!(
        first < initial,
        "the bound did not fall: {first} from {initial}"
    );
    let report = admin(
        &f.http,
        &f.base,
        Method::GET,
        &format!("/experiments/{id}/privacy"),
        None,
    )
    .await;
    assert_eq!(report["clip"].as_f64().unwrap(), bound, "{report}");
    assert_eq!(report["budget_exhausted"], false, "{report}");
    f.stop();
}

/// Local DP on the edge: each client clips and noises its own update before it leaves,
/// sends it at weight 1, records the spend in its ledger before uploading, and stops
/// checking in once another update would pass its own budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_dp_noises_each_update_at_the_edge_and_keeps_the_clients_budget() {
    const CLIENTS: usize = 5;
    const LOCAL_Z: f64 = 0.2;
    let eps = |t: u64| rdp::epsilon(1.0, LOCAL_Z, t, 1e-5).unwrap();
    // One update fits the budget, a second would not.
    let budget = format!("{}", (eps(1) + eps(2)) / 2.0);
    let z = LOCAL_Z.to_string();
    let clip = CLIP.to_string();
    let mut f = Federation::start_with(
        CLIENTS,
        &[
            "--local-dp-noise-multiplier",
            &z,
            "--local-dp-clip",
            &clip,
            "--local-dp-epsilon",
            &budget,
        ],
    )
    .await;
    let id = f
        .run(serde_json::json!({
            "name": "local dp", "features": 64, "classes": 10, "model": "mlp:32",
            "rounds": 2, "clients_per_round": CLIENTS, "min_participants": CLIENTS,
            "collect_deadline_seconds": 60
        }))
        .await;
    // Round 1 publishes; for round 2 every client's budget is spent, so each one exits
    // (successfully) instead of training.
    let start = Instant::now();
    for child in &mut f.edges {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "an edge client failed: {status}");
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "an edge client kept going past its budget"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let rounds = common::rounds(&f.http, &f.base, &id).await;
    let first = rounds.iter().find(|r| r["round"] == 1).unwrap();
    assert_eq!(first["stage"], "published", "{rounds:#?}");
    assert!(
        first["train_loss"].is_null(),
        "a client sent its loss: {first}"
    );
    assert!(
        rounds.iter().all(|r| r["round"] != 2 || r["reported"] == 0),
        "{rounds:#?}"
    );
    for site in 0..CLIENTS {
        let ledger: serde_json::Value = serde_json::from_slice(
            &std::fs::read(f.state.join(format!("edge-state-{site}/local_dp.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(ledger["noise_multipliers"], serde_json::json!([LOCAL_Z]));
    }
    // Weight 1 each: the published model is the initial one plus the mean of the clipped
    // updates plus the mean of five independent noises of standard deviation z C.
    let (initial, updates) = f.first_updates(&mlp(), &TrainConfig::default());
    let noise = noise_on_sum(
        &f.round_model(&id, 1),
        &initial,
        &clipped(&updates, CLIP as f32),
        CLIENTS as f64,
    );
    let configured = (CLIENTS as f64).sqrt() * LOCAL_Z * CLIP;
    assert_noise_scale("local", &noise, configured);
    admin(
        &f.http,
        &f.base,
        Method::POST,
        &format!("/experiments/{id}/stop"),
        None,
    )
    .await;
    f.stop();
}
