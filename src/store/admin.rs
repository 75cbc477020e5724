//! Operator transitions and reads: enqueue, get, list, cancel, retry, discard, pause and resume, stats,
//! and the gauges the scheduler reports as metrics.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgExecutor, PgPool};

use super::maintenance::{CleanupHolder, cleanup_holders};
use super::types::from_row;
use crate::job::{JobId, JobState};

/// Every column of a row in `rowq.jobs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobRow {
    pub id: JobId,
    pub queue: String,
    pub kind: String,
    pub payload: serde_json::Value,
    pub state: JobState,
    pub priority: i16,
    pub run_at: DateTime<Utc>,
    pub attempts: i32,
    pub max_attempts: i32,
    pub group_key: Option<String>,
    pub dedup_key: Option<String>,
    pub dispatch_gen: i64,
    pub dispatch_deadline: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    pub run_deadline: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub result: Option<serde_json::Value>,
    pub last_error: Option<String>,
    pub errors: serde_json::Value,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

from_row!(JobRow {
    id,
    queue,
    kind,
    payload,
    state,
    priority,
    run_at,
    attempts,
    max_attempts,
    group_key,
    dedup_key,
    dispatch_gen,
    dispatch_deadline,
    started_at,
    run_deadline,
    finished_at,
    result,
    last_error,
    errors,
    created_at,
    updated_at
});

/// A job to enqueue; `None` fields take the table's defaults.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewJob {
    pub kind: String,
    pub payload: serde_json::Value,
    pub queue: Option<String>,
    pub priority: Option<i16>,
    pub run_at: Option<DateTime<Utc>>,
    pub max_attempts: Option<i32>,
    pub group_key: Option<String>,
    pub dedup_key: Option<String>,
}

impl NewJob {
    pub fn new(kind: impl Into<String>, payload: serde_json::Value) -> Self {
        NewJob { kind: kind.into(), payload, ..NewJob::default() }
    }
}

/// The values of a new job's `queue, priority, run_at, max_attempts, group_key` columns, from
/// `$3`..`$7` as [`bind_new_job`] binds them, `NULL` taking the table's defaults: one text for
/// [`enqueue`] and [`enqueue_many`].
macro_rules! new_job_columns {
    () => {
        "COALESCE($3, 'default'), COALESCE($4, 0), COALESCE($5, now()), COALESCE($6, 5), $7"
    };
}

fn bind_new_job<'q>(
    query: sqlx::query::QueryScalar<'q, sqlx::Postgres, JobId, sqlx::postgres::PgArguments>,
    job: &'q NewJob,
) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, JobId, sqlx::postgres::PgArguments> {
    query.bind(&job.queue).bind(job.priority).bind(job.run_at).bind(job.max_attempts).bind(&job.group_key)
}

/// The same `INSERT` any client can run. Returns `None` when an unfinished job with the same
/// `dedup_key` exists (`ON CONFLICT DO NOTHING`). Bad rows are refused by the schema's rules
/// (each a domain's CHECK, named in the error). Works inside the caller's transaction: pass
/// `&mut *tx`.
pub async fn enqueue<'e>(executor: impl PgExecutor<'e>, job: &NewJob) -> Result<Option<JobId>, sqlx::Error> {
    let query = sqlx::query_scalar(concat!(
        "INSERT INTO rowq.jobs (kind, payload, queue, priority, run_at, max_attempts, group_key, dedup_key)
        VALUES ($1, $2, ",
        new_job_columns!(),
        ", $8)
        ON CONFLICT DO NOTHING
        RETURNING id"
    ));
    bind_new_job(query.bind(&job.kind).bind(&job.payload), job).bind(&job.dedup_key).fetch_optional(executor).await
}

/// Enqueues one job per payload, each with `like`'s other columns (its own `payload` is not
/// used), in one statement, in the order given: the ids ascend with it, so jobs of one
/// `group_key` run in that order. Returns the ids, in order. A `dedup_key` would let only the
/// first of them in, so `like` must have none. Works inside the caller's transaction, as
/// [`enqueue`] does; bad rows are refused by the same rules, and then none of the statement's
/// are enqueued.
pub async fn enqueue_many<'e>(
    executor: impl PgExecutor<'e>,
    like: &NewJob,
    payloads: &[serde_json::Value],
) -> Result<Vec<JobId>, sqlx::Error> {
    if like.dedup_key.is_some() {
        return Err(sqlx::Error::InvalidArgument(
            "jobs enqueued together cannot share a dedup_key: only the first would be enqueued".into(),
        ));
    }
    let query = sqlx::query_scalar(concat!(
        "INSERT INTO rowq.jobs (kind, payload, queue, priority, run_at, max_attempts, group_key)
        SELECT $1, p.payload, ",
        new_job_columns!(),
        " FROM unnest($2::jsonb[]) WITH ORDINALITY AS p (payload, n)
        ORDER BY p.n
        RETURNING id"
    ));
    bind_new_job(query.bind(&like.kind).bind(payloads), like).fetch_all(executor).await.map(|mut ids: Vec<JobId>| {
        ids.sort_unstable(); // RETURNING's order is the insert's in practice, not by contract
        ids
    })
}

/// The id of the transaction `connection` is in, given one if it had none yet. When the answer
/// to its commit is lost, [`transaction_status`] says what became of it: the function Postgres
/// keeps for that (`pg_xact_status`; `txid_status` before 13).
pub async fn transaction_id(connection: &mut PgConnection) -> Result<i64, sqlx::Error> {
    let (give_id, _) = transaction_statements(has_xid8(connection));
    sqlx::query_scalar(give_id).fetch_one(connection).await
}

/// What became of a transaction ([`transaction_id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransactionStatus {
    Committed,
    Aborted,
    /// Not yet ended: a commit may still be on its way (waiting for a synchronous standby, say).
    InProgress,
    /// So old that Postgres no longer keeps its outcome.
    Forgotten,
}

/// What became of transaction `id`, asked on any connection of `pool`: unlike looking for what
/// it wrote, this tells a commit still in progress from one that never happened.
pub async fn transaction_status(pool: &PgPool, id: i64) -> Result<TransactionStatus, sqlx::Error> {
    let mut connection = pool.acquire().await?;
    let (_, ask) = transaction_statements(has_xid8(&connection));
    let status: Option<String> = sqlx::query_scalar(ask).bind(id).fetch_one(&mut *connection).await?;
    Ok(match status.as_deref() {
        Some("committed") => TransactionStatus::Committed,
        Some("aborted") => TransactionStatus::Aborted,
        Some(_) => TransactionStatus::InProgress,
        None => TransactionStatus::Forgotten,
    })
}

/// Whether the server has the `xid8` functions (13 and later), which replace the `txid_*` ones,
/// deprecated "to be removed in a future release" (rowq supports 12).
fn has_xid8(connection: &PgConnection) -> bool {
    connection.server_version_num().is_some_and(|number| number >= 130_000)
}

/// The statements that give the transaction an id (`bigint`) and ask what became of one
/// (`'committed'`, `'aborted'`, `'in progress'` or `NULL`): with the `xid8` functions, or with
/// the `txid_*` ones of PostgreSQL 12.
pub fn transaction_statements(xid8: bool) -> (&'static str, &'static str) {
    if xid8 {
        ("SELECT pg_current_xact_id()::text::bigint", "SELECT pg_xact_status($1::bigint::text::xid8)")
    } else {
        ("SELECT txid_current()", "SELECT txid_status($1)")
    }
}

pub async fn get(pool: &PgPool, id: JobId) -> Result<Option<JobRow>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM rowq.jobs WHERE id = $1").bind(id).fetch_optional(pool).await
}

/// The unfinished job that holds `dedup_key`: the one an enqueue with that key was a no-op
/// for. `None`: no unfinished job holds it (it finished since, or never existed).
pub async fn dedup_holder(pool: &PgPool, dedup_key: &str) -> Result<Option<JobId>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM rowq.jobs WHERE dedup_key = $1 AND state IN ('pending', 'dispatched', 'running')",
    )
    .bind(dedup_key)
    .fetch_optional(pool)
    .await
}

/// How [`wait_finished`] ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Waited {
    /// The job is succeeded, failed or cancelled.
    Finished(JobRow),
    /// The timeout passed first: the row as last read.
    Unfinished(JobRow),
    /// The job was read, then was gone before it was read finished (`rowq discard`,
    /// retention, a `DELETE` by hand): the row as last read.
    Deleted(JobRow),
    /// No such job at the first read.
    Missing,
}

/// The first pause of [`wait_finished`] between two reads; each next one is twice as long, up
/// to [`WAIT_MAX_POLL`]: a job that takes a few milliseconds is seen finished within a few
/// more, one that takes minutes costs two primary-key reads a second.
pub const WAIT_FIRST_POLL: Duration = Duration::from_millis(10);
pub const WAIT_MAX_POLL: Duration = Duration::from_millis(500);

/// What [`wait_finished`] tells its caller while it waits.
#[derive(Debug)]
pub enum WaitProgress<'a> {
    /// The first row read, and each one whose state or attempts changed.
    Seen(&'a JobRow),
    /// A read failed because the database could not be reached ([`crate::store::unreachable`]:
    /// a failover, a restart): the wait goes on, reading again. Told once an outage.
    Unreachable(&'a sqlx::Error),
    /// A read succeeded again after [`WaitProgress::Unreachable`].
    Reachable,
}

/// Reads job `id` until it is finished or `timeout` has passed (`None`: no limit), telling
/// `progress` what it sees. A read of its primary key each time; nothing is written, nothing
/// is listened for. For a client that enqueued a job and needs its outcome: `rowq wait`,
/// `rowq enqueue --wait`. Once the job has been read, a wait outlasts the database's outages:
/// a read that cannot reach it is tried again (each [`WAIT_MAX_POLL`]) until the timeout, which
/// then ends the wait with the row as last read (`Unfinished`). Any other error, or one before
/// the first read (a database that was never there, a wrong address), ends it at once.
pub async fn wait_finished(
    pool: &PgPool,
    id: JobId,
    timeout: Option<Duration>,
    mut progress: impl FnMut(WaitProgress<'_>),
) -> Result<Waited, sqlx::Error> {
    let deadline = timeout.map(|timeout| tokio::time::Instant::now() + timeout);
    let mut pause = WAIT_FIRST_POLL;
    let mut previous: Option<JobRow> = None;
    let mut unreachable = false;
    loop {
        let row = match get(pool, id).await {
            Ok(Some(row)) => row,
            Ok(None) => return Ok(previous.map_or(Waited::Missing, Waited::Deleted)),
            Err(error) if previous.is_some() && crate::store::unreachable(&error) => {
                if !std::mem::replace(&mut unreachable, true) {
                    progress(WaitProgress::Unreachable(&error));
                }
                let now = tokio::time::Instant::now();
                if deadline.is_some_and(|deadline| deadline <= now) {
                    return previous.map(Waited::Unfinished).ok_or(error);
                }
                let left = deadline.map_or(WAIT_MAX_POLL, |deadline| deadline - now);
                tokio::time::sleep(WAIT_MAX_POLL.min(left)).await;
                continue;
            }
            Err(error) => return Err(error),
        };
        if std::mem::replace(&mut unreachable, false) {
            progress(WaitProgress::Reachable);
        }
        if previous.as_ref().map(|before| (before.state, before.attempts)) != Some((row.state, row.attempts)) {
            progress(WaitProgress::Seen(&row));
        }
        if row.state.is_terminal() {
            return Ok(Waited::Finished(row));
        }
        let now = tokio::time::Instant::now();
        let sleep = match deadline {
            Some(deadline) if deadline <= now => return Ok(Waited::Unfinished(row)),
            Some(deadline) => pause.min(deadline - now),
            None => pause,
        };
        tokio::time::sleep(sleep).await;
        pause = (pause * 2).min(WAIT_MAX_POLL);
        previous = Some(row);
    }
}

/// Filters for [`list`]; `None` matches everything.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub state: Option<JobState>,
    pub kind: Option<String>,
    pub queue: Option<String>,
    /// The jobs of one group: what ran, and what waits, in a customer's ordered stream.
    pub group_key: Option<String>,
    /// The jobs enqueued with one key: each run of a recurring job, say.
    pub dedup_key: Option<String>,
    pub limit: i64,
}

/// Newest first.
pub async fn list(pool: &PgPool, filter: &ListFilter) -> Result<Vec<JobRow>, sqlx::Error> {
    sqlx::query_as(
        r#"
        SELECT * FROM rowq.jobs
        WHERE ($1::rowq.job_state IS NULL OR state = $1)
          AND ($2::text IS NULL OR kind = $2)
          AND ($3::text IS NULL OR queue = $3)
          AND ($5::text IS NULL OR group_key = $5)
          AND ($6::text IS NULL OR dedup_key = $6)
        ORDER BY id DESC
        LIMIT $4
        "#,
    )
    .bind(filter.state)
    .bind(&filter.kind)
    .bind(&filter.queue)
    .bind(filter.limit)
    .bind(&filter.group_key)
    .bind(&filter.dedup_key)
    .fetch_all(pool)
    .await
}

/// The cancel transition, `pending | dispatched → cancelled`, as the start of an `UPDATE` whose
/// callers add which rows (`AND ...`) and what it returns: one text for [`cancel`] and
/// [`cancel_unstarted`], so that they cannot drift apart.
macro_rules! cancel_unstarted_rows {
    () => {
        "UPDATE rowq.jobs
        SET state = 'cancelled', finished_at = now(), dispatch_deadline = NULL, updated_at = now()
        WHERE state IN ('pending', 'dispatched')"
    };
}

/// What a retry sets on a failed row: pending and due now, attempts and outcome reset. One text
/// for [`retry`] and [`retry_many`].
macro_rules! retried_as_new {
    () => {
        "SET state = 'pending', attempts = 0, run_at = now(), finished_at = NULL, result = NULL,
            updated_at = now()"
    };
}

/// `pending | dispatched → cancelled`. A message already sent for a dispatched job will
/// match nothing at the worker's fence. `None`: the job is running, finished, or absent. A
/// cancelled job of a group lets the group's next one go: the schedulers are woken.
pub async fn cancel(pool: &PgPool, id: JobId) -> Result<Option<JobRow>, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let row: Option<JobRow> = sqlx::query_as(concat!(cancel_unstarted_rows!(), " AND id = $1 RETURNING *"))
        .bind(id)
        .fetch_optional(&mut *transaction)
        .await?;
    let group_moved = row.as_ref().is_some_and(|row| row.group_key.is_some());
    commit_waking(transaction, group_moved.then_some("group")).await?;
    Ok(row)
}

/// Whether a transition of many jobs commits, or runs and rolls back to tell what it would do
/// (the same statement, so the same rows: an operator's `--dry-run`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bulk {
    Apply,
    DryRun,
}

/// [`cancel`] for every pending or dispatched job of `queue` and of `kind` (each when given), in
/// one statement: a producer's flood of jobs that must not run. Running jobs are left to finish.
/// Returns the ids, in order. 200,000 jobs of a kind among 400,000 pending took 3.0 s.
pub async fn cancel_unstarted(
    pool: &PgPool,
    queue: Option<&str>,
    kind: Option<&str>,
    bulk: Bulk,
) -> Result<Vec<JobId>, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let rows: Vec<(JobId, bool)> = sqlx::query_as(concat!(
        "WITH moved AS (",
        cancel_unstarted_rows!(),
        " AND ($1::text IS NULL OR queue = $1) AND ($2::text IS NULL OR kind = $2)
            RETURNING id, group_key IS NOT NULL AS grouped
        )
        SELECT id, grouped FROM moved ORDER BY id"
    ))
    .bind(queue)
    .bind(kind)
    .fetch_all(&mut *transaction)
    .await?;
    let group_moved = rows.iter().any(|(_, grouped)| *grouped);
    end_bulk(transaction, bulk, group_moved.then_some("group")).await?;
    Ok(rows.into_iter().map(|(id, _)| id).collect())
}

/// `failed | cancelled → pending` with attempts reset and `run_at = now()`; the next claim
/// gives it a new generation (so a message still in SQS from before a cancel matches nothing),
/// and the schedulers are woken when it commits. `None`: the job is neither failed nor
/// cancelled, or absent. Fails with a unique violation on `jobs_dedup_key_unfinished_idx` when
/// another unfinished job holds its `dedup_key`.
pub async fn retry(pool: &PgPool, id: JobId) -> Result<Option<JobRow>, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let row: Option<JobRow> = sqlx::query_as(concat!(
        "UPDATE rowq.jobs ",
        retried_as_new!(),
        " WHERE id = $1 AND state IN ('failed', 'cancelled') RETURNING *"
    ))
    .bind(id)
    .fetch_optional(&mut *transaction)
    .await?;
    commit_waking(transaction, row.is_some().then_some("retried")).await?;
    Ok(row)
}

/// Which finished jobs a retry or a discard of many takes ([`retry_many`], [`discard_many`]):
/// those in state `of`, of `queue`, of `kind`, finished at or after `since` and before
/// `before`, each when given.
#[derive(Debug, Clone, Copy, Default)]
pub struct FinishedJobs<'a> {
    pub queue: Option<&'a str>,
    pub kind: Option<&'a str>,
    pub since: Option<DateTime<Utc>>,
    pub before: Option<DateTime<Utc>>,
    pub of: EndedAs,
}

/// How the jobs a retry or a discard of many takes ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EndedAs {
    /// Failed jobs: to retry once their cause is fixed, or to discard once read.
    #[default]
    Failed,
    /// Cancelled jobs: a retry is the undo of a cancel (`rowq cancel --all` of the wrong kind).
    Cancelled,
}

impl EndedAs {
    pub fn state(self) -> JobState {
        match self {
            EndedAs::Failed => JobState::Failed,
            EndedAs::Cancelled => JobState::Cancelled,
        }
    }
}

/// The rows of [`FinishedJobs`], its fields bound by [`bind_finished`] as `$1`..`$5`. The state
/// and `finished_at` tests are those of the index of each outcome (`jobs_failed_idx`,
/// `jobs_done_idx`), so `since` and `before` read a range of it.
macro_rules! finished_jobs_where {
    () => {
        "state = $1 AND ($2::text IS NULL OR queue = $2) AND ($3::text IS NULL OR kind = $3)
          AND ($4::timestamptz IS NULL OR finished_at >= $4) AND ($5::timestamptz IS NULL OR finished_at < $5)"
    };
}

fn bind_finished<'q, O>(
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    which: FinishedJobs<'q>,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    query.bind(which.of.state()).bind(which.queue).bind(which.kind).bind(which.since).bind(which.before)
}

/// What [`retry_many`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Retried {
    /// The jobs back to pending, by id.
    pub retried: Vec<JobId>,
    /// The jobs left as they were (failed or cancelled) because another job holds their
    /// `dedup_key`, by id.
    pub left: Vec<LeftHeld>,
}

/// A job that a retry of many left failed (or cancelled): `held_by` holds its `dedup_key`, an
/// unfinished job or a newer one that this retry put back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeftHeld {
    pub id: JobId,
    pub held_by: JobId,
}

/// [`retry`] for every job `which` selects, in one transaction, waking the schedulers.
///
/// Only one unfinished job may hold a `dedup_key`, so a retry of many does not put back a job
/// whose key another holds: an unfinished job, or a newer job of the same key among those
/// retried, which is put back instead (its payload is the latest). Those stay as they were, and
/// are named, rather than one of them refusing the whole retry. A job enqueued with such a key
/// while this runs still refuses it (a unique violation on `jobs_dedup_key_unfinished_idx`):
/// run it again.
///
/// With `since`, the failed rows are found through the index of failed rows by `finished_at`
/// (`jobs_failed_idx`; with the index of all finished rows: 1.0 ms for the last hour's 359 of
/// 300,000 finished rows, against 37 ms for a scan of them all, which is what a retry without
/// `since` reads), the cancelled ones through `jobs_done_idx`. 196,000 failed jobs, 2,000 of
/// them sharing ten keys, went back in 5.9 s.
pub async fn retry_many(pool: &PgPool, which: FinishedJobs<'_>, bulk: Bulk) -> Result<Retried, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let query = sqlx::query_as(concat!(
        "WITH candidate AS (
            SELECT id, dedup_key FROM rowq.jobs WHERE ",
        finished_jobs_where!(),
        " FOR UPDATE
        ), holder AS (
            -- The newest of a key's candidates by a window over them, not a scan per job.
            SELECT c.id, CASE WHEN c.dedup_key IS NOT NULL THEN COALESCE(
                (SELECT u.id FROM rowq.jobs u
                 WHERE u.dedup_key = c.dedup_key AND u.state IN ('pending', 'dispatched', 'running')),
                max(c.id) OVER (PARTITION BY c.dedup_key)
            ) END AS held_by
            FROM candidate c
        ), moved AS (
            UPDATE rowq.jobs j ",
        retried_as_new!(),
        " FROM holder h
            WHERE j.id = h.id AND (h.held_by IS NULL OR h.held_by = h.id)
            RETURNING j.id
        )
        SELECT h.id, CASE WHEN m.id IS NULL THEN h.held_by END
        FROM holder h LEFT JOIN moved m ON m.id = h.id
        ORDER BY h.id"
    ));
    let rows: Vec<(JobId, Option<JobId>)> = bind_finished(query, which).fetch_all(&mut *transaction).await?;
    let mut done = Retried::default();
    for (id, held_by) in rows {
        match held_by {
            None => done.retried.push(id),
            Some(held_by) => done.left.push(LeftHeld { id, held_by }),
        }
    }
    end_bulk(transaction, bulk, (!done.retried.is_empty()).then_some("retried")).await?;
    Ok(done)
}

/// Deletes a failed or cancelled job: its row, payload and error history, which nothing can
/// bring back. `None`: the job is not failed or cancelled (a succeeded row goes by retention;
/// an unfinished one must be cancelled first), or absent. Nothing else waits on a finished row.
pub async fn discard(pool: &PgPool, id: JobId) -> Result<Option<JobRow>, sqlx::Error> {
    sqlx::query_as("DELETE FROM rowq.jobs WHERE id = $1 AND state IN ('failed', 'cancelled') RETURNING *")
        .bind(id)
        .fetch_optional(pool)
        .await
}

/// [`discard`] for every job `which` selects, in one statement; returns their ids, in order.
/// With `ROWQ_FAILED_RETENTION_HOURS=0` (failed rows kept until handled) this is how the
/// failures an operator has read and will not retry go. 200,000 failed jobs of a kind among
/// 400,000 (rows without payloads) went in 0.7 s. With `since` or `before` the rows are found
/// through the index of their outcome (`EXPLAIN`: a bitmap scan of `jobs_failed_idx` or
/// `jobs_done_idx`, a range of `finished_at`).
pub async fn discard_many(pool: &PgPool, which: FinishedJobs<'_>, bulk: Bulk) -> Result<Vec<JobId>, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let query = sqlx::query_as(concat!(
        "WITH gone AS (DELETE FROM rowq.jobs WHERE ",
        finished_jobs_where!(),
        " RETURNING id) SELECT id FROM gone ORDER BY id"
    ));
    let rows: Vec<(JobId,)> = bind_finished(query, which).fetch_all(&mut *transaction).await?;
    end_bulk(transaction, bulk, None).await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// A paused queue: its schedulers claim nothing from it until it is resumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PausedQueue {
    pub queue: String,
    pub paused_at: DateTime<Utc>,
    pub reason: Option<String>,
}

from_row!(PausedQueue { queue, paused_at, reason });

/// What [`pause`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Paused {
    #[serde(flatten)]
    pub queue: PausedQueue,
    /// The queue was paused before: it stays paused since then, with this reason if one was
    /// given, else its first.
    pub already: bool,
}

/// Pauses `queue`: from the first claim that starts after this returns, no scheduler claims its
/// jobs. Producers still enqueue, dispatched and running jobs finish, maintenance goes on. The
/// queue need not have jobs yet. Pausing a paused queue keeps its `paused_at` and records the
/// new reason, if any. A queue name the database refuses (`rowq.queue_name`) is an error.
pub async fn pause(pool: &PgPool, queue: &str, reason: Option<&str>) -> Result<Paused, sqlx::Error> {
    // `paused_at` is the inserting transaction's `now()`: an earlier one means the row was there.
    let (queue, paused_at, reason, already) = sqlx::query_as(
        "INSERT INTO rowq.paused_queues AS p (queue, reason) VALUES ($1, $2)
        ON CONFLICT (queue) DO UPDATE SET reason = coalesce(excluded.reason, p.reason)
        RETURNING p.queue::text, p.paused_at, p.reason, p.paused_at < now()",
    )
    .bind(queue)
    .bind(reason)
    .fetch_one(pool)
    .await?;
    Ok(Paused { queue: PausedQueue { queue, paused_at, reason }, already })
}

/// Resumes `queue`, waking the schedulers (the table's trigger notifies, whoever deletes the
/// row). `None`: it was not paused.
pub async fn resume(pool: &PgPool, queue: &str) -> Result<Option<PausedQueue>, sqlx::Error> {
    sqlx::query_as("DELETE FROM rowq.paused_queues WHERE queue = $1 RETURNING queue::text, paused_at, reason")
        .bind(queue)
        .fetch_optional(pool)
        .await
}

/// The pause of the queue job `id` waits in, when the job is `pending` and its queue paused:
/// nothing claims it until a resume. `None` otherwise, or when there is no such job.
pub async fn pause_holding(pool: &PgPool, id: JobId) -> Result<Option<PausedQueue>, sqlx::Error> {
    sqlx::query_as(
        "SELECT p.queue::text, p.paused_at, p.reason FROM rowq.jobs j JOIN rowq.paused_queues p ON p.queue = j.queue
         WHERE j.id = $1 AND j.state = 'pending'",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
}

/// The paused queues, the longest paused first.
pub async fn paused_queues(pool: &PgPool) -> Result<Vec<PausedQueue>, sqlx::Error> {
    sqlx::query_as("SELECT queue::text, paused_at, reason FROM rowq.paused_queues ORDER BY paused_at, queue")
        .fetch_all(pool)
        .await
}

/// Commits a transition of many jobs as [`commit_waking`] does, or rolls it back for a dry run.
async fn end_bulk(
    transaction: sqlx::Transaction<'_, sqlx::Postgres>,
    bulk: Bulk,
    why: Option<&str>,
) -> Result<(), sqlx::Error> {
    match bulk {
        Bulk::Apply => commit_waking(transaction, why).await,
        Bulk::DryRun => transaction.rollback().await,
    }
}

/// Commits an operator's transition, waking the schedulers (`why`) when it made rows
/// claimable that sent no `NOTIFY` of their own (that is the insert trigger's): a retried job
/// is due at once, a group's next job may go once its head is cancelled. Without it an idle
/// scheduler finds them at its next poll. The notification leaves with the commit.
async fn commit_waking(
    mut transaction: sqlx::Transaction<'_, sqlx::Postgres>,
    why: Option<&str>,
) -> Result<(), sqlx::Error> {
    if let Some(why) = why {
        super::wake_schedulers_at_commit(&mut transaction, why).await?;
    }
    transaction.commit().await
}

/// Jobs of one queue in one state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StateCount {
    pub queue: String,
    pub state: JobState,
    pub count: i64,
}

from_row!(StateCount { queue, state, count });

/// Jobs of one queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueCount {
    pub queue: String,
    pub count: i64,
}

from_row!(QueueCount { queue, count });

/// The queue's health at a glance.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    pub counts: Vec<StateCount>,
    /// Age of the oldest due pending job, in seconds.
    pub oldest_pending_secs: Option<f64>,
    /// Jobs that reached a terminal state in the last minute.
    pub finished_last_minute: i64,
    /// Jobs that failed in the last hour, by kind, the most first (at most
    /// [`STATS_FAILED_KINDS`] kinds): which kind to look at, without a metrics system.
    pub failed_last_hour: Vec<KindCount>,
    /// What has held the cleanup of finished jobs' row versions back for a minute or more
    /// ([`STATS_CLEANUP_HELD_FOR`]), oldest first: while it lasts, claims slow down.
    pub cleanup_held_by: Vec<CleanupHolder>,
    /// The paused queues ([`pause`]), the longest paused first.
    pub paused: Vec<PausedQueue>,
    /// By queue, the `pending` jobs the claim has set aside behind an unfinished earlier job of
    /// their group (`behind_group`, docs/DESIGN.md 36), which wait for their group and not for
    /// the scheduler.
    pub behind_group: Vec<QueueCount>,
}

/// Jobs of one kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KindCount {
    pub kind: String,
    pub count: i64,
}

from_row!(KindCount { kind, count });

/// [`Stats::failed_last_hour`] names at most this many kinds.
pub const STATS_FAILED_KINDS: i64 = 20;

/// [`Stats::cleanup_held_by`] lists what has held the cleanup back for at least this long.
pub const STATS_CLEANUP_HELD_FOR: Duration = Duration::from_secs(60);

pub async fn stats(pool: &PgPool) -> Result<Stats, sqlx::Error> {
    let counts = sqlx::query_as(
        "SELECT queue, state, count(*) AS count FROM rowq.jobs GROUP BY queue, state ORDER BY queue, state",
    )
    .fetch_all(pool)
    .await?;
    let (oldest_pending_secs, finished_last_minute): (Option<f64>, i64) = sqlx::query_as(
        r#"
        SELECT
            (SELECT extract(epoch FROM now() - min(run_at))::float8
               FROM rowq.jobs WHERE state = 'pending' AND run_at <= now()),
            -- One count through each index of finished rows by `finished_at`, whose predicates
            -- these state tests are: the last minute's rows only, however long the history.
            (SELECT count(*) FROM rowq.jobs
               WHERE state IN ('succeeded', 'cancelled') AND finished_at > now() - interval '1 minute')
            + (SELECT count(*) FROM rowq.jobs WHERE state = 'failed' AND finished_at > now() - interval '1 minute')
        "#,
    )
    .fetch_one(pool)
    .await?;
    // Through the index of failed rows by `finished_at`: the last hour's only.
    let failed_last_hour = sqlx::query_as(
        r#"
        SELECT kind, count(*) AS count FROM rowq.jobs
        WHERE state = 'failed' AND finished_at > now() - interval '1 hour'
        GROUP BY kind ORDER BY count(*) DESC, kind LIMIT $1
        "#,
    )
    .bind(STATS_FAILED_KINDS)
    .fetch_all(pool)
    .await?;
    let cleanup_held_by = cleanup_holders(pool, STATS_CLEANUP_HELD_FOR).await?;
    let paused = paused_queues(pool).await?;
    // Through the index of the jobs set aside (`jobs_behind_group_idx`): none read but those.
    let behind_group = sqlx::query_as(
        "SELECT queue, count(*) AS count FROM rowq.jobs WHERE behind_group AND state = 'pending'
         GROUP BY queue ORDER BY queue",
    )
    .fetch_all(pool)
    .await?;
    Ok(Stats {
        counts,
        oldest_pending_secs,
        finished_last_minute,
        failed_last_hour,
        cleanup_held_by,
        paused,
        behind_group,
    })
}

/// [`QueueGauges::due_pending`] counts no further than this, so that a backlog of millions costs
/// the scheduler's metrics no more than a scan of this many index entries.
pub const GAUGE_COUNT_CAP: i64 = 100_000;

/// [`QueueGauges::oldest_claimable_secs`] looks for a claimable job among this many of the
/// oldest due ones of each priority at most, testing each for an unfinished job earlier in its
/// group. The jobs the claim has set aside behind their group (`behind_group`, docs/DESIGN.md
/// 36) are not read at all; the window bounds the walk past those it has not set aside yet:
/// with 200,000 due jobs behind one running job of their group, none set aside (and 1M
/// finished rows), the gauges took 0.12–0.17 s with this window and 2.4–2.6 s without one.
pub const CLAIMABLE_WINDOW: i64 = 10_000;

/// One queue's state as the scheduler reports it in its metrics (`crate::metrics`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueGauges {
    /// How long the oldest due `pending` job has been due, in seconds; 0 when none is. A job
    /// waiting behind an unfinished one of its `group_key` counts: it is how long users wait.
    pub oldest_due_pending_secs: f64,
    /// How long the oldest job a claim would take now has been due, in seconds; 0 when none
    /// would be taken. Like [`oldest_due_pending_secs`](Self::oldest_due_pending_secs), but
    /// without the jobs waiting behind an unfinished one of their `group_key`, which wait for
    /// a job in flight or in its backoff, not for the scheduler: it grows only when dispatch
    /// itself is held up. The jobs the claim has set aside are left out unread; when all of the
    /// [`CLAIMABLE_WINDOW`] oldest due jobs of a priority that it has not set aside wait behind
    /// their groups, that priority counts the wait of the youngest of them: none of its
    /// claimable jobs has waited longer.
    pub oldest_claimable_secs: f64,
    /// `pending` jobs that are due, up to [`GAUGE_COUNT_CAP`].
    pub due_pending: i64,
    /// Claimed and published, not yet started by a worker.
    pub dispatched: i64,
    pub running: i64,
    /// The queue is paused ([`pause`]): its due jobs wait, and the ages above grow, until it is
    /// resumed. Reported as 1 or 0.
    pub paused: bool,
}

/// The statement of [`queue_gauges`] (public so that tests can `EXPLAIN` it).
///
/// The oldest claimable job is the oldest of each priority's first: the claim's index
/// (`jobs_claimable_idx`, which holds no job set aside) is in `run_at` order within a priority,
/// and `priorities` steps through the queue's priorities in it, one index descent each (at most
/// 2,001, the CHECK's range; a queue uses a few).
pub const GAUGES_SQL: &str = concat!(
    r#"
    WITH RECURSIVE priorities (priority) AS (
        (SELECT priority FROM rowq.jobs WHERE state = 'pending' AND NOT behind_group AND queue = $1
          ORDER BY priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT j.priority FROM rowq.jobs j
                 WHERE j.state = 'pending' AND NOT j.behind_group AND j.queue = $1 AND j.priority < p.priority
                 ORDER BY j.priority DESC LIMIT 1)
        FROM priorities p WHERE p.priority IS NOT NULL
    ),
    oldest_claimable AS (
        -- Per priority: the first due job that passes the claim's group test, among the
        -- window's; none passing in a full window, the window's youngest.
        SELECT min(coalesce(
            (SELECT j.run_at FROM rowq.jobs j
              WHERE j.state = 'pending' AND NOT j.behind_group AND j.queue = $1 AND j.priority = p.priority
                AND j.run_at <= coalesce(window_end.at, now())
                AND "#,
    super::first_of_its_group!(),
    r#"
              ORDER BY j.run_at LIMIT 1),
            window_end.at)) AS at
        FROM priorities p,
             LATERAL (SELECT (SELECT run_at FROM rowq.jobs
                               WHERE state = 'pending' AND NOT behind_group AND queue = $1
                                 AND priority = p.priority AND run_at <= now()
                               ORDER BY run_at OFFSET $3 - 1 LIMIT 1) AS at) window_end
        WHERE p.priority IS NOT NULL
    )
    SELECT
        coalesce((SELECT extract(epoch FROM now() - min(run_at))::float8
                    FROM rowq.jobs WHERE state = 'pending' AND queue = $1 AND run_at <= now()), 0),
        coalesce((SELECT extract(epoch FROM now() - at)::float8 FROM oldest_claimable), 0),
        (SELECT count(*) FROM (SELECT FROM rowq.jobs
                                WHERE state = 'pending' AND queue = $1 AND run_at <= now() LIMIT $2) due),
        (SELECT count(*) FROM rowq.jobs WHERE state = 'dispatched' AND queue = $1),
        (SELECT count(*) FROM rowq.jobs WHERE state = 'running' AND queue = $1),
        EXISTS (SELECT FROM rowq.paused_queues WHERE queue = $1)
    "#
);

/// [`QueueGauges`] of `queue`, in one statement. Each part reads a partial index of unfinished
/// rows (the claim's, the dispatched and the running one), never the finished rows. The oldest
/// claimable job is found by walking each priority's due jobs not set aside, oldest first, each
/// tested as the claim tests it, and stopping at the first that passes or at the
/// [`CLAIMABLE_WINDOW`]th.
pub async fn queue_gauges(pool: &PgPool, queue: &str) -> Result<QueueGauges, sqlx::Error> {
    let (oldest_due_pending_secs, oldest_claimable_secs, due_pending, dispatched, running, paused) =
        sqlx::query_as(GAUGES_SQL).bind(queue).bind(GAUGE_COUNT_CAP).bind(CLAIMABLE_WINDOW).fetch_one(pool).await?;
    Ok(QueueGauges { oldest_due_pending_secs, oldest_claimable_secs, due_pending, dispatched, running, paused })
}
