//! Per-client metrics against the privacy a client or an experiment asked for (security
//! review, issue 21, finding 8), end to end: a real `cohort serve` and in-process edge
//! agents (`cohort_edge::agent::run_agent`) whose trainer reports distinctive metrics of
//! its "data" with every task, on an experiment whose model is a file (the only kind
//! whose metrics come from the clients).
//!
//! What it protects:
//! - a client under local differential privacy lets no metric of its data leave: not
//!   the evaluation after training, not the evaluation task of a finished experiment.
//!   The coordinator records only that it withheld them (so it is not asked again), and
//!   the client's ledger is charged for its update alone; a report that withholds and
//!   still carries figures is refused;
//! - in a secure-aggregation experiment no per-client metric travels in the clear: the
//!   clients send none, the coordinator hands out no evaluation task, refuses a
//!   plaintext report (409) and a weight or loss beside a masked input (422), and stores
//!   nothing; the round's mean loss still arrives, inside the masked sum.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cohort_aggregation::{Layout, ModelVector, TensorSpec};
use cohort_coordinator::store::Store;
use cohort_edge::agent::{AgentConfig, AgentReport, run_agent};
use cohort_edge::local_dp::{Ledger, LocalDp};
use cohort_edge::protocol::{CoordinatorClient, Credential, ProtocolError, TaskKind};
use cohort_edge::trainer::{
    ReportedEvaluation, TaskTrainer, TrainerFailure, TrainerJob, TrainerOutput,
};
use common::admin;
use reqwest::Method;

/// The accuracy every trainer here reports: a value no noise or average would land on.
const ACCURACY: f64 = 0.8125;
/// The mean training loss every trainer here reports.
const TRAIN_LOSS: f64 = 0.25;

/// Trains by nudging every weight, and reports metrics of its own data with every task
/// (as the example trainers do: the evaluation of the model it received).
#[derive(Debug)]
struct ReportingTrainer;

impl TaskTrainer for ReportingTrainer {
    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let update = match job.task.kind {
            TaskKind::Train => {
                let values = job.global.values().iter().map(|v| v + 0.01).collect();
                Some(
                    ModelVector::new(job.global.layout().clone(), values)
                        .map_err(|e| TrainerFailure::new(e.to_string()))?,
                )
            }
            TaskKind::Evaluate => None,
        };
        Ok(TrainerOutput {
            update,
            num_examples: 40,
            train_loss: Some(TRAIN_LOSS),
            evaluation: Some(ReportedEvaluation {
                num_examples: 37,
                metrics: BTreeMap::from([
                    ("accuracy".to_string(), ACCURACY),
                    ("loss".to_string(), 0.4375),
                ]),
            }),
        })
    }
}

/// The credential an agent keeps in its state directory.
fn credential(state_dir: &Path) -> Credential {
    serde_json::from_slice(&std::fs::read(state_dir.join("credential.json")).unwrap()).unwrap()
}

use common::Served as Server;

async fn serve(dir: &Path) -> Server {
    common::serve_in(dir).await
}

impl Server {
    async fn admin(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> serde_json::Value {
        admin(&self.http, &self.base, method, path, body).await
    }

    /// Uploads a small safetensors model; its id.
    async fn upload_model(&self) -> String {
        let layout = Layout::new(vec![
            TensorSpec::new("layer.weight", [2, 3]),
            TensorSpec::new("layer.bias", [2]),
        ])
        .unwrap();
        let initial = ModelVector::new(Arc::new(layout), vec![0.5; 8]).unwrap();
        let bytes = cohort_aggregation::model_file::encode(&initial, Default::default());
        let r = self
            .http
            .post(format!("{}/api/v1/admin/models?name=initial", self.base))
            .bearer_auth(common::ADMIN)
            .header("content-type", "application/octet-stream")
            .body(bytes)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "upload: {}", r.text().await.unwrap());
        let file: serde_json::Value = r.json().await.unwrap();
        file["id"].as_str().unwrap().to_string()
    }

    /// A one-round experiment on the uploaded model, with `extra` merged into the spec.
    async fn experiment(&self, clients: usize, extra: serde_json::Value) -> String {
        let model = self.upload_model().await;
        let mut spec = serde_json::json!({
            "name": "metrics", "model": "file", "initial_model": model,
            "rounds": 1, "clients_per_round": clients, "min_participants": clients,
            "collect_deadline_seconds": 60, "max_round_attempts": 1
        });
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let exp = self.admin(Method::POST, "/experiments", Some(spec)).await;
        exp["id"].as_str().unwrap().to_string()
    }

    fn agent(&self, dir: &Path, token: String, local_dp: Option<LocalDp>) -> AgentConfig {
        AgentConfig {
            coordinator: self.base.clone(),
            insecure_http: false,
            ca_pem: Some(self.ca_pem.clone()),
            identity_pem: None,
            enrol_token: Some(token),
            trainer: Arc::new(ReportingTrainer),
            state_dir: dir.to_path_buf(),
            idle_exit: Some(Duration::from_secs(4)),
            seed: 1,
            local_dp,
            slowdown: Duration::ZERO,
            floors: cohort_aggregation::secagg::ClientFloors::default(),
            rules: Default::default(),
        }
    }

    /// Runs `configs` as agents, starts experiment `id` once they have all checked in,
    /// and waits for it to finish and for the agents to go idle and return.
    async fn run(&self, id: &str, configs: Vec<AgentConfig>) -> Vec<AgentReport> {
        let n = configs.len();
        let agents: Vec<_> = configs
            .into_iter()
            .map(|c| tokio::spawn(run_agent(c)))
            .collect();
        common::wait_checked_in(&self.http, &self.base, n, Duration::from_secs(30)).await;
        self.admin(Method::POST, &format!("/experiments/{id}/start"), None)
            .await;
        common::wait_finished(&self.http, &self.base, id, Duration::from_secs(60)).await;
        let mut reports = Vec::new();
        for agent in agents {
            let report = tokio::time::timeout(Duration::from_secs(60), agent)
                .await
                .expect("the agent goes idle and returns")
                .unwrap()
                .expect("the agent runs without error");
            reports.push(report);
        }
        reports
    }

    /// What the coordinator stored of the clients' evaluations, read from its database.
    async fn stored_evaluations(
        &self,
        id: &str,
    ) -> Vec<cohort_coordinator::store::ClientEvaluation> {
        let store = Store::connect("sqlite://cohort.db", &self.data_dir)
            .await
            .unwrap();
        let rows = store.client_evaluations(id.parse().unwrap()).await.unwrap();
        store.close().await;
        rows
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_local_dp_client_sends_no_metric_of_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path()).await;
    let id = server.experiment(1, serde_json::json!({})).await;
    let token = common::issue_token(&server.http, &server.base, "local-dp").await;
    let state_dir = dir.path().join("agent");
    let dp = LocalDp {
        noise_multiplier: 1.0,
        clip: 1.0,
        delta: 1e-5,
        epsilon_budget: None,
    };
    let reports = server
        .run(&id, vec![server.agent(&state_dir, token, Some(dp))])
        .await;
    assert_eq!(reports[0].uploads, 1, "{:?}", reports[0]);

    // The evaluation after training (of version 0) and the evaluation task of the
    // finished experiment's final model (version 1): both withheld, neither carrying a
    // number of the client's data.
    let stored = server.stored_evaluations(&id).await;
    assert!(
        stored
            .iter()
            .all(|e| e.metrics.is_empty() && e.num_examples == 0),
        "a local-DP client's raw metrics were stored: {stored:?}"
    );
    let versions: Vec<i64> = stored.iter().map(|e| e.model_version).collect();
    assert_eq!(versions, [0, 1], "{stored:?}");
    assert!(stored.iter().all(|e| e.withheld.is_some()), "{stored:?}");
    assert_eq!(reports[0].evaluations_withheld, 1, "{:?}", reports[0]);

    // The API says why there are no metrics, and shows no number of this client's.
    let shown = server
        .admin(Method::GET, &format!("/experiments/{id}/evaluations"), None)
        .await;
    for version in shown.as_array().unwrap() {
        assert_eq!(version["clients"], 0, "{shown:#}");
        assert_eq!(version["withheld"], 1, "{shown:#}");
        assert_eq!(version["metrics"], serde_json::json!({}), "{shown:#}");
    }

    // Only the update was charged: the withheld evaluations cost no budget.
    let ledger = Ledger::load(&state_dir).unwrap();
    assert_eq!(ledger.noise_multipliers, [1.0], "{ledger:?}");

    // A report that withholds and still carries figures, or neither withholds nor says
    // how many examples it is over, or gives an unknown reason, is refused and stores
    // nothing, even from a client of the experiment.
    let cred = credential(&state_dir);
    for bad in [
        serde_json::json!({"model_version": 1, "withheld": "local_differential_privacy",
                           "metrics": {"accuracy": ACCURACY}}),
        serde_json::json!({"model_version": 1, "withheld": "local_differential_privacy",
                           "num_examples": 37}),
        serde_json::json!({"model_version": 1, "metrics": {"accuracy": ACCURACY}}),
        serde_json::json!({"model_version": 1, "withheld": "shy"}),
    ] {
        let r = server
            .http
            .post(format!(
                "{}/api/v1/clients/experiments/{id}/evaluations",
                server.base
            ))
            .bearer_auth(format!("{}.{}", cred.client_id, cred.secret))
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 422, "{bad}: {}", r.text().await.unwrap());
    }
    assert_eq!(server.stored_evaluations(&id).await, stored);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_secure_experiment_takes_no_plaintext_per_client_metric() {
    const CLIENTS: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path()).await;
    let id = server
        .experiment(
            CLIENTS,
            serde_json::json!({"secure_aggregation": {
                "advertise_seconds": 20, "share_seconds": 20, "unmask_seconds": 20
            }}),
        )
        .await;
    let mut configs = Vec::new();
    for site in 0..CLIENTS {
        let token = common::issue_token(&server.http, &server.base, &format!("site-{site}")).await;
        configs.push(server.agent(&dir.path().join(format!("agent-{site}")), token, None));
    }
    let reports = server.run(&id, configs).await;
    // Nothing per client was stored or shown; the round's loss came masked.
    let stored = server.stored_evaluations(&id).await;
    assert!(
        stored.is_empty(),
        "per-client metrics of a secure round were stored: {stored:?}"
    );
    for report in &reports {
        assert_eq!(report.uploads, 1, "{report:?}");
        assert_eq!(report.evaluations, 0, "no evaluation task: {report:?}");
    }
    let shown = server
        .admin(Method::GET, &format!("/experiments/{id}/evaluations"), None)
        .await;
    assert_eq!(shown, serde_json::json!([]));
    let rounds = common::rounds(&server.http, &server.base, &id).await;
    assert_eq!(rounds.len(), 1, "{rounds:#?}");
    assert!(rounds[0]["secagg"].is_object(), "{rounds:#?}");
    assert!(rounds[0].get("client_evaluation").is_none(), "{rounds:#?}");
    let loss = rounds[0]["train_loss"]
        .as_f64()
        .expect("the masked mean loss");
    assert!((loss - TRAIN_LOSS).abs() < 1e-2, "{loss}");

    // A client of the experiment that sends one anyway is refused, and nothing is
    // stored.
    let client = CoordinatorClient::new(&server.base, Some(&server.ca_pem)).unwrap();
    let cred = credential(&dir.path().join("agent-0"));
    let evaluation = ReportedEvaluation {
        num_examples: 37,
        metrics: BTreeMap::from([("accuracy".to_string(), ACCURACY)]),
    };
    match client
        .report_evaluation(&cred, id.parse().unwrap(), 0, &evaluation)
        .await
    {
        Err(ProtocolError::Refused {
            status: 409,
            code,
            message,
        }) => {
            assert_eq!(code, "evaluations_not_taken");
            assert!(message.contains("secure aggregation"), "{message}");
        }
        other => panic!("a plaintext metric of a secure round was taken: {other:?}"),
    }
    // The weight and loss of a secure round travel masked: beside the masked input they
    // are refused before its body is read.
    let r = server
        .http
        .post(format!(
            "{}/api/v1/clients/experiments/{id}/rounds/1/attempts/1/update?num_samples=40&train_loss=0.25",
            server.base
        ))
        .bearer_auth(format!("{}.{}", cred.client_id, cred.secret))
        .header("content-type", "application/octet-stream")
        .body(vec![0u8; 40])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422, "{}", r.text().await.unwrap());
    assert!(server.stored_evaluations(&id).await.is_empty());
}
