//! What a spec names as its model.

use std::fmt;
use std::str::FromStr;

use cohort_edge::model::ModelKind;
use serde::{Deserialize, Serialize};

/// What an experiment spec names as its model: a built-in family, or `file` (the
/// tensors of its `initial_model`, trained by the clients' own trainers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecModel {
    /// `logreg`, `mlp`, `mlp:H1,H2,...`: trained by the edge client itself.
    BuiltIn(ModelKind),
    /// `file`: defined by an uploaded safetensors file.
    File,
}

impl FromStr for SpecModel {
    type Err = cohort_edge::model::ModelError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.trim().eq_ignore_ascii_case("file") {
            return Ok(SpecModel::File);
        }
        text.parse().map(SpecModel::BuiltIn).map_err(|e| match e {
            cohort_edge::model::ModelError::Unknown(t) => {
                cohort_edge::model::ModelError::Unknown(format!("{t}` (or `file"))
            }
            other => other,
        })
    }
}

impl fmt::Display for SpecModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpecModel::BuiltIn(kind) => kind.fmt(f),
            SpecModel::File => f.write_str("file"),
        }
    }
}

impl From<ModelKind> for SpecModel {
    fn from(kind: ModelKind) -> Self {
        SpecModel::BuiltIn(kind)
    }
}

impl Serialize for SpecModel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SpecModel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}
