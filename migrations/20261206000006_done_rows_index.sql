-- no-transaction
-- Succeeded and cancelled rows by `finished_at`, for their prune (see the migration before).
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_done_idx ON rowq.jobs (finished_at)
    WHERE state IN ('succeeded', 'cancelled');
