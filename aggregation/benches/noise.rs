//! Cost per draw of the exact lattice samplers (`privacy::discrete`) against the
//! floating-point ones they replaced, at the sizes the mechanisms use.
//!
//! Each benchmark draws `DRAWS` values from a seeded ChaCha20 generator (the generator
//! both use in production); criterion's time over `DRAWS` is the cost per draw. Pairs:
//! - `central/*`: the central and local mechanism's noise per coordinate: the old
//!   Box-Muller draw times `sigma C` against a discrete Gaussian of lattice deviation
//!   `sigma (C / step + sqrt(d))`, here `sigma = 1`, `C = 1`, `d = 10^6` (about `2^20`).
//! - `share_*/*`: one client's distributed noise share per coordinate: the old
//!   `Pois(mu/2) - Pois(mu/2)` from rand_distr against the exact share at the same `mu`
//!   (Skellam from exact Poisson draws below 16, the discrete Gaussian from 16 on).
//!
//! Run with `cargo bench -p cohort-aggregation --bench noise`; the ratio is the new
//! median over the old.

use std::hint::black_box;
use std::time::Duration;

use cohort_aggregation::privacy::discrete::{DiscreteGaussian, Skellam};
use cohort_aggregation::privacy::noise::LatticeGaussian;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};
use rand_distr::{Distribution, Poisson};

/// Draws per measured iteration.
const DRAWS: u64 = 10_000;

/// The old central sampler: one Box-Muller normal from 53-bit uniforms in (0, 1].
fn box_muller(rng: &mut ChaCha20Rng) -> f64 {
    let open = |rng: &mut ChaCha20Rng| ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let radius = (-2.0 * open(rng).ln()).sqrt();
    radius * (std::f64::consts::TAU * open(rng)).cos()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("central");
    group.throughput(Throughput::Elements(DRAWS));
    let lattice = LatticeGaussian::new(1.0, 1.0, 1_000_000).unwrap();
    let (num, den) = lattice.lattice_variance();
    eprintln!(
        "noise: central lattice variance {num}/{den}, step {}",
        lattice.step()
    );
    let gaussian = DiscreteGaussian::new(num, den).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(1);
    group.bench_function("old_box_muller", |b| {
        b.iter(|| {
            for _ in 0..DRAWS {
                black_box(box_muller(&mut rng));
            }
        })
    });
    group.bench_function("discrete_gaussian", |b| {
        b.iter(|| {
            for _ in 0..DRAWS {
                black_box(gaussian.sample(&mut rng));
            }
        })
    });
    group.finish();

    // 4: a million-client round; 16: the switch to the discrete Gaussian; 4e4, 4e12:
    // rounds of 10^5 and of 100 clients at z = 1.
    for mu in [4.0, 16.0, 4e4, 4e12] {
        let mut group = c.benchmark_group(format!("share_mu_{mu:e}"));
        group.throughput(Throughput::Elements(DRAWS));
        let poisson = Poisson::new(mu / 2.0).unwrap();
        group.bench_function("old_float_skellam", |b| {
            b.iter(|| {
                for _ in 0..DRAWS {
                    let x: f64 = poisson.sample(&mut rng);
                    let y: f64 = poisson.sample(&mut rng);
                    black_box(x as i64 - y as i64);
                }
            })
        });
        if mu < 16.0 {
            let skellam = Skellam::at_least(mu).unwrap();
            group.bench_function("exact_skellam", |b| {
                b.iter(|| {
                    for _ in 0..DRAWS {
                        black_box(skellam.sample(&mut rng));
                    }
                })
            });
        } else {
            let gaussian = DiscreteGaussian::at_least(mu).unwrap();
            group.bench_function("discrete_gaussian", |b| {
                b.iter(|| {
                    for _ in 0..DRAWS {
                        black_box(gaussian.sample(&mut rng));
                    }
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
