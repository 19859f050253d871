//! `cohort demo`: the whole system on one machine with nothing installed. A coordinator
//! on SQLite with dev TLS, N edge clients as separate processes on Dirichlet(0.5)
//! partitions of the digits data, one experiment run to the end.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_aggregation::wire;
use cohort_edge::data::{self, Dataset, Standardizer};
use cohort_edge::model::ModelKind;
use cohort_edge::partition::{PartitionScheme, partition};

use crate::server::{ServeFlags, ServeSettings, auth, driver, prepare};
use crate::store::{ExperimentState, RoundStage};
use cohort_core::ExperimentSpec;
use cohort_core::TrainSettings;

/// Settings of a demo run.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Edge clients to start
    #[arg(long, default_value_t = 10)]
    pub clients: usize,
    /// Rounds to run
    #[arg(long, default_value_t = 15)]
    pub rounds: u32,
    /// Where the run's database, certificates, client data and logs go
    #[arg(long, default_value = "cohort-demo")]
    pub dir: PathBuf,
    /// Seed of the split, the partition and the initial model
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Database of the coordinator [default: an SQLite file in the run directory]
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
    /// Combine the updates with secure aggregation (SecAgg+): the coordinator sees only
    /// masked vectors and learns only their sum
    #[arg(long)]
    pub secure_aggregation: bool,
    /// fedavg | fedprox:MU | fedadam | fedyogi | fedadagrad: the same strategies as
    /// `cohort simulate --strategy`
    #[arg(long, default_value = "fedavg")]
    pub strategy: cohort_aggregation::Strategy,
    /// Server learning rate [default: 1 for fedavg/fedprox, 0.01 for the adaptive ones]
    #[arg(long, value_name = "LR")]
    pub server_lr: Option<f32>,
}

/// What a finished demo measured.
#[derive(Debug, Clone)]
pub struct DemoOutcome {
    /// The run's directory.
    pub run_dir: PathBuf,
    /// Test accuracy of each published round's model, from round 1.
    pub accuracy_per_round: Vec<f64>,
}

fn write_csv(path: &Path, d: &Dataset) -> std::io::Result<()> {
    let mut out = String::new();
    for name in &d.feature_names {
        out.push_str(name);
        out.push(',');
    }
    out.push_str("label\n");
    for (row, &label) in d.features.rows().into_iter().zip(&d.labels) {
        for v in row {
            let _ = write!(out, "{v},");
        }
        out.push_str(&d.classes[label as usize]);
        out.push('\n');
    }
    std::fs::write(path, out)
}

/// Settings of `cohort partition`.
#[derive(Debug, Clone, clap::Args)]
pub struct PartitionArgs {
    /// Number of client partitions
    #[arg(long, default_value_t = 3)]
    pub clients: usize,
    /// iid | dirichlet:ALPHA | shards:K | quantity:SIGMA
    #[arg(long, default_value = "dirichlet:0.5")]
    pub partition: PartitionScheme,
    /// Seed of the split and the partition
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Directory for client-<i>.csv and test.csv
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// Writes the shipped digits data as `client-<i>.csv` partitions (of the training 80%)
/// and `test.csv` (the held-out 20%) in `dir`, in the CSV form `cohort-edge --data`
/// reads: the features standardised with the training part's statistics, then a `label`
/// column. Returns the client files and the test set.
pub fn write_digits_partitions(
    dir: &Path,
    clients: usize,
    scheme: &PartitionScheme,
    seed: u64,
) -> Result<(Vec<PathBuf>, Dataset), String> {
    if clients == 0 || clients > 10_000 {
        return Err("the number of clients must be between 1 and 10000".into());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
    let digits = data::digits();
    let (mut train, mut test) =
        data::stratified_split(&digits, 0.2, seed).map_err(|e| e.to_string())?;
    let scaler = Standardizer::fit(&train.features);
    scaler
        .transform(&mut train.features)
        .map_err(|e| e.to_string())?;
    scaler
        .transform(&mut test.features)
        .map_err(|e| e.to_string())?;
    let parts = partition(
        &train.labels,
        train.num_classes(),
        None,
        clients,
        scheme,
        seed,
    )
    .map_err(|e| e.to_string())?;
    let mut csvs = Vec::new();
    for (i, idx) in parts.iter().enumerate() {
        let path = dir.join(format!("client-{i}.csv"));
        write_csv(&path, &train.subset(idx)).map_err(|e| e.to_string())?;
        csvs.push(path);
    }
    write_csv(&dir.join("test.csv"), &test).map_err(|e| e.to_string())?;
    Ok((csvs, test))
}

/// Runs the demo to the end; progress goes to stderr.
pub fn run(args: &DemoArgs) -> Result<DemoOutcome, String> {
    if args.clients == 0 || args.clients > 200 {
        return Err("--clients must be between 1 and 200".into());
    }
    if args.rounds == 0 || args.rounds > 1000 {
        return Err("--rounds must be between 1 and 1000".into());
    }
    crate::server::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: &DemoArgs) -> Result<DemoOutcome, String> {
    let run_dir = args.dir.join(format!(
        "run-{}",
        chrono::Utc::now().format("%Y%m%d-%H%M%S")
    ));
    let clients_dir = run_dir.join("clients");
    std::fs::create_dir_all(&clients_dir)
        .map_err(|e| format!("cannot create `{}`: {e}", clients_dir.display()))?;

    let (csvs, test) = write_digits_partitions(
        &clients_dir,
        args.clients,
        &PartitionScheme::Dirichlet { alpha: 0.5 },
        args.seed,
    )?;

    let settings = ServeSettings::from_sources(
        None,
        &Default::default(),
        ServeFlags {
            listen: Some("127.0.0.1:0".parse().expect("literal address")),
            data_dir: Some(run_dir.join("coordinator")),
            database_url: args.database_url.clone(),
            dev_tls: true,
            // The dashboard then charts test accuracy as the rounds go.
            eval_data: Some(clients_dir.join("test.csv")),
            ..ServeFlags::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let prepared = prepare(settings).await.map_err(|e| e.to_string())?;
    let base = prepared.base_url();
    let ca = prepared.dev_ca_cert.clone().ok_or("dev TLS has a CA")?;
    let state = prepared.state().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(prepared.serve(async move {
        let _ = stopped.await;
    }));
    eprintln!(
        "coordinator listening on {base} (SQLite, dev TLS; CA {})",
        ca.display()
    );

    let spec = demo_spec(args, &test);
    spec.validate().map_err(|e| e.to_string())?;
    let store = &state.store;
    let exp = store
        .create_experiment(
            &spec.name,
            &serde_json::to_value(&spec).map_err(|e| e.to_string())?,
        )
        .await
        .map_err(|e| e.to_string())?;
    store
        .set_experiment_state(exp.id, ExperimentState::Running, "demo")
        .await
        .map_err(|e| e.to_string())?;

    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children: Vec<Child> = Vec::new();
    for (i, csv) in csvs.iter().enumerate() {
        children.push(start_edge_client(store, &exe, &run_dir, &base, &ca, csv, i).await?);
    }
    eprintln!("started {} cohort-edge processes", children.len());

    let outcome = wait_finished(store, exp.id, args.rounds).await;
    let _ = stop.send(());
    let _ = server.await;
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    outcome?;
    let accuracy_per_round = score_rounds(store, exp.id, &run_dir, &test, args.rounds).await?;
    Ok(DemoOutcome {
        run_dir,
        accuracy_per_round,
    })
}

/// The demo's experiment: the MLP on digits with every client in every round, a
/// quorum of 80%, and the strategy asked for.
fn demo_spec(args: &DemoArgs, test: &Dataset) -> ExperimentSpec {
    ExperimentSpec {
        name: "demo: digits, MLP, Dirichlet(0.5)".into(),
        features: test.num_features(),
        classes: test.num_classes(),
        model: ModelKind::Mlp { hidden: vec![64] }.into(),
        initial_model: None,
        tensors: None,
        hyperparameters: None,
        strategy: args.strategy,
        server_lr: args.server_lr,
        rounds: args.rounds,
        clients_per_round: args.clients,
        min_participants: (args.clients * 8 / 10).max(1),
        over_selection: 1.0,
        collect_deadline_seconds: 60,
        max_round_attempts: 3,
        train: TrainSettings::default(),
        seed: args.seed,
        secure_aggregation: args
            .secure_aggregation
            .then(cohort_core::SecureAggregationSpec::default),
        privacy: None,
        aggregator: None,
        max_weight: None,
        mode: Default::default(),
        buffer_size: None,
        concurrency: None,
        staleness_exponent: None,
        max_staleness: None,
        compression: None,
        personalisation: None,
        client_holdout: None,
        columns: None,
    }
}

/// Starts client `i` as a `cohort edge` process of this binary (`exe`) on `csv`, with
/// an enrolment token of its own; its output goes to `clients/client-<i>.log`.
async fn start_edge_client(
    store: &crate::store::Store,
    exe: &Path,
    run_dir: &Path,
    base: &str,
    ca: &Path,
    csv: &Path,
    i: usize,
) -> Result<Child, String> {
    let token = auth::generate_secret().map_err(|e| e.to_string())?;
    store
        .create_enrolment_token(
            &auth::hash_secret(&token),
            &format!("demo-client-{i}"),
            None,
        )
        .await
        .map_err(|e| e.to_string())?;
    let log = std::fs::File::create(run_dir.join(format!("clients/client-{i}.log")))
        .map_err(|e| e.to_string())?;
    Command::new(exe)
        .arg("edge")
        .arg("--coordinator")
        .arg(base)
        .arg("--ca-cert")
        .arg(ca)
        .arg("--data")
        .arg(csv)
        .arg("--state-dir")
        .arg(run_dir.join(format!("clients/state-{i}")))
        .arg("--idle-exit")
        .arg("20")
        .arg("--seed")
        .arg(i.to_string())
        .env("COHORT_ENROL_TOKEN", &token)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start an edge client: {e}"))
}

/// Waits for the experiment to finish, printing each round as it publishes; fails when
/// it fails, is stopped, or takes over 15 minutes.
async fn wait_finished(
    store: &crate::store::Store,
    experiment: uuid::Uuid,
    rounds: u32,
) -> Result<(), String> {
    let started = Instant::now();
    let mut reported = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let exp_now = store
            .experiment(experiment)
            .await
            .map_err(|e| e.to_string())?;
        let published = store.rounds(experiment).await.map_err(|e| e.to_string())?;
        for r in published
            .iter()
            .filter(|r| r.stage == RoundStage::Published)
            .skip(reported)
        {
            eprintln!(
                "round {}/{rounds} published: {} uploads, {} dropped",
                r.round, r.reported, r.dropped
            );
            reported += 1;
        }
        match exp_now.state {
            ExperimentState::Finished => return Ok(()),
            ExperimentState::Failed | ExperimentState::Stopped => {
                return Err(format!("experiment ended {}", exp_now.state.as_str()));
            }
            _ => {}
        }
        if started.elapsed() > Duration::from_secs(900) {
            return Err("the experiment did not finish within 15 minutes".into());
        }
    }
}

/// Scores every published model on the held-out test set and writes `metrics.csv`:
/// the accuracy of each round's model, from round 1.
async fn score_rounds(
    store: &crate::store::Store,
    experiment: uuid::Uuid,
    run_dir: &Path,
    test: &Dataset,
    rounds: u32,
) -> Result<Vec<f64>, String> {
    let (_, model) = driver::experiment_model(
        &store
            .experiment(experiment)
            .await
            .map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let model = model
        .built_in()
        .ok_or("the demo trains a built-in model")?
        .clone();
    let blobs = crate::blobs::BlobStore::open(&run_dir.join("coordinator/blobs"))
        .map_err(|e| e.to_string())?;
    let mut accuracy_per_round = Vec::new();
    let mut csv = String::from("round,test_accuracy,test_loss\n");
    for round in 1..=i64::from(rounds) {
        let path = format!("models/{experiment}/round-{round}.bin");
        let bytes = blobs
            .get(&path)
            .map_err(|e| format!("model of round {round}: {e}"))?;
        let params = wire::decode(model.layout(), &bytes).map_err(|e| e.to_string())?;
        let eval = model
            .evaluate(params.values(), test.features.view(), &test.labels)
            .map_err(|e| e.to_string())?;
        let _ = writeln!(csv, "{round},{},{}", eval.accuracy, eval.loss);
        accuracy_per_round.push(eval.accuracy);
    }
    std::fs::write(run_dir.join("metrics.csv"), csv).map_err(|e| e.to_string())?;
    Ok(accuracy_per_round)
}
