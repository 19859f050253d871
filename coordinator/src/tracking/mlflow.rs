//! `--mlflow-uri`: runs reported to an MLflow tracking server through its REST API
//! (`/api/2.0/mlflow/...`), with no MLflow library on Cohort's side.
//!
//! A run is found again by its key, kept in the run's `cohort.run_key` tag: a replica
//! that did not create a served experiment's run, or a coordinator that restarted,
//! reports into the same run instead of opening another. Parameters go in with the run's
//! first record (MLflow takes the same value twice but refuses a changed one), metrics
//! in batches, the final model through the server's artifact proxy (`mlflow server`
//! serves artifacts by default; a server that does not has its runs' artifacts
//! rejected, and counted as dropped).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};

use super::{Record, RunRef, SinkError};

/// The tag a run's key is kept in.
pub const RUN_KEY_TAG: &str = "cohort.run_key";

/// MLflow's limit on parameters in one `log-batch`.
const PARAMS_PER_BATCH: usize = 100;

/// MLflow's limit on metrics in one `log-batch`.
const METRICS_PER_BATCH: usize = 1000;

/// Time allowed for a request that moves no model.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Time allowed for uploading a model.
const ARTIFACT_TIMEOUT: Duration = Duration::from_secs(600);

/// Why an `--mlflow-uri` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum MlflowUriError {
    /// Not an `http://` or `https://` address.
    #[error(
        "--mlflow-uri `{0}` is not an http:// or https:// address of an MLflow tracking server"
    )]
    Scheme(String),
    /// The HTTP client could not be built.
    #[error("--mlflow-uri: {0}")]
    Client(String),
}

/// Refuses an `--mlflow-uri` that is not an `http://` or `https://` address; settings
/// check it with this before any client is made.
pub fn check_uri(uri: &str) -> Result<(), MlflowUriError> {
    if uri.starts_with("http://") || uri.starts_with("https://") {
        Ok(())
    } else {
        Err(MlflowUriError::Scheme(uri.to_string()))
    }
}

/// A run as the server knows it.
#[derive(Debug, Clone)]
struct KnownRun {
    id: String,
    /// The artifact proxy's path for the run's files, when the server proxies them.
    artifact_path: Option<String>,
}

/// An MLflow tracking server.
#[derive(Debug)]
pub struct MlflowSink {
    base: String,
    http: reqwest::Client,
    runs: HashMap<String, KnownRun>,
}

impl MlflowSink {
    /// A sink for the server at `uri` (`http://127.0.0.1:5000`); nothing is contacted
    /// until the first record.
    pub fn new(uri: &str) -> Result<Self, MlflowUriError> {
        check_uri(uri)?;
        let base = uri.trim_end_matches('/');
        // reqwest is built without a crypto provider of its own; ring is the one.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| MlflowUriError::Client(e.to_string()))?;
        Ok(Self {
            base: base.to_string(),
            http,
            runs: HashMap::new(),
        })
    }

    /// Hands `record` to the server.
    pub async fn send(&mut self, record: &Record) -> Result<(), SinkError> {
        let run = self.run(record.run()).await?;
        match record {
            Record::Start(_) => Ok(()),
            Record::Metrics {
                step,
                time_ms,
                values,
                ..
            } => {
                let metrics: Vec<Value> = values
                    .iter()
                    .map(|(key, value)| {
                        json!({"key": key, "value": value, "timestamp": time_ms, "step": step})
                    })
                    .collect();
                for chunk in metrics.chunks(METRICS_PER_BATCH) {
                    self.post(
                        "runs/log-batch",
                        &json!({"run_id": run.id, "metrics": chunk}),
                    )
                    .await?;
                }
                Ok(())
            }
            Record::Artifact { name, bytes, .. } => {
                let Some(path) = &run.artifact_path else {
                    return Err(SinkError::Rejected(format!(
                        "the MLflow server keeps run {} 's artifacts where Cohort cannot \
                         upload them (start it with --serve-artifacts)",
                        run.id
                    )));
                };
                let url = format!(
                    "{}/api/2.0/mlflow-artifacts/artifacts/{path}/{}",
                    self.base,
                    url_segment(name)
                );
                let response = self
                    .http
                    .put(url)
                    .timeout(ARTIFACT_TIMEOUT)
                    .body(bytes.to_vec())
                    .send()
                    .await
                    .map_err(unreachable)?;
                answer(response).await.map(drop).map_err(SinkError::from)
            }
            Record::End {
                status, time_ms, ..
            } => self
                .post(
                    "runs/update",
                    &json!({"run_id": run.id, "status": status.as_str(), "end_time": time_ms}),
                )
                .await
                .map(drop),
        }
    }

    /// The server's run for `run`: remembered, found by its key, or created (with its
    /// parameters).
    async fn run(&mut self, run: &RunRef) -> Result<KnownRun, SinkError> {
        if let Some(known) = self.runs.get(&run.key) {
            return Ok(known.clone());
        }
        let experiment = self.experiment(&run.experiment).await?;
        let filter = format!(
            "tags.`{RUN_KEY_TAG}` = '{}'",
            run.key.replace('\\', "\\\\").replace('\'', "\\'")
        );
        let found = self
            .post(
                "runs/search",
                &json!({"experiment_ids": [experiment], "filter": filter, "max_results": 1}),
            )
            .await?;
        let info = match found["runs"].get(0) {
            Some(existing) => existing["info"].clone(),
            None => {
                let created = self
                    .post(
                        "runs/create",
                        &json!({
                            "experiment_id": experiment,
                            "run_name": run.name,
                            "start_time": super::now_ms(),
                            "tags": [
                                {"key": RUN_KEY_TAG, "value": run.key},
                                {"key": "mlflow.source.name", "value": "cohort"},
                            ],
                        }),
                    )
                    .await?;
                created["run"]["info"].clone()
            }
        };
        let id = info["run_id"]
            .as_str()
            .ok_or_else(|| {
                SinkError::Rejected(format!("MLflow answered a run without id: {info}"))
            })?
            .to_string();
        let params: Vec<Value> = run
            .params
            .iter()
            .map(|(key, value)| json!({"key": key, "value": value}))
            .collect();
        for chunk in params.chunks(PARAMS_PER_BATCH) {
            match self
                .post("runs/log-batch", &json!({"run_id": id, "params": chunk}))
                .await
            {
                Ok(_) => {}
                // Parameters MLflow will not take (one changed since an earlier run of
                // the same key, say) must not keep the metrics out.
                Err(SinkError::Rejected(why)) => {
                    tracing::warn!(run = %run.key, error = %why, "MLflow refused the run's parameters");
                }
                Err(e) => return Err(e),
            }
        }
        let known = KnownRun {
            id,
            artifact_path: info["artifact_uri"].as_str().and_then(proxied_path),
        };
        self.runs.insert(run.key.clone(), known.clone());
        Ok(known)
    }

    /// The id of the experiment named `name`, created when missing.
    async fn experiment(&self, name: &str) -> Result<String, SinkError> {
        let url = format!(
            "{}/api/2.0/mlflow/experiments/get-by-name?experiment_name={}",
            self.base,
            url_segment(name)
        );
        let response = self.http.get(url).send().await.map_err(unreachable)?;
        let found = match answer(response).await {
            Ok(body) => body["experiment"]["experiment_id"]
                .as_str()
                .map(str::to_string),
            Err(Missing) => None,
            Err(other) => return Err(other.into()),
        };
        if let Some(id) = found {
            return Ok(id);
        }
        match self
            .post("experiments/create", &json!({"name": name}))
            .await
        {
            Ok(body) => body["experiment_id"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| SinkError::Rejected(format!("MLflow answered {body}"))),
            // Another replica created it in between.
            Err(SinkError::Rejected(why)) if why.contains("RESOURCE_ALREADY_EXISTS") => {
                Err(SinkError::Transient(why))
            }
            Err(e) => Err(e),
        }
    }

    async fn post(&self, method: &str, body: &Value) -> Result<Value, SinkError> {
        let url = format!("{}/api/2.0/mlflow/{method}", self.base);
        let response = self
            .http
            .post(url)
            .json(body)
            .send()
            .await
            .map_err(unreachable)?;
        answer(response).await.map_err(SinkError::from)
    }
}

/// What an answer other than success meant.
#[derive(Debug)]
enum Refusal {
    /// `RESOURCE_DOES_NOT_EXIST`.
    Missing,
    /// Anything else.
    Failed(SinkError),
}
use Refusal::Missing;

impl From<Refusal> for SinkError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Missing => SinkError::Rejected("RESOURCE_DOES_NOT_EXIST".into()),
            Refusal::Failed(e) => e,
        }
    }
}

/// The body of a successful answer; a server error or overload is worth retrying, a
/// refusal of the request is not.
async fn answer(response: reqwest::Response) -> Result<Value, Refusal> {
    let status = response.status();
    let text = response
        .text()
        .await
        .map_err(|e| Refusal::Failed(unreachable(e)))?;
    if status.is_success() {
        return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
    }
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let code = body["error_code"].as_str().unwrap_or_default();
    if code == "RESOURCE_DOES_NOT_EXIST" {
        return Err(Missing);
    }
    let message: String = body["message"]
        .as_str()
        .unwrap_or(&text)
        .chars()
        .take(300)
        .collect();
    let why = format!("MLflow answered {status} {code}: {message}");
    Err(Refusal::Failed(
        if status.is_server_error() || status.as_u16() == 429 {
            SinkError::Transient(why)
        } else {
            SinkError::Rejected(why)
        },
    ))
}

fn unreachable(e: reqwest::Error) -> SinkError {
    SinkError::Transient(format!("MLflow unreachable: {e}"))
}

/// The artifact proxy's path for an `mlflow-artifacts:` URI (`mlflow-artifacts:/1/<run>/
/// artifacts`, or with a host, `mlflow-artifacts://host:port/1/...`); `None` for
/// artifacts the server does not proxy (a local path, a bucket).
fn proxied_path(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("mlflow-artifacts:")?;
    let path = match rest.strip_prefix("//") {
        Some(with_host) => &with_host[with_host.find('/')?..],
        None => rest,
    };
    let path = path.trim_matches('/');
    (!path.is_empty()).then(|| path.to_string())
}

/// `name` as one URL path segment.
fn url_segment(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxied_artifact_uris_become_paths_and_others_are_not_uploaded() {
        assert_eq!(
            proxied_path("mlflow-artifacts:/1/abc/artifacts").as_deref(),
            Some("1/abc/artifacts")
        );
        assert_eq!(
            proxied_path("mlflow-artifacts://mlflow:5000/1/abc/artifacts").as_deref(),
            Some("1/abc/artifacts")
        );
        assert_eq!(proxied_path("/srv/mlruns/1/abc/artifacts"), None);
        assert_eq!(proxied_path("s3://bucket/1/abc/artifacts"), None);
    }

    #[test]
    fn artifact_names_are_escaped() {
        assert_eq!(
            url_segment("model round 3.safetensors"),
            "model%20round%203.safetensors"
        );
        assert_eq!(url_segment("../x"), "..%2Fx");
    }

    #[test]
    fn only_http_servers_are_accepted() {
        assert!(MlflowSink::new("http://127.0.0.1:5000/").is_ok());
        assert!(matches!(
            MlflowSink::new("file:///tmp/mlruns"),
            Err(MlflowUriError::Scheme(_))
        ));
    }
}
