//! Rotated quantisation: `quantize:B` (unbiased stochastic rounding to `2^B` levels per
//! block) and `sign` (one bit per coordinate and a scale per block).
//!
//! **Unbiasedness of `quantize:B`.** A rotated coordinate `y` in its block's range
//! `[lo, hi]` sits at `t = (y - lo) / delta` steps (`delta = (hi - lo) / (2^B - 1)`); it
//! is sent as `floor(t) + 1` with probability `t - floor(t)` and as `floor(t)` otherwise,
//! so the decoded `lo + q delta` has expectation `y`. The rotation is linear, so the
//! decoded vector's expectation is the input, whatever the rotation seed. Each
//! coordinate's variance is at most `delta^2 / 4`.
//!
//! `sign` sends `scale * sign(y)` with `scale` the block's mean `|y|` (the scale that
//! minimises the squared error of a sign vector). It is biased: its sender keeps the
//! error and adds it to its next vector ([`super::ErrorFeedback`]).

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

use super::Compression;
use super::format::{CompressError, Header, level, pack, read_floats};
use super::rotation::{blocks, rotate, unrotate};

/// A uniform draw in `[0, 1)` with 53 random bits.
fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// `x` as an `f32` no greater than `x` (for a block's lowest value) or, with `up`, no
/// smaller (its highest), so that the stored range still holds every value.
fn outward(x: f64, up: bool) -> f32 {
    let v = x as f32;
    match (up, f64::from(v).partial_cmp(&x)) {
        (false, Some(std::cmp::Ordering::Greater)) => v.next_down(),
        (true, Some(std::cmp::Ordering::Less)) => v.next_up(),
        _ => v,
    }
}

/// Encodes `values` as `quantize:bits` (see the module's description).
pub(super) fn encode_levels(
    values: &[f32],
    bits: u8,
    rotation_seed: u64,
    rounding_seed: u64,
) -> Vec<u8> {
    let scheme = Compression::Quantize { bits };
    let d = values.len();
    let y = rotate(rotation_seed, values);
    let mut out = Vec::with_capacity(scheme.encoded_len(d));
    Header::write(scheme, d, rotation_seed, &mut out);
    let top = f64::from((1u16 << bits) - 1);
    let mut ranges = Vec::new();
    for block in blocks(d) {
        let part = &y[block];
        let lo = outward(part.iter().copied().fold(f64::INFINITY, f64::min), false);
        let hi = outward(part.iter().copied().fold(f64::NEG_INFINITY, f64::max), true);
        out.extend_from_slice(&lo.to_le_bytes());
        out.extend_from_slice(&hi.to_le_bytes());
        ranges.push((f64::from(lo), f64::from(hi)));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(rounding_seed);
    let levels = blocks(d)
        .into_iter()
        .zip(ranges)
        .flat_map(|(block, (lo, hi))| block.map(move |i| (i, lo, hi)))
        .map(|(i, lo, hi)| {
            let step = (hi - lo) / top;
            if step <= 0.0 {
                return 0;
            }
            let t = ((y[i] - lo) / step).clamp(0.0, top);
            let below = t.floor();
            let up = uniform(&mut rng) < t - below;
            (below + f64::from(u8::from(up))).min(top) as u8
        });
    pack(levels, bits, d, &mut out);
    out
}

/// Checks that a packed body is exactly `count * bits` bits long, its padding zero.
fn check_packed(packed: &[u8], bits: u8, count: usize, before: usize) -> Result<(), CompressError> {
    let len = (count * usize::from(bits)).div_ceil(8);
    if packed.len() != len {
        return Err(CompressError::Length {
            expected: before + len,
            found: before + packed.len(),
        });
    }
    let used = (count * usize::from(bits)) % 8;
    if used != 0 && packed[len - 1] >> used != 0 {
        return Err(CompressError::Reserved);
    }
    Ok(())
}

/// The rotated vector back in the input's coordinates, as `f32`.
fn finish(header: &Header, mut y: Vec<f64>) -> Result<Vec<f32>, CompressError> {
    unrotate(header.rotation_seed, &mut y);
    let out: Vec<f32> = y.into_iter().map(|v| v as f32).collect();
    match out.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(CompressError::NonFinite { index }),
        None => Ok(out),
    }
}

/// Decodes the body of a `quantize:bits` vector whose header has been checked.
pub(super) fn decode_levels(
    header: &Header,
    bits: u8,
    body: &[u8],
) -> Result<Vec<f32>, CompressError> {
    let d = header.dimension;
    let blocks = blocks(d);
    let (ranges, packed) = read_floats(body, blocks.len() * 2)?;
    let before = super::format::HEADER_LEN + ranges.len() * 4;
    check_packed(packed, bits, d, before)?;
    let top = f64::from((1u16 << bits) - 1);
    let mut y = vec![0.0f64; d];
    for (b, block) in blocks.into_iter().enumerate() {
        let (lo, hi) = (f64::from(ranges[2 * b]), f64::from(ranges[2 * b + 1]));
        if lo > hi {
            return Err(CompressError::Range { block: b });
        }
        let step = (hi - lo) / top;
        for i in block {
            y[i] = lo + f64::from(level(packed, bits, i)) * step;
        }
    }
    finish(header, y)
}

/// Encodes `values` as `sign`.
pub(super) fn encode_signs(values: &[f32], rotation_seed: u64) -> Vec<u8> {
    let d = values.len();
    let y = rotate(rotation_seed, values);
    let mut out = Vec::with_capacity(Compression::Sign.encoded_len(d));
    Header::write(Compression::Sign, d, rotation_seed, &mut out);
    for block in blocks(d) {
        let n = block.len() as f64;
        let scale = (y[block].iter().map(|v| v.abs()).sum::<f64>() / n) as f32;
        out.extend_from_slice(&scale.to_le_bytes());
    }
    pack(y.iter().map(|v| u8::from(*v >= 0.0)), 1, d, &mut out);
    out
}

/// Decodes the body of a `sign` vector whose header has been checked.
pub(super) fn decode_signs(header: &Header, body: &[u8]) -> Result<Vec<f32>, CompressError> {
    let d = header.dimension;
    let blocks = blocks(d);
    let (scales, packed) = read_floats(body, blocks.len())?;
    check_packed(packed, 1, d, super::format::HEADER_LEN + scales.len() * 4)?;
    let mut y = vec![0.0f64; d];
    for (b, block) in blocks.into_iter().enumerate() {
        let scale = f64::from(scales[b]);
        if scale < 0.0 {
            return Err(CompressError::Range { block: b });
        }
        for i in block {
            y[i] = if level(packed, 1, i) == 1 {
                scale
            } else {
                -scale
            };
        }
    }
    finish(header, y)
}
