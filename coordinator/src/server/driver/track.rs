//! What served experiments tell the experiment trackers (`--mlflow-uri`,
//! `--tensorboard`): an experiment's settings when it starts, each round's metrics
//! once it is published, and the final model and how it ended when it stops.
//!
//! The replica whose job published a round, or whose request changed an experiment's
//! state, reports it (the store lets only one of them succeed), so a run's records
//! come once however many replicas serve. Gathering a record reads the store on a task
//! of its own and the record then waits in the tracker's queue: neither a round nor a
//! request waits for a tracker.

use std::sync::Arc;

use uuid::Uuid;

use super::DriverError;
use crate::server::settings::ServeSettings;
use crate::server::{AppState, ServeError};
use crate::store::{Experiment, ExperimentState, Round};
use crate::tracking::mlflow::MlflowSink;
use crate::tracking::outbox::Sink;
use crate::tracking::tensorboard::TensorBoardSink;
use crate::tracking::{Record, RunRef, RunStatus, flatten_params, now_ms};

/// The trackers `settings` name.
pub(crate) fn sinks(settings: &ServeSettings) -> Result<Vec<Sink>, ServeError> {
    let mut sinks = Vec::new();
    if let Some(uri) = &settings.mlflow_uri {
        let sink = MlflowSink::new(uri).map_err(|e| ServeError::Tracking(e.to_string()))?;
        tracing::info!(uri = %uri, "experiments report to MLflow");
        sinks.push(Sink::Mlflow(sink));
    }
    if let Some(dir) = &settings.tensorboard {
        tracing::info!(dir = %dir.display(), "experiments write TensorBoard event files");
        sinks.push(Sink::TensorBoard(TensorBoardSink::new(dir.clone())));
    }
    Ok(sinks)
}

/// How trackers know `exp`: by its id, in a tracker experiment of its name, as a run
/// named after it and its id, with its spec as parameters.
pub(crate) fn run_ref(exp: &Experiment) -> RunRef {
    let id = exp.id.to_string();
    let mut params = flatten_params(&exp.spec);
    crate::tracking::set_param(&mut params, "cohort.experiment_id", id.clone());
    RunRef {
        name: format!("{}-{}", exp.name, &id[..8]),
        experiment: exp.name.clone(),
        key: id,
        params: Arc::new(params),
    }
}

/// Reports the metrics of `round`'s `attempt`, just published.
pub(crate) fn round_published(state: &AppState, experiment: Uuid, round: i64, attempt: i64) {
    if !state.tracker.is_active() {
        return;
    }
    let state = state.clone();
    tokio::spawn(async move {
        match round_record(&state, experiment, round, attempt).await {
            Ok(Some(record)) => state.tracker.push(record),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(%experiment, round, error = %e, "round not reported to trackers");
            }
        }
    });
}

async fn round_record(
    state: &AppState,
    experiment: Uuid,
    round: i64,
    attempt: i64,
) -> Result<Option<Record>, DriverError> {
    let exp = state.store.experiment(experiment).await?;
    let r = match state.store.round(experiment, round, attempt).await {
        Ok(r) => r,
        Err(crate::store::StoreError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    // This attempt's bytes only: a record per round must not read the whole history.
    let parts = state
        .store
        .participations(experiment, round, attempt)
        .await?;
    let up = parts.iter().filter_map(|p| p.bytes_up).sum::<i64>();
    let down = parts.iter().filter_map(|p| p.bytes_down).sum::<i64>();
    // Epsilon against the coordinator composes every attempt so far, so it does.
    let against_coordinator = match super::experiment_spec(&exp)?.privacy {
        Some(privacy) => {
            let rounds = state.store.rounds(experiment).await?;
            let selections = state.store.selections(experiment).await?;
            crate::server::privacy::epsilon_against_coordinator_by_attempt(
                &privacy,
                &rounds,
                &selections,
            )
            .map_err(|e| DriverError::Spec(experiment, format!("differential privacy: {e}")))?
            .get(&(round, attempt))
            .copied()
            .flatten()
        }
        None => None,
    };
    Ok(Some(Record::metrics(
        run_ref(&exp),
        round,
        &round_metrics(&r, (up, down), against_coordinator),
    )))
}

/// A published round's metrics, named as `cohort simulate --tensorboard` names them.
fn round_metrics(
    r: &Round,
    (up, down): (i64, i64),
    epsilon_coordinator: Option<f64>,
) -> Vec<(&'static str, f64)> {
    let optional = |v: Option<f64>| v.unwrap_or(f64::NAN);
    let seconds = r
        .finished_at
        .map_or(f64::NAN, |end| (end - r.started_at) as f64 / 1000.0);
    vec![
        ("accuracy/test", optional(r.test_accuracy)),
        ("loss/test", optional(r.test_loss)),
        ("loss/train", optional(r.train_loss)),
        ("clients/selected", r.selected as f64),
        ("clients/participants", r.reported as f64),
        ("clients/dropped", r.dropped as f64),
        ("privacy/epsilon", optional(r.epsilon)),
        ("privacy/epsilon_coordinator", optional(epsilon_coordinator)),
        ("bytes/up", up as f64),
        ("bytes/down", down as f64),
        ("round/attempt", r.attempt as f64),
        ("time/round_seconds", seconds),
    ]
}

/// Reports that `experiment` changed to `to`: a start (or resumption) sends its
/// parameters; an end sends the current model and how it ended.
pub(crate) fn experiment_changed(state: &AppState, experiment: Uuid, to: ExperimentState) {
    if !state.tracker.is_active() {
        return;
    }
    let status = match to {
        ExperimentState::Running => None,
        ExperimentState::Finished => Some(RunStatus::Finished),
        ExperimentState::Failed => Some(RunStatus::Failed),
        ExperimentState::Stopped => Some(RunStatus::Killed),
        ExperimentState::Created | ExperimentState::Paused => return,
    };
    let state = state.clone();
    tokio::spawn(async move {
        let exp = match state.store.experiment(experiment).await {
            Ok(exp) => exp,
            Err(e) => {
                tracing::warn!(%experiment, error = %e, "state not reported to trackers");
                return;
            }
        };
        let run = run_ref(&exp);
        let Some(status) = status else {
            state.tracker.push(Record::Start(run));
            return;
        };
        match final_model(&state, &exp).await {
            Ok(file) => state.tracker.push(Record::Artifact {
                run: run.clone(),
                name: "model.safetensors".into(),
                bytes: Arc::new(file),
            }),
            Err(e) => {
                tracing::warn!(%experiment, error = %e, "final model not sent to trackers");
            }
        }
        state.tracker.push(Record::End {
            run,
            status,
            time_ms: now_ms(),
        });
    });
}

/// `exp`'s latest model as the safetensors file users download.
async fn final_model(state: &AppState, exp: &Experiment) -> Result<Vec<u8>, DriverError> {
    let model = state
        .store
        .latest_model(exp.id)
        .await?
        .ok_or_else(|| DriverError::Aggregation("no model yet".into()))?;
    let blobs = state.blobs.clone();
    let bytes = tokio::task::spawn_blocking(move || blobs.get(&model.blob_path))
        .await
        .map_err(|e| DriverError::Aggregation(e.to_string()))??;
    super::model::model_file(exp, model.round, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RoundStage;

    /// A round's record carries what the issue names (accuracy, losses, participants,
    /// dropouts, epsilon, bytes) and leaves out what the round does not have.
    #[test]
    fn a_round_reports_its_accuracy_clients_privacy_and_bytes() {
        let r = Round {
            experiment_id: Uuid::nil(),
            round: 3,
            attempt: 2,
            stage: RoundStage::Published,
            stage_deadline: None,
            selected: 10,
            reported: 8,
            dropped: 2,
            test_accuracy: Some(0.9),
            test_loss: Some(0.3),
            train_loss: None,
            started_at: 1_000,
            finished_at: Some(3_500),
            secagg: None,
            failure: None,
            privacy: None,
            epsilon: Some(1.5),
        };
        let run = RunRef {
            key: "k".into(),
            experiment: "e".into(),
            name: "n".into(),
            params: Arc::default(),
        };
        let Record::Metrics { step, values, .. } =
            Record::metrics(run, 3, &round_metrics(&r, (800, 1600), None))
        else {
            unreachable!()
        };
        let get = |k: &str| values.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        assert_eq!(step, 3);
        assert_eq!(get("accuracy/test"), Some(0.9));
        assert_eq!(get("loss/test"), Some(0.3));
        assert_eq!(get("loss/train"), None);
        assert_eq!(get("clients/participants"), Some(8.0));
        assert_eq!(get("clients/dropped"), Some(2.0));
        assert_eq!(get("privacy/epsilon"), Some(1.5));
        assert_eq!(get("privacy/epsilon_coordinator"), None);
        assert_eq!(get("bytes/up"), Some(800.0));
        assert_eq!(get("bytes/down"), Some(1600.0));
        assert_eq!(get("time/round_seconds"), Some(2.5));
    }
}
