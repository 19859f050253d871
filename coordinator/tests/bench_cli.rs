//! `cohort bench secagg` as other tools run it: JSON lines with the fields the issue
//! names (`client_mask_s`, `server_unmask_s`, `round_s`, `bytes_per_client`,
//! `expansion`), a result checked against plain FedAvg, and bad flags refused with
//! status 2 before anything is measured.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["bench", "secagg"])
        .args(args)
        .output()
        .expect("cohort runs")
}

#[test]
fn secagg_bench_prints_the_named_fields_for_every_case() {
    let out = bench(&[
        "--n",
        "8",
        "--d",
        "1e3",
        "--dropout",
        "0,0.25",
        "--repeats",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is JSON"))
        .collect();
    let cases: Vec<&serde_json::Value> = lines.iter().filter(|l| l["bench"] == "secagg").collect();
    assert_eq!(cases.len(), 2);
    for (case, dropped) in cases.iter().zip([0, 2]) {
        for field in [
            "client_mask_s",
            "server_unmask_s",
            "round_s",
            "bytes_per_client",
        ] {
            assert!(case[field].as_f64().unwrap() > 0.0, "{field}: {case}");
        }
        // d words plus weight and loss, plus the protocol messages: a little over 1.
        let expansion = case["expansion"].as_f64().unwrap();
        assert!(expansion > 1.0 && expansion < 3.0, "{case}");
        assert_eq!(case["dropped"], dropped);
        assert_eq!(case["d"], 1000);
        assert!(case["max_abs_err"].as_f64().unwrap() <= case["error_bound"].as_f64().unwrap());
    }
    // The Flower harness's records are there to join with compare.py.
    for bench in [
        "secagg_client_mask",
        "secagg_server_unmask",
        "secagg_round",
        "membw_probe",
    ] {
        assert!(lines.iter().any(|l| l["bench"] == bench), "{bench} missing");
    }
}

#[test]
fn secagg_bench_refuses_bad_flags() {
    for args in [
        vec!["--n", "1"],
        vec!["--d", "0"],
        vec!["--dropout", "1"],
        vec!["--n", "10", "--neighbours", "4", "--threshold", "2"],
        vec!["--neighbours", "none"],
        vec!["--repeats", "0"],
    ] {
        let out = bench(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing measured");
    }
}

/// `cohort bench reduce`: one line per measurement with the named fields, next to the
/// probe of the same run; `--reducer cuda` where no GPU is usable is refused, and `auto`
/// says which reducer it took.
#[test]
fn reduce_bench_prints_the_named_fields() {
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "bench",
            "reduce",
            "--n",
            "6",
            "--d",
            "1e4",
            "--repeats",
            "1",
            "--reducer",
            "auto",
        ])
        .output()
        .expect("cohort runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("reducer: "));
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let benches: Vec<&str> = lines.iter().map(|l| l["bench"].as_str().unwrap()).collect();
    assert_eq!(
        benches,
        ["fedavg", "fedavg_in_cache", "masked_sum", "mask_expand"]
    );
    for l in &lines {
        if l["bench"] == "fedavg_in_cache" {
            // Its own size: the run's updates (at most 24) of one chunk per thread.
            assert_eq!(l["n"].as_u64(), Some(6));
            let chunk = cohort_aggregation::reduce::WEIGHTED_CHUNK as u64;
            assert_eq!(l["d"].as_u64().unwrap() % chunk, 0, "{l}");
        } else {
            assert_eq!((l["n"].as_u64(), l["d"].as_u64()), (Some(6), Some(10_000)));
        }
        assert!(l["reducer"].is_string());
        for field in ["median_s", "gbps", "probe_read_gbps", "ratio"] {
            assert!(l[field].as_f64().unwrap() > 0.0, "{field}: {l}");
        }
        if l["bench"] == "fedavg" || l["bench"] == "masked_sum" {
            for field in ["probe_paired_gbps", "ratio_paired"] {
                assert!(l[field].as_f64().unwrap() > 0.0, "{field}: {l}");
            }
        }
        let ratio = l["gbps"].as_f64().unwrap() / l["probe_read_gbps"].as_f64().unwrap();
        assert!((ratio - l["ratio"].as_f64().unwrap()).abs() < 1e-9);
        // The probe is the best of its patterns, and names it.
        let patterns = l["probe_patterns"].as_object().unwrap();
        assert!(patterns.len() >= 3, "{l}");
        let best = patterns
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(0.0f64, f64::max);
        assert_eq!(l["probe_read_gbps"].as_f64().unwrap(), best);
        assert_eq!(
            patterns[l["probe_pattern"].as_str().unwrap()]
                .as_f64()
                .unwrap(),
            best
        );
    }
    // Mask expansion on one core, next to two crates' ChaCha20 on one core.
    let expand = &lines[3];
    for field in ["gbps_per_core", "chacha20_crate_gbps", "rand_chacha_gbps"] {
        assert!(expand[field].as_f64().unwrap() > 0.0, "{field}: {expand}");
    }
    let cpu_only = !cfg!(feature = "cuda") || lines[0]["reducer"] == "cpu";
    if cpu_only {
        let cuda = Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args([
                "bench",
                "reduce",
                "--n",
                "2",
                "--d",
                "10",
                "--reducer",
                "cuda",
            ])
            .output()
            .unwrap();
        assert_eq!(cuda.status.code(), Some(2));
        assert!(cuda.stdout.is_empty());
    }
}

/// `cohort bench dashboard` renders every page of a filled database and reports each.
#[test]
fn dashboard_bench_times_every_page_of_a_filled_database() {
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["bench", "dashboard", "--rounds", "30", "--clients", "250"])
        .args(["--participants", "5", "--repeats", "2"])
        .output()
        .expect("cohort runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is JSON"))
        .collect();
    let pages: Vec<&str> = lines.iter().map(|l| l["page"].as_str().unwrap()).collect();
    for page in [
        "/experiments",
        "/experiments/{id}",
        "/clients",
        "/clients?page=3",
    ] {
        assert!(pages.contains(&page), "{page} missing from {pages:?}");
    }
    for line in &lines {
        assert_eq!(line["bench"], "dashboard");
        assert_eq!(line["rounds"], 30);
        assert_eq!(line["clients"], 250);
        assert!(line["median_ms"].as_f64().unwrap() > 0.0, "{line}");
        assert!(line["p95_ms"].as_f64().unwrap() >= line["median_ms"].as_f64().unwrap());
        assert!(line["bytes"].as_u64().unwrap() > 0);
    }
    let refused = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "bench",
            "dashboard",
            "--participants",
            "20",
            "--clients",
            "10",
        ])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
}
