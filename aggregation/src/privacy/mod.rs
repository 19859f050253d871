//! Differential privacy: what the final model can reveal about any one client.
//!
//! - [`rdp`]: the Rényi DP accountant for the Poisson-subsampled Gaussian mechanism, the
//!   conversion to `(epsilon, delta)`, and the noise multiplier for a budget.
//! - [`central`]: one round of central DP (clip, sum, noise, the adaptive step), as
//!   `serve` and `simulate` both run it.
//! - [`clip`]: L2 clipping of updates, fixed or tracking a quantile of the norms.
//! - [`discrete`]: exact samplers on the integer lattice (Bernoulli(exp(-gamma)), discrete
//!   Laplace, discrete Gaussian); all noise below comes from them, never from floats.
//! - [`noise`]: discrete Gaussian noise on a lattice for the central (and local)
//!   mechanism.
//! - [`distributed`]: each client's share of integer (discrete Gaussian) noise under
//!   secure aggregation, so that the coordinator never sees an un-noised sum.
pub mod central;
pub mod clip;
pub mod discrete;
pub mod distributed;
pub mod noise;
pub mod rdp;
