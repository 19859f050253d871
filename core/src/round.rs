//! The rules of a synchronous round: where an attempt is ([`RoundStage`]), where a
//! selected client is ([`ParticipationState`]), and whether an upload is taken
//! ([`check_upload`]). The store checks them inside its transactions; the simulation's
//! engine checks them in memory.

use serde::Serialize;

pub use cohort_edge::protocol::stage::{RoundStage, UnknownStage};

/// Why a round attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AttemptFailure {
    /// Too few uploads when collection closed.
    BelowQuorum,
    /// Secure aggregation could not unmask the sum: too few shares of a secret, or a
    /// share failed its check.
    NotUnmasked,
}

/// How a closed round attempt ended: its last [`RoundStage`] (published or failed) and,
/// when it failed, why. There is no other vocabulary for a round's outcome: a
/// simulation's `metrics.csv` writes it as its `status` column ([`as_str`](Self::as_str)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttemptEnd {
    /// [`RoundStage::Published`] or [`RoundStage::Failed`].
    pub stage: RoundStage,
    /// Why it failed; `None` when published.
    pub failure: Option<AttemptFailure>,
}

impl AttemptEnd {
    /// The attempt published a new global model.
    pub const PUBLISHED: AttemptEnd = AttemptEnd {
        stage: RoundStage::Published,
        failure: None,
    };

    /// The attempt failed, for this reason; the global model is unchanged.
    pub fn failed(why: AttemptFailure) -> Self {
        AttemptEnd {
            stage: RoundStage::Failed,
            failure: Some(why),
        }
    }

    /// Whether the global model moved.
    pub fn published(self) -> bool {
        self.stage == RoundStage::Published
    }

    /// As written in metrics files: `published`, `below_quorum`, or `failed` (secure
    /// aggregation could not unmask).
    pub fn as_str(self) -> &'static str {
        match self.failure {
            None => "published",
            Some(AttemptFailure::BelowQuorum) => "below_quorum",
            Some(AttemptFailure::NotUnmasked) => "failed",
        }
    }
}

impl Serialize for AttemptEnd {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// A selected client's part in a round attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ParticipationState {
    /// Selected; no upload yet.
    Selected,
    /// Its upload is durable.
    Uploaded,
    /// Missed the deadline (or a secure round's stage).
    Dropped,
}

impl ParticipationState {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            ParticipationState::Selected => "selected",
            ParticipationState::Uploaded => "uploaded",
            ParticipationState::Dropped => "dropped",
        }
    }
}

impl std::str::FromStr for ParticipationState {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(match text {
            "selected" => ParticipationState::Selected,
            "uploaded" => ParticipationState::Uploaded,
            "dropped" => ParticipationState::Dropped,
            other => return Err(format!("unknown participation state `{other}`")),
        })
    }
}

/// What an upload rule needs to know of a round attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundView {
    /// Round number, from 1.
    pub round: i64,
    /// Attempt, from 1.
    pub attempt: i64,
    /// Where it is.
    pub stage: RoundStage,
    /// When collection closes, Unix ms; none without a deadline (a simulation).
    pub deadline_ms: Option<i64>,
    /// Whether it runs secure aggregation (uploads are masked inputs).
    pub secure: bool,
}

/// What an upload rule needs to know of the sender's part in the attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParticipationView {
    /// Where it is.
    pub state: ParticipationState,
    /// Secure rounds: whether its encrypted key shares went out (only then may it add a
    /// masked input).
    pub shared_keys: bool,
}

/// Why an upload was refused. Each has its own stable [`code`](Self::code), which the
/// API sends as its error code, so that a client tells "too late" from "not yours"
/// without reading the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UploadRefusal {
    /// The attempt is in another stage (not yet collecting, or already closed).
    #[error("round {round} attempt {attempt} is {stage}, not collecting uploads")]
    NotCollecting {
        /// Round.
        round: i64,
        /// Attempt.
        attempt: i64,
        /// Where it is.
        stage: RoundStage,
    },
    /// The attempt's deadline has passed (its driver has not closed it yet).
    #[error("round {round} attempt {attempt} stopped collecting at its deadline")]
    DeadlinePassed {
        /// Round.
        round: i64,
        /// Attempt.
        attempt: i64,
    },
    /// The sender was not selected for this attempt.
    #[error("the client is not selected for round {round}")]
    NotSelected {
        /// Round.
        round: i64,
    },
    /// The sender's update for this attempt is already durable.
    #[error("the client already uploaded for round {round}")]
    AlreadyUploaded {
        /// Round.
        round: i64,
    },
    /// The sender was dropped from the attempt (it missed a deadline or a stage).
    #[error("the client was dropped from round {round}")]
    Dropped {
        /// Round.
        round: i64,
    },
    /// Secure rounds: the sender's key shares did not go out, so its masks could never
    /// be removed. The API reports it as `dropped_from_round`: closing the sharing stage
    /// drops every client that did not share, in the transaction that opens collection,
    /// so a request can only meet this rule's other half; it stays as the rule's own
    /// check, not trusting the stage change to have done it.
    #[error("the client did not share keys in round {round}")]
    KeysNotShared {
        /// Round.
        round: i64,
    },
    /// FedBuff: the sender's task outlived its deadline (its slot went to another).
    #[error("the client's task of round {round} expired at its deadline")]
    TaskExpired {
        /// The round (buffer) the task was handed out in.
        round: i64,
    },
}

impl UploadRefusal {
    /// Every code an upload refusal can carry, as the API documents them.
    pub const CODES: [&'static str; 6] = [
        "round_not_collecting",
        "deadline_passed",
        "not_selected",
        "already_uploaded",
        "dropped_from_round",
        "task_expired",
    ];

    /// One refusal of each kind (of round 1, attempt 1): for checks that must cover
    /// them all, such as the API's mapping to its error codes.
    pub fn one_of_each() -> [UploadRefusal; 7] {
        [
            UploadRefusal::NotCollecting {
                round: 1,
                attempt: 1,
                stage: RoundStage::Sharing,
            },
            UploadRefusal::DeadlinePassed {
                round: 1,
                attempt: 1,
            },
            UploadRefusal::NotSelected { round: 1 },
            UploadRefusal::AlreadyUploaded { round: 1 },
            UploadRefusal::Dropped { round: 1 },
            UploadRefusal::KeysNotShared { round: 1 },
            UploadRefusal::TaskExpired { round: 1 },
        ]
    }

    /// The stable code the API sends.
    pub fn code(&self) -> &'static str {
        match self {
            UploadRefusal::NotCollecting { .. } => "round_not_collecting",
            UploadRefusal::DeadlinePassed { .. } => "deadline_passed",
            UploadRefusal::NotSelected { .. } => "not_selected",
            UploadRefusal::AlreadyUploaded { .. } => "already_uploaded",
            UploadRefusal::Dropped { .. } => "dropped_from_round",
            UploadRefusal::KeysNotShared { .. } => "dropped_from_round",
            UploadRefusal::TaskExpired { .. } => "task_expired",
        }
    }
}

/// Whether an upload from a client whose part in the attempt is `participation` (none
/// when it was not selected) is taken at `now` (Unix ms): the attempt must be
/// collecting and before its deadline, and the client selected, not yet uploaded and,
/// in a secure round, past sharing its keys. The checks run in this order, so that a
/// late upload is told it is late whoever sends it.
pub fn check_upload(
    round: &RoundView,
    participation: Option<&ParticipationView>,
    now: i64,
) -> Result<(), UploadRefusal> {
    let (number, attempt) = (round.round, round.attempt);
    if round.stage != RoundStage::Collecting {
        return Err(UploadRefusal::NotCollecting {
            round: number,
            attempt,
            stage: round.stage,
        });
    }
    if round.deadline_ms.is_some_and(|deadline| now > deadline) {
        return Err(UploadRefusal::DeadlinePassed {
            round: number,
            attempt,
        });
    }
    match participation {
        None => Err(UploadRefusal::NotSelected { round: number }),
        Some(p) => match p.state {
            ParticipationState::Uploaded => Err(UploadRefusal::AlreadyUploaded { round: number }),
            ParticipationState::Dropped => Err(UploadRefusal::Dropped { round: number }),
            ParticipationState::Selected if round.secure && !p.shared_keys => {
                Err(UploadRefusal::KeysNotShared { round: number })
            }
            ParticipationState::Selected => Ok(()),
        },
    }
}

/// A FedBuff task as its upload finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FedBuffTaskView {
    /// Where the task is.
    pub state: ParticipationState,
    /// The model version it trains on (every FedBuff task has one).
    pub base_version: i64,
    /// When it was handed out, Unix ms.
    pub handed_out_ms: i64,
    /// It was dropped because it outlived its deadline (rather than as too stale, or
    /// by a failure report or a revocation).
    pub expired: bool,
}

/// Whether a FedBuff upload for the task `task` (none when the client holds no task of
/// round `round`) is taken at `now`: the task must be outstanding and younger than
/// `task_ms`. Returns the version the update trained on, from which its staleness is
/// counted.
pub fn check_fedbuff_upload(
    task: Option<&FedBuffTaskView>,
    round: i64,
    task_ms: i64,
    now: i64,
) -> Result<i64, UploadRefusal> {
    let Some(task) = task else {
        return Err(UploadRefusal::NotSelected { round });
    };
    match task.state {
        ParticipationState::Uploaded => Err(UploadRefusal::AlreadyUploaded { round }),
        ParticipationState::Dropped if task.expired => Err(UploadRefusal::TaskExpired { round }),
        ParticipationState::Dropped => Err(UploadRefusal::Dropped { round }),
        ParticipationState::Selected if now > task.handed_out_ms + task_ms => {
            Err(UploadRefusal::TaskExpired { round })
        }
        ParticipationState::Selected => Ok(task.base_version),
    }
}

/// What follows a failed round attempt (a missed quorum, an aggregation that failed
/// every try, a secure round that could not unmask): the attempt after it, or `None`
/// when `attempt` was the experiment's last (`max_attempts`), which then fails.
///
/// Both of `serve`'s drivers ask this one rule: synchronous rounds (a new attempt
/// selects and collects afresh) and FedBuff buffers (a new attempt aggregates the same
/// buffered updates again, since the next buffer is already filling).
pub fn next_attempt(attempt: i64, max_attempts: u32) -> Option<i64> {
    (attempt < i64::from(max_attempts)).then_some(attempt + 1)
}

/// The fewest clients a round can open with, and how many it asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CohortSize {
    /// Clients selected when that many are available.
    pub wanted: usize,
    /// Below this many available clients the round does not open (it waits, or a
    /// simulation stops): the quorum, or more where secure aggregation needs more.
    pub needed: usize,
}

/// Picks a round's cohort: `size.wanted` of the `available` clients (each counted once,
/// whatever order they come in) uniformly without replacement, or all of them when
/// fewer are available; `None` when fewer than `size.needed` are, so the round waits.
/// Returns the cohort in ascending order.
///
/// Both drivers select with this rule; given the same generator state and the same
/// clients (in any order) they pick the same cohort.
pub fn select_cohort<T: Ord + Copy, R: rand::Rng + ?Sized>(
    available: &[T],
    size: CohortSize,
    rng: &mut R,
) -> Option<Vec<T>> {
    let pool: Vec<T> = available
        .iter()
        .copied()
        .collect::<std::collections::BTreeSet<T>>()
        .into_iter()
        .collect();
    if pool.len() < size.needed.max(1) {
        return None;
    }
    let k = size.wanted.clamp(1, pool.len());
    let mut cohort: Vec<T> = rand::seq::index::sample(rng, pool.len(), k)
        .into_iter()
        .map(|i| pool[i])
        .collect();
    cohort.sort_unstable();
    Some(cohort)
}

/// The seed of an attempt's selection when a deployment asks for reproducible cohorts
/// (`cohort serve --selection-seed`): a mix of the deployment's seed, the round and the
/// attempt, so the cohort does not depend on which replica or tick opens the attempt.
pub fn selection_seed(seed: u64, round: i64, attempt: i64) -> u64 {
    // SplitMix64's finaliser over the three: neighbouring rounds get unrelated seeds.
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    mix(mix(mix(seed) ^ round as u64) ^ attempt as u64)
}

/// How an attempt's collection stands: its selected clients, and how many of them
/// uploaded, were dropped (revoked, or left a secure stage) or reported that their
/// training failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Collection {
    /// Clients selected.
    pub selected: usize,
    /// Uploads taken.
    pub reported: usize,
    /// Selected clients dropped before the close.
    pub dropped: usize,
    /// Selected clients that reported a failed training task.
    pub failed: usize,
}

impl Collection {
    /// Whether collection closes now: every selected client has uploaded, dropped or
    /// failed (waiting longer would change nothing), or the deadline passed (`due`).
    pub fn closes(&self, due: bool) -> bool {
        due || self.reported + self.dropped + self.failed >= self.selected
    }
}

/// What closing a collection with `reported` uploads leads to: aggregation with a
/// quorum (and at least one upload, since there is nothing to average otherwise), a
/// failed attempt without.
pub fn close_outcome(reported: usize, quorum: usize) -> CloseOutcome {
    if reported >= quorum.max(1) {
        CloseOutcome::Aggregate
    } else {
        CloseOutcome::BelowQuorum
    }
}

/// What closing an attempt's collection leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseOutcome {
    /// A quorum uploaded: the attempt aggregates (then publishes).
    Aggregate,
    /// Too few uploaded: the attempt fails (see [`after_failed_attempt`]).
    BelowQuorum,
}

/// What a driver does once an attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailedAttemptPolicy {
    /// Run the round again as its next attempt, up to this many attempts; after the last
    /// the experiment fails (`serve`, and the in-memory driver that mirrors it).
    Retry {
        /// Attempts per round (`max_round_attempts`).
        max_attempts: u32,
    },
    /// Count the round as run with the model unchanged and go on with the next
    /// (`cohort simulate`, whose rounds are a fixed budget of training steps).
    Skip,
}

/// What follows a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFailure {
    /// The same round again, as this attempt.
    Retry(i64),
    /// The next round (its first attempt), the model unchanged.
    NextRound,
    /// The experiment fails: its round failed every attempt.
    FailExperiment,
}

/// The rule after a failed attempt (a missed quorum, an aggregation that failed every
/// try, a secure round that could not unmask), for both drivers.
pub fn after_failed_attempt(attempt: i64, policy: FailedAttemptPolicy) -> AfterFailure {
    match policy {
        FailedAttemptPolicy::Skip => AfterFailure::NextRound,
        FailedAttemptPolicy::Retry { max_attempts } => match next_attempt(attempt, max_attempts) {
            Some(next) => AfterFailure::Retry(next),
            None => AfterFailure::FailExperiment,
        },
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_fedbuff_upload_needs_an_outstanding_task_in_time() {
        let task = |state| FedBuffTaskView {
            state,
            base_version: 3,
            handed_out_ms: 1_000,
            expired: false,
        };
        let selected = task(ParticipationState::Selected);
        assert_eq!(check_fedbuff_upload(Some(&selected), 4, 500, 1_500), Ok(3));
        assert_eq!(
            check_fedbuff_upload(Some(&selected), 4, 500, 1_501),
            Err(UploadRefusal::TaskExpired { round: 4 })
        );
        assert_eq!(
            check_fedbuff_upload(None, 4, 500, 1_200),
            Err(UploadRefusal::NotSelected { round: 4 })
        );
        assert_eq!(
            check_fedbuff_upload(Some(&task(ParticipationState::Uploaded)), 4, 500, 1_200),
            Err(UploadRefusal::AlreadyUploaded { round: 4 })
        );
        assert_eq!(
            check_fedbuff_upload(Some(&task(ParticipationState::Dropped)), 4, 500, 1_200),
            Err(UploadRefusal::Dropped { round: 4 })
        );
        let swept = FedBuffTaskView {
            expired: true,
            ..task(ParticipationState::Dropped)
        };
        assert_eq!(
            check_fedbuff_upload(Some(&swept), 4, 500, 1_200),
            Err(UploadRefusal::TaskExpired { round: 4 })
        );
    }

    #[test]
    fn a_failed_attempt_is_followed_by_the_next_until_the_last() {
        assert_eq!(next_attempt(1, 3), Some(2));
        assert_eq!(next_attempt(2, 3), Some(3));
        assert_eq!(next_attempt(3, 3), None);
        assert_eq!(next_attempt(1, 1), None);
    }

    #[test]
    fn collection_closes_when_everyone_is_accounted_for_or_at_the_deadline() {
        let c = Collection {
            selected: 4,
            reported: 2,
            dropped: 1,
            failed: 0,
        };
        assert!(!c.closes(false));
        assert!(c.closes(true));
        assert!(Collection { failed: 1, ..c }.closes(false));
        assert_eq!(close_outcome(c.reported, 2), CloseOutcome::Aggregate);
        assert_eq!(close_outcome(c.reported, 3), CloseOutcome::BelowQuorum);
        // A quorum of zero still needs one upload: there is nothing to average otherwise.
        assert_eq!(close_outcome(0, 0), CloseOutcome::BelowQuorum);
    }

    #[test]
    fn a_failed_attempt_is_retried_skipped_or_ends_the_experiment() {
        let retry = FailedAttemptPolicy::Retry { max_attempts: 2 };
        assert_eq!(after_failed_attempt(1, retry), AfterFailure::Retry(2));
        assert_eq!(after_failed_attempt(2, retry), AfterFailure::FailExperiment);
        assert_eq!(
            after_failed_attempt(1, FailedAttemptPolicy::Skip),
            AfterFailure::NextRound
        );
    }

    #[test]
    fn selection_seeds_differ_between_rounds_and_attempts() {
        let seeds: std::collections::BTreeSet<u64> = (1..=20)
            .flat_map(|r| (1..=3).map(move |a| selection_seed(7, r, a)))
            .collect();
        assert_eq!(seeds.len(), 60);
        assert_ne!(selection_seed(7, 1, 1), selection_seed(8, 1, 1));
    }

    proptest! {
        /// A cohort is `wanted` distinct available clients (all when fewer), sorted;
        /// none below `needed`; and the order the clients are offered in does not matter.
        #[test]
        fn a_cohort_is_a_sorted_sample_of_distinct_available_clients(
            available in prop::collection::vec(0u32..40, 0..30),
            wanted in 1usize..12,
            needed in 0usize..12,
            seed in any::<u64>(),
        ) {
            use rand::SeedableRng;
            let size = CohortSize { wanted, needed };
            let distinct: std::collections::BTreeSet<u32> = available.iter().copied().collect();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let cohort = select_cohort(&available, size, &mut rng);
            let mut reversed: Vec<u32> = available.clone();
            reversed.reverse();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            prop_assert_eq!(&select_cohort(&reversed, size, &mut rng), &cohort);
            match cohort {
                None => prop_assert!(distinct.len() < needed.max(1)),
                Some(cohort) => {
                    prop_assert_eq!(cohort.len(), wanted.min(distinct.len()));
                    prop_assert!(cohort.windows(2).all(|w| w[0] < w[1]));
                    prop_assert!(cohort.iter().all(|c| distinct.contains(c)));
                }
            }
        }
    }

    const STAGES: [RoundStage; 9] = [
        RoundStage::Advertising,
        RoundStage::Revealing,
        RoundStage::Sharing,
        RoundStage::Collecting,
        RoundStage::Confirming,
        RoundStage::Unmasking,
        RoundStage::Aggregating,
        RoundStage::Published,
        RoundStage::Failed,
    ];

    #[test]
    fn stage_names_round_trip_and_ranks_follow_the_round() {
        for stage in STAGES {
            assert_eq!(stage.as_str().parse::<RoundStage>(), Ok(stage));
        }
        let mut running: Vec<RoundStage> = STAGES.into_iter().filter(|s| s.in_progress()).collect();
        running.sort_by_key(|s| s.rank());
        assert_eq!(running.first(), Some(&RoundStage::Advertising));
        assert_eq!(RoundStage::Failed.rank(), 0);
        assert!("closed".parse::<RoundStage>().is_err());
    }

    #[test]
    fn each_refusal_has_its_own_code_and_every_code_is_listed() {
        let all = UploadRefusal::one_of_each();
        let codes: std::collections::BTreeSet<&str> = all.iter().map(UploadRefusal::code).collect();
        let listed: std::collections::BTreeSet<&str> = UploadRefusal::CODES.into_iter().collect();
        assert_eq!(codes, listed);
        // One code per refusal, but for the one the API reports as a drop.
        assert_eq!(codes.len(), all.len() - 1);
    }

    fn stage() -> impl Strategy<Value = RoundStage> {
        prop::sample::select(STAGES.to_vec())
    }

    fn participation() -> impl Strategy<Value = Option<ParticipationView>> {
        prop::option::of(
            (
                prop::sample::select(vec![
                    ParticipationState::Selected,
                    ParticipationState::Uploaded,
                    ParticipationState::Dropped,
                ]),
                any::<bool>(),
            )
                .prop_map(|(state, shared_keys)| ParticipationView { state, shared_keys }),
        )
    }

    proptest! {
        /// An upload is taken exactly when every condition holds, and a refused one
        /// names the first that does not.
        #[test]
        fn an_upload_is_taken_only_when_every_rule_holds(
            stage in stage(),
            deadline in prop::option::of(0i64..100),
            secure in any::<bool>(),
            part in participation(),
            now in 0i64..100,
        ) {
            let round = RoundView { round: 3, attempt: 2, stage, deadline_ms: deadline, secure };
            let verdict = check_upload(&round, part.as_ref(), now);
            let on_time = deadline.is_none_or(|d| now <= d);
            let ok = stage == RoundStage::Collecting
                && on_time
                && part.is_some_and(|p| p.state == ParticipationState::Selected
                    && (!secure || p.shared_keys));
            prop_assert_eq!(verdict.is_ok(), ok);
            if let Err(refusal) = verdict {
                let expected = if stage != RoundStage::Collecting {
                    "round_not_collecting"
                } else if !on_time {
                    "deadline_passed"
                } else {
                    match part.map(|p| p.state) {
                        None => "not_selected",
                        Some(ParticipationState::Uploaded) => "already_uploaded",
                        Some(ParticipationState::Dropped) => "dropped_from_round",
                        Some(ParticipationState::Selected) => "dropped_from_round",
                    }
                };
                prop_assert_eq!(refusal.code(), expected);
            }
        }
    }
}
