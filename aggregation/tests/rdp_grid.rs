//! Cohort's RDP accountant against Google's `dp_accounting` (RDP accountant, default
//! orders) on a grid of sampling rates, noise multipliers, round counts and deltas. The
//! grid is `fixtures/rdp_grid.json`, written by `scripts/rdp_fixtures.py`.

use cohort_aggregation::privacy::rdp::epsilon;

#[test]
fn epsilon_agrees_with_dp_accounting_on_the_whole_grid() {
    let text = include_str!("fixtures/rdp_grid.json");
    let doc: serde_json::Value = serde_json::from_str(text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() > 100, "{} cases", cases.len());
    let mut worst: f64 = 0.0;
    for case in cases {
        let q = case["sampling_rate"].as_f64().unwrap();
        let sigma = case["noise_multiplier"].as_f64().unwrap();
        let rounds = case["rounds"].as_u64().unwrap();
        let delta = case["delta"].as_f64().unwrap();
        let expected = case["epsilon"].as_f64().unwrap();
        let got = epsilon(q, sigma, rounds, delta).unwrap();
        let relative = ((got - expected) / expected).abs();
        worst = worst.max(relative);
        // The bar is 3%; the computation is the same, so it agrees to rounding.
        assert!(
            relative < 1e-6,
            "q={q} sigma={sigma} T={rounds} delta={delta}: {got} vs {expected}"
        );
    }
    eprintln!("{} cases, worst relative difference {worst:e}", cases.len());
}
