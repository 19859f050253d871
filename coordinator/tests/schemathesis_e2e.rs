//! Hostile input against the served API description: schemathesis (PyPI) generates
//! requests from `/api/v1/openapi.json` for every operation, valid and broken, once
//! with the admin token and once with a client's credential, against a real `cohort
//! serve` over TLS; then the client's routes under an experiment once more with the
//! path naming a real running round the client is in. No answer may be a 5xx, and none
//! may contradict the document (undocumented status, content type or body shape,
//! missing auth that still succeeds).
//!
//! Left out: `positive_data_acceptance` (ST202): a schema-valid request the server
//! refuses. Many refusals are rules the schema cannot state (an id that does not exist,
//! a model file that is not safetensors, cross-field limits of an experiment), so it
//! fails without a bug.
//!
//! Needs the `schemathesis` command; skipped without it, unless
//! `COHORT_REQUIRE_SCHEMATHESIS=1` (CI).

mod common;

use std::process::{Command, Stdio};

use common::{ADMIN, admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

fn schemathesis_available() -> bool {
    let found = Command::new("schemathesis")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("COHORT_REQUIRE_SCHEMATHESIS").is_none(),
            "COHORT_REQUIRE_SCHEMATHESIS is set but schemathesis is not installed"
        );
        eprintln!("skipped: schemathesis is not installed (pip install schemathesis)");
    }
    found
}

/// Runs schemathesis with `bearer` on the operations whose path matches `paths`, with
/// the settings file `config` if any; its output, and whether it passed.
fn run(
    base: &str,
    ca: &std::path::Path,
    bearer: &str,
    paths: &str,
    dir: &std::path::Path,
    config: Option<&std::path::Path>,
) -> (bool, String) {
    let mut command = Command::new("schemathesis");
    if let Some(config) = config {
        command.arg("--config-file").arg(config);
    }
    let out = command
        .arg("run")
        .arg(format!("{base}/api/v1/openapi.json"))
        .arg("--tls-verify")
        .arg(ca)
        .arg("-H")
        .arg(format!("Authorization: Bearer {bearer}"))
        .args(["--include-path-regex", paths])
        .args([
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
        ])
        // One worker: with two, schemathesis 4.32's coverage phase failed about one run
        // in three, inside hypothesis ("AST constructor recursion depth mismatch": its
        // lambda descriptions are not thread-safe) or, once, with a TLS EOF on one
        // request whose cause was not pinned down. Six runs with one worker passed.
        .args(["--max-examples", "25", "--workers", "1", "--seed", "1"])
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("schemathesis runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// On the embedded default, SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemathesis_finds_no_5xx_and_nothing_the_document_does_not_say() {
    if !schemathesis_available() {
        return;
    }
    fuzz(None).await;
}

/// On PostgreSQL, whose types refuse what SQLite stores (a NUL in text, an integer past
/// `bigint`): the same runs must find no 5xx there either.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemathesis_finds_no_5xx_on_postgres() {
    if !schemathesis_available() {
        return;
    }
    let Some((pool, schema, url)) = common::postgres_schema("schemathesis").await else {
        return;
    };
    fuzz(Some(&url)).await;
    common::drop_schema(&pool, &schema).await;
}

/// The generated test cases schemathesis reports in its summary ("N generated").
fn cases(text: &str) -> u64 {
    text.lines()
        .filter_map(|line| {
            let at = line.find(" generated")?;
            line[..at]
                .rsplit(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Runs schemathesis as admin, as a client and as a client in a real round against a
/// fresh `cohort serve` on `database_url` (SQLite without one).
async fn fuzz(database_url: Option<&str>) {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    // Killed however the test ends: a failed run left its coordinator running.
    let server = common::KillOnDrop(spawn_serve(&data_dir, port, database_url));
    let http = wait_healthy(&base, &ca).await;
    // Something to find: an experiment, a client and its credential.
    let experiment = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "fuzzed", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 2, "clients_per_round": 1, "min_participants": 1
        })),
    )
    .await;
    let issued = common::issue_token(&http, &base, "fuzzer").await;
    let enrolled: serde_json::Value = http
        .post(format!("{base}/api/v1/clients/enrol"))
        .json(&serde_json::json!({ "token": issued }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let credential = format!(
        "{}.{}",
        enrolled["client_id"].as_str().unwrap(),
        enrolled["secret"].as_str().unwrap()
    );
    // ... and a round the client is in. With generated path parameters every route
    // under an experiment's round answers 404 before its own logic runs, so a second
    // client pass names this real experiment, round and attempt (schemathesis still
    // generates the queries and bodies).
    let id = experiment["id"].as_str().unwrap().to_string();
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let mut task = serde_json::Value::Null;
    for _ in 0..20 {
        let reply: serde_json::Value = http
            .post(format!("{base}/api/v1/clients/checkin"))
            .bearer_auth(&credential)
            .json(&serde_json::json!({ "wait_seconds": 3 }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if !reply["task"].is_null() {
            task = reply["task"].clone();
            break;
        }
    }
    assert!(!task.is_null(), "the client was never handed a task");
    let config = dir.path().join("real-round.toml");
    std::fs::write(
        &config,
        format!(
            "[parameters]\n\"path.id\" = \"{id}\"\n\"path.round\" = {}\n\"path.attempt\" = {}\n",
            task["round"], task["attempt"]
        ),
    )
    .unwrap();
    let base_for = base.clone();
    let ca_for = ca.clone();
    let work = dir.path().to_path_buf();
    let results = tokio::task::spawn_blocking(move || {
        [
            // The admin's run goes last: it revokes clients (ours among them), after
            // which every client route rightly answers 403 and tests nothing else.
            (
                "client in a real round",
                run(
                    &base_for,
                    &ca_for,
                    &credential,
                    "^/api/v1/clients/experiments/",
                    &work,
                    Some(&config),
                ),
            ),
            (
                "client",
                run(
                    &base_for,
                    &ca_for,
                    &credential,
                    "^/api/v1/clients",
                    &work,
                    None,
                ),
            ),
            (
                "admin",
                run(
                    &base_for,
                    &ca_for,
                    ADMIN,
                    "^/api/v1/(admin|health|openapi)",
                    &work,
                    None,
                ),
            ),
        ]
    })
    .await
    .unwrap();
    for (who, (ok, text)) in &results {
        let tail: String = text
            .lines()
            .rev()
            .take(80)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        let backend = if database_url.is_some() {
            "PostgreSQL"
        } else {
            "SQLite"
        };
        eprintln!(
            "schemathesis on {backend} as {who}: {} test cases\n{tail}",
            cases(text)
        );
        assert!(*ok, "schemathesis found failures as {who}:\n{text}");
        assert!(
            text.contains("generated"),
            "schemathesis ran no test cases as {who}:\n{text}"
        );
    }
    drop(server);
}
