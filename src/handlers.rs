//! The registry of job handlers: `kind` → `async fn(JobContext, T) -> Result<R, JobError>`,
//! with `T: Deserialize` (the payload) and `R: Serialize` (stored in `result`).
//!
//! ```no_run
//! use rowq::{JobContext, JobError, Registry};
//! use serde::Deserialize;
//!
//! #[derive(Deserialize)]
//! struct Resize { key: String }
//!
//! async fn resize(ctx: JobContext, job: Resize) -> Result<String, JobError> {
//!     // Writes through the job's transaction commit together with its completion, or not at all.
//!     sqlx::query("INSERT INTO thumbnails (key) VALUES ($1)")
//!         .bind(&job.key)
//!         .execute(&mut **ctx.tx().await?)
//!         .await?;
//!     Ok(format!("thumbnails/{}", job.key))
//! }
//!
//! let registry = Registry::new().register("resize_image", resize);
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::job::{JobError, JobId};

/// What a handler knows about the execution it is running.
pub struct JobContext {
    pub job_id: JobId,
    pub kind: String,
    /// This execution's number, 1-based.
    pub attempt: i32,
    pub max_attempts: i32,
    /// The handler is stopped at this instant and the attempt recorded as timed out.
    pub deadline: Instant,
    pool: PgPool,
    tx: Arc<Mutex<Option<Transaction<'static, Postgres>>>>,
}

/// The job's own transaction, begun on first use. The worker commits it together with the
/// job's `succeeded` row, fenced by the execution: if the job was taken over or rescued in the
/// meantime, or the handler fails, everything written through it is rolled back.
pub type JobTransaction = OwnedMappedMutexGuard<Option<Transaction<'static, Postgres>>, Transaction<'static, Postgres>>;

impl JobContext {
    pub(crate) fn new(
        job_id: JobId,
        kind: String,
        attempt: i32,
        max_attempts: i32,
        deadline: Instant,
        pool: PgPool,
    ) -> (Self, TransactionSlot) {
        let tx = Arc::new(Mutex::new(None));
        let slot = TransactionSlot(tx.clone());
        (JobContext { job_id, kind, attempt, max_attempts, deadline, pool, tx }, slot)
    }

    /// The job's transaction (see [`JobTransaction`]). Use it as `&mut **ctx.tx().await?`.
    ///
    /// (A boxed `'static` future rather than an `async fn`: a future that borrows the context
    /// trips the compiler's `Send` inference inside generic handler futures.)
    pub fn tx(&self) -> BoxFuture<'static, Result<JobTransaction, JobError>> {
        let (slot, pool) = (self.tx.clone(), self.pool.clone());
        async move {
            let mut guard = slot.lock_owned().await;
            if guard.is_none() {
                *guard = Some(crate::secret::once_more_if_rotated(|| pool.begin()).await?);
            }
            OwnedMutexGuard::try_map(guard, Option::as_mut)
                .map_err(|_| JobError::retryable("the job transaction could not be opened"))
        }
        .boxed()
    }

    /// The pool, for reads that need not be part of the job's transaction.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// The worker's handle on a job's transaction, to commit or roll it back after the handler.
pub(crate) struct TransactionSlot(Arc<Mutex<Option<Transaction<'static, Postgres>>>>);

impl TransactionSlot {
    pub(crate) async fn take(self) -> Option<Transaction<'static, Postgres>> {
        self.0.lock().await.take()
    }
}

type HandlerFn =
    dyn Fn(JobContext, serde_json::Value) -> BoxFuture<'static, Result<serde_json::Value, JobError>> + Send + Sync;

struct Entry {
    run: Box<HandlerFn>,
    timeout: Option<Duration>,
}

/// Handlers by kind.
#[derive(Default)]
pub struct Registry {
    entries: HashMap<String, Entry>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` for `kind`, under the worker's default job timeout.
    pub fn register<T, R, F, Fut>(self, kind: &str, handler: F) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        R: Serialize + 'static,
        F: Fn(JobContext, T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, JobError>> + Send + 'static,
    {
        self.insert(kind, handler, None)
    }

    /// Registers `handler` for `kind` with its own timeout (still cut to the invocation's
    /// remaining time).
    pub fn register_with_timeout<T, R, F, Fut>(self, kind: &str, timeout: Duration, handler: F) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        R: Serialize + 'static,
        F: Fn(JobContext, T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, JobError>> + Send + 'static,
    {
        self.insert(kind, handler, Some(timeout))
    }

    fn insert<T, R, F, Fut>(mut self, kind: &str, handler: F, timeout: Option<Duration>) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        R: Serialize + 'static,
        F: Fn(JobContext, T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, JobError>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let run = move |ctx: JobContext, payload: serde_json::Value| {
            let handler = handler.clone();
            async move {
                let kind = ctx.kind.clone();
                let input: T = serde_json::from_value(payload)
                    .map_err(|e| JobError::permanent(format!("payload does not fit job kind {kind:?}: {e}")))?;
                let output = handler(ctx, input).await?;
                serde_json::to_value(output)
                    .map_err(|e| JobError::permanent(format!("result of job kind {kind:?} is not JSON: {e}")))
            }
            .boxed()
        };
        self.entries.insert(kind.to_string(), Entry { run: Box::new(run), timeout });
        self
    }

    /// Starts the handler of `kind`, or `None` when no handler is registered for it.
    pub(crate) fn call(
        &self,
        kind: &str,
        ctx: JobContext,
        payload: serde_json::Value,
    ) -> Option<BoxFuture<'static, Result<serde_json::Value, JobError>>> {
        self.entries.get(kind).map(|entry| (entry.run)(ctx, payload))
    }

    /// The timeout registered for `kind`, if it has its own.
    pub fn timeout_of(&self, kind: &str) -> Option<Duration> {
        self.entries.get(kind).and_then(|entry| entry.timeout)
    }

    /// The longest timeout any kind registered.
    pub fn longest_timeout(&self) -> Option<Duration> {
        self.entries.values().filter_map(|entry| entry.timeout).max()
    }

    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The built-in kinds used by demos and tests: `noop`, `echo` (result = payload),
    /// `sleep` (`{"ms": N}`), `fail` (`{"times": N}` fails the first N attempts then succeeds,
    /// with `"retry_after_ms": M` asking for each retry M ms later; without `times` it fails
    /// permanently).
    pub fn builtin() -> Self {
        Registry::new()
            .register("noop", |_: JobContext, _: serde_json::Value| async { Ok(serde_json::Value::Null) })
            .register("echo", |_: JobContext, payload: serde_json::Value| async move { Ok(payload) })
            .register("sleep", |_: JobContext, input: Sleep| async move {
                tokio::time::sleep(Duration::from_millis(input.ms)).await;
                Ok(serde_json::json!({ "slept_ms": input.ms }))
            })
            .register("fail", |ctx: JobContext, input: Fail| async move {
                match input.times {
                    Some(times) if i64::from(ctx.attempt) > i64::from(times) => {
                        Ok(serde_json::json!({ "succeeded_on_attempt": ctx.attempt }))
                    }
                    Some(times) => {
                        let error = format!("failing on purpose: attempt {} of the first {times}", ctx.attempt);
                        Err(match input.retry_after_ms {
                            Some(ms) => JobError::retry_after(error, Duration::from_millis(ms)),
                            None => JobError::retryable(error),
                        })
                    }
                    None => Err(JobError::permanent("failing on purpose, permanently")),
                }
            })
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Sleep {
    ms: u64,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Fail {
    times: Option<u32>,
    /// Each failure asks to be retried this long after it ([`JobError::retry_after`]).
    retry_after_ms: Option<u64>,
}

/// A handler future that panicked, as an error instead of a crashed invocation.
pub(crate) async fn catching_panics(
    future: BoxFuture<'static, Result<serde_json::Value, JobError>>,
) -> Result<serde_json::Value, JobError> {
    match std::panic::AssertUnwindSafe(future).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            Err(JobError::retryable(format!("handler panicked: {message}")))
        }
    }
}
