//! Experiment tracking in MLflow, end to end: a real MLflow tracking server (`mlflow
//! server` on loopback, its own SQLite store and artifact directory), a real `cohort
//! serve --mlflow-uri --tensorboard` and in-process edge agents training the built-in
//! MLP on the shipped digits. Read back through MLflow's own Python client.
//!
//! What it protects:
//! - a served experiment's parameters, every round's metrics (accuracy, losses,
//!   participants, dropouts, bytes) and its final model reach MLflow, in one run named
//!   after the experiment, which ends FINISHED;
//! - MLflow stopped for several rounds stalls nothing: the rounds go on, `/metrics`
//!   shows the records waiting and the failed tries, and once MLflow is back the
//!   missing points arrive, none dropped;
//! - the same records reach TensorBoard event files.
//!
//! Needs `mlflow` (the server and client): the Python named by `COHORT_MLFLOW_PYTHON`,
//! else `python3`. Skipped without it, unless `COHORT_REQUIRE_MLFLOW=1` (CI, which
//! installs it in a virtual environment of its own).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_edge::agent::{AgentConfig, run_agent};
use cohort_edge::trainer::BuiltInTrainer;
use common::{ADMIN, admin};
use reqwest::Method;

const CLIENTS: usize = 3;
const ROUNDS: i64 = 8;

fn mlflow_python() -> Option<PathBuf> {
    let python = std::env::var_os("COHORT_MLFLOW_PYTHON")
        .map_or_else(|| PathBuf::from("python3"), PathBuf::from);
    let found = Command::new(&python)
        .args(["-c", "import mlflow.server"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("COHORT_REQUIRE_MLFLOW").is_none(),
            "COHORT_REQUIRE_MLFLOW is set but {} cannot import mlflow",
            python.display()
        );
        eprintln!("skipped: mlflow is not installed (pip install mlflow)");
    }
    found.then_some(python)
}

/// `mlflow server` on `port`, in a process group of its own (it runs its web server
/// as a child process, which must go with it).
struct MlflowServer(Child);

impl MlflowServer {
    fn start(python: &Path, dir: &Path, port: u16) -> Self {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("mlflow.log"))
            .unwrap();
        let child = Command::new(python)
            .args(["-m", "mlflow", "server", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            .arg("--artifacts-destination")
            .arg(dir.join("artifacts"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("mlflow server starts");
        Self(child)
    }

    /// A server with its store in `dir/mlflow`, on a free port, up: the server, that
    /// directory, the port and the address.
    async fn launch(python: &Path, dir: &Path) -> (Self, PathBuf, u16, String) {
        let mlflow_dir = dir.join("mlflow");
        std::fs::create_dir_all(&mlflow_dir).unwrap();
        let port = common::free_port();
        let uri = format!("http://127.0.0.1:{port}");
        let server = Self::start(python, &mlflow_dir, port);
        wait_mlflow(&uri, &mlflow_dir).await;
        (server, mlflow_dir, port, uri)
    }

    fn stop(&mut self) {
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["-9", "--", &group]).status();
        let _ = self.0.wait();
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn wait_mlflow(base: &str, dir: &Path) {
    cohort_coordinator::server::install_crypto_provider();
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(r) = http.get(format!("{base}/health")).send().await
            && r.status().is_success()
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "mlflow server did not come up: {}",
            std::fs::read_to_string(dir.join("mlflow.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Client `i`'s digits: every third sample from the `i`-th.
fn shard(i: usize) -> cohort_edge::data::Dataset {
    let all = cohort_edge::data::digits();
    let mine: Vec<usize> = (i..all.len()).step_by(CLIENTS).collect();
    all.subset(&mine)
}

fn agent(server: &common::Served, dir: &Path, token: String, i: usize) -> AgentConfig {
    let trainer = Arc::new(BuiltInTrainer::new(shard(i)));
    AgentConfig {
        // Rounds of a second or more, so that an outage spans several.
        slowdown: Duration::from_millis(400),
        ..common::agent_config(
            server,
            dir,
            token,
            trainer,
            i as u64,
            Duration::from_secs(5),
        )
    }
}

async fn published(server: &common::Served, id: &str) -> Vec<serde_json::Value> {
    common::rounds(&server.http, &server.base, id)
        .await
        .into_iter()
        .filter(|r| r["stage"] == "published")
        .collect()
}

async fn wait_published(server: &common::Served, id: &str, n: usize, limit: Duration) {
    let deadline = Instant::now() + limit;
    while published(server, id).await.len() < n {
        assert!(
            Instant::now() < deadline,
            "round {n} not published in {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn metrics_text(server: &common::Served) -> String {
    server
        .http
        .get(format!("{}/metrics", server.base))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of the sample of `/metrics` whose name and labels start with `prefix`.
fn sample(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in:\n{text}"))
}

/// Prints as JSON the run with key `argv[3]` (`-`: the only one) in experiment `argv[2]` of the server at
/// `argv[1]`: status, parameters, every metric's history, and where its model was
/// downloaded to (under `argv[4]`).
const READ: &str = r#"
import json, sys
import mlflow
from mlflow.tracking import MlflowClient
uri, name, key, dst = sys.argv[1:5]
client = MlflowClient(tracking_uri=uri)
exp = client.get_experiment_by_name(name)
where = "" if key == "-" else f"tags.`cohort.run_key` = '{key}'"
runs = client.search_runs([exp.experiment_id], filter_string=where)
run = runs[0]
out = {"runs": len(runs), "name": run.info.run_name, "status": run.info.status,
       "params": run.data.params, "metrics": {}}
for metric in run.data.metrics:
    history = client.get_metric_history(run.info.run_id, metric)
    out["metrics"][metric] = sorted([m.step, m.value] for m in history)
out["artifacts"] = [a.path for a in client.list_artifacts(run.info.run_id)]
if "model.safetensors" in out["artifacts"]:
    out["model"] = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="model.safetensors", dst_path=dst,
        tracking_uri=uri)
print(json.dumps(out))
"#;

fn read_run(python: &Path, uri: &str, name: &str, key: &str, dst: &Path) -> serde_json::Value {
    let out = Command::new(python)
        .args(["-c", READ, uri, name, key])
        .arg(dst)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mlflow_gets_every_round_and_the_model_even_across_an_outage() {
    let Some(python) = mlflow_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (mut mlflow, mlflow_dir, port, uri) = MlflowServer::launch(&python, dir.path()).await;

    let board = dir.path().join("board");
    let eval = common::repo().join("data/digits.csv.gz");
    let server = common::serve_in_with(
        dir.path(),
        &[
            ("COHORT_MLFLOW_URI", uri.as_str()),
            ("COHORT_TENSORBOARD", board.to_str().unwrap()),
            ("COHORT_EVAL_DATA", eval.to_str().unwrap()),
        ],
    )
    .await;
    let spec = serde_json::json!({
        "name": "tracked digits", "model": "mlp:16", "features": 64, "classes": 10,
        "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": CLIENTS,
        "collect_deadline_seconds": 120, "max_round_attempts": 2,
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.9},
    });
    let id = common::create_experiment(&server.http, &server.base, spec).await;
    let mut agents = Vec::new();
    for i in 0..CLIENTS {
        let token = common::issue_token(&server.http, &server.base, &format!("site-{i}")).await;
        let config = agent(&server, &dir.path().join(format!("agent-{i}")), token, i);
        agents.push(tokio::spawn(run_agent(config)));
    }
    common::wait_checked_in(&server.http, &server.base, CLIENTS, Duration::from_secs(30)).await;
    let path = format!("/experiments/{id}/start");
    admin(&server.http, &server.base, Method::POST, &path, None).await;

    // MLflow goes down after round 2 and stays down for three more rounds.
    wait_published(&server, &id, 2, Duration::from_secs(120)).await;
    mlflow.stop();
    let down = published(&server, &id).await.len();
    wait_published(&server, &id, down + 3, Duration::from_secs(120)).await;
    let during = metrics_text(&server).await;
    assert!(
        sample(&during, "cohort_tracking_queued{sink=\"mlflow\"}") >= 3.0,
        "the rounds published while MLflow was down wait: {during}"
    );
    assert!(sample(&during, "cohort_tracking_retries_total{sink=\"mlflow\"}") >= 1.0);
    let mut mlflow = MlflowServer::start(&python, &mlflow_dir, port);
    wait_mlflow(&uri, &mlflow_dir).await;
    common::wait_finished(&server.http, &server.base, &id, Duration::from_secs(180)).await;
    for agent in agents {
        tokio::time::timeout(Duration::from_secs(60), agent)
            .await
            .expect("the agent goes idle and returns")
            .unwrap()
            .expect("the agent runs without error");
    }

    // Everything arrives: the queue empties and nothing was dropped.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = metrics_text(&server).await;
        if sample(&text, "cohort_tracking_queued{sink=\"mlflow\"}") == 0.0 {
            for sink in ["mlflow", "tensorboard"] {
                for reason in ["queue_full", "rejected"] {
                    let name = format!(
                        "cohort_tracking_dropped_total{{sink=\"{sink}\",reason=\"{reason}\"}}"
                    );
                    assert_eq!(sample(&text, &name), 0.0, "{name}");
                }
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "MLflow's queue did not empty: {text}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let run = read_run(
        &python,
        &uri,
        "tracked digits",
        &id,
        &dir.path().join("download"),
    );
    assert_eq!(run["runs"], 1, "one run, however the records came: {run}");
    assert_eq!(run["status"], "FINISHED");
    assert_eq!(run["name"], format!("tracked digits-{}", &id[..8]));
    let params = &run["params"];
    assert_eq!(params["rounds"], ROUNDS.to_string());
    assert_eq!(params["model"], "mlp:16");
    assert_eq!(params["train.lr"], "0.01");
    assert_eq!(params["cohort.experiment_id"], id);

    // Every round's metrics, equal to what the API reports, at the round's step.
    let rounds = published(&server, &id).await;
    assert_eq!(rounds.len(), ROUNDS as usize);
    // For the record (the closing note's figure): each round's length, MLflow down
    // from after round 2 until round `down + 3` was published.
    let lengths: Vec<String> = rounds
        .iter()
        .map(|r| {
            let ms = r["finished_at"].as_i64().unwrap() - r["started_at"].as_i64().unwrap();
            format!("{}:{ms}ms", r["round"])
        })
        .collect();
    eprintln!(
        "round lengths (MLflow down after round {down}): {}",
        lengths.join(" ")
    );
    let history = |metric: &str| -> Vec<(i64, f64)> {
        run["metrics"][metric]
            .as_array()
            .unwrap_or_else(|| panic!("no metric {metric}: {run}"))
            .iter()
            .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap()))
            .collect()
    };
    let expect = |field: &str| -> Vec<(i64, f64)> {
        rounds
            .iter()
            .map(|r| (r["round"].as_i64().unwrap(), r[field].as_f64().unwrap()))
            .collect()
    };
    assert_eq!(history("accuracy/test"), expect("test_accuracy"));
    assert_eq!(history("loss/test"), expect("test_loss"));
    assert_eq!(history("loss/train"), expect("train_loss"));
    assert_eq!(history("clients/participants"), expect("reported"));
    assert_eq!(history("clients/dropped"), expect("dropped"));
    let up = history("bytes/up");
    assert_eq!(up.len(), ROUNDS as usize);
    assert!(up.iter().all(|(_, b)| *b > 0.0), "{up:?}");

    // The final model, tensor by tensor as the API serves it.
    let model_path = run["model"].as_str().expect("the model artifact");
    let artifact = std::fs::read(model_path).unwrap();
    let served = server
        .http
        .get(format!(
            "{}/api/v1/admin/experiments/{id}/model.safetensors",
            server.base
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let artifact = safetensors::SafeTensors::deserialize(&artifact).unwrap();
    let served = safetensors::SafeTensors::deserialize(&served).unwrap();
    let mut names = served.names();
    names.sort();
    let mut artifact_names = artifact.names();
    artifact_names.sort();
    assert_eq!(artifact_names, names);
    for name in names {
        assert!(
            artifact.tensor(name).unwrap().data() == served.tensor(name).unwrap().data(),
            "tensor {name} differs from the served model's"
        );
    }

    // TensorBoard got the same rounds, in the experiment's directory.
    let run_dir = board.join(format!("tracked_digits-{}", &id[..8]));
    assert!(
        std::fs::read_dir(&run_dir).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")),
        "{}",
        run_dir.display()
    );
    assert!(run_dir.join("model.safetensors").exists());
    mlflow.stop();
}

/// `cohort simulate --mlflow-uri`: the run's settings, every round's metrics as
/// `metrics.jsonl` has them, and the final model reach MLflow, in the experiment named
/// by `--mlflow-experiment`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_run_reports_to_mlflow() {
    let Some(python) = mlflow_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (mut mlflow, _, _, uri) = MlflowServer::launch(&python, dir.path()).await;
    let out = dir.path().join("sim");
    let status = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "simulate",
            "--clients",
            "10",
            "--rounds",
            "3",
            "--seed",
            "4",
            "--mlflow-uri",
        ])
        .arg(&uri)
        .args(["--mlflow-experiment", "simulated digits", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let run = read_run(
        &python,
        &uri,
        "simulated digits",
        "-",
        &dir.path().join("download"),
    );
    assert_eq!(run["runs"], 1, "{run}");
    assert_eq!(run["status"], "FINISHED");
    assert_eq!(run["name"], "sim/fedavg");
    assert_eq!(run["params"]["rounds"], "3");
    assert_eq!(run["params"]["clients"], "10");
    assert_eq!(run["params"]["lr"], "0.05");
    assert!(run["params"].get("mlflow-uri").is_none());
    assert_eq!(run["params"]["strategy"], "fedavg");
    let jsonl = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    for (metric, column) in [
        ("accuracy/test", "test_accuracy"),
        ("loss/test", "test_loss"),
        ("clients/participants", "participants"),
        ("bytes/up", "bytes_up"),
    ] {
        let history: Vec<(i64, f64)> = run["metrics"][metric]
            .as_array()
            .unwrap_or_else(|| panic!("no {metric}: {run}"))
            .iter()
            .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap()))
            .collect();
        let expected: Vec<(i64, f64)> = rows
            .iter()
            .map(|r| (r["round"].as_i64().unwrap(), r[column].as_f64().unwrap()))
            .collect();
        assert_eq!(history, expected, "{metric}");
    }
    let artifact = std::fs::read(run["model"].as_str().expect("the model artifact")).unwrap();
    let model = cohort_aggregation::model_file::decode(&artifact, 1 << 30).unwrap();
    assert!(model.values().len() > 1000);
    mlflow.stop();
}
