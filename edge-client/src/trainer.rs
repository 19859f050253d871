//! Who trains: the built-in models on a CSV, the user's own program (`--trainer`), or an
//! app's callback (the C API). The agent hands each task to one [`TaskTrainer`] and does
//! everything around it (enrolment, TLS, scheduling, clipping, noise, masking, retries),
//! so the trainer never sees a key, a mask or the coordinator.
//!
//! Whatever a trainer returns is checked before anything leaves the machine: the update
//! must have the global model's tensor names and shapes and finite values, and its report
//! must be well formed. A trainer that fails gets its task reported as failed, with the
//! reason, and nothing is uploaded for it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use cohort_aggregation::ModelVector;
use serde::Serialize;

use crate::protocol::{Task, TaskKind};

pub mod external;
pub mod personalised;

/// One task as a trainer sees it.
#[derive(Debug, Clone, Copy)]
pub struct TrainerJob<'a> {
    /// The task, as the coordinator sent it.
    pub task: &'a Task,
    /// The global model to start from (or, for an evaluation task, to evaluate).
    pub global: &'a ModelVector,
    /// The published round `global` is (0: the initial model).
    pub model_version: i64,
    /// Seed for the trainer's randomness in this task.
    pub seed: u64,
    /// Personalisation only (FedRep): the parameters that may move, the others frozen.
    /// A trainer that cannot honour it says so ([`TaskTrainer::trains_partially`]) and
    /// is never given one.
    pub trainable: Option<&'a [bool]>,
    /// Personalisation only (Ditto): the model the task's proximal term
    /// (`task.train.proximal_mu`) pulls towards, when it is not `global`. Never given to
    /// a trainer that cannot honour it, as `trainable`.
    pub anchor: Option<&'a [f32]>,
}

/// What a trainer returns.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerOutput {
    /// The trained parameters, in the global model's layout; `None` for an evaluation.
    pub update: Option<ModelVector>,
    /// Examples trained on (the update's weight), or, for an evaluation, evaluated.
    pub num_examples: u64,
    /// Mean training loss, when the trainer reports one.
    pub train_loss: Option<f64>,
    /// The trainer's evaluation of the model it received (name to value) and how many
    /// examples it is over.
    pub evaluation: Option<ReportedEvaluation>,
}

/// Metrics of the model a trainer received, on the client's own held-out data.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReportedEvaluation {
    /// Examples the metrics are over.
    pub num_examples: u64,
    /// Metric name to a finite value.
    pub metrics: BTreeMap<String, f64>,
}

/// Why a trainer produced nothing usable. The text is the reason reported to the
/// coordinator and logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainerFailure {
    /// What went wrong, in a sentence or a few lines (a program's log tail included).
    pub reason: String,
}

impl TrainerFailure {
    /// A failure with this reason.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

impl fmt::Display for TrainerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for TrainerFailure {}

/// Trains (or evaluates) for one task. Called off the async threads; may block.
pub trait TaskTrainer: Send + Sync + fmt::Debug {
    /// Runs `job`. An `Ok` is checked again by [`check_output`] before it is used.
    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure>;

    /// Whether [`run`](Self::run) honours [`TrainerJob::trainable`] and
    /// [`TrainerJob::anchor`], which FedRep and Ditto need. The built-in models do; a
    /// trainer of one's own does not by default, and those schemes then fail its tasks
    /// with the reason.
    fn trains_partially(&self) -> bool {
        false
    }

    /// The SHA-256 (hex) of the code this trainer runs, for a site that approves one
    /// trainer (`--approve-trainer`); `None` for a trainer without code of its own to
    /// check (the built-in models), `Some(Err)` when the code cannot be read.
    fn code_hash(&self) -> Option<Result<String, String>> {
        None
    }
}

/// A shared trainer.
pub type SharedTrainer = Arc<dyn TaskTrainer>;

/// The SHA-256 (hex) of a trainer's code: every file of `files` in order, each as its
/// length (`u64` little-endian) then its bytes, so that moving bytes from one file to the
/// next changes it. What `--approve-trainer` (and the Python `EdgeClient`'s
/// `approve_trainer`) compares.
pub fn code_sha256(files: &[std::path::PathBuf]) -> std::io::Result<String> {
    if files.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no file of the trainer's code",
        ));
    }
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    for file in files {
        let bytes = std::fs::read(file)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", file.display())))?;
        hash.update(&(bytes.len() as u64).to_le_bytes());
        hash.update(&bytes);
    }
    Ok(hash
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Largest example count accepted from a trainer: beyond this the weight is not
/// believable, and it would dominate every other client's.
pub const MAX_EXAMPLES: u64 = 1 << 40;

/// Checks what a trainer returned against its job: an update for a training task and
/// none for an evaluation, the global model's layout, finite values, a believable
/// example count, finite metrics with usable names.
pub fn check_output(job: &TrainerJob<'_>, output: &TrainerOutput) -> Result<(), TrainerFailure> {
    match (job.task.kind, &output.update) {
        (TaskKind::Train, None) => {
            return Err(TrainerFailure::new("the trainer returned no update"));
        }
        (TaskKind::Train, Some(update)) => {
            if update.layout() != job.global.layout()
                && update.layout().as_ref() != job.global.layout().as_ref()
            {
                return Err(TrainerFailure::new(
                    "the update's tensors are not the global model's",
                ));
            }
            if let Some(i) = update.values().iter().position(|v| !v.is_finite()) {
                return Err(TrainerFailure::new(format!(
                    "the update holds a non-finite value at parameter {i}"
                )));
            }
        }
        (TaskKind::Evaluate, _) => {}
    }
    if output.num_examples == 0 || output.num_examples > MAX_EXAMPLES {
        return Err(TrainerFailure::new(format!(
            "num_examples must be between 1 and {MAX_EXAMPLES}, got {}",
            output.num_examples
        )));
    }
    if output.train_loss.is_some_and(|l| !l.is_finite()) {
        return Err(TrainerFailure::new("train_loss must be finite"));
    }
    if let Some(evaluation) = &output.evaluation {
        check_metrics(&evaluation.metrics)?;
        if evaluation.num_examples == 0 || evaluation.num_examples > MAX_EXAMPLES {
            return Err(TrainerFailure::new(format!(
                "the evaluation's example count must be between 1 and {MAX_EXAMPLES}, got {}",
                evaluation.num_examples
            )));
        }
    }
    Ok(())
}

/// Most metrics one report may carry (the coordinator's limit too).
pub const MAX_METRICS: usize = 32;

/// A metric name the coordinator accepts: 1 to 64 letters, digits, `_`, `.` or `-`.
pub fn valid_metric_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn check_metrics(metrics: &BTreeMap<String, f64>) -> Result<(), TrainerFailure> {
    if metrics.len() > MAX_METRICS {
        return Err(TrainerFailure::new(format!(
            "{} metrics reported, at most {MAX_METRICS} are accepted",
            metrics.len()
        )));
    }
    for (name, value) in metrics {
        if !valid_metric_name(name) {
            return Err(TrainerFailure::new(format!(
                "metric name `{}` must be 1 to 64 letters, digits, `_`, `.` or `-`",
                name.chars().take(80).collect::<String>()
            )));
        }
        if !value.is_finite() {
            return Err(TrainerFailure::new(format!(
                "metric `{name}` is not a finite number"
            )));
        }
    }
    Ok(())
}

/// The built-in models (logistic regression, MLPs) trained on a local CSV.
#[derive(Debug, Clone)]
pub struct BuiltInTrainer {
    data: Arc<crate::data::Dataset>,
}

impl BuiltInTrainer {
    /// Trains the built-in model a task names on `data`.
    pub fn new(data: crate::data::Dataset) -> Self {
        Self {
            data: Arc::new(data),
        }
    }
}

impl BuiltInTrainer {
    /// The task's model on this client's training examples, and on its held-out ones
    /// when the task is personalised (a split fixed by the experiment, the same every
    /// round and after a restart).
    fn models(
        &self,
        task: &crate::protocol::Task,
    ) -> Result<(crate::train::LocalModel, Option<crate::train::LocalModel>), TrainerFailure> {
        let failure = |e: &dyn fmt::Display| TrainerFailure::new(e.to_string());
        let named;
        let data = match &task.columns {
            Some(columns) => {
                named = self.data.columns(columns).map_err(|e| failure(&e))?;
                &named
            }
            None => &*self.data,
        };
        let Some(personal) = &task.personalisation else {
            let local = crate::agent::local_model(data, task).map_err(|e| failure(&e))?;
            return Ok((local.1, None));
        };
        let (train, held) = holdout_split(data, task.experiment_id, personal.holdout);
        let train = crate::agent::local_model(&train, task).map_err(|e| failure(&e))?;
        if held.is_empty() {
            return Ok((train.1, None));
        }
        let held = crate::agent::local_model(&held, task).map_err(|e| failure(&e))?;
        Ok((train.1, Some(held.1)))
    }
}

/// `data` split into the examples a client trains on and those it holds out
/// (`fraction` of them, at least one of each when it has two), shuffled by the
/// experiment's id so that the split never changes between rounds.
pub fn holdout_split(
    data: &crate::data::Dataset,
    experiment: uuid::Uuid,
    fraction: f64,
) -> (crate::data::Dataset, crate::data::Dataset) {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let n = data.len();
    let mut idx: Vec<usize> = (0..n).collect();
    let (hi, lo) = experiment.as_u64_pair();
    idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(
        hi ^ lo.rotate_left(17),
    ));
    let held = if n >= 2 {
        ((fraction * n as f64).round() as usize).clamp(1, n - 1)
    } else {
        0
    };
    let (out, kept) = idx.split_at(held);
    (data.subset(kept), data.subset(out))
}

impl TaskTrainer for BuiltInTrainer {
    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        use crate::train::Trainer;
        let (local, held) = self.models(job.task)?;
        match job.task.kind {
            TaskKind::Train => {
                let config = &job.task.train;
                let anchor = job.anchor.unwrap_or(job.global.values());
                let pull = config.proximal_mu.map(|mu| (anchor, mu));
                let update = local
                    .train_from(job.global, pull, job.trainable, config, job.seed)
                    .map_err(|e| TrainerFailure::new(e.to_string()))?;
                Ok(TrainerOutput {
                    update: Some(update.params),
                    num_examples: update.num_samples as u64,
                    train_loss: update.train_loss.is_finite().then_some(update.train_loss),
                    evaluation: None,
                })
            }
            TaskKind::Evaluate => {
                let e = held
                    .as_ref()
                    .unwrap_or(&local)
                    .evaluate(job.global)
                    .map_err(|e| TrainerFailure::new(e.to_string()))?;
                Ok(TrainerOutput {
                    update: None,
                    num_examples: e.samples as u64,
                    train_loss: None,
                    evaluation: Some(ReportedEvaluation {
                        num_examples: e.samples as u64,
                        metrics: BTreeMap::from([
                            ("accuracy".to_string(), e.accuracy),
                            ("loss".to_string(), e.loss),
                        ]),
                    }),
                })
            }
        }
    }

    fn trains_partially(&self) -> bool {
        true
    }
}
