//! The scheduler: claims due rows and publishes them to SQS FIFO until SIGTERM/SIGINT.
//! `scheduler --once` runs one drain pass and exits; `ROWQ_DRAIN_SECS` bounds a run.

use anyhow::Context;
use rowq::config::{self, SchedulerConfig};
use rowq::{Scheduler, SqsPublisher, sqs, store, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init(config::log_format());
    let once = std::env::args().any(|arg| arg == "--once");
    let config = SchedulerConfig::from_env().context("invalid scheduler configuration")?;
    let pool = store::connect(&config.database)
        .await
        .with_context(|| format!("cannot connect to {}", config::redact_url(&config.database.url)))?;
    store::migrate(&pool).await.context("cannot apply migrations")?;
    let publisher = SqsPublisher::new(sqs::client().await, config.queue_url.clone());
    let scheduler = Scheduler::new(pool, publisher, config);
    let shutdown = rowq::dispatch::shutdown_on_signals();
    scheduler.run(shutdown, once).await;
    Ok(())
}
