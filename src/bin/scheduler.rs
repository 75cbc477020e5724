//! The scheduler: claims due rows and publishes them to SQS FIFO until SIGTERM/SIGINT.
//! `scheduler --once` runs one drain pass and exits; `ROWQ_DRAIN_SECS` bounds a run. Started by
//! the Lambda service (an EventBridge schedule), each invocation is one bounded drain.

use anyhow::Context;
use rowq::config::{self, SchedulerConfig};
use rowq::{Scheduler, SqsPublisher, dispatch, secret, sqs, store, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init(config::log_format());
    let once = std::env::args().any(|arg| arg == "--once");
    let mut config = SchedulerConfig::from_env().context("invalid scheduler configuration")?;
    secret::resolve(&mut config.database).await?;
    let pool = store::connect_scheduler(&config.database)
        .await
        .with_context(|| format!("cannot connect to {}", config::redact_url(&config.database.url)))?;
    store::migrate(&pool).await.context("cannot apply migrations")?;
    let publisher = SqsPublisher::new(sqs::client().await, config.queue_url.clone());
    let scheduler = Scheduler::new(pool, publisher, config);
    if config::on_lambda() {
        return dispatch::run_lambda(scheduler).await.map_err(|e| anyhow::anyhow!(e));
    }
    scheduler.run(dispatch::shutdown_on_signals(), once).await;
    Ok(())
}
