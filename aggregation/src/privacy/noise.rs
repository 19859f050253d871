//! Gaussian noise for the central mechanism (the coordinator noises the sum of clipped
//! updates) and the local one (a client noises its own clipped update), added exactly
//! on a lattice: the vector is rounded to the lattice `step * Z^d`, exact discrete
//! Gaussian noise ([`super::discrete`]) is added to the integer coordinates, and only the
//! result is scaled back to floats. No float ever carries noise, so the low bits of the
//! output say nothing about the input beyond what the lattice point does (the attack of
//! Mironov 2012 on floating-point samplers has nothing to read).
//!
//! **Lattice step.** `step` is the largest power of two with `step * sqrt(d) <= C / 2^10`
//! (`C` the L2 sensitivity, `d` the dimension): rounding moves the vector by at most
//! `step * sqrt(d) / 2 <= C / 2^11`, far below the noise's `sigma * C` per coordinate,
//! and a power of two makes the scaling to and from the lattice exact in `f64`. Where
//! that would ask for a lattice deviation past `2^31` (the samplers' range; only when
//! `sigma * sqrt(d) > 2^20`, e.g. `sigma = 10^3` at `d = 10^6`) the step is the smallest
//! power of two that fits, and rounding weighs more (see below).
//!
//! **Sensitivity after rounding.** Rounding to the nearest lattice point is not
//! 1-Lipschitz: two sums at L2 distance `C` can round to lattice points
//! `C / step + sqrt(d)` apart (each coordinate's rounding moves by less than 1/2 in
//! lattice units, in opposite directions at worst). The noise is therefore calibrated to
//! that inflated sensitivity: its deviation in lattice units is
//! `sigma * (C / step + sqrt(d))`, i.e. `sigma * (C + step * sqrt(d))` in parameter units
//! (at most `2^-10` more noise than the continuous mechanism at the default step),
//! rounded up to a rational (see [`DiscreteGaussian::at_least`]).
//!
//! **What the accountant assumes.** [`super::rdp`] charges the Gaussian mechanism with
//! noise multiplier `sigma`. The lattice mechanism is the discrete Gaussian mechanism on
//! `Z^d` with integer L2 sensitivity `Delta = C / step + sqrt(d)` and deviation
//! `sigma * Delta`. For an integer shift `v` the discrete Gaussian's Rényi divergence is
//! exactly the continuous one, `alpha v_i^2 / (2 s^2)` per coordinate (Canonne, Kamath
//! and Steinke 2020, Theorem 4), and it adds up over independent coordinates to at most
//! `alpha / (2 sigma^2)`. For the Poisson-subsampled rounds the accountant composes, the
//! likelihood ratio of an integer shift has the continuous form, and the discrete
//! Gaussian's sub-Gaussian moment bound (CKS Corollary 9) bounds every term of the
//! integer-order expansion of `E[(1 - q + q ratio)^alpha]` by the continuous term; the
//! fractional orders and the reverse divergence take the continuous formula as the
//! approximation, as the distributed mechanism does.
//!
//! The generator is the caller's: a cryptographically secure one (ChaCha) seeded from the
//! operating system in production, a seeded one in reproducible simulations. A key drawn
//! from it seeds one ChaCha20 stream per chunk of coordinates, so the noise does not
//! depend on the number of threads.

use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};
use rayon::prelude::*;

use super::discrete::{DiscreteError, DiscreteGaussian};

/// Rounding may move the vector by at most this fraction of the sensitivity (before the
/// fallback for very large noise).
const ROUNDING_SHARE: f64 = 1.0 / 1024.0;

/// The largest lattice deviation: the discrete Gaussian takes variances up to `2^62`.
const MAX_LATTICE_STD: f64 = 2_147_483_648.0;

/// Covers the `f64` rounding in computing the lattice variance (a few operations, each
/// within `2^-53`), so that the rational it is rounded up to is never below the real one.
const VARIANCE_MARGIN: f64 = 1.0 + 1.0 / (1u64 << 40) as f64;

/// Coordinates per parallel task (each its own ChaCha20 stream).
const CHUNK: usize = 4096;

/// Why lattice noise cannot be set up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NoiseError {
    /// A noise multiplier that is not a finite number `>= 0`.
    #[error("the noise multiplier must be a finite number >= 0, got {0}")]
    NoiseMultiplier(f64),
    /// A sensitivity that is not a finite number `> 0`.
    #[error("the L2 sensitivity must be a finite number > 0, got {0}")]
    Sensitivity(f64),
    /// So much noise over so many coordinates that no lattice keeps its deviation within
    /// the samplers' range (`sigma * sqrt(d) >= 2^31`).
    #[error(
        "noise multiplier {noise_multiplier} over {dimension} coordinates is past the lattice's range"
    )]
    OutOfRange {
        /// The noise multiplier.
        noise_multiplier: f64,
        /// The dimension.
        dimension: usize,
    },
    /// The sampler refused the variance.
    #[error(transparent)]
    Sampler(#[from] DiscreteError),
}

/// Discrete Gaussian noise on a lattice, calibrated for one dimension, noise multiplier
/// and sensitivity (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct LatticeGaussian {
    step: f64,
    sampler: DiscreteGaussian,
}

impl LatticeGaussian {
    /// Noise of `noise_multiplier` (`sigma > 0`) times the L2 sensitivity `C` of a vector
    /// of `dimension` coordinates.
    pub fn new(
        noise_multiplier: f64,
        l2_sensitivity: f64,
        dimension: usize,
    ) -> Result<Self, NoiseError> {
        let sigma = noise_multiplier;
        if !(sigma.is_finite() && sigma >= 0.0) {
            return Err(NoiseError::NoiseMultiplier(sigma));
        }
        let c = l2_sensitivity;
        if !(c.is_finite() && c > 0.0) {
            return Err(NoiseError::Sensitivity(c));
        }
        let sqrt_d = (dimension.max(1) as f64).sqrt();
        let out_of_range = || NoiseError::OutOfRange {
            noise_multiplier: sigma,
            dimension,
        };
        // The largest power of two with step * sqrt(d) <= C * ROUNDING_SHARE; the float
        // estimate of the exponent is corrected by exact comparisons.
        let mut step = 2f64.powi((c * ROUNDING_SHARE / sqrt_d).log2().floor() as i32);
        while step * sqrt_d > c * ROUNDING_SHARE {
            step /= 2.0;
        }
        while 2.0 * step * sqrt_d <= c * ROUNDING_SHARE {
            step *= 2.0;
        }
        if sigma * (c / step + sqrt_d) > MAX_LATTICE_STD {
            // The smallest power of two with C / step <= room.
            let room = MAX_LATTICE_STD / sigma - sqrt_d;
            if room < 1.0 {
                return Err(out_of_range());
            }
            while c / step > room {
                step *= 2.0;
            }
        }
        let lattice_std = sigma * (c / step + sqrt_d);
        if lattice_std > MAX_LATTICE_STD {
            return Err(out_of_range());
        }
        let sampler = DiscreteGaussian::at_least(lattice_std * lattice_std * VARIANCE_MARGIN)?;
        Ok(Self { step, sampler })
    }

    /// The lattice step (a power of two) in parameter units.
    pub fn step(&self) -> f64 {
        self.step
    }

    /// The noise's variance parameter in lattice units, as a rational.
    pub fn lattice_variance(&self) -> (u64, u64) {
        self.sampler.variance()
    }

    /// The noise's standard deviation parameter in parameter units,
    /// `sigma * (C + step * sqrt(d))` rounded up.
    pub fn std(&self) -> f64 {
        self.sampler.variance_f64().sqrt() * self.step
    }

    /// The lattice point nearest `value`, in lattice units (saturating far out of range,
    /// which only makes the map contract further).
    pub fn to_lattice(&self, value: f32) -> i64 {
        (f64::from(value) / self.step).round() as i64
    }

    /// Rounds every finite value to the lattice and adds independent discrete Gaussian
    /// noise to its integer coordinate; the noised lattice point, scaled back, is what
    /// remains. Values that are not finite are left as they are (callers check first).
    pub fn add<R: Rng + ?Sized>(&self, values: &mut [f32], rng: &mut R) {
        let mut key = [0u8; 32];
        rng.fill_bytes(&mut key);
        values
            .par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(i, chunk)| {
                let mut stream = ChaCha20Rng::from_seed(key);
                stream.set_stream(i as u64);
                for v in chunk.iter_mut().filter(|v| v.is_finite()) {
                    let noised = self
                        .to_lattice(*v)
                        .saturating_add(self.sampler.sample(&mut stream));
                    // A function of the noised lattice point alone: its rounding to f32
                    // is post-processing and reveals nothing more.
                    *v = (noised as f64 * self.step) as f32;
                }
            });
    }
}

/// Adds the central (or local) Gaussian mechanism's noise to `values`: multiplier
/// `noise_multiplier` (`sigma`) of the L2 sensitivity `l2_sensitivity` (`C`), on the
/// lattice of [`LatticeGaussian`]. A multiplier of 0 leaves the values as they are.
pub fn add_gaussian<R: Rng + ?Sized>(
    values: &mut [f32],
    noise_multiplier: f64,
    l2_sensitivity: f32,
    rng: &mut R,
) -> Result<(), NoiseError> {
    if noise_multiplier == 0.0 {
        return Ok(());
    }
    LatticeGaussian::new(noise_multiplier, f64::from(l2_sensitivity), values.len())?
        .add(values, rng);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_core::SeedableRng;

    fn rng(seed: u64) -> ChaCha20Rng {
        ChaCha20Rng::seed_from_u64(seed)
    }

    /// Protects the calibration: mean 0 and the variance `(sigma (C + step sqrt(d)))^2`,
    /// which is within `2^-9` of the continuous mechanism's `(sigma C)^2`.
    #[test]
    fn the_noise_has_mean_zero_and_the_asked_variance() {
        let mut r = rng(7);
        let n = 200_000;
        let mut values = vec![0.0f32; n];
        let noise = LatticeGaussian::new(3.0, 1.0, n).unwrap();
        let asked = noise.std().powi(2);
        assert!((9.0..9.0 * (1.0 + 1.0 / 512.0)).contains(&asked), "{asked}");
        noise.add(&mut values, &mut r);
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        let var = values
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / (n - 1) as f64;
        // Standard errors: 3/sqrt(n) = 0.0067 for the mean, 9*sqrt(2/n) = 0.028 for the
        // variance; five of them either way.
        assert!(mean.abs() < 0.034, "{mean}");
        assert!((var - asked).abs() < 0.15, "{var}");
        // The tails are Gaussian: about 0.27% beyond three standard deviations.
        let beyond = values.iter().filter(|&&v| f64::from(v).abs() > 9.0).count() as f64 / n as f64;
        assert!((beyond - 0.0027).abs() < 0.0006, "{beyond}");
    }

    /// Protects the fix for floating-point noise: every output is the input's lattice
    /// point plus an integer number of lattice steps, so the noise itself has no
    /// fractional bits to leak through.
    #[test]
    fn noised_values_lie_on_the_lattice() {
        let mut r = rng(3);
        let d = 1000;
        // Small values and noise so that f32 holds every lattice point exactly.
        let noise = LatticeGaussian::new(0.5, 1e-3, d).unwrap();
        let step = noise.step();
        assert!(step.log2().fract() == 0.0, "a power of two: {step}");
        let original: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() * 1e-3).collect();
        let mut values = original.clone();
        noise.add(&mut values, &mut r);
        let mut moved = 0;
        for (&x, &y) in original.iter().zip(&values) {
            let k = f64::from(y) / step;
            assert_eq!(k.fract(), 0.0, "{y} is not on the lattice");
            let offset = k - noise.to_lattice(x) as f64;
            assert_eq!(offset.fract(), 0.0);
            moved += usize::from(offset != 0.0);
        }
        assert!(moved > d / 2, "the noise moved only {moved} values");
    }

    /// Protects the lattice choice: rounding moves the vector by at most `2^-11` of the
    /// sensitivity, and the sensitivity inflation it costs stays within `2^-10`; for very
    /// large noise the step coarsens but the deviation stays within the samplers' range.
    #[test]
    fn the_lattice_step_keeps_rounding_small() {
        for (sigma, c, d) in [(1.0, 1.0, 1), (0.7, 0.1, 1000), (3.0, 5.0, 1_000_000)] {
            let noise = LatticeGaussian::new(sigma, c, d).unwrap();
            let sqrt_d = (d as f64).sqrt();
            assert!(noise.step() * sqrt_d <= c / 1024.0);
            assert!(
                2.0 * noise.step() * sqrt_d > c / 1024.0,
                "the largest such step"
            );
            let inflation = noise.std() / (sigma * c) - 1.0;
            assert!(
                (0.0..=1.0 / 1024.0 + 1e-9).contains(&inflation),
                "{inflation}"
            );
        }
        let huge = LatticeGaussian::new(1e4, 1.0, 10_000_000).unwrap();
        assert!(huge.std() >= 1e4);
        assert!(huge.lattice_variance().0 <= 1 << 62);
        assert!(matches!(
            LatticeGaussian::new(1e6, 1.0, 1 << 28),
            Err(NoiseError::OutOfRange { .. })
        ));
    }

    #[test]
    fn zero_noise_changes_nothing_and_invalid_noise_is_refused() {
        let mut r = rng(1);
        let mut values = vec![1.0f32, 2.0, 3.0];
        add_gaussian(&mut values, 0.0, 1.0, &mut r).unwrap();
        assert_eq!(values, vec![1.0, 2.0, 3.0]);
        assert!(matches!(
            add_gaussian(&mut values, f64::NAN, 1.0, &mut r),
            Err(NoiseError::NoiseMultiplier(_))
        ));
        assert!(add_gaussian(&mut values, -1.0, 1.0, &mut r).is_err());
        assert!(matches!(
            add_gaussian(&mut values, 1.0, 0.0, &mut r),
            Err(NoiseError::Sensitivity(_))
        ));
        assert_eq!(values, vec![1.0, 2.0, 3.0]);
        add_gaussian(&mut [], 1.0, 1.0, &mut r).unwrap();
    }

    /// Protects reproducible simulations: the same seed gives the same noise, whatever
    /// the number of threads.
    #[test]
    fn the_noise_depends_only_on_the_seed() {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut values = vec![0.5f32; 3 * CHUNK + 7];
            pool.install(|| add_gaussian(&mut values, 1.0, 1.0, &mut rng(5)).unwrap());
            values
        };
        assert_eq!(run(1), run(2));
    }
}
