//! Local training on a client's own data: mini-batch SGD with momentum and weight decay,
//! local epochs, and the FedProx proximal term; evaluation of loss and accuracy.
//!
//! [`Trainer`] is the seam through which a user brings their own training code; the
//! built-in [`LocalModel`] implements it for the models in [`crate::model`].

use cohort_aggregation::ModelVector;
use ndarray::{Array2, Axis};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::data::Dataset;
use crate::model::{Evaluation, ModelError, ModelSpec};

/// The most local epochs a round may ask for: past this a round is hours of a phone's
/// battery, and a typo (`10000` for `10`) is likelier than a plan.
pub const MAX_LOCAL_EPOCHS: u32 = 1000;
/// The largest mini-batch a round may ask for.
pub const MAX_BATCH_SIZE: usize = 1 << 20;

/// Hyper-parameters of one round of local training, sent by the server with the task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TrainConfig {
    /// Passes over the local data per round (1 to 1000).
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1000))]
    pub local_epochs: u32,
    /// Samples per SGD step (1 to 2^20); the last batch of an epoch may be smaller.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1048576))]
    pub batch_size: usize,
    /// SGD learning rate.
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0))]
    pub lr: f32,
    /// Heavy-ball momentum (PyTorch convention: `v = m v + g; w -= lr v`).
    pub momentum: f32,
    /// L2 penalty added to the gradient as `weight_decay * w`.
    pub weight_decay: f32,
    /// FedProx proximal weight mu: adds `mu (w - w_global)` to the gradient, which keeps
    /// local models near the global one on heterogeneous data. `None` is plain FedAvg.
    pub proximal_mu: Option<f32>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            local_epochs: 5,
            batch_size: 16,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 1e-4,
            proximal_mu: None,
        }
    }
}

/// Why local training could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrainError {
    /// A hyper-parameter is out of range.
    #[error("invalid training setting: {0}")]
    InvalidConfig(String),
    /// The global model or the data does not fit the model spec.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Training diverged: a parameter became NaN or infinite.
    #[error("local training diverged (non-finite parameters); lower the learning rate")]
    Diverged,
}

impl TrainConfig {
    /// Checks every field, so a bad setting is reported before any work starts.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |msg: String| Err(TrainError::InvalidConfig(msg));
        if self.local_epochs == 0 || self.local_epochs > MAX_LOCAL_EPOCHS {
            return bad(format!(
                "local epochs must be between 1 and {MAX_LOCAL_EPOCHS} (got {})",
                self.local_epochs
            ));
        }
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return bad(format!(
                "batch size must be between 1 and {MAX_BATCH_SIZE} (got {})",
                self.batch_size
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("learning rate must be > 0 (got {})", self.lr));
        }
        if !(self.momentum.is_finite() && (0.0..1.0).contains(&self.momentum)) {
            return bad(format!(
                "momentum must be in [0, 1) (got {})",
                self.momentum
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight decay must be >= 0 (got {})",
                self.weight_decay
            ));
        }
        if let Some(mu) = self.proximal_mu
            && !(mu.is_finite() && mu >= 0.0)
        {
            return bad(format!("proximal mu must be >= 0 (got {mu})"));
        }
        Ok(())
    }
}

/// What a client sends back after training: its new parameters and how much data they
/// were fitted on (the FedAvg weight).
#[derive(Debug, Clone, PartialEq)]
pub struct LocalUpdate {
    /// Locally trained parameters, same layout as the global model.
    pub params: ModelVector,
    /// Number of local training samples.
    pub num_samples: usize,
    /// Mean training loss over the last local epoch.
    pub train_loss: f64,
    /// SGD steps taken.
    pub steps: usize,
}

/// Training code that a client runs on its own data. Implement it to bring your own
/// model; the coordinator only ever sees [`ModelVector`]s.
pub trait Trainer: Send + Sync {
    /// Number of local training samples (the FedAvg weight).
    fn num_samples(&self) -> usize;

    /// Trains from `global` with `config`; `seed` fixes shuffling so runs repeat exactly.
    fn train(
        &self,
        global: &ModelVector,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<LocalUpdate, TrainError>;

    /// Loss and accuracy of `params` on the local data.
    fn evaluate(&self, params: &ModelVector) -> Result<Evaluation, TrainError>;
}

/// A built-in model ([`ModelSpec`]) bound to one client's data.
#[derive(Debug, Clone)]
pub struct LocalModel {
    spec: ModelSpec,
    features: Array2<f32>,
    labels: Vec<u32>,
}

impl LocalModel {
    /// Binds `spec` to `data`; fails if the feature width or labels do not fit.
    pub fn new(spec: ModelSpec, data: &Dataset) -> Result<Self, TrainError> {
        Self::from_parts(spec, data.features.clone(), data.labels.clone())
    }

    /// Binds `spec` to features and labels given directly.
    pub fn from_parts(
        spec: ModelSpec,
        features: Array2<f32>,
        labels: Vec<u32>,
    ) -> Result<Self, TrainError> {
        // Run the spec's own checks once on the whole set instead of per batch later.
        spec.evaluate(&vec![0.0; spec.num_params()], features.view(), &labels)?;
        Ok(Self {
            spec,
            features,
            labels,
        })
    }

    /// The model spec.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Trains from `start` with `config` (its `proximal_mu` is not read: `pull` says
    /// which vector a proximal term `mu/2 |w - anchor|^2` pulls towards, if any, as
    /// FedProx pulls to the global model and Ditto's personal model to it); only the
    /// parameters `trainable` marks move (all, without it), as FedRep trains its head
    /// and its body in turn. `seed` fixes the shuffling.
    pub fn train_from(
        &self,
        start: &ModelVector,
        pull: Option<(&[f32], f32)>,
        trainable: Option<&[bool]>,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<LocalUpdate, TrainError> {
        config.validate()?;
        let spec = &self.spec;
        let n = spec.num_params();
        if start.len() != n || pull.is_some_and(|(a, _)| a.len() != n) {
            return Err(ModelError::ParameterCount {
                expected: n,
                found: start.len(),
            }
            .into());
        }
        if trainable.is_some_and(|t| t.len() != n) {
            return Err(TrainError::InvalidConfig(format!(
                "the trainable mask has {} entries, the model {n} parameters",
                trainable.map_or(0, <[bool]>::len)
            )));
        }
        let (anchor, mu) = pull.unwrap_or((start.values(), 0.0));
        let mut w = start.values().to_vec();
        let mut grad = vec![0.0f32; w.len()];
        let mut velocity = vec![0.0f32; w.len()];
        let mut order: Vec<usize> = (0..self.labels.len()).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut batch_y = Vec::with_capacity(config.batch_size);
        let mut steps = 0;
        let mut epoch_loss = 0.0;
        for _ in 0..config.local_epochs {
            order.shuffle(&mut rng);
            let mut loss_sum = 0.0f64;
            for batch in order.chunks(config.batch_size) {
                let x = self.features.select(Axis(0), batch);
                batch_y.clear();
                batch_y.extend(batch.iter().map(|&i| self.labels[i]));
                let loss = spec.loss_and_gradient(&w, x.view(), &batch_y, &mut grad)?;
                loss_sum += f64::from(loss) * batch.len() as f64;
                if let Some(trainable) = trainable {
                    for (g, t) in grad.iter_mut().zip(trainable) {
                        if !t {
                            *g = 0.0;
                        }
                    }
                }
                for (i, (((wi, gi), vi), &ai)) in w
                    .iter_mut()
                    .zip(&grad)
                    .zip(velocity.iter_mut())
                    .zip(anchor)
                    .enumerate()
                {
                    if trainable.is_some_and(|t| !t[i]) {
                        continue;
                    }
                    let g = gi + config.weight_decay * *wi + mu * (*wi - ai);
                    *vi = config.momentum * *vi + g;
                    *wi -= config.lr * *vi;
                }
                steps += 1;
            }
            epoch_loss = loss_sum / order.len().max(1) as f64;
        }
        if !w.iter().all(|v| v.is_finite()) {
            return Err(TrainError::Diverged);
        }
        let params = ModelVector::new(start.layout().clone(), w)
            .expect("trained vector keeps the start's layout");
        Ok(LocalUpdate {
            params,
            num_samples: self.labels.len(),
            train_loss: epoch_loss,
            steps,
        })
    }
}

impl Trainer for LocalModel {
    fn num_samples(&self) -> usize {
        self.labels.len()
    }

    fn train(
        &self,
        global: &ModelVector,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<LocalUpdate, TrainError> {
        let pull = config.proximal_mu.map(|mu| (global.values(), mu));
        self.train_from(global, pull, None, config, seed)
    }

    fn evaluate(&self, params: &ModelVector) -> Result<Evaluation, TrainError> {
        Ok(self
            .spec
            .evaluate(params.values(), self.features.view(), &self.labels)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelKind;
    use rand::RngExt;

    /// Two well separated Gaussian blobs: any working trainer must fit them.
    fn blobs(n: usize, seed: u64) -> (Array2<f32>, Vec<u32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let labels: Vec<u32> = (0..n).map(|i| (i % 2) as u32).collect();
        let x = Array2::from_shape_fn((n, 2), |(i, _)| {
            let centre = if labels[i] == 0 { -2.0 } else { 2.0 };
            centre + rng.random_range(-1.0f32..1.0)
        });
        (x, labels)
    }

    #[test]
    fn sgd_fits_separable_data() {
        let (x, y) = blobs(200, 1);
        for kind in [ModelKind::LogReg, ModelKind::Mlp { hidden: vec![8] }] {
            let spec = ModelSpec::new(&kind, 2, 2).unwrap();
            let init = spec.init(0);
            let model = LocalModel::from_parts(spec, x.clone(), y.clone()).unwrap();
            let before = model.evaluate(&init).unwrap();
            let update = model.train(&init, &TrainConfig::default(), 7).unwrap();
            let after = model.evaluate(&update.params).unwrap();
            assert!(after.accuracy > 0.98, "{kind}: accuracy {}", after.accuracy);
            assert!(after.loss < before.loss);
            assert_eq!(update.num_samples, 200);
            assert_eq!(update.steps, 5 * 200usize.div_ceil(16));
        }
    }

    #[test]
    fn training_is_deterministic_for_a_seed() {
        let (x, y) = blobs(50, 2);
        let spec = ModelSpec::new(&ModelKind::Mlp { hidden: vec![4] }, 2, 2).unwrap();
        let init = spec.init(3);
        let model = LocalModel::from_parts(spec, x, y).unwrap();
        let cfg = TrainConfig::default();
        let a = model.train(&init, &cfg, 11).unwrap();
        let b = model.train(&init, &cfg, 11).unwrap();
        let c = model.train(&init, &cfg, 12).unwrap();
        assert_eq!(a.params, b.params);
        assert_ne!(a.params, c.params);
    }

    #[test]
    fn proximal_term_keeps_local_model_closer_to_global() {
        let (x, y) = blobs(100, 4);
        let spec = ModelSpec::new(&ModelKind::LogReg, 2, 2).unwrap();
        let init = spec.init(0);
        let model = LocalModel::from_parts(spec, x, y).unwrap();
        let distance = |mu: Option<f32>| {
            let cfg = TrainConfig {
                proximal_mu: mu,
                ..TrainConfig::default()
            };
            let p = model.train(&init, &cfg, 5).unwrap().params;
            p.values()
                .iter()
                .zip(init.values())
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        assert!(distance(Some(1.0)) < 0.8 * distance(None));
    }

    #[test]
    fn bad_settings_are_rejected_before_training() {
        let base = TrainConfig::default();
        let cases = [
            TrainConfig {
                local_epochs: 0,
                ..base.clone()
            },
            TrainConfig {
                batch_size: 0,
                ..base.clone()
            },
            TrainConfig {
                lr: f32::NAN,
                ..base.clone()
            },
            TrainConfig {
                momentum: 1.0,
                ..base.clone()
            },
            TrainConfig {
                proximal_mu: Some(-1.0),
                ..base.clone()
            },
        ];
        for cfg in cases {
            assert!(matches!(cfg.validate(), Err(TrainError::InvalidConfig(_))));
        }
    }

    #[test]
    fn diverging_training_is_an_error() {
        // Identical, huge inputs with alternating labels: the loss can never reach zero,
        // so a large learning rate drives the weights to infinity.
        let x = Array2::from_elem((20, 2), 1e30f32);
        let y: Vec<u32> = (0..20).map(|i| (i % 2) as u32).collect();
        let spec = ModelSpec::new(&ModelKind::LogReg, 2, 2).unwrap();
        let init = spec.init(0);
        let model = LocalModel::from_parts(spec, x, y).unwrap();
        let cfg = TrainConfig {
            lr: 0.9,
            ..TrainConfig::default()
        };
        assert_eq!(model.train(&init, &cfg, 0), Err(TrainError::Diverged));
    }
}
