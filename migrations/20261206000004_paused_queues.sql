-- A queue can be paused: its schedulers claim nothing from it until it is resumed. Jobs are
-- still enqueued (the INSERT does not look here), jobs already dispatched or running finish,
-- maintenance (rescue, prune) goes on. What an operator reaches for when a downstream service
-- is down or a handler is broken: the backlog waits in Postgres, its attempts unspent, instead
-- of failing job after job. `rowq pause QUEUE` and `rowq resume QUEUE` write this table; so can
-- any client:
--   INSERT INTO rowq.paused_queues (queue, reason) VALUES ('emails', 'SMTP provider down');
--   DELETE FROM rowq.paused_queues WHERE queue = 'emails';
--
-- The claim reads this table once per statement (one index probe of a table of a few rows) and
-- claims nothing while its queue is here: the pause is seen by the first claim that starts
-- after it commits, by every scheduler, with no cache to go stale.

CREATE TABLE rowq.paused_queues (
    queue      rowq.queue_name NOT NULL PRIMARY KEY,
    paused_at  timestamptz     NOT NULL DEFAULT now(),
    reason     text
        CONSTRAINT paused_queues_reason_is_1_to_1000_characters CHECK (length(reason) BETWEEN 1 AND 1000)
);

-- A resume wakes the waiting schedulers at once, whoever deletes the row (without it an idle
-- scheduler finds the queue resumed at its next poll).
CREATE FUNCTION rowq.notify_resumed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('rowq_jobs', 'resumed');
    RETURN NULL;
END;
$$;

CREATE TRIGGER paused_queues_notify_resumed
    AFTER DELETE ON rowq.paused_queues
    FOR EACH STATEMENT EXECUTE FUNCTION rowq.notify_resumed();
