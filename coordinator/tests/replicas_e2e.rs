//! Two `cohort serve` processes on one PostgreSQL and one data directory, each with its
//! own round driver and job worker, run one experiment to the end with edge agents
//! talking to both. Neither runs a job the other ran, no round is opened or closed twice,
//! and every round publishes exactly one model.

mod common;

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use cohort_coordinator::store::{JobState, ParticipationState, RoundStage, Store};
use common::{admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_coordinators_on_one_postgres_never_run_the_same_job() {
    let Some((pg, schema, url)) = common::postgres_schema("cohort_replicas").await else {
        return;
    };
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    // The first one creates the dev CA and applies the migrations; the second, started
    // once the first answers, shares both.
    let ports = [free_port(), free_port()];
    let bases: Vec<String> = ports
        .iter()
        .map(|p| format!("https://127.0.0.1:{p}"))
        .collect();
    let mut first = spawn_serve(&data_dir, ports[0], Some(&url));
    let http = wait_healthy(&bases[0], &ca).await;
    let mut second = spawn_serve(&data_dir, ports[1], Some(&url));
    wait_healthy(&bases[1], &ca).await;

    let rounds = 10;
    let exp = admin(
        &http,
        &bases[0],
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "replicas", "features": 4, "classes": 2, "model": "logreg",
            "rounds": rounds, "clients_per_round": 4, "min_participants": 4,
            "collect_deadline_seconds": 60
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    // Started through the second: both see one database.
    admin(
        &http,
        &bases[1],
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let mut agents = Vec::new();
    for i in 0..4u64 {
        let base = &bases[(i % 2) as usize];
        let issued = admin(
            &http,
            base,
            Method::POST,
            "/enrolment-tokens",
            Some(serde_json::json!({"label": format!("site-{i}")})),
        )
        .await;
        let config = cohort_edge::agent::AgentConfig {
            coordinator: base.clone(),
            insecure_http: false,
            ca_pem: Some(std::fs::read(&ca).unwrap()),
            identity_pem: None,
            enrol_token: Some(issued["token"].as_str().unwrap().to_string()),
            trainer: std::sync::Arc::new(cohort_edge::trainer::BuiltInTrainer::new(
                common::blob_data(120, i as f32 * 0.1),
            )),
            state_dir: dir.path().join(format!("agent-{i}")),
            idle_exit: Some(Duration::from_secs(6)),
            seed: i,
            slowdown: std::time::Duration::ZERO,
            floors: cohort_aggregation::secagg::ClientFloors::default(),
            rules: Default::default(),
            local_dp: None,
        };
        agents.push(tokio::spawn(cohort_edge::agent::run_agent(config)));
    }
    common::wait_finished(&http, &bases[0], &id, Duration::from_secs(180)).await;
    for agent in agents {
        tokio::time::timeout(Duration::from_secs(60), agent)
            .await
            .expect("agents finish")
            .unwrap()
            .expect("agents succeed");
    }
    for server in [&mut first, &mut second] {
        server.kill().unwrap();
        server.wait().unwrap();
    }

    let options = sqlx::postgres::PgConnectOptions::from_str(
        &std::env::var("COHORT_TEST_POSTGRES_URL").unwrap(),
    )
    .unwrap()
    .options([("search_path", schema.as_str())]);
    let store = Store::connect_postgres(options).await.unwrap();
    let exp_id = uuid::Uuid::parse_str(&id).unwrap();
    let all_rounds = store.rounds(exp_id).await.unwrap();
    let published: Vec<_> = all_rounds
        .iter()
        .filter(|r| r.stage == RoundStage::Published)
        .collect();
    assert_eq!(published.len(), rounds, "{all_rounds:?}");
    // One aggregation job per published round, claimed once and finished once.
    let jobs = store.jobs(exp_id).await.unwrap();
    assert_eq!(jobs.len(), published.len(), "{jobs:?}");
    for job in &jobs {
        assert_eq!((job.state, job.attempts), (JobState::Done, 1), "{job:?}");
    }
    let audit = store.audit_log(10_000).await.unwrap();
    let mut done_by: HashMap<String, usize> = HashMap::new();
    let mut finished = HashMap::<String, usize>::new();
    for entry in audit.iter().filter(|e| e.action == "job.done") {
        *done_by.entry(entry.actor.clone()).or_default() += 1;
        *finished.entry(entry.detail.clone()).or_default() += 1;
    }
    assert_eq!(finished.len(), jobs.len(), "{finished:?}");
    assert!(finished.values().all(|&n| n == 1), "{finished:?}");
    eprintln!("jobs finished per coordinator: {done_by:?}");
    // Each round attempt was opened once and closed once, by whichever driver got there
    // first.
    for action in ["round.open", "round.close"] {
        let mut seen = HashMap::<String, usize>::new();
        for entry in audit.iter().filter(|e| e.action == action) {
            let attempt: String = entry.detail.split(':').next().unwrap().to_string();
            *seen.entry(attempt).or_default() += 1;
        }
        assert_eq!(seen.len(), all_rounds.len(), "{action}: {seen:?}");
        assert!(seen.values().all(|&n| n == 1), "{action}: {seen:?}");
    }
    // Every upload is counted once, in the round that published it.
    for round in &published {
        let parts = store
            .participations(exp_id, round.round, round.attempt)
            .await
            .unwrap();
        let uploaded = parts
            .iter()
            .filter(|p| p.state == ParticipationState::Uploaded)
            .count() as i64;
        assert_eq!(uploaded, round.reported);
        assert_eq!(
            store
                .uploads(exp_id, round.round, round.attempt)
                .await
                .unwrap()
                .len() as i64,
            round.reported
        );
    }
    store.close().await;
    common::drop_schema(&pg, &schema).await;
}
