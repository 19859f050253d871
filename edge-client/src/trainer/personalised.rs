//! A personalised task ([`crate::personal`]) in `cohort serve`, with whatever trainer the
//! client runs: the personal part is kept in the state directory between rounds and
//! across restarts, only the shared part is uploaded, and every task scores both the
//! model received and the client's personalised model with the trainer's own evaluation
//! (the built-in models: on their held-out split).
//!
//! FedPer and fine-tuning need nothing of the trainer but training and evaluation, so
//! they run with any trainer (a program of one's own, the Python SDK, an app's
//! callback). FedRep freezes layers and Ditto pulls a personal model towards another
//! one; a trainer that cannot ([`TaskTrainer::trains_partially`]) fails those tasks
//! with the reason rather than train something else.

use std::path::{Path, PathBuf};

use cohort_aggregation::ModelVector;

use super::{
    MAX_METRICS, ReportedEvaluation, TaskTrainer, TrainerFailure, TrainerJob, TrainerOutput,
    check_output, valid_metric_name,
};
use crate::personal::{self, TrainFrom};
use crate::protocol::{Task, TaskKind, TaskPersonalisation};
use crate::train::{LocalUpdate, TrainConfig, TrainError};

/// Where a client keeps its personal part of `experiment`: little-endian `f32`s, the
/// whole vector of its personal model ([`personal::PersonalState`]).
pub fn state_path(state_dir: &Path, experiment: uuid::Uuid) -> PathBuf {
    state_dir.join("personal").join(format!("{experiment}.f32"))
}

/// The prefix of the personalised model's metrics in a report (`personal_accuracy`
/// beside the global model's `accuracy`).
pub const PERSONAL_PREFIX: &str = "personal_";

impl From<TrainError> for TrainerFailure {
    fn from(e: TrainError) -> Self {
        TrainerFailure::new(e.to_string())
    }
}

/// The client's trainer, as personalisation trains with it.
struct ViaTrainer<'a> {
    trainer: &'a dyn TaskTrainer,
    task: &'a Task,
    scheme: &'a TaskPersonalisation,
    model_version: i64,
}

impl ViaTrainer<'_> {
    /// Runs one job of the trainer and checks its output.
    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let output = self.trainer.run(job)?;
        check_output(job, &output)?;
        Ok(output)
    }

    /// The trainer's evaluation of `model`.
    fn evaluate(
        &self,
        model: &ModelVector,
        seed: u64,
    ) -> Result<ReportedEvaluation, TrainerFailure> {
        let task = Task {
            kind: TaskKind::Evaluate,
            ..self.task.clone()
        };
        let job = TrainerJob {
            task: &task,
            global: model,
            model_version: self.model_version,
            seed,
            trainable: None,
            anchor: None,
        };
        self.run(&job)?
            .evaluation
            .ok_or_else(|| TrainerFailure::new("the trainer's evaluation has no metrics"))
    }
}

impl TrainFrom for ViaTrainer<'_> {
    type Error = TrainerFailure;

    fn train_from(
        &self,
        start: &ModelVector,
        pull: Option<(&[f32], f32)>,
        trainable: Option<&[bool]>,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<LocalUpdate, TrainerFailure> {
        let anchor = personal::foreign_anchor(start, pull);
        if (trainable.is_some() || anchor.is_some()) && !self.trainer.trains_partially() {
            return Err(cannot_run(self.scheme));
        }
        let task = Task {
            kind: TaskKind::Train,
            train: personal::pulled_config(config, pull),
            ..self.task.clone()
        };
        let job = TrainerJob {
            task: &task,
            global: start,
            model_version: self.model_version,
            seed,
            trainable,
            anchor,
        };
        let output = self.run(&job)?;
        Ok(LocalUpdate {
            params: output
                .update
                .expect("checked: a training task has an update"),
            num_samples: usize::try_from(output.num_examples).unwrap_or(usize::MAX),
            train_loss: output.train_loss.unwrap_or(f64::NAN),
            steps: 0,
        })
    }
}

/// Why a trainer that cannot freeze layers or pull towards another model does not run
/// `scheme`.
fn cannot_run(scheme: &TaskPersonalisation) -> TrainerFailure {
    TrainerFailure::new(format!(
        "personalisation {} needs a trainer that freezes layers and pulls a model towards \
         another (the built-in models do); this client's trainer does not, so use fedper or \
         finetune with it",
        scheme.scheme
    ))
}

/// The global model's metrics and the personalised model's (prefixed with
/// [`PERSONAL_PREFIX`]) in one report, within the coordinator's limits on names and
/// count (the global model's come first).
fn merged(global: ReportedEvaluation, mine: ReportedEvaluation) -> ReportedEvaluation {
    let mut metrics = global.metrics;
    for (name, value) in mine.metrics {
        let name = format!("{PERSONAL_PREFIX}{name}");
        if metrics.len() < MAX_METRICS && valid_metric_name(&name) {
            metrics.insert(name, value);
        }
    }
    ReportedEvaluation {
        num_examples: global.num_examples,
        metrics,
    }
}

/// Runs a personalised task: for training, the personalised update (shared part only)
/// with the client's new personal part kept in `state_dir`; for both kinds, the
/// trainer's evaluation of the `global` model received and of the client's personalised
/// model, in one report.
pub fn run(
    trainer: &dyn TaskTrainer,
    task: &Task,
    global: &ModelVector,
    model_version: i64,
    seed: u64,
    state_dir: &Path,
) -> Result<TrainerOutput, TrainerFailure> {
    let scheme = task
        .personalisation
        .as_ref()
        .ok_or_else(|| TrainerFailure::new("the task is not personalised"))?;
    // Refused up front, not only when a call needs it: Ditto's first personal training
    // starts from the global model it pulls towards, which any trainer could do, and
    // the second would then fail.
    if matches!(
        scheme.scheme,
        personal::Personalisation::FedRep { .. } | personal::Personalisation::Ditto { .. }
    ) && !trainer.trains_partially()
    {
        return Err(cannot_run(scheme));
    }
    let via = ViaTrainer {
        trainer,
        task,
        scheme,
        model_version,
    };
    let path = state_path(state_dir, task.experiment_id);
    let state_failure =
        |e: std::io::Error| TrainerFailure::new(format!("personal state {}: {e}", path.display()));
    let state = crate::state_file::read_f32s(&path, global.len()).map_err(state_failure)?;
    let tune_seed = seed ^ 0x7e57_0f0e;
    let mine = personal::personal_model(
        &scheme.scheme,
        &via,
        global,
        state.as_deref(),
        &task.train,
        tune_seed,
    )?;
    let evaluation = merged(via.evaluate(global, seed)?, via.evaluate(&mine, seed)?);
    if task.kind == TaskKind::Evaluate {
        return Ok(TrainerOutput {
            update: None,
            num_examples: evaluation.num_examples,
            train_loss: None,
            evaluation: Some(evaluation),
        });
    }
    let out = personal::train(
        &scheme.scheme,
        &via,
        global,
        state.as_deref(),
        &task.train,
        seed,
    )?;
    if let Some(kept) = &out.state {
        crate::state_file::write_f32s(&path, kept).map_err(state_failure)?;
    }
    Ok(TrainerOutput {
        update: Some(out.upload.params),
        num_examples: out.upload.num_samples as u64,
        train_loss: out
            .upload
            .train_loss
            .is_finite()
            .then_some(out.upload.train_loss),
        evaluation: Some(evaluation),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::UploadForm;
    use crate::trainer::BuiltInTrainer;

    fn task(scheme: &str) -> Task {
        Task {
            experiment_id: uuid::Uuid::from_u128(7),
            round: 1,
            attempt: 1,
            deadline_ms: None,
            model: "mlp:8".into(),
            features: 4,
            classes: 3,
            train: TrainConfig::default(),
            secure_aggregation: None,
            kind: TaskKind::Train,
            tensors: None,
            upload: UploadForm::Weights,
            hyperparameters: None,
            report_metrics: true,
            compression: None,
            personalisation: Some(TaskPersonalisation {
                scheme: scheme.parse().unwrap(),
                holdout: 0.25,
            }),
            columns: None,
        }
    }

    fn data() -> crate::data::Dataset {
        let labels: Vec<u32> = (0..60).map(|i| (i % 3) as u32).collect();
        let features = ndarray::Array2::from_shape_fn((60, 4), |(i, j)| {
            (labels[i] as f32 - 1.0) * (j as f32 + 1.0) + ((i * 7 + j) % 5) as f32 * 0.1
        });
        crate::data::Dataset {
            features,
            labels,
            classes: vec!["0".into(), "1".into(), "2".into()],
            feature_names: (0..4).map(|j| format!("x{j}")).collect(),
            groups: None,
        }
    }

    fn global() -> ModelVector {
        let spec =
            crate::model::ModelSpec::new(&crate::model::ModelKind::Mlp { hidden: vec![8] }, 4, 3)
                .unwrap();
        spec.init(3)
    }

    /// The personal layers reach the state directory and not the upload, and a later
    /// task (another process, reading the file) scores the kept layers: with them gone
    /// the personalised model is the global one again.
    #[test]
    fn the_personal_part_is_kept_on_disk_and_never_uploaded() {
        let dir = tempfile::tempdir().unwrap();
        let trainer = BuiltInTrainer::new(data());
        let task = task("fedper:layers.1");
        let global = global();
        let mask = task
            .personalisation
            .as_ref()
            .unwrap()
            .scheme
            .personal_mask(global.layout())
            .unwrap();
        let out = run(&trainer, &task, &global, 0, 1, dir.path()).unwrap();
        let upload = out.update.unwrap();
        for (i, personal) in mask.iter().enumerate() {
            if *personal {
                assert_eq!(upload.values()[i], global.values()[i]);
            }
        }
        // 60 examples, a quarter held out.
        assert_eq!(out.num_examples, 45);
        assert_eq!(out.evaluation.as_ref().unwrap().num_examples, 15);
        let path = state_path(dir.path(), task.experiment_id);
        let kept = crate::state_file::read_f32s(&path, global.len())
            .unwrap()
            .unwrap();
        assert!((0..mask.len()).any(|i| mask[i] && kept[i] != global.values()[i]));

        let evaluate = Task {
            kind: TaskKind::Evaluate,
            ..task.clone()
        };
        let scored = |dir: &Path| {
            let e = run(&trainer, &evaluate, &global, 1, 2, dir)
                .unwrap()
                .evaluation
                .unwrap();
            (
                e.metrics["accuracy"],
                e.metrics["personal_accuracy"],
                e.metrics["personal_loss"],
            )
        };
        let (g, _, personal_loss) = scored(dir.path());
        std::fs::remove_file(&path).unwrap();
        let (g_again, p_fresh, fresh_loss) = scored(dir.path());
        assert_eq!(g, g_again);
        assert_eq!(
            p_fresh, g,
            "no kept layers: the personalised model is the global one"
        );
        assert_ne!(personal_loss, fresh_loss, "the kept layers were scored");
    }

    /// A trainer that cannot freeze layers is not asked to: FedRep fails its task with
    /// the reason, FedPer runs.
    #[test]
    fn schemes_a_trainer_cannot_run_fail_with_the_reason() {
        #[derive(Debug)]
        struct Plain(BuiltInTrainer);
        impl TaskTrainer for Plain {
            fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
                assert!(job.trainable.is_none() && job.anchor.is_none());
                self.0.run(job)
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let plain = Plain(BuiltInTrainer::new(data()));
        for scheme in ["fedrep:layers.1", "ditto:0.5"] {
            let e = run(&plain, &task(scheme), &global(), 0, 1, dir.path()).unwrap_err();
            assert!(e.reason.contains("use fedper or finetune"), "{scheme}: {e}");
        }
        for scheme in ["fedper:layers.1", "finetune:2"] {
            run(&plain, &task(scheme), &global(), 0, 1, dir.path()).unwrap();
        }
    }
}
