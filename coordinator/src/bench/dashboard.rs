//! `cohort bench dashboard`: how long the dashboard's pages take at the server for a big
//! deployment. It fills a fresh database with one experiment of `--rounds` rounds (the
//! last one in progress), `--clients` enrolled clients with their tokens,
//! `--participants` participations per round and one job per round, then renders every
//! page through the full application (session check, queries, templates) in process,
//! with no network in between, and prints one JSON line per page: the median, 95th
//! percentile and largest time, the size, and the time of the health check measured the
//! same way in the same run (the floor any request pays).

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, header};
use sqlx::Row;
use tower::ServiceExt;
use uuid::Uuid;

use crate::server::auth::{generate_secret, hash_secret};
use crate::server::{ServeFlags, ServeSettings, prepare};
use crate::store::now_millis;
use cohort_core::ExperimentSpec;
use cohort_core::TrainSettings;

/// Pages must answer within this at the server.
pub const PAGE_BUDGET_MS: f64 = 50.0;

/// Flags of `cohort bench dashboard`.
#[derive(Debug, Clone, clap::Args)]
pub struct DashboardBenchArgs {
    /// Rounds of the experiment (the last one is in progress)
    #[arg(long, default_value_t = 1000)]
    pub rounds: u32,
    /// Enrolled clients
    #[arg(long, default_value_t = 10_000)]
    pub clients: u32,
    /// Clients selected per round
    #[arg(long, default_value_t = 20)]
    pub participants: u32,
    /// Timed requests per page
    #[arg(long, default_value_t = 30)]
    pub repeats: usize,
    /// An EMPTY PostgreSQL database to fill (default: an SQLite file in a temporary
    /// directory); refused if it already holds experiments or clients
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

/// One value to bind in a seeding insert.
enum Val {
    Int(i64),
    Real(f64),
    Text(String),
    Bytes(Vec<u8>),
    Null,
}

/// Runs `$sql` with `$vals` bound, in transaction `$tx`.
macro_rules! exec {
    ($tx:expr, $sql:expr, $vals:expr) => {{
        let mut q = sqlx::query($sql);
        for v in $vals {
            q = match v {
                Val::Int(i) => q.bind(i),
                Val::Real(f) => q.bind(f),
                Val::Text(t) => q.bind(t),
                Val::Bytes(b) => q.bind(b),
                Val::Null => q.bind(Option::<i64>::None),
            };
        }
        q.execute(&mut *$tx).await.map_err(|e| e.to_string())?;
    }};
}

/// Fills the database through `$pool`; the experiment's id.
macro_rules! seed {
    ($pool:expr, $args:expr, $spec:expr) => {{
        let pool = $pool;
        let args: &DashboardBenchArgs = $args;
        let existing: i64 = sqlx::query("SELECT (SELECT COUNT(*) FROM experiments) + (SELECT COUNT(*) FROM clients)")
            .fetch_one(&pool)
            .await
            .map_err(|e| e.to_string())?
            .try_get(0)
            .map_err(|e| e.to_string())?;
        if existing > 0 {
            return Err("the database is not empty: give bench dashboard an empty one".into());
        }
        let now = now_millis();
        let exp = Uuid::new_v4().to_string();
        let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
        exec!(tx, "INSERT INTO experiments (id, name, spec, state, current_round, created_at, updated_at) \
                   VALUES ($1, $2, $3, 'running', $4, $5, $5)",
            [Val::Text(exp.clone()), Val::Text("benchmark".into()), Val::Text($spec),
             Val::Int(i64::from(args.rounds)), Val::Int(now - 86_400_000)]);
        let mut clients = Vec::with_capacity(args.clients as usize);
        for c in 0..args.clients {
            let token = Uuid::new_v4().to_string();
            let client = Uuid::new_v4().to_string();
            let at = now - 86_400_000 + i64::from(c);
            exec!(tx, "INSERT INTO enrolment_tokens (id, token_hash, label, created_at, used_at, used_by) \
                       VALUES ($1, $2, $3, $4, $4, $5)",
                [Val::Text(token.clone()), Val::Bytes(hash_secret(&token).to_vec()),
                 Val::Text(format!("site-{c}")), Val::Int(at), Val::Text(client.clone())]);
            exec!(tx, "INSERT INTO clients (id, secret_hash, label, token_id, enrolled_at, last_seen_at) \
                       VALUES ($1, $2, $3, $4, $5, $6)",
                [Val::Text(client.clone()), Val::Bytes(hash_secret(&client).to_vec()),
                 Val::Text(format!("site-{c}")), Val::Text(token), Val::Int(at),
                 Val::Int(now - i64::from(c) * 1000)]);
            clients.push(client);
        }
        for r in 1..=i64::from(args.rounds) {
            let last = r == i64::from(args.rounds);
            let started = now - (i64::from(args.rounds) - r + 1) * 60_000;
            let n = i64::from(args.participants);
            let accuracy = 0.9 - 0.8 / (r as f64 + 1.0);
            if last {
                exec!(tx, "INSERT INTO rounds (experiment_id, round, attempt, stage, stage_deadline, selected, \
                           reported, dropped, started_at) VALUES ($1, $2, 1, 'collecting', $3, $4, $5, 0, $6)",
                    [Val::Text(exp.clone()), Val::Int(r), Val::Int(now + 60_000), Val::Int(n),
                     Val::Int(n / 2), Val::Int(started)]);
            } else {
                exec!(tx, "INSERT INTO rounds (experiment_id, round, attempt, stage, stage_deadline, selected, \
                           reported, dropped, test_accuracy, test_loss, train_loss, started_at, finished_at) \
                           VALUES ($1, $2, 1, 'published', $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                    [Val::Text(exp.clone()), Val::Int(r), Val::Int(started + 30_000), Val::Int(n),
                     Val::Int(n - 1), Val::Int(1), Val::Real(accuracy), Val::Real(1.0 - accuracy),
                     Val::Real(1.1 - accuracy), Val::Int(started), Val::Int(started + 20_000)]);
                exec!(tx, "INSERT INTO jobs (kind, experiment_id, round, state, attempts, max_attempts, \
                           run_after, created_at, updated_at) VALUES ('aggregate', $1, $2, 'done', 1, 5, $3, $3, $3)",
                    [Val::Text(exp.clone()), Val::Int(r), Val::Int(started + 20_000)]);
            }
            for p in 0..n {
                let client = &clients[((r * n + p) as usize) % clients.len()];
                let (state, uploaded, samples, loss) = if last && p >= n / 2 {
                    ("selected", Val::Null, Val::Null, Val::Null)
                } else if !last && p == n - 1 {
                    ("dropped", Val::Null, Val::Null, Val::Null)
                } else {
                    ("uploaded", Val::Int(started + 10_000), Val::Int(100), Val::Real(0.5))
                };
                exec!(tx, "INSERT INTO participations (experiment_id, round, attempt, client_id, state, \
                           selected_at, uploaded_at, num_samples, train_loss) VALUES ($1, $2, 1, $3, $4, $5, $6, $7, $8)",
                    [Val::Text(exp.clone()), Val::Int(r), Val::Text(client.clone()),
                     Val::Text(state.into()), Val::Int(started), uploaded, samples, loss]);
            }
        }
        exec!(tx, "INSERT INTO models (experiment_id, round, blob_path, parameters, created_at) \
                   VALUES ($1, $2, $3, 650, $4)",
            [Val::Text(exp.clone()), Val::Int(i64::from(args.rounds) - 1),
             Val::Text(format!("models/{exp}/round-{}.bin", args.rounds - 1)), Val::Int(now)]);
        tx.commit().await.map_err(|e| e.to_string())?;
        pool.close().await;
        exp
    }};
}

/// Median, 95th percentile and largest of `times`, in ms.
fn summary(times: &mut [Duration]) -> (f64, f64, f64) {
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |q: f64| ms(times[((times.len() - 1) as f64 * q).round() as usize]);
    (at(0.5), at(0.95), ms(times[times.len() - 1]))
}

/// Runs the benchmark; one JSON line per page on stdout.
pub fn run(args: &DashboardBenchArgs) -> Result<(), String> {
    if args.rounds == 0 || args.clients == 0 || args.participants == 0 || args.repeats == 0 {
        return Err("--rounds, --clients, --participants and --repeats must be at least 1".into());
    }
    if args.participants > args.clients {
        return Err("--participants cannot exceed --clients".into());
    }
    crate::server::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: &DashboardBenchArgs) -> Result<(), String> {
    let dir = tempfile_dir()?;
    let settings = ServeSettings::from_sources(
        None,
        &Default::default(),
        ServeFlags {
            listen: Some("127.0.0.1:0".parse().expect("literal address")),
            data_dir: Some(dir.clone()),
            database_url: args.database_url.clone(),
            insecure_http: true,
            admin_token: Some(generate_secret().map_err(|e| e.to_string())?),
            ..ServeFlags::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let url = settings.database_url.clone();
    let prepared = prepare(settings).await.map_err(|e| e.to_string())?;
    let state = prepared.state().clone();
    let spec = bench_spec(args)?;
    let spec_json = serde_json::to_string(&spec).map_err(|e| e.to_string())?;
    let seeding = Instant::now();
    let exp = if url.starts_with("postgres") {
        seed!(
            sqlx::PgPool::connect(&url)
                .await
                .map_err(|e| e.to_string())?,
            args,
            spec_json
        )
    } else {
        seed!(
            sqlx::SqlitePool::connect(&url)
                .await
                .map_err(|e| e.to_string())?,
            args,
            spec_json
        )
    };
    eprintln!(
        "seeded {} rounds, {} clients, {} participations in {:.1} s",
        args.rounds,
        args.clients,
        u64::from(args.rounds) * u64::from(args.participants),
        seeding.elapsed().as_secs_f64()
    );
    let session = generate_secret().map_err(|e| e.to_string())?;
    let now = now_millis();
    state
        .store
        .create_dashboard_session(
            &hash_secret(&session),
            now,
            now + 3_600_000,
            crate::store::SessionHolder::AdminToken,
        )
        .await
        .map_err(|e| e.to_string())?;
    let app = crate::server::app(state.clone());
    let cookie = format!(
        "{}={session}",
        crate::server::dashboard::session::SESSION_COOKIE
    );
    let backend = if url.starts_with("postgres") {
        "postgres"
    } else {
        "sqlite"
    };

    let measure = |path: String| measure(&app, &cookie, path, args.repeats);
    let (mut health, _, _) = measure("/api/v1/health".into()).await?;
    let (health_median, _, _) = summary(&mut health);
    let pages = [
        "/experiments".to_string(),
        format!("/experiments/{exp}"),
        format!(
            "/experiments/{exp}?page={}",
            (args.rounds as usize).div_ceil(50) / 2 + 1
        ),
        "/experiments/new".into(),
        "/clients".into(),
        format!("/clients?page={}", args.clients.div_ceil(100)),
        "/sign-in".into(),
    ];
    let mut worst: f64 = 0.0;
    for page in pages {
        let (mut times, bytes, status) = measure(page.clone()).await?;
        if status != 200 {
            return Err(format!("{page} answered {status}"));
        }
        let (median, p95, max) = summary(&mut times);
        worst = worst.max(median);
        println!(
            "{}",
            serde_json::json!({
                "bench": "dashboard",
                "page": page.replace(&exp, "{id}"),
                "backend": backend,
                "rounds": args.rounds,
                "clients": args.clients,
                "participants_per_round": args.participants,
                "repeats": args.repeats,
                "median_ms": median,
                "p95_ms": p95,
                "max_ms": max,
                "bytes": bytes,
                "health_median_ms": health_median,
                "ratio_to_health": median / health_median,
                "budget_ms": PAGE_BUDGET_MS,
                "within_budget": median < PAGE_BUDGET_MS,
            })
        );
    }
    state.store.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    if worst >= PAGE_BUDGET_MS {
        eprintln!("slowest page median {worst:.1} ms is over the {PAGE_BUDGET_MS} ms budget");
    }
    Ok(())
}

/// The benchmark's experiment: a logistic regression with `participants` clients a
/// round, only ever filled in by the seeding, never run.
fn bench_spec(args: &DashboardBenchArgs) -> Result<ExperimentSpec, String> {
    Ok(ExperimentSpec {
        name: "benchmark".into(),
        features: 64,
        classes: 10,
        model: "logreg".parse().map_err(|e| format!("{e}"))?,
        initial_model: None,
        tensors: None,
        hyperparameters: None,
        strategy: cohort_aggregation::Strategy::FedAvg,
        server_lr: None,
        rounds: args.rounds,
        clients_per_round: args.participants as usize,
        min_participants: 1,
        over_selection: 1.0,
        collect_deadline_seconds: 120,
        max_round_attempts: 3,
        train: TrainSettings::default(),
        seed: 0,
        secure_aggregation: None,
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
    })
}

/// Times `repeats` GETs of `path` through the whole application in process (after 3
/// that warm caches and the connection pool): the times, the body's size and the
/// status of the last.
async fn measure(
    app: &axum::Router,
    cookie: &str,
    path: String,
    repeats: usize,
) -> Result<(Vec<Duration>, usize, u16), String> {
    let mut times = Vec::with_capacity(repeats);
    let mut bytes = 0;
    let mut status = 0;
    for i in 0..repeats + 3 {
        let request = Request::get(&path)
            .header(header::COOKIE, cookie)
            .body(Body::empty())
            .map_err(|e| e.to_string())?;
        let start = Instant::now();
        let response = app
            .clone()
            .oneshot(request)
            .await
            .map_err(|e| e.to_string())?;
        status = response.status().as_u16();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .map_err(|e| e.to_string())?;
        let took = start.elapsed();
        bytes = body.len();
        if i >= 3 {
            times.push(took);
        }
    }
    Ok((times, bytes, status))
}

/// A fresh directory under the system's temporary directory.
fn tempfile_dir() -> Result<std::path::PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("cohort-bench-dashboard-{}", Uuid::new_v4()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
    Ok(dir)
}
