//! FedBuff (buffered asynchronous aggregation, Nguyen et al., AISTATS 2022) as an
//! experiment mode of `cohort serve`.
//!
//! In mode `fedbuff` there is no selected cohort and no round deadline. A client that
//! checks in gets a task whenever fewer than `concurrency` tasks are outstanding; it
//! trains on the model version current when it downloads it. Its upload goes into the
//! buffer open when it arrives, whatever version it trained on, and once `buffer_size`
//! (K) updates are buffered the server takes a step: the updates' differences from the
//! models they started from are averaged with weights `n_i * s(tau_i)`, where `n_i` is
//! the client's sample count, `tau_i` its staleness (server steps taken since its base
//! version) and `s(tau) = 1 / (1 + tau)^A`, divided by the buffer's samples as in
//! [`cohort simulate --mode fedbuff`](crate::simulate), and applied with the experiment's
//! server optimizer. The next buffer opens in the same transaction that closes the full
//! one, so a slow client never holds a step back: its update simply lands, staler and
//! weighted down, in a later buffer (or is dropped when staler than `max_staleness`).
//!
//! Everything lives in the store ([`crate::store`]'s FedBuff functions) and every change
//! is one transaction, so the mode is crash-safe and runs on several coordinators the way
//! synchronous rounds do.

use std::collections::HashMap;

use cohort_aggregation::fedbuff::{BufferFold, BufferedUpdate};
use cohort_aggregation::{ModelVector, wire};
use cohort_core::ExperimentSpec;
use cohort_core::mode::FedBuffSettings;

use super::model::ExperimentModel;
use super::{DriverError, JOB_ATTEMPTS};
use crate::server::AppState;
use crate::server::driver;
use crate::store::{
    BufferRules, Experiment, ExperimentState, PublishedModel, RoundMetrics, RoundStage, StoreError,
};
use cohort_aggregation::reduce::batch_len;

/// The store's rules for an experiment's buffers.
pub fn buffer_rules(settings: &FedBuffSettings, last_step: u32) -> BufferRules {
    BufferRules {
        buffer_size: settings.buffer_size as i64,
        max_staleness: settings.max_staleness.map(i64::from),
        task_ms: settings.task_ms(),
        last_step: i64::from(last_step),
        job_attempts: JOB_ATTEMPTS,
    }
}

/// One driver step of a running FedBuff experiment: finish it once its last step is
/// published, free the slots of expired tasks, and open the first buffer. (Later buffers
/// open as their predecessors fill; see the module doc.)
pub(super) async fn step(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    settings: &FedBuffSettings,
    now: i64,
) -> Result<(), DriverError> {
    let store = &state.store;
    let version = store.latest_model(exp.id).await?.map_or(0, |m| m.round);
    if version >= i64::from(spec.rounds) {
        return driver::set_state(state, exp.id, ExperimentState::Finished).await;
    }
    store
        .expire_fedbuff_tasks(exp.id, now - settings.task_ms())
        .await?;
    // A buffer whose aggregation failed every try runs again, or fails the experiment:
    // buffers publish in order, so it would otherwise hold every later one.
    if let Some(retry) = store
        .retry_buffer_if_aggregation_failed(
            exp.id,
            version + 1,
            spec.max_round_attempts,
            JOB_ATTEMPTS,
            now,
        )
        .await?
    {
        tracing::warn!(experiment = %exp.id, buffer = version + 1, ?retry,
            "a buffer's aggregation failed every try");
        return Ok(());
    }
    if store.latest_round(exp.id).await?.is_none() {
        match store.open_buffer(exp.id, 1, now).await {
            // Another coordinator opened it, or the experiment just stopped.
            Ok(()) | Err(StoreError::Conflict(_)) => {}
            Err(StoreError::Database(e))
                if e.as_database_error()
                    .is_some_and(|d| d.is_unique_violation()) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The aggregation job of buffer `job_round`: publishes, in order, every full buffer
/// from the one after the current model up to `job_round`. A job that finds its buffer
/// already published (by an earlier run, another coordinator, or a later buffer's job
/// that took the earlier ones in order) has nothing left to do.
pub(super) async fn aggregate(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    settings: &FedBuffSettings,
    model: &ExperimentModel,
    job_round: i64,
) -> Result<(), DriverError> {
    let store = &state.store;
    let mut published_before = None;
    loop {
        let current = store
            .latest_model(exp.id)
            .await?
            .ok_or_else(|| DriverError::Aggregation("no current model".into()))?;
        let buffer = current.round + 1;
        if buffer > job_round {
            return Ok(());
        }
        if published_before == Some(current.round) {
            return Err(DriverError::Aggregation(format!(
                "buffer {buffer} did not publish"
            )));
        }
        published_before = Some(current.round);
        // The buffer's latest attempt: an aggregation that failed runs again as the next.
        let round = store.latest_attempt(exp.id, buffer).await?;
        if round.stage != RoundStage::Aggregating {
            return Err(DriverError::Aggregation(format!(
                "buffer {buffer} is {}, not full",
                round.stage.as_str()
            )));
        }
        aggregate_buffer(state, exp, spec, settings, model, &round, current).await?;
    }
}

/// Folds one full buffer into the next model version and publishes it.
async fn aggregate_buffer(
    state: &AppState,
    exp: &Experiment,
    spec: &ExperimentSpec,
    settings: &FedBuffSettings,
    model: &ExperimentModel,
    round: &crate::store::Round,
    current: PublishedModel,
) -> Result<(), DriverError> {
    let uploads = state.store.buffer_uploads(exp.id, round.round).await?;
    // Uploads are capped when they are recorded; capping again here covers rows recorded
    // before the cap existed.
    let cap = spec.weight_cap();
    let (weighted, samples) = uploads
        .iter()
        .filter_map(|u| Some((u.train_loss?, u.upload.num_samples.min(cap) as f64)))
        .fold((0.0, 0.0), |(l, n), (loss, s)| (l + loss * s, n + s));
    let step = driver::ModelStep::new(state, exp.id, spec, model, &current, round.round);
    let blobs = state.blobs.clone();
    let reducer = state.reducer.clone();
    let model = model.clone();
    let exp_id = exp.id;
    let exponent = settings.staleness_exponent;
    let (published, tested) = tokio::task::spawn_blocking(
        move || -> Result<(PublishedModel, RoundMetrics), DriverError> {
            let bad = |e: &dyn std::fmt::Display| DriverError::Aggregation(e.to_string());
            let layout = model.layout().clone();
            let global = step.load(&current.blob_path)?;
            let mut bases: HashMap<i64, ModelVector> = HashMap::new();
            let mut fold =
                BufferFold::new(layout.clone(), reducer.as_ref(), exponent).map_err(|e| bad(&e))?;
            // A batch at a time, as the synchronous path does: memory holds one batch of
            // updates (and the distinct models they started from), not the buffer.
            for batch in uploads.chunks(batch_len(layout.len())) {
                let mut trained = Vec::with_capacity(batch.len());
                for u in batch {
                    if let std::collections::hash_map::Entry::Vacant(slot) =
                        bases.entry(u.base_version)
                    {
                        slot.insert(step.load(&driver::model_blob(exp_id, u.base_version))?);
                    }
                    let bytes = blobs.get_verified(&u.upload.blob_path, &u.upload.sha256)?;
                    trained.push(wire::decode(&layout, &bytes).map_err(|e| bad(&e))?);
                }
                let items: Vec<BufferedUpdate<'_>> = batch
                    .iter()
                    .zip(&trained)
                    .map(|(u, t)| {
                        (
                            t,
                            &bases[&u.base_version],
                            u.upload.num_samples.clamp(1, cap.max(1)) as u64,
                            u32::try_from(u.staleness).unwrap_or(u32::MAX),
                        )
                    })
                    .collect();
                fold.fold_batch(&items).map_err(|e| bad(&e))?;
            }
            let target = fold.target(&global).map_err(|e| bad(&e))?;
            step.finish(global, &target)
        },
    )
    .await
    .map_err(|e| DriverError::Aggregation(e.to_string()))??;
    let metrics = RoundMetrics {
        train_loss: (samples > 0.0).then(|| weighted / samples),
        ..tested
    };
    driver::publish(state, exp.id, round, &published, metrics).await
}
