//! Bring your own model and trainer, end to end with real processes over TLS: `cohort
//! serve`, an initial model uploaded as a safetensors file, and `cohort edge --trainer`
//! processes running the users' own programs.
//!
//! What it protects:
//! - a model defined only by a file trains under secure aggregation with the NumPy
//!   example trainer (`examples/numpy_trainer`): the final model's accuracy on the
//!   sites' held-out rows (the example's own evaluation, run here, since no site sends
//!   its metrics in the clear in a secure experiment) reaches 0.85, the coordinator
//!   holds no per-site metric, and the downloaded global model loads in NumPy (the
//!   `safetensors` PyPI package) with the uploaded names and shapes;
//! - every trainer fault (non-zero exit, a hang past the time limit, a renamed or
//!   missing tensor, a wrong shape, NaN weights, a huge file) is caught by the client,
//!   reported to the coordinator as a failed task with its reason, sends nothing, and
//!   the client carries on with the next task.
//!
//! The NumPy test needs `python3` with `numpy` and `safetensors`; it says so and skips
//! without them, unless `COHORT_REQUIRE_NUMPY=1` (CI), where their absence fails it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_coordinator::demo::write_digits_partitions;
use cohort_edge::partition::PartitionScheme;
use common::{ADMIN, admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python_has(modules: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// True when the NumPy test can run; panics when CI requires it and it cannot.
fn numpy_available() -> bool {
    let found = python_has("numpy, safetensors.numpy");
    if !found {
        assert!(
            std::env::var_os("COHORT_REQUIRE_NUMPY").is_none(),
            "COHORT_REQUIRE_NUMPY is set but python3 lacks numpy or safetensors"
        );
        eprintln!("skipped: python3 with numpy and safetensors is not installed");
    }
    found
}

/// Uploads `file` as a model file; its JSON description.
async fn upload_model(http: &reqwest::Client, base: &str, file: &Path) -> serde_json::Value {
    let r = http
        .post(format!("{base}/api/v1/admin/models?name=initial"))
        .bearer_auth(ADMIN)
        .header("content-type", "application/octet-stream")
        .body(std::fs::read(file).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "upload: {}", r.text().await.unwrap());
    r.json().await.unwrap()
}

/// The user's program as `cohort edge` runs it.
struct Trainer<'a> {
    /// `--trainer`.
    command: &'a str,
    /// `--trainer-timeout`, seconds.
    timeout: u64,
}

/// `cohort edge --trainer COMMAND` for site `site`; stderr to `dir/edge-<site>.log`.
fn spawn_trainer_edge(
    site: usize,
    base: &str,
    ca: &Path,
    dir: &Path,
    token: &str,
    trainer: Trainer<'_>,
    idle_exit: u64,
) -> (Child, PathBuf) {
    let log = dir.join(format!("edge-{site}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .arg("edge")
        .arg("--coordinator")
        .arg(base)
        .arg("--ca-cert")
        .arg(ca)
        .arg("--state-dir")
        .arg(dir.join(format!("edge-state-{site}")))
        .arg("--idle-exit")
        .arg(idle_exit.to_string())
        .arg("--seed")
        .arg(site.to_string())
        .arg("--trainer")
        .arg(trainer.command)
        .arg("--trainer-timeout")
        .arg(trainer.timeout.to_string())
        .env("COHORT_ENROL_TOKEN", token)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("cohort edge starts");
    (child, log)
}

fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("edge client did not exit");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The accuracy of `model` on every site's held-out rows, weighted by their number: the
/// example trainer's own evaluation (an `evaluate` task run in `work`), as each site
/// would measure it.
fn held_out_accuracy(example: &Path, model: &Path, csvs: &[PathBuf], work: &Path) -> f64 {
    let (mut correct, mut rows) = (0.0, 0.0);
    for (site, csv) in csvs.iter().enumerate() {
        let dir = work.join(format!("site-{site}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(model, dir.join("global.safetensors")).unwrap();
        let task = serde_json::json!({
            "kind": "evaluate", "round": 0, "seed": 0,
            "hyperparameters": {"feature_scale": 1.0}
        });
        std::fs::write(dir.join("task.json"), task.to_string()).unwrap();
        let out = Command::new("python3")
            .arg(example.join("train.py"))
            .arg("--data")
            .arg(csv)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let result: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("result.json")).unwrap()).unwrap();
        let n = result["num_examples"].as_f64().unwrap();
        correct += result["accuracy"].as_f64().unwrap() * n;
        rows += n;
    }
    correct / rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn numpy_trainers_train_a_file_model_under_secure_aggregation() {
    if !numpy_available() {
        return;
    }
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    const SITES: usize = 5;
    let (csvs, _test) = write_digits_partitions(
        &dir.path().join("sites"),
        SITES,
        &PartitionScheme::Dirichlet { alpha: 1.0 },
        0,
    )
    .unwrap();
    let example = repo().join("examples/numpy_trainer");
    let initial = dir.path().join("initial.safetensors");
    let made = Command::new("python3")
        .arg(example.join("init_model.py"))
        .args(["--features", "64", "--classes", "10", "--hidden", "32"])
        .args(["--seed", "0", "--out"])
        .arg(&initial)
        .status()
        .unwrap();
    assert!(made.success());
    let file = upload_model(&http, &base, &initial).await;
    let tensors = file["tensors"].clone();
    assert_eq!(tensors.as_array().unwrap().len(), 4, "{file}");

    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "bring your own", "model": "file", "initial_model": file["id"],
            "rounds": 10, "clients_per_round": SITES, "min_participants": 4,
            "collect_deadline_seconds": 60,
            "train": {"local_epochs": 2, "batch_size": 32, "lr": 0.1, "momentum": 0.9,
                      "weight_decay": 0.0},
            // The partitions are standardised already: the trainer is told to keep
            // its inputs as they are, through task.json.
            "hyperparameters": {"feature_scale": 1.0},
            "secure_aggregation": {
                "advertise_seconds": 20, "share_seconds": 20, "unmask_seconds": 20
            }
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    assert_eq!(
        exp["spec"]["tensors"], tensors,
        "the coordinator records the tensors"
    );
    let mut edges = Vec::new();
    for (site, csv) in csvs.iter().enumerate() {
        let t = common::issue_token(&http, &base, &format!("site-{site}")).await;
        let trainer = format!(
            "python3 {} --data {}",
            example.join("train.py").display(),
            csv.display()
        );
        edges.push(spawn_trainer_edge(
            site,
            &base,
            &ca,
            dir.path(),
            &t,
            Trainer {
                command: &trainer,
                timeout: 120,
            },
            20,
        ));
    }
    common::wait_checked_in(&http, &base, SITES, Duration::from_secs(60)).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    common::wait_finished(&http, &base, &id, Duration::from_secs(600)).await;

    // Every round was secure and published, and no site sent a metric of its own: the
    // coordinator holds no evaluation, and hands out no evaluation task.
    let rounds = common::rounds(&http, &base, &id).await;
    let published: Vec<_> = rounds
        .iter()
        .filter(|r| r["stage"] == "published")
        .collect();
    assert_eq!(published.len(), 10, "{rounds:#?}");
    assert!(published.iter().all(|r| r["secagg"].is_object()));
    assert!(
        published
            .iter()
            .all(|r| r.get("client_evaluation").is_none()),
        "{rounds:#?}"
    );
    let evaluations = admin(
        &http,
        &base,
        Method::GET,
        &format!("/experiments/{id}/evaluations"),
        None,
    )
    .await;
    assert_eq!(evaluations, serde_json::json!([]));

    // The global model, downloaded as safetensors, loads in NumPy with the uploaded
    // names and shapes.
    let r = http
        .get(format!(
            "{base}/api/v1/admin/experiments/{id}/model.safetensors"
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let downloaded = dir.path().join("global.safetensors");
    std::fs::write(&downloaded, r.bytes().await.unwrap()).unwrap();
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import json, sys\n\
             from safetensors.numpy import load_file\n\
             t = load_file(sys.argv[1])\n\
             assert all(v.dtype.name == 'float32' for v in t.values())\n\
             print(json.dumps({k: list(v.shape) for k, v in t.items()}))",
        )
        .arg(&downloaded)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let loaded: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&out.stdout).unwrap();
    for t in tensors.as_array().unwrap() {
        assert_eq!(
            loaded[t["name"].as_str().unwrap()],
            t["shape"],
            "{loaded:?}"
        );
    }
    assert_eq!(loaded.len(), 4);

    // What the sites would have measured on their held-out rows, measured here.
    let work = dir.path().join("evaluation");
    let first = held_out_accuracy(&example, &initial, &csvs, &work.join("initial"));
    let last = held_out_accuracy(&example, &downloaded, &csvs, &work.join("final"));
    eprintln!("held-out accuracy over the sites: initial {first:.4}, final {last:.4}");
    assert!(last >= 0.85, "final accuracy {last}");
    assert!(last > first + 0.3, "the model improved: {first} -> {last}");

    for (mut child, log) in edges {
        let status = wait_exit(&mut child, Duration::from_secs(90));
        assert!(
            status.success(),
            "edge failed: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    server.kill().unwrap();
    server.wait().unwrap();
}

/// A model of two tensors, the first (by name) two-dimensional, as safetensors.
fn tiny_model(path: &Path) {
    use cohort_aggregation::{Layout, ModelVector, TensorSpec};
    let layout = Layout::new(vec![
        TensorSpec::new("a.weight", [2, 3]),
        TensorSpec::new("b.bias", [2]),
    ])
    .unwrap();
    let v = ModelVector::new(std::sync::Arc::new(layout), vec![0.5; 8]).unwrap();
    let bytes = cohort_aggregation::model_file::encode(&v, Default::default());
    std::fs::write(path, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn trainer_faults_are_reported_and_the_client_carries_on() {
    if !python_has("json") {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    let initial = dir.path().join("tiny.safetensors");
    tiny_model(&initial);
    let file = upload_model(&http, &base, &initial).await;
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "faults", "model": "file", "initial_model": file["id"],
            "rounds": 8, "clients_per_round": 2, "min_participants": 1,
            "collect_deadline_seconds": 60, "max_round_attempts": 1
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let script = repo().join("coordinator/tests/fixtures/faulty_trainer.py");
    let good = format!("python3 {}", script.display());
    let faulty = format!("python3 {} --fault-by-round", script.display());
    let t0 = common::issue_token(&http, &base, "good").await;
    let t1 = common::issue_token(&http, &base, "faulty").await;
    let mut good_edge = spawn_trainer_edge(
        0,
        &base,
        &ca,
        dir.path(),
        &t0,
        Trainer {
            command: &good,
            timeout: 20,
        },
        15,
    );
    let mut faulty_edge = spawn_trainer_edge(
        1,
        &base,
        &ca,
        dir.path(),
        &t1,
        Trainer {
            command: &faulty,
            timeout: 3,
        },
        15,
    );
    common::wait_checked_in(&http, &base, 2, Duration::from_secs(60)).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    common::wait_finished(&http, &base, &id, Duration::from_secs(300)).await;

    let faulty_id = std::fs::read_to_string(dir.path().join("edge-state-1/credential.json"))
        .map(|t| serde_json::from_str::<serde_json::Value>(&t).unwrap()["client_id"].clone())
        .unwrap();
    let rounds = common::rounds(&http, &base, &id).await;
    let expected = [
        (1, "exited with"),
        (2, "time limit of 3 s"),
        (3, "tensor `renamed.a.weight` is not part of the model"),
        (4, "tensor `a.weight` is missing"),
        (5, "tensor `a.weight` has shape [6], expected [2, 3]"),
        (6, "non-finite value"),
        (7, "update.safetensors is 67108864 bytes, more than"),
    ];
    for (round, words) in expected {
        let r = rounds
            .iter()
            .find(|r| r["round"] == round && r["stage"] == "published")
            .unwrap_or_else(|| panic!("round {round} published: {rounds:#?}"));
        assert_eq!(
            r["reported"], 1,
            "round {round}: only the good client uploaded"
        );
        let failures = r["failures"].as_array().unwrap();
        assert_eq!(failures.len(), 1, "round {round}: {failures:?}");
        assert_eq!(failures[0]["client_id"], faulty_id);
        let reason = failures[0]["reason"].as_str().unwrap();
        assert!(reason.contains(words), "round {round}: `{reason}`");
        // Nothing the faulty client sent for this round was stored.
        let detail = admin(
            &http,
            &base,
            Method::GET,
            &format!("/experiments/{id}/rounds/{round}/attempts/1"),
            None,
        )
        .await;
        let faulty_part = detail["participants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["client_id"] == faulty_id)
            .unwrap();
        assert_ne!(
            faulty_part["state"], "uploaded",
            "round {round}: {faulty_part}"
        );
    }
    // Round 1's reason carries the program's own last words.
    let round1 = rounds.iter().find(|r| r["round"] == 1).unwrap();
    assert!(
        round1["failures"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("something went wrong in the user's code")
    );
    // After seven faults the client still trains: round 8 has both uploads.
    let last = rounds.iter().find(|r| r["round"] == 8).unwrap();
    assert_eq!(last["reported"], 2, "{last}");
    assert!(last["failures"].as_array().unwrap().is_empty());

    for (child, log) in [&mut good_edge, &mut faulty_edge] {
        let status = wait_exit(child, Duration::from_secs(60));
        let text = std::fs::read_to_string(&*log).unwrap_or_default();
        assert!(status.success(), "edge failed: {text}");
    }
    let faulty_log = std::fs::read_to_string(&faulty_edge.1).unwrap();
    assert!(faulty_log.contains("cohort-edge: trainer: faulty trainer: round 1 fault 1"));
    assert_eq!(faulty_log.matches("task failed").count(), 7, "{faulty_log}");
    // The hung trainer was killed with its process group: no sleeper survives.
    let ps = Command::new("ps").args(["-eo", "args"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&ps.stdout).contains("--fault-by-round"),
        "a trainer outlived its task"
    );
    server.kill().unwrap();
    server.wait().unwrap();
}
