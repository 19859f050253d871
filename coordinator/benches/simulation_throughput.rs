//! Simulation throughput in client updates per second, on two workloads:
//!
//! - `digits_mlp`: the shipped digits, MLP (one hidden layer of 64), Dirichlet(0.5) over
//!   50 clients, full participation, 5 local epochs;
//! - `flower_logreg`: the work of the Flower harness's `bench_simulation.py`: 100 clients
//!   with 100 random points of 100 features each, labels from a fixed linear model plus
//!   noise, logistic regression, one full-batch gradient step per round.
//!
//! The same work runs on a one-thread pool (the plain sequential loop, the baseline) and
//! on a pool with every core, alternating, so both see the same machine load; each figure
//! is the median of the repeats. JSON lines on stdout follow the Flower harness schema
//! (`shared/bench/flower`, bench `fedavg_simulation`), a readable table goes to stderr.
//!
//! `cargo bench -p cohort-coordinator --bench simulation_throughput [-- --repeats N --rounds R --clients N --flower-clients N]`

use cohort_coordinator::simulate::{Prepared, SimulationConfig, prepare, run_rounds};
use cohort_edge::data::Dataset;
use cohort_edge::model::{ModelKind, ModelSpec};
use cohort_edge::partition::PartitionScheme;
use ndarray::Array2;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One client's points as in `bench_simulation.py`: x ~ N(0, 1), y = [x.w + 0.1 e > 0]
/// with one `w` shared by all clients.
fn flower_client(pid: u64, dim: usize, samples: usize, w_true: &[f32]) -> Dataset {
    let mut rng = ChaCha8Rng::seed_from_u64(1234 + pid);
    let mut normal = || -> f32 { StandardNormal.sample(&mut rng) };
    let features = Array2::from_shape_fn((samples, dim), |_| normal());
    let labels = features
        .rows()
        .into_iter()
        .map(|row| {
            let z: f32 = row.iter().zip(w_true).map(|(a, b)| a * b).sum();
            u32::from(z + 0.1 * normal() > 0.0)
        })
        .collect();
    Dataset {
        features,
        labels,
        classes: vec!["0".into(), "1".into()],
        feature_names: (0..dim).map(|j| format!("x{j}")).collect(),
        groups: None,
    }
}

fn flower_workload(clients: usize) -> (SimulationConfig, Prepared) {
    let (dim, samples) = (100, 100);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let w_true: Vec<f32> = (0..dim).map(|_| StandardNormal.sample(&mut rng)).collect();
    let data: Vec<Dataset> = (0..clients as u64)
        .map(|pid| flower_client(pid, dim, samples, &w_true))
        .collect();
    let test = flower_client(u64::MAX, dim, samples, &w_true);
    let cfg = SimulationConfig {
        model: ModelKind::LogReg,
        clients,
        rounds: 5,
        local_epochs: 1,
        batch_size: samples,
        lr: 0.1,
        momentum: 0.0,
        weight_decay: 0.0,
        ..SimulationConfig::default()
    };
    let spec = ModelSpec::new(&ModelKind::LogReg, dim, 2).expect("valid model");
    let prepared = Prepared::new(spec, data, test, "iid").expect("valid workload");
    (cfg, prepared)
}

/// Times `cfg` on `prepared` on a one-thread pool and on an all-cores pool, alternating,
/// and prints one JSON line per pool.
fn measure(workload: &str, cfg: &SimulationConfig, prepared: &Prepared, repeats: usize) {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let params = prepared.spec().num_params();
    let mut pools: Vec<usize> = vec![1, cores];
    pools.dedup();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); pools.len()];
    let mut updates = 0;
    for _ in 0..repeats {
        for (slot, &threads) in pools.iter().enumerate() {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("thread pool");
            let result = pool
                .install(|| run_rounds(cfg, prepared, |_| Ok(())))
                .expect("simulation runs");
            updates = result.total_updates;
            times[slot].push(result.training_seconds);
        }
    }
    let suite = std::env::var("BENCH_SUITE").unwrap_or_else(|_| "cohort".into());
    let baseline = median(times[0].clone());
    let rounds = cfg.rounds;
    eprintln!(
        "{workload}: {params} parameters, {} clients x {rounds} rounds, {repeats} repeats, {cores} cores",
        cfg.clients
    );
    for (slot, &threads) in pools.iter().enumerate() {
        let med = median(times[slot].clone());
        let min = times[slot].iter().copied().fold(f64::INFINITY, f64::min);
        let max = times[slot].iter().copied().fold(0.0, f64::max);
        let ups = updates as f64 / med;
        eprintln!(
            "  {threads:>2} thread(s): {ups:>9.1} client updates/s (median {med:.4} s per run, {:.2}x the one-thread loop)",
            baseline / med
        );
        println!(
            "{}",
            serde_json::json!({
                "suite": suite,
                "bench": "fedavg_simulation",
                "impl": format!("cohort_rayon_{threads}t"),
                "workload": workload,
                "clients": cfg.clients,
                "rounds": rounds,
                "d": params,
                "repeats": repeats,
                "median_s": med / f64::from(rounds),
                "min_s": min / f64::from(rounds),
                "max_s": max / f64::from(rounds),
                "updates_per_s": ups,
                "threads": threads,
                "cores": cores,
                "speedup_vs_one_thread": baseline / med,
            })
        );
    }
}

fn main() {
    let repeats = arg("--repeats", 7);
    let rounds = arg("--rounds", 10) as u32;
    let clients = arg("--clients", 50);
    let cfg = SimulationConfig {
        clients,
        rounds,
        partition: Some(PartitionScheme::Dirichlet { alpha: 0.5 }),
        ..SimulationConfig::default()
    };
    let prepared = prepare(&cfg).expect("benchmark configuration is valid");
    measure("digits_mlp", &cfg, &prepared, repeats);
    let (cfg, prepared) = flower_workload(arg("--flower-clients", 100));
    measure("flower_logreg", &cfg, &prepared, repeats);
}
