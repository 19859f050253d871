//! Helpers shared by the integration tests.
// Each test crate includes this module and uses only part of it.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The admin token the process tests give `cohort serve`.
pub const ADMIN: &str = "process-test-admin-token-0123456789abcdef";

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the real `cohort serve` binary with dev TLS on `port`, quietly.
pub fn spawn_serve(data_dir: &Path, port: u16, database_url: Option<&str>) -> Child {
    spawn_serve_with(data_dir, port, database_url, &[])
}

/// [`spawn_serve`] with extra environment variables (settings such as rate limits).
pub fn spawn_serve_with(
    data_dir: &Path,
    port: u16,
    database_url: Option<&str>,
    env: &[(&str, &str)],
) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
    command.envs(env.iter().copied());
    command
        .args(["serve", "--dev-tls", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(data_dir)
        .env("COHORT_ADMIN_TOKEN", ADMIN)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(url) = database_url {
        command.arg("--database-url").arg(url);
    }
    command.spawn().expect("cohort serve starts")
}

/// The real `cohort edge` for site `site` against the coordinator at `base` (trusting
/// `ca`), on the data `csv`, with its state in `dir/edge-state-<site>`, the enrolment
/// token in its environment, `--seed <site>`, and exiting after `idle_exit` seconds
/// without a task. The caller decides where stderr goes.
pub fn edge_command(
    site: usize,
    base: &str,
    ca: &Path,
    csv: &Path,
    dir: &Path,
    token: &str,
    idle_exit: u64,
) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
    command
        .arg("edge")
        .arg("--coordinator")
        .arg(base)
        .arg("--ca-cert")
        .arg(ca)
        .arg("--data")
        .arg(csv)
        .arg("--state-dir")
        .arg(dir.join(format!("edge-state-{site}")))
        .arg("--idle-exit")
        .arg(idle_exit.to_string())
        .arg("--seed")
        .arg(site.to_string())
        .env("COHORT_ENROL_TOKEN", token)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    command
}

/// A client that trusts only the CA in `ca`.
pub fn client(ca: &Path) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap();
    reqwest::Client::builder()
        .tls_certs_only([ca])
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Waits until the server at `base` answers its health check over TLS.
pub async fn wait_healthy(base: &str, ca: &Path) -> reqwest::Client {
    let start = Instant::now();
    loop {
        if ca.exists() {
            let http = client(ca);
            if let Ok(r) = http.get(format!("{base}/api/v1/health")).send().await
                && r.status().is_success()
            {
                return http;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "server did not come up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An admin request that must succeed; its JSON body (`null` when empty).
pub async fn admin(
    http: &reqwest::Client,
    base: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> serde_json::Value {
    let mut req = http
        .request(method, format!("{base}/api/v1/admin{path}"))
        .bearer_auth(ADMIN);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let r = req.send().await.unwrap();
    assert!(r.status().is_success(), "{path}: {}", r.status());
    r.json().await.unwrap_or(serde_json::Value::Null)
}

/// The body of an admin `GET` that must succeed (a model file, the raw model).
pub async fn admin_bytes(http: &reqwest::Client, base: &str, path: &str) -> Vec<u8> {
    let r = http
        .get(format!("{base}/api/v1/admin{path}"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{path}: {}", r.status());
    r.bytes().await.unwrap().to_vec()
}

/// Creates an experiment from `spec`; its id.
pub async fn create_experiment(
    http: &reqwest::Client,
    base: &str,
    spec: serde_json::Value,
) -> String {
    let exp = admin(
        http,
        base,
        reqwest::Method::POST,
        "/experiments",
        Some(spec),
    )
    .await;
    exp["id"].as_str().expect("an experiment id").to_string()
}

/// Issues a one-time enrolment token labelled `label`; the token.
pub async fn issue_token(http: &reqwest::Client, base: &str, label: &str) -> String {
    let path = "/enrolment-tokens";
    let body = serde_json::json!({ "label": label });
    let issued = admin(http, base, reqwest::Method::POST, path, Some(body)).await;
    issued["token"].as_str().expect("a token").to_string()
}

/// Waits until `n` clients have enrolled and checked in, so that a round can select all
/// of them, failing after `limit`.
pub async fn wait_checked_in(http: &reqwest::Client, base: &str, n: usize, limit: Duration) {
    let start = Instant::now();
    loop {
        let clients = admin(http, base, reqwest::Method::GET, "/clients", None).await;
        let seen = clients
            .as_array()
            .expect("clients are a list")
            .iter()
            .filter(|c| c["last_seen_at"].is_i64())
            .count();
        if seen >= n {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "clients did not check in: {clients}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until experiment `id` has finished, failing after `limit`.
pub async fn wait_finished(http: &reqwest::Client, base: &str, id: &str, limit: Duration) {
    let start = Instant::now();
    loop {
        let path = format!("/experiments/{id}");
        let exp = admin(http, base, reqwest::Method::GET, &path, None).await;
        if exp["state"] == "finished" {
            return;
        }
        assert!(start.elapsed() < limit, "experiment did not finish: {exp}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The rounds of experiment `id`, as the admin API lists them.
pub async fn rounds(http: &reqwest::Client, base: &str, id: &str) -> Vec<serde_json::Value> {
    let path = format!("/experiments/{id}/rounds");
    let rs = admin(http, base, reqwest::Method::GET, &path, None).await;
    rs.as_array().expect("rounds are a list").clone()
}

/// A fresh schema on the PostgreSQL of `COHORT_TEST_POSTGRES_URL`: the admin pool, the
/// schema name and a database URL scoped to it, or `None` when the variable is unset.
pub async fn postgres_schema(prefix: &str) -> Option<(sqlx::PgPool, String, String)> {
    let Ok(url) = std::env::var("COHORT_TEST_POSTGRES_URL") else {
        eprintln!("COHORT_TEST_POSTGRES_URL is not set: PostgreSQL test skipped");
        return None;
    };
    let schema = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url)
        .expect("COHORT_TEST_POSTGRES_URL parses");
    let pool = sqlx::PgPool::connect_with(options).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&pool)
        .await
        .unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    let scoped = format!("{url}{sep}options=-csearch_path%3D{schema}");
    Some((pool, schema, scoped))
}

/// Drops a schema made by [`postgres_schema`].
pub async fn drop_schema(pool: &sqlx::PgPool, schema: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// Two linearly separable blobs with 4 features, as a client's local data.
pub fn blob_data(n: usize, shift: f32) -> cohort_edge::data::Dataset {
    let labels: Vec<u32> = (0..n).map(|i| (i % 2) as u32).collect();
    let features = ndarray::Array2::from_shape_fn((n, 4), |(i, j)| {
        let centre = if labels[i] == 0 { -1.5 } else { 1.5 };
        centre + shift + ((i * 7 + j * 3) % 11) as f32 * 0.05
    });
    cohort_edge::data::Dataset {
        features,
        labels,
        classes: vec!["0".into(), "1".into()],
        feature_names: (0..4).map(|j| format!("x{j}")).collect(),
        groups: None,
    }
}

/// The repository's root.
pub fn repo() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The directory holding the freshest `libcohort_edge.so` this build made (cargo builds
/// the library's C form alongside its Rust form).
pub fn edge_library() -> std::path::PathBuf {
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_cohort"));
    let profile = exe.parent().unwrap().to_path_buf();
    let mut found: Vec<(std::time::SystemTime, std::path::PathBuf)> = Vec::new();
    for dir in [profile.clone(), profile.join("deps")] {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("libcohort_edge") && name.ends_with(".so") {
                let modified = entry.metadata().unwrap().modified().unwrap();
                found.push((modified, entry.path()));
            }
        }
    }
    found.sort();
    let (_, newest) = found
        .pop()
        .expect("the build made libcohort_edge.so (crate-type cdylib)");
    newest
}

/// Compiles the C program `tests/c/<name>.c` against the edge library and its header
/// into `dir/<name>`; its path. The library is copied to `dir/lib`, for
/// `LD_LIBRARY_PATH`.
pub fn compile_c_app(dir: &Path, name: &str) -> std::path::PathBuf {
    let library = edge_library();
    // Link against a copy with the plain name, whichever file cargo left.
    let libdir = dir.join("lib");
    std::fs::create_dir_all(&libdir).unwrap();
    std::fs::copy(&library, libdir.join("libcohort_edge.so")).unwrap();
    let out = dir.join(name);
    let status = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g"])
        .arg("-I")
        .arg(repo().join("edge-client/include"))
        .arg(repo().join(format!("tests/c/{name}.c")))
        .arg("-L")
        .arg(&libdir)
        .args(["-lcohort_edge", "-lm", "-o"])
        .arg(&out)
        .status()
        .expect("a C compiler (cc) is installed");
    assert!(status.success(), "the C program {name} compiles");
    out
}

/// Whether valgrind is installed; panics when `COHORT_REQUIRE_VALGRIND` is set (CI) and
/// it is not.
pub fn valgrind_available() -> bool {
    let found = Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("COHORT_REQUIRE_VALGRIND").is_none(),
            "COHORT_REQUIRE_VALGRIND is set but valgrind is not installed"
        );
    }
    found
}

/// `valgrind` with the tests' settings (leaks checked, any error exits 99, the known
/// false positives of ring's assembly suppressed), its report in `log`; the caller adds
/// the program and its arguments.
pub fn valgrind_command(log: &Path) -> Command {
    let mut c = Command::new("valgrind");
    c.args([
        "--leak-check=full",
        "--errors-for-leak-kinds=definite",
        "--error-exitcode=99",
    ])
    .arg(format!(
        "--suppressions={}",
        repo().join("tests/c/valgrind.supp").display()
    ))
    .arg(format!("--log-file={}", log.display()));
    c
}

/// A child process killed (and reaped) when dropped, so that a test that fails half-way
/// leaves no coordinator or client running behind it.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `cohort serve` child on SQLite in its own data directory, killed when dropped.
pub struct Served {
    pub child: std::process::Child,
    pub base: String,
    pub http: reqwest::Client,
    pub ca: std::path::PathBuf,
    pub ca_pem: Vec<u8>,
    pub data_dir: std::path::PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `cohort serve` under `dir/coordinator` and waits until it answers over TLS.
pub async fn serve_in(dir: &Path) -> Served {
    serve_in_with(dir, &[]).await
}

/// [`serve_in`] with extra environment variables (settings).
pub async fn serve_in_with(dir: &Path, env: &[(&str, &str)]) -> Served {
    cohort_coordinator::server::install_crypto_provider();
    let data_dir = dir.join("coordinator");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let child = spawn_serve_with(&data_dir, port, None, env);
    let ca = data_dir.join("tls/ca.pem");
    let http = wait_healthy(&base, &ca).await;
    Served {
        child,
        base,
        http,
        ca_pem: std::fs::read(&ca).unwrap(),
        ca,
        data_dir,
    }
}

/// An in-process edge agent's settings for `server`: state in `dir`, enrolling with
/// `token`, training with `trainer`, seeded with `seed`, idle out after `idle` seconds.
pub fn agent_config(
    server: &Served,
    dir: &Path,
    token: String,
    trainer: cohort_edge::trainer::SharedTrainer,
    seed: u64,
    idle: Duration,
) -> cohort_edge::agent::AgentConfig {
    cohort_edge::agent::AgentConfig {
        coordinator: server.base.clone(),
        insecure_http: false,
        ca_pem: Some(server.ca_pem.clone()),
        identity_pem: None,
        enrol_token: Some(token),
        trainer,
        state_dir: dir.to_path_buf(),
        idle_exit: Some(idle),
        seed,
        local_dp: None,
        slowdown: Duration::ZERO,
        floors: cohort_aggregation::secagg::ClientFloors::default(),
        rules: Default::default(),
    }
}

/// moto's S3-compatible server: `moto_server` of the virtual environment
/// `COHORT_MOTO_VENV` names, else on the PATH; `None` (the test skips) without it,
/// unless `COHORT_REQUIRE_MOTO` is set.
pub fn moto_server() -> Option<std::path::PathBuf> {
    let candidate = std::env::var_os("COHORT_MOTO_VENV")
        .map(|v| std::path::PathBuf::from(v).join("bin/moto_server"))
        .unwrap_or_else(|| std::path::PathBuf::from("moto_server"));
    let found = Command::new(&candidate)
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("COHORT_REQUIRE_MOTO").is_none(),
            "COHORT_REQUIRE_MOTO is set but {} does not run",
            candidate.display()
        );
        eprintln!("skipped: moto's server is not installed (pip install 'moto[server]')");
    }
    found.then_some(candidate)
}

/// An S3-compatible server on a free loopback port, stopped when dropped.
pub struct S3 {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3 {
    /// Starts `server` on a free port and waits until it answers.
    pub async fn start(server: &Path) -> Self {
        cohort_coordinator::server::install_crypto_provider();
        let port = free_port();
        let child = Command::new(server)
            .args(["-H", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto_server starts");
        let endpoint = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while http.get(&endpoint).send().await.is_err() {
            assert!(Instant::now() < deadline, "moto_server did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self { child, endpoint }
    }

    /// moto's server started with `bucket` created; `None` (the caller skips) where moto
    /// is not installed, as [`moto_server`] says.
    pub async fn with_bucket(bucket: &str) -> Option<Self> {
        let s3 = Self::start(&moto_server()?).await;
        s3.bucket(bucket).await;
        Some(s3)
    }

    /// Creates `bucket` (moto takes an unsigned request).
    pub async fn bucket(&self, bucket: &str) {
        let r = reqwest::Client::new()
            .put(format!("{}/{bucket}", self.endpoint))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }

    /// The keys under `prefix` in `bucket`.
    pub async fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let text = reqwest::Client::new()
            .get(format!(
                "{}/{bucket}?list-type=2&prefix={prefix}&max-keys=1000",
                self.endpoint
            ))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.split("<Key>")
            .skip(1)
            .map(|rest| rest.split("</Key>").next().unwrap().to_string())
            .collect()
    }

    /// The variables `object_store` (and so `cohort serve`) reads for this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", "cohort".into()),
            ("AWS_SECRET_ACCESS_KEY", "cohort-secret".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }
}
