//! `rowq dev`: the whole pipeline on one machine until Ctrl-C.

use anyhow::Context;
use clap::Args;
use sqlx::PgPool;

use super::QueueArgs;
use crate::config::{self, Env, EventSourceConfig, SchedulerConfig, WorkerConfig};
use crate::pipeline::{Pipeline, PipelineConfig};
use crate::store::Session;
use crate::{Registry, Worker, health, sqs, store, telemetry};

#[derive(Args)]
pub struct DevArgs {
    #[command(flatten)]
    queues: QueueArgs,
    /// Scheduler instances.
    #[arg(long, default_value_t = 1)]
    schedulers: usize,
}

/// Connections for the worker side: every poller may run a batch of 10 jobs that each hold a
/// transaction.
const DEV_POOL_SIZE: u32 = 50;

/// A pipeline started by [`start`].
pub struct Running {
    pub pool: PgPool,
    pipeline: Pipeline,
}

impl Running {
    pub async fn stop(self) {
        let totals = self.pipeline.stop().await;
        tracing::info!(published = totals.published, "stopped");
    }
}

pub async fn run(database_url: &str, args: DevArgs) -> anyhow::Result<()> {
    let running = start(database_url, &args, Vec::new(), Vec::new()).await?;
    tracing::info!(
        "rowq is running: INSERT INTO rowq.jobs (kind, payload) VALUES ('echo', '{{\"hello\":\"world\"}}'); Ctrl-C stops"
    );
    let mut shutdown = crate::dispatch::shutdown_on_signals();
    let _ = shutdown.wait_for(|stop| *stop).await;
    tracing::info!("stopping: finishing the batches in flight");
    running.stop().await;
    Ok(())
}

/// `rowq work`: the consumers only, on the queues named by ROWQ_QUEUE_URL / ROWQ_DLQ_URL.
/// `from_secret`: the database secret `database_url` was read from, followed when it rotates.
pub async fn work(database_url: &str, from_secret: Option<crate::config::DatabaseConfig>) -> anyhow::Result<()> {
    telemetry::init(config::log_format());
    let lookup = config::overlay(
        vec![("DATABASE_URL", database_url.to_string())],
        vec![("ROWQ_DB_POOL_SIZE", DEV_POOL_SIZE.to_string())],
    );
    let env = Env::new(&lookup);
    let worker_config = WorkerConfig::from(&env)?;
    let event_source = EventSourceConfig::from(&env)?;
    let pool = super::commands::connect(database_url).await?;
    let worker_pool =
        store::connect(&worker_config.database, Session::Worker).await.context("cannot connect the worker pool")?;
    if let Some(secret) = &from_secret {
        crate::secret::follow(secret, vec![(pool.clone(), Session::Cli), (worker_pool.clone(), Session::Worker)]);
    }
    let worker = Worker::new(worker_pool, Registry::builtin(), worker_config);
    // No scheduler runs here; the scheduler settings are only carried along.
    let scheduler = SchedulerConfig::from(&env)?;
    let health_listen = config::health_listen(&env)?;
    let config = PipelineConfig { scheduler, event_source, schedulers: 0 };
    let pipeline = Pipeline::start(pool.clone(), sqs::client().await, worker, config)
        .await
        .context("cannot start the consumers")?;
    let _health = health::start(health_listen, pipeline.health()).await.map_err(anyhow::Error::msg)?;
    let running = Running { pool, pipeline };
    let mut shutdown = crate::dispatch::shutdown_on_signals();
    let _ = shutdown.wait_for(|stop| *stop).await;
    running.stop().await;
    Ok(())
}

/// Creates the database if it is missing, migrates, creates the queues and starts every piece.
/// `overrides` and `defaults` adjust the settings read from the environment.
pub async fn start(
    database_url: &str,
    args: &DevArgs,
    mut overrides: Vec<(&'static str, String)>,
    mut defaults: Vec<(&'static str, String)>,
) -> anyhow::Result<Running> {
    telemetry::init(config::log_format());
    super::commands::create_database_if_missing(database_url).await?;
    let pool = super::commands::connect(database_url).await?;
    store::migrate(&pool).await.context("migration failed")?;
    let client = sqs::client().await;
    let pair = sqs::ensure_queues(&client, &super::commands::queue_spec(&args.queues))
        .await
        .context("cannot create the queues (is the SQS endpoint up? `make localstack-up`)")?;
    tracing::info!(queue_url = %pair.queue_url, dlq_url = %pair.dlq_url, "queues ready");

    overrides.extend([
        ("DATABASE_URL", database_url.to_string()),
        ("ROWQ_QUEUE_URL", pair.queue_url.clone()),
        ("ROWQ_DLQ_URL", pair.dlq_url.clone()),
        ("ROWQ_FUNCTION_TIMEOUT_SECS", args.queues.function_timeout.to_string()),
    ]);
    defaults.push(("ROWQ_DB_POOL_SIZE", DEV_POOL_SIZE.to_string()));
    let lookup = config::overlay(overrides, defaults);
    let env = Env::new(&lookup);
    let scheduler = SchedulerConfig::from(&env)?;
    let worker_config = WorkerConfig::from(&env)?;
    let event_source = EventSourceConfig::from(&env)?;
    let worker_pool =
        store::connect(&worker_config.database, Session::Worker).await.context("cannot connect the worker pool")?;
    let worker = Worker::new(worker_pool, Registry::builtin(), worker_config);
    let scheduler_pool =
        store::connect_scheduler(&scheduler.database).await.context("cannot connect the scheduler pool")?;
    let config = PipelineConfig { scheduler, event_source, schedulers: args.schedulers };
    let pipeline =
        Pipeline::start(scheduler_pool, client, worker, config).await.context("cannot start the pipeline")?;
    Ok(Running { pool, pipeline })
}
