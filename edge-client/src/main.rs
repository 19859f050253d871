//! `cohort-edge`: the edge client. Enrols once, then trains on local data and uploads
//! model updates to the coordinator, round after round.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use cohort_edge::agent::{AgentConfig, run_agent};

#[derive(Parser)]
#[command(
    name = "cohort-edge",
    version,
    about = "Cohort edge client: local training, model updates only"
)]
struct Args {
    /// Coordinator URL, e.g. https://127.0.0.1:8443
    #[arg(long, env = "COHORT_COORDINATOR")]
    coordinator: String,
    /// CA certificate (PEM) to trust for the coordinator, e.g. its dev CA
    #[arg(long, value_name = "FILE")]
    ca_cert: Option<PathBuf>,
    /// One-time enrolment token (needed until the credential is stored)
    #[arg(long, env = "COHORT_ENROL_TOKEN")]
    enrol_token: Option<String>,
    /// Local training data: CSV (plain or gzip) with a header row and a `label` column
    #[arg(long, value_name = "FILE.csv")]
    data: PathBuf,
    /// Where the credential is kept across restarts
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Exit after this many seconds without a task (default: run until stopped)
    #[arg(long, value_name = "SECONDS")]
    idle_exit: Option<u64>,
    /// Seed of local shuffling
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let rendered = e.render().to_string();
            eprintln!(
                "{}",
                rendered
                    .lines()
                    .next()
                    .unwrap_or("error: invalid arguments")
            );
            return ExitCode::from(2);
        }
    };
    let data = match cohort_edge::data::load_csv(&args.data) {
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
