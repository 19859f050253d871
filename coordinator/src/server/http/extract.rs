//! What the handlers of several resources share: an id in a path, the authenticated
//! client (an extractor) and whether it takes part in an experiment, and a model's bytes
//! as a download. Kept apart from the resources so that they need not import each other.

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use uuid::Uuid;

use crate::server::AppState;
use crate::server::auth::{parse_bearer, verify_secret};
use crate::server::error::{ApiError, ErrorCode};
use crate::store::{Client, Experiment, StoreError, now_millis};

/// An id from a path. One that is not a UUID is a malformed request (400, as the
/// document's `format: uuid` says), not a missing resource; a UUID naming nothing is 404.
pub(crate) fn parse_id(text: &str, what: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(text).map_err(|_| ApiError::BadRequest {
        code: ErrorCode::InvalidId,
        message: format!("the {what} id is not a UUID"),
    })
}

/// The body length the request declares (`Content-Length`), if it declares one that
/// parses: a body declared past a limit is refused before a byte of it is read.
pub(crate) fn declared_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Extractor: the client whose credential the request carries. Missing or wrong
/// credentials are 401; a revoked client is 403; an address past its share of failed
/// authentications is 429 before its credential is looked at. It writes nothing: a
/// handler records the client as seen only once the request has succeeded, so that a
/// refused request leaves the database exactly as it was.
#[derive(Debug, Clone)]
pub struct AuthenticatedClient(pub Client);

impl FromRequestParts<AppState> for AuthenticatedClient {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        // A layer in front (the message limit) may have authenticated the request already.
        if let Some(client) = parts.extensions.get::<AuthenticatedClient>() {
            return Ok(client.clone());
        }
        let Ok(crate::server::rate_limit::PeerAddr(peer)) =
            crate::server::rate_limit::PeerAddr::from_request_parts(parts, state).await;
        state.limits.authentication_allowed(peer)?;
        let wrong = || ApiError::Unauthorized("missing or invalid client credential".into());
        let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
        let Some(first) = values.next() else {
            // No credential at all is no guess: not counted.
            return Err(wrong());
        };
        let refused = || {
            state.limits.authentication_failed(peer);
            wrong()
        };
        if values.next().is_some() {
            return Err(refused());
        }
        let token = parse_bearer(Some(first.as_bytes())).map_err(|_| refused())?;
        let (id, secret) = token.split_once('.').ok_or_else(refused)?;
        let id = Uuid::parse_str(id).map_err(|_| refused())?;
        let (hash, client) = match state.store.client_credential(id).await {
            Ok(found) => found,
            Err(StoreError::NotFound(_)) => return Err(refused()),
            Err(other) => return Err(other.into()),
        };
        let expected: [u8; 32] = hash.as_slice().try_into().map_err(|_| refused())?;
        if !verify_secret(secret, &expected) {
            return Err(refused());
        }
        if client.revoked_at.is_some() {
            return Err(ApiError::Forbidden("this client has been revoked".into()));
        }
        Ok(AuthenticatedClient(client))
    }
}

impl AuthenticatedClient {
    /// Records that the client was seen now (it counts as available for selection).
    pub(crate) async fn seen(&self, state: &AppState) -> Result<(), ApiError> {
        Ok(state.store.touch_client(self.0.id, now_millis()).await?)
    }
}

/// Refuses a client that takes no part in `experiment` (see
/// [`Store::takes_part`](crate::store::Store::takes_part)).
///
/// The answer is a 404 worded exactly as for an experiment that does not exist, not a
/// 403: a client must not learn from it which other experiments there are.
pub(crate) async fn require_participant(
    state: &AppState,
    experiment: Uuid,
    client: Uuid,
) -> Result<(), ApiError> {
    if state.store.takes_part(experiment, client).await? {
        Ok(())
    } else {
        Err(ApiError::NotFound(format!("experiment {experiment}")))
    }
}

/// The experiment, the round of its current model and the model's bytes; shared by the
/// admin and client downloads.
pub(crate) async fn current_model(
    state: &AppState,
    id: &str,
) -> Result<(Experiment, i64, Vec<u8>), ApiError> {
    let id = parse_id(id, "experiment")?;
    let exp = state.store.experiment(id).await?;
    let (round, bytes) = latest_model_bytes(state, id).await?;
    Ok((exp, round, bytes))
}

/// The round and bytes of experiment `id`'s latest model (404 before it has one).
pub(crate) async fn latest_model_bytes(
    state: &AppState,
    id: Uuid,
) -> Result<(i64, Vec<u8>), ApiError> {
    let model = state
        .store
        .latest_model(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("experiment {id} has no model yet")))?;
    let blobs = state.blobs.clone();
    let bytes = tokio::task::spawn_blocking(move || blobs.get(&model.blob_path))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)?;
    Ok((model.round, bytes))
}

/// An `application/octet-stream` answer carrying a model of `round`.
pub(crate) fn octets(
    bytes: Vec<u8>,
    round: i64,
    filename: Option<String>,
) -> Result<axum::response::Response, ApiError> {
    let mut builder = axum::response::Response::builder()
        .header(axum::http::header::CONTENT_TYPE, "application/octet-stream")
        .header("x-cohort-round", round.to_string());
    if let Some(name) = filename {
        builder = builder.header(
            axum::http::header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{name}\""),
        );
    }
    builder
        .body(axum::body::Body::from(bytes))
        .map_err(ApiError::internal)
}
