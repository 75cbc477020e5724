//! Maintenance transitions: rescue of rows whose owner went away, pruning of old rows.

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgExecutor, PgPool};

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

/// Which finished rows a prune deletes: each has an index of its own by `finished_at`
/// (`jobs_done_idx`, `jobs_failed_idx`), so that the prune of one never walks the rows of the
/// other that are kept longer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// Succeeded and cancelled rows.
    Done,
    /// Failed rows.
    Failed,
}

/// Deletes up to [`PRUNE_BATCH`] rows of `which` that finished longer than `retention` ago.
/// Returns how many were deleted.
pub async fn prune_finished(pool: &PgPool, which: Finished, retention: Duration) -> Result<u64, sqlx::Error> {
    // Each statement's state test is its index's predicate, written as a constant so that the
    // generic plan (the scheduler's pool forces them) can use that index.
    let sql = match which {
        Finished::Done => PRUNE_DONE_SQL,
        Finished::Failed => PRUNE_FAILED_SQL,
    };
    let result = sqlx::query(sql).bind(millis(retention)).bind(PRUNE_BATCH).execute(pool).await?;
    Ok(result.rows_affected())
}

macro_rules! prune_sql {
    ($states:literal) => {
        concat!(
            "DELETE FROM rowq.jobs WHERE id = ANY (ARRAY(
                SELECT id FROM rowq.jobs
                WHERE state IN (",
            $states,
            ") AND finished_at < now() - $1 * interval '1 millisecond'
                LIMIT $2
                FOR UPDATE SKIP LOCKED
            ))"
        )
    };
}

pub const PRUNE_DONE_SQL: &str = prune_sql!("'succeeded', 'cancelled'");
pub const PRUNE_FAILED_SQL: &str = prune_sql!("'failed'");

/// A job [`release_set_aside`] found set aside behind its group with nothing before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub id: JobId,
    pub group_key: Option<String>,
}

from_row!(Released { id, group_key });

/// The statement of [`release_set_aside`] (public so that tests can `EXPLAIN` it). It reads the
/// first set-aside job of each group (a walk of `jobs_behind_group_idx`, one step per group), not
/// every set-aside job.
pub const RELEASE_SET_ASIDE_SQL: &str = r#"
        WITH RECURSIVE firsts AS (
            (SELECT group_key, id FROM rowq.jobs WHERE behind_group ORDER BY group_key, id LIMIT 1)
            UNION ALL
            SELECT next.group_key, next.id
            FROM firsts f, LATERAL (SELECT group_key, id FROM rowq.jobs
                                    WHERE behind_group AND group_key > f.group_key
                                    ORDER BY group_key, id LIMIT 1) next
        )
        UPDATE rowq.jobs j
        SET behind_group = false
        WHERE j.id = ANY (ARRAY(
            SELECT s.id FROM rowq.jobs s
            WHERE s.id = ANY (ARRAY(
                    SELECT f.id FROM firsts f
                    WHERE NOT EXISTS (SELECT 1 FROM rowq.jobs earlier
                                      WHERE earlier.group_key = f.group_key
                                        AND earlier.id < f.id
                                        AND earlier.state IN ('pending', 'dispatched', 'running'))))
              AND s.behind_group
            FOR UPDATE SKIP LOCKED))
        RETURNING j.id, j.group_key
        "#;

/// Clears the mark of a job set aside behind its group (docs/DESIGN.md, 36) that has no
/// unfinished job before it: claimable, and left out of every claim. The trigger that clears a
/// group's first mark when one of its jobs ends skips a row another statement holds locked, so
/// that it never waits; this is what catches a mark it so left (and one a client wrote by
/// hand). Nothing is found here in the normal run of things.
pub async fn release_set_aside(pool: &PgPool) -> Result<Vec<Released>, sqlx::Error> {
    sqlx::query_as(RELEASE_SET_ASIDE_SQL).fetch_all(pool).await
}

/// Something that keeps Postgres from removing dead row versions: an open transaction, a
/// prepared one, or a replication slot (a standby's `hot_standby_feedback`).
///
/// Every claim, fence and finish leaves the row's previous version behind, and that version's
/// entry in the partial index of the state it left (`jobs_claim_idx`, `jobs_dispatched_idx`).
/// Postgres removes them, and marks their index entries dead so that scans skip them, only once
/// no snapshot can still see them. While one of these holds the cleanup back, every claim reads
/// again each version left since it began: its in-flight count visits every row dispatched since,
/// its scan every row claimed since, so claims slow down as the jobs run (BENCHMARKS.md, round
/// 35). The transaction does not have to be rowq's, nor in rowq's database: one that wrote
/// anything, anywhere in the cluster, holds every database back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CleanupHolder {
    /// `session`, `prepared transaction` or `replication slot`.
    pub kind: String,
    /// The session's process id (for `pg_terminate_backend`), or the slot's walsender.
    pub pid: Option<i32>,
    pub database: Option<String>,
    pub user: Option<String>,
    /// The session's `application_name`, the prepared transaction's gid, or the slot's name.
    pub name: Option<String>,
    /// `idle in transaction`, `active`, ...; `prepared`; a slot's `active` or `inactive`.
    pub state: Option<String>,
    /// How long its transaction has been open, where Postgres knows it (not for a slot).
    pub open_secs: Option<f64>,
    /// How many transactions the cluster has begun since the oldest one it holds back.
    pub xid_age: i32,
    /// The session's current or last statement, cut to 200 characters.
    pub query: Option<String>,
}

from_row!(CleanupHolder { kind, pid, database, user, name, state, open_secs, xid_age, query });

/// `session 4242 ("psql", user alice, database app, idle in transaction), open for 7 min 12 s,
/// 12345 transactions behind; last statement: "..."`: what an operator needs to find it.
impl std::fmt::Display for CleanupHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.kind)?;
        if let Some(pid) = self.pid {
            write!(f, " {pid}")?;
        }
        let details: Vec<String> = [
            self.name.as_ref().map(|name| format!("{name:?}")),
            self.user.as_ref().map(|user| format!("user {user}")),
            self.database.as_ref().map(|database| format!("database {database}")),
            self.state.clone(),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !details.is_empty() {
            write!(f, " ({})", details.join(", "))?;
        }
        if let Some(secs) = self.open_secs {
            write!(f, ", open for {}", span(secs))?;
        }
        write!(f, ", {} transactions behind", self.xid_age)?;
        if let Some(query) = self.query.as_deref().filter(|query| !query.is_empty()) {
            write!(f, "; last statement: {query:?}")?;
        }
        Ok(())
    }
}

/// `45 s`, `7 min 12 s`, `3 h 20 min`.
pub(crate) fn span(secs: f64) -> String {
    let secs = secs.max(0.0).round() as u64;
    match secs {
        0..60 => format!("{secs} s"),
        60..3600 => format!("{} min {} s", secs / 60, secs % 60),
        _ => format!("{} h {} min", secs / 3600, secs % 3600 / 60),
    }
}

/// A holder whose time Postgres does not show (a replication slot, a walsender, another role's
/// session to a role without `pg_read_all_stats`) is reported by [`cleanup_holders`] once the
/// cluster has begun this many transactions since its horizon.
pub const UNTIMED_HOLDER_XID_AGE: i32 = 10_000;

/// What holds the cleanup of `rowq.jobs` back: sessions and prepared transactions open for at
/// least `open_for`, and replication slots more than [`UNTIMED_HOLDER_XID_AGE`] transactions
/// behind; the five oldest, oldest first. A session of another database counts only once it
/// has a transaction id (it wrote something): before that its snapshot holds back only its own
/// database. Autovacuum's workers are left out; Postgres ignores their snapshots for this.
///
/// A role without the privileges of `pg_read_all_stats` (`pg_monitor` includes them) sees that
/// another role's session holds a transaction, but not since when, its state nor its statement:
/// such a session is reported as a slot is, by its transactions behind.
pub async fn cleanup_holders(
    executor: impl PgExecutor<'_>,
    open_for: Duration,
) -> Result<Vec<CleanupHolder>, sqlx::Error> {
    cleanup_holders_behind(executor, open_for, UNTIMED_HOLDER_XID_AGE).await
}

/// [`cleanup_holders`], with the untimed holders' threshold given (tests use 0).
pub async fn cleanup_holders_behind(
    executor: impl PgExecutor<'_>,
    open_for: Duration,
    untimed_xid_age: i32,
) -> Result<Vec<CleanupHolder>, sqlx::Error> {
    sqlx::query_as(
        r#"
        WITH holders AS (
            SELECT 'session' AS kind, a.pid, a.datname::text AS database, a.usename::text AS "user",
                   nullif(a.application_name, '') AS name, a.state,
                   extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS open_secs,
                   CASE WHEN a.datname <> current_database() THEN age(a.backend_xid)
                        ELSE greatest(age(a.backend_xid), age(a.backend_xmin)) END AS xid_age,
                   left(a.query, 200) AS query
            FROM pg_stat_activity a
            WHERE a.pid <> pg_backend_pid()
              AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
              AND (a.backend_xid IS NOT NULL
                   OR (a.backend_xmin IS NOT NULL AND (a.datname IS NULL OR a.datname = current_database())))
            UNION ALL
            SELECT 'prepared transaction', NULL, p.database::text, p.owner::text, p.gid, 'prepared',
                   extract(epoch FROM clock_timestamp() - p.prepared)::float8, age(p.transaction), NULL
            FROM pg_prepared_xacts p
            UNION ALL
            SELECT 'replication slot', s.active_pid, s.database::text, NULL, s.slot_name::text,
                   CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL, age(s.xmin), NULL
            FROM pg_replication_slots s
            WHERE s.xmin IS NOT NULL
        )
        SELECT * FROM holders
        WHERE open_secs >= $1 OR (open_secs IS NULL AND xid_age >= $2)
        ORDER BY xid_age DESC, open_secs DESC NULLS LAST
        LIMIT 5
        "#,
    )
    .bind(open_for.as_secs_f64())
    .bind(untimed_xid_age)
    .fetch_all(executor)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_reads_as_what_an_operator_needs_to_find_it() {
        let holder = CleanupHolder {
            kind: "session".into(),
            pid: Some(4242),
            database: Some("app".into()),
            user: Some("alice".into()),
            name: Some("psql".into()),
            state: Some("idle in transaction".into()),
            open_secs: Some(432.4),
            xid_age: 12345,
            query: Some("SELECT 1".into()),
        };
        assert_eq!(
            holder.to_string(),
            r#"session 4242 ("psql", user alice, database app, idle in transaction), open for 7 min 12 s, 12345 transactions behind; last statement: "SELECT 1""#
        );
        let slot = CleanupHolder {
            kind: "replication slot".into(),
            pid: None,
            database: None,
            user: None,
            name: Some("standby_1".into()),
            state: Some("inactive".into()),
            open_secs: None,
            xid_age: 20000,
            query: None,
        };
        assert_eq!(slot.to_string(), r#"replication slot ("standby_1", inactive), 20000 transactions behind"#);
    }

    #[test]
    fn spans_read_in_the_largest_units_that_fit() {
        assert_eq!(span(44.6), "45 s");
        assert_eq!(span(60.0), "1 min 0 s");
        assert_eq!(span(12_000.0), "3 h 20 min");
        assert_eq!(span(-1.0), "0 s");
    }
}
