//! Helpers shared by the integration tests.

/// Two linearly separable blobs with 4 features, as a client's local data.
pub fn blob_data(n: usize, shift: f32) -> cohort_edge::data::Dataset {
    let labels: Vec<u32> = (0..n).map(|i| (i % 2) as u32).collect();
    let features = ndarray::Array2::from_shape_fn((n, 4), |(i, j)| {
        let centre = if labels[i] == 0 { -1.5 } else { 1.5 };
        centre + shift + ((i * 7 + j * 3) % 11) as f32 * 0.05
    });
    cohort_edge::data::Dataset {
        features,
        labels,
        classes: vec!["0".into(), "1".into()],
        feature_names: (0..4).map(|j| format!("x{j}")).collect(),
        groups: None,
    }
}
