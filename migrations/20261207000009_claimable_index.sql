-- no-transaction
-- The claim's index: due pending rows not set aside behind their group (the migration before).
-- `jobs_claim_idx`, which holds the set-aside rows too, stays for the binaries older than that
-- migration, whose claim reads it (docs/DESIGN.md, 29 and 36).
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_claimable_idx ON rowq.jobs (queue, priority DESC, run_at, id)
    WHERE state = 'pending' AND NOT behind_group;
