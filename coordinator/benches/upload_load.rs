//! Load on one coordinator: N concurrent edge clients, each on its own TLS connection,
//! upload a 100,000-parameter update (400,000 bytes) in the same round to a real
//! `cohort serve` process on PostgreSQL. Reports uploads per second, upload latency
//! (p50, p99), and the coordinator's resident memory before, at its peak during the
//! uploads, and after the round's aggregation.
//!
//! Each configuration runs on a fresh coordinator (so its peak is its own) in a fresh
//! PostgreSQL schema. The defaults separate the two things memory could grow with:
//!
//! - `100x100` and `1000x100`: 100 or 1,000 uploads held in the round, at most 100 in
//!   flight at once. Memory must not grow with the uploads held: uploads stream to disk
//!   and aggregation folds one at a time.
//! - `1000x1000`: all 1,000 clients at once; memory then grows with connections in
//!   flight (TLS state, one HTTP/2 window and one 64 KiB chunk each), not with the
//!   update size.
//!
//! Every client keeps its connection from check-in to upload and hangs up after its
//! upload is acknowledged, as a phone would.
//!
//! The baseline, measured in the same run on the same disk, is the rate of durable
//! 400,000-byte writes (write, fsync, rename, fsync of the directory), the floor of
//! what each acknowledged upload costs; `ratio` is uploads/s over that rate.
//!
//! `cargo bench -p cohort-coordinator --bench upload_load [-- --runs 100x100,1000x100,1000x1000 --features 9999 --classes 10]`
//!
//! The database is `COHORT_BENCH_POSTGRES_URL`, else `COHORT_TEST_POSTGRES_URL`, else
//! `postgres://postgres@127.0.0.1:5432/test`. One JSON line per configuration goes to
//! stdout, a table to stderr. The load generator runs on the same machine, so the
//! figures are for coordinator and clients sharing its cores.

use std::path::Path;
use std::process::Child;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use reqwest::Method;
use tokio::sync::Semaphore;

// The integration tests' helpers for starting `cohort serve`.
#[path = "../tests/common/mod.rs"]
mod common;

use common::{ADMIN, free_port, spawn_serve_with};

mod support;

use support::{arg, durable_write_rate, median, percentile, status_mib};

/// Resident set size and its high-water mark of `pid`, in MiB.
fn memory_mib(pid: u32) -> (f64, f64) {
    (status_mib(pid, "VmRSS:"), status_mib(pid, "VmHWM:"))
}

fn tls_client(ca: &[u8]) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(ca).unwrap()])
        .timeout(Duration::from_secs(600))
        .pool_max_idle_per_host(1)
        .build()
        .unwrap()
}

struct Coordinator {
    base: String,
    http: reqwest::Client,
    ca: Vec<u8>,
    child: Child,
}

impl Coordinator {
    async fn admin(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let mut req = self
            .http
            .request(method, format!("{}/api/v1/admin{path}", self.base))
            .bearer_auth(ADMIN);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.unwrap_or(serde_json::Value::Null)
    }
}

async fn start_coordinator(data_dir: &Path, url: &str) -> Coordinator {
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    // Every simulated client shares this machine's address: the per-address limits
    // would throttle the run itself.
    let child = spawn_serve_with(
        data_dir,
        port,
        Some(url),
        &[
            ("COHORT_ENROL_RATE", "0"),
            ("COHORT_ADDRESS_UPLOAD_RATE", "0"),
        ],
    );
    let ca_path = data_dir.join("tls/ca.pem");
    common::wait_healthy(&base, &ca_path).await;
    // The uploads of a big run take longer than the helpers' client waits.
    let ca = std::fs::read(&ca_path).unwrap();
    Coordinator {
        base,
        http: tls_client(&ca),
        ca,
        child,
    }
}

/// One virtual client: its own connection, its credential.
struct Client {
    http: reqwest::Client,
    credential: String,
}

async fn enrol(c: &Coordinator, n: usize) -> Vec<Client> {
    futures_util::stream::iter(0..n)
        .map(|i| async move {
            let issued = c
                .admin(
                    Method::POST,
                    "/enrolment-tokens",
                    Some(serde_json::json!({"label": format!("load-{i}")})),
                )
                .await;
            let http = tls_client(&c.ca);
            let r = http
                .post(format!("{}/api/v1/clients/enrol", c.base))
                .json(&serde_json::json!({"token": issued["token"]}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "enrol: {}", r.status());
            let body: serde_json::Value = r.json().await.unwrap();
            Client {
                http,
                credential: format!(
                    "{}.{}",
                    body["client_id"].as_str().unwrap(),
                    body["secret"].as_str().unwrap()
                ),
            }
        })
        .buffer_unordered(32)
        .collect()
        .await
}

async fn checkin(c: &Coordinator, client: &Client, wait: u64) -> serde_json::Value {
    let r = client
        .http
        .post(format!("{}/api/v1/clients/checkin", c.base))
        .bearer_auth(&client.credential)
        .json(&serde_json::json!({"wait_seconds": wait}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "checkin: {}", r.status());
    r.json().await.unwrap()
}

struct Measured {
    clients: usize,
    concurrency: usize,
    parameters: usize,
    uploads_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    rss_before_mib: f64,
    rss_peak_mib: f64,
    rss_after_aggregation_mib: f64,
    aggregate_s: f64,
}

async fn run_one(
    url_base: &str,
    clients: usize,
    concurrency: usize,
    features: usize,
    classes: usize,
) -> Measured {
    let admin_options = sqlx::postgres::PgConnectOptions::from_str(url_base).unwrap();
    let pg = sqlx::PgPool::connect_with(admin_options).await.unwrap();
    let schema = format!("cohort_load_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&pg)
        .await
        .unwrap();
    let sep = if url_base.contains('?') { '&' } else { '?' };
    let url = format!("{url_base}{sep}options=-csearch_path%3D{schema}");
    let dir = tempfile::tempdir().unwrap();
    let mut coordinator = start_coordinator(&dir.path().join("coordinator"), &url).await;
    let c = &coordinator;
    let pid = c.child.id();

    let all = enrol(c, clients).await;
    futures_util::stream::iter(&all)
        .for_each_concurrent(64, |client| async move {
            checkin(c, client, 0).await;
        })
        .await;
    let exp = c
        .admin(
            Method::POST,
            "/experiments",
            Some(serde_json::json!({
                "name": "load", "features": features, "classes": classes, "model": "logreg",
                "rounds": 1, "clients_per_round": clients, "min_participants": clients,
                "collect_deadline_seconds": 3600
            })),
        )
        .await;
    let id = exp["id"].as_str().unwrap().to_string();
    c.admin(Method::POST, &format!("/experiments/{id}/start"), None)
        .await;
    let tasks: Vec<serde_json::Value> = futures_util::stream::iter(&all)
        .map(|client| async move {
            loop {
                let reply = checkin(c, client, 10).await;
                if !reply["task"].is_null() {
                    return reply["task"].clone();
                }
            }
        })
        .buffered(64)
        .collect()
        .await;
    let parameters = features * classes + classes;
    let body: axum::body::Bytes = (0..parameters)
        .flat_map(|i| ((i % 97) as f32 * 1e-3).to_le_bytes())
        .collect::<Vec<u8>>()
        .into();
    // Connections are open and idle now; what the coordinator holds before the uploads.
    let (rss_before, _) = memory_mib(pid);

    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0.0f64;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(memory_mib(pid).0);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            peak
        })
    };
    let gate = Arc::new(Semaphore::new(concurrency));
    let start = Instant::now();
    // Each client hangs up after its upload, as a phone would; the coordinator then holds
    // the upload on disk and in the database, not a connection.
    let uploads = all.into_iter().zip(&tasks).map(|(client, task)| {
        let gate = gate.clone();
        let body = body.clone();
        let url = format!(
            "{}/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/update?num_samples=10",
            c.base,
            task["experiment_id"].as_str().unwrap(),
            task["round"],
            task["attempt"]
        );
        async move {
            let _permit = gate.acquire().await.unwrap();
            let sent = Instant::now();
            let r = client
                .http
                .post(url)
                .bearer_auth(&client.credential)
                .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), reqwest::StatusCode::CREATED);
            let latency = sent.elapsed().as_secs_f64();
            drop(r);
            drop(client);
            latency
        }
    });
    let mut latencies: Vec<f64> = futures_util::future::join_all(uploads).await;
    let wall = start.elapsed().as_secs_f64();
    // The round closes once every selected client uploaded; then the job aggregates.
    let aggregating = Instant::now();
    loop {
        let exp = c
            .admin(Method::GET, &format!("/experiments/{id}"), None)
            .await;
        if exp["state"] == "finished" {
            break;
        }
        assert!(aggregating.elapsed() < Duration::from_secs(600));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let aggregate_s = aggregating.elapsed().as_secs_f64();
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let sampled_peak = sampler.await.unwrap();
    let (rss_after, hwm) = memory_mib(pid);
    latencies.sort_by(f64::total_cmp);
    coordinator.child.kill().unwrap();
    coordinator.child.wait().unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}\" CASCADE"
    )))
    .execute(&pg)
    .await
    .unwrap();
    Measured {
        clients,
        concurrency,
        parameters,
        uploads_per_s: clients as f64 / wall,
        p50_ms: percentile(&latencies, 0.5) * 1e3,
        p99_ms: percentile(&latencies, 0.99) * 1e3,
        rss_before_mib: rss_before,
        // VmHWM is the kernel's own high-water mark, which no sampling can miss.
        rss_peak_mib: hwm.max(sampled_peak),
        rss_after_aggregation_mib: rss_after,
        aggregate_s,
    }
}

fn main() {
    let runs: Vec<(usize, usize)> = arg("--runs")
        .unwrap_or_else(|| "100x100,1000x100,1000x1000".into())
        .split(',')
        .map(|r| {
            let (n, c) = r.split_once('x').expect("--runs takes NxC,...");
            (n.parse().unwrap(), c.parse().unwrap())
        })
        .collect();
    let features: usize = arg("--features").map_or(9999, |v| v.parse().unwrap());
    let classes: usize = arg("--classes").map_or(10, |v| v.parse().unwrap());
    let url = std::env::var("COHORT_BENCH_POSTGRES_URL")
        .or_else(|_| std::env::var("COHORT_TEST_POSTGRES_URL"))
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let parameters = features * classes + classes;
    let probe_dir = std::env::temp_dir().join(format!("cohort-probe-{}", std::process::id()));
    let probe = median(
        (0..3)
            .map(|_| durable_write_rate(&probe_dir, parameters * 4, 200))
            .collect(),
    );
    eprintln!("durable {}-byte writes: {probe:.0}/s", parameters * 4);
    eprintln!(
        "{:>8} {:>6} {:>10} {:>8} {:>8} {:>9} {:>9} {:>9} {:>7}",
        "clients",
        "conc",
        "uploads/s",
        "p50 ms",
        "p99 ms",
        "rss MiB",
        "peak MiB",
        "after MiB",
        "agg s"
    );
    for (clients, concurrency) in runs {
        let m = runtime.block_on(run_one(&url, clients, concurrency, features, classes));
        eprintln!(
            "{:>8} {:>6} {:>10.1} {:>8.1} {:>8.1} {:>9.1} {:>9.1} {:>9.1} {:>7.2}",
            m.clients,
            m.concurrency,
            m.uploads_per_s,
            m.p50_ms,
            m.p99_ms,
            m.rss_before_mib,
            m.rss_peak_mib,
            m.rss_after_aggregation_mib,
            m.aggregate_s
        );
        println!(
            "{}",
            serde_json::json!({
                "bench": "upload_load",
                "clients": m.clients,
                "concurrency": m.concurrency,
                "parameters": m.parameters,
                "bytes_per_upload": m.parameters * 4,
                "uploads_per_s": m.uploads_per_s,
                "p50_ms": m.p50_ms,
                "p99_ms": m.p99_ms,
                "rss_before_mib": m.rss_before_mib,
                "rss_peak_mib": m.rss_peak_mib,
                "rss_after_aggregation_mib": m.rss_after_aggregation_mib,
                "aggregate_s": m.aggregate_s,
                "durable_write_per_s": probe,
                "ratio": m.uploads_per_s / probe,
            })
        );
    }
}
