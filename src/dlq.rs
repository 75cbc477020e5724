//! The dead-letter handler: a message SQS gave up on (received `maxReceiveCount` times
//! without being deleted) marks its job `failed`, guarded by the generation. Jobs already
//! terminal, or dispatched again since (a newer generation), are left alone.

use std::sync::Arc;
use std::time::SystemTime;

use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent};
use sqlx::PgPool;

use crate::config::MetricsTarget;
use crate::job::JobState;
use crate::store::admin::KindCount;
use crate::store::run;
pub use crate::worker::RECEIVE_COUNT_ATTRIBUTE;
use crate::worker::{batch_response, decode_record, lambda_answer};

/// Handles one batch from the DLQ. Only a database failure reports a record failed (SQS
/// delivers it again); malformed bodies are acknowledged and logged. A database that cannot
/// be reached, or refuses the login, fails the rest of the batch with it, untried: each try
/// would wait out the pool's acquire timeout (10 s) in turn, a batch of ten longer than the
/// function's timeout (30 s), which then ended it with nothing said.
///
/// A job still `dispatched` was never started, so it is no poison job: it goes back to
/// `pending`, no attempt spent ([`run::dead_letter`]). A job that goes back to be dispatched,
/// or a failed job of a group (its next one may go), wakes the schedulers, as the worker does. With
/// `metrics`, the batch ends with a line per kind of how many jobs it failed
/// ([`crate::metrics::dead_letters_lines`]): the poison jobs, by kind, which the worker never
/// finished and so never counted; and one of how many it sent back, if any.
pub async fn handle_batch(pool: &PgPool, event: SqsEvent, metrics: Option<&MetricsTarget>) -> SqsBatchResponse {
    let mut failed = Vec::new();
    let (mut group_moved, mut sent_back) = (false, 0u32);
    let mut by_kind: Vec<KindCount> = Vec::new();
    let (mut unavailable, mut untried) = (false, 0usize);
    for record in event.records {
        let Some((message_id, message)) = decode_record(&record) else {
            continue;
        };
        if unavailable {
            failed.push(message_id);
            untried += 1;
            continue;
        }
        let receives = record.attributes.get(RECEIVE_COUNT_ATTRIBUTE).map_or("an unknown number of", String::as_str);
        let reason = format!(
            "dead-lettered: its message (generation {}) was received {receives} times without being processed",
            message.dispatch_gen
        );
        let dead_letter = || run::dead_letter(pool, message.job_id, message.dispatch_gen, &reason);
        match crate::secret::once_more_if_rotated(dead_letter).await {
            Ok(Some(dead)) if dead.to != JobState::Failed => {
                sent_back += 1;
                tracing::warn!(
                    job.id = message.job_id.0, job.dispatch_gen = message.dispatch_gen, sqs.message_id = %message_id,
                    job.from = dead.from.as_str(), job.to = dead.to.as_str(), error = %reason,
                    "dead-lettered before any worker started it: dispatched again, no attempt spent"
                );
            }
            Ok(Some(dead)) => {
                group_moved |= dead.group_key.is_some();
                match by_kind.iter_mut().find(|counted| counted.kind == dead.kind) {
                    Some(counted) => counted.count += 1,
                    None => by_kind.push(KindCount { kind: dead.kind.clone(), count: 1 }),
                }
                tracing::error!(
                    job.id = message.job_id.0, job.dispatch_gen = message.dispatch_gen, sqs.message_id = %message_id,
                    job.from = dead.from.as_str(), job.to = "failed", error = %reason, "job dead-lettered"
                );
            }
            Ok(None) => tracing::info!(
                job.id = message.job_id.0, job.dispatch_gen = message.dispatch_gen, sqs.message_id = %message_id,
                "dead-letter message for a finished or re-dispatched job acknowledged"
            ),
            Err(error) => {
                crate::secret::note(&error);
                unavailable = crate::store::unreachable(&error) || crate::secret::login_refused(&error);
                tracing::error!(error = %error, sqs.message_id = %message_id, "could not record a dead letter: database unavailable; it will be redelivered");
                failed.push(message_id);
            }
        }
    }
    if untried > 0 {
        tracing::warn!(records = untried, "the rest of the batch handed back untried: the database cannot be reached");
    }
    let woken = if sent_back > 0 { Some("rescued") } else { group_moved.then_some("group") };
    if let Some(why) = woken
        && let Err(error) = crate::store::wake_schedulers(pool, why).await
    {
        tracing::warn!(error = %error, why, "could not wake the schedulers; they will poll");
    }
    if let Some(target) = metrics {
        crate::metrics::print(&crate::metrics::dead_letters_lines(
            &target.namespace,
            &target.queue,
            &by_kind,
            sent_back,
            SystemTime::now(),
        ));
    }
    batch_response(failed)
}

/// Runs the DLQ handler as a Lambda function, reporting to `metrics` if given.
pub async fn run_lambda(pool: PgPool, metrics: Option<MetricsTarget>) -> Result<(), lambda_runtime::Error> {
    let (pool, metrics) = (Arc::new(pool), Arc::new(metrics));
    lambda_runtime::run(lambda_runtime::service_fn(move |event: lambda_runtime::LambdaEvent<SqsEvent>| {
        let (pool, metrics) = (pool.clone(), metrics.clone());
        async move {
            let records = event.payload.records.len();
            lambda_answer(records, handle_batch(&pool, event.payload, metrics.as_ref().as_ref()).await)
        }
    }))
    .await
}
