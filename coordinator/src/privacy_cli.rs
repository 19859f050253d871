//! `cohort privacy`: the differential privacy accountant on the command line.

use cohort_aggregation::privacy::rdp;

/// `cohort privacy` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum PrivacyCommand {
    /// Epsilon spent by T rounds of the Poisson-subsampled Gaussian mechanism (RDP
    /// accountant); the last line is the bare number.
    Epsilon(EpsilonArgs),
    /// The smallest noise multiplier that keeps T rounds within (epsilon, delta); the last
    /// line is the bare number.
    Noise(NoiseArgs),
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
}

/// Runs a `cohort privacy` command: its lines, or why it was refused.
pub fn run(command: &PrivacyCommand) -> Result<Vec<String>, rdp::PrivacyError> {
    match command {
        PrivacyCommand::Epsilon(a) => {
            let mut accountant = rdp::RdpAccountant::new();
            accountant.compose(a.sampling_rate, a.noise_multiplier, a.rounds)?;
            let (eps, order) = accountant.epsilon_and_order(a.delta)?;
            Ok(vec![
                format!(
                    "# RDP accountant, Poisson-subsampled Gaussian: q={} sigma={} T={} delta={} (best order {order})",
                    a.sampling_rate, a.noise_multiplier, a.rounds, a.delta
                ),
                format!("{eps}"),
            ])
        }
        PrivacyCommand::Noise(a) => {
            let sigma = rdp::noise_multiplier(a.sampling_rate, a.rounds, a.epsilon, a.delta)?;
            let spent = rdp::epsilon(a.sampling_rate, sigma, a.rounds, a.delta)?;
            Ok(vec![
                format!(
                    "# smallest noise multiplier for epsilon <= {} at delta={} over T={} rounds at q={} (spends {spent})",
                    a.epsilon, a.delta, a.rounds, a.sampling_rate
                ),
                format!("{sigma}"),
            ])
        }
    }
}
