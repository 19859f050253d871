//! FedBuff's buffer fold (Nguyen et al., "Federated Learning with Buffered Asynchronous
//! Aggregation", AISTATS 2022): the math `cohort serve` and `cohort simulate` share.
//!
//! A buffer holds `K` updates, each trained from whatever model version was current when
//! its client downloaded it. The server step moves the global model towards
//!
//! ```text
//! target = global + sum_i n_i s(tau_i) delta_i / sum_i n_i        s(tau) = 1 / (1 + tau)^A
//! ```
//!
//! where `delta_i` is the update's trained model minus the model it started from, `n_i`
//! its sample count and `tau_i` its staleness (server steps taken since its base version).
//! Weighting by samples, as synchronous FedAvg does, keeps the two modes' aggregates the
//! same when nothing is stale; dividing by the samples rather than by the
//! staleness-weighted samples follows the paper (it divides by `K`), so stale updates
//! shrink the step rather than only each other's share. With equal sample counts this is
//! exactly the paper's rule.

use std::sync::Arc;

use crate::reduce::Reducer;
use crate::{AggregationError, Layout, LayoutError, ModelVector, WeightedMean};

/// The default staleness exponent `A`: `s(tau) = 1 / sqrt(1 + tau)`, the paper's choice.
pub const DEFAULT_STALENESS_EXPONENT: f64 = 0.5;

/// The weight of an update `tau` server steps stale: `1 / (1 + tau)^exponent`.
pub fn staleness_weight(tau: u32, exponent: f64) -> f64 {
    (1.0 + f64::from(tau)).powf(-exponent)
}

/// Why a buffer could not be folded.
#[derive(Debug, thiserror::Error)]
pub enum FoldError {
    /// An update or base model does not fit, or a value is not finite.
    #[error(transparent)]
    Aggregation(#[from] AggregationError),
    /// A model could not be built in the experiment's layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The buffer was empty.
    #[error("a buffer with no updates has nothing to fold")]
    Empty,
}

/// A buffer's updates folded, a batch at a time, through a reducer:
/// `sum_i w_i delta_i / sum_i w_i` with `w_i = n_i s(tau_i)` and `delta_i` the trained
/// model minus the model it started from.
pub struct BufferFold {
    mean: WeightedMean,
    exponent: f64,
    weight: f64,
    samples: f64,
}

/// One buffered update: the trained model, the model it started from, its sample count
/// and its staleness.
pub type BufferedUpdate<'a> = (&'a ModelVector, &'a ModelVector, u64, u32);

/// One buffered update as its difference from the model it started from, with its sample
/// count and its staleness.
pub type BufferedDelta<'a> = (&'a ModelVector, u64, u32);

impl BufferFold {
    /// An empty fold for models in `layout`.
    pub fn new(
        layout: Arc<Layout>,
        reducer: &dyn Reducer,
        exponent: f64,
    ) -> Result<Self, FoldError> {
        Ok(Self {
            mean: WeightedMean::with_reducer(layout, reducer)?,
            exponent,
            weight: 0.0,
            samples: 0.0,
        })
    }

    /// The weight of an update of `samples` samples, `tau` steps stale.
    pub fn weight(&self, samples: u64, tau: u32) -> f64 {
        samples as f64 * staleness_weight(tau, self.exponent)
    }

    /// Folds a batch of trained models, each with the model it started from; a batch
    /// with a bad update changes nothing.
    pub fn fold_batch(&mut self, batch: &[BufferedUpdate<'_>]) -> Result<(), FoldError> {
        let mut deltas = Vec::with_capacity(batch.len());
        for &(trained, base, samples, tau) in batch {
            let delta: Vec<f32> = trained
                .values()
                .iter()
                .zip(base.values())
                .map(|(p, b)| p - b)
                .collect();
            deltas.push((
                ModelVector::new(trained.layout().clone(), delta)?,
                samples,
                tau,
            ));
        }
        let deltas: Vec<BufferedDelta<'_>> = deltas.iter().map(|(d, n, t)| (d, *n, *t)).collect();
        self.fold_deltas(&deltas)
    }

    /// Folds a batch of differences (trained model minus the model it started from), for
    /// a caller that changes them first (a simulated attack); a batch with a bad update
    /// changes nothing.
    pub fn fold_deltas(&mut self, batch: &[BufferedDelta<'_>]) -> Result<(), FoldError> {
        let pairs: Vec<(&ModelVector, f64)> = batch
            .iter()
            .map(|&(delta, samples, tau)| (delta, self.weight(samples, tau)))
            .collect();
        self.mean.fold_batch(&pairs)?;
        for (&(_, samples, _), (_, weight)) in batch.iter().zip(&pairs) {
            self.weight += weight;
            self.samples += samples as f64;
        }
        Ok(())
    }

    /// Updates folded so far.
    pub fn updates(&self) -> usize {
        self.mean.count()
    }

    /// The model the server optimizer steps towards from `global`:
    /// `global + sum_i w_i delta_i / sum_i n_i`. Dividing by the samples, not the weights,
    /// follows the paper (and the simulation): stale updates shrink the step instead of
    /// only each other's share.
    pub fn target(self, global: &ModelVector) -> Result<ModelVector, FoldError> {
        if self.samples <= 0.0 {
            return Err(FoldError::Empty);
        }
        let scale = (self.weight / self.samples) as f32;
        let mean = self.mean.finish()?;
        let values = global
            .values()
            .iter()
            .zip(mean.values())
            .map(|(g, d)| g + scale * d)
            .collect();
        Ok(ModelVector::new(global.layout().clone(), values)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(n: usize) -> Arc<Layout> {
        Arc::new(Layout::new(vec![crate::TensorSpec::new("w", [n])]).unwrap())
    }

    fn vector(layout: &Arc<Layout>, values: &[f32]) -> ModelVector {
        ModelVector::new(layout.clone(), values.to_vec()).unwrap()
    }

    #[test]
    fn staleness_weight_is_one_when_fresh_and_decays_with_the_exponent() {
        assert_eq!(staleness_weight(0, 0.5), 1.0);
        assert_eq!(staleness_weight(3, 0.5), 0.5);
        assert_eq!(staleness_weight(9, 1.0), 0.1);
        assert_eq!(staleness_weight(100, 0.0), 1.0);
    }

    #[test]
    fn fresh_updates_average_by_samples_like_fedavg() {
        let l = layout(2);
        let global = vector(&l, &[1.0, 1.0]);
        let (a, b) = (vector(&l, &[3.0, 1.0]), vector(&l, &[1.0, 5.0]));
        let reducer = crate::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        fold.fold_batch(&[(&a, &global, 1, 0), (&b, &global, 3, 0)])
            .unwrap();
        // deltas (2, 0) x1 and (0, 4) x3 over 4 samples.
        let target = fold.target(&global).unwrap();
        assert_eq!(target.values(), &[1.5, 4.0]);
    }

    #[test]
    fn stale_updates_count_from_their_own_base_and_shrink_the_step() {
        let l = layout(1);
        let global = vector(&l, &[10.0]);
        let old_base = vector(&l, &[0.0]);
        let fresh = vector(&l, &[12.0]); // delta 2 from the current model
        let stale = vector(&l, &[4.0]); // delta 4 from version 0, three steps ago
        let reducer = crate::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        fold.fold_batch(&[(&fresh, &global, 1, 0), (&stale, &old_base, 1, 3)])
            .unwrap();
        // s(3) = 1/2: (1 * 2 + 0.5 * 4) / 2 samples = 2.
        let target = fold.target(&global).unwrap();
        assert!((target.values()[0] - 12.0).abs() < 1e-6, "{target:?}");
    }

    #[test]
    fn exponent_zero_ignores_staleness_and_an_empty_buffer_is_refused() {
        let l = layout(1);
        let global = vector(&l, &[0.0]);
        let trained = vector(&l, &[2.0]);
        let reducer = crate::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.0).unwrap();
        assert_eq!(fold.weight(5, 100), 5.0);
        fold.fold_batch(&[(&trained, &global, 5, 100)]).unwrap();
        assert_eq!(fold.target(&global).unwrap().values(), &[2.0]);
        let empty = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        assert!(matches!(empty.target(&global), Err(FoldError::Empty)));
    }

    #[test]
    fn a_non_finite_update_is_refused_and_changes_nothing() {
        let l = layout(1);
        let global = vector(&l, &[0.0]);
        let good = vector(&l, &[1.0]);
        let nan = vector(&l, &[f32::NAN]);
        let reducer = crate::reduce::cpu();
        let mut fold = BufferFold::new(l.clone(), reducer.as_ref(), 0.5).unwrap();
        assert!(
            fold.fold_batch(&[(&good, &global, 1, 0), (&nan, &global, 1, 0)])
                .is_err()
        );
        fold.fold_batch(&[(&good, &global, 1, 0)]).unwrap();
        assert_eq!(fold.target(&global).unwrap().values(), &[1.0]);
    }
}
