//! `cohort compress`: what compression did to a set of `cohort simulate` runs.

/// `cohort compress` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CompressCommand {
    /// Test accuracy against the megabytes the clients uploaded, for `cohort simulate`
    /// runs (their --out directories) with different --compress settings, as PNG and SVG;
    /// prints one line per run: its compression, final accuracy and bytes per update.
    Plot(PlotArgs),
}

/// Flags of `cohort compress plot`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlotArgs {
    /// The PNG to write; the SVG goes beside it
    #[arg(long, value_name = "FILE.png")]
    pub out: std::path::PathBuf,
    /// Title above the plot
    #[arg(long, default_value = "test accuracy against data uploaded")]
    pub title: String,
    /// Output directories of `cohort simulate` runs (each holds metrics.jsonl and
    /// summary.json)
    #[arg(required = true, value_name = "RUN_DIR")]
    pub runs: Vec<std::path::PathBuf>,
}

/// Why a `cohort compress` command failed.
#[derive(Debug, thiserror::Error)]
pub enum CompressCliError {
    /// A run directory could not be read.
    #[error("{path}: {message}")]
    Run {
        /// The file.
        path: std::path::PathBuf,
        /// What was wrong.
        message: String,
    },
    /// The plot could not be written.
    #[error("{0}")]
    Plot(String),
}

/// One line of a run's `metrics.jsonl`: what the plot needs.
#[derive(serde::Deserialize)]
struct RoundLine {
    round: u32,
    test_accuracy: f64,
    bytes_up: u64,
}

/// What the plot needs of a run's `summary.json`.
#[derive(serde::Deserialize)]
struct SummaryLine {
    bytes_up_per_update: f64,
    bytes_down_per_update: f64,
    config: RunConfig,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
struct RunConfig {
    compress_up: String,
    compress_down: String,
    #[serde(default)]
    secure_aggregation: bool,
}

fn read_lines<T: serde::de::DeserializeOwned>(
    path: &std::path::Path,
) -> Result<Vec<T>, CompressCliError> {
    let bad = |message: String| CompressCliError::Run {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| bad(format!("line {}: {e}", i + 1))))
        .collect()
}

/// Runs a `cohort compress` command; returns the lines to print.
pub fn run(command: &CompressCommand) -> Result<Vec<String>, CompressCliError> {
    let CompressCommand::Plot(args) = command;
    let mut runs = Vec::new();
    let mut lines = Vec::new();
    for dir in &args.runs {
        let rounds: Vec<RoundLine> = read_lines(&dir.join("metrics.jsonl"))?;
        let summary_path = dir.join("summary.json");
        let summary: SummaryLine = std::fs::read_to_string(&summary_path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
            .map_err(|message| CompressCliError::Run {
                path: summary_path.clone(),
                message,
            })?;
        let Some(last) = rounds.last() else {
            return Err(CompressCliError::Run {
                path: dir.join("metrics.jsonl"),
                message: "no rounds".into(),
            });
        };
        let c = &summary.config;
        let mut label = if c.compress_up == c.compress_down {
            c.compress_up.clone()
        } else {
            format!("{} up, {} down", c.compress_up, c.compress_down)
        };
        if c.secure_aggregation {
            label.push_str(", SecAgg+");
        }
        let mut total = 0;
        let points = rounds
            .iter()
            .map(|r| {
                total += r.bytes_up;
                (total, r.test_accuracy, r.round)
            })
            .collect();
        lines.push(format!(
            "{}: {label}: accuracy {:.4} after {} rounds, {:.0} bytes up and {:.0} down per update, {:.2} MB up in all",
            dir.display(),
            last.test_accuracy,
            last.round,
            summary.bytes_up_per_update,
            summary.bytes_down_per_update,
            total as f64 / 1e6,
        ));
        runs.push(crate::simulate::plot::BytesRun { label, points });
    }
    let svg = args.out.with_extension("svg");
    crate::simulate::plot::write_bytes_plot(&runs, &args.title, &args.out, &svg)
        .map_err(CompressCliError::Plot)?;
    lines.push(format!(
        "wrote {} and {}",
        args.out.display(),
        svg.display()
    ));
    Ok(lines)
}
