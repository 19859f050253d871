//! FedAvg as a streaming accumulator.
//!
//! The coordinator receives updates one at a time over the network. Folding each into a
//! running weighted sum keeps memory at one model, however many clients report.

use std::fmt;
use std::sync::Arc;

use crate::model_vector::{Layout, ModelVector};
use crate::reduce::{self, Reducer, WeightedSum};

/// Why an update, a mean or a server step was refused.
///
/// Every operation that returns this error validates before it mutates, so a refused
/// call leaves its accumulator, optimizer and model exactly as they were.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AggregationError {
    /// The two vectors have different numbers of parameters.
    #[error("model has {expected} parameters but the update has {found}")]
    LayoutMismatch {
        /// Parameters the model has.
        expected: usize,
        /// Parameters the update has.
        found: usize,
    },
    /// Same number of parameters, but different tensor names or shapes, so adding them
    /// would mix unrelated weights.
    #[error("update has the model's {len} parameters but a different tensor layout")]
    TensorLayoutMismatch {
        /// Parameters both vectors have.
        len: usize,
    },
    /// A weight was zero, negative, NaN or infinite.
    #[error("weight must be finite and greater than zero, got {0}")]
    InvalidWeight(f64),
    /// A weight so large that the running sums would no longer be finite.
    #[error("weight {0} is too large: the running sums would overflow")]
    WeightOverflow(f64),
    /// An input parameter is NaN or infinite.
    #[error("parameter {index} is not finite")]
    NonFinite {
        /// Position of the first offending parameter.
        index: usize,
    },
    /// A mean was asked for before any update was folded.
    #[error("no updates were folded, so there is no mean")]
    Empty,
    /// A server optimizer setting is out of range.
    #[error("invalid {field} {value}: expected {expected}")]
    InvalidConfig {
        /// The setting, e.g. `server_lr`.
        field: &'static str,
        /// The rejected value.
        value: f32,
        /// The accepted range, in words.
        expected: &'static str,
    },
    /// The reducer failed (a device error); the CPU reducer cannot, once the checks
    /// above have passed.
    #[error("reducer: {0}")]
    Reducer(String),
    /// A server step would produce a NaN or infinite parameter or optimizer state.
    #[error("the server step would make parameter {index} non-finite")]
    NonFiniteResult {
        /// Position of the first offending parameter.
        index: usize,
    },
    /// Saved optimizer state that does not belong to this optimizer and model (another
    /// rule or config, another size, or bytes that are not a saved state).
    #[error("optimizer state: {0}")]
    OptimizerState(String),
}

/// Checks that `found` can be combined element-wise with `expected`.
pub(crate) fn check_layout(
    expected: &Arc<Layout>,
    found: &Arc<Layout>,
) -> Result<(), AggregationError> {
    // Updates of one model share its `Arc`, so the pointer check settles the common case
    // without walking the tensor names.
    if Arc::ptr_eq(expected, found) || expected == found {
        return Ok(());
    }
    if expected.len() != found.len() {
        return Err(AggregationError::LayoutMismatch {
            expected: expected.len(),
            found: found.len(),
        });
    }
    Err(AggregationError::TensorLayoutMismatch {
        len: expected.len(),
    })
}

/// Index of the first NaN or infinite value, if any.
pub(crate) fn first_non_finite(values: &[f32]) -> Option<usize> {
    values.iter().position(|v| !v.is_finite())
}

/// The weighted mean of model updates, folded one update at a time (FedAvg).
///
/// Sums are kept in `f64`, one per parameter: with thousands of clients an `f32` running
/// sum would lose the low bits of every late update.
///
/// The accumulator also keeps an upper bound on the magnitude of every sum and refuses a
/// weight that would push it past `f64::MAX`. Since a weighted mean never exceeds the
/// largest folded magnitude, which is at most `f32::MAX`, [`finish`](Self::finish) then
/// always yields finite `f32` values.
///
/// The sums run on a [`Reducer`] (the CPU's cores by default); batches of updates go
/// through [`fold_batch`](Self::fold_batch) so that the reducer reads each once while the
/// sums stay in cache.
pub struct WeightedMean {
    layout: Arc<Layout>,
    sum: Box<dyn WeightedSum>,
    total_weight: f64,
    abs_bound: f64,
    count: usize,
    reducer: &'static str,
}

impl fmt::Debug for WeightedMean {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The sums can be millions of numbers; they would drown any log line.
        f.debug_struct("WeightedMean")
            .field("len", &self.layout.len())
            .field("count", &self.count)
            .field("total_weight", &self.total_weight)
            .field("reducer", &self.reducer)
            .finish()
    }
}

/// The largest magnitude in `values` when every value is finite, else the index of the
/// first value that is not. One pass over the magnitude bits, which the compiler turns
/// into a vector maximum: for non-negative floats the order of the bit patterns is the
/// order of the numbers, and every NaN or infinity is at or above the bits of infinity.
/// (An element-wise `is_finite` with an early return does not vectorise, and was a
/// quarter of a simulation round whose clients do nothing.)
pub fn max_abs_finite(values: &[f32]) -> Result<f32, usize> {
    const MAGNITUDE: u32 = 0x7fff_ffff;
    const INFINITY: u32 = 0x7f80_0000;
    let max_bits = values
        .iter()
        .fold(0u32, |m, v| m.max(v.to_bits() & MAGNITUDE));
    if max_bits >= INFINITY {
        Err(values.iter().position(|v| !v.is_finite()).unwrap_or(0))
    } else {
        Ok(f32::from_bits(max_bits))
    }
}

/// An update's values, checked to be finite, with their largest magnitude: found once,
/// where the update arrives (on the thread that received it), so that the fold reads the
/// update only to add it. The only way to make one is [`Finite::check`].
#[derive(Debug, Clone, Copy)]
pub struct Finite<'a> {
    values: &'a [f32],
    max_abs: f32,
}

impl<'a> Finite<'a> {
    /// Checks `values`; the error is the index of the first NaN or infinity.
    pub fn check(values: &'a [f32]) -> Result<Self, usize> {
        max_abs_finite(values).map(|max_abs| Self { values, max_abs })
    }

    /// The values.
    pub fn values(&self) -> &'a [f32] {
        self.values
    }

    /// The largest magnitude among them.
    pub fn max_abs(&self) -> f32 {
        self.max_abs
    }
}

impl WeightedMean {
    /// An empty accumulator for updates in `layout`, summing on the CPU.
    pub fn new(layout: Arc<Layout>) -> Self {
        Self::with_reducer(layout, reduce::cpu().as_ref())
            .expect("the CPU reducer makes accumulators of any size")
    }

    /// An empty accumulator for updates in `layout`, summing on `reducer` (a device
    /// backend keeps the sums in device memory).
    pub fn with_reducer(
        layout: Arc<Layout>,
        reducer: &dyn Reducer,
    ) -> Result<Self, AggregationError> {
        let sum = reducer
            .weighted_sum(layout.len())
            .map_err(|e| AggregationError::Reducer(e.to_string()))?;
        Ok(Self {
            layout,
            sum,
            total_weight: 0.0,
            abs_bound: 0.0,
            count: 0,
            reducer: reducer.name(),
        })
    }

    /// The layout every folded update must have.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// Adds `update` with `weight` (typically the client's number of training examples).
    ///
    /// Validates everything first, so a rejected update changes nothing. Fails when the
    /// layout differs from the accumulator's, when `weight` is not finite and positive,
    /// when a value is NaN or infinite, or when `weight` is so large the sums would
    /// overflow.
    pub fn fold(&mut self, update: &ModelVector, weight: f64) -> Result<(), AggregationError> {
        self.fold_batch(&[(update, weight)])
    }

    /// Adds every `(update, weight)` of a batch, as [`fold`](Self::fold) one after another
    /// would (the same additions in the same order), reading each update once.
    ///
    /// Validates the whole batch first, so a batch with one bad update changes nothing.
    pub fn fold_batch(&mut self, batch: &[(&ModelVector, f64)]) -> Result<(), AggregationError> {
        let mut checked = Vec::with_capacity(batch.len());
        for &(update, weight) in batch {
            check_layout(&self.layout, update.layout())?;
            let finite = Finite::check(update.values())
                .map_err(|index| AggregationError::NonFinite { index })?;
            checked.push((finite, weight));
        }
        self.fold_finite(&checked)
    }

    /// [`fold_batch`](Self::fold_batch) for bare values in the accumulator's layout, checked
    /// where they arrived ([`Finite`]; such as an update read in place from memory shared
    /// with the process that trained it): the fold reads each once, to add it. Only the
    /// length is checked against the layout.
    pub fn fold_finite(&mut self, batch: &[(Finite<'_>, f64)]) -> Result<(), AggregationError> {
        let len = self.layout.len();
        if let Some((finite, _)) = batch.iter().find(|(f, _)| f.values.len() != len) {
            return Err(AggregationError::LayoutMismatch {
                expected: len,
                found: finite.values.len(),
            });
        }
        let mut total_weight = self.total_weight;
        let mut abs_bound = self.abs_bound;
        for &(finite, weight) in batch {
            if !weight.is_finite() || weight <= 0.0 {
                return Err(AggregationError::InvalidWeight(weight));
            }
            total_weight += weight;
            abs_bound += weight * f64::from(finite.max_abs);
            if !total_weight.is_finite() || !abs_bound.is_finite() {
                return Err(AggregationError::WeightOverflow(weight));
            }
        }
        let values: Vec<&[f32]> = batch.iter().map(|(f, _)| f.values).collect();
        let weights: Vec<f64> = batch.iter().map(|(_, w)| *w).collect();
        self.sum
            .add(&values, &weights)
            .map_err(|e| AggregationError::Reducer(e.to_string()))?;
        self.total_weight = total_weight;
        self.abs_bound = abs_bound;
        self.count += batch.len();
        Ok(())
    }

    /// Number of updates folded so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Sum of the weights folded so far.
    pub fn total_weight(&self) -> f64 {
        self.total_weight
    }

    /// The weighted mean so far, leaving the accumulator usable; fails with
    /// [`AggregationError::Empty`] when nothing was folded.
    pub fn mean(&self) -> Result<ModelVector, AggregationError> {
        if self.count == 0 {
            return Err(AggregationError::Empty);
        }
        let inv = 1.0 / self.total_weight;
        let sums = self
            .sum
            .read()
            .map_err(|e| AggregationError::Reducer(e.to_string()))?;
        let values = sums.iter().map(|&s| (s * inv) as f32).collect();
        let mean = ModelVector::new(self.layout.clone(), values)
            .expect("the sums are sized to the layout");
        Ok(mean)
    }

    /// The weighted mean of everything folded; fails with [`AggregationError::Empty`]
    /// when nothing was folded.
    pub fn finish(self) -> Result<ModelVector, AggregationError> {
        if self.count == 0 {
            return Err(AggregationError::Empty);
        }
        let inv = 1.0 / self.total_weight;
        let sums = self
            .sum
            .into_sums()
            .map_err(|e| AggregationError::Reducer(e.to_string()))?;
        let values = sums.iter().map(|&s| (s * inv) as f32).collect();
        Ok(ModelVector::new(self.layout, values).expect("the sums are sized to the layout"))
    }
}

#[cfg(test)]
mod max_abs_tests {
    use super::max_abs_finite;
    use proptest::prelude::*;

    proptest! {
        /// The vectorised pass agrees with the plain definition on any bit pattern:
        /// NaNs, infinities, subnormals and signed zeros included.
        #[test]
        fn max_abs_finite_is_the_plain_definition(bits in proptest::collection::vec(any::<u32>(), 0..300)) {
            let values: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
            let plain = match values.iter().position(|v| !v.is_finite()) {
                Some(i) => Err(i),
                None => Ok(values.iter().fold(0.0f32, |m, v| m.max(v.abs()))),
            };
            prop_assert_eq!(max_abs_finite(&values).map(f32::to_bits), plain.map(f32::to_bits));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_vector::TensorSpec;
    use proptest::prelude::*;

    fn vector(layout: &Arc<Layout>, values: &[f32]) -> ModelVector {
        ModelVector::new(layout.clone(), values.to_vec()).unwrap()
    }

    #[test]
    fn a_batch_with_one_bad_update_changes_nothing() {
        let layout = Arc::new(Layout::flat(3));
        let mut acc = WeightedMean::new(layout.clone());
        acc.fold(&vector(&layout, &[1.0, 2.0, 3.0]), 2.0).unwrap();
        let before = snapshot(&acc);
        let good = vector(&layout, &[1.0, 1.0, 1.0]);
        let bad = vector(&layout, &[1.0, f32::NAN, 1.0]);
        assert!(acc.fold_batch(&[(&good, 1.0), (&bad, 1.0)]).is_err());
        assert!(acc.fold_batch(&[(&good, 1.0), (&good, -1.0)]).is_err());
        assert_eq!(snapshot(&acc), before);
    }

    fn snapshot(acc: &WeightedMean) -> (Vec<f64>, f64, f64, usize) {
        (
            acc.sum.read().unwrap(),
            acc.total_weight,
            acc.abs_bound,
            acc.count,
        )
    }

    /// The weighted mean computed from all updates at once, normalising the weights first
    /// so that it does not share the accumulator's order of operations.
    fn batch_weighted_mean(updates: &[(Vec<f32>, f64)]) -> Vec<f64> {
        let total: f64 = updates.iter().map(|(_, w)| w).sum();
        let len = updates[0].0.len();
        (0..len)
            .map(|i| {
                updates
                    .iter()
                    .map(|(v, w)| (w / total) * f64::from(v[i]))
                    .sum()
            })
            .collect()
    }

    fn close(a: f32, b: f64) -> bool {
        (f64::from(a) - b).abs() <= 1e-6 * b.abs().max(1.0)
    }

    fn updates() -> impl Strategy<Value = Vec<(Vec<f32>, f64)>> {
        (1usize..12, 1usize..8).prop_flat_map(|(len, n)| {
            prop::collection::vec(
                (prop::collection::vec(-1e3_f32..1e3, len), 1e-2_f64..1e2),
                n,
            )
        })
    }

    fn fold_all(updates: &[(Vec<f32>, f64)], order: impl Iterator<Item = usize>) -> ModelVector {
        let layout = Arc::new(Layout::flat(updates[0].0.len()));
        let mut acc = WeightedMean::new(layout.clone());
        for i in order {
            let (values, weight) = &updates[i];
            acc.fold(&vector(&layout, values), *weight).unwrap();
        }
        acc.finish().unwrap()
    }

    proptest! {
        /// A batch folds to exactly what the same updates folded one by one give.
        #[test]
        fn fold_batch_equals_folding_one_at_a_time(updates in updates()) {
            let layout = Arc::new(Layout::flat(updates[0].0.len()));
            let vectors: Vec<ModelVector> =
                updates.iter().map(|(v, _)| vector(&layout, v)).collect();
            let mut one = WeightedMean::new(layout.clone());
            for (v, (_, w)) in vectors.iter().zip(&updates) {
                one.fold(v, *w).unwrap();
            }
            let mut batch = WeightedMean::new(layout.clone());
            let pairs: Vec<(&ModelVector, f64)> =
                vectors.iter().zip(&updates).map(|(v, (_, w))| (v, *w)).collect();
            batch.fold_batch(&pairs).unwrap();
            prop_assert_eq!(snapshot(&one), snapshot(&batch));
        }

        #[test]
        fn streaming_mean_equals_batch_weighted_mean(updates in updates()) {
            let streamed = fold_all(&updates, 0..updates.len());
            let expected = batch_weighted_mean(&updates);
            for (i, (&got, &want)) in streamed.values().iter().zip(&expected).enumerate() {
                prop_assert!(close(got, want), "parameter {i}: {got} vs {want}");
            }
        }

        #[test]
        fn fold_order_does_not_change_the_mean(
            (updates, order) in updates().prop_flat_map(|u| {
                let order: Vec<usize> = (0..u.len()).collect();
                (Just(u), Just(order).prop_shuffle())
            })
        ) {
            let in_order = fold_all(&updates, 0..updates.len());
            let shuffled = fold_all(&updates, order.into_iter());
            for (&a, &b) in in_order.values().iter().zip(shuffled.values()) {
                prop_assert!(close(a, f64::from(b)), "{a} vs {b}");
            }
        }

        #[test]
        fn mean_of_finite_updates_is_finite(
            values in prop::collection::vec(prop::num::f32::NORMAL, 1..8),
            weight in 1e-3_f64..1e30,
        ) {
            let layout = Arc::new(Layout::flat(values.len()));
            let mut acc = WeightedMean::new(layout.clone());
            acc.fold(&vector(&layout, &values), weight).unwrap();
            acc.fold(&vector(&layout, &values), 1.0).unwrap();
            prop_assert!(acc.finish().unwrap().is_finite());
        }
    }

    #[test]
    fn unit_weights_give_the_plain_mean() {
        let layout = Arc::new(Layout::flat(2));
        let mut acc = WeightedMean::new(layout.clone());
        for values in [[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]] {
            acc.fold(&vector(&layout, &values), 1.0).unwrap();
        }
        assert_eq!(acc.count(), 3);
        assert_eq!(acc.total_weight(), 3.0);
        assert_eq!(acc.finish().unwrap().values(), &[3.0, 5.0]);
    }

    #[test]
    fn weights_scale_each_update() {
        // (1 * [0, 10] + 3 * [4, 2]) / 4 = [12, 16] / 4 = [3, 4]
        let layout = Arc::new(Layout::flat(2));
        let mut acc = WeightedMean::new(layout.clone());
        acc.fold(&vector(&layout, &[0.0, 10.0]), 1.0).unwrap();
        acc.fold(&vector(&layout, &[4.0, 2.0]), 3.0).unwrap();
        assert_eq!(acc.finish().unwrap().values(), &[3.0, 4.0]);
    }

    #[test]
    fn finish_without_updates_is_an_error() {
        let acc = WeightedMean::new(Arc::new(Layout::flat(3)));
        assert_eq!(acc.mean().unwrap_err(), AggregationError::Empty);
        assert_eq!(acc.finish().unwrap_err(), AggregationError::Empty);
    }

    #[test]
    fn mean_does_not_consume_and_agrees_with_finish() {
        let layout = Arc::new(Layout::flat(2));
        let mut acc = WeightedMean::new(layout.clone());
        acc.fold(&vector(&layout, &[1.0, 1.0]), 1.0).unwrap();
        assert_eq!(acc.mean().unwrap().values(), &[1.0, 1.0]);
        acc.fold(&vector(&layout, &[3.0, 5.0]), 1.0).unwrap();
        let mean = acc.mean().unwrap();
        assert_eq!(mean.values(), &[2.0, 3.0]);
        assert_eq!(acc.finish().unwrap(), mean);
    }

    #[test]
    fn mean_keeps_the_tensor_layout() {
        let layout = Arc::new(
            Layout::new(vec![
                TensorSpec::new("w", [2, 2]),
                TensorSpec::new("b", [2]),
            ])
            .unwrap(),
        );
        let mut acc = WeightedMean::new(layout.clone());
        acc.fold(&vector(&layout, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), 2.0)
            .unwrap();
        let mean = acc.finish().unwrap();
        assert!(Arc::ptr_eq(mean.layout(), &layout));
        assert_eq!(mean.tensor("b"), Some(&[5.0, 6.0][..]));
    }

    #[test]
    fn equal_layout_in_a_different_arc_is_accepted() {
        let mut acc = WeightedMean::new(Arc::new(Layout::flat(2)));
        let update = ModelVector::from_flat(vec![1.0, 2.0]);
        acc.fold(&update, 1.0).unwrap();
        assert_eq!(acc.count(), 1);
    }

    #[test]
    fn rejected_updates_leave_the_accumulator_unchanged() {
        let layout = Arc::new(
            Layout::new(vec![TensorSpec::new("w", [2]), TensorSpec::new("b", [1])]).unwrap(),
        );
        let mut acc = WeightedMean::new(layout.clone());
        acc.fold(&vector(&layout, &[1.0, 2.0, 3.0]), 2.0).unwrap();
        let before = snapshot(&acc);
        let good = vector(&layout, &[4.0, 5.0, 6.0]);

        let rejected: Vec<(ModelVector, f64, AggregationError)> = vec![
            (
                vector(&layout, &[1.0, f32::NAN, 3.0]),
                1.0,
                AggregationError::NonFinite { index: 1 },
            ),
            (
                vector(&layout, &[1.0, 2.0, f32::INFINITY]),
                1.0,
                AggregationError::NonFinite { index: 2 },
            ),
            (
                ModelVector::from_flat(vec![1.0, 2.0]),
                1.0,
                AggregationError::LayoutMismatch {
                    expected: 3,
                    found: 2,
                },
            ),
            (
                ModelVector::from_flat(vec![1.0, 2.0, 3.0]),
                1.0,
                AggregationError::TensorLayoutMismatch { len: 3 },
            ),
            (good.clone(), 0.0, AggregationError::InvalidWeight(0.0)),
            (good.clone(), -1.0, AggregationError::InvalidWeight(-1.0)),
            (
                good.clone(),
                f64::INFINITY,
                AggregationError::InvalidWeight(f64::INFINITY),
            ),
            (
                good.clone(),
                f64::MAX,
                AggregationError::WeightOverflow(f64::MAX),
            ),
        ];
        for (update, weight, want) in rejected {
            assert_eq!(acc.fold(&update, weight).unwrap_err(), want);
            assert_eq!(snapshot(&acc), before, "after {want}");
        }
        match acc.fold(&good, f64::NAN).unwrap_err() {
            AggregationError::InvalidWeight(w) => assert!(w.is_nan()),
            other => panic!("expected InvalidWeight, got {other}"),
        }
        assert_eq!(snapshot(&acc), before);

        // Still usable after the rejections: (2*[1,2,3] + 2*[4,5,6]) / 4.
        acc.fold(&good, 2.0).unwrap();
        assert_eq!(acc.finish().unwrap().values(), &[2.5, 3.5, 4.5]);
    }
}
