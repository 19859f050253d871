//! The straggler model: how long a virtual client takes to train, in simulated seconds.
//!
//! Real federated populations are heterogeneous: a few devices are many times slower
//! than the typical one, and in a synchronous round the slowest selected client holds
//! everybody back. Each client gets one fixed *slowdown* factor, drawn once per run from
//! the chosen distribution (its speed is `1 / slowdown`), and a task takes
//!
//! ```text
//! local_epochs * samples * slowdown * SECONDS_PER_SAMPLE_EPOCH
//! ```
//!
//! simulated seconds. The same model times synchronous rounds and FedBuff, so their
//! simulated clocks compare. Communication time is not modelled: with the small models
//! of a simulation it is dwarfed by the spread in compute.

use std::fmt;
use std::str::FromStr;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use crate::seeds::{Stream, derive_seed};

/// Simulated seconds for one sample of one local epoch on a client of slowdown 1: a
/// device that works through 1,000 samples a second. Only ratios of simulated times
/// matter; the constant just gives them a familiar scale.
pub const SECONDS_PER_SAMPLE_EPOCH: f64 = 1e-3;

/// Slowdowns are kept within `[1 / MAX_SLOWDOWN, MAX_SLOWDOWN]`, so that a heavy tail
/// with a tiny exponent cannot produce an infinite duration (a client a million times
/// slower than the typical one never matters to the outcome anyway).
pub const MAX_SLOWDOWN: f64 = 1e6;

/// The distribution each client's slowdown is drawn from. Written `none`,
/// `lognormal:SIGMA` or `pareto:ALPHA`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum StragglerModel {
    /// Every client has slowdown 1: a task's time is proportional to its work.
    #[default]
    None,
    /// `slowdown = exp(sigma * Z)`, `Z` standard normal: median 1, and with `sigma`
    /// around 1 a long right tail (one client in 40 is over 7 times slower than the
    /// median).
    LogNormal {
        /// Standard deviation of the log slowdown, >= 0.
        sigma: f64,
    },
    /// `slowdown` Pareto with scale 1: `P(slowdown > x) = x^-alpha` for `x >= 1`, so the
    /// fastest clients have slowdown 1 and the tail is heavy (infinite variance for
    /// `alpha <= 2`, infinite mean for `alpha <= 1`).
    Pareto {
        /// Tail exponent, > 0; smaller is heavier.
        alpha: f64,
    },
}

impl StragglerModel {
    /// Checks the parameter; the message names the flag and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            StragglerModel::None => Ok(()),
            StragglerModel::LogNormal { sigma } if sigma.is_finite() && sigma >= 0.0 => Ok(()),
            StragglerModel::LogNormal { sigma } => Err(ConfigError(format!(
                "--straggler lognormal:{sigma}: SIGMA must be a number >= 0"
            ))),
            StragglerModel::Pareto { alpha } if alpha.is_finite() && alpha > 0.0 => Ok(()),
            StragglerModel::Pareto { alpha } => Err(ConfigError(format!(
                "--straggler pareto:{alpha}: ALPHA must be a number > 0"
            ))),
        }
    }

    /// One draw of the slowdown from two independent uniforms in `[0, 1)`.
    fn slowdown(&self, u1: f64, u2: f64) -> f64 {
        // `1 - u` is in (0, 1], so logarithms and negative powers stay finite.
        let (v1, v2) = (1.0 - u1, 1.0 - u2);
        let s = match *self {
            StragglerModel::None => 1.0,
            StragglerModel::LogNormal { sigma } => {
                // Box-Muller: one standard normal from two uniforms.
                let z = (-2.0 * v1.ln()).sqrt() * (std::f64::consts::TAU * v2).cos();
                (sigma * z).exp()
            }
            // Inverse CDF of Pareto(scale 1, alpha).
            StragglerModel::Pareto { alpha } => v1.powf(-1.0 / alpha),
        };
        if s.is_nan() {
            1.0
        } else {
            s.clamp(1.0 / MAX_SLOWDOWN, MAX_SLOWDOWN)
        }
    }
}

impl fmt::Display for StragglerModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StragglerModel::None => f.write_str("none"),
            StragglerModel::LogNormal { sigma } => write!(f, "lognormal:{sigma}"),
            StragglerModel::Pareto { alpha } => write!(f, "pareto:{alpha}"),
        }
    }
}

impl FromStr for StragglerModel {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let lower = text.trim().to_ascii_lowercase();
        let (name, value) = match lower.split_once(':') {
            Some((name, value)) => (name, Some(value.trim())),
            None => (lower.as_str(), None),
        };
        let number = |v: Option<&str>, what: &str| {
            v.and_then(|v| v.parse::<f64>().ok()).ok_or_else(|| {
                ConfigError(format!(
                    "invalid straggler model `{text}`: expected {name}:{what} with a number"
                ))
            })
        };
        let model = match (name, value) {
            ("none", None) => StragglerModel::None,
            ("lognormal", v) => StragglerModel::LogNormal {
                sigma: number(v, "SIGMA")?,
            },
            ("pareto", v) => StragglerModel::Pareto {
                alpha: number(v, "ALPHA")?,
            },
            _ => {
                return Err(ConfigError(format!(
                    "unknown straggler model `{text}`: expected none, lognormal:SIGMA or pareto:ALPHA"
                )));
            }
        };
        model.validate()?;
        Ok(model)
    }
}

impl Serialize for StragglerModel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for StragglerModel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Every client's slowdown for one run, drawn from the run seed.
#[derive(Debug, Clone, PartialEq)]
pub struct Stragglers {
    slowdown: Vec<f64>,
}

impl Stragglers {
    /// Draws one slowdown per client. Each client's draw has its own seed stream, so a
    /// client's speed does not change when the number of clients does.
    pub fn new(model: StragglerModel, clients: usize, seed: u64) -> Self {
        let slowdown = (0..clients as u64)
            .map(|client| {
                let mut rng =
                    ChaCha8Rng::seed_from_u64(derive_seed(seed, Stream::Straggler, 0, client));
                model.slowdown(rng.random::<f64>(), rng.random::<f64>())
            })
            .collect();
        Self { slowdown }
    }

    /// Client `client`'s slowdown (1 for a client outside the run).
    pub fn slowdown(&self, client: usize) -> f64 {
        self.slowdown.get(client).copied().unwrap_or(1.0)
    }

    /// Simulated seconds for `client` to train `epochs` epochs over `samples` samples.
    pub fn task_seconds(&self, client: usize, samples: usize, epochs: u32) -> f64 {
        f64::from(epochs) * samples as f64 * self.slowdown(client) * SECONDS_PER_SAMPLE_EPOCH
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantile(mut xs: Vec<f64>, q: f64) -> f64 {
        xs.sort_by(f64::total_cmp);
        xs[((xs.len() - 1) as f64 * q).round() as usize]
    }

    #[test]
    fn models_parse_print_and_reject_bad_parameters() {
        for text in ["none", "lognormal:1", "lognormal:0.5", "pareto:1.5"] {
            let model: StragglerModel = text.parse().unwrap();
            assert_eq!(model.to_string(), text);
        }
        assert_eq!(
            " Pareto:2 ".parse::<StragglerModel>().unwrap(),
            StragglerModel::Pareto { alpha: 2.0 }
        );
        for (bad, needle) in [
            ("pareto:0", "ALPHA"),
            ("pareto:-1", "ALPHA"),
            ("pareto", "pareto:ALPHA"),
            ("pareto:x", "pareto:ALPHA"),
            ("lognormal:-0.5", "SIGMA"),
            ("lognormal:inf", "SIGMA"),
            ("weibull:2", "unknown straggler model"),
            ("none:1", "unknown straggler model"),
            ("", "unknown straggler model"),
        ] {
            let err = bad.parse::<StragglerModel>().unwrap_err().0;
            assert!(err.contains(needle), "`{bad}`: `{err}` lacks `{needle}`");
        }
    }

    #[test]
    fn none_gives_every_client_unit_speed() {
        let s = Stragglers::new(StragglerModel::None, 50, 3);
        assert!((0..50).all(|c| s.slowdown(c) == 1.0));
        assert_eq!(s.task_seconds(7, 20, 5), 100.0 * SECONDS_PER_SAMPLE_EPOCH);
    }

    #[test]
    fn lognormal_has_median_one_and_the_right_spread() {
        let sigma = 1.0;
        let s = Stragglers::new(StragglerModel::LogNormal { sigma }, 20_000, 1);
        let logs: Vec<f64> = (0..20_000).map(|c| s.slowdown(c).ln()).collect();
        let mean = logs.iter().sum::<f64>() / logs.len() as f64;
        let var = logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / logs.len() as f64;
        // Standard errors: 0.007 for the mean, about 0.01 for the standard deviation.
        assert!(mean.abs() < 0.04, "mean log slowdown {mean}");
        assert!((var.sqrt() - sigma).abs() < 0.05, "sd {}", var.sqrt());
        assert!((quantile(logs, 0.5)).abs() < 0.04);
    }

    #[test]
    fn pareto_has_scale_one_and_a_heavy_tail() {
        let alpha = 1.5;
        let n = 20_000;
        let s = Stragglers::new(StragglerModel::Pareto { alpha }, n, 2);
        let xs: Vec<f64> = (0..n).map(|c| s.slowdown(c)).collect();
        assert!(xs.iter().all(|&x| x >= 1.0));
        // P(X > x) = x^-alpha: the median is 2^(1/alpha), the 99th percentile 100^(1/alpha).
        let median = quantile(xs.clone(), 0.5);
        assert!(
            (median / 2f64.powf(1.0 / alpha) - 1.0).abs() < 0.03,
            "median {median}"
        );
        let p99 = quantile(xs.clone(), 0.99);
        assert!(
            (p99 / 100f64.powf(1.0 / alpha) - 1.0).abs() < 0.15,
            "99th percentile {p99}"
        );
        // Heavy-tailed: the slowest of 20 is far above the median.
        let max20 = xs[..20].iter().copied().fold(0.0, f64::max);
        assert!(max20 > 2.0 * median, "{max20}");
    }

    #[test]
    fn draws_are_reproducible_per_seed_and_per_client() {
        let model = StragglerModel::Pareto { alpha: 1.5 };
        let a = Stragglers::new(model, 100, 9);
        assert_eq!(a, Stragglers::new(model, 100, 9));
        assert_ne!(a, Stragglers::new(model, 100, 10));
        // A client's speed does not depend on how many clients there are.
        let b = Stragglers::new(model, 30, 9);
        assert!((0..30).all(|c| a.slowdown(c) == b.slowdown(c)));
    }

    #[test]
    fn extreme_parameters_stay_finite() {
        for model in [
            StragglerModel::Pareto { alpha: 1e-3 },
            StragglerModel::LogNormal { sigma: 1e3 },
        ] {
            let s = Stragglers::new(model, 1000, 4);
            assert!((0..1000).all(|c| {
                let x = s.slowdown(c);
                x.is_finite() && (1.0 / MAX_SLOWDOWN..=MAX_SLOWDOWN).contains(&x)
            }));
        }
        assert_eq!(
            StragglerModel::Pareto { alpha: 1.0 }.slowdown(0.0, 0.0),
            1.0
        );
    }
}
