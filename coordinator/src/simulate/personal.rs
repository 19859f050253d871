//! Personalisation in a simulation: each client's state between rounds, and the
//! per-client evaluation that shows what personalisation bought.
//!
//! Every client holds out part of its own data (`--client-holdout`); after each round
//! the global model is scored on each client's held-out split, and with `--personalise`
//! so is each client's personalised model ([`cohort_edge::personal`]): the run reports
//! the mean and the 10th percentile of both over the clients, and the final figures of
//! every client in `clients.csv`.

use std::collections::HashMap;
use std::sync::Mutex;

use cohort_aggregation::ModelVector;
use cohort_edge::personal::{self, PersonalState, Personalisation};
use cohort_edge::train::{LocalModel, TrainConfig, Trainer};
use rayon::prelude::*;
use serde::Serialize;

use super::SimulationError;

/// A personalised run's scheme and every client's state.
pub(super) struct PersonalRun {
    pub(super) scheme: Personalisation,
    states: Mutex<HashMap<u64, PersonalState>>,
}

impl PersonalRun {
    pub(super) fn new(scheme: Personalisation) -> Self {
        Self {
            scheme,
            states: Mutex::new(HashMap::new()),
        }
    }

    /// Client `client`'s training task: its personalised update, its state kept.
    pub(super) fn train<M: personal::TrainFrom>(
        &self,
        client: u64,
        model: &M,
        global: &ModelVector,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<cohort_edge::train::LocalUpdate, M::Error> {
        let state = self.state(client);
        let out = personal::train(&self.scheme, model, global, state.as_deref(), config, seed)?;
        if let Some(kept) = out.state {
            self.states
                .lock()
                .expect("no panics while held")
                .insert(client, kept);
        }
        Ok(out.upload)
    }

    pub(super) fn state(&self, client: u64) -> Option<PersonalState> {
        self.states
            .lock()
            .expect("no panics while held")
            .get(&client)
            .cloned()
    }
}

/// One client's accuracy on its own held-out split.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientAccuracy {
    /// The client (partition id).
    pub client: u64,
    /// Its training samples.
    pub train_samples: usize,
    /// Its held-out samples.
    pub holdout_samples: usize,
    /// The global model's accuracy on them.
    pub global_accuracy: f64,
    /// Its personalised model's, with `--personalise`.
    pub personal_accuracy: Option<f64>,
}

pub use cohort_core::personalisation::mean_and_p10;

/// Scores `global` (and each client's personalised model) on every client's held-out
/// split, in parallel. `clients[i]` trains client `i`, `holdouts[i]` holds its split
/// (clients with no held-out samples are left out).
pub(super) fn evaluate_clients(
    clients: &[LocalModel],
    holdouts: &[Option<LocalModel>],
    personal: Option<&PersonalRun>,
    global: &ModelVector,
    config: &TrainConfig,
    seed: u64,
) -> Result<Vec<ClientAccuracy>, SimulationError> {
    clients
        .par_iter()
        .zip(holdouts)
        .enumerate()
        .filter_map(|(i, (model, holdout))| holdout.as_ref().map(|h| (i, model, h)))
        .map(|(i, model, holdout)| {
            let global_accuracy = holdout.evaluate(global)?.accuracy;
            let personal_accuracy = match personal {
                None => None,
                Some(run) => {
                    let state = run.state(i as u64);
                    let mine = personal::personal_model(
                        &run.scheme,
                        model,
                        global,
                        state.as_deref(),
                        config,
                        seed ^ i as u64,
                    )?;
                    Some(holdout.evaluate(&mine)?.accuracy)
                }
            };
            Ok(ClientAccuracy {
                client: i as u64,
                train_samples: model.num_samples(),
                holdout_samples: holdout.num_samples(),
                global_accuracy,
                personal_accuracy,
            })
        })
        .collect::<Result<Vec<_>, cohort_edge::train::TrainError>>()
        .map_err(SimulationError::from)
}

#[cfg(test)]
mod tests {
    use crate::simulate::{SimulationConfig, prepare, run_rounds};

    /// FedPer's personal layers never reach an upload: after a whole run (every round's
    /// uploads averaged into it) the global model's head is still the initial one, while
    /// its shared layers moved.
    #[test]
    fn no_upload_carries_a_personal_layer() {
        let cfg = SimulationConfig {
            clients: 10,
            clients_per_round: Some(5),
            rounds: 3,
            local_epochs: 1,
            partition: Some("shards:2".parse().unwrap()),
            personalise: Some("fedper:layers.1".parse().unwrap()),
            ..SimulationConfig::default()
        };
        let pop = prepare(&cfg).unwrap();
        let scheme = cfg.personalise.clone().unwrap();
        let mask = scheme.personal_mask(pop.spec().layout()).unwrap();
        let initial = pop.spec().init(crate::seeds::derive_seed(
            cfg.seed,
            crate::seeds::Stream::ModelInit,
            0,
            0,
        ));
        let result = run_rounds(&cfg, &pop, |_| Ok(())).unwrap();
        let end = result.final_model.values();
        let mut shared_moved = false;
        for (i, personal) in mask.iter().enumerate() {
            if *personal {
                assert_eq!(end[i], initial.values()[i], "personal parameter {i} moved");
            } else {
                shared_moved |= end[i] != initial.values()[i];
            }
        }
        assert!(shared_moved);
    }
}
