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
//!
//! That figure is the privacy against whoever sees only the released results. The party
//! that draws the sample knows who is in each round, so against it sampling amplifies
//! nothing: [`ParticipantLedger`] keeps each participant's own rounds at `q = 1`.

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

/// What one participant has spent against a party that knows it took part: the rounds,
/// and their RDP without amplification by sampling.
///
/// Without sampling the Gaussian mechanism at multiplier `sigma` has RDP
/// `alpha / (2 sigma^2)` at every order `alpha`, so rounds compose by adding
/// `rho = sum 1 / (2 sigma_i^2)` and the curve is `alpha * rho`: one number per participant
/// holds its whole curve, and the one with the largest `rho` has the largest epsilon.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Unamplified {
    /// Rounds it took part in.
    pub rounds: u64,
    /// `sum 1 / (2 sigma_i^2)` over those rounds (infinite after a round without noise).
    pub rho: f64,
}

impl Unamplified {
    /// After one more round at noise multiplier `sigma`.
    pub fn with_round(self, sigma: f64) -> Result<Self, PrivacyError> {
        check(1.0, sigma)?;
        Ok(Self {
            rounds: self.rounds + 1,
            rho: self.rho + 1.0 / (2.0 * sigma * sigma),
        })
    }

    /// Epsilon at `delta`: the same conversion as [`RdpAccountant::epsilon`], over the
    /// same orders, of the curve `alpha * rho`.
    pub fn epsilon(&self, delta: f64) -> Result<f64, PrivacyError> {
        check_delta(delta)?;
        let orders = default_orders();
        let rdp: Vec<f64> = orders.iter().map(|a| a * self.rho).collect();
        Ok(epsilon_from_rdp(&orders, &rdp, delta).0)
    }
}

/// Privacy spent by each participant against the party that draws every round's sample
/// (the coordinator): it knows who is in a round, so sampling amplifies nothing, and a
/// participant's epsilon composes only the rounds it took part in, each at the full
/// Gaussian mechanism (`q = 1`). Participants never charged have spent nothing.
#[derive(Debug, Clone)]
pub struct ParticipantLedger<K> {
    spent: std::collections::HashMap<K, Unamplified>,
}

impl<K> Default for ParticipantLedger<K> {
    fn default() -> Self {
        Self {
            spent: std::collections::HashMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq> ParticipantLedger<K> {
    /// A ledger in which nobody has spent anything.
    pub fn new() -> Self {
        Self::default()
    }

    /// Charges `who` one round at noise multiplier `sigma`.
    pub fn charge(&mut self, who: K, sigma: f64) -> Result<(), PrivacyError> {
        let spent = self.spent.entry(who).or_default();
        *spent = spent.with_round(sigma)?;
        Ok(())
    }

    /// What `who` has spent.
    pub fn spent(&self, who: &K) -> Unamplified {
        self.spent.get(who).copied().unwrap_or_default()
    }

    /// Participants charged at least once.
    pub fn participants(&self) -> usize {
        self.spent.len()
    }

    /// The participant that has spent the most (ties: the one with more rounds), and
    /// what; `None` when nobody has been charged.
    pub fn worst(&self) -> Option<(&K, Unamplified)> {
        self.spent
            .iter()
            .max_by(|a, b| {
                a.1.rho
                    .total_cmp(&b.1.rho)
                    .then(a.1.rounds.cmp(&b.1.rounds))
            })
            .map(|(k, s)| (k, *s))
    }

    /// What the worst of `selected` would have spent after one more round at `sigma`:
    /// the check before a round opens (`None` when `selected` is empty).
    pub fn worst_after<'a>(
        &self,
        selected: impl IntoIterator<Item = &'a K>,
        sigma: f64,
    ) -> Result<Option<Unamplified>, PrivacyError>
    where
        K: 'a,
    {
        let worst = selected
            .into_iter()
            .map(|k| self.spent(k))
            .max_by(|a, b| a.rho.total_cmp(&b.rho).then(a.rounds.cmp(&b.rounds)));
        worst.map(|w| w.with_round(sigma)).transpose()
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

    /// The accountant's figure against the coordinator, which knows who took part: each
    /// participant composes its own rounds at `q = 1`.
    fn unamplified(sigmas: &[f64]) -> Unamplified {
        sigmas
            .iter()
            .fold(Unamplified::default(), |u, &s| u.with_round(s).unwrap())
    }

    proptest::proptest! {
        /// Knowing who took part can only cost privacy: the epsilon of a participant's
        /// rounds against the party that sampled them is never below the epsilon of the
        /// same rounds against observers, whatever their sampling rates.
        #[test]
        fn the_coordinator_s_epsilon_is_never_below_the_observers(
            rounds in proptest::collection::vec((0.001f64..=1.0, 0.3f64..20.0), 1..12),
            delta in 1e-9f64..1e-2,
        ) {
            let mut observers = RdpAccountant::new();
            for &(q, sigma) in &rounds {
                observers.compose(q, sigma, 1).unwrap();
            }
            let sigmas: Vec<f64> = rounds.iter().map(|r| r.1).collect();
            let coordinator = unamplified(&sigmas).epsilon(delta).unwrap();
            let observed = observers.epsilon(delta).unwrap();
            proptest::prop_assert!(
                coordinator >= observed * (1.0 - 1e-9),
                "coordinator {} < observers {}", coordinator, observed
            );
        }

        /// At `q = 1` there is nothing to amplify: both figures are the same number.
        #[test]
        fn without_sampling_both_epsilons_agree(
            sigmas in proptest::collection::vec(0.3f64..20.0, 1..12),
            delta in 1e-9f64..1e-2,
        ) {
            let mut observers = RdpAccountant::new();
            for &sigma in &sigmas {
                observers.compose(1.0, sigma, 1).unwrap();
            }
            let observed = observers.epsilon(delta).unwrap();
            let coordinator = unamplified(&sigmas).epsilon(delta).unwrap();
            proptest::prop_assert!(
                (coordinator - observed).abs() <= 1e-9 * observed.max(1e-12),
                "coordinator {} vs observers {}", coordinator, observed
            );
        }
    }

    /// The ledger charges each participant only its own rounds, finds the worst one, and
    /// checks a round before it opens against the worst of those selected for it.
    #[test]
    fn the_ledger_charges_only_the_rounds_each_participant_took_part_in() {
        let mut ledger = ParticipantLedger::new();
        assert_eq!(ledger.worst(), None);
        for who in ["a", "b", "a"] {
            ledger.charge(who, 2.0).unwrap();
        }
        ledger.charge("c", 1.0).unwrap();
        assert_eq!(ledger.participants(), 3);
        assert_eq!(ledger.spent(&"a"), unamplified(&[2.0, 2.0]));
        assert_eq!(ledger.spent(&"never"), Unamplified::default());
        assert_eq!(ledger.spent(&"never").epsilon(1e-5).unwrap(), 0.0);
        // One round at sigma 1 spends what four at sigma 2 do; "c" is the worst.
        let (who, worst) = ledger.worst().unwrap();
        assert_eq!((*who, worst.rounds), ("c", 1));
        let after = ledger.worst_after(&["a", "b"], 2.0).unwrap().unwrap();
        assert_eq!(after, unamplified(&[2.0, 2.0, 2.0]));
        assert_eq!(ledger.worst_after(&[], 2.0).unwrap(), None);
        let a = ledger.spent(&"a").epsilon(1e-5).unwrap();
        assert!((a - epsilon(1.0, 2.0, 2, 1e-5).unwrap()).abs() < 1e-9 * a);
        assert!(matches!(
            ledger.charge("a", f64::NAN),
            Err(PrivacyError::NoiseMultiplier(_))
        ));
        assert_eq!(
            unamplified(&[0.0]).epsilon(1e-5).unwrap(),
            f64::INFINITY,
            "a round without noise is not private at all"
        );
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
