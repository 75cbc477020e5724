-- A job waiting behind an unfinished earlier job of its group is set aside from the claim.
--
-- The claim skips a job while an earlier job of its `group_key` is unfinished (docs/DESIGN.md,
-- hazard 2). It used to find that out again on every claim, for every such job it passed: a
-- group with 200,000 jobs enqueued behind its running head made every claim of the queue read
-- all 200,000 (0.26-0.28 s each, against a few milliseconds), every poll and every wake, for
-- as long as the backlog lasted, and held the group itself to a few jobs a second.
--
-- Now a claim that finds such a job marks it `behind_group` (docs/DESIGN.md, 36), and the
-- claim's index leaves marked rows out (the next migrations build it), so no claim reads it
-- again until it can run: when an earlier job of its group ends, the statement that ends it
-- clears the mark of the group's first marked job (the trigger below). Nothing but the claim sets it;
-- a client never needs to write it, and what one writes on INSERT is ignored.
--
-- Adding a column with a constant default changes no row, but it needs the table's strongest
-- lock, and while it waits for a transaction that wrote to the table to end, every enqueue,
-- claim and finish queues behind it. So it waits at most a second at a time, and gives way in
-- between: up to 60 tries, then the migration fails (the scheduler that ran it exits, saying
-- why, and runs it again when it is started again). The triggers below are created under the
-- lock it took, released at the migration's commit.
DO $$
BEGIN
    FOR try IN 1..60 LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            ALTER TABLE rowq.jobs ADD COLUMN behind_group boolean NOT NULL DEFAULT false;
            PERFORM set_config('lock_timeout', '0', true);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'rowq.jobs is in use (try % of 60): adding behind_group again in a second', try;
            PERFORM pg_sleep(1);
        END;
    END LOOP;
    RAISE EXCEPTION 'could not lock rowq.jobs to add a column: a transaction kept it for a minute (pg_stat_activity shows which); run rowq migrate again'
        USING ERRCODE = 'lock_not_available';
END;
$$;

-- The mark means "pending, and behind its group": a row that leaves `pending` marked (a cancel)
-- loses it, so that retried later, first of its group, it is claimable. After the row's update,
-- not before: a row trigger that runs before an update locks each row the statement updates
-- again, a lock and its WAL record on every claim, fence and finish of every job, for a case
-- this trigger's WHEN finds false but on a cancelled marked job.
CREATE FUNCTION rowq.clear_behind_group() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.behind_group := false;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_behind_group_on_insert
    BEFORE INSERT ON rowq.jobs
    FOR EACH ROW WHEN (NEW.behind_group)
    EXECUTE FUNCTION rowq.clear_behind_group();

CREATE FUNCTION rowq.unmark_left_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE rowq.jobs SET behind_group = false WHERE id = NEW.id AND behind_group;
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_behind_group_only_while_pending
    AFTER UPDATE ON rowq.jobs
    FOR EACH ROW WHEN (NEW.behind_group AND NEW.state <> 'pending')
    EXECUTE FUNCTION rowq.unmark_left_pending();

-- When an unfinished job of a group ends (or is deleted), the group's first marked job loses
-- its mark: if no earlier job of its group is left it is claimable now, and if one is, the
-- next claim marks it again (one row). The first marked job, not "the next job": two jobs of
-- a group ending at once (each statement blind to the other's) both clear it. A marked row
-- another statement holds locked is skipped rather than waited for (a trigger that waited
-- could deadlock two workers' finishes); `rowq`'s maintenance clears any mark left on a job
-- with nothing before it, every pass (`store::maintenance::release_set_aside`).
CREATE FUNCTION rowq.release_behind_group() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE rowq.jobs SET behind_group = false
    WHERE id = (SELECT id FROM rowq.jobs
                WHERE group_key = OLD.group_key AND behind_group AND state = 'pending'
                ORDER BY group_key, id LIMIT 1
                FOR UPDATE SKIP LOCKED);
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_group_job_ended
    AFTER UPDATE ON rowq.jobs
    FOR EACH ROW WHEN (OLD.group_key IS NOT NULL
                       AND OLD.state IN ('pending', 'dispatched', 'running')
                       AND NEW.state IN ('succeeded', 'failed', 'cancelled'))
    EXECUTE FUNCTION rowq.release_behind_group();

CREATE TRIGGER jobs_group_job_deleted
    AFTER DELETE ON rowq.jobs
    FOR EACH ROW WHEN (OLD.group_key IS NOT NULL AND OLD.state IN ('pending', 'dispatched', 'running'))
    EXECUTE FUNCTION rowq.release_behind_group();
