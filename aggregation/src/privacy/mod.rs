//! Differential privacy: what the final model can reveal about any one client.
//!
//! - [`rdp`]: the Rényi DP accountant for the Poisson-subsampled Gaussian mechanism, the
//!   conversion to `(epsilon, delta)`, and the noise multiplier for a budget.
//! - [`clip`]: L2 clipping of updates, fixed or tracking a quantile of the norms.
//! - [`noise`]: Gaussian noise for the central mechanism.
//! - [`distributed`]: each client's share of integer (Skellam) noise under secure
//!   aggregation, so that the coordinator never sees an un-noised sum.
pub mod clip;
pub mod distributed;
pub mod noise;
pub mod rdp;
