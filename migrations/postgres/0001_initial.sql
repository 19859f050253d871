-- Cohort's system of record, PostgreSQL flavour. Times are Unix milliseconds (BIGINT) and
-- ids are UUID text on both backends, so the same queries and row types serve both.

CREATE TABLE experiments (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    spec          TEXT NOT NULL,
    state         TEXT NOT NULL,
    current_round BIGINT NOT NULL DEFAULT 0,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);

CREATE TABLE enrolment_tokens (
    id          TEXT PRIMARY KEY,
    token_hash  BYTEA NOT NULL UNIQUE,
    label       TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    expires_at  BIGINT,
    used_at     BIGINT,
    used_by     TEXT,
    revoked_at  BIGINT
);

CREATE TABLE clients (
    id            TEXT PRIMARY KEY,
    secret_hash   BYTEA NOT NULL,
    label         TEXT NOT NULL,
    token_id      TEXT NOT NULL REFERENCES enrolment_tokens (id),
    enrolled_at   BIGINT NOT NULL,
    last_seen_at  BIGINT,
    revoked_at    BIGINT
);

CREATE TABLE rounds (
    experiment_id  TEXT NOT NULL REFERENCES experiments (id),
    round          BIGINT NOT NULL,
    attempt        BIGINT NOT NULL,
    stage          TEXT NOT NULL,
    stage_deadline BIGINT,
    selected       BIGINT NOT NULL DEFAULT 0,
    reported       BIGINT NOT NULL DEFAULT 0,
    dropped        BIGINT NOT NULL DEFAULT 0,
    test_accuracy  DOUBLE PRECISION,
    test_loss      DOUBLE PRECISION,
    train_loss     DOUBLE PRECISION,
    started_at     BIGINT NOT NULL,
    finished_at    BIGINT,
    -- A round that fails for want of a quorum is run again as the next attempt.
    PRIMARY KEY (experiment_id, round, attempt)
);

CREATE TABLE participations (
    experiment_id TEXT NOT NULL,
    round         BIGINT NOT NULL,
    attempt       BIGINT NOT NULL,
    client_id     TEXT NOT NULL REFERENCES clients (id),
    state         TEXT NOT NULL,
    selected_at   BIGINT NOT NULL,
    uploaded_at   BIGINT,
    num_samples   BIGINT,
    train_loss    DOUBLE PRECISION,
    PRIMARY KEY (experiment_id, round, attempt, client_id),
    FOREIGN KEY (experiment_id, round, attempt) REFERENCES rounds (experiment_id, round, attempt)
);

CREATE TABLE uploads (
    id            TEXT PRIMARY KEY,
    experiment_id TEXT NOT NULL,
    round         BIGINT NOT NULL,
    attempt       BIGINT NOT NULL,
    client_id     TEXT NOT NULL,
    blob_path     TEXT NOT NULL,
    bytes         BIGINT NOT NULL,
    sha256        BYTEA NOT NULL,
    created_at    BIGINT NOT NULL,
    num_samples   BIGINT NOT NULL,
    UNIQUE (experiment_id, round, attempt, client_id),
    FOREIGN KEY (experiment_id, round, attempt, client_id)
        REFERENCES participations (experiment_id, round, attempt, client_id)
);

CREATE TABLE models (
    experiment_id TEXT NOT NULL REFERENCES experiments (id),
    round         BIGINT NOT NULL,
    blob_path     TEXT NOT NULL,
    parameters    BIGINT NOT NULL,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (experiment_id, round)
);

CREATE TABLE jobs (
    id            BIGSERIAL PRIMARY KEY,
    kind          TEXT NOT NULL,
    experiment_id TEXT NOT NULL REFERENCES experiments (id),
    round         BIGINT NOT NULL,
    state         TEXT NOT NULL,
    attempts      BIGINT NOT NULL DEFAULT 0,
    max_attempts  BIGINT NOT NULL,
    run_after     BIGINT NOT NULL,
    locked_by     TEXT,
    locked_until  BIGINT,
    last_error    TEXT,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);
CREATE INDEX jobs_claimable ON jobs (state, run_after);

CREATE TABLE audit_log (
    id      BIGSERIAL PRIMARY KEY,
    at      BIGINT NOT NULL,
    actor   TEXT NOT NULL,
    action  TEXT NOT NULL,
    subject TEXT NOT NULL,
    detail  TEXT NOT NULL
);
