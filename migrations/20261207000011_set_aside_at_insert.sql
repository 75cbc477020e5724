-- A job inserted behind an unfinished earlier job of its group that its own transaction
-- inserted is set aside at once (docs/DESIGN.md, 36, "At insert").
--
-- A claim sets a job aside (`behind_group`) only while it holds a lock on an earlier unfinished
-- job of its group, so that the statement ending that job cannot miss the mark. A transaction
-- that inserts a group's jobs needs no lock for those behind its own first one: no other
-- transaction sees that job before the commit that shows them all, so none can claim or end
-- it before the marks are there to clear; and if the inserting transaction ends it itself, its
-- trigger sees them. So the jobs of a group imported in one transaction are set aside by the
-- insert, at no further write: before, the claims set them aside one update each (~40 us a
-- job: 7-11 s for 200,000, while the jobs behind them in claim order waited).
--
-- Only the nearest earlier unfinished job of the group is looked at (one step back in the
-- group's index), and it counts only if this transaction itself wrote it (its `xmin`), not a
-- subtransaction of it: inserted by it, nobody else sees it yet; updated by it, it is locked by
-- it until it commits, so no other statement can end it before that either. And only a job with 16 or more unfinished jobs of its group before it is set aside
-- here: a job set aside costs one more write, its release, and a claim sets aside only the jobs
-- it reads while they wait, which in a group of a few jobs is few of them (a fifth in `make
-- bench`'s drain of groups of about four, where setting aside every job behind its group's
-- first at insert took the rate from 15-17k to 12-13k jobs/s). A job not set aside here is set
-- aside by a claim, under its lock, as before, if a claim finds it waiting. What a client
-- writes into `behind_group` is still ignored: the trigger that clears it runs first (triggers
-- of one event run in the order of their names).
CREATE FUNCTION rowq.set_aside_behind_own_earlier_job() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    nearest xid;
    nearest_set_aside boolean;
BEGIN
    -- A transaction's first grouped job has no job of its own before it: most enqueues, one
    -- job a transaction, look no further. (Looking cost them 9-11% of their rate: 2,971-3,059
    -- against 3,323-3,374 single-row inserts a second, pgbench, 4 clients; with this, 1-7%.)
    -- The setting is the transaction's own, and goes with it.
    IF current_setting('rowq.inserted_grouped', true) IS DISTINCT FROM 'on' THEN
        PERFORM set_config('rowq.inserted_grouped', 'on', true);
        RETURN NEW;
    END IF;
    SELECT xmin, behind_group INTO nearest, nearest_set_aside FROM rowq.jobs
    WHERE group_key = NEW.group_key AND id < NEW.id AND state IN ('pending', 'dispatched', 'running')
    ORDER BY group_key DESC, id DESC
    LIMIT 1;
    IF nearest = pg_current_xact_id()::xid THEN
        -- Set aside, it had 16 before it (no claim sees this transaction's jobs): so has this
        -- one, and an import of a large group counts its first 16 jobs once, not at every row.
        IF NOT nearest_set_aside THEN
            PERFORM FROM rowq.jobs
            WHERE group_key = NEW.group_key AND id < NEW.id AND state IN ('pending', 'dispatched', 'running')
            ORDER BY group_key DESC, id DESC
            OFFSET 15 LIMIT 1;
            nearest_set_aside := FOUND;
        END IF;
        NEW.behind_group := nearest_set_aside;
    END IF;
    RETURN NEW;
END;
$$;

-- Creating a trigger takes a lock that conflicts with every write to the table, and waiting for
-- it behind a transaction that wrote would queue every enqueue, claim and finish behind the
-- migration: so it waits at most a second at a time, and gives way in between (60 tries).
DO $$
BEGIN
    FOR try IN 1..60 LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            CREATE TRIGGER jobs_set_aside_behind_own_earlier_job
                BEFORE INSERT ON rowq.jobs
                FOR EACH ROW WHEN (NEW.group_key IS NOT NULL)
                EXECUTE FUNCTION rowq.set_aside_behind_own_earlier_job();
            PERFORM set_config('lock_timeout', '0', true);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'rowq.jobs is in use (try % of 60): creating its trigger again in a second', try;
            PERFORM pg_sleep(1);
        END;
    END LOOP;
    RAISE EXCEPTION 'could not lock rowq.jobs to create a trigger: a transaction kept it for a minute (pg_stat_activity shows which); run rowq migrate again'
        USING ERRCODE = 'lock_not_available';
END;
$$;
