//! The random rotation applied before quantisation: a randomised Hadamard transform
//! (Suresh et al., "Distributed Mean Estimation with Limited Communication", 2017).
//!
//! A vector's largest coordinates decide a quantiser's step; after `x -> H D x` (random
//! signs `D`, then the orthonormal Walsh-Hadamard matrix `H`) every coordinate is a
//! random-signed mix of all of them, so the range shrinks from `max |x_i|` towards
//! `|x| / sqrt(d)` and the same bits carry far less error. The transform is orthonormal
//! and its own inverse up to the signs, so the receiver undoes it exactly (up to float
//! rounding), and because it is linear it may also be undone on a sum of vectors rotated
//! with the same seed.
//!
//! The Hadamard matrix needs a power-of-two length. Rather than pad (which can nearly
//! double what is sent), a vector is cut into blocks whose lengths are powers of two:
//! whole blocks of [`MAX_BLOCK`], then the binary digits of what remains, largest
//! first. Each block is rotated on its own.

use std::ops::Range;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// The longest block rotated as one: large enough that every coordinate mixes with
/// tens of thousands of others, small enough that a block's transform stays in cache.
pub const MAX_BLOCK: usize = 1 << 16;

/// The blocks a vector of `len` coordinates is rotated (and quantised) in: contiguous,
/// in order, each a power of two long, together covering `0..len`.
pub fn blocks(len: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while len - start >= MAX_BLOCK {
        out.push(start..start + MAX_BLOCK);
        start += MAX_BLOCK;
    }
    let rest = len - start;
    for bit in (0..usize::BITS).rev() {
        let size = 1usize << bit;
        if rest & size != 0 {
            out.push(start..start + size);
            start += size;
        }
    }
    out
}

/// The random signs `D` of a rotation: bit `i` of the seed's ChaCha8 stream is the sign
/// of coordinate `i` (set: negated).
fn signs(seed: u64, len: usize) -> Vec<u64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len.div_ceil(64)).map(|_| rng.next_u64()).collect()
}

fn negated(signs: &[u64], i: usize) -> bool {
    signs[i / 64] >> (i % 64) & 1 == 1
}

/// The orthonormal fast Walsh-Hadamard transform of one power-of-two block, in place.
fn hadamard(block: &mut [f64]) {
    let n = block.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for pair in block.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (x, y) in a.iter_mut().zip(b.iter_mut()) {
                let (s, t) = (*x + *y, *x - *y);
                *x = s;
                *y = t;
            }
        }
        h *= 2;
    }
    let scale = 1.0 / (n as f64).sqrt();
    for v in block.iter_mut() {
        *v *= scale;
    }
}

/// Rotates `values` (`x -> H D x`, block by block) with the signs of `seed`, in `f64`
/// so that rotating back loses nothing a reader of `f32` would see.
pub fn rotate(seed: u64, values: &[f32]) -> Vec<f64> {
    let signs = signs(seed, values.len());
    let mut out: Vec<f64> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let v = f64::from(*v);
            if negated(&signs, i) { -v } else { v }
        })
        .collect();
    for block in blocks(values.len()) {
        hadamard(&mut out[block]);
    }
    out
}

/// Undoes [`rotate`] with the same `seed`: `y -> D H y` (the transform is symmetric and
/// orthonormal, the signs their own inverse).
pub fn unrotate(seed: u64, rotated: &mut [f64]) {
    for block in blocks(rotated.len()) {
        hadamard(&mut rotated[block]);
    }
    let signs = signs(seed, rotated.len());
    for (i, v) in rotated.iter_mut().enumerate() {
        if negated(&signs, i) {
            *v = -*v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn blocks_are_powers_of_two_that_cover_the_vector_in_order() {
        for len in [
            0,
            1,
            2,
            3,
            7,
            8,
            1000,
            101_770,
            MAX_BLOCK,
            MAX_BLOCK * 3 + 5,
        ] {
            let b = blocks(len);
            let mut at = 0;
            for r in &b {
                assert_eq!(r.start, at);
                assert!(
                    r.len().is_power_of_two() && r.len() <= MAX_BLOCK,
                    "{len}: {r:?}"
                );
                at = r.end;
            }
            assert_eq!(at, len);
        }
        // 101770 = 65536 + 32768 + 2048 + 1024 + 256 + 128 + 8 + 2: no padding.
        assert_eq!(blocks(101_770).len(), 8);
    }

    #[test]
    fn rotation_spreads_a_spike_over_its_block() {
        // The case rotation exists for: one large coordinate sets a quantiser's range.
        let mut x = vec![0.0f32; 1024];
        x[17] = 32.0;
        let y = rotate(9, &x);
        for v in &y {
            assert!((v.abs() - 1.0).abs() < 1e-12, "{v}"); // 32 / sqrt(1024)
        }
    }

    proptest! {
        /// The receiver gets back exactly what was rotated, up to float rounding, and the
        /// length (the energy) is kept.
        #[test]
        fn rotating_back_restores_the_vector(
            x in prop::collection::vec(-1e3f32..1e3, 0..3000),
            seed in any::<u64>(),
        ) {
            let mut y = rotate(seed, &x);
            let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|a| a * a).sum::<f64>().sqrt();
            let nx = norm(&mut x.iter().map(|v| f64::from(*v)));
            let ny = norm(&mut y.iter().copied());
            prop_assert!((nx - ny).abs() <= 1e-9 * nx.max(1.0));
            unrotate(seed, &mut y);
            for (a, b) in x.iter().zip(&y) {
                prop_assert!((f64::from(*a) - b).abs() <= 1e-9 * f64::from(a.abs()).max(1.0));
                prop_assert_eq!(*a, *b as f32);
            }
        }

        /// Linear: the sum of vectors rotated with one seed rotates back to their sum,
        /// which is what a secure round relies on.
        #[test]
        fn the_sum_of_rotations_is_the_rotation_of_the_sum(
            a in prop::collection::vec(-10f32..10.0, 1..500),
            seed in any::<u64>(),
        ) {
            let b: Vec<f32> = a.iter().rev().copied().collect();
            let (ra, rb) = (rotate(seed, &a), rotate(seed, &b));
            let mut sum: Vec<f64> = ra.iter().zip(&rb).map(|(x, y)| x + y).collect();
            unrotate(seed, &mut sum);
            for ((x, y), s) in a.iter().zip(&b).zip(&sum) {
                prop_assert!((f64::from(*x) + f64::from(*y) - s).abs() < 1e-9);
            }
        }
    }
}
