//! Simulation across the three crates: data and training from `cohort-edge`, the
//! aggregation math from `cohort-aggregation`, the round engine from the coordinator.

use cohort_aggregation::Strategy;
use cohort_coordinator::simulate::{DatasetSpec, SimulationConfig, prepare, run_rounds, simulate};
use cohort_edge::model::ModelKind;
use cohort_edge::partition::PartitionScheme;

#[test]
fn federated_mlp_on_digits_approaches_central_accuracy() {
    let cfg = SimulationConfig {
        clients: 10,
        rounds: 8,
        partition: Some(PartitionScheme::Iid),
        ..SimulationConfig::default()
    };
    let prepared = prepare(&cfg).unwrap();
    let result = run_rounds(&cfg, &prepared, |_| Ok(())).unwrap();
    let last = result.rounds.last().unwrap();
    assert!(last.test_accuracy > 0.9, "accuracy {}", last.test_accuracy);
    assert_eq!(result.total_updates, 80);
    // Learning, not luck: the first round is clearly worse than the last.
    assert!(result.rounds[0].test_loss > last.test_loss);
}

#[test]
fn fedprox_and_fedavg_both_train_on_fedprox_synthetic() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, strategy) in [
        ("fedavg", Strategy::FedAvg),
        ("fedprox", Strategy::FedProx { mu: 1.0 }),
    ] {
        let expected = strategy.to_string();
        let cfg = SimulationConfig {
            dataset: DatasetSpec::Synthetic {
                alpha: 1.0,
                beta: 1.0,
            },
            model: ModelKind::LogReg,
            clients: 30,
            clients_per_round: Some(10),
            rounds: 5,
            local_epochs: 1,
            strategy,
            out: Some(tmp.path().join(name)),
            ..SimulationConfig::default()
        };
        let (summary, dir) = simulate(&cfg, |_| {}).unwrap();
        assert_eq!(summary.strategy, expected);
        assert_eq!(summary.data.partition, "natural");
        assert!(dir.join("summary.json").exists());
        // Ten classes: anything well above chance shows the model learns.
        assert!(
            summary.best_test_accuracy > 0.2,
            "{name}: {}",
            summary.best_test_accuracy
        );
    }
}

#[test]
fn adaptive_server_optimizers_improve_on_the_initial_model() {
    for strategy in [Strategy::FedAdam, Strategy::FedYogi, Strategy::FedAdagrad] {
        let cfg = SimulationConfig {
            dataset: DatasetSpec::BreastCancer,
            model: ModelKind::LogReg,
            clients: 10,
            rounds: 6,
            local_epochs: 1,
            strategy,
            // Adagrad's second moment only grows, so the paper's 0.01 moves it too slowly
            // for a six-round test.
            server_lr: Some(0.1),
            ..SimulationConfig::default()
        };
        let prepared = prepare(&cfg).unwrap();
        let result = run_rounds(&cfg, &prepared, |_| Ok(())).unwrap();
        let last = result.rounds.last().unwrap();
        assert!(
            last.test_accuracy > 0.85,
            "{strategy}: {}",
            last.test_accuracy
        );
    }
}
