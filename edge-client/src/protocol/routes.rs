//! The client routes' paths, written once: the coordinator registers its routes with
//! these templates (`{id}`, `{round}`, `{attempt}` are path parameters) and the edge
//! client fills them in. A coordinator test checks that each is in the OpenAPI document.

use uuid::Uuid;

/// Spend an enrolment token (`POST`).
pub const ENROL: &str = "/api/v1/clients/enrol";
/// Who the caller is (`GET`).
pub const ME: &str = "/api/v1/clients/me";
/// The caller's identity key (`PUT`).
pub const IDENTITY: &str = "/api/v1/clients/me/identity";
/// Check in and wait for a task (`POST`).
pub const CHECKIN: &str = "/api/v1/clients/checkin";
/// An experiment's current global model (`GET`).
pub const MODEL: &str = "/api/v1/clients/experiments/{id}/model";
/// A client's evaluation of a model version (`POST`).
pub const EVALUATIONS: &str = "/api/v1/clients/experiments/{id}/evaluations";
/// A round attempt's update upload (`POST`, octets).
pub const UPDATE: &str =
    "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/update";
/// A failed task's report (`POST`).
pub const FAILURE: &str =
    "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/failure";
/// The secure aggregation messages of a round attempt: this, `/` and a [`SECAGG`] stage.
pub const SECAGG_BASE: &str =
    "/api/v1/clients/experiments/{id}/rounds/{round}/attempts/{attempt}/secagg";
/// The last segment of each secure aggregation route, in the order a round meets them.
pub const SECAGG: [&str; 7] = [
    "keys",
    "roster",
    "reveal",
    "shares",
    "survivors",
    "confirm",
    "unmask",
];

/// Every client route's template but the secure aggregation ones (see [`SECAGG`]).
pub const ALL: [&str; 8] = [
    ENROL,
    ME,
    IDENTITY,
    CHECKIN,
    MODEL,
    EVALUATIONS,
    UPDATE,
    FAILURE,
];

/// A secure aggregation route's template: `SECAGG_BASE/what`.
pub fn secagg_template(what: &str) -> String {
    format!("{SECAGG_BASE}/{what}")
}

/// `template` with the experiment filled in.
pub fn for_experiment(template: &str, experiment: Uuid) -> String {
    template.replace("{id}", &experiment.to_string())
}

/// `template` with the experiment, round and attempt filled in.
pub fn for_attempt(template: &str, experiment: Uuid, round: i64, attempt: i64) -> String {
    for_experiment(template, experiment)
        .replace("{round}", &round.to_string())
        .replace("{attempt}", &attempt.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_paths_have_no_parameters_left() {
        let id = Uuid::nil();
        for template in ALL
            .iter()
            .map(|t| t.to_string())
            .chain(SECAGG.iter().map(|s| secagg_template(s)))
        {
            let path = for_attempt(&template, id, 3, 2);
            assert!(!path.contains('{'), "{path}");
            assert!(path.starts_with("/api/v1/clients/"), "{path}");
        }
        assert_eq!(
            for_attempt(UPDATE, id, 3, 2),
            format!("/api/v1/clients/experiments/{id}/rounds/3/attempts/2/update")
        );
    }
}
