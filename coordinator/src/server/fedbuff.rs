//! FedBuff (buffered asynchronous aggregation, Nguyen et al., AISTATS 2022) as an
//! experiment mode of `cohort serve`.
//!
//! In mode `fedbuff` there is no selected cohort and no round deadline. A client that
//! checks in gets a task whenever fewer than `concurrency` tasks are outstanding; it
//! trains on the model version current when it downloads it. Its upload goes into the
//! buffer open when it arrives, whatever version it trained on, and once `buffer_size`
//! (K) updates are buffered the server takes a step: the updates' differences from the
//! models they started from are averaged with weights `n_i * s(tau_i)`, where `n_i` is
//! the client's sample count, `tau_i` its staleness (server steps taken since its base
//! version) and `s(tau) = 1 / (1 + tau)^A`, divided by the buffer's samples as in
//! [`cohort simulate --mode fedbuff`](crate::simulate), and applied with the experiment's
//! server optimizer. The next buffer opens in the same transaction that closes the full
//! one, so a slow client never holds a step back: its update simply lands, staler and
//! weighted down, in a later buffer (or is dropped when staler than `max_staleness`).
//!
//! Everything lives in the store ([`crate::store`]'s FedBuff functions) and every change
//! is one transaction, so the mode is crash-safe and runs on several coordinators the way
//! synchronous rounds do.

use std::collections::HashMap;
use std::sync::Arc;

use super::models::ExperimentModel;
use axum::Router;
use axum::extract::{Path, State};
use axum::routing::get;
use cohort_aggregation::{Layout, ModelVector, WeightedMean, wire};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::AppState;
use super::admin::ExperimentSpec;
use super::client_api::Task;
use super::driver::{self, DriverError, FOLD_BATCH, JOB_ATTEMPTS};
use super::error::{ApiError, ErrorBody, Json};
use crate::store::{
    BufferRules, Buffered, Experiment, ExperimentState, FedBuffDrops, NewUpload, PublishedModel,
    RoundMetrics, RoundStage, StepStats, StoreError, Upload, now_millis,
};

pub use crate::simulate::staleness_weight;

/// The default staleness exponent A: `s(tau) = 1 / sqrt(1 + tau)`, the paper's choice and
/// `cohort simulate`'s default.
pub const DEFAULT_STALENESS_EXPONENT: f64 = crate::simulate::DEFAULT_STALENESS_EXPONENT;

/// Largest `buffer_size` a spec may ask for.
pub const MAX_BUFFER_SIZE: usize = 10_000;
/// Largest `concurrency` a spec may ask for.
pub const MAX_CONCURRENCY: usize = 100_000;
/// Largest staleness exponent a spec may ask for (beyond it, any stale update weighs
/// nothing).
pub const MAX_STALENESS_EXPONENT: f64 = 10.0;

/// How an experiment schedules training and aggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExperimentMode {
    /// Synchronous rounds: a selected cohort, a deadline, a quorum.
    #[default]
    Sync,
    /// Buffered asynchronous aggregation: a server step every `buffer_size` updates.
    Fedbuff,
}

impl ExperimentMode {
    /// Whether this is the default, synchronous mode (which a stored spec leaves out).
    pub fn is_sync(&self) -> bool {
        *self == ExperimentMode::Sync
    }

    /// The spec's text for the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            ExperimentMode::Sync => "sync",
            ExperimentMode::Fedbuff => "fedbuff",
        }
    }
}

/// A mode name that is neither `sync` nor `fedbuff`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode `{0}`: expected sync or fedbuff")]
pub struct UnknownMode(String);

impl std::str::FromStr for ExperimentMode {
    type Err = UnknownMode;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "sync" => Ok(ExperimentMode::Sync),
            "fedbuff" => Ok(ExperimentMode::Fedbuff),
            _ => Err(UnknownMode(text.to_string())),
        }
    }
}

/// A FedBuff experiment's settings, defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct FedBuffSettings {
    /// Updates per server step (K).
    pub buffer_size: usize,
    /// Clients training at once (C).
    pub concurrency: usize,
    /// The staleness exponent A of `s(tau) = 1 / (1 + tau)^A`.
    pub staleness_exponent: f64,
    /// Updates staler than this are dropped; none keeps every update.
    pub max_staleness: Option<u32>,
    /// How long a task may take, seconds (`collect_deadline_seconds`).
    pub task_seconds: u64,
}

impl FedBuffSettings {
    /// The store's rules for the buffers.
    pub fn rules(&self, last_step: u32) -> BufferRules {
        BufferRules {
            buffer_size: self.buffer_size as i64,
            max_staleness: self.max_staleness.map(i64::from),
            task_ms: self.task_ms(),
            last_step: i64::from(last_step),
            job_attempts: JOB_ATTEMPTS,
        }
    }

    /// How long a task may take, ms.
    pub fn task_ms(&self) -> i64 {
        (self.task_seconds as i64).saturating_mul(1000)
    }
}

impl ExperimentSpec {
    /// The FedBuff settings, defaults filled in, when the experiment is in mode `fedbuff`:
    /// `buffer_size` defaults to `clients_per_round` and `concurrency` to the clients a
    /// synchronous round would select (`clients_per_round * over_selection`).
    pub fn fedbuff(&self) -> Option<FedBuffSettings> {
        (self.mode == ExperimentMode::Fedbuff).then(|| FedBuffSettings {
            buffer_size: self.buffer_size.unwrap_or(self.clients_per_round),
            concurrency: self
                .concurrency
                .unwrap_or_else(|| self.selected_per_round()),
            staleness_exponent: self
                .staleness_exponent
                .unwrap_or(DEFAULT_STALENESS_EXPONENT),
            max_staleness: self.max_staleness,
            task_seconds: self.collect_deadline_seconds,
        })
    }
}

/// The mode's problems with a spec, each reported through `bad(field, message)`.
pub(super) fn problems(spec: &ExperimentSpec, bad: &mut impl FnMut(&'static str, String)) {
    if spec.mode == ExperimentMode::Sync {
        let given = [
            ("buffer_size", spec.buffer_size.is_some()),
            ("concurrency", spec.concurrency.is_some()),
            ("staleness_exponent", spec.staleness_exponent.is_some()),
            ("max_staleness", spec.max_staleness.is_some()),
        ];
        for (field, _) in given.into_iter().filter(|(_, set)| *set) {
            bad(
                field,
                format!("{field} is a FedBuff setting: it needs mode fedbuff"),
            );
        }
        return;
    }
    if spec.secure_aggregation.is_some() {
        bad(
            "secure_aggregation",
            "secure_aggregation does not combine with mode fedbuff: SecAgg+ masks cancel only \
             in the sum of one fixed cohort per round, and a FedBuff buffer fills from \
             whichever clients finish first, trained on different model versions"
                .into(),
        );
    }
    if spec.privacy.is_some() {
        bad(
            "privacy",
            "privacy does not combine with mode fedbuff yet: the accountant charges rounds \
             that sample clients at a known rate, and a FedBuff buffer fills from whichever \
             clients check in and finish first"
                .into(),
        );
    }
    if let Some(rule) = spec.aggregator {
        bad(
            "aggregator",
            format!(
                "aggregator: {rule} does not combine with mode fedbuff: a buffer's updates start \
                 from different model versions and carry staleness weights, which the robust \
                 rules do not take"
            ),
        );
    }
    if let Some(k) = spec.buffer_size
        && !(1..=MAX_BUFFER_SIZE).contains(&k)
    {
        bad(
            "buffer_size",
            format!("buffer_size must be between 1 and {MAX_BUFFER_SIZE}, got {k}"),
        );
    }
    if let Some(c) = spec.concurrency
        && !(1..=MAX_CONCURRENCY).contains(&c)
    {
        bad(
            "concurrency",
            format!("concurrency must be between 1 and {MAX_CONCURRENCY}, got {c}"),
        );
    }
    if let Some(a) = spec.staleness_exponent
        && !(a.is_finite() && (0.0..=MAX_STALENESS_EXPONENT).contains(&a))
    {
        bad(
            "staleness_exponent",
            format!("staleness_exponent must be between 0 and {MAX_STALENESS_EXPONENT}, got {a}"),
        );
    }
}

/// Why a buffer could not be folded.
#[derive(Debug, thiserror::Error)]
pub enum FoldError {
    /// An update or base model does not fit, or a value is not finite.
    #[error(transparent)]
    Aggregation(#[from] cohort_aggregation::AggregationError),
    /// A model could not be built in the experiment's layout.
    #[error(transparent)]
    Layout(#[from] cohort_aggregation::LayoutError),
    /// The buffer was empty.
    #[error("a buffer with no updates has nothing to fold")]
    Empty,
}

/// A buffer's updates folded, a batch at a time, through the experiment's reducer:
/// `sum_i w_i delta_i / sum_i w_i` with `w_i = n_i s(tau_i)` and `delta_i` the trained
/// model minus the model it started from.
pub struct BufferFold {
    mean: WeightedMean,
    exponent: f64,
    weight: f64,
    samples: f64,
}

/// One buffered update: the trained model, the model it started from, its sample count
/// and its staleness.
pub type BufferedUpdate<'a> = (&'a ModelVector, &'a ModelVector, u64, u32);

impl BufferFold {
    /// An empty fold for models in `layout`.
    pub fn new(
        layout: Arc<Layout>,
        reducer: &dyn cohort_aggregation::reduce::Reducer,
        exponent: f64,
    ) -> Result<Self, FoldError> {
        Ok(Self {
            mean: WeightedMean::with_reducer(layout, reducer)?,
            exponent,
            weight: 0.0,
            samples: 0.0,
        })
    }

    /// The weight of an update of `samples` samples, `tau` steps stale.
    pub fn weight(&self, samples: u64, tau: u32) -> f64 {
        samples as f64 * staleness_weight(tau, self.exponent)
    }

    /// Folds a batch; a batch with a bad update changes nothing.
    pub fn fold_batch(&mut self, batch: &[BufferedUpdate<'_>]) -> Result<(), FoldError> {
        let mut deltas = Vec::with_capacity(batch.len());
        for &(trained, base, samples, tau) in batch {
            let delta: Vec<f32> = trained
                .values()
                .iter()
                .zip(base.values())
                .map(|(p, b)| p - b)
                .collect();
            let delta = ModelVector::new(trained.layout().clone(), delta)?;
            deltas.push((delta, self.weight(samples, tau), samples));
        }
        let pairs: Vec<(&ModelVector, f64)> = deltas.iter().map(|(d, w, _)| (d, *w)).collect();
        self.mean.fold_batch(&pairs)?;
        for (_, w, n) in &deltas {
            self.weight += w;
            self.samples += *n as f64;
        }
        Ok(())
    }

    /// The model the server optimizer steps towards from `global`:
    /// `global + sum_i w_i delta_i / sum_i n_i`. Dividing by the samples, not the weights,
    /// follows the paper (and the simulation): stale updates shrink the step instead of
    /// only each other's share.
    pub fn target(self, global: &ModelVector) -> Result<ModelVector, FoldError> {
        if self.samples <= 0.0 {
            return Err(FoldError::Empty);
        }
        let scale = (self.weight / self.samples) as f32;
        let mean = self.mean.finish()?;
        let values = global
            .values()
            .iter()
            .zip(mean.values())
            .map(|(g, d)| g + scale * d)
            .collect();
        Ok(ModelVector::new(global.layout().clone(), values)?)
    }
}

/// One driver step of a running FedBuff experiment: finish it once its last step is
/// published, free the slots of expired tasks, and open the first buffer. (Later buffers
/// open as their predecessors fill; see the module doc.)
pub(super) async fn step(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    settings: &FedBuffSettings,
    now: i64,
) -> Result<(), DriverError> {
    let store = &state.store;
    let version = store.latest_model(exp.id).await?.map_or(0, |m| m.round);
    if version >= i64::from(spec.rounds) {
        return driver::set_state(state, exp.id, ExperimentState::Finished).await;
    }
    store
        .expire_fedbuff_tasks(exp.id, now - settings.task_ms())
        .await?;
    if store.latest_round(exp.id).await?.is_none() {
        match store.open_buffer(exp.id, 1, now).await {
            // Another coordinator opened it, or the experiment just stopped.
            Ok(()) | Err(StoreError::Conflict(_)) => {}
            Err(StoreError::Database(e))
                if e.as_database_error()
                    .is_some_and(|d| d.is_unique_violation()) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The aggregation job of buffer `job_round`: publishes, in order, every full buffer
/// from the one after the current model up to `job_round`. A job that finds its buffer
/// already published (by an earlier run, another coordinator, or a later buffer's job
/// that took the earlier ones in order) has nothing left to do.
pub(super) async fn aggregate(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    settings: &FedBuffSettings,
    model: &ExperimentModel,
    job_round: i64,
) -> Result<(), DriverError> {
    let store = &state.store;
    let mut published_before = None;
    loop {
        let current = store
            .latest_model(exp.id)
            .await?
            .ok_or_else(|| DriverError::Aggregation("no current model".into()))?;
        let buffer = current.round + 1;
        if buffer > job_round {
            return Ok(());
        }
        if published_before == Some(current.round) {
            return Err(DriverError::Aggregation(format!(
                "buffer {buffer} did not publish"
            )));
        }
        published_before = Some(current.round);
        let round = store.round(exp.id, buffer, 1).await?;
        if round.stage != RoundStage::Aggregating {
            return Err(DriverError::Aggregation(format!(
                "buffer {buffer} is {}, not full",
                round.stage.as_str()
            )));
        }
        aggregate_buffer(state, exp, spec, settings, model, &round, current).await?;
    }
}

/// Folds one full buffer into the next model version and publishes it.
async fn aggregate_buffer(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    settings: &FedBuffSettings,
    model: &ExperimentModel,
    round: &crate::store::Round,
    current: PublishedModel,
) -> Result<(), DriverError> {
    let uploads = state.store.buffer_uploads(exp.id, round.round).await?;
    // Uploads are capped when they are recorded; capping again here covers rows recorded
    // before the cap existed.
    let cap = spec.weight_cap();
    let (weighted, samples) = uploads
        .iter()
        .filter_map(|u| Some((u.train_loss?, u.upload.num_samples.min(cap) as f64)))
        .fold((0.0, 0.0), |(l, n), (loss, s)| (l + loss * s, n + s));
    let step = driver::ModelStep::new(state, exp.id, spec, model, round.round);
    let blobs = state.blobs.clone();
    let reducer = state.reducer.clone();
    let model = model.clone();
    let exp_id = exp.id;
    let exponent = settings.staleness_exponent;
    let (published, tested) = tokio::task::spawn_blocking(
        move || -> Result<(PublishedModel, RoundMetrics), DriverError> {
            let bad = |e: &dyn std::fmt::Display| DriverError::Aggregation(e.to_string());
            let layout = model.layout().clone();
            let global = step.load(&current.blob_path)?;
            let mut bases: HashMap<i64, ModelVector> = HashMap::new();
            let mut fold =
                BufferFold::new(layout.clone(), reducer.as_ref(), exponent).map_err(|e| bad(&e))?;
            // A batch at a time, as the synchronous path does: memory holds one batch of
            // updates (and the distinct models they started from), not the buffer.
            for batch in uploads.chunks(FOLD_BATCH) {
                let mut trained = Vec::with_capacity(batch.len());
                for u in batch {
                    if let std::collections::hash_map::Entry::Vacant(slot) =
                        bases.entry(u.base_version)
                    {
                        slot.insert(step.load(&driver::model_blob(exp_id, u.base_version))?);
                    }
                    let bytes = blobs.get_verified(&u.upload.blob_path, &u.upload.sha256)?;
                    trained.push(wire::decode(&layout, &bytes).map_err(|e| bad(&e))?);
                }
                let items: Vec<BufferedUpdate<'_>> = batch
                    .iter()
                    .zip(&trained)
                    .map(|(u, t)| {
                        (
                            t,
                            &bases[&u.base_version],
                            u.upload.num_samples.clamp(1, cap.max(1)) as u64,
                            u32::try_from(u.staleness).unwrap_or(u32::MAX),
                        )
                    })
                    .collect();
                fold.fold_batch(&items).map_err(|e| bad(&e))?;
            }
            let target = fold.target(&global).map_err(|e| bad(&e))?;
            step.finish(global, &target)
        },
    )
    .await
    .map_err(|e| DriverError::Aggregation(e.to_string()))??;
    let metrics = RoundMetrics {
        train_loss: (samples > 0.0).then(|| weighted / samples),
        ..tested
    };
    driver::publish(state, exp.id, round, &published, metrics).await
}

/// The FedBuff task `client` holds or is handed now, in any running (or, for a task it
/// already holds, paused) FedBuff experiment.
pub(super) async fn task_for(state: &AppState, client: Uuid) -> Result<Option<Task>, ApiError> {
    let now = now_millis();
    for exp in state.store.experiments().await? {
        let running = exp.state == ExperimentState::Running;
        if !running && exp.state != ExperimentState::Paused {
            continue;
        }
        // A spec that no longer parses is the driver's to report; it has no tasks.
        let Ok((spec, _)) = driver::experiment_model(&exp) else {
            continue;
        };
        let Some(settings) = spec.fedbuff() else {
            continue;
        };
        let task = state
            .store
            .fedbuff_task(
                exp.id,
                client,
                settings.concurrency as i64,
                settings.task_ms(),
                running,
                now,
            )
            .await?;
        if let Some(task) = task {
            return Ok(Some(super::client_api::plain_task(
                &spec,
                exp.id,
                task.round,
                task.attempt,
                Some(task.deadline),
            )));
        }
    }
    Ok(None)
}

/// Records a FedBuff upload (its blob already durable) into the open buffer. An update
/// staler than `max_staleness` is a 409 naming its staleness; its task is dropped.
pub(super) async fn record_upload(
    state: &AppState,
    spec: &ExperimentSpec,
    settings: &FedBuffSettings,
    experiment: Uuid,
    (round, attempt): (i64, i64),
    upload: &NewUpload<'_>,
) -> Result<Upload, ApiError> {
    let recorded = state
        .store
        .record_fedbuff_upload(
            experiment,
            round,
            attempt,
            upload,
            settings.rules(spec.rounds),
            now_millis(),
        )
        .await?;
    match recorded {
        Buffered::Accepted {
            upload,
            buffer,
            staleness,
            closed,
        } => {
            tracing::debug!(%experiment, buffer, staleness, closed, "fedbuff update buffered");
            Ok(upload)
        }
        Buffered::TooStale {
            staleness,
            max_staleness,
        } => Err(ApiError::conflict(
            "too_stale",
            format!(
                "the update is {staleness} server steps stale, more than max_staleness \
                 ({max_staleness}); it was dropped"
            ),
        )),
    }
}

/// Notes the model version a client downloaded for its FedBuff task (the version its
/// update starts from). Best effort: on failure the hand-out's version stands, which
/// at worst under-counts the update's staleness by the steps taken in between.
pub(super) async fn note_download(state: &AppState, exp: &Experiment, client: Uuid, version: i64) {
    let fedbuff = driver::experiment_model(exp)
        .ok()
        .is_some_and(|(spec, _)| spec.mode == ExperimentMode::Fedbuff);
    if fedbuff && let Err(e) = state.store.note_base_version(exp.id, client, version).await {
        tracing::warn!(experiment = %exp.id, %client, error = %e, "could not note the base version");
    }
}

/// A FedBuff experiment's server steps so far.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FedBuffReport {
    /// The settings, defaults filled in.
    pub settings: FedBuffSettings,
    /// Per published or filling step: updates buffered and their staleness.
    pub steps: Vec<StepStats>,
    /// Tasks that ended without a buffered update.
    pub drops: FedBuffDrops,
}

/// A FedBuff experiment's steps: how many updates each buffered and how stale they were,
/// and how many tasks were dropped as too stale or expired.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/fedbuff", tag = "admin",
    security(("admin_token" = [])), params(("id" = String, Path, description = "Experiment id")),
    responses((status = 200, description = "The steps", body = FedBuffReport),
              (status = 401, body = ErrorBody),
              (status = 404, description = "No such experiment, or not in mode fedbuff", body = ErrorBody)))]
async fn fedbuff_report(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<FedBuffReport>, ApiError> {
    let id = super::admin::parse_id(&id, "experiment")?;
    let exp = state.store.experiment(id).await?;
    let (spec, _) = driver::experiment_model(&exp).map_err(ApiError::internal)?;
    let settings = spec
        .fedbuff()
        .ok_or_else(|| ApiError::NotFound(format!("experiment {id} is not in mode fedbuff")))?;
    let (steps, drops) =
        tokio::try_join!(state.store.fedbuff_steps(id), state.store.fedbuff_drops(id))?;
    Ok(Json(FedBuffReport {
        settings,
        steps,
        drops,
    }))
}

/// The admin routes of the mode, relative to the admin prefix.
pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/experiments/{id}/fedbuff", get(fedbuff_report))
}

/// The handlers above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(
    paths(fedbuff_report),
    components(schemas(
        ExperimentMode,
        FedBuffSettings,
        FedBuffReport,
        StepStats,
        FedBuffDrops
    ))
)]
pub(crate) struct FedBuffDoc;

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(n: usize) -> Arc<Layout> {
        Arc::new(Layout::new(vec![cohort_aggregation::TensorSpec::new("w", [n])]).unwrap())
    }

    fn vector(layout: &Arc<Layout>, values: &[f32]) -> ModelVector {
        ModelVector::new(layout.clone(), values.to_vec()).unwrap()
    }

    fn spec(extra: serde_json::Value) -> ExperimentSpec {
        let mut spec = serde_json::json!({
            "name": "s", "features": 4, "classes": 2, "model": "logreg",
            "rounds": 5, "clients_per_round": 4, "min_participants": 2
        });
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(spec).unwrap()
    }

    fn fields(spec: &ExperimentSpec) -> Vec<&'static str> {
        spec.problems().into_iter().map(|p| p.field).collect()
    }

    #[test]
    fn sync_is_the_default_mode_and_stays_out_of_the_stored_spec() {
        let s = spec(serde_json::json!({}));
        assert_eq!(s.mode, ExperimentMode::Sync);
        assert!(s.fedbuff().is_none());
        assert!(fields(&s).is_empty());
        assert!(serde_json::to_value(&s).unwrap().get("mode").is_none());
        let f = spec(serde_json::json!({"mode": "fedbuff"}));
        assert_eq!(serde_json::to_value(&f).unwrap()["mode"], "fedbuff");
    }

    #[test]
    fn fedbuff_defaults_follow_the_round_settings_and_the_simulation() {
        let s = spec(serde_json::json!({"mode": "fedbuff", "over_selection": 1.5}));
        let f = s.fedbuff().unwrap();
        assert_eq!((f.buffer_size, f.concurrency), (4, 6));
        assert_eq!(f.staleness_exponent, 0.5);
        assert_eq!(f.max_staleness, None);
        assert_eq!(f.task_seconds, s.collect_deadline_seconds);
        let s = spec(serde_json::json!({"mode": "fedbuff", "buffer_size": 3,
            "concurrency": 9, "staleness_exponent": 1.0, "max_staleness": 4}));
        let f = s.fedbuff().unwrap();
        assert_eq!(
            (f.buffer_size, f.concurrency, f.max_staleness),
            (3, 9, Some(4))
        );
        assert!(fields(&s).is_empty());
    }

    #[test]
    fn fedbuff_settings_are_checked_and_name_their_fields() {
        let s = spec(serde_json::json!({"mode": "fedbuff", "buffer_size": 0,
            "concurrency": 0, "staleness_exponent": -1.0}));
        assert_eq!(
            fields(&s),
            ["buffer_size", "concurrency", "staleness_exponent"]
        );
        let s = spec(serde_json::json!({"buffer_size": 3, "max_staleness": 2}));
        assert_eq!(fields(&s), ["buffer_size", "max_staleness"]);
        let secure = spec(serde_json::json!({"mode": "fedbuff", "secure_aggregation": {}}));
        let problems = secure.problems();
        assert_eq!(problems[0].field, "secure_aggregation");
        assert!(problems[0].message.contains("mode fedbuff"), "{problems:?}");
        // Differential privacy and the robust rules assume sync rounds.
        let private = spec(serde_json::json!({"mode": "fedbuff", "privacy":
            {"noise_multiplier": 1.0, "clip": 0.5, "epsilon_budget": 8}}));
        assert!(
            fields(&private).contains(&"privacy"),
            "{:?}",
            private.problems()
        );
        let robust = spec(serde_json::json!({"mode": "fedbuff", "aggregator": "median"}));
        assert!(
            fields(&robust).contains(&"aggregator"),
            "{:?}",
            robust.problems()
        );
        let unknown = serde_json::from_value::<ExperimentSpec>(serde_json::json!({
            "name": "s", "features": 4, "classes": 2, "model": "logreg", "rounds": 5,
            "clients_per_round": 4, "min_participants": 2, "mode": "async"
        }));
        assert!(unknown.is_err());
        assert_eq!(
            "FedBuff".parse::<ExperimentMode>(),
            Ok(ExperimentMode::Fedbuff)
        );
        assert!("async".parse::<ExperimentMode>().is_err());
    }

    #[test]
    fn fresh_updates_average_by_samples_like_fedavg() {
        let l = layout(2);
        let global = vector(&l, &[1.0, 1.0]);
        let (a, b) = (vector(&l, &[3.0, 1.0]), vector(&l, &[1.0, 5.0]));
        let reducer = cohort_aggregation::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        fold.fold_batch(&[(&a, &global, 1, 0), (&b, &global, 3, 0)])
            .unwrap();
        // deltas (2, 0) x1 and (0, 4) x3 over 4 samples.
        let target = fold.target(&global).unwrap();
        assert_eq!(target.values(), &[1.5, 4.0]);
    }

    #[test]
    fn stale_updates_count_from_their_own_base_and_shrink_the_step() {
        let l = layout(1);
        let global = vector(&l, &[10.0]);
        let old_base = vector(&l, &[0.0]);
        let fresh = vector(&l, &[12.0]); // delta 2 from the current model
        let stale = vector(&l, &[4.0]); // delta 4 from version 0, three steps ago
        let reducer = cohort_aggregation::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        fold.fold_batch(&[(&fresh, &global, 1, 0), (&stale, &old_base, 1, 3)])
            .unwrap();
        // s(3) = 1/2: (1 * 2 + 0.5 * 4) / 2 samples = 2.
        let target = fold.target(&global).unwrap();
        assert!((target.values()[0] - 12.0).abs() < 1e-6, "{target:?}");
    }

    #[test]
    fn exponent_zero_ignores_staleness_and_an_empty_buffer_is_refused() {
        let l = layout(1);
        let global = vector(&l, &[0.0]);
        let trained = vector(&l, &[2.0]);
        let reducer = cohort_aggregation::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.0).unwrap();
        assert_eq!(fold.weight(5, 100), 5.0);
        fold.fold_batch(&[(&trained, &global, 5, 100)]).unwrap();
        assert_eq!(fold.target(&global).unwrap().values(), &[2.0]);
        let empty = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        assert!(matches!(empty.target(&global), Err(FoldError::Empty)));
    }

    #[test]
    fn a_non_finite_update_is_refused_and_changes_nothing() {
        let l = layout(1);
        let global = vector(&l, &[0.0]);
        let good = vector(&l, &[1.0]);
        let nan = vector(&l, &[f32::NAN]);
        let reducer = cohort_aggregation::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        assert!(
            fold.fold_batch(&[(&good, &global, 1, 0), (&nan, &global, 1, 0)])
                .is_err()
        );
        fold.fold_batch(&[(&good, &global, 1, 0)]).unwrap();
        assert_eq!(fold.target(&global).unwrap().values(), &[1.0]);
    }
}
