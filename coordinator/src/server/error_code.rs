//! Every error code the API can answer with, its HTTP status and what it means: one
//! list, from which the OpenAPI document enumerates `ErrorBody.error.code`. A handler
//! can only answer with a code from here (the API error type holds an [`ErrorCode`], not
//! a string), so no code goes undocumented.

use axum::http::StatusCode;
use cohort_core::round::UploadRefusal;

macro_rules! error_codes {
    ($($variant:ident = $code:literal, $status:ident, $meaning:literal;)*) => {
        /// A stable, machine-readable reason for an error answer.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $(
                #[doc = $meaning]
                $variant,
            )*
        }

        impl ErrorCode {
            /// Every code, in the order the document lists them.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),*];

            /// The code as sent: `snake_case`.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $code,)*
                }
            }

            /// The HTTP status an answer with this code has.
            pub fn status(self) -> StatusCode {
                match self {
                    $(ErrorCode::$variant => StatusCode::$status,)*
                }
            }

            /// What the code means, for the document.
            pub fn meaning(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $meaning,)*
                }
            }
        }
    };
}

error_codes! {
    BadRequest = "bad_request", BAD_REQUEST,
        "The request could not be read as one this route takes.";
    MalformedJson = "malformed_json", BAD_REQUEST,
        "The body is not well-formed JSON.";
    UnreadableBody = "unreadable_body", BAD_REQUEST,
        "The body could not be read (the connection failed part-way, or it is not UTF-8).";
    InvalidId = "invalid_id", BAD_REQUEST,
        "A path segment that should be an id (a UUID) is not one.";
    Unauthorized = "unauthorized", UNAUTHORIZED,
        "No valid credential: a missing, malformed or wrong token.";
    Forbidden = "forbidden", FORBIDDEN,
        "A valid credential that may not do this: a revoked client, or a person whose role does not allow the operation.";
    NotFound = "not_found", NOT_FOUND,
        "No such route, or no such experiment, round, client, token or model.";
    MethodNotAllowed = "method_not_allowed", METHOD_NOT_ALLOWED,
        "The route exists, not with this method.";
    InvalidTransition = "invalid_transition", CONFLICT,
        "The experiment's state does not allow this change (start a running experiment, resume one that is not paused).";
    ExperimentNotRunning = "experiment_not_running", CONFLICT,
        "The experiment is not running, so it takes no updates.";
    NoBufferOpen = "no_buffer_open", CONFLICT,
        "FedBuff: no buffer takes updates (the last server step was taken).";
    RoundNotCollecting = "round_not_collecting", CONFLICT,
        "The round attempt is in another stage than collecting uploads.";
    DeadlinePassed = "deadline_passed", CONFLICT,
        "The attempt's (or its secure stage's) deadline has passed.";
    NotSelected = "not_selected", CONFLICT,
        "The client is not selected for this round attempt.";
    AlreadyUploaded = "already_uploaded", CONFLICT,
        "The client's update for this attempt is already stored.";
    DroppedFromRound = "dropped_from_round", CONFLICT,
        "The client was dropped from the attempt: it missed a deadline or a secure stage (its key shares did not go out), reported a failed task, or was revoked.";
    TaskExpired = "task_expired", CONFLICT,
        "FedBuff: the client's task outlived its deadline.";
    TooStale = "too_stale", CONFLICT,
        "FedBuff: the update is staler than `max_staleness`.";
    NotSecure = "not_secure", CONFLICT,
        "A secure aggregation message for a round that does not run it.";
    WrongStage = "wrong_stage", CONFLICT,
        "A secure aggregation message for a stage the round is not in.";
    AlreadySent = "already_sent", CONFLICT,
        "The client already sent this stage's message (a retry after a lost answer can stop).";
    NotInRound = "not_in_round", CONFLICT,
        "The secure round went on without the client: it missed an earlier stage.";
    Excluded = "excluded", CONFLICT,
        "The client was excluded from the secure round for revealing a forged share.";
    RoundFailed = "round_failed", CONFLICT,
        "The round attempt failed; the next attempt will be another round to join.";
    NoIdentity = "no_identity", CONFLICT,
        "Secure rounds: the client registered no identity key to sign with.";
    IdentityConflict = "identity_conflict", CONFLICT,
        "The client has another identity registered; an admin must reset it first.";
    EvaluationsNotTaken = "evaluations_not_taken", CONFLICT,
        "The experiment does not take client evaluations.";
    TokenSpent = "token_spent", CONFLICT,
        "The enrolment token is already used or revoked.";
    AlreadyRevoked = "already_revoked", CONFLICT,
        "The client or user is already revoked.";
    NameTaken = "name_taken", CONFLICT,
        "Another user has this name.";
    PayloadTooLarge = "payload_too_large", PAYLOAD_TOO_LARGE,
        "The body is larger than the server takes (`--max-body-bytes`).";
    UnsupportedMediaType = "unsupported_media_type", UNSUPPORTED_MEDIA_TYPE,
        "The body's content type is not the one this route takes.";
    InvalidBody = "invalid_body", UNPROCESSABLE_ENTITY,
        "Well-formed JSON that is not this route's body (an unknown field, a wrong type).";
    InvalidQuery = "invalid_query", UNPROCESSABLE_ENTITY,
        "A query parameter that is missing, does not parse or is out of range.";
    InvalidExperiment = "invalid_experiment", UNPROCESSABLE_ENTITY,
        "An experiment spec that fails validation; the message names the field.";
    InvalidModel = "invalid_model", UNPROCESSABLE_ENTITY,
        "A model file that is not a safetensors file of float tensors.";
    InvalidUpdate = "invalid_update", UNPROCESSABLE_ENTITY,
        "An update of the wrong size, or with values that are not finite.";
    InvalidEvaluation = "invalid_evaluation", UNPROCESSABLE_ENTITY,
        "A client evaluation with counts or metrics out of range.";
    InvalidFailure = "invalid_failure", UNPROCESSABLE_ENTITY,
        "A task failure report that is empty or too long.";
    InvalidCheckin = "invalid_checkin", UNPROCESSABLE_ENTITY,
        "A check-in whose fields are out of range.";
    InvalidUser = "invalid_user", UNPROCESSABLE_ENTITY,
        "A user whose name breaks the naming rules.";
    InvalidTokenRequest = "invalid_token_request", UNPROCESSABLE_ENTITY,
        "An enrolment token request with a label or lifetime out of range.";
    InvalidLimit = "invalid_limit", UNPROCESSABLE_ENTITY,
        "A page size out of range.";
    InvalidIdentity = "invalid_identity", UNPROCESSABLE_ENTITY,
        "An identity key that is not a valid Ed25519 public key.";
    InvalidMessage = "invalid_message", UNPROCESSABLE_ENTITY,
        "A secure aggregation message that fails the protocol's checks (a bad key, signature or share).";
    ForgedShare = "forged_share", UNPROCESSABLE_ENTITY,
        "A revealed share that does not match its sender's commitment.";
    RateLimited = "rate_limited", TOO_MANY_REQUESTS,
        "The caller sent more than its share; `Retry-After` says when to come back.";
    Internal = "internal", INTERNAL_SERVER_ERROR,
        "A fault on the server's side; the detail is in its log, never in the answer.";
    Unavailable = "unavailable", SERVICE_UNAVAILABLE,
        "The coordinator cannot reach its database right now; retry after `Retry-After`.";
}

impl From<&UploadRefusal> for ErrorCode {
    fn from(refusal: &UploadRefusal) -> Self {
        match refusal {
            UploadRefusal::NotCollecting { .. } => ErrorCode::RoundNotCollecting,
            UploadRefusal::DeadlinePassed { .. } => ErrorCode::DeadlinePassed,
            UploadRefusal::NotSelected { .. } => ErrorCode::NotSelected,
            UploadRefusal::AlreadyUploaded { .. } => ErrorCode::AlreadyUploaded,
            UploadRefusal::Dropped { .. } => ErrorCode::DroppedFromRound,
            UploadRefusal::KeysNotShared { .. } => ErrorCode::DroppedFromRound,
            UploadRefusal::TaskExpired { .. } => ErrorCode::TaskExpired,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_snake_case_and_errors() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert!(seen.insert(code.as_str()), "{code} twice");
            assert!(
                code.as_str()
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_'),
                "{code}"
            );
            assert!(
                code.status().is_client_error() || code.status().is_server_error(),
                "{code}"
            );
            assert!(!code.meaning().is_empty());
        }
    }

    #[test]
    fn every_upload_refusal_has_the_code_the_core_names() {
        for refusal in &UploadRefusal::one_of_each() {
            assert_eq!(ErrorCode::from(refusal).as_str(), refusal.code());
        }
        for code in UploadRefusal::CODES {
            assert!(
                ErrorCode::ALL.iter().any(|c| c.as_str() == code),
                "{code} is not an API error code"
            );
        }
    }
}
