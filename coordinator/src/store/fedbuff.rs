//! FedBuff's buffers (buffered asynchronous aggregation) on the rounds, participations and
//! uploads tables.
//!
//! Round `r` of a FedBuff experiment is the buffer that becomes model version `r`; it is
//! `collecting` while it fills, `aggregating` once it holds `buffer_size` updates, and
//! `published` when version `r` is out. Exactly one buffer collects at a time: the upload
//! that fills buffer `r` opens buffer `r + 1` in the same transaction (and queues `r`'s
//! aggregation job), so the next server step never waits for a slow client or for the
//! aggregation. A participation row is one task handed to a client (always attempt 1 of
//! the round whose buffer was open then) and carries the model version the client
//! trains on; its upload is folded into whichever buffer is open when it arrives, and
//! the upload row records that buffer and the update's staleness.
//!
//! Hand-out and upload both lock the experiment's row first (PostgreSQL; SQLite's
//! `BEGIN IMMEDIATE` serialises every writer anyway), so concurrent check-ins never hand
//! out more than the concurrency allows and concurrent uploads never overfill a buffer
//! or close it twice, whichever coordinator serves them.

use cohort_core::round::{FedBuffTaskView, check_fedbuff_upload};
use serde::Serialize;
use uuid::Uuid;

use super::{
    BeginWrite, NewUpload, Pool, Store, StoreError, Upload, audit, experiment_state_for_update,
    parse_uuid, with_pool,
};

/// A task handed to a client in a FedBuff experiment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FedBuffTask {
    /// The experiment.
    pub experiment_id: Uuid,
    /// The round (buffer) that was open when the task was handed out; with `attempt`, it
    /// names the task in the upload path.
    pub round: i64,
    /// Always 1: tasks go to the collecting buffer, whose first attempt it is (only an
    /// aggregation that failed runs again, as a later attempt).
    pub attempt: i64,
    /// The model version (published round) the client trains on.
    pub base_version: i64,
    /// The task expires (its slot frees) at this time, Unix ms.
    pub deadline: i64,
}

/// How a FedBuff experiment's buffers take uploads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferRules {
    /// Updates per server step (K).
    pub buffer_size: i64,
    /// Updates staler than this are dropped instead of buffered.
    pub max_staleness: Option<i64>,
    /// How long a task may take, ms; an older task has expired.
    pub task_ms: i64,
    /// The last server step: the buffer of this round opens no successor.
    pub last_step: i64,
    /// Attempts the aggregation job of a full buffer gets.
    pub job_attempts: i64,
}

/// What followed a buffer whose aggregation failed for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferRetry {
    /// The buffer aggregates again as this attempt.
    Retried {
        /// The new attempt.
        attempt: i64,
    },
    /// That was the buffer's last attempt: the experiment failed.
    ExperimentFailed,
}

/// What became of a FedBuff upload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Buffered {
    /// Recorded in buffer `buffer`; `closed` when it was the update that filled it.
    Accepted {
        /// The recorded upload.
        upload: Upload,
        /// The buffer (round) it went into.
        buffer: i64,
        /// Server steps between its base version and the model it is applied to.
        staleness: i64,
        /// It filled the buffer, which now aggregates.
        closed: bool,
    },
    /// Staler than `max_staleness`: the task is recorded as dropped (`stale`), the update
    /// is not buffered.
    TooStale {
        /// Its staleness.
        staleness: i64,
        /// The most allowed.
        max_staleness: i64,
    },
}

/// A buffered upload with what the aggregation weighs it by.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferedUpload {
    /// The upload.
    pub upload: Upload,
    /// The model version its client trained on.
    pub base_version: i64,
    /// Server steps between that version and the model it is applied to.
    pub staleness: i64,
    /// The client's mean training loss.
    pub train_loss: Option<f64>,
}

/// One server step's buffer, for reports.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StepStats {
    /// The step (round, model version it produces).
    pub step: i64,
    /// Updates buffered.
    pub updates: i64,
    /// Buffered updates trained on an older version than the one they were applied to.
    pub stale_updates: i64,
    /// Mean staleness of the buffered updates.
    pub mean_staleness: f64,
    /// Largest staleness in the buffer.
    pub max_staleness: i64,
}

/// Tasks of a FedBuff experiment that ended without a buffered update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, utoipa::ToSchema)]
pub struct FedBuffDrops {
    /// Uploads refused as staler than `max_staleness`.
    pub too_stale: i64,
    /// Tasks that expired (no upload within `collect_deadline_seconds`).
    pub expired: i64,
}

/// participations: round, attempt, base_version, selected_at.
type TaskRow = (i64, i64, i64, i64);

/// Marks the experiment's tasks handed out before `$before` and still outstanding as
/// dropped (`expired`), counting them on the rounds they were handed out in. Runs inside
/// the caller's transaction `$tx`.
macro_rules! expire_tasks {
    ($tx:expr, $exp:expr, $before:expr) => {{
        sqlx::query(
            "UPDATE rounds SET dropped = dropped + (SELECT COUNT(*) FROM participations p \
               WHERE p.experiment_id = rounds.experiment_id AND p.round = rounds.round \
               AND p.attempt = rounds.attempt AND p.state = 'selected' \
               AND p.base_version IS NOT NULL AND p.selected_at < $1) \
             WHERE experiment_id = $2 AND round IN (SELECT round FROM participations \
               WHERE experiment_id = $2 AND state = 'selected' AND base_version IS NOT NULL \
               AND selected_at < $1)",
        )
        .bind($before)
        .bind($exp)
        .execute(&mut *$tx)
        .await?;
        sqlx::query(
            "UPDATE participations SET state = 'dropped', dropped_stage = 'expired' \
             WHERE experiment_id = $1 AND state = 'selected' AND base_version IS NOT NULL \
             AND selected_at < $2",
        )
        .bind($exp)
        .bind($before)
        .execute(&mut *$tx)
        .await?
        .rows_affected()
    }};
}

/// Inserts buffer `$round` (attempt 1, collecting, no deadline: a buffer waits for its
/// updates however long they take) and makes it the experiment's current round, inside
/// the caller's transaction `$tx`.
macro_rules! insert_buffer {
    ($tx:expr, $exp:expr, $round:expr, $now:expr) => {{
        sqlx::query(
            "INSERT INTO rounds (experiment_id, round, attempt, stage, selected, started_at) \
             VALUES ($1, $2, 1, 'collecting', 0, $3)",
        )
        .bind(&$exp)
        .bind($round)
        .bind($now)
        .execute(&mut *$tx)
        .await?;
        sqlx::query("UPDATE experiments SET current_round = $1, updated_at = $2 WHERE id = $3")
            .bind($round)
            .bind($now)
            .bind(&$exp)
            .execute(&mut *$tx)
            .await?;
    }};
}

/// Drops the FedBuff task of `client` in `round` `attempt` as too stale, counted on the
/// round. A macro, as it runs in either backend's transaction.
macro_rules! drop_stale_task {
    ($tx:expr, $exp:expr, $round:expr, $attempt:expr, $client:expr) => {{
        sqlx::query(
            "UPDATE participations SET state = 'dropped', dropped_stage = 'stale' \
             WHERE experiment_id = $1 AND round = $2 AND attempt = $3 AND client_id = $4",
        )
        .bind(&$exp)
        .bind($round)
        .bind($attempt)
        .bind(&$client)
        .execute(&mut *$tx)
        .await?;
        sqlx::query(
            "UPDATE rounds SET dropped = dropped + 1 \
             WHERE experiment_id = $1 AND round = $2 AND attempt = $3",
        )
        .bind(&$exp)
        .bind($round)
        .bind($attempt)
        .execute(&mut *$tx)
        .await?;
    }};
}

/// Marks the task of `client` in `round` `attempt` uploaded and records its update, going
/// into `buffer` with `staleness`, under upload id `id` (audited when its weight was
/// capped). A macro, as it runs in either backend's transaction.
macro_rules! store_buffered_upload {
    ($tx:expr, $exp:expr, $round:expr, $attempt:expr, $client:expr, $id:expr, $upload:expr,
     $buffer:expr, $staleness:expr, $now:expr) => {{
        sqlx::query(
            "UPDATE participations SET state = 'uploaded', uploaded_at = $1, num_samples = $2, \
             train_loss = $3 WHERE experiment_id = $4 AND round = $5 AND attempt = $6 \
             AND client_id = $7",
        )
        .bind($now)
        .bind($upload.num_samples)
        .bind($upload.train_loss)
        .bind(&$exp)
        .bind($round)
        .bind($attempt)
        .bind(&$client)
        .execute(&mut *$tx)
        .await?;
        sqlx::query(
            "INSERT INTO uploads (id, experiment_id, round, attempt, client_id, blob_path, \
             bytes, sha256, created_at, num_samples, buffer_round, staleness, \
             client_upload_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        )
        .bind($id.to_string())
        .bind(&$exp)
        .bind($round)
        .bind($attempt)
        .bind(&$client)
        .bind($upload.blob_path)
        .bind($upload.bytes)
        .bind($upload.sha256)
        .bind($now)
        .bind($upload.num_samples)
        .bind($buffer)
        .bind($staleness)
        .bind($upload.client_upload_id.map(|u| u.to_string()))
        .execute(&mut *$tx)
        .await?;
        if let Some(claimed) = $upload.claimed_samples {
            audit!(
                $tx,
                $now,
                &$client,
                "upload.weight_capped",
                $exp.as_str(),
                super::rounds::capped_detail($round, $attempt, claimed, $upload.num_samples)
            );
        }
    }};
}

/// Counts one more update into the collecting `buffer` (which held `reported`); when it
/// is `closed` (full), the buffer aggregates: its job is queued and, unless it was the
/// last step, the next buffer opens, all in the same transaction.
macro_rules! count_into_buffer {
    ($tx:expr, $exp:expr, $buffer:expr, $reported:expr, $closed:expr, $rules:expr, $now:expr) => {{
        sqlx::query(
            "UPDATE rounds SET reported = reported + 1, \
             stage = CASE WHEN $1 THEN 'aggregating' ELSE stage END \
             WHERE experiment_id = $2 AND round = $3 AND attempt = 1",
        )
        .bind($closed)
        .bind(&$exp)
        .bind($buffer)
        .execute(&mut *$tx)
        .await?;
        if $closed {
            sqlx::query(super::jobs::ENQUEUE_JOB_SQL)
                .bind(super::JobKind::Aggregate.as_str())
                .bind(&$exp)
                .bind($buffer)
                .bind($rules.job_attempts)
                .bind($now)
                .execute(&mut *$tx)
                .await?;
            if $buffer < $rules.last_step {
                insert_buffer!($tx, $exp, $buffer + 1, $now);
            }
            audit!(
                $tx,
                $now,
                "coordinator",
                "buffer.close",
                $exp.as_str(),
                format!("buffer {}: {} updates", $buffer, $reported + 1)
            );
        }
    }};
}

impl Store {
    /// Opens a FedBuff experiment's first buffer, round `round`. The experiment must be
    /// running and have no buffer collecting; later buffers open as their predecessors
    /// fill.
    pub async fn open_buffer(
        &self,
        experiment_id: Uuid,
        round: i64,
        now: i64,
    ) -> Result<(), StoreError> {
        let exp = experiment_id.to_string();
        let lock = self.for_update();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let state = experiment_state_for_update!(tx, lock, &exp, experiment_id);
            if state != "running" {
                return Err(StoreError::conflict(super::ConflictKind::ExperimentNotRunning, format!(
                    "experiment {experiment_id} is {state}, not running"
                )));
            }
            let (open,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM rounds WHERE experiment_id = $1 AND stage = 'collecting'",
            )
            .bind(&exp)
            .fetch_one(&mut *tx)
            .await?;
            if open > 0 {
                return Err(StoreError::conflict(super::ConflictKind::RoundInProgress, format!(
                    "experiment {experiment_id} already has a buffer open"
                )));
            }
            insert_buffer!(tx, exp, round, now);
            audit!(tx, now, "coordinator", "buffer.open", exp.as_str(), format!("buffer {round}"));
            tx.commit().await?;
        });
        Ok(())
    }

    /// The task `client` holds in FedBuff experiment `experiment_id`, or a new one when it
    /// holds none, `hand_out` is set, the experiment is running, a buffer is open and
    /// fewer than `concurrency` tasks are outstanding. Tasks older than `task_ms` expire
    /// first and free their slots. `None` when the client gets no task.
    pub async fn fedbuff_task(
        &self,
        experiment_id: Uuid,
        client: Uuid,
        concurrency: i64,
        task_ms: i64,
        hand_out: bool,
        now: i64,
    ) -> Result<Option<FedBuffTask>, StoreError> {
        let exp = experiment_id.to_string();
        let client_text = client.to_string();
        let before = now - task_ms;
        let lock = self.for_update();
        let task = |(round, attempt, base_version, selected_at): TaskRow| FedBuffTask {
            experiment_id,
            round,
            attempt,
            base_version,
            deadline: selected_at + task_ms,
        };
        with_pool!(self, p => {
            // Clients long-poll: answer the common "nothing for you" without taking the
            // write lock.
            let (mine, outstanding): (i64, i64) = sqlx::query_as(
                "SELECT COALESCE(SUM(CASE WHEN client_id = $1 THEN 1 ELSE 0 END), 0), COUNT(*) \
                 FROM participations WHERE experiment_id = $2 AND state = 'selected' \
                 AND base_version IS NOT NULL AND selected_at >= $3",
            )
            .bind(&client_text)
            .bind(&exp)
            .bind(before)
            .fetch_one(p)
            .await?;
            if mine == 0 && (!hand_out || outstanding >= concurrency) {
                return Ok(None);
            }
            let mut tx = p.begin_write().await?;
            let state = experiment_state_for_update!(tx, lock, &exp, experiment_id);
            expire_tasks!(tx, &exp, before);
            let held: Option<TaskRow> = sqlx::query_as(
                "SELECT round, attempt, base_version, selected_at FROM participations \
                 WHERE experiment_id = $1 AND client_id = $2 AND state = 'selected' \
                 AND base_version IS NOT NULL ORDER BY selected_at DESC LIMIT 1",
            )
            .bind(&exp)
            .bind(&client_text)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(row) = held {
                tx.commit().await?;
                return Ok(Some(task(row)));
            }
            if !hand_out || state != "running" {
                tx.commit().await?;
                return Ok(None);
            }
            let buffer: Option<(i64,)> = sqlx::query_as(
                "SELECT round FROM rounds WHERE experiment_id = $1 AND stage = 'collecting'",
            )
            .bind(&exp)
            .fetch_optional(&mut *tx)
            .await?;
            let (outstanding,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM participations WHERE experiment_id = $1 \
                 AND state = 'selected' AND base_version IS NOT NULL",
            )
            .bind(&exp)
            .fetch_one(&mut *tx)
            .await?;
            let version: (Option<i64>,) =
                sqlx::query_as("SELECT MAX(round) FROM models WHERE experiment_id = $1")
                    .bind(&exp)
                    .fetch_one(&mut *tx)
                    .await?;
            let (Some((buffer,)), Some(version)) = (buffer, version.0) else {
                tx.commit().await?;
                return Ok(None);
            };
            if outstanding >= concurrency {
                tx.commit().await?;
                return Ok(None);
            }
            sqlx::query(
                "INSERT INTO participations (experiment_id, round, attempt, client_id, state, \
                 selected_at, base_version) VALUES ($1, $2, 1, $3, 'selected', $4, $5)",
            )
            .bind(&exp)
            .bind(buffer)
            .bind(&client_text)
            .bind(now)
            .bind(version)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE rounds SET selected = selected + 1 \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = 1",
            )
            .bind(&exp)
            .bind(buffer)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(Some(task((buffer, 1, version, now))))
        })
    }

    /// Marks the experiment's FedBuff tasks handed out before `before` (Unix ms) and not
    /// uploaded as expired; returns how many.
    pub async fn expire_fedbuff_tasks(
        &self,
        experiment_id: Uuid,
        before: i64,
    ) -> Result<u64, StoreError> {
        let exp = experiment_id.to_string();
        with_pool!(self, p => {
            let (due,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM participations WHERE experiment_id = $1 \
                 AND state = 'selected' AND base_version IS NOT NULL AND selected_at < $2",
            )
            .bind(&exp)
            .bind(before)
            .fetch_one(p)
            .await?;
            if due == 0 {
                return Ok(0);
            }
            let mut tx = p.begin_write().await?;
            let expired = expire_tasks!(tx, &exp, before);
            tx.commit().await?;
            Ok(expired)
        })
    }

    /// Records that `client` downloaded model `version` for its outstanding FedBuff task
    /// in the experiment: the version its update will be trained on (a step may have been
    /// published between the hand-out and the download).
    pub async fn note_base_version(
        &self,
        experiment_id: Uuid,
        client: Uuid,
        version: i64,
    ) -> Result<(), StoreError> {
        with_pool!(self, p => {
            sqlx::query(
                "UPDATE participations SET base_version = $1 WHERE experiment_id = $2 \
                 AND client_id = $3 AND state = 'selected' AND base_version IS NOT NULL \
                 AND base_version < $1",
            )
            .bind(version)
            .bind(experiment_id.to_string())
            .bind(client.to_string())
            .execute(p)
            .await?;
        });
        Ok(())
    }

    /// Records a durable FedBuff upload for the task of round `round`, attempt `attempt`
    /// into the buffer open now, whichever version the task trained on. Refused, with
    /// nothing changed, when the client holds no such outstanding task, the task has
    /// expired, the experiment is neither running nor paused, or no buffer is open (the
    /// experiment has published its last step). An
    /// update staler than the rules allow is not buffered and its task is recorded as
    /// dropped. The upload that fills the buffer moves it to aggregating, queues its
    /// aggregation job and opens the next buffer, all in the same transaction.
    pub async fn record_fedbuff_upload(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        upload: &NewUpload<'_>,
        rules: BufferRules,
        now: i64,
    ) -> Result<Buffered, StoreError> {
        if rules.buffer_size < 1 || rules.job_attempts < 1 {
            return Err(StoreError::conflict(
                super::ConflictKind::InvalidArgument,
                format!(
                    "a buffer needs at least one update and a job one attempt, got {} and {}",
                    rules.buffer_size, rules.job_attempts
                ),
            ));
        }
        let exp = experiment_id.to_string();
        let client = upload.client_id.to_string();
        let lock = self.for_update();
        let id = Uuid::new_v4();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let state = experiment_state_for_update!(tx, lock, &exp, experiment_id);
            // A paused experiment still takes the updates of the tasks it handed out; a
            // stopped or finished one takes nothing more.
            if state != "running" && state != "paused" {
                return Err(StoreError::conflict(super::ConflictKind::ExperimentNotRunning, format!(
                    "experiment {experiment_id} is {state}: it takes no more updates"
                )));
            }
            let part: Option<(String, Option<i64>, i64, Option<String>)> = sqlx::query_as(
                "SELECT state, base_version, selected_at, dropped_stage FROM participations \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3 AND client_id = $4",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(&client)
            .fetch_optional(&mut *tx)
            .await?;
            let task = match part {
                Some((state, Some(base_version), handed_out_ms, dropped)) => Some(FedBuffTaskView {
                    state: state.parse().map_err(StoreError::Corrupt)?,
                    base_version,
                    handed_out_ms,
                    expired: dropped.as_deref() == Some("expired"),
                }),
                // A task of a synchronous round cannot be in a FedBuff experiment.
                Some((_, None, _, _)) => {
                    return Err(StoreError::Corrupt(format!(
                        "round {round} attempt {attempt} of FedBuff experiment {experiment_id} \
                         holds a task without a model version"
                    )));
                }
                None => None,
            };
            let base = check_fedbuff_upload(task.as_ref(), round, rules.task_ms, now)?;
            let buffer: Option<(i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT round, reported FROM rounds WHERE experiment_id = $1 \
                 AND stage = 'collecting'{lock}"
            )))
            .bind(&exp)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((buffer, reported)) = buffer else {
                return Err(StoreError::conflict(super::ConflictKind::NoBufferOpen, format!(
                    "experiment {experiment_id} has no buffer open: it has taken its last \
                     server step or has not started"
                )));
            };
            // The update is applied to version buffer - 1; its base is never newer.
            let staleness = (buffer - 1 - base).max(0);
            if let Some(max) = rules.max_staleness.filter(|max| staleness > *max) {
                drop_stale_task!(tx, exp, round, attempt, client);
                audit!(tx, now, "coordinator", "buffer.too_stale", exp.as_str(),
                    format!("client {client}: staleness {staleness} > {max}"));
                tx.commit().await?;
                return Ok(Buffered::TooStale { staleness, max_staleness: max });
            }
            store_buffered_upload!(tx, exp, round, attempt, client, id, upload, buffer, staleness, now);
            let closed = reported + 1 >= rules.buffer_size;
            count_into_buffer!(tx, exp, buffer, reported, closed, rules, now);
            tx.commit().await?;
            Ok(Buffered::Accepted {
                upload: Upload {
                    id,
                    client_id: upload.client_id,
                    blob_path: upload.blob_path.to_string(),
                    bytes: upload.bytes,
                    sha256: upload.sha256.to_vec(),
                    num_samples: upload.num_samples,
                },
                buffer,
                staleness,
                closed,
            })
        })
    }

    /// Fails the aggregating attempt of buffer `buffer` when its latest aggregation job
    /// has failed for good, and in the same transaction takes the next step
    /// ([`cohort_core::round::next_attempt`], the rule synchronous rounds follow): the
    /// buffer's next attempt aggregates the same buffered updates again, with a fresh
    /// job of `job_attempts` tries (the following buffer is already filling, so the
    /// updates cannot be collected afresh); after `max_attempts` the experiment fails.
    /// Without this a buffer that cannot be folded held its experiment for ever, every
    /// later buffer's job waiting on it. `None` when there was nothing to do (the job
    /// still has tries, or another replica got there first).
    pub async fn retry_buffer_if_aggregation_failed(
        &self,
        experiment_id: Uuid,
        buffer: i64,
        max_attempts: u32,
        job_attempts: i64,
        now: i64,
    ) -> Result<Option<BufferRetry>, StoreError> {
        let exp = experiment_id.to_string();
        with_pool!(self, p => {
            // Asked on every tick while a buffer aggregates: a plain read answers the
            // usual case without the write lock; the transaction checks again.
            if super::rounds::failed_aggregation!(p, &exp, buffer).is_none() {
                return Ok(None);
            }
            let mut tx = p.begin_write().await?;
            let Some(reason) = super::rounds::failed_aggregation!(&mut *tx, &exp, buffer) else {
                return Ok(None);
            };
            let aggregating: Option<(i64, i64, i64)> = sqlx::query_as(
                "SELECT attempt, selected, reported FROM rounds WHERE experiment_id = $1 \
                 AND round = $2 AND stage = 'aggregating' ORDER BY attempt DESC LIMIT 1",
            )
            .bind(&exp)
            .bind(buffer)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((attempt, selected, reported)) = aggregating else {
                return Ok(None);
            };
            sqlx::query(
                "UPDATE rounds SET stage = 'failed', failure = $1, finished_at = $2 \
                 WHERE experiment_id = $3 AND round = $4 AND attempt = $5",
            )
            .bind(&reason)
            .bind(now)
            .bind(&exp)
            .bind(buffer)
            .bind(attempt)
            .execute(&mut *tx)
            .await?;
            audit!(tx, now, "coordinator", "buffer.fail", exp.as_str(),
                format!("buffer {buffer} attempt {attempt}: {reason}"));
            let retry = match cohort_core::round::next_attempt(attempt, max_attempts) {
                Some(next) => {
                    sqlx::query(
                        "INSERT INTO rounds (experiment_id, round, attempt, stage, selected, \
                         reported, started_at) VALUES ($1, $2, $3, 'aggregating', $4, $5, $6)",
                    )
                    .bind(&exp)
                    .bind(buffer)
                    .bind(next)
                    .bind(selected)
                    .bind(reported)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                    sqlx::query(super::jobs::ENQUEUE_JOB_SQL)
                        .bind(super::JobKind::Aggregate.as_str())
                        .bind(&exp)
                        .bind(buffer)
                        .bind(job_attempts)
                        .bind(now)
                        .execute(&mut *tx)
                        .await?;
                    audit!(tx, now, "coordinator", "buffer.retry", exp.as_str(),
                        format!("buffer {buffer} attempt {next}"));
                    BufferRetry::Retried { attempt: next }
                }
                None => {
                    sqlx::query(
                        "UPDATE experiments SET state = 'failed', updated_at = $1 \
                         WHERE id = $2 AND state IN ('running', 'paused')",
                    )
                    .bind(now)
                    .bind(&exp)
                    .execute(&mut *tx)
                    .await?;
                    audit!(tx, now, "coordinator", "experiment.state", exp.as_str(),
                        format!("failed: buffer {buffer} failed {attempt} times"));
                    BufferRetry::ExperimentFailed
                }
            };
            tx.commit().await?;
            Ok(Some(retry))
        })
    }

    /// The uploads folded into buffer `buffer`, in upload-id order, with their base
    /// versions and staleness, for the aggregation job.
    pub async fn buffer_uploads(
        &self,
        experiment_id: Uuid,
        buffer: i64,
    ) -> Result<Vec<BufferedUpload>, StoreError> {
        type Row = (
            String,
            String,
            String,
            i64,
            Vec<u8>,
            i64,
            Option<i64>,
            Option<i64>,
            Option<f64>,
        );
        with_pool!(self, p => {
            let rows: Vec<Row> = sqlx::query_as(
                "SELECT u.id, u.client_id, u.blob_path, u.bytes, u.sha256, u.num_samples, \
                 p.base_version, u.staleness, p.train_loss FROM uploads u \
                 JOIN participations p ON p.experiment_id = u.experiment_id \
                   AND p.round = u.round AND p.attempt = u.attempt AND p.client_id = u.client_id \
                 WHERE u.experiment_id = $1 AND u.buffer_round = $2 ORDER BY u.id",
            )
            .bind(experiment_id.to_string())
            .bind(buffer)
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(id, c, path, bytes, sha, n, base, staleness, loss)| {
                    let missing =
                        || StoreError::Corrupt(format!("buffered upload {id} without its version"));
                    Ok(BufferedUpload {
                        base_version: base.ok_or_else(missing)?,
                        staleness: staleness.ok_or_else(missing)?,
                        train_loss: loss,
                        upload: Upload {
                            id: parse_uuid(&id)?,
                            client_id: parse_uuid(&c)?,
                            blob_path: path,
                            bytes,
                            sha256: sha,
                            num_samples: n,
                        },
                    })
                })
                .collect()
        })
    }

    /// Per server step: updates buffered and their staleness, in step order.
    pub async fn fedbuff_steps(&self, experiment_id: Uuid) -> Result<Vec<StepStats>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(i64, i64, i64, f64, i64)> = sqlx::query_as(
                "SELECT buffer_round, COUNT(*), \
                 CAST(SUM(CASE WHEN staleness > 0 THEN 1 ELSE 0 END) AS BIGINT), \
                 CAST(AVG(staleness) AS DOUBLE PRECISION), CAST(MAX(staleness) AS BIGINT) \
                 FROM uploads WHERE experiment_id = $1 AND buffer_round IS NOT NULL \
                 GROUP BY buffer_round ORDER BY buffer_round",
            )
            .bind(experiment_id.to_string())
            .fetch_all(p)
            .await?;
            Ok(rows
                .into_iter()
                .map(|(step, updates, stale_updates, mean_staleness, max_staleness)| StepStats {
                    step,
                    updates,
                    stale_updates,
                    mean_staleness,
                    max_staleness,
                })
                .collect())
        })
    }

    /// How many of a FedBuff experiment's tasks were dropped as too stale or expired.
    pub async fn fedbuff_drops(&self, experiment_id: Uuid) -> Result<FedBuffDrops, StoreError> {
        with_pool!(self, p => {
            let (too_stale, expired): (i64, i64) = sqlx::query_as(
                "SELECT CAST(COALESCE(SUM(CASE WHEN dropped_stage = 'stale' THEN 1 ELSE 0 END), 0) AS BIGINT), \
                 CAST(COALESCE(SUM(CASE WHEN dropped_stage = 'expired' THEN 1 ELSE 0 END), 0) AS BIGINT) \
                 FROM participations WHERE experiment_id = $1 AND base_version IS NOT NULL \
                 AND state = 'dropped'",
            )
            .bind(experiment_id.to_string())
            .fetch_one(p)
            .await?;
            Ok(FedBuffDrops { too_stale, expired })
        })
    }
}
