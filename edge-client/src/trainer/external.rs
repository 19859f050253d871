//! The user's own training program (`cohort-edge --trainer "COMMAND ..."`), run once per
//! task in a fresh working folder.
//!
//! The folder holds `global.safetensors` (the model to start from) and `task.json` (the
//! round, the local settings, the experiment's hyperparameters, a seed). The program
//! writes `update.safetensors` (same tensor names and shapes) and `result.json`
//! (`num_examples`, optional `train_loss` and `eval_num_examples`, and any other number
//! is a metric of the model it received, evaluated on the client's held-out data). Its
//! environment names each file (`COHORT_WORK_DIR`, `COHORT_TASK`, `COHORT_GLOBAL_MODEL`,
//! `COHORT_UPDATE`, `COHORT_RESULT`) and holds no other `COHORT_*` variable, so the
//! enrolment token never reaches it. Its output goes to the edge client's log; it is
//! killed, with every process it started, at the time limit.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_aggregation::model_file;
use serde_json::Value;

use super::{ReportedEvaluation, TaskTrainer, TrainerFailure, TrainerJob, TrainerOutput};
use crate::protocol::TaskKind;

/// Largest `result.json` read.
pub const MAX_RESULT_BYTES: u64 = 64 * 1024;
/// Lines of the program's output kept for a failure's reason.
const LOG_TAIL_LINES: usize = 20;
/// Longest output line passed on to the log; longer ones are cut.
const MAX_LINE_CHARS: usize = 2000;

/// Why a `--trainer` command cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum TrainerSetupError {
    /// The command line is empty or has unbalanced quotes.
    #[error(
        "invalid --trainer command `{0}`: give a program and its arguments, quoted as a shell would"
    )]
    Command(String),
    /// The folder for the tasks' working folders cannot be made.
    #[error("cannot create the trainer's working folder `{path}`: {source}")]
    WorkRoot {
        /// The folder.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// A user's training program.
#[derive(Debug, Clone)]
pub struct ExternalTrainer {
    argv: Vec<String>,
    timeout: Duration,
    work_root: PathBuf,
}

impl ExternalTrainer {
    /// The program of `command` (split as a shell would, without running one), killed
    /// after `timeout`, with its tasks' folders under `work_root`.
    ///
    /// The program runs inside each task's folder, so words of the command that name an
    /// existing file or folder relative to the current directory are made absolute here:
    /// `python3 train.py --data site.csv` keeps working.
    pub fn new(
        command: &str,
        timeout: Duration,
        work_root: &Path,
    ) -> Result<Self, TrainerSetupError> {
        let words = shlex::split(command)
            .filter(|w| !w.is_empty())
            .ok_or_else(|| TrainerSetupError::Command(command.to_string()))?;
        let argv = words
            .into_iter()
            .map(|word| {
                let path = Path::new(&word);
                if path.is_relative() && !word.starts_with('-') && path.exists() {
                    std::path::absolute(path)
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or(word)
                } else {
                    word
                }
            })
            .collect();
        std::fs::create_dir_all(work_root).map_err(|source| TrainerSetupError::WorkRoot {
            path: work_root.to_path_buf(),
            source,
        })?;
        let work_root =
            std::path::absolute(work_root).map_err(|source| TrainerSetupError::WorkRoot {
                path: work_root.to_path_buf(),
                source,
            })?;
        Ok(Self {
            argv,
            timeout,
            work_root,
        })
    }

    /// The program and its arguments, as they will be run.
    pub fn argv(&self) -> &[String] {
        &self.argv
    }

    /// The files of the trainer's own code: the words of its command that name existing
    /// files, without the interpreter that runs them (`python3 train.py` is
    /// `train.py`; `./train.sh` is `./train.sh`).
    pub fn code_files(&self) -> Vec<PathBuf> {
        let files: Vec<(usize, PathBuf)> = self
            .argv
            .iter()
            .enumerate()
            .filter(|(_, w)| !w.starts_with('-'))
            .map(|(i, w)| (i, PathBuf::from(w)))
            .filter(|(_, p)| p.is_file())
            .collect();
        let interpreted = files.len() > 1 && files.first().is_some_and(|(i, _)| *i == 0);
        files
            .into_iter()
            .filter(|(i, _)| !(interpreted && *i == 0))
            .map(|(_, p)| p)
            .collect()
    }

    /// The SHA-256 (hex) of the trainer's code ([`super::code_sha256`] of
    /// [`code_files`](Self::code_files)): what `cohort-edge --trainer-hash` prints and
    /// `--approve-trainer` compares.
    pub fn code_sha256(&self) -> std::io::Result<String> {
        super::code_sha256(&self.code_files())
            .map_err(|e| std::io::Error::new(e.kind(), format!("{e} (`{}`)", self.argv.join(" "))))
    }

    fn task_json(&self, job: &TrainerJob<'_>, max_update_bytes: usize) -> Value {
        let t = &job.task.train;
        serde_json::json!({
            "kind": match job.task.kind { TaskKind::Train => "train", TaskKind::Evaluate => "evaluate" },
            "experiment_id": job.task.experiment_id,
            "round": job.task.round,
            "attempt": job.task.attempt,
            "model_version": job.model_version,
            "seed": job.seed,
            "train": {
                "local_epochs": t.local_epochs,
                "batch_size": t.batch_size,
                "lr": t.lr,
                "momentum": t.momentum,
                "weight_decay": t.weight_decay,
                "proximal_mu": t.proximal_mu.unwrap_or(0.0),
            },
            "hyperparameters": job.task.hyperparameters.clone().unwrap_or_default(),
            "files": {
                "global_model": "global.safetensors",
                "update": "update.safetensors",
                "result": "result.json",
            },
            "limits": {
                "timeout_seconds": self.timeout.as_secs_f64(),
                "max_update_bytes": max_update_bytes,
            },
        })
    }

    fn run_in(&self, dir: &Path, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let io = |what: &str, e: std::io::Error| TrainerFailure::new(format!("{what}: {e}"));
        let layout = job.global.layout();
        let max_update = model_file::max_file_bytes(layout);
        let metadata = std::collections::HashMap::from([
            ("experiment".to_string(), job.task.experiment_id.to_string()),
            ("round".to_string(), job.model_version.to_string()),
        ]);
        let global = dir.join("global.safetensors");
        let task = dir.join("task.json");
        let update = dir.join("update.safetensors");
        let result = dir.join("result.json");
        std::fs::write(&global, model_file::encode(job.global, metadata))
            .map_err(|e| io("cannot write global.safetensors", e))?;
        let task_text = serde_json::to_vec_pretty(&self.task_json(job, max_update))
            .expect("task json serialises");
        std::fs::write(&task, task_text).map_err(|e| io("cannot write task.json", e))?;

        let mut command = Command::new(&self.argv[0]);
        command
            .args(&self.argv[1..])
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("COHORT_") {
                command.env_remove(key);
            }
        }
        command
            .env("COHORT_WORK_DIR", dir)
            .env("COHORT_TASK", &task)
            .env("COHORT_GLOBAL_MODEL", &global)
            .env("COHORT_UPDATE", &update)
            .env("COHORT_RESULT", &result);
        #[cfg(unix)]
        {
            // Its own process group, so that the time limit kills whatever it started.
            use std::os::unix::process::CommandExt;
            command.process_group(0);
        }
        let started = Instant::now();
        let mut child = command.spawn().map_err(|e| {
            TrainerFailure::new(format!("cannot start the trainer `{}`: {e}", self.argv[0]))
        })?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let readers: Vec<_> = [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        .map(|stream| {
            let tail = tail.clone();
            std::thread::spawn(move || forward_output(stream, &tail))
        })
        .collect();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if started.elapsed() >= self.timeout => break None,
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => {
                    kill_group(&mut child);
                    return Err(io("cannot wait for the trainer", e));
                }
            }
        };
        // Whatever it left running (a data loader, a shell's children) goes with it, so
        // that its pipes close and nothing outlives the task.
        kill_group(&mut child);
        for reader in readers {
            let _ = reader.join();
        }
        let log_tail = || {
            let lines = tail.lock().map(|t| t.clone()).unwrap_or_default();
            if lines.is_empty() {
                String::new()
            } else {
                format!("; its last output:\n{}", Vec::from(lines).join("\n"))
            }
        };
        let Some(status) = status else {
            return Err(TrainerFailure::new(format!(
                "the trainer ran past its time limit of {} s and was killed{}",
                self.timeout.as_secs_f64(),
                log_tail()
            )));
        };
        if !status.success() {
            return Err(TrainerFailure::new(format!(
                "the trainer exited with {status}{}",
                log_tail()
            )));
        }
        let report = read_result(&result)?;
        let update = match job.task.kind {
            TaskKind::Evaluate => None,
            TaskKind::Train => Some(read_update(&update, layout, max_update)?),
        };
        Ok(TrainerOutput {
            update,
            num_examples: report.num_examples,
            train_loss: report.train_loss,
            evaluation: report.evaluation,
        })
    }
}

impl TaskTrainer for ExternalTrainer {
    fn code_hash(&self) -> Option<Result<String, String>> {
        Some(self.code_sha256().map_err(|e| e.to_string()))
    }

    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("task-r{}-a{}-", job.task.round, job.task.attempt))
            .tempdir_in(&self.work_root)
            .map_err(|e| {
                TrainerFailure::new(format!(
                    "cannot create a working folder in `{}`: {e}",
                    self.work_root.display()
                ))
            })?;
        // The folder and whatever the program left in it go when `dir` drops.
        self.run_in(dir.path(), job)
    }
}

fn forward_output(stream: Box<dyn Read + Send>, tail: &Mutex<VecDeque<String>>) {
    let mut reader = BufReader::new(stream);
    let mut raw = Vec::new();
    loop {
        raw.clear();
        // Lines are read whole but kept cut, so a program printing without newlines
        // cannot make the client hold its output.
        match reader.by_ref().take(64 * 1024).read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&raw);
        let line: String = text.trim_end().chars().take(MAX_LINE_CHARS).collect();
        eprintln!("cohort-edge: trainer: {line}");
        if let Ok(mut t) = tail.lock() {
            if t.len() == LOG_TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    }
}

fn kill_group(child: &mut std::process::Child) {
    #[cfg(unix)]
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        // ESRCH once everything has exited: nothing to do.
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A checked `result.json`.
struct ResultReport {
    num_examples: u64,
    train_loss: Option<f64>,
    evaluation: Option<ReportedEvaluation>,
}

fn read_result(path: &Path) -> Result<ResultReport, TrainerFailure> {
    let size = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(_) => return Err(TrainerFailure::new("the trainer wrote no result.json")),
    };
    if size > MAX_RESULT_BYTES {
        return Err(TrainerFailure::new(format!(
            "result.json is {size} bytes, more than the {MAX_RESULT_BYTES} allowed"
        )));
    }
    let text = std::fs::read(path)
        .map_err(|e| TrainerFailure::new(format!("cannot read result.json: {e}")))?;
    let value: Value = serde_json::from_slice(&text)
        .map_err(|e| TrainerFailure::new(format!("result.json is not valid JSON: {e}")))?;
    let Value::Object(fields) = value else {
        return Err(TrainerFailure::new("result.json must be a JSON object"));
    };
    let count = |name: &str, v: &Value| -> Result<u64, TrainerFailure> {
        v.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
            TrainerFailure::new(format!(
                "result.json: `{name}` must be a whole number of at least 1, got {v}"
            ))
        })
    };
    let mut num_examples = None;
    let mut train_loss = None;
    let mut eval_examples = None;
    let mut metrics = BTreeMap::new();
    for (name, v) in &fields {
        match name.as_str() {
            "num_examples" => num_examples = Some(count(name, v)?),
            "eval_num_examples" => eval_examples = Some(count(name, v)?),
            "train_loss" => {
                train_loss = Some(v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
                    TrainerFailure::new(format!(
                        "result.json: `train_loss` must be a finite number, got {v}"
                    ))
                })?);
            }
            _ => {
                let value = v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
                    TrainerFailure::new(format!(
                        "result.json: metric `{}` must be a finite number, got {}",
                        name.chars().take(80).collect::<String>(),
                        v.to_string().chars().take(80).collect::<String>()
                    ))
                })?;
                metrics.insert(name.clone(), value);
            }
        }
    }
    let num_examples =
        num_examples.ok_or_else(|| TrainerFailure::new("result.json has no `num_examples`"))?;
    let evaluation = (!metrics.is_empty()).then(|| ReportedEvaluation {
        num_examples: eval_examples.unwrap_or(num_examples),
        metrics,
    });
    Ok(ResultReport {
        num_examples,
        train_loss,
        evaluation,
    })
}

fn read_update(
    path: &Path,
    layout: &Arc<cohort_aggregation::Layout>,
    max_bytes: usize,
) -> Result<cohort_aggregation::ModelVector, TrainerFailure> {
    let size = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(_) => {
            return Err(TrainerFailure::new(
                "the trainer wrote no update.safetensors",
            ));
        }
    };
    // Refused before it is read: a runaway program must not fill the client's memory.
    if size > max_bytes as u64 {
        return Err(TrainerFailure::new(format!(
            "update.safetensors is {size} bytes, more than the {max_bytes} a model of this size can need"
        )));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| TrainerFailure::new(format!("cannot read update.safetensors: {e}")))?;
    model_file::decode_as(layout, &bytes, max_bytes)
        .map_err(|e| TrainerFailure::new(format!("update.safetensors: {e}")))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::protocol::Task;
    use cohort_aggregation::{Layout, ModelVector, TensorSpec};

    fn task() -> Task {
        serde_json::from_value(serde_json::json!({
            "experiment_id": "00000000-0000-0000-0000-000000000001",
            "round": 2, "attempt": 1, "deadline_ms": null, "model": "file",
            "features": 0, "classes": 0,
            "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.1, "momentum": 0.0,
                      "weight_decay": 0.0, "proximal_mu": null},
            "tensors": [{"name": "w", "shape": [2, 2]}, {"name": "b", "shape": [2]}],
            "hyperparameters": {"scale": 2}
        }))
        .unwrap()
    }

    fn global() -> ModelVector {
        let layout = Layout::new(vec![
            TensorSpec::new("w", [2, 2]),
            TensorSpec::new("b", [2]),
        ]);
        ModelVector::new(
            Arc::new(layout.unwrap()),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        )
        .unwrap()
    }

    fn run(script: &str, timeout: Duration) -> (Result<TrainerOutput, TrainerFailure>, PathBuf) {
        let root = tempfile::tempdir().unwrap().keep();
        let trainer = ExternalTrainer::new(
            &format!("sh -c {}", shlex::try_quote(script).unwrap()),
            timeout,
            &root.join("work"),
        )
        .unwrap();
        let task = task();
        let global = global();
        let job = TrainerJob {
            task: &task,
            global: &global,
            model_version: 1,
            seed: 7,
            trainable: None,
            anchor: None,
        };
        (trainer.run(&job), root)
    }

    #[test]
    fn a_trainer_gets_the_model_and_task_and_its_output_is_read_back() {
        let (out, root) = run(
            "test -f \"$COHORT_TASK\" && grep -q '\"scale\": 2' task.json && \
             cp global.safetensors \"$COHORT_UPDATE\" && \
             echo '{\"num_examples\": 12, \"train_loss\": 0.25, \"accuracy\": 0.75, \
             \"eval_num_examples\": 4}' > result.json",
            Duration::from_secs(30),
        );
        let out = out.unwrap();
        assert_eq!(out.update.unwrap(), global());
        assert_eq!(out.num_examples, 12);
        assert_eq!(out.train_loss, Some(0.25));
        let evaluation = out.evaluation.unwrap();
        assert_eq!(evaluation.num_examples, 4);
        assert_eq!(evaluation.metrics["accuracy"], 0.75);
        // The task's folder is gone with whatever the program left in it.
        assert_eq!(std::fs::read_dir(root.join("work")).unwrap().count(), 0);
    }

    #[test]
    fn a_failing_trainer_is_reported_with_its_last_output() {
        let (out, _) = run(
            "echo 'loading data'; echo 'CUDA out of memory' >&2; exit 7",
            Duration::from_secs(30),
        );
        let reason = out.unwrap_err().reason;
        assert!(reason.contains("exited with exit status: 7"), "{reason}");
        assert!(reason.contains("CUDA out of memory"), "{reason}");
    }

    #[test]
    fn a_hung_trainer_is_killed_with_everything_it_started() {
        // A sleep length no other process uses marks this test's processes in `ps`.
        let seconds = 1_000_000 + std::process::id();
        let marker = format!("sleep {seconds}");
        let started = Instant::now();
        let (out, _) = run(
            &format!("sleep {seconds} & sleep {seconds}"),
            Duration::from_millis(500),
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        let reason = out.unwrap_err().reason;
        assert!(reason.contains("time limit of 0.5 s"), "{reason}");
        std::thread::sleep(Duration::from_millis(200));
        let ps = Command::new("ps")
            .args(["-eo", "pid,pgid,args"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&ps.stdout);
        let survivors: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_end().ends_with(&marker))
            .collect();
        assert!(survivors.is_empty(), "the trainer survived: {survivors:?}");
    }

    #[test]
    fn missing_or_malformed_results_are_refused() {
        let cases = [
            ("cp global.safetensors update.safetensors", "no result.json"),
            (
                "cp global.safetensors update.safetensors; echo '[1]' > result.json",
                "must be a JSON object",
            ),
            (
                "cp global.safetensors update.safetensors; echo '{\"loss\": 1}' > result.json",
                "no `num_examples`",
            ),
            (
                "cp global.safetensors update.safetensors; \
                 echo '{\"num_examples\": 0}' > result.json",
                "at least 1",
            ),
            (
                "cp global.safetensors update.safetensors; \
                 echo '{\"num_examples\": 3, \"note\": \"hi\"}' > result.json",
                "metric `note` must be a finite number",
            ),
            (
                "echo '{\"num_examples\": 3}' > result.json",
                "no update.safetensors",
            ),
            (
                "echo garbage > update.safetensors; echo '{\"num_examples\": 3}' > result.json",
                "update.safetensors: not a valid safetensors file",
            ),
        ];
        for (script, words) in cases {
            let (out, _) = run(script, Duration::from_secs(30));
            let reason = out.unwrap_err().reason;
            assert!(reason.contains(words), "{script}: {reason}");
        }
    }

    #[test]
    fn command_words_naming_files_become_absolute() {
        let here = std::env::current_dir().unwrap();
        let t = ExternalTrainer::new(
            "python3 Cargo.toml --flag src 'two words'",
            Duration::from_secs(1),
            &tempfile::tempdir().unwrap().keep(),
        )
        .unwrap();
        assert_eq!(t.argv()[0], "python3");
        assert_eq!(Path::new(&t.argv()[1]), here.join("Cargo.toml"));
        assert_eq!(t.argv()[2], "--flag");
        assert_eq!(Path::new(&t.argv()[3]), here.join("src"));
        assert_eq!(t.argv()[4], "two words");
        assert!(ExternalTrainer::new("'unbalanced", Duration::from_secs(1), &here).is_err());
        assert!(ExternalTrainer::new("  ", Duration::from_secs(1), &here).is_err());
    }
}
