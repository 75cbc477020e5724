//! The worker's transitions: the fence (`dispatched → running`), the finish
//! (`running → succeeded | pending | failed`), and the DLQ's `→ failed`.
//!
//! An execution is identified by `(id, dispatch_gen, attempts)`: the fence increments
//! `attempts`, so a worker that was taken over (its `run_deadline` passed and a redelivered
//! message started the job again) can no longer finish it, even though the generation is
//! the same.

use std::collections::HashSet;
use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool};

use super::millis;
use super::types::from_row;
use crate::job::{JobId, JobState};

/// One message's claim on a job: start this generation, with this timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartRequest {
    pub id: JobId,
    pub dispatch_gen: i64,
    /// From now to `run_deadline`: the job's timeout plus the rescue grace.
    pub lease: Duration,
}

/// A job this worker now runs, exclusively, as execution `(id, dispatch_gen, attempt)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Started {
    pub id: JobId,
    pub dispatch_gen: i64,
    /// This execution's number, 1-based (`attempts` after the fence).
    pub attempt: i32,
    pub max_attempts: i32,
    pub kind: String,
    pub payload: serde_json::Value,
    pub group_key: Option<String>,
    pub run_deadline: DateTime<Utc>,
    /// How long the job had been due when this execution started, in milliseconds: from its
    /// `run_at` (when it was enqueued for, or its retry's backoff ended) to the fence's `now()`,
    /// both the database's clock.
    pub waited_ms: f64,
}

from_row!(Started { id, dispatch_gen, attempt = "attempts", max_attempts, kind, payload, group_key, run_deadline, waited_ms });

/// The fence statement of [`start`] (public so that tests can `EXPLAIN` it).
pub const START_SQL: &str = r#"
        UPDATE rowq.jobs j
        SET state = 'running',
            attempts = j.attempts + 1,
            started_at = now(),
            run_deadline = now() + ($3::bigint[])[width_bucket(j.id, $1::bigint[])] * interval '1 millisecond',
            dispatch_deadline = NULL,
            updated_at = now()
        WHERE j.id = ANY (ARRAY(SELECT unnest($1::bigint[])))
          AND j.dispatch_gen = ($2::bigint[])[width_bucket(j.id, $1::bigint[])]
          AND j.attempts < j.max_attempts
          AND (j.state::text = 'dispatched' OR (j.state::text = 'running' AND j.run_deadline < now()))
        RETURNING j.id, j.dispatch_gen, j.attempts, j.max_attempts, j.kind, j.payload, j.group_key, j.run_deadline,
                  extract(epoch FROM now() - j.run_at)::float8 * 1000 AS waited_ms
        "#;

/// The statement of [`finish`] when every outcome is a success, the common case (public so
/// that tests can `EXPLAIN` it): `running → succeeded` with the result, under the same guard.
/// Each row's values are found as in [`START_SQL`], the ids bound in ascending order
/// ([`success_arrays`]).
pub const SUCCEED_SQL: &str = r#"
        UPDATE rowq.jobs j
        SET state = 'succeeded',
            result = (($4::text[])[width_bucket(j.id, $1::bigint[])])::jsonb,
            last_error = NULL,
            finished_at = now(),
            run_deadline = NULL,
            updated_at = now()
        WHERE j.id = ANY (ARRAY(SELECT unnest($1::bigint[])))
          AND j.dispatch_gen = ($2::bigint[])[width_bucket(j.id, $1::bigint[])]
          AND j.attempts = ($3::int[])[width_bucket(j.id, $1::bigint[])]
          AND j.state::text = 'running'
        RETURNING j.id, j.dispatch_gen, j.attempts
        "#;

/// The fence, for a whole batch in one statement: `dispatched → running` for the message's
/// generation, or take-over of a `running` row of that generation whose `run_deadline` has
/// passed (its worker died). `attempts + 1`, `started_at`, `run_deadline` set.
///
/// Requests that match nothing are stale or duplicate messages; they are absent from the
/// result. Requests must name distinct jobs (a job appearing twice would start once).
///
/// The rows are found by primary key (`id = ANY` of the ids), and the state guard is written
/// on `state::text` so that no partial index of a state matches it. With the statistics of a
/// table analyzed while its rows were all `pending`, the planner believed the `dispatched`
/// index empty and scanned every in-flight row to start ten; now the cost is the batch's,
/// whatever the statistics say. [`finish`] and `dispatch::release` do the same.
///
/// Each row finds its own request by its position in the ids, not by joining `unnest(...)` of
/// the arrays: for an `UPDATE ... FROM` a function scan, Postgres builds a whole-row copy of
/// every joined row (for re-checks under concurrent updates) and hashes the join; with the
/// success-only finish below this took Postgres's CPU per job in a drain from ~97 to ~83 µs.
/// The position is `width_bucket(j.id, $1)`, a binary search, which needs `$1` in ascending
/// order and each id once (the callers sort, and a job named twice — a stale and a
/// current message in batches combined into one statement — is asked again in a second
/// statement). With an id of the array, the bucket it falls in is its own position.
/// `array_position`, before, compared each row's id with the array's elements one by one:
/// n²/2 comparisons for a statement of n rows, 7% of the worker's backend's CPU in a drain
/// (statements of 80 rows); without them the in-memory drain is 7% faster as the median of 8
/// interleaved pairs (BENCHMARKS.md, round 13).
///
/// The ids are matched through `ANY (ARRAY(SELECT unnest($1)))`, not `ANY ($1)`, so that the
/// statement is planned once per connection, not on every execution. Postgres plans a prepared
/// statement for its parameters' values five times, then keeps the generic plan only if it
/// costs no more than those did. With `ANY ($1)` the planner counts the array's elements, and a
/// quiet queue's batches of one made every plan for its values cheaper than the generic one
/// (which assumes ten): the fence was planned afresh per job, ~0.25 ms of Postgres's CPU on the
/// path of each (bind 0.29 ms, 0.04 with the generic plan). An array computed by a subquery is
/// counted as ten either way, so after five executions the generic plan is kept. Both of
/// [`finish`]'s statements do the same (the joined one since round 14: a quiet queue whose jobs
/// failed had it planned per job).
pub async fn start(pool: &PgPool, requests: &[StartRequest]) -> Result<Vec<Started>, sqlx::Error> {
    start_sorted(&mut *pool.acquire().await?, by_id(requests)).await
}

/// Requests in ascending order of their jobs' ids; a job's own requests keep their order.
fn by_id(requests: &[StartRequest]) -> Vec<&StartRequest> {
    let mut sorted: Vec<&StartRequest> = requests.iter().collect();
    sorted.sort_by_key(|r| r.id);
    sorted
}

/// [`start`] of requests [`by_id`], on one connection (the worker's, see [`step`]): one statement
/// for the first request naming each job, another for the next, and so on.
async fn start_sorted(connection: &mut PgConnection, sorted: Vec<&StartRequest>) -> Result<Vec<Started>, sqlx::Error> {
    let mut started = Vec::new();
    let mut rest = sorted;
    while !rest.is_empty() {
        let (now, later) = first_per_job(rest);
        let (ids, gens, leases) = start_arrays(now);
        let rows: Vec<Started> =
            sqlx::query_as(START_SQL).bind(ids).bind(gens).bind(leases).fetch_all(&mut *connection).await?;
        started.extend(rows);
        rest = later;
    }
    Ok(started)
}

/// The arrays [`START_SQL`] binds as `$1..$3`: each request's job, generation and lease (ms),
/// of requests [`by_id`] naming each job once (the statement's `width_bucket` needs it).
fn start_arrays(requests: Vec<&StartRequest>) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    let (mut ids, mut gens, mut leases) = (Vec::new(), Vec::new(), Vec::new());
    for request in requests {
        ids.push(request.id.0);
        gens.push(request.dispatch_gen);
        leases.push(millis(request.lease));
    }
    (ids, gens, leases)
}

/// The arrays both finish statements bind as `$1..$3`: each execution's job, generation and
/// attempt, which their guard compares with the row.
fn execution_arrays<'a>(finishes: impl Iterator<Item = &'a Finish>) -> (Vec<i64>, Vec<i64>, Vec<i32>) {
    let (mut ids, mut gens, mut attempts) = (Vec::new(), Vec::new(), Vec::new());
    for finish in finishes {
        ids.push(finish.id.0);
        gens.push(finish.dispatch_gen);
        attempts.push(finish.attempt);
    }
    (ids, gens, attempts)
}

/// Ids, generations, attempts and serialized results, as [`SUCCEED_SQL`] binds them.
type SuccessArrays = (Vec<i64>, Vec<i64>, Vec<i32>, Vec<Option<String>>);

/// Each finish with its serialized result, in ascending order of the jobs' ids.
fn by_job(finishes: &[Finish], results: Vec<Option<String>>) -> Vec<(&Finish, Option<String>)> {
    let mut rows: Vec<(&Finish, Option<String>)> = finishes.iter().zip(results).collect();
    rows.sort_unstable_by_key(|(finish, _)| finish.id);
    rows
}

/// The arrays [`SUCCEED_SQL`] binds as `$1..$4`: [`execution_arrays`] and each serialized
/// result, of `rows` from [`by_job`] (its `width_bucket` needs the ids in ascending order; each
/// job must be named once).
fn success_arrays(rows: Vec<(&Finish, Option<String>)>) -> SuccessArrays {
    let (ids, gens, attempts) = execution_arrays(rows.iter().map(|(finish, _)| *finish));
    (ids, gens, attempts, rows.into_iter().map(|(_, result)| result).collect())
}

/// Of requests sorted by job, the first naming each job, and those that name a job again.
fn first_per_job(sorted: Vec<&StartRequest>) -> (Vec<&StartRequest>, Vec<&StartRequest>) {
    let mut previous = None;
    sorted.into_iter().partition(|request| previous.replace(request.id) != Some(request.id))
}

/// How an execution ended, as the row will record it.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// `running → succeeded`, with the handler's result.
    Succeeded { result: serde_json::Value },
    /// `running → pending` at `now() + backoff`, the error appended to the history.
    RetryLater { error: String, backoff: Duration },
    /// `running → failed`, the error appended to the history.
    Failed { error: String },
}

/// An execution whose outcome [`finish`] recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Finished {
    pub id: JobId,
    pub dispatch_gen: i64,
    pub attempt: i32,
}

from_row!(Finished { id, dispatch_gen, attempt = "attempts" });

/// One finished execution.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub id: JobId,
    pub dispatch_gen: i64,
    pub attempt: i32,
    pub outcome: Outcome,
}

/// The statement of [`finish`] (public so that tests can `EXPLAIN` it).
pub const FINISH_SQL: &str = r#"
        UPDATE rowq.jobs j
        SET state = f.state::rowq.job_state,
            result = f.result::jsonb,
            last_error = f.error,
            errors = CASE WHEN f.error IS NULL THEN j.errors
                          ELSE j.errors || jsonb_build_array(jsonb_build_object(
                                 'attempt', j.attempts, 'dispatch_gen', j.dispatch_gen,
                                 'at', now(), 'error', f.error))
                     END,
            run_at = CASE WHEN f.state = 'pending' THEN now() + f.backoff_ms * interval '1 millisecond'
                          ELSE j.run_at END,
            finished_at = CASE WHEN f.state = 'pending' THEN NULL ELSE now() END,
            run_deadline = NULL,
            updated_at = now()
        FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::text[], $5::text[], $6::text[], $7::bigint[])
             AS f(id, dispatch_gen, attempt, state, result, error, backoff_ms)
        WHERE j.id = ANY (ARRAY(SELECT unnest($1::bigint[]))) AND j.id = f.id
          AND j.dispatch_gen = f.dispatch_gen
          AND j.attempts = f.attempt
          AND j.state::text = 'running'
        RETURNING j.id, j.dispatch_gen, j.attempts
        "#;

/// Records outcomes, guarded by the execution `(id, dispatch_gen, attempts)` and
/// `state = 'running'`: an execution that was rescued, taken over or dead-lettered meanwhile
/// records nothing. Returns the executions whose outcome was recorded.
///
/// Takes any executor: the pool for a batch of outcomes in one round trip, or the job's own
/// transaction so the handler's writes commit with its completion, or not at all.
///
/// A batch of successes only, the common case, goes through [`SUCCEED_SQL`], which sets four
/// columns and joins nothing; a mixed batch through [`FINISH_SQL`]. Both have the same guard.
pub async fn finish<'e>(executor: impl PgExecutor<'e>, finishes: &[Finish]) -> Result<Vec<Finished>, sqlx::Error> {
    finish_by_job(executor, by_job(finishes, stored_results(finishes))).await
}

/// [`finish`] of finishes [`by_job`], each success's result already serialized
/// ([`stored_results`]).
async fn finish_by_job<'e>(
    executor: impl PgExecutor<'e>,
    rows: Vec<(&Finish, Option<String>)>,
) -> Result<Vec<Finished>, sqlx::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    // SUCCEED_SQL finds each row's values by its position among the ids (see `start`), which
    // names one request per job. A job named twice (a stale and a current execution), found
    // next to itself once sorted, takes the joined statement, which takes any order.
    let ids = || rows.iter().map(|(finish, _)| finish.id);
    if each_job_once(ids(), std::iter::empty()) && rows.iter().all(|(_, result)| result.is_some()) {
        let (ids, gens, attempts, results) = success_arrays(rows);
        return sqlx::query_as(SUCCEED_SQL).bind(ids).bind(gens).bind(attempts).bind(results).fetch_all(executor).await;
    }
    let finishes = || rows.iter().map(|(finish, _)| *finish);
    let (ids, gens, attempts) = execution_arrays(finishes());
    let states: Vec<&str> = finishes()
        .map(|f| match f.outcome {
            Outcome::Succeeded { .. } => JobState::Succeeded.as_str(),
            Outcome::RetryLater { .. } => JobState::Pending.as_str(),
            Outcome::Failed { .. } => JobState::Failed.as_str(),
        })
        .collect();
    let errors: Vec<Option<String>> = finishes()
        .map(|f| match &f.outcome {
            Outcome::Succeeded { .. } => None,
            Outcome::RetryLater { error, .. } | Outcome::Failed { error } => Some(storable_error(error)),
        })
        .collect();
    let backoffs: Vec<i64> = finishes()
        .map(|f| match f.outcome {
            Outcome::RetryLater { backoff, .. } => millis(backoff),
            Outcome::Succeeded { .. } | Outcome::Failed { .. } => 0,
        })
        .collect();
    let results: Vec<Option<String>> = rows.into_iter().map(|(_, result)| result).collect();
    sqlx::query_as(FINISH_SQL)
        .bind(ids)
        .bind(gens)
        .bind(attempts)
        .bind(states)
        .bind(results)
        .bind(errors)
        .bind(backoffs)
        .fetch_all(executor)
        .await
}

/// One request of a worker's combined statement (see [`step`]): a fence or a finish.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Start(StartRequest),
    Finish(Finish),
}

/// The answer to a [`Step`]: the job started, or the outcome recorded.
#[derive(Debug, Clone, PartialEq)]
pub enum Done {
    Started(Started),
    Finished(Finished),
}

/// What a [`Step`] and its [`Done`] have in common: the execution they are about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKey {
    Start { id: JobId, dispatch_gen: i64 },
    Finish(Finished),
}

impl Started {
    /// This execution, as a finish names it.
    pub fn execution(&self) -> Finished {
        Finished { id: self.id, dispatch_gen: self.dispatch_gen, attempt: self.attempt }
    }
}

impl Finish {
    /// The execution this finish is for.
    pub fn execution(&self) -> Finished {
        Finished { id: self.id, dispatch_gen: self.dispatch_gen, attempt: self.attempt }
    }
}

impl Step {
    pub fn key(&self) -> StepKey {
        match self {
            Step::Start(r) => StepKey::Start { id: r.id, dispatch_gen: r.dispatch_gen },
            Step::Finish(f) => StepKey::Finish(f.execution()),
        }
    }
}

impl Done {
    pub fn key(&self) -> StepKey {
        match self {
            Done::Started(s) => StepKey::Start { id: s.id, dispatch_gen: s.dispatch_gen },
            Done::Finished(f) => StepKey::Finish(*f),
        }
    }

    pub fn started(self) -> Option<Started> {
        if let Done::Started(started) = self { Some(started) } else { None }
    }

    pub fn finished(self) -> Option<Finished> {
        if let Done::Finished(finished) = self { Some(finished) } else { None }
    }
}

/// The statement of [`step`]: [`SUCCEED_SQL`] over `$1..$4` and [`START_SQL`] over `$5..$7`,
/// each a data-modifying CTE of one statement, their rows in one result (public so that tests
/// can `EXPLAIN` it).
pub static STEP_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH finished AS ({SUCCEED_SQL}),
        started AS ({start})
        SELECT false AS started, id, dispatch_gen, attempts,
               NULL::int AS max_attempts, NULL::text AS kind, NULL::jsonb AS payload,
               NULL::text AS group_key, NULL::timestamptz AS run_deadline, NULL::float8 AS waited_ms
        FROM finished
        UNION ALL
        SELECT true, id, dispatch_gen, attempts, max_attempts, kind::text, payload, group_key::text, run_deadline,
               waited_ms
        FROM started",
        start = START_SQL.replace("$1", "$5").replace("$2", "$6").replace("$3", "$7"),
    )
});

/// The fences and the finishes of concurrent batches, in as few statements as they allow:
/// one, when there are both and the finishes are successes of jobs none of the fences names
/// (the common case: one batch's finish and the next batch's fence meet in the combiner);
/// otherwise [`start`] and [`finish`] one after the other. One statement makes one
/// synchronous commit where there were two, and the batches wait for one round trip.
///
/// The two `UPDATE`s of [`STEP_SQL`] run on one snapshot and cannot see each other's rows, so
/// a job named by both (a stale execution's finish and a newer message's fence) would be
/// updated by one of them only: such a batch takes two statements. Every guard is the one of
/// [`START_SQL`] and [`SUCCEED_SQL`], whose text the statement is built from.
pub async fn step(connection: &mut PgConnection, steps: Vec<Step>) -> Result<Vec<Done>, sqlx::Error> {
    let (mut starts, mut finishes) = (Vec::new(), Vec::new());
    for step in steps {
        match step {
            Step::Start(request) => starts.push(request),
            Step::Finish(finish) => finishes.push(finish),
        }
    }
    // Both sorted once, by job: the binary searches of the statements need it, and the jobs
    // named twice are found by walking the two lists side by side.
    let (starts, finishes) = (by_id(&starts), by_job(&finishes, stored_results(&finishes)));
    let one_statement = !starts.is_empty()
        && !finishes.is_empty()
        && finishes.iter().all(|(_, result)| result.is_some())
        && each_job_once(starts.iter().map(|r| r.id), finishes.iter().map(|(f, _)| f.id));
    if !one_statement {
        let mut done: Vec<Done> =
            start_sorted(&mut *connection, starts).await?.into_iter().map(Done::Started).collect();
        done.extend(finish_by_job(&mut *connection, finishes).await?.into_iter().map(Done::Finished));
        return Ok(done);
    }
    type Row = (
        bool,
        JobId,
        i64,
        i32,
        Option<i32>,
        Option<String>,
        Option<serde_json::Value>,
        Option<String>,
        Option<DateTime<Utc>>,
        Option<f64>,
    );
    let (ids, gens, attempts, results) = success_arrays(finishes);
    let (start_ids, start_gens, leases) = start_arrays(starts);
    let rows: Vec<Row> = sqlx::query_as(STEP_SQL.as_str())
        .bind(ids)
        .bind(gens)
        .bind(attempts)
        .bind(results)
        .bind(start_ids)
        .bind(start_gens)
        .bind(leases)
        .fetch_all(&mut *connection)
        .await?;
    rows.into_iter()
        .map(|(started, id, dispatch_gen, attempt, max_attempts, kind, payload, group_key, run_deadline, waited_ms)| {
            if !started {
                return Ok(Done::Finished(Finished { id, dispatch_gen, attempt }));
            }
            match (max_attempts, kind, payload, run_deadline, waited_ms) {
                (Some(max_attempts), Some(kind), Some(payload), Some(run_deadline), Some(waited_ms)) => {
                    Ok(Done::Started(Started {
                        id,
                        dispatch_gen,
                        attempt,
                        max_attempts,
                        kind,
                        payload,
                        group_key,
                        run_deadline,
                        waited_ms,
                    }))
                }
                _ => Err(sqlx::Error::Protocol(format!("started job {} came back without its columns", id.0))),
            }
        })
        .collect()
}

/// Whether no job is named twice in two lists of jobs, each in ascending order: within either
/// list or across them (a merge of the two, each id compared with the one before).
fn each_job_once(a: impl Iterator<Item = JobId>, b: impl Iterator<Item = JobId>) -> bool {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    let mut previous = None;
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x > y => b.next(),
            (Some(_), _) => a.next(),
            (None, _) => b.next(),
        };
        let Some(id) = next else { return true };
        if previous.replace(id) == Some(id) {
            return false;
        }
    }
}

/// Each success's result as `jsonb` accepts it; `None` for a retry or a failure.
fn stored_results(finishes: &[Finish]) -> Vec<Option<String>> {
    finishes
        .iter()
        .map(|f| match &f.outcome {
            Outcome::Succeeded { result } => Some(storable_json(result)),
            Outcome::RetryLater { .. } | Outcome::Failed { .. } => None,
        })
        .collect()
}

/// The longest error message a row keeps, in bytes. The history keeps one per attempt (up to
/// 1000), and a handler may return any string: a 50 MB error would otherwise be stored, and
/// sent back by every `rowq show`, for each attempt.
pub const MAX_ERROR_BYTES: usize = 16 * 1024;

/// The character Postgres cannot store in `text` or `jsonb`, valid in Rust strings and JSON.
const NUL: char = '\0';

/// `error` as a row can keep it: NUL characters replaced by U+FFFD, and cut at a character
/// boundary to [`MAX_ERROR_BYTES`], saying how much was cut. Without this, a handler error
/// containing a NUL would fail the whole batch's finish statement, and every job in it would
/// run again after its lease.
pub fn storable_error(error: &str) -> String {
    let mut text = if error.contains(NUL) { error.replace(NUL, "\u{fffd}") } else { error.to_string() };
    if text.len() > MAX_ERROR_BYTES {
        let total = text.len();
        let mut cut = MAX_ERROR_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str(&format!("… ({} of {total} bytes cut)", total - cut));
    }
    text
}

/// `result` serialized as `jsonb` accepts it: Postgres refuses the escape `\u0000`, which
/// serde_json writes for a NUL in any string or key; those become U+FFFD. (The check on the
/// serialized text also matches an escaped backslash followed by `u0000`; the walk then
/// changes nothing.)
pub fn storable_json(result: &serde_json::Value) -> String {
    let text = result.to_string();
    if !text.contains("\\u0000") {
        return text;
    }
    let mut cleaned = result.clone();
    replace_nul(&mut cleaned);
    cleaned.to_string()
}

fn replace_nul(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::String(text) if text.contains(NUL) => *text = text.replace(NUL, "\u{fffd}"),
        Value::Array(items) => items.iter_mut().for_each(replace_nul),
        Value::Object(map) => {
            let entries = std::mem::take(map);
            for (key, mut item) in entries {
                replace_nul(&mut item);
                map.insert(key.replace(NUL, "\u{fffd}"), item);
            }
        }
        _ => {}
    }
}

/// Of `jobs` (id and generation), those `running` in that generation: the worker's fence would
/// take them over (if their run deadline has passed), not start them.
pub async fn running_of(pool: &PgPool, jobs: &[(JobId, i64)]) -> Result<HashSet<(JobId, i64)>, sqlx::Error> {
    if jobs.is_empty() {
        return Ok(HashSet::new());
    }
    let ids: Vec<JobId> = jobs.iter().map(|(id, _)| *id).collect();
    let running: Vec<(JobId, i64)> =
        sqlx::query_as("SELECT id, dispatch_gen FROM rowq.jobs WHERE id = ANY($1) AND state = 'running'")
            .bind(&ids)
            .fetch_all(pool)
            .await?;
    Ok(running.into_iter().filter(|job| jobs.contains(job)).collect())
}

/// A job whose message [`dead_letter`] took: failed, or dispatched again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLettered {
    /// The state it was in.
    pub from: JobState,
    /// The state it is in now: `failed`, or `pending` for a job no worker had started.
    pub to: JobState,
    /// Its group, whose next job may now go (when it failed).
    pub group_key: Option<String>,
    /// Its kind, for the DLQ handler's metrics.
    pub kind: String,
}

from_row!(DeadLettered { from = "before_state", to = "state", group_key, kind });

/// The DLQ's transition for the dead-lettered generation, with `reason` in the job's error
/// history: `running → failed` (the job's last attempt, as `last_error` too), and
/// `dispatched → pending` with no attempt spent. A job still `dispatched` had not been started
/// by any worker: what failed its message, delivery after delivery, was no execution of it
/// (the worker could not reach the database, or had no time left), so it is no poison job,
/// and it goes back to be dispatched again, as a rescue would once its lease ran out (unless
/// its attempts are somehow used up: then `failed`). Terminal rows and rows of a newer
/// generation are left alone (`None`).
pub async fn dead_letter(
    pool: &PgPool,
    id: JobId,
    dispatch_gen: i64,
    reason: &str,
) -> Result<Option<DeadLettered>, sqlx::Error> {
    sqlx::query_as(
        r#"
        UPDATE rowq.jobs j
        SET state = CASE WHEN before.failed THEN 'failed'::rowq.job_state ELSE 'pending' END,
            last_error = CASE WHEN before.failed THEN $3 ELSE j.last_error END,
            errors = j.errors || jsonb_build_array(jsonb_build_object(
                       'attempt', j.attempts, 'dispatch_gen', j.dispatch_gen, 'at', now(),
                       'error', CASE WHEN before.failed THEN $3::text
                                     ELSE $3::text || '; no worker had started it: dispatched again' END)),
            finished_at = CASE WHEN before.failed THEN now() END,
            dispatch_deadline = NULL,
            run_deadline = NULL,
            updated_at = now()
        FROM (SELECT state, state = 'running' OR attempts >= max_attempts AS failed
              FROM rowq.jobs WHERE id = $1 FOR UPDATE) AS before
        WHERE j.id = $1 AND j.dispatch_gen = $2 AND j.state IN ('dispatched', 'running')
        RETURNING before.state AS before_state, j.state, j.group_key, j.kind
        "#,
    )
    .bind(id)
    .bind(dispatch_gen)
    .bind(storable_error(reason))
    .fetch_optional(pool)
    .await
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_job_named_twice_is_found_within_either_sorted_list_and_across_them() {
        let ids = |ids: &[i64]| ids.iter().map(|&id| JobId(id)).collect::<Vec<_>>().into_iter();
        assert!(each_job_once(ids(&[1, 4, 9]), ids(&[2, 3, 10])));
        assert!(each_job_once(ids(&[]), ids(&[])));
        assert!(each_job_once(ids(&[5]), ids(&[])));
        assert!(!each_job_once(ids(&[1, 4, 4]), ids(&[2])), "twice in the first");
        assert!(!each_job_once(ids(&[1]), ids(&[2, 7, 7])), "twice in the second");
        assert!(!each_job_once(ids(&[1, 4, 9]), ids(&[2, 9])), "once in each, last");
        assert!(!each_job_once(ids(&[3]), ids(&[1, 3, 5])), "once in each, in the middle");
    }

    #[test]
    fn a_nul_in_an_error_is_replaced_and_a_huge_error_is_cut_at_a_character_boundary() {
        assert_eq!(storable_error("bad\0byte"), "bad\u{fffd}byte");
        assert_eq!(storable_error("fine"), "fine");
        let huge = "é".repeat(MAX_ERROR_BYTES); // 2 bytes each
        let stored = storable_error(&huge);
        assert!(stored.starts_with(&"é".repeat(MAX_ERROR_BYTES / 2)), "kept the first 16 KiB");
        assert!(stored.ends_with(&format!("… ({} of {} bytes cut)", MAX_ERROR_BYTES, 2 * MAX_ERROR_BYTES)));
    }

    #[test]
    fn a_nul_anywhere_in_a_result_is_replaced_and_everything_else_kept() {
        let result = json!({"a\u{0}": ["x\u{0}y", 1, {"deep": "\u{0}"}], "b": "back\\u0000slash"});
        let stored: serde_json::Value = serde_json::from_str(&storable_json(&result)).unwrap();
        assert_eq!(stored, json!({"a\u{fffd}": ["x\u{fffd}y", 1, {"deep": "\u{fffd}"}], "b": "back\\u0000slash"}));
        assert!(!storable_json(&result).contains("\\u0000\""), "{}", storable_json(&result));
        assert_eq!(storable_json(&json!({"n": 1})), r#"{"n":1}"#);
    }
}
