//! The edge agent: enrol once, then check in, train and upload, round after round, next
//! to data that never leaves the machine. Only model parameters are ever sent.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rand::RngExt;

use crate::data::Dataset;
use crate::model::{ModelKind, ModelSpec};
use crate::protocol::{CoordinatorClient, Credential, ProtocolError, Task, TaskKind};
use crate::train::LocalModel;
use crate::trainer::{SharedTrainer, TrainerFailure, TrainerJob, TrainerOutput};
use cohort_aggregation::ModelVector;

/// What the agent needs to run.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Coordinator base URL, e.g. `https://127.0.0.1:8443`.
    pub coordinator: String,
    /// Allow a plain `http://` coordinator URL: the enrolment token, the credential and
    /// the updates then cross the network unencrypted. Off: such a URL is refused.
    pub insecure_http: bool,
    /// PEM of the CA to trust (the coordinator's dev CA), or the system roots.
    pub ca_pem: Option<Vec<u8>>,
    /// Mutual TLS: this client's certificate chain and private key, PEM, for a
    /// coordinator that asks for one (`cohort serve --client-ca`).
    pub identity_pem: Option<Vec<u8>>,
    /// One-time enrolment token; needed only until the credential is stored.
    pub enrol_token: Option<String>,
    /// Who trains each task: the built-in models on a local CSV
    /// ([`BuiltInTrainer`](crate::trainer::BuiltInTrainer)), the user's program, or an
    /// app's callback.
    pub trainer: SharedTrainer,
    /// Where the credential is kept across restarts.
    pub state_dir: PathBuf,
    /// Stop after this long without a task (`None`: run until killed).
    pub idle_exit: Option<Duration>,
    /// Seed of local shuffling and of the stochastic rounding before masking. Each task
    /// uses a seed derived from this one and the task's round number (not from how many
    /// tasks came before), so a round that is handed out again after a coordinator
    /// restart trains and rounds exactly as the first time.
    pub seed: u64,
    /// Local differential privacy: clip and noise every update before it leaves, within
    /// the client's own budget.
    pub local_dp: Option<crate::local_dp::LocalDp>,
    /// Extra time spent on every task after training and before the upload: emulates a
    /// slow device (a straggler) in tests and demonstrations. Zero for real use.
    pub slowdown: Duration,
    /// The least this client accepts of a secure round's settings (threshold,
    /// neighbours, party count, noise): a round below them is refused, and the refusal
    /// says which floor it fell short of.
    pub floors: cohort_aggregation::secagg::ClientFloors,
    /// What this site allows (experiments, rounds); a task outside it is refused,
    /// reported and logged ([`crate::governance`]).
    pub rules: crate::governance::SiteRules,
}

/// Why the agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// No stored credential and no enrolment token.
    #[error("not enrolled yet: pass an enrolment token")]
    NoToken,
    /// Reading or writing the state directory failed.
    #[error("state directory `{path}`: {source}")]
    State {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The coordinator refused us for good.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A task does not fit the local data.
    #[error("task does not fit the local data: {0}")]
    Task(String),
    /// This client left a secure round: the coordinator's messages did not check out,
    /// or too few of its neighbours remained. The round goes on without it.
    #[error("secure aggregation: {0}")]
    SecureAggregation(#[from] cohort_aggregation::secagg::SecAggError),
    /// Local differential privacy settings or ledger.
    #[error(transparent)]
    LocalDp(#[from] crate::local_dp::LocalDpError),
    /// This client's identity could not be loaded or made.
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityFileError),
    /// The trainer could not complete the task (or its output was refused).
    #[error("trainer: {0}")]
    Trainer(TrainerFailure),
}

/// What the agent did before it stopped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentReport {
    /// The client's id.
    pub client_id: Option<uuid::Uuid>,
    /// Updates uploaded (acknowledged by the coordinator).
    pub uploads: usize,
    /// `(experiment, round, attempt)` of every acknowledged upload.
    pub acknowledged: Vec<(uuid::Uuid, i64, i64)>,
    /// Tasks given up (e.g. the round closed before the upload).
    pub skipped: usize,
    /// Tasks the trainer could not complete (reported to the coordinator as failed).
    pub failed: usize,
    /// Evaluation tasks completed (metrics reported).
    pub evaluations: usize,
    /// The fingerprint of this client's identity, as the coordinator's admin sees it.
    pub identity_fingerprint: Option<String>,
    /// Evaluation tasks answered without metrics: under local differential privacy no
    /// metric of this client's data leaves the machine.
    pub evaluations_withheld: usize,
    /// Tasks this site's rules refused (reported to the coordinator).
    pub refused: usize,
}

/// Delay before retry number `attempt` (from 0): exponential from 0.5 s, capped at 30 s,
/// with full jitter so that many clients coming back after an outage spread out.
pub fn backoff_delay(attempt: u32, rng: &mut impl rand::Rng) -> Duration {
    let cap_ms = 30_000f64;
    let ceiling = (500.0 * 2f64.powi(attempt.min(16) as i32)).min(cap_ms);
    Duration::from_millis(rng.random_range(0.0..=ceiling) as u64)
}

const CREDENTIAL_FILE: &str = "credential.json";

fn state_error(path: &Path) -> impl FnOnce(std::io::Error) -> AgentError + '_ {
    move |source| AgentError::State {
        path: path.to_path_buf(),
        source,
    }
}

fn load_credential(dir: &Path) -> Result<Option<Credential>, AgentError> {
    let path = dir.join(CREDENTIAL_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| AgentError::State {
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(state_error(&path)(e)),
    }
}

fn store_credential(dir: &Path, cred: &Credential) -> Result<(), AgentError> {
    std::fs::create_dir_all(dir).map_err(state_error(dir))?;
    let path = dir.join(CREDENTIAL_FILE);
    let tmp = dir.join("credential.json.tmp");
    let json = serde_json::to_vec(cred).expect("a credential serialises");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = options.open(&tmp)?;
        f.write_all(&json)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(state_error(&path))
}

/// Runs `op` until it succeeds or fails for good, sleeping [`backoff_delay`] between
/// retryable failures.
async fn with_retries<T, F, Fut>(mut op: F) -> Result<T, ProtocolError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ProtocolError>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if e.is_retryable() => {
                let delay = backoff_delay(attempt, &mut rand::rng());
                note(&format!("retrying in {delay:?}: {e}"));
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn note(line: &str) {
    eprintln!("cohort-edge: {line}");
}

/// A test hook, as the coordinator's `COHORT_FAULT_PAUSE`: with
/// `COHORT_EDGE_PAUSE=<stage>:<round>` the agent stops for ever just before it sends
/// that stage's message (`advertise`, `reveal`, `share`, `masked`, `confirm` or
/// `unmask`) in the first secure round it serves from round `<round>` on, after saying
/// so on stderr, so that a test can kill it at an exact stage. Unset, as in production,
/// it costs one environment read per stage.
async fn pause_point(stage: &str, round: i64) {
    let wanted = std::env::var("COHORT_EDGE_PAUSE").unwrap_or_default();
    let Some((at, from)) = wanted.split_once(':') else {
        return;
    };
    if at == stage && from.parse::<i64>().is_ok_and(|from| round >= from) {
        note(&format!("paused before {stage} in round {round}"));
        std::future::pending::<()>().await;
    }
}

/// Enrols if needed, then serves tasks until idle for `idle_exit` (or forever).
pub async fn run_agent(config: AgentConfig) -> Result<AgentReport, AgentError> {
    let client = CoordinatorClient::with_identity(
        &config.coordinator,
        config.ca_pem.as_deref(),
        config.identity_pem.as_deref(),
        config.insecure_http,
    )?;
    let identity = crate::identity::load_or_create(&config.state_dir)?;
    let public = identity.public();
    let fingerprint = cohort_aggregation::secagg::identity::fingerprint(&public);
    note(&format!("identity fingerprint {fingerprint}"));
    let cred = credential(&client, &config, &public).await?;
    let mut report = AgentReport {
        client_id: Some(cred.client_id),
        identity_fingerprint: Some(fingerprint),
        ..AgentReport::default()
    };
    let mut ledger = match &config.local_dp {
        Some(dp) => {
            dp.validate()?;
            Some(crate::local_dp::Ledger::load(&config.state_dir)?)
        }
        None => None,
    };
    // Every trainer call this agent starts is counted until it returns; each task below
    // ends only once its calls have, and so does this function, however it ends.
    let runs = TrainerRuns::default();
    let _wait_on_exit = runs.wait_on_drop();
    let trainer = TrackedTrainer {
        trainer: config.trainer.clone(),
        runs: runs.clone(),
        state_dir: Arc::new(config.state_dir.clone()),
    };
    let joined = std::sync::Mutex::new(std::collections::HashSet::new());
    let site_log = crate::governance::SiteLog::new(&config.state_dir);
    let mut idle_since = Instant::now();
    loop {
        if config
            .idle_exit
            .is_some_and(|limit| idle_since.elapsed() >= limit)
        {
            return Ok(report);
        }
        // Never wait past the idle limit, so an idle agent exits on time.
        let wait = config.idle_exit.map_or(10, |limit| {
            limit.saturating_sub(idle_since.elapsed()).as_secs().min(10)
        });
        let task = with_retries(|| client.checkin(&cred, wait)).await?;
        let Some(task) = task else { continue };
        // The site's rules, before any data is read or any budget charged. The log is
        // read back only when a round limit needs its count.
        let trained = match config.rules.max_rounds {
            Some(_) => site_log
                .trained(task.experiment_id)
                .map_err(state_error(site_log.path()))?,
            None => 0,
        };
        let code = config
            .rules
            .approved_trainer
            .as_ref()
            .and_then(|_| config.trainer.code_hash());
        if let Some(why) =
            config
                .rules
                .refusal(&task_ref(&task), task.columns.as_deref(), trained, code)
        {
            refuse(&client, &cred, &task, &why, &site_log).await?;
            report.refused += 1;
            idle_since = Instant::now();
            continue;
        }
        let sent_before = client.update_bytes_sent();
        if let (TaskKind::Train, Some(dp), Some(ledger)) =
            (task.kind, &config.local_dp, &mut ledger)
            && !charge_local_dp(ledger, dp, &config.state_dir)?
        {
            return Ok(report);
        }
        let round_seed = task_seed(config.seed, task.round);
        let how = HowToServe {
            seed: round_seed,
            slowdown: config.slowdown,
            local_dp: config.local_dp.as_ref(),
            floors: &config.floors,
            identity: &identity,
            joined: &joined,
            state_dir: &config.state_dir,
        };
        let outcome = match task.kind {
            TaskKind::Evaluate => {
                serve_evaluation(&client, &cred, trainer.clone(), &task, &how).await
            }
            TaskKind::Train => serve_task(&client, &cred, trainer.clone(), &task, &how)
                .await
                .map(|()| Served::Uploaded),
        };
        // A task can end (a secure round abandoned, an error) while the training it
        // started still runs; the next task, and the caller once this returns, must not
        // see it go on: an app's C callback cannot be cancelled, so it is waited for.
        runs.settled().await;
        let mut entry =
            crate::governance::SiteLogEntry::of(&task_ref(&task), logged_outcome(&outcome));
        entry.reason = match &outcome {
            Err(e) => Some(e.to_string()),
            Ok(_) => None,
        };
        entry.bytes_sent = client.update_bytes_sent() - sent_before;
        entry.local_dp_epsilon = match (&config.local_dp, &ledger) {
            (Some(dp), Some(ledger)) => ledger.epsilon_with(None, dp.delta).ok(),
            _ => None,
        };
        site_log
            .append(&entry)
            .map_err(state_error(site_log.path()))?;
        record_outcome(outcome, &task, &mut report, &client, &cred).await?;
        idle_since = Instant::now();
    }
}

/// This client's credential: the stored one (its identity key registered, for a
/// client enrolled before identities existed), or a new enrolment with the token.
async fn credential(
    client: &CoordinatorClient,
    config: &AgentConfig,
    public: &[u8; 32],
) -> Result<Credential, AgentError> {
    Ok(match load_credential(&config.state_dir)? {
        Some(cred) => {
            // A client enrolled before identities existed registers its own now; for
            // one that has it, this changes nothing. Another key on file is refused:
            // the admin must reset it, which is what a swapped identity should need.
            with_retries(|| client.register_identity(&cred, public)).await?;
            cred
        }
        None => {
            let token = config.enrol_token.as_deref().ok_or(AgentError::NoToken)?;
            let cred = with_retries(|| client.enrol(token, public)).await?;
            store_credential(&config.state_dir, &cred)?;
            note(&format!("enrolled as {}", cred.client_id));
            cred
        }
    })
}

/// Charges a training task's update to the local DP ledger, and stores the ledger,
/// before the update can leave: a crash after the upload cannot forget what it spent.
/// Only updates are charged: nothing else of this client's data leaves under local DP
/// (see `withhold_metrics`). `false` when the budget is spent: a client that can no
/// longer contribute stops checking in, rather than be selected and drop out of every
/// round.
fn charge_local_dp(
    ledger: &mut crate::local_dp::Ledger,
    dp: &crate::local_dp::LocalDp,
    state_dir: &Path,
) -> Result<bool, AgentError> {
    match ledger.charge(dp) {
        Ok(epsilon) => {
            ledger.store(state_dir)?;
            note(&format!(
                "local dp: epsilon {epsilon:.4} (delta {}) with this update",
                dp.delta
            ));
            Ok(true)
        }
        Err(e @ crate::local_dp::LocalDpError::BudgetSpent { .. }) => {
            note(&e.to_string());
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// Refuses `task` under the site's rules: reported to the coordinator as the task's
/// failure (with `why`), and written to the site log.
async fn refuse(
    client: &CoordinatorClient,
    cred: &Credential,
    task: &Task,
    why: &str,
    site_log: &crate::governance::SiteLog,
) -> Result<(), AgentError> {
    note(&format!(
        "refused experiment={} round={} attempt={}: {why}",
        task.experiment_id, task.round, task.attempt
    ));
    site_log
        .append(&crate::governance::SiteLogEntry {
            reason: Some(why.to_string()),
            ..crate::governance::SiteLogEntry::of(
                &task_ref(task),
                crate::governance::TaskOutcome::Refused,
            )
        })
        .map_err(state_error(site_log.path()))?;
    if let Err(e) = with_retries(|| client.report_failure(cred, task, why)).await {
        note(&format!("could not report the refusal: {e}"));
    }
    Ok(())
}

/// `task` as the site's rules and log see it.
fn task_ref(task: &Task) -> crate::governance::TaskRef {
    crate::governance::TaskRef {
        experiment: task.experiment_id,
        round: task.round,
        attempt: task.attempt,
        kind: match task.kind {
            TaskKind::Train => crate::governance::Kind::Train,
            TaskKind::Evaluate => crate::governance::Kind::Evaluate,
        },
    }
}

/// What the site log says became of a task that ran.
fn logged_outcome(outcome: &Result<Served, AgentError>) -> crate::governance::TaskOutcome {
    use crate::governance::TaskOutcome;
    match outcome {
        Ok(Served::Uploaded) => TaskOutcome::Uploaded,
        Ok(Served::Evaluated) => TaskOutcome::Evaluated,
        Ok(Served::Withheld) => TaskOutcome::Withheld,
        Err(
            AgentError::Protocol(ProtocolError::Refused {
                status: 404 | 409, ..
            })
            | AgentError::SecureAggregation(_),
        ) => TaskOutcome::Skipped,
        Err(_) => TaskOutcome::Failed,
    }
}

/// Counts what became of a task in the report (and says so in the log): a failed
/// trainer is reported to the coordinator, a round that moved on or a secure round left
/// is skipped; any other error ends the agent.
async fn record_outcome(
    outcome: Result<Served, AgentError>,
    task: &Task,
    report: &mut AgentReport,
    client: &CoordinatorClient,
    cred: &Credential,
) -> Result<(), AgentError> {
    match outcome {
        Ok(Served::Evaluated) => {
            report.evaluations += 1;
            note(&format!(
                "evaluated experiment={} model_version={}",
                task.experiment_id, task.round
            ));
        }
        Ok(Served::Withheld) => {
            report.evaluations_withheld += 1;
            note(&format!(
                "withheld the evaluation (local dp) experiment={} model_version={}",
                task.experiment_id, task.round
            ));
        }
        // The trainer failed: the task is reported failed and nothing was uploaded;
        // the next task starts afresh.
        Err(AgentError::Trainer(failure)) => {
            note(&format!(
                "task failed experiment={} round={} attempt={}: {failure}",
                task.experiment_id, task.round, task.attempt
            ));
            report.failed += 1;
            if let Err(e) =
                with_retries(|| client.report_failure(cred, task, &failure.reason)).await
            {
                note(&format!("could not report the failure: {e}"));
            }
        }
        Ok(Served::Uploaded) => {
            report.uploads += 1;
            report
                .acknowledged
                .push((task.experiment_id, task.round, task.attempt));
            // The site's own record of what the coordinator confirmed it holds.
            note(&format!(
                "acknowledged experiment={} round={} attempt={}",
                task.experiment_id, task.round, task.attempt
            ));
        }
        // The round moved on (closed, deadline passed): wait for the next one.
        Err(AgentError::Protocol(ProtocolError::Refused {
            status: 404 | 409, ..
        })) => {
            report.skipped += 1;
        }
        // This client left a secure round; the next one starts afresh.
        Err(AgentError::SecureAggregation(e)) => {
            note(&format!(
                "left secure round experiment={} round={} attempt={}: {e}",
                task.experiment_id, task.round, task.attempt
            ));
            report.skipped += 1;
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// The experiment's class index of every local sample.
///
/// A CSV's classes are numbered by the labels that occur in that file, so a client that
/// lacks some classes (the normal case with non-IID data) would number the others
/// differently from its peers. The experiment's classes are `0..classes`, so each label
/// must be one of those integers, and that integer is the index.
pub fn experiment_labels(data: &Dataset, classes: usize) -> Result<Vec<u32>, AgentError> {
    let index: Vec<u32> = data
        .classes
        .iter()
        .map(|name| match name.trim().parse::<usize>() {
            Ok(i) if i < classes => Ok(i as u32),
            _ => Err(AgentError::Task(format!(
                "label `{name}` is not one of the experiment's classes 0..{}",
                classes.saturating_sub(1)
            ))),
        })
        .collect::<Result<_, _>>()?;
    Ok(data.labels.iter().map(|&l| index[l as usize]).collect())
}

/// The layout of the task's model: a file model's tensors, or a built-in model's.
fn task_layout(task: &Task) -> Result<std::sync::Arc<cohort_aggregation::Layout>, AgentError> {
    if let Some(tensors) = &task.tensors {
        return cohort_aggregation::Layout::new(tensors.clone())
            .map(std::sync::Arc::new)
            .map_err(|e| AgentError::Task(format!("the task's tensors: {e}")));
    }
    let kind: ModelKind = task
        .model
        .parse()
        .map_err(|e| AgentError::Task(format!("{e}")))?;
    ModelSpec::new(&kind, task.features, task.classes)
        .map(|spec| spec.layout().clone())
        .map_err(|e| AgentError::Task(e.to_string()))
}

/// The trainer calls an agent has started and that have not returned yet. A call is
/// counted from the moment it is spawned (not when the blocking pool gets to it) until
/// its closure ends, so that nothing counted as finished can still start.
#[derive(Debug, Clone, Default)]
struct TrainerRuns(Arc<RunCount>);

#[derive(Debug, Default)]
struct RunCount {
    running: Mutex<usize>,
    /// For the blocking wait of [`WaitOnDrop`].
    none_running: Condvar,
    /// For the async wait of [`TrainerRuns::settled`].
    settled: tokio::sync::Notify,
}

/// One counted trainer call; dropping it (when the call's closure ends, or if the
/// closure is dropped unrun) ends the count.
struct Run(Arc<RunCount>);

impl TrainerRuns {
    fn start(&self) -> Run {
        *lock(&self.0.running) += 1;
        Run(self.0.clone())
    }

    /// Returns once no trainer call started by this agent is running.
    async fn settled(&self) {
        loop {
            let notified = self.0.settled.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the count is read, so a call ending in between still
            // wakes this one.
            notified.as_mut().enable();
            if *lock(&self.0.running) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// A guard that, when dropped, blocks until no call is running: what keeps the
    /// promise when the agent's future is dropped mid-task (cancelled, or unwound by a
    /// panic) instead of reaching [`settled`](Self::settled).
    fn wait_on_drop(&self) -> WaitOnDrop {
        WaitOnDrop(self.0.clone())
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let mut running = lock(&self.0.running);
        *running -= 1;
        if *running == 0 {
            self.0.none_running.notify_all();
            self.0.settled.notify_waiters();
        }
    }
}

/// See [`TrainerRuns::wait_on_drop`].
struct WaitOnDrop(Arc<RunCount>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        // Blocking a thread here is the lesser evil: the alternative is a callback
        // running into memory its app freed once the call that started it returned.
        let mut running = lock(&self.0.running);
        while *running > 0 {
            running = self
                .0
                .none_running
                .wait(running)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// A lock that a panic elsewhere does not poison: the count stays right whatever
/// panicked, since it is only ever changed by one step under the lock.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The agent's trainer, with its calls counted ([`TrainerRuns`]).
#[derive(Debug, Clone)]
struct TrackedTrainer {
    trainer: SharedTrainer,
    runs: TrainerRuns,
    /// Where a personalised task keeps the client's personal part.
    state_dir: Arc<std::path::PathBuf>,
}

/// Starts the trainer off the async threads; its output is checked before it is
/// returned. The call is counted until it returns, whether or not the handle is awaited.
fn spawn_trainer(
    trainer: TrackedTrainer,
    task: &Task,
    global: ModelVector,
    version: i64,
    seed: u64,
) -> tokio::task::JoinHandle<Result<TrainerOutput, TrainerFailure>> {
    let task = task.clone();
    let run = trainer.runs.start();
    tokio::task::spawn_blocking(move || {
        let _run = run;
        let job = TrainerJob {
            task: &task,
            global: &global,
            model_version: version,
            seed,
            trainable: None,
            anchor: None,
        };
        let output = if task.personalisation.is_some() {
            crate::trainer::personalised::run(
                trainer.trainer.as_ref(),
                &task,
                &global,
                version,
                seed,
                &trainer.state_dir,
            )?
        } else {
            trainer.trainer.run(&job)?
        };
        crate::trainer::check_output(&job, &output)?;
        Ok(output)
    })
}

/// What a started trainer returned, as the agent's result.
async fn trained(
    handle: tokio::task::JoinHandle<Result<TrainerOutput, TrainerFailure>>,
) -> Result<TrainerOutput, AgentError> {
    handle
        .await
        .map_err(|e| {
            AgentError::Trainer(TrainerFailure::new(format!("the trainer panicked: {e}")))
        })?
        .map_err(AgentError::Trainer)
}

/// Runs the trainer and checks what it returns.
async fn run_trainer(
    trainer: TrackedTrainer,
    task: &Task,
    global: ModelVector,
    version: i64,
    seed: u64,
) -> Result<TrainerOutput, AgentError> {
    trained(spawn_trainer(trainer, task, global, version, seed)).await
}

/// How a task ended well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// A training task's update is acknowledged.
    Uploaded,
    /// An evaluation task's metrics are reported.
    Evaluated,
    /// An evaluation task is answered without metrics ([`withhold_metrics`]).
    Withheld,
}

/// Whether this client keeps its metrics to itself: under local differential privacy
/// no metric of its data leaves the machine, not even noised.
///
/// Noising them was the other way: each metric clipped to a range (accuracy in [0, 1],
/// the loss and the example count to a stated bound), noised at the client's multiplier
/// and charged to its ledger. But every report would then cost as much epsilon as an
/// update, the noise (the bound times the multiplier) would drown any one client's
/// figure, and a budget the user sized for its updates would run out on telemetry. A
/// user who asks for local DP expects the budget to buy model updates and nothing else
/// of the data to leave; so the client says only that it withheld them, which tells
/// nothing of its data, costs nothing, and keeps the coordinator from asking again.
fn withhold_metrics(local_dp: Option<&crate::local_dp::LocalDp>) -> bool {
    local_dp.is_some()
}

/// Sends the trainer's evaluation of the model it received, when the experiment takes
/// one. A report that does not get through is logged, not fatal: it is a report, and
/// the update matters more.
async fn send_evaluation(
    client: &CoordinatorClient,
    cred: &Credential,
    task: &Task,
    version: i64,
    output: &TrainerOutput,
) {
    // Never in a secure round, whatever the coordinator asks: the update travels masked,
    // and this client's metrics in the clear beside it would tell what the masking
    // hides. Its weight and loss travel inside the masked vector instead.
    if task.secure_aggregation.is_some() {
        return;
    }
    let (true, Some(evaluation)) = (task.report_metrics, &output.evaluation) else {
        return;
    };
    if let Err(e) =
        with_retries(|| client.report_evaluation(cred, task.experiment_id, version, evaluation))
            .await
    {
        note(&format!("could not report the evaluation: {e}"));
    }
}

/// Tells the coordinator, when the experiment takes evaluations, that this client
/// withholds its own of model `version` ([`withhold_metrics`]). Logged, not fatal, as
/// [`send_evaluation`].
async fn send_withheld(client: &CoordinatorClient, cred: &Credential, task: &Task, version: i64) {
    if !task.report_metrics || task.secure_aggregation.is_some() {
        return;
    }
    if let Err(e) =
        with_retries(|| client.withhold_evaluation(cred, task.experiment_id, version)).await
    {
        note(&format!("could not report the withheld evaluation: {e}"));
    }
}

/// An evaluation task: the trainer evaluates the current model; only metrics are sent.
/// A client that withholds its metrics ([`withhold_metrics`]) neither fetches the model
/// nor runs the trainer: it answers that it withheld them.
async fn serve_evaluation(
    client: &CoordinatorClient,
    cred: &Credential,
    trainer: TrackedTrainer,
    task: &Task,
    how: &HowToServe<'_>,
) -> Result<Served, AgentError> {
    if withhold_metrics(how.local_dp) {
        // The task's round is the model version to evaluate.
        with_retries(|| client.withhold_evaluation(cred, task.experiment_id, task.round)).await?;
        return Ok(Served::Withheld);
    }
    let seed = how.seed;
    let layout = task_layout(task)?;
    let (global, version) =
        with_retries(|| client.versioned_model(cred, task.experiment_id, &layout)).await?;
    let output = run_trainer(trainer, task, global, version, seed).await?;
    let Some(evaluation) = &output.evaluation else {
        return Err(AgentError::Trainer(TrainerFailure::new(
            "an evaluation task's result has no metrics",
        )));
    };
    with_retries(|| client.report_evaluation(cred, task.experiment_id, version, evaluation))
        .await?;
    Ok(Served::Evaluated)
}

/// This client's settings for one task.
struct HowToServe<'a> {
    /// The task's seed ([`task_seed`]).
    seed: u64,
    /// Extra time before the upload ([`AgentConfig::slowdown`]).
    slowdown: Duration,
    local_dp: Option<&'a crate::local_dp::LocalDp>,
    floors: &'a cohort_aggregation::secagg::ClientFloors,
    /// Signs this client's keys and survivor lists in secure rounds.
    identity: &'a cohort_aggregation::secagg::Identity,
    /// Secure sessions this client has joined: a coordinator that sends one again
    /// (to replay signed messages of an earlier round) is refused.
    joined: &'a std::sync::Mutex<std::collections::HashSet<[u8; 32]>>,
    /// The state directory (the error-feedback residual of compressed uploads).
    state_dir: &'a Path,
}

async fn serve_task(
    client: &CoordinatorClient,
    cred: &Credential,
    trainer: TrackedTrainer,
    task: &Task,
    how: &HowToServe<'_>,
) -> Result<(), AgentError> {
    let HowToServe {
        seed,
        slowdown,
        local_dp,
        state_dir,
        ..
    } = *how;
    if let Some(secure) = &task.secure_aggregation {
        return serve_secure_task(client, cred, trainer, task, secure, how).await;
    }
    let layout = task_layout(task)?;
    let (global, version) =
        with_retries(|| client.versioned_model(cred, task.experiment_id, &layout)).await?;
    let base = global.clone();
    let output = run_trainer(trainer, task, global, version, seed).await?;
    if withhold_metrics(local_dp) {
        send_withheld(client, cred, task, version).await;
    } else {
        send_evaluation(client, cred, task, version, &output).await;
    }
    let update = output
        .update
        .expect("checked: a training task has an update");
    if !slowdown.is_zero() {
        tokio::time::sleep(slowdown).await;
    }
    let (params, samples, loss) = match local_dp {
        // The clipped, noised update, at weight 1 and with no loss: a sample count would
        // raise this client's influence past the clip (and tell its data's size), and the
        // loss is not noised.
        Some(dp) => {
            let mut delta: Vec<f32> = update
                .values()
                .iter()
                .zip(base.values())
                .map(|(p, g)| p - g)
                .collect();
            dp.privatize(&mut delta, &mut rand::rng())?;
            let noised: Vec<f32> = base
                .values()
                .iter()
                .zip(&delta)
                .map(|(g, d)| g + d)
                .collect();
            let params = cohort_aggregation::ModelVector::new(base.layout().clone(), noised)
                .map_err(|e| AgentError::Task(e.to_string()))?;
            (params, 1, f64::NAN)
        }
        None => (
            update,
            usize::try_from(output.num_examples).unwrap_or(usize::MAX),
            output.train_loss.unwrap_or(f64::NAN),
        ),
    };
    // One id for every try of this upload: a retry whose first try was stored (its
    // answer lost) is recognised, not counted twice or refused.
    let upload_id = uuid::Uuid::new_v4();
    if task.upload != crate::protocol::UploadForm::CompressedDifference {
        with_retries(|| client.upload(cred, task, &params, samples, loss, upload_id)).await?;
        return Ok(());
    }
    let Some(compression) = &task.compression else {
        return Err(AgentError::Task(
            "the task asks for a compressed difference without its compression settings".into(),
        ));
    };
    // From the model this client received (its own decoded copy of a compressed one).
    let difference: Vec<f32> = params
        .values()
        .iter()
        .zip(base.values())
        .map(|(p, g)| p - g)
        .collect();
    let body = crate::upload_compression::compress_upload(
        state_dir,
        task.experiment_id,
        (compression.upload, compression.upload_rotation_seed),
        &difference,
        task_seed(seed, -2),
    )
    .map_err(|e| AgentError::Task(e.to_string()))?;
    with_retries(|| client.upload_body(cred, task, body.clone(), samples, loss, upload_id)).await?;
    Ok(())
}

/// Polls a long-polling fetch until the stage it waits for has closed.
async fn wait_stage<T, F, Fut>(mut fetch: F) -> Result<T, ProtocolError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, ProtocolError>>,
{
    loop {
        if let Some(found) = with_retries(&mut fetch).await? {
            return Ok(found);
        }
    }
}

/// A secure round: the SecAgg+ stages around local training. Only the masked
/// vector of the update ever leaves the machine; the keys and the self-mask seed stay in
/// memory, so a client that restarts mid-round drops out of it, and the protocol's
/// dropout recovery takes over.
async fn serve_secure_task(
    client: &CoordinatorClient,
    cred: &Credential,
    trainer: TrackedTrainer,
    task: &Task,
    secure: &crate::protocol::SecureTask,
    how: &HowToServe<'_>,
) -> Result<(), AgentError> {
    use cohort_aggregation::secagg::ClientSession;
    let HowToServe {
        seed,
        local_dp,
        floors,
        identity,
        joined,
        ..
    } = *how;

    let layout = task_layout(task)?;
    if secure.config.dimension != layout.len() {
        return Err(AgentError::Task(format!(
            "the secure round expects {} parameters, the model has {}",
            secure.config.dimension,
            layout.len()
        )));
    }
    admit_secure_round(joined, task, &secure.config)?;
    // Floors first: a round below them is refused before a key or a model is fetched.
    let (mut session, keys) = ClientSession::with_floors(
        secure.config.clone(),
        secure.index,
        *floors,
        identity,
        &mut rand::rng(),
    )?;
    pause_point("advertise", task.round).await;
    with_retries(|| client.advertise_keys(cred, task, &keys)).await?;
    let round = format!(
        "experiment={} round={} attempt={}",
        task.experiment_id, task.round, task.attempt
    );
    note(&format!("secagg advertised keys {round}"));
    // Train while the other clients advertise, reveal and share.
    let (global, version) =
        with_retries(|| client.versioned_model(cred, task.experiment_id, &layout)).await?;
    let base = global.clone();
    let training = spawn_trainer(trainer, task, global, version, seed);
    let roster = wait_stage(|| client.roster(cred, task, 10)).await?;
    let reveal = session.reveal(&roster)?;
    pause_point("reveal", task.round).await;
    with_retries(|| client.send_reveal(cred, task, &reveal)).await?;
    note(&format!("secagg revealed graph nonce {round}"));
    let directory = wait_stage(|| client.key_directory(cred, task, 10)).await?;
    let shares = session.share_keys(&directory, &mut rand::rng())?;
    pause_point("share", task.round).await;
    with_retries(|| client.send_shares(cred, task, &shares)).await?;
    note(&format!("secagg shared keys {round}"));
    let forwarded = wait_stage(|| client.forwarded_shares(cred, task, 10)).await?;
    // A failed trainer leaves the round here: nothing masked is sent, and the protocol
    // recovers from the dropout.
    let output = trained(training).await?;
    if local_dp.is_none() {
        send_evaluation(client, cred, task, version, &output).await;
    }
    let (mut session, masked) =
        mask_update(session, forwarded, &output, &base, local_dp, seed).await?;
    let upload_id = uuid::Uuid::new_v4();
    pause_point("masked", task.round).await;
    match with_retries(|| client.upload_masked(cred, task, &masked, upload_id)).await {
        Ok(()) => note(&format!("secagg uploaded masked input {round}")),
        // A retry whose first try was stored (its answer lost) is refused as a replay;
        // the survivor list says whether the input is in the sum, and a client left out
        // gets a 409 there too.
        Err(ProtocolError::Refused { status: 409, .. }) => {
            note(&format!(
                "secagg masked input refused as a replay or late {round}"
            ));
        }
        Err(e) => return Err(e.into()),
    }
    let mut request = wait_stage(|| client.survivors(cred, task, 10)).await?;
    if session.config().consistency_check {
        let confirmation = session.confirm(&request, identity)?;
        pause_point("confirm", task.round).await;
        with_retries(|| client.send_confirmation(cred, task, &confirmation)).await?;
        note(&format!("secagg signed the survivor list {round}"));
        request = wait_stage(|| client.unmask_request(cred, task, 10)).await?;
    }
    let reveal = session.unmask(&request)?;
    pause_point("unmask", task.round).await;
    with_retries(|| client.send_unmask(cred, task, &reveal)).await?;
    note(&format!("secagg revealed shares {round}"));
    Ok(())
}

/// The update's difference from the model it started from, noised first under local
/// DP, masked for the round (off the async threads: masking is a few passes over the
/// model). Hands the session back with the masked words.
async fn mask_update(
    mut session: cohort_aggregation::secagg::ClientSession,
    forwarded: cohort_aggregation::secagg::ForwardedShares,
    output: &TrainerOutput,
    base: &ModelVector,
    local_dp: Option<&crate::local_dp::LocalDp>,
    seed: u64,
) -> Result<(cohort_aggregation::secagg::ClientSession, Vec<u32>), AgentError> {
    let update = output
        .update
        .as_ref()
        .expect("checked: a training task has an update");
    let delta: Vec<f32> = update
        .values()
        .iter()
        .zip(base.values())
        .map(|(p, g)| p - g)
        .collect();
    let mut delta = delta;
    let (loss, samples) = match local_dp {
        // Noised before masking; weight 1 and no loss, as on plain rounds.
        Some(dp) => {
            dp.privatize(&mut delta, &mut rand::rng())?;
            (0.0, 1)
        }
        None => (output.train_loss.unwrap_or(0.0), output.num_examples),
    };
    // Stochastic rounding needs no secrecy (the masks hide the rounded vector), so its
    // noise follows the task's seed and a re-run of the round gives the same sum. Noise
    // for differential privacy must be unpredictable: with distributed noise the
    // generator is the operating system's.
    let seeded_rounding = session.quantizer().distributed_noise().is_none();
    // Masking is a few passes over the model: off the async threads.
    let (session, masked) = tokio::task::spawn_blocking(move || {
        let masked = if seeded_rounding {
            // A stream apart from training's, derived from the same task seed.
            let mut rounding =
                <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(task_seed(seed, -1));
            session.mask(&forwarded, &delta, samples, loss, &mut rounding)
        } else {
            session.mask(&forwarded, &delta, samples, loss, &mut rand::rng())
        };
        (session, masked)
    })
    .await
    .map_err(|e| AgentError::Task(e.to_string()))?;
    Ok((session, masked?))
}

/// Refuses a secure round whose settings could make this client sign something a
/// coordinator that cheats could replay: settings naming another experiment, round or
/// attempt than the task (the client signs for the task's), or a session this client
/// has already joined (every signature is bound to the session). Records the session.
fn admit_secure_round(
    joined: &std::sync::Mutex<std::collections::HashSet<[u8; 32]>>,
    task: &Task,
    config: &cohort_aggregation::secagg::RoundConfig,
) -> Result<(), AgentError> {
    let context = &config.context;
    if context.experiment != task.experiment_id.to_string()
        || context.round != u64::try_from(task.round).unwrap_or(u64::MAX)
        || context.attempt != u64::try_from(task.attempt).unwrap_or(u64::MAX)
    {
        return Err(AgentError::Task(
            "the secure round's settings name another round than its task".into(),
        ));
    }
    if !joined
        .lock()
        .expect("no panics while held")
        .insert(config.session)
    {
        return Err(AgentError::Task(
            "the coordinator sent a secure session this client has already joined".into(),
        ));
    }
    Ok(())
}

/// The seed a task of round `round` trains with, given the agent's `--seed`: the two
/// mixed (SplitMix64's finaliser) so that neighbouring rounds get unrelated streams.
/// Public so that a test can recompute exactly the update an agent sent.
pub fn task_seed(seed: u64, round: i64) -> u64 {
    let mut z = seed ^ (round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The task's model bound to the local data.
pub(crate) fn local_model(
    data: &Dataset,
    task: &Task,
) -> Result<(ModelSpec, LocalModel), AgentError> {
    let kind: ModelKind = task
        .model
        .parse()
        .map_err(|e| AgentError::Task(format!("{e}")))?;
    if data.num_features() != task.features {
        return Err(AgentError::Task(format!(
            "the model takes {} features, the local data has {}",
            task.features,
            data.num_features()
        )));
    }
    let spec = ModelSpec::new(&kind, task.features, task.classes)
        .map_err(|e| AgentError::Task(e.to_string()))?;
    let labels = experiment_labels(data, task.classes)?;
    let local = LocalModel::from_parts(spec.clone(), data.features.clone(), labels)
        .map_err(|e| AgentError::Task(e.to_string()))?;
    Ok((spec, local))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Issue 21: a coordinator that cheats could replay signed messages of one round
    /// in another by sending its settings again. The client signs only for its task's
    /// round and joins each session once.
    #[test]
    fn a_secure_round_naming_another_round_or_a_joined_session_is_refused() {
        let task = Task {
            experiment_id: uuid::Uuid::new_v4(),
            round: 4,
            attempt: 2,
            deadline_ms: None,
            model: "logreg".into(),
            features: 4,
            classes: 2,
            train: crate::train::TrainConfig::default(),
            secure_aggregation: None,
            kind: TaskKind::Train,
            tensors: None,
            upload: crate::protocol::UploadForm::MaskedDifference,
            hyperparameters: None,
            report_metrics: false,
            compression: None,
            personalisation: None,
            columns: None,
        };
        let config = |experiment: &str, round: u64, attempt: u64, session: u8| {
            cohort_aggregation::secagg::RoundConfig {
                session: [session; 32],
                context: cohort_aggregation::secagg::RoundContext {
                    experiment: experiment.into(),
                    round,
                    attempt,
                },
                consistency_check: true,
                parties: 3,
                threshold: 2,
                neighbours: 2,
                dimension: 10,
                quantization: Default::default(),
            }
        };
        let joined = std::sync::Mutex::new(std::collections::HashSet::new());
        let exp = task.experiment_id.to_string();
        for (other, why) in [
            (config("another", 4, 2, 1), "experiment"),
            (config(&exp, 3, 2, 1), "round"),
            (config(&exp, 4, 1, 1), "attempt"),
        ] {
            let refused = admit_secure_round(&joined, &task, &other).unwrap_err();
            assert!(
                refused.to_string().contains("another round"),
                "{why}: {refused}"
            );
        }
        admit_secure_round(&joined, &task, &config(&exp, 4, 2, 1)).unwrap();
        let again = admit_secure_round(&joined, &task, &config(&exp, 4, 2, 1)).unwrap_err();
        assert!(again.to_string().contains("already joined"), "{again}");
        admit_secure_round(&joined, &task, &config(&exp, 4, 2, 2)).unwrap();
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for attempt in 0..40 {
            let d = backoff_delay(attempt, &mut rng);
            let ceiling = (500.0 * 2f64.powi(attempt.min(16) as i32)).min(30_000.0);
            assert!(d.as_millis() as f64 <= ceiling, "attempt {attempt}: {d:?}");
        }
        let late: Vec<_> = (0..50).map(|_| backoff_delay(10, &mut rng)).collect();
        assert!(late.iter().any(|d| *d != late[0]), "jittered");
        assert!(late.iter().all(|d| *d <= Duration::from_secs(30)));
    }

    #[test]
    fn labels_keep_the_experiment_numbering_when_classes_are_missing_locally() {
        // Only classes 3 and 8 occur here; the CSV loader numbers them 0 and 1.
        let data =
            crate::data::parse_csv("a,label\n1,3\n2,8\n3,3\n".as_bytes(), "local.csv").unwrap();
        assert_eq!(data.labels, vec![0, 1, 0]);
        assert_eq!(experiment_labels(&data, 10).unwrap(), vec![3, 8, 3]);
        assert!(experiment_labels(&data, 5).is_err(), "8 is outside 0..4");
        let text = crate::data::parse_csv("a,label\n1,cat\n2,dog\n".as_bytes(), "t.csv").unwrap();
        assert!(experiment_labels(&text, 10).is_err());
    }

    /// A trainer that takes its time and counts the calls that have returned.
    #[derive(Debug, Default)]
    struct Slow(std::sync::atomic::AtomicUsize);

    impl crate::trainer::TaskTrainer for Slow {
        fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
            std::thread::sleep(Duration::from_millis(300));
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(TrainerOutput {
                update: Some(job.global.clone()),
                num_examples: 1,
                train_loss: None,
                evaluation: None,
            })
        }
    }

    /// A trainer call whose handle is dropped (its task abandoned) is still waited for:
    /// by the agent's next step, and by a guard dropped with the agent's future.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn abandoned_trainer_calls_are_waited_for() {
        let task: Task = serde_json::from_value(serde_json::json!({
            "experiment_id": "00000000-0000-0000-0000-000000000001",
            "round": 1, "attempt": 1, "deadline_ms": null, "model": "file",
            "features": 0, "classes": 0,
            "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.1, "momentum": 0.0,
                      "weight_decay": 0.0, "proximal_mu": null},
            "tensors": [{"name": "w", "shape": [2]}]
        }))
        .unwrap();
        let layout = task_layout(&task).unwrap();
        let global = ModelVector::new(layout, vec![1.0, 2.0]).unwrap();
        let slow = Arc::new(Slow::default());
        let tracked = TrackedTrainer {
            trainer: slow.clone(),
            runs: TrainerRuns::default(),
            state_dir: Arc::new(std::env::temp_dir()),
        };
        let returned = || slow.0.load(std::sync::atomic::Ordering::SeqCst);

        drop(spawn_trainer(tracked.clone(), &task, global.clone(), 0, 1));
        tracked.runs.settled().await;
        assert_eq!(returned(), 1, "settled before the call returned");

        let guard = tracked.runs.wait_on_drop();
        drop(spawn_trainer(tracked.clone(), &task, global, 0, 1));
        tokio::task::spawn_blocking(move || drop(guard))
            .await
            .unwrap();
        assert_eq!(returned(), 2, "the guard let go before the call returned");
    }

    #[test]
    fn credential_survives_a_restart_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load_credential(dir.path()).unwrap(), None);
        let cred = Credential {
            client_id: uuid::Uuid::new_v4(),
            secret: "s3cret".into(),
        };
        store_credential(dir.path(), &cred).unwrap();
        assert_eq!(load_credential(dir.path()).unwrap(), Some(cred));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(CREDENTIAL_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
