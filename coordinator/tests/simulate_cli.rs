//! `cohort simulate` as a user runs it: a real process, real files, exit codes.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn cohort(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("cohort binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap()
}

/// Runs `cohort simulate ARGS --out OUT` in `cwd`, which must succeed, and returns the
/// parsed `summary.json`.
fn simulate_ok(cwd: &Path, out: &Path, args: &[&str]) -> serde_json::Value {
    let mut full = vec!["simulate"];
    full.extend_from_slice(args);
    full.extend_from_slice(&["--out", out.to_str().unwrap()]);
    let o = cohort(&full, cwd);
    assert!(
        o.status.success(),
        "simulate {args:?} failed: {}",
        stderr(&o)
    );
    read_json(&out.join("summary.json"))
}

/// Runs a small, fast simulation into `dir/name` and returns the output directory.
fn small_run(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let mut args = vec![
        "--dataset",
        "breast-cancer",
        "--model",
        "logreg",
        "--clients",
        "8",
        "--rounds",
        "4",
        "--local-epochs",
        "1",
    ];
    args.extend_from_slice(extra);
    simulate_ok(dir, &out, &args);
    out
}

/// metrics.csv without the `seconds` column, which is wall-clock time.
fn metrics_without_seconds(dir: &Path) -> Vec<String> {
    let text = fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let seconds = header.iter().position(|c| *c == "seconds").unwrap();
    text.lines()
        .map(|l| {
            l.split(',')
                .enumerate()
                .filter(|(i, _)| *i != seconds)
                .map(|(_, v)| v)
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect()
}

#[test]
fn run_writes_metrics_summary_and_plots() {
    let tmp = tempfile::tempdir().unwrap();
    let out = small_run(tmp.path(), "run", &["--seed", "3", "--dropout", "0.25"]);
    let metrics = fs::read_to_string(out.join("metrics.csv")).unwrap();
    let header = metrics.lines().next().unwrap();
    assert!(header.starts_with("round,test_accuracy,test_loss,participants,dropped,seconds"));
    assert_eq!(metrics.lines().count(), 5, "header plus one row per round");
    let jsonl = fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[3]["round"], 4);
    assert_eq!(rows[3]["strategy"], "fedavg");
    assert_eq!(
        rows[3]["dropped"].as_u64().unwrap() + rows[3]["participants"].as_u64().unwrap(),
        rows[3]["selected"].as_u64().unwrap()
    );
    let summary = read_json(&out.join("summary.json"));
    for key in [
        "final_test_accuracy",
        "rounds",
        "updates_per_second",
        "config",
    ] {
        assert!(summary.get(key).is_some(), "summary.json lacks {key}");
    }
    assert_eq!(summary["rounds"], 4);
    assert_eq!(summary["config"]["clients"], 8);
    assert_eq!(summary["config"]["partition"], "dirichlet:0.5");
    assert_eq!(summary["config"]["dropout"], 0.25);
    let acc = summary["final_test_accuracy"].as_f64().unwrap();
    assert!(
        acc > 0.8,
        "logistic regression on breast cancer should learn, got {acc}"
    );
    let png = fs::read(out.join("accuracy.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = fs::read_to_string(out.join("accuracy.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("round"));
    // Nothing but the finished directory is left beside it.
    let names: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec!["run"]);
}

#[test]
fn same_seed_gives_identical_metrics_and_other_seed_differs() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = [
        "--seed",
        "11",
        "--clients-per-round",
        "5",
        "--dropout",
        "0.2",
    ];
    let a = small_run(tmp.path(), "a", &extra);
    let b = small_run(tmp.path(), "b", &extra);
    assert_eq!(metrics_without_seconds(&a), metrics_without_seconds(&b));
    let c = small_run(
        tmp.path(),
        "c",
        &[
            "--seed",
            "12",
            "--clients-per-round",
            "5",
            "--dropout",
            "0.2",
        ],
    );
    assert_ne!(metrics_without_seconds(&a), metrics_without_seconds(&c));
}

#[test]
fn thread_count_does_not_change_results() {
    let tmp = tempfile::tempdir().unwrap();
    let one = small_run(tmp.path(), "one", &["--seed", "5", "--threads", "1"]);
    let two = small_run(tmp.path(), "two", &["--seed", "5", "--threads", "2"]);
    assert_eq!(metrics_without_seconds(&one), metrics_without_seconds(&two));
}

#[test]
fn any_csv_with_a_label_column_works() {
    let tmp = tempfile::tempdir().unwrap();
    // Text labels, the label column first, quoted header names: still a well-formed CSV.
    let mut csv = String::from("label,\"width\",height,depth\n");
    for i in 0..120 {
        let class = ["cat", "dog", "eel"][i % 3];
        let base = (i % 3) as f64 * 3.0;
        csv.push_str(&format!(
            "{class},{},{},{}\n",
            base + (i as f64 * 0.37).sin(),
            base - (i as f64 * 0.11).cos(),
            (i % 7) as f64
        ));
    }
    let path = tmp.path().join("animals.csv");
    fs::write(&path, csv).unwrap();
    let summary = simulate_ok(
        tmp.path(),
        &tmp.path().join("run"),
        &[
            "--dataset",
            path.to_str().unwrap(),
            "--model",
            "mlp:8",
            "--clients",
            "4",
            "--rounds",
            "5",
            "--partition",
            "iid",
        ],
    );
    assert_eq!(summary["data"]["classes"], 3);
    assert_eq!(summary["data"]["features"], 3);
    assert!(summary["final_test_accuracy"].as_f64().unwrap() > 0.9);
}

#[test]
fn config_file_sets_keys_and_flags_override_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("sim.toml");
    fs::write(
        &cfg,
        "dataset = \"breast-cancer\"\nmodel = \"logreg\"\nclients = 6\nrounds = 9\nlocal-epochs = 1\nstrategy = \"fedprox:0.5\"\n",
    )
    .unwrap();
    let summary = simulate_ok(
        tmp.path(),
        &tmp.path().join("run"),
        &["--config", cfg.to_str().unwrap(), "--rounds", "2"],
    );
    assert_eq!(summary["rounds"], 2);
    assert_eq!(summary["config"]["clients"], 6);
    assert_eq!(summary["config"]["strategy"], "fedprox:0.5");
}

/// Bad input: exit status 2, one line on stderr naming the problem, no panic, and no
/// output directory.
fn assert_rejected(args: &[&str], needles: &[&str], files: &[(&str, &str)]) {
    let tmp = tempfile::tempdir().unwrap();
    for (name, content) in files {
        fs::write(tmp.path().join(name), content).unwrap();
    }
    let mut full = vec!["simulate", "--out", "run", "--rounds", "2"];
    full.extend_from_slice(args);
    let o = cohort(&full, tmp.path());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: expected one line, got {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    for needle in needles {
        assert!(
            err.contains(needle),
            "{args:?}: `{err}` should mention `{needle}`"
        );
    }
    assert!(
        !tmp.path().join("run").exists(),
        "{args:?} left an output directory"
    );
    let leftovers: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !files.iter().any(|(f, _)| f == n))
        .collect();
    assert!(leftovers.is_empty(), "{args:?} left {leftovers:?}");
}

#[test]
fn missing_file_is_rejected() {
    assert_rejected(&["--dataset", "nope.csv"], &["nope.csv"], &[]);
}

#[test]
fn csv_without_label_column_is_rejected() {
    assert_rejected(
        &["--dataset", "x.csv"],
        &["x.csv", "label"],
        &[("x.csv", "a,b,class\n1,2,0\n3,4,1\n")],
    );
}

#[test]
fn non_numeric_cell_is_rejected_with_row_column_and_value() {
    assert_rejected(
        &["--dataset", "x.csv"],
        &["x.csv", "3", "b", "oops"],
        &[("x.csv", "a,b,label\n1,2,0\n3,oops,1\n5,6,0\n")],
    );
}

#[test]
fn non_positive_dirichlet_alpha_is_rejected() {
    assert_rejected(&["--partition", "dirichlet:0"], &["dirichlet:0"], &[]);
    assert_rejected(&["--partition", "dirichlet:-1"], &["dirichlet:-1"], &[]);
}

#[test]
fn more_clients_than_samples_is_rejected() {
    assert_rejected(
        &["--dataset", "breast-cancer", "--clients", "1000"],
        &["1000"],
        &[],
    );
}

#[test]
fn unknown_model_and_strategy_are_rejected() {
    assert_rejected(&["--model", "resnet"], &["resnet"], &[]);
    assert_rejected(&["--strategy", "fedfoo"], &["fedfoo"], &[]);
}

#[test]
fn out_of_range_settings_are_rejected() {
    assert_rejected(&["--dropout", "1.5"], &["--dropout"], &[]);
    assert_rejected(
        &["--clients", "5", "--clients-per-round", "6"],
        &["--clients-per-round"],
        &[],
    );
    assert_rejected(&["--config", "missing.toml"], &["missing.toml"], &[]);
    assert_rejected(
        &["--config", "bad.toml"],
        &["bad.toml", "clinets"],
        &[("bad.toml", "clinets = 4\n")],
    );
}

#[test]
fn comparing_strategies_writes_each_run_and_a_combined_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cmp");
    let summary = simulate_ok(
        tmp.path(),
        &out,
        &[
            "--dataset",
            "synthetic:1,1",
            "--clients",
            "30",
            "--clients-per-round",
            "10",
            "--model",
            "logreg",
            "--rounds",
            "3",
            "--local-epochs",
            "1",
            "--strategy",
            "fedavg,fedprox:1",
        ],
    );
    let runs = summary["runs"].as_array().unwrap();
    let names: Vec<&str> = runs
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["fedavg", "fedprox:1"]);
    for run in runs {
        assert!(run["final_test_accuracy"].as_f64().is_some());
        let dir = out.join(run["dir"].as_str().unwrap());
        for file in [
            "metrics.csv",
            "summary.json",
            "accuracy.png",
            "accuracy.svg",
        ] {
            assert!(dir.join(file).exists(), "{} lacks {file}", dir.display());
        }
    }
    let combined = fs::read_to_string(out.join("metrics.csv")).unwrap();
    assert_eq!(combined.lines().count(), 1 + 2 * 3);
    assert!(combined.lines().skip(1).any(|l| l.ends_with(",fedprox:1")));
    assert!(out.join("accuracy.png").exists());
    // Same data, sampling and initial model: only the strategy differs, so the
    // participants per round agree.
    let participants = |strategy: &str| -> Vec<String> {
        combined
            .lines()
            .skip(1)
            .filter(|l| l.ends_with(&format!(",{strategy}")))
            .map(|l| l.split(',').nth(3).unwrap().to_string())
            .collect()
    };
    assert_eq!(participants("fedavg"), participants("fedprox:1"));
}

#[test]
fn listing_a_strategy_twice_is_rejected() {
    assert_rejected(&["--strategy", "fedavg,fedavg"], &["fedavg", "twice"], &[]);
}

/// Secure aggregation changes who sees what, not what is learned: on the same seed the
/// model ends within 0.01 of plain FedAvg (the quantisation error is far smaller), and
/// the same command twice gives the same metrics whatever the thread timing.
#[test]
fn secure_aggregation_learns_what_plain_fedavg_learns_and_is_reproducible() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
        "--dataset",
        "digits",
        "--clients",
        "20",
        "--partition",
        "dirichlet:0.3",
        "--rounds",
        "5",
        "--local-epochs",
        "1",
        "--seed",
        "4",
    ];
    let plain = simulate_ok(tmp.path(), &tmp.path().join("plain"), &args);
    let mut secure_args = args.to_vec();
    secure_args.push("--secure-aggregation");
    let a = simulate_ok(tmp.path(), &tmp.path().join("a"), &secure_args);
    let gap = (a["final_test_accuracy"].as_f64().unwrap()
        - plain["final_test_accuracy"].as_f64().unwrap())
    .abs();
    assert!(gap <= 0.01, "secure {a} vs plain {plain}");
    assert_eq!(a["config"]["secure-aggregation"], true);
    // Defaults are resolved into the summary: for 20 clients, 18 neighbours keep 10%
    // dropout from failing more than one round in 1,000.
    assert_eq!(a["config"]["neighbours"], 18);
    assert_eq!(a["config"]["threshold"], 10);
    let mut threads1 = secure_args.clone();
    threads1.extend_from_slice(&["--threads", "1"]);
    simulate_ok(tmp.path(), &tmp.path().join("b"), &threads1);
    assert_eq!(
        metrics_without_seconds(&tmp.path().join("a")),
        metrics_without_seconds(&tmp.path().join("b"))
    );
}

/// `--dropout-stage` moves where the same dropping clients stop. Dropping before the
/// masked input loses their updates; dropping at unmasking keeps them (their self masks
/// are rebuilt from their neighbours' shares). A round that cannot be recovered is
/// `failed` and leaves the model as it was, rather than ending the run.
#[test]
fn dropout_stages_change_who_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, stage: &str, dropout: &str| {
        let out = tmp.path().join(name);
        simulate_ok(
            tmp.path(),
            &out,
            &[
                "--dataset",
                "breast-cancer",
                "--model",
                "logreg",
                "--clients",
                "12",
                "--rounds",
                "3",
                "--local-epochs",
                "1",
                "--seed",
                "2",
                "--secure-aggregation",
                "--neighbours",
                "11",
                "--dropout",
                dropout,
                "--dropout-stage",
                stage,
            ],
        );
        let text = fs::read_to_string(out.join("metrics.csv")).unwrap();
        let header: Vec<String> = text
            .lines()
            .next()
            .unwrap()
            .split(',')
            .map(String::from)
            .collect();
        let col = |row: &str, name: &str| -> String {
            let i = header.iter().position(|h| h == name).unwrap();
            row.split(',').nth(i).unwrap().to_string()
        };
        text.lines()
            .skip(1)
            .map(|row| (col(row, "participants"), col(row, "status")))
            .collect::<Vec<_>>()
    };
    let advertise = run("adv", "advertise", "0.25");
    let unmask = run("unm", "unmask", "0.25");
    for ((p_adv, s_adv), (p_unm, s_unm)) in advertise.iter().zip(&unmask) {
        assert_eq!((s_adv.as_str(), s_unm.as_str()), ("published", "published"));
        assert_eq!(p_unm, "12", "unmask-stage dropouts still count");
        assert!(p_adv.parse::<usize>().unwrap() < 12);
    }
    // 10 of 12 clients gone before masking: below the threshold, the round fails.
    let failed = run("fail", "share", "0.85");
    assert!(
        failed.iter().any(|(p, s)| p == "0" && s == "failed"),
        "{failed:?}"
    );
}

#[test]
fn secure_aggregation_settings_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    for (extra, needle) in [
        (
            vec!["--dropout-stage", "share"],
            "needs --secure-aggregation",
        ),
        (vec!["--threshold", "3"], "need --secure-aggregation"),
        (
            vec!["--secure-aggregation", "--threshold", "2"],
            "--threshold must be more than half",
        ),
        (
            vec![
                "--secure-aggregation",
                "--neighbours",
                "4",
                "--threshold",
                "5",
            ],
            "--threshold must be more than half",
        ),
        (vec!["--secure-aggregation", "--clip", "0"], "--clip"),
        (
            vec!["--secure-aggregation", "--dropout-stage", "later"],
            "unknown stage",
        ),
        (
            vec!["--secure-aggregation", "--clients-per-round", "1"],
            "at least 2 clients",
        ),
    ] {
        let mut args = vec!["simulate", "--clients", "8", "--rounds", "1"];
        args.extend_from_slice(&extra);
        let out = tmp.path().join("never");
        args.extend_from_slice(&["--out", out.to_str().unwrap()]);
        let o = cohort(&args, tmp.path());
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{extra:?}: {}", stderr(&o));
        assert!(!out.exists());
    }
}

#[test]
fn robust_aggregation_settings_that_cannot_work_are_rejected() {
    assert_rejected(
        &["--aggregator", "median", "--secure-aggregation"],
        &["--aggregator median", "secure aggregation"],
        &[],
    );
    assert_rejected(
        &["--aggregator", "krum:5", "--clients", "10"],
        &["krum", "at least 13"],
        &[],
    );
    assert_rejected(&["--aggregator", "mean"], &["mean", "median"], &[]);
    assert_rejected(&["--malicious", "1.5"], &["--malicious"], &[]);
    assert_rejected(&["--attack", "flip"], &["flip", "sign-flip"], &[]);
}

/// Central differential privacy: `metrics.csv` carries the epsilon spent after each
/// round, the same number `cohort privacy epsilon` gives for that many rounds, and the
/// run stops before a round that would go over `--dp-epsilon`.
#[test]
fn differential_privacy_reports_epsilon_per_round_and_keeps_to_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dp");
    let args = [
        "--clients",
        "40",
        "--clients-per-round",
        "8",
        "--rounds",
        "6",
        "--model",
        "logreg",
        "--dp-noise-multiplier",
        "1.2",
        "--dp-clip",
        "0.5",
    ];
    let summary = simulate_ok(tmp.path(), &out, &args);
    let csv = fs::read_to_string(out.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = header
        .iter()
        .position(|c| *c == "epsilon")
        .expect("an epsilon column");
    let eps: Vec<f64> = lines
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect();
    assert_eq!(eps.len(), 6);
    assert!(eps.windows(2).all(|w| w[0] < w[1]), "{eps:?}");
    let expected = cohort(
        &[
            "privacy",
            "epsilon",
            "--sampling-rate",
            "0.2",
            "--noise-multiplier",
            "1.2",
            "--rounds",
            "6",
            "--delta",
            "1e-5",
        ],
        tmp.path(),
    );
    let expected: f64 = String::from_utf8(expected.stdout)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (eps[5] - expected).abs() < 1e-9 * expected,
        "{} vs {expected}",
        eps[5]
    );
    assert_eq!(summary["epsilon"].as_f64().unwrap(), eps[5]);

    // A budget between rounds 3 and 4 stops the run after round 3.
    let budget = (eps[2] + eps[3]) / 2.0;
    let out = tmp.path().join("budget");
    let budget_text = budget.to_string();
    let mut with_budget = args.to_vec();
    with_budget.extend_from_slice(&["--dp-epsilon", &budget_text]);
    let summary = simulate_ok(tmp.path(), &out, &with_budget);
    assert_eq!(summary["rounds"], 3);
    assert!(summary["epsilon"].as_f64().unwrap() <= budget);
    assert!(
        summary["stopped"]
            .as_str()
            .unwrap()
            .contains("privacy budget")
    );
}

/// The coordinator samples the clients, so against it nothing is amplified:
/// `metrics.csv` gains `epsilon_coordinator` (the worst client's own rounds) before the
/// last three columns, above the observers' `epsilon` in every row; `inf` under central
/// noise, where the coordinator sees every update; empty without DP. A budget against
/// the coordinator stops a run that the same budget against observers lets finish.
#[test]
fn metrics_csv_reports_epsilon_against_the_coordinator_and_its_budget_stops_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let column = |out: &Path, name: &str| -> Vec<String> {
        let csv = fs::read_to_string(out.join("metrics.csv")).unwrap();
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        assert_eq!(
            &header[header.len() - 4..],
            ["epsilon_coordinator", "sim_seconds", "epsilon", "strategy"]
        );
        let col = header.iter().position(|c| *c == name).unwrap();
        lines
            .map(|l| l.split(',').nth(col).unwrap().to_string())
            .collect()
    };
    let numbers = |v: Vec<String>| -> Vec<f64> { v.iter().map(|e| e.parse().unwrap()).collect() };
    let args = [
        "--dataset",
        "breast-cancer",
        "--model",
        "logreg",
        "--clients",
        "40",
        "--clients-per-round",
        "8",
        "--rounds",
        "5",
        "--local-epochs",
        "1",
        "--dp-noise-multiplier",
        "1.5",
        "--dp-clip",
        "0.5",
    ];
    let mut secure = args.to_vec();
    secure.push("--secure-aggregation");
    let out = tmp.path().join("secure");
    let summary = simulate_ok(tmp.path(), &out, &secure);
    let observers = numbers(column(&out, "epsilon"));
    let coordinator = numbers(column(&out, "epsilon_coordinator"));
    assert_eq!(coordinator.len(), 5);
    assert!(
        coordinator.windows(2).all(|w| w[0] <= w[1]),
        "{coordinator:?}"
    );
    for (c, o) in coordinator.iter().zip(&observers) {
        assert!(
            c > o,
            "against the coordinator {c} <= against observers {o}"
        );
    }
    assert_eq!(
        summary["epsilon_coordinator"].as_f64(),
        Some(coordinator[4])
    );
    assert!(summary.get("epsilon_coordinator_unbounded").is_none());

    // Central noise: the coordinator sees every update, no epsilon holds against it.
    let out = tmp.path().join("central");
    let summary = simulate_ok(tmp.path(), &out, &args);
    assert!(
        column(&out, "epsilon_coordinator")
            .iter()
            .all(|e| e == "inf")
    );
    assert!(summary["epsilon_coordinator"].is_null(), "{summary}");
    assert!(
        summary["epsilon_coordinator_unbounded"]
            .as_str()
            .unwrap()
            .contains("central noise")
    );
    let out = small_run(tmp.path(), "plain", &[]);
    assert!(
        column(&out, "epsilon_coordinator")
            .iter()
            .all(|e| e.is_empty())
    );

    // The same seed samples the same clients: at the full run's final figure as the
    // budget, the check (at the worst-case multiplier of only the threshold surviving)
    // refuses a round before the end against the coordinator, and none against observers.
    let budget = coordinator[4].to_string();
    let mut against = secure.clone();
    against.extend_from_slice(&[
        "--dp-epsilon",
        &budget,
        "--dp-budget-against",
        "coordinator",
    ]);
    let summary = simulate_ok(tmp.path(), &tmp.path().join("against"), &against);
    assert!(summary["rounds"].as_u64().unwrap() < 5, "{summary}");
    assert!(summary["epsilon_coordinator"].as_f64().unwrap() <= coordinator[4]);
    assert!(
        summary["stopped"]
            .as_str()
            .unwrap()
            .contains("against the coordinator"),
        "{summary}"
    );
    assert_eq!(summary["config"]["dp-budget-against"], "coordinator");
    let mut observers_budget = secure.clone();
    observers_budget.extend_from_slice(&["--dp-epsilon", &budget]);
    let summary = simulate_ok(tmp.path(), &tmp.path().join("observers"), &observers_budget);
    assert_eq!(summary["rounds"], 5, "{summary}");
}

#[test]
fn differential_privacy_settings_that_cannot_work_are_rejected() {
    assert_rejected(
        &["--dp-epsilon", "3"],
        &["--dp-epsilon needs --dp-noise-multiplier"],
        &[],
    );
    assert_rejected(
        &[
            "--dp-noise-multiplier",
            "1",
            "--secure-aggregation",
            "--dp-clip-quantile",
            "0.5",
        ],
        &["--dp-clip-quantile", "secure aggregation"],
        &[],
    );
    assert_rejected(
        &["--dp-noise-multiplier", "1", "--dp-clip-quantile", "1.5"],
        &["--dp-clip-quantile must be in (0, 1)"],
        &[],
    );
    assert_rejected(
        &[
            "--dp-noise-multiplier",
            "2",
            "--dp-clip-quantile",
            "0.5",
            "--dp-clip-count-noise",
            "0.5",
        ],
        &["--dp-clip-count-noise 0.5 leaves no room"],
        &[],
    );
    assert_rejected(
        &["--dp-clip-count-noise", "1"],
        &["need --dp-noise-multiplier"],
        &[],
    );
    assert_rejected(
        &["--dp-noise-multiplier", "101"],
        &["--dp-noise-multiplier must be at most 100"],
        &[],
    );
    assert_rejected(
        &["--dp-noise-multiplier", "1", "--aggregator", "median"],
        &["--aggregator median"],
        &[],
    );
    assert_rejected(
        &["--dp-noise-multiplier=-1"],
        &["--dp-noise-multiplier"],
        &[],
    );
    assert_rejected(
        &["--dp-noise-multiplier", "1", "--dp-clip", "0"],
        &["--dp-clip"],
        &[],
    );
    assert_rejected(
        &["--dp-noise-multiplier", "1", "--dp-delta", "1"],
        &["--dp-delta"],
        &[],
    );
    assert_rejected(
        &[
            "--dp-noise-multiplier",
            "1",
            "--dp-epsilon",
            "8",
            "--dp-budget-against",
            "coordinator",
        ],
        &["--dp-budget-against coordinator needs --secure-aggregation"],
        &[],
    );
    assert_rejected(
        &[
            "--dp-noise-multiplier",
            "1",
            "--secure-aggregation",
            "--dp-budget-against",
            "coordinator",
        ],
        &["needs --dp-epsilon"],
        &[],
    );
    assert_rejected(
        &["--dp-budget-against", "server"],
        &["observers or coordinator"],
        &[],
    );
}

/// FedBuff and the straggler model: one server step per row, the simulated clock in
/// `metrics.csv` and `summary.json`, the target reported, and the same seed giving the
/// same rows whatever the number of threads.
#[test]
fn fedbuff_writes_one_row_per_server_step_on_the_simulated_clock() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = [
        "--mode",
        "fedbuff",
        "--buffer-size",
        "3",
        "--concurrency",
        "5",
        "--straggler",
        "pareto:1.5",
        "--target-accuracy",
        "0.6",
        "--seed",
        "4",
    ];
    let a = small_run(tmp.path(), "a", &extra);
    // Tasks train in parallel batches: one thread must give the same rows.
    let mut one_thread = extra.to_vec();
    one_thread.extend_from_slice(&["--threads", "1"]);
    let b = small_run(tmp.path(), "b", &one_thread);
    assert_eq!(metrics_without_seconds(&a), metrics_without_seconds(&b));
    let csv = fs::read_to_string(a.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(
        &header[header.len() - 3..],
        ["sim_seconds", "epsilon", "strategy"]
    );
    let col = |name: &str| header.iter().position(|c| *c == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 4, "one row per server step");
    let sim: Vec<f64> = rows
        .iter()
        .map(|r| r[col("sim_seconds")].parse().unwrap())
        .collect();
    assert!(
        sim[0] > 0.0 && sim.windows(2).all(|w| w[0] <= w[1]),
        "{sim:?}"
    );
    assert!(rows.iter().all(|r| r[col("participants")] == "3"));
    let summary = read_json(&a.join("summary.json"));
    assert_eq!(summary["config"]["mode"], "fedbuff");
    assert_eq!(summary["config"]["buffer-size"], 3);
    assert_eq!(summary["config"]["straggler"], "pareto:1.5");
    assert_eq!(summary["total_updates"], 12);
    assert_eq!(summary["sim_seconds"].as_f64().unwrap(), sim[3]);
    assert!(summary["mean_staleness"].as_f64().unwrap() >= 0.0);
    assert_eq!(summary["target_accuracy"], 0.6);
    // Reached or not, the key is there; when reached, it is a row's clock.
    match summary["sim_seconds_to_target"].as_f64() {
        Some(t) => assert!(sim.contains(&t), "{t} not in {sim:?}"),
        None => assert!(summary["sim_seconds_to_target"].is_null()),
    }
}

#[test]
fn fedbuff_and_straggler_settings_that_cannot_work_are_rejected() {
    assert_rejected(
        &["--mode", "fedbuff", "--secure-aggregation"],
        &["--mode fedbuff", "--secure-aggregation"],
        &[],
    );
    assert_rejected(
        &["--mode", "fedbuff", "--dp-noise-multiplier", "1"],
        &["--mode fedbuff", "--dp-noise-multiplier"],
        &[],
    );
    assert_rejected(
        &["--mode", "fedbuff", "--aggregator", "median"],
        &["--aggregator median"],
        &[],
    );
    assert_rejected(
        &["--mode", "fedbuff", "--buffer-size", "0"],
        &["--buffer-size"],
        &[],
    );
    assert_rejected(
        &["--mode", "fedbuff", "--clients", "8", "--concurrency", "9"],
        &["--concurrency"],
        &[],
    );
    assert_rejected(&["--buffer-size", "5"], &["need --mode fedbuff"], &[]);
    assert_rejected(&["--mode", "async"], &["async", "fedbuff"], &[]);
    assert_rejected(&["--straggler", "pareto"], &["pareto:ALPHA"], &[]);
    assert_rejected(&["--straggler", "pareto:0"], &["ALPHA", "> 0"], &[]);
    assert_rejected(&["--straggler", "slow"], &["slow", "lognormal:SIGMA"], &[]);
    assert_rejected(&["--target-accuracy", "2"], &["--target-accuracy"], &[]);
}

/// One column of metrics.csv, by name, as numbers.
fn column(dir: &Path, name: &str) -> Vec<f64> {
    let text = fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let at = header.iter().position(|c| *c == name).unwrap();
    lines
        .map(|l| l.split(',').nth(at).unwrap().parse().unwrap())
        .collect()
}

/// Compression cuts the bytes each round moves, as metrics.csv records them, by what
/// the scheme promises, and the model still learns; the same seed gives the same run.
#[test]
fn compressed_runs_count_their_bytes_and_still_learn() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = small_run(tmp.path(), "plain", &["--seed", "5"]);
    let q8 = small_run(
        tmp.path(),
        "q8",
        &["--seed", "5", "--compress", "quantize:8"],
    );
    let again = small_run(
        tmp.path(),
        "again",
        &["--seed", "5", "--compress", "quantize:8"],
    );
    let sign = small_run(tmp.path(), "sign", &["--seed", "5", "--compress", "sign"]);
    assert_eq!(
        metrics_without_seconds(&q8),
        metrics_without_seconds(&again)
    );
    // logreg on breast cancer: 30 features, 2 classes, 62 parameters; 8 clients a round.
    let (up, down) = (column(&plain, "bytes_up"), column(&plain, "bytes_down"));
    assert!(up.iter().all(|b| *b == 8.0 * 62.0 * 4.0), "{up:?}");
    assert!(down.iter().all(|b| *b == 8.0 * 62.0 * 4.0), "{down:?}");
    // A quarter of the floats, plus a 24-byte header and 8 bytes per rotation block
    // (62 = 32 + 16 + 8 + 4 + 2: five blocks).
    let per_client = (24 + 5 * 8 + 62) as f64;
    for name in ["bytes_up", "bytes_down"] {
        assert!(
            column(&q8, name).iter().all(|b| *b == 8.0 * per_client),
            "{name}"
        );
    }
    // sign: one bit a parameter up, models down uncompressed.
    let sign_up = (24 + 5 * 4 + 62usize.div_ceil(8)) as f64;
    assert!(
        column(&sign, "bytes_up")
            .iter()
            .all(|b| *b == 8.0 * sign_up)
    );
    assert_eq!(column(&sign, "bytes_down"), down);
    for run in [&q8, &sign] {
        let acc = read_json(&run.join("summary.json"))["final_test_accuracy"]
            .as_f64()
            .unwrap();
        assert!(acc > 0.8, "{run:?} should still learn, got {acc}");
    }
}

/// Under secure aggregation, 4-bit uploads go masked in 16-bit words (or 8 where the
/// round's sum fits): at most 0.55 times today's 32-bit masked upload.
#[test]
fn compressed_secure_rounds_send_narrow_masked_words() {
    let tmp = tempfile::tempdir().unwrap();
    let secure = ["--secure-aggregation", "--clip", "0.5", "--seed", "2"];
    let wide = small_run(tmp.path(), "wide", &secure);
    let mut narrow_args = secure.to_vec();
    narrow_args.extend_from_slice(&["--compress-up", "quantize:4", "--word-bits", "16"]);
    let narrow = small_run(tmp.path(), "narrow", &narrow_args);
    let (w, n) = (column(&wide, "bytes_up"), column(&narrow, "bytes_up"));
    // 62 model words and 2 words of weight and loss per client.
    assert!(w.iter().all(|b| *b == 8.0 * (62.0 * 4.0 + 8.0)), "{w:?}");
    assert!(n.iter().all(|b| *b == 8.0 * (62.0 * 2.0 + 8.0)), "{n:?}");
    assert!(n[0] / w[0] <= 0.55);
    let acc = read_json(&narrow.join("summary.json"))["final_test_accuracy"]
        .as_f64()
        .unwrap();
    assert!(
        acc > 0.8,
        "4-bit secure rounds should still learn, got {acc}"
    );
}

#[test]
fn compression_settings_that_cannot_work_are_rejected() {
    assert_rejected(
        &["--compress", "quantize:3"],
        &["quantize:3", "1, 2, 4 or 8"],
        &[],
    );
    assert_rejected(&["--compress-up", "topk:2"], &["topk:2", "at most 1"], &[]);
    assert_rejected(
        &["--compress-down", "sign"],
        &["--compress-down", "uploads only"],
        &[],
    );
    assert_rejected(
        &["--compress-down", "quantize:2"],
        &["--compress-down", "too coarse"],
        &[],
    );
    assert_rejected(
        &["--secure-aggregation", "--compress-up", "topk:0.01"],
        &["--compress-up", "cannot run under secure aggregation"],
        &[],
    );
    assert_rejected(
        &["--secure-aggregation", "--compress-up", "sign"],
        &["--compress-up", "quantize:1"],
        &[],
    );
    assert_rejected(
        &[
            "--secure-aggregation",
            "--clients",
            "40",
            "--compress-up",
            "quantize:4",
            "--word-bits",
            "8",
        ],
        &["--word-bits", "too narrow for 40 clients at 4 bits"],
        &[],
    );
    assert_rejected(
        &["--compress", "quantize:4", "--word-bits", "16"],
        &["--word-bits", "needs --secure-aggregation"],
        &[],
    );
    assert_rejected(
        &["--mode", "fedbuff", "--compress", "quantize:4"],
        &["--compress-up", "fedbuff"],
        &[],
    );
}

/// A personalised run scores every client's global and personal model on its own
/// held-out split: per-round means and 10th percentiles in metrics.csv, each client's
/// final figures in clients.csv; on two classes a client, its own head beats the
/// shared model's.
#[test]
fn personalised_runs_score_each_client_on_its_own_split() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("fedper");
    simulate_ok(
        tmp.path(),
        &out,
        &[
            "--dataset",
            "digits",
            "--clients",
            "20",
            "--clients-per-round",
            "10",
            "--rounds",
            "8",
            "--partition",
            "shards:2",
            "--personalise",
            "fedper:layers.1",
            "--seed",
            "4",
        ],
    );
    let personal = column(&out, "personal_accuracy_mean");
    let global = column(&out, "client_accuracy_mean");
    assert_eq!(personal.len(), 8);
    let last = personal.len() - 1;
    assert!(
        personal[last] > global[last] + 0.05,
        "{personal:?} vs {global:?}"
    );
    assert!(column(&out, "personal_accuracy_p10")[last] <= personal[last]);
    let clients = fs::read_to_string(out.join("clients.csv")).unwrap();
    let mut lines = clients.lines();
    assert_eq!(
        lines.next().unwrap(),
        "client,train_samples,holdout_samples,global_accuracy,personal_accuracy"
    );
    let rows: Vec<Vec<f64>> = lines
        .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 20, "every client holds some out");
    for r in &rows {
        // A fifth of the client's samples, at least one.
        assert!(
            r[2] >= 1.0 && (r[2] - 0.2 * (r[1] + r[2])).abs() <= 1.0,
            "{r:?}"
        );
        assert!((0.0..=1.0).contains(&r[3]) && (0.0..=1.0).contains(&r[4]));
    }
    let mean = rows.iter().map(|r| r[4]).sum::<f64>() / rows.len() as f64;
    assert!((mean - personal[last]).abs() < 1e-9);
    // Without --personalise the columns are empty, unless the clients hold data out.
    let plain = small_run(tmp.path(), "plain", &[]);
    assert!(
        fs::read_to_string(plain.join("metrics.csv"))
            .unwrap()
            .contains(",,,,")
    );
    assert!(!plain.join("clients.csv").exists());
}

#[test]
fn personalisation_settings_that_cannot_work_are_rejected() {
    assert_rejected(
        &["--personalise", "fedper:fc2"],
        &[
            "--personalise fedper:fc2",
            "no layer or tensor `fc2`",
            "layers.0, layers.1",
        ],
        &[],
    );
    assert_rejected(
        &["--personalise", "fedrep:layers.0,layers.1"],
        &["nothing would be shared"],
        &[],
    );
    assert_rejected(
        &["--personalise", "ditto:0"],
        &["LAMBDA must be a number above 0"],
        &[],
    );
    assert_rejected(
        &["--personalise", "finetune:0"],
        &["EPOCHS must be a whole number"],
        &[],
    );
    assert_rejected(
        &["--personalise", "local"],
        &["unknown personalisation `local`"],
        &[],
    );
    assert_rejected(
        &["--personalise", "finetune:2", "--client-holdout", "0"],
        &["--client-holdout must be above 0"],
        &[],
    );
    assert_rejected(
        &["--client-holdout", "0.95"],
        &["--client-holdout must be in [0, 0.9)"],
        &[],
    );
    assert_rejected(
        &["--personalise", "finetune:2", "--mode", "fedbuff"],
        &["--personalise finetune:2 is for synchronous rounds"],
        &[],
    );
}
