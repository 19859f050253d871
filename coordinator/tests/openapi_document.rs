//! The API's contract as a generated client reads it: the OpenAPI document must say what
//! the handlers do. Each test protects one thing a client generator (openapi-python-client,
//! openapi-generator) builds code from: where a parameter goes, what a success answer
//! holds, the values an enum field takes, the bounds the server enforces, the bytes an
//! octet-stream body carries. The served document is also compared, byte for byte, with
//! the committed `docs/openapi.json` (in `server_http.rs`).

use serde_json::Value;

fn document() -> Value {
    serde_json::to_value(cohort_coordinator::server::http::openapi()).unwrap()
}

/// Every operation: (method, path, operation).
fn operations(doc: &Value) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if ["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                out.push((method.clone(), path.clone(), op.clone()));
            }
        }
    }
    out
}

/// Follows a `$ref` to `#/components/schemas/...`.
fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(r) => {
            let name = r.trim_start_matches("#/components/schemas/");
            let found = &doc["components"]["schemas"][name];
            assert!(!found.is_null(), "{r} is not in the components");
            found
        }
        None => schema,
    }
}

fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
    let s = &doc["components"]["schemas"][name];
    assert!(!s.is_null(), "no schema {name}");
    s
}

/// A property's schema, through `oneOf: [null, X]` and `allOf` wrappers and `$ref`s.
fn property<'a>(doc: &'a Value, schema_name: &str, field: &str) -> &'a Value {
    let p = &schema(doc, schema_name)["properties"][field];
    assert!(!p.is_null(), "{schema_name} has no property {field}");
    unwrap_nullable(doc, p)
}

fn unwrap_nullable<'a>(doc: &'a Value, p: &'a Value) -> &'a Value {
    for key in ["oneOf", "anyOf", "allOf"] {
        if let Some(options) = p[key].as_array()
            && let Some(real) = options.iter().find(|o| o["type"] != "null")
        {
            return unwrap_nullable(doc, real);
        }
    }
    resolve(doc, p)
}

fn parameter<'a>(op: &'a Value, name: &str) -> &'a Value {
    op["parameters"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("no parameter {name}"))
}

const UPDATE: &str = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/update";

/// A generator puts a path parameter into the URL template and makes it required: a
/// query parameter declared as one can never be sent, and an optional one never left out.
#[test]
fn query_parameters_are_declared_in_the_query_and_optional_ones_are_optional() {
    let doc = document();
    let cases = [
        ("post", UPDATE, "num_samples"),
        ("post", UPDATE, "train_loss"),
        ("post", UPDATE, "upload_id"),
        (
            "get",
            "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/roster",
            "wait_seconds",
        ),
        ("post", "/api/v1/admin/models", "name"),
        ("get", "/api/v1/admin/audit", "limit"),
        ("get", "/api/v1/admin/audit", "before"),
    ];
    for (method, path, name) in cases {
        let p = parameter(&doc["paths"][path][method], name);
        assert_eq!(p["in"], "query", "{method} {path} {name}");
        assert_ne!(p["required"], true, "{method} {path} {name} is optional");
    }
    // And every parameter declared in the path is in the template.
    for (method, path, op) in operations(&doc) {
        for p in op["parameters"].as_array().into_iter().flatten() {
            if p["in"] == "path" {
                let name = p["name"].as_str().unwrap();
                assert!(
                    path.contains(&format!("{{{name}}}")),
                    "{method} {path}: path parameter {name} is not in the path"
                );
            }
        }
    }
}

/// Success answers that have no body, as their handlers send them: a client's reports
/// are acknowledged by the status alone.
const ANSWERED_WITHOUT_BODY: &[(&str, &str)] = &[
    ("post", "/api/v1/clients/experiments/{id}/evaluations"),
    (
        "post",
        "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/failure",
    ),
];

/// A client needs the body of every success answer (creating an experiment returns the
/// `id` every later call names); only 204 and the acknowledgements above have none. And
/// every answer has a description, which OpenAPI requires.
#[test]
fn every_success_answer_documents_its_body() {
    let doc = document();
    let mut missing = Vec::new();
    for (method, path, op) in operations(&doc) {
        for (status, response) in op["responses"].as_object().unwrap() {
            assert!(
                response["description"]
                    .as_str()
                    .is_some_and(|d| !d.is_empty()),
                "{method} {path} {status}: no description"
            );
            if !status.starts_with('2')
                || status == "204"
                || ANSWERED_WITHOUT_BODY.contains(&(method.as_str(), path.as_str()))
            {
                continue;
            }
            let content = response["content"].as_object();
            let described = content.is_some_and(|c| {
                c.values()
                    .all(|media| media["schema"].is_object() || media["schema"].is_boolean())
                    && !c.is_empty()
            });
            if !described {
                missing.push(format!("{method} {path} {status}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "success answers without a body: {missing:#?}"
    );
    let created = &doc["paths"]["/api/v1/admin/experiments"]["post"]["responses"]["201"];
    let body = resolve(&doc, &created["content"]["application/json"]["schema"]);
    assert!(
        body["required"]
            .as_array()
            .is_some_and(|r| r.contains(&Value::from("id"))),
        "the created experiment's id: {body}"
    );
}

/// States and stages are closed sets; a generator makes them enums only when the
/// document lists their values.
#[test]
fn experiment_states_and_round_stages_are_enumerated() {
    let doc = document();
    let values = |s: &Value| -> Vec<String> {
        s["enum"]
            .as_array()
            .unwrap_or_else(|| panic!("not an enum: {s}"))
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let states = values(property(&doc, "Experiment", "state"));
    for s in [
        "created", "running", "paused", "stopped", "finished", "failed",
    ] {
        assert!(states.contains(&s.to_string()), "{s} in {states:?}");
    }
    let stages = values(property(&doc, "Round", "stage"));
    for s in [
        "collecting",
        "aggregating",
        "published",
        "failed",
        "advertising",
        "unmasking",
    ] {
        assert!(stages.contains(&s.to_string()), "{s} in {stages:?}");
    }
    for reply in [
        "RosterReply",
        "DirectoryReply",
        "SharesReply",
        "SurvivorsReply",
        "Accepted",
    ] {
        assert_eq!(
            values(property(&doc, reply, "stage")),
            stages,
            "{reply}.stage"
        );
    }
    for (schema_name, field) in [
        ("Job", "state"),
        ("Job", "kind"),
        ("Participation", "state"),
    ] {
        assert!(!values(property(&doc, schema_name, field)).is_empty());
    }
}

/// The bounds the server enforces are in the document, so that a client can check
/// before it sends, and the fields a spec cannot do without are required.
#[test]
fn required_fields_and_bounds_are_stated() {
    let doc = document();
    let spec = schema(&doc, "ExperimentSpec");
    let required: Vec<&str> = spec["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for field in [
        "name",
        "model",
        "rounds",
        "clients_per_round",
        "min_participants",
    ] {
        assert!(required.contains(&field), "{field} in {required:?}");
    }
    // Each bound as the server enforces it: the constant its check uses, where it has one.
    let samples = &parameter(&doc["paths"][UPDATE]["post"], "num_samples")["schema"];
    let bounds = [
        (
            property(&doc, "ExperimentSpec", "clients_per_round"),
            "maximum",
            cohort_core::spec::MAX_CLIENTS_PER_ROUND as f64,
        ),
        (
            property(&doc, "ExperimentSpec", "rounds"),
            "maximum",
            100_000.0,
        ),
        (
            property(&doc, "ExperimentSpec", "max_round_attempts"),
            "maximum",
            f64::from(cohort_core::spec::MAX_ROUND_ATTEMPTS),
        ),
        (
            property(&doc, "TrainSettings", "local_epochs"),
            "maximum",
            f64::from(cohort_edge::train::MAX_LOCAL_EPOCHS),
        ),
        (
            property(&doc, "TrainSettings", "local_epochs"),
            "minimum",
            1.0,
        ),
        (
            samples,
            "maximum",
            cohort_coordinator::server::http::client_api::MAX_NUM_SAMPLES as f64,
        ),
        (samples, "minimum", 1.0),
        (
            property(&doc, "CheckIn", "wait_seconds"),
            "maximum",
            cohort_coordinator::server::http::client_api::MAX_CHECKIN_WAIT_SECONDS as f64,
        ),
    ];
    for (schema, key, expected) in bounds {
        let stated = schema[key]
            .as_f64()
            .unwrap_or_else(|| panic!("no {key}: {schema}"));
        assert_eq!(stated, expected, "{key} of {schema}");
    }
}

/// One rule for every name and label, stated once in the document as the server checks
/// it (`cohort_core::text`): the same length in characters and the same pattern.
#[test]
fn every_name_and_label_states_the_one_text_rule() {
    let doc = document();
    let rule = cohort_core::text::LABEL_PATTERN;
    let fields = [
        property(&doc, "ExperimentSpec", "name").clone(),
        property(&doc, "NewEnrolmentToken", "label").clone(),
        parameter(&doc["paths"]["/api/v1/admin/models"]["post"], "name")["schema"].clone(),
    ];
    let reason = property(&doc, "FailureReport", "reason");
    assert_eq!(reason["pattern"], cohort_core::text::FREE_TEXT_PATTERN);
    for f in &fields {
        assert_eq!(f["pattern"], rule, "{f}");
        assert_eq!(f["maxLength"], cohort_core::text::MAX_LABEL_CHARS, "{f}");
        assert_eq!(f["minLength"], 1, "{f}");
    }
}

/// Octet-stream bodies are bytes: described as JSON arrays of integers, a generated
/// client would send a JSON list. The model downloads name their round in a header.
#[test]
fn binary_bodies_are_binary_strings_and_model_downloads_name_their_round() {
    let doc = document();
    let binary = |media: &Value| {
        let s = &media["schema"];
        assert_eq!(s["type"], "string", "{media}");
        assert_eq!(s["format"], "binary", "{media}");
    };
    let mut seen = 0;
    for (method, path, op) in operations(&doc) {
        if let Some(media) = op["requestBody"]["content"].get("application/octet-stream") {
            binary(media);
            seen += 1;
        }
        for (status, response) in op["responses"].as_object().unwrap() {
            if let Some(media) = response["content"].get("application/octet-stream") {
                binary(media);
                seen += 1;
                if path.ends_with("/model") || path.ends_with("/model.safetensors") {
                    assert!(
                        response["headers"].get("x-cohort-round").is_some(),
                        "{method} {path} {status}: no x-cohort-round"
                    );
                }
            }
        }
    }
    assert!(seen >= 5, "octet-stream bodies found: {seen}");
    let update = &doc["paths"][UPDATE]["post"];
    let described = update["description"].as_str().unwrap_or_default();
    assert!(described.contains("little-endian"), "{described}");
}

/// A path id is a UUID, and one that is not is refused with 400 (listed).
#[test]
fn path_ids_are_uuids() {
    let doc = document();
    for (method, path, op) in operations(&doc) {
        for p in op["parameters"].as_array().into_iter().flatten() {
            if p["in"] == "path" && p["name"] == "id" {
                assert_eq!(p["schema"]["format"], "uuid", "{method} {path}");
                assert!(
                    op["responses"].get("400").is_some(),
                    "{method} {path}: no 400"
                );
                assert!(
                    op["responses"].get("404").is_some(),
                    "{method} {path}: no 404"
                );
            }
        }
    }
}

/// Every status a caller can get is listed: 401 wherever a credential is needed, 403
/// wherever a (revoked) client's is, 422 wherever a body or query is checked.
#[test]
fn refusals_a_route_can_answer_are_listed() {
    let doc = document();
    for (method, path, op) in operations(&doc) {
        let responses = &op["responses"];
        let security = op["security"].to_string();
        if op["security"].as_array().is_some_and(|s| !s.is_empty()) {
            assert!(responses.get("401").is_some(), "{method} {path}: no 401");
        }
        if security.contains("client_credential") {
            assert!(responses.get("403").is_some(), "{method} {path}: no 403");
        }
        let query = op["parameters"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["in"] == "query"));
        if query || op.get("requestBody").is_some() {
            assert!(responses.get("422").is_some(), "{method} {path}: no 422");
        }
    }
}

/// The layout of a model's flat vector is in the document: a task's tensors (names,
/// shapes, order) and what its upload holds (weights, or a masked difference).
#[test]
fn a_tasks_model_layout_and_upload_form_are_documented() {
    let doc = document();
    let tensors = property(&doc, "Task", "tensors");
    let item = resolve(&doc, &tensors["items"]);
    assert!(item["properties"].get("name").is_some(), "{item}");
    assert!(item["properties"].get("shape").is_some(), "{item}");
    let upload = property(&doc, "Task", "upload");
    assert_eq!(
        upload["enum"],
        serde_json::json!(["weights", "masked_difference", "compressed_difference"])
    );
    let described = schema(&doc, "Task")["properties"]["tensors"]["description"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(described.contains("layers.{i}.weight"), "{described}");
}

/// Every JSON body a client sends names its fields, the secure-aggregation messages
/// included (they were described as free-form objects with their shape in prose), so
/// that a generated client builds them and schemathesis generates real ones.
#[test]
fn every_json_request_body_names_its_fields() {
    let doc = document();
    for (method, path, op) in operations(&doc) {
        let Some(media) = op["requestBody"]["content"].get("application/json") else {
            continue;
        };
        let body = resolve(&doc, &media["schema"]);
        assert!(
            body["properties"]
                .as_object()
                .is_some_and(|p| !p.is_empty()),
            "{method} {path}: the body names no fields: {body}"
        );
    }
    for reply in [
        "RosterReply",
        "DirectoryReply",
        "SharesReply",
        "SurvivorsReply",
    ] {
        let fields = schema(&doc, reply)["properties"].as_object().unwrap();
        let payload = fields
            .iter()
            .find(|(name, _)| name.as_str() != "stage")
            .map(|(_, p)| unwrap_nullable(&doc, p))
            .unwrap();
        assert!(payload["properties"].is_object(), "{reply}: {payload}");
    }
}
