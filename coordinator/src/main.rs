//! `cohort`: the coordinator command.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use cohort_aggregation::Strategy;
use cohort_coordinator::server::{ServeArgs, ServeSettings};
use cohort_coordinator::simulate::{DatasetSpec, RoundRecord, SimulationConfig, compare, simulate};
use cohort_edge::model::ModelKind;
use cohort_edge::partition::PartitionScheme;
use indicatif::{ProgressBar, ProgressStyle};

// Updates, models and sums on transparent huge pages: the reducers read them at memory
// speed (see the module's figures).
#[global_allocator]
static ALLOCATOR: cohort_coordinator::huge_pages::HugePageAllocator =
    cohort_coordinator::huge_pages::HugePageAllocator;

#[derive(Parser)]
#[command(
    name = "cohort",
    version,
    about = "Cohort: federated learning with privacy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a federated model over many virtual clients in one process.
    Simulate(Box<SimulateArgs>),
    /// Run the coordinator: the HTTP API over TLS. Flags override `COHORT_*` variables,
    /// which override the `--config` file.
    Serve(ServeArgs),
    /// Show the whole system: a coordinator (SQLite, dev TLS) and N cohort-edge processes
    /// on partitions of the digits data run one experiment to the end.
    Demo(cohort_coordinator::demo::DemoArgs),
    /// Write the shipped digits data as per-client CSV partitions and a test CSV, for
    /// cohort-edge trials on real processes or machines (docker-compose.yml uses it).
    Partition(cohort_coordinator::demo::PartitionArgs),
    /// Measure Cohort on this machine; JSON lines on stdout.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Print the REST API's OpenAPI document (what `GET /api/v1/openapi.json` serves), to
    /// generate a client without a running coordinator.
    Openapi,
    /// Differential privacy accounting: epsilon of a run, or the noise for a budget.
    #[command(subcommand)]
    Privacy(cohort_coordinator::privacy_cli::PrivacyCommand),
    /// Compression: accuracy against bytes uploaded, over `cohort simulate` runs.
    #[command(subcommand)]
    Compress(cohort_coordinator::compress_cli::CompressCommand),
    /// The edge client (as `cohort-edge`), so that `cohort demo` can start it from this
    /// binary.
    #[command(hide = true)]
    Edge(cohort_edge::cli::EdgeArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// One secure aggregation round with every party in this process: client masking,
    /// server unmasking, the whole round, bytes per client.
    Secagg(cohort_coordinator::bench::secagg::SecAggBenchArgs),
    /// The reducer's hot loops (FedAvg sum, masked sum, mask expansion) next to a memory
    /// read probe of the same run.
    Reduce(cohort_coordinator::bench::reduce::ReduceBenchArgs),
    /// The dashboard's pages at the server, for an experiment with many rounds and many
    /// clients (a fresh database filled for the purpose).
    Dashboard(cohort_coordinator::bench::dashboard::DashboardBenchArgs),
}

/// Flags override the keys of the same name in `--config`.
#[derive(Args)]
struct SimulateArgs {
    /// TOML file with any of the settings below (same names, e.g. `clients-per-round = 10`).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// digits | breast-cancer | mnist10k | synthetic:ALPHA,BETA | PATH.csv[.gz] [default: digits]
    #[arg(long)]
    dataset: Option<DatasetSpec>,
    /// logreg | mlp | mlp:H1,H2,... [default: mlp (one hidden layer of 64)]
    #[arg(long)]
    model: Option<ModelKind>,
    /// Number of virtual clients [default: 50]
    #[arg(long, value_name = "N")]
    clients: Option<usize>,
    /// Clients selected per round [default: all]
    #[arg(long, value_name = "K")]
    clients_per_round: Option<usize>,
    /// Minimum reports for a round to update the model [default: 1]
    #[arg(long, value_name = "M")]
    min_participants: Option<usize>,
    /// Number of rounds [default: 40]
    #[arg(long, value_name = "R")]
    rounds: Option<u32>,
    /// iid | dirichlet:ALPHA | shards:K | quantity:SIGMA | natural [default: dirichlet:0.5; natural for synthetic]
    #[arg(long)]
    partition: Option<PartitionScheme>,
    /// fedavg | fedprox:MU | fedadam | fedyogi | fedadagrad [default: fedavg]. Several,
    /// comma-separated, compare them on identical data, sampling and initial model, each
    /// in DIR/<strategy>/ with a combined summary in DIR.
    #[arg(long, value_delimiter = ',')]
    strategy: Option<Vec<Strategy>>,
    /// Server learning rate [default: 1 for fedavg/fedprox, 0.01 for adaptive strategies]
    #[arg(long, value_name = "LR")]
    server_lr: Option<f64>,
    /// Local epochs per round [default: 5]
    #[arg(long, value_name = "E")]
    local_epochs: Option<u32>,
    /// Local mini-batch size [default: 16]
    #[arg(long, value_name = "B")]
    batch_size: Option<usize>,
    /// Local SGD learning rate [default: 0.05]
    #[arg(long, value_name = "LR")]
    lr: Option<f64>,
    /// Local SGD momentum [default: 0.9]
    #[arg(long)]
    momentum: Option<f64>,
    /// Local L2 weight decay [default: 0.0001]
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Probability that a selected client drops out [default: 0]
    #[arg(long, value_name = "P")]
    dropout: Option<f64>,
    /// Where dropping clients stop, with --secure-aggregation: advertise | share | masked
    /// | unmask [default: masked, i.e. never uploads]
    #[arg(long, value_name = "STAGE")]
    dropout_stage: Option<cohort_aggregation::secagg::Stage>,
    /// Combine updates with secure aggregation (SecAgg+): the server learns only the sum
    #[arg(long)]
    secure_aggregation: bool,
    /// Secure aggregation: shares needed to rebuild a client's secrets [default: just
    /// over half the neighbours]
    #[arg(long, value_name = "T")]
    threshold: Option<usize>,
    /// Secure aggregation: neighbours per client [default: O(log n), sized so that 10%
    /// dropout fails at most one round in 1,000; 20 for 100 clients per round]
    #[arg(long, value_name = "K")]
    neighbours: Option<usize>,
    /// Secure aggregation: clip each update coordinate to [-C, C] [default: 4]
    #[arg(long, value_name = "C")]
    clip: Option<f32>,
    /// Secure aggregation: weight cap; larger sample counts count as this [default: the
    /// largest client's sample count]
    #[arg(long, value_name = "W")]
    max_weight: Option<u32>,
    /// Compress both directions: quantize:B (B = 1, 2, 4, 8; rotated, unbiased) up, and
    /// down too for B = 4 or 8 (models need 4 bits or more); sign | topk:F (with error
    /// feedback) up only [default: none]
    #[arg(long, value_name = "SCHEME")]
    compress: Option<cohort_aggregation::compress::Compression>,
    /// Compress uploads: none | quantize:B | sign | topk:F (overrides --compress)
    #[arg(long, value_name = "SCHEME")]
    compress_up: Option<cohort_aggregation::compress::Compression>,
    /// Compress downloads: none | quantize:4 | quantize:8 (overrides --compress)
    #[arg(long, value_name = "SCHEME")]
    compress_down: Option<cohort_aggregation::compress::Compression>,
    /// Personalised models: fedper:LAYERS | fedrep:LAYERS (those layers stay on each
    /// client: layers.0, layers.1, ... or tensor names) | ditto:LAMBDA | finetune:EPOCHS;
    /// reports each client's personal and global accuracy on its own held-out split
    #[arg(long, value_name = "SCHEME")]
    personalise: Option<cohort_edge::personal::Personalisation>,
    /// Fraction of each client's data held out to score the models on, per client
    /// [default: 0.2 with --personalise, else 0 (off)]
    #[arg(long, value_name = "F")]
    client_holdout: Option<f64>,
    /// Also write TensorBoard event files here (DIR/<strategy>/), round by round
    #[arg(long, value_name = "DIR")]
    tensorboard: Option<PathBuf>,
    /// Also report the run to this MLflow tracking server (http://host:port): settings
    /// as parameters, every round's metrics, the final model as an artifact
    #[arg(long, value_name = "URL")]
    mlflow_uri: Option<String>,
    /// The MLflow experiment the run goes into [default: cohort-simulate]
    #[arg(long, value_name = "NAME")]
    mlflow_experiment: Option<String>,
    /// Secure aggregation with quantize:B uploads: masked word width, 8 | 16 | 32
    /// [default: the narrowest that holds the round's sum]
    #[arg(long, value_name = "W")]
    word_bits: Option<u32>,
    /// Where aggregation runs: auto (the GPU when a CUDA driver and device are present,
    /// else the CPU) | cpu | cuda [default: auto]
    #[arg(long, value_name = "auto|cpu|cuda")]
    reducer: Option<cohort_aggregation::reduce::ReducerChoice>,
    /// Robust aggregation instead of the weighted mean: median | trimmed-mean:BETA |
    /// krum:F | multi-krum:F:M (plaintext rounds only)
    #[arg(long, value_name = "RULE")]
    aggregator: Option<cohort_aggregation::robust::RobustRule>,
    /// Fraction of clients that are malicious [default: 0]
    #[arg(long, value_name = "P")]
    malicious: Option<f64>,
    /// What malicious clients send: sign-flip:S (-S times their update) | scale:S
    /// [default: sign-flip:4]
    #[arg(long, value_name = "ATTACK")]
    attack: Option<cohort_coordinator::simulate::Attack>,
    /// Differential privacy: noise standard deviation over the clipping bound; clients are
    /// then Poisson-sampled at clients-per-round / clients. Central noise added by the
    /// coordinator, or with --secure-aggregation distributed noise: each client adds its
    /// share before masking
    #[arg(long, value_name = "SIGMA")]
    dp_noise_multiplier: Option<f64>,
    /// Differential privacy: L2 bound on each client's update [default: 1]
    #[arg(long, value_name = "C")]
    dp_clip: Option<f32>,
    /// Differential privacy: delta epsilon is reported at [default: 1e-5]
    #[arg(long, value_name = "D")]
    dp_delta: Option<f64>,
    /// Differential privacy: epsilon budget; the run stops before a round that would
    /// exceed it
    #[arg(long, value_name = "E")]
    dp_epsilon: Option<f64>,
    /// Differential privacy: whom --dp-epsilon is enforced against: observers (of the
    /// published models; epsilon amplified by sampling) | coordinator (which knows who was
    /// sampled: the worst sampled client's own rounds, unamplified; needs
    /// --secure-aggregation) [default: observers]
    #[arg(long, value_name = "WHOM")]
    dp_budget_against: Option<cohort_core::privacy::BudgetAgainst>,
    /// Differential privacy, central noise: adapt the clip (starting at --dp-clip) to this
    /// quantile of the update norms, from a noised count (Andrew et al. 2021)
    #[arg(long, value_name = "Q")]
    dp_clip_quantile: Option<f64>,
    /// Differential privacy, adaptive clip: noise on the count of clients within the clip
    /// [default: expected clients per round / 20]
    #[arg(long, value_name = "SIGMA_B")]
    dp_clip_count_noise: Option<f64>,
    /// sync (rounds that wait for every selected client) | fedbuff (buffered asynchronous
    /// aggregation: the server steps after every --buffer-size updates) [default: sync]
    #[arg(long, value_name = "MODE")]
    mode: Option<cohort_coordinator::simulate::Mode>,
    /// Client speeds for the simulated clock: none | lognormal:SIGMA | pareto:ALPHA (each
    /// client's slowdown drawn once) [default: none]
    #[arg(long, value_name = "MODEL")]
    straggler: Option<cohort_coordinator::simulate::StragglerModel>,
    /// FedBuff: client updates per server step [default: 10]
    #[arg(long, value_name = "K")]
    buffer_size: Option<usize>,
    /// FedBuff: clients training at once [default: clients per round]
    #[arg(long, value_name = "C")]
    concurrency: Option<usize>,
    /// FedBuff: an update tau steps stale is weighted 1/(1+tau)^A [default: 0.5]
    #[arg(long, value_name = "A")]
    staleness_exponent: Option<f64>,
    /// Report when test accuracy first reaches A (round, simulated seconds, updates)
    #[arg(long, value_name = "A")]
    target_accuracy: Option<f64>,
    /// Fraction of the data held out for testing [default: 0.2]
    #[arg(long)]
    test_fraction: Option<f64>,
    /// Seed for every random choice [default: 0]
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// Output directory [default: runs/simulate-<timestamp>]
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Worker threads for client training [default: all cores]
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Train with your own Python code: a module (or a .py file) whose `train(weights,
    /// task)` (or FUNCTION) trains a client; it may also define `evaluate`,
    /// `client_data`, `test_data` and `initial_weights` (required). Needs the `cohort`
    /// Python package (`pip install ./python`); `--dataset` and `--model` then do not
    /// apply.
    #[arg(long, value_name = "MODULE[:FUNCTION]")]
    python: Option<String>,
    /// The interpreter for `--python`'s workers [default: python3]
    #[arg(long, value_name = "PATH", requires = "python")]
    python_exe: Option<PathBuf>,
    /// Python worker processes for `--python` [default: 2]
    #[arg(long, value_name = "N", requires = "python")]
    workers: Option<usize>,
    /// Pin `--python` workers to devices, round robin: cuda:0,cuda:1 or cpu
    #[arg(long, value_delimiter = ',', requires = "python")]
    devices: Option<Vec<String>>,
    /// Kill a `--python` task that runs longer than this many seconds (it fails)
    #[arg(long, value_name = "SECONDS", requires = "python")]
    task_timeout: Option<f64>,
}

impl SimulateArgs {
    /// The run's settings, and the strategies to compare when more than one was named.
    fn resolve(mut self) -> Result<(SimulationConfig, Vec<Strategy>), String> {
        let strategies = self.strategy.take().unwrap_or_default();
        let mut cfg = match &self.config {
            Some(path) => SimulationConfig::from_toml_file(path).map_err(|e| e.to_string())?,
            None => SimulationConfig::default(),
        };
        macro_rules! set {
            ($($field:ident),*) => {$(if let Some(v) = self.$field { cfg.$field = v; })*};
        }
        macro_rules! set_some {
            ($($field:ident),*) => {$(if let Some(v) = self.$field { cfg.$field = Some(v); })*};
        }
        set!(
            dataset,
            model,
            clients,
            min_participants,
            rounds,
            local_epochs,
            batch_size,
            lr,
            momentum,
            weight_decay,
            dropout,
            dropout_stage,
            clip,
            reducer,
            test_fraction,
            malicious,
            attack,
            dp_clip,
            dp_delta,
            dp_budget_against,
            mode,
            straggler,
            seed
        );
        set_some!(
            clients_per_round,
            partition,
            server_lr,
            out,
            threshold,
            neighbours,
            max_weight,
            aggregator,
            dp_noise_multiplier,
            dp_epsilon,
            dp_clip_quantile,
            dp_clip_count_noise,
            buffer_size,
            concurrency,
            staleness_exponent,
            target_accuracy
        );
        if self.secure_aggregation {
            cfg.secure_aggregation = true;
        }
        if let Some(scheme) = self.compress {
            cfg.compress_up = scheme;
            // The biased schemes need a residual per receiver, and a model trains from
            // no fewer than 4 bits: those models go plain.
            cfg.compress_down = match scheme {
                cohort_aggregation::compress::Compression::Quantize { bits }
                    if bits < cohort_core::compression::MIN_DOWNLOAD_BITS =>
                {
                    cohort_aggregation::compress::Compression::None
                }
                s if s.uses_error_feedback() => cohort_aggregation::compress::Compression::None,
                s => s,
            };
        }
        set!(compress_up, compress_down);
        set_some!(
            word_bits,
            personalise,
            client_holdout,
            tensorboard,
            mlflow_uri,
            mlflow_experiment
        );
        if let [only] = strategies.as_slice() {
            cfg.strategy = *only;
        }
        Ok((cfg, strategies))
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One line, like every other input error; `--help` has the details.
            let rendered = e.render().to_string();
            let first = rendered
                .lines()
                .next()
                .unwrap_or("error: invalid arguments");
            eprintln!("{first}");
            return ExitCode::from(2);
        }
    };
    match cli.command {
        Command::Simulate(args) => run_simulate(*args),
        Command::Serve(args) => run_serve(args),
        Command::Demo(args) => run_demo(&args),
        Command::Partition(args) => run_partition(&args),
        Command::Openapi => {
            // Through a JSON value, whose keys are sorted: the committed snapshot
            // (`docs/openapi.json`) then diffs by content, not by declaration order.
            let doc = serde_json::to_value(cohort_coordinator::server::http::openapi())
                .and_then(|v| serde_json::to_string_pretty(&v));
            match doc {
                Ok(text) => {
                    println!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Privacy(command) => match cohort_coordinator::privacy_cli::run(&command) {
            Ok(lines) => {
                for line in lines {
                    println!("{line}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Command::Compress(command) => match cohort_coordinator::compress_cli::run(&command) {
            Ok(lines) => {
                for line in lines {
                    println!("{line}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Command::Edge(args) => cohort_edge::cli::run(args),
        Command::Bench(BenchCommand::Reduce(args)) => {
            let selected = match cohort_aggregation::reduce::select(args.reducer) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("error: --reducer {}: {e}", args.reducer);
                    return ExitCode::from(2);
                }
            };
            eprintln!("{}", selected.line);
            match cohort_coordinator::bench::reduce::run(&args, selected.reducer.as_ref()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Bench(BenchCommand::Dashboard(args)) => {
            match cohort_coordinator::bench::dashboard::run(&args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Bench(BenchCommand::Secagg(args)) => {
            match cohort_coordinator::bench::secagg::run(&args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

fn run_serve(args: ServeArgs) -> ExitCode {
    let settings = match ServeSettings::from_args(args) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match cohort_coordinator::server::run_until_signal(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

fn run_simulate(args: SimulateArgs) -> ExitCode {
    let threads = args.threads;
    let python = args.python.clone().map(|target| {
        (
            target,
            args.python_exe.clone(),
            args.workers,
            args.devices.clone().unwrap_or_default(),
            args.task_timeout,
        )
    });
    let (cfg, strategies) = match args.resolve() {
        Ok(resolved) => resolved,
        Err(msg) => {
            eprintln!("error: {msg}");
            return ExitCode::from(2);
        }
    };
    if let Some(n) = threads
        && let Err(code) = set_threads(n)
    {
        return code;
    }
    // The one line that says where aggregation runs (and why, when `auto` falls back),
    // shown with the first round, so that bad input still gets its single error line.
    let reducer_line = match cohort_aggregation::reduce::select(cfg.reducer) {
        Ok(selected) => std::cell::Cell::new(Some(selected.line)),
        Err(e) => {
            eprintln!("error: --reducer {}: {e}", cfg.reducer);
            return ExitCode::from(2);
        }
    };
    let bar = progress_bar(cfg.rounds);
    let rounds = cfg.rounds;
    let report = |prefix: &str, r: &RoundRecord| {
        let mut line = format!(
            "{prefix}accuracy {:.4} loss {:.4} participants {} dropped {}",
            r.test_accuracy, r.test_loss, r.participants, r.dropped
        );
        if !r.status.published() {
            line.push_str(&format!(" ({})", r.status.as_str()));
        }
        if let Some(first) = reducer_line.take() {
            match &bar {
                Some(bar) => bar.println(first),
                None => eprintln!("{first}"),
            }
        }
        match &bar {
            Some(bar) => {
                bar.set_message(line);
                bar.inc(1);
            }
            None => eprintln!("round {}/{rounds} {line} {:.3}s", r.round, r.seconds),
        }
    };
    let outcome = if let Some((target, exe, workers, devices, task_timeout)) = python {
        if strategies.len() > 1 {
            eprintln!("error: --python runs one strategy at a time");
            return ExitCode::from(2);
        }
        let task_timeout = match task_timeout {
            Some(t) if !(t.is_finite() && t > 0.0) => {
                eprintln!("error: --task-timeout must be a positive number of seconds");
                return ExitCode::from(2);
            }
            t => t.map(std::time::Duration::from_secs_f64),
        };
        let settings = cohort_coordinator::simulate::python::PythonSettings {
            python: exe.unwrap_or_else(|| PathBuf::from("python3")),
            code: cohort_coordinator::simulate::python::PythonCode::Module(target),
            workers: workers.unwrap_or(2),
            devices,
            task_timeout,
            clients: cfg.clients,
            hyperparameters: serde_json::Map::new(),
            env: Vec::new(),
            shared_memory: std::env::var("COHORT_WORKER_TRANSPORT").as_deref() != Ok("pipes"),
            clients_split: cohort_coordinator::simulate::python::ClientSplit::of(&cfg),
        };
        run_python(&cfg, settings, |r| report("", r))
    } else if strategies.len() > 1 {
        if let Some(bar) = &bar {
            bar.set_length(u64::from(rounds) * strategies.len() as u64);
        }
        compare(&cfg, &strategies, |s, r| report(&format!("{s}: "), r)).map(|(c, dir)| {
            let results: Vec<String> = c
                .runs
                .iter()
                .map(|r| format!("{} {:.4}", r.strategy, r.final_test_accuracy))
                .collect();
            format!(
                "final test accuracy: {} after {} rounds; results in {}",
                results.join(", "),
                c.rounds,
                dir.display()
            )
        })
    } else {
        simulate(&cfg, |r| report("", r)).map(|(summary, dir)| final_line(&cfg, &summary, &dir))
    };
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    match outcome {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Sizes rayon's global pool to `n` threads, or says why it cannot.
fn set_threads(n: usize) -> Result<(), ExitCode> {
    if n == 0 {
        eprintln!("error: --threads must be at least 1");
        return Err(ExitCode::from(2));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| {
            eprintln!("error: cannot start {n} worker threads: {e}");
            ExitCode::from(1)
        })
}

/// The progress bar of a simulation, when stderr is a terminal.
fn progress_bar(rounds: u32) -> Option<ProgressBar> {
    std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new(u64::from(rounds));
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40.cyan/blue} {pos}/{len} rounds {msg} [{elapsed_precise}<{eta_precise}]",
            )
            .expect("static template is valid"),
        );
        bar
    })
}

/// A simulation whose clients train with the user's Python `train` in worker processes.
fn run_python(
    cfg: &SimulationConfig,
    settings: cohort_coordinator::simulate::python::PythonSettings,
    on_round: impl FnMut(&RoundRecord),
) -> Result<String, cohort_coordinator::simulate::SimulationError> {
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    cohort_coordinator::simulate::python::PythonPopulation::start(settings, cancel)
        .and_then(|pop| cohort_coordinator::simulate::simulate_population(cfg, &pop, on_round))
        .map(|(summary, dir, _)| {
            format!(
                "final test accuracy {:.4} after {} rounds ({} failed tasks, {:.1} client updates/s); results in {}",
                summary.final_test_accuracy,
                summary.rounds,
                summary.total_failed,
                summary.updates_per_second,
                dir.display()
            )
        })
}

/// The last line of a single-strategy simulation: accuracy, simulated time, the
/// target, privacy spent and why it stopped, when any of these apply.
fn final_line(
    cfg: &SimulationConfig,
    summary: &cohort_coordinator::simulate::Summary,
    dir: &std::path::Path,
) -> String {
    let privacy = summary
        .epsilon
        .map(|e| {
            let coordinator = match summary.epsilon_coordinator {
                Some(Some(c)) => format!("{c:.3}"),
                _ => "none".into(),
            };
            format!(
                ", epsilon {e:.3} at delta {} ({coordinator} against the coordinator)",
                cfg.dp_delta
            )
        })
        .unwrap_or_default();
    let stopped = summary
        .stopped
        .as_ref()
        .map(|why| format!(" (stopped: {why})"))
        .unwrap_or_default();
    let target = summary
        .target
        .as_ref()
        .map(|t| match (t.rounds_to_target, t.sim_seconds_to_target) {
            (Some(round), Some(sim)) => format!(
                ", target {} reached in round {round} at {sim:.1} simulated s",
                t.target_accuracy
            ),
            _ => format!(", target {} not reached", t.target_accuracy),
        })
        .unwrap_or_default();
    format!(
        "final test accuracy {:.4} after {} rounds ({:.1} simulated s){target}{privacy}{stopped} ({:.1} client updates/s on {} threads); results in {}",
        summary.final_test_accuracy,
        summary.rounds,
        summary.sim_seconds,
        summary.updates_per_second,
        summary.threads,
        dir.display()
    )
}

fn run_partition(args: &cohort_coordinator::demo::PartitionArgs) -> ExitCode {
    match cohort_coordinator::demo::write_digits_partitions(
        &args.out,
        args.clients,
        &args.partition,
        args.seed,
    ) {
        Ok((csvs, test)) => {
            for path in &csvs {
                println!("{}", path.display());
            }
            println!(
                "test set: {} rows in {}",
                test.len(),
                args.out.join("test.csv").display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_demo(args: &cohort_coordinator::demo::DemoArgs) -> ExitCode {
    match cohort_coordinator::demo::run(args) {
        Ok(outcome) => {
            let last = outcome.accuracy_per_round.last().copied().unwrap_or(0.0);
            println!("results in {}", outcome.run_dir.display());
            println!("final_test_accuracy={last:.4}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
