-- People who use the admin API and the dashboard, each with a role and a token of
-- their own (only its SHA-256 is kept). The first admin is the admin token from the
-- settings, which is not a row here.
CREATE TABLE users (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    role        TEXT NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    secret_hash BYTEA NOT NULL,
    created_at  BIGINT NOT NULL,
    created_by  TEXT NOT NULL,
    revoked_at  BIGINT
);

-- A dashboard session is the admin token's (no user) or a person's, whose role then
-- decides what the session may do; revoking the person ends their sessions.
ALTER TABLE dashboard_sessions ADD COLUMN user_id TEXT;
