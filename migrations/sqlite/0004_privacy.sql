-- Differential privacy. Each round attempt of a private experiment carries what it was
-- charged (the sampling rate, the noise multiplier after dropouts, the clip and the
-- fixed denominator) and epsilon spent by the experiment up to and including it, as
-- JSON: the accountant re-composes the stored charges, so the number the API and the
-- dashboard show is the one the budget check used.
ALTER TABLE rounds ADD COLUMN privacy TEXT;
