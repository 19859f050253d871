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

/// Elements of the accumulator one task owns at a time: 32 KiB of `f64` (or 16 KiB of
/// `u32`), which stays in the first-level cache while a batch's inputs stream past it.
const CHUNK: usize = 4096;

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
/// accumulator and streaming the batch's inputs through them, with loops compiled for the
/// widest vector unit the CPU has. It allocates nothing per input.
///
/// Accumulators come from a small pool of buffers that finished accumulators return to,
/// so a coordinator's round after round reuses memory whose pages are already mapped
/// (a fresh 8 MB buffer costs thousands of page faults, more than the sum itself on a
/// virtual machine).
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
            buf.clear();
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

/// [`CpuReducer`]'s weighted sum.
#[derive(Debug)]
struct CpuWeightedSum {
    sum: Vec<f64>,
    pool: Arc<Pool>,
}

/// [`CpuReducer`]'s modular sum.
#[derive(Debug)]
struct CpuModularSum {
    acc: Vec<u32>,
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
    if updates.len() != weights.len() {
        return Err(ReduceError::WeightCount {
            updates: updates.len(),
            weights: weights.len(),
        });
    }
    check_lengths(sum.len(), updates)?;
    let kernels = kernels::detect();
    sum.par_chunks_mut(CHUNK).enumerate().for_each(|(c, s)| {
        let range = c * CHUNK..c * CHUNK + s.len();
        // Four updates per pass over the accumulator: it is loaded and stored once for
        // four additions, made in the same order as one at a time.
        let mut quads = updates.chunks_exact(4).zip(weights.chunks_exact(4));
        for (u, w) in &mut quads {
            let x = [
                &u[0][range.clone()],
                &u[1][range.clone()],
                &u[2][range.clone()],
                &u[3][range.clone()],
            ];
            kernels.axpy4(s, x, [w[0], w[1], w[2], w[3]]);
        }
        let rest = updates.len() / 4 * 4;
        for (u, &w) in updates[rest..].iter().zip(&weights[rest..]) {
            kernels.axpy(s, &u[range.clone()], w);
        }
    });
    Ok(())
}

/// `acc[i] += y_j[i] (mod 2^32)` for every input of the batch, in place.
pub fn modular_sum_into(acc: &mut [u32], inputs: &[&[u32]]) -> Result<(), ReduceError> {
    check_lengths(acc.len(), inputs)?;
    let kernels = kernels::detect();
    acc.par_chunks_mut(CHUNK).enumerate().for_each(|(c, a)| {
        let range = c * CHUNK..c * CHUNK + a.len();
        for input in inputs {
            kernels.add_words(a, &input[range.clone()]);
        }
    });
    Ok(())
}

impl WeightedSum for CpuWeightedSum {
    fn add(&mut self, updates: &[&[f32]], weights: &[f64]) -> Result<(), ReduceError> {
        weighted_sum_into(&mut self.sum, updates, weights)
    }

    fn read(&self) -> Result<Vec<f64>, ReduceError> {
        Ok(self.sum.clone())
    }

    fn into_sums(mut self: Box<Self>) -> Result<Vec<f64>, ReduceError> {
        Ok(std::mem::take(&mut self.sum))
    }
}

impl ModularSum for CpuModularSum {
    fn add(&mut self, inputs: &[&[u32]]) -> Result<(), ReduceError> {
        modular_sum_into(&mut self.acc, inputs)
    }

    fn read(&self) -> Result<Vec<u32>, ReduceError> {
        Ok(self.acc.clone())
    }

    fn into_sums(mut self: Box<Self>) -> Result<Vec<u32>, ReduceError> {
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
            pool: self.pool.clone(),
        }))
    }

    fn modular_sum(&self, len: usize) -> Result<Box<dyn ModularSum>, ReduceError> {
        Ok(Box::new(CpuModularSum {
            acc: take(&self.pool.u32s, len),
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
    /// `acc[i] += w * x[i]`.
    pub(super) fn axpy_portable(acc: &mut [f64], x: &[f32], w: f64) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += w * f64::from(v);
        }
    }

    /// `acc[i] += w[0] x[0][i]`, then `+= w[1] x[1][i]`, and so on: the additions of four
    /// [`axpy_portable`] calls in their order, with one load and store of `acc`.
    pub(super) fn axpy4_portable(acc: &mut [f64], x: [&[f32]; 4], w: [f64; 4]) {
        let n = acc
            .len()
            .min(x[0].len())
            .min(x[1].len())
            .min(x[2].len())
            .min(x[3].len());
        let (acc, x0, x1, x2, x3) = (
            &mut acc[..n],
            &x[0][..n],
            &x[1][..n],
            &x[2][..n],
            &x[3][..n],
        );
        for i in 0..n {
            let mut a = acc[i];
            a += w[0] * f64::from(x0[i]);
            a += w[1] * f64::from(x1[i]);
            a += w[2] * f64::from(x2[i]);
            a += w[3] * f64::from(x3[i]);
            acc[i] = a;
        }
    }

    /// `acc[i] += y[i] (mod 2^32)`.
    pub(super) fn add_words_portable(acc: &mut [u32], y: &[u32]) {
        for (a, &v) in acc.iter_mut().zip(y) {
            *a = a.wrapping_add(v);
        }
    }

    /// The kernels chosen for this CPU.
    #[derive(Clone, Copy)]
    pub(super) struct Kernels {
        #[cfg(target_arch = "x86_64")]
        level: x86::Level,
    }

    impl Kernels {
        pub(super) fn axpy(self, acc: &mut [f64], x: &[f32], w: f64) {
            #[cfg(target_arch = "x86_64")]
            {
                x86::axpy(self.level, acc, x, w)
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                axpy_portable(acc, x, w)
            }
        }

        pub(super) fn axpy4(self, acc: &mut [f64], x: [&[f32]; 4], w: [f64; 4]) {
            #[cfg(target_arch = "x86_64")]
            {
                x86::axpy4(self.level, acc, x, w)
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                axpy4_portable(acc, x, w)
            }
        }

        pub(super) fn add_words(self, acc: &mut [u32], y: &[u32]) {
            #[cfg(target_arch = "x86_64")]
            {
                x86::add_words(self.level, acc, y)
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                add_words_portable(acc, y)
            }
        }
    }

    pub(super) fn detect() -> Kernels {
        Kernels {
            #[cfg(target_arch = "x86_64")]
            level: x86::Level::detect(),
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

        #[target_feature(enable = "avx512f")]
        fn axpy_avx512(acc: &mut [f64], x: &[f32], w: f64) {
            super::axpy_portable(acc, x, w)
        }

        #[target_feature(enable = "avx2")]
        fn axpy_avx2(acc: &mut [f64], x: &[f32], w: f64) {
            super::axpy_portable(acc, x, w)
        }

        #[target_feature(enable = "avx512f")]
        fn axpy4_avx512(acc: &mut [f64], x: [&[f32]; 4], w: [f64; 4]) {
            super::axpy4_portable(acc, x, w)
        }

        #[target_feature(enable = "avx2")]
        fn axpy4_avx2(acc: &mut [f64], x: [&[f32]; 4], w: [f64; 4]) {
            super::axpy4_portable(acc, x, w)
        }

        pub(super) fn axpy4(level: Level, acc: &mut [f64], x: [&[f32]; 4], w: [f64; 4]) {
            match level {
                // SAFETY: `Level::detect` saw the CPU report AVX-512F; the function
                // body is safe Rust over slices.
                Level::Avx512 => unsafe { axpy4_avx512(acc, x, w) },
                // SAFETY: as above, for AVX2.
                Level::Avx2 => unsafe { axpy4_avx2(acc, x, w) },
                Level::Portable => super::axpy4_portable(acc, x, w),
            }
        }

        #[target_feature(enable = "avx512f")]
        fn add_words_avx512(acc: &mut [u32], y: &[u32]) {
            super::add_words_portable(acc, y)
        }

        #[target_feature(enable = "avx2")]
        fn add_words_avx2(acc: &mut [u32], y: &[u32]) {
            super::add_words_portable(acc, y)
        }

        pub(super) fn axpy(level: Level, acc: &mut [f64], x: &[f32], w: f64) {
            match level {
                // SAFETY: `Level::detect` saw the CPU report AVX-512F; the function
                // body is safe Rust over slices.
                Level::Avx512 => unsafe { axpy_avx512(acc, x, w) },
                // SAFETY: as above, for AVX2.
                Level::Avx2 => unsafe { axpy_avx2(acc, x, w) },
                Level::Portable => super::axpy_portable(acc, x, w),
            }
        }

        pub(super) fn add_words(level: Level, acc: &mut [u32], y: &[u32]) {
            match level {
                // SAFETY: `Level::detect` saw the CPU report AVX-512F; the function
                // body is safe Rust over slices.
                Level::Avx512 => unsafe { add_words_avx512(acc, y) },
                // SAFETY: as above, for AVX2.
                Level::Avx2 => unsafe { add_words_avx2(acc, y) },
                Level::Portable => super::add_words_portable(acc, y),
            }
        }

        #[cfg(test)]
        mod tests {
            use super::*;

            /// Every instruction set this CPU has gives the portable loop's bits.
            #[test]
            fn every_level_gives_the_same_bits() {
                let x: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin()).collect();
                let y: Vec<u32> = (0..1003u32)
                    .map(|i| i.wrapping_mul(2_654_435_761))
                    .collect();
                let mut levels = vec![Level::Portable];
                if std::arch::is_x86_feature_detected!("avx2") {
                    levels.push(Level::Avx2);
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    levels.push(Level::Avx512);
                }
                let mut expected = vec![0.25f64; 1003];
                super::super::axpy_portable(&mut expected, &x, 3.3);
                let mut words = vec![7u32; 1003];
                super::super::add_words_portable(&mut words, &y);
                let mut four = vec![0.25f64; 1003];
                for w in [1.5, -2.0, 0.1, 7.0] {
                    super::super::axpy_portable(&mut four, &x, w);
                }
                for level in levels {
                    let mut got = vec![0.25f64; 1003];
                    axpy(level, &mut got, &x, 3.3);
                    assert_eq!(got, expected, "{level:?}");
                    let mut got4 = vec![0.25f64; 1003];
                    axpy4(level, &mut got4, [&x, &x, &x, &x], [1.5, -2.0, 0.1, 7.0]);
                    assert_eq!(got4, four, "{level:?}: four at once, same bits");
                    let mut w = vec![7u32; 1003];
                    add_words(level, &mut w, &y);
                    assert_eq!(w, words, "{level:?}");
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
            n in 0usize..6,
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
            n in 0usize..6,
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
