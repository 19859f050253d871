//! Rényi differential privacy accounting for the Poisson-subsampled Gaussian mechanism:
//! a round in which each client takes part with probability `q` and the (clipped) sum
//! of their updates gets Gaussian noise of standard deviation `sigma * C`.
//!
//! The RDP of one round at order `alpha` is `log(A_alpha) / (alpha - 1)` (Mironov, Talwar
//! and Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism"), with
//! `A_alpha` summed exactly for integer orders and by the two-sided series of their
//! Section 3.3 for fractional ones; rounds compose by adding RDP; the conversion to
//! `(epsilon, delta)` is Proposition 12 of Canonne, Kamath and Steinke 2020. The orders
//! and every numerical choice (series length, when a series counts as converged, when
//! an order is dropped) follow Google's `dp_accounting` RDP accountant, so the two agree
//! to rounding; `tests/fixtures/rdp_grid.json` holds its answers on a grid.

/// The orders the accountant evaluates, as `dp_accounting` does by default:
/// 1.1, 1.2, ..., 10.9, then 11, ..., 63, then 128, 256, 512, 1024.
pub fn default_orders() -> Vec<f64> {
    let mut orders: Vec<f64> = (1..100).map(|x| 1.0 + f64::from(x) / 10.0).collect();
    orders.extend((11..64).map(f64::from));
    orders.extend([128.0, 256.0, 512.0, 1024.0]);
    orders
}

/// Why a privacy computation was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PrivacyError {
    /// The sampling rate is not a probability.
    #[error("sampling rate must be in [0, 1], got {0}")]
    SamplingRate(f64),
    /// The noise multiplier is negative or not a number.
    #[error("noise multiplier must be a finite number >= 0, got {0}")]
    NoiseMultiplier(f64),
    /// Delta is not in (0, 1).
    #[error("delta must be in (0, 1), got {0}")]
    Delta(f64),
    /// The epsilon target is not a positive number.
    #[error("epsilon must be a finite number > 0, got {0}")]
    Epsilon(f64),
    /// No noise multiplier up to the search's ceiling stays within the budget.
    #[error("no noise multiplier up to {ceiling} keeps epsilon <= {epsilon} at delta {delta}")]
    Unreachable {
        /// The epsilon asked for.
        epsilon: f64,
        /// The delta.
        delta: f64,
        /// The largest multiplier tried.
        ceiling: f64,
    },
}

/// `log(exp(a) + exp(b))` without overflow.
fn log_add(a: f64, b: f64) -> f64 {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    if lo == f64::NEG_INFINITY {
        return hi;
    }
    (lo - hi).exp().ln_1p() + hi
}

/// `log |binomial(n, k)|` for real `n` (the sign is dropped, as in `dp_accounting`).
fn log_comb(n: f64, k: f64) -> f64 {
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0)
}

/// `log(erfc(x))`, accurate far into the tail where `erfc` itself underflows.
fn log_erfc(x: f64) -> f64 {
    let r = libm::erfc(x);
    if r > 0.0 {
        return r.ln();
    }
    // The asymptotic (Laurent) series of log(erfc(x)) at infinity.
    -std::f64::consts::PI.ln() / 2.0 - x.ln() - x * x - 0.5 * x.powi(-2) + 0.625 * x.powi(-4)
        - 37.0 / 24.0 * x.powi(-6)
        + 353.0 / 64.0 * x.powi(-8)
}

/// `log(A_alpha)` for an integer order, `0 < q < 1`.
fn log_a_int(q: f64, sigma: f64, alpha: u32) -> f64 {
    let mut log_a = f64::NEG_INFINITY;
    let log1mq = (-q).ln_1p();
    let a = f64::from(alpha);
    for i in 0..=alpha {
        let i = f64::from(i);
        let coef = log_comb(a, i) + i * q.ln() + (a - i) * log1mq;
        log_a = log_add(log_a, coef + (i * i - i) / (2.0 * sigma * sigma));
    }
    log_a
}

/// Terms of the fractional-order series before the order is given up on.
const MAX_SERIES_TERMS: u32 = 1000;

/// `log(A_alpha)` for a fractional order, `0 < q < 1`: the integrals over `(-inf, z0]`
/// and `[z0, inf)` as two series, stopped once both terms fall and are negligible.
/// Infinite (the order is then not used) when the series does not settle.
fn log_a_frac(q: f64, sigma: f64, alpha: f64) -> f64 {
    let (mut log_a0, mut log_a1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let z0 = sigma * sigma * (1.0 / q - 1.0).ln() + 0.5;
    let log1mq = (-q).ln_1p();
    let (mut last_s0, mut last_s1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let sqrt2 = std::f64::consts::SQRT_2;
    for i in 0..MAX_SERIES_TERMS {
        let i = f64::from(i);
        let coef = log_comb(alpha, i);
        let j = alpha - i;
        let log_t0 = coef + i * q.ln() + j * log1mq;
        let log_t1 = coef + j * q.ln() + i * log1mq;
        let log_e0 = 0.5f64.ln() + log_erfc((i - z0) / (sqrt2 * sigma));
        let log_e1 = 0.5f64.ln() + log_erfc((z0 - j) / (sqrt2 * sigma));
        let log_s0 = log_t0 + (i * i - i) / (2.0 * sigma * sigma) + log_e0;
        let log_s1 = log_t1 + (j * j - j) / (2.0 * sigma * sigma) + log_e1;
        log_a0 = log_add(log_a0, log_s0);
        log_a1 = log_add(log_a1, log_s1);
        let total = log_add(log_a0, log_a1);
        if log_s0 < last_s0 && log_s1 < last_s1 && log_s0.max(log_s1) < total - 30.0 {
            return total;
        }
        last_s0 = log_s0;
        last_s1 = log_s1;
    }
    f64::INFINITY
}

/// RDP at order `alpha` of one round of the Poisson-subsampled Gaussian mechanism.
fn rdp_one(q: f64, sigma: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        return 0.0;
    }
    if alpha.is_infinite() || sigma == 0.0 {
        return f64::INFINITY;
    }
    if q == 1.0 {
        return alpha / (2.0 * sigma * sigma);
    }
    let log_a = if alpha.fract() == 0.0 && alpha <= f64::from(u32::MAX) {
        log_a_int(q, sigma, alpha as u32)
    } else {
        log_a_frac(q, sigma, alpha)
    };
    log_a / (alpha - 1.0)
}

fn check(q: f64, sigma: f64) -> Result<(), PrivacyError> {
    if !(0.0..=1.0).contains(&q) {
        return Err(PrivacyError::SamplingRate(q));
    }
    if !(sigma.is_finite() && sigma >= 0.0) {
        return Err(PrivacyError::NoiseMultiplier(sigma));
    }
    Ok(())
}

fn check_delta(delta: f64) -> Result<(), PrivacyError> {
    if !(delta > 0.0 && delta < 1.0) {
        return Err(PrivacyError::Delta(delta));
    }
    Ok(())
}

/// The smallest epsilon over `orders` for the RDP curve `rdp` at `delta`, and the order
/// that gives it.
fn epsilon_from_rdp(orders: &[f64], rdp: &[f64], delta: f64) -> (f64, f64) {
    let mut best = (f64::INFINITY, orders.first().copied().unwrap_or(0.0));
    for (&a, &r) in orders.iter().zip(rdp) {
        let eps = if r < 0.0 || delta * delta + (-r).exp_m1() > 0.0 {
            // Negative RDP is numerical noise; a tiny RDP is bounded through KL.
            0.0
        } else if a > 1.01 {
            r + (-1.0 / a).ln_1p() - (delta * a).ln() / (a - 1.0)
        } else {
            f64::INFINITY
        };
        if eps < best.0 {
            best = (eps, a);
        }
    }
    (best.0.max(0.0), best.1)
}

/// Privacy spent so far by a sequence of rounds, as an RDP curve over fixed orders.
#[derive(Debug, Clone, PartialEq)]
pub struct RdpAccountant {
    orders: Vec<f64>,
    rdp: Vec<f64>,
}

impl Default for RdpAccountant {
    fn default() -> Self {
        Self::new()
    }
}

impl RdpAccountant {
    /// An accountant over [`default_orders`] that has spent nothing.
    pub fn new() -> Self {
        let orders = default_orders();
        let rdp = vec![0.0; orders.len()];
        Self { orders, rdp }
    }

    /// Adds `rounds` rounds of the Poisson-subsampled Gaussian mechanism with sampling
    /// rate `q` and noise multiplier `sigma`.
    pub fn compose(&mut self, q: f64, sigma: f64, rounds: u64) -> Result<(), PrivacyError> {
        check(q, sigma)?;
        for (r, &a) in self.rdp.iter_mut().zip(&self.orders) {
            *r += rounds as f64 * rdp_one(q, sigma, a);
        }
        Ok(())
    }

    /// Epsilon spent at `delta`.
    pub fn epsilon(&self, delta: f64) -> Result<f64, PrivacyError> {
        Ok(self.epsilon_and_order(delta)?.0)
    }

    /// Epsilon spent at `delta`, and the RDP order that gives the tightest bound.
    pub fn epsilon_and_order(&self, delta: f64) -> Result<(f64, f64), PrivacyError> {
        check_delta(delta)?;
        Ok(epsilon_from_rdp(&self.orders, &self.rdp, delta))
    }
}

/// Epsilon at `delta` after `rounds` rounds with sampling rate `q` and noise multiplier
/// `sigma`.
pub fn epsilon(q: f64, sigma: f64, rounds: u64, delta: f64) -> Result<f64, PrivacyError> {
    check_delta(delta)?;
    let mut accountant = RdpAccountant::new();
    accountant.compose(q, sigma, rounds)?;
    accountant.epsilon(delta)
}

/// The largest noise multiplier the search tries.
pub const MAX_NOISE_MULTIPLIER: f64 = 1e6;

/// The smallest noise multiplier (to a relative 1e-6, rounded up) that keeps epsilon at
/// `delta` within `target` after `rounds` rounds at sampling rate `q`.
pub fn noise_multiplier(q: f64, rounds: u64, target: f64, delta: f64) -> Result<f64, PrivacyError> {
    check(q, 0.0)?;
    check_delta(delta)?;
    if !(target.is_finite() && target > 0.0) {
        return Err(PrivacyError::Epsilon(target));
    }
    let within = |sigma: f64| epsilon(q, sigma, rounds, delta).map(|e| e <= target);
    let mut hi = 1.0;
    while !within(hi)? {
        hi *= 2.0;
        if hi > MAX_NOISE_MULTIPLIER {
            return Err(PrivacyError::Unreachable {
                epsilon: target,
                delta,
                ceiling: MAX_NOISE_MULTIPLIER,
            });
        }
    }
    let mut lo = 0.0;
    while (hi - lo) > 1e-6 * hi {
        let mid = 0.5 * (lo + hi);
        if within(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_issue_s_three_cases_match_dp_accounting() {
        for (q, sigma, rounds, delta, expected) in [
            (0.01, 1.1, 1000, 1e-5, 1.7117701662429012),
            (1.0, 5.0, 50, 1e-6, 7.766237903487095),
            (0.02, 1.3, 2000, 1e-6, 4.317767479676103),
        ] {
            let eps = epsilon(q, sigma, rounds, delta).unwrap();
            assert!(
                ((eps - expected) / expected).abs() < 1e-6,
                "({q}, {sigma}, {rounds}, {delta}): {eps} vs {expected}"
            );
        }
    }

    #[test]
    fn more_noise_fewer_rounds_and_less_sampling_spend_less() {
        let base = epsilon(0.05, 1.0, 100, 1e-5).unwrap();
        assert!(epsilon(0.05, 2.0, 100, 1e-5).unwrap() < base);
        assert!(epsilon(0.05, 1.0, 10, 1e-5).unwrap() < base);
        assert!(epsilon(0.01, 1.0, 100, 1e-5).unwrap() < base);
        assert!(epsilon(0.05, 1.0, 100, 1e-3).unwrap() < base);
        assert_eq!(epsilon(0.0, 1.0, 100, 1e-5).unwrap(), 0.0);
        assert_eq!(epsilon(0.5, 0.0, 1, 1e-5).unwrap(), f64::INFINITY);
    }

    #[test]
    fn composing_in_steps_equals_composing_at_once() {
        let mut steps = RdpAccountant::new();
        for _ in 0..10 {
            steps.compose(0.02, 1.2, 30).unwrap();
        }
        let once = epsilon(0.02, 1.2, 300, 1e-6).unwrap();
        assert!((steps.epsilon(1e-6).unwrap() - once).abs() < 1e-9 * once);
    }

    #[test]
    fn the_noise_search_finds_the_smallest_multiplier_within_the_budget() {
        let sigma = noise_multiplier(0.01, 1000, 1.7117701662429012, 1e-5).unwrap();
        assert!((sigma - 1.1).abs() < 1e-4, "{sigma}");
        assert!(epsilon(0.01, sigma, 1000, 1e-5).unwrap() <= 1.7117701662429012);
        assert!(epsilon(0.01, sigma * 0.999, 1000, 1e-5).unwrap() > 1.7117701662429012);
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert_eq!(
            epsilon(1.5, 1.0, 1, 1e-5),
            Err(PrivacyError::SamplingRate(1.5))
        );
        assert!(matches!(
            epsilon(0.1, -1.0, 1, 1e-5),
            Err(PrivacyError::NoiseMultiplier(_))
        ));
        assert!(matches!(
            epsilon(0.1, f64::NAN, 1, 1e-5),
            Err(PrivacyError::NoiseMultiplier(_))
        ));
        assert!(matches!(
            epsilon(0.1, 1.0, 1, 0.0),
            Err(PrivacyError::Delta(_))
        ));
        assert!(matches!(
            epsilon(0.1, 1.0, 1, 1.0),
            Err(PrivacyError::Delta(_))
        ));
        assert!(matches!(
            noise_multiplier(0.1, 10, -1.0, 1e-5),
            Err(PrivacyError::Epsilon(_))
        ));
        assert!(matches!(
            noise_multiplier(1.0, 1_000_000_000, 1e-9, 1e-9),
            Err(PrivacyError::Unreachable { .. })
        ));
    }
}
