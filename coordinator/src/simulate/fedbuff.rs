//! FedBuff: buffered asynchronous aggregation (Nguyen et al., "Federated Learning with
//! Buffered Asynchronous Aggregation", AISTATS 2022), as an event-driven simulation on
//! the straggler model's clock.
//!
//! `concurrency` clients, drawn at random, train at any moment, each on the model that
//! was current when it started. When one finishes, its update (trained model minus the
//! model it started from) goes into the buffer and a fresh client, drawn from those not
//! training, starts on the current model; slow clients hold nobody back. Every
//! `buffer-size` (K) updates the server takes a step:
//!
//! ```text
//! delta  = sum_i n_i s(tau_i) delta_i / sum_i n_i        s(tau) = 1 / (1 + tau)^A
//! model <- server_optimizer.step(model, model + delta)   (plain averaging: model + lr delta)
//! ```
//!
//! where `n_i` is the client's sample count and `tau_i` the server steps taken since it
//! downloaded its model: [`BufferFold`], the fold `cohort serve` takes its FedBuff steps
//! with. Weighting by samples, as synchronous FedAvg does, keeps the two
//! modes' aggregates the same when nothing is stale; dividing by the samples rather than
//! by the staleness-weighted samples follows the paper (it divides by K), so stale
//! updates shrink the step rather than only each other's share. With equal sample
//! counts this is exactly the paper's rule.
//!
//! Each server step is one row of `metrics.csv`. Results depend only on the seed: events
//! are ordered by simulated finish time, ties by start order, and every task trains with
//! its own seed, so the pending tasks can train in parallel in any order.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::Instant;

use cohort_aggregation::ModelVector;
use cohort_aggregation::fedbuff::BufferFold;
use cohort_aggregation::reduce::Reducer;
use cohort_edge::train::TrainConfig;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::SimulationError;
use super::config::{ConfigError, SimulationConfig};
use super::population::{ClientFailure, ClientTask, Population, TaskResult, malicious_clients};
use super::record::{RoundRecord, SimulationResult};
use super::straggler::Stragglers;
use crate::engine::{ClientId, EngineError};
use crate::seeds::{Stream, derive_seed};

/// A client's task between its start and its finish.
struct Task {
    client: ClientId,
    /// The server version the client downloaded.
    version: u32,
    /// The model it trains from.
    model: Arc<ModelVector>,
    /// Simulated time it finishes.
    finish: f64,
    /// It will never report (the dropout model); it still occupies its slot.
    drops: bool,
    /// Its trained model, once computed.
    update: Option<TaskResult>,
}

/// A task's finish, ordered by simulated time and then by start order, so that ties
/// (equal clients, or no straggler model) resolve the same way on every run.
#[derive(Debug, Clone, Copy)]
struct Finish {
    time: f64,
    seq: u64,
}

impl PartialEq for Finish {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Finish {}

impl PartialOrd for Finish {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Finish {
    fn cmp(&self, other: &Self) -> Ordering {
        self.time
            .total_cmp(&other.time)
            .then(self.seq.cmp(&other.seq))
    }
}

/// Who trains when: the idle clients, the tasks in flight and their finish events.
struct Scheduler<'a> {
    cfg: &'a SimulationConfig,
    pop: &'a dyn Population,
    train: TrainConfig,
    stragglers: Stragglers,
    idle: Vec<ClientId>,
    tasks: BTreeMap<u64, Task>,
    events: BinaryHeap<Reverse<Finish>>,
    next_seq: u64,
    select_rng: ChaCha8Rng,
    drop_rng: ChaCha8Rng,
    /// Most tasks trained at once: bounds the memory held by trained updates.
    chunk: usize,
}

impl Scheduler<'_> {
    /// A random idle client starts training at `now` on `model`, version `version`.
    fn start(&mut self, now: f64, model: &Arc<ModelVector>, version: u32) {
        if self.idle.is_empty() {
            return;
        }
        let client = self
            .idle
            .swap_remove(self.select_rng.random_range(0..self.idle.len()));
        // Drawn for every task, so that the dropout rate does not change who is chosen.
        let drops = self.drop_rng.random::<f64>() < self.cfg.dropout;
        let i = client.0 as usize;
        let samples = self.pop.num_samples(client);
        let finish = now
            + self
                .stragglers
                .task_seconds(i, samples, self.cfg.local_epochs);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.tasks.insert(
            seq,
            Task {
                client,
                version,
                model: model.clone(),
                finish,
                drops,
                update: None,
            },
        );
        self.events.push(Reverse(Finish { time: finish, seq }));
    }

    /// Trains, in parallel, the untrained tasks that finish soonest (the next one to
    /// finish among them). Each task's inputs were fixed when it started, so the results
    /// do not depend on which tasks share a batch.
    fn train_pending(&mut self) -> Result<(), SimulationError> {
        let mut pending: Vec<(f64, u64)> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.update.is_none() && !t.drops)
            .map(|(seq, t)| (t.finish, *seq))
            .collect();
        pending.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        pending.truncate(self.chunk);
        let batch: Vec<ClientTask<'_>> = pending
            .iter()
            .map(|&(_, seq)| {
                let task = &self.tasks[&seq];
                ClientTask {
                    client: task.client,
                    round: task.version + 1,
                    model_version: u64::from(task.version),
                    global: &task.model,
                    train: &self.train,
                    seed: derive_seed(self.cfg.seed, Stream::AsyncTraining, 0, seq),
                }
            })
            .collect();
        let trained = self.pop.train(&batch)?;
        drop(batch);
        let trained: Vec<(u64, TaskResult)> =
            pending.iter().map(|&(_, seq)| seq).zip(trained).collect();
        for (seq, update) in trained {
            if let Some(task) = self.tasks.get_mut(&seq) {
                task.update = Some(update);
            }
        }
        Ok(())
    }
}

impl<'a> Scheduler<'a> {
    /// A scheduler with every client idle and no task started.
    fn new(
        cfg: &'a SimulationConfig,
        pop: &'a dyn Population,
        train: TrainConfig,
        chunk: usize,
    ) -> Self {
        let n = pop.clients();
        Scheduler {
            cfg,
            pop,
            train,
            stragglers: Stragglers::new(cfg.straggler, n, cfg.seed),
            idle: (0..n as u64).map(ClientId).collect(),
            tasks: BTreeMap::new(),
            events: BinaryHeap::new(),
            next_seq: 0,
            select_rng: ChaCha8Rng::seed_from_u64(derive_seed(
                cfg.seed,
                Stream::AsyncSelection,
                0,
                0,
            )),
            drop_rng: ChaCha8Rng::seed_from_u64(derive_seed(
                cfg.seed,
                Stream::AsyncSelection,
                1,
                0,
            )),
            chunk,
        }
    }
}

/// The buffer of staleness-weighted updates since the last server step.
struct Buffer {
    fold: BufferFold,
    samples: u64,
    loss_sum: f64,
    loss_samples: u64,
    dropped: usize,
}

impl Buffer {
    fn new(
        global: &ModelVector,
        reducer: &dyn Reducer,
        exponent: f64,
    ) -> Result<Self, SimulationError> {
        let fold = BufferFold::new(global.layout().clone(), reducer, exponent)
            .map_err(|e| EngineError::InvalidConfig(format!("FedBuff buffer: {e}")))?;
        Ok(Self {
            fold,
            samples: 0,
            loss_sum: 0.0,
            loss_samples: 0,
            dropped: 0,
        })
    }

    /// Folds a finished task's update into the buffer with its staleness (server steps
    /// since the version it trained on); `attack` rewrites a malicious client's delta.
    /// An update that is not finite (an attack's overflow) is refused, as the
    /// coordinator refuses its upload, and counts as a dropout. Returns the staleness of
    /// a folded update.
    fn add(
        &mut self,
        update: &cohort_edge::train::LocalUpdate,
        task: &Task,
        version: u32,
        attack: Option<&super::config::Attack>,
    ) -> Option<u32> {
        let tau = version - task.version;
        let samples = update.num_samples as u64;
        let delta: Vec<f32> = update
            .params
            .values()
            .iter()
            .zip(task.model.values())
            .map(|(p, s)| match attack {
                Some(attack) => attack.apply(p - s),
                None => p - s,
            })
            .collect();
        let delta =
            ModelVector::new(task.model.layout().clone(), delta).expect("the model's own layout");
        if self.fold.fold_deltas(&[(&delta, samples, tau)]).is_err() {
            self.dropped += 1;
            return None;
        }
        self.samples += samples;
        if update.train_loss.is_finite() {
            self.loss_sum += update.train_loss * samples as f64;
            self.loss_samples += samples;
        }
        Some(tau)
    }

    /// What the server step taken from this buffer reports, before its fold is spent.
    fn tally(&self) -> StepTally {
        let updates = self.fold.updates();
        StepTally {
            updates,
            dropped: self.dropped,
            samples: self.samples,
            train_loss: (self.loss_samples > 0).then(|| self.loss_sum / self.loss_samples as f64),
        }
    }
}

/// The counts of one buffer's server step.
struct StepTally {
    updates: usize,
    dropped: usize,
    samples: u64,
    train_loss: Option<f64>,
}

impl StepTally {
    /// The record of the server step that published `version`, taken at simulated time
    /// `now` after `seconds` of real time.
    fn record(
        self,
        version: u32,
        eval: &cohort_edge::model::Evaluation,
        seconds: f64,
        now: f64,
        parameters: usize,
    ) -> RoundRecord {
        RoundRecord {
            round: version,
            test_accuracy: eval.accuracy,
            test_loss: eval.loss,
            participants: self.updates,
            dropped: self.dropped,
            seconds,
            selected: self.updates + self.dropped,
            train_loss: self.train_loss,
            samples: self.samples,
            status: cohort_core::round::AttemptEnd::PUBLISHED,
            sim_seconds: now,
            epsilon: None,
            epsilon_coordinator: None,
            // FedBuff sends plain floats: every task that ended downloaded the model
            // once, every update folded was uploaded once.
            bytes_up: (self.updates * parameters * 4) as u64,
            bytes_down: ((self.updates + self.dropped) * parameters * 4) as u64,
            client_accuracy_mean: None,
            client_accuracy_p10: None,
            personal_accuracy_mean: None,
            personal_accuracy_p10: None,
            clients: None,
        }
    }
}

/// Runs `cfg.rounds` FedBuff server steps on prepared data, calling `on_round` after each.
pub(super) fn run(
    cfg: &SimulationConfig,
    pop: &dyn Population,
    mut on_round: impl FnMut(&RoundRecord) -> Result<(), SimulationError>,
) -> Result<SimulationResult, SimulationError> {
    let started = Instant::now();
    let n = pop.clients();
    let k = cfg.buffer_size();
    let exponent = cfg.staleness_exponent();
    let reducer = cohort_aggregation::reduce::select(cfg.reducer)
        .map_err(|e| ConfigError(format!("--reducer {}: {e}", cfg.reducer)))?
        .reducer;
    let mut optimizer = cfg
        .strategy
        .server_optimizer(cfg.server_lr.map(|lr| lr as f32))
        .map_err(|e| ConfigError(format!("--strategy {}: {e}", cfg.strategy)))?;
    let mut global = Arc::new(pop.initial_model(derive_seed(cfg.seed, Stream::ModelInit, 0, 0))?);
    let mut train = cfg.train_config();
    train.proximal_mu = cfg.strategy.proximal_mu();
    let malicious = malicious_clients(cfg, n);
    let threads = rayon::current_num_threads();
    // As in synchronous rounds: at most 64 MiB of trained updates at once, and at least
    // four tasks per thread.
    const CHUNK_BYTES: usize = 64 << 20;
    let update_bytes = global.len().max(1) * std::mem::size_of::<f32>();
    let mut sched = Scheduler::new(
        cfg,
        pop,
        train,
        (CHUNK_BYTES / update_bytes).max(threads * 4),
    );
    let mut version = 0u32;
    for _ in 0..cfg.concurrency().min(n) {
        sched.start(0.0, &global, version);
    }
    let mut buffer = Buffer::new(&global, reducer.as_ref(), exponent)?;
    let mut records = Vec::with_capacity(cfg.rounds as usize);
    let (mut total_updates, mut staleness_sum) = (0usize, 0u64);
    let mut training_seconds = 0.0;
    let mut step_started = Instant::now();
    let mut failures: Vec<ClientFailure> = Vec::new();
    while version < cfg.rounds {
        let Some(Reverse(Finish { time: now, seq })) = sched.events.pop() else {
            break; // unreachable: a finished task is always replaced
        };
        let busy = Instant::now();
        if sched
            .tasks
            .get(&seq)
            .is_some_and(|t| t.update.is_none() && !t.drops)
        {
            sched.train_pending()?;
        }
        let task = sched
            .tasks
            .remove(&seq)
            .expect("every finish event has its task");
        sched.idle.push(task.client);
        match task.update {
            None if task.drops => buffer.dropped += 1,
            None => unreachable!("the next task to finish is always trained first"),
            Some(Err(failure)) => {
                buffer.dropped += 1;
                failures.push(failure);
            }
            Some(Ok(ref update)) => {
                let attacked = malicious.contains(&task.client).then_some(&cfg.attack);
                if let Some(tau) = buffer.add(update, &task, version, attacked) {
                    staleness_sum += u64::from(tau);
                }
            }
        }
        if buffer.fold.updates() == k {
            let fresh = Buffer::new(&global, reducer.as_ref(), exponent)?;
            let buffer = std::mem::replace(&mut buffer, fresh);
            let tally = buffer.tally();
            let updates = tally.updates;
            let mean = buffer.fold.target(&global).map_err(|e| {
                EngineError::InvalidConfig(format!("FedBuff server step {}: {e}", version + 1))
            })?;
            let mut next = (*global).clone();
            optimizer.step(&mut next, &mean).map_err(|e| {
                EngineError::InvalidConfig(format!("FedBuff server step {}: {e}", version + 1))
            })?;
            global = Arc::new(next);
            version += 1;
            total_updates += updates;
            training_seconds += busy.elapsed().as_secs_f64();
            let eval = pop.evaluate(version, &global)?;
            let seconds = step_started.elapsed().as_secs_f64();
            let record = tally.record(version, &eval, seconds, now, global.len());
            on_round(&record)?;
            records.push(record);
            step_started = Instant::now();
        } else {
            training_seconds += busy.elapsed().as_secs_f64();
        }
        if version < cfg.rounds {
            sched.start(now, &global, version);
        }
    }
    Ok(SimulationResult {
        rounds: records,
        data: pop.facts(),
        total_updates,
        training_seconds,
        wall_seconds: started.elapsed().as_secs_f64(),
        threads,
        stopped: None,
        mean_staleness: Some(staleness_sum as f64 / total_updates.max(1) as f64),
        failures,
        final_model: global,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_events_pop_earliest_first_and_ties_in_start_order() {
        let mut heap = BinaryHeap::new();
        for (time, seq) in [(2.0, 0), (1.0, 3), (1.0, 1), (0.5, 2)] {
            heap.push(Reverse(Finish { time, seq }));
        }
        let order: Vec<u64> = std::iter::from_fn(|| heap.pop().map(|Reverse(f)| f.seq)).collect();
        assert_eq!(order, [2, 1, 3, 0]);
    }
}
