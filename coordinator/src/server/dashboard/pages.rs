//! The dashboard's pages and the actions their forms post to. Every page is rendered
//! whole on the server; the parts marked `data-live` are what the page script refreshes.

use std::collections::{BTreeMap, HashMap};

use askama::Template;
use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use chrono::{TimeZone, Utc};
use serde::Deserialize;
use uuid::Uuid;

use super::chart::{self, Chart, Series};
use super::form::{self, Fieldset, Parsed};
use super::multipart;
use super::session::{Session, field, form_fields};
use super::{Chrome, PageError, render};
use crate::server::AppState;
use crate::server::auth::{generate_secret, hash_secret};
use crate::server::error::ApiError;
use crate::server::http::admin::{current_safetensors, resolve_initial_model};
use crate::server::http::extract::{current_model, octets};
use crate::server::http::models::{EvaluationSummary, summarise};
use crate::store::{ExperimentState, Round, RoundStage, now_millis};
use cohort_core::ExperimentSpec;
use cohort_core::SpecModel;

/// Rounds per page of the experiment page's round table.
pub const ROUNDS_PER_PAGE: usize = 50;
/// Clients per page of the clients page.
pub const CLIENTS_PER_PAGE: i64 = 100;
/// Enrolment tokens the clients page lists (newest first).
pub const TOKENS_SHOWN: i64 = 50;
/// Jobs the experiment page lists (newest first).
pub const JOBS_SHOWN: i64 = 20;

impl From<ApiError> for PageError {
    fn from(e: ApiError) -> Self {
        match e {
            ApiError::NotFound(what) => PageError::NotFound(what),
            other => PageError::internal(other.client_message()),
        }
    }
}

fn parse_id(text: &str, what: &str) -> Result<Uuid, PageError> {
    Uuid::parse_str(text).map_err(|_| PageError::NotFound(format!("{what} `{text}`")))
}

/// A Unix-ms time as `2026-12-03 12:00:05 UTC`.
fn when(ms: i64) -> String {
    Utc.timestamp_millis_opt(ms)
        .single()
        .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| "-".into())
}

/// A Unix-ms time relative to `now`: `12 s ago`, `3 min ago`, ...
fn ago(ms: Option<i64>, now: i64) -> String {
    let Some(ms) = ms else {
        return "never".into();
    };
    let s = (now - ms).max(0) / 1000;
    match s {
        0..60 => format!("{s} s ago"),
        60..3600 => format!("{} min ago", s / 60),
        3600..86_400 => format!("{} h ago", s / 3600),
        _ => format!("{} d ago", s / 86_400),
    }
}

fn percent(x: Option<f64>) -> String {
    x.map(|a| format!("{:.1}%", a * 100.0))
        .unwrap_or_else(|| "-".into())
}

fn number(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}

/// `GET /`: the experiments.
pub async fn home() -> Redirect {
    Redirect::to("/experiments")
}

/// A row of the experiments table.
#[derive(Debug, Clone)]
pub struct ExperimentRow {
    id: String,
    name: String,
    state: &'static str,
    round: i64,
    rounds: i64,
    accuracy: String,
    created: String,
}

#[derive(Template)]
#[template(path = "experiments.html")]
struct ExperimentsPage {
    page: Chrome,
    rows: Vec<ExperimentRow>,
}

/// `GET /experiments`: every experiment with its state, round progress and latest
/// accuracy.
pub async fn experiments(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
) -> Result<Response, PageError> {
    let (list, accuracy) =
        tokio::try_join!(state.store.experiments(), state.store.latest_accuracies())?;
    let rows = list
        .into_iter()
        .map(|e| {
            let rounds = e.spec.get("rounds").and_then(|r| r.as_i64()).unwrap_or(0);
            ExperimentRow {
                id: e.id.to_string(),
                name: e.name,
                state: e.state.as_str(),
                round: e.current_round,
                rounds,
                accuracy: accuracy
                    .get(&e.id)
                    .map(|a| percent(a.test_accuracy))
                    .unwrap_or_else(|| "-".into()),
                created: when(e.created_at),
            }
        })
        .collect();
    Ok(render(&ExperimentsPage {
        page: Chrome::signed_in(&session, "experiments"),
        rows,
    }))
}

#[derive(Template)]
#[template(path = "new_experiment.html")]
struct NewExperimentPage {
    page: Chrome,
    fieldsets: Vec<Fieldset>,
    invalid: bool,
}

/// The uploaded model files as the form's initial-model select offers them.
async fn model_file_choices(state: &AppState) -> Result<Vec<form::ModelFileChoice>, PageError> {
    Ok(state
        .store
        .model_files()
        .await?
        .into_iter()
        .map(|m| form::ModelFileChoice {
            label: format!(
                "{} ({}, {} parameters, {})",
                m.name,
                &m.id.to_string()[..8],
                m.parameters,
                when(m.created_at)
            ),
            id: m.id.to_string(),
        })
        .collect())
}

/// `GET /experiments/new`: the form.
pub async fn new_experiment(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
) -> Result<Response, PageError> {
    let mut fieldsets = form::blank();
    form::with_model_files(&mut fieldsets, &model_file_choices(&state).await?);
    Ok(render(&NewExperimentPage {
        page: Chrome::signed_in(&session, "experiments"),
        fieldsets,
        invalid: false,
    }))
}

/// `POST /experiments`: creates an experiment from the form, or shows the form again
/// with a message next to each bad field.
pub async fn create(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
    body: Bytes,
) -> Result<Response, PageError> {
    let fields = form_fields(&body)?;
    let fieldsets = match form::parse(&fields) {
        Parsed::Spec(mut spec) => {
            // As the API does: the initial model's tensors go into the spec, and the
            // rules that depend on them (its parameter count) run again.
            let errors: HashMap<&'static str, String> =
                match resolve_initial_model(&state, &mut spec).await {
                    Ok(()) => spec
                        .validate()
                        .err()
                        .into_iter()
                        .flat_map(|e| e.problems)
                        .map(|p| (p.field, p.message))
                        .collect(),
                    Err(ApiError::UnprocessableEntity { message, .. }) => {
                        HashMap::from([("initial_model", message)])
                    }
                    Err(e) => return Err(e.into()),
                };
            if errors.is_empty() {
                let value = serde_json::to_value(&*spec).map_err(PageError::internal)?;
                let exp = state.store.create_experiment(&spec.name, &value).await?;
                return Ok(Redirect::to(&format!("/experiments/{}", exp.id)).into_response());
            }
            form::rejected(&fields, &errors)
        }
        Parsed::Invalid(fieldsets) => fieldsets,
    };
    let mut fieldsets = fieldsets;
    form::with_model_files(&mut fieldsets, &model_file_choices(&state).await?);
    let mut response = render(&NewExperimentPage {
        page: Chrome::signed_in(&session, "experiments"),
        fieldsets,
        invalid: true,
    });
    *response.status_mut() = StatusCode::UNPROCESSABLE_ENTITY;
    Ok(response)
}

use super::UPLOAD_PATH;

/// A row of the model files table.
#[derive(Debug, Clone)]
pub struct ModelFileRow {
    id: String,
    name: String,
    parameters: i64,
    /// The values' size as `f32`, e.g. `1.2 MB`.
    size: String,
    /// (name, shape) of each tensor.
    tensors: Vec<(String, String)>,
    sha256: String,
    uploaded: String,
}

#[derive(Template)]
#[template(path = "models.html")]
struct ModelsPage {
    page: Chrome,
    files: Vec<ModelFileRow>,
    /// The file just uploaded, if the page follows an upload.
    uploaded: Option<ModelFileRow>,
    /// Why an upload was refused.
    error: Option<String>,
    /// The name typed, shown again after a refused upload.
    name: String,
    /// The largest upload this server takes, e.g. `64.0 MB`.
    limit: String,
}

/// `n` bytes for people: `532 B`, `4.1 kB`, `1.2 MB`.
fn bytes_text(n: u64) -> String {
    match n {
        0..1_000 => format!("{n} B"),
        1_000..1_000_000 => format!("{:.1} kB", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", n as f64 / 1e6),
        _ => format!("{:.1} GB", n as f64 / 1e9),
    }
}

fn model_file_row(m: &crate::store::ModelFile) -> ModelFileRow {
    ModelFileRow {
        id: m.id.to_string(),
        name: m.name.clone(),
        parameters: m.parameters,
        size: bytes_text(m.parameters.max(0) as u64 * 4),
        tensors: m
            .tensors
            .iter()
            .map(|t| (t.name.clone(), format!("{:?}", t.shape)))
            .collect(),
        sha256: m.sha256.clone(),
        uploaded: when(m.created_at),
    }
}

/// `?uploaded=` of the model files page: the file just stored.
#[derive(Debug, Deserialize)]
pub struct UploadedQuery {
    uploaded: Option<String>,
}

async fn models_page(
    state: &AppState,
    session: &Session,
    uploaded: Option<Uuid>,
    error: Option<String>,
    name: String,
) -> Result<Response, PageError> {
    let files: Vec<ModelFileRow> = state
        .store
        .model_files()
        .await?
        .iter()
        .map(model_file_row)
        .collect();
    let uploaded = uploaded.and_then(|id| {
        let id = id.to_string();
        files.iter().find(|f| f.id == id).cloned()
    });
    let status = if error.is_some() {
        StatusCode::UNPROCESSABLE_ENTITY
    } else {
        StatusCode::OK
    };
    let mut response = render(&ModelsPage {
        page: Chrome::signed_in(session, "models"),
        files,
        uploaded,
        error,
        name,
        limit: bytes_text(state.settings.max_body_bytes as u64),
    });
    *response.status_mut() = status;
    Ok(response)
}

/// `GET /models`: the uploaded model files, and the form to upload one.
pub async fn models(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
    Query(query): Query<UploadedQuery>,
) -> Result<Response, PageError> {
    let uploaded = query
        .uploaded
        .as_deref()
        .and_then(|id| Uuid::parse_str(id).ok());
    models_page(&state, &session, uploaded, None, String::new()).await
}

/// `POST /models`: stores an uploaded safetensors file (a `multipart/form-data` form
/// with `name` and `file`) exactly as the API does, then shows it listed; a file the API
/// would refuse is refused with its reason, and nothing is stored.
pub async fn upload_model(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, PageError> {
    let Some(boundary) = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(multipart::boundary)
    else {
        return Err(PageError::BadRequest(
            "a model file is uploaded as multipart/form-data (the form on this page)".into(),
        ));
    };
    let parts = multipart::parse(&body, &boundary)
        .map_err(|e| PageError::BadRequest(format!("malformed form: {e}")))?;
    let typed = multipart::text(&parts, "name").trim().to_string();
    let file = multipart::part(&parts, "file").filter(|f| !f.data.is_empty());
    let Some(file) = file else {
        let error = "Choose a safetensors file to upload.".to_string();
        return models_page(&state, &session, None, Some(error), typed).await;
    };
    // Without a name, the file's own name (less its extension) says what it is.
    let name = if typed.is_empty() {
        let from_file = file.filename.as_deref().unwrap_or("").trim();
        let stem = from_file.strip_suffix(".safetensors").unwrap_or(from_file);
        if stem.is_empty() {
            "model".to_string()
        } else {
            stem.chars().take(200).collect()
        }
    } else {
        typed.clone()
    };
    match crate::server::http::models::store_model_file(&state, name, file.data.clone()).await {
        Ok(stored) => {
            Ok(Redirect::to(&format!("{UPLOAD_PATH}?uploaded={}", stored.id)).into_response())
        }
        Err(ApiError::UnprocessableEntity { message, .. }) => {
            models_page(&state, &session, None, Some(capitalise(&message)), typed).await
        }
        Err(e) => Err(e.into()),
    }
}

/// `text` with its first letter upper-case and a full stop, as a sentence on a page.
fn capitalise(text: &str) -> String {
    let mut chars = text.chars();
    let mut out: String = chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default();
    if !out.ends_with('.') {
        out.push('.');
    }
    out
}

/// A byte count as people read it: `–` for none, else B, kB or MB (decimal).
fn bytes(n: i64) -> String {
    match n {
        0 => "–".into(),
        n if n < 1_000 => format!("{n} B"),
        n if n < 1_000_000 => format!("{:.1} kB", n as f64 / 1e3),
        n => format!("{:.2} MB", n as f64 / 1e6),
    }
}

/// A row of the rounds table.
#[derive(Debug, Clone)]
pub struct RoundRow {
    round: i64,
    attempt: i64,
    stage: &'static str,
    selected: i64,
    reported: i64,
    dropped: i64,
    train_loss: String,
    test_loss: String,
    accuracy: String,
    /// Against observers of the published models.
    epsilon: String,
    /// Against the coordinator: the worst client's so far.
    epsilon_coordinator: String,
    duration: String,
    failure: String,
    /// Tasks of this attempt that clients reported they could not complete.
    failed_tasks: usize,
    /// Bytes the attempt's clients uploaded, all together.
    bytes_up: String,
    /// Bytes of model the attempt's clients downloaded, all together.
    bytes_down: String,
}

/// A task a client reported it could not complete.
#[derive(Debug, Clone)]
pub struct FailureRow {
    round: i64,
    attempt: i64,
    client: String,
    at: String,
    /// Client-supplied text: the template escapes it like every value.
    reason: String,
}

/// The round in progress.
#[derive(Debug, Clone)]
pub struct LiveRound {
    round: i64,
    attempt: i64,
    stage: &'static str,
    deadline: String,
    selected: i64,
    reported: i64,
    /// For a secure round: (stage, clients that reached it).
    secure_progress: Vec<(&'static str, usize)>,
    /// For a secure round: (stage missed, clients, a few of their ids).
    dropped_at: Vec<(&'static str, usize, String)>,
    secure: bool,
    threshold: usize,
    neighbours: usize,
}

/// A row of the jobs table.
#[derive(Debug, Clone)]
pub struct JobRow {
    id: i64,
    kind: &'static str,
    round: i64,
    state: &'static str,
    attempts: String,
    error: String,
}

#[derive(Template)]
#[template(path = "experiment.html")]
struct ExperimentPage {
    page: Chrome,
    id: String,
    name: String,
    state: &'static str,
    can_start: bool,
    can_pause: bool,
    can_resume: bool,
    can_stop: bool,
    round: i64,
    rounds: i64,
    /// `Round`, or `Server step` in mode fedbuff (a round is then a buffer's step).
    round_label: &'static str,
    /// `sync` or `fedbuff`.
    mode: &'static str,
    /// The mode's settings in a line.
    mode_detail: String,
    latest_accuracy: String,
    best_accuracy: String,
    latest_loss: String,
    privacy: String,
    privacy_detail: String,
    /// Epsilon against observers of the published models, in a line (empty without
    /// differential privacy).
    privacy_observers: String,
    /// Epsilon against the coordinator, in a line (empty without differential privacy).
    privacy_coordinator: String,
    model_round: Option<i64>,
    accuracy_chart: String,
    loss_chart: String,
    loss_legend: String,
    participation_chart: String,
    participation_legend: String,
    live: Option<LiveRound>,
    round_rows: Vec<RoundRow>,
    round_page: usize,
    round_pages: usize,
    job_counts: String,
    jobs: Vec<JobRow>,
    settings: Vec<(String, String)>,
    /// Whether the model is from a file: its metrics are the clients' evaluations.
    file_model: bool,
    /// For a file model: the clients' evaluation of the initial model, in a line.
    initial_evaluation: String,
    /// Task failures reported by clients, newest first (at most [`FAILURES_SHOWN`]).
    failures: Vec<FailureRow>,
    /// Every reported task failure of the experiment.
    failure_count: usize,
    /// Whether to show task failures: always for a file model, whose clients run their
    /// own trainers; for a built-in one only once a client has reported one.
    show_failures: bool,
    /// A personalised experiment's per-client accuracies.
    personal: Option<PersonalPanel>,
}

/// A personalised experiment's panel: the global and the personalised models'
/// accuracy over the clients, per model version, and each client's for the latest.
struct PersonalPanel {
    scheme: String,
    /// Newest first, at most [`PERSONAL_VERSIONS_SHOWN`].
    versions: Vec<PersonalVersionRow>,
    latest_version: i64,
    clients: Vec<PersonalClientRow>,
}

/// Model versions the personalisation panel lists.
pub const PERSONAL_VERSIONS_SHOWN: usize = 20;

struct PersonalVersionRow {
    version: i64,
    clients: usize,
    global_mean: String,
    global_p10: String,
    personal_mean: String,
    personal_p10: String,
}

struct PersonalClientRow {
    client: String,
    examples: i64,
    global: String,
    personal: String,
}

impl PersonalPanel {
    fn of(
        scheme: Option<&cohort_edge::personal::Personalisation>,
        summaries: &BTreeMap<i64, EvaluationSummary>,
        evaluations: &[crate::store::ClientEvaluation],
    ) -> Option<Self> {
        let spread = |s: &EvaluationSummary, name: &str| {
            let m = s.per_client.get(name);
            (percent(m.map(|m| m.mean)), percent(m.map(|m| m.p10)))
        };
        let versions = summaries
            .iter()
            .rev()
            .filter(|(_, s)| s.clients > 0)
            .take(PERSONAL_VERSIONS_SHOWN)
            .map(|(version, s)| {
                let (global_mean, global_p10) = spread(s, "accuracy");
                let (personal_mean, personal_p10) = spread(s, "personal_accuracy");
                PersonalVersionRow {
                    version: *version,
                    clients: s.clients,
                    global_mean,
                    global_p10,
                    personal_mean,
                    personal_p10,
                }
            })
            .collect::<Vec<_>>();
        let latest_version = versions.first().map_or(0, |v| v.version);
        let clients = evaluations
            .iter()
            .filter(|e| e.model_version == latest_version && e.withheld.is_none())
            .map(|e| PersonalClientRow {
                client: e.client_id.to_string(),
                examples: e.num_examples,
                global: percent(e.metrics.get("accuracy").copied()),
                personal: percent(e.metrics.get("personal_accuracy").copied()),
            })
            .collect();
        Some(Self {
            scheme: scheme?.to_string(),
            versions,
            latest_version,
            clients,
        })
    }
}

/// Task failures the experiment page lists (newest first).
pub const FAILURES_SHOWN: usize = 100;

/// `?page=` of a paged table.
#[derive(Debug, Deserialize)]
pub struct PageQuery {
    page: Option<String>,
}

impl PageQuery {
    /// The page asked for, from 1; anything unreadable is page 1.
    fn number(&self) -> usize {
        self.page
            .as_deref()
            .and_then(|p| p.parse::<usize>().ok())
            .filter(|p| *p >= 1)
            .unwrap_or(1)
    }
}

/// The settings of a spec as (label, value) lines; an unset one reads `default`.
fn settings_lines(spec: &serde_json::Value) -> Vec<(String, String)> {
    crate::flat_settings::flatten(spec)
        .into_iter()
        .map(|(key, value)| (key, value.unwrap_or_else(|| "default".into())))
        .collect()
}

/// `GET /experiments/{id}`: charts, the round in progress, rounds, jobs, settings.
pub async fn experiment(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
    Path(id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Response, PageError> {
    let id = parse_id(&id, "experiment")?;
    let exp = state.store.experiment(id).await?;
    let (rounds, jobs, model, evaluations, task_failures) = tokio::try_join!(
        state.store.rounds(id),
        state.store.job_summary(id, JOBS_SHOWN),
        state.store.latest_model(id),
        state.store.client_evaluations(id),
        state.store.task_failures(id)
    )?;
    let spec: Option<ExperimentSpec> = serde_json::from_value(exp.spec.clone()).ok();
    let client_metrics = summarise(&evaluations);
    let shown = Shown {
        file_model: spec.as_ref().is_some_and(|s| s.model == SpecModel::File),
        clients: &client_metrics,
    };
    let fedbuff = spec.as_ref().and_then(ExperimentSpec::fedbuff);
    let attempts = last_attempts(&rounds);
    let published: Vec<&Round> = attempts
        .iter()
        .copied()
        .filter(|r| r.stage == RoundStage::Published)
        .collect();
    let charts = Charts::of(&shown, &attempts, &published);
    let live = match rounds.last() {
        Some(r) if r.stage.in_progress() => Some(live_round(&state, r, now_millis()).await?),
        _ => None,
    };
    let privacy_report = PrivacyCard::of(&state, &exp, &rounds).await?;
    let traffic = state.store.traffic(exp.id).await?;
    // Newest first, paged.
    let round_pages = rounds.len().div_ceil(ROUNDS_PER_PAGE).max(1);
    let round_page = query.number().min(round_pages);
    let round_rows = rounds
        .iter()
        .rev()
        .skip((round_page - 1) * ROUNDS_PER_PAGE)
        .take(ROUNDS_PER_PAGE)
        .map(|r| RoundRow::of(r, &shown, &privacy_report, &task_failures, &traffic))
        .collect();
    let best = published
        .iter()
        .filter_map(|r| shown.accuracy(r))
        .fold(None, |best: Option<f64>, a| {
            Some(best.map_or(a, |b| b.max(a)))
        });
    let latest = published.last();
    let (privacy, privacy_detail) = privacy_summary(&exp.spec, &rounds, &privacy_report);
    let (privacy_observers, privacy_coordinator) = privacy_report.lines();
    let state_now = exp.state;
    let page = ExperimentPage {
        page: Chrome::signed_in(&session, "experiments"),
        id: exp.id.to_string(),
        name: exp.name.clone(),
        state: state_now.as_str(),
        can_start: state_now == ExperimentState::Created,
        can_pause: state_now == ExperimentState::Running,
        can_resume: state_now == ExperimentState::Paused,
        can_stop: ExperimentState::Stopped.allowed_from().contains(&state_now),
        round: exp.current_round,
        rounds: spec.as_ref().map_or(0, |s| i64::from(s.rounds)),
        round_label: if fedbuff.is_some() {
            "Server step"
        } else {
            "Round"
        },
        mode: spec.as_ref().map_or("sync", |s| s.mode.as_str()),
        mode_detail: mode_detail(fedbuff.as_ref()),
        latest_accuracy: percent(latest.and_then(|r| shown.accuracy(r))),
        best_accuracy: percent(best),
        latest_loss: number(latest.and_then(|r| shown.loss(r))),
        privacy,
        privacy_detail,
        privacy_observers,
        privacy_coordinator,
        model_round: model.map(|m| m.round),
        accuracy_chart: charts.accuracy,
        loss_chart: charts.loss,
        loss_legend: charts.loss_legend,
        participation_chart: charts.participation,
        participation_legend: charts.participation_legend,
        live,
        round_rows,
        round_page,
        round_pages,
        job_counts: job_counts(&jobs),
        jobs: jobs.recent.iter().map(JobRow::of).collect(),
        settings: settings_lines(&exp.spec),
        file_model: shown.file_model,
        initial_evaluation: initial_evaluation(client_metrics.get(&0)),
        failure_count: task_failures.len(),
        show_failures: shown.file_model || !task_failures.is_empty(),
        failures: task_failures
            .iter()
            .rev()
            .take(FAILURES_SHOWN)
            .map(FailureRow::of)
            .collect(),
        personal: PersonalPanel::of(
            spec.as_ref().and_then(|s| s.personalisation.as_ref()),
            &client_metrics,
            &evaluations,
        ),
    };
    Ok(render(&page))
}

/// The last attempt of each round, in round order: it carries the round's outcome.
fn last_attempts(rounds: &[Round]) -> Vec<&Round> {
    let mut last: Vec<&Round> = Vec::new();
    for r in rounds {
        match last.last_mut() {
            Some(previous) if previous.round == r.round => *previous = r,
            _ => last.push(r),
        }
    }
    last
}

/// Which figures the experiment page shows for a round: the coordinator's test set for
/// a built-in model, the clients' weighted evaluations for a file model.
struct Shown<'a> {
    file_model: bool,
    clients: &'a BTreeMap<i64, EvaluationSummary>,
}

impl Shown<'_> {
    fn figures(&self, r: &Round) -> (Option<f64>, Option<f64>) {
        shown_evaluation(
            self.file_model,
            self.clients,
            r.round,
            r.stage == RoundStage::Published,
            (r.test_accuracy, r.test_loss),
        )
    }

    fn accuracy(&self, r: &Round) -> Option<f64> {
        self.figures(r).0
    }

    fn loss(&self, r: &Round) -> Option<f64> {
        self.figures(r).1
    }

    /// `points` of metric `name`, led by the initial model's (version 0) clients'
    /// evaluation when the model is a file.
    fn with_initial(&self, name: &str, mut points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
        if self.file_model
            && let Some(v) = client_metric(self.clients, 0, name)
        {
            points.insert(0, (0.0, v));
        }
        points
    }
}

/// The experiment page's three charts, rendered, with the legends of the two that plot
/// more than one series.
struct Charts {
    accuracy: String,
    loss: String,
    loss_legend: String,
    participation: String,
    participation_legend: String,
}

impl Charts {
    fn of(shown: &Shown<'_>, attempts: &[&Round], published: &[&Round]) -> Self {
        let series_of = |f: &dyn Fn(&Round) -> Option<f64>| -> Vec<(f64, f64)> {
            published
                .iter()
                .filter_map(|r| f(r).map(|v| (r.round as f64, v)))
                .collect()
        };
        let (accuracy_name, accuracy_title, loss_name) = if shown.file_model {
            (
                "Clients' evaluation accuracy (weighted)",
                "Clients' evaluation accuracy per round",
                "Clients' evaluation loss (weighted)",
            )
        } else {
            ("Test accuracy", "Test accuracy per round", "Test loss")
        };
        let accuracy_series = [Series {
            name: accuracy_name,
            class: "s-accuracy",
            points: shown.with_initial("accuracy", series_of(&|r| shown.accuracy(r))),
        }];
        let loss_series = [
            Series {
                name: loss_name,
                class: "s-test-loss",
                points: shown.with_initial("loss", series_of(&|r| shown.loss(r))),
            },
            Series {
                name: "Training loss (clients, weighted)",
                class: "s-train-loss",
                points: series_of(&|r: &Round| r.train_loss),
            },
        ];
        let finished = |count: fn(&Round) -> i64| -> Vec<(f64, f64)> {
            attempts
                .iter()
                .filter(|r| !r.stage.in_progress())
                .map(|r| (r.round as f64, count(r) as f64))
                .collect()
        };
        let participation_series = [
            Series {
                name: "Uploaded",
                class: "s-uploaded",
                points: finished(|r| r.reported),
            },
            Series {
                name: "Dropped",
                class: "s-dropped",
                points: finished(|r| r.dropped),
            },
        ];
        let chart = |title, y_label, y_range, y_format: fn(f64) -> String, series: &[Series]| {
            chart::render(
                &Chart {
                    title,
                    x_label: "round",
                    y_label,
                    y_range,
                    y_format,
                },
                series,
            )
        };
        Self {
            accuracy: chart(
                accuracy_title,
                "accuracy",
                Some((0.0, 1.0)),
                |y| format!("{:.0}%", y * 100.0),
                &accuracy_series,
            ),
            loss: chart(
                "Loss per round",
                "loss",
                None,
                |y| format!("{y:.2}"),
                &loss_series,
            ),
            loss_legend: chart::legend(&loss_series),
            participation: chart(
                "Participants and dropouts per round",
                "clients",
                None,
                |y| format!("{y:.0}"),
                &participation_series,
            ),
            participation_legend: chart::legend(&participation_series),
        }
    }
}

impl RoundRow {
    fn of(
        r: &Round,
        shown: &Shown<'_>,
        privacy: &PrivacyCard,
        task_failures: &[crate::store::TaskFailure],
        traffic: &HashMap<(i64, i64), (i64, i64)>,
    ) -> Self {
        let (up, down) = traffic
            .get(&(r.round, r.attempt))
            .copied()
            .unwrap_or_default();
        RoundRow {
            bytes_up: bytes(up),
            bytes_down: bytes(down),
            round: r.round,
            attempt: r.attempt,
            stage: r.stage.as_str(),
            selected: r.selected,
            reported: r.reported,
            dropped: r.dropped,
            train_loss: number(r.train_loss),
            test_loss: number(shown.loss(r)),
            accuracy: percent(shown.accuracy(r)),
            epsilon: r.epsilon.map_or_else(|| "–".into(), |e| format!("{e:.3}")),
            epsilon_coordinator: privacy.round_figure(r),
            duration: r
                .finished_at
                .map(|f| format!("{:.1} s", (f - r.started_at) as f64 / 1000.0))
                .unwrap_or_else(|| "running".into()),
            failure: r.failure.clone().unwrap_or_default(),
            failed_tasks: task_failures
                .iter()
                .filter(|f| f.round == r.round && f.attempt == r.attempt)
                .count(),
        }
    }
}

/// How a FedBuff experiment takes its steps, in words; a synchronous one's rounds.
fn mode_detail(fedbuff: Option<&cohort_core::FedBuffSettings>) -> String {
    match fedbuff {
        Some(f) => format!(
            "a step every {} updates, {} clients training at once, staleness exponent {}{}",
            f.buffer_size,
            f.concurrency,
            f.staleness_exponent,
            f.max_staleness
                .map(|m| format!(", updates over {m} steps stale dropped"))
                .unwrap_or_default()
        ),
        None => "rounds with a selected cohort".into(),
    }
}

/// The experiment's jobs counted by state, e.g. `3 done, 1 running`.
fn job_counts(jobs: &crate::store::JobSummary) -> String {
    if jobs.counts.is_empty() {
        return "none yet".into();
    }
    jobs.counts
        .iter()
        .map(|(state, n)| format!("{n} {state}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl JobRow {
    fn of(j: &crate::store::Job) -> Self {
        JobRow {
            id: j.id,
            kind: j.kind.as_str(),
            round: j.round,
            state: j.state.as_str(),
            attempts: format!("{}/{}", j.attempts, j.max_attempts),
            error: j.last_error.clone().unwrap_or_default(),
        }
    }
}

impl FailureRow {
    fn of(f: &crate::store::TaskFailure) -> Self {
        FailureRow {
            round: f.round,
            attempt: f.attempt,
            client: f.client_id.to_string(),
            at: when(f.at),
            reason: f.reason.clone(),
        }
    }
}

/// The clients' evaluation of the initial model (version 0), in words.
fn initial_evaluation(summary: Option<&EvaluationSummary>) -> String {
    match summary {
        Some(s) => format!(
            "accuracy {}, loss {} ({} clients, {} examples{})",
            percent(s.metrics.get("accuracy").copied()),
            number(s.metrics.get("loss").copied()),
            s.clients,
            s.num_examples,
            // Clients under local DP answer without figures: say so, rather than leave
            // the reader to wonder where they went.
            match s.withheld {
                0 => String::new(),
                n => format!("; {n} withheld theirs under local differential privacy"),
            }
        ),
        None => "not reported yet".into(),
    }
}

/// Metric `name` of the clients' evaluations of model version `version`.
fn client_metric(
    clients: &BTreeMap<i64, EvaluationSummary>,
    version: i64,
    name: &str,
) -> Option<f64> {
    clients
        .get(&version)
        .and_then(|s| s.metrics.get(name))
        .copied()
}

/// The (accuracy, loss) a round attempt shows. A built-in model's come from the server's
/// test set (`server`). A file model has none the server could compute: its are the
/// clients' sample-weighted evaluations of the version the attempt published (version
/// `round`), and an attempt that published nothing (one retried for want of a quorum)
/// shows none, though a later attempt of its round has them.
fn shown_evaluation(
    file_model: bool,
    clients: &BTreeMap<i64, EvaluationSummary>,
    round: i64,
    published: bool,
    server: (Option<f64>, Option<f64>),
) -> (Option<f64>, Option<f64>) {
    if !file_model {
        return server;
    }
    if !published {
        return (None, None);
    }
    (
        client_metric(clients, round, "accuracy"),
        client_metric(clients, round, "loss"),
    )
}

/// The privacy card's two figures: epsilon against observers of the published models
/// and against the coordinator, now and after each attempt.
struct PrivacyCard {
    /// `None` without differential privacy.
    figures: Option<PrivacyFigures>,
}

struct PrivacyFigures {
    budget: f64,
    against: cohort_core::privacy::BudgetAgainst,
    observers: f64,
    coordinator: crate::server::privacy::CoordinatorEpsilon,
    by_attempt: HashMap<(i64, i64), Option<f64>>,
}

impl PrivacyCard {
    async fn of(
        state: &AppState,
        exp: &crate::store::Experiment,
        rounds: &[Round],
    ) -> Result<Self, PageError> {
        let spec: Option<cohort_core::ExperimentSpec> =
            serde_json::from_value(exp.spec.clone()).ok();
        let Some((spec, privacy)) = spec.and_then(|s| Some((s.clone(), s.privacy?))) else {
            return Ok(Self { figures: None });
        };
        let selections = state.store.selections(exp.id).await?;
        let ledger = crate::server::privacy::CoordinatorLedger::new(rounds, &selections)
            .map_err(PageError::internal)?;
        let coordinator = if spec.secure_aggregation.is_some() {
            ledger.epsilon(privacy.delta).map_err(PageError::internal)?
        } else {
            crate::server::privacy::CoordinatorEpsilon::Unbounded
        };
        Ok(Self {
            figures: Some(PrivacyFigures {
                budget: privacy.epsilon_budget,
                against: privacy.budget_against,
                observers: rounds.iter().rev().find_map(|r| r.epsilon).unwrap_or(0.0),
                coordinator,
                by_attempt: ledger
                    .by_attempt(privacy.delta)
                    .map_err(PageError::internal)?,
            }),
        })
    }

    /// The lines under the big figure: against observers, and against the coordinator.
    fn lines(&self) -> (String, String) {
        let Some(f) = &self.figures else {
            return (String::new(), String::new());
        };
        let enforced = |whom| {
            if f.against == whom {
                format!(" (the budget of {} is enforced on this)", f.budget)
            } else {
                String::new()
            }
        };
        use crate::server::privacy::CoordinatorEpsilon;
        use cohort_core::privacy::BudgetAgainst;
        let coordinator = match f.coordinator {
            CoordinatorEpsilon::Bounded { epsilon, rounds } => format!(
                "against the coordinator, which knows who took part: ε {epsilon:.3}, the worst \
                 client's, over the {rounds} attempts it was selected for, without \
                 amplification{}",
                enforced(BudgetAgainst::Coordinator)
            ),
            CoordinatorEpsilon::Unbounded => format!(
                "against the coordinator: none holds ({})",
                crate::server::privacy::CENTRAL_NOISE_UNBOUNDED
            ),
        };
        (
            format!(
                "against observers of the published models: ε {:.3}, amplified by sampling{}",
                f.observers,
                enforced(BudgetAgainst::Observers)
            ),
            coordinator,
        )
    }

    /// The figure the budget is enforced on.
    fn budgeted(&self) -> f64 {
        let Some(f) = &self.figures else { return 0.0 };
        match f.against {
            cohort_core::privacy::BudgetAgainst::Observers => f.observers,
            cohort_core::privacy::BudgetAgainst::Coordinator => {
                f.coordinator.epsilon().unwrap_or(f64::INFINITY)
            }
        }
    }

    /// The rounds table's coordinator figure for an attempt.
    fn round_figure(&self, r: &Round) -> String {
        match &self.figures {
            Some(f) if r.privacy.is_some() => match f.by_attempt.get(&(r.round, r.attempt)) {
                Some(Some(e)) => format!("{e:.3}"),
                _ => "none holds".into(),
            },
            _ => "–".into(),
        }
    }
}

/// The privacy card: epsilon spent of the budget (the last charged attempt's figure,
/// which composes every earlier charge), and how the noise is added. The figure is the
/// one the budget is enforced on: against observers unless the experiment says
/// `budget_against: coordinator`; the card's lines below it give both.
fn privacy_summary(
    spec: &serde_json::Value,
    rounds: &[Round],
    card: &PrivacyCard,
) -> (String, String) {
    let spec: Option<cohort_core::ExperimentSpec> = serde_json::from_value(spec.clone()).ok();
    let Some(spec) = spec else {
        return ("unknown".into(), "the stored settings do not parse".into());
    };
    let Some(privacy) = &spec.privacy else {
        return (
            "not enabled".into(),
            "no noise is added: the published models carry no privacy guarantee".into(),
        );
    };
    let spent = card.budgeted();
    let mechanism = if spec.secure_aggregation.is_some() {
        "distributed noise (each client's share, before masking)"
    } else {
        "central noise (added by the coordinator)"
    };
    let clip = if privacy.clip_quantile.is_some() {
        format!(
            "adaptive clip, now {:.4}",
            crate::server::privacy::current_clip(privacy, rounds)
        )
    } else {
        format!("clip {}", privacy.clip)
    };
    (
        format!("ε {spent:.3} of {}", privacy.epsilon_budget),
        format!(
            "δ {:e}; {mechanism}; noise multiplier {}; {clip}",
            privacy.delta, privacy.noise_multiplier
        ),
    )
}

/// The round in progress, with a secure round's protocol progress and who dropped where.
async fn live_round(state: &AppState, r: &Round, now: i64) -> Result<LiveRound, PageError> {
    let participants = state
        .store
        .participations(r.experiment_id, r.round, r.attempt)
        .await?;
    let config =
        crate::server::driver::secure_rounds::round_config(r).map_err(PageError::internal)?;
    let deadline = r
        .stage_deadline
        .map(|d| {
            let left = (d - now) / 1000;
            if left >= 0 {
                format!("{left} s left")
            } else {
                format!("passed {} s ago", -left)
            }
        })
        .unwrap_or_else(|| "-".into());
    let mut live = LiveRound {
        round: r.round,
        attempt: r.attempt,
        stage: r.stage.as_str(),
        deadline,
        selected: r.selected,
        reported: r.reported,
        secure_progress: Vec::new(),
        dropped_at: Vec::new(),
        secure: config.is_some(),
        threshold: 0,
        neighbours: 0,
    };
    if let Some(config) = config {
        let p = crate::server::driver::secure_rounds::progress(&participants);
        live.threshold = config.threshold;
        live.neighbours = config.neighbours;
        live.secure_progress = vec![
            ("selected", p.selected),
            ("advertised keys", p.advertised),
            ("revealed graph nonce", p.revealed),
            ("shared keys", p.shared),
            ("uploaded masked input", p.masked),
        ];
        if config.consistency_check {
            live.secure_progress
                .push(("signed the survivor list", p.confirmed));
        }
        live.secure_progress.push(("revealed shares", p.unmasked));
        let mut by_stage: HashMap<&str, Vec<String>> = HashMap::new();
        for part in &participants {
            if let Some(stage) = part.dropped_stage.as_deref() {
                by_stage
                    .entry(stage)
                    .or_default()
                    .push(part.client_id.to_string()[..8].to_string());
            }
        }
        for (stage, label) in [
            ("advertise", "advertising keys"),
            ("reveal", "revealing the graph nonce"),
            ("share", "sharing keys"),
            ("masked", "uploading the masked input"),
            ("confirm", "signing the survivor list"),
            ("unmask", "unmasking"),
        ] {
            let ids = by_stage.remove(stage).unwrap_or_default();
            let shown = ids.iter().take(8).cloned().collect::<Vec<_>>().join(", ");
            let more = if ids.len() > 8 {
                format!(" and {} more", ids.len() - 8)
            } else {
                String::new()
            };
            live.dropped_at
                .push((label, ids.len(), format!("{shown}{more}")));
        }
    }
    Ok(live)
}

/// `POST /experiments/{id}/{start|pause|resume|stop}`.
pub async fn act(
    State(state): State<AppState>,
    Path((id, action)): Path<(String, String)>,
) -> Result<Response, PageError> {
    let uuid = parse_id(&id, "experiment")?;
    let current = state.store.experiment(uuid).await?;
    let (to, needs) = match action.as_str() {
        "start" => (ExperimentState::Running, Some(ExperimentState::Created)),
        "pause" => (ExperimentState::Paused, None),
        "resume" => (ExperimentState::Running, Some(ExperimentState::Paused)),
        "stop" => (ExperimentState::Stopped, None),
        other => return Err(PageError::NotFound(format!("action `{other}`"))),
    };
    if let Some(needs) = needs
        && current.state != needs
    {
        return Err(PageError::Conflict(format!(
            "experiment `{}` is {}; only a {} experiment can {action}",
            current.name,
            current.state.as_str(),
            needs.as_str()
        )));
    }
    state
        .store
        .set_experiment_state(uuid, to, &crate::store::admin_actor())
        .await?;
    crate::server::driver::track::experiment_changed(&state, uuid, to);
    Ok(Redirect::to(&format!("/experiments/{uuid}")).into_response())
}

/// `GET /experiments/{id}/model`: the current global model as little-endian `f32`.
pub async fn model_raw(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    let (exp, round, bytes) = current_model(&state, &id).await?;
    Ok(octets(
        bytes,
        round,
        Some(format!("{}-round-{round}.f32", exp.id)),
    )?)
}

/// `GET /experiments/{id}/model.safetensors`: the current global model as safetensors.
pub async fn model_safetensors(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    let (file, round, name) = current_safetensors(&state, &id).await?;
    Ok(octets(file, round, Some(name))?)
}

/// A row of the clients table.
#[derive(Debug, Clone)]
pub struct ClientRow {
    id: String,
    label: String,
    enrolled: String,
    last_seen: String,
    /// The fingerprint of its registered identity.
    identity: Option<String>,
    rounds: i64,
    revoked: bool,
}

/// A row of the tokens table.
#[derive(Debug, Clone)]
pub struct TokenRow {
    id: String,
    label: String,
    created: String,
    expires: String,
    status: &'static str,
    revocable: bool,
}

/// A token just issued, shown once.
#[derive(Debug, Clone)]
pub struct Issued {
    label: String,
    token: String,
}

#[derive(Template)]
#[template(path = "clients.html")]
struct ClientsPage {
    page: Chrome,
    clients: Vec<ClientRow>,
    total: i64,
    page_number: i64,
    pages: i64,
    tokens: Vec<TokenRow>,
    issued: Option<Issued>,
    token_error: Option<String>,
    token_label: String,
}

async fn clients_page(
    state: &AppState,
    session: &Session,
    page_number: usize,
    issued: Option<Issued>,
    token_error: Option<String>,
    token_label: String,
) -> Result<Response, PageError> {
    let now = now_millis();
    let total = state.store.client_count().await?;
    let pages = ((total + CLIENTS_PER_PAGE - 1) / CLIENTS_PER_PAGE).max(1);
    let page_number = (page_number as i64).clamp(1, pages);
    let (page, tokens, identities) = tokio::try_join!(
        state
            .store
            .client_page((page_number - 1) * CLIENTS_PER_PAGE, CLIENTS_PER_PAGE),
        state.store.recent_enrolment_tokens(TOKENS_SHOWN),
        state.store.client_identities()
    )?;
    let clients = page
        .clients
        .iter()
        .map(|c| ClientRow {
            id: c.id.to_string(),
            label: c.label.clone(),
            enrolled: when(c.enrolled_at),
            last_seen: ago(c.last_seen_at, now),
            identity: identities
                .get(&c.id)
                .map(cohort_aggregation::secagg::identity::fingerprint),
            rounds: page.rounds_taken.get(&c.id).copied().unwrap_or(0),
            revoked: c.revoked_at.is_some(),
        })
        .collect();
    let tokens = tokens
        .iter()
        .map(|t| {
            let expired = t.expires_at.is_some_and(|e| e <= now);
            let status = if t.revoked_at.is_some() {
                "revoked"
            } else if t.used_at.is_some() {
                "used"
            } else if expired {
                "expired"
            } else {
                "unused"
            };
            TokenRow {
                id: t.id.to_string(),
                label: t.label.clone(),
                created: when(t.created_at),
                expires: t.expires_at.map(when).unwrap_or_else(|| "never".into()),
                status,
                revocable: status == "unused",
            }
        })
        .collect();
    let status = if token_error.is_some() {
        StatusCode::UNPROCESSABLE_ENTITY
    } else {
        StatusCode::OK
    };
    let mut response = render(&ClientsPage {
        page: Chrome::signed_in(session, "clients"),
        clients,
        total,
        page_number,
        pages,
        tokens,
        issued,
        token_error,
        token_label,
    });
    *response.status_mut() = status;
    Ok(response)
}

/// `GET /clients`: enrolled clients (a page at a time) and enrolment tokens.
pub async fn clients(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
    Query(query): Query<PageQuery>,
) -> Result<Response, PageError> {
    clients_page(&state, &session, query.number(), None, None, String::new()).await
}

/// `POST /clients/{id}/revoke`: the client's credential is refused from now on.
pub async fn revoke_client(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, PageError> {
    let id = parse_id(&id, "client")?;
    state.store.revoke_client(id).await?;
    Ok(Redirect::to(&back_to_clients(&body)).into_response())
}

/// `POST /tokens/{id}/revoke`: an unused enrolment token stops working.
pub async fn revoke_token(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, PageError> {
    let id = parse_id(&id, "enrolment token")?;
    state.store.revoke_enrolment_token(id).await?;
    Ok(Redirect::to(&back_to_clients(&body)).into_response())
}

/// The clients page the form was on (its `page` field), to go back to.
fn back_to_clients(body: &[u8]) -> String {
    let page = form_fields(body)
        .ok()
        .and_then(|f| field(&f, "page").and_then(|p| p.parse::<u32>().ok()))
        .filter(|p| *p > 1);
    match page {
        Some(p) => format!("/clients?page={p}"),
        None => "/clients".into(),
    }
}

/// `POST /tokens`: issues an enrolment token and shows it, once, on the clients page.
/// The token is in this answer only (never in a URL, never stored but hashed).
pub async fn create_token(
    State(state): State<AppState>,
    Extension(session): Extension<Session>,
    body: Bytes,
) -> Result<Response, PageError> {
    let fields = form_fields(&body)?;
    let label = field(&fields, "label").unwrap_or("").trim().to_string();
    let hours = field(&fields, "expires_in_hours").unwrap_or("").trim();
    let error = cohort_core::text::check_label("The label", &label)
        .err()
        .map(|why| format!("{why}."));
    let expires_at = match hours {
        "" => Ok(None),
        h => match h.parse::<u64>() {
            Ok(h) if (1..=24 * 3650).contains(&h) => Ok(Some(now_millis() + h as i64 * 3_600_000)),
            _ => Err(format!(
                "Expiry must be a whole number of hours from 1 to 87600, not `{h}`."
            )),
        },
    };
    let (error, expires_at) = match (error, expires_at) {
        (Some(e), _) | (None, Err(e)) => (Some(e), None),
        (None, Ok(at)) => (None, at),
    };
    if error.is_some() {
        return clients_page(&state, &session, 1, None, error, label).await;
    }
    let token = generate_secret().map_err(PageError::internal)?;
    state
        .store
        .create_enrolment_token(&hash_secret(&token), &label, expires_at)
        .await?;
    let mut response = clients_page(
        &state,
        &session,
        1,
        Some(Issued { label, token }),
        None,
        String::new(),
    )
    .await?;
    *response.status_mut() = StatusCode::CREATED;
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A personalised experiment's panel: both models over the clients per version,
    /// newest first, and each client of the latest version.
    #[test]
    fn the_personalisation_panel_shows_both_models_over_the_clients() {
        let report = |version: i64, global: f64, mine: f64| crate::store::ClientEvaluation {
            model_version: version,
            client_id: Uuid::new_v4(),
            num_examples: 10,
            metrics: BTreeMap::from([
                ("accuracy".into(), global),
                ("personal_accuracy".into(), mine),
            ]),
            at: 0,
            withheld: None,
        };
        let evaluations = vec![
            report(0, 0.1, 0.1),
            report(1, 0.5, 0.9),
            report(1, 0.7, 0.8),
        ];
        let summaries = summarise(&evaluations);
        let scheme: cohort_edge::personal::Personalisation = "fedper:layers.1".parse().unwrap();
        assert!(PersonalPanel::of(None, &summaries, &evaluations).is_none());
        let panel = PersonalPanel::of(Some(&scheme), &summaries, &evaluations).unwrap();
        assert_eq!(panel.scheme, "fedper:layers.1");
        assert_eq!(panel.latest_version, 1);
        let v = &panel.versions[0];
        assert_eq!((v.version, v.clients), (1, 2));
        assert_eq!(
            (v.global_mean.as_str(), v.global_p10.as_str()),
            ("60.0%", "50.0%")
        );
        assert_eq!(
            (v.personal_mean.as_str(), v.personal_p10.as_str()),
            ("85.0%", "80.0%")
        );
        assert_eq!(panel.versions[1].version, 0);
        assert_eq!(panel.clients.len(), 2);
    }

    #[test]
    fn a_file_model_shows_the_clients_evaluation_of_the_version_a_round_published() {
        let clients = BTreeMap::from([(
            3,
            EvaluationSummary {
                clients: 2,
                num_examples: 50,
                metrics: BTreeMap::from([("accuracy".into(), 0.8), ("loss".into(), 0.4)]),
                withheld: 0,
                per_client: BTreeMap::new(),
            },
        )]);
        let server = (Some(0.1), Some(2.0));
        // A built-in model: the server's own figures, whatever the clients said.
        assert_eq!(shown_evaluation(false, &clients, 3, true, server), server);
        assert_eq!(
            shown_evaluation(true, &clients, 3, true, server),
            (Some(0.8), Some(0.4))
        );
        // The failed attempt of round 3 published nothing; round 4 is not evaluated yet.
        assert_eq!(
            shown_evaluation(true, &clients, 3, false, server),
            (None, None)
        );
        assert_eq!(
            shown_evaluation(true, &clients, 4, true, server),
            (None, None)
        );
    }

    #[test]
    fn sizes_and_messages_read_as_text() {
        assert_eq!(bytes_text(532), "532 B");
        assert_eq!(bytes_text(4_100), "4.1 kB");
        assert_eq!(bytes_text(67_108_864), "67.1 MB");
        assert_eq!(
            capitalise("model file: bad header"),
            "Model file: bad header."
        );
        assert_eq!(capitalise("done."), "Done.");
    }
}
