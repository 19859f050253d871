//! Personalisation in `cohort serve`, end to end: a real coordinator, in-process edge
//! agents (`run_agent`, what `cohort-edge`, the Python SDK and the C API run) training
//! the built-in MLP on the shipped digits, two classes a client, over real TLS.
//!
//! What it protects:
//! - FedPer's personal layers never leave a client: every upload the coordinator
//!   stored holds the global model's own values there (which therefore never move),
//!   though every client trained a head of its own;
//! - each client keeps its personal layers in its state directory;
//! - every client reports the global and its personalised model's accuracy on its own
//!   held-out split for every model version, and the experiment shows their spread
//!   (mean, 10th percentile) over the clients and each client's figures; with two
//!   classes a client, the personalised models do better than the global one.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cohort_edge::agent::{AgentConfig, run_agent};
use cohort_edge::trainer::BuiltInTrainer;
use common::{Served, admin};
use reqwest::Method;

const CLIENTS: usize = 4;
const ROUNDS: u32 = 4;
/// `mlp:32` on 64 pixels and 10 classes: layers.0 is 64 x 32 + 32, layers.1 (the
/// personal head) 32 x 10 + 10, last in the flat vector.
const PARAMS: usize = 64 * 32 + 32 + 32 * 10 + 10;
const HEAD: std::ops::Range<usize> = (64 * 32 + 32)..PARAMS;

/// Client `i`'s data: the digits of classes `2i` and `2i + 1`, pixels scaled to 0-1.
fn two_classes(i: usize) -> cohort_edge::data::Dataset {
    let all = cohort_edge::data::digits();
    let mine: Vec<usize> = (0..all.len())
        .filter(|&k| all.labels[k] as usize / 2 == i)
        .collect();
    let mut data = all.subset(&mine);
    data.features.mapv_inplace(|v| v / 16.0);
    data
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
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

async fn model(server: &Served, id: &str) -> Vec<f32> {
    let path = format!("/experiments/{id}/model");
    floats(&common::admin_bytes(&server.http, &server.base, &path).await)
}

fn agent(server: &Served, dir: &Path, token: String, i: usize) -> AgentConfig {
    let trainer = Arc::new(BuiltInTrainer::new(two_classes(i)));
    common::agent_config(
        server,
        dir,
        token,
        trainer,
        i as u64,
        Duration::from_secs(5),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn personal_layers_stay_on_the_clients_and_the_experiment_shows_both_accuracies() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let spec = serde_json::json!({
        "name": "fedper", "model": "mlp:32", "features": 64, "classes": 10,
        "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": CLIENTS,
        "collect_deadline_seconds": 120, "max_round_attempts": 2,
        "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.1, "momentum": 0.9},
        "personalisation": "fedper:layers.1", "client_holdout": 0.25
    });
    let exp = admin(
        &server.http,
        &server.base,
        Method::POST,
        "/experiments",
        Some(spec),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();

    let mut agents = Vec::new();
    for i in 0..CLIENTS {
        let token = common::issue_token(&server.http, &server.base, &format!("site-{i}")).await;
        let config = agent(&server, &dir.path().join(format!("agent-{i}")), token, i);
        agents.push(tokio::spawn(run_agent(config)));
    }
    common::wait_checked_in(&server.http, &server.base, CLIENTS, Duration::from_secs(30)).await;
    let path = format!("/experiments/{id}/start");
    admin(&server.http, &server.base, Method::POST, &path, None).await;
    common::wait_finished(&server.http, &server.base, &id, Duration::from_secs(120)).await;
    for agent in agents {
        let report = tokio::time::timeout(Duration::from_secs(60), agent)
            .await
            .expect("the agent goes idle and returns")
            .unwrap()
            .expect("the agent runs without error");
        assert_eq!(report.uploads, ROUNDS as usize, "{report:?}");
    }

    // The global head never moves (every upload carries the global's own), so each
    // stored upload's head is the final model's: no client's own head reached the
    // coordinator, though each trained one (below).
    let end = model(&server, &id).await;
    assert_eq!(end.len(), PARAMS);
    let uploads: Vec<PathBuf> = files(&server.data_dir.join("blobs/uploads").join(&id));
    assert_eq!(uploads.len(), CLIENTS * ROUNDS as usize, "{uploads:?}");
    for path in &uploads {
        let values = floats(&std::fs::read(path).unwrap());
        assert_eq!(values.len(), PARAMS, "{}", path.display());
        assert_eq!(
            &values[HEAD],
            &end[HEAD],
            "{} carries a personal layer",
            path.display()
        );
    }

    // Each client kept a head of its own, trained away from the global one.
    for i in 0..CLIENTS {
        let kept = dir.path().join(format!("agent-{i}/personal/{id}.f32"));
        let kept = floats(&std::fs::read(&kept).unwrap());
        assert_eq!(kept.len(), PARAMS);
        assert_ne!(&kept[HEAD], &end[HEAD], "client {i} trained its head");
    }

    // Every version's figures from every client, and their spread.
    let path = format!("/experiments/{id}/evaluations");
    let versions = admin(&server.http, &server.base, Method::GET, &path, None).await;
    let versions = versions.as_array().unwrap();
    assert_eq!(versions.len(), ROUNDS as usize + 1, "{versions:#?}");
    for v in versions {
        assert_eq!(v["clients"], CLIENTS, "{v:#}");
        for metric in ["accuracy", "personal_accuracy"] {
            let spread = &v["per_client"][metric];
            assert_eq!(spread["clients"], CLIENTS, "{v:#}");
            assert!(spread["p10"].as_f64().unwrap() <= spread["mean"].as_f64().unwrap());
        }
    }
    let last = versions.last().unwrap();
    let global = last["per_client"]["accuracy"]["mean"].as_f64().unwrap();
    let personal = last["per_client"]["personal_accuracy"]["mean"]
        .as_f64()
        .unwrap();
    assert!(
        personal > global + 0.05,
        "two classes a client: personalised {personal} against global {global}"
    );
    let version = last["model_version"].as_i64().unwrap();
    let path = format!("/experiments/{id}/evaluations/{version}");
    let rows = admin(&server.http, &server.base, Method::GET, &path, None).await;
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), CLIENTS);
    // A quarter of each client's examples held out.
    let mut held: Vec<i64> = rows
        .iter()
        .map(|r| r["num_examples"].as_i64().unwrap())
        .collect();
    let mut expected: Vec<i64> = (0..CLIENTS)
        .map(|i| (two_classes(i).len() as f64 * 0.25).round() as i64)
        .collect();
    held.sort();
    expected.sort();
    assert_eq!(held, expected);
    assert!(
        rows.iter()
            .all(|r| r["metrics"]["personal_accuracy"].is_f64()),
        "{rows:#?}"
    );
}
