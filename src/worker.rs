//! The worker: [`Worker::handle_batch`] takes an SQS batch (as Lambda delivers it) and returns
//! the partial batch response. Per record: decode → fence → run the handler by `kind` →
//! finish. The Lambda binary and the local event-source runner both call it.
//!
//! - A malformed body, a stale generation, or a duplicate is acknowledged (not retried).
//! - A job error is recorded in the row (retry with backoff, or `failed`); the message is
//!   acknowledged. Retries are the database's job, not SQS's.
//! - Only infrastructure failures (the database unreachable) become `batchItemFailures`,
//!   so SQS redelivers; the later records of the same message group fail with them, keeping
//!   FIFO order.
//! - Records of one message group run in order; different groups run concurrently.
//! - The fence of a batch is one statement; so is the finish of every job that did not write
//!   through its own transaction. A job that did is finished inside that transaction.
//!   Batches handled at the same time by one process (the local runner's pollers) share those
//!   statements, one batch's finish going with another's fence ([`crate::combine`],
//!   [`run::step`]), in one of [`LANES`] chains of statements chosen by the batch's poller.
//! - With `ROWQ_METRICS_NAMESPACE` set, each batch ends with metrics lines of what it did
//!   ([`crate::metrics::Tally`]): one per kind it ran, and one of the messages it did not run.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use aws_lambda_events::event::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent, SqsMessage};
use lambda_runtime::Diagnostic;
use rand::Rng;
use sqlx::PgPool;
use tokio::sync::{oneshot, watch};

use crate::combine::{self, Combiner};
use crate::config::WorkerConfig;
use crate::handlers::{JobContext, Registry, catching_panics};
use crate::job::{JobError, JobId, JobMessage, JobState};
use crate::metrics::{Tally, UNREGISTERED_KIND};
use crate::store::kept::{self, KeptConnections};
use crate::store::run::{self, Done, Finish, Finished, Outcome, StartRequest, Started, Step};

/// The SQS record attribute that names the FIFO message group.
pub const GROUP_ATTRIBUTE: &str = "MessageGroupId";

/// The SQS record attribute counting receives.
pub const RECEIVE_COUNT_ATTRIBUTE: &str = "ApproximateReceiveCount";

/// How many chains of combined statements one worker runs side by side: a batch's fences and
/// finishes go to the combiner of its poller's lane (`poller % LANES`). The lanes share the
/// worker's kept connections.
///
/// With one combiner, the local runner's pollers moved in lock-step: the one statement in
/// flight answered every batch at once, their handlers ran while Postgres had nothing of the
/// worker's to do, and their finishes and next fences came back together for the next
/// statement — a chain of one statement at a time, which left a third of two cores idle in a
/// drain (a second slot in the same combiner is never used: the batches all wait on the first).
/// Two lanes are two such chains out of phase: one's statement runs while the other's batches
/// are handled. Each statement holds half as many requests, so a drain commits twice as often.
/// In-memory drain, 8 pollers, on a machine with a 42 µs `fdatasync` where one lane missed the
/// drain target, in turns with the build before: 37.6–38.9k jobs/s against 31.3–37.8k, ratio
/// to the SQL floor 0.51–0.55 against 0.42–0.48 (BENCHMARKS.md, round 36). Three lanes gave no
/// more and four cost more CPU than they gained; lanes taken in turn by batch instead of by
/// poller split a batch's finish from its poller's next fence, and gained less.
///
/// A Lambda instance handles one batch at a time, always in lane 0; a lane's combiner task
/// starts when its first batch with a record to fence arrives, so a Lambda instance runs only
/// the one.
pub const LANES: usize = 2;

/// Pool, handlers and settings: built once per Lambda instance, shared by its invocations.
pub struct Worker {
    pool: PgPool,
    registry: Registry,
    config: WorkerConfig,
    /// Fences and finishes of concurrent batches, combined ([`run::step`]): one combiner per
    /// lane ([`LANES`]), started by the lane's first batch.
    lanes: [OnceLock<Combiner<Step, Done>>; LANES],
    /// The connections the lanes' statements keep between them, shared by the lanes.
    kept: Arc<KeptConnections>,
    /// The schedulers' wake-up after a job of a group ended, sent from a task of its own for
    /// the batches of a process that holds several at once ([`GroupWake::Background`]),
    /// started by the first such wake.
    group_waker: OnceLock<Coalesced>,
}

/// A task that runs an action each time it is asked to, one run at a time, folding the asks
/// that come while a run is on its way into one more run after it: every ask is followed by a
/// run that starts after it, and a burst of asks costs at most two. The task ends when this is
/// dropped.
struct Coalesced {
    /// How many asks were made: the task wakes on each change, and one change seen stands for
    /// every ask made before it was seen.
    asked: watch::Sender<u64>,
    /// How many of them a finished run started after.
    answered: watch::Receiver<u64>,
}

impl Coalesced {
    /// Starts the task (on the current Tokio runtime), which runs `action` when asked.
    fn spawn<F, Fut>(action: F) -> Self
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (asked, mut asks) = watch::channel(0);
        let (answer, answered) = watch::channel(0);
        tokio::spawn(async move {
            // Ends when the sender is dropped. Asks made during a run mark a change, seen by the
            // next turn: one more run, after them all.
            while asks.changed().await.is_ok() {
                let covered = *asks.borrow_and_update();
                action().await;
                answer.send_replace(covered);
            }
        });
        Coalesced { asked, answered }
    }

    /// Asks for a run, without waiting for it.
    fn ask(&self) {
        self.asked.send_modify(|made| *made += 1);
    }

    /// Waits until every ask made before this call has been followed by a finished run.
    async fn flush(&self) {
        let made = *self.asked.borrow();
        // An error: the task is gone (it panicked), and no run will come.
        let _ = self.answered.clone().wait_for(|&covered| covered >= made).await;
    }
}

/// The longest [`Worker::settle`] waits for the last wakes of a stopping process: a wake takes
/// a millisecond or so, and one that cannot be sent meanwhile (the database gone, the pool
/// waiting out its acquire timeout) would only hold up the process's end, for what the
/// schedulers' poll (500 ms by default) makes up for anyway.
pub const SETTLE_WITHIN: Duration = Duration::from_secs(1);

/// How a batch wakes the schedulers once a job of a group has ended (its group's next job may
/// go, and that sends no `NOTIFY` of its own).
///
/// A Lambda instance sends the wake itself, before the batch's answer: the environment may be
/// frozen as soon as the answer is sent, and a wake left to another task could wait there for
/// the next invocation, its group with it. A process holding several batches at once (the
/// local event source's pollers, `rowq work`) lives on between them, and hands the wake to a
/// task of the worker's ([`Worker::wake_for_groups`]): awaited by the batch, its round trip
/// came between the finish and the poller's next batch, which then missed the statement that
/// would have carried its fence with another batch's finish. In-memory drain of 20,000 jobs in
/// groups of about four, five pairs in turns: 10.8–14.7k jobs/s against 8.8–12.0k, the wakes
/// 2,003 → 492 and the fences and finishes sent apart 466 → 74 (docs/benchmarks-log.md, round
/// 47).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GroupWake {
    Await,
    Background,
}

/// What the rounds of one batch share.
struct Batch<'a> {
    /// The combiner of the batch's lane: its fences and finishes.
    steps: &'a Combiner<Step, Done>,
    /// When the invocation ends.
    deadline: Instant,
    /// How a job of a group that ended wakes the schedulers.
    wake: GroupWake,
}

/// A record this worker will act on.
#[derive(Debug, Clone)]
struct Record {
    message_id: String,
    message: JobMessage,
    /// How many times SQS has delivered it (`ApproximateReceiveCount`), 1 when not said.
    received: u32,
}

impl Record {
    /// The job and generation its message names.
    fn job(&self) -> (JobId, i64) {
        (self.message.job_id, self.message.dispatch_gen)
    }

    /// The fence of the job its message names, leased for `lease`.
    fn fence(&self, lease: Duration) -> Step {
        Step::Start(StartRequest { id: self.message.job_id, dispatch_gen: self.message.dispatch_gen, lease })
    }
}

/// How one execution ended.
struct Execution {
    record: Record,
    job: Started,
    outcome: Outcome,
    recorded: Recorded,
    /// How long the handler ran, until it returned or timed out.
    ran_for: Duration,
    /// Whether this worker has a handler for the job's kind.
    kind_known: bool,
}

impl Execution {
    /// The `Kind` this execution counts under in the metrics: its job's, or
    /// [`UNREGISTERED_KIND`] when this worker has no handler for it, so that producers cannot add
    /// metrics by writing new kinds.
    fn metrics_kind(&self) -> &str {
        if self.kind_known { &self.job.kind } else { UNREGISTERED_KIND }
    }
}

/// Whether an execution's outcome is in the row yet.
enum Recorded {
    /// Not yet: it goes into the round's one batched finish.
    Pending,
    /// Committed inside the job's own transaction, with the handler's writes.
    Committed,
    /// The execution was superseded meanwhile; its transaction was rolled back.
    Superseded,
    /// The database failed while committing: SQS must redeliver.
    Failed(sqlx::Error),
}

impl Worker {
    /// The combined statements run on connections of `pool` that the lanes keep between
    /// back-to-back statements ([`KeptConnections`]): at most one per statement in flight, never
    /// the whole pool, and none for longer than [`kept::KEEP_FOR`] unused.
    pub fn new(pool: PgPool, registry: Registry, config: WorkerConfig) -> Self {
        let most = combine::STATEMENTS_IN_FLIGHT * LANES;
        let kept = Arc::new(KeptConnections::new(pool.clone(), most, kept::KEEP_FOR));
        Worker { pool, registry, config, lanes: Default::default(), kept, group_waker: OnceLock::new() }
    }

    /// Wakes the schedulers for the next job of a group whose job ended, as `wake` says: now, or
    /// by the worker's task ([`Coalesced`]: one `NOTIFY` at a time, and one more after those
    /// asked for while one was on its way, so that each wake comes after the commit it is for).
    async fn wake_for_groups(&self, wake: GroupWake) {
        async fn wake_now(pool: PgPool) {
            if let Err(error) = crate::store::wake_schedulers(&pool, "group").await {
                tracing::warn!(error = %error, "could not notify schedulers of group progress; they will poll");
            }
        }
        match wake {
            GroupWake::Await => wake_now(self.pool.clone()).await,
            GroupWake::Background => {
                let pool = &self.pool;
                self.group_waker
                    .get_or_init(|| {
                        let pool = pool.clone();
                        Coalesced::spawn(move || wake_now(pool.clone()))
                    })
                    .ask();
            }
        }
    }

    /// Waits until the schedulers' wake-ups handed to the worker's task ([`GroupWake::Background`])
    /// have been sent, for [`SETTLE_WITHIN`] at most. A process that stops calls it after its
    /// last batch: a wake still waiting there was lost with the process, and the group's next
    /// job waited for a scheduler's poll.
    pub async fn settle(&self) {
        let Some(waker) = self.group_waker.get() else { return };
        if tokio::time::timeout(SETTLE_WITHIN, waker.flush()).await.is_err() {
            tracing::warn!(
                waited_ms = SETTLE_WITHIN.as_millis() as u64,
                "the schedulers' last wake for groups was not sent in time; they will poll"
            );
        }
    }

    /// The combiner of `poller`'s lane, started (a task on the current Tokio runtime) by the
    /// lane's first batch.
    fn lane(&self, poller: usize) -> &Combiner<Step, Done> {
        self.lanes[poller % LANES].get_or_init(|| {
            let kept = self.kept.clone();
            Combiner::spawn(Step::key, Done::key, move |steps| {
                let kept = kept.clone();
                async move {
                    let mut connection = crate::secret::once_more_if_rotated(|| kept.take()).await?;
                    let done = run::step(&mut connection, steps).await?;
                    kept.keep(connection);
                    Ok(done)
                }
            })
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Where this worker reports its metrics, if anywhere (the DLQ handler beside it reports
    /// there too).
    pub fn metrics(&self) -> Option<&crate::config::MetricsTarget> {
        self.config.metrics.as_ref()
    }

    /// Handles one SQS batch; `deadline` is when the invocation ends (Lambda's deadline).
    pub async fn handle_batch(&self, event: SqsEvent, deadline: Instant) -> SqsBatchResponse {
        self.handle_batch_then(event, deadline, 0, None).await
    }

    /// [`handle_batch`](Self::handle_batch), saying on `ran` when the batch's last handlers
    /// have returned, before their outcomes are recorded (or dropping it unsent when the batch
    /// ends otherwise). A poller that holds several batches in one process (the local event
    /// source) takes its next batch then: its fence can meet this batch's finish in the
    /// combiner, one statement and one commit for both, and no more than one batch of its
    /// handlers runs at a time. `poller` names who delivered the batch: each poller's batches
    /// use the statements of its own lane ([`LANES`]). With `ran` the process lives on between
    /// batches, and the schedulers' wake after a job of a group ended is sent by a task of the
    /// worker's, not awaited by the batch ([`GroupWake`]).
    pub async fn handle_batch_then(
        &self,
        event: SqsEvent,
        deadline: Instant,
        poller: usize,
        mut ran: Option<oneshot::Sender<()>>,
    ) -> SqsBatchResponse {
        let mut tally = if self.config.metrics.is_some() { Tally::default() } else { Tally::messages_only() };
        let groups = group_records(event.records, &mut tally);
        if groups.is_empty() {
            self.print_metrics(&tally); // malformed or duplicate records, if any
            return batch_response(Vec::new()); // nothing to fence: no lane is started for it
        }
        let wake = if ran.is_some() { GroupWake::Background } else { GroupWake::Await };
        let batch = Batch { steps: self.lane(poller), deadline, wake };
        let mut failures: Vec<String> = Vec::new();
        let mut cursors = vec![0usize; groups.len()];
        let mut failed_groups = vec![false; groups.len()];
        loop {
            // This round: the next record of every group that has one and has not failed.
            let round: Vec<(usize, Record)> = groups
                .iter()
                .enumerate()
                .filter(|(g, _)| !failed_groups[*g])
                .filter_map(|(g, records)| records.get(cursors[g]).map(|r| (g, r.clone())))
                .collect();
            if round.is_empty() {
                break;
            }
            for (g, _) in &round {
                cursors[*g] += 1;
            }
            let last = groups.iter().enumerate().all(|(g, records)| failed_groups[g] || cursors[g] >= records.len());
            let ran = if last { ran.take() } else { None };
            for failed in self.run_round(&batch, &round, ran, &mut tally).await {
                failed_groups[failed] = true;
            }
        }
        // Every record of a failed group from its failure on is reported failed.
        for (g, records) in groups.iter().enumerate() {
            if failed_groups[g] {
                let first_failed = cursors[g] - 1;
                failures.extend(records[first_failed..].iter().map(|r| r.message_id.clone()));
            }
        }
        tally.returned = failures.len() as u32;
        self.print_metrics(&tally);
        batch_response(failures)
    }

    /// Prints the batch's [`Tally`] as metrics lines ([`crate::metrics`]) when metrics are
    /// configured: every record of a batch is counted once, so only an event with no records
    /// prints none.
    fn print_metrics(&self, tally: &Tally) {
        let Some(target) = &self.config.metrics else { return };
        crate::metrics::print(&crate::metrics::outcomes_lines(
            &target.namespace,
            &target.queue,
            tally,
            SystemTime::now(),
        ));
    }

    /// Fences, runs and finishes one record per group, saying on `ran` when the handlers have
    /// returned. Returns the groups that hit an infrastructure failure.
    async fn run_round(
        &self,
        batch: &Batch<'_>,
        round: &[(usize, Record)],
        mut ran: Option<oneshot::Sender<()>>,
        tally: &mut Tally,
    ) -> Vec<usize> {
        let every_group = || round.iter().map(|(g, _)| *g).collect();
        let Some(lease) = self.lease_within(batch.deadline, round.len()) else {
            return every_group();
        };
        // Records delivered before whose jobs are `running`: take-overs, run one at a time
        // after the others ([`Self::run_one_at_a_time`]).
        let redelivered: Vec<(JobId, i64)> =
            round.iter().filter(|(_, r)| r.received > 1).map(|(_, r)| r.job()).collect();
        let read = || run::running_of(&self.pool, &redelivered);
        let running = match crate::secret::once_more_if_rotated(read).await {
            Ok(running) => running,
            Err(error) => {
                crate::secret::note(&error);
                tracing::error!(error = %error, records = round.len(), "could not read the jobs of redelivered records: database unavailable; records will be redelivered");
                return every_group();
            }
        };
        let (later, now): (Vec<_>, Vec<_>) = round.iter().partition(|(_, r)| running.contains(&r.job()));
        let started = match batch.steps.call(now.iter().map(|(_, r)| r.fence(lease)).collect()).await {
            Ok(done) => done.into_iter().filter_map(Done::started),
            Err(error) => {
                crate::secret::note(&error);
                tracing::error!(error = %error, records = round.len(), "could not start jobs: database unavailable; records will be redelivered");
                return every_group();
            }
        };
        let mut by_job: HashMap<(JobId, i64), Started> =
            started.into_iter().map(|job| ((job.id, job.dispatch_gen), job)).collect();
        let mut group_of: HashMap<String, usize> = HashMap::new();
        let mut runs = Vec::new();
        for (g, record) in &now {
            group_of.insert(record.message_id.clone(), *g);
            match by_job.remove(&record.job()) {
                Some(job) => {
                    log_started(&job, record, JobState::Dispatched);
                    runs.push(self.execute((*record).clone(), job, batch.deadline));
                }
                None => log_stale(record, tally),
            }
        }
        for (g, record) in &later {
            group_of.insert(record.message_id.clone(), *g);
        }
        let executions = futures::future::join_all(runs).await;
        let mut say_ran = |last: bool| {
            if last && let Some(ran) = ran.take() {
                let _ = ran.send(());
            }
        };
        say_ran(later.is_empty());
        let mut failed_records = self.record_outcomes(batch, executions, tally).await;
        let later = later.into_iter().map(|(_, record)| record.clone()).collect();
        failed_records.extend(self.run_one_at_a_time(batch, later, say_ran, tally).await);
        failed_records.iter().filter_map(|id| group_of.get(id).copied()).collect()
    }

    /// The lease of a fence now: the longest a handler may run, within the time `deadline`
    /// leaves, plus the rescue grace; `None`, logged, when no time is left for `records`.
    fn lease_within(&self, deadline: Instant, records: usize) -> Option<Duration> {
        let left = deadline.saturating_duration_since(Instant::now());
        let remaining = left.saturating_sub(self.config.deadline_margin);
        if remaining.is_zero() {
            tracing::warn!(
                records,
                left_ms = left.as_millis() as u64,
                margin_ms = self.config.deadline_margin.as_millis() as u64,
                "no time left in this invocation; records will be redelivered"
            );
            return None;
        }
        let longest =
            self.registry.longest_timeout().map_or(self.config.job_timeout, |t| t.max(self.config.job_timeout));
        Some(longest.min(remaining) + self.config.rescue_grace)
    }

    /// Takes over, runs and records the jobs of `taken_over` one at a time, each fenced just
    /// before it runs and recorded before the next begins, and says on `say_ran(true)` when the
    /// last handler has returned. Returns the message ids whose outcome could not be recorded,
    /// or that were not run: no time was left, or an outcome before could not be recorded (the
    /// database gone: each further fence would fail too, on a database that does not answer
    /// only after the pool's acquire timeout).
    ///
    /// The execution before a take-over ended without an outcome: its worker was killed, or
    /// timed out, or a job beside it ended the process (memory, a crash in native code). Run
    /// side by side as on first delivery, such a job killed its batch-mates with it at every
    /// delivery, each a further attempt, until SQS gave up on all of them and the DLQ handler
    /// failed them together. One at a time, each one run before it is recorded; and the order
    /// turns round with every delivery (as given on odd receive counts, reversed on even), so
    /// that within two deliveries of a batch every other job has run before the one that kills.
    /// Fenced one by one, a job the invocation has no time left for spends no attempt.
    async fn run_one_at_a_time(
        &self,
        batch: &Batch<'_>,
        mut taken_over: Vec<Record>,
        mut say_ran: impl FnMut(bool),
        tally: &mut Tally,
    ) -> Vec<String> {
        let mut failed = Vec::new();
        let Some(first) = taken_over.first() else {
            return failed;
        };
        if first.received % 2 == 0 {
            taken_over.reverse();
        }
        tracing::warn!(
            records = taken_over.len(),
            "jobs to take over after their messages came back run one at a time, each recorded before the next"
        );
        let last = taken_over.len() - 1;
        for (i, record) in taken_over.into_iter().enumerate() {
            let execution = self.take_over(batch, record, &mut failed, tally).await;
            say_ran(i == last);
            if let Some(execution) = execution {
                failed.extend(self.record_outcomes(batch, vec![execution], tally).await);
            }
        }
        failed
    }

    /// Fences the job of `record` with a lease made now and runs it: `None` when it did not run,
    /// either handed back (no time left, an outcome before it already in `failed`, or the fence
    /// failed: its message id goes to `failed`) or stale (acknowledged).
    async fn take_over(
        &self,
        batch: &Batch<'_>,
        record: Record,
        failed: &mut Vec<String>,
        tally: &mut Tally,
    ) -> Option<Execution> {
        let lease = if failed.is_empty() { self.lease_within(batch.deadline, 1) } else { None };
        let Some(lease) = lease else {
            tracing::warn!(job.id = record.message.job_id.0, sqs.message_id = %record.message_id, "not run: no time left, or the database gone; the record will be redelivered");
            failed.push(record.message_id);
            return None;
        };
        let job = match batch.steps.call(vec![record.fence(lease)]).await {
            Ok(done) => done.into_iter().find_map(Done::started),
            Err(error) => {
                crate::secret::note(&error);
                tracing::error!(error = %error, sqs.message_id = %record.message_id, "could not start the job: database unavailable; the record will be redelivered");
                failed.push(record.message_id);
                return None;
            }
        };
        let Some(job) = job else {
            log_stale(&record, tally);
            return None;
        };
        log_started(&job, &record, JobState::Running);
        Some(self.execute(record, job, batch.deadline).await)
    }

    /// Runs one started job's handler under its timeout.
    async fn execute(&self, record: Record, mut job: Started, deadline: Instant) -> Execution {
        let timeout = self
            .registry
            .timeout_of(&job.kind)
            .unwrap_or(self.config.job_timeout)
            .min(deadline.saturating_duration_since(Instant::now()).saturating_sub(self.config.deadline_margin));
        let (ctx, slot) = JobContext::new(
            job.id,
            job.kind.clone(),
            job.attempt,
            job.max_attempts,
            Instant::now() + timeout,
            self.pool.clone(),
        );
        // The payload (up to 1 MiB) is moved to the handler, not copied; the row keeps it.
        let payload = std::mem::take(&mut job.payload);
        let began = Instant::now();
        let called = self.registry.call(&job.kind, ctx, payload);
        let kind_known = called.is_some();
        let result = match called {
            None => Err(JobError::permanent(format!(
                "unknown job kind {:?}: this worker has no handler for it (it knows: {})",
                job.kind,
                self.known_kinds()
            ))),
            Some(future) => match tokio::time::timeout(timeout, catching_panics(future)).await {
                Ok(result) => result,
                Err(_) => Err(JobError::retryable(format!("timed out after {} ms", timeout.as_millis()))),
            },
        };
        let ran_for = began.elapsed();
        let tx = slot.take().await;
        let outcome = match result {
            Ok(result) => Outcome::Succeeded { result },
            Err(error) if error.is_retryable() && job.attempt < job.max_attempts => Outcome::RetryLater {
                backoff: error
                    .asked_delay()
                    .unwrap_or_else(|| backoff(job.attempt, self.config.backoff_base, self.config.backoff_max)),
                error: error.to_string(),
            },
            Err(JobError::Retryable(error) | JobError::RetryAfter(error, _)) => Outcome::Failed {
                error: format!("{error} (attempt {} of {}: no attempts left)", job.attempt, job.max_attempts),
            },
            Err(JobError::Permanent(error)) => Outcome::Failed { error },
        };
        // A job that wrote through its transaction is finished inside it, at once, so the
        // connection goes back to the pool for the rest of the batch. A failed attempt's
        // writes are discarded: only a success commits.
        let recorded = match tx {
            Some(mut tx) if matches!(outcome, Outcome::Succeeded { .. }) => {
                match run::finish(&mut *tx, &[finish_of(&job, &outcome)]).await {
                    Ok(recorded) if recorded.is_empty() => Recorded::Superseded, // dropped: rolled back
                    Ok(_) => match tx.commit().await {
                        Ok(()) => Recorded::Committed,
                        Err(error) => Recorded::Failed(error),
                    },
                    Err(error) => Recorded::Failed(error),
                }
            }
            _ => Recorded::Pending,
        };
        Execution { record, job, outcome, recorded, ran_for, kind_known }
    }

    fn known_kinds(&self) -> String {
        let mut kinds: Vec<&str> = self.registry.kinds().collect();
        kinds.sort_unstable();
        kinds.join(", ")
    }

    /// Records the outcomes not yet recorded in one statement, and logs and counts every outcome;
    /// wakes the schedulers, as the batch's `wake` says, when a job of a group ended. Returns the
    /// message ids whose outcome could not be recorded.
    async fn record_outcomes(&self, batch: &Batch<'_>, executions: Vec<Execution>, tally: &mut Tally) -> Vec<String> {
        let mut failed = Vec::new();
        let mut finished: Vec<&Execution> = Vec::new();
        let (pending, done): (Vec<&Execution>, Vec<&Execution>) =
            executions.iter().partition(|e| matches!(e.recorded, Recorded::Pending));

        let finishes: Vec<Finish> = pending.iter().map(|e| finish_of(&e.job, &e.outcome)).collect();
        match batch.steps.call(finishes.into_iter().map(Step::Finish).collect()).await {
            Ok(done) => {
                let recorded: HashSet<Finished> = done.into_iter().filter_map(Done::finished).collect();
                for execution in pending {
                    if recorded.contains(&execution.job.execution()) {
                        finished.push(execution);
                    } else {
                        report_superseded(execution, tally);
                    }
                }
            }
            Err(error) => {
                crate::secret::note(&error);
                tracing::error!(error = %error, jobs = pending.len(), "could not record outcomes: database unavailable; records will be redelivered");
                failed.extend(pending.iter().map(|e| e.record.message_id.clone()));
            }
        }
        for execution in done {
            match &execution.recorded {
                Recorded::Committed => finished.push(execution),
                Recorded::Superseded => report_superseded(execution, tally),
                Recorded::Failed(error) => {
                    tracing::error!(error = %error, job.id = execution.job.id.0, "could not commit the job's transaction; the record will be redelivered");
                    failed.push(execution.record.message_id.clone());
                }
                Recorded::Pending => {}
            }
        }

        for execution in &finished {
            report_finished(execution, tally);
        }
        let group_moved =
            finished.iter().any(|e| e.job.group_key.is_some() && !matches!(e.outcome, Outcome::RetryLater { .. }));
        if group_moved {
            self.wake_for_groups(batch.wake).await;
        }
        failed
    }
}

/// Logs a job's fence: `from` the state it left.
fn log_started(job: &Started, record: &Record, from: JobState) {
    tracing::info!(
        job.id = job.id.0, job.kind = %job.kind, job.attempt = job.attempt,
        job.dispatch_gen = job.dispatch_gen, sqs.message_id = %record.message_id,
        job.from = from.as_str(), job.to = "running", "job started"
    );
}

/// Logs and counts a record whose fence matched nothing: it is acknowledged.
fn log_stale(record: &Record, tally: &mut Tally) {
    tally.stale += 1;
    tracing::info!(
        job.id = record.message.job_id.0, job.dispatch_gen = record.message.dispatch_gen,
        sqs.message_id = %record.message_id,
        "stale or duplicate message acknowledged: the job is not waiting for this generation"
    )
}

/// The finish that records `outcome` for the execution `job`.
fn finish_of(job: &Started, outcome: &Outcome) -> Finish {
    Finish { id: job.id, dispatch_gen: job.dispatch_gen, attempt: job.attempt, outcome: outcome.clone() }
}

/// Logs a recorded outcome and counts it in the batch's `tally`.
fn report_finished(execution: &Execution, tally: &mut Tally) {
    let job = &execution.job;
    match &execution.outcome {
        Outcome::Succeeded { .. } => {
            tally.execution(execution.metrics_kind(), job.waited_ms, execution.ran_for, |kind| &mut kind.succeeded);
            tracing::info!(
                job.id = job.id.0, job.kind = %job.kind, job.attempt = job.attempt, job.dispatch_gen = job.dispatch_gen,
                job.from = "running", job.to = "succeeded", "job succeeded"
            )
        }
        Outcome::RetryLater { error, backoff } => {
            tally.execution(execution.metrics_kind(), job.waited_ms, execution.ran_for, |kind| &mut kind.retried);
            tracing::warn!(
                job.id = job.id.0, job.kind = %job.kind, job.attempt = job.attempt, job.dispatch_gen = job.dispatch_gen,
                job.from = "running", job.to = "pending", backoff_ms = backoff.as_millis() as u64, error = %error,
                "job failed; will retry"
            )
        }
        Outcome::Failed { error } => {
            tally.execution(execution.metrics_kind(), job.waited_ms, execution.ran_for, |kind| &mut kind.failed);
            tracing::error!(
                job.id = job.id.0, job.kind = %job.kind, job.attempt = job.attempt, job.dispatch_gen = job.dispatch_gen,
                job.from = "running", job.to = "failed", error = %error, "job failed"
            )
        }
    }
}

/// Logs an execution whose outcome was discarded and counts it in the batch's `tally`.
fn report_superseded(execution: &Execution, tally: &mut Tally) {
    let job = &execution.job;
    tally.execution(execution.metrics_kind(), job.waited_ms, execution.ran_for, |kind| &mut kind.superseded);
    tracing::warn!(
        job.id = execution.job.id.0,
        job.attempt = execution.job.attempt,
        job.dispatch_gen = execution.job.dispatch_gen,
        "execution superseded (rescued, taken over or dead-lettered meanwhile): its outcome and writes are discarded"
    );
}

/// Decodes records, drops the ones that can never be valid (logged, and counted in `tally`), and
/// groups the rest by `MessageGroupId` in arrival order. A second record for the same job
/// generation in one batch is a duplicate and is acknowledged.
fn group_records(records: Vec<SqsMessage>, tally: &mut Tally) -> Vec<Vec<Record>> {
    let mut groups: Vec<Vec<Record>> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut seen: HashSet<(JobId, i64)> = HashSet::new();
    for raw in records {
        let Some((message_id, message)) = decode_record(&raw) else {
            tally.malformed += 1;
            continue;
        };
        if !seen.insert((message.job_id, message.dispatch_gen)) {
            tally.stale += 1;
            tracing::info!(sqs.message_id = %message_id, job.id = message.job_id.0, job.dispatch_gen = message.dispatch_gen, "duplicate message in batch acknowledged");
            continue;
        }
        // Standard queues have no group: each record is its own group.
        let group = raw.attributes.get(GROUP_ATTRIBUTE).cloned().unwrap_or_else(|| format!("\u{0}{message_id}"));
        let position = *index.entry(group).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        let received = raw.attributes.get(RECEIVE_COUNT_ATTRIBUTE).and_then(|n| n.parse().ok()).unwrap_or(1);
        groups[position].push(Record { message_id, message, received });
    }
    groups
}

/// A record's message id and job message, or `None` (logged) for a record that can never be
/// valid: it is acknowledged, as retrying it cannot help. Shared by the worker and the DLQ handler.
pub(crate) fn decode_record(raw: &SqsMessage) -> Option<(String, JobMessage)> {
    let Some(message_id) = raw.message_id.clone() else {
        tracing::error!("SQS record without a messageId acknowledged: it cannot be reported failed");
        return None;
    };
    match JobMessage::decode(raw.body.as_deref().unwrap_or_default()) {
        Ok(message) => Some((message_id, message)),
        Err(error) => {
            tracing::error!(sqs.message_id = %message_id, error = %error, "malformed message acknowledged and dropped");
            None
        }
    }
}

/// The partial batch response reporting `failed` message ids.
pub fn batch_response(failed: Vec<String>) -> SqsBatchResponse {
    let mut response = SqsBatchResponse::default();
    response.batch_item_failures = failed
        .into_iter()
        .map(|id| {
            let mut failure = BatchItemFailure::default();
            failure.item_identifier = id;
            failure
        })
        .collect();
    response
}

/// Whether `response` hands back every record of a batch of `records` (none acknowledged): what
/// a Lambda answers with a function error ([`lambda_answer`]) and a poller of the local event
/// source pauses after ([`crate::event_source`]).
pub fn hands_back_all(records: usize, response: &SqsBatchResponse) -> bool {
    records > 0 && response.batch_item_failures.len() >= records
}

/// What a Lambda on the SQS event source answers for a batch of `records` records: its
/// partial batch response, or a function error when that response hands back every record.
///
/// Both return the same records to the queue. But Lambda backs off after a function error,
/// reducing the concurrency of the event source mapping, and a response listing failed
/// records is a successful invocation: nothing slows. Every record comes back only when the
/// database could not be had (a refused login, no connection slot, a server starting up) or
/// the invocation had no time left; answered as a success, each such batch went back within
/// milliseconds and Lambda received the next at once, so a queue drained into invisibility for
/// the visibility timeout, a receive nearer the DLQ per message, while invocation after
/// invocation opened connections to a database trying to recover. (The local event source's
/// pollers pause instead: [`crate::event_source`].)
pub fn lambda_answer(records: usize, response: SqsBatchResponse) -> Result<SqsBatchResponse, Diagnostic> {
    if !hands_back_all(records, &response) {
        return Ok(response);
    }
    tracing::warn!(records, "every record handed back: answering with a function error so that Lambda backs off");
    Err(Diagnostic {
        error_type: "rowq::BatchHandedBack".into(),
        error_message: format!(
            "every record of the batch ({records}) handed back (the database could not be had, or no time was left); \
             they return to the queue as a partial batch response would return them"
        ),
    })
}

/// Exponential backoff with jitter for attempt `attempt` (1-based): a delay drawn uniformly
/// from [d/2, d], where d = base × 2^(attempt-1) capped at `max`.
pub fn backoff(attempt: i32, base: Duration, max: Duration) -> Duration {
    let exponent = u32::try_from(attempt.saturating_sub(1)).unwrap_or(0).min(32);
    let ceiling = base.saturating_mul(2u32.saturating_pow(exponent)).min(max);
    let half = ceiling / 2;
    let jitter_ms = rand::rng().random_range(0..=half.as_millis() as u64);
    half + Duration::from_millis(jitter_ms)
}

/// Epoch milliseconds of 2001-01-01: no real invocation deadline is earlier.
const PLAUSIBLE_EPOCH_MS: u64 = 978_307_200_000;

/// The Lambda deadline (`Lambda-Runtime-Deadline-Ms`, epoch milliseconds) as an `Instant`.
///
/// `cargo lambda watch` (1.9) sends the function timeout itself (e.g. `600000`) instead of an
/// epoch time; read as epoch it would leave no time at all, so a value that cannot be an epoch
/// deadline is taken as the time left.
pub fn deadline_from_epoch_millis(deadline_ms: u64) -> Instant {
    if deadline_ms < PLAUSIBLE_EPOCH_MS {
        return Instant::now() + Duration::from_millis(deadline_ms);
    }
    let deadline = SystemTime::UNIX_EPOCH + Duration::from_millis(deadline_ms);
    let remaining = deadline.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO);
    Instant::now() + remaining
}

/// Runs a worker as a Lambda function on the SQS event source. Library users call this from
/// their own `main` with their own registry.
pub async fn run_lambda(worker: Worker) -> Result<(), lambda_runtime::Error> {
    let worker = Arc::new(worker);
    lambda_runtime::run(lambda_runtime::service_fn(move |event: lambda_runtime::LambdaEvent<SqsEvent>| {
        let worker = worker.clone();
        async move {
            let deadline = deadline_from_epoch_millis(event.context.deadline);
            let records = event.payload.records.len();
            lambda_answer(records, worker.handle_batch(event.payload, deadline).await)
        }
    }))
    .await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tokio::sync::mpsc;

    use super::*;

    /// A worker whose database does not answer: every fence fails at once, and the test needs
    /// no server. Not `store::connect_lazy`: that pool waits out its 10 s acquire timeout on a
    /// refused connection, which made this test take 20 s instead of 0.4.
    fn unreachable_worker() -> Worker {
        worker_of("postgres://rowq@127.0.0.1:1/none", Duration::from_millis(200))
    }

    /// A worker of the database at `url`, whose pool waits `acquire` for a connection.
    fn worker_of(url: &str, acquire: Duration) -> Worker {
        let lookup = |name: &str| (name == "DATABASE_URL").then(|| url.to_string());
        let config = WorkerConfig::from(&crate::config::Env::new(&lookup)).unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new().acquire_timeout(acquire).connect_lazy(url).unwrap();
        Worker::new(pool, Registry::builtin(), config)
    }

    /// A [`Coalesced`] whose runs each say on the receiver returned that they started, then run
    /// `rest`.
    fn announcing<F, Fut>(rest: F) -> (Coalesced, mpsc::UnboundedReceiver<()>)
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (started, starts) = mpsc::unbounded_channel();
        let coalesced = Coalesced::spawn(move || {
            let (started, rest) = (started.clone(), rest());
            async move {
                let _ = started.send(());
                rest.await
            }
        });
        (coalesced, starts)
    }

    /// Asks that come while a run is on its way are folded into one run after it, and none is
    /// left without a run that starts after it.
    #[tokio::test]
    async fn asks_during_a_run_are_folded_into_one_run_after_it() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (coalesced, mut starts) = announcing({
            let gate = gate.clone();
            move || {
                let gate = gate.clone();
                // Held until let through.
                async move { gate.acquire().await.map(|permit| permit.forget()).unwrap() }
            }
        });
        let soon = Duration::from_secs(10);

        coalesced.ask();
        tokio::time::timeout(soon, starts.recv()).await.unwrap().unwrap();
        for _ in 0..5 {
            coalesced.ask(); // while the first run is on its way
        }
        gate.add_permits(1);
        tokio::time::timeout(soon, starts.recv()).await.expect("the asks during a run got no run after it").unwrap();
        gate.add_permits(1);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(starts.try_recv().is_err(), "five asks during a run made more than one run after it");

        coalesced.ask();
        gate.add_permits(1);
        tokio::time::timeout(soon, starts.recv()).await.expect("an ask after a quiet moment got no run").unwrap();
    }

    /// A flush returns once every ask made before it has been followed by a finished run: not
    /// before, and not on the end of a run that had begun before the last ask.
    #[tokio::test]
    async fn a_flush_waits_for_a_finished_run_after_every_ask_before_it() {
        let finished = Arc::new(AtomicU64::new(0));
        let (coalesced, mut starts) = announcing({
            let finished = finished.clone();
            move || {
                let finished = finished.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let soon = Duration::from_secs(10);
        let runs = || finished.load(Ordering::SeqCst);

        tokio::time::timeout(soon, coalesced.flush()).await.expect("a flush with nothing asked waited");
        assert_eq!(runs(), 0);

        coalesced.ask();
        tokio::time::timeout(soon, coalesced.flush()).await.unwrap();
        assert_eq!(runs(), 1, "the flush returned before the run after its ask had finished");

        coalesced.ask();
        tokio::time::timeout(soon, starts.recv()).await.unwrap().unwrap(); // the first run's start
        tokio::time::timeout(soon, starts.recv()).await.unwrap().unwrap(); // the second's: on its way
        coalesced.ask();
        tokio::time::timeout(soon, coalesced.flush()).await.unwrap();
        assert_eq!(runs(), 3, "the flush returned at the end of a run begun before its last ask");
    }

    /// A stopping process waits for its last group wake no longer than [`SETTLE_WITHIN`], even
    /// when the wake cannot get a connection (here a server that accepts and never answers,
    /// behind a pool that would wait a minute for it).
    #[tokio::test]
    async fn settling_does_not_wait_for_a_wake_the_database_does_not_answer() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = silent.local_addr().unwrap();
        let _held = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                held.push(stream); // open, unanswered
            }
        });
        let worker = worker_of(&format!("postgres://rowq@{address}/none"), Duration::from_secs(60));

        worker.wake_for_groups(GroupWake::Background).await;
        tokio::time::timeout(SETTLE_WITHIN * 10, worker.settle())
            .await
            .expect("settling waited for a wake the database will not answer");
    }

    #[tokio::test]
    async fn a_lane_starts_with_its_first_batch_so_lambda_runs_one_combiner() {
        let worker = unreachable_worker();
        let started = |worker: &Worker| worker.lanes.iter().map(|lane| lane.get().is_some()).collect::<Vec<_>>();
        let first = |n: usize| (0..LANES).map(|lane| lane < n).collect::<Vec<_>>();
        assert_eq!(started(&worker), first(0), "no combiner before a batch");
        let event = |id: &str, body: &str| {
            let mut event = SqsEvent::default();
            event.records = vec![record(id, Some("g"), body)];
            event
        };
        let deadline = Instant::now() + Duration::from_secs(30);

        let response = worker.handle_batch(event("m", "not a job message"), deadline).await;
        assert!(response.batch_item_failures.is_empty(), "a malformed record is acknowledged");
        assert_eq!(started(&worker), first(0), "a batch with nothing to fence starts no combiner");

        let response = worker.handle_batch(event("a", &body(1, 1)), deadline).await;
        assert_eq!(response.batch_item_failures.len(), 1, "the fence failed: SQS redelivers");
        assert_eq!(started(&worker), first(1), "Lambda's batches: lane 0 alone");

        worker.handle_batch_then(event("b", &body(1, 1)), deadline, LANES + 1, None).await;
        assert_eq!(started(&worker), first(2), "poller LANES + 1 is lane 1's");
    }

    fn record(id: &str, group: Option<&str>, body: &str) -> SqsMessage {
        let mut message = SqsMessage::default();
        message.message_id = Some(id.to_string());
        message.body = Some(body.to_string());
        if let Some(group) = group {
            message.attributes.insert(GROUP_ATTRIBUTE.to_string(), group.to_string());
        }
        message
    }

    fn body(job: i64, generation: i64) -> String {
        JobMessage::new(JobId(job), generation).encode()
    }

    #[test]
    fn records_are_grouped_by_message_group_in_arrival_order() {
        let mut tally = Tally::default();
        let groups = group_records(
            vec![
                record("a", Some("g1"), &body(1, 1)),
                record("b", Some("g2"), &body(2, 1)),
                record("c", Some("g1"), &body(3, 1)),
                record("d", None, &body(4, 1)),
                record("e", None, &body(5, 1)),
            ],
            &mut tally,
        );
        assert_eq!(tally, Tally::default());
        let ids: Vec<Vec<&str>> = groups.iter().map(|g| g.iter().map(|r| r.message_id.as_str()).collect()).collect();
        assert_eq!(ids, vec![vec!["a", "c"], vec!["b"], vec!["d"], vec!["e"]]);
    }

    #[test]
    fn malformed_and_duplicate_records_are_dropped_before_grouping_and_counted() {
        let mut tally = Tally::default();
        let groups = group_records(
            vec![
                record("a", Some("g1"), "not json"),
                record("b", Some("g1"), &body(1, 1)),
                record("c", Some("g1"), &body(1, 1)),
                record("d", Some("g1"), &body(1, 2)),
                record("e", Some("g1"), r#"{"v":9,"job_id":1,"dispatch_gen":1}"#),
            ],
            &mut tally,
        );
        let ids: Vec<&str> = groups.iter().flatten().map(|r| r.message_id.as_str()).collect();
        assert_eq!(ids, vec!["b", "d"]);
        assert_eq!((tally.malformed, tally.stale), (2, 1));
    }

    #[test]
    fn backoff_grows_exponentially_within_jitter_and_stops_at_the_ceiling() {
        let base = Duration::from_millis(1000);
        let max = Duration::from_secs(60);
        for _ in 0..200 {
            let first = backoff(1, base, max);
            assert!(first >= Duration::from_millis(500) && first <= Duration::from_millis(1000), "{first:?}");
            let fourth = backoff(4, base, max);
            assert!(fourth >= Duration::from_millis(4000) && fourth <= Duration::from_millis(8000), "{fourth:?}");
            let late = backoff(40, base, max);
            assert!(late >= Duration::from_secs(30) && late <= max, "{late:?}");
        }
    }

    #[test]
    fn lambda_deadline_in_the_past_leaves_no_time() {
        let an_hour_ago = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap() - Duration::from_secs(3600);
        let deadline = deadline_from_epoch_millis(an_hour_ago.as_millis() as u64);
        assert!(deadline <= Instant::now());
    }

    #[test]
    fn lambda_deadline_in_the_future_leaves_the_time_until_it() {
        let in_a_minute = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap() + Duration::from_secs(60);
        let left = deadline_from_epoch_millis(in_a_minute.as_millis() as u64) - Instant::now();
        assert!(left > Duration::from_secs(58) && left <= Duration::from_secs(60), "{left:?}");
    }

    #[test]
    fn an_emulator_deadline_that_is_a_timeout_is_read_as_time_left() {
        let left = deadline_from_epoch_millis(600_000) - Instant::now();
        assert!(left > Duration::from_secs(590) && left <= Duration::from_secs(600), "{left:?}");
    }
}
