//! The real data sets shipped with Cohort, embedded in the binary so that it works from
//! any working directory.

use super::Dataset;
use super::csv::parse_csv;

const DIGITS_GZ: &[u8] = include_bytes!("../../../data/digits.csv.gz");
const BREAST_CANCER_GZ: &[u8] = include_bytes!("../../../data/breast_cancer.csv.gz");
// Referenced only by the coordinator and the Python package: the linker leaves its 2 MB
// out of the `cohort-edge` binary.
const MNIST10K_GZ: &[u8] = include_bytes!("../../../data/mnist10k.csv.gz");

/// The UCI optical handwritten digits (as in scikit-learn's `load_digits`): 1797 samples,
/// 64 features (8x8 pixel intensities `px0`..`px63`, 0..16), 10 classes `"0"`..`"9"`.
///
/// # Panics
/// Never in practice: the embedded bytes are fixed at compile time and parsing them is
/// covered by a test.
pub fn digits() -> Dataset {
    embedded(DIGITS_GZ, "digits.csv.gz")
}

/// The Wisconsin diagnostic breast cancer set (as in scikit-learn's
/// `load_breast_cancer`): 569 samples, 30 features, 2 classes (`"0"` malignant,
/// `"1"` benign).
///
/// # Panics
/// Never in practice: the embedded bytes are fixed at compile time and parsing them is
/// covered by a test.
pub fn breast_cancer() -> Dataset {
    embedded(BREAST_CANCER_GZ, "breast_cancer.csv.gz")
}

/// 10,000 MNIST images (LeCun, Cortes, Burges), 28x28 grayscale, 784 features
/// `px0`..`px783` (0..255, row by row), 10 classes `"0"`..`"9"`, rows shuffled once. By
/// convention the first 8,000 rows train and the last 2,000 test ([`MNIST10K_TRAIN`]).
///
/// # Panics
/// Never in practice: the embedded bytes are fixed at compile time and parsing them is
/// covered by a test.
pub fn mnist10k() -> Dataset {
    embedded(MNIST10K_GZ, "mnist10k.csv.gz")
}

/// Rows of [`mnist10k`] that train; the rest are its test split.
///
/// cbindgen:ignore
pub const MNIST10K_TRAIN: usize = 8_000;

fn embedded(bytes: &'static [u8], name: &str) -> Dataset {
    match parse_csv(flate2::read::GzDecoder::new(bytes), name) {
        Ok(ds) => ds,
        // Only reachable if the files in data/ were replaced by broken ones.
        Err(e) => panic!("embedded data set is corrupt: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_has_expected_shape_and_classes() {
        let ds = digits();
        assert_eq!(ds.len(), 1797);
        assert_eq!(ds.num_features(), 64);
        assert_eq!(ds.num_classes(), 10);
        let want: Vec<String> = (0..10).map(|c| c.to_string()).collect();
        assert_eq!(ds.classes, want);
        assert!(ds.class_counts().iter().all(|&c| (170..=190).contains(&c)));
        assert!(ds.features.iter().all(|&v| (0.0..=16.0).contains(&v)));
        assert!(ds.groups.is_none());
    }

    #[test]
    fn mnist10k_has_expected_shape_and_class_counts() {
        let ds = mnist10k();
        assert_eq!(ds.len(), 10_000);
        assert_eq!(ds.num_features(), 784);
        assert_eq!(ds.num_classes(), 10);
        // The counts the data set's README gives.
        assert_eq!(
            ds.class_counts(),
            vec![1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978]
        );
        assert!(ds.features.iter().all(|&v| (0.0..=255.0).contains(&v)));
    }

    #[test]
    fn breast_cancer_has_expected_shape_and_classes() {
        let ds = breast_cancer();
        assert_eq!(ds.len(), 569);
        assert_eq!(ds.num_features(), 30);
        assert_eq!(ds.num_classes(), 2);
        // scikit-learn's counts: 212 malignant, 357 benign.
        assert_eq!(ds.class_counts(), vec![212, 357]);
        assert!(ds.groups.is_none());
    }
}
