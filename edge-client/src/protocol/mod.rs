//! The coordinator's REST API as the edge client speaks it: the types a task carries,
//! every request and reply body ([`messages`]) and every client route's path
//! ([`routes`]) — always built, so that the coordinator's handlers take and answer the
//! very same types and register the very same paths — and the HTTP client itself
//! ([`CoordinatorClient`], with the `agent` feature). The coordinator's tests check that
//! each path here is an operation of its OpenAPI document, and the cross-crate tests run
//! this client against the real server.

use cohort_aggregation::secagg::RoundConfig;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::train::TrainConfig;

#[cfg(feature = "agent")]
mod client;
#[cfg(feature = "agent")]
pub use client::*;
pub mod messages;
pub mod routes;
pub mod stage;
pub mod text;

/// A client's credential: its id and secret, kept in the state directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credential {
    /// The client's id.
    pub client_id: Uuid,
    /// The client's secret (only its hash is on the server).
    pub secret: String,
}

impl Credential {
    /// The `Authorization: Bearer` value, `id.secret`: private, so that only the HTTP
    /// client (a child module) ever writes the secret out.
    #[cfg_attr(not(feature = "agent"), allow(dead_code))]
    fn bearer(&self) -> String {
        format!("{}.{}", self.client_id, self.secret)
    }
}

/// What a selected client must do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Task {
    /// The experiment.
    pub experiment_id: Uuid,
    /// The round.
    pub round: i64,
    /// The round's attempt (part of the upload path).
    pub attempt: i64,
    /// Upload before this time, Unix ms.
    pub deadline_ms: Option<i64>,
    /// Model family and shape, e.g. `mlp:64`.
    pub model: String,
    /// Feature columns the model takes.
    pub features: usize,
    /// Classes the model predicts.
    pub classes: usize,
    /// Local training settings (with the FedProx mu when the strategy has one).
    pub train: TrainConfig,
    /// For a secure round: the protocol settings and the client's index. The client
    /// then runs the four stages under `.../secagg/` and uploads only a masked vector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_aggregation: Option<SecureTask>,
    /// `train` (the default): train and upload. `evaluate`: evaluate the experiment's
    /// current (final) model and report the metrics to `.../evaluations`; `round` is then
    /// the model version and `attempt` 0.
    #[serde(default)]
    pub kind: TaskKind,
    /// The model's tensors, in the order of its wire form (the model download and the
    /// upload are these tensors' values, each row-major, one after the other). For a
    /// built-in model: `layers.{i}.weight` of shape `[out, in]` then `layers.{i}.bias`
    /// of shape `[out]`, for each layer `i` from the input's; for `file`, the model
    /// file's tensors. Absent only from a coordinator older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<cohort_aggregation::TensorSpec>>,
    /// What the upload holds: the new weights, or (secure rounds) the masked difference
    /// from the model the client received.
    #[serde(default)]
    pub upload: UploadForm,
    /// The experiment's free-form settings for the client's trainer.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyperparameters: Option<serde_json::Map<String, serde_json::Value>>,
    /// Whether the experiment takes the client's evaluation of the model it received
    /// (`POST .../evaluations`): file models without differential privacy.
    #[serde(default)]
    pub report_metrics: bool,
    /// How the model download and the upload are compressed; absent: 32-bit floats both
    /// ways.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<TaskCompression>,
    /// The experiment's personalisation: the client keeps a part of the model (or a
    /// model) of its own, never uploaded, and reports both models' accuracy on a
    /// held-out split of its data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub personalisation: Option<TaskPersonalisation>,
    /// The columns of the site's data the experiment reads as features, in the model's
    /// order (the label column too); absent when the experiment does not name them. A
    /// site that shares only some columns refuses a task naming another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Vec<String>>,
}

/// A task's personalisation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TaskPersonalisation {
    /// `fedper:LAYERS`, `fedrep:LAYERS`, `ditto:LAMBDA` or `finetune:EPOCHS`
    /// ([`crate::personal::Personalisation`]).
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "fedper:layers.1"))]
    pub scheme: crate::personal::Personalisation,
    /// The fraction of its examples a built-in model's client holds out to score the
    /// global and its personalised model on (a trainer of its own holds out its own).
    pub holdout: f64,
}

/// A task's compression. A compressed model download says so in its
/// `x-cohort-compression` header, and its body is that scheme's (it starts with `CZ`,
/// see `cohort_aggregation::compress::format`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TaskCompression {
    /// The upload's scheme: `none`, `quantize:B`, `sign` or `topk:F`. On a plain round
    /// (`upload: compressed_difference`) the body is the difference from the received
    /// model in this scheme; on a secure round the masked words carry `quantize:B`'s
    /// bits (the round's settings say how).
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "quantize:4"))]
    pub upload: cohort_aggregation::compress::Compression,
    /// The rotation seed the upload's header must carry (the coordinator checks it).
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 0, maximum = 9007199254740991_i64)
    )]
    pub upload_rotation_seed: u64,
    /// The model download's scheme: `none`, `quantize:4` or `quantize:8`.
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "quantize:8"))]
    pub download: cohort_aggregation::compress::Compression,
}

/// What a task asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// Train from the current model and upload the update.
    #[default]
    Train,
    /// Evaluate the current model and report metrics; nothing is uploaded.
    Evaluate,
}

/// What a task's upload holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum UploadForm {
    /// The locally trained model itself (not a difference): little-endian `f32` values
    /// in the order of the task's `tensors`, with `num_samples` in the query.
    #[default]
    Weights,
    /// Secure rounds: the difference from the model the client received, clipped,
    /// quantized and masked as the round's settings say (`d` little-endian words of the
    /// round's width, 32 bits unless compressed, then the weight and the weighted loss
    /// as 32-bit words).
    MaskedDifference,
    /// Plain rounds with compression: the difference from the model the client
    /// received, compressed as the task's `compression.upload` says (a `CZ` body), with
    /// `num_samples` in the query. The coordinator adds what it decodes to the model.
    CompressedDifference,
}

/// A client's part in a secure round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecureTask {
    /// The client's index in the round (1..n).
    pub index: u32,
    /// The round's public protocol settings.
    pub config: RoundConfig,
}

/// The answer to a check-in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckInReply {
    /// The task, or none when the client was not selected within the wait.
    pub task: Option<Task>,
}
