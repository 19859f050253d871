//! The settings of `cohort serve`: one typed struct, loaded in layers and checked once at
//! start-up, so that nothing later has to second-guess a value.
//!
//! Layers, later ones winning key by key:
//!
//! 1. built-in defaults;
//! 2. an optional TOML file (`--config FILE`), kebab-case keys, unknown keys refused;
//! 3. `COHORT_*` environment variables;
//! 4. command-line flags.
//!
//! | setting | TOML | environment | flag |
//! | --- | --- | --- | --- |
//! | listen address | `listen = "0.0.0.0:8443"` | `COHORT_LISTEN=0.0.0.0:8443` | `--listen` |
//! | data directory | `data-dir = "/var/lib/cohort"` | `COHORT_DATA_DIR=/var/lib/cohort` | `--data-dir` |
//! | database | `database-url = "postgres://db/cohort"` | `COHORT_DATABASE_URL=...` | `--database-url` |
//! | dev TLS | `dev-tls = true` | `COHORT_DEV_TLS=1` | `--dev-tls` |
//! | TLS files | `tls-cert = "cert.pem"`, `tls-key = "key.pem"` | `COHORT_TLS_CERT`, `COHORT_TLS_KEY` | `--tls-cert`, `--tls-key` |
//! | plain HTTP | `insecure-http = true` | `COHORT_INSECURE_HTTP=1` | `--insecure-http` |
//! | admin token | `admin-token = "..."` | `COHORT_ADMIN_TOKEN=...` | `--admin-token` |
//! | body limit | `max-body-bytes = 67108864` | `COHORT_MAX_BODY_BYTES=67108864` | `--max-body-bytes` |
//! | job lease | `job-lease-seconds = 120` | `COHORT_JOB_LEASE_SECONDS=120` | `--job-lease-seconds` |

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Default listen address: loopback only, so a fresh install is not exposed by accident.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8443";
/// Default data directory (TLS material, the admin token hash, the SQLite file).
pub const DEFAULT_DATA_DIR: &str = "cohort-data";
/// Default database: an SQLite file inside the data directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://cohort.db";
/// Default largest accepted request body: 64 MiB, room for a large model update.
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// Default job lease: long enough for an aggregation between two renewals.
pub const DEFAULT_JOB_LEASE_SECONDS: u64 = 120;
/// Shortest job lease: the lease is renewed every third of it, and a database round trip
/// must fit in that.
pub const MIN_JOB_LEASE_SECONDS: u64 = 3;
/// Shortest admin token accepted from settings; shorter ones are guessable.
pub const MIN_ADMIN_TOKEN_LEN: usize = 32;

/// A secret string (the admin token) whose `Debug` output never shows the value, so it
/// cannot leak through a log line or an error report.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself; call only where it is compared or hashed.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// How the server speaks to the network. Exactly one is chosen at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsMode {
    /// A self-signed CA and a server certificate, created once in `<data_dir>/tls/`.
    DevTls,
    /// A certificate chain and a private key from PEM files.
    Files {
        /// PEM certificate chain, leaf first.
        cert: PathBuf,
        /// PEM private key (PKCS#8, PKCS#1 or SEC1).
        key: PathBuf,
    },
    /// Plain HTTP, for use behind a TLS-terminating proxy; only when asked for explicitly.
    InsecureHttp,
}

/// Every setting of `cohort serve`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeSettings {
    /// Address and port to listen on.
    pub listen: SocketAddr,
    /// Directory for TLS material, the admin token hash and the default SQLite file.
    pub data_dir: PathBuf,
    /// Database URL: `sqlite://PATH` or `postgres://...` / `postgresql://...`. A relative
    /// SQLite path has already been resolved inside `data_dir` (and made absolute).
    pub database_url: String,
    /// Transport security.
    pub tls: TlsMode,
    /// The admin token from settings; `None` means generate one at first start.
    pub admin_token: Option<Secret>,
    /// Largest accepted request body in bytes.
    pub max_body_bytes: usize,
    /// Where aggregation's hot loops run: `auto` (the GPU when one is usable), `cpu` or
    /// `cuda`.
    pub reducer: cohort_aggregation::reduce::ReducerChoice,
    /// A held-out labelled CSV the coordinator evaluates every published model on (test
    /// accuracy and loss per round), for experiments whose features and classes match it.
    pub eval_data: Option<PathBuf>,
    /// Mutual TLS: a PEM file of the CA certificates every TLS client must present a
    /// certificate from.
    pub client_ca: Option<PathBuf>,
    /// Rate limits on enrolment, uploads, client messages and failed authentications.
    pub rate_limits: super::rate_limit::RateSettings,
    /// Load balancers in front of the coordinator: a request from one of these
    /// addresses is taken to come from the address it names in `X-Forwarded-For`.
    pub trusted_proxies: Vec<std::net::IpAddr>,
    /// How long a replica holds a claimed job without renewing it; a job held by a
    /// replica that died is taken over this long after its last renewal.
    pub job_lease: std::time::Duration,
    /// Draws every round's cohort from this seed (mixed with the round and attempt)
    /// instead of the operating system's generator, so that a deployment's selections
    /// can be replayed; `None` (the default) draws them unpredictably.
    pub selection_seed: Option<u64>,
    /// How log lines are written.
    pub log_format: super::logging::LogFormat,
    /// An MLflow tracking server every experiment reports its parameters, round metrics
    /// and final model to.
    pub mlflow_uri: Option<String>,
    /// A directory every experiment writes TensorBoard event files into
    /// (`DIR/<experiment name>-<id>/`).
    pub tensorboard: Option<PathBuf>,
    /// Where uploads and models are kept: an object store URL (`s3://bucket/prefix`,
    /// `gs://...`, `az://...`); `None` keeps them in `data_dir/blobs`.
    pub blob_store: Option<String>,
}

/// Why the settings cannot be used. Messages name the setting and, except for secrets,
/// the value.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The config file could not be read.
    #[error("cannot read config `{path}`: {source}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The config file is not valid TOML for these settings.
    #[error("invalid config `{path}`: {message}")]
    ParseFile {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the line when known.
        message: String,
    },
    /// An environment variable holds a value that cannot be parsed.
    #[error("invalid {var}: {message}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// What is wrong.
        message: String,
    },
    /// `--mlflow-uri` is not an HTTP address.
    #[error(
        "--mlflow-uri `{0}` is not an http:// or https:// address of an MLflow tracking server"
    )]
    InvalidMlflowUri(String),
    /// No TLS mode was chosen.
    #[error(
        "no TLS mode chosen: pick --dev-tls, --tls-cert FILE with --tls-key FILE, or --insecure-http"
    )]
    NoTlsMode,
    /// More than one TLS mode was chosen.
    #[error("conflicting TLS modes: {0} (choose exactly one)")]
    ConflictingTlsModes(String),
    /// Only one of the certificate and key files was given.
    #[error("{0} is set but {1} is not: both are needed for TLS from files")]
    IncompleteTlsFiles(&'static str, &'static str),
    /// The database URL has an unsupported scheme or no path.
    #[error("invalid database url `{url}`: {reason}")]
    InvalidDatabaseUrl {
        /// The URL as given.
        url: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// The admin token is too short to be safe. The token itself is never shown.
    #[error("admin token is too short ({len} characters): use at least {min}")]
    AdminTokenTooShort {
        /// Its length.
        len: usize,
        /// The minimum.
        min: usize,
    },
    /// A trusted proxy is not an IP address.
    #[error("trusted proxies: `{0}` is not an IP address (give a comma-separated list)")]
    InvalidTrustedProxy(String),
    /// The job lease is out of range.
    #[error("job lease: {0} seconds is out of range (3 to 86400)")]
    InvalidJobLease(u64),
    /// Mutual TLS was asked for without TLS.
    #[error("--client-ca needs TLS (--dev-tls or --tls-cert/--tls-key), not --insecure-http")]
    ClientCaWithoutTls,
    /// The body limit is zero.
    #[error("max body bytes must be at least 1")]
    ZeroMaxBodyBytes,
    /// The data directory is empty.
    #[error("data dir must not be empty")]
    EmptyDataDir,
    /// The current directory, needed to make a relative SQLite path absolute, is unknown.
    #[error("cannot resolve `{path}`: {source}")]
    ResolvePath {
        /// The path.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// Command-line flags of `cohort serve`. Each one, when given, overrides the same setting
/// from the environment and the config file.
#[derive(Debug, Clone, Default, PartialEq, clap::Args)]
pub struct ServeFlags {
    /// Address to listen on [env: COHORT_LISTEN] [default: 127.0.0.1:8443]
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Directory for TLS material, the admin token hash and the SQLite file
    /// [env: COHORT_DATA_DIR] [default: cohort-data]
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// sqlite://PATH (relative to the data dir) or postgres://...
    /// [env: COHORT_DATABASE_URL] [default: sqlite://cohort.db]
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
    /// Create (once) a self-signed CA and server certificate in DATA_DIR/tls/ and serve
    /// HTTPS with them [env: COHORT_DEV_TLS=1]
    #[arg(long)]
    pub dev_tls: bool,
    /// PEM certificate chain for HTTPS; needs --tls-key [env: COHORT_TLS_CERT]
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for HTTPS; needs --tls-cert [env: COHORT_TLS_KEY]
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Serve plain HTTP (only behind a TLS-terminating proxy) [env: COHORT_INSECURE_HTTP=1]
    #[arg(long)]
    pub insecure_http: bool,
    /// Admin token, at least 32 characters; prefer COHORT_ADMIN_TOKEN, since flags show
    /// up in process listings [default: generated and printed once at first start]
    #[arg(long, value_name = "TOKEN")]
    pub admin_token: Option<String>,
    /// Largest accepted request body in bytes [env: COHORT_MAX_BODY_BYTES] [default: 67108864]
    #[arg(long, value_name = "N")]
    pub max_body_bytes: Option<usize>,
    /// Where aggregation runs: auto (the GPU when a CUDA driver and device are present,
    /// else the CPU), cpu or cuda [env: COHORT_REDUCER] [default: auto]
    #[arg(long, value_name = "auto|cpu|cuda")]
    pub reducer: Option<cohort_aggregation::reduce::ReducerChoice>,
    /// Held-out labelled CSV (or .csv.gz) to evaluate each published model on, for the
    /// experiments whose features and classes match it [env: COHORT_EVAL_DATA]
    #[arg(long, value_name = "FILE")]
    pub eval_data: Option<PathBuf>,
    /// Mutual TLS: every client (edge clients, API callers, the dashboard's browser)
    /// must present a certificate issued by a CA in this PEM file [env: COHORT_CLIENT_CA]
    #[arg(long, value_name = "FILE")]
    pub client_ca: Option<PathBuf>,
    /// Enrolments per minute from one address, 0 for no limit [env: COHORT_ENROL_RATE]
    /// [default: 600]
    #[arg(long, value_name = "N")]
    pub enrol_rate: Option<u32>,
    /// Update uploads per minute from one client, 0 for no limit [env: COHORT_UPLOAD_RATE]
    /// [default: 120]
    #[arg(long, value_name = "N")]
    pub upload_rate: Option<u32>,
    /// Update uploads per minute from one address, all its clients together, 0 for no
    /// limit [env: COHORT_ADDRESS_UPLOAD_RATE] [default: 60000]
    #[arg(long, value_name = "N")]
    pub address_upload_rate: Option<u32>,
    /// A client's other messages per minute (secure-aggregation keys, shares and unmask
    /// answers, evaluation and failure reports), 0 for no limit [env: COHORT_MESSAGE_RATE]
    /// [default: 600]
    #[arg(long, value_name = "N")]
    pub message_rate: Option<u32>,
    /// Failed authentications per minute from one address (wrong admin tokens, client
    /// credentials and dashboard sign-ins together); past it the address gets 429 before
    /// its credentials are checked. 0 for no limit [env: COHORT_AUTH_FAILURE_RATE]
    /// [default: 120]
    #[arg(long, value_name = "N")]
    pub auth_failure_rate: Option<u32>,
    /// Failed dashboard sign-ins per minute to the admin account from all addresses
    /// together; past it every sign-in waits (the API's bearer token still works). 0 for
    /// no limit [env: COHORT_SIGN_IN_FAILURE_RATE] [default: 600]
    #[arg(long, value_name = "N")]
    pub sign_in_failure_rate: Option<u32>,
    /// Comma-separated IP addresses of load balancers in front of the coordinator: their
    /// requests count as coming from the address they name in X-Forwarded-For (for the
    /// per-address rate limits) [env: COHORT_TRUSTED_PROXIES]
    #[arg(long, value_name = "ADDRS")]
    pub trusted_proxies: Option<String>,
    /// Seconds a replica holds a claimed job between renewals; a job held by a replica
    /// that died is taken over after this [env: COHORT_JOB_LEASE_SECONDS] [default: 120]
    #[arg(long, value_name = "SECS")]
    pub job_lease_seconds: Option<u64>,
    /// Draw round cohorts from this seed, mixed with the round and attempt, so that a
    /// deployment's selections can be replayed (and compared with `cohort simulate`);
    /// by default they are unpredictable [env: COHORT_SELECTION_SEED]
    #[arg(long, value_name = "SEED")]
    pub selection_seed: Option<u64>,
    /// Log lines on standard error as text (colour only on a terminal, and never with
    /// NO_COLOR set) or one JSON object a line [env: COHORT_LOG_FORMAT] [default: text]
    #[arg(long, value_name = "text|json")]
    pub log_format: Option<super::logging::LogFormat>,
    /// Report every experiment's parameters, round metrics and final model to the MLflow
    /// tracking server at this address (MLflow experiment: the experiment's name; run:
    /// its name and id). A server that is down never stalls a round: records wait and
    /// are retried [env: COHORT_MLFLOW_URI]
    #[arg(long, value_name = "URL")]
    pub mlflow_uri: Option<String>,
    /// Write every experiment's parameters, round metrics and final model as TensorBoard
    /// event files into DIR/<experiment name>-<id>/ [env: COHORT_TENSORBOARD]
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Keep uploads and models in an object store instead of DATA_DIR/blobs:
    /// s3://BUCKET[/PREFIX] (credentials, region and endpoint from the AWS_* variables),
    /// gs://BUCKET[/PREFIX] or az://CONTAINER[/PREFIX]; replicas then share only the
    /// database and the bucket [env: COHORT_BLOB_STORE]
    #[arg(long, value_name = "URL")]
    pub blob_store: Option<String>,
}

/// `cohort serve`'s command line: an optional config file plus the flags.
#[derive(Debug, Clone, Default, PartialEq, clap::Args)]
pub struct ServeArgs {
    /// TOML file with any of the settings (kebab-case keys, e.g. `data-dir = "/srv/cohort"`)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The flags.
    #[command(flatten)]
    pub flags: ServeFlags,
}

/// One layer of settings: every key optional, so layers can be merged key by key.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct Layer {
    listen: Option<SocketAddr>,
    data_dir: Option<PathBuf>,
    database_url: Option<String>,
    dev_tls: Option<bool>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    insecure_http: Option<bool>,
    admin_token: Option<String>,
    max_body_bytes: Option<usize>,
    reducer: Option<cohort_aggregation::reduce::ReducerChoice>,
    eval_data: Option<PathBuf>,
    client_ca: Option<PathBuf>,
    enrol_rate: Option<u32>,
    upload_rate: Option<u32>,
    address_upload_rate: Option<u32>,
    message_rate: Option<u32>,
    auth_failure_rate: Option<u32>,
    sign_in_failure_rate: Option<u32>,
    trusted_proxies: Option<String>,
    job_lease_seconds: Option<u64>,
    selection_seed: Option<u64>,
    log_format: Option<super::logging::LogFormat>,
    mlflow_uri: Option<String>,
    tensorboard: Option<PathBuf>,
    blob_store: Option<String>,
}

impl Layer {
    /// Keys set in `over` replace those in `self`.
    fn merge(self, over: Layer) -> Layer {
        Layer {
            listen: over.listen.or(self.listen),
            data_dir: over.data_dir.or(self.data_dir),
            database_url: over.database_url.or(self.database_url),
            dev_tls: over.dev_tls.or(self.dev_tls),
            tls_cert: over.tls_cert.or(self.tls_cert),
            tls_key: over.tls_key.or(self.tls_key),
            insecure_http: over.insecure_http.or(self.insecure_http),
            admin_token: over.admin_token.or(self.admin_token),
            max_body_bytes: over.max_body_bytes.or(self.max_body_bytes),
            reducer: over.reducer.or(self.reducer),
            eval_data: over.eval_data.or(self.eval_data),
            client_ca: over.client_ca.or(self.client_ca),
            enrol_rate: over.enrol_rate.or(self.enrol_rate),
            upload_rate: over.upload_rate.or(self.upload_rate),
            address_upload_rate: over.address_upload_rate.or(self.address_upload_rate),
            message_rate: over.message_rate.or(self.message_rate),
            auth_failure_rate: over.auth_failure_rate.or(self.auth_failure_rate),
            sign_in_failure_rate: over.sign_in_failure_rate.or(self.sign_in_failure_rate),
            trusted_proxies: over.trusted_proxies.or(self.trusted_proxies),
            job_lease_seconds: over.job_lease_seconds.or(self.job_lease_seconds),
            selection_seed: over.selection_seed.or(self.selection_seed),
            log_format: over.log_format.or(self.log_format),
            mlflow_uri: over.mlflow_uri.or(self.mlflow_uri),
            tensorboard: over.tensorboard.or(self.tensorboard),
            blob_store: over.blob_store.or(self.blob_store),
        }
    }

    fn from_file(path: &Path) -> Result<Layer, SettingsError> {
        let text = std::fs::read_to_string(path).map_err(|source| SettingsError::ReadFile {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| {
            let line = e
                .span()
                .and_then(|span| text.get(..span.start))
                .map(|before| before.matches('\n').count() + 1);
            let msg = e.message().trim_end().to_string();
            SettingsError::ParseFile {
                path: path.to_path_buf(),
                message: match line {
                    Some(line) => format!("line {line}: {msg}"),
                    None => msg,
                },
            }
        })
    }

    fn from_env(env: &HashMap<String, String>) -> Result<Layer, SettingsError> {
        // An empty variable counts as unset, the way shells and compose files treat it.
        let get = |var: &str| env.get(var).map(String::as_str).filter(|v| !v.is_empty());
        let flag = |var: &'static str| -> Result<Option<bool>, SettingsError> {
            get(var)
                .map(|v| match v.to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" | "on" => Ok(true),
                    "0" | "false" | "no" | "off" => Ok(false),
                    _ => Err(SettingsError::InvalidEnv {
                        var,
                        message: format!("`{v}` is not a boolean (use 1 or 0)"),
                    }),
                })
                .transpose()
        };
        let rate = |var: &'static str| -> Result<Option<u32>, SettingsError> {
            get(var)
                .map(|v| {
                    v.parse().map_err(|_| SettingsError::InvalidEnv {
                        var,
                        message: format!("`{v}` is not a whole number per minute"),
                    })
                })
                .transpose()
        };
        Ok(Layer {
            listen: get("COHORT_LISTEN")
                .map(|v| {
                    v.parse().map_err(|_| SettingsError::InvalidEnv {
                        var: "COHORT_LISTEN",
                        message: format!("`{v}` is not an address such as 127.0.0.1:8443"),
                    })
                })
                .transpose()?,
            data_dir: get("COHORT_DATA_DIR").map(PathBuf::from),
            database_url: get("COHORT_DATABASE_URL").map(str::to_string),
            dev_tls: flag("COHORT_DEV_TLS")?,
            tls_cert: get("COHORT_TLS_CERT").map(PathBuf::from),
            tls_key: get("COHORT_TLS_KEY").map(PathBuf::from),
            insecure_http: flag("COHORT_INSECURE_HTTP")?,
            admin_token: get("COHORT_ADMIN_TOKEN").map(str::to_string),
            max_body_bytes: get("COHORT_MAX_BODY_BYTES")
                .map(|v| {
                    v.parse().map_err(|_| SettingsError::InvalidEnv {
                        var: "COHORT_MAX_BODY_BYTES",
                        message: format!("`{v}` is not a whole number of bytes"),
                    })
                })
                .transpose()?,
            reducer: get("COHORT_REDUCER")
                .map(|v| {
                    v.parse().map_err(|message| SettingsError::InvalidEnv {
                        var: "COHORT_REDUCER",
                        message,
                    })
                })
                .transpose()?,
            eval_data: get("COHORT_EVAL_DATA").map(PathBuf::from),
            client_ca: get("COHORT_CLIENT_CA").map(PathBuf::from),
            enrol_rate: rate("COHORT_ENROL_RATE")?,
            upload_rate: rate("COHORT_UPLOAD_RATE")?,
            address_upload_rate: rate("COHORT_ADDRESS_UPLOAD_RATE")?,
            message_rate: rate("COHORT_MESSAGE_RATE")?,
            auth_failure_rate: rate("COHORT_AUTH_FAILURE_RATE")?,
            sign_in_failure_rate: rate("COHORT_SIGN_IN_FAILURE_RATE")?,
            trusted_proxies: get("COHORT_TRUSTED_PROXIES").map(str::to_string),
            job_lease_seconds: get("COHORT_JOB_LEASE_SECONDS")
                .map(|v| {
                    v.parse().map_err(|_| SettingsError::InvalidEnv {
                        var: "COHORT_JOB_LEASE_SECONDS",
                        message: format!("expected whole seconds, got `{v}`"),
                    })
                })
                .transpose()?,
            selection_seed: get("COHORT_SELECTION_SEED")
                .map(|v| {
                    v.parse().map_err(|_| SettingsError::InvalidEnv {
                        var: "COHORT_SELECTION_SEED",
                        message: format!("expected a whole number from 0 to 2^64 - 1, got `{v}`"),
                    })
                })
                .transpose()?,
            log_format: get("COHORT_LOG_FORMAT")
                .map(|v| {
                    v.parse().map_err(|message| SettingsError::InvalidEnv {
                        var: "COHORT_LOG_FORMAT",
                        message,
                    })
                })
                .transpose()?,
            mlflow_uri: get("COHORT_MLFLOW_URI").map(str::to_string),
            tensorboard: get("COHORT_TENSORBOARD").map(PathBuf::from),
            blob_store: get("COHORT_BLOB_STORE").map(str::to_string),
        })
    }

    fn from_flags(flags: ServeFlags) -> Layer {
        Layer {
            listen: flags.listen,
            data_dir: flags.data_dir,
            database_url: flags.database_url,
            // A boolean flag can only switch a mode on; its absence leaves lower layers be.
            dev_tls: flags.dev_tls.then_some(true),
            tls_cert: flags.tls_cert,
            tls_key: flags.tls_key,
            insecure_http: flags.insecure_http.then_some(true),
            admin_token: flags.admin_token,
            max_body_bytes: flags.max_body_bytes,
            reducer: flags.reducer,
            eval_data: flags.eval_data,
            client_ca: flags.client_ca,
            enrol_rate: flags.enrol_rate,
            upload_rate: flags.upload_rate,
            address_upload_rate: flags.address_upload_rate,
            message_rate: flags.message_rate,
            auth_failure_rate: flags.auth_failure_rate,
            sign_in_failure_rate: flags.sign_in_failure_rate,
            trusted_proxies: flags.trusted_proxies,
            job_lease_seconds: flags.job_lease_seconds,
            selection_seed: flags.selection_seed,
            log_format: flags.log_format,
            mlflow_uri: flags.mlflow_uri,
            tensorboard: flags.tensorboard,
            blob_store: flags.blob_store,
        }
    }
}

impl ServeSettings {
    /// Loads and validates the settings from the real process environment and `args`.
    pub fn from_args(args: ServeArgs) -> Result<Self, SettingsError> {
        // `vars_os` rather than `vars`: a non-UTF-8 variable elsewhere in the environment
        // must not abort start-up; a non-UTF-8 `COHORT_*` one is refused by name.
        let mut env = HashMap::new();
        for (key, value) in std::env::vars_os() {
            let Some(key) = key.to_str() else { continue };
            if !key.starts_with("COHORT_") {
                continue;
            }
            let value = value.into_string().map_err(|_| SettingsError::InvalidEnv {
                var: known_var(key),
                message: "value is not valid UTF-8".into(),
            })?;
            env.insert(key.to_string(), value);
        }
        Self::from_sources(args.config.as_deref(), &env, args.flags)
    }

    /// Loads and validates the settings from an optional TOML file, a map of environment
    /// variables (only the `COHORT_*` keys are read) and the flags, in that order of
    /// precedence, lowest first.
    pub fn from_sources(
        file: Option<&Path>,
        env: &HashMap<String, String>,
        flags: ServeFlags,
    ) -> Result<Self, SettingsError> {
        let file_layer = match file {
            Some(path) => Layer::from_file(path)?,
            None => Layer::default(),
        };
        let merged = file_layer
            .merge(Layer::from_env(env)?)
            .merge(Layer::from_flags(flags));
        Self::validate(merged)
    }

    fn validate(layer: Layer) -> Result<Self, SettingsError> {
        let tls = tls_mode(&layer)?;
        let trusted_proxies = layer
            .trusted_proxies
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| {
                a.parse()
                    .map_err(|_| SettingsError::InvalidTrustedProxy(a.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if layer.client_ca.is_some() && tls == TlsMode::InsecureHttp {
            return Err(SettingsError::ClientCaWithoutTls);
        }
        let data_dir = layer
            .data_dir
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
        if data_dir.as_os_str().is_empty() {
            return Err(SettingsError::EmptyDataDir);
        }
        let database_url = resolve_database_url(
            layer
                .database_url
                .as_deref()
                .unwrap_or(DEFAULT_DATABASE_URL),
            &data_dir,
        )?;
        let admin_token = match layer.admin_token {
            Some(token) => {
                let len = token.chars().count();
                if len < MIN_ADMIN_TOKEN_LEN {
                    return Err(SettingsError::AdminTokenTooShort {
                        len,
                        min: MIN_ADMIN_TOKEN_LEN,
                    });
                }
                Some(Secret::new(token))
            }
            None => None,
        };
        let max_body_bytes = layer.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        if max_body_bytes == 0 {
            return Err(SettingsError::ZeroMaxBodyBytes);
        }
        let job_lease_seconds = layer.job_lease_seconds.unwrap_or(DEFAULT_JOB_LEASE_SECONDS);
        if !(MIN_JOB_LEASE_SECONDS..=86_400).contains(&job_lease_seconds) {
            return Err(SettingsError::InvalidJobLease(job_lease_seconds));
        }
        if let Some(uri) = &layer.mlflow_uri
            && crate::tracking::mlflow::check_uri(uri).is_err()
        {
            return Err(SettingsError::InvalidMlflowUri(uri.clone()));
        }
        let listen = layer.listen.unwrap_or_else(|| {
            DEFAULT_LISTEN
                .parse()
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 8443)))
        });
        Ok(ServeSettings {
            listen,
            data_dir,
            database_url,
            tls,
            admin_token,
            max_body_bytes,
            reducer: layer.reducer.unwrap_or_default(),
            eval_data: layer.eval_data,
            client_ca: layer.client_ca,
            trusted_proxies,
            job_lease: std::time::Duration::from_secs(job_lease_seconds),
            selection_seed: layer.selection_seed,
            log_format: layer.log_format.unwrap_or_default(),
            mlflow_uri: layer.mlflow_uri,
            tensorboard: layer.tensorboard,
            blob_store: layer.blob_store,
            rate_limits: {
                use super::rate_limit::{PerMinute, RateSettings};
                let d = RateSettings::default();
                RateSettings {
                    enrol_per_address: layer.enrol_rate.map_or(d.enrol_per_address, PerMinute),
                    uploads_per_client: layer.upload_rate.map_or(d.uploads_per_client, PerMinute),
                    uploads_per_address: layer
                        .address_upload_rate
                        .map_or(d.uploads_per_address, PerMinute),
                    messages_per_client: layer
                        .message_rate
                        .map_or(d.messages_per_client, PerMinute),
                    auth_failures_per_address: layer
                        .auth_failure_rate
                        .map_or(d.auth_failures_per_address, PerMinute),
                    sign_in_failures_per_account: layer
                        .sign_in_failure_rate
                        .map_or(d.sign_in_failures_per_account, PerMinute),
                }
            },
        })
    }
}

/// Maps an arbitrary `COHORT_*` name to the static name used in errors.
fn known_var(key: &str) -> &'static str {
    const KNOWN: [&str; 20] = [
        "COHORT_JOB_LEASE_SECONDS",
        "COHORT_MESSAGE_RATE",
        "COHORT_AUTH_FAILURE_RATE",
        "COHORT_SIGN_IN_FAILURE_RATE",
        "COHORT_TRUSTED_PROXIES",
        "COHORT_ENROL_RATE",
        "COHORT_UPLOAD_RATE",
        "COHORT_ADDRESS_UPLOAD_RATE",
        "COHORT_EVAL_DATA",
        "COHORT_CLIENT_CA",
        "COHORT_LISTEN",
        "COHORT_DATA_DIR",
        "COHORT_DATABASE_URL",
        "COHORT_DEV_TLS",
        "COHORT_TLS_CERT",
        "COHORT_TLS_KEY",
        "COHORT_INSECURE_HTTP",
        "COHORT_ADMIN_TOKEN",
        "COHORT_MAX_BODY_BYTES",
        "COHORT_REDUCER",
    ];
    KNOWN
        .iter()
        .copied()
        .find(|k| *k == key)
        .unwrap_or("COHORT_* variable")
}

/// Exactly one TLS mode, from the merged keys.
fn tls_mode(layer: &Layer) -> Result<TlsMode, SettingsError> {
    let dev = layer.dev_tls == Some(true);
    let insecure = layer.insecure_http == Some(true);
    let files = layer.tls_cert.is_some() || layer.tls_key.is_some();
    let chosen: Vec<&str> = [
        (dev, "--dev-tls"),
        (files, "--tls-cert/--tls-key"),
        (insecure, "--insecure-http"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect();
    match chosen.len() {
        0 => return Err(SettingsError::NoTlsMode),
        1 => {}
        _ => return Err(SettingsError::ConflictingTlsModes(chosen.join(" and "))),
    }
    if dev {
        return Ok(TlsMode::DevTls);
    }
    if insecure {
        return Ok(TlsMode::InsecureHttp);
    }
    match (&layer.tls_cert, &layer.tls_key) {
        (Some(cert), Some(key)) => Ok(TlsMode::Files {
            cert: cert.clone(),
            key: key.clone(),
        }),
        (Some(_), None) => Err(SettingsError::IncompleteTlsFiles("--tls-cert", "--tls-key")),
        _ => Err(SettingsError::IncompleteTlsFiles("--tls-key", "--tls-cert")),
    }
}

/// Checks the scheme, and turns a relative SQLite path into an absolute one inside
/// `data_dir`, so the store and every later reader agree on which file it is.
fn resolve_database_url(url: &str, data_dir: &Path) -> Result<String, SettingsError> {
    let invalid = |reason| SettingsError::InvalidDatabaseUrl {
        url: url.to_string(),
        reason,
    };
    if let Some(path) = url.strip_prefix("sqlite://") {
        if path.is_empty() {
            return Err(invalid("no file path after sqlite://"));
        }
        if path.contains('?') {
            return Err(invalid("query parameters are not supported"));
        }
        let path = Path::new(path);
        if path.is_absolute() {
            return Ok(url.to_string());
        }
        let joined = data_dir.join(path);
        let absolute =
            std::path::absolute(&joined).map_err(|source| SettingsError::ResolvePath {
                path: joined.clone(),
                source,
            })?;
        let text = absolute
            .to_str()
            .ok_or_else(|| invalid("the resolved path is not valid UTF-8"))?;
        return Ok(format!("sqlite://{text}"));
    }
    for scheme in ["postgres://", "postgresql://"] {
        if let Some(rest) = url.strip_prefix(scheme) {
            if rest.is_empty() {
                return Err(invalid("no host after the scheme"));
            }
            return Ok(url.to_string());
        }
    }
    Err(invalid(
        "expected sqlite://PATH, postgres://... or postgresql://...",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn insecure() -> ServeFlags {
        ServeFlags {
            insecure_http: true,
            ..ServeFlags::default()
        }
    }

    fn write_config(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, text.as_bytes()).unwrap();
        file
    }

    const TOKEN_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const TOKEN_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    #[test]
    fn defaults_apply_when_nothing_is_set() {
        let s = ServeSettings::from_sources(None, &env(&[]), insecure()).unwrap();
        assert_eq!(s.listen, "127.0.0.1:8443".parse().unwrap());
        assert_eq!(s.data_dir, PathBuf::from("cohort-data"));
        assert_eq!(s.tls, TlsMode::InsecureHttp);
        assert_eq!(s.admin_token, None);
        assert_eq!(s.max_body_bytes, 64 * 1024 * 1024);
        let expected = std::path::absolute("cohort-data/cohort.db").unwrap();
        assert_eq!(
            s.database_url,
            format!("sqlite://{}", expected.to_str().unwrap())
        );
    }

    #[test]
    fn flags_override_env_which_overrides_file() {
        let file = write_config(&format!(
            "listen = \"127.0.0.1:1000\"\ndata-dir = \"/from/file\"\nmax-body-bytes = 10\n\
             admin-token = \"{TOKEN_A}\"\ninsecure-http = true\n"
        ));
        let e = env(&[
            ("COHORT_LISTEN", "127.0.0.1:2000"),
            ("COHORT_DATA_DIR", "/from/env"),
            ("COHORT_ADMIN_TOKEN", TOKEN_B),
        ]);
        let flags = ServeFlags {
            listen: Some("127.0.0.1:3000".parse().unwrap()),
            ..ServeFlags::default()
        };
        let s = ServeSettings::from_sources(Some(file.path()), &e, flags).unwrap();
        assert_eq!(s.listen, "127.0.0.1:3000".parse().unwrap(), "flag wins");
        assert_eq!(s.data_dir, PathBuf::from("/from/env"), "env beats file");
        assert_eq!(s.admin_token, Some(Secret::new(TOKEN_B)), "env beats file");
        assert_eq!(s.max_body_bytes, 10, "file beats default");
        assert_eq!(s.tls, TlsMode::InsecureHttp, "file picks the TLS mode");
        assert_eq!(s.database_url, "sqlite:///from/env/cohort.db");
    }

    #[test]
    fn env_can_switch_off_a_tls_mode_from_the_file() {
        let file = write_config("dev-tls = true\n");
        let e = env(&[("COHORT_DEV_TLS", "0"), ("COHORT_INSECURE_HTTP", "1")]);
        let s = ServeSettings::from_sources(Some(file.path()), &e, ServeFlags::default()).unwrap();
        assert_eq!(s.tls, TlsMode::InsecureHttp);
    }

    #[test]
    fn tls_files_come_from_env_or_flags() {
        let e = env(&[("COHORT_TLS_CERT", "/c.pem"), ("COHORT_TLS_KEY", "/k.pem")]);
        let s = ServeSettings::from_sources(None, &e, ServeFlags::default()).unwrap();
        assert_eq!(
            s.tls,
            TlsMode::Files {
                cert: "/c.pem".into(),
                key: "/k.pem".into()
            }
        );
        let flags = ServeFlags {
            tls_key: Some("/flag-k.pem".into()),
            ..ServeFlags::default()
        };
        let s = ServeSettings::from_sources(None, &e, flags).unwrap();
        assert_eq!(
            s.tls,
            TlsMode::Files {
                cert: "/c.pem".into(),
                key: "/flag-k.pem".into()
            }
        );
    }

    #[test]
    fn the_job_lease_comes_from_any_layer_and_is_range_checked() {
        let s = ServeSettings::from_sources(None, &env(&[]), insecure()).unwrap();
        assert_eq!(s.job_lease, std::time::Duration::from_secs(120));
        let e = env(&[("COHORT_JOB_LEASE_SECONDS", "5")]);
        let s = ServeSettings::from_sources(None, &e, insecure()).unwrap();
        assert_eq!(s.job_lease, std::time::Duration::from_secs(5));
        let flags = ServeFlags {
            job_lease_seconds: Some(30),
            ..insecure()
        };
        let s = ServeSettings::from_sources(None, &e, flags).unwrap();
        assert_eq!(s.job_lease, std::time::Duration::from_secs(30));
        for bad in ["0", "2", "86401"] {
            let e = env(&[("COHORT_JOB_LEASE_SECONDS", bad)]);
            let err = ServeSettings::from_sources(None, &e, insecure()).unwrap_err();
            assert!(
                matches!(err, SettingsError::InvalidJobLease(_)),
                "{bad}: {err}"
            );
        }
        let e = env(&[("COHORT_JOB_LEASE_SECONDS", "soon")]);
        let err = ServeSettings::from_sources(None, &e, insecure()).unwrap_err();
        assert!(
            err.to_string().contains("COHORT_JOB_LEASE_SECONDS"),
            "{err}"
        );
    }

    /// The limits on messages and failed authentications come from any layer, with
    /// defaults that leave honest fleets alone, and 0 turns one off.
    #[test]
    fn message_and_failure_limits_come_from_any_layer() {
        use crate::server::rate_limit::PerMinute;
        let s = ServeSettings::from_sources(None, &env(&[]), insecure()).unwrap();
        assert_eq!(s.rate_limits.messages_per_client, PerMinute(600));
        assert_eq!(s.rate_limits.auth_failures_per_address, PerMinute(120));
        assert_eq!(s.rate_limits.sign_in_failures_per_account, PerMinute(600));
        let file = write_config("insecure-http = true\nmessage-rate = 5\n");
        let e = env(&[
            ("COHORT_AUTH_FAILURE_RATE", "7"),
            ("COHORT_SIGN_IN_FAILURE_RATE", "0"),
        ]);
        let flags = ServeFlags {
            auth_failure_rate: Some(9),
            ..ServeFlags::default()
        };
        let s = ServeSettings::from_sources(Some(file.path()), &e, flags).unwrap();
        assert_eq!(s.rate_limits.messages_per_client, PerMinute(5));
        assert_eq!(s.rate_limits.auth_failures_per_address, PerMinute(9));
        assert_eq!(s.rate_limits.sign_in_failures_per_account, PerMinute(0));
        let e = env(&[("COHORT_MESSAGE_RATE", "lots")]);
        let err = ServeSettings::from_sources(None, &e, insecure()).unwrap_err();
        assert!(err.to_string().contains("COHORT_MESSAGE_RATE"), "{err}");
    }

    #[test]
    fn trusted_proxies_are_a_list_of_addresses() {
        let e = env(&[("COHORT_TRUSTED_PROXIES", "10.0.0.2, ::1")]);
        let s = ServeSettings::from_sources(None, &e, insecure()).unwrap();
        assert_eq!(
            s.trusted_proxies,
            vec![
                "10.0.0.2".parse::<std::net::IpAddr>().unwrap(),
                "::1".parse().unwrap()
            ]
        );
        let e = env(&[("COHORT_TRUSTED_PROXIES", "10.0.0.2,nginx")]);
        let err = ServeSettings::from_sources(None, &e, insecure()).unwrap_err();
        assert!(
            matches!(err, SettingsError::InvalidTrustedProxy(ref a) if a == "nginx"),
            "{err}"
        );
        let s = ServeSettings::from_sources(None, &env(&[]), insecure()).unwrap();
        assert!(s.trusted_proxies.is_empty());
    }

    /// Mutual TLS is a TLS setting: from the file, the environment or the flags, and
    /// refused without TLS instead of silently serving without client certificates.
    #[test]
    fn client_ca_needs_tls() {
        let file = write_config("dev-tls = true\nclient-ca = \"/from/file.pem\"\n");
        let s = ServeSettings::from_sources(Some(file.path()), &env(&[]), ServeFlags::default())
            .unwrap();
        assert_eq!(s.client_ca, Some(PathBuf::from("/from/file.pem")));
        let e = env(&[("COHORT_CLIENT_CA", "/env.pem"), ("COHORT_DEV_TLS", "1")]);
        let s = ServeSettings::from_sources(None, &e, ServeFlags::default()).unwrap();
        assert_eq!(s.client_ca, Some(PathBuf::from("/env.pem")));
        let e = env(&[("COHORT_CLIENT_CA", "/env.pem")]);
        let err = ServeSettings::from_sources(None, &e, insecure()).unwrap_err();
        assert!(matches!(err, SettingsError::ClientCaWithoutTls), "{err}");
    }

    #[test]
    fn no_tls_mode_is_refused_with_the_choices() {
        let err = ServeSettings::from_sources(None, &env(&[]), ServeFlags::default()).unwrap_err();
        assert!(matches!(err, SettingsError::NoTlsMode));
        let msg = err.to_string();
        for choice in ["--dev-tls", "--tls-cert", "--tls-key", "--insecure-http"] {
            assert!(msg.contains(choice), "{msg}");
        }
    }

    #[test]
    fn two_tls_modes_conflict() {
        let flags = ServeFlags {
            dev_tls: true,
            insecure_http: true,
            ..ServeFlags::default()
        };
        let err = ServeSettings::from_sources(None, &env(&[]), flags).unwrap_err();
        assert!(
            matches!(err, SettingsError::ConflictingTlsModes(_)),
            "{err}"
        );
        assert!(err.to_string().contains("--dev-tls and --insecure-http"));

        let e = env(&[("COHORT_TLS_CERT", "/c.pem"), ("COHORT_TLS_KEY", "/k.pem")]);
        let flags = ServeFlags {
            dev_tls: true,
            ..ServeFlags::default()
        };
        let err = ServeSettings::from_sources(None, &e, flags).unwrap_err();
        assert!(
            matches!(err, SettingsError::ConflictingTlsModes(_)),
            "{err}"
        );
    }

    #[test]
    fn a_cert_without_a_key_is_refused() {
        let flags = ServeFlags {
            tls_cert: Some("/c.pem".into()),
            ..ServeFlags::default()
        };
        let err = ServeSettings::from_sources(None, &env(&[]), flags).unwrap_err();
        assert!(
            matches!(
                err,
                SettingsError::IncompleteTlsFiles("--tls-cert", "--tls-key")
            ),
            "{err}"
        );
    }

    #[test]
    fn database_url_schemes_are_checked() {
        for ok in [
            "postgres://db/cohort",
            "postgresql://u:p@db:5432/cohort",
            "sqlite:///var/lib/cohort.db",
        ] {
            let flags = ServeFlags {
                database_url: Some(ok.into()),
                ..insecure()
            };
            let s = ServeSettings::from_sources(None, &env(&[]), flags).unwrap();
            assert_eq!(
                s.database_url, ok,
                "absolute and server URLs are kept as given"
            );
        }
        for bad in [
            "mysql://db",
            "cohort.db",
            "sqlite://",
            "sqlite:cohort.db",
            "postgres://",
        ] {
            let flags = ServeFlags {
                database_url: Some(bad.into()),
                ..insecure()
            };
            let err = ServeSettings::from_sources(None, &env(&[]), flags).unwrap_err();
            assert!(
                matches!(err, SettingsError::InvalidDatabaseUrl { .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn relative_sqlite_path_lands_in_the_data_dir() {
        let flags = ServeFlags {
            data_dir: Some("/srv/cohort".into()),
            database_url: Some("sqlite://db/main.db".into()),
            ..insecure()
        };
        let s = ServeSettings::from_sources(None, &env(&[]), flags).unwrap();
        assert_eq!(s.database_url, "sqlite:///srv/cohort/db/main.db");
    }

    #[test]
    fn short_admin_token_is_refused_without_showing_it() {
        let e = env(&[("COHORT_ADMIN_TOKEN", "hunter2")]);
        let err = ServeSettings::from_sources(None, &e, insecure()).unwrap_err();
        assert!(matches!(
            err,
            SettingsError::AdminTokenTooShort { len: 7, min: 32 }
        ));
        assert!(!err.to_string().contains("hunter2"));
    }

    #[test]
    fn admin_token_never_appears_in_debug_output() {
        let e = env(&[("COHORT_ADMIN_TOKEN", TOKEN_A)]);
        let s = ServeSettings::from_sources(None, &e, insecure()).unwrap();
        assert!(!format!("{s:?}").contains(TOKEN_A));
    }

    #[test]
    fn zero_body_limit_is_refused() {
        let flags = ServeFlags {
            max_body_bytes: Some(0),
            ..insecure()
        };
        let err = ServeSettings::from_sources(None, &env(&[]), flags).unwrap_err();
        assert!(matches!(err, SettingsError::ZeroMaxBodyBytes));
    }

    #[test]
    fn bad_env_values_name_the_variable() {
        for (var, value) in [
            ("COHORT_LISTEN", "localhost"),
            ("COHORT_MAX_BODY_BYTES", "lots"),
            ("COHORT_DEV_TLS", "maybe"),
        ] {
            let err =
                ServeSettings::from_sources(None, &env(&[(var, value)]), insecure()).unwrap_err();
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn empty_env_values_count_as_unset() {
        let e = env(&[("COHORT_LISTEN", ""), ("COHORT_ADMIN_TOKEN", "")]);
        let s = ServeSettings::from_sources(None, &e, insecure()).unwrap();
        assert_eq!(s.admin_token, None);
        assert_eq!(s.listen, "127.0.0.1:8443".parse().unwrap());
    }

    #[test]
    fn unknown_config_keys_are_refused_with_the_line() {
        let file = write_config("insecure-http = true\nlisten_port = 8443\n");
        let err = ServeSettings::from_sources(Some(file.path()), &env(&[]), ServeFlags::default())
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, SettingsError::ParseFile { .. }));
        assert!(
            msg.contains("listen_port") && msg.contains("line 2"),
            "{msg}"
        );
    }

    #[test]
    fn missing_config_file_is_named() {
        let err = ServeSettings::from_sources(
            Some(Path::new("/no/such/cohort.toml")),
            &env(&[]),
            insecure(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("/no/such/cohort.toml"));
    }
}
