//! The edge client embedded in a C program through its C API (`tests/c/edge_app.c`,
//! compiled here against the library and its generated header), alongside two `cohort
//! edge` processes, against a real `cohort serve` over TLS.
//!
//! What it protects:
//! - the C API enrols, serves three rounds with the app's own training callback and
//!   reports its status; every round needs the app's upload (three clients, quorum
//!   three), so a round only publishes if the app's update arrived;
//! - a bad configuration gets a code and a message, not a crash;
//! - under valgrind (`--leak-check=full`) the program leaks nothing definitely. CI sets
//!   `COHORT_REQUIRE_VALGRIND=1`; elsewhere the valgrind run is skipped with a message
//!   when valgrind is not installed. A C compiler (`cc`) is needed either way.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use cohort_coordinator::demo::write_digits_partitions;
use cohort_edge::partition::PartitionScheme;
use common::{admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_c_app_completes_rounds_through_the_c_api() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let app = common::compile_c_app(dir.path(), "edge_app");
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    let http = wait_healthy(&base, &ca).await;
    let (csvs, _) =
        write_digits_partitions(&dir.path().join("sites"), 3, &PartitionScheme::Iid, 0).unwrap();
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "c api", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 3, "clients_per_round": 3, "min_participants": 3,
            "collect_deadline_seconds": 240, "max_round_attempts": 1,
            "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05}
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let mut edges = Vec::new();
    for (site, csv) in csvs.iter().take(2).enumerate() {
        let issued = common::issue_token(&http, &base, &format!("edge-{site}")).await;
        let token = &issued;
        edges.push(
            common::edge_command(site, &base, &ca, csv, dir.path(), token, 15)
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
    }
    let issued = common::issue_token(&http, &base, "c-app").await;
    let token = issued;
    let mut command = if common::valgrind_available() {
        let mut c = common::valgrind_command(&dir.path().join("valgrind.log"));
        c.arg(&app);
        c
    } else {
        eprintln!("valgrind is not installed: the leak check is skipped");
        Command::new(&app)
    };
    command
        .arg(&base)
        .arg(&ca)
        .arg(&token)
        .arg(dir.path().join("c-app-state"))
        .arg(&csvs[2])
        // The partitions are standardised already: the app keeps the features as they are.
        .arg("1.0")
        .arg("20")
        .env("LD_LIBRARY_PATH", dir.path().join("lib"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let app_run = tokio::task::spawn_blocking(move || command.output().unwrap());
    // The experiment starts once all three clients are waiting.
    let start = std::time::Instant::now();
    loop {
        let clients = admin(&http, &base, Method::GET, "/clients", None).await;
        if clients.as_array().unwrap().len() == 3 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "clients enrol");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    common::wait_finished(&http, &base, &id, Duration::from_secs(600)).await;
    let rounds = common::rounds(&http, &base, &id).await;
    assert_eq!(rounds.len(), 3, "{rounds:#?}");
    for r in &rounds {
        assert_eq!(r["stage"], "published");
        assert_eq!(r["reported"], 3, "the app's update is in every round: {r}");
    }
    let output = tokio::time::timeout(Duration::from_secs(300), app_run)
        .await
        .expect("the app exits")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let valgrind = std::fs::read_to_string(dir.path().join("valgrind.log")).unwrap_or_default();
    assert!(
        output.status.success(),
        "app failed ({:?}):\n{stdout}\n{stderr}\n{valgrind}",
        output.status
    );
    assert!(stdout.contains("enrolled=1 uploads=3 failed=0"), "{stdout}");
    if !valgrind.is_empty() {
        assert!(
            valgrind.contains("definitely lost: 0 bytes")
                || valgrind.contains("no leaks are possible"),
            "{valgrind}"
        );
        eprintln!(
            "valgrind: {}",
            valgrind
                .lines()
                .filter(|l| l.contains("lost:")
                    || l.contains("ERROR SUMMARY")
                    || l.contains("in use at exit"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    for mut edge in edges {
        let _ = edge.wait();
    }
    server.kill().unwrap();
    server.wait().unwrap();
}
