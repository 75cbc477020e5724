-- rowq: a Postgres table as a job queue. See DESIGN.md in the project docs and src/lib.rs.
--
-- Enqueue is a plain INSERT:
--   INSERT INTO rowq.jobs (kind, payload) VALUES ('resize_image', '{"key":"a.png"}');
-- Constraints are named as sentences, so the error a client of any language sees says
-- what is wrong: `violates check constraint "jobs_kind_is_a_nonempty_identifier"`.

CREATE SCHEMA IF NOT EXISTS rowq;

CREATE TYPE rowq.job_state AS ENUM (
    'pending',      -- waiting in Postgres; enqueued, retried, rescued or released after a failed publish
    'dispatched',   -- claimed by a scheduler, a message (job_id, dispatch_gen) is on its way to SQS
    'running',      -- a worker passed the fence and runs it (attempts was incremented)
    'succeeded',    -- terminal: the handler returned Ok, `result` holds its value
    'failed',       -- terminal: attempts used up, a permanent error, unknown kind, or dead-lettered
    'cancelled'     -- terminal: cancelled before it ran
);

CREATE TABLE rowq.jobs (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue             text              NOT NULL DEFAULT 'default',
    kind              text              NOT NULL,
    payload           jsonb             NOT NULL DEFAULT '{}',
    state             rowq.job_state    NOT NULL DEFAULT 'pending',
    priority          smallint          NOT NULL DEFAULT 0,   -- higher runs first
    run_at            timestamptz       NOT NULL DEFAULT now(), -- not before
    attempts          integer           NOT NULL DEFAULT 0,   -- executions started
    max_attempts      integer           NOT NULL DEFAULT 5,
    group_key         text,             -- jobs with one key run one at a time, in id order
    dedup_key         text,             -- a second unfinished job with the key is refused
    dispatch_gen      bigint            NOT NULL DEFAULT 0,   -- the fencing token: +1 per claim
    dispatch_deadline timestamptz,      -- a `dispatched` row not started by then is rescued
    started_at        timestamptz,
    run_deadline      timestamptz,      -- a `running` row not finished by then is rescued
    finished_at       timestamptz,
    result            jsonb,
    last_error        text,
    errors            jsonb             NOT NULL DEFAULT '[]', -- history: [{attempt, at, error}]
    created_at        timestamptz       NOT NULL DEFAULT now(),
    updated_at        timestamptz       NOT NULL DEFAULT now(),

    CONSTRAINT jobs_kind_is_a_nonempty_identifier
        CHECK (kind ~ '^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$'),
    CONSTRAINT jobs_queue_is_a_nonempty_identifier
        CHECK (queue ~ '^[A-Za-z0-9_.-]{1,64}$'),
    CONSTRAINT jobs_payload_is_a_json_object
        CHECK (jsonb_typeof(payload) = 'object'),
    CONSTRAINT jobs_payload_is_at_most_1_mib
        CHECK (octet_length(payload::text) <= 1048576),
    CONSTRAINT jobs_max_attempts_between_1_and_1000
        CHECK (max_attempts BETWEEN 1 AND 1000),
    CONSTRAINT jobs_attempts_not_negative
        CHECK (attempts >= 0),
    -- group_key becomes the SQS MessageGroupId: 1-128 printable ASCII characters, no spaces.
    CONSTRAINT jobs_group_key_is_1_to_128_printable_ascii
        CHECK (group_key IS NULL OR group_key ~ '^[!-~]{1,128}$'),
    CONSTRAINT jobs_dedup_key_is_1_to_256_characters
        CHECK (dedup_key IS NULL OR length(dedup_key) BETWEEN 1 AND 256),
    CONSTRAINT jobs_priority_between_minus_1000_and_1000
        CHECK (priority BETWEEN -1000 AND 1000),
    CONSTRAINT jobs_errors_is_a_json_array
        CHECK (jsonb_typeof(errors) = 'array')
);

-- The claim: due pending rows of one queue, highest priority first, then run_at, then id.
-- Partial, so its size follows the backlog, never the history of finished rows.
CREATE INDEX jobs_claim_idx ON rowq.jobs (queue, priority DESC, run_at, id)
    WHERE state = 'pending';

-- When to wake up next: the earliest future run_at (delayed jobs, retries after backoff).
CREATE INDEX jobs_pending_run_at_idx ON rowq.jobs (queue, run_at)
    WHERE state = 'pending';

-- Rescue of lost dispatches, and the in-flight count used for backpressure.
CREATE INDEX jobs_dispatched_idx ON rowq.jobs (queue, dispatch_deadline)
    WHERE state = 'dispatched';

-- Rescue of workers that died mid-job.
CREATE INDEX jobs_running_idx ON rowq.jobs (run_deadline)
    WHERE state = 'running';

-- Group ordering: "is there an earlier unfinished job in my group?"
CREATE INDEX jobs_group_idx ON rowq.jobs (group_key, id)
    WHERE group_key IS NOT NULL AND state IN ('pending', 'dispatched', 'running');

-- Pruning of finished rows by age.
CREATE INDEX jobs_finished_idx ON rowq.jobs (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled');

-- A dedup'd enqueue: `INSERT ... ON CONFLICT DO NOTHING` is a no-op while a job with the
-- same dedup_key is unfinished; once it finishes the key is free again.
CREATE UNIQUE INDEX jobs_dedup_key_unfinished_idx ON rowq.jobs (dedup_key)
    WHERE dedup_key IS NOT NULL AND state IN ('pending', 'dispatched', 'running');

-- One NOTIFY per inserting statement (not per row) wakes idle schedulers at once.
-- Every scheduler re-checks its own queue on it, which is cheap.
CREATE FUNCTION rowq.notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('rowq_jobs', 'inserted');
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_notify_inserted
    AFTER INSERT ON rowq.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION rowq.notify_inserted();
