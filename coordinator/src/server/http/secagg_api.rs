//! Client routes of a secure round, under
//! `/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/`:
//!
//! | stage | client sends | client fetches (long poll) |
//! |---|---|---|
//! | advertising | `POST keys` (signed keys, graph commitment) | `GET roster`: members and their commitments once advertising closed |
//! | revealing | `POST reveal` (graph nonce) | `GET keys`: the key directory once revealing closed |
//! | sharing | `POST shares` | `GET shares`: its neighbours' shares once sharing closed |
//! | collecting | `POST .../update` (the masked words) | `GET survivors`: who is in the sum |
//! | confirming (consistency check) | `POST confirm` (signature over the survivors) | `GET unmask`: the survivors with the neighbours' signatures |
//! | unmasking | `POST unmask` | |
//!
//! Every message is checked against the round's protocol state, rebuilt from the store
//! (the stages that have closed, once per replica: [`crate::server::secagg_snapshots`]), before
//! it is recorded; the store re-checks the stage in the transaction that records it. A `GET` answers `{"stage": ..., "<message>": null}` until the stage it waits for
//! has closed, and a 409 when the round failed or went on without the caller.

use cohort_edge::protocol::messages::{DirectoryReply, RosterReply, SharesReply, SurvivorsReply};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::post;
use cohort_aggregation::secagg::{
    AdvertiseKeys, Confirmation, DirectoryEntry, GraphReveal, RoundConfig, SecAggError,
    ServerSession, ShareKeys, UnmaskShares,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::server::AppState;
use crate::server::driver::secure_rounds::{SecureRoundError, round_config};
use crate::server::error::{ApiError, ErrorBody, ErrorCode, Json};
use crate::server::http::client_api::MAX_CHECKIN_WAIT_SECONDS;
use crate::server::http::extract::AuthenticatedClient;
use crate::server::secagg_snapshots::POLL_INTERVAL;
use crate::store::RoundKey;
use crate::store::{Participation, Round, RoundStage, SecAggMessageKind, now_millis};

const BASE: &str = cohort_edge::protocol::routes::SECAGG_BASE;

/// The client routes of secure rounds, with absolute paths.
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(&format!("{BASE}/keys"), post(advertise).get(directory))
        .route(&format!("{BASE}/roster"), axum::routing::get(roster))
        .route(&format!("{BASE}/reveal"), post(reveal))
        .route(&format!("{BASE}/shares"), post(share).get(shares))
        .route(&format!("{BASE}/survivors"), axum::routing::get(survivors))
        .route(&format!("{BASE}/confirm"), post(confirm))
        .route(&format!("{BASE}/unmask"), post(unmask).get(unmask_request))
}

/// The handlers above, for the OpenAPI document.
#[derive(utoipa::OpenApi)]
#[openapi(
    paths(advertise, roster, reveal, directory, share, shares, survivors, confirm, unmask_request, unmask),
    components(schemas(Accepted, RosterReply, DirectoryReply, SharesReply, SurvivorsReply)),
    tags((name = "secure aggregation", description = "The stages of a SecAgg+ round, for edge clients"))
)]
pub(crate) struct SecAggDoc;

/// How long a `GET` may wait for its stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// Seconds to wait for the stage to close (long poll), at most 30.
    #[param(minimum = 0, maximum = 30)]
    #[serde(default)]
    pub wait_seconds: u64,
}

/// A stored protocol message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Accepted {
    /// The stage the message belongs to (the one that takes it).
    pub stage: RoundStage,
}

/// A secure round as one of its clients sees it.
struct ClientView {
    experiment: Uuid,
    round: Round,
    config: RoundConfig,
    me: Participation,
    index: u32,
}

fn round_error(e: SecureRoundError) -> ApiError {
    match e {
        SecureRoundError::Store(s) => s.into(),
        other => ApiError::internal(other),
    }
}

/// The protocol's refusal as an API error: a message for the wrong stage or from a
/// client no longer in the round is a conflict; a malformed one is unprocessable.
fn protocol_error(e: SecAggError) -> ApiError {
    match e {
        SecAggError::WrongStage { .. } => ApiError::conflict(ErrorCode::WrongStage, e.to_string()),
        SecAggError::NotInRound(_) => ApiError::conflict(ErrorCode::NotInRound, e.to_string()),
        SecAggError::Duplicate(_) => ApiError::conflict(ErrorCode::AlreadySent, e.to_string()),
        SecAggError::RoundFailed(_) => ApiError::conflict(ErrorCode::RoundFailed, e.to_string()),
        SecAggError::Excluded(_) => ApiError::conflict(ErrorCode::Excluded, e.to_string()),
        other => ApiError::unprocessable(ErrorCode::InvalidMessage, other.to_string()),
    }
}

async fn view(
    state: &AppState,
    client: Uuid,
    id: &str,
    round: i64,
    attempt: i64,
) -> Result<ClientView, ApiError> {
    let experiment = crate::server::http::extract::parse_id(id, "experiment")?;
    let r = state.store.round(experiment, round, attempt).await?;
    let config = round_config(&r).map_err(round_error)?.ok_or_else(|| {
        ApiError::conflict(
            ErrorCode::NotSecure,
            format!("round {round} attempt {attempt} does not use secure aggregation"),
        )
    })?;
    let me = state
        .store
        .participation(experiment, round, attempt, client)
        .await?
        .ok_or_else(|| {
            ApiError::conflict(
                ErrorCode::NotSelected,
                format!("client {client} is not selected for round {round}"),
            )
        })?;
    let index = me
        .secagg_index
        .and_then(|i| u32::try_from(i).ok())
        .ok_or_else(|| ApiError::internal("a secure round's participation has no index"))?;
    Ok(ClientView {
        experiment,
        round: r,
        config,
        me,
        index,
    })
}

fn check_wait(q: &WaitQuery) -> Result<Duration, ApiError> {
    if q.wait_seconds > MAX_CHECKIN_WAIT_SECONDS {
        return Err(ApiError::unprocessable(
            ErrorCode::InvalidQuery,
            format!("wait_seconds must be at most {MAX_CHECKIN_WAIT_SECONDS}"),
        ));
    }
    Ok(Duration::from_secs(q.wait_seconds))
}

fn failed(round: &Round) -> ApiError {
    ApiError::conflict(
        ErrorCode::RoundFailed,
        format!(
            "round {} attempt {} failed: {}",
            round.round,
            round.attempt,
            round.failure.as_deref().unwrap_or("no reason recorded")
        ),
    )
}

fn not_in_round(round: &Round, what: &str) -> ApiError {
    ApiError::conflict(
        ErrorCode::NotInRound,
        format!(
            "round {} attempt {} went on without this client: it {what}",
            round.round, round.attempt
        ),
    )
}

/// Whether `stage` comes after `of` in a secure round.
fn past(stage: RoundStage, of: RoundStage) -> bool {
    stage.rank() > of.rank()
}

/// The `wait_seconds` query of a long poll, or why it did not parse.
type WaitParam = Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>;

/// The round's closed stages through `closed`, as this replica keeps them.
async fn closed(
    state: &AppState,
    v: &ClientView,
    closed: RoundStage,
) -> Result<std::sync::Arc<ServerSession>, ApiError> {
    state
        .secure_rounds
        .closed(&state.store, &v.round, closed)
        .await
        .map_err(round_error)
}

/// A long-polling `GET` for what stage `after` produces: waits (up to the query's
/// `wait_seconds`) until the round is past `after`, then answers with `fetch`'s message;
/// `None` when the wait ends first, a 409 when the round failed. While it waits it reads
/// only the round's stage, through the replica's shared read.
async fn poll_after<'a, T, F, Fut>(
    state: &'a AppState,
    client: &'a AuthenticatedClient,
    (id, round, attempt): (&'a str, i64, i64),
    query: WaitParam,
    after: RoundStage,
    fetch: F,
) -> Result<(RoundStage, Option<T>), ApiError>
where
    F: FnOnce(ClientView) -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>>,
{
    let Query(q) =
        query.map_err(|e| ApiError::unprocessable(ErrorCode::InvalidQuery, e.body_text()))?;
    let wait = check_wait(&q)?;
    let until = tokio::time::Instant::now() + wait;
    let mut v = view(state, client.0.id, id, round, attempt).await?;
    let found = loop {
        let stage = v.round.stage;
        if stage == RoundStage::Failed {
            return Err(failed(&v.round));
        }
        if past(stage, after) {
            break (stage, Some(fetch(v).await?));
        }
        if tokio::time::Instant::now() >= until {
            break (stage, None);
        }
        tokio::time::sleep(POLL_INTERVAL).await;
        let now = state
            .secure_rounds
            .round(&state.store, v.experiment, round, attempt)
            .await?;
        if now.stage == RoundStage::Failed || past(now.stage, after) {
            // The caller's own row may have changed with the stage.
            v = view(state, client.0.id, id, round, attempt).await?;
        } else {
            v.round = now;
        }
    };
    client_seen(state, client).await;
    Ok(found)
}

async fn record(
    state: &AppState,
    v: &ClientView,
    client: &AuthenticatedClient,
    kind: SecAggMessageKind,
    body: String,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    state
        .store
        .record_secagg_message(
            RoundKey::new(v.experiment, v.round.round, v.round.attempt),
            client.0.id,
            kind,
            &body,
            now_millis(),
        )
        .await?;
    if let Err(e) = state.store.touch_client(client.0.id, now_millis()).await {
        tracing::warn!(error = %e, "could not record the client as seen");
    }
    Ok((
        StatusCode::CREATED,
        Json(Accepted {
            stage: kind.round_stage(),
        }),
    ))
}

/// Takes the caller's message of `kind` (revealing, sharing or confirming): refused
/// unless the round is at that stage, then checked by `check` against the snapshot of
/// the stages before it, then recorded.
async fn take<M: Serialize>(
    state: &AppState,
    client: &AuthenticatedClient,
    (id, round, attempt): (&str, i64, i64),
    kind: SecAggMessageKind,
    message: &M,
    check: impl FnOnce(&ServerSession, u32) -> Result<(), SecAggError>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    let v = view(state, client.0.id, id, round, attempt).await?;
    let stage = kind.round_stage();
    require_stage(&v, stage)?;
    let before = match stage {
        RoundStage::Revealing => RoundStage::Advertising,
        RoundStage::Sharing => RoundStage::Revealing,
        RoundStage::Confirming => RoundStage::Collecting,
        other => {
            return Err(ApiError::internal(format!(
                "no message is taken at {}",
                other.as_str()
            )));
        }
    };
    check(&*closed(state, &v, before).await?, v.index).map_err(protocol_error)?;
    let body = serde_json::to_string(message).map_err(ApiError::internal)?;
    record(state, &v, client, kind, body).await
}

/// Refuses a message the round does not take now. A client that already sent this
/// stage's message gets the distinct code `already_sent`, so that a retry after a lost
/// answer knows its message is in.
fn require_stage(v: &ClientView, stage: RoundStage) -> Result<(), ApiError> {
    if v.me.secagg_stage.as_deref() == Some("excluded") {
        return Err(ApiError::conflict(
            ErrorCode::Excluded,
            format!(
                "this client was excluded from round {} attempt {} for revealing a forged share",
                v.round.round, v.round.attempt
            ),
        ));
    }
    let done = match stage {
        RoundStage::Advertising => v.me.secagg_stage.is_some(),
        RoundStage::Revealing => matches!(
            v.me.secagg_stage.as_deref(),
            Some("revealed" | "shared" | "masked" | "confirmed" | "unmasked")
        ),
        RoundStage::Sharing => matches!(
            v.me.secagg_stage.as_deref(),
            Some("shared" | "masked" | "confirmed" | "unmasked")
        ),
        RoundStage::Confirming => {
            matches!(v.me.secagg_stage.as_deref(), Some("confirmed" | "unmasked"))
        }
        _ => matches!(v.me.secagg_stage.as_deref(), Some("unmasked" | "excluded")),
    };
    if done {
        return Err(ApiError::conflict(
            ErrorCode::AlreadySent,
            format!(
                "this client already sent its {} message in round {} attempt {}",
                stage.as_str(),
                v.round.round,
                v.round.attempt
            ),
        ));
    }
    if v.round.stage == RoundStage::Failed {
        return Err(failed(&v.round));
    }
    if v.round.stage != stage {
        return Err(ApiError::conflict(
            ErrorCode::WrongStage,
            format!(
                "round {} attempt {} is {}, not {}",
                v.round.round,
                v.round.attempt,
                v.round.stage.as_str(),
                stage.as_str()
            ),
        ));
    }
    Ok(())
}

/// Advertising: the caller's two X25519 public keys and graph commitment, signed with
/// the identity it registered.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/keys",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path)),
    request_body = AdvertiseKeys,
    responses((status = 201, body = Accepted), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "Not advertising, already sent, not selected, or no identity registered", body = ErrorBody),
              (status = 422, description = "Not two valid X25519 keys, or a signature that does not verify under the caller's identity", body = ErrorBody)))]
async fn advertise(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    Json(keys): Json<AdvertiseKeys>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    let v = view(&state, client.0.id, &id, round, attempt).await?;
    require_stage(&v, RoundStage::Advertising)?;
    let identity = state
        .store
        .client_identity(client.0.id)
        .await?
        .ok_or_else(|| {
            ApiError::conflict(
                ErrorCode::NoIdentity,
                "this client has no registered identity to sign its keys with: register \
                 one (PUT /api/v1/clients/me/identity) before joining a secure round",
            )
        })?;
    // The protocol's own checks (index, signature, low-order keys) on a scratch session.
    ServerSession::new(v.config.clone())
        .map_err(ApiError::internal)?
        .check_keys(v.index, &keys, &identity)
        .map_err(protocol_error)?;
    // Stored with the identity it was checked under: the round is rebuilt with it even
    // if the admin resets the client's identity meanwhile.
    let entry = DirectoryEntry {
        index: v.index,
        keys,
        identity,
    };
    let body = serde_json::to_string(&entry).map_err(ApiError::internal)?;
    record(&state, &v, &client, SecAggMessageKind::Advertise, body).await
}

/// The roster (`U1` and every member's graph commitment) once advertising has closed.
#[utoipa::path(get, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/roster",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path), WaitQuery),
    responses((status = 200, body = RosterReply), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "The round failed, or the caller did not advertise", body = ErrorBody)))]
async fn roster(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    query: WaitParam,
) -> Result<Json<RosterReply>, ApiError> {
    let state = &state;
    let at = (id.as_str(), round, attempt);
    let (stage, roster) = poll_after(
        state,
        &client,
        at,
        query,
        RoundStage::Advertising,
        |v| async move {
            if v.me.secagg_stage.is_none() {
                return Err(not_in_round(&v.round, "did not advertise keys in time"));
            }
            closed(state, &v, RoundStage::Advertising)
                .await?
                .roster()
                .ok_or_else(|| ApiError::internal("advertising closed without a roster"))
        },
    )
    .await?;
    Ok(Json(RosterReply { stage, roster }))
}

/// Revealing: the nonce behind the caller's graph commitment.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/reveal",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path)),
    request_body = GraphReveal,
    responses((status = 201, body = Accepted), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "Not revealing, already sent, or the caller did not advertise", body = ErrorBody),
              (status = 422, description = "A nonce that does not match the caller's commitment", body = ErrorBody)))]
async fn reveal(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    Json(message): Json<GraphReveal>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    let at = (id.as_str(), round, attempt);
    take(
        &state,
        &client,
        at,
        SecAggMessageKind::Reveal,
        &message,
        |s, i| s.check_reveal(i, &message),
    )
    .await
}

/// The key directory (`U1`) once advertising has closed.
#[utoipa::path(get, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/keys",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path), WaitQuery),
    responses((status = 200, body = DirectoryReply), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "The round failed, or the caller did not advertise", body = ErrorBody)))]
async fn directory(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    query: WaitParam,
) -> Result<Json<DirectoryReply>, ApiError> {
    let state = &state;
    let at = (id.as_str(), round, attempt);
    let (stage, directory) = poll_after(
        state,
        &client,
        at,
        query,
        RoundStage::Revealing,
        |v| async move {
            if v.me.secagg_stage.is_none() {
                return Err(not_in_round(&v.round, "did not advertise keys in time"));
            }
            // Only the caller's neighbourhood: O(k) keys, not O(n).
            closed(state, &v, RoundStage::Revealing)
                .await?
                .directory_for(v.index)
                .ok_or_else(|| ApiError::internal("revealing closed without a key directory"))
        },
    )
    .await?;
    Ok(Json(DirectoryReply { stage, directory }))
}

async fn client_seen(state: &AppState, client: &AuthenticatedClient) {
    if let Err(e) = state.store.touch_client(client.0.id, now_millis()).await {
        tracing::warn!(error = %e, "could not record the client as seen");
    }
}

/// Sharing: one encrypted share pair per neighbour, and the seed commitment.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/shares",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path)),
    request_body = ShareKeys,
    responses((status = 201, body = Accepted), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "Not sharing, already sent, or the caller did not advertise", body = ErrorBody),
              (status = 422, description = "Not exactly one share per neighbour, or a malformed share", body = ErrorBody)))]
async fn share(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    Json(message): Json<ShareKeys>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    let at = (id.as_str(), round, attempt);
    take(
        &state,
        &client,
        at,
        SecAggMessageKind::Share,
        &message,
        |s, i| s.check_shares(i, &message),
    )
    .await
}

/// The shares the caller's neighbours in `U2` encrypted for it, once sharing has closed.
#[utoipa::path(get, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/shares",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path), WaitQuery),
    responses((status = 200, body = SharesReply), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "The round failed, or the caller did not share keys", body = ErrorBody)))]
async fn shares(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    query: WaitParam,
) -> Result<Json<SharesReply>, ApiError> {
    let state = &state;
    let at = (id.as_str(), round, attempt);
    let (stage, shares) = poll_after(
        state,
        &client,
        at,
        query,
        RoundStage::Sharing,
        |v| async move {
            match closed(state, &v, RoundStage::Sharing)
                .await?
                .forwarded_for(v.index)
            {
                Ok(f) => Ok(f),
                Err(SecAggError::NotInRound(_)) => {
                    Err(not_in_round(&v.round, "did not share keys in time"))
                }
                Err(e) => Err(protocol_error(e)),
            }
        },
    )
    .await?;
    Ok(Json(SharesReply { stage, shares }))
}

/// The survivors (`U3`), once masked input collection has closed.
#[utoipa::path(get, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/survivors",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path), WaitQuery),
    responses((status = 200, body = SurvivorsReply), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "The round failed, or the caller's masked input is not in the sum", body = ErrorBody)))]
async fn survivors(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    query: WaitParam,
) -> Result<Json<SurvivorsReply>, ApiError> {
    let state = &state;
    let at = (id.as_str(), round, attempt);
    let (stage, request) = poll_after(
        state,
        &client,
        at,
        query,
        RoundStage::Collecting,
        |v| async move {
            let request = closed(state, &v, RoundStage::Collecting)
                .await?
                .survivor_list()
                .ok_or_else(|| ApiError::internal("collection closed without survivors"))?;
            if request.survivors.binary_search(&v.index).is_err() {
                return Err(not_in_round(
                    &v.round,
                    "did not upload a masked input in time",
                ));
            }
            Ok(request)
        },
    )
    .await?;
    Ok(Json(SurvivorsReply { stage, request }))
}

/// Confirming (consistency check): the caller's signature over the survivor list it was
/// sent.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/confirm",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path)),
    request_body = Confirmation,
    responses((status = 201, body = Accepted), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "Not confirming, already sent, or not a survivor", body = ErrorBody),
              (status = 422, description = "A signature that does not verify under the caller's identity", body = ErrorBody)))]
async fn confirm(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    Json(message): Json<Confirmation>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    let at = (id.as_str(), round, attempt);
    take(
        &state,
        &client,
        at,
        SecAggMessageKind::Confirm,
        &message,
        |s, i| s.check_confirmation(i, &message),
    )
    .await
}

/// The stage whose close produces what survivors answer: confirming with the
/// consistency check, collecting without.
fn before_unmasking(config: &RoundConfig) -> RoundStage {
    if config.consistency_check {
        RoundStage::Confirming
    } else {
        RoundStage::Collecting
    }
}

/// The survivor list with the signatures of the caller's neighbours over it, once
/// confirming has closed (without the consistency check: once collection has closed,
/// and with no signatures).
#[utoipa::path(get, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/unmask",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path), WaitQuery),
    responses((status = 200, body = SurvivorsReply), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "The round failed, or the caller is not a survivor that signed the list", body = ErrorBody)))]
async fn unmask_request(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    query: WaitParam,
) -> Result<Json<SurvivorsReply>, ApiError> {
    let state = &state;
    let at = (id.as_str(), round, attempt);
    let config = view(state, client.0.id, &id, round, attempt).await?.config;
    let (stage, request) = poll_after(
        state,
        &client,
        at,
        query,
        before_unmasking(&config),
        |v| async move {
            let session = closed(state, &v, before_unmasking(&v.config)).await?;
            let signed = !v.config.consistency_check || session.confirmed().any(|u| u == v.index);
            match session.unmask_request_for(v.index) {
                Some(request) if signed => Ok(request),
                _ => Err(not_in_round(
                    &v.round,
                    "is not a survivor that signed the survivor list in time",
                )),
            }
        },
    )
    .await?;
    Ok(Json(SurvivorsReply { stage, request }))
}

/// Unmasking: the caller's shares of its neighbours' secrets: seeds of survivors, mask
/// keys of clients that dropped after sharing.
#[utoipa::path(post, path = "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg/unmask",
    tag = "secure aggregation", security(("client_credential" = [])),
    params(("id" = uuid::Uuid, Path), ("round" = i64, Path), ("attempt" = i64, Path)),
    request_body = UnmaskShares,
    responses((status = 201, body = Accepted), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "Not unmasking, already sent, or not a survivor", body = ErrorBody),
              (status = 422, description = "A share of the wrong kind, owner or holder", body = ErrorBody)))]
async fn unmask(
    State(state): State<AppState>,
    client: AuthenticatedClient,
    Path((id, round, attempt)): Path<(String, i64, i64)>,
    Json(message): Json<UnmaskShares>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    let v = view(&state, client.0.id, &id, round, attempt).await?;
    require_stage(&v, RoundStage::Unmasking)?;
    let checked = closed(&state, &v, before_unmasking(&v.config))
        .await?
        .check_unmask(v.index, &message);
    let body = serde_json::to_string(&message).map_err(ApiError::internal)?;
    match checked {
        Ok(()) => record(&state, &v, &client, SecAggMessageKind::Unmask, body).await,
        Err(forged @ SecAggError::WrongShare { .. }) => {
            // The forged answer is kept as the evidence that excludes its sender; the
            // secret is rebuilt from the other holders' shares.
            record(&state, &v, &client, SecAggMessageKind::Forged, body).await?;
            tracing::warn!(client = %client.0.id, round, attempt, error = %forged,
                "client excluded from unmasking");
            Err(ApiError::unprocessable(
                ErrorCode::ForgedShare,
                forged.to_string(),
            ))
        }
        Err(e) => Err(protocol_error(e)),
    }
}
