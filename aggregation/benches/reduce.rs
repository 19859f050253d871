//! The reducer's three hot loops on every backend this machine has: the FedAvg weighted
//! sum and the masked sum of 100 vectors of 1,000,000 values (in batches of 16, as the
//! coordinator's jobs fold them), and 100 ChaCha20 masks expanded into one accumulator.
//! Throughput is bytes of input (or of mask output) per second; `cohort bench reduce`
//! prints the same figures next to a memory probe as JSON lines.
//!
//! Run with `cargo bench -p cohort-aggregation --bench reduce` (add `--features cuda` for
//! the GPU, which is measured only where one is usable).

use std::hint::black_box;
use std::time::Duration;

use cohort_aggregation::reduce::{self, Reducer};
use cohort_aggregation::secagg::prg::{Mask, MaskSign};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const N: usize = 100;
const D: usize = 1_000_000;
const BATCH: usize = 16;

fn reducers() -> Vec<std::sync::Arc<dyn Reducer>> {
    let mut all = vec![reduce::cpu()];
    if let Ok(selected) = reduce::select(reduce::ReducerChoice::Cuda) {
        all.push(selected.reducer);
    }
    all
}

fn bench(c: &mut Criterion) {
    let updates: Vec<Vec<f32>> = (0..N)
        .map(|j| {
            (0..D)
                .map(|i| ((i * 31 + j * 17) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        })
        .collect();
    let weights: Vec<f64> = (0..N).map(|j| (j % 900 + 100) as f64).collect();
    let words: Vec<Vec<u32>> = (0..N)
        .map(|j| {
            (0..D)
                .map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ j as u32)
                .collect()
        })
        .collect();
    let seeds: Vec<[u8; 32]> = (0..N)
        .map(|j| std::array::from_fn(|k| (j * 7 + k) as u8))
        .collect();
    let masks: Vec<Mask<'_>> = seeds
        .iter()
        .map(|seed| Mask {
            seed,
            sign: MaskSign::Subtract,
        })
        .collect();
    let mut group = c.benchmark_group("reduce");
    group
        .measurement_time(Duration::from_secs(5))
        .sample_size(10);
    group.throughput(Throughput::Bytes((N * D * 4) as u64));
    for r in reducers() {
        group.bench_function(format!("fedavg/{}", r.name()), |b| {
            b.iter(|| {
                let mut sum = r.weighted_sum(D).unwrap();
                for (batch, w) in updates.chunks(BATCH).zip(weights.chunks(BATCH)) {
                    let refs: Vec<&[f32]> = batch.iter().map(Vec::as_slice).collect();
                    sum.add(&refs, w).unwrap();
                }
                sum.sync().unwrap();
                black_box(sum);
            })
        });
        group.bench_function(format!("masked_sum/{}", r.name()), |b| {
            b.iter(|| {
                let mut sum = r.modular_sum(D).unwrap();
                for batch in words.chunks(BATCH) {
                    let refs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
                    sum.add(&refs).unwrap();
                }
                sum.sync().unwrap();
                black_box(sum);
            })
        });
        let mut acc = vec![0u32; D];
        group.bench_function(format!("mask_expand/{}", r.name()), |b| {
            b.iter(|| {
                r.apply_masks(&masks, 0, &mut acc).unwrap();
                black_box(&acc);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
