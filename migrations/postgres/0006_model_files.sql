-- Models users bring: an uploaded safetensors file is checked, stored as a blob in the
-- wire form (little-endian f32 in the order of its tensors) and described here, so an
-- experiment can start from it and train it with the clients' own trainers.
CREATE TABLE model_files (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    -- JSON array of {"name", "shape"}: the layout every update must match.
    tensors     TEXT NOT NULL,
    parameters  BIGINT NOT NULL,
    -- SHA-256 of the file as uploaded, hex.
    sha256      TEXT NOT NULL,
    blob_path   TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);

-- What clients report about a model version they received: the metrics of their own
-- evaluation (JSON object name -> number) over num_examples of their data. One report per
-- client and version; the round API shows the sample-weighted means.
CREATE TABLE client_evaluations (
    experiment_id  TEXT NOT NULL REFERENCES experiments (id),
    model_version  BIGINT NOT NULL,
    client_id      TEXT NOT NULL REFERENCES clients (id),
    num_examples   BIGINT NOT NULL,
    metrics        TEXT NOT NULL,
    at             BIGINT NOT NULL,
    PRIMARY KEY (experiment_id, model_version, client_id)
);

-- Tasks a client could not complete (its trainer failed, its output was refused), with
-- the reason the client gave. Nothing was uploaded for them.
CREATE TABLE task_failures (
    experiment_id  TEXT NOT NULL REFERENCES experiments (id),
    round          BIGINT NOT NULL,
    attempt        BIGINT NOT NULL,
    client_id      TEXT NOT NULL REFERENCES clients (id),
    reason         TEXT NOT NULL,
    at             BIGINT NOT NULL,
    PRIMARY KEY (experiment_id, round, attempt, client_id)
);
