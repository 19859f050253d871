//! Local differential privacy: the client clips its update to an L2 bound and adds
//! Gaussian noise to it before anything leaves the machine, so that what it sends (to a
//! coordinator it need not trust, and to anyone who sees the upload) reveals about its
//! data only what the Gaussian mechanism allows. It adds to whatever the coordinator does
//! (central or distributed noise), and needs no one else's cooperation.
//!
//! The client keeps its own ledger in its state directory: the noise multiplier of every
//! update it sent, composed by the RDP accountant with no amplification (a client cannot
//! know that the coordinator keeps its selection secret, so it counts every upload at
//! sampling rate 1). With a budget, the client refuses to send an update that would take
//! it past the budget; it stays enrolled and simply stops contributing.
//!
//! Updates are all that leaves: the agent sends no metric of the local data (no
//! evaluation, no training loss, no example count), so nothing else needs a place in
//! the ledger.

use std::path::{Path, PathBuf};

use cohort_aggregation::privacy::clip::clip_l2;
use cohort_aggregation::privacy::noise::{NoiseError, add_gaussian};
use cohort_aggregation::privacy::rdp::{PrivacyError, RdpAccountant};
use serde::{Deserialize, Serialize};

/// The client's local DP settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalDp {
    /// The noise's standard deviation over the clip.
    pub noise_multiplier: f64,
    /// L2 bound on the update (its difference from the global model).
    pub clip: f32,
    /// The delta epsilon is stated at.
    pub delta: f64,
    /// No update is sent that would take epsilon past this; `None`: no limit, only the
    /// ledger.
    pub epsilon_budget: Option<f64>,
}

/// Why local DP cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum LocalDpError {
    /// A setting is out of range.
    #[error("local differential privacy: {0}")]
    Settings(String),
    /// The next update would pass the budget.
    #[error(
        "local differential privacy: another update would bring epsilon to {next:.4}, past the budget {budget}; this client sends no more updates"
    )]
    BudgetSpent {
        /// Epsilon with the next update.
        next: f64,
        /// The budget.
        budget: f64,
    },
    /// The ledger file could not be read or written.
    #[error("local differential privacy ledger `{path}`: {message}")]
    Ledger {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The accountant refused.
    #[error("local differential privacy: {0}")]
    Accountant(#[from] PrivacyError),
    /// The noise cannot be drawn for this update (too much noise over too many
    /// coordinates for the lattice it is drawn on).
    #[error("local differential privacy: {0}")]
    Noise(#[from] NoiseError),
}

impl LocalDp {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), LocalDpError> {
        let bad = |m: String| Err(LocalDpError::Settings(m));
        if !(self.noise_multiplier.is_finite()
            && self.noise_multiplier > 0.0
            && self.noise_multiplier <= 1e4)
        {
            return bad(format!(
                "the noise multiplier must be in (0, 10000], got {}",
                self.noise_multiplier
            ));
        }
        if !(self.clip.is_finite() && self.clip > 0.0) {
            return bad(format!("the clip must be > 0, got {}", self.clip));
        }
        if !(self.delta > 0.0 && self.delta < 1.0) {
            return bad(format!("delta must be in (0, 1), got {}", self.delta));
        }
        if let Some(budget) = self.epsilon_budget
            && !(budget.is_finite() && budget > 0.0)
        {
            return bad(format!("the epsilon budget must be > 0, got {budget}"));
        }
        Ok(())
    }

    /// Clips `delta` (an update's difference from the global model) to the bound and adds
    /// Gaussian noise of `z` times the clip to every coordinate, drawn exactly on a lattice
    /// ([`add_gaussian`]), from `rng` (the operating system's CSPRNG in the agent).
    pub fn privatize(
        &self,
        delta: &mut [f32],
        rng: &mut (impl rand::Rng + ?Sized),
    ) -> Result<(), LocalDpError> {
        clip_l2(delta, self.clip);
        add_gaussian(delta, self.noise_multiplier, self.clip, rng)?;
        Ok(())
    }
}

/// The file the ledger lives in, in the agent's state directory.
pub const LEDGER_FILE: &str = "local_dp.json";

/// Every update this client sent under local DP: the noise multiplier of each.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ledger {
    /// Noise multipliers, one per update sent.
    pub noise_multipliers: Vec<f64>,
}

impl Ledger {
    /// Reads the ledger in `state_dir`; a missing file is an empty ledger.
    pub fn load(state_dir: &Path) -> Result<Self, LocalDpError> {
        let path = state_dir.join(LEDGER_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| LocalDpError::Ledger {
                path,
                message: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(LocalDpError::Ledger {
                path,
                message: e.to_string(),
            }),
        }
    }

    /// Writes the ledger to `state_dir` atomically (a temporary file renamed over it), so
    /// a crash leaves the old ledger or the new one, never a torn one.
    pub fn store(&self, state_dir: &Path) -> Result<(), LocalDpError> {
        let path = state_dir.join(LEDGER_FILE);
        let tmp = state_dir.join(format!("{LEDGER_FILE}.tmp"));
        let fail = |e: std::io::Error| LocalDpError::Ledger {
            path: path.clone(),
            message: e.to_string(),
        };
        let bytes = serde_json::to_vec_pretty(self).expect("the ledger serialises");
        std::fs::write(&tmp, bytes).map_err(fail)?;
        std::fs::rename(&tmp, &path).map_err(fail)
    }

    /// Epsilon at `delta` after every recorded update plus `extra` more at multiplier
    /// `z`.
    pub fn epsilon_with(&self, extra: Option<f64>, delta: f64) -> Result<f64, LocalDpError> {
        let mut accountant = RdpAccountant::new();
        for &z in self.noise_multipliers.iter().chain(extra.iter()) {
            accountant.compose(1.0, z, 1)?;
        }
        Ok(accountant.epsilon(delta)?)
    }

    /// Checks that one more update at `settings` stays within the budget, and records it.
    /// The caller stores the ledger before the update leaves: a crash after the upload
    /// cannot then forget that it was spent.
    pub fn charge(&mut self, settings: &LocalDp) -> Result<f64, LocalDpError> {
        let next = self.epsilon_with(Some(settings.noise_multiplier), settings.delta)?;
        if let Some(budget) = settings.epsilon_budget
            && next > budget
        {
            return Err(LocalDpError::BudgetSpent { next, budget });
        }
        self.noise_multipliers.push(settings.noise_multiplier);
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn settings() -> LocalDp {
        LocalDp {
            noise_multiplier: 2.0,
            clip: 1.0,
            delta: 1e-5,
            epsilon_budget: None,
        }
    }

    /// What leaves the machine is the clipped update plus noise of the configured scale.
    #[test]
    fn privatize_clips_then_adds_noise_of_the_configured_scale() {
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(7);
        let d = 40_000;
        let mut delta = vec![0.0f32; d];
        delta[0] = 1000.0; // norm 1000: clipped to 1 before the noise
        settings().privatize(&mut delta, &mut rng).unwrap();
        let rest = &delta[1..];
        let n = rest.len() as f64;
        let mean = rest.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let std = (rest
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / (n - 1.0))
            .sqrt();
        assert!(
            (std / 2.0 - 1.0).abs() < 5.0 / (2.0 * n).sqrt(),
            "std {std}"
        );
        assert!(mean.abs() < 5.0 * 2.0 / n.sqrt(), "mean {mean}");
        // The big coordinate was clipped to 1 (plus noise of std 2), not left near 1000.
        assert!(delta[0].abs() < 1.0 + 5.0 * 2.0, "{}", delta[0]);
    }

    /// The ledger composes like the accountant at q = 1, survives a restart, and the
    /// update that would pass the budget is refused without being recorded.
    #[test]
    fn the_ledger_composes_persists_and_enforces_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let direct = |t: u64| cohort_aggregation::privacy::rdp::epsilon(1.0, 2.0, t, 1e-5).unwrap();
        let budget = (direct(3) + direct(4)) / 2.0;
        let limited = LocalDp {
            epsilon_budget: Some(budget),
            ..settings()
        };
        let mut ledger = Ledger::load(dir.path()).unwrap();
        for t in 1..=3 {
            let spent = ledger.charge(&limited).unwrap();
            assert!((spent - direct(t)).abs() < 1e-9 * direct(t));
            ledger.store(dir.path()).unwrap();
        }
        let mut reloaded = Ledger::load(dir.path()).unwrap();
        assert_eq!(reloaded, ledger);
        match reloaded.charge(&limited) {
            Err(LocalDpError::BudgetSpent { next, .. }) => {
                assert!((next - direct(4)).abs() < 1e-9 * direct(4))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            reloaded.noise_multipliers.len(),
            3,
            "a refused update is not recorded"
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        for bad in [
            LocalDp {
                noise_multiplier: 0.0,
                ..settings()
            },
            LocalDp {
                clip: -1.0,
                ..settings()
            },
            LocalDp {
                delta: 1.0,
                ..settings()
            },
            LocalDp {
                epsilon_budget: Some(f64::NAN),
                ..settings()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(settings().validate().is_ok());
    }

    #[test]
    fn a_corrupt_ledger_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LEDGER_FILE), b"{not json").unwrap();
        assert!(matches!(
            Ledger::load(dir.path()),
            Err(LocalDpError::Ledger { .. })
        ));
    }
}
