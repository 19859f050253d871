//! An experiment's differential privacy settings: the noise, the clip, the budget and
//! whom it holds against, checked field by field. What each round is charged is the
//! coordinator's accounting over its stored rounds.

use cohort_aggregation::privacy::clip::AdaptiveClip;
use cohort_aggregation::privacy::distributed::{DistributedNoise, SkellamScale};
use serde::{Deserialize, Serialize};

/// Why no epsilon holds against the coordinator under central noise: the reason the API
/// and `cohort simulate`'s summary give with their `null`.
pub const CENTRAL_NOISE_UNBOUNDED: &str = "central noise: the coordinator clips and noises \
     the updates itself and sees each one in the clear, so no epsilon holds against it";

/// An experiment's differential privacy settings (`"privacy": {...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PrivacySpec {
    /// Noise multiplier `z`: the noise on the sum of the clipped updates has standard
    /// deviation `z * clip`.
    pub noise_multiplier: f64,
    /// L2 bound on each client's update (its difference from the global model); the
    /// starting bound when clipping is adaptive.
    pub clip: f64,
    /// The `delta` of the (epsilon, delta) guarantee. Default 1e-5.
    #[serde(default = "default_delta")]
    pub delta: f64,
    /// The budget: no round starts that could take epsilon past it.
    pub epsilon_budget: f64,
    /// Adaptive clipping (Andrew et al. 2021; central noise only): the quantile of the
    /// update norms the bound tracks, in (0, 1). Absent: the clip stays fixed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_quantile: Option<f64>,
    /// Adaptive clipping: standard deviation of the noise on the count of clients within
    /// the bound. Default: the expected clients per round / 20. Must be above `z / 2`,
    /// since the count takes its share of the privacy from the update's noise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_count_noise: Option<f64>,
    /// Whom `epsilon_budget` is enforced against: `observers` of the published models
    /// (the default; epsilon amplified by sampling) or the `coordinator` (no
    /// amplification, the worst selected client's epsilon; distributed noise only, since
    /// under central noise the coordinator sees every update).
    #[serde(default, skip_serializing_if = "BudgetAgainst::is_observers")]
    pub budget_against: BudgetAgainst,
}

/// Whom an experiment's epsilon budget is enforced against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum BudgetAgainst {
    /// Anyone who sees only the published models: each round is charged at the sampling
    /// rate (amplification by subsampling).
    #[default]
    Observers,
    /// The coordinator, which draws the sample: no round opens that could take any
    /// selected client's own epsilon, its rounds composed without amplification, past
    /// the budget.
    Coordinator,
}

impl BudgetAgainst {
    /// Whether this is the default, [`BudgetAgainst::Observers`].
    pub fn is_observers(&self) -> bool {
        *self == BudgetAgainst::Observers
    }

    /// The name in settings and forms.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetAgainst::Observers => "observers",
            BudgetAgainst::Coordinator => "coordinator",
        }
    }
}

impl std::fmt::Display for BudgetAgainst {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BudgetAgainst {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "observers" => Ok(BudgetAgainst::Observers),
            "coordinator" => Ok(BudgetAgainst::Coordinator),
            other => Err(format!(
                "budget_against must be observers or coordinator, got `{other}`"
            )),
        }
    }
}

fn default_delta() -> f64 {
    1e-5
}

/// The adaptive rule's geometric step (the paper's default).
pub const ADAPTIVE_CLIP_LEARNING_RATE: f64 = 0.2;

impl PrivacySpec {
    /// Checks the settings for an experiment that selects `wanted` clients per round,
    /// `secure` with secure aggregation (distributed noise) or not; the error names the
    /// field (`privacy.clip`, ...).
    pub fn problems(&self, wanted: usize, secure: bool) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let z = self.noise_multiplier;
        if !(z.is_finite() && z > 0.0 && z <= 1e4) {
            out.push((
                "privacy.noise_multiplier",
                format!("privacy: noise_multiplier must be in (0, 10000], got {z}"),
            ));
        }
        if !(self.clip.is_finite() && self.clip > 0.0 && self.clip <= 1e6) {
            out.push((
                "privacy.clip",
                format!("privacy: clip must be in (0, 1e6], got {}", self.clip),
            ));
        }
        if !(self.delta > 0.0 && self.delta < 1.0) {
            out.push((
                "privacy.delta",
                format!("privacy: delta must be in (0, 1), got {}", self.delta),
            ));
        }
        if !(self.epsilon_budget.is_finite() && self.epsilon_budget > 0.0) {
            out.push((
                "privacy.epsilon_budget",
                format!(
                    "privacy: epsilon_budget must be a positive number, got {}",
                    self.epsilon_budget
                ),
            ));
        }
        if secure && (self.clip_quantile.is_some() || self.clip_count_noise.is_some()) {
            out.push((
                "privacy.clip_quantile",
                "privacy: adaptive clipping is for central noise only: under secure \
                 aggregation the clipped count would need a secure sum of its own"
                    .into(),
            ));
        } else if let Some(quantile) = self.clip_quantile {
            if !(quantile > 0.0 && quantile < 1.0) {
                out.push((
                    "privacy.clip_quantile",
                    format!("privacy: clip_quantile must be in (0, 1), got {quantile}"),
                ));
            } else if z.is_finite() && z > 0.0 {
                let sigma_b = self.count_noise(wanted as f64);
                if let Err(e) = self.update_noise_multiplier(wanted as f64) {
                    out.push(("privacy.clip_count_noise", e));
                } else if !(sigma_b.is_finite() && sigma_b > 0.0) {
                    out.push((
                        "privacy.clip_count_noise",
                        format!("privacy: clip_count_noise must be > 0, got {sigma_b}"),
                    ));
                }
            }
        } else if self.clip_count_noise.is_some() {
            out.push((
                "privacy.clip_count_noise",
                "privacy: clip_count_noise needs clip_quantile (adaptive clipping)".into(),
            ));
        }
        if !secure && self.budget_against == BudgetAgainst::Coordinator {
            out.push((
                "privacy.budget_against",
                "privacy: budget_against coordinator needs secure_aggregation: under central \
                 noise the coordinator sees every update in the clear, so no epsilon holds \
                 against it"
                    .into(),
            ));
        }
        if secure && out.is_empty() {
            let noise = DistributedNoise {
                l2_clip: self.clip as f32,
                noise_multiplier: z,
            };
            // Poisson sampling can select more than `wanted`; twice as many is far past
            // anything it draws in practice.
            if let Err(e) = SkellamScale::new(noise, (2 * wanted.max(1)) as u32) {
                out.push(("privacy", format!("privacy: {e}")));
            }
        }
        out
    }

    /// The standard deviation of the noise on the adaptive rule's count, for rounds of
    /// `expected` clients.
    pub fn count_noise(&self, expected: f64) -> f64 {
        self.clip_count_noise.unwrap_or(expected / 20.0)
    }

    /// The noise multiplier left for the update when adaptive clipping takes its share:
    /// `(z^-2 - (2 sigma_b)^-2)^-1/2` (Andrew et al. 2021, Theorem 1), so that the pair
    /// spends what the Gaussian mechanism at `z` alone would. Without adaptive clipping,
    /// `z`.
    pub fn update_noise_multiplier(&self, expected: f64) -> Result<f64, String> {
        let z = self.noise_multiplier;
        if self.clip_quantile.is_none() {
            return Ok(z);
        }
        let sigma_b = self.count_noise(expected);
        let rest = z.powi(-2) - (2.0 * sigma_b).powi(-2);
        if rest.is_nan() || rest <= 0.0 {
            return Err(format!(
                "privacy: clip_count_noise {sigma_b} leaves no room for the update's noise \
                 at noise_multiplier {z}: it must be above {:.4}",
                z / 2.0
            ));
        }
        Ok(rest.powf(-0.5))
    }

    /// The adaptive rule at `bound`, when clipping is adaptive.
    pub fn adaptive_rule(&self, bound: f64, expected: f64) -> Option<AdaptiveClip> {
        self.clip_quantile.map(|quantile| AdaptiveClip {
            bound: bound as f32,
            target_quantile: quantile,
            learning_rate: ADAPTIVE_CLIP_LEARNING_RATE,
            count_noise_std: self.count_noise(expected),
        })
    }

    /// The distributed noise settings clients get in a secure round.
    pub fn distributed_noise(&self) -> DistributedNoise {
        DistributedNoise {
            l2_clip: self.clip as f32,
            noise_multiplier: self.noise_multiplier,
        }
    }
}
