//! A plain round's compressed upload, and the error-feedback residual that `sign` and
//! `topk:F` keep between rounds in the state directory (so that what one round's
//! compression dropped reaches the coordinator in a later round, even across restarts).

use std::path::{Path, PathBuf};

use cohort_aggregation::compress::{CompressError, Compression, ErrorFeedback};

/// Where the residual of `experiment` is kept: little-endian `f32`s.
pub fn residual_path(state_dir: &Path, experiment: uuid::Uuid) -> PathBuf {
    state_dir.join("feedback").join(format!("{experiment}.f32"))
}

/// Why an upload could not be compressed.
#[derive(Debug, thiserror::Error)]
pub enum UploadCompressionError {
    /// The difference could not be encoded (a non-finite value).
    #[error("compressing the upload: {0}")]
    Compress(#[from] CompressError),
    /// The residual could not be read or kept.
    #[error("error-feedback residual {path}: {source}")]
    State {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

/// Compresses `difference` (the trained model minus the model received) in `scheme`
/// with the rotation the task assigned, adding the residual kept for the experiment and
/// keeping the new one. A residual of another length (the model changed) starts again
/// from zero. `rounding_seed` drives the stochastic rounding (it needs no secrecy).
pub fn compress_upload(
    state_dir: &Path,
    experiment: uuid::Uuid,
    (scheme, rotation_seed): (Compression, u64),
    difference: &[f32],
    rounding_seed: u64,
) -> Result<Vec<u8>, UploadCompressionError> {
    let path = residual_path(state_dir, experiment);
    let state = |source| UploadCompressionError::State {
        path: path.clone(),
        source,
    };
    let mut feedback = ErrorFeedback::new();
    if scheme.uses_error_feedback()
        && let Some(residual) =
            crate::state_file::read_f32s(&path, difference.len()).map_err(state)?
    {
        feedback = ErrorFeedback::from_residual(residual);
    }
    let body = feedback.compress(scheme, difference, rotation_seed, rounding_seed)?;
    if scheme.uses_error_feedback() {
        crate::state_file::write_f32s(&path, feedback.residual()).map_err(state)?;
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_aggregation::compress::Expected;

    /// The residual survives a restart: what two uploads sent plus what is kept is what
    /// was fed in, though the second upload ran in a "new process" that read the file.
    #[test]
    fn the_residual_is_kept_between_uploads_and_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let experiment = uuid::Uuid::from_u128(5);
        let scheme = Compression::TopK { fraction: 0.25 };
        let rounds = [vec![1.0f32, -2.0, 0.5, 0.25], vec![0.1f32, 0.2, -3.0, 0.4]];
        let mut sent = [0.0f32; 4];
        for d in &rounds {
            let body = compress_upload(dir.path(), experiment, (scheme, 0), d, 1).unwrap();
            let expected = Expected {
                dimension: 4,
                rotation_seed: Some(0),
            };
            for (s, v) in sent
                .iter_mut()
                .zip(scheme.decode(&body, &expected).unwrap())
            {
                *s += v;
            }
        }
        let kept = std::fs::read(residual_path(dir.path(), experiment)).unwrap();
        let kept: Vec<f32> = kept
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for i in 0..4 {
            let fed = rounds[0][i] + rounds[1][i];
            assert!((fed - sent[i] - kept[i]).abs() < 1e-6, "{i}");
        }
        // One coordinate of four went up in the last upload: the other three wait.
        assert_eq!(kept.iter().filter(|v| **v != 0.0).count(), 3);
    }
}
