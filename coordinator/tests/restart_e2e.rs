//! A coordinator killed with SIGKILL in the middle of an experiment and started again on
//! the same data directory finishes every round, and loses no acknowledged upload.

mod common;

use std::time::{Duration, Instant};

use common::{admin, free_port, spawn_serve, wait_healthy};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_during_a_round_loses_no_acknowledged_upload() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    let rounds = 8;
    let exp = admin(
        &http,
        &base,
        reqwest::Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "restart", "features": 4, "classes": 2, "model": "logreg", "rounds": rounds,
            "clients_per_round": 3, "min_participants": 3, "collect_deadline_seconds": 60,
            "train": {"local_epochs": 20}
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    admin(
        &http,
        &base,
        reqwest::Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let mut agents = Vec::new();
    for i in 0..3u64 {
        let issued = admin(
            &http,
            &base,
            reqwest::Method::POST,
            "/enrolment-tokens",
            Some(serde_json::json!({"label": format!("a{i}")})),
        )
        .await;
        let config = cohort_edge::agent::AgentConfig {
            coordinator: base.clone(),
            ca_pem: Some(std::fs::read(&ca).unwrap()),
            enrol_token: Some(issued["token"].as_str().unwrap().to_string()),
            data: common::blob_data(200, i as f32 * 0.1),
            state_dir: dir.path().join(format!("agent-{i}")),
            idle_exit: Some(Duration::from_secs(8)),
            seed: i,
        };
        agents.push(tokio::spawn(cohort_edge::agent::run_agent(config)));
    }

    // Kill the coordinator once a few rounds are done, mid-experiment.
    let start = Instant::now();
    loop {
        let rs = admin(
            &http,
            &base,
            reqwest::Method::GET,
            &format!("/experiments/{id}/rounds"),
            None,
        )
        .await;
        if rs.as_array().unwrap().len() >= 3 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "rounds did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.kill().unwrap(); // SIGKILL on Unix
    server.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;

    let mut reports = Vec::new();
    for agent in agents {
        let report = tokio::time::timeout(Duration::from_secs(120), agent)
            .await
            .expect("agents finish")
            .unwrap()
            .expect("agents survive the restart");
        reports.push(report);
    }
    let exp = admin(
        &http,
        &base,
        reqwest::Method::GET,
        &format!("/experiments/{id}"),
        None,
    )
    .await;
    assert_eq!(exp["state"], "finished");
    let rs = admin(
        &http,
        &base,
        reqwest::Method::GET,
        &format!("/experiments/{id}/rounds"),
        None,
    )
    .await;
    let published: Vec<&serde_json::Value> = rs
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["stage"] == "published")
        .collect();
    assert_eq!(published.len(), rounds as usize, "every round completed");
    server.kill().unwrap();
    server.wait().unwrap();
    // Every upload an agent saw acknowledged is an `uploaded` participation row.
    let store = cohort_coordinator::store::Store::connect("sqlite://cohort.db", &data_dir)
        .await
        .unwrap();
    let mut checked = 0;
    for report in &reports {
        let client = report.client_id.unwrap();
        for &(exp, round, attempt) in &report.acknowledged {
            let parts = store.participations(exp, round, attempt).await.unwrap();
            let mine = parts
                .iter()
                .find(|p| p.client_id == client)
                .expect("participation row");
            assert_eq!(
                mine.state,
                cohort_coordinator::store::ParticipationState::Uploaded
            );
            checked += 1;
        }
    }
    assert!(
        checked >= rounds as usize * 3 - 3,
        "only {checked} acknowledged uploads"
    );
}
