//! Models users bring: safetensors files uploaded as an experiment's initial model, the
//! model an experiment trains (built in or from a file), and what clients report back
//! about it (their own evaluations, and the tasks their trainers could not complete).
//!
//! A model defined by a file has no architecture the coordinator knows: it aggregates
//! the file's tensors as they are and leaves training and evaluation to the clients'
//! trainers. Its metrics are the clients' evaluation reports, weighted by their sample
//! counts.

use cohort_edge::protocol::messages::{EvaluationReport, FailureReport, WithheldReason};
use std::collections::BTreeMap;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::server::AppState;
use crate::server::driver::model::model_file_blob;
use crate::server::error::{ApiError, ErrorBody, ErrorCode, Json};
use crate::server::http::extract::AuthenticatedClient;
use crate::server::http::extract::parse_id;
use crate::store::{ClientEvaluation, ModelFile, TaskFailure, now_millis};

/// Where an uploaded model file's name comes from.
#[derive(Debug, Clone, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UploadModelQuery {
    /// A name for people (1 to 200 characters, not blank, no control characters);
    /// default `model`.
    #[param(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\u0000-\u001F\u007F-\u009F]*[^\s\u0000-\u001F\u007F-\u009F][^\u0000-\u001F\u007F-\u009F]*$"
    )]
    #[serde(default)]
    pub name: Option<String>,
}

/// Uploads a model file to start experiments from.
///
/// The body (`application/octet-stream`) is a safetensors file of `F32` tensors with
/// finite values. The answer names its tensors; an experiment refers to it by id
/// (`"model": "file", "initial_model": ID`).
#[utoipa::path(post, path = "/api/v1/admin/models", tag = "admin",
    security(("admin_token" = [])), params(UploadModelQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, description = "Stored", body = ModelFile), (status = 401, body = ErrorBody),
              (status = 413, body = ErrorBody), (status = 415, body = ErrorBody),
              (status = 422, description = "Not a usable safetensors model", body = ErrorBody)))]
async fn upload_model(
    State(state): State<AppState>,
    query: Result<Query<UploadModelQuery>, axum::extract::rejection::QueryRejection>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<ModelFile>), ApiError> {
    let Query(query) =
        query.map_err(|e| ApiError::unprocessable(ErrorCode::InvalidQuery, e.body_text()))?;
    // A model file may be as large as the server takes (--max-body-bytes); the JSON
    // routes' smaller default limit does not apply to it.
    let limit = state.settings.max_body_bytes;
    let too_large = || {
        ApiError::PayloadTooLarge(format!(
            "the model file is larger than the limit of {limit} bytes"
        ))
    };
    // A declared length over the limit is refused before a byte of it is read.
    if crate::server::http::extract::declared_length(&headers).is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let body = axum::body::to_bytes(body, limit).await.map_err(|e| {
        if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
        {
            too_large()
        } else {
            ApiError::bad_request(
                ErrorCode::UnreadableBody,
                format!("reading the model file failed: {e}"),
            )
        }
    })?;
    let is_octets = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/octet-stream"));
    if !is_octets {
        return Err(ApiError::UnsupportedMediaType(
            "a model file must be sent as application/octet-stream".into(),
        ));
    }
    let name = query.name.unwrap_or_else(|| "model".into());
    let file = store_model_file(&state, name, body).await?;
    Ok((StatusCode::CREATED, Json(file)))
}

/// Checks an uploaded model file and stores it: the name (1 to 200 characters, no
/// control characters), a
/// safetensors file of finite `F32` tensors, at most the parameters a model may have.
/// Nothing is stored unless all of that holds. Shared by the API and the dashboard, so
/// that both accept exactly the same files.
pub(crate) async fn store_model_file(
    state: &AppState,
    name: String,
    body: axum::body::Bytes,
) -> Result<ModelFile, ApiError> {
    if let Err(why) = cohort_core::text::check_label("name", &name) {
        return Err(ApiError::unprocessable(ErrorCode::InvalidModel, why));
    }
    let (vector, sha256) = tokio::task::spawn_blocking(move || {
        let vector = cohort_aggregation::model_file::decode(&body, usize::MAX)?;
        Ok::<_, cohort_aggregation::model_file::ModelFileError>((
            vector,
            hex(ring::digest::digest(&ring::digest::SHA256, &body).as_ref()),
        ))
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(|e| ApiError::unprocessable(ErrorCode::InvalidModel, format!("model file: {e}")))?;
    if vector.len() > cohort_edge::model::MAX_PARAMETERS {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidModel,
            format!(
                "model file: {} parameters, more than the {} supported",
                vector.len(),
                cohort_edge::model::MAX_PARAMETERS
            ),
        ));
    }
    let id = Uuid::new_v4();
    let file = ModelFile {
        id,
        name,
        tensors: vector.layout().tensors().to_vec(),
        parameters: vector.len() as i64,
        sha256,
        blob_path: model_file_blob(id),
        created_at: now_millis(),
    };
    let blobs = state.blobs.clone();
    let path = file.blob_path.clone();
    let bytes = cohort_aggregation::wire::encode(&vector);
    tokio::task::spawn_blocking(move || blobs.put(&path, &bytes))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)?;
    state.store.create_model_file(&file).await?;
    Ok(file)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every uploaded model file, newest first.
#[utoipa::path(get, path = "/api/v1/admin/models", tag = "admin",
    security(("admin_token" = [])),
    responses((status = 200, description = "Model files, newest first", body = Vec<ModelFile>), (status = 401, body = ErrorBody)))]
async fn list_models(State(state): State<AppState>) -> Result<Json<Vec<ModelFile>>, ApiError> {
    Ok(Json(state.store.model_files().await?))
}

/// One uploaded model file.
#[utoipa::path(get, path = "/api/v1/admin/models/{id}", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Model file id")),
    responses((status = 200, description = "The model file", body = ModelFile), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
async fn get_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ModelFile>, ApiError> {
    let id = parse_id(&id, "model file")?;
    Ok(Json(state.store.model_file(id).await?))
}

/// One model version's evaluation by the clients.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct VersionEvaluation {
    /// The published round whose model was evaluated (0: the initial model).
    pub model_version: i64,
    /// The sample-weighted means.
    #[serde(flatten)]
    pub summary: EvaluationSummary,
}

/// The clients' evaluations of every model version of an experiment (from 0, the
/// initial model), each metric weighted by the examples behind it.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/evaluations", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Per model version", body = Vec<VersionEvaluation>),
              (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn list_evaluations(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Vec<VersionEvaluation>>, ApiError> {
    let id = parse_id(&id, "experiment")?;
    state.store.experiment(id).await?;
    let summaries = summarise(&state.store.client_evaluations(id).await?);
    Ok(Json(
        summaries
            .into_iter()
            .map(|(model_version, summary)| VersionEvaluation {
                model_version,
                summary,
            })
            .collect(),
    ))
}

/// The admin routes of model files and evaluations, relative to the admin prefix.
pub(crate) fn admin_routes() -> Router<AppState> {
    Router::new()
        .route("/models", post(upload_model).get(list_models))
        .route("/models/{id}", get(get_model))
        .route("/experiments/{id}/evaluations", get(list_evaluations))
        .route(
            "/experiments/{id}/evaluations/{version}",
            get(version_evaluations),
        )
}

/// Longest failure reason kept; a trainer's log tail is cut to this.
pub const MAX_REASON_CHARS: usize = 2000;
/// Most metrics one evaluation report may carry.
pub const MAX_METRICS: usize = 32;

/// Checks a metric name: the names end up as JSON keys and dashboard labels.
pub fn valid_metric_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// Records a client's evaluation of a model version of an experiment with a file model.
/// A repeated report (a retry) is accepted and changes nothing. Only from a client that
/// takes part in the experiment; to any other, the experiment does not exist.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/evaluations", tag = "client",
    security(("client_credential" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    request_body = EvaluationReport,
    responses((status = 201, description = "Recorded"), (status = 200, description = "Already recorded"),
              (status = 401, body = ErrorBody),
              (status = 404, description = "No such experiment, or the client takes no part in it", body = ErrorBody),
              (status = 409, description = "The experiment does not take client evaluations", body = ErrorBody),
              (status = 422, body = ErrorBody)))]
async fn report_evaluation(
    State(state): State<AppState>,
    AuthenticatedClient(client): AuthenticatedClient,
    Path(id): Path<String>,
    Json(report): Json<EvaluationReport>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(&id, "experiment")?;
    crate::server::http::extract::require_participant(&state, id, client.id).await?;
    let num_examples = match (report.withheld, report.num_examples) {
        (Some(_), None) if report.metrics.is_empty() => 0,
        (Some(_), _) => {
            return Err(ApiError::unprocessable(
                ErrorCode::InvalidEvaluation,
                "a report that withholds its metrics carries none: no num_examples, no metrics",
            ));
        }
        (None, Some(n)) if n >= 1 => n,
        (None, _) => {
            return Err(ApiError::unprocessable(
                ErrorCode::InvalidEvaluation,
                "num_examples must be at least 1",
            ));
        }
    };
    if report.metrics.len() > MAX_METRICS {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidEvaluation,
            format!("at most {MAX_METRICS} metrics"),
        ));
    }
    if let Some((name, value)) = report
        .metrics
        .iter()
        .find(|(n, v)| !valid_metric_name(n) || !v.is_finite())
    {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidEvaluation,
            format!(
                "metric `{}` = {value}: names are 1 to 64 letters, digits, `_`, `.` or `-`, values finite",
                name.chars().take(80).collect::<String>()
            ),
        ));
    }
    let exp = state.store.experiment(id).await?;
    let spec = crate::server::driver::experiment_spec(&exp).map_err(ApiError::internal)?;
    if let Some(why) = spec.evaluation_refusal() {
        return Err(ApiError::conflict(ErrorCode::EvaluationsNotTaken, why));
    }
    let current = state.store.latest_model(id).await?.map_or(-1, |m| m.round);
    if report.model_version < 0 || report.model_version > current {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidEvaluation,
            format!(
                "model_version must be a published version, 0 to {current}, got {}",
                report.model_version
            ),
        ));
    }
    let new = state
        .store
        .record_client_evaluation(
            id,
            &ClientEvaluation {
                model_version: report.model_version,
                client_id: client.id,
                num_examples,
                metrics: report.metrics,
                at: now_millis(),
                withheld: report.withheld.map(|w| w.as_str().to_string()),
            },
        )
        .await?;
    Ok(if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    })
}

/// Reports that this client could not complete its task for a round attempt (its
/// trainer failed or its output was refused); nothing is uploaded for it. Attempt 0 of
/// the final round: the evaluation task of a finished experiment. The round goes
/// on without the client, as with any dropout.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/failure",
    tag = "client", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path, description = "Experiment id"), ("round" = i64, Path), ("attempt" = i64, Path)),
    request_body = FailureReport,
    responses((status = 201, description = "Recorded"), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody),
              (status = 409, description = "`already_uploaded`: the client's update for this task is already counted", body = ErrorBody),
              (status = 422, body = ErrorBody)))]
async fn report_failure(
    State(state): State<AppState>,
    AuthenticatedClient(client): AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    Json(report): Json<FailureReport>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(&id, "experiment")?;
    cohort_core::text::check_free_text("reason", &report.reason)
        .map_err(|e| ApiError::unprocessable(ErrorCode::InvalidFailure, e))?;
    // Only a client the round selected may speak for it; attempt 0 is the evaluation of
    // a finished experiment's final model, which its clients are asked for.
    let selected = if attempt == 0 {
        crate::server::http::extract::require_participant(&state, id, client.id).await?;
        let exp = state.store.experiment(id).await?;
        let spec = crate::server::driver::experiment_spec(&exp).map_err(ApiError::internal)?;
        exp.state == crate::store::ExperimentState::Finished
            && round == exp.current_round
            && spec.evaluation_refusal().is_none()
    } else {
        state
            .store
            .participations(id, round, attempt)
            .await?
            .iter()
            .any(|p| p.client_id == client.id)
    };
    if !selected {
        return Err(ApiError::NotFound(format!(
            "no task of experiment {id} round {round} attempt {attempt} for this client"
        )));
    }
    let reason: String = report.reason.chars().take(MAX_REASON_CHARS).collect();
    tracing::warn!(experiment = %id, round, attempt, client = %client.id, %reason,
        "client reports its task failed");
    state
        .store
        .record_task_failure(
            id,
            &TaskFailure {
                round,
                attempt,
                client_id: client.id,
                reason,
                at: now_millis(),
            },
        )
        .await?;
    Ok(StatusCode::CREATED)
}

/// The client routes of evaluations and failures, with absolute paths.
pub(crate) fn client_routes() -> Router<AppState> {
    Router::new()
        .route(
            cohort_edge::protocol::routes::EVALUATIONS,
            post(report_evaluation),
        )
        .route(cohort_edge::protocol::routes::FAILURE, post(report_failure))
}

/// The clients' evaluations of one model version: sample-weighted means, and how each
/// metric spreads over the clients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EvaluationSummary {
    /// Clients that reported metrics.
    pub clients: usize,
    /// Examples in all.
    pub num_examples: i64,
    /// Each metric's mean over the clients that reported it, weighted by their examples.
    pub metrics: BTreeMap<String, f64>,
    /// Clients that answered without metrics (local differential privacy keeps them on
    /// the client), counted in nothing above.
    #[serde(default)]
    pub withheld: usize,
    /// Each metric over the clients, each client counting once: what a personalised
    /// experiment compares (`personal_accuracy` against the global model's `accuracy`
    /// on the same clients' held-out data).
    #[serde(default)]
    pub per_client: BTreeMap<String, MetricSpread>,
}

/// One metric over the clients that reported it, each counting once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MetricSpread {
    /// Clients that reported it.
    pub clients: usize,
    /// Their unweighted mean.
    pub mean: f64,
    /// The 10th percentile (nearest rank): the clients the model serves worst.
    pub p10: f64,
    /// The lowest.
    pub min: f64,
    /// The highest.
    pub max: f64,
}

impl MetricSpread {
    /// The spread of `values`; `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Self> {
        let (mean, p10) = cohort_core::personalisation::mean_and_p10(values)?;
        Some(Self {
            clients: values.len(),
            mean,
            p10,
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }
}

/// The weighted means of every model version's evaluations.
pub fn summarise(evaluations: &[ClientEvaluation]) -> BTreeMap<i64, EvaluationSummary> {
    /// Per metric: the example-weighted sum and the weight.
    type MetricSums = BTreeMap<String, (f64, f64)>;
    #[derive(Default)]
    struct Version {
        clients: usize,
        num_examples: i64,
        sums: MetricSums,
        withheld: usize,
        values: BTreeMap<String, Vec<f64>>,
    }
    let mut versions: BTreeMap<i64, Version> = BTreeMap::new();
    for e in evaluations {
        let entry = versions.entry(e.model_version).or_default();
        if e.withheld.is_some() {
            entry.withheld += 1;
            continue;
        }
        entry.clients += 1;
        entry.num_examples += e.num_examples;
        for (name, value) in &e.metrics {
            let m = entry.sums.entry(name.clone()).or_default();
            m.0 += value * e.num_examples as f64;
            m.1 += e.num_examples as f64;
            entry.values.entry(name.clone()).or_default().push(*value);
        }
    }
    versions
        .into_iter()
        .map(|(version, v)| {
            (
                version,
                EvaluationSummary {
                    clients: v.clients,
                    num_examples: v.num_examples,
                    metrics: v
                        .sums
                        .into_iter()
                        .filter(|(_, (_, weight))| *weight > 0.0)
                        .map(|(name, (sum, weight))| (name, sum / weight))
                        .collect(),
                    withheld: v.withheld,
                    per_client: v
                        .values
                        .into_iter()
                        .filter_map(|(name, values)| MetricSpread::of(&values).map(|s| (name, s)))
                        .collect(),
                },
            )
        })
        .collect()
}

/// Every client's evaluation of one model version of an experiment (a personalised
/// experiment's per-client accuracies: each client's global and personalised model on
/// its own held-out data).
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/evaluations/{version}", tag = "admin",
    security(("admin_token" = [])),
    params(("id" = uuid::Uuid, Path, description = "Experiment id"),
           ("version" = i64, Path, description = "Model version (0: the initial model)")),
    responses((status = 200, description = "One row per client, by client id", body = Vec<ClientEvaluation>),
              (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 422, body = ErrorBody)))]
async fn version_evaluations(
    State(state): State<AppState>,
    Path((id, version)): Path<(String, String)>,
) -> Result<Json<Vec<ClientEvaluation>>, ApiError> {
    let id = parse_id(&id, "experiment")?;
    let version: i64 = version.parse().ok().filter(|v| *v >= 0).ok_or_else(|| {
        ApiError::unprocessable(
            ErrorCode::InvalidEvaluation,
            format!(
                "version must be a model version, 0 or more, got `{}`",
                version.chars().take(40).collect::<String>()
            ),
        )
    })?;
    state.store.experiment(id).await?;
    let rows = state.store.client_evaluations(id).await?;
    Ok(Json(
        rows.into_iter()
            .filter(|e| e.model_version == version)
            .collect(),
    ))
}

/// The handlers above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(
    paths(
        upload_model,
        list_models,
        get_model,
        list_evaluations,
        version_evaluations,
        report_evaluation,
        report_failure
    ),
    components(schemas(
        EvaluationReport,
        WithheldReason,
        FailureReport,
        EvaluationSummary,
        MetricSpread,
        VersionEvaluation
    ))
)]
pub(crate) struct ModelsDoc;

#[cfg(test)]
mod tests {
    use super::*;

    fn evaluation(version: i64, n: i64, accuracy: f64) -> ClientEvaluation {
        ClientEvaluation {
            model_version: version,
            client_id: Uuid::new_v4(),
            num_examples: n,
            metrics: BTreeMap::from([("accuracy".into(), accuracy)]),
            at: 0,
            withheld: None,
        }
    }

    #[test]
    fn summaries_weigh_each_client_by_its_examples() {
        let withheld = ClientEvaluation {
            num_examples: 0,
            metrics: BTreeMap::new(),
            withheld: Some(WithheldReason::LocalDifferentialPrivacy.as_str().into()),
            ..evaluation(1, 0, 0.0)
        };
        let s = summarise(&[
            evaluation(1, 100, 0.9),
            evaluation(1, 300, 0.5),
            withheld.clone(),
            evaluation(2, 10, 1.0),
            ClientEvaluation {
                model_version: 3,
                ..withheld
            },
        ]);
        assert_eq!(s[&1].clients, 2);
        assert_eq!(s[&1].num_examples, 400);
        assert!((s[&1].metrics["accuracy"] - 0.6).abs() < 1e-12);
        assert_eq!(s[&1].withheld, 1, "counted apart, weighing nothing");
        assert_eq!(s[&2].metrics["accuracy"], 1.0);
        assert_eq!(s[&2].withheld, 0);
        assert_eq!((s[&3].clients, s[&3].withheld), (0, 1));
        assert!(s[&3].metrics.is_empty());
    }
}
