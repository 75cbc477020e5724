-- The last table CHECKs become domains, as the second migration did with the costly ones.
--
-- Postgres reads every CHECK of a table back from its stored text and plans it again on each
-- INSERT statement, whichever columns it sets (in `perf`: `pg_strtok` and `parseNodeString`
-- under `ExecConstraints`). For the five cheap checks the first migration left on rowq.jobs that
-- was ~20 µs of CPU per one-row INSERT, the common way to enqueue: 199-212 µs of the machine's
-- CPU per row with them, 176-194 with these domains (BENCHMARKS.md, round 28). A domain's
-- constraints are read once per connection and run only when a value of the domain is stored:
-- the enqueue, and an UPDATE that sets the column (the fence's `attempts + 1`, a failure's
-- `errors`). Same rules, same names, so a bad row still fails with the rule's name, e.g.:
--   value for domain rowq.max_attempts violates check constraint "jobs_max_attempts_between_1_and_1000"
--
-- No table rewrite: a column changed to a domain that has constraints makes Postgres rewrite the
-- table to check every row (the second migration did; its comment says otherwise). So each
-- domain is created bare, the columns change to it (the table's file is kept; the two partial
-- indexes on priority and dedup_key, which hold unfinished rows only, are rebuilt), and then the
-- constraints are added, each of which scans the rows once to check them. The whole migration is
-- one transaction, so the rows are never writable without their rules.

CREATE DOMAIN rowq.max_attempts AS integer;
CREATE DOMAIN rowq.attempt_count AS integer;
CREATE DOMAIN rowq.dedup_key AS text;
CREATE DOMAIN rowq.priority AS smallint;
CREATE DOMAIN rowq.error_history AS jsonb;

ALTER TABLE rowq.jobs
    DROP CONSTRAINT jobs_max_attempts_between_1_and_1000,
    DROP CONSTRAINT jobs_attempts_not_negative,
    DROP CONSTRAINT jobs_dedup_key_is_1_to_256_characters,
    DROP CONSTRAINT jobs_priority_between_minus_1000_and_1000,
    DROP CONSTRAINT jobs_errors_is_a_json_array,
    ALTER COLUMN max_attempts TYPE rowq.max_attempts,
    ALTER COLUMN attempts TYPE rowq.attempt_count,
    ALTER COLUMN dedup_key TYPE rowq.dedup_key,
    ALTER COLUMN priority TYPE rowq.priority,
    ALTER COLUMN errors TYPE rowq.error_history;

ALTER DOMAIN rowq.max_attempts
    ADD CONSTRAINT jobs_max_attempts_between_1_and_1000 CHECK (VALUE BETWEEN 1 AND 1000);
ALTER DOMAIN rowq.attempt_count
    ADD CONSTRAINT jobs_attempts_not_negative CHECK (VALUE >= 0);
ALTER DOMAIN rowq.dedup_key
    ADD CONSTRAINT jobs_dedup_key_is_1_to_256_characters CHECK (length(VALUE) BETWEEN 1 AND 256);
ALTER DOMAIN rowq.priority
    ADD CONSTRAINT jobs_priority_between_minus_1000_and_1000 CHECK (VALUE BETWEEN -1000 AND 1000);
ALTER DOMAIN rowq.error_history
    ADD CONSTRAINT jobs_errors_is_a_json_array CHECK (jsonb_typeof(VALUE) = 'array');
