-- The claim's group test looks up "an earlier unfinished job of this group" by `jobs_group_idx`.
-- Given a group that holds most of the rows (one tenant's backlog), the planner expected any row
-- to be one of them and chose to read the table from its start for each test, or the primary
-- key from its lowest id: through every finished row before the group's first unfinished one.
-- Telling it that a group holds few rows keeps the test on the group's index, whatever the
-- last ANALYZE saw (docs/DESIGN.md, 36). Neither statement holds up an enqueue or a claim.
ALTER TABLE rowq.jobs ALTER COLUMN group_key SET (n_distinct = -0.5);
ANALYZE rowq.jobs (group_key);
