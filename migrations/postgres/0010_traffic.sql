-- Bytes each selected client moved in its round attempt: what it uploaded (as sent:
-- compressed, masked or plain) and the models it downloaded while selected. NULL until
-- it does.
ALTER TABLE participations ADD COLUMN bytes_up BIGINT;
ALTER TABLE participations ADD COLUMN bytes_down BIGINT;
