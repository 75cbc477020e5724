//! The local event-source runner: what Lambda's SQS event source mapping does, on one
//! machine and without Docker. Long-polls the queue (up to 10 messages), builds the same
//! `SqsEvent` Lambda would (same fields, system attributes), calls the handler with a
//! deadline like an invocation's, deletes the records not reported as failures, and leaves
//! the failures to reappear after the visibility timeout. Several pollers run at once.
//!
//! A poller takes its next batch as soon as the handlers of the one before have returned,
//! while that batch's outcomes are recorded and its messages deleted ([`HandlersReturned`]):
//! its handlers never run beside the next batch's, and the next batch's fence can go to
//! Postgres in the same statement as the previous batch's finish (`store::run::step`), when
//! both reach the worker's combiner while it gathers.
//!
//! It calls the worker's own [`crate::Worker::handle_batch`] (or the DLQ handler): it is a
//! transport, not a second implementation of the worker.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, Message, MessageSystemAttributeName};
use tokio::sync::{oneshot, watch};

use crate::health::Health;
use crate::sqs::{self, MAX_BATCH, SqsError};

/// Pause after a failed receive, so an unreachable endpoint is not hammered.
const RECEIVE_RETRY_DELAY: Duration = Duration::from_secs(1);

/// A poller's pause before its next receive after a batch whose every record was handed back
/// (the database unreachable, or refusing every connection): this long after the first such
/// batch, twice as long after each next one in a row, at most [`HANDED_BACK_PAUSE_MOST`]; none
/// once a batch gets through.
///
/// Without it, a poller whose worker failed at once (a refused login, no connection slot left)
/// received batch after batch and handed each back: within seconds the whole queue was in
/// flight, each message hidden for its visibility timeout (6 × the function timeout: minutes)
/// and a receive nearer the dead-letter queue, so that when the database came back the jobs
/// waited for their messages. Paused, a poller holds one batch per pause, and the rest stay
/// visible for the moment the database answers. (A database that does not answer at all is
/// paced already: each batch waits for the pool's 10 s before it fails.) On Lambda, the worker
/// answers such a batch with a function error instead, after which Lambda backs off
/// ([`crate::worker::lambda_answer`]).
pub const HANDED_BACK_PAUSE_FIRST: Duration = Duration::from_secs(1);
/// The longest pause after batches handed back whole ([`HANDED_BACK_PAUSE_FIRST`]).
pub const HANDED_BACK_PAUSE_MOST: Duration = Duration::from_secs(20);

/// The pause before a poller's next receive after `in_a_row` batches handed back whole.
fn handed_back_pause(in_a_row: u32) -> Duration {
    let doublings = in_a_row.saturating_sub(1).min(16);
    (HANDED_BACK_PAUSE_FIRST * 2u32.pow(doublings)).min(HANDED_BACK_PAUSE_MOST)
}

/// Time past a batch's deadline for its outcomes to be recorded and its messages deleted,
/// before a poller that has not come back counts as stuck.
const HEALTH_SLACK: Duration = Duration::from_secs(30);

/// Given to the handler with each batch, to send on when the batch's handlers have returned
/// and only its outcomes are left to record ([`crate::Worker::handle_batch_then`]): the poller
/// then takes its next batch. A handler that drops it unsent is waited for to the end, one
/// batch at a time.
pub type HandlersReturned = oneshot::Sender<()>;

/// Counts over a run, readable while it runs.
#[derive(Debug, Default)]
pub struct EventSourceTotals {
    pub batches: AtomicU64,
    pub records: AtomicU64,
    pub failures: AtomicU64,
    pub receive_errors: AtomicU64,
}

/// One queue, polled like an event source mapping.
pub struct EventSource {
    client: Client,
    queue_url: String,
    queue_arn: String,
    region: String,
    wait: Duration,
    function_timeout: Duration,
    totals: EventSourceTotals,
    /// What its pollers last did, each its own beat, for the health endpoint of `rowq work`
    /// ([`crate::health`]).
    health: Arc<Health>,
}

impl EventSource {
    /// Looks up the queue's ARN (records carry it as `eventSourceARN`).
    pub async fn new(
        client: Client,
        queue_url: &str,
        wait: Duration,
        function_timeout: Duration,
    ) -> Result<Self, SqsError> {
        let queue_arn = sqs::queue_arn(&client, queue_url).await?;
        let region = queue_arn.split(':').nth(3).unwrap_or("us-east-1").to_string();
        let name = queue_url.rsplit('/').next().unwrap_or(queue_url);
        // A poller beats once per long poll, or once per batch, which its deadline bounds.
        let health = Arc::new(Health::new(format!("queue {name}"), wait + function_timeout + HEALTH_SLACK));
        Ok(EventSource {
            client,
            queue_url: queue_url.to_string(),
            queue_arn,
            region,
            wait,
            function_timeout,
            totals: EventSourceTotals::default(),
            health,
        })
    }

    /// Its pollers' health, as the health endpoint reads it.
    pub fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    pub fn totals(&self) -> &EventSourceTotals {
        &self.totals
    }

    /// Runs `pollers` concurrent pollers until `shutdown` turns `true`. A batch being handled
    /// is always finished (handled and deleted) before a poller stops. The handler is told which
    /// poller (0-based) delivered each batch: the worker keeps each poller's statements in a
    /// lane of their own ([`crate::worker::LANES`]).
    ///
    /// Each poller holds one batch whose handlers run and, at most, one before it whose
    /// outcomes are being recorded and messages deleted: it receives again when the handler
    /// sends on [`HandlersReturned`], or returns. FIFO order is kept by SQS, which delivers no
    /// message of a group while an earlier one of that group is in flight (received and not
    /// yet deleted).
    pub async fn run<H, F>(self: Arc<Self>, pollers: usize, handler: H, shutdown: watch::Receiver<bool>)
    where
        H: Fn(SqsEvent, Instant, usize, HandlersReturned) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = SqsBatchResponse> + Send + 'static,
    {
        let mut tasks = tokio::task::JoinSet::new();
        self.health.set_pollers(pollers.max(1));
        for poller in 0..pollers.max(1) {
            let source = self.clone();
            let handler = handler.clone();
            let mut shutdown = shutdown.clone();
            tasks.spawn(async move {
                let mut batches = PollerBatches::default();
                // Batches handed back whole in a row, as their deliveries end (the last one may
                // end after the next receive); and how many of them the poller has paused for.
                let handed_back = Arc::new(AtomicU32::new(0));
                let mut paused_for = 0;
                while !*shutdown.borrow() {
                    let in_a_row = handed_back.load(Ordering::Relaxed);
                    if in_a_row != paused_for {
                        paused_for = in_a_row;
                        if in_a_row > 0 {
                            let pause = handed_back_pause(in_a_row);
                            tracing::warn!(
                                batches = in_a_row,
                                pause_ms = pause.as_millis() as u64,
                                "every record of the last batch was handed back; pausing before the next receive"
                            );
                            tokio::select! {
                                _ = shutdown.changed() => break,
                                _ = tokio::time::sleep(pause) => {}
                            }
                        }
                    }
                    tokio::select! {
                        _ = shutdown.changed() => break,
                        messages = source.receive(poller) => match messages {
                            Ok(messages) if messages.is_empty() => {}
                            Ok(messages) => {
                                let (returned, handlers_returned) = oneshot::channel();
                                let delivery = tokio::spawn({
                                    let (source, handler, handed_back) =
                                        (source.clone(), handler.clone(), handed_back.clone());
                                    async move {
                                        if source.deliver(messages, &handler, poller, returned).await {
                                            handed_back.fetch_add(1, Ordering::Relaxed);
                                        } else {
                                            handed_back.store(0, Ordering::Relaxed);
                                        }
                                    }
                                });
                                batches.hand_over(delivery, handlers_returned).await;
                            }
                            Err(error) => {
                                source.totals.receive_errors.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(error = %error, "receive failed; retrying");
                                tokio::time::sleep(RECEIVE_RETRY_DELAY).await;
                            }
                        },
                    }
                }
                batches.finish().await;
            });
        }
        while let Some(joined) = tasks.join_next().await {
            if let Err(error) = joined {
                tracing::error!(error = %error, "a poller stopped abnormally");
            }
        }
    }

    /// One receive → handle → delete cycle, as poller 0; returns how many records were handled.
    pub async fn poll_once<H, F>(&self, handler: &H) -> Result<usize, SqsError>
    where
        H: Fn(SqsEvent, Instant, usize, HandlersReturned) -> F,
        F: Future<Output = SqsBatchResponse>,
    {
        let messages = self.receive(0).await?;
        let count = messages.len();
        self.deliver(messages, handler, 0, oneshot::channel().0).await;
        Ok(count)
    }

    async fn receive(&self, poller: usize) -> Result<Vec<Message>, SqsError> {
        let received = self
            .client
            .receive_message()
            .queue_url(&self.queue_url)
            .max_number_of_messages(MAX_BATCH as i32)
            .wait_time_seconds(self.wait.as_secs() as i32)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .map(|output| output.messages.unwrap_or_default())
            .map_err(|e| SqsError::call("ReceiveMessage", &self.queue_url, e));
        self.health.record_by(poller, "receive", received.as_ref().err().map(ToString::to_string));
        received
    }

    /// Hands `messages` to `handler` and deletes those it did not hand back. Returns whether it
    /// handed every one of them back.
    async fn deliver<H, F>(
        &self,
        messages: Vec<Message>,
        handler: &H,
        poller: usize,
        returned: HandlersReturned,
    ) -> bool
    where
        H: Fn(SqsEvent, Instant, usize, HandlersReturned) -> F,
        F: Future<Output = SqsBatchResponse>,
    {
        if messages.is_empty() {
            return false;
        }
        let mut event = SqsEvent::default();
        event.records = messages.iter().map(|m| self.record(m)).collect();
        let deadline = Instant::now() + self.function_timeout;
        let response = handler(event, deadline, poller, returned).await;
        let failed: HashSet<&str> = response.batch_item_failures.iter().map(|f| f.item_identifier.as_str()).collect();
        self.totals.batches.fetch_add(1, Ordering::Relaxed);
        self.totals.records.fetch_add(messages.len() as u64, Ordering::Relaxed);
        self.totals.failures.fetch_add(failed.len() as u64, Ordering::Relaxed);
        let done: Vec<&Message> =
            messages.iter().filter(|m| !failed.contains(m.message_id().unwrap_or_default())).collect();
        self.delete(&done).await;
        let handed_back = (!failed.is_empty()).then(|| {
            format!(
                "{} of the last batch's {} messages were handed back for redelivery: the database \
                 unreachable, or no time left (the worker's log says which)",
                failed.len(),
                messages.len()
            )
        });
        let whole = crate::worker::hands_back_all(messages.len(), &response);
        self.health.record_by(poller, "batch", handed_back);
        whole
    }

    /// The record as the Lambda service builds it.
    fn record(&self, message: &Message) -> SqsMessage {
        let mut record = SqsMessage::default();
        record.message_id = message.message_id().map(str::to_string);
        record.receipt_handle = message.receipt_handle().map(str::to_string);
        record.body = message.body().map(str::to_string);
        record.md5_of_body = message.md5_of_body().map(str::to_string);
        record.attributes = message
            .attributes()
            .map(|attributes| attributes.iter().map(|(k, v)| (k.as_str().to_string(), v.clone())).collect())
            .unwrap_or_default();
        record.event_source = Some("aws:sqs".to_string());
        record.event_source_arn = Some(self.queue_arn.clone());
        record.aws_region = Some(self.region.clone());
        record
    }

    /// Deletes handled messages. A message whose delete fails comes back after the
    /// visibility timeout; its job is no longer waiting for it, so the fence drops it.
    async fn delete(&self, messages: &[&Message]) {
        for chunk in messages.chunks(MAX_BATCH) {
            let entries: Vec<DeleteMessageBatchRequestEntry> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, m)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(m.receipt_handle().unwrap_or_default())
                        .build()
                        .ok()
                })
                .collect();
            match self.client.delete_message_batch().queue_url(&self.queue_url).set_entries(Some(entries)).send().await
            {
                Ok(output) => {
                    for failure in output.failed() {
                        tracing::warn!(
                            code = failure.code(),
                            "a handled message could not be deleted; it will be redelivered and dropped"
                        );
                    }
                }
                Err(error) => {
                    tracing::warn!(error = %DisplayErrorContext(error), "handled messages could not be deleted; they will be redelivered and dropped")
                }
            }
        }
    }
}

/// One poller's batches: the one whose handlers run and, at most, one before it whose outcomes
/// are being recorded (and messages deleted). The in-memory benchmark's consumers use it too.
#[derive(Debug, Default)]
pub struct PollerBatches {
    finishing: Option<tokio::task::JoinHandle<()>>,
}

impl PollerBatches {
    /// Takes `delivery`, a batch just handed to its handler in a task of its own, and waits until
    /// its handlers have returned, as told on `handlers_returned`, or, if the handler drops that
    /// unsent, until the delivery is done. The batch before it is done by then too.
    pub async fn hand_over(&mut self, delivery: tokio::task::JoinHandle<()>, handlers_returned: oneshot::Receiver<()>) {
        let early = handlers_returned.await.is_ok();
        if let Some(previous) = self.finishing.take() {
            joined(previous).await;
        }
        if early {
            self.finishing = Some(delivery);
        } else {
            joined(delivery).await;
        }
    }

    /// Waits for the batch still finishing, if there is one.
    pub async fn finish(self) {
        if let Some(last) = self.finishing {
            joined(last).await;
        }
    }
}

/// Waits for a poller's batch to be handled and deleted; a panic in it is logged, and the
/// poller goes on.
async fn joined(delivery: tokio::task::JoinHandle<()>) {
    if let Err(error) = delivery.await {
        tracing::error!(error = %error, "a batch's delivery stopped abnormally");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_after_batches_handed_back_whole_doubles_up_to_its_most() {
        let pauses: Vec<u64> = (1..=7).map(|n| handed_back_pause(n).as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 20, 20]);
        assert_eq!(handed_back_pause(u32::MAX), HANDED_BACK_PAUSE_MOST);
    }
}
