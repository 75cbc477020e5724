-- no-transaction
-- `jobs_done_idx` and `jobs_failed_idx` hold between them every entry this one held.
DROP INDEX CONCURRENTLY IF EXISTS rowq.jobs_finished_idx;
