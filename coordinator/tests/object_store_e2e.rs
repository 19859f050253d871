//! Blobs in an object store, against a real S3-compatible server on loopback (`moto` in
//! server mode, from PyPI), as `cohort serve --blob-store s3://bucket/prefix` uses it.
//!
//! What it protects:
//! - the store keeps the directory store's promises in a bucket: a blob round-trips,
//!   a damaged one fails its checksum, a blob written in pieces is a multipart upload
//!   (several parts) that is invisible until committed, and a writer dropped before
//!   that leaves no object;
//! - a served experiment runs with every upload and model in the bucket and no blob
//!   directory at all; a bucket that does not exist stops start-up with its name.
//!
//! Needs moto's server: `moto_server` of the virtual environment `COHORT_MOTO_VENV`
//! names, else on the PATH. Skipped without it, unless `COHORT_REQUIRE_MOTO=1` (CI).

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use cohort_coordinator::blobs::BlobStore;
use cohort_coordinator::blobs::object::{ObjectBlobs, PART_BYTES};
use cohort_edge::agent::{AgentConfig, run_agent};
use cohort_edge::trainer::BuiltInTrainer;
use common::admin;
use reqwest::Method;

/// The store's promises, in a real bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_keeps_the_directory_stores_promises() {
    let Some(s3) = common::S3::with_bucket("promises").await else {
        return;
    };
    let runtime = tokio::runtime::Handle::current();
    let vars: Vec<(String, String)> = s3.env().into_iter().map(|(k, v)| (k.into(), v)).collect();
    let blobs = tokio::task::spawn_blocking(move || {
        ObjectBlobs::open_with("s3://promises/deployment-a", vars, runtime).map(BlobStore::Object)
    })
    .await
    .unwrap()
    .unwrap();

    let store = blobs.clone();
    let (info, pieces, big_bytes) = tokio::task::spawn_blocking(move || {
        let info = store.put("models/e/1.bin", b"weights").unwrap();
        assert_eq!(store.get("models/e/1.bin").unwrap(), b"weights");
        assert_eq!(
            store.get_verified(&info.path, &info.sha256).unwrap(),
            b"weights"
        );
        // Damaged in the bucket: the recorded checksum catches it.
        store.put("models/e/1.bin", b"weightz").unwrap();
        assert!(store.get_verified(&info.path, &info.sha256).is_err());
        for bad in ["", "../x", "/etc/passwd", "a/../../x"] {
            assert!(store.put(bad, b"x").is_err(), "{bad}");
        }
        // Two and a half parts, in uneven pieces.
        let big: Vec<u8> = (0..PART_BYTES * 5 / 2).map(|i| (i % 251) as u8).collect();
        let mut w = store.writer("uploads/e/1-1/c.bin").unwrap();
        for piece in big.chunks(3_000_001) {
            w.write(piece).unwrap();
        }
        assert!(
            store.get("uploads/e/1-1/c.bin").is_err(),
            "not visible before commit"
        );
        let pieces = w.commit().unwrap();
        let whole = store.put("uploads/e/1-1/whole.bin", &big).unwrap();
        assert_eq!((pieces.bytes, pieces.sha256), (whole.bytes, whole.sha256));
        assert_eq!(store.get("uploads/e/1-1/c.bin").unwrap(), big);
        // A writer dropped before its commit leaves nothing.
        let mut w = store.writer("uploads/e/1-1/dropped.bin").unwrap();
        w.write(&big[..PART_BYTES + 10]).unwrap();
        drop(w);
        assert!(store.get("uploads/e/1-1/dropped.bin").is_err());
        (info, pieces, big.len())
    })
    .await
    .unwrap();
    assert_eq!(info.path, "models/e/1.bin");
    assert_eq!(pieces.bytes as usize, big_bytes);
    let mut keys = s3.keys("promises", "deployment-a/").await;
    keys.sort();
    assert_eq!(
        keys,
        [
            "deployment-a/models/e/1.bin",
            "deployment-a/uploads/e/1-1/c.bin",
            "deployment-a/uploads/e/1-1/whole.bin"
        ],
        "the probe and the dropped upload left nothing"
    );
}

fn agent(server: &common::Served, dir: &Path, token: String, i: usize) -> AgentConfig {
    let trainer = Arc::new(BuiltInTrainer::new(common::blob_data(30, i as f32)));
    common::agent_config(
        server,
        dir,
        token,
        trainer,
        i as u64,
        Duration::from_secs(4),
    )
}

/// A served experiment with its blobs in the bucket and none on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_served_experiment_keeps_every_blob_in_the_bucket() {
    let Some(server) = common::moto_server() else {
        return;
    };
    let s3 = common::S3::start(&server).await;
    let dir = tempfile::tempdir().unwrap();

    // A bucket that does not exist stops start-up, naming it.
    let mut env: Vec<(&str, String)> = s3.env();
    env.push(("COHORT_BLOB_STORE", "s3://missing-bucket/x".into()));
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "serve",
            "--dev-tls",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path().join("refused"))
        .env("COHORT_ADMIN_TOKEN", common::ADMIN)
        .envs(pairs.iter().copied())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("s3://missing-bucket/x"), "{stderr}");

    s3.bucket("cohort").await;
    let mut env = s3.env();
    env.push(("COHORT_BLOB_STORE", "s3://cohort/site-a".into()));
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = common::serve_in_with(dir.path(), &pairs).await;
    let spec = serde_json::json!({
        "name": "in a bucket", "features": 4, "classes": 2, "model": "mlp:8",
        "rounds": 3, "clients_per_round": 3, "min_participants": 3,
        "collect_deadline_seconds": 60, "max_round_attempts": 2
    });
    let id = common::create_experiment(&server.http, &server.base, spec).await;
    let mut agents = Vec::new();
    for i in 0..3 {
        let token = common::issue_token(&server.http, &server.base, &format!("s{i}")).await;
        let config = agent(&server, &dir.path().join(format!("agent-{i}")), token, i);
        agents.push(tokio::spawn(run_agent(config)));
    }
    common::wait_checked_in(&server.http, &server.base, 3, Duration::from_secs(30)).await;
    let path = format!("/experiments/{id}/start");
    admin(&server.http, &server.base, Method::POST, &path, None).await;
    common::wait_finished(&server.http, &server.base, &id, Duration::from_secs(120)).await;
    for agent in agents {
        let report = tokio::time::timeout(Duration::from_secs(60), agent)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(report.uploads, 3, "{report:?}");
    }
    let keys = s3.keys("cohort", "site-a/").await;
    let uploads = keys
        .iter()
        .filter(|k| k.starts_with(&format!("site-a/uploads/{id}/")))
        .count();
    assert_eq!(uploads, 9, "3 rounds x 3 clients: {keys:?}");
    assert!(
        keys.iter().any(|k| k.starts_with("site-a/models/")),
        "the published models are in the bucket: {keys:?}"
    );
    assert!(
        !server.data_dir.join("blobs").exists(),
        "no blob directory on disk"
    );
    // The final model is served from the bucket.
    let path = format!("/experiments/{id}/model.safetensors");
    let file = common::admin_bytes(&server.http, &server.base, &path).await;
    cohort_aggregation::model_file::decode(&file, 1 << 20).unwrap();
}
