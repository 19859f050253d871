//! What travels between the simulated coordinator and its clients: each direction's
//! compression, the clients' error-feedback residuals, and the bytes it all takes.
//!
//! A client receives the global model (compressed with `--compress-down`: each client
//! decodes its own copy, rotated and rounded with its own seeds) and trains from what it
//! received; its update is the difference from that. A plain round's update goes up
//! compressed with `--compress-up` (plus the client's residual, for `sign` and `topk`)
//! and the coordinator adds what it decodes to its own exact model. A secure round's
//! update is quantised inside the protocol ([`crate::simulate::run`]), so here it is only
//! counted.

use std::collections::HashMap;
use std::sync::Mutex;

use cohort_aggregation::ModelVector;
use cohort_aggregation::compress::{Compression, ErrorFeedback, Expected};
use rayon::prelude::*;

use super::population::Params;
use super::{ConfigError, SimulationError};
use crate::engine::ClientId;
use crate::seeds::{Stream, derive_seed};

/// Bytes a round moved, over all its clients.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes uploaded (updates, masked or not).
    pub bytes_up: u64,
    /// Bytes downloaded (models).
    pub bytes_down: u64,
}

/// The links of one run.
pub(super) struct Links {
    up: Compression,
    down: Compression,
    seed: u64,
    residuals: Mutex<HashMap<ClientId, ErrorFeedback>>,
    traffic: Mutex<Traffic>,
}

/// The four seeds of a client's round: its upload's rotation and rounding, its
/// download's rotation and rounding.
fn seeds(run_seed: u64, round: u32, client: ClientId, stream: [Stream; 2]) -> (u64, u64) {
    (
        derive_seed(run_seed, stream[0], round, client.0),
        derive_seed(run_seed, stream[1], round, client.0),
    )
}

impl Links {
    pub(super) fn new(up: Compression, down: Compression, seed: u64) -> Self {
        Self {
            up,
            down,
            seed,
            residuals: Mutex::new(HashMap::new()),
            traffic: Mutex::new(Traffic::default()),
        }
    }

    fn count(&self, up: u64, down: u64) {
        let mut t = self.traffic.lock().expect("no panics while held");
        t.bytes_up += up;
        t.bytes_down += down;
    }

    /// Counts an upload the caller encoded itself (a secure round's masked input).
    pub(super) fn count_upload(&self, bytes: usize) {
        self.count(bytes as u64, 0);
    }

    /// This round's bytes so far, and a fresh count for the next.
    pub(super) fn take_traffic(&self) -> Traffic {
        std::mem::take(&mut *self.traffic.lock().expect("no panics while held"))
    }

    /// The models clients `ids` receive in `round`, and their bytes counted: `None` when
    /// the model goes uncompressed (every client trains from `global` itself).
    pub(super) fn downloads(
        &self,
        round: u32,
        ids: &[ClientId],
        global: &ModelVector,
    ) -> Result<Option<Vec<ModelVector>>, SimulationError> {
        if self.down == Compression::None {
            self.count(0, (ids.len() * global.len() * 4) as u64);
            return Ok(None);
        }
        let expected = |rotation_seed| Expected {
            dimension: global.len(),
            rotation_seed: Some(rotation_seed),
        };
        let received = ids
            .par_iter()
            .map(|&id| {
                let (rotation, rounding) = seeds(
                    self.seed,
                    round,
                    id,
                    [Stream::DownloadRotation, Stream::DownloadRounding],
                );
                let bytes = self.down.encode(global.values(), rotation, rounding)?;
                let values = self.down.decode(&bytes, &expected(rotation))?;
                let model = ModelVector::new(global.layout().clone(), values)
                    .expect("the model's own layout");
                Ok((model, bytes.len()))
            })
            .collect::<Result<Vec<_>, cohort_aggregation::compress::CompressError>>()
            .map_err(|e| ConfigError(format!("--compress-down {}: {e}", self.down)))?;
        self.count(0, received.iter().map(|(_, b)| *b as u64).sum());
        Ok(Some(received.into_iter().map(|(m, _)| m).collect()))
    }

    /// What the coordinator makes of client `id`'s trained parameters in a plain round:
    /// the update (from the model the client `received`) goes up compressed, and the
    /// coordinator adds what it decodes to its own `global`. Bytes are counted. `None`:
    /// the parameters arrive as they are (nothing is compressed, or the update is not
    /// finite and the round's own checks will refuse it).
    pub(super) fn upload(
        &self,
        round: u32,
        id: ClientId,
        received: &ModelVector,
        global: &ModelVector,
        params: &Params<'_>,
    ) -> Result<Option<Vec<f32>>, SimulationError> {
        if self.up == Compression::None && self.down == Compression::None {
            self.count((global.len() * 4) as u64, 0);
            return Ok(None);
        }
        let update: Vec<f32> = params
            .values()
            .iter()
            .zip(received.values())
            .map(|(p, r)| p - r)
            .collect();
        if update.iter().any(|v| !v.is_finite()) {
            self.count((global.len() * 4) as u64, 0);
            return Ok(None);
        }
        let (rotation, rounding) = seeds(
            self.seed,
            round,
            id,
            [Stream::UploadRotation, Stream::UploadRounding],
        );
        let mut feedback = self
            .residuals
            .lock()
            .expect("no panics while held")
            .remove(&id)
            .unwrap_or_default();
        let compressed = feedback
            .compress(self.up, &update, rotation, rounding)
            .and_then(|bytes| {
                let expected = Expected {
                    dimension: update.len(),
                    rotation_seed: Some(rotation),
                };
                Ok((self.up.decode(&bytes, &expected)?, bytes.len()))
            });
        if self.up.uses_error_feedback() {
            self.residuals
                .lock()
                .expect("no panics while held")
                .insert(id, feedback);
        }
        let (decoded, bytes) =
            compressed.map_err(|e| ConfigError(format!("--compress-up {}: {e}", self.up)))?;
        self.count(bytes as u64, 0);
        Ok(Some(
            global
                .values()
                .iter()
                .zip(decoded)
                .map(|(g, d)| g + d)
                .collect(),
        ))
    }

    /// What the coordinator makes of client `id`'s trained parameters in a secure round:
    /// the same update, from the exact `global` (the protocol quantises and counts it).
    pub(super) fn rebase(
        received: &ModelVector,
        global: &ModelVector,
        params: &Params<'_>,
    ) -> Vec<f32> {
        params
            .values()
            .iter()
            .zip(received.values())
            .zip(global.values())
            .map(|((p, r), g)| g + (p - r))
            .collect()
    }
}
