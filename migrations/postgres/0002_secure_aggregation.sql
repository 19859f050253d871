-- Secure aggregation (SecAgg+). A secure round moves through advertising, sharing,
-- collecting (masked inputs) and unmasking before it aggregates; each client's progress
-- and the stage it dropped at are on its participation row, and the protocol messages
-- the coordinator routes (public keys, encrypted shares, revealed shares) are stored so
-- that any coordinator can rebuild the round's state from the database alone.

-- The round's public protocol settings (JSON), null for a plain round.
ALTER TABLE rounds ADD COLUMN secagg TEXT;
-- Why a failed attempt failed.
ALTER TABLE rounds ADD COLUMN failure TEXT;

-- The client's index in the protocol (1..n), its last completed stage
-- (advertised, shared, masked, unmasked) and the stage it dropped at.
ALTER TABLE participations ADD COLUMN secagg_index BIGINT;
ALTER TABLE participations ADD COLUMN secagg_stage TEXT;
ALTER TABLE participations ADD COLUMN dropped_stage TEXT;

CREATE TABLE secagg_messages (
    experiment_id TEXT NOT NULL,
    round         BIGINT NOT NULL,
    attempt       BIGINT NOT NULL,
    client_id     TEXT NOT NULL,
    -- advertise, share or unmask
    stage         TEXT NOT NULL,
    -- The message as JSON; never an unmasked update (masked inputs are uploads).
    body          TEXT NOT NULL,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (experiment_id, round, attempt, client_id, stage),
    FOREIGN KEY (experiment_id, round, attempt, client_id)
        REFERENCES participations (experiment_id, round, attempt, client_id)
);
