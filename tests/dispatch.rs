//! The scheduler against real Postgres, with the in-memory publisher (to count every send)
//! and with LocalStack SQS.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rowq::dispatch::RunTotals;
use rowq::sqs::{MemoryPublisher, Publisher, SqsPublisher};
use rowq::store::admin::{self, NewJob};
use rowq::store::dispatch::claim_due;
use rowq::store::run::{StartRequest, start};
use rowq::{JobId, JobMessage, JobState, Registry, Scheduler, Worker, dlq, maintenance};
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const MEMORY_URL: &str = "memory://jobs.fifo";

fn memory_scheduler(pool: &PgPool) -> Scheduler<MemoryPublisher> {
    Scheduler::new(pool.clone(), MemoryPublisher::new(), common::scheduler_config(MEMORY_URL))
}

/// A scheduler whose poll and maintenance intervals are 600 s: only a NOTIFY wakes it.
fn spawn_idle_scheduler(pool: &PgPool) -> (watch::Sender<bool>, JoinHandle<RunTotals>) {
    let mut config = common::scheduler_config(MEMORY_URL);
    config.poll_interval = Duration::from_secs(600);
    config.maintenance_interval = Duration::from_secs(600);
    let (_, stop, running) = spawn_run(Scheduler::new(pool.clone(), MemoryPublisher::new(), config), false);
    (stop, running)
}

/// Runs `scheduler` in a task until the sender returned turns `true` (keep it: a dropped one
/// reads as changed at once), or, with `once`, until nothing is due; the `Arc` reaches its
/// publisher meanwhile.
fn spawn_run<P: Publisher + 'static>(
    scheduler: Scheduler<P>,
    once: bool,
) -> (Arc<Scheduler<P>>, watch::Sender<bool>, JoinHandle<RunTotals>) {
    let scheduler = Arc::new(scheduler);
    let (stop, shutdown) = watch::channel(false);
    let running = tokio::spawn({
        let scheduler = scheduler.clone();
        async move { scheduler.run(shutdown, once).await }
    });
    (scheduler, stop, running)
}

async fn wait_dispatched(pool: &PgPool, id: JobId, what: &str) {
    common::eventually(Duration::from_secs(30), what, || {
        let pool = pool.clone();
        async move { (common::job(&pool, id).await.state == JobState::Dispatched).then_some(()) }
    })
    .await;
}

async fn enqueue_with(pool: &PgPool, job: NewJob) -> JobId {
    admin::enqueue(pool, &job).await.unwrap().unwrap()
}

/// The `n`th no-op job of `group` (`n` in its payload).
fn group_job(group: &str, n: i64) -> NewJob {
    NewJob { group_key: Some(group.into()), ..NewJob::new("noop", json!({ "n": n })) }
}

/// The job ids the scheduler has published since the last take, in order.
fn sent_ids(scheduler: &Scheduler<MemoryPublisher>) -> Vec<JobId> {
    scheduler.publisher().take().into_iter().map(|o| o.message.job_id).collect()
}

/// [`sent_ids`] with each message's FIFO group.
fn sent_with_groups(scheduler: &Scheduler<MemoryPublisher>) -> Vec<(JobId, String)> {
    scheduler.publisher().take().into_iter().map(|o| (o.message.job_id, o.group_id)).collect()
}

#[tokio::test]
async fn claims_follow_priority_then_run_at_then_id_and_skip_future_rows() {
    let pool = common::database().await;
    let now = chrono::Utc::now();
    let due_since = |seconds: i64| NewJob {
        run_at: Some(now - chrono::Duration::seconds(seconds)),
        ..NewJob::new("noop", json!({}))
    };
    let low_old = enqueue_with(&pool, due_since(60)).await;
    let low_new = enqueue_with(&pool, due_since(10)).await;
    let high = enqueue_with(&pool, NewJob { priority: Some(10), ..NewJob::new("noop", json!({})) }).await;
    let low_same_time_a = enqueue_with(&pool, due_since(5)).await;
    let low_same_time_b = enqueue_with(&pool, due_since(5)).await;
    let future = enqueue_with(
        &pool,
        NewJob {
            priority: Some(100),
            run_at: Some(now + chrono::Duration::hours(1)),
            ..NewJob::new("noop", json!({}))
        },
    )
    .await;
    let other_queue =
        enqueue_with(&pool, NewJob { queue: Some("other".into()), ..NewJob::new("noop", json!({})) }).await;

    let claimed: Vec<JobId> =
        claim_due(&pool, "default", 100, Duration::from_secs(60)).await.unwrap().into_iter().map(|c| c.id).collect();
    assert_eq!(claimed, vec![high, low_old, low_new, low_same_time_a, low_same_time_b]);
    assert_eq!(common::job(&pool, future).await.state, JobState::Pending, "a future run_at was claimed early");
    assert_eq!(common::job(&pool, other_queue).await.state, JobState::Pending, "another queue's job was claimed");

    // The scheduler publishes in the same order; a job without a group_key gets a FIFO group of
    // its own generation, so a stale message still in flight never blocks its successor.
    sqlx::query("UPDATE rowq.jobs SET state = 'pending'").execute(&pool).await.unwrap();
    let scheduler = memory_scheduler(&pool);
    scheduler.run_once().await.unwrap();
    let sent = scheduler.publisher().take();
    let sent_ids: Vec<JobId> = sent.iter().map(|o| o.message.job_id).collect();
    assert_eq!(sent_ids, vec![high, low_old, low_new, low_same_time_a, low_same_time_b]);
    assert!(sent.iter().all(|o| o.message.dispatch_gen == 2 && o.group_id == o.dedup_id));
}

#[tokio::test]
async fn a_claim_sets_the_lease_and_bumps_the_generation() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    let claimed = claim_due(&pool, "default", 10, Duration::from_secs(120)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let row = common::job(&pool, id).await;
    assert_eq!(row.state, JobState::Dispatched);
    assert_eq!(row.dispatch_gen, 1);
    assert_eq!(row.attempts, 0, "a claim must not consume an attempt");
    let lease = row.dispatch_deadline.unwrap() - row.updated_at;
    assert_eq!(lease.num_seconds(), 120);
    // A second claim finds nothing: the row is no longer pending.
    assert!(claim_due(&pool, "default", 10, Duration::from_secs(120)).await.unwrap().is_empty());
}

#[tokio::test]
async fn concurrent_schedulers_dispatch_every_job_generation_exactly_once() {
    let pool = common::database().await;
    const JOBS: i64 = 5000;
    const SCHEDULERS: usize = 6;
    common::enqueue_many(&pool, "noop", JOBS).await;
    let schedulers: Vec<Arc<Scheduler<MemoryPublisher>>> = (0..SCHEDULERS)
        .map(|_| {
            let mut config = common::scheduler_config(MEMORY_URL);
            config.claim_batch = 50;
            Arc::new(Scheduler::new(pool.clone(), MemoryPublisher::new(), config))
        })
        .collect();
    let started = Instant::now();
    let runs = schedulers.iter().map(|scheduler| {
        let scheduler = scheduler.clone();
        tokio::spawn(async move {
            let (_keep, shutdown) = watch::channel(false);
            scheduler.run(shutdown, true).await
        })
    });
    let totals = futures::future::join_all(runs).await;
    let elapsed = started.elapsed();

    let mut sent = Vec::new();
    for scheduler in &schedulers {
        sent.extend(scheduler.publisher().take());
    }
    let per_scheduler: Vec<u64> = totals.iter().map(|t| t.as_ref().unwrap().published).collect();
    println!(
        "{JOBS} jobs claimed+published by {SCHEDULERS} schedulers in {elapsed:?} ({:.0} rows/s, in-memory publisher); per scheduler {per_scheduler:?}",
        JOBS as f64 / elapsed.as_secs_f64()
    );
    assert_eq!(sent.len() as i64, JOBS, "messages sent != rows");
    let unique: HashSet<(JobId, i64)> = sent.iter().map(|o| (o.message.job_id, o.message.dispatch_gen)).collect();
    assert_eq!(unique.len() as i64, JOBS, "a job generation was sent twice");
    assert!(sent.iter().all(|o| o.message.dispatch_gen == 1), "a job was claimed more than once");
    assert_eq!(common::count_in_state(&pool, JobState::Dispatched).await, JOBS);
    assert!(per_scheduler.iter().filter(|n| **n > 0).count() > 1, "only one scheduler did any work: {per_scheduler:?}");
}

#[tokio::test]
async fn concurrent_schedulers_deliver_every_row_once_through_localstack() {
    let pool = common::database().await;
    const JOBS: i64 = 2000;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(60)).await;
    common::enqueue_many(&pool, "noop", JOBS).await;
    let started = Instant::now();
    let runs = (0..3).map(|_| {
        let scheduler = Scheduler::new(
            pool.clone(),
            SqsPublisher::new(client.clone(), queues.queue_url.clone()),
            common::scheduler_config(&queues.queue_url),
        );
        tokio::spawn(async move {
            let (_keep, shutdown) = watch::channel(false);
            scheduler.run(shutdown, true).await
        })
    });
    let published: u64 = futures::future::join_all(runs).await.into_iter().map(|t| t.unwrap().published).sum();
    let elapsed = started.elapsed();
    println!(
        "{JOBS} jobs claimed+published to LocalStack by 3 schedulers in {elapsed:?} ({:.0} rows/s)",
        JOBS as f64 / elapsed.as_secs_f64()
    );
    assert_eq!(published as i64, JOBS);
    let received = common::drain_queue(&client, &queues.queue_url, Duration::from_secs(3)).await;
    assert_eq!(received.len() as i64, JOBS, "messages received != rows");
    let unique: HashSet<JobId> = received.iter().map(|m| m.job_id).collect();
    assert_eq!(unique.len() as i64, JOBS);
}

#[tokio::test]
async fn the_in_flight_cap_holds_back_dispatch_and_a_new_high_priority_job_goes_first_when_room_frees() {
    let pool = common::database().await;
    let mut config = common::scheduler_config(MEMORY_URL);
    config.max_in_flight = 5;
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), config);
    common::enqueue_many(&pool, "noop", 50).await;

    let first = scheduler.run_once().await.unwrap();
    assert_eq!(first.claimed, 5);
    assert!(first.capped);
    let second = scheduler.run_once().await.unwrap();
    assert_eq!(second.claimed, 0, "dispatched past the in-flight cap");
    assert_eq!(common::count_in_state(&pool, JobState::Dispatched).await, 5);

    let urgent = enqueue_with(&pool, NewJob { priority: Some(100), ..NewJob::new("noop", json!({})) }).await;
    // A worker starts one job: one slot frees.
    let sent = scheduler.publisher().take();
    let started = start(
        &pool,
        &[StartRequest {
            id: sent[0].message.job_id,
            dispatch_gen: sent[0].message.dispatch_gen,
            lease: Duration::from_secs(60),
        }],
    )
    .await
    .unwrap();
    assert_eq!(started.len(), 1);
    let third = scheduler.run_once().await.unwrap();
    assert_eq!(third.claimed, 1);
    let sent = scheduler.publisher().take();
    assert_eq!(sent[0].message.job_id, urgent, "the high-priority job did not jump the backlog");
}

#[tokio::test]
async fn a_failed_publish_puts_rows_back_to_pending_without_using_attempts_and_they_go_out_on_recovery() {
    let pool = common::database().await;
    let ids = common::enqueue_many(&pool, "noop", 25).await;
    let scheduler = memory_scheduler(&pool);
    scheduler.publisher().set_failing(true);
    let report = scheduler.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published, report.released), (25, 0, 25));
    assert!(report.publish_error.unwrap().contains("set to fail"));
    for id in &ids {
        let row = common::job(&pool, *id).await;
        assert_eq!((row.state, row.attempts, row.dispatch_gen), (JobState::Pending, 0, 1));
    }

    scheduler.publisher().set_failing(false);
    let report = scheduler.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published, report.released), (25, 25, 0));
    let sent = scheduler.publisher().take();
    assert!(sent.iter().all(|o| o.message.dispatch_gen == 2), "the retry must be a new generation");
    assert_eq!(common::count_in_state(&pool, JobState::Dispatched).await, 25);
}

#[tokio::test]
async fn a_queue_that_does_not_exist_releases_the_rows_for_a_later_pass() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let missing = format!("{}/000000000000/rowq-no-such-queue.fifo", common::endpoint());
    let scheduler = Scheduler::new(
        pool.clone(),
        SqsPublisher::new(client.clone(), missing.clone()),
        common::scheduler_config(&missing),
    );
    let ids = common::enqueue_many(&pool, "noop", 12).await;
    let report = scheduler.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published, report.released), (12, 0, 12));
    println!("publish error: {}", report.publish_error.as_deref().unwrap_or_default());
    for id in ids {
        let row = common::job(&pool, id).await;
        assert_eq!((row.state, row.attempts), (JobState::Pending, 0));
    }
}

#[tokio::test]
async fn an_unreachable_endpoint_releases_the_rows_and_they_are_dispatched_once_it_is_back() {
    let pool = common::database().await;
    let real = common::sqs().await;
    let queues = common::queues(&real, 5, Duration::from_secs(60)).await;
    // Nothing listens on port 1: every call fails to connect, like an endpoint that went away.
    let down = common::sqs_at("http://127.0.0.1:1").await;
    let ids = common::enqueue_many(&pool, "noop", 15).await;
    let outage = Scheduler::new(
        pool.clone(),
        SqsPublisher::new(down, queues.queue_url.clone()),
        common::scheduler_config(&queues.queue_url),
    );
    let report = outage.run_once().await.unwrap();
    assert_eq!((report.published, report.released), (0, 15));

    let recovered = Scheduler::new(
        pool.clone(),
        SqsPublisher::new(real.clone(), queues.queue_url.clone()),
        common::scheduler_config(&queues.queue_url),
    );
    let report = recovered.run_once().await.unwrap();
    assert_eq!((report.published, report.released), (15, 0));
    let received = common::drain_queue(&real, &queues.queue_url, Duration::from_secs(2)).await;
    let received: HashSet<JobId> = received.iter().map(|m| m.job_id).collect();
    assert_eq!(received, ids.into_iter().collect());
}

#[tokio::test]
async fn a_crash_between_claim_and_publish_is_rescued_after_the_lease_and_the_old_generation_cannot_start() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    // The "crashed" scheduler claimed and never published.
    let crashed = claim_due(&pool, "default", 10, Duration::from_millis(300)).await.unwrap();
    assert_eq!(crashed[0].dispatch_gen, 1);
    let before = maintenance::run_once(&pool, Duration::ZERO).await.unwrap();
    assert_eq!(before.rescued_dispatched, 0, "rescued before the lease ran out");

    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = maintenance::run_once(&pool, Duration::ZERO).await.unwrap();
    assert_eq!(report.rescued_dispatched, 1);
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Pending, 0));

    let scheduler = memory_scheduler(&pool);
    scheduler.run_once().await.unwrap();
    let sent = scheduler.publisher().take();
    assert_eq!(sent[0].message.dispatch_gen, 2);

    // A message of generation 1 that shows up late matches nothing.
    only_the_new_generation_starts(&pool, id, "the old generation started").await;
}

/// A fence of generation 1 starts nothing and one of generation 2 starts job `id`: the claim
/// after a rescue or a retry gave the job a new generation. `stale_started` says what it means
/// when generation 1 starts it.
async fn only_the_new_generation_starts(pool: &PgPool, id: JobId, stale_started: &str) {
    let lease = Duration::from_secs(60);
    let stale = start(pool, &[StartRequest { id, dispatch_gen: 1, lease }]).await.unwrap();
    assert!(stale.is_empty(), "{stale_started}");
    assert_eq!(start(pool, &[StartRequest { id, dispatch_gen: 2, lease }]).await.unwrap().len(), 1);
}

/// A job cancelled while its message was on its way, then retried (`rowq retry`, the undo of a
/// cancel), runs once, by its new generation: the message sent before the cancel matches nothing.
#[tokio::test]
async fn a_cancelled_job_retried_runs_by_its_new_generation_never_by_the_message_sent_before() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    let before = claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(before[0].dispatch_gen, 1);
    assert!(admin::cancel(&pool, id).await.unwrap().is_some());
    let retried = admin::retry(&pool, id).await.unwrap().expect("a cancelled job can be retried");
    assert_eq!((retried.state, retried.attempts, retried.finished_at), (JobState::Pending, 0, None));
    let again = claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(again[0].dispatch_gen, 2);
    only_the_new_generation_starts(&pool, id, "the message sent before the cancel started the job").await;
    assert!(admin::retry(&pool, id).await.unwrap().is_none(), "a running job was retried");
}

#[tokio::test]
async fn jobs_of_one_group_are_dispatched_one_at_a_time_in_id_order() {
    let pool = common::database().await;
    let first = enqueue_with(&pool, group_job("customer-9", 1)).await;
    let second = enqueue_with(&pool, NewJob { priority: Some(50), ..group_job("customer-9", 2) }).await;
    let loose = common::enqueue(&pool, "noop", json!({})).await;
    let scheduler = memory_scheduler(&pool);

    scheduler.run_once().await.unwrap();
    let sent = sent_with_groups(&scheduler);
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0], (first, "customer-9".to_string()));
    assert_eq!(sent[1].0, loose);
    assert!(sent[1].1.starts_with(&format!("{loose}-1-")), "{}", sent[1].1);

    // While the first is unfinished (even running), the second waits.
    start(&pool, &[StartRequest { id: first, dispatch_gen: 1, lease: Duration::from_secs(60) }]).await.unwrap();
    scheduler.run_once().await.unwrap();
    assert!(scheduler.publisher().take().is_empty(), "the group's second job ran beside its first");

    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(first)
        .execute(&pool)
        .await
        .unwrap();
    scheduler.run_once().await.unwrap();
    assert_eq!(sent_ids(&scheduler), vec![second]);
}

/// Ids are given out at INSERT and rows appear at COMMIT. When two transactions enqueue into one
/// group at the same time and the later id commits first, the claim cannot see the earlier id yet:
/// the later one goes first, and the earlier one is claimed once it commits, while the other is
/// still in flight. SQS FIFO holds a group's second message until the first is deleted, so they
/// still run one at a time, in commit order (README, `group_key`; docs/DESIGN.md, 2).
#[tokio::test]
async fn group_jobs_from_overlapping_transactions_are_dispatched_in_commit_order() {
    let pool = common::database().await;
    let mut open = pool.begin().await.unwrap();
    let numbered_first = admin::enqueue(&mut *open, &group_job("customer-7", 1)).await.unwrap().unwrap();
    let committed_first = enqueue_with(&pool, group_job("customer-7", 2)).await;
    assert!(numbered_first.0 < committed_first.0);
    let scheduler = memory_scheduler(&pool);

    scheduler.run_once().await.unwrap();
    assert_eq!(sent_ids(&scheduler), vec![committed_first], "only the committed job exists for the claim");

    open.commit().await.unwrap();
    scheduler.run_once().await.unwrap();
    assert_eq!(
        sent_with_groups(&scheduler),
        vec![(numbered_first, "customer-7".to_string())],
        "behind the other, in the same FIFO group"
    );
    assert_eq!(common::job(&pool, committed_first).await.state, JobState::Dispatched);
}

/// Jobs enqueued together (`admin::enqueue_many`, `rowq enqueue --lines`) take ascending ids in
/// the order given, so a group runs them in that order; inside the caller's transaction they
/// appear at its commit. A shared `dedup_key` is refused: only the first would be enqueued.
#[tokio::test]
async fn jobs_enqueued_together_run_in_the_order_given_within_their_group() {
    let pool = common::database().await;
    let like = group_job("customer-9", 0);
    let payloads: Vec<serde_json::Value> = (1..=3).map(|n| json!({ "n": n })).collect();
    let mut open = pool.begin().await.unwrap();
    let ids = admin::enqueue_many(&mut *open, &like, &payloads).await.unwrap();
    assert_eq!(ids.len(), 3);
    let scheduler = memory_scheduler(&pool);
    scheduler.run_once().await.unwrap();
    assert!(sent_ids(&scheduler).is_empty(), "jobs of an open transaction were claimed");
    open.commit().await.unwrap();

    for (n, id) in (1..=3).zip(&ids) {
        assert_eq!(common::job(&pool, *id).await.payload, json!({ "n": n }), "ids follow the payloads' order");
        scheduler.run_once().await.unwrap();
        assert_eq!(sent_ids(&scheduler), vec![*id], "the group's next job, and only it");
        sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
    }

    let keyed = NewJob { dedup_key: Some("once".into()), ..NewJob::new("noop", json!({})) };
    let error = admin::enqueue_many(&pool, &keyed, &payloads).await.unwrap_err();
    assert!(error.to_string().contains("cannot share a dedup_key"), "{error}");
}

#[tokio::test]
async fn an_idle_scheduler_wakes_on_notify_long_before_its_poll_interval() {
    let pool = common::database().await;
    let (stop, running) = spawn_idle_scheduler(&pool);
    tokio::time::sleep(Duration::from_millis(500)).await; // idle, listening

    let mut latencies = Vec::new();
    for _ in 0..5 {
        let inserted = Instant::now();
        let id = common::enqueue(&pool, "noop", json!({})).await;
        wait_dispatched(&pool, id, "the NOTIFY to wake the scheduler").await;
        latencies.push(inserted.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("insert → dispatched with a 600 s poll interval: {latencies:?}");
    stop.send(true).unwrap();
    let totals = running.await.unwrap();
    assert_eq!(totals.published, 5);
}

#[tokio::test]
async fn the_scheduler_listens_again_after_its_connection_is_terminated() {
    let pool = common::database().await;
    let (stop, running) = spawn_idle_scheduler(&pool);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(!killed.is_empty());
    // Give the scheduler time to notice and LISTEN again, then insert. The scheduler claims
    // on its listener's connection, right after the LISTEN: either is its last statement.
    common::eventually(Duration::from_secs(30), "the listener to reconnect", || {
        let pool = pool.clone();
        async move {
            let listening: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                   AND pid <> pg_backend_pid() AND state = 'idle'
                   AND (query ILIKE 'LISTEN%' OR query LIKE '%WITH in_flight AS%')",
            )
            .fetch_one(&pool)
            .await
            .ok()?;
            (listening > 0).then_some(())
        }
    })
    .await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    wait_dispatched(&pool, id, "a NOTIFY after the reconnect").await;
    stop.send(true).unwrap();
    running.await.unwrap();
}

#[tokio::test]
async fn a_bounded_drain_stops_when_its_budget_is_spent() {
    let pool = common::database().await;
    let mut config = common::scheduler_config(MEMORY_URL);
    config.drain_for = Some(Duration::from_millis(700));
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), config);
    common::enqueue_many(&pool, "noop", 10).await;
    let (_keep, shutdown) = watch::channel(false);
    let started = Instant::now();
    let totals = scheduler.run(shutdown, false).await;
    let elapsed = started.elapsed();
    assert_eq!(totals.published, 10);
    assert!(elapsed >= Duration::from_millis(700), "stopped before its budget: {elapsed:?}");
    println!("drain with a 700 ms budget returned after {elapsed:?}");
}

#[tokio::test]
async fn a_shutdown_signal_stops_an_idle_scheduler() {
    let pool = common::database().await;
    let (stop, running) = spawn_idle_scheduler(&pool);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), running).await.expect("the scheduler ignored shutdown").unwrap();
}

/// A job that falls due while the scheduler's maintenance is held up is still dispatched.
#[tokio::test]
async fn a_long_maintenance_pass_does_not_hold_up_dispatch() {
    let pool = common::database().await;
    // The prune's DELETE waits for an advisory lock that this test holds: maintenance stays in
    // its pass for as long as the test wants, as a prune of 50,000 rows would for a while.
    for statement in [
        "CREATE FUNCTION wait_for_the_test() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$",
        "CREATE TRIGGER held_prune BEFORE DELETE ON rowq.jobs FOR EACH STATEMENT EXECUTE FUNCTION wait_for_the_test()",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let mut holder = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)").execute(&mut *holder).await.unwrap();
    let old = common::enqueue(&pool, "noop", json!({})).await;
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() - interval '2 hours' WHERE id = $1")
        .bind(old)
        .execute(&pool)
        .await
        .unwrap();
    let mut config = common::scheduler_config(MEMORY_URL);
    config.retention = Duration::from_secs(3600).into();
    config.poll_interval = Duration::from_secs(600);
    let (scheduler, stop, running) = spawn_run(Scheduler::new(pool.clone(), MemoryPublisher::new(), config), false);
    common::eventually(Duration::from_secs(30), "the prune to wait for the test's lock", || {
        let pool = pool.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                   AND wait_event_type = 'Lock' AND query LIKE '%DELETE FROM rowq.jobs%'",
            )
            .fetch_one(&pool)
            .await
            .ok()?;
            (waiting == 1).then_some(())
        }
    })
    .await;

    let due = common::enqueue(&pool, "noop", json!({})).await;
    wait_dispatched(&pool, due, "the job enqueued while maintenance was held up").await;
    // The row is `dispatched` once the claim commits; its message is sent just after.
    let sent: Vec<JobId> = common::eventually(Duration::from_secs(30), "the message to be sent", || {
        let sent = sent_ids(&scheduler);
        async move { (!sent.is_empty()).then_some(sent) }
    })
    .await;
    assert_eq!(sent, vec![due]);
    assert!(admin::get(&pool, old).await.unwrap().is_some(), "pruned while the prune was held");

    // A shutdown lets the maintenance pass in progress finish.
    sqlx::query("SELECT pg_advisory_unlock(4242)").execute(&mut *holder).await.unwrap();
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), running).await.expect("the scheduler did not stop").unwrap();
    assert!(admin::get(&pool, old).await.unwrap().is_none(), "the held prune did not complete");
}

/// Rows that a rescue puts back to `pending` send no notification of their own: the rescue
/// sends one, which wakes the loop.
#[tokio::test]
async fn a_row_rescued_by_maintenance_is_dispatched_without_waiting_for_the_poll() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    // A scheduler that crashed after claiming, with a lease that ends after the loop below has
    // gone idle (its first pass finds nothing due).
    claim_due(&pool, "default", 1, Duration::from_millis(800)).await.unwrap();
    let mut config = common::scheduler_config(MEMORY_URL);
    config.poll_interval = Duration::from_secs(600);
    config.maintenance_interval = Duration::from_millis(200);
    let (_, stop, running) = spawn_run(Scheduler::new(pool.clone(), MemoryPublisher::new(), config), false);
    common::eventually(Duration::from_secs(30), "the rescued row to be claimed again", || {
        let pool = pool.clone();
        async move {
            let row = common::job(&pool, id).await;
            (row.state == JobState::Dispatched && row.dispatch_gen == 2).then_some(())
        }
    })
    .await;
    stop.send(true).unwrap();
    assert_eq!(running.await.unwrap().published, 1);
}

/// `scheduler --once` maintains first: what its rescue puts back goes out in the same run.
#[tokio::test]
async fn a_run_once_sends_what_its_maintenance_rescued() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    claim_due(&pool, "default", 1, Duration::ZERO).await.unwrap();
    let scheduler = memory_scheduler(&pool);
    let (_keep, shutdown) = watch::channel(false);
    let totals = scheduler.run(shutdown, true).await;
    assert_eq!(totals.published, 1);
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.dispatch_gen), (JobState::Dispatched, 2));
}

/// A retried job is due at once, and its update sends no `NOTIFY` of its own: the retry wakes
/// the schedulers, one job at a time or all failed jobs at once.
#[tokio::test]
async fn a_retried_job_is_dispatched_without_waiting_for_the_poll() {
    let pool = common::database().await;
    let one = common::enqueue(&pool, "noop", json!({})).await;
    let all = common::enqueue(&pool, "noop", json!({})).await;
    sqlx::query("UPDATE rowq.jobs SET state = 'failed', attempts = 5, finished_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let (stop, running) = spawn_idle_scheduler(&pool);
    // Once it has sent this one, nothing is due: the loop waits for a notification.
    let sentinel = common::enqueue(&pool, "noop", json!({})).await;
    wait_dispatched(&pool, sentinel, "the sentinel job to be dispatched").await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    assert!(admin::retry(&pool, one).await.unwrap().is_some());
    wait_dispatched(&pool, one, "a job retried by id to be dispatched").await;
    assert_eq!(
        admin::retry_many(&pool, admin::FinishedJobs::default(), admin::Bulk::Apply).await.unwrap().retried,
        vec![all]
    );
    wait_dispatched(&pool, all, "the jobs of a retry of all failed ones to be dispatched").await;
    stop.send(true).unwrap();
    assert_eq!(running.await.unwrap().published, 3);
}

/// A paused queue is claimed from by no scheduler: its jobs stay pending with their attempts and
/// generation untouched, other queues go on, and once it is resumed its jobs go, in claim order.
#[tokio::test]
async fn a_paused_queue_is_claimed_from_by_no_scheduler_until_it_is_resumed() {
    let pool = common::database().await;
    let held = common::enqueue_many(&pool, "noop", 3).await;
    let other = enqueue_with(&pool, NewJob { queue: Some("other".into()), ..NewJob::new("noop", json!({})) }).await;
    let paused = admin::pause(&pool, "default", Some("SMTP provider down")).await.unwrap();
    assert!(!paused.already, "{paused:?}");
    assert_eq!((paused.queue.queue.as_str(), paused.queue.reason.as_deref()), ("default", Some("SMTP provider down")));

    let schedulers = [memory_scheduler(&pool), memory_scheduler(&pool)];
    for scheduler in &schedulers {
        let report = scheduler.run_once().await.unwrap();
        assert_eq!((report.claimed, report.published, report.paused), (0, 0, true), "{report:?}");
        assert_eq!(sent_ids(scheduler), []);
    }
    for id in &held {
        let row = common::job(&pool, *id).await;
        assert_eq!((row.state, row.dispatch_gen, row.attempts), (JobState::Pending, 0, 0), "{row:?}");
    }
    let mut config = common::scheduler_config(MEMORY_URL);
    config.queue = "other".into();
    let others = Scheduler::new(pool.clone(), MemoryPublisher::new(), config);
    let report = others.run_once().await.unwrap();
    assert_eq!((report.claimed, report.paused), (1, false), "another queue is not held: {report:?}");
    assert_eq!(sent_ids(&others), [other]);

    // Pausing again keeps when the pause began, and takes a new reason when one is given.
    let again = admin::pause(&pool, "default", Some("still down")).await.unwrap();
    assert!(again.already, "{again:?}");
    assert_eq!((again.queue.paused_at, again.queue.reason.as_deref()), (paused.queue.paused_at, Some("still down")));
    let kept = admin::pause(&pool, "default", None).await.unwrap();
    assert_eq!(kept.queue.reason.as_deref(), Some("still down"));
    assert_eq!(admin::paused_queues(&pool).await.unwrap(), std::slice::from_ref(&kept.queue));
    let refused = admin::pause(&pool, "no spaces", None).await.unwrap_err().to_string();
    assert!(refused.contains("jobs_queue_is_a_nonempty_identifier"), "{refused}");

    assert_eq!(admin::resume(&pool, "default").await.unwrap(), Some(kept.queue));
    assert_eq!(admin::resume(&pool, "default").await.unwrap(), None);
    let report = schedulers[0].run_once().await.unwrap();
    assert_eq!((report.claimed, report.paused), (3, false), "{report:?}");
    assert_eq!(sent_ids(&schedulers[0]), held);
}

/// `ROWQ_MAX_DISPATCH_RATE` holds a backlog to its rate: 150 due jobs at 100 a second, of which
/// the bucket holds a tenth of a second's worth (10) at first, cannot go out in less than 1.4 s,
/// nor in fewer than 15 claims; and every one of them goes, once.
#[tokio::test]
async fn a_dispatch_rate_holds_a_backlog_to_it_and_all_of_it_goes() {
    let pool = common::database().await;
    let (captured, _logging) = Captured::logs(tracing::Level::INFO);
    let ids = common::enqueue_many(&pool, "noop", 150).await;
    let mut config = common::scheduler_config(MEMORY_URL);
    config.max_dispatch_rate = Some(100);
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), config);
    let began = Instant::now();
    let (_keep, shutdown) = watch::channel(false);
    let totals = scheduler.run(shutdown, true).await;
    let took = began.elapsed();
    assert_eq!(totals.published, 150, "{totals:?}");
    assert!(took >= Duration::from_millis(1400), "150 jobs at 100 a second went out in {took:?}");
    assert!(totals.passes >= 15, "claims of more than the bucket holds: {totals:?}");
    let mut sent = sent_ids(&scheduler);
    sent.sort_unstable();
    assert_eq!(sent, ids);
    let logged = captured.text();
    let started = logged.lines().find(|line| line.contains("scheduler started")).unwrap_or_default();
    assert!(started.contains("max_dispatch_rate=100/s"), "the limit it runs under, in its log: {logged}");
}

/// A running scheduler whose queue is paused says so in its log, once however often it is
/// woken, and claims nothing; a resume by plain SQL wakes it at once (the table's trigger
/// notifies), not at its poll 600 s later, and it says that too.
#[tokio::test]
async fn a_resume_by_plain_sql_wakes_a_paused_scheduler_which_logs_the_pause_once() {
    let pool = common::database().await;
    let (captured, _logging) = Captured::logs(tracing::Level::INFO);
    sqlx::query("INSERT INTO rowq.paused_queues (queue, reason) VALUES ('default', 'deploy')")
        .execute(&pool)
        .await
        .unwrap();
    let first = common::enqueue(&pool, "noop", json!({})).await;
    let (stop, running) = spawn_idle_scheduler(&pool);
    let paused_line = "queue is paused: nothing is claimed until it is resumed (rowq resume default)";
    common::eventually(Duration::from_secs(30), "the scheduler to log the pause", || {
        let logged = captured.text();
        async move { logged.contains(paused_line).then_some(()) }
    })
    .await;
    // An insert's notification wakes it: another paused pass, and no second warning.
    let second = common::enqueue(&pool, "noop", json!({})).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for id in [first, second] {
        assert_eq!(common::job(&pool, id).await.state, JobState::Pending);
    }

    sqlx::query("DELETE FROM rowq.paused_queues WHERE queue = 'default'").execute(&pool).await.unwrap();
    wait_dispatched(&pool, first, "the first job to be dispatched once the queue is resumed").await;
    wait_dispatched(&pool, second, "the second job to be dispatched once the queue is resumed").await;
    stop.send(true).unwrap();
    assert_eq!(running.await.unwrap().published, 2);
    let logged = captured.text();
    assert_eq!(logged.matches(paused_line).count(), 1, "{logged}");
    assert!(logged.contains("queue resumed: claiming again"), "{logged}");
}

/// A group's next job may go once its head ends, and that sends no `NOTIFY` of its own:
/// however the head ends (the worker finishes it, in a Lambda's batch or in a batch of a process
/// that holds several, whose wake a task of the worker's sends; an operator cancels it, the DLQ
/// or a rescue fails it), the schedulers are woken, and an idle one dispatches the next job at
/// once. A head the DLQ sends back unstarted (its message dead-lettered before a worker started
/// it) is dispatched again at once, and its group's next job waits.
#[tokio::test]
async fn every_way_a_groups_head_ends_wakes_the_schedulers_for_its_next_job() {
    let pool = common::database().await;
    let mut groups = Vec::new();
    for group in ["finished", "finished-by-a-poller", "cancelled", "dead-lettered", "rescued", "unstarted"] {
        groups.push((enqueue_with(&pool, group_job(group, 1)).await, enqueue_with(&pool, group_job(group, 2)).await));
    }
    let (stop, running) = spawn_idle_scheduler(&pool);
    for &(head, _) in &groups {
        wait_dispatched(&pool, head, "the head of each group to be dispatched").await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // nothing else is due: idle
    let message = |id: JobId| {
        common::event(vec![common::record(&format!("message-{id}"), &id.to_string(), JobMessage::new(id, 1).encode())])
    };
    let [finished, by_a_poller, cancelled, dead_lettered, rescued, unstarted] = groups.try_into().unwrap();

    let worker = Worker::new(pool.clone(), Registry::builtin(), common::worker_config());
    let response = worker.handle_batch(message(finished.0), Instant::now() + Duration::from_secs(30)).await;
    assert!(response.batch_item_failures.is_empty());
    wait_dispatched(&pool, finished.1, "the next job after its head succeeded").await;

    let (ran, handlers_returned) = tokio::sync::oneshot::channel();
    let deadline = Instant::now() + Duration::from_secs(30);
    let response = worker.handle_batch_then(message(by_a_poller.0), deadline, 1, Some(ran)).await;
    assert!(response.batch_item_failures.is_empty());
    assert!(handlers_returned.await.is_ok());
    wait_dispatched(&pool, by_a_poller.1, "the next job after its head succeeded in a poller's batch").await;

    assert!(admin::cancel(&pool, cancelled.0).await.unwrap().is_some());
    wait_dispatched(&pool, cancelled.1, "the next job after its head was cancelled").await;

    // A worker started it (and died with it, delivery after delivery).
    let started = StartRequest { id: dead_lettered.0, dispatch_gen: 1, lease: Duration::from_secs(60) };
    assert_eq!(start(&pool, &[started]).await.unwrap().len(), 1);
    assert!(dlq::handle_batch(&pool, message(dead_lettered.0), None).await.batch_item_failures.is_empty());
    assert_eq!(common::job(&pool, dead_lettered.0).await.state, JobState::Failed);
    wait_dispatched(&pool, dead_lettered.1, "the next job after its head was dead-lettered").await;

    assert!(dlq::handle_batch(&pool, message(unstarted.0), None).await.batch_item_failures.is_empty());
    common::eventually(Duration::from_secs(30), "the head sent back unstarted to be dispatched again", || {
        let pool = pool.clone();
        async move {
            let row = common::job(&pool, unstarted.0).await;
            (row.state == JobState::Dispatched && row.dispatch_gen == 2).then_some(())
        }
    })
    .await;
    assert_eq!(common::job(&pool, unstarted.1).await.state, JobState::Pending, "its group waits for it");

    sqlx::query(
        "UPDATE rowq.jobs SET state = 'running', attempts = max_attempts, run_deadline = now() - interval '1 minute'
         WHERE id = $1",
    )
    .bind(rescued.0)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(maintenance::run_once(&pool, Duration::ZERO).await.unwrap().failed, 1);
    wait_dispatched(&pool, rescued.1, "the next job after a rescue failed its head").await;

    stop.send(true).unwrap();
    assert_eq!(running.await.unwrap().published, 12);
}

#[tokio::test]
async fn finished_rows_older_than_the_retention_are_pruned_and_others_kept() {
    let pool = common::database().await;
    let old = common::enqueue(&pool, "noop", json!({})).await;
    let recent = common::enqueue(&pool, "noop", json!({})).await;
    let waiting = common::enqueue(&pool, "noop", json!({})).await;
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() - interval '2 hours' WHERE id = $1")
        .bind(old)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE rowq.jobs SET state = 'failed', finished_at = now() - interval '10 minutes' WHERE id = $1")
        .bind(recent)
        .execute(&pool)
        .await
        .unwrap();
    let report = maintenance::run_once(&pool, Duration::from_secs(3600)).await.unwrap();
    assert_eq!((report.pruned, report.more_left), (1, false));
    assert!(admin::get(&pool, old).await.unwrap().is_none());
    assert!(admin::get(&pool, recent).await.unwrap().is_some());
    assert!(admin::get(&pool, waiting).await.unwrap().is_some());
}

/// Failed rows by their own retention: longer than the others', or forever.
#[tokio::test]
async fn failed_rows_are_pruned_by_their_own_retention() {
    let pool = common::database().await;
    let mut finished = Vec::new();
    for (state, age) in
        [("succeeded", "2 hours"), ("cancelled", "2 hours"), ("failed", "2 hours"), ("failed", "3 days")]
    {
        let id = common::enqueue(&pool, "noop", json!({})).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE rowq.jobs SET state = '{state}', finished_at = now() - interval '{age}' WHERE id = $1"
        )))
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
        finished.push(id);
    }
    let kept = |ids: Vec<JobId>| {
        let pool = pool.clone();
        async move {
            let mut kept = Vec::new();
            for id in ids {
                kept.push(admin::get(&pool, id).await.unwrap().is_some());
            }
            kept
        }
    };
    let hour = Duration::from_secs(3600);
    let forever = maintenance::Retention { done: hour, failed: Duration::ZERO };
    assert_eq!(maintenance::run_once(&pool, forever).await.unwrap().pruned, 2);
    assert_eq!(kept(finished.clone()).await, [false, false, true, true], "failed rows kept forever");
    let a_day = maintenance::Retention { done: hour, failed: hour * 24 };
    assert_eq!(maintenance::run_once(&pool, a_day).await.unwrap().pruned, 1);
    assert_eq!(kept(finished.clone()).await, [false, false, true, false], "failed rows kept a day");
}

/// One pass prunes at most 10 statements of 5,000 rows. A pass that stops there is followed by
/// the next at once, not after `maintenance_interval`: otherwise pruning has a ceiling
/// (10,000 rows a second at the default 5 s) that a busy queue's finished rows outgrow.
#[tokio::test]
async fn finished_rows_beyond_one_pass_are_pruned_without_waiting_for_the_next_interval() {
    let pool = common::database().await;
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, state, finished_at)
         SELECT 'noop', 'succeeded', now() - interval '2 days' FROM generate_series(1, 60000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut config = common::scheduler_config(MEMORY_URL);
    config.retention = Duration::from_secs(3600).into();
    config.maintenance_interval = Duration::from_secs(600);
    let (_, stop, running) = spawn_run(Scheduler::new(pool.clone(), MemoryPublisher::new(), config), false);
    common::eventually(Duration::from_secs(30), "every finished row past the retention to be pruned", || {
        let pool = pool.clone();
        async move {
            let left: i64 = sqlx::query_scalar("SELECT count(*) FROM rowq.jobs").fetch_one(&pool).await.ok()?;
            (left == 0).then_some(())
        }
    })
    .await;
    stop.send(true).unwrap();
    running.await.unwrap();
}

/// A rescue stops at 10 statements of 1,000 rows per pass too, and says that it left rows.
#[tokio::test]
async fn a_rescue_that_stops_at_the_round_limit_reports_rows_left() {
    let pool = common::database().await;
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, state, dispatch_gen, dispatch_deadline)
         SELECT 'noop', 'dispatched', 1, now() - interval '1 minute' FROM generate_series(1, 12000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let first = maintenance::run_once(&pool, Duration::ZERO).await.unwrap();
    assert_eq!((first.rescued_dispatched, first.more_left), (10_000, true));
    let second = maintenance::run_once(&pool, Duration::ZERO).await.unwrap();
    assert_eq!((second.rescued_dispatched, second.more_left), (2_000, false));
}

#[tokio::test]
async fn a_release_after_a_worker_started_the_job_leaves_it_running() {
    let pool = common::database().await;
    // The send timed out from the scheduler's side but reached SQS, and a worker already
    // started the job: the release must not put it back to pending (a second run).
    let id = common::enqueue(&pool, "noop", json!({})).await;
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    start(&pool, &[StartRequest { id, dispatch_gen: claimed[0].dispatch_gen, lease: Duration::from_secs(60) }])
        .await
        .unwrap();
    let released = rowq::store::dispatch::release(&pool, &[(id, claimed[0].dispatch_gen)]).await.unwrap();
    assert!(released.is_empty());
    assert_eq!(common::job(&pool, id).await.state, JobState::Running);

    // Nor may a release of an old generation touch a row claimed again since.
    sqlx::query("UPDATE rowq.jobs SET state = 'pending' WHERE id = $1").bind(id).execute(&pool).await.unwrap();
    let again = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    assert_eq!(again[0].dispatch_gen, 2);
    let released = rowq::store::dispatch::release(&pool, &[(id, 1)]).await.unwrap();
    assert!(released.is_empty());
    assert_eq!(common::job(&pool, id).await.state, JobState::Dispatched);
}

/// A publisher that, while it "sends", looks at the rows from another connection.
struct Inspecting {
    pool: PgPool,
    seen: std::sync::Mutex<Vec<JobState>>,
}

impl rowq::Publisher for Inspecting {
    async fn send_batch(
        &self,
        batch: &[rowq::sqs::Outgoing],
    ) -> Result<Vec<rowq::sqs::EntryFailure>, rowq::sqs::SqsError> {
        for outgoing in batch {
            let state: JobState = sqlx::query_scalar("SELECT state FROM rowq.jobs WHERE id = $1")
                .bind(outgoing.message.job_id)
                .fetch_one(&self.pool)
                .await
                .expect("read the row while publishing");
            self.seen.lock().unwrap().push(state);
        }
        Ok(Vec::new())
    }
}

#[tokio::test]
async fn claims_are_committed_before_anything_is_sent() {
    let pool = common::database().await;
    // If the claim's transaction were still open during the SQS call, another connection would
    // see the rows as pending, and a worker fast enough could not fence them.
    common::enqueue_many(&pool, "noop", 30).await;
    let inspecting = Inspecting { pool: pool.clone(), seen: Default::default() };
    let scheduler = Scheduler::new(pool.clone(), inspecting, common::scheduler_config(MEMORY_URL));
    assert_eq!(scheduler.run_once().await.unwrap().published, 30);
    let seen = scheduler.publisher().seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 30);
    assert!(
        seen.iter().all(|s| *s == JobState::Dispatched),
        "rows not committed as dispatched during publish: {seen:?}"
    );
}

#[tokio::test]
async fn claims_made_on_the_listener_connection_are_committed_before_anything_is_sent_too() {
    let pool = common::database().await;
    // The running scheduler claims on its listener's connection, not through `run_once`'s pool,
    // and with batches of 10 its second and third claims run while the first rows are sent.
    common::enqueue_many(&pool, "noop", 30).await;
    let mut config = common::scheduler_config(MEMORY_URL);
    config.claim_batch = 10;
    config.drain_for = Some(Duration::from_millis(500));
    let scheduler = Scheduler::new(pool.clone(), Inspecting { pool: pool.clone(), seen: Default::default() }, config);
    let (_keep, shutdown) = watch::channel(false);
    let published = scheduler.run(shutdown, false).await.published;
    let seen = scheduler.publisher().seen.lock().unwrap().clone();
    assert!(
        seen.iter().all(|s| *s == JobState::Dispatched),
        "rows not committed as dispatched during publish: {seen:?}"
    );
    assert_eq!((published, seen.len()), (30, 30));
}

#[tokio::test]
async fn a_job_id_used_again_after_the_table_is_recreated_is_not_dropped_by_sqs_deduplication() {
    let pool = common::database().await;
    // SQS silently drops a message whose dedup id it saw in the last five minutes. Job ids
    // come back after TRUNCATE ... RESTART IDENTITY or a restore from backup.
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(60)).await;
    let scheduler = Scheduler::new(
        pool.clone(),
        SqsPublisher::new(client.clone(), queues.queue_url.clone()),
        common::scheduler_config(&queues.queue_url),
    );
    let first = common::enqueue(&pool, "noop", json!({})).await;
    assert_eq!(scheduler.run_once().await.unwrap().published, 1);
    sqlx::query("TRUNCATE rowq.jobs RESTART IDENTITY").execute(&pool).await.unwrap();
    let again = common::enqueue(&pool, "noop", json!({})).await;
    assert_eq!(first, again, "the identity did not restart");
    assert_eq!(scheduler.run_once().await.unwrap().published, 1);

    let received = common::drain_queue(&client, &queues.queue_url, Duration::from_secs(2)).await;
    assert_eq!(received.len(), 2, "SQS dropped the second job as a duplicate of the first");
}

#[tokio::test]
async fn the_claim_alone_commits_without_waiting_for_the_disk() {
    let pool = common::database().await;
    common::enqueue(&pool, "noop", json!({})).await;
    let mut connection = pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *connection).await.unwrap();
    let claimed = sqlx::query(rowq::store::dispatch::CLAIM_SQL)
        .bind("default")
        .bind(10_i64)
        .bind(60_000_i64)
        .bind(1000_i64)
        .bind(500_i64)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let inside: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(inside, "off", "the claim's transaction waits for its WAL to reach the disk");
    tx.commit().await.unwrap();
    let after: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut *connection).await.unwrap();
    assert_eq!(after, "on", "the claim changed the setting for the rest of the session");
}

/// The schedulers' wake-up (after a group's job ended, a rescue) is a transaction of its own
/// that does not wait for the disk either, and leaves the session's setting as it was: the
/// fences and finishes that run on the same connections must wait for it.
#[tokio::test]
async fn a_wake_of_the_schedulers_commits_without_waiting_for_the_disk_and_reaches_them() {
    // Two connections: the listener's, and one for everything else.
    let pool = common::database_with(2).await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen(rowq::store::NOTIFY_CHANNEL).await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    sqlx::query(rowq::store::WAKE_SQL).bind("elsewhere").bind("group").execute(&mut *tx).await.unwrap();
    let inside: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(inside, "off", "the wake's transaction waits for its WAL to reach the disk");
    tx.rollback().await.unwrap();

    rowq::store::wake_schedulers(&pool, "group").await.unwrap();
    let after: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&pool).await.unwrap();
    assert_eq!(after, "on", "the wake changed the setting for the rest of the session");
    let notification = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.unwrap().unwrap();
    assert_eq!(notification.payload(), "group");
}

#[tokio::test]
async fn one_statement_claims_and_tells_when_the_next_delayed_job_is_due() {
    let pool = common::database().await;
    let at = chrono::Utc::now() + chrono::Duration::seconds(30);
    let mut delayed = NewJob::new("noop", json!({}));
    delayed.run_at = Some(at);
    enqueue_with(&pool, delayed).await;
    common::enqueue(&pool, "noop", json!({})).await;
    let claim =
        rowq::store::dispatch::claim_due_within(&pool, "default", 10, 1000, Duration::from_secs(60)).await.unwrap();
    assert_eq!((claim.jobs.len(), claim.in_flight_before), (1, 0));
    let next = claim.next_due.expect("the delayed job's run_at");
    assert!((next - at).num_milliseconds().abs() < 5, "{next} is not {at}");

    let empty =
        rowq::store::dispatch::claim_due_within(&pool, "default", 10, 1000, Duration::from_secs(60)).await.unwrap();
    assert!(empty.jobs.is_empty());
    assert_eq!(empty.in_flight_before, 1);
    assert_eq!(empty.next_due, claim.next_due);
}

/// With a poll interval of ten minutes, only the next due time the claim returns can wake the
/// scheduler for a delayed job: both when the claim took nothing and when it took a job due
/// now beside it (a short claim).
#[tokio::test]
async fn an_idle_scheduler_wakes_when_a_delayed_job_falls_due_not_at_its_poll_interval() {
    let pool = common::database().await;
    let (stop, running) = spawn_idle_scheduler(&pool);
    for with_a_due_job in [false, true] {
        let mut delayed = NewJob::new("noop", json!({}));
        delayed.run_at = Some(chrono::Utc::now() + chrono::Duration::milliseconds(1500));
        let delayed = enqueue_with(&pool, delayed).await;
        if with_a_due_job {
            let now = common::enqueue(&pool, "noop", json!({})).await;
            wait_dispatched(&pool, now, "the job due now").await;
        }
        wait_dispatched(&pool, delayed, "the delayed job, at its run_at").await;
    }
    stop.send(true).unwrap();
    assert_eq!(running.await.unwrap().published, 3);
}

#[tokio::test]
async fn the_scheduler_plans_its_statements_once_per_connection() {
    let pool = common::database().await;
    common::enqueue_many(&pool, "noop", 20).await;
    let own = rowq::store::connect_scheduler(&common::own_database_config(&pool, 1)).await.unwrap();
    for _ in 0..8 {
        rowq::store::dispatch::claim_due_within(&own, "default", 1, 1000, Duration::from_secs(60)).await.unwrap();
    }
    let (generic, custom): (i64, i64) = sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%in_flight AS%'",
    )
    .fetch_one(&own)
    .await
    .unwrap();
    assert_eq!((generic, custom), (8, 0), "the claim was planned again for its parameters");
}

#[tokio::test]
async fn a_connection_that_died_while_idle_is_replaced_before_use() {
    let pool = common::database().await;
    let own = rowq::store::connect(&common::own_database_config(&pool, 1), rowq::store::Session::Worker).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&own).await.unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&pool).await.unwrap();
    tokio::time::sleep(rowq::store::IDLE_BEFORE_PING + Duration::from_millis(200)).await;
    let replaced: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&own).await.unwrap();
    assert_ne!(replaced, pid);
}

/// Each pool of rowq's names its sessions for its part and rowq's version, as `pg_stat_activity`
/// shows them to whoever counts the connections or looks for a lock's holder; a URL that names
/// them itself keeps its name.
#[tokio::test]
async fn rowqs_sessions_name_their_part_and_version_unless_the_url_names_them() {
    use rowq::store::Session;
    let pool = common::database().await;
    let config = common::own_database_config(&pool, 1);
    async fn name_of(pool: PgPool) -> String {
        sqlx::query_scalar("SELECT application_name::text FROM pg_stat_activity WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap()
    }
    let version = env!("CARGO_PKG_VERSION");
    let scheduler = rowq::store::connect_scheduler(&config).await.unwrap();
    assert_eq!(name_of(scheduler).await, format!("rowq scheduler {version}"));
    for (session, part) in [(Session::Worker, "worker"), (Session::DlqHandler, "dlq-handler"), (Session::Cli, "cli")] {
        let own = rowq::store::connect_lazy(&config, session).unwrap();
        assert_eq!(name_of(own).await, format!("rowq {part} {version}"), "{session:?}");
    }
    let separator = if config.url.contains('?') { '&' } else { '?' };
    let named = rowq::config::DatabaseConfig {
        url: format!("{}{separator}application_name=billing-worker", config.url),
        ..config
    };
    let own = rowq::store::connect(&named, Session::Worker).await.unwrap();
    assert_eq!(name_of(own).await, "billing-worker");
}

/// A publisher whose sends wait until `open` says so (at most 10 s), counting what the table
/// holds `dispatched` when each send begins, and the sends that gave up waiting.
struct Gated {
    pool: PgPool,
    open: fn(i64) -> bool,
    dispatched_at_send: std::sync::Mutex<Vec<i64>>,
    gave_up: std::sync::atomic::AtomicUsize,
}

impl Gated {
    fn new(pool: &PgPool, open: fn(i64) -> bool) -> Self {
        Gated { pool: pool.clone(), open, dispatched_at_send: Default::default(), gave_up: Default::default() }
    }
}

impl rowq::Publisher for Gated {
    async fn send_batch(
        &self,
        _batch: &[rowq::sqs::Outgoing],
    ) -> Result<Vec<rowq::sqs::EntryFailure>, rowq::sqs::SqsError> {
        let dispatched = || async { common::count_in_state(&self.pool, JobState::Dispatched).await };
        let at_send = dispatched().await;
        self.dispatched_at_send.lock().unwrap().push(at_send);
        let started = Instant::now();
        while !(self.open)(dispatched().await) {
            if started.elapsed() > Duration::from_secs(10) {
                self.gave_up.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(Vec::new())
    }
}

#[tokio::test]
async fn the_next_claim_runs_while_the_rows_of_the_last_one_are_still_being_sent() {
    let pool = common::database().await;
    // Each send holds until a later claim has committed: a scheduler that claimed only after
    // its sends came back would hold every send for the full 10 s and see only its own rows.
    common::enqueue_many(&pool, "noop", 30).await;
    let mut config = common::scheduler_config(MEMORY_URL);
    config.claim_batch = 10;
    let gated = Gated::new(&pool, |dispatched| dispatched >= 20);
    let scheduler = Scheduler::new(pool.clone(), gated, config);
    let (_keep, shutdown) = watch::channel(false);
    let totals = scheduler.run(shutdown, true).await;
    assert_eq!((totals.claimed, totals.published), (30, 30));
    let gave_up = scheduler.publisher().gave_up.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(gave_up, 0, "a send waited 10 s for a claim that only came after it");
    let at_send = scheduler.publisher().dispatched_at_send.lock().unwrap().clone();
    assert_eq!(at_send.len(), 3, "{at_send:?}");
}

#[tokio::test]
async fn a_slow_queue_is_not_claimed_further_ahead_than_two_claims() {
    let pool = common::database().await;
    // While the first sends hang, the scheduler may have claimed the next batch, but not the
    // backlog: claimed rows that wait in its memory spend their dispatch lease.
    common::enqueue_many(&pool, "noop", 100).await;
    let mut config = common::scheduler_config(MEMORY_URL);
    config.claim_batch = 10;
    config.publish_concurrency = 1;
    let gated = Arc::new(Gated::new(&pool, |_| false));
    let (_, _keep, running) = spawn_run(Scheduler::new(pool.clone(), gated.clone(), config), true);
    common::eventually(Duration::from_secs(10), "the first send to begin", || {
        let gated = gated.clone();
        async move { (!gated.dispatched_at_send.lock().unwrap().is_empty()).then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dispatched = common::count_in_state(&pool, JobState::Dispatched).await;
    assert!((10..=20).contains(&dispatched), "{dispatched} rows claimed while one send of 10 hangs");
    running.abort();
}

#[tokio::test]
async fn after_a_failed_send_the_scheduler_claims_no_more_until_it_has_backed_off() {
    let pool = common::database().await;
    // The claim that was already running when the send failed may still come back (and its
    // rows go out or back to pending), but the pass must not go on through the backlog.
    common::enqueue_many(&pool, "noop", 100).await;
    let mut config = common::scheduler_config(MEMORY_URL);
    config.claim_batch = 10;
    // One send at a time, so that at most one claim more than the one being sent can be taken
    // before the failure is seen, however the sends and claims interleave: with 8 sends in flight,
    // a loaded machine let two more claims return before the first failed send was polled.
    config.publish_concurrency = 1;
    // Long enough for a few passes between backoffs; a pass that went on claiming would claim
    // (and release) the backlog again and again until the budget ran out.
    config.drain_for = Some(Duration::from_millis(700));
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), config);
    scheduler.publisher().set_failing(true);
    let (_keep, shutdown) = watch::channel(false);
    let totals = scheduler.run(shutdown, false).await;
    assert!(totals.passes >= 1);
    assert!(
        (10..=20 * totals.passes).contains(&totals.claimed),
        "claimed {} in {} failing passes",
        totals.claimed,
        totals.passes
    );
    assert_eq!((totals.published, totals.released), (0, totals.claimed));
    assert_eq!(common::count_in_state(&pool, JobState::Pending).await, 100);
}

#[tokio::test]
async fn the_scheduler_sessions_plan_no_sequential_scan_of_the_table() {
    let pool = common::database().await;
    // tests/plans.rs checks the plans under these settings; this checks the sessions get them.
    let own = rowq::store::connect_scheduler(&common::own_database_config(&pool, 1)).await.unwrap();
    let setting: String = sqlx::query_scalar("SHOW enable_seqscan").fetch_one(&own).await.unwrap();
    assert_eq!(setting, "off");
    let mut listener = sqlx::postgres::PgListener::connect_with(&own).await.unwrap();
    let setting: String = sqlx::query_scalar("SHOW enable_seqscan").fetch_one(&mut listener).await.unwrap();
    assert_eq!(setting, "off", "the listener's connection, where the claim runs, lacks the setting");
}

/// Held while a test's transaction is left open: such a transaction holds back the cleanup of
/// every database, so tests that name the holder must not meet another test's.
static HOLDERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// [`common::open_transaction`], its transaction id left out, taken once no other test of this
/// file holds one: keep the guard until the test's last look at the holders.
async fn open_transaction(url: &str, name: &str) -> (sqlx::PgConnection, i32, tokio::sync::MutexGuard<'static, ()>) {
    let alone = HOLDERS.lock().await;
    let (connection, pid, _xid) = common::open_transaction(url, name).await.unwrap();
    (connection, pid, alone)
}

async fn holder_pids(pool: &PgPool, open_for: Duration) -> Vec<Option<i32>> {
    let holders = rowq::store::maintenance::cleanup_holders(pool, open_for).await.unwrap();
    holders.iter().map(|holder| holder.pid).collect()
}

/// What `rowq stats` and the scheduler name when claims slow down: a transaction left open
/// anywhere in the cluster once it has a transaction id, one of this database as soon as it
/// has a snapshot, and neither once it ends.
#[tokio::test]
async fn a_transaction_left_open_is_named_as_holding_back_the_cleanup() {
    let pool = common::database().await;
    let name = format!("rowq-test-holder-{}", std::process::id());
    let (mut here, here_pid, _alone) = open_transaction(&common::url_of(&pool), &name).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let holders = rowq::store::maintenance::cleanup_holders(&pool, Duration::from_secs(1)).await.unwrap();
    let holder = holders.iter().find(|holder| holder.pid == Some(here_pid)).expect("the open transaction is named");
    assert_eq!(holder.kind, "session");
    assert_eq!(holder.name.as_deref(), Some(name.as_str()));
    assert_eq!(holder.state.as_deref(), Some("idle in transaction"));
    assert!(holder.open_secs.is_some_and(|secs| secs >= 1.0), "{holder:?}");
    assert!(holder.to_string().starts_with(&format!("session {here_pid} (\"{name}\"")), "{holder}");
    assert!(
        !holder_pids(&pool, Duration::from_secs(60)).await.contains(&Some(here_pid)),
        "named before it was open for the time asked"
    );
    sqlx::query("COMMIT").execute(&mut here).await.unwrap();
    assert!(!holder_pids(&pool, Duration::ZERO).await.contains(&Some(here_pid)), "named after it ended");

    // Another database's session holds this one back only once it has a transaction id.
    use sqlx::Connection;
    let mut reader = sqlx::PgConnection::connect(&common::database_url("postgres")).await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut reader).await.unwrap();
    let reader_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut reader).await.unwrap();
    assert!(
        !holder_pids(&pool, Duration::ZERO).await.contains(&Some(reader_pid)),
        "another database's snapshot does not hold this one's cleanup back"
    );
    sqlx::query("SELECT txid_current()").execute(&mut reader).await.unwrap();
    assert!(holder_pids(&pool, Duration::ZERO).await.contains(&Some(reader_pid)));
    sqlx::query("ROLLBACK").execute(&mut reader).await.unwrap();
}

/// A role without `pg_read_all_stats` (a scheduler not granted `pg_monitor`) sees another
/// role's session without its start, state, statement or backend type: the session is still
/// named, as an untimed holder.
#[tokio::test]
async fn another_roles_transaction_is_named_to_a_role_that_cannot_see_its_details() {
    use sqlx::{ConnectOptions, Connection};
    let pool = common::database().await;
    let role = format!("rowq_test_plain_{}", std::process::id());
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}"))).execute(&pool).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE {role} LOGIN"))).execute(&pool).await.unwrap();
    let url = common::url_of(&pool);
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let mut plain = options.username(&role).connect().await.unwrap();
    let (mut holder, pid, _alone) = open_transaction(&url, "rowq-test-hidden-holder").await;

    // Open for an hour: no holder of this test run qualifies by its time, only untimed ones.
    let holders =
        rowq::store::maintenance::cleanup_holders_behind(&mut plain, Duration::from_secs(3600), 0).await.unwrap();
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    plain.close().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE {role}"))).execute(&pool).await.unwrap();
    let seen = holders.iter().find(|holder| holder.pid == Some(pid)).expect("the hidden session is named");
    assert_eq!((seen.kind.as_str(), seen.open_secs, seen.state.as_deref()), ("session", None, None), "{seen:?}");
}

/// Everything `tracing` writes while it is the thread's subscriber, as text.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Captures this thread's log lines of `level` and above (the test's runtime has one
    /// thread, so its spawned tasks' too) until the guard is dropped.
    fn logs(level: tracing::Level) -> (Captured, tracing::subscriber::DefaultGuard) {
        let captured = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer({
                let captured = captured.clone();
                move || captured.clone()
            })
            .with_ansi(false)
            .with_max_level(level)
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Claims slow down while the cleanup is held back, and nothing else in the scheduler's logs
/// says why: its maintenance names the transaction, once per `cleanup_warn_after`.
#[tokio::test]
async fn the_scheduler_warns_of_a_transaction_holding_back_the_cleanup() {
    let pool = common::database().await;
    let (captured, _logging) = Captured::logs(tracing::Level::WARN);
    let (mut holder, pid, _alone) = open_transaction(&common::url_of(&pool), "rowq-test-scheduler-holder").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let mut config = common::scheduler_config(MEMORY_URL);
    config.cleanup_warn_after = Some(Duration::from_secs(1));
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), config);
    for _ in 0..2 {
        let (_keep, shutdown) = watch::channel(false);
        scheduler.run(shutdown, true).await;
    }
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let logged = captured.text();
    let warning = "cleanup held back by session";
    assert_eq!(logged.matches(warning).count(), 1, "one warning per cleanup_warn_after: {logged}");
    // It names the oldest holder: this one (no other test holds one meanwhile, `HOLDERS`).
    let line = logged.lines().find(|line| line.contains(warning)).unwrap_or_default();
    assert!(line.contains(", open for ") && line.contains("transactions behind"), "{line}");
    assert!(line.contains(&format!("holder.pid={pid}")), "{line}");
}

/// The gauges the scheduler reports as metrics read its own queue's unfinished rows only, by
/// state: what is due and how long it has waited, what is dispatched, what is running.
#[tokio::test]
async fn a_queues_gauges_count_its_due_dispatched_and_running_jobs_and_the_oldest_wait() {
    let pool = common::database().await;
    let empty = admin::queue_gauges(&pool, "default").await.unwrap();
    let nothing = admin::QueueGauges {
        oldest_due_pending_secs: 0.0,
        oldest_claimable_secs: 0.0,
        due_pending: 0,
        dispatched: 0,
        running: 0,
        paused: false,
    };
    assert_eq!(empty, nothing);

    sqlx::query(
        "INSERT INTO rowq.jobs (kind, queue, run_at, state) VALUES
            ('noop', 'default', now() - interval '90 seconds', 'pending'),
            ('noop', 'default', now(), 'pending'),
            ('noop', 'default', now() + interval '1 hour', 'pending'),
            ('noop', 'default', now() - interval '1 day', 'dispatched'),
            ('noop', 'default', now() - interval '1 day', 'dispatched'),
            ('noop', 'default', now() - interval '1 day', 'running'),
            ('noop', 'default', now() - interval '1 day', 'succeeded'),
            ('noop', 'default', now() - interval '1 day', 'failed'),
            ('noop', 'other', now() - interval '1 hour', 'pending'),
            ('noop', 'other', now() - interval '1 hour', 'dispatched'),
            ('noop', 'other', now() - interval '1 hour', 'running')",
    )
    .execute(&pool)
    .await
    .unwrap();
    admin::pause(&pool, "other", None).await.unwrap();
    let gauges = admin::queue_gauges(&pool, "default").await.unwrap();
    assert!((90.0..100.0).contains(&gauges.oldest_due_pending_secs), "{gauges:?}");
    assert_eq!(gauges.oldest_claimable_secs, gauges.oldest_due_pending_secs, "no group holds one back: {gauges:?}");
    assert_eq!((gauges.due_pending, gauges.dispatched, gauges.running), (2, 2, 1), "{gauges:?}");
    assert!(!gauges.paused, "another queue is paused, not this one: {gauges:?}");
    admin::pause(&pool, "default", None).await.unwrap();
    assert!(admin::queue_gauges(&pool, "default").await.unwrap().paused);
}

/// Jobs waiting behind an unfinished job of their group (running, dispatched, or pending in
/// its backoff) are due, and users wait for them, but no claim would take them: the claimable
/// wait, which the backlog alarm reads, leaves them out, and counts a group's head.
#[tokio::test]
async fn the_claimable_wait_leaves_out_jobs_behind_their_group() {
    let pool = common::database().await;
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, group_key, run_at, state) VALUES
            ('noop', 'running', now() - interval '2 hours', 'running'),
            ('noop', 'running', now() - interval '1 hour', 'pending'),
            ('noop', 'dispatched', now() - interval '2 hours', 'dispatched'),
            ('noop', 'dispatched', now() - interval '50 minutes', 'pending'),
            ('noop', 'backoff', now() + interval '1 hour', 'pending'),
            ('noop', 'backoff', now() - interval '40 minutes', 'pending'),
            ('noop', 'done', now() - interval '3 hours', 'succeeded'),
            ('noop', 'done', now() - interval '20 minutes', 'pending'),
            ('noop', 'done', now() - interval '30 minutes', 'pending'),
            ('noop', NULL, now() - interval '10 minutes', 'pending')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let gauges = admin::queue_gauges(&pool, "default").await.unwrap();
    let minutes = |secs: f64| (secs / 60.0).round();
    assert_eq!(minutes(gauges.oldest_due_pending_secs), 60.0, "{gauges:?}");
    // 'done': its first unfinished job (id order, not run_at order) is its head: 20 minutes.
    assert_eq!(minutes(gauges.oldest_claimable_secs), 20.0, "{gauges:?}");
    assert_eq!(gauges.due_pending, 6, "{gauges:?}");

    sqlx::query("UPDATE rowq.jobs SET state = 'dispatched' WHERE group_key = 'done' OR group_key IS NULL")
        .execute(&pool)
        .await
        .unwrap();
    let gauges = admin::queue_gauges(&pool, "default").await.unwrap();
    assert_eq!(gauges.oldest_claimable_secs, 0.0, "every due job is behind its group: {gauges:?}");
    assert_eq!(minutes(gauges.oldest_due_pending_secs), 60.0, "{gauges:?}");
}

/// The claimable wait tests at most `CLAIMABLE_WINDOW` due jobs for their group: when all of
/// them wait behind it, it reads the youngest of their waits, which no claimable job exceeds.
#[tokio::test]
async fn the_claimable_wait_looks_no_further_than_its_window() {
    let pool = common::database().await;
    let insert = "INSERT INTO rowq.jobs (kind, group_key, run_at, state)
         SELECT 'noop', 'long', now() - interval '1 day', 'running'::rowq.job_state
         UNION ALL
         SELECT 'noop', 'long', now() - n * interval '1 second', 'pending' FROM generate_series(1, $1) n
         UNION ALL
         SELECT 'noop', NULL, now() - interval '1 second', 'pending'";
    common::insert_unmarked(&pool, insert, admin::CLAIMABLE_WINDOW + 100).await.unwrap();
    let gauges = admin::queue_gauges(&pool, "default").await.unwrap();
    // The window ends at the job due 101 s ago; the claimable one, due 1 s ago, is beyond it.
    let youngest_in_window = 101.0;
    assert!((youngest_in_window..youngest_in_window + 30.0).contains(&gauges.oldest_claimable_secs), "{gauges:?}");
    let oldest = (admin::CLAIMABLE_WINDOW + 100) as f64;
    assert!((oldest..oldest + 30.0).contains(&gauges.oldest_due_pending_secs), "{gauges:?}");
}

/// Jobs the claim has set aside behind their group are not read by the claimable wait: a group's
/// backlog deeper than `CLAIMABLE_WINDOW`, once set aside, leaves the wait of the claimable jobs
/// behind it, not of the window's youngest (which would page the backlog alarm for as long as
/// the group's backlog lasts). And the oldest claimable job is the oldest of every priority's.
#[tokio::test]
async fn a_groups_backlog_set_aside_does_not_hold_up_the_claimable_wait() {
    let pool = common::database().await;
    let backlog = admin::CLAIMABLE_WINDOW + 100;
    let insert = "INSERT INTO rowq.jobs (kind, group_key, run_at, state)
         SELECT 'noop', 'import', now() - interval '1 day', 'running'::rowq.job_state
         UNION ALL
         SELECT 'noop', 'import', now() - interval '2 hours' + n * interval '10 ms', 'pending'
         FROM generate_series(1, $1) n
         UNION ALL
         SELECT 'noop', NULL, now() - interval '1 minute', 'pending'";
    common::insert_unmarked(&pool, insert, backlog).await.unwrap();
    let minutes = |secs: f64| (secs / 60.0).round();
    let before = admin::queue_gauges(&pool, "default").await.unwrap();
    assert_eq!(minutes(before.oldest_claimable_secs), 118.0, "none set aside yet: the window's youngest {before:?}");

    let window = rowq::store::dispatch::SET_ASIDE_WINDOW_MAX;
    let claim = rowq::store::dispatch::claim_setting_aside(&pool, "default", 0, 100, Duration::from_secs(60), window)
        .await
        .unwrap();
    assert_eq!(claim.set_aside, backlog, "{claim:?}");
    let gauges = admin::queue_gauges(&pool, "default").await.unwrap();
    assert_eq!(minutes(gauges.oldest_claimable_secs), 1.0, "{gauges:?}");
    assert_eq!(minutes(gauges.oldest_due_pending_secs), 120.0, "users wait for the set-aside jobs: {gauges:?}");

    // Another priority's older job is older, whichever way the priorities lie.
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, priority, run_at) VALUES
            ('noop', 5, now() - interval '5 minutes'), ('noop', -5, now() - interval '10 minutes')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let gauges = admin::queue_gauges(&pool, "default").await.unwrap();
    assert_eq!(minutes(gauges.oldest_claimable_secs), 10.0, "{gauges:?}");
}

/// A backlog of millions costs the gauges no more than a scan of `GAUGE_COUNT_CAP` entries.
#[tokio::test]
async fn the_due_count_of_the_gauges_stops_at_its_cap() {
    let pool = common::database().await;
    sqlx::query("INSERT INTO rowq.jobs (kind) SELECT 'noop' FROM generate_series(1, $1)")
        .bind(admin::GAUGE_COUNT_CAP + 5)
        .execute(&pool)
        .await
        .unwrap();
    let gauges = admin::queue_gauges(&pool, "default").await.unwrap();
    assert_eq!(gauges.due_pending, admin::GAUGE_COUNT_CAP);
}

/// `n` jobs of `group`, each enqueued in a transaction of its own, as producers enqueue a
/// group's jobs over time: the claims set them aside, not the insert (which sets aside only
/// the jobs behind one its own transaction inserted: DESIGN 36, "At insert").
async fn enqueue_group(pool: &PgPool, group: &str, n: i64) -> Vec<JobId> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let insert = sqlx::query_scalar("INSERT INTO rowq.jobs (kind, group_key) VALUES ('noop', $1) RETURNING id");
        ids.push(insert.bind(group).fetch_one(pool).await.unwrap());
    }
    ids
}

/// How many jobs are set aside behind their group.
async fn set_aside_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rowq.jobs WHERE behind_group").fetch_one(pool).await.unwrap()
}

async fn succeed(pool: &PgPool, id: JobId) {
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
}

/// The rows each read of `index` by a claim reads (those it returns and those it filters out),
/// by `EXPLAIN ANALYZE` in a transaction rolled back, in a session set as the scheduler's.
async fn rows_the_claim_reads(pool: &PgPool, index: &str) -> Vec<i64> {
    let mut tx = pool.begin().await.unwrap();
    for (setting, value) in rowq::store::SCHEDULER_SESSION {
        let set = format!("SET LOCAL {setting} = {value}");
        sqlx::query(sqlx::AssertSqlSafe(set)).execute(&mut *tx).await.unwrap();
    }
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", rowq::store::dispatch::CLAIM_SQL);
    let explained: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
        .bind("default")
        .bind(100_i64)
        .bind(60_000_i64)
        .bind(1000_i64)
        .bind(100_i64)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    fn walk(plan: &serde_json::Value, index: &str, reads: &mut Vec<i64>) {
        if plan.get("Index Name").and_then(|name| name.as_str()) == Some(index) {
            // A count per loop, which PostgreSQL 18 prints with two decimals (1.00).
            let rows = |key: &str| plan.get(key).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
            reads.push((rows("Actual Rows") + rows("Rows Removed by Filter")).round() as i64);
        }
        for child in plan.get("Plans").and_then(|plans| plans.as_array()).into_iter().flatten() {
            walk(child, index, reads);
        }
    }
    let mut reads = Vec::new();
    walk(&explained[0]["Plan"], index, &mut reads);
    reads
}

/// A group's backlog behind its running head (docs/DESIGN.md, 36): the claims set it aside once,
/// and from then on read past none of it, while the jobs behind it are claimed at once; each
/// job of the group goes when the one before it ends.
#[tokio::test]
async fn a_groups_backlog_is_set_aside_once_and_no_claim_reads_it_again() {
    let pool = common::database().await;
    let group = enqueue_group(&pool, "tenant-1", 2000).await;
    let loose = common::enqueue_many(&pool, "noop", 10).await;
    let scheduler = memory_scheduler(&pool);

    let report = scheduler.run_once().await.unwrap();
    let mut expected = vec![group[0]];
    expected.extend(&loose);
    assert_eq!(sent_ids(&scheduler), expected, "the group's head and the jobs behind the backlog");
    assert_eq!(report.set_aside, 99, "a claim reads as many jobs as it may take (100): {report:?}");
    assert!(report.full, "a claim that set jobs aside is not followed by the next at once");
    // A scheduler's run goes on claiming while its claims set jobs aside.
    let (drainer, _stop, running) = spawn_run(memory_scheduler(&pool), true);
    assert_eq!(running.await.unwrap().claimed, 0);
    assert!(drainer.publisher().take().is_empty());
    assert_eq!(set_aside_count(&pool).await, 1999);

    let later = common::enqueue(&pool, "noop", json!({})).await;
    assert_eq!(
        rows_the_claim_reads(&pool, "jobs_claimable_idx").await,
        vec![1, 1],
        "the claim (and its window of jobs to set aside) read more than the one new job: the backlog again"
    );
    // This scheduler's last claim found its window full of the group's jobs: its next only sets
    // aside, and finding nothing more to, says that a claim should follow at once.
    let report = scheduler.run_once().await.unwrap();
    assert!(report.full && report.claimed == 0, "{report:?}");
    scheduler.run_once().await.unwrap();
    assert_eq!(sent_ids(&scheduler), vec![later]);

    for n in 1..4 {
        succeed(&pool, group[n - 1]).await;
        let report = scheduler.run_once().await.unwrap();
        assert_eq!(sent_ids(&scheduler), vec![group[n]], "the group's next job once the one before it ended");
        assert_eq!(report.set_aside, 0, "{report:?}");
    }
    assert_eq!(set_aside_count(&pool).await, 1996);
}

/// A claim marks a job as behind its group only while it holds a lock on an earlier unfinished
/// job of the group. Here the statement that ends the group's head has run, and not committed,
/// when the claim looks: the claim still sees the head unfinished, so it does not claim the
/// next job, and it must not set it aside either, since the head's trigger has already looked for
/// a mark to clear and found none. Once the head's end commits, the next job is claimed.
#[tokio::test]
async fn no_job_is_set_aside_behind_a_job_whose_end_is_being_committed() {
    let pool = common::database().await;
    let head = enqueue_with(&pool, group_job("tenant-2", 1)).await;
    let lease = Duration::from_secs(60);
    assert_eq!(claim_due(&pool, "default", 10, lease).await.unwrap().len(), 1);
    let next = enqueue_with(&pool, group_job("tenant-2", 2)).await;

    let mut ending = pool.begin().await.unwrap();
    sqlx::query("UPDATE rowq.jobs SET state = 'cancelled', finished_at = now() WHERE id = $1")
        .bind(head)
        .execute(&mut *ending)
        .await
        .unwrap();
    let claim = rowq::store::dispatch::claim_due_within(&pool, "default", 10, 1000, lease).await.unwrap();
    assert!(claim.jobs.is_empty(), "the next job was claimed before its head ended");
    assert_eq!(claim.set_aside, 0, "the next job was set aside behind a head that was ending");
    ending.commit().await.unwrap();

    let claimed: Vec<JobId> = claim_due(&pool, "default", 10, lease).await.unwrap().into_iter().map(|c| c.id).collect();
    assert_eq!(claimed, vec![next], "the next job is left set aside behind a head that has ended");
}

/// The lock that lets a claim set a job aside is on the group's first unfinished job, and only
/// that one. Here the statement that ends the group's running head holds its row when a claim
/// looks at a later job: had the claim locked the next unfinished job instead (the one set aside
/// behind the head), the head's trigger, which skips a locked row, would leave that job's mark
/// in place with nothing before it, until maintenance.
#[tokio::test]
async fn a_claim_looking_while_a_head_ends_leaves_the_job_behind_the_head_to_be_released() {
    let pool = common::database().await;
    let lease = Duration::from_secs(60);
    let group = enqueue_group(&pool, "tenant-9", 2).await;
    let (head, next) = (group[0], group[1]);
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![head], 1));
    let last = enqueue_with(&pool, group_job("tenant-9", 3)).await;

    let mut ending = pool.begin().await.unwrap();
    sqlx::query("SELECT FROM rowq.jobs WHERE id = $1 FOR UPDATE").bind(head).execute(&mut *ending).await.unwrap();
    let mut claiming = pool.begin().await.unwrap();
    let claim = rowq::store::dispatch::claim_due_within(&mut *claiming, "default", 10, 1000, lease).await.unwrap();
    assert!(claim.jobs.is_empty(), "{claim:?}");
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(head)
        .execute(&mut *ending)
        .await
        .unwrap();
    ending.commit().await.unwrap();
    claiming.commit().await.unwrap();

    assert_eq!(claim_due_within_ids(&pool, lease).await.0, vec![next], "the job behind the head was left set aside");
    succeed(&pool, next).await;
    assert_eq!(claim_due_within_ids(&pool, lease).await.0, vec![last]);
}

/// The jobs of a group imported by one transaction are set aside by the insert itself once 16
/// or more of the group's jobs are before them (here over two statements), so that no claim has
/// to set those aside; the claims take the group's jobs one at a time in id order, each released
/// as the one before it ends. A row an `ON CONFLICT DO NOTHING` left out is no earlier job: the
/// row after it is not set aside behind it.
#[tokio::test]
async fn a_groups_jobs_imported_by_one_transaction_are_set_aside_by_the_insert() {
    let pool = common::database().await;
    let lease = Duration::from_secs(60);
    let mut import = pool.begin().await.unwrap();
    let insert =
        "INSERT INTO rowq.jobs (kind, group_key) SELECT 'noop', 'tenant-10' FROM generate_series(1, $1) RETURNING id";
    let mut group: Vec<JobId> = sqlx::query_scalar(insert).bind(18_i64).fetch_all(&mut *import).await.unwrap();
    group.extend(sqlx::query_scalar::<_, JobId>(insert).bind(2_i64).fetch_all(&mut *import).await.unwrap());
    import.commit().await.unwrap();
    let marks: Vec<bool> = sqlx::query_scalar("SELECT behind_group FROM rowq.jobs WHERE id = ANY($1) ORDER BY id")
        .bind(&group)
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(marks, [[false; 16].as_slice(), &[true; 4]].concat(), "set aside at insert: each behind 16 or more");
    for &job in &group {
        assert_eq!(claim_due_within_ids(&pool, lease).await.0, vec![job], "the group's next job, in id order");
        succeed(&pool, job).await;
    }
    assert_eq!(set_aside_count(&pool).await, 0);

    let holder = enqueue_with(&pool, NewJob { dedup_key: Some("k".into()), ..NewJob::new("noop", json!({})) }).await;
    let after_left_out: JobId = sqlx::query_scalar(
        "INSERT INTO rowq.jobs (kind, group_key, dedup_key)
         SELECT 'noop', 'tenant-11', CASE WHEN n = 16 THEN 'k' END FROM generate_series(1, 18) n
         ON CONFLICT DO NOTHING RETURNING id",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .max()
    .unwrap();
    let marked: Vec<JobId> =
        sqlx::query_scalar("SELECT id FROM rowq.jobs WHERE behind_group").fetch_all(&pool).await.unwrap();
    assert_eq!(
        marked,
        vec![after_left_out],
        "the 18th row, behind 16 inserted; not the 17th, behind 15 and one left out"
    );
    let claimed = claim_due_within_ids(&pool, lease).await.0;
    assert_eq!(claimed[..1], [holder]);
}

/// The insert sets a job aside only behind an earlier job its own transaction inserted. Behind
/// another transaction's unfinished job it may not: that job can end while the insert is
/// uncommitted, and the statement that ends it cannot see the new row to clear its mark. Here
/// the group's 16 jobs end between the insert and its commit; the job must still be claimed (it
/// was left set aside with nothing before it when the insert marked it behind any unfinished
/// job).
#[tokio::test]
async fn a_job_inserted_behind_another_transactions_job_is_left_for_the_claim_to_set_aside() {
    let pool = common::database().await;
    let lease = Duration::from_secs(60);
    let before = enqueue_group(&pool, "tenant-12", 16).await;

    let mut inserting = pool.begin().await.unwrap();
    // A job of another group first: the transaction's first grouped job is never looked at.
    sqlx::query("INSERT INTO rowq.jobs (kind, group_key) VALUES ('noop', 'tenant-13')")
        .execute(&mut *inserting)
        .await
        .unwrap();
    let next: JobId =
        sqlx::query_scalar("INSERT INTO rowq.jobs (kind, group_key) VALUES ('noop', 'tenant-12') RETURNING id")
            .fetch_one(&mut *inserting)
            .await
            .unwrap();
    // Their release trigger cannot see `next`.
    sqlx::query("UPDATE rowq.jobs SET state = 'cancelled', finished_at = now() WHERE id = ANY($1)")
        .bind(&before)
        .execute(&pool)
        .await
        .unwrap();
    inserting.commit().await.unwrap();

    assert_eq!(set_aside_count(&pool).await, 0, "set aside behind jobs of another transaction");
    assert_eq!(
        claim_due_within_ids(&pool, lease).await.0[1..],
        [next],
        "the job was left set aside with nothing before it"
    );
}

/// A drain of many small groups, run by the scheduler and a worker with maintenance held off:
/// every job runs, each group one at a time in id order, and none waits for maintenance to
/// clear a mark left on it with nothing before it. With the claim locking the first earlier
/// job it could (not the group's first unfinished one), such marks were left behind as heads
/// ended beside claims (82 of 20,000 in `make bench`'s grouped drain), and this drain stalled.
/// The scheduler polls a minute apart, so the drain's tail moves on the group wakes alone (with
/// the batch's wake left out, this timed out).
#[tokio::test]
async fn a_drain_of_many_small_groups_needs_no_maintenance_to_finish() {
    drain_small_groups(common::database_with(20).await, false).await;
}

/// The same drain with each batch handled as a process that holds several at once handles it
/// (`handle_batch_then` with `ran`): the group wakes go to the worker's task, which folds those
/// asked while one is on its way into one more, against a live database and scheduler. With the
/// task not asked, a group's next job waited for the scheduler's poll, a minute away, and this
/// timed out; that no ask is lost in the folding is the worker's unit test
/// (`asks_during_a_run_are_folded_into_one_run_after_it`).
#[tokio::test]
async fn a_drain_of_many_small_groups_through_pollers_moves_on_their_folded_wakes() {
    drain_small_groups(common::database_with(20).await, true).await;
}

/// Drains 6,000 jobs in groups of about four through the scheduler (maintenance held off, its
/// poll a minute apart) and eight pollers of one worker, their batches handed over as a process
/// holding several does (`background`) or as Lambda does, in `pool`'s database (each test opens
/// its own: its name is the caller's line); checks every group ran in order. The jobs are
/// enqueued as by many transactions, so that the claims set them aside (DESIGN 36: the lock that
/// guards it is what this drain once stalled on).
async fn drain_small_groups(pool: PgPool, background: bool) {
    const JOBS: i64 = 6000;
    let insert = "INSERT INTO rowq.jobs (kind, group_key)
         SELECT 'noop', 'g' || abs(hashint4(i::int) % ($1 / 4)) FROM generate_series(1, $1) i";
    common::insert_unmarked(&pool, insert, JOBS).await.unwrap();
    let mut config = common::scheduler_config(MEMORY_URL);
    config.maintenance_interval = Duration::from_secs(600);
    config.poll_interval = Duration::from_secs(60);
    let (scheduler, stop, running) = spawn_run(Scheduler::new(pool.clone(), MemoryPublisher::new(), config), false);
    let worker = Arc::new(Worker::new(pool.clone(), Registry::builtin(), common::worker_config()));
    let pollers: Vec<JoinHandle<()>> = (0..8)
        .map(|poller| {
            let (scheduler, worker, mut stopped) = (scheduler.clone(), worker.clone(), stop.subscribe());
            tokio::spawn(async move {
                while !*stopped.borrow_and_update() {
                    let sent = scheduler.publisher().receive(10, Duration::from_millis(50)).await;
                    if sent.is_empty() {
                        continue;
                    }
                    let (event, deadline) =
                        (common::event(common::records_of(&sent)), Instant::now() + Duration::from_secs(30));
                    if background {
                        let (ran, _handlers_returned) = tokio::sync::oneshot::channel();
                        worker.handle_batch_then(event, deadline, poller, Some(ran)).await;
                    } else {
                        worker.handle_batch(event, deadline).await;
                    }
                }
            })
        })
        .collect();
    common::eventually(Duration::from_secs(30), "every grouped job to succeed without maintenance or a poll", || {
        let pool = pool.clone();
        async move { (common::count_in_state(&pool, JobState::Succeeded).await == JOBS).then_some(()) }
    })
    .await;
    stop.send(true).unwrap();
    running.await.unwrap();
    for poller in pollers {
        poller.await.unwrap();
    }
    let overlapping: i64 = sqlx::query_scalar(common::GROUP_JOBS_OUT_OF_ORDER_SQL).fetch_one(&pool).await.unwrap();
    assert_eq!(overlapping, 0, "jobs of a group ran side by side or out of order");
}

/// The mark means "pending, and behind its group": a set-aside job that is cancelled loses it,
/// so that retried later, when nothing is before it, it is claimed. And whatever a client
/// writes into the column on INSERT is ignored.
#[tokio::test]
async fn a_set_aside_job_cancelled_and_retried_first_of_its_group_is_claimed() {
    let pool = common::database().await;
    let group = enqueue_group(&pool, "tenant-3", 2).await;
    let lease = Duration::from_secs(60);
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![group[0]], 1));

    assert!(admin::cancel(&pool, group[1]).await.unwrap().is_some());
    assert_eq!(set_aside_count(&pool).await, 0, "a cancelled job kept its mark");
    succeed(&pool, group[0]).await;
    assert!(admin::retry(&pool, group[1]).await.unwrap().is_some());
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![group[1]], 0));

    let inserted: JobId = sqlx::query_scalar(
        "INSERT INTO rowq.jobs (kind, group_key, behind_group) VALUES ('noop', 'tenant-4', true) RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![inserted], 0), "a client's mark was kept");
}

/// The ids one claim took, and how many jobs it set aside.
async fn claim_due_within_ids(pool: &PgPool, lease: Duration) -> (Vec<JobId>, i64) {
    let claim = rowq::store::dispatch::claim_due_within(pool, "default", 10, 1000, lease).await.unwrap();
    (claim.jobs.into_iter().map(|c| c.id).collect(), claim.set_aside)
}

/// A group's unfinished job deleted by hand releases the job set aside behind it, as its end
/// would; and a mark left on a job with nothing before it (a row the release trigger found
/// locked, or a client's write) is cleared by maintenance, which leaves a job that is rightly
/// set aside alone.
#[tokio::test]
async fn a_deleted_head_releases_its_group_and_maintenance_releases_a_mark_left_behind() {
    let pool = common::database().await;
    let lease = Duration::from_secs(60);
    let deleted = enqueue_group(&pool, "tenant-5", 2).await;
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![deleted[0]], 1));
    sqlx::query("DELETE FROM rowq.jobs WHERE id = $1").bind(deleted[0]).execute(&pool).await.unwrap();
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![deleted[1]], 0));

    let stranded = enqueue_group(&pool, "tenant-6", 1).await[0];
    let behind = enqueue_group(&pool, "tenant-7", 2).await;
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![stranded, behind[0]], 1));
    let another = enqueue_with(&pool, group_job("tenant-6", 2)).await;
    succeed(&pool, stranded).await;
    sqlx::query("UPDATE rowq.jobs SET behind_group = true WHERE id = $1").bind(another).execute(&pool).await.unwrap();
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![], 0), "a marked job was claimed");

    let report = maintenance::run_once(&pool, Duration::ZERO).await.unwrap();
    assert_eq!(report.released, 1, "{report:?}");
    assert_eq!(set_aside_count(&pool).await, 1, "the job rightly set aside was released too");
    assert_eq!(claim_due_within_ids(&pool, lease).await, (vec![another], 0));
}
