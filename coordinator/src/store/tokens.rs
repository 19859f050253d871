//! Enrolment tokens and enrolled clients. Only hashes of tokens and client secrets are
//! stored: a copy of the database lets nobody enrol or act as a client.

use serde::Serialize;
use uuid::Uuid;

use super::{BeginWrite, Pool, Store, StoreError, audit, now_millis, parse_uuid, with_pool};

/// A one-time enrolment token, as an admin sees it (never the token itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct EnrolmentToken {
    /// Identifier, for listing and revoking.
    pub id: Uuid,
    /// What the admin called it (e.g. the hospital it was handed to).
    pub label: String,
    /// Creation time, Unix ms.
    pub created_at: i64,
    /// After this time it no longer enrols, Unix ms.
    pub expires_at: Option<i64>,
    /// When it was used, Unix ms.
    pub used_at: Option<i64>,
    /// The client it enrolled.
    pub used_by: Option<Uuid>,
    /// When an admin revoked it, Unix ms.
    pub revoked_at: Option<i64>,
}

pub(super) type TokenRow = (
    String,
    String,
    i64,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
);

impl EnrolmentToken {
    pub(super) fn from_row(row: TokenRow) -> Result<Self, StoreError> {
        let (id, label, created_at, expires_at, used_at, used_by, revoked_at) = row;
        Ok(Self {
            id: parse_uuid(&id)?,
            label,
            created_at,
            expires_at,
            used_at,
            used_by: used_by.as_deref().map(parse_uuid).transpose()?,
            revoked_at,
        })
    }
}

/// An enrolled client, as an admin sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Client {
    /// Identifier; with its secret, the client's credential.
    pub id: Uuid,
    /// The label of the token it enrolled with.
    pub label: String,
    /// Enrolment time, Unix ms.
    pub enrolled_at: i64,
    /// Last authenticated request, Unix ms.
    pub last_seen_at: Option<i64>,
    /// When an admin revoked it, Unix ms; a revoked client is refused everything.
    pub revoked_at: Option<i64>,
}

pub(super) type ClientRow = (String, String, i64, Option<i64>, Option<i64>);

/// A token as enrolment checks it: id, label, expires_at, used_at, revoked_at.
type SpendableToken = (String, String, Option<i64>, Option<i64>, Option<i64>);

/// A client row with its secret hash first.
type CredentialRow = (Vec<u8>, String, String, i64, Option<i64>, Option<i64>);

impl Client {
    pub(super) fn from_row(row: ClientRow) -> Result<Self, StoreError> {
        let (id, label, enrolled_at, last_seen_at, revoked_at) = row;
        Ok(Self {
            id: parse_uuid(&id)?,
            label,
            enrolled_at,
            last_seen_at,
            revoked_at,
        })
    }
}

impl Store {
    /// Stores a new enrolment token by its hash.
    pub async fn create_enrolment_token(
        &self,
        token_hash: &[u8],
        label: &str,
        expires_at: Option<i64>,
    ) -> Result<EnrolmentToken, StoreError> {
        let now = now_millis();
        let id = Uuid::new_v4();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            sqlx::query(
                "INSERT INTO enrolment_tokens (id, token_hash, label, created_at, expires_at) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(id.to_string())
            .bind(token_hash)
            .bind(label)
            .bind(now)
            .bind(expires_at)
            .execute(&mut *tx)
            .await?;
            audit!(tx, now, super::admin_actor(), "token.create", id.to_string(), label);
            tx.commit().await?;
        });
        Ok(EnrolmentToken {
            id,
            label: label.to_string(),
            created_at: now,
            expires_at,
            used_at: None,
            used_by: None,
            revoked_at: None,
        })
    }

    /// Every enrolment token, newest first.
    pub async fn enrolment_tokens(&self) -> Result<Vec<EnrolmentToken>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<TokenRow> = sqlx::query_as(
                "SELECT id, label, created_at, expires_at, used_at, used_by, revoked_at \
                 FROM enrolment_tokens ORDER BY created_at DESC, id",
            )
            .fetch_all(p)
            .await?;
            rows.into_iter().map(EnrolmentToken::from_row).collect()
        })
    }

    /// Revokes an unused token; a used or already revoked one is a conflict.
    pub async fn revoke_enrolment_token(&self, id: Uuid) -> Result<(), StoreError> {
        let now = now_millis();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let done = sqlx::query(
                "UPDATE enrolment_tokens SET revoked_at = $1 \
                 WHERE id = $2 AND used_at IS NULL AND revoked_at IS NULL",
            )
            .bind(now)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 0 {
                let exists: Option<(String,)> =
                    sqlx::query_as("SELECT id FROM enrolment_tokens WHERE id = $1")
                        .bind(id.to_string())
                        .fetch_optional(&mut *tx)
                        .await?;
                return Err(match exists {
                    None => StoreError::NotFound(format!("enrolment token {id}")),
                    Some(_) => StoreError::conflict(super::ConflictKind::TokenSpent, format!(
                        "enrolment token {id} is already used or revoked"
                    )),
                });
            }
            audit!(tx, now, super::admin_actor(), "token.revoke", id.to_string(), "");
            tx.commit().await?;
        });
        Ok(())
    }

    /// Spends the token whose hash is `token_hash` and enrols a client whose secret hashes
    /// to `secret_hash`. The token is marked used in the same transaction, conditionally,
    /// so two clients racing with one token cannot both enrol.
    pub async fn enrol(
        &self,
        token_hash: &[u8],
        secret_hash: &[u8],
        now: i64,
    ) -> Result<Client, StoreError> {
        let client_id = Uuid::new_v4();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let token: Option<SpendableToken> =
                sqlx::query_as(
                    "SELECT id, label, expires_at, used_at, revoked_at \
                     FROM enrolment_tokens WHERE token_hash = $1",
                )
                .bind(token_hash)
                .fetch_optional(&mut *tx)
                .await?;
            let Some((token_id, label, expires_at, used_at, revoked_at)) = token else {
                return Err(StoreError::TokenRefused("unknown enrolment token"));
            };
            if revoked_at.is_some() {
                return Err(StoreError::TokenRefused("enrolment token revoked"));
            }
            if used_at.is_some() {
                return Err(StoreError::TokenRefused("enrolment token already used"));
            }
            if expires_at.is_some_and(|t| t <= now) {
                return Err(StoreError::TokenRefused("enrolment token expired"));
            }
            let spent = sqlx::query(
                "UPDATE enrolment_tokens SET used_at = $1, used_by = $2 \
                 WHERE id = $3 AND used_at IS NULL AND revoked_at IS NULL",
            )
            .bind(now)
            .bind(client_id.to_string())
            .bind(&token_id)
            .execute(&mut *tx)
            .await?;
            if spent.rows_affected() != 1 {
                return Err(StoreError::TokenRefused("enrolment token already used"));
            }
            sqlx::query(
                "INSERT INTO clients (id, secret_hash, label, token_id, enrolled_at) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(client_id.to_string())
            .bind(secret_hash)
            .bind(&label)
            .bind(&token_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            audit!(tx, now, client_id.to_string(), "client.enrol", token_id.as_str(), label.as_str());
            tx.commit().await?;
            Ok(Client {
                id: client_id,
                label,
                enrolled_at: now,
                last_seen_at: None,
                revoked_at: None,
            })
        })
    }

    /// The stored secret hash and record of client `id`, for authenticating it.
    pub async fn client_credential(&self, id: Uuid) -> Result<(Vec<u8>, Client), StoreError> {
        with_pool!(self, p => {
            let row: Option<CredentialRow> =
                sqlx::query_as(
                    "SELECT secret_hash, id, label, enrolled_at, last_seen_at, revoked_at \
                     FROM clients WHERE id = $1",
                )
                .bind(id.to_string())
                .fetch_optional(p)
                .await?;
            let (hash, id_text, label, enrolled_at, last_seen_at, revoked_at) =
                row.ok_or_else(|| StoreError::NotFound(format!("client {id}")))?;
            let client = Client::from_row((id_text, label, enrolled_at, last_seen_at, revoked_at))?;
            Ok((hash, client))
        })
    }

    /// Records that client `id` was seen at `now`.
    pub async fn touch_client(&self, id: Uuid, now: i64) -> Result<(), StoreError> {
        with_pool!(self, p => {
            sqlx::query("UPDATE clients SET last_seen_at = $1 WHERE id = $2")
                .bind(now)
                .bind(id.to_string())
                .execute(p)
                .await?;
        });
        Ok(())
    }

    /// Every enrolled client, in enrolment order.
    pub async fn clients(&self) -> Result<Vec<Client>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<ClientRow> = sqlx::query_as(
                "SELECT id, label, enrolled_at, last_seen_at, revoked_at FROM clients \
                 ORDER BY enrolled_at, id",
            )
            .fetch_all(p)
            .await?;
            rows.into_iter().map(Client::from_row).collect()
        })
    }

    /// Revokes client `id`: from now on every request with its credential is refused.
    pub async fn revoke_client(&self, id: Uuid) -> Result<(), StoreError> {
        let now = now_millis();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let done = sqlx::query(
                "UPDATE clients SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL",
            )
            .bind(now)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 0 {
                let exists: Option<(String,)> = sqlx::query_as("SELECT id FROM clients WHERE id = $1")
                    .bind(id.to_string())
                    .fetch_optional(&mut *tx)
                    .await?;
                return Err(match exists {
                    None => StoreError::NotFound(format!("client {id}")),
                    Some(_) => StoreError::conflict(super::ConflictKind::AlreadyRevoked, format!("client {id} is already revoked")),
                });
            }
            // Out of the plain rounds it is in: the round stops waiting for an upload
            // that can no longer come (its credential is refused from now on). A FedBuff
            // task (a participation with a base version) frees its slot whatever its
            // buffer's stage. A secure round drops it at its next stage deadline, as the
            // protocol drops any client that goes silent.
            let rounds: Vec<(String, i64, i64)> = sqlx::query_as(
                "UPDATE participations SET state = 'dropped', dropped_stage = 'revoked' \
                 WHERE client_id = $1 \
                 AND state = 'selected' AND (base_version IS NOT NULL OR EXISTS ( \
                   SELECT 1 FROM rounds r WHERE r.experiment_id = participations.experiment_id \
                   AND r.round = participations.round AND r.attempt = participations.attempt \
                   AND r.stage = 'collecting' AND r.secagg IS NULL)) \
                 RETURNING experiment_id, round, attempt",
            )
            .bind(id.to_string())
            .fetch_all(&mut *tx)
            .await?;
            for (experiment, round, attempt) in &rounds {
                sqlx::query(
                    "UPDATE rounds SET dropped = dropped + 1 \
                     WHERE experiment_id = $1 AND round = $2 AND attempt = $3",
                )
                .bind(experiment)
                .bind(round)
                .bind(attempt)
                .execute(&mut *tx)
                .await?;
            }
            let detail = match rounds.len() {
                0 => String::new(),
                n => format!("dropped from {n} open round(s)"),
            };
            audit!(tx, now, super::admin_actor(), "client.revoke", id.to_string(), detail);
            tx.commit().await?;
        });
        Ok(())
    }
}
