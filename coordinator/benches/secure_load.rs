//! Load on one coordinator in the two shapes a fleet of phones gives it.
//!
//! **Secure rounds** (the default): N virtual edge clients, each an in-process task with
//! its own credential and its own HTTPS connection (one `cohort_edge` protocol client
//! each), drive a real `cohort serve` process through complete SecAgg+ rounds: check-in,
//! advertise keys, key directory, send shares, forwarded shares, mask a synthetic update
//! of `d` parameters, upload the masked input, survivors, unmask. Every round must reach
//! `published`; anything else fails the run. It reports uploads per second over the
//! collection window (first masked upload sent to last one answered), upload latency
//! (request sent to answer, masking excluded), the time each stage of each round took
//! (as the admin API shows the round moving), and the coordinator's memory: resident
//! size sampled through the run and the kernel's high-water mark (`VmHWM`).
//!
//! **Held long polls** (`--hold-polls M`): M clients enrol, then all of them hold a
//! check-in long poll at once while no experiment runs, as an idle fleet does. It counts
//! errors and early answers (both must be 0), shows from the server's side that all M
//! were held at once (each request recorded the client as seen, `/metrics` counted no
//! check-in answered, and the coordinator held at least M socket descriptors), and
//! reports the time to enrol and connect, the time until all polls were in, and the
//! coordinator's peak resident memory and descriptor count.
//!
//! Masking (and the other client-side cryptography) runs on a bounded pool of
//! `--mask-workers` threads, so that the load generator does not take every core from
//! the coordinator it measures. The baseline, measured in the same run on the same disk
//! and memory, is the rate of durable writes of one masked input's bytes (write, fsync,
//! rename, directory fsync: the floor of an acknowledged upload) and a memory read probe;
//! `ratio` is uploads/s over durable writes/s.
//!
//! ```text
//! cargo bench -p cohort-coordinator --bench secure_load -- [--clients 50] [--dimension 10000]
//!     [--rounds 2] [--mask-workers W] [--stage-seconds 600] [--database-url postgres://...]
//!     [--out target/secure_load.json]
//! cargo bench -p cohort-coordinator --bench secure_load -- --hold-polls 10000 [--hold-seconds 30]
//!     [--connect-concurrency 200] [--out target/checkin_polls.json]
//! ```
//!
//! The model is the built-in logistic regression with `classes` (10 when `d` allows)
//! and `d / classes - 1` features, exactly `d` parameters. The database is the embedded
//! SQLite unless `--database-url` names a PostgreSQL server, in which case the run gets a
//! fresh schema, dropped at the end. The summary goes to stdout as one JSON line and to
//! the `--out` file (a relative path is from the workspace root); progress and a table
//! to stderr; the coordinator's log (warnings, and its open file limit) to
//! `target/secure_load-serve.log`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cohort_aggregation::secagg::ClientSession;
use cohort_edge::protocol::{CoordinatorClient, Credential, ProtocolError, Task};
use futures_util::StreamExt;
use rand::RngExt;
use reqwest::Method;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

// The integration tests' helpers: the admin token and a free port.
#[path = "../tests/common/mod.rs"]
mod common;

use common::{ADMIN, free_port};

mod support;

use support::{durable_write_rate, median, percentile, status_mib};

/// The longest long poll the coordinator grants.
const MAX_WAIT_SECONDS: u64 = 30;
/// Tries of one request that failed in a way worth retrying (transport, 5xx, 429).
const TRIES: u32 = 8;

/// The run's settings.
#[derive(Debug, Clone)]
struct Args {
    clients: usize,
    dimension: usize,
    rounds: u32,
    mask_workers: usize,
    stage_seconds: u64,
    database_url: Option<String>,
    hold_polls: usize,
    hold_seconds: u64,
    connect_concurrency: usize,
    out: Option<PathBuf>,
}

impl Args {
    fn parse() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut args = Args {
            clients: 50,
            dimension: 10_000,
            rounds: 2,
            // Half the cores: the other half is the coordinator's.
            mask_workers: (cores / 2).max(1),
            stage_seconds: 600,
            database_url: None,
            hold_polls: 0,
            hold_seconds: MAX_WAIT_SECONDS,
            connect_concurrency: 200,
            out: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            // `cargo bench` appends `--bench`.
            if flag == "--bench" {
                continue;
            }
            let mut value = || it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
            let number = |v: String| -> u64 {
                v.replace('_', "")
                    .parse()
                    .unwrap_or_else(|_| panic!("{flag}: `{v}` is not a whole number"))
            };
            match flag.as_str() {
                "--clients" => args.clients = number(value()) as usize,
                "--dimension" => args.dimension = number(value()) as usize,
                "--rounds" => args.rounds = number(value()) as u32,
                "--mask-workers" => args.mask_workers = (number(value()) as usize).max(1),
                "--stage-seconds" => args.stage_seconds = number(value()),
                "--database-url" => args.database_url = Some(value()),
                "--hold-polls" => args.hold_polls = number(value()) as usize,
                "--hold-seconds" => args.hold_seconds = number(value()),
                "--connect-concurrency" => {
                    args.connect_concurrency = (number(value()) as usize).max(1);
                }
                "--out" => args.out = Some(PathBuf::from(value())),
                other => panic!(
                    "unknown flag {other}; see the header of coordinator/benches/secure_load.rs"
                ),
            }
        }
        assert!(args.clients >= 3, "a secure round needs at least 3 clients");
        assert!(args.rounds >= 1, "--rounds must be at least 1");
        assert!(
            (1..=MAX_WAIT_SECONDS).contains(&args.hold_seconds),
            "--hold-seconds must be 1 to {MAX_WAIT_SECONDS}, the longest poll the coordinator holds"
        );
        args
    }
}

/// The workspace's `target` directory.
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target/tmp has a parent")
        .to_path_buf()
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// Open file descriptors of `pid`, and how many of them are sockets.
fn descriptors(pid: u32) -> (usize, usize) {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return (0, 0);
    };
    let mut all = 0;
    let mut sockets = 0;
    for entry in dir.flatten() {
        all += 1;
        if std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
        {
            sockets += 1;
        }
    }
    (all, sockets)
}

/// The soft and hard open file limits of `pid` (`None`: unlimited).
fn open_file_limits(pid: u32) -> (Option<u64>, Option<u64>) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_default();
    let mut fields = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .map(|v| v.parse::<u64>().ok());
    (fields.next().flatten(), fields.next().flatten())
}

/// Samples a process's resident memory and descriptors until stopped; the peaks.
struct Sampler {
    running: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(f64, usize)>,
}

impl Sampler {
    fn start(pid: u32) -> Self {
        let running = Arc::new(AtomicBool::new(true));
        let flag = running.clone();
        let task = tokio::spawn(async move {
            let (mut rss, mut fds) = (0.0f64, 0usize);
            let mut tick = 0u64;
            while flag.load(Ordering::Relaxed) {
                rss = rss.max(status_mib(pid, "VmRSS:"));
                // A directory of 10,000 entries is not free to list; every half second.
                if tick.is_multiple_of(5) {
                    fds = fds.max(descriptors(pid).0);
                }
                tick += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (rss, fds)
        });
        Self { running, task }
    }

    async fn stop(self) -> (f64, usize) {
        self.running.store(false, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// A `cohort serve` process of this run.
struct Coordinator {
    base: String,
    ca: Vec<u8>,
    http: reqwest::Client,
    child: Child,
    pid: u32,
    _dir: tempfile::TempDir,
    schema: Option<(sqlx::PgPool, String)>,
}

impl Coordinator {
    async fn start(database_url: Option<&str>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().join("coordinator");
        let schema = match database_url {
            Some(url) if url.starts_with("postgres") => {
                let options =
                    <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(url)
                        .expect("--database-url parses");
                let pool = sqlx::PgPool::connect_with(options)
                    .await
                    .expect("PostgreSQL answers");
                let name = format!("cohort_secure_load_{}", uuid::Uuid::new_v4().simple());
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{name}\"")))
                    .execute(&pool)
                    .await
                    .unwrap();
                Some((pool, name))
            }
            _ => None,
        };
        let url = match (&schema, database_url) {
            (Some((_, name)), Some(url)) => {
                let sep = if url.contains('?') { '&' } else { '?' };
                Some(format!("{url}{sep}options=-csearch_path%3D{name}"))
            }
            (None, url) => url.map(str::to_string),
            (Some(_), None) => unreachable!("a schema comes from a URL"),
        };
        let port = free_port();
        let base = format!("https://127.0.0.1:{port}");
        let log = std::fs::File::create(target_dir().join("secure_load-serve.log")).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
        command
            .args(["serve", "--dev-tls", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(&data_dir)
            // Every virtual client shares this machine's address, and a fleet enrols at
            // once: the per-address and per-client limits would throttle the run itself.
            .args(["--enrol-rate", "0", "--upload-rate", "0"])
            .args(["--address-upload-rate", "0"])
            .env("COHORT_ADMIN_TOKEN", ADMIN)
            // Warnings, and the open file limit the coordinator set itself.
            .env("RUST_LOG", "warn,cohort_coordinator::server::fd_limit=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(url) = &url {
            command.arg("--database-url").arg(url);
        }
        let child = command.spawn().expect("cohort serve starts");
        let pid = child.id();
        let ca_path = data_dir.join("tls/ca.pem");
        let start = Instant::now();
        let (ca, http) = loop {
            if let Ok(ca) = std::fs::read(&ca_path)
                && let Ok(cert) = reqwest::Certificate::from_pem(&ca)
            {
                let http = reqwest::Client::builder()
                    .tls_certs_only([cert])
                    .timeout(Duration::from_secs(300))
                    .build()
                    .unwrap();
                if let Ok(r) = http.get(format!("{base}/api/v1/health")).send().await
                    && r.status().is_success()
                {
                    break (ca, http);
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "cohort serve did not come up; see target/secure_load-serve.log"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        Self {
            base,
            ca,
            http,
            child,
            pid,
            _dir: dir,
            schema,
        }
    }

    async fn admin(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self
            .http
            .request(method, format!("{}/api/v1/admin{path}", self.base))
            .bearer_auth(ADMIN);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        assert!(status.is_success(), "{path}: {status} {text}");
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    /// Answered check-ins, as `/metrics` counts them.
    async fn checkins_answered(&self) -> u64 {
        let r = self
            .http
            .get(format!("{}/metrics", self.base))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        r.text()
            .await
            .unwrap()
            .lines()
            .filter(|l| {
                l.starts_with("cohort_http_requests_total")
                    && l.contains("route=\"/api/v1/clients/checkin\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// Its memory high-water mark, then stops it and drops its schema.
    async fn finish(mut self) -> f64 {
        let hwm = status_mib(self.pid, "VmHWM:");
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        if let Some((pool, name)) = &self.schema {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
            )))
            .execute(pool)
            .await
            .unwrap();
        }
        hwm
    }
}

/// One virtual client: its own protocol client (so its own connection) and credential.
struct Virtual {
    client: CoordinatorClient,
    cred: Credential,
    /// Signs the client's keys and survivor lists, as a real edge client's does.
    identity: cohort_aggregation::secagg::Identity,
}

/// Issues a token for each of `n` clients and enrols them, `concurrency` at a time,
/// each on its own connection.
async fn enrol(c: &Coordinator, n: usize, concurrency: usize) -> Vec<Arc<Virtual>> {
    let done = AtomicU64::new(0);
    let done = &done;
    futures_util::stream::iter(0..n)
        .map(|i| async move {
            let issued = c
                .admin(
                    Method::POST,
                    "/enrolment-tokens",
                    Some(json!({"label": format!("load-{i}")})),
                )
                .await;
            let token = issued["token"].as_str().expect("a token");
            let client = CoordinatorClient::new(&c.base, Some(&c.ca)).unwrap();
            // Registered at enrolment, as a real edge client's is.
            let identity = cohort_aggregation::secagg::identity::Identity::generate()
                .expect("randomness for an identity");
            let cred = client
                .enrol(token, &identity.public())
                .await
                .unwrap_or_else(|e| panic!("enrolment {i}: {e}"));
            let so_far = done.fetch_add(1, Ordering::Relaxed) + 1;
            if so_far.is_multiple_of(1000) {
                eprintln!("  enrolled {so_far}/{n}");
            }
            Arc::new(Virtual {
                client,
                cred,
                identity,
            })
        })
        .buffer_unordered(concurrency)
        .collect()
        .await
}

/// An error with its sources, which say what a transport error was.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Counts requests tried again.
static RETRIES: AtomicU64 = AtomicU64::new(0);

/// Counts rounds a client left because the coordinator went on without it (a 404 or
/// 409 answer: its unmask message came after the stage had closed, say).
static LEFT: AtomicU64 = AtomicU64::new(0);

/// Why a protocol step did not complete.
#[derive(Debug)]
enum StepError {
    /// The coordinator answered 404 or 409: the round went on without this client. A
    /// real edge client counts the task as skipped and checks in for the next round;
    /// so does a virtual one. (Treating it as fatal is what once stopped two clients
    /// whose unmask message arrived after the stage had closed: round 2 then waited
    /// for them until its deadline.)
    Left(String),
    /// Anything else: the run fails.
    Failed(String),
}

impl From<StepError> for String {
    fn from(e: StepError) -> String {
        match e {
            StepError::Left(m) | StepError::Failed(m) => m,
        }
    }
}

/// `op` until it succeeds or fails for good; a retryable failure is counted and tried
/// again after a short backoff, up to [`TRIES`] times.
async fn retried<T, F, Fut>(what: &str, mut op: F) -> Result<T, StepError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ProtocolError>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_retryable() && attempt + 1 < TRIES => {
                RETRIES.fetch_add(1, Ordering::Relaxed);
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(200 << attempt.min(5))).await;
            }
            Err(
                e @ ProtocolError::Refused {
                    status: 404 | 409, ..
                },
            ) => return Err(StepError::Left(format!("{what}: {e}"))),
            Err(e) => return Err(StepError::Failed(format!("{what}: {e}"))),
        }
    }
}

/// Long-polls `fetch` until the stage's message arrives.
async fn awaited<T, F, Fut>(what: &str, mut fetch: F) -> Result<T, StepError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, ProtocolError>>,
{
    loop {
        if let Some(found) = retried(what, &mut fetch).await? {
            return Ok(found);
        }
    }
}

/// Client-side CPU work (masking above all) on the bounded pool.
async fn on_pool<T: Send + 'static>(
    pool: &Arc<Semaphore>,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let _permit = pool.clone().acquire_owned().await.unwrap();
    tokio::task::spawn_blocking(work).await.unwrap()
}

/// One client's round: when its masked upload was sent and answered, from the run's
/// start, and when its unmask message was answered (Unix ms).
#[derive(Debug, Clone, Copy)]
struct Upload {
    round: i64,
    sent_s: f64,
    answered_s: f64,
    /// `None` when the round went on without its unmask message (its input is in the
    /// sum all the same).
    unmasked_ms: Option<i64>,
}

/// The secure round a client is selected for, at or after round `round`.
async fn next_task(v: &Virtual, experiment: uuid::Uuid, round: i64) -> Result<Task, String> {
    loop {
        let task = retried("check-in", || v.client.checkin(&v.cred, MAX_WAIT_SECONDS))
            .await
            .map_err(String::from)?;
        match task {
            Some(t) if t.experiment_id == experiment && t.round >= round => return Ok(t),
            Some(t) => {
                return Err(format!(
                    "check-in: a task for round {} of {} while waiting for round {round}",
                    t.round, t.experiment_id
                ));
            }
            None => continue,
        }
    }
}

/// One client through `rounds` secure rounds: each round it is selected for, to the end
/// or until the coordinator goes on without it.
async fn client_rounds(
    v: Arc<Virtual>,
    experiment: uuid::Uuid,
    rounds: u32,
    pool: Arc<Semaphore>,
    t0: Instant,
) -> Result<Vec<Upload>, String> {
    let mut uploads = Vec::with_capacity(rounds as usize);
    let mut round = 1;
    while round <= rounds as i64 {
        let task = next_task(&v, experiment, round).await?;
        match one_round(&v, &task, &pool, t0).await {
            Ok(upload) => uploads.push(upload),
            Err(StepError::Left(why)) => {
                LEFT.fetch_add(1, Ordering::Relaxed);
                eprintln!("  a client left round {}: {why}", task.round);
            }
            Err(StepError::Failed(e)) => return Err(e),
        }
        round = task.round + 1;
    }
    Ok(uploads)
}

/// One client's secure round, from its task to its unmask message.
async fn one_round(
    v: &Virtual,
    task: &Task,
    pool: &Arc<Semaphore>,
    t0: Instant,
) -> Result<Upload, StepError> {
    let c = &v.client;
    let cred = &v.cred;
    let failed = |e: cohort_aggregation::secagg::SecAggError| StepError::Failed(e.to_string());
    let secure = task
        .secure_aggregation
        .clone()
        .ok_or_else(|| StepError::Failed("a plain task in a secure experiment".into()))?;
    let (mut session, keys) = ClientSession::new(
        secure.config.clone(),
        secure.index,
        &v.identity,
        &mut rand::rng(),
    )
    .map_err(failed)?;
    retried("advertise", || c.advertise_keys(cred, task, &keys)).await?;
    let roster = awaited("roster", || c.roster(cred, task, MAX_WAIT_SECONDS)).await?;
    let reveal = session.reveal(&roster).map_err(failed)?;
    retried("reveal", || c.send_reveal(cred, task, &reveal)).await?;
    let directory = awaited("key directory", || {
        c.key_directory(cred, task, MAX_WAIT_SECONDS)
    })
    .await?;
    let (mut session, shares) = on_pool(pool, move || {
        let mut session = session;
        let shares = session.share_keys(&directory, &mut rand::rng());
        (session, shares)
    })
    .await;
    let shares = shares.map_err(failed)?;
    retried("send shares", || c.send_shares(cred, task, &shares)).await?;
    let forwarded = awaited("forwarded shares", || {
        c.forwarded_shares(cred, task, MAX_WAIT_SECONDS)
    })
    .await?;
    let d = secure.config.dimension;
    let (session, masked) = on_pool(pool, move || {
        let mut rng = rand::rng();
        // A synthetic update: small differences from the global model.
        let update: Vec<f32> = (0..d).map(|_| rng.random_range(-0.05..0.05)).collect();
        let masked = session.mask(&forwarded, &update, 10, 0.5, &mut rng);
        (session, masked)
    })
    .await;
    let masked = masked.map_err(failed)?;
    let upload_id = uuid::Uuid::new_v4();
    let sent_s = t0.elapsed().as_secs_f64();
    retried("masked upload", || {
        c.upload_masked(cred, task, &masked, upload_id)
    })
    .await?;
    let answered_s = t0.elapsed().as_secs_f64();
    drop(masked);
    let mut upload = Upload {
        round: task.round,
        sent_s,
        answered_s,
        unmasked_ms: None,
    };
    // From here the input is in the sum: a round that goes on without this client's
    // shares is still this client's upload.
    let unmasked = async {
        let mut request =
            awaited("survivors", || c.survivors(cred, task, MAX_WAIT_SECONDS)).await?;
        let mut session = session;
        if session.config().consistency_check {
            let confirmation = session.confirm(&request, &v.identity).map_err(failed)?;
            retried("confirm", || c.send_confirmation(cred, task, &confirmation)).await?;
            request = awaited("unmask request", || {
                c.unmask_request(cred, task, MAX_WAIT_SECONDS)
            })
            .await?;
        }
        let (_, reveal) = on_pool(pool, move || {
            let mut session = session;
            let reveal = session.unmask(&request);
            (session, reveal)
        })
        .await;
        let reveal = reveal.map_err(failed)?;
        retried("unmask", || c.send_unmask(cred, task, &reveal)).await
    };
    match unmasked.await {
        Ok(()) => upload.unmasked_ms = Some(unix_ms()),
        Err(StepError::Left(why)) => {
            LEFT.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "  a client's unmask message came late in round {}: {why}",
                task.round
            );
        }
        Err(e) => return Err(e),
    }
    Ok(upload)
}

/// The stages of a secure round, in order.
const STAGES: [&str; 8] = [
    "advertising",
    "revealing",
    "sharing",
    "collecting",
    "confirming",
    "unmasking",
    "aggregating",
    "published",
];

/// When the admin API first showed each (round, attempt, stage), Unix ms; polls until
/// round `rounds` is published or any attempt fails.
async fn watch_rounds(
    c: &Coordinator,
    experiment: &str,
    rounds: i64,
) -> (Vec<(i64, i64, String, i64)>, Vec<Value>) {
    let mut seen: Vec<(i64, i64, String, i64)> = Vec::new();
    loop {
        let listed = c
            .admin(
                Method::GET,
                &format!("/experiments/{experiment}/rounds"),
                None,
            )
            .await;
        let now = unix_ms();
        let list = listed.as_array().cloned().unwrap_or_default();
        for r in &list {
            let key = (
                r["round"].as_i64().unwrap(),
                r["attempt"].as_i64().unwrap(),
                r["stage"].as_str().unwrap_or("?").to_string(),
            );
            if !seen
                .iter()
                .any(|(a, b, s, _)| (a, b, s) == (&key.0, &key.1, &key.2))
            {
                seen.push((key.0, key.1, key.2, now));
            }
        }
        let failed = list.iter().any(|r| r["stage"] == "failed");
        let last_published = list
            .iter()
            .any(|r| r["round"] == rounds && r["stage"] == "published");
        if failed || last_published {
            return (seen, list);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Seconds each stage of round `round` (its published attempt) took, from the
/// transitions `seen`; a stage too short to be seen between two polls (100 ms) counts
/// as 0, its time going to the stage before it.
fn stage_seconds(seen: &[(i64, i64, String, i64)], round: &Value) -> Vec<(String, f64)> {
    let (r, a) = (round["round"].as_i64(), round["attempt"].as_i64());
    let at = |stage: &str| {
        seen.iter()
            .find(|(sr, sa, s, _)| Some(*sr) == r && Some(*sa) == a && s == stage)
            .map(|(_, _, _, t)| *t)
    };
    let mut times: Vec<Option<i64>> = STAGES.iter().map(|s| at(s)).collect();
    times[0] = round["started_at"].as_i64();
    let last = times.len() - 1;
    times[last] = round["finished_at"].as_i64().or(times[last]);
    // An unseen stage began when the next seen one did.
    for i in (0..times.len() - 1).rev() {
        if times[i].is_none() {
            times[i] = times[i + 1];
        }
    }
    STAGES
        .windows(2)
        .zip(times.windows(2))
        .map(|(names, t)| {
            let name = if names[0] == "aggregating" {
                "aggregate_publish".to_string()
            } else {
                names[0].to_string()
            };
            let secs = match (t[0], t[1]) {
                (Some(a), Some(b)) => (b - a) as f64 / 1e3,
                _ => f64::NAN,
            };
            (name, secs)
        })
        .collect()
}

/// The built-in logistic regression closest to `d` parameters: (features, classes).
fn logreg_shape(d: usize) -> (usize, usize) {
    // features * classes + classes = d, so classes divides d.
    let classes = [10, 8, 5, 4, 2]
        .into_iter()
        .find(|c| d.is_multiple_of(*c) && d / c >= 2)
        .unwrap_or(2);
    ((d / classes).max(2) - 1, classes)
}

async fn secure_run(args: &Args, probe: &Baseline) -> Value {
    let (features, classes) = logreg_shape(args.dimension);
    let d = features * classes + classes;
    if d != args.dimension {
        eprintln!(
            "note: d = {d} (logreg {features} x {classes}), the nearest to --dimension {}",
            args.dimension
        );
    }
    let c = Coordinator::start(args.database_url.as_deref()).await;
    let pid = c.pid;
    let (soft, hard) = open_file_limits(pid);
    eprintln!(
        "coordinator pid {pid}, open file limit {soft:?} (hard {hard:?}); enrolling {} clients",
        args.clients
    );
    let sampler = Sampler::start(pid);
    let t_enrol = Instant::now();
    let clients = enrol(&c, args.clients, args.connect_concurrency.min(64)).await;
    let enrol_s = t_enrol.elapsed().as_secs_f64();
    // Seen now, so that the round selects all of them.
    futures_util::stream::iter(&clients)
        .for_each_concurrent(64, |v| async move {
            retried("check-in", || v.client.checkin(&v.cred, 0))
                .await
                .map_err(String::from)
                .unwrap();
        })
        .await;
    let rss_idle = status_mib(pid, "VmRSS:");
    let stage = args.stage_seconds;
    let exp = c
        .admin(
            Method::POST,
            "/experiments",
            Some(json!({
                "name": "secure-load", "model": "logreg",
                "features": features, "classes": classes,
                "rounds": args.rounds,
                "clients_per_round": args.clients, "min_participants": args.clients,
                // Honest clients: every stage closes when all have answered, long before
                // these; the deadlines only bound a run that went wrong.
                "collect_deadline_seconds": stage,
                "max_round_attempts": 1,
                "secure_aggregation": {
                    "advertise_seconds": stage, "reveal_seconds": stage,
                    "share_seconds": stage, "confirm_seconds": stage,
                    "unmask_seconds": stage
                }
            })),
        )
        .await;
    let id = exp["id"].as_str().expect("an experiment id").to_string();
    let experiment: uuid::Uuid = id.parse().unwrap();
    c.admin(Method::POST, &format!("/experiments/{id}/start"), None)
        .await;
    eprintln!(
        "experiment {id}: {} rounds, d = {d}, {} clients, {} mask workers",
        args.rounds, args.clients, args.mask_workers
    );
    let pool = Arc::new(Semaphore::new(args.mask_workers));
    let t0 = Instant::now();
    let started_ms = unix_ms();
    let handles: Vec<_> = clients
        .iter()
        .map(|v| {
            tokio::spawn(client_rounds(
                v.clone(),
                experiment,
                args.rounds,
                pool.clone(),
                t0,
            ))
        })
        .collect();
    let (seen, rounds) = watch_rounds(&c, &id, args.rounds as i64).await;
    let mut errors = Vec::new();
    let mut uploads = Vec::new();
    let failed: Vec<&Value> = rounds.iter().filter(|r| r["stage"] == "failed").collect();
    if failed.is_empty() {
        for h in handles {
            match tokio::time::timeout(Duration::from_secs(120), h).await {
                Ok(Ok(Ok(u))) => uploads.extend(u),
                Ok(Ok(Err(e))) => errors.push(e),
                Ok(Err(e)) => errors.push(format!("client task: {e}")),
                Err(_) => errors.push("a client did not finish its last round".into()),
            }
        }
    } else {
        for h in &handles {
            h.abort();
        }
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let (rss_peak_sampled, fds_peak) = sampler.stop().await;
    let rss_end = status_mib(pid, "VmRSS:");
    // Its high-water mark is the memory probe's; what the clients hold is resident now.
    let bench_rss = status_mib(std::process::id(), "VmRSS:");
    // The protocol settings the coordinator chose for this cohort (k, t, quantisation).
    let params = rounds
        .first()
        .map(|r| {
            let mut p = r["secagg"].clone();
            if let Some(o) = p.as_object_mut() {
                o.remove("session");
            }
            p
        })
        .unwrap_or(Value::Null);
    let hwm = c.finish().await;
    if !failed.is_empty() {
        panic!(
            "secure_load: a round failed: {}",
            serde_json::to_string_pretty(&failed).unwrap()
        );
    }
    let published = rounds.iter().filter(|r| r["stage"] == "published").count();
    if !errors.is_empty() {
        errors.sort();
        errors.dedup();
        panic!(
            "secure_load: {} client error(s), first: {:?}",
            errors.len(),
            &errors[..errors.len().min(5)]
        );
    }
    assert_eq!(
        published, args.rounds as usize,
        "every round must be published: {rounds:?}"
    );
    assert_eq!(
        uploads.len(),
        args.clients * args.rounds as usize,
        "one masked upload per client and round"
    );

    // Per round: the collection window and the stages.
    let mut per_round = Vec::new();
    let mut at_deadline = Vec::new();
    for r in 1..=args.rounds as i64 {
        let mine: Vec<&Upload> = uploads.iter().filter(|u| u.round == r).collect();
        let first = mine.iter().map(|u| u.sent_s).fold(f64::INFINITY, f64::min);
        let last = mine.iter().map(|u| u.answered_s).fold(0.0, f64::max);
        let mut lat: Vec<f64> = mine.iter().map(|u| u.answered_s - u.sent_s).collect();
        lat.sort_by(f64::total_cmp);
        let round = rounds
            .iter()
            .find(|x| x["round"] == r && x["stage"] == "published")
            .unwrap();
        let stages = stage_seconds(&seen, round);
        // Honest clients answer every stage long before its deadline: a stage that lasted
        // as long as its deadline waited on someone who never came.
        for (name, secs) in &stages {
            if *secs >= (stage as f64) * 0.9 && name != "published" {
                at_deadline.push(format!("round {r} {name}: {secs:.1} s of {stage} s"));
            }
        }
        // From the clients' side: the last unmask message answered to the model published
        // (the unmask stage closing, the aggregation job, the publish).
        let last_unmask = mine.iter().filter_map(|u| u.unmasked_ms).max().unwrap_or(0);
        let unmasked_to_published =
            (round["finished_at"].as_i64().unwrap_or(0) - last_unmask) as f64 / 1e3;
        let total = (round["finished_at"].as_i64().unwrap_or(0)
            - round["started_at"].as_i64().unwrap_or(0)) as f64
            / 1e3;
        let stages: serde_json::Map<String, Value> =
            stages.into_iter().map(|(n, s)| (n, json!(s))).collect();
        per_round.push(json!({
            "round": r,
            "uploads": mine.len(),
            "uploads_per_s": mine.len() as f64 / (last - first),
            "window_s": last - first,
            "upload_p50_ms": percentile(&lat, 0.5) * 1e3,
            "upload_p99_ms": percentile(&lat, 0.99) * 1e3,
            "upload_max_ms": lat.last().copied().unwrap_or(f64::NAN) * 1e3,
            "stages_s": stages,
            "round_s": total,
            "last_unmask_to_published_s": unmasked_to_published,
        }));
    }
    let mut lat: Vec<f64> = uploads.iter().map(|u| u.answered_s - u.sent_s).collect();
    lat.sort_by(f64::total_cmp);
    let rates: Vec<f64> = per_round
        .iter()
        .map(|r| r["uploads_per_s"].as_f64().unwrap())
        .collect();
    let uploads_per_s = median(rates);
    let stage_median = |name: &str| {
        median(
            per_round
                .iter()
                .map(|r| r["stages_s"][name].as_f64().unwrap_or(f64::NAN))
                .collect(),
        )
    };
    let stages_median: serde_json::Map<String, Value> = STAGES[..STAGES.len() - 1]
        .iter()
        .map(|s| {
            let name = if *s == "aggregating" {
                "aggregate_publish"
            } else {
                s
            };
            (name.to_string(), json!(stage_median(name)))
        })
        .collect();
    let masked_bytes = (d + 2) * 4;
    let summary = json!({
        "bench": "secure_load",
        "clients": args.clients,
        "dimension": d,
        "model": format!("logreg {features} features x {classes} classes"),
        "secure_aggregation": params,
        "database": if args.database_url.as_deref().is_some_and(|u| u.starts_with("postgres")) { "postgres" } else { "sqlite" },
        "mask_workers": args.mask_workers,
        "rounds_published": published,
        "uploads": uploads.len(),
        "bytes_per_upload": masked_bytes,
        "uploads_per_s_median": uploads_per_s,
        "upload_p50_ms": percentile(&lat, 0.5) * 1e3,
        "upload_p99_ms": percentile(&lat, 0.99) * 1e3,
        "upload_max_ms": lat.last().copied().unwrap_or(f64::NAN) * 1e3,
        "stages_median_s": stages_median,
        "per_round": per_round,
        "retries": RETRIES.load(Ordering::Relaxed),
        "rounds_left": LEFT.load(Ordering::Relaxed),
        "stages_at_deadline": at_deadline,
        "enrol_s": enrol_s,
        "rounds_wall_s": wall_s,
        "started_at_ms": started_ms,
        "coordinator_rss_idle_mib": rss_idle,
        "coordinator_rss_peak_sampled_mib": rss_peak_sampled,
        "coordinator_rss_end_mib": rss_end,
        "coordinator_vmhwm_mib": hwm,
        "coordinator_fds_peak": fds_peak,
        "coordinator_open_file_limit": [soft, hard],
        "load_generator_rss_mib": bench_rss,
        "baseline_durable_writes_per_s": probe.durable_writes_per_s,
        "baseline_read_gbps": probe.read_gbps,
        "ratio": uploads_per_s / probe.durable_writes_per_s,
    });
    eprintln!(
        "\n{:>6} {:>8} {:>6} {:>10} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "round",
        "uploads",
        "/s",
        "p50 ms",
        "p99 ms",
        "adv s",
        "rev s",
        "share s",
        "collect s",
        "confirm s",
        "unmask s",
        "agg s",
        "round s",
        "window s"
    );
    for r in summary["per_round"].as_array().unwrap() {
        let s = &r["stages_s"];
        eprintln!(
            "{:>6} {:>8} {:>6.1} {:>10.1} {:>8.1} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2}",
            r["round"].as_i64().unwrap(),
            r["uploads"].as_u64().unwrap(),
            r["uploads_per_s"].as_f64().unwrap(),
            r["upload_p50_ms"].as_f64().unwrap(),
            r["upload_p99_ms"].as_f64().unwrap(),
            s["advertising"].as_f64().unwrap_or(f64::NAN),
            s["revealing"].as_f64().unwrap_or(f64::NAN),
            s["sharing"].as_f64().unwrap_or(f64::NAN),
            s["collecting"].as_f64().unwrap_or(f64::NAN),
            s["confirming"].as_f64().unwrap_or(f64::NAN),
            s["unmasking"].as_f64().unwrap_or(f64::NAN),
            s["aggregate_publish"].as_f64().unwrap_or(f64::NAN),
            r["round_s"].as_f64().unwrap(),
            r["window_s"].as_f64().unwrap(),
        );
    }
    eprintln!(
        "coordinator memory: idle {rss_idle:.1} MiB, peak sampled {rss_peak_sampled:.1} MiB, \
         VmHWM {hwm:.1} MiB, end {rss_end:.1} MiB; peak descriptors {fds_peak}; retries {}; \
         rounds a client left {}",
        RETRIES.load(Ordering::Relaxed),
        LEFT.load(Ordering::Relaxed)
    );
    eprintln!(
        "uploads/s (median of rounds) {uploads_per_s:.1}, {:.3} of the {:.0} durable {masked_bytes}-byte writes/s",
        uploads_per_s / probe.durable_writes_per_s,
        probe.durable_writes_per_s
    );
    summary
}

async fn hold_run(args: &Args, probe: &Baseline) -> Value {
    let m = args.hold_polls;
    let wait = args.hold_seconds;
    let own = cohort_coordinator::server::fd_limit::raise().unwrap();
    let c = Coordinator::start(args.database_url.as_deref()).await;
    let pid = c.pid;
    let (soft, hard) = open_file_limits(pid);
    // Each poll is a socket on both sides; the coordinator also holds its database,
    // listener, log and blob files.
    let needed = m as u64 + 64;
    let mut warnings = Vec::new();
    if soft.is_some_and(|s| s < needed) {
        warnings.push(format!(
            "the coordinator's open file limit is {soft:?} (hard {hard:?}), below the {needed} \
             descriptors {m} held polls need: raise the hard limit (ulimit -Hn, LimitNOFILE=)"
        ));
    }
    if own.soft.is_some_and(|s| s < needed) {
        warnings.push(format!(
            "this load generator's open file limit is {:?} (hard {:?}), below the {needed} \
             descriptors {m} clients need",
            own.soft, own.hard
        ));
    }
    for w in &warnings {
        eprintln!("WARNING: {w}");
    }
    eprintln!(
        "coordinator pid {pid}, open file limit {soft:?} (hard {hard:?}); load generator {:?}; \
         enrolling {m} clients, {} at a time",
        own.soft, args.connect_concurrency
    );
    let sampler = Sampler::start(pid);
    let t_enrol = Instant::now();
    let clients = enrol(&c, m, args.connect_concurrency).await;
    let enrol_s = t_enrol.elapsed().as_secs_f64();
    let (fds_after_enrol, sockets_after_enrol) = descriptors(pid);
    let rss_after_enrol = status_mib(pid, "VmRSS:");
    eprintln!(
        "enrolled {m} in {enrol_s:.1} s; coordinator: {fds_after_enrol} descriptors \
         ({sockets_after_enrol} sockets), {rss_after_enrol:.1} MiB"
    );
    let answered_before = c.checkins_answered().await;
    let hold_start_ms = unix_ms();
    let t0 = Instant::now();
    let polls: Vec<_> = clients
        .iter()
        .map(|v| {
            let v = v.clone();
            tokio::spawn(async move {
                let sent = t0.elapsed().as_secs_f64();
                let r = v.client.checkin(&v.cred, wait).await;
                (sent, t0.elapsed().as_secs_f64(), r.map(|t| t.is_some()))
            })
        })
        .collect();
    // Until the coordinator has seen every poll (each records its client as seen before
    // it waits), or the wait is nearly over.
    let mut all_in_s = None;
    let mut received = 0;
    let mut snapshot = None;
    let mut bench_rss = f64::NAN;
    while t0.elapsed() < Duration::from_secs(wait.saturating_sub(3).max(1)) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let listed = c.admin(Method::GET, "/clients", None).await;
        received = listed
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| {
                x["last_seen_at"]
                    .as_i64()
                    .is_some_and(|t| t >= hold_start_ms)
            })
            .count();
        if received == m && all_in_s.is_none() {
            all_in_s = Some(t0.elapsed().as_secs_f64());
            // What the coordinator holds with every poll in.
            let (fds, sockets) = descriptors(pid);
            let answered = c.checkins_answered().await - answered_before;
            snapshot = Some((fds, sockets, answered, status_mib(pid, "VmRSS:")));
            bench_rss = status_mib(std::process::id(), "VmRSS:");
            break;
        }
    }
    let (fds_held, sockets_held, answered_early, rss_held) = snapshot.unwrap_or_else(|| {
        let (fds, sockets) = descriptors(pid);
        (fds, sockets, u64::MAX, status_mib(pid, "VmRSS:"))
    });
    eprintln!(
        "held: {received}/{m} polls in after {:?} s; {fds_held} descriptors ({sockets_held} \
         sockets), {answered_early} answered so far, {rss_held:.1} MiB",
        all_in_s.map(|s| (s * 10.0).round() / 10.0)
    );
    let mut errors = Vec::new();
    let mut tasks = 0;
    let mut answered_at = Vec::with_capacity(m);
    let mut last_sent = 0.0f64;
    for p in polls {
        let (sent, at, r) = p.await.unwrap();
        last_sent = last_sent.max(sent);
        match r {
            Ok(false) => answered_at.push(at),
            Ok(true) => tasks += 1,
            Err(e) => errors.push((at, error_chain(&e))),
        }
    }
    let (rss_peak_sampled, fds_peak) = sampler.stop().await;
    answered_at.sort_by(f64::total_cmp);
    let early = answered_at
        .iter()
        .filter(|t| **t < wait as f64 - 0.5)
        .count();
    let hwm = c.finish().await;
    // Distinct errors with how many clients got each and when (seconds into the hold).
    let mut kinds: std::collections::BTreeMap<&str, (usize, f64, f64)> = Default::default();
    for (at, e) in &errors {
        let k = kinds.entry(e.as_str()).or_insert((0, f64::INFINITY, 0.0));
        k.0 += 1;
        k.1 = k.1.min(*at);
        k.2 = k.2.max(*at);
    }
    let first_errors: Vec<Value> = kinds
        .iter()
        .take(5)
        .map(|(e, (n, from, to))| json!({"error": e, "clients": n, "from_s": from, "to_s": to}))
        .collect();
    let held_at_once = if answered_early == 0 { received } else { 0 };
    let summary = json!({
        "bench": "checkin_polls",
        "clients": m,
        "hold_seconds": wait,
        "database": if args.database_url.as_deref().is_some_and(|u| u.starts_with("postgres")) { "postgres" } else { "sqlite" },
        "errors": errors.len(),
        "first_errors": first_errors,
        "tasks": tasks,
        "answered_early": early,
        "held_at_once": held_at_once,
        "received_by_coordinator": received,
        "all_polls_in_s": all_in_s,
        "answered_s_min": answered_at.first(),
        "answered_s_p50": percentile(&answered_at, 0.5),
        "answered_s_p99": percentile(&answered_at, 0.99),
        "answered_s_max": answered_at.last(),
        "enrol_and_connect_s": enrol_s,
        "enrolments_per_s": m as f64 / enrol_s,
        "coordinator_fds_after_enrol": fds_after_enrol,
        "coordinator_fds_held": fds_held,
        "coordinator_sockets_held": sockets_held,
        "coordinator_fds_peak": fds_peak,
        "coordinator_rss_after_enrol_mib": rss_after_enrol,
        "coordinator_rss_held_mib": rss_held,
        "coordinator_rss_peak_sampled_mib": rss_peak_sampled,
        "coordinator_vmhwm_mib": hwm,
        "coordinator_open_file_limit": [soft, hard],
        "load_generator_open_file_limit": [own.soft, own.hard],
        "load_generator_rss_held_mib": bench_rss,
        "warnings": warnings,
        "baseline_read_gbps": probe.read_gbps,
    });
    eprintln!(
        "{m} polls of {wait} s: {} errors, {early} answered early, {tasks} tasks; held at once \
         {held_at_once}; answered at p50 {:.2} s, max {:.2} s; coordinator peak {:.1} MiB \
         (VmHWM), {fds_peak} descriptors at peak",
        errors.len(),
        percentile(&answered_at, 0.5),
        answered_at.last().copied().unwrap_or(f64::NAN),
        hwm
    );
    if !errors.is_empty() {
        eprintln!("first errors: {first_errors:?}");
    }
    summary
}

/// What the same machine does in the same run, for the ratio.
struct Baseline {
    durable_writes_per_s: f64,
    read_gbps: f64,
}

fn baseline(bytes: usize) -> Baseline {
    let dir = target_dir().join(format!("secure-load-probe-{}", std::process::id()));
    let durable_writes_per_s = median(
        (0..3)
            .map(|_| durable_write_rate(&dir, bytes, 100))
            .collect(),
    );
    let read_gbps = cohort_coordinator::bench::reduce::read_probe(256 << 20, 5);
    eprintln!(
        "baseline: {durable_writes_per_s:.0} durable {bytes}-byte writes/s, memory read {read_gbps:.1} GB/s"
    );
    Baseline {
        durable_writes_per_s,
        read_gbps,
    }
}

fn main() {
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Each virtual client holds a socket; the soft limit starts at 1,024.
    if let Err(e) = cohort_coordinator::server::fd_limit::raise() {
        eprintln!("could not raise the open file limit: {e}");
    }
    let probe = baseline((args.dimension + 2) * 4);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (summary, default_out) = if args.hold_polls > 0 {
        (
            runtime.block_on(hold_run(&args, &probe)),
            "checkin_polls.json",
        )
    } else {
        (
            runtime.block_on(secure_run(&args, &probe)),
            "secure_load.json",
        )
    };
    // `cargo bench` runs this in the package's directory; a relative `--out` is taken
    // from the workspace root, where the command was most likely typed.
    let out = match args.out.clone() {
        Some(path) if path.is_relative() => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the coordinator crate sits in the workspace")
            .join(path),
        Some(path) => path,
        None => target_dir().join(default_out),
    };
    std::fs::write(&out, serde_json::to_string_pretty(&summary).unwrap() + "\n").unwrap();
    println!("{summary}");
    eprintln!("summary written to {}", out.display());
    if args.hold_polls > 0
        && (summary["errors"] != 0
            || summary["answered_early"] != 0
            || summary["tasks"] != 0
            || summary["held_at_once"] != args.hold_polls)
    {
        eprintln!("checkin_polls: not every poll was held to its end without error");
        std::process::exit(1);
    }
    if args.hold_polls == 0
        && summary["stages_at_deadline"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    {
        eprintln!(
            "secure_load: a stage waited on its deadline: {}",
            summary["stages_at_deadline"]
        );
        std::process::exit(1);
    }
}
