//! How an experiment schedules training: synchronous rounds, or FedBuff (buffered
//! asynchronous aggregation, Nguyen et al., AISTATS 2022), with its settings and their
//! checks. The fold of a buffer is math, in [`cohort_aggregation::fedbuff`].

use serde::{Deserialize, Serialize};

use crate::ExperimentSpec;

pub use cohort_aggregation::fedbuff::{DEFAULT_STALENESS_EXPONENT, staleness_weight};

/// Largest `buffer_size` a spec may ask for.
pub const MAX_BUFFER_SIZE: usize = 10_000;
/// Largest `concurrency` a spec may ask for.
pub const MAX_CONCURRENCY: usize = 100_000;
/// Largest staleness exponent a spec may ask for (beyond it, any stale update weighs
/// nothing).
pub const MAX_STALENESS_EXPONENT: f64 = 10.0;

/// How an experiment schedules training and aggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ExperimentMode {
    /// Synchronous rounds: a selected cohort, a deadline, a quorum.
    #[default]
    Sync,
    /// Buffered asynchronous aggregation: a server step every `buffer_size` updates.
    Fedbuff,
}

impl ExperimentMode {
    /// Whether this is the default, synchronous mode (which a stored spec leaves out).
    pub fn is_sync(&self) -> bool {
        *self == ExperimentMode::Sync
    }

    /// The spec's text for the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            ExperimentMode::Sync => "sync",
            ExperimentMode::Fedbuff => "fedbuff",
        }
    }
}

/// A mode name that is neither `sync` nor `fedbuff`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode `{0}`: expected sync or fedbuff")]
pub struct UnknownMode(String);

impl std::str::FromStr for ExperimentMode {
    type Err = UnknownMode;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "sync" => Ok(ExperimentMode::Sync),
            "fedbuff" => Ok(ExperimentMode::Fedbuff),
            _ => Err(UnknownMode(text.to_string())),
        }
    }
}

/// A FedBuff experiment's settings, defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FedBuffSettings {
    /// Updates per server step (K).
    pub buffer_size: usize,
    /// Clients training at once (C).
    pub concurrency: usize,
    /// The staleness exponent A of `s(tau) = 1 / (1 + tau)^A`.
    pub staleness_exponent: f64,
    /// Updates staler than this are dropped; none keeps every update.
    pub max_staleness: Option<u32>,
    /// How long a task may take, seconds (`collect_deadline_seconds`).
    pub task_seconds: u64,
}

impl FedBuffSettings {
    /// How long a task may take, ms.
    pub fn task_ms(&self) -> i64 {
        (self.task_seconds as i64).saturating_mul(1000)
    }
}

impl ExperimentSpec {
    /// The FedBuff settings, defaults filled in, when the experiment is in mode `fedbuff`:
    /// `buffer_size` defaults to `clients_per_round` and `concurrency` to the clients a
    /// synchronous round would select (`clients_per_round * over_selection`).
    pub fn fedbuff(&self) -> Option<FedBuffSettings> {
        (self.mode == ExperimentMode::Fedbuff).then(|| FedBuffSettings {
            buffer_size: self.buffer_size.unwrap_or(self.clients_per_round),
            concurrency: self
                .concurrency
                .unwrap_or_else(|| self.selected_per_round()),
            staleness_exponent: self
                .staleness_exponent
                .unwrap_or(DEFAULT_STALENESS_EXPONENT),
            max_staleness: self.max_staleness,
            task_seconds: self.collect_deadline_seconds,
        })
    }
}

/// The mode's problems with a spec, each reported through `bad(field, message)`.
pub(crate) fn problems(spec: &ExperimentSpec, bad: &mut impl FnMut(&'static str, String)) {
    if spec.mode == ExperimentMode::Sync {
        let given = [
            ("buffer_size", spec.buffer_size.is_some()),
            ("concurrency", spec.concurrency.is_some()),
            ("staleness_exponent", spec.staleness_exponent.is_some()),
            ("max_staleness", spec.max_staleness.is_some()),
        ];
        for (field, _) in given.into_iter().filter(|(_, set)| *set) {
            bad(
                field,
                format!("{field} is a FedBuff setting: it needs mode fedbuff"),
            );
        }
        return;
    }
    if spec.secure_aggregation.is_some() {
        bad(
            "secure_aggregation",
            "secure_aggregation does not combine with mode fedbuff: SecAgg+ masks cancel only \
             in the sum of one fixed cohort per round, and a FedBuff buffer fills from \
             whichever clients finish first, trained on different model versions"
                .into(),
        );
    }
    if spec.privacy.is_some() {
        bad(
            "privacy",
            "privacy does not combine with mode fedbuff yet: the accountant charges rounds \
             that sample clients at a known rate, and a FedBuff buffer fills from whichever \
             clients check in and finish first"
                .into(),
        );
    }
    if let Some(rule) = spec.aggregator {
        bad(
            "aggregator",
            format!(
                "aggregator: {rule} does not combine with mode fedbuff: a buffer's updates start \
                 from different model versions and carry staleness weights, which the robust \
                 rules do not take"
            ),
        );
    }
    if let Some(k) = spec.buffer_size
        && !(1..=MAX_BUFFER_SIZE).contains(&k)
    {
        bad(
            "buffer_size",
            format!("buffer_size must be between 1 and {MAX_BUFFER_SIZE}, got {k}"),
        );
    }
    if let Some(c) = spec.concurrency
        && !(1..=MAX_CONCURRENCY).contains(&c)
    {
        bad(
            "concurrency",
            format!("concurrency must be between 1 and {MAX_CONCURRENCY}, got {c}"),
        );
    }
    if let Some(a) = spec.staleness_exponent
        && !(a.is_finite() && (0.0..=MAX_STALENESS_EXPONENT).contains(&a))
    {
        bad(
            "staleness_exponent",
            format!("staleness_exponent must be between 0 and {MAX_STALENESS_EXPONENT}, got {a}"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: serde_json::Value) -> ExperimentSpec {
        let mut spec = serde_json::json!({
            "name": "s", "features": 4, "classes": 2, "model": "logreg",
            "rounds": 5, "clients_per_round": 4, "min_participants": 2
        });
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(spec).unwrap()
    }

    fn all_problems(spec: &ExperimentSpec) -> Vec<crate::SpecProblem> {
        spec.validate().err().map_or_else(Vec::new, |e| e.problems)
    }

    fn fields(spec: &ExperimentSpec) -> Vec<&'static str> {
        all_problems(spec).into_iter().map(|p| p.field).collect()
    }

    #[test]
    fn sync_is_the_default_mode_and_stays_out_of_the_stored_spec() {
        let s = spec(serde_json::json!({}));
        assert_eq!(s.mode, ExperimentMode::Sync);
        assert!(s.fedbuff().is_none());
        assert!(fields(&s).is_empty());
        assert!(serde_json::to_value(&s).unwrap().get("mode").is_none());
        let f = spec(serde_json::json!({"mode": "fedbuff"}));
        assert_eq!(serde_json::to_value(&f).unwrap()["mode"], "fedbuff");
    }

    #[test]
    fn fedbuff_defaults_follow_the_round_settings_and_the_simulation() {
        let s = spec(serde_json::json!({"mode": "fedbuff", "over_selection": 1.5}));
        let f = s.fedbuff().unwrap();
        assert_eq!((f.buffer_size, f.concurrency), (4, 6));
        assert_eq!(f.staleness_exponent, 0.5);
        assert_eq!(f.max_staleness, None);
        assert_eq!(f.task_seconds, s.collect_deadline_seconds);
        let s = spec(serde_json::json!({"mode": "fedbuff", "buffer_size": 3,
            "concurrency": 9, "staleness_exponent": 1.0, "max_staleness": 4}));
        let f = s.fedbuff().unwrap();
        assert_eq!(
            (f.buffer_size, f.concurrency, f.max_staleness),
            (3, 9, Some(4))
        );
        assert!(fields(&s).is_empty());
    }

    #[test]
    fn fedbuff_settings_are_checked_and_name_their_fields() {
        let s = spec(serde_json::json!({"mode": "fedbuff", "buffer_size": 0,
            "concurrency": 0, "staleness_exponent": -1.0}));
        assert_eq!(
            fields(&s),
            ["buffer_size", "concurrency", "staleness_exponent"]
        );
        let s = spec(serde_json::json!({"buffer_size": 3, "max_staleness": 2}));
        assert_eq!(fields(&s), ["buffer_size", "max_staleness"]);
        let secure = spec(serde_json::json!({"mode": "fedbuff", "secure_aggregation": {}}));
        let problems = all_problems(&secure);
        assert_eq!(problems[0].field, "secure_aggregation");
        assert!(problems[0].message.contains("mode fedbuff"), "{problems:?}");
        // Differential privacy and the robust rules assume sync rounds.
        let private = spec(serde_json::json!({"mode": "fedbuff", "privacy":
            {"noise_multiplier": 1.0, "clip": 0.5, "epsilon_budget": 8}}));
        assert!(
            fields(&private).contains(&"privacy"),
            "{:?}",
            all_problems(&private)
        );
        let robust = spec(serde_json::json!({"mode": "fedbuff", "aggregator": "median"}));
        assert!(
            fields(&robust).contains(&"aggregator"),
            "{:?}",
            all_problems(&robust)
        );
        let unknown = serde_json::from_value::<ExperimentSpec>(serde_json::json!({
            "name": "s", "features": 4, "classes": 2, "model": "logreg", "rounds": 5,
            "clients_per_round": 4, "min_participants": 2, "mode": "async"
        }));
        assert!(unknown.is_err());
        assert_eq!(
            "FedBuff".parse::<ExperimentMode>(),
            Ok(ExperimentMode::Fedbuff)
        );
        assert!("async".parse::<ExperimentMode>().is_err());
    }
}
