//! People and their roles over the API: an admin creates a person with a role and hands
//! them the token shown once in the answer (`<id>.<secret>`, used as a bearer token like
//! the admin token), lists them, and revokes them.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::extract::parse_id;
use crate::server::AppState;
use crate::server::auth::{generate_secret, hash_secret};
use crate::server::error::{ApiError, ErrorBody, ErrorCode};
use crate::store::{Role, User};

/// A person to create.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewUser {
    /// 1 to 64 letters, digits, `.`, `_`, `-` or `@` (`alice`, `a.smith@clinic`); unique;
    /// `admin` and `coordinator` are reserved.
    #[schema(example = "alice")]
    pub name: String,
    /// `viewer` (reads everything), `operator` (runs experiments) or `admin` (clients,
    /// tokens, users, models).
    pub role: Role,
}

/// A person just created, with their token: shown only in this answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreatedUser {
    /// Identifier.
    pub id: uuid::Uuid,
    /// Name.
    pub name: String,
    /// Role.
    pub role: Role,
    /// The person's bearer token (`Authorization: Bearer <token>`), and what they sign
    /// in to the dashboard with beside their name. Only its hash is kept.
    pub token: String,
}

/// Creates a person with a role; their token appears only in this answer.
#[utoipa::path(post, path = "/api/v1/admin/users", tag = "admin",
    security(("admin_token" = [])), request_body = NewUser,
    responses((status = 201, description = "Created", body = CreatedUser),
              (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 409, description = "The name is taken", body = ErrorBody),
              (status = 422, body = ErrorBody)))]
async fn create_user(
    State(state): State<AppState>,
    Json(req): Json<NewUser>,
) -> Result<(StatusCode, Json<CreatedUser>), ApiError> {
    if let Err(why) = crate::server::roles::check_name(&req.name) {
        return Err(ApiError::unprocessable(ErrorCode::InvalidUser, why));
    }
    let secret = generate_secret().map_err(ApiError::internal)?;
    let user = state
        .store
        .create_user(&req.name, req.role, &hash_secret(&secret))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedUser {
            token: format!("{}.{secret}", user.id),
            id: user.id,
            name: user.name,
            role: user.role,
        }),
    ))
}

/// Every person, by name (never their tokens).
#[utoipa::path(get, path = "/api/v1/admin/users", tag = "admin",
    security(("admin_token" = [])),
    responses((status = 200, description = "People", body = Vec<User>),
              (status = 401, body = ErrorBody)))]
async fn list_users(State(state): State<AppState>) -> Result<Json<Vec<User>>, ApiError> {
    Ok(Json(state.store.users().await?))
}

/// Revokes a person: their token is refused from now on, and their dashboard sessions
/// end.
#[utoipa::path(post, path = "/api/v1/admin/users/{id}/revoke", tag = "admin",
    security(("admin_token" = [])), params(("id" = uuid::Uuid, Path, description = "User id")),
    responses((status = 200, description = "Revoked", body = User),
              (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody),
              (status = 409, description = "Already revoked", body = ErrorBody)))]
async fn revoke_user(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<User>, ApiError> {
    let id = parse_id(&id, "user")?;
    Ok(Json(state.store.revoke_user(id).await?))
}

/// The user routes, relative to the admin prefix.
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/users", post(create_user).get(list_users))
        .route("/users/{id}/revoke", post(revoke_user))
}

/// The handlers above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(
    paths(create_user, list_users, revoke_user),
    components(schemas(NewUser, CreatedUser, User, Role))
)]
pub struct UsersDoc;
