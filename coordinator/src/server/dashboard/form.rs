//! The new-experiment form: every setting the API's [`ExperimentSpec`] takes, parsed
//! field by field so that each problem is shown next to its own field, all at once.

use std::collections::HashMap;

use cohort_aggregation::Strategy;
use cohort_edge::model::ModelKind;

use cohort_core::ExperimentSpec;
use cohort_core::SecureAggregationSpec;
use cohort_core::TrainSettings;
use cohort_core::privacy::PrivacySpec;

/// What kind of control a field is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// A text box.
    Text,
    /// A number box.
    Number,
    /// A checkbox.
    Checkbox,
    /// A choice among options given at render time ([`with_model_files`]).
    Select,
    /// A text box of several lines.
    TextArea,
}

/// One option of a [`Control::Select`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The value submitted.
    pub value: String,
    /// What the option reads.
    pub label: String,
    /// Whether it is the one chosen.
    pub selected: bool,
}

/// One field of the form, ready to render.
#[derive(Debug, Clone)]
pub struct FieldView {
    /// The form name (`rounds`, `train.lr`, ...); also the element id.
    pub name: &'static str,
    /// The label.
    pub label: &'static str,
    /// A line of help under the control.
    pub help: &'static str,
    /// `text`, `number`, `checkbox`, `select` or `textarea`.
    pub input_type: &'static str,
    /// The `step` of a number box (`any` for decimals).
    pub step: &'static str,
    /// Whether the field must be filled.
    pub required: bool,
    /// The value shown (what was submitted, or the default).
    pub value: String,
    /// For a checkbox: whether it is ticked.
    pub checked: bool,
    /// What is wrong with it, if anything.
    pub error: Option<String>,
    /// For a select: its options.
    pub options: Vec<Choice>,
}

/// A group of fields.
#[derive(Debug, Clone)]
pub struct Fieldset {
    /// The group's legend.
    pub legend: &'static str,
    /// Its fields.
    pub fields: Vec<FieldView>,
}

struct FieldDef {
    name: &'static str,
    label: &'static str,
    help: &'static str,
    control: Control,
    /// Decimals allowed.
    decimal: bool,
    required: bool,
}

const fn def(
    name: &'static str,
    label: &'static str,
    help: &'static str,
    control: Control,
    decimal: bool,
    required: bool,
) -> FieldDef {
    FieldDef {
        name,
        label,
        help,
        control,
        decimal,
        required,
    }
}

use Control::{Checkbox, Number, Select, Text, TextArea};

const GROUPS: &[(&str, &[FieldDef])] = &[
    (
        "Experiment",
        &[
            def(
                "name",
                "Name",
                "Shown in lists; 1 to 200 characters.",
                Text,
                false,
                true,
            ),
            def(
                "features",
                "Features",
                "Feature columns in the clients' data (built-in models).",
                Number,
                false,
                true,
            ),
            def(
                "classes",
                "Classes",
                "Number of label classes, at least 2 (built-in models).",
                Number,
                false,
                true,
            ),
            def(
                "model",
                "Model",
                "logreg, mlp or mlp:H1,H2,... (hidden layer widths), trained by the edge client; or file: the initial model below, trained by the clients' own trainers.",
                Text,
                false,
                true,
            ),
            def(
                "initial_model",
                "Initial model",
                "A model file uploaded on the Models page to start from: required with model file; for a built-in model its tensors must be the model's.",
                Select,
                false,
                false,
            ),
            def(
                "hyperparameters",
                "Trainer hyperparameters",
                "Optional JSON object handed to the clients' trainers with every task, at most 16 KiB, e.g. {\"feature_scale\": 0.0625}.",
                TextArea,
                false,
                false,
            ),
            def(
                "strategy",
                "Strategy",
                "fedavg, fedprox:MU (MU the proximal weight, e.g. fedprox:0.01), or an adaptive server optimiser: fedadam, fedyogi or fedadagrad.",
                Text,
                false,
                true,
            ),
            def(
                "server_lr",
                "Server learning rate",
                "How far a round moves the global model: empty for the default (1 for fedavg and fedprox, 0.01 for the adaptive optimisers).",
                Number,
                true,
                false,
            ),
            def(
                "aggregator",
                "Robust aggregator",
                "Empty for the weighted mean; median, trimmed-mean:BETA, krum:F or multi-krum:F:M to withstand bad clients (plaintext rounds only: not with secure aggregation or differential privacy).",
                Text,
                false,
                false,
            ),
            def(
                "max_weight",
                "Maximum weight",
                "Plain rounds: a client's sample count counts as at most this in the weighted mean; empty for the default (1000). Secure aggregation has its own below; differential privacy weighs clients equally.",
                Number,
                false,
                false,
            ),
            def(
                "seed",
                "Seed",
                "Seed of the initial model.",
                Number,
                false,
                true,
            ),
        ],
    ),
    (
        "Rounds",
        &[
            def(
                "rounds",
                "Rounds",
                "Rounds to run, 1 to 100000.",
                Number,
                false,
                true,
            ),
            def(
                "clients_per_round",
                "Clients per round",
                "Updates a round needs.",
                Number,
                false,
                true,
            ),
            def(
                "min_participants",
                "Minimum participants",
                "Quorum: fewer uploads and the round is tried again.",
                Number,
                false,
                true,
            ),
            def(
                "over_selection",
                "Over-selection",
                "Clients selected per round as a multiple of clients per round (1 to 10), to absorb dropouts.",
                Number,
                true,
                true,
            ),
            def(
                "collect_deadline_seconds",
                "Upload deadline (s)",
                "Seconds selected clients have to upload, 1 to 86400.",
                Number,
                false,
                true,
            ),
            def(
                "max_round_attempts",
                "Attempts per round",
                "Tries of a round without quorum before the experiment fails.",
                Number,
                false,
                true,
            ),
        ],
    ),
    (
        "Local training",
        &[
            def(
                "train.local_epochs",
                "Local epochs",
                "Passes over the local data per round.",
                Number,
                false,
                true,
            ),
            def(
                "train.batch_size",
                "Batch size",
                "Mini-batch size.",
                Number,
                false,
                true,
            ),
            def(
                "train.lr",
                "Learning rate",
                "SGD learning rate (> 0).",
                Number,
                true,
                true,
            ),
            def(
                "train.momentum",
                "Momentum",
                "SGD momentum, in [0, 1).",
                Number,
                true,
                true,
            ),
            def(
                "train.weight_decay",
                "Weight decay",
                "L2 weight decay (>= 0).",
                Number,
                true,
                true,
            ),
        ],
    ),
    (
        "Mode",
        &[
            def(
                "mode",
                "Mode",
                "sync (rounds with a selected cohort; the default when empty) or fedbuff (buffered asynchronous: a server step every buffer-size updates; rounds are then server steps).",
                Text,
                false,
                false,
            ),
            def(
                "buffer_size",
                "Buffer size (FedBuff)",
                "Updates per server step (K); empty for clients per round.",
                Number,
                false,
                false,
            ),
            def(
                "concurrency",
                "Concurrency (FedBuff)",
                "Clients training at once (C); empty for clients per round x over-selection.",
                Number,
                false,
                false,
            ),
            def(
                "staleness_exponent",
                "Staleness exponent (FedBuff)",
                "A in the weight 1/(1+staleness)^A, 0 to 10; empty for 0.5.",
                Number,
                true,
                false,
            ),
            def(
                "max_staleness",
                "Maximum staleness (FedBuff)",
                "Updates more server steps stale than this are dropped; empty keeps every update.",
                Number,
                false,
                false,
            ),
        ],
    ),
    (
        "Compression",
        &[
            def(
                "compression.upload",
                "Uploads",
                "none; quantize:B (B = 1, 2, 4 or 8 bits a parameter, rotated, unbiased); sign (1 bit, with error feedback); topk:F (the largest fraction F, with error feedback; not with secure aggregation).",
                Text,
                false,
                false,
            ),
            def(
                "compression.download",
                "Model downloads",
                "none, quantize:4 or quantize:8: each client gets its own compressed copy of the model.",
                Text,
                false,
                false,
            ),
            def(
                "compression.word_bits",
                "Masked word width",
                "Secure aggregation with quantize:B uploads: 8, 16 or 32 bits; empty for the narrowest that holds the round's sum.",
                Number,
                false,
                false,
            ),
        ],
    ),
    (
        "Personalisation",
        &[
            def(
                "personalisation",
                "Scheme",
                "Empty for one global model; fedper:LAYERS or fedrep:LAYERS (those layers or tensors stay on each client, e.g. layers.1), ditto:LAMBDA (a personal model pulled towards the global one), finetune:EPOCHS.",
                Text,
                false,
                false,
            ),
            def(
                "client_holdout",
                "Held-out fraction",
                "The share of each client's examples it scores the global and its personalised model on; empty for 0.2.",
                Number,
                false,
                false,
            ),
        ],
    ),
    (
        "Secure aggregation (SecAgg+)",
        &[
            def(
                "secure_aggregation",
                "Secure aggregation",
                "Clients upload only masked updates; the coordinator learns only their sum. Needs at least 3 clients per round.",
                Checkbox,
                false,
                false,
            ),
            def(
                "secure_aggregation.threshold",
                "Threshold",
                "Shares needed to rebuild a client's secrets; empty for the default (just over half the neighbours).",
                Number,
                false,
                false,
            ),
            def(
                "secure_aggregation.neighbours",
                "Neighbours",
                "Neighbours per client; empty for the default sized for 10% dropout and the colluding fraction.",
                Number,
                false,
                false,
            ),
            def(
                "secure_aggregation.colluding_fraction",
                "Colluding fraction",
                "Fraction of clients assumed to work with a coordinator that cheats (0 to 0.5); the default neighbourhood and threshold keep every update private against it.",
                Number,
                false,
                true,
            ),
            def(
                "secure_aggregation.clip",
                "Clip",
                "Each update coordinate is clipped to [-clip, clip] before quantisation.",
                Number,
                true,
                true,
            ),
            def(
                "secure_aggregation.max_weight",
                "Maximum weight",
                "Sample counts above this count as this in the weighted mean.",
                Number,
                false,
                true,
            ),
            def(
                "secure_aggregation.advertise_seconds",
                "Advertise deadline (s)",
                "Seconds to advertise keys.",
                Number,
                false,
                true,
            ),
            def(
                "secure_aggregation.share_seconds",
                "Share deadline (s)",
                "Seconds to send encrypted shares.",
                Number,
                false,
                true,
            ),
            def(
                "secure_aggregation.unmask_seconds",
                "Unmask deadline (s)",
                "Seconds survivors have to reveal shares.",
                Number,
                false,
                true,
            ),
        ],
    ),
    (
        "Differential privacy",
        &[
            def(
                "privacy",
                "Differential privacy",
                "Clip every update and add Gaussian noise: the coordinator adds it to plain rounds; under secure aggregation each client adds its share before masking. Rounds stop before the budget is exceeded.",
                Checkbox,
                false,
                false,
            ),
            def(
                "privacy.noise_multiplier",
                "Noise multiplier",
                "Noise standard deviation over the clip (z > 0).",
                Number,
                true,
                true,
            ),
            def(
                "privacy.clip",
                "L2 clip",
                "Each client's update is clipped to this L2 norm (the starting bound when adaptive).",
                Number,
                true,
                true,
            ),
            def(
                "privacy.delta",
                "Delta",
                "The delta of the (epsilon, delta) guarantee, in (0, 1).",
                Number,
                true,
                true,
            ),
            def(
                "privacy.epsilon_budget",
                "Epsilon budget",
                "No round starts that could take epsilon past this.",
                Number,
                true,
                true,
            ),
            def(
                "privacy.budget_against",
                "Budget against",
                "observers: epsilon against anyone who sees only the published models, amplified by sampling. coordinator: the worst selected client's epsilon against the coordinator, which knows who took part (no amplification; secure aggregation only: under central noise the coordinator sees every update).",
                Text,
                false,
                true,
            ),
            def(
                "privacy.clip_quantile",
                "Adaptive clip quantile",
                "Empty for a fixed clip; a quantile in (0, 1) of update norms for the bound to track (central noise only).",
                Number,
                true,
                false,
            ),
            def(
                "privacy.clip_count_noise",
                "Clip count noise",
                "Adaptive clipping: noise on the count within the bound; empty for the default (expected clients / 20).",
                Number,
                true,
                false,
            ),
        ],
    ),
];

/// The compression group: `None` when both directions are `none` (or empty) and no
/// width is named.
fn compression_fields(r: &mut Reader) -> Option<cohort_core::CompressionSpec> {
    use cohort_aggregation::compress::Compression;
    let scheme = |r: &mut Reader, name| {
        if r.text(name).trim().is_empty() {
            Some(Compression::None)
        } else {
            r.parsed::<Compression>(name)
        }
    };
    let upload = scheme(r, "compression.upload").unwrap_or_default();
    let download = scheme(r, "compression.download").unwrap_or_default();
    let word_bits = r.optional("compression.word_bits").flatten().and_then(|w| {
        let w = u32::try_from(w).ok();
        if w.is_none() {
            r.errors
                .insert("compression.word_bits", "must be 8, 16 or 32".into());
        }
        w
    });
    let spec = cohort_core::CompressionSpec {
        upload,
        download,
        word_bits,
    };
    (spec.is_on() || word_bits.is_some()).then_some(spec)
}

/// The privacy settings a ticked box starts from.
fn default_privacy() -> PrivacySpec {
    PrivacySpec {
        noise_multiplier: 1.0,
        clip: 0.5,
        delta: 1e-5,
        epsilon_budget: 8.0,
        clip_quantile: None,
        clip_count_noise: None,
        budget_against: cohort_core::privacy::BudgetAgainst::Observers,
    }
}

/// The values a fresh form shows: the API's defaults.
/// The spec a fresh form shows.
fn default_spec() -> ExperimentSpec {
    ExperimentSpec {
        name: String::new(),
        features: 64,
        classes: 10,
        model: ModelKind::Mlp { hidden: vec![32] }.into(),
        initial_model: None,
        tensors: None,
        hyperparameters: None,
        strategy: Strategy::FedAvg,
        server_lr: None,
        rounds: 20,
        clients_per_round: 10,
        min_participants: 8,
        over_selection: 1.0,
        collect_deadline_seconds: 120,
        max_round_attempts: 3,
        train: TrainSettings::default(),
        seed: 0,
        secure_aggregation: None,
        privacy: None,
        aggregator: None,
        max_weight: None,
        mode: Default::default(),
        buffer_size: None,
        concurrency: None,
        staleness_exponent: None,
        max_staleness: None,
        compression: None,
        personalisation: None,
        client_holdout: None,
        columns: None,
    }
}

/// The values a fresh form shows, by field name: [`default_spec`], with secure
/// aggregation off but its defaults filled in for when it is ticked.
fn defaults() -> HashMap<&'static str, String> {
    let d = default_spec();
    let secure = SecureAggregationSpec::default();
    let privacy = default_privacy();
    HashMap::from([
        ("name", d.name),
        ("features", d.features.to_string()),
        ("classes", d.classes.to_string()),
        ("model", d.model.to_string()),
        ("initial_model", String::new()),
        ("hyperparameters", String::new()),
        ("strategy", d.strategy.to_string()),
        ("server_lr", String::new()),
        ("aggregator", String::new()),
        ("max_weight", String::new()),
        ("seed", d.seed.to_string()),
        ("rounds", d.rounds.to_string()),
        ("clients_per_round", d.clients_per_round.to_string()),
        ("min_participants", d.min_participants.to_string()),
        ("over_selection", d.over_selection.to_string()),
        (
            "collect_deadline_seconds",
            d.collect_deadline_seconds.to_string(),
        ),
        ("max_round_attempts", d.max_round_attempts.to_string()),
        ("train.local_epochs", d.train.local_epochs.to_string()),
        ("train.batch_size", d.train.batch_size.to_string()),
        ("train.lr", d.train.lr.to_string()),
        ("train.momentum", d.train.momentum.to_string()),
        ("train.weight_decay", d.train.weight_decay.to_string()),
        ("mode", d.mode.as_str().to_string()),
        ("buffer_size", String::new()),
        ("concurrency", String::new()),
        ("staleness_exponent", String::new()),
        ("max_staleness", String::new()),
        ("compression.upload", "none".into()),
        ("compression.download", "none".into()),
        ("compression.word_bits", String::new()),
        ("personalisation", String::new()),
        ("client_holdout", String::new()),
        ("secure_aggregation", String::new()),
        ("secure_aggregation.threshold", String::new()),
        ("secure_aggregation.neighbours", String::new()),
        (
            "secure_aggregation.colluding_fraction",
            secure.colluding_fraction.to_string(),
        ),
        ("secure_aggregation.clip", secure.clip.to_string()),
        (
            "secure_aggregation.max_weight",
            secure.max_weight.to_string(),
        ),
        (
            "secure_aggregation.advertise_seconds",
            secure.advertise_seconds.to_string(),
        ),
        (
            "secure_aggregation.share_seconds",
            secure.share_seconds.to_string(),
        ),
        (
            "secure_aggregation.unmask_seconds",
            secure.unmask_seconds.to_string(),
        ),
        ("privacy", String::new()),
        (
            "privacy.noise_multiplier",
            privacy.noise_multiplier.to_string(),
        ),
        ("privacy.clip", privacy.clip.to_string()),
        ("privacy.delta", privacy.delta.to_string()),
        ("privacy.epsilon_budget", privacy.epsilon_budget.to_string()),
        ("privacy.budget_against", privacy.budget_against.to_string()),
        ("privacy.clip_quantile", String::new()),
        ("privacy.clip_count_noise", String::new()),
    ])
}

/// The form with these values and errors (by field name).
fn view(
    values: &HashMap<&'static str, String>,
    errors: &HashMap<&'static str, String>,
) -> Vec<Fieldset> {
    GROUPS
        .iter()
        .map(|(legend, defs)| Fieldset {
            legend,
            fields: defs
                .iter()
                .map(|d| FieldView {
                    name: d.name,
                    label: d.label,
                    help: d.help,
                    input_type: match d.control {
                        Text => "text",
                        Number => "number",
                        Checkbox => "checkbox",
                        Select => "select",
                        TextArea => "textarea",
                    },
                    step: if d.decimal { "any" } else { "1" },
                    required: d.required,
                    value: values.get(d.name).cloned().unwrap_or_default(),
                    checked: d.control == Checkbox
                        && values.get(d.name).is_some_and(|v| !v.is_empty()),
                    error: errors.get(d.name).cloned(),
                    options: Vec::new(),
                })
                .collect(),
        })
        .collect()
}

/// A fresh form, filled with defaults.
pub fn blank() -> Vec<Fieldset> {
    view(&defaults(), &HashMap::new())
}

/// The submitted values of the form's fields, by name.
fn submitted_values(fields: &[(String, String)]) -> HashMap<&'static str, String> {
    let mut values = HashMap::new();
    for (key, value) in fields {
        if let Some(def) = GROUPS
            .iter()
            .flat_map(|(_, defs)| defs.iter())
            .find(|d| d.name == key)
        {
            values.insert(def.name, value.trim().to_string());
        }
    }
    values
}

/// The submitted form again with these messages (by field name), for problems found
/// after [`parse`] accepted it (those that need the store, such as an initial model
/// that does not exist).
pub fn rejected(
    fields: &[(String, String)],
    errors: &HashMap<&'static str, String>,
) -> Vec<Fieldset> {
    view(&submitted_values(fields), errors)
}

/// An uploaded model file as the initial-model select offers it.
#[derive(Debug, Clone)]
pub struct ModelFileChoice {
    /// Its id, the value submitted.
    pub id: String,
    /// What the option reads.
    pub label: String,
}

/// Fills the initial-model select with the uploaded model files (and "none"), the one
/// submitted chosen; an id that is not among them (a file typed in by a script) stays
/// an option, so that the form shows what was sent.
pub fn with_model_files(fieldsets: &mut [Fieldset], files: &[ModelFileChoice]) {
    for f in fieldsets
        .iter_mut()
        .flat_map(|s| s.fields.iter_mut())
        .filter(|f| f.name == "initial_model")
    {
        let chosen = f.value.clone();
        f.options = std::iter::once(Choice {
            value: String::new(),
            label: "none".into(),
            selected: chosen.is_empty(),
        })
        .chain(files.iter().map(|m| Choice {
            value: m.id.clone(),
            label: m.label.clone(),
            selected: m.id == chosen,
        }))
        .collect();
        if !chosen.is_empty() && !files.iter().any(|m| m.id == chosen) {
            f.options.push(Choice {
                label: chosen.clone(),
                value: chosen,
                selected: true,
            });
        }
    }
}

/// The outcome of reading a submitted form.
#[derive(Debug)]
pub enum Parsed {
    /// A valid spec.
    Spec(Box<ExperimentSpec>),
    /// The form again, with what was typed and a message next to each bad field.
    Invalid(Vec<Fieldset>),
}

/// The secure aggregation fieldset, when its box is ticked.
fn secure_fields(r: &mut Reader) -> Option<SecureAggregationSpec> {
    if r.text("secure_aggregation").is_empty() {
        None
    } else {
        let s = SecureAggregationSpec::default();
        let clip = r
            .number::<f32>("secure_aggregation.clip")
            .filter(|c| c.is_finite() && *c > 0.0);
        if clip.is_none() {
            r.errors
                .entry("secure_aggregation.clip")
                .or_insert_with(|| "must be a number above 0".into());
        }
        Some(SecureAggregationSpec {
            threshold: r.optional("secure_aggregation.threshold").flatten(),
            neighbours: r.optional("secure_aggregation.neighbours").flatten(),
            colluding_fraction: r
                .number("secure_aggregation.colluding_fraction")
                .unwrap_or(s.colluding_fraction),
            clip: clip.unwrap_or(s.clip),
            max_weight: r
                .whole("secure_aggregation.max_weight")
                .unwrap_or(s.max_weight),
            consistency_check: s.consistency_check,
            advertise_seconds: r
                .whole("secure_aggregation.advertise_seconds")
                .unwrap_or(s.advertise_seconds),
            reveal_seconds: s.reveal_seconds,
            confirm_seconds: s.confirm_seconds,
            share_seconds: r
                .whole("secure_aggregation.share_seconds")
                .unwrap_or(s.share_seconds),
            unmask_seconds: r
                .whole("secure_aggregation.unmask_seconds")
                .unwrap_or(s.unmask_seconds),
        })
    }
}

/// The differential privacy fieldset, when its box is ticked.
fn privacy_fields(r: &mut Reader) -> Option<PrivacySpec> {
    if r.text("privacy").is_empty() {
        None
    } else {
        let p = default_privacy();
        Some(PrivacySpec {
            noise_multiplier: r
                .number("privacy.noise_multiplier")
                .unwrap_or(p.noise_multiplier),
            clip: r.number("privacy.clip").unwrap_or(p.clip),
            delta: r.number("privacy.delta").unwrap_or(p.delta),
            epsilon_budget: r
                .number("privacy.epsilon_budget")
                .unwrap_or(p.epsilon_budget),
            clip_quantile: r.optional_number("privacy.clip_quantile").flatten(),
            clip_count_noise: r.optional_number("privacy.clip_count_noise").flatten(),
            budget_against: if r.text("privacy.budget_against").is_empty() {
                p.budget_against
            } else {
                r.parsed("privacy.budget_against")
                    .unwrap_or(p.budget_against)
            },
        })
    }
}

/// The initial model's id, when one is chosen.
fn initial_model_field(r: &mut Reader) -> Option<uuid::Uuid> {
    match r.text("initial_model").to_string().as_str() {
        "" => None,
        text => {
            let id = uuid::Uuid::parse_str(text).ok();
            if id.is_none() {
                r.errors
                    .insert("initial_model", format!("`{text}` is not a model file id"));
            }
            id
        }
    }
}

/// The trainers' hyperparameters, a JSON object, when given.
fn hyperparameters_field(r: &mut Reader) -> Option<serde_json::Map<String, serde_json::Value>> {
    match r.text("hyperparameters").to_string().as_str() {
        "" => None,
        text => match serde_json::from_str(text) {
            Ok(map) => Some(map),
            Err(e) => {
                r.errors.insert(
                    "hyperparameters",
                    format!("must be a JSON object, like {{\"epochs\": 2}}: {e}"),
                );
                None
            }
        },
    }
}

/// Local training's settings, each defaulting to `d`'s.
fn train_fields(r: &mut Reader, d: &TrainSettings) -> TrainSettings {
    TrainSettings {
        local_epochs: r.whole("train.local_epochs").unwrap_or(d.local_epochs),
        batch_size: r.whole("train.batch_size").unwrap_or(d.batch_size),
        lr: r.number("train.lr").unwrap_or(d.lr),
        momentum: r.number("train.momentum").unwrap_or(d.momentum),
        weight_decay: r.number("train.weight_decay").unwrap_or(d.weight_decay),
    }
}

/// Reads a submitted form: each field on its own, then the spec as a whole
/// ([`ExperimentSpec::validate`]).
/// The submitted values, and a message for each field that did not parse.
struct Reader {
    values: HashMap<&'static str, String>,
    errors: HashMap<&'static str, String>,
}

impl Reader {
    fn text(&self, name: &'static str) -> &str {
        self.values.get(name).map(String::as_str).unwrap_or("")
    }

    /// A required value of type `T`; `what` names the type in the message.
    fn required<T: std::str::FromStr>(&mut self, name: &'static str, what: &str) -> Option<T> {
        let text = self.text(name).to_string();
        if text.is_empty() {
            self.errors.insert(name, "required".to_string());
            return None;
        }
        let parsed = text.parse::<T>().ok();
        if parsed.is_none() {
            self.errors.insert(name, format!("`{text}` is not {what}"));
        }
        parsed
    }

    fn whole<T: std::str::FromStr>(&mut self, name: &'static str) -> Option<T> {
        self.required(name, "a whole number")
    }

    fn number<T: std::str::FromStr>(&mut self, name: &'static str) -> Option<T> {
        self.required(name, "a number")
    }

    /// An optional whole number: `Some(None)` when empty, `None` when it does not parse.
    fn optional(&mut self, name: &'static str) -> Option<Option<usize>> {
        let text = self.text(name).to_string();
        if text.is_empty() {
            return Some(None);
        }
        let parsed = text.parse::<usize>().ok();
        if parsed.is_none() {
            self.errors
                .insert(name, format!("`{text}` is not a whole number"));
        }
        parsed.map(Some)
    }

    /// An optional decimal: `Some(None)` when empty, `None` when it does not parse.
    fn optional_number(&mut self, name: &'static str) -> Option<Option<f64>> {
        let text = self.text(name).to_string();
        if text.is_empty() {
            return Some(None);
        }
        let parsed = text.parse::<f64>().ok();
        if parsed.is_none() {
            self.errors
                .insert(name, format!("`{text}` is not a number"));
        }
        parsed.map(Some)
    }

    /// A value whose own parser explains what is wrong.
    fn parsed<T: std::str::FromStr>(&mut self, name: &'static str) -> Option<T>
    where
        T::Err: std::fmt::Display,
    {
        match self.text(name).parse::<T>() {
            Ok(v) => Some(v),
            Err(e) => {
                self.errors.insert(name, e.to_string());
                None
            }
        }
    }
}

/// Reads a submitted form: each field on its own, then the spec as a whole
/// ([`ExperimentSpec::validate`]).
pub fn parse(fields: &[(String, String)]) -> Parsed {
    let mut r = Reader {
        values: submitted_values(fields),
        errors: HashMap::new(),
    };
    // A field that did not parse already has its message; the spec-wide rules still run,
    // with the default in its place, so that every other problem shows up at once too.
    let d = default_spec();
    let secure = secure_fields(&mut r);
    let privacy = privacy_fields(&mut r);
    let aggregator = if r.text("aggregator").is_empty() {
        None
    } else {
        r.parsed("aggregator")
    };
    let spec = ExperimentSpec {
        name: r.text("name").to_string(),
        features: r.whole("features").unwrap_or(d.features),
        classes: r.whole("classes").unwrap_or(d.classes),
        model: r.parsed("model").unwrap_or(d.model),
        initial_model: initial_model_field(&mut r),
        // Filled in from the initial model when the experiment is created.
        tensors: None,
        hyperparameters: hyperparameters_field(&mut r),
        strategy: r.parsed("strategy").unwrap_or(d.strategy),
        server_lr: r.optional_number("server_lr").flatten().map(|lr| lr as f32),
        rounds: r.whole("rounds").unwrap_or(d.rounds),
        clients_per_round: r.whole("clients_per_round").unwrap_or(d.clients_per_round),
        min_participants: r.whole("min_participants").unwrap_or(d.min_participants),
        over_selection: r.number("over_selection").unwrap_or(d.over_selection),
        collect_deadline_seconds: r
            .whole("collect_deadline_seconds")
            .unwrap_or(d.collect_deadline_seconds),
        max_round_attempts: r
            .whole("max_round_attempts")
            .unwrap_or(d.max_round_attempts),
        train: train_fields(&mut r, &d.train),
        seed: r.whole("seed").unwrap_or(d.seed),
        secure_aggregation: secure,
        privacy,
        aggregator,
        max_weight: r.optional("max_weight").flatten().and_then(|m| {
            let m = u32::try_from(m).ok();
            if m.is_none() {
                r.errors
                    .insert("max_weight", "must be at most 4294967295".into());
            }
            m
        }),
        // An empty (or absent, from an older page or a script) mode is the default.
        mode: if r.text("mode").is_empty() {
            d.mode
        } else {
            r.parsed("mode").unwrap_or(d.mode)
        },
        buffer_size: r.optional("buffer_size").flatten(),
        concurrency: r.optional("concurrency").flatten(),
        staleness_exponent: r.optional_number("staleness_exponent").flatten(),
        max_staleness: r.optional("max_staleness").flatten().and_then(|m| {
            let m = u32::try_from(m).ok();
            if m.is_none() {
                r.errors
                    .insert("max_staleness", "must be at most 4294967295".into());
            }
            m
        }),
        compression: compression_fields(&mut r),
        personalisation: if r.text("personalisation").is_empty() {
            None
        } else {
            r.parsed("personalisation")
        },
        client_holdout: r.optional_number("client_holdout").flatten(),
        columns: None,
    };
    if spec.name.is_empty() {
        r.errors.insert("name", "required".into());
    }
    for problem in spec.validate().err().into_iter().flat_map(|e| e.problems) {
        r.errors.entry(problem.field).or_insert(problem.message);
    }
    if r.errors.is_empty() {
        Parsed::Spec(Box::new(spec))
    } else {
        Parsed::Invalid(view(&r.values, &r.errors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn submitted(changes: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut values = defaults();
        values.insert("name", "digits".into());
        for (k, v) in changes {
            let key = GROUPS
                .iter()
                .flat_map(|(_, d)| d.iter())
                .find(|d| d.name == *k)
                .map(|d| d.name)
                .unwrap_or_else(|| panic!("no field {k}"));
            values.insert(key, v.to_string());
        }
        values
            .into_iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    fn errors(parsed: Parsed) -> HashMap<&'static str, String> {
        match parsed {
            Parsed::Spec(spec) => panic!("accepted {spec:?}"),
            Parsed::Invalid(sets) => sets
                .into_iter()
                .flat_map(|s| s.fields)
                .filter_map(|f| f.error.map(|e| (f.name, e)))
                .collect(),
        }
    }

    #[test]
    fn the_defaults_with_a_name_make_a_valid_spec() {
        match parse(&submitted(&[])) {
            Parsed::Spec(spec) => {
                assert_eq!(spec.name, "digits");
                assert!(spec.secure_aggregation.is_none());
                assert!(spec.validate().is_ok());
            }
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
    }

    #[test]
    fn every_bad_field_gets_its_own_message_at_once() {
        let errs = errors(parse(&submitted(&[
            ("rounds", "0"),
            ("train.lr", "fast"),
            ("min_participants", "50"),
            ("model", "cnn"),
        ])));
        assert!(
            errs["rounds"].contains("rounds must be between"),
            "{errs:?}"
        );
        assert!(errs["train.lr"].contains("not a number"), "{errs:?}");
        assert!(errs["model"].contains("cnn"), "{errs:?}");
        // The spec-wide rules run even though two fields did not parse.
        assert!(
            errs["min_participants"].contains("clients_per_round"),
            "{errs:?}"
        );
    }

    #[test]
    fn cross_field_rules_point_at_the_right_field() {
        let errs = errors(parse(&submitted(&[("min_participants", "50")])));
        assert!(
            errs["min_participants"].contains("clients_per_round"),
            "{errs:?}"
        );
        let errs = errors(parse(&submitted(&[("train.momentum", "1.5")])));
        assert!(errs["train.momentum"].contains("momentum"), "{errs:?}");
    }

    #[test]
    fn secure_aggregation_settings_are_checked_when_ticked() {
        let errs = errors(parse(&submitted(&[
            ("secure_aggregation", "on"),
            ("clients_per_round", "2"),
            ("min_participants", "2"),
        ])));
        assert!(errs.contains_key("secure_aggregation"), "{errs:?}");
        match parse(&submitted(&[("secure_aggregation", "on")])) {
            Parsed::Spec(spec) => assert!(spec.secure_aggregation.is_some()),
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
    }

    /// The form reaches every privacy setting and the robust rule, and their cross-field
    /// rules point at the field a user has to change.
    #[test]
    fn privacy_and_robust_settings_are_read_and_checked() {
        match parse(&submitted(&[
            ("privacy", "on"),
            ("privacy.noise_multiplier", "0.9"),
            ("privacy.epsilon_budget", "4"),
            ("privacy.clip_quantile", "0.5"),
        ])) {
            Parsed::Spec(spec) => {
                let p = spec.privacy.expect("privacy ticked");
                assert_eq!(p.noise_multiplier, 0.9);
                assert_eq!(p.epsilon_budget, 4.0);
                assert_eq!(p.clip_quantile, Some(0.5));
                assert_eq!(p.delta, 1e-5);
            }
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
        let errs = errors(parse(&submitted(&[
            ("privacy", "on"),
            ("privacy.delta", "2"),
            ("privacy.clip", "none"),
        ])));
        assert!(errs["privacy.delta"].contains("delta"), "{errs:?}");
        assert!(errs["privacy.clip"].contains("not a number"), "{errs:?}");
        // Whom the budget holds against: read, named when misspelt, and refused where the
        // coordinator sees every update.
        match parse(&submitted(&[
            ("privacy", "on"),
            ("secure_aggregation", "on"),
            ("privacy.budget_against", "coordinator"),
        ])) {
            Parsed::Spec(spec) => assert_eq!(
                spec.privacy.unwrap().budget_against,
                cohort_core::privacy::BudgetAgainst::Coordinator
            ),
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
        let errs = errors(parse(&submitted(&[
            ("privacy", "on"),
            ("privacy.budget_against", "server"),
        ])));
        assert!(
            errs["privacy.budget_against"].contains("observers or coordinator"),
            "{errs:?}"
        );
        let errs = errors(parse(&submitted(&[
            ("privacy", "on"),
            ("privacy.budget_against", "coordinator"),
        ])));
        assert!(
            errs["privacy.budget_against"].contains("secure_aggregation"),
            "{errs:?}"
        );
        let errs = errors(parse(&submitted(&[
            ("aggregator", "median"),
            ("secure_aggregation", "on"),
        ])));
        assert!(errs["aggregator"].contains("secure"), "{errs:?}");
        let errs = errors(parse(&submitted(&[("aggregator", "krum:9")])));
        assert!(errs["aggregator"].contains("min_participants"), "{errs:?}");
        match parse(&submitted(&[("aggregator", "trimmed-mean:0.2")])) {
            Parsed::Spec(spec) => {
                assert_eq!(spec.aggregator.unwrap().to_string(), "trimmed-mean:0.2")
            }
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
    }

    /// Compression comes from its group: `none` both ways is no compression, a scheme
    /// is parsed, and the core's refusals show next to their fields.
    #[test]
    fn personalisation_comes_from_the_form_and_is_checked() {
        match parse(&submitted(&[("personalisation", "fedper:layers.1")])) {
            Parsed::Spec(spec) => {
                assert_eq!(spec.personalisation.unwrap().to_string(), "fedper:layers.1");
                assert_eq!(spec.client_holdout, None);
            }
            Parsed::Invalid(_) => panic!("a valid personalisation"),
        }
        let errs = errors(parse(&submitted(&[("personalisation", "fedper:fc9")])));
        assert!(
            errs["personalisation"].contains("no layer or tensor `fc9`"),
            "{errs:?}"
        );
        let errs = errors(parse(&submitted(&[("personalisation", "ditto:-1")])));
        assert!(errs["personalisation"].contains("LAMBDA"), "{errs:?}");
        let errs = errors(parse(&submitted(&[("client_holdout", "0.3")])));
        assert!(
            errs["client_holdout"].contains("set personalisation"),
            "{errs:?}"
        );
    }

    #[test]
    fn compression_comes_from_the_form_and_is_checked() {
        match parse(&submitted(&[])) {
            Parsed::Spec(spec) => assert_eq!(spec.compression, None),
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
        match parse(&submitted(&[
            ("compression.upload", "quantize:4"),
            ("compression.download", "quantize:8"),
        ])) {
            Parsed::Spec(spec) => {
                let c = spec.compression.unwrap();
                assert_eq!(
                    (c.upload.to_string(), c.download.to_string()),
                    ("quantize:4".into(), "quantize:8".into())
                );
            }
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
        let errs = errors(parse(&submitted(&[("compression.upload", "quantize:3")])));
        assert!(
            errs["compression.upload"].contains("1, 2, 4 or 8"),
            "{errs:?}"
        );
        let errs = errors(parse(&submitted(&[
            ("compression.upload", "topk:0.01"),
            ("secure_aggregation", "on"),
        ])));
        assert!(
            errs["compression.upload"].contains("secure aggregation"),
            "{errs:?}"
        );
        let errs = errors(parse(&submitted(&[("compression.download", "sign")])));
        assert!(
            errs["compression.download"].contains("uploads only"),
            "{errs:?}"
        );
        let errs = errors(parse(&submitted(&[("compression.word_bits", "16")])));
        assert!(
            errs["compression.word_bits"].contains("secure_aggregation"),
            "{errs:?}"
        );
    }

    /// The plain rounds' weight cap: empty is the default, a number is the cap, and the
    /// spec's rules about it show next to the field.
    #[test]
    fn the_weight_cap_comes_from_the_form_and_is_checked() {
        match parse(&submitted(&[])) {
            Parsed::Spec(spec) => assert_eq!(spec.max_weight, None),
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
        match parse(&submitted(&[("max_weight", "250")])) {
            Parsed::Spec(spec) => assert_eq!(spec.max_weight, Some(250)),
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
        let errs = errors(parse(&submitted(&[("max_weight", "0")])));
        assert!(errs["max_weight"].contains("at least 1"), "{errs:?}");
        let errs = errors(parse(&submitted(&[("max_weight", "many")])));
        assert!(errs["max_weight"].contains("whole number"), "{errs:?}");
        let errs = errors(parse(&submitted(&[
            ("max_weight", "10"),
            ("secure_aggregation", "on"),
        ])));
        assert!(
            errs["max_weight"].contains("secure_aggregation.max_weight"),
            "{errs:?}"
        );
    }

    #[test]
    fn fedbuff_settings_come_from_the_form_and_are_checked() {
        match parse(&submitted(&[
            ("mode", "fedbuff"),
            ("buffer_size", "3"),
            ("concurrency", "6"),
            ("staleness_exponent", "1"),
            ("max_staleness", "4"),
        ])) {
            Parsed::Spec(spec) => {
                let f = spec.fedbuff().expect("fedbuff mode");
                assert_eq!((f.buffer_size, f.concurrency), (3, 6));
                assert_eq!((f.staleness_exponent, f.max_staleness), (1.0, Some(4)));
            }
            Parsed::Invalid(_) => panic!("valid"),
        }
        // A form without the mode (an older page, a script) is a synchronous experiment.
        match parse(&submitted(&[("mode", "")])) {
            Parsed::Spec(spec) => assert!(spec.fedbuff().is_none()),
            Parsed::Invalid(_) => panic!("valid"),
        }
        let errs = errors(parse(&submitted(&[
            ("mode", "later"),
            ("buffer_size", "x"),
            ("staleness_exponent", "much"),
        ])));
        for field in ["mode", "buffer_size", "staleness_exponent"] {
            assert!(errs.contains_key(field), "{field}: {errs:?}");
        }
        let errs = errors(parse(&submitted(&[
            ("mode", "fedbuff"),
            ("secure_aggregation", "on"),
        ])));
        assert!(errs.contains_key("secure_aggregation"), "{errs:?}");
    }

    #[test]
    fn a_file_model_takes_its_initial_model_and_hyperparameters_from_the_form() {
        let id = uuid::Uuid::new_v4();
        match parse(&submitted(&[
            ("model", "file"),
            ("initial_model", &id.to_string()),
            ("hyperparameters", r#"{"epochs": 2}"#),
        ])) {
            Parsed::Spec(spec) => {
                assert_eq!(spec.model, cohort_core::SpecModel::File);
                assert_eq!(spec.initial_model, Some(id));
                assert_eq!(spec.hyperparameters.unwrap()["epochs"], 2);
            }
            Parsed::Invalid(sets) => panic!("{sets:?}"),
        }
        let errs = errors(parse(&submitted(&[("model", "file")])));
        assert!(errs["initial_model"].contains("required"), "{errs:?}");
        let errs = errors(parse(&submitted(&[
            ("model", "file"),
            ("initial_model", "latest"),
            ("hyperparameters", "epochs=2"),
        ])));
        assert!(errs["initial_model"].contains("`latest`"), "{errs:?}");
        assert!(errs["hyperparameters"].contains("JSON object"), "{errs:?}");
        let big = format!(r#"{{"x": "{}"}}"#, "y".repeat(17 * 1024));
        let errs = errors(parse(&submitted(&[
            ("model", "file"),
            ("initial_model", &id.to_string()),
            ("hyperparameters", &big),
        ])));
        assert!(errs["hyperparameters"].contains("16384"), "{errs:?}");
    }

    #[test]
    fn the_initial_model_select_offers_the_files_and_keeps_what_was_sent() {
        let files = [form_choice("a"), form_choice("b")];
        let mut sets = blank();
        with_model_files(&mut sets, &files);
        let select = |sets: &[Fieldset]| {
            sets.iter()
                .flat_map(|s| s.fields.iter())
                .find(|f| f.name == "initial_model")
                .unwrap()
                .clone()
        };
        let f = select(&sets);
        assert_eq!(f.input_type, "select");
        assert_eq!(f.options.len(), 3);
        assert!(f.options[0].selected && f.options[0].value.is_empty());
        let mut sets = rejected(
            &[("initial_model".to_string(), "b".to_string())],
            &HashMap::new(),
        );
        with_model_files(&mut sets, &files);
        let chosen: Vec<_> = select(&sets)
            .options
            .into_iter()
            .filter(|o| o.selected)
            .map(|o| o.value)
            .collect();
        assert_eq!(chosen, ["b"]);
        // An id that is not among the files stays, chosen.
        let mut sets = rejected(
            &[("initial_model".to_string(), "zzz".to_string())],
            &HashMap::new(),
        );
        with_model_files(&mut sets, &files);
        let f = select(&sets);
        assert_eq!(f.options.len(), 4);
        assert!(f.options[3].selected && f.options[3].value == "zzz");
    }

    fn form_choice(id: &str) -> ModelFileChoice {
        ModelFileChoice {
            id: id.into(),
            label: format!("file {id}"),
        }
    }

    #[test]
    fn a_missing_name_is_required_and_the_typed_values_come_back() {
        let mut fields = submitted(&[("rounds", "7")]);
        fields.retain(|(k, _)| k != "name");
        match parse(&fields) {
            Parsed::Spec(_) => panic!("accepted without a name"),
            Parsed::Invalid(sets) => {
                let all: Vec<_> = sets.into_iter().flat_map(|s| s.fields).collect();
                let name = all.iter().find(|f| f.name == "name").unwrap();
                assert_eq!(name.error.as_deref(), Some("required"));
                let rounds = all.iter().find(|f| f.name == "rounds").unwrap();
                assert_eq!(rounds.value, "7");
            }
        }
    }
}
