//! Distributed differential privacy under secure aggregation, in the integer domain of
//! the masked sum: the Skellam mechanism (Agarwal, Kairouz and Liu, NeurIPS 2021) for
//! small noise shares and the distributed discrete Gaussian mechanism (Kairouz, Liu and
//! Steinke, ICML 2021) for large ones, both drawn exactly ([`super::discrete`]).
//!
//! Every client clips its update to L2 norm `C`, scales it by `gamma`, rounds each
//! coordinate stochastically (unbiased) to an integer, adds its own noise share of
//! variance `mu` per coordinate, and only then masks the vector. The coordinator unmasks
//! the sum of the survivors' vectors: it never sees a sum, let alone an update, without
//! noise, and no one but the client ever holds its share (it is drawn from the client's
//! own generator and sent nowhere but inside the masked vector).
//!
//! **Which noise.** Every client of a round draws from the same distribution (`mu`
//! depends only on the round's settings and dimension):
//! - `mu < 16`: Skellam `Sk(mu) = Pois(mu / 2) - Pois(mu / 2)` from the exact Poisson
//!   sampler, whose cost grows with the mean (a few dozen uniform draws at `mu = 16`).
//!   The sum of `m` shares is exactly `Sk(m mu)`.
//! - `mu >= 16`: the discrete Gaussian `N_Z(0, mu)`, whose exact sampler costs `O(1)`
//!   draws at every `mu`. `mu` reaches `10^15` here, where an exact Poisson sampler for a
//!   rational mean (Duchon and Duvignau's, or thinning Poisson(1) draws) would take
//!   `Theta(mu)` draws per coordinate, and the fast Poisson samplers (rand_distr's PTRS,
//!   used before) decide in floating point. The sum of `m` shares is close to, not
//!   exactly, `N_Z(0, m mu)` (see Accounting).
//!
//! **Calibration.** For a round of `n` selected clients and noise multiplier `z`, each
//! share has variance parameter `mu = (z * Delta)^2 / n` (rounded up to a rational),
//! where `Delta = gamma * C + sqrt(d)` bounds the L2 norm of a client's rounded vector
//! (rounding moves each of the `d` coordinates by less than 1). When all `n` survive, the
//! sum carries noise of standard deviation `z * Delta` (the discrete Gaussian's variance
//! is below `mu` by a relative `10^-6` at most once `mu >= 1`); when only `m` do, the
//! round's effective multiplier is `z * sqrt(m / n)`, which
//! [`SkellamScale::effective_noise_multiplier`] reports so that the accountant charges the
//! noise that was actually there.
//!
//! **Accounting.** The accountant treats a round as the Poisson-subsampled Gaussian
//! mechanism with the effective multiplier (the approximation both papers and TensorFlow
//! Federated's distributed DP use), and [`SkellamScale::skellam_excess`] bounds how much
//! the actual noise's divergence exceeds the Gaussian one, relative to it:
//! - Skellam: the second term of Agarwal et al.'s Theorem 3.5; with `gamma` as large as
//!   the 32-bit words allow the sum's variance is large and the excess small (a test
//!   checks).
//! - Discrete Gaussian shares: Kairouz, Liu and Steinke's Theorem 1 (Proposition 14)
//!   makes the sum of `m` shares of `N_Z(0, mu)` `eps^2 / 2`-concentrated DP with
//!   `eps^2 <= Delta^2 / (m mu) + 2 tau d` (the larger constant of the versions in
//!   circulation), `tau = 10 sum_{k=1}^{m-1} exp(-2 pi^2 mu k / (k+1))
//!   <= 10 (m - 1) exp(-pi^2 mu)`. At `mu >= 16` that is below `10^-46` of the Gaussian
//!   term for every round `SkellamScale::new` accepts (`m <= 2^21`, `d <= 2^28`,
//!   `z <= 100`).
//!
//! **Range.** `gamma` is the largest scale for which the signed sum of `n` clients cannot
//! leave `(-2^31, 2^31)` unless the noise exceeds 8 standard deviations (probability
//! about `10^-15` per coordinate): `n (gamma C + 1) + 8 z Delta < 2^31`, with `Delta`
//! taken at the largest dimension a round allows.
//!
//! The threat model is the one of secure aggregation: clients follow the protocol (a
//! client that skips its noise share weakens the guarantee by its share's variance only);
//! the coordinator is curious and sees only masked vectors and the noisy sum.

use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::discrete::{DiscreteGaussian, Skellam};

/// Coordinates encoded per parallel task; each task draws from its own ChaCha20 stream of
/// the client's noise key, so the result does not depend on the number of threads.
const CHUNK: usize = 4096;

/// The largest `sqrt(d)` a secure round can have (`d <= 2^28`).
const MAX_SQRT_DIMENSION: f64 = 16_384.0;

/// Standard deviations of headroom left for the noise in the 32-bit sum.
const TAIL_SIGMAS: f64 = 8.0;

/// Shares of smaller variance are Skellam, larger ones discrete Gaussian (module docs).
pub const SKELLAM_BELOW: f64 = 16.0;

/// Covers the `f64` rounding in computing a share's variance, so that the rational it is
/// rounded up to is never below the real one.
const VARIANCE_MARGIN: f64 = 1.0 + 1.0 / (1u64 << 40) as f64;

/// The largest noise multiplier accepted: beyond it nothing useful is left of the sum.
pub const MAX_NOISE_MULTIPLIER: f64 = 100.0;

/// Public settings of distributed noise for a secure round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DistributedNoise {
    /// Each client's update is clipped to this L2 norm (`C`).
    pub l2_clip: f32,
    /// The sum of all selected clients' shares has standard deviation `noise_multiplier`
    /// times the sensitivity (`z`).
    pub noise_multiplier: f64,
}

/// Why distributed noise cannot be set up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DistributedNoiseError {
    /// A setting out of range.
    #[error("invalid distributed noise setting: {0}")]
    InvalidSettings(String),
}

/// The integer scale of one round's distributed noise: `gamma`, the sensitivity and each
/// client's share variance.
#[derive(Debug, Clone, PartialEq)]
pub struct SkellamScale {
    noise: DistributedNoise,
    parties: u32,
    gamma: f64,
}

impl SkellamScale {
    /// The scale for a round of `parties` selected clients.
    pub fn new(noise: DistributedNoise, parties: u32) -> Result<Self, DistributedNoiseError> {
        let bad = |m: String| Err(DistributedNoiseError::InvalidSettings(m));
        let c = f64::from(noise.l2_clip);
        if !(c.is_finite() && c > 0.0 && c <= 1e6) {
            return bad(format!(
                "l2_clip must be in (0, 1e6], got {}",
                noise.l2_clip
            ));
        }
        let z = noise.noise_multiplier;
        if !(z.is_finite() && (0.0..=MAX_NOISE_MULTIPLIER).contains(&z)) {
            return bad(format!(
                "noise_multiplier must be in [0, {MAX_NOISE_MULTIPLIER}], got {z}"
            ));
        }
        if parties == 0 {
            return bad("a round needs at least one client".into());
        }
        let n = f64::from(parties);
        let limit = f64::from(i32::MAX);
        let scaled_clip =
            (limit - n - TAIL_SIGMAS * z * MAX_SQRT_DIMENSION) / (n + TAIL_SIGMAS * z);
        // Fewer than 2^10 levels across the clip would drown the update in rounding.
        if scaled_clip < 1024.0 {
            return bad(format!(
                "{parties} clients with noise multiplier {z} leave no precision in 32-bit words"
            ));
        }
        Ok(Self {
            noise,
            parties,
            gamma: scaled_clip.floor() / c,
        })
    }

    /// The public settings.
    pub fn settings(&self) -> &DistributedNoise {
        &self.noise
    }

    /// The scale `gamma`: one unit of the integer domain is `1 / gamma` of a parameter.
    pub fn gamma(&self) -> f64 {
        self.gamma
    }

    /// The L2 sensitivity of the integer sum to one client, `gamma C + sqrt(d)`.
    pub fn sensitivity(&self, dimension: usize) -> f64 {
        self.gamma * f64::from(self.noise.l2_clip) + (dimension as f64).sqrt()
    }

    /// The variance `mu` of one client's noise share per coordinate, in integer units.
    pub fn share_variance(&self, dimension: usize) -> f64 {
        let s = self.noise.noise_multiplier * self.sensitivity(dimension);
        s * s / f64::from(self.parties)
    }

    /// The noise multiplier the sum of `survivors` clients' shares amounts to:
    /// `z * sqrt(survivors / n)`.
    pub fn effective_noise_multiplier(&self, survivors: usize) -> f64 {
        self.noise.noise_multiplier * (survivors as f64 / f64::from(self.parties)).sqrt()
    }

    /// Standard deviation of the noise in the decoded sum of `survivors` clients, in
    /// parameter units.
    pub fn sum_noise_std(&self, survivors: usize, dimension: usize) -> f64 {
        (survivors as f64 * self.share_variance(dimension)).sqrt() / self.gamma
    }

    /// How much the Rényi divergence of order `alpha` of the sum of `survivors` noise
    /// shares may exceed the Gaussian mechanism's, relative to it (module docs): for
    /// Skellam shares the second term of Agarwal et al.'s Theorem 3.5,
    /// `min(((2 alpha - 1) D2^2 + 6 D1) / (16 mu^2), 3 D1 / (4 mu))` over
    /// `alpha D2^2 / (2 mu)` with `mu` the sum's variance and `D1 <= sqrt(d) D2`; for
    /// discrete Gaussian shares `2 tau d / (D2^2 / (m mu))`. Infinite without noise.
    pub fn skellam_excess(&self, alpha: f64, survivors: usize, dimension: usize) -> f64 {
        let share = self.share_variance(dimension);
        let m = survivors as f64;
        let mu = m * share;
        if mu <= 0.0 {
            return f64::INFINITY;
        }
        let d2 = self.sensitivity(dimension);
        if share < SKELLAM_BELOW {
            let d1 = (dimension as f64).sqrt() * d2;
            let gaussian = alpha * d2 * d2 / (2.0 * mu);
            let extra = (((2.0 * alpha - 1.0) * d2 * d2 + 6.0 * d1) / (16.0 * mu * mu))
                .min(3.0 * d1 / (4.0 * mu));
            return extra / gaussian;
        }
        let tau = 10.0 * (m - 1.0) * (-std::f64::consts::PI.powi(2) * share).exp();
        2.0 * tau * dimension as f64 * mu / (d2 * d2)
    }

    /// The exact sampler of one client's noise share, variance `mu` rounded up.
    fn share_sampler(&self, dimension: usize) -> ShareSampler {
        let mu = self.share_variance(dimension) * VARIANCE_MARGIN;
        // new() keeps z Delta below 2^28 (the headroom), so mu < 2^56 is in range.
        if mu < SKELLAM_BELOW {
            ShareSampler::Skellam(Skellam::at_least(mu).expect("mu < 16 is in range"))
        } else {
            ShareSampler::Gaussian(
                DiscreteGaussian::at_least(mu)
                    .expect("SkellamScale::new bounds the share variance below 2^56"),
            )
        }
    }

    /// One client's contribution: `update` clipped to L2 norm `C`, scaled by `gamma`,
    /// stochastically rounded, plus its noise share, as words of `Z_2^32` (two's
    /// complement) in `out` (the same length as `update`). The values must be finite
    /// (the caller checks). Rounding and noise come from ChaCha20 streams of a key drawn
    /// from `rng`.
    pub fn encode<R: Rng + ?Sized>(&self, update: &[f32], out: &mut [u32], rng: &mut R) {
        debug_assert_eq!(update.len(), out.len());
        let norm = update
            .par_iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt();
        let c = f64::from(self.noise.l2_clip);
        let factor = self.gamma * if norm > c { c / norm } else { 1.0 };
        let share = self.share_sampler(update.len());
        let mut key = [0u8; 32];
        rng.fill_bytes(&mut key);
        out.par_chunks_mut(CHUNK)
            .zip(update.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(i, (out, x))| {
                let mut stream = ChaCha20Rng::from_seed(key);
                stream.set_stream(i as u64);
                for (o, &v) in out.iter_mut().zip(x) {
                    let s = f64::from(v) * factor;
                    let floor = s.floor();
                    let up = unit(&mut stream) < s - floor;
                    let q = floor as i64 + i64::from(up) + share.sample(&mut stream);
                    // Reduction mod 2^32: the sum is read back as two's complement.
                    *o = q as u32;
                }
            });
    }

    /// The sum of the clients' vectors, read back from `Z_2^32` as signed integers, in
    /// parameter units.
    pub fn decode(&self, words: &[u32]) -> Vec<f64> {
        words
            .par_iter()
            .map(|&w| f64::from(w as i32) / self.gamma)
            .collect()
    }
}

/// One client's noise share per coordinate.
enum ShareSampler {
    Skellam(Skellam),
    Gaussian(DiscreteGaussian),
}

impl ShareSampler {
    fn sample(&self, rng: &mut ChaCha20Rng) -> i64 {
        match self {
            Self::Skellam(s) => s.sample(rng),
            Self::Gaussian(g) => g.sample(rng),
        }
    }
}

/// A uniform number in [0, 1) from 53 random bits.
fn unit(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scale(z: f64, n: u32) -> SkellamScale {
        SkellamScale::new(
            DistributedNoise {
                l2_clip: 1.0,
                noise_multiplier: z,
            },
            n,
        )
        .unwrap()
    }

    #[test]
    fn the_sum_cannot_wrap_within_the_headroom() {
        for (z, n) in [(0.0, 2), (0.5, 20), (1.0, 100), (5.0, 1000), (100.0, 10)] {
            let s = scale(z, n);
            let d = 1usize << 28;
            let worst = f64::from(n) * (s.gamma() + 1.0) + TAIL_SIGMAS * z * s.sensitivity(d);
            assert!(worst < f64::from(i32::MAX), "z={z} n={n}");
            // and gamma is not needlessly small: one more unit of scaled clip would not fit
            let next = s.gamma() + 1.0;
            let over = f64::from(n) * (next + 1.0) + TAIL_SIGMAS * z * (next + MAX_SQRT_DIMENSION);
            assert!(over > f64::from(i32::MAX), "z={z} n={n}");
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        let ok = DistributedNoise {
            l2_clip: 1.0,
            noise_multiplier: 1.0,
        };
        for bad in [
            DistributedNoise { l2_clip: 0.0, ..ok },
            DistributedNoise {
                l2_clip: f32::NAN,
                ..ok
            },
            DistributedNoise {
                noise_multiplier: -1.0,
                ..ok
            },
            DistributedNoise {
                noise_multiplier: f64::INFINITY,
                ..ok
            },
            DistributedNoise {
                noise_multiplier: 101.0,
                ..ok
            },
        ] {
            assert!(SkellamScale::new(bad, 10).is_err(), "{bad:?}");
        }
        assert!(SkellamScale::new(ok, 0).is_err());
        assert!(
            SkellamScale::new(ok, 3_000_000).is_err(),
            "no precision left for 3 million clients"
        );
    }

    #[test]
    fn without_noise_the_sum_is_the_clipped_sum_within_rounding() {
        let s = scale(0.0, 3);
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let updates = [vec![0.3f32, -0.4], vec![3.0, 4.0], vec![-0.1, 0.0]];
        let mut sum = [0u32; 2];
        for u in &updates {
            let mut out = [0u32; 2];
            s.encode(u, &mut out, &mut rng);
            for (a, b) in sum.iter_mut().zip(out) {
                *a = a.wrapping_add(b);
            }
        }
        // The second update has norm 5 and is clipped to norm 1: (0.6, 0.8).
        let f = |v: f32| f64::from(v);
        let expect = [f(0.3) + 0.6 + f(-0.1), f(-0.4) + 0.8];
        for (got, want) in s.decode(&sum).iter().zip(expect) {
            assert!((got - want).abs() <= 3.0 / s.gamma(), "{got} vs {want}");
        }
    }

    /// Protects the accounting shortcut: at the scales the 32-bit words allow, the noise
    /// shares' Rényi divergence exceeds the Gaussian one by a negligible fraction at every
    /// order the accountant uses, so charging the Gaussian is sound; both kinds of share
    /// are covered (Skellam for a million clients at z = 0.5).
    #[test]
    fn the_noise_excess_over_the_gaussian_is_negligible() {
        for (z, n) in [
            (0.3, 5),
            (0.7, 20),
            (1.0, 100),
            (5.0, 1000),
            (0.5, 1_000_000),
        ] {
            for d in [650usize, 1 << 20] {
                let s = scale(z, n);
                for alpha in crate::privacy::rdp::default_orders() {
                    let excess = s.skellam_excess(alpha, n as usize, d);
                    assert!(excess < 1e-6, "z={z} n={n} d={d} alpha={alpha}: {excess}");
                }
            }
        }
        assert!(scale(0.5, 1_000_000).share_variance(650) < SKELLAM_BELOW);
        assert!(scale(1.0, 100).share_variance(650) >= SKELLAM_BELOW);
        assert_eq!(scale(0.0, 5).skellam_excess(2.0, 5, 10), f64::INFINITY);
    }

    /// Protects the calibration of each share, for both kinds: a zero update encodes to
    /// its noise share alone, of mean 0 and variance `mu` (the discrete Gaussian's is
    /// below `mu` by a relative 10^-6 at most).
    #[test]
    fn noise_shares_have_the_asked_variance() {
        let mut rng = ChaCha20Rng::seed_from_u64(9);
        let d = 40_000;
        for (z, n) in [(0.5, 1_000_000), (1.0, 100), (100.0, 10)] {
            let s = scale(z, n);
            let mut out = vec![0u32; d];
            s.encode(&vec![0.0; d], &mut out, &mut rng);
            let draws: Vec<f64> = out.iter().map(|&w| f64::from(w as i32)).collect();
            let mu = s.share_variance(d);
            let mean = draws.iter().sum::<f64>() / d as f64;
            let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (d - 1) as f64;
            // The sample variance has relative standard error sqrt(2 / d) = 0.7% (a
            // little more for Skellam's heavier tails at small mu); five of them.
            assert!(
                (var / mu - 1.0).abs() < 0.04,
                "z={z} n={n}: variance {var} vs {mu}"
            );
            assert!(
                mean.abs() < 5.0 * (mu / d as f64).sqrt(),
                "z={z} n={n}: mean {mean}"
            );
        }
    }

    /// Protects the fix for floating-point noise: the shares are integers drawn exactly,
    /// so a zero update's words are the same for the same key and change with it.
    #[test]
    fn noise_shares_depend_only_on_the_clients_key() {
        let s = scale(1.0, 100);
        let (mut a, mut b, mut c) = (vec![0u32; 9000], vec![0u32; 9000], vec![0u32; 9000]);
        s.encode(&[0.0; 9000], &mut a, &mut ChaCha20Rng::seed_from_u64(1));
        s.encode(&[0.0; 9000], &mut b, &mut ChaCha20Rng::seed_from_u64(1));
        s.encode(&[0.0; 9000], &mut c, &mut ChaCha20Rng::seed_from_u64(2));
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
