//! The audit log over the API: who did what to which object, and when, newest first.
//! Every admin action (experiments created and moved between states, enrolment tokens
//! issued and revoked, clients revoked, model files uploaded, dashboard sign-ins) and
//! the coordinator's own round and job transitions write an entry in the same database
//! transaction as the change itself, so the log and the state never disagree.

use axum::extract::{Query, State};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use crate::server::AppState;
use crate::server::error::{ApiError, ErrorBody, ErrorCode};
use crate::store::AuditEntry;

/// Entries per page when `limit` is not given.
pub const DEFAULT_AUDIT_PAGE: i64 = 100;
/// The most entries one page holds.
pub const MAX_AUDIT_PAGE: i64 = 1000;

/// Paging through the log.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Entries to return, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// Only entries older than this id: the last id of the previous page.
    pub before: Option<i64>,
}

/// The audit log, newest first, a page at a time.
#[utoipa::path(get, path = "/api/v1/admin/audit", tag = "admin",
    security(("admin_token" = [])), params(AuditQuery),
    responses((status = 200, description = "Entries, newest first", body = Vec<AuditEntry>),
              (status = 401, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn list_audit(
    State(state): State<AppState>,
    Query(query): Query<AuditQuery>,
) -> Result<Json<Vec<AuditEntry>>, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_AUDIT_PAGE);
    if !(1..=MAX_AUDIT_PAGE).contains(&limit) {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidLimit,
            format!("limit {limit}: must be between 1 and {MAX_AUDIT_PAGE}"),
        ));
    }
    Ok(Json(state.store.audit_page(limit, query.before).await?))
}

/// The audit route, relative to the admin prefix.
pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/audit", get(list_audit))
}

/// The handler above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(paths(list_audit), components(schemas(AuditEntry)))]
pub struct AuditDoc;
