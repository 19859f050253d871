//! `cohort-edge`: the edge client. Enrols once, then trains on local data and uploads
//! model updates to the coordinator, round after round.

use std::process::ExitCode;

use clap::Parser;
use cohort_edge::cli::EdgeArgs;

#[derive(Parser)]
#[command(
    name = "cohort-edge",
    version,
    about = "Cohort edge client: local training, model updates only"
)]
struct Cli {
    #[command(flatten)]
    args: EdgeArgs,
}

fn main() -> ExitCode {
    match Cli::try_parse() {
        Ok(cli) => cohort_edge::cli::run(cli.args),
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            ExitCode::SUCCESS
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
            ExitCode::from(2)
        }
    }
}
