//! The `rowq` command line: operate the queue without writing SQL. The `rowq` binary is one
//! call of [`main`], for the reason [`crate::entry`] gives for the Lambda binaries: awaited from
//! the binary, the CLI's async code was compiled a second time there (42.5 s of a clean
//! `cargo bench --no-run`'s unit time, BENCHMARKS.md round 11).

mod commands;
mod demo;
mod dev;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rowq", version, about = "A Postgres table as a job queue whose work runs on AWS Lambda")]
struct Cli {
    /// Postgres URL.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true, default_value = "")]
    database_url: String,
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or update the rowq schema (idempotent).
    Migrate,
    /// Enqueue a job (the same INSERT any client can run).
    Enqueue(commands::EnqueueArgs),
    /// Show one job: its row and its error history.
    Status {
        /// The job id.
        id: i64,
    },
    /// Wait until a job is finished, then show it as `status` does; exit 0 if it succeeded, 1
    /// if it failed or was cancelled, 124 if the timeout passed first.
    Wait(commands::WaitArgs),
    /// List jobs, newest first.
    List(commands::ListArgs),
    /// Counts by queue and state, oldest pending age, throughput over the last minute.
    Stats,
    /// Put failed or cancelled jobs back to pending, with attempts reset. Of many, a job whose
    /// dedup_key another job holds is left as it was, and named.
    Retry(commands::RetryArgs),
    /// Delete failed or cancelled jobs (their rows and error history): the failures read and
    /// not to be retried, where ROWQ_FAILED_RETENTION_HOURS keeps them.
    Discard(commands::DiscardArgs),
    /// Cancel a pending or dispatched job, or all of them of a kind or a queue.
    Cancel(commands::CancelArgs),
    /// Pause a queue: no scheduler claims its jobs until it is resumed. Jobs are still
    /// enqueued; dispatched and running jobs finish. With no QUEUE, list the paused queues.
    Pause(commands::PauseArgs),
    /// Resume a paused queue: its schedulers are woken and dispatch at once.
    Resume {
        /// The queue (the jobs' `queue` column).
        queue: String,
    },
    /// Manage the SQS queues.
    Queues {
        #[command(subcommand)]
        command: QueuesCommand,
    },
    /// Run the whole pipeline on this machine: migrations, queues, scheduler, worker and DLQ
    /// handler behind a local event source, until Ctrl-C.
    Dev(dev::DevArgs),
    /// Run the worker and the DLQ handler behind the local event source, without a scheduler:
    /// a worker fleet outside Lambda (ECS, EC2, a laptop). Needs ROWQ_QUEUE_URL.
    Work(WorkArgs),
    /// `dev` plus a mixed batch of demo jobs, live progress and a summary; exits 1 if any job
    /// did not end in the state its kind implies.
    Demo(demo::DemoArgs),
}

#[derive(Subcommand)]
enum QueuesCommand {
    /// Create the FIFO jobs queue and its FIFO DLQ with a redrive policy (idempotent).
    Create(QueueArgs),
    /// Messages waiting and in flight on the jobs queue and the DLQ.
    Show(QueueArgs),
}

#[derive(Args, Clone)]
pub struct QueueArgs {
    /// Base name: the queues are NAME.fifo and NAME-dlq.fifo.
    #[arg(long, env = "ROWQ_SQS_QUEUE_NAME", default_value = "rowq-jobs")]
    pub name: String,
    /// Receives before a message moves to the DLQ.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_receive_count: u32,
    /// The worker's function timeout in seconds; the visibility timeout is 6 times it.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=900))]
    pub function_timeout: u64,
}

/// Parses the command line and runs it; exits 1 with the error on stderr if it fails.
pub fn main() {
    let cli = Cli::parse();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
        .and_then(|runtime| runtime.block_on(run(cli)));
    if let Err(error) = result {
        eprintln!("rowq: {}", one_line(&error));
        std::process::exit(commands::exit_code(&error));
    }
}

/// The error and its causes, each after a colon, skipping a cause that repeats the text before
/// it. A database error ends the line with the server's message alone: sqlx's error has the
/// server's as its source, which says the message again with the line of Postgres's own C
/// source it was raised at (`… at line 3665`), nothing a user can act on.
fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let database = cause.downcast_ref::<sqlx::Error>().and_then(sqlx::Error::as_database_error);
        let text = database.map_or_else(|| cause.to_string(), |db| db.message().to_string());
        if !line.ends_with(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        if database.is_some() {
            break;
        }
    }
    line
}

#[derive(Args)]
struct WorkArgs {
    /// Ask the `rowq work` running beside this one, on ROWQ_HEALTH_LISTEN, whether its pollers
    /// turn: exit 0 if `/livez` answered 200. For a container's health check.
    #[arg(long)]
    health_check: bool,
}

async fn run(mut cli: Cli) -> anyhow::Result<()> {
    if let Command::Work(WorkArgs { health_check: true }) = cli.command {
        return crate::entry::health_check().map_err(|error| anyhow::anyhow!(error));
    }
    let mut from_secret = None;
    if cli.database_url.is_empty()
        && let Some(database) = database_from_secret().await?
    {
        cli.database_url = database.url.clone();
        from_secret = Some(database);
    }
    match cli.command {
        Command::Dev(args) => dev::run(&cli.database_url, args).await,
        Command::Work(_) => dev::work(&cli.database_url, from_secret).await,
        Command::Demo(args) => demo::run(&cli.database_url, args).await,
        command => commands::run(&cli.database_url, cli.json, command).await,
    }
}

/// With neither `--database-url` nor `DATABASE_URL`, the URL in the secret
/// `ROWQ_DATABASE_SECRET_ARN` names, read as the deployed binaries read it: an operator runs
/// `rowq` against the production database with the secret's ARN and their own AWS credentials,
/// and no password is copied into a shell or its history. `None` when no secret is named.
async fn database_from_secret() -> anyhow::Result<Option<crate::config::DatabaseConfig>> {
    let env = crate::config::Env::new(&crate::config::process_env);
    if env.optional("ROWQ_DATABASE_SECRET_ARN").is_none() {
        return Ok(None);
    }
    let mut database = crate::config::DatabaseConfig::from(&env, 1)?;
    crate::secret::resolve(&mut database).await?;
    Ok(Some(database))
}
