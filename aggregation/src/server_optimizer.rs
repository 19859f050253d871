//! How the server turns the averaged client model into the next global model.
//!
//! Follows Reddi et al. 2021, "Adaptive Federated Optimization" (Algorithm 2). The
//! clients' weighted mean (from [`WeightedMean`](crate::WeightedMean)) minus the current
//! global model is the pseudo-gradient `delta_t = mean - x_t`, which the server applies
//! either directly (FedAvg, FedProx) or through an adaptive optimizer (FedAdam, FedYogi,
//! FedAdagrad).

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::fedavg::{AggregationError, check_layout, first_non_finite};
use crate::model_vector::{Layout, ModelVector};

/// Which second-moment rule an adaptive server optimizer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdaptiveKind {
    /// FedAdam: `v_t = beta2 * v_{t-1} + (1 - beta2) * delta_t^2`.
    Adam,
    /// FedYogi: `v_t = v_{t-1} - (1 - beta2) * delta_t^2 * sign(v_{t-1} - delta_t^2)`.
    Yogi,
    /// FedAdagrad: `v_t = v_{t-1} + delta_t^2`.
    Adagrad,
}

impl AdaptiveKind {
    /// Lower-case name: `adam`, `yogi` or `adagrad`.
    pub fn name(self) -> &'static str {
        match self {
            AdaptiveKind::Adam => "adam",
            AdaptiveKind::Yogi => "yogi",
            AdaptiveKind::Adagrad => "adagrad",
        }
    }
}

impl fmt::Display for AdaptiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Hyperparameters of an adaptive server optimizer.
///
/// Fields missing from a serialized config take their [`Default`] values. Fields are
/// public, so a config is only known to be valid once [`validate`](Self::validate) (or
/// [`ServerOptimizer::adaptive`], which calls it) has accepted it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveConfig {
    /// Server learning rate `eta`; finite and > 0.
    pub server_lr: f32,
    /// First-moment decay `beta1`; in `[0, 1)`.
    pub beta1: f32,
    /// Second-moment decay `beta2`; in `[0, 1)`. Adagrad ignores it.
    pub beta2: f32,
    /// Adaptivity `tau`, added to `sqrt(v_t)`; finite and > 0.
    pub tau: f32,
}

impl Default for AdaptiveConfig {
    /// `server_lr` 0.01, `beta1` 0.9, `beta2` 0.99, `tau` 1e-3.
    fn default() -> Self {
        Self {
            server_lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            tau: 1e-3,
        }
    }
}

impl AdaptiveConfig {
    /// A config with every field given, checked with [`validate`](Self::validate).
    pub fn new(server_lr: f32, beta1: f32, beta2: f32, tau: f32) -> Result<Self, AggregationError> {
        let config = Self {
            server_lr,
            beta1,
            beta2,
            tau,
        };
        config.validate()?;
        Ok(config)
    }

    /// This config with `server_lr` replaced (not validated).
    pub fn with_server_lr(self, server_lr: f32) -> Self {
        Self { server_lr, ..self }
    }

    /// Checks every field's range, failing with [`AggregationError::InvalidConfig`].
    ///
    /// `beta2` is checked even though Adagrad ignores it, so a config that passes stays
    /// valid when only the kind changes.
    pub fn validate(&self) -> Result<(), AggregationError> {
        check_positive("server_lr", self.server_lr)?;
        check_unit_interval("beta1", self.beta1)?;
        check_unit_interval("beta2", self.beta2)?;
        check_positive("tau", self.tau)?;
        Ok(())
    }
}

fn check_positive(field: &'static str, value: f32) -> Result<(), AggregationError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(AggregationError::InvalidConfig {
            field,
            value,
            expected: "a finite number > 0",
        })
    }
}

fn check_unit_interval(field: &'static str, value: f32) -> Result<(), AggregationError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(AggregationError::InvalidConfig {
            field,
            value,
            expected: "a number in [0, 1)",
        })
    }
}

/// The optimizer's moments, one entry per parameter, stored as `f32` like the model.
#[derive(Clone)]
struct Moments {
    layout: Arc<Layout>,
    m: Vec<f32>,
    v: Vec<f32>,
}

#[derive(Clone)]
enum Rule {
    Average {
        server_lr: f32,
    },
    Adaptive {
        kind: AdaptiveKind,
        config: AdaptiveConfig,
        moments: Option<Moments>,
    },
}

/// Turns the clients' weighted mean into the next global model, one round at a time.
///
/// Plain averaging is stateless. The adaptive rules keep the moments `m` and `v`, created
/// on the first [`step`](Self::step) and sized to that model; later steps must use the
/// same layout until [`reset`](Self::reset).
///
/// Each element is computed in `f64` without reductions, so a step is deterministic:
/// the same inputs give bit-identical outputs on every run and thread count.
#[derive(Clone)]
pub struct ServerOptimizer {
    rule: Rule,
}

impl fmt::Debug for ServerOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The moments are model-sized; print their presence, not their values.
        match &self.rule {
            Rule::Average { server_lr } => f
                .debug_struct("ServerOptimizer")
                .field("rule", &"average")
                .field("server_lr", server_lr)
                .finish(),
            Rule::Adaptive {
                kind,
                config,
                moments,
            } => f
                .debug_struct("ServerOptimizer")
                .field("rule", kind)
                .field("config", config)
                .field("moments_len", &moments.as_ref().map(|s| s.m.len()))
                .finish(),
        }
    }
}

impl ServerOptimizer {
    /// Plain averaging (the server side of FedAvg and FedProx):
    /// `x_{t+1} = x_t + server_lr * delta_t`.
    ///
    /// `server_lr` 1.0 makes the next global model exactly the clients' mean. Fails
    /// unless `server_lr` is finite and > 0.
    pub fn average(server_lr: f32) -> Result<Self, AggregationError> {
        check_positive("server_lr", server_lr)?;
        Ok(Self {
            rule: Rule::Average { server_lr },
        })
    }

    /// An adaptive optimizer (FedAdam, FedYogi or FedAdagrad) without bias correction,
    /// as in the paper:
    ///
    /// - `m_t = beta1 * m_{t-1} + (1 - beta1) * delta_t`
    /// - `v_t` by `kind`, see [`AdaptiveKind`]
    /// - `x_{t+1} = x_t + server_lr * m_t / (sqrt(v_t) + tau)`
    ///
    /// The moments start at `m_{-1} = 0` and `v_{-1} = tau^2`: the paper requires
    /// `v_{-1} >= tau^2`, and the smallest allowed value lets the first step move as far
    /// as the config permits. Fails when [`AdaptiveConfig::validate`] does.
    pub fn adaptive(kind: AdaptiveKind, config: AdaptiveConfig) -> Result<Self, AggregationError> {
        config.validate()?;
        Ok(Self {
            rule: Rule::Adaptive {
                kind,
                config,
                moments: None,
            },
        })
    }

    /// The server rule: `average`, `adam`, `yogi` or `adagrad`.
    pub fn name(&self) -> &'static str {
        match &self.rule {
            Rule::Average { .. } => "average",
            Rule::Adaptive { kind, .. } => kind.name(),
        }
    }

    /// The server learning rate.
    pub fn server_lr(&self) -> f32 {
        match &self.rule {
            Rule::Average { server_lr } => *server_lr,
            Rule::Adaptive { config, .. } => config.server_lr,
        }
    }

    /// The adaptive rule and its config; `None` for plain averaging.
    pub fn adaptive_config(&self) -> Option<(AdaptiveKind, AdaptiveConfig)> {
        match &self.rule {
            Rule::Average { .. } => None,
            Rule::Adaptive { kind, config, .. } => Some((*kind, *config)),
        }
    }

    /// Forgets the moments, so the next step starts afresh and may use a new layout.
    pub fn reset(&mut self) {
        if let Rule::Adaptive { moments, .. } = &mut self.rule {
            *moments = None;
        }
    }

    /// The state a later step depends on, as bytes: the adaptive rules' moments after at
    /// least one step, `None` for plain averaging (stateless) and before the first step.
    ///
    /// A coordinator stores these bytes with each model it publishes, so that one
    /// restarted (or another replica) continues the same optimizer with
    /// [`restore_state`](Self::restore_state): the layout is a header naming the rule,
    /// its config and the parameter count, then `m` and `v` as little-endian `f32`.
    pub fn state_bytes(&self) -> Option<Vec<u8>> {
        let Rule::Adaptive {
            kind,
            config,
            moments: Some(moments),
        } = &self.rule
        else {
            return None;
        };
        let mut out = state_header(*kind, config, moments.m.len());
        out.reserve(8 * moments.m.len());
        for x in moments.m.iter().chain(&moments.v) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        Some(out)
    }

    /// Continues from moments saved by [`state_bytes`](Self::state_bytes) for a model
    /// of `layout`, replacing any this optimizer holds.
    ///
    /// Fails, changing nothing, when this is plain averaging, when the bytes were saved
    /// by another rule or config or for another parameter count, when they are cut short
    /// or too long, or when a moment is not finite (or `v` is negative, which no step can
    /// produce).
    pub fn restore_state(
        &mut self,
        layout: &Arc<Layout>,
        bytes: &[u8],
    ) -> Result<(), AggregationError> {
        let refuse = |why: String| Err(AggregationError::OptimizerState(why));
        let Rule::Adaptive {
            kind,
            config,
            moments,
        } = &mut self.rule
        else {
            return refuse("plain averaging keeps no state".into());
        };
        let len = layout.len();
        let header = state_header(*kind, config, len);
        let Some(body) = bytes.strip_prefix(header.as_slice()) else {
            return refuse(format!(
                "the saved state is not {kind}'s with this config for {len} parameters"
            ));
        };
        if body.len() != 8 * len {
            return refuse(format!(
                "{} bytes of moments, expected {} for {len} parameters",
                body.len(),
                8 * len
            ));
        }
        let floats: Vec<f32> = body
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (m, v) = floats.split_at(len);
        // Every rule keeps v positive: it starts at tau^2 and Yogi only ever moves it part
        // of the way towards delta^2.
        if let Some(index) =
            first_non_finite(m).or_else(|| v.iter().position(|&x| !x.is_finite() || x < 0.0))
        {
            return refuse(format!("moment {index} is out of range"));
        }
        *moments = Some(Moments {
            layout: layout.clone(),
            m: m.to_vec(),
            v: v.to_vec(),
        });
        Ok(())
    }

    /// Moves `global` towards `mean`, the weighted mean of the clients' models.
    ///
    /// Fails, changing neither `global` nor the optimizer, when the layouts differ (from
    /// each other or from the moments of earlier steps), when `mean` has a NaN or
    /// infinite value, or when the result would not be finite.
    pub fn step(
        &mut self,
        global: &mut ModelVector,
        mean: &ModelVector,
    ) -> Result<(), AggregationError> {
        check_layout(global.layout(), mean.layout())?;
        if let Some(index) = first_non_finite(mean.values()) {
            return Err(AggregationError::NonFinite { index });
        }
        match &mut self.rule {
            Rule::Average { server_lr } => average_step(*server_lr, global, mean),
            Rule::Adaptive {
                kind,
                config,
                moments,
            } => {
                if let Some(existing) = moments.as_ref() {
                    check_layout(&existing.layout, global.layout())?;
                }
                // Build fresh moments aside and keep them only if the step succeeds, so
                // a failed first step leaves the optimizer as new.
                let mut fresh = None;
                let state = match moments.as_mut() {
                    Some(existing) => existing,
                    None => fresh.insert(Moments {
                        layout: global.layout().clone(),
                        m: vec![0.0; global.len()],
                        v: vec![config.tau * config.tau; global.len()],
                    }),
                };
                adaptive_step(*kind, config, state, global, mean)?;
                if fresh.is_some() {
                    *moments = fresh;
                }
                Ok(())
            }
        }
    }
}

/// What saved state starts with: a tag and version, then the rule, its config and the
/// parameter count, so state restored into another optimizer or model is refused.
fn state_header(kind: AdaptiveKind, config: &AdaptiveConfig, len: usize) -> Vec<u8> {
    let mut out = b"cohort-optimizer-state/1\n".to_vec();
    out.extend_from_slice(kind.name().as_bytes());
    out.push(b'\n');
    for x in [config.server_lr, config.beta1, config.beta2, config.tau] {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out
}

fn average_step(
    server_lr: f32,
    global: &mut ModelVector,
    mean: &ModelVector,
) -> Result<(), AggregationError> {
    // x + 1 * (mean - x) need not round back to mean, and FedAvg promises the mean itself.
    if server_lr == 1.0 {
        global.values_mut().copy_from_slice(mean.values());
        return Ok(());
    }
    let lr = f64::from(server_lr);
    let next = |x: f32, mean: f32| {
        let x = f64::from(x);
        (x + lr * (f64::from(mean) - x)) as f32
    };
    // A first pass only checks, so an overflow is reported before anything is written.
    let overflow = global
        .values()
        .iter()
        .zip(mean.values())
        .position(|(&x, &mean)| !next(x, mean).is_finite());
    if let Some(index) = overflow {
        return Err(AggregationError::NonFiniteResult { index });
    }
    for (x, &mean) in global.values_mut().iter_mut().zip(mean.values()) {
        *x = next(*x, mean);
    }
    Ok(())
}

fn adaptive_step(
    kind: AdaptiveKind,
    config: &AdaptiveConfig,
    state: &mut Moments,
    global: &mut ModelVector,
    mean: &ModelVector,
) -> Result<(), AggregationError> {
    let beta2 = f64::from(config.beta2);
    // Matching on the kind here, outside the loop, gives each rule its own branch-free
    // loop body that the compiler can vectorise.
    match kind {
        AdaptiveKind::Adam => apply_moments(config, state, global, mean, |v, d2| {
            beta2 * v + (1.0 - beta2) * d2
        }),
        AdaptiveKind::Yogi => apply_moments(config, state, global, mean, |v, d2| {
            // Not `f64::signum`, which is 1 at zero: the paper's sign(0) is 0, so v stays
            // put when it already equals delta^2.
            let sign = if v > d2 {
                1.0
            } else if v < d2 {
                -1.0
            } else {
                0.0
            };
            v - (1.0 - beta2) * d2 * sign
        }),
        AdaptiveKind::Adagrad => apply_moments(config, state, global, mean, |v, d2| v + d2),
    }
}

/// One adaptive step with `next_v(v_{t-1}, delta_t^2) = v_t`.
fn apply_moments(
    config: &AdaptiveConfig,
    state: &mut Moments,
    global: &mut ModelVector,
    mean: &ModelVector,
    next_v: impl Fn(f64, f64) -> f64,
) -> Result<(), AggregationError> {
    let lr = f64::from(config.server_lr);
    let beta1 = f64::from(config.beta1);
    let tau = f64::from(config.tau);
    let next = |x: f32, mean: f32, m: f32, v: f32| {
        let x = f64::from(x);
        let delta = f64::from(mean) - x;
        let m = beta1 * f64::from(m) + (1.0 - beta1) * delta;
        let v = next_v(f64::from(v), delta * delta);
        let x = x + lr * m / (v.sqrt() + tau);
        (x as f32, m as f32, v as f32)
    };
    let finite = |(x, m, v): (f32, f32, f32)| x.is_finite() && m.is_finite() && v.is_finite();

    // Check every element before writing any: recomputing is cheaper than a second
    // model-sized buffer, and the arithmetic is deterministic so both passes agree.
    let overflow = global
        .values()
        .iter()
        .zip(mean.values())
        .zip(state.m.iter().zip(&state.v))
        .position(|((&x, &mean), (&m, &v))| !finite(next(x, mean, m, v)));
    if let Some(index) = overflow {
        return Err(AggregationError::NonFiniteResult { index });
    }
    for ((x, &mean), (m, v)) in global
        .values_mut()
        .iter_mut()
        .zip(mean.values())
        .zip(state.m.iter_mut().zip(state.v.iter_mut()))
    {
        (*x, *m, *v) = next(*x, mean, *m, *v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_vector::TensorSpec;
    use serde::de::IntoDeserializer;
    use serde::de::value::{Error as DeError, MapDeserializer};

    /// The example every hand-computed test below starts from.
    const X0: [f32; 3] = [1.0, -2.0, 0.5];
    /// First round's client mean: delta_0 = [0.5, -1, 0.25].
    const MEAN1: [f32; 3] = [1.5, -3.0, 0.75];
    /// Second round's client mean.
    const MEAN2: [f32; 3] = [0.75, -2.5, 0.75];

    fn test_config() -> AdaptiveConfig {
        // tau^2 = 0.25 = 0.5^2, so the first element of the Yogi example hits sign(0).
        AdaptiveConfig::new(0.1, 0.5, 0.75, 0.5).unwrap()
    }

    fn assert_close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(g) - w).abs() < 1e-6,
                "parameter {i}: got {g}, want {w}"
            );
        }
    }

    /// Runs the two rounds and returns the global model after each.
    fn two_steps(opt: &mut ServerOptimizer) -> (Vec<f32>, Vec<f32>) {
        let mut global = ModelVector::from_flat(X0.to_vec());
        let layout = global.layout().clone();
        let mean1 = ModelVector::new(layout.clone(), MEAN1.to_vec()).unwrap();
        let mean2 = ModelVector::new(layout, MEAN2.to_vec()).unwrap();
        opt.step(&mut global, &mean1).unwrap();
        let after1 = global.values().to_vec();
        opt.step(&mut global, &mean2).unwrap();
        (after1, global.into_values())
    }

    #[test]
    fn average_matches_hand_computed_steps() {
        // lr 0.5: x1 = x0 + 0.5 * ([1.5, -3, 0.75] - [1, -2, 0.5]) = [1.25, -2.5, 0.625]
        // x2 = x1 + 0.5 * ([0.75, -2.5, 0.75] - x1) = x1 + 0.5 * [-0.5, 0, 0.125]
        let mut opt = ServerOptimizer::average(0.5).unwrap();
        let (x1, x2) = two_steps(&mut opt);
        assert_eq!(x1, [1.25, -2.5, 0.625]);
        assert_eq!(x2, [1.0, -2.5, 0.6875]);
    }

    #[test]
    fn average_with_unit_lr_returns_exactly_the_mean() {
        // Values whose difference is not exact in f64 would expose x + (mean - x).
        let mut global = ModelVector::from_flat(vec![1e-30, 3.0e38, -7.1, 0.1]);
        let mean = ModelVector::from_flat(vec![1e30, -3.0e38, 2.3e-38, 0.3]);
        let mut opt = ServerOptimizer::average(1.0).unwrap();
        opt.step(&mut global, &mean).unwrap();
        assert_eq!(global.values(), mean.values());
    }

    #[test]
    fn fedadam_matches_hand_computed_steps() {
        // Round 1, delta = [0.5, -1, 0.25], m = 0.5 * delta = [0.25, -0.5, 0.125]
        // v = 0.75 * 0.25 + 0.25 * delta^2 = [0.25, 0.4375, 0.203125]
        // x1 = x0 + 0.1 * m / (sqrt(v) + 0.5)
        //    = [1 + 0.025 / 1.0, -2 - 0.05 / 1.16143783, 0.5 + 0.0125 / 0.95069391]
        // Round 2, delta = mean2 - x1 = [-0.275, -0.45694991, 0.23685171]
        // m = [-0.0125, -0.47847496, 0.18092585], v = [0.20640625, 0.38032581, 0.16636843]
        let mut opt = ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config()).unwrap();
        let (x1, x2) = two_steps(&mut opt);
        assert_close(&x1, &[1.025, -2.043_050_087_4, 0.513_148_290_817]);
        assert_close(
            &x2,
            &[1.023_690_166_197, -2.085_897_096_79, 0.533_076_616_508],
        );
    }

    #[test]
    fn fedyogi_matches_hand_computed_steps() {
        // Round 1, delta = [0.5, -1, 0.25], delta^2 = [0.25, 1, 0.0625], v_prev = 0.25
        // sign(v_prev - delta^2) = [0, -1, 1]
        // v = 0.25 - 0.25 * delta^2 * sign = [0.25, 0.5, 0.234375]
        // x1 = x0 + 0.1 * [0.25, -0.5, 0.125] / (sqrt(v) + 0.5)
        //    = [1 + 0.025 / 1.0, -2 - 0.05 / 1.20710678, 0.5 + 0.0125 / 0.98412292]
        // Round 2, delta = [-0.275, -0.45857864, 0.23729833], sign = [1, 1, 1]
        // m = [-0.0125, -0.47928932, 0.18114917], v = [0.23109375, 0.44742641, 0.22029738]
        let mut opt = ServerOptimizer::adaptive(AdaptiveKind::Yogi, test_config()).unwrap();
        let (x1, x2) = two_steps(&mut opt);
        assert_close(&x1, &[1.025, -2.041_421_356_23, 0.512_701_665_379]);
        assert_close(
            &x2,
            &[1.023_725_428_963, -2.082_424_826_85, 0.531_389_196_625],
        );
    }

    #[test]
    fn fedadagrad_matches_hand_computed_steps() {
        // Round 1, delta = [0.5, -1, 0.25], v = 0.25 + delta^2 = [0.5, 1.25, 0.3125]
        // x1 = x0 + 0.1 * [0.25, -0.5, 0.125] / (sqrt(v) + 0.5)
        //    = [1 + 0.025 / 1.20710678, -2 - 0.05 / 1.61803399, 0.5 + 0.0125 / 1.05901699]
        // Round 2, delta = [-0.27071068, -0.46909830, 0.23819660]
        // m = [-0.01035534, -0.48454915, 0.18159830], v = [0.57328427, 1.47005322, 0.36923762]
        let mut opt = ServerOptimizer::adaptive(AdaptiveKind::Adagrad, test_config()).unwrap();
        let (x1, x2) = two_steps(&mut opt);
        assert_close(
            &x1,
            &[1.020_710_678_118, -2.030_901_699_43, 0.511_803_398_874],
        );
        assert_close(
            &x2,
            &[1.019_886_966_172, -2.059_197_242_37, 0.528_198_327_075],
        );
    }

    #[test]
    fn layout_mismatch_is_an_error_and_changes_nothing() {
        let layout = Arc::new(
            Layout::new(vec![TensorSpec::new("w", [2]), TensorSpec::new("b", [1])]).unwrap(),
        );
        let optimizers = [
            ServerOptimizer::average(0.5).unwrap(),
            ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config()).unwrap(),
        ];
        for mut opt in optimizers {
            let mut global = ModelVector::new(layout.clone(), X0.to_vec()).unwrap();
            let short = ModelVector::from_flat(vec![1.0, 2.0]);
            let renamed = ModelVector::from_flat(MEAN1.to_vec());
            assert_eq!(
                opt.step(&mut global, &short).unwrap_err(),
                AggregationError::LayoutMismatch {
                    expected: 3,
                    found: 2
                }
            );
            assert_eq!(
                opt.step(&mut global, &renamed).unwrap_err(),
                AggregationError::TensorLayoutMismatch { len: 3 }
            );
            assert_eq!(global.values(), &X0);
            assert!(matches!(
                &opt.rule,
                Rule::Average { .. } | Rule::Adaptive { moments: None, .. }
            ));
        }
    }

    #[test]
    fn adaptive_refuses_a_model_other_than_its_moments_until_reset() {
        let mut opt = ServerOptimizer::adaptive(AdaptiveKind::Yogi, test_config()).unwrap();
        let mut global = ModelVector::from_flat(X0.to_vec());
        let mean = ModelVector::new(global.layout().clone(), MEAN1.to_vec()).unwrap();
        opt.step(&mut global, &mean).unwrap();
        let Rule::Adaptive {
            moments: Some(before),
            ..
        } = opt.rule.clone()
        else {
            panic!("first step must create the moments");
        };

        let mut other = ModelVector::from_flat(vec![0.0; 4]);
        let other_mean = ModelVector::from_flat(vec![1.0; 4]);
        assert_eq!(
            opt.step(&mut other, &other_mean).unwrap_err(),
            AggregationError::LayoutMismatch {
                expected: 3,
                found: 4
            }
        );
        assert_eq!(other.values(), &[0.0; 4]);
        let Rule::Adaptive {
            moments: Some(after),
            ..
        } = &opt.rule
        else {
            panic!("a failed step must keep the moments");
        };
        assert_eq!((&after.m, &after.v), (&before.m, &before.v));

        opt.reset();
        opt.step(&mut other, &other_mean).unwrap();
    }

    #[test]
    fn non_finite_mean_is_refused_before_any_change() {
        let mut opt = ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config()).unwrap();
        let mut global = ModelVector::from_flat(X0.to_vec());
        let mean = ModelVector::new(global.layout().clone(), vec![1.0, f32::NAN, 0.0]).unwrap();
        assert_eq!(
            opt.step(&mut global, &mean).unwrap_err(),
            AggregationError::NonFinite { index: 1 }
        );
        assert_eq!(global.values(), &X0);
        assert!(matches!(&opt.rule, Rule::Adaptive { moments: None, .. }));
    }

    #[test]
    fn overflowing_step_is_refused_before_any_change() {
        let mut global = ModelVector::from_flat(vec![0.0, -3.0e38]);
        let mean = ModelVector::new(global.layout().clone(), vec![1.0, 3.0e38]).unwrap();
        let mut opt = ServerOptimizer::average(2.0).unwrap();
        assert_eq!(
            opt.step(&mut global, &mean).unwrap_err(),
            AggregationError::NonFiniteResult { index: 1 }
        );
        assert_eq!(global.values(), &[0.0, -3.0e38]);

        // delta^2 = 3.6e77 does not fit in the f32 moment v.
        let mut opt = ServerOptimizer::adaptive(AdaptiveKind::Adagrad, test_config()).unwrap();
        assert_eq!(
            opt.step(&mut global, &mean).unwrap_err(),
            AggregationError::NonFiniteResult { index: 1 }
        );
        assert_eq!(global.values(), &[0.0, -3.0e38]);
        assert!(matches!(&opt.rule, Rule::Adaptive { moments: None, .. }));
    }

    #[test]
    fn steps_are_deterministic() {
        for kind in [
            AdaptiveKind::Adam,
            AdaptiveKind::Yogi,
            AdaptiveKind::Adagrad,
        ] {
            let config = AdaptiveConfig::default();
            let mut a = ServerOptimizer::adaptive(kind, config).unwrap();
            let mut b = ServerOptimizer::adaptive(kind, config).unwrap();
            assert_eq!(two_steps(&mut a), two_steps(&mut b));
        }
    }

    /// A coordinator restarted between two rounds continues from the state it stored:
    /// the second step of a restored optimizer is bit for bit the uninterrupted one's.
    #[test]
    fn restored_state_continues_the_same_optimizer() {
        for kind in [
            AdaptiveKind::Adam,
            AdaptiveKind::Yogi,
            AdaptiveKind::Adagrad,
        ] {
            let mut uninterrupted = ServerOptimizer::adaptive(kind, test_config()).unwrap();
            let (after1, after2) = two_steps(&mut uninterrupted);

            let mut first = ServerOptimizer::adaptive(kind, test_config()).unwrap();
            assert_eq!(first.state_bytes(), None, "no state before the first step");
            let mut global = ModelVector::from_flat(X0.to_vec());
            let layout = global.layout().clone();
            first
                .step(
                    &mut global,
                    &ModelVector::new(layout.clone(), MEAN1.to_vec()).unwrap(),
                )
                .unwrap();
            assert_eq!(global.values(), after1.as_slice());
            let saved = first.state_bytes().expect("state after a step");

            let mut restarted = ServerOptimizer::adaptive(kind, test_config()).unwrap();
            restarted.restore_state(&layout, &saved).unwrap();
            restarted
                .step(
                    &mut global,
                    &ModelVector::new(layout, MEAN2.to_vec()).unwrap(),
                )
                .unwrap();
            assert_eq!(global.values(), after2.as_slice(), "{kind}");
        }
    }

    /// Without its state a restarted FedAdam would start its moments from zero and
    /// step elsewhere: the test above would not hold by accident.
    #[test]
    fn a_fresh_optimizer_steps_differently_from_a_restored_one() {
        let mut uninterrupted =
            ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config()).unwrap();
        let (after1, after2) = two_steps(&mut uninterrupted);
        let mut global = ModelVector::from_flat(after1);
        let layout = global.layout().clone();
        let mut fresh = ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config()).unwrap();
        fresh
            .step(
                &mut global,
                &ModelVector::new(layout, MEAN2.to_vec()).unwrap(),
            )
            .unwrap();
        assert_ne!(global.values(), after2.as_slice());
    }

    #[test]
    fn state_of_another_rule_config_or_size_is_refused_and_changes_nothing() {
        let mut saved_by = ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config()).unwrap();
        two_steps(&mut saved_by);
        let saved = saved_by.state_bytes().unwrap();
        let layout = ModelVector::from_flat(X0.to_vec()).layout().clone();
        let other_size = ModelVector::from_flat(vec![0.0; 4]).layout().clone();
        let refused = |opt: &mut ServerOptimizer, layout: &Arc<Layout>, bytes: &[u8]| {
            let err = opt.restore_state(layout, bytes).unwrap_err();
            assert!(matches!(err, AggregationError::OptimizerState(_)), "{err}");
            assert_eq!(opt.state_bytes(), None, "a refused restore changes nothing");
        };
        refused(
            &mut ServerOptimizer::adaptive(AdaptiveKind::Yogi, test_config()).unwrap(),
            &layout,
            &saved,
        );
        refused(
            &mut ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config().with_server_lr(0.2))
                .unwrap(),
            &layout,
            &saved,
        );
        let mut adam = ServerOptimizer::adaptive(AdaptiveKind::Adam, test_config()).unwrap();
        refused(&mut adam, &other_size, &saved);
        refused(&mut adam, &layout, &saved[..saved.len() - 1]);
        refused(&mut adam, &layout, &[saved.as_slice(), &[0; 4]].concat());
        refused(&mut adam, &layout, b"not a state");
        let mut nan = saved.clone();
        let at = nan.len() - 4;
        nan[at..].copy_from_slice(&f32::NAN.to_le_bytes());
        refused(&mut adam, &layout, &nan);
        let err = ServerOptimizer::average(1.0)
            .unwrap()
            .restore_state(&layout, &saved)
            .unwrap_err();
        assert!(matches!(err, AggregationError::OptimizerState(_)));
    }

    #[test]
    fn default_config_is_the_documented_one_and_valid() {
        let config = AdaptiveConfig::default();
        assert_eq!(
            (config.server_lr, config.beta1, config.beta2, config.tau),
            (0.01, 0.9, 0.99, 1e-3)
        );
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn config_out_of_range_is_rejected() {
        let d = AdaptiveConfig::default();
        let bad = [
            ("server_lr", d.with_server_lr(0.0)),
            ("server_lr", d.with_server_lr(-0.1)),
            ("server_lr", d.with_server_lr(f32::INFINITY)),
            ("server_lr", d.with_server_lr(f32::NAN)),
            ("beta1", AdaptiveConfig { beta1: 1.0, ..d }),
            ("beta1", AdaptiveConfig { beta1: -0.1, ..d }),
            (
                "beta1",
                AdaptiveConfig {
                    beta1: f32::NAN,
                    ..d
                },
            ),
            ("beta2", AdaptiveConfig { beta2: 1.0, ..d }),
            ("tau", AdaptiveConfig { tau: 0.0, ..d }),
            ("tau", AdaptiveConfig { tau: f32::NAN, ..d }),
        ];
        for (field, config) in bad {
            match config.validate() {
                Err(AggregationError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{config:?}: expected InvalidConfig, got {other:?}"),
            }
            assert!(ServerOptimizer::adaptive(AdaptiveKind::Adam, config).is_err());
        }
        assert!(AdaptiveConfig::new(0.1, 0.0, 0.0, 1e-9).is_ok());
        assert!(ServerOptimizer::average(0.0).is_err());
        assert!(ServerOptimizer::average(f32::NAN).is_err());
    }

    #[test]
    fn partial_config_deserializes_with_defaults() {
        let fields = vec![("server_lr", 0.5_f32), ("tau", 0.25)].into_iter();
        let de = MapDeserializer::<_, DeError>::new(fields);
        let config = AdaptiveConfig::deserialize(de).unwrap();
        assert_eq!(
            config,
            AdaptiveConfig {
                server_lr: 0.5,
                tau: 0.25,
                ..AdaptiveConfig::default()
            }
        );

        let typo = vec![("beta_1", 0.5_f32)].into_iter();
        assert!(AdaptiveConfig::deserialize(MapDeserializer::<_, DeError>::new(typo)).is_err());
    }

    #[test]
    fn adaptive_kind_serializes_as_its_lowercase_name() {
        for kind in [
            AdaptiveKind::Adam,
            AdaptiveKind::Yogi,
            AdaptiveKind::Adagrad,
        ] {
            let de: serde::de::value::StrDeserializer<'_, DeError> =
                kind.name().into_deserializer();
            assert_eq!(AdaptiveKind::deserialize(de), Ok(kind));
        }
    }

    #[test]
    fn name_reports_the_server_rule() {
        let c = AdaptiveConfig::default();
        assert_eq!(ServerOptimizer::average(1.0).unwrap().name(), "average");
        for (kind, name) in [
            (AdaptiveKind::Adam, "adam"),
            (AdaptiveKind::Yogi, "yogi"),
            (AdaptiveKind::Adagrad, "adagrad"),
        ] {
            assert_eq!(ServerOptimizer::adaptive(kind, c).unwrap().name(), name);
        }
    }
}
