//! Who the virtual clients are. The round loop asks a [`Population`] to train a batch of
//! clients and to evaluate the global model; it never knows whether the clients are the
//! built-in models on a partitioned CSV ([`super::Prepared`]) or the user's own Python
//! function in a pool of worker processes ([`super::python::PythonPopulation`]).
//!
//! A client can fail in two ways. A *task failure* (the user's code raised, returned a
//! wrong shape or a NaN, or its worker died) is a dropout: the round goes on without
//! that client, exactly as when a deployed client reports its task failed. A *fatal*
//! error (the built-in trainer refusing its own data, a pool that cannot start) ends the
//! run.

use cohort_aggregation::ModelVector;
use cohort_edge::model::Evaluation;
use cohort_edge::train::{LocalUpdate, TrainConfig};
use serde::Serialize;

use super::SimulationError;
use super::run::DataFacts;
use crate::engine::ClientId;

/// One client's training task in a batch.
#[derive(Debug, Clone, Copy)]
pub struct ClientTask<'a> {
    /// The client that trains.
    pub client: ClientId,
    /// The round the update is for (FedBuff: the server step it starts from, plus one).
    pub round: u32,
    /// Identifies `global` within the run: tasks with the same version train from the
    /// same model, so a worker needs it only once.
    pub model_version: u32,
    /// The model to start from.
    pub global: &'a ModelVector,
    /// Local training settings.
    pub train: &'a TrainConfig,
    /// Seed for the client's randomness in this task.
    pub seed: u64,
}

/// A client whose task produced no usable update: it counts as a dropout.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientFailure {
    /// The client (its partition id).
    pub client: u64,
    /// The round.
    pub round: u32,
    /// What went wrong, as the user would want to read it (the exception's message).
    pub reason: String,
}

/// The result of one task: an update, or why there is none.
pub type TaskResult = Result<LocalUpdate, ClientFailure>;

/// The virtual clients of a simulation and the held-out evaluation.
pub trait Population: Sync {
    /// Number of clients; their ids are `0..clients()`.
    fn clients(&self) -> usize;

    /// Training samples of `client` as far as known (the straggler model's task length);
    /// 0 when the population does not know before training.
    fn num_samples(&self, client: ClientId) -> usize;

    /// The largest weight (sample count) one update may carry under secure aggregation,
    /// unless the configuration sets one.
    fn max_weight(&self) -> u32;

    /// The global model before round 1.
    fn initial_model(&self, seed: u64) -> Result<ModelVector, SimulationError>;

    /// Trains every task of the batch; the results come back in the order of `tasks`.
    /// An `Err` ends the run; a task's own failure is an `Err` inside the vector.
    fn train(&self, tasks: &[ClientTask<'_>]) -> Result<Vec<TaskResult>, SimulationError>;

    /// Loss and accuracy of `global` on the held-out test data after `round` (0: the
    /// initial model). Either may be NaN when the population has no such measure.
    fn evaluate(&self, round: u32, global: &ModelVector) -> Result<Evaluation, SimulationError>;

    /// Facts about the data and the model, for the summary.
    fn facts(&self) -> DataFacts;

    /// What trains the clients, for the summary (`built-in` or `python`).
    fn trainer(&self) -> &'static str;
}
