//! Throughput of the SecAgg mask generator (`secagg::prg`).
//!
//! Every figure is in bytes of keystream per second: a run of `m` masks over `d` words
//! counts `4 * d * m` bytes. `baseline/add_vectors` adds one stored vector to another of
//! the same size, i.e. what applying a precomputed mask would cost in memory traffic.
//!
//! Run with `cargo bench -p cohort-aggregation --bench mask_prg`.

use std::hint::black_box;
use std::time::Duration;

use cohort_aggregation::secagg::prg::{
    Backend, Mask, MaskSign, apply_masks_parallel, apply_masks_with, backend, keystream_with,
};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// Words in the accumulator: a 1M-parameter model.
const WORDS: usize = 1_000_000;

fn seeds(count: usize) -> Vec<[u8; 32]> {
    (0..count)
        .map(|i| std::array::from_fn(|j| (i * 31 + j * 7) as u8))
        .collect()
}

fn masks(seeds: &[[u8; 32]]) -> Vec<Mask<'_>> {
    seeds
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
        .collect()
}

fn available() -> impl Iterator<Item = Backend> {
    Backend::ALL.into_iter().filter(|b| b.is_available())
}

fn bench(c: &mut Criterion) {
    eprintln!(
        "mask_prg: detected backend {}, rayon threads {}",
        backend(),
        rayon::current_num_threads()
    );
    let mut acc: Vec<u32> = (0..WORDS as u32).collect();
    let src: Vec<u32> = (0..WORDS as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();

    let mut group = c.benchmark_group("baseline");
    group.throughput(Throughput::Bytes((WORDS * 4) as u64));
    group.bench_function("add_vectors", |b| {
        b.iter(|| {
            for (a, s) in acc.iter_mut().zip(&src) {
                *a = a.wrapping_add(*s);
            }
            black_box(&mut acc);
        })
    });
    group.finish();

    let mut group = c.benchmark_group("keystream");
    group.throughput(Throughput::Bytes((WORDS * 4) as u64));
    let seed = seeds(1)[0];
    for backend in available() {
        group.bench_function(backend.name(), |b| {
            b.iter(|| keystream_with(backend, black_box(&seed), 0, &mut acc))
        });
    }
    group.finish();

    for count in [1, 16] {
        let seeds = seeds(count);
        let masks = masks(&seeds);
        let mut group = c.benchmark_group(format!("apply_masks/{count}"));
        group.throughput(Throughput::Bytes((WORDS * 4 * count) as u64));
        for backend in available() {
            group.bench_function(BenchmarkId::from_parameter(backend.name()), |b| {
                b.iter(|| apply_masks_with(backend, black_box(&masks), 0, &mut acc))
            });
        }
        group.bench_function(BenchmarkId::from_parameter("parallel"), |b| {
            b.iter(|| apply_masks_parallel(black_box(&masks), 0, &mut acc))
        });
        group.finish();
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench
}
criterion_main!(benches);
