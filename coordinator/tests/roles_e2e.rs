//! People and roles, end to end on a real `cohort serve`: an admin (the admin token)
//! creates a viewer, an operator and an admin, each with a token of their own.
//!
//! What it protects:
//! - every documented admin operation, tried as each role, is allowed or refused with
//!   403 exactly as the table below says — and the table is the one the OpenAPI
//!   document states (`x-cohort-role`), and names every documented admin operation, so
//!   a new route cannot slip in without a decision;
//! - the audit log names the person for what they did;
//! - a revoked person's token is refused; tokens are never listed.

mod common;

use std::collections::BTreeMap;

use cohort_coordinator::server::http::documented_admin_routes;
use common::{ADMIN, Served};
use reqwest::{Method, StatusCode};

/// The role each admin operation needs, written out by hand: what the README and the
/// API document promise, checked independently of the code that enforces it.
fn expected_roles() -> BTreeMap<(String, String), &'static str> {
    let rows: &[(&str, &str, &str)] = &[
        ("GET", "/whoami", "viewer"),
        ("GET", "/experiments", "viewer"),
        ("POST", "/experiments", "operator"),
        ("GET", "/experiments/{id}", "viewer"),
        ("POST", "/experiments/{id}/start", "operator"),
        ("POST", "/experiments/{id}/pause", "operator"),
        ("POST", "/experiments/{id}/resume", "operator"),
        ("POST", "/experiments/{id}/stop", "operator"),
        ("GET", "/experiments/{id}/rounds", "viewer"),
        ("GET", "/experiments/{id}/privacy", "viewer"),
        (
            "GET",
            "/experiments/{id}/rounds/{round}/attempts/{attempt}",
            "viewer",
        ),
        ("GET", "/experiments/{id}/jobs", "viewer"),
        ("GET", "/experiments/{id}/model", "viewer"),
        ("GET", "/experiments/{id}/model.safetensors", "viewer"),
        ("GET", "/experiments/{id}/evaluations", "viewer"),
        ("GET", "/experiments/{id}/evaluations/{version}", "viewer"),
        ("GET", "/experiments/{id}/fedbuff", "viewer"),
        ("GET", "/enrolment-tokens", "viewer"),
        ("POST", "/enrolment-tokens", "admin"),
        ("POST", "/enrolment-tokens/{id}/revoke", "admin"),
        ("GET", "/clients", "viewer"),
        ("DELETE", "/clients/{id}/identity", "admin"),
        ("POST", "/clients/{id}/revoke", "admin"),
        ("GET", "/models", "viewer"),
        ("POST", "/models", "admin"),
        ("GET", "/models/{id}", "viewer"),
        ("GET", "/audit", "viewer"),
        ("GET", "/users", "viewer"),
        ("POST", "/users", "admin"),
        ("POST", "/users/{id}/revoke", "admin"),
    ];
    rows.iter()
        .map(|(m, p, r)| ((m.to_string(), format!("/api/v1/admin{p}")), *r))
        .collect()
}

fn rank(role: &str) -> u8 {
    match role {
        "viewer" => 0,
        "operator" => 1,
        "admin" => 2,
        other => panic!("no role {other}"),
    }
}

/// `path` with each `{parameter}` replaced by a well-formed id, so that what answers is
/// the guard (or, once past it, the handler), not the router.
fn concrete(path: &str) -> String {
    path.split('/')
        .map(|seg| {
            if seg.starts_with('{') && seg.ends_with('}') {
                "00000000-0000-4000-8000-000000000000"
            } else {
                seg
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

async fn create_user(server: &Served, name: &str, role: &str) -> (String, String) {
    let body = common::admin(
        &server.http,
        &server.base,
        Method::POST,
        "/users",
        Some(serde_json::json!({"name": name, "role": role})),
    )
    .await;
    (
        body["id"].as_str().unwrap().to_string(),
        body["token"].as_str().unwrap().to_string(),
    )
}

async fn call(
    server: &Served,
    token: &str,
    method: Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (StatusCode, serde_json::Value) {
    let mut req = server
        .http
        .request(method, format!("{}{path}", server.base))
        .bearer_auth(token);
    req = match body {
        Some(b) => req.json(&b),
        None => req
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body("{}"),
    };
    let r = req.send().await.unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_is_allowed_or_refused_by_role_as_documented() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let people = [
        (
            "vera",
            "viewer",
            create_user(&server, "vera", "viewer").await.1,
        ),
        (
            "otto",
            "operator",
            create_user(&server, "otto", "operator").await.1,
        ),
        ("ada", "admin", create_user(&server, "ada", "admin").await.1),
    ];

    // The document states the table, and the table names every documented operation.
    let expected = expected_roles();
    let doc: serde_json::Value = server
        .http
        .get(format!("{}/api/v1/openapi.json", server.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let routes = documented_admin_routes();
    assert_eq!(routes.len(), expected.len(), "{routes:?}");
    for (method, path) in &routes {
        let key = (method.to_string(), path.clone());
        let role = expected
            .get(&key)
            .unwrap_or_else(|| panic!("{method} {path} has no role in the table"));
        let stated = &doc["paths"][path][method.as_str().to_lowercase()]["x-cohort-role"];
        assert_eq!(stated, role, "{method} {path}: the document says {stated}");
    }

    for (name, role, token) in &people {
        for (method, path) in &routes {
            let needed = expected[&(method.to_string(), path.clone())];
            let (status, body) = call(&server, token, method.clone(), &concrete(path), None).await;
            if rank(role) >= rank(needed) {
                assert!(
                    status != StatusCode::FORBIDDEN && status != StatusCode::UNAUTHORIZED,
                    "{name} ({role}) {method} {path}: {status} {body}"
                );
            } else {
                assert_eq!(
                    status,
                    StatusCode::FORBIDDEN,
                    "{name} ({role}) {method} {path}"
                );
                assert_eq!(body["error"]["code"], "forbidden");
                let message = body["error"]["message"].as_str().unwrap();
                assert!(
                    message.contains(name) && message.contains(needed),
                    "{message}"
                );
            }
        }
        // Metrics are a read.
        let r = server
            .http
            .get(format!("{}/metrics", server.base))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{name} reads /metrics");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_log_names_the_person_and_revoked_tokens_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::serve_in(dir.path()).await;
    let (_, otto) = create_user(&server, "otto", "operator").await;
    let (ada_id, ada) = create_user(&server, "ada", "admin").await;
    let (vera_id, vera) = create_user(&server, "vera", "viewer").await;

    let (status, me) = call(&server, &otto, Method::GET, "/api/v1/admin/whoami", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(me, serde_json::json!({"name": "otto", "role": "operator"}));

    let spec = serde_json::json!({
        "name": "audited", "features": 4, "classes": 2, "model": "logreg",
        "rounds": 1, "clients_per_round": 1, "min_participants": 1
    });
    let (status, exp) = call(
        &server,
        &otto,
        Method::POST,
        "/api/v1/admin/experiments",
        Some(spec),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{exp}");
    let (status, _) = call(
        &server,
        &ada,
        Method::POST,
        "/api/v1/admin/enrolment-tokens",
        Some(serde_json::json!({"label": "site"})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _) = call(
        &server,
        &ada,
        Method::POST,
        &format!("/api/v1/admin/users/{vera_id}/revoke"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);

    let audit = common::admin(&server.http, &server.base, Method::GET, "/audit", None).await;
    let actor_of = |action: &str| -> String {
        audit
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["action"] == action)
            .unwrap_or_else(|| panic!("no {action} in {audit}"))["actor"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(
        actor_of("experiment.create").starts_with("otto (operator) via api from "),
        "{audit}"
    );
    assert!(actor_of("token.create").starts_with("ada (admin) via api from "));
    assert!(actor_of("user.revoke").starts_with("ada (admin) via api from "));
    assert!(actor_of("user.create").starts_with("admin via api from "));

    // Vera is revoked: her token no longer works. Nobody's token is ever listed.
    let (status, _) = call(&server, &vera, Method::GET, "/api/v1/admin/whoami", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let users = common::admin(&server.http, &server.base, Method::GET, "/users", None).await;
    let text = users.to_string();
    for token in [&otto, &ada, &vera] {
        let secret = token.split_once('.').unwrap().1;
        assert!(!text.contains(secret));
    }
    assert!(text.contains(&ada_id));
    // A name is one person's; the reserved names are refused.
    for (name, status) in [
        ("otto", StatusCode::CONFLICT),
        ("admin", StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let (got, _) = call(
            &server,
            ADMIN,
            Method::POST,
            "/api/v1/admin/users",
            Some(serde_json::json!({"name": name, "role": "viewer"})),
        )
        .await;
        assert_eq!(got, status, "{name}");
    }
}
