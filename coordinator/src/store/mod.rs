//! The system of record: experiments, enrolment tokens, clients, rounds, participations,
//! uploads, models, jobs and the audit log.
//!
//! One [`Store`] serves both backends: an SQLite file, the embedded default, and
//! PostgreSQL in production. Every query is written once (runtime queries with `$N`
//! placeholders in first-use order, which both engines read the same way) and run against
//! whichever pool is open; only the job claim differs, because PostgreSQL can skip rows
//! locked by another coordinator and SQLite serialises writers anyway. Times are Unix
//! milliseconds and ids are UUID text on both, so the row types are the same.
//!
//! Every method is one transaction: it either makes its whole change or returns an error
//! and changes nothing.

mod dashboard;
mod fedbuff;
mod identities;
mod jobs;
mod model_files;
mod rounds;
mod secagg;
mod telemetry;
mod tokens;
mod users;

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use uuid::Uuid;

pub use dashboard::{ClientPage, JobSummary, LatestAccuracy, SESSION_IDLE_MS, SessionHolder};
pub use fedbuff::{
    BufferRetry, BufferRules, Buffered, BufferedUpload, FedBuffDrops, FedBuffTask, StepStats,
};
pub use identities::{IDENTITY_BYTES, Registered};
use jobs::JobRow;
pub use jobs::{Job, JobKind, JobState};
pub use model_files::{ClientEvaluation, ModelFile, TaskFailure};
pub use rounds::{
    NewUpload, NoiseMechanism, Participation, ParticipationState, PendingTask, PublishedModel,
    Round, RoundKey, RoundMetrics, RoundPrivacy, RoundStage, Selection, Upload,
};
pub use secagg::{SecAggMessage, SecAggMessageKind, SecureNext};
pub use telemetry::StoreCounts;
pub use tokens::{Client, EnrolmentToken};
use tokens::{ClientRow, TokenRow};
pub use users::{Role, User};

static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/sqlite");
static POSTGRES_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/postgres");

/// Why a store operation failed. Nothing was changed when one of these is returned.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database URL is not one the store understands.
    #[error("unsupported database url `{0}`: expected sqlite://PATH or postgres://...")]
    UnsupportedUrl(String),
    /// A token or credential was refused (unknown, used, revoked or expired).
    #[error("{0}")]
    TokenRefused(&'static str),
    /// An upload was refused by the round's rules ([`cohort_core::round::check_upload`]),
    /// with nothing changed.
    #[error(transparent)]
    Refused(#[from] cohort_core::round::UploadRefusal),
    /// The row asked for does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// The change conflicts with the row's current state; the kind says how.
    #[error("{0}")]
    Conflict(Conflict),
    /// A stored value could not be read back (a bug or a hand-edited database).
    #[error("corrupt stored value: {0}")]
    Corrupt(String),
    /// The database itself failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
}

/// A change the store refused because of the row's current state: what kind of clash it
/// is (for the API to give each its own code) and a message naming the rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Conflict {
    /// What kind of clash.
    pub kind: ConflictKind,
    /// What clashed, for people.
    pub message: String,
}

impl std::ops::Deref for Conflict {
    type Target = str;

    /// The message: a conflict reads as what it says.
    fn deref(&self) -> &str {
        &self.message
    }
}

/// The kinds of [`Conflict`]. Those a request can meet reach the API, each as its own
/// error code; the rest only the driver meets (a race it lost, which it skips).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictKind {
    /// The experiment's state does not allow the change (start a finished experiment,
    /// resume one that is not paused).
    InvalidTransition,
    /// Another change to the same experiment got in between (which the row lock rules
    /// out; kept so that such a change is refused, never lost).
    ConcurrentChange,
    /// The experiment is not running, so it takes no rounds or updates.
    ExperimentNotRunning,
    /// FedBuff: no buffer is open (the last server step was taken, or none yet).
    NoBufferOpen,
    /// A round or buffer is already in progress (the driver lost a race to open one).
    RoundInProgress,
    /// The round moved on from the stage the change was for (the driver lost a race).
    StageMoved,
    /// A secure aggregation message for a round that does not run it.
    NotSecure,
    /// A secure aggregation message for a stage the round is not in.
    WrongStage,
    /// A secure aggregation message after its stage's deadline.
    StageDeadlinePassed,
    /// A secure aggregation message from a client not selected for the round.
    NotSelected,
    /// A client's second message of one stage.
    AlreadySent,
    /// A message from a client the round went on without (it missed a stage).
    NotAtStage,
    /// An enrolment token already used or revoked.
    TokenSpent,
    /// A client or user already revoked.
    AlreadyRevoked,
    /// A user's name that another user has.
    NameTaken,
    /// A client that has another identity registered.
    IdentityConflict,
    /// A job this worker does not hold (its lease ran out and another took it).
    JobNotHeld,
    /// An argument no caller should pass (a job with no attempts).
    InvalidArgument,
}

impl StoreError {
    /// A [`StoreError::Conflict`] of `kind`.
    pub fn conflict(kind: ConflictKind, message: impl Into<String>) -> Self {
        StoreError::Conflict(Conflict {
            kind,
            message: message.into(),
        })
    }
}

/// Which database engine a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// An SQLite file.
    Sqlite,
    /// A PostgreSQL server.
    Postgres,
}

#[derive(Debug, Clone)]
enum Pool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// Runs `$body` with `$pool` bound to the open pool, whichever backend it is. The body is
/// compiled once per backend, so one query text serves both.
macro_rules! with_pool {
    ($store:expr, $pool:ident => $body:expr) => {
        match &$store.pool {
            Pool::Sqlite($pool) => $body,
            Pool::Postgres($pool) => $body,
        }
    };
}
pub(crate) use with_pool;

tokio::task_local! {
    static ADMIN_ACTOR: String;
}

/// Runs `work` with `actor` as the "who" of the admin actions it audits: the request
/// guards name the channel (the API's bearer token or a dashboard session) and the
/// address, so that the audit log says more than "admin" without every store method
/// taking one more argument.
pub async fn acting_as<F: std::future::Future>(actor: String, work: F) -> F::Output {
    ADMIN_ACTOR.scope(actor, work).await
}

/// The actor of an admin action audited now: the one [`acting_as`] set for this
/// request, else `admin`.
pub(crate) fn admin_actor() -> String {
    ADMIN_ACTOR
        .try_with(Clone::clone)
        .unwrap_or_else(|_| "admin".to_string())
}

/// Appends an audit entry inside the caller's open transaction `$tx`.
macro_rules! audit {
    ($tx:expr, $at:expr, $actor:expr, $action:expr, $subject:expr, $detail:expr) => {
        sqlx::query(
            "INSERT INTO audit_log (at, actor, action, subject, detail) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind($at)
        .bind($actor)
        .bind($action)
        .bind($subject)
        .bind($detail)
        .execute(&mut *$tx)
        .await?
    };
}
pub(crate) use audit;

/// Inside the write transaction `$tx`: the state of experiment `$id` (its text id
/// `$text`), with its row locked by `$lock` ([`Store::for_update`]) so that concurrent
/// coordinators serialise on it. An unknown experiment returns `NotFound` from the caller.
macro_rules! experiment_state_for_update {
    ($tx:expr, $lock:expr, $text:expr, $id:expr) => {{
        let row: Option<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT state FROM experiments WHERE id = $1{}",
            $lock
        )))
        .bind($text)
        .fetch_optional(&mut *$tx)
        .await?;
        match row {
            Some((state,)) => state,
            None => return Err(StoreError::NotFound(format!("experiment {}", $id))),
        }
    }};
}
pub(crate) use experiment_state_for_update;

/// Opens a transaction that will write. SQLite takes its write lock at once
/// (`BEGIN IMMEDIATE`): a transaction that reads first and upgrades later fails with
/// "database is locked", without waiting, when another writer got in between.
pub(crate) trait BeginWrite {
    /// The database.
    type Db: sqlx::Database;
    /// Begins the transaction.
    fn begin_write(
        &self,
    ) -> impl std::future::Future<Output = Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>>
    + Send;
}

impl BeginWrite for SqlitePool {
    type Db = sqlx::Sqlite;
    fn begin_write(
        &self,
    ) -> impl std::future::Future<Output = Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>>
    + Send {
        let pool = self.clone();
        async move { pool.begin_with("BEGIN IMMEDIATE").await }
    }
}

impl BeginWrite for PgPool {
    type Db = sqlx::Postgres;
    fn begin_write(
        &self,
    ) -> impl std::future::Future<Output = Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>>
    + Send {
        let pool = self.clone();
        async move { pool.begin().await }
    }
}

/// The coordinator's database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: Pool,
}

impl Store {
    /// The row-lock clause for a `SELECT` that a transaction will act on. PostgreSQL runs
    /// transactions side by side (READ COMMITTED), so a read-then-write must lock the row
    /// it read, or two coordinators both act on the same stale state; SQLite's
    /// `BEGIN IMMEDIATE` already makes the whole transaction exclusive and has no such
    /// clause.
    pub(crate) fn for_update(&self) -> &'static str {
        match self.pool {
            Pool::Sqlite(_) => "",
            Pool::Postgres(_) => " FOR UPDATE",
        }
    }
}

/// Milliseconds since the Unix epoch, the time unit of every stored timestamp.
pub fn now_millis() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Lifecycle of an experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExperimentState {
    /// Created, not started.
    Created,
    /// Rounds are being scheduled.
    Running,
    /// No new round starts until resumed.
    Paused,
    /// Stopped by an admin before its last round.
    Stopped,
    /// All rounds done.
    Finished,
    /// Gave up (e.g. rounds kept failing).
    Failed,
}

impl ExperimentState {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            ExperimentState::Created => "created",
            ExperimentState::Running => "running",
            ExperimentState::Paused => "paused",
            ExperimentState::Stopped => "stopped",
            ExperimentState::Finished => "finished",
            ExperimentState::Failed => "failed",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "created" => ExperimentState::Created,
            "running" => ExperimentState::Running,
            "paused" => ExperimentState::Paused,
            "stopped" => ExperimentState::Stopped,
            "finished" => ExperimentState::Finished,
            "failed" => ExperimentState::Failed,
            other => return Err(StoreError::Corrupt(format!("experiment state `{other}`"))),
        })
    }

    /// States from which an admin action may move to `self`.
    pub fn allowed_from(self) -> &'static [ExperimentState] {
        use ExperimentState::*;
        match self {
            Running => &[Created, Paused],
            Paused => &[Running],
            Stopped => &[Created, Running, Paused],
            Finished | Failed => &[Running],
            Created => &[],
        }
    }
}

/// A stored experiment.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Experiment {
    /// Identifier.
    pub id: Uuid,
    /// Human name.
    pub name: String,
    /// Its settings, as given at creation (validated by the API layer).
    #[schema(value_type = cohort_core::ExperimentSpec)]
    pub spec: serde_json::Value,
    /// Lifecycle state.
    pub state: ExperimentState,
    /// Last round started (0 before the first).
    pub current_round: i64,
    /// Creation time, Unix ms.
    pub created_at: i64,
    /// Last change, Unix ms.
    pub updated_at: i64,
}

fn parse_uuid(text: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(text).map_err(|_| StoreError::Corrupt(format!("uuid `{text}`")))
}

/// An experiment row: id, name, spec, state, current_round, created_at, updated_at.
type ExperimentRow = (String, String, String, String, i64, i64, i64);

impl Experiment {
    fn from_row(row: ExperimentRow) -> Result<Self, StoreError> {
        let (id, name, spec, state, current_round, created_at, updated_at) = row;
        Ok(Experiment {
            id: parse_uuid(&id)?,
            name,
            spec: serde_json::from_str(&spec)
                .map_err(|e| StoreError::Corrupt(format!("experiment spec: {e}")))?,
            state: ExperimentState::parse(&state)?,
            current_round,
            created_at,
            updated_at,
        })
    }
}

impl Store {
    /// Opens (creating an SQLite file if missing) and migrates the database at `url`:
    /// `sqlite://PATH` (relative paths are taken inside `data_dir`) or `postgres://...`.
    pub async fn connect(url: &str, data_dir: &Path) -> Result<Self, StoreError> {
        if let Some(path) = url.strip_prefix("sqlite://") {
            let path = Path::new(path);
            let path = if path.is_absolute() {
                path.to_path_buf()
            } else {
                data_dir.join(path)
            };
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| {
                    StoreError::Database(sqlx::Error::Configuration(
                        format!("cannot create `{}`: {e}", parent.display()).into(),
                    ))
                })?;
            }
            let options = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .foreign_keys(true)
                .busy_timeout(Duration::from_secs(10));
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(options)
                .await?;
            return Self::migrated(Pool::Sqlite(pool)).await;
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let options = PgConnectOptions::from_str(url)?;
            return Self::connect_postgres(options).await;
        }
        Err(StoreError::UnsupportedUrl(url.to_string()))
    }

    /// Opens and migrates PostgreSQL with explicit options (tests use them to put each
    /// run in its own schema).
    pub async fn connect_postgres(options: PgConnectOptions) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        Self::migrated(Pool::Postgres(pool)).await
    }

    async fn migrated(pool: Pool) -> Result<Self, StoreError> {
        match &pool {
            Pool::Sqlite(p) => SQLITE_MIGRATIONS.run(p).await?,
            Pool::Postgres(p) => POSTGRES_MIGRATIONS.run(p).await?,
        }
        Ok(Self { pool })
    }

    /// The engine in use.
    pub fn backend(&self) -> Backend {
        match self.pool {
            Pool::Sqlite(_) => Backend::Sqlite,
            Pool::Postgres(_) => Backend::Postgres,
        }
    }

    /// Closes every connection.
    pub async fn close(&self) {
        with_pool!(self, p => p.close().await)
    }

    /// Records a new experiment in state `created`.
    pub async fn create_experiment(
        &self,
        name: &str,
        spec: &serde_json::Value,
    ) -> Result<Experiment, StoreError> {
        let now = now_millis();
        let exp = Experiment {
            id: Uuid::new_v4(),
            name: name.to_string(),
            spec: spec.clone(),
            state: ExperimentState::Created,
            current_round: 0,
            created_at: now,
            updated_at: now,
        };
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            sqlx::query(
                "INSERT INTO experiments (id, name, spec, state, current_round, created_at, updated_at) \
                 VALUES ($1, $2, $3, $4, 0, $5, $5)",
            )
            .bind(exp.id.to_string())
            .bind(&exp.name)
            .bind(spec.to_string())
            .bind(exp.state.as_str())
            .bind(now)
            .execute(&mut *tx)
            .await?;
            audit!(tx, now, admin_actor(), "experiment.create", exp.id.to_string(), &exp.name);
            tx.commit().await?;
        });
        Ok(exp)
    }

    /// The experiment with `id`.
    pub async fn experiment(&self, id: Uuid) -> Result<Experiment, StoreError> {
        let sql = "SELECT id, name, spec, state, current_round, created_at, updated_at \
                   FROM experiments WHERE id = $1";
        with_pool!(self, p => {
            let row: Option<ExperimentRow> =
                sqlx::query_as(sql).bind(id.to_string()).fetch_optional(p).await?;
            match row {
                Some(row) => Experiment::from_row(row),
                None => Err(StoreError::NotFound(format!("experiment {id}"))),
            }
        })
    }

    /// Every experiment, newest first.
    pub async fn experiments(&self) -> Result<Vec<Experiment>, StoreError> {
        let sql = "SELECT id, name, spec, state, current_round, created_at, updated_at \
                   FROM experiments ORDER BY created_at DESC, id";
        with_pool!(self, p => {
            let rows: Vec<ExperimentRow> = sqlx::query_as(sql).fetch_all(p).await?;
            rows.into_iter().map(Experiment::from_row).collect()
        })
    }

    /// Moves an experiment to `to` if its current state allows it
    /// ([`ExperimentState::allowed_from`]); a refused move is a [`StoreError::Conflict`]
    /// that names both states.
    pub async fn set_experiment_state(
        &self,
        id: Uuid,
        to: ExperimentState,
        actor: &str,
    ) -> Result<Experiment, StoreError> {
        self.set_experiment_state_because(id, to, actor, to.as_str())
            .await
    }

    /// [`set_experiment_state`](Self::set_experiment_state), with `detail` (why) in the
    /// audit log.
    pub async fn set_experiment_state_because(
        &self,
        id: Uuid,
        to: ExperimentState,
        actor: &str,
        detail: &str,
    ) -> Result<Experiment, StoreError> {
        let now = now_millis();
        // The row is locked while it is read, so that a concurrent change waits and then
        // sees this one's state: two admins pressing pause at once get one `paused` and
        // one `invalid_transition`, never a lost update.
        let lock = self.for_update();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let (state,): (String,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT state FROM experiments WHERE id = $1{lock}"
            )))
                .bind(id.to_string())
                .fetch_optional(&mut *tx)
                .await?
                .ok_or_else(|| StoreError::NotFound(format!("experiment {id}")))?;
            let from = ExperimentState::parse(&state)?;
            if !to.allowed_from().contains(&from) {
                return Err(StoreError::conflict(ConflictKind::InvalidTransition, format!(
                    "experiment {id} is {} and cannot become {}",
                    from.as_str(),
                    to.as_str()
                )));
            }
            // The state is re-checked in the update as well: with the row locked above this
            // cannot miss, and if it ever did, the change is refused, never lost.
            let done = sqlx::query(
                "UPDATE experiments SET state = $1, updated_at = $2 WHERE id = $3 AND state = $4",
            )
            .bind(to.as_str())
            .bind(now)
            .bind(id.to_string())
            .bind(from.as_str())
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() != 1 {
                return Err(StoreError::conflict(ConflictKind::ConcurrentChange, format!(
                    "experiment {id} changed state concurrently"
                )));
            }
            if to == ExperimentState::Stopped {
                // A stopped experiment takes nothing more: the attempt still collecting
                // (or in a secure stage) fails with it, so that no round of it reads as
                // running. One already aggregating holds only uploads taken before the
                // stop and may still publish.
                sqlx::query(
                    "UPDATE rounds SET stage = 'failed', finished_at = $1, \
                     failure = 'the experiment was stopped' \
                     WHERE experiment_id = $2 AND stage NOT IN ('published', 'failed', 'aggregating')",
                )
                .bind(now)
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
            }
            audit!(tx, now, actor, "experiment.state", id.to_string(), detail);
            tx.commit().await?;
        });
        self.experiment(id).await
    }

    /// The most recent audit entries, newest first.
    pub async fn audit_log(&self, limit: i64) -> Result<Vec<AuditEntry>, StoreError> {
        self.audit_page(limit, None).await
    }

    /// Up to `limit` audit entries older than entry `before` (all when `None`), newest
    /// first: pages through the log with the last id of the previous page.
    pub async fn audit_page(
        &self,
        limit: i64,
        before: Option<i64>,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(i64, i64, String, String, String, String)> = sqlx::query_as(
                "SELECT id, at, actor, action, subject, detail FROM audit_log \
                 WHERE id < $2 ORDER BY id DESC LIMIT $1",
            )
            .bind(limit)
            .bind(before.unwrap_or(i64::MAX))
            .fetch_all(p)
            .await?;
            Ok(rows
                .into_iter()
                .map(|(id, at, actor, action, subject, detail)| AuditEntry {
                    id,
                    at,
                    actor,
                    action,
                    subject,
                    detail,
                })
                .collect())
        })
    }
}

/// One line of the audit log.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct AuditEntry {
    /// Its place in the log: larger is newer.
    pub id: i64,
    /// When, Unix ms.
    pub at: i64,
    /// Who: the admin with the channel and address (`admin via api from 10.0.0.5`,
    /// `admin via dashboard session 1a2b3c4d from 10.0.0.5`: the first 8 hex digits of
    /// the session's stored hash), a client id, `coordinator`, or the job worker that
    /// finished a job.
    pub actor: String,
    /// What, e.g. `experiment.create`.
    pub action: String,
    /// The id acted on.
    pub subject: String,
    /// Free text; never a secret.
    pub detail: String,
}
