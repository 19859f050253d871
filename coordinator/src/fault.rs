//! Crash points for the fault-injection tests.
//!
//! A test that must kill the coordinator at an exact place in a round (between choosing
//! clients and storing the choice, after an upload is stored but before it is answered,
//! with a job's lease held) cannot hit those places by watching the API: each lasts
//! microseconds. So the coordinator names them, and `COHORT_FAULT_PAUSE=<point>` makes
//! it stop at the first one reached: it prints `cohort: fault point <point> reached` to
//! stderr and waits there for ever, for the test to SIGKILL it. Nothing else changes,
//! and with the variable unset (as in production) a point costs one branch on a value
//! read once.
//!
//! With `COHORT_FAULT_ONCE_FILE=<path>` as well, only the process that creates that file
//! pauses: among several replicas sharing one database, exactly one stops, whichever gets
//! there first.

use std::sync::OnceLock;

/// A place in a round where a test can stop the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// Clients are chosen for a round; the round is not stored yet.
    Selection,
    /// A secure round's keys are all in; the round has not moved to revealing.
    Advertised,
    /// A secure round's graph nonces are all in; the round has not moved to sharing.
    Revealed,
    /// A secure round's shares are all in; the round has not moved to collecting.
    Shared,
    /// An upload (plain or masked) is stored and committed; its answer is not sent.
    UploadStored,
    /// A round's collection is complete; it has not moved to confirming, unmasking or
    /// aggregation.
    Collected,
    /// A secure round's signatures over the survivor list are all in; the round has not
    /// moved to unmasking.
    Confirmed,
    /// A secure round's shares are revealed; the round has not moved to aggregation.
    Unmasked,
    /// An aggregation job is claimed (its lease held); it has not started.
    JobClaimed,
    /// A round's new model is written to the blob store; it is not published yet.
    Publishing,
}

impl FaultPoint {
    /// Every point, in the order a round meets them.
    pub const ALL: [FaultPoint; 10] = [
        FaultPoint::Selection,
        FaultPoint::Advertised,
        FaultPoint::Revealed,
        FaultPoint::Shared,
        FaultPoint::UploadStored,
        FaultPoint::Collected,
        FaultPoint::Confirmed,
        FaultPoint::Unmasked,
        FaultPoint::JobClaimed,
        FaultPoint::Publishing,
    ];

    /// The name `COHORT_FAULT_PAUSE` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultPoint::Selection => "selection",
            FaultPoint::Advertised => "advertised",
            FaultPoint::Revealed => "revealed",
            FaultPoint::Confirmed => "confirmed",
            FaultPoint::Shared => "shared",
            FaultPoint::UploadStored => "upload-stored",
            FaultPoint::Collected => "collected",
            FaultPoint::Unmasked => "unmasked",
            FaultPoint::JobClaimed => "job-claimed",
            FaultPoint::Publishing => "publishing",
        }
    }
}

struct Armed {
    point: Option<String>,
    once_file: Option<std::path::PathBuf>,
}

fn armed() -> &'static Armed {
    static ARMED: OnceLock<Armed> = OnceLock::new();
    ARMED.get_or_init(|| Armed {
        point: std::env::var("COHORT_FAULT_PAUSE")
            .ok()
            .filter(|p| !p.is_empty()),
        once_file: std::env::var_os("COHORT_FAULT_ONCE_FILE").map(Into::into),
    })
}

/// Whether this process should stop at `point`: it is the armed point, and (with a once
/// file) this process is the one that created the file.
fn should_pause(point: FaultPoint) -> bool {
    let armed = armed();
    if armed.point.as_deref() != Some(point.as_str()) {
        return false;
    }
    match &armed.once_file {
        None => true,
        Some(path) => std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .is_ok(),
    }
}

/// Stops here for ever when `COHORT_FAULT_PAUSE` names `point` (see the module docs);
/// returns at once otherwise.
pub async fn reached(point: FaultPoint) {
    if should_pause(point) {
        eprintln!("cohort: fault point {} reached", point.as_str());
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn point_names_are_distinct() {
        let names: std::collections::HashSet<_> =
            FaultPoint::ALL.iter().map(|p| p.as_str()).collect();
        assert_eq!(names.len(), FaultPoint::ALL.len());
    }

    #[tokio::test]
    async fn an_unarmed_point_returns_at_once() {
        // The test process does not set COHORT_FAULT_PAUSE.
        for point in FaultPoint::ALL {
            tokio::time::timeout(std::time::Duration::from_secs(1), reached(point))
                .await
                .expect("returns");
        }
    }
}
