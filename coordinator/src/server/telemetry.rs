//! `/metrics` for Prometheus: this replica's request and job timings, and the counts of
//! the shared database (experiments, round stages, jobs, uploads, clients).
//!
//! The process-local series live in a [`Registry`] of this server's own, not in a
//! global recorder, so that several servers in one process (the tests) keep theirs
//! apart. The database counts are read at scrape time: every replica reports the same
//! values for them, which Prometheus queries should aggregate with `max`, not `sum`.

use std::fmt::Write as _;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use super::AppState;
use super::error::ApiError;
use crate::store::{StoreCounts, now_millis};

/// A client counts as active when seen within this window.
pub const ACTIVE_CLIENT_WINDOW_MS: i64 = 5 * 60 * 1000;

/// Latency buckets in seconds: 1 ms to 60 s (long polls and uploads of large models
/// sit at the top).
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// This process's series.
#[derive(Debug, Clone)]
pub struct Telemetry {
    registry: Registry,
    http_requests: IntCounterVec,
    http_seconds: HistogramVec,
    jobs: IntCounterVec,
    job_seconds: HistogramVec,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    /// Fresh series, all at zero.
    pub fn new() -> Self {
        let registry =
            Registry::new_custom(Some("cohort".into()), None).expect("a constant, valid prefix");
        let http_requests = IntCounterVec::new(
            Opts::new(
                "http_requests_total",
                "HTTP requests answered, by route template, method and status code.",
            ),
            &["route", "method", "status"],
        )
        .expect("valid metric");
        let http_seconds = HistogramVec::new(
            HistogramOpts::new(
                "http_request_duration_seconds",
                "Time to answer an HTTP request (to the response head), by route template and method.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route", "method"],
        )
        .expect("valid metric");
        let jobs = IntCounterVec::new(
            Opts::new(
                "jobs_run_total",
                "Jobs this replica ran, by kind and outcome (ok or error).",
            ),
            &["kind", "outcome"],
        )
        .expect("valid metric");
        let job_seconds = HistogramVec::new(
            HistogramOpts::new(
                "job_duration_seconds",
                "Time this replica took to run a job, by kind.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["kind"],
        )
        .expect("valid metric");
        for collector in [
            Box::new(http_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(http_seconds.clone()),
            Box::new(jobs.clone()),
            Box::new(job_seconds.clone()),
        ] {
            registry.register(collector).expect("distinct names");
        }
        Self {
            registry,
            http_requests,
            http_seconds,
            jobs,
            job_seconds,
        }
    }

    /// Records one answered request.
    pub fn observe_request(&self, route: &str, method: &str, status: u16, seconds: f64) {
        self.http_requests
            .with_label_values(&[route, method, &status.to_string()])
            .inc();
        self.http_seconds
            .with_label_values(&[route, method])
            .observe(seconds);
    }

    /// Records one job run.
    pub fn observe_job(&self, kind: &str, ok: bool, seconds: f64) {
        self.jobs
            .with_label_values(&[kind, if ok { "ok" } else { "error" }])
            .inc();
        self.job_seconds.with_label_values(&[kind]).observe(seconds);
    }

    /// The text exposition of this process's series, the database's counts and the
    /// process's memory.
    pub fn render(&self, counts: &StoreCounts, resident_bytes: Option<u64>) -> String {
        let mut buffer = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("the text encoder writes to memory");
        let mut out = String::from_utf8(buffer).expect("the text encoding is UTF-8");
        render_counts(&mut out, counts);
        if let Some(bytes) = resident_bytes {
            gauge(
                &mut out,
                "cohort_process_resident_memory_bytes",
                "Resident memory of this coordinator process.",
                &[(vec![], bytes as f64)],
            );
        }
        out
    }
}

/// (sink, reason, value) of one tracking counter sample.
type CounterSample<'a> = (&'a str, Option<&'a str>, u64);

/// The experiment trackers' queues: what each took, retried and dropped (a counter
/// each, this replica's), and what waits now.
pub fn render_tracking(out: &mut String, stats: &[crate::tracking::outbox::OutboxStats]) {
    if stats.is_empty() {
        return;
    }
    let families: [(&str, &str, Vec<CounterSample<'_>>); 3] = [
        (
            "cohort_tracking_records_sent_total",
            "Records (parameters, round metrics, models, ends) an experiment tracker took.",
            stats.iter().map(|s| (s.sink, None, s.sent)).collect(),
        ),
        (
            "cohort_tracking_retries_total",
            "Tries to hand a record to an experiment tracker that failed and were repeated.",
            stats.iter().map(|s| (s.sink, None, s.retries)).collect(),
        ),
        (
            "cohort_tracking_dropped_total",
            "Records an experiment tracker never got: its queue was full (queue_full) or it \
             refused them (rejected).",
            stats
                .iter()
                .flat_map(|s| {
                    [
                        (s.sink, Some("queue_full"), s.dropped_full),
                        (s.sink, Some("rejected"), s.dropped_rejected),
                    ]
                })
                .collect(),
        ),
    ];
    for (name, help, samples) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (sink, reason, value) in samples {
            let reason = reason.map_or(String::new(), |r| format!(",reason=\"{r}\""));
            let _ = writeln!(out, "{name}{{sink=\"{sink}\"{reason}}} {value}");
        }
    }
    let queued: Vec<Sample<'_>> = stats
        .iter()
        .map(|s| (vec![("sink", s.sink)], s.queued as f64))
        .collect();
    gauge(
        out,
        "cohort_tracking_queued",
        "Records waiting for an experiment tracker on this replica.",
        &queued,
    );
}

/// (labels, value) of one sample.
type Sample<'a> = (Vec<(&'a str, &'a str)>, f64);

/// Writes one gauge family.
fn gauge(out: &mut String, name: &str, help: &str, samples: &[Sample<'_>]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for (labels, value) in samples {
        out.push_str(name);
        if !labels.is_empty() {
            out.push('{');
            for (i, (key, val)) in labels.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{key}=\"{}\"", escape_label(val));
            }
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }
}

/// A label value as the exposition format wants it: backslash, quote and newline
/// escaped. The values here come from the database's own state names, but a value is
/// never trusted to be tame.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn render_counts(out: &mut String, c: &StoreCounts) {
    let experiments: Vec<Sample<'_>> = c
        .experiments
        .iter()
        .map(|(state, n)| (vec![("state", state.as_str())], *n as f64))
        .collect();
    gauge(
        out,
        "cohort_experiments",
        "Experiments, by state (from the database).",
        &experiments,
    );
    let rounds: Vec<Sample<'_>> = c
        .rounds
        .iter()
        .map(|(stage, n)| (vec![("stage", stage.as_str())], *n as f64))
        .collect();
    gauge(
        out,
        "cohort_rounds",
        "Round attempts, by stage (from the database): the running stages are rounds in \
         flight; published and failed only grow.",
        &rounds,
    );
    let jobs: Vec<Sample<'_>> = c
        .jobs
        .iter()
        .map(|(kind, state, n)| {
            (
                vec![("kind", kind.as_str()), ("state", state.as_str())],
                *n as f64,
            )
        })
        .collect();
    gauge(
        out,
        "cohort_jobs",
        "Jobs, by kind and state (from the database).",
        &jobs,
    );
    for (name, help, value) in [
        (
            "cohort_uploads",
            "Client updates recorded, all time (from the database).",
            c.uploads,
        ),
        (
            "cohort_upload_bytes",
            "Bytes of the client updates recorded, all time (from the database).",
            c.upload_bytes,
        ),
        (
            "cohort_task_failures",
            "Tasks clients reported they could not complete, all time (from the database).",
            c.task_failures,
        ),
        (
            "cohort_clients",
            "Enrolled clients not revoked (from the database).",
            c.clients,
        ),
        (
            "cohort_clients_active",
            "Enrolled clients seen in the last five minutes (from the database).",
            c.clients_active,
        ),
    ] {
        gauge(out, name, help, &[(vec![], value as f64)]);
    }
}

/// This process's resident memory, from `/proc/self/status` (Linux); `None` elsewhere.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Middleware: times every request and counts it by route template (never the raw
/// path, whose ids would make a series per experiment and client).
pub async fn record_requests(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = request.method().as_str().to_string();
    let start = Instant::now();
    let response = next.run(request).await;
    state.telemetry.observe_request(
        &route,
        &method,
        response.status().as_u16(),
        start.elapsed().as_secs_f64(),
    );
    response
}

/// `GET /metrics`: the Prometheus text format. Needs the admin token, as a bearer
/// token (Prometheus: `authorization: {credentials_file: ...}`), since round and client
/// counts are the operator's business.
pub async fn metrics(
    State(state): State<AppState>,
    super::rate_limit::PeerAddr(peer): super::rate_limit::PeerAddr,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    // Any person may read the metrics (a viewer's right).
    super::http::authenticate(&state, &headers, peer).await?;
    let counts = state
        .store
        .counts(now_millis() - ACTIVE_CLIENT_WINDOW_MS)
        .await?;
    let mut body = state.telemetry.render(&counts, resident_bytes());
    render_tracking(&mut body, &state.tracker.stats());
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts() -> StoreCounts {
        StoreCounts {
            experiments: vec![("running".into(), 2)],
            rounds: vec![("collecting".into(), 1), ("published".into(), 7)],
            jobs: vec![("aggregate".into(), "done".into(), 7)],
            uploads: 21,
            upload_bytes: 4096,
            task_failures: 1,
            clients: 3,
            clients_active: 2,
        }
    }

    /// Each tracker's queue shows what it sent, retried, dropped (by why) and holds.
    #[test]
    fn tracking_queues_are_exposed_per_tracker() {
        let mut text = String::new();
        render_tracking(&mut text, &[]);
        assert!(text.is_empty(), "no trackers, no families");
        render_tracking(
            &mut text,
            &[crate::tracking::outbox::OutboxStats {
                sink: "mlflow",
                sent: 7,
                retries: 3,
                dropped_full: 2,
                dropped_rejected: 1,
                queued: 4,
            }],
        );
        for line in [
            "# TYPE cohort_tracking_records_sent_total counter",
            "cohort_tracking_records_sent_total{sink=\"mlflow\"} 7",
            "cohort_tracking_retries_total{sink=\"mlflow\"} 3",
            "# TYPE cohort_tracking_dropped_total counter",
            "cohort_tracking_dropped_total{sink=\"mlflow\",reason=\"queue_full\"} 2",
            "cohort_tracking_dropped_total{sink=\"mlflow\",reason=\"rejected\"} 1",
            "# TYPE cohort_tracking_queued gauge",
            "cohort_tracking_queued{sink=\"mlflow\"} 4",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in:\n{text}"
            );
        }
    }

    /// The exposition carries every family with its type, the database counts as
    /// labelled samples, and the process series once something was observed.
    #[test]
    fn render_lists_every_family() {
        let t = Telemetry::new();
        t.observe_request("/api/v1/health", "GET", 200, 0.003);
        t.observe_job("aggregate", true, 0.2);
        let text = t.render(&counts(), Some(1 << 20));
        for line in [
            "# TYPE cohort_http_requests_total counter",
            "cohort_http_requests_total{method=\"GET\",route=\"/api/v1/health\",status=\"200\"} 1",
            "# TYPE cohort_http_request_duration_seconds histogram",
            "cohort_http_request_duration_seconds_bucket{method=\"GET\",route=\"/api/v1/health\",le=\"0.005\"} 1",
            "cohort_jobs_run_total{kind=\"aggregate\",outcome=\"ok\"} 1",
            "cohort_job_duration_seconds_count{kind=\"aggregate\"} 1",
            "# TYPE cohort_rounds gauge",
            "cohort_rounds{stage=\"collecting\"} 1",
            "cohort_rounds{stage=\"published\"} 7",
            "cohort_jobs{kind=\"aggregate\",state=\"done\"} 7",
            "cohort_experiments{state=\"running\"} 2",
            "cohort_uploads 21",
            "cohort_upload_bytes 4096",
            "cohort_task_failures 1",
            "cohort_clients 3",
            "cohort_clients_active 2",
            "cohort_process_resident_memory_bytes 1048576",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in:\n{text}"
            );
        }
    }

    /// A label value cannot break out of its quotes or its line.
    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        gauge(&mut out, "g", "h", &[(vec![("k", "a\"b\\c\nd")], 1.0)]);
        assert!(out.contains("g{k=\"a\\\"b\\\\c\\nd\"} 1\n"), "{out}");
        assert_eq!(out.lines().count(), 3);
    }

    /// Each server keeps its own series: two side by side do not mix.
    #[test]
    fn registries_are_per_server() {
        let (a, b) = (Telemetry::new(), Telemetry::new());
        a.observe_request("/x", "GET", 200, 0.1);
        let text = b.render(&StoreCounts::default(), None);
        assert!(!text.contains("route=\"/x\""), "{text}");
    }

    #[test]
    fn resident_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(resident_bytes().is_some_and(|b| b > 0));
        }
    }
}
