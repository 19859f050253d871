//! What the admin dashboard needs beyond the API's queries: its sign-in sessions, and
//! summaries that keep its pages fast with thousands of rounds and clients (one page of
//! clients at a time, the latest accuracy of every experiment in one query, job counts
//! instead of every job).

use std::collections::HashMap;

use uuid::Uuid;

use super::{
    BeginWrite, Client, ClientRow, EnrolmentToken, Job, JobRow, Pool, Store, StoreError, TokenRow,
    audit, parse_uuid, with_pool,
};

/// A session is refused after this long without a request, Unix ms.
pub const SESSION_IDLE_MS: i64 = 2 * 60 * 60 * 1000;
/// A session's `last_seen_at` is written at most this often, so that reading a page does
/// not cost a write each time.
const SESSION_TOUCH_MS: i64 = 60 * 1000;

/// The newest published round of an experiment and its test accuracy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatestAccuracy {
    /// The round.
    pub round: i64,
    /// Its model's test accuracy, when it was evaluated.
    pub test_accuracy: Option<f64>,
}

/// One page of enrolled clients, in enrolment order.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientPage {
    /// The clients on this page.
    pub clients: Vec<Client>,
    /// Rounds each of them uploaded an update to (missing means none).
    pub rounds_taken: HashMap<Uuid, i64>,
}

/// How many of an experiment's jobs are in each state, and the newest few.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JobSummary {
    /// (state, count), for every state that has jobs.
    pub counts: Vec<(String, i64)>,
    /// The newest jobs, newest first.
    pub recent: Vec<Job>,
}

/// Whose a dashboard session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionHolder {
    /// Signed in with the admin token.
    AdminToken,
    /// Signed in by a person (their role applies).
    User(Uuid),
}

impl Store {
    /// Records a new dashboard session by the hash of its id; expired sessions are
    /// removed in the same transaction, so the table does not grow without bound.
    pub async fn create_dashboard_session(
        &self,
        id_hash: &[u8],
        now: i64,
        expires_at: i64,
        holder: SessionHolder,
    ) -> Result<(), StoreError> {
        let user = match holder {
            SessionHolder::AdminToken => None,
            SessionHolder::User(id) => Some(id.to_string()),
        };
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            sqlx::query("DELETE FROM dashboard_sessions WHERE expires_at <= $1 OR last_seen_at <= $2")
                .bind(now)
                .bind(now - SESSION_IDLE_MS)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO dashboard_sessions \
                 (id_hash, created_at, last_seen_at, expires_at, user_id) \
                 VALUES ($1, $2, $2, $3, $4)",
            )
            .bind(id_hash)
            .bind(now)
            .bind(expires_at)
            .bind(user)
            .execute(&mut *tx)
            .await?;
            audit!(tx, now, super::admin_actor(), "dashboard.sign_in", "", "");
            tx.commit().await?;
        });
        Ok(())
    }

    /// Who holds the session whose id hashes to `id_hash`, if it is live at `now` (not
    /// expired, not idle too long); a live one is marked seen.
    pub async fn dashboard_session_live(
        &self,
        id_hash: &[u8],
        now: i64,
    ) -> Result<Option<SessionHolder>, StoreError> {
        with_pool!(self, p => {
            let row: Option<(i64, i64, Option<String>)> = sqlx::query_as(
                "SELECT last_seen_at, expires_at, user_id FROM dashboard_sessions \
                 WHERE id_hash = $1",
            )
            .bind(id_hash)
            .fetch_optional(p)
            .await?;
            let Some((last_seen_at, expires_at, user)) = row else {
                return Ok(None);
            };
            if now >= expires_at || now - last_seen_at >= SESSION_IDLE_MS {
                return Ok(None);
            }
            if now - last_seen_at >= SESSION_TOUCH_MS {
                sqlx::query("UPDATE dashboard_sessions SET last_seen_at = $1 WHERE id_hash = $2")
                    .bind(now)
                    .bind(id_hash)
                    .execute(p)
                    .await?;
            }
            Ok(Some(match user {
                Some(id) => SessionHolder::User(super::parse_uuid(&id)?),
                None => SessionHolder::AdminToken,
            }))
        })
    }

    /// Ends a session (sign-out). Ending one that does not exist is not an error.
    pub async fn end_dashboard_session(&self, id_hash: &[u8], now: i64) -> Result<(), StoreError> {
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let done = sqlx::query("DELETE FROM dashboard_sessions WHERE id_hash = $1")
                .bind(id_hash)
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() > 0 {
                audit!(tx, now, super::admin_actor(), "dashboard.sign_out", "", "");
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// The newest published round of every experiment that has one, with its accuracy.
    pub async fn latest_accuracies(&self) -> Result<HashMap<Uuid, LatestAccuracy>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(String, i64, Option<f64>)> = sqlx::query_as(
                "SELECT r.experiment_id, r.round, r.test_accuracy FROM rounds r \
                 JOIN (SELECT experiment_id, MAX(round) AS round FROM rounds \
                       WHERE stage = 'published' GROUP BY experiment_id) m \
                   ON r.experiment_id = m.experiment_id AND r.round = m.round \
                 WHERE r.stage = 'published'",
            )
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(id, round, test_accuracy)| {
                    Ok((parse_uuid(&id)?, LatestAccuracy { round, test_accuracy }))
                })
                .collect()
        })
    }

    /// Clients `offset..offset + limit` in enrolment order, with the rounds each took
    /// part in ([`client_count`](Self::client_count) gives the total).
    pub async fn client_page(&self, offset: i64, limit: i64) -> Result<ClientPage, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<ClientRow> = sqlx::query_as(
                "SELECT id, label, enrolled_at, last_seen_at, revoked_at FROM clients \
                 ORDER BY enrolled_at, id LIMIT $1 OFFSET $2",
            )
            .bind(limit)
            .bind(offset)
            .fetch_all(p)
            .await?;
            let clients = rows
                .into_iter()
                .map(Client::from_row)
                .collect::<Result<Vec<_>, _>>()?;
            let mut rounds_taken = HashMap::new();
            if !clients.is_empty() {
                // One query for the page: `IN ($1, ..., $n)` reads the participations
                // index for these clients only.
                let placeholders = (1..=clients.len())
                    .map(|i| format!("${i}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let sql = format!(
                    "SELECT client_id, COUNT(*) FROM participations \
                     WHERE state = 'uploaded' AND client_id IN ({placeholders}) GROUP BY client_id"
                );
                // Only `$N` placeholders are formatted in; every value is bound.
                let mut query = sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql));
                for c in &clients {
                    query = query.bind(c.id.to_string());
                }
                for (id, n) in query.fetch_all(p).await? {
                    rounds_taken.insert(parse_uuid(&id)?, n);
                }
            }
            Ok(ClientPage { clients, rounds_taken })
        })
    }

    /// How many clients are enrolled.
    pub async fn client_count(&self) -> Result<i64, StoreError> {
        with_pool!(self, p => {
            let (total,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM clients")
                .fetch_one(p)
                .await?;
            Ok(total)
        })
    }

    /// The newest `limit` enrolment tokens, newest first (never the tokens themselves).
    pub async fn recent_enrolment_tokens(
        &self,
        limit: i64,
    ) -> Result<Vec<EnrolmentToken>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<TokenRow> = sqlx::query_as(
                "SELECT id, label, created_at, expires_at, used_at, used_by, revoked_at \
                 FROM enrolment_tokens ORDER BY created_at DESC, id LIMIT $1",
            )
            .bind(limit)
            .fetch_all(p)
            .await?;
            rows.into_iter().map(EnrolmentToken::from_row).collect()
        })
    }

    /// The counts of an experiment's jobs by state, and its newest `limit` jobs.
    pub async fn job_summary(
        &self,
        experiment_id: Uuid,
        limit: i64,
    ) -> Result<JobSummary, StoreError> {
        with_pool!(self, p => {
            let counts: Vec<(String, i64)> = sqlx::query_as(
                "SELECT state, COUNT(*) FROM jobs WHERE experiment_id = $1 \
                 GROUP BY state ORDER BY state",
            )
            .bind(experiment_id.to_string())
            .fetch_all(p)
            .await?;
            let rows: Vec<JobRow> = sqlx::query_as(
                "SELECT id, kind, experiment_id, round, state, attempts, max_attempts, \
                 run_after, locked_by, locked_until, last_error FROM jobs \
                 WHERE experiment_id = $1 ORDER BY id DESC LIMIT $2",
            )
            .bind(experiment_id.to_string())
            .bind(limit)
            .fetch_all(p)
            .await?;
            let recent = rows.into_iter().map(Job::from_row).collect::<Result<_, _>>()?;
            Ok(JobSummary { counts, recent })
        })
    }
}
