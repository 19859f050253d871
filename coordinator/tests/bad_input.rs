//! Bad input, one case per test: each is answered with the right status and JSON error
//! code, and leaves the database (every row of every table) and the blob directory
//! exactly as they were. Every case runs against SQLite, and against PostgreSQL (in a
//! schema of its own) when `COHORT_TEST_POSTGRES_URL` is set.
//!
//! The servers are real: `cohort serve`'s prepared server on `127.0.0.1:0` with dev TLS,
//! spoken to over HTTPS by a client that trusts only the generated CA.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use cohort_coordinator::server::error::ErrorBody;
use cohort_coordinator::server::{ServeError, ServeFlags, ServeSettings, prepare};
use reqwest::{Method, StatusCode};
use sqlx::postgres::PgConnectOptions;
use sqlx::sqlite::SqliteConnectOptions;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Small, so the oversize case sends little; a tiny model's update (40 bytes) fits.
const BODY_LIMIT: usize = 1024;

/// Which database a test server runs on.
#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Postgres,
}

/// A read-only view of the server's database, for snapshots.
enum Db {
    Sqlite(sqlx::SqlitePool),
    Postgres {
        pool: sqlx::PgPool,
        admin: sqlx::PgPool,
        schema: String,
    },
}

/// Every row of every table, as text, sorted per table.
type Snapshot = BTreeMap<String, Vec<String>>;

impl Db {
    async fn snapshot(&self) -> Snapshot {
        let mut out = BTreeMap::new();
        match self {
            Db::Sqlite(pool) => {
                let tables: Vec<(String,)> = sqlx::query_as(
                    "SELECT name FROM sqlite_master WHERE type = 'table' \
                     AND name NOT LIKE 'sqlite_%' ORDER BY name",
                )
                .fetch_all(pool)
                .await
                .unwrap();
                for (table,) in tables {
                    let columns: Vec<(String,)> =
                        sqlx::query_as("SELECT name FROM pragma_table_info($1) ORDER BY cid")
                            .bind(&table)
                            .fetch_all(pool)
                            .await
                            .unwrap();
                    // quote() renders any SQLite value, NULL and blobs included, as text.
                    let row = columns
                        .iter()
                        .map(|(c,)| format!("quote(\"{c}\")"))
                        .collect::<Vec<_>>()
                        .join(" || '|' || ");
                    let sql = format!("SELECT {row} FROM \"{table}\"");
                    let mut rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                        .fetch_all(pool)
                        .await
                        .unwrap();
                    rows.sort();
                    out.insert(table, rows);
                }
            }
            Db::Postgres { pool, .. } => {
                let tables: Vec<(String,)> = sqlx::query_as(
                    "SELECT table_name::text FROM information_schema.tables \
                     WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' \
                     ORDER BY 1",
                )
                .fetch_all(pool)
                .await
                .unwrap();
                assert!(!tables.is_empty(), "the test schema has the tables");
                for (table,) in tables {
                    let sql = format!("SELECT row_to_json(t)::text FROM \"{table}\" t");
                    let mut rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                        .fetch_all(pool)
                        .await
                        .unwrap();
                    rows.sort();
                    out.insert(table, rows);
                }
            }
        }
        out
    }

    async fn finish(self) {
        match self {
            Db::Sqlite(pool) => pool.close().await,
            Db::Postgres {
                pool,
                admin,
                schema,
            } => {
                pool.close().await;
                let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
                sqlx::query(sqlx::AssertSqlSafe(drop))
                    .execute(&admin)
                    .await
                    .unwrap();
                admin.close().await;
            }
        }
    }
}

/// Every blob on disk with its size.
fn blob_listing(root: &Path) -> Vec<(PathBuf, u64)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(PathBuf, u64)>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let entry = entry.unwrap();
            let path = entry.path();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                walk(&path, root, out);
            } else {
                out.push((path.strip_prefix(root).unwrap().to_path_buf(), meta.len()));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// What a test compares before and after a refused request.
#[derive(Debug, PartialEq)]
struct State {
    rows: Snapshot,
    blobs: Vec<(PathBuf, u64)>,
}

struct Harness {
    base: String,
    client: reqwest::Client,
    token: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
    db: Option<Db>,
    dir: tempfile::TempDir,
}

impl Harness {
    /// A dev-TLS server on a fresh database of `backend`, or `None` when PostgreSQL is
    /// asked for and not configured.
    async fn start(backend: Backend) -> Option<Self> {
        cohort_coordinator::server::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let (database_url, db) = match backend {
            Backend::Sqlite => {
                let url = "sqlite://cohort.db".to_string();
                (url, None)
            }
            Backend::Postgres => {
                let Ok(url) = std::env::var("COHORT_TEST_POSTGRES_URL") else {
                    eprintln!("COHORT_TEST_POSTGRES_URL is not set: PostgreSQL case skipped");
                    return None;
                };
                let schema = format!("cohort_bad_{}", uuid::Uuid::new_v4().simple());
                let options = PgConnectOptions::from_str(&url).unwrap();
                let admin = sqlx::PgPool::connect_with(options.clone()).await.unwrap();
                let create = format!("CREATE SCHEMA \"{schema}\"");
                sqlx::query(sqlx::AssertSqlSafe(create))
                    .execute(&admin)
                    .await
                    .unwrap();
                let pool =
                    sqlx::PgPool::connect_with(options.options([("search_path", schema.as_str())]))
                        .await
                        .unwrap();
                let sep = if url.contains('?') { '&' } else { '?' };
                let scoped = format!("{url}{sep}options=-csearch_path%3D{schema}");
                (
                    scoped,
                    Some(Db::Postgres {
                        pool,
                        admin,
                        schema,
                    }),
                )
            }
        };
        let settings = ServeSettings::from_sources(
            None,
            &HashMap::new(),
            ServeFlags {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                data_dir: Some(dir.path().to_path_buf()),
                database_url: Some(database_url),
                dev_tls: true,
                max_body_bytes: Some(BODY_LIMIT),
                ..ServeFlags::default()
            },
        )
        .expect("test settings are valid");
        let prepared = prepare(settings).await.expect("server prepares");
        let token = prepared
            .generated_admin_token
            .as_ref()
            .expect("first start generates a token")
            .expose()
            .to_string();
        let ca = std::fs::read(prepared.dev_ca_cert.as_ref().unwrap()).unwrap();
        let client = reqwest::Client::builder()
            .tls_certs_only([reqwest::Certificate::from_pem(&ca).unwrap()])
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        let base = prepared.base_url();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            prepared
                .serve(async move {
                    let _ = stopped.await;
                })
                .await
        });
        let db = match db {
            Some(db) => db,
            None => {
                // The server created the file and applied its migrations in prepare().
                let options = SqliteConnectOptions::new()
                    .filename(dir.path().join("cohort.db"))
                    .read_only(true);
                Db::Sqlite(sqlx::SqlitePool::connect_with(options).await.unwrap())
            }
        };
        Some(Self {
            base,
            client,
            token,
            stop: Some(stop),
            task,
            db: Some(db),
            dir,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn state(&self) -> State {
        State {
            rows: self.db.as_ref().unwrap().snapshot().await,
            blobs: blob_listing(&self.dir.path().join("blobs")),
        }
    }

    /// Sends `request`, checks its status and error code, and checks that it changed
    /// nothing.
    async fn refused(&self, request: reqwest::RequestBuilder, status: StatusCode, code: &str) {
        let before = self.state().await;
        let response = request.send().await.expect("request reaches the server");
        assert_eq!(response.status(), status, "expected {code}");
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert!(
            content_type.starts_with("application/json"),
            "content type {content_type}"
        );
        let text = response.text().await.unwrap();
        let body: ErrorBody = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("not the error shape ({e}): {text}"));
        assert_eq!(body.error.code, code, "{}", body.error.message);
        assert!(!body.error.message.is_empty());
        let after = self.state().await;
        assert!(
            before == after,
            "the refused request changed the database or the blobs:\nbefore {before:#?}\nafter {after:#?}"
        );
    }

    fn admin(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, self.url(&format!("/api/v1/admin{path}")))
            .bearer_auth(&self.token)
    }

    async fn issue_token(&self) -> String {
        let r = self
            .admin(Method::POST, "/enrolment-tokens")
            .json(&serde_json::json!({"label": "site"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        let body: serde_json::Value = r.json().await.unwrap();
        body["token"].as_str().unwrap().to_string()
    }

    fn enrol(&self, body: &serde_json::Value) -> reqwest::RequestBuilder {
        self.client
            .post(self.url("/api/v1/clients/enrol"))
            .json(body)
    }

    /// Enrols a client and returns its credential `<id>.<secret>`.
    async fn enrolled(&self) -> String {
        let token = self.issue_token().await;
        let r = self
            .enrol(&serde_json::json!({"token": token}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        let body: serde_json::Value = r.json().await.unwrap();
        format!(
            "{}.{}",
            body["client_id"].as_str().unwrap(),
            body["secret"].as_str().unwrap()
        )
    }

    async fn checkin(&self, credential: &str, wait: u64) -> serde_json::Value {
        let r = self
            .client
            .post(self.url("/api/v1/clients/checkin"))
            .bearer_auth(credential)
            .json(&serde_json::json!({"wait_seconds": wait}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        r.json().await.unwrap()
    }

    async fn task_of(&self, credential: &str) -> Task {
        for _ in 0..10 {
            let reply = self.checkin(credential, 3).await;
            if !reply["task"].is_null() {
                let t = &reply["task"];
                return Task {
                    experiment: t["experiment_id"].as_str().unwrap().to_string(),
                    round: t["round"].as_i64().unwrap(),
                    attempt: t["attempt"].as_i64().unwrap(),
                };
            }
        }
        panic!("no task was handed out");
    }

    /// A running one-round experiment of a 10-parameter model with clients `a` and `b`
    /// selected, and `outsider` enrolled but never available (so never selected).
    async fn collecting(&self, quorum: usize, deadline_seconds: u64) -> Round {
        let a = self.enrolled().await;
        let b = self.enrolled().await;
        let outsider = self.enrolled().await;
        self.checkin(&a, 0).await;
        self.checkin(&b, 0).await;
        let spec = serde_json::json!({
            "name": "tiny", "features": 4, "classes": 2, "model": "logreg", "rounds": 1,
            "clients_per_round": 2, "min_participants": quorum,
            "collect_deadline_seconds": deadline_seconds
        });
        let r = self
            .admin(Method::POST, "/experiments")
            .json(&spec)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        let exp: serde_json::Value = r.json().await.unwrap();
        let id = exp["id"].as_str().unwrap();
        let r = self
            .admin(Method::POST, &format!("/experiments/{id}/start"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let task = self.task_of(&a).await;
        assert_eq!(self.task_of(&b).await, task);
        Round {
            a,
            b,
            outsider,
            task,
        }
    }

    /// An upload request, with the credential if one is given.
    fn upload(
        &self,
        credential: Option<&str>,
        task: &Task,
        body: Vec<u8>,
    ) -> reqwest::RequestBuilder {
        let path = format!(
            "/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/update?num_samples=3&train_loss=0.5",
            task.experiment, task.round, task.attempt
        );
        let mut req = self
            .client
            .post(self.url(&path))
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body);
        if let Some(credential) = credential {
            req = req.bearer_auth(credential);
        }
        req
    }

    async fn upload_ok(&self, credential: &str, task: &Task) {
        let r = self
            .upload(Some(credential), task, floats(&[1.0; 10]))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            StatusCode::CREATED,
            "{}",
            r.text().await.unwrap()
        );
    }

    async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(20), &mut self.task)
            .await
            .expect("server stops within the grace period")
            .expect("server task does not panic")
            .expect("server ran without error");
        self.db.take().unwrap().finish().await;
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Task {
    experiment: String,
    round: i64,
    attempt: i64,
}

struct Round {
    a: String,
    b: String,
    outsider: String,
    task: Task,
}

fn floats(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes each case once and runs it on both backends.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let h = super::Harness::start(super::Backend::Sqlite).await.unwrap();
                    super::$name(&h).await;
                    h.finish().await;
                }
            )*
        }
        mod postgres_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(h) = super::Harness::start(super::Backend::Postgres).await else {
                        return;
                    };
                    super::$name(&h).await;
                    h.finish().await;
                }
            )*
        }
    };
}

on_both_backends!(
    malformed_json_is_400_and_enrols_nobody,
    unknown_field_is_422_and_creates_no_experiment,
    update_of_the_wrong_dimension_is_422,
    non_finite_update_is_422,
    update_not_sent_as_octets_is_415,
    body_over_the_limit_is_413,
    chunked_body_over_the_limit_is_413,
    chunked_update_with_a_non_finite_value_is_422,
    upload_from_a_client_not_selected_is_409,
    upload_for_a_round_that_does_not_exist_is_404,
    upload_after_collection_closed_is_409,
    replayed_upload_is_409,
    a_retried_upload_with_its_upload_id_is_recognised_not_counted_again,
    missing_credential_is_401,
    wrong_credential_is_401,
    revoked_client_is_403,
    used_enrolment_token_is_401,
    secure_keys_that_are_not_valid_x25519_keys_are_422,
    secure_message_for_another_stage_is_409,
    secure_replayed_message_is_409_already_sent,
    secure_message_from_a_client_not_selected_is_409,
    secure_shares_for_the_wrong_neighbours_are_422,
    secure_masked_input_of_the_wrong_length_or_with_a_weight_is_422,
    secure_masked_input_from_a_client_that_did_not_share_is_409,
    secure_unmask_with_shares_it_does_not_hold_is_422,
    secure_unmask_with_a_forged_share_is_422_and_excludes_its_sender,
);

/// A running secure experiment (SecAgg+, 3 clients, full graph, threshold 2) with all
/// three clients selected, each with its protocol session, plus an outsider.
struct SecureRound {
    clients: Vec<(String, cohort_aggregation::secagg::ClientSession)>,
    /// Each client's registered identity, in the order of `clients`.
    identities: Vec<cohort_aggregation::secagg::Identity>,
    outsider: String,
    task: Task,
}

impl Harness {
    async fn secure_round(&self) -> SecureRound {
        use cohort_aggregation::secagg::{ClientSession, RoundConfig};
        let credentials = [
            self.enrolled().await,
            self.enrolled().await,
            self.enrolled().await,
        ];
        let outsider = self.enrolled().await;
        for c in &credentials {
            self.checkin(c, 0).await;
        }
        let spec = serde_json::json!({
            "name": "secure", "features": 4, "classes": 2, "model": "logreg", "rounds": 1,
            "clients_per_round": 3, "min_participants": 2, "collect_deadline_seconds": 60,
            "secure_aggregation": {"threshold": 2, "neighbours": 2, "advertise_seconds": 60,
                                   "share_seconds": 60, "unmask_seconds": 60}
        });
        let r = self
            .admin(Method::POST, "/experiments")
            .json(&spec)
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            StatusCode::CREATED,
            "{}",
            r.text().await.unwrap()
        );
        let exp: serde_json::Value = r.json().await.unwrap();
        let id = exp["id"].as_str().unwrap().to_string();
        let r = self
            .admin(Method::POST, &format!("/experiments/{id}/start"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let mut clients = Vec::new();
        let mut identities = Vec::new();
        let mut task = None;
        for c in credentials {
            let identity = cohort_aggregation::secagg::Identity::generate().unwrap();
            self.register_identity(&c, &identity).await;
            let mut reply = serde_json::Value::Null;
            for _ in 0..10 {
                reply = self.checkin(&c, 3).await;
                if !reply["task"].is_null() {
                    break;
                }
            }
            let t = &reply["task"];
            let secure = &t["secure_aggregation"];
            let config: RoundConfig = serde_json::from_value(secure["config"].clone()).unwrap();
            let index = secure["index"].as_u64().unwrap() as u32;
            let (session, _) =
                ClientSession::new(config, index, &identity, &mut rand::rng()).unwrap();
            identities.push(identity);
            task = Some(Task {
                experiment: t["experiment_id"].as_str().unwrap().to_string(),
                round: t["round"].as_i64().unwrap(),
                attempt: t["attempt"].as_i64().unwrap(),
            });
            clients.push((c, session));
        }
        SecureRound {
            clients,
            identities,
            outsider,
            task: task.unwrap(),
        }
    }

    /// Registers `identity` as the client's, as an edge client does at start.
    async fn register_identity(
        &self,
        credential: &str,
        identity: &cohort_aggregation::secagg::Identity,
    ) {
        use base64::Engine;
        let public = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(identity.public());
        let r = self
            .client
            .put(self.url("/api/v1/clients/me/identity"))
            .bearer_auth(credential)
            .json(&serde_json::json!({ "identity": public }))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    }

    fn secagg(&self, credential: &str, task: &Task, what: &str) -> reqwest::RequestBuilder {
        self.client
            .post(self.url(&format!(
                "/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/secagg/{what}",
                task.experiment, task.round, task.attempt
            )))
            .bearer_auth(credential)
    }

    async fn secagg_get(&self, credential: &str, task: &Task, what: &str) -> serde_json::Value {
        let r = self
            .client
            .get(self.url(&format!(
                "/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/secagg/{what}?wait_seconds=10",
                task.experiment, task.round, task.attempt
            )))
            .bearer_auth(credential)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        r.json().await.unwrap()
    }

    async fn accepted(&self, request: reqwest::RequestBuilder) {
        let r = request.send().await.unwrap();
        assert_eq!(
            r.status(),
            StatusCode::CREATED,
            "{}",
            r.text().await.unwrap()
        );
    }

    /// Fresh key pairs for every client of `round`, advertised, and every graph nonce
    /// revealed; returns when the directory is out.
    async fn advertise_all(
        &self,
        round: &mut SecureRound,
    ) -> cohort_aggregation::secagg::KeyDirectory {
        use cohort_aggregation::secagg::ClientSession;
        for ((c, session), identity) in round.clients.iter_mut().zip(&round.identities) {
            let (fresh, keys) = ClientSession::new(
                session.config().clone(),
                session.index(),
                identity,
                &mut rand::rng(),
            )
            .unwrap();
            *session = fresh;
            self.accepted(self.secagg(c, &round.task, "keys").json(&keys))
                .await;
        }
        for (c, session) in round.clients.iter_mut() {
            let reply = self.secagg_get(c, &round.task, "roster").await;
            let roster =
                serde_json::from_value(reply["roster"].clone()).expect("advertising closed");
            let reveal = session.reveal(&roster).unwrap();
            self.accepted(self.secagg(c, &round.task, "reveal").json(&reveal))
                .await;
        }
        let reply = self
            .secagg_get(&round.clients[0].0, &round.task, "keys")
            .await;
        serde_json::from_value(reply["directory"].clone()).expect("revealing closed")
    }

    /// Every survivor of a masked round signs the survivor list; returns each client's
    /// unmask request (the list with its neighbours' signatures).
    async fn confirm_all(
        &self,
        round: &mut SecureRound,
    ) -> Vec<cohort_aggregation::secagg::UnmaskRequest> {
        for ((c, session), identity) in round.clients.iter_mut().zip(&round.identities) {
            let reply = self.secagg_get(c, &round.task, "survivors").await;
            let request = serde_json::from_value(reply["request"].clone()).unwrap();
            let confirmation = session.confirm(&request, identity).unwrap();
            self.accepted(self.secagg(c, &round.task, "confirm").json(&confirmation))
                .await;
        }
        let mut requests = Vec::new();
        for (c, _) in &round.clients {
            let reply = self.secagg_get(c, &round.task, "unmask").await;
            requests.push(serde_json::from_value(reply["request"].clone()).expect("confirmed"));
        }
        requests
    }

    /// Advertises and shares for every client; returns when sharing has closed.
    async fn share_all(&self, round: &mut SecureRound) {
        let directory = self.advertise_all(round).await;
        for (c, session) in round.clients.iter_mut() {
            let shares = session.share_keys(&directory, &mut rand::rng()).unwrap();
            self.accepted(self.secagg(c, &round.task, "shares").json(&shares))
                .await;
        }
        let reply = self
            .secagg_get(&round.clients[0].0, &round.task, "shares")
            .await;
        assert!(!reply["shares"].is_null(), "sharing closed: {reply}");
    }

    /// Runs the round to unmasking: every client shares and uploads its masked input.
    async fn mask_all(&self, round: &mut SecureRound) {
        self.share_all(round).await;
        for (c, session) in round.clients.iter_mut() {
            let reply = self.secagg_get(c, &round.task, "shares").await;
            let forwarded = serde_json::from_value(reply["shares"].clone()).unwrap();
            let masked = session
                .mask(&forwarded, &[0.5; 10], 5, 0.1, &mut rand::rng())
                .unwrap();
            self.accepted(self.masked_upload(c, &round.task, &masked, ""))
                .await;
        }
        let reply = self
            .secagg_get(&round.clients[0].0, &round.task, "survivors")
            .await;
        assert!(!reply["request"].is_null(), "collection closed: {reply}");
    }

    fn masked_upload(
        &self,
        credential: &str,
        task: &Task,
        words: &[u32],
        query: &str,
    ) -> reqwest::RequestBuilder {
        self.client
            .post(self.url(&format!(
                "/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/update{query}",
                task.experiment, task.round, task.attempt
            )))
            .bearer_auth(credential)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(cohort_aggregation::secagg::messages::encode_words(words))
    }
}

async fn secure_keys_that_are_not_valid_x25519_keys_are_422(h: &Harness) {
    let round = h.secure_round().await;
    let (c, _) = &round.clients[0];
    // 31 bytes is not a key.
    let short = serde_json::json!({"cipher_pk": "AQ", "mask_pk": "AQ"});
    h.refused(
        h.secagg(c, &round.task, "keys").json(&short),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_body",
    )
    .await;
    // The all-zero point has low order: every agreement with it is public. Signed by
    // the client itself, so only the key check can refuse it.
    let (_, session) = &round.clients[0];
    let config = session.config();
    let zeros = [0u8; 32];
    let sign = |cipher: &[u8; 32], mask: &[u8; 32]| {
        let statement = config.advertise_statement(session.index(), cipher, mask, &[7; 32]);
        cohort_aggregation::secagg::AdvertiseKeys {
            cipher_pk: *cipher,
            mask_pk: *mask,
            graph_commitment: [7; 32],
            signature: round.identities[0].sign(&statement),
        }
    };
    h.refused(
        h.secagg(c, &round.task, "keys").json(&sign(&zeros, &zeros)),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_message",
    )
    .await;
    // Keys signed by another identity than the client's registered one (a coordinator
    // substituting keys could only do this) are refused too.
    let mut forged = sign(&[9; 32], &[9; 32]);
    forged.signature = cohort_aggregation::secagg::Identity::generate()
        .unwrap()
        .sign(&config.advertise_statement(session.index(), &[9; 32], &[9; 32], &[7; 32]));
    let r = h
        .secagg(c, &round.task, "keys")
        .json(&forged)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = r.text().await.unwrap();
    assert!(body.contains("does not verify"), "{body}");
}

async fn secure_message_for_another_stage_is_409(h: &Harness) {
    let round = h.secure_round().await;
    let (c, _) = &round.clients[0];
    let shares = serde_json::json!({"seed_commitment": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "shares": []});
    h.refused(
        h.secagg(c, &round.task, "shares").json(&shares),
        StatusCode::CONFLICT,
        "conflict",
    )
    .await;
    let unmask = serde_json::json!({"seed_shares": [], "key_shares": []});
    h.refused(
        h.secagg(c, &round.task, "unmask").json(&unmask),
        StatusCode::CONFLICT,
        "conflict",
    )
    .await;
    // A masked input before collection.
    h.refused(
        h.masked_upload(c, &round.task, &[0; 12], ""),
        StatusCode::CONFLICT,
        "round_not_collecting",
    )
    .await;
}

async fn secure_replayed_message_is_409_already_sent(h: &Harness) {
    use cohort_aggregation::secagg::ClientSession;
    let round = h.secure_round().await;
    let (c, session) = &round.clients[0];
    let identity = &round.identities[0];
    let (_, keys) = ClientSession::new(
        session.config().clone(),
        session.index(),
        identity,
        &mut rand::rng(),
    )
    .unwrap();
    h.accepted(h.secagg(c, &round.task, "keys").json(&keys))
        .await;
    for replay in [
        keys.clone(),
        ClientSession::new(
            session.config().clone(),
            session.index(),
            identity,
            &mut rand::rng(),
        )
        .unwrap()
        .1,
    ] {
        h.refused(
            h.secagg(c, &round.task, "keys").json(&replay),
            StatusCode::CONFLICT,
            "already_sent",
        )
        .await;
    }
}

async fn secure_message_from_a_client_not_selected_is_409(h: &Harness) {
    use cohort_aggregation::secagg::ClientSession;
    let round = h.secure_round().await;
    let (_, session) = &round.clients[0];
    let (_, keys) = ClientSession::new(
        session.config().clone(),
        session.index(),
        &round.identities[0],
        &mut rand::rng(),
    )
    .unwrap();
    h.refused(
        h.secagg(&round.outsider, &round.task, "keys").json(&keys),
        StatusCode::CONFLICT,
        "conflict",
    )
    .await;
    let r = h
        .client
        .get(h.url(&format!(
            "/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/secagg/keys",
            round.task.experiment, round.task.round, round.task.attempt
        )))
        .bearer_auth(&round.outsider);
    h.refused(r, StatusCode::CONFLICT, "conflict").await;
}

async fn secure_shares_for_the_wrong_neighbours_are_422(h: &Harness) {
    let mut round = h.secure_round().await;
    let directory = h.advertise_all(&mut round).await;
    let (c, session) = &mut round.clients[0];
    let good = session.share_keys(&directory, &mut rand::rng()).unwrap();
    let mut missing = good.clone();
    missing.shares.pop();
    h.refused(
        h.secagg(c, &round.task, "shares").json(&missing),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_message",
    )
    .await;
    let mut to_self = good.clone();
    to_self.shares[0].to = session.index();
    h.refused(
        h.secagg(c, &round.task, "shares").json(&to_self),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_message",
    )
    .await;
    let mut short = good.clone();
    short.shares[0].ciphertext.truncate(10);
    h.refused(
        h.secagg(c, &round.task, "shares").json(&short),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_message",
    )
    .await;
    h.accepted(h.secagg(c, &round.task, "shares").json(&good))
        .await;
}

async fn secure_masked_input_of_the_wrong_length_or_with_a_weight_is_422(h: &Harness) {
    let mut round = h.secure_round().await;
    h.share_all(&mut round).await;
    let (c, _) = &round.clients[0];
    // A logreg of 4 features and 2 classes has 10 parameters: 12 words with the weight
    // and the loss.
    for words in [vec![7u32; 11], vec![7u32; 13], vec![]] {
        h.refused(
            h.masked_upload(c, &round.task, &words, ""),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_update",
        )
        .await;
    }
    h.refused(
        h.masked_upload(c, &round.task, &[7u32; 12], "?num_samples=5"),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_query",
    )
    .await;
    h.refused(
        h.masked_upload(c, &round.task, &[7u32; 12], "?train_loss=0.5"),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_query",
    )
    .await;
}

async fn secure_masked_input_from_a_client_that_did_not_share_is_409(h: &Harness) {
    let mut round = h.secure_round().await;
    let directory = h.advertise_all(&mut round).await;
    // A selected client that has not shared yet cannot upload while the round shares,
    // and once collection is open a client that never shared (here: one never
    // selected) cannot add a masked input.
    let (c0, _) = &round.clients[0];
    h.refused(
        h.masked_upload(c0, &round.task, &[7u32; 12], ""),
        StatusCode::CONFLICT,
        "round_not_collecting",
    )
    .await;
    for (c, session) in round.clients.iter_mut() {
        let shares = session.share_keys(&directory, &mut rand::rng()).unwrap();
        h.accepted(h.secagg(c, &round.task, "shares").json(&shares))
            .await;
    }
    h.secagg_get(&round.clients[0].0, &round.task, "shares")
        .await;
    h.refused(
        h.masked_upload(&round.outsider, &round.task, &[7u32; 12], ""),
        StatusCode::CONFLICT,
        "not_selected",
    )
    .await;
}

async fn secure_unmask_with_shares_it_does_not_hold_is_422(h: &Harness) {
    let mut round = h.secure_round().await;
    h.mask_all(&mut round).await;
    let requests = h.confirm_all(&mut round).await;
    let mut answers = Vec::new();
    for ((_, session), request) in round.clients.iter_mut().zip(&requests) {
        answers.push(session.unmask(request).unwrap());
    }
    // Client 0 passes off client 1's shares as its own.
    let (c0, _) = &round.clients[0];
    h.refused(
        h.secagg(c0, &round.task, "unmask").json(&answers[1]),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_message",
    )
    .await;
    // A survivor's key share (the wrong kind) is refused too.
    let mut wrong_kind = answers[0].clone();
    wrong_kind.key_shares = wrong_kind.seed_shares.clone();
    wrong_kind.seed_shares.clear();
    h.refused(
        h.secagg(c0, &round.task, "unmask").json(&wrong_kind),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_message",
    )
    .await;
    h.accepted(h.secagg(c0, &round.task, "unmask").json(&answers[0]))
        .await;
}

/// Finding 5 of the security review: a forged share is refused as `forged_share`
/// naming its sender (not the share's owner), kept as evidence, and its sender is
/// excluded from the round's unmasking: not even its honest answer is taken after it.
async fn secure_unmask_with_a_forged_share_is_422_and_excludes_its_sender(h: &Harness) {
    let mut round = h.secure_round().await;
    h.mask_all(&mut round).await;
    let requests = h.confirm_all(&mut round).await;
    let (c0, session) = &mut round.clients[0];
    let honest = session.unmask(&requests[0]).unwrap();
    let mut forged = honest.clone();
    let share = &mut forged.seed_shares[0];
    share.share[20] ^= 0x10;
    let owner = share.owner;
    let r = h
        .secagg(c0, &round.task, "unmask")
        .json(&forged)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "forged_share", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("of client {owner}'s secret")),
        "{message}"
    );
    h.refused(
        h.secagg(c0, &round.task, "unmask").json(&honest),
        StatusCode::CONFLICT,
        "excluded",
    )
    .await;
}

async fn malformed_json_is_400_and_enrols_nobody(h: &Harness) {
    let token = h.issue_token().await;
    for broken in ["{\"token\": ", "{\"token\": \"x\",}", "{\"token\" \"x\"}"] {
        h.refused(
            h.client
                .post(h.url("/api/v1/clients/enrol"))
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(broken),
            StatusCode::BAD_REQUEST,
            "malformed_json",
        )
        .await;
    }
    // The token was not spent by the refused attempts.
    let ok = h
        .enrol(&serde_json::json!({"token": token}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::CREATED);
}

async fn unknown_field_is_422_and_creates_no_experiment(h: &Harness) {
    let spec = serde_json::json!({
        "name": "x", "features": 4, "classes": 2, "model": "logreg", "rounds": 1,
        "clients_per_round": 2, "min_participants": 1, "colour": "blue"
    });
    h.refused(
        h.admin(Method::POST, "/experiments").json(&spec),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_body",
    )
    .await;
    let token = h.issue_token().await;
    h.refused(
        h.enrol(&serde_json::json!({"token": token, "admin": true})),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_body",
    )
    .await;
}

async fn update_of_the_wrong_dimension_is_422(h: &Harness) {
    let round = h.collecting(2, 30).await;
    for values in [&[0.0f32; 9][..], &[0.0; 11], &[]] {
        h.refused(
            h.upload(Some(&round.a), &round.task, floats(values)),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_update",
        )
        .await;
    }
    // Not a whole number of f32s.
    h.refused(
        h.upload(Some(&round.a), &round.task, vec![0; 41]),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_update",
    )
    .await;
    // Nothing was half-recorded: the same client's good upload still goes through.
    h.upload_ok(&round.a, &round.task).await;
}

async fn non_finite_update_is_422(h: &Harness) {
    let round = h.collecting(2, 30).await;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut values = [0.5f32; 10];
        values[7] = bad;
        h.refused(
            h.upload(Some(&round.a), &round.task, floats(&values)),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_update",
        )
        .await;
    }
    h.upload_ok(&round.a, &round.task).await;
}

async fn update_not_sent_as_octets_is_415(h: &Harness) {
    let round = h.collecting(2, 30).await;
    let t = &round.task;
    let path = format!(
        "/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/update?num_samples=3",
        t.experiment, t.round, t.attempt
    );
    h.refused(
        h.client
            .post(h.url(&path))
            .bearer_auth(&round.a)
            .json(&[1.0f32; 10]),
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    )
    .await;
}

async fn body_over_the_limit_is_413(h: &Harness) {
    let round = h.collecting(2, 30).await;
    h.refused(
        h.upload(Some(&round.a), &round.task, vec![0; BODY_LIMIT + 4]),
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    )
    .await;
    // A JSON body over the limit is refused the same way.
    let big = serde_json::json!({"token": "x".repeat(BODY_LIMIT * 2)});
    h.refused(
        h.enrol(&big),
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    )
    .await;
    h.upload_ok(&round.a, &round.task).await;
}

/// A body sent chunked (no `Content-Length`), in pieces of `piece` bytes, so the server
/// can only find out what it holds by reading it.
fn chunked(bytes: Vec<u8>, piece: usize) -> reqwest::Body {
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
        bytes.chunks(piece).map(|c| Ok(c.to_vec())).collect();
    reqwest::Body::wrap_stream(futures_util::stream::iter(pieces))
}

async fn chunked_body_over_the_limit_is_413(h: &Harness) {
    let round = h.collecting(2, 30).await;
    h.refused(
        h.upload(Some(&round.a), &round.task, Vec::new())
            .body(chunked(vec![0; BODY_LIMIT * 3], 7)),
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    )
    .await;
    // The same update, chunked and cut mid-float, is accepted when it is right.
    let r = h
        .upload(Some(&round.a), &round.task, Vec::new())
        .body(chunked(floats(&[1.0; 10]), 3))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
}

async fn chunked_update_with_a_non_finite_value_is_422(h: &Harness) {
    let round = h.collecting(2, 30).await;
    let mut values = [0.25f32; 10];
    values[9] = f32::NAN;
    h.refused(
        h.upload(Some(&round.a), &round.task, Vec::new())
            .body(chunked(floats(&values), 5)),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_update",
    )
    .await;
    h.upload_ok(&round.a, &round.task).await;
}

async fn upload_from_a_client_not_selected_is_409(h: &Harness) {
    let round = h.collecting(2, 30).await;
    h.refused(
        h.upload(Some(&round.outsider), &round.task, floats(&[1.0; 10])),
        StatusCode::CONFLICT,
        "not_selected",
    )
    .await;
}

async fn upload_for_a_round_that_does_not_exist_is_404(h: &Harness) {
    let round = h.collecting(2, 30).await;
    let later = Task {
        round: round.task.round + 1,
        ..round.task.clone()
    };
    let retry = Task {
        attempt: round.task.attempt + 1,
        ..round.task.clone()
    };
    let other_experiment = Task {
        experiment: uuid::Uuid::new_v4().to_string(),
        ..round.task.clone()
    };
    for task in [later, retry, other_experiment] {
        h.refused(
            h.upload(Some(&round.a), &task, floats(&[1.0; 10])),
            StatusCode::NOT_FOUND,
            "not_found",
        )
        .await;
    }
}

async fn upload_after_collection_closed_is_409(h: &Harness) {
    // Quorum 1 and a one-second deadline: `a` uploads, `b` misses the deadline and is
    // dropped, and the round moves on without it.
    let round = h.collecting(1, 1).await;
    h.upload_ok(&round.a, &round.task).await;
    // Wait until the driver has nothing left to do: the experiment finished.
    let mut state = String::new();
    for _ in 0..100 {
        let exp: serde_json::Value = h
            .admin(
                Method::GET,
                &format!("/experiments/{}", round.task.experiment),
            )
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        state = exp["state"].as_str().unwrap().to_string();
        if state == "finished" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state, "finished");
    h.refused(
        h.upload(Some(&round.b), &round.task, floats(&[1.0; 10])),
        StatusCode::CONFLICT,
        "round_not_collecting",
    )
    .await;
}

async fn replayed_upload_is_409(h: &Harness) {
    let round = h.collecting(2, 30).await;
    h.upload_ok(&round.a, &round.task).await;
    // The same bytes again, and different ones: neither replaces the acknowledged update.
    for values in [[1.0f32; 10], [9.0; 10]] {
        h.refused(
            h.upload(Some(&round.a), &round.task, floats(&values)),
            StatusCode::CONFLICT,
            "already_uploaded",
        )
        .await;
    }
}

/// Idempotent uploads: a retry carrying the upload's own id (its first try stored, the
/// answer lost) gets 200 and the stored upload's id, and changes nothing; another
/// upload from the same client is still refused; the id is the client's own, so
/// another client may use the same one.
async fn a_retried_upload_with_its_upload_id_is_recognised_not_counted_again(h: &Harness) {
    let round = h.collecting(2, 30).await;
    let upload_id = uuid::Uuid::new_v4();
    let with_id = |credential: &str, id: uuid::Uuid, values: [f32; 10]| {
        let path = format!(
            "/api/v1/clients/experiments/{}/rounds/{}/attempts/{}/update\
             ?num_samples=3&train_loss=0.5&upload_id={id}",
            round.task.experiment, round.task.round, round.task.attempt
        );
        h.client
            .post(h.url(&path))
            .bearer_auth(credential)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(floats(&values))
    };
    let first = with_id(&round.a, upload_id, [1.0; 10])
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first: serde_json::Value = first.json().await.unwrap();
    let before = h.state().await;
    for _ in 0..2 {
        let again = with_id(&round.a, upload_id, [1.0; 10])
            .send()
            .await
            .unwrap();
        assert_eq!(again.status(), StatusCode::OK);
        let again: serde_json::Value = again.json().await.unwrap();
        assert_eq!(again["upload_id"], first["upload_id"]);
        assert_eq!(again["replayed"], true);
    }
    assert!(
        h.state().await == before,
        "a recognised retry changes nothing"
    );
    h.refused(
        with_id(&round.a, uuid::Uuid::new_v4(), [9.0; 10]),
        StatusCode::CONFLICT,
        "already_uploaded",
    )
    .await;
    let other = with_id(&round.b, upload_id, [2.0; 10])
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::CREATED);
    let other: serde_json::Value = other.json().await.unwrap();
    assert_ne!(other["upload_id"], first["upload_id"]);
}

async fn missing_credential_is_401(h: &Harness) {
    let round = h.collecting(2, 30).await;
    h.refused(
        h.upload(None, &round.task, floats(&[1.0; 10])),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
    h.refused(
        h.client
            .post(h.url("/api/v1/clients/checkin"))
            .json(&serde_json::json!({"wait_seconds": 0})),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
}

async fn wrong_credential_is_401(h: &Harness) {
    let round = h.collecting(2, 30).await;
    let (id, secret) = round.a.split_once('.').unwrap();
    let mut flipped = secret.to_string().into_bytes();
    flipped[0] = if flipped[0] == b'A' { b'B' } else { b'A' };
    let wrong_secret = format!("{id}.{}", String::from_utf8(flipped).unwrap());
    let unknown_id = format!("{}.{secret}", uuid::Uuid::new_v4());
    let other_clients_secret = format!("{id}.{}", round.b.split_once('.').unwrap().1);
    for credential in [
        wrong_secret.as_str(),
        unknown_id.as_str(),
        other_clients_secret.as_str(),
        id,
        "not-a-credential",
        &h.token,
    ] {
        h.refused(
            h.upload(Some(credential), &round.task, floats(&[1.0; 10])),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        )
        .await;
    }
}

async fn revoked_client_is_403(h: &Harness) {
    let round = h.collecting(2, 30).await;
    let id = round.a.split_once('.').unwrap().0;
    let r = h
        .admin(Method::POST, &format!("/clients/{id}/revoke"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    h.refused(
        h.upload(Some(&round.a), &round.task, floats(&[1.0; 10])),
        StatusCode::FORBIDDEN,
        "forbidden",
    )
    .await;
    h.refused(
        h.client
            .post(h.url("/api/v1/clients/checkin"))
            .bearer_auth(&round.a)
            .json(&serde_json::json!({"wait_seconds": 0})),
        StatusCode::FORBIDDEN,
        "forbidden",
    )
    .await;
}

async fn used_enrolment_token_is_401(h: &Harness) {
    let token = h.issue_token().await;
    let first = h
        .enrol(&serde_json::json!({"token": token}))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    h.refused(
        h.enrol(&serde_json::json!({"token": token})),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
}
