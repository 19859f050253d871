//! Models users bring (uploaded safetensors files), what clients report about the model
//! versions they evaluate, and the tasks they could not complete.

use std::collections::BTreeMap;

use cohort_aggregation::TensorSpec;
use serde::Serialize;
use uuid::Uuid;

use super::{BeginWrite, Pool, Store, StoreError, audit, parse_uuid, with_pool};

/// An uploaded model file, as checked and stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ModelFile {
    /// Identifier, named by an experiment's `initial_model`.
    pub id: Uuid,
    /// What the admin called it.
    pub name: String,
    /// Its tensors, in the order of the stored vector.
    pub tensors: Vec<TensorSpec>,
    /// Scalar parameters in all.
    pub parameters: i64,
    /// SHA-256 of the file as uploaded, hex.
    pub sha256: String,
    /// The blob holding its values (wire form).
    #[serde(skip)]
    #[schema(ignore)]
    pub blob_path: String,
    /// Upload time, Unix ms.
    pub created_at: i64,
}

type ModelFileRow = (String, String, String, i64, String, String, i64);

impl ModelFile {
    fn from_row(row: ModelFileRow) -> Result<Self, StoreError> {
        let (id, name, tensors, parameters, sha256, blob_path, created_at) = row;
        Ok(Self {
            id: parse_uuid(&id)?,
            name,
            tensors: serde_json::from_str(&tensors)
                .map_err(|e| StoreError::Corrupt(format!("model file tensors: {e}")))?,
            parameters,
            sha256,
            blob_path,
            created_at,
        })
    }
}

/// One client's evaluation of one model version.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ClientEvaluation {
    /// The published round whose model was evaluated (0: the initial model).
    pub model_version: i64,
    /// The client.
    pub client_id: Uuid,
    /// Examples the metrics are over (0 when withheld).
    pub num_examples: i64,
    /// Metric name to value (none when withheld).
    pub metrics: BTreeMap<String, f64>,
    /// When it was reported, Unix ms.
    pub at: i64,
    /// Why the client kept its metrics to itself, when it did (as the API names the
    /// reason, e.g. `local_differential_privacy`): the report then says only that it
    /// answered.
    pub withheld: Option<String>,
}

/// A task a client reported it could not complete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct TaskFailure {
    /// The round.
    pub round: i64,
    /// The round's attempt.
    pub attempt: i64,
    /// The client.
    pub client_id: Uuid,
    /// What the client said went wrong.
    pub reason: String,
    /// When it was reported, Unix ms.
    pub at: i64,
}

impl Store {
    /// Records an uploaded model file whose blob is already stored.
    pub async fn create_model_file(&self, file: &ModelFile) -> Result<(), StoreError> {
        let tensors = serde_json::to_string(&file.tensors).expect("tensor specs serialise");
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            sqlx::query(
                "INSERT INTO model_files (id, name, tensors, parameters, sha256, blob_path, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(file.id.to_string())
            .bind(&file.name)
            .bind(&tensors)
            .bind(file.parameters)
            .bind(&file.sha256)
            .bind(&file.blob_path)
            .bind(file.created_at)
            .execute(&mut *tx)
            .await?;
            audit!(tx, file.created_at, super::admin_actor(), "model_file.upload", file.id.to_string(),
                format!("{} ({} parameters, sha256 {})", file.name, file.parameters, file.sha256));
            tx.commit().await?;
        });
        Ok(())
    }

    /// One model file.
    pub async fn model_file(&self, id: Uuid) -> Result<ModelFile, StoreError> {
        with_pool!(self, p => {
            let row: Option<ModelFileRow> = sqlx::query_as(
                "SELECT id, name, tensors, parameters, sha256, blob_path, created_at \
                 FROM model_files WHERE id = $1",
            )
            .bind(id.to_string())
            .fetch_optional(p)
            .await?;
            row.map(ModelFile::from_row)
                .transpose()?
                .ok_or_else(|| StoreError::NotFound(format!("model file {id}")))
        })
    }

    /// Every model file, newest first.
    pub async fn model_files(&self) -> Result<Vec<ModelFile>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<ModelFileRow> = sqlx::query_as(
                "SELECT id, name, tensors, parameters, sha256, blob_path, created_at \
                 FROM model_files ORDER BY created_at DESC, id",
            )
            .fetch_all(p)
            .await?;
            rows.into_iter().map(ModelFile::from_row).collect()
        })
    }

    /// Records a client's evaluation of a model version. A second report from the same
    /// client for the same version is ignored (a retried request), and `false` says so.
    pub async fn record_client_evaluation(
        &self,
        experiment: Uuid,
        evaluation: &ClientEvaluation,
    ) -> Result<bool, StoreError> {
        let metrics = serde_json::to_string(&evaluation.metrics).expect("metrics serialise");
        with_pool!(self, p => {
            let done = sqlx::query(
                "INSERT INTO client_evaluations \
                 (experiment_id, model_version, client_id, num_examples, metrics, at, withheld) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
            )
            .bind(experiment.to_string())
            .bind(evaluation.model_version)
            .bind(evaluation.client_id.to_string())
            .bind(evaluation.num_examples)
            .bind(&metrics)
            .bind(evaluation.at)
            .bind(evaluation.withheld.as_deref())
            .execute(p)
            .await?;
            Ok(done.rows_affected() == 1)
        })
    }

    /// Every client evaluation of an experiment, by model version then client.
    pub async fn client_evaluations(
        &self,
        experiment: Uuid,
    ) -> Result<Vec<ClientEvaluation>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(i64, String, i64, String, i64, Option<String>)> = sqlx::query_as(
                "SELECT model_version, client_id, num_examples, metrics, at, withheld \
                 FROM client_evaluations WHERE experiment_id = $1 \
                 ORDER BY model_version, client_id",
            )
            .bind(experiment.to_string())
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(model_version, client, num_examples, metrics, at, withheld)| {
                    Ok(ClientEvaluation {
                        model_version,
                        client_id: parse_uuid(&client)?,
                        num_examples,
                        metrics: serde_json::from_str(&metrics)
                            .map_err(|e| StoreError::Corrupt(format!("metrics: {e}")))?,
                        at,
                        withheld,
                    })
                })
                .collect()
        })
    }

    /// Experiments that `client` took part in ([`takes_part`](Self::takes_part)),
    /// finished since `since` (Unix ms), whose final model it has neither evaluated nor
    /// failed to evaluate (a failure of attempt 0), newest first (at most 20):
    /// `(experiment, final model version, spec)`.
    pub async fn final_models_to_evaluate(
        &self,
        client: Uuid,
        since: i64,
    ) -> Result<Vec<(Uuid, i64, serde_json::Value)>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(String, i64, String)> = sqlx::query_as(
                "SELECT e.id, e.current_round, e.spec FROM experiments e \
                 WHERE e.state = 'finished' AND e.updated_at >= $1 AND EXISTS ( \
                   SELECT 1 FROM participations p WHERE p.experiment_id = e.id \
                   AND p.client_id = $2) \
                 AND NOT EXISTS ( \
                   SELECT 1 FROM client_evaluations c WHERE c.experiment_id = e.id \
                   AND c.model_version = e.current_round AND c.client_id = $2) \
                 AND NOT EXISTS ( \
                   SELECT 1 FROM task_failures f WHERE f.experiment_id = e.id \
                   AND f.round = e.current_round AND f.attempt = 0 AND f.client_id = $2) \
                 ORDER BY e.updated_at DESC LIMIT 20",
            )
            .bind(since)
            .bind(client.to_string())
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(id, version, spec)| {
                    let spec = serde_json::from_str(&spec)
                        .map_err(|e| StoreError::Corrupt(format!("spec: {e}")))?;
                    Ok((parse_uuid(&id)?, version, spec))
                })
                .collect()
        })
    }

    /// Records that `client` could not complete its task of `round`/`attempt`; a repeat
    /// report of the same task is ignored. A FedBuff task it held is dropped (`failed`)
    /// at once, so that its concurrency slot goes to the next client instead of waiting
    /// for the task to expire; a round's task is never handed to this client again
    /// ([`pending_task`](Self::pending_task) skips it).
    pub async fn record_task_failure(
        &self,
        experiment: Uuid,
        failure: &TaskFailure,
    ) -> Result<(), StoreError> {
        let exp = experiment.to_string();
        let client = failure.client_id.to_string();
        let lock = self.for_update();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            // A task whose update is counted did not fail: its report would only make
            // the admin's view contradict the round's.
            let state: Option<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT state FROM participations WHERE experiment_id = $1 AND round = $2 \
                 AND attempt = $3 AND client_id = $4{lock}"
            )))
            .bind(&exp)
            .bind(failure.round)
            .bind(failure.attempt)
            .bind(&client)
            .fetch_optional(&mut *tx)
            .await?;
            if state.is_some_and(|(state,)| state == "uploaded") {
                return Err(StoreError::Refused(
                    cohort_core::round::UploadRefusal::AlreadyUploaded { round: failure.round },
                ));
            }
            sqlx::query(
                "INSERT INTO task_failures (experiment_id, round, attempt, client_id, reason, at) \
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            )
            .bind(&exp)
            .bind(failure.round)
            .bind(failure.attempt)
            .bind(&client)
            .bind(&failure.reason)
            .bind(failure.at)
            .execute(&mut *tx)
            .await?;
            let freed = sqlx::query(
                "UPDATE participations SET state = 'dropped', dropped_stage = 'failed' \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3 AND client_id = $4 \
                 AND state = 'selected' AND base_version IS NOT NULL",
            )
            .bind(&exp)
            .bind(failure.round)
            .bind(failure.attempt)
            .bind(&client)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if freed > 0 {
                sqlx::query(
                    "UPDATE rounds SET dropped = dropped + 1 \
                     WHERE experiment_id = $1 AND round = $2 AND attempt = $3",
                )
                .bind(&exp)
                .bind(failure.round)
                .bind(failure.attempt)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// How many selected clients of a round attempt reported that their task failed and
    /// uploaded nothing (a client that says both is counted once, as an upload).
    pub async fn task_failure_count(
        &self,
        experiment: Uuid,
        round: i64,
        attempt: i64,
    ) -> Result<i64, StoreError> {
        with_pool!(self, p => {
            let (n,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM task_failures f \
                 WHERE f.experiment_id = $1 AND f.round = $2 AND f.attempt = $3 \
                 AND NOT EXISTS (SELECT 1 FROM uploads u WHERE u.experiment_id = f.experiment_id \
                   AND u.round = f.round AND u.attempt = f.attempt AND u.client_id = f.client_id)",
            )
            .bind(experiment.to_string())
            .bind(round)
            .bind(attempt)
            .fetch_one(p)
            .await?;
            Ok(n)
        })
    }

    /// Every reported task failure of an experiment, oldest first.
    pub async fn task_failures(&self, experiment: Uuid) -> Result<Vec<TaskFailure>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(i64, i64, String, String, i64)> = sqlx::query_as(
                "SELECT round, attempt, client_id, reason, at FROM task_failures \
                 WHERE experiment_id = $1 ORDER BY at, round, attempt, client_id",
            )
            .bind(experiment.to_string())
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(round, attempt, client, reason, at)| {
                    Ok(TaskFailure {
                        round,
                        attempt,
                        client_id: parse_uuid(&client)?,
                        reason,
                        at,
                    })
                })
                .collect()
        })
    }
}
