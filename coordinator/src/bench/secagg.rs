//! `cohort bench secagg`: SecAgg+ rounds of `n` clients with `d`-parameter updates, the
//! same cases as the Flower harness's `bench_secagg.py` (random updates in `[-1, 1]`,
//! weights in `100..1000`, a fraction of clients dropping after sharing keys).
//!
//! Each repeat runs a whole round through the in-process transport with the clients one
//! after another (each using every core, as a client machine would; or all at once,
//! sharing the cores, with `--concurrent-clients`), and checks the
//! unmasked mean against the plain weighted mean of the survivors. JSON lines go to
//! stdout: one `secagg` record per case with the fields the issue names, then records in
//! the Flower harness schema (`secagg_client_mask`, `secagg_server_unmask`,
//! `secagg_round`, `secagg_client_share_keys`, `membw_probe`) so that `compare.py` can
//! join them with Flower's.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use clap::Args;
use cohort_aggregation::secagg::{
    self, QuantizationParams, RoundConfig, Stage, default_threshold, effective_degree, local, prg,
};
use rand::{Rng, RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

/// Flags of `cohort bench secagg`.
#[derive(Debug, Clone, Args)]
pub struct SecAggBenchArgs {
    /// Clients in the round (comma-separated for several cases)
    #[arg(long, value_name = "N", value_delimiter = ',', default_value = "100")]
    pub n: Vec<u32>,
    /// Parameters per update (comma-separated; 1e5 style accepted)
    #[arg(long, value_name = "D", value_delimiter = ',', default_value = "100000", value_parser = parse_count)]
    pub d: Vec<usize>,
    /// Neighbours per client [default: 2*ceil(log2 n), as in the Flower harness]; `full`
    /// or n-1 for the complete graph (the original SecAgg)
    #[arg(long, value_name = "K", value_delimiter = ',')]
    pub neighbours: Option<Vec<String>>,
    /// Shares needed to rebuild a secret [default: just over half the neighbours]
    #[arg(long, value_name = "T")]
    pub threshold: Option<usize>,
    /// Fraction of clients that drop out (comma-separated for several cases)
    #[arg(long, value_name = "F", value_delimiter = ',', default_value = "0")]
    pub dropout: Vec<f64>,
    /// Where the dropping clients stop [default: masked, i.e. after sharing keys, as in
    /// the Flower harness]
    #[arg(long, value_name = "STAGE", default_value = "masked")]
    pub dropout_stage: Stage,
    /// Rounds per case; figures are medians
    #[arg(long, value_name = "R", default_value_t = 3)]
    pub repeats: usize,
    /// Seed of the updates, weights and who drops
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the server removes the masks: auto | cpu | cuda
    #[arg(long, default_value = "cpu")]
    pub reducer: cohort_aggregation::reduce::ReducerChoice,
    /// Whether survivors sign the survivor list before unmasking (the consistency check
    /// of the protocol against a coordinator that cheats), as `cohort serve` does by
    /// default: true | false
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub consistency_check: bool,
    /// Run the clients of each stage at the same time, sharing the cores, rather than
    /// one after another with every core each: for rounds of thousands of clients, where
    /// the round's wall time is the figure and one client's is not (its per-client
    /// figures then include waiting for the cores)
    #[arg(long)]
    pub concurrent_clients: bool,
}

/// A count such as `1000000` or `1e6`.
pub fn parse_count(text: &str) -> Result<usize, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    if !(v.is_finite() && v >= 1.0 && v.fract() == 0.0 && v <= secagg::MAX_DIMENSION as f64) {
        return Err(format!(
            "`{text}` must be a whole number between 1 and {}",
            secagg::MAX_DIMENSION
        ));
    }
    Ok(v as usize)
}

/// The Flower harness's neighbours for `n` clients, `2 * ceil(log2 n)` (14 for 100), so
/// that default runs compare like with like.
fn flower_neighbours(n: usize) -> usize {
    let log = (usize::BITS - n.saturating_sub(1).leading_zeros()) as usize;
    (2 * log).min(n.saturating_sub(1)).max(1)
}

/// The median (the mean of the middle two for an even count); NaN when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Reads a buffer of `bytes` once and sums it: the machine's memory read bandwidth, the
/// baseline the unmasking figures are put against.
fn memory_probe(bytes: usize, repeats: usize) -> f64 {
    let words = vec![1u64; bytes / 8];
    let mut times = Vec::with_capacity(repeats);
    let mut sink = 0u64;
    for _ in 0..repeats {
        let start = Instant::now();
        sink = sink.wrapping_add(words.iter().fold(0u64, |a, &w| a.wrapping_add(w)));
        times.push(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    bytes as f64 / median(times) / 1e9
}

/// One case's figures.
struct Case {
    n: u32,
    d: usize,
    k: usize,
    t: usize,
    f: f64,
}

/// Runs every case and prints its JSON lines; returns an error message for bad input.
pub fn run(args: &SecAggBenchArgs) -> Result<(), String> {
    if args.repeats == 0 {
        return Err("--repeats must be at least 1".into());
    }
    if let Some(bad) = args.dropout.iter().find(|f| !(0.0..1.0).contains(*f)) {
        return Err(format!("--dropout must be in [0, 1), got {bad}"));
    }
    // Every case is checked before anything is measured.
    let mut cases = Vec::new();
    for &n in &args.n {
        if n < 2 {
            return Err(format!("--n must be at least 2, got {n}"));
        }
        let ks: Vec<usize> = match &args.neighbours {
            None => vec![flower_neighbours(n as usize)],
            Some(list) => list
                .iter()
                .map(|k| match k.trim() {
                    "full" => Ok(n as usize - 1),
                    other => other
                        .parse::<usize>()
                        .ok()
                        .filter(|&k| k >= 1)
                        .ok_or_else(|| format!("--neighbours `{other}`: a number >= 1 or full")),
                })
                .collect::<Result<_, _>>()?,
        };
        for &k in &ks {
            let keff = effective_degree(n as usize, k);
            let t = args.threshold.unwrap_or(default_threshold(n as usize, k));
            for &d in &args.d {
                for &f in &args.dropout {
                    let case = Case {
                        n,
                        d,
                        k: keff,
                        t,
                        f,
                    };
                    case_config(&case, args.consistency_check)
                        .validate()
                        .map_err(|e| e.to_string())?;
                    cases.push(case);
                }
            }
        }
    }
    let selected =
        cohort_aggregation::reduce::select(args.reducer).map_err(|e| format!("--reducer: {e}"))?;
    eprintln!("{}", selected.line);
    let reducer = selected.reducer;
    let suite = std::env::var("BENCH_SUITE").unwrap_or_else(|_| "cohort".into());
    let threads = rayon::current_num_threads();
    let probe_gbps = memory_probe(256 << 20, 5);
    println!(
        "{}",
        json!({"suite": suite, "bench": "membw_probe", "impl": "probe_sum", "mib": 256,
               "gbps": probe_gbps, "median_s": (256u64 << 20) as f64 / probe_gbps / 1e9})
    );
    for case in &cases {
        run_case(args, &suite, threads, probe_gbps, case, &reducer)?;
    }
    Ok(())
}

/// The protocol settings of a case.
fn case_config(case: &Case, consistency_check: bool) -> RoundConfig {
    RoundConfig {
        session: [0; 32],
        context: secagg::RoundContext::default(),
        consistency_check,
        parties: case.n,
        threshold: case.t,
        neighbours: case.k,
        dimension: case.d,
        quantization: QuantizationParams {
            clip: 1.0,
            ..QuantizationParams::default()
        },
    }
}

fn run_case(
    args: &SecAggBenchArgs,
    suite: &str,
    threads: usize,
    probe_gbps: f64,
    case: &Case,
    reducer: &std::sync::Arc<dyn cohort_aggregation::reduce::Reducer>,
) -> Result<(), String> {
    let &Case { n, d, k, t, f } = case;
    let graph = if k >= n as usize - 1 {
        "full"
    } else {
        "sparse"
    };
    let config = case_config(case, args.consistency_check);
    config.validate().map_err(|e| e.to_string())?;
    let (dropped, drop_at, weights) = case_inputs(args, case);
    let update = |u: u32| -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_mul(1_000_003) ^ u64::from(u));
        (0..d).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    };
    let mut times = CaseTimes::default();
    let mut bytes_per_client = 0.0;
    let (mut max_err, mut bound) = (0.0f64, 0.0f64);
    let mut masks_removed = 0usize;
    for repeat in 0..args.repeats {
        let (round, input_time) = one_round(args, &config, reducer, &drop_at, &weights, &update);
        let out = round
            .result
            .map_err(|e| format!("n={n} d={d} k={k} f={f}: the round failed: {e}"))?;
        times.add(&round.timings, out.mask_seconds, input_time);
        let survivors = &out.survivors;
        bytes_per_client = survivors
            .iter()
            .map(|u| round.bytes_sent[u] as f64)
            .sum::<f64>()
            / survivors.len() as f64;
        masks_removed = out.masks_removed;
        if repeat == 0 {
            (max_err, bound) = check_mean(survivors, &weights, &update, &out.decoded)
                .map_err(|e| format!("n={n} d={d}: {e}"))?;
        }
        eprintln!(
            "n={n} d={d} k={k} t={t} f={f} repeat {}: mask {:.4}s/client, unmask {:.4}s, round {:.2}s",
            repeat + 1,
            median(round.timings.client_mask.clone()),
            round.timings.server_unmask,
            round.timings.round - input_time
        );
    }
    let client_mask_s = median(times.client_mask.clone());
    let server_unmask_s = median(times.server_unmask.clone());
    let round_s = median(times.rounds.clone());
    let plain_bytes = (d * 4) as f64;
    // Keystream the server generated while unmasking, as a rate next to the memory probe.
    let keystream_gbps =
        masks_removed as f64 * (d + secagg::EXTRA_WORDS) as f64 * 4.0 / server_unmask_s / 1e9;
    let common = json!({"n": n, "d": d, "k": k, "t": t, "f": f, "graph": graph,
        "dropped": dropped, "repeats": args.repeats});
    let mut record = json!({
        "suite": suite, "bench": "secagg", "impl": "cohort",
        "client_mask_s": client_mask_s,
        "server_unmask_s": server_unmask_s,
        "server_mask_s": median(times.server_mask.clone()),
        "client_advertise_s": median(times.client_advertise),
        "client_confirm_s": median(times.client_confirm),
        "client_unmask_s": median(times.client_unmask),
        "server_advertise_reveal_confirm_s": median(times.server_checks),
        "consistency_check": args.consistency_check,
        "concurrent_clients": args.concurrent_clients,
        "mask_share": median(times.server_mask) / server_unmask_s,
        "round_s": round_s,
        "bytes_per_client": bytes_per_client,
        "expansion": bytes_per_client / plain_bytes,
        "max_abs_err": max_err,
        "error_bound": bound,
        "server_keystream_gbps": keystream_gbps,
        "membw_probe_gbps": probe_gbps,
        "prg_backend": prg::backend(),
        "reducer": reducer.name(),
        "threads": threads,
    });
    merge(&mut record, &common);
    println!("{record}");
    for (bench, values) in [
        ("secagg_client_mask", times.client_mask),
        ("secagg_client_share_keys", times.client_share),
        ("secagg_server_unmask", times.server_unmask),
        ("secagg_round", times.rounds),
    ] {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(0.0, f64::max);
        let mut line = json!({"suite": suite, "bench": bench, "impl": "cohort",
            "median_s": median(values), "min_s": min, "max_s": max});
        merge(&mut line, &common);
        if bench == "secagg_client_share_keys" {
            // Flower keys this bench without d and f.
            let obj = line.as_object_mut().expect("an object");
            obj.remove("d");
            obj.remove("f");
        }
        println!("{line}");
    }
    Ok(())
}

/// One round of a case, and the seconds of it spent making the clients' inputs (not the
/// protocol's): their sum when clients run one after another; none with
/// `--concurrent-clients`, where making one client's input overlaps another's work and
/// the round's wall time is reported whole.
fn one_round(
    args: &SecAggBenchArgs,
    config: &RoundConfig,
    reducer: &std::sync::Arc<dyn cohort_aggregation::reduce::Reducer>,
    drop_at: &BTreeMap<u32, Stage>,
    weights: &[u64],
    update: &(dyn Fn(u32) -> Vec<f32> + Sync),
) -> (local::LocalRound, f64) {
    let mut seed = [0u8; 32];
    rand::rng().fill_bytes(&mut seed);
    let input_time = Mutex::new(0.0f64);
    let parallel = args.concurrent_clients;
    let round = local::run_round_on(reducer.clone(), config, seed, drop_at, parallel, |u| {
        let start = Instant::now();
        let values = update(u);
        *input_time.lock().expect("no panics while held") += start.elapsed().as_secs_f64();
        local::ClientInput::Update {
            values,
            weight: weights[u as usize - 1],
            loss: 0.0,
        }
    });
    let input_time = input_time.into_inner().expect("no panics while held");
    (round, if parallel { 0.0 } else { input_time })
}

/// Who drops (a fraction `f` of the parties, at `--dropout-stage`) and each party's
/// weight, from the bench's seed.
fn case_inputs(args: &SecAggBenchArgs, case: &Case) -> (usize, BTreeMap<u32, Stage>, Vec<u64>) {
    let dropped = (case.f * f64::from(case.n)).round() as usize;
    let mut drop_rng = ChaCha8Rng::seed_from_u64(args.seed ^ 0xd20b);
    let drop_at: BTreeMap<u32, Stage> =
        rand::seq::index::sample(&mut drop_rng, case.n as usize, dropped)
            .into_iter()
            .map(|i| (i as u32 + 1, args.dropout_stage))
            .collect();
    let weights: Vec<u64> = {
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ 0x3e16);
        (0..case.n).map(|_| rng.random_range(100..1000)).collect()
    };
    (dropped, drop_at, weights)
}

/// Every repeat's timings of one case, in seconds: per client where the protocol runs
/// per client, per round otherwise.
#[derive(Default)]
struct CaseTimes {
    client_mask: Vec<f64>,
    client_share: Vec<f64>,
    // The parts the protocol against a coordinator that cheats adds: signing and checking
    // keys, the graph nonces, signing and checking the survivor list.
    client_advertise: Vec<f64>,
    client_confirm: Vec<f64>,
    client_unmask: Vec<f64>,
    server_checks: Vec<f64>,
    server_unmask: Vec<f64>,
    server_mask: Vec<f64>,
    /// Whole rounds, less the time spent making the inputs.
    rounds: Vec<f64>,
}

impl CaseTimes {
    fn add(&mut self, timings: &local::Timings, mask_seconds: f64, input_time: f64) {
        self.client_mask.extend(timings.client_mask.iter().copied());
        self.client_share
            .extend(timings.client_share.iter().copied());
        self.client_advertise
            .extend(timings.client_advertise.iter().copied());
        self.client_confirm
            .extend(timings.client_confirm.iter().copied());
        self.client_unmask
            .extend(timings.client_unmask.iter().copied());
        self.server_checks
            .push(timings.server_advertise + timings.server_reveal + timings.server_confirm);
        self.server_unmask.push(timings.server_unmask);
        self.server_mask.push(mask_seconds);
        self.rounds.push(timings.round - input_time);
    }
}

/// The unmasked mean against the plain weighted mean of the survivors' updates: the
/// largest error and the bound it must stay within.
fn check_mean(
    survivors: &[u32],
    weights: &[u64],
    update: &dyn Fn(u32) -> Vec<f32>,
    decoded: &secagg::Decoded,
) -> Result<(f64, f64), String> {
    let total: f64 = survivors
        .iter()
        .map(|&u| weights[u as usize - 1] as f64)
        .sum();
    let mut reference = vec![0f64; decoded.mean.len()];
    for &u in survivors {
        let w = weights[u as usize - 1] as f64;
        for (r, x) in reference.iter_mut().zip(update(u)) {
            *r += w * f64::from(x);
        }
    }
    let max_err = reference
        .iter()
        .zip(&decoded.mean)
        .map(|(r, m)| (r / total - f64::from(*m)).abs())
        .fold(0.0f64, f64::max);
    let bound = decoded.error_bound;
    if max_err > bound {
        return Err(format!("error {max_err:e} exceeds the bound {bound:e}"));
    }
    Ok((max_err, bound))
}

fn merge(into: &mut serde_json::Value, from: &serde_json::Value) {
    if let (Some(a), Some(b)) = (into.as_object_mut(), from.as_object()) {
        for (k, v) in b {
            a.insert(k.clone(), v.clone());
        }
    }
}
