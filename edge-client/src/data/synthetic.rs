//! FedProx Synthetic(alpha, beta): naturally federated, heterogeneous data with a known
//! generating process.
//!
//! Follows Li et al. 2020, "Federated Optimization in Heterogeneous Networks" (FedProx),
//! section 5.1, and its reference generator `generate_synthetic.py`, drawing in the same
//! order. The draws cannot match NumPy's bit for bit, but the distribution is the same.

use ndarray::Array2;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{LogNormal, Normal, StandardNormal};

use super::Dataset;
use super::error::DataError;

/// Most samples one device can get. The reference draws `lognormal(4, 2) + 50` samples
/// per device, a heavy tail (about 0.2% of devices draw more than 20 000); the cap keeps
/// a rare huge draw from exhausting memory.
pub const MAX_SAMPLES_PER_DEVICE: usize = 20_000;

/// Most feature values (samples x features) one generated data set may hold, 1 GiB of
/// `f32`; larger requests are rejected rather than attempted.
pub const MAX_FEATURE_VALUES: usize = 1 << 28;

/// Parameters of [`synthetic`].
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    /// How much the local models differ: device k's model weights and biases are drawn
    /// around `u_k ~ N(0, alpha)` (alpha is a standard deviation). 0 gives every device
    /// model weights from the same distribution.
    pub alpha: f64,
    /// How much the local data differ: the mean of device k's inputs is drawn around
    /// `B_k ~ N(0, beta)` (beta is a standard deviation). 0 centres every device's inputs
    /// on the same distribution.
    pub beta: f64,
    /// Number of devices (30 in the paper).
    pub devices: usize,
    /// Input dimension (60 in the paper).
    pub features: usize,
    /// Number of classes (10 in the paper).
    pub classes: usize,
    /// Seed of the generator; the same config always gives the same data.
    pub seed: u64,
}

impl Default for SyntheticConfig {
    /// Synthetic(1, 1) with the paper's sizes: 30 devices, 60 features, 10 classes, seed 0.
    fn default() -> Self {
        SyntheticConfig {
            alpha: 1.0,
            beta: 1.0,
            devices: 30,
            features: 60,
            classes: 10,
            seed: 0,
        }
    }
}

/// Generates FedProx Synthetic(alpha, beta).
///
/// For each device k: `u_k ~ N(0, alpha)`, `B_k ~ N(0, beta)`; the input mean `v_k` has
/// elements `~ N(B_k, 1)`; the model `W_k` (classes x features) and `b_k` have elements
/// `~ N(u_k, 1)`; inputs `x ~ N(v_k, Sigma)` with `Sigma` diagonal,
/// `Sigma_jj = j^-1.2` for `j = 1..=features`; the label is
/// `argmax(softmax(W_k x + b_k)) = argmax(W_k x + b_k)`. Device k holds
/// `floor(lognormal(4, 2)) + 50` samples, capped at [`MAX_SAMPLES_PER_DEVICE`].
///
/// Samples are listed device by device; `groups` holds each sample's device index.
/// Classes are `"0"`..; features are `"x0"`...
///
/// # Errors
/// [`DataError::InvalidParameter`] if alpha or beta is negative or not finite, devices
/// or features is 0, classes is below 2, or the data would exceed
/// [`MAX_FEATURE_VALUES`].
pub fn synthetic(cfg: &SyntheticConfig) -> Result<Dataset, DataError> {
    validate(cfg)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let (d, c) = (cfg.features, cfg.classes);

    // Same draw order as the reference: sizes, u, B, all v_k, then per device W, b, x.
    let sizes_dist = LogNormal::new(4.0, 2.0).map_err(|e| internal(&e))?;
    let sizes: Vec<usize> = (0..cfg.devices)
        .map(|_| {
            let draw: f64 = rng.sample(sizes_dist);
            // `as` saturates and truncates toward zero like NumPy's astype(int).
            (draw as usize)
                .saturating_add(50)
                .min(MAX_SAMPLES_PER_DEVICE)
        })
        .collect();
    let total: usize = sizes.iter().sum();
    if total.checked_mul(d).is_none_or(|v| v > MAX_FEATURE_VALUES) {
        return Err(too_big(cfg, total));
    }

    let u: Vec<f64> = normals(&mut rng, 0.0, cfg.alpha, cfg.devices)?;
    let big_b: Vec<f64> = normals(&mut rng, 0.0, cfg.beta, cfg.devices)?;
    let v: Vec<Vec<f64>> = big_b
        .iter()
        .map(|&bk| normals(&mut rng, bk, 1.0, d))
        .collect::<Result<_, _>>()?;
    let x_std: Vec<f64> = (1..=d).map(|j| (j as f64).powf(-0.6)).collect();

    let mut values: Vec<f32> = Vec::with_capacity(total * d);
    let mut labels: Vec<u32> = Vec::with_capacity(total);
    let mut groups: Vec<u32> = Vec::with_capacity(total);
    let mut x = vec![0.0f64; d];
    for (k, ((&n_k, &u_k), v_k)) in sizes.iter().zip(&u).zip(&v).enumerate() {
        // Row-major classes x features, so each logit is a contiguous dot product.
        let w = normals(&mut rng, u_k, 1.0, c * d)?;
        let b = normals(&mut rng, u_k, 1.0, c)?;
        let group = u32::try_from(k).map_err(|_| too_big(cfg, total))?;
        for _ in 0..n_k {
            for ((xj, &mean), &sd) in x.iter_mut().zip(v_k).zip(&x_std) {
                let z: f64 = rng.sample(StandardNormal);
                *xj = mean + sd * z;
            }
            let label = argmax_logit(&w, &b, &x, d);
            values.extend(x.iter().map(|&xj| xj as f32));
            labels.push(label);
            groups.push(group);
        }
    }

    let features = Array2::from_shape_vec((total, d), values).map_err(|e| internal(&e))?;
    Ok(Dataset {
        features,
        labels,
        classes: (0..c).map(|i| i.to_string()).collect(),
        feature_names: (0..d).map(|j| format!("x{j}")).collect(),
        groups: Some(groups),
    })
}

fn validate(cfg: &SyntheticConfig) -> Result<(), DataError> {
    let invalid =
        |parameter, reason: String| Err(DataError::InvalidParameter { parameter, reason });
    for (name, value) in [("synthetic alpha", cfg.alpha), ("synthetic beta", cfg.beta)] {
        if !(value.is_finite() && value >= 0.0) {
            return invalid(name, format!("{value} must be finite and >= 0"));
        }
    }
    if cfg.devices == 0 {
        return invalid(
            "synthetic devices",
            "0; at least 1 device is needed".to_owned(),
        );
    }
    if cfg.features == 0 {
        return invalid(
            "synthetic features",
            "0; at least 1 feature is needed".to_owned(),
        );
    }
    if cfg.classes < 2 {
        return invalid(
            "synthetic classes",
            format!("{}; classification needs at least 2", cfg.classes),
        );
    }
    // Every device holds at least 50 samples and a classes x features model, so this
    // bounds all allocations before any is made.
    let min_values = cfg
        .devices
        .checked_mul(50)
        .and_then(|n| n.checked_mul(cfg.features));
    let model_values = cfg.classes.checked_mul(cfg.features);
    if min_values.is_none_or(|v| v > MAX_FEATURE_VALUES)
        || model_values.is_none_or(|v| v > MAX_FEATURE_VALUES)
    {
        return Err(too_big(cfg, cfg.devices.saturating_mul(50)));
    }
    Ok(())
}

fn normals(rng: &mut ChaCha8Rng, mean: f64, std: f64, n: usize) -> Result<Vec<f64>, DataError> {
    // validate() has checked std is finite, which is all Normal::new requires.
    let dist = Normal::new(mean, std).map_err(|e| internal(&e))?;
    Ok((0..n).map(|_| rng.sample(dist)).collect())
}

/// Index of the largest logit `w[c] . x + b[c]`, the first on ties (as `np.argmax`).
fn argmax_logit(w: &[f64], b: &[f64], x: &[f64], d: usize) -> u32 {
    let mut best = (0u32, f64::NEG_INFINITY);
    for (c, (row, &bc)) in w.chunks_exact(d).zip(b).enumerate() {
        let logit = row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() + bc;
        if logit > best.1 {
            // classes fits u32: validate() bounds it by MAX_FEATURE_VALUES.
            best = (c as u32, logit);
        }
    }
    best.0
}

fn too_big(cfg: &SyntheticConfig, samples: usize) -> DataError {
    DataError::InvalidParameter {
        parameter: "synthetic size",
        reason: format!(
            "{} devices x {} features x {} classes ({samples} samples) exceeds the limit of {} \
             feature values",
            cfg.devices, cfg.features, cfg.classes, MAX_FEATURE_VALUES
        ),
    }
}

fn internal(e: &dyn std::fmt::Display) -> DataError {
    DataError::InvalidParameter {
        parameter: "synthetic distribution",
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(alpha: f64, beta: f64, seed: u64) -> SyntheticConfig {
        SyntheticConfig {
            alpha,
            beta,
            seed,
            ..SyntheticConfig::default()
        }
    }

    #[test]
    fn default_is_synthetic_1_1_with_paper_sizes() {
        let c = SyntheticConfig::default();
        assert_eq!((c.alpha, c.beta), (1.0, 1.0));
        assert_eq!((c.devices, c.features, c.classes), (30, 60, 10));
    }

    #[test]
    fn shapes_names_and_labels_are_consistent() {
        let ds = synthetic(&cfg(0.5, 0.5, 3)).unwrap();
        assert_eq!(ds.num_features(), 60);
        assert_eq!(ds.features.nrows(), ds.len());
        assert_eq!(
            ds.classes,
            (0..10).map(|c| c.to_string()).collect::<Vec<_>>()
        );
        assert_eq!(ds.feature_names[0], "x0");
        assert_eq!(ds.feature_names[59], "x59");
        assert!(ds.labels.iter().all(|&l| l < 10));
        assert!(ds.features.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn every_device_has_between_50_and_the_cap_samples_in_order() {
        let ds = synthetic(&SyntheticConfig::default()).unwrap();
        let groups = ds.groups.as_ref().unwrap();
        assert_eq!(groups.len(), ds.len());
        assert!(groups.windows(2).all(|w| w[0] <= w[1]), "device by device");
        let mut counts = vec![0usize; 30];
        for &g in groups {
            counts[g as usize] += 1;
        }
        assert!(
            counts
                .iter()
                .all(|&n| (50..=MAX_SAMPLES_PER_DEVICE).contains(&n)),
            "{counts:?}"
        );
    }

    #[test]
    fn same_seed_same_data_and_distinct_seeds_differ() {
        let a = synthetic(&cfg(1.0, 1.0, 11)).unwrap();
        let b = synthetic(&cfg(1.0, 1.0, 11)).unwrap();
        let c = synthetic(&cfg(1.0, 1.0, 12)).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn zero_alpha_and_beta_still_generate_valid_data() {
        let ds = synthetic(&cfg(0.0, 0.0, 5)).unwrap();
        assert!(ds.len() >= 30 * 50);
        assert!(ds.labels.iter().all(|&l| l < 10));
        // With beta = 0, every B_k is exactly 0, so the inputs centre on N(0, 1) means;
        // the overall mean of the first feature should be near 0.
        let m = ds.features.column(0).mean().unwrap();
        assert!(m.abs() < 1.0, "{m}");
    }

    #[test]
    fn zero_std_draws_are_exactly_the_mean() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(normals(&mut rng, 3.25, 0.0, 4).unwrap(), vec![3.25; 4]);
    }

    #[test]
    fn larger_beta_spreads_device_input_means_further() {
        let spread = |beta: f64| {
            let ds = synthetic(&SyntheticConfig {
                beta,
                devices: 20,
                ..cfg(0.0, beta, 9)
            })
            .unwrap();
            let groups = ds.groups.unwrap();
            let mut sums = vec![(0.0f64, 0usize); 20];
            for (row, &g) in ds.features.rows().into_iter().zip(&groups) {
                let s = &mut sums[g as usize];
                s.0 += row.iter().map(|&v| f64::from(v)).sum::<f64>() / row.len() as f64;
                s.1 += 1;
            }
            let means: Vec<f64> = sums.iter().map(|(s, n)| s / *n as f64).collect();
            let mu = means.iter().sum::<f64>() / means.len() as f64;
            means.iter().map(|m| (m - mu).powi(2)).sum::<f64>() / means.len() as f64
        };
        assert!(spread(5.0) > 4.0 * spread(0.0));
    }

    #[test]
    fn invalid_configs_are_rejected_with_named_parameter() {
        let bad = [
            SyntheticConfig {
                alpha: -1.0,
                ..Default::default()
            },
            SyntheticConfig {
                beta: f64::NAN,
                ..Default::default()
            },
            SyntheticConfig {
                alpha: f64::INFINITY,
                ..Default::default()
            },
            SyntheticConfig {
                devices: 0,
                ..Default::default()
            },
            SyntheticConfig {
                features: 0,
                ..Default::default()
            },
            SyntheticConfig {
                classes: 1,
                ..Default::default()
            },
            SyntheticConfig {
                devices: usize::MAX,
                ..Default::default()
            },
            SyntheticConfig {
                classes: usize::MAX,
                ..Default::default()
            },
            SyntheticConfig {
                features: 1 << 40,
                ..Default::default()
            },
        ];
        for c in bad {
            let err = synthetic(&c).unwrap_err();
            assert!(
                matches!(err, DataError::InvalidParameter { .. }),
                "{c:?}: {err:?}"
            );
            assert!(err.to_string().starts_with("invalid synthetic"), "{err}");
        }
    }
}
