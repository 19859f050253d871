//! Experiment trackers for `cohort simulate`:
//!
//! - `--tensorboard DIR`: the run's settings and every round's metrics as TensorBoard
//!   scalars in `DIR/<strategy>/`, written as each round ends (so a TensorBoard pointed
//!   at `DIR` shows the run live, one curve per strategy of a comparison). A file that
//!   cannot be written stops the run, as the run's own outputs do.
//! - `--mlflow-uri URL`: the same to an MLflow tracking server, one run per strategy in
//!   the experiment `--mlflow-experiment`, with the final model as an artifact. The
//!   server is fed from a queue on a thread of its own: a server that is slow or down
//!   never holds a round up; at the end the run waits up to [`MLFLOW_DRAIN`] for it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::SimulationError;
use super::config::SimulationConfig;
use super::output::output_error;
use super::record::RoundRecord;
use crate::tracking::mlflow::MlflowSink;
use crate::tracking::outbox::{BackgroundTracker, QUEUE_CAPACITY, Sink};
use crate::tracking::tensorboard::EventWriter;
use crate::tracking::{Record, RunRef, RunStatus, flatten_params, now_ms, set_param};

/// How long a finished run waits for MLflow to take what is queued.
pub const MLFLOW_DRAIN: Duration = Duration::from_secs(60);

/// The MLflow experiment simulated runs go into by default.
pub const DEFAULT_MLFLOW_EXPERIMENT: &str = "cohort-simulate";

/// A round's metrics as trackers name them.
pub(super) fn scalars(r: &RoundRecord) -> Vec<(&'static str, f64)> {
    let optional = |v: Option<f64>| v.unwrap_or(f64::NAN);
    vec![
        ("accuracy/test", r.test_accuracy),
        ("loss/test", r.test_loss),
        ("loss/train", optional(r.train_loss)),
        ("clients/selected", r.selected as f64),
        ("clients/participants", r.participants as f64),
        ("clients/dropped", r.dropped as f64),
        ("privacy/epsilon", optional(r.epsilon)),
        (
            "privacy/epsilon_coordinator",
            optional(r.epsilon_coordinator),
        ),
        ("bytes/up", r.bytes_up as f64),
        ("bytes/down", r.bytes_down as f64),
        ("accuracy/clients_mean", optional(r.client_accuracy_mean)),
        ("accuracy/clients_p10", optional(r.client_accuracy_p10)),
        ("accuracy/personal_mean", optional(r.personal_accuracy_mean)),
        ("accuracy/personal_p10", optional(r.personal_accuracy_p10)),
        ("time/sim_seconds", r.sim_seconds),
    ]
}

/// One strategy's trackers.
pub(super) struct Trackers {
    board: Option<EventWriter>,
    mlflow: Option<(BackgroundTracker, RunRef)>,
}

impl Trackers {
    /// Starts the trackers `cfg` asks for, telling them the run's settings.
    pub(super) fn start(
        cfg: &SimulationConfig,
        strategy: &str,
        out: &Path,
    ) -> Result<Self, SimulationError> {
        let board = cfg
            .tensorboard
            .as_deref()
            .map(|dir| start_board(dir, strategy, cfg))
            .transpose()?;
        let mlflow = match &cfg.mlflow_uri {
            Some(uri) => Some(start_mlflow(uri, cfg, strategy, out)?),
            None => None,
        };
        Ok(Self { board, mlflow })
    }

    /// Reports `r`.
    pub(super) fn round(&mut self, r: &RoundRecord) -> Result<(), SimulationError> {
        let scalars = scalars(r);
        if let Some((tracker, run)) = &self.mlflow {
            tracker
                .tracker()
                .push(Record::metrics(run.clone(), i64::from(r.round), &scalars));
        }
        if let Some(w) = self.board.as_mut() {
            w.scalars(i64::from(r.round), &scalars)
                .and_then(|()| w.flush())
                .map_err(|e| output_error(w.path(), e))?;
        }
        Ok(())
    }

    /// Sends the final model and the end, and waits for MLflow to take them; a server
    /// still down after [`MLFLOW_DRAIN`] is reported on standard error, not as a
    /// failure of the run, whose own outputs are complete.
    pub(super) fn finish(mut self, model: &cohort_aggregation::ModelVector) {
        let Some((tracker, run)) = self.mlflow.take() else {
            return;
        };
        let file = cohort_aggregation::model_file::encode(
            model,
            std::collections::HashMap::from([("run".to_string(), run.name.clone())]),
        );
        tracker.tracker().push(Record::Artifact {
            run: run.clone(),
            name: "model.safetensors".into(),
            bytes: Arc::new(file),
        });
        end(&tracker, run, RunStatus::Finished, MLFLOW_DRAIN);
    }
}

impl Drop for Trackers {
    /// A run that failed part way is marked failed rather than left running.
    fn drop(&mut self) {
        if let Some((tracker, run)) = self.mlflow.take() {
            end(&tracker, run, RunStatus::Failed, Duration::from_secs(5));
        }
    }
}

/// Sends `run`'s end and waits up to `limit` for MLflow to take what is queued.
fn end(tracker: &BackgroundTracker, run: RunRef, status: RunStatus, limit: Duration) {
    tracker.tracker().push(Record::End {
        run,
        status,
        time_ms: now_ms(),
    });
    let left = tracker.drain(limit);
    let dropped: u64 = tracker
        .tracker()
        .stats()
        .iter()
        .map(|s| s.dropped_full + s.dropped_rejected)
        .sum();
    if left > 0 || dropped > 0 {
        eprintln!(
            "warning: MLflow did not take {} of the run's records ({left} still waiting \
             after {} s, {dropped} dropped); the run's own files are complete",
            left as u64 + dropped,
            limit.as_secs()
        );
    }
}

/// Starts `dir/<strategy>`'s event file with the run's settings as its text.
fn start_board(
    dir: &Path,
    strategy: &str,
    cfg: &SimulationConfig,
) -> Result<EventWriter, SimulationError> {
    let run = dir.join(strategy);
    let mut writer = EventWriter::create(&run).map_err(|e| output_error(&run, e))?;
    let settings = toml::to_string(cfg).unwrap_or_else(|e| format!("(settings: {e})"));
    // Indented: Markdown shows it as the TOML it is.
    let text: String = settings.lines().map(|l| format!("    {l}\n")).collect();
    writer
        .text(0, "settings", &text)
        .and_then(|()| writer.flush())
        .map_err(|e| output_error(writer.path(), e))?;
    Ok(writer)
}

/// Starts feeding the MLflow server and tells it the run's settings. The run is new
/// each time (keyed by a fresh id): running the same settings twice is two runs.
fn start_mlflow(
    uri: &str,
    cfg: &SimulationConfig,
    strategy: &str,
    out: &Path,
) -> Result<(BackgroundTracker, RunRef), SimulationError> {
    let bad = |message: String| SimulationError::Output {
        path: out.to_path_buf(),
        message,
    };
    let sink = MlflowSink::new(uri).map_err(|e| bad(e.to_string()))?;
    let tracker = BackgroundTracker::start(move || vec![Sink::Mlflow(sink)], QUEUE_CAPACITY)
        .map_err(|e| bad(format!("cannot start the MLflow feeder: {e}")))?;
    let settings = serde_json::to_value(cfg).unwrap_or_default();
    let mut params = flatten_params(&settings);
    params.retain(|(k, _)| k != "mlflow-uri" && k != "mlflow-experiment");
    set_param(&mut params, "strategy", strategy.to_string());
    let out_name = out
        .file_name()
        .map_or_else(|| "simulate".into(), |n| n.to_string_lossy().into_owned());
    let run = RunRef {
        key: uuid::Uuid::new_v4().to_string(),
        experiment: cfg
            .mlflow_experiment
            .clone()
            .unwrap_or_else(|| DEFAULT_MLFLOW_EXPERIMENT.into()),
        name: format!("{out_name}/{strategy}"),
        params: Arc::new(params),
    };
    tracker.tracker().push(Record::Start(run.clone()));
    Ok((tracker, run))
}
