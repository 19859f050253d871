//! Admin routes: experiments and their lifecycle, rounds and jobs, enrolment tokens and
//! clients. Mounted under [`ADMIN_PREFIX`](crate::server::ADMIN_PREFIX), behind the admin guard.

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use cohort_edge::model::ModelSpec;

use cohort_core::SpecModel;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::extract::{current_model, octets, parse_id};
use crate::server::AppState;
use crate::server::auth::{generate_secret, hash_secret};
use crate::server::error::{ApiError, ErrorBody, ErrorCode, Json};
use crate::store::{
    Client, ConflictKind, EnrolmentToken, Experiment, ExperimentState, Job, Round, StoreError,
    now_millis,
};

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(what) => ApiError::NotFound(what),
            StoreError::Conflict(conflict) => match conflict_code(conflict.kind) {
                Some(code) => ApiError::conflict(code, conflict.message),
                // A race only the driver can meet reached a request: a fault here.
                None => ApiError::internal(conflict.message),
            },
            StoreError::Refused(refusal) => {
                ApiError::conflict(ErrorCode::from(&refusal), refusal.to_string())
            }
            StoreError::TokenRefused(why) => ApiError::Unauthorized(why.to_string()),
            StoreError::Database(e) if database_unreachable(&e) => ApiError::Unavailable {
                detail: e.to_string(),
                retry_after_seconds: DATABASE_RETRY_AFTER_SECONDS,
            },
            other => ApiError::internal(other),
        }
    }
}

/// The API's code for a store conflict a request can meet; `None` for those only the
/// driver meets.
fn conflict_code(kind: ConflictKind) -> Option<ErrorCode> {
    Some(match kind {
        ConflictKind::InvalidTransition => ErrorCode::InvalidTransition,
        ConflictKind::ExperimentNotRunning => ErrorCode::ExperimentNotRunning,
        ConflictKind::NoBufferOpen => ErrorCode::NoBufferOpen,
        ConflictKind::NotSecure => ErrorCode::NotSecure,
        ConflictKind::WrongStage => ErrorCode::WrongStage,
        ConflictKind::StageDeadlinePassed => ErrorCode::DeadlinePassed,
        ConflictKind::NotSelected => ErrorCode::NotSelected,
        ConflictKind::AlreadySent => ErrorCode::AlreadySent,
        ConflictKind::NotAtStage => ErrorCode::NotInRound,
        ConflictKind::TokenSpent => ErrorCode::TokenSpent,
        ConflictKind::AlreadyRevoked => ErrorCode::AlreadyRevoked,
        ConflictKind::NameTaken => ErrorCode::NameTaken,
        ConflictKind::IdentityConflict => ErrorCode::IdentityConflict,
        ConflictKind::ConcurrentChange
        | ConflictKind::RoundInProgress
        | ConflictKind::StageMoved
        | ConflictKind::JobNotHeld
        | ConflictKind::InvalidArgument => return None,
    })
}

/// What a caller is told to wait while the database is unreachable: the pool
/// reconnects by itself, and a restarted PostgreSQL takes seconds to come back.
pub const DATABASE_RETRY_AFTER_SECONDS: u64 = 5;

/// True for the database errors that mean "not reachable right now" (connection refused
/// or reset, no connection free in time, the server shutting down), as opposed to a
/// query the database refused.
pub fn database_unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => true,
        // PostgreSQL's class 08 (connection exception) and 57P0x (admin shutdown, crash
        // shutdown, cannot connect now).
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P0")),
        _ => false,
    }
}

use cohort_core::{ExperimentSpec, InvalidSpec, TrainSettings};

impl From<InvalidSpec> for ApiError {
    /// A spec that does not validate is a 422 naming the first problem's field.
    fn from(e: InvalidSpec) -> Self {
        ApiError::unprocessable(ErrorCode::InvalidExperiment, e.to_string())
    }
}

/// A request for a new enrolment token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEnrolmentToken {
    /// Who it is for, e.g. the hospital it is handed to: 1 to 200 characters, not only
    /// spaces, no control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\u0000-\u001F\u007F-\u009F]*[^\s\u0000-\u001F\u007F-\u009F][^\u0000-\u001F\u007F-\u009F]*$"
    )]
    pub label: String,
    /// Seconds until it stops working, 1 to ten years; none means it never expires.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 315_360_000)]
    pub expires_in_seconds: Option<u64>,
}

/// The longest an enrolment token may live: ten years.
pub const MAX_TOKEN_LIFETIME_SECONDS: u64 = 10 * 365 * 86_400;

/// A new enrolment token. `token` is shown only here: the server keeps its hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct IssuedEnrolmentToken {
    /// Identifier, for listing and revoking.
    pub id: Uuid,
    /// The one-time token to hand to the client.
    pub token: String,
    /// Its label.
    pub label: String,
    /// Expiry, Unix ms.
    pub expires_at: Option<i64>,
}

/// Creates an experiment in state `created`.
#[utoipa::path(post, path = "/api/v1/admin/experiments", tag = "admin",
    security(("admin_token" = [])), request_body = ExperimentSpec,
    responses((status = 201, description = "Created; later calls name it by its `id`", body = Experiment), (status = 401, body = ErrorBody),
              (status = 422, description = "Invalid spec", body = ErrorBody)))]
async fn create_experiment(
    State(state): State<AppState>,
    Json(mut spec): Json<ExperimentSpec>,
) -> Result<(StatusCode, Json<Experiment>), ApiError> {
    resolve_initial_model(&state, &mut spec).await?;
    spec.validate()?;
    let value = serde_json::to_value(&spec).map_err(ApiError::internal)?;
    let exp = state.store.create_experiment(&spec.name, &value).await?;
    Ok((StatusCode::CREATED, Json(exp)))
}

/// Fills in the tensors of the spec's `initial_model` (or clears them, without one),
/// and checks that a built-in model can start from it.
pub(crate) async fn resolve_initial_model(
    state: &AppState,
    spec: &mut ExperimentSpec,
) -> Result<(), ApiError> {
    spec.tensors = None;
    let Some(id) = spec.initial_model else {
        return Ok(());
    };
    let file = match state.store.model_file(id).await {
        Ok(file) => file,
        Err(StoreError::NotFound(_)) => {
            return Err(ApiError::unprocessable(
                ErrorCode::InvalidExperiment,
                format!("initial_model: no uploaded model file {id}"),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    if let SpecModel::BuiltIn(kind) = &spec.model
        && let Ok(built_in) = ModelSpec::new(kind, spec.features, spec.classes)
    {
        let vector = crate::server::driver::model::load_model_file(state, &file)
            .await
            .map_err(ApiError::internal)?;
        if let Err(e) = crate::server::driver::model::reorder(&vector, built_in.layout()) {
            return Err(ApiError::unprocessable(
                ErrorCode::InvalidExperiment,
                format!("initial_model: not a {} model: {e}", spec.model),
            ));
        }
    }
    spec.tensors = Some(file.tensors);
    Ok(())
}

/// Lists experiments, newest first.
#[utoipa::path(get, path = "/api/v1/admin/experiments", tag = "admin",
    security(("admin_token" = [])),
    responses((status = 200, description = "Experiments, newest first", body = Vec<Experiment>), (status = 401, body = ErrorBody)))]
async fn list_experiments(
    State(state): State<AppState>,
) -> Result<Json<Vec<Experiment>>, ApiError> {
    Ok(Json(state.store.experiments().await?))
}

/// One experiment.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "The experiment", body = Experiment), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
async fn get_experiment(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Experiment>, ApiError> {
    let id = parse_id(&id, "experiment")?;
    Ok(Json(state.store.experiment(id).await?))
}

async fn transition(
    state: &AppState,
    id: &str,
    to: ExperimentState,
) -> Result<Json<Experiment>, ApiError> {
    let id = parse_id(id, "experiment")?;
    let changed = state
        .store
        .set_experiment_state(id, to, &crate::store::admin_actor())
        .await?;
    crate::server::driver::track::experiment_changed(state, id, to);
    Ok(Json(changed))
}

/// Starts a created experiment.
#[utoipa::path(post, path = "/api/v1/admin/experiments/{id}/start", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Running", body = Experiment), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, description = "Not startable", body = ErrorBody)))]
async fn start_experiment(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Experiment>, ApiError> {
    let id_parsed = parse_id(&id, "experiment")?;
    let current = state.store.experiment(id_parsed).await?;
    if current.state != ExperimentState::Created {
        return Err(ApiError::conflict(
            ErrorCode::InvalidTransition,
            format!(
                "experiment {id} is {}; only a created experiment starts (use resume)",
                current.state.as_str()
            ),
        ));
    }
    transition(&state, &id, ExperimentState::Running).await
}

/// Pauses a running experiment: the round in progress finishes, no new one starts.
#[utoipa::path(post, path = "/api/v1/admin/experiments/{id}/pause", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Paused", body = Experiment), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn pause_experiment(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Experiment>, ApiError> {
    transition(&state, &id, ExperimentState::Paused).await
}

/// Resumes a paused experiment.
#[utoipa::path(post, path = "/api/v1/admin/experiments/{id}/resume", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Running", body = Experiment), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn resume_experiment(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Experiment>, ApiError> {
    let id_parsed = parse_id(&id, "experiment")?;
    let current = state.store.experiment(id_parsed).await?;
    if current.state != ExperimentState::Paused {
        return Err(ApiError::conflict(
            ErrorCode::InvalidTransition,
            format!("experiment {id} is {}, not paused", current.state.as_str()),
        ));
    }
    transition(&state, &id, ExperimentState::Running).await
}

/// Stops an experiment for good.
#[utoipa::path(post, path = "/api/v1/admin/experiments/{id}/stop", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Stopped", body = Experiment), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn stop_experiment(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Experiment>, ApiError> {
    transition(&state, &id, ExperimentState::Stopped).await
}

/// Every round attempt of an experiment, with its stage and metrics.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/rounds", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Every round attempt, oldest first", body = Vec<RoundView>), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
async fn list_rounds(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Vec<RoundView>>, ApiError> {
    let id = parse_id(&id, "experiment")?;
    let exp = state.store.experiment(id).await?;
    let rounds = state.store.rounds(id).await?;
    let coordinator_epsilon = coordinator_epsilon_by_attempt(&state, &exp, &rounds).await?;
    let mut evaluations =
        crate::server::http::models::summarise(&state.store.client_evaluations(id).await?);
    let mut failures = state.store.task_failures(id).await?;
    Ok(Json(
        rounds
            .into_iter()
            .map(|round| {
                let published = round.stage == crate::store::RoundStage::Published;
                let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut failures)
                    .into_iter()
                    .partition(|f| f.round == round.round && f.attempt == round.attempt);
                failures = rest;
                RoundView {
                    client_evaluation: published
                        .then(|| evaluations.remove(&round.round))
                        .flatten(),
                    failures: mine,
                    epsilon_coordinator: coordinator_epsilon
                        .get(&(round.round, round.attempt))
                        .copied()
                        .flatten(),
                    round,
                }
            })
            .collect(),
    ))
}

/// Epsilon against the coordinator after each charged attempt of a private experiment,
/// by `(round, attempt)`; empty for one without differential privacy.
pub(crate) async fn coordinator_epsilon_by_attempt(
    state: &AppState,
    exp: &crate::store::Experiment,
    rounds: &[Round],
) -> Result<std::collections::HashMap<(i64, i64), Option<f64>>, ApiError> {
    let privacy = crate::server::driver::experiment_spec(exp)
        .ok()
        .and_then(|spec| spec.privacy);
    let Some(privacy) = privacy else {
        return Ok(Default::default());
    };
    let selections = state.store.selections(exp.id).await?;
    crate::server::privacy::epsilon_against_coordinator_by_attempt(&privacy, rounds, &selections)
        .map_err(ApiError::internal)
}

/// A round attempt with what its clients reported.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct RoundView {
    /// The attempt: stage, deadline, counts, metrics, failure.
    #[serde(flatten)]
    pub round: Round,
    /// For a published round of a file model: the clients' evaluations of the model it
    /// published (reported by the next round's clients, or, for the last round, by
    /// evaluation tasks), weighted by their examples.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_evaluation: Option<crate::server::http::models::EvaluationSummary>,
    /// Tasks of this attempt that clients reported they could not complete, with why.
    pub failures: Vec<crate::store::TaskFailure>,
    /// Differential privacy: epsilon spent against the coordinator up to and including
    /// this attempt (the worst client's; `epsilon` is against observers). `null` without
    /// differential privacy, and under central noise, where none holds.
    pub epsilon_coordinator: Option<f64>,
}

/// What a differentially private experiment has spent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PrivacyReport {
    /// `central` (the coordinator adds the noise) or `distributed` (each client adds a
    /// share before masking).
    pub mechanism: String,
    /// The delta epsilon is stated at.
    pub delta: f64,
    /// The budget.
    pub epsilon_budget: f64,
    /// Whom the budget is enforced against: `observers` (`epsilon_spent`) or
    /// `coordinator` (`epsilon_spent_coordinator`).
    pub budget_against: cohort_core::privacy::BudgetAgainst,
    /// Epsilon spent so far against observers of the published models: the RDP
    /// composition of every round attempt's charge, amplified by the sampling.
    pub epsilon_spent: f64,
    /// Epsilon spent so far against the coordinator, which draws the sample and knows
    /// who took part: the worst client's, its own attempts composed without
    /// amplification. `null` under central noise, where the coordinator sees every update
    /// and no epsilon holds (`epsilon_coordinator_unbounded` says so).
    pub epsilon_spent_coordinator: Option<f64>,
    /// Why `epsilon_spent_coordinator` is `null`; absent when it is a number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon_coordinator_unbounded: Option<String>,
    /// Attempts the worst client (the one `epsilon_spent_coordinator` is for) was
    /// selected for.
    pub worst_client_attempts: u64,
    /// Clients selected for at least one charged attempt.
    pub clients_charged: usize,
    /// Round attempts charged (a failed attempt stays charged).
    pub attempts_charged: usize,
    /// The configured noise multiplier.
    pub noise_multiplier: f64,
    /// The L2 clip the next round uses (it moves when clipping is adaptive).
    pub clip: f64,
    /// Whether the experiment stopped because its next round could have gone over the
    /// budget.
    pub budget_exhausted: bool,
    /// Epsilon after each charged attempt, in order.
    pub rounds: Vec<PrivacyRound>,
}

/// One charged round attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PrivacyRound {
    /// Round number.
    pub round: i64,
    /// Attempt.
    pub attempt: i64,
    /// Probability that an available client was selected.
    pub sampling_rate: f64,
    /// The noise multiplier charged (after dropouts, for distributed noise).
    pub noise_multiplier: f64,
    /// The L2 clip of the round.
    pub clip: f64,
    /// Epsilon spent against observers up to and including it.
    pub epsilon: f64,
    /// Epsilon spent against the coordinator up to and including it: the worst client's
    /// so far; `null` where none holds (central noise).
    pub epsilon_coordinator: Option<f64>,
}

/// Differential privacy: epsilon spent against the budget, round by round, against
/// observers of the published models and against the coordinator. 404 names an
/// experiment without differential privacy as well as an unknown one.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/privacy", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Privacy spent", body = PrivacyReport),
              (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn get_privacy(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<PrivacyReport>, ApiError> {
    let id = parse_id(&id, "experiment")?;
    let exp = state.store.experiment(id).await?;
    let (spec, _) = crate::server::driver::experiment_model(&exp).map_err(ApiError::internal)?;
    let Some(privacy) = &spec.privacy else {
        return Err(ApiError::NotFound(format!(
            "experiment {id} has no differential privacy settings"
        )));
    };
    let rounds = state.store.rounds(id).await?;
    let selections = state.store.selections(id).await?;
    let ledger = crate::server::privacy::CoordinatorLedger::new(&rounds, &selections)
        .map_err(ApiError::internal)?;
    let by_attempt = ledger
        .by_attempt(privacy.delta)
        .map_err(ApiError::internal)?;
    let charged: Vec<PrivacyRound> = rounds
        .iter()
        .filter_map(|r| {
            let p = r.privacy.as_ref()?;
            Some(PrivacyRound {
                round: r.round,
                attempt: r.attempt,
                sampling_rate: p.sampling_rate,
                noise_multiplier: p.noise_multiplier,
                clip: p.clip,
                epsilon: p.epsilon,
                epsilon_coordinator: by_attempt.get(&(r.round, r.attempt)).copied().flatten(),
            })
        })
        .collect();
    let coordinator = ledger.epsilon(privacy.delta).map_err(ApiError::internal)?;
    let (epsilon_spent_coordinator, worst_client_attempts) = match coordinator {
        crate::server::privacy::CoordinatorEpsilon::Bounded { epsilon, rounds } => {
            (Some(epsilon), rounds)
        }
        crate::server::privacy::CoordinatorEpsilon::Unbounded => (None, 0),
    };
    // Central noise is a property of the experiment: say so before its first charge too.
    let unbounded = epsilon_spent_coordinator.is_none() || spec.secure_aggregation.is_none();
    let published = rounds
        .iter()
        .filter(|r| r.stage == crate::store::RoundStage::Published)
        .map(|r| r.round)
        .max()
        .unwrap_or(0);
    Ok(Json(PrivacyReport {
        mechanism: if spec.secure_aggregation.is_some() {
            "distributed"
        } else {
            "central"
        }
        .into(),
        delta: privacy.delta,
        epsilon_budget: privacy.epsilon_budget,
        budget_against: privacy.budget_against,
        epsilon_spent: charged.last().map_or(0.0, |r| r.epsilon),
        epsilon_spent_coordinator: epsilon_spent_coordinator.filter(|_| !unbounded),
        epsilon_coordinator_unbounded: unbounded
            .then(|| crate::server::privacy::CENTRAL_NOISE_UNBOUNDED.to_string()),
        worst_client_attempts,
        clients_charged: ledger.clients(),
        attempts_charged: charged.len(),
        noise_multiplier: privacy.noise_multiplier,
        clip: crate::server::privacy::current_clip(privacy, &rounds),
        // A running experiment finishes early only at the budget check.
        budget_exhausted: exp.state == ExperimentState::Finished
            && published < i64::from(spec.rounds),
        rounds: charged,
    }))
}

/// Who dropped out of a secure round, by the stage they missed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct DroppedAt {
    /// Selected, never advertised keys.
    pub advertise: Vec<Uuid>,
    /// Advertised, never revealed their graph nonce (the attempt failed for it).
    pub reveal: Vec<Uuid>,
    /// Revealed, never sent their shares.
    pub share: Vec<Uuid>,
    /// Sent shares, never uploaded a masked input.
    pub masked: Vec<Uuid>,
    /// Uploaded, never signed the survivor list (consistency check; their input still
    /// counts).
    pub confirm: Vec<Uuid>,
    /// Uploaded, never revealed their shares (their input still counts).
    pub unmask: Vec<Uuid>,
}

/// A secure round's protocol state, for dashboards.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct SecureRoundView {
    /// Clients selected.
    pub parties: u32,
    /// Shares needed to rebuild a secret.
    pub threshold: usize,
    /// Neighbours per client asked for (the graph rounds it up to even, or to the
    /// complete graph).
    pub neighbours: usize,
    /// Each update coordinate is clipped to this.
    pub clip: f32,
    /// How many clients reached each stage.
    pub progress: crate::server::driver::secure_rounds::SecureProgress,
    /// Who dropped where.
    pub dropped: DroppedAt,
}

/// One round attempt in detail.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct RoundDetail {
    /// The attempt: stage, deadline, counts, metrics, failure.
    pub round: Round,
    /// For a secure round: the protocol's progress and who dropped where.
    pub secure_aggregation: Option<SecureRoundView>,
    /// Every selected client's part: state, protocol index and progress, drop stage.
    pub participants: Vec<crate::store::Participation>,
}

/// One round attempt: its stage and, for a secure round, the protocol's progress and who
/// dropped out at which stage.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/rounds/{round}/attempts/{attempt}", tag = "admin",
    security(("admin_token" = [])),
    params(("id" = uuid::Uuid, Path, description = "Experiment id"), ("round" = i64, Path), ("attempt" = i64, Path)),
    responses((status = 200, description = "The round attempt", body = RoundDetail), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
async fn get_round(
    State(state): State<AppState>,
    Path((id, round, attempt)): Path<(String, String, String)>,
) -> Result<Json<RoundDetail>, ApiError> {
    let id = parse_id(&id, "experiment")?;
    let number = |text: &str, what: &str| {
        text.parse::<i64>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| ApiError::NotFound(format!("{what} `{text}`")))
    };
    let (round, attempt) = (number(&round, "round")?, number(&attempt, "attempt")?);
    let r = state.store.round(id, round, attempt).await?;
    let participants = state.store.participations(id, round, attempt).await?;
    let secure = crate::server::driver::secure_rounds::round_config(&r)
        .map_err(ApiError::internal)?
        .map(|config| {
            let mut dropped = DroppedAt::default();
            for p in &participants {
                match p.dropped_stage.as_deref() {
                    Some("advertise") => dropped.advertise.push(p.client_id),
                    Some("reveal") => dropped.reveal.push(p.client_id),
                    Some("share") => dropped.share.push(p.client_id),
                    Some("masked") => dropped.masked.push(p.client_id),
                    Some("confirm") => dropped.confirm.push(p.client_id),
                    Some("unmask") => dropped.unmask.push(p.client_id),
                    _ => {}
                }
            }
            SecureRoundView {
                parties: config.parties,
                threshold: config.threshold,
                neighbours: config.neighbours,
                clip: config.quantization.clip,
                progress: crate::server::driver::secure_rounds::progress(&participants),
                dropped,
            }
        });
    Ok(Json(RoundDetail {
        round: r,
        secure_aggregation: secure,
        participants,
    }))
}

/// The jobs of an experiment (aggregation, evaluation, publishing) and their state.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/jobs", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "Jobs", body = Vec<Job>), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
async fn list_jobs(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Vec<Job>>, ApiError> {
    let id = parse_id(&id, "experiment")?;
    state.store.experiment(id).await?;
    Ok(Json(state.store.jobs(id).await?))
}

/// Issues a one-time enrolment token; the token itself appears only in this answer.
#[utoipa::path(post, path = "/api/v1/admin/enrolment-tokens", tag = "admin",
    security(("admin_token" = [])), request_body = NewEnrolmentToken,
    responses((status = 201, description = "Issued", body = IssuedEnrolmentToken),
              (status = 401, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_token(
    State(state): State<AppState>,
    Json(req): Json<NewEnrolmentToken>,
) -> Result<(StatusCode, Json<IssuedEnrolmentToken>), ApiError> {
    if let Err(why) = cohort_core::text::check_label("label", &req.label) {
        return Err(ApiError::unprocessable(ErrorCode::InvalidTokenRequest, why));
    }
    let expires_at = match req.expires_in_seconds {
        Some(s) if s == 0 || s > MAX_TOKEN_LIFETIME_SECONDS => {
            return Err(ApiError::unprocessable(
                ErrorCode::InvalidTokenRequest,
                "expires_in_seconds must be between 1 and ten years",
            ));
        }
        Some(s) => Some(now_millis() + (s as i64) * 1000),
        None => None,
    };
    let token = generate_secret().map_err(ApiError::internal)?;
    let stored = state
        .store
        .create_enrolment_token(&hash_secret(&token), &req.label, expires_at)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(IssuedEnrolmentToken {
            id: stored.id,
            token,
            label: stored.label,
            expires_at,
        }),
    ))
}

/// Lists enrolment tokens (never the tokens themselves).
#[utoipa::path(get, path = "/api/v1/admin/enrolment-tokens", tag = "admin",
    security(("admin_token" = [])),
    responses((status = 200, description = "Tokens", body = Vec<EnrolmentToken>), (status = 401, body = ErrorBody)))]
async fn list_tokens(State(state): State<AppState>) -> Result<Json<Vec<EnrolmentToken>>, ApiError> {
    Ok(Json(state.store.enrolment_tokens().await?))
}

/// Revokes an unused enrolment token.
#[utoipa::path(post, path = "/api/v1/admin/enrolment-tokens/{id}/revoke", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Token id")),
    responses((status = 204, description = "Revoked"), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn revoke_token(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(&id, "enrolment token")?;
    state.store.revoke_enrolment_token(id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Lists enrolled clients.
#[utoipa::path(get, path = "/api/v1/admin/clients", tag = "admin",
    security(("admin_token" = [])),
    responses((status = 200, description = "Clients", body = Vec<ClientListing>), (status = 401, body = ErrorBody)))]
async fn list_clients(State(state): State<AppState>) -> Result<Json<Vec<ClientListing>>, ApiError> {
    let identities = state.store.client_identities().await?;
    let clients = state.store.clients().await?;
    Ok(Json(
        clients
            .into_iter()
            .map(|client| ClientListing {
                identity_fingerprint: identities
                    .get(&client.id)
                    .map(cohort_aggregation::secagg::identity::fingerprint),
                client,
            })
            .collect(),
    ))
}

/// An enrolled client with its identity's fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ClientListing {
    /// The client.
    #[serde(flatten)]
    pub client: Client,
    /// The fingerprint of its registered identity (compare it with the one `cohort edge`
    /// prints at the site), `null` until it registered one.
    pub identity_fingerprint: Option<String>,
}

/// Clears a client's identity so that it can register a new one (a site that lost its
/// key). Audited: a swapped identity is what an impostor needs.
#[utoipa::path(delete, path = "/api/v1/admin/clients/{id}/identity", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Client id")),
    responses((status = 204, description = "Cleared"), (status = 401, body = ErrorBody),
              (status = 404, description = "No such client, or no identity", body = ErrorBody)))]
async fn reset_client_identity(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(&id, "client")?;
    state.store.reset_identity(id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Revokes a client: its credential is refused from now on.
#[utoipa::path(post, path = "/api/v1/admin/clients/{id}/revoke", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Client id")),
    responses((status = 204, description = "Revoked"), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn revoke_client(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(&id, "client")?;
    state.store.revoke_client(id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The current global model, as raw values.
///
/// The body is the model's `d` parameters as little-endian IEEE-754 `f32` (`4 d`
/// bytes), in the order of the experiment's tensors (a task's `tensors`), each tensor
/// row-major; the round that published it is in the `x-cohort-round` header.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/model", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "The model", content_type = "application/octet-stream",
               headers(("x-cohort-round" = i64, description = "The round that published this model (0: the initial model)"))),
              (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn download_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<axum::response::Response, ApiError> {
    let (_, round, bytes) = current_model(&state, &id).await?;
    octets(bytes, round, None)
}

/// The current global model as a safetensors file.
///
/// The file holds one `F32` tensor per model tensor, with PyTorch state-dict names and
/// shapes (`layers.{i}.weight`, `layers.{i}.bias` for a built-in model), loadable with
/// `safetensors.torch.load_file`; the round that published it is in `x-cohort-round`.
#[utoipa::path(get, path = "/api/v1/admin/experiments/{id}/model.safetensors", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "The model", content_type = "application/octet-stream",
               headers(("x-cohort-round" = i64, description = "The round that published this model (0: the initial model)"))),
              (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn download_safetensors(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<axum::response::Response, ApiError> {
    let (file, round, name) = current_safetensors(&state, &id).await?;
    octets(file, round, Some(name))
}

/// The current global model as a safetensors file, its round and a file name; shared by
/// the API and the dashboard.
pub(crate) async fn current_safetensors(
    state: &AppState,
    id: &str,
) -> Result<(Vec<u8>, i64, String), ApiError> {
    let (exp, round, bytes) = current_model(state, id).await?;
    let file = crate::server::driver::model::model_file(&exp, round, &bytes)
        .map_err(ApiError::internal)?;
    Ok((file, round, format!("{}-round-{round}.safetensors", exp.id)))
}

/// The admin routes for experiments, tokens and clients, relative to the admin prefix.
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/experiments",
            post(create_experiment).get(list_experiments),
        )
        .route("/experiments/{id}", get(get_experiment))
        .route("/experiments/{id}/start", post(start_experiment))
        .route("/experiments/{id}/pause", post(pause_experiment))
        .route("/experiments/{id}/resume", post(resume_experiment))
        .route("/experiments/{id}/stop", post(stop_experiment))
        .route("/experiments/{id}/rounds", get(list_rounds))
        .route("/experiments/{id}/privacy", get(get_privacy))
        .route(
            "/experiments/{id}/rounds/{round}/attempts/{attempt}",
            get(get_round),
        )
        .route("/experiments/{id}/jobs", get(list_jobs))
        .route("/experiments/{id}/model", get(download_model))
        .route(
            "/experiments/{id}/model.safetensors",
            get(download_safetensors),
        )
        .route("/enrolment-tokens", post(create_token).get(list_tokens))
        .route("/enrolment-tokens/{id}/revoke", post(revoke_token))
        .route("/clients", get(list_clients))
        .route("/clients/{id}/revoke", post(revoke_client))
        .route(
            "/clients/{id}/identity",
            axum::routing::delete(reset_client_identity),
        )
}

/// The handlers above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(
    paths(
        create_experiment,
        list_experiments,
        get_experiment,
        start_experiment,
        pause_experiment,
        resume_experiment,
        stop_experiment,
        list_rounds,
        get_round,
        get_privacy,
        list_jobs,
        create_token,
        list_tokens,
        revoke_token,
        list_clients,
        revoke_client,
        reset_client_identity,
        download_model,
        download_safetensors
    ),
    components(schemas(
        ExperimentSpec,
        TrainSettings,
        NewEnrolmentToken,
        IssuedEnrolmentToken,
        cohort_core::SecureAggregationSpec,
        cohort_core::CompressionSpec,
        cohort_core::privacy::PrivacySpec,
        cohort_core::privacy::BudgetAgainst,
        PrivacyReport,
        PrivacyRound,
        RoundDetail,
        SecureRoundView,
        DroppedAt,
        crate::server::driver::secure_rounds::SecureProgress
    ))
)]
pub(crate) struct AdminDoc;

#[cfg(test)]
mod tests {
    use super::*;

    /// Connection failures become a 503 with a retry hint; a query the database refused
    /// stays a 500, since retrying it would not help.
    #[test]
    fn only_unreachable_databases_are_unavailable() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        for e in [
            sqlx::Error::Io(refused),
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
        ] {
            assert!(database_unreachable(&e), "{e}");
            let api: ApiError = StoreError::Database(e).into();
            assert_eq!(api.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE);
        }
        let api: ApiError = StoreError::Database(sqlx::Error::RowNotFound).into();
        assert_eq!(api.status(), axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    }
}
