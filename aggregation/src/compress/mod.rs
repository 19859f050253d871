//! Compressed updates and models: fewer bytes per round in each direction.
//!
//! Three schemes, named as a user writes them (`Compression`'s `FromStr`):
//!
//! - `quantize:B` (B = 1, 2, 4, 8): rotate ([`rotation`]), then round each coordinate
//!   stochastically to one of `2^B` levels spread over its block's range. Unbiased: the
//!   decoded vector's expectation is the input ([`quantize`]).
//! - `sign`: rotate, then send each coordinate's sign and one scale per block (the
//!   block's mean absolute value). Biased; the sender keeps what was lost and adds it
//!   to its next update ([`ErrorFeedback`]), which is what makes it converge.
//! - `topk:F`: send the `ceil(F d)` largest coordinates by magnitude, with error
//!   feedback. No rotation (sparsity is the point).
//!
//! `none` sends the plain little-endian `f32` body of [`crate::wire`]. Every compressed
//! body starts with a header that says what was sent ([`format`]); the receiver checks
//! it against what the experiment asked for rather than trusting it.

mod feedback;
pub mod format;
pub mod quantize;
pub mod rotation;
mod sparse;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;

pub use feedback::ErrorFeedback;
pub use format::{CompressError, Expected};

/// The bit widths `quantize:B` accepts: each divides a byte, so a coordinate never
/// straddles two.
pub const QUANTIZE_BITS: [u8; 4] = [1, 2, 4, 8];

/// How a vector travels in one direction.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Compression {
    /// Plain little-endian `f32`, 32 bits per parameter.
    #[default]
    None,
    /// Random rotation, then unbiased stochastic rounding to `bits` bits per parameter.
    Quantize {
        /// 1, 2, 4 or 8.
        bits: u8,
    },
    /// Random rotation, then one sign bit per parameter and a scale per block; biased,
    /// used with error feedback.
    Sign,
    /// The largest `fraction` of the parameters by magnitude, as positions and values;
    /// biased, used with error feedback.
    TopK {
        /// In `(0, 1]`.
        fraction: f64,
    },
}

/// Why a scheme's name does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompressionParseError {
    /// Not one of the schemes.
    #[error(
        "unknown compression `{0}`: use none, quantize:B (B = 1, 2, 4 or 8), sign or topk:F (0 < F <= 1)"
    )]
    Unknown(String),
    /// `quantize:B` with a `B` not in [`QUANTIZE_BITS`].
    #[error("quantize:{0}: the bits must be 1, 2, 4 or 8")]
    Bits(String),
    /// `topk:F` with an `F` outside `(0, 1]`.
    #[error("topk:{0}: the fraction must be a number above 0 and at most 1")]
    Fraction(String),
}

impl FromStr for Compression {
    type Err = CompressionParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        match s.split_once(':') {
            None if s == "none" => Ok(Self::None),
            None if s == "sign" => Ok(Self::Sign),
            Some(("quantize", b)) => match b.parse::<u8>() {
                Ok(bits) if QUANTIZE_BITS.contains(&bits) => Ok(Self::Quantize { bits }),
                _ => Err(CompressionParseError::Bits(b.to_string())),
            },
            Some(("topk", f)) => match f.parse::<f64>() {
                Ok(fraction) if fraction > 0.0 && fraction <= 1.0 => Ok(Self::TopK { fraction }),
                _ => Err(CompressionParseError::Fraction(f.to_string())),
            },
            _ => Err(CompressionParseError::Unknown(s.to_string())),
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("none"),
            Self::Quantize { bits } => write!(f, "quantize:{bits}"),
            Self::Sign => f.write_str("sign"),
            Self::TopK { fraction } => write!(f, "topk:{fraction}"),
        }
    }
}

impl serde::Serialize for Compression {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Compression {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Compression {
    /// Whether the sender must keep what compression lost and add it to its next vector
    /// (the biased schemes).
    pub fn uses_error_feedback(self) -> bool {
        matches!(self, Self::Sign | Self::TopK { .. })
    }

    /// Whether the decoded vector's expectation is the input, so that a mean of many
    /// decoded vectors tends to the mean of the inputs without any sender state.
    pub fn is_unbiased(self) -> bool {
        matches!(self, Self::None | Self::Quantize { .. })
    }

    /// Whether the scheme rotates before it encodes (and so needs a rotation seed).
    pub fn rotates(self) -> bool {
        matches!(self, Self::Quantize { .. } | Self::Sign)
    }

    /// The number of coordinates `topk:F` sends of a vector of `dimension`: `ceil(F d)`,
    /// at least 1 (for a non-empty vector).
    pub fn kept(self, dimension: usize) -> usize {
        match self {
            Self::TopK { fraction } => {
                ((fraction * dimension as f64).ceil() as usize).clamp(dimension.min(1), dimension)
            }
            _ => dimension,
        }
    }

    /// Encodes `values` under this scheme. `rotation_seed` picks the rotation (the
    /// receiver must know it: [`Expected::rotation_seed`]); `rounding_seed` the
    /// stochastic rounding (private to the sender). `None` gives the plain
    /// [`crate::wire`] body.
    pub fn encode(
        self,
        values: &[f32],
        rotation_seed: u64,
        rounding_seed: u64,
    ) -> Result<Vec<u8>, CompressError> {
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(CompressError::NonFinite { index });
        }
        Ok(match self {
            Self::None => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::Quantize { bits } => {
                quantize::encode_levels(values, bits, rotation_seed, rounding_seed)
            }
            Self::Sign => quantize::encode_signs(values, rotation_seed),
            Self::TopK { .. } => sparse::encode(values, self.kept(values.len())),
        })
    }

    /// Decodes a body that should hold a vector compressed with this scheme, checking
    /// everything the header says against `expected` (dimension, scheme, bits, seed,
    /// count) and every value it carries (finite, in range), and refusing trailing
    /// bytes.
    pub fn decode(self, bytes: &[u8], expected: &Expected) -> Result<Vec<f32>, CompressError> {
        match self {
            Self::None => {
                if bytes.len() != expected.dimension * 4 {
                    return Err(CompressError::Length {
                        expected: expected.dimension * 4,
                        found: bytes.len(),
                    });
                }
                let values: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                    return Err(CompressError::NonFinite { index });
                }
                Ok(values)
            }
            _ => {
                let (header, body) = format::Header::read(bytes, self, expected)?;
                match self {
                    Self::Quantize { bits } => quantize::decode_levels(&header, bits, body),
                    Self::Sign => quantize::decode_signs(&header, body),
                    Self::TopK { .. } => {
                        sparse::decode(body, header.dimension, self.kept(header.dimension))
                    }
                    Self::None => unreachable!("handled above"),
                }
            }
        }
    }

    /// Bytes this scheme sends for a vector of `dimension` (exact for every scheme but
    /// `topk`, whose positions take a varying number of bytes: its bound with 2-byte
    /// gaps is given).
    pub fn encoded_len(self, dimension: usize) -> usize {
        let blocks = rotation::blocks(dimension).len();
        match self {
            Self::None => dimension * 4,
            Self::Quantize { bits } => {
                format::HEADER_LEN + blocks * 8 + (dimension * usize::from(bits)).div_ceil(8)
            }
            Self::Sign => format::HEADER_LEN + blocks * 4 + dimension.div_ceil(8),
            Self::TopK { .. } => format::HEADER_LEN + 8 + self.kept(dimension) * 6,
        }
    }
}

#[cfg(test)]
mod naming_tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_say_what_is_allowed() {
        for s in [
            "none",
            "quantize:1",
            "quantize:2",
            "quantize:4",
            "quantize:8",
            "sign",
            "topk:0.01",
            "topk:1",
        ] {
            assert_eq!(s.parse::<Compression>().unwrap().to_string(), s);
        }
        for (bad, says) in [
            ("quantize:3", "1, 2, 4 or 8"),
            ("quantize:16", "1, 2, 4 or 8"),
            ("quantize:", "1, 2, 4 or 8"),
            ("topk:0", "above 0"),
            ("topk:1.5", "at most 1"),
            ("topk:NaN", "above 0"),
            ("zip", "unknown compression `zip`"),
        ] {
            let e = bad.parse::<Compression>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn topk_keeps_at_least_one_and_at_most_all() {
        let k = |f: f64, d: usize| Compression::TopK { fraction: f }.kept(d);
        assert_eq!(k(0.01, 101_770), 1018);
        assert_eq!(k(0.01, 5), 1);
        assert_eq!(k(1.0, 5), 5);
        assert_eq!(k(0.5, 0), 0);
    }
}
