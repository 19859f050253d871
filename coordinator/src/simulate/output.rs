//! Where a run's files go: a staging directory that becomes the output directory only when
//! the run has finished, and the streaming `metrics.csv` writer.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::SimulationError;
use super::config::ConfigError;
use super::record::RoundRecord;

pub(super) fn output_error(path: &Path, e: impl std::fmt::Display) -> SimulationError {
    SimulationError::Output {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// A hidden sibling directory that collects a run's files. [`StagedDir::commit`] moves
/// them into the target; dropping it without committing deletes it, so an interrupted or
/// failed run leaves nothing that looks finished.
#[derive(Debug)]
pub struct StagedDir {
    target: PathBuf,
    staging: PathBuf,
    committed: bool,
}

impl StagedDir {
    /// Stages output for `target`, which must not be an existing file.
    pub fn create(target: &Path) -> Result<Self, SimulationError> {
        if target.exists() && !target.is_dir() {
            return Err(ConfigError(format!(
                "--out `{}` exists and is not a directory",
                target.display()
            ))
            .into());
        }
        let name = target
            .file_name()
            .ok_or_else(|| {
                ConfigError(format!(
                    "--out `{}` has no directory name",
                    target.display()
                ))
            })?
            .to_string_lossy()
            .into_owned();
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(|e| output_error(&parent, e))?;
        let staging = parent.join(format!(".{name}.partial-{}", std::process::id()));
        if staging.exists() {
            fs::remove_dir_all(&staging).map_err(|e| output_error(&staging, e))?;
        }
        fs::create_dir(&staging).map_err(|e| output_error(&staging, e))?;
        Ok(Self {
            target: target.to_path_buf(),
            staging,
            committed: false,
        })
    }

    /// The staging directory to write into.
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// Moves the staged files into the target directory (replacing files of the same
    /// name from an earlier run) and returns the target.
    pub fn commit(mut self) -> Result<PathBuf, SimulationError> {
        if !self.target.exists() {
            fs::rename(&self.staging, &self.target).map_err(|e| output_error(&self.target, e))?;
        } else {
            for entry in fs::read_dir(&self.staging).map_err(|e| output_error(&self.staging, e))? {
                let entry = entry.map_err(|e| output_error(&self.staging, e))?;
                let dest = self.target.join(entry.file_name());
                fs::rename(entry.path(), &dest).map_err(|e| output_error(&dest, e))?;
            }
            fs::remove_dir(&self.staging).map_err(|e| output_error(&self.staging, e))?;
        }
        self.committed = true;
        Ok(self.target.clone())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the directory is hidden and named after the process anyway.
            let _ = fs::remove_dir_all(&self.staging);
        }
    }
}

/// An optional figure as a CSV cell: empty when absent.
fn optional(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// Writes `metrics.csv` and `metrics.jsonl` one round at a time, flushed after each row
/// so a long run can be watched while it goes.
pub struct MetricsWriter {
    csv_path: PathBuf,
    csv: BufWriter<File>,
    jsonl_path: PathBuf,
    jsonl: BufWriter<File>,
}

/// Column names of `metrics.csv`, in order (also the keys of each `metrics.jsonl` line).
/// New columns go before `epsilon_coordinator`: `epsilon_coordinator`, `sim_seconds`,
/// `epsilon` and `strategy` stay the last four, as tools that read them from the end
/// expect.
pub const METRICS_COLUMNS: [&str; 20] = [
    "round",
    "test_accuracy",
    "test_loss",
    "participants",
    "dropped",
    "seconds",
    "selected",
    "train_loss",
    "samples",
    "status",
    "bytes_up",
    "bytes_down",
    "client_accuracy_mean",
    "client_accuracy_p10",
    "personal_accuracy_mean",
    "personal_accuracy_p10",
    "epsilon_coordinator",
    "sim_seconds",
    "epsilon",
    "strategy",
];

#[derive(Serialize)]
struct JsonRow<'a> {
    #[serde(flatten)]
    record: &'a RoundRecord,
    strategy: &'a str,
}

fn append(out: &mut BufWriter<File>, path: &Path, text: &str) -> Result<(), SimulationError> {
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(|e| output_error(path, e))
}

fn close(out: &mut BufWriter<File>, path: &Path) -> Result<(), SimulationError> {
    out.flush().map_err(|e| output_error(path, e))?;
    out.get_ref().sync_all().map_err(|e| output_error(path, e))
}

impl MetricsWriter {
    /// Creates both files in `dir` and writes the CSV header.
    pub fn create(dir: &Path) -> Result<Self, SimulationError> {
        let open = |name: &str| {
            let path = dir.join(name);
            File::create(&path)
                .map(|f| (path.clone(), BufWriter::new(f)))
                .map_err(|e| output_error(&path, e))
        };
        let (csv_path, csv) = open("metrics.csv")?;
        let (jsonl_path, jsonl) = open("metrics.jsonl")?;
        let mut w = Self {
            csv_path,
            csv,
            jsonl_path,
            jsonl,
        };
        append(&mut w.csv, &w.csv_path, &METRICS_COLUMNS.join(","))?;
        Ok(w)
    }

    /// Appends one round of `strategy` to both files.
    pub fn write(&mut self, r: &RoundRecord, strategy: &str) -> Result<(), SimulationError> {
        let line = format!(
            "{},{},{},{},{},{:.6},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.round,
            r.test_accuracy,
            r.test_loss,
            r.participants,
            r.dropped,
            r.seconds,
            r.selected,
            r.train_loss.map(|l| l.to_string()).unwrap_or_default(),
            r.samples,
            r.status.as_str(),
            r.bytes_up,
            r.bytes_down,
            optional(r.client_accuracy_mean),
            optional(r.client_accuracy_p10),
            optional(r.personal_accuracy_mean),
            optional(r.personal_accuracy_p10),
            // `inf` under central noise: the coordinator sees every update.
            r.epsilon_coordinator
                .map(|e| e.to_string())
                .unwrap_or_default(),
            r.sim_seconds,
            r.epsilon.map(|e| e.to_string()).unwrap_or_default(),
            strategy
        );
        append(&mut self.csv, &self.csv_path, &line)?;
        let json = serde_json::to_string(&JsonRow {
            record: r,
            strategy,
        })
        .expect("round records serialise");
        append(&mut self.jsonl, &self.jsonl_path, &json)
    }

    /// Flushes both files to disk.
    pub fn finish(mut self) -> Result<(), SimulationError> {
        close(&mut self.csv, &self.csv_path)?;
        close(&mut self.jsonl, &self.jsonl_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncommitted_staging_is_removed_and_target_never_appears() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("run");
        let staged = StagedDir::create(&target).unwrap();
        fs::write(staged.path().join("metrics.csv"), "round\n").unwrap();
        let staging = staged.path().to_path_buf();
        drop(staged);
        assert!(!staging.exists());
        assert!(!target.exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn commit_moves_files_into_new_or_existing_target() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("run");
        for content in ["first", "second"] {
            let staged = StagedDir::create(&target).unwrap();
            fs::write(staged.path().join("summary.json"), content).unwrap();
            assert_eq!(staged.commit().unwrap(), target);
            assert_eq!(
                fs::read_to_string(target.join("summary.json")).unwrap(),
                content
            );
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn target_that_is_a_file_is_a_config_error() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("file");
        fs::write(&target, "x").unwrap();
        assert!(matches!(
            StagedDir::create(&target),
            Err(SimulationError::Config(_))
        ));
    }
}
