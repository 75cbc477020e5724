-- no-transaction
-- The jobs set aside behind their group, by group: the first of a group is what the trigger
-- that releases it and the maintenance that checks it look up (docs/DESIGN.md, 36).
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_behind_group_idx ON rowq.jobs (group_key, id)
    WHERE behind_group;
