//! A site's say over what runs on its data, and its own record of what ran.
//!
//! A hospital's IT approves what a federated client may do before it runs: which
//! experiments (`--allowed-experiments`), for how many rounds each (`--max-rounds`). A
//! task outside them is refused before any data is read or any privacy budget charged;
//! the refusal is reported to the coordinator as the task's failure, with the reason,
//! and written to the site's log.
//!
//! The site log (`site-log.jsonl` in the state directory) is the site's own audit
//! trail: one JSON line for every task the client was handed — when, which experiment,
//! round and attempt, what became of it, the bytes of update it sent, and under local
//! differential privacy the epsilon spent so far. The client only appends to it (each
//! line synced before the next task), and it is also what `--max-rounds` counts.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The site log's file name in the state directory.
pub const SITE_LOG_FILE: &str = "site-log.jsonl";

/// An approved trainer's hash as given (`--approve-trainer`): 64 hexadecimal digits,
/// returned in lowercase.
pub fn parse_sha256(value: &str) -> Result<String, String> {
    let v = value.trim().to_ascii_lowercase();
    if v.len() == 64 && v.chars().all(|c| c.is_ascii_hexdigit()) {
        Ok(v)
    } else {
        Err(format!(
            "--approve-trainer must be a SHA-256 in hexadecimal (64 digits, as --trainer-hash \
             prints), got `{}`",
            value.chars().take(80).collect::<String>()
        ))
    }
}

/// What a site allows. The default allows everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SiteRules {
    /// Only these experiments may run here (`None`: any).
    pub allowed_experiments: Option<Vec<Uuid>>,
    /// At most this many training tasks per experiment (`None`: no limit).
    pub max_rounds: Option<u32>,
    /// Only the trainer whose code has this SHA-256 (lowercase hex) may run
    /// (`--approve-trainer`; `None`: any).
    pub approved_trainer: Option<String>,
    /// Only these columns of the site's data may be read, the label among them
    /// (`--columns`; `None`: all). A task must name its columns, all of them here.
    pub columns: Option<std::collections::BTreeSet<String>>,
}

/// A task as the site's rules and log see it: whose, which round, which kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskRef {
    /// The experiment.
    pub experiment: Uuid,
    /// The round (for an evaluation, the model version).
    pub round: i64,
    /// The round's attempt.
    pub attempt: i64,
    /// Training or evaluation.
    pub kind: Kind,
}

/// A task's kind, as the site log names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Training on the site's data.
    Train,
    /// Evaluating a model on it.
    Evaluate,
}

impl SiteRules {
    /// Why this site refuses `task`, if it does, given the training tasks of its
    /// experiment it already ran (`trained`) and the hash of the trainer's code as it is
    /// now (`code`: see [`crate::trainer::TaskTrainer::code_hash`]).
    pub fn refusal(
        &self,
        task: &TaskRef,
        columns: Option<&[String]>,
        trained: u32,
        code: Option<Result<String, String>>,
    ) -> Option<String> {
        if let Some(why) = self.column_refusal(task, columns) {
            return Some(why);
        }
        if let Some(approved) = &self.approved_trainer {
            match code {
                None => {
                    return Some(format!(
                        "this site approves only the trainer whose code has sha256 {approved} \
                         (--approve-trainer); this client's trainer has no code of its own"
                    ));
                }
                Some(Err(e)) => {
                    return Some(format!(
                        "cannot check the trainer's code against the approved sha256 {approved}: {e}"
                    ));
                }
                Some(Ok(hash)) if &hash != approved => {
                    return Some(format!(
                        "the trainer's code has sha256 {hash}, not the one this site approved \
                         ({approved}, --approve-trainer)"
                    ));
                }
                Some(Ok(_)) => {}
            }
        }
        if let Some(allowed) = &self.allowed_experiments
            && !allowed.contains(&task.experiment)
        {
            return Some(format!(
                "experiment {} is not allowed at this site (--allowed-experiments)",
                task.experiment
            ));
        }
        if let Some(max) = self.max_rounds
            && task.kind == Kind::Train
            && trained >= max
        {
            return Some(format!(
                "this site trains at most {max} rounds of an experiment (--max-rounds) and \
                 has trained {trained} of experiment {}",
                task.experiment
            ));
        }
        None
    }
}

impl SiteRules {
    /// Why the columns `task` reads (`columns`, from its experiment) are not the site's
    /// to give, if they are not.
    fn column_refusal(&self, task: &TaskRef, columns: Option<&[String]>) -> Option<String> {
        let shared = self.columns.as_ref()?;
        let listed = || shared.iter().cloned().collect::<Vec<_>>().join(",");
        let Some(columns) = columns else {
            return Some(format!(
                "experiment {} does not name the columns it reads (its spec's `columns`); this \
                 site shares only {} (--columns)",
                task.experiment,
                listed()
            ));
        };
        let label = crate::data::LABEL_COLUMN.to_string();
        let outside: Vec<&String> = columns
            .iter()
            .chain((task.kind == Kind::Train).then_some(&label))
            .filter(|c| !shared.contains(*c))
            .collect();
        if outside.is_empty() {
            return None;
        }
        let names: Vec<String> = outside.iter().map(|c| format!("`{c}`")).collect();
        Some(format!(
            "experiment {} reads column{} {}, which this site does not share (--columns {})",
            task.experiment,
            if outside.len() == 1 { "" } else { "s" },
            names.join(", "),
            listed()
        ))
    }
}

/// What became of a task, as the site log records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskOutcome {
    /// The update was acknowledged.
    Uploaded,
    /// The evaluation's metrics were reported.
    Evaluated,
    /// An evaluation answered without metrics (local differential privacy).
    Withheld,
    /// The trainer failed (reported to the coordinator).
    Failed,
    /// The site's rules refused it (reported to the coordinator).
    Refused,
    /// Given up: the round moved on, or a secure round was left.
    Skipped,
}

/// One line of the site log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiteLogEntry {
    /// When the task ended, Unix ms.
    pub at_ms: i64,
    /// The experiment.
    pub experiment: Uuid,
    /// The round (for an evaluation, the model version).
    pub round: i64,
    /// The round's attempt.
    pub attempt: i64,
    /// `train` or `evaluate`.
    pub kind: Kind,
    /// What became of it.
    pub outcome: TaskOutcome,
    /// Why, for a refused or failed task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Bytes of update the coordinator acknowledged for it.
    pub bytes_sent: u64,
    /// Under local differential privacy: this client's epsilon spent so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_dp_epsilon: Option<f64>,
}

impl SiteLogEntry {
    /// An entry for `task` ending now with `outcome`.
    pub fn of(task: &TaskRef, outcome: TaskOutcome) -> Self {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        Self {
            at_ms,
            experiment: task.experiment,
            round: task.round,
            attempt: task.attempt,
            kind: task.kind,
            outcome,
            reason: None,
            bytes_sent: 0,
            local_dp_epsilon: None,
        }
    }
}

/// The site log of a state directory.
#[derive(Debug, Clone)]
pub struct SiteLog {
    path: PathBuf,
}

impl SiteLog {
    /// The log in `state_dir` (created on the first entry).
    pub fn new(state_dir: &Path) -> Self {
        Self {
            path: state_dir.join(SITE_LOG_FILE),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `entry` as one line and syncs it.
    pub fn append(&self, entry: &SiteLogEntry) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut line = serde_json::to_vec(entry).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        file.write_all(&line)?;
        file.sync_data()
    }

    /// Every entry, oldest first; a line that does not parse (a crash mid-write) is
    /// skipped.
    pub fn entries(&self) -> std::io::Result<Vec<SiteLogEntry>> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => Ok(text
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// Training tasks of `experiment` this site ran (whatever became of them, refusals
    /// aside): what `--max-rounds` counts.
    pub fn trained(&self, experiment: Uuid) -> std::io::Result<u32> {
        Ok(self
            .entries()?
            .iter()
            .filter(|e| {
                e.experiment == experiment
                    && e.kind == Kind::Train
                    && e.outcome != TaskOutcome::Refused
            })
            .count() as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(experiment: u128, kind: Kind) -> TaskRef {
        TaskRef {
            experiment: Uuid::from_u128(experiment),
            round: 3,
            attempt: 1,
            kind,
        }
    }

    #[test]
    fn rules_refuse_other_experiments_and_rounds_past_the_limit() {
        let open = SiteRules::default();
        assert_eq!(open.refusal(&task(1, Kind::Train), None, 1000, None), None);
        let rules = SiteRules {
            allowed_experiments: Some(vec![Uuid::from_u128(1)]),
            max_rounds: Some(2),
            approved_trainer: None,
            columns: None,
        };
        assert_eq!(rules.refusal(&task(1, Kind::Train), None, 1, None), None);
        let why = rules.refusal(&task(2, Kind::Train), None, 0, None).unwrap();
        assert!(why.contains("not allowed at this site"), "{why}");
        let why = rules.refusal(&task(1, Kind::Train), None, 2, None).unwrap();
        assert!(why.contains("at most 2 rounds"), "{why}");
        // Evaluating the model is not training on the data again.
        assert_eq!(rules.refusal(&task(1, Kind::Evaluate), None, 2, None), None);
    }

    /// A site that shares some columns runs an experiment that reads only those (and the
    /// label) and refuses one that reads another, or does not say what it reads.
    #[test]
    fn only_tasks_reading_shared_columns_run() {
        let rules = SiteRules {
            columns: Some(["age", "bmi", "label"].map(String::from).into()),
            ..SiteRules::default()
        };
        let names = |c: &[&str]| c.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let t = task(1, Kind::Train);
        assert_eq!(
            rules.refusal(&t, Some(&names(&["bmi", "age"])), 0, None),
            None
        );
        let why = rules
            .refusal(&t, Some(&names(&["age", "name", "zip"])), 0, None)
            .unwrap();
        assert!(
            why.contains("columns `name`, `zip`") && why.contains("--columns age,bmi,label"),
            "{why}"
        );
        let why = rules.refusal(&t, None, 0, None).unwrap();
        assert!(why.contains("does not name the columns"), "{why}");
        // Training needs the label: a site that does not share it trains nothing.
        let no_label = SiteRules {
            columns: Some(["age"].map(String::from).into()),
            ..SiteRules::default()
        };
        let why = no_label
            .refusal(&t, Some(&names(&["age"])), 0, None)
            .unwrap();
        assert!(why.contains("column `label`"), "{why}");
    }

    #[test]
    fn only_the_approved_trainer_runs() {
        let approved = "ab".repeat(32);
        let rules = SiteRules {
            approved_trainer: Some(approved.clone()),
            ..SiteRules::default()
        };
        let t = task(1, Kind::Train);
        assert_eq!(rules.refusal(&t, None, 0, Some(Ok(approved.clone()))), None);
        let why = rules
            .refusal(&t, None, 0, Some(Ok("cd".repeat(32))))
            .unwrap();
        assert!(why.contains("not the one this site approved"), "{why}");
        let why = rules.refusal(&t, None, 0, None).unwrap();
        assert!(why.contains("no code of its own"), "{why}");
        let why = rules
            .refusal(&t, None, 0, Some(Err("gone".into())))
            .unwrap();
        assert!(
            why.contains("cannot check") && why.contains("gone"),
            "{why}"
        );
    }

    /// The log only grows, survives a reopening (a restart), skips a torn last line,
    /// and counts an experiment's training tasks without its refusals.
    #[test]
    fn the_log_appends_and_counts_training_tasks() {
        let dir = tempfile::tempdir().unwrap();
        let log = SiteLog::new(dir.path());
        let t = task(1, Kind::Train);
        log.append(&SiteLogEntry::of(&t, TaskOutcome::Uploaded))
            .unwrap();
        log.append(&SiteLogEntry::of(&t, TaskOutcome::Failed))
            .unwrap();
        log.append(&SiteLogEntry {
            reason: Some("no".into()),
            ..SiteLogEntry::of(&t, TaskOutcome::Refused)
        })
        .unwrap();
        log.append(&SiteLogEntry::of(
            &task(2, Kind::Train),
            TaskOutcome::Uploaded,
        ))
        .unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(log.path())
            .unwrap()
            .write_all(b"{\"at_ms\": 1, \"exper")
            .unwrap();
        let again = SiteLog::new(dir.path());
        assert_eq!(again.entries().unwrap().len(), 4);
        assert_eq!(again.trained(Uuid::from_u128(1)).unwrap(), 2);
        assert_eq!(again.trained(Uuid::from_u128(3)).unwrap(), 0);
    }
}
