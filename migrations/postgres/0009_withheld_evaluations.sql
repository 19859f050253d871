-- A client may answer an evaluation without its metrics: under local differential
-- privacy none of its data's metrics leaves the machine un-noised, so it reports only
-- that it withheld them (`local_differential_privacy`), and is not asked again. Such a
-- report has num_examples 0 and no metrics; NULL for a report that carries them.
ALTER TABLE client_evaluations ADD COLUMN withheld TEXT;
