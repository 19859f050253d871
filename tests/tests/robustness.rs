//! Robust aggregation under attack, on digits: with a fifth of the clients (2 of 10)
//! sending their update sign-flipped and scaled by 4, or scaled by 10, plain FedAvg
//! collapses while the coordinate-wise median, the trimmed mean, Krum and Multi-Krum each
//! stay within 0.05 of the clean FedAvg run.
//!
//! Ten clients of about 144 samples each: Krum keeps one client's update a round, so its
//! accuracy is that of a model trained on one client's share at a time; with 20 clients
//! of about 72 samples it plateaus near 0.83 (see the README).

use cohort_aggregation::robust::RobustRule;
use cohort_coordinator::simulate::{Attack, SimulationConfig, prepare, run_rounds};
use cohort_edge::partition::PartitionScheme;

fn final_accuracy(aggregator: Option<RobustRule>, malicious: f64, attack: Attack) -> f64 {
    let cfg = SimulationConfig {
        clients: 10,
        rounds: 30,
        local_epochs: 2,
        partition: Some(PartitionScheme::Iid),
        aggregator,
        malicious,
        attack,
        ..SimulationConfig::default()
    };
    cfg.validate().unwrap();
    let prepared = prepare(&cfg).unwrap();
    let result = run_rounds(&cfg, &prepared, |_| Ok(())).unwrap();
    result.rounds.last().unwrap().test_accuracy
}

#[test]
fn robust_rules_hold_up_where_fedavg_does_not() {
    let clean = final_accuracy(None, 0.0, Attack::SignFlip { scale: 4.0 });
    assert!(clean > 0.9, "clean FedAvg {clean}");
    for attack in [
        Attack::SignFlip { scale: 4.0 },
        Attack::Scale { factor: 10.0 },
    ] {
        let attacked = final_accuracy(None, 0.2, attack);
        assert!(
            attacked < clean - 0.3,
            "{attack}: the attack must hurt FedAvg: {attacked} vs {clean}"
        );
        for rule in [
            RobustRule::Median,
            RobustRule::TrimmedMean { trim: 0.25 },
            RobustRule::Krum { byzantine: 2 },
            RobustRule::MultiKrum {
                byzantine: 2,
                select: 6,
            },
        ] {
            let acc = final_accuracy(Some(rule), 0.2, attack);
            eprintln!(
                "{attack} {rule}: {acc:.4} (clean FedAvg {clean:.4}, attacked FedAvg {attacked:.4})"
            );
            assert!(
                acc > clean - 0.05,
                "{attack} {rule}: {acc} vs clean FedAvg {clean}"
            );
        }
    }
}
