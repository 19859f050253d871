//! Secure aggregation's rows: the protocol messages the coordinator routes between
//! clients (public keys, encrypted shares, revealed shares), and the stage changes of a
//! secure round. Masked inputs are ordinary uploads.
//!
//! The store checks only what it can see in its rows (the round's stage and deadline,
//! the client's progress); the content of a message is checked against the protocol by
//! the caller before it is recorded.

use serde::Serialize;
use uuid::Uuid;

use super::{
    BeginWrite, Pool, Round, RoundKey, RoundStage, Store, StoreError, audit, parse_uuid, with_pool,
};

/// Which protocol message a client sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SecAggMessageKind {
    /// Signed public keys and graph commitment, with the identity they were checked
    /// under.
    Advertise,
    /// The graph nonce.
    Reveal,
    /// Encrypted shares for the neighbours.
    Share,
    /// A signature over the survivor list (consistency check).
    Confirm,
    /// Revealed shares.
    Unmask,
    /// Revealed shares of which one did not match its owner's commitment. Kept as the
    /// evidence for which the client is excluded from unmasking.
    Forged,
}

impl SecAggMessageKind {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            SecAggMessageKind::Advertise => "advertise",
            SecAggMessageKind::Reveal => "reveal",
            SecAggMessageKind::Share => "share",
            SecAggMessageKind::Confirm => "confirm",
            SecAggMessageKind::Unmask => "unmask",
            SecAggMessageKind::Forged => "forged",
        }
    }

    /// The round stage that accepts it.
    pub fn round_stage(self) -> RoundStage {
        match self {
            SecAggMessageKind::Advertise => RoundStage::Advertising,
            SecAggMessageKind::Reveal => RoundStage::Revealing,
            SecAggMessageKind::Share => RoundStage::Sharing,
            SecAggMessageKind::Confirm => RoundStage::Confirming,
            SecAggMessageKind::Unmask | SecAggMessageKind::Forged => RoundStage::Unmasking,
        }
    }

    /// The client's progress it may be at before (`None`: fresh) and after the
    /// message. Unmasking follows masking directly, or confirming with the consistency
    /// check (which the protocol checks; the store sees only rows).
    fn progress(self) -> (&'static [Option<&'static str>], &'static str) {
        match self {
            SecAggMessageKind::Advertise => (&[None], "advertised"),
            SecAggMessageKind::Reveal => (&[Some("advertised")], "revealed"),
            SecAggMessageKind::Share => (&[Some("revealed")], "shared"),
            SecAggMessageKind::Confirm => (&[Some("masked")], "confirmed"),
            SecAggMessageKind::Unmask => (&[Some("masked"), Some("confirmed")], "unmasked"),
            SecAggMessageKind::Forged => (&[Some("masked"), Some("confirmed")], "excluded"),
        }
    }
}

/// A stored protocol message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecAggMessage {
    /// The sender.
    pub client_id: Uuid,
    /// The sender's protocol index.
    pub index: u32,
    /// The message as JSON.
    pub body: String,
}

/// Where a secure round goes when its current stage ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecureNext {
    /// To the next protocol stage, open until `deadline` (Unix ms).
    Stage {
        /// The next stage.
        to: RoundStage,
        /// When it closes.
        deadline: i64,
    },
    /// To aggregation: the job that unmasks the sum is queued in the same transaction.
    Aggregate {
        /// Attempts the job gets.
        job_attempts: i64,
    },
    /// The attempt fails, for `reason`.
    Fail {
        /// Why, for the admin.
        reason: String,
    },
}

impl Store {
    /// Records client `client`'s protocol message of `kind`. Refused, with nothing
    /// changed, unless the round is at the stage that takes it, before its deadline,
    /// and the client is in the round and has completed exactly the stage before.
    pub async fn record_secagg_message(
        &self,
        key: RoundKey,
        client: Uuid,
        kind: SecAggMessageKind,
        body: &str,
        now: i64,
    ) -> Result<(), StoreError> {
        let RoundKey {
            experiment: experiment_id,
            round,
            attempt,
        } = key;
        let exp = experiment_id.to_string();
        let lock = self.for_update();
        let client_text = client.to_string();
        let (before, after) = kind.progress();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let row: Option<(String, Option<i64>, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT stage, stage_deadline, secagg FROM rounds \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3{lock}"
            )))
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .fetch_optional(&mut *tx)
            .await?;
            let (stage, deadline, secagg) =
                row.ok_or_else(|| StoreError::NotFound(format!("round {round} attempt {attempt}")))?;
            if secagg.is_none() {
                return Err(StoreError::conflict(super::ConflictKind::NotSecure, format!(
                    "round {round} attempt {attempt} does not use secure aggregation"
                )));
            }
            let wanted = kind.round_stage().as_str();
            if stage != wanted {
                return Err(StoreError::conflict(super::ConflictKind::WrongStage, format!(
                    "round {round} attempt {attempt} is {stage}, not {wanted}"
                )));
            }
            if deadline.is_some_and(|d| now > d) {
                return Err(StoreError::conflict(super::ConflictKind::StageDeadlinePassed, format!(
                    "round {round} attempt {attempt} stopped {wanted} at its deadline"
                )));
            }
            let part: Option<(String, Option<String>)> = sqlx::query_as(
                "SELECT state, secagg_stage FROM participations WHERE experiment_id = $1 \
                 AND round = $2 AND attempt = $3 AND client_id = $4",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(&client_text)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((state, progress)) = part else {
                return Err(StoreError::conflict(super::ConflictKind::NotSelected, format!(
                    "client {client} is not selected for round {round}"
                )));
            };
            if progress.as_deref() == Some(after) {
                return Err(StoreError::conflict(super::ConflictKind::AlreadySent, format!(
                    "client {client} already sent its {} message in round {round}",
                    kind.as_str()
                )));
            }
            if !before.contains(&progress.as_deref()) || state == "dropped" {
                return Err(StoreError::conflict(super::ConflictKind::NotAtStage, format!(
                    "client {client} is not at the {} stage of round {round}",
                    kind.as_str()
                )));
            }
            sqlx::query(
                "INSERT INTO secagg_messages (experiment_id, round, attempt, client_id, stage, \
                 body, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(&client_text)
            .bind(kind.as_str())
            .bind(body)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE participations SET secagg_stage = $1 WHERE experiment_id = $2 \
                 AND round = $3 AND attempt = $4 AND client_id = $5",
            )
            .bind(after)
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .bind(&client_text)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// The stored messages of `kind` in a round attempt, in protocol index order.
    pub async fn secagg_messages(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        kind: SecAggMessageKind,
    ) -> Result<Vec<SecAggMessage>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(String, Option<i64>, String)> = sqlx::query_as(
                "SELECT m.client_id, p.secagg_index, m.body FROM secagg_messages m \
                 JOIN participations p ON p.experiment_id = m.experiment_id AND p.round = m.round \
                   AND p.attempt = m.attempt AND p.client_id = m.client_id \
                 WHERE m.experiment_id = $1 AND m.round = $2 AND m.attempt = $3 AND m.stage = $4 \
                 ORDER BY p.secagg_index",
            )
            .bind(experiment_id.to_string())
            .bind(round)
            .bind(attempt)
            .bind(kind.as_str())
            .fetch_all(p)
            .await?;
            rows.into_iter()
                .map(|(c, index, body)| {
                    let index = index
                        .and_then(|i| u32::try_from(i).ok())
                        .ok_or_else(|| StoreError::Corrupt(format!("secagg index of {c}")))?;
                    Ok(SecAggMessage {
                        client_id: parse_uuid(&c)?,
                        index,
                        body,
                    })
                })
                .collect()
        })
    }

    /// Ends stage `from` of a secure round attempt: clients that did not complete it are
    /// marked as dropped there, and the round moves on as `next` says, all in one
    /// transaction. A conflict when the round is no longer at `from` (another
    /// coordinator moved it first).
    pub async fn advance_secure_round(
        &self,
        experiment_id: Uuid,
        round: i64,
        attempt: i64,
        from: RoundStage,
        next: &SecureNext,
        now: i64,
    ) -> Result<Round, StoreError> {
        if let SecureNext::Aggregate { job_attempts } = next
            && *job_attempts < 1
        {
            return Err(StoreError::conflict(
                super::ConflictKind::InvalidArgument,
                format!("a job needs at least one attempt, got {job_attempts}"),
            ));
        }
        let (laggards, dropped_stage, drop_them) = stage_laggards(from, next)?;
        let exp = experiment_id.to_string();
        let lock = self.for_update();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let row: Option<(String, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT stage, secagg FROM rounds \
                 WHERE experiment_id = $1 AND round = $2 AND attempt = $3{lock}"
            )))
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .fetch_optional(&mut *tx)
            .await?;
            let (stage, secagg) =
                row.ok_or_else(|| StoreError::NotFound(format!("round {round} attempt {attempt}")))?;
            if secagg.is_none() || stage != from.as_str() {
                return Err(StoreError::conflict(super::ConflictKind::StageMoved, format!(
                    "round {round} attempt {attempt} is {stage}, not a secure round {}",
                    from.as_str()
                )));
            }
            let new_state = if drop_them { "'dropped'" } else { "state" };
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE participations SET state = {new_state}, dropped_stage = $1 \
                 WHERE experiment_id = $2 AND round = $3 AND attempt = $4 \
                 AND state <> 'dropped' AND {laggards}"
            )))
            .bind(dropped_stage)
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .execute(&mut *tx)
            .await?;
            let (dropped,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM participations WHERE experiment_id = $1 AND round = $2 \
                 AND attempt = $3 AND state = 'dropped'",
            )
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .fetch_one(&mut *tx)
            .await?;
            let (to, deadline, failure, finished) = match next {
                SecureNext::Stage { to, deadline } => (to.as_str(), Some(*deadline), None, None),
                SecureNext::Aggregate { .. } => ("aggregating", None, None, None),
                SecureNext::Fail { reason } => ("failed", None, Some(reason.as_str()), Some(now)),
            };
            sqlx::query(
                "UPDATE rounds SET stage = $1, stage_deadline = $2, failure = $3, \
                 finished_at = $4, dropped = $5 \
                 WHERE experiment_id = $6 AND round = $7 AND attempt = $8",
            )
            .bind(to)
            .bind(deadline)
            .bind(failure)
            .bind(finished)
            .bind(dropped)
            .bind(&exp)
            .bind(round)
            .bind(attempt)
            .execute(&mut *tx)
            .await?;
            if let SecureNext::Aggregate { job_attempts } = next {
                sqlx::query(super::jobs::ENQUEUE_JOB_SQL)
                    .bind(super::JobKind::Aggregate.as_str())
                    .bind(&exp)
                    .bind(round)
                    .bind(*job_attempts)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            }
            let detail = match failure {
                Some(reason) => format!("round {round} attempt {attempt}: {} -> failed: {reason}", from.as_str()),
                None => format!("round {round} attempt {attempt}: {} -> {to}, {dropped} dropped", from.as_str()),
            };
            audit!(tx, now, "coordinator", "round.advance", exp.as_str(), detail);
            tx.commit().await?;
        });
        self.round(experiment_id, round, attempt).await
    }
}

/// Who is behind when stage `from` of a secure round ends: the SQL condition that picks
/// them, the stage they are recorded as dropped at, and whether they leave the round
/// (a survivor that does not sign or reveal keeps its input in the sum).
fn stage_laggards(
    from: RoundStage,
    next: &SecureNext,
) -> Result<(&'static str, &'static str, bool), StoreError> {
    Ok(match from {
        RoundStage::Advertising => ("secagg_stage IS NULL", "advertise", true),
        RoundStage::Revealing => ("secagg_stage = 'advertised'", "reveal", true),
        RoundStage::Sharing => ("secagg_stage = 'revealed'", "share", true),
        RoundStage::Collecting => ("secagg_stage = 'shared'", "masked", true),
        // A survivor that does not sign or reveal keeps its input in the sum.
        RoundStage::Confirming => ("secagg_stage = 'masked'", "confirm", false),
        RoundStage::Unmasking => (
            "secagg_stage IN ('masked', 'confirmed') AND dropped_stage IS NULL",
            "unmask",
            false,
        ),
        // A sum that could not be unmasked: nobody is behind.
        RoundStage::Aggregating if matches!(next, SecureNext::Fail { .. }) => ("1 = 0", "", false),
        other => {
            return Err(StoreError::conflict(
                super::ConflictKind::StageMoved,
                format!("a secure round cannot advance from {}", other.as_str()),
            ));
        }
    })
}
