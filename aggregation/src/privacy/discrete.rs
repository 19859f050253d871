//! Exact samplers on the integer lattice: `Bernoulli(exp(-gamma))`, the discrete Laplace
//! and the discrete Gaussian of Canonne, Kamath and Steinke 2020 ("The Discrete Gaussian
//! for Differential Privacy", Algorithms 1 to 3), and Poisson and Skellam draws, all for
//! rational parameters.
//!
//! Why not floating point: a sampler that computes `sigma * sqrt(-2 ln u) cos(2 pi v)`
//! and adds it to a value produces only the floats that its arithmetic can reach, and
//! which ones depends on the value; the output's low bits then tell the value apart
//! (Mironov 2012, "On Significance of the Least Significant Bits for Differential
//! Privacy"). Here every decision compares uniform integers (drawn from the caller's
//! generator by rejection, so they are exactly uniform) with integers or rationals, so
//! each output has exactly the probability the formula gives, and the noised value is an
//! integer that the caller scales back only afterwards.
//!
//! **Range.** Outputs are `i64`. The Laplace and Gaussian samplers condition on
//! `|output| < 2^62` (they redraw beyond it); at the scales they accept (a Laplace scale
//! up to `2^32`, a Gaussian variance up to `2^62`) that event has probability below
//! `exp(-2^29)`, far below anything a test or an attacker could see.
//!
//! **Cost.** The Laplace and Gaussian samplers take an expected `O(1)` uniform 64-bit
//! words per output at every scale (about ten for the Laplace, twice that for the
//! Gaussian); the Poisson sampler's cost grows with its mean, so Skellam noise is only for
//! small variances. `benches/noise.rs` measures them against the floating-point samplers
//! they replaced (about 170 ns against 30 to 60 ns per draw).

use rand_core::Rng;

/// Outputs at or past this magnitude are redrawn (see the module docs).
const OUTPUT_LIMIT: u128 = 1 << 62;

/// The largest discrete Laplace scale accepted.
const MAX_LAPLACE_SCALE: u64 = 1 << 32;

/// The largest Poisson mean accepted: the exact sampler takes `O(1 + mean)` draws.
pub const MAX_POISSON_MEAN: u64 = 1 << 20;

/// The largest numerator of a discrete Gaussian variance: it keeps `2 N D t^2` (the
/// acceptance test's denominator) below `2^128`.
pub const MAX_VARIANCE_NUMERATOR: u64 = 1 << 62;

/// The largest denominator of a discrete Gaussian variance.
pub const MAX_VARIANCE_DENOMINATOR: u64 = 1 << 32;

/// Numerators that [`DiscreteGaussian::at_least`] aims below: the acceptance test then
/// squares a 64-bit number (one 128-bit product) unless a proposal lies `2^8` standard
/// deviations out.
const FAST_NUMERATOR: f64 = (1u64 << 56) as f64;

/// Why a sampler cannot be set up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DiscreteError {
    /// A rational parameter with denominator 0.
    #[error("the denominator of a rational parameter must be > 0")]
    ZeroDenominator,
    /// A discrete Laplace of scale 0 or past [`MAX_LAPLACE_SCALE`].
    #[error("the discrete Laplace scale {num}/{den} must be in (0, 2^32]")]
    LaplaceScale {
        /// The scale's numerator.
        num: u64,
        /// The scale's denominator.
        den: u64,
    },
    /// A Poisson mean past [`MAX_POISSON_MEAN`] (the exact sampler's cost grows with it).
    #[error("the Poisson mean {num}/{den} is past the exact sampler's range (at most 2^20)")]
    PoissonMean {
        /// The mean's numerator.
        num: u64,
        /// The mean's denominator.
        den: u64,
    },
    /// A variance that is not a finite number `>= 0`.
    #[error("the variance must be a finite number >= 0, got {0}")]
    InvalidVariance(f64),
    /// A variance past the sampler's range.
    #[error(
        "the variance {num}/{den} is past the sampler's range (numerator at most 2^62, denominator at most 2^32)"
    )]
    VarianceOutOfRange {
        /// The variance's numerator.
        num: u128,
        /// The variance's denominator.
        den: u128,
    },
}

/// A uniform integer in `[0, n)`, `n >= 1`, by Lemire's multiply-and-reject (exact: the
/// rejected low words are the ones that would make some outputs more likely).
fn below_u64<R: Rng + ?Sized>(n: u64, rng: &mut R) -> u64 {
    debug_assert!(n > 0);
    let mut m = u128::from(rng.next_u64()) * u128::from(n);
    if (m as u64) < n {
        let threshold = n.wrapping_neg() % n;
        while (m as u64) < threshold {
            m = u128::from(rng.next_u64()) * u128::from(n);
        }
    }
    (m >> 64) as u64
}

/// A uniform integer in `[0, n)`, `n >= 1`: 64-bit ranges as [`below_u64`], wider ones by
/// masking to the bit length of `n - 1` and rejecting (fewer than two tries expected).
fn below_u128<R: Rng + ?Sized>(n: u128, rng: &mut R) -> u128 {
    debug_assert!(n > 0);
    if let Ok(small) = u64::try_from(n) {
        return u128::from(below_u64(small, rng));
    }
    let bits = 128 - (n - 1).leading_zeros();
    let mask = u128::MAX >> (128 - bits);
    loop {
        let x = ((u128::from(rng.next_u64()) << 64) | u128::from(rng.next_u64())) & mask;
        if x < n {
            return x;
        }
    }
}

/// `Bernoulli(num / den)` for `num <= den`, `den >= 1`.
fn bernoulli<R: Rng + ?Sized>(num: u128, den: u128, rng: &mut R) -> bool {
    below_u128(den, rng) < num
}

/// `Bernoulli(exp(-num / den))` for `0 <= num <= den` (CKS Algorithm 1, first case): the
/// parity of the first `K` at which `Bernoulli(gamma / K)` fails.
fn bernoulli_exp_unit<R: Rng + ?Sized>(num: u128, den: u128, rng: &mut R) -> bool {
    debug_assert!(num <= den && den > 0);
    if num == 0 {
        return true;
    }
    let mut k: u128 = 1;
    loop {
        let success = match den.checked_mul(k) {
            Some(dk) => bernoulli(num, dk, rng),
            // num / (den k) as two independent trials: the same probability, no overflow
            // (reached only after about 2^15 successes in a row, a 1 / (2^15)! event).
            None => bernoulli(num, den, rng) && bernoulli(1, k, rng),
        };
        if !success {
            return k % 2 == 1;
        }
        k += 1;
    }
}

/// `Bernoulli(exp(-(whole + rem / den)))` for `rem < den`: `whole` independent draws of
/// `Bernoulli(exp(-1))` and one of `exp(-rem / den)`, stopping at the first failure (CKS
/// Algorithm 1, second case). The expected work does not grow with `whole`.
fn bernoulli_exp_split<R: Rng + ?Sized>(whole: u128, rem: u128, den: u128, rng: &mut R) -> bool {
    let mut i = 0;
    while i < whole {
        if !bernoulli_exp_unit(1, 1, rng) {
            return false;
        }
        i += 1;
    }
    bernoulli_exp_unit(rem, den, rng)
}

/// `Bernoulli(exp(-num / den))` for any `num`, `den >= 1`: one draw of `exp(-1)` per
/// whole unit of the exponent, peeled off by subtraction and stopping at the first
/// failure, then one of the fraction. Fewer than 1.6 units are peeled on average whatever
/// the exponent, so no 128-bit division is needed (the Gaussian's acceptance test spent a
/// quarter of its time in two of them).
fn bernoulli_exp_raw<R: Rng + ?Sized>(num: u128, den: u128, rng: &mut R) -> bool {
    let mut rem = num;
    while rem >= den {
        if !bernoulli_exp_unit(1, 1, rng) {
            return false;
        }
        rem -= den;
    }
    bernoulli_exp_unit(rem, den, rng)
}

/// One draw of `Bernoulli(exp(-num / den))`: `true` with probability exactly
/// `exp(-num / den)`.
pub fn bernoulli_exp<R: Rng + ?Sized>(
    num: u128,
    den: u128,
    rng: &mut R,
) -> Result<bool, DiscreteError> {
    if den == 0 {
        return Err(DiscreteError::ZeroDenominator);
    }
    Ok(bernoulli_exp_raw(num, den, rng))
}

/// The discrete Laplace of scale `t / s` (`t, s >= 1`): `P(x)` proportional to
/// `exp(-|x| s / t)` (CKS Algorithm 2), conditioned on `|x| < 2^62`.
fn laplace_raw<R: Rng + ?Sized>(t: u64, s: u64, rng: &mut R) -> i64 {
    loop {
        // X = U + t V is geometric with ratio exp(-1/t): U uniform below t kept with
        // probability exp(-U / t), V geometric with ratio exp(-1).
        let u = below_u64(t, rng);
        if !bernoulli_exp_unit(u128::from(u), u128::from(t), rng) {
            continue;
        }
        let mut v: u64 = 0;
        while bernoulli_exp_unit(1, 1, rng) {
            v = v.saturating_add(1);
        }
        let x = u128::from(u) + u128::from(t) * u128::from(v);
        let y = x / u128::from(s);
        let negative = rng.next_u32() & 1 == 1;
        // Both signs of 0 are the same point: drop one so 0 is not counted twice.
        if (negative && y == 0) || y >= OUTPUT_LIMIT {
            continue;
        }
        let y = y as i64;
        return if negative { -y } else { y };
    }
}

/// One draw of the discrete Laplace of scale `num / den`: `P(x)` proportional to
/// `exp(-|x| den / num)` for every integer `x`. The scale must be in `(0, 2^32]`.
pub fn discrete_laplace<R: Rng + ?Sized>(
    num: u64,
    den: u64,
    rng: &mut R,
) -> Result<i64, DiscreteError> {
    if den == 0 {
        return Err(DiscreteError::ZeroDenominator);
    }
    if num == 0 || u128::from(num) > u128::from(den) * u128::from(MAX_LAPLACE_SCALE) {
        return Err(DiscreteError::LaplaceScale { num, den });
    }
    Ok(laplace_raw(num, den, rng))
}

/// The discrete Gaussian `N_Z(0, sigma^2)` for a rational `sigma^2 = num / den`:
/// `P(x)` proportional to `exp(-x^2 / (2 sigma^2))` for every integer `x` (CKS
/// Algorithm 3). Its variance is below `sigma^2`, by a relative `10^-6` or less once
/// `sigma >= 1` (the tests sum it exactly). Set up once, drawn from many times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscreteGaussian {
    /// `N`, with `sigma^2 = N / D`.
    num: u64,
    /// `D`.
    den: u64,
    /// `t = floor(sigma) + 1`, the scale of the Laplace proposal.
    t: u64,
    /// `D t`.
    den_t: u128,
    /// `2 N D t^2`: the acceptance probability of a proposal `y` is
    /// `exp(-(|y| D t - N)^2 / (2 N D t^2))`, i.e. `exp(-(|y| - sigma^2 / t)^2 / (2 sigma^2))`.
    accept_den: u128,
}

impl DiscreteGaussian {
    /// The discrete Gaussian of variance parameter `num / den`; `num <= 2^62`,
    /// `1 <= den <= 2^32` (they keep the acceptance test within 128-bit words).
    pub fn new(num: u64, den: u64) -> Result<Self, DiscreteError> {
        if den == 0 {
            return Err(DiscreteError::ZeroDenominator);
        }
        if num > MAX_VARIANCE_NUMERATOR || den > MAX_VARIANCE_DENOMINATOR {
            return Err(DiscreteError::VarianceOutOfRange {
                num: u128::from(num),
                den: u128::from(den),
            });
        }
        // floor(sqrt(N / D)) = floor(sqrt(floor(N / D))).
        let t = (num / den).isqrt() + 1;
        let den_t = u128::from(den) * u128::from(t);
        // Below 2^128: t^2 D <= 4 N when sigma >= 1, and t = 1 (so 2 N D < 2^65) when not.
        let accept_den = 2 * u128::from(num) * den_t * u128::from(t);
        Ok(Self {
            num,
            den,
            t,
            den_t,
            accept_den,
        })
    }

    /// The discrete Gaussian whose variance parameter is the smallest rational with a
    /// power-of-two denominator (at most `2^32`, and no larger than keeps the numerator
    /// below `2^56`) that is at least `variance`: rounding up, so that no caller gets
    /// less noise than it asked for. The comparison is exact (`variance * 2^k` is exact
    /// in `f64` and its ceiling too); callers that compute `variance` in floating point
    /// add their own margin for that computation's rounding.
    pub fn at_least(variance: f64) -> Result<Self, DiscreteError> {
        let (num, den) = rational_at_least(variance)?;
        if num > MAX_VARIANCE_NUMERATOR as f64 {
            return Err(DiscreteError::VarianceOutOfRange {
                num: num as u128,
                den: u128::from(den),
            });
        }
        Self::new(num as u64, den)
    }

    /// `sigma^2` as `(numerator, denominator)`.
    pub fn variance(&self) -> (u64, u64) {
        (self.num, self.den)
    }

    /// `sigma^2` as the nearest `f64`.
    pub fn variance_f64(&self) -> f64 {
        self.num as f64 / self.den as f64
    }

    /// One draw: `P(x)` proportional to `exp(-x^2 / (2 sigma^2))`, conditioned on
    /// `|x| < 2^62`. 0 when `sigma^2` is 0.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> i64 {
        if self.num == 0 {
            return 0;
        }
        loop {
            let y = laplace_raw(self.t, 1, rng);
            // |y| < 2^62 and D t <= 2^49: the product fits.
            let distance =
                (u128::from(y.unsigned_abs()) * self.den_t).abs_diff(u128::from(self.num));
            if self.accept(distance, rng) {
                return y;
            }
        }
    }

    /// `Bernoulli(exp(-distance^2 / accept_den))`.
    fn accept<R: Rng + ?Sized>(&self, distance: u128, rng: &mut R) -> bool {
        if let Ok(small) = u64::try_from(distance) {
            let square = u128::from(small) * u128::from(small);
            return bernoulli_exp_raw(square, self.accept_den, rng);
        }
        // A proposal far in the tail: the square takes 256 bits.
        let (hi, lo) = mul_wide(distance, distance);
        bernoulli_exp_wide(hi, lo, self.accept_den, rng)
    }
}

/// The smallest `N / 2^k >= value` with `k <= 32` as large as keeps `N` below `2^56`, as
/// `(N as f64, 2^k)`: `value * 2^k` is exact in `f64`, and so is its ceiling, so the
/// comparison is exact. `N` may exceed `2^56` (and `u64`) when `value` does; callers
/// check it against their own bound.
fn rational_at_least(value: f64) -> Result<(f64, u64), DiscreteError> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(DiscreteError::InvalidVariance(value));
    }
    let mut k = 32;
    while k > 0 && value * (1u64 << k) as f64 > FAST_NUMERATOR {
        k -= 1;
    }
    Ok(((value * (1u64 << k) as f64).ceil(), 1u64 << k))
}

/// `Poisson(a / b)` for `a / b <= 1/2`: a proposal `j` geometric with ratio `a / b`
/// (`P(j)` proportional to `(a / b)^j`) kept with probability `1 / j!`, so that `P(j)` is
/// proportional to `(a / b)^j / j!`. Over 80% of proposals are kept.
fn poisson_small<R: Rng + ?Sized>(a: u128, b: u128, rng: &mut R) -> u64 {
    debug_assert!(2 * a <= b);
    loop {
        let mut j: u64 = 0;
        while bernoulli(a, b, rng) {
            j += 1;
        }
        if (2..=j).all(|i| below_u64(i, rng) == 0) {
            return j;
        }
    }
}

/// One draw of `Poisson(num / den)`, exactly, as the sum of `ceil(2 num / den)` draws of
/// mean at most 1/2 (expected `O(1 + num / den)` uniform draws). The mean must be at most
/// [`MAX_POISSON_MEAN`].
pub fn poisson<R: Rng + ?Sized>(num: u64, den: u64, rng: &mut R) -> Result<u64, DiscreteError> {
    if den == 0 {
        return Err(DiscreteError::ZeroDenominator);
    }
    if u128::from(num) > u128::from(den) * u128::from(MAX_POISSON_MEAN) {
        return Err(DiscreteError::PoissonMean { num, den });
    }
    Ok(poisson_raw(num, den, rng))
}

fn poisson_raw<R: Rng + ?Sized>(num: u64, den: u64, rng: &mut R) -> u64 {
    let (a, b) = (u128::from(num), u128::from(den));
    let pieces = (2 * a).div_ceil(b);
    (0..pieces).map(|_| poisson_small(a, b * pieces, rng)).sum()
}

/// The Skellam distribution `Pois(mu / 2) - Pois(mu / 2)` (mean 0, variance `mu`) for a
/// rational `mu / 2`, drawn exactly from two [`poisson`] draws. Their cost grows with
/// `mu`, so this is for small variances (up to [`MAX_SKELLAM_VARIANCE`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skellam {
    /// `mu / 2 = half_num / half_den`.
    half_num: u64,
    half_den: u64,
}

/// The largest Skellam variance accepted.
pub const MAX_SKELLAM_VARIANCE: f64 = 1024.0;

impl Skellam {
    /// The Skellam distribution of the smallest variance `mu >= variance` whose half is a
    /// rational with a power-of-two denominator up to `2^32` (rounded up, as
    /// [`DiscreteGaussian::at_least`]).
    pub fn at_least(variance: f64) -> Result<Self, DiscreteError> {
        if variance > MAX_SKELLAM_VARIANCE {
            return Err(DiscreteError::VarianceOutOfRange {
                num: variance.ceil() as u128,
                den: 1,
            });
        }
        // Halved through the denominator: exact even where variance / 2 would not be.
        let (num, den) = rational_at_least(variance)?;
        Ok(Self {
            half_num: num as u64,
            half_den: 2 * den,
        })
    }

    /// `mu` as the nearest `f64`.
    pub fn variance_f64(&self) -> f64 {
        2.0 * self.half_num as f64 / self.half_den as f64
    }

    /// One draw.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> i64 {
        if self.half_num == 0 {
            return 0;
        }
        let a = poisson_raw(self.half_num, self.half_den, rng);
        let b = poisson_raw(self.half_num, self.half_den, rng);
        a as i64 - b as i64
    }
}

/// `Bernoulli(exp(-(hi 2^128 + lo) / den))`, `den >= 1`.
fn bernoulli_exp_wide<R: Rng + ?Sized>(hi: u128, lo: u128, den: u128, rng: &mut R) -> bool {
    let (quotient_hi, quotient_lo, rem) = div_wide(hi, lo, den);
    // exp(-(q_hi 2^128 + q_lo + rem / den)): q_hi rounds of 2^128 draws of exp(-1), all
    // stopping at the first failure.
    let mut round = 0;
    while round < quotient_hi {
        if !bernoulli_exp_split(u128::MAX, 0, 1, rng) || !bernoulli_exp_unit(1, 1, rng) {
            return false;
        }
        round += 1;
    }
    bernoulli_exp_split(quotient_lo, rem, den, rng)
}

/// `a b` as `(high, low)` 128-bit halves.
fn mul_wide(a: u128, b: u128) -> (u128, u128) {
    const LOW: u128 = u64::MAX as u128;
    let (a1, a0, b1, b0) = (a >> 64, a & LOW, b >> 64, b & LOW);
    let (ll, lh, hl, hh) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
    // The middle 64-bit column with its carries; each term is below 2^64, so no overflow.
    let mid = (ll >> 64) + (lh & LOW) + (hl & LOW);
    let lo = (ll & LOW) | (mid << 64);
    let hi = hh + (lh >> 64) + (hl >> 64) + (mid >> 64);
    (hi, lo)
}

/// `(hi 2^128 + lo) / d` as `(quotient high, quotient low, remainder)`, by binary long
/// division (only the far tail of the Gaussian takes this path).
fn div_wide(hi: u128, lo: u128, d: u128) -> (u128, u128, u128) {
    debug_assert!(d > 0);
    let (mut q_hi, mut q_lo, mut rem) = (0u128, 0u128, 0u128);
    for i in (0..256).rev() {
        let bit = if i >= 128 {
            (hi >> (i - 128)) & 1
        } else {
            (lo >> i) & 1
        };
        let carry = rem >> 127;
        rem = (rem << 1) | bit;
        // The true value is carry 2^128 + rem < 2 d, so one subtraction brings it below d.
        if carry == 1 || rem >= d {
            rem = rem.wrapping_sub(d);
            if i >= 128 {
                q_hi |= 1 << (i - 128);
            } else {
                q_lo |= 1 << i;
            }
        }
    }
    (q_hi, q_lo, rem)
}

/// One draw of the discrete Gaussian `N_Z(0, num / den)` (see [`DiscreteGaussian`]).
pub fn discrete_gaussian<R: Rng + ?Sized>(
    num: u64,
    den: u64,
    rng: &mut R,
) -> Result<i64, DiscreteError> {
    Ok(DiscreteGaussian::new(num, den)?.sample(rng))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;
    use std::collections::BTreeMap;

    fn rng(seed: u64) -> ChaCha20Rng {
        ChaCha20Rng::seed_from_u64(seed)
    }

    /// `P(x)` of the discrete Laplace of scale `b`.
    fn laplace_pmf(b: f64) -> impl Fn(i64) -> f64 {
        let q = (-1.0 / b).exp();
        move |x| (1.0 - q) / (1.0 + q) * q.powi(x.unsigned_abs() as i32)
    }

    /// `P(x)` of `N_Z(0, s2)`, normalised by summing far past the tails.
    fn gaussian_pmf(s2: f64) -> impl Fn(i64) -> f64 {
        let reach = (s2.sqrt() * 40.0) as i64 + 10;
        let total: f64 = (-reach..=reach)
            .map(|x| (-(x as f64).powi(2) / (2.0 * s2)).exp())
            .sum();
        move |x| (-(x as f64).powi(2) / (2.0 * s2)).exp() / total
    }

    /// The exact variance of `N_Z(0, s2)`.
    fn gaussian_variance(s2: f64) -> f64 {
        let pmf = gaussian_pmf(s2);
        let reach = (s2.sqrt() * 40.0) as i64 + 10;
        (-reach..=reach).map(|x| (x as f64).powi(2) * pmf(x)).sum()
    }

    /// Pearson's statistic of `draws` against a pmf: one bin per value in
    /// `[-reach, reach]` whose expected count is at least 5, one for all the rest.
    /// Returns `(statistic, degrees of freedom)`.
    fn chi_square(draws: &[i64], pmf: impl Fn(i64) -> f64, reach: i64) -> (f64, f64) {
        let n = draws.len() as f64;
        let binned: Vec<i64> = (-reach..=reach).filter(|&x| n * pmf(x) >= 5.0).collect();
        let mut counts: BTreeMap<i64, f64> = binned.iter().map(|&x| (x, 0.0)).collect();
        let mut rest_count = 0.0;
        for &x in draws {
            match counts.get_mut(&x) {
                Some(c) => *c += 1.0,
                None => rest_count += 1.0,
            }
        }
        let mut statistic = 0.0;
        let mut inside = 0.0;
        for (&x, &observed) in &counts {
            let expected = n * pmf(x);
            inside += pmf(x);
            statistic += (observed - expected).powi(2) / expected;
        }
        let rest_expected = n * (1.0 - inside);
        let mut bins = counts.len() as f64;
        if rest_expected > 1e-9 {
            statistic += (rest_count - rest_expected).powi(2) / rest_expected;
            bins += 1.0;
        } else {
            assert_eq!(rest_count, 0.0, "draws where the pmf has no mass");
        }
        (statistic, bins - 1.0)
    }

    /// The chi-square statistic has mean `df` and standard deviation `sqrt(2 df)`; a
    /// correct sampler passes six of those above the mean but for a `< 10^-5` chance.
    fn assert_fits(draws: &[i64], pmf: impl Fn(i64) -> f64, what: &str) {
        let (statistic, df) = chi_square(draws, pmf, 2000);
        assert!(
            statistic < df + 6.0 * (2.0 * df).sqrt(),
            "{what}: chi-square {statistic:.1} on {df} degrees of freedom"
        );
    }

    fn mean_and_variance(draws: &[i64]) -> (f64, f64) {
        let n = draws.len() as f64;
        let mean = draws.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = draws
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / (n - 1.0);
        (mean, var)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Protects Algorithm 1: the frequency of `true` is `exp(-num / den)` within five
        /// standard errors, across exponents below and above 1.
        #[test]
        fn bernoulli_exp_frequencies_match_exp(num in 0u128..400, den in 1u128..100, seed: u64) {
            let n = 4000;
            let mut r = rng(seed);
            let hits = (0..n).filter(|_| bernoulli_exp(num, den, &mut r).unwrap()).count();
            let p = (-(num as f64) / den as f64).exp();
            let se = (p * (1.0 - p) / n as f64).sqrt();
            let freq = hits as f64 / n as f64;
            // Five standard errors, and five draws: for a tiny p (exp(-11.7) here and there)
            // a single hit among 4,000 is already past five standard errors.
            prop_assert!(
                (freq - p).abs() <= 5.0 * se + 5.0 / n as f64,
                "{num}/{den}: {freq} vs {p}"
            );
        }

        /// Protects the 256-bit arithmetic of the Gaussian's far tail: the product and the
        /// quotient with remainder put the number back together.
        #[test]
        fn wide_division_inverts_wide_multiplication(a: u128, b in 1u128.., r_seed: u128) {
            let (hi, lo) = mul_wide(a, b);
            let r = r_seed % b;
            let (lo, carry) = lo.overflowing_add(r);
            let hi = hi + u128::from(carry);
            prop_assert_eq!(div_wide(hi, lo, b), (0, a, r));
        }
    }

    /// Protects the 128-bit halves at their extremes.
    #[test]
    fn wide_products_of_extremes() {
        assert_eq!(mul_wide(u128::MAX, u128::MAX), (u128::MAX - 1, 1));
        assert_eq!(mul_wide(1 << 127, 1 << 127), (1 << 126, 0));
        assert_eq!(mul_wide(1 << 64, 1 << 64), (1, 0));
        assert_eq!(div_wide(u128::MAX - 1, 1, 1), (u128::MAX - 1, 1, 0));
        assert_eq!(div_wide(5, 7, u128::MAX), (0, 5, 12));
    }

    /// Protects the far-tail path of the Gaussian's acceptance test: through the wide
    /// division it keeps `exp(-x / den)` within five standard errors.
    #[test]
    fn the_wide_acceptance_test_has_the_same_probabilities() {
        let mut r = rng(3);
        let n = 20_000;
        for (lo, den) in [(1u128, 3u128), (5, 2), (7, 7)] {
            let hits = (0..n)
                .filter(|_| bernoulli_exp_wide(0, lo, den, &mut r))
                .count();
            let p = (-(lo as f64) / den as f64).exp();
            let se = (p * (1.0 - p) / f64::from(n)).sqrt();
            let freq = hits as f64 / f64::from(n);
            assert!((freq - p).abs() < 5.0 * se, "{lo}/{den}: {freq} vs {p}");
        }
        // 2^128 / 1 is past any exponent a draw could survive.
        assert!(!bernoulli_exp_wide(1, 0, 1, &mut r));
    }

    /// Protects Algorithm 2 against the exact pmf `(1 - q) / (1 + q) q^|x|`,
    /// `q = exp(-1 / b)`, and its variance `2 q / (1 - q)^2`.
    #[test]
    fn discrete_laplace_matches_its_pmf_and_variance() {
        let mut r = rng(5);
        let n = 100_000;
        for (num, den) in [(1u64, 1u64), (3, 2), (7, 3), (1, 4), (20, 1)] {
            let draws: Vec<i64> = (0..n)
                .map(|_| discrete_laplace(num, den, &mut r).unwrap())
                .collect();
            let b = num as f64 / den as f64;
            assert_fits(&draws, laplace_pmf(b), &format!("laplace {num}/{den}"));
            let q = (-1.0 / b).exp();
            let var = 2.0 * q / (1.0 - q).powi(2);
            let (mean, sample_var) = mean_and_variance(&draws);
            // Standard error of the mean sqrt(var / n); of the variance about
            // var sqrt((kurtosis - 1) / n) with kurtosis below 6 for these: 5 of each.
            assert!(
                mean.abs() < 5.0 * (var / n as f64).sqrt(),
                "{num}/{den}: mean {mean}"
            );
            assert!(
                (sample_var - var).abs() < 5.0 * var * (5.0 / n as f64).sqrt(),
                "{num}/{den}: variance {sample_var} vs {var}"
            );
        }
    }

    /// Protects Algorithm 3 against the exact pmf of `N_Z(0, sigma^2)` for variances below,
    /// at and above 1, with non-integer rationals.
    #[test]
    fn discrete_gaussian_matches_its_pmf() {
        let mut r = rng(11);
        let n = 100_000;
        for (num, den) in [(1u64, 4u64), (1, 1), (5, 2), (100, 7), (1000, 3)] {
            let g = DiscreteGaussian::new(num, den).unwrap();
            let draws: Vec<i64> = (0..n).map(|_| g.sample(&mut r)).collect();
            let s2 = num as f64 / den as f64;
            assert_fits(&draws, gaussian_pmf(s2), &format!("gaussian {num}/{den}"));
        }
    }

    /// Protects the noise scale at the sizes the mechanisms use: mean 0 and the exact
    /// variance of `N_Z(0, sigma^2)`, which is `sigma^2` to within `10^-6` once
    /// `sigma >= 1`.
    #[test]
    fn discrete_gaussian_has_mean_zero_and_its_exact_variance() {
        for s2 in [0.5, 1.0, 2.5, 50.0] {
            let exact = gaussian_variance(s2);
            // Below sigma^2; from 2.5 on by less than the sum's own rounding.
            assert!(exact < s2 * (1.0 + 1e-12), "{s2}");
            if s2 >= 1.0 {
                assert!(exact > s2 * (1.0 - 1e-6), "{s2}: {exact}");
            }
        }
        let mut r = rng(13);
        let n = 100_000;
        for s2 in [0.5, 2.5, (1u64 << 20) as f64 / 3.0, 1e12, 4e15] {
            let g = DiscreteGaussian::at_least(s2).unwrap();
            let draws: Vec<i64> = (0..n).map(|_| g.sample(&mut r)).collect();
            let (mean, var) = mean_and_variance(&draws);
            let exact = if s2 < 100.0 {
                gaussian_variance(g.variance_f64())
            } else {
                s2
            };
            // Standard errors: sqrt(var / n) for the mean, var sqrt(2 / n) for the
            // variance (kurtosis 3); five of each.
            assert!(
                mean.abs() < 5.0 * (exact / n as f64).sqrt(),
                "{s2}: mean {mean}"
            );
            assert!(
                (var / exact - 1.0).abs() < 5.0 * (2.0 / n as f64).sqrt(),
                "{s2}: variance {var} vs {exact}"
            );
        }
    }

    /// `P(k)` of `Poisson(lambda)`.
    fn poisson_pmf(lambda: f64) -> impl Fn(i64) -> f64 {
        move |k| {
            if k < 0 {
                return 0.0;
            }
            let log =
                -lambda + k as f64 * lambda.ln() - (1..=k).map(|i| (i as f64).ln()).sum::<f64>();
            log.exp()
        }
    }

    /// Protects the exact Poisson sampler against its pmf, mean and variance (both
    /// `lambda`), with means below, at and above the pieces' 1/2.
    #[test]
    fn poisson_matches_its_pmf_mean_and_variance() {
        let mut r = rng(19);
        let n = 100_000;
        for (num, den) in [(1u64, 3u64), (1, 2), (1, 1), (5, 2), (29, 4)] {
            let draws: Vec<i64> = (0..n)
                .map(|_| poisson(num, den, &mut r).unwrap() as i64)
                .collect();
            let lambda = num as f64 / den as f64;
            assert_fits(&draws, poisson_pmf(lambda), &format!("poisson {num}/{den}"));
            let (mean, var) = mean_and_variance(&draws);
            let se = (lambda / n as f64).sqrt();
            assert!((mean - lambda).abs() < 5.0 * se, "{num}/{den}: mean {mean}");
            // The variance's standard error: lambda sqrt((2 + 1 / lambda) / n).
            let var_se = lambda * ((2.0 + 1.0 / lambda) / n as f64).sqrt();
            assert!(
                (var - lambda).abs() < 5.0 * var_se,
                "{num}/{den}: variance {var}"
            );
        }
        assert_eq!(poisson(0, 1, &mut r).unwrap(), 0);
    }

    /// Protects the exact Skellam noise of small variances against its pmf (the
    /// difference of two Poisson pmfs) and its variance `mu`.
    #[test]
    fn skellam_matches_its_pmf_and_variance() {
        let mut r = rng(29);
        let n = 100_000;
        for mu in [0.375, 2.0, 15.5] {
            let sk = Skellam::at_least(mu).unwrap();
            assert_eq!(sk.variance_f64(), mu, "these are exact binary fractions");
            let draws: Vec<i64> = (0..n).map(|_| sk.sample(&mut r)).collect();
            let p: Vec<f64> = (0..400).map(poisson_pmf(mu / 2.0)).collect();
            let table: Vec<f64> = (0..200)
                .map(|k| (0..200).map(|j| p[j + k] * p[j]).sum())
                .collect();
            let pmf = |k: i64| table.get(k.unsigned_abs() as usize).copied().unwrap_or(0.0);
            assert_fits(&draws, pmf, &format!("skellam {mu}"));
            let (mean, var) = mean_and_variance(&draws);
            assert!(
                mean.abs() < 5.0 * (mu / n as f64).sqrt(),
                "{mu}: mean {mean}"
            );
            let var_se = mu * ((2.0 + 1.0 / mu) / n as f64).sqrt();
            assert!((var - mu).abs() < 5.0 * var_se, "{mu}: variance {var}");
        }
        assert_eq!(Skellam::at_least(0.0).unwrap().sample(&mut r), 0);
        assert!(Skellam::at_least(MAX_SKELLAM_VARIANCE * 2.0).is_err());
        assert!(Skellam::at_least(f64::NAN).is_err());
        assert_eq!(poisson(1, 0, &mut r), Err(DiscreteError::ZeroDenominator));
        assert!(poisson(MAX_POISSON_MEAN + 1, 1, &mut r).is_err());
        poisson(u64::MAX, u64::MAX, &mut r).unwrap();
        poisson(1, u64::MAX, &mut r).unwrap();
    }

    /// Protects the promise callers rely on: the rational is never below the variance
    /// asked for, and is as close as its denominator allows.
    #[test]
    fn variances_round_up_to_a_bounded_rational() {
        for v in [
            0.0,
            1e-300,
            1e-9,
            0.1,
            1.0 / 3.0,
            2.5,
            1e6 + 0.7,
            1e12 / 7.0,
            4.0e18,
        ] {
            let g = DiscreteGaussian::at_least(v).unwrap();
            let (num, den) = g.variance();
            assert!(den <= MAX_VARIANCE_DENOMINATOR && den.is_power_of_two());
            // v * den is exact (den is a power of two), and so is its ceiling: num / den
            // is the smallest multiple of 1 / den at or above v.
            let scaled = v * den as f64;
            assert_eq!(num as f64, scaled.ceil(), "{v}: {num}/{den}");
            // and den is the largest the bounds allow
            assert!(
                den == MAX_VARIANCE_DENOMINATOR || 2.0 * scaled > FAST_NUMERATOR,
                "{v}"
            );
        }
        assert_eq!(
            DiscreteGaussian::at_least(0.1).unwrap().variance().1,
            1 << 32
        );
        assert!(matches!(
            DiscreteGaussian::at_least(f64::NAN),
            Err(DiscreteError::InvalidVariance(_))
        ));
        assert!(DiscreteGaussian::at_least(-1.0).is_err());
        assert!(matches!(
            DiscreteGaussian::at_least(1e19),
            Err(DiscreteError::VarianceOutOfRange { .. })
        ));
    }

    /// Protects callers from panics: every sampler either refuses a parameter with an
    /// error or draws, at 0, at the extremes of its range and past them.
    #[test]
    fn samplers_never_panic_on_edge_values() {
        let mut r = rng(17);
        for _ in 0..100 {
            assert!(bernoulli_exp(0, 1, &mut r).unwrap());
            assert!(bernoulli_exp(0, u128::MAX, &mut r).unwrap());
            assert!(!bernoulli_exp(u128::MAX, 1, &mut r).unwrap());
            bernoulli_exp(u128::MAX, u128::MAX, &mut r).unwrap();
            bernoulli_exp(1, u128::MAX, &mut r).unwrap();
            assert_eq!(discrete_gaussian(0, 1, &mut r).unwrap(), 0);
            discrete_gaussian(MAX_VARIANCE_NUMERATOR, 1, &mut r).unwrap();
            discrete_gaussian(1, MAX_VARIANCE_DENOMINATOR, &mut r).unwrap();
            discrete_gaussian(MAX_VARIANCE_NUMERATOR, MAX_VARIANCE_DENOMINATOR, &mut r).unwrap();
            discrete_laplace(1, u64::MAX, &mut r).unwrap();
            discrete_laplace(MAX_LAPLACE_SCALE, 1, &mut r).unwrap();
            discrete_laplace(u64::MAX, u64::MAX, &mut r).unwrap();
        }
        assert_eq!(
            bernoulli_exp(1, 0, &mut r),
            Err(DiscreteError::ZeroDenominator)
        );
        assert_eq!(
            discrete_gaussian(1, 0, &mut r),
            Err(DiscreteError::ZeroDenominator)
        );
        assert!(discrete_gaussian(MAX_VARIANCE_NUMERATOR + 1, 1, &mut r).is_err());
        assert!(discrete_gaussian(1, MAX_VARIANCE_DENOMINATOR + 1, &mut r).is_err());
        assert_eq!(
            discrete_laplace(1, 0, &mut r),
            Err(DiscreteError::ZeroDenominator)
        );
        assert!(discrete_laplace(0, 1, &mut r).is_err());
        assert!(discrete_laplace(MAX_LAPLACE_SCALE + 1, 1, &mut r).is_err());
        // A tiny variance gives 0 but for a probability of about exp(-2^31).
        let tiny = DiscreteGaussian::at_least(1e-300).unwrap();
        assert!((0..1000).all(|_| tiny.sample(&mut r) == 0));
    }

    /// Protects reproducibility: the same seed gives the same draws.
    #[test]
    fn draws_depend_only_on_the_seed() {
        let g = DiscreteGaussian::at_least(1e6).unwrap();
        let (mut first, mut second) = (rng(23), rng(23));
        let a: Vec<i64> = (0..100).map(|_| g.sample(&mut first)).collect();
        let b: Vec<i64> = (0..100).map(|_| g.sample(&mut second)).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != a[0]));
    }
}
