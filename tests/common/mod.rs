//! Factories and fixtures shared by the integration tests: real Postgres (each test makes a
//! fresh database, [`database`]) and LocalStack SQS (each test gets its own queues).
#![allow(dead_code)] // each test binary uses its own subset

use std::time::{Duration, Instant};

use aws_lambda_events::event::sqs::{SqsEvent, SqsMessage};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::{Credentials, Region};
use rowq::config::{DatabaseConfig, SchedulerConfig, WorkerConfig};
use rowq::sqs::{QueuePair, QueueSpec};
use rowq::store::admin::{self, JobRow, NewJob};
use rowq::{JobContext, JobError, JobId, JobState};
use sqlx::migrate::MigrateDatabase;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};

pub const ENDPOINT_DEFAULT: &str = "http://127.0.0.1:4566";

/// The LocalStack endpoint the tests use (`AWS_ENDPOINT_URL`, as the Makefile sets it).
pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| ENDPOINT_DEFAULT.to_string())
}

/// An SQS client for LocalStack. Panics with what to do when LocalStack is not running.
pub async fn sqs() -> Client {
    let endpoint = endpoint();
    let health = format!("{}/_localstack/health", endpoint.trim_end_matches('/'));
    let reachable = tokio::net::TcpStream::connect(endpoint.trim_start_matches("http://").trim_end_matches('/')).await;
    assert!(
        reachable.is_ok(),
        "LocalStack is not answering at {endpoint} ({health}): run the tests with `make test`, \
         or start it with `make localstack-up`"
    );
    sqs_at(&endpoint).await
}

/// An SQS client for any endpoint (an unreachable one simulates an outage).
pub async fn sqs_at(endpoint: &str) -> Client {
    Client::new(&aws_at(endpoint).await)
}

/// The AWS settings of a test's clients (SQS, Secrets Manager) for `endpoint`: LocalStack's
/// region and credentials, and timeouts that make an unreachable endpoint fail fast.
pub async fn aws_at(endpoint: &str) -> aws_config::SdkConfig {
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(2))
        .operation_attempt_timeout(Duration::from_secs(25))
        .build();
    rowq::sqs::aws_config()
        .endpoint_url(endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "rowq-tests"))
        .timeout_config(timeouts)
        .load()
        .await
}

/// A fresh FIFO queue and DLQ with a unique name.
pub async fn queues(client: &Client, max_receive_count: u32, visibility_timeout: Duration) -> QueuePair {
    let name = format!("rowq-test-{}-{}", std::process::id(), rand_suffix());
    rowq::sqs::ensure_queues(client, &QueueSpec { name, max_receive_count, visibility_timeout })
        .await
        .expect("create test queues")
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    u64::from(nanos) * 1000 + COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// Receives and deletes every message until the queue stays empty for `quiet`.
pub async fn drain_queue(client: &Client, queue_url: &str, quiet: Duration) -> Vec<rowq::JobMessage> {
    let mut messages = Vec::new();
    let mut last = Instant::now();
    while last.elapsed() < quiet {
        let received = receive_and_delete(client, queue_url).await.expect("receive and delete");
        if received.is_empty() {
            continue;
        }
        last = Instant::now();
        messages.extend(
            received.iter().map(|m| rowq::JobMessage::decode(m.body().unwrap_or_default()).expect("a job message")),
        );
    }
    messages
}

/// Sends one message per `(job, generation)`, ten to a call, each in the job's own message
/// group and deduplicated as `{dedup_prefix}-{job}-{generation}`. Returns how many SQS took.
pub async fn send_job_messages(
    client: &Client,
    queue_url: &str,
    messages: &[(rowq::JobId, i64)],
    dedup_prefix: &str,
) -> Result<usize, String> {
    let mut sent = 0;
    for chunk in messages.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, (id, generation))| {
                aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(rowq::JobMessage::new(*id, *generation).encode())
                    .message_group_id(id.to_string())
                    .message_deduplication_id(format!("{dedup_prefix}-{id}-{generation}"))
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let output = client
            .send_message_batch()
            .queue_url(queue_url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        sent += output.successful().len();
    }
    Ok(sent)
}

/// One long poll (up to 10 messages, 1 s) and the deletion of what it received.
pub async fn receive_and_delete(client: &Client, queue_url: &str) -> Result<Vec<aws_sdk_sqs::types::Message>, String> {
    let output = client
        .receive_message()
        .queue_url(queue_url)
        .max_number_of_messages(10)
        .wait_time_seconds(1)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let received = output.messages.unwrap_or_default();
    if received.is_empty() {
        return Ok(received);
    }
    let entries = received
        .iter()
        .enumerate()
        .map(|(i, m)| {
            aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(m.receipt_handle().unwrap_or_default())
                .build()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    client
        .delete_message_batch()
        .queue_url(queue_url)
        .set_entries(Some(entries))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    Ok(received)
}

/// Scheduler settings for tests: small batches, short intervals.
pub fn scheduler_config(queue_url: &str) -> SchedulerConfig {
    SchedulerConfig {
        database: database_config(),
        queue_url: queue_url.to_string(),
        queue: "default".to_string(),
        claim_batch: 100,
        max_in_flight: 100_000,
        publish_concurrency: 8,
        poll_interval: Duration::from_millis(200),
        busy_poll: Duration::from_millis(20),
        max_dispatch_rate: None,
        dispatch_lease: Duration::from_secs(300),
        maintenance_interval: Duration::from_secs(1),
        retention: rowq::maintenance::Retention::FOREVER,
        drain_for: None,
        cleanup_warn_after: None,
        metrics_namespace: None,
        health_listen: None,
    }
}

pub fn worker_config() -> WorkerConfig {
    WorkerConfig {
        database: database_config(),
        job_timeout: Duration::from_secs(30),
        deadline_margin: Duration::from_millis(500),
        rescue_grace: Duration::from_secs(1),
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
        metrics: None,
    }
}

fn database_config() -> DatabaseConfig {
    DatabaseConfig {
        url: std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        pool_size: 4,
        secret_arn: None,
    }
}

/// The URL of database `name` on the test server (`DATABASE_URL`'s server).
pub fn database_url(name: &str) -> String {
    let server = database_config().url;
    // Keep the URL's parameters (`?sslmode=...`): they apply to every database of the server.
    let (base, query) = server.split_once('?').map_or((server.as_str(), None), |(base, query)| (base, Some(query)));
    let root = &base[..base.rfind('/').unwrap_or(base.len())];
    match query {
        Some(query) => format!("{root}/{name}?{query}"),
        None => format!("{root}/{name}"),
    }
}

/// A fresh database with rowq's schema for the test that calls this, and a pool of 5 on it.
#[track_caller]
pub fn database() -> impl Future<Output = PgPool> {
    database_with(5)
}

/// A fresh database with rowq's schema for the test that calls this, and a pool of
/// `max_connections` on it.
///
/// It is named after the process and the calling line, so that no two tests share one, nor
/// two runs at once. It is dropped when the test's runtime ends, unless the test panicked: a
/// failed test's database stays to look at until the next run, whose first test drops those of
/// processes that are gone.
#[track_caller]
pub fn database_with(max_connections: u32) -> impl Future<Output = PgPool> {
    fresh_database(std::panic::Location::caller(), max_connections, None)
}

/// A fresh database, as [`database`], with the schema only as far as the migrations up to
/// `version` take it: for a test of the migration after it.
#[track_caller]
pub fn database_migrated_to(version: i64) -> impl Future<Output = PgPool> {
    fresh_database(std::panic::Location::caller(), 5, Some(version))
}

fn fresh_database(
    caller: &'static std::panic::Location<'static>,
    max_connections: u32,
    migrated_to: Option<i64>,
) -> impl Future<Output = PgPool> {
    let file = std::path::Path::new(caller.file()).file_stem().and_then(|stem| stem.to_str()).unwrap_or("test");
    let name = format!("{TEST_DATABASE_PREFIX}{}_{file}_{}", std::process::id(), caller.line());
    async move {
        LEFT_BY_GONE_RUNS_DROPPED
            .get_or_init(|| async {
                drop_databases_of_gone_runs(TEST_DATABASE_PREFIX).await;
            })
            .await;
        let url = database_url(&name);
        sqlx::Postgres::create_database(&url).await.unwrap_or_else(|e| panic!("create database {name}: {e}"));
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .idle_timeout(Duration::from_secs(1))
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect to {name}: {e}"));
        match migrated_to {
            None => rowq::store::migrate(&pool).await,
            Some(version) => rowq::store::MIGRATOR.run_to(version, &pool).await,
        }
        .expect("migrate the test database");
        // A task lives as long as the test's runtime; dropping it drops the database.
        let dropped_with_the_runtime = DropDatabase(url);
        tokio::spawn(async move {
            let _database = dropped_with_the_runtime;
            std::future::pending::<()>().await
        });
        pool
    }
}

/// Drops the database at this URL when dropped, unless the thread is panicking.
struct DropDatabase(String);

impl Drop for DropDatabase {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // The test's runtime is shutting down: the drop runs on a runtime of its own.
        let url = std::mem::take(&mut self.0);
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(sqlx::Postgres::force_drop_database(&url)).map_err(std::io::Error::other)
        })
        .join();
        if let Ok(Err(error)) = dropped {
            eprintln!("could not drop a test database (the next run will): {error}");
        }
    }
}

/// `rowq_test_<pid>_<file>_<line>`.
const TEST_DATABASE_PREFIX: &str = "rowq_test_";

static LEFT_BY_GONE_RUNS_DROPPED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// Drops the databases named `<prefix><pid>_…` that a process which no longer runs left behind
/// (a failed test's, or a benchmark stopped half-way), and returns their names. A database
/// somebody is connected to stays: a run on another machine against the same server may own it.
/// Linux only: elsewhere, none is dropped.
pub async fn drop_databases_of_gone_runs(prefix: &str) -> Vec<String> {
    let names: Vec<String> = {
        let mut server = sqlx::PgConnection::connect(&database_config().url).await.expect("connect to DATABASE_URL");
        sqlx::query_scalar(
            "SELECT datname FROM pg_database d WHERE starts_with(datname, $1)
               AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)",
        )
        .bind(prefix)
        .fetch_all(&mut server)
        .await
        .expect("list the databases of earlier runs")
    };
    let mut dropped = Vec::new();
    for name in names {
        let pid = name[prefix.len()..].split('_').next().unwrap_or_default();
        let gone = cfg!(target_os = "linux") && !std::path::Path::new("/proc").join(pid).exists();
        // Another process may be dropping it too: a failure here is only a leftover.
        if gone && sqlx::Postgres::force_drop_database(&database_url(&name)).await.is_ok() {
            dropped.push(name);
        }
    }
    dropped
}

/// Runs `insert`, a statement that inserts jobs (binding `n` as `$1`), as if each of its rows
/// came from a transaction of its own, as producers enqueue a group's jobs over time: the insert
/// sets none of them aside (it sets aside only the jobs behind one its own transaction inserted,
/// DESIGN 36, "At insert"), and the claims must. Its trigger is off for this transaction alone.
/// The benchmark's `group-backlog` uses it too.
pub async fn insert_unmarked(pool: &PgPool, insert: &'static str, n: i64) -> Result<(), sqlx::Error> {
    const TRIGGER: &str = "jobs_set_aside_behind_own_earlier_job";
    let mut tx = pool.begin().await?;
    let alter = |how: &str| format!("ALTER TABLE rowq.jobs {how} TRIGGER {TRIGGER}");
    sqlx::query(sqlx::AssertSqlSafe(alter("DISABLE"))).execute(&mut *tx).await?;
    sqlx::query(insert).bind(n).execute(&mut *tx).await?;
    sqlx::query(sqlx::AssertSqlSafe(alter("ENABLE"))).execute(&mut *tx).await?;
    tx.commit().await
}

/// A record as SQS delivers it: `message_id`, its message group and `body`.
pub fn record(message_id: &str, group: &str, body: String) -> SqsMessage {
    let mut record = SqsMessage::default();
    record.message_id = Some(message_id.to_string());
    record.body = Some(body);
    record.attributes.insert("MessageGroupId".into(), group.into());
    record
}

/// `record` as SQS delivers it the `receives`th time.
pub fn received(mut record: SqsMessage, receives: u32) -> SqsMessage {
    record.attributes.insert(rowq::worker::RECEIVE_COUNT_ATTRIBUTE.into(), receives.to_string());
    record
}

/// The records SQS would deliver for the messages a scheduler sent.
pub fn records_of(sent: &[rowq::sqs::Outgoing]) -> Vec<SqsMessage> {
    sent.iter().map(|out| record(&out.dedup_id, &out.group_id, out.message.encode())).collect()
}

/// A Lambda event of `records`.
pub fn event(records: Vec<SqsMessage>) -> SqsEvent {
    let mut event = SqsEvent::default();
    event.records = records;
    event
}

/// How many jobs with a `group_key` started before the job before them in their group (by id)
/// ended: a group runs one job at a time, in id order, so anything but 0 is a broken group. For
/// a table whose jobs have all finished; one row, one `bigint`.
pub const GROUP_JOBS_OUT_OF_ORDER_SQL: &str = "
    SELECT count(*) FROM (
        SELECT started_at, lag(finished_at) OVER (PARTITION BY group_key ORDER BY id) AS before
        FROM rowq.jobs WHERE group_key IS NOT NULL) AS grouped
    WHERE started_at < before";

/// Settings that open a pool of rowq's own (`rowq::store::connect*`) on the test's database.
pub fn own_database_config(pool: &PgPool, pool_size: u32) -> DatabaseConfig {
    DatabaseConfig { url: url_of(pool), pool_size, secret_arn: None }
}

/// The URL of the database `pool` is on, for a process of rowq's own to open.
pub fn url_of(pool: &PgPool) -> String {
    database_url(pool.connect_options().get_database().expect("a test pool names its database"))
}

/// A connection to `url`, named `name` (its `application_name`), holding a transaction that has
/// a transaction id, as a session that wrote something and then waited would (a forgotten
/// `BEGIN`, a long report): until it ends, Postgres cleans up no row version younger than it, in
/// any database of the server. With its process id and transaction id.
pub async fn open_transaction(url: &str, name: &str) -> Result<(sqlx::PgConnection, i32, i64), sqlx::Error> {
    use sqlx::ConnectOptions;
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    let mut connection = options.application_name(name).connect().await?;
    sqlx::query("BEGIN").execute(&mut connection).await?;
    let (pid, xid): (i32, i64) =
        sqlx::query_as("SELECT pg_backend_pid(), txid_current()").fetch_one(&mut connection).await?;
    Ok((connection, pid, xid))
}

/// Enqueues one job with defaults; panics if refused.
pub async fn enqueue(pool: &PgPool, kind: &str, payload: serde_json::Value) -> JobId {
    admin::enqueue(pool, &NewJob::new(kind, payload)).await.expect("enqueue").expect("not a duplicate")
}

/// Enqueues `n` jobs of `kind` in one statement.
pub async fn enqueue_many(pool: &PgPool, kind: &str, n: i64) -> Vec<JobId> {
    sqlx::query_scalar("INSERT INTO rowq.jobs (kind) SELECT $1 FROM generate_series(1, $2) RETURNING id")
        .bind(kind)
        .bind(n)
        .fetch_all(pool)
        .await
        .expect("enqueue many")
}

pub async fn job(pool: &PgPool, id: JobId) -> JobRow {
    admin::get(pool, id).await.expect("read job").expect("job exists")
}

pub async fn count_in_state(pool: &PgPool, state: JobState) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rowq.jobs WHERE state = $1")
        .bind(state)
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Polls `check` until it returns `Some`, or panics after `limit` with `what`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(started.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The in-process pipeline's settings for tests: one scheduler, `pollers` consumers, the DLQ
/// served when `with_dlq`.
pub fn pipeline_config(queues: &QueuePair, pollers: usize, with_dlq: bool) -> rowq::pipeline::PipelineConfig {
    rowq::pipeline::PipelineConfig {
        scheduler: scheduler_config(&queues.queue_url),
        event_source: rowq::config::EventSourceConfig {
            queue_url: queues.queue_url.clone(),
            dlq_url: with_dlq.then(|| queues.dlq_url.clone()),
            pollers,
            wait: Duration::from_secs(1),
            function_timeout: Duration::from_secs(30),
        },
        schedulers: 1,
    }
}

/// The input of [`effect`].
#[derive(serde::Deserialize, Default)]
#[serde(default)]
pub struct Effect {
    /// Sleep this long after writing the effect.
    pub sleep_ms: u64,
    /// Fail (retryably) the first N attempts, after writing the effect.
    pub fail_first: i32,
    /// Fail permanently, after writing the effect.
    pub permanent: bool,
}

/// A job that writes one row per execution into `effects` (see [`create_effects`]) through its
/// own transaction: the row commits only with the job's success, so `effects` shows how many
/// executions committed and which attempt did.
pub async fn effect(ctx: JobContext, input: Effect) -> Result<i32, JobError> {
    sqlx::query("INSERT INTO effects (job_id, attempt) VALUES ($1, $2)")
        .bind(ctx.job_id)
        .bind(ctx.attempt)
        .execute(&mut **ctx.tx().await?)
        .await?;
    tokio::time::sleep(Duration::from_millis(input.sleep_ms)).await;
    if input.permanent {
        return Err(JobError::permanent("doomed on purpose"));
    }
    if ctx.attempt <= input.fail_first {
        return Err(JobError::retryable(format!("effect fails attempt {} on purpose", ctx.attempt)));
    }
    Ok(ctx.attempt)
}

/// The table [`effect`] writes to.
pub async fn create_effects(pool: &PgPool) {
    sqlx::query("CREATE TABLE effects (job_id bigint NOT NULL, attempt int NOT NULL, UNIQUE (job_id, attempt))")
        .execute(pool)
        .await
        .unwrap();
}

/// The URL of `pool`'s database through a [`cuttable_proxy`], and the proxy's switch: a
/// database that goes away at the test's command.
pub async fn database_behind_a_proxy(pool: &PgPool) -> (String, std::sync::Arc<tokio::sync::watch::Sender<bool>>) {
    use sqlx::ConnectOptions;
    let options = pool.connect_options();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let (proxy, outage) = cuttable_proxy(upstream).await.expect("a proxy in front of the database");
    ((*options).clone().port(proxy.port()).to_url_lossy().to_string(), outage)
}

/// A TCP proxy in front of `upstream` (`host:port`); sending `true` on the returned channel makes
/// it unreachable (open connections are cut, new ones refused) until `false`: an outage of
/// LocalStack, or of Postgres, at the tests' command.
pub async fn cuttable_proxy(
    upstream: String,
) -> Result<(std::net::SocketAddr, std::sync::Arc<tokio::sync::watch::Sender<bool>>), std::io::Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let outage = std::sync::Arc::new(tokio::sync::watch::channel(false).0);
    let handle = outage.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else { continue };
            if *handle.borrow() {
                drop(inbound);
                continue;
            }
            let mut cut = handle.subscribe();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await else { return };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    _ = cut.wait_for(|down| *down) => {}
                }
            });
        }
    });
    Ok((address, outage))
}
