//! # rowq — a Postgres table as a job queue whose work runs on AWS Lambda
//!
//! Enqueue is a plain `INSERT INTO rowq.jobs (kind, payload) VALUES (...)`, from any language,
//! inside your own transaction. A scheduler claims due rows atomically and publishes
//! `(job_id, dispatch_gen)` messages to an SQS FIFO queue; Lambda workers run each job by its
//! `kind` and record the outcome in the row; a DLQ handler fails poison jobs. Postgres is the
//! source of truth, SQS only the transport. Every write is fenced by the row's dispatch
//! generation (and attempt), so no duplicate message, crash or race runs a job twice.
//!
//! ```text
//! pending ──claim──▶ dispatched ──fence──▶ running ──ok──▶ succeeded
//!    ▲                   │                    │
//!    │                   │ lease expired      ├─error, attempts left──▶ pending (run_at = now + backoff)
//!    └───────────────────┘ (rescue)           ├─error, none left──────▶ failed
//!                                             └─deadline passed────────▶ pending / failed (rescue)
//! pending | dispatched ──cancel──▶ cancelled        any live message on the DLQ ──▶ failed
//! ```
//!
//! ## Modules
//!
//! - [`job`]: `JobId`, `JobState` (mirrors `rowq.job_state`), `JobMessage` (the SQS body), `JobError`.
//! - [`store`]: all SQL, one function per transition, each a guarded `UPDATE ... RETURNING`.
//! - [`dispatch`]: the scheduler: claim → publish → release failures; its loop.
//! - [`sqs`]: the `Publisher` seam (SQS and in-memory), client and queue set-up.
//! - [`worker`]: `Worker::handle_batch`: SQS batch in, partial batch response out.
//! - [`combine`]: group commit: concurrent batches of one worker share their fence and finish.
//! - [`handlers`]: the registry `kind → async fn(JobContext, T) -> Result<R, JobError>`.
//! - [`dlq`]: the dead-letter handler.
//! - [`event_source`]: the local stand-in for Lambda's SQS event source mapping.
//! - [`maintenance`]: rescue of stuck rows, pruning of finished rows.
//! - [`health`]: `/livez` and `/readyz` over HTTP for the scheduler and `rowq work` as services
//!   (`ROWQ_HEALTH_LISTEN`).
//! - [`metrics`]: CloudWatch Embedded Metric Format lines: the scheduler's gauges of its queue,
//!   what each of the worker's batches did by kind, the jobs the DLQ handler failed.
//! - [`pipeline`]: every piece in one process (`rowq dev`, end-to-end tests, benchmarks).
//! - [`entry`]: what the Lambda binaries and the scheduler run, on a one-thread runtime, compiled
//!   once here instead of in each binary.
//! - [`cli`]: the `rowq` command line (`migrate`, `enqueue`, `status`, `dev`, `demo`, ...),
//!   compiled here for the same reason.
//! - [`config`]: one struct per binary, from the environment.
//! - [`secret`]: the database URL from Secrets Manager at cold start.
//! - [`telemetry`]: tracing set-up and field names.
//!
//! The binaries in `src/bin/` only wire these together: `scheduler`, `worker` and
//! `dlq-handler` through [`entry`], `rowq` through [`cli`].

pub mod cli;
pub mod combine;
pub mod config;
pub mod dispatch;
pub mod dlq;
pub mod entry;
pub mod event_source;
pub mod handlers;
pub mod health;
pub mod job;
pub mod maintenance;
pub mod metrics;
pub mod pipeline;
pub mod secret;
pub mod sqs;
pub mod store;
pub mod telemetry;
pub mod worker;

pub use dispatch::{DispatchReport, Scheduler};
pub use handlers::{JobContext, Registry};
pub use job::{JobError, JobId, JobMessage, JobState};
pub use sqs::{MemoryPublisher, Publisher, SqsPublisher};
pub use worker::Worker;
