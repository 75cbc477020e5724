//! The scheduler: claim → publish → report, in a loop that wakes on `NOTIFY` (an insert, a
//! rescue, a group's progress), on the next `run_at`, and on a poll interval, with maintenance
//! (rescue, prune) running beside it. [`Scheduler::run_once`] is one pass, used by the loop, by `scheduler --once`
//! and by the tests.
//!
//! The claim commits before anything is sent: no transaction is held open across an SQS
//! call. A message that fails to publish puts its row back to `pending` (guarded by the
//! generation, no attempt consumed). A crash between claim and publish leaves `dispatched`
//! rows that maintenance rescues after their lease; their next claim gets a new generation.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::OptionFuture;
use futures::stream::FuturesUnordered;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::watch;

use crate::config::SchedulerConfig;
use crate::health::Health;
use crate::job::{JobId, JobMessage};
use crate::maintenance;
use crate::sqs::{EntryFailure, MAX_BATCH, Outgoing, Publisher, SqsError};
use crate::store::{self, dispatch::Claim, dispatch::Claimed};

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DispatchReport {
    /// Rows moved `pending → dispatched`.
    pub claimed: usize,
    /// Messages SQS accepted.
    pub published: usize,
    /// Rows put back to `pending` because their message was not accepted.
    pub released: usize,
    /// The in-flight cap left no room for (all of) a full batch.
    pub capped: bool,
    /// The pass's last claim took a full batch, set jobs aside behind their group, or only set
    /// aside (it took nothing by design): more may be due right now.
    pub full: bool,
    /// Jobs the claims found waiting behind an unfinished earlier job of their group and set
    /// aside, so that no claim reads them again until they can run (docs/DESIGN.md, 36).
    pub set_aside: usize,
    /// The first publish error of the pass, if any.
    pub publish_error: Option<String>,
    /// The earliest future `run_at` among pending rows when the claim ran.
    pub next_due: Option<chrono::DateTime<chrono::Utc>>,
    /// The queue is paused (`rowq pause`): the claim took nothing.
    pub paused: bool,
    /// `ROWQ_MAX_DISPATCH_RATE` held the claim to fewer rows than a batch, and it took all it
    /// was allowed (or it was allowed none): more may be due once the rate allows.
    pub rate_limited: bool,
}

/// A pass that could not complete: the database is unreachable or refused a statement.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("scheduler could not {action} for queue {queue:?}: {source}; it will retry")]
    Database { action: &'static str, queue: String, source: sqlx::Error },
}

/// Why [`Scheduler::run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Shutdown,
    DrainBudgetSpent,
    /// `--once`: nothing more was due.
    Drained,
}

/// Totals over a [`Scheduler::run`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunTotals {
    pub passes: u64,
    pub claimed: u64,
    pub published: u64,
    pub released: u64,
}

/// How long to back off after a failure, doubling up to a ceiling.
const ERROR_BACKOFF_MIN: Duration = Duration::from_millis(100);
const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(10);

pub struct Scheduler<P> {
    pool: PgPool,
    publisher: P,
    config: SchedulerConfig,
    /// When the cleanup may next be checked ([`Scheduler::check_cleanup`]).
    cleanup_check: NotBefore,
    /// When the metrics may next be reported ([`Scheduler::report_metrics`]).
    metrics_report: NotBefore,
    /// `ROWQ_MAX_DISPATCH_RATE`, when set.
    rate: Option<DispatchRate>,
    /// What the loop last did, for the health endpoint ([`crate::health`]).
    health: std::sync::Arc<Health>,
    /// Nonzero when the next claim only sets aside (its claim `LIMIT 0`), reading this many
    /// claimable jobs for those behind their group ([`store::dispatch::claim_setting_aside`]):
    /// the last claim found half of what it read or more to set aside, the front of a group's
    /// backlog not yet set aside. A claim reads past every such job it does not set aside, so
    /// claiming beside the setting aside would read the rest of the backlog again at every step
    /// (docs/DESIGN.md, 36).
    set_aside_window: AtomicU32,
}

/// What one claim asked for ([`Scheduler::claim`]): the rows it was allowed to take, and how many
/// claimable jobs it read to set aside those behind their group (0: as many as it could take).
#[derive(Debug, Clone, Copy)]
struct Asked {
    allowed: u32,
    window: u32,
}

/// A token bucket of claimed rows for `ROWQ_MAX_DISPATCH_RATE`. It holds a tenth of a
/// second's worth of rows (one at least), so that a limited backlog goes out in about ten
/// claims a second, each as large as that, rather than one claim per job.
struct DispatchRate {
    per_sec: f64,
    capacity: f64,
    /// Tokens, and when they were counted.
    bucket: std::sync::Mutex<(f64, Instant)>,
}

impl DispatchRate {
    fn new(per_sec: u32) -> Self {
        let per_sec = f64::from(per_sec);
        let capacity = (per_sec / 10.0).max(1.0);
        DispatchRate { per_sec, capacity, bucket: std::sync::Mutex::new((capacity, Instant::now())) }
    }

    /// The tokens at `now`, after adding what accrued since they were last counted.
    fn refilled(&self, now: Instant) -> std::sync::MutexGuard<'_, (f64, Instant)> {
        let mut bucket = self.bucket.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let accrued = now.saturating_duration_since(bucket.1).as_secs_f64() * self.per_sec;
        bucket.0 = (bucket.0 + accrued).min(self.capacity);
        bucket.1 = bucket.1.max(now);
        bucket
    }

    /// Takes up to `want` whole tokens; returns how many it took.
    fn take(&self, want: u32) -> u32 {
        self.take_at(want, Instant::now())
    }

    fn take_at(&self, want: u32, now: Instant) -> u32 {
        let mut bucket = self.refilled(now);
        // In [0, capacity], and the capacity is at most 100,000: the cast neither wraps nor cuts.
        let granted = (bucket.0.floor() as u32).min(want);
        bucket.0 -= f64::from(granted);
        granted
    }

    /// Returns what a claim was allowed and did not take.
    fn give_back(&self, unused: u32) {
        let mut bucket = self.refilled(Instant::now());
        bucket.0 = (bucket.0 + f64::from(unused)).min(self.capacity);
    }

    /// How long until the bucket is full again: the wait between two limited claims.
    fn until_full(&self) -> Duration {
        self.until_full_at(Instant::now())
    }

    fn until_full_at(&self, now: Instant) -> Duration {
        let bucket = self.refilled(now);
        Duration::from_secs_f64((self.capacity - bucket.0).max(0.0) / self.per_sec)
    }
}

/// The earliest time something periodic may run again; at first, at once.
#[derive(Default)]
struct NotBefore(std::sync::Mutex<Option<Instant>>);

impl NotBefore {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn passed(&self) -> bool {
        self.slot().is_none_or(|at| Instant::now() >= at)
    }

    fn defer(&self, interval: Duration) {
        *self.slot() = Some(Instant::now() + interval);
    }
}

/// The health of a scheduler of `config`'s dispatch loop. Idle, the loop beats once per poll
/// interval: three missed are a stuck loop.
pub fn loop_health(config: &SchedulerConfig) -> std::sync::Arc<Health> {
    std::sync::Arc::new(Health::new("dispatch", config.poll_interval * 3))
}

impl<P: Publisher> Scheduler<P> {
    pub fn new(pool: PgPool, publisher: P, config: SchedulerConfig) -> Self {
        let health = loop_health(&config);
        Self::with_health(pool, publisher, config, health)
    }

    /// [`Scheduler::new`] reporting to `health`, which the process may have served while it
    /// connected and migrated ([`loop_health`], [`Health::starting`]).
    pub fn with_health(pool: PgPool, publisher: P, config: SchedulerConfig, health: std::sync::Arc<Health>) -> Self {
        let rate = config.max_dispatch_rate.map(DispatchRate::new);
        Scheduler {
            pool,
            publisher,
            config,
            cleanup_check: NotBefore::default(),
            metrics_report: NotBefore::default(),
            rate,
            health,
            set_aside_window: AtomicU32::new(0),
        }
    }

    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// One pass: claim up to a batch of due rows (within the in-flight cap), publish them in
    /// `SendMessageBatch` calls of up to 10 with several in flight, release what failed.
    pub async fn run_once(&self) -> Result<DispatchReport, DispatchError> {
        match self.pass(None, || false).await {
            (_, Some(error)) => Err(error),
            (report, None) => Ok(report),
        }
    }

    /// Claims and publishes: one claim, then claim after claim while each comes back full and
    /// `keep_claiming()` says yes. Returns what it did, and the first database error, after
    /// which it claims no more.
    ///
    /// Claiming overlaps publishing: the next claim runs while the rows of the previous ones
    /// are being sent, and up to `publish_concurrency` `SendMessageBatch` calls stay in flight
    /// across claims, so no claim waits for the slowest call of the one before. A claim starts
    /// only while fewer than a claim's worth of rows wait to be sent: with a slow queue the
    /// claimed-but-unsent rows stay under two claims' worth, and their dispatch lease does not
    /// tick away in the scheduler's memory. After a failed send nothing more is claimed: the
    /// rows already claimed are still sent (or released), then the caller backs off.
    ///
    /// The first claim is on the pickup path of every job: when there is a listener, the
    /// notification arrived on its connection and the claims go back on it, with no pool
    /// checkout and no check-in ping (sqlx pings every connection returned to a pool, a round
    /// trip that competed with the worker's fence for the CPU just as the job was handed over).
    /// Notifications that arrive meanwhile are buffered by the listener.
    async fn pass(
        &self,
        listener: Option<&mut PgListener>,
        keep_claiming: impl Fn() -> bool,
    ) -> (DispatchReport, Option<DispatchError>) {
        let claim_batch = self.config.claim_batch as usize;
        let mut report = DispatchReport::default();
        let mut error = None;
        let mut listener = listener;
        let mut first = true;
        let mut claiming = std::pin::pin!(None);
        let mut unsent: VecDeque<Vec<Outgoing>> = VecDeque::new();
        let mut sends = FuturesUnordered::new();
        loop {
            while sends.len() < self.config.publish_concurrency {
                let Some(batch) = unsent.pop_front() else { break };
                sends.push(self.send(batch));
            }
            let waiting: usize = unsent.iter().map(Vec::len).sum();
            let healthy = report.publish_error.is_none() && error.is_none();
            if claiming.is_none() && waiting < claim_batch && (first || (healthy && report.full && keep_claiming())) {
                first = false;
                claiming.set(Some(self.claim(listener.take())));
            }
            if claiming.is_none() && sends.is_empty() && unsent.is_empty() {
                break;
            }
            tokio::select! {
                Some((returned, claim, asked)) = OptionFuture::from(claiming.as_mut().as_pin_mut()), if claiming.is_some() => {
                    claiming.set(None);
                    self.health.beat();
                    listener = returned;
                    match claim {
                        Ok(claim) => unsent.extend(self.claimed(claim, asked, &mut report)),
                        Err(source) => error = Some(self.db_error("claim due jobs", source)),
                    }
                }
                Some((batch, result)) = sends.next(), if !sends.is_empty() => {
                    self.health.beat();
                    let failed = self.sent(&batch, result, &mut report);
                    if let Err(release_error) = self.release(&failed, &mut report).await {
                        error.get_or_insert(release_error);
                    }
                }
            }
        }
        let failure = error.as_ref().map(ToString::to_string).or_else(|| report.publish_error.clone());
        self.health.record("pass", failure);
        (report, error)
    }

    fn db_error(&self, action: &'static str, source: sqlx::Error) -> DispatchError {
        crate::secret::note(&source);
        DispatchError::Database { action, queue: self.config.queue.clone(), source }
    }

    /// One claim, on the listener's connection when there is one, which it hands back, with
    /// what it asked for: the rows it was allowed to take (a batch, or fewer under
    /// `ROWQ_MAX_DISPATCH_RATE`) and its set-aside window. Allowed none, it still runs (`LIMIT
    /// 0`), so that what it reports, the pause included, is read.
    async fn claim<'l>(
        &self,
        listener: Option<&'l mut PgListener>,
    ) -> (Option<&'l mut PgListener>, Result<Claim, sqlx::Error>, Asked) {
        let (queue, cap, lease) = (&self.config.queue, self.config.max_in_flight, self.config.dispatch_lease);
        let window = self.set_aside_window.load(Ordering::Relaxed);
        let batch = match window {
            0 => self.rate.as_ref().map_or(self.config.claim_batch, |rate| rate.take(self.config.claim_batch)),
            _ => 0,
        };
        let (listener, claim) = match listener {
            Some(listener) => {
                let claim =
                    store::dispatch::claim_setting_aside(&mut *listener, queue, batch, cap, lease, window).await;
                (Some(listener), claim)
            }
            None => (None, store::dispatch::claim_setting_aside(&self.pool, queue, batch, cap, lease, window).await),
        };
        if let (Some(rate), Err(_)) = (&self.rate, &claim) {
            rate.give_back(batch);
        }
        (listener, claim, Asked { allowed: batch, window })
    }

    /// Adds a claim that `asked` so much to the report; returns its rows as the messages to send,
    /// in batches.
    fn claimed(&self, claim: Claim, asked: Asked, report: &mut DispatchReport) -> Vec<Vec<Outgoing>> {
        let Asked { allowed, window } = asked;
        let cap = self.config.max_in_flight;
        let jobs = claim.jobs;
        report.claimed += jobs.len();
        // A claim that set jobs aside read no further than them: what is claimable behind them
        // is for the next claim, at once, as after a full batch.
        let set_aside = usize::try_from(claim.set_aside).unwrap_or(0);
        report.set_aside += set_aside;
        // What the claim read to set aside: its window, or as many rows as it could take.
        let only = window > 0;
        let read = match window {
            0 => {
                let room = i64::from(cap).saturating_sub(claim.in_flight_before).clamp(0, i64::from(allowed));
                u32::try_from(room).unwrap_or(allowed)
            }
            window => window,
        };
        let (least, most) = (store::dispatch::SET_ASIDE_WINDOW, store::dispatch::SET_ASIDE_WINDOW_MAX);
        let next = match set_aside > 0 && set_aside * 2 >= read as usize {
            true => read.saturating_mul(4).clamp(least, most),
            false => 0,
        };
        self.set_aside_window.store(next, Ordering::Relaxed);
        // And one that only set aside claimed nothing: a claim follows it at once.
        report.full = jobs.len() == self.config.claim_batch as usize || set_aside > 0 || only;
        if set_aside > 0 {
            tracing::debug!(jobs = set_aside, "jobs set aside behind an unfinished job of their group");
        }
        let took = u32::try_from(jobs.len()).unwrap_or(u32::MAX);
        if let Some(rate) = &self.rate {
            rate.give_back(allowed.saturating_sub(took));
        }
        report.rate_limited = !only && allowed < self.config.claim_batch && took == allowed;
        report.next_due = claim.next_due;
        report.paused = claim.paused;
        // Fewer than a batch: nothing more is due, or the cap held the claim back.
        report.capped = !report.full && claim.in_flight_before + jobs.len() as i64 >= i64::from(cap);
        for job in &jobs {
            tracing::info!(
                job.id = job.id.0,
                job.dispatch_gen = job.dispatch_gen,
                job.from = "pending",
                job.to = "dispatched",
                "job claimed"
            );
        }
        jobs.chunks(MAX_BATCH).map(|chunk| chunk.iter().map(outgoing).collect()).collect()
    }

    /// Adds a send's outcome to the report; returns the `(id, generation)` of the rows whose
    /// message was not accepted.
    fn sent(
        &self,
        batch: &[Outgoing],
        result: Result<Vec<EntryFailure>, SqsError>,
        report: &mut DispatchReport,
    ) -> Vec<(JobId, i64)> {
        let mut failed = Vec::new();
        match result {
            Ok(failures) => {
                for failure in failures {
                    match batch.get(failure.index) {
                        Some(entry) => failed.push((entry.message.job_id, entry.message.dispatch_gen)),
                        // An id SQS did not get from us: we cannot tell which entry failed, so
                        // treat the whole call as failed.
                        None => failed.extend(batch.iter().map(|e| (e.message.job_id, e.message.dispatch_gen))),
                    }
                    tracing::warn!(error = %failure.reason, "SQS refused a message");
                    report.publish_error.get_or_insert(failure.reason);
                }
            }
            Err(error) => {
                tracing::warn!(error = %error, messages = batch.len(), "publish failed");
                failed.extend(batch.iter().map(|e| (e.message.job_id, e.message.dispatch_gen)));
                report.publish_error.get_or_insert(error.to_string());
            }
        }
        failed.sort_unstable();
        failed.dedup();
        report.published += batch.len() - failed.len();
        failed
    }

    /// Puts rows whose message was not accepted back to `pending` (guarded by the generation
    /// claimed), and adds them to the report.
    async fn release(&self, failed: &[(JobId, i64)], report: &mut DispatchReport) -> Result<(), DispatchError> {
        let released = store::dispatch::release(&self.pool, failed)
            .await
            .map_err(|source| self.db_error("release unpublished jobs", source))?;
        for id in &released {
            tracing::warn!(
                job.id = id.0,
                job.from = "dispatched",
                job.to = "pending",
                "job released: its message was not published"
            );
        }
        report.released += released.len();
        Ok(())
    }

    async fn send(&self, batch: Vec<Outgoing>) -> (Vec<Outgoing>, Result<Vec<EntryFailure>, SqsError>) {
        let result = self.publisher.send_batch(&batch).await;
        (batch, result)
    }

    /// Runs until `shutdown` turns `true`, the drain budget (`ROWQ_DRAIN_SECS`) is spent, or
    /// (with `once`) nothing more is due. A pass in progress always completes before it returns.
    pub async fn run(&self, shutdown: watch::Receiver<bool>, once: bool) -> RunTotals {
        let stop_at = self.config.drain_for.map(|budget| Instant::now() + budget);
        self.run_until(shutdown, once, stop_at).await
    }

    /// [`Scheduler::run`] with an explicit end: a scheduled Lambda drains until its deadline.
    ///
    /// Maintenance (rescue, prune) runs beside the dispatch loop, every `maintenance_interval`,
    /// not in it: a pass that prunes 50,000 rows or rescues a dead worker's thousands takes
    /// hundreds of milliseconds, and no due job should wait for it. A rescue wakes the loop
    /// through the notification channel ([`maintenance::run_once`]). With `once`, the first
    /// maintenance runs before the first claim, so what it rescues goes out in this run.
    pub async fn run_until(&self, shutdown: watch::Receiver<bool>, once: bool, stop_at: Option<Instant>) -> RunTotals {
        // What an operator checks first when dispatch looks slow: the limits it runs under.
        tracing::info!(
            queue = %self.config.queue,
            claim_batch = self.config.claim_batch,
            max_in_flight = self.config.max_in_flight,
            max_dispatch_rate = %self.config.max_dispatch_rate.map_or_else(|| "none".to_string(), |rate| format!("{rate}/s")),
            once,
            "scheduler started"
        );
        self.health.running();
        let (stopped, dispatch_stopped) = watch::channel(false);
        if once {
            self.maintain().await;
        }
        let dispatching = async {
            let totals = self.dispatch_until(shutdown, once, stop_at).await;
            stopped.send_replace(true);
            totals
        };
        let (totals, ()) = tokio::join!(dispatching, self.maintain_until(dispatch_stopped, once));
        totals
    }

    /// The dispatch loop of [`Scheduler::run_until`]: passes, and waits between them.
    async fn dispatch_until(
        &self,
        mut shutdown: watch::Receiver<bool>,
        once: bool,
        stop_at: Option<Instant>,
    ) -> RunTotals {
        let mut totals = RunTotals::default();
        let mut listener: Option<PgListener> = None;
        let mut backoff = ERROR_BACKOFF_MIN;
        let mut paused = false;
        let stop = loop {
            if *shutdown.borrow() {
                break StopReason::Shutdown;
            }
            let budget_left = stop_at.map(|at| at.saturating_duration_since(Instant::now()));
            if budget_left == Some(Duration::ZERO) {
                break StopReason::DrainBudgetSpent;
            }
            if listener.is_none() && !once {
                listener = self.listen().await;
            }

            totals.passes += 1;
            // A long backlog is one pass of back-to-back claims; it yields to a shutdown and the
            // end of the budget between two claims.
            let keep_claiming = || !*shutdown.borrow() && stop_at.is_none_or(|at| Instant::now() < at);
            let (report, error) = self.pass(listener.as_mut(), keep_claiming).await;
            totals.claimed += report.claimed as u64;
            totals.published += report.published as u64;
            totals.released += report.released as u64;
            if error.is_none() && report.paused != paused {
                paused = report.paused;
                log_pause(&self.config.queue, paused);
            }
            let wait = if let Some(error) = error {
                tracing::error!(error = %error, "dispatch pass failed");
                backoff = (backoff * 2).min(ERROR_BACKOFF_MAX);
                backoff
            } else if report.released > 0 {
                backoff = (backoff * 2).min(ERROR_BACKOFF_MAX);
                backoff
            } else {
                backoff = ERROR_BACKOFF_MIN;
                if report.full {
                    continue;
                } else if report.rate_limited {
                    // Until the rate allows a claim as large as the bucket holds; `once` too,
                    // as more may be due.
                    self.rate.as_ref().map_or(self.config.busy_poll, DispatchRate::until_full)
                } else if once {
                    break StopReason::Drained;
                } else if paused {
                    // Until a resume's notification, or the next poll: what falls due meanwhile
                    // waits for the resume too.
                    self.config.poll_interval
                } else if report.capped {
                    self.config.busy_poll
                } else {
                    self.idle_wait(report.next_due)
                }
            };
            let wait = budget_left.map_or(wait, |left| wait.min(left));
            // A limited scheduler waits out its rate whatever is inserted meanwhile: each
            // notification would otherwise wake it for a claim of the few rows that accrued.
            let listening = !report.rate_limited;
            let woke_by_listener = tokio::select! {
                _ = shutdown.changed() => false,
                _ = tokio::time::sleep(wait) => false,
                notification = recv(&mut listener), if listening => match notification {
                    Ok(true) => true,
                    Ok(false) => false,
                    Err(error) => {
                        tracing::warn!(error = %error, "notification listener lost; reconnecting");
                        listener = None;
                        false
                    }
                },
            };
            if woke_by_listener && let Some(listener) = listener.as_mut() {
                // One pass serves every notification that arrived meanwhile.
                while listener.next_buffered().is_some() {}
            }
        };
        tracing::info!(
            ?stop,
            passes = totals.passes,
            claimed = totals.claimed,
            published = totals.published,
            released = totals.released,
            "scheduler stopped"
        );
        totals
    }

    /// How long to sleep when nothing is due: until the next `run_at`, at most the poll interval.
    fn idle_wait(&self, next_due: Option<chrono::DateTime<chrono::Utc>>) -> Duration {
        next_due.map_or(self.config.poll_interval, |at| {
            (at - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO).min(self.config.poll_interval)
        })
    }

    async fn listen(&self) -> Option<PgListener> {
        let connected = async {
            let mut listener = PgListener::connect_with(&self.pool).await?;
            listener.listen(store::NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match connected.await {
            Ok(listener) => Some(listener),
            Err(error) => {
                crate::secret::note(&error);
                tracing::warn!(error = %error, "could not LISTEN; polling until it can");
                None
            }
        }
    }

    /// Maintenance every `maintenance_interval` until the dispatch loop has stopped; the pass
    /// in progress then completes. Starts with a pass unless `waited` (one already ran). A pass
    /// that left work ([`maintenance::MaintenanceReport::more_left`]) is followed by the next
    /// at once.
    async fn maintain_until(&self, mut dispatch_stopped: watch::Receiver<bool>, waited: bool) {
        let mut wait = waited;
        loop {
            if wait {
                tokio::select! {
                    _ = tokio::time::sleep(self.config.maintenance_interval) => {}
                    _ = dispatch_stopped.wait_for(|stopped| *stopped) => return,
                }
            }
            if *dispatch_stopped.borrow() {
                return;
            }
            wait = !self.maintain().await;
        }
    }

    /// One maintenance pass, logged, and the cleanup check; `true` when the pass left work for
    /// the next.
    async fn maintain(&self) -> bool {
        self.check_cleanup().await;
        self.report_metrics().await;
        match maintenance::run_once(&self.pool, self.config.retention).await {
            Ok(report) if report.is_empty() => false,
            Ok(report) => {
                tracing::info!(?report, "maintenance");
                report.more_left
            }
            Err(error) => {
                crate::secret::note(&error);
                tracing::warn!(error = %error, "maintenance failed; will retry");
                false
            }
        }
    }

    /// Warns, at most once per `cleanup_warn_after`, while something open that long holds back
    /// the cleanup of the rows' old versions ([`store::maintenance::CleanupHolder`]): every
    /// claim then reads again each row version left since it began, and dispatch slows down as
    /// jobs run, with nothing else in the scheduler's own logs to say why.
    ///
    /// It looks at most once per `maintenance_interval` (passes that leave work follow each
    /// other at once), and after a warning not again for `cleanup_warn_after`.
    async fn check_cleanup(&self) {
        let Some(after) = self.config.cleanup_warn_after else { return };
        if !self.cleanup_check.passed() {
            return;
        }
        let holders = store::maintenance::cleanup_holders(&self.pool, after).await.unwrap_or_else(|error| {
            tracing::warn!(error = %error, "could not check what holds back the cleanup of old row versions");
            Vec::new()
        });
        let Some(oldest) = holders.first() else {
            self.cleanup_check.defer(self.config.maintenance_interval);
            return;
        };
        self.cleanup_check.defer(after);
        tracing::warn!(
            holder.pid = oldest.pid,
            holder.open_secs = oldest.open_secs,
            holder.xid_age = oldest.xid_age,
            holders = holders.len(),
            "cleanup held back by {oldest}: every claim re-reads the row versions left since, and dispatch slows \
             down until it ends (README: \"Long transactions\")"
        );
    }

    /// Prints the queue's gauges as one metrics line ([`crate::metrics`]) when a namespace is
    /// set, at most once per `maintenance_interval` (passes that leave work follow each other
    /// at once). Several schedulers of one queue each report the same gauges: alarms read their
    /// maximum.
    async fn report_metrics(&self) {
        let Some(namespace) = &self.config.metrics_namespace else { return };
        if !self.metrics_report.passed() {
            return;
        }
        self.metrics_report.defer(self.config.maintenance_interval);
        let line = match store::admin::queue_gauges(&self.pool, &self.config.queue).await {
            Ok(gauges) => {
                crate::metrics::gauges_line(namespace, &self.config.queue, &gauges, std::time::SystemTime::now())
            }
            Err(error) => {
                tracing::warn!(error = %error, "could not read the queue's gauges for its metrics");
                return;
            }
        };
        crate::metrics::print(std::slice::from_ref(&line));
    }
}

/// Says when the scheduler's queue turns paused or resumed: an operator who paused it and
/// forgot, or a producer wondering why nothing runs, finds it in the scheduler's log.
fn log_pause(queue: &str, paused: bool) {
    if paused {
        tracing::warn!(queue, "queue is paused: nothing is claimed until it is resumed (rowq resume {queue})");
    } else {
        tracing::info!(queue, "queue resumed: claiming again");
    }
}

/// The message for a claimed row.
fn outgoing(job: &Claimed) -> Outgoing {
    let message = JobMessage::new(job.id, job.dispatch_gen);
    let dedup_id = message.dedup_id(job.created_at);
    Outgoing { message, group_id: job.group_key.clone().unwrap_or_else(|| dedup_id.clone()), dedup_id }
}

/// Waits for a notification: `Ok(true)` when one arrived, `Ok(false)` when the connection was
/// lost (it reconnects on the next call), never when there is no listener.
async fn recv(listener: &mut Option<PgListener>) -> Result<bool, sqlx::Error> {
    match listener {
        Some(listener) => Ok(listener.try_recv().await?.is_some()),
        None => std::future::pending().await,
    }
}

/// Time kept free before a scheduled invocation's deadline to finish the pass in flight.
pub const LAMBDA_DRAIN_MARGIN: Duration = Duration::from_secs(10);

/// Runs the scheduler as a Lambda on an EventBridge schedule: each invocation drains for
/// `ROWQ_DRAIN_SECS` (or until its deadline less [`LAMBDA_DRAIN_MARGIN`]), then returns the totals.
pub async fn run_lambda<P: Publisher + 'static>(scheduler: Scheduler<P>) -> Result<(), lambda_runtime::Error> {
    let scheduler = std::sync::Arc::new(scheduler);
    lambda_runtime::run(lambda_runtime::service_fn(move |event: lambda_runtime::LambdaEvent<serde_json::Value>| {
        let scheduler = scheduler.clone();
        async move {
            let deadline = crate::worker::deadline_from_epoch_millis(event.context.deadline);
            let mut stop_at = deadline.checked_sub(LAMBDA_DRAIN_MARGIN).unwrap_or(deadline);
            if let Some(budget) = scheduler.config.drain_for {
                stop_at = stop_at.min(Instant::now() + budget);
            }
            let (_keep, shutdown) = watch::channel(false);
            let totals = scheduler.run_until(shutdown, false, Some(stop_at)).await;
            Ok::<_, lambda_runtime::Error>(serde_json::json!({
                "passes": totals.passes, "claimed": totals.claimed,
                "published": totals.published, "released": totals.released,
            }))
        }
    }))
    .await
}

/// A receiver that turns `true` on the first SIGTERM or SIGINT (Ctrl-C).
pub fn shutdown_on_signals() -> watch::Receiver<bool> {
    let (sender, receiver) = watch::channel(false);
    tokio::spawn(async move {
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(error) => {
                    tracing::warn!(error = %error, "cannot listen for SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate => {}
        }
        tracing::info!("shutting down: finishing the batch in flight");
        let _ = sender.send(true);
    });
    receiver
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dispatch_rate_grants_what_its_bucket_holds_as_it_refills_and_takes_back_what_a_claim_left() {
        let rate = DispatchRate::new(100); // a tenth of a second's worth: 10
        let start = rate.bucket.lock().unwrap().1;
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert_eq!(rate.take_at(500, at(0)), 10);
        assert_eq!(rate.take_at(500, at(5)), 0, "a token takes 10 ms to accrue");
        let wait = rate.until_full_at(at(5)).as_secs_f64();
        assert!((wait - 0.095).abs() < 1e-6, "9.5 tokens short: {wait} s");
        assert_eq!(rate.take_at(500, at(42)), 4, "42 ms: 4.2 tokens, taken whole");
        assert_eq!(rate.take_at(500, at(55)), 1, "the 0.2 left and 13 ms more");
        rate.give_back(1000);
        assert_eq!(rate.take_at(500, at(60)), 10, "the bucket holds no more than its capacity");
        assert_eq!(rate.take_at(500, at(10_000)), 10, "nor after a long idle time");
        assert_eq!(rate.take_at(4, at(10_000)), 0);
        assert_eq!(DispatchRate::new(3).take(500), 1, "a slow rate still holds one job");
    }
}
