//! The settings of a simulation run: parsed from a TOML file and command-line flags,
//! checked once before any work starts.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use cohort_aggregation::Strategy;
use cohort_aggregation::secagg::{self, Stage};
use cohort_edge::model::ModelKind;
use cohort_edge::partition::PartitionScheme;
use serde::{Deserialize, Serialize};

use super::straggler::StragglerModel;
use cohort_core::privacy::BudgetAgainst;

/// Which data a simulation trains on.
#[derive(Debug, Clone, PartialEq)]
pub enum DatasetSpec {
    /// The shipped UCI handwritten digits (1,797 samples, 64 features, 10 classes).
    Digits,
    /// The shipped UCI breast cancer Wisconsin diagnostic set (569 samples, 30 features).
    BreastCancer,
    /// The shipped 10,000 MNIST images (784 features); its fixed split (the first 8,000
    /// rows train, the last 2,000 test) replaces `test-fraction`.
    Mnist10k,
    /// FedProx Synthetic(alpha, beta), naturally split over one device per client.
    Synthetic {
        /// How much the devices' models differ.
        alpha: f64,
        /// How much the devices' data differ.
        beta: f64,
    },
    /// A CSV file (plain or gzip) with a header row and a `label` column.
    Csv(PathBuf),
}

pub use super::ConfigError;

impl FromStr for DatasetSpec {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let t = text.trim();
        match t.to_ascii_lowercase().as_str() {
            "digits" => return Ok(DatasetSpec::Digits),
            "mnist10k" => return Ok(DatasetSpec::Mnist10k),
            "breast-cancer" | "breast_cancer" => return Ok(DatasetSpec::BreastCancer),
            _ => {}
        }
        if let Some(params) = t.to_ascii_lowercase().strip_prefix("synthetic:") {
            let parts: Vec<&str> = params.split(',').map(str::trim).collect();
            let parse = |s: &str| s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
            return match parts.as_slice() {
                [a, b] => match (parse(a), parse(b)) {
                    (Some(alpha), Some(beta)) => Ok(DatasetSpec::Synthetic { alpha, beta }),
                    _ => Err(ConfigError(format!(
                        "invalid dataset `{t}`: alpha and beta must be numbers >= 0"
                    ))),
                },
                _ => Err(ConfigError(format!(
                    "invalid dataset `{t}`: expected synthetic:ALPHA,BETA"
                ))),
            };
        }
        if t.is_empty() {
            return Err(ConfigError(
                "empty dataset: expected digits, breast-cancer, synthetic:ALPHA,BETA or a CSV path"
                    .into(),
            ));
        }
        Ok(DatasetSpec::Csv(PathBuf::from(t)))
    }
}

impl fmt::Display for DatasetSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatasetSpec::Digits => f.write_str("digits"),
            DatasetSpec::Mnist10k => f.write_str("mnist10k"),
            DatasetSpec::BreastCancer => f.write_str("breast-cancer"),
            DatasetSpec::Synthetic { alpha, beta } => write!(f, "synthetic:{alpha},{beta}"),
            DatasetSpec::Csv(path) => write!(f, "{}", path.display()),
        }
    }
}

impl Serialize for DatasetSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DatasetSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Every setting of a simulation run. Field names are the command-line flags; a TOML
/// `--config` file uses the same keys (`clients-per-round = 10`, or `clients_per_round`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct SimulationConfig {
    /// Data set to train on.
    pub dataset: DatasetSpec,
    /// Model family and shape.
    pub model: ModelKind,
    /// Number of virtual clients the training data is split over.
    pub clients: usize,
    /// Clients selected per round; `None` selects every client.
    #[serde(alias = "clients_per_round", skip_serializing_if = "Option::is_none")]
    pub clients_per_round: Option<usize>,
    /// Minimum reports for a round to count.
    #[serde(alias = "min_participants")]
    pub min_participants: usize,
    /// Number of rounds.
    pub rounds: u32,
    /// How the training data is split over clients; `None` means `natural` for data that
    /// comes already federated (synthetic) and `dirichlet:0.5` otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<PartitionScheme>,
    /// Federated strategy.
    pub strategy: Strategy,
    /// Server learning rate; `None` takes the strategy's default.
    #[serde(alias = "server_lr", skip_serializing_if = "Option::is_none")]
    pub server_lr: Option<f64>,
    /// Local epochs per round.
    #[serde(alias = "local_epochs")]
    pub local_epochs: u32,
    /// Local mini-batch size.
    #[serde(alias = "batch_size")]
    pub batch_size: usize,
    /// Local SGD learning rate.
    pub lr: f64,
    /// Local SGD momentum.
    pub momentum: f64,
    /// Local L2 weight decay.
    #[serde(alias = "weight_decay")]
    pub weight_decay: f64,
    /// Probability that a selected client drops out (at `dropout-stage`).
    pub dropout: f64,
    /// With secure aggregation, the protocol stage at which dropping clients stop:
    /// `advertise`, `share`, `masked` or `unmask`. Without it only `masked` (the client
    /// never uploads) applies.
    #[serde(alias = "dropout_stage", with = "stage_text")]
    pub dropout_stage: Stage,
    /// Combine updates with secure aggregation (SecAgg+): the server sees only the sum.
    #[serde(alias = "secure_aggregation")]
    pub secure_aggregation: bool,
    /// Secure aggregation: shares needed to rebuild a client's secrets; `None` is just
    /// over half the neighbours.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threshold: Option<usize>,
    /// Secure aggregation: neighbours per client; `None` sizes it for 10% dropout (20
    /// for 100 clients per round).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub neighbours: Option<usize>,
    /// Secure aggregation: each update coordinate is clipped to `[-clip, clip]` before
    /// quantisation.
    pub clip: f32,
    /// Secure aggregation: sample counts above this count as this; `None` is the largest
    /// client's sample count, so no weight is capped.
    #[serde(alias = "max_weight", skip_serializing_if = "Option::is_none")]
    pub max_weight: Option<u32>,
    /// Compression of the clients' uploads: `none`, `quantize:B` (B = 1, 2, 4, 8), `sign`
    /// or `topk:F` (plain rounds); see [`cohort_aggregation::compress`].
    pub compress_up: cohort_aggregation::compress::Compression,
    /// Compression of the model each client downloads: `none` or `quantize:B`.
    pub compress_down: cohort_aggregation::compress::Compression,
    /// Secure aggregation with `compress_up = quantize:B`: the masked words' width (8, 16
    /// or 32); `None` is the narrowest that holds the round's sum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub word_bits: Option<u32>,
    /// Personalisation: `fedper:LAYERS`, `fedrep:LAYERS`, `ditto:LAMBDA` or
    /// `finetune:EPOCHS` (built-in models; see [`cohort_edge::personal`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub personalise: Option<cohort_edge::personal::Personalisation>,
    /// Fraction of each client's data it holds out to score the global (and its
    /// personalised) model on; `None` is 0.2 with `personalise`, else 0 (off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_holdout: Option<f64>,
    /// Where aggregation runs: `auto` (the GPU when one is usable), `cpu` or `cuda`.
    pub reducer: cohort_aggregation::reduce::ReducerChoice,
    /// Fraction of the data held out as the global test set.
    #[serde(alias = "test_fraction")]
    pub test_fraction: f64,
    /// A robust aggregation rule instead of the weighted mean (`median`,
    /// `trimmed-mean:BETA`, `krum:F`, `multi-krum:F:M`); plaintext rounds only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aggregator: Option<cohort_aggregation::robust::RobustRule>,
    /// Fraction of the clients that are malicious (chosen once per run from the seed);
    /// their updates are replaced as `attack` says.
    pub malicious: f64,
    /// What a malicious client sends instead of its honest update.
    pub attack: Attack,
    /// Central differential privacy (DP-FedAvg): each round samples every client with
    /// probability `clients_per_round / clients` (Poisson), clips each update to L2 norm
    /// `dp_clip`, and adds Gaussian noise of standard deviation `dp_noise_multiplier *
    /// dp_clip` to the sum; `None` is off. With `secure_aggregation` the noise is
    /// distributed instead: each client adds its share of Skellam noise before masking,
    /// so the coordinator never sees an un-noised sum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_noise_multiplier: Option<f64>,
    /// Differential privacy: the L2 bound on each client's update.
    pub dp_clip: f32,
    /// Differential privacy: the delta epsilon is reported at.
    pub dp_delta: f64,
    /// Differential privacy: the budget; the run stops before a round that would spend
    /// more. `None` is no limit (epsilon is still reported).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_epsilon: Option<f64>,
    /// Differential privacy: whom `dp_epsilon` is enforced against: `observers` of the
    /// published models (epsilon amplified by sampling) or the `coordinator`, which
    /// knows who was sampled (the worst sampled client's own rounds, unamplified;
    /// needs secure aggregation). Both figures are reported either way.
    #[serde(skip_serializing_if = "BudgetAgainst::is_observers")]
    pub dp_budget_against: BudgetAgainst,
    /// Differential privacy: when set, the clip starts at `dp_clip` and tracks this
    /// quantile of the clients' update norms (Andrew et al. 2021, geometric step 0.2),
    /// from a noised count of the clients within it. Central noise only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_clip_quantile: Option<f64>,
    /// Differential privacy with an adaptive clip: standard deviation of the noise on the
    /// count of clients within the clip; `None` is the paper's expected clients / 20.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_clip_count_noise: Option<f64>,
    /// How clients and the server take turns: synchronous rounds, or FedBuff's buffered
    /// asynchronous aggregation.
    pub mode: Mode,
    /// The distribution of client slowdowns that sets the simulated clock (`none`,
    /// `lognormal:SIGMA`, `pareto:ALPHA`); used by both modes.
    pub straggler: StragglerModel,
    /// FedBuff: client updates per server step (K); `None` is 10.
    #[serde(alias = "buffer_size", skip_serializing_if = "Option::is_none")]
    pub buffer_size: Option<usize>,
    /// FedBuff: clients training at any moment; `None` is the clients per round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    /// FedBuff: an update `tau` server steps stale is weighted `1 / (1 + tau)^A`; `None`
    /// is 0.5.
    #[serde(alias = "staleness_exponent", skip_serializing_if = "Option::is_none")]
    pub staleness_exponent: Option<f64>,
    /// Test accuracy whose first attainment `summary.json` reports (round, simulated
    /// seconds, client updates); `None` reports nothing.
    #[serde(alias = "target_accuracy", skip_serializing_if = "Option::is_none")]
    pub target_accuracy: Option<f64>,
    /// Seed for every random choice in the run.
    pub seed: u64,
    /// Output directory; `None` picks `runs/simulate-<timestamp>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out: Option<PathBuf>,
    /// Also write TensorBoard event files into this directory (one run per strategy,
    /// `DIR/<strategy>/`), round by round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensorboard: Option<PathBuf>,
    /// Also report the run to this MLflow tracking server: its settings as parameters,
    /// every round's metrics, the final model as an artifact (one run per strategy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow_uri: Option<String>,
    /// The MLflow experiment the runs go into; `None` is `cohort-simulate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow_experiment: Option<String>,
}

impl Default for SimulationConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetSpec::Digits,
            model: ModelKind::Mlp {
                hidden: cohort_edge::model::DEFAULT_MLP_HIDDEN.to_vec(),
            },
            clients: 50,
            clients_per_round: None,
            min_participants: 1,
            rounds: 40,
            partition: None,
            strategy: Strategy::FedAvg,
            server_lr: None,
            local_epochs: 5,
            batch_size: 16,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 1e-4,
            dropout: 0.0,
            dropout_stage: Stage::Masked,
            secure_aggregation: false,
            threshold: None,
            neighbours: None,
            clip: secagg::QuantizationParams::default().clip,
            max_weight: None,
            compress_up: cohort_aggregation::compress::Compression::None,
            compress_down: cohort_aggregation::compress::Compression::None,
            word_bits: None,
            personalise: None,
            client_holdout: None,
            reducer: cohort_aggregation::reduce::ReducerChoice::Auto,
            test_fraction: 0.2,
            aggregator: None,
            malicious: 0.0,
            attack: Attack::SignFlip { scale: 4.0 },
            dp_noise_multiplier: None,
            dp_clip: 1.0,
            dp_delta: 1e-5,
            dp_epsilon: None,
            dp_budget_against: BudgetAgainst::Observers,
            dp_clip_quantile: None,
            dp_clip_count_noise: None,
            mode: Mode::Sync,
            straggler: StragglerModel::None,
            buffer_size: None,
            concurrency: None,
            staleness_exponent: None,
            target_accuracy: None,
            seed: 0,
            out: None,
            tensorboard: None,
            mlflow_uri: None,
            mlflow_experiment: None,
        }
    }
}

impl SimulationConfig {
    /// Reads a TOML file; keys missing from it keep their defaults.
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("cannot read config `{}`: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| {
            let msg = e.message().to_string();
            let line = e
                .span()
                .map(|span| text[..span.start.min(text.len())].lines().count().max(1));
            match line {
                Some(line) => ConfigError(format!(
                    "invalid config `{}` line {line}: {msg}",
                    path.display()
                )),
                None => ConfigError(format!("invalid config `{}`: {msg}", path.display())),
            }
        })
    }

    /// The partition scheme in effect, with the default filled in.
    pub fn partition_scheme(&self) -> PartitionScheme {
        self.partition.unwrap_or(match self.dataset {
            DatasetSpec::Synthetic { .. } => PartitionScheme::Natural,
            _ => PartitionScheme::Dirichlet { alpha: 0.5 },
        })
    }

    /// The configuration with every default filled in, as recorded in `summary.json`.
    pub fn resolved(&self) -> SimulationConfig {
        let (neighbours, threshold) = if self.secure_aggregation {
            let (k, t) = self.secure_graph();
            (Some(k), Some(t))
        } else {
            (self.neighbours, self.threshold)
        };
        let fedbuff = self.mode == Mode::Fedbuff;
        SimulationConfig {
            partition: Some(self.partition_scheme()),
            clients_per_round: Some(self.clients_per_round()),
            neighbours,
            threshold,
            buffer_size: fedbuff.then(|| self.buffer_size()),
            concurrency: fedbuff.then(|| self.concurrency()),
            staleness_exponent: fedbuff.then(|| self.staleness_exponent()),
            ..self.clone()
        }
    }

    /// FedBuff: client updates per server step, with the default filled in.
    pub fn buffer_size(&self) -> usize {
        self.buffer_size.unwrap_or(DEFAULT_BUFFER_SIZE)
    }

    /// FedBuff: clients training at once, with the default (the clients per round)
    /// filled in.
    pub fn concurrency(&self) -> usize {
        self.concurrency.unwrap_or_else(|| self.clients_per_round())
    }

    /// FedBuff: the staleness exponent, with the default filled in.
    pub fn staleness_exponent(&self) -> f64 {
        self.staleness_exponent
            .unwrap_or(DEFAULT_STALENESS_EXPONENT)
    }

    /// Secure aggregation's neighbours and threshold for the clients selected per round,
    /// defaults filled in.
    pub fn secure_graph(&self) -> (usize, usize) {
        let n = self.clients_per_round();
        let k = self
            .neighbours
            .unwrap_or_else(|| secagg::default_neighbours(n));
        let t = self
            .threshold
            .unwrap_or_else(|| secagg::default_threshold(n, k));
        (k, t)
    }

    /// Clients selected per round, with the default filled in.
    /// Differential privacy's sampling rate: `clients_per_round / clients`.
    pub fn sampling_rate(&self) -> f64 {
        self.clients_per_round() as f64 / self.clients.max(1) as f64
    }

    /// With an adaptive clip: the noise on the clipped count (`sigma_b`) and the noise
    /// multiplier left for the update (`z_delta`) so that the round as a whole is the
    /// Gaussian mechanism at `dp_noise_multiplier` (Andrew et al. 2021, Theorem 1:
    /// `z = (z_delta^-2 + (2 sigma_b)^-2)^-1/2`).
    pub fn adaptive_clip_noise(&self) -> Result<(f64, f64), ConfigError> {
        let z = self.dp_noise_multiplier.unwrap_or(0.0);
        let expected = self.sampling_rate() * self.clients as f64;
        let sigma_b = self.dp_clip_count_noise.unwrap_or(expected / 20.0);
        if !(sigma_b.is_finite() && sigma_b > 0.0) {
            return Err(ConfigError(format!(
                "--dp-clip-count-noise must be > 0, got {sigma_b}"
            )));
        }
        let rest = z.powi(-2) - (2.0 * sigma_b).powi(-2);
        if rest.is_nan() || rest <= 0.0 {
            return Err(ConfigError(format!(
                "--dp-clip-count-noise {sigma_b} leaves no room for the update's noise at \
                 --dp-noise-multiplier {z}: it must be above {:.4}",
                z / 2.0
            )));
        }
        Ok((sigma_b, rest.powf(-0.5)))
    }

    /// Clients selected per round (all of them when `clients_per_round` is unset).
    pub fn clients_per_round(&self) -> usize {
        self.clients_per_round.unwrap_or(self.clients)
    }

    /// Checks the settings that do not depend on the data.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |msg: String| Err(ConfigError(msg));
        if let Some(uri) = &self.mlflow_uri
            && let Err(e) = crate::tracking::mlflow::check_uri(uri)
        {
            return bad(e.to_string());
        }
        if self
            .mlflow_experiment
            .as_deref()
            .is_some_and(|n| n.trim().is_empty())
        {
            return bad("--mlflow-experiment must not be empty".into());
        }
        if self.clients == 0 {
            return bad("--clients must be at least 1".into());
        }
        let k = self.clients_per_round();
        if k == 0 || k > self.clients {
            return bad(format!(
                "--clients-per-round must be between 1 and --clients ({}), got {k}",
                self.clients
            ));
        }
        if self.min_participants == 0 || self.min_participants > k {
            return bad(format!(
                "--min-participants must be between 1 and clients per round ({k}), got {}",
                self.min_participants
            ));
        }
        if self.rounds == 0 {
            return bad("--rounds must be at least 1".into());
        }
        if !(self.malicious.is_finite() && (0.0..1.0).contains(&self.malicious)) {
            return bad(format!(
                "--malicious must be a fraction in [0, 1), got {}",
                self.malicious
            ));
        }
        self.validate_privacy()?;
        self.validate_aggregator(k)?;
        self.validate_dropout_and_secure(k)?;
        self.validate_compression(k)?;
        self.validate_personalisation()?;
        if !(self.test_fraction.is_finite() && self.test_fraction > 0.0 && self.test_fraction < 1.0)
        {
            return bad(format!(
                "--test-fraction must be in (0, 1), got {}",
                self.test_fraction
            ));
        }
        if let Some(lr) = self.server_lr
            && !(lr.is_finite() && lr > 0.0)
        {
            return bad(format!("--server-lr must be > 0, got {lr}"));
        }
        self.straggler.validate()?;
        if let Some(a) = self.target_accuracy
            && !(a.is_finite() && a > 0.0 && a <= 1.0)
        {
            return bad(format!("--target-accuracy must be in (0, 1], got {a}"));
        }
        self.validate_mode()?;
        if matches!(self.partition_scheme(), PartitionScheme::Natural)
            && !matches!(self.dataset, DatasetSpec::Synthetic { .. })
        {
            return bad(format!(
                "--partition natural needs a naturally federated data set (synthetic:ALPHA,BETA), not `{}`",
                self.dataset
            ));
        }
        self.train_config()
            .validate()
            .map_err(|e| ConfigError(e.to_string()))
    }

    /// The differential privacy flags: their ranges, and which need which.
    fn validate_privacy(&self) -> Result<(), ConfigError> {
        let bad = |msg: String| Err(ConfigError(msg));
        if let Some(sigma) = self.dp_noise_multiplier {
            if !(sigma.is_finite() && sigma >= 0.0) {
                return bad(format!(
                    "--dp-noise-multiplier must be a number >= 0, got {sigma}"
                ));
            }
            if !(self.dp_clip.is_finite() && self.dp_clip > 0.0) {
                return bad(format!("--dp-clip must be > 0, got {}", self.dp_clip));
            }
            if !(self.dp_delta > 0.0 && self.dp_delta < 1.0) {
                return bad(format!(
                    "--dp-delta must be in (0, 1), got {}",
                    self.dp_delta
                ));
            }
            if let Some(e) = self.dp_epsilon
                && !(e.is_finite() && e > 0.0)
            {
                return bad(format!("--dp-epsilon must be > 0, got {e}"));
            }
            if self.dp_budget_against == BudgetAgainst::Coordinator {
                if !self.secure_aggregation {
                    return bad(
                        "--dp-budget-against coordinator needs --secure-aggregation: under \
                         central noise the coordinator sees every update, so no epsilon holds \
                         against it"
                            .into(),
                    );
                }
                if self.dp_epsilon.is_none() {
                    return bad("--dp-budget-against coordinator needs --dp-epsilon".into());
                }
            }
            if sigma > cohort_aggregation::privacy::distributed::MAX_NOISE_MULTIPLIER {
                return bad(format!(
                    "--dp-noise-multiplier must be at most {}, got {sigma}",
                    cohort_aggregation::privacy::distributed::MAX_NOISE_MULTIPLIER
                ));
            }
            if let Some(rule) = self.aggregator {
                return bad(format!(
                    "--aggregator {rule} and --dp-noise-multiplier do not combine: the noise \
                     is calibrated to a sum of clipped updates"
                ));
            }
            if let Some(quantile) = self.dp_clip_quantile {
                if !(quantile > 0.0 && quantile < 1.0) {
                    return bad(format!(
                        "--dp-clip-quantile must be in (0, 1), got {quantile}"
                    ));
                }
                if self.secure_aggregation {
                    return bad(
                        "--dp-clip-quantile needs the count of clients within the clip, which \
                         secure aggregation does not release yet: use a fixed --dp-clip"
                            .into(),
                    );
                }
                self.adaptive_clip_noise()?;
            } else if self.dp_clip_count_noise.is_some() {
                return bad("--dp-clip-count-noise needs --dp-clip-quantile".into());
            }
        } else if self.dp_clip_quantile.is_some() || self.dp_clip_count_noise.is_some() {
            return bad(
                "--dp-clip-quantile and --dp-clip-count-noise need --dp-noise-multiplier".into(),
            );
        } else if self.dp_epsilon.is_some() {
            return bad("--dp-epsilon needs --dp-noise-multiplier".into());
        } else if !self.dp_budget_against.is_observers() {
            return bad("--dp-budget-against needs --dp-noise-multiplier".into());
        }
        Ok(())
    }

    /// A robust rule: not with secure aggregation or an adaptive optimizer, and one a
    /// full round of `k` updates can feed.
    fn validate_aggregator(&self, k: usize) -> Result<(), ConfigError> {
        let bad = |msg: String| Err(ConfigError(msg));
        if let Some(rule) = self.aggregator {
            if self.secure_aggregation {
                return bad(format!(
                    "--aggregator {rule} needs every client's update, which secure aggregation \
                     hides from the coordinator: use one or the other"
                ));
            }
            if self.strategy.adaptive_kind().is_some() {
                return bad(format!(
                    "--aggregator {rule} replaces the mean that {} steps from: use fedavg or fedprox",
                    self.strategy
                ));
            }
            // Checked against a full round; a round with fewer uploads than the rule
            // needs publishes nothing.
            rule.check(k)
                .map_err(|e| ConfigError(format!("--aggregator {rule}: {e}")))?;
        }
        Ok(())
    }

    /// Dropouts, and secure aggregation's settings for rounds of `k` clients (or their
    /// absence without it).
    fn validate_dropout_and_secure(&self, k: usize) -> Result<(), ConfigError> {
        let bad = |msg: String| Err(ConfigError(msg));
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            return bad(format!(
                "--dropout must be a probability in [0, 1), got {}",
                self.dropout
            ));
        }
        if !self.secure_aggregation {
            if self.dropout_stage != Stage::Masked {
                return bad(format!(
                    "--dropout-stage {} needs --secure-aggregation (without it a client only \
                     uploads, and `masked` is the one stage it can drop at)",
                    self.dropout_stage
                ));
            }
            if self.threshold.is_some() || self.neighbours.is_some() || self.max_weight.is_some() {
                return bad(
                    "--threshold, --neighbours and --max-weight need --secure-aggregation".into(),
                );
            }
        } else {
            if k < 2 {
                return bad(format!(
                    "--secure-aggregation needs at least 2 clients per round, got {k}"
                ));
            }
            if !(self.clip.is_finite() && self.clip > 0.0) {
                return bad(format!("--clip must be > 0, got {}", self.clip));
            }
            if self.max_weight == Some(0) {
                return bad("--max-weight must be at least 1".into());
            }
            let (neighbours, threshold) = self.secure_graph();
            let keff = secagg::effective_degree(k, neighbours);
            if neighbours == 0 {
                return bad("--neighbours must be at least 1".into());
            }
            if 2 * threshold <= keff || threshold > keff {
                return bad(format!(
                    "--threshold must be more than half of the {keff} neighbours and at most \
                     {keff} (between {} and {keff}), got {threshold}",
                    keff / 2 + 1
                ));
            }
        }
        Ok(())
    }

    /// The fraction of each client's data held out to score models on.
    pub fn client_holdout(&self) -> f64 {
        self.client_holdout
            .unwrap_or(if self.personalise.is_some() { 0.2 } else { 0.0 })
    }

    /// `--personalise` and `--client-holdout`: ranges, and what they cannot run with
    /// (the layer names are checked against the model once it is known).
    fn validate_personalisation(&self) -> Result<(), ConfigError> {
        let holdout = self.client_holdout();
        if !(holdout.is_finite() && (0.0..0.9).contains(&holdout)) {
            return Err(ConfigError(format!(
                "--client-holdout must be in [0, 0.9), got {holdout}"
            )));
        }
        if let Some(scheme) = &self.personalise {
            if holdout == 0.0 {
                return Err(ConfigError(format!(
                    "--personalise {scheme} needs a held-out split per client to score the \
                     personal models on: --client-holdout must be above 0"
                )));
            }
            if self.mode == Mode::Fedbuff {
                return Err(ConfigError(format!(
                    "--personalise {scheme} is for synchronous rounds, not --mode fedbuff"
                )));
            }
            if self.dp_noise_multiplier.is_some() {
                return Err(ConfigError(format!(
                    "--personalise {scheme} with differential privacy: a personal model \
                     trained on the client's data is not covered by the guarantee, and its \
                     accuracy is reported in the clear"
                )));
            }
        }
        Ok(())
    }

    /// Both directions' compression, as a spec's `compression` (the core's rules).
    pub fn compression(&self) -> cohort_core::CompressionSpec {
        cohort_core::CompressionSpec {
            upload: self.compress_up,
            download: self.compress_down,
            word_bits: self.word_bits,
        }
    }

    /// The compression flags, by the core's rules for rounds of `k` clients; the messages
    /// name the flags.
    fn validate_compression(&self, k: usize) -> Result<(), ConfigError> {
        let spec = self.compression();
        if spec.is_on() && self.mode == Mode::Fedbuff {
            return Err(ConfigError(
                "--compress-up and --compress-down are for synchronous rounds; --mode fedbuff \
                 sends plain floats"
                    .into(),
            ));
        }
        let secure = self.secure_aggregation;
        // Poisson sampling under differential privacy sizes a round by chance: the word
        // must hold the most clients a round can have.
        let parties = if self.dp_noise_multiplier.is_some() {
            self.clients
        } else {
            k
        };
        let context = cohort_core::compression::CompressionContext {
            secure_parties: secure.then_some(parties),
            distributed_noise: secure && self.dp_noise_multiplier.is_some(),
        };
        match spec.problems(context).into_iter().next() {
            None => Ok(()),
            Some((_, message)) => Err(ConfigError(
                message
                    .replace("compression.upload", "--compress-up")
                    .replace("compression.download", "--compress-down")
                    .replace("compression.word_bits", "--word-bits")
                    .replace("secure_aggregation", "--secure-aggregation"),
            )),
        }
    }

    /// The settings of `--mode`: FedBuff's own, and what it cannot be combined with.
    fn validate_mode(&self) -> Result<(), ConfigError> {
        let bad = |msg: String| Err(ConfigError(msg));
        if self.mode == Mode::Sync {
            if self.buffer_size.is_some()
                || self.concurrency.is_some()
                || self.staleness_exponent.is_some()
            {
                return bad(
                    "--buffer-size, --concurrency and --staleness-exponent need --mode fedbuff"
                        .into(),
                );
            }
            return Ok(());
        }
        if self.secure_aggregation {
            return bad(
                "--mode fedbuff and --secure-aggregation do not combine: SecAgg+ masks cancel \
                 only within one synchronous cohort, and FedBuff's buffer fills from clients \
                 that started on different models at different times"
                    .into(),
            );
        }
        if self.dp_noise_multiplier.is_some() {
            return bad(
                "--mode fedbuff and --dp-noise-multiplier do not combine: the privacy \
                 accountant assumes Poisson-sampled synchronous rounds, which FedBuff does not run"
                    .into(),
            );
        }
        if let Some(rule) = self.aggregator {
            return bad(format!(
                "--mode fedbuff and --aggregator {rule} do not combine: FedBuff weighs each \
                 update by its staleness as it arrives, and a robust rule needs a cohort of \
                 updates from one model"
            ));
        }
        if self.min_participants != 1 {
            return bad(format!(
                "--min-participants {} is the quorum of a synchronous round; with --mode \
                 fedbuff the server steps after every --buffer-size updates",
                self.min_participants
            ));
        }
        if self.buffer_size() == 0 {
            return bad("--buffer-size must be at least 1".into());
        }
        let c = self.concurrency();
        if c == 0 || c > self.clients {
            return bad(format!(
                "--concurrency must be between 1 and --clients ({}), got {c}",
                self.clients
            ));
        }
        let a = self.staleness_exponent();
        if !(a.is_finite() && a >= 0.0) {
            return bad(format!(
                "--staleness-exponent must be a number >= 0, got {a}"
            ));
        }
        Ok(())
    }

    /// Local training settings (the strategy adds its proximal mu per task).
    pub fn train_config(&self) -> cohort_edge::train::TrainConfig {
        cohort_edge::train::TrainConfig {
            local_epochs: self.local_epochs,
            batch_size: self.batch_size,
            lr: self.lr as f32,
            momentum: self.momentum as f32,
            weight_decay: self.weight_decay as f32,
            proximal_mu: None,
        }
    }
}

/// FedBuff's default buffer size K (the paper's choice for its cross-device runs).
pub const DEFAULT_BUFFER_SIZE: usize = 10;

pub use cohort_aggregation::fedbuff::DEFAULT_STALENESS_EXPONENT;

/// How a simulation schedules training and aggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Synchronous rounds: the server waits for every selected client before it moves.
    #[default]
    Sync,
    /// Buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022): clients train
    /// whenever a slot is free, and the server steps after every `buffer-size` updates.
    Fedbuff,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Sync => "sync",
            Mode::Fedbuff => "fedbuff",
        })
    }
}

impl FromStr for Mode {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "sync" => Ok(Mode::Sync),
            "fedbuff" => Ok(Mode::Fedbuff),
            _ => Err(ConfigError(format!(
                "unknown mode `{text}`: expected sync or fedbuff"
            ))),
        }
    }
}

/// What a malicious client sends: its honest update `delta` (new model minus global)
/// replaced by another. Written `sign-flip:S` (sends `-S * delta`) or `scale:S` (sends
/// `S * delta`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Attack {
    /// Sends `-scale * delta`.
    SignFlip {
        /// How much larger than the honest update.
        scale: f32,
    },
    /// Sends `factor * delta`.
    Scale {
        /// The factor.
        factor: f32,
    },
}

impl Attack {
    /// The update a malicious client sends in place of `delta`.
    pub fn apply(&self, delta: f32) -> f32 {
        match *self {
            Attack::SignFlip { scale } => -scale * delta,
            Attack::Scale { factor } => factor * delta,
        }
    }
}

impl std::fmt::Display for Attack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attack::SignFlip { scale } => write!(f, "sign-flip:{scale}"),
            Attack::Scale { factor } => write!(f, "scale:{factor}"),
        }
    }
}

impl From<Attack> for String {
    fn from(a: Attack) -> String {
        a.to_string()
    }
}

impl TryFrom<String> for Attack {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl std::str::FromStr for Attack {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let lower = text.trim().to_ascii_lowercase();
        let (name, value) = lower.split_once(':').unwrap_or((lower.as_str(), ""));
        let number = |v: &str| {
            v.parse::<f32>()
                .ok()
                .filter(|x| x.is_finite())
                .ok_or_else(|| format!("attack `{text}`: `{v}` is not a finite number"))
        };
        match name {
            "sign-flip" if value.is_empty() => Ok(Attack::SignFlip { scale: 1.0 }),
            "sign-flip" => Ok(Attack::SignFlip {
                scale: number(value)?,
            }),
            "scale" => Ok(Attack::Scale {
                factor: number(value)?,
            }),
            _ => Err(format!(
                "unknown attack `{text}`: expected sign-flip, sign-flip:S or scale:S"
            )),
        }
    }
}

/// `dropout-stage` as its name in TOML and `summary.json`.
mod stage_text {
    use cohort_aggregation::secagg::Stage;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(stage: &Stage, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(stage.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Stage, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dataset_specs_parse_and_round_trip() {
        for text in [
            "digits",
            "breast-cancer",
            "synthetic:1,1",
            "synthetic:0.5,0",
            "data/x.csv.gz",
        ] {
            let spec: DatasetSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
        }
        assert!("synthetic:1".parse::<DatasetSpec>().is_err());
        assert!("synthetic:-1,1".parse::<DatasetSpec>().is_err());
        assert!("synthetic:a,b".parse::<DatasetSpec>().is_err());
    }

    #[test]
    fn toml_uses_the_flag_names_and_rejects_unknown_keys() {
        let cfg: SimulationConfig = toml::from_str(
            "dataset = \"breast-cancer\"\nmodel = \"logreg\"\nclients-per-round = 4\nlocal_epochs = 2\npartition = \"iid\"\nstrategy = \"fedprox:0.1\"",
        )
        .unwrap();
        assert_eq!(cfg.dataset, DatasetSpec::BreastCancer);
        assert_eq!(cfg.clients_per_round, Some(4));
        assert_eq!(cfg.local_epochs, 2);
        assert_eq!(cfg.strategy, Strategy::FedProx { mu: 0.1 });
        assert_eq!(cfg.clients, SimulationConfig::default().clients);
        assert!(toml::from_str::<SimulationConfig>("clinets = 3").is_err());
        assert!(toml::from_str::<SimulationConfig>("partition = \"dirichlet:0\"").is_err());
    }

    #[test]
    fn validation_names_the_bad_setting() {
        let base = SimulationConfig::default();
        let cases = [
            (
                SimulationConfig {
                    clients: 0,
                    ..base.clone()
                },
                "--clients",
            ),
            (
                SimulationConfig {
                    clients_per_round: Some(51),
                    ..base.clone()
                },
                "--clients-per-round",
            ),
            (
                SimulationConfig {
                    rounds: 0,
                    ..base.clone()
                },
                "--rounds",
            ),
            (
                SimulationConfig {
                    dropout: 1.0,
                    ..base.clone()
                },
                "--dropout",
            ),
            (
                SimulationConfig {
                    partition: Some(PartitionScheme::Natural),
                    ..base.clone()
                },
                "natural",
            ),
            (
                SimulationConfig {
                    lr: -1.0,
                    ..base.clone()
                },
                "learning rate",
            ),
        ];
        for (cfg, needle) in cases {
            let err = cfg.validate().unwrap_err().0;
            assert!(err.contains(needle), "`{err}` should mention `{needle}`");
        }
        base.validate().unwrap();
    }

    #[test]
    fn fedbuff_settings_are_checked() {
        let fedbuff = SimulationConfig {
            mode: Mode::Fedbuff,
            clients: 20,
            clients_per_round: Some(5),
            ..SimulationConfig::default()
        };
        fedbuff.validate().unwrap();
        let resolved = fedbuff.resolved();
        assert_eq!(resolved.buffer_size, Some(DEFAULT_BUFFER_SIZE));
        assert_eq!(
            resolved.concurrency,
            Some(5),
            "defaults to clients per round"
        );
        assert_eq!(
            resolved.staleness_exponent,
            Some(DEFAULT_STALENESS_EXPONENT)
        );
        assert_eq!(SimulationConfig::default().resolved().buffer_size, None);
        let cases = [
            (
                SimulationConfig {
                    secure_aggregation: true,
                    ..fedbuff.clone()
                },
                "--secure-aggregation",
            ),
            (
                SimulationConfig {
                    dp_noise_multiplier: Some(1.0),
                    ..fedbuff.clone()
                },
                "--dp-noise-multiplier",
            ),
            (
                SimulationConfig {
                    aggregator: Some(cohort_aggregation::robust::RobustRule::Median),
                    ..fedbuff.clone()
                },
                "--aggregator median",
            ),
            (
                SimulationConfig {
                    buffer_size: Some(0),
                    ..fedbuff.clone()
                },
                "--buffer-size",
            ),
            (
                SimulationConfig {
                    concurrency: Some(21),
                    ..fedbuff.clone()
                },
                "--concurrency",
            ),
            (
                SimulationConfig {
                    staleness_exponent: Some(-1.0),
                    ..fedbuff.clone()
                },
                "--staleness-exponent",
            ),
            (
                SimulationConfig {
                    min_participants: 2,
                    ..fedbuff.clone()
                },
                "--min-participants",
            ),
            (
                SimulationConfig {
                    buffer_size: Some(4),
                    ..SimulationConfig::default()
                },
                "need --mode fedbuff",
            ),
            (
                SimulationConfig {
                    target_accuracy: Some(1.5),
                    ..SimulationConfig::default()
                },
                "--target-accuracy",
            ),
            (
                SimulationConfig {
                    straggler: StragglerModel::Pareto { alpha: 0.0 },
                    ..SimulationConfig::default()
                },
                "--straggler",
            ),
        ];
        for (cfg, needle) in cases {
            let err = cfg.validate().unwrap_err().0;
            assert!(err.contains(needle), "`{err}` should mention `{needle}`");
        }
        let toml: SimulationConfig = toml::from_str(
            "mode = \"fedbuff\"\nbuffer-size = 4\nstaleness_exponent = 1.0\nstraggler = \"pareto:1.5\"",
        )
        .unwrap();
        assert_eq!(toml.mode, Mode::Fedbuff);
        assert_eq!(toml.buffer_size, Some(4));
        assert_eq!(toml.straggler, StragglerModel::Pareto { alpha: 1.5 });
        assert!(toml::from_str::<SimulationConfig>("mode = \"async\"").is_err());
    }
}
