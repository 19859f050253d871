//! Differential privacy: what the final model can reveal about any one client.
//!
//! - [`rdp`]: the Rényi DP accountant for the Poisson-subsampled Gaussian mechanism, the
//!   conversion to `(epsilon, delta)`, and the noise multiplier for a budget.
pub mod rdp;
