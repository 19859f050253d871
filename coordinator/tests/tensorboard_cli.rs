//! `cohort simulate --tensorboard DIR` read back by TensorBoard's own reader (the
//! `tensorboard` PyPI package's `EventAccumulator`), as a user's TensorBoard reads it:
//! every round's metrics under their tags, at their round, with the values of
//! `metrics.jsonl`; and the run's settings in the text tab.
//!
//! Needs `tensorboard` for `python3`; skipped without it, unless
//! `COHORT_REQUIRE_TENSORBOARD=1` (CI).

use std::process::Command;

fn tensorboard_available() -> bool {
    let found = Command::new("python3")
        .args([
            "-c",
            "import tensorboard.backend.event_processing.event_accumulator",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("COHORT_REQUIRE_TENSORBOARD").is_none(),
            "COHORT_REQUIRE_TENSORBOARD is set but tensorboard is not installed"
        );
        eprintln!("skipped: tensorboard is not installed (pip install tensorboard)");
    }
    found
}

/// Prints, as JSON, every scalar tag's `(step, value)` points and the text summaries'
/// tags, for each run directory under the given directory.
const READ: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {}, "tensors": tags.get("tensors", [])}
for tag in tags["scalars"]:
    out["scalars"][tag] = [[e.step, e.value] for e in acc.Scalars(tag)]
if "settings" in out["tensors"]:
    out["settings"] = acc.Tensors("settings")[0].tensor_proto.string_val[0].decode()
print(json.dumps(out))
"#;

#[test]
fn tensorboard_reads_every_rounds_metrics() {
    if !tensorboard_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let board = tmp.path().join("board");
    let status = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "simulate",
            "--clients",
            "10",
            "--rounds",
            "4",
            "--seed",
            "3",
        ])
        .arg("--out")
        .arg(&out)
        .arg("--tensorboard")
        .arg(&board)
        .status()
        .unwrap();
    assert!(status.success());
    let read = Command::new("python3")
        .args(["-c", READ])
        .arg(board.join("fedavg"))
        .output()
        .unwrap();
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4);
    for (tag, field) in [
        ("accuracy/test", "test_accuracy"),
        ("loss/test", "test_loss"),
        ("loss/train", "train_loss"),
        ("clients/participants", "participants"),
        ("bytes/up", "bytes_up"),
    ] {
        let points = got["scalars"][tag]
            .as_array()
            .unwrap_or_else(|| panic!("no {tag} in {got}"));
        assert_eq!(points.len(), 4, "{tag}: {points:?}");
        for (point, row) in points.iter().zip(&rows) {
            assert_eq!(point[0], row["round"], "{tag}");
            let want = row[field].as_f64().unwrap();
            let value = point[1].as_f64().unwrap();
            assert!(
                (value - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{tag} round {}: {value} against {want}",
                row["round"]
            );
        }
    }
    let settings = got["settings"].as_str().unwrap();
    assert!(settings.contains("rounds = 4"), "{settings}");
}
