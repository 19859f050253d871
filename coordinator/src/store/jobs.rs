//! The job queue: aggregation, evaluation and publishing of a round are rows that a
//! worker claims under a lease, so several coordinators on one PostgreSQL never run the
//! same job twice, and a job whose worker died is picked up again when its lease runs out.

use serde::Serialize;
use uuid::Uuid;

use super::{BeginWrite, Pool, Store, StoreError, audit, now_millis, parse_uuid, with_pool};

/// What a job does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    /// Fold a round's uploads into the next global model.
    Aggregate,
    /// Evaluate a published model.
    Evaluate,
    /// Make an aggregated model the current one.
    Publish,
}

impl JobKind {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Aggregate => "aggregate",
            JobKind::Evaluate => "evaluate",
            JobKind::Publish => "publish",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "aggregate" => JobKind::Aggregate,
            "evaluate" => JobKind::Evaluate,
            "publish" => JobKind::Publish,
            other => return Err(StoreError::Corrupt(format!("job kind `{other}`"))),
        })
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for a worker (possibly until `run_after`).
    Queued,
    /// Claimed by a worker whose lease has not run out.
    Running,
    /// Finished.
    Done,
    /// Failed on its last allowed attempt.
    Failed,
}

impl JobState {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Failed => "failed",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "queued" => JobState::Queued,
            "running" => JobState::Running,
            "done" => JobState::Done,
            "failed" => JobState::Failed,
            other => return Err(StoreError::Corrupt(format!("job state `{other}`"))),
        })
    }
}

/// A job row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Job {
    /// Identifier.
    pub id: i64,
    /// What it does.
    pub kind: JobKind,
    /// The experiment it belongs to.
    pub experiment_id: Uuid,
    /// The round it belongs to.
    pub round: i64,
    /// Where it is.
    pub state: JobState,
    /// Claims so far.
    pub attempts: i64,
    /// Claims allowed before it fails for good.
    pub max_attempts: i64,
    /// Not claimable before this time, Unix ms (backoff after a failure).
    pub run_after: i64,
    /// The worker holding it.
    pub locked_by: Option<String>,
    /// When that worker's lease ends, Unix ms.
    pub locked_until: Option<i64>,
    /// The last failure's message.
    pub last_error: Option<String>,
}

pub(super) type JobRow = (
    i64,
    String,
    String,
    i64,
    String,
    i64,
    i64,
    i64,
    Option<String>,
    Option<i64>,
    Option<String>,
);

impl Job {
    pub(super) fn from_row(row: JobRow) -> Result<Self, StoreError> {
        let (id, kind, exp, round, state, attempts, max_attempts, run_after, by, until, err) = row;
        Ok(Self {
            id,
            kind: JobKind::parse(&kind)?,
            experiment_id: parse_uuid(&exp)?,
            round,
            state: JobState::parse(&state)?,
            attempts,
            max_attempts,
            run_after,
            locked_by: by,
            locked_until: until,
            last_error: err,
        })
    }
}

const JOB_COLUMNS_SQL: &str = "id, kind, experiment_id, round, state, attempts, max_attempts, \
                               run_after, locked_by, locked_until, last_error";

// A job is claimable when it is queued and due, or when its worker's lease ran out and it
// has attempts left. PostgreSQL skips rows another coordinator is claiming right now;
// SQLite has one writer at a time, so the plain sub-select is already exclusive.
const CLAIM_POSTGRES: &str = "UPDATE jobs SET state = 'running', attempts = attempts + 1, \
     locked_by = $1, locked_until = $2, updated_at = $3 \
     WHERE id = (SELECT id FROM jobs \
         WHERE attempts < max_attempts \
           AND ((state = 'queued' AND run_after <= $3) OR (state = 'running' AND locked_until < $3)) \
         ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) \
     RETURNING id, kind, experiment_id, round, state, attempts, max_attempts, \
               run_after, locked_by, locked_until, last_error";
const CLAIM_SQLITE: &str = "UPDATE jobs SET state = 'running', attempts = attempts + 1, \
     locked_by = $1, locked_until = $2, updated_at = $3 \
     WHERE id = (SELECT id FROM jobs \
         WHERE attempts < max_attempts \
           AND ((state = 'queued' AND run_after <= $3) OR (state = 'running' AND locked_until < $3)) \
         ORDER BY id LIMIT 1) \
     RETURNING id, kind, experiment_id, round, state, attempts, max_attempts, \
               run_after, locked_by, locked_until, last_error";

/// Queues a job (kind, experiment, round, max attempts, now), claimable at once; shared by
/// [`Store::enqueue_job`] and the transactions that queue a job with another change.
pub(super) const ENQUEUE_JOB_SQL: &str = "INSERT INTO jobs (kind, experiment_id, round, state, \
     attempts, max_attempts, run_after, created_at, updated_at) \
     VALUES ($1, $2, $3, 'queued', 0, $4, $5, $5, $5)";

impl Store {
    /// Queues a job, claimable at once.
    pub async fn enqueue_job(
        &self,
        kind: JobKind,
        experiment_id: Uuid,
        round: i64,
        max_attempts: i64,
    ) -> Result<Job, StoreError> {
        if max_attempts < 1 {
            return Err(StoreError::conflict(
                super::ConflictKind::InvalidArgument,
                format!("a job needs at least one attempt, got {max_attempts}"),
            ));
        }
        let now = now_millis();
        with_pool!(self, p => {
            let (id,): (i64,) = sqlx::query_as(
                sqlx::AssertSqlSafe(format!("{ENQUEUE_JOB_SQL} RETURNING id")),
            )
            .bind(kind.as_str())
            .bind(experiment_id.to_string())
            .bind(round)
            .bind(max_attempts)
            .bind(now)
            .fetch_one(p)
            .await?;
            Ok(Job {
                id,
                kind,
                experiment_id,
                round,
                state: JobState::Queued,
                attempts: 0,
                max_attempts,
                run_after: now,
                locked_by: None,
                locked_until: None,
                last_error: None,
            })
        })
    }

    /// Claims the oldest claimable job for `worker` until `now + lease_ms`, or `None`.
    pub async fn claim_job(
        &self,
        worker: &str,
        now: i64,
        lease_ms: i64,
    ) -> Result<Option<Job>, StoreError> {
        let sql = match self.pool {
            Pool::Sqlite(_) => CLAIM_SQLITE,
            Pool::Postgres(_) => CLAIM_POSTGRES,
        };
        debug_assert!(sql.ends_with(JOB_COLUMNS_SQL));
        with_pool!(self, p => {
            let row: Option<JobRow> = sqlx::query_as(sql)
                .bind(worker)
                .bind(now + lease_ms)
                .bind(now)
                .fetch_optional(p)
                .await?;
            row.map(Job::from_row).transpose()
        })
    }

    /// Extends `worker`'s lease on a running job to `until` (Unix ms), so that a job
    /// that runs longer than one lease is not taken over while its worker is alive.
    /// Fails with a conflict if `worker` no longer holds it.
    pub async fn renew_job(&self, id: i64, worker: &str, until: i64) -> Result<(), StoreError> {
        let renewed = with_pool!(self, p => {
            sqlx::query(
                "UPDATE jobs SET locked_until = $1 \
                 WHERE id = $2 AND state = 'running' AND locked_by = $3",
            )
            .bind(until)
            .bind(id)
            .bind(worker)
            .execute(p)
            .await?
            .rows_affected()
        });
        if renewed == 0 {
            return Err(StoreError::conflict(
                super::ConflictKind::JobNotHeld,
                format!("job {id} is not held by {worker}"),
            ));
        }
        Ok(())
    }

    /// Marks a job done, and writes who ran it to the audit log. Fails with a conflict if
    /// `worker` no longer holds it (its lease ran out and another worker took over), so a
    /// slow worker cannot finish twice.
    pub async fn complete_job(&self, id: i64, worker: &str) -> Result<(), StoreError> {
        let now = now_millis();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let done: Option<(String, String, i64)> = sqlx::query_as(
                "UPDATE jobs SET state = 'done', locked_by = NULL, locked_until = NULL, updated_at = $1 \
                 WHERE id = $2 AND state = 'running' AND locked_by = $3 \
                 RETURNING kind, experiment_id, round",
            )
            .bind(now)
            .bind(id)
            .bind(worker)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((kind, experiment, round)) = done else {
                return Err(StoreError::conflict(super::ConflictKind::JobNotHeld, format!("job {id} is not held by {worker}")));
            };
            audit!(tx, now, worker, "job.done", experiment.as_str(), format!("job {id}: {kind} of round {round}"));
            tx.commit().await?;
        });
        Ok(())
    }

    /// Records a failed attempt: the job is queued again after `retry_after_ms`, or fails
    /// for good when it has used all its attempts.
    pub async fn fail_job(
        &self,
        id: i64,
        worker: &str,
        error: &str,
        now: i64,
        retry_after_ms: i64,
    ) -> Result<Job, StoreError> {
        with_pool!(self, p => {
            let row: Option<JobRow> = sqlx::query_as(
                "UPDATE jobs SET \
                   state = CASE WHEN attempts < max_attempts THEN 'queued' ELSE 'failed' END, \
                   run_after = $1, last_error = $2, locked_by = NULL, locked_until = NULL, \
                   updated_at = $3 \
                 WHERE id = $4 AND state = 'running' AND locked_by = $5 \
                 RETURNING id, kind, experiment_id, round, state, attempts, max_attempts, \
                           run_after, locked_by, locked_until, last_error",
            )
            .bind(now + retry_after_ms)
            .bind(error)
            .bind(now)
            .bind(id)
            .bind(worker)
            .fetch_optional(p)
            .await?;
            row.ok_or_else(|| StoreError::conflict(super::ConflictKind::JobNotHeld, format!("job {id} is not held by {worker}")))
                .and_then(Job::from_row)
        })
    }

    /// The jobs of an experiment, oldest first.
    pub async fn jobs(&self, experiment_id: Uuid) -> Result<Vec<Job>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<JobRow> = sqlx::query_as(
                "SELECT id, kind, experiment_id, round, state, attempts, max_attempts, \
                 run_after, locked_by, locked_until, last_error FROM jobs \
                 WHERE experiment_id = $1 ORDER BY id",
            )
            .bind(experiment_id.to_string())
            .fetch_all(p)
            .await?;
            rows.into_iter().map(Job::from_row).collect()
        })
    }
}
