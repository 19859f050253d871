//! The Cohort edge client: everything that runs next to private data.
//!
//! - [`data`]: CSV loading, the shipped real data sets, FedProx Synthetic, stratified
//!   splits and standardisation.
//! - [`partition`]: non-IID partitioners for research (IID, Dirichlet label skew,
//!   pathological shards, quantity skew), deterministic from a seed.
//! - [`model`]: multinomial logistic regression and MLPs with forward and backward passes.
//! - [`train`]: local training (mini-batch SGD with momentum, weight decay, FedProx) and
//!   evaluation, behind the [`train::Trainer`] trait.
//! - [`protocol`]: the coordinator's REST API as the client speaks it: its types, and
//!   (with the `agent` feature, on by default) the HTTP client.
//! - [`identity`]: this client's long-term Ed25519 identity, kept in the state
//!   directory and registered with the coordinator.
//! - [`personal`]: personalised federated learning (FedPer, FedRep, Ditto, fine-tuning):
//!   which parameters stay on the client, and how a client trains its own model.
//! - [`local_dp`]: optional local differential privacy: clip and noise before upload,
//!   with the client's own ledger and budget.
//!
//! With the `agent` feature (the default):
//! - [`agent`]: the edge loop: enrol once, then check in, train, upload, with retries.
//! - [`trainer`]: who trains a task: the built-in models, the user's own program
//!   (`--trainer`), or an app's callback; the checks on what they return; and a
//!   personalised task with any of them ([`trainer::personalised`]).
//! - [`upload_compression`]: a compressed upload and its error-feedback residual, kept
//!   in the state directory.
//! - [`state_file`]: the vectors kept in the state directory, replaced whole.
//! - [`governance`]: what a site allows (experiments, rounds) and its own append-only
//!   log of every task.
//! - [`ffi`]: the C API (`cdylib`, `staticlib`, header `include/cohort_edge.h`), for
//!   apps that train inside their own process.

#[cfg(feature = "agent")]
pub mod agent;
#[cfg(feature = "agent")]
pub mod cli;
pub mod data;
#[cfg(feature = "agent")]
pub mod ffi;
#[cfg(feature = "agent")]
pub mod governance;
pub mod identity;
pub mod local_dp;
pub mod model;
pub mod partition;
pub mod personal;
pub mod protocol;
#[cfg(feature = "agent")]
pub mod state_file;
pub mod train;
#[cfg(feature = "agent")]
pub mod trainer;
#[cfg(feature = "agent")]
pub mod upload_compression;
