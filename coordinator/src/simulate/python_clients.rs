//! A Python population's clients scored on their own data, and personalised: each
//! worker holds out part of every client's data (`--client-holdout`, the same split
//! every round), scores models on it with the user's `evaluate`, and with
//! `--personalise` the engine keeps each client's personal state and trains through
//! [`cohort_edge::personal`] exactly as for the built-in models, only the shared part
//! reaching the aggregate.
//!
//! FedPer and fine-tuning need nothing of the user's `train` but training; FedRep
//! freezes layers and Ditto pulls a model towards another one, which a `train` of one's
//! own does not do, so those two are refused for Python clients before the run starts.

use std::sync::atomic::Ordering;

use cohort_aggregation::ModelVector;
use cohort_edge::personal::{self, TrainFrom};
use cohort_edge::train::{LocalUpdate, TrainConfig, TrainError};
use serde_json::json;

use super::SimulationError;
use super::config::ConfigError;
use super::personal::ClientAccuracy;
use super::population::{ClientFailure, ClientTask};
use super::python::{Landed, Outcome, PythonPopulation, WorkerError};
use crate::engine::ClientId;

/// Why a personalised task produced nothing.
enum TaskError {
    /// The client's task failed: a dropout.
    Failed(ClientFailure),
    /// The run cannot go on.
    Fatal(SimulationError),
}

impl From<TrainError> for TaskError {
    fn from(e: TrainError) -> Self {
        TaskError::Fatal(ConfigError(format!("--personalise: {e}")).into())
    }
}

/// One worker training for one client, as personalisation trains.
struct ViaWorker<'a> {
    pop: &'a PythonPopulation,
    worker: usize,
    client: ClientId,
    round: u32,
}

impl TrainFrom for ViaWorker<'_> {
    type Error = TaskError;

    fn train_from(
        &self,
        start: &ModelVector,
        pull: Option<(&[f32], f32)>,
        trainable: Option<&[bool]>,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<LocalUpdate, TaskError> {
        if trainable.is_some() || personal::foreign_anchor(start, pull).is_some() {
            return Err(TaskError::Fatal(
                ConfigError(
                    "a Python train cannot freeze layers or pull towards another model".into(),
                )
                .into(),
            ));
        }
        let config = personal::pulled_config(config, pull);
        let task = ClientTask {
            client: self.client,
            round: self.round,
            model_version: self.pop.private_version(),
            global: start,
            train: &config,
            seed,
        };
        match self.pop.train_one(self.worker, &task, None) {
            Ok(Ok(Outcome {
                landed: Landed::Owned(values),
                num_samples,
                train_loss,
                ..
            })) => Ok(LocalUpdate {
                params: ModelVector::new(start.layout().clone(), values)
                    .expect("checked against the model's layout"),
                num_samples,
                train_loss,
                steps: 0,
            }),
            Ok(Ok(_)) => unreachable!("no slot was given, so the update is owned"),
            Ok(Err(failure)) => Err(TaskError::Failed(failure)),
            Err(e) => Err(TaskError::Fatal(e)),
        }
    }
}

impl PythonPopulation {
    /// A model version no round uses ([`PythonPopulation`]'s `next_private_version`).
    pub(super) fn private_version(&self) -> u64 {
        self.next_private_version.fetch_sub(1, Ordering::Relaxed)
    }

    /// Trains `tasks` with personalisation: each client starts from the global model
    /// with its own part, and what comes back is only the shared part (owned, not in
    /// shared memory: a client's personalised start is a model of its own).
    pub(super) fn personal_tasks(
        &self,
        tasks: &[ClientTask<'_>],
    ) -> Result<Vec<Result<Outcome<'static>, ClientFailure>>, SimulationError> {
        let run = self.personal.as_ref().expect("called with personalisation");
        let order: Vec<usize> = (0..tasks.len()).collect();
        self.schedule(&order, tasks.len(), |worker, i| {
            let t = &tasks[i];
            let via = ViaWorker {
                pop: self,
                worker,
                client: t.client,
                round: t.round,
            };
            match run.train(t.client.0, &via, t.global, t.train, t.seed) {
                Ok(update) => Ok(Ok(Outcome {
                    landed: Landed::Owned(update.params.into_values()),
                    num_samples: update.num_samples,
                    train_loss: update.train_loss,
                    client: t.client.0,
                    round: t.round,
                })),
                Err(TaskError::Failed(failure)) => Ok(Err(failure)),
                Err(TaskError::Fatal(e)) => Err(e),
            }
        })
    }

    /// The user's `evaluate` of `model` on client `client`'s held-out split, on worker
    /// `worker`: `(accuracy, examples)`; `None` when the client holds nothing out.
    fn evaluate_client(
        &self,
        worker: usize,
        client: u64,
        version: u64,
        model: &ModelVector,
    ) -> Result<Option<(f64, usize)>, SimulationError> {
        let request = json!({
            "op": "evaluate_client",
            "client": client,
            "hyperparameters": self.settings.hyperparameters,
        });
        let fail = |reason: String| SimulationError::Evaluation { round: 0, reason };
        let header = match self.exchange(worker, version, model, &request)? {
            Ok((header, _)) => header,
            Err(WorkerError::Task(reason) | WorkerError::Process(reason)) => {
                return Err(fail(format!("client {client}'s held-out split: {reason}")));
            }
        };
        if header["none"] == json!(true) {
            return Ok(None);
        }
        let accuracy = header["metrics"]["accuracy"].as_f64().ok_or_else(|| {
            fail(format!(
                "evaluate returned no metrics[\"accuracy\"] for client {client}'s held-out split"
            ))
        })?;
        let examples = header["num_examples"].as_u64().unwrap_or(0) as usize;
        Ok(Some((accuracy, examples)))
    }

    /// Every client's accuracy on its own held-out split: the global model's, and with
    /// personalisation its personalised model's. `None` without a held-out split.
    pub(super) fn score_clients(
        &self,
        global: &ModelVector,
    ) -> Result<Option<Vec<ClientAccuracy>>, SimulationError> {
        let split = &self.settings.clients_split;
        if split.holdout <= 0.0 {
            return Ok(None);
        }
        if !self.has_evaluate.load(Ordering::Relaxed) {
            return Err(ConfigError(
                "--client-holdout and --personalise score each client's models with your \
                 evaluate function: pass evaluate"
                    .into(),
            )
            .into());
        }
        let version = self.private_version();
        let clients = self.settings.clients;
        let order: Vec<usize> = (0..clients).collect();
        let scored = self.schedule(&order, clients, |worker, i| {
            let client = i as u64;
            let Some((global_accuracy, held)) =
                self.evaluate_client(worker, client, version, global)?
            else {
                return Ok(None);
            };
            let personal_accuracy = match &self.personal {
                None => None,
                Some(run) => {
                    let via = ViaWorker {
                        pop: self,
                        worker,
                        client: ClientId(client),
                        round: 0,
                    };
                    let state = run.state(client);
                    let mine = match personal::personal_model(
                        &run.scheme,
                        &via,
                        global,
                        state.as_deref(),
                        &split.tuning,
                        split.seed ^ client,
                    ) {
                        Ok(m) => m,
                        Err(TaskError::Fatal(e)) => return Err(e),
                        Err(TaskError::Failed(f)) => {
                            return Err(SimulationError::Evaluation {
                                round: 0,
                                reason: format!(
                                    "fine-tuning client {client}'s personal model: {}",
                                    f.reason
                                ),
                            });
                        }
                    };
                    let own = self.private_version();
                    self.evaluate_client(worker, client, own, &mine)?
                        .map(|(a, _)| a)
                }
            };
            Ok(Some(ClientAccuracy {
                client,
                train_samples: self.samples[i].load(Ordering::Relaxed),
                holdout_samples: held,
                global_accuracy,
                personal_accuracy,
            }))
        })?;
        Ok(Some(scored.into_iter().flatten().collect()))
    }
}
