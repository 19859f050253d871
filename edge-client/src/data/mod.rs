//! Tabular data sets: loading, the shipped real sets, synthetic generators, splitting and
//! standardisation.

use ndarray::{Array2, Axis};

mod csv;
mod error;
mod shipped;
mod split;
mod synthetic;

pub use self::csv::{LABEL_COLUMN, load_csv, load_csv_only, parse_csv, parse_csv_only};
pub use error::{DataError, FeatureProblem};
pub use shipped::{MNIST10K_TRAIN, breast_cancer, digits, mnist10k};
pub use split::{Standardizer, stratified_split};
pub use synthetic::{MAX_FEATURE_VALUES, MAX_SAMPLES_PER_DEVICE, SyntheticConfig, synthetic};

/// A labelled data set held in memory: one row of `features` per sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Sample features, one row per sample.
    pub features: Array2<f32>,
    /// Class index of each sample, in `0..classes.len()`.
    pub labels: Vec<u32>,
    /// Class names in index order (the original label text of the source file).
    pub classes: Vec<String>,
    /// Feature (column) names in column order.
    pub feature_names: Vec<String>,
    /// The natural owner (device) of each sample, for data sets that come already
    /// federated, such as FedProx Synthetic; `None` for pooled data.
    pub groups: Option<Vec<u32>>,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when the set holds no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Number of feature columns.
    pub fn num_features(&self) -> usize {
        self.features.ncols()
    }

    /// Number of classes.
    pub fn num_classes(&self) -> usize {
        self.classes.len()
    }

    /// Number of samples of each class, indexed by class.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.num_classes()];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }

    /// The samples at `indices`, in that order, with the same classes and feature names.
    ///
    /// # Panics
    /// If an index is out of range; callers pass indices produced from this data set.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        Dataset {
            features: self.features.select(Axis(0), indices),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
            classes: self.classes.clone(),
            feature_names: self.feature_names.clone(),
            groups: self
                .groups
                .as_ref()
                .map(|g| indices.iter().map(|&i| g[i]).collect()),
        }
    }

    /// The feature columns named `names`, in that order (an experiment that names its
    /// columns gets its features in its own order, whatever the file's).
    ///
    /// # Errors
    /// A message naming the first column this data set does not have.
    pub fn columns(&self, names: &[String]) -> Result<Dataset, String> {
        let positions = names
            .iter()
            .map(|name| {
                self.feature_names
                    .iter()
                    .position(|f| f == name)
                    .ok_or_else(|| {
                        format!(
                            "the experiment reads column `{name}`, which this site's data does \
                             not have"
                        )
                    })
            })
            .collect::<Result<Vec<usize>, String>>()?;
        Ok(Dataset {
            features: self.features.select(Axis(1), &positions),
            labels: self.labels.clone(),
            classes: self.classes.clone(),
            feature_names: names.to_vec(),
            groups: self.groups.clone(),
        })
    }
}
