//! `cohort serve`: settings, TLS, authentication and the HTTP API.
//!
//! - [`settings`]: one validated [`ServeSettings`] from a TOML file, `COHORT_*`
//!   variables and flags.
//! - [`tls`]: the development CA and loading certificates into rustls.
//! - [`auth`]: the admin token (generated once, stored hashed) and secret hashing.
//! - [`error`]: [`ApiError`], the JSON error body, and the [`Json`](error::Json) extractor.
//! - [`http`]: the handlers, one module per resource, the routes and the OpenAPI
//!   document.
//! - [`driver`]: what moves experiments on: the ticks of synchronous rounds, secure
//!   rounds and FedBuff buffers, and the aggregation jobs.
//!
//! [`run`] is the whole command; [`prepare`] and [`Prepared::serve`] split it so tests can
//! bind `127.0.0.1:0`, learn the address and generated secrets, and talk to a real server.

pub mod auth;
pub mod dashboard;
pub mod driver;
pub mod early_answer;
pub mod error;
pub mod error_code;
pub mod fd_limit;
pub mod http;
pub mod logging;
pub mod privacy;
pub mod rate_limit;
pub mod roles;
pub mod secagg_snapshots;
pub mod settings;
pub mod telemetry;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;

use crate::blobs::BlobStore;
use crate::store::{Store, StoreError};
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum_server::tls_rustls::RustlsConfig;
use tower_http::trace::{DefaultMakeSpan, DefaultOnResponse, TraceLayer};
use tracing::Level;

pub use auth::{AdminToken, hash_secret};
pub use error::ApiError;
pub use http::{ADMIN_PREFIX, ApiDoc, admin_router};
pub use settings::{Secret, ServeArgs, ServeFlags, ServeSettings, SettingsError, TlsMode};

/// How long in-flight requests may finish after shutdown is asked for.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's headers; without a bound, a client
/// that trickles bytes could hold a connection open forever.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// What every handler can reach. Cheap to clone: each part sits behind an `Arc`.
#[derive(Clone)]
pub struct AppState {
    /// The validated settings.
    pub settings: Arc<ServeSettings>,
    /// Checks admin bearer tokens.
    pub admin: Arc<AdminToken>,
    /// The system of record.
    pub store: Store,
    /// Uploaded updates and published models on disk.
    pub blobs: BlobStore,
    /// Where aggregation's hot loops run (the CPU's cores or a GPU).
    pub reducer: Arc<dyn cohort_aggregation::reduce::Reducer>,
    /// The held-out set published models are evaluated on (`--eval-data`), if any.
    pub eval: Option<Arc<cohort_edge::data::Dataset>>,
    /// This server's request and job series, for `/metrics`.
    pub telemetry: telemetry::Telemetry,
    /// This replica's rate limits on enrolment and uploads.
    pub limits: Arc<rate_limit::RateLimits>,
    /// This replica's snapshots of secure rounds' closed stages.
    pub secure_rounds: Arc<secagg_snapshots::SecureRoundCache>,
    /// The experiment trackers (`--mlflow-uri`, `--tensorboard`) this replica reports
    /// to; none by default.
    pub tracker: crate::tracking::outbox::Tracker,
}

impl AppState {
    /// State from settings, the admin token verifier, the store, the blob store and the
    /// reducer.
    pub fn new(
        settings: ServeSettings,
        admin: AdminToken,
        store: Store,
        blobs: BlobStore,
        reducer: Arc<dyn cohort_aggregation::reduce::Reducer>,
    ) -> Self {
        let limits = Arc::new(rate_limit::RateLimits::new(settings.rate_limits));
        Self {
            limits,
            settings: Arc::new(settings),
            admin: Arc::new(admin),
            store,
            blobs,
            reducer,
            eval: None,
            telemetry: telemetry::Telemetry::new(),
            secure_rounds: Arc::new(secagg_snapshots::SecureRoundCache::new()),
            tracker: Default::default(),
        }
    }

    /// The same state, evaluating published models on `data`.
    pub fn with_eval_data(mut self, data: cohort_edge::data::Dataset) -> Self {
        self.eval = Some(Arc::new(data));
        self
    }
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The data directory could not be created.
    #[error("cannot create data dir `{path}`: {source}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// TLS could not be set up.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// The admin token could not be set up.
    #[error(transparent)]
    AdminToken(#[from] auth::AuthError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The object store for blobs could not be set up or reached.
    #[error("{0}")]
    BlobStore(String),
    /// An experiment tracker could not be set up.
    #[error("{0}")]
    Tracking(String),
    /// The async runtime could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    /// The server stopped on an I/O error.
    #[error("server failed: {0}")]
    Serve(std::io::Error),
    /// A start-up task did not finish.
    #[error("start-up task failed: {0}")]
    Task(String),
    /// The database could not be opened or migrated.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `--reducer cuda` without a usable GPU.
    #[error("reducer: {0}")]
    Reducer(String),
    /// `--eval-data` names a file that cannot be read as a labelled CSV.
    #[error("eval data `{path}`: {message}")]
    EvalData {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
}

impl ServeError {
    /// The process exit status for this error: 2 when a setting points at unusable TLS
    /// files (fix the input), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            ServeError::Tls(_) | ServeError::Reducer(_) | ServeError::EvalData { .. } => 2,
            _ => 1,
        }
    }
}

/// The largest body a route that reads its body whole (JSON, forms) takes: 1 MiB, or
/// `--max-body-bytes` when that is smaller. Nothing of the API's JSON comes near it.
pub const MAX_JSON_BODY_BYTES: usize = 1 << 20;

/// The whole HTTP application: public routes, the guarded admin routes of
/// [`admin_router`], the JSON 404 fallback, the body limit and request tracing.
pub fn app(state: AppState) -> Router {
    app_with_admin(state, admin_router())
}

/// Like [`app`], with `admin` as the admin router (paths relative to [`ADMIN_PREFIX`]).
/// Every route in it, and every unknown path under the prefix, is behind the admin
/// token guard.
pub fn app_with_admin(state: AppState, admin: Router<AppState>) -> Router {
    // The guard wraps the admin fallback too, so an unknown admin path answers 401 to a
    // caller without the token instead of revealing which admin routes exist.
    let admin = admin
        .fallback(error::not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            http::require_admin,
        ));
    // Every API answer, errors included, is JSON; the dashboard answers in HTML, so the
    // rewriting of non-JSON errors stays on the API's side.
    let api = http::public_router(&state)
        .nest(ADMIN_PREFIX, admin)
        .layer(middleware::map_response(error::json_errors));
    Router::new()
        .merge(api)
        .merge(crate::server::dashboard::router(state.clone()))
        .route("/metrics", axum::routing::get(telemetry::metrics))
        .fallback(fallback)
        // Inside the body limit and tracing, per route: the route template is known here.
        .layer(middleware::from_fn_with_state(
            state.clone(),
            telemetry::record_requests,
        ))
        // Bodies read whole (JSON, forms) stay small; the routes that take big bodies
        // (update uploads, model files) read them as streams against --max-body-bytes.
        .layer(DefaultBodyLimit::max(
            state.settings.max_body_bytes.min(MAX_JSON_BODY_BYTES),
        ))
        // Outermost but for tracing: a body a handler abandoned is read on wherever
        // the answer came from (a handler, the body limit, the admin guard).
        .layer(middleware::from_fn(early_answer::keep_reading))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(DefaultMakeSpan::new().level(Level::INFO))
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        .with_state(state)
}

/// Paths no route matches: a JSON 404 under `/api/`, the dashboard's HTML 404 elsewhere.
async fn fallback(uri: axum::http::Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    if uri.path() == "/api" || uri.path().starts_with("/api/") {
        return error::json_errors(error::not_found(uri).await.into_response()).await;
    }
    crate::server::dashboard::not_found(uri).await
}

/// A server that has done all its start-up work and is bound, but not yet serving.
pub struct Prepared {
    listener: std::net::TcpListener,
    state: AppState,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// The address actually bound (the port is known even when 0 was asked for).
    pub local_addr: SocketAddr,
    /// In dev TLS mode, the CA certificate clients must trust.
    pub dev_ca_cert: Option<PathBuf>,
    /// The admin token, when this start generated it. Shown once; only its hash is kept.
    pub generated_admin_token: Option<Secret>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("local_addr", &self.local_addr)
            .field("tls", &self.tls.is_some())
            .field("dev_ca_cert", &self.dev_ca_cert)
            .field("generated_admin_token", &self.generated_admin_token)
            .finish_non_exhaustive()
    }
}

/// Does the start-up work: creates the data directory, sets up TLS (creating the
/// development CA when asked), loads or generates the admin token, and binds the listen
/// address.
pub async fn prepare(settings: ServeSettings) -> Result<Prepared, ServeError> {
    // File I/O and key generation would stall an async worker; do them on the blocking
    // pool.
    // The store first: a database that cannot be opened or migrated stops start-up before
    // anything listens.
    let store = Store::connect(&settings.database_url, &settings.data_dir).await?;
    tokio::task::spawn_blocking(move || prepare_blocking(settings, store))
        .await
        .map_err(|e| ServeError::Task(e.to_string()))?
}

fn prepare_blocking(settings: ServeSettings, store: Store) -> Result<Prepared, ServeError> {
    install_crypto_provider();
    std::fs::create_dir_all(&settings.data_dir).map_err(|source| ServeError::DataDir {
        path: settings.data_dir.clone(),
        source,
    })?;
    let (tls, dev_ca_cert) = match &settings.tls {
        TlsMode::DevTls => {
            let files = tls::ensure_dev_tls(&settings.data_dir)?;
            let config = tls::load_server_config_with_clients(
                &files.server_cert,
                &files.server_key,
                settings.client_ca.as_deref(),
            )?;
            (Some(config), Some(files.ca_cert))
        }
        TlsMode::Files { cert, key } => (
            Some(tls::load_server_config_with_clients(
                cert,
                key,
                settings.client_ca.as_deref(),
            )?),
            None,
        ),
        TlsMode::InsecureHttp => (None, None),
    };
    let (admin, generated_admin_token) =
        AdminToken::load_or_generate(&settings.data_dir, settings.admin_token.as_ref())?;
    let blobs = match &settings.blob_store {
        // On the blocking pool: the store's calls block on this runtime.
        Some(url) => BlobStore::Object(
            crate::blobs::object::ObjectBlobs::open(url, tokio::runtime::Handle::current())
                .map_err(|e| ServeError::BlobStore(e.to_string()))?,
        ),
        None => {
            let blobs_root = settings.data_dir.join("blobs");
            BlobStore::open(&blobs_root).map_err(|source| ServeError::DataDir {
                path: blobs_root,
                source,
            })?
        }
    };
    tracing::info!(blobs = %blobs.describe(), "uploads and models are kept here");
    let listener =
        std::net::TcpListener::bind(settings.listen).map_err(|source| ServeError::Bind {
            addr: settings.listen,
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: settings.listen,
        source,
    })?;
    let selected = cohort_aggregation::reduce::select(settings.reducer)
        .map_err(|e| ServeError::Reducer(format!("--reducer {}: {e}", settings.reducer)))?;
    tracing::info!("{}", selected.line);
    let eval = match settings.eval_data.clone() {
        Some(path) => {
            // Already on the blocking pool.
            let data = cohort_edge::data::load_csv(&path).map_err(|e| ServeError::EvalData {
                path: path.clone(),
                message: e.to_string(),
            })?;
            tracing::info!(
                path = %path.display(),
                samples = data.labels.len(),
                features = data.features.ncols(),
                classes = data.classes.len(),
                "published models are evaluated on this held-out set"
            );
            Some(data)
        }
        None => None,
    };
    let sinks = driver::track::sinks(&settings)?;
    let mut state = AppState::new(settings, admin, store, blobs, selected.reducer);
    if let Some(data) = eval {
        state = state.with_eval_data(data);
    }
    // On the blocking pool, inside the runtime: the feeding tasks start on it.
    state.tracker =
        crate::tracking::outbox::Tracker::start(sinks, crate::tracking::outbox::QUEUE_CAPACITY);
    Ok(Prepared {
        listener,
        state,
        tls,
        local_addr,
        dev_ca_cert,
        generated_admin_token,
    })
}

impl Prepared {
    /// The state the routes will see.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// The base URL clients use, e.g. `https://127.0.0.1:8443`.
    pub fn base_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.local_addr)
    }

    /// The start-up report for stdout: the CA to trust in dev TLS, the admin token when it
    /// was just generated (the only time it is ever shown), and last, as the sign that the
    /// server is ready, where to connect.
    pub fn banner(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if self.tls.is_none() {
            lines.push("warning: plain HTTP (--insecure-http); put a TLS proxy in front".into());
        }
        if let Some(ca) = &self.dev_ca_cert {
            lines.push(format!(
                "dev TLS: clients must trust the CA certificate {}",
                ca.display()
            ));
        }
        if let Some(token) = &self.generated_admin_token {
            lines.push(format!(
                "admin token (shown only this once; only its hash is stored): {}",
                token.expose()
            ));
        }
        lines.push(format!("cohort serve listening on {}", self.base_url()));
        lines
    }

    /// Serves [`app`] until `shutdown` completes, then drains in-flight requests for up
    /// to [`SHUTDOWN_GRACE`].
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        self.serve_with_admin(admin_router(), shutdown).await
    }

    /// Like [`serve`](Self::serve), with `admin` as the admin router (see
    /// [`app_with_admin`]); every route in it is guarded by the admin token.
    pub async fn serve_with_admin(
        self,
        admin: Router<AppState>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        // The round driver runs beside the API and stops with it.
        let driver = tokio::spawn(driver::run(self.state.clone()));
        let tracker = self.state.tracker.clone();
        let router = app_with_admin(self.state, admin);
        let result = serve(self.listener, router, self.tls, shutdown).await;
        driver.abort();
        // What the trackers have not taken yet gets a moment to leave; a tracker that is
        // down does not hold the shutdown up longer.
        let left = tracker.drain(TRACKER_DRAIN).await;
        if left > 0 {
            tracing::warn!(
                records = left,
                "trackers did not take these records before shutdown"
            );
        }
        result
    }
}

/// How long a stopping server waits for its trackers to take what is queued.
pub const TRACKER_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// The most a connection buffers of what it reads. hyper's default (about 400 KB) lets
/// every connection in the middle of an upload hold a whole 100,000-parameter update;
/// with this cap an upload in flight holds one buffer plus the chunk on its way to disk,
/// so memory grows with connections, not with model size.
pub const CONNECTION_READ_BUFFER: usize = 64 * 1024;

/// Connection settings for both the TLS and the plain listener.
fn limit_connections(
    builder: &mut hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
) {
    builder
        .http1()
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(CONNECTION_READ_BUFFER);
    // Edge clients speak HTTP/2 when TLS offers it. hyper's HTTP/2 stream window (1 MB)
    // would let each client push its whole update before the handler reads it; a fixed
    // window of one buffer keeps a stream in flight to that. (The connection window stays
    // at its default: shrinking it too made early answers such as a 413 reach clients as
    // broken pipes.)
    builder
        .http2()
        .adaptive_window(false)
        .initial_stream_window_size(CONNECTION_READ_BUFFER as u32);
}

/// Serves `router` on `listener`, over TLS with `tls` or as plain HTTP without, until
/// `shutdown` completes; then stops accepting and lets in-flight requests finish for up
/// to [`SHUTDOWN_GRACE`].
pub async fn serve(
    listener: std::net::TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let handle = axum_server::Handle::new();
    let trigger = handle.clone();
    let watcher = tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutting down");
        trigger.graceful_shutdown(Some(SHUTDOWN_GRACE));
    });
    // The peer's address goes with every request, for the per-address rate limits.
    let service = router.into_make_service_with_connect_info::<SocketAddr>();
    let result = match tls {
        Some(config) => {
            let mut server = axum_server::tls_rustls::from_tcp_rustls(
                listener,
                RustlsConfig::from_config(config),
            )
            .map_err(ServeError::Serve)?;
            limit_connections(server.http_builder());
            server.handle(handle).serve(service).await
        }
        None => {
            let mut server = axum_server::from_tcp(listener).map_err(ServeError::Serve)?;
            limit_connections(server.http_builder());
            server.handle(handle).serve(service).await
        }
    };
    watcher.abort();
    result.map_err(ServeError::Serve)
}

/// `cohort serve` inside an existing runtime: prepares, prints the banner to stdout, and
/// serves until `shutdown`.
pub async fn run(
    settings: ServeSettings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let prepared = prepare(settings).await?;
    for line in prepared.banner() {
        println!("{line}");
    }
    prepared.serve(shutdown).await
}

/// `cohort serve` from a synchronous `main`: installs the ring crypto provider, starts
/// logging to stderr (`RUST_LOG`, default `info`; [`logging`]), raises the open file limit
/// ([`fd_limit`]), starts a multi-threaded runtime, and runs until Ctrl-C or SIGTERM.
pub fn run_until_signal(settings: ServeSettings) -> Result<(), ServeError> {
    install_crypto_provider();
    logging::init(settings.log_format);
    // Every held client connection is a file descriptor; before anything listens.
    fd_limit::raise_and_log();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    runtime.block_on(run(settings, shutdown_signal()))
}

/// Completes on Ctrl-C, or on SIGTERM (what `docker stop` and systemd send) on Unix.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            // Without a signal handler there is nothing to wait for; never complete.
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

/// Makes ring the process-wide rustls provider. Safe to call more than once; a provider
/// installed earlier (by an embedding program or a test) is kept.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
