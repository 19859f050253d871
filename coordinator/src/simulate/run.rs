//! The simulation loop: many virtual clients in one process, driven through the round
//! engine exactly as remote clients are.

use std::time::Instant;

use cohort_edge::data::{self, Dataset, Standardizer, SyntheticConfig};
use cohort_edge::model::{Evaluation, ModelSpec};
use cohort_edge::partition::partition;
use cohort_edge::train::{LocalModel, TrainError, Trainer};
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::SimulationError;
use super::config::{ConfigError, DatasetSpec, Mode, SimulationConfig};
use super::links::Links;
use super::population::{
    ClientFailure, ClientTask, Params, Population, TaskResult, Trained, malicious_clients,
};
use super::straggler::Stragglers;
use crate::engine::{
    ClientId, ClientUpdate, EngineConfig, EngineError, RoundEngine, RoundOutcome, RoundPlan,
    SecureMean,
};
use crate::seeds::{Stream, derive_seed, derive_seed_bytes};
use cohort_aggregation::privacy::central::CentralSum;
use cohort_aggregation::secagg::{self, Stage, local};
use cohort_core::privacy::BudgetAgainst;

use super::population::DataFacts;
use super::record::{RoundRecord, SimulationResult};

/// Data prepared for a run: standardised train and test sets and each client's model.
pub struct Prepared {
    clients: Vec<LocalModel>,
    test: Dataset,
    spec: ModelSpec,
    facts: DataFacts,
    /// Each client's held-out split (`None`: it holds none out), when the run scores
    /// the models on them; empty otherwise.
    holdouts: Vec<Option<LocalModel>>,
    /// The personalisation scheme and the clients' state.
    personal: Option<super::personal::PersonalRun>,
    /// Local training settings and seed for fine-tuning a personal model to score it.
    tuning: (cohort_edge::train::TrainConfig, u64),
}

impl Prepared {
    /// The virtual clients, in id order.
    pub fn clients(&self) -> &[LocalModel] {
        &self.clients
    }

    /// The model shape in use.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Facts about the prepared data.
    pub fn facts(&self) -> &DataFacts {
        &self.facts
    }

    /// Loss and accuracy of the model `params` on the held-out test set.
    pub(super) fn evaluate(&self, params: &[f32]) -> Result<Evaluation, SimulationError> {
        Ok(self
            .spec
            .evaluate(params, self.test.features.view(), &self.test.labels)?)
    }
}

fn load_dataset(cfg: &SimulationConfig) -> Result<Dataset, SimulationError> {
    Ok(match &cfg.dataset {
        DatasetSpec::Digits => data::digits(),
        DatasetSpec::BreastCancer => data::breast_cancer(),
        DatasetSpec::Synthetic { alpha, beta } => data::synthetic(&SyntheticConfig {
            alpha: *alpha,
            beta: *beta,
            devices: cfg.clients,
            seed: derive_seed(cfg.seed, Stream::Data, 0, 0),
            ..SyntheticConfig::default()
        })?,
        DatasetSpec::Csv(path) => data::load_csv(path)?,
        DatasetSpec::Mnist10k => data::mnist10k(),
    })
}

/// Loads, splits, standardises and partitions the data, and binds one model per client.
/// Everything that can be wrong with the input is found here, before any output exists.
pub fn prepare(cfg: &SimulationConfig) -> Result<Prepared, SimulationError> {
    cfg.validate()?;
    let dataset = load_dataset(cfg)?;
    let (mut train, mut test) = if cfg.dataset == DatasetSpec::Mnist10k {
        // The set's published split, so results compare with other tools' on it.
        let all: Vec<usize> = (0..dataset.len()).collect();
        let (head, tail) = all.split_at(data::MNIST10K_TRAIN);
        (dataset.subset(head), dataset.subset(tail))
    } else {
        data::stratified_split(
            &dataset,
            cfg.test_fraction,
            derive_seed(cfg.seed, Stream::Split, 0, 0),
        )?
    };
    let scaler = Standardizer::fit(&train.features);
    scaler.transform(&mut train.features)?;
    scaler.transform(&mut test.features)?;
    let scheme = cfg.partition_scheme();
    let parts = partition(
        &train.labels,
        train.num_classes(),
        train.groups.as_deref(),
        cfg.clients,
        &scheme,
        derive_seed(cfg.seed, Stream::Partition, 0, 0),
    )?;
    let spec = ModelSpec::new(&cfg.model, train.num_features(), train.num_classes())?;
    let personal = match &cfg.personalise {
        Some(scheme) => {
            scheme
                .personal_mask(spec.layout())
                .map_err(|e| ConfigError(format!("--personalise {scheme}: {e}")))?;
            Some(super::personal::PersonalRun::new(scheme.clone()))
        }
        None => None,
    };
    // Each client's own held-out split, drawn from its partition with a seed of its own.
    let holdout = cfg.client_holdout();
    let mut clients = Vec::with_capacity(parts.len());
    let mut holdouts = Vec::new();
    for (i, idx) in parts.iter().enumerate() {
        if holdout == 0.0 {
            clients.push(train.subset(idx));
            continue;
        }
        let mut idx = idx.clone();
        idx.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(
            cfg.seed,
            Stream::Split,
            1,
            i as u64,
        )));
        let held = if idx.len() >= 2 {
            ((holdout * idx.len() as f64).round() as usize).clamp(1, idx.len() - 1)
        } else {
            0
        };
        let (out, kept) = idx.split_at(held);
        clients.push(train.subset(kept));
        holdouts.push((!out.is_empty()).then(|| train.subset(out)));
    }
    let mut prepared = Prepared::new(spec.clone(), clients, test, &scheme.to_string())?;
    prepared.holdouts = holdouts
        .into_iter()
        .map(|h| h.map(|d| LocalModel::new(spec.clone(), &d)).transpose())
        .collect::<Result<_, TrainError>>()?;
    prepared.personal = personal;
    prepared.tuning = (
        cfg.train_config(),
        derive_seed(cfg.seed, Stream::LocalTraining, 0, 0),
    );
    Ok(prepared)
}

impl Prepared {
    /// Binds one model per client to data the caller has already split (for data that
    /// does not come from a [`SimulationConfig`], such as a benchmark's own generator).
    /// `partition` names how the data was split, for the summary.
    pub fn new(
        spec: ModelSpec,
        client_data: Vec<Dataset>,
        test: Dataset,
        partition: &str,
    ) -> Result<Self, SimulationError> {
        if client_data.is_empty() {
            return Err(ConfigError("a simulation needs at least one client".into()).into());
        }
        let mut sizes: Vec<usize> = client_data.iter().map(Dataset::len).collect();
        sizes.sort_unstable();
        let facts = DataFacts {
            train_samples: sizes.iter().sum(),
            test_samples: test.len(),
            features: spec.inputs(),
            classes: spec.classes(),
            partition: partition.to_string(),
            client_samples_min: sizes[0],
            client_samples_median: sizes[sizes.len() / 2],
            client_samples_max: sizes[sizes.len() - 1],
            model_parameters: spec.num_params(),
        };
        let clients = client_data
            .iter()
            .map(|d| LocalModel::new(spec.clone(), d))
            .collect::<Result<Vec<_>, TrainError>>()?;
        // Checks the test set against the model once, so evaluation cannot fail later.
        spec.evaluate(
            &vec![0.0; spec.num_params()],
            test.features.view(),
            &test.labels,
        )?;
        Ok(Self {
            clients,
            test,
            spec,
            facts,
            holdouts: Vec::new(),
            personal: None,
            tuning: (cohort_edge::train::TrainConfig::default(), 0),
        })
    }
}

impl Population for Prepared {
    fn clients(&self) -> usize {
        self.clients.len()
    }

    fn num_samples(&self, client: ClientId) -> usize {
        self.clients
            .get(client.0 as usize)
            .map_or(0, |c| c.num_samples())
    }

    fn max_weight(&self) -> u32 {
        self.facts.client_samples_max.clamp(1, u32::MAX as usize) as u32
    }

    fn initial_model(&self, seed: u64) -> Result<cohort_aggregation::ModelVector, SimulationError> {
        Ok(self.spec.init(seed))
    }

    /// Trains on the rayon pool. The built-in trainer fails only on a bug or on data it
    /// should have refused in [`prepare`], so a failure ends the run.
    fn train(&self, tasks: &[ClientTask<'_>]) -> Result<Vec<TaskResult>, SimulationError> {
        tasks
            .par_iter()
            .map(|t| {
                let model = &self.clients[t.client.0 as usize];
                match &self.personal {
                    Some(run) => run.train(t.client.0, model, t.global, t.train, t.seed),
                    None => model.train(t.global, t.train, t.seed),
                }
                .map(Ok)
                .map_err(|source| SimulationError::Client {
                    client: t.client,
                    round: t.round,
                    source,
                })
            })
            .collect()
    }

    fn evaluate(
        &self,
        _round: u32,
        global: &cohort_aggregation::ModelVector,
    ) -> Result<Evaluation, SimulationError> {
        Prepared::evaluate(self, global.values())
    }

    fn facts(&self) -> DataFacts {
        self.facts.clone()
    }

    fn trainer(&self) -> &'static str {
        "built-in"
    }

    fn client_accuracies(
        &self,
        global: &cohort_aggregation::ModelVector,
    ) -> Result<Option<Vec<super::personal::ClientAccuracy>>, SimulationError> {
        if self.holdouts.is_empty() {
            return Ok(None);
        }
        let (config, seed) = &self.tuning;
        super::personal::evaluate_clients(
            &self.clients,
            &self.holdouts,
            self.personal.as_ref(),
            global,
            config,
            *seed,
        )
        .map(Some)
    }
}

/// Runs every round of a prepared simulation, calling `on_round` after each one (to
/// stream metrics and show progress). Clients train in parallel on the rayon pool.
pub fn run_rounds(
    cfg: &SimulationConfig,
    pop: &dyn Population,
    mut on_round: impl FnMut(&RoundRecord) -> Result<(), SimulationError>,
) -> Result<SimulationResult, SimulationError> {
    if cfg.mode == Mode::Fedbuff {
        return super::fedbuff::run(cfg, pop, on_round);
    }
    let started = Instant::now();
    let initial = pop.initial_model(derive_seed(cfg.seed, Stream::ModelInit, 0, 0))?;
    let initial_len = initial.len();
    let mut engine = RoundEngine::new(
        initial,
        EngineConfig {
            clients_per_round: cfg.clients_per_round(),
            min_participants: cfg.min_participants,
            train: cfg.train_config(),
            strategy: cfg.strategy,
            server_lr: cfg.server_lr.map(|lr| lr as f32),
            // A simulation's rounds are a fixed budget: a round below quorum is counted
            // with the model unchanged, and the next one runs.
            failed_attempts: cohort_core::round::FailedAttemptPolicy::Skip,
        },
    )?;
    let reducer = cohort_aggregation::reduce::select(cfg.reducer)
        .map_err(|e| ConfigError(format!("--reducer {}: {e}", cfg.reducer)))?
        .reducer;
    engine.set_reducer(reducer.clone());
    let all: Vec<ClientId> = (0..pop.clients() as u64).map(ClientId).collect();
    let stragglers = Stragglers::new(cfg.straggler, all.len(), cfg.seed);
    // The simulated clock: every round lasts as long as its slowest reporting client.
    let mut clock = 0.0;
    let mut tick = |reporting: &[ClientId]| {
        clock += round_sim_seconds(cfg, pop, &stragglers, reporting);
        clock
    };
    let threads = rayon::current_num_threads();
    // Updates are trained a chunk at a time and folded in selection order: memory stays
    // bounded by the chunk, not the cohort, and the fold order (hence every float) is the
    // same whatever the thread timing. Chunks are the reducers' batches (up to 512 MiB
    // of updates, so that a round of a million-parameter model folds in one pass and
    // writes each sum once), and at least four per thread so that uneven client sizes
    // even out within a chunk.
    let (neighbours, threshold) = cfg.secure_graph();
    let shared = RoundsShared {
        malicious: malicious_clients(cfg, all.len()),
        all,
        chunk: cohort_aggregation::reduce::batch_len(initial_len).max(threads * 4),
        reducer,
        neighbours,
        threshold,
    };
    let mut records = Vec::with_capacity(cfg.rounds as usize);
    let mut total_updates = 0;
    let mut training_seconds = 0.0;
    let mut ledger = PrivacyLedger::new(cfg)?;
    let mut stopped = None;
    let mut run = Run {
        cfg,
        pop,
        failures: Vec::new(),
        links: Links::new(cfg.compress_up, cfg.compress_down, cfg.seed),
    };
    for _ in 0..cfg.rounds {
        let round_start = Instant::now();
        let round_no = engine.rounds_closed() + 1;
        let (outcome, reporting) = match cfg.dp_noise_multiplier {
            Some(sigma) => {
                match private_round_step(&mut run, &mut engine, &mut ledger, &shared, sigma)? {
                    PrivateStep::Ran(outcome, reporting) => (outcome, reporting),
                    PrivateStep::OverBudget(why) => {
                        stopped = Some(why);
                        break;
                    }
                }
            }
            None => plain_round_step(&mut run, &mut engine, &shared, round_no)?,
        };
        training_seconds += round_start.elapsed().as_secs_f64();
        total_updates += outcome.participants;
        let sim = tick(&reporting);
        let traffic = run.links.take_traffic();
        let mut record = record_round(pop, &engine, &outcome, round_start, sim, traffic)?;
        if cfg.dp_noise_multiplier.is_some() {
            ledger.record(cfg, &mut record)?;
        }
        on_round(&record)?;
        records.push(record);
    }
    Ok(SimulationResult {
        rounds: records,
        data: pop.facts(),
        total_updates,
        training_seconds,
        wall_seconds: started.elapsed().as_secs_f64(),
        threads,
        stopped,
        mean_staleness: None,
        failures: run.failures,
        final_model: engine.global().clone(),
    })
}

/// What every round of a synchronous run takes from the run's set-up.
struct RoundsShared {
    /// Every client, in id order.
    all: Vec<ClientId>,
    malicious: std::collections::BTreeSet<ClientId>,
    /// Clients trained at a time in a plain round.
    chunk: usize,
    reducer: std::sync::Arc<dyn cohort_aggregation::reduce::Reducer>,
    /// The secure rounds' neighbourhood and threshold without differential privacy.
    neighbours: usize,
    threshold: usize,
}

/// A round without differential privacy: the engine samples the cohort, the planned
/// clients drop, the rest train (masked, under secure aggregation). Returns the outcome
/// and the clients that reported.
fn plain_round_step(
    run: &mut Run<'_>,
    engine: &mut RoundEngine,
    shared: &RoundsShared,
    round_no: u32,
) -> Result<(RoundOutcome, Vec<ClientId>), SimulationError> {
    let cfg = run.cfg;
    let mut select_rng =
        ChaCha8Rng::seed_from_u64(derive_seed(cfg.seed, Stream::Selection, round_no, 0));
    let plan = engine.open_round(&shared.all, &mut select_rng)?;
    // Under secure aggregation the same clients drop as in a plain run with this seed;
    // they only stop at another stage.
    let dropping = dropouts(cfg, round_no, &plan.selected);
    let reporting = survivors(&plan.selected, &dropping);
    let outcome = if cfg.secure_aggregation {
        secure_round(
            run,
            engine,
            &plan,
            &dropping,
            round_no,
            SecureSettings {
                reducer: shared.reducer.clone(),
                neighbours: shared.neighbours,
                threshold: shared.threshold,
                noise: None,
            },
        )?
    } else {
        plain_round(
            run,
            engine,
            &plan,
            &reporting,
            &shared.malicious,
            shared.chunk,
        )?
    };
    Ok((outcome, reporting))
}

/// What a differentially private round step did.
enum PrivateStep {
    /// The round ran: its outcome and the clients that reported.
    Ran(RoundOutcome, Vec<ClientId>),
    /// The round's worst case could go over the budget, so it never started: why.
    OverBudget(String),
}

/// A round of differential privacy: Poisson sampling, the budget checked against the
/// round's worst case before it runs, then central noise on a plain round, or the
/// survivors' noise shares under secure aggregation, charged to the ledger.
fn private_round_step(
    run: &mut Run<'_>,
    engine: &mut RoundEngine,
    ledger: &mut PrivacyLedger,
    shared: &RoundsShared,
    sigma: f64,
) -> Result<PrivateStep, SimulationError> {
    let cfg = run.cfg;
    let round_no = engine.rounds_closed() + 1;
    let sampled = poisson_sample(cfg, &shared.all, round_no);
    // Under secure aggregation the noise is the survivors' shares, so a round's
    // multiplier falls when clients drop, down to what the threshold (the fewest clients
    // that can still unmask) carries. The round is accounted at that worst case before
    // it runs: one that could go over the budget never starts.
    let graph = cfg
        .secure_aggregation
        .then(|| round_graph(cfg, sampled.len()));
    let worst = match graph {
        Some(Some((_, t))) => sigma * (t as f64 / sampled.len() as f64).sqrt(),
        // Too few clients for a secure round: nothing is released.
        Some(None) => f64::INFINITY,
        None => sigma,
    };
    if let Some(why) = ledger.refusal(cfg, &sampled, worst, round_no)? {
        return Ok(PrivateStep::OverBudget(why));
    }
    let plan = engine.open_round_for(&sampled)?;
    let dropping = dropouts(cfg, round_no, &plan.selected);
    let reporting = survivors(&plan.selected, &dropping);
    let (outcome, spent) = match graph {
        Some(Some((k, t))) => {
            let noise = cohort_aggregation::privacy::distributed::DistributedNoise {
                l2_clip: cfg.dp_clip,
                noise_multiplier: sigma,
            };
            let outcome = secure_round(
                run,
                engine,
                &plan,
                &dropping,
                round_no,
                SecureSettings {
                    reducer: shared.reducer.clone(),
                    neighbours: k,
                    threshold: t,
                    noise: Some((noise, cfg.sampling_rate() * shared.all.len() as f64)),
                },
            )?;
            // A round that could not be unmasked released nothing.
            let spent = outcome
                .status
                .published()
                .then(|| sigma * (outcome.participants as f64 / plan.selected.len() as f64).sqrt());
            (outcome, spent)
        }
        Some(None) => (engine.close_round_secure(None)?, None),
        None => (
            private_round(
                run,
                engine,
                &plan,
                &reporting,
                sigma,
                &mut ledger.adaptive_clip,
            )?,
            Some(sigma),
        ),
    };
    if let Some(spent) = spent {
        ledger.charge(cfg, &plan.selected, spent)?;
    }
    Ok(PrivateStep::Ran(outcome, reporting))
}

/// What a differentially private run has spent: against observers (the accountant of
/// the sampled rounds) and against the coordinator (each client's own rounds,
/// unamplified), and the adaptive clipping bound as it moves.
struct PrivacyLedger {
    accountant: cohort_aggregation::privacy::rdp::RdpAccountant,
    clients_spent: cohort_aggregation::privacy::rdp::ParticipantLedger<ClientId>,
    adaptive_clip: Option<cohort_aggregation::privacy::clip::AdaptiveClip>,
}

fn dp_error(e: cohort_aggregation::privacy::rdp::PrivacyError) -> ConfigError {
    ConfigError(format!("differential privacy: {e}"))
}

impl PrivacyLedger {
    fn new(cfg: &SimulationConfig) -> Result<Self, SimulationError> {
        let adaptive_clip = match cfg.dp_clip_quantile {
            Some(quantile) => Some(cohort_aggregation::privacy::clip::AdaptiveClip {
                bound: cfg.dp_clip,
                target_quantile: quantile,
                learning_rate: 0.2,
                count_noise_std: cfg.adaptive_clip_noise()?.0,
            }),
            None => None,
        };
        Ok(Self {
            accountant: cohort_aggregation::privacy::rdp::RdpAccountant::new(),
            clients_spent: cohort_aggregation::privacy::rdp::ParticipantLedger::new(),
            adaptive_clip,
        })
    }

    /// Why round `round_no`, charged at multiplier `worst` to the clients `sampled`,
    /// must not run: its epsilon could go over the budget the run is held to.
    fn refusal(
        &self,
        cfg: &SimulationConfig,
        sampled: &[ClientId],
        worst: f64,
        round_no: u32,
    ) -> Result<Option<String>, SimulationError> {
        let Some(budget) = cfg.dp_epsilon.filter(|_| worst.is_finite()) else {
            return Ok(None);
        };
        Ok(match cfg.dp_budget_against {
            BudgetAgainst::Observers => {
                let mut next = self.accountant.clone();
                next.compose(cfg.sampling_rate(), worst, 1)
                    .map_err(dp_error)?;
                let eps = next.epsilon(cfg.dp_delta).map_err(dp_error)?;
                (eps > budget).then(|| {
                    format!(
                        "privacy budget: round {round_no} could bring epsilon to {eps:.4} > {budget}"
                    )
                })
            }
            BudgetAgainst::Coordinator => {
                let next = self
                    .clients_spent
                    .worst_after(sampled, worst)
                    .map_err(dp_error)?
                    .unwrap_or_default();
                let eps = next.epsilon(cfg.dp_delta).map_err(dp_error)?;
                (eps > budget).then(|| {
                    format!(
                        "privacy budget against the coordinator: round {round_no} could \
                         bring a sampled client's epsilon to {eps:.4} > {budget}"
                    )
                })
            }
        })
    }

    /// Charges a round released at multiplier `spent` with the cohort `selected`.
    fn charge(
        &mut self,
        cfg: &SimulationConfig,
        selected: &[ClientId],
        spent: f64,
    ) -> Result<(), SimulationError> {
        self.accountant
            .compose(cfg.sampling_rate(), spent, 1)
            .map_err(dp_error)?;
        // Every sampled client, dropped or not: one that dropped after masking is still
        // in the sum, and the coordinator knows it was asked.
        if cfg.secure_aggregation {
            for &client in selected {
                self.clients_spent.charge(client, spent).map_err(dp_error)?;
            }
        }
        Ok(())
    }

    /// Writes both epsilons spent so far into the round's record.
    fn record(
        &self,
        cfg: &SimulationConfig,
        record: &mut RoundRecord,
    ) -> Result<(), SimulationError> {
        record.epsilon = Some(self.accountant.epsilon(cfg.dp_delta).map_err(dp_error)?);
        record.epsilon_coordinator = Some(if cfg.secure_aggregation {
            let worst = self
                .clients_spent
                .worst()
                .map(|(_, w)| w)
                .unwrap_or_default();
            worst.epsilon(cfg.dp_delta).map_err(dp_error)?
        } else {
            f64::INFINITY
        });
        Ok(())
    }
}

/// What every round of a run shares: its settings, its clients, and the tasks that
/// failed so far.
struct Run<'a> {
    cfg: &'a SimulationConfig,
    pop: &'a dyn Population,
    failures: Vec<ClientFailure>,
    links: Links,
}

/// How a trained update reaches the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Upload {
    /// As it is, or compressed with `--compress-up` (plain rounds).
    Plain,
    /// Quantised and masked inside the secure aggregation protocol.
    Masked,
}

/// A plaintext round: the reporting clients train (a chunk at a time, folded in
/// selection order), the malicious ones replace their update with the attack, and the
/// round closes with the weighted mean or the robust rule.
fn plain_round(
    run: &mut Run<'_>,
    engine: &mut RoundEngine,
    plan: &RoundPlan,
    reporting: &[ClientId],
    malicious: &std::collections::BTreeSet<ClientId>,
    chunk: usize,
) -> Result<RoundOutcome, SimulationError> {
    let (cfg, pop, links) = (run.cfg, run.pop, &run.links);
    let failures = &mut run.failures;
    let round_no = plan.task.round;
    let task = &plan.task;
    let global = task.global.values();
    let training = Training {
        cfg,
        pop,
        links,
        upload: Upload::Plain,
        task,
        round_no,
    };
    // A robust rule needs every update at once; the weighted mean folds them as they
    // come.
    let mut kept: Vec<(Vec<f32>, u64, f64)> = Vec::new();
    for batch in reporting.chunks(chunk) {
        train_clients(&training, batch, failures, |mut updates| {
            for (id, u) in &mut updates {
                if malicious.contains(id) {
                    let attacked: Vec<f32> = u
                        .params
                        .values()
                        .iter()
                        .zip(global)
                        .map(|(p, g)| g + cfg.attack.apply(p - g))
                        .collect();
                    u.params = Params::Owned(attacked);
                }
            }
            if cfg.aggregator.is_some() {
                for (_, u) in updates {
                    kept.push((
                        delta(u.params.values(), global),
                        u.num_samples as u64,
                        u.train_loss,
                    ));
                }
                return Ok(());
            }
            // One fold over the part: the sums are read and written once per part, not
            // once per update.
            let mut submitted: Vec<(ClientId, ClientUpdate<'_>)> =
                Vec::with_capacity(updates.len());
            for (id, u) in &updates {
                let params = u.params.finite().map_err(|index| EngineError::BadUpdate {
                    client: *id,
                    source: cohort_aggregation::AggregationError::NonFinite { index },
                })?;
                submitted.push((
                    *id,
                    ClientUpdate {
                        params,
                        num_samples: u.num_samples as u64,
                        train_loss: u.train_loss,
                    },
                ));
            }
            engine.submit_batch(&submitted)?;
            Ok(())
        })?;
    }
    match cfg.aggregator {
        Some(rule) => close_robust(engine, rule, &kept, global, task),
        None => Ok(engine.close_round()?),
    }
}

/// An update's difference from the global model it started from.
fn delta(update: &[f32], global: &[f32]) -> Vec<f32> {
    update.iter().zip(global).map(|(p, g)| p - g).collect()
}

/// Simulated seconds of a synchronous round: its slowest reporting client's local
/// training. A round nobody reports to takes no time (the model does not move, and the
/// next round starts at once).
fn round_sim_seconds(
    cfg: &SimulationConfig,
    pop: &dyn Population,
    stragglers: &Stragglers,
    reporting: &[ClientId],
) -> f64 {
    reporting
        .iter()
        .map(|id| {
            let i = id.0 as usize;
            let samples = pop.num_samples(*id);
            stragglers.task_seconds(i, samples, cfg.local_epochs)
        })
        .fold(0.0, f64::max)
}

/// What the clients of one round train on, and how their updates come back.
struct Training<'a> {
    cfg: &'a SimulationConfig,
    pop: &'a dyn Population,
    links: &'a Links,
    upload: Upload,
    task: &'a crate::engine::Task,
    round_no: u32,
}

/// Clients `ids` train on the round's task, each with its own reproducible seed, from
/// the model it received (the global model, or its own decoded copy of a compressed
/// one). The updates come back in the order of `ids`, as the coordinator has them (a
/// plain round's decoded from what was uploaded, see [`Links`]); a client whose task
/// failed is left out (a dropout) and its failure is added to `failures`.
fn train_clients(
    training: &Training<'_>,
    ids: &[ClientId],
    failures: &mut Vec<ClientFailure>,
    mut consume: impl for<'a> FnMut(Vec<(ClientId, Trained<'a>)>) -> Result<(), SimulationError>,
) -> Result<(), SimulationError> {
    let Training {
        cfg,
        pop,
        links,
        upload,
        task,
        round_no,
    } = *training;
    let received = links.downloads(round_no, ids, &task.global)?;
    let model_of = |i: usize| received.as_ref().map_or(&*task.global, |r| &r[i]);
    let tasks: Vec<ClientTask<'_>> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| ClientTask {
            client: id,
            round: round_no,
            // Each client's decoded copy is a model of its own for a worker's cache.
            model_version: match received {
                None => u64::from(round_no - 1),
                Some(_) => u64::from(round_no) << 32 | id.0,
            },
            global: model_of(i),
            train: &task.train,
            seed: derive_seed(cfg.seed, Stream::LocalTraining, round_no, id.0),
        })
        .collect();
    let before = failures.len();
    let mut trained = 0;
    pop.train_in_place(&tasks, &mut |first, outcomes| {
        let mut updates = Vec::with_capacity(outcomes.len());
        for (i, (&id, outcome)) in ids[first..].iter().zip(outcomes).enumerate() {
            match outcome {
                Ok(update) => updates.push((first + i, id, update)),
                Err(failure) => failures.push(failure),
            }
        }
        trained += updates.len();
        if updates.is_empty() {
            return Ok(());
        }
        let updates = updates
            .into_par_iter()
            .map(|(i, id, mut update)| {
                let arrived = match upload {
                    Upload::Plain => {
                        links.upload(round_no, id, model_of(i), &task.global, &update.params)?
                    }
                    Upload::Masked => received
                        .as_ref()
                        .map(|_| Links::rebase(model_of(i), &task.global, &update.params)),
                };
                if let Some(values) = arrived {
                    update.params = Params::Owned(values);
                }
                Ok((id, update))
            })
            .collect::<Result<Vec<_>, SimulationError>>()?;
        consume(updates)
    })?;
    // One failing client is a dropout; all of them is a bug in the training code, which
    // no number of further rounds would fix.
    if trained == 0
        && let Some(first) = failures.get(before)
    {
        return Err(SimulationError::RoundFailed {
            round: round_no,
            failed: failures.len() - before,
            reason: first.reason.clone(),
            client: first.client,
        });
    }
    Ok(())
}

/// Which of a round's selected clients drop out (the same draws whatever the round's
/// kind, so a seed drops the same clients in plain and secure runs).
fn dropouts(cfg: &SimulationConfig, round_no: u32, selected: &[ClientId]) -> Vec<bool> {
    let mut drop_rng =
        ChaCha8Rng::seed_from_u64(derive_seed(cfg.seed, Stream::Dropout, round_no, 0));
    selected
        .iter()
        .map(|_| drop_rng.random::<f64>() < cfg.dropout)
        .collect()
}

/// The selected clients that do not drop.
fn survivors(selected: &[ClientId], dropping: &[bool]) -> Vec<ClientId> {
    selected
        .iter()
        .zip(dropping)
        .filter(|(_, d)| !**d)
        .map(|(id, _)| *id)
        .collect()
}

/// Poisson sampling, as the privacy accountant assumes: every client takes part in round
/// `round_no` with probability `q`, independently.
fn poisson_sample(cfg: &SimulationConfig, all: &[ClientId], round_no: u32) -> Vec<ClientId> {
    let q = cfg.sampling_rate();
    let mut select_rng =
        ChaCha8Rng::seed_from_u64(derive_seed(cfg.seed, Stream::Selection, round_no, 0));
    all.iter()
        .copied()
        .filter(|_| select_rng.random::<f64>() < q)
        .collect()
}

/// Secure aggregation's neighbours and threshold for a round of `n` sampled clients
/// (defaults filled in); `None` when `n` clients cannot hold a secure round with them.
fn round_graph(cfg: &SimulationConfig, n: usize) -> Option<(usize, usize)> {
    if n < 2 {
        return None;
    }
    let k = cfg
        .neighbours
        .unwrap_or_else(|| secagg::default_neighbours(n));
    let t = cfg
        .threshold
        .unwrap_or_else(|| secagg::default_threshold(n, k));
    let effective = secagg::effective_degree(n, k);
    (t <= effective && 2 * t > effective).then_some((k, t))
}

/// One round of central differential privacy (DP-FedAvg, McMahan et al. 2018): every
/// client takes part with probability `q` (Poisson sampling, as the accountant assumes),
/// each update is clipped to L2 norm `C`, the sum gets `N(0, (sigma C)^2)` per
/// coordinate, and it is divided by the expected count `q N` (a fixed denominator, so the
/// number of participants is not revealed through the scale). Clients weigh equally:
/// a sample count would raise a client's influence past the clip.
fn private_round(
    run: &mut Run<'_>,
    engine: &mut RoundEngine,
    plan: &RoundPlan,
    reporting: &[ClientId],
    sigma: f64,
    adaptive_clip: &mut Option<cohort_aggregation::privacy::clip::AdaptiveClip>,
) -> Result<RoundOutcome, SimulationError> {
    let (cfg, pop, links) = (run.cfg, run.pop, &run.links);
    let failures = &mut run.failures;
    let round_no = plan.task.round;
    let q = cfg.sampling_rate();
    let expected = (q * pop.clients() as f64).max(1.0);
    // With an adaptive clip, part of the privacy goes to the count that moves it, and the
    // update gets the noise multiplier that is left (see `adaptive_clip_noise`).
    let (clip, update_sigma) = match adaptive_clip {
        Some(rule) => (rule.bound, cfg.adaptive_clip_noise()?.1),
        None => (cfg.dp_clip, sigma),
    };
    let task = &plan.task;
    let global = task.global.values();
    let mut sum = CentralSum::new(global.len(), clip);
    let mut updates: Vec<(Vec<f32>, u64, f64, bool)> = Vec::new();
    let training = Training {
        cfg,
        pop,
        links,
        upload: Upload::Plain,
        task,
        round_no,
    };
    train_clients(&training, reporting, failures, |part| {
        updates.par_extend(part.into_par_iter().map(|(_, u)| {
            let mut delta: Vec<f32> = delta(u.params.values(), global);
            let within = sum.clip(&mut delta);
            (delta, u.num_samples as u64, u.train_loss, within)
        }));
        Ok(())
    })?;
    let noise_error = |e: &dyn std::fmt::Display| SimulationError::Noise(e.to_string());
    for (delta, _, _, within) in &updates {
        sum.add_clipped(delta, *within)
            .map_err(|e| noise_error(&e))?;
    }
    let mut noise_rng = rand_chacha::ChaCha20Rng::seed_from_u64(derive_seed(
        cfg.seed,
        Stream::PrivacyNoise,
        round_no,
        0,
    ));
    // The fixed denominator again: the adaptive rule's fraction is over the expected count.
    let (mean, _) = sum
        .finish(
            global,
            update_sigma,
            expected,
            adaptive_clip.as_mut(),
            &mut noise_rng,
        )
        .map_err(|e| noise_error(&e))?;
    let samples: u64 = updates.iter().map(|u| u.1).sum();
    Ok(engine.close_round_secure(Some(SecureMean {
        mean: cohort_aggregation::ModelVector::new(task.global.layout().clone(), mean)
            .expect("the model's own layout"),
        participants: updates.len(),
        samples,
        // The clients' losses are not noised: releasing their mean would leak past the
        // guarantee.
        train_loss: None,
    }))?)
}

/// Closes a plaintext round with a robust rule over the clients' updates (`(delta,
/// samples, loss)`, in selection order). Too few updates for the rule, or for the quorum,
/// leave the model as it is.
fn close_robust(
    engine: &mut RoundEngine,
    rule: cohort_aggregation::robust::RobustRule,
    kept: &[(Vec<f32>, u64, f64)],
    global: &[f32],
    task: &crate::engine::Task,
) -> Result<RoundOutcome, SimulationError> {
    let deltas: Vec<&[f32]> = kept.iter().map(|(d, _, _)| d.as_slice()).collect();
    let samples: u64 = kept.iter().map(|(_, n, _)| n).sum();
    let train_loss = (samples > 0)
        .then(|| kept.iter().map(|(_, n, l)| *n as f64 * l).sum::<f64>() / samples as f64);
    let result = match cohort_aggregation::robust::aggregate(rule, &deltas) {
        Ok(delta) => Some(SecureMean {
            mean: cohort_aggregation::ModelVector::new(
                task.global.layout().clone(),
                global.iter().zip(&delta).map(|(g, d)| g + d).collect(),
            )
            .expect("the model's own layout"),
            participants: kept.len(),
            samples,
            train_loss,
        }),
        // Fewer updates than the rule needs: nothing to publish this round.
        Err(cohort_aggregation::robust::RobustError::Parameters(_))
        | Err(cohort_aggregation::robust::RobustError::Empty) => None,
        Err(e) => return Err(ConfigError(format!("--aggregator {rule}: {e}")).into()),
    };
    Ok(engine.close_round_secure(result)?)
}

fn record_round(
    pop: &dyn Population,
    engine: &RoundEngine,
    outcome: &RoundOutcome,
    round_start: Instant,
    sim_seconds: f64,
    traffic: super::links::Traffic,
) -> Result<RoundRecord, SimulationError> {
    let eval = pop.evaluate(outcome.round, engine.global())?;
    let per_client = pop.client_accuracies(engine.global())?;
    let summary = |pick: fn(&super::personal::ClientAccuracy) -> Option<f64>| {
        per_client.as_ref().and_then(|all| {
            let values: Vec<f64> = all.iter().filter_map(pick).collect();
            super::personal::mean_and_p10(&values)
        })
    };
    let global = summary(|c| Some(c.global_accuracy));
    let personal = summary(|c| c.personal_accuracy);
    Ok(RoundRecord {
        client_accuracy_mean: global.map(|g| g.0),
        client_accuracy_p10: global.map(|g| g.1),
        personal_accuracy_mean: personal.map(|p| p.0),
        personal_accuracy_p10: personal.map(|p| p.1),
        clients: per_client,
        round: outcome.round,
        test_accuracy: eval.accuracy,
        test_loss: eval.loss,
        participants: outcome.participants,
        dropped: outcome.dropped,
        seconds: round_start.elapsed().as_secs_f64(),
        selected: outcome.selected,
        train_loss: outcome.train_loss,
        samples: outcome.samples,
        status: outcome.status,
        sim_seconds,
        epsilon: None,
        epsilon_coordinator: None,
        bytes_up: traffic.bytes_up,
        bytes_down: traffic.bytes_down,
    })
}

/// How one secure round is set up.
struct SecureSettings {
    neighbours: usize,
    threshold: usize,
    /// Removes the masks on the server's side.
    reducer: std::sync::Arc<dyn cohort_aggregation::reduce::Reducer>,
    /// Distributed differential privacy: each client's noise share and the fixed
    /// denominator (the expected number of clients) that the noisy sum is divided by.
    noise: Option<(
        cohort_aggregation::privacy::distributed::DistributedNoise,
        f64,
    )>,
}

/// The settings of a simulated secure round (with the run's upload compression and the
/// round's one rotation), checked, and the bytes of one client's masked input: the model
/// words in the round's width, the weight and loss words in 32 bits.
fn secure_config(
    cfg: &SimulationConfig,
    plan: &RoundPlan,
    round_no: u32,
    (neighbours, threshold): (usize, usize),
    quantization: secagg::QuantizationParams,
) -> Result<(secagg::RoundConfig, usize), SimulationError> {
    let config = secagg::RoundConfig {
        session: derive_seed_bytes(cfg.seed, Stream::SecureAggregation, round_no),
        context: secagg::RoundContext {
            experiment: String::new(),
            round: round_no as u64,
            attempt: 1,
        },
        // In process the coordinator is this program: the check costs a signature per
        // client, and runs the protocol as `cohort serve` does.
        consistency_check: true,
        parties: plan.selected.len() as u32,
        threshold,
        neighbours,
        dimension: plan.task.global.len(),
        quantization: cfg.compression().secure_quantization(
            quantization,
            derive_seed(cfg.seed, Stream::SecureRotation, round_no, 0),
        ),
    };
    let quantizer = config
        .validate()
        .map_err(|e| ConfigError(format!("secure aggregation: {e}")))?;
    let masked_bytes =
        config.dimension * (quantizer.word_bits() / 8) as usize + secagg::EXTRA_WORDS * 4;
    Ok((config, masked_bytes))
}

/// One round under secure aggregation: the selected clients train and run the SecAgg+
/// protocol through the in-process transport, and the engine receives only the
/// unmasked weighted mean. Client `i` of the protocol is `plan.selected[i - 1]`;
/// `dropping[i - 1]` clients stop at `cfg.dropout_stage`.
fn secure_round(
    run: &mut Run<'_>,
    engine: &mut RoundEngine,
    plan: &RoundPlan,
    dropping: &[bool],
    round_no: u32,
    settings: SecureSettings,
) -> Result<RoundOutcome, SimulationError> {
    let (cfg, pop, links) = (run.cfg, run.pop, &run.links);
    let failures = &mut run.failures;
    let SecureSettings {
        neighbours,
        threshold,
        noise,
        reducer,
    } = settings;
    let drop_at: std::collections::BTreeMap<u32, Stage> = dropping
        .iter()
        .enumerate()
        .filter(|(_, d)| **d)
        .map(|(i, _)| (i as u32 + 1, cfg.dropout_stage))
        .collect();
    let task = &plan.task;
    let global = task.global.values();
    // Every client that gets as far as sending its masked input trains first, through
    // the population (a Python pool trains them all at once, largest batch first); the
    // protocol then runs on the finished updates.
    let trains: Vec<ClientId> = plan
        .selected
        .iter()
        .zip(dropping)
        .filter(|(_, d)| !**d || cfg.dropout_stage > Stage::Masked)
        .map(|(id, _)| *id)
        .collect();
    let mut inputs = std::collections::HashMap::new();
    let training = Training {
        cfg,
        pop,
        links,
        upload: Upload::Masked,
        task,
        round_no,
    };
    train_clients(&training, &trains, failures, |part| {
        for (id, update) in part {
            let values: Vec<f32> = delta(update.params.values(), global);
            let loss = if update.train_loss.is_finite() {
                update.train_loss
            } else {
                0.0
            };
            inputs.insert(id, (values, update.num_samples as u64, loss));
        }
        Ok(())
    })?;
    // Asked after training: a Python population learns its clients' sizes then.
    let max_weight = cfg.max_weight.unwrap_or_else(|| pop.max_weight());
    let quantization = secagg::QuantizationParams {
        clip: cfg.clip,
        max_weight,
        distributed_noise: noise.map(|(n, _)| n),
        ..secagg::QuantizationParams::default()
    };
    let (config, masked_bytes) =
        secure_config(cfg, plan, round_no, (neighbours, threshold), quantization)?;
    links.count_upload(inputs.len() * masked_bytes);
    let mut keys = derive_seed_bytes(cfg.seed, Stream::SecureAggregation, round_no);
    keys[0] ^= 1; // the clients' key stream, apart from the public session id
    let inputs = std::sync::Mutex::new(inputs);
    let round = local::run_round_on(reducer, &config, keys, &drop_at, true, |u| {
        let id = plan.selected[u as usize - 1];
        let input = inputs.lock().expect("no panics while held").remove(&id);
        match input {
            Some((values, weight, loss)) => local::ClientInput::Update {
                values,
                weight,
                loss,
            },
            // An empty vector is refused by the client's own checks: it drops out.
            None => local::ClientInput::Quantized(Vec::new()),
        }
    });
    let result = round.result.ok().map(|unmasked| {
        // Under differential privacy the noisy sum is divided by the expected count, not
        // the survivors', so that the scale reveals nothing either.
        let rescale = noise.map_or(1.0, |(_, expected)| {
            unmasked.survivors.len() as f64 / expected.max(1.0)
        });
        let mean: Vec<f32> = global
            .iter()
            .zip(&unmasked.decoded.mean)
            .map(|(g, d)| g + (f64::from(*d) * rescale) as f32)
            .collect();
        SecureMean {
            mean: cohort_aggregation::ModelVector::new(task.global.layout().clone(), mean)
                .expect("the model's own layout"),
            participants: unmasked.survivors.len(),
            samples: unmasked.decoded.total_weight,
            train_loss: unmasked.decoded.mean_loss,
        }
    });
    Ok(engine.close_round_secure(result)?)
}
