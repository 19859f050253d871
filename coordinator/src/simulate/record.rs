//! What a simulation run measured: a row of `metrics.csv` per round, the data it used,
//! and the run's totals. Both the synchronous loop and FedBuff's produce them; the
//! facts about the data come from the population.

use serde::Serialize;

use super::population::{ClientFailure, DataFacts};

/// One row of `metrics.csv`: the state after a round.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundRecord {
    /// Round number, from 1.
    pub round: u32,
    /// Accuracy of the global model on the held-out test set.
    pub test_accuracy: f64,
    /// Mean cross-entropy of the global model on the test set.
    pub test_loss: f64,
    /// Clients whose updates were aggregated.
    pub participants: usize,
    /// Selected clients that never reported.
    pub dropped: usize,
    /// Wall-clock seconds for the round (training, aggregation, evaluation).
    pub seconds: f64,
    /// Clients selected.
    pub selected: usize,
    /// Sample-weighted mean local training loss (empty when nobody reported).
    pub train_loss: Option<f64>,
    /// Training samples behind the aggregate.
    pub samples: u64,
    /// Whether the global model was updated (`published`), or why not.
    pub status: cohort_core::round::AttemptEnd,
    /// Simulated seconds from the start of the run to the end of this round, by the
    /// straggler model: a synchronous round lasts as long as its slowest reporting
    /// client; a FedBuff step happens when the update that fills the buffer arrives.
    pub sim_seconds: f64,
    /// Differential privacy: epsilon spent up to and including this round (at the run's
    /// delta) against observers of the published models; `None` without differential
    /// privacy.
    pub epsilon: Option<f64>,
    /// Differential privacy: epsilon spent up to and including this round against the
    /// coordinator, which knows who was sampled: the worst client's, its own rounds
    /// composed without amplification. Infinite under central noise, where the
    /// coordinator sees every update (`inf` in `metrics.csv`; JSON has no infinity, so
    /// `null` in `metrics.jsonl`); `None` without differential privacy.
    pub epsilon_coordinator: Option<f64>,
    /// Bytes the round's clients uploaded, all together: updates as sent (compressed, or
    /// masked under secure aggregation, or 4 bytes a parameter).
    pub bytes_up: u64,
    /// Bytes the round's clients downloaded, all together: the model each trained from.
    pub bytes_down: u64,
    /// The global model's accuracy on each client's own held-out split: the mean over
    /// the clients (`--client-holdout`, on with `--personalise`).
    pub client_accuracy_mean: Option<f64>,
    /// ... and its 10th percentile (nearest rank).
    pub client_accuracy_p10: Option<f64>,
    /// Each client's personalised model on its own held-out split: the mean.
    pub personal_accuracy_mean: Option<f64>,
    /// ... and the 10th percentile.
    pub personal_accuracy_p10: Option<f64>,
    /// Every client's figures after this round (written to `clients.csv` for the last).
    #[serde(skip)]
    pub clients: Option<Vec<super::personal::ClientAccuracy>>,
}

/// Everything a finished run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimulationResult {
    /// One record per round.
    pub rounds: Vec<RoundRecord>,
    /// Data and model facts.
    pub data: DataFacts,
    /// Client updates aggregated over the run.
    pub total_updates: usize,
    /// Seconds spent training and aggregating (excludes set-up and evaluation).
    pub training_seconds: f64,
    /// Seconds for the whole run, set-up included.
    pub wall_seconds: f64,
    /// Worker threads used for client training.
    pub threads: usize,
    /// Why the run ended before its last round (the privacy budget), if it did.
    pub stopped: Option<String>,
    /// FedBuff: mean staleness (server steps between a client's download and its
    /// update's use) over the updates aggregated; `None` for synchronous runs.
    pub mean_staleness: Option<f64>,
    /// Tasks that produced no usable update (each counted as a dropout), in order.
    pub failures: Vec<ClientFailure>,
    /// The global model after the last round.
    #[serde(skip)]
    pub final_model: std::sync::Arc<cohort_aggregation::ModelVector>,
}

impl SimulationResult {
    /// Client updates aggregated per second of training and aggregation.
    pub fn updates_per_second(&self) -> f64 {
        if self.training_seconds > 0.0 {
            self.total_updates as f64 / self.training_seconds
        } else {
            0.0
        }
    }
}
