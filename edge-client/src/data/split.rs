//! Train/test splitting and feature standardisation.

use std::collections::BTreeMap;

use ndarray::{Array2, Axis};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::Dataset;
use super::error::DataError;

/// Splits `ds` into `(train, test)`, stratified and deterministic from `seed`.
///
/// Strata are the classes, or the groups (devices) when `ds.groups` is `Some`, so that
/// every device of naturally federated data keeps training data; both outputs keep
/// their `groups`. Within each stratum the indices are shuffled and
/// `round(test_fraction * stratum_size)` go to the test set, clamped so that a stratum of
/// two or more samples puts at least one in each set and a stratum of one sample keeps
/// it for training. Both outputs list samples in their original order.
///
/// # Errors
/// - [`DataError::InvalidParameter`] if `test_fraction` is not strictly between 0 and 1,
///   or `ds` is internally inconsistent (row, label and group counts differ).
/// - [`DataError::SplitImpossible`] if `ds` is empty or no stratum has two samples, so
///   the test set would be empty.
pub fn stratified_split(
    ds: &Dataset,
    test_fraction: f64,
    seed: u64,
) -> Result<(Dataset, Dataset), DataError> {
    if !(test_fraction > 0.0 && test_fraction < 1.0) {
        return Err(DataError::InvalidParameter {
            parameter: "test fraction",
            reason: format!("{test_fraction} is not strictly between 0 and 1"),
        });
    }
    let n = ds.labels.len();
    if ds.features.nrows() != n {
        return Err(DataError::InvalidParameter {
            parameter: "dataset",
            reason: format!("{} feature rows but {n} labels", ds.features.nrows()),
        });
    }
    let (keys, by): (&[u32], &str) = match &ds.groups {
        Some(g) if g.len() != n => {
            return Err(DataError::InvalidParameter {
                parameter: "dataset",
                reason: format!("{} group ids but {n} labels", g.len()),
            });
        }
        Some(g) => (g, "group"),
        None => (&ds.labels, "class"),
    };
    if n == 0 {
        return Err(DataError::SplitImpossible {
            reason: "the data set is empty".to_owned(),
        });
    }

    // BTreeMap so strata are visited in a fixed order and the RNG stream is reproducible.
    let mut strata: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, &k) in keys.iter().enumerate() {
        strata.entry(k).or_default().push(i);
    }

    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut is_test = vec![false; n];
    let mut n_test = 0usize;
    for members in strata.values_mut() {
        let size = members.len();
        if size < 2 {
            continue;
        }
        members.shuffle(&mut rng);
        // Saturating cast: the product is in [0, size] because test_fraction is in (0, 1).
        let want = (test_fraction * size as f64).round() as usize;
        let take = want.clamp(1, size - 1);
        for &i in &members[..take] {
            is_test[i] = true;
        }
        n_test += take;
    }
    if n_test == 0 {
        return Err(DataError::SplitImpossible {
            reason: format!(
                "every {by} has a single sample, so none can be held out without leaving its {by} \
                 without training data"
            ),
        });
    }

    let (test_idx, train_idx): (Vec<usize>, Vec<usize>) = (0..n).partition(|&i| is_test[i]);
    Ok((ds.subset(&train_idx), ds.subset(&test_idx)))
}

/// Per-feature standardisation to zero mean and unit variance: `(x - mean) / std`.
///
/// Fit it on the training set only and apply it to every split, so no statistic of the
/// test data leaks into training.
#[derive(Debug, Clone, PartialEq)]
pub struct Standardizer {
    mean: Vec<f32>,
    std: Vec<f32>,
}

impl Standardizer {
    /// Learns the mean and population standard deviation of each column.
    ///
    /// A constant column gets std 1 so that it maps to 0 rather than NaN; with no rows at
    /// all, every column gets mean 0 and std 1 (the identity).
    pub fn fit(features: &Array2<f32>) -> Standardizer {
        let rows = features.nrows();
        let mut mean = Vec::with_capacity(features.ncols());
        let mut std = Vec::with_capacity(features.ncols());
        for col in features.axis_iter(Axis(1)) {
            if rows == 0 {
                mean.push(0.0);
                std.push(1.0);
                continue;
            }
            // f64 accumulation: f32 sums over thousands of rows lose digits.
            let m = col.iter().map(|&v| f64::from(v)).sum::<f64>() / rows as f64;
            let var = col.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / rows as f64;
            let s = var.sqrt();
            mean.push(m as f32);
            // A spread at the level of f32 rounding of the mean is rounding noise of a
            // constant column; dividing by it would blow that noise up.
            std.push(
                if s > m.abs() * f64::from(f32::EPSILON) && (s as f32) > 0.0 {
                    (s as f32).min(f32::MAX)
                } else {
                    1.0
                },
            );
        }
        Standardizer { mean, std }
    }

    /// Standardises `features` in place with the fitted statistics.
    ///
    /// # Errors
    /// [`DataError::InvalidParameter`] (leaving `features` untouched) if `features` does
    /// not have as many columns as the data this was fitted on.
    pub fn transform(&self, features: &mut Array2<f32>) -> Result<(), DataError> {
        if features.ncols() != self.mean.len() {
            return Err(DataError::InvalidParameter {
                parameter: "features to standardise",
                reason: format!(
                    "{} columns, but the standardizer was fitted on {}",
                    features.ncols(),
                    self.mean.len()
                ),
            });
        }
        for mut row in features.axis_iter_mut(Axis(0)) {
            for ((v, &m), &s) in row.iter_mut().zip(&self.mean).zip(&self.std) {
                *v = (*v - m) / s;
            }
        }
        Ok(())
    }

    /// The fitted per-column means.
    pub fn mean(&self) -> &[f32] {
        &self.mean
    }

    /// The fitted per-column standard deviations (1 for constant columns).
    pub fn std(&self) -> &[f32] {
        &self.std
    }

    /// Number of columns this was fitted on.
    pub fn num_features(&self) -> usize {
        self.mean.len()
    }
}

#[cfg(test)]
mod tests {
    use ndarray::array;

    use super::*;

    fn toy(labels: Vec<u32>, groups: Option<Vec<u32>>) -> Dataset {
        let n = labels.len();
        let classes = (0..=labels.iter().copied().max().unwrap_or(0))
            .map(|c| c.to_string())
            .collect();
        Dataset {
            features: Array2::from_shape_fn((n, 2), |(i, j)| (i * 2 + j) as f32),
            labels,
            classes,
            feature_names: vec!["a".into(), "b".into()],
            groups,
        }
    }

    #[test]
    fn digits_split_matches_scikit_learn_size_and_keeps_class_balance() {
        let ds = super::super::digits();
        let (train, test) = stratified_split(&ds, 0.2, 0).unwrap();
        assert_eq!(train.len() + test.len(), ds.len());
        assert!((355..=365).contains(&test.len()), "{}", test.len());
        for (c, (&tr, &all)) in train
            .class_counts()
            .iter()
            .zip(&ds.class_counts())
            .enumerate()
        {
            let frac = 1.0 - tr as f64 / all as f64;
            assert!((frac - 0.2).abs() < 0.01, "class {c}: test fraction {frac}");
        }
    }

    #[test]
    fn split_is_deterministic_and_seed_dependent() {
        let ds = super::super::digits();
        let a = stratified_split(&ds, 0.25, 7).unwrap();
        let b = stratified_split(&ds, 0.25, 7).unwrap();
        let c = stratified_split(&ds, 0.25, 8).unwrap();
        assert_eq!(a, b);
        assert_ne!(a.1.features, c.1.features);
    }

    #[test]
    fn outputs_partition_the_samples_in_original_order() {
        let ds = toy((0..40).map(|i| i % 3).collect(), None);
        let (train, test) = stratified_split(&ds, 0.3, 1).unwrap();
        // Feature column 0 is 2 * original index, so it identifies each sample.
        let ids = |d: &Dataset| {
            d.features
                .column(0)
                .iter()
                .map(|&v| v as usize / 2)
                .collect::<Vec<_>>()
        };
        let (tr, te) = (ids(&train), ids(&test));
        assert!(tr.windows(2).all(|w| w[0] < w[1]));
        assert!(te.windows(2).all(|w| w[0] < w[1]));
        let mut all: Vec<usize> = tr.iter().chain(&te).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..40).collect::<Vec<_>>());
        for (d, idx) in [(&train, &tr), (&test, &te)] {
            for (&l, &i) in d.labels.iter().zip(idx.iter()) {
                assert_eq!(l, ds.labels[i]);
            }
        }
    }

    #[test]
    fn every_class_keeps_training_data_and_pairs_give_one_to_test() {
        // Class 0: 1 sample, class 1: 2 samples, class 2: 10 samples.
        let mut labels = vec![0, 1, 1];
        labels.extend(std::iter::repeat_n(2, 10));
        let ds = toy(labels, None);
        for frac in [0.01, 0.5, 0.99] {
            let (train, test) = stratified_split(&ds, frac, 3).unwrap();
            assert_eq!(train.class_counts()[0], 1, "singleton stays in train");
            assert_eq!(train.class_counts()[1], 1);
            assert_eq!(test.class_counts()[1], 1);
            assert!(train.class_counts()[2] >= 1 && test.class_counts()[2] >= 1);
        }
    }

    #[test]
    fn grouped_data_is_stratified_by_group_and_keeps_groups() {
        let labels: Vec<u32> = (0..30).map(|i| i % 2).collect();
        let groups: Vec<u32> = (0..30).map(|i| if i < 1 { 9 } else { i % 4 }).collect();
        let ds = toy(labels, Some(groups.clone()));
        let (train, test) = stratified_split(&ds, 0.5, 5).unwrap();
        let tg = train.groups.as_ref().unwrap();
        let sg = test.groups.as_ref().unwrap();
        assert_eq!(tg.len(), train.len());
        assert_eq!(sg.len(), test.len());
        for g in [0, 1, 2, 3, 9] {
            assert!(tg.contains(&g), "group {g} keeps training data");
        }
        assert!(!sg.contains(&9), "a group of one sample is not held out");
        for g in 0..4 {
            let total = groups.iter().filter(|&&x| x == g).count();
            let held = sg.iter().filter(|&&x| x == g).count();
            assert_eq!(held, (total as f64 * 0.5).round() as usize);
        }
    }

    #[test]
    fn bad_fraction_and_impossible_splits_are_errors() {
        let ds = toy(vec![0, 1, 0, 1], None);
        for f in [0.0, 1.0, -0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                stratified_split(&ds, f, 0),
                Err(DataError::InvalidParameter { .. })
            ));
        }
        let singletons = toy(vec![0, 1, 2], None);
        assert!(matches!(
            stratified_split(&singletons, 0.5, 0),
            Err(DataError::SplitImpossible { .. })
        ));
        let empty = toy(vec![], None);
        assert!(matches!(
            stratified_split(&empty, 0.5, 0),
            Err(DataError::SplitImpossible { .. })
        ));
        let mut bad_groups = toy(vec![0, 1, 0, 1], Some(vec![0, 1]));
        assert!(matches!(
            stratified_split(&bad_groups, 0.5, 0),
            Err(DataError::InvalidParameter { .. })
        ));
        bad_groups.groups = None;
        bad_groups.labels.push(0);
        assert!(matches!(
            stratified_split(&bad_groups, 0.5, 0),
            Err(DataError::InvalidParameter { .. })
        ));
    }

    #[test]
    fn standardizer_gives_zero_mean_unit_std_and_constant_columns_map_to_zero() {
        let x = array![[1.0f32, 5.0, 1e6], [3.0, 5.0, 1e6], [5.0, 5.0, 1e6]];
        let s = Standardizer::fit(&x);
        assert_eq!(s.mean(), &[3.0, 5.0, 1e6]);
        assert!(
            (s.std()[0] - (8.0f32 / 3.0).sqrt()).abs() < 1e-6,
            "population std"
        );
        assert_eq!(&s.std()[1..], &[1.0, 1.0]);
        let mut y = x.clone();
        s.transform(&mut y).unwrap();
        assert!(y.iter().all(|v| v.is_finite()));
        assert!(y.column(0).sum().abs() < 1e-6);
        assert!(
            y.column(1)
                .iter()
                .chain(y.column(2).iter())
                .all(|&v| v == 0.0)
        );
    }

    #[test]
    fn standardizer_handles_no_rows_and_rejects_wrong_width() {
        let s = Standardizer::fit(&Array2::zeros((0, 3)));
        assert_eq!(s.mean(), &[0.0; 3]);
        assert_eq!(s.std(), &[1.0; 3]);
        let mut wrong = Array2::<f32>::ones((2, 2));
        assert!(matches!(
            s.transform(&mut wrong),
            Err(DataError::InvalidParameter { .. })
        ));
        assert_eq!(wrong, Array2::<f32>::ones((2, 2)));
    }
}
