//! Robust aggregation under attack, on digits: with a fifth of the clients sending their
//! update sign-flipped and scaled by 4, plain FedAvg collapses while the coordinate-wise
//! median, the trimmed mean and Multi-Krum stay within 0.05 of the clean FedAvg run, and
//! Krum within 0.05 of its own clean run (Krum keeps one client's update a round, so it
//! trails the mean even without an attack).

use cohort_aggregation::robust::RobustRule;
use cohort_coordinator::simulate::{Attack, SimulationConfig, prepare, run_rounds};
use cohort_edge::partition::PartitionScheme;

fn final_accuracy(aggregator: Option<RobustRule>, malicious: f64) -> f64 {
    let cfg = SimulationConfig {
        clients: 20,
        rounds: 30,
        local_epochs: 2,
        partition: Some(PartitionScheme::Iid),
        aggregator,
        malicious,
        attack: Attack::SignFlip { scale: 4.0 },
        ..SimulationConfig::default()
    };
    cfg.validate().unwrap();
    let prepared = prepare(&cfg).unwrap();
    let result = run_rounds(&cfg, &prepared, |_| Ok(())).unwrap();
    result.rounds.last().unwrap().test_accuracy
}

#[test]
fn robust_rules_hold_up_where_fedavg_does_not() {
    let clean = final_accuracy(None, 0.0);
    let attacked = final_accuracy(None, 0.2);
    assert!(clean > 0.9, "clean FedAvg {clean}");
    assert!(
        attacked < clean - 0.3,
        "the attack must hurt FedAvg: {attacked} vs {clean}"
    );
    for rule in [
        RobustRule::Median,
        RobustRule::TrimmedMean { trim: 0.25 },
        RobustRule::MultiKrum {
            byzantine: 4,
            select: 12,
        },
    ] {
        let acc = final_accuracy(Some(rule), 0.2);
        assert!(acc > clean - 0.05, "{rule}: {acc} vs clean FedAvg {clean}");
    }
    let krum = RobustRule::Krum { byzantine: 4 };
    let (krum_clean, krum_attacked) = (
        final_accuracy(Some(krum), 0.0),
        final_accuracy(Some(krum), 0.2),
    );
    assert!(
        krum_attacked > krum_clean - 0.05,
        "krum: {krum_attacked} vs {krum_clean}"
    );
    assert!(
        krum_attacked > attacked + 0.3,
        "krum {krum_attacked} vs FedAvg {attacked}"
    );
}
