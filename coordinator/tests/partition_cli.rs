//! `cohort partition` writes client partitions that `cohort-edge --data` can read, and
//! that together hold the whole training split exactly once.

use std::process::Command;

#[test]
fn partitions_cover_the_training_split_and_load_as_edge_data() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["partition", "--clients", "3", "--seed", "4", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 4, "{stdout}");
    let mut rows = 0;
    for i in 0..3 {
        let part = cohort_edge::data::load_csv(&dir.path().join(format!("client-{i}.csv")))
            .expect("a partition is valid edge data");
        assert_eq!(part.num_features(), 64);
        assert!(!part.is_empty());
        rows += part.len();
    }
    let test = cohort_edge::data::load_csv(&dir.path().join("test.csv")).unwrap();
    let all = cohort_edge::data::digits();
    assert_eq!(rows + test.len(), all.len());
}

#[test]
fn partition_refuses_zero_clients_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["partition", "--clients", "0", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: "));
}
