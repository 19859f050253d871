//! The hot loops of aggregation behind one interface, so that every path (simulation,
//! the server's jobs, secure aggregation's unmasking) runs on the fastest backend the
//! machine has: the CPU's cores, or a GPU where one is present.
//!
//! Three operations:
//!
//! - [`WeightedSum`]: `sum[i] += w_j * x_j[i]` over batches of `f32` updates, summed in
//!   `f64` (FedAvg);
//! - [`ModularSum`]: `acc[i] += y_j[i] (mod 2^32)` over batches of masked inputs (secure
//!   aggregation's sum);
//! - [`Reducer::apply_masks`]: add or subtract the ChaCha20 mask of every seed in a batch
//!   (secure aggregation's unmasking), see [`crate::secagg::prg`].
//!
//! The sums are accumulator objects made by the reducer, so that a device backend keeps
//! them in device memory across batches and only the inputs travel; memory stays one
//! accumulator and one batch, whatever the number of updates. Integer results are the
//! same on every backend, bit for bit; so are the `f64` sums, since every backend adds
//! each element's terms in batch order without fusing the multiply and the add.

use std::fmt;
use std::sync::Arc;

use rayon::prelude::*;

use crate::secagg::prg::{self, Mask, PrgError};

/// Why a reduction was refused. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReduceError {
    /// An input's length differs from the accumulator's.
    #[error("input {index} has {found} values, the accumulator {expected}")]
    LengthMismatch {
        /// The offending input's position in the batch.
        index: usize,
        /// The accumulator's length.
        expected: usize,
        /// The input's length.
        found: usize,
    },
    /// Different numbers of updates and weights.
    #[error("{updates} updates but {weights} weights")]
    WeightCount {
        /// Updates in the batch.
        updates: usize,
        /// Weights given.
        weights: usize,
    },
    /// The mask generator refused (a range beyond one keystream).
    #[error(transparent)]
    Prg(#[from] PrgError),
    /// The device failed.
    #[error("device: {0}")]
    Device(String),
}

/// A weighted sum of `f64` accumulators, fed batches of `f32` updates.
pub trait WeightedSum: Send + fmt::Debug {
    /// Adds `weights[j] * updates[j][i]` to element `i`, for every update of the batch in
    /// order.
    fn add(&mut self, updates: &[&[f32]], weights: &[f64]) -> Result<(), ReduceError>;

    /// Waits until every batch added so far is summed (a device queues its work; the
    /// CPU is always done).
    fn sync(&self) -> Result<(), ReduceError> {
        Ok(())
    }

    /// The sums so far.
    fn read(&self) -> Result<Vec<f64>, ReduceError>;

    /// The sums, consuming the accumulator (no copy where the sums are in host memory).
    fn into_sums(self: Box<Self>) -> Result<Vec<f64>, ReduceError>;
}

/// A sum modulo 2^32 of `u32` words, fed batches of inputs.
pub trait ModularSum: Send + fmt::Debug {
    /// Adds every input of the batch, word by word.
    fn add(&mut self, inputs: &[&[u32]]) -> Result<(), ReduceError>;

    /// Waits until every batch added so far is summed (a device queues its work; the
    /// CPU is always done).
    fn sync(&self) -> Result<(), ReduceError> {
        Ok(())
    }

    /// The sums so far.
    fn read(&self) -> Result<Vec<u32>, ReduceError>;

    /// The sums, consuming the accumulator (no copy where the sums are in host memory).
    fn into_sums(self: Box<Self>) -> Result<Vec<u32>, ReduceError>;
}

/// A backend for the hot loops of aggregation.
pub trait Reducer: Send + Sync + fmt::Debug {
    /// `cpu` or `cuda`, for logs and benchmark records.
    fn name(&self) -> &'static str;

    /// A weighted sum of `len` elements, all zero.
    fn weighted_sum(&self, len: usize) -> Result<Box<dyn WeightedSum>, ReduceError>;

    /// A modular sum of `len` words, all zero.
    fn modular_sum(&self, len: usize) -> Result<Box<dyn ModularSum>, ReduceError>;

    /// Adds or subtracts the mask of every seed, `acc[i]` being keystream word
    /// `first_word + i` (see [`prg::apply_masks`]).
    fn apply_masks(
        &self,
        masks: &[Mask<'_>],
        first_word: u64,
        acc: &mut [u32],
    ) -> Result<(), ReduceError>;
}

/// Words of the modular accumulator one task owns at a time: 64 KiB of `u32`, in the
/// second-level cache while a batch's inputs stream past it, each input read in runs of
/// 64 KiB. With the inputs on huge pages (as the `cohort` command allocates them) the
/// runs no longer stop at 4 KiB pages, and longer ones keep the prefetchers going:
/// `cohort bench reduce` on the 2-core Intel Xeon, three turns, against the probe read
/// just before: 4,096 words 0.92-0.95, 16,384 words 0.99-1.01.
const CHUNK: usize = 16_384;

/// Sums of the weighted accumulator one task owns at a time: 256 KiB of `f64`, in the
/// second-level cache. Each input is then read in runs of 128 KiB: fewer jumps between
/// runs for the fold, whose arithmetic (a conversion, a multiply and an add per value,
/// where the modular sum has one add) leaves it less slack to absorb them. Measured with
/// the prefetching below on 4 KiB pages, three turns: 8,192 sums at 0.69 to 0.73 of the
/// probe, 16,384 at 0.85 to 0.90, 32,768 at 0.83 to 0.89; on huge pages (scratch
/// harness, four turns, GB/s): 16,384 sums 30.1-32.4, 32,768 31.0-32.3 (with the prefetch
/// at 1 KiB, 32.2-33.3), 65,536 29.9-30.5. A benchmark of the fold's arithmetic alone
/// sizes its work by it.
pub const WEIGHTED_CHUNK: usize = 32_768;

/// Inputs added per pass over an accumulator chunk: the chunk is loaded and stored once
/// for eight additions, and eight input streams are read at once, enough for the
/// prefetchers to keep memory busy (measured: four leave bandwidth unused).
const GROUP: usize = 8;

/// Bytes of inputs one batch may hold: what [`batch_len`] sizes batches by.
pub const BATCH_BYTES: usize = 512 << 20;

/// How many inputs of `values` 4-byte values each to fold per batch: as many as fit in
/// [`BATCH_BYTES`], at least one.
///
/// Every pass over the inputs reads and writes the whole accumulator once (16 bytes per
/// value for `f64` sums); a batch that holds all of a round's updates writes each sum
/// once, so the reduction reads little more than the updates themselves (with 16
/// updates of a million parameters a batch, the accumulator's traffic was a fifth of
/// the updates'). The server's jobs, `cohort simulate` and `cohort bench reduce` all
/// batch by this rule, so that memory holds at most 512 MiB of inputs at once, whatever
/// the number of clients.
pub fn batch_len(values: usize) -> usize {
    (BATCH_BYTES / values.max(1).saturating_mul(4)).max(1)
}

fn check_lengths<T>(expected: usize, inputs: &[&[T]]) -> Result<(), ReduceError> {
    match inputs.iter().position(|x| x.len() != expected) {
        Some(index) => Err(ReduceError::LengthMismatch {
            index,
            expected,
            found: inputs[index].len(),
        }),
        None => Ok(()),
    }
}

/// The CPU backend: every core of the rayon pool, each owning cache-sized chunks of the
/// accumulator and streaming the batch's inputs through them, eight at a time, with loops
/// compiled for the widest vector unit the CPU has. It allocates nothing per input.
///
/// Accumulators come from a small pool of buffers that finished accumulators return to,
/// so a coordinator's round after round reuses memory whose pages are already mapped
/// (a fresh 8 MB buffer costs thousands of page faults, more than the sum itself on a
/// virtual machine). A new accumulator is not zeroed: its first batch writes the sums
/// without reading them, so a round that fits one batch writes each sum exactly once.
#[derive(Debug, Clone, Default)]
pub struct CpuReducer {
    pool: Arc<Pool>,
}

/// Buffers kept for reuse, at most [`POOL_BUFFERS`] of each kind.
#[derive(Debug, Default)]
struct Pool {
    f64s: std::sync::Mutex<Vec<Vec<f64>>>,
    u32s: std::sync::Mutex<Vec<Vec<u32>>>,
}

/// Buffers of each kind the pool keeps.
const POOL_BUFFERS: usize = 4;

/// A buffer of `len` elements whose contents are unspecified (a reused buffer keeps its
/// old values): its owner writes before it reads.
fn take<T: Copy + Default + Send + Sync>(
    pool: &std::sync::Mutex<Vec<Vec<T>>>,
    len: usize,
) -> Vec<T> {
    let reused = pool.lock().ok().and_then(|mut p| {
        p.iter()
            .position(|b| b.capacity() >= len)
            .map(|i| p.swap_remove(i))
    });
    match reused {
        Some(mut buf) => {
            buf.truncate(len);
            buf.resize(len, T::default());
            buf
        }
        None => {
            let mut buf = vec![T::default(); len];
            // Touch every page from every core now rather than one fault at a time inside
            // the first batch.
            buf.par_chunks_mut(1 << 16)
                .for_each(|c| c.fill(T::default()));
            buf
        }
    }
}

fn give_back<T>(pool: &std::sync::Mutex<Vec<Vec<T>>>, buf: Vec<T>) {
    if buf.capacity() == 0 {
        return;
    }
    if let Ok(mut p) = pool.lock()
        && p.len() < POOL_BUFFERS
    {
        p.push(buf);
    }
}

/// Whether an accumulator's buffer holds its sums yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Nothing was added: the sums are zero, and the buffer holds whatever it held
    /// before, never read. The next batch writes the sums without reading them.
    Zero,
    /// The buffer holds the sums.
    Sums,
}

/// [`CpuReducer`]'s weighted sum.
#[derive(Debug)]
struct CpuWeightedSum {
    sum: Vec<f64>,
    start: Start,
    pool: Arc<Pool>,
}

/// [`CpuReducer`]'s modular sum.
#[derive(Debug)]
struct CpuModularSum {
    acc: Vec<u32>,
    start: Start,
    pool: Arc<Pool>,
}

impl Drop for CpuWeightedSum {
    fn drop(&mut self) {
        give_back(&self.pool.f64s, std::mem::take(&mut self.sum));
    }
}

impl Drop for CpuModularSum {
    fn drop(&mut self) {
        give_back(&self.pool.u32s, std::mem::take(&mut self.acc));
    }
}

/// `sum[i] += w_j * x_j[i]` for every update of the batch, in place.
pub fn weighted_sum_into(
    sum: &mut [f64],
    updates: &[&[f32]],
    weights: &[f64],
) -> Result<(), ReduceError> {
    weighted_sum_from(sum, Start::Sums, updates, weights)
}

/// The weighted sum of a batch into `sum`, which holds sums (`Start::Sums`) or is
/// overwritten as if it held zeros (`Start::Zero`). Checks everything before it writes;
/// an empty batch writes nothing (so `sum` is still at its `start`).
fn weighted_sum_from(
    sum: &mut [f64],
    start: Start,
    updates: &[&[f32]],
    weights: &[f64],
) -> Result<(), ReduceError> {
    if updates.len() != weights.len() {
        return Err(ReduceError::WeightCount {
            updates: updates.len(),
            weights: weights.len(),
        });
    }
    check_lengths(sum.len(), updates)?;
    if updates.is_empty() {
        return Ok(());
    }
    let kernels = kernels::detect();
    sum.par_chunks_mut(WEIGHTED_CHUNK)
        .enumerate()
        .for_each(|(c, s)| {
            let range = c * WEIGHTED_CHUNK..c * WEIGHTED_CHUNK + s.len();
            let mut fresh = start == Start::Zero;
            let mut j = 0;
            // Every element's terms are added in batch order, whatever the grouping, so the
            // sums are the bits of one update at a time.
            while j < updates.len() {
                let k = group_len(updates.len() - j);
                let x = &updates[j..j + k];
                let w = &weights[j..j + k];
                kernels.weighted(s, x, w, range.clone(), fresh);
                fresh = false;
                j += k;
            }
        });
    Ok(())
}

/// Inputs to take in the next pass when `left` remain: a full group, else the largest
/// power of two that fits.
fn group_len(left: usize) -> usize {
    match left {
        GROUP.. => GROUP,
        4.. => 4,
        2.. => 2,
        _ => 1,
    }
}

/// `acc[i] += y_j[i] (mod 2^32)` for every input of the batch, in place.
pub fn modular_sum_into(acc: &mut [u32], inputs: &[&[u32]]) -> Result<(), ReduceError> {
    modular_sum_from(acc, Start::Sums, inputs)
}

/// The modular sum of a batch into `acc`, as [`weighted_sum_from`] for words.
fn modular_sum_from(acc: &mut [u32], start: Start, inputs: &[&[u32]]) -> Result<(), ReduceError> {
    check_lengths(acc.len(), inputs)?;
    if inputs.is_empty() {
        return Ok(());
    }
    let kernels = kernels::detect();
    acc.par_chunks_mut(CHUNK).enumerate().for_each(|(c, a)| {
        let range = c * CHUNK..c * CHUNK + a.len();
        let mut fresh = start == Start::Zero;
        let mut j = 0;
        while j < inputs.len() {
            let k = group_len(inputs.len() - j);
            kernels.add_words(a, &inputs[j..j + k], range.clone(), fresh);
            fresh = false;
            j += k;
        }
    });
    Ok(())
}

impl WeightedSum for CpuWeightedSum {
    fn add(&mut self, updates: &[&[f32]], weights: &[f64]) -> Result<(), ReduceError> {
        weighted_sum_from(&mut self.sum, self.start, updates, weights)?;
        if !updates.is_empty() {
            self.start = Start::Sums;
        }
        Ok(())
    }

    fn read(&self) -> Result<Vec<f64>, ReduceError> {
        Ok(match self.start {
            Start::Zero => vec![0.0; self.sum.len()],
            Start::Sums => self.sum.clone(),
        })
    }

    fn into_sums(mut self: Box<Self>) -> Result<Vec<f64>, ReduceError> {
        if self.start == Start::Zero {
            self.sum.fill(0.0);
        }
        Ok(std::mem::take(&mut self.sum))
    }
}

impl ModularSum for CpuModularSum {
    fn add(&mut self, inputs: &[&[u32]]) -> Result<(), ReduceError> {
        modular_sum_from(&mut self.acc, self.start, inputs)?;
        if !inputs.is_empty() {
            self.start = Start::Sums;
        }
        Ok(())
    }

    fn read(&self) -> Result<Vec<u32>, ReduceError> {
        Ok(match self.start {
            Start::Zero => vec![0; self.acc.len()],
            Start::Sums => self.acc.clone(),
        })
    }

    fn into_sums(mut self: Box<Self>) -> Result<Vec<u32>, ReduceError> {
        if self.start == Start::Zero {
            self.acc.fill(0);
        }
        Ok(std::mem::take(&mut self.acc))
    }
}

impl Reducer for CpuReducer {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn weighted_sum(&self, len: usize) -> Result<Box<dyn WeightedSum>, ReduceError> {
        Ok(Box::new(CpuWeightedSum {
            sum: take(&self.pool.f64s, len),
            start: Start::Zero,
            pool: self.pool.clone(),
        }))
    }

    fn modular_sum(&self, len: usize) -> Result<Box<dyn ModularSum>, ReduceError> {
        Ok(Box::new(CpuModularSum {
            acc: take(&self.pool.u32s, len),
            start: Start::Zero,
            pool: self.pool.clone(),
        }))
    }

    fn apply_masks(
        &self,
        masks: &[Mask<'_>],
        first_word: u64,
        acc: &mut [u32],
    ) -> Result<(), ReduceError> {
        Ok(prg::apply_masks_parallel(masks, first_word, acc)?)
    }
}

/// The inner loops, compiled for the widest vector unit the CPU has.
///
/// The binary targets plain x86-64 (SSE2), where the `f32` to `f64` multiply-add runs two
/// lanes wide and is compute-bound; the same loop compiled for AVX2 or AVX-512 runs four
/// or eight wide and reaches memory speed. The loops are plain Rust; only the instruction
/// set differs, and no path fuses the multiply and the add, so every path gives the same
/// bits.
mod kernels {
    use std::ops::Range;

    /// Values of an `f32` input in one 64-byte cache line: the fold's step.
    const LINE: usize = 16;

    /// How far ahead of the fold each input is prefetched, in values (1 KiB), on CPUs
    /// where that helps (see [`x86::prefetch_helps`]). On an Intel CPU the fold's
    /// arithmetic filled the out-of-order window long before eight inputs' loads had
    /// reached far enough ahead to hide memory's latency, and the hardware prefetchers
    /// stop at every 4 KiB page; asking for the line ahead kept every stream's misses in
    /// flight. On 4 KiB pages 2 KiB ahead was best (three turns: the loop before this
    /// and the larger [`super::WEIGHTED_CHUNK`] read at 0.63 to 0.71 of the probe, with
    /// both at 0.85 to 0.90; 1.5 KiB and 3 KiB ahead, prefetching to the second-level
    /// cache only, and sixteen inputs a pass were all slower); on huge pages, where a
    /// prefetch no longer waits for an address translation, 1 KiB (scratch harness, four
    /// turns, 32,768 sums: 1 KiB 32.2-33.3 GB/s, 2 KiB 31.0-32.3, 3 KiB 30.3-30.9).
    const AHEAD: usize = 256;

    /// Asks for the cache line [`AHEAD`] values past `at` in `x`. A prefetch never faults
    /// nor changes what any load reads, so an address past the slice's end is harmless.
    #[inline(always)]
    #[allow(unsafe_code)]
    fn prefetch(x: &[f32], at: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = x.as_ptr().wrapping_add(at + AHEAD);
            // SAFETY: a prefetch is a hint: it reads nothing the program can see and
            // cannot fault, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (x, at);
    }

    /// `acc[i] = (FRESH ? 0 : acc[i]) + w[0] x[0][i] + w[1] x[1][i] + ...`, the additions
    /// in that order, with one load (none when `FRESH`) and one store of `acc`; a cache
    /// line of every input at a time, each input prefetched [`AHEAD`] when `PREFETCH`.
    #[inline(always)]
    pub(super) fn weighted<const K: usize, const FRESH: bool, const PREFETCH: bool>(
        acc: &mut [f64],
        x: [&[f32]; K],
        w: [f64; K],
    ) {
        let n = acc.len();
        // One length for every slice, so the loops below have no bounds checks.
        let x: [&[f32]; K] = std::array::from_fn(|k| &x[k][..n]);
        let whole = n - n % LINE;
        for line in (0..whole).step_by(LINE) {
            if PREFETCH {
                for input in &x {
                    prefetch(input, line);
                }
            }
            let sums: &mut [f64; LINE] = (&mut acc[line..line + LINE]).try_into().expect("a line");
            let xs: [&[f32; LINE]; K] =
                std::array::from_fn(|k| x[k][line..line + LINE].try_into().expect("a line"));
            weighted_line::<K, FRESH>(sums, xs, w);
        }
        for i in whole..n {
            let mut a = if FRESH { 0.0 } else { acc[i] };
            for k in 0..K {
                a += w[k] * f64::from(x[k][i]);
            }
            acc[i] = a;
        }
    }

    /// [`weighted`] for one line of every input: fixed sizes, so that the compiler turns
    /// it into whole vectors (each sum's additions are still in input order).
    #[inline(always)]
    fn weighted_line<const K: usize, const FRESH: bool>(
        acc: &mut [f64; LINE],
        x: [&[f32; LINE]; K],
        w: [f64; K],
    ) {
        let mut a = if FRESH { [0.0; LINE] } else { *acc };
        for k in 0..K {
            for i in 0..LINE {
                a[i] += w[k] * f64::from(x[k][i]);
            }
        }
        *acc = a;
    }

    /// `acc[i] = (FRESH ? 0 : acc[i]) + y[0][i] + y[1][i] + ... (mod 2^32)`.
    #[inline(always)]
    pub(super) fn add_words<const K: usize, const FRESH: bool>(acc: &mut [u32], y: [&[u32]; K]) {
        let n = acc.len();
        let y: [&[u32]; K] = std::array::from_fn(|k| &y[k][..n]);
        for i in 0..n {
            let mut a = if FRESH { 0 } else { acc[i] };
            for input in &y {
                a = a.wrapping_add(input[i]);
            }
            acc[i] = a;
        }
    }

    /// The kernels chosen for this CPU.
    #[derive(Clone, Copy)]
    pub(super) struct Kernels {
        #[cfg(target_arch = "x86_64")]
        level: x86::Level,
        /// Whether the fold prefetches its inputs ([`AHEAD`]).
        prefetch: bool,
    }

    /// Calls `$go!(K, FRESH)` with the group's size (8, 4, 2 or 1, as
    /// [`super::group_len`] makes them) and freshness as constants, so that each pair
    /// gets its own compiled loop.
    macro_rules! by_group {
        ($len:expr, $fresh:expr, $go:ident) => {
            match ($len, $fresh) {
                (8, true) => $go!(8, true),
                (8, false) => $go!(8, false),
                (4, true) => $go!(4, true),
                (4, false) => $go!(4, false),
                (2, true) => $go!(2, true),
                (2, false) => $go!(2, false),
                (_, true) => $go!(1, true),
                (_, false) => $go!(1, false),
            }
        };
    }

    impl Kernels {
        /// Adds the weighted group `x` (each sliced to `range`) to `acc`, or writes it
        /// when `fresh`.
        pub(super) fn weighted(
            self,
            acc: &mut [f64],
            x: &[&[f32]],
            w: &[f64],
            range: Range<usize>,
            fresh: bool,
        ) {
            macro_rules! go {
                ($k:literal, $fresh:literal) => {{
                    let xs: [&[f32]; $k] = std::array::from_fn(|j| &x[j][range.clone()]);
                    let ws: [f64; $k] = std::array::from_fn(|j| w[j]);
                    self.weighted_at::<$k, $fresh>(acc, xs, ws)
                }};
            }
            by_group!(x.len(), fresh, go)
        }

        /// Adds the group `y` (each sliced to `range`) to `acc`, or writes it when
        /// `fresh`.
        pub(super) fn add_words(
            self,
            acc: &mut [u32],
            y: &[&[u32]],
            range: Range<usize>,
            fresh: bool,
        ) {
            macro_rules! go {
                ($k:literal, $fresh:literal) => {{
                    let ys: [&[u32]; $k] = std::array::from_fn(|j| &y[j][range.clone()]);
                    self.add_words_at::<$k, $fresh>(acc, ys)
                }};
            }
            by_group!(y.len(), fresh, go)
        }

        fn weighted_at<const K: usize, const FRESH: bool>(
            self,
            acc: &mut [f64],
            x: [&[f32]; K],
            w: [f64; K],
        ) {
            #[cfg(target_arch = "x86_64")]
            {
                x86::weighted::<K, FRESH>(self.level, self.prefetch, acc, x, w)
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                weighted::<K, FRESH, false>(acc, x, w)
            }
        }

        fn add_words_at<const K: usize, const FRESH: bool>(self, acc: &mut [u32], y: [&[u32]; K]) {
            #[cfg(target_arch = "x86_64")]
            {
                x86::add_words::<K, FRESH>(self.level, acc, y)
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                add_words::<K, FRESH>(acc, y)
            }
        }
    }

    pub(super) fn detect() -> Kernels {
        Kernels {
            #[cfg(target_arch = "x86_64")]
            level: x86::Level::detect(),
            #[cfg(target_arch = "x86_64")]
            prefetch: x86::prefetch_helps(),
            #[cfg(not(target_arch = "x86_64"))]
            prefetch: false,
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    mod x86 {
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        pub(super) enum Level {
            Portable,
            Avx2,
            Avx512,
        }

        impl Level {
            pub(super) fn detect() -> Self {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    Level::Avx512
                } else if std::arch::is_x86_feature_detected!("avx2") {
                    Level::Avx2
                } else {
                    Level::Portable
                }
            }
        }

        /// Whether prefetching each input [`super::AHEAD`] speeds the fold. Where it was
        /// first measured, from 0.63-0.71 to 0.85-0.90 of the memory probe (the CPU's
        /// model was not recorded; its full-width AVX-512, ChaCha20 at three times the
        /// AVX2 crates' speed, says an Intel Xeon); on an AMD EPYC (Zen 4), whose
        /// prefetchers follow the eight streams themselves, the same loop read 23-30
        /// GB/s with the prefetches and 36-40 GB/s without (one run, 96 updates of 10^6
        /// values, chunks of 4,096 to 65,536 sums, three turns). Other vendors are left
        /// to their hardware prefetchers.
        ///
        /// Read once: the kernels are chosen for every batch, and CPUID traps to the
        /// hypervisor on a virtual machine.
        pub(super) fn prefetch_helps() -> bool {
            static HELPS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            *HELPS.get_or_init(|| {
                // SAFETY: leaf 0 of CPUID (the vendor) exists on every x86-64 CPU.
                #[allow(unused_unsafe)]
                let id = unsafe { std::arch::x86_64::__cpuid(0) };
                let mut vendor = [0u8; 12];
                vendor[..4].copy_from_slice(&id.ebx.to_le_bytes());
                vendor[4..8].copy_from_slice(&id.edx.to_le_bytes());
                vendor[8..].copy_from_slice(&id.ecx.to_le_bytes());
                &vendor == b"GenuineIntel"
            })
        }

        #[target_feature(enable = "avx512f")]
        fn weighted_avx512<const K: usize, const FRESH: bool, const PREFETCH: bool>(
            acc: &mut [f64],
            x: [&[f32]; K],
            w: [f64; K],
        ) {
            super::weighted::<K, FRESH, PREFETCH>(acc, x, w)
        }

        #[target_feature(enable = "avx2")]
        fn weighted_avx2<const K: usize, const FRESH: bool, const PREFETCH: bool>(
            acc: &mut [f64],
            x: [&[f32]; K],
            w: [f64; K],
        ) {
            super::weighted::<K, FRESH, PREFETCH>(acc, x, w)
        }

        pub(super) fn weighted<const K: usize, const FRESH: bool>(
            level: Level,
            prefetch: bool,
            acc: &mut [f64],
            x: [&[f32]; K],
            w: [f64; K],
        ) {
            if prefetch {
                weighted_at::<K, FRESH, true>(level, acc, x, w)
            } else {
                weighted_at::<K, FRESH, false>(level, acc, x, w)
            }
        }

        fn weighted_at<const K: usize, const FRESH: bool, const PREFETCH: bool>(
            level: Level,
            acc: &mut [f64],
            x: [&[f32]; K],
            w: [f64; K],
        ) {
            match level {
                // SAFETY: `Level::detect` saw the CPU report AVX-512F; the function
                // body is safe Rust over slices.
                Level::Avx512 => unsafe { weighted_avx512::<K, FRESH, PREFETCH>(acc, x, w) },
                // SAFETY: as above, for AVX2.
                Level::Avx2 => unsafe { weighted_avx2::<K, FRESH, PREFETCH>(acc, x, w) },
                Level::Portable => super::weighted::<K, FRESH, PREFETCH>(acc, x, w),
            }
        }

        #[target_feature(enable = "avx512f")]
        fn add_words_avx512<const K: usize, const FRESH: bool>(acc: &mut [u32], y: [&[u32]; K]) {
            super::add_words::<K, FRESH>(acc, y)
        }

        #[target_feature(enable = "avx2")]
        fn add_words_avx2<const K: usize, const FRESH: bool>(acc: &mut [u32], y: [&[u32]; K]) {
            super::add_words::<K, FRESH>(acc, y)
        }

        pub(super) fn add_words<const K: usize, const FRESH: bool>(
            level: Level,
            acc: &mut [u32],
            y: [&[u32]; K],
        ) {
            match level {
                // SAFETY: `Level::detect` saw the CPU report AVX-512F; the function
                // body is safe Rust over slices.
                Level::Avx512 => unsafe { add_words_avx512::<K, FRESH>(acc, y) },
                // SAFETY: as above, for AVX2.
                Level::Avx2 => unsafe { add_words_avx2::<K, FRESH>(acc, y) },
                Level::Portable => super::add_words::<K, FRESH>(acc, y),
            }
        }

        #[cfg(test)]
        mod tests {
            use super::*;

            /// One update at a time with a plain loop: the reference every kernel must
            /// equal bit for bit.
            fn one_at_a_time(start: Option<&[f64]>, x: &[&[f32]], w: &[f64]) -> Vec<f64> {
                let n = x[0].len();
                let mut acc = start.map_or_else(|| vec![0.0; n], <[f64]>::to_vec);
                for (u, &w) in x.iter().zip(w) {
                    for (a, &v) in acc.iter_mut().zip(u.iter()) {
                        *a += w * f64::from(v);
                    }
                }
                acc
            }

            /// Every instruction set this CPU has, every group size, fresh or adding,
            /// gives the plain loop's bits (no fused multiply-add, the same order).
            #[test]
            fn every_level_and_group_gives_the_same_bits() {
                let xs: Vec<Vec<f32>> = (0..8)
                    .map(|k| {
                        (0..1003)
                            .map(|i| ((i * 7 + k) as f32 * 0.37).sin())
                            .collect()
                    })
                    .collect();
                let x: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
                let w = [1.5, -2.0, 0.1, 7.0, 3.3, -0.25, 1e-3, 11.0];
                let ys: Vec<Vec<u32>> = (0..8u32)
                    .map(|k| {
                        (0..1003u32)
                            .map(|i| (i ^ k).wrapping_mul(2_654_435_761))
                            .collect()
                    })
                    .collect();
                let y: Vec<&[u32]> = ys.iter().map(Vec::as_slice).collect();
                let start: Vec<f64> = (0..1003).map(|i| f64::from(i) * 0.25 - 7.0).collect();
                let words: Vec<u32> = (0..1003u32).map(|i| i.wrapping_mul(40_503)).collect();
                let mut levels = vec![Level::Portable];
                if std::arch::is_x86_feature_detected!("avx2") {
                    levels.push(Level::Avx2);
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    levels.push(Level::Avx512);
                }
                for level in levels.into_iter().flat_map(|l| [(l, false), (l, true)]) {
                    let kernels = |(level, prefetch)| super::super::Kernels { level, prefetch };
                    for k in [1usize, 2, 4, 8] {
                        for fresh in [true, false] {
                            let mut got = if fresh {
                                vec![f64::NAN; 1003]
                            } else {
                                start.clone()
                            };
                            kernels(level).weighted(&mut got, &x[..k], &w[..k], 0..1003, fresh);
                            let want =
                                one_at_a_time((!fresh).then_some(&start[..]), &x[..k], &w[..k]);
                            assert_eq!(
                                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                "{level:?}, {k} at once, fresh {fresh}"
                            );
                            let mut acc = if fresh {
                                vec![u32::MAX; 1003]
                            } else {
                                words.clone()
                            };
                            kernels(level).add_words(&mut acc, &y[..k], 0..1003, fresh);
                            let mut want = if fresh { vec![0; 1003] } else { words.clone() };
                            for input in &y[..k] {
                                for (a, &v) in want.iter_mut().zip(input.iter()) {
                                    *a = a.wrapping_add(v);
                                }
                            }
                            assert_eq!(acc, want, "{level:?}, {k} words at once, fresh {fresh}");
                        }
                    }
                }
            }
        }
    }
}

/// The CPU reducer, shared by the whole process (and so is its buffer pool).
pub fn cpu() -> Arc<dyn Reducer> {
    static CPU: std::sync::OnceLock<Arc<dyn Reducer>> = std::sync::OnceLock::new();
    CPU.get_or_init(|| Arc::new(CpuReducer::default())).clone()
}

/// Which reducer to use, as `--reducer auto|cpu|cuda` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String", into = "String")]
pub enum ReducerChoice {
    /// The GPU when a CUDA driver and device are present, else the CPU.
    #[default]
    Auto,
    /// The CPU's cores.
    Cpu,
    /// The GPU; an error when there is none (or this build has no CUDA support).
    Cuda,
}

impl std::str::FromStr for ReducerChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(ReducerChoice::Auto),
            "cpu" => Ok(ReducerChoice::Cpu),
            "cuda" | "gpu" => Ok(ReducerChoice::Cuda),
            other => Err(format!(
                "unknown reducer `{other}`: expected auto, cpu or cuda"
            )),
        }
    }
}

impl TryFrom<String> for ReducerChoice {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<ReducerChoice> for String {
    fn from(c: ReducerChoice) -> String {
        c.as_str().into()
    }
}

impl ReducerChoice {
    /// `auto`, `cpu` or `cuda`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReducerChoice::Auto => "auto",
            ReducerChoice::Cpu => "cpu",
            ReducerChoice::Cuda => "cuda",
        }
    }
}

impl fmt::Display for ReducerChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A chosen reducer and the one line that says which it is and why, for the log.
pub struct Selected {
    /// The reducer.
    pub reducer: Arc<dyn Reducer>,
    /// E.g. `reducer: cpu (2 threads; no CUDA driver found)`.
    pub line: String,
}

/// Picks the reducer for `choice`. `auto` falls back to the CPU, saying why; `cuda`
/// without a usable GPU is an error. Never panics, with or without a driver.
pub fn select(choice: ReducerChoice) -> Result<Selected, ReduceError> {
    let cpu_line = |why: &str| {
        format!(
            "reducer: cpu ({} threads; {why})",
            rayon::current_num_threads()
        )
    };
    match choice {
        ReducerChoice::Cpu => Ok(Selected {
            reducer: cpu(),
            line: cpu_line("chosen with --reducer cpu"),
        }),
        ReducerChoice::Cuda | ReducerChoice::Auto => match gpu() {
            Ok((reducer, what)) => Ok(Selected {
                reducer,
                line: format!("reducer: cuda ({what})"),
            }),
            Err(why) if choice == ReducerChoice::Auto => Ok(Selected {
                reducer: cpu(),
                line: cpu_line(&why),
            }),
            Err(why) => Err(ReduceError::Device(why)),
        },
    }
}

/// The GPU reducer and a description of the device, or why there is none. Looked for
/// once per process (starting CUDA and compiling the kernels takes a while), so every
/// caller of [`select`] shares one device context.
fn gpu() -> Result<(Arc<dyn Reducer>, String), String> {
    type Found = Result<(Arc<dyn Reducer>, String), String>;
    static GPU: std::sync::OnceLock<Found> = std::sync::OnceLock::new();
    GPU.get_or_init(|| {
        #[cfg(feature = "cuda")]
        {
            crate::cuda::CudaReducer::new()
                .map(|r| {
                    let what = r.describe();
                    (Arc::new(r) as Arc<dyn Reducer>, what)
                })
                .map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err("this build has no CUDA support (build with --features cuda)".into())
        }
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn cpu_weighted_sum_matches_a_plain_loop(
            d in 0usize..10_000,
            n in 0usize..20,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
            let updates: Vec<Vec<f32>> = (0..n)
                .map(|_| (0..d).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect())
                .collect();
            let weights: Vec<f64> = (0..n).map(|_| (next() % 100 + 1) as f64).collect();
            let start: Vec<f64> = (0..d).map(|i| i as f64).collect();
            let mut expected = start.clone();
            for (u, w) in updates.iter().zip(&weights) {
                for (e, &v) in expected.iter_mut().zip(u) {
                    *e += w * f64::from(v);
                }
            }
            let mut got = start.clone();
            let refs: Vec<&[f32]> = updates.iter().map(Vec::as_slice).collect();
            weighted_sum_into(&mut got, &refs, &weights).unwrap();
            // The same additions in the same order per element: bit-identical.
            prop_assert_eq!(&got, &expected);
            // Through the accumulator, in two batches, from zero.
            let cpu = CpuReducer::default();
            let mut acc = cpu.weighted_sum(d).unwrap();
            let (a, b) = refs.split_at(refs.len() / 2);
            let (wa, wb) = weights.split_at(weights.len() / 2);
            acc.add(a, wa).unwrap();
            acc.add(b, wb).unwrap();
            let mut from_zero = vec![0.0; d];
            weighted_sum_into(&mut from_zero, &refs, &weights).unwrap();
            prop_assert_eq!(&acc.read().unwrap(), &from_zero);
            // A pooled buffer comes back zeroed.
            drop(acc);
            let again = cpu.weighted_sum(d).unwrap();
            prop_assert!(again.read().unwrap().iter().all(|&v| v == 0.0));
            prop_assert_eq!(again.into_sums().unwrap().len(), d);
        }

        #[test]
        fn cpu_wrapping_sum_matches_a_plain_loop(
            d in 0usize..10_000,
            n in 0usize..20,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s as u32 };
            let inputs: Vec<Vec<u32>> = (0..n).map(|_| (0..d).map(|_| next()).collect()).collect();
            let mut expected: Vec<u32> = (0..d).map(|_| next()).collect();
            let mut got = expected.clone();
            for input in &inputs {
                for (e, &y) in expected.iter_mut().zip(input) {
                    *e = e.wrapping_add(y);
                }
            }
            let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
            let start = got.clone();
            modular_sum_into(&mut got, &refs).unwrap();
            prop_assert_eq!(&got, &expected);
            let mut acc = CpuReducer::default().modular_sum(d).unwrap();
            acc.add(&[&start]).unwrap();
            acc.add(&refs).unwrap();
            prop_assert_eq!(acc.read().unwrap(), expected);
        }
    }

    /// Sums that span several of the tasks' chunks (the property tests above stay inside
    /// one) equal the plain loops: every chunk's range is its own, none skipped or
    /// added twice, and the last, shorter one included.
    #[test]
    fn sums_across_chunk_boundaries_match_a_plain_loop() {
        let n = 13;
        for d in [WEIGHTED_CHUNK * 2 + 37, CHUNK * 3 + 5, WEIGHTED_CHUNK] {
            let updates: Vec<Vec<f32>> = (0..n)
                .map(|j| {
                    (0..d)
                        .map(|i| ((i * 31 + j * 17) % 2001) as f32 / 1000.0 - 1.0)
                        .collect()
                })
                .collect();
            let weights: Vec<f64> = (0..n).map(|j| (j * 7 + 1) as f64).collect();
            let refs: Vec<&[f32]> = updates.iter().map(Vec::as_slice).collect();
            let mut expected = vec![0.0f64; d];
            for (u, w) in updates.iter().zip(&weights) {
                for (e, &v) in expected.iter_mut().zip(u) {
                    *e += w * f64::from(v);
                }
            }
            let mut acc = CpuReducer::default().weighted_sum(d).unwrap();
            acc.add(&refs, &weights).unwrap();
            assert!(acc.read().unwrap() == expected, "weighted, d = {d}");

            let words: Vec<Vec<u32>> = (0..n)
                .map(|j| {
                    (0..d)
                        .map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ j as u32)
                        .collect()
                })
                .collect();
            let refs: Vec<&[u32]> = words.iter().map(Vec::as_slice).collect();
            let mut expected = vec![0u32; d];
            for w in &words {
                for (e, &y) in expected.iter_mut().zip(w) {
                    *e = e.wrapping_add(y);
                }
            }
            let mut acc = CpuReducer::default().modular_sum(d).unwrap();
            acc.add(&refs).unwrap();
            assert!(acc.read().unwrap() == expected, "modular, d = {d}");
        }
    }

    /// A batch holds at most 512 MiB of inputs and at least one input, whatever the
    /// size: a round of a hundred million-parameter updates folds in one pass.
    #[test]
    fn batches_hold_at_most_512_mib_and_at_least_one_input() {
        assert_eq!(batch_len(1_000_000), 134);
        assert!(batch_len(1_000_000) * 1_000_000 * 4 <= BATCH_BYTES);
        assert_eq!(batch_len(100_000_000), 1);
        assert_eq!(batch_len(usize::MAX), 1);
        assert_eq!(batch_len(0), BATCH_BYTES / 4);
    }

    /// An accumulator on a reused buffer (holding an earlier round's sums) starts from
    /// zero: its first batch overwrites what the buffer held, and one that never gets a
    /// batch reads as zeros.
    #[test]
    fn a_reused_buffer_starts_from_zero() {
        let cpu = CpuReducer::default();
        let x: Vec<f32> = (0..9000).map(|i| (i as f32).cos()).collect();
        let y: Vec<u32> = (0..9000u32).map(|i| i.wrapping_mul(77_777)).collect();
        for _ in 0..3 {
            let mut sum = cpu.weighted_sum(9000).unwrap();
            sum.add(&[x.as_slice(); 11], &[2.5; 11]).unwrap();
            drop(sum);
            let mut acc = cpu.modular_sum(9000).unwrap();
            acc.add(&[y.as_slice(); 9]).unwrap();
            drop(acc);
        }
        let mut sum = cpu.weighted_sum(9000).unwrap();
        assert!(sum.read().unwrap().iter().all(|&v| v == 0.0));
        sum.add(&[], &[]).unwrap();
        assert!(sum.read().unwrap().iter().all(|&v| v == 0.0));
        sum.add(&[&x], &[1.0]).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| 0.0 + f64::from(v)).collect();
        assert_eq!(sum.into_sums().unwrap(), want);
        let untouched = cpu.weighted_sum(9000).unwrap();
        assert!(untouched.into_sums().unwrap().iter().all(|&v| v == 0.0));
        let mut acc = cpu.modular_sum(9000).unwrap();
        acc.add(&[&y]).unwrap();
        assert_eq!(acc.into_sums().unwrap(), y);
        let untouched = cpu.modular_sum(9000).unwrap();
        assert!(untouched.into_sums().unwrap().iter().all(|&v| v == 0));
        // A refused batch leaves a fresh accumulator fresh (zeros), not half written.
        let mut sum = cpu.weighted_sum(9000).unwrap();
        assert!(sum.add(&[&x, &x[..10]], &[1.0, 1.0]).is_err());
        assert!(sum.read().unwrap().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn choices_parse_and_auto_never_fails() {
        assert_eq!("auto".parse(), Ok(ReducerChoice::Auto));
        assert_eq!(" CPU ".parse(), Ok(ReducerChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(ReducerChoice::Cuda));
        assert!("tpu".parse::<ReducerChoice>().is_err());
        let auto = select(ReducerChoice::Auto).unwrap();
        assert!(auto.line.starts_with("reducer: "), "{}", auto.line);
        let cpu = select(ReducerChoice::Cpu).unwrap();
        assert_eq!(cpu.reducer.name(), "cpu");
        if auto.reducer.name() == "cpu" {
            // No GPU here: asking for one is a clear error, not a panic.
            eprintln!("no GPU: {}", auto.line);
            assert!(select(ReducerChoice::Cuda).is_err());
        }
    }

    #[test]
    fn mismatched_inputs_are_refused_and_change_nothing() {
        let mut sum = vec![1.0; 4];
        assert_eq!(
            weighted_sum_into(&mut sum, &[&[1.0; 4], &[1.0; 3]], &[1.0, 1.0]),
            Err(ReduceError::LengthMismatch {
                index: 1,
                expected: 4,
                found: 3
            })
        );
        assert_eq!(
            weighted_sum_into(&mut sum, &[&[1.0; 4]], &[]),
            Err(ReduceError::WeightCount {
                updates: 1,
                weights: 0
            })
        );
        assert_eq!(sum, vec![1.0; 4]);
        let mut acc = vec![7u32; 3];
        assert!(modular_sum_into(&mut acc, &[&[1, 2]]).is_err());
        assert_eq!(acc, vec![7; 3]);
        let mut device_like = CpuReducer::default().modular_sum(3).unwrap();
        assert!(device_like.add(&[&[1, 2, 3], &[1]]).is_err());
        assert_eq!(device_like.read().unwrap(), vec![0; 3]);
    }

    #[test]
    fn masks_through_the_reducer_equal_the_generator() {
        let seed = [3u8; 32];
        let masks = [Mask {
            seed: &seed,
            sign: prg::MaskSign::Add,
        }];
        let mut a = vec![0u32; 1000];
        let mut b = vec![0u32; 1000];
        CpuReducer::default()
            .apply_masks(&masks, 17, &mut a)
            .unwrap();
        prg::apply_masks(&masks, 17, &mut b).unwrap();
        assert_eq!(a, b);
    }
}
