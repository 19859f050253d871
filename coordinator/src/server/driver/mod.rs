//! The round driver: moves every running experiment through its rounds, and works the
//! job queue.
//!
//! Nothing lives only in memory: each step reads the experiment's state from the store,
//! makes one transactional change, and the next tick carries on from whatever was last
//! committed. So a coordinator killed at any point resumes where it stopped, and several
//! coordinators on one PostgreSQL can run drivers side by side: their conditional updates
//! and the job claim let exactly one of them make each change.
//!
//! An experiment in mode `fedbuff` has no rounds in this sense: [`fedbuff`] takes
//! its steps and its aggregation jobs.

pub mod fedbuff;
pub mod model;
pub mod secure_rounds;
pub mod track;

use std::time::Duration;

use cohort_aggregation::{ModelVector, WeightedMean, wire};
use cohort_edge::model::ModelSpec;

use cohort_core::SpecModel;
use cohort_core::round::Collection;
use model::ExperimentModel;
use uuid::Uuid;

use crate::server::AppState;
use crate::store::{
    Experiment, ExperimentState, Job, JobKind, PublishedModel, Round, RoundKey, RoundMetrics,
    RoundStage, StoreError, now_millis,
};
use cohort_aggregation::privacy::central::CentralSum;
use cohort_aggregation::reduce::batch_len;
use cohort_core::ExperimentSpec;

/// How often the driver looks at the experiments.
pub const TICK: Duration = Duration::from_millis(250);
/// A client counts as available when it was seen this recently: in a check-in's long
/// poll (which marks it seen as it waits), or just out of one. `cohort-edge` is back in a
/// check-in within a second of the last one ending (it waits at most 10 s each), so a
/// client silent for longer is not waiting for work: training for another experiment, or
/// gone. A longer window (it was a minute) selected such clients, and a round needing
/// them stalled until its deadline.
pub const AVAILABILITY_WINDOW_MS: i64 = 15_000;
/// Attempts a job gets before it fails for good.
pub const JOB_ATTEMPTS: i64 = 5;

/// Why a driver step failed. The step changed nothing it did not commit; the next tick
/// tries again.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The store refused or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A stored experiment spec no longer parses (a bug or a hand-edited database).
    #[error("experiment {0} has an invalid spec: {1}")]
    Spec(Uuid, String),
    /// Reading or writing a blob failed.
    #[error("blob i/o: {0}")]
    Blob(#[from] std::io::Error),
    /// An upload or model could not be decoded or combined.
    #[error("aggregation: {0}")]
    Aggregation(String),
}

/// The spec of an experiment.
pub fn experiment_spec(exp: &Experiment) -> Result<ExperimentSpec, DriverError> {
    serde_json::from_value(exp.spec.clone()).map_err(|e| DriverError::Spec(exp.id, e.to_string()))
}

/// The spec and model of an experiment.
pub fn experiment_model(
    exp: &Experiment,
) -> Result<(ExperimentSpec, ExperimentModel), DriverError> {
    let spec = experiment_spec(exp)?;
    let bad = |e: &dyn std::fmt::Display| DriverError::Spec(exp.id, e.to_string());
    let model = match &spec.model {
        SpecModel::BuiltIn(kind) => ExperimentModel::BuiltIn(
            ModelSpec::new(kind, spec.features, spec.classes).map_err(|e| bad(&e))?,
        ),
        SpecModel::File => {
            let (Some(id), Some(tensors)) = (spec.initial_model, spec.tensors.clone()) else {
                return Err(bad(&"a file model without its initial model's tensors"));
            };
            ExperimentModel::File {
                id,
                layout: std::sync::Arc::new(
                    cohort_aggregation::Layout::new(tensors).map_err(|e| bad(&e))?,
                ),
            }
        }
    };
    Ok((spec, model))
}

pub(super) fn model_blob(experiment: Uuid, round: i64) -> String {
    format!("models/{experiment}/round-{round}.bin")
}

/// Where the adaptive server optimizer's state after `round` is kept, next to its model.
pub(super) fn optimizer_blob(experiment: Uuid, round: i64) -> String {
    format!("models/{experiment}/round-{round}.optimizer")
}

/// The last step of every aggregation job, off the async threads: the experiment's
/// server optimizer, continued from the state stored with the model the round started
/// from, moves the global model towards the round's target; the result and the
/// optimizer's new state are stored as the round's, and the model is evaluated on the
/// held-out set.
///
/// The state is written under the round's own name and only ever read for a published
/// model, so a job run again (after a crash, by another replica) starts from the same
/// state and writes the same bytes.
#[derive(Clone)]
pub(super) struct ModelStep {
    blobs: crate::blobs::BlobStore,
    strategy: cohort_aggregation::Strategy,
    server_lr: Option<f32>,
    eval: Option<std::sync::Arc<cohort_edge::data::Dataset>>,
    model: ExperimentModel,
    experiment: Uuid,
    /// The round (or FedBuff version) of the model this step starts from.
    from: i64,
    round: i64,
}

impl ModelStep {
    /// The step of `round`, starting from the published model `from`.
    pub(super) fn new(
        state: &AppState,
        experiment: Uuid,
        spec: &ExperimentSpec,
        model: &ExperimentModel,
        from: &PublishedModel,
        round: i64,
    ) -> Self {
        Self {
            blobs: state.blobs.clone(),
            strategy: spec.strategy,
            server_lr: spec.server_lr,
            eval: state.eval.clone(),
            model: model.clone(),
            experiment,
            from: from.round,
            round,
        }
    }

    /// A stored model (the current one, or the one an update started from).
    pub(super) fn load(&self, path: &str) -> Result<ModelVector, DriverError> {
        wire::decode(self.model.layout(), &self.blobs.get(path)?)
            .map_err(|e| DriverError::Aggregation(e.to_string()))
    }

    /// A model vector of the experiment's layout from raw values.
    pub(super) fn vector(&self, values: Vec<f32>) -> Result<ModelVector, DriverError> {
        ModelVector::new(self.model.layout().clone(), values)
            .map_err(|e| DriverError::Aggregation(e.to_string()))
    }

    /// Steps `global` towards `target`, stores it as the round's model and evaluates it.
    pub(super) fn finish(
        &self,
        mut global: ModelVector,
        target: &ModelVector,
    ) -> Result<(PublishedModel, RoundMetrics), DriverError> {
        let bad = |e: &dyn std::fmt::Display| DriverError::Aggregation(e.to_string());
        let mut optimizer = self
            .strategy
            .server_optimizer(self.server_lr)
            .map_err(|e| bad(&e))?;
        // The initial model (round 0) has no state: the moments start afresh there. Any
        // later model of an adaptive experiment was published with its state, so a
        // missing state is an error, never a silent restart of the moments.
        if optimizer.adaptive_config().is_some() && self.from > 0 {
            let saved = self
                .blobs
                .get(&optimizer_blob(self.experiment, self.from))
                .map_err(|e| {
                    bad(&format!(
                        "the {} state of model {} is unreadable: {e}",
                        optimizer.name(),
                        self.from
                    ))
                })?;
            optimizer
                .restore_state(global.layout(), &saved)
                .map_err(|e| bad(&e))?;
        }
        optimizer.step(&mut global, target).map_err(|e| bad(&e))?;
        if let Some(state) = optimizer.state_bytes() {
            self.blobs
                .put(&optimizer_blob(self.experiment, self.round), &state)?;
        }
        let path = model_blob(self.experiment, self.round);
        self.blobs.put(&path, &wire::encode(&global))?;
        let tested = evaluate(
            self.eval.as_deref(),
            &self.model,
            global.values(),
            self.experiment,
        );
        Ok((
            PublishedModel {
                round: self.round,
                blob_path: path,
                parameters: global.len() as i64,
            },
            tested,
        ))
    }
}

/// One pass: every running experiment takes its next step, then queued jobs run until
/// none is left. `worker` names this coordinator in job leases.
pub async fn tick(state: &AppState, worker: &str) -> Result<(), DriverError> {
    tick_with(state, worker, now_millis).await
}

/// [`tick`] with the clock stopped at `now` (Unix ms) for the rounds' deadlines and the
/// jobs' leases: a test drives time forward with it instead of sleeping through
/// deadlines. (A running job's lease is still renewed on the wall clock.)
pub async fn tick_at(state: &AppState, worker: &str, now: i64) -> Result<(), DriverError> {
    tick_with(state, worker, || now).await
}

async fn tick_with(
    state: &AppState,
    worker: &str,
    clock: impl Fn() -> i64,
) -> Result<(), DriverError> {
    for exp in state.store.experiments().await? {
        if exp.state == ExperimentState::Running
            && let Err(e) = step_experiment(state, &exp, clock()).await
        {
            tracing::warn!(experiment = %exp.id, error = %e, "experiment step failed");
        }
    }
    let lease = state.settings.job_lease;
    let lease_ms = lease.as_millis() as i64;
    while let Some(job) = state.store.claim_job(worker, clock(), lease_ms).await? {
        crate::fault::reached(crate::fault::FaultPoint::JobClaimed).await;
        let started = std::time::Instant::now();
        let outcome = {
            // The lease is renewed while the job runs: a job longer than one lease stays
            // with this live worker, and only a dead worker's job is taken over.
            let renewals = async {
                loop {
                    tokio::time::sleep(lease / 3).await;
                    if let Err(e) = state
                        .store
                        .renew_job(job.id, worker, now_millis() + lease_ms)
                        .await
                    {
                        tracing::warn!(job = job.id, error = %e, "job lease not renewed");
                    }
                }
            };
            tokio::select! {
                outcome = run_job(state, &job) => outcome,
                never = renewals => never,
            }
        };
        state.telemetry.observe_job(
            job.kind.as_str(),
            outcome.is_ok(),
            started.elapsed().as_secs_f64(),
        );
        match outcome {
            Ok(()) => state.store.complete_job(job.id, worker).await?,
            Err(e) => {
                tracing::warn!(job = job.id, error = %e, "job failed");
                state
                    .store
                    .fail_job(job.id, worker, &e.to_string(), clock(), 1_000)
                    .await?;
            }
        }
    }
    Ok(())
}

/// Runs [`tick`] every [`TICK`] until the task is dropped.
pub async fn run(state: AppState) {
    let worker = format!("coordinator-{}", Uuid::new_v4().simple());
    loop {
        if let Err(e) = tick(&state, &worker).await {
            tracing::warn!(error = %e, "driver tick failed");
        }
        tokio::time::sleep(TICK).await;
    }
}

/// The model round 0 publishes: the uploaded file when the spec names one (in the
/// model's tensor order), else a built-in model's seeded initialisation.
async fn initial_model(
    state: &AppState,
    spec: &ExperimentSpec,
    model: &ExperimentModel,
) -> Result<ModelVector, DriverError> {
    let from_file = match spec.initial_model {
        Some(id) => {
            let file = state.store.model_file(id).await?;
            let vector = model::load_model_file(state, &file).await?;
            Some(vector)
        }
        None => None,
    };
    match (model, from_file) {
        (_, Some(vector)) => {
            model::reorder(&vector, model.layout()).map_err(DriverError::Aggregation)
        }
        (ExperimentModel::BuiltIn(built_in), None) => Ok(built_in.init(spec.seed)),
        (ExperimentModel::File { id, .. }, None) => Err(DriverError::Aggregation(format!(
            "the model file {id} is missing"
        ))),
    }
}

async fn step_experiment(state: &AppState, exp: &Experiment, now: i64) -> Result<(), DriverError> {
    let store = &state.store;
    let (spec, model) = experiment_model(exp)?;
    if store.latest_model(exp.id).await?.is_none() {
        let initial = initial_model(state, &spec, &model).await?;
        let path = model_blob(exp.id, 0);
        let blobs = state.blobs.clone();
        let bytes = wire::encode(&initial);
        let p = path.clone();
        tokio::task::spawn_blocking(move || blobs.put(&p, &bytes))
            .await
            .map_err(|e| DriverError::Aggregation(e.to_string()))??;
        let published = PublishedModel {
            round: 0,
            blob_path: path,
            parameters: initial.len() as i64,
        };
        store
            .publish_model(exp.id, 0, 0, &published, RoundMetrics::default(), now)
            .await?;
    }
    if let Some(settings) = spec.fedbuff() {
        return crate::server::driver::fedbuff::step(state, exp, &spec, &settings, now).await;
    }
    let Some(round) = store.latest_round(exp.id).await? else {
        return open(state, exp, &spec, 1, 1, now).await;
    };
    match round.stage {
        RoundStage::Advertising
        | RoundStage::Revealing
        | RoundStage::Sharing
        | RoundStage::Confirming
        | RoundStage::Unmasking => {
            secure_step(state, &spec, &round, now).await?;
        }
        RoundStage::Collecting if round.secagg.is_some() => {
            secure_step(state, &spec, &round, now).await?;
        }
        RoundStage::Collecting => {
            let due = round.stage_deadline.is_some_and(|d| now > d);
            // A client whose trainer failed will not upload: waiting for it until the
            // deadline would only slow the round down.
            // Nor for a client revoked since the round opened (counted as dropped).
            let mut collection = Collection {
                selected: round.selected as usize,
                reported: round.reported as usize,
                dropped: round.dropped as usize,
                failed: 0,
            };
            if !collection.closes(due) {
                collection.failed = store
                    .task_failure_count(exp.id, round.round, round.attempt)
                    .await? as usize;
            }
            if collection.closes(due) {
                close(state, exp, &spec, &round, now).await?;
            }
        }
        RoundStage::Aggregating => {
            // A job that failed every attempt fails its round; the next tick retries it.
            store
                .fail_round_if_aggregation_failed(exp.id, round.round, round.attempt, now)
                .await?;
        }
        RoundStage::Published => {
            if round.round >= i64::from(spec.rounds) {
                set_state(state, exp.id, ExperimentState::Finished).await?;
            } else {
                open(state, exp, &spec, round.round + 1, 1, now).await?;
            }
        }
        RoundStage::Failed => {
            // `serve` runs a failed round again (`FailedAttemptPolicy::Retry`).
            match cohort_core::round::next_attempt(round.attempt, spec.max_round_attempts) {
                Some(attempt) => open(state, exp, &spec, round.round, attempt, now).await?,
                None => set_state(state, exp.id, ExperimentState::Failed).await?,
            }
        }
    }
    Ok(())
}

async fn secure_step(
    state: &AppState,
    spec: &ExperimentSpec,
    round: &Round,
    now: i64,
) -> Result<(), DriverError> {
    crate::server::driver::secure_rounds::step(
        state,
        spec,
        round,
        spec.min_participants,
        JOB_ATTEMPTS,
        now,
    )
    .await
}

pub(super) async fn set_state(
    state: &AppState,
    id: Uuid,
    to: ExperimentState,
) -> Result<(), DriverError> {
    match state
        .store
        .set_experiment_state(id, to, "coordinator")
        .await
    {
        // Another coordinator (or an admin) changed it first: nothing left to do.
        Ok(_) => {
            crate::server::driver::track::experiment_changed(state, id, to);
            Ok(())
        }
        Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Opens a round attempt among the available clients, once there are enough of them
/// for a quorum; until then it waits.
async fn open(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    round: i64,
    attempt: i64,
    now: i64,
) -> Result<(), DriverError> {
    let available = state
        .store
        .available_clients(now - AVAILABILITY_WINDOW_MS)
        .await?;
    let size = spec.cohort_size();
    if available.len() < size.needed {
        return Ok(());
    }
    if let Some(privacy) = &spec.privacy {
        let round = RoundToOpen {
            round,
            attempt,
            needed: size.needed,
            now,
        };
        return open_private(state, exp, spec, privacy, &available, round).await;
    }
    let mut rng = selection_rng(state, round, attempt);
    let Some(selected) = cohort_core::round::select_cohort(&available, size, &mut rng) else {
        return Ok(());
    };
    let k = selected.len();
    crate::fault::reached(crate::fault::FaultPoint::Selection).await;
    let opened = match &spec.secure_aggregation {
        Some(secure) => {
            let (_, model) = experiment_model(exp)?;
            let mut session = [0u8; 32];
            rand::RngExt::fill(&mut rand::rng(), &mut session);
            let context = round_context(exp, round, attempt);
            let config = secure
                .round_config(k, model.num_params(), session, context)
                .and_then(|config| with_compression(config, spec, exp.id, round, attempt));
            let config = match config {
                Ok(config) => config,
                Err(why) => {
                    // Fewer clients than wanted: try again on a later tick.
                    tracing::warn!(experiment = %exp.id, round, parties = k, "not opened: {why}");
                    return Ok(());
                }
            };
            let text = serde_json::to_string(&config).expect("settings serialise");
            let deadline = now + (secure.advertise_seconds as i64) * 1000;
            state
                .store
                .open_secure_round(
                    RoundKey::new(exp.id, round, attempt),
                    &selected,
                    &text,
                    deadline,
                    now,
                )
                .await
        }
        None => {
            let deadline = now + (spec.collect_deadline_seconds as i64) * 1000;
            state
                .store
                .open_round(exp.id, round, attempt, &selected, deadline, now)
                .await
        }
    };
    opened_or_raced(opened)
}

/// The generator an attempt's cohort is drawn from: the operating system's, or one
/// seeded from `--selection-seed` and the attempt, so that replicas and restarts draw
/// the same cohort for it.
/// A secure round's settings with the experiment's upload compression: fixed bits, the
/// word width, and the attempt's one rotation seed (checked again for this many parties).
fn with_compression(
    mut config: cohort_aggregation::secagg::RoundConfig,
    spec: &ExperimentSpec,
    experiment: Uuid,
    round: i64,
    attempt: i64,
) -> Result<cohort_aggregation::secagg::RoundConfig, String> {
    let Some(compression) = spec.compression else {
        return Ok(config);
    };
    let seed = cohort_core::compression::rotation_seed(
        experiment,
        round,
        attempt,
        None,
        cohort_core::compression::SeedUse::SecureRound,
    );
    config.quantization = compression.secure_quantization(config.quantization, seed);
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

fn selection_rng(state: &AppState, round: i64, attempt: i64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    match state.settings.selection_seed {
        Some(seed) => rand_chacha::ChaCha8Rng::seed_from_u64(cohort_core::round::selection_seed(
            seed, round, attempt,
        )),
        None => rand_chacha::ChaCha8Rng::from_rng(&mut rand::rng()),
    }
}

fn opened_or_raced(opened: Result<Round, StoreError>) -> Result<(), DriverError> {
    match opened {
        // A concurrent coordinator opened it, or the experiment just stopped.
        Ok(_) | Err(StoreError::Conflict(_)) => Ok(()),
        Err(StoreError::Database(e)) if is_unique_violation(&e) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Which attempt is opening, and the fewest clients it can run with.
struct RoundToOpen {
    round: i64,
    attempt: i64,
    needed: usize,
    now: i64,
}

/// Opens an attempt of a differentially private round: Poisson sampling among the
/// available clients, and the budget check against the attempt's worst-case charge, as
/// epsilon against observers or, when the experiment says so, as the worst selected
/// client's epsilon against the coordinator. An attempt that could take it past the
/// budget never opens: the experiment finishes.
/// What a secure round's clients sign their messages for: this experiment, round and
/// attempt.
fn round_context(
    exp: &Experiment,
    round: i64,
    attempt: i64,
) -> cohort_aggregation::secagg::RoundContext {
    cohort_aggregation::secagg::RoundContext {
        experiment: exp.id.to_string(),
        round: u64::try_from(round).unwrap_or_default(),
        attempt: u64::try_from(attempt).unwrap_or_default(),
    }
}

async fn open_private(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    privacy: &cohort_core::privacy::PrivacySpec,
    available: &[Uuid],
    to_open: RoundToOpen,
) -> Result<(), DriverError> {
    let RoundToOpen {
        round,
        attempt,
        needed,
        now,
    } = to_open;
    let wanted = spec.selected_per_round();
    let q = (wanted as f64 / available.len() as f64).min(1.0);
    let denominator = q * available.len() as f64;
    let selected: Vec<Uuid> = {
        let mut rng = rand::rng();
        available
            .iter()
            .filter(|_| rand::RngExt::random_bool(&mut rng, q))
            .copied()
            .collect()
    };
    // Too small a draw to run: draw again on the next tick. Conditioning on the size
    // raises each client's chance of selection above q only by the (tiny, for the
    // cohorts a budget is planned for) chance of a draw this small.
    if selected.len() < needed {
        return Ok(());
    }
    // The round's protocol settings come from the real draw, and are checked before it
    // is charged: a draw no valid setting fits is drawn again, not charged.
    let secure_config = match &spec.secure_aggregation {
        Some(secure) => {
            let (_, model) = experiment_model(exp)?;
            let mut session = [0u8; 32];
            rand::RngExt::fill(&mut rand::rng(), &mut session);
            let context = round_context(exp, round, attempt);
            match secure.round_config(selected.len(), model.num_params(), session, context) {
                Ok(mut config) => {
                    config.quantization.distributed_noise = Some(privacy.distributed_noise());
                    Some(config)
                }
                Err(why) => {
                    tracing::warn!(experiment = %exp.id, round, parties = selected.len(),
                        "not opened: {why}");
                    return Ok(());
                }
            }
        }
        None => None,
    };
    let rounds = state.store.rounds(exp.id).await?;
    let selections = state.store.selections(exp.id).await?;
    let threshold = secure_config.as_ref().map(|c| c.threshold);
    let dp_error = |e| DriverError::Spec(exp.id, format!("differential privacy: {e}"));
    let ledger =
        crate::server::privacy::CoordinatorLedger::new(&rounds, &selections).map_err(dp_error)?;
    let charge = crate::server::privacy::charge_round(
        privacy,
        &rounds,
        &ledger,
        q,
        denominator,
        &selected,
        threshold,
    )
    .map_err(dp_error)?;
    if let Some(why) = charge.over_budget(privacy, round) {
        let epsilon = charge.against(privacy.budget_against);
        tracing::info!(experiment = %exp.id, round, epsilon, "{why}");
        return match state
            .store
            .set_experiment_state_because(exp.id, ExperimentState::Finished, "coordinator", &why)
            .await
        {
            Ok(_) => {
                crate::server::driver::track::experiment_changed(
                    state,
                    exp.id,
                    ExperimentState::Finished,
                );
                Ok(())
            }
            Err(StoreError::Conflict(_)) => Ok(()),
            Err(e) => Err(e.into()),
        };
    }
    let (secagg, deadline) = match (&spec.secure_aggregation, secure_config) {
        (Some(secure), Some(config)) => {
            let text = serde_json::to_string(&config).expect("settings serialise");
            (Some(text), now + (secure.advertise_seconds as i64) * 1000)
        }
        _ => (None, now + (spec.collect_deadline_seconds as i64) * 1000),
    };
    let opened = state
        .store
        .open_private_round(
            RoundKey::new(exp.id, round, attempt),
            &selected,
            secagg.as_deref(),
            &charge.record,
            deadline,
            now,
        )
        .await;
    opened_or_raced(opened)
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.is_unique_violation())
}

async fn close(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    round: &Round,
    now: i64,
) -> Result<(), DriverError> {
    let quorum = spec.min_participants as i64;
    crate::fault::reached(crate::fault::FaultPoint::Collected).await;
    match state
        .store
        .close_collection(
            exp.id,
            round.round,
            round.attempt,
            quorum,
            JOB_ATTEMPTS,
            now,
        )
        .await
    {
        // The aggregation job was queued with the close; a concurrent coordinator that
        // closed first gets the conflict.
        Ok(_) | Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn run_job(state: &AppState, job: &Job) -> Result<(), DriverError> {
    match job.kind {
        JobKind::Aggregate => aggregate(state, job).await,
        // Evaluation and publishing are folded into aggregation for now; a queued job of
        // those kinds has nothing left to do.
        JobKind::Evaluate | JobKind::Publish => Ok(()),
    }
}

/// What an aggregation job works on: the experiment with its spec and model, the round
/// attempt that closed, and the published model it starts from.
#[derive(Clone, Copy)]
struct RoundJob<'a> {
    exp: &'a Experiment,
    spec: &'a ExperimentSpec,
    model: &'a ExperimentModel,
    round: &'a Round,
    current: &'a PublishedModel,
}

/// Unmasks a secure round's sum and publishes the model it moves to. A sum that cannot
/// be unmasked (a share failed its check) fails the round, which then runs again.
async fn aggregate_secure(state: &AppState, job: &RoundJob<'_>) -> Result<(), DriverError> {
    let RoundJob {
        exp,
        spec,
        model,
        round,
        current,
    } = *job;
    let unmasked = match crate::server::driver::secure_rounds::unmask_round(state, round).await? {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!(experiment = %exp.id, round = round.round, error = %e,
                "secure round could not be unmasked");
            return crate::server::driver::secure_rounds::fail_aggregation(
                state,
                round,
                e.to_string(),
            )
            .await;
        }
    };
    tracing::info!(
        experiment = %exp.id,
        round = round.round,
        survivors = unmasked.survivors.len(),
        error_bound = unmasked.decoded.error_bound,
        "secure sum unmasked"
    );
    let step = ModelStep::new(state, exp.id, spec, model, current, round.round);
    let current_path = current.blob_path.clone();
    let mean_loss = unmasked.decoded.mean_loss;
    let survivors = unmasked.survivors.len();
    let denominator = round.privacy.as_ref().map(|p| p.denominator);
    let (published, tested) = tokio::task::spawn_blocking(
        move || -> Result<(PublishedModel, RoundMetrics), DriverError> {
            let global = step.load(&current_path)?;
            // The clients masked their updates' differences from this model. Under
            // distributed noise the noisy sum is divided by the expected count, not the
            // survivors', so that the scale reveals nothing either.
            let rescale = denominator.map_or(1.0, |d| survivors as f64 / d.max(1.0));
            let mean: Vec<f32> = global
                .values()
                .iter()
                .zip(&unmasked.decoded.mean)
                .map(|(g, d)| g + (f64::from(*d) * rescale) as f32)
                .collect();
            let mean = step.vector(mean)?;
            step.finish(global, &mean)
        },
    )
    .await
    .map_err(|e| DriverError::Aggregation(e.to_string()))??;
    let metrics = RoundMetrics {
        train_loss: mean_loss,
        ..tested
    };
    match (&round.privacy, &spec.privacy) {
        // The survivors' shares carried `z * sqrt(m / n)` of the noise: the round is
        // charged for that, in place of the worst case it opened with.
        (Some(record), Some(privacy)) => {
            let parties = round.selected.max(1) as f64;
            let record = crate::store::RoundPrivacy {
                noise_multiplier: privacy.noise_multiplier * (survivors as f64 / parties).sqrt(),
                ..record.clone()
            };
            publish_private(
                state,
                exp.id,
                round,
                &published,
                metrics,
                record,
                privacy.delta,
            )
            .await
        }
        _ => publish(state, exp.id, round, &published, metrics).await,
    }
}

/// Test accuracy and loss of a just-aggregated model on the coordinator's held-out set,
/// when it has one that fits the experiment (a built-in model of the same features and
/// classes; a file model's metrics come from its clients). Runs where the
/// model is still in memory. Evaluation is a report, not a step of the round: when it
/// cannot run, the round publishes without it.
pub(super) fn evaluate(
    eval: Option<&cohort_edge::data::Dataset>,
    model: &ExperimentModel,
    params: &[f32],
    experiment: Uuid,
) -> RoundMetrics {
    let (Some(data), Some(model)) = (eval, model.built_in()) else {
        return RoundMetrics::default();
    };
    if data.features.ncols() != model.inputs() || data.classes.len() != model.classes() {
        return RoundMetrics::default();
    }
    match model.evaluate(params, data.features.view(), &data.labels) {
        Ok(e) => RoundMetrics {
            test_accuracy: Some(e.accuracy),
            test_loss: Some(e.loss),
            train_loss: None,
        },
        Err(e) => {
            tracing::warn!(%experiment, error = %e, "evaluation skipped");
            RoundMetrics::default()
        }
    }
}

/// What a publication's outcome means: done (the trackers are told), or done already
/// by an earlier run of the job (a conflict), or an error.
fn published(
    state: &AppState,
    experiment: Uuid,
    round: &Round,
    outcome: Result<(), StoreError>,
) -> Result<(), DriverError> {
    match outcome {
        Ok(()) => {
            track::round_published(state, experiment, round.round, round.attempt);
            Ok(())
        }
        Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Publishes a round's model; a conflict means an earlier run of the job already did.
pub(super) async fn publish(
    state: &AppState,
    experiment: Uuid,
    round: &Round,
    model: &PublishedModel,
    metrics: RoundMetrics,
) -> Result<(), DriverError> {
    crate::fault::reached(crate::fault::FaultPoint::Publishing).await;
    let outcome = state
        .store
        .publish_model(
            experiment,
            round.round,
            round.attempt,
            model,
            metrics,
            now_millis(),
        )
        .await;
    published(state, experiment, round, outcome)
}

/// Folds a round's uploads, one at a time, into the next global model and publishes it.
async fn aggregate(state: &AppState, job: &Job) -> Result<(), DriverError> {
    let store = &state.store;
    let exp = store.experiment(job.experiment_id).await?;
    let (spec, model) = experiment_model(&exp)?;
    if let Some(settings) = spec.fedbuff() {
        return crate::server::driver::fedbuff::aggregate(
            state, &exp, &spec, &settings, &model, job.round,
        )
        .await;
    }
    // Only a round's latest attempt can be aggregating: the next opens once it failed.
    let round = match store.latest_attempt(exp.id, job.round).await {
        Ok(round) if round.stage == RoundStage::Aggregating => round,
        // Already published by an earlier run of this job.
        Ok(_) | Err(StoreError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let current = store
        .latest_model(exp.id)
        .await?
        .ok_or_else(|| DriverError::Aggregation("no current model".into()))?;
    let job = RoundJob {
        exp: &exp,
        spec: &spec,
        model: &model,
        round: &round,
        current: &current,
    };
    if round.secagg.is_some() {
        return aggregate_secure(state, &job).await;
    }
    let mut uploads = store.uploads(exp.id, round.round, round.attempt).await?;
    // Floating-point sums depend on their order. Folding in the order of the uploads'
    // contents, not of their arrival, makes a round that is run again (after a crash, or
    // in a replay of the experiment) give the same model bit for bit.
    uploads.sort_by(|a, b| a.sha256.cmp(&b.sha256).then(a.id.cmp(&b.id)));
    if let (Some(privacy), Some(record)) = (&spec.privacy, &round.privacy) {
        return aggregate_central(state, &job, privacy, record, uploads).await;
    }
    let participations = store
        .participations(exp.id, round.round, round.attempt)
        .await?;
    let step = ModelStep::new(state, exp.id, &spec, &model, &current, round.round);
    let blobs = state.blobs.clone();
    let layout = model.layout().clone();
    let reducer = state.reducer.clone();
    let aggregator = spec.aggregator;
    // Uploads are capped when they are recorded; capping again here covers rows recorded
    // before the cap existed.
    let cap = spec.weight_cap();
    let (published, tested) = tokio::task::spawn_blocking(
        move || -> Result<(PublishedModel, RoundMetrics), DriverError> {
            let bad = |e: &dyn std::fmt::Display| DriverError::Aggregation(e.to_string());
            let global = step.load(&current.blob_path)?;
            let read = |upload: &crate::store::Upload| -> Result<_, DriverError> {
                let bytes = blobs.get_verified(&upload.blob_path, &upload.sha256)?;
                wire::decode(&layout, &bytes).map_err(|e| bad(&e))
            };
            let mean = match aggregator {
                Some(rule) => {
                    // A robust rule compares the updates with each other, so it holds
                    // them all; the quorum check at creation made sure there are enough.
                    let deltas = uploads
                        .iter()
                        .map(|upload| {
                            let update = read(upload)?;
                            Ok(update
                                .values()
                                .iter()
                                .zip(global.values())
                                .map(|(u, g)| u - g)
                                .collect::<Vec<f32>>())
                        })
                        .collect::<Result<Vec<_>, DriverError>>()?;
                    let views: Vec<&[f32]> = deltas.iter().map(Vec::as_slice).collect();
                    let delta = cohort_aggregation::robust::aggregate(rule, &views)
                        .map_err(|e| bad(&format!("aggregator {rule}: {e}")))?;
                    step.vector(
                        global
                            .values()
                            .iter()
                            .zip(&delta)
                            .map(|(g, d)| g + d)
                            .collect(),
                    )?
                }
                None => {
                    let mut mean = WeightedMean::with_reducer(layout.clone(), reducer.as_ref())
                        .map_err(|e| bad(&e))?;
                    // A batch at a time: the reducer reads each update once while the sums
                    // stay in cache (or on the device), and memory holds one batch, not
                    // the round.
                    for batch in uploads.chunks(batch_len(layout.len())) {
                        let updates = batch
                            .iter()
                            .map(|upload| Ok((read(upload)?, upload.num_samples.min(cap) as f64)))
                            .collect::<Result<Vec<_>, DriverError>>()?;
                        let pairs: Vec<(&cohort_aggregation::ModelVector, f64)> =
                            updates.iter().map(|(u, w)| (u, *w)).collect();
                        mean.fold_batch(&pairs).map_err(|e| bad(&e))?;
                    }
                    mean.finish().map_err(|e| bad(&e))?
                }
            };
            step.finish(global, &mean)
        },
    )
    .await
    .map_err(|e| DriverError::Aggregation(e.to_string()))??;
    let metrics = RoundMetrics {
        train_loss: mean_train_loss(&participations, cap),
        ..tested
    };
    publish(state, exp.id, &round, &published, metrics).await
}

/// The clients' training loss, weighted by their (capped) sample counts; `None` when no
/// client reported one.
fn mean_train_loss(participations: &[crate::store::Participation], cap: i64) -> Option<f64> {
    let (weighted, samples) = participations
        .iter()
        .filter_map(|p| Some((p.train_loss?, p.num_samples?.min(cap) as f64)))
        .fold((0.0, 0.0), |(l, n), (loss, s)| (l + loss * s, n + s));
    (samples > 0.0).then(|| weighted / samples)
}

/// A round of central differential privacy (DP-FedAvg, McMahan et al. 2018): each
/// upload's difference from the global model is clipped to the round's L2 bound, the sum
/// gets Gaussian noise of standard deviation `z * clip` per coordinate from a generator
/// seeded by the operating system, and is divided by the round's fixed denominator.
/// Clients weigh equally (a sample count would raise a client's influence past the clip)
/// and no training loss is published, since it is not noised. With adaptive clipping the
/// noised count of clients within the bound moves the bound for the next round.
async fn aggregate_central(
    state: &AppState,
    job: &RoundJob<'_>,
    privacy: &cohort_core::privacy::PrivacySpec,
    record: &crate::store::RoundPrivacy,
    uploads: Vec<crate::store::Upload>,
) -> Result<(), DriverError> {
    let RoundJob {
        exp,
        spec,
        model,
        round,
        current,
    } = *job;
    let step = ModelStep::new(state, exp.id, spec, model, current, round.round);
    let blobs = state.blobs.clone();
    let layout = model.layout().clone();
    let current_path = current.blob_path.clone();
    let clip = record.clip as f32;
    let denominator = record.denominator.max(1.0);
    let update_sigma = privacy
        .update_noise_multiplier(denominator)
        .map_err(|e| DriverError::Spec(exp.id, e))?;
    let mut adaptive = privacy.adaptive_rule(record.clip, denominator);
    let (published, tested, next_clip) = tokio::task::spawn_blocking(
        move || -> Result<(PublishedModel, RoundMetrics, Option<f64>), DriverError> {
            use rand::SeedableRng;
            let bad = |e: &dyn std::fmt::Display| DriverError::Aggregation(e.to_string());
            let global = step.load(&current_path)?;
            let mut sum = CentralSum::new(global.len(), clip);
            for upload in &uploads {
                let bytes = blobs.get_verified(&upload.blob_path, &upload.sha256)?;
                let update = wire::decode(&layout, &bytes).map_err(|e| bad(&e))?;
                let delta: Vec<f32> = update
                    .values()
                    .iter()
                    .zip(global.values())
                    .map(|(u, g)| u - g)
                    .collect();
                sum.add(delta).map_err(|e| bad(&e))?;
            }
            let mut seed = [0u8; 32];
            rand::RngExt::fill(&mut rand::rng(), &mut seed);
            let mut noise_rng = rand_chacha::ChaCha20Rng::from_seed(seed);
            let (mean, next_clip) = sum
                .finish(
                    global.values(),
                    update_sigma,
                    denominator,
                    adaptive.as_mut(),
                    &mut noise_rng,
                )
                .map_err(|e| bad(&e))?;
            let next_clip = next_clip.map(f64::from);
            let (published, tested) = step.finish(global, &step.vector(mean)?)?;
            Ok((published, tested, next_clip))
        },
    )
    .await
    .map_err(|e| DriverError::Aggregation(e.to_string()))??;
    let final_record = crate::store::RoundPrivacy {
        next_clip,
        ..record.clone()
    };
    publish_private(
        state,
        exp.id,
        round,
        &published,
        tested,
        final_record,
        privacy.delta,
    )
    .await
}

/// Publishes a private round with its final charge, and epsilon recomputed with it.
async fn publish_private(
    state: &AppState,
    experiment: Uuid,
    round: &Round,
    model: &PublishedModel,
    metrics: RoundMetrics,
    mut record: crate::store::RoundPrivacy,
    delta: f64,
) -> Result<(), DriverError> {
    let rounds = state.store.rounds(experiment).await?;
    record.epsilon = crate::server::privacy::epsilon_spent(
        &rounds,
        Some((round.round, round.attempt)),
        Some((record.sampling_rate, record.noise_multiplier)),
        delta,
    )
    .map_err(|e| DriverError::Spec(experiment, format!("differential privacy: {e}")))?;
    crate::fault::reached(crate::fault::FaultPoint::Publishing).await;
    let outcome = state
        .store
        .publish_private_model(
            RoundKey::new(experiment, round.round, round.attempt),
            model,
            metrics,
            Some(&record),
            now_millis(),
        )
        .await;
    published(state, experiment, round, outcome)
}
