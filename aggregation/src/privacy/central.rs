//! One round of central differential privacy (DP-FedAvg, McMahan et al. 2018): the math
//! `cohort serve` and `cohort simulate` share.
//!
//! Each update's difference from the global model is clipped to an L2 bound `C`, the
//! clipped differences are summed, the sum gets discrete Gaussian noise of standard
//! deviation `z * C` per coordinate, and it is divided by a fixed denominator (the
//! expected number of clients, so the scale does not reveal how many took part). Clients
//! weigh equally: a sample count would raise a client's influence past the clip. With
//! adaptive clipping (Andrew et al. 2021) the noised count of clients within the bound
//! then moves the bound, with the same generator, after the update's noise.

use rand_core::Rng;

use super::clip::{AdaptiveClip, ClipError, clip_l2};
use super::noise::{NoiseError, add_gaussian};

/// Why a private round could not be closed.
#[derive(Debug, thiserror::Error)]
pub enum CentralError {
    /// An update's length is not the model's.
    #[error("an update of {got} values for a model of {expected}")]
    Length {
        /// The model's length.
        expected: usize,
        /// The update's.
        got: usize,
    },
    /// The update's noise could not be drawn (a setting out of range).
    #[error(transparent)]
    Noise(#[from] NoiseError),
    /// The adaptive rule's count noise could not be drawn.
    #[error(transparent)]
    Clip(#[from] ClipError),
}

/// The clipped sum of one private round, folded an update at a time.
#[derive(Debug, Clone)]
pub struct CentralSum {
    sum: Vec<f32>,
    clip: f32,
    within: usize,
    count: usize,
}

impl CentralSum {
    /// An empty sum for a model of `len` values, clipping each update to L2 norm `clip`.
    pub fn new(len: usize, clip: f32) -> Self {
        Self {
            sum: vec![0.0; len],
            clip,
            within: 0,
            count: 0,
        }
    }

    /// Clips `delta` in place to the round's bound; true when it was within it already
    /// (what the adaptive rule counts). For callers that clip in parallel and add later
    /// with [`add_clipped`](Self::add_clipped).
    pub fn clip(&self, delta: &mut [f32]) -> bool {
        clip_l2(delta, self.clip) <= self.clip
    }

    /// Adds an update already clipped by [`clip`](Self::clip); `within` is what it
    /// returned. A wrong length changes nothing.
    pub fn add_clipped(&mut self, delta: &[f32], within: bool) -> Result<(), CentralError> {
        if delta.len() != self.sum.len() {
            return Err(CentralError::Length {
                expected: self.sum.len(),
                got: delta.len(),
            });
        }
        for (s, d) in self.sum.iter_mut().zip(delta) {
            *s += d;
        }
        self.within += usize::from(within);
        self.count += 1;
        Ok(())
    }

    /// Clips `delta` and adds it.
    pub fn add(&mut self, mut delta: Vec<f32>) -> Result<(), CentralError> {
        let within = self.clip(&mut delta);
        self.add_clipped(&delta, within)
    }

    /// Updates added so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The round's new global model: `global + (sum + noise) / denominator`, the noise of
    /// standard deviation `update_sigma * clip` drawn from `rng`; then, with `adaptive`,
    /// the rule's step from the noised count of updates within the bound over
    /// `denominator` clients (drawn from `rng` after the update's noise), which returns
    /// the next round's bound.
    pub fn finish<R: Rng + ?Sized>(
        mut self,
        global: &[f32],
        update_sigma: f64,
        denominator: f64,
        adaptive: Option<&mut AdaptiveClip>,
        rng: &mut R,
    ) -> Result<(Vec<f32>, Option<f32>), CentralError> {
        if global.len() != self.sum.len() {
            return Err(CentralError::Length {
                expected: self.sum.len(),
                got: global.len(),
            });
        }
        add_gaussian(&mut self.sum, update_sigma, self.clip, rng)?;
        let next_clip = match adaptive {
            Some(rule) => {
                Some(rule.update_noised(self.within, denominator.round() as usize, rng)?)
            }
            None => None,
        };
        let model = global
            .iter()
            .zip(&self.sum)
            .map(|(g, s)| g + (f64::from(*s) / denominator) as f32)
            .collect();
        Ok((model, next_clip))
    }
}

#[cfg(test)]
mod tests {
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    use super::*;

    #[test]
    fn without_noise_the_model_moves_by_the_clipped_sum_over_the_denominator() {
        let mut round = CentralSum::new(2, 1.0);
        round.add(vec![3.0, 4.0]).unwrap(); // norm 5, clipped to (0.6, 0.8)
        round.add(vec![0.5, 0.0]).unwrap(); // within the bound
        assert_eq!(round.count(), 2);
        let mut rng = ChaCha20Rng::seed_from_u64(0);
        let (model, next) = round.finish(&[1.0, 1.0], 0.0, 4.0, None, &mut rng).unwrap();
        assert!((model[0] - (1.0 + 1.1 / 4.0)).abs() < 1e-6, "{model:?}");
        assert!((model[1] - (1.0 + 0.8 / 4.0)).abs() < 1e-6, "{model:?}");
        assert_eq!(next, None);
    }

    #[test]
    fn the_noise_and_the_adaptive_step_come_from_the_generator_in_a_fixed_order() {
        let run = |seed| {
            let mut round = CentralSum::new(3, 0.5);
            round.add(vec![0.1, 0.2, 0.3]).unwrap();
            round.add(vec![2.0, 0.0, 0.0]).unwrap();
            let mut rule = AdaptiveClip {
                bound: 0.5,
                target_quantile: 0.5,
                learning_rate: 0.2,
                count_noise_std: 0.1,
            };
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            round
                .finish(&[0.0; 3], 1.0, 2.0, Some(&mut rule), &mut rng)
                .unwrap()
        };
        let (a, next_a) = run(7);
        let (b, next_b) = run(7);
        assert_eq!(a, b);
        assert_eq!(next_a, next_b);
        assert!(next_a.is_some());
        let (c, _) = run(8);
        assert_ne!(a, c, "a different seed draws different noise");
    }

    #[test]
    fn an_update_of_the_wrong_length_changes_nothing() {
        let mut round = CentralSum::new(2, 1.0);
        assert!(matches!(
            round.add(vec![1.0]),
            Err(CentralError::Length {
                expected: 2,
                got: 1
            })
        ));
        assert_eq!(round.count(), 0);
        let mut rng = ChaCha20Rng::seed_from_u64(0);
        let (model, _) = round.finish(&[0.0, 0.0], 0.0, 1.0, None, &mut rng).unwrap();
        assert_eq!(model, [0.0, 0.0]);
    }
}
