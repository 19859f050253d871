//! Privacy against the coordinator in `cohort serve` (security review, issue 21, finding
//! 7). The coordinator draws every round's sample and knows who is in it, so against it
//! sampling amplifies nothing. What this protects:
//! - the privacy report of a private secure experiment sampled at q < 1 states both
//!   epsilons: against observers (amplified) and against the coordinator, which is the
//!   worst client's own attempts composed at q = 1, recomputed here from the selections
//!   the API lists, and larger;
//! - a budget against the coordinator stops an experiment that the same budget against
//!   observers lets run on: the latter goes past the coordinator budget while its
//!   observers' figure is still within it.
//!
//! The driver runs in process (`driver::tick`) with clients that check in and never
//! answer: every secure attempt fails at its advertise deadline, and stays charged to
//! everyone it selected.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use cohort_aggregation::privacy::rdp;
use cohort_coordinator::server::{AppState, ServeFlags, ServeSettings, driver, prepare};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// Clients enrolled and checked in.
const CLIENTS: usize = 40;
/// Clients a round wants: each is sampled with probability 4 / 40.
const WANTED: usize = 4;
const DELTA: f64 = 1e-5;

struct Harness {
    state: AppState,
    token: String,
    _dir: tempfile::TempDir,
}

impl Harness {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let settings = ServeSettings::from_sources(
            None,
            &HashMap::new(),
            ServeFlags {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                data_dir: Some(dir.path().to_path_buf()),
                insecure_http: true,
                ..ServeFlags::default()
            },
        )
        .unwrap();
        let prepared = prepare(settings).await.unwrap();
        let token = prepared
            .generated_admin_token
            .as_ref()
            .unwrap()
            .expose()
            .to_string();
        let state = prepared.state().clone();
        let now = cohort_coordinator::store::now_millis();
        for i in 0..CLIENTS {
            let token_hash = format!("token-{i}").into_bytes();
            state
                .store
                .create_enrolment_token(&token_hash, &format!("site-{i}"), None)
                .await
                .unwrap();
            let client = state
                .store
                .enrol(&token_hash, format!("secret-{i}").as_bytes(), now)
                .await
                .unwrap();
            state.store.touch_client(client.id, now).await.unwrap();
        }
        Self {
            state,
            token,
            _dir: dir,
        }
    }

    async fn api(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let request = Request::builder()
            .method(method)
            .uri(format!("/api/v1/admin{path}"))
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
            .unwrap();
        let response = cohort_coordinator::server::app(self.state.clone())
            .oneshot(request)
            .await
            .unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).to_string();
        assert!(
            status == StatusCode::OK || status == StatusCode::CREATED,
            "{path}: {status} {text}"
        );
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null)
    }

    /// Creates and starts a private secure experiment; its id.
    async fn experiment(&self, noise_multiplier: f64, budget: f64, against: &str) -> String {
        let mut spec = serde_json::json!({
            "name": format!("private, budget against {against}"),
            "features": 4, "classes": 2, "model": "logreg",
            "rounds": 50, "clients_per_round": WANTED, "min_participants": 2,
            "max_round_attempts": 1000,
            "secure_aggregation": {"advertise_seconds": 1},
            "privacy": {"noise_multiplier": noise_multiplier, "clip": 0.5,
                        "epsilon_budget": budget}
        });
        // Observers are the default: a spec that says nothing means them.
        if against != "observers" {
            spec["privacy"]["budget_against"] = against.into();
        }
        let exp = self.api(Method::POST, "/experiments", Some(spec)).await;
        let id = exp["id"].as_str().unwrap().to_string();
        self.api(Method::POST, &format!("/experiments/{id}/start"), None)
            .await;
        id
    }

    async fn privacy(&self, id: &str) -> serde_json::Value {
        self.api(Method::GET, &format!("/experiments/{id}/privacy"), None)
            .await
    }

    /// Drives the experiments until `done` holds for the report of `id` (every attempt
    /// fails at its advertise deadline, and the next opens), or panics after a minute.
    async fn run_until(
        &self,
        id: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let report = self.privacy(id).await;
            if done(&report) {
                return report;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "never got there: {report:#}"
            );
            // Clients stay available, as if they checked in (they never answer).
            let now = cohort_coordinator::store::now_millis();
            for c in self.state.store.clients().await.unwrap() {
                self.state.store.touch_client(c.id, now).await.unwrap();
            }
            driver::tick(&self.state, "test").await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Epsilon against the coordinator recomputed from the API: each client's own
    /// attempts at q = 1, the worst client's; and how many attempts it took part in.
    async fn worst_client(&self, id: &str, report: &serde_json::Value) -> (f64, usize) {
        let mut sigmas: HashMap<String, Vec<f64>> = HashMap::new();
        for r in report["rounds"].as_array().unwrap() {
            let detail = self
                .api(
                    Method::GET,
                    &format!(
                        "/experiments/{id}/rounds/{}/attempts/{}",
                        r["round"], r["attempt"]
                    ),
                    None,
                )
                .await;
            for p in detail["participants"].as_array().unwrap() {
                sigmas
                    .entry(p["client_id"].as_str().unwrap().to_string())
                    .or_default()
                    .push(r["noise_multiplier"].as_f64().unwrap());
            }
        }
        sigmas
            .values()
            .map(|s| {
                let mut accountant = rdp::RdpAccountant::new();
                for &sigma in s {
                    accountant.compose(1.0, sigma, 1).unwrap();
                }
                (accountant.epsilon(DELTA).unwrap(), s.len())
            })
            .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a })
    }
}

/// The report states both figures; the coordinator's is the worst client's own
/// attempts unamplified, larger than the observers', and each attempt has its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_privacy_report_states_the_epsilon_against_the_coordinator_too() {
    let h = Harness::start().await;
    let id = h.experiment(1.0, 1000.0, "observers").await;
    let report = h
        .run_until(&id, |r| r["attempts_charged"].as_u64().unwrap() >= 3)
        .await;
    let observers = report["epsilon_spent"].as_f64().unwrap();
    let coordinator = report["epsilon_spent_coordinator"]
        .as_f64()
        .unwrap_or_else(|| panic!("no epsilon against the coordinator: {report:#}"));
    assert_eq!(report["budget_against"], "observers", "{report:#}");
    assert!(
        report.get("epsilon_coordinator_unbounded").is_none(),
        "{report:#}"
    );
    let (worst, attempts) = h.worst_client(&id, &report).await;
    assert!(
        (coordinator - worst).abs() < 1e-9 * worst,
        "served {coordinator}, recomputed {worst}"
    );
    assert_eq!(report["worst_client_attempts"], attempts as u64);
    assert!(
        coordinator > observers,
        "the coordinator knows who took part: {coordinator} <= {observers}"
    );
    // Round by round, the figure so far never falls, and the last is the total.
    let per_round: Vec<f64> = report["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["epsilon_coordinator"].as_f64().unwrap())
        .collect();
    assert!(per_round.windows(2).all(|w| w[0] <= w[1]), "{per_round:?}");
    assert_eq!(*per_round.last().unwrap(), coordinator);
    // The rounds listing carries it too.
    let rounds = h
        .api(Method::GET, &format!("/experiments/{id}/rounds"), None)
        .await;
    let listed = rounds.as_array().unwrap();
    assert_eq!(
        listed[0]["epsilon_coordinator"].as_f64(),
        Some(per_round[0]),
        "{:#}",
        listed[0]
    );
}

/// Against the coordinator a client's own attempts add up without amplification: the
/// same budget stops an experiment that, held against observers only, runs past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_against_the_coordinator_stops_what_the_observers_budget_lets_run() {
    const BUDGET: f64 = 8.0;
    let h = Harness::start().await;
    let against_coordinator = h.experiment(1.0, BUDGET, "coordinator").await;
    let against_observers = h.experiment(1.0, BUDGET, "observers").await;
    let stopped = h
        .run_until(&against_coordinator, |r| r["budget_exhausted"] == true)
        .await;
    assert_eq!(stopped["budget_against"], "coordinator");
    let spent = stopped["epsilon_spent_coordinator"].as_f64().unwrap();
    assert!(spent <= BUDGET, "{stopped:#}");
    assert!(stopped["epsilon_spent"].as_f64().unwrap() < BUDGET);
    let audit = h.api(Method::GET, "/audit", None).await;
    assert!(
        audit
            .to_string()
            .contains("privacy budget against the coordinator"),
        "{audit:#}"
    );

    // The observers' budget lets the other one take some client past BUDGET against the
    // coordinator while its own figure stays within it.
    let past = h
        .run_until(&against_observers, |r| {
            r["epsilon_spent_coordinator"].as_f64().unwrap() > BUDGET
        })
        .await;
    assert!(
        past["epsilon_spent"].as_f64().unwrap() <= BUDGET,
        "{past:#}"
    );
    assert_eq!(past["budget_exhausted"], false, "{past:#}");
}
