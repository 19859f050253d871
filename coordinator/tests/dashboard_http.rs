//! The dashboard's guard over a real TLS socket: without a session no page shows and no
//! action runs; with one, no state-changing request runs without the session's CSRF
//! token or from another site; sign-in and sign-out behave.

use std::collections::HashMap;
use std::time::Duration;

use cohort_coordinator::server::{ServeFlags, ServeSettings, prepare};
use reqwest::header::{CONTENT_TYPE, COOKIE, LOCATION, ORIGIN, SET_COOKIE};
use reqwest::{Method, StatusCode};
use tokio::sync::oneshot;

struct Server {
    base: String,
    http: reqwest::Client,
    token: String,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), cohort_coordinator::server::ServeError>>,
    dir: tempfile::TempDir,
    /// The server's store, for clients that only need to be there.
    store: cohort_coordinator::store::Store,
}

async fn start() -> Server {
    start_with(None).await
}

/// A server whose largest accepted body is `max_body_bytes` (default without).
async fn start_with(max_body_bytes: Option<usize>) -> Server {
    start_configured(max_body_bytes, &[]).await
}

/// A server whose settings also read `env` (`COHORT_*` variables).
async fn start_configured(max_body_bytes: Option<usize>, env: &[(&str, &str)]) -> Server {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let settings = ServeSettings::from_sources(
        None,
        &env,
        ServeFlags {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            data_dir: Some(dir.path().to_path_buf()),
            dev_tls: true,
            max_body_bytes,
            ..ServeFlags::default()
        },
    )
    .unwrap();
    let prepared = prepare(settings).await.unwrap();
    let base = prepared.base_url();
    let token = prepared
        .generated_admin_token
        .as_ref()
        .unwrap()
        .expose()
        .to_string();
    let ca = std::fs::read(prepared.dev_ca_cert.as_ref().unwrap()).unwrap();
    let http = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(&ca).unwrap()])
        // Redirects are what these tests look at; never follow them.
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let store = prepared.state().store.clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(prepared.serve(async move {
        let _ = stopped.await;
    }));
    Server {
        base,
        http,
        token,
        stop,
        task,
        dir,
        store,
    }
}

impl Server {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A form POST with `cookie` (if any) and the fields.
    async fn post(
        &self,
        path: &str,
        cookie: Option<&str>,
        fields: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(self.url(path))
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(encode(fields));
        if let Some(cookie) = cookie {
            req = req.header(COOKIE, cookie);
        }
        req.send().await.unwrap()
    }

    /// The model upload form, as a browser sends it: `multipart/form-data` with the
    /// CSRF token (if any), a name and the file.
    async fn upload(
        &self,
        cookie: &str,
        csrf: Option<&str>,
        name: &str,
        file: &[u8],
    ) -> reqwest::Response {
        let boundary = "----CohortTestBoundary7MA4YWxkTrZu0gW";
        let mut body = Vec::new();
        let mut field = |disposition: String, value: &[u8]| {
            body.extend_from_slice(
                format!("--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n")
                    .as_bytes(),
            );
            if disposition.contains("filename") {
                body.extend_from_slice(b"Content-Type: application/octet-stream\r\n");
            }
            body.extend_from_slice(b"\r\n");
            body.extend_from_slice(value);
            body.extend_from_slice(b"\r\n");
        };
        if let Some(csrf) = csrf {
            field("name=\"csrf\"".into(), csrf.as_bytes());
        }
        field("name=\"name\"".into(), name.as_bytes());
        field("name=\"file\"; filename=\"tiny.safetensors\"".into(), file);
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        self.http
            .post(self.url("/models"))
            .header(
                CONTENT_TYPE,
                format!("multipart/form-data; boundary={boundary}"),
            )
            .header(COOKIE, cookie)
            .body(body)
            .send()
            .await
            .unwrap()
    }

    /// The uploaded model files, from the API.
    async fn model_files(&self) -> Vec<serde_json::Value> {
        self.api(Method::GET, "/models", None)
            .await
            .as_array()
            .unwrap()
            .clone()
    }

    async fn get(&self, path: &str, cookie: Option<&str>) -> reqwest::Response {
        let mut req = self.http.get(self.url(path));
        if let Some(cookie) = cookie {
            req = req.header(COOKIE, cookie);
        }
        req.send().await.unwrap()
    }

    /// An admin API call; its JSON.
    async fn api(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let mut req = self
            .http
            .request(method, self.url(&format!("/api/v1/admin{path}")))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.unwrap_or(serde_json::Value::Null)
    }

    /// Signs in through the form; the `Cookie` header value of the new session.
    async fn sign_in(&self) -> String {
        let page = self.get("/sign-in", None).await;
        let form_cookie = cookie_pair(&page, "cohort_sign_in").expect("sign-in form cookie");
        let html = page.text().await.unwrap();
        let form_token = hidden(&html, "csrf");
        let r = self
            .post(
                "/sign-in",
                Some(&form_cookie),
                &[
                    ("csrf", &form_token),
                    ("token", &self.token),
                    ("next", "/clients"),
                ],
            )
            .await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER);
        assert_eq!(r.headers()[LOCATION], "/clients");
        cookie_pair(&r, "cohort_session").expect("session cookie")
    }

    /// Signs `name` in with `token` through the form; the session's `Cookie` value.
    async fn sign_in_as(&self, name: &str, token: &str) -> String {
        let page = self.get("/sign-in", None).await;
        let form_cookie = cookie_pair(&page, "cohort_sign_in").expect("sign-in form cookie");
        let form_token = hidden(&page.text().await.unwrap(), "csrf");
        let r = self
            .post(
                "/sign-in",
                Some(&form_cookie),
                &[("csrf", &form_token), ("name", name), ("token", token)],
            )
            .await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER, "{name} signs in");
        cookie_pair(&r, "cohort_session").expect("session cookie")
    }

    async fn shut_down(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
    }
}

/// An urlencoded form body.
fn encode(fields: &[(&str, &str)]) -> String {
    serde_urlencoded::to_string(fields).unwrap()
}

/// `name=value` of the cookie `name` that the response sets.
fn cookie_pair(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers().get_all(SET_COOKIE).iter().find_map(|v| {
        let text = v.to_str().ok()?;
        let pair = text.split(';').next()?.trim();
        (pair.starts_with(&format!("{name}=")) && pair.len() > name.len() + 1)
            .then(|| pair.to_string())
    })
}

/// The value of the first hidden input `name` in `html`.
fn hidden(html: &str, name: &str) -> String {
    let needle = format!("name=\"{name}\" value=\"");
    let start = html
        .find(&needle)
        .unwrap_or_else(|| panic!("no {name} in {html}"))
        + needle.len();
    html[start..start + html[start..].find('"').unwrap()].to_string()
}

/// A complete, valid new-experiment form.
fn experiment_form(csrf: &str) -> Vec<(&'static str, String)> {
    vec![
        ("csrf", csrf.to_string()),
        ("name", "guarded".into()),
        ("features", "64".into()),
        ("classes", "10".into()),
        ("model", "logreg".into()),
        ("strategy", "fedavg".into()),
        ("seed", "0".into()),
        ("rounds", "3".into()),
        ("clients_per_round", "2".into()),
        ("min_participants", "2".into()),
        ("over_selection", "1".into()),
        ("collect_deadline_seconds", "60".into()),
        ("max_round_attempts", "2".into()),
        ("train.local_epochs", "1".into()),
        ("train.batch_size", "16".into()),
        ("train.lr", "0.1".into()),
        ("train.momentum", "0".into()),
        ("train.weight_decay", "0".into()),
    ]
}

fn pairs<'a>(form: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    form.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[tokio::test]
async fn without_a_session_pages_go_to_sign_in_and_actions_are_refused() {
    let server = start().await;
    let exp = server
        .api(
            Method::POST,
            "/experiments",
            Some(
                serde_json::json!({"name": "e", "features": 64, "classes": 10, "model": "logreg",
                "rounds": 2, "clients_per_round": 2, "min_participants": 1}),
            ),
        )
        .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let token = server
        .api(
            Method::POST,
            "/enrolment-tokens",
            Some(serde_json::json!({"label": "site"})),
        )
        .await;
    let token_id = token["id"].as_str().unwrap().to_string();
    let pages = [
        "/".to_string(),
        "/experiments".into(),
        "/experiments/new".into(),
        format!("/experiments/{id}"),
        format!("/experiments/{id}?page=2"),
        format!("/experiments/{id}/model"),
        format!("/experiments/{id}/model.safetensors"),
        "/clients".into(),
        "/clients?page=3".into(),
    ];
    // No cookie, a made-up session, and a malformed one.
    let forged = format!("cohort_session={}", "ab".repeat(32));
    for cookie in [
        None,
        Some(forged.as_str()),
        Some("cohort_session=../../etc"),
    ] {
        for page in &pages {
            let r = server.get(page, cookie).await;
            assert_eq!(r.status(), StatusCode::SEE_OTHER, "{page} {cookie:?}");
            let location = r.headers()[LOCATION].to_str().unwrap().to_string();
            assert!(
                location.starts_with("/sign-in?next=/"),
                "{page}: {location}"
            );
            let body = r.text().await.unwrap();
            assert!(
                !body.contains(&id) || page.contains(&id),
                "{page} leaked the experiment"
            );
        }
        let actions = [
            "/experiments".to_string(),
            format!("/experiments/{id}/start"),
            format!("/experiments/{id}/pause"),
            format!("/experiments/{id}/resume"),
            format!("/experiments/{id}/stop"),
            format!("/clients/{}/revoke", uuid::Uuid::new_v4()),
            "/tokens".into(),
            format!("/tokens/{token_id}/revoke"),
            "/sign-out".into(),
        ];
        for action in &actions {
            let form = experiment_form("anything");
            let r = server.post(action, cookie, &pairs(&form)).await;
            assert_eq!(r.status(), StatusCode::FORBIDDEN, "{action} {cookie:?}");
            assert!(r.text().await.unwrap().contains("not signed in"));
        }
    }
    // Nothing changed.
    let list = server.api(Method::GET, "/experiments", None).await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["state"], "created");
    let tokens = server.api(Method::GET, "/enrolment-tokens", None).await;
    assert_eq!(tokens.as_array().unwrap().len(), 1);
    assert!(tokens[0]["revoked_at"].is_null());
    // The sign-in page and the assets are the only things open.
    assert_eq!(server.get("/sign-in", None).await.status(), StatusCode::OK);
    assert_eq!(
        server.get("/static/app.css", None).await.status(),
        StatusCode::OK
    );
    server.shut_down().await;
}

#[tokio::test]
async fn state_changing_requests_need_this_sessions_csrf_token_and_this_site() {
    let server = start().await;
    let session = server.sign_in().await;
    let other = server.sign_in().await;
    let html = server
        .get("/experiments/new", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    let csrf = hidden(&html, "csrf");
    let other_html = server
        .get("/experiments/new", Some(&other))
        .await
        .text()
        .await
        .unwrap();
    let other_csrf = hidden(&other_html, "csrf");
    assert_ne!(csrf, other_csrf, "each session has its own token");

    let mut without = experiment_form("");
    without.retain(|(k, _)| *k != "csrf");
    for (what, form) in [
        ("no token", without),
        ("an empty token", experiment_form("")),
        ("a wrong token", experiment_form(&"0".repeat(64))),
        ("another session's token", experiment_form(&other_csrf)),
    ] {
        let r = server
            .post("/experiments", Some(&session), &pairs(&form))
            .await;
        assert_eq!(r.status(), StatusCode::FORBIDDEN, "{what}");
        assert!(r.text().await.unwrap().contains("CSRF"), "{what}");
    }
    // The right token from a page of another site.
    let r = server
        .http
        .post(server.url("/experiments"))
        .header(COOKIE, &session)
        .header(ORIGIN, "https://evil.example")
        .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(encode(&pairs(&experiment_form(&csrf))))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(
        server
            .api(Method::GET, "/experiments", None)
            .await
            .as_array()
            .unwrap()
            .is_empty(),
        "a refused request created an experiment"
    );

    // With the token: created, and its start needs the token too.
    let r = server
        .post(
            "/experiments",
            Some(&session),
            &pairs(&experiment_form(&csrf)),
        )
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let page = r.headers()[LOCATION].to_str().unwrap().to_string();
    let r = server
        .post(&format!("{page}/start"), Some(&session), &[])
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let list = server.api(Method::GET, "/experiments", None).await;
    assert_eq!(list[0]["state"], "created");
    let r = server
        .post(&format!("{page}/start"), Some(&session), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let list = server.api(Method::GET, "/experiments", None).await;
    assert_eq!(list[0]["state"], "running");
    // Starting twice is a conflict, shown as a page.
    let r = server
        .post(&format!("{page}/start"), Some(&session), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status(), StatusCode::CONFLICT);

    // Sign-out needs the token as well; without it the session lives on.
    let r = server.post("/sign-out", Some(&session), &[]).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(
        server.get("/experiments", Some(&session)).await.status(),
        StatusCode::OK
    );

    // The audit log says who acted: a dashboard session (named by a prefix of its
    // stored hash, never the cookie) from this address; each sign-in its own session.
    let log = server.api(Method::GET, "/audit?limit=100", None).await;
    let actors = |action: &str| -> Vec<String> {
        log.as_array()
            .unwrap()
            .iter()
            .filter(|e| e["action"] == action)
            .map(|e| e["actor"].as_str().unwrap().to_string())
            .collect()
    };
    let sign_ins = actors("dashboard.sign_in");
    assert_eq!(sign_ins.len(), 2, "{log}");
    assert_ne!(sign_ins[0], sign_ins[1], "two sessions, two names");
    for actor in sign_ins
        .iter()
        .chain(&actors("experiment.create"))
        .chain(&actors("experiment.state"))
    {
        let label = actor
            .strip_prefix("admin via dashboard session ")
            .and_then(|rest| rest.strip_suffix(" from 127.0.0.1"))
            .unwrap_or_else(|| panic!("actor {actor}"));
        assert!(label.len() == 8 && label.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!session.contains(label), "the session id is not in the log");
    }
    assert_eq!(
        actors("experiment.create")[0],
        actors("experiment.state")[0],
        "the same session created and started it"
    );
    server.shut_down().await;
}

#[tokio::test]
async fn sign_in_gives_a_strict_http_only_cookie_and_sign_out_ends_the_session() {
    let server = start().await;
    // The sign-in form itself is protected: no form cookie, no session.
    let r = server
        .post("/sign-in", None, &[("csrf", "x"), ("token", &server.token)])
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(cookie_pair(&r, "cohort_session").is_none());
    // A wrong token is refused with the form again.
    let page = server.get("/sign-in", None).await;
    let form_cookie = cookie_pair(&page, "cohort_sign_in").unwrap();
    let form_token = hidden(&page.text().await.unwrap(), "csrf");
    let r = server
        .post(
            "/sign-in",
            Some(&form_cookie),
            &[("csrf", &form_token), ("token", "not-the-token")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(cookie_pair(&r, "cohort_session").is_none());
    assert!(r.text().await.unwrap().contains("not the admin token"));
    // An open redirect is not on offer.
    let r = server
        .post(
            "/sign-in",
            Some(&form_cookie),
            &[
                ("csrf", &form_token),
                ("token", &server.token),
                ("next", "//evil.example/x"),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(r.headers()[LOCATION], "/experiments");
    let set = r
        .headers()
        .get_all(SET_COOKIE)
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .find(|v| v.starts_with("cohort_session="))
        .unwrap();
    for attribute in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/"] {
        assert!(set.contains(attribute), "{set} lacks {attribute}");
    }
    let session = set.split(';').next().unwrap().to_string();
    let html = server
        .get("/experiments", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(html.contains("Sign out"));
    let csrf = hidden(&html, "csrf");
    let r = server
        .post("/sign-out", Some(&session), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(r.headers()[LOCATION], "/sign-in");
    // The old cookie is dead on the server, not just deleted in the browser.
    let r = server.get("/experiments", Some(&session)).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    server.shut_down().await;
}

/// `?next=` survives sign-in only as a path on this site: the tricks that make a
/// browser leave it (a tab or newline it drops, a backslash it reads as `/`, either one
/// percent-escaped, a second `/`, a scheme) all land on the default page instead, both in
/// the form the sign-in page renders and in the redirect after signing in.
#[tokio::test]
async fn sign_in_never_redirects_to_another_site() {
    let server = start().await;
    let page = server.get("/sign-in", None).await;
    let form_cookie = cookie_pair(&page, "cohort_sign_in").unwrap();
    let form_token = hidden(&page.text().await.unwrap(), "csrf");
    for bad in [
        "/%09/evil.example",
        "/\t/evil.example",
        "/\r\n/evil.example",
        "/\\evil.example",
        "/%5C/evil.example",
        "//evil.example",
        "/%2F/evil.example",
        "https://evil.example",
    ] {
        let query = encode(&[("next", bad)]);
        let html = server
            .get(&format!("/sign-in?{query}"), None)
            .await
            .text()
            .await
            .unwrap();
        assert_eq!(hidden(&html, "next"), "/experiments", "form for {bad:?}");
        let r = server
            .post(
                "/sign-in",
                Some(&form_cookie),
                &[
                    ("csrf", &form_token),
                    ("token", &server.token),
                    ("next", bad),
                ],
            )
            .await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER, "{bad:?}");
        assert_eq!(r.headers()[LOCATION], "/experiments", "after {bad:?}");
    }
    // A path on the site is where the browser goes back to.
    let r = server
        .post(
            "/sign-in",
            Some(&form_cookie),
            &[
                ("csrf", &form_token),
                ("token", &server.token),
                ("next", "/clients?page=2"),
            ],
        )
        .await;
    assert_eq!(r.headers()[LOCATION], "/clients?page=2");
    server.shut_down().await;
}

/// Failed sign-ins are limited per address (together with the API's failed bearer
/// tokens) and for the admin account from all addresses together. Past either limit the
/// form answers 429 with Retry-After before the token is looked at; while only one
/// address's share is spent, another address still signs in.
#[tokio::test]
async fn failed_sign_ins_are_limited_per_address_and_per_account() {
    let server = start_configured(
        None,
        &[
            ("COHORT_AUTH_FAILURE_RATE", "2"),
            ("COHORT_SIGN_IN_FAILURE_RATE", "4"),
            ("COHORT_TRUSTED_PROXIES", "127.0.0.1"),
        ],
    )
    .await;
    let page = server.get("/sign-in", None).await;
    let form_cookie = cookie_pair(&page, "cohort_sign_in").unwrap();
    let form_token = hidden(&page.text().await.unwrap(), "csrf");
    let sign_in = |token: &str, address: &str| {
        server
            .http
            .post(server.url("/sign-in"))
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(COOKIE, &form_cookie)
            .header("x-forwarded-for", address)
            .body(encode(&[("csrf", &form_token), ("token", token)]))
            .send()
    };
    let limited = |r: &reqwest::Response| {
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(cookie_pair(r, "cohort_session").is_none());
        let wait: u64 = r.headers()[reqwest::header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&wait), "{wait}");
    };
    for _ in 0..2 {
        let r = sign_in("not-the-token", "203.0.113.7").await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    // That address has used its share: even the right token is not tried.
    let r = sign_in(&server.token, "203.0.113.7").await.unwrap();
    limited(&r);
    assert!(r.text().await.unwrap().contains("Too many failed sign-ins"));
    // Another address signs in.
    let r = sign_in(&server.token, "198.51.100.1").await.unwrap();
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert!(cookie_pair(&r, "cohort_session").is_some());
    // Two more failures from a second address spend the account's share of 4: now
    // every address waits, a fresh one with the right token included.
    for _ in 0..2 {
        let r = sign_in("not-the-token", "198.51.100.2").await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    limited(&sign_in(&server.token, "192.0.2.9").await.unwrap());
    server.shut_down().await;
}

#[tokio::test]
async fn the_form_shows_each_problem_next_to_its_field_and_pages_render() {
    let server = start().await;
    let session = server.sign_in().await;
    let html = server
        .get("/experiments/new", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    let csrf = hidden(&html, "csrf");
    let mut form = experiment_form(&csrf);
    for (k, v) in form.iter_mut() {
        match *k {
            "rounds" => *v = "0".into(),
            "train.lr" => *v = "fast".into(),
            "min_participants" => *v = "9".into(),
            _ => {}
        }
    }
    let r = server
        .post("/experiments", Some(&session), &pairs(&form))
        .await;
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let html = r.text().await.unwrap();
    for (field, words) in [
        ("rounds", "rounds must be between 1 and 100000"),
        ("train.lr", "`fast` is not a number"),
        (
            "min_participants",
            "min_participants must be between 1 and clients_per_round",
        ),
    ] {
        let id = format!("id=\"{field}-error\">");
        let at = html
            .find(&id)
            .unwrap_or_else(|| panic!("no message for {field}"));
        assert!(
            html[at..].starts_with(&format!("{id}{words}")),
            "{field}: {}",
            &html[at..at + 120]
        );
    }
    // What was typed comes back.
    assert!(html.contains("name=\"train.lr\" type=\"number\" value=\"fast\""));
    assert!(
        server
            .api(Method::GET, "/experiments", None)
            .await
            .as_array()
            .unwrap()
            .is_empty()
    );

    // A token made on the clients page is shown once and listed after.
    let r = server
        .post(
            "/tokens",
            Some(&session),
            &[("csrf", &csrf), ("label", "St. Elsewhere")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let html = r.text().await.unwrap();
    assert!(html.contains("id=\"issued-token\""));
    let again = server
        .get("/clients", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(again.contains("St. Elsewhere") && !again.contains("issued-token"));
    let r = server
        .post(
            "/tokens",
            Some(&session),
            &[("csrf", &csrf), ("label", " ")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    server.shut_down().await;
}

/// The form carries the privacy settings and the robust rule to the API, and the
/// experiment page shows the budget (and says plainly when there is none).
#[tokio::test]
async fn privacy_settings_go_from_the_form_to_the_experiment_page() {
    let server = start().await;
    let session = server.sign_in().await;
    let html = server
        .get("/experiments/new", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    for field in [
        "privacy.noise_multiplier",
        "privacy.epsilon_budget",
        "aggregator",
    ] {
        assert!(
            html.contains(&format!("name=\"{field}\"")),
            "no {field} field"
        );
    }
    let csrf = hidden(&html, "csrf");
    let mut form = experiment_form(&csrf);
    form.extend([
        ("privacy", "on".to_string()),
        ("privacy.noise_multiplier", "1.2".to_string()),
        ("privacy.clip", "0.4".to_string()),
        ("privacy.delta", "0.00001".to_string()),
        ("privacy.epsilon_budget", "6".to_string()),
    ]);
    let r = server
        .post("/experiments", Some(&session), &pairs(&form))
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let page = r.headers()[LOCATION].to_str().unwrap().to_string();
    let list = server.api(Method::GET, "/experiments", None).await;
    let privacy = &list[0]["spec"]["privacy"];
    assert_eq!(privacy["noise_multiplier"], 1.2, "{privacy}");
    assert_eq!(privacy["clip"], 0.4, "{privacy}");
    assert_eq!(privacy["epsilon_budget"], 6.0, "{privacy}");
    let html = server
        .get(&page, Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        html.contains("id=\"privacy\">ε 0.000 of 6</p>"),
        "{}",
        &html[html.find("id=\"privacy\"").unwrap()..][..200]
    );
    assert!(html.contains("central noise"));
    let id = page.rsplit('/').next().unwrap();
    let report = server
        .api(Method::GET, &format!("/experiments/{id}/privacy"), None)
        .await;
    assert_eq!(report["epsilon_spent"], 0.0, "{report}");
    assert_eq!(report["budget_exhausted"], false, "{report}");

    // Without privacy, the card says so instead of showing a number.
    let mut plain = experiment_form(&csrf);
    plain.push(("aggregator", "median".to_string()));
    let r = server
        .post("/experiments", Some(&session), &pairs(&plain))
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let page = r.headers()[LOCATION].to_str().unwrap().to_string();
    let html = server
        .get(&page, Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(html.contains("id=\"privacy\">not enabled</p>"));
    // A built-in model without reported failures has no failures panel.
    assert!(!html.contains("id=\"failures-live\""));
    let list = server.api(Method::GET, "/experiments", None).await;
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .any(|e| e["spec"]["aggregator"] == "median"),
        "{list}"
    );
    server.shut_down().await;
}

/// A small valid safetensors model: two tensors, 8 parameters.
/// The experiment page states epsilon against observers of the published models and
/// against the coordinator (which knows who took part), on the card and per attempt; the
/// form takes whom the budget holds against, and the big figure is that one. Under
/// central noise the card says no epsilon holds against the coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_experiment_page_shows_epsilon_against_observers_and_the_coordinator() {
    let server = start().await;
    let session = server.sign_in().await;
    let html = server
        .get("/experiments/new", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(html.contains("name=\"privacy.budget_against\""));
    let csrf = hidden(&html, "csrf");
    let quantization = cohort_aggregation::secagg::QuantizationParams::default();
    let mut form = experiment_form(&csrf);
    form.retain(|(k, _)| !matches!(*k, "clients_per_round" | "max_round_attempts"));
    form.extend([
        ("clients_per_round", "4".to_string()),
        ("max_round_attempts", "100".to_string()),
        ("secure_aggregation", "on".to_string()),
        ("secure_aggregation.colluding_fraction", "0".to_string()),
        ("secure_aggregation.clip", quantization.clip.to_string()),
        (
            "secure_aggregation.max_weight",
            quantization.max_weight.to_string(),
        ),
        ("secure_aggregation.advertise_seconds", "1".to_string()),
        ("secure_aggregation.share_seconds", "30".to_string()),
        ("secure_aggregation.unmask_seconds", "30".to_string()),
        ("privacy", "on".to_string()),
        ("privacy.noise_multiplier", "1".to_string()),
        ("privacy.clip", "0.5".to_string()),
        ("privacy.delta", "0.00001".to_string()),
        ("privacy.epsilon_budget", "1000".to_string()),
        ("privacy.budget_against", "coordinator".to_string()),
    ]);
    let r = server
        .post("/experiments", Some(&session), &pairs(&form))
        .await;
    assert_eq!(
        r.status(),
        StatusCode::SEE_OTHER,
        "{}",
        r.text().await.unwrap()
    );
    let page = r.headers()[LOCATION].to_str().unwrap().to_string();
    let id = page.rsplit('/').next().unwrap().to_string();
    let spec = server
        .api(Method::GET, &format!("/experiments/{id}"), None)
        .await;
    assert_eq!(
        spec["spec"]["privacy"]["budget_against"], "coordinator",
        "{spec}"
    );

    // Five clients that check in and never answer: each secure attempt samples four,
    // fails at its advertise deadline and stays charged to them. Four of five, so that
    // until the fifth attempt some client has surely taken part in every one (with four of
    // twelve, two draws were disjoint one time in seven, and then the test could only run
    // on until its time was up) while sampling still amplifies the observers' figure.
    let now = cohort_coordinator::store::now_millis();
    let mut clients = Vec::new();
    for i in 0..5 {
        let hash = format!("dashboard-token-{i}").into_bytes();
        server
            .store
            .create_enrolment_token(&hash, "site", None)
            .await
            .unwrap();
        let c = server.store.enrol(&hash, b"secret", now).await.unwrap();
        clients.push(c.id);
    }
    server
        .api(Method::POST, &format!("/experiments/{id}/start"), None)
        .await;
    let started = std::time::Instant::now();
    let report = loop {
        let now = cohort_coordinator::store::now_millis();
        for c in &clients {
            server.store.touch_client(*c, now).await.unwrap();
        }
        let report = server
            .api(Method::GET, &format!("/experiments/{id}/privacy"), None)
            .await;
        if report["attempts_charged"].as_u64().unwrap() >= 2 {
            // Paused, nothing more is charged: the page and the report agree.
            server
                .api(Method::POST, &format!("/experiments/{id}/pause"), None)
                .await;
            let paused = server
                .api(Method::GET, &format!("/experiments/{id}/privacy"), None)
                .await;
            // The coordinator's epsilon exceeds the observers' for sure only when the
            // worst client took part in every charged attempt (the same rounds without
            // amplification); with disjoint draws either can be larger. Run on until then.
            if paused["worst_client_attempts"] == paused["attempts_charged"] {
                break paused;
            }
            server
                .api(Method::POST, &format!("/experiments/{id}/resume"), None)
                .await;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{report:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let observers = report["epsilon_spent"].as_f64().unwrap();
    let coordinator = report["epsilon_spent_coordinator"].as_f64().unwrap();
    assert!(coordinator > observers, "{report:#}");
    let html = askama_unescape(
        &server
            .get(&page, Some(&session))
            .await
            .text()
            .await
            .unwrap(),
    );
    let card = &html[html.find("id=\"privacy\"").unwrap()..];
    let card = &card[..card.find("</div>").unwrap()];
    // The budget holds against the coordinator: its figure is the big one.
    assert!(
        card.contains(&format!("id=\"privacy\">ε {coordinator:.3} of 1000</p>")),
        "{card}"
    );
    assert!(
        card.contains(&format!(
            "against observers of the published models: ε {observers:.3}"
        )),
        "{card}"
    );
    assert!(
        card.contains(&format!(
            "against the coordinator, which knows who took part: ε {coordinator:.3}"
        )),
        "{card}"
    );
    assert!(
        card.contains("(the budget of 1000 is enforced on this)"),
        "{card}"
    );
    assert!(html.contains("Epsilon vs coordinator"));
    let last = report["rounds"].as_array().unwrap().last().unwrap().clone();
    assert!(
        html.contains(&format!(
            "<td class=\"num\">{:.3}</td><td class=\"num\">{:.3}</td>",
            last["epsilon"].as_f64().unwrap(),
            last["epsilon_coordinator"].as_f64().unwrap()
        )),
        "{}",
        &html[html.find("id=\"rounds\"").unwrap()..][..1500]
    );

    // Central noise: the coordinator sees every update; no number is made up.
    let mut central = experiment_form(&csrf);
    central.extend([
        ("privacy", "on".to_string()),
        ("privacy.noise_multiplier", "1".to_string()),
        ("privacy.clip", "0.5".to_string()),
        ("privacy.delta", "0.00001".to_string()),
        ("privacy.epsilon_budget", "8".to_string()),
    ]);
    let r = server
        .post("/experiments", Some(&session), &pairs(&central))
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let page = r.headers()[LOCATION].to_str().unwrap().to_string();
    let html = askama_unescape(
        &server
            .get(&page, Some(&session))
            .await
            .text()
            .await
            .unwrap(),
    );
    assert!(
        html.contains(
            "id=\"privacy-coordinator\">against the coordinator: none holds (central noise"
        ),
        "{}",
        &html[html.find("id=\"privacy\"").unwrap()..][..600]
    );
    let id = page.rsplit('/').next().unwrap();
    let report = server
        .api(Method::GET, &format!("/experiments/{id}/privacy"), None)
        .await;
    assert!(report["epsilon_spent_coordinator"].is_null(), "{report:#}");
    assert!(
        report["epsilon_coordinator_unbounded"]
            .as_str()
            .unwrap()
            .contains("sees each one in the clear"),
        "{report:#}"
    );
    server.shut_down().await;
}

fn tiny_model() -> Vec<u8> {
    use cohort_aggregation::{Layout, ModelVector, TensorSpec};
    let layout = Layout::new(vec![
        TensorSpec::new("a.weight", [2, 3]),
        TensorSpec::new("b.bias", [2]),
    ])
    .unwrap();
    let v = ModelVector::new(std::sync::Arc::new(layout), vec![0.5; 8]).unwrap();
    cohort_aggregation::model_file::encode(&v, Default::default())
}

/// A model file uploaded on the models page is stored as the API stores it and listed;
/// a bad file is refused with its reason and stores nothing; the upload needs the
/// session's CSRF token and this site, like every other action.
#[tokio::test]
async fn model_files_are_uploaded_through_the_models_page() {
    let server = start().await;
    let session = server.sign_in().await;
    let r = server.get("/models", Some(&session)).await;
    assert_eq!(r.status(), StatusCode::OK);
    let html = r.text().await.unwrap();
    assert!(html.contains("href=\"/models\" aria-current=\"page\""));
    assert!(html.contains("enctype=\"multipart/form-data\""));
    assert!(html.contains("No model file has been uploaded yet"));
    let csrf = hidden(&html, "csrf");

    // Refused before anything is read: no token, a wrong one, another site.
    let r = server.upload(&session, None, "x", &tiny_model()).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = server
        .upload(&session, Some(&"0".repeat(64)), "x", &tiny_model())
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = server
        .http
        .post(server.url("/models"))
        .header(CONTENT_TYPE, "multipart/form-data; boundary=B")
        .header(COOKIE, &session)
        .header(ORIGIN, "https://evil.example")
        .body(format!(
            "--B\r\nContent-Disposition: form-data; name=\"csrf\"\r\n\r\n{csrf}\r\n--B--\r\n"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    // Without a session at all.
    let r = server
        .upload("cohort_session=none", Some(&csrf), "x", &tiny_model())
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(server.model_files().await.is_empty());

    // Files the API would refuse: each with its reason on the page, nothing stored.
    let mut truncated = tiny_model();
    truncated.truncate(truncated.len() - 4);
    for (bad, words) in [
        (b"not a safetensors file".to_vec(), "Model file:"),
        (truncated, "Model file:"),
        (Vec::new(), "Choose a safetensors file"),
    ] {
        let r = server
            .upload(&session, Some(&csrf), "<b>bad</b>", &bad)
            .await;
        assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let html = r.text().await.unwrap();
        let at = html.find("id=\"upload-error\"").expect("an upload error");
        assert!(html[at..].contains(words), "{}", &html[at..at + 200]);
        // What was typed comes back, escaped.
        assert!(
            html.contains("value=\"&#60;b&#62;bad&#60;/b&#62;\"")
                || html.contains("value=\"&lt;b&gt;bad&lt;/b&gt;\""),
            "name not shown escaped"
        );
    }
    assert!(server.model_files().await.is_empty());

    // A good file: stored, then listed with its size and tensors.
    let r = server
        .upload(&session, Some(&csrf), "tiny <net>", &tiny_model())
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let location = r.headers()[LOCATION].to_str().unwrap().to_string();
    let files = server.model_files().await;
    assert_eq!(files.len(), 1, "{files:?}");
    let id = files[0]["id"].as_str().unwrap().to_string();
    assert_eq!(files[0]["name"], "tiny <net>");
    assert_eq!(files[0]["parameters"], 8);
    assert_eq!(location, format!("/models?uploaded={id}"));
    let html = server
        .get(&location, Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(html.contains("id=\"uploaded\""), "{html}");
    assert!(html.contains(&format!("data-model-file=\"{id}\"")));
    assert!(html.contains("tiny &#60;net&#62;") || html.contains("tiny &lt;net&gt;"));
    assert!(!html.contains("tiny <net>"));
    assert!(html.contains("2 tensors") && html.contains("<code>a.weight</code> [2, 3]"));
    server.shut_down().await;
}

/// The server's body limit holds for uploads from the page too.
#[tokio::test]
async fn an_upload_over_the_body_limit_is_refused_and_stores_nothing() {
    let server = start_with(Some(4096)).await;
    let session = server.sign_in().await;
    let html = server
        .get("/models", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    let csrf = hidden(&html, "csrf");
    let r = server
        .upload(&session, Some(&csrf), "big", &vec![7u8; 8192])
        .await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(r.text().await.unwrap().contains("nothing was stored"));
    assert!(server.model_files().await.is_empty());
    // Other forms are read as urlencoded forms only: the multipart allowance is for
    // /models, so elsewhere the token in a multipart body is not found.
    let r = server
        .http
        .post(server.url("/tokens"))
        .header(CONTENT_TYPE, "multipart/form-data; boundary=B")
        .header(COOKIE, &session)
        .body(format!(
            "--B\r\nContent-Disposition: form-data; name=\"csrf\"\r\n\r\n{csrf}\r\n--B--\r\n"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    server.shut_down().await;
}

/// An experiment of a file model is made from the form (the initial model chosen from
/// the uploaded files, hyperparameters as JSON), and its page shows the clients'
/// evaluations and the task failures they report, escaped.
#[tokio::test]
async fn a_file_model_experiment_is_created_from_the_form_and_shows_client_reports() {
    let server = start().await;
    let session = server.sign_in().await;
    let html = server
        .get("/models", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    let csrf = hidden(&html, "csrf");
    let r = server
        .upload(&session, Some(&csrf), "tiny", &tiny_model())
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let file_id = server.model_files().await[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let html = server
        .get("/experiments/new", Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        html.contains(&format!("<option value=\"{file_id}\">tiny (")),
        "the uploaded file is not offered"
    );
    assert!(html.contains("<textarea id=\"hyperparameters\""));

    let form_with = |changes: &[(&'static str, &str)]| {
        let mut form = experiment_form(&csrf);
        for (k, v) in changes {
            form.retain(|(key, _)| key != k);
            form.push((k, v.to_string()));
        }
        form
    };
    // Each problem next to its field.
    let unknown = uuid::Uuid::new_v4().to_string();
    for (changes, field, words) in [
        (
            vec![("model", "file")],
            "initial_model",
            "initial_model is required with model `file`",
        ),
        (
            vec![("model", "file"), ("initial_model", unknown.as_str())],
            "initial_model",
            "initial_model: no uploaded model file",
        ),
        (
            vec![("model", "file"), ("initial_model", "tiny")],
            "initial_model",
            "`tiny` is not a model file id",
        ),
        (
            // A built-in model whose tensors are not the file's.
            vec![("model", "logreg"), ("initial_model", file_id.as_str())],
            "initial_model",
            "initial_model: not a logreg model",
        ),
        (
            vec![
                ("model", "file"),
                ("initial_model", file_id.as_str()),
                ("hyperparameters", "[1, 2]"),
            ],
            "hyperparameters",
            "must be a JSON object",
        ),
    ] {
        let form = form_with(&changes);
        let r = server
            .post("/experiments", Some(&session), &pairs(&form))
            .await;
        assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY, "{changes:?}");
        let html = r.text().await.unwrap();
        let id = format!("id=\"{field}-error\">");
        let at = html
            .find(&id)
            .unwrap_or_else(|| panic!("no message for {field} with {changes:?}"));
        let shown = askama_unescape(&html[at + id.len()..at + id.len() + 200]);
        assert!(shown.starts_with(words), "{changes:?}: {shown}");
    }
    assert!(
        server
            .api(Method::GET, "/experiments", None)
            .await
            .as_array()
            .unwrap()
            .is_empty()
    );

    let form = form_with(&[
        ("model", "file"),
        ("initial_model", &file_id),
        ("hyperparameters", "{\"epochs\": 2, \"note\": \"<x>\"}"),
    ]);
    let r = server
        .post("/experiments", Some(&session), &pairs(&form))
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let page = r.headers()[LOCATION].to_str().unwrap().to_string();
    let list = server.api(Method::GET, "/experiments", None).await;
    let spec = &list[0]["spec"];
    assert_eq!(spec["model"], "file", "{spec}");
    assert_eq!(spec["initial_model"], file_id.as_str(), "{spec}");
    assert_eq!(spec["tensors"].as_array().unwrap().len(), 2, "{spec}");
    assert_eq!(spec["hyperparameters"]["epochs"], 2, "{spec}");
    let exp: uuid::Uuid = page.rsplit('/').next().unwrap().parse().unwrap();

    // Before any report: a file model's page has the failures panel, empty.
    let html = server
        .get(&page, Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(html.contains("No client has reported a failed task."));
    assert!(html.contains("id=\"initial-evaluation\">not reported yet<"));

    // What clients report, recorded in the server's own database.
    let store = cohort_coordinator::store::Store::connect("sqlite://cohort.db", server.dir.path())
        .await
        .unwrap();
    store
        .create_enrolment_token(b"token-hash", "site", None)
        .await
        .unwrap();
    let client = store.enrol(b"token-hash", b"secret-hash", 1).await.unwrap();
    store
        .record_client_evaluation(
            exp,
            &cohort_coordinator::store::ClientEvaluation {
                model_version: 0,
                client_id: client.id,
                num_examples: 40,
                metrics: [("accuracy".to_string(), 0.75), ("loss".to_string(), 0.5)]
                    .into_iter()
                    .collect(),
                at: 1,
                withheld: None,
            },
        )
        .await
        .unwrap();
    store
        .record_task_failure(
            exp,
            &cohort_coordinator::store::TaskFailure {
                round: 1,
                attempt: 1,
                client_id: client.id,
                reason: "trainer exited 1: <script>alert(1)</script> & more".into(),
                at: 2,
            },
        )
        .await
        .unwrap();

    let html = server
        .get(&page, Some(&session))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        askama_unescape(&html).contains("<h2>Latest accuracy (clients' evaluation)</h2>"),
        "no clients' evaluation card"
    );
    let at = html
        .find("id=\"initial-evaluation\">")
        .expect("initial evaluation");
    assert!(
        html[at..].contains("accuracy 75.0%, loss 0.5000 (1 clients, 40 examples)"),
        "{}",
        &html[at..at + 200]
    );
    let at = html.find("id=\"task-failures\"").expect("failures table");
    let table = &html[at..];
    assert!(table.contains(&client.id.to_string()));
    assert!(
        !html.contains("<script>alert(1)"),
        "a reason was not escaped"
    );
    assert!(
        askama_unescape(table).contains("trainer exited 1: <script>alert(1)</script> & more"),
        "{}",
        &table[..600.min(table.len())]
    );
    server.shut_down().await;
}

/// `html` with the entities askama writes turned back into characters.
fn askama_unescape(html: &str) -> String {
    html.replace("&#60;", "<")
        .replace("&lt;", "<")
        .replace("&#62;", ">")
        .replace("&gt;", ">")
        .replace("&#34;", "\"")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&#x27;", "'")
        .replace("&#96;", "`")
        .replace("&#38;", "&")
        .replace("&amp;", "&")
}

/// Creates and starts an experiment from `spec`, with `clients` enrolled clients that
/// check in until its first round opens: the experiment's id and the clients.
async fn running_with_round(
    server: &Server,
    spec: serde_json::Value,
    clients: usize,
) -> (uuid::Uuid, Vec<uuid::Uuid>) {
    let created = server.api(Method::POST, "/experiments", Some(spec)).await;
    let experiment: uuid::Uuid = created["id"].as_str().unwrap().parse().unwrap();
    let now = cohort_coordinator::store::now_millis();
    let mut ids = Vec::new();
    for i in 0..clients {
        let hash = format!("{experiment}-token-{i}").into_bytes();
        server
            .store
            .create_enrolment_token(&hash, "site", None)
            .await
            .unwrap();
        ids.push(server.store.enrol(&hash, b"secret", now).await.unwrap().id);
    }
    server
        .api(
            Method::POST,
            &format!("/experiments/{experiment}/start"),
            None,
        )
        .await;
    let started = std::time::Instant::now();
    while server
        .store
        .latest_round(experiment)
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no round opened"
        );
        touch(server, &ids).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (experiment, ids)
}

/// Marks `clients` available now.
async fn touch(server: &Server, clients: &[uuid::Uuid]) {
    for c in clients {
        server
            .store
            .touch_client(*c, cohort_coordinator::store::now_millis())
            .await
            .unwrap();
    }
}

/// Records `client`'s upload to round 1 attempt 1 straight in the store, naming a blob
/// that was never written: the round counts it, and its aggregation cannot read it.
async fn upload_without_blob(server: &Server, experiment: uuid::Uuid, client: uuid::Uuid) {
    server
        .store
        .record_upload(
            experiment,
            1,
            1,
            &cohort_coordinator::store::NewUpload {
                client_id: client,
                blob_path: "uploads/never-written",
                bytes: 16,
                sha256: &[7; 32],
                num_samples: 10,
                claimed_samples: None,
                train_loss: Some(0.5),
                client_upload_id: None,
                wire_bytes: None,
            },
            cohort_coordinator::store::now_millis(),
        )
        .await
        .unwrap();
}

/// Issue 22: an aggregation job that fails every attempt (here: the upload's blob is
/// gone) left its round `aggregating` for ever, and the experiment with it. Now the
/// driver fails the round with the job's last error, the round runs again as its next
/// attempt, and the experiment's page shows why the first one failed.
#[tokio::test]
async fn a_round_whose_aggregation_fails_every_attempt_fails_and_runs_again() {
    let server = start().await;
    let spec = serde_json::json!({"name": "lost blob", "features": 4, "classes": 2,
        "model": "logreg", "rounds": 1, "clients_per_round": 1, "min_participants": 1,
        "collect_deadline_seconds": 60, "max_round_attempts": 3});
    let (experiment, clients) = running_with_round(&server, spec, 1).await;
    // Every attempt of this upload's aggregation job fails.
    upload_without_blob(&server, experiment, clients[0]).await;
    let started = std::time::Instant::now();
    let wait = |what: &str| {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        )
    };
    let failed = loop {
        wait("round 1 attempt 1 to fail");
        let rounds = server.store.rounds(experiment).await.unwrap();
        if let Some(first) = rounds.iter().find(|r| r.round == 1 && r.attempt == 1)
            && first.stage == cohort_coordinator::store::RoundStage::Failed
        {
            break first.clone();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let reason = failed.failure.clone().unwrap_or_default();
    assert!(
        reason.starts_with("aggregation failed 5 times: "),
        "{reason}"
    );
    // The round runs again as its next attempt (the client is still available).
    loop {
        wait("round 1 attempt 2");
        touch(&server, &clients).await;
        if server
            .store
            .round(experiment, 1, 2)
            .await
            .is_ok_and(|r| r.stage == cohort_coordinator::store::RoundStage::Collecting)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let session = server.sign_in().await;
    let html = askama_unescape(
        &server
            .get(&format!("/experiments/{experiment}"), Some(&session))
            .await
            .text()
            .await
            .unwrap(),
    );
    assert!(html.contains("aggregation failed 5 times"), "{html}");
    server.shut_down().await;
}

/// Hands `client` the only task of FedBuff experiment `experiment` (concurrency 1) and
/// records its update straight in the store as the blob at `path` (`bytes` long, with
/// `sha256`), which
/// fills the one-update buffer of the experiment's last step and queues its
/// aggregation.
async fn buffer_upload(
    server: &Server,
    experiment: uuid::Uuid,
    client: uuid::Uuid,
    path: &str,
    bytes: i64,
    sha256: &[u8],
) {
    let now = cohort_coordinator::store::now_millis();
    let task = server
        .store
        .fedbuff_task(experiment, client, 1, 60_000, true, now)
        .await
        .unwrap()
        .expect("a task for the only client");
    server
        .store
        .record_fedbuff_upload(
            experiment,
            task.round,
            task.attempt,
            &cohort_coordinator::store::NewUpload {
                client_id: client,
                blob_path: path,
                bytes,
                sha256,
                num_samples: 10,
                claimed_samples: None,
                train_loss: Some(0.5),
                client_upload_id: None,
                wire_bytes: None,
            },
            cohort_coordinator::store::BufferRules {
                buffer_size: 1,
                max_staleness: None,
                task_ms: 60_000,
                last_step: 1,
                job_attempts: 5,
            },
            now,
        )
        .await
        .unwrap();
}

/// Issue 22: in FedBuff mode a full buffer whose aggregation job failed every try stayed
/// `aggregating` for ever, and every later buffer's job waited on it. Now the driver
/// fails that attempt with the job's last error and aggregates the same buffered update
/// again as the buffer's next attempt; here the blob the first attempt could not read is
/// back by then, so the second attempt publishes the version and the experiment
/// finishes.
#[tokio::test]
async fn a_buffer_whose_aggregation_fails_every_attempt_runs_again() {
    use cohort_coordinator::store::RoundStage;
    let server = start().await;
    let spec = serde_json::json!({"name": "lost buffered blob", "features": 4, "classes": 2,
        "model": "logreg", "rounds": 1, "clients_per_round": 1, "min_participants": 1,
        "mode": "fedbuff", "buffer_size": 1, "concurrency": 1,
        "collect_deadline_seconds": 60, "max_round_attempts": 2});
    let (experiment, clients) = running_with_round(&server, spec, 1).await;
    // The update is the initial model itself (a valid upload of the right size); its
    // blob is written only after the first attempt has failed.
    let blobs =
        cohort_coordinator::blobs::BlobStore::open(&server.dir.path().join("blobs")).unwrap();
    let update = blobs
        .get(&format!("models/{experiment}/round-0.bin"))
        .unwrap();
    let scratch = blobs.put("scratch/update", &update).unwrap();
    let path = format!("uploads/{experiment}/late");
    buffer_upload(
        &server,
        experiment,
        clients[0],
        &path,
        update.len() as i64,
        &scratch.sha256,
    )
    .await;
    let started = std::time::Instant::now();
    let wait = |what: &str| {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        )
    };
    let (failed, retry) = loop {
        wait("buffer 1 attempt 1 to fail and attempt 2 to aggregate");
        let rounds = server.store.rounds(experiment).await.unwrap();
        let first = rounds.iter().find(|r| r.round == 1 && r.attempt == 1);
        let second = rounds.iter().find(|r| r.round == 1 && r.attempt == 2);
        if let (Some(first), Some(second)) = (first, second)
            && first.stage == RoundStage::Failed
        {
            break (first.clone(), second.clone());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let reason = failed.failure.clone().unwrap_or_default();
    assert!(
        reason.starts_with("aggregation failed 5 times: "),
        "{reason}"
    );
    assert_eq!(
        retry.reported, 1,
        "the retry aggregates the same buffered update"
    );
    blobs.put(&path, &update).unwrap();
    loop {
        wait("version 1 to publish and the experiment to finish");
        let exp = server.store.experiment(experiment).await.unwrap();
        if exp.state == cohort_coordinator::store::ExperimentState::Finished {
            break;
        }
        assert_ne!(
            exp.state,
            cohort_coordinator::store::ExperimentState::Failed
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let published = server.store.round(experiment, 1, 2).await.unwrap();
    assert_eq!(published.stage, RoundStage::Published);
    server.shut_down().await;
}

/// A buffer whose every aggregation attempt fails fails its experiment, with the
/// reason in the audit log, instead of holding it for ever.
#[tokio::test]
async fn a_buffer_that_fails_its_last_attempt_fails_the_experiment() {
    use cohort_coordinator::store::ExperimentState;
    let server = start().await;
    let spec = serde_json::json!({"name": "lost for good", "features": 4, "classes": 2,
        "model": "logreg", "rounds": 1, "clients_per_round": 1, "min_participants": 1,
        "mode": "fedbuff", "buffer_size": 1, "concurrency": 1,
        "collect_deadline_seconds": 60, "max_round_attempts": 1});
    let (experiment, clients) = running_with_round(&server, spec, 1).await;
    buffer_upload(
        &server,
        experiment,
        clients[0],
        "uploads/never-written",
        16,
        &[7; 32],
    )
    .await;
    let started = std::time::Instant::now();
    while server.store.experiment(experiment).await.unwrap().state != ExperimentState::Failed {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the experiment never failed: {:?}",
            server.store.rounds(experiment).await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let audit = server.store.audit_log(50).await.unwrap();
    assert!(
        audit
            .iter()
            .any(|e| e.action == "experiment.state" && e.detail.contains("buffer 1 failed 1 times")),
        "{audit:?}"
    );
    server.shut_down().await;
}

/// Issue 22: a revoked client stayed selected, so its round waited for it until the
/// deadline (here a minute). Now the revocation takes it out: the round closes on the
/// other client's upload alone, long before its deadline.
#[tokio::test]
async fn a_round_goes_on_without_a_client_revoked_in_it() {
    let server = start().await;
    let spec = serde_json::json!({"name": "revoked", "features": 4, "classes": 2,
        "model": "logreg", "rounds": 1, "clients_per_round": 2, "min_participants": 1,
        "collect_deadline_seconds": 60});
    let (experiment, clients) = running_with_round(&server, spec, 2).await;
    upload_without_blob(&server, experiment, clients[0]).await;
    let revoked = std::time::Instant::now();
    server
        .api(
            Method::POST,
            &format!("/clients/{}/revoke", clients[1]),
            None,
        )
        .await;
    loop {
        let round = server.store.round(experiment, 1, 1).await.unwrap();
        if round.stage != cohort_coordinator::store::RoundStage::Collecting {
            assert_eq!((round.reported, round.dropped), (1, 1), "{round:?}");
            break;
        }
        assert!(
            revoked.elapsed() < Duration::from_secs(20),
            "the round still waits for the revoked client: {round:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.shut_down().await;
}

/// A dashboard form post: path, fields, and the role it needs.
type DashboardAction<'a> = (String, Vec<(&'a str, &'a str)>, &'a str);

/// People sign in to the dashboard by name with their own token, and each action of
/// the dashboard is allowed or refused (403, before the form is read) by their role,
/// as the API's are; the audit log names the person; revoking them ends their session.
#[tokio::test]
async fn people_sign_in_by_name_and_each_dashboard_action_follows_their_role() {
    let server = start().await;
    let exp = server
        .api(
            Method::POST,
            "/experiments",
            Some(serde_json::json!({
                "name": "roles", "features": 4, "classes": 2, "model": "logreg",
                "rounds": 1, "clients_per_round": 1, "min_participants": 1
            })),
        )
        .await;
    let exp_id = exp["id"].as_str().unwrap().to_string();
    let mut people = Vec::new();
    for (name, role) in [("vera", "viewer"), ("otto", "operator"), ("ada", "admin")] {
        let user = server
            .api(
                Method::POST,
                "/users",
                Some(serde_json::json!({"name": name, "role": role})),
            )
            .await;
        people.push((name, role, user["token"].as_str().unwrap().to_string()));
    }
    // A name with another person's token, or a wrong token, signs nobody in.
    let page = server.get("/sign-in", None).await;
    let form_cookie = cookie_pair(&page, "cohort_sign_in").unwrap();
    let form_token = hidden(&page.text().await.unwrap(), "csrf");
    let r = server
        .post(
            "/sign-in",
            Some(&form_cookie),
            &[
                ("csrf", &form_token),
                ("name", "vera"),
                ("token", &people[2].2),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(cookie_pair(&r, "cohort_session").is_none());

    let rank = |role: &str| {
        ["viewer", "operator", "admin"]
            .iter()
            .position(|r| *r == role)
    };
    for (name, role, token) in &people {
        let cookie = server.sign_in_as(name, token).await;
        let html = server
            .get("/experiments", Some(&cookie))
            .await
            .text()
            .await
            .unwrap();
        let csrf = hidden(&html, "csrf");
        for page in [
            "/experiments",
            "/clients",
            "/models",
            &format!("/experiments/{exp_id}"),
        ] {
            let r = server.get(page, Some(&cookie)).await;
            assert_eq!(r.status(), StatusCode::OK, "{name} reads {page}");
        }
        let create = experiment_form(&csrf);
        let unknown = "00000000-0000-4000-8000-000000000000";
        let actions: Vec<DashboardAction<'_>> = vec![
            ("/experiments".into(), pairs(&create), "operator"),
            (
                format!("/experiments/{exp_id}/pause"),
                vec![("csrf", &csrf)],
                "operator",
            ),
            (
                "/tokens".into(),
                vec![("csrf", &csrf), ("label", "site")],
                "admin",
            ),
            (
                format!("/tokens/{unknown}/revoke"),
                vec![("csrf", &csrf)],
                "admin",
            ),
            (
                format!("/clients/{unknown}/revoke"),
                vec![("csrf", &csrf)],
                "admin",
            ),
        ];
        for (path, fields, needed) in actions {
            let r = server.post(&path, Some(&cookie), &fields).await;
            if rank(role) >= rank(needed) {
                assert_ne!(
                    r.status(),
                    StatusCode::FORBIDDEN,
                    "{name} ({role}) POST {path}"
                );
            } else {
                assert_eq!(
                    r.status(),
                    StatusCode::FORBIDDEN,
                    "{name} ({role}) POST {path}"
                );
                let text = r.text().await.unwrap();
                assert!(text.contains(needed), "{text}");
            }
        }
        let r = server
            .upload(&cookie, Some(&csrf), "tiny", &tiny_model())
            .await;
        if *role == "admin" {
            assert_ne!(r.status(), StatusCode::FORBIDDEN, "{name} uploads a model");
        } else {
            assert_eq!(r.status(), StatusCode::FORBIDDEN, "{name} uploads a model");
        }
        // Anyone signed in may sign out.
        let r = server
            .post("/sign-out", Some(&cookie), &[("csrf", &csrf)])
            .await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER, "{name} signs out");
    }

    // The audit log names the person and the channel.
    let audit = server.api(Method::GET, "/audit?limit=1000", None).await;
    let actors: Vec<&str> = audit
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["actor"].as_str().unwrap())
        .collect();
    assert!(
        actors
            .iter()
            .any(|a| a.starts_with("otto (operator) via dashboard session ")),
        "{actors:?}"
    );
    assert!(
        actors
            .iter()
            .any(|a| a.starts_with("ada (admin) via dashboard session "))
    );

    // Revoking a person ends their session at once.
    let users = server.api(Method::GET, "/users", None).await;
    let otto = users
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "otto")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let cookie = server.sign_in_as("otto", &people[1].2).await;
    assert_eq!(
        server.get("/experiments", Some(&cookie)).await.status(),
        StatusCode::OK
    );
    server
        .api(Method::POST, &format!("/users/{otto}/revoke"), None)
        .await;
    let r = server.get("/experiments", Some(&cookie)).await;
    assert_eq!(
        r.status(),
        StatusCode::SEE_OTHER,
        "a revoked person is signed out"
    );
    server.shut_down().await;
}
