//! `cohort privacy epsilon` and `cohort privacy noise` as other tools run them: the last
//! line of stdout is the bare number, and bad arguments are refused with status 2.

use std::process::Command;

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
