//! The `cohort-edge` command line, in the library so that `cohort demo` can start the
//! very same client as a child process of the `cohort` binary.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use cohort_aggregation::secagg::ClientFloors;

use crate::agent::{AgentConfig, run_agent};

/// Flags of `cohort-edge`.
#[derive(Debug, Clone, Args)]
pub struct EdgeArgs {
    /// Coordinator URL, e.g. https://127.0.0.1:8443
    #[arg(long, env = "COHORT_COORDINATOR")]
    pub coordinator: String,
    /// Allow a plain http:// coordinator URL. The enrolment token, this client's
    /// credential and its updates then cross the network unencrypted: only for a test or
    /// a network you trust end to end (loopback included, nothing is exempt without it)
    #[arg(long)]
    pub insecure_http: bool,
    /// CA certificate (PEM) to trust for the coordinator, e.g. its dev CA
    #[arg(long, value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
    /// Mutual TLS: this client's certificate (PEM chain), for a coordinator started with
    /// --client-ca; needs --client-key
    #[arg(long, value_name = "FILE", requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// Mutual TLS: the private key (PEM) of --client-cert
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// One-time enrolment token (needed until the credential is stored)
    #[arg(long, env = "COHORT_ENROL_TOKEN")]
    pub enrol_token: Option<String>,
    /// Local training data for the built-in models: CSV (plain or gzip) with a header
    /// row and a `label` column (not needed with --trainer)
    #[arg(long, value_name = "FILE.csv", required_unless_present = "trainer")]
    pub data: Option<PathBuf>,
    /// Your own training program, run once per task in a fresh working folder holding
    /// global.safetensors and task.json; it writes update.safetensors and result.json
    /// (see examples/numpy_trainer/README.md). Split as a shell would; words naming an
    /// existing file are made absolute
    #[arg(long, value_name = "COMMAND", conflicts_with = "data")]
    pub trainer: Option<String>,
    /// Kill the trainer (and everything it started) after this many seconds; the task
    /// is then reported failed
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 3600,
        requires = "trainer"
    )]
    pub trainer_timeout: u64,
    /// Where the credential is kept across restarts
    #[arg(long, value_name = "DIR")]
    pub state_dir: PathBuf,
    /// Exit after this many seconds without a task (default: run until stopped)
    #[arg(long, value_name = "SECONDS")]
    pub idle_exit: Option<u64>,
    /// Seed of local shuffling
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Wait this many milliseconds after training each (non-secure) task, before its
    /// upload: emulates a slow device for tests and demonstrations (default 0)
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 0,
        env = "COHORT_EDGE_SLOWDOWN_MS"
    )]
    pub slowdown_ms: u64,
    /// Local differential privacy: clip every update to --local-dp-clip and add Gaussian
    /// noise of this multiple of the clip before it leaves; no metric of the local data
    /// is sent (default: off)
    #[arg(long, value_name = "Z", requires = "local_dp_clip")]
    pub local_dp_noise_multiplier: Option<f64>,
    /// Local differential privacy: L2 bound on each update
    #[arg(long, value_name = "C", requires = "local_dp_noise_multiplier")]
    pub local_dp_clip: Option<f32>,
    /// Local differential privacy: the delta epsilon is stated at
    #[arg(long, value_name = "D", default_value_t = 1e-5)]
    pub local_dp_delta: f64,
    /// Local differential privacy: send no update that would take this client's epsilon
    /// past this (default: no limit; the ledger is kept either way)
    #[arg(long, value_name = "E", requires = "local_dp_noise_multiplier")]
    pub local_dp_epsilon: Option<f64>,
    /// Secure rounds: refuse a round that selects fewer clients than this, or asks to
    /// unmask a sum of fewer inputs (a coordinator that cheats could otherwise isolate
    /// this client's update)
    #[arg(long, value_name = "N", default_value_t = ClientFloors::default().min_parties)]
    pub min_parties: u32,
    /// Secure rounds: refuse a round whose neighbourhood is smaller than this (a smaller
    /// complete graph is accepted)
    #[arg(long, value_name = "K", default_value_t = ClientFloors::default().min_neighbours)]
    pub min_neighbours: usize,
    /// Secure rounds: refuse a round whose threshold (shares needed to rebuild a secret)
    /// is below this
    #[arg(long, value_name = "T", default_value_t = ClientFloors::default().min_threshold)]
    pub min_threshold: usize,
    /// Secure rounds: refuse a round whose distributed noise multiplier, as planned or
    /// for the clients really in the sum, is below this (default 0: rounds without noise
    /// are accepted)
    #[arg(long, value_name = "Z", default_value_t = ClientFloors::default().min_noise_multiplier)]
    pub min_noise_multiplier: f64,
    /// Secure rounds: take rounds without the consistency check. Without it a
    /// coordinator that cheats can unmask a client's update on a sparse neighbour graph
    /// (by showing each client its own survivor list); refused by default
    #[arg(long)]
    pub allow_no_consistency_check: bool,
    /// Only these experiments may run on this site's data (comma-separated ids); a task
    /// of any other is refused, reported to the coordinator and logged
    #[arg(long, value_name = "ID,...", value_delimiter = ',')]
    pub allowed_experiments: Option<Vec<uuid::Uuid>>,
    /// At most this many training rounds of any one experiment on this site's data;
    /// later tasks are refused, reported and logged
    #[arg(long, value_name = "N")]
    pub max_rounds: Option<u32>,
    /// Only the --trainer whose code has this SHA-256 may run (what --trainer-hash
    /// prints); checked before every task, so a changed script is refused, reported and
    /// logged
    #[arg(long, value_name = "SHA256")]
    pub approve_trainer: Option<String>,
    /// Print the SHA-256 of --trainer's code (the files its command names, without the
    /// interpreter) and exit, contacting nothing
    #[arg(long, requires = "trainer")]
    pub trainer_hash: bool,
    /// Only these columns of the site's data are ever read (comma-separated header
    /// names, `label` among them): --data keeps no other, and a task whose experiment
    /// reads another, or does not name its columns, is refused, reported and logged
    #[arg(long, value_name = "NAME,...", value_delimiter = ',')]
    pub columns: Option<Vec<String>>,
}

/// `--trainer-hash`: prints the hash of the trainer's code.
fn print_trainer_hash(trainer: &dyn crate::trainer::TaskTrainer) -> ExitCode {
    match trainer.code_hash() {
        Some(Ok(hash)) => {
            println!("{hash}");
            ExitCode::SUCCESS
        }
        Some(Err(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        None => {
            eprintln!("error: the built-in trainer has no code of its own to hash");
            ExitCode::from(2)
        }
    }
}

/// What the site allows, from its flags.
fn site_rules(args: &EdgeArgs) -> Result<crate::governance::SiteRules, String> {
    Ok(crate::governance::SiteRules {
        allowed_experiments: args.allowed_experiments.clone(),
        max_rounds: args.max_rounds,
        columns: shared_columns(args)?,
        approved_trainer: args
            .approve_trainer
            .as_deref()
            .map(crate::governance::parse_sha256)
            .transpose()?,
    })
}

/// `--columns` as a set; empty names are refused.
fn shared_columns(args: &EdgeArgs) -> Result<Option<std::collections::BTreeSet<String>>, String> {
    let Some(columns) = &args.columns else {
        return Ok(None);
    };
    let set: std::collections::BTreeSet<String> =
        columns.iter().map(|c| c.trim().to_string()).collect();
    if set.iter().any(String::is_empty) {
        return Err("--columns: a column name is empty".into());
    }
    Ok(Some(set))
}

/// The trainer the flags ask for: an external command (`--trainer`) or the built-in
/// models on `--data`.
fn trainer_of(args: &EdgeArgs) -> Result<crate::trainer::SharedTrainer, String> {
    match (&args.trainer, &args.data) {
        (Some(command), _) => {
            if args.trainer_timeout == 0 {
                return Err("--trainer-timeout must be at least 1 second".into());
            }
            let trainer = crate::trainer::external::ExternalTrainer::new(
                command,
                Duration::from_secs(args.trainer_timeout),
                &args.state_dir.join("work"),
            )
            .map_err(|e| e.to_string())?;
            Ok(std::sync::Arc::new(trainer))
        }
        (None, Some(path)) => {
            let shared = shared_columns(args)?;
            let data =
                crate::data::load_csv_only(path, shared.as_ref()).map_err(|e| e.to_string())?;
            Ok(std::sync::Arc::new(crate::trainer::BuiltInTrainer::new(
                data,
            )))
        }
        (None, None) => Err("give --data FILE.csv (built-in models) or --trainer COMMAND".into()),
    }
}

/// Runs the client to the end: exit status 2 for bad input, 1 for a failure, 0 when it
/// stopped after `--idle-exit`.
pub fn run(args: EdgeArgs) -> ExitCode {
    // Before anything else, so that nothing is read, started or sent for a URL that
    // would carry the credential in clear.
    if let Err(e) = crate::protocol::check_coordinator_url(&args.coordinator, args.insecure_http) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let trainer = match trainer_of(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if args.trainer_hash {
        return print_trainer_hash(trainer.as_ref());
    }
    let rules = match site_rules(&args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let ca_pem = match &args.ca_cert {
        Some(path) => match std::fs::read(path) {
            Ok(pem) => Some(pem),
            Err(e) => {
                eprintln!("error: cannot read `{}`: {e}", path.display());
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let identity_pem = match (&args.client_cert, &args.client_key) {
        (Some(cert), Some(key)) => match crate::protocol::read_identity(cert, key) {
            Ok(pem) => Some(pem),
            Err((path, e)) => {
                eprintln!("error: cannot read `{}`: {e}", path.display());
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let local_dp = match (args.local_dp_noise_multiplier, args.local_dp_clip) {
        (Some(noise_multiplier), Some(clip)) => {
            let dp = crate::local_dp::LocalDp {
                noise_multiplier,
                clip,
                delta: args.local_dp_delta,
                epsilon_budget: args.local_dp_epsilon,
            };
            if let Err(e) = dp.validate() {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
            Some(dp)
        }
        _ => None,
    };
    let floors = ClientFloors {
        min_parties: args.min_parties,
        min_neighbours: args.min_neighbours,
        min_threshold: args.min_threshold,
        min_noise_multiplier: args.min_noise_multiplier,
        require_consistency_check: !args.allow_no_consistency_check,
    };
    if let Err(e) = floors.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let config = AgentConfig {
        coordinator: args.coordinator,
        insecure_http: args.insecure_http,
        ca_pem,
        identity_pem,
        enrol_token: args.enrol_token,
        trainer,
        state_dir: args.state_dir,
        idle_exit: args.idle_exit.map(Duration::from_secs),
        seed: args.seed,
        slowdown: Duration::from_millis(args.slowdown_ms),
        local_dp,
        floors,
        rules,
    };
    match runtime.block_on(run_agent(config)) {
        Ok(report) => {
            println!(
                "uploads={} skipped={} failed={} evaluations={} refused={}",
                report.uploads, report.skipped, report.failed, report.evaluations, report.refused
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
