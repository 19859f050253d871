//! The whole system end to end: `cohort demo` starts a coordinator over TLS and 10
//! `cohort-edge` processes, each on its own Dirichlet(0.5) partition of digits, and runs
//! 15 rounds of FedAvg with the MLP (also with secure aggregation, on PostgreSQL). On
//! SQLite always, on PostgreSQL when `COHORT_TEST_POSTGRES_URL` is set (each run in a
//! schema of its own).

mod common;

use std::process::Command;

fn run_demo(extra: &[&str]) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["demo", "--clients", "10", "--rounds", "15", "--dir"];
    let dir_arg = dir.path().to_str().unwrap().to_string();
    args.push(&dir_arg);
    args.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(&args)
        .output()
        .expect("cohort demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    let value = last
        .strip_prefix("final_test_accuracy=")
        .unwrap_or_else(|| panic!("last line is `{last}`"));
    value.parse().unwrap()
}

#[test]
fn ten_edge_processes_train_digits_to_ninety_percent_on_sqlite() {
    let accuracy = run_demo(&[]);
    assert!(accuracy >= 0.90, "final test accuracy {accuracy}");
}

#[tokio::test]
async fn ten_edge_processes_train_digits_to_ninety_percent_on_postgres() {
    let Some((pool, schema, scoped)) = common::postgres_schema("cohort_e2e").await else {
        return;
    };
    let accuracy = tokio::task::spawn_blocking(move || run_demo(&["--database-url", &scoped]))
        .await
        .unwrap();
    common::drop_schema(&pool, &schema).await;
    assert!(accuracy >= 0.90, "final test accuracy {accuracy}");
}

/// The same experiment with secure aggregation (SecAgg+) on PostgreSQL: the coordinator
/// sees only masked vectors, and the model learns as well.
#[tokio::test]
async fn ten_edge_processes_train_digits_to_ninety_percent_with_secure_aggregation_on_postgres() {
    let Some((pool, schema, scoped)) = common::postgres_schema("cohort_secure_e2e").await else {
        return;
    };
    let accuracy = tokio::task::spawn_blocking(move || {
        run_demo(&["--database-url", &scoped, "--secure-aggregation"])
    })
    .await
    .unwrap();
    common::drop_schema(&pool, &schema).await;
    assert!(accuracy >= 0.90, "final test accuracy {accuracy}");
}
