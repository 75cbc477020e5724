//! The chaos run: real Postgres, real LocalStack, scheduler and runner *processes*, and faults
//! injected at random while thousands of jobs flow — SIGKILLed processes, every message
//! delivered twice, terminated database sessions, an unreachable SQS endpoint, the queue paused
//! and resumed, run deadlines cut short. A fifth of the jobs belong to groups, whose jobs must run
//! one at a time in id order. At the end every invariant rowq promises is checked and printed.
//!
//! `make chaos` runs it at full size (CHAOS_JOBS=5000, CHAOS_SECONDS=60); `make test` at a small
//! one. The binary is its own runner process: started with `--runner` it serves the queue with
//! the chaos job handlers, like a Lambda worker fleet would.
//!
//! Settings: CHAOS_JOBS, CHAOS_SECONDS (fault window), CHAOS_SCHEDULERS, CHAOS_RUNNERS, CHAOS_SEED.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rowq::config::{Env, EventSourceConfig, SchedulerConfig, WorkerConfig};
use rowq::pipeline::{Pipeline, PipelineConfig};
use rowq::{Registry, Worker};
use sqlx::PgPool;
use sqlx::migrate::MigrateDatabase;
use tokio::process::{Child, Command};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    if args.first().map(String::as_str) == Some("--runner") {
        return runtime.block_on(runner());
    }
    // `cargo test NAME` passes NAME to every test binary: run only when selected or unfiltered.
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if !filters.is_empty() && !filters.iter().any(|f| "chaos".contains(f.as_str())) {
        println!("chaos: 0 passed, 0 failed (filtered out)");
        return ExitCode::SUCCESS;
    }
    match runtime.block_on(harness()) {
        Ok(()) => {
            println!("chaos: 1 passed, 0 failed");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("chaos: {error}");
            println!("chaos: 0 passed, 1 failed");
            ExitCode::FAILURE
        }
    }
}

// ---- the jobs -----------------------------------------------------------------------------

/// A runner process: the worker and the DLQ handler behind the local event source.
async fn runner() -> ExitCode {
    rowq::telemetry::init_with_default(rowq::telemetry::LogFormat::Text, tracing::Level::WARN);
    let lookup = |name: &str| std::env::var(name).ok();
    let env = Env::new(&lookup);
    let (worker_config, source, scheduler) =
        match (WorkerConfig::from(&env), EventSourceConfig::from(&env), SchedulerConfig::from(&env)) {
            (Ok(w), Ok(e), Ok(s)) => (w, e, s),
            (w, e, s) => {
                eprintln!("runner: bad configuration: {:?} {:?} {:?}", w.err(), e.err(), s.err());
                return ExitCode::FAILURE;
            }
        };
    let Ok(pool) = rowq::store::connect(&worker_config.database, rowq::store::Session::Worker).await else {
        eprintln!("runner: cannot connect");
        return ExitCode::FAILURE;
    };
    let registry = Registry::new().register("effect", common::effect);
    let worker = Worker::new(pool.clone(), registry, worker_config);
    let client = rowq::sqs::client().await;
    let config = PipelineConfig { scheduler, event_source: source, schedulers: 0 };
    let pipeline = match Pipeline::start(pool, client, worker, config).await {
        Ok(pipeline) => pipeline,
        Err(error) => {
            eprintln!("runner: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut shutdown = rowq::dispatch::shutdown_on_signals();
    let _ = shutdown.wait_for(|stop| *stop).await;
    pipeline.stop().await;
    ExitCode::SUCCESS
}

// ---- the harness --------------------------------------------------------------------------

struct Settings {
    jobs: i64,
    fault_window: Duration,
    schedulers: usize,
    runners: usize,
    seed: u64,
}

impl Settings {
    fn from_env() -> Self {
        let number =
            |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        Settings {
            jobs: number("CHAOS_JOBS", 600) as i64,
            fault_window: Duration::from_secs(number("CHAOS_SECONDS", 12)),
            schedulers: number("CHAOS_SCHEDULERS", 3) as usize,
            runners: number("CHAOS_RUNNERS", 3) as usize,
            seed: number("CHAOS_SEED", rand::rng().random()),
        }
    }
}

/// Faults injected, by kind.
#[derive(Default)]
struct Faults(BTreeMap<&'static str, u64>);

impl Faults {
    fn add(&mut self, kind: &'static str, n: u64) {
        *self.0.entry(kind).or_default() += n;
    }
}

/// What the children are started with.
struct World {
    database_url: String,
    queue_url: String,
    dlq_url: String,
    proxy_endpoint: String,
    logs: PathBuf,
}

type Error = Box<dyn std::error::Error>;

async fn harness() -> Result<(), Error> {
    let settings = Settings::from_env();
    println!(
        "chaos: {} jobs, {:?} of faults, {} schedulers, {} runners, seed {}",
        settings.jobs, settings.fault_window, settings.schedulers, settings.runners, settings.seed
    );
    let mut rng = StdRng::seed_from_u64(settings.seed);

    // A fresh database and fresh queues.
    let database_url = common::database_url(&format!("rowq_chaos_{}", std::process::id()));
    sqlx::Postgres::create_database(&database_url).await?;
    let result = run(&settings, &mut rng, &database_url).await;
    let _ = sqlx::Postgres::force_drop_database(&database_url).await;
    result
}

async fn run(settings: &Settings, rng: &mut StdRng, database_url: &str) -> Result<(), Error> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .acquire_timeout(Duration::from_secs(60))
        .connect(database_url)
        .await?;
    rowq::store::migrate(&pool).await?;
    common::create_effects(&pool).await;
    let sqs = common::sqs().await;
    let queues = common::queues(&sqs, 10, Duration::from_secs(30)).await;

    // Children reach SQS through a proxy the harness can cut.
    let upstream = common::endpoint().trim_start_matches("http://").trim_end_matches('/').to_string();
    let (proxy_address, outage) = common::cuttable_proxy(upstream).await?;
    let proxy_endpoint = format!("http://{proxy_address}");
    let logs = std::env::temp_dir().join(format!("rowq-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let world = World {
        database_url: database_url.to_string(),
        queue_url: queues.queue_url.clone(),
        dlq_url: queues.dlq_url.clone(),
        proxy_endpoint,
        logs: logs.clone(),
    };

    enqueue(&pool, settings.jobs).await?;
    let mut schedulers: Vec<Child> =
        (0..settings.schedulers).map(|i| spawn_scheduler(&world, i)).collect::<Result<_, _>>()?;
    let mut runners: Vec<Child> = (0..settings.runners).map(|i| spawn_runner(&world, i)).collect::<Result<_, _>>()?;

    let started = Instant::now();
    let mut faults = Faults::default();
    let mut spawned = settings.schedulers + settings.runners;
    // Rows claimed while the queue was paused, after a second for a claim already running.
    let mut claimed_while_paused = 0;
    // The first seven faults are one of each kind, so even a small run injects them all.
    let mut tick = 0;
    while started.elapsed() < settings.fault_window {
        tokio::time::sleep(Duration::from_millis(rng.random_range(150..600))).await;
        let roll = if tick < 7 { [0, 20, 45, 60, 75, 85, 93][tick] } else { rng.random_range(0..100) };
        tick += 1;
        match roll {
            0..=19 => {
                let i = rng.random_range(0..schedulers.len());
                spawned += 1;
                replace(&mut schedulers[i], || spawn_scheduler(&world, spawned)).await?;
                faults.add("SIGKILL a scheduler (restarted)", 1);
            }
            20..=44 => {
                let i = rng.random_range(0..runners.len());
                spawned += 1;
                replace(&mut runners[i], || spawn_runner(&world, spawned)).await?;
                faults.add("SIGKILL a runner (restarted)", 1);
            }
            45..=59 => {
                let sent = duplicate_in_flight(&pool, &sqs, &queues.queue_url, rng).await?;
                faults.add("duplicate every dispatched message (rounds)", 1);
                faults.add("duplicate messages sent", sent);
            }
            60..=74 => {
                let terminated: Vec<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .fetch_all(&pool)
                .await?;
                faults.add("pg_terminate_backend rounds", 1);
                faults.add("database sessions terminated", terminated.len() as u64);
            }
            75..=84 => {
                let cut = Duration::from_millis(rng.random_range(1000..4000));
                outage.send_replace(true);
                tokio::time::sleep(cut).await;
                outage.send_replace(false);
                faults.add("SQS endpoint unreachable (windows)", 1);
                faults.add("SQS endpoint unreachable (ms)", cut.as_millis() as u64);
            }
            85..=92 => {
                // As `rowq pause` and `rowq resume` do it. Every claim adds one to a generation.
                let claims = || sqlx::query_scalar::<_, i64>("SELECT sum(dispatch_gen)::bigint FROM rowq.jobs");
                sqlx::query("INSERT INTO rowq.paused_queues (queue, reason) VALUES ('default', 'chaos')")
                    .execute(&pool)
                    .await?;
                // A claim that began before the pause committed may still end: a generous moment.
                tokio::time::sleep(Duration::from_secs(1)).await;
                let before = claims().fetch_one(&pool).await?;
                let paused = Duration::from_millis(rng.random_range(500..1500));
                tokio::time::sleep(paused).await;
                let after = claims().fetch_one(&pool).await?;
                sqlx::query("DELETE FROM rowq.paused_queues WHERE queue = 'default'").execute(&pool).await?;
                claimed_while_paused += after - before;
                faults.add("queue paused, then resumed (windows)", 1);
                faults.add("queue paused (ms)", paused.as_millis() as u64);
            }
            _ => {
                let cut = sqlx::query(
                    "UPDATE rowq.jobs SET run_deadline = now() - interval '1 millisecond' \
                     WHERE id IN (SELECT id FROM rowq.jobs WHERE state = 'running' ORDER BY random() LIMIT 5)",
                )
                .execute(&pool)
                .await?
                .rows_affected();
                faults.add("run deadline cut short (jobs)", cut);
            }
        }
    }
    outage.send_replace(false);
    let fault_window = started.elapsed();

    // Let it settle: every job must reach a terminal state.
    let settle = Instant::now();
    let deadline = Duration::from_secs(240);
    loop {
        let open: i64 =
            sqlx::query_scalar("SELECT count(*) FROM rowq.jobs WHERE state IN ('pending', 'dispatched', 'running')")
                .fetch_one(&pool)
                .await?;
        if open == 0 {
            break;
        }
        if settle.elapsed().as_secs().is_multiple_of(10) && settle.elapsed().subsec_millis() < 250 {
            let states: Vec<(rowq::JobState, i64)> = sqlx::query_as(
                "SELECT state, count(*) FROM rowq.jobs WHERE state IN ('pending', 'dispatched', 'running') GROUP BY 1",
            )
            .fetch_all(&pool)
            .await?;
            eprintln!("chaos: settling, {:.0} s: {states:?}", settle.elapsed().as_secs_f64());
        }
        if settle.elapsed() > deadline {
            return Err(format!(
                "{open} jobs still unfinished {deadline:?} after the faults stopped (logs in {})",
                logs.display()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let total = started.elapsed();
    for child in schedulers.iter_mut().chain(runners.iter_mut()) {
        terminate(child).await;
    }

    let mut checks = check_invariants(&pool, &sqs, &queues.queue_url, &queues.dlq_url, settings.jobs).await?;
    checks.push((
        "no row claimed while its queue was paused",
        claimed_while_paused == 0,
        format!("{claimed_while_paused} claims"),
    ));
    println!();
    println!("{:<46} {:>10}", "FAULT INJECTED", "COUNT");
    for (kind, n) in &faults.0 {
        println!("{kind:<46} {n:>10}");
    }
    println!();
    println!("{:<70} {:>8}", "INVARIANT", "RESULT");
    let mut failed = 0;
    for (name, ok, detail) in &checks {
        println!("{name:<70} {:>8}  {detail}", if *ok { "holds" } else { "BROKEN" });
        failed += usize::from(!ok);
    }
    println!();
    println!(
        "{} jobs in {:.1} s ({:.1} s of faults, settled {:.1} s later); logs in {}",
        settings.jobs,
        total.as_secs_f64(),
        fault_window.as_secs_f64(),
        (total - fault_window).as_secs_f64(),
        logs.display()
    );
    if failed > 0 {
        return Err(format!("{failed} invariants broken").into());
    }
    if std::env::var_os("CHAOS_KEEP_LOGS").is_none() {
        let _ = std::fs::remove_dir_all(&logs);
    }
    Ok(())
}

/// 85 % plain effects (0–30 ms), 7 % that fail twice then succeed, 5 % slow (1.5 s, the ones whose
/// deadlines get cut), 3 % doomed (fail permanently). One job in five, of each kind, belongs to
/// one of [`GROUPS`] groups, whose jobs must run one at a time in id order.
async fn enqueue(pool: &PgPool, jobs: i64) -> Result<(), Error> {
    sqlx::query(
        r#"
        INSERT INTO rowq.jobs (kind, payload, max_attempts, group_key)
        SELECT 'effect',
               CASE WHEN n % 100 < 85 THEN jsonb_build_object('sleep_ms', n % 31)
                    WHEN n % 100 < 92 THEN jsonb_build_object('fail_first', 2)
                    WHEN n % 100 < 97 THEN jsonb_build_object('sleep_ms', 1500)
                    ELSE jsonb_build_object('permanent', true) END,
               50,
               CASE WHEN n % 5 = 0 THEN 'chaos-' || (n / 5) % $2 END
        FROM generate_series(1, $1) AS n
        "#,
    )
    .bind(jobs)
    .bind(GROUPS)
    .execute(pool)
    .await?;
    Ok(())
}

/// How many groups the grouped jobs are spread over.
const GROUPS: i64 = 20;

fn child_env(world: &World, command: &mut Command, name: &str) -> Result<(), Error> {
    let log = std::fs::File::create(world.logs.join(format!("{name}.log")))?;
    command
        .env("DATABASE_URL", &world.database_url)
        .env("ROWQ_QUEUE_URL", &world.queue_url)
        .env("ROWQ_DLQ_URL", &world.dlq_url)
        .env("AWS_ENDPOINT_URL", &world.proxy_endpoint)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("ROWQ_LOG_FORMAT", "text")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true);
    Ok(())
}

/// SIGKILLs a child process and puts the one `spawn` starts in its place.
async fn replace(child: &mut Child, spawn: impl FnOnce() -> Result<Child, Error>) -> Result<(), Error> {
    let _ = child.start_kill();
    let _ = child.wait().await;
    *child = spawn()?;
    Ok(())
}

fn spawn_scheduler(world: &World, n: usize) -> Result<Child, Error> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_scheduler"));
    child_env(world, &mut command, &format!("scheduler-{n}"))?;
    command
        .env("ROWQ_DISPATCH_LEASE_SECS", "8")
        .env("ROWQ_MAX_IN_FLIGHT", "300")
        .env("ROWQ_CLAIM_BATCH", "50")
        .env("ROWQ_MAINTENANCE_INTERVAL_SECS", "1")
        .env("ROWQ_POLL_INTERVAL_MS", "200")
        .env("ROWQ_DB_POOL_SIZE", "3");
    Ok(command.spawn()?)
}

fn spawn_runner(world: &World, n: usize) -> Result<Child, Error> {
    let mut command = Command::new(std::env::current_exe()?);
    command.arg("--runner");
    child_env(world, &mut command, &format!("runner-{n}"))?;
    command
        .env("ROWQ_POLLERS", "4")
        .env("ROWQ_WAIT_SECS", "1")
        .env("ROWQ_FUNCTION_TIMEOUT_SECS", "5")
        .env("ROWQ_JOB_TIMEOUT_SECS", "3")
        .env("ROWQ_DEADLINE_MARGIN_MS", "500")
        .env("ROWQ_RESCUE_GRACE_SECS", "1")
        .env("ROWQ_BACKOFF_BASE_MS", "100")
        .env("ROWQ_BACKOFF_MAX_SECS", "1")
        // 3 runners × 16 + 3 schedulers × 4 stays well inside Postgres's default 100 connections,
        // also while killed processes' connections linger.
        .env("ROWQ_DB_POOL_SIZE", "16");
    Ok(command.spawn()?)
}

async fn terminate(child: &mut Child) {
    if let Some(pid) = child.id() {
        let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status().await;
        if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_ok() {
            return;
        }
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// Sends a second copy of the message of every dispatched row, with a new deduplication id.
async fn duplicate_in_flight(
    pool: &PgPool,
    sqs: &aws_sdk_sqs::Client,
    queue_url: &str,
    rng: &mut StdRng,
) -> Result<u64, Error> {
    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, dispatch_gen FROM rowq.jobs WHERE state = 'dispatched' LIMIT 200")
            .fetch_all(pool)
            .await?;
    let nonce: u64 = rng.random();
    let messages: Vec<(rowq::JobId, i64)> =
        rows.into_iter().map(|(id, generation)| (rowq::JobId(id), generation)).collect();
    let sent = common::send_job_messages(sqs, queue_url, &messages, &format!("chaos-{nonce}")).await?;
    Ok(sent as u64)
}

type Check = (&'static str, bool, String);

async fn check_invariants(
    pool: &PgPool,
    sqs: &aws_sdk_sqs::Client,
    queue_url: &str,
    dlq_url: &str,
    jobs: i64,
) -> Result<Vec<Check>, Error> {
    let mut checks: Vec<Check> = Vec::new();
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await }
    };
    let rows = count("SELECT count(*) FROM rowq.jobs").await?;
    checks.push(("every job enqueued is still there", rows == jobs, format!("{rows} of {jobs}")));
    let open = count("SELECT count(*) FROM rowq.jobs WHERE state NOT IN ('succeeded', 'failed', 'cancelled')").await?;
    checks.push(("every job is terminal", open == 0, format!("{open} not terminal")));
    let wrong = count(
        "SELECT count(*) FROM rowq.jobs WHERE (payload ? 'permanent') <> (state = 'failed') OR state = 'cancelled'",
    )
    .await?;
    let failed = count("SELECT count(*) FROM rowq.jobs WHERE state = 'failed'").await?;
    checks.push((
        "doomed jobs failed, every other job succeeded",
        wrong == 0,
        format!("{wrong} wrong; {failed} failed in all"),
    ));
    let doubled =
        count("SELECT count(*) FROM (SELECT job_id FROM effects GROUP BY job_id HAVING count(*) > 1) AS d").await?;
    checks.push(("no job has two committed effects (no double execution)", doubled == 0, format!("{doubled} jobs")));
    let missing = count(
        "SELECT count(*) FROM rowq.jobs j WHERE j.state = 'succeeded' \
         AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.job_id = j.id AND e.attempt = j.attempts)",
    )
    .await?;
    checks.push((
        "every succeeded job has its effect, from its last attempt (no loss)",
        missing == 0,
        format!("{missing} jobs"),
    ));
    let leaked =
        count("SELECT count(*) FROM effects e JOIN rowq.jobs j ON j.id = e.job_id WHERE j.state <> 'succeeded'")
            .await?;
    checks.push(("failed attempts committed nothing", leaked == 0, format!("{leaked} effects")));
    let over = count(
        "SELECT count(*) FROM rowq.jobs j WHERE (SELECT count(*) FROM effects e WHERE e.job_id = j.id) > j.attempts",
    )
    .await?;
    checks.push(("no job has more effects than attempts", over == 0, format!("{over} jobs")));
    // A group's next job is claimed only once the one before it has ended, so every execution of
    // it starts after that end.
    let overlapping = count(common::GROUP_JOBS_OUT_OF_ORDER_SQL).await?;
    let grouped = count("SELECT count(*) FROM rowq.jobs WHERE group_key IS NOT NULL").await?;
    checks.push((
        "the jobs of each group ran one at a time, in id order",
        overlapping == 0,
        format!("{overlapping} started before the job before them ended, of {grouped} grouped"),
    ));
    let set_aside = count("SELECT count(*) FROM rowq.jobs WHERE behind_group").await?;
    checks.push(("no job is left set aside behind its group", set_aside == 0, format!("{set_aside} jobs")));
    let retried = count("SELECT count(*) FROM rowq.jobs WHERE attempts > 1").await?;
    let max_attempts = count("SELECT coalesce(max(attempts), 0)::bigint FROM rowq.jobs").await?;
    checks.push((
        "(for the record) jobs that ran more than one attempt",
        true,
        format!("{retried}, at most {max_attempts} attempts"),
    ));

    // Whatever is left on the queues must be stale: no job still waits for it.
    let mut needed = 0;
    let mut left = 0;
    for url in [queue_url, dlq_url] {
        for message in common::drain_queue(sqs, url, Duration::from_secs(2)).await {
            left += 1;
            let state: Option<rowq::JobState> = sqlx::query_scalar("SELECT state FROM rowq.jobs WHERE id = $1")
                .bind(message.job_id)
                .fetch_optional(pool)
                .await?;
            needed += usize::from(state.is_some_and(|s| !s.is_terminal()));
        }
    }
    checks.push((
        "nothing left on the queue or DLQ that a job still needs",
        needed == 0,
        format!("{left} stale messages drained, {needed} needed"),
    ));
    Ok(checks)
}
