//! The bodies a client and the coordinator exchange, written once: the coordinator's
//! handlers take and answer these types, the edge client sends and reads them, and the
//! OpenAPI document's schemas are derived from them (feature `openapi`).

use std::collections::BTreeMap;

use cohort_aggregation::secagg::{ForwardedShares, KeyDirectory, Roster, UnmaskRequest};
use serde::{Deserialize, Serialize};

/// The body of every error answer: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Stable, machine-readable `snake_case` code, e.g. `unauthorized`, `malformed_json`.
    #[cfg_attr(feature = "openapi", schema(example = "unauthorized"))]
    pub code: String,
    /// Human-readable explanation.
    #[cfg_attr(
        feature = "openapi",
        schema(example = "missing bearer token: send `Authorization: Bearer <token>`")
    )]
    pub message: String,
}

/// An enrolment request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EnrolRequest {
    /// The one-time token an admin issued.
    pub token: String,
    /// The client's identity: its long-term Ed25519 public key, unpadded base64url (32
    /// bytes). Registered with the credential; a client enrolled without one registers
    /// it later with `PUT /api/v1/clients/me/identity`.
    #[serde(default)]
    pub identity: Option<String>,
}

/// A client's identity to register.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct IdentityRequest {
    /// The long-term Ed25519 public key, unpadded base64url (32 bytes).
    pub identity: String,
}

/// A registered identity, as people compare it out of band.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct IdentityRegistered {
    /// The key's fingerprint: the first 16 bytes of its SHA-256, hex, in groups of four.
    pub fingerprint: String,
}

/// A check-in: the client is available and waits up to `wait_seconds` for a task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CheckIn {
    /// Seconds to wait for a task (long poll), at most 30.
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 30))]
    #[serde(default)]
    pub wait_seconds: u64,
}

/// The answer to an upload (`201`), or to a retry of one already stored (`200`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UploadReceipt {
    /// The coordinator's id of the stored upload (not the client's `upload_id` query).
    pub upload_id: uuid::Uuid,
    /// `true` when this answers a retry whose first try was already stored: nothing was
    /// counted again. Absent otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
}

/// Why a client could not complete a task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct FailureReport {
    /// What went wrong, for the admin: not blank, no control characters but tabs and
    /// line breaks; cut to 2000 characters.
    #[cfg_attr(
        feature = "openapi",
        schema(
            min_length = 1,
            pattern = r"^[^\u0000-\u0008\u000B\u000C\u000E-\u001F\u007F-\u009F]*[^\s\u0000-\u001F\u007F-\u009F][^\u0000-\u0008\u000B\u000C\u000E-\u001F\u007F-\u009F]*$"
        )
    )]
    pub reason: String,
}

impl FailureReport {
    /// The report of `what` went wrong, made fit to send: cut to 2000 characters, each
    /// control character but tabs and line breaks (a trainer's colour codes, a NUL)
    /// replaced with U+FFFD, and never blank.
    pub fn new(what: &str) -> Self {
        let reason: String = what
            .chars()
            .take(2000)
            .map(|c| {
                if super::text::refused_in_free_text(c) {
                    '\u{fffd}'
                } else {
                    c
                }
            })
            .collect();
        FailureReport {
            reason: if super::text::is_blank(&reason) {
                "the task failed without saying why".into()
            } else {
                reason
            },
        }
    }
}

/// A client's evaluation of a model version it received, or its word that it keeps its
/// metrics to itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EvaluationReport {
    /// The published round whose model was evaluated (0: the initial model).
    #[cfg_attr(feature = "openapi", schema(minimum = 0))]
    pub model_version: i64,
    /// Examples the metrics are over, at least 1; absent when `withheld`.
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    #[serde(default)]
    pub num_examples: Option<i64>,
    /// Metric name (letters, digits, `_`, `.`, `-`; up to 64) to a finite value; at most
    /// 32; none when `withheld`.
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    /// Set when the client answers without metrics, and why: it is then not asked
    /// again, and the summaries count it apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub withheld: Option<WithheldReason>,
}

/// Why a client answered an evaluation without its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum WithheldReason {
    /// The client runs under local differential privacy, whose guarantee covers only
    /// what it noises: its updates. Metrics of its data stay on the machine.
    LocalDifferentialPrivacy,
}

impl WithheldReason {
    /// The reason as the API and the store spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            WithheldReason::LocalDifferentialPrivacy => "local_differential_privacy",
        }
    }
}

/// The roster (`U1` with every member's graph commitment), once advertising has closed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RosterReply {
    /// The round's stage now.
    pub stage: super::stage::RoundStage,
    /// The roster, `null` until advertising has closed.
    pub roster: Option<Roster>,
}

/// The key directory (`U1`, the graph nonces, the caller's neighbourhood's signed keys),
/// once revealing has closed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DirectoryReply {
    /// The round's stage now.
    pub stage: super::stage::RoundStage,
    /// The directory, `null` until revealing has closed.
    pub directory: Option<KeyDirectory>,
}

/// The shares the caller's neighbours encrypted for it, once sharing has closed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SharesReply {
    /// The round's stage now.
    pub stage: super::stage::RoundStage,
    /// The shares, `null` until sharing has closed.
    pub shares: Option<ForwardedShares>,
}

/// The clients whose masked inputs are in the sum (`U3`), once collection has closed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SurvivorsReply {
    /// The round's stage now.
    pub stage: super::stage::RoundStage,
    /// The survivors, `null` until collection has closed.
    pub request: Option<UnmaskRequest>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trainer's output goes out as a report the server takes: colour codes and NULs
    /// replaced, line breaks kept, cut to 2000 characters, never blank.
    #[test]
    fn failure_reports_are_made_fit_to_send() {
        let report = FailureReport::new("\u{1b}[31mTraceback\u{0}\n  line 3\tboom");
        assert_eq!(
            report.reason,
            "\u{fffd}[31mTraceback\u{fffd}\n  line 3\tboom"
        );
        assert_eq!(
            FailureReport::new(&"x".repeat(5000)).reason.chars().count(),
            2000
        );
        assert!(!FailureReport::new(" \n ").reason.trim().is_empty());
    }

    /// The bodies are what the coordinator's routes take: a field the server refuses as
    /// unknown would be a client that cannot enrol.
    #[test]
    fn bodies_have_the_wire_names() {
        let enrol = EnrolRequest {
            token: "t".into(),
            identity: None,
        };
        assert_eq!(
            serde_json::to_value(&enrol).unwrap(),
            serde_json::json!({"token": "t", "identity": null})
        );
        let report = EvaluationReport {
            model_version: 2,
            num_examples: None,
            metrics: BTreeMap::new(),
            withheld: Some(WithheldReason::LocalDifferentialPrivacy),
        };
        assert_eq!(
            serde_json::to_value(&report).unwrap(),
            serde_json::json!({"model_version": 2, "num_examples": null, "metrics": {},
                               "withheld": "local_differential_privacy"})
        );
        let error: ErrorBody =
            serde_json::from_str(r#"{"error": {"code": "not_found", "message": "gone"}}"#).unwrap();
        assert_eq!(error.error.code, "not_found");
    }
}
