//! Differential privacy: what the final model can reveal about any one client.
//!
//! - [`rdp`]: the Rényi DP accountant for the Poisson-subsampled Gaussian mechanism, the
//!   conversion to `(epsilon, delta)`, and the noise multiplier for a budget.
//! - [`clip`]: L2 clipping of updates, fixed or tracking a quantile of the norms.
//! - [`noise`]: Gaussian noise for the central mechanism.
pub mod clip;
pub mod noise;
pub mod rdp;
