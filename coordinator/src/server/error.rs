//! The API's one error type and the JSON body every error response carries:
//!
//! ```json
//! {"error": {"code": "malformed_json", "message": "..."}}
//! ```
//!
//! Also the [`Json`] extractor whose rejections are [`ApiError`]s, and the middleware that
//! gives axum's own responses (404, 405, body-limit and extractor rejections) the same
//! shape.

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use super::error_code::ErrorCode;
/// The error body, shared with the edge client.
pub use cohort_edge::protocol::messages::{ErrorBody, ErrorDetail};

/// An error the API reports to its caller. The code is a stable `snake_case` string for
/// programs; the message is for people.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// 400: the request is malformed.
    #[error("{message}")]
    BadRequest {
        /// Stable code, e.g. `malformed_json`.
        code: ErrorCode,
        /// What was wrong.
        message: String,
    },
    /// 401: no valid credentials.
    #[error("{0}")]
    Unauthorized(String),
    /// 403: valid credentials that do not allow this.
    #[error("{0}")]
    Forbidden(String),
    /// 404: no such route or resource.
    #[error("{0}")]
    NotFound(String),
    /// 405: the route exists but not with this method.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// 409: the request conflicts with the current state.
    #[error("{message}")]
    Conflict {
        /// Stable code, e.g. `deadline_passed`.
        code: ErrorCode,
        /// What conflicts.
        message: String,
    },
    /// 413: the body is larger than the server accepts.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// 415: the body's content type is not accepted here.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// 422: well-formed but invalid (unknown fields, wrong types, failed validation).
    #[error("{message}")]
    UnprocessableEntity {
        /// Stable code, e.g. `invalid_body`.
        code: ErrorCode,
        /// What is invalid, naming the field when known.
        message: String,
    },
    /// 429: this caller sent more than its share; `Retry-After` says when to come back.
    #[error("{message}")]
    TooManyRequests {
        /// Which limit was hit.
        message: String,
        /// Seconds until a request will be taken again.
        retry_after_seconds: u64,
    },
    /// 500: a fault on the server's side. The detail is logged, never sent.
    #[error("internal error: {0}")]
    Internal(String),
    /// 503: a dependency (the database) is unreachable for now; `Retry-After` says when
    /// to try again. The detail is logged, never sent.
    #[error("unavailable: {detail}")]
    Unavailable {
        /// What failed, for the log.
        detail: String,
        /// Seconds to wait before retrying.
        retry_after_seconds: u64,
    },
}

/// What a client sees instead of the detail of an internal error.
const INTERNAL_MESSAGE: &str = "internal server error";
/// What a client sees when the database is unreachable.
const UNAVAILABLE_MESSAGE: &str =
    "the coordinator cannot reach its database right now; retry after the time in Retry-After";

impl ApiError {
    /// A 400 with a specific code.
    pub fn bad_request(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::BadRequest {
            code,
            message: message.into(),
        }
    }

    /// A 409 with a specific code.
    pub fn conflict(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Conflict {
            code,
            message: message.into(),
        }
    }

    /// A 422 with a specific code.
    pub fn unprocessable(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::UnprocessableEntity {
            code,
            message: message.into(),
        }
    }

    /// A 500 whose `detail` goes to the log only.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        Self::Internal(detail.to_string())
    }

    /// The HTTP status: the one its code is documented with.
    pub fn status(&self) -> StatusCode {
        self.code().status()
    }

    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::BadRequest { code, .. }
            | ApiError::Conflict { code, .. }
            | ApiError::UnprocessableEntity { code, .. } => *code,
            ApiError::Unauthorized(_) => ErrorCode::Unauthorized,
            ApiError::Forbidden(_) => ErrorCode::Forbidden,
            ApiError::NotFound(_) => ErrorCode::NotFound,
            ApiError::MethodNotAllowed(_) => ErrorCode::MethodNotAllowed,
            ApiError::PayloadTooLarge(_) => ErrorCode::PayloadTooLarge,
            ApiError::UnsupportedMediaType(_) => ErrorCode::UnsupportedMediaType,
            ApiError::TooManyRequests { .. } => ErrorCode::RateLimited,
            ApiError::Internal(_) => ErrorCode::Internal,
            ApiError::Unavailable { .. } => ErrorCode::Unavailable,
        }
    }

    /// The message sent to the client (generic for internal errors).
    pub fn client_message(&self) -> &str {
        match self {
            ApiError::BadRequest { message, .. }
            | ApiError::Conflict { message, .. }
            | ApiError::UnprocessableEntity { message, .. }
            | ApiError::Unauthorized(message)
            | ApiError::Forbidden(message)
            | ApiError::NotFound(message)
            | ApiError::MethodNotAllowed(message)
            | ApiError::PayloadTooLarge(message)
            | ApiError::UnsupportedMediaType(message)
            | ApiError::TooManyRequests { message, .. } => message,
            ApiError::Internal(_) => INTERNAL_MESSAGE,
            ApiError::Unavailable { .. } => UNAVAILABLE_MESSAGE,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code().as_str().to_string(),
                message: self.client_message().to_string(),
            },
        }
    }

    /// The error for a status that axum or a layer produced on its own, keeping its text
    /// as the message when there is one.
    fn from_status(status: StatusCode, text: Option<String>) -> Self {
        let message = text.unwrap_or_else(|| {
            status
                .canonical_reason()
                .unwrap_or("request failed")
                .to_ascii_lowercase()
        });
        match status {
            StatusCode::UNAUTHORIZED => ApiError::Unauthorized(message),
            StatusCode::FORBIDDEN => ApiError::Forbidden(message),
            StatusCode::NOT_FOUND => ApiError::NotFound(message),
            StatusCode::METHOD_NOT_ALLOWED => ApiError::MethodNotAllowed(message),
            // No layer answers 409 on its own: one that did would be a fault here.
            StatusCode::CONFLICT => ApiError::Internal(message),
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(message),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::UnsupportedMediaType(message),
            StatusCode::UNPROCESSABLE_ENTITY => {
                ApiError::unprocessable(ErrorCode::InvalidBody, message)
            }
            s if s.is_server_error() => ApiError::Internal(message),
            _ => ApiError::bad_request(ErrorCode::BadRequest, message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(detail) = &self {
            tracing::error!(%detail, "internal error while handling a request");
        }
        if let ApiError::Unavailable { detail, .. } = &self {
            tracing::warn!(%detail, "database unavailable while handling a request");
        }
        let status = self.status();
        let retry_after = match &self {
            ApiError::TooManyRequests {
                retry_after_seconds,
                ..
            }
            | ApiError::Unavailable {
                retry_after_seconds,
                ..
            } => Some(*retry_after_seconds),
            _ => None,
        };
        let mut response = (status, axum::Json(self.body())).into_response();
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::JsonDataError(e) => {
                ApiError::unprocessable(ErrorCode::InvalidBody, e.body_text())
            }
            JsonRejection::JsonSyntaxError(e) => {
                ApiError::bad_request(ErrorCode::MalformedJson, e.body_text())
            }
            JsonRejection::MissingJsonContentType(_) => {
                ApiError::UnsupportedMediaType("expected `Content-Type: application/json`".into())
            }
            JsonRejection::BytesRejection(e) => {
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::PayloadTooLarge(
                        "request body is larger than the server accepts".into(),
                    )
                } else {
                    ApiError::bad_request(ErrorCode::UnreadableBody, e.body_text())
                }
            }
            other => ApiError::bad_request(ErrorCode::BadRequest, other.body_text()),
        }
    }
}

/// A JSON body (request or response) whose extraction failures are [`ApiError`]s, so a
/// malformed, mistyped or oversized body gets the same JSON error shape as everything
/// else. Use it instead of `axum::Json` in every handler.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T, S> FromRequest<S> for Json<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(value) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Json(value))
    }
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// Largest error body from axum or a layer that is read to reuse as the message.
const MAX_REWRITTEN_BODY: usize = 4096;

/// Middleware: turns any error response that is not already JSON (axum's 405, body-limit
/// and extractor rejections, a layer's own refusal) into the API's JSON error shape, so a
/// client never has to handle two formats. Headers such as `Allow` are kept.
pub async fn json_errors(response: Response) -> Response {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_REWRITTEN_BODY)
        .await
        .ok()
        .and_then(|bytes| String::from_utf8(bytes.to_vec()).ok())
        .map(|text| text.trim().to_string())
        .filter(|text| !text.is_empty());
    let error = ApiError::from_status(status, text);
    let body = serde_json::to_vec(&error.body()).unwrap_or_default();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if status == StatusCode::UNAUTHORIZED {
        parts
            .headers
            .entry(header::WWW_AUTHENTICATE)
            .or_insert(HeaderValue::from_static("Bearer"));
    }
    Response::from_parts(parts, Body::from(body))
}

/// The fallback for paths no route matches.
pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("no route for `{}`", uri.path()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::extract::DefaultBodyLimit;
    use axum::routing::post;
    use serde::Deserialize;
    use tower::ServiceExt;

    #[derive(Debug, Deserialize, Serialize)]
    #[serde(deny_unknown_fields)]
    struct Payload {
        name: String,
        count: u32,
    }

    async fn echo(Json(p): Json<Payload>) -> Json<Payload> {
        Json(p)
    }

    fn router() -> Router {
        Router::new()
            .route("/echo", post(echo))
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(64))
            .layer(axum::middleware::map_response(json_errors))
    }

    async fn send(content_type: Option<&str>, body: &str) -> (StatusCode, ErrorBody) {
        let mut req = Request::post("/echo");
        if let Some(ct) = content_type {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        let response = router()
            .oneshot(req.body(Body::from(body.to_string())).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("not the error shape ({e}): {bytes:?}"));
        (status, body)
    }

    const JSON: Option<&str> = Some("application/json");

    #[tokio::test]
    async fn valid_body_passes_through() {
        let response = router()
            .oneshot(
                Request::post("/echo")
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Body::from(r#"{"name":"a","count":1}"#))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn malformed_json_is_400() {
        let (status, body) = send(JSON, "{\"name\": ").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body.error.code, "malformed_json");
    }

    #[tokio::test]
    async fn wrong_content_type_is_415() {
        let (status, body) = send(Some("text/plain"), r#"{"name":"a","count":1}"#).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(body.error.code, "unsupported_media_type");
        let (status, _) = send(None, r#"{"name":"a","count":1}"#).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[tokio::test]
    async fn unknown_field_is_422_and_named() {
        let (status, body) = send(JSON, r#"{"name":"a","count":1,"extra":true}"#).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(body.error.code, "invalid_body");
        assert!(
            body.error.message.contains("extra"),
            "{}",
            body.error.message
        );
    }

    #[tokio::test]
    async fn wrong_type_is_422_and_names_the_field() {
        let (status, body) = send(JSON, r#"{"name":"a","count":-1}"#).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(
            body.error.message.contains("count"),
            "{}",
            body.error.message
        );
    }

    #[tokio::test]
    async fn oversize_body_is_413() {
        let big = format!(r#"{{"name":"{}","count":1}}"#, "x".repeat(200));
        let (status, body) = send(JSON, &big).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body.error.code, "payload_too_large");
    }

    #[tokio::test]
    async fn axum_405_and_404_get_the_json_shape() {
        let response = router()
            .oneshot(Request::get("/echo").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert!(response.headers().contains_key(header::ALLOW));
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.error.code, "method_not_allowed");

        let response = router()
            .oneshot(Request::get("/nowhere").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.error.code, "not_found");
    }

    #[test]
    fn internal_errors_hide_the_detail() {
        let e = ApiError::internal("db password is hunter2");
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.body().error.message, "internal server error");
    }

    /// A caller told to slow down, or to wait out a database outage, learns when to come
    /// back (`Retry-After`) and gets the usual JSON error; the outage's detail (which
    /// may name hosts) stays in the log.
    #[tokio::test]
    async fn throttled_and_unavailable_answers_carry_retry_after() {
        let limited = ApiError::TooManyRequests {
            message: "too many enrolments from this address".into(),
            retry_after_seconds: 7,
        }
        .into_response();
        assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(limited.headers()[header::RETRY_AFTER], "7");
        let down = ApiError::Unavailable {
            detail: "connection refused by db.internal:5432".into(),
            retry_after_seconds: 5,
        }
        .into_response();
        assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(down.headers()[header::RETRY_AFTER], "5");
        let body = axum::body::to_bytes(down.into_body(), 4096).await.unwrap();
        let body: ErrorBody = serde_json::from_slice(&body).unwrap();
        assert_eq!(body.error.code, "unavailable");
        assert!(!body.error.message.contains("db.internal"));
    }
}
