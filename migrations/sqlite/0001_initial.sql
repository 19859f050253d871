-- Cohort's system of record, SQLite flavour. Times are Unix milliseconds (INTEGER) and
-- ids are UUID text on both backends, so the same queries and row types serve both.

CREATE TABLE experiments (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    spec          TEXT NOT NULL,
    state         TEXT NOT NULL,
    current_round INTEGER NOT NULL DEFAULT 0,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);

CREATE TABLE enrolment_tokens (
    id          TEXT PRIMARY KEY,
    token_hash  BLOB NOT NULL UNIQUE,
    label       TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER,
    used_at     INTEGER,
    used_by     TEXT,
    revoked_at  INTEGER
);

CREATE TABLE clients (
    id            TEXT PRIMARY KEY,
    secret_hash   BLOB NOT NULL,
    label         TEXT NOT NULL,
    token_id      TEXT NOT NULL REFERENCES enrolment_tokens (id),
    enrolled_at   INTEGER NOT NULL,
    last_seen_at  INTEGER,
    revoked_at    INTEGER
);

CREATE TABLE rounds (
    experiment_id  TEXT NOT NULL REFERENCES experiments (id),
    round          INTEGER NOT NULL,
    attempt        INTEGER NOT NULL,
    stage          TEXT NOT NULL,
    stage_deadline INTEGER,
    selected       INTEGER NOT NULL DEFAULT 0,
    reported       INTEGER NOT NULL DEFAULT 0,
    dropped        INTEGER NOT NULL DEFAULT 0,
    test_accuracy  REAL,
    test_loss      REAL,
    train_loss     REAL,
    started_at     INTEGER NOT NULL,
    finished_at    INTEGER,
    -- A round that fails for want of a quorum is run again as the next attempt.
    PRIMARY KEY (experiment_id, round, attempt)
);

CREATE TABLE participations (
    experiment_id TEXT NOT NULL,
    round         INTEGER NOT NULL,
    attempt       INTEGER NOT NULL,
    client_id     TEXT NOT NULL REFERENCES clients (id),
    state         TEXT NOT NULL,
    selected_at   INTEGER NOT NULL,
    uploaded_at   INTEGER,
    num_samples   INTEGER,
    train_loss    REAL,
    PRIMARY KEY (experiment_id, round, attempt, client_id),
    FOREIGN KEY (experiment_id, round, attempt) REFERENCES rounds (experiment_id, round, attempt)
);

CREATE TABLE uploads (
    id            TEXT PRIMARY KEY,
    experiment_id TEXT NOT NULL,
    round         INTEGER NOT NULL,
    attempt       INTEGER NOT NULL,
    client_id     TEXT NOT NULL,
    blob_path     TEXT NOT NULL,
    bytes         INTEGER NOT NULL,
    sha256        BLOB NOT NULL,
    created_at    INTEGER NOT NULL,
    num_samples   INTEGER NOT NULL,
    UNIQUE (experiment_id, round, attempt, client_id),
    FOREIGN KEY (experiment_id, round, attempt, client_id)
        REFERENCES participations (experiment_id, round, attempt, client_id)
);

CREATE TABLE models (
    experiment_id TEXT NOT NULL REFERENCES experiments (id),
    round         INTEGER NOT NULL,
    blob_path     TEXT NOT NULL,
    parameters    INTEGER NOT NULL,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (experiment_id, round)
);

CREATE TABLE jobs (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    kind          TEXT NOT NULL,
    experiment_id TEXT NOT NULL REFERENCES experiments (id),
    round         INTEGER NOT NULL,
    state         TEXT NOT NULL,
    attempts      INTEGER NOT NULL DEFAULT 0,
    max_attempts  INTEGER NOT NULL,
    run_after     INTEGER NOT NULL,
    locked_by     TEXT,
    locked_until  INTEGER,
    last_error    TEXT,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);
CREATE INDEX jobs_claimable ON jobs (state, run_after);

CREATE TABLE audit_log (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      INTEGER NOT NULL,
    actor   TEXT NOT NULL,
    action  TEXT NOT NULL,
    subject TEXT NOT NULL,
    detail  TEXT NOT NULL
);
