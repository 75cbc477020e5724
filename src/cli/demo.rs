//! `rowq demo`: the dev pipeline plus a mixed batch of demo jobs, live progress, and a
//! summary that checks every job ended in the state its kind implies.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use sqlx::PgPool;

use super::dev::{self, DevArgs};
use crate::JobState;

#[derive(Args)]
pub struct DemoArgs {
    #[command(flatten)]
    dev: DevArgs,
    /// How many demo jobs to enqueue.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(10..=1_000_000))]
    jobs: i64,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

/// The queue column value demo jobs go to, so a demo never mixes with real jobs.
const DEMO_QUEUE: &str = "demo";

/// Demo kinds and payloads, in tenths: 5 echo, 2 sleep, 2 fail-then-succeed, 1 fail for good.
/// The ratio is fixed by `n % 10` in one INSERT, so any client could reproduce it.
const DEMO_INSERT: &str = r#"
    INSERT INTO rowq.jobs (queue, kind, payload)
    SELECT $1,
           CASE WHEN n % 10 < 5 THEN 'echo' WHEN n % 10 < 7 THEN 'sleep' ELSE 'fail' END,
           CASE WHEN n % 10 < 5 THEN jsonb_build_object('n', n)
                WHEN n % 10 < 7 THEN jsonb_build_object('ms', 10 + n % 190)
                WHEN n % 10 < 9 THEN jsonb_build_object('times', 1 + n % 2)
                ELSE '{}'::jsonb END
    FROM generate_series(1, $2) AS n
    RETURNING id
"#;

pub async fn run(database_url: &str, args: DemoArgs) -> anyhow::Result<()> {
    // The demo's own output is the progress bar and the summary; RUST_LOG=info shows the rest.
    crate::telemetry::init_with_default(crate::config::log_format(), tracing::Level::ERROR);
    let overrides = vec![("ROWQ_QUEUE", DEMO_QUEUE.to_string())];
    // Short backoff, so retried demo jobs finish within seconds.
    let defaults = vec![("ROWQ_BACKOFF_BASE_MS", "200".to_string()), ("ROWQ_BACKOFF_MAX_SECS", "2".to_string())];
    let running = dev::start(database_url, &args.dev, overrides, defaults).await?;
    let pool = running.pool.clone();

    let started = Instant::now();
    let ids: Vec<i64> = sqlx::query_scalar(DEMO_INSERT)
        .bind(DEMO_QUEUE)
        .bind(args.jobs)
        .fetch_all(&pool)
        .await
        .context("cannot enqueue")?;
    let (first, last) = (ids.iter().min().copied().unwrap_or(0), ids.iter().max().copied().unwrap_or(0));
    eprintln!("enqueued {} demo jobs (ids {first}..={last}) with one INSERT", ids.len());

    let outcome = watch(&pool, first, last, args.jobs, Duration::from_secs(args.timeout)).await;
    let elapsed = started.elapsed();
    running.stop().await;
    let counts = outcome?;
    summary(&pool, first, last, &counts, elapsed).await
}

/// Shows progress until every demo job is terminal.
async fn watch(
    pool: &PgPool,
    first: i64,
    last: i64,
    total: i64,
    timeout: Duration,
) -> anyhow::Result<BTreeMap<JobState, i64>> {
    let tty = std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut last_line = Instant::now() - Duration::from_secs(60);
    loop {
        let counts = state_counts(pool, first, last).await?;
        let done: i64 = counts.iter().filter(|(s, _)| s.is_terminal()).map(|(_, n)| n).sum();
        let line = progress_line(&counts, done, total);
        if tty {
            eprint!("\r{line}");
            let _ = std::io::stderr().flush();
        } else if last_line.elapsed() >= Duration::from_secs(2) || done == total {
            eprintln!("{line}");
            last_line = Instant::now();
        }
        if done == total {
            if tty {
                eprintln!();
            }
            return Ok(counts);
        }
        if started.elapsed() > timeout {
            eprintln!();
            bail!("demo timed out after {timeout:?} with {} of {total} jobs finished", done);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn progress_line(counts: &BTreeMap<JobState, i64>, done: i64, total: i64) -> String {
    const WIDTH: i64 = 30;
    let filled = (done * WIDTH / total.max(1)) as usize;
    let bar = format!("{}{}", "#".repeat(filled), "-".repeat(WIDTH as usize - filled));
    let states: Vec<String> =
        JobState::ALL.iter().map(|s| format!("{s} {}", counts.get(s).copied().unwrap_or(0))).collect();
    format!("[{bar}] {done}/{total}  {}", states.join("  "))
}

async fn state_counts(pool: &PgPool, first: i64, last: i64) -> anyhow::Result<BTreeMap<JobState, i64>> {
    let rows: Vec<(JobState, i64)> = sqlx::query_as(
        "SELECT state, count(*) FROM rowq.jobs WHERE queue = $1 AND id BETWEEN $2 AND $3 GROUP BY state",
    )
    .bind(DEMO_QUEUE)
    .bind(first)
    .bind(last)
    .fetch_all(pool)
    .await
    .context("cannot read progress")?;
    Ok(rows.into_iter().collect())
}

/// Prints the summary; fails when a job did not end as its kind implies.
async fn summary(
    pool: &PgPool,
    first: i64,
    last: i64,
    counts: &BTreeMap<JobState, i64>,
    elapsed: Duration,
) -> anyhow::Result<()> {
    let by_kind: Vec<(String, JobState, i64, i64)> = sqlx::query_as(
        r#"
        SELECT CASE WHEN kind = 'fail' AND NOT payload ? 'times' THEN 'fail (permanent)'
                    WHEN kind = 'fail' THEN 'fail (retries)' ELSE kind END AS label,
               state, count(*), sum(attempts)
        FROM rowq.jobs WHERE queue = $1 AND id BETWEEN $2 AND $3
        GROUP BY 1, 2 ORDER BY 1, 2
        "#,
    )
    .bind(DEMO_QUEUE)
    .bind(first)
    .bind(last)
    .fetch_all(pool)
    .await?;
    let latencies: Vec<f64> = sqlx::query_scalar(
        r#"
        SELECT extract(epoch FROM started_at - created_at)::float8 * 1000 FROM rowq.jobs
        WHERE queue = $1 AND id BETWEEN $2 AND $3 AND attempts = 1 ORDER BY 1
        "#,
    )
    .bind(DEMO_QUEUE)
    .bind(first)
    .bind(last)
    .fetch_all(pool)
    .await?;

    let total: i64 = counts.values().sum();
    println!();
    println!("{:<18} {:<10} {:>7} {:>9}  EXPECTED", "KIND", "STATE", "JOBS", "ATTEMPTS");
    let mut wrong = 0;
    for (label, state, jobs, attempts) in &by_kind {
        let expected = if label == "fail (permanent)" { JobState::Failed } else { JobState::Succeeded };
        let ok = *state == expected;
        if !ok {
            wrong += jobs;
        }
        println!("{label:<18} {:<10} {jobs:>7} {attempts:>9}  {}", state.as_str(), if ok { "yes" } else { "NO" });
    }
    println!();
    println!("jobs                 {total}");
    println!("wall time            {:.2} s", elapsed.as_secs_f64());
    println!(
        "throughput           {:.0} jobs/s (retries wait for their backoff)",
        total as f64 / elapsed.as_secs_f64()
    );
    if !latencies.is_empty() {
        let at = |p: f64| latencies[((latencies.len() - 1) as f64 * p).round() as usize];
        println!(
            "insert → start       p50 {:.0} ms   p90 {:.0} ms   p99 {:.0} ms   (first attempts; all inserted at once)",
            at(0.5),
            at(0.9),
            at(0.99)
        );
    }
    if wrong > 0 {
        bail!("{wrong} demo jobs did not end in the state their kind implies");
    }
    println!("every job ended in the state its kind implies");
    Ok(())
}
