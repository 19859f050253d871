//! The round engine: selection, collection and aggregation of one federated round after
//! another, with no knowledge of transport or storage.
//!
//! Simulation drives it in process; the server drives the very same engine from HTTP
//! handlers. Every method either changes state completely or returns an error and
//! changes nothing, so a caller can hand it untrusted input.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use cohort_aggregation::reduce::Reducer;
use cohort_aggregation::{
    AggregationError, Finite, ModelVector, ServerOptimizer, Strategy, WeightedMean,
};
use cohort_core::round::{
    AfterFailure, AttemptEnd, AttemptFailure, CloseOutcome, CohortSize, FailedAttemptPolicy,
    ParticipationState, ParticipationView, RoundStage, RoundView, UploadRefusal,
    after_failed_attempt, check_upload, close_outcome, select_cohort,
};
use cohort_edge::train::TrainConfig;
use rand::Rng;
use serde::Serialize;

/// Identifies a client within an experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ClientId(pub u64);

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "client-{}", self.0)
    }
}

/// How rounds are run: who takes part, what they train, how results are combined.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Clients selected per round; fewer are selected when fewer are available.
    pub clients_per_round: usize,
    /// Quorum: a round with fewer reports than this is abandoned and the global model
    /// stays as it was.
    pub min_participants: usize,
    /// Local training settings sent with every task. The strategy's proximal mu, if any,
    /// overrides `proximal_mu`.
    pub train: TrainConfig,
    /// Federated strategy.
    pub strategy: Strategy,
    /// Server learning rate; `None` takes the strategy's default.
    pub server_lr: Option<f32>,
    /// What a failed attempt (below quorum, or a secure round that could not unmask)
    /// leads to: `cohort simulate` skips to the next round; mirroring `serve`, the round
    /// runs again up to a number of attempts, then the experiment fails.
    pub failed_attempts: FailedAttemptPolicy,
}

/// Why the engine refused a call. The engine's state is unchanged after any of these.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A setting cannot work.
    #[error("invalid engine setting: {0}")]
    InvalidConfig(String),
    /// `open_round` while a round is already collecting.
    #[error("round {0} is still open")]
    RoundAlreadyOpen(u32),
    /// `submit` or `close_round` with no round open.
    #[error("no round is open")]
    NoOpenRound,
    /// `open_round` after a round failed its last attempt.
    #[error("the experiment failed: round {round} failed all {attempts} attempts")]
    ExperimentFailed {
        /// The round.
        round: u32,
        /// Its attempts.
        attempts: u32,
    },
    /// Fewer clients are available than the quorum needs.
    #[error("{available} clients available but the quorum is {quorum}")]
    NotEnoughClients {
        /// Clients offered for selection.
        available: usize,
        /// Minimum participants per round.
        quorum: usize,
    },
    /// A client that was not selected for this round sent an update.
    #[error("{client} was not selected for round {round}")]
    NotSelected {
        /// The sender.
        client: ClientId,
        /// The open round.
        round: u32,
    },
    /// A client sent a second update in the same round.
    #[error("{client} already reported in round {round}")]
    DuplicateUpdate {
        /// The sender.
        client: ClientId,
        /// The open round.
        round: u32,
    },
    /// The update's sample count is zero.
    #[error("{client} reported zero training samples")]
    NoSamples {
        /// The sender.
        client: ClientId,
    },
    /// The reducer (a device) could not hold the round's sums.
    #[error("reducer: {0}")]
    Reducer(String),
    /// The update does not fit the global model, or has non-finite values.
    #[error("update from {client} rejected: {source}")]
    BadUpdate {
        /// The sender.
        client: ClientId,
        /// What was wrong with it.
        source: AggregationError,
    },
}

/// What a selected client is asked to do in a round.
#[derive(Debug, Clone)]
pub struct Task {
    /// Round number, starting at 1.
    pub round: u32,
    /// Attempt at the round, starting at 1.
    pub attempt: u32,
    /// The global model to start from.
    pub global: Arc<ModelVector>,
    /// Local training settings, including the FedProx mu when the strategy has one.
    pub train: TrainConfig,
}

/// The outcome of opening a round: who was selected and what they must do.
#[derive(Debug, Clone)]
pub struct RoundPlan {
    /// Clients selected, in ascending order.
    pub selected: Vec<ClientId>,
    /// The task every selected client receives.
    pub task: Task,
}

/// A client's contribution to a round.
#[derive(Debug, Clone, Copy)]
pub struct ClientUpdate<'a> {
    /// Locally trained parameters, in the global model's layout, checked finite where
    /// they arrived.
    pub params: Finite<'a>,
    /// Training samples behind them (the FedAvg weight).
    pub num_samples: u64,
    /// The client's mean training loss, for reporting.
    pub train_loss: f64,
}

/// What secure aggregation hands the engine: the weighted mean model of the round's
/// participants, and the totals it revealed along with it.
#[derive(Debug, Clone)]
pub struct SecureMean {
    /// The sample-weighted mean of the participants' models.
    pub mean: ModelVector,
    /// Clients whose updates are in the mean.
    pub participants: usize,
    /// Sum of their (capped) sample counts.
    pub samples: u64,
    /// Their sample-weighted mean training loss.
    pub train_loss: Option<f64>,
}

/// Summary of a closed round.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundOutcome {
    /// Round number.
    pub round: u32,
    /// Attempt at the round.
    pub attempt: u32,
    /// Published, or failed and why.
    pub status: AttemptEnd,
    /// Clients selected.
    pub selected: usize,
    /// Clients whose update was folded in.
    pub participants: usize,
    /// Selected clients that never reported.
    pub dropped: usize,
    /// Sum of the participants' sample counts.
    pub samples: u64,
    /// Sample-weighted mean training loss of the participants (`None` when none reported).
    pub train_loss: Option<f64>,
}

struct Collecting {
    round: u32,
    attempt: u32,
    selected: BTreeSet<ClientId>,
    reported: BTreeSet<ClientId>,
    mean: WeightedMean,
    samples: u64,
    loss_sum: f64,
}

/// Runs federated rounds over a global model.
pub struct RoundEngine {
    config: EngineConfig,
    global: Arc<ModelVector>,
    optimizer: ServerOptimizer,
    rounds_closed: u32,
    /// The attempt the next (or open) round runs as.
    attempt: u32,
    /// Set once a round failed its last attempt: no round opens after it.
    failed: bool,
    open: Option<Collecting>,
    reducer: Arc<dyn Reducer>,
}

impl fmt::Debug for RoundEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoundEngine")
            .field("config", &self.config)
            .field("rounds_closed", &self.rounds_closed)
            .field("open_round", &self.open.as_ref().map(|c| c.round))
            .finish()
    }
}

impl RoundEngine {
    /// An engine that starts from `initial`.
    pub fn new(initial: ModelVector, config: EngineConfig) -> Result<Self, EngineError> {
        if config.clients_per_round == 0 {
            return Err(EngineError::InvalidConfig(
                "clients per round must be at least 1".into(),
            ));
        }
        if config.min_participants == 0 || config.min_participants > config.clients_per_round {
            return Err(EngineError::InvalidConfig(format!(
                "minimum participants must be between 1 and clients per round ({}), got {}",
                config.clients_per_round, config.min_participants
            )));
        }
        config
            .train
            .validate()
            .map_err(|e| EngineError::InvalidConfig(e.to_string()))?;
        if !initial.is_finite() {
            return Err(EngineError::InvalidConfig(
                "initial model has non-finite parameters".into(),
            ));
        }
        let optimizer = config
            .strategy
            .server_optimizer(config.server_lr)
            .map_err(|e| EngineError::InvalidConfig(e.to_string()))?;
        Ok(Self {
            config,
            global: Arc::new(initial),
            optimizer,
            rounds_closed: 0,
            attempt: 1,
            failed: false,
            open: None,
            reducer: cohort_aggregation::reduce::cpu(),
        })
    }

    /// Sums the rounds' updates on `reducer` from the next round on (the CPU's cores by
    /// default).
    pub fn set_reducer(&mut self, reducer: Arc<dyn Reducer>) {
        self.reducer = reducer;
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The current global model.
    pub fn global(&self) -> &Arc<ModelVector> {
        &self.global
    }

    /// Rounds done so far: published, or skipped after a failed attempt. (A round that
    /// runs again is not done until its last attempt.)
    pub fn rounds_closed(&self) -> u32 {
        self.rounds_closed
    }

    /// The attempt the next round opens as (1 unless the last one failed and runs again).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Whether a round failed its last attempt, which ends the experiment.
    pub fn experiment_failed(&self) -> bool {
        self.failed
    }

    /// The number of the round now collecting, if any.
    pub fn open_round_number(&self) -> Option<u32> {
        self.open.as_ref().map(|c| c.round)
    }

    /// Selects up to `clients_per_round` of `available` uniformly without replacement
    /// (duplicates in `available` count once) and opens the next round.
    pub fn open_round<R: Rng + ?Sized>(
        &mut self,
        available: &[ClientId],
        rng: &mut R,
    ) -> Result<RoundPlan, EngineError> {
        self.check_can_open()?;
        let size = CohortSize {
            wanted: self.config.clients_per_round,
            needed: self.config.min_participants,
        };
        let Some(selected) = select_cohort(available, size, rng) else {
            return Err(EngineError::NotEnoughClients {
                available: available.iter().collect::<BTreeSet<_>>().len(),
                quorum: self.config.min_participants,
            });
        };
        self.open_with(selected.into_iter().collect())
    }

    /// Opens the next round for exactly `selected` (duplicates count once), chosen by the
    /// caller: Poisson sampling for differential privacy picks each client independently,
    /// so a round may have any size, none included. The quorum is applied at close.
    pub fn open_round_for(&mut self, selected: &[ClientId]) -> Result<RoundPlan, EngineError> {
        self.check_can_open()?;
        self.open_with(selected.iter().copied().collect())
    }

    fn check_can_open(&self) -> Result<(), EngineError> {
        if let Some(c) = &self.open {
            return Err(EngineError::RoundAlreadyOpen(c.round));
        }
        if self.failed {
            return Err(EngineError::ExperimentFailed {
                round: self.rounds_closed + 1,
                attempts: self.attempt,
            });
        }
        Ok(())
    }

    /// Counts the closed attempt by the core's rules: a published round is done; a
    /// failed one runs again, is skipped or fails the experiment, as configured.
    fn count_closed(&mut self, status: AttemptEnd) {
        if status.published() {
            self.rounds_closed += 1;
            self.attempt = 1;
            return;
        }
        match after_failed_attempt(i64::from(self.attempt), self.config.failed_attempts) {
            AfterFailure::Retry(next) => self.attempt = u32::try_from(next).unwrap_or(u32::MAX),
            AfterFailure::NextRound => {
                self.rounds_closed += 1;
                self.attempt = 1;
            }
            AfterFailure::FailExperiment => self.failed = true,
        }
    }

    fn open_with(&mut self, selected: BTreeSet<ClientId>) -> Result<RoundPlan, EngineError> {
        let round = self.rounds_closed + 1;
        let mut train = self.config.train.clone();
        if let Some(mu) = self.config.strategy.proximal_mu() {
            train.proximal_mu = Some(mu);
        }
        let plan = RoundPlan {
            selected: selected.iter().copied().collect(),
            task: Task {
                round,
                attempt: self.attempt,
                global: self.global.clone(),
                train,
            },
        };
        self.open = Some(Collecting {
            round,
            attempt: self.attempt,
            selected,
            reported: BTreeSet::new(),
            mean: WeightedMean::with_reducer(self.global.layout().clone(), self.reducer.as_ref())
                .map_err(|e| EngineError::Reducer(e.to_string()))?,
            samples: 0,
            loss_sum: 0.0,
        });
        Ok(plan)
    }

    /// Folds one client's update into the open round.
    pub fn submit(
        &mut self,
        client: ClientId,
        update: ClientUpdate<'_>,
    ) -> Result<(), EngineError> {
        self.submit_batch(&[(client, update)])
    }

    /// Folds several clients' updates into the open round in one pass over the sums (the
    /// same additions, in the same order, as submitting them one by one). Checks them all
    /// first: a batch with one refused update changes nothing, and the error names that
    /// client. (Their values are [`Finite`] already, checked where they arrived.)
    pub fn submit_batch(
        &mut self,
        updates: &[(ClientId, ClientUpdate<'_>)],
    ) -> Result<(), EngineError> {
        let open = self.open.as_mut().ok_or(EngineError::NoOpenRound)?;
        let mut in_batch = BTreeSet::new();
        // The same upload rule `cohort serve` checks in its store; a simulated round is
        // collecting while it is open and has no deadline (stragglers are cut by the
        // straggler model instead).
        let view = RoundView {
            round: i64::from(open.round),
            attempt: i64::from(open.attempt),
            stage: RoundStage::Collecting,
            deadline_ms: None,
            secure: false,
        };
        for (client, update) in updates {
            let client = *client;
            let part = open.selected.contains(&client).then(|| ParticipationView {
                state: if open.reported.contains(&client) || in_batch.contains(&client) {
                    ParticipationState::Uploaded
                } else {
                    ParticipationState::Selected
                },
                shared_keys: false,
            });
            check_upload(&view, part.as_ref(), 0).map_err(|refusal| match refusal {
                UploadRefusal::NotSelected { .. } => EngineError::NotSelected {
                    client,
                    round: open.round,
                },
                _ => EngineError::DuplicateUpdate {
                    client,
                    round: open.round,
                },
            })?;
            in_batch.insert(client);
            if update.num_samples == 0 {
                return Err(EngineError::NoSamples { client });
            }
            let found = update.params.values().len();
            if found != self.global.len() {
                return Err(EngineError::BadUpdate {
                    client,
                    source: AggregationError::LayoutMismatch {
                        expected: self.global.len(),
                        found,
                    },
                });
            }
        }
        let batch: Vec<(Finite<'_>, f64)> = updates
            .iter()
            .map(|(_, u)| (u.params, u.num_samples as f64))
            .collect();
        // What is left to refuse is a weight that would overflow the sums: the batch's.
        open.mean
            .fold_finite(&batch)
            .map_err(|source| EngineError::BadUpdate {
                client: updates[0].0,
                source,
            })?;
        for (client, update) in updates {
            open.reported.insert(*client);
            open.samples += update.num_samples;
            if update.train_loss.is_finite() {
                open.loss_sum += update.train_loss * update.num_samples as f64;
            }
        }
        Ok(())
    }

    /// Closes the open round with a mean computed elsewhere, without the engine seeing
    /// any single update: secure aggregation's unmasked weighted mean of the
    /// participants' models, or a robust rule's aggregate. `None` when the secure round failed. Updates submitted with
    /// [`submit`](Self::submit) in this round are ignored.
    pub fn close_round_secure(
        &mut self,
        result: Option<SecureMean>,
    ) -> Result<RoundOutcome, EngineError> {
        let open = self.open.as_ref().ok_or(EngineError::NoOpenRound)?;
        if let Some(r) = &result {
            if r.participants > open.selected.len() {
                return Err(EngineError::InvalidConfig(format!(
                    "{} participants in a round of {} selected clients",
                    r.participants,
                    open.selected.len()
                )));
            }
            if r.mean.len() != self.global.len() || !r.mean.is_finite() {
                return Err(EngineError::InvalidConfig(format!(
                    "a secure mean must be {} finite parameters",
                    self.global.len()
                )));
            }
        }
        let open = self.open.take().expect("checked above");
        let quorum = self.config.min_participants;
        let (status, participants, samples, train_loss) = match result {
            Some(r) if close_outcome(r.participants, quorum) == CloseOutcome::Aggregate => {
                let mut next = (*self.global).clone();
                self.optimizer
                    .step(&mut next, &r.mean)
                    .expect("mean has the global layout");
                self.global = Arc::new(next);
                (
                    AttemptEnd::PUBLISHED,
                    r.participants,
                    r.samples,
                    r.train_loss,
                )
            }
            Some(r) => (
                AttemptEnd::failed(AttemptFailure::BelowQuorum),
                r.participants,
                r.samples,
                r.train_loss,
            ),
            None => (AttemptEnd::failed(AttemptFailure::NotUnmasked), 0, 0, None),
        };
        self.count_closed(status);
        Ok(RoundOutcome {
            round: open.round,
            attempt: open.attempt,
            status,
            selected: open.selected.len(),
            participants,
            dropped: open.selected.len() - participants,
            samples,
            train_loss,
        })
    }

    /// Closes the open round: with a quorum, the server optimizer moves the global model
    /// toward the weighted mean; without one, the round is abandoned.
    pub fn close_round(&mut self) -> Result<RoundOutcome, EngineError> {
        let open = self.open.take().ok_or(EngineError::NoOpenRound)?;
        let participants = open.reported.len();
        let quorum = self.config.min_participants;
        let status = if close_outcome(participants, quorum) == CloseOutcome::Aggregate {
            let mean = open
                .mean
                .finish()
                .expect("a quorum of at least one update was folded");
            let mut next = (*self.global).clone();
            self.optimizer
                .step(&mut next, &mean)
                .expect("mean has the global layout");
            self.global = Arc::new(next);
            AttemptEnd::PUBLISHED
        } else {
            AttemptEnd::failed(AttemptFailure::BelowQuorum)
        };
        self.count_closed(status);
        Ok(RoundOutcome {
            round: open.round,
            attempt: open.attempt,
            status,
            selected: open.selected.len(),
            participants,
            dropped: open.selected.len() - participants,
            samples: open.samples,
            train_loss: (open.samples > 0).then(|| open.loss_sum / open.samples as f64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn engine(k: usize, quorum: usize, strategy: Strategy) -> RoundEngine {
        RoundEngine::new(
            ModelVector::from_flat(vec![0.0, 0.0]),
            EngineConfig {
                clients_per_round: k,
                min_participants: quorum,
                train: TrainConfig::default(),
                strategy,
                server_lr: None,
                failed_attempts: FailedAttemptPolicy::Skip,
            },
        )
        .unwrap()
    }

    fn clients(n: u64) -> Vec<ClientId> {
        (0..n).map(ClientId).collect()
    }

    fn update(p: &ModelVector, n: u64) -> ClientUpdate<'_> {
        ClientUpdate {
            params: Finite::check(p.values()).expect("the tests' updates are finite"),
            num_samples: n,
            train_loss: 1.0,
        }
    }

    #[test]
    fn fedavg_round_publishes_sample_weighted_mean() {
        let mut e = engine(2, 1, Strategy::FedAvg);
        let plan = e
            .open_round(&clients(2), &mut ChaCha8Rng::seed_from_u64(0))
            .unwrap();
        assert_eq!(plan.selected, clients(2));
        let a = ModelVector::from_flat(vec![1.0, 2.0]);
        let b = ModelVector::from_flat(vec![4.0, 8.0]);
        e.submit(ClientId(0), update(&a, 2)).unwrap();
        e.submit(ClientId(1), update(&b, 1)).unwrap();
        let out = e.close_round().unwrap();
        assert_eq!(out.status, AttemptEnd::PUBLISHED);
        assert_eq!((out.participants, out.dropped, out.samples), (2, 0, 3));
        assert_eq!(e.global().values(), &[2.0, 4.0]);
        assert_eq!(e.rounds_closed(), 1);
    }

    #[test]
    fn round_below_quorum_leaves_global_model_unchanged() {
        let mut e = engine(3, 2, Strategy::FedAvg);
        e.open_round(&clients(3), &mut ChaCha8Rng::seed_from_u64(0))
            .unwrap();
        let a = ModelVector::from_flat(vec![1.0, 1.0]);
        e.submit(ClientId(0), update(&a, 5)).unwrap();
        let out = e.close_round().unwrap();
        assert_eq!(out.status, AttemptEnd::failed(AttemptFailure::BelowQuorum));
        assert_eq!(out.dropped, 2);
        assert_eq!(e.global().values(), &[0.0, 0.0]);
    }

    #[test]
    fn a_round_below_quorum_runs_again_until_its_last_attempt_then_the_experiment_fails() {
        let mut e = engine(3, 2, Strategy::FedAvg);
        e.config.failed_attempts = FailedAttemptPolicy::Retry { max_attempts: 2 };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let plan = e.open_round(&clients(3), &mut rng).unwrap();
        assert_eq!((plan.task.round, plan.task.attempt), (1, 1));
        let out = e.close_round().unwrap();
        assert_eq!(
            (out.round, out.attempt, out.status),
            (1, 1, AttemptEnd::failed(AttemptFailure::BelowQuorum))
        );
        assert_eq!((e.rounds_closed(), e.attempt()), (0, 2));
        // The second attempt publishes: the next round starts at its first attempt.
        let plan = e.open_round(&clients(3), &mut rng).unwrap();
        assert_eq!((plan.task.round, plan.task.attempt), (1, 2));
        let a = ModelVector::from_flat(vec![1.0, 1.0]);
        for client in &plan.selected[..2] {
            e.submit(*client, update(&a, 1)).unwrap();
        }
        assert_eq!(e.close_round().unwrap().status, AttemptEnd::PUBLISHED);
        assert_eq!((e.rounds_closed(), e.attempt()), (1, 1));
        // Round 2 misses its quorum twice: the experiment fails and nothing opens.
        for attempt in 1..=2 {
            let plan = e.open_round(&clients(3), &mut rng).unwrap();
            assert_eq!((plan.task.round, plan.task.attempt), (2, attempt));
            e.close_round().unwrap();
        }
        assert!(e.experiment_failed());
        assert_eq!(
            e.open_round(&clients(3), &mut rng).unwrap_err(),
            EngineError::ExperimentFailed {
                round: 2,
                attempts: 2
            }
        );
    }

    #[test]
    fn rejected_submissions_change_nothing() {
        let mut e = engine(1, 1, Strategy::FedAvg);
        assert_eq!(
            e.submit(
                ClientId(0),
                update(&ModelVector::from_flat(vec![1.0, 1.0]), 1)
            ),
            Err(EngineError::NoOpenRound)
        );
        let plan = e
            .open_round(&clients(4), &mut ChaCha8Rng::seed_from_u64(3))
            .unwrap();
        let chosen = plan.selected[0];
        let other = clients(4).into_iter().find(|c| *c != chosen).unwrap();
        let good = ModelVector::from_flat(vec![3.0, 3.0]);
        assert!(matches!(
            e.submit(other, update(&good, 1)),
            Err(EngineError::NotSelected { .. })
        ));
        assert!(matches!(
            e.submit(chosen, update(&ModelVector::from_flat(vec![1.0]), 1)),
            Err(EngineError::BadUpdate { .. })
        ));
        // A NaN never reaches the engine: an update's values are checked on arrival.
        assert_eq!(Finite::check(&[0.0, f32::NAN]).map(|_| ()), Err(1));
        assert!(matches!(
            e.submit(chosen, update(&good, 0)),
            Err(EngineError::NoSamples { .. })
        ));
        e.submit(chosen, update(&good, 1)).unwrap();
        assert!(matches!(
            e.submit(chosen, update(&good, 1)),
            Err(EngineError::DuplicateUpdate { .. })
        ));
        e.close_round().unwrap();
        assert_eq!(e.global().values(), &[3.0, 3.0]);
    }

    #[test]
    fn a_batch_folds_as_one_by_one_and_a_bad_one_changes_nothing() {
        let updates = [
            ModelVector::from_flat(vec![1.0, -2.0]),
            ModelVector::from_flat(vec![0.5, 3.25]),
            ModelVector::from_flat(vec![-7.0, 0.125]),
        ];
        let mut one = engine(3, 1, Strategy::FedAvg);
        let plan = one
            .open_round(&clients(3), &mut ChaCha8Rng::seed_from_u64(1))
            .unwrap();
        for (id, u) in plan.selected.iter().zip(&updates) {
            one.submit(*id, update(u, id.0 + 1)).unwrap();
        }
        let mut batch = engine(3, 1, Strategy::FedAvg);
        let plan = batch
            .open_round(&clients(3), &mut ChaCha8Rng::seed_from_u64(1))
            .unwrap();
        let all: Vec<(ClientId, ClientUpdate<'_>)> = plan
            .selected
            .iter()
            .zip(&updates)
            .map(|(id, u)| (*id, update(u, id.0 + 1)))
            .collect();
        let short = ModelVector::from_flat(vec![0.0]);
        let mut spoiled = all.clone();
        spoiled[1].1 = update(&short, 1);
        assert!(matches!(
            batch.submit_batch(&spoiled),
            Err(EngineError::BadUpdate { client, .. }) if client == plan.selected[1]
        ));
        let twice = [all[0], all[0]];
        assert!(matches!(
            batch.submit_batch(&twice),
            Err(EngineError::DuplicateUpdate { .. })
        ));
        batch.submit_batch(&all).unwrap();
        let (a, b) = (one.close_round().unwrap(), batch.close_round().unwrap());
        assert_eq!((a.participants, a.samples), (b.participants, b.samples));
        assert_eq!(one.global().values(), batch.global().values());
    }

    #[test]
    fn selection_is_a_seeded_sample_without_replacement() {
        let mut e = engine(5, 1, Strategy::FedAvg);
        let pick = |e: &mut RoundEngine, seed| {
            let p = e
                .open_round(&clients(20), &mut ChaCha8Rng::seed_from_u64(seed))
                .unwrap();
            e.close_round().unwrap();
            p.selected
        };
        let a = pick(&mut e, 9);
        let b = pick(&mut e, 9);
        assert_eq!(a, b);
        assert_eq!(a.iter().collect::<BTreeSet<_>>().len(), 5);
        assert_ne!(a, pick(&mut e, 10));
    }

    #[test]
    fn fedprox_mu_travels_with_the_task() {
        let mut e = engine(1, 1, Strategy::FedProx { mu: 0.5 });
        let plan = e
            .open_round(&clients(1), &mut ChaCha8Rng::seed_from_u64(0))
            .unwrap();
        assert_eq!(plan.task.train.proximal_mu, Some(0.5));
        assert_eq!(plan.task.round, 1);
    }

    #[test]
    fn second_open_and_bad_quorum_are_errors() {
        let mut e = engine(2, 2, Strategy::FedAvg);
        assert!(matches!(
            e.open_round(&clients(1), &mut ChaCha8Rng::seed_from_u64(0)),
            Err(EngineError::NotEnoughClients { .. })
        ));
        e.open_round(&clients(2), &mut ChaCha8Rng::seed_from_u64(0))
            .unwrap();
        assert_eq!(
            e.open_round(&clients(2), &mut ChaCha8Rng::seed_from_u64(0))
                .unwrap_err(),
            EngineError::RoundAlreadyOpen(1)
        );
        let bad = RoundEngine::new(
            ModelVector::from_flat(vec![0.0]),
            EngineConfig {
                clients_per_round: 2,
                min_participants: 3,
                train: TrainConfig::default(),
                strategy: Strategy::FedAvg,
                server_lr: None,
                failed_attempts: FailedAttemptPolicy::Skip,
            },
        );
        assert!(matches!(bad, Err(EngineError::InvalidConfig(_))));
    }
}
