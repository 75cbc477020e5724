//! The operator subcommands: one function each, one clear line on error.

use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use chrono::{DateTime, Utc};
use clap::Args;
use serde::Serialize;
use sqlx::PgPool;

use super::{Command, QueueArgs, QueuesCommand};
use crate::config::{DatabaseConfig, redact_url};
use crate::sqs::{self, QueueSpec};
use crate::store::{self, admin};
use crate::{JobId, JobState};

#[derive(Args)]
pub struct EnqueueArgs {
    /// The job kind (which handler runs it).
    kind: String,
    /// The payload, a JSON object; `@FILE` reads it from a file, `-` from standard input.
    #[arg(default_value = "{}")]
    payload: String,
    /// Enqueue one job per line of FILE (`-`: standard input), each line a payload, all with
    /// the other options, in one transaction (a backfill): a line that is not a JSON object
    /// enqueues none, naming it. Blank lines are skipped.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["payload", "dedup_key", "wait"])]
    lines: Option<String>,
    #[arg(long)]
    queue: Option<String>,
    /// Higher runs first.
    #[arg(long, allow_hyphen_values = true)]
    priority: Option<i16>,
    /// Not before this time (RFC 3339, e.g. 2026-12-01T09:00:00Z).
    #[arg(long, conflicts_with = "delay", value_parser = a_time)]
    run_at: Option<DateTime<Utc>>,
    /// Not before this many seconds from now.
    #[arg(long)]
    delay: Option<u64>,
    #[arg(long)]
    max_attempts: Option<i32>,
    /// Jobs with the same key run one at a time, in order.
    #[arg(long)]
    group_key: Option<String>,
    /// A second enqueue with this key is a no-op while the first is unfinished.
    #[arg(long)]
    dedup_key: Option<String>,
    /// Wait until the job is finished, as `rowq wait` does (an enqueue that --dedup-key made a
    /// no-op waits for the job that holds the key).
    #[arg(long)]
    wait: bool,
    /// With --wait: give up after this many seconds (exit 124); the job goes on.
    #[arg(long, requires = "wait")]
    timeout: Option<u64>,
}

#[derive(Args)]
pub struct WaitArgs {
    /// The job id.
    id: i64,
    /// Give up after this many seconds (exit 124); the job goes on. Default: no limit.
    #[arg(long)]
    timeout: Option<u64>,
}

#[derive(Args)]
pub struct ListArgs {
    #[arg(long)]
    state: Option<JobState>,
    #[arg(long)]
    kind: Option<String>,
    #[arg(long)]
    queue: Option<String>,
    /// The jobs of this group_key, finished ones too: what ran and what waits, in order.
    #[arg(long)]
    group_key: Option<String>,
    /// The jobs enqueued with this dedup_key, finished ones too: each run of a recurring job.
    #[arg(long)]
    dedup_key: Option<String>,
    #[arg(long, default_value_t = 20)]
    limit: i64,
}

/// Which failed or cancelled jobs a retry or a discard of many takes.
#[derive(Args)]
#[command(group(clap::ArgGroup::new("many").args(["all_failed", "all_cancelled"])))]
pub struct FinishedArgs {
    /// Every failed job (of --queue, --kind, --since and --before, each if given).
    #[arg(long)]
    all_failed: bool,
    /// Every cancelled job (of --queue, --kind, --since and --before, each if given).
    #[arg(long)]
    all_cancelled: bool,
    /// Only the jobs of this queue.
    #[arg(long, requires = "many")]
    queue: Option<String>,
    /// Only the jobs of this kind: say, the one whose handler was fixed, or was cancelled by mistake.
    #[arg(long, requires = "many")]
    kind: Option<String>,
    /// Only the jobs that finished (failed, or were cancelled) at or after this time (RFC 3339).
    #[arg(long, requires = "many", value_parser = a_time)]
    since: Option<DateTime<Utc>>,
    /// Only the jobs that finished before this time (RFC 3339).
    #[arg(long, requires = "many", value_parser = a_time)]
    before: Option<DateTime<Utc>>,
    /// Say what --all-failed or --all-cancelled would do, and change nothing.
    #[arg(long, requires = "many")]
    dry_run: bool,
}

impl FinishedArgs {
    /// The jobs of a retry or a discard of many; `None` for one job by its id.
    fn many(&self) -> Option<admin::FinishedJobs<'_>> {
        let of = match (self.all_failed, self.all_cancelled) {
            (true, _) => admin::EndedAs::Failed,
            (_, true) => admin::EndedAs::Cancelled,
            _ => return None,
        };
        Some(admin::FinishedJobs {
            queue: self.queue.as_deref(),
            kind: self.kind.as_deref(),
            since: self.since,
            before: self.before,
            of,
        })
    }
}

#[derive(Args)]
pub struct RetryArgs {
    /// The job id (a failed or a cancelled job).
    #[arg(required_unless_present = "many", conflicts_with = "many")]
    id: Option<i64>,
    #[command(flatten)]
    which: FinishedArgs,
}

#[derive(Args)]
pub struct DiscardArgs {
    /// The job id (a failed or a cancelled job).
    #[arg(required_unless_present = "many", conflicts_with = "many")]
    id: Option<i64>,
    #[command(flatten)]
    which: FinishedArgs,
}

#[derive(Args)]
pub struct CancelArgs {
    /// The job id.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    id: Option<i64>,
    /// Every pending or dispatched job of --kind and --queue (one of them at least); running
    /// jobs finish.
    #[arg(long)]
    all: bool,
    #[arg(long, requires = "all")]
    queue: Option<String>,
    #[arg(long, requires = "all")]
    kind: Option<String>,
    /// Say what --all would cancel, and change nothing.
    #[arg(long, requires = "all")]
    dry_run: bool,
}

#[derive(Args)]
pub struct PauseArgs {
    /// The queue (the jobs' `queue` column); it need not have jobs yet.
    queue: Option<String>,
    /// Why, for whoever finds it paused (`rowq stats`, `rowq pause`).
    #[arg(long, requires = "queue")]
    reason: Option<String>,
}

pub async fn run(database_url: &str, json: bool, command: Command) -> anyhow::Result<()> {
    match command {
        Command::Queues { command: QueuesCommand::Create(args) } => return create_queues(&args, json).await,
        Command::Queues { command: QueuesCommand::Show(args) } => return show_queues(&args, json).await,
        Command::Dev(_) | Command::Demo(_) | Command::Work(_) => unreachable!("cli::run dispatches dev, demo and work"),
        _ => {}
    }
    let pool = connect(database_url).await?;
    operate(&pool, json, command).await.map_err(behind_schema)
}

/// A table or column this rowq reads that the database lacks: its rowq schema is older than
/// this binary, as when the CLI is upgraded before the scheduler (which migrates at start).
fn behind_schema(error: anyhow::Error) -> anyhow::Error {
    const UNDEFINED_TABLE: &str = "42P01";
    const UNDEFINED_COLUMN: &str = "42703";
    let missing = error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<sqlx::Error>())
        .filter_map(sqlx::Error::as_database_error)
        .any(|db| matches!(db.code().as_deref(), Some(UNDEFINED_TABLE | UNDEFINED_COLUMN)));
    if missing {
        error.context("the database's rowq schema is older than this rowq: run `rowq migrate`")
    } else {
        error
    }
}

async fn operate(pool: &PgPool, json: bool, command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            store::migrate(pool).await.context("migration failed")?;
            say(json, &serde_json::json!({"migrated": true}), "schema rowq is up to date");
        }
        Command::Enqueue(args) => enqueue(pool, args, json).await?,
        Command::Status { id } => {
            let row = get(pool, id).await?;
            if json {
                print_json(&row);
            } else {
                print_row(&row);
            }
        }
        Command::Wait(args) => wait(pool, JobId(args.id), args.timeout, json).await?,
        Command::List(args) => {
            let filter = admin::ListFilter {
                state: args.state,
                kind: args.kind,
                queue: args.queue,
                group_key: args.group_key,
                dedup_key: args.dedup_key,
                limit: args.limit,
            };
            let rows = admin::list(pool, &filter).await.context("cannot list jobs")?;
            if json {
                print_json(&rows);
            } else {
                print_table(&rows);
            }
        }
        Command::Stats => stats(pool, json).await?,
        Command::Retry(args) => retry(pool, args, json).await?,
        Command::Discard(args) => discard(pool, args, json).await?,
        Command::Cancel(args) => cancel(pool, args, json).await?,
        Command::Pause(args) => pause(pool, args, json).await?,
        Command::Resume { queue } => resume(pool, &queue, json).await?,
        Command::Queues { .. } | Command::Dev(_) | Command::Demo(_) | Command::Work(_) => {}
    }
    Ok(())
}

pub async fn connect(database_url: &str) -> anyhow::Result<PgPool> {
    if database_url.is_empty() {
        bail!(
            "no database: set DATABASE_URL, pass --database-url postgres://user@host:5432/db, or set ROWQ_DATABASE_SECRET_ARN"
        );
    }
    let config = DatabaseConfig { url: database_url.to_string(), pool_size: 4, secret_arn: None };
    store::connect(&config, store::Session::Cli)
        .await
        .with_context(|| format!("cannot connect to {}", redact_url(database_url)))
}

/// `rowq dev` and `rowq demo` start from nothing: create the database when it does not exist.
pub async fn create_database_if_missing(database_url: &str) -> anyhow::Result<()> {
    use sqlx::migrate::MigrateDatabase;
    if database_url.is_empty() {
        return Ok(()); // `connect` says what is missing
    }
    let exists = sqlx::Postgres::database_exists(database_url)
        .await
        .with_context(|| format!("cannot connect to {}", redact_url(database_url)))?;
    if !exists {
        sqlx::Postgres::create_database(database_url)
            .await
            .with_context(|| format!("cannot create the database {}", redact_url(database_url)))?;
        eprintln!("created database {}", redact_url(database_url));
    }
    Ok(())
}

async fn get(pool: &PgPool, id: i64) -> anyhow::Result<admin::JobRow> {
    admin::get(pool, JobId(id)).await.context("cannot read the job")?.ok_or_else(|| anyhow!("job {id} does not exist"))
}

async fn enqueue(pool: &PgPool, args: EnqueueArgs, json: bool) -> anyhow::Result<()> {
    let run_at = match (args.run_at, args.delay) {
        (Some(at), _) => Some(at),
        (None, Some(secs)) => Some(Utc::now() + Duration::from_secs(secs)),
        (None, None) => None,
    };
    let payload = match (&args.lines, args.payload.as_str()) {
        (Some(_), _) => serde_json::Value::Null, // each line's, below
        (None, "-") => parse_payload(&read_input("-")?, || "the payload on standard input".into())?,
        (None, text) => match text.strip_prefix('@') {
            Some(path) => parse_payload(&read_input(path)?, || format!("the payload in {path}"))?,
            None => parse_payload(text, || "PAYLOAD".into())?,
        },
    };
    let job = admin::NewJob {
        kind: args.kind,
        payload,
        queue: args.queue,
        priority: args.priority,
        run_at,
        max_attempts: args.max_attempts,
        group_key: args.group_key,
        dedup_key: args.dedup_key.clone(),
    };
    if let Some(source) = &args.lines {
        return enqueue_lines(pool, &job, source, json).await;
    }
    let mut transaction = pool.begin().await.context("cannot enqueue")?;
    let xid = admin::transaction_id(&mut transaction).await.context("cannot enqueue")?;
    let enqueued = admin::enqueue(&mut *transaction, &job).await.map_err(|error| refused(error, "cannot enqueue"))?;
    match enqueued {
        Some(id) => commit_enqueued(pool, transaction, xid, id, "cannot enqueue").await?,
        None => drop(transaction), // a no-op: its dedup_key is held; nothing to keep, nor to hold open
    }
    let id = match enqueued {
        Some(id) if !args.wait => {
            say(json, &serde_json::json!({"id": id, "enqueued": true}), &format!("enqueued job {id}"));
            return Ok(());
        }
        Some(id) => {
            // stdout is the finished job's: this line there would make --json two documents.
            eprintln!("enqueued job {id}");
            id
        }
        None => {
            let key = args.dedup_key.unwrap_or_default();
            let holder = admin::dedup_holder(pool, &key).await.context("cannot read the job that holds the key")?;
            let text = match holder {
                Some(holder) => format!("not enqueued: job {holder}, unfinished, has dedup_key {key:?}"),
                None => format!("not enqueued: an unfinished job had dedup_key {key:?} (it has finished since)"),
            };
            match (args.wait, holder) {
                (false, _) => {
                    say(json, &serde_json::json!({"id": null, "enqueued": false, "held_by": holder}), &text);
                    return Ok(());
                }
                (true, Some(holder)) => {
                    eprintln!("{text}: waiting for it");
                    holder
                }
                (true, None) => bail!("{text}: enqueue again"),
            }
        }
    };
    wait(pool, id, args.timeout, json).await
}

/// Jobs enqueued together, per statement, at most: a statement's round trip is shared by 1,000
/// rows of small payloads.
const LINES_PER_STATEMENT: usize = 1000;

/// Payload text per statement, at most (a single line longer than this goes alone). 1,000 lines
/// of up to 1 MiB each would bind an array of nearly 1 GiB, the most Postgres takes in one value,
/// and take several times that in memory on both sides once parsed; 8 MiB bounds a statement's
/// payloads at a few tens of MB and still shares a round trip among 1,000 lines of 8 kB.
const BYTES_PER_STATEMENT: usize = 8 << 20;

/// Numbered payload lines (`(index, text)`, blank lines left out), as [`LineSource::lines`]
/// reads them.
type Lines<'a> = Box<dyn Iterator<Item = anyhow::Result<(usize, String)>> + 'a>;

/// `lines` cut into statements of at most [`LINES_PER_STATEMENT`] lines and, unless one line is
/// larger alone, [`BYTES_PER_STATEMENT`] of text. A line that cannot be read ends it, with why.
fn statements(lines: Lines<'_>) -> impl Iterator<Item = anyhow::Result<Vec<(usize, String)>>> + '_ {
    let mut lines = lines.peekable();
    std::iter::from_fn(move || {
        let (mut statement, mut bytes) = (Vec::new(), 0);
        while statement.len() < LINES_PER_STATEMENT {
            if let Some(Ok((_, line))) = lines.peek()
                && !statement.is_empty()
                && bytes + line.len() > BYTES_PER_STATEMENT
            {
                break;
            }
            match lines.next() {
                Some(Ok(line)) => {
                    bytes += line.1.len();
                    statement.push(line);
                }
                Some(Err(error)) => return Some(Err(error)),
                None => break,
            }
        }
        (!statement.is_empty()).then_some(Ok(statement))
    })
}

/// Where `enqueue --lines` reads its lines. A regular file is read twice, its lines checked and
/// then enqueued a statement at a time, and never held whole: a backfill of 5 GB of payloads
/// needs one statement's worth of memory, not 5 GB. Anything else (standard input, a pipe such
/// as `<(zcat jobs.gz)`, which can be read only once) is read whole before the transaction
/// begins: a slow producer then holds no transaction open (which would hold back the cleanup of
/// old row versions).
enum LineSource {
    File(std::fs::File),
    Text(String),
}

impl LineSource {
    fn open(source: &str) -> anyhow::Result<Self> {
        let regular = source != "-" && std::fs::metadata(source).is_ok_and(|meta| meta.is_file());
        if !regular {
            return Ok(LineSource::Text(read_input(source)?));
        }
        Ok(LineSource::File(std::fs::File::open(source).with_context(|| format!("cannot read {source}"))?))
    }

    /// The payload lines, from the start; `name` names the source in errors. A file is read
    /// again through the handle it was opened with: a file renamed over it meanwhile is not read.
    fn lines<'a>(&'a self, name: &'a str) -> anyhow::Result<Lines<'a>> {
        use std::io::{BufRead, Seek};
        let reader: Box<dyn BufRead + 'a> = match self {
            LineSource::File(file) => {
                let mut file: &std::fs::File = file;
                file.rewind().with_context(|| format!("cannot read {name} again"))?;
                Box::new(std::io::BufReader::new(file))
            }
            LineSource::Text(text) => Box::new(text.as_bytes()),
        };
        Ok(Box::new(reader.lines().enumerate().filter_map(move |(index, line)| match line {
            Ok(line) if line.trim().is_empty() => None,
            Ok(line) => Some(Ok((index, line))),
            Err(error) => Some(Err(anyhow!(error).context(format!("cannot read line {} of {name}", index + 1)))),
        })))
    }
}

/// What `enqueue --lines` says first when it enqueued nothing: its lines go in one transaction.
const NONE_ENQUEUED: &str = "cannot enqueue, so none was";

/// `enqueue --lines`: one job like `job` per line of `source`, all in one transaction.
async fn enqueue_lines(pool: &PgPool, job: &admin::NewJob, source: &str, json: bool) -> anyhow::Result<()> {
    let name = if source == "-" { "standard input" } else { source };
    // Every line is checked before the transaction begins: a bad line is found before anything
    // is written. The lines stay text until their statement (a parsed payload takes several
    // times its text's memory).
    let input = LineSource::open(source)?;
    let mut checked = 0;
    for line in input.lines(name)? {
        let (index, line) = line?;
        let what = || format!("line {} of {name}", index + 1);
        // The database refuses a payload that is no object too, but would not say which line.
        if !parse_payload(&line, what)?.is_object() {
            bail!("{} is not a JSON object (a payload must be one): {:?}", what(), clip(&line));
        }
        checked += 1;
    }
    let mut transaction = pool.begin().await.context("cannot enqueue")?;
    let xid = admin::transaction_id(&mut transaction).await.context("cannot enqueue")?;
    let mut ids = Vec::with_capacity(checked);
    for statement in statements(input.lines(name)?) {
        let statement = statement.with_context(|| NONE_ENQUEUED.to_string())?;
        let payloads = statement
            .iter()
            .map(|(index, line)| parse_payload(line, || format!("line {} of {name}", index + 1)))
            .collect::<anyhow::Result<Vec<_>>>()
            .with_context(|| format!("{NONE_ENQUEUED}: {name} changed while it was read"))?;
        match admin::enqueue_many(&mut *transaction, job, &payloads).await {
            Ok(done) => ids.extend(done),
            Err(error) => {
                drop(transaction); // rolled back: nothing of the input is enqueued
                return Err(refused_line(pool, job, &statement, name, error).await);
            }
        }
    }
    if ids.len() != checked {
        bail!(
            "{NONE_ENQUEUED}: {name} changed while it was read ({checked} payload lines checked, then {} read)",
            ids.len()
        );
    }
    match ids.first() {
        Some(&first) => commit_enqueued(pool, transaction, xid, first, NONE_ENQUEUED).await?,
        None => drop(transaction), // nothing written
    }
    let text = match (ids.first(), ids.last()) {
        (Some(first), Some(last)) if first == last => format!("enqueued 1 job (id {first})"),
        (Some(first), Some(last)) => format!("enqueued {} jobs (ids {first} to {last})", ids.len()),
        _ => format!("enqueued 0 jobs: {name} has no payload lines"),
    };
    say(json, &serde_json::json!({"enqueued": ids.len(), "ids": ids}), &text);
    Ok(())
}

/// Why the database refused a statement of `chunk`'s lines, naming the first line it refuses.
///
/// A statement of many rows fails as a whole, and Postgres says which rule a row broke but not
/// which row: a payload over 1 MiB, or holding `\u0000` (which `jsonb` cannot store), in a
/// backfill of 100,000 lines would be a needle to find by hand. So, when the rows' contents were
/// refused, the chunk's lines are enqueued again one at a time, in a transaction rolled back
/// whatever happens, until one is refused. A job of the options alone (`{}` as its payload) is
/// tried first: when that is refused, the options are at fault, not a line.
async fn refused_line(
    pool: &PgPool,
    job: &admin::NewJob,
    chunk: &[(usize, String)],
    name: &str,
    error: sqlx::Error,
) -> anyhow::Error {
    if refusal_of_the_data(&error).is_none() {
        return refused(error, NONE_ENQUEUED);
    }
    let first_refused = async {
        let mut transaction = pool.begin().await?;
        let options_alone = serde_json::Value::Object(serde_json::Map::new());
        if let Err(options) = admin::enqueue_many(&mut *transaction, job, &[options_alone]).await {
            return Ok::<_, sqlx::Error>(Some((None, options)));
        }
        for (index, line) in chunk {
            let Ok(payload) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            if let Err(refusal) = admin::enqueue_many(&mut *transaction, job, &[payload]).await {
                return Ok(Some((Some(*index), refusal)));
            }
        }
        Ok(None)
    };
    match first_refused.await {
        Ok(Some((Some(index), refusal))) => refused(refusal, &format!("{NONE_ENQUEUED}: line {} of {name}", index + 1)),
        Ok(Some((None, refusal))) => refused(refusal, NONE_ENQUEUED),
        // Refused together and not one by one, or the search could not run: what was refused.
        Ok(None) | Err(_) => refused(error, NONE_ENQUEUED),
    }
}

/// How long [`commit_enqueued`] waits for a commit whose answer was lost to end, before it says
/// it cannot tell whether the jobs were enqueued.
const COMMIT_SETTLES_WITHIN: Duration = Duration::from_secs(10);

/// Commits `transaction` (transaction id `xid`), which enqueued jobs from `first` on.
///
/// When the commit's answer is lost (the connection cut, the server shutting down), the client
/// cannot know whether it committed, and "cannot enqueue" would send its user to enqueue again:
/// every job twice, if it had. So the database is asked, on another connection, what became of
/// the transaction, until it has ended. A commit the database refused (a deferred rule, say)
/// enqueued nothing: `refusal`.
async fn commit_enqueued(
    pool: &PgPool,
    transaction: sqlx::Transaction<'_, sqlx::Postgres>,
    xid: i64,
    first: JobId,
    refusal: &str,
) -> anyhow::Result<()> {
    use admin::TransactionStatus::{Aborted, Committed, Forgotten, InProgress};
    let Err(lost) = transaction.commit().await else {
        return Ok(());
    };
    if !answer_lost(&lost) {
        return Err(refused(lost, refusal));
    }
    let deadline = std::time::Instant::now() + COMMIT_SETTLES_WITHIN;
    let ended = loop {
        match admin::transaction_status(pool, xid).await {
            Ok(InProgress) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            status => break status,
        }
    };
    let lost = format!("the answer to the commit was lost ({lost})");
    let unknown = format!("`rowq status {first}` tells whether they were, before you enqueue them again");
    match ended {
        Ok(Committed) => {
            eprintln!("{lost}; transaction {xid} committed all the same: enqueued");
            Ok(())
        }
        Ok(Aborted) => bail!("{refusal}: {lost}, and transaction {xid} was rolled back"),
        Ok(InProgress) => bail!(
            "{lost}, and transaction {xid} is still committing after {} s: {unknown}",
            COMMIT_SETTLES_WITHIN.as_secs()
        ),
        Ok(Forgotten) => bail!("{lost}, and the database no longer knows transaction {xid}: {unknown}"),
        Err(asking) => bail!("{lost}, and the database cannot be asked what became of it ({asking}): {unknown}"),
    }
}

/// Whether a commit failed without the database's answer, or with an answer that says the
/// session ended ([`store::unreachable`]: a lost connection, a shutdown): then it may have
/// committed or not. Any other answer from the database refused it.
fn answer_lost(error: &sqlx::Error) -> bool {
    error.as_database_error().is_none() || store::unreachable(error)
}

/// A time given on the command line: RFC 3339, with its offset. chrono's own parser says only
/// "premature end of input" of `2026-12-01 09:00`, which leaves the user to guess what is missing.
fn a_time(text: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(text).map(|at| at.with_timezone(&Utc)).map_err(|error| {
        format!("not an RFC 3339 time with its offset, as 2026-12-01T09:00:00Z or 2026-12-01T10:00:00+01:00 ({error})")
    })
}

/// All of FILE, or of standard input for `-`.
fn read_input(source: &str) -> anyhow::Result<String> {
    if source == "-" {
        return std::io::read_to_string(std::io::stdin()).context("cannot read standard input");
    }
    std::fs::read_to_string(source).with_context(|| format!("cannot read {source}"))
}

/// A payload's JSON; `what` names where it came from, in the error only (a backfill parses
/// each of its lines twice, and names none that parses). Whether it is an object is the
/// database's rule (`jobs_payload_is_a_json_object`).
fn parse_payload(text: &str, what: impl FnOnce() -> String) -> anyhow::Result<serde_json::Value> {
    serde_json::from_str(text).with_context(|| format!("{} is not valid JSON: {:?}", what(), clip(text)))
}

/// At most the first 80 characters of `text`, for an error line.
fn clip(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

/// A wait whose timeout passed before its job finished: `rowq` exits with [`TIMED_OUT`], as
/// `timeout(1)` does, so that a script can tell it from a job that failed (1).
#[derive(Debug)]
struct StillUnfinished(String);

impl std::fmt::Display for StillUnfinished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StillUnfinished {}

const TIMED_OUT: i32 = 124;

/// The exit code of a command that failed with `error`: 1, or [`TIMED_OUT`] for a wait.
pub fn exit_code(error: &anyhow::Error) -> i32 {
    if error.is::<StillUnfinished>() { TIMED_OUT } else { 1 }
}

/// Waits for job `id` to finish, telling each state it is seen in on stderr (text only), then
/// prints it as `status` does. A job that did not succeed is an error naming why.
async fn wait(pool: &PgPool, id: JobId, timeout: Option<u64>, json: bool) -> anyhow::Result<()> {
    let timeout = timeout.map(Duration::from_secs);
    if !json {
        warn_if_paused(pool, id).await?;
    }
    let waited = admin::wait_finished(pool, id, timeout, |seen| match seen {
        admin::WaitProgress::Seen(row) if !json => eprintln!("job {id} {}", progress(row)),
        admin::WaitProgress::Seen(_) => {}
        admin::WaitProgress::Unreachable(error) => {
            eprintln!("job {id}: the database cannot be reached ({error}); still waiting, reading it again")
        }
        admin::WaitProgress::Reachable => eprintln!("job {id}: the database answers again"),
    })
    .await
    .context("cannot read the job")?;
    let row = match waited {
        admin::Waited::Deleted(_) => {
            bail!(
                "job {id} was deleted while it was waited on (by rowq discard, retention, or by hand): its outcome is gone"
            )
        }
        admin::Waited::Missing => bail!("job {id} does not exist"),
        admin::Waited::Finished(row) | admin::Waited::Unfinished(row) => row,
    };
    if json {
        print_json(&row);
    } else {
        print_row(&row);
    }
    match row.state {
        JobState::Succeeded => Ok(()),
        JobState::Failed => bail!(
            "job {id} failed after {} of {} attempts: {}",
            row.attempts,
            row.max_attempts,
            row.last_error.as_deref().unwrap_or("no error recorded")
        ),
        JobState::Cancelled => bail!("job {id} was cancelled"),
        _ => Err(StillUnfinished(format!(
            "job {id} is still {} after {} s: it goes on; `rowq wait` again or `rowq status`",
            row.state,
            timeout.unwrap_or_default().as_secs()
        ))
        .into()),
    }
}

/// Says so on stderr when job `id` waits in a paused queue: nothing claims it until a resume.
async fn warn_if_paused(pool: &PgPool, id: JobId) -> anyhow::Result<()> {
    let paused = admin::pause_holding(pool, id).await.context("cannot read the job's queue")?;
    if let Some(paused) = paused {
        let reason = paused.reason.as_deref().map(|reason| format!(" ({reason})")).unwrap_or_default();
        eprintln!(
            "queue {} is paused since {}{reason}: job {id} waits until `rowq resume {}`",
            paused.queue,
            paused.paused_at.to_rfc3339(),
            paused.queue
        );
    }
    Ok(())
}

/// A line for the state `row` is seen in while waiting for it.
fn progress(row: &admin::JobRow) -> String {
    let attempt = format!("attempt {} of {}", row.attempts, row.max_attempts);
    match (row.state, &row.last_error) {
        (JobState::Running, _) => format!("running ({attempt})"),
        (JobState::Pending, Some(error)) if row.attempts > 0 => {
            format!("pending: {attempt} failed ({error}); retry at {}", row.run_at.to_rfc3339())
        }
        (JobState::Pending, _) if row.run_at > Utc::now() => format!("pending until {}", row.run_at.to_rfc3339()),
        (state, _) => state.to_string(),
    }
}

/// A refusal by one of the database's rules (class 23: a check, a unique index) as one line,
/// `what` then the rule's message, which names it; any other error keeps its cause after
/// `what`, so that [`behind_schema`] can still find a missing table in it.
fn refused(error: sqlx::Error, what: &str) -> anyhow::Error {
    match refusal_of_the_data(&error) {
        Some(reason) => anyhow!("{what}: the database refused it: {reason}"),
        None => anyhow!(error).context(what.to_string()),
    }
}

/// What the database said, with its detail, when it refused a statement for what it wrote: a
/// broken rule (SQLSTATE class 23, integrity) or a value it cannot take (class 22, data: a
/// `\u0000` in JSON, "unsupported Unicode escape sequence", whose detail names the character).
/// `None` for every other failure: the connection's, say, which says nothing of the data.
fn refusal_of_the_data(error: &sqlx::Error) -> Option<String> {
    const DATA_EXCEPTION: &str = "22";
    const INTEGRITY_CONSTRAINT_VIOLATION: &str = "23";
    let db = error.as_database_error()?;
    let code = db.code()?;
    if !(code.starts_with(DATA_EXCEPTION) || code.starts_with(INTEGRITY_CONSTRAINT_VIOLATION)) {
        return None;
    }
    // A table CHECK's detail is the whole row ("Failing row contains (...)", payload and all).
    let detail = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .and_then(|pg| pg.detail())
        .filter(|detail| !detail.starts_with("Failing row contains"));
    Some(match detail {
        Some(detail) => format!("{} ({})", db.message(), detail.trim_end_matches('.')),
        None => db.message().to_string(),
    })
}

async fn retry(pool: &PgPool, args: RetryArgs, json: bool) -> anyhow::Result<()> {
    let dry_run = args.which.dry_run;
    if let Some(which) = args.which.many() {
        let state = which.of.state();
        let done = admin::retry_many(pool, which, bulk(dry_run)).await.map_err(|e| retry_refused(e, None))?;
        let mut text = if dry_run {
            format!("dry run, nothing changed: {} {state} jobs would go back to pending", done.retried.len())
        } else {
            format!("{} {state} jobs back to pending", done.retried.len())
        };
        if !done.left.is_empty() {
            let named: Vec<String> =
                done.left.iter().map(|left| format!("{} (held by {})", left.id.0, left.held_by.0)).collect();
            text += &format!(
                "; {} {} {state}, as another job holds their dedup_key: {}",
                done.left.len(),
                if dry_run { "would be left" } else { "left" },
                named.join(", ")
            );
        }
        // What a retry leaves is as it was, failed or cancelled: its JSON key says which.
        let mut value = serde_json::Map::new();
        value.insert("retried".into(), serde_json::json!(done.retried));
        value.insert(format!("left_{state}"), serde_json::json!(done.left));
        say(json, &with_dry_run(&value, dry_run), &text);
        return Ok(());
    }
    let id = args.id.unwrap_or_default();
    match admin::retry(pool, JobId(id)).await.map_err(|e| retry_refused(e, Some(id)))? {
        Some(row) => say(json, &row, &format!("job {id} is pending again (attempts reset)")),
        None => {
            let row = get(pool, id).await?;
            bail!("job {id} is {}: only failed or cancelled jobs can be retried", row.state);
        }
    }
    Ok(())
}

async fn discard(pool: &PgPool, args: DiscardArgs, json: bool) -> anyhow::Result<()> {
    let dry_run = args.which.dry_run;
    if let Some(which) = args.which.many() {
        let state = which.of.state();
        let ids = admin::discard_many(pool, which, bulk(dry_run)).await.context("cannot discard")?;
        let text = if dry_run {
            format!("dry run, nothing changed: {} {state} jobs would be deleted", ids.len())
        } else {
            format!("{} {state} jobs deleted", ids.len())
        };
        say(json, &with_dry_run(&serde_json::json!({ "discarded": ids }), dry_run), &text);
        return Ok(());
    }
    let id = args.id.unwrap_or_default();
    match admin::discard(pool, JobId(id)).await.context("cannot discard")? {
        Some(row) => say(json, &row, &format!("job {id} ({}, {}) deleted", row.kind, row.state)),
        None => {
            let row = get(pool, id).await?;
            let why = match row.state {
                JobState::Succeeded => " (a succeeded row goes after ROWQ_RETENTION_HOURS)",
                JobState::Pending | JobState::Dispatched => " (cancel it first if it must not run)",
                _ => "",
            };
            bail!("job {id} is {}: only failed or cancelled jobs can be discarded{why}", row.state);
        }
    }
    Ok(())
}

/// `id` is the job a retry of one named; `None` for a retry of many, which leaves the jobs whose
/// key is held as they were (`admin::retry_many`) and is refused only by a job enqueued
/// meanwhile.
fn retry_refused(error: sqlx::Error, id: Option<i64>) -> anyhow::Error {
    let held = error.as_database_error().and_then(|db| db.constraint()) == Some("jobs_dedup_key_unfinished_idx");
    match id {
        Some(id) if held => anyhow!("job {id} cannot be retried: another unfinished job holds its dedup_key"),
        None if held => anyhow!(
            "nothing was retried: a job enqueued meanwhile holds the dedup_key of one of them; run the retry again"
        ),
        Some(id) => anyhow!(error).context(format!("cannot retry job {id}")),
        None => anyhow!(error).context("cannot retry the failed jobs"),
    }
}

async fn cancel(pool: &PgPool, args: CancelArgs, json: bool) -> anyhow::Result<()> {
    if args.all {
        if args.queue.is_none() && args.kind.is_none() {
            bail!("cancel --all needs --kind or --queue: name what must not run (a queue cancels all its kinds)");
        }
        let ids = admin::cancel_unstarted(pool, args.queue.as_deref(), args.kind.as_deref(), bulk(args.dry_run))
            .await
            .context("cannot cancel")?;
        let text = if args.dry_run {
            format!("dry run, nothing changed: {} pending or dispatched jobs would be cancelled", ids.len())
        } else {
            format!("{} pending or dispatched jobs cancelled", ids.len())
        };
        say(json, &with_dry_run(&serde_json::json!({ "cancelled": ids }), args.dry_run), &text);
        return Ok(());
    }
    let id = args.id.unwrap_or_default();
    match admin::cancel(pool, JobId(id)).await.context("cannot cancel")? {
        Some(row) => say(json, &row, &format!("job {id} cancelled")),
        None => {
            let row = get(pool, id).await?;
            match row.state {
                JobState::Running => {
                    bail!("job {id} is running (attempt {}): it cannot be cancelled now", row.attempts)
                }
                state => bail!("job {id} is already {state}: nothing to cancel"),
            }
        }
    }
    Ok(())
}

fn bulk(dry_run: bool) -> admin::Bulk {
    if dry_run { admin::Bulk::DryRun } else { admin::Bulk::Apply }
}

/// A bulk command's JSON, with `"dry_run": true` when nothing was changed.
fn with_dry_run<T: Serialize>(done: &T, dry_run: bool) -> serde_json::Value {
    let mut value = serde_json::to_value(done).unwrap_or_default();
    if let (true, Some(object)) = (dry_run, value.as_object_mut()) {
        object.insert("dry_run".into(), true.into());
    }
    value
}

async fn pause(pool: &PgPool, args: PauseArgs, json: bool) -> anyhow::Result<()> {
    let Some(queue) = args.queue else {
        let paused = admin::paused_queues(pool).await.context("cannot read the paused queues")?;
        if json {
            print_json(&paused);
        } else if paused.is_empty() {
            println!("no queue is paused");
        } else {
            paused.iter().for_each(|queue| println!("{}", paused_line(queue)));
        }
        return Ok(());
    };
    let done = admin::pause(pool, &queue, args.reason.as_deref())
        .await
        .map_err(|error| refused(error, &format!("cannot pause queue {queue:?}")))?;
    let text = if done.already {
        format!("{} (already)", paused_line(&done.queue))
    } else {
        format!("{}: no job of it is claimed until `rowq resume {queue}`", paused_line(&done.queue))
    };
    say(json, &done, &text);
    Ok(())
}

async fn resume(pool: &PgPool, queue: &str, json: bool) -> anyhow::Result<()> {
    let resumed = admin::resume(pool, queue).await.with_context(|| format!("cannot resume queue {queue:?}"))?;
    let text = match &resumed {
        Some(was) => format!("queue {queue} resumed, after {}", since(was.paused_at)),
        None => {
            // A typo resumes nothing: name what is paused.
            let paused = admin::paused_queues(pool).await.context("cannot read the paused queues")?;
            let names: Vec<&str> = paused.iter().map(|p| p.queue.as_str()).collect();
            if names.is_empty() {
                format!("queue {queue} was not paused; no queue is")
            } else {
                format!("queue {queue} was not paused; paused: {}", names.join(", "))
            }
        }
    };
    say(json, &serde_json::json!({ "queue": queue, "resumed": resumed.is_some() }), &text);
    Ok(())
}

/// `queue emails paused since 2026-12-06T15:00:00Z (3 min ago): SMTP provider down`.
fn paused_line(paused: &admin::PausedQueue) -> String {
    let reason = paused.reason.as_deref().map_or(String::new(), |reason| format!(": {reason}"));
    format!(
        "queue {} paused since {} ({} ago){reason}",
        paused.queue,
        paused.paused_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        since(paused.paused_at)
    )
}

/// How long ago `at` was, as the cleanup warning says how long a transaction has been open.
fn since(at: DateTime<Utc>) -> String {
    store::maintenance::span((Utc::now() - at).num_milliseconds() as f64 / 1000.0)
}

async fn stats(pool: &PgPool, json: bool) -> anyhow::Result<()> {
    let stats = admin::stats(pool).await.context("cannot read stats")?;
    if json {
        print_json(&stats);
        return Ok(());
    }
    println!("{:<16} {:<11} {:>10}", "QUEUE", "STATE", "JOBS");
    for count in &stats.counts {
        println!("{:<16} {:<11} {:>10}", count.queue, count.state, count.count);
    }
    match stats.oldest_pending_secs {
        Some(secs) => println!("oldest due pending job: {secs:.1} s"),
        None => println!("no due pending jobs"),
    }
    for behind in &stats.behind_group {
        println!(
            "{}: {} pending jobs wait behind an unfinished earlier job of their group (rowq list --group-key KEY)",
            behind.queue, behind.count
        );
    }
    println!(
        "finished in the last minute: {} ({:.1}/s)",
        stats.finished_last_minute,
        stats.finished_last_minute as f64 / 60.0
    );
    if !stats.failed_last_hour.is_empty() {
        let kinds: Vec<String> = stats.failed_last_hour.iter().map(|k| format!("{} {}", k.kind, k.count)).collect();
        println!("failed in the last hour, by kind: {} (rowq list --state failed --kind KIND)", kinds.join(", "));
    }
    for paused in &stats.paused {
        println!("{}", paused_line(paused));
    }
    for holder in &stats.cleanup_held_by {
        println!(
            "cleanup held back by {holder}: finished jobs' row versions stay until it ends, and claims slow down \
             (README: \"Long transactions\")"
        );
    }
    Ok(())
}

async fn create_queues(args: &QueueArgs, json: bool) -> anyhow::Result<()> {
    let client = sqs::client().await;
    let pair = sqs::ensure_queues(&client, &queue_spec(args)).await.context("cannot create the queues")?;
    if json {
        print_json(&serde_json::json!({
            "queue_url": pair.queue_url, "queue_arn": pair.queue_arn, "dlq_url": pair.dlq_url, "dlq_arn": pair.dlq_arn,
        }));
    } else {
        println!("ROWQ_QUEUE_URL={}", pair.queue_url);
        println!("ROWQ_DLQ_URL={}", pair.dlq_url);
    }
    Ok(())
}

async fn show_queues(args: &QueueArgs, json: bool) -> anyhow::Result<()> {
    let client = sqs::client().await;
    let mut depths = serde_json::Map::new();
    for name in [format!("{}.fifo", args.name), format!("{}-dlq.fifo", args.name)] {
        let url = sqs::queue_url(&client, &name).await.with_context(|| format!("cannot find queue {name}"))?;
        let depth = sqs::queue_depth(&client, &url).await?;
        if !json {
            println!("{name}: {} waiting, {} in flight", depth.visible, depth.in_flight);
        }
        depths.insert(name, serde_json::json!(depth));
    }
    if json {
        print_json(&depths);
    }
    Ok(())
}

pub fn queue_spec(args: &QueueArgs) -> QueueSpec {
    QueueSpec {
        name: args.name.clone(),
        max_receive_count: args.max_receive_count,
        visibility_timeout: Duration::from_secs(6 * args.function_timeout),
    }
}

fn say<T: Serialize>(json: bool, value: &T, text: &str) {
    if json {
        print_json(value);
    } else {
        println!("{text}");
    }
}

fn print_json<T: Serialize>(value: &T) {
    match serde_json::to_string_pretty(value) {
        Ok(text) => println!("{text}"),
        Err(error) => eprintln!("rowq: cannot print JSON: {error}"),
    }
}

fn print_row(row: &admin::JobRow) {
    let time = |t: Option<DateTime<Utc>>| t.map_or("-".to_string(), |t| t.to_rfc3339());
    println!("job {}  {}  ({} in queue {})", row.id, row.state, row.kind, row.queue);
    println!("  attempts      {} of {}", row.attempts, row.max_attempts);
    println!("  priority      {}", row.priority);
    println!("  run_at        {}", row.run_at.to_rfc3339());
    println!("  dispatch_gen  {}", row.dispatch_gen);
    if let Some(key) = &row.group_key {
        println!("  group_key     {key}");
    }
    if let Some(key) = &row.dedup_key {
        println!("  dedup_key     {key}");
    }
    println!("  created_at    {}", row.created_at.to_rfc3339());
    println!("  started_at    {}", time(row.started_at));
    println!("  finished_at   {}", time(row.finished_at));
    println!("  payload       {}", row.payload);
    if let Some(result) = &row.result {
        println!("  result        {result}");
    }
    if let Some(error) = &row.last_error {
        println!("  last_error    {error}");
    }
    if let Some(history) = row.errors.as_array().filter(|h| !h.is_empty()) {
        println!("  errors:");
        for entry in history {
            println!(
                "    attempt {} at {}: {}",
                entry["attempt"],
                entry["at"].as_str().unwrap_or("?"),
                entry["error"].as_str().unwrap_or("?")
            );
        }
    }
}

fn print_table(rows: &[admin::JobRow]) {
    println!(
        "{:>8} {:<12} {:<20} {:<10} {:>8} {:<25} LAST ERROR",
        "ID", "QUEUE", "KIND", "STATE", "ATTEMPTS", "RUN AT"
    );
    for row in rows {
        let error: String = row.last_error.as_deref().unwrap_or("").chars().take(60).collect();
        println!(
            "{:>8} {:<12} {:<20} {:<10} {:>8} {:<25} {}",
            row.id,
            row.queue,
            row.kind,
            row.state,
            format!("{}/{}", row.attempts, row.max_attempts),
            row.run_at.format("%Y-%m-%d %H:%M:%S%.3f"),
            error
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(lines: &[(usize, &str)]) -> Vec<Vec<(usize, String)>> {
        let lines = lines.iter().map(|(n, line)| Ok((*n, line.to_string()))).collect::<Vec<_>>();
        statements(Box::new(lines.into_iter())).collect::<anyhow::Result<_>>().unwrap()
    }

    fn sizes_of(lines: &[(usize, &str)]) -> Vec<(usize, usize)> {
        cut(lines).iter().map(|statement| (statement.len(), statement.iter().map(|(_, l)| l.len()).sum())).collect()
    }

    #[test]
    fn lines_go_in_statements_of_at_most_1000_lines_and_8_mib_unless_one_line_is_larger() {
        let small: Vec<(usize, &str)> = (0..2500).map(|n| (n, "{}")).collect();
        assert_eq!(sizes_of(&small), [(1000, 2000), (1000, 2000), (500, 1000)]);
        let mib = format!("{{\"pad\":\"{}\"}}", "x".repeat((1 << 20) - 10));
        let large: Vec<(usize, &str)> = (0..20).map(|n| (n, mib.as_str())).collect();
        let sizes = sizes_of(&large);
        assert_eq!(sizes.iter().map(|(lines, _)| lines).collect::<Vec<_>>(), [&8, &8, &4], "{sizes:?}");
        assert!(sizes.iter().all(|(_, bytes)| *bytes <= BYTES_PER_STATEMENT), "{sizes:?}");
        let huge = "x".repeat(BYTES_PER_STATEMENT + 1);
        let alone = [(0, "{}"), (1, huge.as_str()), (2, "{}")];
        assert_eq!(sizes_of(&alone), [(1, 2), (1, huge.len()), (1, 2)], "a line over the limit goes alone");
        let in_order: Vec<usize> = cut(&small).into_iter().flatten().map(|(n, _)| n).collect();
        assert_eq!(in_order, (0..2500).collect::<Vec<_>>());
        assert!(cut(&[]).is_empty());
    }

    #[test]
    fn a_line_that_cannot_be_read_ends_the_statements_naming_it() {
        let text = LineSource::Text("{}\n\n  \n{\"n\":4}\n".to_string());
        let lines: Vec<(usize, String)> = text.lines("t").unwrap().collect::<anyhow::Result<_>>().unwrap();
        assert_eq!(lines, [(0, "{}".to_string()), (3, "{\"n\":4}".to_string())], "blank lines are left out, counted");
        let file = std::env::temp_dir().join(format!("rowq-unreadable-{}.jsonl", std::process::id()));
        std::fs::write(&file, b"{}\n{\"a\":\"\xff\"}\n{}\n").unwrap();
        let source = LineSource::open(&file.to_string_lossy()).unwrap();
        let mut statements = statements(source.lines("f").unwrap());
        let error = statements.next().unwrap().unwrap_err();
        assert!(format!("{error:#}").starts_with("cannot read line 2 of f: "), "{error:#}");
        std::fs::remove_file(&file).unwrap();
    }
}
