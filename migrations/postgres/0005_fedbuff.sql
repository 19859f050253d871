-- FedBuff (buffered asynchronous aggregation). An experiment in mode fedbuff reuses the
-- rounds, participations and uploads tables: round r is the buffer that becomes model
-- version r, a participation is one task handed to a client (in the round whose buffer
-- was open at the time), and an upload is folded into whichever buffer was open when it
-- arrived, which may be a later one than its task's. Plain rounds leave all three
-- columns null.

-- The model version (published round) the client trained on.
ALTER TABLE participations ADD COLUMN base_version BIGINT;
-- The buffer (round) the upload was folded into, and how many server steps had been
-- taken since its base version when it is applied: buffer - 1 - base_version.
ALTER TABLE uploads ADD COLUMN buffer_round BIGINT;
ALTER TABLE uploads ADD COLUMN staleness BIGINT;
-- The aggregation job reads a buffer's uploads.
CREATE INDEX uploads_by_buffer ON uploads (experiment_id, buffer_round);
