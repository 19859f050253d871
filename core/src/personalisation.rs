//! An experiment's personalisation ([`cohort_edge::personal`]) against the rest of its
//! spec: the layers it names must be the model's, the rounds synchronous, and the
//! per-client accuracies it reports must not sit beside a guarantee they would break.

use cohort_aggregation::Layout;
use cohort_edge::model::ModelSpec;
use cohort_edge::protocol::TaskPersonalisation;

use crate::{ExperimentSpec, SpecModel};

/// The held-out fraction a client scores its models on when the spec gives none.
pub const DEFAULT_CLIENT_HOLDOUT: f64 = 0.2;

/// Mean and 10th percentile (nearest rank) of `values`, as personalisation reports a
/// metric over the clients; `None` when empty.
pub fn mean_and_p10(values: &[f64]) -> Option<(f64, f64)> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((0.1 * sorted.len() as f64).ceil() as usize).max(1);
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    Some((mean, sorted[rank - 1]))
}

impl ExperimentSpec {
    /// The held-out fraction of a client's examples (built-in models): the spec's, or
    /// [`DEFAULT_CLIENT_HOLDOUT`].
    pub fn client_holdout(&self) -> f64 {
        self.client_holdout.unwrap_or(DEFAULT_CLIENT_HOLDOUT)
    }

    /// What a task tells the client of the experiment's personalisation.
    pub fn task_personalisation(&self) -> Option<TaskPersonalisation> {
        self.personalisation
            .as_ref()
            .map(|scheme| TaskPersonalisation {
                scheme: scheme.clone(),
                holdout: self.client_holdout(),
            })
    }

    /// The model's tensors, when the spec knows them (a built-in model that builds, or
    /// a file model's `tensors`).
    fn known_layout(&self) -> Option<Layout> {
        match &self.model {
            SpecModel::BuiltIn(kind) => ModelSpec::new(kind, self.features, self.classes)
                .ok()
                .map(|m| m.layout().as_ref().clone()),
            SpecModel::File => self
                .tensors
                .as_ref()
                .and_then(|t| Layout::new(t.clone()).ok()),
        }
    }

    /// `personalisation` and `client_holdout` against the model and the other settings.
    pub(crate) fn personalisation_problems(&self, bad: &mut impl FnMut(&'static str, String)) {
        if let Some(holdout) = self.client_holdout
            && !(holdout.is_finite() && holdout > 0.0 && holdout < 0.9)
        {
            bad(
                "client_holdout",
                format!("client_holdout must be above 0 and below 0.9, got {holdout}"),
            );
        }
        let Some(scheme) = &self.personalisation else {
            if self.client_holdout.is_some() {
                bad(
                    "client_holdout",
                    "client_holdout is the split personalised models are scored on: set \
                     personalisation too"
                        .into(),
                );
            }
            return;
        };
        if let Some(layout) = self.known_layout()
            && let Err(e) = scheme.personal_mask(&layout)
        {
            bad("personalisation", e.to_string());
        }
        if self.fedbuff().is_some() {
            bad(
                "personalisation",
                format!("personalisation {scheme} is for synchronous rounds, not mode fedbuff"),
            );
        }
        if self.privacy.is_some() {
            bad(
                "personalisation",
                format!(
                    "personalisation {scheme} with differential privacy: a personal model \
                     trained on the client's data is not covered by the guarantee, and its \
                     accuracy is reported in the clear"
                ),
            );
        }
        if self.secure_aggregation.is_some() {
            bad(
                "personalisation",
                format!(
                    "personalisation {scheme} with secure aggregation: each client reports its \
                     models' accuracy in the clear, beside an update the masking hides"
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ExperimentSpec;

    fn spec(extra: serde_json::Value) -> ExperimentSpec {
        let mut base = serde_json::json!({
            "name": "p", "features": 4, "classes": 3, "model": "mlp:8",
            "rounds": 2, "clients_per_round": 2, "min_participants": 2
        });
        base.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(base).unwrap()
    }

    fn problems(extra: serde_json::Value) -> Vec<(String, String)> {
        match spec(extra).validate() {
            Ok(()) => Vec::new(),
            Err(e) => e
                .problems
                .into_iter()
                .map(|p| (p.field.to_string(), p.message))
                .collect(),
        }
    }

    /// The columns an experiment reads: one per feature of a built-in model, named once,
    /// names a site can list (no comma), the label implied rather than named.
    #[test]
    fn named_columns_must_fit_the_model_and_be_listable() {
        assert!(problems(serde_json::json!({"columns": ["a", "b", "c", "d"]})).is_empty());
        for (columns, says) in [
            (serde_json::json!(["a", "b", "c"]), "model takes 4 features"),
            (serde_json::json!(["a", "b", "c", "a"]), "named twice"),
            (
                serde_json::json!(["a", "b", "c", "label"]),
                "label column is always read",
            ),
            (
                serde_json::json!(["a", "b", "c", "x,y"]),
                "not a column name",
            ),
            (serde_json::json!([]), "at least one column"),
        ] {
            let p = problems(serde_json::json!({ "columns": columns }));
            assert!(
                p.iter().any(|(f, m)| f == "columns" && m.contains(says)),
                "{columns}: {p:?}"
            );
        }
    }

    /// Bad settings are refused before the experiment starts, naming the setting.
    #[test]
    fn unknown_layers_and_clashing_settings_are_refused_by_name() {
        assert!(problems(serde_json::json!({"personalisation": "fedper:layers.1"})).is_empty());
        let p = problems(serde_json::json!({"personalisation": "fedrep:fc2"}));
        assert_eq!(p[0].0, "personalisation");
        assert!(p[0].1.contains("no layer or tensor `fc2`"), "{p:?}");
        let p = problems(
            serde_json::json!({"personalisation": "ditto:0.1", "privacy": {
            "noise_multiplier": 1.0, "clip": 1.0, "delta": 1e-5, "epsilon_budget": 10.0}}),
        );
        assert!(
            p.iter()
                .any(|(f, m)| f == "personalisation" && m.contains("differential privacy")),
            "{p:?}"
        );
        let p =
            problems(serde_json::json!({"client_holdout": 0.95, "personalisation": "finetune:2"}));
        assert_eq!(p[0].0, "client_holdout");
        let p = problems(serde_json::json!({"client_holdout": 0.2}));
        assert!(p[0].1.contains("set personalisation"), "{p:?}");
        let e = serde_json::from_value::<ExperimentSpec>(serde_json::json!({
            "name": "p", "features": 4, "classes": 3, "model": "mlp:8",
            "rounds": 2, "clients_per_round": 2, "min_participants": 2,
            "personalisation": "local"
        }))
        .unwrap_err();
        assert!(
            e.to_string().contains("unknown personalisation `local`"),
            "{e}"
        );
    }

    #[test]
    fn the_tenth_percentile_is_the_nearest_rank() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(super::mean_and_p10(&v), Some((10.5, 2.0)));
        assert_eq!(super::mean_and_p10(&[0.5]), Some((0.5, 0.5)));
        assert_eq!(super::mean_and_p10(&[]), None);
    }

    #[test]
    fn tasks_carry_the_scheme_and_the_holdout() {
        let s = spec(serde_json::json!({"personalisation": "fedper:layers.1"}));
        let task = s.plain_task(uuid::Uuid::nil(), 1, 1, None);
        let p = task.personalisation.unwrap();
        assert_eq!(p.scheme.to_string(), "fedper:layers.1");
        assert_eq!(p.holdout, super::DEFAULT_CLIENT_HOLDOUT);
        assert!(
            task.report_metrics,
            "personalised clients report their accuracies"
        );
    }
}
