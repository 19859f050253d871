//! Where a round attempt is: the stages every party names the same way (the
//! coordinator's store and its rules, the API's replies, the edge client reading them).
//! Here, in the protocol's crate, because the edge client parses them; the coordinator's
//! core re-exports them as `cohort_core::round::RoundStage`.

use serde::{Deserialize, Serialize};

/// Where a round attempt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RoundStage {
    /// Secure aggregation: selected clients advertise their signed public keys and
    /// graph commitments.
    Advertising,
    /// Secure aggregation: clients reveal their graph nonces, from which the neighbour
    /// graph is drawn.
    Revealing,
    /// Secure aggregation: clients send their encrypted key shares.
    Sharing,
    /// Selected clients train and upload until the deadline (with secure aggregation:
    /// masked inputs).
    Collecting,
    /// Secure aggregation with the consistency check: survivors sign the survivor list.
    Confirming,
    /// Secure aggregation: survivors reveal the shares that unmask the sum.
    Unmasking,
    /// Collection closed with a quorum; the aggregation job folds the uploads.
    Aggregating,
    /// The new global model is published.
    Published,
    /// Too few uploads by the deadline; the round runs again as the next attempt.
    Failed,
}

/// A stage name that is none of [`RoundStage`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown round stage `{0}`")]
pub struct UnknownStage(pub String);

impl RoundStage {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            RoundStage::Advertising => "advertising",
            RoundStage::Revealing => "revealing",
            RoundStage::Sharing => "sharing",
            RoundStage::Collecting => "collecting",
            RoundStage::Confirming => "confirming",
            RoundStage::Unmasking => "unmasking",
            RoundStage::Aggregating => "aggregating",
            RoundStage::Published => "published",
            RoundStage::Failed => "failed",
        }
    }

    /// Where the stage comes in a round: 1 for advertising up to 8 for published, 0 for
    /// failed. Later stages have higher ranks.
    pub fn rank(self) -> u8 {
        match self {
            RoundStage::Failed => 0,
            RoundStage::Advertising => 1,
            RoundStage::Revealing => 2,
            RoundStage::Sharing => 3,
            RoundStage::Collecting => 4,
            RoundStage::Confirming => 5,
            RoundStage::Unmasking => 6,
            RoundStage::Aggregating => 7,
            RoundStage::Published => 8,
        }
    }

    /// Whether the round is still running (not published or failed).
    pub fn in_progress(self) -> bool {
        !matches!(self, RoundStage::Published | RoundStage::Failed)
    }
}

impl std::fmt::Display for RoundStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RoundStage {
    type Err = UnknownStage;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(match text {
            "advertising" => RoundStage::Advertising,
            "revealing" => RoundStage::Revealing,
            "sharing" => RoundStage::Sharing,
            "collecting" => RoundStage::Collecting,
            "confirming" => RoundStage::Confirming,
            "unmasking" => RoundStage::Unmasking,
            "aggregating" => RoundStage::Aggregating,
            "published" => RoundStage::Published,
            "failed" => RoundStage::Failed,
            other => return Err(UnknownStage(other.to_string())),
        })
    }
}
