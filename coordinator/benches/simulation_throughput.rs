//! Simulation throughput in client updates per second: digits, MLP (one hidden layer of
//! 64), Dirichlet(0.5) over 50 clients, full participation.
//!
//! The same work runs on a one-thread pool (the plain sequential loop, the baseline) and
//! on a pool with every core, alternating, so both see the same machine load; each figure
//! is the median of the repeats. JSON lines on stdout follow the Flower harness schema
//! (`shared/bench/flower`, bench `fedavg_simulation`), a readable table goes to stderr.
//!
//! `cargo bench -p cohort-coordinator --bench simulation_throughput [-- --repeats N --rounds R --clients N]`

use cohort_coordinator::simulate::{SimulationConfig, prepare, run_rounds};
use cohort_edge::partition::PartitionScheme;

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

fn main() {
    let repeats = arg("--repeats", 5);
    let rounds = arg("--rounds", 5) as u32;
    let clients = arg("--clients", 50);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let cfg = SimulationConfig {
        clients,
        rounds,
        partition: Some(PartitionScheme::Dirichlet { alpha: 0.5 }),
        ..SimulationConfig::default()
    };
    let prepared = prepare(&cfg).expect("benchmark configuration is valid");
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
                .install(|| run_rounds(&cfg, &prepared, |_| Ok(())))
                .expect("simulation runs");
            updates = result.total_updates;
            times[slot].push(result.training_seconds);
        }
    }
    let suite = std::env::var("BENCH_SUITE").unwrap_or_else(|_| "cohort".into());
    let baseline = median(times[0].clone());
    eprintln!(
        "digits MLP ({params} parameters), {clients} clients x {rounds} rounds, {repeats} repeats, {cores} cores"
    );
    for (slot, &threads) in pools.iter().enumerate() {
        let med = median(times[slot].clone());
        let min = times[slot].iter().copied().fold(f64::INFINITY, f64::min);
        let max = times[slot].iter().copied().fold(0.0, f64::max);
        let ups = updates as f64 / med;
        eprintln!(
            "  {threads:>2} thread(s): {ups:>9.1} client updates/s (median {med:.3} s per run, {:.2}x the one-thread loop)",
            baseline / med
        );
        println!(
            "{}",
            serde_json::json!({
                "suite": suite,
                "bench": "fedavg_simulation",
                "impl": format!("cohort_rayon_{threads}t"),
                "clients": clients,
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
