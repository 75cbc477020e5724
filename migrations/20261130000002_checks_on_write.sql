-- Checks that run when a value is written, not on every update of the row.
--
-- Postgres evaluates every CHECK constraint of a table on every UPDATE, whichever columns the
-- UPDATE sets. rowq updates each job three times (claim, fence, finish), and three of the checks
-- of the first migration -- two regular expressions and the payload serialised to text to measure
-- it (a whole 1 MiB payload, three times per job) -- took 12% of Postgres's CPU in a drain.
-- A domain's constraints run when a value is stored in a column of that domain: on INSERT, or an
-- UPDATE that sets the column, never when the row moves between states. Same rules, same names,
-- so a bad INSERT still fails with, e.g.:
--   value for domain rowq.job_kind violates check constraint "jobs_kind_is_a_nonempty_identifier"
-- The cheap integer and array checks stay table constraints.
--
-- The column type changes take an ACCESS EXCLUSIVE lock on rowq.jobs while they verify the
-- existing rows (no rewrite: each domain is over the column's own type).

CREATE DOMAIN rowq.job_kind AS text
    CONSTRAINT jobs_kind_is_a_nonempty_identifier
        CHECK (VALUE ~ '^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$');

CREATE DOMAIN rowq.queue_name AS text
    CONSTRAINT jobs_queue_is_a_nonempty_identifier
        CHECK (VALUE ~ '^[A-Za-z0-9_.-]{1,64}$');

CREATE DOMAIN rowq.job_payload AS jsonb
    CONSTRAINT jobs_payload_is_a_json_object
        CHECK (jsonb_typeof(VALUE) = 'object')
    CONSTRAINT jobs_payload_is_at_most_1_mib
        CHECK (octet_length(VALUE::text) <= 1048576);

-- group_key becomes the SQS MessageGroupId: 1-128 printable ASCII characters, no spaces.
CREATE DOMAIN rowq.group_key AS text
    CONSTRAINT jobs_group_key_is_1_to_128_printable_ascii
        CHECK (VALUE ~ '^[!-~]{1,128}$');

ALTER TABLE rowq.jobs
    DROP CONSTRAINT jobs_kind_is_a_nonempty_identifier,
    DROP CONSTRAINT jobs_queue_is_a_nonempty_identifier,
    DROP CONSTRAINT jobs_payload_is_a_json_object,
    DROP CONSTRAINT jobs_payload_is_at_most_1_mib,
    DROP CONSTRAINT jobs_group_key_is_1_to_128_printable_ascii,
    ALTER COLUMN kind TYPE rowq.job_kind,
    ALTER COLUMN queue TYPE rowq.queue_name,
    ALTER COLUMN payload TYPE rowq.job_payload,
    ALTER COLUMN group_key TYPE rowq.group_key;
