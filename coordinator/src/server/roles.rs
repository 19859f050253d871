//! Who may do what: the role each admin operation needs, and who a request is.
//!
//! The table is by method and path, so that one rule covers an operation in the API and
//! its twin in the dashboard, and the OpenAPI document states each operation's role
//! from this same function (`x-cohort-role`), so the document cannot drift from what is
//! enforced:
//!
//! | operations | role |
//! |---|---|
//! | every read (`GET`), `/metrics` included | `viewer` |
//! | experiments: create, start, pause, resume, stop; FedBuff steps | `operator` |
//! | clients, enrolment tokens, users, models: any change | `admin` |
//!
//! An operation the table does not name needs `admin`: a new route is closed until it
//! is placed.

use axum::http::Method;

pub use crate::store::Role;

/// The role `method` on `path` needs; `path` is an admin path relative to the admin
/// prefix (`/experiments/{id}/start`) or a dashboard path (`/experiments/{id}/start`,
/// the same shape).
pub fn required_role(method: &Method, path: &str) -> Role {
    if method == Method::GET || method == Method::HEAD {
        return Role::Viewer;
    }
    let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
    match first {
        "experiments" => Role::Operator,
        // The dashboard's sign-out: anyone signed in may leave.
        "sign-out" => Role::Viewer,
        _ => Role::Admin,
    }
}

/// Who a request is: the admin token from the settings, or a person with a token of
/// their own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The person's name; `admin` for the admin token.
    pub name: String,
    /// What they may do.
    pub role: Role,
    /// The person's id; `None` for the admin token.
    pub user: Option<uuid::Uuid>,
}

impl Principal {
    /// The admin token's holder.
    pub fn admin_token() -> Self {
        Self {
            name: "admin".into(),
            role: Role::Admin,
            user: None,
        }
    }

    /// How the audit log names them acting through `channel` (`api`, `dashboard
    /// session 1a2b3c4d`) from `address`.
    pub fn actor(&self, channel: &str, address: &str) -> String {
        match self.user {
            None => format!("admin via {channel} from {address}"),
            Some(_) => format!("{} ({}) via {channel} from {address}", self.name, self.role),
        }
    }

    /// Why they may not do what needs `needed`, if they may not.
    pub fn refusal(&self, needed: Role) -> Option<String> {
        (self.role < needed).then(|| {
            format!(
                "{} is a{} {}; this needs the {needed} role",
                self.name,
                if self.role == Role::Operator { "n" } else { "" },
                self.role
            )
        })
    }
}

/// Rules for a person's name: what the audit log and the dashboard show, and what
/// they sign in with.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = (1..=64).contains(&name.chars().count())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@'));
    if !ok {
        return Err(format!(
            "name `{}` must be 1 to 64 letters, digits, `.`, `_`, `-` or `@`",
            name.chars().take(64).collect::<String>()
        ));
    }
    if name == "admin" || name == "coordinator" {
        return Err(format!(
            "`{name}` is reserved: the audit log names the admin token and the coordinator so"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads are a viewer's, running experiments an operator's, everything else an
    /// admin's; an unnamed change is an admin's.
    #[test]
    fn each_operation_needs_its_role() {
        assert_eq!(required_role(&Method::GET, "/audit"), Role::Viewer);
        assert_eq!(required_role(&Method::GET, "/users"), Role::Viewer);
        assert_eq!(required_role(&Method::POST, "/experiments"), Role::Operator);
        assert_eq!(
            required_role(&Method::POST, "/experiments/x/fedbuff"),
            Role::Operator
        );
        assert_eq!(required_role(&Method::POST, "/models"), Role::Admin);
        assert_eq!(required_role(&Method::DELETE, "/models/x"), Role::Admin);
        assert_eq!(
            required_role(&Method::POST, "/clients/x/revoke"),
            Role::Admin
        );
        assert_eq!(required_role(&Method::POST, "/users"), Role::Admin);
        assert_eq!(required_role(&Method::POST, "/something-new"), Role::Admin);
    }

    #[test]
    fn the_audit_log_names_the_person() {
        let alice = Principal {
            name: "alice".into(),
            role: Role::Operator,
            user: Some(uuid::Uuid::nil()),
        };
        assert_eq!(
            alice.actor("api", "10.0.0.1"),
            "alice (operator) via api from 10.0.0.1"
        );
        assert_eq!(
            Principal::admin_token().actor("api", "10.0.0.1"),
            "admin via api from 10.0.0.1"
        );
        assert_eq!(alice.refusal(Role::Operator), None);
        let why = alice.refusal(Role::Admin).unwrap();
        assert_eq!(why, "alice is an operator; this needs the admin role");
    }

    #[test]
    fn names_are_plain_and_not_reserved() {
        assert!(check_name("alice.smith@hospital-1").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("bob smith").is_err());
        assert!(check_name("admin").is_err());
        assert!(check_name(&"a".repeat(65)).is_err());
    }
}
