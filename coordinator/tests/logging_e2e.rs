//! `cohort serve`'s log as an operator's collector reads it: the real binary with its
//! standard error going to a file.
//!
//! What it protects:
//! - text lines written to a file carry no terminal escape codes (colour is for a
//!   terminal only);
//! - `--log-format json` (or `COHORT_LOG_FORMAT=json`) writes one JSON object a line,
//!   every line, with the level and the message;
//! - a log format that does not exist is refused at start, naming the setting.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs `cohort serve` with `args` and `env`, its standard error in `log`, until it has
/// answered a health check and refused a bad admin token (a warning); then stops it.
async fn serve_and_log(dir: &Path, log: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    cohort_coordinator::server::install_crypto_provider();
    let port = common::free_port();
    let base = format!("https://127.0.0.1:{port}");
    let data_dir = dir.join("coordinator");
    let mut child = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["serve", "--dev-tls", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(&data_dir)
        .args(args)
        .envs(env.iter().copied())
        .env("COHORT_ADMIN_TOKEN", common::ADMIN)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let http = common::wait_healthy(&base, &data_dir.join("tls/ca.pem")).await;
    let refused = http
        .get(format!("{base}/api/v1/admin/experiments"))
        .bearer_auth("not-the-admin-token-not-the-admin-token")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    // Let the log catch up before the process goes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = child.kill();
    let _ = child.wait();
    std::fs::read_to_string(log).unwrap()
}

#[tokio::test]
async fn a_log_file_has_no_escape_codes() {
    let dir = tempfile::tempdir().unwrap();
    let text = serve_and_log(dir.path(), &dir.path().join("serve.log"), &[], &[]).await;
    assert!(text.lines().count() >= 2, "too little logged:\n{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes in a log file:\n{text:?}"
    );
    assert!(text.contains("INFO"), "{text}");
}

#[tokio::test]
async fn json_lines_parse_as_json_by_flag_and_by_environment() {
    let dir = tempfile::tempdir().unwrap();
    for (name, args, env) in [
        ("flag", vec!["--log-format", "json"], vec![]),
        ("env", vec![], vec![("COHORT_LOG_FORMAT", "json")]),
    ] {
        let log = dir.path().join(format!("{name}.log"));
        let text = serve_and_log(&dir.path().join(name), &log, &args, &env).await;
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(lines.len() >= 2, "{name}: too little logged:\n{text}");
        for line in &lines {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {line}"));
            assert!(v["level"].is_string(), "{name}: {line}");
            assert!(v["timestamp"].is_string(), "{name}: {line}");
            assert!(v["fields"].is_object(), "{name}: {line}");
        }
        assert!(
            lines.iter().any(|l| l.contains("\"level\":\"INFO\"")),
            "{name}:\n{text}"
        );
    }
}

#[test]
fn an_unknown_log_format_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    for (args, env, names) in [
        (vec!["--log-format", "yaml"], None, "--log-format"),
        (
            vec![],
            Some(("COHORT_LOG_FORMAT", "yaml")),
            "COHORT_LOG_FORMAT",
        ),
    ] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
        command
            .args(["serve", "--dev-tls", "--data-dir"])
            .arg(dir.path().join("never"))
            .args(&args)
            .env("COHORT_ADMIN_TOKEN", common::ADMIN);
        if let Some((k, v)) = env {
            command.env(k, v);
        }
        let out = command.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(names) && stderr.contains("yaml"),
            "{stderr}"
        );
        assert!(!dir.path().join("never").exists(), "nothing is created");
    }
}
