//! Distributed differential privacy under secure aggregation: the Skellam mechanism
//! (Agarwal, Kairouz and Liu, NeurIPS 2021) in the integer domain of the masked sum.
//!
//! Every client clips its update to L2 norm `C`, scales it by `gamma`, rounds each
//! coordinate stochastically (unbiased) to an integer, adds its own noise share — integer
//! Skellam noise `Sk(mu) = Pois(mu / 2) - Pois(mu / 2)` of variance `mu` per coordinate —
//! and only then masks the vector. The coordinator unmasks the sum of the survivors'
//! vectors: the sum of `m` shares is `Sk(m mu)`, so it never sees a sum, let alone an
//! update, without noise, and no one but the client ever holds its share (it is drawn
//! from the client's own generator and sent nowhere but inside the masked vector).
//!
//! **Calibration.** For a round of `n` selected clients and noise multiplier `z`, each
//! share has variance `mu = (z * Delta)^2 / n`, where `Delta = gamma * C + sqrt(d)` bounds
//! the L2 norm of a client's rounded vector (rounding moves each of the `d` coordinates by
//! less than 1). When all `n` survive, the sum carries noise of standard deviation exactly
//! `z * Delta`, the Gaussian mechanism's `z` times the sensitivity; when only `m` do, the
//! round's effective multiplier is `z * sqrt(m / n)`, which
//! [`SkellamScale::effective_noise_multiplier`] reports so that the accountant charges the
//! noise that was actually there.
//!
//! **Accounting.** The Skellam mechanism's Rényi divergence is the Gaussian one plus a
//! term of order `1 / mu^2` (their Theorem 3.5); with `gamma` chosen as large as the
//! 32-bit words allow, the sum's variance is above `10^12` for rounds of up to thousands
//! of clients and that term is below `10^-9` of the Gaussian one (a test checks), so the accountant treats a round as the Poisson-subsampled Gaussian
//! mechanism with the effective multiplier (the approximation the paper and TensorFlow
//! Federated's distributed DP use). [`SkellamScale::skellam_excess`] computes the
//! excess so that a test can check it is negligible.
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
use rand_distr::{Distribution, Poisson};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Coordinates encoded per parallel task; each task draws from its own ChaCha20 stream of
/// the client's noise key, so the result does not depend on the number of threads.
const CHUNK: usize = 4096;

/// The largest `sqrt(d)` a secure round can have (`d <= 2^28`).
const MAX_SQRT_DIMENSION: f64 = 16_384.0;

/// Standard deviations of headroom left for the noise in the 32-bit sum.
const TAIL_SIGMAS: f64 = 8.0;

/// The largest noise multiplier accepted: beyond it nothing useful is left of the sum.
pub const MAX_NOISE_MULTIPLIER: f64 = 100.0;

/// Public settings of distributed noise for a secure round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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

    /// How much the Skellam mechanism's Rényi divergence of order `alpha` exceeds the
    /// Gaussian one, relative to it, for the sum of `survivors` shares: the second term of
    /// Agarwal et al.'s Theorem 3.5, `min(((2 alpha - 1) D2^2 + 6 D1) / (16 mu^2),
    /// 3 D1 / (4 mu))` over `alpha D2^2 / (2 mu)`, with `D1 <= sqrt(d) D2`.
    pub fn skellam_excess(&self, alpha: f64, survivors: usize, dimension: usize) -> f64 {
        let mu = survivors as f64 * self.share_variance(dimension);
        if mu <= 0.0 {
            return f64::INFINITY;
        }
        let d2 = self.sensitivity(dimension);
        let d1 = (dimension as f64).sqrt() * d2;
        let gaussian = alpha * d2 * d2 / (2.0 * mu);
        let extra = (((2.0 * alpha - 1.0) * d2 * d2 + 6.0 * d1) / (16.0 * mu * mu))
            .min(3.0 * d1 / (4.0 * mu));
        extra / gaussian
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
        let mu = self.share_variance(update.len());
        // Two Poisson draws of mean mu / 2; rand_distr refuses a mean of 0.
        let poisson = (mu > 0.0).then(|| Poisson::new(mu / 2.0).expect("mu is finite and > 0"));
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
                    let mut q = floor as i64 + i64::from(up);
                    if let Some(p) = &poisson {
                        q += skellam_pair(p, &mut stream);
                    }
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

/// A uniform number in [0, 1) from 53 random bits.
fn unit(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

fn skellam_pair(poisson: &Poisson<f64>, rng: &mut ChaCha20Rng) -> i64 {
    let a: f64 = poisson.sample(rng);
    let b: f64 = poisson.sample(rng);
    a as i64 - b as i64
}

/// One draw of the Skellam distribution of variance `mu` (`Pois(mu/2) - Pois(mu/2)`);
/// 0 when `mu` is 0.
pub fn skellam<R: Rng + ?Sized>(mu: f64, rng: &mut R) -> i64 {
    if !(mu.is_finite() && mu > 0.0) {
        return 0;
    }
    let p = Poisson::new(mu / 2.0).expect("mu is finite and > 0");
    let a: f64 = p.sample(rng);
    let b: f64 = p.sample(rng);
    a as i64 - b as i64
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

    /// Protects the accounting shortcut: at the scales the 32-bit words allow, the
    /// Skellam mechanism's Rényi divergence exceeds the Gaussian one by a negligible
    /// fraction at every order the accountant uses, so charging the Gaussian is sound.
    #[test]
    fn the_skellam_excess_over_the_gaussian_is_negligible() {
        for (z, n) in [(0.3, 5), (0.7, 20), (1.0, 100), (5.0, 1000)] {
            for d in [650usize, 1 << 20] {
                let s = scale(z, n);
                for alpha in crate::privacy::rdp::default_orders() {
                    let excess = s.skellam_excess(alpha, n as usize, d);
                    assert!(excess < 1e-6, "z={z} n={n} d={d} alpha={alpha}: {excess}");
                }
            }
        }
    }

    #[test]
    fn skellam_draws_have_the_asked_variance() {
        let mut rng = ChaCha20Rng::seed_from_u64(9);
        for mu in [2.0, 1e4, 1e12] {
            let n = 40_000;
            let draws: Vec<f64> = (0..n).map(|_| skellam(mu, &mut rng) as f64).collect();
            let mean = draws.iter().sum::<f64>() / n as f64;
            let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            // The sample variance has relative standard error sqrt(2 / n) = 0.7%.
            assert!((var / mu - 1.0).abs() < 0.04, "mu={mu}: variance {var}");
            assert!(
                mean.abs() < 5.0 * (mu / n as f64).sqrt(),
                "mu={mu}: mean {mean}"
            );
        }
        assert_eq!(skellam(0.0, &mut rng), 0);
    }
}
