//! `topk:F`: the largest coordinates by magnitude, as positions and values.
//!
//! Positions go as LEB128 gaps: at a 1% density the gap between neighbours is about 100,
//! one or two bytes instead of four, so a coordinate costs about 5 bytes sent instead of
//! the 400 bytes of the 100 plain floats it stands for.

use super::Compression;
use super::format::{CompressError, HEADER_LEN, Header, read_floats};

/// Encodes the `k` largest-magnitude coordinates of `values` (ties go to the lower
/// position, so the choice is deterministic).
pub(super) fn encode(values: &[f32], k: usize) -> Vec<u8> {
    let d = values.len();
    let mut order: Vec<u32> = (0..d as u32).collect();
    if k < d {
        let larger = |a: &u32, b: &u32| {
            let (x, y) = (values[*a as usize].abs(), values[*b as usize].abs());
            y.total_cmp(&x).then(a.cmp(b))
        };
        order.select_nth_unstable_by(k, larger);
        order.truncate(k);
    }
    order.sort_unstable();
    let fraction = if d == 0 { 1.0 } else { k as f64 / d as f64 };
    let mut out = Vec::with_capacity(HEADER_LEN + 8 + k * 6);
    Header::write(Compression::TopK { fraction }, d, 0, &mut out);
    out.extend_from_slice(&(k as u64).to_le_bytes());
    let mut previous: i64 = -1;
    for &i in &order {
        let mut gap = (i64::from(i) - previous - 1) as u64;
        previous = i64::from(i);
        loop {
            let byte = (gap & 0x7f) as u8;
            gap >>= 7;
            if gap == 0 {
                out.push(byte);
                break;
            }
            out.push(byte | 0x80);
        }
    }
    for &i in &order {
        out.extend_from_slice(&values[i as usize].to_le_bytes());
    }
    out
}

/// Decodes a `topk` body whose header has been checked: `kept` coordinates of a vector
/// of `dimension`, the rest zero.
pub(super) fn decode(
    body: &[u8],
    dimension: usize,
    kept: usize,
) -> Result<Vec<f32>, CompressError> {
    let (count, mut rest) = match body.split_first_chunk::<8>() {
        Some((c, rest)) => (u64::from_le_bytes(*c), rest),
        None => {
            return Err(CompressError::TooShort {
                needed: HEADER_LEN + 8,
                found: HEADER_LEN + body.len(),
            });
        }
    };
    if count != kept as u64 {
        return Err(CompressError::Count {
            expected: kept,
            found: count,
        });
    }
    let mut positions = Vec::with_capacity(kept);
    let mut previous: u64 = u64::MAX; // -1: the first gap counts from before position 0
    for index in 0..kept {
        let mut gap: u64 = 0;
        let mut shift = 0;
        loop {
            let (&byte, tail) = rest
                .split_first()
                .ok_or(CompressError::Position { index })?;
            rest = tail;
            if shift > 56 {
                return Err(CompressError::Position { index });
            }
            gap |= u64::from(byte & 0x7f) << shift;
            shift += 7;
            if byte & 0x80 == 0 {
                break;
            }
        }
        let at = previous
            .wrapping_add(1)
            .checked_add(gap)
            .filter(|p| *p < dimension as u64)
            .ok_or(CompressError::Position { index })?;
        positions.push(at as usize);
        previous = at;
    }
    let before = body.len() - rest.len();
    let (values, tail) = read_floats(rest, kept)?;
    if !tail.is_empty() {
        return Err(CompressError::Length {
            expected: HEADER_LEN + before + kept * 4,
            found: HEADER_LEN + body.len(),
        });
    }
    let mut out = vec![0.0f32; dimension];
    for (p, v) in positions.into_iter().zip(values) {
        out[p] = v;
    }
    Ok(out)
}
