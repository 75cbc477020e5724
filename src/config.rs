//! Configuration from the environment: one struct per binary, read and validated once at
//! start. This is the only module that reads environment variables. A missing or invalid
//! setting fails with a message that names the variable.

use std::str::FromStr;
use std::time::Duration;

/// A setting that is missing or does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{name} is not set: {hint}")]
    Missing { name: &'static str, hint: &'static str },
    #[error("{name}={value:?} is invalid: {reason}")]
    Invalid { name: &'static str, value: String, reason: String },
}

pub const DEFAULT_QUEUE: &str = "default";
pub const DEFAULT_CLAIM_BATCH: u32 = 500;
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 1000;
pub const DEFAULT_PUBLISH_CONCURRENCY: usize = 8;
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 500;
pub const DEFAULT_BUSY_POLL_MS: u64 = 50;
pub const DEFAULT_DISPATCH_LEASE_SECS: u64 = 300;
pub const DEFAULT_MAINTENANCE_INTERVAL_SECS: u64 = 5;
pub const DEFAULT_RETENTION_HOURS: u64 = 24 * 7;
pub const DEFAULT_CLEANUP_WARN_SECS: u64 = 300;
pub const DEFAULT_SCHEDULER_POOL_SIZE: u32 = 4;
pub const DEFAULT_WORKER_POOL_SIZE: u32 = 2;
pub const DEFAULT_JOB_TIMEOUT_SECS: u64 = 60;
pub const DEFAULT_DEADLINE_MARGIN_MS: u64 = 2000;
pub const DEFAULT_RESCUE_GRACE_SECS: u64 = 10;
pub const DEFAULT_BACKOFF_BASE_MS: u64 = 1000;
pub const DEFAULT_BACKOFF_MAX_SECS: u64 = 3600;
pub const DEFAULT_POLLERS: usize = 4;
pub const DEFAULT_WAIT_SECS: u64 = 1;
pub const DEFAULT_FUNCTION_TIMEOUT_SECS: u64 = 60;
/// Lambda's own upper bound on a function timeout.
pub const MAX_FUNCTION_TIMEOUT_SECS: u64 = 900;

/// Reads settings through a lookup function, so tests need not touch the process environment.
pub struct Env<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
}

impl<'a> Env<'a> {
    pub fn new(lookup: &'a dyn Fn(&str) -> Option<String>) -> Self {
        Env { lookup }
    }

    fn get(&self, name: &str) -> Option<String> {
        (self.lookup)(name).filter(|value| !value.trim().is_empty())
    }

    pub fn required(&self, name: &'static str, hint: &'static str) -> Result<String, ConfigError> {
        self.get(name).ok_or(ConfigError::Missing { name, hint })
    }

    pub fn optional(&self, name: &'static str) -> Option<String> {
        self.get(name)
    }

    /// A number in `range`, or `default` when unset.
    pub fn number<T>(
        &self,
        name: &'static str,
        default: T,
        range: std::ops::RangeInclusive<T>,
    ) -> Result<T, ConfigError>
    where
        T: FromStr + PartialOrd + Copy + std::fmt::Display,
    {
        let Some(raw) = self.get(name) else {
            return Ok(default);
        };
        let value: T = raw.trim().parse().map_err(|_| ConfigError::Invalid {
            name,
            value: raw.clone(),
            reason: "not a whole number".into(),
        })?;
        if !range.contains(&value) {
            return Err(ConfigError::Invalid {
                name,
                value: raw,
                reason: format!("must be between {} and {}", range.start(), range.end()),
            });
        }
        Ok(value)
    }

    fn millis(
        &self,
        name: &'static str,
        default: u64,
        range: std::ops::RangeInclusive<u64>,
    ) -> Result<Duration, ConfigError> {
        self.number(name, default, range).map(Duration::from_millis)
    }

    fn secs(
        &self,
        name: &'static str,
        default: u64,
        range: std::ops::RangeInclusive<u64>,
    ) -> Result<Duration, ConfigError> {
        self.number(name, default, range).map(Duration::from_secs)
    }

    /// Seconds in `range`, or `default` when unset; `None` at 0 (the feature is off).
    fn secs_or_off(
        &self,
        name: &'static str,
        default: u64,
        range: std::ops::RangeInclusive<u64>,
    ) -> Result<Option<Duration>, ConfigError> {
        Ok(Some(self.secs(name, default, range)?).filter(|secs| !secs.is_zero()))
    }
}

/// The process environment, as [`Env::new`] reads it.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// A lookup over the process environment where `overrides` always win and `defaults` fill
/// in what the environment leaves unset. `rowq dev` uses it to pass the queue URLs it created.
pub fn overlay(
    overrides: Vec<(&'static str, String)>,
    defaults: Vec<(&'static str, String)>,
) -> impl Fn(&str) -> Option<String> {
    move |name: &str| {
        let find = |pairs: &[(&'static str, String)]| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone());
        find(&overrides).or_else(|| process_env(name).filter(|v| !v.trim().is_empty())).or_else(|| find(&defaults))
    }
}

/// Whether this process was started by the Lambda service (its runtime API is set).
pub fn on_lambda() -> bool {
    process_env("AWS_LAMBDA_RUNTIME_API").is_some()
}

/// `ROWQ_LOG_FORMAT=json|text`; by default JSON on Lambda, text elsewhere.
pub fn log_format() -> crate::telemetry::LogFormat {
    match process_env("ROWQ_LOG_FORMAT").as_deref() {
        Some("json") => crate::telemetry::LogFormat::Json,
        Some("text") => crate::telemetry::LogFormat::Text,
        _ if process_env("AWS_LAMBDA_FUNCTION_NAME").is_some() => crate::telemetry::LogFormat::Json,
        _ => crate::telemetry::LogFormat::Text,
    }
}

/// Postgres connection settings shared by every binary.
#[derive(Debug, Clone)]
pub struct DatabaseConfig {
    /// Empty until [`crate::secret::resolve`] fills it when `secret_arn` is set.
    pub url: String,
    pub pool_size: u32,
    /// `ROWQ_DATABASE_SECRET_ARN`: read the URL from Secrets Manager at start instead.
    pub secret_arn: Option<String>,
}

impl DatabaseConfig {
    pub fn from(env: &Env<'_>, default_pool: u32) -> Result<Self, ConfigError> {
        let pool_size = env.number("ROWQ_DB_POOL_SIZE", default_pool, 1..=200)?;
        if env.optional("DATABASE_URL").is_none()
            && let Some(arn) = env.optional("ROWQ_DATABASE_SECRET_ARN")
        {
            if !arn.starts_with("arn:") {
                return Err(ConfigError::Invalid {
                    name: "ROWQ_DATABASE_SECRET_ARN",
                    value: arn,
                    reason: "must be a Secrets Manager secret ARN (arn:aws:secretsmanager:...)".into(),
                });
            }
            return Ok(DatabaseConfig { url: String::new(), pool_size, secret_arn: Some(arn) });
        }
        let url = env.required(
            "DATABASE_URL",
            "set it to postgres://user:password@host:5432/dbname, or set ROWQ_DATABASE_SECRET_ARN",
        )?;
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(ConfigError::Invalid {
                name: "DATABASE_URL",
                value: redact_url(&url),
                reason: "must start with postgres:// or postgresql://".into(),
            });
        }
        Ok(DatabaseConfig { url, pool_size, secret_arn: None })
    }
}

/// A database URL with its password replaced, fit for a log line or an error.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.find(':') {
                Some(colon) => format!("{}{}:***{}", &url[..scheme + 3], &credentials[..colon], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// The scheduler: claims due rows of one rowq queue and publishes them to one SQS FIFO queue.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub database: DatabaseConfig,
    /// SQS FIFO queue URL the jobs are published to.
    pub queue_url: String,
    /// The `queue` column value this scheduler serves.
    pub queue: String,
    /// Rows claimed per claim statement.
    pub claim_batch: u32,
    /// Dispatch only while fewer rows of the queue than this are `dispatched`.
    pub max_in_flight: u32,
    /// `SendMessageBatch` calls in flight at once.
    pub publish_concurrency: usize,
    /// Idle wake-up when no NOTIFY arrives.
    pub poll_interval: Duration,
    /// Wake-up while work waits on capacity (in-flight cap reached).
    pub busy_poll: Duration,
    /// `ROWQ_MAX_DISPATCH_RATE`: publish at most this many jobs per second (this scheduler's
    /// share of what a downstream service accepts); `None` publishes as fast as jobs fall due.
    pub max_dispatch_rate: Option<u32>,
    /// A dispatched row not fenced by a worker within this is rescued.
    pub dispatch_lease: Duration,
    pub maintenance_interval: Duration,
    /// Finished rows older than this are deleted (failed ones by their own); zero keeps them.
    pub retention: crate::maintenance::Retention,
    /// Run for at most this long, then exit (scheduled-Lambda mode); `None` runs until stopped.
    pub drain_for: Option<Duration>,
    /// Warn (every this long) while a transaction open for this long holds back the cleanup of
    /// the rows' old versions, which slows every claim; `None` never checks.
    pub cleanup_warn_after: Option<Duration>,
    /// `ROWQ_METRICS_NAMESPACE`: report the queue's gauges under this CloudWatch namespace, as
    /// Embedded Metric Format lines on stdout ([`crate::metrics`]); `None` reports nothing.
    pub metrics_namespace: Option<String>,
    /// `ROWQ_HEALTH_LISTEN`: serve `/livez` and `/readyz` on this address ([`crate::health`]),
    /// when the scheduler runs as a service; `None` serves nothing.
    pub health_listen: Option<std::net::SocketAddr>,
}

impl SchedulerConfig {
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from(&Env::new(&process_env))
    }

    pub fn from(env: &Env<'_>) -> Result<Self, ConfigError> {
        let queue = queue_name(env)?;
        Ok(SchedulerConfig {
            database: DatabaseConfig::from(env, DEFAULT_SCHEDULER_POOL_SIZE)?,
            queue_url: queue_url(env, "ROWQ_QUEUE_URL")?,
            queue,
            claim_batch: env.number("ROWQ_CLAIM_BATCH", DEFAULT_CLAIM_BATCH, 1..=5000)?,
            max_in_flight: env.number("ROWQ_MAX_IN_FLIGHT", DEFAULT_MAX_IN_FLIGHT, 1..=1_000_000)?,
            publish_concurrency: env.number("ROWQ_PUBLISH_CONCURRENCY", DEFAULT_PUBLISH_CONCURRENCY, 1..=256)?,
            poll_interval: env.millis("ROWQ_POLL_INTERVAL_MS", DEFAULT_POLL_INTERVAL_MS, 10..=600_000)?,
            busy_poll: env.millis("ROWQ_BUSY_POLL_MS", DEFAULT_BUSY_POLL_MS, 1..=60_000)?,
            max_dispatch_rate: Some(env.number("ROWQ_MAX_DISPATCH_RATE", 0, 0..=1_000_000)?).filter(|rate| *rate > 0),
            dispatch_lease: env.secs("ROWQ_DISPATCH_LEASE_SECS", DEFAULT_DISPATCH_LEASE_SECS, 1..=86_400)?,
            maintenance_interval: env.secs(
                "ROWQ_MAINTENANCE_INTERVAL_SECS",
                DEFAULT_MAINTENANCE_INTERVAL_SECS,
                1..=3600,
            )?,
            retention: retention(env)?,
            drain_for: env.secs_or_off("ROWQ_DRAIN_SECS", 0, 0..=MAX_FUNCTION_TIMEOUT_SECS * 100)?,
            cleanup_warn_after: env.secs_or_off("ROWQ_CLEANUP_WARN_SECS", DEFAULT_CLEANUP_WARN_SECS, 0..=7 * 86_400)?,
            metrics_namespace: metrics_namespace(env)?,
            health_listen: health_listen(env)?,
        })
    }
}

/// `ROWQ_HEALTH_LISTEN`: an IP address and port, as `0.0.0.0:8080` (every interface, in a
/// container) or `127.0.0.1:8080`. The scheduler's is in [`SchedulerConfig`]; `rowq work`
/// reads it here.
pub fn health_listen(env: &Env<'_>) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    let Some(raw) = env.optional("ROWQ_HEALTH_LISTEN") else { return Ok(None) };
    raw.trim().parse().map(Some).map_err(|_| ConfigError::Invalid {
        name: "ROWQ_HEALTH_LISTEN",
        value: raw,
        reason: "must be an IP address and a port, as 0.0.0.0:8080".into(),
    })
}

/// `ROWQ_RETENTION_HOURS` and `ROWQ_FAILED_RETENTION_HOURS`, which is the first unless set.
fn retention(env: &Env<'_>) -> Result<crate::maintenance::Retention, ConfigError> {
    const MAX_HOURS: u64 = 24 * 3650;
    let done = env.number("ROWQ_RETENTION_HOURS", DEFAULT_RETENTION_HOURS, 0..=MAX_HOURS)?;
    let failed = env.number("ROWQ_FAILED_RETENTION_HOURS", done, 0..=MAX_HOURS)?;
    let hours = |hours: u64| Duration::from_secs(hours * 3600);
    Ok(crate::maintenance::Retention { done: hours(done), failed: hours(failed) })
}

/// `ROWQ_QUEUE`: the `queue` column value a scheduler serves (and a worker's metrics name).
fn queue_name(env: &Env<'_>) -> Result<String, ConfigError> {
    let queue = env.optional("ROWQ_QUEUE").unwrap_or_else(|| DEFAULT_QUEUE.to_string());
    if queue.len() > 64 || !queue.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) {
        return Err(ConfigError::Invalid {
            name: "ROWQ_QUEUE",
            value: queue,
            reason: "must be 1-64 characters of A-Z a-z 0-9 _ . -".into(),
        });
    }
    Ok(queue)
}

/// `ROWQ_METRICS_NAMESPACE`, checked against CloudWatch's rules for a namespace, which would
/// otherwise drop every metric without a word: 1-255 characters of letters, digits and
/// `. - _ / # : space`, not starting with `AWS/` (AWS's own).
fn metrics_namespace(env: &Env<'_>) -> Result<Option<String>, ConfigError> {
    let Some(namespace) = env.optional("ROWQ_METRICS_NAMESPACE") else { return Ok(None) };
    let allowed = |c: char| c.is_ascii_alphanumeric() || ".-_/#: ".contains(c);
    if namespace.len() > 255 || !namespace.chars().all(allowed) || namespace.starts_with("AWS/") {
        return Err(ConfigError::Invalid {
            name: "ROWQ_METRICS_NAMESPACE",
            value: namespace,
            reason: "must be 1-255 characters of A-Z a-z 0-9 . - _ / # : and space, not starting with AWS/".into(),
        });
    }
    Ok(Some(namespace))
}

fn queue_url(env: &Env<'_>, name: &'static str) -> Result<String, ConfigError> {
    let url = env.required(name, "set it to the SQS FIFO queue URL (CreateQueue/GetQueueUrl returns it)")?;
    if !(url.starts_with("https://") || url.starts_with("http://")) || !url.ends_with(".fifo") {
        return Err(ConfigError::Invalid {
            name,
            value: url,
            reason: "must be an http(s) URL of a FIFO queue (ending in .fifo)".into(),
        });
    }
    Ok(url)
}

/// The worker: fences, runs and finishes jobs delivered in SQS batches.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub database: DatabaseConfig,
    /// Timeout of a job whose kind sets none; always cut to the invocation's remaining time.
    pub job_timeout: Duration,
    /// Time kept free before the Lambda deadline to record outcomes.
    pub deadline_margin: Duration,
    /// Added to a job's timeout to form its `run_deadline`, after which it may be rescued.
    pub rescue_grace: Duration,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// Where to report what each batch did ([`crate::metrics::Tally`]); `None` reports nothing.
    pub metrics: Option<MetricsTarget>,
}

/// A worker's metrics: `ROWQ_METRICS_NAMESPACE`, and `ROWQ_QUEUE` as their `Queue` dimension
/// (a worker runs whatever its SQS queue delivers; the name only labels its metrics, to match
/// the scheduler's of the same queue).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsTarget {
    pub namespace: String,
    pub queue: String,
}

impl WorkerConfig {
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from(&Env::new(&process_env))
    }

    pub fn from(env: &Env<'_>) -> Result<Self, ConfigError> {
        let config = WorkerConfig {
            database: DatabaseConfig::from(env, DEFAULT_WORKER_POOL_SIZE)?,
            job_timeout: env.secs("ROWQ_JOB_TIMEOUT_SECS", DEFAULT_JOB_TIMEOUT_SECS, 1..=MAX_FUNCTION_TIMEOUT_SECS)?,
            deadline_margin: env.millis("ROWQ_DEADLINE_MARGIN_MS", DEFAULT_DEADLINE_MARGIN_MS, 0..=60_000)?,
            rescue_grace: env.secs("ROWQ_RESCUE_GRACE_SECS", DEFAULT_RESCUE_GRACE_SECS, 0..=3600)?,
            backoff_base: env.millis("ROWQ_BACKOFF_BASE_MS", DEFAULT_BACKOFF_BASE_MS, 1..=3_600_000)?,
            backoff_max: env.secs("ROWQ_BACKOFF_MAX_SECS", DEFAULT_BACKOFF_MAX_SECS, 1..=7 * 86_400)?,
            metrics: match metrics_namespace(env)? {
                Some(namespace) => Some(MetricsTarget { namespace, queue: queue_name(env)? }),
                None => None,
            },
        };
        if config.backoff_max < config.backoff_base {
            return Err(ConfigError::Invalid {
                name: "ROWQ_BACKOFF_MAX_SECS",
                value: config.backoff_max.as_secs().to_string(),
                reason: "must not be below ROWQ_BACKOFF_BASE_MS".into(),
            });
        }
        Ok(config)
    }
}

/// The local event-source runner: what the Lambda SQS event source mapping does, on one machine.
#[derive(Debug, Clone)]
pub struct EventSourceConfig {
    pub queue_url: String,
    /// The dead-letter queue, served by the DLQ handler when set.
    pub dlq_url: Option<String>,
    /// Concurrent long-pollers (Lambda concurrency).
    pub pollers: usize,
    /// Long-poll wait (`WaitTimeSeconds`).
    pub wait: Duration,
    /// Deadline given to each batch, as a Lambda function timeout.
    pub function_timeout: Duration,
}

impl EventSourceConfig {
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from(&Env::new(&process_env))
    }

    pub fn from(env: &Env<'_>) -> Result<Self, ConfigError> {
        Ok(EventSourceConfig {
            queue_url: queue_url(env, "ROWQ_QUEUE_URL")?,
            dlq_url: match env.optional("ROWQ_DLQ_URL") {
                Some(_) => Some(queue_url(env, "ROWQ_DLQ_URL")?),
                None => None,
            },
            pollers: env.number("ROWQ_POLLERS", DEFAULT_POLLERS, 1..=256)?,
            wait: env.secs("ROWQ_WAIT_SECS", DEFAULT_WAIT_SECS, 0..=20)?,
            function_timeout: env.secs(
                "ROWQ_FUNCTION_TIMEOUT_SECS",
                DEFAULT_FUNCTION_TIMEOUT_SECS,
                1..=MAX_FUNCTION_TIMEOUT_SECS,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn scheduler(pairs: &[(&str, &str)]) -> Result<SchedulerConfig, ConfigError> {
        let vars = env_of(pairs);
        let lookup = move |name: &str| vars.get(name).cloned();
        SchedulerConfig::from(&Env::new(&lookup))
    }

    const DB: (&str, &str) = ("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    const QUEUE: (&str, &str) = ("ROWQ_QUEUE_URL", "http://127.0.0.1:4566/queue/us-east-1/000000000000/jobs.fifo");

    #[test]
    fn scheduler_defaults_apply_when_only_the_required_settings_are_given() {
        let config = scheduler(&[DB, QUEUE]).unwrap();
        assert_eq!(config.queue, DEFAULT_QUEUE);
        assert_eq!(config.claim_batch, DEFAULT_CLAIM_BATCH);
        assert_eq!(config.max_in_flight, DEFAULT_MAX_IN_FLIGHT);
        assert_eq!(config.poll_interval, Duration::from_millis(DEFAULT_POLL_INTERVAL_MS));
        assert_eq!(config.drain_for, None);
        assert_eq!(config.cleanup_warn_after, Some(Duration::from_secs(DEFAULT_CLEANUP_WARN_SECS)));
        assert_eq!(config.retention, Duration::from_secs(DEFAULT_RETENTION_HOURS * 3600).into());
        assert_eq!(config.metrics_namespace, None);
        assert_eq!(config.max_dispatch_rate, None);
        assert_eq!(config.health_listen, None);
    }

    #[test]
    fn the_health_endpoint_listens_on_an_address_and_port() {
        let config = scheduler(&[DB, QUEUE, ("ROWQ_HEALTH_LISTEN", "0.0.0.0:8080")]).unwrap();
        assert_eq!(config.health_listen, Some(std::net::SocketAddr::from(([0, 0, 0, 0], 8080))));
        for bad in ["8080", "localhost:8080", "0.0.0.0"] {
            let error = scheduler(&[DB, QUEUE, ("ROWQ_HEALTH_LISTEN", bad)]).unwrap_err();
            assert!(matches!(error, ConfigError::Invalid { name: "ROWQ_HEALTH_LISTEN", .. }), "{bad}: {error}");
        }
    }

    #[test]
    fn failed_rows_are_kept_as_long_as_the_others_unless_set_apart() {
        let hours = |hours: u64| Duration::from_secs(hours * 3600);
        let retention = |settings: &[(&str, &str)]| scheduler(&[&[DB, QUEUE], settings].concat()).unwrap().retention;
        assert_eq!(retention(&[("ROWQ_RETENTION_HOURS", "24")]), hours(24).into());
        let apart = retention(&[("ROWQ_RETENTION_HOURS", "24"), ("ROWQ_FAILED_RETENTION_HOURS", "720")]);
        assert_eq!((apart.done, apart.failed), (hours(24), hours(720)));
        let kept = retention(&[("ROWQ_FAILED_RETENTION_HOURS", "0")]);
        assert_eq!((kept.done, kept.failed), (hours(DEFAULT_RETENTION_HOURS), Duration::ZERO));
        let error = scheduler(&[DB, QUEUE, ("ROWQ_FAILED_RETENTION_HOURS", "a month")]).unwrap_err().to_string();
        assert!(error.contains("ROWQ_FAILED_RETENTION_HOURS"), "{error}");
    }

    #[test]
    fn a_dispatch_rate_of_zero_is_no_limit_and_one_that_is_no_whole_number_is_refused() {
        let config = scheduler(&[DB, QUEUE, ("ROWQ_MAX_DISPATCH_RATE", "50")]).unwrap();
        assert_eq!(config.max_dispatch_rate, Some(50));
        assert_eq!(scheduler(&[DB, QUEUE, ("ROWQ_MAX_DISPATCH_RATE", "0")]).unwrap().max_dispatch_rate, None);
        let Err(error) = scheduler(&[DB, QUEUE, ("ROWQ_MAX_DISPATCH_RATE", "2.5")]) else {
            panic!("a fraction was accepted")
        };
        assert!(error.to_string().contains("ROWQ_MAX_DISPATCH_RATE"), "{error}");
    }

    #[test]
    fn a_metrics_namespace_is_one_cloudwatch_accepts() {
        let config = scheduler(&[DB, QUEUE, ("ROWQ_METRICS_NAMESPACE", "rowq/prod-eu #2")]).unwrap();
        assert_eq!(config.metrics_namespace.as_deref(), Some("rowq/prod-eu #2"));
        for bad in ["AWS/SQS", "rowq|prod", &"n".repeat(256)] {
            let error = scheduler(&[DB, QUEUE, ("ROWQ_METRICS_NAMESPACE", bad)]).unwrap_err();
            assert!(matches!(error, ConfigError::Invalid { name: "ROWQ_METRICS_NAMESPACE", .. }), "{bad}: {error}");
        }
    }

    #[test]
    fn a_missing_setting_is_named() {
        let error = scheduler(&[QUEUE]).unwrap_err();
        assert!(matches!(error, ConfigError::Missing { name: "DATABASE_URL", .. }));
        assert!(error.to_string().starts_with("DATABASE_URL is not set"));
        let error = scheduler(&[DB]).unwrap_err();
        assert!(matches!(error, ConfigError::Missing { name: "ROWQ_QUEUE_URL", .. }));
    }

    #[test]
    fn an_invalid_setting_is_named_with_the_reason() {
        let error = scheduler(&[DB, QUEUE, ("ROWQ_CLAIM_BATCH", "lots")]).unwrap_err();
        assert_eq!(error.to_string(), r#"ROWQ_CLAIM_BATCH="lots" is invalid: not a whole number"#);
        let error = scheduler(&[DB, QUEUE, ("ROWQ_CLAIM_BATCH", "0")]).unwrap_err();
        assert!(error.to_string().contains("must be between 1 and 5000"));
        let error = scheduler(&[DB, ("ROWQ_QUEUE_URL", "http://x/queue/jobs")]).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { name: "ROWQ_QUEUE_URL", .. }));
        let error = scheduler(&[("DATABASE_URL", "mysql://x"), QUEUE]).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { name: "DATABASE_URL", .. }));
        let error = scheduler(&[DB, QUEUE, ("ROWQ_QUEUE", "no spaces")]).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { name: "ROWQ_QUEUE", .. }));
    }

    #[test]
    fn a_secret_arn_stands_in_for_the_database_url() {
        let arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:rowq-db-AbCdEf";
        let config = scheduler(&[("ROWQ_DATABASE_SECRET_ARN", arn), QUEUE]).unwrap();
        assert_eq!(config.database.secret_arn.as_deref(), Some(arn));
        let error = scheduler(&[("ROWQ_DATABASE_SECRET_ARN", "rowq-db"), QUEUE]).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { name: "ROWQ_DATABASE_SECRET_ARN", .. }));
    }

    #[test]
    fn settings_in_seconds_are_off_at_zero_and_on_otherwise() {
        type Field = fn(&SchedulerConfig) -> Option<Duration>;
        let settings: [(&str, &str, Field); 2] = [
            ("ROWQ_CLEANUP_WARN_SECS", "60", |config| config.cleanup_warn_after),
            ("ROWQ_DRAIN_SECS", "50", |config| config.drain_for),
        ];
        for (name, on, field) in settings {
            assert_eq!(field(&scheduler(&[DB, QUEUE, (name, "0")]).unwrap()), None, "{name}=0");
            let secs = on.parse().unwrap();
            assert_eq!(field(&scheduler(&[DB, QUEUE, (name, on)]).unwrap()), Some(Duration::from_secs(secs)), "{name}");
        }
    }

    #[test]
    fn worker_refuses_a_backoff_ceiling_below_its_base() {
        let vars = env_of(&[DB, ("ROWQ_BACKOFF_BASE_MS", "5000"), ("ROWQ_BACKOFF_MAX_SECS", "2")]);
        let lookup = move |name: &str| vars.get(name).cloned();
        let error = WorkerConfig::from(&Env::new(&lookup)).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { name: "ROWQ_BACKOFF_MAX_SECS", .. }));
    }

    #[test]
    fn a_worker_reports_metrics_only_with_a_namespace_and_names_them_by_its_queue() {
        let worker = |pairs: &[(&str, &str)]| {
            let vars = env_of(pairs);
            let lookup = move |name: &str| vars.get(name).cloned();
            WorkerConfig::from(&Env::new(&lookup))
        };
        assert_eq!(worker(&[DB, ("ROWQ_QUEUE", "emails")]).unwrap().metrics, None);
        let target = worker(&[DB, ("ROWQ_METRICS_NAMESPACE", "rowq/prod")]).unwrap().metrics;
        assert_eq!(target, Some(MetricsTarget { namespace: "rowq/prod".into(), queue: DEFAULT_QUEUE.into() }));
        let target = worker(&[DB, ("ROWQ_METRICS_NAMESPACE", "rowq/prod"), ("ROWQ_QUEUE", "emails")]).unwrap().metrics;
        assert_eq!(target.map(|t| t.queue).as_deref(), Some("emails"));
        let error = worker(&[DB, ("ROWQ_METRICS_NAMESPACE", "rowq/prod"), ("ROWQ_QUEUE", "no queue")]).unwrap_err();
        assert!(matches!(error, ConfigError::Invalid { name: "ROWQ_QUEUE", .. }));
    }

    #[test]
    fn passwords_are_redacted_from_database_urls() {
        assert_eq!(redact_url("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
        assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(redact_url("postgres://db/x"), "postgres://db/x");
    }
}
