//! Models with forward and backward passes on ndarray: multinomial logistic regression and
//! multi-layer perceptrons with ReLU hidden layers, trained with softmax cross-entropy.
//!
//! A model is a [`ModelSpec`] (layer sizes) plus a flat [`ModelVector`]. Tensors are named
//! `layers.{i}.weight` (shape `[out, in]`) and `layers.{i}.bias` (shape `[out]`), the same
//! row-major convention as a PyTorch `nn.Linear` state dict.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use cohort_aggregation::{Layout, ModelVector, TensorSpec};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis, s};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The hidden layer sizes used by a bare `mlp`: one hidden layer of 64, the reference
/// architecture of the shipped data sets' README.
pub const DEFAULT_MLP_HIDDEN: [usize; 1] = [64];

/// The largest model accepted: 2^28 parameters (1 GiB of `f32`). Anything larger would
/// exhaust memory on the machines this runs on before training could start.
pub const MAX_PARAMETERS: usize = 1 << 28;

/// Which family of model to train, as a user names it on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelKind {
    /// Multinomial logistic regression (one linear layer, softmax).
    LogReg,
    /// Multi-layer perceptron with ReLU hidden layers of the given sizes.
    Mlp {
        /// Hidden layer widths, input side first.
        hidden: Vec<usize>,
    },
}

/// Why a model name or shape is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The text is not one of the accepted model forms.
    #[error("unknown model `{0}`: expected logreg, mlp or mlp:H1,H2,...")]
    Unknown(String),
    /// A hidden size is not a positive integer.
    #[error("invalid model `{text}`: hidden size `{size}` must be a positive integer")]
    BadHiddenSize {
        /// The whole model text.
        text: String,
        /// The offending size.
        size: String,
    },
    /// The data has no features or fewer than two classes.
    #[error(
        "a model needs at least one input feature and two classes (got {inputs} and {classes})"
    )]
    Degenerate {
        /// Input features.
        inputs: usize,
        /// Output classes.
        classes: usize,
    },
    /// The model would have more than [`MAX_PARAMETERS`] parameters.
    #[error("model {sizes:?} would have more than {max} parameters")]
    TooLarge {
        /// Layer widths asked for.
        sizes: Vec<usize>,
        /// The limit.
        max: usize,
    },
    /// Parameters do not fit the spec's layout.
    #[error("parameters have {found} values but the model needs {expected}")]
    ParameterCount {
        /// Parameters the spec needs.
        expected: usize,
        /// Parameters given.
        found: usize,
    },
    /// A batch's feature width or labels do not fit the model.
    #[error("batch does not fit the model: {0}")]
    Batch(String),
}

impl FromStr for ModelKind {
    type Err = ModelError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let t = text.trim().to_ascii_lowercase();
        match t.as_str() {
            "logreg" => return Ok(ModelKind::LogReg),
            "mlp" => {
                return Ok(ModelKind::Mlp {
                    hidden: DEFAULT_MLP_HIDDEN.to_vec(),
                });
            }
            _ => {}
        }
        let Some(sizes) = t.strip_prefix("mlp:") else {
            return Err(ModelError::Unknown(text.trim().to_string()));
        };
        let hidden = sizes
            .split(',')
            .map(|s| match s.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(ModelError::BadHiddenSize {
                    text: text.trim().to_string(),
                    size: s.trim().to_string(),
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ModelKind::Mlp { hidden })
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelKind::LogReg => f.write_str("logreg"),
            ModelKind::Mlp { hidden } => {
                let sizes: Vec<String> = hidden.iter().map(ToString::to_string).collect();
                write!(f, "mlp:{}", sizes.join(","))
            }
        }
    }
}

impl Serialize for ModelKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ModelKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Layer sizes of a concrete model: input width, hidden widths, number of classes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    sizes: Vec<usize>,
    layout: Arc<Layout>,
}

impl ModelSpec {
    /// The model of `kind` for data with `inputs` features and `classes` classes.
    pub fn new(kind: &ModelKind, inputs: usize, classes: usize) -> Result<Self, ModelError> {
        if inputs == 0 || classes < 2 {
            return Err(ModelError::Degenerate { inputs, classes });
        }
        let mut sizes = vec![inputs];
        if let ModelKind::Mlp { hidden } = kind {
            sizes.extend_from_slice(hidden);
        }
        sizes.push(classes);
        let params = sizes.windows(2).try_fold(0usize, |acc, w| {
            w[0].checked_mul(w[1])
                .and_then(|n| n.checked_add(w[1]))
                .and_then(|n| n.checked_add(acc))
        });
        if params.is_none_or(|n| n > MAX_PARAMETERS) {
            return Err(ModelError::TooLarge {
                sizes,
                max: MAX_PARAMETERS,
            });
        }
        let tensors = sizes
            .windows(2)
            .enumerate()
            .flat_map(|(i, w)| {
                [
                    TensorSpec::new(format!("layers.{i}.weight"), [w[1], w[0]]),
                    TensorSpec::new(format!("layers.{i}.bias"), [w[1]]),
                ]
            })
            .collect();
        let layout = Arc::new(Layout::new(tensors).expect("generated tensor names are unique"));
        Ok(Self { sizes, layout })
    }

    /// Widths from the input layer to the output layer.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Number of input features.
    pub fn inputs(&self) -> usize {
        self.sizes[0]
    }

    /// Number of output classes.
    pub fn classes(&self) -> usize {
        self.sizes[self.sizes.len() - 1]
    }

    /// The named tensors of this model.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// Total number of parameters.
    pub fn num_params(&self) -> usize {
        self.layout.len()
    }

    /// Fresh parameters: He-uniform weights for ReLU layers, Glorot-uniform for the
    /// output layer, zero biases. Deterministic from `seed`, so every client and the server
    /// can agree on the initial model without sending it.
    pub fn init(&self, seed: u64) -> ModelVector {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut values = Vec::with_capacity(self.num_params());
        let last = self.sizes.len() - 2;
        for (i, w) in self.sizes.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            let bound = if i == last {
                (6.0 / (fan_in + fan_out) as f64).sqrt()
            } else {
                (6.0 / fan_in as f64).sqrt()
            } as f32;
            values.extend((0..fan_in * fan_out).map(|_| rng.random_range(-bound..bound)));
            values.extend(std::iter::repeat_n(0.0, fan_out));
        }
        ModelVector::new(self.layout.clone(), values).expect("init fills the layout exactly")
    }

    fn check_params(&self, len: usize) -> Result<(), ModelError> {
        if len != self.num_params() {
            return Err(ModelError::ParameterCount {
                expected: self.num_params(),
                found: len,
            });
        }
        Ok(())
    }

    fn check_batch(&self, x: &ArrayView2<'_, f32>, y: Option<&[u32]>) -> Result<(), ModelError> {
        if x.ncols() != self.inputs() {
            return Err(ModelError::Batch(format!(
                "{} features, model expects {}",
                x.ncols(),
                self.inputs()
            )));
        }
        if let Some(y) = y {
            if y.len() != x.nrows() {
                return Err(ModelError::Batch(format!(
                    "{} rows but {} labels",
                    x.nrows(),
                    y.len()
                )));
            }
            if let Some(&bad) = y.iter().find(|&&l| l as usize >= self.classes()) {
                return Err(ModelError::Batch(format!(
                    "label {bad} out of range for {} classes",
                    self.classes()
                )));
            }
        }
        Ok(())
    }

    /// Weight `[out, in]` and bias `[out]` views of layer `i` inside `params`.
    fn layer<'a>(&self, params: &'a [f32], i: usize) -> (ArrayView2<'a, f32>, ArrayView1<'a, f32>) {
        let (offset, out, inp) = self.layer_offset(i);
        let w = ArrayView2::from_shape((out, inp), &params[offset..offset + out * inp])
            .expect("layer slice matches its shape");
        let b = ArrayView1::from(&params[offset + out * inp..offset + out * inp + out]);
        (w, b)
    }

    fn layer_mut<'a>(
        &self,
        params: &'a mut [f32],
        i: usize,
    ) -> (ArrayViewMut2<'a, f32>, ArrayViewMut1<'a, f32>) {
        let (offset, out, inp) = self.layer_offset(i);
        let (w, b) = params[offset..offset + out * inp + out].split_at_mut(out * inp);
        let w = ArrayViewMut2::from_shape((out, inp), w).expect("layer slice matches its shape");
        (w, ArrayViewMut1::from(b))
    }

    fn layer_offset(&self, i: usize) -> (usize, usize, usize) {
        let offset = self
            .sizes
            .windows(2)
            .take(i)
            .map(|w| w[0] * w[1] + w[1])
            .sum();
        (offset, self.sizes[i + 1], self.sizes[i])
    }

    fn num_layers(&self) -> usize {
        self.sizes.len() - 1
    }

    /// Class scores (pre-softmax) for each row of `x`.
    pub fn logits(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
    ) -> Result<Array2<f32>, ModelError> {
        self.check_params(params.len())?;
        self.check_batch(&x, None)?;
        Ok(self
            .forward(params, x)
            .pop()
            .expect("a model has at least one layer"))
    }

    /// Every layer's output for the batch `x`, input side first: ReLU activations for
    /// hidden layers, logits last. The backward pass needs them all.
    fn forward(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Vec<Array2<f32>> {
        let layers = self.num_layers();
        let mut outputs: Vec<Array2<f32>> = Vec::with_capacity(layers);
        for i in 0..layers {
            let input = if i == 0 { x } else { outputs[i - 1].view() };
            let (w, b) = self.layer(params, i);
            let mut z = input.dot(&w.t());
            z += &b;
            if i + 1 < layers {
                z.mapv_inplace(|v| v.max(0.0));
            }
            outputs.push(z);
        }
        outputs
    }

    /// Mean softmax cross-entropy of the batch, and its gradient with respect to every
    /// parameter written into `grad` (overwritten, same layout as `params`).
    pub fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u32],
        grad: &mut [f32],
    ) -> Result<f32, ModelError> {
        self.check_params(params.len())?;
        self.check_params(grad.len())?;
        self.check_batch(&x, Some(y))?;
        let n = x.nrows();
        if n == 0 {
            grad.fill(0.0);
            return Ok(0.0);
        }
        let layers = self.num_layers();
        let mut acts = self.forward(params, x.view());
        let mut delta = acts.pop().expect("at least one layer");
        let loss = softmax_cross_entropy_backward(&mut delta, y);
        for i in (0..layers).rev() {
            let input = if i == 0 { x.view() } else { acts[i - 1].view() };
            let (mut gw, mut gb) = self.layer_mut(grad, i);
            general_mat_mul(1.0, &delta.t(), &input, 0.0, &mut gw);
            gb.assign(&delta.sum_axis(Axis(0)));
            if i > 0 {
                let (w, _) = self.layer(params, i);
                let mut upstream = delta.dot(&w);
                upstream.zip_mut_with(&acts[i - 1], |d, &a| {
                    if a <= 0.0 {
                        *d = 0.0;
                    }
                });
                delta = upstream;
            }
        }
        Ok(loss)
    }

    /// Mean cross-entropy loss and accuracy of `params` on a labelled set, computed in
    /// chunks so memory stays bounded on large sets.
    pub fn evaluate(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u32],
    ) -> Result<Evaluation, ModelError> {
        self.check_params(params.len())?;
        self.check_batch(&x, Some(y))?;
        const CHUNK: usize = 1024;
        let mut loss_sum = 0.0f64;
        let mut correct = 0usize;
        for start in (0..x.nrows()).step_by(CHUNK) {
            let end = (start + CHUNK).min(x.nrows());
            let logits = self.logits(params, x.slice(s![start..end, ..]))?;
            for (row, &label) in logits.rows().into_iter().zip(&y[start..end]) {
                let (lse, argmax) = log_sum_exp_argmax(row);
                loss_sum += f64::from(lse - row[label as usize]);
                if argmax == label as usize {
                    correct += 1;
                }
            }
        }
        let samples = y.len();
        Ok(Evaluation {
            loss: if samples == 0 {
                0.0
            } else {
                loss_sum / samples as f64
            },
            accuracy: if samples == 0 {
                0.0
            } else {
                correct as f64 / samples as f64
            },
            samples,
        })
    }
}

/// Loss and accuracy of a model on a labelled set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// Mean softmax cross-entropy.
    pub loss: f64,
    /// Fraction of samples whose highest-scoring class is the label.
    pub accuracy: f64,
    /// Number of samples evaluated.
    pub samples: usize,
}

/// Numerically stable `log(sum(exp(row)))` and the index of the largest entry.
fn log_sum_exp_argmax(row: ArrayView1<'_, f32>) -> (f32, usize) {
    let (argmax, max) =
        row.iter()
            .copied()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, v)| {
                if v > bv { (i, v) } else { (bi, bv) }
            });
    let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
    (max + sum.ln(), argmax)
}

/// Turns logits into `(softmax - onehot) / n` in place and returns the mean loss.
fn softmax_cross_entropy_backward(logits: &mut Array2<f32>, y: &[u32]) -> f32 {
    let n = logits.nrows() as f32;
    let mut loss = 0.0f64;
    for (mut row, &label) in logits.rows_mut().into_iter().zip(y) {
        let (lse, _) = log_sum_exp_argmax(row.view());
        loss += f64::from(lse - row[label as usize]);
        row.mapv_inplace(|v| (v - lse).exp() / n);
        row[label as usize] -= 1.0 / n;
    }
    (loss / f64::from(n)) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;
    use proptest::prelude::*;

    fn random_batch(
        rows: usize,
        cols: usize,
        classes: usize,
        seed: u64,
    ) -> (Array2<f32>, Vec<u32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let x = Array2::from_shape_fn((rows, cols), |_| rng.random_range(-1.0f32..1.0));
        let y = (0..rows)
            .map(|_| rng.random_range(0..classes as u32))
            .collect();
        (x, y)
    }

    /// Central finite differences in f64 around the f32 parameters; the analytic gradient
    /// must agree to within the error f32 forward passes allow.
    fn check_gradient(kind: ModelKind, seed: u64) {
        let (inputs, classes) = (5, 4);
        let spec = ModelSpec::new(&kind, inputs, classes).unwrap();
        let params = spec.init(seed).into_values();
        let (x, y) = random_batch(7, inputs, classes, seed + 1);
        let mut grad = vec![0.0; params.len()];
        spec.loss_and_gradient(&params, x.view(), &y, &mut grad)
            .unwrap();
        // Small enough that no ReLU of this tiny net crosses its kink, large enough that
        // f32 rounding of the loss stays well below the tolerance.
        let eps = 1e-3f32;
        for i in 0..params.len() {
            let mut plus = params.clone();
            plus[i] += eps;
            let mut minus = params.clone();
            minus[i] -= eps;
            let mut scratch = vec![0.0; params.len()];
            let lp = spec
                .loss_and_gradient(&plus, x.view(), &y, &mut scratch)
                .unwrap();
            let lm = spec
                .loss_and_gradient(&minus, x.view(), &y, &mut scratch)
                .unwrap();
            let numeric = (f64::from(lp) - f64::from(lm)) / (2.0 * f64::from(eps));
            let analytic = f64::from(grad[i]);
            assert!(
                (numeric - analytic).abs() <= 2e-3 + 2e-2 * analytic.abs(),
                "{kind} parameter {i}: analytic {analytic} vs numeric {numeric}"
            );
        }
    }

    #[test]
    fn logreg_gradient_matches_finite_differences() {
        for seed in 0..5 {
            check_gradient(ModelKind::LogReg, seed);
        }
    }

    #[test]
    fn mlp_gradient_matches_finite_differences() {
        for seed in 0..5 {
            check_gradient(ModelKind::Mlp { hidden: vec![6, 3] }, seed);
        }
    }

    #[test]
    fn layout_follows_pytorch_linear_convention() {
        let spec = ModelSpec::new(&"mlp:8".parse().unwrap(), 3, 2).unwrap();
        let names: Vec<_> = spec
            .layout()
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("layers.0.weight".to_string(), vec![8, 3]),
                ("layers.0.bias".to_string(), vec![8]),
                ("layers.1.weight".to_string(), vec![2, 8]),
                ("layers.1.bias".to_string(), vec![2]),
            ]
        );
        assert_eq!(spec.num_params(), 8 * 3 + 8 + 2 * 8 + 2);
    }

    #[test]
    fn model_names_parse_and_round_trip() {
        for text in ["logreg", "mlp:64", "mlp:128,32"] {
            let kind: ModelKind = text.parse().unwrap();
            assert_eq!(kind.to_string(), text);
        }
        assert_eq!(
            "MLP".parse::<ModelKind>().unwrap(),
            ModelKind::Mlp { hidden: vec![64] }
        );
        assert!(matches!(
            "cnn".parse::<ModelKind>(),
            Err(ModelError::Unknown(_))
        ));
        assert!(matches!(
            "mlp:0".parse::<ModelKind>(),
            Err(ModelError::BadHiddenSize { .. })
        ));
        assert!(matches!(
            "mlp:".parse::<ModelKind>(),
            Err(ModelError::BadHiddenSize { .. })
        ));
    }

    #[test]
    fn mismatched_batches_are_errors_not_panics() {
        let spec = ModelSpec::new(&ModelKind::LogReg, 3, 2).unwrap();
        let params = spec.init(0).into_values();
        let (x, _) = random_batch(4, 5, 2, 0);
        assert!(spec.logits(&params, x.view()).is_err());
        let (x, _) = random_batch(4, 3, 2, 0);
        let mut grad = vec![0.0; params.len()];
        assert!(
            spec.loss_and_gradient(&params, x.view(), &[0, 1, 2, 0], &mut grad)
                .is_err()
        );
        assert!(
            spec.loss_and_gradient(&params, x.view(), &[0, 1], &mut grad)
                .is_err()
        );
        assert!(
            spec.evaluate(&params[1..], x.view(), &[0, 1, 1, 0])
                .is_err()
        );
    }

    #[test]
    fn oversized_models_are_refused_before_allocating() {
        let kind: ModelKind = "mlp:100000000,100000000".parse().unwrap();
        assert!(matches!(
            ModelSpec::new(&kind, 64, 10),
            Err(ModelError::TooLarge { .. })
        ));
        let overflow = ModelKind::Mlp {
            hidden: vec![usize::MAX],
        };
        assert!(matches!(
            ModelSpec::new(&overflow, 64, 10),
            Err(ModelError::TooLarge { .. })
        ));
    }

    #[test]
    fn evaluation_reports_loss_of_uniform_prediction() {
        let spec = ModelSpec::new(&ModelKind::LogReg, 2, 4).unwrap();
        let params = vec![0.0; spec.num_params()];
        let (x, y) = random_batch(10, 2, 4, 3);
        let eval = spec.evaluate(&params, x.view(), &y).unwrap();
        assert!((eval.loss - 4f64.ln()).abs() < 1e-6);
        assert_eq!(eval.samples, 10);
    }

    proptest! {
        #[test]
        fn loss_is_finite_and_non_negative_for_extreme_logits(scale in 1.0f32..1e4, seed in 0u64..100) {
            let spec = ModelSpec::new(&ModelKind::LogReg, 3, 3).unwrap();
            let params: Vec<f32> = spec.init(seed).values().iter().map(|v| v * scale).collect();
            let (x, y) = random_batch(5, 3, 3, seed);
            let mut grad = vec![0.0; params.len()];
            let loss = spec.loss_and_gradient(&params, x.view(), &y, &mut grad).unwrap();
            prop_assert!(loss.is_finite() && loss >= 0.0);
            prop_assert!(grad.iter().all(|g| g.is_finite()));
        }
    }
}
