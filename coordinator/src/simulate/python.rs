//! Clients written in Python: a pool of worker processes (`python -m cohort._worker`),
//! each with its own interpreter, that run the user's `train` and `evaluate` functions.
//!
//! There is no Ray and no shared interpreter: a worker that crashes, runs out of memory
//! or hangs past the task timeout is killed, its task fails (a dropout, as a deployed
//! client that reports a failure), and a fresh worker takes its place. Each worker sees
//! only the GPU it is pinned to (`CUDA_VISIBLE_DEVICES`) and its share of the cores for
//! BLAS and OpenMP.
//!
//! The pool speaks a small framed protocol over the worker's standard input and output
//! (the worker moves them out of the user's way first, so a `print` cannot corrupt it):
//! every frame is a little-endian `u32` header length, a JSON header, a `u64` body length
//! and the body. Models travel as raw `f32` bytes in the layout's order, and a worker gets
//! each round's global model once, however many clients it trains in that round. On
//! Linux the tensors do not cross the pipe at all: the engine writes a worker's model into
//! memory it shares with that worker, and the worker writes its update into a slot of the
//! same memory, where the engine checks and folds it ([`super::shared_memory`]).
//!
//! Whatever a worker returns is checked here, not in Python: the tensor names and shapes
//! of the global model, a floating-point dtype, finite values, a believable example count.

use std::collections::BTreeMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_aggregation::{Finite, Layout, ModelVector, TensorSpec};
use cohort_edge::model::Evaluation;
use cohort_edge::train::LocalUpdate;
use rayon::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

use super::SimulationError;
use super::config::ConfigError;
use super::population::DataFacts;
use super::population::{
    ClientFailure, ClientTask, Consume, Params, Population, TaskResult, Trained, TrainedResult,
};
use super::shared_memory::{Area, SharedFile};
use crate::engine::ClientId;

/// Largest JSON header a worker may send (a traceback fits many times over).
const MAX_HEADER: usize = 16 << 20;

/// Largest example count believed from a worker (as from a deployed trainer).
pub const MAX_EXAMPLES: u64 = cohort_edge::trainer::MAX_EXAMPLES;

/// Where the workers find the user's code.
#[derive(Debug, Clone)]
pub enum PythonCode {
    /// A pickled payload written by `cohort.simulate` (the functions, the data, the
    /// initial weights).
    Payload(PathBuf),
    /// `module[:function]`: the module supplies `train` (or the named function) and
    /// optionally `evaluate`, `client_data` and `initial_weights`.
    Module(String),
}

/// How to run the Python workers.
#[derive(Debug, Clone)]
pub struct PythonSettings {
    /// The interpreter (`python3`, or the caller's `sys.executable`).
    pub python: PathBuf,
    /// The user's code.
    pub code: PythonCode,
    /// Worker processes (at least 1).
    pub workers: usize,
    /// Devices the workers are pinned to, round robin: `cuda:N` (or `N`) makes worker `i`
    /// see only that GPU, `cpu` hides every GPU. Empty: the workers inherit the
    /// environment.
    pub devices: Vec<String>,
    /// A task running longer than this is killed and fails.
    pub task_timeout: Option<Duration>,
    /// Number of virtual clients (partition ids `0..clients`).
    pub clients: usize,
    /// Free-form settings handed to every task (`task.hyperparameters`).
    pub hyperparameters: serde_json::Map<String, Value>,
    /// Extra environment variables for the workers.
    pub env: Vec<(String, String)>,
    /// Models and updates go through memory shared with the workers (Linux) instead of
    /// their pipes. Where it cannot be set up, the pipes carry them.
    pub shared_memory: bool,
    /// Each client's held-out split and the run's personalisation.
    pub clients_split: ClientSplit,
}

/// How a run scores each client on its own data, and what it personalises: the run's
/// `--client-holdout` and `--personalise`.
#[derive(Debug, Clone, Default)]
pub struct ClientSplit {
    /// The fraction of each client's examples held out (0: none, and no per-client
    /// scores).
    pub holdout: f64,
    /// Seeds each client's split.
    pub seed: u64,
    /// The personalisation scheme, if any.
    pub personalise: Option<cohort_edge::personal::Personalisation>,
    /// Training settings for fine-tuning a personal model to score it.
    pub tuning: cohort_edge::train::TrainConfig,
}

impl ClientSplit {
    /// The split and personalisation `cfg` asks for.
    pub fn of(cfg: &super::config::SimulationConfig) -> Self {
        Self {
            holdout: cfg.client_holdout(),
            seed: crate::seeds::derive_seed(cfg.seed, crate::seeds::Stream::Split, 2, 0),
            personalise: cfg.personalise.clone(),
            tuning: cfg.train_config(),
        }
    }

    /// Why a Python `train` cannot run this split's scheme, if it cannot.
    pub fn refusal(&self) -> Option<ConfigError> {
        match &self.personalise {
            Some(
                p @ (cohort_edge::personal::Personalisation::FedRep { .. }
                | cohort_edge::personal::Personalisation::Ditto { .. }),
            ) => Some(ConfigError(format!(
                "--personalise {p} freezes layers or pulls a model towards another, which a \
                     Python train does not do: use fedper:TENSORS or finetune:EPOCHS with it"
            ))),
            _ => None,
        }
    }
}

impl PythonSettings {
    /// Checks what can be checked before any process starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(why) = self.clients_split.refusal() {
            return Err(why);
        }
        if self.workers == 0 {
            return Err(ConfigError("workers must be at least 1".into()));
        }
        if self.clients == 0 {
            return Err(ConfigError("clients must be at least 1".into()));
        }
        if let Some(t) = self.task_timeout
            && t.is_zero()
        {
            return Err(ConfigError("task_timeout must be positive".into()));
        }
        for d in &self.devices {
            device_visibility(d)?;
        }
        Ok(())
    }
}

/// What `CUDA_VISIBLE_DEVICES` a worker pinned to `device` gets.
fn device_visibility(device: &str) -> Result<String, ConfigError> {
    let d = device.trim();
    if d == "cpu" {
        return Ok(String::new());
    }
    let index = d.strip_prefix("cuda:").unwrap_or(d);
    if !index.is_empty() && index.chars().all(|c| c.is_ascii_digit()) {
        Ok(index.to_string())
    } else {
        Err(ConfigError(format!(
            "device `{device}` must be `cuda:N`, `N` or `cpu`"
        )))
    }
}

/// One worker process and the model it holds.
struct Worker {
    child: Child,
    input: BufWriter<ChildStdin>,
    output: BufReader<ChildStdout>,
    /// The model version the worker holds, if any.
    version: Option<u64>,
}

/// A task a worker is running, for the watchdog.
#[derive(Default)]
struct Running {
    pid: Option<u32>,
    deadline: Option<Instant>,
    timed_out: bool,
}

/// The Python workers and what the run has learnt about the clients.
pub struct PythonPopulation {
    pub(super) settings: PythonSettings,
    layout: Arc<Layout>,
    initial: ModelVector,
    /// One slot per worker; `None` until started or after a crash.
    workers: Vec<Mutex<Option<Worker>>>,
    running: Arc<Vec<Mutex<Running>>>,
    /// Each client's sample count, from its last report (0: not yet trained).
    pub(super) samples: Vec<AtomicUsize>,
    cancel: Arc<AtomicBool>,
    watchdog_stop: Arc<AtomicBool>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    /// Workers started over the run (restarts included).
    started: AtomicUsize,
    /// Whether the user's code has an `evaluate` (a population without one is not asked,
    /// so no round waits for a model sent for nothing).
    pub(super) has_evaluate: AtomicBool,
    /// The memory shared with the workers, once the model's size is known.
    shared: Option<Shared>,
    /// The shared file, from before the first worker starts (workers inherit it).
    shared_file: Option<SharedFile>,
    /// With `--personalise`: the scheme and every client's personal state.
    pub(super) personal: Option<super::personal::PersonalRun>,
    /// Model versions for models that are no round's global (a client's personalised
    /// model, the global scored on the clients' splits): counted down from the top, far
    /// from the rounds'.
    pub(super) next_private_version: std::sync::atomic::AtomicU64,
}

/// The parts of the shared memory.
struct Shared {
    /// Each worker's model area.
    models: Vec<Mutex<Area>>,
    /// The update slots, one per task of a part of a batch; held for a whole batch.
    slots: Mutex<Vec<Area>>,
}

/// A task's update before it is handed over: in its slot, or copied out of the reply.
pub(super) struct Outcome<'s> {
    pub(super) landed: Landed<'s>,
    pub(super) num_samples: usize,
    pub(super) train_loss: f64,
    pub(super) client: u64,
    pub(super) round: u32,
}

/// Where an update landed.
pub(super) enum Landed<'s> {
    /// Copied out of the reply (over the pipe, or in another order or dtype) and
    /// checked on the way.
    Owned(Vec<f32>),
    /// In its slot, the model's tensors in order, as `float32`: still to be checked for
    /// finite values, which is left until the whole part has landed, so that the workers
    /// never wait on it and the checks run on every core.
    InSlot {
        values: &'s [f32],
        tensors: Vec<ReturnedTensor>,
    },
}

impl<'s> Outcome<'s> {
    /// The update as the round loop reads it, or the task's failure when a value is not
    /// finite (named by the general check).
    pub(super) fn check(self, layout: &Arc<Layout>) -> Result<Trained<'s>, ClientFailure> {
        let params = match self.landed {
            Landed::Owned(values) => Params::Owned(values),
            Landed::InSlot { values, tensors } => match Finite::check(values) {
                Ok(finite) => Params::Finite(finite),
                Err(_) => {
                    let reason =
                        update_from_tensors(layout, &tensors, bytemuck::cast_slice(values))
                            .err()
                            .unwrap_or_else(|| "the update holds NaN or infinity".into());
                    return Err(ClientFailure {
                        client: self.client,
                        round: self.round,
                        reason,
                    });
                }
            },
        };
        Ok(Trained {
            params,
            num_samples: self.num_samples,
            train_loss: self.train_loss,
        })
    }
}

/// Update slots hold at most this many bytes together (fewer, larger parts for small
/// models would only touch more memory), and at least two per worker.
const SLOT_BYTES: usize = 64 << 20;

impl std::fmt::Debug for PythonPopulation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PythonPopulation")
            .field("workers", &self.settings.workers)
            .field("clients", &self.settings.clients)
            .field("parameters", &self.initial.len())
            .finish()
    }
}

/// A failure inside one worker exchange.
pub(super) enum WorkerError {
    /// The user's code failed or returned something unusable: the task fails.
    Task(String),
    /// The process died, hung or broke the protocol: it is replaced and the task fails.
    Process(String),
}

impl PythonPopulation {
    /// Starts one worker, asks it for the initial model and checks it; the other
    /// workers start when first needed. `cancel`, once set, kills every worker and makes
    /// the run stop with [`SimulationError::Interrupted`].
    pub fn start(
        settings: PythonSettings,
        cancel: Arc<AtomicBool>,
    ) -> Result<Self, SimulationError> {
        settings.validate()?;
        let running: Arc<Vec<Mutex<Running>>> = Arc::new(
            (0..settings.workers)
                .map(|_| Mutex::new(Running::default()))
                .collect(),
        );
        let watchdog_stop = Arc::new(AtomicBool::new(false));
        let watchdog = {
            let (running, stop, cancel) = (running.clone(), watchdog_stop.clone(), cancel.clone());
            std::thread::Builder::new()
                .name("cohort-python-watchdog".into())
                .spawn(move || watch(&running, &stop, &cancel))
                .map_err(|e| ConfigError(format!("cannot start the worker watchdog: {e}")))?
        };
        // Created before the first worker, which inherits it; mapped once the initial
        // weights say how large the model is.
        let shared_file = if settings.shared_memory {
            match SharedFile::create() {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!("no shared memory for the Python workers ({e}): using pipes");
                    None
                }
            }
        } else {
            None
        };
        let mut pop = Self {
            workers: (0..settings.workers).map(|_| Mutex::new(None)).collect(),
            samples: (0..settings.clients).map(|_| AtomicUsize::new(0)).collect(),
            settings,
            layout: Arc::new(Layout::flat(0)),
            initial: ModelVector::from_flat(Vec::new()),
            running,
            cancel,
            watchdog_stop,
            watchdog: Some(watchdog),
            started: AtomicUsize::new(0),
            has_evaluate: AtomicBool::new(true),
            shared: None,
            shared_file,
            personal: None,
            next_private_version: std::sync::atomic::AtomicU64::new(u64::MAX),
        };
        pop.personal = pop
            .settings
            .clients_split
            .personalise
            .clone()
            .map(super::personal::PersonalRun::new);
        let initial = pop.fetch_initial()?;
        if let Some(scheme) = &pop.settings.clients_split.personalise {
            scheme
                .personal_mask(initial.layout())
                .map_err(|e| ConfigError(format!("--personalise {scheme}: {e}")))?;
        }
        pop.layout = initial.layout().clone();
        pop.initial = initial;
        pop.shared = pop.map_shared();
        Ok(pop)
    }

    /// Maps the shared memory: a model area per worker, then the update slots.
    fn map_shared(&self) -> Option<Shared> {
        let file = self.shared_file.as_ref()?;
        let bytes = self.layout.len().checked_mul(4)?.max(4);
        let slots = (SLOT_BYTES / bytes).max(2 * self.settings.workers);
        let sizes: Vec<usize> = std::iter::repeat_n(bytes, self.settings.workers + slots).collect();
        match file.map(&sizes) {
            Ok(mut areas) => {
                let slots = areas.split_off(self.settings.workers);
                Some(Shared {
                    models: areas.into_iter().map(Mutex::new).collect(),
                    slots: Mutex::new(slots),
                })
            }
            Err(e) => {
                tracing::warn!("no shared memory for the Python workers ({e}): using pipes");
                None
            }
        }
    }

    /// The model's layout, as the user's initial weights define it.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// Worker processes started so far, restarts included.
    pub fn workers_started(&self) -> usize {
        self.started.load(Ordering::Relaxed)
    }

    fn interrupted(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    fn spawn(&self, index: usize) -> Result<Worker, SimulationError> {
        let s = &self.settings;
        let mut cmd = Command::new(&s.python);
        cmd.args(["-m", "cohort._worker"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("COHORT_WORKER_INDEX", index.to_string())
            .env("COHORT_WORKER_CLIENTS", s.clients.to_string())
            .env("COHORT_WORKER_HOLDOUT", s.clients_split.holdout.to_string())
            .env("COHORT_WORKER_SPLIT_SEED", s.clients_split.seed.to_string())
            .env("PYTHONUNBUFFERED", "1");
        match &s.code {
            PythonCode::Payload(path) => cmd.env("COHORT_WORKER_PAYLOAD", path),
            PythonCode::Module(target) => cmd.env("COHORT_WORKER_TARGET", target),
        };
        // Each worker gets its share of the cores for BLAS and OpenMP, unless the user
        // chose: oversubscribed thread pools are the usual reason a pool runs slow.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let share = (cores / s.workers).max(1).to_string();
        for var in [
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "OPENBLAS_NUM_THREADS",
            "NUMEXPR_NUM_THREADS",
        ] {
            if std::env::var_os(var).is_none() {
                cmd.env(var, &share);
            }
        }
        if let Some(file) = &self.shared_file {
            cmd.env("COHORT_WORKER_SHM_FD", file.raw_fd().to_string());
        }
        if !s.devices.is_empty() {
            let device = &s.devices[index % s.devices.len()];
            cmd.env("CUDA_VISIBLE_DEVICES", device_visibility(device)?);
        }
        for (k, v) in &s.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().map_err(|e| {
            ConfigError(format!(
                "cannot start the Python worker `{} -m cohort._worker`: {e}",
                s.python.display()
            ))
        })?;
        self.started.fetch_add(1, Ordering::Relaxed);
        let input = BufWriter::with_capacity(1 << 20, child.stdin.take().expect("piped"));
        let output = BufReader::with_capacity(1 << 20, child.stdout.take().expect("piped"));
        let mut worker = Worker {
            child,
            input,
            output,
            version: None,
        };
        // The worker says it is ready once it has loaded the user's code; a module that
        // does not import is the user's mistake, not a crash to retry.
        match read_frame(&mut worker.output, 0) {
            Ok((header, _)) if header["ok"] == json!(true) => {
                if header["evaluate"] == json!(false) {
                    self.has_evaluate.store(false, Ordering::Relaxed);
                }
                Ok(worker)
            }
            Ok((header, _)) => {
                let _ = worker.child.kill();
                let _ = worker.child.wait();
                Err(ConfigError(format!(
                    "the Python worker could not load your code: {}",
                    header["error"].as_str().unwrap_or("no reason given")
                ))
                .into())
            }
            Err(e) => {
                let _ = worker.child.kill();
                let status = worker.child.wait().ok();
                Err(ConfigError(format!(
                    "the Python worker `{} -m cohort._worker` exited before it was ready \
                     ({e}; {}); is the `cohort` package installed for that interpreter?",
                    s.python.display(),
                    status.map_or("no status".into(), |s| s.to_string()),
                ))
                .into())
            }
        }
    }

    fn fetch_initial(&self) -> Result<ModelVector, SimulationError> {
        let mut slot = self.workers[0].lock().expect("no panics while held");
        let mut worker = self.spawn(0)?;
        let result = (|| {
            write_frame(&mut worker.input, &json!({"op": "initial"}), &[])?;
            read_frame(&mut worker.output, 0)
        })();
        let (header, body) = result.map_err(|e| {
            ConfigError(format!(
                "the Python worker failed while loading the initial weights: {e}"
            ))
        })?;
        if header["ok"] != json!(true) {
            return Err(ConfigError(format!(
                "initial weights: {}",
                header["error"].as_str().unwrap_or("no reason given")
            ))
            .into());
        }
        let tensors: Vec<ReturnedTensor> = serde_json::from_value(header["tensors"].clone())
            .map_err(|e| ConfigError(format!("initial weights: bad description: {e}")))?;
        let model = initial_from_tensors(&tensors, &body).map_err(ConfigError)?;
        *slot = Some(worker);
        Ok(model)
    }

    /// Runs one request on worker `index`, starting it first if it is not running, and
    /// sending it `global` (as `version`) if it holds another model.
    pub(super) fn exchange(
        &self,
        index: usize,
        version: u64,
        global: &ModelVector,
        request: &Value,
    ) -> Result<Result<(Value, Body), WorkerError>, SimulationError> {
        let mut slot = self.workers[index].lock().expect("no panics while held");
        if self.interrupted() {
            return Err(SimulationError::Interrupted);
        }
        if slot.is_none() {
            *slot = Some(self.spawn(index)?);
        }
        let worker = slot.as_mut().expect("started above");
        {
            let mut r = self.running[index].lock().expect("no panics while held");
            *r = Running {
                pid: Some(worker.child.id()),
                deadline: self.settings.task_timeout.map(|t| Instant::now() + t),
                timed_out: false,
            };
        }
        let result = (|| -> std::io::Result<(Value, Body)> {
            if worker.version != Some(version) {
                worker.version = None;
                let tensors: Vec<Value> = global
                    .layout()
                    .tensors()
                    .iter()
                    .map(|t| json!({"name": t.name, "shape": t.shape}))
                    .collect();
                let mut header = json!({"op": "model", "version": version, "tensors": tensors});
                let values = global.values();
                match self.shared.as_ref() {
                    Some(shared) => {
                        // The worker is idle (its lock is held here): its area is ours.
                        let mut area = shared.models[index].lock().expect("no panics while held");
                        area.write_f32s(values)?;
                        header["shm"] = json!({"offset": area.offset(), "bytes": values.len() * 4});
                        write_frame(&mut worker.input, &header, &[])?;
                    }
                    None => {
                        write_frame(&mut worker.input, &header, &[bytemuck::cast_slice(values)])?
                    }
                }
                worker.version = Some(version);
            }
            write_frame(&mut worker.input, request, &[])?;
            // An update may come back as float64: room for twice the model, and a little.
            read_frame(&mut worker.output, global.len() * 8 + (1 << 20))
        })();
        let timed_out = {
            let mut r = self.running[index].lock().expect("no panics while held");
            let t = r.timed_out;
            *r = Running::default();
            t
        };
        if self.interrupted() {
            kill(worker);
            *slot = None;
            return Err(SimulationError::Interrupted);
        }
        match result {
            Ok((header, body)) if header["ok"] == json!(true) => Ok(Ok((header, body))),
            Ok((header, _)) => Ok(Err(WorkerError::Task(
                header["error"]
                    .as_str()
                    .unwrap_or("the worker reported a failure without a reason")
                    .to_string(),
            ))),
            Err(e) => {
                let mut worker = slot.take().expect("present");
                let _ = worker.child.kill();
                let status = worker.child.wait().ok();
                let reason = if timed_out {
                    format!(
                        "the task ran past the task timeout of {:?} and its worker was killed",
                        self.settings.task_timeout.unwrap_or_default()
                    )
                } else {
                    format!(
                        "the Python worker died ({}){}",
                        status.map_or_else(|| e.to_string(), |s| describe_exit(&s)),
                        if e.kind() == std::io::ErrorKind::InvalidData {
                            format!(": {e}")
                        } else {
                            String::new()
                        }
                    )
                };
                Ok(Err(WorkerError::Process(reason)))
            }
        }
    }

    /// Trains one task on `worker`; its update goes to `slot` when there is one.
    pub(super) fn train_one<'s>(
        &self,
        worker: usize,
        task: &ClientTask<'_>,
        slot: Option<&'s Area>,
    ) -> Result<Result<Outcome<'s>, ClientFailure>, SimulationError> {
        let fail = |reason: String| {
            Ok(Err(ClientFailure {
                client: task.client.0,
                round: task.round,
                reason,
            }))
        };
        let mut request = json!({
            "op": "train",
            "version": task.model_version,
            "client": task.client.0,
            "round": task.round,
            "seed": task.seed,
            "config": task.train,
            "hyperparameters": self.settings.hyperparameters,
        });
        if let Some(slot) = slot {
            request["slot"] = json!({"offset": slot.offset(), "bytes": slot.size()});
        }
        let (header, body) =
            match self.exchange(worker, task.model_version, task.global, &request)? {
                Ok(reply) => reply,
                Err(WorkerError::Task(reason) | WorkerError::Process(reason)) => {
                    return fail(reason);
                }
            };
        let in_slot = header.get("slot_bytes").and_then(Value::as_u64);
        let reply: TrainReply = match serde_json::from_value(header) {
            Ok(r) => r,
            Err(e) => return fail(format!("the worker's reply is malformed: {e}")),
        };
        if reply.num_examples == 0 || reply.num_examples > MAX_EXAMPLES {
            return fail(format!(
                "num_examples must be between 1 and {MAX_EXAMPLES}, got {}",
                reply.num_examples
            ));
        }
        let layout = task.global.layout();
        let landed = match (in_slot, slot) {
            (Some(n), Some(slot)) => {
                let Some(bytes) = usize::try_from(n).ok().and_then(|n| slot.bytes(n)) else {
                    return fail(format!(
                        "the worker says it wrote {n} bytes into a {}-byte slot",
                        slot.size()
                    ));
                };
                let in_order = in_model_order(layout, &reply.tensors, bytes.len())
                    .then(|| slot.f32s(layout.len()))
                    .flatten();
                match in_order {
                    Some(values) => Landed::InSlot {
                        values,
                        tensors: reply.tensors,
                    },
                    // Another order, or float64: the general check, and a copy.
                    None => match update_from_tensors(layout, &reply.tensors, bytes) {
                        Ok(p) => Landed::Owned(p.into_values()),
                        Err(reason) => return fail(reason),
                    },
                }
            }
            (Some(_), None) => {
                return fail("the worker wrote to a slot it was not given".into());
            }
            (None, _) => match update_from_body(layout, &reply.tensors, body) {
                Ok(p) => Landed::Owned(p.into_values()),
                Err(reason) => return fail(reason),
            },
        };
        let train_loss = reply
            .metrics
            .get("loss")
            .or_else(|| reply.metrics.get("train_loss"))
            .copied()
            .filter(|l| l.is_finite())
            .unwrap_or(f64::NAN);
        if let Some(s) = self.samples.get(task.client.0 as usize) {
            s.store(reply.num_examples as usize, Ordering::Relaxed);
        }
        Ok(Ok(Outcome {
            landed,
            num_samples: reply.num_examples as usize,
            train_loss,
            client: task.client.0,
            round: task.round,
        }))
    }

    /// Runs `tasks` on the workers, largest known client first so that the last task of
    /// the batch is a short one; task `i` writes its update to `slots[i]` when there are
    /// slots. The outcomes come back in the order of `tasks`.
    fn run_tasks<'s>(
        &self,
        tasks: &[ClientTask<'_>],
        slots: Option<&'s [Area]>,
    ) -> Result<Vec<Result<Outcome<'s>, ClientFailure>>, SimulationError> {
        let mut order: Vec<usize> = (0..tasks.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.num_samples(tasks[i].client)));
        self.schedule(&order, tasks.len(), |w, i| {
            self.train_one(w, &tasks[i], slots.map(|s| &s[i]))
        })
    }

    /// Runs job `i` for every `i` of `order` on the workers, each worker taking the next
    /// job as it finishes one (job `i` runs as `job(worker, i)`); the results come back
    /// indexed by job, `n` of them. The first fatal error ends the batch.
    pub(super) fn schedule<R: Send>(
        &self,
        order: &[usize],
        n: usize,
        job: impl Fn(usize, usize) -> Result<R, SimulationError> + Sync,
    ) -> Result<Vec<R>, SimulationError> {
        let next = AtomicUsize::new(0);
        let results: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
        let workers = self.settings.workers.min(order.len());
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|w| {
                    let (next, results, job) = (&next, &results, &job);
                    scope.spawn(move || -> Result<(), SimulationError> {
                        loop {
                            let k = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&i) = order.get(k) else {
                                return Ok(());
                            };
                            let result = job(w, i)?;
                            *results[i].lock().expect("no panics while held") = Some(result);
                        }
                    })
                })
                .collect();
            let mut first_error = None;
            for h in handles {
                match h.join() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        first_error.get_or_insert(e);
                    }
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            first_error.map_or(Ok(()), Err)
        })?;
        Ok(results
            .into_iter()
            .map(|r| {
                r.into_inner()
                    .expect("no panics while held")
                    .expect("every job ran")
            })
            .collect())
    }
}

/// Whether returned tensors are the model's own, in its order, all `float32`, filling
/// `bytes`: then their bytes are the model vector as they are.
fn in_model_order(layout: &Layout, tensors: &[ReturnedTensor], bytes: usize) -> bool {
    tensors.len() == layout.tensors().len()
        && tensors.iter().zip(layout.tensors()).all(|(t, spec)| {
            t.name == spec.name && t.shape == spec.shape && float_kind(t) == Ok(Float::F32)
        })
        && bytes == layout.len() * 4
}

/// The watchdog: kills a worker whose task ran past its deadline, and every worker once
/// the run is cancelled.
fn watch(running: &[Mutex<Running>], stop: &AtomicBool, cancel: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let cancelled = cancel.load(Ordering::Relaxed);
        let now = Instant::now();
        for slot in running {
            let mut r = slot.lock().expect("no panics while held");
            let late = r.deadline.is_some_and(|d| now >= d);
            if let Some(pid) = r.pid
                && (late || cancelled)
            {
                r.timed_out = late && !cancelled;
                r.deadline = None;
                kill_pid(pid);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(unix)]
fn kill_pid(pid: u32) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

#[cfg(not(unix))]
fn kill_pid(_pid: u32) {}

fn kill(worker: &mut Worker) {
    let _ = worker.child.kill();
    let _ = worker.child.wait();
}

fn describe_exit(status: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            let name = match signal {
                9 => " (SIGKILL: out of memory, or killed)",
                11 => " (SIGSEGV)",
                6 => " (SIGABRT)",
                _ => "",
            };
            return format!("killed by signal {signal}{name}");
        }
    }
    status.to_string()
}

impl Drop for PythonPopulation {
    fn drop(&mut self) {
        self.watchdog_stop.store(true, Ordering::Relaxed);
        for slot in &self.workers {
            if let Ok(mut w) = slot.lock()
                && let Some(mut worker) = w.take()
            {
                // Closing its input ends a worker's loop; one that does not go is killed.
                drop(worker.input);
                let deadline = Instant::now() + Duration::from_secs(2);
                loop {
                    match worker.child.try_wait() {
                        Ok(Some(_)) | Err(_) => break,
                        Ok(None) if Instant::now() >= deadline => {
                            let _ = worker.child.kill();
                            let _ = worker.child.wait();
                            break;
                        }
                        Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            }
        }
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
    }
}

impl Population for PythonPopulation {
    fn clients(&self) -> usize {
        self.settings.clients
    }

    fn num_samples(&self, client: ClientId) -> usize {
        self.samples
            .get(client.0 as usize)
            .map_or(0, |s| s.load(Ordering::Relaxed))
    }

    /// The largest sample count reported so far (secure aggregation clamps weights to
    /// this bound unless `max-weight` is set), at least 1.
    fn max_weight(&self) -> u32 {
        self.samples
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
            .clamp(1, u32::MAX as usize) as u32
    }

    fn initial_model(&self, _seed: u64) -> Result<ModelVector, SimulationError> {
        Ok(self.initial.clone())
    }

    /// Trains the batch and returns owned updates (copied out of the shared slots).
    fn train(&self, tasks: &[ClientTask<'_>]) -> Result<Vec<TaskResult>, SimulationError> {
        let mut out = Vec::with_capacity(tasks.len());
        self.train_in_place(tasks, &mut |_, part| {
            for outcome in part {
                out.push(outcome.map(|t| {
                    LocalUpdate {
                        params: ModelVector::new(self.layout.clone(), t.params.into_owned())
                            .expect("checked against the model's layout"),
                        num_samples: t.num_samples,
                        train_loss: t.train_loss,
                        steps: 0,
                    }
                }));
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Trains the batch a part at a time, as many tasks as there are shared slots, and
    /// hands each part's updates over where they lie in the slots.
    fn train_in_place(
        &self,
        tasks: &[ClientTask<'_>],
        consume: &mut Consume<'_>,
    ) -> Result<(), SimulationError> {
        if self.personal.is_some() {
            let outcomes = self.personal_tasks(tasks)?;
            let layout = &self.layout;
            return consume(
                0,
                outcomes
                    .into_iter()
                    .map(|o| o.and_then(|o| o.check(layout)))
                    .collect(),
            );
        }
        let Some(shared) = &self.shared else {
            let outcomes = self.run_tasks(tasks, None)?;
            let layout = &self.layout;
            return consume(
                0,
                outcomes
                    .into_iter()
                    .map(|o| o.and_then(|o| o.check(layout)))
                    .collect(),
            );
        };
        // Held for the whole batch: nobody else may write these slots until `consume`
        // is done with them.
        let slots = shared.slots.lock().expect("no panics while held");
        for (part, chunk) in tasks.chunks(slots.len()).enumerate() {
            let outcomes = self.run_tasks(chunk, Some(&slots))?;
            let layout = &self.layout;
            let handed: Vec<TrainedResult<'_>> = outcomes
                .into_par_iter()
                .map(|o| o.and_then(|o| o.check(layout)))
                .collect();
            consume(part * slots.len(), handed)?;
        }
        Ok(())
    }

    fn evaluate(&self, round: u32, global: &ModelVector) -> Result<Evaluation, SimulationError> {
        if !self.has_evaluate.load(Ordering::Relaxed) {
            return Ok(Evaluation {
                loss: f64::NAN,
                accuracy: f64::NAN,
                samples: 0,
            });
        }
        let request = json!({
            "op": "evaluate",
            "version": round,
            "round": round,
            "hyperparameters": self.settings.hyperparameters,
        });
        // Versions of evaluated models are apart from training versions (a round's
        // training starts from the previous round's model).
        let version = u64::from(round);
        let (header, _) = match self.exchange(0, version, global, &request)? {
            Ok(reply) => reply,
            Err(WorkerError::Task(reason) | WorkerError::Process(reason)) => {
                return Err(SimulationError::Evaluation { round, reason });
            }
        };
        if header["none"] == json!(true) {
            return Ok(Evaluation {
                loss: f64::NAN,
                accuracy: f64::NAN,
                samples: 0,
            });
        }
        let reply: EvalReply =
            serde_json::from_value(header).map_err(|e| SimulationError::Evaluation {
                round,
                reason: format!("the worker's reply is malformed: {e}"),
            })?;
        Ok(Evaluation {
            loss: reply.loss.filter(|l| l.is_finite()).unwrap_or(f64::NAN),
            accuracy: reply
                .metrics
                .get("accuracy")
                .copied()
                .filter(|a| a.is_finite())
                .unwrap_or(f64::NAN),
            samples: reply.num_examples as usize,
        })
    }

    fn facts(&self) -> DataFacts {
        let mut sizes: Vec<usize> = self
            .samples
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect();
        sizes.sort_unstable();
        DataFacts {
            train_samples: sizes.iter().sum(),
            test_samples: 0,
            features: 0,
            classes: 0,
            partition: "python".into(),
            client_samples_min: sizes.first().copied().unwrap_or(0),
            client_samples_median: sizes.get(sizes.len() / 2).copied().unwrap_or(0),
            client_samples_max: sizes.last().copied().unwrap_or(0),
            model_parameters: self.initial.len(),
        }
    }

    fn client_accuracies(
        &self,
        global: &ModelVector,
    ) -> Result<Option<Vec<super::personal::ClientAccuracy>>, SimulationError> {
        self.score_clients(global)
    }

    fn trainer(&self) -> &'static str {
        "python"
    }
}

/// One tensor as a worker returned it: its name, NumPy dtype string and shape; its
/// bytes follow the previous tensor's in the body, C order.
#[derive(Debug, Clone, Deserialize)]
pub struct ReturnedTensor {
    /// The tensor's name.
    pub name: String,
    /// NumPy's `dtype.str`, e.g. `<f4`.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
}

#[derive(Deserialize)]
struct TrainReply {
    num_examples: u64,
    #[serde(default)]
    metrics: BTreeMap<String, f64>,
    tensors: Vec<ReturnedTensor>,
}

#[derive(Deserialize)]
struct EvalReply {
    #[serde(default)]
    loss: Option<f64>,
    #[serde(default)]
    num_examples: u64,
    #[serde(default)]
    metrics: BTreeMap<String, f64>,
}

/// The element type of a returned tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Float {
    F32,
    F64,
}

fn float_kind(t: &ReturnedTensor) -> Result<Float, String> {
    // `=` is native order, which is little-endian on every platform Cohort builds for.
    match t.dtype.as_str() {
        "<f4" | "=f4" | "|f4" => Ok(Float::F32),
        "<f8" | "=f8" | "|f8" => Ok(Float::F64),
        other => Err(format!(
            "tensor `{}` has dtype {}; a model's tensors must be float32 or float64",
            t.name,
            numpy_name(other)
        )),
    }
}

fn numpy_name(dtype: &str) -> String {
    let (kind, size) = dtype.split_at(dtype.len().min(2));
    let bits = size.parse::<usize>().map(|b| b * 8).unwrap_or(0);
    match kind.chars().nth(1) {
        Some('i') => format!("int{bits}"),
        Some('u') => format!("uint{bits}"),
        Some('f') => format!("float{bits}"),
        Some('b') => "bool".into(),
        Some('c') => format!("complex{bits}"),
        Some('O') => "object".into(),
        _ => format!("`{dtype}`"),
    }
}

/// Reads the returned tensors' bytes into `f32`s in `layout`'s order, checking that
/// every tensor of the model is there once with its shape, that there is no other, that
/// each is floating point and that every value is finite. Errors name the tensor.
pub fn update_from_tensors(
    layout: &Arc<Layout>,
    tensors: &[ReturnedTensor],
    body: &[u8],
) -> Result<ModelVector, String> {
    let mut by_name: BTreeMap<&str, (usize, &ReturnedTensor)> = BTreeMap::new();
    let mut offset = 0usize;
    for t in tensors {
        let kind = float_kind(t)?;
        let count = t
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("tensor `{}` has an impossible shape", t.name))?;
        let width = if kind == Float::F32 { 4 } else { 8 };
        let bytes = count
            .checked_mul(width)
            .ok_or_else(|| format!("tensor `{}` has an impossible shape", t.name))?;
        if by_name.insert(&t.name, (offset, t)).is_some() {
            return Err(format!("tensor `{}` is returned twice", t.name));
        }
        offset = offset
            .checked_add(bytes)
            .filter(|&o| o <= body.len())
            .ok_or_else(|| {
                format!(
                    "tensor `{}`: the worker sent fewer bytes than its shape needs",
                    t.name
                )
            })?;
    }
    if offset != body.len() {
        return Err("the worker sent more bytes than the tensors' shapes need".into());
    }
    for spec in layout.tensors() {
        if !by_name.contains_key(spec.name.as_str()) {
            return Err(format!(
                "tensor `{}` is missing from the returned weights",
                spec.name
            ));
        }
    }
    if let Some(extra) = tensors.iter().find(|t| layout.find(&t.name).is_none()) {
        return Err(format!(
            "tensor `{}` is not in the model (its tensors are: {})",
            extra.name,
            layout
                .tensors()
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut values = Vec::with_capacity(layout.len());
    for spec in layout.tensors() {
        let (start, t) = by_name[spec.name.as_str()];
        if t.shape != spec.shape {
            return Err(format!(
                "tensor `{}` has shape {:?}; the model's is {:?}",
                spec.name, t.shape, spec.shape
            ));
        }
        let before = values.len();
        match float_kind(t)? {
            Float::F32 => {
                let raw = &body[start..start + spec.numel() * 4];
                values.extend(
                    raw.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
            }
            Float::F64 => {
                let raw = &body[start..start + spec.numel() * 8];
                values.extend(
                    raw.chunks_exact(8)
                        .map(|c| f64::from_le_bytes(c.try_into().expect("chunks of 8")) as f32),
                );
            }
        }
        if let Some(i) = values[before..].iter().position(|v| !v.is_finite()) {
            return Err(format!(
                "tensor `{}` holds NaN or infinity (at flat index {i})",
                spec.name
            ));
        }
    }
    ModelVector::new(layout.clone(), values).map_err(|e| e.to_string())
}

/// [`update_from_tensors`] on a frame's body, without copying it when every tensor is
/// `float32` and in the model's order (what a worker normally sends).
fn update_from_body(
    layout: &Arc<Layout>,
    tensors: &[ReturnedTensor],
    body: Body,
) -> Result<ModelVector, String> {
    if !in_model_order(layout, tensors, body.len) {
        return update_from_tensors(layout, tensors, body.bytes());
    }
    let values = body
        .into_f32s()
        .expect("a whole number of f32s, checked above");
    if cohort_aggregation::max_abs_finite(&values).is_err() {
        // The slow path finds the tensor and its index for the message.
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        return update_from_tensors(layout, tensors, &bytes);
    }
    ModelVector::new(layout.clone(), values).map_err(|e| e.to_string())
}

/// The initial model from the user's tensors, in the order the user gave them.
pub fn initial_from_tensors(
    tensors: &[ReturnedTensor],
    body: &[u8],
) -> Result<ModelVector, String> {
    if tensors.is_empty() {
        return Err("the initial weights hold no tensor".into());
    }
    let layout = Layout::new(
        tensors
            .iter()
            .map(|t| TensorSpec::new(t.name.clone(), t.shape.clone()))
            .collect(),
    )
    .map_err(|e| format!("initial weights: {e}"))?;
    update_from_tensors(&Arc::new(layout), tensors, body)
        .map_err(|e| format!("initial weights: {e}"))
}

fn write_frame(w: &mut impl Write, header: &Value, body: &[&[u8]]) -> std::io::Result<()> {
    let header = serde_json::to_vec(header).expect("JSON values serialise");
    w.write_all(&(header.len() as u32).to_le_bytes())?;
    w.write_all(&header)?;
    let len: usize = body.iter().map(|b| b.len()).sum();
    w.write_all(&(len as u64).to_le_bytes())?;
    for part in body {
        w.write_all(part)?;
    }
    w.flush()
}

/// A frame's body, read into `f32`-aligned storage: an update that is all `float32`
/// in the model's order becomes the model vector without another copy.
#[derive(Debug, Default)]
pub struct Body {
    words: Vec<f32>,
    len: usize,
}

impl Body {
    /// The body's bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The body as `f32`s, when its length is a whole number of them.
    fn into_f32s(self) -> Option<Vec<f32>> {
        (self.len == self.words.len() * 4).then_some(self.words)
    }
}

impl std::ops::Deref for Body {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

/// Reads one frame; a body over `max_body` (0: no body allowed beyond 1 GiB) is refused.
fn read_frame(r: &mut impl Read, max_body: usize) -> std::io::Result<(Value, Body)> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_HEADER {
        return Err(invalid(format!("a {len}-byte reply header")));
    }
    let mut header = vec![0u8; len];
    r.read_exact(&mut header)?;
    let header: Value = serde_json::from_slice(&header)
        .map_err(|e| invalid(format!("a reply header that is not JSON: {e}")))?;
    let mut blen = [0u8; 8];
    r.read_exact(&mut blen)?;
    let blen = u64::from_le_bytes(blen);
    let limit = if max_body == 0 { 1 << 30 } else { max_body };
    if blen > limit as u64 {
        return Err(invalid(format!("a {blen}-byte reply body")));
    }
    let len = blen as usize;
    let mut words = vec![0f32; len.div_ceil(4)];
    r.read_exact(&mut bytemuck::cast_slice_mut(&mut words)[..len])?;
    Ok((header, Body { words, len }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Arc<Layout> {
        Arc::new(
            Layout::new(vec![
                TensorSpec::new("w", [2, 2]),
                TensorSpec::new("b", [2]),
            ])
            .unwrap(),
        )
    }

    fn t(name: &str, dtype: &str, shape: &[usize]) -> ReturnedTensor {
        ReturnedTensor {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.to_vec(),
        }
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn tensors_in_any_order_and_float64_land_in_layout_order() {
        let mut body = f32s(&[9.0, 8.0]);
        body.extend([1.0f64, 2.0, 3.0, 4.0].iter().flat_map(|x| x.to_le_bytes()));
        let m = update_from_tensors(
            &layout(),
            &[t("b", "<f4", &[2]), t("w", "<f8", &[2, 2])],
            &body,
        )
        .unwrap();
        assert_eq!(m.values(), &[1.0, 2.0, 3.0, 4.0, 9.0, 8.0]);
    }

    #[test]
    fn every_bad_update_is_refused_naming_the_tensor() {
        let good = f32s(&[0.0; 6]);
        let cases: Vec<(Vec<ReturnedTensor>, Vec<u8>, &str)> = vec![
            (
                vec![t("w", "<f4", &[2, 2])],
                f32s(&[0.0; 4]),
                "tensor `b` is missing",
            ),
            (
                vec![t("w", "<f4", &[4]), t("b", "<f4", &[2])],
                good.clone(),
                "tensor `w` has shape [4]",
            ),
            (
                vec![t("w", "<i8", &[2, 2]), t("b", "<f4", &[2])],
                good.clone(),
                "tensor `w` has dtype int64",
            ),
            (
                vec![
                    t("w", "<f4", &[2, 2]),
                    t("b", "<f4", &[2]),
                    t("x", "<f4", &[0]),
                ],
                good.clone(),
                "tensor `x` is not in the model",
            ),
            (
                vec![t("w", "<f4", &[2, 2]), t("b", "<f4", &[2])],
                f32s(&[0.0, 0.0, f32::NAN, 0.0, 0.0, 0.0]),
                "tensor `w` holds NaN",
            ),
            (
                vec![t("w", "<f4", &[2, 2]), t("b", "<f4", &[2])],
                f32s(&[0.0; 5]),
                "fewer bytes",
            ),
        ];
        for (tensors, body, expected) in cases {
            let err = update_from_tensors(&layout(), &tensors, &body).unwrap_err();
            assert!(err.contains(expected), "{err} should say {expected}");
        }
    }

    #[test]
    fn an_update_in_the_models_order_is_taken_as_is_and_still_checked() {
        let tensors = [t("w", "<f4", &[2, 2]), t("b", "<f4", &[2])];
        let frame = |values: &[f32]| {
            let mut buf = Vec::new();
            write_frame(&mut buf, &json!({}), &[&f32s(values)]).unwrap();
            read_frame(&mut buf.as_slice(), 1 << 10).unwrap().1
        };
        let m =
            update_from_body(&layout(), &tensors, frame(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])).unwrap();
        assert_eq!(m.values(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let err = update_from_body(
            &layout(),
            &tensors,
            frame(&[0.0, 0.0, 0.0, 0.0, 0.0, f32::INFINITY]),
        )
        .unwrap_err();
        assert!(err.contains("tensor `b` holds NaN or infinity"), "{err}");
    }

    #[test]
    fn frames_round_trip_and_oversized_bodies_are_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &json!({"op": "x"}), &[b"ab", b"cd"]).unwrap();
        let (h, b) = read_frame(&mut buf.as_slice(), 4).unwrap();
        assert_eq!(h["op"], "x");
        assert_eq!(&*b, b"abcd");
        assert!(read_frame(&mut buf.as_slice(), 3).is_err());
    }

    #[test]
    fn devices_map_to_cuda_visible_devices() {
        assert_eq!(device_visibility("cuda:1").unwrap(), "1");
        assert_eq!(device_visibility("0").unwrap(), "0");
        assert_eq!(device_visibility("cpu").unwrap(), "");
        assert!(device_visibility("gpu").is_err());
    }
}
