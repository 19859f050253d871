//! Routes for edge clients: enrolment with a one-time token, and the client credential
//! (`Authorization: Bearer <client id>.<secret>`) every later request carries.

use axum::Router;
use axum::extract::{FromRequestParts, State};
use axum::http::StatusCode;
use axum::http::header;
use axum::http::request::Parts;
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::AppState;
use super::auth::{generate_secret, hash_secret, parse_bearer, verify_secret};
use super::error::{ApiError, ErrorBody, Json};
use crate::store::{Client, StoreError, now_millis};

/// Name of the client-credential security scheme in the OpenAPI document.
pub const CLIENT_SECURITY_SCHEME: &str = "client_credential";

/// An enrolment request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnrolRequest {
    /// The one-time token an admin issued.
    pub token: String,
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

/// Extractor: the client whose credential the request carries. Missing or wrong
/// credentials are 401; a revoked client is 403. Each success records when the client
/// was last seen.
#[derive(Debug, Clone)]
pub struct AuthenticatedClient(pub Client);

impl FromRequestParts<AppState> for AuthenticatedClient {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let wrong = || ApiError::Unauthorized("missing or invalid client credential".into());
        let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
        let first = values.next();
        if values.next().is_some() {
            return Err(wrong());
        }
        let token = parse_bearer(first.map(|v| v.as_bytes())).map_err(|_| wrong())?;
        let (id, secret) = token.split_once('.').ok_or_else(wrong)?;
        let id = Uuid::parse_str(id).map_err(|_| wrong())?;
        let (hash, client) = match state.store.client_credential(id).await {
            Ok(found) => found,
            Err(StoreError::NotFound(_)) => return Err(wrong()),
            Err(other) => return Err(other.into()),
        };
        let expected: [u8; 32] = hash.as_slice().try_into().map_err(|_| wrong())?;
        if !verify_secret(secret, &expected) {
            return Err(wrong());
        }
        if client.revoked_at.is_some() {
            return Err(ApiError::Forbidden("this client has been revoked".into()));
        }
        state.store.touch_client(client.id, now_millis()).await?;
        Ok(AuthenticatedClient(client))
    }
}

/// Enrols a client with a one-time enrolment token.
#[utoipa::path(post, path = "/api/v1/clients/enrol", tag = "client", request_body = EnrolRequest,
    responses((status = 201, description = "Enrolled", body = Enrolled),
              (status = 401, description = "Unknown, used, revoked or expired token", body = ErrorBody),
              (status = 422, body = ErrorBody)))]
async fn enrol(
    State(state): State<AppState>,
    Json(req): Json<EnrolRequest>,
) -> Result<(StatusCode, Json<Enrolled>), ApiError> {
    let secret = generate_secret().map_err(ApiError::internal)?;
    let client = state
        .store
        .enrol(
            &hash_secret(&req.token),
            &hash_secret(&secret),
            now_millis(),
        )
        .await?;
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
async fn me(AuthenticatedClient(client): AuthenticatedClient) -> Json<ClientIdentity> {
    Json(ClientIdentity {
        client_id: client.id,
        label: client.label,
    })
}

/// The client routes, with absolute paths.
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/v1/clients/enrol", post(enrol))
        .route("/api/v1/clients/me", get(me))
}

/// The handlers above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(
    paths(enrol, me),
    components(schemas(EnrolRequest, Enrolled, ClientIdentity)),
    tags((name = "client", description = "Edge clients (enrolment, then the client credential)"))
)]
pub(crate) struct ClientDoc;
