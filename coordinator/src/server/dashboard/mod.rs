//! The admin web dashboard, served by `cohort serve` at `/`.
//!
//! Server-rendered HTML (templates in `web-ui/templates`, compiled into the binary by
//! askama; CSS and a small script from `web-ui/static`, embedded at build time), so every
//! read-only view works without JavaScript and nothing is fetched from anywhere but this
//! server. The script only refreshes the parts of a page marked `data-live`.
//!
//! - [`session`]: sign-in with the admin token, the session cookie, and the guard that
//!   also checks the CSRF token of every state-changing request.
//! - [`pages`]: the experiment, experiment-detail, clients and model files pages and
//!   their actions.
//! - [`form`]: the new-experiment form, its parsing and its per-field messages.
//! - [`multipart`]: reading the model upload form's `multipart/form-data` body.
//! - [`chart`]: SVG line charts, drawn on the server.

pub mod chart;
pub mod form;
pub mod multipart;
pub mod pages;
pub mod session;

/// Where the model files page is, and where its upload form posts to (a path the
/// session guard gives the larger body limit of a file upload).
pub const UPLOAD_PATH: &str = "/models";

use askama::Template;
use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};

use crate::server::AppState;

/// The stylesheet, embedded at build time.
const APP_CSS: &str = include_str!("../../../../web-ui/static/app.css");
/// The script that keeps `data-live` regions current, embedded at build time.
const APP_JS: &str = include_str!("../../../../web-ui/static/app.js");

/// A short hash of the embedded assets, put in their URLs so that a browser never runs
/// a new page against an old cached script.
pub fn asset_version() -> &'static str {
    static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let digest = ring::digest::digest(
            &ring::digest::SHA256,
            format!("{APP_CSS}\0{APP_JS}").as_bytes(),
        );
        crate::server::auth::to_hex(&digest.as_ref()[..6])
    });
    &VERSION
}

/// What every page's frame (header, navigation, sign-out form) needs.
#[derive(Debug, Clone)]
pub struct Chrome {
    /// The CSRF token for the page's forms; empty when signed out.
    pub csrf: String,
    /// Whether to show navigation and sign-out.
    pub signed_in: bool,
    /// Which navigation entry is current: `experiments`, `clients`, `models` or empty.
    pub nav: &'static str,
    /// See [`asset_version`].
    pub asset_version: &'static str,
}

impl Chrome {
    /// The frame of a signed-in page.
    pub fn signed_in(session: &session::Session, nav: &'static str) -> Self {
        Self {
            csrf: session.csrf.clone(),
            signed_in: true,
            nav,
            asset_version: asset_version(),
        }
    }

    /// The frame of the sign-in page.
    pub fn signed_out() -> Self {
        Self {
            csrf: String::new(),
            signed_in: false,
            nav: "",
            asset_version: asset_version(),
        }
    }
}

/// Why a dashboard request failed, shown as an HTML page with the matching status.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// The thing asked for does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// The action does not fit the current state (e.g. starting a running experiment).
    #[error("{0}")]
    Conflict(String),
    /// The request is refused (no session, bad CSRF token, cross-site).
    #[error("{0}")]
    Forbidden(String),
    /// The request itself is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// The request's body is larger than the server accepts.
    #[error("{0}")]
    TooLarge(String),
    /// Something failed on the server; details go to the log, not the page.
    #[error("internal error")]
    Internal(String),
}

impl PageError {
    /// An internal error, logged with its cause.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        PageError::Internal(detail.to_string())
    }

    fn status(&self) -> StatusCode {
        match self {
            PageError::NotFound(_) => StatusCode::NOT_FOUND,
            PageError::Conflict(_) => StatusCode::CONFLICT,
            PageError::Forbidden(_) => StatusCode::FORBIDDEN,
            PageError::BadRequest(_) => StatusCode::BAD_REQUEST,
            PageError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            PageError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<crate::store::StoreError> for PageError {
    fn from(e: crate::store::StoreError) -> Self {
        use crate::store::StoreError;
        match e {
            StoreError::NotFound(what) => PageError::NotFound(what),
            StoreError::Conflict(why) => PageError::Conflict(why.message),
            StoreError::TokenRefused(why) => PageError::Conflict(why.to_string()),
            other => PageError::internal(other),
        }
    }
}

#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage {
    page: Chrome,
    status: u16,
    title: String,
    message: String,
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        if let PageError::Internal(detail) = &self {
            tracing::error!(error = %detail, "dashboard request failed");
        }
        let status = self.status();
        let page = ErrorPage {
            page: Chrome::signed_out(),
            status: status.as_u16(),
            title: status.canonical_reason().unwrap_or("Error").to_string(),
            message: self.to_string(),
        };
        (status, render(&page)).into_response()
    }
}

/// A template rendered to an HTML answer; a template that fails to render (a bug) is a
/// 500, not a panic.
pub fn render(template: &impl Template) -> Response {
    match template.render() {
        Ok(html) => Html(html).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "dashboard template failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "template error").into_response()
        }
    }
}

async fn stylesheet() -> Response {
    asset(APP_CSS, "text/css; charset=utf-8")
}

async fn script() -> Response {
    asset(APP_JS, "text/javascript; charset=utf-8")
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            // Versioned URLs: a changed asset gets a new URL, so it may be cached long.
            (header::CACHE_CONTROL, "public, max-age=31536000, immutable"),
        ],
        body,
    )
        .into_response()
}

/// Headers on every dashboard answer: no caching of pages that show private state, no
/// framing, and a content security policy that allows only this server's own script and
/// stylesheet (the page has no inline script or style to allow).
async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// The dashboard's routes, with absolute paths. Everything except the sign-in page and
/// the static assets is behind [`session::require_session`].
pub fn router(state: AppState) -> Router<AppState> {
    let guarded = Router::new()
        .route("/", get(pages::home))
        .route("/experiments", get(pages::experiments).post(pages::create))
        .route("/experiments/new", get(pages::new_experiment))
        .route("/experiments/{id}", get(pages::experiment))
        .route("/experiments/{id}/{action}", post(pages::act))
        .route("/experiments/{id}/model", get(pages::model_raw))
        .route(
            "/experiments/{id}/model.safetensors",
            get(pages::model_safetensors),
        )
        .route("/clients", get(pages::clients))
        .route(UPLOAD_PATH, get(pages::models).post(pages::upload_model))
        .route("/clients/{id}/revoke", post(pages::revoke_client))
        .route("/tokens", post(pages::create_token))
        .route("/tokens/{id}/revoke", post(pages::revoke_token))
        .route("/sign-out", post(session::sign_out))
        .layer(middleware::from_fn_with_state(
            state,
            session::require_session,
        ));
    Router::new()
        .route(
            "/sign-in",
            get(session::sign_in_page).post(session::sign_in),
        )
        .route("/static/app.css", get(stylesheet))
        .route("/static/app.js", get(script))
        .merge(guarded)
        .layer(middleware::map_response(security_headers))
}

/// The answer for a path nothing matches outside the API: an HTML 404.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    let mut response = PageError::NotFound(format!("page `{}`", uri.path())).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
