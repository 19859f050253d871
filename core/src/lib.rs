//! Cohort's rules, written once.
//!
//! The coordinator runs experiments two ways: `cohort serve` over HTTP with every change
//! in a store transaction, and `cohort simulate` in memory with thousands of virtual
//! clients. Both obey the rules in this crate, so that a setting means the same thing in
//! either and a rule changed here changes in both. The crate does no I/O and no async
//! (no tokio, sqlx or axum); the math beneath it is [`cohort_aggregation`].
//!
//! - [`spec`]: what an admin asks for ([`ExperimentSpec`]) and the one function that
//!   checks it ([`ExperimentSpec::validate`]).
//! - [`compression`]: how updates and models travel, per direction, and which
//!   combinations may run.
//! - [`model`]: the model a spec names ([`SpecModel`]).
//! - [`mode`]: synchronous rounds or FedBuff, and FedBuff's settings.
//! - [`privacy`]: differential privacy settings ([`PrivacySpec`]).
//! - [`round`]: the rules of a synchronous round: its stages, a client's part in it, and
//!   whether an upload is taken ([`check_upload`]).
//! - [`text`]: the one rule for names and labels ([`text::check_label`]).
//! - [`secure`]: secure aggregation settings ([`SecureAggregationSpec`]) and the round
//!   configuration sized from them.

pub mod compression;
pub mod mode;
pub mod model;
pub mod personalisation;
pub mod privacy;
pub mod round;
pub mod secure;
pub mod spec;
pub mod task;
pub use cohort_edge::protocol::text;

pub use compression::CompressionSpec;
pub use mode::{ExperimentMode, FedBuffSettings, UnknownMode};
pub use model::SpecModel;
pub use privacy::{BudgetAgainst, PrivacySpec};
pub use round::{
    ParticipationState, ParticipationView, RoundStage, RoundView, UploadRefusal, check_upload,
};
pub use secure::SecureAggregationSpec;
pub use spec::{ExperimentSpec, InvalidSpec, SpecProblem, TrainSettings, default_max_weight};
