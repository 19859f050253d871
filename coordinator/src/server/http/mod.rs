//! The HTTP API: routes, the admin guard and the OpenAPI document that describes them.
//!
//! Public routes live at the top level; admin routes go into [`admin_router`], which
//! [`app`](crate::server::app) nests under [`ADMIN_PREFIX`] behind the admin-token guard, so a
//! route added there cannot be left unguarded. Every route is listed in [`ApiDoc`].

pub mod admin;
pub mod audit;
pub mod client_api;
pub mod extract;
pub mod fedbuff;
pub mod models;
pub mod secagg_api;
pub mod users;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::get;
use serde::{Deserialize, Serialize};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use crate::server::AppState;
use crate::server::auth::parse_bearer;
use crate::server::error::{ApiError, ErrorBody, ErrorCode, ErrorDetail, Json};

/// Where the admin API is mounted; every path below it needs the admin token.
pub const ADMIN_PREFIX: &str = "/api/v1/admin";
/// Name of the bearer security scheme in the OpenAPI document.
pub const ADMIN_SECURITY_SCHEME: &str = "admin_token";

/// The OpenAPI document of the coordinator's API.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Cohort coordinator API",
        description = "Federated learning coordinator. Admin routes need \
                       `Authorization: Bearer <token>`: the admin token, or a person's \
                       token (`/api/v1/admin/users`), whose role (viewer < operator < \
                       admin) must allow the operation; each operation says which it \
                       needs (`x-cohort-role`). Every error is \
                       `{\"error\": {\"code\": ..., \"message\": ...}}`."
    ),
    paths(health, openapi_json, whoami),
    components(schemas(ErrorBody, ErrorDetail, Health, WhoAmI)),
    modifiers(&AdminSecurity),
    tags(
        (name = "meta", description = "Liveness and the API description"),
        (name = "admin", description = "Platform administration (admin token)")
    )
)]
pub struct ApiDoc;

/// The whole OpenAPI document: the meta routes plus every admin route.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.merge(crate::server::http::admin::AdminDoc::openapi());
    doc.merge(crate::server::http::client_api::ClientDoc::openapi());
    doc.merge(crate::server::http::secagg_api::SecAggDoc::openapi());
    doc.merge(crate::server::http::fedbuff::FedBuffDoc::openapi());
    doc.merge(crate::server::http::models::ModelsDoc::openapi());
    doc.merge(crate::server::http::audit::AuditDoc::openapi());
    doc.merge(crate::server::http::users::UsersDoc::openapi());
    let components = doc.components.get_or_insert_with(Default::default);
    let mut scheme = Http::new(HttpAuthScheme::Bearer);
    scheme.description =
        Some("A client's credential, `<client id>.<secret>`, as returned by enrolment.".into());
    components.add_security_scheme(
        crate::server::http::client_api::CLIENT_SECURITY_SCHEME,
        SecurityScheme::Http(scheme),
    );
    document_framework_answers(&mut doc);
    document_binary_bodies(&mut doc);
    document_error_codes(&mut doc);
    document_roles(&mut doc);
    doc
}

/// States on every admin operation the role it needs, from the table the guard
/// enforces ([`required_role`](crate::server::roles::required_role)): an `x-cohort-role`
/// extension, a line of its description, and the 403 a lesser role gets.
fn document_roles(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::extensions::ExtensionsBuilder;
    use utoipa::openapi::response::ResponseBuilder;
    for (path, item) in doc.paths.paths.iter_mut() {
        let Some(relative) = path.strip_prefix(ADMIN_PREFIX) else {
            continue;
        };
        for (method, op) in [
            (Method::GET, &mut item.get),
            (Method::POST, &mut item.post),
            (Method::PUT, &mut item.put),
            (Method::DELETE, &mut item.delete),
            (Method::PATCH, &mut item.patch),
        ] {
            let Some(op) = op else { continue };
            let role = crate::server::roles::required_role(&method, relative);
            let extension = ExtensionsBuilder::new()
                .add("x-cohort-role", role.as_str())
                .build();
            op.extensions
                .get_or_insert_with(Default::default)
                .merge(extension);
            let line =
                format!("Needs the `{role}` role (or a higher one: viewer < operator < admin).");
            op.description = Some(match op.description.take() {
                Some(text) => format!("{text}\n\n{line}"),
                None => line,
            });
            op.responses
                .responses
                .entry("403".into())
                .or_insert_with(|| {
                    RefOr::T(
                        ResponseBuilder::new()
                            .description("A person whose role does not allow this")
                            .build(),
                    )
                });
        }
    }
}

/// Describes every `application/octet-stream` body, sent or answered, as what it is on
/// the wire: a string of bytes (`format: binary`), so that a generated client sends and
/// returns raw bytes instead of a JSON array of integers. Each operation's description
/// gives the byte layout.
fn document_binary_bodies(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
    use utoipa::openapi::{RefOr, Schema};
    let binary = || -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .build()
            .into()
    };
    const OCTETS: &str = "application/octet-stream";
    for op in operations_mut(doc) {
        if let Some(RefOr::T(body)) = op.request_body.as_mut()
            && let Some(RefOr::T(content)) = body.content.get_mut(OCTETS)
        {
            content.schema = Some(binary());
        }
        for response in op.responses.responses.values_mut() {
            if let RefOr::T(response) = response
                && let Some(RefOr::T(content)) = response.content.get_mut(OCTETS)
            {
                content.schema = Some(binary());
            }
        }
    }
}

/// Enumerates `ErrorBody.error.code` from [`ErrorCode::ALL`], each with its status and
/// meaning, so that a generated client knows every code it can meet.
fn document_error_codes(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::Schema;
    let Some(RefOr::T(Schema::Object(detail))) = doc
        .components
        .as_mut()
        .and_then(|c| c.schemas.get_mut("ErrorDetail"))
    else {
        return;
    };
    let Some(RefOr::T(Schema::Object(code))) = detail.properties.get_mut("code") else {
        return;
    };
    code.enum_values = Some(
        ErrorCode::ALL
            .iter()
            .map(|c| serde_json::Value::from(c.as_str()))
            .collect(),
    );
    let table: Vec<String> = ErrorCode::ALL
        .iter()
        .map(|c| format!("- `{c}` ({}): {}", c.status().as_u16(), c.meaning()))
        .collect();
    code.description = Some(format!(
        "Stable, machine-readable code: one per kind of refusal, with its HTTP status.\n\n{}",
        table.join("\n")
    ));
}

/// Documents, on every operation, the answers given before its handler runs or by the
/// layers around it, so that the document lists every status a caller can get: 400 for
/// a body or parameter that does not parse, 413 and 415 for a body too large or of another
/// type, 503 while the database is unreachable.
fn document_framework_answers(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    let error = |description: &str| -> RefOr<utoipa::openapi::Response> {
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build()
            .into()
    };
    for op in operations_mut(doc) {
        // A path or query parameter that does not parse (an attempt number past
        // i64, an id that is not a UUID) is refused before the handler runs, as is a
        // body that does not.
        use utoipa::openapi::path::ParameterIn;
        let has_path = has_parameter_in(op, ParameterIn::Path);
        let has_query = has_parameter_in(op, ParameterIn::Query);
        let has_body = op.request_body.is_some();
        let secured = op.security.as_ref().is_some_and(|s| !s.is_empty());
        // A revoked client's credential still authenticates, and is refused.
        let as_client = serde_json::to_value(&op.security).is_ok_and(|v| {
            v.to_string()
                .contains(crate::server::http::client_api::CLIENT_SECURITY_SCHEME)
        });
        let answers = [
            ("400", has_body || has_path || has_query),
            ("401", secured),
            ("403", as_client),
            ("404", has_path),
            ("413", has_body),
            ("415", has_body),
            ("422", has_body || has_query),
            // Every route behind a token refuses an address that failed to
            // authenticate too often, before it looks at the token.
            ("429", secured),
            ("503", true),
        ];
        for (status, _) in answers.into_iter().filter(|(_, applies)| *applies) {
            op.responses
                .responses
                .entry(status.into())
                .or_insert_with(|| error(standard_description(status)));
        }
        // OpenAPI requires a description on every response; a handler's own listing
        // of a refusal often gives only its body.
        for (status, response) in op.responses.responses.iter_mut() {
            if let RefOr::T(response) = response
                && response.description.is_empty()
            {
                response.description = standard_description(status).into();
            }
        }
    }
}

/// What a status means on any route: the description of the answers the layers add, and
/// of a response whose handler gave none.
fn standard_description(status: &str) -> &'static str {
    match status {
        "200" => "OK",
        "201" => "Created",
        "400" => "The body or a path or query parameter does not parse",
        "401" => "No valid credential",
        "403" => "The credential may not do this (a revoked client)",
        "404" => "Nothing has this id, or the caller may not see it",
        "409" => "Refused by the resource's current state; the code says which rule",
        "413" => "The body is larger than the server takes",
        "415" => "The body's content type is not the one documented",
        "422" => {
            "The body or a query parameter parses but is not valid here (an unknown field, \
             a wrong type, a value out of range); the code and message say why"
        }
        "429" => {
            "Too many failed authentications from this address, or too many requests from \
             this client: retry after Retry-After seconds"
        }
        "503" => "The database is unreachable for now: retry after Retry-After seconds",
        _ => "See the error code",
    }
}

/// Every operation of the document, to amend.
fn operations_mut(
    doc: &mut utoipa::openapi::OpenApi,
) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    doc.paths.paths.values_mut().flat_map(|item| {
        [
            &mut item.get,
            &mut item.post,
            &mut item.put,
            &mut item.delete,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
    })
}

/// Whether the operation takes a parameter in `place` (the path, the query).
fn has_parameter_in(
    op: &utoipa::openapi::path::Operation,
    place: utoipa::openapi::path::ParameterIn,
) -> bool {
    op.parameters.iter().flatten().any(|p| match p {
        utoipa::openapi::RefOr::T(p) => p.parameter_in == place,
        utoipa::openapi::RefOr::Ref(_) => false,
    })
}

/// Adds the admin bearer scheme to the document's components.
struct AdminSecurity;

impl Modify for AdminSecurity {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let mut scheme = Http::new(HttpAuthScheme::Bearer);
        scheme.description = Some(
            "The admin token: set in settings (`COHORT_ADMIN_TOKEN`) or printed once by \
             `cohort serve` at first start."
                .into(),
        );
        components.add_security_scheme(ADMIN_SECURITY_SCHEME, SecurityScheme::Http(scheme));
    }
}

/// The answer of the health check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// Always `ok` when the server answers.
    #[schema(example = "ok")]
    pub status: String,
}

/// Who the caller is, as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct WhoAmI {
    /// The caller's role (`viewer`, `operator`, `admin`); `admin` for the admin token.
    #[schema(example = "admin")]
    pub role: String,
    /// The caller's name; `admin` for the admin token.
    #[schema(example = "alice")]
    pub name: String,
}

/// Liveness check; needs no token.
#[utoipa::path(
    get,
    path = "/api/v1/health",
    tag = "meta",
    responses((status = 200, description = "The server is up", body = Health))
)]
async fn health() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

/// This OpenAPI document; needs no token.
#[utoipa::path(
    get,
    path = "/api/v1/openapi.json",
    tag = "meta",
    responses((status = 200, description = "The OpenAPI 3 document", body = Object, content_type = "application/json"))
)]
async fn openapi_json() -> impl axum::response::IntoResponse {
    // The document depends on nothing but the code: built and serialized once per
    // process, not on every request (it is some 200 KB).
    static DOCUMENT: std::sync::LazyLock<axum::body::Bytes> = std::sync::LazyLock::new(|| {
        serde_json::to_vec(&openapi())
            .expect("the OpenAPI document serializes")
            .into()
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.clone(),
    )
}

/// Who the caller is: a cheap way to check a token.
#[utoipa::path(
    get,
    path = "/api/v1/admin/whoami",
    tag = "admin",
    security(("admin_token" = [])),
    responses(
        (status = 200, description = "The token's holder and role", body = WhoAmI),
        (status = 401, description = "Missing, malformed or wrong token", body = ErrorBody)
    )
)]
async fn whoami(
    axum::Extension(who): axum::Extension<crate::server::roles::Principal>,
) -> Json<WhoAmI> {
    Json(WhoAmI {
        role: who.role.as_str().into(),
        name: who.name,
    })
}

/// The public routes, with absolute paths. A client's messages other than updates
/// (secure aggregation, evaluation and failure reports) pass its message limit first.
pub(crate) fn public_router(state: &AppState) -> Router<AppState> {
    let limited = || {
        axum::middleware::from_fn_with_state(
            state.clone(),
            crate::server::http::client_api::limit_messages,
        )
    };
    Router::new()
        .route("/api/v1/health", get(health))
        .route("/api/v1/openapi.json", get(openapi_json))
        .merge(crate::server::http::client_api::routes())
        .merge(crate::server::http::secagg_api::routes().route_layer(limited()))
        .merge(crate::server::http::models::client_routes().route_layer(limited()))
}

/// The admin routes, with paths relative to [`ADMIN_PREFIX`]. Add new admin routes here
/// (and to [`ApiDoc`]); [`app`](crate::server::app) puts the whole router behind the guard.
pub fn admin_router() -> Router<AppState> {
    Router::new()
        .route("/whoami", get(whoami))
        .merge(crate::server::http::admin::routes())
        .merge(crate::server::http::fedbuff::routes())
        .merge(crate::server::http::models::admin_routes())
        .merge(crate::server::http::audit::routes())
        .merge(crate::server::http::users::routes())
}

/// Middleware: lets a request through only with `Authorization: Bearer <token>` of the
/// admin token or a person's, whose role allows the operation
/// ([`roles::required_role`](crate::server::roles::required_role)); others get 401 or
/// 403. The action is audited under the person's name: `alice (operator) via api from
/// <address>`, or `admin via api from <address>` for the admin token.
pub(crate) async fn require_admin(
    State(state): State<AppState>,
    crate::server::rate_limit::PeerAddr(peer): crate::server::rate_limit::PeerAddr,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let who = authenticate(&state, request.headers(), peer).await?;
    let needed = crate::server::roles::required_role(request.method(), request.uri().path());
    if let Some(why) = who.refusal(needed) {
        return Err(ApiError::Forbidden(why));
    }
    let actor = who.actor("api", &address_text(peer));
    let mut request = request;
    request.extensions_mut().insert(who);
    Ok(crate::store::acting_as(actor, next.run(request)).await)
}

/// A client address for the audit log; `unknown` where the server has none (a router
/// called directly, as in tests).
pub(crate) fn address_text(peer: Option<std::net::IpAddr>) -> String {
    peer.map_or_else(|| "unknown".to_string(), |ip| ip.to_string())
}

/// Who the bearer token of a request from `peer` belongs to: the admin token, or a
/// person's token (`<user id>.<secret>`, not revoked). An address past its share of
/// failed authentications gets 429 before the token is looked at; a token presented
/// and refused counts against that share (a missing one does not: it is no guess).
pub(crate) async fn authenticate(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<std::net::IpAddr>,
) -> Result<crate::server::roles::Principal, ApiError> {
    state.limits.authentication_allowed(peer)?;
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let first = values.next();
    let refused = |e: ApiError| {
        if first.is_some() {
            state.limits.authentication_failed(peer);
        }
        e
    };
    // Two Authorization headers are ambiguous; refuse rather than pick one.
    if values.next().is_some() {
        return Err(refused(ApiError::Unauthorized(
            "more than one authorization header".into(),
        )));
    }
    let token = parse_bearer(first.map(|v| v.as_bytes()))
        .map_err(|e| refused(ApiError::Unauthorized(e.to_string())))?;
    if state.admin.verify(token) {
        return Ok(crate::server::roles::Principal::admin_token());
    }
    match person(state, token).await? {
        Some(who) => Ok(who),
        None => Err(refused(ApiError::Unauthorized("invalid token".into()))),
    }
}

/// The person whose token is `token`, if it is a live person's token.
pub(crate) async fn person(
    state: &AppState,
    token: &str,
) -> Result<Option<crate::server::roles::Principal>, ApiError> {
    let Some((id, secret)) = token.split_once('.') else {
        return Ok(None);
    };
    let Ok(id) = id.parse::<uuid::Uuid>() else {
        return Ok(None);
    };
    let Some((hash, user)) = state.store.user_credential(id).await? else {
        return Ok(None);
    };
    let Ok(hash) = <[u8; 32]>::try_from(hash.as_slice()) else {
        return Ok(None);
    };
    if user.revoked_at.is_some() || !crate::server::auth::verify_secret(secret, &hash) {
        return Ok(None);
    }
    Ok(Some(crate::server::roles::Principal {
        name: user.name,
        role: user.role,
        user: Some(user.id),
    }))
}

/// Every documented admin operation as (method, path), from the OpenAPI document: the
/// list tests walk to prove that each one is guarded. Path parameters keep their
/// `{name}` placeholders.
pub fn documented_admin_routes() -> Vec<(Method, String)> {
    documented_routes()
        .into_iter()
        .filter(|(_, path)| path == ADMIN_PREFIX || path.starts_with(&format!("{ADMIN_PREFIX}/")))
        .collect()
}

/// Every documented operation as (method, path).
pub fn documented_routes() -> Vec<(Method, String)> {
    let doc = serde_json::to_value(openapi()).unwrap_or_default();
    let mut routes = Vec::new();
    if let Some(paths) = doc.get("paths").and_then(|p| p.as_object()) {
        for (path, item) in paths {
            let Some(item) = item.as_object() else {
                continue;
            };
            for key in item.keys() {
                let Ok(method) = Method::from_bytes(key.to_ascii_uppercase().as_bytes()) else {
                    continue;
                };
                // Path items also hold `parameters`, `summary` and the like.
                if matches!(
                    method,
                    Method::GET
                        | Method::POST
                        | Method::PUT
                        | Method::PATCH
                        | Method::DELETE
                        | Method::HEAD
                        | Method::OPTIONS
                ) {
                    routes.push((method, path.clone()));
                }
            }
        }
    }
    routes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_admin_operation_declares_the_bearer_scheme() {
        let doc = serde_json::to_value(openapi()).unwrap();
        let admin = documented_admin_routes();
        assert!(!admin.is_empty());
        for (method, path) in admin {
            let op = &doc["paths"][&path][method.as_str().to_ascii_lowercase()];
            let security = op["security"].as_array().cloned().unwrap_or_default();
            assert!(
                security
                    .iter()
                    .any(|s| s.get(ADMIN_SECURITY_SCHEME).is_some()),
                "{method} {path} does not declare {ADMIN_SECURITY_SCHEME}"
            );
            assert!(
                op["responses"].get("401").is_some(),
                "{method} {path} does not document its 401"
            );
        }
    }

    /// A client tells "too late" from "not yours" by the error code alone, so every code
    /// the upload rules can give must be in the document: a new refusal added to the
    /// core without documenting it fails here.
    #[test]
    fn every_upload_refusal_code_is_documented_on_the_upload_route() {
        let doc = serde_json::to_value(openapi()).unwrap();
        let path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/update";
        let conflict = doc["paths"][path]["post"]["responses"]["409"]["description"]
            .as_str()
            .unwrap_or_default();
        for code in cohort_core::UploadRefusal::CODES {
            assert!(
                conflict.contains(&format!("`{code}`")),
                "{code}: {conflict}"
            );
        }
    }

    /// The edge client fills in the same path templates the server registers: each is
    /// an operation of the document, so a route renamed on one side fails here.
    #[test]
    fn the_edge_clients_routes_are_the_documented_ones() {
        use cohort_edge::protocol::routes;
        let doc = serde_json::to_value(openapi()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        let templates = routes::ALL
            .iter()
            .map(|t| t.to_string())
            .chain(routes::SECAGG.iter().map(|s| routes::secagg_template(s)));
        for template in templates {
            assert!(
                paths.contains_key(&template),
                "{template} is not documented"
            );
        }
        let documented_client_routes = paths
            .keys()
            .filter(|p| p.starts_with("/api/v1/clients/"))
            .count();
        assert_eq!(
            documented_client_routes,
            routes::ALL.len() + routes::SECAGG.len(),
            "a client route the edge does not know"
        );
    }

    /// Issue 23: the admin model downloads worked but were missing from `paths`, so a
    /// generated client had no way to fetch the model it trained.
    #[test]
    fn the_admin_model_downloads_are_documented_with_their_round_header() {
        let doc = serde_json::to_value(openapi()).unwrap();
        for path in [
            "/api/v1/admin/experiments/{id}/model",
            "/api/v1/admin/experiments/{id}/model.safetensors",
        ] {
            let ok = &doc["paths"][path]["get"]["responses"]["200"];
            assert!(ok.is_object(), "{path} is not documented");
            assert!(ok["headers"]["x-cohort-round"].is_object(), "{path}: {ok}");
        }
    }

    #[test]
    fn document_has_the_error_schema_and_the_security_scheme() {
        let doc = serde_json::to_value(openapi()).unwrap();
        assert!(doc["components"]["schemas"].get("ErrorBody").is_some());
        assert_eq!(
            doc["components"]["securitySchemes"][ADMIN_SECURITY_SCHEME]["scheme"],
            "bearer"
        );
        let routes = documented_routes();
        assert!(routes.contains(&(Method::GET, "/api/v1/health".to_string())));
    }
}
