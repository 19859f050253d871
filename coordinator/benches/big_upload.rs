//! One large update through `cohort serve`: a 100,000,010-parameter model (logistic
//! regression over 10,000,000 features and 10 classes: 400 MB of `f32`) and one client
//! streaming its whole update, with the blobs on disk and in an S3 bucket (moto's
//! server, when it is installed: `COHORT_MOTO_VENV` or `moto_server` on the PATH).
//!
//! What it shows: the coordinator's resident memory while the upload streams through
//! stays flat (the body is checked and written a chunk at a time, to a file or as 8 MiB
//! multipart parts), rather than growing by the update's size. The coordinator's RSS is
//! sampled every 20 ms from `/proc`; the round waits for a second client that never
//! uploads, so no aggregation runs while it is measured. The client streams zeros
//! generated a MiB at a time, so it holds no copy either.
//!
//! `cargo bench -p cohort-coordinator --bench big_upload [-- --mb 400]`
//!
//! One JSON line per store goes to stdout, a table to stderr.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::Method;

// The integration tests' helpers for starting `cohort serve` and moto.
#[path = "../tests/common/mod.rs"]
mod common;

mod support;

use common::{admin, free_port, issue_token, spawn_serve_with};
use support::{arg, status_mib};

fn tls_client(ca: &[u8]) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(ca).unwrap()])
        .timeout(Duration::from_secs(1200))
        .build()
        .unwrap()
}

struct Measured {
    store: &'static str,
    bytes: usize,
    baseline_mib: f64,
    peak_mib: f64,
    seconds: f64,
}

async fn enrol(http: &reqwest::Client, base: &str, label: &str) -> String {
    let token = issue_token(http, base, label).await;
    let r = http
        .post(format!("{base}/api/v1/clients/enrol"))
        .json(&serde_json::json!({ "token": token }))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "enrol: {}", r.status());
    let body: serde_json::Value = r.json().await.unwrap();
    format!(
        "{}.{}",
        body["client_id"].as_str().unwrap(),
        body["secret"].as_str().unwrap()
    )
}

async fn checkin(http: &reqwest::Client, base: &str, credential: &str) -> serde_json::Value {
    let r = http
        .post(format!("{base}/api/v1/clients/checkin"))
        .bearer_auth(credential)
        .json(&serde_json::json!({"wait_seconds": 1}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "checkin: {}", r.status());
    r.json().await.unwrap()
}

async fn run(store: &'static str, features: usize, env: &[(&str, String)]) -> Measured {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut settings: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    settings.push(("COHORT_MAX_BODY_BYTES", "2000000000"));
    let mut child = spawn_serve_with(&data_dir, port, None, &settings);
    let pid = child.id();
    let ca_path = data_dir.join("tls/ca.pem");
    common::wait_healthy(&base, &ca_path).await;
    let ca = std::fs::read(&ca_path).unwrap();
    let http = tls_client(&ca);

    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "big", "model": "logreg", "features": features, "classes": 10,
            "rounds": 1, "clients_per_round": 2, "min_participants": 2,
            "collect_deadline_seconds": 3600
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let uploader = enrol(&http, &base, "uploader").await;
    let idle = enrol(&http, &base, "idle").await;
    checkin(&http, &base, &uploader).await;
    checkin(&http, &base, &idle).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let task = loop {
        let _ = checkin(&http, &base, &idle).await;
        let reply = checkin(&http, &base, &uploader).await;
        if reply["task"].is_object() {
            break reply["task"].clone();
        }
    };
    // The initial model was made and stored; let its memory go back first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let baseline_mib = status_mib(pid, "VmRSS:");

    let parameters = features * 10 + 10;
    let bytes = parameters * 4;
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0.0f64;
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(status_mib(pid, "VmRSS:"));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            peak
        })
    };
    const CHUNK: usize = 1 << 20;
    let chunks = bytes.div_ceil(CHUNK);
    let body = futures_util::stream::iter((0..chunks).map(move |i| {
        let n = CHUNK.min(bytes - i * CHUNK);
        Ok::<_, std::io::Error>(vec![0u8; n])
    }));
    let url = format!(
        "{base}/api/v1/clients/experiments/{id}/rounds/{}/attempts/{}/update?num_samples=10",
        task["round"], task["attempt"]
    );
    let started = Instant::now();
    let r = http
        .post(url)
        .bearer_auth(&uploader)
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .header(reqwest::header::CONTENT_LENGTH, bytes)
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await
        .unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let status = r.status();
    sampling.store(false, Ordering::Relaxed);
    let peak_mib = sampler.await.unwrap();
    assert_eq!(
        status,
        reqwest::StatusCode::CREATED,
        "{}",
        r.text().await.unwrap()
    );
    let _ = child.kill();
    let _ = child.wait();
    Measured {
        store,
        bytes,
        baseline_mib,
        peak_mib,
        seconds,
    }
}

fn main() {
    let mb: usize = arg("--mb").and_then(|v| v.parse().ok()).unwrap_or(400);
    // Logistic regression over `features` and 10 classes: 40 bytes a feature.
    let features = mb * 1_000_000 / 40;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        cohort_coordinator::server::install_crypto_provider();
        let mut results = vec![run("dir", features, &[]).await];
        if let Some(s3) = common::S3::with_bucket("big").await {
            let mut env = s3.env();
            env.push(("COHORT_BLOB_STORE", "s3://big/upload".into()));
            results.push(run("s3 (moto)", features, &env).await);
        }
        eprintln!(
            "{:<10} {:>10} {:>14} {:>12} {:>12} {:>8} {:>8}",
            "store", "MB", "baseline MiB", "peak MiB", "growth MiB", "s", "MB/s"
        );
        for m in &results {
            let mb = m.bytes as f64 / 1e6;
            eprintln!(
                "{:<10} {:>10.1} {:>14.1} {:>12.1} {:>12.1} {:>8.2} {:>8.1}",
                m.store,
                mb,
                m.baseline_mib,
                m.peak_mib,
                m.peak_mib - m.baseline_mib,
                m.seconds,
                mb / m.seconds
            );
            println!(
                "{}",
                serde_json::json!({
                    "bench": "big_upload",
                    "store": m.store,
                    "bytes": m.bytes,
                    "baseline_rss_mib": m.baseline_mib,
                    "peak_rss_mib": m.peak_mib,
                    "growth_mib": m.peak_mib - m.baseline_mib,
                    "growth_over_update": (m.peak_mib - m.baseline_mib) * 1048576.0 / m.bytes as f64,
                    "seconds": m.seconds,
                })
            );
        }
    });
}
