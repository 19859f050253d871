-- Each client's long-term Ed25519 public key (its identity): registered at enrolment,
-- or once afterwards by a client enrolled before identities existed, and shown to the
-- admin as a fingerprint so that sites can be checked out of band. Secure rounds give
-- each client its neighbours' identities, under which their advertised keys are signed.
CREATE TABLE client_identities (
    client_id     TEXT PRIMARY KEY REFERENCES clients (id),
    public_key    BYTEA NOT NULL,
    registered_at BIGINT NOT NULL
);
