//! Maintenance transitions: rescue of rows whose owner went away, pruning of old rows.

use std::time::Duration;

use sqlx::PgPool;

use super::millis;
use super::types::from_row;
use crate::job::{JobId, JobState};

// Each statement below reaches its rows through `id = ANY (ARRAY(...))` of a locking subquery,
// which the planner turns into primary-key lookups; a join or `IN` may become a hash join over
// a sequential scan of the whole table (see `dispatch::claim_due_within`). The rescues' state
// guard is on `state::text`, as in `run::start`: with stale statistics the planner otherwise
// reads the whole partial index of that state instead of the rescued ids.

/// Rows moved per statement, so one rescue never holds many locks for long.
pub const RESCUE_BATCH: i64 = 1000;
/// Rows deleted per statement.
pub const PRUNE_BATCH: i64 = 5000;

/// A row moved by a rescue, and where it went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rescued {
    pub id: JobId,
    pub dispatch_gen: i64,
    pub state: JobState,
    /// A failed row's group lets its next job go.
    pub group_key: Option<String>,
}

from_row!(Rescued { id, dispatch_gen, state, group_key });

/// The statement of [`rescue_dispatched`] (public so that tests can `EXPLAIN` it).
pub const RESCUE_DISPATCHED_SQL: &str = r#"
        WITH stuck AS (
            SELECT id FROM rowq.jobs
            WHERE state = 'dispatched' AND dispatch_deadline < now()
            ORDER BY dispatch_deadline
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        )
        UPDATE rowq.jobs j
        SET state = CASE WHEN j.attempts < j.max_attempts THEN 'pending'::rowq.job_state
                         ELSE 'failed'::rowq.job_state END,
            finished_at = CASE WHEN j.attempts < j.max_attempts THEN NULL ELSE now() END,
            last_error = CASE WHEN j.attempts < j.max_attempts THEN j.last_error
                              ELSE 'attempts used up; last dispatch was never started' END,
            dispatch_deadline = NULL,
            updated_at = now()
        WHERE j.id = ANY (ARRAY(SELECT id FROM stuck)) AND j.state::text = 'dispatched'
        RETURNING j.id, j.dispatch_gen, j.state, j.group_key
        "#;

/// `dispatched → pending` for rows whose `dispatch_deadline` passed: the scheduler crashed
/// between claim and publish, or the message was lost or outlived its lease. The next claim
/// gives a new generation, so the old message, if it still arrives, matches nothing.
/// No attempt was consumed; a row whose attempts are somehow used up goes to `failed`.
pub async fn rescue_dispatched(pool: &PgPool) -> Result<Vec<Rescued>, sqlx::Error> {
    sqlx::query_as(RESCUE_DISPATCHED_SQL).bind(RESCUE_BATCH).fetch_all(pool).await
}

/// The statement of [`rescue_running`] (public so that tests can `EXPLAIN` it).
pub const RESCUE_RUNNING_SQL: &str = r#"
        WITH stuck AS (
            SELECT id FROM rowq.jobs
            WHERE state = 'running' AND run_deadline < now()
            ORDER BY run_deadline
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        ),
        reason AS (
            SELECT 'no outcome by the run deadline: the worker timed out, was killed or lost the database' AS text
        )
        UPDATE rowq.jobs j
        SET state = CASE WHEN j.attempts < j.max_attempts THEN 'pending'::rowq.job_state
                         ELSE 'failed'::rowq.job_state END,
            finished_at = CASE WHEN j.attempts < j.max_attempts THEN NULL ELSE now() END,
            run_at = CASE WHEN j.attempts < j.max_attempts
                          THEN now() + $2 * interval '1 millisecond' ELSE j.run_at END,
            last_error = reason.text,
            errors = j.errors || jsonb_build_array(jsonb_build_object(
                       'attempt', j.attempts, 'dispatch_gen', j.dispatch_gen, 'at', now(), 'error', reason.text)),
            run_deadline = NULL,
            updated_at = now()
        FROM reason
        WHERE j.id = ANY (ARRAY(SELECT id FROM stuck)) AND j.state::text = 'running'
        RETURNING j.id, j.dispatch_gen, j.state, j.group_key
        "#;

/// `running → pending | failed` for rows whose `run_deadline` passed: the worker was killed
/// or lost its database connection. The error is recorded as a failed attempt. The worker,
/// if it is somehow still alive, can no longer finish: its guard needs `state = 'running'`.
pub async fn rescue_running(pool: &PgPool, retry_delay: Duration) -> Result<Vec<Rescued>, sqlx::Error> {
    sqlx::query_as(RESCUE_RUNNING_SQL).bind(RESCUE_BATCH).bind(millis(retry_delay)).fetch_all(pool).await
}

/// Deletes up to [`PRUNE_BATCH`] finished rows (succeeded, failed, cancelled) that finished
/// longer than `retention` ago. Returns how many were deleted.
pub async fn prune_finished(pool: &PgPool, retention: Duration) -> Result<u64, sqlx::Error> {
    let result = sqlx::query(
        r#"
        DELETE FROM rowq.jobs
        WHERE id = ANY (ARRAY(
            SELECT id FROM rowq.jobs
            WHERE state IN ('succeeded', 'failed', 'cancelled')
              AND finished_at < now() - $1 * interval '1 millisecond'
            LIMIT $2
            FOR UPDATE SKIP LOCKED
        ))
        "#,
    )
    .bind(millis(retention))
    .bind(PRUNE_BATCH)
    .execute(pool)
    .await?;
    Ok(result.rows_affected())
}
