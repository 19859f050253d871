//! The header every compressed body starts with, and the checks a receiver makes.
//!
//! ```text
//! offset  bytes  field
//! 0       2      magic "CZ"
//! 2       1      format version (1)
//! 3       1      scheme: 1 quantize, 2 sign, 3 topk
//! 4       1      bits per coordinate (quantize: 1, 2, 4 or 8; sign: 1; topk: 0)
//! 5       3      zero
//! 8       8      dimension (u64, little-endian)
//! 16      8      rotation seed (u64, little-endian; 0 for topk)
//! 24      ...    the scheme's body
//! ```
//!
//! Bodies, all little-endian:
//!
//! - quantize: per rotation block ([`super::rotation::blocks`]) its lowest and highest
//!   rotated value (`f32`, `f32`), then the levels packed `bits` to a coordinate, the
//!   first coordinate in the lowest bits of the first byte;
//! - sign: per block its scale (`f32`), then one bit per coordinate (set: positive),
//!   packed the same way;
//! - topk: the count `k` (`u64`), then the `k` positions in increasing order, each as the
//!   gap from the previous one (the first from `-1`) minus one, in LEB128, then the `k`
//!   values (`f32`).
//!
//! Nothing in the header is trusted: [`Header::read`] compares every field with what the
//! experiment asked for and the round expects.

use super::Compression;

/// Bytes before a scheme's body.
pub const HEADER_LEN: usize = 24;

const MAGIC: [u8; 2] = *b"CZ";
const VERSION: u8 = 1;

/// What a receiver expects of a compressed body, from the experiment and the round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// Parameters of the model.
    pub dimension: usize,
    /// The rotation seed the round assigned to this sender (ignored by `topk`); `None`
    /// takes the header's (a client decoding the model it downloaded: a coordinator's
    /// choice of rotation can only hurt its own model).
    pub rotation_seed: Option<u64>,
}

/// Why a body is not a valid compressed vector of what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CompressError {
    /// Shorter than its header says it must be.
    #[error("compressed body is {found} bytes, too short for its header ({needed} needed)")]
    TooShort {
        /// Bytes needed for what the header announced so far.
        needed: usize,
        /// Bytes received.
        found: usize,
    },
    /// The first bytes are not the format's magic.
    #[error("not a compressed body: it does not start with \"CZ\" (was it sent uncompressed?)")]
    Magic,
    /// A format version this build does not read.
    #[error("compressed body format version {0} is not supported (this build reads version 1)")]
    Version(u8),
    /// The header names another scheme than the experiment's.
    #[error("compressed body says {found}, the experiment asks for {expected}")]
    Scheme {
        /// The experiment's scheme.
        expected: String,
        /// What the header says.
        found: String,
    },
    /// The header's dimension is not the model's.
    #[error("compressed body holds {found} parameters, the model has {expected}")]
    Dimension {
        /// Parameters the model has.
        expected: usize,
        /// Parameters the header announces.
        found: u64,
    },
    /// The rotation seed is not the one the round assigned.
    #[error("compressed body was rotated with seed {found}, the round assigned {expected}")]
    Seed {
        /// The round's seed for this sender.
        expected: u64,
        /// The header's.
        found: u64,
    },
    /// Reserved header bytes are not zero.
    #[error("compressed body's reserved header bytes are not zero")]
    Reserved,
    /// The body's length is not what its header implies.
    #[error("compressed body is {found} bytes, its header implies {expected}")]
    Length {
        /// Bytes implied.
        expected: usize,
        /// Bytes received.
        found: usize,
    },
    /// A value (an input coordinate, a block's range or scale, a sent value) is NaN or
    /// infinite.
    #[error("value {index} is not finite")]
    NonFinite {
        /// Position of the first bad value (a block number for ranges and scales).
        index: usize,
    },
    /// A block's range is reversed.
    #[error("block {block}'s range is reversed (lowest above highest)")]
    Range {
        /// The block.
        block: usize,
    },
    /// `topk`: the count is not what the experiment's fraction gives.
    #[error(
        "compressed body sends {found} coordinates, the experiment's fraction gives {expected}"
    )]
    Count {
        /// `ceil(F d)`.
        expected: usize,
        /// The header's count.
        found: u64,
    },
    /// `topk`: a position is malformed or past the model.
    #[error("compressed body's position {index} is malformed or past the model")]
    Position {
        /// Which of the `k` positions.
        index: usize,
    },
}

/// A checked header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Parameters of the vector.
    pub dimension: usize,
    /// The rotation seed.
    pub rotation_seed: u64,
}

fn scheme_byte(c: Compression) -> (u8, u8) {
    match c {
        Compression::Quantize { bits } => (1, bits),
        Compression::Sign => (2, 1),
        Compression::TopK { .. } => (3, 0),
        Compression::None => (0, 32),
    }
}

fn scheme_name(scheme: u8, bits: u8) -> String {
    match scheme {
        1 => format!("quantize:{bits}"),
        2 => "sign".into(),
        3 => "topk".into(),
        other => format!("scheme {other}"),
    }
}

impl Header {
    /// Writes the header of `scheme` for a vector of `dimension`.
    pub fn write(scheme: Compression, dimension: usize, rotation_seed: u64, out: &mut Vec<u8>) {
        let (s, bits) = scheme_byte(scheme);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[VERSION, s, bits, 0, 0, 0]);
        out.extend_from_slice(&(dimension as u64).to_le_bytes());
        let seed = if scheme.rotates() { rotation_seed } else { 0 };
        out.extend_from_slice(&seed.to_le_bytes());
    }

    /// Reads and checks the header of a body that should hold `scheme`; returns it and
    /// the scheme's body.
    pub fn read<'a>(
        bytes: &'a [u8],
        scheme: Compression,
        expected: &Expected,
    ) -> Result<(Header, &'a [u8]), CompressError> {
        if bytes.len() >= 2 && bytes[..2] != MAGIC {
            return Err(CompressError::Magic);
        }
        if bytes.len() < HEADER_LEN {
            return Err(CompressError::TooShort {
                needed: HEADER_LEN,
                found: bytes.len(),
            });
        }
        if bytes[2] != VERSION {
            return Err(CompressError::Version(bytes[2]));
        }
        let (s, bits) = scheme_byte(scheme);
        if (bytes[3], bytes[4]) != (s, bits) {
            return Err(CompressError::Scheme {
                expected: scheme.to_string(),
                found: scheme_name(bytes[3], bytes[4]),
            });
        }
        if bytes[5..8] != [0, 0, 0] {
            return Err(CompressError::Reserved);
        }
        let dimension = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        if dimension != expected.dimension as u64 {
            return Err(CompressError::Dimension {
                expected: expected.dimension,
                found: dimension,
            });
        }
        let seed = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        let want = if scheme.rotates() {
            expected.rotation_seed.unwrap_or(seed)
        } else {
            0
        };
        if seed != want {
            return Err(CompressError::Seed {
                expected: want,
                found: seed,
            });
        }
        Ok((
            Header {
                dimension: expected.dimension,
                rotation_seed: seed,
            },
            &bytes[HEADER_LEN..],
        ))
    }
}

/// Packs `levels` (each below `2^bits`) `bits` to a coordinate, lowest bits first.
pub(super) fn pack(levels: impl Iterator<Item = u8>, bits: u8, count: usize, out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + (count * usize::from(bits)).div_ceil(8), 0);
    let per_byte = 8 / usize::from(bits);
    for (i, q) in levels.enumerate() {
        out[start + i / per_byte] |= q << ((i % per_byte) * usize::from(bits));
    }
}

/// Coordinate `i`'s level in a body packed by [`pack`].
pub(super) fn level(packed: &[u8], bits: u8, i: usize) -> u8 {
    let per_byte = 8 / usize::from(bits);
    let mask = ((1u16 << bits) - 1) as u8;
    (packed[i / per_byte] >> ((i % per_byte) * usize::from(bits))) & mask
}

/// Reads `count` little-endian `f32`s from the front of `bytes`, refusing non-finite
/// ones; returns them and the rest.
pub(super) fn read_floats(bytes: &[u8], count: usize) -> Result<(Vec<f32>, &[u8]), CompressError> {
    let needed = count * 4;
    if bytes.len() < needed {
        return Err(CompressError::TooShort {
            needed: HEADER_LEN + needed,
            found: HEADER_LEN + bytes.len(),
        });
    }
    let values: Vec<f32> = bytes[..needed]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(CompressError::NonFinite { index });
    }
    Ok((values, &bytes[needed..]))
}
