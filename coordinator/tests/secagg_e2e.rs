//! Secure aggregation end to end, over TLS, with real processes: `cohort serve` and 10
//! `cohort-edge` processes on Dirichlet(0.5) partitions of digits run a SecAgg+
//! experiment, and two edge clients are killed with SIGKILL in round 1: one right after
//! it sent its key shares, one right after it uploaded its masked input; and a run with a
//! client killed at each of the six stages of the protocol against a coordinator that
//! cheats.
//!
//! What it protects:
//! - the round completes (the first client's pairwise masks are removed with its
//!   rebuilt mask key; the second's self mask is rebuilt from its neighbours' shares);
//! - the published model equals, within the quantisation bound, the plain FedAvg of the
//!   survivors' updates, recomputed here from the same data, model and seeds (and it
//!   visibly includes the client that died after uploading);
//! - the round detail says who dropped at which stage;
//! - nothing the coordinator stored (database, blobs) contains an unmasked update: no
//!   survivor's update or trained model appears in any stored byte, and the stored
//!   masked inputs agree with the quantised updates no more often than chance.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cohort_aggregation::ModelVector;
use cohort_aggregation::secagg::{EXTRA_WORDS, QuantizationParams, Quantizer};
use cohort_coordinator::demo::write_digits_partitions;
use cohort_coordinator::store::Store;
use cohort_edge::agent::{experiment_labels, task_seed};
use cohort_edge::model::{ModelKind, ModelSpec};
use cohort_edge::partition::PartitionScheme;
use cohort_edge::train::{LocalModel, TrainConfig, Trainer};
use common::{admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

const CLIENTS: usize = 10;
const ROUNDS: u32 = 3;

/// A `cohort edge` child whose stderr is copied to a log file line by line, each line
/// also sent to the test as `(site, line)`.
fn spawn_edge(
    site: usize,
    base: &str,
    ca: &Path,
    csv: &Path,
    dir: &Path,
    token: &str,
    lines: mpsc::Sender<(usize, String)>,
) -> (Child, PathBuf) {
    let mut child = common::edge_command(site, base, ca, csv, dir, token, 25)
        .stderr(Stdio::piped())
        .spawn()
        .expect("cohort edge starts");
    let log = dir.join(format!("edge-{site}.log"));
    let mut file = std::fs::File::create(&log).unwrap();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::Write;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(file, "{line}");
            let _ = lines.send((site, line));
        }
    });
    (child, log)
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Waits (at most a minute) until `n` clients have checked in, so that a round opened
/// now selects them all.
async fn wait_checked_in(http: &reqwest::Client, base: &str, n: usize) {
    let start = Instant::now();
    loop {
        let clients = admin(http, base, Method::GET, "/clients", None).await;
        let seen = clients
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| !c["last_seen_at"].is_null())
            .count();
        if seen == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {seen} clients checked in"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secure_round_survives_two_clients_killed_mid_round() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    let (csvs, _test) = write_digits_partitions(
        &dir.path().join("sites"),
        CLIENTS,
        &PartitionScheme::Dirichlet { alpha: 0.5 },
        0,
    )
    .unwrap();
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "secure", "features": 64, "classes": 10, "model": "mlp",
            "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": 6,
            "collect_deadline_seconds": 15,
            "secure_aggregation": {
                "advertise_seconds": 8, "reveal_seconds": 8, "share_seconds": 15,
                "confirm_seconds": 15, "unmask_seconds": 15
            }
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let exp_id = uuid::Uuid::parse_str(&id).unwrap();
    let (tx, rx) = mpsc::channel();
    let mut edges: Vec<Option<Child>> = Vec::new();
    for (site, csv) in csvs.iter().enumerate() {
        let issued = admin(
            &http,
            &base,
            Method::POST,
            "/enrolment-tokens",
            Some(serde_json::json!({"label": format!("site-{site}")})),
        )
        .await;
        let (child, _) = spawn_edge(
            site,
            &base,
            &ca,
            csv,
            dir.path(),
            issued["token"].as_str().unwrap(),
            tx.clone(),
        );
        edges.push(Some(child));
    }
    drop(tx);
    // Start once all ten have enrolled and checked in, so that round 1 selects them all
    // (a round selects among the clients available when it opens).
    wait_checked_in(&http, &base, CLIENTS).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;

    // Site 0 dies right after its key shares went out; the first other site to upload
    // its masked input dies right after. Both in round 1.
    let round_one = "round=1 attempt=1";
    let mut after_share = None;
    let mut after_upload = None;
    let start = Instant::now();
    while after_share.is_none() || after_upload.is_none() {
        let (site, line) = rx
            .recv_timeout(Duration::from_secs(120).saturating_sub(start.elapsed()))
            .expect("round 1 reaches both kill points");
        if !line.contains(round_one) {
            continue;
        }
        let kill = if site == 0 && line.contains("secagg shared keys") {
            after_share = Some(site);
            true
        } else if site != 0
            && after_upload.is_none()
            && line.contains("secagg uploaded masked input")
        {
            after_upload = Some(site);
            true
        } else {
            false
        };
        if kill {
            let mut child = edges[site].take().unwrap();
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            eprintln!("killed site {site} after: {line}");
        }
    }
    let (killed_after_share, killed_after_upload) = (after_share.unwrap(), after_upload.unwrap());

    // Wait for the end, showing every attempt's stage and failure if it does not come.
    let start = Instant::now();
    loop {
        let exp = admin(
            &http,
            &base,
            Method::GET,
            &format!("/experiments/{id}"),
            None,
        )
        .await;
        if exp["state"] == "finished" {
            break;
        }
        let rounds = common::rounds(&http, &base, &id).await;
        assert!(
            exp["state"] == "running" && start.elapsed() < Duration::from_secs(240),
            "experiment is {}: {rounds:#?}",
            exp["state"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for child in edges.iter_mut().flatten() {
        let status = child.wait().unwrap();
        assert!(status.success(), "an edge client failed");
    }

    // Who dropped where, as the admin API reports it.
    let clients = admin(&http, &base, Method::GET, "/clients", None).await;
    let client_of = |site: usize| -> uuid::Uuid {
        let label = format!("site-{site}");
        let c = clients
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["label"] == label.as_str())
            .unwrap();
        uuid::Uuid::parse_str(c["id"].as_str().unwrap()).unwrap()
    };
    let detail = admin(
        &http,
        &base,
        Method::GET,
        &format!("/experiments/{id}/rounds/1/attempts/1"),
        None,
    )
    .await;
    assert_eq!(detail["round"]["stage"], "published", "{detail}");
    let secure = &detail["secure_aggregation"];
    assert_eq!(secure["progress"]["advertised"], 10, "{secure}");
    assert_eq!(secure["progress"]["shared"], 10, "{secure}");
    assert_eq!(secure["progress"]["masked"], 9, "{secure}");
    assert_eq!(secure["progress"]["confirmed"], 8, "{secure}");
    assert_eq!(secure["progress"]["unmasked"], 8, "{secure}");
    assert_eq!(
        secure["dropped"]["masked"],
        serde_json::json!([client_of(killed_after_share)])
    );
    // Killed before it could sign the survivor list: its input is in the sum, and it
    // is recorded as dropped there.
    assert_eq!(
        secure["dropped"]["confirm"],
        serde_json::json!([client_of(killed_after_upload)])
    );
    let rounds = common::rounds(&http, &base, &id).await;
    let published = rounds.iter().filter(|r| r["stage"] == "published").count();
    assert_eq!(
        published, ROUNDS as usize,
        "every round published: {rounds:?}"
    );
    server.kill().unwrap();
    server.wait().unwrap();

    // Recompute every survivor's update of round 1 as its edge client did: the initial
    // model, the experiment's training settings, the site's data, and the agent's seed
    // for round 1 (`task_seed(--seed, 1)`).
    let spec = ModelSpec::new(&ModelKind::Mlp { hidden: vec![64] }, 64, 10).unwrap();
    let initial = spec.init(0);
    let train = TrainConfig::default();
    let survivors: Vec<usize> = (0..CLIENTS).filter(|&s| s != killed_after_share).collect();
    let mut updates: Vec<(usize, ModelVector, u64)> = Vec::new();
    for &site in &survivors {
        let data = cohort_edge::data::load_csv(&csvs[site]).unwrap();
        let labels = experiment_labels(&data, 10).unwrap();
        let local = LocalModel::from_parts(spec.clone(), data.features.clone(), labels).unwrap();
        let u = local
            .train(&initial, &train, task_seed(site as u64, 1))
            .unwrap();
        updates.push((site, u.params, u.num_samples as u64));
    }
    let store = Store::connect("sqlite://cohort.db", &data_dir)
        .await
        .unwrap();
    let model = store.latest_model(exp_id).await.unwrap().unwrap();
    assert_eq!(model.round, i64::from(ROUNDS));
    let blobs = cohort_coordinator::blobs::BlobStore::open(&data_dir.join("blobs")).unwrap();
    let round_one_model = floats(&blobs.get(&format!("models/{id}/round-1.bin")).unwrap());

    // Plain FedAvg of the survivors' (clipped) differences from the initial model.
    let q = QuantizationParams::default();
    let fedavg = |sites: &[usize]| -> Vec<f64> {
        let total: f64 = updates
            .iter()
            .filter(|(s, _, _)| sites.contains(s))
            .map(|(_, _, w)| (*w).min(u64::from(q.max_weight)) as f64)
            .sum();
        let mut mean: Vec<f64> = initial.values().iter().map(|&g| f64::from(g)).collect();
        for (s, params, w) in &updates {
            if !sites.contains(s) {
                continue;
            }
            let w = (*w).min(u64::from(q.max_weight)) as f64;
            for ((m, &p), &g) in mean.iter_mut().zip(params.values()).zip(initial.values()) {
                let clip = f64::from(q.clip);
                *m += w * f64::from(p - g).clamp(-clip, clip) / total;
            }
        }
        mean
    };
    let max_diff = |reference: &[f64]| {
        reference
            .iter()
            .zip(&round_one_model)
            .map(|(r, &m)| (r - f64::from(m)).abs())
            .fold(0.0, f64::max)
    };
    let quantizer = Quantizer::new(q, CLIENTS as u32).unwrap();
    let total_weight: u64 = updates.iter().map(|(_, _, w)| *w).sum();
    let bound = quantizer.error_bound(survivors.len(), total_weight);
    // The server's own f32 arithmetic after decoding (global + mean difference, then the
    // optimizer's step): at most four roundings of half an ulp of the largest parameter.
    let largest = round_one_model.iter().fold(0f32, |m, v| m.max(v.abs()));
    let slack = 4.0 * f64::from(largest) * f64::from(f32::EPSILON) / 2.0;
    let diff = max_diff(&fedavg(&survivors));
    eprintln!(
        "round 1: {} survivors, largest difference from plain FedAvg {diff:.3e}, bound \
         {bound:.3e} + f32 slack {slack:.3e}",
        survivors.len()
    );
    assert!(
        diff <= bound + slack,
        "differs from FedAvg by {diff}, bound {bound}"
    );
    let without: Vec<usize> = survivors
        .iter()
        .copied()
        .filter(|&s| s != killed_after_upload)
        .collect();
    let diff_without = max_diff(&fedavg(&without));
    assert!(
        diff_without > 100.0 * (bound + slack),
        "the client killed after uploading must be in the sum ({diff_without})"
    );

    // Nothing stored holds an unmasked update. (1) No survivor's trained parameters or
    // update, as little-endian floats, appear anywhere in the data directory (16-byte
    // windows at 64 places along each vector).
    let stored: Vec<(PathBuf, Vec<u8>)> = files(&data_dir)
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    for (site, params, _) in &updates {
        let delta: Vec<f32> = params
            .values()
            .iter()
            .zip(initial.values())
            .map(|(p, g)| p - g)
            .collect();
        for vector in [params.values(), &delta[..]] {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            for k in 0..64 {
                let at = (k * (bytes.len() - 16) / 63) & !3;
                let needle = &bytes[at..at + 16];
                for (path, hay) in &stored {
                    assert!(
                        !hay.windows(16).any(|w| w == needle),
                        "site {site}'s update is in {}",
                        path.display()
                    );
                }
            }
        }
    }
    // (2) The stored masked inputs are not the quantised updates: each coordinate of a
    // quantised update is one of two neighbouring integers; a masked word lands on
    // either with probability 2^-31.
    let parts = store.participations(exp_id, 1, 1).await.unwrap();
    let uploads = store.uploads(exp_id, 1, 1).await.unwrap();
    assert_eq!(uploads.len(), 9);
    let scale_levels = f64::from((1u32 << quantizer.bits()) - 1);
    for upload in &uploads {
        let p = parts
            .iter()
            .find(|p| p.client_id == upload.client_id)
            .unwrap();
        assert_eq!(p.num_samples, None, "the weight is not stored in the clear");
        assert_eq!(p.train_loss, None, "the loss is not stored in the clear");
        assert_eq!(upload.num_samples, 0);
        let site = survivors
            .iter()
            .copied()
            .find(|&s| client_of(s) == upload.client_id)
            .unwrap();
        let (_, params, w) = updates.iter().find(|(s, _, _)| *s == site).unwrap();
        let words = blobs.get(&upload.blob_path).unwrap();
        assert_eq!(words.len(), (spec.num_params() + EXTRA_WORDS) * 4);
        let masked: Vec<u32> = words
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let clip = f64::from(q.clip);
        let scale = (*w).min(u64::from(q.max_weight)) as f64 / f64::from(q.max_weight);
        let matches = params
            .values()
            .iter()
            .zip(initial.values())
            .zip(&masked)
            .filter(|((p, g), m)| {
                let s = scale * f64::from(**p - **g).clamp(-clip, clip);
                let z = (s + clip) * scale_levels / (2.0 * clip);
                let lo = z.floor() as u32;
                **m == lo || **m == lo.wrapping_add(1)
            })
            .count();
        assert!(
            matches <= 2,
            "site {site}: {matches} of {} stored words equal the quantised update",
            spec.num_params()
        );
    }
    // (3) The protocol messages are public keys, ciphertexts and revealed shares only:
    // none is as long as an update.
    for (path, bytes) in &stored {
        if path.extension().is_some_and(|e| e == "bin")
            && path.to_string_lossy().contains("uploads")
        {
            assert_eq!(bytes.len(), (spec.num_params() + EXTRA_WORDS) * 4);
        }
    }
}

/// Finding 3 of the security review: an edge client took whatever threshold the
/// coordinator sent. Three `cohort edge` processes join a secure experiment whose
/// threshold is 2; one of them was started with `--min-threshold 3`: it refuses the
/// round before it advertises a key, and says which floor the round fell short of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_client_refuses_a_round_below_its_floors_and_says_why() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;
    let (csvs, _test) = write_digits_partitions(
        &dir.path().join("sites"),
        3,
        &PartitionScheme::Dirichlet { alpha: 0.5 },
        0,
    )
    .unwrap();
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "floors", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 1, "clients_per_round": 3, "min_participants": 2,
            "collect_deadline_seconds": 10,
            "secure_aggregation": {"threshold": 2, "neighbours": 2, "advertise_seconds": 5,
                                   "share_seconds": 5, "unmask_seconds": 5}
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let (tx, rx) = mpsc::channel();
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
        let mut command = common::edge_command(
            site,
            &base,
            &ca,
            csv,
            dir.path(),
            issued["token"].as_str().unwrap(),
            20,
        );
        if site == 2 {
            command.args(["--min-threshold", "3"]);
        }
        let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send((site, line));
            }
        });
        edges.push(child);
    }
    drop(tx);
    wait_checked_in(&http, &base, 3).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let mut refusal = None;
    let mut advertised_by_2 = false;
    let start = Instant::now();
    while refusal.is_none() {
        let (site, line) = rx
            .recv_timeout(Duration::from_secs(60).saturating_sub(start.elapsed()))
            .expect("site 2 refuses the round");
        if site == 2 && line.contains("secagg advertised keys") {
            advertised_by_2 = true;
        }
        if site == 2 && line.contains("floor") {
            refusal = Some(line);
        }
    }
    let refusal = refusal.unwrap();
    assert!(
        refusal.contains(
            "the round's threshold is 2, below this client's floor of 3 (--min-threshold)"
        ),
        "{refusal}"
    );
    assert!(!advertised_by_2, "the refusing client advertised no key");
    for mut child in edges {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = server.kill();
    let _ = server.wait();
}

/// Issue 21: the protocol against a coordinator that cheats costs nothing in
/// robustness. A secure experiment with the consistency check (the default) runs over
/// TLS with 10 `cohort edge` processes, and one client is killed (SIGKILL) at each of the
/// six stages, at the exact stage (`COHORT_EDGE_PAUSE` stops it just before it sends that
/// stage's message): two in round 1 (advertise, reveal), two in round 2 (share, masked
/// input), two in round 3 (signing the survivor list, unmask). A killed site comes back
/// once a later round has begun, as a rebooted hospital server would: the same state
/// directory, identity and credential, in a new process.
///
/// What it protects: every round publishes (a client lost before revealing its graph
/// nonce fails that attempt, and the next attempt goes on without it); each killed
/// client is recorded as dropped at its stage; and each round's model equals, within
/// the quantisation bound, the plain FedAvg of that round's survivors (the clients
/// whose masked input is in the sum), recomputed here from the previous round's
/// published model, the sites' data and the agents' seeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_round_publishes_with_a_client_killed_at_each_stage() {
    /// (site, stage it dies before sending, first round it may die in).
    const KILLS: [(usize, &str, i64); 6] = [
        (0, "advertise", 1),
        (1, "reveal", 1),
        (2, "share", 2),
        (3, "masked", 2),
        (4, "confirm", 3),
        (5, "unmask", 3),
    ];
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;
    let (csvs, _test) = write_digits_partitions(
        &dir.path().join("sites"),
        CLIENTS,
        &PartitionScheme::Dirichlet { alpha: 0.5 },
        0,
    )
    .unwrap();
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "secure, clients killed at every stage", "features": 64, "classes": 10,
            "model": "logreg", "rounds": ROUNDS, "clients_per_round": CLIENTS,
            "min_participants": 3, "max_round_attempts": 4,
            "collect_deadline_seconds": 10,
            "secure_aggregation": {
                "consistency_check": true,
                "advertise_seconds": 6, "reveal_seconds": 6, "share_seconds": 6,
                "confirm_seconds": 6, "unmask_seconds": 6
            }
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let exp_id = uuid::Uuid::parse_str(&id).unwrap();
    let (tx, rx) = mpsc::channel();
    let mut tokens = Vec::new();
    for site in 0..CLIENTS {
        let issued = admin(
            &http,
            &base,
            Method::POST,
            "/enrolment-tokens",
            Some(serde_json::json!({"label": format!("site-{site}")})),
        )
        .await;
        tokens.push(issued["token"].as_str().unwrap().to_string());
    }
    let spawn = |site: usize, pause: Option<String>, life: usize| -> Child {
        let mut command =
            common::edge_command(site, &base, &ca, &csvs[site], dir.path(), &tokens[site], 25);
        if let Some(pause) = pause {
            command.env("COHORT_EDGE_PAUSE", pause);
        }
        let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let tx = tx.clone();
        let log = dir.path().join(format!("edge-{site}-{life}.log"));
        std::thread::spawn(move || {
            use std::io::Write;
            let mut file = std::fs::File::create(log).unwrap();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = writeln!(file, "{line}");
                let _ = tx.send((site, line));
            }
        });
        child
    };
    let mut edges: Vec<Option<Child>> = (0..CLIENTS)
        .map(|site| {
            let pause = KILLS
                .iter()
                .find(|(s, _, _)| *s == site)
                .map(|(_, stage, round)| format!("{stage}:{round}"));
            Some(spawn(site, pause, 0))
        })
        .collect();
    wait_checked_in(&http, &base, CLIENTS).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;

    // Each marked client pauses just before its stage's message; kill it there.
    let mut killed_in: Vec<(usize, &str, i64)> = Vec::new();
    let mut down: Vec<(usize, i64)> = Vec::new();
    let start = Instant::now();
    while killed_in.len() < KILLS.len() {
        let Ok((site, line)) =
            rx.recv_timeout(Duration::from_secs(300).saturating_sub(start.elapsed()))
        else {
            let rounds = common::rounds(&http, &base, &id).await;
            panic!("killed only {killed_in:?}: {rounds:#?}");
        };
        // A site comes back once another has begun a later round than the one it died
        // in (so that a client killed before advertising really misses its round).
        let now_in = line
            .split(" round=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|r| r.parse::<i64>().ok());
        if let Some(now_in) = now_in {
            for (back, _) in down.extract_if(.., |(_, died)| now_in > *died) {
                eprintln!("restarting site {back}");
                edges[back] = Some(spawn(back, None, 1));
            }
        }
        let Some(at) = line.split("paused before ").nth(1) else {
            continue;
        };
        let (stage, round) = at.split_once(" in round ").expect("a pause line");
        let (_, expected, _) = KILLS.iter().find(|(s, _, _)| *s == site).unwrap();
        assert_eq!(stage, *expected, "site {site}: {line}");
        let mut child = edges[site].take().unwrap();
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        eprintln!("killed site {site} before {stage} in round {round}");
        let round: i64 = round.parse().unwrap();
        down.push((site, round));
        killed_in.push((site, expected, round));
    }

    let start = Instant::now();
    loop {
        let exp = admin(
            &http,
            &base,
            Method::GET,
            &format!("/experiments/{id}"),
            None,
        )
        .await;
        if exp["state"] == "finished" {
            break;
        }
        let rounds = common::rounds(&http, &base, &id).await;
        assert!(
            exp["state"] == "running" && start.elapsed() < Duration::from_secs(300),
            "experiment is {}: {rounds:#?}",
            exp["state"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for child in edges.iter_mut().flatten() {
        assert!(child.wait().unwrap().success(), "an edge client failed");
    }
    let rounds = common::rounds(&http, &base, &id).await;
    let published: Vec<&serde_json::Value> = rounds
        .iter()
        .filter(|r| r["stage"] == "published")
        .collect();
    assert_eq!(published.len(), ROUNDS as usize, "{rounds:#?}");
    let clients = admin(&http, &base, Method::GET, "/clients", None).await;
    let site_of = |client: uuid::Uuid| -> usize {
        let c = clients
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == client.to_string().as_str())
            .unwrap();
        c["label"].as_str().unwrap()["site-".len()..]
            .parse()
            .unwrap()
    };
    server.kill().unwrap();
    server.wait().unwrap();

    let store = Store::connect("sqlite://cohort.db", &data_dir)
        .await
        .unwrap();
    let blobs = cohort_coordinator::blobs::BlobStore::open(&data_dir.join("blobs")).unwrap();
    // Each killed client is recorded as dropped at its stage, in the round it died in.
    let mut dropped: Vec<(i64, usize, String)> = Vec::new();
    for a in store.rounds(exp_id).await.unwrap() {
        for p in store
            .participations(exp_id, a.round, a.attempt)
            .await
            .unwrap()
        {
            if let Some(stage) = p.dropped_stage {
                dropped.push((a.round, site_of(p.client_id), stage));
            }
        }
    }
    for &(site, stage, round) in &killed_in {
        assert!(
            dropped.contains(&(round, site, stage.to_string())),
            "site {site} is recorded as dropped at {stage} in round {round}: {dropped:?}"
        );
    }

    // Every round's model is the FedAvg of its survivors' updates from the model before.
    let spec = ModelSpec::new(&ModelKind::LogReg, 64, 10).unwrap();
    let train = TrainConfig::default();
    let q = QuantizationParams::default();
    let mut base_model = spec.init(0);
    for round in 1..=i64::from(ROUNDS) {
        let attempt = published
            .iter()
            .find(|r| r["round"] == round)
            .and_then(|r| r["attempt"].as_i64())
            .unwrap();
        let row = store.round(exp_id, round, attempt).await.unwrap();
        let config: cohort_aggregation::secagg::RoundConfig =
            serde_json::from_value(row.secagg.clone().unwrap()).unwrap();
        assert!(config.consistency_check);
        let parts = store.participations(exp_id, round, attempt).await.unwrap();
        let survivors: Vec<usize> = parts
            .iter()
            .filter(|p| {
                matches!(
                    p.secagg_stage.as_deref(),
                    Some("masked" | "confirmed" | "unmasked" | "excluded")
                )
            })
            .map(|p| site_of(p.client_id))
            .collect();
        let mut updates = Vec::new();
        for &site in &survivors {
            let data = cohort_edge::data::load_csv(&csvs[site]).unwrap();
            let labels = experiment_labels(&data, 10).unwrap();
            let local =
                LocalModel::from_parts(spec.clone(), data.features.clone(), labels).unwrap();
            let u = local
                .train(&base_model, &train, task_seed(site as u64, round))
                .unwrap();
            updates.push((u.params, u.num_samples as u64));
        }
        let weight = |w: u64| w.min(u64::from(q.max_weight)) as f64;
        let total: f64 = updates.iter().map(|(_, w)| weight(*w)).sum();
        let mut fedavg: Vec<f64> = base_model.values().iter().map(|&g| f64::from(g)).collect();
        let clip = f64::from(q.clip);
        for (params, w) in &updates {
            for ((m, &p), &g) in fedavg
                .iter_mut()
                .zip(params.values())
                .zip(base_model.values())
            {
                *m += weight(*w) * f64::from(p - g).clamp(-clip, clip) / total;
            }
        }
        let model = floats(
            &blobs
                .get(&format!("models/{id}/round-{round}.bin"))
                .unwrap(),
        );
        let quantizer = Quantizer::new(q, config.parties).unwrap();
        let bound = quantizer.error_bound(survivors.len(), updates.iter().map(|(_, w)| *w).sum());
        let largest = model.iter().fold(0f32, |m, v| m.max(v.abs()));
        let slack = 4.0 * f64::from(largest) * f64::from(f32::EPSILON) / 2.0;
        let diff = fedavg
            .iter()
            .zip(&model)
            .map(|(r, &m)| (r - f64::from(m)).abs())
            .fold(0.0, f64::max);
        eprintln!(
            "round {round} attempt {attempt}: survivors {survivors:?}, largest difference \
             from FedAvg {diff:.3e} (bound {bound:.3e} + {slack:.3e})"
        );
        assert!(
            diff <= bound + slack,
            "round {round}: differs from the FedAvg of its survivors by {diff}"
        );
        base_model = ModelVector::new(base_model.layout().clone(), model).unwrap();
    }
}
