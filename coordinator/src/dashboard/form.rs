//! The new-experiment form: every setting the API's [`ExperimentSpec`] takes, parsed
//! field by field so that each problem is shown next to its own field, all at once.

use std::collections::HashMap;

use cohort_aggregation::Strategy;
use cohort_edge::model::ModelKind;

use crate::server::admin::{ExperimentSpec, TrainSettings};
use crate::server::secure_rounds::SecureAggregationSpec;

/// What kind of control a field is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// A text box.
    Text,
    /// A number box.
    Number,
    /// A checkbox.
    Checkbox,
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
    /// `text`, `number` or `checkbox`.
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

use Control::{Checkbox, Number, Text};

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
                "Feature columns in the clients' data.",
                Number,
                false,
                true,
            ),
            def(
                "classes",
                "Classes",
                "Number of label classes (at least 2).",
                Number,
                false,
                true,
            ),
            def(
                "model",
                "Model",
                "logreg, mlp or mlp:H1,H2,... (hidden layer widths).",
                Text,
                false,
                true,
            ),
            def(
                "strategy",
                "Strategy",
                "fedavg or fedprox:MU (MU the proximal weight, e.g. fedprox:0.01).",
                Text,
                false,
                true,
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
                "Neighbours per client; empty for the default sized for 10% dropout.",
                Number,
                false,
                false,
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
];

/// The values a fresh form shows: the API's defaults.
fn defaults() -> HashMap<&'static str, String> {
    let train = TrainSettings::default();
    let secure = SecureAggregationSpec::default();
    HashMap::from([
        ("name", String::new()),
        ("features", "64".to_string()),
        ("classes", "10".to_string()),
        ("model", "mlp:32".to_string()),
        ("strategy", "fedavg".to_string()),
        ("seed", "0".to_string()),
        ("rounds", "20".to_string()),
        ("clients_per_round", "10".to_string()),
        ("min_participants", "8".to_string()),
        ("over_selection", "1".to_string()),
        ("collect_deadline_seconds", "120".to_string()),
        ("max_round_attempts", "3".to_string()),
        ("train.local_epochs", train.local_epochs.to_string()),
        ("train.batch_size", train.batch_size.to_string()),
        ("train.lr", train.lr.to_string()),
        ("train.momentum", train.momentum.to_string()),
        ("train.weight_decay", train.weight_decay.to_string()),
        ("secure_aggregation", String::new()),
        ("secure_aggregation.threshold", String::new()),
        ("secure_aggregation.neighbours", String::new()),
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
                    },
                    step: if d.decimal { "any" } else { "1" },
                    required: d.required,
                    value: values.get(d.name).cloned().unwrap_or_default(),
                    checked: d.control == Checkbox
                        && values.get(d.name).is_some_and(|v| !v.is_empty()),
                    error: errors.get(d.name).cloned(),
                })
                .collect(),
        })
        .collect()
}

/// A fresh form, filled with defaults.
pub fn blank() -> Vec<Fieldset> {
    view(&defaults(), &HashMap::new())
}

/// The outcome of reading a submitted form.
#[derive(Debug)]
pub enum Parsed {
    /// A valid spec.
    Spec(Box<ExperimentSpec>),
    /// The form again, with what was typed and a message next to each bad field.
    Invalid(Vec<Fieldset>),
}

/// Reads a submitted form: each field on its own, then the spec as a whole
/// ([`ExperimentSpec::problems`]).
pub fn parse(fields: &[(String, String)]) -> Parsed {
    let known: HashMap<&'static str, ()> = GROUPS
        .iter()
        .flat_map(|(_, defs)| defs.iter().map(|d| (d.name, ())))
        .collect();
    let mut values: HashMap<&'static str, String> = HashMap::new();
    for (key, value) in fields {
        if let Some((name, _)) = known.get_key_value(key.as_str()) {
            values.insert(name, value.trim().to_string());
        }
    }
    let mut errors: HashMap<&'static str, String> = HashMap::new();
    let text = |name: &'static str| values.get(name).map(String::as_str).unwrap_or("");

    fn number<T: std::str::FromStr>(
        errors: &mut HashMap<&'static str, String>,
        name: &'static str,
        text: &str,
        what: &str,
    ) -> Option<T> {
        if text.is_empty() {
            errors.insert(name, "required".to_string());
            return None;
        }
        match text.parse::<T>() {
            Ok(v) => Some(v),
            Err(_) => {
                errors.insert(name, format!("`{text}` is not {what}"));
                None
            }
        }
    }
    fn optional<T: std::str::FromStr>(
        errors: &mut HashMap<&'static str, String>,
        name: &'static str,
        text: &str,
    ) -> Option<Option<T>> {
        if text.is_empty() {
            return Some(None);
        }
        match text.parse::<T>() {
            Ok(v) => Some(Some(v)),
            Err(_) => {
                errors.insert(name, format!("`{text}` is not a whole number"));
                None
            }
        }
    }
    let whole = "a whole number";
    let decimal = "a number";

    let features = number::<usize>(&mut errors, "features", text("features"), whole);
    let classes = number::<usize>(&mut errors, "classes", text("classes"), whole);
    let model = match text("model").parse::<ModelKind>() {
        Ok(m) => Some(m),
        Err(e) => {
            errors.insert("model", e.to_string());
            None
        }
    };
    let strategy = match text("strategy").parse::<Strategy>() {
        Ok(s) => Some(s),
        Err(e) => {
            errors.insert("strategy", e.to_string());
            None
        }
    };
    let seed = number::<u64>(&mut errors, "seed", text("seed"), whole);
    let rounds = number::<u32>(&mut errors, "rounds", text("rounds"), whole);
    let per_round = number::<usize>(
        &mut errors,
        "clients_per_round",
        text("clients_per_round"),
        whole,
    );
    let min = number::<usize>(
        &mut errors,
        "min_participants",
        text("min_participants"),
        whole,
    );
    let over = number::<f64>(
        &mut errors,
        "over_selection",
        text("over_selection"),
        decimal,
    );
    let deadline = number::<u64>(
        &mut errors,
        "collect_deadline_seconds",
        text("collect_deadline_seconds"),
        whole,
    );
    let attempts = number::<u32>(
        &mut errors,
        "max_round_attempts",
        text("max_round_attempts"),
        whole,
    );
    let epochs = number::<u32>(
        &mut errors,
        "train.local_epochs",
        text("train.local_epochs"),
        whole,
    );
    let batch = number::<usize>(
        &mut errors,
        "train.batch_size",
        text("train.batch_size"),
        whole,
    );
    let lr = number::<f32>(&mut errors, "train.lr", text("train.lr"), decimal);
    let momentum = number::<f32>(
        &mut errors,
        "train.momentum",
        text("train.momentum"),
        decimal,
    );
    let decay = number::<f32>(
        &mut errors,
        "train.weight_decay",
        text("train.weight_decay"),
        decimal,
    );
    let secure = if text("secure_aggregation").is_empty() {
        Some(None)
    } else {
        let threshold = optional::<usize>(
            &mut errors,
            "secure_aggregation.threshold",
            text("secure_aggregation.threshold"),
        );
        let neighbours = optional::<usize>(
            &mut errors,
            "secure_aggregation.neighbours",
            text("secure_aggregation.neighbours"),
        );
        let clip = number::<f32>(
            &mut errors,
            "secure_aggregation.clip",
            text("secure_aggregation.clip"),
            decimal,
        )
        .filter(|c| {
            let ok = c.is_finite() && *c > 0.0;
            if !ok {
                errors.insert("secure_aggregation.clip", "must be a number above 0".into());
            }
            ok
        });
        let max_weight = number::<u32>(
            &mut errors,
            "secure_aggregation.max_weight",
            text("secure_aggregation.max_weight"),
            whole,
        );
        let mut seconds = [0u64; 3];
        let mut all = true;
        for (slot, name) in seconds.iter_mut().zip([
            "secure_aggregation.advertise_seconds",
            "secure_aggregation.share_seconds",
            "secure_aggregation.unmask_seconds",
        ]) {
            match number::<u64>(&mut errors, name, text(name), whole) {
                Some(v) => *slot = v,
                None => all = false,
            }
        }
        match (threshold, neighbours, clip, max_weight, all) {
            (Some(threshold), Some(neighbours), Some(clip), Some(max_weight), true) => {
                Some(Some(SecureAggregationSpec {
                    threshold,
                    neighbours,
                    clip,
                    max_weight,
                    advertise_seconds: seconds[0],
                    share_seconds: seconds[1],
                    unmask_seconds: seconds[2],
                }))
            }
            _ => None,
        }
    };

    // A field that did not parse already has its message; the spec-wide rules still run,
    // with the default in its place, so that every other problem shows up at once too.
    let d = ExperimentSpec::dashboard_default();
    let spec = ExperimentSpec {
        name: text("name").to_string(),
        features: features.unwrap_or(d.features),
        classes: classes.unwrap_or(d.classes),
        model: model.unwrap_or(d.model),
        strategy: strategy.unwrap_or(d.strategy),
        rounds: rounds.unwrap_or(d.rounds),
        clients_per_round: per_round.unwrap_or(d.clients_per_round),
        min_participants: min.unwrap_or(d.min_participants),
        over_selection: over.unwrap_or(d.over_selection),
        collect_deadline_seconds: deadline.unwrap_or(d.collect_deadline_seconds),
        max_round_attempts: attempts.unwrap_or(d.max_round_attempts),
        train: TrainSettings {
            local_epochs: epochs.unwrap_or(d.train.local_epochs),
            batch_size: batch.unwrap_or(d.train.batch_size),
            lr: lr.unwrap_or(d.train.lr),
            momentum: momentum.unwrap_or(d.train.momentum),
            weight_decay: decay.unwrap_or(d.train.weight_decay),
        },
        seed: seed.unwrap_or(d.seed),
        secure_aggregation: secure.unwrap_or_else(|| Some(SecureAggregationSpec::default())),
    };
    if text("name").is_empty() {
        errors.insert("name", "required".into());
    }
    for problem in spec.problems() {
        errors.entry(problem.field).or_insert(problem.message);
    }
    if errors.is_empty() {
        Parsed::Spec(Box::new(spec))
    } else {
        Parsed::Invalid(view(&values, &errors))
    }
}

impl ExperimentSpec {
    /// The settings a fresh form shows.
    fn dashboard_default() -> Self {
        let v = defaults();
        let get = |k: &str| v.get(k).cloned().unwrap_or_default();
        Self {
            name: String::new(),
            features: get("features").parse().unwrap_or(64),
            classes: get("classes").parse().unwrap_or(10),
            model: get("model").parse().unwrap_or(ModelKind::LogReg),
            strategy: Strategy::FedAvg,
            rounds: get("rounds").parse().unwrap_or(20),
            clients_per_round: get("clients_per_round").parse().unwrap_or(10),
            min_participants: get("min_participants").parse().unwrap_or(8),
            over_selection: 1.0,
            collect_deadline_seconds: 120,
            max_round_attempts: 3,
            train: TrainSettings::default(),
            seed: 0,
            secure_aggregation: None,
        }
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
