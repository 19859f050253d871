//! What a client is asked to do: the task built from an experiment's spec, and whether
//! the experiment takes the clients' own evaluations. Both drivers (synchronous rounds,
//! FedBuff) and the final evaluation build their tasks here, so a client sees the same
//! settings whichever handed it the task.

use cohort_edge::model::ModelSpec;
use cohort_edge::protocol::{Task, TaskKind, UploadForm};
use cohort_edge::train::TrainConfig;
use uuid::Uuid;

use crate::{ExperimentSpec, SpecModel};

impl ExperimentSpec {
    /// A training task of experiment `experiment` (round `round`, attempt `attempt`, due
    /// at `deadline_ms`) with this spec's model and training settings, and no secure
    /// aggregation: a secure round adds its own settings to it.
    pub fn plain_task(
        &self,
        experiment: Uuid,
        round: i64,
        attempt: i64,
        deadline_ms: Option<i64>,
    ) -> Task {
        Task {
            experiment_id: experiment,
            round,
            attempt,
            deadline_ms,
            model: self.model.to_string(),
            features: self.features,
            classes: self.classes,
            train: TrainConfig {
                local_epochs: self.train.local_epochs,
                batch_size: self.train.batch_size,
                lr: self.train.lr,
                momentum: self.train.momentum,
                weight_decay: self.train.weight_decay,
                proximal_mu: self.strategy.proximal_mu(),
            },
            secure_aggregation: None,
            kind: TaskKind::Train,
            tensors: self.tensors.clone().or_else(|| self.built_in_tensors()),
            upload: UploadForm::Weights,
            hyperparameters: self.hyperparameters.clone(),
            report_metrics: self.evaluation_refusal().is_none(),
            compression: None,
            personalisation: self.task_personalisation(),
            columns: self.columns.clone(),
        }
    }

    /// A built-in model's tensors, in the order of its flat vector; `None` for a file
    /// model (whose tensors the spec carries) or one that does not build (a spec that
    /// failed validation never gets this far).
    fn built_in_tensors(&self) -> Option<Vec<cohort_aggregation::TensorSpec>> {
        match &self.model {
            SpecModel::BuiltIn(kind) => ModelSpec::new(kind, self.features, self.classes)
                .ok()
                .map(|m| m.layout().tensors().to_vec()),
            SpecModel::File => None,
        }
    }

    /// Why the experiment takes no client evaluations, if it does not: only file models
    /// (whose metrics come from nowhere else) and personalised experiments (whose
    /// clients score their models on their own held-out data); never with differential privacy, whose
    /// guarantee covers the model and not per-client metrics sent in the clear; and
    /// never with secure aggregation, which hides each client's update from the
    /// coordinator: a client's metrics in the clear beside its masked update would tell
    /// what the masking hides (the weight and loss it needs travel inside the masked
    /// vector instead).
    pub fn evaluation_refusal(&self) -> Option<String> {
        // A personalised client's accuracies come from its own held-out data, which the
        // coordinator's test set cannot stand in for, whatever the model.
        if self.model != SpecModel::File && self.personalisation.is_none() {
            return Some(
                "client evaluations are taken for file models only; the coordinator evaluates built-in ones".into(),
            );
        }
        if self.privacy.is_some() {
            return Some(
                "the experiment is differentially private: per-client metrics would be released without noise".into(),
            );
        }
        if self.secure_aggregation.is_some() {
            return Some(
                "the experiment uses secure aggregation: per-client metrics would travel in the clear while the updates are masked".into(),
            );
        }
        None
    }
}
