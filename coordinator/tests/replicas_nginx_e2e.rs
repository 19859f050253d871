//! Three `cohort serve` replicas on one PostgreSQL and one shared data directory, behind
//! Debian's nginx as the load balancer, with six real `cohort-edge` processes that know
//! only nginx's address. In a plain FedAvg experiment, one replica stops right after
//! claiming a round's aggregation job (`COHORT_FAULT_PAUSE=job-claimed`, so it holds the
//! job's lease) and is killed with SIGKILL while that round is `aggregating`; then, in a
//! SecAgg+ experiment, a second replica is killed the same way, and the last one carries
//! on alone.
//!
//! What it protects: the surviving replicas finish the round and the experiment; a dead
//! replica's job is taken over only once its lease ran out, and runs exactly once (one
//! `job.done`, by a live replica; two claims); no other job runs twice; every round
//! publishes exactly one model; no upload an edge client saw acknowledged is lost, and
//! none is counted twice; nginx spreads the requests over all three replicas.
//!
//! nginx terminates TLS and proxies HTTP/1.1 over TLS to the replicas, rather than
//! passing TLS through at layer 4 (`stream`): that is how such a service is usually put
//! behind a load balancer (the public certificate lives at the balancer, the replicas
//! keep internal ones), it balances and fails over per request rather than per
//! long-lived connection, and it can say who the client is in `X-Forwarded-For`, which
//! the replicas believe because they are started with `--trusted-proxies`. Passthrough
//! would be the choice for mutual TLS with `--client-ca`, where the replica itself must
//! see the client's certificate. nginx retries a request on another replica only when it
//! could not be sent (`proxy_next_upstream error timeout`, without `non_idempotent`): an
//! upload whose replica died after receiving it is answered 502 and the edge client
//! retries it with the same upload id, which the coordinators count once.
//!
//! Needs nginx (`apt-get install nginx`) and `COHORT_TEST_POSTGRES_URL`; skips, saying
//! so, when either is missing, unless `COHORT_REQUIRE_NGINX=1` makes a missing nginx a
//! failure.

mod common;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cohort_coordinator::demo::write_digits_partitions;
use cohort_coordinator::store::{AuditEntry, Job, JobState, ParticipationState, Store};
use cohort_edge::partition::PartitionScheme;
use common::{admin, free_port, wait_healthy};
use reqwest::Method;

const REPLICAS: usize = 3;
const CLIENTS: usize = 6;
const ROUNDS: i64 = 6;
/// Short, so that the takeover comes quickly; the worker renews it every third.
const LEASE_SECONDS: i64 = 5;
/// An edge client exits after this long without a task: longer than the pause while the
/// held job's lease runs out, so that none leaves in the middle.
const EDGE_IDLE_EXIT: u64 = 12;
const FAULT_LINE: &str = "cohort: fault point job-claimed reached";

/// Every process the test starts, killed when it ends, passed or failed.
#[derive(Default)]
struct Processes {
    replicas: Vec<Option<Child>>,
    edges: Vec<Option<Child>>,
    nginx: Option<Child>,
}

impl Drop for Processes {
    fn drop(&mut self) {
        for child in self.replicas.iter_mut().chain(self.edges.iter_mut()) {
            if let Some(mut child) = child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if let Some(nginx) = self.nginx.take() {
            stop_nginx(nginx);
        }
    }
}

/// Stops nginx with SIGTERM, so that the master takes its workers with it (a SIGKILLed
/// master would leave them serving), and SIGKILL only if it does not go.
fn stop_nginx(mut nginx: Child) {
    use rustix::process::{Pid, Signal, kill_process};
    let _ = kill_process(Pid::from_child(&nginx), Signal::TERM);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if let Ok(Some(_)) = nginx.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = nginx.kill();
    let _ = nginx.wait();
}

/// Debian's nginx, or `None` (and why) when it is not installed.
fn find_nginx() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    ["/usr/sbin", "/usr/local/sbin"]
        .iter()
        .map(PathBuf::from)
        .chain(std::env::split_paths(&path))
        .map(|dir| dir.join("nginx"))
        .find(|candidate| candidate.is_file())
}

fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// `cohort serve` on `port` with dev TLS (shared through the data directory), stdout and
/// stderr into `log`, where the fault line is looked for.
fn spawn_replica(
    data_dir: &Path,
    port: u16,
    database_url: &str,
    env: &[(&str, String)],
    log: &Path,
) -> Child {
    let out = File::create(log).unwrap();
    // A replica with a data directory of its own (blobs in a bucket) presents the
    // certificate the first replica made, copied into its directory.
    let tls: Vec<String> =
        if data_dir.join("tls/server.pem").exists() && !data_dir.join("tls/ca-key.pem").exists() {
            vec![
                "--tls-cert".into(),
                data_dir.join("tls/server.pem").display().to_string(),
                "--tls-key".into(),
                data_dir.join("tls/server-key.pem").display().to_string(),
            ]
        } else {
            vec!["--dev-tls".into()]
        };
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .arg("serve")
        .args(&tls)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(data_dir)
        .arg("--database-url")
        .arg(database_url)
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .env("COHORT_ADMIN_TOKEN", common::ADMIN)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("cohort serve starts")
}

/// The nginx configuration: TLS at nginx with the dev certificate (names `localhost` and
/// `127.0.0.1`, so the edge clients trust it through the dev CA), and HTTPS to the
/// replicas, whose certificate nginx checks against the same CA.
fn nginx_conf(prefix: &Path, port: u16, replicas: &[u16], tls: &Path) -> String {
    let servers: String = replicas
        .iter()
        .map(|p| format!("        server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;\n"))
        .collect();
    let p = prefix.display();
    let tls = tls.display();
    format!(
        r#"# Workers as root: the test runs as root, and its temp dir is root's. (Ignored, with a
# warning, when nginx does not start as root.)
user root;
worker_processes 1;
events {{ worker_connections 1024; }}
http {{
    # Everything nginx writes stays in the test's folder.
    client_body_temp_path {p}/body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    log_format upstreams '$msec $status $request_method $uri $upstream_addr $upstream_status';
    access_log {p}/access.log upstreams;

    upstream cohort {{
{servers}        # Connections to the replicas are kept open between requests.
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {tls}/server.pem;
        ssl_certificate_key {tls}/server-key.pem;
        ssl_protocols TLSv1.2 TLSv1.3;
        # At least the replicas' --max-body-bytes (64 MiB by default): nginx refuses
        # larger bodies with 413 before they reach a replica.
        client_max_body_size 64m;

        location / {{
            proxy_pass https://cohort;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            # The replicas run with --trusted-proxies 127.0.0.1: they key per-address
            # rate limits on the address nginx appends here.
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto https;
            proxy_ssl_protocols TLSv1.2 TLSv1.3;
            proxy_ssl_trusted_certificate {tls}/ca.pem;
            proxy_ssl_verify on;
            proxy_ssl_name localhost;
            proxy_ssl_session_reuse on;
            # Uploads stream through to the replica, which writes them durably itself;
            # answers (models) stream back.
            proxy_request_buffering off;
            proxy_buffering off;
            # Longer than a check-in's long poll (at most 30 s).
            proxy_read_timeout 75s;
            proxy_send_timeout 75s;
            proxy_connect_timeout 2s;
            # A replica that refuses or does not answer a connection: the request goes to
            # the next one. Not after the request was sent (no `non_idempotent`): the edge
            # client retries its upload itself, with the same upload id.
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 3;
        }}
    }}
}}
"#
    )
}

/// `(experiment, round, attempt)` of every upload acknowledged in an edge client's log.
fn acknowledged(log: &str) -> Vec<(String, i64, i64)> {
    log.lines()
        .filter_map(|l| l.strip_prefix("cohort-edge: acknowledged "))
        .map(|rest| {
            let field = |name: &str| {
                rest.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(name))
                    .unwrap()
                    .to_string()
            };
            (
                field("experiment="),
                field("round=").parse().unwrap(),
                field("attempt=").parse().unwrap(),
            )
        })
        .collect()
}

/// The job id in a `job.done` audit entry's detail (`job <id>: <kind> of round <n>`).
fn job_id(detail: &str) -> i64 {
    detail
        .strip_prefix("job ")
        .and_then(|rest| rest.split(':').next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("job.done detail `{detail}`"))
}

/// The replicas as the test reaches them: through nginx, through the database, and
/// through their logs.
struct Cluster {
    http: reqwest::Client,
    /// nginx's address.
    base: String,
    /// Each replica's stdout and stderr.
    logs: Vec<PathBuf>,
    /// Removing it arms the fault point for the next job claimed (see the test).
    once_file: PathBuf,
    store: Store,
}

/// A replica killed while it held a round's aggregation job.
struct Kill {
    replica: usize,
    /// Its worker name in job leases and `job.done` entries.
    worker: String,
    /// The job as it claimed it.
    job: Job,
    /// When its lease ran out, Unix ms.
    lease_ends: i64,
    /// When it was killed, Unix ms.
    killed_at: i64,
}

/// Creates and starts an experiment through nginx: its id, as text and parsed.
async fn start_experiment(cluster: &Cluster, spec: serde_json::Value) -> (String, uuid::Uuid) {
    let (http, base) = (&cluster.http, &cluster.base);
    let exp = admin(http, base, Method::POST, "/experiments", Some(spec)).await;
    let id = exp["id"].as_str().unwrap().to_string();
    let path = format!("/experiments/{id}/start");
    admin(http, base, Method::POST, &path, None).await;
    let exp_id = uuid::Uuid::parse_str(&id).unwrap();
    (id, exp_id)
}

/// Once experiment `id` has published two rounds, arms the fault point, waits for the
/// live replica that pauses on the next job claim (its lease held, the round
/// `aggregating`), and SIGKILLs it.
async fn kill_the_next_job_holder(cluster: &Cluster, procs: &mut Processes, id: &str) -> Kill {
    let (http, base) = (&cluster.http, &cluster.base);
    let start = Instant::now();
    loop {
        let rs = common::rounds(http, base, id).await;
        if rs.iter().filter(|r| r["stage"] == "published").count() >= 2 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "two rounds did not publish: {rs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    std::fs::remove_file(&cluster.once_file).unwrap();
    let live: Vec<usize> = (0..REPLICAS)
        .filter(|&i| procs.replicas[i].is_some())
        .collect();
    let replica = loop {
        let hits: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&i| {
                std::fs::read_to_string(&cluster.logs[i])
                    .is_ok_and(|text| text.contains(FAULT_LINE))
            })
            .collect();
        if let [one] = hits[..] {
            break one;
        }
        assert!(hits.len() < 2, "more than one replica paused: {hits:?}");
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "no replica reached the fault point"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // The claim was committed before the pause: the row names the paused worker and its
    // lease.
    let exp_id = uuid::Uuid::parse_str(id).unwrap();
    let job = cluster
        .store
        .jobs(exp_id)
        .await
        .unwrap()
        .into_iter()
        .find(|j| j.state == JobState::Running)
        .expect("the paused replica's job is running");
    assert_eq!(job.attempts, 1, "{job:?}");
    let worker = job.locked_by.clone().expect("a worker holds it");
    let lease_ends = job.locked_until.expect("a lease");
    let round = common::rounds(http, base, id)
        .await
        .into_iter()
        .find(|r| r["round"] == job.round);
    assert_eq!(
        round.as_ref().map(|r| &r["stage"]),
        Some(&serde_json::json!("aggregating")),
        "{round:?}"
    );

    let mut victim = procs.replicas[replica].take().unwrap();
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();
    Kill {
        replica,
        worker,
        job,
        lease_ends,
        killed_at: now_millis(),
    }
}

/// Checks a finished experiment, given its rounds as the API listed them: every round
/// published exactly once with exactly one model, each upload counted once, every job
/// done exactly once, and the killed replica's job claimed twice and done once by
/// another worker after its lease ran out. Returns the `job.done` entry of that takeover.
async fn check_experiment(
    cluster: &Cluster,
    pg: &sqlx::PgPool,
    schema: &str,
    id: &str,
    rs: &[serde_json::Value],
    kill: &Kill,
) -> AuditEntry {
    let store = &cluster.store;
    let exp_id = uuid::Uuid::parse_str(id).unwrap();
    let rounds = ROUNDS;
    let reported: Vec<String> = rs
        .iter()
        .map(|r| {
            format!(
                "{}.{}:{}:{}",
                r["round"], r["attempt"], r["stage"], r["reported"]
            )
        })
        .collect();
    eprintln!("{id}: round.attempt:stage:uploads {reported:?}");
    let published: Vec<&serde_json::Value> =
        rs.iter().filter(|r| r["stage"] == "published").collect();
    let mut per_round = HashMap::<i64, usize>::new();
    for r in &published {
        *per_round.entry(r["round"].as_i64().unwrap()).or_default() += 1;
    }
    assert_eq!(per_round.len(), rounds as usize, "{rs:?}");
    assert!(per_round.values().all(|&n| n == 1), "{rs:?}");
    let models: Vec<(i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT round, COUNT(*) FROM \"{schema}\".models WHERE experiment_id = $1 \
         GROUP BY round ORDER BY round"
    )))
    .bind(id)
    .fetch_all(pg)
    .await
    .unwrap();
    let one_each: Vec<(i64, i64)> = (0..=rounds).map(|r| (r, 1)).collect();
    assert_eq!(
        models, one_each,
        "one model per round, round 0 the initial one"
    );

    // Each round's count is its distinct uploaders, and each has one stored upload.
    for r in &published {
        let (round, attempt) = (r["round"].as_i64().unwrap(), r["attempt"].as_i64().unwrap());
        let parts = store.participations(exp_id, round, attempt).await.unwrap();
        let uploaded: HashSet<uuid::Uuid> = parts
            .iter()
            .filter(|p| p.state == ParticipationState::Uploaded)
            .map(|p| p.client_id)
            .collect();
        let reported = r["reported"].as_i64().unwrap();
        assert_eq!(reported, uploaded.len() as i64, "round {round}");
        let stored = store.uploads(exp_id, round, attempt).await.unwrap();
        assert_eq!(stored.len() as i64, reported, "round {round}");
    }

    let jobs = store.jobs(exp_id).await.unwrap();
    assert_eq!(jobs.len(), rounds as usize, "one job per round: {jobs:?}");
    let audit = store.audit_log(10_000).await.unwrap();
    let done: Vec<&AuditEntry> = audit
        .iter()
        .filter(|e| e.action == "job.done" && e.subject == id)
        .collect();
    let mut done_per_job = HashMap::<i64, usize>::new();
    for entry in &done {
        *done_per_job.entry(job_id(&entry.detail)).or_default() += 1;
    }
    assert_eq!(done_per_job.len(), jobs.len(), "{done:?}");
    for job in &jobs {
        assert_eq!(job.state, JobState::Done, "{job:?}");
        assert_eq!(done_per_job.get(&job.id), Some(&1), "{job:?}: {done:?}");
        // The dead worker's claim counts as an attempt.
        let claims = if job.id == kill.job.id { 2 } else { 1 };
        assert_eq!(job.attempts, claims, "{job:?}");
    }
    let takeover = *done
        .iter()
        .find(|e| job_id(&e.detail) == kill.job.id)
        .unwrap();
    assert_ne!(takeover.actor, kill.worker, "{takeover:?}");
    assert!(takeover.actor.starts_with("coordinator-"), "{takeover:?}");
    assert!(
        takeover.at >= kill.lease_ends,
        "job {} done at {} before the lease ended at {}",
        kill.job.id,
        takeover.at,
        kill.lease_ends
    );
    takeover.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_killed_holding_a_job_behind_nginx_lose_nothing_and_run_it_once() {
    behind_nginx(None).await;
}

/// The same with every upload and model in an S3 bucket (moto's server): the replicas
/// share nothing but PostgreSQL and the bucket, each its own data directory and none a
/// blob directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_sharing_only_the_database_and_a_bucket_lose_nothing_behind_nginx() {
    let Some(s3) = common::S3::with_bucket("replicas").await else {
        return;
    };
    behind_nginx(Some(&s3)).await;
}

/// Three replicas behind nginx, two killed holding jobs; blobs in `bucket` when given,
/// else in one data directory they share.
async fn behind_nginx(bucket: Option<&common::S3>) {
    let Some(nginx_bin) = find_nginx() else {
        assert!(
            std::env::var("COHORT_REQUIRE_NGINX").as_deref() != Ok("1"),
            "nginx is not installed and COHORT_REQUIRE_NGINX=1"
        );
        eprintln!("nginx is not installed (apt-get install nginx): replicas behind nginx skipped");
        return;
    };
    let Some((pg, schema, url)) = common::postgres_schema("cohort_nginx").await else {
        return;
    };
    cohort_coordinator::server::install_crypto_provider();
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let mut procs = Processes::default();

    // Disarmed at first: the fault point pauses only the process that creates this file,
    // and it exists. Removing it arms the next job claim, on whichever replica makes it.
    let once_file = dir.path().join("fault-once");
    std::fs::write(&once_file, b"").unwrap();
    let mut env = vec![
        ("COHORT_JOB_LEASE_SECONDS", LEASE_SECONDS.to_string()),
        ("COHORT_FAULT_PAUSE", "job-claimed".to_string()),
        ("COHORT_FAULT_ONCE_FILE", once_file.display().to_string()),
        ("COHORT_TRUSTED_PROXIES", "127.0.0.1".to_string()),
    ];
    if let Some(s3) = bucket {
        env.extend(s3.env());
        env.push(("COHORT_BLOB_STORE", "s3://replicas/cluster".to_string()));
    }
    let ports: Vec<u16> = (0..REPLICAS).map(|_| free_port()).collect();
    let logs: Vec<PathBuf> = (0..REPLICAS)
        .map(|i| dir.path().join(format!("replica-{i}.log")))
        .collect();
    // With a bucket, each replica has a directory of its own; else they share one.
    let dirs: Vec<PathBuf> = (0..REPLICAS)
        .map(|i| match (bucket, i) {
            (Some(_), 1..) => dir.path().join(format!("replica-{i}")),
            _ => data_dir.clone(),
        })
        .collect();
    // The first makes the dev CA and certificate and applies the migrations; the others
    // start once it answers, with its certificate.
    let replica = |i: usize| Some(spawn_replica(&dirs[i], ports[i], &url, &env, &logs[i]));
    procs.replicas.push(replica(0));
    wait_healthy(&format!("https://127.0.0.1:{}", ports[0]), &ca).await;
    for own in dirs.iter().filter(|d| **d != data_dir) {
        std::fs::create_dir_all(own.join("tls")).unwrap();
        for file in ["server.pem", "server-key.pem"] {
            std::fs::copy(data_dir.join("tls").join(file), own.join("tls").join(file)).unwrap();
        }
    }
    procs.replicas.extend((1..REPLICAS).map(replica));
    for port in &ports[1..] {
        wait_healthy(&format!("https://127.0.0.1:{port}"), &ca).await;
    }

    let nginx_dir = dir.path().join("nginx");
    std::fs::create_dir_all(&nginx_dir).unwrap();
    let lb_port = free_port();
    let conf = nginx_dir.join("nginx.conf");
    let text = nginx_conf(&nginx_dir, lb_port, &ports, &data_dir.join("tls"));
    std::fs::write(&conf, text).unwrap();
    let nginx_log = File::create(nginx_dir.join("stderr.log")).unwrap();
    procs.nginx = Some(
        Command::new(&nginx_bin)
            .arg("-p")
            .arg(&nginx_dir)
            .arg("-c")
            .arg(&conf)
            .arg("-g")
            .arg(format!(
                "daemon off; pid {0}/nginx.pid; error_log {0}/error.log;",
                nginx_dir.display()
            ))
            .stdin(Stdio::null())
            .stdout(nginx_log.try_clone().unwrap())
            .stderr(nginx_log)
            .spawn()
            .expect("nginx starts"),
    );
    // From here on, everything goes through nginx.
    let base = format!("https://127.0.0.1:{lb_port}");
    let http = wait_healthy(&base, &ca).await;
    let cluster = Cluster {
        http,
        base,
        logs,
        once_file,
        store: Store::connect(&url, &data_dir).await.unwrap(),
    };

    let (csvs, _test) = write_digits_partitions(
        &dir.path().join("sites"),
        CLIENTS,
        &PartitionScheme::Dirichlet { alpha: 0.5 },
        0,
    )
    .unwrap();
    let plain = serde_json::json!({
        "name": "behind-nginx", "features": 64, "classes": 10, "model": "logreg",
        "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": 4,
        "collect_deadline_seconds": 30
    });
    let (plain_id, _) = start_experiment(&cluster, plain).await;
    let mut edge_logs = Vec::new();
    for (site, csv) in csvs.iter().enumerate() {
        let token =
            common::issue_token(&cluster.http, &cluster.base, &format!("site-{site}")).await;
        let log = dir.path().join(format!("edge-{site}.log"));
        let child = common::edge_command(
            site,
            &cluster.base,
            &ca,
            csv,
            dir.path(),
            &token,
            EDGE_IDLE_EXIT,
        )
        .stderr(File::create(&log).unwrap())
        .spawn()
        .expect("cohort edge starts");
        procs.edges.push(Some(child));
        edge_logs.push(log);
    }

    // A plain experiment: one of three replicas is killed holding a round's job, and the
    // other two finish the round and the experiment.
    let first = kill_the_next_job_holder(&cluster, &mut procs, &plain_id).await;
    let limit = Duration::from_secs(120);
    common::wait_finished(&cluster.http, &cluster.base, &plain_id, limit).await;
    // Then a secure one (SecAgg+: keys, shares and masked inputs in the database, each
    // request at any replica): a second replica is killed the same way, and the last one
    // alone takes its job over and finishes.
    let secure = serde_json::json!({
        "name": "secure-behind-nginx", "features": 64, "classes": 10, "model": "logreg",
        "rounds": ROUNDS, "clients_per_round": CLIENTS, "min_participants": 4,
        "collect_deadline_seconds": 30, "secure_aggregation": {}
    });
    let (secure_id, _) = start_experiment(&cluster, secure).await;
    let second = kill_the_next_job_holder(&cluster, &mut procs, &secure_id).await;
    common::wait_finished(&cluster.http, &cluster.base, &secure_id, limit).await;

    let mut acked = Vec::new();
    for (site, log) in edge_logs.iter().enumerate() {
        let mut child = procs.edges[site].take().unwrap();
        let status = child.wait().unwrap();
        let text = std::fs::read_to_string(log).unwrap();
        assert!(status.success(), "edge client {site} failed: {text}");
        acked.push(acknowledged(&text));
    }
    let mut listed = Vec::new();
    for id in [&plain_id, &secure_id] {
        listed.push(common::rounds(&cluster.http, &cluster.base, id).await);
    }
    let wall = started.elapsed();
    drop(procs);

    let mut takeovers = Vec::new();
    for ((id, kill), rs) in [(&plain_id, &first), (&secure_id, &second)]
        .into_iter()
        .zip(&listed)
    {
        takeovers.push(check_experiment(&cluster, &pg, &schema, id, rs, kill).await);
    }
    // The last replica standing took the second job over.
    assert_ne!(takeovers[1].actor, first.worker);

    // No upload an edge client saw acknowledged is lost.
    let store = &cluster.store;
    let clients = store.clients().await.unwrap();
    let mut checked = 0;
    for (site, acks) in acked.iter().enumerate() {
        let label = format!("site-{site}");
        let client = clients.iter().find(|c| c.label == label).unwrap().id;
        for (exp, round, attempt) in acks {
            let exp = uuid::Uuid::parse_str(exp).unwrap();
            let parts = store.participations(exp, *round, *attempt).await.unwrap();
            let mine = parts.iter().find(|p| p.client_id == client);
            assert_eq!(
                mine.map(|p| p.state),
                Some(ParticipationState::Uploaded),
                "{label}: experiment {exp} round {round} attempt {attempt}"
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 2 * ROUNDS as usize * 4,
        "only {checked} acknowledged uploads"
    );

    // nginx spread the requests over all three replicas, and failed over from the dead.
    let access = std::fs::read_to_string(nginx_dir.join("access.log")).unwrap();
    let mut served = HashMap::<String, usize>::new();
    let (mut failed_over, mut bad_gateway) = (0, 0);
    for line in access.lines() {
        // `$msec $status $request_method $uri $upstream_addr $upstream_status`, where
        // `$upstream_addr` lists every replica tried, comma-separated.
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) == Some(&"502") {
            bad_gateway += 1;
        }
        let tried: Vec<&str> = fields
            .iter()
            .skip(4)
            .take_while(|f| f.starts_with("127.0.0.1:"))
            .map(|f| f.trim_end_matches(','))
            .collect();
        if tried.len() > 1 {
            failed_over += 1;
        }
        if let Some(last) = tried.last() {
            *served.entry(last.to_string()).or_default() += 1;
        }
    }
    for port in &ports {
        let addr = format!("127.0.0.1:{port}");
        assert!(served.get(&addr).is_some_and(|&n| n > 0), "{served:?}");
    }

    for ((name, kill), takeover) in [("plain", &first), ("secure", &second)]
        .iter()
        .zip(&takeovers)
    {
        eprintln!(
            "{name}: killed replica {} ({}) holding job {} of round {}; taken over by {} \
             {} ms after the kill, {} ms after the claim (lease {} ms)",
            kill.replica,
            kill.worker,
            kill.job.id,
            kill.job.round,
            takeover.actor,
            takeover.at - kill.killed_at,
            takeover.at - (kill.lease_ends - LEASE_SECONDS * 1000),
            LEASE_SECONDS * 1000,
        );
    }
    eprintln!(
        "{ROUNDS} rounds published in each experiment, {checked} acknowledged uploads all \
         recorded; requests per replica {served:?}, {failed_over} failed over, \
         {bad_gateway} answered 502; {:.1} s",
        wall.as_secs_f64(),
    );
    if let Some(s3) = bucket {
        for d in &dirs {
            assert!(
                !d.join("blobs").exists(),
                "{}: no blob directory",
                d.display()
            );
        }
        let keys = s3.keys("replicas", "cluster/uploads/").await;
        assert!(
            keys.len() >= checked,
            "{} uploads in the bucket",
            keys.len()
        );
    }
    cluster.store.close().await;
    common::drop_schema(&pg, &schema).await;
}
