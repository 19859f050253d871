//! Secrets never reach a log or the database in the clear. A real `cohort serve` and two
//! real `cohort edge` processes, all logging at `debug` (what an operator turns on to
//! chase a problem), run a secure experiment to the end; along the way the admin API is
//! called with the right token and with a near miss, clients present wrong credentials,
//! and an enrolment token is used twice. Afterwards no log line of any process, and no
//! byte of the SQLite database (WAL included), holds the admin token, an enrolment
//! token, a client secret or a refused token.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use cohort_coordinator::demo::write_digits_partitions;
use cohort_edge::partition::PartitionScheme;
use common::{ADMIN, admin, free_port, wait_healthy};
use reqwest::Method;

/// Every file under `dir`, recursively, with its bytes.
fn files(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(bytes) = std::fs::read(&path) {
                out.push((path, bytes));
            }
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_secret_reaches_a_log_or_the_database() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["serve", "--dev-tls", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(&data_dir)
        .env("COHORT_ADMIN_TOKEN", ADMIN)
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(logs.join("serve.out")).unwrap())
        .stderr(std::fs::File::create(logs.join("serve.err")).unwrap())
        .spawn()
        .unwrap();
    let http = wait_healthy(&base, &ca).await;

    // A near miss of the admin token, refused, must not be echoed either.
    let near_miss = format!("{}x", &ADMIN[..ADMIN.len() - 1]);
    let r = http
        .get(format!("{base}/api/v1/admin/experiments"))
        .bearer_auth(&near_miss)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(!r.text().await.unwrap().contains(&near_miss));

    let (csvs, _) =
        write_digits_partitions(&dir.path().join("sites"), 3, &PartitionScheme::Iid, 0).unwrap();
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "secrets", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 2, "clients_per_round": 3, "min_participants": 3,
            "collect_deadline_seconds": 60,
            "train": {"local_epochs": 1},
            "secure_aggregation": {
                "advertise_seconds": 20, "share_seconds": 20, "unmask_seconds": 20
            }
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let mut secrets = vec![ADMIN.to_string(), near_miss];
    let mut edges = Vec::new();
    for (site, csv) in csvs.iter().enumerate() {
        let issued = common::issue_token(&http, &base, &format!("site-{site}")).await;
        let token = issued;
        edges.push(
            common::edge_command(site, &base, &ca, csv, dir.path(), &token, 10)
                .env("RUST_LOG", "debug")
                .stdout(std::fs::File::create(logs.join(format!("edge-{site}.out"))).unwrap())
                .stderr(std::fs::File::create(logs.join(format!("edge-{site}.err"))).unwrap())
                .spawn()
                .unwrap(),
        );
        secrets.push(token);
    }
    let start = std::time::Instant::now();
    loop {
        let clients = admin(&http, &base, Method::GET, "/clients", None).await;
        if clients.as_array().unwrap().len() == 3 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{clients}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    common::wait_finished(&http, &base, &id, Duration::from_secs(300)).await;
    for mut edge in edges {
        let status = edge.wait().unwrap();
        assert!(status.success());
    }

    let mut client_ids = Vec::new();
    // The clients' credentials, and wrong ones built from them: a used enrolment token
    // again, a right id with a wrong secret.
    for site in 0..3 {
        let text = std::fs::read_to_string(
            dir.path()
                .join(format!("edge-state-{site}/credential.json")),
        )
        .unwrap();
        let credential: serde_json::Value = serde_json::from_str(&text).unwrap();
        let client_id = credential["client_id"].as_str().unwrap();
        let secret = credential["secret"].as_str().unwrap().to_string();
        assert!(secret.len() >= 16, "a real secret: {secret}");
        let wrong = format!("{}{}", &secret[..secret.len() - 2], "zz");
        let r = http
            .post(format!("{base}/api/v1/clients/checkin"))
            .bearer_auth(format!("{client_id}.{wrong}"))
            .json(&serde_json::json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        secrets.push(secret);
        secrets.push(wrong);
        client_ids.push(client_id.to_string());
    }
    let reused = http
        .post(format!("{base}/api/v1/clients/enrol"))
        .json(&serde_json::json!({ "token": secrets[2] }))
        .send()
        .await
        .unwrap();
    assert!(reused.status().is_client_error(), "{}", reused.status());

    server.kill().unwrap();
    server.wait().unwrap();

    let logged = files(&logs);
    assert!(
        logged
            .iter()
            .any(|(p, b)| p.ends_with("serve.err") && contains(b, "DEBUG")),
        "the coordinator logged at debug level"
    );
    let stored: Vec<_> = files(&data_dir)
        .into_iter()
        .filter(|(p, _)| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("cohort.db"))
        })
        .collect();
    assert!(!stored.is_empty(), "the SQLite files are read");
    // The scan sees what the processes did: the clients' public ids are logged and
    // stored, their secrets must not be.
    for id in &client_ids {
        assert!(
            logged.iter().any(|(_, b)| contains(b, id)),
            "client {id} in a log"
        );
        assert!(
            stored.iter().any(|(_, b)| contains(b, id)),
            "client {id} stored"
        );
    }
    for secret in &secrets {
        for (path, bytes) in logged.iter().chain(&stored) {
            assert!(
                !contains(bytes, secret),
                "a secret ({}...) is in {}",
                &secret[..6],
                path.display()
            );
        }
    }
}
