//! Every SQL statement of rowq lives here: one function per state transition, each a single
//! guarded `UPDATE ... RETURNING`. A transition that matches no row lost a race to another
//! actor (a second scheduler, a duplicate message, a rescue): it returns `None` or an empty
//! list, never an error.
//!
//! - [`dispatch`]: claim due rows, release the ones whose publish failed, what to wait for.
//! - [`run`]: the worker's fence (`start`), its `finish`, and the DLQ's `dead_letter`.
//! - [`maintenance`]: rescue of stuck rows, pruning of finished ones.
//! - [`admin`]: enqueue, read, list, cancel, retry, stats (the CLI and tests).

pub mod admin;
pub mod dispatch;
pub mod maintenance;
pub mod run;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use crate::config::DatabaseConfig;

/// The schema migrations, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The channel the insert trigger notifies (one notification per inserting statement).
pub const NOTIFY_CHANNEL: &str = "rowq_jobs";

/// Opens a pool. Statement logging is turned down: a per-query info line would drown the
/// transition log lines and could leak values.
pub async fn connect(config: &DatabaseConfig) -> Result<PgPool, sqlx::Error> {
    pool_options(config).connect_with(connect_options(config)?).await
}

/// A pool that connects on first use: a Lambda cold start does not fail when the database is
/// briefly unreachable; the batches fail instead and SQS redelivers them.
pub fn connect_lazy(config: &DatabaseConfig) -> Result<PgPool, sqlx::Error> {
    Ok(pool_options(config).connect_lazy_with(connect_options(config)?))
}

fn connect_options(config: &DatabaseConfig) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(config
        .url
        .parse::<PgConnectOptions>()?
        .log_statements(log::LevelFilter::Debug)
        .log_slow_statements(log::LevelFilter::Warn, Duration::from_secs(1)))
}

fn pool_options(config: &DatabaseConfig) -> PgPoolOptions {
    PgPoolOptions::new().max_connections(config.pool_size).acquire_timeout(Duration::from_secs(10))
}

/// Applies the embedded migrations (idempotent).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// Milliseconds as the `bigint` the SQL statements take for intervals.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
