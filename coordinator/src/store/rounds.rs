//! Rounds, the clients selected for them, their uploads and the published models. Every
//! stage change is one transaction with its precondition checked inside it, so a
//! coordinator that restarts (or a second one on the same PostgreSQL) finds each round
//! exactly where the last committed step left it.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{
    BeginWrite, Pool, Store, StoreError, audit, experiment_state_for_update, parse_uuid, with_pool,
};

pub use cohort_core::round::{ParticipationState, RoundStage};
use cohort_core::round::{ParticipationView, RoundView, UploadRefusal, check_upload};

/// A stored round stage.
pub(crate) fn parse_stage(text: &str) -> Result<RoundStage, StoreError> {
    text.parse()
        .map_err(|e: cohort_core::round::UnknownStage| StoreError::Corrupt(e.to_string()))
}

/// A stored participation state.
fn parse_participation(text: &str) -> Result<ParticipationState, StoreError> {
    text.parse().map_err(StoreError::Corrupt)
}

/// One attempt at one round.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Round {
    /// The experiment.
    pub experiment_id: Uuid,
    /// Round number, from 1.
    pub round: i64,
    /// Attempt, from 1.
    pub attempt: i64,
    /// Stage.
    pub stage: RoundStage,
    /// When collection closes, Unix ms.
    pub stage_deadline: Option<i64>,
    /// Clients selected.
    pub selected: i64,
    /// Uploads received.
    pub reported: i64,
    /// Selected clients that did not upload by the deadline.
    pub dropped: i64,
    /// Test accuracy of the published model.
    pub test_accuracy: Option<f64>,
    /// Test loss of the published model.
    pub test_loss: Option<f64>,
    /// Sample-weighted mean client training loss.
    pub train_loss: Option<f64>,
    /// Start, Unix ms.
    pub started_at: i64,
    /// End (published or failed), Unix ms.
    pub finished_at: Option<i64>,
    /// Secure aggregation's public round settings, for a secure round.
    #[schema(value_type = Option<Object>)]
    pub secagg: Option<serde_json::Value>,
    /// Why the attempt failed.
    pub failure: Option<String>,
    /// Differential privacy: what the attempt was charged, for a private experiment.
    pub privacy: Option<RoundPrivacy>,
    /// Differential privacy: epsilon the experiment has spent up to and including this
    /// attempt (at the experiment's delta).
    pub epsilon: Option<f64>,
}

/// How a private round adds its noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NoiseMechanism {
    /// The coordinator clips the plaintext updates and noises their sum.
    Central,
    /// Each client adds its share of Skellam noise before masking (secure aggregation).
    Distributed,
}

/// What one attempt of a differentially private round is charged, and what it needs to
/// run: stored with the round (JSON) when it opens, and updated when it publishes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RoundPrivacy {
    /// Where the noise comes from.
    pub mechanism: NoiseMechanism,
    /// Probability that any one available client was selected (Poisson sampling).
    pub sampling_rate: f64,
    /// The noise multiplier the accountant charges: the configured one for central
    /// noise; for distributed noise, the one the round's survivors carry (until it
    /// publishes, the worst case of only the threshold surviving).
    pub noise_multiplier: f64,
    /// The L2 bound on each client's update in this round.
    pub clip: f64,
    /// The fixed denominator of the noisy mean: the expected number of clients.
    pub denominator: f64,
    /// Adaptive clipping: the bound for the next round, once this one has published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_clip: Option<f64>,
    /// Epsilon spent by the experiment up to and including this attempt.
    pub epsilon: f64,
}

type RoundRow = (
    String,
    i64,
    i64,
    String,
    Option<i64>,
    i64,
    i64,
    i64,
    Option<f64>,
    Option<f64>,
    Option<f64>,
    i64,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// A `SELECT` of every [`RoundRow`] column from `rounds`, followed by `$tail`.
macro_rules! select_rounds {
    ($tail:literal) => {
        concat!(
            "SELECT experiment_id, round, attempt, stage, stage_deadline, selected, reported, ",
            "dropped, test_accuracy, test_loss, train_loss, started_at, finished_at, secagg, ",
            "failure, privacy FROM rounds ",
            $tail
        )
    };
}

impl Round {
    fn from_row(r: RoundRow) -> Result<Self, StoreError> {
        Self {
            experiment_id: parse_uuid(&r.0)?,
            round: r.1,
            attempt: r.2,
            stage: parse_stage(&r.3)?,
            stage_deadline: r.4,
            selected: r.5,
            reported: r.6,
            dropped: r.7,
            test_accuracy: r.8,
            test_loss: r.9,
            train_loss: r.10,
            started_at: r.11,
            finished_at: r.12,
            secagg: r
                .13
                .map(|text| {
                    serde_json::from_str(&text)
                        .map_err(|e| StoreError::Corrupt(format!("round secagg settings: {e}")))
                })
                .transpose()?,
            failure: r.14,
            epsilon: None,
            privacy: None,
        }
        .with_privacy(r.15)
    }

    fn with_privacy(mut self, text: Option<String>) -> Result<Self, StoreError> {
        if let Some(text) = text {
            let privacy: RoundPrivacy = serde_json::from_str(&text)
                .map_err(|e| StoreError::Corrupt(format!("round privacy: {e}")))?;
            self.epsilon = Some(privacy.epsilon);
            self.privacy = Some(privacy);
        }
        Ok(self)
    }
}

/// A selected client's row.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Participation {
    /// The client.
    pub client_id: Uuid,
    /// Where it is.
    pub state: ParticipationState,
    /// Selection time, Unix ms.
    pub selected_at: i64,
    /// Upload time, Unix ms.
    pub uploaded_at: Option<i64>,
    /// Samples behind its update.
    pub num_samples: Option<i64>,
    /// Its mean training loss.
    pub train_loss: Option<f64>,
    /// Secure aggregation: the client's index in the round (1..n).
    pub secagg_index: Option<i64>,
    /// Secure aggregation: the last stage it completed (`advertised`, `revealed`,
    /// `shared`, `masked`, `confirmed`, `unmasked`), or `excluded`.
    pub secagg_stage: Option<String>,
    /// Secure aggregation: the stage it dropped out at (`advertise`, `share`, `masked`,
    /// `unmask`).
    pub dropped_stage: Option<String>,
    /// Bytes of its upload as sent (compressed, masked or plain floats); `None` before
    /// it uploads.
    pub bytes_up: Option<i64>,
    /// Bytes of the models it downloaded while selected; `None` before its first.
    pub bytes_down: Option<i64>,
}

/// One client selected for one round attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    /// Round number.
    pub round: i64,
    /// Attempt.
    pub attempt: i64,
    /// The client.
    pub client_id: Uuid,
}

/// A participation row: client_id, state, selected_at, uploaded_at, num_samples,
/// train_loss, secagg_index, secagg_stage, dropped_stage, bytes_up, bytes_down.
type ParticipationRow = (
    String,
    String,
    i64,
    Option<i64>,
    Option<i64>,
    Option<f64>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

/// An upload to record, its blob already durable at `blob_path`.
#[derive(Debug, Clone)]
pub struct NewUpload<'a> {
    /// The uploading client.
    pub client_id: Uuid,
    /// Where the update's bytes are, relative to the data directory.
    pub blob_path: &'a str,
    /// Size of the blob.
    pub bytes: i64,
    /// SHA-256 of the blob.
    pub sha256: &'a [u8],
    /// Samples behind the update (the FedAvg weight), as counted: at most the
    /// experiment's cap.
    pub num_samples: i64,
    /// What the client claimed when it was more than the cap, so `num_samples` holds the
    /// cap instead: recorded in the audit log with the upload.
    pub claimed_samples: Option<i64>,
    /// The client's mean training loss.
    pub train_loss: Option<f64>,
    /// The id the client chose for this upload, if it sent one: a retry with the same id
    /// finds the stored upload through [`Store::upload_by_client_id`].
    pub client_upload_id: Option<Uuid>,
    /// Bytes the client sent, when they are not the blob's (a compressed upload, stored
    /// decoded); `None`: `bytes`.
    pub wire_bytes: Option<i64>,
}

impl NewUpload<'_> {
    /// The upload as recorded under `id`.
    fn recorded(&self, id: Uuid) -> Upload {
        Upload {
            id,
            client_id: self.client_id,
            blob_path: self.blob_path.to_string(),
            bytes: self.bytes,
            sha256: self.sha256.to_vec(),
            num_samples: self.num_samples,
        }
    }
}

/// A recorded upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Upload {
    /// Identifier.
    pub id: Uuid,
    /// The uploading client.
    pub client_id: Uuid,
    /// Where the bytes are, relative to the data directory.
    pub blob_path: String,
    /// Size of the blob.
    pub bytes: i64,
    /// SHA-256 of the blob.
    #[serde(skip)]
    pub sha256: Vec<u8>,
    /// Samples behind the update.
    pub num_samples: i64,
}

/// A published global model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublishedModel {
    /// Round that produced it (0 is the initial model).
    pub round: i64,
    /// Where its bytes are, relative to the data directory.
    pub blob_path: String,
    /// Number of parameters.
    pub parameters: i64,
}

/// Which attempt of which round of which experiment a store call is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoundKey {
    /// The experiment.
    pub experiment: Uuid,
    /// The round (a FedBuff buffer, a model version).
    pub round: i64,
    /// The attempt of the round.
    pub attempt: i64,
}

impl RoundKey {
    /// Attempt `attempt` of round `round` of `experiment`.
    pub fn new(experiment: Uuid, round: i64, attempt: i64) -> Self {
        Self {
            experiment,
            round,
            attempt,
        }
    }
}

/// Metrics recorded when a round's model is published.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RoundMetrics {
    /// Test accuracy of the new model.
    pub test_accuracy: Option<f64>,
    /// Test loss of the new model.
    pub test_loss: Option<f64>,
    /// Sample-weighted mean client training loss.
    pub train_loss: Option<f64>,
}

/// Why the latest aggregation job of `round` failed for good (`Some("aggregation failed
/// N times: ...")`), or `None` while it has attempts left or has none. A macro, as the
/// query runs on either backend's pool or transaction.
macro_rules! failed_aggregation {
    ($conn:expr, $exp:expr, $round:expr) => {{
        let job: Option<(String, Option<String>, i64)> = sqlx::query_as(
            "SELECT state, last_error, attempts FROM jobs \
             WHERE experiment_id = $1 AND round = $2 AND kind = $3 ORDER BY id DESC LIMIT 1",
        )
        .bind($exp)
        .bind($round)
        .bind(super::JobKind::Aggregate.as_str())
        .fetch_optional($conn)
        .await?;
        job.filter(|(state, _, _)| state == "failed")
            .map(|(_, last_error, attempts)| {
                format!(
                    "aggregation failed {attempts} times: {}",
                    last_error.as_deref().unwrap_or("no error recorded")
                )
            })
    }};
}
pub(super) use failed_aggregation;

impl Store {
    /// Starts attempt `attempt` of round `round` with the `selected` clients, collecting
    /// until `deadline`. The experiment must be running and have no attempt in progress.
    pub async fn open_round(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        selected: &[Uuid],
        deadline: i64,
        now: i64,
    ) -> Result<Round, StoreError> {
        self.open_attempt(
            RoundKey::new(experiment_id, round, attempt),
            selected,
            None,
            None,
            deadline,
            now,
        )
        .await
    }

    /// Starts an attempt of a differentially private round: a plaintext one, or a
    /// secure one when `secagg` is given, recorded with what it is `privacy` charged.
    pub async fn open_private_round(
        &self,
        key: RoundKey,
        selected: &[Uuid],
        secagg: Option<&str>,
        privacy: &RoundPrivacy,
        deadline: i64,
        now: i64,
    ) -> Result<Round, StoreError> {
        let privacy = serde_json::to_string(privacy).expect("privacy records serialise");
        self.open_attempt(key, selected, secagg, Some(&privacy), deadline, now)
            .await
    }

    /// Starts a secure round attempt: like [`open_round`](Self::open_round), but the
    /// round first collects public keys (stage `advertising`, until `deadline`), keeps
    /// the protocol's public settings `secagg` (JSON), and gives the `selected` clients
    /// the protocol indices `1..=n` in the order given.
    pub async fn open_secure_round(
        &self,
        key: RoundKey,
        selected: &[Uuid],
        secagg: &str,
        deadline: i64,
        now: i64,
    ) -> Result<Round, StoreError> {
        self.open_attempt(key, selected, Some(secagg), None, deadline, now)
            .await
    }

    async fn open_attempt(
        &self,
        key: RoundKey,
        selected: &[Uuid],
        secagg: Option<&str>,
        privacy: Option<&str>,
        deadline: i64,
        now: i64,
    ) -> Result<Round, StoreError> {
        let RoundKey {
            experiment: experiment_id,
            round,
            attempt,
        } = key;
        let exp = experiment_id.to_string();
        let stage = if secagg.is_some() {
            "advertising"
        } else {
            "collecting"
        };
        let lock = self.for_update();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let state = experiment_state_for_update!(tx, lock, &exp, experiment_id);
            if state != "running" {
                return Err(StoreError::conflict(super::ConflictKind::ExperimentNotRunning, format!(
                    "experiment {experiment_id} is {state}, not running"
                )));
            }
            let (busy,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM rounds WHERE experiment_id = $1 \
                 AND stage NOT IN ('published', 'failed')",
            )
            .bind(&exp)
            .fetch_one(&mut *tx)
            .await?;
            if busy > 0 {
                return Err(StoreError::conflict(super::ConflictKind::RoundInProgress, format!(
                    "experiment {experiment_id} already has a round in progress"
                )));
            }
            sqlx::query(
                "INSERT INTO rounds (experiment_id, round, attempt, stage, stage_deadline, \
                 selected, started_at, secagg, privacy) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(stage)
            .bind(deadline)
            .bind(selected.len() as i64)
            .bind(now)
            .bind(secagg)
            .bind(privacy)
            .execute(&mut *tx)
            .await?;
            for (i, client) in selected.iter().enumerate() {
                sqlx::query(
                    "INSERT INTO participations (experiment_id, round, attempt, client_id, state, \
                     selected_at, secagg_index) VALUES ($1, $2, $3, $4, 'selected', $5, $6)",
                )
                .bind(&exp)
                .bind(round)
                .bind(attempt)
                .bind(client.to_string())
                .bind(now)
                .bind(secagg.map(|_| i as i64 + 1))
                .execute(&mut *tx)
                .await?;
            }
            sqlx::query("UPDATE experiments SET current_round = $1, updated_at = $2 WHERE id = $3")
                .bind(round)
                .bind(now)
                .bind(&exp)
                .execute(&mut *tx)
                .await?;
            audit!(tx, now, "coordinator", "round.open", exp.as_str(), format!("round {round} attempt {attempt}"));
            tx.commit().await?;
        });
        self.round(experiment_id, round, attempt).await
    }

    /// One round attempt.
    pub async fn round(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
    ) -> Result<Round, StoreError> {
        let sql = select_rounds!("WHERE experiment_id = $1 AND round = $2 AND attempt = $3");
        with_pool!(self, p => {
            let row: Option<RoundRow> = sqlx::query_as(sql)
                .bind(experiment_id.to_string())
                .bind(round)
                .bind(attempt)
                .fetch_optional(p)
                .await?;
            row.ok_or_else(|| StoreError::NotFound(format!("round {round} attempt {attempt}")))
                .and_then(Round::from_row)
        })
    }

    /// The latest attempt of round `round`.
    pub async fn latest_attempt(
        &self,
        experiment_id: Uuid,
        round: i64,
    ) -> Result<Round, StoreError> {
        let sql =
            select_rounds!("WHERE experiment_id = $1 AND round = $2 ORDER BY attempt DESC LIMIT 1");
        with_pool!(self, p => {
            let row: Option<RoundRow> = sqlx::query_as(sql)
                .bind(experiment_id.to_string())
                .bind(round)
                .fetch_optional(p)
                .await?;
            row.ok_or_else(|| StoreError::NotFound(format!("round {round}")))
                .and_then(Round::from_row)
        })
    }

    /// Every attempt of every round of an experiment, in order.
    pub async fn rounds(&self, experiment_id: Uuid) -> Result<Vec<Round>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<RoundRow> = sqlx::query_as(
                select_rounds!("WHERE experiment_id = $1 ORDER BY round, attempt"),
            )
            .bind(experiment_id.to_string())
            .fetch_all(p)
            .await?;
            rows.into_iter().map(Round::from_row).collect()
        })
    }

    /// The participations of a round attempt, by client id.
    pub async fn participations(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
    ) -> Result<Vec<Participation>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<ParticipationRow> =
                sqlx::query_as(
                    "SELECT client_id, state, selected_at, uploaded_at, num_samples, train_loss, \
                     secagg_index, secagg_stage, dropped_stage, bytes_up, bytes_down \
                     FROM participations WHERE experiment_id = $1 AND round = $2 AND attempt = $3 \
                     ORDER BY client_id",
                )
                .bind(experiment_id.to_string())
                .bind(round)
                .bind(attempt)
                .fetch_all(p)
                .await?;
            rows.into_iter().map(participation_from_row).collect()
        })
    }

    /// Bytes each round attempt's clients moved, all together: `(round, attempt)` to
    /// `(uploaded, downloaded)`.
    pub async fn traffic(
        &self,
        experiment_id: Uuid,
    ) -> Result<std::collections::HashMap<(i64, i64), (i64, i64)>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(i64, i64, i64, i64)> = sqlx::query_as(
                "SELECT round, attempt, CAST(COALESCE(SUM(bytes_up), 0) AS BIGINT), \
                 CAST(COALESCE(SUM(bytes_down), 0) AS BIGINT) FROM participations \
                 WHERE experiment_id = $1 GROUP BY round, attempt",
            )
            .bind(experiment_id.to_string())
            .fetch_all(p)
            .await?;
            Ok(rows.into_iter().map(|(r, a, up, down)| ((r, a), (up, down))).collect())
        })
    }

    /// Counts `bytes` of model downloaded by `client` towards the round attempt it is
    /// selected for and has not uploaded to yet (none: nothing is counted).
    pub async fn note_download(
        &self,
        experiment_id: Uuid,
        client_id: Uuid,
        bytes: i64,
    ) -> Result<(), StoreError> {
        with_pool!(self, p => {
            sqlx::query(
                "UPDATE participations SET bytes_down = COALESCE(bytes_down, 0) + $1 \
                 WHERE experiment_id = $2 AND client_id = $3 AND state = 'selected'",
            )
            .bind(bytes)
            .bind(experiment_id.to_string())
            .bind(client_id.to_string())
            .execute(p)
            .await?;
        });
        Ok(())
    }

    /// Who was selected for every attempt of an experiment, in round and attempt order:
    /// what the coordinator knows about each client, and so what its privacy against the
    /// coordinator is composed from.
    pub async fn selections(&self, experiment_id: Uuid) -> Result<Vec<Selection>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(i64, i64, String)> = sqlx::query_as(
                "SELECT round, attempt, client_id FROM participations WHERE experiment_id = $1 \
                 ORDER BY round, attempt, client_id",
            )
            .bind(experiment_id.to_string())
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(round, attempt, client)| {
                    Ok(Selection {
                        round,
                        attempt,
                        client_id: parse_uuid(&client)?,
                    })
                })
                .collect()
        })
    }

    /// One client's participation in a round attempt, `None` when it was not selected.
    /// The per-request lookup of the client protocol's routes: one row, where
    /// [`participations`](Self::participations) reads the whole round.
    pub async fn participation(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        client: Uuid,
    ) -> Result<Option<Participation>, StoreError> {
        with_pool!(self, p => {
            let row: Option<ParticipationRow> =
                sqlx::query_as(
                    "SELECT client_id, state, selected_at, uploaded_at, num_samples, train_loss, \
                     secagg_index, secagg_stage, dropped_stage, bytes_up, bytes_down \
                     FROM participations WHERE experiment_id = $1 AND round = $2 AND attempt = $3 \
                     AND client_id = $4",
                )
                .bind(experiment_id.to_string())
                .bind(round)
                .bind(attempt)
                .bind(client.to_string())
                .fetch_optional(p)
                .await?;
            row.map(participation_from_row).transpose()
        })
    }

    /// Whether `client` takes part in experiment `experiment_id`: it was selected for
    /// one of its rounds (or, under FedBuff, handed one of its tasks), whatever became
    /// of that. Only such a client may fetch the experiment's model or report on it:
    /// nothing else ties a client to an experiment (any available client may be
    /// selected), so this is the whole of eligibility.
    pub async fn takes_part(&self, experiment_id: Uuid, client: Uuid) -> Result<bool, StoreError> {
        with_pool!(self, p => {
            let row: Option<(String,)> = sqlx::query_as(
                "SELECT client_id FROM participations WHERE client_id = $1 \
                 AND experiment_id = $2 LIMIT 1",
            )
            .bind(client.to_string())
            .bind(experiment_id.to_string())
            .fetch_optional(p)
            .await?;
            Ok(row.is_some())
        })
    }

    /// Records a durable upload. Refused, with nothing changed, unless the round attempt
    /// is collecting, its deadline has not passed, and the client is selected and has not
    /// uploaded yet (a replay is a conflict).
    pub async fn record_upload(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        upload: &NewUpload<'_>,
        now: i64,
    ) -> Result<Upload, StoreError> {
        let exp = experiment_id.to_string();
        let lock = self.for_update();
        let client = upload.client_id.to_string();
        let id = Uuid::new_v4();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let stage: Option<(String, Option<i64>, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT stage, stage_deadline, secagg FROM rounds \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3{lock}"
            )))
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((stage, deadline_ms, secagg)) = stage else {
                return Err(StoreError::NotFound(format!("round {round} attempt {attempt}")));
            };
            let view = RoundView {
                round,
                attempt,
                stage: parse_stage(&stage)?,
                deadline_ms,
                secure: secagg.is_some(),
            };
            let part: Option<(String, Option<String>)> = sqlx::query_as(
                "SELECT state, secagg_stage FROM participations WHERE experiment_id = $1 AND round = $2 \
                 AND attempt = $3 AND client_id = $4",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(&client)
            .fetch_optional(&mut *tx)
            .await?;
            let part = match part {
                None => None,
                Some((state, secure_stage)) => Some(ParticipationView {
                    state: parse_participation(&state)?,
                    // Only clients whose key shares went out (U2) may add a masked input.
                    shared_keys: secure_stage.as_deref() == Some("shared"),
                }),
            };
            check_upload(&view, part.as_ref(), now)?;
            let secure = view.secure;
            // With secure aggregation the weight and loss travel inside the masked
            // vector; the row keeps neither.
            let (samples, loss) = if secure {
                (None, None)
            } else {
                (Some(upload.num_samples), upload.train_loss)
            };
            let moved = sqlx::query(
                "UPDATE participations SET state = 'uploaded', uploaded_at = $1, num_samples = $2, \
                 train_loss = $3, secagg_stage = CASE WHEN secagg_index IS NULL THEN NULL \
                 ELSE 'masked' END, bytes_up = $8 WHERE experiment_id = $4 AND round = $5 \
                 AND attempt = $6 AND client_id = $7 AND state = 'selected'",
            )
            .bind(now)
            .bind(samples)
            .bind(loss)
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(&client)
            .bind(upload.wire_bytes.unwrap_or(upload.bytes))
            .execute(&mut *tx)
            .await?;
            if moved.rows_affected() != 1 {
                return Err(UploadRefusal::AlreadyUploaded { round }.into());
            }
            sqlx::query(
                "INSERT INTO uploads (id, experiment_id, round, attempt, client_id, blob_path, \
                 bytes, sha256, created_at, num_samples, client_upload_id) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            )
            .bind(id.to_string())
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(&client)
            .bind(upload.blob_path)
            .bind(upload.bytes)
            .bind(upload.sha256)
            .bind(now)
            .bind(upload.num_samples)
            .bind(upload.client_upload_id.map(|u| u.to_string()))
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE rounds SET reported = reported + 1 \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .execute(&mut *tx)
            .await?;
            if let (Some(claimed), false) = (upload.claimed_samples, secure) {
                audit!(tx, now, &client, "upload.weight_capped", exp.as_str(),
                    capped_detail(round, attempt, claimed, upload.num_samples));
            }
            tx.commit().await?;
        });
        Ok(upload.recorded(id))
    }

    /// Closes collection: clients that did not upload are dropped, and the attempt moves
    /// to aggregating with at least `quorum` uploads, or fails without. Moving to
    /// aggregating queues the round's aggregation job (with `job_attempts` attempts) in
    /// the same transaction, so a coordinator that dies right after the close cannot
    /// leave a round aggregating with no job to finish it.
    pub async fn close_collection(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        quorum: i64,
        job_attempts: i64,
        now: i64,
    ) -> Result<Round, StoreError> {
        if job_attempts < 1 {
            return Err(StoreError::conflict(
                super::ConflictKind::InvalidArgument,
                format!("a job needs at least one attempt, got {job_attempts}"),
            ));
        }
        let exp = experiment_id.to_string();
        let lock = self.for_update();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let row: Option<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT stage, reported FROM rounds \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3{lock}"
            )))
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .fetch_optional(&mut *tx)
            .await?;
            let (stage, reported) =
                row.ok_or_else(|| StoreError::NotFound(format!("round {round} attempt {attempt}")))?;
            if stage != "collecting" {
                return Err(StoreError::conflict(super::ConflictKind::StageMoved, format!(
                    "round {round} attempt {attempt} is {stage}, not collecting"
                )));
            }
            let dropped = sqlx::query(
                "UPDATE participations SET state = 'dropped' WHERE experiment_id = $1 \
                 AND round = $2 AND attempt = $3 AND state = 'selected'",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .execute(&mut *tx)
            .await?
            .rows_affected() as i64;
            let aggregate = cohort_core::round::close_outcome(
                usize::try_from(reported).unwrap_or(0),
                usize::try_from(quorum).unwrap_or(usize::MAX),
            ) == cohort_core::round::CloseOutcome::Aggregate;
            let next = if aggregate { "aggregating" } else { "failed" };
            // A failed attempt says why, as every other failure does.
            let failure = (!aggregate).then(|| {
                format!("{reported} uploads by the close, below the quorum of {quorum}")
            });
            sqlx::query(
                "UPDATE rounds SET stage = $1, dropped = dropped + $2, \
                 finished_at = CASE WHEN $1 = 'failed' THEN $3 ELSE NULL END, \
                 failure = COALESCE($7, failure) \
                 WHERE experiment_id = $4 AND round = $5 AND attempt = $6",
            )
            .bind(next)
            .bind(dropped)
            .bind(now)
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(failure)
            .execute(&mut *tx)
            .await?;
            if aggregate {
                sqlx::query(super::jobs::ENQUEUE_JOB_SQL)
                .bind(super::JobKind::Aggregate.as_str())
                .bind(&exp)
                .bind(round)
                .bind(job_attempts)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
            audit!(tx, now, "coordinator", "round.close", exp.as_str(), format!("round {round} attempt {attempt}: {next}, {reported} uploads, {dropped} dropped"));
            tx.commit().await?;
        });
        self.round(experiment_id, round, attempt).await
    }

    /// Fails round `round` attempt `attempt` when it is still aggregating and its latest
    /// aggregation job has failed for good (every attempt used): a round whose uploads
    /// cannot be folded must not hold its experiment for ever. The driver then runs the
    /// round again as its next attempt, as after a missed quorum. One transaction checks
    /// both, so a replica that raced another fails the round once; returns whether this
    /// call failed it.
    pub async fn fail_round_if_aggregation_failed(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        now: i64,
    ) -> Result<bool, StoreError> {
        let exp = experiment_id.to_string();
        with_pool!(self, p => {
            // The driver asks on every tick while a round aggregates: a plain read
            // answers the usual case (the job still has attempts) without taking the
            // write lock; the transaction below checks again.
            if failed_aggregation!(p, &exp, round).is_none() {
                return Ok(false);
            }
            let mut tx = p.begin_write().await?;
            let Some(reason) = failed_aggregation!(&mut *tx, &exp, round) else {
                return Ok(false);
            };
            let moved = sqlx::query(
                "UPDATE rounds SET stage = 'failed', failure = $1, finished_at = $2 \
                 WHERE experiment_id = $3 AND round = $4 AND attempt = $5 AND stage = 'aggregating'",
            )
            .bind(&reason)
            .bind(now)
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if moved == 0 {
                return Ok(false);
            }
            audit!(tx, now, "coordinator", "round.fail", exp.as_str(), format!("round {round} attempt {attempt}: {reason}"));
            tx.commit().await?;
            Ok(true)
        })
    }

    /// The upload `client` sent to `experiment_id` under its own id `client_upload_id`,
    /// if one was stored: how a retried upload is recognised.
    pub async fn upload_by_client_id(
        &self,
        experiment_id: Uuid,
        client: Uuid,
        client_upload_id: Uuid,
    ) -> Result<Option<Upload>, StoreError> {
        with_pool!(self, p => {
            let row: Option<(String, String, String, i64, Vec<u8>, i64)> = sqlx::query_as(
                "SELECT id, client_id, blob_path, bytes, sha256, num_samples FROM uploads \
                 WHERE experiment_id = $1 AND client_id = $2 AND client_upload_id = $3",
            )
            .bind(experiment_id.to_string())
            .bind(client.to_string())
            .bind(client_upload_id.to_string())
            .fetch_optional(p)
            .await?;
            row.map(|(id, c, path, bytes, sha, n)| {
                Ok(Upload {
                    id: parse_uuid(&id)?,
                    client_id: parse_uuid(&c)?,
                    blob_path: path,
                    bytes,
                    sha256: sha,
                    num_samples: n,
                })
            })
            .transpose()
        })
    }

    /// The uploads of a round attempt, in upload-id order, for the aggregation job.
    pub async fn uploads(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
    ) -> Result<Vec<Upload>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(String, String, String, i64, Vec<u8>, i64)> = sqlx::query_as(
                "SELECT id, client_id, blob_path, bytes, sha256, num_samples FROM uploads \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3 ORDER BY id",
            )
            .bind(experiment_id.to_string())
            .bind(round)
            .bind(attempt)
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(id, c, path, bytes, sha, n)| {
                    Ok(Upload {
                        id: parse_uuid(&id)?,
                        client_id: parse_uuid(&c)?,
                        blob_path: path,
                        bytes,
                        sha256: sha,
                        num_samples: n,
                    })
                })
                .collect()
        })
    }

    /// Stores the model of round 0 (the initial one) or of a round that is aggregating,
    /// which then becomes published with `metrics`.
    pub async fn publish_model(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        model: &PublishedModel,
        metrics: RoundMetrics,
        now: i64,
    ) -> Result<(), StoreError> {
        self.publish_private_model(
            RoundKey::new(experiment_id, round, attempt),
            model,
            metrics,
            None,
            now,
        )
        .await
    }

    /// [`publish_model`](Self::publish_model) for a private round, whose privacy record
    /// is replaced by `privacy` (what it was finally charged, the next clip) in the same
    /// transaction; `None` leaves the record as it is.
    pub async fn publish_private_model(
        &self,
        key: RoundKey,
        model: &PublishedModel,
        metrics: RoundMetrics,
        privacy: Option<&RoundPrivacy>,
        now: i64,
    ) -> Result<(), StoreError> {
        let RoundKey {
            experiment: experiment_id,
            round,
            attempt,
        } = key;
        let exp = experiment_id.to_string();
        let privacy = privacy.map(|p| serde_json::to_string(p).expect("privacy records serialise"));
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            if round > 0 {
                let moved = sqlx::query(
                    "UPDATE rounds SET stage = 'published', finished_at = $1, test_accuracy = $2, \
                     test_loss = $3, train_loss = $4, privacy = COALESCE($8, privacy) \
                     WHERE experiment_id = $5 AND round = $6 \
                     AND attempt = $7 AND stage = 'aggregating'",
                )
                .bind(now)
                .bind(metrics.test_accuracy)
                .bind(metrics.test_loss)
                .bind(metrics.train_loss)
                .bind(&exp)
                .bind(round)
                .bind(attempt)
                .bind(&privacy)
                .execute(&mut *tx)
                .await?;
                if moved.rows_affected() != 1 {
                    return Err(StoreError::conflict(super::ConflictKind::StageMoved, format!(
                        "round {round} attempt {attempt} is not aggregating"
                    )));
                }
            }
            sqlx::query(
                "INSERT INTO models (experiment_id, round, blob_path, parameters, created_at) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(&exp)
            .bind(round)
            .bind(&model.blob_path)
            .bind(model.parameters)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// The newest published model of an experiment.
    pub async fn latest_model(
        &self,
        experiment_id: Uuid,
    ) -> Result<Option<PublishedModel>, StoreError> {
        with_pool!(self, p => {
            let row: Option<(i64, String, i64)> = sqlx::query_as(
                "SELECT round, blob_path, parameters FROM models WHERE experiment_id = $1 \
                 ORDER BY round DESC LIMIT 1",
            )
            .bind(experiment_id.to_string())
            .fetch_optional(p)
            .await?;
            Ok(row.map(|(round, blob_path, parameters)| PublishedModel {
                round,
                blob_path,
                parameters,
            }))
        })
    }
}

/// A collecting round a client is selected for and has not uploaded to yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PendingTask {
    /// The experiment.
    pub experiment_id: Uuid,
    /// The round.
    pub round: i64,
    /// The attempt.
    pub attempt: i64,
    /// When collection closes, Unix ms (with secure aggregation: when advertising does).
    pub deadline: Option<i64>,
    /// Secure aggregation's round settings (JSON) for a secure round.
    pub secagg: Option<String>,
    /// The client's index in a secure round.
    pub secagg_index: Option<i64>,
}

/// experiment_id, round, attempt, stage_deadline, secagg, secagg_index.
type PendingRow = (String, i64, i64, Option<i64>, Option<String>, Option<i64>);

impl Store {
    /// The oldest round attempt that `client` is selected for and should start now: a
    /// plain round collecting uploads it has not uploaded to, or a secure round
    /// collecting public keys it has not advertised; never one it reported it could not
    /// complete. (FedBuff tasks are not rounds a client
    /// is selected for; [`fedbuff_task`](Self::fedbuff_task) hands them out.)
    pub async fn pending_task(&self, client: Uuid) -> Result<Option<PendingTask>, StoreError> {
        with_pool!(self, p => {
            let row: Option<PendingRow> = sqlx::query_as(
                "SELECT p.experiment_id, p.round, p.attempt, r.stage_deadline, r.secagg, p.secagg_index \
                 FROM participations p JOIN rounds r ON r.experiment_id = p.experiment_id \
                   AND r.round = p.round AND r.attempt = p.attempt \
                 WHERE p.client_id = $1 AND p.state = 'selected' AND p.base_version IS NULL \
                   AND ((r.stage = 'collecting' AND r.secagg IS NULL) \
                     OR (r.stage = 'advertising' AND p.secagg_stage IS NULL)) \
                   AND NOT EXISTS (SELECT 1 FROM task_failures f \
                     WHERE f.experiment_id = p.experiment_id AND f.round = p.round \
                       AND f.attempt = p.attempt AND f.client_id = p.client_id) \
                 ORDER BY r.started_at LIMIT 1",
            )
            .bind(client.to_string())
            .fetch_optional(p)
            .await?;
            row.map(|(e, round, attempt, deadline, secagg, index)| {
                Ok(PendingTask {
                    experiment_id: parse_uuid(&e)?,
                    round,
                    attempt,
                    deadline,
                    secagg,
                    secagg_index: index,
                })
            })
            .transpose()
        })
    }

    /// Clients not revoked and seen at or after `since` (Unix ms), in id order: the pool
    /// a round selects from.
    pub async fn available_clients(&self, since: i64) -> Result<Vec<Uuid>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(String,)> = sqlx::query_as(
                "SELECT id FROM clients WHERE revoked_at IS NULL AND last_seen_at >= $1 ORDER BY id",
            )
            .bind(since)
            .fetch_all(p)
            .await?;
            rows.into_iter().map(|(id,)| parse_uuid(&id)).collect()
        })
    }

    /// The newest attempt of the newest round of an experiment.
    pub async fn latest_round(&self, experiment_id: Uuid) -> Result<Option<Round>, StoreError> {
        with_pool!(self, p => {
            let row: Option<RoundRow> = sqlx::query_as(
                select_rounds!("WHERE experiment_id = $1 ORDER BY round DESC, attempt DESC LIMIT 1"),
            )
            .bind(experiment_id.to_string())
            .fetch_optional(p)
            .await?;
            row.map(Round::from_row).transpose()
        })
    }
}

/// The audit detail of an upload whose claimed sample count was capped.
pub(crate) fn capped_detail(round: i64, attempt: i64, claimed: i64, counted: i64) -> String {
    format!(
        "round {round} attempt {attempt}: {claimed} samples claimed, counted as {counted} \
         (the experiment's max_weight)"
    )
}

fn participation_from_row(
    (c, s, sel, up, n, loss, index, stage, dropped, bytes_up, bytes_down): ParticipationRow,
) -> Result<Participation, StoreError> {
    Ok(Participation {
        bytes_up,
        bytes_down,
        client_id: parse_uuid(&c)?,
        state: parse_participation(&s)?,
        selected_at: sel,
        uploaded_at: up,
        num_samples: n,
        train_loss: loss,
        secagg_index: index,
        secagg_stage: stage,
        dropped_stage: dropped,
    })
}
