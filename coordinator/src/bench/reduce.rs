//! `cohort bench reduce`: the reducer's three hot loops at a chosen size, each next to a
//! memory read probe measured in the same run: the best of several read patterns.
//!
//! - `fedavg`: the weighted sum of `n` updates of `d` `f32`, folded in batches as the
//!   server's job folds them; bytes are the updates read.
//! - `fedavg_in_cache`: the same fold over updates that stay in the cores' caches: the
//!   kernel's arithmetic alone, the ceiling of `fedavg` on a machine whose memory is
//!   faster than it.
//! - `masked_sum`: the modular sum of `n` masked inputs of `d` words.
//! - `mask_expand`: `n` ChaCha20 masks expanded and added to one accumulator; bytes are
//!   the mask output. The line also gives the rate of one core (`gbps_per_core`: one
//!   mask expanded on one thread) next to the ChaCha20 keystream of two well-kept crates
//!   on one core, measured in the same run: RustCrypto's `chacha20` (`chacha20_crate_gbps`)
//!   and `rand_chacha` (`rand_chacha_gbps`), each filling a buffer of the mask's size.
//!
//! One JSON line per measurement: `bench`, `n`, `d`, `reducer`, `median_s`, `gbps`,
//! `probe_read_gbps` (the best read pattern's, named in `probe_pattern`; every
//! pattern's figure in `probe_patterns`), `ratio` (= `gbps / probe_read_gbps`) and
//! `huge_pages` (the system's transparent huge page setting, which decides whether the
//! inputs and the probe's buffer got them: `always`, `madvise`, `never`). The
//! lines of the sums that read memory (`fedavg`, `masked_sum`) add `ratio_paired`: the
//! best pattern is read again just before each repeat, and the figure is the median of
//! each repeat's rate over the probe read before it (`probe_paired_gbps` the median of
//! those probes), which holds where the machine's memory speed moves within a run. The
//! sums' accumulator is taken from the reducer (reused memory in steady state) and
//! reading the sums back, once per round, is not part of the figure.

use std::time::Instant;

use clap::Args;
use cohort_aggregation::reduce::{self, Reducer};
use cohort_aggregation::secagg::prg::{Mask, MaskSign};
use rayon::prelude::*;
use serde_json::json;

use super::secagg::median;

/// Flags of `cohort bench reduce`.
#[derive(Debug, Clone, Args)]
pub struct ReduceBenchArgs {
    /// Updates (and masks) per measurement
    #[arg(long, default_value_t = 100)]
    pub n: usize,
    /// Parameters per update (1e6 style accepted)
    #[arg(long, default_value = "1000000", value_parser = super::secagg::parse_count)]
    pub d: usize,
    /// auto | cpu | cuda
    #[arg(long, default_value = "cpu")]
    pub reducer: cohort_aggregation::reduce::ReducerChoice,
    /// Updates per batch for fedavg and masked_sum [default: as the server's jobs and
    /// `cohort simulate` batch them, as many as fit in 512 MiB]
    #[arg(long)]
    pub batch: Option<usize>,
    /// Measurements per figure; the median is reported
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
}

/// Reads `bytes` of memory and returns the best pattern's GB/s (median of `repeats`
/// each; see [`super::read_probe`]).
pub fn read_probe(bytes: usize, repeats: usize) -> f64 {
    super::read_probe::measure(bytes, repeats).best().gbps
}

/// Times `f` `repeats` times, reading the probe's buffer once just before each.
fn time_paired<F: FnMut()>(repeats: usize, probe: &Probe, mut f: F) -> Paired {
    let repeats = (0..repeats)
        .map(|_| {
            let gbps = probe.reread.gbps();
            let start = Instant::now();
            f();
            (start.elapsed().as_secs_f64(), gbps)
        })
        .collect();
    Paired { repeats }
}

fn time<F: FnMut()>(repeats: usize, mut f: F) -> f64 {
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        f();
        times.push(start.elapsed().as_secs_f64());
    }
    median(times)
}

/// The run's memory read probe, which every line carries, and its best pattern kept to
/// read again just before each repeat of a kernel that reads memory.
struct Probe {
    best: super::read_probe::PatternRate,
    patterns: serde_json::Map<String, serde_json::Value>,
    reread: super::read_probe::Reread,
    /// The system's transparent huge page setting, read once for every line.
    huge_pages: String,
}

/// A kernel's repeats, each with the probe read just before it.
struct Paired {
    /// Each repeat's seconds and the probe's GB/s just before it.
    repeats: Vec<(f64, f64)>,
}

impl Paired {
    /// The median seconds of the kernel's repeats.
    fn seconds(&self) -> f64 {
        median(self.repeats.iter().map(|&(s, _)| s).collect())
    }

    /// `probe_paired_gbps` (the median of the probes read before the repeats) and
    /// `ratio_paired` (the median of each repeat's GB/s over the probe read before it),
    /// for `bytes` read per repeat.
    fn fields(&self, bytes: usize) -> serde_json::Value {
        let probes = self.repeats.iter().map(|&(_, p)| p).collect();
        let ratios = self
            .repeats
            .iter()
            .map(|&(s, p)| bytes as f64 / s / 1e9 / p)
            .collect();
        json!({"probe_paired_gbps": median(probes), "ratio_paired": median(ratios)})
    }
}

impl Probe {
    fn measure() -> Self {
        let (measured, reread) = super::read_probe::measure_and_keep(1 << 30, 5);
        Self {
            reread,
            huge_pages: crate::huge_pages::transparent_huge_pages(),
            best: measured.best(),
            patterns: measured
                .patterns
                .iter()
                .map(|p| (p.pattern.to_string(), json!(p.gbps)))
                .collect(),
        }
    }

    /// One measurement's JSON line: `bytes` read in `seconds`, against the probe.
    fn line(
        &self,
        reducer: &dyn Reducer,
        bench: &str,
        (n, d): (usize, usize),
        seconds: f64,
        extra: serde_json::Value,
    ) -> serde_json::Value {
        let gbps = (n * d * 4) as f64 / seconds / 1e9;
        let mut line = json!({"suite": "cohort", "bench": bench, "n": n, "d": d,
            "reducer": reducer.name(), "threads": rayon::current_num_threads(),
            "median_s": seconds, "gbps": gbps, "probe_read_gbps": self.best.gbps,
            "probe_pattern": self.best.pattern, "probe_patterns": self.patterns,
            "ratio": gbps / self.best.gbps,
            "huge_pages": self.huge_pages});
        if let (Some(line), Some(extra)) = (line.as_object_mut(), extra.as_object()) {
            line.extend(extra.clone());
        }
        line
    }
}

/// Runs the measurements and prints their JSON lines.
pub fn run(args: &ReduceBenchArgs, reducer: &dyn Reducer) -> Result<(), String> {
    let batch = args
        .batch
        .unwrap_or_else(|| cohort_aggregation::reduce::batch_len(args.d));
    if args.n == 0 || batch == 0 || args.repeats == 0 {
        return Err("--n, --batch and --repeats must be at least 1".into());
    }
    let (n, d) = (args.n, args.d);
    if n.saturating_mul(d) > 1 << 31 {
        return Err(format!(
            "--n x --d = {} values is more than this benchmark holds",
            n * d
        ));
    }
    let probe = Probe::measure();
    let bytes = n * d * 4;
    let fedavg = time_fedavg(reducer, (n, d), batch, (args.repeats, &probe))?;
    let extra = with_batch(fedavg.fields(bytes), batch);
    println!(
        "{}",
        probe.line(reducer, "fedavg", (n, d), fedavg.seconds(), extra)
    );
    let (cache_n, cache_d, in_cache) = fedavg_in_cache(reducer, n, args.repeats)?;
    println!(
        "{}",
        probe.line(
            reducer,
            "fedavg_in_cache",
            (cache_n, cache_d),
            in_cache,
            json!({})
        )
    );
    let masked = time_masked_sum(reducer, (n, d), batch, (args.repeats, &probe))?;
    let extra = with_batch(masked.fields(bytes), batch);
    println!(
        "{}",
        probe.line(reducer, "masked_sum", (n, d), masked.seconds(), extra)
    );
    let seeds: Vec<[u8; 32]> = (0..n)
        .map(|j| {
            let mut s = [0u8; 32];
            s[..8].copy_from_slice(&(j as u64).to_le_bytes());
            s
        })
        .collect();
    let expand = time_mask_expand(reducer, &seeds, d, args.repeats)?;
    let one_core = one_core_rates(&seeds[0], d, args.repeats)?;
    let extra = json!({"gbps_per_core": one_core.cohort,
        "chacha20_crate_gbps": one_core.chacha20_crate,
        "rand_chacha_gbps": one_core.rand_chacha,
        "prg_backend": cohort_aggregation::secagg::prg::backend()});
    println!(
        "{}",
        probe.line(reducer, "mask_expand", (n, d), expand, extra)
    );
    Ok(())
}

/// `fields` with the batch size added.
fn with_batch(mut fields: serde_json::Value, batch: usize) -> serde_json::Value {
    fields["batch"] = json!(batch);
    fields
}

/// The repeats of a weighted sum of `n` updates of `d` values, `batch` at a time, from a
/// fresh accumulator until the sums are done (what a round's job does), each after a
/// read of the probe.
fn time_fedavg(
    reducer: &dyn Reducer,
    (n, d): (usize, usize),
    batch: usize,
    (repeats, probe): (usize, &Probe),
) -> Result<Paired, String> {
    // Inputs: n vectors of d values, generated in parallel (not timed).
    let updates: Vec<Vec<f32>> = (0..n)
        .into_par_iter()
        .map(|j| {
            (0..d)
                .map(|i| ((i * 31 + j * 17) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        })
        .collect();
    let weights: Vec<f64> = (0..n).map(|j| (j % 900 + 100) as f64).collect();
    let mut failure = None;
    let paired = time_paired(repeats, probe, || {
        let run = || -> Result<(), String> {
            let mut sum = reducer.weighted_sum(d).map_err(|e| e.to_string())?;
            for (batch, w) in updates.chunks(batch).zip(weights.chunks(batch)) {
                let refs: Vec<&[f32]> = batch.iter().map(Vec::as_slice).collect();
                sum.add(&refs, w).map_err(|e| e.to_string())?;
            }
            // Until the sums are done (a device queues its work); reading them back
            // happens once per round, not per update, and is not timed here.
            sum.sync().map_err(|e| e.to_string())
        };
        if let Err(e) = run() {
            failure = Some(e);
        }
    });
    failure.map_or(Ok(paired), Err)
}

/// The repeats of a modular sum of `n` inputs of `d` words, `batch` at a time, each after
/// a read of the probe.
fn time_masked_sum(
    reducer: &dyn Reducer,
    (n, d): (usize, usize),
    batch: usize,
    (repeats, probe): (usize, &Probe),
) -> Result<Paired, String> {
    let inputs: Vec<Vec<u32>> = (0..n)
        .into_par_iter()
        .map(|j| {
            (0..d)
                .map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ j as u32)
                .collect()
        })
        .collect();
    let mut failure = None;
    let paired = time_paired(repeats, probe, || {
        let run = || -> Result<(), String> {
            let mut sum = reducer.modular_sum(d).map_err(|e| e.to_string())?;
            for batch in inputs.chunks(batch) {
                let refs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
                sum.add(&refs).map_err(|e| e.to_string())?;
            }
            sum.sync().map_err(|e| e.to_string())
        };
        if let Err(e) = run() {
            failure = Some(e);
        }
    });
    failure.map_or(Ok(paired), Err)
}

/// The median seconds of expanding one mask per seed (one in ten added, the others
/// subtracted, as a round's unmasking) into one accumulator of `d` words.
fn time_mask_expand(
    reducer: &dyn Reducer,
    seeds: &[[u8; 32]],
    d: usize,
    repeats: usize,
) -> Result<f64, String> {
    let masks: Vec<Mask<'_>> = seeds
        .iter()
        .enumerate()
        .map(|(j, seed)| Mask {
            seed,
            sign: if j % 10 == 0 {
                MaskSign::Add
            } else {
                MaskSign::Subtract
            },
        })
        .collect();
    let mut acc = vec![0u32; d];
    let mut failure = None;
    let seconds = time(repeats, || {
        if let Err(e) = reducer.apply_masks(&masks, 0, &mut acc) {
            failure = Some(e.to_string());
        }
    });
    std::hint::black_box(&acc);
    failure.map_or(Ok(seconds), Err)
}

/// The FedAvg fold's arithmetic alone: up to 12 updates of one chunk per thread (the
/// reducer's unit of work, [`reduce::WEIGHTED_CHUNK`] values: 1.5 MiB of updates per
/// core, which stays in the cores' second-level caches), folded 200 times per
/// measurement. Returns the updates, their length and the median seconds of one fold:
/// the rate the kernel would reach if memory were free, which is what bounds the
/// `fedavg` line when it is not far above the probe.
fn fedavg_in_cache(
    reducer: &dyn Reducer,
    n: usize,
    repeats: usize,
) -> Result<(usize, usize, f64), String> {
    const FOLDS: usize = 200;
    let (n, d) = (
        n.min(12),
        reduce::WEIGHTED_CHUNK * rayon::current_num_threads(),
    );
    let updates: Vec<Vec<f32>> = (0..n)
        .map(|j| {
            (0..d)
                .map(|i| ((i * 31 + j * 17) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = updates.iter().map(Vec::as_slice).collect();
    let weights: Vec<f64> = (0..n).map(|j| (j % 900 + 100) as f64).collect();
    let mut failure = None;
    let seconds = time(repeats, || {
        let run = || -> Result<(), String> {
            for _ in 0..FOLDS {
                let mut sum = reducer.weighted_sum(d).map_err(|e| e.to_string())?;
                sum.add(&refs, &weights).map_err(|e| e.to_string())?;
                sum.sync().map_err(|e| e.to_string())?;
            }
            Ok(())
        };
        if let Err(e) = run() {
            failure = Some(e);
        }
    });
    match failure {
        Some(e) => Err(e),
        None => Ok((n, d, seconds / FOLDS as f64)),
    }
}

/// GB/s of ChaCha20 keystream on one core: Cohort's mask generator, and two crates'.
struct OneCore {
    cohort: f64,
    chacha20_crate: f64,
    rand_chacha: f64,
}

/// Expands one mask of `d` words on this thread alone, and fills `4 d` bytes from each
/// crate's ChaCha20 generator (20 rounds, as the masks), `repeats` times each.
fn one_core_rates(seed: &[u8; 32], d: usize, repeats: usize) -> Result<OneCore, String> {
    use rand::{Rng, SeedableRng};
    let bytes = (d * 4) as f64;
    let mut acc = vec![0u32; d];
    let mask = [Mask {
        seed,
        sign: MaskSign::Add,
    }];
    let mut failure = None;
    let cohort = time(repeats, || {
        if let Err(e) = cohort_aggregation::secagg::prg::apply_masks(&mask, 0, &mut acc) {
            failure = Some(e.to_string());
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    std::hint::black_box(&acc);
    let mut out = vec![0u8; d * 4];
    let mut crypto = chacha20::ChaCha20Rng::from_seed(*seed);
    let chacha20_crate = time(repeats, || crypto.fill_bytes(&mut out));
    std::hint::black_box(&out);
    let mut chacha = rand_chacha::ChaCha20Rng::from_seed(*seed);
    let rand_chacha = time(repeats, || chacha.fill_bytes(&mut out));
    std::hint::black_box(&out);
    Ok(OneCore {
        cohort: bytes / cohort / 1e9,
        chacha20_crate: bytes / chacha20_crate / 1e9,
        rand_chacha: bytes / rand_chacha / 1e9,
    })
}
