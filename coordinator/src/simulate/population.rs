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

use cohort_aggregation::{Finite, ModelVector};
use cohort_edge::model::Evaluation;
use cohort_edge::train::{LocalUpdate, TrainConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::SimulationError;
use super::config::SimulationConfig;
use crate::engine::ClientId;
use crate::seeds::{Stream, derive_seed};

/// One client's training task in a batch.
#[derive(Debug, Clone, Copy)]
pub struct ClientTask<'a> {
    /// The client that trains.
    pub client: ClientId,
    /// The round the update is for (FedBuff: the server step it starts from, plus one).
    pub round: u32,
    /// Identifies `global` within the run: tasks with the same version train from the
    /// same model, so a worker needs it only once.
    pub model_version: u64,
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

/// A trained update as the round loop reads it.
#[derive(Debug, Clone)]
pub struct Trained<'a> {
    /// The locally trained parameters, in the global model's layout.
    pub params: Params<'a>,
    /// Training samples behind them (the FedAvg weight).
    pub num_samples: usize,
    /// Mean training loss over the last local epoch (NaN when not reported).
    pub train_loss: f64,
}

/// An update's values: checked and borrowed from where the population keeps them
/// (memory shared with the process that trained it), so that they are folded where they
/// lie, or owned and not yet checked.
#[derive(Debug, Clone)]
pub enum Params<'a> {
    /// Checked finite on arrival, in place.
    Finite(Finite<'a>),
    /// The population's own copy; the round loop checks it.
    Owned(Vec<f32>),
}

impl Params<'_> {
    /// The values.
    pub fn values(&self) -> &[f32] {
        match self {
            Params::Finite(f) => f.values(),
            Params::Owned(v) => v,
        }
    }

    /// The values, checked finite (again only when owned); the error is the index of
    /// the first NaN or infinity.
    pub fn finite(&self) -> Result<Finite<'_>, usize> {
        match self {
            Params::Finite(f) => Ok(*f),
            Params::Owned(v) => Finite::check(v),
        }
    }

    /// The values, owned.
    pub fn into_owned(self) -> Vec<f32> {
        match self {
            Params::Finite(f) => f.values().to_vec(),
            Params::Owned(v) => v,
        }
    }
}

impl From<LocalUpdate> for Trained<'static> {
    fn from(u: LocalUpdate) -> Self {
        Self {
            params: Params::Owned(u.params.into_values()),
            num_samples: u.num_samples,
            train_loss: u.train_loss,
        }
    }
}

/// A task's outcome as [`Population::train_in_place`] hands it over.
pub type TrainedResult<'a> = Result<Trained<'a>, ClientFailure>;

/// What [`Population::train_in_place`] calls with each part of a batch: the index in
/// `tasks` of the part's first task, and the part's outcomes in task order.
pub type Consume<'c> =
    dyn for<'a> FnMut(usize, Vec<TrainedResult<'a>>) -> Result<(), SimulationError> + 'c;

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

    /// Trains every task of the batch and hands the outcomes to `consume`, in the order
    /// of `tasks`, one consecutive part at a time (a population whose updates live in a
    /// fixed number of shared slots hands over as many as it has slots, and reuses them
    /// once `consume` returns). The updates may be borrowed: `consume` folds them where
    /// they lie. An `Err` from training or from `consume` ends the batch.
    fn train_in_place(
        &self,
        tasks: &[ClientTask<'_>],
        consume: &mut Consume<'_>,
    ) -> Result<(), SimulationError> {
        let results = self.train(tasks)?;
        consume(
            0,
            results.into_iter().map(|r| r.map(Trained::from)).collect(),
        )
    }

    /// Loss and accuracy of `global` on the held-out test data after `round` (0: the
    /// initial model). Either may be NaN when the population has no such measure.
    fn evaluate(&self, round: u32, global: &ModelVector) -> Result<Evaluation, SimulationError>;

    /// Facts about the data and the model, for the summary.
    fn facts(&self) -> DataFacts;

    /// What trains the clients, for the summary (`built-in` or `python`).
    fn trainer(&self) -> &'static str;

    /// Each client's accuracy on its own held-out split, for the global model and (with
    /// personalisation) its personalised one; `None` when the population holds nothing
    /// out per client.
    fn client_accuracies(
        &self,
        _global: &ModelVector,
    ) -> Result<Option<Vec<super::personal::ClientAccuracy>>, SimulationError> {
        Ok(None)
    }
}

/// Facts about the data a run used, for the summary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataFacts {
    /// Training samples over all clients.
    pub train_samples: usize,
    /// Held-out test samples.
    pub test_samples: usize,
    /// Feature columns.
    pub features: usize,
    /// Classes.
    pub classes: usize,
    /// Partition scheme in effect.
    pub partition: String,
    /// Smallest, median and largest client sample counts.
    pub client_samples_min: usize,
    /// Median client sample count.
    pub client_samples_median: usize,
    /// Largest client sample count.
    pub client_samples_max: usize,
    /// Model parameters.
    pub model_parameters: usize,
}

/// The malicious clients of a run of `clients`, fixed for the run by the seed.
pub(super) fn malicious_clients(
    cfg: &SimulationConfig,
    clients: usize,
) -> std::collections::BTreeSet<ClientId> {
    let count = (cfg.malicious * clients as f64).round() as usize;
    let mut rng = ChaCha8Rng::seed_from_u64(derive_seed(cfg.seed, Stream::Malicious, 0, 0));
    rand::seq::index::sample(&mut rng, clients, count.min(clients))
        .into_iter()
        .map(|i| ClientId(i as u64))
        .collect()
}
