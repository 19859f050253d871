//! `cohort privacy epsilon` and `cohort privacy noise` as other tools run them: the last
//! line of stdout is the bare number, and bad arguments are refused with status 2.

use std::process::Command;

use cohort_aggregation::privacy::rdp;

fn privacy(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .arg("privacy")
        .args(args)
        .output()
        .expect("cohort runs")
}

fn last_number(out: &std::process::Output) -> f64 {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    let last = stdout.lines().last().expect("some output");
    last.parse()
        .unwrap_or_else(|_| panic!("last line `{last}` is not a bare number"))
}

#[test]
fn epsilon_prints_dp_accounting_s_values_on_its_last_line() {
    for (q, sigma, rounds, delta, expected) in [
        ("0.01", "1.1", "1000", "1e-5", 1.7118),
        ("1.0", "5.0", "50", "1e-6", 7.7662),
        ("0.02", "1.3", "2000", "1e-6", 4.3178),
    ] {
        let eps = last_number(&privacy(&[
            "epsilon",
            "--sampling-rate",
            q,
            "--noise-multiplier",
            sigma,
            "--rounds",
            rounds,
            "--delta",
            delta,
        ]));
        assert!(
            ((eps - expected) / expected).abs() < 1e-4,
            "{eps} vs {expected}"
        );
    }
}

#[test]
fn noise_prints_the_smallest_multiplier_within_the_budget() {
    let sigma = last_number(&privacy(&[
        "noise",
        "--sampling-rate",
        "0.01",
        "--rounds",
        "1000",
        "--epsilon",
        "1.7118",
        "--delta",
        "1e-5",
    ]));
    assert!((sigma - 1.1).abs() < 1e-3, "{sigma}");
    // Spending it back gives at most the budget.
    let eps = last_number(&privacy(&[
        "epsilon",
        "--sampling-rate",
        "0.01",
        "--noise-multiplier",
        &sigma.to_string(),
        "--rounds",
        "1000",
        "--delta",
        "1e-5",
    ]));
    assert!(eps <= 1.7118, "{eps}");
}

#[test]
fn bad_arguments_are_refused_with_a_message() {
    for args in [
        &[
            "epsilon",
            "--sampling-rate",
            "1.5",
            "--noise-multiplier",
            "1",
            "--rounds",
            "1",
            "--delta",
            "1e-5",
        ][..],
        &[
            "epsilon",
            "--sampling-rate",
            "0.1",
            "--noise-multiplier",
            "-1",
            "--rounds",
            "1",
            "--delta",
            "1e-5",
        ],
        &[
            "epsilon",
            "--sampling-rate",
            "0.1",
            "--noise-multiplier",
            "1",
            "--rounds",
            "1",
            "--delta",
            "0",
        ],
        &[
            "noise",
            "--sampling-rate",
            "0.1",
            "--rounds",
            "10",
            "--epsilon",
            "0",
            "--delta",
            "1e-5",
        ],
    ] {
        let out = privacy(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // A missing flag is clap's usage error, also status 2.
    assert_eq!(
        privacy(&["epsilon", "--sampling-rate", "0.1"])
            .status
            .code(),
        Some(2)
    );
}

/// The coordinator draws the sample, so its figure has no amplification: `epsilon` says
/// both, keeps the observers' figure on its last line unless `--against coordinator`,
/// and the coordinator's figure for a client in K rounds is the accountant's at q = 1.
#[test]
fn epsilon_and_noise_give_the_coordinator_s_figure_without_amplification() {
    let base = [
        "epsilon",
        "--sampling-rate",
        "0.01",
        "--noise-multiplier",
        "1.1",
        "--rounds",
        "1000",
        "--delta",
        "1e-5",
    ];
    let out = privacy(&base);
    assert!((last_number(&out) - 1.7118).abs() < 1e-3);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("# against the coordinator"), "{stdout}");
    let mut against = base.to_vec();
    against.extend(["--against", "coordinator", "--participations", "10"]);
    let eps = last_number(&privacy(&against));
    let expected = rdp::epsilon(1.0, 1.1, 10, 1e-5).unwrap();
    assert!(
        (eps - expected).abs() < 1e-9 * expected,
        "{eps} vs {expected}"
    );
    assert!(
        eps > 1.7118,
        "ten rounds unamplified cost more than 1000 sampled at 1%"
    );
    // The noise for a budget against the coordinator spends it back.
    let sigma = last_number(&privacy(&[
        "noise",
        "--sampling-rate",
        "0.01",
        "--rounds",
        "1000",
        "--epsilon",
        "8",
        "--delta",
        "1e-5",
        "--against",
        "coordinator",
        "--participations",
        "10",
    ]));
    assert!(rdp::epsilon(1.0, sigma, 10, 1e-5).unwrap() <= 8.0);
    assert!(rdp::epsilon(1.0, sigma * 0.999, 10, 1e-5).unwrap() > 8.0);
    // More participations than rounds, or an unknown adversary, are refused.
    let mut too_many = base.to_vec();
    too_many.extend(["--against", "coordinator", "--participations", "1001"]);
    assert_eq!(privacy(&too_many).status.code(), Some(2));
    let mut unknown = base.to_vec();
    unknown.extend(["--against", "server"]);
    assert_eq!(privacy(&unknown).status.code(), Some(2));
}

fn simulate(out: &std::path::Path, extra: &[&str]) {
    let status = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["simulate", "--dataset", "breast-cancer", "--clients", "10"])
        .args(["--clients-per-round", "5", "--rounds", "3", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .expect("cohort runs");
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
}

#[test]
fn plot_draws_accuracy_against_epsilon_for_simulation_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (dp, plain) = (dir.path().join("dp"), dir.path().join("plain"));
    simulate(
        &dp,
        &["--dp-noise-multiplier", "1.0", "--secure-aggregation"],
    );
    simulate(&plain, &[]);
    let png = dir.path().join("privacy.png");
    let out = privacy(&[
        "plot",
        "--out",
        png.to_str().unwrap(),
        dp.to_str().unwrap(),
        plain.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].contains("epsilon=") && !lines[0].contains("epsilon=none"));
    assert!(lines[1].contains("epsilon=none"), "{stdout}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(png.with_extension("svg")).unwrap();
    assert!(svg.contains("epsilon spent"));

    // A directory that is not a run is refused by name, and nothing is written.
    let missing = dir.path().join("nothing-here");
    let other = dir.path().join("other.png");
    let out = privacy(&[
        "plot",
        "--out",
        other.to_str().unwrap(),
        missing.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing-here"));
    assert!(!other.exists());
}
