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
//!
//! That epsilon is against observers of the published models: it is amplified by the
//! sampling, which they cannot see. The coordinator draws the sample and knows who is in
//! it, so against the coordinator there is no amplification: what it can learn about one
//! client is bounded by the attempts that client was selected for, each at the full
//! (`q = 1`) mechanism with the attempt's charged multiplier ([`CoordinatorLedger`]).
//! The figure reported is the worst client's. Under central noise the coordinator sees
//! every update in the clear and no epsilon holds against it
//! ([`CoordinatorEpsilon::Unbounded`]). An experiment enforces its budget against one of
//! the two ([`BudgetAgainst`]).

use cohort_aggregation::privacy::rdp::{
    ParticipantLedger, PrivacyError, RdpAccountant, Unamplified,
};
use uuid::Uuid;

use crate::store::{NoiseMechanism, Round, RoundPrivacy, Selection};

use cohort_core::privacy::{BudgetAgainst, PrivacySpec};

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

pub use cohort_core::privacy::CENTRAL_NOISE_UNBOUNDED;

/// Epsilon against the coordinator, which knows who took part in every round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CoordinatorEpsilon {
    /// Central noise: the coordinator sees every update in the clear; no epsilon holds.
    Unbounded,
    /// The worst client's epsilon: its own attempts composed without amplification.
    Bounded {
        /// Epsilon at the experiment's delta.
        epsilon: f64,
        /// Attempts that client was selected for.
        rounds: u64,
    },
}

impl CoordinatorEpsilon {
    /// The figure, `None` when no epsilon holds.
    pub fn epsilon(&self) -> Option<f64> {
        match self {
            CoordinatorEpsilon::Unbounded => None,
            CoordinatorEpsilon::Bounded { epsilon, .. } => Some(*epsilon),
        }
    }

    fn of(worst: Option<Unamplified>, delta: f64) -> Result<Self, PrivacyError> {
        let worst = worst.unwrap_or_default();
        Ok(CoordinatorEpsilon::Bounded {
            epsilon: worst.epsilon(delta)?,
            rounds: worst.rounds,
        })
    }
}

/// What every client has spent against the coordinator: each charged attempt is charged,
/// at `q = 1` and its stored noise multiplier, to every client selected for it. Being
/// selected is what the coordinator knows; whether a client then dropped out (possibly
/// after its masked input counted) is not taken off, so the figure is an upper bound.
#[derive(Debug, Clone, Default)]
pub struct CoordinatorLedger {
    clients: ParticipantLedger<Uuid>,
    /// Some charged attempt added central noise.
    unbounded: bool,
    /// After each charged attempt `(round, attempt)`, in order: the worst client so far.
    after: Vec<((i64, i64), WorstSoFar)>,
}

/// The worst client after a charged attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
enum WorstSoFar {
    /// No epsilon holds against the coordinator (central noise).
    Unbounded,
    /// What the worst client has spent, once anyone has been charged.
    Client(Option<Unamplified>),
}

fn worse(a: Option<Unamplified>, b: Unamplified) -> Unamplified {
    match a {
        Some(a) if (a.rho, a.rounds) >= (b.rho, b.rounds) => a,
        _ => b,
    }
}

impl CoordinatorLedger {
    /// The ledger of every stored charge in `rounds` (in round and attempt order), with
    /// who was selected for each attempt.
    pub fn new(rounds: &[Round], selections: &[Selection]) -> Result<Self, PrivacyError> {
        let mut selected: std::collections::HashMap<(i64, i64), Vec<Uuid>> =
            std::collections::HashMap::new();
        for s in selections {
            selected
                .entry((s.round, s.attempt))
                .or_default()
                .push(s.client_id);
        }
        let mut ledger = Self::default();
        let mut worst = None;
        for r in rounds {
            let Some(p) = &r.privacy else { continue };
            match p.mechanism {
                NoiseMechanism::Central => ledger.unbounded = true,
                NoiseMechanism::Distributed => {
                    for &client in selected.get(&(r.round, r.attempt)).into_iter().flatten() {
                        ledger.clients.charge(client, p.noise_multiplier)?;
                        worst = Some(worse(worst, ledger.clients.spent(&client)));
                    }
                }
            }
            let after = if ledger.unbounded {
                WorstSoFar::Unbounded
            } else {
                WorstSoFar::Client(worst)
            };
            ledger.after.push(((r.round, r.attempt), after));
        }
        Ok(ledger)
    }

    /// Clients charged at least once.
    pub fn clients(&self) -> usize {
        self.clients.participants()
    }

    /// Epsilon against the coordinator now: the worst client's.
    pub fn epsilon(&self, delta: f64) -> Result<CoordinatorEpsilon, PrivacyError> {
        if self.unbounded {
            return Ok(CoordinatorEpsilon::Unbounded);
        }
        CoordinatorEpsilon::of(self.clients.worst().map(|(_, w)| w), delta)
    }

    /// Epsilon against the coordinator after each charged attempt, by `(round, attempt)`:
    /// the worst client's up to and including it, `None` where no epsilon holds.
    pub fn by_attempt(
        &self,
        delta: f64,
    ) -> Result<std::collections::HashMap<(i64, i64), Option<f64>>, PrivacyError> {
        let mut out = std::collections::HashMap::new();
        // The worst figure moves only when its client, or one passing it, takes part:
        // convert each value once.
        let mut last: Option<(Unamplified, f64)> = None;
        for &(key, after) in &self.after {
            let epsilon = match after {
                WorstSoFar::Unbounded => None,
                WorstSoFar::Client(None) => Some(0.0),
                WorstSoFar::Client(Some(w)) => Some(match last {
                    Some((l, e)) if l == w => e,
                    _ => {
                        let e = w.epsilon(delta)?;
                        last = Some((w, e));
                        e
                    }
                }),
            };
            out.insert(key, epsilon);
        }
        Ok(out)
    }

    /// Epsilon against the coordinator of the worst of `selected` if it took part in one
    /// more attempt at `mechanism` and noise multiplier `sigma`: the check before a round
    /// opens. Clients never selected before start from zero.
    pub fn with_round(
        &self,
        selected: &[Uuid],
        mechanism: NoiseMechanism,
        sigma: f64,
        delta: f64,
    ) -> Result<CoordinatorEpsilon, PrivacyError> {
        if self.unbounded || mechanism == NoiseMechanism::Central {
            return Ok(CoordinatorEpsilon::Unbounded);
        }
        CoordinatorEpsilon::of(self.clients.worst_after(selected, sigma)?, delta)
    }
}

/// What a round about to open is charged, before the budget check.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundCharge {
    /// The record stored with the round.
    pub record: RoundPrivacy,
    /// Epsilon against observers after it, which the budget is checked against by
    /// default.
    pub epsilon: f64,
    /// Epsilon against the coordinator after it: the worst selected client's.
    pub coordinator: CoordinatorEpsilon,
}

impl RoundCharge {
    /// The figure the budget is checked against; infinite where no epsilon holds.
    pub fn against(&self, whom: BudgetAgainst) -> f64 {
        match whom {
            BudgetAgainst::Observers => self.epsilon,
            BudgetAgainst::Coordinator => self.coordinator.epsilon().unwrap_or(f64::INFINITY),
        }
    }

    /// Why round `round` must not open under `spec`'s budget (the experiment finishes
    /// instead), or `None` when it may.
    pub fn over_budget(&self, spec: &PrivacySpec, round: i64) -> Option<String> {
        let spent = self.against(spec.budget_against);
        if spent <= spec.epsilon_budget {
            return None;
        }
        Some(match spec.budget_against {
            BudgetAgainst::Observers => format!(
                "finished: privacy budget: round {round} could bring epsilon to {spent:.4} > {}",
                spec.epsilon_budget
            ),
            BudgetAgainst::Coordinator => format!(
                "finished: privacy budget against the coordinator: round {round} could bring \
                 a selected client's epsilon to {spent:.4} > {}",
                spec.epsilon_budget
            ),
        })
    }
}

/// The charge of a round of the `selected` clients drawn from `available` at rate `q`,
/// with `threshold` the fewest survivors that can unmask a secure round (none for central
/// noise), given every earlier attempt in `rounds` and what each client has spent against
/// the coordinator in `ledger`.
pub fn charge_round(
    spec: &PrivacySpec,
    rounds: &[Round],
    ledger: &CoordinatorLedger,
    q: f64,
    denominator: f64,
    selected: &[Uuid],
    threshold: Option<usize>,
) -> Result<RoundCharge, PrivacyError> {
    let (mechanism, worst) = match threshold {
        Some(t) => (
            NoiseMechanism::Distributed,
            spec.noise_multiplier * (t as f64 / selected.len().max(1) as f64).sqrt(),
        ),
        None => (NoiseMechanism::Central, spec.noise_multiplier),
    };
    let epsilon = epsilon_spent(rounds, None, Some((q, worst)), spec.delta)?;
    let coordinator = ledger.with_round(selected, mechanism, worst, spec.delta)?;
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
        coordinator,
    })
}

/// Epsilon against the coordinator after each charged attempt of an experiment with
/// `privacy`, by `(round, attempt)`, from its rounds and who was selected for them.
pub fn epsilon_against_coordinator_by_attempt(
    privacy: &PrivacySpec,
    rounds: &[Round],
    selections: &[Selection],
) -> Result<std::collections::HashMap<(i64, i64), Option<f64>>, PrivacyError> {
    CoordinatorLedger::new(rounds, selections).and_then(|ledger| ledger.by_attempt(privacy.delta))
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
            budget_against: BudgetAgainst::Observers,
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
        let ledger = CoordinatorLedger::default();
        let selected = clients(20);
        let charge = charge_round(&spec(), &[], &ledger, 0.2, 20.0, &selected, Some(11)).unwrap();
        let expected = 1.1 * (11.0f64 / 20.0).sqrt();
        assert!((charge.record.noise_multiplier - expected).abs() < 1e-12);
        assert_eq!(charge.record.mechanism, NoiseMechanism::Distributed);
        let central = charge_round(&spec(), &[], &ledger, 0.2, 20.0, &selected, None).unwrap();
        assert!(charge.epsilon > central.epsilon);
    }

    fn clients(n: u128) -> Vec<Uuid> {
        (1..=n).map(Uuid::from_u128).collect()
    }

    fn distributed(round: i64, q: f64, z: f64) -> Round {
        let mut r = charged(round, q, z);
        r.privacy.as_mut().unwrap().mechanism = NoiseMechanism::Distributed;
        r
    }

    fn select(round: i64, who: &[Uuid]) -> Vec<Selection> {
        who.iter()
            .map(|&client_id| Selection {
                round,
                attempt: 1,
                client_id,
            })
            .collect()
    }

    /// Against the coordinator each client composes only its own attempts, at `q = 1`:
    /// a client in all five rounds sampled at 0.2 has spent what five un-sampled rounds
    /// spend, far more than the observers' figure for the same rounds.
    #[test]
    fn the_coordinator_s_epsilon_is_the_worst_client_s_own_rounds_unamplified() {
        let c = clients(3);
        let rounds: Vec<Round> = (1..=5).map(|r| distributed(r, 0.2, 1.5)).collect();
        let mut selections = Vec::new();
        for r in 1..=5 {
            // c[0] every round, c[1] in round 2 only; c[2] never.
            let mut who = vec![c[0]];
            if r == 2 {
                who.push(c[1]);
            }
            selections.extend(select(r, &who));
        }
        let ledger = CoordinatorLedger::new(&rounds, &selections).unwrap();
        assert_eq!(ledger.clients(), 2);
        let direct = cohort_aggregation::privacy::rdp::epsilon(1.0, 1.5, 5, 1e-5).unwrap();
        let CoordinatorEpsilon::Bounded { epsilon, rounds: n } = ledger.epsilon(1e-5).unwrap()
        else {
            panic!("distributed noise has a bound against the coordinator")
        };
        assert!(
            (epsilon - direct).abs() < 1e-9 * direct,
            "{epsilon} vs {direct}"
        );
        assert_eq!(n, 5);
        let observers = epsilon_spent(&rounds, None, None, 1e-5).unwrap();
        assert!(epsilon > 2.0 * observers, "{epsilon} vs {observers}");
        // Round by round, the worst client's figure so far.
        let by = ledger.by_attempt(1e-5).unwrap();
        for r in 1..=5u64 {
            let expected = cohort_aggregation::privacy::rdp::epsilon(1.0, 1.5, r, 1e-5).unwrap();
            let got = by[&(r as i64, 1)].unwrap();
            assert!((got - expected).abs() < 1e-9 * expected, "round {r}: {got}");
        }
        // The next round is checked against the worst of those selected for it: c[2]
        // and c[1] alone stay far below c[0].
        let with = |who: &[Uuid]| {
            ledger
                .with_round(who, NoiseMechanism::Distributed, 1.5, 1e-5)
                .unwrap()
                .epsilon()
                .unwrap()
        };
        let six = cohort_aggregation::privacy::rdp::epsilon(1.0, 1.5, 6, 1e-5).unwrap();
        assert!((with(&c) - six).abs() < 1e-9 * six);
        let two = cohort_aggregation::privacy::rdp::epsilon(1.0, 1.5, 2, 1e-5).unwrap();
        assert!((with(&c[1..]) - two).abs() < 1e-9 * two);
    }

    /// Under central noise the coordinator sees every update: no number is made up.
    #[test]
    fn central_noise_has_no_epsilon_against_the_coordinator() {
        let c = clients(2);
        let rounds = vec![charged(1, 0.5, 1.1)];
        let ledger = CoordinatorLedger::new(&rounds, &select(1, &c)).unwrap();
        assert_eq!(ledger.epsilon(1e-5).unwrap(), CoordinatorEpsilon::Unbounded);
        assert_eq!(ledger.by_attempt(1e-5).unwrap()[&(1, 1)], None);
        let charge = charge_round(&spec(), &rounds, &ledger, 0.5, 1.0, &c, None).unwrap();
        assert_eq!(charge.coordinator, CoordinatorEpsilon::Unbounded);
        assert_eq!(charge.against(BudgetAgainst::Coordinator), f64::INFINITY);
        assert_eq!(charge.against(BudgetAgainst::Observers), charge.epsilon);
        // Before any charge, nobody has spent anything.
        let empty = CoordinatorLedger::new(&[], &[]).unwrap();
        assert_eq!(
            empty.epsilon(1e-5).unwrap(),
            CoordinatorEpsilon::Bounded {
                epsilon: 0.0,
                rounds: 0
            }
        );
    }

    /// A budget against the coordinator is checked against the worst selected client
    /// after the round at its worst-case multiplier: a round that the observers' budget
    /// lets open is refused when it would take a much-selected client past it.
    #[test]
    fn a_budget_against_the_coordinator_refuses_what_the_observers_budget_allows() {
        let c = clients(20);
        let rounds: Vec<Round> = (1..=3).map(|r| distributed(r, 0.2, 1.1)).collect();
        let selections: Vec<Selection> = (1..=3).flat_map(|r| select(r, &c[..4])).collect();
        let ledger = CoordinatorLedger::new(&rounds, &selections).unwrap();
        let charge = charge_round(&spec(), &rounds, &ledger, 0.2, 4.0, &c[..4], Some(3)).unwrap();
        let budget = 8.0;
        assert!(
            charge.against(BudgetAgainst::Observers) <= budget,
            "{charge:?}"
        );
        assert!(
            charge.against(BudgetAgainst::Coordinator) > budget,
            "{charge:?}"
        );
        let observers = spec();
        assert_eq!(charge.over_budget(&observers, 4), None);
        let coordinator = PrivacySpec {
            budget_against: BudgetAgainst::Coordinator,
            ..spec()
        };
        let why = charge.over_budget(&coordinator, 4).unwrap();
        assert!(why.contains("against the coordinator: round 4"), "{why}");
        // Fresh clients start from zero.
        let fresh = charge_round(&spec(), &rounds, &ledger, 0.2, 4.0, &c[4..8], Some(3)).unwrap();
        assert!(
            fresh.against(BudgetAgainst::Coordinator) <= budget,
            "{fresh:?}"
        );
    }

    #[test]
    fn budget_against_reads_its_two_names_and_stays_out_of_default_specs() {
        assert_eq!("observers".parse(), Ok(BudgetAgainst::Observers));
        assert_eq!(" Coordinator".parse(), Ok(BudgetAgainst::Coordinator));
        assert!("server".parse::<BudgetAgainst>().is_err());
        let text = serde_json::to_value(spec()).unwrap();
        assert!(text.get("budget_against").is_none(), "{text}");
        let parsed: PrivacySpec = serde_json::from_value(serde_json::json!({
            "noise_multiplier": 1.0, "clip": 0.5, "epsilon_budget": 8,
            "budget_against": "coordinator"
        }))
        .unwrap();
        assert_eq!(parsed.budget_against, BudgetAgainst::Coordinator);
        assert_eq!(
            serde_json::to_value(&parsed).unwrap()["budget_against"],
            "coordinator"
        );
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
        // No epsilon holds against a coordinator that sees every update.
        let against_coordinator = PrivacySpec {
            budget_against: BudgetAgainst::Coordinator,
            ..spec()
        };
        assert!(fields(against_coordinator.clone(), true).is_empty());
        assert_eq!(
            fields(against_coordinator, false),
            ["privacy.budget_against"]
        );
    }
}
