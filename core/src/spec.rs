//! What an admin asks for when creating an experiment, and the one function that checks
//! it: [`ExperimentSpec::validate`] returns every problem, each tied to its field, so the
//! API answers with the first and the dashboard's form shows all of them next to their
//! fields. `serve`, `simulate` and the Python SDK check a spec through this function only.

use cohort_aggregation::Strategy;
use cohort_edge::model::ModelSpec;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::SpecModel;

/// Local training settings sent to clients with every task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct TrainSettings {
    /// Local epochs per round, 1 to 1000.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1000))]
    pub local_epochs: u32,
    /// Mini-batch size, 1 to 2^20.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1048576))]
    pub batch_size: usize,
    /// SGD learning rate, above 0.
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0))]
    pub lr: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
}

impl Default for TrainSettings {
    fn default() -> Self {
        let d = cohort_edge::train::TrainConfig::default();
        Self {
            local_epochs: d.local_epochs,
            batch_size: d.batch_size,
            lr: d.lr,
            momentum: d.momentum,
            weight_decay: d.weight_decay,
        }
    }
}

/// What an admin sends to create an experiment. Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExperimentSpec {
    /// Human name: 1 to 200 characters, not blank, no control characters.
    #[cfg_attr(
        feature = "openapi",
        schema(
            min_length = 1,
            max_length = 200,
            pattern = r"^[^\u0000-\u001F\u007F-\u009F]*[^\s\u0000-\u001F\u007F-\u009F][^\u0000-\u001F\u007F-\u009F]*$"
        )
    )]
    pub name: String,
    /// Feature columns of the clients' data: required (at least 1) for a built-in
    /// model, unused for `file`.
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 268435456))]
    #[serde(default)]
    pub features: usize,
    /// Number of classes: required (at least 2) for a built-in model, unused for `file`.
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 268435456))]
    #[serde(default)]
    pub classes: usize,
    /// `logreg`, `mlp` or `mlp:H1,H2,...` (built in, trained by the edge client), or
    /// `file`: the tensors of `initial_model`, trained by each client's own trainer
    /// (`cohort-edge --trainer`), with metrics from the clients' evaluations.
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "mlp:64"))]
    pub model: crate::SpecModel,
    /// An uploaded model file (`POST /api/v1/admin/models`) to start from: required for
    /// `file`; for a built-in model, its tensors must be the model's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_model: Option<Uuid>,
    /// The tensors of `initial_model`, filled in by the coordinator when the experiment
    /// is created (a value sent is replaced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<cohort_aggregation::TensorSpec>>,
    /// Free-form settings passed to the clients' trainers with every task (a JSON object,
    /// at most 16 KiB), e.g. `{"feature_scale": 0.0625}`.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyperparameters: Option<serde_json::Map<String, serde_json::Value>>,
    /// `fedavg`, `fedprox:MU`, `fedadam`, `fedyogi` or `fedadagrad`.
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "fedavg"))]
    #[serde(default = "default_strategy")]
    pub strategy: Strategy,
    /// The server learning rate: how far each round moves the global model towards the
    /// clients' mean (averaging) or along the adaptive step (`fedadam`, `fedyogi`,
    /// `fedadagrad`). Absent: 1 for averaging (the next model is the mean itself), 0.01
    /// for the adaptive rules, as in `cohort simulate --server-lr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(exclusive_minimum = 0, maximum = 100, example = 0.01)
    )]
    pub server_lr: Option<f32>,
    /// Rounds to run, 1 to 100000.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 100000))]
    pub rounds: u32,
    /// Clients whose updates a round needs, 1 to 100000.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 100000))]
    pub clients_per_round: usize,
    /// Minimum uploads for a round to count (the quorum): 1 to `clients_per_round`.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 100000))]
    pub min_participants: usize,
    /// Clients selected per round, as a multiple of `clients_per_round` (1 to 10), so
    /// that dropouts still leave enough uploads.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 10))]
    #[serde(default = "default_over_selection")]
    pub over_selection: f64,
    /// Seconds selected clients have to upload, 1 to 86400.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 86400))]
    #[serde(default = "default_collect_seconds")]
    pub collect_deadline_seconds: u64,
    /// Attempts a round gets before the experiment fails: a round without quorum, or
    /// whose aggregation failed every try, runs again as its next attempt until then.
    /// In mode `fedbuff`, the attempts a full buffer's aggregation gets.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 10000))]
    #[serde(default = "default_round_retries")]
    pub max_round_attempts: u32,
    /// Local training settings.
    #[serde(default)]
    pub train: TrainSettings,
    /// Seed of the initial model.
    #[serde(default)]
    pub seed: u64,
    /// Secure aggregation (SecAgg+): clients upload only masked updates and the
    /// coordinator learns only their sum. `{}` takes every default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_aggregation: Option<crate::secure::SecureAggregationSpec>,
    /// Differential privacy: clipping, noise (central on plain rounds, distributed among
    /// the clients under secure aggregation) and an epsilon budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<crate::privacy::PrivacySpec>,
    /// A robust rule in place of the weighted mean, for plaintext rounds: `median`,
    /// `trimmed-mean:BETA`, `krum:F` or `multi-krum:F:M`. Absent: the weighted mean.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, example = "median"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregator: Option<cohort_aggregation::robust::RobustRule>,
    /// Plain rounds: the most one upload weighs in the weighted mean (and in the mean
    /// training loss). A client reports its own sample count, so without a cap one
    /// client claiming 10^12 samples would be the whole mean; a count above this counts
    /// as this, and the audit log records the clamp. Absent: 1000, the default of
    /// `secure_aggregation.max_weight`, which secure rounds use instead; differentially
    /// private rounds weigh every client equally and take none.
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_weight: Option<u32>,
    /// `sync` (the default): rounds with a selected cohort, a deadline and a quorum.
    /// `fedbuff`: buffered asynchronous aggregation (see [`crate::mode`]); `rounds` is
    /// then the number of server steps (model versions) to publish,
    /// `collect_deadline_seconds` how long a task may take before its slot is freed, and
    /// `min_participants` is not used (a step waits for its `buffer_size` updates, however
    /// long they take) and `max_round_attempts` counts a buffer's aggregation attempts.
    #[serde(default, skip_serializing_if = "crate::mode::ExperimentMode::is_sync")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "sync"))]
    pub mode: crate::mode::ExperimentMode,
    /// FedBuff: updates per server step (K), 1 to 10000; default `clients_per_round`.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 10000))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer_size: Option<usize>,
    /// FedBuff: clients training at once (C); default `clients_per_round *
    /// over_selection`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    /// FedBuff: A in the staleness weight `1 / (1 + tau)^A`, 0 to 10; default 0.5.
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 10))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_exponent: Option<f64>,
    /// FedBuff: updates more than this many server steps stale are dropped (and counted);
    /// default none, every update is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u32>,
    /// Compression of the clients' uploads and of the models they download (synchronous
    /// rounds): `{"upload": "quantize:4", "download": "quantize:4"}`. Absent: 32-bit
    /// floats both ways.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<crate::CompressionSpec>,
    /// Personalisation (synchronous rounds): `fedper:LAYERS`, `fedrep:LAYERS`,
    /// `ditto:LAMBDA` or `finetune:EPOCHS`. Each client keeps its personal part (never
    /// uploaded) in its state directory, and reports the global and its personalised
    /// model's accuracy on a held-out split of its data.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, example = "fedper:layers.1"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub personalisation: Option<cohort_edge::personal::Personalisation>,
    /// With personalisation: the fraction of each client's examples held out to score
    /// the models on (built-in models; default 0.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_holdout: Option<f64>,
    /// The columns of a site's data the experiment reads as features, by their header
    /// names, in the model's feature order (the label column, `label`, is read too). A
    /// site that shares only some columns (`cohort-edge --columns`) refuses a task that
    /// names another, and one that names none; a built-in trainer reads exactly these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Vec<String>>,
}

/// The most clients a round may need: beyond this one coordinator's round is not the
/// tool (and `clients_per_round * over_selection` stays far from overflowing).
pub const MAX_CLIENTS_PER_ROUND: usize = 100_000;
/// The most attempts a round may get before the experiment fails. Private experiments
/// whose rounds may fail for a long while (each attempt charging the budget until it
/// runs out) use a thousand; more is a typo, not a plan.
pub const MAX_ROUND_ATTEMPTS: u32 = 10_000;

fn default_strategy() -> Strategy {
    Strategy::FedAvg
}
fn default_over_selection() -> f64 {
    1.0
}
fn default_collect_seconds() -> u64 {
    120
}
fn default_round_retries() -> u32 {
    3
}

/// The weight cap of plain rounds when the spec sets none: the secure rounds' default,
/// so that an experiment weighs its clients alike with or without secure aggregation.
pub fn default_max_weight() -> u32 {
    cohort_aggregation::secagg::QuantizationParams::default().max_weight
}

impl ExperimentSpec {
    /// The most a plain round's upload weighs: [`max_weight`](Self::max_weight), or
    /// [`default_max_weight`].
    pub fn weight_cap(&self) -> i64 {
        i64::from(self.max_weight.unwrap_or_else(default_max_weight))
    }

    /// The weight a plain round gives an upload whose client reports `num_samples`.
    pub fn sample_weight(&self, num_samples: i64) -> i64 {
        num_samples.min(self.weight_cap())
    }

    /// Clients selected per round when enough are available:
    /// `ceil(clients_per_round * over_selection)`.
    pub fn selected_per_round(&self) -> usize {
        ((self.clients_per_round as f64 * self.over_selection).ceil() as usize).max(1)
    }

    /// How many clients a synchronous round asks for, and the fewest it opens with: the
    /// quorum, or more where secure aggregation needs `t + 1` parties.
    pub fn cohort_size(&self) -> crate::round::CohortSize {
        let wanted = self.selected_per_round();
        let needed = match &self.secure_aggregation {
            Some(secure) => self.min_participants.max(secure.min_clients(wanted)),
            None => self.min_participants,
        };
        crate::round::CohortSize { wanted, needed }
    }

    /// What a synchronous round does after a failed attempt in `serve`: runs again, up to
    /// `max_round_attempts` (for an in-memory driver that mirrors `serve`).
    pub fn failed_attempt_policy(&self) -> crate::round::FailedAttemptPolicy {
        crate::round::FailedAttemptPolicy::Retry {
            max_attempts: self.max_round_attempts,
        }
    }

    /// Checks the spec as a whole: `Err` holds every problem, each tied to the field it
    /// is about (so that a form can show all of them next to their fields at once); its
    /// message is the first one's, which names the field.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        let mut problems = Vec::new();
        let mut bad =
            |field: &'static str, message: String| problems.push(SpecProblem { field, message });
        if let Err(why) = crate::text::check_label("name", &self.name) {
            bad("name", why);
        }
        let params = self.model_problems(&mut bad);
        self.round_problems(&mut bad);
        self.secure_problems(params, &mut bad);
        if let Some(privacy) = &self.privacy {
            for (field, message) in
                privacy.problems(self.selected_per_round(), self.secure_aggregation.is_some())
            {
                bad(field, message);
            }
        }
        self.weighting_problems(&mut bad);
        self.compression_problems(&mut bad);
        self.personalisation_problems(&mut bad);
        self.column_problems(&mut bad);
        crate::mode::problems(self, &mut bad);
        self.train_problems(&mut bad);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(InvalidSpec { problems })
        }
    }

    /// The named columns' problems: none empty, repeated, the label, or holding a comma
    /// (a site lists the columns it shares separated by commas); as many as a built-in
    /// model's features.
    fn column_problems(&self, bad: &mut impl FnMut(&'static str, String)) {
        let Some(columns) = &self.columns else {
            return;
        };
        if columns.is_empty() {
            bad(
                "columns",
                "columns, when given, names at least one column".into(),
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for c in columns {
            if c.trim().is_empty() || c.trim() != c || c.contains(',') || c.len() > 200 {
                bad(
                    "columns",
                    format!(
                        "column `{}` is not a column name (1 to 200 characters, no comma, no \
                         space at either end)",
                        c.chars().take(60).collect::<String>()
                    ),
                );
            } else if c == cohort_edge::data::LABEL_COLUMN {
                bad(
                    "columns",
                    "columns names the features; the label column is always read".into(),
                );
            } else if !seen.insert(c.as_str()) {
                bad("columns", format!("column `{c}` is named twice"));
            }
        }
        if matches!(self.model, SpecModel::BuiltIn(_)) && columns.len() != self.features {
            bad(
                "columns",
                format!(
                    "columns names {} columns but the model takes {} features",
                    columns.len(),
                    self.features
                ),
            );
        }
    }

    /// The model's problems; its parameter count when it is known (a built-in model
    /// that builds, or a file model's tensors).
    fn model_problems(&self, bad: &mut impl FnMut(&'static str, String)) -> Option<usize> {
        match &self.model {
            SpecModel::BuiltIn(kind) => match ModelSpec::new(kind, self.features, self.classes) {
                Ok(m) => Some(m.num_params()),
                Err(e) => {
                    let field = if self.features == 0 {
                        "features"
                    } else if self.classes < 2 {
                        "classes"
                    } else {
                        "model"
                    };
                    bad(field, format!("model: {e}"));
                    None
                }
            },
            SpecModel::File => {
                if self.initial_model.is_none() {
                    bad(
                        "initial_model",
                        "initial_model is required with model `file`: upload the model's \
                         safetensors file to /api/v1/admin/models and give its id"
                            .into(),
                    );
                }
                self.tensors
                    .as_ref()
                    .map(|t| t.iter().map(cohort_aggregation::TensorSpec::numel).sum())
            }
        }
    }

    /// The hyperparameters, how many rounds and clients, the deadlines, the attempts and
    /// the strategy with its server learning rate.
    fn round_problems(&self, bad: &mut impl FnMut(&'static str, String)) {
        if let Some(h) = &self.hyperparameters {
            let size = serde_json::to_vec(h).map_or(usize::MAX, |v| v.len());
            if size > 16 * 1024 {
                bad(
                    "hyperparameters",
                    format!("hyperparameters must be at most 16384 bytes of JSON, got {size}"),
                );
            }
        }
        if self.rounds == 0 || self.rounds > 100_000 {
            bad(
                "rounds",
                format!("rounds must be between 1 and 100000, got {}", self.rounds),
            );
        }
        if self.clients_per_round == 0 || self.clients_per_round > MAX_CLIENTS_PER_ROUND {
            bad(
                "clients_per_round",
                format!(
                    "clients_per_round must be between 1 and {MAX_CLIENTS_PER_ROUND}, got {}",
                    self.clients_per_round
                ),
            );
        }
        if self.min_participants == 0 || self.min_participants > self.clients_per_round {
            bad(
                "min_participants",
                format!(
                    "min_participants must be between 1 and clients_per_round ({}), got {}",
                    self.clients_per_round, self.min_participants
                ),
            );
        }
        if !(self.over_selection.is_finite() && (1.0..=10.0).contains(&self.over_selection)) {
            bad(
                "over_selection",
                format!(
                    "over_selection must be between 1 and 10, got {}",
                    self.over_selection
                ),
            );
        }
        if self.collect_deadline_seconds == 0 || self.collect_deadline_seconds > 86_400 {
            bad(
                "collect_deadline_seconds",
                "collect_deadline_seconds must be between 1 and 86400".into(),
            );
        }
        if self.max_round_attempts == 0 || self.max_round_attempts > MAX_ROUND_ATTEMPTS {
            bad(
                "max_round_attempts",
                format!(
                    "max_round_attempts must be between 1 and {MAX_ROUND_ATTEMPTS}, got {}",
                    self.max_round_attempts
                ),
            );
        }
        // The strategy itself always has a valid optimizer (its defaults); only a
        // server_lr given can make one fail.
        if let Some(lr) = self.server_lr {
            if let Err(e) = self.strategy.server_optimizer(Some(lr)) {
                bad("server_lr", format!("server_lr: {e}"));
            } else if lr > 100.0 {
                bad("server_lr", "server_lr must be at most 100".into());
            }
        }
    }

    /// Compression against the rest of the spec: secure rounds take only `quantize:B`
    /// uploads in a word that holds the sum of the clients a round selects, and FedBuff
    /// none at all.
    fn compression_problems(&self, bad: &mut impl FnMut(&'static str, String)) {
        let Some(compression) = &self.compression else {
            return;
        };
        if compression.is_on() && self.fedbuff().is_some() {
            bad(
                "compression.upload",
                "compression is for synchronous rounds: mode fedbuff sends plain floats".into(),
            );
        }
        let secure = self.secure_aggregation.is_some();
        let context = crate::compression::CompressionContext {
            secure_parties: secure.then(|| self.selected_per_round()),
            distributed_noise: secure && self.privacy.is_some(),
        };
        for (field, message) in compression.problems(context) {
            bad(field, message);
        }
    }

    /// Secure aggregation's settings against the clients a round selects and the
    /// model's size (`params`), each problem tied to its own field.
    fn secure_problems(&self, params: Option<usize>, bad: &mut impl FnMut(&'static str, String)) {
        if let Some(secure) = &self.secure_aggregation
            && let Err(e) = secure.validate(self.selected_per_round(), params.unwrap_or(1))
        {
            let field = [
                "advertise_seconds",
                "reveal_seconds",
                "share_seconds",
                "confirm_seconds",
                "unmask_seconds",
                "neighbours",
                "threshold",
                "colluding_fraction",
                "clip",
                "max_weight",
            ]
            .into_iter()
            .find(|name| e.starts_with(name))
            .map_or("secure_aggregation", |name| match name {
                "advertise_seconds" => "secure_aggregation.advertise_seconds",
                "reveal_seconds" => "secure_aggregation.reveal_seconds",
                "share_seconds" => "secure_aggregation.share_seconds",
                "confirm_seconds" => "secure_aggregation.confirm_seconds",
                "unmask_seconds" => "secure_aggregation.unmask_seconds",
                "neighbours" => "secure_aggregation.neighbours",
                "threshold" => "secure_aggregation.threshold",
                "colluding_fraction" => "secure_aggregation.colluding_fraction",
                "clip" => "secure_aggregation.clip",
                _ => "secure_aggregation.max_weight",
            });
            bad(field, format!("secure_aggregation: {e}"));
        }
    }

    /// How updates are weighed and combined: the weight cap and the robust rule, each
    /// against secure aggregation and differential privacy.
    fn weighting_problems(&self, bad: &mut impl FnMut(&'static str, String)) {
        match self.max_weight {
            Some(0) => bad("max_weight", "max_weight must be at least 1".into()),
            Some(_) if self.secure_aggregation.is_some() => bad(
                "max_weight",
                "max_weight caps plain rounds' sample weights; with secure aggregation the \
                 weight is capped inside the masked vector: set secure_aggregation.max_weight"
                    .into(),
            ),
            Some(_) if self.privacy.is_some() => bad(
                "max_weight",
                "max_weight does not apply: a differentially private experiment weighs every \
                 client equally"
                    .into(),
            ),
            _ => {}
        }
        if let Some(rule) = self.aggregator {
            if self.secure_aggregation.is_some() {
                bad(
                    "aggregator",
                    format!(
                        "aggregator: {rule} needs to see each client's update, and secure \
                         aggregation shows the coordinator only their sum; choose one"
                    ),
                );
            } else if self.privacy.is_some() {
                bad(
                    "aggregator",
                    format!(
                        "aggregator: {rule} with differential privacy is not supported: the \
                         noise is calibrated to the sensitivity of the clipped mean"
                    ),
                );
            } else if let Err(e) = rule.check(self.min_participants) {
                bad(
                    "aggregator",
                    format!(
                        "aggregator: {e} (a round may aggregate as few as min_participants = {} \
                         updates)",
                        self.min_participants
                    ),
                );
            }
        }
    }

    /// Local training's settings, as the clients will check them.
    fn train_problems(&self, bad: &mut impl FnMut(&'static str, String)) {
        let train = cohort_edge::train::TrainConfig {
            local_epochs: self.train.local_epochs,
            batch_size: self.train.batch_size,
            lr: self.train.lr,
            momentum: self.train.momentum,
            weight_decay: self.train.weight_decay,
            proximal_mu: self.strategy.proximal_mu(),
        };
        if let Err(e) = train.validate() {
            let text = e.to_string();
            let field = [
                ("local epochs", "train.local_epochs"),
                ("batch size", "train.batch_size"),
                ("learning rate", "train.lr"),
                ("momentum", "train.momentum"),
                ("weight decay", "train.weight_decay"),
                ("proximal mu", "strategy"),
            ]
            .into_iter()
            .find(|(words, _)| text.contains(words))
            .map_or("train", |(_, field)| field);
            bad(field, format!("train: {e}"));
        }
    }
}

/// Why an [`ExperimentSpec`] was refused: every problem found, at least one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .problems[0].message)]
pub struct InvalidSpec {
    /// The problems, in the order the fields are checked.
    pub problems: Vec<SpecProblem>,
}

/// One thing wrong with an [`ExperimentSpec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecProblem {
    /// The field, as the form names it: `rounds`, `train.lr`,
    /// `secure_aggregation.threshold`, ...
    pub field: &'static str,
    /// What is wrong, naming the field.
    pub message: String,
}
