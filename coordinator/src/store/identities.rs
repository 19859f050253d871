//! Client identities: each client's long-term Ed25519 public key. A client registers it
//! once (at enrolment, or once afterwards); it never changes silently. A client that lost
//! its key is reset by an admin, and that is audited, because a swapped identity is
//! exactly what a coordinator that cheats would need to impersonate a site.

use std::collections::BTreeMap;

use uuid::Uuid;

use super::{BeginWrite, Pool, Store, StoreError, audit, parse_uuid, with_pool};

/// Bytes of an identity (an Ed25519 public key).
pub const IDENTITY_BYTES: usize = 32;

/// What a registration did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registered {
    /// The key is now the client's identity.
    New,
    /// The client already had exactly this key: nothing changed.
    Unchanged,
}

fn key_of(bytes: Vec<u8>, client: &str) -> Result<[u8; IDENTITY_BYTES], StoreError> {
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("identity of client {client}")))
}

impl Store {
    /// Makes `public_key` client `client`'s identity. Registering the same key again
    /// changes nothing; a different key while one is registered is a conflict (only an
    /// admin's [`reset_identity`](Self::reset_identity) clears it).
    pub async fn register_identity(
        &self,
        client: Uuid,
        public_key: &[u8; IDENTITY_BYTES],
        now: i64,
    ) -> Result<Registered, StoreError> {
        let id = client.to_string();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let known: Option<(Vec<u8>,)> =
                sqlx::query_as("SELECT public_key FROM client_identities WHERE client_id = $1")
                    .bind(&id)
                    .fetch_optional(&mut *tx)
                    .await?;
            if let Some((key,)) = known {
                return if key.as_slice() == public_key.as_slice() {
                    Ok(Registered::Unchanged)
                } else {
                    Err(StoreError::conflict(super::ConflictKind::IdentityConflict, format!(
                        "client {client} has another identity registered; an admin must reset it first"
                    )))
                };
            }
            let exists: Option<(String,)> = sqlx::query_as("SELECT id FROM clients WHERE id = $1")
                .bind(&id)
                .fetch_optional(&mut *tx)
                .await?;
            if exists.is_none() {
                return Err(StoreError::NotFound(format!("client {client}")));
            }
            sqlx::query(
                "INSERT INTO client_identities (client_id, public_key, registered_at) \
                 VALUES ($1, $2, $3)",
            )
            .bind(&id)
            .bind(public_key.as_slice())
            .bind(now)
            .execute(&mut *tx)
            .await?;
            audit!(tx, now, "client", "client.identity", id.clone(), "");
            tx.commit().await?;
        });
        Ok(Registered::New)
    }

    /// Client `client`'s identity, if it registered one.
    pub async fn client_identity(
        &self,
        client: Uuid,
    ) -> Result<Option<[u8; IDENTITY_BYTES]>, StoreError> {
        let id = client.to_string();
        with_pool!(self, p => {
            let row: Option<(Vec<u8>,)> =
                sqlx::query_as("SELECT public_key FROM client_identities WHERE client_id = $1")
                    .bind(&id)
                    .fetch_optional(p)
                    .await?;
            row.map(|(k,)| key_of(k, &id)).transpose()
        })
    }

    /// Every registered identity, by client.
    pub async fn client_identities(
        &self,
    ) -> Result<BTreeMap<Uuid, [u8; IDENTITY_BYTES]>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<(String, Vec<u8>)> =
                sqlx::query_as("SELECT client_id, public_key FROM client_identities")
                    .fetch_all(p)
                    .await?;
            rows.into_iter()
                .map(|(id, key)| Ok((parse_uuid(&id)?, key_of(key, &id)?)))
                .collect()
        })
    }

    /// Clears client `client`'s identity (an admin's act, audited), so that it can
    /// register a new one; `NotFound` when it has none.
    pub async fn reset_identity(&self, client: Uuid) -> Result<(), StoreError> {
        let id = client.to_string();
        let now = super::now_millis();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let done = sqlx::query("DELETE FROM client_identities WHERE client_id = $1")
                .bind(&id)
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() == 0 {
                return Err(StoreError::NotFound(format!("identity of client {client}")));
            }
            audit!(tx, now, super::admin_actor(), "client.identity_reset", id.clone(), "");
            tx.commit().await?;
        });
        Ok(())
    }
}
