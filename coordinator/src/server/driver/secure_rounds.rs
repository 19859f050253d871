//! Secure rounds on the coordinator: an experiment's SecAgg+ settings, the protocol
//! state rebuilt from the store, the stage changes the driver makes, and the job that
//! unmasks the sum.
//!
//! Nothing about a round lives only in memory. Each request and each driver step
//! rebuilds the round's [`ServerSession`] from the stored messages (keys, encrypted
//! shares, the set of masked inputs, revealed shares), or takes the replica's snapshot
//! of the stages that have closed, and checks what it must against it; the store then
//! records the change in one transaction that re-checks the round's stage. So any coordinator, restarted or one of several, carries a round on. The
//! coordinator never holds an unmasked update: clients send only masked vectors, and the
//! job removes the masks from their sum alone.

use cohort_aggregation::secagg::{
    self, Confirmation, DirectoryEntry, GraphReveal, RoundConfig, SecAggError, ServerSession,
    ShareKeys, UnmaskShares, Unmasked,
};
use cohort_core::round::{CloseOutcome, close_outcome};
use serde::Serialize;
use utoipa::ToSchema;

use crate::fault::FaultPoint;
use crate::server::AppState;
use crate::server::driver::DriverError;
use crate::store::{
    Participation, Round, RoundStage, SecAggMessageKind, SecureNext, Store, StoreError, now_millis,
};
use cohort_core::ExperimentSpec;

/// Why a secure round's stored state could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SecureRoundError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The protocol refused a message or a stage change.
    #[error(transparent)]
    Protocol(#[from] SecAggError),
    /// A stored value does not parse (a bug or a hand-edited database).
    #[error("corrupt secure round state: {0}")]
    Corrupt(String),
}

/// The round's public settings, or `None` for a plain round.
pub fn round_config(round: &Round) -> Result<Option<RoundConfig>, SecureRoundError> {
    round
        .secagg
        .as_ref()
        .map(|v| {
            serde_json::from_value(v.clone())
                .map_err(|e| SecureRoundError::Corrupt(format!("round settings: {e}")))
        })
        .transpose()
}

fn parse<T: serde::de::DeserializeOwned>(body: &str, what: &str) -> Result<T, SecureRoundError> {
    serde_json::from_str(body).map_err(|e| SecureRoundError::Corrupt(format!("{what}: {e}")))
}

/// Rebuilds the server session of a secure round from the store, up to the stage the
/// round is at: keys, graph nonces, shares, the masked inputs' senders (without their
/// vectors), signatures over the survivor list and revealed shares. A failed round has
/// no session.
pub async fn rebuild(
    store: &Store,
    round: &Round,
    participations: &[Participation],
) -> Result<ServerSession, SecureRoundError> {
    let rank = round.stage.rank();
    if rank == 0 {
        return Err(failed_round(round));
    }
    let (exp, r, a) = (round.experiment_id, round.round, round.attempt);
    let mut session = rebuild_through(store, round, rank - 1, Some(participations)).await?;
    match round.stage {
        RoundStage::Advertising => restore_keys(store, round, &mut session).await?,
        RoundStage::Revealing => {
            for m in store
                .secagg_messages(exp, r, a, SecAggMessageKind::Reveal)
                .await?
            {
                session.receive_reveal(m.index, &parse::<GraphReveal>(&m.body, "stored nonce")?)?;
            }
        }
        RoundStage::Sharing => {
            for m in store
                .secagg_messages(exp, r, a, SecAggMessageKind::Share)
                .await?
            {
                session.receive_shares(m.index, &parse::<ShareKeys>(&m.body, "stored shares")?)?;
            }
        }
        RoundStage::Collecting => restore_masked(participations, &mut session)?,
        RoundStage::Confirming => restore_confirmations(store, round, &mut session).await?,
        _ => {
            let stored = store
                .secagg_messages(exp, r, a, SecAggMessageKind::Unmask)
                .await?;
            let replies = stored
                .iter()
                .map(|m| Ok((m.index, parse::<UnmaskShares>(&m.body, "stored shares")?)))
                .collect::<Result<Vec<_>, SecureRoundError>>()?;
            let replies: Vec<(u32, &UnmaskShares)> = replies.iter().map(|(u, r)| (*u, r)).collect();
            session.receive_unmasks(&replies)?;
            // Survivors excluded for a forged share (their stored answer is the evidence).
            for m in store
                .secagg_messages(exp, r, a, SecAggMessageKind::Forged)
                .await?
            {
                session.exclude(m.index)?;
            }
        }
    }
    Ok(session)
}

/// The server session of a secure round with `closed` and every stage before it ended,
/// and nothing of later stages: a snapshot that no request can change any more once the
/// round is past `closed` (the store records a message only at its own stage), so each
/// replica can rebuild it once and share it between requests ([`crate::server::secagg_snapshots`]).
/// `closed` is a protocol stage from advertising to confirming; the round must be past
/// it.
pub async fn rebuild_closed(
    store: &Store,
    round: &Round,
    closed: RoundStage,
) -> Result<ServerSession, SecureRoundError> {
    let wanted = closed.rank();
    let at = round.stage.rank();
    if at == 0 {
        return Err(failed_round(round));
    }
    if !(1..=RoundStage::Confirming.rank()).contains(&wanted) || at <= wanted {
        return Err(SecureRoundError::Corrupt(format!(
            "round {} attempt {} is {}: {} has not closed",
            round.round,
            round.attempt,
            round.stage.as_str(),
            closed.as_str()
        )));
    }
    rebuild_through(store, round, wanted, None).await
}

/// Rebuilds a session with every stage up to rank `rank` closed (0: none; at most
/// confirming's). The masked inputs' senders come from `participations` when the caller
/// has them, else from the store. A round without the consistency check has no
/// confirming stage to close.
async fn rebuild_through(
    store: &Store,
    round: &Round,
    rank: u8,
    participations: Option<&[Participation]>,
) -> Result<ServerSession, SecureRoundError> {
    let (exp, r, a) = (round.experiment_id, round.round, round.attempt);
    let mut session = ServerSession::new(config_of(round)?)?;
    let rank = rank.min(RoundStage::Confirming.rank());
    if rank < RoundStage::Advertising.rank() {
        return Ok(session);
    }
    restore_keys(store, round, &mut session).await?;
    session.close_advertise()?;
    if rank < RoundStage::Revealing.rank() {
        return Ok(session);
    }
    for m in store
        .secagg_messages(exp, r, a, SecAggMessageKind::Reveal)
        .await?
    {
        session.receive_reveal(m.index, &parse::<GraphReveal>(&m.body, "stored nonce")?)?;
    }
    session.close_reveal()?;
    if rank < RoundStage::Sharing.rank() {
        return Ok(session);
    }
    for m in store
        .secagg_messages(exp, r, a, SecAggMessageKind::Share)
        .await?
    {
        session.receive_shares(m.index, &parse::<ShareKeys>(&m.body, "stored shares")?)?;
    }
    session.close_sharing()?;
    if rank < RoundStage::Collecting.rank() {
        return Ok(session);
    }
    match participations {
        Some(parts) => restore_masked(parts, &mut session)?,
        None => restore_masked(&store.participations(exp, r, a).await?, &mut session)?,
    }
    session.close_collection()?;
    if rank < RoundStage::Confirming.rank() || !session.config().consistency_check {
        return Ok(session);
    }
    restore_confirmations(store, round, &mut session).await?;
    session.close_confirm()?;
    Ok(session)
}

fn config_of(round: &Round) -> Result<RoundConfig, SecureRoundError> {
    round_config(round)?.ok_or_else(|| SecureRoundError::Corrupt("not a secure round".into()))
}

fn failed_round(round: &Round) -> SecureRoundError {
    SecureRoundError::Corrupt(format!(
        "round {} attempt {} failed",
        round.round, round.attempt
    ))
}

/// Keys as stored: the advertised message with the identity it was checked under, so a
/// round is rebuilt with the identities it ran with even if one is reset meanwhile.
async fn restore_keys(
    store: &Store,
    round: &Round,
    session: &mut ServerSession,
) -> Result<(), SecureRoundError> {
    for m in store
        .secagg_messages(
            round.experiment_id,
            round.round,
            round.attempt,
            SecAggMessageKind::Advertise,
        )
        .await?
    {
        let entry = parse::<DirectoryEntry>(&m.body, "stored keys")?;
        session.restore_keys(m.index, &entry.keys, &entry.identity)?;
    }
    Ok(())
}

async fn restore_confirmations(
    store: &Store,
    round: &Round,
    session: &mut ServerSession,
) -> Result<(), SecureRoundError> {
    for m in store
        .secagg_messages(
            round.experiment_id,
            round.round,
            round.attempt,
            SecAggMessageKind::Confirm,
        )
        .await?
    {
        session.receive_confirmation(
            m.index,
            &parse::<Confirmation>(&m.body, "stored signature")?,
        )?;
    }
    Ok(())
}

fn restore_masked(
    participations: &[Participation],
    session: &mut ServerSession,
) -> Result<(), SecureRoundError> {
    let mut masked: Vec<u32> = participations
        .iter()
        .filter(|p| {
            matches!(
                p.secagg_stage.as_deref(),
                Some("masked" | "confirmed" | "unmasked" | "excluded")
            )
        })
        .filter_map(|p| p.secagg_index.and_then(|i| u32::try_from(i).ok()))
        .collect();
    masked.sort_unstable();
    for index in masked {
        session.restore_masked(index)?;
    }
    Ok(())
}

/// Counts of a secure round's clients by progress.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct SecureProgress {
    /// Clients selected.
    pub selected: usize,
    /// Clients that advertised keys (`U1`).
    pub advertised: usize,
    /// Clients that revealed their graph nonce.
    pub revealed: usize,
    /// Clients that sent their shares (`U2`).
    pub shared: usize,
    /// Clients whose masked input is stored (`U3`).
    pub masked: usize,
    /// Survivors that signed the survivor list (consistency check).
    pub confirmed: usize,
    /// Survivors that revealed their shares.
    pub unmasked: usize,
    /// Survivors excluded from unmasking for revealing a forged share.
    pub excluded: usize,
}

/// The progress counts of a round's participations.
pub fn progress(participations: &[Participation]) -> SecureProgress {
    let reached = |stages: &[&str]| {
        participations
            .iter()
            .filter(|p| {
                p.secagg_stage
                    .as_deref()
                    .is_some_and(|s| stages.contains(&s))
            })
            .count()
    };
    SecureProgress {
        selected: participations.len(),
        advertised: reached(&[
            "advertised",
            "revealed",
            "shared",
            "masked",
            "confirmed",
            "unmasked",
            "excluded",
        ]),
        revealed: reached(&[
            "revealed",
            "shared",
            "masked",
            "confirmed",
            "unmasked",
            "excluded",
        ]),
        shared: reached(&["shared", "masked", "confirmed", "unmasked", "excluded"]),
        masked: reached(&["masked", "confirmed", "unmasked", "excluded"]),
        // With the consistency check every answer comes after a signature.
        confirmed: reached(&["confirmed", "unmasked", "excluded"]),
        unmasked: reached(&["unmasked"]),
        excluded: reached(&["excluded"]),
    }
}

/// One driver step for a secure round at a protocol stage: when everyone still in has
/// answered, or the stage's deadline has passed, the stage closes and the round moves
/// on, or fails with the protocol's reason. Unmasking also closes as soon as every
/// secret it needs has `t` shares.
pub async fn step(
    state: &AppState,
    spec: &ExperimentSpec,
    round: &Round,
    quorum: usize,
    job_attempts: i64,
    now: i64,
) -> Result<(), DriverError> {
    let Some(settings) = &spec.secure_aggregation else {
        return Err(DriverError::Spec(
            round.experiment_id,
            "a secure round in an experiment without secure_aggregation".into(),
        ));
    };
    let store = &state.store;
    let (exp, r, a) = (round.experiment_id, round.round, round.attempt);
    let parts = store.participations(exp, r, a).await?;
    let p = progress(&parts);
    let due = round.stage_deadline.is_some_and(|d| now > d);
    let consistency = round_config(round)
        .map_err(secure_error)?
        .is_some_and(|c| c.consistency_check);
    let everyone = match round.stage {
        RoundStage::Advertising => p.advertised >= p.selected,
        RoundStage::Revealing => p.revealed >= p.advertised,
        RoundStage::Sharing => p.shared >= p.revealed,
        RoundStage::Collecting => p.masked >= p.shared,
        RoundStage::Confirming => p.confirmed >= p.masked,
        // Only survivors that signed the list may answer.
        RoundStage::Unmasking if consistency => p.unmasked + p.excluded >= p.confirmed,
        RoundStage::Unmasking => p.unmasked + p.excluded >= p.masked,
        _ => return Ok(()),
    };
    let secs = |s: u64| now + (s as i64) * 1000;
    let next = if round.stage == RoundStage::Unmasking {
        let session = rebuild(store, round, &parts).await.map_err(secure_error)?;
        let missing = session.missing_secrets();
        if missing.is_empty() {
            SecureNext::Aggregate { job_attempts }
        } else if everyone || due {
            SecureNext::Fail {
                reason: format!(
                    "unmasking ended with {} secrets short of {} shares (first: client {})",
                    missing.len(),
                    session.config().threshold,
                    missing[0].0
                ),
            }
        } else {
            return Ok(());
        }
    } else {
        if !(everyone || due) {
            return Ok(());
        }
        let mut session = rebuild(store, round, &parts).await.map_err(secure_error)?;
        let closed = match round.stage {
            RoundStage::Advertising => session.close_advertise().map(|_| ()),
            RoundStage::Revealing => session.close_reveal(),
            RoundStage::Sharing => session.close_sharing(),
            RoundStage::Confirming => session.close_confirm(),
            _ => session.close_collection().map(|_| ()),
        };
        match closed {
            Ok(())
                if round.stage == RoundStage::Collecting
                    && close_outcome(p.masked, quorum) == CloseOutcome::BelowQuorum =>
            {
                SecureNext::Fail {
                    reason: format!("{} masked inputs, below the quorum of {quorum}", p.masked),
                }
            }
            Ok(()) => match round.stage {
                RoundStage::Advertising => SecureNext::Stage {
                    to: RoundStage::Revealing,
                    deadline: secs(settings.reveal_seconds),
                },
                RoundStage::Revealing => SecureNext::Stage {
                    to: RoundStage::Sharing,
                    deadline: secs(settings.share_seconds),
                },
                RoundStage::Sharing => SecureNext::Stage {
                    to: RoundStage::Collecting,
                    deadline: secs(spec.collect_deadline_seconds),
                },
                RoundStage::Collecting if consistency => SecureNext::Stage {
                    to: RoundStage::Confirming,
                    deadline: secs(settings.confirm_seconds),
                },
                _ => SecureNext::Stage {
                    to: RoundStage::Unmasking,
                    deadline: secs(settings.unmask_seconds),
                },
            },
            Err(e) => SecureNext::Fail {
                reason: e.to_string(),
            },
        }
    };
    let point = match (round.stage, &next) {
        (_, SecureNext::Fail { .. }) => None,
        (RoundStage::Advertising, _) => Some(FaultPoint::Advertised),
        (RoundStage::Revealing, _) => Some(FaultPoint::Revealed),
        (RoundStage::Sharing, _) => Some(FaultPoint::Shared),
        (RoundStage::Collecting, _) => Some(FaultPoint::Collected),
        (RoundStage::Confirming, _) => Some(FaultPoint::Confirmed),
        _ => Some(FaultPoint::Unmasked),
    };
    if let Some(point) = point {
        crate::fault::reached(point).await;
    }
    match store
        .advance_secure_round(exp, r, a, round.stage, &next, now)
        .await
    {
        // Another coordinator moved the round first.
        Ok(_) | Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn secure_error(e: SecureRoundError) -> DriverError {
    match e {
        SecureRoundError::Store(s) => DriverError::Store(s),
        other => DriverError::Aggregation(other.to_string()),
    }
}

/// Rebuilds a secure round at aggregation, folds its stored masked inputs into their
/// sum (one at a time, as they are read) and removes the masks. Runs on the blocking
/// pool for the folding and unmasking.
pub async fn unmask_round(
    state: &AppState,
    round: &Round,
) -> Result<Result<Unmasked, SecAggError>, DriverError> {
    let store = &state.store;
    let (exp, r, a) = (round.experiment_id, round.round, round.attempt);
    let parts = store.participations(exp, r, a).await?;
    let mut session = rebuild(store, round, &parts).await.map_err(secure_error)?;
    let uploads = store.uploads(exp, r, a).await?;
    let index_of: std::collections::HashMap<uuid::Uuid, i64> = parts
        .iter()
        .filter_map(|p| Some((p.client_id, p.secagg_index?)))
        .collect();
    let survivors: std::collections::BTreeSet<u32> = session.masked().collect();
    let blobs = state.blobs.clone();
    let words = session.input_words();
    let (dimension, word_bits) = (session.config().dimension, session.quantizer().word_bits());
    let reducer = state.reducer.clone();
    session.set_reducer(reducer.clone());
    tokio::task::spawn_blocking(move || {
        let bad = |e: &dyn std::fmt::Display| DriverError::Aggregation(e.to_string());
        let mut sum = reducer.modular_sum(words).map_err(|e| bad(&e))?;
        let mut folded = std::collections::BTreeSet::new();
        // A batch at a time, as the plain job does: one batch in memory, not the round.
        for batch in uploads.chunks(cohort_aggregation::reduce::batch_len(words)) {
            let mut inputs = Vec::with_capacity(batch.len());
            for upload in batch {
                let index = index_of
                    .get(&upload.client_id)
                    .and_then(|&i| u32::try_from(i).ok())
                    .ok_or_else(|| {
                        DriverError::Aggregation("an upload from outside the round".into())
                    })?;
                if !survivors.contains(&index) || !folded.insert(index) {
                    return Err(DriverError::Aggregation(format!(
                        "upload of client {index} is not a masked input of this round"
                    )));
                }
                let bytes = blobs.get_verified(&upload.blob_path, &upload.sha256)?;
                inputs.push(
                    secagg::messages::decode_masked(&bytes, dimension, word_bits)
                        .map_err(|e| bad(&e))?,
                );
            }
            let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
            sum.add(&refs).map_err(|e| bad(&e))?;
        }
        if folded != survivors {
            return Err(DriverError::Aggregation(
                "a masked input of the round is missing from the uploads".into(),
            ));
        }
        Ok(session.finish_with(sum.read().map_err(|e| bad(&e))?))
    })
    .await
    .map_err(|e| DriverError::Aggregation(e.to_string()))?
}

/// Marks an aggregating secure round failed (its sum could not be unmasked).
pub async fn fail_aggregation(
    state: &AppState,
    round: &Round,
    reason: String,
) -> Result<(), DriverError> {
    match state
        .store
        .advance_secure_round(
            round.experiment_id,
            round.round,
            round.attempt,
            RoundStage::Aggregating,
            &SecureNext::Fail { reason },
            now_millis(),
        )
        .await
    {
        Ok(_) | Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
