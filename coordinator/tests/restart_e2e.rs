//! The demo's experiment (10 `cohort-edge` processes, each on its own Dirichlet(0.5)
//! partition of digits, 15 rounds of FedAvg with the MLP) with the coordinator killed by
//! SIGKILL once in the middle of a round and started again on the same data directory:
//! every round completes, every upload an edge client saw acknowledged is an `uploaded`
//! participation row, and the published model still reaches >= 0.90 test accuracy.

mod common;

use std::collections::HashSet;
use std::process::Child;
use std::time::{Duration, Instant};

use cohort_coordinator::demo::write_digits_partitions;
use cohort_coordinator::store::{ParticipationState, Store};
use cohort_edge::model::{ModelKind, ModelSpec};
use cohort_edge::partition::PartitionScheme;
use common::{admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

const CLIENTS: usize = 10;
const ROUNDS: u32 = 15;

/// `(experiment, round, attempt)` of every upload acknowledged in an edge client's log.
fn acknowledged(log: &str) -> Vec<(String, i64, i64)> {
    log.lines()
        .filter_map(|l| l.strip_prefix("cohort-edge: acknowledged "))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_during_a_round_loses_no_acknowledged_upload() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    let (csvs, test) = write_digits_partitions(
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
            "name": "restart", "features": 64, "classes": 10, "model": "mlp",
            "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": 8,
            "collect_deadline_seconds": 60
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let mut edges: Vec<(Child, std::path::PathBuf)> = Vec::new();
    for (i, csv) in csvs.iter().enumerate() {
        let issued = admin(
            &http,
            &base,
            Method::POST,
            "/enrolment-tokens",
            Some(serde_json::json!({"label": format!("site-{i}")})),
        )
        .await;
        let log = dir.path().join(format!("edge-{i}.log"));
        let child = common::edge_command(
            i,
            &base,
            &ca,
            csv,
            dir.path(),
            issued["token"].as_str().unwrap(),
            20,
        )
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("cohort edge starts");
        edges.push((child, log));
    }

    // Kill the coordinator in the middle of a round: once a few rounds are published and
    // the current one has some, not all, of its uploads.
    let start = Instant::now();
    loop {
        let rounds = common::rounds(&http, &base, &id).await;
        let in_progress = rounds.last().is_some_and(|r| {
            r["stage"] == "collecting"
                && r["reported"].as_i64().unwrap() > 0
                && r["reported"].as_i64() < r["selected"].as_i64()
        });
        if rounds.len() >= 4 && in_progress {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "rounds did not start"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.kill().unwrap(); // SIGKILL on Unix
    server.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    common::wait_finished(&http, &base, &id, Duration::from_secs(300)).await;
    let mut acked = Vec::new();
    for (mut child, log) in edges {
        let status = child.wait().unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(status.success(), "edge client failed: {text}");
        acked.push(acknowledged(&text));
    }
    let rs = common::rounds(&http, &base, &id).await;
    let published: HashSet<i64> = rs
        .iter()
        .filter(|r| r["stage"] == "published")
        .map(|r| r["round"].as_i64().unwrap())
        .collect();
    assert_eq!(
        published.len(),
        ROUNDS as usize,
        "every round completed: {rs:?}"
    );
    // The published model still learned.
    let model = http
        .get(format!("{base}/api/v1/admin/experiments/{id}/model"))
        .bearer_auth(common::ADMIN)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let params: Vec<f32> = model
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let spec = ModelSpec::new(&ModelKind::Mlp { hidden: vec![64] }, 64, 10).unwrap();
    let eval = spec
        .evaluate(&params, test.features.view(), &test.labels)
        .unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    assert!(eval.accuracy >= 0.90, "test accuracy {}", eval.accuracy);

    // Every upload an edge client saw acknowledged is an `uploaded` participation row.
    let store = Store::connect("sqlite://cohort.db", &data_dir)
        .await
        .unwrap();
    let clients = store.clients().await.unwrap();
    let mut checked = 0;
    for (site, acks) in acked.iter().enumerate() {
        let label = format!("site-{site}");
        let client = clients.iter().find(|c| c.label == label).unwrap().id;
        for (exp, round, attempt) in acks {
            let exp = uuid::Uuid::parse_str(exp).unwrap();
            let parts = store.participations(exp, *round, *attempt).await.unwrap();
            let mine = parts
                .iter()
                .find(|p| p.client_id == client)
                .expect("participation row");
            assert_eq!(
                mine.state,
                ParticipationState::Uploaded,
                "{label} round {round}"
            );
            checked += 1;
        }
    }
    eprintln!(
        "after the restart: test accuracy {:.4}, {checked} acknowledged uploads all recorded",
        eval.accuracy
    );
    assert!(
        checked >= ROUNDS as usize * 8,
        "only {checked} acknowledged uploads"
    );
}
