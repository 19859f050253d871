//! What each replica keeps of secure rounds between requests: snapshots of the protocol
//! stages that have closed, and the rounds' stages for long polls.
//!
//! Every client of a round asks the same questions once a stage closes (the key
//! directory, its neighbours' shares, the survivors) and every message of the next
//! stage is checked against the same closed stages. Rebuilding the round from the
//! store for each of them costs `O(n)` rows per request and `O(n^2)` per stage: at
//! 1,000 clients that was most of a round's time and gigabytes of short-lived memory.
//! A closed stage cannot change (the store records a message only while the round is
//! at that message's stage, in the transaction that checks it), so one rebuild per
//! replica serves all of them, and a replica that restarts simply rebuilds it. Nothing
//! here is the system of record.
//!
//! Long polls ask the round's stage every [`POLL_INTERVAL`]; with a thousand clients
//! waiting, those reads were thousands of queries a second on one row. They share one
//! read per round per [`STAGE_FRESHNESS`] instead; a stage change is seen at most that
//! much later.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_aggregation::secagg::ServerSession;
use tokio::sync::OnceCell;
use uuid::Uuid;

use super::driver::secure_rounds::{SecureRoundError, rebuild_closed};
use crate::store::{Round, RoundStage, Store, StoreError};

/// How often a long poll looks at its round's stage.
pub const POLL_INTERVAL: Duration = Duration::from_millis(150);
/// How old a shared read of a round's stage may be.
pub const STAGE_FRESHNESS: Duration = Duration::from_millis(100);
/// Snapshots kept per replica: a few stages of the rounds running now. The oldest goes
/// first; one dropped by mistake is rebuilt on its next use.
const SNAPSHOTS_KEPT: usize = 64;
/// Rounds whose stage is kept per replica.
const STAGES_KEPT: usize = 1024;

type RoundKey = (Uuid, i64, i64);
type Snapshot = Arc<OnceCell<Arc<ServerSession>>>;

/// A replica's snapshots of closed stages and reads of round stages.
#[derive(Debug, Default)]
pub struct SecureRoundCache {
    snapshots: Mutex<HashMap<(RoundKey, RoundStage), (u64, Snapshot)>>,
    stages: Mutex<HashMap<RoundKey, (Instant, Round)>>,
    next: AtomicU64,
}

impl SecureRoundCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The session of `round` with `closed` and the stages before it ended (see
    /// [`rebuild_closed`]), rebuilt from the store at most once per replica while it is
    /// kept, however many requests ask at once. The round must be past `closed`.
    pub async fn closed(
        &self,
        store: &Store,
        round: &Round,
        closed: RoundStage,
    ) -> Result<Arc<ServerSession>, SecureRoundError> {
        let key = ((round.experiment_id, round.round, round.attempt), closed);
        let cell = {
            let seq = self.next.fetch_add(1, Ordering::Relaxed);
            let mut snapshots = self.snapshots.lock().expect("cache lock");
            if !snapshots.contains_key(&key) && snapshots.len() >= SNAPSHOTS_KEPT {
                let oldest = snapshots
                    .iter()
                    .min_by_key(|(_, (seq, _))| *seq)
                    .map(|(k, _)| *k);
                if let Some(oldest) = oldest {
                    snapshots.remove(&oldest);
                }
            }
            let entry = snapshots
                .entry(key)
                .or_insert_with(|| (seq, Arc::new(OnceCell::new())));
            entry.0 = seq;
            entry.1.clone()
        };
        // A failed rebuild leaves the cell empty: the next request tries again.
        cell.get_or_try_init(|| async { rebuild_closed(store, round, closed).await.map(Arc::new) })
            .await
            .cloned()
    }

    /// The round's row as read from the store at most [`STAGE_FRESHNESS`] ago.
    pub async fn round(
        &self,
        store: &Store,
        experiment: Uuid,
        round: i64,
        attempt: i64,
    ) -> Result<Round, StoreError> {
        let key = (experiment, round, attempt);
        if let Some((at, r)) = self.stages.lock().expect("cache lock").get(&key)
            && at.elapsed() < STAGE_FRESHNESS
        {
            return Ok(r.clone());
        }
        let fresh = store.round(experiment, round, attempt).await?;
        let mut stages = self.stages.lock().expect("cache lock");
        if stages.len() >= STAGES_KEPT {
            stages.retain(|_, (at, _)| at.elapsed() < STAGE_FRESHNESS);
        }
        stages.insert(key, (Instant::now(), fresh.clone()));
        Ok(fresh)
    }
}
