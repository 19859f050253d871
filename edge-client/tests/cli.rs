//! The `cohort-edge` command line against a coordinator URL: plain HTTP would carry the
//! enrolment token and the client's credential in clear, so it is refused unless asked
//! for with `--insecure-http`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The enrolment token the tests pass: it must never show in an error.
const SECRET: &str = "s3cret-enrolment-value";

/// A fresh scratch folder for one test, holding a tiny training CSV.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cohort-edge-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("data.csv"), "f0,f1,label\n0,1,0\n1,0,1\n").unwrap();
    dir
}

/// How long one run may take: each test's client stops at once, by refusing the URL or
/// at the coordinator's first answer.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// `cohort-edge` against `coordinator`, with `extra` flags; nothing from the test's own
/// environment reaches it. A client still running after [`RUN_LIMIT`] is killed and
/// reported as such (its exit code is then `None`).
fn edge(dir: &std::path::Path, coordinator: &str, extra: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cohort-edge"))
        .env_remove("COHORT_COORDINATOR")
        .env_remove("COHORT_ENROL_TOKEN")
        .args(["--coordinator", coordinator, "--enrol-token", SECRET])
        .arg("--data")
        .arg(dir.join("data.csv"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > RUN_LIMIT {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "cohort-edge {coordinator} {extra:?} still ran after {RUN_LIMIT:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_plain_http_coordinator_is_refused_without_insecure_http() {
    let dir = scratch("refused");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    for url in [
        format!("http://127.0.0.1:{port}"),
        format!("HTTP://localhost:{port}/"),
        format!("http://[::1]:{port}"),
    ] {
        let out = edge(&dir, &url, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        for words in ["plain HTTP", "unencrypted", "https://", "--insecure-http"] {
            assert!(stderr.contains(words), "{url}: `{words}` not in {stderr}");
        }
        assert!(
            !stderr.contains(SECRET),
            "no secret in the message: {stderr}"
        );
    }
    // Nothing was sent: the refusal comes before any connection.
    assert!(listener.accept().is_err(), "no connection was made");
    for url in ["ftp://127.0.0.1:1", "127.0.0.1:8443", "https//x"] {
        let out = edge(&dir, url, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert!(stderr.contains("https://"), "{url}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plain_http_coordinator_is_used_with_insecure_http() {
    let dir = scratch("allowed");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // A coordinator that refuses the enrolment for good, so that the client stops.
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut request_line = String::new();
        reader.read_line(&mut request_line).unwrap();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" || line.is_empty() {
                break;
            }
        }
        let body = r#"{"error":{"code":"forbidden","message":"test coordinator says no"}}"#;
        write!(
            stream,
            "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        request_line
    });
    let out = edge(&dir, &url, &["--insecure-http"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("test coordinator says no"), "{stderr}");
    let request_line = server.join().unwrap();
    assert!(
        request_line.starts_with("POST /api/v1/clients/enrol "),
        "{request_line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--trainer-hash` prints what `--approve-trainer` takes (the script's hash, not the
/// interpreter's), contacting nothing; a value that is not a SHA-256 is refused at start.
#[test]
fn the_trainer_hash_is_printed_and_a_malformed_approval_is_refused() {
    let dir = scratch("trainer-hash");
    let script = dir.join("train.sh");
    std::fs::write(&script, "echo training\n").unwrap();
    let command = format!("sh {}", script.display());
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_cohort-edge"))
            .env_remove("COHORT_COORDINATOR")
            .args([
                "--coordinator",
                "https://127.0.0.1:9",
                "--trainer",
                &command,
            ])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--trainer-hash"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let trainer = cohort_edge::trainer::external::ExternalTrainer::new(
        &command,
        Duration::from_secs(5),
        &dir.join("work"),
    )
    .unwrap();
    assert_eq!(printed, trainer.code_sha256().unwrap());
    assert_eq!(trainer.code_files(), vec![script.clone()]);

    let out = run(&["--approve-trainer", "not-a-hash"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--approve-trainer must be a SHA-256"),
        "{stderr}"
    );
}
