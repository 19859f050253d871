//! People who use the admin API and the dashboard: each a name, a role and a token of
//! their own, of which only the SHA-256 is stored. The first admin is the admin token
//! from the settings (`COHORT_ADMIN_TOKEN`), which has no row here.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{BeginWrite, Pool, Store, StoreError, audit, now_millis, parse_uuid, with_pool};

/// What a person may do. Each role may do what the ones before it may.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything: experiments, rounds, models, clients, tokens' metadata, the
    /// audit log, metrics.
    Viewer,
    /// Runs experiments: creates, starts, pauses, resumes and stops them.
    Operator,
    /// Manages who takes part and who administers: clients, enrolment tokens, users,
    /// models.
    Admin,
}

impl Role {
    /// The role's name, as stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "viewer" => Ok(Role::Viewer),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            other => Err(format!(
                "`{other}` is not a role (viewer, operator or admin)"
            )),
        }
    }
}

/// A person, as an admin sees them (never their token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct User {
    /// Identifier; the first part of the person's token.
    pub id: Uuid,
    /// The name the audit log and the dashboard show.
    pub name: String,
    /// What they may do.
    pub role: Role,
    /// Creation time, Unix ms.
    pub created_at: i64,
    /// Who created them (an audit actor).
    pub created_by: String,
    /// When an admin revoked them, Unix ms; a revoked person's token is refused.
    pub revoked_at: Option<i64>,
}

type UserRow = (String, String, String, i64, String, Option<i64>);

/// A user row with the token's secret hash first.
type CredentialRow = (Vec<u8>, String, String, String, i64, String, Option<i64>);

/// A user row's columns, in [`UserRow`]'s order (a macro: queries are static text).
macro_rules! user_columns {
    () => {
        "id, name, role, created_at, created_by, revoked_at"
    };
}

impl User {
    fn from_row(row: UserRow) -> Result<Self, StoreError> {
        let (id, name, role, created_at, created_by, revoked_at) = row;
        Ok(Self {
            id: parse_uuid(&id)?,
            name,
            role: role.parse().map_err(StoreError::Corrupt)?,
            created_at,
            created_by,
            revoked_at,
        })
    }
}

impl Store {
    /// Stores a new person whose token's secret hashes to `secret_hash`; a name taken
    /// already is a conflict.
    pub async fn create_user(
        &self,
        name: &str,
        role: Role,
        secret_hash: &[u8],
    ) -> Result<User, StoreError> {
        let now = now_millis();
        let id = Uuid::new_v4();
        let created_by = super::admin_actor();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let taken: Option<(String,)> = sqlx::query_as("SELECT id FROM users WHERE name = $1")
                .bind(name)
                .fetch_optional(&mut *tx)
                .await?;
            if taken.is_some() {
                return Err(StoreError::conflict(
                    super::ConflictKind::NameTaken,
                    format!("a user named `{name}` exists already"),
                ));
            }
            sqlx::query(
                "INSERT INTO users (id, name, role, secret_hash, created_at, created_by) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(id.to_string())
            .bind(name)
            .bind(role.as_str())
            .bind(secret_hash)
            .bind(now)
            .bind(&created_by)
            .execute(&mut *tx)
            .await?;
            audit!(tx, now, created_by.clone(), "user.create", id.to_string(),
                format!("{name} ({role})"));
            tx.commit().await?;
        });
        Ok(User {
            id,
            name: name.to_string(),
            role,
            created_at: now,
            created_by,
            revoked_at: None,
        })
    }

    /// Every person, by name.
    pub async fn users(&self) -> Result<Vec<User>, StoreError> {
        with_pool!(self, p => {
            let rows: Vec<UserRow> = sqlx::query_as(concat!(
                "SELECT ",
                user_columns!(),
                " FROM users ORDER BY name"
            ))
            .fetch_all(p)
            .await?;
            rows.into_iter().map(User::from_row).collect()
        })
    }

    /// Person `id` with their token's secret hash, for checking a token.
    pub async fn user_credential(&self, id: Uuid) -> Result<Option<(Vec<u8>, User)>, StoreError> {
        with_pool!(self, p => {
            let row: Option<CredentialRow> =
                sqlx::query_as(concat!(
                    "SELECT secret_hash, ",
                    user_columns!(),
                    " FROM users WHERE id = $1"
                ))
                .bind(id.to_string())
                .fetch_optional(p)
                .await?;
            row.map(|(hash, id, name, role, created_at, created_by, revoked_at)| {
                User::from_row((id, name, role, created_at, created_by, revoked_at))
                    .map(|user| (hash, user))
            })
            .transpose()
        })
    }

    /// Revokes person `id`: their token is refused from now on.
    pub async fn revoke_user(&self, id: Uuid) -> Result<User, StoreError> {
        let now = now_millis();
        with_pool!(self, p => {
            let mut tx = p.begin_write().await?;
            let done = sqlx::query(
                "UPDATE users SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL",
            )
            .bind(now)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
            let row: Option<UserRow> = sqlx::query_as(concat!(
                "SELECT ",
                user_columns!(),
                " FROM users WHERE id = $1"
            ))
            .bind(id.to_string())
            .fetch_optional(&mut *tx)
            .await?;
            let Some(row) = row else {
                return Err(StoreError::NotFound(format!("user {id}")));
            };
            if done.rows_affected() == 0 {
                return Err(StoreError::conflict(
                    super::ConflictKind::AlreadyRevoked,
                    format!("user {id} is already revoked"),
                ));
            }
            let user = User::from_row(row)?;
            // Their dashboard sessions end with their token.
            sqlx::query("DELETE FROM dashboard_sessions WHERE user_id = $1")
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
            audit!(tx, now, super::admin_actor(), "user.revoke", id.to_string(), user.name.clone());
            tx.commit().await?;
            Ok(user)
        })
    }
}
