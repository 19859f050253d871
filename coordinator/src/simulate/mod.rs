//! Simulation mode: a researcher's whole federated experiment in one process.
//!
//! [`simulate`] checks the settings and the data, trains the virtual clients round after
//! round through the [`crate::engine::RoundEngine`], and writes `metrics.csv` (and the
//! same rows as `metrics.jsonl`),
//! `summary.json`, `accuracy.png` and `accuracy.svg` into the output directory. Output is
//! staged next to the target and moved into place only when the run finishes, so a
//! failed run never leaves a directory that looks like a finished one.

mod board;
mod config;
mod fedbuff;
mod links;
mod output;
mod personal;
pub mod plot;
mod population;
pub mod python;
mod python_clients;
mod record;
mod run;
mod shared_memory;
mod straggler;

/// Why a setting cannot be used. Messages name the setting and the value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

use std::path::{Path, PathBuf};

use cohort_aggregation::Strategy;

use cohort_edge::data::DataError;
use cohort_edge::model::ModelError;
use cohort_edge::partition::PartitionError;
use cohort_edge::train::TrainError;
use serde::Serialize;

pub use cohort_aggregation::fedbuff::staleness_weight;
pub use config::{
    Attack, DEFAULT_BUFFER_SIZE, DEFAULT_STALENESS_EXPONENT, DatasetSpec, Mode, SimulationConfig,
};
pub use output::{MetricsWriter, StagedDir};
pub use personal::ClientAccuracy;
pub use plot::{Series, write_plots};
pub use population::{ClientFailure, ClientTask, DataFacts, Population, TaskResult};
pub use record::{RoundRecord, SimulationResult};
pub use run::{Prepared, prepare, run_rounds};
pub use straggler::{SECONDS_PER_SAMPLE_EPOCH, StragglerModel, Stragglers};

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
    /// The user's evaluation of the global model failed (the run has no test accuracy
    /// for that round, so it stops).
    #[error("evaluating the global model after round {round} failed: {reason}")]
    Evaluation {
        /// The round.
        round: u32,
        /// The exception's message.
        reason: String,
    },
    /// Every client trained in a round failed.
    #[error("every client trained in round {round} failed ({failed}); client {client}: {reason}")]
    RoundFailed {
        /// The round.
        round: u32,
        /// How many failed.
        failed: usize,
        /// The first failing client.
        client: u64,
        /// Its failure.
        reason: String,
    },
    /// The privacy noise cannot be drawn for these settings and this model (too much
    /// noise over too many coordinates for the lattice, or a count noise out of range).
    #[error("differential privacy noise: {0}")]
    Noise(String),
    /// The run was interrupted (Ctrl-C); nothing was written.
    #[error("interrupted")]
    Interrupted,
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
            | SimulationError::Train(_)
            | SimulationError::Noise(_) => 2,
            SimulationError::Client { .. }
            | SimulationError::Evaluation { .. }
            | SimulationError::RoundFailed { .. }
            | SimulationError::Interrupted
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
    /// Selected clients that dropped out, over all rounds (failed tasks included).
    pub total_dropped: usize,
    /// Tasks whose training failed (an exception, a bad update, a dead worker), over all
    /// rounds; each is also a dropout.
    pub total_failed: usize,
    /// What trained the clients: `built-in` or `python`.
    pub trainer: &'static str,
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
    /// Differential privacy: epsilon spent over the run (at the configured delta) against
    /// observers of the published models.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
    /// Differential privacy: epsilon spent over the run against the coordinator, which
    /// knows who was sampled (the worst client's own rounds, unamplified). `null` under
    /// central noise, where no epsilon holds (`epsilon_coordinator_unbounded` says why);
    /// absent without differential privacy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epsilon_coordinator: Option<Option<f64>>,
    /// Why `epsilon_coordinator` is `null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epsilon_coordinator_unbounded: Option<String>,
    /// Why the run ended before its last round, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// Simulated seconds for the whole run, by the straggler model.
    pub sim_seconds: f64,
    /// Bytes uploaded over the run (updates as sent: compressed, masked or plain).
    pub bytes_up: u64,
    /// Bytes downloaded over the run (the models clients trained from).
    pub bytes_down: u64,
    /// `bytes_up` per update aggregated.
    pub bytes_up_per_update: f64,
    /// `bytes_down` per update aggregated.
    pub bytes_down_per_update: f64,
    /// FedBuff: mean staleness of the updates aggregated, in server steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_staleness: Option<f64>,
    /// When the run first reached `--target-accuracy` (absent without a target).
    #[serde(flatten)]
    pub target: Option<TargetReached>,
}

/// When a run first reached its target test accuracy. With a target that was never
/// reached the `*_to_target` fields are `null`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetReached {
    /// The target test accuracy.
    pub target_accuracy: f64,
    /// The first round whose test accuracy is at least the target.
    pub rounds_to_target: Option<u32>,
    /// Simulated seconds at the end of that round.
    pub sim_seconds_to_target: Option<f64>,
    /// Client updates aggregated up to and including that round.
    pub updates_to_target: Option<usize>,
}

impl TargetReached {
    /// The first of `rounds` to reach `target` test accuracy.
    pub fn find(target: f64, rounds: &[RoundRecord]) -> Self {
        let mut updates = 0;
        for r in rounds {
            updates += r.participants;
            if r.test_accuracy >= target {
                return Self {
                    target_accuracy: target,
                    rounds_to_target: Some(r.round),
                    sim_seconds_to_target: Some(r.sim_seconds),
                    updates_to_target: Some(updates),
                };
            }
        }
        Self {
            target_accuracy: target,
            rounds_to_target: None,
            sim_seconds_to_target: None,
            updates_to_target: None,
        }
    }
}

impl Summary {
    fn new(cfg: &SimulationConfig, result: &SimulationResult, trainer: &'static str) -> Self {
        let last = result.rounds.last();
        let best = result.rounds.iter().max_by(|a, b| {
            a.test_accuracy
                .total_cmp(&b.test_accuracy)
                .then(b.round.cmp(&a.round))
        });
        let resolved = cfg.resolved();
        let bytes_up = result.rounds.iter().map(|r| r.bytes_up).sum();
        let bytes_down = result.rounds.iter().map(|r| r.bytes_down).sum();
        Summary {
            final_test_accuracy: last.map_or(0.0, |r| r.test_accuracy),
            final_test_loss: last.map_or(0.0, |r| r.test_loss),
            best_test_accuracy: best.map_or(0.0, |r| r.test_accuracy),
            best_round: best.map_or(0, |r| r.round),
            rounds: result.rounds.len() as u32,
            updates_per_second: result.updates_per_second(),
            total_updates: result.total_updates,
            total_dropped: result.rounds.iter().map(|r| r.dropped).sum(),
            total_failed: result.failures.len(),
            trainer,
            training_seconds: result.training_seconds,
            wall_seconds: result.wall_seconds,
            threads: result.threads,
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            strategy: cfg.strategy.to_string(),
            data: result.data.clone(),
            config: serde_json::to_value(&resolved).unwrap_or_default(),
            cohort_version: env!("CARGO_PKG_VERSION"),
            epsilon: last.and_then(|r| r.epsilon),
            epsilon_coordinator: last
                .and_then(|r| r.epsilon_coordinator)
                .map(|e| e.is_finite().then_some(e)),
            epsilon_coordinator_unbounded: last
                .and_then(|r| r.epsilon_coordinator)
                .filter(|e| e.is_infinite())
                .map(|_| {
                    if cfg.secure_aggregation {
                        "a round without noise (noise multiplier 0) released its sum exactly"
                            .to_string()
                    } else {
                        cohort_core::privacy::CENTRAL_NOISE_UNBOUNDED.to_string()
                    }
                }),
            stopped: result.stopped.clone(),
            sim_seconds: last.map_or(0.0, |r| r.sim_seconds),
            bytes_up,
            bytes_down,
            bytes_up_per_update: bytes_up as f64 / result.total_updates.max(1) as f64,
            bytes_down_per_update: bytes_down as f64 / result.total_updates.max(1) as f64,
            mean_staleness: result.mean_staleness,
            target: cfg
                .target_accuracy
                .map(|t| TargetReached::find(t, &result.rounds)),
        }
    }
}

fn default_out() -> PathBuf {
    PathBuf::from(format!(
        "runs/simulate-{}",
        chrono::Utc::now().format("%Y%m%d-%H%M%S")
    ))
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), SimulationError> {
    let json = serde_json::to_string_pretty(value).expect("summaries serialise");
    std::fs::write(path, json + "\n").map_err(|e| SimulationError::Output {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn plot_title(cfg: &SimulationConfig, strategy: &str) -> String {
    format!(
        "{} · {} · {} · {} clients · {}",
        cfg.dataset,
        cfg.model,
        cfg.partition_scheme(),
        cfg.clients,
        strategy
    )
}

fn plot_into(dir: &Path, title: &str, series: &[Series<'_>]) -> Result<(), SimulationError> {
    let png = dir.join("accuracy.png");
    write_plots(series, title, &png, &dir.join("accuracy.svg"))
        .map_err(|message| SimulationError::Output { path: png, message })
}

/// Runs one strategy on prepared data and writes the metrics, `summary.json` and the
/// plots into `dir`. `extra` also receives every row (the comparison's combined file).
fn run_into(
    dir: &Path,
    cfg: &SimulationConfig,
    out: &Path,
    pop: &dyn Population,
    mut extra: Option<&mut MetricsWriter>,
    mut on_round: impl FnMut(&RoundRecord),
) -> Result<(Summary, SimulationResult), SimulationError> {
    let strategy = cfg.strategy.to_string();
    let mut metrics = MetricsWriter::create(dir)?;
    let mut trackers = board::Trackers::start(cfg, &strategy, out)?;
    let result = run_rounds(cfg, pop, |record| {
        metrics.write(record, &strategy)?;
        trackers.round(record)?;
        if let Some(w) = extra.as_deref_mut() {
            w.write(record, &strategy)?;
        }
        on_round(record);
        Ok(())
    })?;
    metrics.finish()?;
    trackers.finish(&result.final_model);
    let mut resolved = cfg.clone();
    resolved.out = Some(out.to_path_buf());
    let summary = Summary::new(&resolved, &result, pop.trainer());
    write_json(&dir.join("summary.json"), &summary)?;
    if let Some(clients) = result.rounds.last().and_then(|r| r.clients.as_ref()) {
        write_clients_csv(&dir.join("clients.csv"), clients)?;
    }
    let title = if pop.trainer() == "python" {
        // The data and the model are the user's: name what Cohort knows of the run.
        format!(
            "python trainer · {} parameters · {} clients · {strategy}",
            result.data.model_parameters, cfg.clients
        )
    } else {
        plot_title(cfg, &strategy)
    };
    plot_into(
        dir,
        &title,
        &[Series {
            label: &strategy,
            records: &result.rounds,
        }],
    )?;
    Ok((summary, result))
}

/// `clients.csv`: every client's accuracy on its own held-out split after the last
/// round, for the global model and (with personalisation) its own.
fn write_clients_csv(path: &Path, clients: &[ClientAccuracy]) -> Result<(), SimulationError> {
    let mut text =
        String::from("client,train_samples,holdout_samples,global_accuracy,personal_accuracy\n");
    for c in clients {
        text.push_str(&format!(
            "{},{},{},{},{}\n",
            c.client,
            c.train_samples,
            c.holdout_samples,
            c.global_accuracy,
            c.personal_accuracy
                .map(|a| a.to_string())
                .unwrap_or_default()
        ));
    }
    std::fs::write(path, text).map_err(|e| output::output_error(path, e))
}

/// Runs a whole simulation and writes its outputs into `cfg.out`. `on_round` sees each
/// round's record as it finishes (for progress display).
pub fn simulate(
    cfg: &SimulationConfig,
    on_round: impl FnMut(&RoundRecord),
) -> Result<(Summary, PathBuf), SimulationError> {
    let out = cfg.out.clone().unwrap_or_else(default_out);
    // All input is checked before anything is written.
    let prepared = prepare(cfg)?;
    let staged = StagedDir::create(&out)?;
    let (summary, _) = run_into(staged.path(), cfg, &out, &prepared, None, on_round)?;
    Ok((summary, staged.commit()?))
}

/// Runs a whole simulation with clients that `pop` supplies (the Python SDK's worker
/// pool) and writes the same outputs as [`simulate`] into `cfg.out`. The data settings of
/// `cfg` (`dataset`, `model`, `partition`, `test-fraction`) are the population's
/// business and are not read here. Returns the summary, where the outputs are, and the
/// run's records (the final model is `result.rounds`' last publication, which the
/// population also saw).
pub fn simulate_population(
    cfg: &SimulationConfig,
    pop: &dyn Population,
    on_round: impl FnMut(&RoundRecord),
) -> Result<(Summary, PathBuf, SimulationResult), SimulationError> {
    cfg.validate()?;
    let out = cfg.out.clone().unwrap_or_else(default_out);
    let staged = StagedDir::create(&out)?;
    let (summary, result) = run_into(staged.path(), cfg, &out, pop, None, on_round)?;
    Ok((summary, staged.commit()?, result))
}

/// One strategy's line in a comparison's `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct ComparisonEntry {
    /// The strategy.
    pub strategy: String,
    /// Sub-directory with this strategy's own outputs.
    pub dir: String,
    /// Test accuracy of its final global model.
    pub final_test_accuracy: f64,
    /// Test loss of its final global model.
    pub final_test_loss: f64,
    /// Its best test accuracy over all rounds.
    pub best_test_accuracy: f64,
    /// Round of that best accuracy.
    pub best_round: u32,
    /// Client updates aggregated per second.
    pub updates_per_second: f64,
}

/// The `summary.json` of a comparison of strategies on identical data, partition,
/// initial model and client sampling.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// Each strategy's results, in the order given.
    pub runs: Vec<ComparisonEntry>,
    /// Rounds per run.
    pub rounds: u32,
    /// Data and model facts (the same for every run).
    pub data: DataFacts,
    /// The resolved configuration shared by the runs (`strategy` is the first one).
    pub config: serde_json::Value,
    /// Version of Cohort that produced the runs.
    pub cohort_version: &'static str,
}

/// A directory name for a strategy's outputs (`fedprox:1` becomes `fedprox-1`).
fn strategy_dir(strategy: &Strategy) -> String {
    strategy.to_string().replace(':', "-")
}

/// Runs the same experiment once per strategy, each into `DIR/<strategy>/`, and writes a
/// combined `metrics.csv` (with a `strategy` column), `summary.json` and overlaid plots
/// into `DIR`. Every run sees the same data, partition, initial model, client sampling
/// and dropout, so differences come from the strategy alone.
pub fn compare(
    cfg: &SimulationConfig,
    strategies: &[Strategy],
    mut on_round: impl FnMut(&Strategy, &RoundRecord),
) -> Result<(Comparison, PathBuf), SimulationError> {
    let mut names = std::collections::BTreeSet::new();
    if let Some(dup) = strategies.iter().find(|s| !names.insert(strategy_dir(s))) {
        return Err(ConfigError(format!("--strategy lists `{dup}` twice")).into());
    }
    let first = strategies
        .first()
        .ok_or_else(|| ConfigError("--strategy needs at least one strategy".into()))?;
    let out = cfg.out.clone().unwrap_or_else(default_out);
    let shared = SimulationConfig {
        strategy: *first,
        ..cfg.clone()
    };
    let prepared = prepare(&shared)?;
    let staged = StagedDir::create(&out)?;
    let mut combined = MetricsWriter::create(staged.path())?;
    let mut runs = Vec::with_capacity(strategies.len());
    let mut histories = Vec::with_capacity(strategies.len());
    for strategy in strategies {
        let dir_name = strategy_dir(strategy);
        let dir = staged.path().join(&dir_name);
        std::fs::create_dir(&dir).map_err(|e| SimulationError::Output {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        let run_cfg = SimulationConfig {
            strategy: *strategy,
            ..cfg.clone()
        };
        let (summary, result) = run_into(
            &dir,
            &run_cfg,
            &out.join(&dir_name),
            &prepared,
            Some(&mut combined),
            |r| on_round(strategy, r),
        )?;
        runs.push(ComparisonEntry {
            strategy: summary.strategy.clone(),
            dir: dir_name,
            final_test_accuracy: summary.final_test_accuracy,
            final_test_loss: summary.final_test_loss,
            best_test_accuracy: summary.best_test_accuracy,
            best_round: summary.best_round,
            updates_per_second: summary.updates_per_second,
        });
        histories.push((strategy.to_string(), result.rounds));
    }
    combined.finish()?;
    let mut resolved = shared.resolved();
    resolved.out = Some(out.clone());
    let comparison = Comparison {
        runs,
        rounds: cfg.rounds,
        data: prepared.facts().clone(),
        config: serde_json::to_value(&resolved).unwrap_or_default(),
        cohort_version: env!("CARGO_PKG_VERSION"),
    };
    write_json(&staged.path().join("summary.json"), &comparison)?;
    let series: Vec<Series<'_>> = histories
        .iter()
        .map(|(label, records)| Series { label, records })
        .collect();
    let labels: Vec<&str> = histories.iter().map(|(l, _)| l.as_str()).collect();
    plot_into(
        staged.path(),
        &plot_title(cfg, &labels.join(" vs ")),
        &series,
    )?;
    Ok((comparison, staged.commit()?))
}
