//! L2 clipping of client updates, with a fixed bound or one that tracks a quantile of
//! the clients' update norms (Andrew, Thakkar, McMahan and Ramaswamy 2021, "Differentially
//! Private Learning with Adaptive Clipping").
//!
//! Clipping bounds each client's contribution to the sum (its sensitivity), which is what
//! the Gaussian noise is calibrated to.

use super::discrete::DiscreteGaussian;

/// Scales `update` down to L2 norm at most `bound`; returns its norm before clipping.
/// A bound that is not a positive finite number leaves the update as it is.
pub fn clip_l2(update: &mut [f32], bound: f32) -> f32 {
    let norm = update
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt() as f32;
    if bound.is_finite() && bound > 0.0 && norm > bound {
        let scale = bound / norm;
        for v in update.iter_mut() {
            *v *= scale;
        }
    }
    norm
}

/// Why an adaptive clipping setting was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClipError {
    /// The setting named is out of range.
    #[error("adaptive clipping: {0}")]
    Setting(String),
}

/// The adaptive clipping rule: after each round the bound moves geometrically towards
/// the `target_quantile` of the clients' update norms, estimated from how many clients
/// were within the bound. That count is itself noised (standard deviation
/// `count_noise_std`), since it is a statistic of the clients' data too.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveClip {
    /// The bound for the next round.
    pub bound: f32,
    /// The quantile of update norms the bound tracks (default 0.5).
    pub target_quantile: f64,
    /// The geometric step (default 0.2).
    pub learning_rate: f64,
    /// Standard deviation of the Gaussian noise on the count of clients within the bound.
    pub count_noise_std: f64,
}

impl AdaptiveClip {
    /// A rule starting at `initial_bound` with the paper's defaults (quantile 0.5, step
    /// 0.2) and `count_noise_std` on the count.
    pub fn new(initial_bound: f32, count_noise_std: f64) -> Result<Self, ClipError> {
        let rule = Self {
            bound: initial_bound,
            target_quantile: 0.5,
            learning_rate: 0.2,
            count_noise_std,
        };
        rule.check()?;
        Ok(rule)
    }

    /// Checks every setting.
    pub fn check(&self) -> Result<(), ClipError> {
        let bad = |m: String| Err(ClipError::Setting(m));
        if !(self.bound.is_finite() && self.bound > 0.0) {
            return bad(format!("the bound must be > 0, got {}", self.bound));
        }
        if !(self.target_quantile > 0.0 && self.target_quantile < 1.0) {
            return bad(format!(
                "the target quantile must be in (0, 1), got {}",
                self.target_quantile
            ));
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return bad(format!(
                "the learning rate must be > 0, got {}",
                self.learning_rate
            ));
        }
        if !(self.count_noise_std.is_finite() && self.count_noise_std >= 0.0) {
            return bad(format!(
                "the count noise must be >= 0, got {}",
                self.count_noise_std
            ));
        }
        Ok(())
    }

    /// Moves the bound after a round in which `within` of `clients` updates had norm at
    /// most the bound; `noise` is one standard normal draw (the caller's RNG), scaled
    /// here by `count_noise_std`. Returns the new bound. Noise meant as differential
    /// privacy goes through [`update_noised`](Self::update_noised) instead, which draws
    /// it exactly on the integers.
    pub fn update(&mut self, within: usize, clients: usize, noise: f64) -> f32 {
        self.step(within as f64 + noise * self.count_noise_std, clients)
    }

    /// [`update`](Self::update) with the count noised by exact discrete Gaussian noise
    /// `N_Z(0, count_noise_std^2)` (variance rounded up) from `rng`: the count is an
    /// integer of sensitivity 1, so the noised count is too, and no float carries the
    /// noise (see [`super::discrete`]).
    pub fn update_noised<R: rand_core::Rng + ?Sized>(
        &mut self,
        within: usize,
        clients: usize,
        rng: &mut R,
    ) -> Result<f32, ClipError> {
        let std = self.count_noise_std;
        // The margin covers the rounding of std * std.
        let noise = DiscreteGaussian::at_least(std * std * (1.0 + f64::EPSILON * 4.0))
            .map_err(|e| ClipError::Setting(format!("the count noise: {e}")))?
            .sample(rng);
        let count = (within as i64).saturating_add(noise);
        Ok(self.step(count as f64, clients))
    }

    /// Moves the bound towards the target quantile given the (noised) count within it.
    fn step(&mut self, count: f64, clients: usize) -> f32 {
        if clients == 0 {
            return self.bound;
        }
        let fraction = count / clients as f64;
        let step = (-self.learning_rate * (fraction - self.target_quantile)).exp();
        let next = (f64::from(self.bound) * step) as f32;
        if next.is_finite() && next > 0.0 {
            self.bound = next;
        }
        self.bound
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_scales_long_updates_to_the_bound_and_leaves_short_ones() {
        let mut long = vec![3.0, 4.0];
        assert_eq!(clip_l2(&mut long, 1.0), 5.0);
        assert!((long[0] - 0.6).abs() < 1e-6 && (long[1] - 0.8).abs() < 1e-6);
        let mut short = vec![0.3, 0.4];
        assert_eq!(clip_l2(&mut short, 1.0), 0.5);
        assert_eq!(short, vec![0.3, 0.4]);
    }

    #[test]
    fn the_adaptive_bound_converges_to_the_target_quantile() {
        // Norms 1, 2, ..., 100: the median is about 50.
        let norms: Vec<f32> = (1..=100).map(|n| n as f32).collect();
        let mut rule = AdaptiveClip::new(1.0, 0.0).unwrap();
        for _ in 0..400 {
            let within = norms.iter().filter(|&&n| n <= rule.bound).count();
            rule.update(within, norms.len(), 0.0);
        }
        assert!((rule.bound - 50.0).abs() < 3.0, "{}", rule.bound);
        let mut high = AdaptiveClip {
            target_quantile: 0.9,
            ..AdaptiveClip::new(1.0, 0.0).unwrap()
        };
        for _ in 0..400 {
            let within = norms.iter().filter(|&&n| n <= high.bound).count();
            high.update(within, norms.len(), 0.0);
        }
        assert!((high.bound - 90.0).abs() < 3.0, "{}", high.bound);
    }

    /// Protects the privacy of the count: the noise on it is an integer with the
    /// configured deviation (within five standard errors), drawn exactly.
    #[test]
    fn the_noised_count_is_an_integer_with_the_configured_deviation() {
        use rand_core::SeedableRng;
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(4);
        let n = 20_000;
        let mut counts = Vec::with_capacity(n);
        for _ in 0..n {
            let mut rule = AdaptiveClip {
                learning_rate: 1.0,
                ..AdaptiveClip::new(1.0, 4.0).unwrap()
            };
            let bound = rule.update_noised(50, 100, &mut rng).unwrap();
            // bound = exp(-(count / 100 - 0.5)): the count comes back to f32 precision.
            let count = 100.0 * (0.5 - f64::from(bound).ln());
            assert!((count - count.round()).abs() < 1e-3, "{count}");
            counts.push(count.round());
        }
        let mean = counts.iter().sum::<f64>() / n as f64;
        let var = counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        assert!(
            (mean - 50.0).abs() < 5.0 * 4.0 / (n as f64).sqrt(),
            "{mean}"
        );
        assert!(
            (var / 16.0 - 1.0).abs() < 5.0 * (2.0 / n as f64).sqrt(),
            "{var}"
        );
        let mut silent = AdaptiveClip::new(1.0, 0.0).unwrap();
        let mut twin = silent;
        assert_eq!(
            silent.update_noised(30, 100, &mut rng).unwrap(),
            twin.update(30, 100, 0.0)
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(AdaptiveClip::new(0.0, 1.0).is_err());
        assert!(AdaptiveClip::new(1.0, -1.0).is_err());
        assert!(AdaptiveClip::new(f32::NAN, 1.0).is_err());
        let rule = AdaptiveClip {
            target_quantile: 1.0,
            ..AdaptiveClip::new(1.0, 0.0).unwrap()
        };
        assert!(rule.check().is_err());
    }
}
