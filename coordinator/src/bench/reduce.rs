//! `cohort bench reduce`: the reducer's three hot loops at a chosen size, each next to a
//! memory read probe measured in the same run: the best of several read patterns.
//!
//! - `fedavg`: the weighted sum of `n` updates of `d` `f32`, folded in batches as the
//!   server's job folds them; bytes are the updates read.
//! - `masked_sum`: the modular sum of `n` masked inputs of `d` words.
//! - `mask_expand`: `n` ChaCha20 masks expanded and added to one accumulator; bytes are
//!   the mask output.
//!
//! One JSON line per measurement: `bench`, `n`, `d`, `reducer`, `median_s`, `gbps`,
//! `probe_read_gbps` (the best read pattern's, named in `probe_pattern`; every
//! pattern's figure in `probe_patterns`) and `ratio` (= `gbps / probe_read_gbps`). The sums' accumulator is
//! taken from the reducer (reused memory in steady state) and reading the sums back, once
//! per round, is not part of the figure.

use std::time::Instant;

use clap::Args;
use cohort_aggregation::reduce::Reducer;
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
    /// Updates per batch for fedavg and masked_sum (the server's job folds this many at
    /// a time)
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Measurements per figure; the median is reported
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
}

/// Reads `bytes` of memory and returns the best pattern's GB/s (median of `repeats`
/// each; see [`super::read_probe`]).
pub fn read_probe(bytes: usize, repeats: usize) -> f64 {
    super::read_probe::measure(bytes, repeats).best().gbps
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

/// Runs the three measurements and prints their JSON lines.
pub fn run(args: &ReduceBenchArgs, reducer: &dyn Reducer) -> Result<(), String> {
    if args.n == 0 || args.batch == 0 || args.repeats == 0 {
        return Err("--n, --batch and --repeats must be at least 1".into());
    }
    let (n, d) = (args.n, args.d);
    if n.saturating_mul(d) > 1 << 31 {
        return Err(format!(
            "--n x --d = {} values is more than this benchmark holds",
            n * d
        ));
    }
    let measured = super::read_probe::measure(1 << 30, 5);
    let best = measured.best();
    let probe = best.gbps;
    let patterns: serde_json::Map<String, serde_json::Value> = measured
        .patterns
        .iter()
        .map(|p| (p.pattern.to_string(), json!(p.gbps)))
        .collect();
    let emit = |bench: &str, seconds: f64, bytes: f64| {
        let gbps = bytes / seconds / 1e9;
        println!(
            "{}",
            json!({"suite": "cohort", "bench": bench, "n": n, "d": d, "reducer": reducer.name(),
                   "batch": args.batch, "threads": rayon::current_num_threads(),
                   "median_s": seconds, "gbps": gbps, "probe_read_gbps": probe,
                   "probe_pattern": best.pattern, "probe_patterns": patterns,
                   "ratio": gbps / probe})
        );
    };
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
    let fedavg = time(args.repeats, || {
        // From a fresh accumulator to the sums read back: what a round's job does.
        let run = || -> Result<(), String> {
            let mut sum = reducer.weighted_sum(d).map_err(|e| e.to_string())?;
            for (batch, w) in updates.chunks(args.batch).zip(weights.chunks(args.batch)) {
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
    if let Some(e) = failure.take() {
        return Err(e);
    }
    emit("fedavg", fedavg, (n * d * 4) as f64);
    drop(updates);
    let inputs: Vec<Vec<u32>> = (0..n)
        .into_par_iter()
        .map(|j| {
            (0..d)
                .map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ j as u32)
                .collect()
        })
        .collect();
    let mut acc = vec![0u32; d];
    let masked = time(args.repeats, || {
        let run = || -> Result<(), String> {
            let mut sum = reducer.modular_sum(d).map_err(|e| e.to_string())?;
            for batch in inputs.chunks(args.batch) {
                let refs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
                sum.add(&refs).map_err(|e| e.to_string())?;
            }
            sum.sync().map_err(|e| e.to_string())
        };
        if let Err(e) = run() {
            failure = Some(e);
        }
    });
    if let Some(e) = failure.take() {
        return Err(e);
    }
    emit("masked_sum", masked, (n * d * 4) as f64);
    drop(inputs);
    let seeds: Vec<[u8; 32]> = (0..n)
        .map(|j| {
            let mut s = [0u8; 32];
            s[..8].copy_from_slice(&(j as u64).to_le_bytes());
            s
        })
        .collect();
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
    let expand = time(args.repeats, || {
        if let Err(e) = reducer.apply_masks(&masks, 0, &mut acc) {
            failure = Some(e.to_string());
        }
    });
    if let Some(e) = failure.take() {
        return Err(e);
    }
    std::hint::black_box(&acc);
    emit("mask_expand", expand, (n * d * 4) as f64);
    Ok(())
}
