//! The scheduler's transitions: `pending → dispatched` (claim) and back (release).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool};

use super::millis;
use super::types::from_row;
use crate::job::JobId;

/// A row the scheduler now owns for one dispatch generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    pub id: JobId,
    pub dispatch_gen: i64,
    pub group_key: Option<String>,
    /// Part of the message's deduplication id (see [`crate::JobMessage::dedup_id`]).
    pub created_at: DateTime<Utc>,
}

from_row!(Claimed { id, dispatch_gen, group_key, created_at });

/// `pending → dispatched` for up to `limit` due rows of `queue`: `dispatch_gen + 1`,
/// `dispatch_deadline = now() + lease`. Returns them in claim order (priority, run_at, id).
///
/// The CTE is needed because `UPDATE` has neither `ORDER BY`/`LIMIT` nor `SKIP LOCKED`: the
/// inner `SELECT ... FOR UPDATE SKIP LOCKED` picks and locks the rows, so concurrent
/// schedulers each take different rows instead of queueing on the same locks, and the outer
/// `UPDATE` moves exactly the rows it locked. The statement commits on its own (autocommit),
/// before anything is sent to SQS.
///
/// The outer `UPDATE` finds its rows through `id = ANY (ARRAY(...))`, not by joining the CTE:
/// the planner cannot tell how many rows a `LIMIT` computed from a subquery leaves, and for a
/// join it chose a hash join over a sequential scan of the whole table — a claim whose cost
/// grew with every finished row kept (4.9 ms for 100 rows on a 20,000-row table, against
/// 1.8 ms through the primary key).
///
/// A job with a `group_key` is claimable only while no earlier job of its group is
/// unfinished: the group runs one at a time, in id order, even across retries.
///
/// A paused queue (a row in `rowq.paused_queues`) claims nothing: the statement reads the
/// pause itself, so a pause holds from the first claim that starts after it commits, in every
/// scheduler at once, and the claim's `LIMIT 0` leaves its rows unread.
pub async fn claim_due(pool: &PgPool, queue: &str, limit: u32, lease: Duration) -> Result<Vec<Claimed>, sqlx::Error> {
    Ok(claim_due_within(pool, queue, limit, u32::MAX, lease).await?.jobs)
}

/// The claimable jobs of the queue `$1` in claim order, read from `jobs_claimable_idx`, with
/// `$more` conditions: what the claim takes from, and where it looks for jobs to set aside.
macro_rules! claimable_in_order {
    ($($more:expr),*) => {
        concat!(
            "SELECT j.id, j.group_key
            FROM rowq.jobs j
            WHERE j.state = 'pending'
              AND NOT j.behind_group
              AND j.queue = $1
              AND j.run_at <= now() ",
            $($more,)*
            "
            ORDER BY j.priority DESC, j.run_at, j.id"
        )
    };
}

/// The claim statement of [`claim_due_within`] (public so that tests can `EXPLAIN` it).
///
/// Beside the claim itself (`due`, `claimed`), it sets aside the jobs that wait behind an
/// unfinished earlier job of their group (`looked_at`, `behind`, `set_aside`; docs/DESIGN.md,
/// 36). It reads the first claimable jobs in claim order, from the same index: as many as
/// the claim may take (the rows it reads first itself), or `$5` when that is more (a claim that
/// only sets aside, [`claim_setting_aside`]); and marks `behind_group` those of them with such
/// an earlier job. The mark leaves them out of `jobs_claimable_idx`: no claim reads them again
/// until their group's earlier jobs have ended, when a trigger clears it.
///
/// A job is marked only while the claim holds a lock on an earlier unfinished job of its group:
/// one it takes itself (it holds that row, dispatched, until it commits), or the group's first
/// unfinished job, which it locks without waiting (`FOR SHARE SKIP LOCKED`), on that job's
/// newest version. The statement that ends that job then waits for the claim to commit, so that
/// its trigger sees the mark it is to clear. Had the job ended between the claim's snapshot and
/// its lock, it is no longer unfinished and no reason for a mark; had another statement locked
/// it (to end it, perhaps), the claim marks nothing behind it this time. The first unfinished
/// job and no other: locking the next one when the first is locked (`LIMIT 1` under `SKIP
/// LOCKED` goes on to it) would lock the very job whose mark the first one's ending trigger is
/// clearing at that moment, which skips a locked job: it was left set aside with nothing before
/// it until maintenance, 82 of 20,000 jobs in groups of four (`make bench`'s grouped drain).
pub const CLAIM_SQL: &str = concat!(
    r#"
        WITH in_flight AS (
            SELECT count(*) AS n, set_config('synchronous_commit', 'off', true) AS commit_mode,
                   EXISTS (SELECT FROM rowq.paused_queues WHERE queue = $1) AS paused
            FROM rowq.jobs WHERE queue = $1 AND state = 'dispatched'
        ),
        due AS (
            "#,
    claimable_in_order!("AND ", super::first_of_its_group!()),
    r#"
            LIMIT CASE WHEN (SELECT paused FROM in_flight) THEN 0
                       ELSE least($2, greatest(0, $4 - (SELECT n FROM in_flight))) END
            FOR UPDATE SKIP LOCKED
        ),
        looked_at AS (
            "#,
    claimable_in_order!(),
    r#"
            LIMIT CASE WHEN (SELECT paused FROM in_flight) THEN 0
                       ELSE greatest($5, least($2, greatest(0, $4 - (SELECT n FROM in_flight)))) END
        ),
        behind AS (
            SELECT l.id
            FROM looked_at l
            WHERE l.group_key IS NOT NULL
              AND l.id <> ALL (ARRAY(SELECT id FROM due))
              AND (EXISTS (SELECT FROM due WHERE due.group_key = l.group_key AND due.id < l.id)
               OR (SELECT head.id FROM rowq.jobs head
                   WHERE head.id = (SELECT earlier.id FROM rowq.jobs earlier
                                    WHERE earlier.group_key = l.group_key
                                      AND earlier.id < l.id
                                      AND earlier.state IN ('pending', 'dispatched', 'running')
                                    ORDER BY earlier.group_key, earlier.id
                                    LIMIT 1)
                     AND head.state IN ('pending', 'dispatched', 'running')
                   FOR SHARE SKIP LOCKED) IS NOT NULL)
        ),
        set_aside AS (
            UPDATE rowq.jobs j
            SET behind_group = true
            WHERE j.id = ANY (ARRAY(
                SELECT b.id FROM rowq.jobs b
                WHERE b.id = ANY (ARRAY(SELECT id FROM behind))
                  AND b.state::text = 'pending'
                  AND NOT b.behind_group
                FOR UPDATE SKIP LOCKED))
            RETURNING j.id
        ),
        next_due AS (
            SELECT min(run_at) AS at FROM rowq.jobs WHERE queue = $1 AND state = 'pending' AND run_at > now()
        ),
        claimed AS (
            UPDATE rowq.jobs j
            SET state = 'dispatched',
                dispatch_gen = j.dispatch_gen + 1,
                dispatch_deadline = now() + $3 * interval '1 millisecond',
                updated_at = now()
            WHERE j.id = ANY (ARRAY(SELECT id FROM due))
            RETURNING j.id, j.dispatch_gen, j.group_key, j.created_at, j.priority, j.run_at
        )
        SELECT c.id, c.dispatch_gen, c.group_key, c.created_at, in_flight.n, next_due.at, in_flight.paused,
               (SELECT count(*) FROM set_aside) AS set_aside
        FROM in_flight CROSS JOIN next_due LEFT JOIN claimed c ON true
        ORDER BY c.priority DESC, c.run_at, c.id
        "#
);

/// How many claimable jobs a claim that only sets aside reads, at least
/// ([`claim_setting_aside`]).
pub const SET_ASIDE_WINDOW: u32 = 500;
/// How many at most, however wide the scheduler makes its window.
pub const SET_ASIDE_WINDOW_MAX: u32 = 20_000;

/// What one claim statement did and saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The claimed rows, in claim order (priority, run_at, id).
    pub jobs: Vec<Claimed>,
    /// Rows of the queue `dispatched` before this claim.
    pub in_flight_before: i64,
    /// The earliest `run_at` in the future among the queue's pending rows: when something
    /// next falls due (delayed jobs, retries after backoff), if nothing is due now.
    pub next_due: Option<DateTime<Utc>>,
    /// The queue is paused (`rowq.paused_queues`): the claim took nothing.
    pub paused: bool,
    /// Jobs this claim found waiting behind an unfinished earlier job of their group, and set
    /// aside (see [`CLAIM_SQL`]): when there are any, more may be claimable right now, behind
    /// them in claim order.
    pub set_aside: i64,
}

/// [`claim_due`], taking no more rows than leave fewer than `max_in_flight` rows of the queue
/// `dispatched` (backpressure), counted in the same statement. One round trip per pass: the
/// statement also returns the in-flight count it saw, the next future `run_at` and whether the
/// queue is paused, in one row with no job when it claims nothing, so neither an empty claim
/// nor the scheduler's idle wait needs a second query.
///
/// The claim commits asynchronously (`synchronous_commit` off for its own transaction only):
/// it returns without waiting for its WAL to reach the disk, which is most of a claim's time
/// on the pickup path of every job. This is safe because nothing outside the database acts on
/// a claim before a synchronous commit covers it: the fence, which every execution must pass,
/// commits synchronously, and WAL is flushed in order, so a fence that is durable makes the
/// claim it fenced durable too. If the server crashes before the claim reaches the disk, the
/// row comes back `pending` with the generation before it; the message already published for
/// the lost generation either matches the row's next claim (same generation, and SQS drops
/// the second message as a duplicate within five minutes) or meets a row that is not
/// `dispatched` for it, and the fence drops it. Either way the job runs once.
/// `tests/worker.rs` (`a_claim_lost_in_a_crash_still_runs_its_job_once`) replays that crash.
pub async fn claim_due_within(
    executor: impl PgExecutor<'_>,
    queue: &str,
    limit: u32,
    max_in_flight: u32,
    lease: Duration,
) -> Result<Claim, sqlx::Error> {
    claim_setting_aside(executor, queue, limit, max_in_flight, lease, 0).await
}

/// [`claim_due_within`], reading `window` claimable jobs to set aside those waiting behind their
/// group when that is more than it may claim. The scheduler passes 0, and after a claim that
/// found half of what it read or more to set aside (the front of a group's backlog), it claims
/// with `limit` 0 and a window four times wider, until the front is set aside: a claim reads past
/// each such job it does not set aside, so claiming beside the setting aside would read the rest
/// of the backlog again at every step (docs/DESIGN.md, 36).
pub async fn claim_setting_aside(
    executor: impl PgExecutor<'_>,
    queue: &str,
    limit: u32,
    max_in_flight: u32,
    lease: Duration,
    window: u32,
) -> Result<Claim, sqlx::Error> {
    type Row =
        (Option<JobId>, Option<i64>, Option<String>, Option<DateTime<Utc>>, i64, Option<DateTime<Utc>>, bool, i64);
    let rows: Vec<Row> = sqlx::query_as(CLAIM_SQL)
        .bind(queue)
        .bind(i64::from(limit))
        .bind(millis(lease))
        .bind(i64::from(max_in_flight))
        .bind(i64::from(window))
        .fetch_all(executor)
        .await?;
    let (in_flight_before, next_due, paused, set_aside) =
        rows.first().map_or((0, None, false, 0), |row| (row.4, row.5, row.6, row.7));
    let jobs = rows
        .into_iter()
        .filter_map(|(id, dispatch_gen, group_key, created_at, ..)| {
            Some(Claimed { id: id?, dispatch_gen: dispatch_gen?, group_key, created_at: created_at? })
        })
        .collect();
    Ok(Claim { jobs, in_flight_before, next_due, paused, set_aside })
}

/// The statement of [`release`] (public so that tests can `EXPLAIN` it).
pub const RELEASE_SQL: &str = r#"
        UPDATE rowq.jobs j
        SET state = 'pending', dispatch_deadline = NULL, updated_at = now()
        FROM unnest($1::bigint[], $2::bigint[]) AS r(id, dispatch_gen)
        WHERE j.id = ANY ($1) AND j.id = r.id AND j.dispatch_gen = r.dispatch_gen AND j.state::text = 'dispatched'
        RETURNING j.id
        "#;

/// `dispatched → pending` for rows whose message could not be published, guarded by the
/// generation that was claimed: a row a worker already started (the send did succeed) or that
/// was rescued and claimed again is left alone. No attempt is consumed.
pub async fn release(pool: &PgPool, jobs: &[(JobId, i64)]) -> Result<Vec<JobId>, sqlx::Error> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = jobs.iter().map(|(id, _)| id.0).collect();
    let gens: Vec<i64> = jobs.iter().map(|(_, dispatch_gen)| *dispatch_gen).collect();
    sqlx::query_scalar(RELEASE_SQL).bind(ids).bind(gens).fetch_all(pool).await
}
