//! Simulation mode: a researcher's whole federated experiment in one process.
//!
//! [`simulate`] checks the settings and the data, trains the virtual clients round after
//! round through the [`crate::engine::RoundEngine`], and writes `metrics.csv`,
//! `summary.json`, `accuracy.png` and `accuracy.svg` into the output directory. Output is
//! staged next to the target and moved into place only when the run finishes, so a
//! failed run never leaves a directory that looks like a finished one.

mod config;
mod output;
mod plot;
mod run;

use std::path::PathBuf;

use cohort_edge::data::DataError;
use cohort_edge::model::ModelError;
use cohort_edge::partition::PartitionError;
use cohort_edge::train::TrainError;
use serde::Serialize;

pub use config::{ConfigError, DatasetSpec, SimulationConfig};
pub use output::{MetricsWriter, StagedDir};
pub use plot::write_plots;
pub use run::{DataFacts, Prepared, RoundRecord, SimulationResult, prepare, run_rounds};

use crate::engine::{ClientId, EngineError};

/// Why a simulation could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum SimulationError {
    /// A setting is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The data could not be loaded or split.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The data cannot be partitioned as asked.
    #[error(transparent)]
    Partition(#[from] PartitionError),
    /// The model does not fit the data.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A client's data does not fit its trainer.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// A client failed during a round.
    #[error("{client} failed in round {round}: {source}")]
    Client {
        /// The failing client.
        client: ClientId,
        /// The round.
        round: u32,
        /// What went wrong.
        source: TrainError,
    },
    /// The round engine refused a step (a bug if it happens in simulation).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Writing results failed.
    #[error("cannot write `{path}`: {message}")]
    Output {
        /// File or directory concerned.
        path: PathBuf,
        /// The underlying failure.
        message: String,
    },
}

impl SimulationError {
    /// Process exit status: 2 for bad input (settings, data, model), 1 for failures
    /// during the run.
    pub fn exit_code(&self) -> u8 {
        match self {
            SimulationError::Config(_)
            | SimulationError::Data(_)
            | SimulationError::Partition(_)
            | SimulationError::Model(_)
            | SimulationError::Train(_) => 2,
            SimulationError::Client { .. }
            | SimulationError::Engine(_)
            | SimulationError::Output { .. } => 1,
        }
    }
}

/// The `summary.json` of a finished run.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Test accuracy of the final global model.
    pub final_test_accuracy: f64,
    /// Test loss of the final global model.
    pub final_test_loss: f64,
    /// Best test accuracy over all rounds.
    pub best_test_accuracy: f64,
    /// Round of the best test accuracy.
    pub best_round: u32,
    /// Rounds run.
    pub rounds: u32,
    /// Client updates aggregated per second of training and aggregation.
    pub updates_per_second: f64,
    /// Client updates aggregated in total.
    pub total_updates: usize,
    /// Selected clients that dropped out, over all rounds.
    pub total_dropped: usize,
    /// Seconds spent training and aggregating.
    pub training_seconds: f64,
    /// Seconds for the whole run.
    pub wall_seconds: f64,
    /// Worker threads used.
    pub threads: usize,
    /// Logical cores of the machine.
    pub cores: usize,
    /// Strategy used (also inside `config`).
    pub strategy: String,
    /// Data and model facts.
    pub data: DataFacts,
    /// The full resolved configuration, defaults filled in.
    pub config: serde_json::Value,
    /// Version of Cohort that produced the run.
    pub cohort_version: &'static str,
}

impl Summary {
    fn new(cfg: &SimulationConfig, result: &SimulationResult) -> Self {
        let last = result.rounds.last();
        let best = result.rounds.iter().max_by(|a, b| {
            a.test_accuracy
                .total_cmp(&b.test_accuracy)
                .then(b.round.cmp(&a.round))
        });
        let mut resolved = cfg.clone();
        resolved.partition = Some(cfg.partition_scheme());
        resolved.clients_per_round = Some(cfg.clients_per_round());
        Summary {
            final_test_accuracy: last.map_or(0.0, |r| r.test_accuracy),
            final_test_loss: last.map_or(0.0, |r| r.test_loss),
            best_test_accuracy: best.map_or(0.0, |r| r.test_accuracy),
            best_round: best.map_or(0, |r| r.round),
            rounds: result.rounds.len() as u32,
            updates_per_second: result.updates_per_second(),
            total_updates: result.total_updates,
            total_dropped: result.rounds.iter().map(|r| r.dropped).sum(),
            training_seconds: result.training_seconds,
            wall_seconds: result.wall_seconds,
            threads: result.threads,
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            strategy: cfg.strategy.to_string(),
            data: result.data.clone(),
            config: serde_json::to_value(&resolved).unwrap_or_default(),
            cohort_version: env!("CARGO_PKG_VERSION"),
        }
    }
}

/// Runs a whole simulation and writes its outputs into `cfg.out`. `on_round` sees each
/// round's record as it finishes (for progress display).
pub fn simulate(
    cfg: &SimulationConfig,
    mut on_round: impl FnMut(&RoundRecord),
) -> Result<(Summary, PathBuf), SimulationError> {
    let out = cfg.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!(
            "runs/simulate-{}",
            chrono::Utc::now().format("%Y%m%d-%H%M%S")
        ))
    });
    // All input is checked before anything is written.
    let prepared = prepare(cfg)?;
    let staged = StagedDir::create(&out)?;
    let mut metrics = MetricsWriter::create(&staged.path().join("metrics.csv"))?;
    let result = run_rounds(cfg, &prepared, |record| {
        metrics.write(record)?;
        on_round(record);
        Ok(())
    })?;
    metrics.finish()?;
    let mut resolved = cfg.clone();
    resolved.out = Some(out.clone());
    let summary = Summary::new(&resolved, &result);
    let summary_path = staged.path().join("summary.json");
    let json = serde_json::to_string_pretty(&summary).expect("summary serialises");
    std::fs::write(&summary_path, json + "\n").map_err(|e| SimulationError::Output {
        path: summary_path.clone(),
        message: e.to_string(),
    })?;
    let title = format!(
        "{} · {} · {} · {} clients · {}",
        cfg.dataset,
        cfg.model,
        cfg.partition_scheme(),
        cfg.clients,
        cfg.strategy
    );
    let png = staged.path().join("accuracy.png");
    write_plots(
        &result.rounds,
        &title,
        &png,
        &staged.path().join("accuracy.svg"),
    )
    .map_err(|message| SimulationError::Output { path: png, message })?;
    let final_dir = staged.commit()?;
    Ok((summary, final_dir))
}
