//! The queues between runs and trackers: [`Tracker::push`] never waits, each tracker
//! is fed in order by a task of its own that retries while the tracker is down (with
//! backoff, up to [`MAX_BACKOFF`] between tries, so the missing points arrive soon
//! after it is back), and what could not be kept is counted: records that arrive while
//! a queue holds [`QUEUE_CAPACITY`] are dropped, and so are records a tracker rejects.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::mlflow::MlflowSink;
use super::tensorboard::TensorBoardSink;
use super::{Record, SinkError};

/// Records a tracker's queue holds while it is down: a run of a few thousand rounds
/// with a couple of records each, more than an outage of hours at a round a few seconds.
pub const QUEUE_CAPACITY: usize = 10_000;

/// The first wait after a failed try.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// The longest wait between tries.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A tracker a run's records go to.
#[derive(Debug)]
pub enum Sink {
    /// An MLflow tracking server.
    Mlflow(MlflowSink),
    /// TensorBoard event files.
    TensorBoard(TensorBoardSink),
}

impl Sink {
    /// The tracker's name in logs and in `/metrics`.
    pub fn name(&self) -> &'static str {
        match self {
            Sink::Mlflow(_) => "mlflow",
            Sink::TensorBoard(_) => "tensorboard",
        }
    }

    async fn send(&mut self, record: &Record) -> Result<(), SinkError> {
        match self {
            Sink::Mlflow(s) => s.send(record).await,
            Sink::TensorBoard(s) => s.send(record).await,
        }
    }
}

/// What one tracker's queue has done, for `/metrics`.
#[derive(Debug, Default)]
pub struct OutboxCounts {
    sent: AtomicU64,
    retries: AtomicU64,
    dropped_full: AtomicU64,
    dropped_rejected: AtomicU64,
}

/// A reading of one tracker's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxStats {
    /// The tracker (`mlflow`, `tensorboard`).
    pub sink: &'static str,
    /// Records the tracker took.
    pub sent: u64,
    /// Tries that failed and were tried again.
    pub retries: u64,
    /// Records dropped because the queue was full.
    pub dropped_full: u64,
    /// Records dropped because the tracker rejected them.
    pub dropped_rejected: u64,
    /// Records waiting now.
    pub queued: u64,
}

#[derive(Debug)]
struct Outbox {
    sink: &'static str,
    queue: Mutex<VecDeque<Record>>,
    wake: Notify,
    counts: OutboxCounts,
    capacity: usize,
}

impl Outbox {
    fn queued(&self) -> usize {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn stats(&self) -> OutboxStats {
        let c = &self.counts;
        OutboxStats {
            sink: self.sink,
            sent: c.sent.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            dropped_full: c.dropped_full.load(Ordering::Relaxed),
            dropped_rejected: c.dropped_rejected.load(Ordering::Relaxed),
            queued: self.queued() as u64,
        }
    }

    /// Feeds the sink in order, forever: the front record leaves the queue only once
    /// the sink took or rejected it.
    async fn feed(self: Arc<Self>, mut sink: Sink) {
        let mut backoff = FIRST_BACKOFF;
        let mut failing = false;
        loop {
            let front = self
                .queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .front()
                .cloned();
            let Some(record) = front else {
                self.wake.notified().await;
                continue;
            };
            let outcome = sink.send(&record).await;
            match outcome {
                Ok(()) => {
                    self.counts.sent.fetch_add(1, Ordering::Relaxed);
                    if failing {
                        tracing::info!(sink = self.sink, "tracker reachable again");
                    }
                    failing = false;
                    backoff = FIRST_BACKOFF;
                }
                Err(SinkError::Transient(why)) => {
                    self.counts.retries.fetch_add(1, Ordering::Relaxed);
                    // One line per outage, not one per try.
                    if !failing {
                        tracing::warn!(sink = self.sink, error = %why,
                            "tracker unreachable; its records wait in the queue");
                    }
                    failing = true;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
                Err(SinkError::Rejected(why)) => {
                    self.counts.dropped_rejected.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(sink = self.sink, run = %record.run().key, error = %why,
                        "tracker rejected a record; dropped");
                }
            }
            self.queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
        }
    }
}

/// The handle runs push their records into: one queue and one feeding task per
/// tracker. Cheap to clone; with no trackers, pushing does nothing.
#[derive(Debug, Clone, Default)]
pub struct Tracker {
    outboxes: Vec<Arc<Outbox>>,
}

impl Tracker {
    /// Starts feeding `sinks` on the current tokio runtime, each queue holding up to
    /// `capacity` records.
    pub fn start(sinks: Vec<Sink>, capacity: usize) -> Self {
        let outboxes = sinks
            .into_iter()
            .map(|sink| {
                let outbox = Arc::new(Outbox {
                    sink: sink.name(),
                    queue: Mutex::new(VecDeque::new()),
                    wake: Notify::new(),
                    counts: OutboxCounts::default(),
                    capacity,
                });
                tokio::spawn(outbox.clone().feed(sink));
                outbox
            })
            .collect();
        Self { outboxes }
    }

    /// Whether any tracker listens (callers skip gathering records otherwise).
    pub fn is_active(&self) -> bool {
        !self.outboxes.is_empty()
    }

    /// Queues `record` for every tracker; returns at once. A full queue drops it and
    /// counts it.
    pub fn push(&self, record: Record) {
        for outbox in &self.outboxes {
            let mut queue = outbox.queue.lock().unwrap_or_else(|e| e.into_inner());
            if queue.len() >= outbox.capacity {
                drop(queue);
                outbox.counts.dropped_full.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    sink = outbox.sink,
                    run = %record.run().key,
                    "tracker queue full; record dropped"
                );
                continue;
            }
            queue.push_back(record.clone());
            drop(queue);
            outbox.wake.notify_one();
        }
    }

    /// Each tracker's counts.
    pub fn stats(&self) -> Vec<OutboxStats> {
        self.outboxes.iter().map(|o| o.stats()).collect()
    }

    /// Waits up to `limit` for every queue to empty; returns the records still waiting.
    pub async fn drain(&self, limit: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let waiting: usize = self.outboxes.iter().map(|o| o.queued()).sum();
            if waiting == 0 || tokio::time::Instant::now() >= deadline {
                return waiting;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A [`Tracker`] for code without a tokio runtime (`cohort simulate`): its queues are
/// fed on a thread of their own, which stops when this is dropped.
#[derive(Debug)]
pub struct BackgroundTracker {
    tracker: Tracker,
    runtime: Option<tokio::runtime::Runtime>,
}

impl BackgroundTracker {
    /// Starts feeding the sinks `make` builds (inside the runtime, which an HTTP client
    /// needs), each queue holding up to `capacity` records.
    pub fn start(make: impl FnOnce() -> Vec<Sink>, capacity: usize) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("cohort-tracking")
            .enable_all()
            .build()?;
        let tracker = runtime.block_on(async { Tracker::start(make(), capacity) });
        Ok(Self {
            tracker,
            runtime: Some(runtime),
        })
    }

    /// The handle to push records into.
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// Waits up to `limit` for every queue to empty; returns the records still waiting.
    pub fn drain(&self, limit: Duration) -> usize {
        match &self.runtime {
            Some(rt) => rt.block_on(self.tracker.drain(limit)),
            None => 0,
        }
    }
}

impl Drop for BackgroundTracker {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracking::RunRef;

    fn run() -> RunRef {
        RunRef {
            key: "k".into(),
            experiment: "e".into(),
            name: "r".into(),
            params: Arc::default(),
        }
    }

    /// A tracker that is down does not hold the caller up: records wait, in order, and
    /// arrive once it is back; past the queue's capacity they are dropped and counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_wait_for_a_tracker_that_is_down_and_overflow_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        // A TensorBoard directory under a regular file cannot be created: down.
        let blocker = dir.path().join("blocker");
        std::fs::write(&blocker, b"").unwrap();
        let tracker = Tracker::start(
            vec![Sink::TensorBoard(TensorBoardSink::new(blocker.join("tb")))],
            3,
        );
        let started = std::time::Instant::now();
        for step in 0..5 {
            tracker.push(Record::metrics(run(), step, &[("accuracy/test", 0.5)]));
        }
        assert!(
            started.elapsed() < Duration::from_millis(100),
            "push waited"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stats = tracker.stats()[0];
        assert_eq!(stats.queued, 3);
        assert_eq!(stats.dropped_full, 2);
        assert!(stats.retries >= 1, "{stats:?}");
        assert_eq!(stats.sent, 0);
        // Back up: the queued three arrive.
        std::fs::remove_file(&blocker).unwrap();
        assert_eq!(tracker.drain(Duration::from_secs(20)).await, 0);
        let stats = tracker.stats()[0];
        assert_eq!((stats.sent, stats.queued, stats.dropped_full), (3, 0, 2));
        let written: Vec<_> = std::fs::read_dir(blocker.join("tb").join("r"))
            .unwrap()
            .collect();
        assert_eq!(written.len(), 1);
    }

    #[tokio::test]
    async fn without_trackers_pushing_does_nothing() {
        let tracker = Tracker::default();
        assert!(!tracker.is_active());
        tracker.push(Record::Start(run()));
        assert!(tracker.stats().is_empty());
        assert_eq!(tracker.drain(Duration::ZERO).await, 0);
    }
}
