//! Gaussian noise for the central mechanism: the coordinator adds `N(0, (sigma C)^2)` to
//! each coordinate of the sum of clipped updates. The generator is the caller's: a
//! cryptographically secure one (ChaCha) seeded from the operating system in
//! production, a seeded one in reproducible simulations.

use rand_core::Rng;

/// A uniform number in (0, 1], from 53 random bits.
fn open_unit(rng: &mut (impl Rng + ?Sized)) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

/// Two independent standard normal draws (Box-Muller).
pub fn standard_normal_pair(rng: &mut (impl Rng + ?Sized)) -> (f64, f64) {
    let radius = (-2.0 * open_unit(rng).ln()).sqrt();
    let angle = std::f64::consts::TAU * open_unit(rng);
    (radius * angle.cos(), radius * angle.sin())
}

/// One standard normal draw.
pub fn standard_normal(rng: &mut (impl Rng + ?Sized)) -> f64 {
    standard_normal_pair(rng).0
}

/// Adds independent `N(0, std^2)` noise to every value of `values`. A `std` that is not a
/// finite number >= 0 adds nothing (callers validate settings first).
pub fn add_gaussian(values: &mut [f32], std: f64, rng: &mut (impl Rng + ?Sized)) {
    if !(std.is_finite() && std > 0.0) {
        return;
    }
    let mut chunks = values.chunks_exact_mut(2);
    for pair in &mut chunks {
        let (a, b) = standard_normal_pair(rng);
        pair[0] = (f64::from(pair[0]) + std * a) as f32;
        pair[1] = (f64::from(pair[1]) + std * b) as f32;
    }
    for v in chunks.into_remainder() {
        *v = (f64::from(*v) + std * standard_normal(rng)) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_core::SeedableRng;

    #[test]
    fn the_noise_has_mean_zero_and_the_asked_variance() {
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(7);
        let n = 200_000;
        let mut values = vec![0.0f32; n];
        add_gaussian(&mut values, 3.0, &mut rng);
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        let var = values
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / (n - 1) as f64;
        // Standard errors: 3/sqrt(n) = 0.0067 for the mean, 9*sqrt(2/n) = 0.028 for the
        // variance; five of them either way.
        assert!(mean.abs() < 0.034, "{mean}");
        assert!((var - 9.0).abs() < 0.15, "{var}");
        // The tails are Gaussian: about 0.27% beyond three standard deviations.
        let beyond = values.iter().filter(|&&v| f64::from(v).abs() > 9.0).count() as f64 / n as f64;
        assert!((beyond - 0.0027).abs() < 0.0006, "{beyond}");
    }

    #[test]
    fn zero_or_invalid_noise_changes_nothing() {
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(1);
        let mut values = vec![1.0f32, 2.0, 3.0];
        add_gaussian(&mut values, 0.0, &mut rng);
        add_gaussian(&mut values, f64::NAN, &mut rng);
        assert_eq!(values, vec![1.0, 2.0, 3.0]);
    }
}
