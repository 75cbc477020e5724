//! The `rowq` binary end to end, as an operator uses it, against real Postgres and LocalStack.

mod common;

use std::collections::BTreeSet;
use std::process::{Child, Command, Output};
use std::time::Duration;

use rowq::pipeline::Pipeline;
use rowq::{Registry, Worker};
use serde_json::{Value, json};
use sqlx::PgPool;

/// `binary` with the database and LocalStack's endpoint and credentials in its environment.
fn command(binary: &str, pool: &PgPool) -> Command {
    let mut command = Command::new(binary);
    command
        .env("DATABASE_URL", common::url_of(pool))
        .env("AWS_ENDPOINT_URL", common::endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test");
    command
}

/// `rowq work` on `queue_url`, reporting metrics under `rowq/test` for the queue `emails`, its
/// output piped; `settings` are more environment variables.
fn work_reporting_metrics(pool: &PgPool, queue_url: &str, settings: &[(&str, &str)]) -> Child {
    let mut work = command(env!("CARGO_BIN_EXE_rowq"), pool);
    work.arg("work")
        .env("ROWQ_QUEUE_URL", queue_url)
        .env("ROWQ_METRICS_NAMESPACE", "rowq/test")
        .env("ROWQ_QUEUE", "emails")
        .env("ROWQ_WAIT_SECS", "1")
        .envs(settings.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    work.spawn().expect("start rowq work")
}

/// Whether every message of the queue has been received and deleted: a batch handler has
/// returned (and printed what it prints) for each.
async fn handled_and_deleted(client: &aws_sdk_sqs::Client, queue_url: &str) -> bool {
    let depth = rowq::sqs::queue_depth(client, queue_url).await.expect("the queue's depth");
    (depth.visible, depth.in_flight) == (0, 0)
}

/// A job of `kind` as the scheduler leaves it once it has published generation 1.
async fn dispatched(pool: &PgPool, kind: &str) -> rowq::JobId {
    sqlx::query_scalar("INSERT INTO rowq.jobs (kind, state, dispatch_gen) VALUES ($1, 'dispatched', 1) RETURNING id")
        .bind(kind)
        .fetch_one(pool)
        .await
        .expect("insert a dispatched job")
}

/// `rowq ARGS` on the test's database, to run or spawn.
fn rowq_command(pool: &PgPool, args: &[&str]) -> Command {
    let mut rowq = command(env!("CARGO_BIN_EXE_rowq"), pool);
    rowq.args(["--database-url", &common::url_of(pool)]).args(args);
    rowq
}

fn rowq(pool: &PgPool, args: &[&str]) -> Output {
    rowq_command(pool, args).output().expect("run rowq")
}

/// Runs `scheduler --once` publishing to `queue_url`, with `env` added; expects success.
fn schedule_once(pool: &PgPool, queue_url: &str, env: &[(&str, &str)]) -> Output {
    let output = command(env!("CARGO_BIN_EXE_scheduler"), pool)
        .arg("--once")
        .env("ROWQ_QUEUE_URL", queue_url)
        .envs(env.iter().copied())
        .output()
        .expect("run the scheduler");
    assert!(output.status.success(), "scheduler --once failed: {}", stderr(&output));
    output
}

/// The JSON lines a binary printed on stdout (its metrics; its logs are on stderr).
fn json_lines(output: &Output) -> Vec<Value> {
    stdout(output)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs `rowq ARGS --json`, expects success, and parses its output.
fn json_of(pool: &PgPool, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    parsed(args, &rowq(pool, &all))
}

/// The JSON a successful `rowq ARGS --json` printed.
fn parsed(args: &[&str], output: &Output) -> Value {
    assert!(output.status.success(), "rowq {args:?} failed: {}", stderr(output));
    serde_json::from_str(&stdout(output))
        .unwrap_or_else(|e| panic!("rowq {args:?} --json is not JSON ({e}): {}", stdout(output)))
}

/// Runs `rowq ARGS`, expects exit code 1 and one clear line on stderr.
fn refusal(pool: &PgPool, args: &[&str]) -> String {
    let output = rowq(pool, args);
    assert_eq!(output.status.code(), Some(1), "rowq {args:?} should fail: {}", stdout(&output));
    let message = stderr(&output);
    assert_eq!(message.trim().lines().count(), 1, "not one line: {message}");
    assert!(message.starts_with("rowq: "), "{message}");
    message
}

#[tokio::test]
async fn enqueue_then_status_shows_the_job_succeeded_with_its_result() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let config = common::pipeline_config(&queues, 2, false);
    let worker = Worker::new(pool.clone(), Registry::builtin(), common::worker_config());
    let pipeline = Pipeline::start(pool.clone(), client, worker, config).await.unwrap();

    let enqueued = json_of(&pool, &["enqueue", "echo", r#"{"greeting":"hello"}"#, "--priority", "3"]);
    assert_eq!(enqueued["enqueued"], json!(true));
    let id = enqueued["id"].as_i64().unwrap().to_string();
    let status = common::eventually(Duration::from_secs(30), "the job to succeed", || {
        let status = json_of(&pool, &["status", &id]);
        async move { (status["state"] == json!("succeeded")).then_some(status) }
    })
    .await;
    pipeline.stop().await;
    assert_eq!(status["result"], json!({"greeting": "hello"}));
    assert_eq!(status["attempts"], json!(1));
    assert_eq!(status["priority"], json!(3));

    let text = stdout(&rowq(&pool, &["status", &id]));
    assert!(text.contains("succeeded") && text.contains(r#"result        {"greeting":"hello"}"#), "{text}");
    let listed = json_of(&pool, &["list", "--state", "succeeded"]);
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let stats = json_of(&pool, &["stats"]);
    assert_eq!(stats["counts"][0]["state"], json!("succeeded"));
    assert_eq!(stats["finished_last_minute"], json!(1));
    assert!(stats["cleanup_held_by"].is_array(), "{stats}");
}

#[tokio::test]
async fn cancel_and_retry_move_jobs_and_refuse_clearly_when_they_cannot() {
    let pool = common::database().await;
    let pending = json_of(&pool, &["enqueue", "noop", "--delay", "3600"])["id"].as_i64().unwrap().to_string();
    let cancelled = json_of(&pool, &["cancel", &pending]);
    assert_eq!(cancelled["state"], json!("cancelled"));
    let message = refusal(&pool, &["cancel", &pending]);
    assert!(message.contains(&format!("job {pending} is already cancelled")), "{message}");

    let running = json_of(&pool, &["enqueue", "noop"])["id"].as_i64().unwrap().to_string();
    sqlx::query("UPDATE rowq.jobs SET state = 'running', attempts = 1 WHERE id = $1")
        .bind(running.parse::<i64>().unwrap())
        .execute(&pool)
        .await
        .unwrap();
    let message = refusal(&pool, &["cancel", &running]);
    assert!(message.contains("is running (attempt 1): it cannot be cancelled now"), "{message}");
    let message = refusal(&pool, &["retry", &running]);
    assert!(message.contains("is running: only failed or cancelled jobs can be retried"), "{message}");

    let failed = json_of(&pool, &["enqueue", "fail", "--dedup-key", "once"])["id"].as_i64().unwrap();
    sqlx::query("UPDATE rowq.jobs SET state = 'failed', attempts = 5, finished_at = now() WHERE id = $1")
        .bind(failed)
        .execute(&pool)
        .await
        .unwrap();
    // While another unfinished job holds its dedup key, the retry is refused.
    json_of(&pool, &["enqueue", "fail", "--dedup-key", "once"]);
    let message = refusal(&pool, &["retry", &failed.to_string()]);
    assert!(message.contains("another unfinished job holds its dedup_key"), "{message}");
    sqlx::query("DELETE FROM rowq.jobs WHERE dedup_key = 'once' AND id <> $1")
        .bind(failed)
        .execute(&pool)
        .await
        .unwrap();
    let retried = json_of(&pool, &["retry", &failed.to_string()]);
    assert_eq!((retried["state"].clone(), retried["attempts"].clone()), (json!("pending"), json!(0)));

    sqlx::query("UPDATE rowq.jobs SET state = 'failed', finished_at = now() WHERE id = $1")
        .bind(failed)
        .execute(&pool)
        .await
        .unwrap();
    let all = json_of(&pool, &["retry", "--all-failed"]);
    assert_eq!(all["retried"], json!([failed]));
}

#[tokio::test]
async fn bad_input_gets_one_clear_line_and_a_nonzero_exit() {
    let pool = common::database().await;
    let message = refusal(&pool, &["enqueue", "noop", "{not json"]);
    assert!(message.contains("PAYLOAD is not valid JSON"), "{message}");
    let message = refusal(&pool, &["enqueue", "bad kind!"]);
    assert!(message.contains("jobs_kind_is_a_nonempty_identifier"), "{message}");
    let message = refusal(&pool, &["enqueue", "noop", "[1]"]);
    assert!(message.contains("jobs_payload_is_a_json_object"), "{message}");
    let message = refusal(&pool, &["enqueue", "noop", r#"{"a":"\u0000"}"#]);
    assert!(message.contains("the database refused it: unsupported Unicode escape sequence (\\u0000"), "{message}");
    // clap's usage errors exit 2; a time without its offset says what a time must be.
    for args in
        [&["enqueue", "noop", "--run-at", "2026-12-01 09:00"][..], &["retry", "--all-failed", "--since", "today"]]
    {
        let output = rowq(&pool, args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(
            stderr(&output).contains("not an RFC 3339 time with its offset, as 2026-12-01T09:00:00Z"),
            "{}",
            stderr(&output)
        );
    }
    let message = refusal(&pool, &["status", "424242"]);
    assert!(message.contains("job 424242 does not exist"), "{message}");

    let output = Command::new(env!("CARGO_BIN_EXE_rowq"))
        .args(["--database-url", "postgres://nobody:secret@127.0.0.1:1/nowhere", "stats"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let message = stderr(&output);
    assert!(message.contains("cannot connect to postgres://nobody:***@127.0.0.1:1/nowhere"), "{message}");
    assert!(!message.contains("secret"), "the password leaked: {message}");

    let output = Command::new(env!("CARGO_BIN_EXE_rowq"))
        .args(["queues", "create", "--name", "rowq-cli-test"])
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("cannot create the queues"), "{}", stderr(&output));
}

#[tokio::test]
async fn queues_create_is_idempotent_and_prints_the_urls() {
    let pool = common::database().await;
    let name = format!("rowq-cli-{}", std::process::id());
    let first = json_of(&pool, &["queues", "create", "--name", &name]);
    let second = json_of(&pool, &["queues", "create", "--name", &name, "--max-receive-count", "3"]);
    assert_eq!(first["queue_url"], second["queue_url"]);
    assert!(first["queue_url"].as_str().unwrap().ends_with(&format!("{name}.fifo")));
    assert!(first["dlq_url"].as_str().unwrap().ends_with(&format!("{name}-dlq.fifo")));
    let shown = json_of(&pool, &["queues", "show", "--name", &name]);
    assert_eq!(shown[format!("{name}.fifo")]["visible"], json!(0));
}

#[test]
fn every_subcommand_has_help() {
    for sub in [
        "migrate", "enqueue", "status", "wait", "list", "stats", "retry", "discard", "cancel", "queues", "dev", "demo",
        "work",
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_rowq")).args([sub, "--help"]).output().unwrap();
        assert!(output.status.success(), "rowq {sub} --help failed");
        assert!(stdout(&output).contains("Usage: rowq"), "rowq {sub} --help: {}", stdout(&output));
    }
}

/// With `ROWQ_METRICS_NAMESPACE` set, the scheduler binary prints its queue's gauges as one
/// CloudWatch Embedded Metric Format line on stdout, where its logs (stderr) never go.
#[tokio::test]
async fn the_scheduler_prints_its_queues_gauges_as_cloudwatch_metrics_on_stdout() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, run_at) VALUES
            ('noop', now() - interval '60 seconds'), ('noop', now()), ('noop', now() + interval '1 hour')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let output = schedule_once(&pool, &queues.queue_url, &[("ROWQ_METRICS_NAMESPACE", "rowq/test")]);
    let lines = json_lines(&output);
    assert_eq!(lines.len(), 1, "one metrics line per maintenance interval: {lines:?}");
    let line = &lines[0];
    assert_eq!(line["_aws"]["CloudWatchMetrics"][0]["Namespace"], "rowq/test", "{line}");
    assert_eq!(line["Queue"], "default");
    // Read before the run's first claim: the two due jobs, the older one due for 60 s.
    assert_eq!(line["DuePending"], 2, "{line}");
    let oldest = ["OldestDuePendingSeconds", "OldestClaimableSeconds"].map(|name| line[name].as_f64().unwrap());
    assert!(oldest.iter().all(|secs| (60.0..90.0).contains(secs)), "{line}");
    assert_eq!((line["Dispatched"].as_i64(), line["Running"].as_i64()), (Some(0), Some(0)), "{line}");
    // Then it dispatched them as usual.
    let dispatched: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rowq.jobs WHERE state = 'dispatched'").fetch_one(&pool).await.unwrap();
    assert_eq!(dispatched, 2);
}

/// With `ROWQ_METRICS_NAMESPACE` set, a worker prints what each batch did as metrics lines, one
/// per kind it ran and one of the messages it did not run: `rowq work` runs a success, a failure
/// with attempts left and a permanent failure, and acknowledges a message for a generation no job
/// is waiting for and one that is no rowq message.
#[tokio::test]
async fn a_worker_prints_what_each_batch_did_by_kind_as_cloudwatch_metrics_on_stdout() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    sqlx::query(
        r#"INSERT INTO rowq.jobs (kind, payload)
           VALUES ('noop', '{}'), ('fail', '{"times": 1}'), ('fail', '{}'), ('resize_42', '{}'), ('resize_43', '{}')"#,
    )
    .execute(&pool)
    .await
    .unwrap();
    schedule_once(&pool, &queues.queue_url, &[]);
    let stale = [(rowq::JobId(1), 7)];
    assert_eq!(common::send_job_messages(&client, &queues.queue_url, &stale, "stale").await, Ok(1));
    client
        .send_message()
        .queue_url(&queues.queue_url)
        .message_body("not a rowq message")
        .message_group_id("junk")
        .message_deduplication_id("junk")
        .send()
        .await
        .expect("send a malformed message");

    let backoff = [("ROWQ_BACKOFF_BASE_MS", "60000"), ("ROWQ_BACKOFF_MAX_SECS", "60")];
    let worker = work_reporting_metrics(&pool, &queues.queue_url, &backoff);
    let started = std::time::Instant::now();
    let finished = loop {
        let counts: (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state IN ('succeeded', 'failed')),
                    count(*) FILTER (WHERE state = 'pending' AND attempts = 1)
             FROM rowq.jobs",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        // Every message handled and deleted, the stale one too: its batch's metrics are printed.
        let emptied = handled_and_deleted(&client, &queues.queue_url).await;
        if (counts == (4, 1) && emptied) || started.elapsed() > Duration::from_secs(30) {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut worker = worker;
    worker.kill().expect("stop rowq work");
    let output = worker.wait_with_output().expect("rowq work's output");
    assert_eq!(finished, (4, 1), "the jobs did not run: {}", stderr(&output));

    let lines = json_lines(&output);
    assert!(!lines.is_empty(), "no metrics line: {}", stderr(&output));
    let total = |kind: Option<&str>, name: &str| {
        let of_kind = |line: &&Value| kind.is_none_or(|kind| line["Kind"] == kind);
        lines.iter().filter(of_kind).map(|line| line[name].as_u64().unwrap_or(0)).sum::<u64>()
    };
    let names = rowq::metrics::EXECUTIONS[..4].iter().chain(&rowq::metrics::MESSAGES).map(|(name, _)| *name);
    let totals: Vec<(&str, u64)> = names.map(|name| (name, total(None, name))).collect();
    assert_eq!(
        totals,
        [
            ("JobsSucceeded", 1),
            ("JobsRetried", 1),
            ("JobsFailed", 3),
            ("JobsSuperseded", 0),
            ("MessagesStale", 1),
            ("MessagesReturned", 0),
            ("MessagesMalformed", 1)
        ],
        "{lines:?}"
    );
    let by_kind = |kind| ["JobsSucceeded", "JobsRetried", "JobsFailed"].map(|name| total(Some(kind), name));
    assert_eq!((by_kind("noop"), by_kind("fail")), ([1, 0, 0], [0, 1, 1]), "{lines:?}");
    // Kinds no handler knows fail, and count under one `Kind`: producers cannot add metrics.
    assert_eq!(by_kind(rowq::metrics::UNREGISTERED_KIND), [0, 0, 2], "{lines:?}");
    let kinds: BTreeSet<&str> = lines.iter().filter_map(|line| line["Kind"].as_str()).collect();
    assert_eq!(kinds, BTreeSet::from(["(unregistered)", "fail", "noop"]), "{lines:?}");
    for name in ["JobDuration", "JobWait"] {
        let values: Vec<f64> =
            lines.iter().filter_map(|line| line[name].as_array()).flatten().filter_map(Value::as_f64).collect();
        assert_eq!(values.len(), 5, "one {name} per execution: {lines:?}");
        assert!(values.iter().all(|ms| (0.0..30_000.0).contains(ms)), "{name}: {values:?}");
    }
    for line in &lines {
        assert_eq!(line["Queue"], "emails", "{line}");
        assert_eq!(line["_aws"]["CloudWatchMetrics"][0]["Namespace"], "rowq/test", "{line}");
        let sets = if line["Kind"].is_string() { json!([["Queue"], ["Queue", "Kind"]]) } else { json!([["Queue"]]) };
        assert_eq!(line["_aws"]["CloudWatchMetrics"][0]["Dimensions"], sets, "{line}");
    }
}

/// The DLQ handler, given the same namespace, prints how many jobs of each kind it failed, and
/// how many it sent back: `rowq work` serves the DLQ too, and a message there for a job a worker
/// started fails it, one for a job no worker started sends it back to be dispatched again.
#[tokio::test]
async fn the_dlq_handler_prints_the_jobs_it_failed_by_kind_as_cloudwatch_metrics_on_stdout() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let id = dispatched(&pool, "resize_image").await;
    let unstarted = dispatched(&pool, "resize_image").await;
    let started = rowq::store::run::StartRequest { id, dispatch_gen: 1, lease: Duration::from_secs(60) };
    assert_eq!(rowq::store::run::start(&pool, &[started]).await.unwrap().len(), 1);
    assert_eq!(common::send_job_messages(&client, &queues.dlq_url, &[(id, 1), (unstarted, 1)], "dead").await, Ok(2));

    let worker = work_reporting_metrics(&pool, &queues.queue_url, &[("ROWQ_DLQ_URL", &queues.dlq_url)]);
    let started = std::time::Instant::now();
    // The job is failed when the handler's statement commits; its metrics line is printed once
    // the batch is done, before its message is deleted.
    while !(common::job(&pool, id).await.state == rowq::JobState::Failed
        && handled_and_deleted(&client, &queues.dlq_url).await)
        && started.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut worker = worker;
    worker.kill().expect("stop rowq work");
    let output = worker.wait_with_output().expect("rowq work's output");
    assert_eq!(common::job(&pool, id).await.state, rowq::JobState::Failed, "{}", stderr(&output));
    assert_eq!(common::job(&pool, unstarted).await.state, rowq::JobState::Pending, "{}", stderr(&output));

    let lines = json_lines(&output);
    let (failed, sent_back): (Vec<&Value>, Vec<&Value>) = lines.iter().partition(|line| line["Kind"].is_string());
    assert_eq!(failed.len(), 1, "one line for the one kind: {lines:?}");
    let sent_back: Vec<&Value> = sent_back.into_iter().filter(|line| line["JobsSentBack"].is_number()).collect();
    assert_eq!(sent_back.len(), 1, "one line of jobs sent back: {lines:?}");
    assert_eq!((&sent_back[0]["Queue"], &sent_back[0]["JobsSentBack"]), (&json!("emails"), &json!(1)));
    let line = failed[0];
    assert_eq!(
        (&line["Queue"], &line["Kind"], &line["JobsDeadLettered"]),
        (&json!("emails"), &json!("resize_image"), &json!(1))
    );
    assert_eq!(line["_aws"]["CloudWatchMetrics"][0]["Namespace"], "rowq/test", "{line}");
    assert_eq!(line["_aws"]["CloudWatchMetrics"][0]["Dimensions"], json!([["Queue"], ["Queue", "Kind"]]), "{line}");
}

/// `rowq stats` names the kinds that failed in the last hour, the most first: where to look,
/// without a metrics system. Older failures and other states do not count.
#[tokio::test]
async fn stats_names_the_kinds_that_failed_in_the_last_hour() {
    let pool = common::database().await;
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, state, finished_at) VALUES
            ('email', 'failed', now()), ('resize', 'failed', now() - interval '10 minutes'),
            ('resize', 'failed', now()), ('resize', 'failed', now() - interval '2 hours'),
            ('email', 'succeeded', now()), ('thumb', 'cancelled', now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let stats = json_of(&pool, &["stats"]);
    assert_eq!(stats["failed_last_hour"], json!([{"kind": "resize", "count": 2}, {"kind": "email", "count": 1}]));
    let text = stdout(&rowq(&pool, &["stats"]));
    assert!(text.contains("failed in the last hour, by kind: resize 2, email 1"), "{text}");
}

/// `rowq stats` counts, by queue, the jobs the claim has set aside behind their group: a backlog
/// that waits for its group, not for the scheduler.
#[tokio::test]
async fn stats_counts_the_jobs_waiting_behind_their_group() {
    let pool = common::database().await;
    sqlx::query("INSERT INTO rowq.jobs (kind, group_key) SELECT 'noop', 'tenant' FROM generate_series(1, 5)")
        .execute(&pool)
        .await
        .unwrap();
    rowq::store::dispatch::claim_due(&pool, "default", 10, std::time::Duration::from_secs(60)).await.unwrap();
    let stats = json_of(&pool, &["stats"]);
    assert_eq!(stats["behind_group"], json!([{"queue": "default", "count": 4}]));
    let text = stdout(&rowq(&pool, &["stats"]));
    assert!(text.contains("default: 4 pending jobs wait behind an unfinished earlier job of their group"), "{text}");
}

/// `rowq retry --all-failed --kind K` puts back the failed jobs of one kind (the one whose handler
/// was fixed) and no other, and with `--since` only those that failed since; a job whose `dedup_key` another job holds stays failed and is named,
/// where it used to refuse the whole retry: the key's unfinished job holds it, or, between failed
/// jobs of one key, the newest, which goes back instead.
#[tokio::test]
async fn a_retry_of_the_failed_jobs_of_a_kind_leaves_other_kinds_and_names_those_whose_key_is_held() {
    let pool = common::database().await;
    let insert = |kind: &'static str, queue: &'static str, key: Option<&'static str>, state: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "INSERT INTO rowq.jobs (kind, queue, dedup_key, state, attempts, finished_at)
                 VALUES ($1, $2, $3, $4::rowq.job_state, 5, CASE WHEN $4 = 'failed' THEN now() END) RETURNING id",
            )
            .bind(kind)
            .bind(queue)
            .bind(key)
            .bind(state)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let plain = insert("resize", "default", None, "failed").await;
    let held = insert("resize", "default", Some("k1"), "failed").await;
    let holder = insert("resize", "default", Some("k1"), "pending").await;
    let older = insert("resize", "default", Some("k2"), "failed").await;
    let newer = insert("resize", "default", Some("k2"), "failed").await;
    let other_kind = insert("email", "default", None, "failed").await;
    let other_queue = insert("resize", "bulk", None, "failed").await;
    let before = insert("resize", "default", None, "failed").await;
    sqlx::query("UPDATE rowq.jobs SET finished_at = now() - interval '2 days' WHERE id = $1")
        .bind(before)
        .execute(&pool)
        .await
        .unwrap();

    let since = (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
    let states =
        || sqlx::query_as::<_, (i64, String)>("SELECT id, state::text FROM rowq.jobs ORDER BY id").fetch_all(&pool);
    let untouched = states().await.unwrap();
    let filters = ["retry", "--all-failed", "--kind", "resize", "--queue", "default", "--since", &since];
    // A dry run says exactly what the retry will do, and does nothing.
    let dry = json_of(&pool, &[&filters[..], &["--dry-run"]].concat());
    assert_eq!(states().await.unwrap(), untouched, "a dry run changed the table");
    let done = json_of(&pool, &filters);
    assert_eq!(done["retried"], json!([plain, newer]), "{done}");
    let left = json!([{"id": held, "held_by": holder}, {"id": older, "held_by": newer}]);
    assert_eq!(done["left_failed"], left, "{done}");
    assert_eq!((&dry["retried"], &dry["left_failed"], &dry["dry_run"]), (&done["retried"], &left, &json!(true)));
    assert_eq!(done.get("dry_run"), None, "{done}");
    let states: Vec<(i64, String)> = states().await.unwrap();
    let pending = |id: i64| (id, if [plain, holder, newer].contains(&id) { "pending" } else { "failed" }.to_string());
    let expected: Vec<(i64, String)> =
        [plain, held, holder, older, newer, other_kind, other_queue, before].into_iter().map(pending).collect();
    assert_eq!(states, expected);

    // The rest, said in words: the two still held stay failed. A dry run says it in the conditional.
    let dry = stdout(&rowq(&pool, &["retry", "--all-failed", "--dry-run"]));
    assert!(
        dry.starts_with("dry run, nothing changed: 3 failed jobs would go back to pending; 2 would be left failed"),
        "{dry}"
    );
    let text = stdout(&rowq(&pool, &["retry", "--all-failed"]));
    let said = format!(
        "3 failed jobs back to pending; 2 left failed, as another job holds their dedup_key: {held} (held by {holder}), \
         {older} (held by {newer})"
    );
    assert_eq!(text.trim(), said);
}

/// `rowq cancel --all --kind K` cancels every pending or dispatched job of that kind (of `--queue`
/// too, when given), a producer's flood that must not run, and leaves running and finished jobs
/// and other kinds alone; with neither a kind nor a queue it refuses, so that no slip cancels
/// every queue.
#[tokio::test]
async fn a_cancel_of_all_of_a_kind_cancels_its_unstarted_jobs_and_nothing_else() {
    let pool = common::database().await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO rowq.jobs (kind, queue, state, dispatch_gen, attempts, finished_at)
         SELECT kind, queue, state::rowq.job_state, 1, 1, CASE WHEN state = 'failed' THEN now() END
         FROM (VALUES ('spam', 'default', 'pending'), ('spam', 'default', 'dispatched'),
                      ('spam', 'default', 'running'), ('spam', 'default', 'failed'),
                      ('spam', 'bulk', 'pending'), ('email', 'default', 'pending')) AS v (kind, queue, state)
         RETURNING id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();

    let message = refusal(&pool, &["cancel", "--all"]);
    assert!(message.contains("cancel --all needs --kind or --queue"), "{message}");
    let text = stdout(&rowq(&pool, &["cancel", "--all", "--kind", "spam", "--queue", "default", "--dry-run"]));
    assert_eq!(text.trim(), "dry run, nothing changed: 2 pending or dispatched jobs would be cancelled");
    assert_eq!(common::count_in_state(&pool, rowq::JobState::Cancelled).await, 0, "a dry run cancelled jobs");
    let done = json_of(&pool, &["cancel", "--all", "--kind", "spam", "--queue", "default"]);
    assert_eq!(done["cancelled"], json!(ids[..2]), "{done}");
    let states: Vec<String> =
        sqlx::query_scalar("SELECT state::text FROM rowq.jobs ORDER BY id").fetch_all(&pool).await.unwrap();
    assert_eq!(states, ["cancelled", "cancelled", "running", "failed", "pending", "pending"]);

    let text = stdout(&rowq(&pool, &["cancel", "--all", "--queue", "bulk"]));
    assert_eq!(text.trim(), "1 pending or dispatched jobs cancelled");
    let message = refusal(&pool, &["cancel", &ids[2].to_string()]);
    assert!(message.contains("is running (attempt 1): it cannot be cancelled now"), "{message}");

    // The undo of a cancel by mistake: the cancelled jobs of the kind and queue go back, attempts
    // reset, and nothing else moves.
    let undo = ["retry", "--all-cancelled", "--kind", "spam", "--queue", "default"];
    let text = stdout(&rowq(&pool, &[&undo[..], &["--dry-run"]].concat()));
    assert_eq!(text.trim(), "dry run, nothing changed: 2 cancelled jobs would go back to pending");
    assert_eq!(common::count_in_state(&pool, rowq::JobState::Cancelled).await, 3, "a dry run retried jobs");
    let done = json_of(&pool, &undo);
    assert_eq!(done, json!({"retried": ids[..2], "left_cancelled": []}));
    let rows: Vec<(String, i32)> =
        sqlx::query_as("SELECT state::text, attempts FROM rowq.jobs ORDER BY id").fetch_all(&pool).await.unwrap();
    let states: Vec<&str> = rows.iter().map(|(state, _)| state.as_str()).collect();
    assert_eq!(states, ["pending", "pending", "running", "failed", "cancelled", "pending"]);
    assert_eq!((rows[0].1, rows[1].1), (0, 0), "attempts reset");
    let one = json_of(&pool, &["retry", &ids[4].to_string()]);
    assert_eq!(one["state"], json!("pending"), "{one}");
    let message = refusal(&pool, &["retry", &ids[5].to_string()]);
    assert!(message.contains("is pending: only failed or cancelled jobs can be retried"), "{message}");
    let both = rowq(&pool, &["retry", "--all-failed", "--all-cancelled"]);
    assert_eq!(both.status.code(), Some(2), "a usage error, as clap reports them");
    assert!(stderr(&both).contains("cannot be used with"), "{}", stderr(&both));
}

/// `rowq discard` deletes failed or cancelled jobs: one by its id, or many by `--all-failed` or
/// `--all-cancelled` with a retry's filters and `--before`, a dry run first. It refuses a job
/// that is unfinished or succeeded, saying why, and every row it does not name stays as it was.
#[tokio::test]
async fn a_discard_deletes_the_failed_or_cancelled_jobs_it_names_and_nothing_else() {
    let pool = common::database().await;
    // A job of `kind` in `queue` and `state`, finished `hours_ago` (when finished).
    let insert = |kind: &'static str, queue: &'static str, state: &'static str, hours_ago: Option<i32>| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "INSERT INTO rowq.jobs (kind, queue, state, dispatch_gen, attempts, finished_at)
                 VALUES ($1, $2, $3::rowq.job_state, 1, 1, now() - $4 * interval '1 hour') RETURNING id",
            )
            .bind(kind)
            .bind(queue)
            .bind(state)
            .bind(hours_ago)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let old_failed = insert("resize", "default", "failed", Some(30)).await;
    let recent_failed = insert("resize", "default", "failed", Some(1)).await;
    let other_queue = insert("resize", "bulk", "failed", Some(30)).await;
    let other_kind = insert("email", "default", "failed", Some(30)).await;
    let cancelled = insert("resize", "default", "cancelled", Some(30)).await;
    let succeeded = insert("resize", "default", "succeeded", Some(30)).await;
    let pending = insert("resize", "default", "pending", None).await;
    let running = insert("resize", "default", "running", None).await;
    let ids = || sqlx::query_scalar::<_, i64>("SELECT id FROM rowq.jobs ORDER BY id").fetch_all(&pool);
    let all = ids().await.unwrap();

    // The failed jobs of a kind and queue that failed over a day ago: a dry run counts them and
    // deletes nothing, then the discard deletes exactly those.
    let day_ago = (chrono::Utc::now() - chrono::Duration::days(1)).to_rfc3339();
    let filters = ["discard", "--all-failed", "--kind", "resize", "--queue", "default", "--before", &day_ago];
    let text = stdout(&rowq(&pool, &[&filters[..], &["--dry-run"]].concat()));
    assert_eq!(text.trim(), "dry run, nothing changed: 1 failed jobs would be deleted");
    assert_eq!(ids().await.unwrap(), all, "a dry run deleted rows");
    let done = json_of(&pool, &filters);
    assert_eq!(done, json!({"discarded": [old_failed]}));

    // Cancelled jobs, by --since: the failed ones of the same time stay.
    let two_days_ago = (chrono::Utc::now() - chrono::Duration::days(2)).to_rfc3339();
    let done = json_of(&pool, &["discard", "--all-cancelled", "--since", &two_days_ago]);
    assert_eq!(done, json!({"discarded": [cancelled]}));

    // One by its id; the unfinished and the succeeded are refused, each saying why.
    let text = stdout(&rowq(&pool, &["discard", &other_kind.to_string()]));
    assert_eq!(text.trim(), format!("job {other_kind} (email, failed) deleted"));
    let message = refusal(&pool, &["discard", &succeeded.to_string()]);
    assert!(message.contains("is succeeded: only failed or cancelled jobs can be discarded (a succeeded"), "{message}");
    let message = refusal(&pool, &["discard", &pending.to_string()]);
    assert!(
        message.contains("is pending: only failed or cancelled jobs can be discarded (cancel it first"),
        "{message}"
    );
    let message = refusal(&pool, &["discard", &running.to_string()]);
    assert!(message.contains(&format!("job {running} is running: only failed or cancelled")), "{message}");
    let message = refusal(&pool, &["discard", "999999"]);
    assert!(message.contains("job 999999 does not exist"), "{message}");
    assert_eq!(ids().await.unwrap(), [recent_failed, other_queue, succeeded, pending, running]);

    for usage in [&["discard"][..], &["discard", "1", "--all-failed"], &["discard", "--kind", "resize"]] {
        let output = rowq(&pool, usage);
        assert_eq!(output.status.code(), Some(2), "{usage:?}: a usage error, as clap reports them");
    }
}

/// With no URL given, an operator's `rowq` and the scheduler read the database URL from the
/// secret `ROWQ_DATABASE_SECRET_ARN` names (here the JSON RDS writes for a managed secret, in
/// LocalStack's Secrets Manager), so that no password is copied into a shell; a secret that
/// cannot be read, or a value that is no ARN, is one clear line naming it.
#[tokio::test]
async fn the_cli_and_the_scheduler_read_the_database_url_from_a_secret() {
    let pool = common::database().await;
    let sqs = common::sqs().await;
    let queues = common::queues(&sqs, 3, Duration::from_secs(30)).await;
    let secrets = aws_sdk_secretsmanager::Client::new(&common::aws_at(&common::endpoint()).await);
    let options = pool.connect_options();
    let database = options.get_database().expect("a test pool names its database");
    let rds_secret = json!({
        "engine": "postgres", "username": options.get_username(), "password": "trust auth takes any",
        "host": options.get_host(), "port": options.get_port(), "dbname": database,
    });
    let arn = secrets
        .create_secret()
        .name(format!("rowq-test/{database}"))
        .secret_string(rds_secret.to_string())
        .send()
        .await
        .expect("create the secret")
        .arn
        .expect("a created secret has an ARN");
    let by_secret = |binary: &str, arn: &str| {
        let mut command = command(binary, &pool);
        command.env_remove("DATABASE_URL").env("ROWQ_DATABASE_SECRET_ARN", arn);
        command
    };

    let output = by_secret(env!("CARGO_BIN_EXE_rowq"), &arn)
        .args(["enqueue", "echo", r#"{"via":"secret"}"#, "--json"])
        .output()
        .unwrap();
    let id = parsed(&["enqueue"], &output)["id"].as_i64().expect("the enqueued job's id");
    let job = common::job(&pool, rowq::JobId(id)).await;
    assert_eq!((job.kind.as_str(), &job.payload), ("echo", &json!({"via": "secret"})));

    let output = by_secret(env!("CARGO_BIN_EXE_scheduler"), &arn)
        .arg("--once")
        .env("ROWQ_QUEUE_URL", &queues.queue_url)
        .output()
        .unwrap();
    assert!(output.status.success(), "scheduler --once by the secret failed: {}", stderr(&output));
    assert_eq!(common::job(&pool, rowq::JobId(id)).await.state, rowq::JobState::Dispatched);

    let missing = arn.replace("rowq-test/", "rowq-test/missing-");
    for (arn, said) in
        [(missing.as_str(), "cannot read the database secret arn:"), ("rowq-db", "ROWQ_DATABASE_SECRET_ARN")]
    {
        let output = by_secret(env!("CARGO_BIN_EXE_rowq"), arn).arg("stats").output().unwrap();
        assert_eq!(output.status.code(), Some(1), "rowq stats by the secret {arn} should fail");
        let message = stderr(&output);
        assert_eq!(message.trim().lines().count(), 1, "not one line: {message}");
        assert!(message.contains(said), "{message}");
    }
    secrets
        .delete_secret()
        .secret_id(&arn)
        .force_delete_without_recovery(true)
        .send()
        .await
        .expect("delete the secret");
}

/// `rowq list --group-key` and `--dedup-key` find the jobs of a group, or of a key, finished
/// ones too, newest first, and nothing else.
#[tokio::test]
async fn list_finds_the_jobs_of_a_group_or_of_a_dedup_key_finished_ones_too() {
    let pool = common::database().await;
    let enqueue = |args: &[&str]| json_of(&pool, &[&["enqueue", "report"][..], args].concat())["id"].as_i64().unwrap();
    let first = enqueue(&["--dedup-key", "nightly", "--group-key", "g"]);
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(first)
        .execute(&pool)
        .await
        .unwrap();
    let second = enqueue(&["--dedup-key", "nightly"]);
    let grouped = enqueue(&["--group-key", "g"]);
    enqueue(&[]);
    let ids = |args: &[&str]| -> Vec<i64> {
        let listed = json_of(&pool, &[&["list"][..], args].concat());
        listed.as_array().unwrap().iter().map(|row| row["id"].as_i64().unwrap()).collect()
    };
    assert_eq!(ids(&["--dedup-key", "nightly"]), [second, first]);
    assert_eq!(ids(&["--group-key", "g"]), [grouped, first]);
    assert_eq!(ids(&["--group-key", "g", "--state", "pending"]), [grouped]);
    assert_eq!(ids(&["--dedup-key", "weekly"]), Vec::<i64>::new());
}

/// Runs `rowq ARGS` with `input` on its standard input.
fn rowq_reading(pool: &PgPool, args: &[&str], input: &str) -> Output {
    reading(rowq_command(pool, args), input)
}

/// Runs `command` with `input` on its standard input.
fn reading(mut command: Command, input: &str) -> Output {
    use std::io::Write;
    let mut child = command
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start rowq");
    child.stdin.take().expect("piped stdin").write_all(input.as_bytes()).expect("write rowq's input");
    child.wait_with_output().expect("run rowq")
}

/// `rowq enqueue KIND --lines FILE` enqueues a job per line (`-`: standard input), in the
/// lines' order, all in one transaction: a line that is not a JSON object enqueues none and is
/// named, and so does a row the database refuses, in whichever statement. A PAYLOAD
/// of `@FILE` or `-` is read from the file or from standard input.
#[tokio::test]
async fn enqueue_lines_enqueues_a_job_per_line_in_order_or_none_naming_the_bad_line() {
    let pool = common::database().await;
    let count = || sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rowq.jobs").fetch_one(&pool);

    let lines = "{\"n\":1}\n\n{\"n\":2}\n{\"n\":3}\n";
    let output = rowq_reading(
        &pool,
        &["enqueue", "resize", "--lines", "-", "--queue", "bulk", "--group-key", "g", "--json"],
        lines,
    );
    let done = parsed(&["enqueue", "--lines"], &output);
    assert_eq!(done["enqueued"], json!(3), "{done}");
    let rows: Vec<(i64, Value, String, Option<String>)> =
        sqlx::query_as("SELECT id, payload, queue, group_key FROM rowq.jobs ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let ids: Vec<i64> = rows.iter().map(|row| row.0).collect();
    assert_eq!(done["ids"], json!(ids));
    for (row, n) in rows.iter().zip(1..) {
        assert_eq!(
            (&row.1, row.2.as_str(), row.3.as_deref()),
            (&json!({"n": n}), "bulk", Some("g")),
            "in the lines' order"
        );
    }

    let file = std::env::temp_dir().join(format!("rowq-lines-{}.jsonl", std::process::id()));
    std::fs::write(&file, "{\"n\":4}\n{\"n\":5}\n{oops\n").unwrap();
    let path = file.to_string_lossy().into_owned();
    let message = refusal(&pool, &["enqueue", "resize", "--lines", &path]);
    assert!(message.contains(&format!("line 3 of {path} is not valid JSON")), "{message}");
    let output = rowq_reading(&pool, &["enqueue", "resize", "--lines", "-"], "{\"n\":4}\n[5]\n");
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("line 2 of standard input is not a JSON object"), "{}", stderr(&output));
    // 1,002 lines go in two statements; the second's second row is refused, and the first's go
    // with it. Postgres names the rule, not the row: the line is found, and named, all the same.
    let too_big = format!("{{\"pad\":\"{}\"}}", "x".repeat(1 << 20));
    let many = format!("{}{too_big}\n{{}}\n", "{}\n".repeat(1001));
    let output = rowq_reading(&pool, &["enqueue", "resize", "--lines", "-"], &many);
    assert_eq!(output.status.code(), Some(1));
    let message = stderr(&output);
    assert!(message.contains("cannot enqueue, so none was: line 1002 of standard input: "), "{message}");
    assert!(message.contains("jobs_payload_is_at_most_1_mib"), "{message}");
    // JSON may hold `\u0000`, which jsonb cannot: refused, with Postgres's detail, at its line.
    let output = rowq_reading(&pool, &["enqueue", "resize", "--lines", "-"], "{}\n{\"a\":\"x\\u0000\"}\n{}\n");
    let message = stderr(&output);
    assert!(message.contains("line 2 of standard input: the database refused it: unsupported Unicode escape sequence (\\u0000 cannot be converted to text)"), "{message}");
    // An option every line shares is refused at the first: it is not any line's fault.
    let output = rowq_reading(&pool, &["enqueue", "resize", "--lines", "-", "--group-key", "a b"], "{}\n{}\n");
    let message = stderr(&output);
    assert!(message.contains("cannot enqueue, so none was: the database refused it: "), "{message}");
    assert!(message.contains("jobs_group_key_is_1_to_128_printable_ascii") && !message.contains("line"), "{message}");
    assert_eq!(count().await.unwrap(), 3, "a refused line enqueued some of the others");
    // A regular file is read twice (checked, then enqueued); a pipe, once.
    std::fs::write(&file, "{\"n\":4}\n\n{\"n\":5}\n").unwrap();
    assert_eq!(json_of(&pool, &["enqueue", "resize", "--lines", &path])["enqueued"], json!(2));
    let output = rowq_reading(&pool, &["enqueue", "resize", "--lines", "/dev/stdin"], "{\"n\":6}\n");
    assert!(stdout(&output).starts_with("enqueued 1 job (id "), "{}{}", stdout(&output), stderr(&output));
    let payloads: Vec<Value> = sqlx::query_scalar("SELECT payload FROM rowq.jobs WHERE id > $1 ORDER BY id")
        .bind(ids[2])
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(payloads, [json!({"n": 4}), json!({"n": 5}), json!({"n": 6})]);

    std::fs::write(&file, "{\"from\":\"a file\"}").unwrap();
    let one = json_of(&pool, &["enqueue", "resize", &format!("@{path}")]);
    let job = common::job(&pool, rowq::JobId(one["id"].as_i64().unwrap())).await;
    assert_eq!(job.payload, json!({"from": "a file"}));
    let output = rowq_reading(&pool, &["enqueue", "resize", "-", "--json"], "{\"from\":\"stdin\"}");
    let one = parsed(&["enqueue", "-"], &output);
    let job = common::job(&pool, rowq::JobId(one["id"].as_i64().unwrap())).await;
    assert_eq!(job.payload, json!({"from": "stdin"}));
    std::fs::remove_file(&file).unwrap();

    for usage in [["--lines", "-", "--wait"], ["--lines", "-", "--dedup-key=k"]] {
        let output = rowq(&pool, &[&["enqueue", "resize"][..], &usage[..]].concat());
        assert_eq!(output.status.code(), Some(2), "{usage:?}: a usage error, as clap reports them");
    }
}

/// A TCP proxy to the test database's server that relays both ways until a client sends its
/// first `COMMIT`: it passes that on and cuts the client off at once, then closes the server's
/// side when the server answers. The commit goes through; its answer is lost. Returns the URL
/// of the database through it (without TLS, so that the proxy can read the `COMMIT`).
async fn proxy_losing_the_first_commits_answer(pool: &PgPool) -> String {
    use sqlx::ConnectOptions;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let options = pool.connect_options();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let armed = Arc::new(AtomicBool::new(true));
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let mut server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let armed = armed.clone();
            tokio::spawn(async move {
                let (mut asked, mut answered) = (vec![0; 1 << 16], vec![0; 1 << 16]);
                loop {
                    tokio::select! {
                        read = client.read(&mut asked) => {
                            let Ok(n @ 1..) = read else { return };
                            let commit = asked[..n].windows(6).any(|bytes| bytes == b"COMMIT");
                            if server.write_all(&asked[..n]).await.is_err() {
                                return;
                            }
                            if commit && armed.swap(false, Ordering::SeqCst) {
                                drop(client);
                                let _ = server.read(&mut answered).await; // the commit's answer, to no one
                                return;
                            }
                        }
                        read = server.read(&mut answered) => {
                            let Ok(n @ 1..) = read else { return };
                            if client.write_all(&answered[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    let through = (*options).clone().port(port).ssl_mode(sqlx::postgres::PgSslMode::Disable);
    through.to_url_lossy().to_string()
}

/// `rowq enqueue` whose commit's answer is lost does not send its user to enqueue every job
/// again: it asks what became of its transaction, waiting while the commit is in progress. A
/// commit that went through, slowly (a deferred trigger sleeps in it), is reported as enqueued,
/// once; one whose session was ended in it, as not enqueued; one refused, as refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_whose_commit_answer_is_lost_asks_what_became_of_its_transaction() {
    let pool = common::database().await;
    let of_kind = |kind: &'static str| {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rowq.jobs WHERE kind = $1").bind(kind).fetch_one(&pool)
    };
    let at_commit = |body: &str| {
        sqlx::AssertSqlSafe(format!(
            "CREATE OR REPLACE FUNCTION at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN {body}; RETURN NULL; END $$"
        ))
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{}; CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON rowq.jobs DEFERRABLE INITIALLY DEFERRED
        FOR EACH ROW EXECUTE FUNCTION at_commit()",
        at_commit("PERFORM pg_sleep(0.3)").0
    )))
    .execute(&pool)
    .await
    .unwrap();
    let through_proxy = |args: &'static [&'static str], input: &'static str| {
        let pool = pool.clone();
        async move {
            let url = proxy_losing_the_first_commits_answer(&pool).await;
            tokio::task::spawn_blocking(move || {
                let mut rowq = command(env!("CARGO_BIN_EXE_rowq"), &pool);
                rowq.args(["--database-url", &url]).args(args);
                reading(rowq, input)
            })
            .await
            .unwrap()
        }
    };

    let output = through_proxy(&["enqueue", "slow", "--lines", "-"], "{}\n{}\n{}\n").await;
    let message = stderr(&output);
    assert!(output.status.success(), "{message}");
    assert!(message.contains("the answer to the commit was lost"), "{message}");
    assert!(message.contains("committed all the same: enqueued"), "{message}");
    assert!(stdout(&output).contains("enqueued 3 jobs"), "{}", stdout(&output));
    assert_eq!(of_kind("slow").await.unwrap(), 3);
    let output = through_proxy(&["enqueue", "slow", "{}"], "").await;
    assert!(output.status.success() && stderr(&output).contains("committed all the same"), "{}", stderr(&output));
    assert_eq!(of_kind("slow").await.unwrap(), 4);

    sqlx::query(at_commit("PERFORM pg_terminate_backend(pg_backend_pid())")).execute(&pool).await.unwrap();
    let message = refusal(&pool, &["enqueue", "ended", "{}"]);
    assert!(message.contains("cannot enqueue: the answer to the commit was lost"), "{message}");
    assert!(message.contains("was rolled back"), "{message}");
    let output = rowq_reading(&pool, &["enqueue", "ended", "--lines", "-"], "{}\n{}\n");
    assert!(stderr(&output).contains("cannot enqueue, so none was: the answer to the commit"), "{}", stderr(&output));
    assert_eq!(of_kind("ended").await.unwrap(), 0);

    // Both ways of asking, PostgreSQL 12's included, on this server (which has both).
    for xid8 in [true, false] {
        let (give_id, ask) = rowq::store::admin::transaction_statements(xid8);
        for commit in [true, false] {
            let mut transaction = pool.begin().await.unwrap();
            let xid: i64 = sqlx::query_scalar(give_id).fetch_one(&mut *transaction).await.unwrap();
            let ongoing: Option<String> = sqlx::query_scalar(ask).bind(xid).fetch_one(&pool).await.unwrap();
            let (ended, expected) = match commit {
                true => (transaction.commit().await, "committed"),
                false => (transaction.rollback().await, "aborted"),
            };
            ended.unwrap();
            let status: Option<String> = sqlx::query_scalar(ask).bind(xid).fetch_one(&pool).await.unwrap();
            assert_eq!((ongoing.as_deref(), status.as_deref()), (Some("in progress"), Some(expected)), "{give_id}");
        }
    }

    sqlx::query(at_commit("RAISE check_violation USING MESSAGE = 'refused at commit'")).execute(&pool).await.unwrap();
    let message = refusal(&pool, &["enqueue", "refused", "{}"]);
    assert!(message.contains("cannot enqueue: the database refused it: refused at commit"), "{message}");
    assert_eq!(of_kind("refused").await.unwrap(), 0);
}

/// A CLI newer than the database's schema (upgraded before the scheduler, which migrates at
/// start) says to migrate when a command needs what the schema lacks; what it does not need
/// still works, and after `rowq migrate` so does the rest.
#[tokio::test]
async fn a_command_that_needs_a_newer_schema_says_to_run_migrate() {
    let pool = common::database_migrated_to(20261204000003).await;
    for args in [&["pause", "emails"][..], &["stats"], &["resume", "emails"]] {
        let message = refusal(&pool, args);
        assert!(message.contains("schema is older than this rowq: run `rowq migrate`"), "{args:?}: {message}");
        assert_eq!(message.matches("does not exist").count(), 1, "the cause said once: {message}");
        assert!(!message.contains(" at line "), "Postgres's own source line is no help: {message}");
    }
    assert!(json_of(&pool, &["enqueue", "noop"])["enqueued"].as_bool().unwrap_or_default());
    json_of(&pool, &["migrate"]);
    assert_eq!(json_of(&pool, &["pause", "emails"])["already"], json!(false));
    let message = refusal(&pool, &["status", "12345"]);
    assert!(!message.contains("rowq migrate"), "not a schema's error: {message}");
}

/// `rowq pause` and `rowq resume`: the pause is in `stats` with its reason, a second pause says
/// it was already paused, a resume of a queue that is not paused names those that are (a typo
/// resumes nothing), and a name the database refuses is one clear line.
#[tokio::test]
async fn pause_and_resume_a_queue_from_the_command_line_and_find_it_in_stats() {
    let pool = common::database().await;
    assert_eq!(stdout(&rowq(&pool, &["pause"])).trim(), "no queue is paused");
    let text = stdout(&rowq(&pool, &["pause", "emails", "--reason", "SMTP provider down"]));
    assert!(text.starts_with("queue emails paused since "), "{text}");
    assert!(text.contains(" s ago): SMTP provider down: no job of it is claimed until `rowq resume emails`"), "{text}");
    let again = json_of(&pool, &["pause", "emails"]);
    assert_eq!(
        (&again["queue"], &again["reason"], &again["already"]),
        (&json!("emails"), &json!("SMTP provider down"), &json!(true))
    );
    let listed = json_of(&pool, &["pause"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["paused_at"], again["paused_at"], "{listed}");

    let stats = json_of(&pool, &["stats"]);
    assert_eq!(stats["paused"][0]["queue"], "emails", "{stats}");
    let text = stdout(&rowq(&pool, &["stats"]));
    assert!(text.contains("queue emails paused since ") && text.contains("SMTP provider down"), "{text}");

    let typo = stdout(&rowq(&pool, &["resume", "emials"]));
    assert_eq!(typo.trim(), "queue emials was not paused; paused: emails");
    let resumed = json_of(&pool, &["resume", "emails"]);
    assert_eq!(resumed, json!({ "queue": "emails", "resumed": true }));
    assert_eq!(stdout(&rowq(&pool, &["resume", "emails"])).trim(), "queue emails was not paused; no queue is");
    assert_eq!(json_of(&pool, &["stats"])["paused"], json!([]));

    let message = refusal(&pool, &["pause", "two words"]);
    assert!(message.contains("cannot pause queue \"two words\": the database refused it"), "{message}");
    let message = refusal(&pool, &["pause", "emails", "--reason", ""]);
    assert!(message.contains("paused_queues_reason_is_1_to_1000_characters"), "{message}");
    assert_eq!(json_of(&pool, &["pause"]), json!([]), "a refused pause pauses nothing");
}

/// `rowq ARGS` run without blocking the test's runtime, which drives the pipeline the command
/// waits for.
async fn rowq_beside(pool: &PgPool, args: &[&str]) -> Output {
    tokio::process::Command::from(rowq_command(pool, args)).output().await.expect("run rowq")
}

/// [`json_of`] without blocking the test's runtime: while the pipeline runs in it, a blocked
/// runtime can hold a job's row locked, and an enqueue of the same dedup_key waits for it.
async fn json_beside(pool: &PgPool, args: &[&str]) -> Value {
    parsed(args, &rowq_beside(pool, &[args, &["--json"]].concat()).await)
}

/// A job deleted while `rowq wait` waits on it (a discard, retention, a `DELETE` by hand) is
/// said to be deleted, not never to have existed.
#[tokio::test]
async fn a_wait_on_a_job_deleted_meanwhile_says_it_was_deleted() {
    let pool = common::database().await;
    let id = common::enqueue(&pool, "noop", json!({})).await; // no scheduler runs here
    let wait = Said::first_line_of(rowq_command(&pool, &["wait", &id.to_string()])).await;
    assert!(wait.stderr.starts_with(&format!("job {id} pending")), "{}", wait.stderr);
    sqlx::query("DELETE FROM rowq.jobs WHERE id = $1").bind(id).execute(&pool).await.unwrap();
    let (output, progress) = wait.until_it_ends().await;
    assert_eq!(output.status.code(), Some(1), "{progress}");
    let said = progress.trim().lines().last().unwrap_or_default();
    assert!(said.contains(&format!("job {id} was deleted while it was waited on")), "{said}");
}

/// The last line of stderr: the error `rowq` exits with, after the progress of a wait.
fn last_line(output: &Output) -> String {
    stderr(output).trim().lines().last().unwrap_or_default().to_string()
}

#[tokio::test]
async fn a_wait_ends_with_the_job_and_its_exit_code_says_how_it_ended() {
    let pool = common::database().await;
    // No scheduler serves `nobody`: the wait runs out, and says so with its own exit code.
    let output = rowq_beside(&pool, &["enqueue", "echo", "--queue", "nobody", "--wait", "--timeout", "1"]).await;
    assert_eq!(output.status.code(), Some(124), "{}", stderr(&output));
    let id = stderr(&output).lines().next().and_then(|line| line.strip_prefix("enqueued job ")).unwrap().to_string();
    assert!(stderr(&output).contains(&format!("job {id} pending\n")), "{}", stderr(&output));
    assert_eq!(
        last_line(&output),
        format!("rowq: job {id} is still pending after 1 s: it goes on; `rowq wait` again or `rowq status`")
    );
    assert!(stdout(&output).starts_with(&format!("job {id}  pending  (echo in queue nobody)")), "{}", stdout(&output));
    let cancelled = rowq_beside(&pool, &["cancel", &id]).await;
    assert!(cancelled.status.success(), "{}", stderr(&cancelled));
    let output = rowq_beside(&pool, &["wait", &id]).await;
    assert_eq!((output.status.code(), last_line(&output)), (Some(1), format!("rowq: job {id} was cancelled")));
    let output = rowq_beside(&pool, &["wait", "999999"]).await;
    assert_eq!((output.status.code(), last_line(&output)), (Some(1), "rowq: job 999999 does not exist".into()));

    // A paused queue: the wait says why nothing happens.
    assert!(rowq_beside(&pool, &["pause", "default", "--reason", "deploy"]).await.status.success());
    let output = rowq_beside(&pool, &["enqueue", "noop", "--wait", "--timeout", "1"]).await;
    assert_eq!(output.status.code(), Some(124), "{}", stderr(&output));
    assert!(
        stderr(&output).contains(" (deploy): job ") && stderr(&output).contains(" waits until `rowq resume default`"),
        "{}",
        stderr(&output)
    );

    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let worker = Worker::new(pool.clone(), Registry::builtin(), common::worker_config());
    let pipeline =
        Pipeline::start(pool.clone(), client, worker, common::pipeline_config(&queues, 2, false)).await.unwrap();
    assert!(rowq_beside(&pool, &["resume", "default"]).await.status.success());

    let output = rowq_beside(&pool, &["enqueue", "echo", r#"{"n":1}"#, "--wait", "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let row: Value = serde_json::from_str(&stdout(&output)).expect("--json prints the finished job, alone");
    assert_eq!((&row["state"], &row["result"]), (&json!("succeeded"), &json!({"n": 1})), "{row}");

    let output = rowq_beside(&pool, &["enqueue", "fail", r#"{"times":5}"#, "--max-attempts", "2", "--wait"]).await;
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let line = last_line(&output);
    assert!(line.starts_with("rowq: job ") && line.contains(" failed after 2 of 2 attempts: "), "{line}");
    assert!(stdout(&output).contains("  failed  (fail in queue default)"), "{}", stdout(&output));

    // An enqueue that its dedup_key made a no-op waits for the job that holds the key.
    let holder = json_beside(&pool, &["enqueue", "sleep", r#"{"ms":3000}"#, "--dedup-key", "nightly"]).await;
    let holder = holder["id"].as_i64().unwrap();
    let output = rowq_beside(&pool, &["enqueue", "sleep", "--dedup-key", "nightly", "--wait"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let progress = stderr(&output);
    assert!(
        progress.starts_with(&format!(
            "not enqueued: job {holder}, unfinished, has dedup_key \"nightly\": waiting for it\n"
        )),
        "{progress}"
    );
    assert!(progress.contains(&format!("job {holder} running (attempt 1 of 5)\n")), "{progress}");
    assert!(progress.ends_with(&format!("job {holder} succeeded\n")), "{progress}");
    let without_wait = json_beside(&pool, &["enqueue", "sleep", r#"{"ms":3000}"#, "--dedup-key", "nightly"]).await;
    let again = json_beside(&pool, &["enqueue", "sleep", "--dedup-key", "nightly"]).await;
    assert_eq!(again, json!({"id": null, "enqueued": false, "held_by": without_wait["id"]}));
    pipeline.stop().await;
}

/// A wait outlasts an outage of the database (a failover, a restart): it says the database
/// cannot be reached, reads again, and ends with the job's outcome. An outage that outlasts
/// `--timeout` ends it as a timeout (124) with the job as last read, not as a failed job (1).
/// One before the job was first read ends it at once.
#[tokio::test]
async fn a_wait_outlasts_an_outage_of_the_database_and_ends_with_the_jobs_outcome() {
    let pool = common::database().await;
    let (url, outage) = common::database_behind_a_proxy(&pool).await;
    let wait = |id: rowq::JobId, timeout: &str| {
        let mut rowq = command(env!("CARGO_BIN_EXE_rowq"), &pool);
        rowq.args(["--database-url", &url, "wait", &id.to_string(), "--timeout", timeout]);
        Said::first_line_of(rowq)
    };
    let pending = || common::enqueue(&pool, "noop", json!({})); // no scheduler runs: it waits

    let id = pending().await;
    let waiting = wait(id, "60").await; // it has read the job, pending
    assert_eq!(waiting.stderr, format!("job {id} pending\n"));
    outage.send_replace(true);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now(), result = '{\"n\": 1}' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    outage.send_replace(false);
    let (output, progress) = waiting.until_it_ends().await;
    assert_eq!(output.status.code(), Some(0), "{progress}");
    assert!(progress.contains(&format!("job {id}: the database cannot be reached (")), "{progress}");
    assert!(progress.contains(&format!("job {id}: the database answers again\njob {id} succeeded\n")), "{progress}");
    assert!(stdout(&output).starts_with(&format!("job {id}  succeeded")), "{}", stdout(&output));

    let id = pending().await;
    let waiting = wait(id, "2").await;
    outage.send_replace(true);
    let (output, progress) = waiting.until_it_ends().await;
    outage.send_replace(false);
    assert_eq!(output.status.code(), Some(124), "{progress}");
    assert!(progress.contains("the database cannot be reached"), "{progress}");
    assert!(
        progress.ends_with(&format!(
            "rowq: job {id} is still pending after 2 s: it goes on; `rowq wait` again or `rowq status`\n"
        )),
        "{progress}"
    );

    // Before the job is first read, nothing says it is there to wait for: a database that
    // cannot be reached ends the wait at once, even one without a timeout.
    outage.send_replace(true);
    let nowhere =
        sqlx::postgres::PgPoolOptions::new().acquire_timeout(Duration::from_secs(3)).connect_lazy(&url).unwrap();
    let waited =
        tokio::time::timeout(Duration::from_secs(20), rowq::store::admin::wait_finished(&nowhere, id, None, |_| {}))
            .await;
    assert!(matches!(waited, Ok(Err(ref error)) if rowq::store::unreachable(error)), "{waited:?}");
    outage.send_replace(false);
}

/// A command under way that has printed its first line on stderr: a `rowq wait` that has read
/// its job. Its stdout stays piped; its stderr is read here.
struct Said {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>,
    stderr: String,
}

impl Said {
    /// Starts `command` and returns once it has printed a line on stderr (30 s at most).
    async fn first_line_of(command: Command) -> Self {
        use tokio::io::AsyncBufReadExt;
        let mut command = tokio::process::Command::from(command);
        command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let mut child = command.spawn().expect("start the command");
        let stderr = child.stderr.take().expect("piped stderr");
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
        let first = first.expect("a first line within 30 s").unwrap().expect("a first line, not the end");
        Said { child, lines, stderr: format!("{first}\n") }
    }

    /// Its output once it has ended, and all it printed on stderr.
    async fn until_it_ends(mut self) -> (Output, String) {
        while let Some(line) = self.lines.next_line().await.unwrap() {
            self.stderr += &format!("{line}\n");
        }
        (self.child.wait_with_output().await.unwrap(), self.stderr)
    }
}

/// A service, `scheduler` or `rowq work`, running until killed (also when the test fails)
/// with its health endpoint on a free port of 127.0.0.1.
struct Service {
    child: Child,
    address: std::net::SocketAddr,
}

/// A port of 127.0.0.1 on which nothing listens, for as long as this lives: bound, never
/// listened on, so a connection to it is refused. A port found free and let go could be found
/// free again by another test running beside this one and served (a health endpoint answering
/// 200 where none was to be): this one is held.
struct ClosedPort(socket2::Socket);

impl ClosedPort {
    fn new() -> Self {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
        let any_port: std::net::SocketAddr = "127.0.0.1:0".parse().expect("an address");
        socket.bind(&any_port.into()).expect("a port of 127.0.0.1");
        ClosedPort(socket)
    }

    fn address(&self) -> std::net::SocketAddr {
        self.0.local_addr().ok().and_then(|address| address.as_socket()).expect("a bound address")
    }
}

impl Service {
    /// `scheduler` on `queue_url`, with `env` added.
    fn scheduler(pool: &PgPool, queue_url: &str, env: &[(&str, &str)]) -> Self {
        let mut scheduler = command(env!("CARGO_BIN_EXE_scheduler"), pool);
        scheduler.env("ROWQ_QUEUE_URL", queue_url).env("ROWQ_POLL_INTERVAL_MS", "100").envs(env.iter().copied());
        Service::start(scheduler)
    }

    /// Starts `service` with its health endpoint on a port the system picks when it binds, and
    /// learns the port from the line the service logs then. (A port found free beforehand could
    /// be taken, between the finding and the binding, by another test running beside this one.)
    fn start(mut service: Command) -> Self {
        let mut child = service
            .env("ROWQ_HEALTH_LISTEN", "127.0.0.1:0")
            .env("ROWQ_LOG_FORMAT", "text") // the line read below, whatever the environment says
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start the service");
        let stderr = child.stderr.take().expect("piped stderr");
        let (told, address) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            // Reads to the end, so that the service never blocks on a full pipe.
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("health endpoint listening")
                    && let Some(address) = line.split("address=").nth(1).and_then(|rest| rest.split_whitespace().next())
                {
                    let _ = told.send(address.parse::<std::net::SocketAddr>().expect("the address it listens on"));
                }
            }
        });
        let address = address.recv_timeout(Duration::from_secs(30)).expect("the service says where it listens");
        Service { child, address }
    }

    /// `GET path`: the status code and the JSON body; `None` while nothing answers.
    async fn get(&self, path: &str) -> Option<(u16, Value)> {
        let address = self.address;
        let path = path.to_string();
        let answer = tokio::task::spawn_blocking(move || rowq::health::ask(address, &path)).await.ok()?.ok()?;
        assert!(answer.head.contains("Content-Type: application/json"), "{}", answer.head);
        let body = &answer.body;
        Some((answer.code, serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))))
    }

    /// Polls `path` until `until` holds of its answer (30 s at most); returns the last answer.
    async fn wait_for(&self, path: &str, until: impl Fn(u16, &Value) -> bool) -> (u16, Value) {
        let started = std::time::Instant::now();
        loop {
            let answer = self.get(path).await;
            match answer {
                Some((code, body)) if until(code, &body) || started.elapsed() > Duration::from_secs(30) => {
                    return (code, body);
                }
                None if started.elapsed() > Duration::from_secs(30) => panic!("nothing answers on {}", self.address),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `BINARY --health-check` with `ROWQ_HEALTH_LISTEN=listen` and no other setting, as a
/// container's health check runs it.
fn health_check(binary: &[&str], listen: &str) -> Output {
    Command::new(binary[0])
        .args(&binary[1..])
        .arg("--health-check")
        .env_clear()
        .env("ROWQ_HEALTH_LISTEN", listen)
        .output()
        .expect("run --health-check")
}

const SCHEDULER: &[&str] = &[env!("CARGO_BIN_EXE_scheduler")];

/// `ROWQ_HEALTH_LISTEN`: a scheduler run as a service says on `/readyz` that it dispatches,
/// on `/livez` that its loop turns, and answers anything else 404.
#[tokio::test]
async fn the_scheduler_service_answers_ready_once_it_has_dispatched() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let id = common::enqueue(&pool, "noop", json!({})).await;

    let service = Service::scheduler(&pool, &queues.queue_url, &[]);
    let (code, body) = service.wait_for("/readyz", |code, _| code == 200).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!((&body["live"], &body["ready"], &body["error"]), (&json!(true), &json!(true), &Value::Null), "{body}");
    assert!(body["last_beat_ms_ago"].as_u64().is_some_and(|ms| ms < 30_000), "{body}");
    assert_eq!(common::job(&pool, id).await.state, rowq::JobState::Dispatched, "ready, so the job went out");
    assert_eq!(service.get("/livez").await.map(|(code, _)| code), Some(200));
    assert_eq!(service.get("/metrics").await.map(|(code, _)| code), Some(404));
    // The container's check, given the address the scheduler listens on for every interface.
    let check = health_check(SCHEDULER, &format!("0.0.0.0:{}", service.address.port()));
    assert!(check.status.success(), "{}", stderr(&check));
    assert_eq!(parsed(&["scheduler", "--health-check"], &check)["live"], json!(true));
}

/// While its migrations wait (here on a lock the test holds; in production, an index built
/// concurrently behind long transactions), the scheduler already answers: live, so that no
/// orchestrator restarts it into the same wait, and not ready, naming the step. Then it runs.
#[tokio::test]
async fn the_scheduler_service_is_live_and_not_ready_while_its_migrations_wait() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE").execute(&mut *blocker).await.unwrap();

    let service = Service::scheduler(&pool, &queues.queue_url, &[]);
    let migrating = |body: &Value| body["error"] == json!("dispatch: applying migrations");
    let (code, body) = service.wait_for("/readyz", |_, body| migrating(body)).await;
    assert_eq!(code, 503, "{body}");
    assert!(migrating(&body), "{body}");
    assert_eq!((&body["live"], &body["ready"]), (&json!(true), &json!(false)), "{body}");
    assert_eq!(service.get("/livez").await.map(|(code, _)| code), Some(200));
    assert!(health_check(SCHEDULER, &service.address.to_string()).status.success());
    assert_eq!(common::job(&pool, id).await.state, rowq::JobState::Pending, "nothing dispatched while migrating");

    blocker.commit().await.unwrap();
    let (code, body) = service.wait_for("/readyz", |code, _| code == 200).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(common::job(&pool, id).await.state, rowq::JobState::Dispatched);
}

/// With SQS unreachable the scheduler is not ready, naming why, and still live: its loop turns
/// (a restart would not bring SQS back). The job it could not publish waits, attempts unspent.
#[tokio::test]
async fn the_scheduler_service_is_live_and_not_ready_while_sqs_is_unreachable() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let id = common::enqueue(&pool, "noop", json!({})).await;
    // A port nothing listens on: every SQS call is refused.
    let closed_port = ClosedPort::new();
    let closed = closed_port.address();
    let unreachable = format!("http://{closed}");

    let service = Service::scheduler(&pool, &queues.queue_url, &[("AWS_ENDPOINT_URL", &unreachable)]);
    let passed = |body: &Value| body["error"].as_str().is_some_and(|e| !e.contains("nothing has completed yet"));
    let (code, body) = service.wait_for("/readyz", |_, body| passed(body)).await;
    assert_eq!(code, 503, "{body}");
    assert_eq!((&body["live"], &body["ready"]), (&json!(true), &json!(false)), "{body}");
    assert!(passed(&body), "{body}");
    let (code, body) = service.get("/livez").await.expect("an answer");
    assert_eq!(code, 200, "{body}");
    // Released after each failed send (or claimed again, its send under way): never started.
    let job = common::job(&pool, id).await;
    assert!(matches!(job.state, rowq::JobState::Pending | rowq::JobState::Dispatched), "{job:?}");
    assert_eq!((job.attempts, job.started_at), (0, None), "{job:?}");
    // Live, so the container's check passes; where nothing listens, it fails, saying so.
    assert!(health_check(SCHEDULER, &service.address.to_string()).status.success());
    let check = health_check(SCHEDULER, &closed.to_string());
    assert!(!check.status.success());
    assert!(stderr(&check).contains(&format!("no health answer on {closed}")), "{}", stderr(&check));
}

/// `rowq work` as a service: ready once each queue's pollers have received; not ready, naming
/// why, once a batch's messages are handed back for redelivery (here: a function timeout
/// shorter than the time kept for recording outcomes leaves no time for any job), and live all
/// along. `rowq work --health-check` asks it.
#[tokio::test]
async fn rowq_work_as_a_service_is_ready_while_its_batches_are_handled() {
    let pool = common::database().await;
    let client = common::sqs().await;
    let work = |queues: &rowq::sqs::QueuePair, env: &[(&str, &str)]| {
        let mut work = rowq_command(&pool, &["work"]);
        work.env("ROWQ_QUEUE_URL", &queues.queue_url).env("ROWQ_DLQ_URL", &queues.dlq_url).env("ROWQ_WAIT_SECS", "1");
        work.envs(env.iter().copied());
        Service::start(work)
    };
    let rowq_work: &[&str] = &[env!("CARGO_BIN_EXE_rowq"), "work"];

    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let service = work(&queues, &[]);
    let (code, body) = service.wait_for("/readyz", |code, _| code == 200).await;
    assert_eq!((code, &body["error"]), (200, &Value::Null), "{body}");
    let check = health_check(rowq_work, &service.address.to_string());
    assert!(check.status.success(), "{}", stderr(&check));
    drop(service);

    // New queues: a long poll of the killed process may still take a message sent to the old.
    let queues = common::queues(&client, 5, Duration::from_secs(30)).await;
    let id = dispatched(&pool, "noop").await;
    assert_eq!(common::send_job_messages(&client, &queues.queue_url, &[(id, 1)], "late").await, Ok(1));
    let service = work(&queues, &[("ROWQ_FUNCTION_TIMEOUT_SECS", "1"), ("ROWQ_DEADLINE_MARGIN_MS", "2000")]);
    let handed_back = |body: &Value| body["error"].as_str().is_some_and(|e| e.contains("handed back for redelivery"));
    let (code, body) = service.wait_for("/readyz", |_, body| handed_back(body)).await;
    assert_eq!(code, 503, "{body}");
    assert!(handed_back(&body), "{body}");
    let queue_name = queues.queue_url.rsplit('/').next().expect("a queue name");
    assert!(body["error"].as_str().is_some_and(|e| e.contains(&format!("queue {queue_name}: 1 of"))), "{body}");
    assert_eq!(service.get("/livez").await.map(|(code, _)| code), Some(200));
    assert_eq!(common::job(&pool, id).await.state, rowq::JobState::Dispatched, "not run: no time for it");
}
