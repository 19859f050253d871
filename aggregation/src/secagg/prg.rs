//! The mask generator of secure aggregation: ChaCha20 keystreams added to or subtracted
//! from a vector in Z_2^32.
//!
//! In SecAgg (Bonawitz et al. 2017) every client hides its quantised update under masks
//! that cancel in the sum: a pairwise mask shared with each other client (added by one of
//! the pair, subtracted by the other) and a self mask that the server removes once enough
//! clients have revealed its seed. A mask is a pseudo-random vector expanded from a 32-byte
//! seed, and both ends must expand it to exactly the same words. The server's hot loop
//! applies hundreds of masks, each from its own seed, to one accumulator of up to 2^28
//! words, so the expansion has to run at the speed of the cipher core.
//!
//! # The keystream
//!
//! A mask is the ChaCha20 keystream of RFC 8439: 20 rounds, the seed as the 256-bit key,
//! [`MASK_NONCE`] as the 96-bit nonce, and the 32-bit block counter starting at 0. The
//! state of block `b` is the usual
//!
//! ```text
//! word  0..4   "expand 32-byte k"       word 12      b (the block counter)
//! word  4..12  seed, 8 little-endian    word 13..16  MASK_NONCE, 3 little-endian words
//! ```
//!
//! The keystream is read as little-endian `u32` words in order: word `i` is bytes
//! `4i..4i + 4` of the keystream, so block `b` holds words `16b..16b + 16`, and one seed
//! gives 2^32 blocks * 16 = 2^36 words ([`KEYSTREAM_WORDS`]). Applying a mask to an
//! accumulator means `acc[i] = acc[i] ± word(first_word + i)` with wrapping arithmetic, so
//! a long vector can be cut into ranges (one per thread, one per message) that each give
//! the same words as one pass over the whole.
//!
//! # Speed
//!
//! [`apply_masks`] works in tiles of a few KiB of the accumulator: for each tile it runs
//! every mask, generating that tile's keystream in SIMD registers (16 blocks at once with
//! AVX-512, one block per lane, 8 with AVX2), so the tile stays in L1 while the keystream
//! never touches memory. With one or two masks each group of blocks is transposed from
//! the registers' block-per-lane layout into word order and added; with more, the tile
//! itself is transposed in place into the block-per-lane layout, every mask is added
//! there, and the tile is transposed back, so the transposition is paid per tile rather
//! than per mask. The implementation is chosen at run time ([`backend`]; the CPU features
//! are detected by `std`, which caches them); the portable one is a plain RFC 8439 block
//! function and the reference the others are tested against.
//!
//! On one Sapphire Rapids core this gives about 6 GB/s of keystream with AVX-512, 3 GB/s
//! with AVX2 and 0.55 GB/s portable (see `benches/mask_prg.rs`).

use thiserror::Error;

/// The 96-bit ChaCha20 nonce every mask of one protocol uses (domain separation).
pub const MASK_NONCE: [u8; 12] = *b"cohort-mask\0";

/// Number of `u32` words in one seed's keystream: 2^32 blocks of 16 words.
pub const KEYSTREAM_WORDS: u64 = 1 << 36;

/// Words in one ChaCha20 block.
const BLOCK_WORDS: usize = 16;

/// "expand 32-byte k", the first four words of every ChaCha20 state.
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];

/// Whether a mask is added to or subtracted from the accumulator (mod 2^32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskSign {
    /// `acc[i] = acc[i] + word(i)`, wrapping.
    Add,
    /// `acc[i] = acc[i] - word(i)`, wrapping.
    Subtract,
}

/// One mask to apply: the ChaCha20 key (the seed) and whether it is added or subtracted.
#[derive(Clone, Copy)]
pub struct Mask<'a> {
    /// The 256-bit ChaCha20 key the mask is expanded from. Secret.
    pub seed: &'a [u8; 32],
    /// Whether the mask is added or subtracted.
    pub sign: MaskSign,
}

impl std::fmt::Debug for Mask<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The seed is a secret: never print it, not even in a panic message or a log.
        f.debug_struct("Mask")
            .field("sign", &self.sign)
            .finish_non_exhaustive()
    }
}

/// Why a mask could not be applied. Nothing was written when one is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PrgError {
    /// The words asked for run past the end of the keystream ([`KEYSTREAM_WORDS`]).
    #[error(
        "keystream words {first_word}..{first_word}+{len} run past the end of the keystream (2^36 words)"
    )]
    OutOfRange {
        /// The first keystream word asked for.
        first_word: u64,
        /// How many words were asked for.
        len: usize,
    },
    /// [`apply_masks_with`] or [`keystream_with`] was asked for an implementation this CPU
    /// cannot run.
    #[error("the {0} backend is not available on this machine")]
    BackendUnavailable(Backend),
}

/// An implementation of the mask generator. All give bit-identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Plain Rust, one RFC 8439 block at a time. Runs everywhere.
    Portable,
    /// x86-64 AVX2: 8 blocks at a time in 256-bit registers.
    Avx2,
    /// x86-64 AVX-512F: 16 blocks at a time in 512-bit registers.
    Avx512,
}

impl Backend {
    /// Every backend, slowest first.
    pub const ALL: [Backend; 3] = [Backend::Portable, Backend::Avx2, Backend::Avx512];

    /// The fastest backend this CPU supports: the one [`apply_masks`] uses.
    pub fn detected() -> Backend {
        Engine::detected().backend()
    }

    /// Whether this CPU can run the backend.
    pub fn is_available(self) -> bool {
        Engine::for_backend(self).is_some()
    }

    /// Short lower-case name for reports: `"portable"`, `"avx2"` or `"avx512"`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Portable => "portable",
            Backend::Avx2 => "avx2",
            Backend::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which implementation [`apply_masks`] uses on this machine: `"avx512"`, `"avx2"` or
/// `"portable"`, for benchmark reports.
pub fn backend() -> &'static str {
    Backend::detected().name()
}

/// Applies every mask in `masks` to `acc`, where `acc[0]` is keystream word `first_word`.
///
/// `acc[i] = acc[i] ± word(first_word + i)`, wrapping, for each mask, so a caller can split
/// a long vector into ranges (e.g. one per thread) and get the same result as one call over
/// the whole vector. Fails, leaving `acc` untouched, if `first_word + acc.len()` exceeds
/// [`KEYSTREAM_WORDS`].
pub fn apply_masks(masks: &[Mask<'_>], first_word: u64, acc: &mut [u32]) -> Result<(), PrgError> {
    check_range(first_word, acc.len())?;
    let prepared = prepare(masks);
    apply_range(
        Engine::detected(),
        &MASK_NONCE_WORDS,
        &prepared,
        first_word,
        acc,
    );
    Ok(())
}

/// [`apply_masks`] with a chosen implementation, for benchmarks and cross-checks.
///
/// Fails with [`PrgError::BackendUnavailable`] if this CPU cannot run `backend`.
pub fn apply_masks_with(
    backend: Backend,
    masks: &[Mask<'_>],
    first_word: u64,
    acc: &mut [u32],
) -> Result<(), PrgError> {
    let engine = Engine::for_backend(backend).ok_or(PrgError::BackendUnavailable(backend))?;
    check_range(first_word, acc.len())?;
    let prepared = prepare(masks);
    apply_range(engine, &MASK_NONCE_WORDS, &prepared, first_word, acc);
    Ok(())
}

/// Same as [`apply_masks`], but splits `acc` into ranges over the current rayon pool.
///
/// Every thread works on disjoint words and runs all masks over its range tile by tile, so
/// the results are bit-identical to [`apply_masks`] (addition mod 2^32 does not care about
/// order).
pub fn apply_masks_parallel(
    masks: &[Mask<'_>],
    first_word: u64,
    acc: &mut [u32],
) -> Result<(), PrgError> {
    use rayon::prelude::*;

    check_range(first_word, acc.len())?;
    if masks.is_empty() || acc.is_empty() {
        return Ok(());
    }
    let engine = Engine::detected();
    let prepared = prepare(masks);
    let threads = rayon::current_num_threads().max(1);
    // A few chunks per thread so work stealing can even out, each a whole number of
    // tiles so that no chunk but the first and the last starts or ends inside a block.
    let chunk = acc
        .len()
        .div_ceil(threads * 4)
        .clamp(PARALLEL_MIN_WORDS, PARALLEL_MAX_WORDS)
        .next_multiple_of(PARALLEL_MIN_WORDS);
    // Align chunk starts to multiples of `chunk` in keystream space.
    let misalignment = (first_word % chunk as u64) as usize;
    let head_len = if misalignment == 0 {
        0
    } else {
        (chunk - misalignment).min(acc.len())
    };
    let (head, body) = acc.split_at_mut(head_len);
    let body_start = first_word + head_len as u64;
    rayon::join(
        || apply_range(engine, &MASK_NONCE_WORDS, &prepared, first_word, head),
        || {
            body.par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, part)| {
                    let start = body_start + (i * chunk) as u64;
                    apply_range(engine, &MASK_NONCE_WORDS, &prepared, start, part);
                });
        },
    );
    Ok(())
}

/// Writes keystream words `first_word..first_word + out.len()` of `seed` into `out`.
///
/// For tests, and for the client, which masks a fresh vector. Fails, leaving `out`
/// untouched, if the range runs past [`KEYSTREAM_WORDS`].
pub fn keystream(seed: &[u8; 32], first_word: u64, out: &mut [u32]) -> Result<(), PrgError> {
    keystream_with_nonce(Engine::detected(), seed, &MASK_NONCE_WORDS, first_word, out)
}

/// [`keystream`] with a chosen implementation, for benchmarks and cross-checks.
///
/// Fails with [`PrgError::BackendUnavailable`] if this CPU cannot run `backend`.
pub fn keystream_with(
    backend: Backend,
    seed: &[u8; 32],
    first_word: u64,
    out: &mut [u32],
) -> Result<(), PrgError> {
    let engine = Engine::for_backend(backend).ok_or(PrgError::BackendUnavailable(backend))?;
    keystream_with_nonce(engine, seed, &MASK_NONCE_WORDS, first_word, out)
}

/// Chunks of [`apply_masks_parallel`] are multiples of this many words (16 KiB).
const PARALLEL_MIN_WORDS: usize = 4096;
/// Longest chunk of [`apply_masks_parallel`] (4 MiB), so that threads can steal work.
const PARALLEL_MAX_WORDS: usize = 1 << 20;

const MASK_NONCE_WORDS: [u32; 3] = nonce_words(&MASK_NONCE);

/// The nonce as the three state words 13..16.
const fn nonce_words(nonce: &[u8; 12]) -> [u32; 3] {
    [
        u32::from_le_bytes([nonce[0], nonce[1], nonce[2], nonce[3]]),
        u32::from_le_bytes([nonce[4], nonce[5], nonce[6], nonce[7]]),
        u32::from_le_bytes([nonce[8], nonce[9], nonce[10], nonce[11]]),
    ]
}

/// The seed as the eight key words 4..12 of the state.
fn key_words(seed: &[u8; 32]) -> [u32; 8] {
    std::array::from_fn(|i| {
        u32::from_le_bytes([
            seed[4 * i],
            seed[4 * i + 1],
            seed[4 * i + 2],
            seed[4 * i + 3],
        ])
    })
}

/// What a prepared mask does to each accumulator word.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    /// `acc += word`
    Add,
    /// `acc -= word`
    Sub,
    /// `acc = word` (writes the keystream itself).
    Set,
}

/// A mask with its key already in state-word form. Holds a secret, so no `Debug`.
#[derive(Clone, Copy)]
struct Prepared {
    key: [u32; 8],
    op: Op,
}

fn prepare(masks: &[Mask<'_>]) -> Vec<Prepared> {
    masks
        .iter()
        .map(|mask| Prepared {
            key: key_words(mask.seed),
            op: match mask.sign {
                MaskSign::Add => Op::Add,
                MaskSign::Subtract => Op::Sub,
            },
        })
        .collect()
}

fn check_range(first_word: u64, len: usize) -> Result<(), PrgError> {
    let end = u64::try_from(len)
        .ok()
        .and_then(|len| first_word.checked_add(len));
    match end {
        Some(end) if end <= KEYSTREAM_WORDS => Ok(()),
        _ => Err(PrgError::OutOfRange { first_word, len }),
    }
}

/// [`keystream`] with any nonce and engine (the RFC test vectors use their own nonce).
fn keystream_with_nonce(
    engine: Engine,
    seed: &[u8; 32],
    nonce: &[u32; 3],
    first_word: u64,
    out: &mut [u32],
) -> Result<(), PrgError> {
    check_range(first_word, out.len())?;
    let mask = [Prepared {
        key: key_words(seed),
        op: Op::Set,
    }];
    apply_range(engine, nonce, &mask, first_word, out);
    Ok(())
}

/// Applies `masks` to `acc`, whose first word is keystream word `first_word`.
///
/// The caller has checked the range with [`check_range`]. Splits `acc` into a partial
/// first block, whole blocks, and a partial last block; the partial ones go through a
/// one-block scratch buffer so the engines only ever see whole blocks.
fn apply_range(
    engine: Engine,
    nonce: &[u32; 3],
    masks: &[Prepared],
    first_word: u64,
    acc: &mut [u32],
) {
    debug_assert!(check_range(first_word, acc.len()).is_ok());
    if masks.is_empty() || acc.is_empty() {
        return;
    }
    let offset = (first_word % BLOCK_WORDS as u64) as usize;
    let mut block = first_word / BLOCK_WORDS as u64;
    let head_len = if offset == 0 {
        0
    } else {
        (BLOCK_WORDS - offset).min(acc.len())
    };
    let (head, body) = acc.split_at_mut(head_len);
    if !head.is_empty() {
        partial_block(engine, nonce, masks, block, offset, head);
        block += 1;
    }
    let (whole, tail) = body.as_chunks_mut::<BLOCK_WORDS>();
    if !whole.is_empty() {
        engine.apply_blocks(nonce, masks, counter(block), whole);
        block += whole.len() as u64;
    }
    if !tail.is_empty() {
        partial_block(engine, nonce, masks, block, 0, tail);
    }
}

/// Applies `masks` to `words`, which are words `offset..offset + words.len()` of `block`.
fn partial_block(
    engine: Engine,
    nonce: &[u32; 3],
    masks: &[Prepared],
    block: u64,
    offset: usize,
    words: &mut [u32],
) {
    let range = offset..offset + words.len();
    let mut scratch = [[0u32; BLOCK_WORDS]];
    scratch[0][range.clone()].copy_from_slice(words);
    engine.apply_blocks(nonce, masks, counter(block), &mut scratch);
    words.copy_from_slice(&scratch[0][range]);
}

/// The 32-bit block counter of a block inside a checked range.
fn counter(block: u64) -> u32 {
    debug_assert!(block < 1 << 32, "block {block} is past the counter space");
    block as u32
}

/// A backend that this CPU was checked to support.
#[derive(Clone, Copy)]
enum Engine {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(x86::Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(x86::Avx512),
}

impl Engine {
    fn detected() -> Engine {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(token) = x86::Avx512::detect() {
                return Engine::Avx512(token);
            }
            if let Some(token) = x86::Avx2::detect() {
                return Engine::Avx2(token);
            }
        }
        Engine::Portable
    }

    fn for_backend(backend: Backend) -> Option<Engine> {
        match backend {
            Backend::Portable => Some(Engine::Portable),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => x86::Avx2::detect().map(Engine::Avx2),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 => x86::Avx512::detect().map(Engine::Avx512),
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Avx2 | Backend::Avx512 => None,
        }
    }

    fn backend(self) -> Backend {
        match self {
            Engine::Portable => Backend::Portable,
            #[cfg(target_arch = "x86_64")]
            Engine::Avx2(_) => Backend::Avx2,
            #[cfg(target_arch = "x86_64")]
            Engine::Avx512(_) => Backend::Avx512,
        }
    }

    /// Applies `masks` to whole blocks `first_block..first_block + blocks.len()`.
    ///
    /// Lanes past the end of `blocks` may compute blocks whose counter wrapped past 2^32;
    /// their words are thrown away.
    fn apply_blocks(
        self,
        nonce: &[u32; 3],
        masks: &[Prepared],
        first_block: u32,
        blocks: &mut [[u32; BLOCK_WORDS]],
    ) {
        match self {
            Engine::Portable => portable::apply_blocks(nonce, masks, first_block, blocks),
            #[cfg(target_arch = "x86_64")]
            Engine::Avx2(token) => token.apply_blocks(nonce, masks, first_block, blocks),
            #[cfg(target_arch = "x86_64")]
            Engine::Avx512(token) => token.apply_blocks(nonce, masks, first_block, blocks),
        }
    }
}

/// One ChaCha20 double round (a column round, then a diagonal round) over a 16-word state
/// `$x`, whatever a word is (a `u32` or a vector of one word from many blocks), given the
/// word operations as functions.
macro_rules! double_round {
    ($x:ident, $add:expr, $xor:expr, $rol16:expr, $rol12:expr, $rol8:expr, $rol7:expr) => {
        double_round!(@qr $x, 0, 4, 8, 12, $add, $xor, $rol16, $rol12, $rol8, $rol7);
        double_round!(@qr $x, 1, 5, 9, 13, $add, $xor, $rol16, $rol12, $rol8, $rol7);
        double_round!(@qr $x, 2, 6, 10, 14, $add, $xor, $rol16, $rol12, $rol8, $rol7);
        double_round!(@qr $x, 3, 7, 11, 15, $add, $xor, $rol16, $rol12, $rol8, $rol7);
        double_round!(@qr $x, 0, 5, 10, 15, $add, $xor, $rol16, $rol12, $rol8, $rol7);
        double_round!(@qr $x, 1, 6, 11, 12, $add, $xor, $rol16, $rol12, $rol8, $rol7);
        double_round!(@qr $x, 2, 7, 8, 13, $add, $xor, $rol16, $rol12, $rol8, $rol7);
        double_round!(@qr $x, 3, 4, 9, 14, $add, $xor, $rol16, $rol12, $rol8, $rol7);
    };
    (@qr $x:ident, $a:literal, $b:literal, $c:literal, $d:literal,
     $add:expr, $xor:expr, $rol16:expr, $rol12:expr, $rol8:expr, $rol7:expr) => {
        $x[$a] = ($add)($x[$a], $x[$b]);
        $x[$d] = ($rol16)(($xor)($x[$d], $x[$a]));
        $x[$c] = ($add)($x[$c], $x[$d]);
        $x[$b] = ($rol12)(($xor)($x[$b], $x[$c]));
        $x[$a] = ($add)($x[$a], $x[$b]);
        $x[$d] = ($rol8)(($xor)($x[$d], $x[$a]));
        $x[$c] = ($add)($x[$c], $x[$d]);
        $x[$b] = ($rol7)(($xor)($x[$b], $x[$c]));
    };
}

/// The reference: a straightforward RFC 8439 block function in safe Rust.
mod portable {
    use super::{BLOCK_WORDS, Op, Prepared, SIGMA};

    /// Blocks per tile: all masks run over one tile (4 KiB) before the next.
    const TILE_BLOCKS: usize = 64;

    fn add(a: u32, b: u32) -> u32 {
        a.wrapping_add(b)
    }
    fn xor(a: u32, b: u32) -> u32 {
        a ^ b
    }
    fn rol16(a: u32) -> u32 {
        a.rotate_left(16)
    }
    fn rol12(a: u32) -> u32 {
        a.rotate_left(12)
    }
    fn rol8(a: u32) -> u32 {
        a.rotate_left(8)
    }
    fn rol7(a: u32) -> u32 {
        a.rotate_left(7)
    }

    /// The RFC 8439 section 2.3 block function: the 16 keystream words of one block.
    pub(super) fn block(key: &[u32; 8], nonce: &[u32; 3], counter: u32) -> [u32; BLOCK_WORDS] {
        let mut init = [0u32; BLOCK_WORDS];
        init[..4].copy_from_slice(&SIGMA);
        init[4..12].copy_from_slice(key);
        init[12] = counter;
        init[13..].copy_from_slice(nonce);
        let mut x = init;
        for _ in 0..10 {
            double_round!(x, add, xor, rol16, rol12, rol8, rol7);
        }
        for (word, input) in x.iter_mut().zip(init) {
            *word = word.wrapping_add(input);
        }
        x
    }

    pub(super) fn apply_blocks(
        nonce: &[u32; 3],
        masks: &[Prepared],
        first_block: u32,
        blocks: &mut [[u32; BLOCK_WORDS]],
    ) {
        for (t, tile) in blocks.chunks_mut(TILE_BLOCKS).enumerate() {
            let tile_block = first_block.wrapping_add((t * TILE_BLOCKS) as u32);
            for mask in masks {
                for (i, words) in tile.iter_mut().enumerate() {
                    let stream = block(&mask.key, nonce, tile_block.wrapping_add(i as u32));
                    for (word, k) in words.iter_mut().zip(stream) {
                        *word = match mask.op {
                            Op::Add => word.wrapping_add(k),
                            Op::Sub => word.wrapping_sub(k),
                            Op::Set => k,
                        };
                    }
                }
            }
        }
    }
}

/// AVX2 and AVX-512 engines. The only unsafe code of the module is here: calls into
/// `#[target_feature]` functions, guarded by run-time detection, and unaligned vector
/// loads and stores through references of exactly the vector's size.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use super::{BLOCK_WORDS, Prepared};

    /// Proof that this CPU and OS support AVX-512F; only [`Avx512::detect`] makes one.
    #[derive(Clone, Copy)]
    pub(super) struct Avx512(());

    impl Avx512 {
        pub(super) fn detect() -> Option<Avx512> {
            std::arch::is_x86_feature_detected!("avx512f").then_some(Avx512(()))
        }

        pub(super) fn apply_blocks(
            self,
            nonce: &[u32; 3],
            masks: &[Prepared],
            first_block: u32,
            blocks: &mut [[u32; BLOCK_WORDS]],
        ) {
            // SAFETY: an `Avx512` value exists only if `detect` found AVX-512F at run time.
            unsafe { avx512::apply_blocks(nonce, masks, first_block, blocks) }
        }
    }

    /// Proof that this CPU and OS support AVX2; only [`Avx2::detect`] makes one.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2(());

    impl Avx2 {
        pub(super) fn detect() -> Option<Avx2> {
            std::arch::is_x86_feature_detected!("avx2").then_some(Avx2(()))
        }

        pub(super) fn apply_blocks(
            self,
            nonce: &[u32; 3],
            masks: &[Prepared],
            first_block: u32,
            blocks: &mut [[u32; BLOCK_WORDS]],
        ) {
            // SAFETY: an `Avx2` value exists only if `detect` found AVX2 at run time.
            unsafe { avx2::apply_blocks(nonce, masks, first_block, blocks) }
        }
    }

    /// 16 blocks at a time: state word `w` of blocks `b..b + 16` in one `__m512i`.
    mod avx512 {
        use core::arch::x86_64::*;

        use super::super::{BLOCK_WORDS, Op, Prepared, SIGMA};

        /// Blocks computed at once, one per lane.
        const LANES: usize = 16;
        /// 16 blocks, either in natural order (one block per row) or transposed (row `w`
        /// holds word `w` of the 16 blocks, lane `j` that of block `j`).
        type Group = [[u32; LANES]; BLOCK_WORDS];
        /// Groups per tile: all masks run over one tile (16 KiB) before the next.
        const TILE_GROUPS: usize = 16;
        /// Up to this many masks, each group's keystream is transposed into natural order
        /// (one transposition per mask); with more, the tile is transposed into the
        /// lane layout and back (two per tile, whatever the number of masks).
        const DIRECT_MAX_MASKS: usize = 2;

        #[inline]
        #[target_feature(enable = "avx512f")]
        fn load(src: &[u32; 16]) -> __m512i {
            // SAFETY: `src` is 64 readable bytes and `loadu` needs no alignment.
            unsafe { _mm512_loadu_si512(src.as_ptr().cast()) }
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        fn store(dst: &mut [u32; 16], value: __m512i) {
            // SAFETY: `dst` is 64 writable bytes and `storeu` needs no alignment.
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), value) }
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        fn add(a: __m512i, b: __m512i) -> __m512i {
            _mm512_add_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn sub(a: __m512i, b: __m512i) -> __m512i {
            _mm512_sub_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn xor(a: __m512i, b: __m512i) -> __m512i {
            _mm512_xor_si512(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn rol16(a: __m512i) -> __m512i {
            _mm512_rol_epi32::<16>(a)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn rol12(a: __m512i) -> __m512i {
            _mm512_rol_epi32::<12>(a)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn rol8(a: __m512i) -> __m512i {
            _mm512_rol_epi32::<8>(a)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn rol7(a: __m512i) -> __m512i {
            _mm512_rol_epi32::<7>(a)
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        fn splat(word: u32) -> __m512i {
            _mm512_set1_epi32(word.cast_signed())
        }

        /// Keystream blocks `counter..counter + 16` (wrapping), transposed: element `w`
        /// holds word `w` of every block, lane `j` that of block `counter + j`.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn blocks(key: &[u32; 8], nonce: &[u32; 3], counter: u32) -> [__m512i; BLOCK_WORDS] {
            let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let init = [
                splat(SIGMA[0]),
                splat(SIGMA[1]),
                splat(SIGMA[2]),
                splat(SIGMA[3]),
                splat(key[0]),
                splat(key[1]),
                splat(key[2]),
                splat(key[3]),
                splat(key[4]),
                splat(key[5]),
                splat(key[6]),
                splat(key[7]),
                add(splat(counter), lanes),
                splat(nonce[0]),
                splat(nonce[1]),
                splat(nonce[2]),
            ];
            let mut x = init;
            for _ in 0..10 {
                double_round!(x, add, xor, rol16, rol12, rol8, rol7);
            }
            for (word, input) in x.iter_mut().zip(init) {
                *word = add(*word, input);
            }
            x
        }

        /// Transposes a 16x16 matrix of `u32`: `out[j]` lane `i` is `r[i]` lane `j`.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn transpose(r: [__m512i; 16]) -> [__m512i; 16] {
            let zero = _mm512_setzero_si512();
            // Interleave words of row pairs within each 128-bit lane.
            let mut a = [zero; 16];
            for i in 0..8 {
                a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
                a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
            }
            // Then word pairs: b[4q + k], 128-bit lane l = rows 4q..4q + 4 of column 4l + k.
            let mut b = [zero; 16];
            for q in 0..4 {
                b[4 * q] = _mm512_unpacklo_epi64(a[4 * q], a[4 * q + 2]);
                b[4 * q + 1] = _mm512_unpackhi_epi64(a[4 * q], a[4 * q + 2]);
                b[4 * q + 2] = _mm512_unpacklo_epi64(a[4 * q + 1], a[4 * q + 3]);
                b[4 * q + 3] = _mm512_unpackhi_epi64(a[4 * q + 1], a[4 * q + 3]);
            }
            // Then a 4x4 transposition of 128-bit lanes among b[k], b[4 + k], b[8 + k],
            // b[12 + k]: out[4l + k] lane q = b[4q + k] lane l.
            let mut out = [zero; 16];
            for k in 0..4 {
                let c0 = _mm512_shuffle_i32x4::<0x44>(b[k], b[4 + k]);
                let c1 = _mm512_shuffle_i32x4::<0xee>(b[k], b[4 + k]);
                let c2 = _mm512_shuffle_i32x4::<0x44>(b[8 + k], b[12 + k]);
                let c3 = _mm512_shuffle_i32x4::<0xee>(b[8 + k], b[12 + k]);
                out[k] = _mm512_shuffle_i32x4::<0x88>(c0, c2);
                out[4 + k] = _mm512_shuffle_i32x4::<0xdd>(c0, c2);
                out[8 + k] = _mm512_shuffle_i32x4::<0x88>(c1, c3);
                out[12 + k] = _mm512_shuffle_i32x4::<0xdd>(c1, c3);
            }
            out
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        fn load_group(group: &Group) -> [__m512i; 16] {
            let mut rows = [_mm512_setzero_si512(); 16];
            for (row, src) in rows.iter_mut().zip(group) {
                *row = load(src);
            }
            rows
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        fn store_group(group: &mut Group, rows: [__m512i; 16]) {
            for (dst, row) in group.iter_mut().zip(rows) {
                store(dst, row);
            }
        }

        /// `group[i] = op(group[i], stream[i])` for each of the 16 rows.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn combine(op: Op, group: &mut Group, stream: [__m512i; 16]) {
            match op {
                Op::Add => {
                    for (dst, k) in group.iter_mut().zip(stream) {
                        store(dst, add(load(dst), k));
                    }
                }
                Op::Sub => {
                    for (dst, k) in group.iter_mut().zip(stream) {
                        store(dst, sub(load(dst), k));
                    }
                }
                Op::Set => store_group(group, stream),
            }
        }

        #[target_feature(enable = "avx512f")]
        pub(super) fn apply_blocks(
            nonce: &[u32; 3],
            masks: &[Prepared],
            first_block: u32,
            blocks: &mut [[u32; BLOCK_WORDS]],
        ) {
            let (groups, rest) = blocks.as_chunks_mut::<LANES>();
            let whole = groups.len();
            apply_groups(nonce, masks, first_block, groups);
            if !rest.is_empty() {
                // Fewer than 16 blocks left: run a whole group over a padded copy.
                let mut pad = [[[0u32; BLOCK_WORDS]; LANES]];
                pad[0][..rest.len()].copy_from_slice(rest);
                let block = first_block.wrapping_add((whole * LANES) as u32);
                apply_groups(nonce, masks, block, &mut pad);
                rest.copy_from_slice(&pad[0][..rest.len()]);
            }
        }

        /// Applies `masks` to whole groups of natural-order blocks from `first_block` on.
        #[target_feature(enable = "avx512f")]
        fn apply_groups(
            nonce: &[u32; 3],
            masks: &[Prepared],
            first_block: u32,
            groups: &mut [Group],
        ) {
            for (t, tile) in groups.chunks_mut(TILE_GROUPS).enumerate() {
                let tile_block = first_block.wrapping_add((t * TILE_GROUPS * LANES) as u32);
                let counter = |g: usize| tile_block.wrapping_add((g * LANES) as u32);
                if masks.len() <= DIRECT_MAX_MASKS {
                    for mask in masks {
                        for (g, group) in tile.iter_mut().enumerate() {
                            let stream = transpose(blocks(&mask.key, nonce, counter(g)));
                            combine(mask.op, group, stream);
                        }
                    }
                    continue;
                }
                // Transpose the tile in place into the registers' layout, run every mask
                // over it there, and transpose it back.
                for group in tile.iter_mut() {
                    store_group(group, transpose(load_group(group)));
                }
                for mask in masks {
                    for (g, group) in tile.iter_mut().enumerate() {
                        combine(mask.op, group, blocks(&mask.key, nonce, counter(g)));
                    }
                }
                for group in tile.iter_mut() {
                    store_group(group, transpose(load_group(group)));
                }
            }
        }
    }

    /// 8 blocks at a time: state word `w` of blocks `b..b + 8` in one `__m256i`.
    mod avx2 {
        use core::arch::x86_64::*;

        use super::super::{BLOCK_WORDS, Op, Prepared, SIGMA};

        /// Blocks computed at once, one per lane.
        const LANES: usize = 8;
        /// 8 blocks in natural order, one block per row. Transposed in place, the same
        /// 128 words are viewed as 16 rows of 8 ([`lanes_mut`]): row `w` holds word `w`
        /// of each block, lane `j` that of block `j`.
        type Group = [[u32; BLOCK_WORDS]; LANES];
        /// Groups per tile: all masks run over one tile (16 KiB) before the next.
        const TILE_GROUPS: usize = 32;
        /// See the AVX-512 engine.
        const DIRECT_MAX_MASKS: usize = 2;

        /// Byte shuffles that rotate each 32-bit lane left by 16 and by 8 bits.
        #[derive(Clone, Copy)]
        struct Rotations {
            by16: __m256i,
            by8: __m256i,
        }

        impl Rotations {
            #[inline]
            #[target_feature(enable = "avx2")]
            fn new() -> Rotations {
                let by16 = _mm256_setr_epi8(
                    2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13, //
                    2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13,
                );
                let by8 = _mm256_setr_epi8(
                    3, 0, 1, 2, 7, 4, 5, 6, 11, 8, 9, 10, 15, 12, 13, 14, //
                    3, 0, 1, 2, 7, 4, 5, 6, 11, 8, 9, 10, 15, 12, 13, 14,
                );
                // Hidden from the optimiser: seeing constant shuffles, LLVM splits the
                // rotation by 16 into two word shuffles and pushes the one by 8 through
                // the preceding xor, three shuffles where two do (about 10% slower).
                std::hint::black_box(Rotations { by16, by8 })
            }
        }

        #[inline]
        #[target_feature(enable = "avx2")]
        fn load(src: &[u32; 8]) -> __m256i {
            // SAFETY: `src` is 32 readable bytes and `loadu` needs no alignment.
            unsafe { _mm256_loadu_si256(src.as_ptr().cast()) }
        }

        #[inline]
        #[target_feature(enable = "avx2")]
        fn store(dst: &mut [u32; 8], value: __m256i) {
            // SAFETY: `dst` is 32 writable bytes and `storeu` needs no alignment.
            unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), value) }
        }

        #[inline]
        #[target_feature(enable = "avx2")]
        fn add(a: __m256i, b: __m256i) -> __m256i {
            _mm256_add_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        fn sub(a: __m256i, b: __m256i) -> __m256i {
            _mm256_sub_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        fn xor(a: __m256i, b: __m256i) -> __m256i {
            _mm256_xor_si256(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        fn rol12(a: __m256i) -> __m256i {
            _mm256_or_si256(_mm256_slli_epi32::<12>(a), _mm256_srli_epi32::<20>(a))
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        fn rol7(a: __m256i) -> __m256i {
            _mm256_or_si256(_mm256_slli_epi32::<7>(a), _mm256_srli_epi32::<25>(a))
        }

        #[inline]
        #[target_feature(enable = "avx2")]
        fn splat(word: u32) -> __m256i {
            _mm256_set1_epi32(word.cast_signed())
        }

        /// Keystream blocks `counter..counter + 8` (wrapping), transposed: element `w`
        /// holds word `w` of every block, lane `j` that of block `counter + j`.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn blocks(
            rotations: Rotations,
            key: &[u32; 8],
            nonce: &[u32; 3],
            counter: u32,
        ) -> [__m256i; BLOCK_WORDS] {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let init = [
                splat(SIGMA[0]),
                splat(SIGMA[1]),
                splat(SIGMA[2]),
                splat(SIGMA[3]),
                splat(key[0]),
                splat(key[1]),
                splat(key[2]),
                splat(key[3]),
                splat(key[4]),
                splat(key[5]),
                splat(key[6]),
                splat(key[7]),
                add(splat(counter), lanes),
                splat(nonce[0]),
                splat(nonce[1]),
                splat(nonce[2]),
            ];
            let rol16 = |a| _mm256_shuffle_epi8(a, rotations.by16);
            let rol8 = |a| _mm256_shuffle_epi8(a, rotations.by8);
            let mut x = init;
            for _ in 0..10 {
                double_round!(x, add, xor, rol16, rol12, rol8, rol7);
            }
            for (word, input) in x.iter_mut().zip(init) {
                *word = add(*word, input);
            }
            x
        }

        /// Transposes an 8x8 matrix of `u32`: `out[j]` lane `i` is `r[i]` lane `j`.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn transpose(r: [__m256i; 8]) -> [__m256i; 8] {
            let zero = _mm256_setzero_si256();
            let mut a = [zero; 8];
            for i in 0..4 {
                a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
                a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
            }
            // b[4q + k], 128-bit lane l = rows 4q..4q + 4 of column 4l + k.
            let mut b = [zero; 8];
            for q in 0..2 {
                b[4 * q] = _mm256_unpacklo_epi64(a[4 * q], a[4 * q + 2]);
                b[4 * q + 1] = _mm256_unpackhi_epi64(a[4 * q], a[4 * q + 2]);
                b[4 * q + 2] = _mm256_unpacklo_epi64(a[4 * q + 1], a[4 * q + 3]);
                b[4 * q + 3] = _mm256_unpackhi_epi64(a[4 * q + 1], a[4 * q + 3]);
            }
            let mut out = [zero; 8];
            for k in 0..4 {
                out[k] = _mm256_permute2x128_si256::<0x20>(b[k], b[4 + k]);
                out[4 + k] = _mm256_permute2x128_si256::<0x31>(b[k], b[4 + k]);
            }
            out
        }

        /// The 128 words of a group as 16 rows of 8.
        fn lanes_mut(group: &mut Group) -> &mut [[u32; LANES]] {
            group.as_flattened_mut().as_chunks_mut::<LANES>().0
        }

        /// Reads a natural-order group as rows: `rows[w]` lane `j` = `group[j][w]`.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn load_natural(group: &Group) -> [__m256i; BLOCK_WORDS] {
            let zero = _mm256_setzero_si256();
            let mut low = [zero; 8];
            let mut high = [zero; 8];
            for ((block, low), high) in group.iter().zip(&mut low).zip(&mut high) {
                let (halves, _) = block.as_chunks::<8>();
                *low = load(&halves[0]);
                *high = load(&halves[1]);
            }
            let mut rows = [zero; BLOCK_WORDS];
            rows[..8].copy_from_slice(&transpose(low));
            rows[8..].copy_from_slice(&transpose(high));
            rows
        }

        /// `group[j][w] = op(group[j][w], rows[w] lane j)`, with `group` in natural order.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn combine_natural(op: Op, group: &mut Group, rows: [__m256i; BLOCK_WORDS]) {
            let (low, high) = rows.split_at(8);
            let low = transpose([
                low[0], low[1], low[2], low[3], low[4], low[5], low[6], low[7],
            ]);
            let high = transpose([
                high[0], high[1], high[2], high[3], high[4], high[5], high[6], high[7],
            ]);
            for ((block, low), high) in group.iter_mut().zip(low).zip(high) {
                let (halves, _) = block.as_chunks_mut::<8>();
                for (half, k) in halves.iter_mut().zip([low, high]) {
                    let value = match op {
                        Op::Add => add(load(half), k),
                        Op::Sub => sub(load(half), k),
                        Op::Set => k,
                    };
                    store(half, value);
                }
            }
        }

        /// `lanes[w] = op(lanes[w], rows[w])`, with `lanes` the rows of a transposed group.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn combine_lanes(op: Op, lanes: &mut [[u32; LANES]], rows: [__m256i; BLOCK_WORDS]) {
            match op {
                Op::Add => {
                    for (dst, k) in lanes.iter_mut().zip(rows) {
                        store(dst, add(load(dst), k));
                    }
                }
                Op::Sub => {
                    for (dst, k) in lanes.iter_mut().zip(rows) {
                        store(dst, sub(load(dst), k));
                    }
                }
                Op::Set => {
                    for (dst, k) in lanes.iter_mut().zip(rows) {
                        store(dst, k);
                    }
                }
            }
        }

        #[target_feature(enable = "avx2")]
        pub(super) fn apply_blocks(
            nonce: &[u32; 3],
            masks: &[Prepared],
            first_block: u32,
            blocks: &mut [[u32; BLOCK_WORDS]],
        ) {
            let (groups, rest) = blocks.as_chunks_mut::<LANES>();
            let whole = groups.len();
            apply_groups(nonce, masks, first_block, groups);
            if !rest.is_empty() {
                // Fewer than 8 blocks left: run a whole group over a padded copy.
                let mut pad = [[[0u32; BLOCK_WORDS]; LANES]];
                pad[0][..rest.len()].copy_from_slice(rest);
                let block = first_block.wrapping_add((whole * LANES) as u32);
                apply_groups(nonce, masks, block, &mut pad);
                rest.copy_from_slice(&pad[0][..rest.len()]);
            }
        }

        /// Applies `masks` to whole groups of natural-order blocks from `first_block` on.
        #[target_feature(enable = "avx2")]
        fn apply_groups(
            nonce: &[u32; 3],
            masks: &[Prepared],
            first_block: u32,
            groups: &mut [Group],
        ) {
            let rotations = Rotations::new();
            for (t, tile) in groups.chunks_mut(TILE_GROUPS).enumerate() {
                let tile_block = first_block.wrapping_add((t * TILE_GROUPS * LANES) as u32);
                let counter = |g: usize| tile_block.wrapping_add((g * LANES) as u32);
                if masks.len() <= DIRECT_MAX_MASKS {
                    for mask in masks {
                        for (g, group) in tile.iter_mut().enumerate() {
                            let stream = blocks(rotations, &mask.key, nonce, counter(g));
                            combine_natural(mask.op, group, stream);
                        }
                    }
                    continue;
                }
                // Transpose the tile in place into the registers' layout, run every mask
                // over it there, and transpose it back.
                for group in tile.iter_mut() {
                    let rows = load_natural(group);
                    combine_lanes(Op::Set, lanes_mut(group), rows);
                }
                for mask in masks {
                    for (g, group) in tile.iter_mut().enumerate() {
                        let stream = blocks(rotations, &mask.key, nonce, counter(g));
                        combine_lanes(mask.op, lanes_mut(group), stream);
                    }
                }
                for group in tile.iter_mut() {
                    let mut rows = [_mm256_setzero_si256(); BLOCK_WORDS];
                    for (row, lane) in rows.iter_mut().zip(lanes_mut(group).iter()) {
                        *row = load(lane);
                    }
                    combine_natural(Op::Set, group, rows);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn unhex(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    fn to_bytes(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn engines() -> Vec<Engine> {
        Backend::ALL
            .into_iter()
            .filter_map(Engine::for_backend)
            .collect()
    }

    /// The slowest possible reference: one portable block per word.
    fn reference_word(seed: &[u8; 32], word: u64) -> u32 {
        let block = portable::block(&key_words(seed), &MASK_NONCE_WORDS, counter(word / 16));
        block[(word % 16) as usize]
    }

    fn reference_apply(masks: &[Mask<'_>], first_word: u64, acc: &mut [u32]) {
        for mask in masks {
            for (i, word) in acc.iter_mut().enumerate() {
                let k = reference_word(mask.seed, first_word + i as u64);
                *word = match mask.sign {
                    MaskSign::Add => word.wrapping_add(k),
                    MaskSign::Subtract => word.wrapping_sub(k),
                };
            }
        }
    }

    const RFC_KEY: [u8; 32] = {
        let mut key = [0u8; 32];
        let mut i = 0;
        while i < 32 {
            key[i] = i as u8;
            i += 1;
        }
        key
    };

    #[test]
    fn rfc8439_2_3_2_block_function_on_every_backend() {
        let nonce = nonce_words(&[0, 0, 0, 0x09, 0, 0, 0, 0x4a, 0, 0, 0, 0]);
        let expected = unhex(concat!(
            "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e",
            "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e",
        ));
        let block = portable::block(&key_words(&RFC_KEY), &nonce, 1);
        assert_eq!(to_bytes(&block), expected);
        for engine in engines() {
            let mut out = [0u32; 16];
            // Counter 1 is keystream word 16.
            keystream_with_nonce(engine, &RFC_KEY, &nonce, 16, &mut out).unwrap();
            assert_eq!(to_bytes(&out), expected, "{}", engine.backend());
        }
    }

    #[test]
    fn rfc8439_2_4_2_sunscreen_keystream_on_every_backend() {
        let nonce = nonce_words(&[0, 0, 0, 0, 0, 0, 0, 0x4a, 0, 0, 0, 0]);
        let expected = unhex(concat!(
            "224f51f3401bd9e12fde276fb8631ded8c131f823d2c06e27e4fcaec9ef3cf78",
            "8a3b0aa372600a92b57974cded2b9334794cba40c63e34cdea212c4cf07d41b7",
            "69a6749f3f630f4122cafe28ec4dc47e26d4346d70b98c73f3e9c53ac40c5945",
            "398b6eda1a832c89c167eacd901d7e2bf363",
        ));
        assert_eq!(expected.len(), 114);
        let plaintext = b"Ladies and Gentlemen of the class of '99: If I could offer you \
            only one tip for the future, sunscreen would be it.";
        let ciphertext = unhex(concat!(
            "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b",
            "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8",
            "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736",
            "5af90bbf74a35be6b40b8eedf2785e42874d",
        ));
        let xored: Vec<u8> = plaintext
            .iter()
            .zip(&ciphertext)
            .map(|(p, c)| p ^ c)
            .collect();
        assert_eq!(xored, expected, "the vector itself is consistent");
        for engine in engines() {
            // 114 bytes: 28 whole words and half of the 29th, from block 1 (word 16) on.
            let mut out = [0u32; 29];
            keystream_with_nonce(engine, &RFC_KEY, &nonce, 16, &mut out).unwrap();
            assert_eq!(to_bytes(&out)[..114], expected[..], "{}", engine.backend());
        }
    }

    #[test]
    fn mask_debug_does_not_print_the_seed() {
        let seed = [0xab; 32];
        let mask = Mask {
            seed: &seed,
            sign: MaskSign::Subtract,
        };
        let shown = format!("{mask:?}");
        assert!(shown.contains("Subtract"), "{shown}");
        assert!(!shown.contains("171") && !shown.contains("ab"), "{shown}");
    }

    #[test]
    fn out_of_range_is_an_error_not_a_panic() {
        let seed = [7; 32];
        let masks = [Mask {
            seed: &seed,
            sign: MaskSign::Add,
        }];
        let mut acc = vec![5u32; 33];
        let cases = [
            (KEYSTREAM_WORDS - 32, 33),
            (KEYSTREAM_WORDS, 1),
            (KEYSTREAM_WORDS + 1, 0),
            (u64::MAX, 1),
            (u64::MAX - 3, 33),
        ];
        for (first_word, len) in cases {
            let expected = Err(PrgError::OutOfRange { first_word, len });
            let acc = &mut acc[..len];
            assert_eq!(apply_masks(&masks, first_word, acc), expected);
            assert_eq!(apply_masks_parallel(&masks, first_word, acc), expected);
            assert_eq!(keystream(&seed, first_word, acc), expected);
            for backend in Backend::ALL.into_iter().filter(|b| b.is_available()) {
                assert_eq!(apply_masks_with(backend, &masks, first_word, acc), expected);
            }
        }
        assert!(acc.iter().all(|&w| w == 5), "a refused call writes nothing");
        // The very last words and an empty range at the very end are fine.
        assert_eq!(apply_masks(&masks, KEYSTREAM_WORDS - 33, &mut acc), Ok(()));
        assert_eq!(apply_masks(&masks, KEYSTREAM_WORDS, &mut []), Ok(()));
        let mut expected = vec![5u32; 33];
        reference_apply(&masks, KEYSTREAM_WORDS - 33, &mut expected);
        assert_eq!(acc, expected);
    }

    #[test]
    fn unavailable_backend_is_an_error() {
        for backend in Backend::ALL {
            let result = apply_masks_with(backend, &[], 0, &mut []);
            if backend.is_available() {
                assert_eq!(result, Ok(()));
            } else {
                assert_eq!(result, Err(PrgError::BackendUnavailable(backend)));
            }
        }
        assert!(Backend::Portable.is_available());
        assert_eq!(backend(), Backend::detected().name());
    }

    #[test]
    fn parallel_matches_serial_on_long_unaligned_ranges() {
        let seeds: Vec<[u8; 32]> = (0..5u8).map(|i| [i.wrapping_mul(37); 32]).collect();
        let masks: Vec<Mask<'_>> = seeds
            .iter()
            .enumerate()
            .map(|(i, seed)| Mask {
                seed,
                sign: if i % 2 == 0 {
                    MaskSign::Add
                } else {
                    MaskSign::Subtract
                },
            })
            .collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for (first_word, len) in [
            (0, 300_001),
            (5, 100_000),
            (4095, 50_000),
            (123_457, 70_003),
        ] {
            for masks in [&masks[..1], &masks[..]] {
                let start: Vec<u32> = (0..len as u32)
                    .map(|i| i.wrapping_mul(2_654_435_761))
                    .collect();
                let mut serial = start.clone();
                apply_masks(masks, first_word, &mut serial).unwrap();
                let mut parallel = start.clone();
                pool.install(|| apply_masks_parallel(masks, first_word, &mut parallel))
                    .unwrap();
                assert_eq!(parallel, serial, "first_word {first_word}, len {len}");
                // And the fast engine agrees with the slow reference on a long range.
                let mut reference = start[..2000].to_vec();
                reference_apply(masks, first_word, &mut reference);
                assert_eq!(serial[..2000], reference[..]);
            }
        }
    }

    #[test]
    fn keystream_crosses_the_tile_and_group_boundaries() {
        let seed = [0x5a; 32];
        for engine in engines() {
            for (first_word, len) in [(0, 70_000), (1, 20_000), (16 * 255, 9_000)] {
                let mut out = vec![0xdead_beef; len];
                keystream_with_nonce(engine, &seed, &MASK_NONCE_WORDS, first_word, &mut out)
                    .unwrap();
                for (i, &word) in out.iter().enumerate().step_by(97) {
                    assert_eq!(word, reference_word(&seed, first_word + i as u64));
                }
            }
        }
    }

    /// First words near zero, anywhere, and near the end of the counter space.
    fn first_word() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..100_000,
            0..KEYSTREAM_WORDS,
            (KEYSTREAM_WORDS - 10_000)..=KEYSTREAM_WORDS,
        ]
    }

    /// A range inside the keystream: a first word and a length up to 5000.
    fn range() -> impl Strategy<Value = (u64, usize)> {
        (first_word(), 0usize..5000).prop_map(|(first, len)| {
            let room = usize::try_from(KEYSTREAM_WORDS - first).unwrap_or(usize::MAX);
            (first, len.min(room))
        })
    }

    fn seeds_and_signs() -> impl Strategy<Value = Vec<([u8; 32], bool)>> {
        prop::collection::vec((any::<[u8; 32]>(), any::<bool>()), 0..6)
    }

    fn as_masks(seeds: &[([u8; 32], bool)]) -> Vec<Mask<'_>> {
        seeds
            .iter()
            .map(|(seed, add)| Mask {
                seed,
                sign: if *add {
                    MaskSign::Add
                } else {
                    MaskSign::Subtract
                },
            })
            .collect()
    }

    fn start_acc(len: usize, salt: u32) -> Vec<u32> {
        (0..len as u32)
            .map(|i| i.wrapping_mul(0x9e37_79b9) ^ salt)
            .collect()
    }

    proptest! {
        #[test]
        fn apply_masks_matches_the_reference_on_every_backend(
            seeds in seeds_and_signs(),
            (first_word, len) in range(),
            salt in any::<u32>(),
        ) {
            let masks = as_masks(&seeds);
            let start = start_acc(len, salt);
            let mut expected = start.clone();
            reference_apply(&masks, first_word, &mut expected);

            let mut acc = start.clone();
            apply_masks(&masks, first_word, &mut acc).unwrap();
            prop_assert_eq!(&acc, &expected);
            for backend in Backend::ALL.into_iter().filter(|b| b.is_available()) {
                let mut acc = start.clone();
                apply_masks_with(backend, &masks, first_word, &mut acc).unwrap();
                prop_assert_eq!(&acc, &expected, "backend {}", backend);
            }
        }

        #[test]
        fn keystream_matches_the_reference_on_every_backend(
            seed in any::<[u8; 32]>(),
            (first_word, len) in range(),
        ) {
            let expected: Vec<u32> =
                (0..len as u64).map(|i| reference_word(&seed, first_word + i)).collect();
            let mut out = vec![0x0bad_f00d; len];
            keystream(&seed, first_word, &mut out).unwrap();
            prop_assert_eq!(&out, &expected);
            for engine in engines() {
                let mut out = vec![0x0bad_f00d; len];
                keystream_with_nonce(engine, &seed, &MASK_NONCE_WORDS, first_word, &mut out)
                    .unwrap();
                prop_assert_eq!(&out, &expected, "backend {}", engine.backend());
            }
        }

        #[test]
        fn splitting_a_range_anywhere_gives_the_same_words(
            seeds in seeds_and_signs(),
            (first_word, len) in range(),
            split in any::<prop::sample::Index>(),
        ) {
            let masks = as_masks(&seeds);
            let start = start_acc(len, 1);
            let mut whole = start.clone();
            apply_masks(&masks, first_word, &mut whole).unwrap();
            let at = split.index(len + 1);
            let mut parts = start;
            let (left, right) = parts.split_at_mut(at);
            apply_masks(&masks, first_word, left).unwrap();
            apply_masks(&masks, first_word + at as u64, right).unwrap();
            prop_assert_eq!(parts, whole);
        }

        #[test]
        fn parallel_equals_serial(
            seeds in seeds_and_signs(),
            (first_word, len) in range(),
        ) {
            let masks = as_masks(&seeds);
            let mut serial = start_acc(len, 2);
            let mut parallel = serial.clone();
            apply_masks(&masks, first_word, &mut serial).unwrap();
            apply_masks_parallel(&masks, first_word, &mut parallel).unwrap();
            prop_assert_eq!(parallel, serial);
        }

        #[test]
        fn adding_then_subtracting_a_seed_restores_the_accumulator(
            seeds in prop::collection::vec(any::<[u8; 32]>(), 1..5),
            (first_word, len) in range(),
            salt in any::<u32>(),
        ) {
            let start = start_acc(len, salt);
            let mut acc = start.clone();
            let added: Vec<Mask<'_>> =
                seeds.iter().map(|seed| Mask { seed, sign: MaskSign::Add }).collect();
            let subtracted: Vec<Mask<'_>> =
                seeds.iter().map(|seed| Mask { seed, sign: MaskSign::Subtract }).collect();
            apply_masks(&added, first_word, &mut acc).unwrap();
            if len >= 4 {
                prop_assert_ne!(&acc, &start);
            }
            apply_masks(&subtracted, first_word, &mut acc).unwrap();
            prop_assert_eq!(acc, start);
        }
    }
}
