//! `cohort privacy`: the differential privacy accountant on the command line.

use cohort_aggregation::privacy::rdp;

use cohort_core::privacy::BudgetAgainst;

/// `cohort privacy` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum PrivacyCommand {
    /// Epsilon spent by T rounds of the Poisson-subsampled Gaussian mechanism (RDP
    /// accountant), against observers of the published models and against the
    /// coordinator (which knows who was sampled: no amplification); the last line is the
    /// bare number, against observers unless --against coordinator.
    Epsilon(EpsilonArgs),
    /// The smallest noise multiplier that keeps T rounds within (epsilon, delta), against
    /// observers or (--against coordinator) against the coordinator; the last line is the
    /// bare number.
    Noise(NoiseArgs),
    /// Test accuracy against epsilon spent, for `cohort simulate` runs (their --out
    /// directories) under different budgets, as PNG and SVG; a run without differential
    /// privacy is drawn as the reference line.
    Plot(PlotArgs),
}

/// Flags of `cohort privacy plot`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlotArgs {
    /// The PNG to write; the SVG goes beside it
    #[arg(long, value_name = "FILE.png")]
    pub out: std::path::PathBuf,
    /// Title above the plot
    #[arg(long, default_value = "test accuracy against privacy spent")]
    pub title: String,
    /// Output directories of `cohort simulate` runs (each holds metrics.jsonl)
    #[arg(required = true, value_name = "RUN_DIR")]
    pub runs: Vec<std::path::PathBuf>,
}

/// Why a `cohort privacy` command failed.
#[derive(Debug, thiserror::Error)]
pub enum PrivacyCliError {
    /// The accountant refused the settings.
    #[error(transparent)]
    Accountant(#[from] rdp::PrivacyError),
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
    /// A client cannot take part in more rounds than there are.
    #[error("--participations {participations} is more than --rounds {rounds}")]
    Participations {
        /// The rounds the client was said to take part in.
        participations: u64,
        /// The rounds.
        rounds: u64,
    },
}

/// Flags of `cohort privacy epsilon`.
#[derive(Debug, Clone, clap::Args)]
pub struct EpsilonArgs {
    /// Probability that a client takes part in a round (Poisson sampling), in [0, 1]
    #[arg(long, value_name = "Q")]
    pub sampling_rate: f64,
    /// Noise standard deviation over the clipping norm
    #[arg(long, value_name = "SIGMA")]
    pub noise_multiplier: f64,
    /// Rounds
    #[arg(long, value_name = "T")]
    pub rounds: u64,
    /// Delta, in (0, 1)
    #[arg(long, value_name = "D")]
    pub delta: f64,
    /// Whom the figure on the last line is against.
    #[command(flatten)]
    pub against: AgainstArgs,
}

/// Whom a `cohort privacy` figure is against.
#[derive(Debug, Clone, clap::Args)]
pub struct AgainstArgs {
    /// observers (of the published models: amplified by sampling) | coordinator (draws
    /// the sample and knows who took part: each of a client's rounds at q = 1)
    #[arg(long, value_name = "WHOM", default_value = "observers")]
    pub against: cohort_core::privacy::BudgetAgainst,
    /// Against the coordinator: the rounds the client took part in [default: T, the
    /// worst case; a client is in q*T of them on average]
    #[arg(long, value_name = "K")]
    pub participations: Option<u64>,
}

impl AgainstArgs {
    /// The rounds a client takes part in, of `rounds`, for the coordinator's figure.
    fn participations(&self, rounds: u64) -> Result<u64, PrivacyCliError> {
        match self.participations {
            Some(k) if k > rounds => Err(PrivacyCliError::Participations {
                participations: k,
                rounds,
            }),
            k => Ok(k.unwrap_or(rounds)),
        }
    }
}

/// Flags of `cohort privacy noise`.
#[derive(Debug, Clone, clap::Args)]
pub struct NoiseArgs {
    /// Probability that a client takes part in a round (Poisson sampling), in [0, 1]
    #[arg(long, value_name = "Q")]
    pub sampling_rate: f64,
    /// Rounds
    #[arg(long, value_name = "T")]
    pub rounds: u64,
    /// The epsilon budget, > 0
    #[arg(long, value_name = "E")]
    pub epsilon: f64,
    /// Delta, in (0, 1)
    #[arg(long, value_name = "D")]
    pub delta: f64,
    /// Whom the figure on the last line is against.
    #[command(flatten)]
    pub against: AgainstArgs,
}

/// Runs a `cohort privacy` command: its lines, or why it was refused.
pub fn run(command: &PrivacyCommand) -> Result<Vec<String>, PrivacyCliError> {
    match command {
        PrivacyCommand::Epsilon(a) => {
            let mut accountant = rdp::RdpAccountant::new();
            accountant.compose(a.sampling_rate, a.noise_multiplier, a.rounds)?;
            let (eps, order) = accountant.epsilon_and_order(a.delta)?;
            let k = a.against.participations(a.rounds)?;
            // Without sampling, the coordinator's figure is the accountant's at q = 1
            // over the client's own rounds.
            let coordinator = rdp::epsilon(1.0, a.noise_multiplier, k, a.delta)?;
            Ok(vec![
                format!(
                    "# RDP accountant, Poisson-subsampled Gaussian: q={} sigma={} T={} delta={} (best order {order})",
                    a.sampling_rate, a.noise_multiplier, a.rounds, a.delta
                ),
                format!("# against observers of the published models: {eps}"),
                format!(
                    "# against the coordinator, which knows who took part (no amplification), for a client in {k} of the rounds: {coordinator}"
                ),
                format!(
                    "{}",
                    match a.against.against {
                        BudgetAgainst::Observers => eps,
                        BudgetAgainst::Coordinator => coordinator,
                    }
                ),
            ])
        }
        PrivacyCommand::Noise(a) => match a.against.against {
            BudgetAgainst::Observers => {
                let sigma = rdp::noise_multiplier(a.sampling_rate, a.rounds, a.epsilon, a.delta)?;
                let spent = rdp::epsilon(a.sampling_rate, sigma, a.rounds, a.delta)?;
                let k = a.against.participations(a.rounds)?;
                let coordinator = rdp::epsilon(1.0, sigma, k, a.delta)?;
                Ok(vec![
                    format!(
                        "# smallest noise multiplier for epsilon <= {} at delta={} over T={} rounds at q={} (spends {spent})",
                        a.epsilon, a.delta, a.rounds, a.sampling_rate
                    ),
                    format!(
                        "# against the coordinator it spends {coordinator} for a client in {k} of the rounds"
                    ),
                    format!("{sigma}"),
                ])
            }
            BudgetAgainst::Coordinator => {
                let k = a.against.participations(a.rounds)?;
                let sigma = rdp::noise_multiplier(1.0, k, a.epsilon, a.delta)?;
                let spent = rdp::epsilon(1.0, sigma, k, a.delta)?;
                Ok(vec![
                    format!(
                        "# smallest noise multiplier for epsilon <= {} at delta={} against the coordinator, for a client in {k} rounds (no amplification; spends {spent})",
                        a.epsilon, a.delta
                    ),
                    format!("{sigma}"),
                ])
            }
        },
        PrivacyCommand::Plot(a) => plot(a),
    }
}

/// One line of a run's `metrics.jsonl`: what the plot needs.
#[derive(serde::Deserialize)]
struct RoundLine {
    round: u32,
    test_accuracy: f64,
    epsilon: Option<f64>,
}

fn plot(args: &PlotArgs) -> Result<Vec<String>, PrivacyCliError> {
    let mut runs = Vec::new();
    for dir in &args.runs {
        let path = dir.join("metrics.jsonl");
        let bad = |message: String| PrivacyCliError::Run {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let rounds: Vec<RoundLine> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, l)| serde_json::from_str(l).map_err(|e| bad(format!("line {}: {e}", i + 1))))
            .collect::<Result<_, _>>()?;
        let Some(last) = rounds.last() else {
            return Err(bad("no rounds".into()));
        };
        let label = match last.epsilon {
            Some(e) => format!("epsilon {e:.2}"),
            None => "no DP".to_string(),
        };
        runs.push(crate::simulate::plot::PrivacyRun {
            label,
            points: rounds
                .iter()
                .map(|r| (r.epsilon, r.test_accuracy, r.round))
                .collect(),
        });
    }
    let svg = args.out.with_extension("svg");
    crate::simulate::plot::write_privacy_plot(&runs, &args.title, &args.out, &svg)
        .map_err(PrivacyCliError::Plot)?;
    let mut lines: Vec<String> = runs
        .iter()
        .zip(&args.runs)
        .map(|(r, dir)| {
            let (eps, acc, round) = r.points.last().copied().unwrap_or((None, 0.0, 0));
            format!(
                "{}\tepsilon={}\trounds={round}\ttest_accuracy={acc:.4}",
                dir.display(),
                eps.map_or("none".to_string(), |e| format!("{e:.4}"))
            )
        })
        .collect();
    lines.push(format!(
        "wrote {} and {}",
        args.out.display(),
        svg.display()
    ));
    Ok(lines)
}
