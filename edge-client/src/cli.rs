//! The `cohort-edge` command line, in the library so that `cohort demo` can start the
//! very same client as a child process of the `cohort` binary.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use crate::agent::{AgentConfig, run_agent};

/// Flags of `cohort-edge`.
#[derive(Debug, Clone, Args)]
pub struct EdgeArgs {
    /// Coordinator URL, e.g. https://127.0.0.1:8443
    #[arg(long, env = "COHORT_COORDINATOR")]
    pub coordinator: String,
    /// CA certificate (PEM) to trust for the coordinator, e.g. its dev CA
    #[arg(long, value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
    /// One-time enrolment token (needed until the credential is stored)
    #[arg(long, env = "COHORT_ENROL_TOKEN")]
    pub enrol_token: Option<String>,
    /// Local training data: CSV (plain or gzip) with a header row and a `label` column
    #[arg(long, value_name = "FILE.csv")]
    pub data: PathBuf,
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
}

/// Runs the client to the end: exit status 2 for bad input, 1 for a failure, 0 when it
/// stopped after `--idle-exit`.
pub fn run(args: EdgeArgs) -> ExitCode {
    let data = match crate::data::load_csv(&args.data) {
        Ok(d) => d,
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
        ca_pem,
        enrol_token: args.enrol_token,
        data,
        state_dir: args.state_dir,
        idle_exit: args.idle_exit.map(Duration::from_secs),
        seed: args.seed,
        slowdown: Duration::from_millis(args.slowdown_ms),
    };
    match runtime.block_on(run_agent(config)) {
        Ok(report) => {
            println!("uploads={} skipped={}", report.uploads, report.skipped);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
