//! Compression settings of an experiment, per direction, and the rules that decide which
//! combinations may run (the math is [`cohort_aggregation::compress`]).
//!
//! - **Upload** (client to coordinator): `none`, `quantize:B`, `sign` or `topk:F`. Under
//!   secure aggregation only `quantize:B` (or `none`): the coordinator sees only a sum,
//!   so the scheme must commute with summing. Rotation and stochastic rounding do (one
//!   rotation per round, unbiased rounding into a ring wide enough for the sum); the
//!   scales of `sign` and the positions of `topk` differ from client to client, so their
//!   sum is neither a sign vector nor sparse.
//! - **Download** (coordinator to client): `none` or `quantize:B`. The biased schemes
//!   need their sender to keep a residual per receiver, and a model, unlike an update,
//!   is not sparse.

use cohort_aggregation::compress::Compression;
use cohort_aggregation::secagg::quantize::WORD_BITS;
use cohort_edge::protocol::TaskCompression;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The fewest bits per weight a downloaded model may be quantised to. An update's
/// rounding error averages out over clients and rounds; a model's is what every client
/// of the round trains from: at 2 bits mnist10k's MLP lost 15 points of accuracy, at 1
/// bit it diverged.
pub const MIN_DOWNLOAD_BITS: u8 = 4;

/// How updates and models travel.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct CompressionSpec {
    /// Client to coordinator: `none`, `quantize:B` (B = 1, 2, 4, 8; rotated, unbiased),
    /// `sign` (rotated, with error feedback) or `topk:F` (the largest fraction F, with
    /// error feedback; plain rounds only).
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "quantize:4"))]
    pub upload: Compression,
    /// Coordinator to client: `none`, `quantize:4` or `quantize:8`.
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "quantize:8"))]
    pub download: Compression,
    /// Secure aggregation with `quantize:B`: the width of the masked model words, 8, 16
    /// or 32. Absent: the narrowest that holds the sum of every selected client's values
    /// (`clients x (2^B - 1) < 2^width`).
    #[cfg_attr(feature = "openapi", schema(minimum = 8, maximum = 32))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub word_bits: Option<u32>,
}

/// What the rest of the experiment says that decides whether a compression may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressionContext {
    /// Clients selected per round, when rounds are secure (their sum must fit a word).
    pub secure_parties: Option<usize>,
    /// Whether secure rounds carry distributed noise (which needs the 32-bit ring).
    pub distributed_noise: bool,
}

impl CompressionSpec {
    /// Whether anything is compressed.
    pub fn is_on(&self) -> bool {
        self.upload != Compression::None || self.download != Compression::None
    }

    /// Every problem with these settings in `context`, each with the field it is about
    /// (`compression.upload`, ...) and a message that names the setting and says why.
    pub fn problems(&self, context: CompressionContext) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if matches!(self.download, Compression::Sign | Compression::TopK { .. }) {
            out.push((
                "compression.download",
                format!(
                    "compression.download: {} is for uploads only: it needs its sender to keep \
                     a residual per receiver, and a model is not sparse; use none or quantize:B",
                    self.download
                ),
            ));
        }
        if let Compression::Quantize { bits } = self.download
            && bits < MIN_DOWNLOAD_BITS
        {
            out.push((
                "compression.download",
                format!(
                    "compression.download: quantize:{bits} leaves each weight one of {} values \
                     per block, too coarse for a model to train from (it diverges); models \
                     take quantize:4 or quantize:8",
                    1u32 << bits
                ),
            ));
        }
        if let Some(w) = self.word_bits
            && !WORD_BITS.contains(&w)
        {
            out.push((
                "compression.word_bits",
                format!("compression.word_bits must be 8, 16 or 32, got {w}"),
            ));
        }
        let Some(parties) = context.secure_parties else {
            if self.word_bits.is_some() {
                out.push((
                    "compression.word_bits",
                    "compression.word_bits sizes masked words: it needs secure_aggregation".into(),
                ));
            }
            return out;
        };
        match self.upload {
            Compression::TopK { .. } => out.push((
                "compression.upload",
                format!(
                    "compression.upload: {} cannot run under secure aggregation: the \
                     coordinator only sees the sum of masked vectors, and clients keep \
                     different coordinates, so the sum is not sparse (every coordinate \
                     would have to be masked and sent); use quantize:B",
                    self.upload
                ),
            )),
            Compression::Sign => out.push((
                "compression.upload",
                "compression.upload: sign cannot run under secure aggregation: each client's \
                 signs come with its own scales, so a masked sum of sign vectors is not the \
                 sum of the updates; use quantize:1"
                    .into(),
            )),
            Compression::Quantize { bits } => {
                if context.distributed_noise {
                    out.push((
                        "compression.upload",
                        "compression.upload: quantize:B cannot carry distributed noise under \
                         secure aggregation: the noise needs the 32-bit ring; use none"
                            .into(),
                    ));
                } else if let Some(w) = self.word_bits.filter(|w| WORD_BITS.contains(w)) {
                    let sum = parties as u64 * ((1u64 << bits) - 1);
                    if sum >= 1u64 << w {
                        out.push((
                            "compression.word_bits",
                            format!(
                                "compression.word_bits: a {w}-bit word is too narrow for {parties} \
                                 clients at {bits} bits: their sum reaches {parties} x {} = {sum}, \
                                 above 2^{w} - 1",
                                (1u64 << bits) - 1
                            ),
                        ));
                    }
                }
            }
            Compression::None => {
                if self.word_bits.is_some() {
                    out.push((
                        "compression.word_bits",
                        "compression.word_bits needs compression.upload quantize:B".into(),
                    ));
                }
            }
        }
        out
    }

    /// The quantisation of a secure round under these settings: `base` with the upload's
    /// bits, the word width and the round's rotation seed (the same for every client, so
    /// that the coordinator can rotate the sum back).
    pub fn secure_quantization(
        &self,
        base: cohort_aggregation::secagg::QuantizationParams,
        rotation_seed: u64,
    ) -> cohort_aggregation::secagg::QuantizationParams {
        match self.upload {
            Compression::Quantize { bits } => cohort_aggregation::secagg::QuantizationParams {
                bits: Some(u32::from(bits)),
                word_bits: self.word_bits,
                rotation_seed: Some(rotation_seed),
                ..base
            },
            _ => base,
        }
    }
}

/// What a rotation seed is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeedUse {
    /// A client's upload in a round attempt.
    Upload = 1,
    /// The model a client downloads (by model version).
    Download = 2,
    /// A secure round attempt's one rotation, the same for every client.
    SecureRound = 3,
}

/// SplitMix64's finaliser: full avalanche, so that neighbouring rounds and clients get
/// unrelated seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The rotation seed of `use_` in `experiment`'s round (or model version) `round`,
/// attempt `attempt`, for `client` (none for a secure round's shared seed). Derived, not
/// stored: the coordinator computes it again to check an upload. Rotation seeds are not
/// secrets (the rounding noise is the client's own); they keep to 53 bits so that a JSON
/// reader with only doubles reads them exactly.
pub fn rotation_seed(
    experiment: Uuid,
    round: i64,
    attempt: i64,
    client: Option<Uuid>,
    use_: SeedUse,
) -> u64 {
    let (e, c) = (experiment.as_u128(), client.map_or(0, |c| c.as_u128()));
    let words = [
        use_ as u64,
        e as u64,
        (e >> 64) as u64,
        round as u64,
        attempt as u64,
        c as u64,
        (c >> 64) as u64,
    ];
    words.iter().fold(0u64, |h, w| mix(h ^ w)) & ((1 << 53) - 1)
}

impl CompressionSpec {
    /// What a client's task says of compression in round `round`, attempt `attempt`:
    /// both schemes and the seed its upload must be rotated with. `None` when nothing is
    /// compressed.
    pub fn task(
        &self,
        experiment: Uuid,
        round: i64,
        attempt: i64,
        client: Uuid,
    ) -> Option<TaskCompression> {
        self.is_on().then(|| TaskCompression {
            upload: self.upload,
            upload_rotation_seed: rotation_seed(
                experiment,
                round,
                attempt,
                Some(client),
                SeedUse::Upload,
            ),
            download: self.download,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(upload: &str, download: &str, word_bits: Option<u32>) -> CompressionSpec {
        CompressionSpec {
            upload: upload.parse().unwrap(),
            download: download.parse().unwrap(),
            word_bits,
        }
    }

    fn refused(s: CompressionSpec, secure: Option<usize>) -> Vec<(&'static str, String)> {
        s.problems(CompressionContext {
            secure_parties: secure,
            distributed_noise: false,
        })
    }

    #[test]
    fn seeds_differ_by_every_input_and_fit_a_double() {
        let (e, c) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let base = rotation_seed(e, 3, 1, Some(c), SeedUse::Upload);
        assert_eq!(base, rotation_seed(e, 3, 1, Some(c), SeedUse::Upload));
        for other in [
            rotation_seed(Uuid::from_u128(9), 3, 1, Some(c), SeedUse::Upload),
            rotation_seed(e, 4, 1, Some(c), SeedUse::Upload),
            rotation_seed(e, 3, 2, Some(c), SeedUse::Upload),
            rotation_seed(e, 3, 1, None, SeedUse::Upload),
            rotation_seed(e, 3, 1, Some(c), SeedUse::Download),
        ] {
            assert_ne!(other, base);
            assert!(other < 1 << 53);
        }
    }

    #[test]
    fn each_bad_combination_is_refused_naming_the_setting() {
        let plain_ok = [
            ("quantize:4", "quantize:4"),
            ("sign", "none"),
            ("topk:0.01", "quantize:8"),
        ];
        for (up, down) in plain_ok {
            assert!(
                refused(spec(up, down, None), None).is_empty(),
                "{up} {down}"
            );
        }
        assert!(refused(spec("quantize:4", "quantize:4", None), Some(10)).is_empty());
        assert!(refused(spec("quantize:4", "none", Some(16)), Some(4369)).is_empty());
        let cases = [
            (
                spec("none", "topk:0.1", None),
                None,
                "compression.download",
                "for uploads only",
            ),
            (
                spec("none", "sign", None),
                None,
                "compression.download",
                "for uploads only",
            ),
            (
                spec("none", "quantize:2", None),
                None,
                "compression.download",
                "too coarse",
            ),
            (
                spec("topk:0.01", "none", None),
                Some(10),
                "compression.upload",
                "cannot run under secure aggregation",
            ),
            (
                spec("sign", "none", None),
                Some(10),
                "compression.upload",
                "use quantize:1",
            ),
            (
                spec("quantize:4", "none", Some(8)),
                Some(100),
                "compression.word_bits",
                "8-bit word is too narrow for 100 clients at 4 bits",
            ),
            (
                spec("quantize:4", "none", Some(16)),
                Some(4370),
                "compression.word_bits",
                "too narrow for 4370 clients",
            ),
            (
                spec("quantize:4", "none", Some(12)),
                Some(10),
                "compression.word_bits",
                "must be 8, 16 or 32",
            ),
            (
                spec("quantize:4", "none", Some(16)),
                None,
                "compression.word_bits",
                "needs secure_aggregation",
            ),
            (
                spec("none", "none", Some(16)),
                Some(10),
                "compression.word_bits",
                "needs compression.upload quantize:B",
            ),
        ];
        for (s, secure, field, says) in cases {
            let problems = refused(s, secure);
            assert!(
                problems
                    .iter()
                    .any(|(f, m)| *f == field && m.contains(says) && m.contains(field)),
                "{s:?}: {problems:?}"
            );
        }
        let noisy = spec("quantize:4", "none", None).problems(CompressionContext {
            secure_parties: Some(10),
            distributed_noise: true,
        });
        assert!(noisy[0].1.contains("32-bit ring"));
    }
}
