//! The whole pipeline in one process: schedulers, the worker behind the local event source,
//! and the DLQ handler behind another. `rowq dev`, the end-to-end tests and the benchmarks
//! run it; in AWS the same pieces run as separate Lambdas and a scheduler service.

use std::sync::Arc;
use std::time::Instant;

use aws_sdk_sqs::Client;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::config::{EventSourceConfig, SchedulerConfig};
use crate::dispatch::{RunTotals, Scheduler};
use crate::event_source::EventSource;
use crate::sqs::{SqsError, SqsPublisher};
use crate::worker::Worker;

/// How many of each piece to run.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub scheduler: SchedulerConfig,
    pub event_source: EventSourceConfig,
    /// Scheduler instances (they share the claim safely); 0 runs only the consumers.
    pub schedulers: usize,
}

/// Handles on a running pipeline.
pub struct Pipeline {
    tasks: tokio::task::JoinSet<Option<RunTotals>>,
    stop: watch::Sender<bool>,
    jobs: Arc<EventSource>,
    dead_letters: Option<Arc<EventSource>>,
}

impl Pipeline {
    /// Starts every piece in the background. `pool` serves the schedulers and the DLQ handler
    /// (open it with [`crate::store::connect_scheduler`]); the worker brings its own.
    pub async fn start(pool: PgPool, client: Client, worker: Worker, config: PipelineConfig) -> Result<Self, SqsError> {
        let (stop, shutdown) = watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..config.schedulers {
            let scheduler = Scheduler::new(
                pool.clone(),
                SqsPublisher::new(client.clone(), config.scheduler.queue_url.clone()),
                config.scheduler.clone(),
            );
            let shutdown = shutdown.clone();
            tasks.spawn(async move { Some(scheduler.run(shutdown, false).await) });
        }

        let source = &config.event_source;
        let jobs =
            Arc::new(EventSource::new(client.clone(), &source.queue_url, source.wait, source.function_timeout).await?);
        let metrics = worker.metrics().cloned();
        let worker = Arc::new(worker);
        let handler = {
            let worker = worker.clone();
            move |event, deadline: Instant, poller, returned| {
                let worker = worker.clone();
                async move { worker.handle_batch_then(event, deadline, poller, Some(returned)).await }
            }
        };
        tasks.spawn({
            let (jobs, shutdown, pollers) = (jobs.clone(), shutdown.clone(), source.pollers);
            async move {
                jobs.run(pollers, handler, shutdown).await;
                // The last batches' wakes for their groups, before the process goes.
                worker.settle().await;
                None
            }
        });

        let dead_letters = match &source.dlq_url {
            Some(dlq_url) => {
                let dlq =
                    Arc::new(EventSource::new(client.clone(), dlq_url, source.wait, source.function_timeout).await?);
                let handler = move |event, _deadline: Instant, _poller, _returned| {
                    let (pool, metrics) = (pool.clone(), metrics.clone());
                    async move { crate::dlq::handle_batch(&pool, event, metrics.as_ref()).await }
                };
                tasks.spawn({
                    let (dlq, shutdown) = (dlq.clone(), shutdown.clone());
                    async move {
                        dlq.run(1, handler, shutdown).await;
                        None
                    }
                });
                Some(dlq)
            }
            None => None,
        };
        Ok(Pipeline { tasks, stop, jobs, dead_letters })
    }

    /// The worker's event source (for its counters).
    pub fn jobs(&self) -> &EventSource {
        &self.jobs
    }

    pub fn dead_letters(&self) -> Option<&EventSource> {
        self.dead_letters.as_deref()
    }

    /// The health of its pollers, queue by queue, for the health endpoint of `rowq work`.
    pub fn health(&self) -> Vec<Arc<crate::health::Health>> {
        std::iter::once(&self.jobs).chain(&self.dead_letters).map(|source| source.health()).collect()
    }

    /// Asks every piece to stop after the batch in hand, and waits for them.
    pub async fn stop(mut self) -> RunTotals {
        let _ = self.stop.send(true);
        let mut totals = RunTotals::default();
        while let Some(joined) = self.tasks.join_next().await {
            match joined {
                Ok(Some(run)) => {
                    totals.passes += run.passes;
                    totals.claimed += run.claimed;
                    totals.published += run.published;
                    totals.released += run.released;
                }
                Ok(None) => {}
                Err(error) => tracing::error!(error = %error, "a pipeline task stopped abnormally"),
            }
        }
        totals
    }
}
