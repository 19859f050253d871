//! The C API: the edge client embedded in an app, which trains inside its own process.
//!
//! ```c
//! CohortError err = {0};
//! CohortClient *client = NULL;
//! if (cohort_client_new(config_json, &client, &err) != COHORT_OK) { puts(err.message); }
//! cohort_client_run_pending(client, train, app_state, 30, &err);  // tasks until idle 30 s
//! CohortStatus status; cohort_client_status(client, &status);
//! cohort_client_free(client);
//! ```
//!
//! The library does everything around training (enrolment, TLS, scheduling, clipping,
//! noise, masking, retries); the app's callback receives the global weights and returns
//! new ones and a sample count. Every function returns a [`CohortCode`] and fills a
//! caller-owned [`CohortError`]; no panic crosses the boundary, and nothing the library
//! allocates is left for the caller to free except the client itself.
//!
//! Threads: `cohort_client_run_pending` blocks its caller; the callback runs on one of
//! the library's worker threads, one task at a time, while it does, and never after it
//! has returned: a task that ends early (a secure round abandoned while the callback
//! trains) waits for the callback before the next task starts or the call returns. A
//! client must not be used from two threads at once.

// The boundary with C is unsafe by nature; each block says what the caller promised.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::protocol::TaskKind;
use crate::trainer::{ReportedEvaluation, TaskTrainer, TrainerFailure, TrainerJob, TrainerOutput};

/// Result codes of every function.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CohortCode {
    /// Success.
    CohortOk = 0,
    /// A pointer argument was null, or a string was not UTF-8.
    CohortInvalidArgument = 1,
    /// The configuration JSON is malformed or incomplete.
    CohortInvalidConfig = 2,
    /// The coordinator could not be reached or refused the client for good.
    CohortProtocol = 3,
    /// The state directory could not be read or written.
    CohortState = 4,
    /// Anything else, including an internal error caught at the boundary.
    CohortInternal = 5,
}

/// Length of [`CohortError::message`], terminating zero included.
pub const COHORT_ERROR_MESSAGE_LEN: usize = 512;

/// An error: its code and a message (UTF-8, zero-terminated, cut to fit). Owned by the
/// caller, so nothing needs freeing.
#[repr(C)]
#[derive(Debug)]
pub struct CohortError {
    /// The code, [`CohortCode::CohortOk`] when there was no error.
    pub code: CohortCode,
    /// What went wrong.
    pub message: [c_char; COHORT_ERROR_MESSAGE_LEN],
}

/// What the agent did so far, for an app's status screen.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CohortStatus {
    /// 1 once the client holds a credential (enrolled), else 0.
    pub enrolled: i32,
    /// Updates uploaded and acknowledged.
    pub uploads: u64,
    /// Tasks given up (the round moved on).
    pub skipped: u64,
    /// Tasks the callback failed (reported to the coordinator).
    pub failed: u64,
    /// Evaluation tasks completed.
    pub evaluations: u64,
}

/// One task as the callback sees it. Pointers are valid during the call only.
#[repr(C)]
#[derive(Debug)]
pub struct CohortTask {
    /// 0: train and return new weights; 1: only evaluate the weights given.
    pub kind: i32,
    /// The round (for an evaluation, the model version).
    pub round: i64,
    /// The published round the weights are (0: the initial model).
    pub model_version: i64,
    /// A seed for the trainer's randomness.
    pub seed: u64,
    /// Local epochs asked for.
    pub local_epochs: u32,
    /// Mini-batch size asked for.
    pub batch_size: u64,
    /// Learning rate asked for.
    pub lr: f32,
    /// Momentum asked for.
    pub momentum: f32,
    /// Weight decay asked for.
    pub weight_decay: f32,
    /// FedProx mu (0: none).
    pub proximal_mu: f32,
    /// The model's tensors, JSON: `[{"name": ..., "shape": [...]}, ...]`, in the order
    /// of the weights.
    pub tensors_json: *const c_char,
    /// The experiment's hyperparameters, JSON object.
    pub hyperparameters_json: *const c_char,
}

/// What the callback reports besides the weights. Fields it does not know stay as the
/// library set them (NaN, 0).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CohortTrainResult {
    /// Examples trained on (the update's weight), or evaluated; at least 1.
    pub num_examples: u64,
    /// Mean training loss, or NaN.
    pub train_loss: f64,
    /// Accuracy of the weights received, on the app's held-out data, or NaN.
    pub eval_accuracy: f64,
    /// Loss of the weights received, on the app's held-out data, or NaN.
    pub eval_loss: f64,
    /// Examples behind the evaluation (0: num_examples).
    pub eval_num_examples: u64,
}

/// The app's training callback. `global` holds `len` weights; for a training task the
/// callback writes `len` new weights to `update` (for an evaluation `update` is null).
/// Returns 0 on success; anything else fails the task, which is then reported to the
/// coordinator and nothing is uploaded.
pub type CohortTrainFn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        task: *const CohortTask,
        global: *const f32,
        len: usize,
        update: *mut f32,
        result: *mut CohortTrainResult,
    ) -> i32,
>;

/// An embedded edge client. Opaque to C.
pub struct CohortClient {
    runtime: tokio::runtime::Runtime,
    config: ClientConfig,
    status: CohortStatus,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientConfig {
    coordinator: String,
    #[serde(default)]
    ca_cert_file: Option<PathBuf>,
    #[serde(default)]
    ca_cert_pem: Option<String>,
    #[serde(default)]
    client_cert_file: Option<PathBuf>,
    #[serde(default)]
    client_key_file: Option<PathBuf>,
    #[serde(default)]
    enrol_token: Option<String>,
    state_dir: PathBuf,
    #[serde(default)]
    seed: u64,
    /// Allows a plain `http://` coordinator, over which the credential travels in clear.
    #[serde(default)]
    insecure_http: bool,
}

struct Failure(CohortCode, String);

fn write_error(err: *mut CohortError, code: CohortCode, message: &str) {
    if err.is_null() {
        return;
    }
    let mut buffer = [0 as c_char; COHORT_ERROR_MESSAGE_LEN];
    // Cut at a character boundary so that the message stays valid UTF-8.
    let mut end = message.len().min(COHORT_ERROR_MESSAGE_LEN - 1);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    for (slot, byte) in buffer.iter_mut().zip(message[..end].bytes()) {
        *slot = byte as c_char;
    }
    // SAFETY: the caller passed a pointer to a CohortError it owns (or null, handled).
    unsafe {
        (*err).code = code;
        (*err).message = buffer;
    }
}

/// Runs `body`, turning its failure or panic into a code and a message in `err`.
fn guarded(err: *mut CohortError, body: impl FnOnce() -> Result<(), Failure>) -> CohortCode {
    let outcome = catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown".into());
        Err(Failure(
            CohortCode::CohortInternal,
            format!("internal error: {what}"),
        ))
    });
    match outcome {
        Ok(()) => {
            write_error(err, CohortCode::CohortOk, "");
            CohortCode::CohortOk
        }
        Err(Failure(code, message)) => {
            write_error(err, code, &message);
            code
        }
    }
}

fn invalid(what: &str) -> Failure {
    Failure(CohortCode::CohortInvalidArgument, what.to_string())
}

/// Creates a client from a JSON configuration: `coordinator` (an `https://` URL),
/// `state_dir`, and optionally `ca_cert_file` or `ca_cert_pem` (the CA to trust),
/// `client_cert_file` with `client_key_file` (PEM; for a coordinator that requires mutual
/// TLS), `enrol_token` (needed until the credential is stored), `seed`, and
/// `insecure_http` (`true` allows an `http://` coordinator, over which the enrolment token
/// and the credential travel unencrypted: for tests only; otherwise such a URL is
/// refused with `CohortInvalidConfig`). Nothing is sent yet.
///
/// # Safety
/// `config_json` must be a zero-terminated string; `out` must point to writable
/// storage for a pointer; `err` may be null or point to a `CohortError`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_new(
    config_json: *const c_char,
    out: *mut *mut CohortClient,
    err: *mut CohortError,
) -> CohortCode {
    guarded(err, || {
        if config_json.is_null() || out.is_null() {
            return Err(invalid("config_json and out must not be null"));
        }
        // SAFETY: non-null and zero-terminated, as the caller promised.
        let text = unsafe { CStr::from_ptr(config_json) }
            .to_str()
            .map_err(|_| invalid("config_json is not UTF-8"))?;
        let config: ClientConfig = serde_json::from_str(text).map_err(|e| {
            Failure(
                CohortCode::CohortInvalidConfig,
                format!("configuration: {e}"),
            )
        })?;
        if config.ca_cert_file.is_some() && config.ca_cert_pem.is_some() {
            return Err(Failure(
                CohortCode::CohortInvalidConfig,
                "configuration: give ca_cert_file or ca_cert_pem, not both".into(),
            ));
        }
        if config.client_cert_file.is_some() != config.client_key_file.is_some() {
            return Err(Failure(
                CohortCode::CohortInvalidConfig,
                "configuration: client_cert_file and client_key_file go together".into(),
            ));
        }
        crate::protocol::check_coordinator_url(&config.coordinator, config.insecure_http).map_err(
            |e| {
                Failure(
                    CohortCode::CohortInvalidConfig,
                    format!("configuration: {e}"),
                )
            },
        )?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Failure(CohortCode::CohortInternal, format!("runtime: {e}")))?;
        let client = Box::new(CohortClient {
            runtime,
            config,
            status: CohortStatus::default(),
        });
        // SAFETY: `out` is non-null and writable, as the caller promised.
        unsafe { *out = Box::into_raw(client) };
        Ok(())
    })
}

/// The app's callback and its data, handed to the library's worker thread.
#[derive(Debug)]
struct CallbackTrainer {
    train: unsafe extern "C" fn(
        *mut c_void,
        *const CohortTask,
        *const f32,
        usize,
        *mut f32,
        *mut CohortTrainResult,
    ) -> i32,
    user_data: *mut c_void,
}

// SAFETY: the app hands `user_data` to the library for the duration of
// `cohort_client_run_pending`, which calls back one task at a time; the documented
// contract is that the callback may run on a library thread.
unsafe impl Send for CallbackTrainer {}
// SAFETY: as above; calls never overlap: the agent serves one task at a time, and a
// task ends only once its callback has returned.
unsafe impl Sync for CallbackTrainer {}

impl TaskTrainer for CallbackTrainer {
    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let tensors =
            serde_json::to_string(job.global.layout().tensors()).expect("tensor specs serialise");
        let hyper = serde_json::to_string(&job.task.hyperparameters.clone().unwrap_or_default())
            .expect("a JSON object serialises");
        let tensors = CString::new(tensors).map_err(|e| TrainerFailure::new(e.to_string()))?;
        let hyper = CString::new(hyper).map_err(|e| TrainerFailure::new(e.to_string()))?;
        let t = &job.task.train;
        let task = CohortTask {
            kind: match job.task.kind {
                TaskKind::Train => 0,
                TaskKind::Evaluate => 1,
            },
            round: job.task.round,
            model_version: job.model_version,
            seed: job.seed,
            local_epochs: t.local_epochs,
            batch_size: t.batch_size as u64,
            lr: t.lr,
            momentum: t.momentum,
            weight_decay: t.weight_decay,
            proximal_mu: t.proximal_mu.unwrap_or(0.0),
            tensors_json: tensors.as_ptr(),
            hyperparameters_json: hyper.as_ptr(),
        };
        let global = job.global.values();
        let mut update = match job.task.kind {
            TaskKind::Train => Some(vec![f32::NAN; global.len()]),
            TaskKind::Evaluate => None,
        };
        let mut result = CohortTrainResult {
            num_examples: 0,
            train_loss: f64::NAN,
            eval_accuracy: f64::NAN,
            eval_loss: f64::NAN,
            eval_num_examples: 0,
        };
        let update_ptr = update
            .as_mut()
            .map_or(std::ptr::null_mut(), |u| u.as_mut_ptr());
        // SAFETY: every pointer is valid for the call: `task` and its strings live on
        // this frame, `global` has `len` floats, `update` has `len` (or is null for an
        // evaluation), `result` is ours. The function pointer is the app's.
        let status = unsafe {
            (self.train)(
                self.user_data,
                &task,
                global.as_ptr(),
                global.len(),
                update_ptr,
                &mut result,
            )
        };
        if status != 0 {
            return Err(TrainerFailure::new(format!(
                "the app's training callback returned {status}"
            )));
        }
        let update = match update {
            Some(values) => Some(
                cohort_aggregation::ModelVector::new(job.global.layout().clone(), values)
                    .map_err(|e| TrainerFailure::new(e.to_string()))?,
            ),
            None => None,
        };
        let mut metrics = std::collections::BTreeMap::new();
        if !result.eval_accuracy.is_nan() {
            metrics.insert("accuracy".to_string(), result.eval_accuracy);
        }
        if !result.eval_loss.is_nan() {
            metrics.insert("loss".to_string(), result.eval_loss);
        }
        let eval_examples = if result.eval_num_examples == 0 {
            result.num_examples
        } else {
            result.eval_num_examples
        };
        let evaluation = (!metrics.is_empty()).then_some(ReportedEvaluation {
            num_examples: eval_examples,
            metrics,
        });
        Ok(TrainerOutput {
            update,
            num_examples: result.num_examples,
            train_loss: (!result.train_loss.is_nan()).then_some(result.train_loss),
            evaluation,
        })
    }
}

/// Enrols if needed, then serves tasks with `train` until no task has come for
/// `idle_seconds`. Blocks the caller; `train` runs on a library thread meanwhile.
///
/// # Safety
/// `client` must come from `cohort_client_new` and not be freed; `train` must be a
/// valid function that honours [`CohortTrainFn`]'s contract; `user_data` is passed to
/// it as is; `err` may be null or point to a `CohortError`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_run_pending(
    client: *mut CohortClient,
    train: CohortTrainFn,
    user_data: *mut c_void,
    idle_seconds: u32,
    err: *mut CohortError,
) -> CohortCode {
    guarded(err, || {
        // SAFETY: a live client from cohort_client_new, as the caller promised.
        let client = unsafe { client.as_mut() }.ok_or_else(|| invalid("client is null"))?;
        let train = train.ok_or_else(|| invalid("train is null"))?;
        let c = &client.config;
        let ca_pem = match (&c.ca_cert_file, &c.ca_cert_pem) {
            (Some(path), _) => Some(std::fs::read(path).map_err(|e| {
                Failure(
                    CohortCode::CohortInvalidConfig,
                    format!("ca_cert_file `{}`: {e}", path.display()),
                )
            })?),
            (None, Some(pem)) => Some(pem.clone().into_bytes()),
            (None, None) => None,
        };
        let identity_pem = match (&c.client_cert_file, &c.client_key_file) {
            (Some(cert), Some(key)) => Some(crate::protocol::read_identity(cert, key).map_err(
                |(path, e)| {
                    let what = if &path == cert {
                        "client_cert_file"
                    } else {
                        "client_key_file"
                    };
                    Failure(
                        CohortCode::CohortInvalidConfig,
                        format!("{what} `{}`: {e}", path.display()),
                    )
                },
            )?),
            _ => None,
        };
        let config = crate::agent::AgentConfig {
            coordinator: c.coordinator.clone(),
            insecure_http: c.insecure_http,
            ca_pem,
            identity_pem,
            enrol_token: c.enrol_token.clone(),
            trainer: std::sync::Arc::new(CallbackTrainer { train, user_data }),
            state_dir: c.state_dir.clone(),
            idle_exit: Some(Duration::from_secs(u64::from(idle_seconds))),
            seed: c.seed,
            local_dp: None,
            slowdown: Duration::ZERO,
            floors: cohort_aggregation::secagg::ClientFloors::default(),
            rules: Default::default(),
        };
        let report = client.runtime.block_on(crate::agent::run_agent(config));
        match report {
            Ok(r) => {
                let s = &mut client.status;
                s.enrolled = i32::from(r.client_id.is_some());
                s.uploads += r.uploads as u64;
                s.skipped += r.skipped as u64;
                s.failed += r.failed as u64;
                s.evaluations += r.evaluations as u64;
                Ok(())
            }
            Err(e) => {
                let code = match &e {
                    crate::agent::AgentError::State { .. } => CohortCode::CohortState,
                    crate::agent::AgentError::NoToken => CohortCode::CohortInvalidConfig,
                    crate::agent::AgentError::Protocol(_) => CohortCode::CohortProtocol,
                    _ => CohortCode::CohortInternal,
                };
                Err(Failure(code, e.to_string()))
            }
        }
    })
}

/// Copies what the client did so far into `out`.
///
/// # Safety
/// `client` must be a live client; `out` must point to a writable `CohortStatus`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_status(
    client: *const CohortClient,
    out: *mut CohortStatus,
    err: *mut CohortError,
) -> CohortCode {
    guarded(err, || {
        // SAFETY: a live client, as the caller promised.
        let client = unsafe { client.as_ref() }.ok_or_else(|| invalid("client is null"))?;
        if out.is_null() {
            return Err(invalid("out is null"));
        }
        let mut status = client.status;
        status.enrolled = i32::from(client.config.state_dir.join("credential.json").exists());
        // SAFETY: non-null and writable, as the caller promised.
        unsafe { *out = status };
        Ok(())
    })
}

/// Frees a client (null is ignored). Its worker threads stop first.
///
/// # Safety
/// `client` must come from `cohort_client_new` and not be used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cohort_client_free(client: *mut CohortClient) {
    if client.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: from Box::into_raw in cohort_client_new, freed once, as promised.
        let CohortClient { runtime, .. } = *unsafe { Box::from_raw(client) };
        runtime.shutdown_timeout(Duration::from_secs(5));
    }));
}

/// The library's version, a static zero-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn cohort_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cohort_client_new` on `config`: its code, its message, and the client (freed).
    fn create(config: &str) -> (CohortCode, String) {
        let config = CString::new(config).unwrap();
        let mut client: *mut CohortClient = std::ptr::null_mut();
        let mut err = CohortError {
            code: CohortCode::CohortOk,
            message: [0; COHORT_ERROR_MESSAGE_LEN],
        };
        // SAFETY: a zero-terminated string, and pointers to our own locals.
        let code = unsafe { cohort_client_new(config.as_ptr(), &mut client, &mut err) };
        // SAFETY: written by write_error, zero-terminated within the buffer.
        let message = unsafe { CStr::from_ptr(err.message.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: from cohort_client_new (or null), freed once.
        unsafe { cohort_client_free(client) };
        (code, message)
    }

    /// An app embedding the client gets the CLI's rule: plain HTTP only when its
    /// configuration says `insecure_http`.
    #[test]
    fn a_plain_http_coordinator_needs_insecure_http() {
        let dir = std::env::temp_dir().join(format!("cohort-ffi-{}", std::process::id()));
        let config = |url: &str, extra: &str| {
            format!(
                r#"{{"coordinator": "{url}", "state_dir": "{}"{extra}}}"#,
                dir.display()
            )
        };
        let (code, message) = create(&config("http://127.0.0.1:8443", ""));
        assert_eq!(code, CohortCode::CohortInvalidConfig);
        assert!(message.contains("insecure_http"), "{message}");
        assert!(message.contains("unencrypted"), "{message}");
        let (code, message) = create(&config(
            "http://127.0.0.1:8443",
            r#", "insecure_http": true"#,
        ));
        assert_eq!(code, CohortCode::CohortOk, "{message}");
        let (code, message) = create(&config("https://127.0.0.1:8443", ""));
        assert_eq!(code, CohortCode::CohortOk, "{message}");
        let (code, _) = create(&config(
            "ftp://127.0.0.1:8443",
            r#", "insecure_http": true"#,
        ));
        assert_eq!(code, CohortCode::CohortInvalidConfig);
    }
}
