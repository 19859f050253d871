//! Independent, reproducible random streams derived from one user seed.
//!
//! Every random choice in a run (data split, partition, selection, dropout, each client's
//! shuffling) draws from its own stream, keyed by what it is for, the round and the
//! client. So results do not depend on thread scheduling or on the order work is done,
//! and changing one part (say, the dropout rate) leaves the other streams untouched.

/// What a random stream is used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Stream {
    /// Generating synthetic data.
    Data = 1,
    /// The train/test split.
    Split = 2,
    /// Assigning samples to clients.
    Partition = 3,
    /// Initial model parameters.
    ModelInit = 4,
    /// Choosing the clients of a round.
    Selection = 5,
    /// Deciding which selected clients drop out.
    Dropout = 6,
    /// A client's local shuffling.
    LocalTraining = 7,
    /// Secure aggregation: the round's session id and the clients' key material.
    SecureAggregation = 8,
    /// Which clients are malicious.
    Malicious = 9,
    /// Differential privacy's noise (a simulation's; a coordinator draws from the
    /// operating system).
    PrivacyNoise = 10,
    /// Each client's straggler slowdown, drawn once per run.
    Straggler = 11,
    /// FedBuff: who starts training next (round 0) and who drops out (round 1).
    AsyncSelection = 12,
    /// FedBuff: a task's local shuffling, keyed by the task's sequence number (a client
    /// may train several times on the same model version).
    AsyncTraining = 13,
    /// Compression: the rotation of a client's upload.
    UploadRotation = 14,
    /// Compression: the stochastic rounding of a client's upload.
    UploadRounding = 15,
    /// Compression: the rotation of the model a client downloads.
    DownloadRotation = 16,
    /// Compression: the stochastic rounding of the model a client downloads.
    DownloadRounding = 17,
    /// Compression under secure aggregation: the round's one rotation.
    SecureRotation = 18,
}

/// SplitMix64's finaliser: a bijection on `u64` with full avalanche, so nearby inputs
/// give unrelated outputs.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of stream `stream` for `round` and `client` under the run seed `seed`.
pub fn derive_seed(seed: u64, stream: Stream, round: u32, client: u64) -> u64 {
    let mut h = mix(seed);
    h = mix(h ^ stream as u64);
    h = mix(h ^ u64::from(round));
    mix(h ^ client)
}

/// 32 bytes for stream `stream` of `round` (for keys and session ids), from four
/// independent 64-bit seeds.
pub fn derive_seed_bytes(seed: u64, stream: Stream, round: u32) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&derive_seed(seed, stream, round, i as u64).to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn streams_rounds_and_clients_get_distinct_seeds() {
        let mut seen = HashSet::new();
        for stream in [Stream::Selection, Stream::Dropout, Stream::LocalTraining] {
            for round in 0..20 {
                for client in 0..50 {
                    assert!(seen.insert(derive_seed(7, stream, round, client)));
                }
            }
        }
        assert_eq!(
            derive_seed(1, Stream::Split, 0, 0),
            derive_seed(1, Stream::Split, 0, 0)
        );
        assert_ne!(
            derive_seed(1, Stream::Split, 0, 0),
            derive_seed(2, Stream::Split, 0, 0)
        );
    }
}
