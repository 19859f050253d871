//! Differential privacy for served experiments: the settings an experiment asks for, what
//! each round is charged, and the budget check the driver makes before a round opens.
//!
//! A private round selects each available client independently with probability
//! `q = min(1, wanted / available)` (Poisson sampling, which is what the accountant's
//! subsampled Gaussian assumes), clips every update to an L2 bound and adds Gaussian
//! noise of standard deviation `z * clip` to the sum: the coordinator adds it to plain
//! rounds (central noise), and under secure aggregation the clients add it themselves, a
//! Skellam share each before masking, so that the coordinator never sees an un-noised
//! sum (distributed noise). The noisy sum is divided by the expected count `q *
//! available`, a fixed denominator, so the scale does not reveal how many took part.
//!
//! Each attempt is charged when it opens, at the worst case: for distributed noise the
//! multiplier of only the threshold of clients surviving. A published secure round is
//! re-charged at what its survivors actually carried. A failed attempt stays charged:
//! whether a round fails depends on who took part. Epsilon is the RDP composition of every
//! stored charge, so the figure the API shows is the one the budget check used.

use cohort_aggregation::privacy::clip::AdaptiveClip;
use cohort_aggregation::privacy::distributed::{DistributedNoise, SkellamScale};
use cohort_aggregation::privacy::rdp::{PrivacyError, RdpAccountant};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::store::{NoiseMechanism, Round, RoundPrivacy};

/// An experiment's differential privacy settings (`"privacy": {...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
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

/// Epsilon (at `delta`) spent by every charged attempt in `rounds`, with `extra` charged
/// on top (the round about to open, or a round's final charge in place of its
/// provisional one, when `replace` names it).
pub fn epsilon_spent(
    rounds: &[Round],
    replace: Option<(i64, i64)>,
    extra: Option<(f64, f64)>,
    delta: f64,
) -> Result<f64, PrivacyError> {
    let mut accountant = RdpAccountant::new();
    for r in rounds {
        if replace == Some((r.round, r.attempt)) {
            continue;
        }
        if let Some(p) = &r.privacy {
            accountant.compose(p.sampling_rate, p.noise_multiplier, 1)?;
        }
    }
    if let Some((q, z)) = extra {
        accountant.compose(q, z, 1)?;
    }
    accountant.epsilon(delta)
}

/// The clip bound the next round uses: the last published round's adaptive step, or the
/// configured bound.
pub fn current_clip(spec: &PrivacySpec, rounds: &[Round]) -> f64 {
    rounds
        .iter()
        .rev()
        .filter_map(|r| r.privacy.as_ref()?.next_clip)
        .next()
        .unwrap_or(spec.clip)
}

/// What a round about to open is charged, before the budget check.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundCharge {
    /// The record stored with the round.
    pub record: RoundPrivacy,
    /// Epsilon after it, which the budget is checked against.
    pub epsilon: f64,
}

/// The charge of a round of `selected` clients drawn from `available` at rate `q`, with
/// `threshold` the fewest survivors that can unmask a secure round (none for central
/// noise), given every earlier attempt in `rounds`.
pub fn charge_round(
    spec: &PrivacySpec,
    rounds: &[Round],
    q: f64,
    denominator: f64,
    selected: usize,
    threshold: Option<usize>,
) -> Result<RoundCharge, PrivacyError> {
    let (mechanism, worst) = match threshold {
        Some(t) => (
            NoiseMechanism::Distributed,
            spec.noise_multiplier * (t as f64 / selected.max(1) as f64).sqrt(),
        ),
        None => (NoiseMechanism::Central, spec.noise_multiplier),
    };
    let epsilon = epsilon_spent(rounds, None, Some((q, worst)), spec.delta)?;
    Ok(RoundCharge {
        record: RoundPrivacy {
            mechanism,
            sampling_rate: q,
            noise_multiplier: worst,
            clip: current_clip(spec, rounds),
            denominator,
            next_clip: None,
            epsilon,
        },
        epsilon,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RoundStage;

    fn spec() -> PrivacySpec {
        PrivacySpec {
            noise_multiplier: 1.1,
            clip: 0.5,
            delta: 1e-5,
            epsilon_budget: 8.0,
            clip_quantile: None,
            clip_count_noise: None,
        }
    }

    fn charged(round: i64, q: f64, z: f64) -> Round {
        Round {
            experiment_id: uuid::Uuid::nil(),
            round,
            attempt: 1,
            stage: RoundStage::Published,
            stage_deadline: None,
            selected: 10,
            reported: 10,
            dropped: 0,
            test_accuracy: None,
            test_loss: None,
            train_loss: None,
            started_at: 0,
            finished_at: None,
            secagg: None,
            failure: None,
            privacy: Some(RoundPrivacy {
                mechanism: NoiseMechanism::Central,
                sampling_rate: q,
                noise_multiplier: z,
                clip: 0.5,
                denominator: 10.0,
                next_clip: None,
                epsilon: 0.0,
            }),
            epsilon: None,
        }
    }

    /// The stored charges compose to what the accountant gives for the same rounds run
    /// as one mechanism: the served figure is the `cohort privacy epsilon` one.
    #[test]
    fn stored_charges_compose_like_the_accountant() {
        let rounds: Vec<Round> = (1..=50).map(|r| charged(r, 0.2, 1.1)).collect();
        let served = epsilon_spent(&rounds, None, None, 1e-5).unwrap();
        let direct = cohort_aggregation::privacy::rdp::epsilon(0.2, 1.1, 50, 1e-5).unwrap();
        assert!(
            (served - direct).abs() < 1e-9 * direct,
            "{served} vs {direct}"
        );
        // Replacing a round's charge leaves it out and adds the new one.
        let lower = epsilon_spent(&rounds, Some((50, 1)), Some((0.2, 2.0)), 1e-5).unwrap();
        assert!(lower < served);
    }

    /// A distributed round is charged at the multiplier of only the threshold surviving,
    /// which is below the configured one: the budget check can never be optimistic.
    #[test]
    fn distributed_rounds_are_charged_at_the_worst_case() {
        let charge = charge_round(&spec(), &[], 0.2, 20.0, 20, Some(11)).unwrap();
        let expected = 1.1 * (11.0f64 / 20.0).sqrt();
        assert!((charge.record.noise_multiplier - expected).abs() < 1e-12);
        assert_eq!(charge.record.mechanism, NoiseMechanism::Distributed);
        let central = charge_round(&spec(), &[], 0.2, 20.0, 20, None).unwrap();
        assert!(charge.epsilon > central.epsilon);
    }

    #[test]
    fn the_next_clip_comes_from_the_last_adaptive_step() {
        let mut rounds = vec![charged(1, 0.2, 1.1), charged(2, 0.2, 1.1)];
        assert_eq!(current_clip(&spec(), &rounds), 0.5);
        rounds[0].privacy.as_mut().unwrap().next_clip = Some(0.4);
        rounds[1].privacy.as_mut().unwrap().next_clip = Some(0.3);
        assert_eq!(current_clip(&spec(), &rounds), 0.3);
    }

    #[test]
    fn bad_settings_name_their_field() {
        let fields = |s: PrivacySpec, secure: bool| -> Vec<&'static str> {
            s.problems(20, secure).into_iter().map(|(f, _)| f).collect()
        };
        assert!(fields(spec(), false).is_empty());
        assert!(fields(spec(), true).is_empty());
        let bad = PrivacySpec {
            noise_multiplier: -1.0,
            clip: f64::NAN,
            delta: 1.0,
            epsilon_budget: 0.0,
            ..spec()
        };
        assert_eq!(
            fields(bad, false),
            [
                "privacy.noise_multiplier",
                "privacy.clip",
                "privacy.delta",
                "privacy.epsilon_budget"
            ]
        );
        let adaptive = PrivacySpec {
            clip_quantile: Some(0.5),
            ..spec()
        };
        assert!(fields(adaptive.clone(), false).is_empty());
        assert_eq!(fields(adaptive, true), ["privacy.clip_quantile"]);
        // sigma_b at or below z/2 leaves the update no noise of its own.
        let starved = PrivacySpec {
            clip_quantile: Some(0.5),
            clip_count_noise: Some(0.5),
            ..spec()
        };
        assert_eq!(fields(starved, false), ["privacy.clip_count_noise"]);
    }
}
