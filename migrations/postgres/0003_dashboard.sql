-- The admin web dashboard. A signed-in browser holds a random session id in an HttpOnly
-- cookie; only its SHA-256 is stored, so a copy of the database signs nobody in. Sessions
-- live in the database, not in a coordinator's memory, so any replica behind a load
-- balancer accepts them and sign-out ends them everywhere.
CREATE TABLE dashboard_sessions (
    id_hash      BYTEA PRIMARY KEY,
    created_at   BIGINT NOT NULL,
    last_seen_at BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL
);
CREATE INDEX dashboard_sessions_expiry ON dashboard_sessions (expires_at);

-- The clients page counts each client's rounds; the experiment page lists its jobs.
CREATE INDEX participations_by_client ON participations (client_id, state);
CREATE INDEX jobs_by_experiment ON jobs (experiment_id, id);
CREATE INDEX clients_by_enrolment ON clients (enrolled_at, id);
CREATE INDEX enrolment_tokens_by_creation ON enrolment_tokens (created_at, id);
