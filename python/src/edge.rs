//! `run_edge`: the Rust edge agent with the user's Python functions as its trainer.
//!
//! The agent (enrolment, TLS, check-in, SecAgg+ masking, local DP, clipping, retries,
//! upload ids) runs on a thread of its own with a tokio runtime. Each task it gets is
//! handed to the *calling* thread, which holds the GIL only while the user's function
//! runs: Ctrl-C then interrupts `train` itself, and everything network-bound waits with
//! the GIL released.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::time::Duration;

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use cohort_coordinator::simulate::python::{ReturnedTensor, update_from_tensors};
use cohort_edge::agent::{AgentConfig, AgentError, run_agent};
use cohort_edge::protocol::{CoordinatorClient, ProtocolError, TaskKind};
use cohort_edge::trainer::{
    ReportedEvaluation, TaskTrainer, TrainerFailure, TrainerJob, TrainerOutput,
};

use crate::{cohort_error, model_to_dict};

/// One task handed from the agent's thread to the Python thread.
struct Job {
    kind: TaskKind,
    global: cohort_aggregation::ModelVector,
    info: serde_json::Value,
    reply: SyncSender<Result<TrainerOutput, TrainerFailure>>,
}

/// The agent's trainer: sends each job to the Python thread and waits for its answer.
#[derive(Debug)]
struct PythonTrainer {
    jobs: std::sync::Mutex<Sender<Job>>,
    /// The files of the user's functions, for a site that approves them by hash.
    code_files: Vec<std::path::PathBuf>,
    partition_id: Option<u64>,
}

/// A site's say over what runs on its data (`cohort.EdgeClient`'s `allowed_experiments`,
/// `max_rounds`, `approve_trainer`, `columns`), and the files of its functions' code.
#[derive(Debug, Default, FromPyObject)]
struct SiteSettings {
    #[pyo3(item)]
    allowed_experiments: Option<Vec<String>>,
    #[pyo3(item)]
    max_rounds: Option<u32>,
    #[pyo3(item)]
    approve_trainer: Option<String>,
    #[pyo3(item)]
    columns: Option<Vec<String>>,
    #[pyo3(item)]
    code_files: Vec<String>,
}

impl SiteSettings {
    fn rules(&self) -> Result<cohort_edge::governance::SiteRules, String> {
        let allowed_experiments = self
            .allowed_experiments
            .as_ref()
            .map(|ids| {
                ids.iter()
                    .map(|id| {
                        id.parse::<uuid::Uuid>().map_err(|_| {
                            format!("allowed_experiments: `{id}` is not an experiment id")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        if self
            .columns
            .as_ref()
            .is_some_and(|c| c.iter().any(|n| n.trim().is_empty()))
        {
            return Err("columns: a column name is empty".into());
        }
        Ok(cohort_edge::governance::SiteRules {
            allowed_experiments,
            max_rounds: self.max_rounds,
            columns: self
                .columns
                .as_ref()
                .map(|c| c.iter().map(|n| n.trim().to_string()).collect()),
            approved_trainer: self
                .approve_trainer
                .as_deref()
                .map(cohort_edge::governance::parse_sha256)
                .transpose()
                .map_err(|e| e.replace("--approve-trainer", "approve_trainer"))?,
        })
    }
}

/// The SHA-256 of a trainer's code (`files`, in order), as a site approves it
/// (`cohort.EdgeClient.trainer_hash`).
#[pyfunction]
fn code_sha256(py: Python<'_>, files: Vec<String>) -> PyResult<String> {
    let files: Vec<std::path::PathBuf> = files.into_iter().map(Into::into).collect();
    cohort_edge::trainer::code_sha256(&files)
        .map_err(|e| cohort_error(py, "ConfigError", e.to_string()))
}

impl TaskTrainer for PythonTrainer {
    fn code_hash(&self) -> Option<Result<String, String>> {
        Some(cohort_edge::trainer::code_sha256(&self.code_files).map_err(|e| e.to_string()))
    }

    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let info = serde_json::json!({
            "round": job.task.round,
            "seed": job.seed,
            "partition_id": self.partition_id,
            "config": job.task.train,
            "hyperparameters": job.task.hyperparameters,
            "experiment_id": job.task.experiment_id.to_string(),
            "model_version": job.model_version,
        });
        self.jobs
            .lock()
            .map_err(|_| TrainerFailure::new("the Python thread is gone"))?
            .send(Job {
                kind: job.task.kind,
                global: job.global.clone(),
                info,
                reply,
            })
            .map_err(|_| TrainerFailure::new("the client is stopping"))?;
        answer
            .recv()
            .unwrap_or_else(|_| Err(TrainerFailure::new("the client is stopping")))
    }
}

/// What the agent thread ends with.
enum Finished {
    Agent(Result<cohort_edge::agent::AgentReport, AgentError>),
    Unreachable(String),
}

/// Runs the edge agent until it exits (idle limit, budget spent) or fails; `handler`
/// is `cohort.edge`'s dispatcher, called as `handler(kind, weights, info)` for each task
/// and returning `(num_examples, metrics, tensors, body)` (`tensors` is `None` for an
/// evaluation). `insecure_http` allows a plain `http://` coordinator, over which the
/// credential travels unencrypted; without it such a URL is a `ConfigError`.
#[pyfunction]
#[pyo3(signature = (coordinator, ca_pem, identity_pem, enrol_token, state_dir, seed, idle_exit, partition_id, handler, insecure_http=false, site=None))]
#[allow(clippy::too_many_arguments)]
fn run_edge<'py>(
    py: Python<'py>,
    coordinator: String,
    ca_pem: Option<Vec<u8>>,
    identity_pem: Option<Vec<u8>>,
    enrol_token: Option<String>,
    state_dir: String,
    seed: u64,
    idle_exit: Option<f64>,
    partition_id: Option<u64>,
    handler: Bound<'py, PyAny>,
    insecure_http: bool,
    site: Option<SiteSettings>,
) -> PyResult<Bound<'py, PyDict>> {
    let site = site.unwrap_or_default();
    let rules = site
        .rules()
        .map_err(|e| cohort_error(py, "ConfigError", e))?;
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Finished>();
    let trainer = Arc::new(PythonTrainer {
        jobs: std::sync::Mutex::new(jobs_tx),
        code_files: site
            .code_files
            .iter()
            .map(std::path::PathBuf::from)
            .collect(),
        partition_id,
    });
    let idle_exit = match idle_exit {
        Some(s) if !(s.is_finite() && s >= 0.0) => {
            return Err(cohort_error(
                py,
                "ConfigError",
                format!("idle_exit must be a number of seconds >= 0, got {s}"),
            ));
        }
        other => other.map(Duration::from_secs_f64),
    };
    let client = CoordinatorClient::with_identity(
        &coordinator,
        ca_pem.as_deref(),
        identity_pem.as_deref(),
        insecure_http,
    )
    .map_err(|e| cohort_error(py, "ConfigError", e.to_string()))?;
    let config = AgentConfig {
        coordinator,
        insecure_http,
        ca_pem,
        identity_pem,
        enrol_token,
        trainer,
        state_dir: state_dir.into(),
        idle_exit,
        seed,
        local_dp: None,
        slowdown: Duration::ZERO,
        floors: cohort_aggregation::secagg::ClientFloors::default(),
        rules,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = spawn_agent(client, config, done_tx, stop_rx)
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the agent: {e}")))?;
    let (jobs_rx, done_rx) = (
        std::sync::Mutex::new(jobs_rx),
        std::sync::Mutex::new(done_rx),
    );
    let result = serve(py, &handler, &jobs_rx, &done_rx);
    if result.is_err() {
        let _ = stop_tx.send(());
    }
    drop(jobs_rx);
    let _ = py.detach(|| agent.join());
    python_outcome(py, result?)
}

/// Runs the agent on a thread of its own with its own runtime, until it finishes (its
/// end sent on `done`) or `stop` fires.
fn spawn_agent(
    client: CoordinatorClient,
    config: AgentConfig,
    done_tx: std::sync::mpsc::Sender<Finished>,
    stop_rx: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("cohort-edge-agent".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = done_tx.send(Finished::Unreachable(format!(
                        "cannot start the network runtime: {e}"
                    )));
                    return;
                }
            };
            let finished = runtime.block_on(async move {
                // The first contact is not retried: a wrong address, port or CA is a
                // mistake to report now, not an outage to wait out.
                if let Err(e) = client.health().await {
                    return Some(Finished::Unreachable(e.to_string()));
                }
                tokio::select! {
                    report = run_agent(config) => Some(Finished::Agent(report)),
                    _ = stop_rx => None,
                }
            });
            if let Some(f) = finished {
                let _ = done_tx.send(f);
            }
            // In-flight requests are dropped; the stored credential is written
            // atomically, so a stop at any point leaves the state directory usable.
            runtime.shutdown_timeout(Duration::from_secs(1));
        })
}

/// The agent's end as Python sees it: the report as a dict, or the exception.
fn python_outcome(py: Python<'_>, finished: Finished) -> PyResult<Bound<'_, PyDict>> {
    match finished {
        Finished::Unreachable(reason) => Err(cohort_error(
            py,
            "UnreachableError",
            format!("cannot reach the coordinator: {reason}"),
        )),
        Finished::Agent(Ok(report)) => {
            let d = PyDict::new(py);
            d.set_item("client_id", report.client_id.map(|id| id.to_string()))?;
            d.set_item("uploads", report.uploads)?;
            d.set_item("failed", report.failed)?;
            d.set_item("skipped", report.skipped)?;
            d.set_item("evaluations", report.evaluations)?;
            d.set_item("refused", report.refused)?;
            Ok(d)
        }
        Finished::Agent(Err(AgentError::Protocol(ProtocolError::Refused {
            status,
            code,
            message,
        }))) => {
            let class = py.import("cohort._types")?.getattr("ApiError")?;
            Err(PyErr::from_value(class.call1((status, code, message))?))
        }
        Finished::Agent(Err(AgentError::Protocol(e @ ProtocolError::Transport(_)))) => {
            Err(cohort_error(py, "UnreachableError", e.to_string()))
        }
        Finished::Agent(Err(e)) => Err(cohort_error(py, "CohortError", e.to_string())),
    }
}

/// Runs the user's functions for each job until the agent finishes; Ctrl-C (or any
/// exception the dispatcher lets through) ends it.
fn serve(
    py: Python<'_>,
    handler: &Bound<'_, PyAny>,
    jobs: &std::sync::Mutex<Receiver<Job>>,
    done: &std::sync::Mutex<Receiver<Finished>>,
) -> PyResult<Finished> {
    // Receivers are not `Sync`; a mutex lets the GIL-free closures borrow them.
    loop {
        if let Ok(f) = done.lock().unwrap_or_else(|p| p.into_inner()).try_recv() {
            return Ok(f);
        }
        match py.detach(|| {
            jobs.lock()
                .unwrap_or_else(|p| p.into_inner())
                .recv_timeout(Duration::from_millis(50))
        }) {
            Ok(job) => {
                let answer = run_job(py, handler, &job);
                match answer {
                    Ok(output) => {
                        let _ = job.reply.send(output);
                    }
                    // Ctrl-C inside `train`: the task is not reported (the process is
                    // stopping, and the coordinator times it out like any lost client).
                    Err(e) if e.is_instance_of::<PyKeyboardInterrupt>(py) => return Err(e),
                    Err(e) => {
                        let _ = job.reply.send(Err(TrainerFailure::new(e.to_string())));
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => {
                // The agent dropped its trainer: it has finished.
                return py
                    .detach(|| done.lock().unwrap_or_else(|p| p.into_inner()).recv())
                    .map_err(|_| PyRuntimeError::new_err("the edge agent stopped unexpectedly"));
            }
        }
    }
}

/// What the dispatcher returns: the example count, the metrics, each returned tensor's
/// `(name, dtype, shape)` (none for an evaluation) and their bytes.
type HandlerReply<'py> = (
    u64,
    std::collections::BTreeMap<String, f64>,
    Option<Vec<(String, String, Vec<usize>)>>,
    Bound<'py, PyBytes>,
);

/// Calls the dispatcher for one job. A Python exception from the user's code comes
/// back as a failure (its message is reported to the coordinator); only Ctrl-C escapes.
fn run_job(
    py: Python<'_>,
    handler: &Bound<'_, PyAny>,
    job: &Job,
) -> PyResult<Result<TrainerOutput, TrainerFailure>> {
    let weights = model_to_dict(py, &job.global)?;
    let info = pythonize(py, &job.info)?;
    let kind = match job.kind {
        TaskKind::Train => "train",
        TaskKind::Evaluate => "evaluate",
    };
    let reply = match handler.call1((kind, weights, info)) {
        Ok(r) => r,
        Err(e) if e.is_instance_of::<PyKeyboardInterrupt>(py) => return Err(e),
        Err(e) => return Ok(Err(TrainerFailure::new(describe(py, &e)))),
    };
    let (num_examples, metrics, tensors, body): HandlerReply<'_> = match reply.extract() {
        Ok(r) => r,
        Err(e) => return Ok(Err(TrainerFailure::new(format!("bad handler reply: {e}")))),
    };
    let metrics: std::collections::BTreeMap<String, f64> =
        metrics.into_iter().filter(|(_, v)| v.is_finite()).collect();
    Ok(match (job.kind, tensors) {
        (TaskKind::Train, Some(tensors)) => {
            let tensors: Vec<ReturnedTensor> = tensors
                .into_iter()
                .map(|(name, dtype, shape)| ReturnedTensor { name, dtype, shape })
                .collect();
            update_from_tensors(job.global.layout(), &tensors, body.as_bytes())
                .map(|update| TrainerOutput {
                    update: Some(update),
                    num_examples,
                    train_loss: metrics.get("loss").copied(),
                    evaluation: None,
                })
                .map_err(TrainerFailure::new)
        }
        (TaskKind::Train, None) => Err(TrainerFailure::new("train returned no weights")),
        (TaskKind::Evaluate, _) => Ok(TrainerOutput {
            update: None,
            num_examples,
            train_loss: None,
            evaluation: Some(ReportedEvaluation {
                num_examples,
                metrics,
            }),
        }),
    })
}

/// The exception's type and message, as reported to the coordinator.
fn describe(py: Python<'_>, e: &PyErr) -> String {
    let name = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    let text = format!("{name}: {}", e.value(py));
    text.chars().take(4000).collect()
}

/// A JSON value as Python objects (through the `json` module: the values are small).
fn pythonize<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?
        .getattr("loads")?
        .call1((value.to_string(),))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_edge, m)?)?;
    m.add_function(wrap_pyfunction!(code_sha256, m)?)
}
