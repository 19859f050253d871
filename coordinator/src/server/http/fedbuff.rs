//! FedBuff's client and admin routes: a client's task in a FedBuff experiment, its
//! upload into the open buffer, the version it downloaded, and the per-step report.
//! The buffers' steps and aggregation are the driver's ([`crate::server::driver::fedbuff`]).

use axum::Router;
use axum::extract::{Path, State};
use axum::routing::get;
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::server::AppState;
use crate::server::driver;
use crate::server::driver::fedbuff::buffer_rules;
use crate::server::error::{ApiError, ErrorBody, ErrorCode, Json};
use crate::store::{
    Buffered, Experiment, ExperimentState, FedBuffDrops, NewUpload, StepStats, Upload, now_millis,
};
use cohort_core::ExperimentSpec;
use cohort_core::mode::{ExperimentMode, FedBuffSettings};
use cohort_edge::protocol::Task;

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
            return Ok(Some(spec.plain_task(
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
            buffer_rules(settings, spec.rounds),
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
            ErrorCode::TooStale,
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
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "The steps", body = FedBuffReport),
              (status = 401, body = ErrorBody),
              (status = 404, description = "No such experiment, or not in mode fedbuff", body = ErrorBody)))]
async fn fedbuff_report(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<FedBuffReport>, ApiError> {
    let id = crate::server::http::extract::parse_id(&id, "experiment")?;
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
