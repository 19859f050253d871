//! Where a run's metrics go besides Cohort's own files: experiment trackers that
//! organisations already run.
//!
//! - [`tensorboard`]: TensorBoard event files (`--tensorboard DIR`).
//! - [`mlflow`]: an MLflow tracking server, through its REST API (`--mlflow-uri`).
//! - [`outbox`]: the queue between a run and its trackers. A round hands its metrics to
//!   the outbox and goes on; each tracker is fed from its own queue by its own task,
//!   which retries while the tracker is down and counts what it had to drop, so a
//!   tracker that is slow or down never stalls a round.
//!
//! A run (one served experiment, or one strategy of `cohort simulate`) reaches a
//! tracker as [`Record`]s: its settings when it starts, its metrics at every round, its
//! final model as an artifact, and how it ended.

pub mod mlflow;
pub mod outbox;
pub mod tensorboard;

use std::sync::Arc;

/// Which run a record belongs to, and what a tracker that has not seen it yet needs to
/// create it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRef {
    /// What identifies the run across processes and restarts (a served experiment's
    /// id): a tracker finds a run it created earlier, or that another replica created,
    /// by this key.
    pub key: String,
    /// The tracker's experiment the run belongs to (MLflow's experiment name).
    pub experiment: String,
    /// The run's display name.
    pub name: String,
    /// The run's settings as flat `(key, value)` parameters ([`flatten_params`]).
    pub params: Arc<Vec<(String, String)>>,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// Ran all its rounds (or spent its privacy budget).
    Finished,
    /// Gave up.
    Failed,
    /// Stopped by a person.
    Killed,
}

impl RunStatus {
    /// The name MLflow gives this status.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Finished => "FINISHED",
            RunStatus::Failed => "FAILED",
            RunStatus::Killed => "KILLED",
        }
    }
}

/// One thing a tracker is told about a run.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// The run started: its parameters.
    Start(RunRef),
    /// Metrics at one step (a round, or a model version).
    Metrics {
        /// The run.
        run: RunRef,
        /// The round.
        step: i64,
        /// When the values were taken, Unix milliseconds.
        time_ms: i64,
        /// `(name, value)`; names are `group/metric` (`accuracy/test`), values finite.
        values: Vec<(String, f64)>,
    },
    /// A file of the run (its final model).
    Artifact {
        /// The run.
        run: RunRef,
        /// File name.
        name: String,
        /// Contents, shared with every tracker's queue rather than copied into each.
        bytes: Arc<Vec<u8>>,
    },
    /// The run ended.
    End {
        /// The run.
        run: RunRef,
        /// How.
        status: RunStatus,
        /// When, Unix milliseconds.
        time_ms: i64,
    },
}

impl Record {
    /// The run this record is about.
    pub fn run(&self) -> &RunRef {
        match self {
            Record::Start(run)
            | Record::Metrics { run, .. }
            | Record::Artifact { run, .. }
            | Record::End { run, .. } => run,
        }
    }

    /// Metrics at `step` taken now, keeping the finite values only (a metric a round
    /// does not have, such as epsilon without privacy, is left out, not sent as NaN).
    pub fn metrics(run: RunRef, step: i64, values: &[(&str, f64)]) -> Self {
        Record::Metrics {
            run,
            step,
            time_ms: now_ms(),
            values: values
                .iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
        }
    }
}

/// Why a tracker did not take a record.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Worth trying again: the tracker is unreachable, overloaded or failing inside.
    #[error("{0} (will retry)")]
    Transient(String),
    /// Trying again would be refused again (a malformed or unacceptable record); the
    /// record is dropped and counted.
    #[error("{0}")]
    Rejected(String),
}

/// The longest parameter value sent: MLflow refuses longer ones (and the whole batch
/// with them), so a long value (a list of layers, a data path) is cut, marked by `…`.
pub const MAX_PARAM_VALUE_CHARS: usize = 6000;

/// A run's settings as flat parameters ([`crate::flat_settings::flatten`]): nested
/// objects become dotted keys (`privacy.noise_multiplier`), arrays their JSON text,
/// nulls nothing; sorted by key, values cut to [`MAX_PARAM_VALUE_CHARS`].
pub fn flatten_params(value: &serde_json::Value) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = crate::flat_settings::flatten(value)
        .into_iter()
        .filter_map(|(key, value)| {
            let text = value?;
            let text = match text.char_indices().nth(MAX_PARAM_VALUE_CHARS - 1) {
                Some((cut, _)) => format!("{}…", &text[..cut]),
                None => text,
            };
            Some((key, text))
        })
        .collect();
    out.sort();
    out
}

/// `params` with `(key, value)` set: replaced where the key is there, added where not
/// (MLflow refuses a batch naming a key twice).
pub fn set_param(params: &mut Vec<(String, String)>, key: &str, value: String) {
    match params.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => params.push((key.to_string(), value)),
    }
}

/// Now, Unix milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nested settings reach a tracker as one flat parameter each, long values cut to
    /// what MLflow takes, so a big setting cannot get the whole batch refused.
    #[test]
    fn settings_flatten_to_dotted_parameters() {
        let long = "x".repeat(MAX_PARAM_VALUE_CHARS + 10);
        let spec = serde_json::json!({
            "rounds": 5,
            "lr": f64::from(0.01f32),
            "privacy": {"noise_multiplier": 1.1, "delta": null},
            "layers": [64, 10],
            "name": "digits",
            "path": long,
        });
        let params = flatten_params(&spec);
        let get = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v);
        assert_eq!(get("rounds").unwrap(), "5");
        assert_eq!(get("lr").unwrap(), "0.01");
        assert_eq!(get("privacy.noise_multiplier").unwrap(), "1.1");
        assert_eq!(get("privacy.delta"), None);
        assert_eq!(get("layers").unwrap(), "[64,10]");
        assert_eq!(get("name").unwrap(), "digits");
        assert_eq!(get("path").unwrap().chars().count(), MAX_PARAM_VALUE_CHARS);
        assert!(get("path").unwrap().ends_with('…'));
    }

    #[test]
    fn metrics_leave_out_what_a_round_does_not_have() {
        let run = RunRef {
            key: "k".into(),
            experiment: "e".into(),
            name: "r".into(),
            params: Arc::default(),
        };
        let Record::Metrics { values, .. } = Record::metrics(
            run,
            3,
            &[("accuracy/test", 0.9), ("privacy/epsilon", f64::NAN)],
        ) else {
            unreachable!()
        };
        assert_eq!(values, vec![("accuracy/test".to_string(), 0.9)]);
    }
}
