//! The worker's handle_batch against real Postgres: fence, run, finish, and every way a
//! message can be stale, duplicated, malformed or cut off.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
use common::{event, received, record, records_of};
use rowq::store::admin::{self, NewJob};
use rowq::store::dispatch::claim_due;
use rowq::store::kept::KeptConnections;
use rowq::store::run::{Done, Finish, Outcome, StartRequest, Step, StepKey, finish, start, step};
use rowq::{JobContext, JobId, JobMessage, JobState, MemoryPublisher, Registry, Scheduler, Worker, maintenance};
use serde_json::json;
use sqlx::PgPool;

const MEMORY_URL: &str = "memory://jobs.fifo";

async fn effects_of(pool: &PgPool, id: JobId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE job_id = $1").bind(id).fetch_one(pool).await.unwrap()
}

fn registry() -> Registry {
    Registry::builtin().register("effect", common::effect).register_with_timeout(
        "slow",
        Duration::from_millis(200),
        |_: JobContext, _: serde_json::Value| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok(())
        },
    )
}

fn worker(pool: &PgPool) -> Worker {
    Worker::new(pool.clone(), registry(), common::worker_config())
}

/// The records of generation 1 of `jobs`, each in a group of its own, delivered the
/// `receives`th time.
fn delivered(jobs: &[JobId], receives: u32) -> Vec<SqsMessage> {
    jobs.iter().map(|&id| received(record(&id.to_string(), &id.to_string(), message(id, 1)), receives)).collect()
}

fn message(id: JobId, generation: i64) -> String {
    JobMessage::new(id, generation).encode()
}

async fn deliver(worker: &Worker, records: Vec<SqsMessage>) -> Vec<String> {
    deliver_from(worker, 0, records).await
}

/// [`deliver`], as the local runner's poller `poller` hands a batch over: in that poller's lane.
async fn deliver_from(worker: &Worker, poller: usize, records: Vec<SqsMessage>) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let response = worker.handle_batch_then(event(records), deadline, poller, None).await;
    response.batch_item_failures.into_iter().map(|f| f.item_identifier).collect()
}

/// Claims everything due and hands each claim to the worker as its own one-record batch.
async fn dispatch_and_run(pool: &PgPool, worker: &Worker) -> usize {
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), common::scheduler_config(MEMORY_URL));
    scheduler.run_once().await.unwrap();
    let sent = scheduler.publisher().take();
    for outgoing in &sent {
        let id = outgoing.dedup_id.clone();
        let failed = deliver(worker, vec![record(&id, &outgoing.group_id, outgoing.message.encode())]).await;
        assert!(failed.is_empty(), "infrastructure failure on {id}");
    }
    sent.len()
}

/// Runs the job to a terminal state, skipping backoff delays.
async fn run_to_end(pool: &PgPool, worker: &Worker, id: JobId) -> admin::JobRow {
    for _ in 0..50 {
        let row = common::job(pool, id).await;
        if row.state.is_terminal() {
            return row;
        }
        sqlx::query("UPDATE rowq.jobs SET run_at = now() WHERE id = $1 AND state = 'pending'")
            .bind(id)
            .execute(pool)
            .await
            .unwrap();
        dispatch_and_run(pool, worker).await;
    }
    panic!("job {id} did not finish");
}

fn failed(error: &str) -> Outcome {
    Outcome::Failed { error: error.to_string() }
}

/// A late success goes through the success-only finish statement, a late failure through the
/// mixed one: each must refuse a stalled execution.
fn stalled_outcomes() -> [Outcome; 2] {
    [Outcome::Succeeded { result: json!("late") }, failed("late")]
}

/// Runs `check` once per stalled outcome, each time on an empty table.
async fn with_each_stalled_outcome(pool: &PgPool, check: impl AsyncFn(&PgPool, Outcome)) {
    for outcome in stalled_outcomes() {
        sqlx::query("TRUNCATE rowq.jobs").execute(pool).await.unwrap();
        check(pool, outcome).await;
    }
}

#[tokio::test]
async fn a_job_runs_once_and_its_result_and_its_writes_commit_together() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let id = common::enqueue(&pool, "effect", json!({})).await;
    let echo = common::enqueue(&pool, "echo", json!({"hello": "world"})).await;
    assert_eq!(dispatch_and_run(&pool, &worker(&pool)).await, 2);
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts, row.result.clone()), (JobState::Succeeded, 1, Some(json!(1))));
    assert!(row.finished_at.is_some() && row.started_at.is_some());
    assert_eq!(effects_of(&pool, id).await, 1);
    assert_eq!(common::job(&pool, echo).await.result, Some(json!({"hello": "world"})));
}

#[tokio::test]
async fn a_message_delivered_twice_in_one_batch_or_in_two_runs_the_job_once() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let worker = worker(&pool);
    let id = common::enqueue(&pool, "effect", json!({})).await;
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let body = message(id, claimed[0].dispatch_gen);
    let failed = deliver(&worker, vec![record("m1", "g", body.clone()), record("m2", "g", body.clone())]).await;
    assert!(failed.is_empty());
    let failed = deliver(&worker, vec![record("m3", "g", body)]).await;
    assert!(failed.is_empty(), "a duplicate must be acknowledged, not retried");
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 1));
    assert_eq!(effects_of(&pool, id).await, 1);
}

#[tokio::test]
async fn a_stale_generation_arriving_after_a_rescue_is_acknowledged_without_running() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let worker = worker(&pool);
    let id = common::enqueue(&pool, "effect", json!({})).await;
    claim_due(&pool, "default", 1, Duration::from_millis(1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(maintenance::run_once(&pool, Duration::ZERO).await.unwrap().rescued_dispatched, 1);
    let again = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    assert_eq!(again[0].dispatch_gen, 2);

    let failed = deliver(&worker, vec![record("old", "g", message(id, 1))]).await;
    assert!(failed.is_empty());
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts, row.dispatch_gen), (JobState::Dispatched, 0, 2));
    assert_eq!(effects_of(&pool, id).await, 0);

    deliver(&worker, vec![record("new", "g", message(id, 2))]).await;
    assert_eq!(common::job(&pool, id).await.state, JobState::Succeeded);
    assert_eq!(effects_of(&pool, id).await, 1);
}

#[tokio::test]
async fn a_cancelled_job_whose_message_arrives_does_not_run() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    assert!(admin::cancel(&pool, id).await.unwrap().is_some());
    let failed = deliver(&worker(&pool), vec![record("m", "g", message(id, claimed[0].dispatch_gen))]).await;
    assert!(failed.is_empty());
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Cancelled, 0));
}

#[tokio::test]
async fn job_errors_retry_with_backoff_then_succeed_and_fail_when_attempts_run_out() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let worker = worker(&pool);
    let flaky = common::enqueue(&pool, "fail", json!({"times": 2})).await;
    dispatch_and_run(&pool, &worker).await;
    let row = common::job(&pool, flaky).await;
    assert_eq!((row.state, row.attempts), (JobState::Pending, 1));
    assert!(row.run_at > row.started_at.unwrap(), "a retry must wait for its backoff");
    assert!(row.last_error.as_deref().unwrap().contains("failing on purpose"));
    let row = run_to_end(&pool, &worker, flaky).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 3));
    assert_eq!(row.result, Some(json!({"succeeded_on_attempt": 3})));
    let history = row.errors.as_array().unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(history[0]["attempt"], json!(1));
    assert_eq!(history[1]["attempt"], json!(2));
    assert_eq!(row.last_error, None, "a success clears last_error; the history keeps it");

    // The failed attempts' writes were rolled back; only the successful one's remain.
    let effectful =
        admin::enqueue(&pool, &NewJob { max_attempts: Some(5), ..NewJob::new("effect", json!({"fail_first": 2})) })
            .await
            .unwrap()
            .unwrap();
    let row = run_to_end(&pool, &worker, effectful).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 3));
    let attempts: Vec<i32> = sqlx::query_scalar("SELECT attempt FROM effects WHERE job_id = $1")
        .bind(effectful)
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(attempts, vec![3]);

    let exhausted =
        admin::enqueue(&pool, &NewJob { max_attempts: Some(2), ..NewJob::new("fail", json!({"times": 9})) })
            .await
            .unwrap()
            .unwrap();
    let row = run_to_end(&pool, &worker, exhausted).await;
    assert_eq!((row.state, row.attempts), (JobState::Failed, 2));
    assert!(row.last_error.as_deref().unwrap().contains("no attempts left"), "{:?}", row.last_error);

    let permanent = common::enqueue(&pool, "fail", json!({})).await;
    let row = run_to_end(&pool, &worker, permanent).await;
    assert_eq!((row.state, row.attempts), (JobState::Failed, 1), "a permanent error must not retry");
}

/// A handler that names when to try again (`JobError::retry_after`: a downstream's
/// `Retry-After`) gets that wait exactly, instead of the backoff; the attempt is spent, the last
/// one fails the job, and a wait too long to store is cut to `MAX_RETRY_AFTER` instead of failing
/// the batch's finish.
#[tokio::test]
async fn a_handler_that_names_its_retrys_wait_gets_it_instead_of_the_backoff() {
    let pool = common::database().await;
    let worker = worker(&pool);
    let waited = |row: &admin::JobRow| (row.run_at - row.started_at.unwrap()).to_std().unwrap();
    let ten_minutes = Duration::from_secs(600);

    let asked = common::enqueue(&pool, "fail", json!({"times": 1, "retry_after_ms": 600_000})).await;
    assert_eq!(dispatch_and_run(&pool, &worker).await, 1);
    let row = common::job(&pool, asked).await;
    assert_eq!((row.state, row.attempts), (JobState::Pending, 1), "{:?}", row.last_error);
    assert!(
        (ten_minutes..ten_minutes + Duration::from_secs(5)).contains(&waited(&row)),
        "retry due {:?} after the attempt started, not the 10 minutes asked for",
        waited(&row)
    );
    assert!(row.last_error.as_deref().unwrap().contains("failing on purpose"), "{:?}", row.last_error);
    let row = run_to_end(&pool, &worker, asked).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 2));

    let forever = common::enqueue(&pool, "fail", json!({"times": 9, "retry_after_ms": u64::MAX})).await;
    assert_eq!(dispatch_and_run(&pool, &worker).await, 1);
    let row = common::job(&pool, forever).await;
    assert_eq!(row.state, JobState::Pending, "{:?}", row.last_error);
    let cap = rowq::job::MAX_RETRY_AFTER;
    assert!((cap..cap + Duration::from_secs(5)).contains(&waited(&row)), "{:?}", waited(&row));

    let last = admin::enqueue(
        &pool,
        &NewJob { max_attempts: Some(1), ..NewJob::new("fail", json!({"times": 9, "retry_after_ms": 1})) },
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(dispatch_and_run(&pool, &worker).await, 1);
    let row = common::job(&pool, last).await;
    assert_eq!((row.state, row.attempts), (JobState::Failed, 1));
    assert!(row.last_error.as_deref().unwrap().contains("no attempts left"), "{:?}", row.last_error);
}

/// Closes every connection of a worker's `pool`, as a pool retires them (idle, or too old): its
/// next statement opens a new one.
async fn retire_connections(pool: &PgPool) {
    tokio::time::sleep(rowq::store::kept::KEEP_FOR * 4).await; // the kept connection goes back to the pool
    while pool.num_idle() > 0 {
        pool.acquire().await.unwrap().close().await.unwrap();
    }
    assert_eq!(pool.size(), 0, "every connection of the worker is closed");
}

/// A worker whose database secret is rotated (RDS rotates a managed password every 7 days)
/// reads it again when the database refuses a login, and opens its next connections with it:
/// the batch that met the refusal runs then, not handed back to wait for its visibility
/// timeout; so does a DLQ handler's dead letter. The tests' server trusts any password, so here
/// the secret's user changes and the old one may no longer log in.
#[tokio::test]
async fn a_worker_follows_its_database_secret_when_it_is_rotated() {
    use sqlx::ConnectOptions;
    let pool = common::database().await;
    let secrets = aws_sdk_secretsmanager::Client::new(&common::aws_at(&common::endpoint()).await);
    let options = pool.connect_options();
    let database = options.get_database().expect("a test pool names its database").to_string();
    let [old, new] = ["old", "new"].map(|role| format!("rowq_test_rotated_{role}_{}", std::process::id()));
    let run = |sql: String| sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool);
    for role in [&old, &new] {
        run(format!("CREATE ROLE {role} LOGIN SUPERUSER")).await.unwrap();
    }
    let url_as = |role: &str| (*options).clone().username(role).to_url_lossy().to_string();
    let created = secrets.create_secret().name(format!("rowq-test/rotated-{database}")).secret_string(url_as(&old));
    let arn = created.send().await.expect("create the secret").arn.expect("a created secret has an ARN");

    let mut config = rowq::config::DatabaseConfig { url: String::new(), pool_size: 2, secret_arn: Some(arn.clone()) };
    rowq::secret::resolve(&mut config).await.unwrap();
    let worker_pool = rowq::store::connect_lazy(&config, rowq::store::Session::Worker).unwrap();
    rowq::secret::follow(&config, vec![(worker_pool.clone(), rowq::store::Session::Worker)]);
    let worker = Worker::new(worker_pool.clone(), registry(), common::worker_config());
    let user = || sqlx::query_scalar::<_, String>("SELECT current_user::text").fetch_one(&worker_pool);
    let first = common::enqueue(&pool, "echo", json!({"n": 1})).await;
    assert_eq!(dispatch_and_run(&pool, &worker).await, 1);
    assert_eq!(common::job(&pool, first).await.state, JobState::Succeeded);
    assert_eq!(user().await.unwrap(), old);

    // The rotation: the secret names the new login, and the old one is refused. Its sessions
    // go on, as they do on RDS; the worker's end as a pool's do (idle, or too old), so that
    // its next statement needs a new one.
    secrets.put_secret_value().secret_id(&arn).secret_string(url_as(&new)).send().await.expect("rotate");
    run(format!("ALTER ROLE {old} NOLOGIN")).await.unwrap();
    retire_connections(&worker_pool).await;
    let second = common::enqueue(&pool, "echo", json!({"n": 2})).await;
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), common::scheduler_config(MEMORY_URL));
    scheduler.run_once().await.unwrap();
    let sent = scheduler.publisher().take();
    let handed_back = deliver(&worker, records_of(&sent)).await;
    assert!(handed_back.is_empty(), "the batch that met the refused login was handed back: {handed_back:?}");
    assert_eq!(common::job(&pool, second).await.state, JobState::Succeeded);
    assert_eq!(user().await.unwrap(), new);

    // Rotated back, once the follower may read again: the DLQ handler meets the refusal, and
    // its statement runs with the secret read again.
    tokio::time::sleep(rowq::secret::REREAD_AT_MOST_EVERY).await;
    let poison = common::enqueue(&pool, "echo", json!({"n": "poison"})).await;
    scheduler.run_once().await.unwrap();
    let dead = scheduler.publisher().take();
    let started =
        StartRequest { id: poison, dispatch_gen: dead[0].message.dispatch_gen, lease: Duration::from_secs(60) };
    assert_eq!(start(&pool, &[started]).await.unwrap().len(), 1, "a worker started it, and died with it");
    secrets.put_secret_value().secret_id(&arn).secret_string(url_as(&old)).send().await.expect("rotate back");
    run(format!("ALTER ROLE {old} LOGIN")).await.unwrap();
    run(format!("ALTER ROLE {new} NOLOGIN")).await.unwrap();
    retire_connections(&worker_pool).await;
    let dead_letters = event(records_of(&dead).into_iter().map(|record| received(record, 5)).collect());
    let response = rowq::dlq::handle_batch(&worker_pool, dead_letters, None).await;
    assert!(response.batch_item_failures.is_empty(), "the dead letter met the refused login and was handed back");
    assert_eq!(common::job(&pool, poison).await.state, JobState::Failed);
    assert_eq!(user().await.unwrap(), old);

    // A login refused with what the secret holds is tried once more, not again and again: the
    // batch is handed back at once.
    run(format!("ALTER ROLE {old} NOLOGIN")).await.unwrap();
    retire_connections(&worker_pool).await;
    let third = common::enqueue(&pool, "echo", json!({"n": 3})).await;
    scheduler.run_once().await.unwrap();
    let sent = scheduler.publisher().take();
    let delivered = Instant::now();
    assert_eq!(deliver(&worker, records_of(&sent)).await.len(), 1, "refused with the secret's own URL: handed back");
    assert!(delivered.elapsed() < rowq::secret::RENEWAL_WAIT, "held for {:?}", delivered.elapsed());
    assert_eq!(common::job(&pool, third).await.state, JobState::Dispatched);

    worker_pool.close().await;
    for role in [&old, &new] {
        run(format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")).await.unwrap();
        run(format!("DROP ROLE {role}")).await.unwrap();
    }
    secrets.delete_secret().secret_id(&arn).force_delete_without_recovery(true).send().await.expect("delete it");
}

/// The next step of a workflow, enqueued by a handler through its job's transaction: it exists
/// once, from the attempt that succeeded, however many attempts failed after enqueuing it, and
/// it is dispatched and run like any job.
#[tokio::test]
async fn a_follow_up_enqueued_through_the_jobs_transaction_exists_once_and_only_after_success() {
    let pool = common::database().await;
    let registry = registry().register("chain", |ctx: JobContext, input: serde_json::Value| async move {
        let next = NewJob::new("echo", json!({ "after": ctx.job_id, "attempt": ctx.attempt }));
        admin::enqueue(&mut **ctx.tx().await?, &next).await?;
        if i64::from(ctx.attempt) <= input["fail_first"].as_i64().unwrap_or(0) {
            return Err(rowq::JobError::retryable(format!("attempt {} fails after enqueuing", ctx.attempt)));
        }
        Ok(())
    });
    let worker = Worker::new(pool.clone(), registry, common::worker_config());
    let id = common::enqueue(&pool, "chain", json!({ "fail_first": 2 })).await;
    let row = run_to_end(&pool, &worker, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 3));

    let follow_ups: Vec<(JobId, serde_json::Value)> =
        sqlx::query_as("SELECT id, payload FROM rowq.jobs WHERE kind = 'echo'").fetch_all(&pool).await.unwrap();
    let expected = json!({ "after": id, "attempt": 3 });
    assert_eq!(follow_ups.iter().map(|(_, payload)| payload).collect::<Vec<_>>(), [&expected]);
    let next = run_to_end(&pool, &worker, follow_ups[0].0).await;
    assert_eq!((next.state, next.result), (JobState::Succeeded, Some(expected)));
}

#[tokio::test]
async fn unknown_kinds_and_payloads_that_do_not_fit_fail_with_a_clear_error() {
    let pool = common::database().await;
    let worker = worker(&pool);
    let unknown = common::enqueue(&pool, "resize_image", json!({})).await;
    let bad_payload = common::enqueue(&pool, "sleep", json!({"ms": "soon"})).await;
    let extra_field = common::enqueue(&pool, "sleep", json!({"ms": 1, "mss": 2})).await;
    dispatch_and_run(&pool, &worker).await;

    let row = common::job(&pool, unknown).await;
    assert_eq!((row.state, row.attempts), (JobState::Failed, 1));
    let error = row.last_error.unwrap();
    assert!(error.contains(r#"unknown job kind "resize_image""#) && error.contains("echo"), "{error}");
    for id in [bad_payload, extra_field] {
        let row = common::job(&pool, id).await;
        assert_eq!(row.state, JobState::Failed);
        assert!(
            row.last_error.as_deref().unwrap().contains(r#"payload does not fit job kind "sleep""#),
            "{:?}",
            row.last_error
        );
    }
}

/// Postgres stores no NUL character in `text` or `jsonb`; Rust strings and JSON may hold one.
#[tokio::test]
async fn results_and_errors_postgres_cannot_store_are_cleaned_without_failing_the_batch() {
    let pool = common::database().await;
    let registry = Registry::builtin().register("nul", |_: JobContext, input: serde_json::Value| async move {
        match input["fail"].as_bool() {
            Some(true) => Err(rowq::JobError::permanent(format!("bad\0byte {}", "x".repeat(100_000)))),
            _ => Ok(json!({"text\u{0}": "a\u{0}b"})),
        }
    });
    let worker = Worker::new(pool.clone(), registry, common::worker_config());
    let fine = common::enqueue(&pool, "echo", json!({"n": 1})).await;
    let nul_result = common::enqueue(&pool, "nul", json!({})).await;
    let nul_error = common::enqueue(&pool, "nul", json!({"fail": true})).await;
    let batch = claimed_batches(&pool, 10).await.remove(0);
    assert!(deliver(&worker, batch).await.is_empty(), "every outcome was recorded");

    assert_eq!(common::job(&pool, fine).await.state, JobState::Succeeded);
    let row = common::job(&pool, nul_result).await;
    assert_eq!((row.state, row.result), (JobState::Succeeded, Some(json!({"text\u{fffd}": "a\u{fffd}b"}))));
    let row = common::job(&pool, nul_error).await;
    assert_eq!((row.state, row.attempts), (JobState::Failed, 1));
    let error = row.last_error.unwrap();
    assert!(error.starts_with("bad\u{fffd}byte xxx"), "{}", &error[..20]);
    // 100,009 bytes, 100,011 once the NUL (1 byte) is U+FFFD (3 bytes).
    let cut = 100_011 - rowq::store::run::MAX_ERROR_BYTES;
    assert!(error.ends_with(&format!("({cut} of 100011 bytes cut)")), "{}", &error[error.len() - 40..]);
}

#[tokio::test]
async fn a_handler_that_exceeds_its_timeout_is_stopped_and_recorded_as_a_timed_out_attempt() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "slow", json!({})).await;
    let started = Instant::now();
    dispatch_and_run(&pool, &worker(&pool)).await;
    println!("a 30 s handler with a 200 ms timeout returned after {:?}", started.elapsed());
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Pending, 1));
    assert_eq!(row.last_error.as_deref(), Some("timed out after 200 ms"));
}

#[tokio::test]
async fn a_panicking_handler_is_a_failed_attempt_not_a_crashed_batch() {
    let pool = common::database().await;
    let registry = Registry::new().register("panics", |_: JobContext, _: serde_json::Value| async {
        if true {
            panic!("index out of bounds");
        }
        Ok(())
    });
    let worker = Worker::new(pool.clone(), registry, common::worker_config());
    let id = common::enqueue(&pool, "panics", json!({})).await;
    dispatch_and_run(&pool, &worker).await;
    let row = common::job(&pool, id).await;
    assert_eq!(row.state, JobState::Pending);
    assert_eq!(row.last_error.as_deref(), Some("handler panicked: index out of bounds"));
}

#[tokio::test]
async fn malformed_messages_are_acknowledged_and_the_rest_of_the_batch_runs() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let huge = format!(r#"{{"v":1,"job_id":1,"dispatch_gen":1,"pad":"{}"}}"#, "x".repeat(200_000));
    let records = vec![
        record("junk", "g", "hello".into()),
        record("version", "g", r#"{"v":2,"job_id":1,"dispatch_gen":1}"#.into()),
        record("missing", "g", r#"{"v":1,"job_id":1}"#.into()),
        record("negative", "g", r#"{"v":1,"job_id":-1,"dispatch_gen":1}"#.into()),
        record("no-such-job", "g", message(JobId(987_654), 1)),
        record("huge", "g", huge),
        record("empty", "g", String::new()),
        record("real", "g", message(id, claimed[0].dispatch_gen)),
    ];
    let failed = deliver(&worker(&pool), records).await;
    assert!(failed.is_empty(), "bad messages must not be retried: {failed:?}");
    assert_eq!(common::job(&pool, id).await.state, JobState::Succeeded);
}

#[tokio::test]
async fn a_worker_killed_mid_job_is_taken_over_by_the_redelivered_message_and_the_job_finishes_once() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let id = common::enqueue(&pool, "effect", json!({})).await;
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    // The first worker passed the fence and was killed: nothing of it committed but the fence.
    let killed =
        start(&pool, &[StartRequest { id, dispatch_gen: claimed[0].dispatch_gen, lease: Duration::from_millis(100) }])
            .await
            .unwrap();
    assert_eq!(killed[0].attempt, 1);

    // Redelivered before the run deadline: the job may still be running; acknowledged, not run.
    let body = message(id, claimed[0].dispatch_gen);
    deliver(&worker(&pool), vec![record("again", "g", body.clone())]).await;
    assert_eq!(common::job(&pool, id).await.attempts, 1, "took over a job before its run deadline");

    tokio::time::sleep(Duration::from_millis(150)).await;
    deliver(&worker(&pool), vec![record("after-deadline", "g", body)]).await;
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 2));
    assert_eq!(effects_of(&pool, id).await, 1);

    // The killed worker comes back to life and tries to record its outcome: refused.
    let zombie = Finish {
        id,
        dispatch_gen: killed[0].dispatch_gen,
        attempt: 1,
        outcome: Outcome::Succeeded { result: json!("zombie") },
    };
    assert!(finish(&pool, &[zombie]).await.unwrap().is_empty());
    let zombie = Finish { id, dispatch_gen: killed[0].dispatch_gen, attempt: 1, outcome: failed("zombie") };
    assert!(finish(&pool, &[zombie]).await.unwrap().is_empty(), "the mixed-outcome statement has the guard too");
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.result), (JobState::Succeeded, Some(json!(2))));
}

/// A job that ends its worker's process (memory, a crash in native code) takes the batch
/// with it, outcomes unrecorded. Its batch-mates must not go down with it at every delivery
/// until SQS gives up on them all: taken over after their messages came back, the executions
/// run one at a time, each recorded before the next, in an order that turns round with every
/// attempt. The process's end is the batch's task aborted as the killing job starts.
#[tokio::test]
async fn jobs_delivered_with_one_that_kills_the_process_finish_within_two_more_deliveries() {
    let pool = common::database().await;
    let (kills, mut killing) = tokio::sync::mpsc::unbounded_channel::<()>();
    let registry = registry().register("kills", move |_: JobContext, _: serde_json::Value| {
        let kills = kills.clone();
        async move {
            let _ = kills.send(());
            std::future::pending::<Result<(), rowq::JobError>>().await
        }
    });
    let worker = Arc::new(Worker::new(pool.clone(), registry, common::worker_config()));
    let first = common::enqueue(&pool, "noop", json!({})).await;
    let killer = common::enqueue(&pool, "kills", json!({})).await;
    let last = common::enqueue(&pool, "noop", json!({})).await;
    claim_due(&pool, "default", 3, Duration::from_secs(60)).await.unwrap();
    let states = || async {
        let mut states = Vec::new();
        for id in [first, killer, last] {
            let row = common::job(&pool, id).await;
            states.push((row.state, row.attempts));
        }
        states
    };

    for received in 1..=3 {
        let records = delivered(&[first, killer, last], received);
        let worker = worker.clone();
        let batch = tokio::spawn(async move { deliver(&worker, records).await });
        tokio::time::timeout(Duration::from_secs(10), killing.recv()).await.expect("the killing job runs").unwrap();
        batch.abort(); // the process ends
        assert!(batch.await.unwrap_err().is_cancelled());
        // Its visibility timeout is longer than a run deadline: the next delivery takes over.
        sqlx::query("UPDATE rowq.jobs SET run_deadline = now() - interval '1 second' WHERE state = 'running'")
            .execute(&pool)
            .await
            .unwrap();
        let expected = match received {
            // First delivery: the three side by side, nothing recorded.
            1 => [(JobState::Running, 1), (JobState::Running, 1), (JobState::Running, 1)],
            // Received twice, the order turned round: the last job runs before the one that
            // kills; the first, not reached, was not taken over (no attempt spent).
            2 => [(JobState::Running, 1), (JobState::Running, 2), (JobState::Succeeded, 2)],
            // Three times, in the order given: the first job runs before it.
            _ => [(JobState::Succeeded, 2), (JobState::Running, 3), (JobState::Succeeded, 2)],
        };
        assert_eq!(states().await, expected, "after delivery {received}");
    }
}

/// One at a time, once an outcome cannot be recorded (the database gone), the rest of the
/// taken-over jobs are handed back unrun: each run would be an attempt whose outcome is lost too.
#[tokio::test]
async fn taken_over_jobs_after_one_whose_outcome_was_lost_are_handed_back_unrun() {
    let pool = common::database().await;
    let (url, outage) = common::database_behind_a_proxy(&pool).await;
    let mut config = common::worker_config();
    config.database.url = url;
    let through_proxy = rowq::store::connect_lazy(&config.database, rowq::store::Session::Worker).unwrap();
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = ran.clone();
    let registry = registry()
        .register("cuts", move |_: JobContext, _: serde_json::Value| {
            outage.send_replace(true); // the database goes away while it runs
            async { Ok(()) }
        })
        .register("counts", move |_: JobContext, _: serde_json::Value| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok(()) }
        });
    let worker = Worker::new(through_proxy, registry, config);
    let ids = [
        common::enqueue(&pool, "counts", json!({})).await,
        common::enqueue(&pool, "counts", json!({})).await,
        common::enqueue(&pool, "cuts", json!({})).await,
    ];
    claim_due(&pool, "default", 3, Duration::from_secs(60)).await.unwrap();
    let requests: Vec<StartRequest> =
        ids.iter().map(|&id| StartRequest { id, dispatch_gen: 1, lease: Duration::from_secs(60) }).collect();
    assert_eq!(start(&pool, &requests).await.unwrap().len(), 3);
    sqlx::query("UPDATE rowq.jobs SET run_deadline = now() - interval '1 second'").execute(&pool).await.unwrap();

    // Delivered again (their worker died), a second time: the order turned round, so the one
    // that cuts runs first.
    let mut failed = deliver(&worker, delivered(&ids, 2)).await;
    failed.sort();
    let mut every = ids.map(|id| id.to_string()).to_vec();
    every.sort();
    assert_eq!(failed, every, "all three handed back");
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 0, "no handler ran after the lost outcome");
    let attempts: Vec<i32> =
        sqlx::query_scalar("SELECT attempts FROM rowq.jobs ORDER BY id").fetch_all(&pool).await.unwrap();
    assert_eq!(attempts, [1, 1, 2], "the two not run were not taken over either");
}

#[tokio::test]
async fn a_taken_over_execution_cannot_commit_its_writes() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let id = common::enqueue(&pool, "effect", json!({"sleep_ms": 600})).await;
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let body = message(id, claimed[0].dispatch_gen);
    // The first worker stalls (a long GC pause, a frozen VM): while its handler is still
    // running, its run deadline passes and a redelivered message takes the job over.
    let first = tokio::spawn({
        let (pool, body) = (pool.clone(), body.clone());
        async move {
            worker(&pool)
                .handle_batch(event(vec![record("first", "g", body)]), Instant::now() + Duration::from_secs(30))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("UPDATE rowq.jobs SET run_deadline = now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    deliver(&worker(&pool), vec![record("second", "g", body)]).await;
    let _: SqsBatchResponse = first.await.unwrap();

    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 2));
    let attempts: Vec<i32> =
        sqlx::query_scalar("SELECT attempt FROM effects WHERE job_id = $1").bind(id).fetch_all(&pool).await.unwrap();
    assert_eq!(attempts, vec![2], "the superseded execution's writes committed");
}

#[tokio::test]
async fn a_job_whose_worker_died_is_rescued_by_maintenance_and_runs_again() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let id = admin::enqueue(&pool, &NewJob { max_attempts: Some(2), ..NewJob::new("effect", json!({})) })
        .await
        .unwrap()
        .unwrap();
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    start(&pool, &[StartRequest { id, dispatch_gen: claimed[0].dispatch_gen, lease: Duration::from_millis(50) }])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let report = maintenance::run_once(&pool, Duration::ZERO).await.unwrap();
    assert_eq!(report.rescued_running, 1);
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts), (JobState::Pending, 1));
    assert!(row.last_error.as_deref().unwrap().contains("no outcome by the run deadline"));

    let row = run_to_end(&pool, &worker(&pool), id).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 2));
    assert_eq!(effects_of(&pool, id).await, 1);

    // With no attempts left, a rescue fails the job instead.
    let last = admin::enqueue(&pool, &NewJob { max_attempts: Some(1), ..NewJob::new("noop", json!({})) })
        .await
        .unwrap()
        .unwrap();
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    start(&pool, &[StartRequest { id: last, dispatch_gen: claimed[0].dispatch_gen, lease: Duration::from_millis(50) }])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(maintenance::run_once(&pool, Duration::ZERO).await.unwrap().failed, 1);
    assert_eq!(common::job(&pool, last).await.state, JobState::Failed);
}

#[tokio::test]
async fn an_unreachable_database_fails_every_record_so_sqs_redelivers() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let mut config = common::worker_config();
    config.database.url = "postgres://postgres@127.0.0.1:1/nowhere".into();
    let unreachable = rowq::store::connect_lazy(&config.database, rowq::store::Session::Worker).unwrap();
    let worker = Worker::new(unreachable, registry(), config);
    let failed = deliver(
        &worker,
        vec![
            record("a", "g", message(id, claimed[0].dispatch_gen)),
            record("b", "g", message(JobId(99), 1)),
            record("c", "h", message(JobId(98), 1)),
        ],
    )
    .await;
    assert_eq!(failed, vec!["a", "b", "c"]);
    assert_eq!(common::job(&pool, id).await.state, JobState::Dispatched, "nothing changed");
}

#[tokio::test]
async fn records_of_a_group_run_in_order_and_a_failure_fails_the_rest_of_that_group_only() {
    let pool = common::database().await;
    let order: Arc<Mutex<Vec<i64>>> = Arc::default();
    let log = order.clone();
    let registry = Registry::new()
        .register("append", move |_: JobContext, input: serde_json::Value| {
            let log = log.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                log.lock().unwrap().push(input["n"].as_i64().unwrap_or_default());
                Ok(())
            }
        })
        .register("cut_connection", |ctx: JobContext, _: serde_json::Value| async move {
            // The job's own connection dies before its completion commits: an infrastructure
            // failure, as when the database restarts mid-batch.
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut **ctx.tx().await?).await?;
            sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(ctx.pool()).await?;
            Ok(())
        });
    let worker = Worker::new(pool.clone(), registry, common::worker_config());
    let mut ids = Vec::new();
    for (kind, n) in [("append", 1), ("cut_connection", 2), ("append", 3), ("append", 10), ("append", 11)] {
        ids.push(common::enqueue(&pool, kind, json!({ "n": n })).await);
    }
    let claimed = claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(claimed.len(), 5);
    let failed = deliver(
        &worker,
        vec![
            record("g1", "g", message(ids[0], 1)),
            record("h10", "h", message(ids[3], 1)),
            record("g2", "g", message(ids[1], 1)),
            record("g3", "g", message(ids[2], 1)),
            record("h11", "h", message(ids[4], 1)),
        ],
    )
    .await;
    assert_eq!(failed, vec!["g2", "g3"]);
    let order = order.lock().unwrap().clone();
    let g: Vec<i64> = order.iter().copied().filter(|n| *n < 10).collect();
    let h: Vec<i64> = order.iter().copied().filter(|n| *n >= 10).collect();
    assert_eq!(g, vec![1], "group g ran past its failure, or out of order");
    assert_eq!(h, vec![10, 11]);
    assert_eq!(common::job(&pool, ids[2]).await.state, JobState::Dispatched, "g3 must wait for redelivery");
    assert_eq!(common::job(&pool, ids[1]).await.state, JobState::Running, "g2's outcome was not recorded");
}

#[tokio::test]
async fn the_aws_sample_sqs_event_and_a_fifo_event_get_valid_partial_batch_responses() {
    let pool = common::database().await;
    let worker = worker(&pool);
    let sample: SqsEvent = serde_json::from_str(include_str!("fixtures/aws-example-sqs-event.json")).unwrap();
    let response = worker.handle_batch(sample, Instant::now() + Duration::from_secs(5)).await;
    assert_eq!(serde_json::to_value(&response).unwrap(), json!({"batchItemFailures": []}));

    let id = common::enqueue(&pool, "echo", json!({"from": "fixture"})).await;
    assert_eq!(id, JobId(1), "the fixture names job 1");
    claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let fifo: SqsEvent = serde_json::from_str(include_str!("fixtures/fifo-job-event.json")).unwrap();
    let response = worker.handle_batch(fifo, Instant::now() + Duration::from_secs(5)).await;
    assert_eq!(serde_json::to_value(&response).unwrap(), json!({"batchItemFailures": []}));
    assert_eq!(common::job(&pool, id).await.result, Some(json!({"from": "fixture"})));
}

#[tokio::test]
async fn an_invocation_without_time_left_hands_its_records_back() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let response = worker(&pool).handle_batch(event(vec![record("m", "g", message(id, 1))]), Instant::now()).await;
    assert_eq!(response.batch_item_failures.len(), 1);
    assert_eq!(common::job(&pool, id).await.state, JobState::Dispatched);
}

#[tokio::test]
async fn a_stalled_worker_cannot_finish_a_job_that_was_rescued_or_dead_lettered_meanwhile() {
    let pool = common::database().await;
    // Rescue and dead-lettering change neither the generation nor the attempt: only the
    // state guard stops the stalled worker's outcome, in either finish statement.
    with_each_stalled_outcome(&pool, a_stalled_worker_cannot_finish_a_rescued_or_dead_lettered_job).await;
}

async fn a_stalled_worker_cannot_finish_a_rescued_or_dead_lettered_job(pool: &PgPool, outcome: Outcome) {
    let rescued = common::enqueue(pool, "noop", json!({})).await;
    let dead = common::enqueue(pool, "noop", json!({})).await;
    claim_due(pool, "default", 2, Duration::from_secs(60)).await.unwrap();
    let lease = |id| StartRequest { id, dispatch_gen: 1, lease: Duration::from_millis(50) };
    start(pool, &[lease(rescued), lease(dead)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(rowq::store::maintenance::rescue_running(pool, Duration::ZERO).await.unwrap().len(), 2);
    // Put `dead` back to running and dead-letter it instead.
    sqlx::query("UPDATE rowq.jobs SET state = 'running' WHERE id = $1").bind(dead).execute(pool).await.unwrap();
    rowq::store::run::dead_letter(pool, dead, 1, "dead-lettered in a test").await.unwrap().unwrap();

    let stalled = |id| Finish { id, dispatch_gen: 1, attempt: 1, outcome: outcome.clone() };
    let recorded = finish(pool, &[stalled(rescued), stalled(dead)]).await.unwrap();
    assert!(recorded.is_empty(), "a stalled worker recorded an outcome: {recorded:?}");
    assert_eq!(common::job(pool, rescued).await.state, JobState::Pending);
    assert_eq!(common::job(pool, dead).await.state, JobState::Failed);
}

#[tokio::test]
async fn a_batch_of_transactional_jobs_larger_than_the_pool_still_runs_in_one_attempt_each() {
    // A Lambda worker has a small pool (2) and gets batches of 10. Each job that writes
    // through its transaction holds a connection: it must give it back as soon as it is done,
    // not at the end of the batch, or the others wait out their timeout.
    let pool = common::database_with(2).await;
    common::create_effects(&pool).await;
    let mut config = common::worker_config();
    config.job_timeout = Duration::from_secs(3);
    let worker = Worker::new(pool.clone(), registry(), config);
    let ids = common::enqueue_many(&pool, "effect", 10).await;
    sqlx::query("UPDATE rowq.jobs SET payload = '{\"sleep_ms\": 200}'").execute(&pool).await.unwrap();
    claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    let records = ids.iter().map(|id| record(&id.to_string(), &id.to_string(), message(*id, 1))).collect();
    let started = Instant::now();
    let failed = deliver(&worker, records).await;
    println!("10 transactional jobs on a pool of 2: {:?}", started.elapsed());
    assert!(failed.is_empty(), "{failed:?}");
    let attempts: Vec<(JobState, i32)> =
        sqlx::query_as("SELECT state, attempts FROM rowq.jobs ORDER BY id").fetch_all(&pool).await.unwrap();
    assert!(attempts.iter().all(|a| *a == (JobState::Succeeded, 1)), "{attempts:?}");
}

#[tokio::test]
async fn a_stalled_execution_cannot_finish_the_run_of_a_job_retried_by_hand_meanwhile() {
    let pool = common::database().await;
    // A retry by hand resets `attempts`, so the new run's first execution has the same attempt
    // number as the stalled one: only the generation tells them apart, in either statement.
    with_each_stalled_outcome(&pool, a_stalled_execution_cannot_finish_a_rerun).await;
}

async fn a_stalled_execution_cannot_finish_a_rerun(pool: &PgPool, outcome: Outcome) {
    let id = common::enqueue(pool, "noop", json!({})).await;
    claim_due(pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let lease = |dispatch_gen| StartRequest { id, dispatch_gen, lease: Duration::from_secs(60) };
    assert_eq!(start(pool, &[lease(1)]).await.unwrap().len(), 1);
    rowq::store::run::dead_letter(pool, id, 1, "dead-lettered in a test").await.unwrap().unwrap();
    assert!(rowq::store::admin::retry(pool, id).await.unwrap().is_some());
    claim_due(pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let rerun = start(pool, &[lease(2)]).await.unwrap();
    assert_eq!((rerun.len(), rerun[0].attempt), (1, 1));

    let stalled = Finish { id, dispatch_gen: 1, attempt: 1, outcome };
    let recorded = finish(pool, &[stalled]).await.unwrap();
    assert!(recorded.is_empty(), "the stalled execution of generation 1 finished generation 2's run: {recorded:?}");
    assert_eq!(common::job(pool, id).await.state, JobState::Running);
}

/// The claim commits asynchronously. A server crash that loses it brings the row back
/// `pending` with the generation before it, while its message is already out; recovery is
/// replayed here by writing back exactly that row. Both orders in which the lost generation's
/// message can meet the row run the job once.
#[tokio::test]
async fn a_claim_lost_in_a_crash_still_runs_its_job_once() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let worker = worker(&pool);
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), common::scheduler_config(MEMORY_URL));
    let lose_the_claim = |id: JobId| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "UPDATE rowq.jobs SET state = 'pending', dispatch_gen = dispatch_gen - 1, dispatch_deadline = NULL
                 WHERE id = $1 AND state = 'dispatched'",
            )
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
        }
    };

    // 1. The lost generation's message arrives after the row was claimed again: the new claim
    // has the same generation and the same deduplication id, so SQS keeps one of the two
    // messages, and whichever arrives runs the job once; the other finds it running or done.
    let late = common::enqueue(&pool, "effect", json!({})).await;
    scheduler.run_once().await.unwrap();
    let lost = scheduler.publisher().take();
    lose_the_claim(late).await;
    scheduler.run_once().await.unwrap();
    let again = scheduler.publisher().take();
    assert_eq!(again[0].message, lost[0].message, "the claim after the crash is a different generation");
    assert_eq!(again[0].dedup_id, lost[0].dedup_id, "SQS would not drop the second message as a duplicate");
    for outgoing in [&lost[0], &again[0]] {
        assert!(deliver(&worker, vec![record("m", "g", outgoing.message.encode())]).await.is_empty());
    }
    assert_eq!(effects_of(&pool, late).await, 1);
    let row = common::job(&pool, late).await;
    assert_eq!((row.state, row.attempts), (JobState::Succeeded, 1));

    // 2. It arrives before the row is claimed again: the row is not dispatched for it, so it
    // is dropped; the next claim's message (same id) is the one SQS drops, and the row waits
    // for its dispatch lease, is rescued and runs once under the next generation.
    let early = common::enqueue(&pool, "effect", json!({})).await;
    scheduler.run_once().await.unwrap();
    let lost = scheduler.publisher().take();
    lose_the_claim(early).await;
    assert!(deliver(&worker, vec![record("m1", "g", lost[0].message.encode())]).await.is_empty());
    assert_eq!(effects_of(&pool, early).await, 0, "a message of a lost claim ran the job");
    scheduler.run_once().await.unwrap();
    let deduplicated = scheduler.publisher().take();
    assert_eq!(deduplicated[0].dedup_id, lost[0].dedup_id);
    sqlx::query("UPDATE rowq.jobs SET dispatch_deadline = now() - interval '1 second' WHERE id = $1")
        .bind(early)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(maintenance::run_once(&pool, Duration::ZERO).await.unwrap().rescued_dispatched, 1);
    scheduler.run_once().await.unwrap();
    let next = scheduler.publisher().take();
    assert_eq!(next[0].message.dispatch_gen, lost[0].message.dispatch_gen + 1);
    assert!(deliver(&worker, vec![record("m2", "g", next[0].message.encode())]).await.is_empty());
    assert_eq!(effects_of(&pool, early).await, 1);
    assert_eq!(common::job(&pool, early).await.state, JobState::Succeeded);
}

/// The records of every claimed job, `per_batch` to a batch, one message group per job.
async fn claimed_batches(pool: &PgPool, per_batch: usize) -> Vec<Vec<SqsMessage>> {
    let claimed = claim_due(pool, "default", 1000, Duration::from_secs(60)).await.unwrap();
    let records: Vec<SqsMessage> = claimed
        .iter()
        .map(|c| record(&format!("m{}", c.id), &format!("g{}", c.id), message(c.id, c.dispatch_gen)))
        .collect();
    records.chunks(per_batch).map(<[SqsMessage]>::to_vec).collect()
}

/// `started_at` and `finished_at` are `now()` of the fence's and the finish's transactions:
/// jobs fenced in one statement share one `started_at`.
#[tokio::test]
async fn batches_handled_at_once_by_one_worker_share_their_fence_and_finish_statements() {
    let pool = common::database().await;
    common::enqueue_many(&pool, "noop", 80).await;
    let worker = worker(&pool);
    let batches = claimed_batches(&pool, 10).await;
    assert_eq!(batches.len(), 8);
    let failed = futures::future::join_all(batches.into_iter().map(|records| deliver(&worker, records))).await;
    assert!(failed.iter().all(Vec::is_empty), "{failed:?}");
    assert_eq!(common::count_in_state(&pool, JobState::Succeeded).await, 80);
    let (fences, finishes): (i64, i64) =
        sqlx::query_as("SELECT count(DISTINCT started_at), count(DISTINCT finished_at) FROM rowq.jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    println!("8 concurrent batches of 10: {fences} fence statement(s), {finishes} finish statement(s)");
    assert!(fences <= 2 && finishes <= 2, "{fences} fences, {finishes} finishes for 8 batches");
}

/// `handle_batch_then` says the handlers have returned before the batch's outcomes are
/// recorded: that is what lets the next batch's fence go in the same statement as this finish
/// (`run::step`). Here the finish is held back by a lock on the job's row, which the handler
/// takes in a transaction of its own and leaves open: the poller must be told while the row is
/// still `running`. Told only after the finish, it is not told at all while the lock is held
/// (the test gives up waiting after 10 s, then releases it).
#[tokio::test]
async fn a_batch_says_its_handlers_returned_before_its_outcomes_are_recorded() {
    let pool = common::database().await;
    let held: Arc<tokio::sync::Mutex<Option<sqlx::Transaction<'static, sqlx::Postgres>>>> = Arc::default();
    let registry = Registry::new().register("lock_own_row", {
        let (pool, held) = (pool.clone(), held.clone());
        move |ctx: JobContext, _: serde_json::Value| {
            let (pool, held) = (pool.clone(), held.clone());
            async move {
                let mut tx = pool.begin().await?;
                sqlx::query("SELECT 1 FROM rowq.jobs WHERE id = $1 FOR UPDATE")
                    .bind(ctx.job_id)
                    .execute(&mut *tx)
                    .await?;
                *held.lock().await = Some(tx);
                Ok(())
            }
        }
    });
    let worker = Worker::new(pool.clone(), registry, common::worker_config());
    let id = common::enqueue(&pool, "lock_own_row", json!({})).await;
    claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let (returned, handlers_returned) = tokio::sync::oneshot::channel();
    let deadline = Instant::now() + Duration::from_secs(30);
    let records = vec![record("m1", "g", message(id, 1))];
    let (response, state_when_told) =
        tokio::join!(worker.handle_batch_then(event(records), deadline, 0, Some(returned)), async {
            let told = tokio::time::timeout(Duration::from_secs(10), handlers_returned).await;
            let state = common::job(&pool, id).await.state;
            if let Some(tx) = held.lock().await.take() {
                tx.rollback().await.unwrap();
            }
            assert!(matches!(told, Ok(Ok(()))), "not told while the finish waited: {told:?}");
            state
        });
    assert!(response.batch_item_failures.is_empty(), "{response:?}");
    assert_eq!(state_when_told, JobState::Running, "told after the outcome was recorded");
    assert_eq!(common::job(&pool, id).await.state, JobState::Succeeded);
}

/// `handle_batch_then` says so only when the last round of a batch has run: two records of one
/// group run one after the other, and the second's handler has returned when it does.
#[tokio::test]
async fn a_batch_says_its_handlers_returned_only_after_its_last_round() {
    let pool = common::database().await;
    let returned_handlers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = returned_handlers.clone();
    let registry = Registry::new().register("count", move |_: JobContext, _: serde_json::Value| {
        let counted = counted.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
    });
    let worker = Worker::new(pool.clone(), registry, common::worker_config());
    let ids = [common::enqueue(&pool, "count", json!({})).await, common::enqueue(&pool, "count", json!({})).await];
    claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    let records = ids.iter().map(|id| record(&format!("m{}", id.0), "one-group", message(*id, 1))).collect();
    let (returned, handlers_returned) = tokio::sync::oneshot::channel();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (response, seen) = tokio::join!(worker.handle_batch_then(event(records), deadline, 0, Some(returned)), async {
        handlers_returned.await.expect("told when the handlers returned");
        returned_handlers.load(std::sync::atomic::Ordering::SeqCst)
    });
    assert!(response.batch_item_failures.is_empty());
    assert_eq!(seen, 2, "told before the second round's handler returned");
}

/// From two pollers of one lane, the two fences go in one statement, which names the job once;
/// from pollers of two lanes, in two statements at once, and the row's guard lets one through.
#[tokio::test]
async fn a_job_delivered_to_two_batches_handled_at_once_runs_once() {
    let pool = common::database().await;
    common::create_effects(&pool).await;
    let worker = worker(&pool);
    for pollers in [(0, rowq::worker::LANES), (0, 1)] {
        let id = common::enqueue(&pool, "effect", json!({})).await;
        let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
        let body = message(id, claimed[0].dispatch_gen);
        let (first, second) = tokio::join!(
            deliver_from(&worker, pollers.0, vec![record("m1", "g", body.clone())]),
            deliver_from(&worker, pollers.1, vec![record("m2", "g", body)]),
        );
        assert!(
            first.is_empty() && second.is_empty(),
            "{pollers:?}: the duplicate is acknowledged: {first:?} {second:?}"
        );
        let row = common::job(&pool, id).await;
        assert_eq!((row.state, row.attempts), (JobState::Succeeded, 1), "{pollers:?}");
        assert_eq!(effects_of(&pool, id).await, 1, "{pollers:?}");
    }
}

/// The worker's lanes are chains of statements of their own: with both statements of one lane
/// held up (a lock on their rows), a batch of the other lane's poller still runs at once. With
/// one lane for every poller, it waits behind them.
#[tokio::test]
async fn a_lane_whose_statements_are_held_up_does_not_hold_up_the_other() {
    let pool = common::database_with(8).await;
    let ids = [
        common::enqueue(&pool, "noop", json!({})).await,
        common::enqueue(&pool, "noop", json!({})).await,
        common::enqueue(&pool, "noop", json!({})).await,
    ];
    claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    let batch = |id: JobId| vec![record(&format!("m{}", id.0), &format!("g{}", id.0), message(id, 1))];
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM rowq.jobs WHERE id = ANY ($1) FOR UPDATE")
        .bind(vec![ids[0].0, ids[1].0])
        .execute(&mut *lock)
        .await
        .unwrap();
    let worker = Arc::new(worker(&pool));
    let waiting_on_locks = |n: i64| {
        let pool = pool.clone();
        common::eventually(Duration::from_secs(10), "the fences to wait on the lock", move || {
            let pool = pool.clone();
            async move {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                (waiting == n).then_some(())
            }
        })
    };
    // Pollers 0 and LANES share lane 0: one fence at a time, each in a statement of its own.
    let mut held = Vec::new();
    for (n, (poller, id)) in [(0, ids[0]), (rowq::worker::LANES, ids[1])].into_iter().enumerate() {
        let worker = worker.clone();
        held.push(tokio::spawn(async move { deliver_from(&worker, poller, batch(id)).await }));
        waiting_on_locks(n as i64 + 1).await;
    }
    let other = tokio::time::timeout(Duration::from_secs(10), deliver_from(&worker, 1, batch(ids[2]))).await;
    let states = [common::job(&pool, ids[0]).await.state, common::job(&pool, ids[2]).await.state];
    lock.rollback().await.unwrap();
    assert_eq!(other.ok(), Some(Vec::new()), "lane 1's batch waited behind lane 0's statements");
    assert_eq!(states, [JobState::Dispatched, JobState::Succeeded]);
    for batch in held {
        assert!(batch.await.unwrap().is_empty());
    }
    assert_eq!(common::count_in_state(&pool, JobState::Succeeded).await, 3);
}

#[tokio::test]
async fn a_database_failure_under_a_shared_statement_fails_every_batch_in_it() {
    let pool = common::database().await;
    common::enqueue_many(&pool, "noop", 6).await;
    let batches = claimed_batches(&pool, 2).await;
    let mut config = common::worker_config();
    config.database.url = "postgres://postgres@127.0.0.1:1/nowhere".into();
    let worker = Worker::new(
        rowq::store::connect_lazy(&config.database, rowq::store::Session::Worker).unwrap(),
        registry(),
        config,
    );
    let failed = futures::future::join_all(batches.iter().cloned().map(|records| deliver(&worker, records))).await;
    for (batch, failed) in batches.iter().zip(failed) {
        let all: Vec<String> = batch.iter().filter_map(|r| r.message_id.clone()).collect();
        assert_eq!(failed, all, "every record of every batch is handed back");
    }
    assert_eq!(common::count_in_state(&pool, JobState::Dispatched).await, 6);
}

/// A stale and a current message for one job, in batches combined into one fence: the rows
/// find their request by position, so the job named twice is fenced in a second statement. The
/// same for a stale and a current finish. Both orders: with one statement, the row would see
/// only the request sorted last, and the current one would be lost when the stale one is.
#[tokio::test]
async fn a_stale_and_a_current_request_for_one_job_in_one_statement_start_it_and_record_it() {
    let pool = common::database().await;
    for generations in [[1, 2], [2, 1]] {
        let id = common::enqueue(&pool, "noop", json!({})).await;
        claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
        sqlx::query("UPDATE rowq.jobs SET state = 'pending' WHERE id = $1").bind(id).execute(&pool).await.unwrap();
        let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
        assert_eq!(claimed[0].dispatch_gen, 2);
        let request = |dispatch_gen| StartRequest { id, dispatch_gen, lease: Duration::from_secs(60) };
        let started = start(&pool, &generations.map(request)).await.unwrap();
        assert_eq!(started.iter().map(|s| (s.id, s.dispatch_gen)).collect::<Vec<_>>(), vec![(id, 2)]);

        let done = |dispatch_gen| Finish {
            id,
            dispatch_gen,
            attempt: 1,
            outcome: Outcome::Succeeded { result: json!(dispatch_gen) },
        };
        let recorded = finish(&pool, &generations.map(done)).await.unwrap();
        assert_eq!(recorded.iter().map(|f| f.dispatch_gen).collect::<Vec<_>>(), vec![2]);
        let row = common::job(&pool, id).await;
        assert_eq!((row.state, row.result), (JobState::Succeeded, Some(json!(2))));
    }
}

#[tokio::test]
async fn an_execution_taken_over_while_it_stalled_cannot_finish_the_one_that_took_over() {
    let pool = common::database().await;
    // A take-over keeps the generation: only the attempt tells the two executions apart.
    for outcome in stalled_outcomes() {
        let id = common::enqueue(&pool, "noop", json!({})).await;
        let claimed = claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
        let request = |lease| StartRequest { id, dispatch_gen: claimed[0].dispatch_gen, lease };
        assert_eq!(start(&pool, &[request(Duration::from_millis(50))]).await.unwrap()[0].attempt, 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(start(&pool, &[request(Duration::from_secs(60))]).await.unwrap()[0].attempt, 2);

        let stalled = Finish { id, dispatch_gen: claimed[0].dispatch_gen, attempt: 1, outcome };
        assert!(finish(&pool, &[stalled]).await.unwrap().is_empty(), "attempt 1 finished attempt 2's run");
        let row = common::job(&pool, id).await;
        assert_eq!((row.state, row.attempts), (JobState::Running, 2));
    }
}

/// The finish of one batch and the fence of the next, asked at once, go to Postgres as one
/// statement (`finished_at` of the one is `started_at` of the other: `now()` of one
/// transaction), and each keeps its guard there.
#[tokio::test]
async fn a_finish_and_a_fence_asked_at_once_share_one_statement_and_keep_their_guards() {
    let pool = common::database().await;
    let [done, next, stalled, stale]: [JobId; 4] = common::enqueue_many(&pool, "noop", 4).await.try_into().unwrap();
    claim_due(&pool, "default", 4, Duration::from_secs(60)).await.unwrap();
    let request = |id, dispatch_gen, lease| StartRequest { id, dispatch_gen, lease };
    start(&pool, &[request(done, 1, Duration::from_secs(60)), request(stalled, 1, Duration::from_millis(50))])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(start(&pool, &[request(stalled, 1, Duration::from_secs(60))]).await.unwrap()[0].attempt, 2);
    sqlx::query("UPDATE rowq.jobs SET state = 'pending' WHERE id = $1").bind(stale).execute(&pool).await.unwrap();
    assert_eq!(claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap()[0].dispatch_gen, 2);

    let succeeded =
        |id, attempt| Finish { id, dispatch_gen: 1, attempt, outcome: Outcome::Succeeded { result: json!(id) } };
    let steps = vec![
        Step::Finish(succeeded(done, 1)),
        Step::Finish(succeeded(stalled, 1)),
        Step::Start(request(next, 1, Duration::from_secs(60))),
        Step::Start(request(stale, 1, Duration::from_secs(60))),
    ];
    let answered = keys_answered(&pool, steps).await;
    let expected = vec![
        StepKey::Finish(rowq::store::run::Finished { id: done, dispatch_gen: 1, attempt: 1 }),
        StepKey::Start { id: next, dispatch_gen: 1 },
    ];
    assert_eq!(answered, expected, "only the current finish and fence are answered");

    let (done, next, stalled, stale) = (
        common::job(&pool, done).await,
        common::job(&pool, next).await,
        common::job(&pool, stalled).await,
        common::job(&pool, stale).await,
    );
    assert_eq!((done.state, done.result), (JobState::Succeeded, Some(json!(done.id))));
    assert_eq!((next.state, next.attempts), (JobState::Running, 1));
    assert_eq!(done.finished_at, next.started_at, "the finish and the fence were two statements");
    assert_eq!((stalled.state, stalled.attempts, stalled.result), (JobState::Running, 2, None), "attempt guard");
    assert_eq!((stale.state, stale.dispatch_gen), (JobState::Dispatched, 2), "generation guard");
}

/// Each execution learns from its fence how long its job had been due (the worker's `JobWait`
/// metric), by the database's clock, whether the fence went alone or in one statement with a
/// finish.
#[tokio::test]
async fn a_fence_says_how_long_each_job_had_been_due_alone_or_beside_a_finish() {
    let pool = common::database().await;
    let ids: Vec<JobId> = sqlx::query_scalar(
        "INSERT INTO rowq.jobs (kind, run_at) VALUES
            ('noop', now() - interval '90 seconds'), ('noop', now() - interval '30 seconds') RETURNING id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    claim_due(&pool, "default", 2, Duration::from_secs(60)).await.unwrap();
    let request = |id| StartRequest { id, dispatch_gen: 1, lease: Duration::from_secs(60) };
    let alone = start(&pool, &[request(ids[0])]).await.unwrap();

    let finish = Finish { id: ids[0], dispatch_gen: 1, attempt: 1, outcome: Outcome::Succeeded { result: json!(1) } };
    let mut connection = pool.acquire().await.unwrap();
    let done = step(&mut connection, vec![Step::Finish(finish), Step::Start(request(ids[1]))]).await.unwrap();
    let beside: Vec<_> = done.into_iter().filter_map(Done::started).collect();
    let finished_at = common::job(&pool, ids[0]).await.finished_at;
    assert_eq!(finished_at, common::job(&pool, ids[1]).await.started_at, "one statement");

    let seconds = [alone[0].waited_ms / 1000.0, beside[0].waited_ms / 1000.0];
    assert!((90.0..100.0).contains(&seconds[0]) && (30.0..40.0).contains(&seconds[1]), "{seconds:?}");
}

/// A job named by a finish and by a fence at once (a stalled execution reports while a
/// redelivered message takes it over) is asked in two statements: in one, the two `UPDATE`s
/// would race for the row on one snapshot, and which of them took it would be Postgres's
/// choice. Fenced first, the take-over wins and the stalled execution records nothing.
#[tokio::test]
async fn a_job_named_by_a_finish_and_a_fence_at_once_is_taken_over_in_two_statements() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap();
    let request = |lease| StartRequest { id, dispatch_gen: 1, lease };
    start(&pool, &[request(Duration::from_millis(50))]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let stalled = Finish { id, dispatch_gen: 1, attempt: 1, outcome: Outcome::Succeeded { result: json!("late") } };
    let steps = vec![Step::Finish(stalled), Step::Start(request(Duration::from_secs(60)))];
    let answered = keys_answered(&pool, steps).await;
    assert_eq!(answered, vec![StepKey::Start { id, dispatch_gen: 1 }]);
    let row = common::job(&pool, id).await;
    assert_eq!((row.state, row.attempts, row.result), (JobState::Running, 2, None));
}

/// A stale and a current message for one job, fenced in the statement that finishes another
/// job: the rows find their request by position, so that statement splits as `start` does.
#[tokio::test]
async fn a_stale_and_a_current_fence_for_one_job_beside_a_finish_start_it() {
    let pool = common::database().await;
    let [finished, twice]: [JobId; 2] = common::enqueue_many(&pool, "noop", 2).await.try_into().unwrap();
    claim_due(&pool, "default", 2, Duration::from_secs(60)).await.unwrap();
    let request = |id, dispatch_gen| StartRequest { id, dispatch_gen, lease: Duration::from_secs(60) };
    start(&pool, &[request(finished, 1)]).await.unwrap();
    sqlx::query("UPDATE rowq.jobs SET state = 'pending' WHERE id = $1").bind(twice).execute(&pool).await.unwrap();
    assert_eq!(claim_due(&pool, "default", 1, Duration::from_secs(60)).await.unwrap()[0].dispatch_gen, 2);

    let done = Finish { id: finished, dispatch_gen: 1, attempt: 1, outcome: Outcome::Succeeded { result: json!(1) } };
    let steps = vec![Step::Finish(done), Step::Start(request(twice, 1)), Step::Start(request(twice, 2))];
    let mut answered = keys_answered(&pool, steps).await;
    answered.sort_by_key(|key| matches!(key, StepKey::Start { .. }));
    let finished_key = rowq::store::run::Finished { id: finished, dispatch_gen: 1, attempt: 1 };
    assert_eq!(answered, vec![StepKey::Finish(finished_key), StepKey::Start { id: twice, dispatch_gen: 2 }]);
    assert_eq!(common::job(&pool, twice).await.state, JobState::Running);
}

/// The fence and the success-only finish find each row's request by the position of its id
/// among the bound ids, with a binary search that needs them in ascending order. Requests asked
/// in any order still each set their own row: alone, and in one combined statement.
#[tokio::test]
async fn requests_in_any_order_each_set_their_own_row_and_no_other() {
    let pool = common::database().await;
    let ids = common::enqueue_many(&pool, "noop", 6).await;
    claim_due(&pool, "default", 6, Duration::from_secs(60)).await.unwrap();
    // Each job's own lease and result, so that a row given another's request shows it.
    let lease = |id: JobId| Duration::from_secs(60 + 10 * id.0 as u64);
    let fence = |id: JobId| StartRequest { id, dispatch_gen: 1, lease: lease(id) };
    let done =
        |id: JobId| Finish { id, dispatch_gen: 1, attempt: 1, outcome: Outcome::Succeeded { result: json!(id.0) } };
    let (first, second): (Vec<JobId>, Vec<JobId>) = (vec![ids[4], ids[1], ids[5]], vec![ids[3], ids[0], ids[2]]);

    let leases_of = async |ids: &[JobId]| {
        let mut leases = Vec::new();
        for &id in ids {
            let row = common::job(&pool, id).await;
            let lease = row.run_deadline.zip(row.started_at).map(|(deadline, started)| deadline - started);
            leases.push(lease.and_then(|lease| lease.to_std().ok()));
        }
        leases
    };

    let started = start(&pool, &first.iter().map(|&id| fence(id)).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(started.len(), 3, "every fence of the first three matched its row");
    assert_eq!(leases_of(&first).await, first.iter().map(|&id| Some(lease(id))).collect::<Vec<_>>());
    let steps: Vec<Step> = [first[2], first[0], first[1]]
        .into_iter()
        .map(|id| Step::Finish(done(id)))
        .chain(second.iter().map(|&id| Step::Start(fence(id))))
        .collect();
    assert_eq!(keys_answered(&pool, steps).await.len(), 6, "every request of the combined statement matched");
    assert_eq!(leases_of(&second).await, second.iter().map(|&id| Some(lease(id))).collect::<Vec<_>>());
    let finished = finish(&pool, &[done(second[2]), done(second[0]), done(second[1])]).await.unwrap();
    assert_eq!(finished.len(), 3, "every finish of the last three matched its row");

    for id in ids {
        let row = common::job(&pool, id).await;
        assert_eq!((row.state, row.result), (JobState::Succeeded, Some(json!(id.0))), "job {}'s result", id.0);
    }
}

/// What one combined statement of `steps` answered, by key.
async fn keys_answered(pool: &PgPool, steps: Vec<Step>) -> Vec<StepKey> {
    step(&mut pool.acquire().await.unwrap(), steps).await.unwrap().iter().map(Done::key).collect()
}

async fn backend_pid(connection: &mut sqlx::PgConnection) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(connection).await
}

/// A pool of `size` on `test`'s database and the connections a worker would keep of it for
/// `keep_for`.
async fn kept_of_pool(test: &PgPool, size: u32, keep_for: Duration) -> (PgPool, Arc<KeptConnections>) {
    let database = (*test.connect_options()).clone();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(size).connect_with(database).await.unwrap();
    (pool.clone(), Arc::new(KeptConnections::new(pool, 2, keep_for)))
}

/// One statement as the worker runs it: on a kept connection, kept again. Returns its backend.
async fn statement_on(kept: &Arc<KeptConnections>) -> i32 {
    let mut connection = kept.take().await.unwrap();
    let pid = backend_pid(&mut connection).await.unwrap();
    kept.keep(connection);
    pid
}

#[tokio::test]
async fn the_worker_keeps_its_connection_between_back_to_back_statements_then_gives_it_back() {
    let test = common::database().await;
    // A keep time long against a loaded machine's stalls: the checks within it must not race it.
    let (pool, kept) = kept_of_pool(&test, 3, Duration::from_secs(1)).await;
    let pid = statement_on(&kept).await;
    assert_eq!((kept.len(), pool.num_idle()), (1, 0), "kept, not back in the pool");
    assert_eq!(statement_on(&kept).await, pid, "the next statement runs on the same connection");

    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(kept.len(), 1, "still kept within its time");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(kept.is_empty(), "an unused connection goes back to the pool after its time");
    common::eventually(Duration::from_secs(5), "the pool to have it again", || {
        let idle = pool.num_idle();
        async move { (idle == 1).then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn the_worker_never_keeps_every_connection_of_its_pool() {
    let test = common::database().await;
    // A job's own transaction takes a connection from the same pool while the worker's
    // statements run: a Lambda worker's pool of 2 keeps one free for it.
    let (pool, kept) = kept_of_pool(&test, 2, Duration::from_secs(60)).await;
    let (a, b) = (kept.take().await.unwrap(), kept.take().await.unwrap());
    kept.keep(a);
    kept.keep(b);
    assert_eq!(kept.len(), 1);
    let mut for_a_job = tokio::time::timeout(Duration::from_secs(2), pool.acquire()).await.unwrap().unwrap();
    backend_pid(&mut for_a_job).await.unwrap();

    let (_single, kept) = kept_of_pool(&test, 1, Duration::from_secs(60)).await;
    statement_on(&kept).await;
    assert!(kept.is_empty(), "a pool of one keeps nothing");
}

#[tokio::test]
async fn a_connection_kept_past_its_time_is_not_handed_out_even_if_its_release_has_not_run() {
    let test = common::database().await;
    // A Lambda instance is frozen between invocations, timers included; the database or a
    // proxy may close an idle connection meanwhile. Here the server ends the kept connection's
    // session and the thread blocks past the keep time, so the release cannot run.
    // The session ends before the connection is kept, so nothing awaits between the keep and
    // the blocking sleep: on this one-thread runtime the release timer cannot run however slow
    // the machine (awaiting the terminate after the keep let a loaded CI machine run it).
    let (pool, kept) = kept_of_pool(&test, 3, Duration::from_millis(100)).await;
    let mut connection = kept.take().await.unwrap();
    let pid = backend_pid(&mut connection).await.unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&pool).await.unwrap();
    kept.keep(connection);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(kept.len(), 1, "the release did not run: the runtime was blocked");
    let mut fresh = kept.take().await.unwrap();
    assert_ne!(backend_pid(&mut fresh).await.unwrap(), pid, "a live connection from the pool, not the stale one");
}

/// Every connection of rowq's pool to Postgres sends without Nagle's delay (TCP_NODELAY, the
/// patch in `vendor/sqlx-core`). Without it a statement whose bound values span more than one
/// segment — a combined finish of 80 results of a few hundred bytes — waited ~44 ms for the
/// server's delayed ACK over TLS, and every new connection ~90 ms.
#[tokio::test]
async fn the_connections_to_postgres_send_without_nagles_delay() {
    let test = common::database().await;
    let pool =
        rowq::store::connect(&common::own_database_config(&test, 3), rowq::store::Session::Worker).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(pool.acquire().await.unwrap());
    }
    // The pool's own sockets, by their local ports as the server sees them: the other tests in
    // this process connect at the same time, and a socket of theirs caught between its connect
    // and its TCP_NODELAY read as one without it.
    let mut ours = Vec::new();
    for connection in &mut held {
        let port: i32 = sqlx::query_scalar("SELECT inet_client_port()").fetch_one(&mut **connection).await.unwrap();
        ours.push(u16::try_from(port).unwrap());
    }
    let server = test.connect_options().get_port();
    let sockets: Vec<(u16, bool)> =
        postgres_sockets(server).into_iter().filter(|(local, _)| ours.contains(local)).collect();
    assert_eq!(sockets.len(), 3, "the pool's connections (local ports {ours:?}) among the process's sockets");
    assert!(
        sockets.iter().all(|&(_, nodelay)| nodelay),
        "sockets to port {server} (local port, TCP_NODELAY): {sockets:?}"
    );
}

/// The process's TCP sockets whose peer is `port`: each one's local port, and whether TCP_NODELAY
/// is set on it.
fn postgres_sockets(port: u16) -> Vec<(u16, bool)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let Ok(fd) = entry.unwrap().file_name().to_string_lossy().parse::<i32>() else { continue };
        // SAFETY: the descriptor is open (listed just now) and only borrowed for these calls.
        let descriptor = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let socket = socket2::SockRef::from(&descriptor);
        let peer = socket.peer_addr().ok().and_then(|address| address.as_socket());
        if peer.map(|address| address.port()) != Some(port) {
            continue; // not a socket connected to the server
        }
        let Some(local) = socket.local_addr().ok().and_then(|address| address.as_socket()) else { continue };
        let nodelay = socket.tcp_nodelay().unwrap_or_else(|e| panic!("TCP_NODELAY of fd {fd}: {e}"));
        found.push((local.port(), nodelay));
    }
    found
}
