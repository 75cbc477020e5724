//! The database URL from AWS Secrets Manager, read at cold start when
//! `ROWQ_DATABASE_SECRET_ARN` is set instead of `DATABASE_URL` (the deployed Lambdas), and read
//! again when the database refuses a login ([`follow`]): a rotated secret.
//!
//! The secret may hold a URL (`postgres://...`), a JSON object with a `url`, or the JSON that
//! RDS writes for a managed secret (`username`, `password`, `host`, `port`, `dbname`).

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use serde::Deserialize;
use sqlx::PgPool;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::config::DatabaseConfig;
use crate::store::{self, Session};

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the database secret {arn}: {detail}")]
    Read { arn: String, detail: String },
    #[error("the database secret {arn} holds neither a postgres:// URL nor JSON with url or username/password/host")]
    Format { arn: String },
}

/// Fills `database.url` from the secret when one is configured; otherwise leaves it alone.
pub async fn resolve(database: &mut DatabaseConfig) -> Result<(), SecretError> {
    if let Some(arn) = &database.secret_arn {
        database.url = read(arn).await?;
    }
    Ok(())
}

/// The database URL secret `arn` holds now.
async fn read(arn: &str) -> Result<String, SecretError> {
    let config = crate::sqs::aws_config().load().await;
    let client = aws_sdk_secretsmanager::Client::new(&config);
    let output = client.get_secret_value().secret_id(arn).send().await.map_err(|e| SecretError::Read {
        arn: arn.to_string(),
        detail: aws_sdk_secretsmanager::error::DisplayErrorContext(e).to_string(),
    })?;
    let text = output.secret_string().ok_or_else(|| SecretError::Format { arn: arn.to_string() })?;
    url_from_secret(text).ok_or_else(|| SecretError::Format { arn: arn.to_string() })
}

/// A login the database refused, as [`note`] heard of it; [`follow`] waits on it.
static LOGIN_REFUSED: Notify = Notify::const_new();

/// The least time between two reads of the secret by [`follow`]: a database that refuses every
/// login, with a secret that does not change, costs a read every 10 s, not one per statement.
pub const REREAD_AT_MOST_EVERY: Duration = Duration::from_secs(10);

/// What [`follow`] has read so far, for [`renewed`] to wait on: set by the first `follow` of a
/// process that has a secret to follow.
static READS: OnceLock<watch::Sender<Reads>> = OnceLock::new();

#[derive(Clone, Copy, Default)]
struct Reads {
    /// How many times the secret was read again.
    count: u64,
    /// When a read last gave the pools a new URL.
    changed_at: Option<Instant>,
}

/// How long [`renewed`] waits for the secret to be read again. A read takes tens of
/// milliseconds; a follower that read it less than [`REREAD_AT_MOST_EVERY`] ago reads again
/// only then, and the statement is better handed back than held that long.
pub const RENEWAL_WAIT: Duration = Duration::from_secs(5);

/// Whether `error` is a login the database refused (SQLSTATE class 28: a password or a user
/// that no longer works). It comes only from opening a connection: no statement ran.
pub(crate) fn login_refused(error: &sqlx::Error) -> bool {
    error.as_database_error().and_then(|db| db.code()).is_some_and(|code| code.starts_with("28"))
}

/// Tells [`follow`] that the database refused a login if `error` says so. Every place that
/// meets the database's errors in a long-lived process (the worker's statements, the
/// scheduler's passes, maintenance and listener, the DLQ handler) passes them here; without a
/// secret to follow, it does nothing.
pub fn note(error: &sqlx::Error) {
    if login_refused(error) {
        LOGIN_REFUSED.notify_one();
    }
}

/// Whether `error` is a refused login after which the pools were given a new URL: [`follow`]
/// changed it less than [`REREAD_AT_MOST_EVERY`] ago, or it reads the secret again now (within
/// [`RENEWAL_WAIT`]) and finds another URL there. Without a secret to follow, false.
pub async fn renewed(error: &sqlx::Error) -> bool {
    if !login_refused(error) {
        return false;
    }
    let Some(reads) = READS.get() else {
        return false;
    };
    let mut reads = reads.subscribe();
    let before = *reads.borrow_and_update();
    if before.changed_at.is_some_and(|at| at.elapsed() < REREAD_AT_MOST_EVERY) {
        return true; // this login may have been tried before the change: try the new URL first
    }
    LOGIN_REFUSED.notify_one();
    match tokio::time::timeout(RENEWAL_WAIT, reads.wait_for(|read| read.count > before.count)).await {
        Ok(Ok(read)) => read.changed_at != before.changed_at,
        Ok(Err(_)) | Err(_) => false,
    }
}

/// Runs `statement`, and once more if the database refused its login and the secret, read
/// again, holds a new URL ([`renewed`]): the statement never ran, so it is safe to run again.
///
/// A refused login used to fail what needed a new connection until the next try: a Lambda
/// worker handed its batch back, and SQS redelivered it only when its visibility timeout ended
/// (minutes), holding the batch's FIFO groups meanwhile; a handler's transaction failed its
/// attempt. Used where the batch or attempt would otherwise fail: the worker's fences and
/// finishes, the job's own transaction, the DLQ handler's statements. A scheduler's pass is
/// simply tried again.
pub async fn once_more_if_rotated<T, F, Fut>(mut statement: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    match statement().await {
        Err(error) if renewed(&error).await => statement().await,
        done => done,
    }
}

/// Keeps `pools` connecting with the URL the database secret holds, when `database` names one.
///
/// Read only at start, a secret was kept for the life of the process: once it was rotated (RDS
/// rotates a managed master user's password every 7 days unless told otherwise), the old
/// password kept working on the connections already open and on no new one, so a warm Lambda or
/// a scheduler service failed every statement that needed a new connection until it was
/// replaced: the worker's batches, the DLQ handler's, the scheduler's passes, all of them. Now
/// each login the database refuses ([`note`]) has the secret read again (at most every
/// [`REREAD_AT_MOST_EVERY`]); when it holds another URL, each pool opens its new connections
/// with it (its own session settings kept). A batch or a job's transaction that met the refusal
/// goes on with it ([`once_more_if_rotated`]); a scheduler's pass is tried again.
pub fn follow(database: &DatabaseConfig, pools: Vec<(PgPool, Session)>) {
    let Some(arn) = database.secret_arn.clone() else {
        return;
    };
    let mut current = database.url.clone();
    let reads = READS.get_or_init(|| watch::Sender::new(Reads::default())).clone();
    tokio::spawn(async move {
        loop {
            LOGIN_REFUSED.notified().await;
            let read_at = Instant::now();
            let mut changed = false;
            match read(&arn).await {
                Ok(url) if url == current => tracing::warn!(
                    secret = %arn,
                    "the database refused a login, and the database secret still holds the URL it was opened with"
                ),
                Ok(url) => {
                    let given = pools.iter().try_for_each(|(pool, session)| {
                        store::session_options(&url, *session).map(|options| pool.set_connect_options(options))
                    });
                    match given {
                        Ok(()) => {
                            tracing::info!(secret = %arn, "the database secret has changed: new connections use it");
                            current = url;
                            changed = true;
                        }
                        Err(error) => {
                            tracing::error!(secret = %arn, error = %error, "the database secret's new URL is not one")
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(error = %error, "the database refused a login, and its secret cannot be read again")
                }
            }
            reads.send_modify(|reads| {
                reads.count += 1;
                if changed {
                    reads.changed_at = Some(Instant::now());
                }
            });
            tokio::time::sleep_until(read_at + REREAD_AT_MOST_EVERY).await;
        }
    });
}

#[derive(Deserialize)]
struct RdsSecret {
    url: Option<String>,
    username: Option<String>,
    password: Option<String>,
    host: Option<String>,
    port: Option<serde_json::Value>,
    dbname: Option<String>,
}

/// The database URL a secret's text describes.
pub fn url_from_secret(text: &str) -> Option<String> {
    let text = text.trim();
    if text.starts_with("postgres://") || text.starts_with("postgresql://") {
        return Some(text.to_string());
    }
    let secret: RdsSecret = serde_json::from_str(text).ok()?;
    if let Some(url) = secret.url {
        return Some(url);
    }
    let port = match secret.port {
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(serde_json::Value::String(s)) => s,
        _ => "5432".to_string(),
    };
    Some(format!(
        "postgres://{}:{}@{}:{port}/{}",
        encode(&secret.username?),
        encode(&secret.password?),
        secret.host?,
        secret.dbname.unwrap_or_else(|| "postgres".to_string())
    ))
}

/// Percent-encodes everything but unreserved characters (RFC 3986), for userinfo.
fn encode(part: &str) -> String {
    part.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_url_secret_is_used_as_is() {
        assert_eq!(url_from_secret(" postgres://a:b@h/db\n").as_deref(), Some("postgres://a:b@h/db"));
    }

    #[test]
    fn a_json_secret_with_a_url_uses_it() {
        assert_eq!(url_from_secret(r#"{"url":"postgres://x@y/z"}"#).as_deref(), Some("postgres://x@y/z"));
    }

    #[test]
    fn an_rds_managed_secret_becomes_a_url_with_its_password_encoded() {
        let secret = r#"{"engine":"postgres","username":"rowq","password":"p@ss/w:rd","host":"db.example","port":5432,"dbname":"jobs"}"#;
        assert_eq!(url_from_secret(secret).as_deref(), Some("postgres://rowq:p%40ss%2Fw%3Ard@db.example:5432/jobs"));
    }

    #[test]
    fn a_secret_without_what_is_needed_is_refused() {
        assert_eq!(url_from_secret(r#"{"username":"rowq"}"#), None);
        assert_eq!(url_from_secret("hunter2"), None);
    }
}
