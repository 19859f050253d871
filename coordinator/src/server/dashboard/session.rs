//! Signing in to the dashboard, and the guard in front of every other page.
//!
//! Signing in with the admin token, or by name with a person's own token, creates a
//! session (whose role, for a person, decides what it may change): a random 256-bit id in a cookie
//! that is `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page sends
//! it) and `Secure` when the server speaks TLS. Only the id's SHA-256 is stored.
//!
//! Every state-changing request also carries a CSRF token in its form body: the SHA-256 of
//! the session id under a fixed label, which only a page of this server (rendered for
//! this session) can know. The guard checks it, and refuses a request whose `Origin` or
//! `Sec-Fetch-Site` says it comes from another site, before any handler runs, so a
//! handler cannot forget. The sign-in form, which has no session yet, is protected the
//! same way by a one-time cookie whose value the form repeats (double submit).

use askama::Template;
use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use super::{Chrome, PageError, render};
use crate::server::AppState;
use crate::server::auth::{generate_secret, hash_secret, to_hex};
use crate::server::rate_limit::{ADMIN_ACCOUNT, PEOPLE_ACCOUNT};
use crate::server::roles::Principal;
use crate::server::settings::TlsMode;
use crate::store::now_millis;

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "cohort_session";
/// The sign-in form's double-submit cookie.
pub const SIGN_IN_COOKIE: &str = "cohort_sign_in";
/// The form field that carries the CSRF token.
pub const CSRF_FIELD: &str = "csrf";
/// A session ends this long after sign-in, whatever happens, Unix ms.
pub const SESSION_LIFETIME_MS: i64 = 12 * 60 * 60 * 1000;
/// The most a dashboard form body may hold.
const MAX_FORM_BYTES: usize = 64 * 1024;

/// A signed-in request's session, as handlers see it.
#[derive(Debug, Clone)]
pub struct Session {
    /// The CSRF token to put in this session's forms.
    pub csrf: String,
    /// Who signed in.
    pub who: Principal,
}

/// The CSRF token of the session whose id is `session_id`.
pub fn csrf_token(session_id: &str) -> String {
    to_hex(&hash_secret(&format!(
        "cohort-dashboard-csrf\0{session_id}"
    )))
}

/// Compares two tokens in time that does not depend on where they differ.
fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// The value of cookie `name`, if the request sent exactly one cookie of that name.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let mut found = None;
    for value in headers.get_all(header::COOKIE) {
        let Ok(text) = value.to_str() else { continue };
        for pair in text.split(';') {
            if let Some((key, value)) = pair.trim().split_once('=')
                && key == name
            {
                if found.is_some() {
                    // Two cookies of one name (e.g. one planted for a parent domain):
                    // trust neither.
                    return None;
                }
                found = Some(value);
            }
        }
    }
    found
}

fn secure_attr(state: &AppState) -> &'static str {
    match state.settings.tls {
        TlsMode::InsecureHttp => "",
        _ => "; Secure",
    }
}

fn set_cookie(state: &AppState, name: &str, value: &str, max_age_s: i64) -> HeaderValue {
    let text = format!(
        "{name}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age_s}{}",
        secure_attr(state)
    );
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Whether `headers` say the request comes from a page of another site. Browsers send
/// `Sec-Fetch-Site` and, on POST, `Origin`; a request with neither (a script, curl) is
/// judged by its CSRF token alone.
///
/// The host is the `Host` header, or under HTTP/2 (which has none) the request URI's
/// authority.
fn cross_site(headers: &HeaderMap, uri: &Uri) -> bool {
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && !matches!(site, "same-origin" | "none")
    {
        return true;
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .or_else(|| uri.authority().map(|a| a.as_str()));
        let origin_host = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .map(|(_, authority)| authority);
        let foreign = match (origin_host, host) {
            (Some(o), Some(h)) => !o.eq_ignore_ascii_case(h),
            _ => true,
        };
        if foreign {
            tracing::warn!(?origin, ?host, "dashboard: cross-site request refused");
        }
        return foreign;
    }
    false
}

/// Where to go after signing in when `?next=` names no safe place.
const DEFAULT_NEXT: &str = "/experiments";

/// Where to go after signing in: a path on this site, never another site.
///
/// Browsers are lenient with a `Location`: they drop tabs and newlines anywhere in it
/// (`/\t/evil.example` becomes `//evil.example`), read `\` as `/`, and take `//host` as
/// another site with this one's scheme. So `next` must be a plain absolute path: one `/`
/// not followed by another, no `\`, and nothing but visible ASCII (no whitespace, no
/// control character). That holds for the text as sent and again after each round of
/// percent-decoding, so that an escaped `/`, `\` or tab cannot pass either. Anything
/// else, and the sign-in page itself, goes to [`DEFAULT_NEXT`].
fn safe_next(next: Option<&str>) -> String {
    let Some(path) = next else {
        return DEFAULT_NEXT.to_string();
    };
    // A path is decoded at most this many times; one still changing after that is
    // nested deeper than anything this site links to.
    const MAX_DECODINGS: usize = 4;
    let mut layer = path.as_bytes().to_vec();
    let mut settled = false;
    for _ in 0..=MAX_DECODINGS {
        if !plain_local_path(&layer) {
            return DEFAULT_NEXT.to_string();
        }
        let decoded = percent_decode(&layer);
        if decoded == layer {
            settled = true;
            break;
        }
        layer = decoded;
    }
    let sign_in = path == "/sign-in" || path.starts_with("/sign-in?");
    if !settled || sign_in {
        return DEFAULT_NEXT.to_string();
    }
    path.to_string()
}

/// True for an absolute path on this site: it starts with exactly one `/`, holds no
/// `\`, and only visible ASCII (so no whitespace or control character).
fn plain_local_path(path: &[u8]) -> bool {
    path.first() == Some(&b'/')
        && path.get(1) != Some(&b'/')
        && path.iter().all(|&b| b.is_ascii_graphic() && b != b'\\')
}

/// `%XX` escapes decoded once; a `%` without two hex digits after it stays as it is.
fn percent_decode(text: &[u8]) -> Vec<u8> {
    let hex = |b: u8| char::from(b).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                text.get(i + 1).copied().and_then(hex),
                text.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

/// The form fields of an urlencoded body.
pub fn form_fields(body: &[u8]) -> Result<Vec<(String, String)>, PageError> {
    serde_urlencoded::from_bytes::<Vec<(String, String)>>(body)
        .map_err(|e| PageError::BadRequest(format!("malformed form: {e}")))
}

/// The one value of `name` among `fields`.
pub fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}

/// Middleware: lets a request through only with a live session; a state-changing request
/// also needs the session's CSRF token and must not come from another site. Signed-out
/// page views go to the sign-in page (and back afterwards); anything else is refused.
pub async fn require_session(
    State(state): State<AppState>,
    crate::server::rate_limit::PeerAddr(peer): crate::server::rate_limit::PeerAddr,
    request: Request,
    next: Next,
) -> Result<Response, PageError> {
    let session_id = cookie(request.headers(), SESSION_COOKIE)
        .filter(|id| id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_string);
    let holder = match &session_id {
        Some(id) => {
            state
                .store
                .dashboard_session_live(&hash_secret(id), now_millis())
                .await?
        }
        None => None,
    };
    let who = match holder {
        Some(holder) => session_principal(&state, holder).await?,
        None => None,
    };
    let safe = matches!(*request.method(), Method::GET | Method::HEAD);
    let (Some(session_id), Some(who)) = (session_id, who) else {
        if safe {
            let target = request
                .uri()
                .path_and_query()
                .map(|pq| pq.as_str())
                .unwrap_or("/");
            let next = url_encode(target);
            return Ok(Redirect::to(&format!("/sign-in?next={next}")).into_response());
        }
        return Err(PageError::Forbidden(
            "you are not signed in (or your session ended); sign in and try again".into(),
        ));
    };
    let csrf = csrf_token(&session_id);
    let mut request = if safe {
        request
    } else {
        if cross_site(request.headers(), request.uri()) {
            return Err(PageError::Forbidden("cross-site request refused".into()));
        }
        // The role first: a request its sender may not make is refused before its
        // body is read.
        let needed = crate::server::roles::required_role(request.method(), request.uri().path());
        if let Some(why) = who.refusal(needed) {
            return Err(PageError::Forbidden(why));
        }
        // Only the model upload form sends files: a multipart body, up to the server's
        // body limit, is taken there alone; every other form stays small.
        let boundary = request
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(super::multipart::boundary)
            .filter(|_| request.uri().path() == super::UPLOAD_PATH);
        let limit = if boundary.is_some() {
            state.settings.max_body_bytes
        } else {
            MAX_FORM_BYTES
        };
        let (parts, body) = request.into_parts();
        let bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
            if boundary.is_some() {
                PageError::TooLarge(format!(
                    "the upload is larger than this server accepts ({limit} bytes in all), \
                     or was cut off; nothing was stored"
                ))
            } else {
                PageError::BadRequest("form too large".into())
            }
        })?;
        let presented = match &boundary {
            Some(boundary) => {
                let fields = super::multipart::parse(&bytes, boundary)
                    .map_err(|e| PageError::BadRequest(format!("malformed form: {e}")))?;
                super::multipart::text(&fields, CSRF_FIELD).to_string()
            }
            None => field(&form_fields(&bytes)?, CSRF_FIELD)
                .unwrap_or("")
                .to_string(),
        };
        if !same_token(&presented, &csrf) {
            return Err(PageError::Forbidden(
                "missing or wrong CSRF token; reload the page and try again".into(),
            ));
        }
        Request::from_parts(parts, Body::from(bytes))
    };
    let actor = who.actor(
        &format!("dashboard session {}", session_label(&session_id)),
        &crate::server::http::address_text(peer),
    );
    request.extensions_mut().insert(Session { csrf, who });
    Ok(crate::store::acting_as(actor, next.run(request)).await)
}

/// Who a live session's holder is now; `None` for a person revoked since (whose
/// sessions revocation ended, unless it raced with this request).
async fn session_principal(
    state: &AppState,
    holder: crate::store::SessionHolder,
) -> Result<Option<Principal>, PageError> {
    Ok(match holder {
        crate::store::SessionHolder::AdminToken => Some(Principal::admin_token()),
        crate::store::SessionHolder::User(id) => state
            .store
            .user_credential(id)
            .await?
            .filter(|(_, user)| user.revoked_at.is_none())
            .map(|(_, user)| Principal {
                name: user.name,
                role: user.role,
                user: Some(user.id),
            }),
    })
}

/// Names a session in the audit log without revealing it: the first 8 hex digits of
/// its stored hash, enough to tell sessions apart and to find the row.
fn session_label(session_id: &str) -> String {
    to_hex(&hash_secret(session_id)[..4])
}

/// Percent-encodes `text` for a query-string value.
fn url_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[derive(Template)]
#[template(path = "sign_in.html")]
struct SignInPage {
    page: Chrome,
    form_token: String,
    next: String,
    error: Option<String>,
}

/// `?next=` of the sign-in page.
#[derive(Debug, Deserialize)]
pub struct NextQuery {
    next: Option<String>,
}

fn sign_in_form(
    state: &AppState,
    next: &str,
    error: Option<String>,
    status: axum::http::StatusCode,
) -> Result<Response, PageError> {
    let form_token = generate_secret().map_err(PageError::internal)?;
    let page = SignInPage {
        page: Chrome::signed_out(),
        form_token: form_token.clone(),
        next: next.to_string(),
        error,
    };
    let mut response = render(&page);
    *response.status_mut() = status;
    response.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(state, SIGN_IN_COOKIE, &form_token, 3600),
    );
    Ok(response)
}

/// `GET /sign-in`: the sign-in form.
pub async fn sign_in_page(
    State(state): State<AppState>,
    Query(query): Query<NextQuery>,
) -> Result<Response, PageError> {
    sign_in_form(
        &state,
        &safe_next(query.next.as_deref()),
        None,
        axum::http::StatusCode::OK,
    )
}

/// The sign-in form again, with 429 and `Retry-After`: `peer` or the account failed
/// too often.
fn too_many_sign_ins(
    state: &AppState,
    next: &str,
    peer: Option<std::net::IpAddr>,
    limited: &crate::server::ApiError,
) -> Result<Response, PageError> {
    let seconds = match limited {
        crate::server::ApiError::TooManyRequests {
            retry_after_seconds,
            ..
        } => *retry_after_seconds,
        _ => 60,
    };
    tracing::warn!(
        peer = %crate::server::http::address_text(peer),
        "dashboard sign-in refused: too many failed sign-ins"
    );
    let mut response = sign_in_form(
        state,
        next,
        Some(format!(
            "Too many failed sign-ins; try again in {seconds} seconds."
        )),
        axum::http::StatusCode::TOO_MANY_REQUESTS,
    )?;
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    Ok(response)
}

/// Who `token` signs in: the admin token for the admin account, else the person
/// `name` if it is their live token.
async fn signed_in(
    state: &AppState,
    account: &str,
    name: &str,
    token: &str,
) -> Result<Option<Principal>, PageError> {
    if token.is_empty() {
        return Ok(None);
    }
    if account == ADMIN_ACCOUNT {
        return Ok(state.admin.verify(token).then(Principal::admin_token));
    }
    Ok(crate::server::http::person(state, token)
        .await
        .map_err(PageError::internal)?
        .filter(|p| p.name == name))
}

/// `POST /sign-in`: checks the admin token, or a person's name and token, and starts a
/// session.
pub async fn sign_in(
    State(state): State<AppState>,
    crate::server::rate_limit::PeerAddr(peer): crate::server::rate_limit::PeerAddr,
    uri: Uri,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, PageError> {
    if cross_site(&headers, &uri) {
        return Err(PageError::Forbidden("cross-site request refused".into()));
    }
    let fields = form_fields(&body)?;
    let next = safe_next(field(&fields, "next"));
    // The admin token signs in without a name (or as `admin`); a person with theirs.
    let name = field(&fields, "name").unwrap_or("").trim().to_string();
    let account = if name.is_empty() || name == ADMIN_ACCOUNT {
        ADMIN_ACCOUNT
    } else {
        PEOPLE_ACCOUNT
    };
    // Refused before the token is looked at, so that a guesser past its share learns
    // nothing more, whatever it sends.
    if let Err(limited) = state.limits.sign_in_allowed(peer, account) {
        return too_many_sign_ins(&state, &next, peer, &limited);
    }
    let expected = cookie(&headers, SIGN_IN_COOKIE).unwrap_or("");
    let presented = field(&fields, CSRF_FIELD).unwrap_or("");
    if expected.is_empty() || !same_token(presented, expected) {
        return sign_in_form(
            &state,
            &next,
            Some("The sign-in form expired; please try again.".into()),
            axum::http::StatusCode::FORBIDDEN,
        );
    }
    let token = field(&fields, "token").unwrap_or("").trim();
    let who = signed_in(&state, account, &name, token).await?;
    let Some(who) = who else {
        // An empty field is no guess; a wrong token counts against the address and the
        // account.
        if !token.is_empty() {
            state.limits.sign_in_failed(peer, account);
        }
        tracing::warn!("dashboard sign-in refused: wrong token for the name");
        let why = if account == ADMIN_ACCOUNT {
            "That is not the admin token."
        } else {
            "That name and token do not go together."
        };
        return sign_in_form(
            &state,
            &next,
            Some(why.into()),
            axum::http::StatusCode::UNAUTHORIZED,
        );
    };
    let session_id = generate_secret().map_err(PageError::internal)?;
    let now = now_millis();
    let actor = who.actor(
        &format!("dashboard session {}", session_label(&session_id)),
        &crate::server::http::address_text(peer),
    );
    let holder = match who.user {
        Some(id) => crate::store::SessionHolder::User(id),
        None => crate::store::SessionHolder::AdminToken,
    };
    crate::store::acting_as(
        actor,
        state.store.create_dashboard_session(
            &hash_secret(&session_id),
            now,
            now + SESSION_LIFETIME_MS,
            holder,
        ),
    )
    .await?;
    let mut response = Redirect::to(&next).into_response();
    let headers = response.headers_mut();
    headers.append(
        header::SET_COOKIE,
        set_cookie(
            &state,
            SESSION_COOKIE,
            &session_id,
            SESSION_LIFETIME_MS / 1000,
        ),
    );
    headers.append(
        header::SET_COOKIE,
        set_cookie(&state, SIGN_IN_COOKIE, "", 0),
    );
    Ok(response)
}

/// `POST /sign-out`: ends the session here and in the database.
pub async fn sign_out(
    State(state): State<AppState>,
    crate::server::rate_limit::PeerAddr(peer): crate::server::rate_limit::PeerAddr,
    headers: HeaderMap,
) -> Result<Response, PageError> {
    if let Some(id) = cookie(&headers, SESSION_COOKIE) {
        let actor = format!(
            "admin via dashboard session {} from {}",
            session_label(id),
            crate::server::http::address_text(peer)
        );
        crate::store::acting_as(
            actor,
            state
                .store
                .end_dashboard_session(&hash_secret(id), now_millis()),
        )
        .await?;
    }
    let mut response = Redirect::to("/sign-in").into_response();
    response.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(&state, SESSION_COOKIE, "", 0),
    );
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_stays_on_this_site() {
        assert_eq!(safe_next(Some("/clients?page=2")), "/clients?page=2");
        for bad in [
            "//evil.example",
            "https://evil.example",
            "/\\evil",
            "",
            "/sign-in",
        ] {
            assert_eq!(safe_next(Some(bad)), "/experiments", "{bad}");
        }
        assert_eq!(safe_next(None), "/experiments");
    }

    /// Ways to smuggle another site past a "starts with one slash" check: browsers drop
    /// tabs and newlines, read `\` as `/`, and a percent-escape can hide any of those
    /// (or a second `/`) until something decodes it.
    #[test]
    fn next_refuses_every_known_way_off_the_site() {
        for bad in [
            "/%09/evil.example",
            "/\t/evil.example",
            "/\t/evil",
            "/\n/evil",
            "/\r\n/evil",
            "/%0d%0a/evil",
            "/%0A/evil",
            "\t//evil",
            " //evil",
            "/ /evil",
            "/\\evil",
            "/%5C/evil",
            "/%5c%5cevil",
            "//evil",
            "///evil",
            "/%2F/evil",
            "/%2f/evil",
            "/%252F/evil",
            "/%25252F/evil",
            "https://evil",
            "HTTPS://evil",
            "javascript:alert(1)",
            "evil.example",
            "/\u{0}/evil",
            "/\u{7f}",
            "/\u{a0}/evil",
            "/\u{2028}/evil",
            "/%E2%80%A8/evil",
            "/%C0%AF/evil",
            "/sign-in?next=//evil",
        ] {
            assert_eq!(safe_next(Some(bad)), "/experiments", "{bad:?}");
        }
        for good in [
            "/experiments",
            "/experiments/0b7c?tab=rounds",
            "/clients?page=2&sort=seen",
            "/models#files",
            "/experiments/a%2Db",
        ] {
            assert_eq!(safe_next(Some(good)), good, "{good:?}");
        }
    }

    #[test]
    fn a_cookie_sent_twice_is_trusted_neither_time() {
        let mut headers = HeaderMap::new();
        headers.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; cohort_session=x"),
        );
        assert_eq!(cookie(&headers, SESSION_COOKIE), Some("x"));
        headers.append(header::COOKIE, HeaderValue::from_static("cohort_session=y"));
        assert_eq!(cookie(&headers, SESSION_COOKIE), None);
    }

    #[test]
    fn requests_from_other_sites_are_recognised() {
        let mut headers = HeaderMap::new();
        let plain: Uri = "/experiments".parse().unwrap();
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8443"));
        assert!(!cross_site(&headers, &plain));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://127.0.0.1:8443"),
        );
        assert!(!cross_site(&headers, &plain));
        // HTTP/2 has no Host header: the authority is in the URI.
        let h2: Uri = "https://127.0.0.1:8443/experiments".parse().unwrap();
        let mut no_host = headers.clone();
        no_host.remove(header::HOST);
        assert!(!cross_site(&no_host, &h2));
        assert!(cross_site(&no_host, &plain));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(cross_site(&headers, &plain));
        headers.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(cross_site(&headers, &plain));
        headers.remove(header::ORIGIN);
        headers.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(cross_site(&headers, &plain));
    }

    #[test]
    fn csrf_tokens_differ_per_session_and_compare_exactly() {
        let a = csrf_token("a".repeat(64).as_str());
        let b = csrf_token("b".repeat(64).as_str());
        assert_ne!(a, b);
        assert!(same_token(&a, &a.clone()));
        assert!(!same_token(&a, &b));
        assert!(!same_token(&a, &a[..10]));
    }
}
