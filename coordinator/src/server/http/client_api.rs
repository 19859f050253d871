//! Routes for edge clients: enrolment with a one-time token, and the client credential
//! (`Authorization: Bearer <client id>.<secret>`) every later request carries.

use axum::Router;
use axum::extract::{FromRequestParts, State};
use axum::http::StatusCode;
use axum::http::header;
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use cohort_edge::protocol::messages::{
    CheckIn, EnrolRequest, IdentityRegistered, IdentityRequest, UploadReceipt,
};
use cohort_edge::protocol::routes;
use cohort_edge::protocol::{CheckInReply, SecureTask, Task, TaskKind, UploadForm};

use super::extract::{AuthenticatedClient, require_participant};
use crate::server::AppState;
use crate::server::auth::{generate_secret, hash_secret};
use crate::server::error::{ApiError, ErrorBody, ErrorCode, Json};
use crate::store::{StoreError, now_millis};

/// Name of the client-credential security scheme in the OpenAPI document.
pub const CLIENT_SECURITY_SCHEME: &str = "client_credential";

/// Parses an identity as clients send it.
fn parse_identity(text: &str) -> Result<[u8; crate::store::IDENTITY_BYTES], ApiError> {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(text.trim().as_bytes())
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            ApiError::unprocessable(
                ErrorCode::InvalidIdentity,
                "identity must be a 32-byte Ed25519 public key in unpadded base64url",
            )
        })
}

/// A new client's credential. The secret is shown only here; the server keeps its hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Enrolled {
    /// The client's id.
    pub client_id: Uuid,
    /// The client's secret.
    pub secret: String,
}

impl Enrolled {
    /// The bearer value for later requests: `<client id>.<secret>`.
    pub fn credential(&self) -> String {
        format!("{}.{}", self.client_id, self.secret)
    }
}

/// Who an authenticated client is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ClientIdentity {
    /// The client's id.
    pub client_id: Uuid,
    /// The label of the token it enrolled with.
    pub label: String,
}

/// Middleware for the routes of a client's messages other than updates (secure
/// aggregation, evaluation and failure reports): a `POST` is authenticated here and
/// counted against the client's message limit before its handler runs, which then finds
/// the client already authenticated. Other methods (the long polls) pass untouched.
pub(crate) async fn limit_messages(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Result<axum::response::Response, ApiError> {
    if request.method() != axum::http::Method::POST {
        return Ok(next.run(request).await);
    }
    let (mut parts, body) = request.into_parts();
    let client = AuthenticatedClient::from_request_parts(&mut parts, &state).await?;
    state.limits.message(client.0.id)?;
    parts.extensions.insert(client);
    Ok(next
        .run(axum::extract::Request::from_parts(parts, body))
        .await)
}

/// Enrols a client with a one-time enrolment token.
#[utoipa::path(post, path = "/api/v1/clients/enrol", tag = "client", request_body = EnrolRequest,
    responses((status = 201, description = "Enrolled", body = Enrolled),
              (status = 401, description = "Unknown, used, revoked or expired token", body = ErrorBody),
              (status = 422, body = ErrorBody),
              (status = 429, description = "Too many enrolments from this address", body = ErrorBody)))]
async fn enrol(
    State(state): State<AppState>,
    crate::server::rate_limit::PeerAddr(peer): crate::server::rate_limit::PeerAddr,
    Json(req): Json<EnrolRequest>,
) -> Result<(StatusCode, Json<Enrolled>), ApiError> {
    state.limits.enrolment(peer)?;
    // Checked before the token is spent: a malformed identity enrols nobody.
    let identity = req.identity.as_deref().map(parse_identity).transpose()?;
    let secret = generate_secret().map_err(ApiError::internal)?;
    let client = state
        .store
        .enrol(
            &hash_secret(&req.token),
            &hash_secret(&secret),
            now_millis(),
        )
        .await?;
    if let Some(key) = identity {
        state
            .store
            .register_identity(client.id, &key, now_millis())
            .await?;
    }
    Ok((
        StatusCode::CREATED,
        Json(Enrolled {
            client_id: client.id,
            secret,
        }),
    ))
}

/// Who the caller is: a cheap way for a client to check its credential.
#[utoipa::path(get, path = "/api/v1/clients/me", tag = "client",
    security(("client_credential" = [])),
    responses((status = 200, description = "The caller", body = ClientIdentity),
              (status = 401, body = ErrorBody), (status = 403, description = "Revoked", body = ErrorBody)))]
async fn me(
    State(state): State<AppState>,
    client: AuthenticatedClient,
) -> Result<Json<ClientIdentity>, ApiError> {
    client.seen(&state).await?;
    let AuthenticatedClient(client) = client;
    Ok(Json(ClientIdentity {
        client_id: client.id,
        label: client.label,
    }))
}

/// Registers the caller's identity (its long-term Ed25519 public key): once, for a
/// client enrolled without one. The same key again is a no-op; another key is refused
/// until an admin resets the identity, so that no one (a coordinator that cheats
/// included) swaps a site's identity without a trace.
#[utoipa::path(put, path = "/api/v1/clients/me/identity", tag = "client", request_body = IdentityRequest,
    security(("client_credential" = [])),
    responses((status = 201, description = "Registered", body = IdentityRegistered),
              (status = 200, description = "This key was already registered", body = IdentityRegistered),
              (status = 401, body = ErrorBody),
              (status = 409, description = "Another identity is registered", body = ErrorBody),
              (status = 422, body = ErrorBody)))]
async fn register_identity(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Json(req): Json<IdentityRequest>,
) -> Result<(StatusCode, Json<IdentityRegistered>), ApiError> {
    let key = parse_identity(&req.identity)?;
    let registered = match state
        .store
        .register_identity(client.0.id, &key, now_millis())
        .await
    {
        Ok(r) => r,
        Err(StoreError::Conflict(m)) => {
            return Err(ApiError::conflict(ErrorCode::IdentityConflict, m.message));
        }
        Err(e) => return Err(e.into()),
    };
    client.seen(&state).await?;
    let status = match registered {
        crate::store::Registered::New => StatusCode::CREATED,
        crate::store::Registered::Unchanged => StatusCode::OK,
    };
    Ok((
        status,
        Json(IdentityRegistered {
            fingerprint: cohort_aggregation::secagg::identity::fingerprint(&key),
        }),
    ))
}

/// The client routes, with absolute paths.
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(routes::ENROL, post(enrol))
        .route(routes::ME, get(me))
        .route(routes::IDENTITY, axum::routing::put(register_identity))
        .route(routes::CHECKIN, post(checkin))
        .route(routes::MODEL, get(model))
        .route(routes::UPDATE, post(upload))
}

/// The handlers above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(
    paths(enrol, me, register_identity, checkin, model, upload),
    components(schemas(EnrolRequest, IdentityRequest, IdentityRegistered, Enrolled, ClientIdentity, CheckIn, Task, TaskKind, UploadForm, SecureTask, cohort_edge::protocol::TaskCompression, CheckInReply)),
    tags((name = "client", description = "Edge clients (enrolment, then the client credential)"))
)]
pub(crate) struct ClientDoc;

/// How long a check-in may wait for a task at most.
pub const MAX_CHECKIN_WAIT_SECONDS: u64 = 30;

async fn task_for(state: &AppState, client: Uuid) -> Result<Option<Task>, ApiError> {
    if let Some(task) = crate::server::http::fedbuff::task_for(state, client).await? {
        return Ok(Some(task));
    }
    let Some(pending) = state.store.pending_task(client).await? else {
        return evaluation_task(state, client).await;
    };
    let exp = state.store.experiment(pending.experiment_id).await?;
    let (spec, _) = crate::server::driver::experiment_model(&exp).map_err(ApiError::internal)?;
    let secure_aggregation = match (&pending.secagg, pending.secagg_index) {
        (Some(text), Some(index)) => Some(SecureTask {
            index: u32::try_from(index).map_err(ApiError::internal)?,
            config: serde_json::from_str(text).map_err(ApiError::internal)?,
        }),
        _ => None,
    };
    let compression = spec
        .compression
        .and_then(|c| c.task(exp.id, pending.round, pending.attempt, client));
    let upload = if secure_aggregation.is_some() {
        UploadForm::MaskedDifference
    } else if compression.is_some() {
        // Even with only the download compressed: the client trained from its decoded
        // copy, and its difference from that copy is what the exact model must move by.
        UploadForm::CompressedDifference
    } else {
        UploadForm::Weights
    };
    Ok(Some(Task {
        secure_aggregation,
        upload,
        compression,
        ..spec.plain_task(exp.id, pending.round, pending.attempt, pending.deadline)
    }))
}

/// How long after an experiment finishes its clients are asked to evaluate its final
/// model.
pub const FINAL_EVALUATION_WINDOW_MS: i64 = 24 * 3600 * 1000;

/// A task to evaluate the final model of a recently finished experiment with a file
/// model that this client took part in and has not evaluated yet: the rounds' own reports cover every
/// model version but the last, since each client evaluates the model it receives.
async fn evaluation_task(state: &AppState, client: Uuid) -> Result<Option<Task>, ApiError> {
    let since = now_millis() - FINAL_EVALUATION_WINDOW_MS;
    for (experiment, version, spec) in state.store.final_models_to_evaluate(client, since).await? {
        let Ok(spec) = serde_json::from_value::<cohort_core::ExperimentSpec>(spec) else {
            continue;
        };
        if spec.evaluation_refusal().is_some() || spec.fedbuff().is_some() {
            continue;
        }
        return Ok(Some(Task {
            kind: TaskKind::Evaluate,
            ..spec.plain_task(experiment, version, 0, None)
        }));
    }
    Ok(None)
}

/// Checks in and waits (long poll) for a task.
#[utoipa::path(post, path = "/api/v1/clients/checkin", tag = "client",
    security(("client_credential" = [])), request_body = CheckIn,
    responses((status = 200, description = "A task, or none", body = CheckInReply),
              (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 422, body = ErrorBody)))]
async fn checkin(
    State(state): State<AppState>,
    authenticated: AuthenticatedClient,
    Json(req): Json<CheckIn>,
) -> Result<Json<CheckInReply>, ApiError> {
    if req.wait_seconds > MAX_CHECKIN_WAIT_SECONDS {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidCheckin,
            format!("wait_seconds must be at most {MAX_CHECKIN_WAIT_SECONDS}"),
        ));
    }
    authenticated.seen(&state).await?;
    let AuthenticatedClient(client) = authenticated;
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(req.wait_seconds);
    loop {
        if let Some(task) = task_for(&state, client.id).await? {
            return Ok(Json(CheckInReply { task: Some(task) }));
        }
        if tokio::time::Instant::now() >= until {
            return Ok(Json(CheckInReply { task: None }));
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        // Staying in the long poll counts as being available.
        state.store.touch_client(client.id, now_millis()).await?;
    }
}

/// The experiment's current global model.
///
/// The body is the model's `d` parameters as little-endian IEEE-754 `f32` (`4 d`
/// bytes), in the order of the task's `tensors`, each tensor row-major; the round that
/// published it is in the `x-cohort-round` header (0: the initial model). While an
/// experiment with a `compression.download` scheme runs, the body is the model in that
/// scheme instead (a `CZ` header then the scheme's body, rotated with a seed of this
/// client's own, which the header carries), and the `x-cohort-compression` header names
/// the scheme. Only for a client that takes part in the experiment; to any other, the
/// experiment does not exist.
#[utoipa::path(get, path = "/api/v1/clients/experiments/{id}/model", tag = "client",
    security(("client_credential" = [])), params(("id" = uuid::Uuid, Path, description = "Experiment id")),
    responses((status = 200, description = "The model", content_type = "application/octet-stream",
               headers(("x-cohort-round" = i64, description = "The round that published this model (0: the initial model)"),
                       ("x-cohort-compression" = String, description = "The scheme the body is compressed with (`quantize:4`, `quantize:8`); absent: plain `f32`"))),
              (status = 401, body = ErrorBody),
              (status = 404, description = "No such experiment, or the client takes no part in it", body = ErrorBody)))]
async fn model(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<axum::response::Response, ApiError> {
    let experiment = crate::server::http::extract::parse_id(&id, "experiment")?;
    require_participant(&state, experiment, client.0.id).await?;
    let (exp, round, bytes) = crate::server::http::extract::current_model(&state, &id).await?;
    client.seen(&state).await?;
    crate::server::http::fedbuff::note_download(&state, &exp, client.0.id, round).await;
    let (bytes, scheme) = compressed_model(&exp, round, client.0.id, bytes).await?;
    if let Err(e) = state
        .store
        .note_download(exp.id, client.0.id, bytes.len() as i64)
        .await
    {
        // The count is for the record; the model is what the client needs.
        tracing::warn!(error = %e, "could not count a model download");
    }
    let mut response = crate::server::http::extract::octets(bytes, round, None)?;
    if let Some(scheme) = scheme {
        response.headers_mut().insert(
            "x-cohort-compression",
            axum::http::HeaderValue::from_str(&scheme.to_string()).map_err(ApiError::internal)?,
        );
    }
    Ok(response)
}

/// The model `bytes` (model version `version`) as `client` downloads it: compressed with
/// the experiment's download scheme, rotated with the client's own seed for the version,
/// while the experiment runs (a finished experiment's final model goes whole to the
/// clients evaluating it); the scheme, when compressed.
async fn compressed_model(
    exp: &crate::store::Experiment,
    version: i64,
    client: Uuid,
    bytes: Vec<u8>,
) -> Result<(Vec<u8>, Option<cohort_aggregation::compress::Compression>), ApiError> {
    use cohort_aggregation::compress::{Compression, Expected};
    let spec = crate::server::driver::experiment_spec(exp).map_err(ApiError::internal)?;
    let scheme = spec.compression.map_or(Compression::None, |c| c.download);
    if scheme == Compression::None || exp.state != crate::store::ExperimentState::Running {
        return Ok((bytes, None));
    }
    let seed = cohort_core::compression::rotation_seed(
        exp.id,
        version,
        0,
        Some(client),
        cohort_core::compression::SeedUse::Download,
    );
    let compressed = tokio::task::spawn_blocking(move || {
        let plain = Expected {
            dimension: bytes.len() / 4,
            rotation_seed: None,
        };
        let values = Compression::None.decode(&bytes, &plain)?;
        // The rounding needs no secret: the client decodes the same either way.
        scheme.encode(&values, seed, seed ^ 0x5eed)
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(ApiError::internal)?;
    Ok((compressed, Some(scheme)))
}

/// The most samples an upload may claim. The weight counted is capped lower still (the
/// experiment's `max_weight`); this bound keeps a claim a number that every client
/// language and the database hold exactly, and refuses the absurd outright.
pub const MAX_NUM_SAMPLES: i64 = 1_000_000_000_000;

/// Metadata of an upload, in the query string.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UploadQuery {
    /// Samples behind the update (the FedAvg weight), 1 to 10^12; counted as at most the
    /// experiment's `max_weight`. Required for a plain round; refused for a secure one,
    /// whose weight travels inside the masked vector.
    #[param(minimum = 1, maximum = 1_000_000_000_000_i64)]
    #[serde(default)]
    pub num_samples: Option<i64>,
    /// The client's mean training loss.
    #[serde(default)]
    pub train_loss: Option<f64>,
    /// An id the client chooses for this upload (a UUID) and sends again with every
    /// retry of it: a retry whose first try was stored is answered 200 with the stored
    /// upload instead of being counted twice or refused.
    #[serde(default)]
    pub upload_id: Option<Uuid>,
}

/// Uploads the client's update for its task.
///
/// The body (`application/octet-stream`) is what the task's `upload` says. `weights`: the
/// locally trained model's `d` parameters as little-endian IEEE-754 `f32` (`4 d` bytes),
/// in the order of the task's `tensors`, each tensor row-major, every value finite, with
/// `num_samples` (and optionally `train_loss`) in the query. `compressed_difference`
/// (plain rounds of an experiment with `compression`): the difference from the model the
/// client received, in the task's `compression.upload` scheme (a `CZ` header then the
/// scheme's body; plain little-endian `f32`s for `none`), rotated with the task's
/// `upload_rotation_seed`, with `num_samples` in the query; the coordinator adds what it
/// decodes to the model. `masked_difference` (secure rounds): the masked quantized
/// difference from the received model, `d` little-endian words in the round's width
/// (32 bits, or 8 or 16 under compression) followed by the masked weight and weighted
/// loss in 32-bit words, and no `num_samples` or `train_loss`. The upload is on disk and
/// recorded before the answer is sent; the participation records its bytes as sent.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/update",
    tag = "client", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path, description = "Experiment id"), ("round" = i64, Path, description = "Round"),
           ("attempt" = i64, Path, description = "Attempt"), UploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, description = "Stored", body = UploadReceipt),
              (status = 200, description = "A retry (same upload_id) of an upload already stored: nothing counted again", body = UploadReceipt),
              (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, description = "Refused by the round's rules, with nothing changed; the code says which: `round_not_collecting` (the attempt is in another stage), `deadline_passed`, `not_selected`, `already_uploaded` (a second upload, or a replay without its upload_id), `dropped_from_round` (also a secure round's client whose key shares did not go out), `task_expired` (FedBuff: the task outlived its deadline), `too_stale` (FedBuff: the update is staler than max_staleness)", body = ErrorBody),
              (status = 413, body = ErrorBody), (status = 415, body = ErrorBody),
              (status = 422, description = "Wrong dimension or non-finite value", body = ErrorBody),
              (status = 429, description = "Too many uploads from this client or address", body = ErrorBody)))]
async fn upload(
    State(state): State<AppState>,
    AuthenticatedClient(client): AuthenticatedClient,
    crate::server::rate_limit::PeerAddr(peer): crate::server::rate_limit::PeerAddr,
    axum::extract::Path((id, round, attempt)): axum::extract::Path<(String, i64, i64)>,
    query: Result<axum::extract::Query<UploadQuery>, axum::extract::rejection::QueryRejection>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<UploadReceipt>), ApiError> {
    state.limits.upload(client.id, peer)?;
    let axum::extract::Query(query) =
        query.map_err(|e| ApiError::unprocessable(ErrorCode::InvalidQuery, e.body_text()))?;
    check_upload_request(&headers, &query)?;
    let id = crate::server::http::extract::parse_id(&id, "experiment")?;
    // A retry of an upload that was stored: the same answer, nothing counted again,
    // whatever stage the round has reached since.
    if let Some(replayed) = stored_upload(&state, id, client.id, query.upload_id).await? {
        return Ok(replayed);
    }
    let exp = state.store.experiment(id).await?;
    let (spec, model) =
        crate::server::driver::experiment_model(&exp).map_err(ApiError::internal)?;
    let word_bits = masked_word_bits(&state, id, round, attempt).await?;
    let secure = word_bits.is_some();
    let expected = expected_body(word_bits, &query, model.layout().len())?;
    // Each upload gets a blob of its own name, so a refused replay can never overwrite
    // the bytes of an acknowledged upload.
    let path = format!(
        "uploads/{id}/{round}-{attempt}/{}-{}.bin",
        client.id,
        Uuid::new_v4().simple()
    );
    let (info, wire_bytes) = match spec.compression.filter(|c| !secure && c.is_on()) {
        Some(c) => {
            let received = ReceivedDifference::new(
                c.upload,
                (id, round, attempt),
                client.id,
                model.layout().clone(),
            );
            let (info, wire) = received.store(&state, &headers, body, &path).await?;
            (info, Some(wire as i64))
        }
        None => (
            receive_update(&state, &headers, body, expected, &path).await?,
            None,
        ),
    };
    let path = info.path.clone();
    // A secure upload's weight is masked; the row records none. A plain one's is the
    // client's own claim, counted up to the experiment's cap.
    let claimed = query.num_samples.unwrap_or(0);
    let num_samples = if secure {
        claimed
    } else {
        spec.sample_weight(claimed)
    };
    let new_upload = crate::store::NewUpload {
        client_id: client.id,
        blob_path: &info.path,
        bytes: info.bytes as i64,
        sha256: &info.sha256,
        num_samples,
        claimed_samples: (num_samples != claimed).then_some(claimed),
        train_loss: query.train_loss,
        client_upload_id: query.upload_id,
        wire_bytes,
    };
    let recorded = match spec.fedbuff() {
        // FedBuff takes the upload into the buffer open now, whichever round its task
        // was handed out in.
        Some(settings) => {
            crate::server::http::fedbuff::record_upload(
                &state,
                &spec,
                &settings,
                id,
                (round, attempt),
                &new_upload,
            )
            .await
        }
        None => state
            .store
            .record_upload(id, round, attempt, &new_upload, now_millis())
            .await
            .map_err(ApiError::from),
    };
    match recorded {
        Ok(upload) => {
            crate::fault::reached(crate::fault::FaultPoint::UploadStored).await;
            // Best effort: the upload is committed, and a failed touch must not turn
            // its acknowledgement into an error the client would retry.
            if let Err(e) = state.store.touch_client(client.id, now_millis()).await {
                tracing::warn!(error = %e, "could not record the client as seen");
            }
            Ok((
                StatusCode::CREATED,
                Json(UploadReceipt {
                    upload_id: upload.id,
                    replayed: false,
                }),
            ))
        }
        Err(e) => {
            let blobs = state.blobs.clone();
            let _ = tokio::task::spawn_blocking(move || blobs.remove(&path)).await;
            // Two tries of one upload raced, and the other one was stored.
            if let Some(replayed) = stored_upload(&state, id, client.id, query.upload_id).await? {
                return Ok(replayed);
            }
            Err(e)
        }
    }
}

/// The width of a secure round attempt's masked model words; `None` for a plain round.
async fn masked_word_bits(
    state: &AppState,
    id: Uuid,
    round: i64,
    attempt: i64,
) -> Result<Option<u32>, ApiError> {
    match state.store.round(id, round, attempt).await {
        Ok(r) => crate::server::driver::secure_rounds::round_config(&r)
            .map_err(ApiError::internal)?
            .map(|c| c.validate().map(|q| q.word_bits()))
            .transpose()
            .map_err(ApiError::internal),
        Err(crate::store::StoreError::NotFound(what)) => Err(ApiError::NotFound(what)),
        Err(e) => Err(e.into()),
    }
}

/// What an upload request must be before its body is read: octets, and a sample count
/// and loss that make sense when given.
fn check_upload_request(
    headers: &axum::http::HeaderMap,
    query: &UploadQuery,
) -> Result<(), ApiError> {
    let is_octets = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/octet-stream"));
    if !is_octets {
        return Err(ApiError::UnsupportedMediaType(
            "an update must be sent as application/octet-stream".into(),
        ));
    }
    if query
        .num_samples
        .is_some_and(|n| !(1..=MAX_NUM_SAMPLES).contains(&n))
    {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidQuery,
            format!("num_samples must be between 1 and {MAX_NUM_SAMPLES}"),
        ));
    }
    if query.train_loss.is_some_and(|l| !l.is_finite()) {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidQuery,
            "train_loss must be finite",
        ));
    }
    Ok(())
}

/// The body a round takes from this request: masked words under secure aggregation, of
/// `word_bits` each (with no weight or loss beside them, they travel masked), else floats
/// with a sample count.
fn expected_body(
    word_bits: Option<u32>,
    query: &UploadQuery,
    params: usize,
) -> Result<Body, ApiError> {
    Ok(if let Some(word_bits) = word_bits {
        if query.num_samples.is_some() || query.train_loss.is_some() {
            return Err(ApiError::unprocessable(
                ErrorCode::InvalidQuery,
                "a secure round's upload is the masked vector alone: its weight and loss \
                 travel masked inside it, so num_samples and train_loss must not be sent",
            ));
        }
        Body::MaskedWords {
            bytes: params * (word_bits / 8) as usize + cohort_aggregation::secagg::EXTRA_WORDS * 4,
            word_bits,
        }
    } else {
        if query.num_samples.is_none() {
            return Err(ApiError::unprocessable(
                ErrorCode::InvalidQuery,
                "num_samples is required: the number of samples behind the update",
            ));
        }
        Body::Floats(params)
    })
}

/// The answer to a retry of an upload already stored under the client's `upload_id`
/// (200, the stored upload's id), or `None` when there is no such upload.
async fn stored_upload(
    state: &AppState,
    experiment: Uuid,
    client: Uuid,
    upload_id: Option<Uuid>,
) -> Result<Option<(StatusCode, Json<UploadReceipt>)>, ApiError> {
    let Some(upload_id) = upload_id else {
        return Ok(None);
    };
    let stored = state
        .store
        .upload_by_client_id(experiment, client, upload_id)
        .await?;
    Ok(stored.map(|u| {
        (
            StatusCode::OK,
            Json(UploadReceipt {
                upload_id: u.id,
                replayed: true,
            }),
        )
    }))
}

/// How far past the body limit an oversized upload is read (and dropped) before the 413
/// is sent.
const OVERSIZE_DRAIN_BYTES: usize = 1024 * 1024;

/// Bytes of an upload gathered before each write to disk: what one upload in flight holds
/// in memory, whatever the model's size.
const UPLOAD_WRITE_CHUNK: usize = 64 * 1024;

/// What an upload's body must be.
#[derive(Debug, Clone, Copy)]
enum Body {
    /// A plain update: this many finite little-endian `f32`s.
    Floats(usize),
    /// A secure round's masked input: this many bytes of little-endian words, the
    /// model's in `word_bits` and the weight and loss in 32 (any value: masked words are
    /// uniform, and many look like NaN as floats).
    MaskedWords {
        /// The input's length.
        bytes: usize,
        /// Width of the model words.
        word_bits: u32,
    },
}

/// Checks a body as it streams in.
enum BodyCheck {
    Floats(cohort_aggregation::wire::StreamCheck),
    Words {
        expected: usize,
        seen: usize,
        word_bits: u32,
    },
}

impl BodyCheck {
    fn new(body: Body) -> Self {
        match body {
            Body::Floats(n) => BodyCheck::Floats(cohort_aggregation::wire::StreamCheck::new(n)),
            Body::MaskedWords { bytes, word_bits } => BodyCheck::Words {
                expected: bytes,
                seen: 0,
                word_bits,
            },
        }
    }

    fn feed(&mut self, chunk: &[u8]) -> Result<(), ()> {
        match self {
            BodyCheck::Floats(c) => c.feed(chunk).map_err(|_| ()),
            BodyCheck::Words { expected, seen, .. } => {
                *seen += chunk.len();
                if *seen > *expected { Err(()) } else { Ok(()) }
            }
        }
    }

    fn finish(self) -> Result<(), String> {
        match self {
            BodyCheck::Floats(c) => c.finish().map_err(|e| e.to_string()),
            BodyCheck::Words {
                expected,
                seen,
                word_bits,
            } if seen != expected => Err(format!(
                "a masked input of this round is {expected} bytes (the model's parameters in \
                 {word_bits}-bit words, then its weight and its loss in 32-bit words), got \
                 {seen} bytes or more"
            )),
            BodyCheck::Words { .. } => Ok(()),
        }
    }
}

/// A plain round's compressed upload: the difference from the model the client
/// received, in `scheme`, rotated with `rotation_seed`.
struct ReceivedDifference {
    scheme: cohort_aggregation::compress::Compression,
    rotation_seed: u64,
    experiment: Uuid,
    layout: std::sync::Arc<cohort_aggregation::Layout>,
}

impl ReceivedDifference {
    /// The upload of `client` in `experiment`'s round attempt `(round, attempt)`: its
    /// rotation seed is the one the task gave it.
    fn new(
        scheme: cohort_aggregation::compress::Compression,
        (experiment, round, attempt): (Uuid, i64, i64),
        client: Uuid,
        layout: std::sync::Arc<cohort_aggregation::Layout>,
    ) -> Self {
        let rotation_seed = cohort_core::compression::rotation_seed(
            experiment,
            round,
            attempt,
            Some(client),
            cohort_core::compression::SeedUse::Upload,
        );
        Self {
            scheme,
            rotation_seed,
            experiment,
            layout,
        }
    }

    /// Reads the body (it is small: that is the point), checks and decodes it, adds it to
    /// the experiment's current model and stores the result as a plain update's blob
    /// (little-endian `f32`), so that aggregation takes it as any other. Returns the
    /// blob and the bytes the client sent. A body that is not what the experiment asked
    /// for is refused (422 `invalid_update`) with the decoder's reason.
    async fn store(
        self,
        state: &AppState,
        headers: &axum::http::HeaderMap,
        body: axum::body::Body,
        path: &str,
    ) -> Result<(crate::blobs::BlobInfo, usize), ApiError> {
        let limit = state.settings.max_body_bytes;
        let too_large = || {
            ApiError::PayloadTooLarge(format!(
                "the body is larger than the limit of {limit} bytes"
            ))
        };
        if crate::server::http::extract::declared_length(headers).is_some_and(|n| n > limit as u64)
        {
            return Err(too_large());
        }
        let bytes = axum::body::to_bytes(body, limit)
            .await
            .map_err(|_| too_large())?;
        let (_, model) =
            crate::server::http::extract::latest_model_bytes(state, self.experiment).await?;
        let blobs = state.blobs.clone();
        let path = path.to_string();
        let wire = bytes.len();
        let info = tokio::task::spawn_blocking(move || {
            let global = cohort_aggregation::wire::decode(&self.layout, &model)
                .map_err(ApiError::internal)?;
            let global = global.values();
            let expected = cohort_aggregation::compress::Expected {
                dimension: global.len(),
                rotation_seed: Some(self.rotation_seed),
            };
            let difference = self
                .scheme
                .decode(&bytes, &expected)
                .map_err(|e| ApiError::unprocessable(ErrorCode::InvalidUpdate, e.to_string()))?;
            let mut weights = Vec::with_capacity(global.len() * 4);
            for (g, d) in global.iter().zip(&difference) {
                let w = g + d;
                if !w.is_finite() {
                    return Err(ApiError::unprocessable(
                        ErrorCode::InvalidUpdate,
                        "the difference takes a parameter past the range of f32",
                    ));
                }
                weights.extend_from_slice(&w.to_le_bytes());
            }
            let mut writer = blobs.writer(&path).map_err(ApiError::internal)?;
            writer.write(&weights).map_err(ApiError::internal)?;
            writer.commit().map_err(ApiError::internal)
        })
        .await
        .map_err(ApiError::internal)??;
        Ok((info, wire))
    }
}

/// Streams an upload's body to a blob while checking it (whole `f32`s, the right count,
/// all finite for a plain update; the right number of words for a masked input) and the
/// body limit, so that memory per upload stays at one chunk however large the model is.
/// The blob is durable when this returns; on any error nothing is left on disk.
async fn receive_update(
    state: &AppState,
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
    expected: Body,
    path: &str,
) -> Result<crate::blobs::BlobInfo, ApiError> {
    use http_body_util::BodyExt;

    let limit = state.settings.max_body_bytes;
    let too_large = || {
        ApiError::PayloadTooLarge(format!(
            "the body is larger than the limit of {limit} bytes"
        ))
    };
    if crate::server::http::extract::declared_length(headers).is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let blobs = state.blobs.clone();
    let p = path.to_string();
    let mut writer = tokio::task::spawn_blocking(move || blobs.writer(&p))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)?;
    let mut check = BodyCheck::new(expected);
    let mut received = 0usize;
    let mut pending: Vec<u8> = Vec::with_capacity(UPLOAD_WRITE_CHUNK);
    let mut body = body;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::bad_request(
                ErrorCode::UnreadableBody,
                format!("reading the body failed: {e}"),
            )
        })?;
        let Ok(chunk) = frame.into_data() else {
            continue; // trailers carry nothing we use
        };
        received += chunk.len();
        if received > limit {
            // Answering while the client is still sending makes many clients see a
            // broken pipe instead of the 413; read (and drop) a little more first, so
            // that a body somewhat over the limit gets its answer.
            if received > limit.saturating_add(OVERSIZE_DRAIN_BYTES) {
                return Err(too_large());
            }
            continue;
        }
        // A wrong body is read to its end (up to the limit) before it is refused, so
        // the answer is the same however the client's bytes were split; the checker
        // keeps its first error for `finish`.
        if check.feed(&chunk).is_err() {
            continue;
        }
        pending.extend_from_slice(&chunk);
        if pending.len() >= UPLOAD_WRITE_CHUNK {
            // The buffer travels to the blocking pool and back, so it is reused.
            let buf = std::mem::take(&mut pending);
            let (w, buf) =
                tokio::task::spawn_blocking(move || writer.write(&buf).map(|()| (writer, buf)))
                    .await
                    .map_err(ApiError::internal)?
                    .map_err(ApiError::internal)?;
            writer = w;
            pending = buf;
            pending.clear();
        }
    }
    if received > limit {
        return Err(too_large());
    }
    check
        .finish()
        .map_err(|e| ApiError::unprocessable(ErrorCode::InvalidUpdate, e))?;
    tokio::task::spawn_blocking(move || {
        writer.write(&pending)?;
        writer.commit()
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(ApiError::internal)
}
