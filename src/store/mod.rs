//! Every SQL statement of rowq lives here: one function per state transition, each a single
//! guarded `UPDATE ... RETURNING`. A transition that matches no row lost a race to another
//! actor (a second scheduler, a duplicate message, a rescue): it returns `None` or an empty
//! list, never an error.
//!
//! - [`dispatch`]: claim due rows, release the ones whose publish failed, what to wait for.
//! - [`run`]: the worker's fence (`start`), its `finish`, and the DLQ's `dead_letter`.
//! - [`maintenance`]: rescue of stuck rows, pruning of finished ones.
//! - [`admin`]: enqueue, read, list, cancel, retry, stats (the CLI and tests).
//! - [`kept`]: the connections a busy worker keeps between its statements.

/// The claim's test of a pending row `j`: no earlier job of its `group_key` is unfinished, so
/// the group runs one at a time, in id order, even across retries. One text for the claim
/// ([`dispatch::CLAIM_SQL`]) and the gauge of what a claim would take
/// ([`admin::queue_gauges`]), so that the gauge cannot drift from the claim.
macro_rules! first_of_its_group {
    () => {
        "(j.group_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM rowq.jobs earlier
                    WHERE earlier.group_key = j.group_key
                      AND earlier.id < j.id
                      AND earlier.state IN ('pending', 'dispatched', 'running')))"
    };
}
pub(crate) use first_of_its_group;

pub mod admin;
pub mod dispatch;
pub mod kept;
pub mod maintenance;
pub mod run;
mod types;

use std::sync::LazyLock;
use std::time::Duration;

use sqlx::SqlStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgExecutor, PgPool};

use crate::config::DatabaseConfig;

/// The schema migrations, embedded in the binary: what `sqlx::migrate!("./migrations")` would
/// embed, listed by hand because that macro lives in sqlx's proc-macro crate (`types` says why
/// rowq has none). A test checks this list against the directory.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    Migrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                // As sqlx's own loader reads the directive: such a file runs outside a transaction.
                let no_transaction = sql.starts_with("-- no-transaction");
                Migration::new(
                    version,
                    description.into(),
                    MigrationType::Simple,
                    SqlStr::from_static(sql),
                    no_transaction,
                )
            })
            .collect(),
    )
});

/// Version, description and SQL of each file of `migrations/`, named `<version>_<description>.sql`
/// with the description's spaces written as underscores.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (20261130000001, "jobs", include_str!("../../migrations/20261130000001_jobs.sql")),
    (20261130000002, "checks on write", include_str!("../../migrations/20261130000002_checks_on_write.sql")),
    (20261204000003, "rules as domains", include_str!("../../migrations/20261204000003_rules_as_domains.sql")),
    (20261206000004, "paused queues", include_str!("../../migrations/20261206000004_paused_queues.sql")),
    (20261206000005, "failed rows index", include_str!("../../migrations/20261206000005_failed_rows_index.sql")),
    (20261206000006, "done rows index", include_str!("../../migrations/20261206000006_done_rows_index.sql")),
    (20261207000007, "behind group", include_str!("../../migrations/20261207000007_behind_group.sql")),
    (20261207000008, "group statistics", include_str!("../../migrations/20261207000008_group_statistics.sql")),
    (20261207000009, "claimable index", include_str!("../../migrations/20261207000009_claimable_index.sql")),
    (20261207000010, "behind group index", include_str!("../../migrations/20261207000010_behind_group_index.sql")),
    (20261207000011, "set aside at insert", include_str!("../../migrations/20261207000011_set_aside_at_insert.sql")),
];

/// The channel the insert trigger notifies (one notification per inserting statement).
pub const NOTIFY_CHANNEL: &str = "rowq_jobs";

/// Wakes the waiting schedulers, as an insert does, where rows may have become claimable
/// without one, after the statement that made them so has committed: a group's head finished
/// (`why` = `group`), a rescue put rows back to `pending` (`rescued`). A scheduler that is not
/// listening finds the rows at its next poll.
///
/// The notification is a transaction of its own, committed asynchronously (`synchronous_commit`
/// off for it alone): a transaction that notifies takes an id and writes a commit record, and it
/// holds the server's notification lock, one for every database, from before its commit until
/// after it, so that notifications queue in commit order. Waiting for its flush held up every
/// other notifying commit meanwhile, each enqueue's among them (the insert trigger's), and the
/// wake itself, for a transaction that writes nothing: lost in a crash, it is a wake-up lost,
/// and the schedulers poll. The listeners read it as soon as it commits, flushed or not.
pub async fn wake_schedulers(pool: &PgPool, why: &str) -> Result<(), sqlx::Error> {
    sqlx::query(WAKE_SQL).bind(NOTIFY_CHANNEL).bind(why).execute(pool).await.map(|_| ())
}

/// The statement of [`wake_schedulers`] (public so that a test can run it inside a transaction).
pub const WAKE_SQL: &str = "SELECT pg_notify($1, $2), set_config('synchronous_commit', 'off', true)";

/// [`wake_schedulers`] inside `transaction`: the notification goes out when it commits (as it
/// commits, synchronously or not), and not at all if it rolls back. For an operator's
/// transition that made rows claimable: a retried job is due at once, a group's next job may go
/// once its head is cancelled.
pub async fn wake_schedulers_at_commit(transaction: &mut sqlx::PgConnection, why: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)").bind(NOTIFY_CHANNEL).bind(why).execute(transaction).await.map(|_| ())
}

/// Opens a pool of `session`'s connections ([`connect_scheduler`] opens the scheduler's).
/// Statement logging is turned down: a per-query info line would drown the transition log lines
/// and could leak values.
pub async fn connect(config: &DatabaseConfig, session: Session) -> Result<PgPool, sqlx::Error> {
    pool_options(config).connect_with(session_options(&config.url, session)?).await
}

/// Opens the scheduler's pool: [`connect`], with the session settings of [`SCHEDULER_SESSION`].
///
/// Every statement is planned once per connection. Postgres replans a prepared statement on
/// every execution when it judges the plan for the actual parameters cheaper than the generic
/// one, and it judges so for the claim (its group test is a correlated subquery): 0.6 to 1.3 ms
/// of planning on every claim, on the pickup path of every job, for the same plan each time.
///
/// And no statement reads the whole table. On a small table — a quiet queue, the first
/// thousand jobs — the planner judged a sequential scan cheaper than the primary key for the
/// claim's `UPDATE`: every claim read every row, finished ones included, which was half of a
/// one-job claim's execution (0.20 against 0.11 ms on a table of 1,000 finished rows) and grew
/// with the table until the planner changed its mind. Every statement the scheduler runs is
/// written so that its rows are found by primary key or by a partial index of their state
/// (`tests/plans.rs` checks the generic plans, on a small table and on a deep one), so turning
/// sequential scans off takes nothing away from it: the planner still scans where there is no
/// other way, and here there always is.
///
/// And no statement is compiled by LLVM (`jit = off`). The generic claim's estimated cost grows
/// with the backlog the last analyze saw (its `LIMIT` is a parameter): past `jit_above_cost`
/// (100,000; a backlog of ~200,000 jobs), Postgres compiled the claim at every execution, 15 ms
/// of a 16 ms claim of 100 rows on Debian's PostgreSQL 15, when the backlog was deepest. Every
/// statement here finds its rows by index and returns at most a batch: compiling never pays.
/// Not for pools that run user code: a handler's queries may need plans per parameter and
/// sequential scans.
pub async fn connect_scheduler(config: &DatabaseConfig) -> Result<PgPool, sqlx::Error> {
    pool_options(config).connect_with(session_options(&config.url, Session::Scheduler)?).await
}

/// Whose a pool's sessions are: what each names itself to the server, and the settings it runs
/// with (the scheduler's are [`SCHEDULER_SESSION`]; the others run with the server's).
///
/// Each session is named for its part and rowq's version ([`Session::application_name`]): what
/// `pg_stat_activity` shows, and `rowq stats` when it names what holds back the cleanup of old
/// row versions. A DBA counting connections (a worker's pool per Lambda instance adds up) or
/// looking for the session that holds a lock sees which are rowq's, and of which release: whether
/// a binary older than a migration is still connected, before a release drops what only such a
/// binary reads (README, "How it maps to AWS"). A URL that names its sessions itself
/// (`?application_name=...`, or `PGAPPNAME`) keeps its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Session {
    /// The worker's: a Lambda, `rowq work`, `rowq dev`.
    Worker,
    /// The dead-letter handler's Lambda.
    DlqHandler,
    /// The `rowq` CLI's own statements.
    Cli,
    /// The scheduler's ([`connect_scheduler`]).
    Scheduler,
}

impl Session {
    /// `rowq <part> <version>`: `rowq worker 0.1.0`.
    pub fn application_name(self) -> String {
        let part = match self {
            Session::Worker => "worker",
            Session::DlqHandler => "dlq-handler",
            Session::Cli => "cli",
            Session::Scheduler => "scheduler",
        };
        format!("rowq {part} {}", env!("CARGO_PKG_VERSION"))
    }
}

/// The options with which a pool of `session` connects to `url`; what
/// [`crate::secret::follow`] gives a pool when the database secret changes.
pub fn session_options(url: &str, session: Session) -> Result<PgConnectOptions, sqlx::Error> {
    let mut options = url
        .parse::<PgConnectOptions>()?
        .log_statements(log::LevelFilter::Debug)
        .log_slow_statements(log::LevelFilter::Warn, Duration::from_secs(1));
    if options.get_application_name().is_none() {
        options = options.application_name(&session.application_name());
    }
    Ok(match session {
        Session::Scheduler => options.options(SCHEDULER_SESSION),
        Session::Worker | Session::DlqHandler | Session::Cli => options,
    })
}

/// The session settings of [`connect_scheduler`]'s connections (its listener's included: the
/// claim runs on it).
pub const SCHEDULER_SESSION: [(&str, &str); 3] =
    [("plan_cache_mode", "force_generic_plan"), ("enable_seqscan", "off"), ("jit", "off")];

/// A pool that connects on first use: a Lambda cold start does not fail when the database is
/// briefly unreachable; the batches fail instead and SQS redelivers them.
pub fn connect_lazy(config: &DatabaseConfig, session: Session) -> Result<PgPool, sqlx::Error> {
    Ok(pool_options(config).connect_lazy_with(session_options(&config.url, session)?))
}

/// A connection idle for longer than this is tested (one round trip) before it is handed out.
pub const IDLE_BEFORE_PING: Duration = Duration::from_secs(5);

/// sqlx tests every connection with a round trip before handing it out, and again when it
/// comes back. The second test already catches a connection that broke while in use; the
/// first one is kept only for connections that sat idle long enough for the server, a proxy
/// or a NAT to have dropped them. A busy worker or scheduler thus saves a round trip per
/// statement (one of three), and the pickup path of a job, which goes through the claim and
/// the fence, saves two. A connection that broke within the idle window fails its statement
/// once, as it would have failed mid-batch: the caller's retry path (the scheduler's next
/// pass, SQS redelivery) handles it, and sqlx drops the connection when it comes back.
fn pool_options(config: &DatabaseConfig) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(config.pool_size)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(false)
        .before_acquire(|connection, meta| {
            Box::pin(async move {
                if meta.idle_for >= IDLE_BEFORE_PING {
                    connection.ping().await?;
                }
                Ok(true)
            })
        })
}

/// Applies the embedded migrations (idempotent), then repairs any index of the schema left
/// invalid by an interrupted build.
///
/// An index built `CONCURRENTLY` (migrations 5 and 6) whose build fails or is cancelled stays,
/// invalid: Postgres keeps it up to date but plans no statement with it. The migration is not
/// recorded, and its next run skips the existing name (`IF NOT EXISTS`). So each run of this
/// ends by rebuilding, also concurrently, whatever index of `rowq` is invalid; and by dropping
/// what an interrupted rebuild leaves (Postgres's `_ccnew` and `_ccold` indexes), as Postgres's
/// documentation of `REINDEX CONCURRENTLY` says to. One process repairs at a time (an advisory
/// lock): two schedulers starting together would otherwise rebuild each other's `_ccnew`.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let (number, version): (String, String) =
        sqlx::query_as("SELECT current_setting('server_version_num'), current_setting('server_version')")
            .fetch_one(pool)
            .await?;
    if let Some(refusal) = unsupported_server(&number, &version) {
        return Err(sqlx::Error::Configuration(refusal.into()).into());
    }
    MIGRATOR.run(pool).await?;
    if invalid_indexes(pool).await?.is_empty() {
        return Ok(()); // as nearly always: no lock taken
    }
    // A connection of its own, closed at the end: the session's lock goes with it, whatever fails.
    let mut connection = pool.acquire().await?.detach();
    sqlx::query("SELECT pg_advisory_lock(hashtext($1))").bind(INDEX_REPAIR_LOCK).execute(&mut connection).await?;
    for index in invalid_indexes(&mut connection).await? {
        let base = index.trim_end_matches('"').trim_end_matches(|c: char| c.is_ascii_digit());
        let statement = if base.ends_with("_ccnew") || base.ends_with("_ccold") {
            tracing::warn!(%index, "dropping what an interrupted index rebuild left");
            format!("DROP INDEX CONCURRENTLY IF EXISTS {index}")
        } else {
            tracing::warn!(%index, "rebuilding an index whose build was interrupted");
            format!("REINDEX INDEX CONCURRENTLY {index}")
        };
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&mut connection).await?;
    }
    connection.close().await?;
    Ok(())
}

/// The oldest Postgres rowq runs on, as `server_version_num`: [`migrate`]'s repair uses
/// `REINDEX INDEX CONCURRENTLY`, new in 12. Every test runs on 14 to 18 (`make test-postgres`).
pub const MIN_SERVER_VERSION_NUM: u32 = 120_000;

/// Why a server of `server_version_num` `number` (`server_version` `version`) cannot hold rowq's
/// schema, or `None` when it can. [`migrate`] asks before any migration runs: on an older server
/// the first sign would otherwise be a syntax error in the middle of the schema.
pub fn unsupported_server(number: &str, version: &str) -> Option<String> {
    match number.trim().parse::<u32>() {
        Ok(number) if number >= MIN_SERVER_VERSION_NUM => None,
        _ => Some(format!(
            "rowq needs PostgreSQL {} or later; this server is {version}",
            MIN_SERVER_VERSION_NUM / 10_000
        )),
    }
}

/// The advisory lock, by `hashtext`, that [`migrate`] repairs indexes under.
const INDEX_REPAIR_LOCK: &str = "rowq: index repair";

/// The indexes of schema `rowq` that Postgres does not plan with, as quoted qualified names.
pub async fn invalid_indexes<'e>(executor: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_index i
         JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'rowq' AND NOT i.indisvalid ORDER BY 1",
    )
    .fetch_all(executor)
    .await
}

/// Whether `error` says the database could not be reached, or went away, rather than that it
/// refused a statement: the connection refused, lost or timed out, no connection to be had in
/// time, the server shutting down, restarting or not yet accepting connections (SQLSTATE
/// classes 08 and 57P), or out of connection slots (53300). What a failover or a restart looks
/// like to a client, for a while; a client that can wait, reads again.
pub fn unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) | sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => {
            db.code().is_some_and(|code| code.starts_with("08") || code.starts_with("57P") || code == "53300")
        }
        _ => false,
    }
}

/// Milliseconds as the `bigint` the SQL statements take for intervals.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::unsupported_server;

    #[test]
    fn a_server_older_than_postgres_12_is_refused_by_name() {
        assert_eq!(
            unsupported_server("110022", "11.22 (Debian 11.22-1)").as_deref(),
            Some("rowq needs PostgreSQL 12 or later; this server is 11.22 (Debian 11.22-1)")
        );
        assert_eq!(unsupported_server("120000", "12.0"), None);
        assert_eq!(unsupported_server("150019", "15.19"), None);
        assert_eq!(unsupported_server("180001", "18.1"), None);
        assert!(unsupported_server("", "?").is_some(), "a version it cannot read is not taken as new enough");
    }
}
