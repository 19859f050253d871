//! The named federated strategies a user picks from.
//!
//! A strategy is written as a short string (`fedavg`, `fedprox:0.01`, `fedadam`, ...)
//! on the command line, in config files and on the wire, so [`Display`](fmt::Display),
//! [`FromStr`] and serde all use that one form.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::fedavg::AggregationError;
use crate::server_optimizer::{AdaptiveConfig, AdaptiveKind, ServerOptimizer};

/// The accepted spellings, for error messages.
const ACCEPTED: &str = "fedavg, fedprox:MU, fedadam, fedyogi or fedadagrad";

/// A federated learning strategy: what clients optimise and how the server combines them.
///
/// Adaptive strategies carry no hyperparameters, so the string form stays short; build a
/// tuned optimizer from [`adaptive_kind`](Self::adaptive_kind) and
/// [`ServerOptimizer::adaptive`] when the defaults do not fit.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Strategy {
    /// Federated averaging (McMahan et al. 2017).
    #[default]
    FedAvg,
    /// FedProx (Li et al. 2020): clients add `mu / 2 * ||w - w_global||^2` to their loss;
    /// the server averages as FedAvg does.
    FedProx {
        /// Proximal coefficient; finite and >= 0.
        mu: f32,
    },
    /// FedAvg clients with an Adam server optimizer (Reddi et al. 2021).
    FedAdam,
    /// FedAvg clients with a Yogi server optimizer (Reddi et al. 2021).
    FedYogi,
    /// FedAvg clients with an Adagrad server optimizer (Reddi et al. 2021).
    FedAdagrad,
}

/// Why a strategy string was not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StrategyParseError {
    /// Not a strategy name at all.
    #[error("unknown strategy `{input}`: expected {ACCEPTED}")]
    Unknown {
        /// The text given, trimmed.
        input: String,
    },
    /// `fedprox` without its `:MU`.
    #[error(
        "strategy `{input}` is missing the proximal coefficient mu: \
         expected fedprox:MU with MU a finite number >= 0, e.g. fedprox:0.01"
    )]
    MissingMu {
        /// The text given, trimmed.
        input: String,
    },
    /// The `MU` of `fedprox:MU` is not a finite number >= 0.
    #[error(
        "invalid FedProx mu `{mu}` in `{input}`: expected a finite number >= 0, e.g. fedprox:0.01"
    )]
    InvalidMu {
        /// The text given, trimmed.
        input: String,
        /// The part after the colon.
        mu: String,
    },
    /// A strategy other than FedProx was given a `:` parameter.
    #[error("strategy `{input}` takes no parameter: expected {ACCEPTED}")]
    UnexpectedParameter {
        /// The text given, trimmed.
        input: String,
    },
}

impl Strategy {
    /// FedProx with proximal coefficient `mu`; fails unless `mu` is finite and >= 0.
    pub fn fedprox(mu: f32) -> Result<Self, StrategyParseError> {
        checked_mu(mu).ok_or_else(|| StrategyParseError::InvalidMu {
            input: format!("fedprox:{mu}"),
            mu: mu.to_string(),
        })
    }

    /// The lower-case name without parameters: `fedavg`, `fedprox`, `fedadam`, `fedyogi`
    /// or `fedadagrad`.
    pub fn name(&self) -> &'static str {
        match self {
            Strategy::FedAvg => "fedavg",
            Strategy::FedProx { .. } => "fedprox",
            Strategy::FedAdam => "fedadam",
            Strategy::FedYogi => "fedyogi",
            Strategy::FedAdagrad => "fedadagrad",
        }
    }

    /// The proximal coefficient clients must apply; `Some` only for FedProx.
    pub fn proximal_mu(&self) -> Option<f32> {
        match self {
            Strategy::FedProx { mu } => Some(*mu),
            _ => None,
        }
    }

    /// The server's adaptive rule; `None` for FedAvg and FedProx, which plainly average.
    pub fn adaptive_kind(&self) -> Option<AdaptiveKind> {
        match self {
            Strategy::FedAvg | Strategy::FedProx { .. } => None,
            Strategy::FedAdam => Some(AdaptiveKind::Adam),
            Strategy::FedYogi => Some(AdaptiveKind::Yogi),
            Strategy::FedAdagrad => Some(AdaptiveKind::Adagrad),
        }
    }

    /// The server optimizer for this strategy.
    ///
    /// `server_lr` `None` takes the default: 1.0 for FedAvg and FedProx (the next global
    /// model is the clients' mean), [`AdaptiveConfig::default`]'s for the adaptive ones,
    /// whose other hyperparameters are the defaults too. Fails when `server_lr` is not
    /// finite and > 0.
    pub fn server_optimizer(
        &self,
        server_lr: Option<f32>,
    ) -> Result<ServerOptimizer, AggregationError> {
        match self.adaptive_kind() {
            None => ServerOptimizer::average(server_lr.unwrap_or(1.0)),
            Some(kind) => {
                let defaults = AdaptiveConfig::default();
                let config = defaults.with_server_lr(server_lr.unwrap_or(defaults.server_lr));
                ServerOptimizer::adaptive(kind, config)
            }
        }
    }
}

/// `mu` if it is finite and >= 0, with -0 turned into 0 so it prints as `0`.
fn checked_mu(mu: f32) -> Option<Strategy> {
    (mu.is_finite() && mu >= 0.0).then(|| Strategy::FedProx { mu: mu.abs() })
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // `f32`'s Display prints the shortest digits that parse back to the same value.
            Strategy::FedProx { mu } => write!(f, "fedprox:{mu}"),
            other => f.write_str(other.name()),
        }
    }
}

impl FromStr for Strategy {
    type Err = StrategyParseError;

    /// Parses `fedavg`, `fedprox:MU`, `fedadam`, `fedyogi` or `fedadagrad`, ignoring case
    /// and surrounding whitespace.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let input = s.trim();
        let lower = input.to_ascii_lowercase();
        let (name, param) = match lower.split_once(':') {
            Some((name, param)) => (name, Some(param)),
            None => (lower.as_str(), None),
        };
        let plain = match name {
            "fedavg" => Strategy::FedAvg,
            "fedadam" => Strategy::FedAdam,
            "fedyogi" => Strategy::FedYogi,
            "fedadagrad" => Strategy::FedAdagrad,
            "fedprox" => {
                return match param {
                    None | Some("") => Err(StrategyParseError::MissingMu {
                        input: input.to_owned(),
                    }),
                    Some(mu) => mu.parse().ok().and_then(checked_mu).ok_or_else(|| {
                        StrategyParseError::InvalidMu {
                            input: input.to_owned(),
                            // Slice the original so the message shows what was typed.
                            mu: input[name.len() + 1..].to_owned(),
                        }
                    }),
                };
            }
            _ => {
                return Err(StrategyParseError::Unknown {
                    input: input.to_owned(),
                });
            }
        };
        match param {
            None => Ok(plain),
            Some(_) => Err(StrategyParseError::UnexpectedParameter {
                input: input.to_owned(),
            }),
        }
    }
}

impl TryFrom<String> for Strategy {
    type Error = StrategyParseError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Strategy> for String {
    fn from(strategy: Strategy) -> Self {
        strategy.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::{prop_assert_eq, proptest};
    use serde::de::IntoDeserializer;
    use serde::de::value::{Error as DeError, StrDeserializer};

    const ALL: [Strategy; 6] = [
        Strategy::FedAvg,
        Strategy::FedProx { mu: 0.01 },
        Strategy::FedProx { mu: 0.0 },
        Strategy::FedAdam,
        Strategy::FedYogi,
        Strategy::FedAdagrad,
    ];

    fn parse(s: &str) -> Result<Strategy, StrategyParseError> {
        s.parse()
    }

    #[test]
    fn display_round_trips_through_from_str() {
        for strategy in ALL {
            let text = strategy.to_string();
            assert_eq!(parse(&text), Ok(strategy), "{text}");
        }
        assert_eq!(Strategy::FedProx { mu: 0.01 }.to_string(), "fedprox:0.01");
        assert_eq!(Strategy::FedAdagrad.to_string(), "fedadagrad");
    }

    proptest! {
        #[test]
        fn any_valid_mu_round_trips(mu in 0.0_f32..f32::MAX) {
            let strategy = Strategy::fedprox(mu).unwrap();
            prop_assert_eq!(parse(&strategy.to_string()), Ok(strategy));
        }
    }

    #[test]
    fn parsing_ignores_case_and_surrounding_whitespace() {
        assert_eq!(parse("  FedAvg\n"), Ok(Strategy::FedAvg));
        assert_eq!(parse("FEDYOGI"), Ok(Strategy::FedYogi));
        assert_eq!(parse("\tFedProx:1E-2 "), Ok(Strategy::FedProx { mu: 0.01 }));
    }

    #[test]
    fn negative_zero_mu_becomes_zero() {
        let strategy = parse("fedprox:-0").unwrap();
        assert_eq!(strategy.to_string(), "fedprox:0");
        assert_eq!(Strategy::fedprox(-0.0).unwrap().to_string(), "fedprox:0");
    }

    #[test]
    fn fedprox_without_mu_says_the_mu_is_missing() {
        for input in ["fedprox", "FedProx:"] {
            let err = parse(input).unwrap_err();
            assert_eq!(
                err,
                StrategyParseError::MissingMu {
                    input: input.into()
                }
            );
            assert!(
                err.to_string()
                    .contains("missing the proximal coefficient mu")
            );
        }
    }

    #[test]
    fn fedprox_with_invalid_mu_names_the_mu() {
        for (input, mu) in [
            ("fedprox:-1", "-1"),
            ("fedprox:nan", "nan"),
            ("fedprox:NaN", "NaN"),
            ("fedprox:inf", "inf"),
            ("fedprox:1e39", "1e39"),
            ("fedprox:abc", "abc"),
            ("fedprox: 0.1", " 0.1"),
        ] {
            let err = parse(input).unwrap_err();
            assert_eq!(
                err,
                StrategyParseError::InvalidMu {
                    input: input.into(),
                    mu: mu.into()
                }
            );
            assert!(err.to_string().contains(&format!("`{mu}`")), "{err}");
        }
        assert!(Strategy::fedprox(-1.0).is_err());
        assert!(Strategy::fedprox(f32::NAN).is_err());
    }

    #[test]
    fn unknown_strategy_lists_the_accepted_forms() {
        let err = parse(" bogus ").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown strategy `bogus`: expected fedavg, fedprox:MU, fedadam, fedyogi or fedadagrad"
        );
        assert!(matches!(parse(""), Err(StrategyParseError::Unknown { .. })));
        assert!(matches!(
            parse("fedfoo:1"),
            Err(StrategyParseError::Unknown { .. })
        ));
    }

    #[test]
    fn parameter_on_a_plain_strategy_is_an_error() {
        let err = parse("fedavg:0.1").unwrap_err();
        assert_eq!(
            err,
            StrategyParseError::UnexpectedParameter {
                input: "fedavg:0.1".into()
            }
        );
        assert!(err.to_string().contains(ACCEPTED));
    }

    #[test]
    fn serde_uses_the_string_form() {
        for strategy in ALL {
            let text = String::from(strategy);
            let de: StrDeserializer<'_, DeError> = text.as_str().into_deserializer();
            assert_eq!(Strategy::deserialize(de), Ok(strategy));
        }
        let de: StrDeserializer<'_, DeError> = "fedprox".into_deserializer();
        let err = Strategy::deserialize(de).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn only_fedprox_has_a_proximal_mu() {
        assert_eq!(Strategy::FedProx { mu: 0.5 }.proximal_mu(), Some(0.5));
        for strategy in [
            Strategy::FedAvg,
            Strategy::FedAdam,
            Strategy::FedYogi,
            Strategy::FedAdagrad,
        ] {
            assert_eq!(strategy.proximal_mu(), None);
        }
    }

    #[test]
    fn server_optimizer_defaults_per_strategy() {
        let adaptive_lr = AdaptiveConfig::default().server_lr;
        for (strategy, name, lr) in [
            (Strategy::FedAvg, "average", 1.0),
            (Strategy::FedProx { mu: 0.1 }, "average", 1.0),
            (Strategy::FedAdam, "adam", adaptive_lr),
            (Strategy::FedYogi, "yogi", adaptive_lr),
            (Strategy::FedAdagrad, "adagrad", adaptive_lr),
        ] {
            let opt = strategy.server_optimizer(None).unwrap();
            assert_eq!((opt.name(), opt.server_lr()), (name, lr), "{strategy}");
            let tuned = strategy.server_optimizer(Some(0.3)).unwrap();
            assert_eq!(tuned.server_lr(), 0.3);
            assert!(strategy.server_optimizer(Some(0.0)).is_err());
            assert!(strategy.server_optimizer(Some(f32::NAN)).is_err());
        }
    }
}
