//! The real data sets shipped with Cohort, embedded in the binary so that it works from
//! any working directory.

use super::Dataset;
use super::csv::parse_csv;

const DIGITS_GZ: &[u8] = include_bytes!("../../../data/digits.csv.gz");
const BREAST_CANCER_GZ: &[u8] = include_bytes!("../../../data/breast_cancer.csv.gz");

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
