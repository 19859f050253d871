-- Idempotent uploads: the id a client chose for an upload. A retry carrying the same id
-- (its first try stored, the answer lost) is answered with the stored upload instead of
-- being counted again or refused.
ALTER TABLE uploads ADD COLUMN client_upload_id TEXT;
CREATE UNIQUE INDEX uploads_client_upload_id ON uploads (client_id, client_upload_id)
    WHERE client_upload_id IS NOT NULL;
