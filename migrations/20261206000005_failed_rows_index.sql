-- no-transaction
-- Failed rows may be kept longer than succeeded and cancelled ones (ROWQ_FAILED_RETENTION_HOURS):
-- each kind of finished row gets an index of its own by `finished_at`, so that the prune of one
-- kind never walks the rows of the other that it keeps. This migration and the next build them
-- CONCURRENTLY, which holds back no enqueue or claim while they run on a large table; a
-- statement so built cannot share a migration, nor a transaction, with another. An index whose
-- build was interrupted is left invalid: `rowq migrate` rebuilds it. `jobs_finished_idx` stays
-- for the binaries older than this migration, whose prune reads it (docs/DESIGN.md, 29).
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_failed_idx ON rowq.jobs (finished_at)
    WHERE state = 'failed';
