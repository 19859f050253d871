//! What `/metrics` reports from the database: counts that every replica sees alike,
//! since they come from the shared system of record rather than one process's memory.

use super::{Pool, Store, StoreError, with_pool};

/// Counts across all experiments, read in one go when Prometheus scrapes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreCounts {
    /// (state, experiments).
    pub experiments: Vec<(String, i64)>,
    /// (stage, round attempts): the in-progress stages are what is running now,
    /// `published` and `failed` only ever grow.
    pub rounds: Vec<(String, i64)>,
    /// (kind, state, jobs).
    pub jobs: Vec<(String, String, i64)>,
    /// Uploads recorded, all time.
    pub uploads: i64,
    /// Their bytes.
    pub upload_bytes: i64,
    /// Tasks clients reported they could not complete.
    pub task_failures: i64,
    /// Enrolled clients not revoked.
    pub clients: i64,
    /// Of those, seen at or after the `since` given.
    pub clients_active: i64,
}

impl Store {
    /// The counts `/metrics` exports; clients seen at or after `since` (Unix ms) count
    /// as active.
    pub async fn counts(&self, since: i64) -> Result<StoreCounts, StoreError> {
        with_pool!(self, p => {
            let experiments: Vec<(String, i64)> = sqlx::query_as(
                "SELECT state, COUNT(*) FROM experiments GROUP BY state ORDER BY state",
            )
            .fetch_all(p)
            .await?;
            let rounds: Vec<(String, i64)> = sqlx::query_as(
                "SELECT stage, COUNT(*) FROM rounds GROUP BY stage ORDER BY stage",
            )
            .fetch_all(p)
            .await?;
            let jobs: Vec<(String, String, i64)> = sqlx::query_as(
                "SELECT kind, state, COUNT(*) FROM jobs GROUP BY kind, state ORDER BY kind, state",
            )
            .fetch_all(p)
            .await?;
            let (uploads, upload_bytes): (i64, i64) = sqlx::query_as(
                "SELECT COUNT(*), CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM uploads",
            )
            .fetch_one(p)
            .await?;
            let (task_failures,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM task_failures")
                .fetch_one(p)
                .await?;
            let (clients, clients_active): (i64, i64) = sqlx::query_as(
                "SELECT COUNT(*), \
                 CAST(COALESCE(SUM(CASE WHEN last_seen_at >= $1 THEN 1 ELSE 0 END), 0) AS BIGINT) \
                 FROM clients WHERE revoked_at IS NULL",
            )
            .bind(since)
            .fetch_one(p)
            .await?;
            Ok(StoreCounts {
                experiments,
                rounds,
                jobs,
                uploads,
                upload_bytes,
                task_failures,
                clients,
                clients_active,
            })
        })
    }
}
