//! The math both ends of Cohort must agree on.
//!
//! This crate is pure: no I/O, no async, no global state. The coordinator and the edge
//! client both depend on it, so a model update means the same thing on either side.
//!
//! - [`ModelVector`]: flat `f32` parameters with named tensor shapes.
//! - [`WeightedMean`]: FedAvg as a streaming accumulator, folded one update at a time.
//! - [`ServerOptimizer`]: how the server turns the averaged update into the next global
//!   model (plain averaging, FedAdam, FedYogi, FedAdagrad).
//! - [`Strategy`]: the named federated strategies a user picks from.
//! - [`wire`]: the little-endian `f32` body in which vectors travel.
//! - [`compress`]: fewer bytes per vector: rotated quantisation, signs, top-k, error
//!   feedback.
//! - [`model_file`]: models as safetensors files, strictly checked when decoded.
//! - [`secagg`]: secure aggregation (SecAgg+): the server learns only the sum.
//! - [`reduce`]: the hot loops (weighted sums, modular sums, mask expansion) behind one
//!   [`reduce::Reducer`] interface with a CPU backend.
//! - [`privacy`]: differential privacy accounting (RDP).
//! - [`fedbuff`]: FedBuff's buffer fold and staleness weight.
//! - [`robust`]: aggregation rules that resist malicious clients (median, trimmed mean,
//!   Krum, Multi-Krum).

pub mod compress;
#[cfg(feature = "cuda")]
pub mod cuda;
mod fedavg;
pub mod fedbuff;
pub mod model_file;
mod model_vector;
pub mod privacy;
pub mod reduce;
pub mod robust;
pub mod secagg;
mod server_optimizer;
mod strategy;
pub mod wire;

pub use fedavg::{AggregationError, Finite, WeightedMean, max_abs_finite};
pub use model_vector::{Layout, LayoutError, ModelVector, TensorSpec};
pub use server_optimizer::{AdaptiveConfig, AdaptiveKind, ServerOptimizer};
pub use strategy::{Strategy, StrategyParseError};
