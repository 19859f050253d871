//! The whole system end to end: `cohort demo` starts a coordinator over TLS and 10
//! `cohort-edge` processes, each on its own Dirichlet(0.5) partition of digits, and runs
//! 15 rounds of FedAvg with the MLP. On SQLite always, on PostgreSQL when
//! `COHORT_TEST_POSTGRES_URL` is set (each run in a schema of its own).

use std::process::Command;
use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

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
    let Ok(url) = std::env::var("COHORT_TEST_POSTGRES_URL") else {
        eprintln!("COHORT_TEST_POSTGRES_URL is not set: PostgreSQL run skipped");
        return;
    };
    let schema = format!("cohort_e2e_{}", uuid::Uuid::new_v4().simple());
    let admin = PgConnectOptions::from_str(&url).unwrap();
    let pool = sqlx::PgPool::connect_with(admin.clone()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&pool)
        .await
        .unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    let scoped = format!("{url}{sep}options=-csearch_path%3D{schema}");
    let accuracy = tokio::task::spawn_blocking(move || run_demo(&["--database-url", &scoped]))
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}\" CASCADE"
    )))
    .execute(&pool)
    .await
    .unwrap();
    assert!(accuracy >= 0.90, "final test accuracy {accuracy}");
}
