//! FedBuff served for real: `cohort serve` and `cohort edge` processes over TLS on
//! loopback. Six clients, two of them slowed down, run a FedBuff experiment with buffers
//! of three; the published versions keep advancing while the slow clients are still
//! training, their late updates land staler in later buffers and are counted. A spec that
//! combines FedBuff with secure aggregation is refused with a 422 that names the field,
//! and a coordinator killed with SIGKILL in the middle of a buffer resumes it.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use cohort_coordinator::demo::write_digits_partitions;
use cohort_coordinator::store::{ParticipationState, Store};
use cohort_edge::partition::PartitionScheme;
use common::{ADMIN, admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

/// Acknowledged `(experiment, round, attempt)` lines in an edge client's log.
fn acknowledged(log: &Path) -> Vec<(String, i64, i64)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
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

/// A FedBuff experiment over `clients` digits partitions, started.
async fn start_fedbuff(
    http: &reqwest::Client,
    base: &str,
    steps: u32,
    concurrency: usize,
) -> String {
    let exp = admin(
        http,
        base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "fedbuff", "features": 64, "classes": 10, "model": "logreg",
            "rounds": steps, "clients_per_round": 3, "min_participants": 1,
            "collect_deadline_seconds": 60, "mode": "fedbuff", "buffer_size": 3,
            "concurrency": concurrency, "staleness_exponent": 0.5,
            "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.1}
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    admin(
        http,
        base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    id
}

/// Starts one `cohort edge` per CSV, the ones in `slow` with `slow_ms` of slowdown per
/// task and the others with `fast_ms`; their logs go to `dir/edge-<i>.log`.
async fn spawn_edges(
    http: &reqwest::Client,
    base: &str,
    ca: &Path,
    dir: &Path,
    csvs: &[PathBuf],
    slow: &[usize],
    (fast_ms, slow_ms): (u64, u64),
) -> Vec<(Child, PathBuf)> {
    let mut edges = Vec::new();
    for (i, csv) in csvs.iter().enumerate() {
        let issued = admin(
            http,
            base,
            Method::POST,
            "/enrolment-tokens",
            Some(serde_json::json!({"label": format!("site-{i}")})),
        )
        .await;
        let log = dir.join(format!("edge-{i}.log"));
        let slowdown = if slow.contains(&i) { slow_ms } else { fast_ms };
        let child =
            common::edge_command(i, base, ca, csv, dir, issued["token"].as_str().unwrap(), 15)
                .arg("--slowdown-ms")
                .arg(slowdown.to_string())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("cohort edge starts");
        edges.push((child, log));
    }
    edges
}

/// Published rounds (server steps) so far.
fn published(rounds: &[serde_json::Value]) -> usize {
    rounds.iter().filter(|r| r["stage"] == "published").count()
}

async fn fedbuff_report(http: &reqwest::Client, base: &str, id: &str) -> serde_json::Value {
    admin(
        http,
        base,
        Method::GET,
        &format!("/experiments/{id}/fedbuff"),
        None,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fedbuff_steps_advance_while_slow_clients_train_and_their_stale_updates_count() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    // FedBuff with secure aggregation: a 422 naming the field, and nothing created.
    let refused = http
        .post(format!("{base}/api/v1/admin/experiments"))
        .bearer_auth(ADMIN)
        .json(&serde_json::json!({
            "name": "masked buffer", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 3, "clients_per_round": 3, "min_participants": 3,
            "mode": "fedbuff", "secure_aggregation": {}
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    let body: serde_json::Value = refused.json().await.unwrap();
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("secure_aggregation") && message.contains("fedbuff"),
        "{body}"
    );
    for bad in [
        serde_json::json!({"mode": "fedbuff", "buffer_size": 0}),
        serde_json::json!({"buffer_size": 3}),
        serde_json::json!({"mode": "asynchronous"}),
    ] {
        let mut spec = serde_json::json!({
            "name": "bad", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 3, "clients_per_round": 3, "min_participants": 3
        });
        spec.as_object_mut()
            .unwrap()
            .extend(bad.as_object().unwrap().clone());
        let r = http
            .post(format!("{base}/api/v1/admin/experiments"))
            .bearer_auth(ADMIN)
            .json(&spec)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 422, "{bad}");
    }
    let listed = admin(&http, &base, Method::GET, "/experiments", None).await;
    assert_eq!(
        listed.as_array().unwrap().len(),
        0,
        "refused specs create nothing"
    );

    // The slow clients wait 6 s per task, far past what three steps of the fast ones
    // take even on a loaded 2-core machine, and 30 steps outlast their first upload even
    // on a fast one.
    const STEPS: u32 = 30;
    let (csvs, _test) =
        write_digits_partitions(&dir.path().join("sites"), 6, &PartitionScheme::Iid, 0).unwrap();
    let id = start_fedbuff(&http, &base, STEPS, 6).await;
    let slow = [4usize, 5];
    let edges = spawn_edges(&http, &base, &ca, dir.path(), &csvs, &slow, (300, 6_000)).await;

    // The published versions advance while the slow clients have not uploaded at all.
    let start = Instant::now();
    loop {
        let rounds = common::rounds(&http, &base, &id).await;
        let slow_acks: usize = slow.iter().map(|&i| acknowledged(&edges[i].1).len()).sum();
        if published(&rounds) >= 3 {
            assert_eq!(
                slow_acks, 0,
                "the slow clients uploaded before three steps were published: {rounds:?}"
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "steps did not advance: {rounds:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    common::wait_finished(&http, &base, &id, Duration::from_secs(180)).await;
    let rounds = common::rounds(&http, &base, &id).await;
    assert_eq!(published(&rounds), STEPS as usize, "{rounds:?}");
    for r in &rounds {
        assert_eq!(r["reported"], 3, "every step folds exactly K updates: {r}");
    }
    let report = fedbuff_report(&http, &base, &id).await;
    let steps = report["steps"].as_array().unwrap();
    assert_eq!(steps.len(), STEPS as usize, "{report}");
    let stale: i64 = steps
        .iter()
        .map(|s| s["stale_updates"].as_i64().unwrap())
        .sum();
    let max_staleness = steps
        .iter()
        .map(|s| s["max_staleness"].as_i64().unwrap())
        .max()
        .unwrap();
    assert!(stale >= 1, "no stale update was buffered: {report}");
    assert!(
        max_staleness >= 2,
        "the slow clients' updates were not stale: {report}"
    );
    assert_eq!(report["settings"]["buffer_size"], 3);
    assert_eq!(report["settings"]["staleness_exponent"], 0.5);

    // The slow clients' updates were buffered (staler) rather than refused.
    let mut slow_acks = 0;
    let mut all = Vec::new();
    for (i, (mut child, log)) in edges.into_iter().enumerate() {
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "edge client failed: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let acks = acknowledged(&log);
        if slow.contains(&i) {
            slow_acks += acks.len();
        }
        all.push(acks);
    }
    assert!(slow_acks >= 1, "no slow client's update was acknowledged");
    server.kill().unwrap();
    server.wait().unwrap();

    // Every acknowledged upload is an uploaded task with its update in a buffer.
    let store = Store::connect("sqlite://cohort.db", &data_dir)
        .await
        .unwrap();
    let exp = uuid::Uuid::parse_str(&id).unwrap();
    let mut buffered = HashSet::new();
    for step in 1..=i64::from(STEPS) {
        for u in store.buffer_uploads(exp, step).await.unwrap() {
            buffered.insert((u.upload.client_id, u.upload.id));
        }
    }
    assert_eq!(buffered.len(), 3 * STEPS as usize);
    let acked: usize = all.iter().map(Vec::len).sum();
    assert_eq!(
        acked,
        buffered.len(),
        "every acknowledged update is buffered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fedbuff_coordinator_killed_mid_buffer_resumes_and_publishes_every_step_once() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    const STEPS: u32 = 10;
    let (csvs, _test) =
        write_digits_partitions(&dir.path().join("sites"), 4, &PartitionScheme::Iid, 1).unwrap();
    let id = start_fedbuff(&http, &base, STEPS, 4).await;
    let edges = spawn_edges(&http, &base, &ca, dir.path(), &csvs, &[], (300, 300)).await;

    // Kill the coordinator while a buffer holds some, not all, of its updates.
    let start = Instant::now();
    loop {
        let rounds = common::rounds(&http, &base, &id).await;
        let mid_buffer = rounds.last().is_some_and(|r| {
            r["stage"] == "collecting" && (1..3).contains(&r["reported"].as_i64().unwrap())
        });
        if published(&rounds) >= 2 && mid_buffer {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "buffers did not fill: {rounds:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.kill().unwrap(); // SIGKILL on Unix
    server.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    common::wait_finished(&http, &base, &id, Duration::from_secs(180)).await;
    let rounds = common::rounds(&http, &base, &id).await;
    let steps: Vec<i64> = rounds
        .iter()
        .filter(|r| r["stage"] == "published")
        .map(|r| r["round"].as_i64().unwrap())
        .collect();
    assert_eq!(
        steps,
        (1..=i64::from(STEPS)).collect::<Vec<_>>(),
        "{rounds:?}"
    );
    let mut acked = Vec::new();
    for (mut child, log) in edges {
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "edge client failed: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        acked.push(acknowledged(&log));
    }
    server.kill().unwrap();
    server.wait().unwrap();

    // Every upload a client saw acknowledged, before or after the kill, is recorded.
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
            let mine = parts.iter().find(|p| p.client_id == client).unwrap();
            assert_eq!(
                mine.state,
                ParticipationState::Uploaded,
                "{label} round {round}"
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 3 * STEPS as usize,
        "only {checked} acknowledged uploads"
    );
}
