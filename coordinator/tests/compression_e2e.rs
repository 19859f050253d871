//! Compression in `cohort serve`, end to end: a real coordinator, in-process edge agents
//! (`run_agent`, what `cohort-edge`, the Python SDK and the C API run) and real TLS.
//!
//! What it protects:
//! - a compressed experiment's clients download their own compressed copy of the model
//!   and upload a compressed difference from it; the coordinator moves its exact model
//!   by the mean of what it decodes, and records every client's bytes each way, which
//!   are the schemes' sizes (a fraction of 32-bit floats);
//! - `topk` keeps the error-feedback residual in the client's state directory;
//! - under secure aggregation, 4-bit uploads travel masked in 8-bit words (3 clients'
//!   sum fits), a quarter of today's 32-bit masked words, and the round still unmasks
//!   the sum;
//! - an upload that is not what the experiment asked for (plain floats, another scheme,
//!   another rotation) is refused 422 with the decoder's reason and changes nothing;
//! - settings that cannot work are refused when the experiment is created, naming the
//!   setting.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cohort_aggregation::compress::{Compression, Expected};
use cohort_aggregation::{Layout, ModelVector, TensorSpec};
use cohort_edge::agent::{AgentConfig, run_agent};
use cohort_edge::protocol::{CoordinatorClient, TaskKind, UploadForm};
use cohort_edge::trainer::{TaskTrainer, TrainerFailure, TrainerJob, TrainerOutput};
use common::{Served, admin};
use reqwest::Method;

/// Parameters of the test model: one 64 x 64 tensor.
const D: usize = 4096;

/// What every client's training adds to the model it received.
fn step(i: usize) -> f32 {
    0.01 * ((i as f32) * 0.37).sin()
}

/// Trains by adding [`step`] to the model it received.
#[derive(Debug)]
struct SteppingTrainer;

impl TaskTrainer for SteppingTrainer {
    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let update = match job.task.kind {
            TaskKind::Train => {
                let values = job
                    .global
                    .values()
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v + step(i))
                    .collect();
                Some(
                    ModelVector::new(job.global.layout().clone(), values)
                        .map_err(|e| TrainerFailure::new(e.to_string()))?,
                )
            }
            TaskKind::Evaluate => None,
        };
        Ok(TrainerOutput {
            update,
            num_examples: 50,
            train_loss: Some(0.5),
            evaluation: None,
        })
    }
}

fn initial_values() -> Vec<f32> {
    (0..D).map(|i| ((i % 97) as f32 - 48.0) / 100.0).collect()
}

async fn upload_model(server: &Served) -> String {
    let layout = Layout::new(vec![TensorSpec::new("layer.weight", [64, 64])]).unwrap();
    let initial = ModelVector::new(Arc::new(layout), initial_values()).unwrap();
    let bytes = cohort_aggregation::model_file::encode(&initial, Default::default());
    let r = server
        .http
        .post(format!("{}/api/v1/admin/models?name=initial", server.base))
        .bearer_auth(common::ADMIN)
        .header("content-type", "application/octet-stream")
        .body(bytes)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "upload: {}", r.text().await.unwrap());
    r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Creates an experiment of `rounds` rounds of 3 clients on the test model with `extra`
/// merged into its spec.
async fn experiment(server: &Served, rounds: u32, extra: serde_json::Value) -> String {
    let model = upload_model(server).await;
    let mut spec = serde_json::json!({
        "name": "compression", "model": "file", "initial_model": model,
        "rounds": rounds, "clients_per_round": 3, "min_participants": 3,
        "collect_deadline_seconds": 60, "max_round_attempts": 2
    });
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    let exp = admin(
        &server.http,
        &server.base,
        Method::POST,
        "/experiments",
        Some(spec),
    )
    .await;
    exp["id"].as_str().unwrap().to_string()
}

fn agent(server: &Served, dir: &Path, token: String, seed: u64) -> AgentConfig {
    AgentConfig {
        coordinator: server.base.clone(),
        insecure_http: false,
        ca_pem: Some(server.ca_pem.clone()),
        identity_pem: None,
        enrol_token: Some(token),
        trainer: Arc::new(SteppingTrainer),
        state_dir: dir.to_path_buf(),
        idle_exit: Some(Duration::from_secs(4)),
        seed,
        local_dp: None,
        slowdown: Duration::ZERO,
        floors: cohort_aggregation::secagg::ClientFloors::default(),
        rules: Default::default(),
    }
}

/// Runs three agents (state under `dir/agent-{i}`) on experiment `id` to its end.
async fn run_three(server: &Served, dir: &Path, id: &str) {
    let mut agents = Vec::new();
    for i in 0..3 {
        let token = common::issue_token(&server.http, &server.base, &format!("site-{i}")).await;
        let config = agent(server, &dir.join(format!("agent-{i}")), token, i);
        agents.push(tokio::spawn(run_agent(config)));
    }
    common::wait_checked_in(&server.http, &server.base, 3, Duration::from_secs(30)).await;
    admin(
        &server.http,
        &server.base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    common::wait_finished(&server.http, &server.base, id, Duration::from_secs(90)).await;
    for agent in agents {
        tokio::time::timeout(Duration::from_secs(60), agent)
            .await
            .expect("the agent goes idle and returns")
            .unwrap()
            .expect("the agent runs without error");
    }
}

/// Every participation of round `round`'s first attempt.
async fn participants(server: &Served, id: &str, round: i64) -> Vec<serde_json::Value> {
    let path = format!("/experiments/{id}/rounds/{round}/attempts/1");
    let detail = admin(&server.http, &server.base, Method::GET, &path, None).await;
    detail["participants"].as_array().unwrap().clone()
}

async fn final_model(server: &Served, id: &str) -> Vec<f32> {
    let path = format!("/experiments/{id}/model");
    common::admin_bytes(&server.http, &server.base, &path)
        .await
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compressed_rounds_count_their_bytes_and_move_the_model_by_what_was_sent() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let q8 = Compression::Quantize { bits: 8 };
    let id = experiment(
        &server,
        2,
        serde_json::json!({"compression": {"upload": "quantize:8", "download": "quantize:8"}}),
    )
    .await;
    run_three(&server, dir.path(), &id).await;
    for round in [1, 2] {
        let parts = participants(&server, &id, round).await;
        assert_eq!(parts.len(), 3);
        for p in &parts {
            assert_eq!(p["state"], "uploaded", "{p}");
            assert_eq!(p["bytes_up"], q8.encoded_len(D) as u64, "{p}");
            assert_eq!(p["bytes_down"], q8.encoded_len(D) as u64, "{p}");
        }
        // A quarter of the floats, and the 24-byte header and one range per block.
        assert!((q8.encoded_len(D) as f64) < 0.26 * (4 * D) as f64);
    }
    // Each round moved the exact model by the mean of the decoded differences: the
    // clients' step, off by 8-bit rounding of a difference whose rotated values span
    // about 0.004 (a step of 2e-5) plus the decoded model's own rounding in the
    // difference (none: each client's difference is from its own decoded copy).
    let model = final_model(&server, &id).await;
    let initial = initial_values();
    for i in 0..D {
        let moved = model[i] - initial[i];
        assert!(
            (moved - 2.0 * step(i)).abs() < 2e-3,
            "parameter {i}: moved {moved}, expected {}",
            2.0 * step(i)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn topk_uploads_keep_their_residual_in_the_state_directory() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let top = Compression::TopK { fraction: 0.01 };
    let id = experiment(
        &server,
        1,
        serde_json::json!({"compression": {"upload": "topk:0.01"}}),
    )
    .await;
    run_three(&server, dir.path(), &id).await;
    for p in participants(&server, &id, 1).await {
        let up = p["bytes_up"].as_u64().unwrap() as usize;
        // 41 coordinates: their gaps (one or two bytes) and values, and the header.
        assert!(up <= top.encoded_len(D) && up < (4 * D) / 50, "{p}");
        assert_eq!(p["bytes_down"], (4 * D) as u64, "models go plain: {p}");
    }
    for i in 0..3 {
        let residual = dir.path().join(format!("agent-{i}/feedback/{id}.f32"));
        let bytes = std::fs::read(&residual).unwrap();
        assert_eq!(bytes.len(), 4 * D, "{}", residual.display());
        let kept = bytes.chunks_exact(4).filter(|c| *c != [0u8; 4]).count();
        // Every non-zero step that was not among the largest waits (step(0) is 0).
        let moved = (0..D).filter(|&i| step(i) != 0.0).count();
        assert_eq!(kept, moved - top.kept(D), "what was not sent is kept");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secure_rounds_mask_four_bit_uploads_in_narrow_words() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let id = experiment(
        &server,
        1,
        serde_json::json!({
            "compression": {"upload": "quantize:4"},
            // The weight scales each value before it is rounded to 4 bits: a cap near
            // the clients' sample counts (50) keeps the values' range in use.
            "secure_aggregation": {"clip": 0.05, "max_weight": 50}
        }),
    )
    .await;
    run_three(&server, dir.path(), &id).await;
    for p in participants(&server, &id, 1).await {
        // 3 clients x 15 levels fit a byte: D one-byte words and the 32-bit weight and
        // loss words, against 4 (D + 2) bytes in 32-bit words.
        assert_eq!(p["bytes_up"], (D + 8) as u64, "{p}");
        assert_eq!(p["secagg_stage"], "unmasked", "{p}");
    }
    let model = final_model(&server, &id).await;
    let initial = initial_values();
    // The secure mean of 4-bit values over a clip of 0.05: rounding moves each rotated
    // coordinate of each client by up to a step of 0.1 / 15, about a third of that on
    // average, and the mean of three shrinks it by sqrt(3): an error of norm about 0.12
    // against the step's 0.45.
    let err = model
        .iter()
        .zip(&initial)
        .enumerate()
        .map(|(i, (m, x))| (m - x - step(i)).powi(2))
        .sum::<f32>()
        .sqrt();
    let norm = (0..D).map(|i| step(i).powi(2)).sum::<f32>().sqrt();
    assert!(
        err < 0.5 * norm,
        "error {err} against a step of norm {norm}"
    );
}

/// An upload that is not what the experiment asked for is refused with the decoder's
/// reason, and the round still takes the right one afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_that_is_not_the_experiments_compression_is_422() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let id = experiment(
        &server,
        1,
        serde_json::json!({"min_participants": 1, "clients_per_round": 1,
            "compression": {"upload": "quantize:4", "download": "quantize:8"}}),
    )
    .await;
    let client = CoordinatorClient::new(&server.base, Some(&server.ca_pem)).unwrap();
    let token = common::issue_token(&server.http, &server.base, "scripted").await;
    let identity = cohort_aggregation::secagg::identity::Identity::generate().unwrap();
    let cred = client.enrol(&token, &identity.public()).await.unwrap();
    client.checkin(&cred, 0).await.unwrap();
    admin(
        &server.http,
        &server.base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let task = loop {
        if let Some(task) = client.checkin(&cred, 5).await.unwrap() {
            break task;
        }
    };
    assert_eq!(task.upload, UploadForm::CompressedDifference);
    let compression = task.compression.expect("the task says how to compress");
    assert_eq!(compression.upload, Compression::Quantize { bits: 4 });
    let layout = Arc::new(Layout::new(vec![TensorSpec::new("layer.weight", [64, 64])]).unwrap());
    let received = client
        .model(&cred, task.experiment_id, &layout)
        .await
        .unwrap();
    // The download was 8-bit: close to the model, not equal to it (the rotated model
    // spans about 2.4, a step of 0.01).
    let off = received
        .values()
        .iter()
        .zip(initial_values())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(off > 0.0 && off < 0.03, "{off}");
    let difference = vec![0.001f32; D];
    let right = compression
        .upload
        .encode(&difference, compression.upload_rotation_seed, 1)
        .unwrap();
    let refused = |body: Vec<u8>, says: &'static str| {
        let (client, cred, task) = (&client, &cred, &task);
        async move {
            let e = client
                .upload_body(cred, task, body, 50, 0.5, uuid::Uuid::new_v4())
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains("422") && e.contains(says), "{e}");
        }
    };
    let plain: Vec<u8> = difference.iter().flat_map(|v| v.to_le_bytes()).collect();
    refused(plain, "does not start with").await;
    let eight = Compression::Quantize { bits: 8 }
        .encode(&difference, compression.upload_rotation_seed, 1)
        .unwrap();
    refused(eight, "says quantize:8, the experiment asks for quantize:4").await;
    let rotated_elsewhere = compression
        .upload
        .encode(&difference, compression.upload_rotation_seed ^ 1, 1)
        .unwrap();
    refused(rotated_elsewhere, "rotated with seed").await;
    let mut short = right.clone();
    short.pop();
    refused(short, "bytes").await;
    client
        .upload_body(&cred, &task, right.clone(), 50, 0.5, uuid::Uuid::new_v4())
        .await
        .unwrap();
    let parts = participants(&server, &id, 1).await;
    assert_eq!(parts[0]["bytes_up"], right.len() as u64);
    // The stored upload is the decoded difference added to the exact model.
    let decoded = compression
        .upload
        .decode(
            &right,
            &Expected {
                dimension: D,
                rotation_seed: Some(compression.upload_rotation_seed),
            },
        )
        .unwrap();
    common::wait_finished(&server.http, &server.base, &id, Duration::from_secs(30)).await;
    let model = final_model(&server, &id).await;
    for (i, (m, x)) in model.iter().zip(initial_values()).enumerate() {
        assert!((m - (x + decoded[i])).abs() < 1e-6, "parameter {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_that_cannot_work_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let model = upload_model(&server).await;
    for (compression, secure, says) in [
        (
            serde_json::json!({"upload": "quantize:3"}),
            false,
            "1, 2, 4 or 8",
        ),
        (
            serde_json::json!({"download": "topk:0.1"}),
            false,
            "compression.download",
        ),
        (
            serde_json::json!({"download": "quantize:2"}),
            false,
            "too coarse",
        ),
        (
            serde_json::json!({"upload": "topk:0.01"}),
            true,
            "cannot run under secure aggregation",
        ),
        (
            serde_json::json!({"upload": "sign"}),
            true,
            "use quantize:1",
        ),
        (
            serde_json::json!({"upload": "quantize:8", "word_bits": 8}),
            true,
            "8-bit word is too narrow for 3 clients at 8 bits",
        ),
        (
            serde_json::json!({"upload": "quantize:4", "word_bits": 16}),
            false,
            "needs secure_aggregation",
        ),
    ] {
        let mut spec = serde_json::json!({
            "name": "refused", "model": "file", "initial_model": model, "rounds": 1,
            "clients_per_round": 3, "min_participants": 3, "compression": compression,
        });
        if secure {
            spec["secure_aggregation"] = serde_json::json!({});
        }
        let r = server
            .http
            .post(format!("{}/api/v1/admin/experiments", server.base))
            .bearer_auth(common::ADMIN)
            .json(&spec)
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body = r.text().await.unwrap();
        assert_eq!(status, 422, "{compression}: {body}");
        assert!(body.contains(says), "{compression}: {body}");
    }
    let listed = admin(
        &server.http,
        &server.base,
        Method::GET,
        "/experiments",
        None,
    )
    .await;
    assert!(listed.as_array().unwrap().is_empty(), "nothing was created");
}
