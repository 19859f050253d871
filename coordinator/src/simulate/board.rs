//! `--tensorboard DIR`: a run's settings and every round's metrics as TensorBoard
//! scalars, in `DIR/<strategy>/`, written as each round ends (so a TensorBoard pointed
//! at `DIR` shows the run live, one curve per strategy of a comparison).

use std::path::Path;

use super::SimulationError;
use super::config::SimulationConfig;
use super::output::output_error;
use super::record::RoundRecord;
use crate::tracking::tensorboard::EventWriter;

/// One strategy's event file.
pub(super) struct Board {
    writer: EventWriter,
}

impl Board {
    /// Starts `dir/<strategy>`'s event file with the run's settings as its text.
    pub(super) fn start(
        dir: &Path,
        strategy: &str,
        cfg: &SimulationConfig,
    ) -> Result<Self, SimulationError> {
        let run = dir.join(strategy);
        let mut writer = EventWriter::create(&run).map_err(|e| output_error(&run, e))?;
        let settings = toml::to_string(cfg).unwrap_or_else(|e| format!("(settings: {e})"));
        // Indented: Markdown shows it as the TOML it is.
        let text: String = settings.lines().map(|l| format!("    {l}\n")).collect();
        writer
            .text(0, "settings", &text)
            .and_then(|()| writer.flush())
            .map_err(|e| output_error(writer.path(), e))?;
        Ok(Self { writer })
    }

    /// Writes `r`'s metrics at its round.
    pub(super) fn round(&mut self, r: &RoundRecord) -> Result<(), SimulationError> {
        let optional = |v: Option<f64>| v.unwrap_or(f64::NAN);
        let scalars = [
            ("accuracy/test", r.test_accuracy),
            ("loss/test", r.test_loss),
            ("loss/train", optional(r.train_loss)),
            ("clients/selected", r.selected as f64),
            ("clients/participants", r.participants as f64),
            ("clients/dropped", r.dropped as f64),
            ("privacy/epsilon", optional(r.epsilon)),
            (
                "privacy/epsilon_coordinator",
                optional(r.epsilon_coordinator),
            ),
            ("bytes/up", r.bytes_up as f64),
            ("bytes/down", r.bytes_down as f64),
            ("accuracy/clients_mean", optional(r.client_accuracy_mean)),
            ("accuracy/clients_p10", optional(r.client_accuracy_p10)),
            ("accuracy/personal_mean", optional(r.personal_accuracy_mean)),
            ("accuracy/personal_p10", optional(r.personal_accuracy_p10)),
            ("time/sim_seconds", r.sim_seconds),
        ];
        self.writer
            .scalars(i64::from(r.round), &scalars)
            .and_then(|()| self.writer.flush())
            .map_err(|e| output_error(self.writer.path(), e))
    }
}
