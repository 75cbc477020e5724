//! The whole path through LocalStack SQS: scheduler → FIFO queue → local event source →
//! worker → row; duplicates on the wire; dead letters.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent};
use rowq::event_source::{EventSource, HandlersReturned};
use rowq::pipeline::Pipeline;
use rowq::store::dispatch::claim_due;
use rowq::store::run::{StartRequest, start};
use rowq::{JobContext, JobError, JobMessage, JobState, Registry, Scheduler, SqsPublisher, Worker, dlq};
use serde_json::json;
use sqlx::PgPool;

fn effect_registry() -> Registry {
    Registry::builtin().register("effect", |ctx: JobContext, _: serde_json::Value| async move {
        sqlx::query("INSERT INTO effects (job_id, attempt) VALUES ($1, $2)")
            .bind(ctx.job_id)
            .bind(ctx.attempt)
            .execute(&mut **ctx.tx().await?)
            .await
            .map_err(JobError::from)?;
        Ok(())
    })
}

async fn create_effects(pool: &PgPool) {
    sqlx::query("CREATE TABLE effects (job_id bigint NOT NULL, attempt int NOT NULL, UNIQUE (job_id, attempt))")
        .execute(pool)
        .await
        .unwrap();
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test]
async fn every_message_delivered_twice_still_runs_each_job_once() {
    let pool = common::database().await;
    const JOBS: i64 = 300;
    create_effects(&pool).await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let ids = common::enqueue_many(&pool, "effect", JOBS).await;
    let scheduler = Scheduler::new(
        pool.clone(),
        SqsPublisher::new(client.clone(), queues.queue_url.clone()),
        common::scheduler_config(&queues.queue_url),
    );
    let (_keep, shutdown) = tokio::sync::watch::channel(false);
    assert_eq!(scheduler.run(shutdown, true).await.published as i64, JOBS);

    // A second copy of every message, with another dedup id so SQS does not drop it.
    let copies: Vec<(rowq::JobId, i64)> = ids.iter().map(|id| (*id, 1)).collect();
    let sent = common::send_job_messages(&client, &queues.queue_url, &copies, "duplicate").await.unwrap();
    assert_eq!(sent, copies.len());

    let source = Arc::new(
        EventSource::new(client.clone(), &queues.queue_url, Duration::from_secs(1), Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let worker = Arc::new(Worker::new(pool.clone(), effect_registry(), common::worker_config()));
    let handler = move |event: SqsEvent, deadline: Instant, poller, returned| {
        let worker = worker.clone();
        async move { worker.handle_batch_then(event, deadline, poller, Some(returned)).await }
    };
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(source.clone().run(4, handler, shutdown));
    common::eventually(Duration::from_secs(60), "every job to succeed", || {
        let pool = pool.clone();
        async move { (common::count_in_state(&pool, JobState::Succeeded).await == JOBS).then_some(()) }
    })
    .await;
    // Let the duplicates drain too.
    common::eventually(Duration::from_secs(30), "every duplicate to be handled", || {
        let records = source.totals().records.load(std::sync::atomic::Ordering::Relaxed);
        async move { (records >= 2 * JOBS as u64).then_some(()) }
    })
    .await;
    stop.send(true).unwrap();
    running.await.unwrap();

    let attempts: Vec<i32> = sqlx::query_scalar("SELECT attempts FROM rowq.jobs").fetch_all(&pool).await.unwrap();
    assert!(attempts.iter().all(|a| *a == 1), "a job ran more than once");
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects").fetch_one(&pool).await.unwrap();
    assert_eq!(effects, JOBS, "effects committed != jobs");
    let leftover = common::drain_queue(&client, &queues.queue_url, Duration::from_secs(1)).await;
    assert!(leftover.is_empty(), "messages left on the queue: {}", leftover.len());
}

/// What one poller's handler calls saw.
#[derive(Debug, Default)]
struct PollerTrace {
    batches: usize,
    in_handlers: usize,
    most_in_handlers: usize,
    next_began_while_finishing: usize,
}

/// How many messages [`queue_of_job_messages`] sends.
const MESSAGES: u64 = 20;

/// A new queue holding [`MESSAGES`] job messages, each in a message group of its own.
async fn queue_of_job_messages(client: &aws_sdk_sqs::Client, dedup_prefix: &str) -> rowq::sqs::QueuePair {
    let queues = common::queues(client, 5, Duration::from_secs(30)).await;
    let messages: Vec<(rowq::JobId, i64)> = (0..MESSAGES as i64).map(|n| (rowq::JobId(n), 1)).collect();
    let sent = common::send_job_messages(client, &queues.queue_url, &messages, dedup_prefix).await.unwrap();
    assert_eq!(sent as u64, MESSAGES);
    queues
}

/// Runs `pollers` pollers of an event source on `queue_url` with `handler` until they have
/// handled [`MESSAGES`] records, then stops them.
async fn poll_until_all_handled<H, F>(client: &aws_sdk_sqs::Client, queue_url: &str, pollers: usize, handler: H)
where
    H: Fn(SqsEvent, Instant, usize, HandlersReturned) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = SqsBatchResponse> + Send + 'static,
{
    let source = Arc::new(
        EventSource::new(client.clone(), queue_url, Duration::from_secs(1), Duration::from_secs(30)).await.unwrap(),
    );
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(source.clone().run(pollers, handler, shutdown));
    common::eventually(Duration::from_secs(30), "every message handled", || {
        let records = source.totals().records.load(std::sync::atomic::Ordering::Relaxed);
        async move { (records >= MESSAGES).then_some(()) }
    })
    .await;
    stop.send(true).unwrap();
    running.await.unwrap();
}

/// A poller takes its next batch as soon as the handler says the handlers of the last one have
/// returned, while that batch is still recording its outcomes; never two batches' handlers at
/// once; and from a handler that never says so, one batch after the other, as before.
#[tokio::test]
async fn a_poller_takes_its_next_batch_when_the_handlers_of_the_last_one_have_returned() {
    let client = common::sqs().await;
    for tells in [true, false] {
        let queues = queue_of_job_messages(&client, "poller").await;
        let trace: Arc<std::sync::Mutex<PollerTrace>> = Arc::default();
        let handler = {
            let trace = trace.clone();
            move |_event: SqsEvent, _deadline: Instant, _poller: usize, returned: HandlersReturned| {
                let trace = trace.clone();
                async move {
                    let batch = {
                        let mut t = trace.lock().unwrap();
                        t.batches += 1;
                        t.in_handlers += 1;
                        t.most_in_handlers = t.most_in_handlers.max(t.in_handlers);
                        t.batches
                    };
                    tokio::time::sleep(Duration::from_millis(50)).await; // the handlers
                    trace.lock().unwrap().in_handlers -= 1;
                    let unsent = if tells {
                        returned.send(()).unwrap();
                        None
                    } else {
                        Some(returned)
                    };
                    // The outcomes being recorded: long enough for the next batch to begin, if it may.
                    let finishing = Instant::now();
                    while finishing.elapsed() < Duration::from_secs(3) {
                        let began = {
                            let mut t = trace.lock().unwrap();
                            let began = t.batches > batch;
                            t.next_began_while_finishing += usize::from(began);
                            began
                        };
                        if began {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    drop(unsent);
                    SqsBatchResponse::default()
                }
            }
        };
        poll_until_all_handled(&client, &queues.queue_url, 1, handler).await;
        let trace = std::mem::take(&mut *trace.lock().unwrap());
        assert_eq!(trace.most_in_handlers, 1, "two batches' handlers ran at once: {trace:?}");
        if tells {
            assert!(trace.next_began_while_finishing >= 1, "the next batch waited for the last to finish: {trace:?}");
        } else {
            assert_eq!(trace.next_began_while_finishing, 0, "a batch began before the last one ended: {trace:?}");
        }
        let leftover = common::drain_queue(&client, &queues.queue_url, Duration::from_secs(1)).await;
        assert!(leftover.is_empty(), "messages left on the queue: {}", leftover.len());
    }
}

/// Each poller tells the handler who it is, so that the worker can keep a poller's statements
/// in its own lane: with two pollers and a handler slow enough that one poller cannot take every
/// batch, both indexes reach the handler, and no other.
#[tokio::test]
async fn the_event_source_tells_the_handler_which_poller_delivered_each_batch() {
    let client = common::sqs().await;
    let queues = queue_of_job_messages(&client, "lanes").await;
    let seen: Arc<std::sync::Mutex<std::collections::BTreeSet<usize>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |_event: SqsEvent, _deadline: Instant, poller: usize, _returned: HandlersReturned| {
            seen.lock().unwrap().insert(poller);
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                SqsBatchResponse::default()
            }
        }
    };
    poll_until_all_handled(&client, &queues.queue_url, 2, handler).await;
    assert_eq!(*seen.lock().unwrap(), [0, 1].into(), "the pollers the handler was told of");
}

/// A poller whose whole batch is handed back (a worker whose database refuses every connection
/// at once) pauses before its next receive, longer after each such batch in a row, so that the
/// rest of the queue stays visible; once a batch gets through, it polls at full speed again.
#[tokio::test]
async fn a_poller_whose_whole_batch_is_handed_back_pauses_before_receiving_again() {
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(60)).await;
    let messages: Vec<(rowq::JobId, i64)> = (1..=60).map(|n| (rowq::JobId(n), 1)).collect();
    assert_eq!(common::send_job_messages(&client, &queues.queue_url, &messages, "pause").await.unwrap(), 60);
    let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let handler = {
        let refusing = refusing.clone();
        move |event: SqsEvent, _deadline: Instant, _poller: usize, _returned: HandlersReturned| {
            let refusing = refusing.load(std::sync::atomic::Ordering::Relaxed);
            let every_record = event.records.into_iter().filter_map(|record| record.message_id).collect();
            async move { rowq::worker::batch_response(if refusing { every_record } else { Vec::new() }) }
        }
    };
    let source = Arc::new(
        EventSource::new(client.clone(), &queues.queue_url, Duration::from_secs(1), Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(source.clone().run(1, handler, shutdown));
    // Handed back at once, batch after batch: at 0 s, then after 1 s, then after 2 s more.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let batches = source.totals().batches.load(std::sync::atomic::Ordering::Relaxed);
    // Two on time; one if the endpoint is slow to answer. Six, the whole queue, without the pause.
    assert!((1..=2).contains(&batches), "{batches} batches handed back whole in 2.5 s");

    refusing.store(false, std::sync::atomic::Ordering::Relaxed);
    let recovered = Instant::now();
    common::eventually(Duration::from_secs(15), "the 40 messages still visible handled", || {
        let records = source.totals().records.load(std::sync::atomic::Ordering::Relaxed);
        async move { (records >= 60).then_some(()) }
    })
    .await;
    // At most the pause then running (2 s), and the 40 at full speed.
    assert!(recovered.elapsed() < Duration::from_secs(8), "took {:?}", recovered.elapsed());
    stop.send(true).unwrap();
    running.await.unwrap();
}

/// Messages a worker cannot complete land on the DLQ after `maxReceiveCount` receives. The DLQ
/// handler fails the job a worker had started (a poison job: its worker crashed each time) and
/// sends the one no worker had started back to be dispatched again, no attempt spent: what
/// failed its message was the worker's database, not the job, and it runs once that answers.
#[tokio::test]
async fn records_that_keep_failing_land_on_the_dlq_and_the_dlq_handler_fails_the_started_job_and_redispatches_the_other()
 {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 2, Duration::from_secs(1)).await;
    let poison = common::enqueue(&pool, "noop", json!({})).await;
    let unstarted = common::enqueue(&pool, "noop", json!({})).await;
    let scheduler = Scheduler::new(
        pool.clone(),
        SqsPublisher::new(client.clone(), queues.queue_url.clone()),
        common::scheduler_config(&queues.queue_url),
    );
    assert_eq!(scheduler.run_once().await.unwrap().published, 2);
    // A worker started the poison job, and died with it.
    let lease = Duration::from_secs(60);
    assert_eq!(start(&pool, &[StartRequest { id: poison, dispatch_gen: 1, lease }]).await.unwrap().len(), 1);

    // The worker's database is unreachable: every receive ends in a batch item failure.
    let mut config = common::worker_config();
    config.database.url = "postgres://postgres@127.0.0.1:1/nowhere".into();
    let broken = Arc::new(Worker::new(
        rowq::store::connect_lazy(&config.database, rowq::store::Session::Worker).unwrap(),
        effect_registry(),
        config,
    ));
    let source = EventSource::new(client.clone(), &queues.queue_url, Duration::from_secs(1), Duration::from_secs(10))
        .await
        .unwrap();
    let handler = move |event: SqsEvent, deadline: Instant, _poller, _returned| {
        let broken = broken.clone();
        async move { broken.handle_batch(event, deadline).await }
    };
    let started = Instant::now();
    let mut receives = 0;
    while started.elapsed() < Duration::from_secs(30) {
        receives += source.poll_once(&handler).await.unwrap();
        let on_dlq: String = client
            .get_queue_attributes()
            .queue_url(&queues.dlq_url)
            .attribute_names(aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages)
            .send()
            .await
            .unwrap()
            .attributes()
            .and_then(|a| a.get(&aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages).cloned())
            .unwrap_or_default();
        if on_dlq == "2" {
            break;
        }
    }
    assert_eq!(receives, 4, "received {receives} times before the DLQ took both");
    assert_eq!(common::job(&pool, unstarted).await.state, JobState::Dispatched);

    let dlq = EventSource::new(client.clone(), &queues.dlq_url, Duration::from_secs(1), Duration::from_secs(10))
        .await
        .unwrap();
    let dlq_handler = |event: SqsEvent, _deadline: Instant, _poller, _returned| {
        let pool = pool.clone();
        async move { dlq::handle_batch(&pool, event, None).await }
    };
    let mut handled = 0;
    while handled < 2 && started.elapsed() < Duration::from_secs(40) {
        handled += dlq.poll_once(&dlq_handler).await.unwrap();
    }
    assert_eq!(handled, 2);
    let row = common::job(&pool, poison).await;
    assert_eq!(row.state, JobState::Failed);
    let error = row.last_error.unwrap();
    // The count is SQS's "approximate" one: LocalStack counts the receive that moved it.
    assert!(error.contains("dead-lettered") && error.contains("times without being processed"), "{error}");
    println!("dead-lettered after {:?}: {error}", started.elapsed());

    let row = common::job(&pool, unstarted).await;
    assert_eq!((row.state, row.attempts, row.last_error), (JobState::Pending, 0, None));
    assert_eq!(scheduler.run_once().await.unwrap().published, 1, "dispatched again");
    let worker = Arc::new(Worker::new(pool.clone(), effect_registry(), common::worker_config()));
    let healthy = move |event: SqsEvent, deadline: Instant, _poller, _returned| {
        let worker = worker.clone();
        async move { worker.handle_batch(event, deadline).await }
    };
    let mut ran = 0;
    while ran == 0 && started.elapsed() < Duration::from_secs(50) {
        ran += source.poll_once(&healthy).await.unwrap();
    }
    let row = common::job(&pool, unstarted).await;
    assert_eq!((row.state, row.attempts, row.dispatch_gen), (JobState::Succeeded, 1, 2));
}

/// The DLQ handler fails a started job, sends one no worker started back to `pending` (no
/// attempt spent, the reason in its history), fails one whose attempts are somehow used up, and
/// leaves finished and re-dispatched jobs alone.
#[tokio::test]
async fn the_dlq_handler_fails_started_jobs_sends_unstarted_ones_back_and_leaves_the_rest_alone() {
    let pool = common::database().await;
    let finished = common::enqueue(&pool, "noop", json!({})).await;
    let redispatched = common::enqueue(&pool, "noop", json!({})).await;
    let dead = common::enqueue(&pool, "noop", json!({})).await;
    let unstarted = common::enqueue(&pool, "noop", json!({})).await;
    let used_up = common::enqueue(&pool, "noop", json!({})).await;
    claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(finished)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE rowq.jobs SET dispatch_gen = 2 WHERE id = $1").bind(redispatched).execute(&pool).await.unwrap();
    assert_eq!(
        start(&pool, &[StartRequest { id: dead, dispatch_gen: 1, lease: Duration::from_secs(60) }])
            .await
            .unwrap()
            .len(),
        1
    );
    sqlx::query("UPDATE rowq.jobs SET max_attempts = 1, attempts = 1 WHERE id = $1")
        .bind(used_up)
        .execute(&pool)
        .await
        .unwrap();

    let record = |id: &str, body: String| common::received(common::record(id, "g", body), 5);
    let event = common::event(vec![
        record("a", JobMessage::new(finished, 1).encode()),
        record("b", JobMessage::new(redispatched, 1).encode()),
        record("c", "garbage".into()),
        record("d", JobMessage::new(dead, 1).encode()),
        record("e", JobMessage::new(unstarted, 1).encode()),
        record("f", JobMessage::new(used_up, 1).encode()),
    ]);
    let response = dlq::handle_batch(&pool, event, None).await;
    assert!(response.batch_item_failures.is_empty());
    assert_eq!(common::job(&pool, finished).await.state, JobState::Succeeded);
    assert_eq!(common::job(&pool, redispatched).await.state, JobState::Dispatched);
    let row = common::job(&pool, dead).await;
    assert_eq!((row.state, row.attempts), (JobState::Failed, 1));
    assert!(row.last_error.unwrap().contains("received 5 times"));

    let row = common::job(&pool, unstarted).await;
    assert_eq!((row.state, row.attempts, row.last_error, row.finished_at), (JobState::Pending, 0, None, None));
    let history = row.errors.to_string();
    assert!(history.contains("received 5 times") && history.contains("no worker had started it"), "{history}");
    assert_eq!(claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap().len(), 1, "due again");

    let row = common::job(&pool, used_up).await;
    assert_eq!(row.state, JobState::Failed, "attempts used up");
}

#[tokio::test]
async fn thousands_of_rows_flow_from_insert_to_succeeded_with_two_schedulers_and_several_pollers() {
    const JOBS: i64 = 3000;
    // 8 pollers × 10 records, each job writing through its own transaction: more connections
    // than the 5 of a test's usual pool.
    let pool = common::database_with(40).await;
    create_effects(&pool).await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let mut config = common::pipeline_config(&queues, 8, true);
    config.schedulers = 2;
    let worker = Worker::new(pool.clone(), effect_registry(), common::worker_config());
    let pipeline = Pipeline::start(pool.clone(), client.clone(), worker, config).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let started = Instant::now();
    // Inserted in statements of 100, as an application would in bursts.
    for _ in 0..JOBS / 100 {
        sqlx::query("INSERT INTO rowq.jobs (kind) SELECT 'effect' FROM generate_series(1, 100)")
            .execute(&pool)
            .await
            .unwrap();
    }
    common::eventually(Duration::from_secs(120), "every job to succeed", || {
        let pool = pool.clone();
        async move { (common::count_in_state(&pool, JobState::Succeeded).await == JOBS).then_some(()) }
    })
    .await;
    let elapsed = started.elapsed();
    let totals = pipeline.stop().await;

    let mut latencies: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM started_at - created_at)::float8 * 1000 FROM rowq.jobs ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    latencies.sort_by(f64::total_cmp);
    println!(
        "end to end through LocalStack: {JOBS} jobs in {elapsed:?} = {:.0} jobs/s; insert→running p50 {:.0} ms, p99 {:.0} ms; published {}",
        JOBS as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        totals.published
    );
    let attempts: HashSet<i32> =
        sqlx::query_scalar("SELECT attempts FROM rowq.jobs").fetch_all(&pool).await.unwrap().into_iter().collect();
    assert_eq!(attempts, HashSet::from([1]));
    let effects: i64 = sqlx::query_scalar("SELECT count(DISTINCT job_id) FROM effects").fetch_one(&pool).await.unwrap();
    assert_eq!(effects, JOBS);
    assert_eq!(totals.published as i64, JOBS, "a job was published twice");
}
