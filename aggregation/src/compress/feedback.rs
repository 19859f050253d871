//! Error feedback (Stich et al. 2018; Karimireddy et al. 2019): a sender using a biased
//! scheme (`sign`, `topk`) keeps what compression dropped and adds it to its next vector,
//! so that nothing is lost for good, only delayed.

use super::{CompressError, Compression, Expected};

/// The residual a sender carries from one compressed vector to the next.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
}

impl ErrorFeedback {
    /// A sender that has dropped nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Restores a residual kept between runs (its length is checked at the next
    /// [`compress`](Self::compress)).
    pub fn from_residual(residual: Vec<f32>) -> Self {
        Self { residual }
    }

    /// What has been dropped and not yet sent.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Compresses `update` plus the residual under `scheme` and keeps what the receiver
    /// will not see. An unbiased scheme needs no feedback: its residual stays empty. A
    /// residual of another length (the model changed) is dropped.
    pub fn compress(
        &mut self,
        scheme: Compression,
        update: &[f32],
        rotation_seed: u64,
        rounding_seed: u64,
    ) -> Result<Vec<u8>, CompressError> {
        if !scheme.uses_error_feedback() {
            self.residual.clear();
            return scheme.encode(update, rotation_seed, rounding_seed);
        }
        if self.residual.len() != update.len() {
            self.residual = vec![0.0; update.len()];
        }
        let carried: Vec<f32> = update
            .iter()
            .zip(&self.residual)
            .map(|(u, r)| u + r)
            .collect();
        let bytes = scheme.encode(&carried, rotation_seed, rounding_seed)?;
        let expected = Expected {
            dimension: update.len(),
            rotation_seed: Some(rotation_seed),
        };
        let sent = scheme.decode(&bytes, &expected)?;
        self.residual = carried.iter().zip(&sent).map(|(c, s)| c - s).collect();
        Ok(bytes)
    }
}
