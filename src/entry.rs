//! What the `worker`, `dlq-handler` and `scheduler` binaries run, behind one synchronous call
//! each that starts its own Tokio runtime.
//!
//! A crate that polls another crate's futures compiles their whole async call tree again:
//! async bodies are instantiated where they are polled, like generic code, and optimised
//! builds do not share those instances between crates. Each binary that awaited the library
//! recompiled sqlx's connection machinery, the AWS SDK's request orchestrator and the Lambda
//! runtime for itself — 20 to 40 s of CPU per binary in a clean `bench`-profile build, the
//! largest part of `make bench` on a fresh clone. Called through these functions, a binary
//! compiles its `main` and nothing else, and the library compiles the async code once.
//! Library users who write their own worker call [`crate::worker::run_lambda`] from their own
//! async `main`, or [`worker`] with their own registry.

use std::future::Future;

use sqlx::PgPool;

use crate::config::{self, DatabaseConfig, SchedulerConfig, WorkerConfig};
use crate::dispatch::{self, Scheduler};
use crate::handlers::Registry;
use crate::sqs::{self, SqsPublisher};
use crate::store::Session;
use crate::worker::{self, Worker};
use crate::{dlq, health, secret, store};

/// What a binary reports when it cannot start or stops on an error.
pub type Error = lambda_runtime::Error;

/// Runs `future` to completion on a runtime of one thread.
///
/// A Lambda instance handles one batch at a time, and the worker runs a batch's handlers
/// concurrently within one task, so more threads could only move that task around; the
/// scheduler is one loop that waits on Postgres and SQS. What more threads did cost is a
/// cross-thread wake-up (a futex call, often a sleeping thread to schedule) each time an answer
/// from the database woke a task parked on the other thread. Measured with the library's
/// scheduler and worker in one process, 8 pollers, on the two cores Postgres shares: 15.6–17.1k
/// jobs/s and 63–76 µs of CPU per job on two threads, 18.9–19.5k and 52–56 µs on one worker
/// thread, 19.8–20.9k and 51–52 µs on this one (BENCHMARKS.md, round 8). A handler that needs
/// CPU for long belongs in `tokio::task::spawn_blocking`, on any runtime; `block_in_place`
/// is not available here.
fn block_on<F: Future<Output = Result<(), Error>>>(future: F) -> Result<(), Error> {
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(future)
}

/// The Lambdas' pool: the database URL from its secret if one is configured (and read again
/// when the database refuses a login: [`secret::follow`]), connecting on first use (a cold
/// start does not fail while the database is briefly unreachable).
async fn lazy_pool(database: &mut DatabaseConfig, session: Session) -> Result<PgPool, Error> {
    secret::resolve(database).await?;
    let pool = store::connect_lazy(database, session)?;
    secret::follow(database, vec![(pool.clone(), session)]);
    Ok(pool)
}

/// The worker Lambda: the database URL from its secret if one is configured, a pool that
/// connects on first use, and `registry`'s handlers on the Lambda runtime.
pub fn worker(mut config: WorkerConfig, registry: Registry) -> Result<(), Error> {
    block_on(async move {
        let pool = lazy_pool(&mut config.database, Session::Worker).await?;
        worker::run_lambda(Worker::new(pool, registry, config)).await
    })
}

/// The dead-letter Lambda, set up as [`worker`].
pub fn dlq_handler(mut config: WorkerConfig) -> Result<(), Error> {
    block_on(async move {
        dlq::run_lambda(lazy_pool(&mut config.database, Session::DlqHandler).await?, config.metrics).await
    })
}

/// `scheduler --health-check`, `rowq work --health-check`: whether the process serving
/// `ROWQ_HEALTH_LISTEN` beside it answers `/livez` with 200 ([`health::check`]); prints its
/// answer. It reads no other setting.
pub fn health_check() -> Result<(), Error> {
    let address = config::health_listen(&config::Env::new(&config::process_env))?
        .ok_or("--health-check asks the process serving ROWQ_HEALTH_LISTEN, which is not set")?;
    println!("{}", health::check(address, "/livez")?);
    Ok(())
}

/// The scheduler: migrates, then publishes to `ROWQ_QUEUE_URL` until SIGTERM or SIGINT (with
/// `once`, until nothing more is due); on Lambda, one bounded drain per invocation. As a
/// service, its health endpoint opens first: live and not ready while it connects and migrates.
pub fn scheduler(mut config: SchedulerConfig, once: bool) -> Result<(), Error> {
    block_on(async move {
        let on_lambda = config::on_lambda();
        let health = dispatch::loop_health(&config);
        health.starting("connecting to the database");
        let listen = if on_lambda { None } else { config.health_listen };
        let _server = health::start(listen, vec![health.clone()]).await?;
        secret::resolve(&mut config.database).await?;
        let pool = store::connect_scheduler(&config.database)
            .await
            .map_err(|error| format!("cannot connect to {}: {error}", config::redact_url(&config.database.url)))?;
        secret::follow(&config.database, vec![(pool.clone(), Session::Scheduler)]);
        health.starting("applying migrations");
        store::migrate(&pool).await.map_err(|error| format!("cannot apply migrations: {error}"))?;
        let publisher = SqsPublisher::new(sqs::client().await, config.queue_url.clone());
        let scheduler = Scheduler::with_health(pool, publisher, config, health);
        if on_lambda {
            return dispatch::run_lambda(scheduler).await;
        }
        scheduler.run(dispatch::shutdown_on_signals(), once).await;
        Ok(())
    })
}
