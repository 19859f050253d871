//! The CUDA reducer (feature `cuda`): the same three operations as the CPU's, on an
//! NVIDIA GPU through cudarc, with the driver and NVRTC loaded at run time, so that a
//! build with the feature runs (on the CPU) where CUDA is not installed.
//!
//! - Kernels are compiled at start-up with NVRTC, with `--fmad=false`, so the `f64`
//!   weighted sums round exactly as the CPU's loops do (no fused multiply-add), and the
//!   integer results are the same bits by construction.
//! - Sums live in device memory across batches; a batch of updates is copied through a
//!   pinned (page-locked) staging buffer on one of two streams while the previous batch
//!   is reduced on the other, so copies overlap compute. cudarc's per-buffer events order
//!   the kernels that share the accumulator.
//! - The mask kernel gives each thread one 64-byte ChaCha20 block of the accumulator and
//!   a group of seeds; groups add their partial sums with atomic adds, which are exact
//!   modulo 2^32 in any order.
//!
//! cudarc panics when the CUDA library is missing instead of returning an error, so
//! [`CudaReducer::new`] checks for the libraries first and also turns any panic during
//! start-up into an error.

// Kernel launches and pinned allocations are `unsafe` in cudarc; each use below says
// why it is sound.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use crate::reduce::{ModularSum, ReduceError, Reducer, WeightedSum};
use crate::secagg::prg::{KEYSTREAM_WORDS, MASK_NONCE, Mask, MaskSign, PrgError};

/// The kernels, compiled at run time.
const KERNELS: &str = r#"
extern "C" __global__ void weighted_sum(double* sum, const float* updates,
                                        const double* weights, int batch,
                                        unsigned long long len) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < len; i += stride) {
        double acc = sum[i];
        for (int j = 0; j < batch; ++j) {
            // Separate multiply and add, rounded as the CPU's loop rounds them.
            acc = __dadd_rn(acc, __dmul_rn(weights[j], (double)updates[(unsigned long long)j * len + i]));
        }
        sum[i] = acc;
    }
}

extern "C" __global__ void modular_sum(unsigned int* acc, const unsigned int* inputs,
                                       int batch, unsigned long long len) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < len; i += stride) {
        unsigned int a = acc[i];
        for (int j = 0; j < batch; ++j) {
            a += inputs[(unsigned long long)j * len + i];
        }
        acc[i] = a;
    }
}

__device__ __forceinline__ unsigned int rotl32(unsigned int x, int n) {
    return __funnelshift_l(x, x, n);
}

#define QR(a, b, c, d)                     \
    a += b; d ^= a; d = rotl32(d, 16);     \
    c += d; b ^= c; b = rotl32(b, 12);     \
    a += b; d ^= a; d = rotl32(d, 8);      \
    c += d; b ^= c; b = rotl32(b, 7);

// Thread (x, y): keystream block `first_block + x` of every mask in group y. `keys`
// holds 8 little-endian words per mask, `signs` 0 (add) or 1 (subtract).
extern "C" __global__ void apply_masks(unsigned int* acc, const unsigned int* keys,
                                       const int* signs, int masks, int groups,
                                       unsigned long long first_word,
                                       unsigned long long len,
                                       unsigned int n0, unsigned int n1, unsigned int n2) {
    unsigned long long first_block = first_word / 16;
    unsigned long long blocks = (first_word + len - 1) / 16 - first_block + 1;
    unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= blocks) return;
    unsigned long long block = first_block + t;
    int per_group = (masks + groups - 1) / groups;
    int m0 = blockIdx.y * per_group;
    int m1 = min(masks, m0 + per_group);
    if (m0 >= m1) return;
    unsigned int part[16];
    #pragma unroll
    for (int w = 0; w < 16; ++w) part[w] = 0;
    for (int m = m0; m < m1; ++m) {
        const unsigned int* k = keys + 8 * m;
        unsigned int x0 = 0x61707865u, x1 = 0x3320646eu, x2 = 0x79622d32u, x3 = 0x6b206574u;
        unsigned int x4 = k[0], x5 = k[1], x6 = k[2], x7 = k[3];
        unsigned int x8 = k[4], x9 = k[5], x10 = k[6], x11 = k[7];
        unsigned int x12 = (unsigned int)block, x13 = n0, x14 = n1, x15 = n2;
        unsigned int s[16] = {x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15};
        #pragma unroll
        for (int r = 0; r < 10; ++r) {
            QR(x0, x4, x8, x12) QR(x1, x5, x9, x13) QR(x2, x6, x10, x14) QR(x3, x7, x11, x15)
            QR(x0, x5, x10, x15) QR(x1, x6, x11, x12) QR(x2, x7, x8, x13) QR(x3, x4, x9, x14)
        }
        unsigned int out[16] = {x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15};
        int sub = signs[m];
        #pragma unroll
        for (int w = 0; w < 16; ++w) {
            unsigned int ks = out[w] + s[w];
            part[w] += sub ? (0u - ks) : ks;
        }
    }
    unsigned long long base = block * 16;
    #pragma unroll
    for (int w = 0; w < 16; ++w) {
        unsigned long long word = base + w;
        if (word >= first_word && word < first_word + len) {
            atomicAdd(acc + (word - first_word), part[w]);
        }
    }
}
"#;

/// Why the GPU cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library on this machine.
    #[error("no CUDA driver found")]
    NoDriver,
    /// No NVRTC library (needed to compile the kernels).
    #[error("no NVRTC library found")]
    NoNvrtc,
    /// A driver but no device.
    #[error("no CUDA device found")]
    NoDevice,
    /// The driver, NVRTC or a kernel failed.
    #[error("CUDA: {0}")]
    Driver(String),
}

fn driver(e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

fn device(e: impl std::fmt::Debug) -> ReduceError {
    ReduceError::Device(format!("{e:?}"))
}

struct Inner {
    ctx: Arc<CudaContext>,
    streams: [Arc<CudaStream>; 2],
    weighted_sum: CudaFunction,
    modular_sum: CudaFunction,
    apply_masks: CudaFunction,
    name: String,
}

impl Inner {
    /// Waits until both streams have finished everything queued on them.
    fn sync(&self) -> Result<(), ReduceError> {
        for stream in &self.streams {
            stream.synchronize().map_err(device)?;
        }
        Ok(())
    }
}

/// The GPU backend of [`Reducer`].
#[derive(Clone)]
pub struct CudaReducer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CudaReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaReducer")
            .field("device", &self.inner.name)
            .finish()
    }
}

/// Threads per block of every kernel.
const THREADS: u32 = 256;

fn grid_for(elements: u64) -> LaunchConfig {
    // Grid-stride loops: enough blocks to fill a large GPU, never more than the elements.
    let blocks = elements.div_ceil(u64::from(THREADS)).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaReducer {
    /// The reducer on device 0, or why there is none. Never panics.
    pub fn new() -> Result<Self, CudaError> {
        // SAFETY: these only try to load the libraries and report whether they could.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::NoNvrtc);
        }
        std::panic::catch_unwind(Self::start)
            .unwrap_or_else(|_| Err(CudaError::Driver("CUDA start-up panicked".into())))
    }

    fn start() -> Result<Self, CudaError> {
        if CudaContext::device_count().map_err(driver)? < 1 {
            return Err(CudaError::NoDevice);
        }
        let ctx = CudaContext::new(0).map_err(driver)?;
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        // Compiled for this device's own architecture (sm_90 on Hopper), not NVRTC's
        // oldest default.
        let ptx = compile_ptx_with_opts(
            KERNELS,
            CompileOptions {
                fmad: Some(false),
                options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
                ..CompileOptions::default()
            },
        )
        .map_err(driver)?;
        let module = ctx.load_module(ptx).map_err(driver)?;
        let memory = ctx.total_mem().map_err(driver)?;
        let name = format!(
            "{} (compute {major}.{minor}, {} GiB)",
            ctx.name().map_err(driver)?,
            memory >> 30
        );
        Ok(Self {
            inner: Arc::new(Inner {
                streams: [
                    ctx.new_stream().map_err(driver)?,
                    ctx.new_stream().map_err(driver)?,
                ],
                weighted_sum: module.load_function("weighted_sum").map_err(driver)?,
                modular_sum: module.load_function("modular_sum").map_err(driver)?,
                apply_masks: module.load_function("apply_masks").map_err(driver)?,
                ctx,
                name,
            }),
        })
    }

    /// The device, for the log line.
    pub fn describe(&self) -> String {
        self.inner.name.clone()
    }
}

/// Inputs copied to the device per piece of a batch.
const DEVICE_BATCH: usize = 16;

/// Two pinned host buffers and two device buffers of one batch each, used in turn on the
/// two streams: while one batch is reduced, the next is copied.
struct Staging<T: cudarc::driver::DeviceRepr> {
    host: [Option<PinnedHostSlice<T>>; 2],
    device: [Option<CudaSlice<T>>; 2],
    turn: usize,
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy> Staging<T> {
    fn new() -> Self {
        Self {
            host: [None, None],
            device: [None, None],
            turn: 0,
        }
    }

    /// Copies the batch into this turn's pinned buffer and onto the device, on this
    /// turn's stream; returns the stream and the device buffer.
    fn upload<'a>(
        &'a mut self,
        inner: &Inner,
        batch: &[&[T]],
        len: usize,
    ) -> Result<(Arc<CudaStream>, &'a CudaSlice<T>), ReduceError> {
        let turn = self.turn;
        self.turn ^= 1;
        let total = batch.len() * len;
        let stream = inner.streams[turn].clone();
        if self.host[turn].as_ref().is_none_or(|h| h.len() != total) {
            // SAFETY: the buffer is written in full below before any read.
            self.host[turn] = Some(unsafe { inner.ctx.alloc_pinned::<T>(total) }.map_err(device)?);
        }
        if self.device[turn].as_ref().is_none_or(|d| d.len() < total) {
            self.device[turn] = Some(stream.alloc_zeros::<T>(total).map_err(device)?);
        }
        let host = self.host[turn].as_mut().expect("allocated above");
        // Waits until the previous copy out of this buffer has finished.
        let staged = host.as_mut_slice().map_err(device)?;
        for (dst, src) in staged.chunks_exact_mut(len).zip(batch) {
            dst.copy_from_slice(src);
        }
        let dev = self.device[turn].as_mut().expect("allocated above");
        stream.memcpy_htod(&*host, dev).map_err(device)?;
        Ok((stream, self.device[turn].as_ref().expect("allocated above")))
    }
}

struct CudaWeightedSum {
    inner: Arc<Inner>,
    sum: CudaSlice<f64>,
    staging: Staging<f32>,
}

struct CudaModularSum {
    inner: Arc<Inner>,
    acc: CudaSlice<u32>,
    staging: Staging<u32>,
}

impl std::fmt::Debug for CudaWeightedSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaWeightedSum")
            .field("len", &self.sum.len())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for CudaModularSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModularSum")
            .field("len", &self.acc.len())
            .finish_non_exhaustive()
    }
}

fn check<T>(expected: usize, inputs: &[&[T]]) -> Result<(), ReduceError> {
    match inputs.iter().position(|x| x.len() != expected) {
        Some(index) => Err(ReduceError::LengthMismatch {
            index,
            expected,
            found: inputs[index].len(),
        }),
        None => Ok(()),
    }
}

impl WeightedSum for CudaWeightedSum {
    fn add(&mut self, updates: &[&[f32]], weights: &[f64]) -> Result<(), ReduceError> {
        if updates.len() != weights.len() {
            return Err(ReduceError::WeightCount {
                updates: updates.len(),
                weights: weights.len(),
            });
        }
        let len = self.sum.len();
        check(len, updates)?;
        if updates.is_empty() || len == 0 {
            return Ok(());
        }
        // The host's batches can hold hundreds of updates (`reduce::batch_len`); the
        // device takes them a few at a time, so that the pinned buffers stay small and a
        // piece is copied while the previous one is reduced.
        if updates.len() > DEVICE_BATCH {
            for (u, w) in updates
                .chunks(DEVICE_BATCH)
                .zip(weights.chunks(DEVICE_BATCH))
            {
                self.add(u, w)?;
            }
            return Ok(());
        }
        let inner = self.inner.clone();
        let (stream, staged) = self.staging.upload(&inner, updates, len)?;
        let weights = stream.clone_htod(weights).map_err(device)?;
        let batch = updates.len() as i32;
        let n = len as u64;
        let mut launch = stream.launch_builder(&inner.weighted_sum);
        launch
            .arg(&mut self.sum)
            .arg(staged)
            .arg(&weights)
            .arg(&batch)
            .arg(&n);
        // SAFETY: the kernel reads `batch * len` floats of `staged` (that many were
        // copied), `batch` weights, and reads and writes `len` sums, matching its
        // signature.
        unsafe { launch.launch(grid_for(n)) }.map_err(device)?;
        Ok(())
    }

    fn sync(&self) -> Result<(), ReduceError> {
        self.inner.sync()
    }

    fn read(&self) -> Result<Vec<f64>, ReduceError> {
        self.inner.streams[0].clone_dtoh(&self.sum).map_err(device)
    }

    fn into_sums(self: Box<Self>) -> Result<Vec<f64>, ReduceError> {
        self.read()
    }
}

impl ModularSum for CudaModularSum {
    fn add(&mut self, inputs: &[&[u32]]) -> Result<(), ReduceError> {
        let len = self.acc.len();
        check(len, inputs)?;
        if inputs.is_empty() || len == 0 {
            return Ok(());
        }
        if inputs.len() > DEVICE_BATCH {
            for piece in inputs.chunks(DEVICE_BATCH) {
                self.add(piece)?;
            }
            return Ok(());
        }
        let inner = self.inner.clone();
        let (stream, staged) = self.staging.upload(&inner, inputs, len)?;
        let batch = inputs.len() as i32;
        let n = len as u64;
        let mut launch = stream.launch_builder(&inner.modular_sum);
        launch.arg(&mut self.acc).arg(staged).arg(&batch).arg(&n);
        // SAFETY: the kernel reads `batch * len` words of `staged` and reads and writes
        // `len` words of the accumulator, matching its signature.
        unsafe { launch.launch(grid_for(n)) }.map_err(device)?;
        Ok(())
    }

    fn sync(&self) -> Result<(), ReduceError> {
        self.inner.sync()
    }

    fn read(&self) -> Result<Vec<u32>, ReduceError> {
        self.inner.streams[0].clone_dtoh(&self.acc).map_err(device)
    }

    fn into_sums(self: Box<Self>) -> Result<Vec<u32>, ReduceError> {
        self.read()
    }
}

impl Reducer for CudaReducer {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn weighted_sum(&self, len: usize) -> Result<Box<dyn WeightedSum>, ReduceError> {
        let stream = &self.inner.streams[0];
        // A zero-byte device allocation is an error; an empty sum is the null slice.
        let sum = if len == 0 {
            stream.null::<f64>()
        } else {
            stream.alloc_zeros::<f64>(len)
        }
        .map_err(device)?;
        Ok(Box::new(CudaWeightedSum {
            inner: self.inner.clone(),
            sum,
            staging: Staging::new(),
        }))
    }

    fn modular_sum(&self, len: usize) -> Result<Box<dyn ModularSum>, ReduceError> {
        let stream = &self.inner.streams[0];
        let acc = if len == 0 {
            stream.null::<u32>()
        } else {
            stream.alloc_zeros::<u32>(len)
        }
        .map_err(device)?;
        Ok(Box::new(CudaModularSum {
            inner: self.inner.clone(),
            acc,
            staging: Staging::new(),
        }))
    }

    fn apply_masks(
        &self,
        masks: &[Mask<'_>],
        first_word: u64,
        acc: &mut [u32],
    ) -> Result<(), ReduceError> {
        let len = acc.len();
        if first_word
            .checked_add(len as u64)
            .is_none_or(|end| end > KEYSTREAM_WORDS)
        {
            return Err(ReduceError::Prg(PrgError::OutOfRange { first_word, len }));
        }
        if masks.is_empty() || len == 0 {
            return Ok(());
        }
        let stream = &self.inner.streams[0];
        let keys: Vec<u32> = masks
            .iter()
            .flat_map(|m| {
                m.seed
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            })
            .collect();
        let signs: Vec<i32> = masks
            .iter()
            .map(|m| i32::from(m.sign == MaskSign::Subtract))
            .collect();
        let nonce: Vec<u32> = MASK_NONCE
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut dev_acc = stream.clone_htod(acc).map_err(device)?;
        let dev_keys = stream.clone_htod(&keys).map_err(device)?;
        let dev_signs = stream.clone_htod(&signs).map_err(device)?;
        let blocks = (first_word + len as u64 - 1) / 16 - first_word / 16 + 1;
        // Enough mask groups to give the GPU about a million threads, at most one per
        // mask.
        let groups = (1_000_000u64.div_ceil(blocks)).clamp(1, masks.len() as u64) as u32;
        let count = masks.len() as i32;
        let group_count = groups as i32;
        let cfg = LaunchConfig {
            grid_dim: (blocks.div_ceil(u64::from(THREADS)) as u32, groups, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = len as u64;
        let mut launch = stream.launch_builder(&self.inner.apply_masks);
        launch
            .arg(&mut dev_acc)
            .arg(&dev_keys)
            .arg(&dev_signs)
            .arg(&count)
            .arg(&group_count)
            .arg(&first_word)
            .arg(&n)
            .arg(&nonce[0])
            .arg(&nonce[1])
            .arg(&nonce[2]);
        // SAFETY: the kernel reads 8 words of key and one sign per mask (`count` masks
        // were copied) and adds to the `len` words of `dev_acc` only, matching its
        // signature; the grid covers every block of the range.
        unsafe { launch.launch(cfg) }.map_err(device)?;
        stream.memcpy_dtoh(&dev_acc, acc).map_err(device)?;
        stream.synchronize().map_err(device)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::CpuReducer;
    use crate::secagg::prg;

    /// The reducer, or `None` (with a visible message) where no GPU can be used.
    fn gpu() -> Option<CudaReducer> {
        match CudaReducer::new() {
            Ok(r) => {
                eprintln!("CUDA tests run on {}", r.describe());
                Some(r)
            }
            Err(e) => {
                eprintln!("CUDA tests skipped: {e}");
                None
            }
        }
    }

    fn words(n: usize, seed: u64) -> Vec<u32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u32
            })
            .collect()
    }

    #[test]
    fn start_up_never_panics() {
        // On a machine without CUDA this is an error, not a panic; with one, a reducer.
        let _ = gpu();
    }

    /// Integer results on the device are the CPU's, bit for bit, on random inputs:
    /// masked sums over batches, and masks at unaligned offsets with mixed signs.
    #[test]
    fn integer_results_are_bit_identical_to_the_cpu() {
        let Some(gpu) = gpu() else { return };
        for (d, n, first_word) in [
            (1usize, 1usize, 0u64),
            (1000, 7, 3),
            (1 << 20, 40, 17),
            (100_003, 130, 1 << 30),
        ] {
            let inputs: Vec<Vec<u32>> = (0..n).map(|j| words(d, j as u64 + 9)).collect();
            let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
            let mut on_gpu = gpu.modular_sum(d).unwrap();
            let mut on_cpu = CpuReducer::default().modular_sum(d).unwrap();
            for batch in refs.chunks(16) {
                on_gpu.add(batch).unwrap();
                on_cpu.add(batch).unwrap();
            }
            let sum = on_cpu.read().unwrap();
            assert_eq!(on_gpu.read().unwrap(), sum, "masked sum d={d} n={n}");
            let seeds: Vec<[u8; 32]> = (0..n)
                .map(|j| {
                    let w = words(8, j as u64 + 1000);
                    let mut s = [0u8; 32];
                    for (c, x) in s.chunks_exact_mut(4).zip(w) {
                        c.copy_from_slice(&x.to_le_bytes());
                    }
                    s
                })
                .collect();
            let masks: Vec<Mask<'_>> = seeds
                .iter()
                .enumerate()
                .map(|(j, seed)| Mask {
                    seed,
                    sign: if j % 3 == 0 {
                        MaskSign::Subtract
                    } else {
                        MaskSign::Add
                    },
                })
                .collect();
            let mut a = sum.clone();
            let mut b = sum;
            gpu.apply_masks(&masks, first_word, &mut a).unwrap();
            prg::apply_masks_parallel(&masks, first_word, &mut b).unwrap();
            assert_eq!(a, b, "masks d={d} n={n} first_word={first_word}");
        }
    }

    /// The weighted sum on the device rounds exactly as the CPU's.
    #[test]
    fn weighted_sums_match_the_cpu() {
        let Some(gpu) = gpu() else { return };
        let d = 300_001;
        let updates: Vec<Vec<f32>> = (0..37)
            .map(|j| {
                words(d, j + 77)
                    .into_iter()
                    .map(|w| (w % 20_001) as f32 / 10_000.0 - 1.0)
                    .collect()
            })
            .collect();
        let weights: Vec<f64> = (0..37).map(|j| f64::from(j * 13 % 900 + 100)).collect();
        let refs: Vec<&[f32]> = updates.iter().map(Vec::as_slice).collect();
        let mut on_gpu = gpu.weighted_sum(d).unwrap();
        let mut on_cpu = CpuReducer::default().weighted_sum(d).unwrap();
        for (batch, w) in refs.chunks(16).zip(weights.chunks(16)) {
            on_gpu.add(batch, w).unwrap();
            on_cpu.add(batch, w).unwrap();
        }
        assert_eq!(on_gpu.read().unwrap(), on_cpu.read().unwrap());
    }
}
