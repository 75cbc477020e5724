//! SQS: the one seam of rowq. [`Publisher`] sends job messages; [`SqsPublisher`] is the real
//! one, [`MemoryPublisher`] keeps them in memory for tests and benchmarks (and can be told to
//! fail). Also the client set-up and the idempotent creation of the FIFO queue and its DLQ.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{QueueAttributeName, SendMessageBatchRequestEntry};

use crate::job::JobMessage;

/// SQS's limit on entries per `SendMessageBatch` / `DeleteMessageBatch` call.
pub const MAX_BATCH: usize = 10;

/// A job message, the FIFO group it goes to, and its deduplication id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub message: JobMessage,
    pub group_id: String,
    pub dedup_id: String,
}

/// One entry of a batch that SQS refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryFailure {
    /// Position of the entry in the batch.
    pub index: usize,
    pub reason: String,
}

/// A call to SQS that failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum SqsError {
    #[error("SQS {operation} on {queue_url} failed: {detail}")]
    Call { operation: &'static str, queue_url: String, detail: String },
    #[error("SQS {operation}: {detail}")]
    Request { operation: &'static str, detail: String },
}

impl SqsError {
    pub(crate) fn call<E, R>(operation: &'static str, queue_url: &str, error: SdkError<E, R>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: std::fmt::Debug,
    {
        SqsError::Call { operation, queue_url: queue_url.to_string(), detail: describe(error) }
    }
}

/// One line for an SDK error: the service's code and message when SQS answered, else the
/// transport's chain of causes (connection refused, timeout, ...).
fn describe<E, R>(error: SdkError<E, R>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match error.as_service_error() {
        Some(service) => {
            format!("{}: {}", service.code().unwrap_or("error"), service.message().unwrap_or("no message"))
        }
        None => DisplayErrorContext(error).to_string(),
    }
}

/// Sends job messages. The only trait in rowq: the seam between the scheduler and the queue.
pub trait Publisher: Send + Sync {
    /// Sends up to [`MAX_BATCH`] messages in one call. `Ok` lists the entries that were
    /// refused (the others were accepted); `Err` means none may be assumed sent.
    fn send_batch(&self, batch: &[Outgoing]) -> impl Future<Output = Result<Vec<EntryFailure>, SqsError>> + Send;
}

/// A shared publisher publishes like the one it shares (the scheduler owns its publisher;
/// benchmarks keep a handle on the in-memory one to consume from it).
impl<P: Publisher> Publisher for std::sync::Arc<P> {
    fn send_batch(&self, batch: &[Outgoing]) -> impl Future<Output = Result<Vec<EntryFailure>, SqsError>> + Send {
        self.as_ref().send_batch(batch)
    }
}

/// The real publisher: `SendMessageBatch` on a FIFO queue.
#[derive(Debug, Clone)]
pub struct SqsPublisher {
    client: Client,
    queue_url: String,
}

impl SqsPublisher {
    pub fn new(client: Client, queue_url: impl Into<String>) -> Self {
        SqsPublisher { client, queue_url: queue_url.into() }
    }
}

impl Publisher for SqsPublisher {
    async fn send_batch(&self, batch: &[Outgoing]) -> Result<Vec<EntryFailure>, SqsError> {
        let entries = batch
            .iter()
            .enumerate()
            .map(|(index, outgoing)| {
                SendMessageBatchRequestEntry::builder()
                    .id(index.to_string())
                    .message_body(outgoing.message.encode())
                    .message_group_id(&outgoing.group_id)
                    .message_deduplication_id(&outgoing.dedup_id)
                    .build()
                    .map_err(|e| SqsError::Request { operation: "SendMessageBatch", detail: e.to_string() })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output = self
            .client
            .send_message_batch()
            .queue_url(&self.queue_url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| SqsError::call("SendMessageBatch", &self.queue_url, e))?;
        Ok(output
            .failed()
            .iter()
            .map(|failure| EntryFailure {
                index: failure.id().parse().unwrap_or(usize::MAX),
                reason: format!("{}: {}", failure.code(), failure.message().unwrap_or("no message")),
            })
            .collect())
    }
}

/// Keeps sent messages in memory, in order. For tests and the in-memory benchmark transport.
///
/// Like an SQS long poll, a message wakes one waiting receiver, not all of them: a send wakes
/// one, and a receiver that leaves messages behind wakes the next. Waking every waiting
/// receiver for each message (the benchmark's eight pollers) put seven futile turns of the
/// thread ahead of the one that took it, on the pickup path of every job (BENCHMARKS.md,
/// round 27).
#[derive(Debug, Default)]
pub struct MemoryPublisher {
    sent: Mutex<VecDeque<Outgoing>>,
    failing: AtomicBool,
    arrived: tokio::sync::Notify,
}

impl MemoryPublisher {
    pub fn new() -> Self {
        Self::default()
    }

    /// While `true`, every call fails as a whole, like an unreachable endpoint.
    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
    }

    /// Takes every message sent so far.
    pub fn take(&self) -> Vec<Outgoing> {
        self.take_up_to(usize::MAX)
    }

    /// Takes the oldest `max` messages at most; wakes another receiver if any are left.
    pub fn take_up_to(&self, max: usize) -> Vec<Outgoing> {
        let (taken, left) = {
            let mut sent = self.sent.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let n = max.min(sent.len());
            (sent.drain(..n).collect(), !sent.is_empty())
        };
        if left {
            self.arrived.notify_one(); // after the lock: the receiver woken takes it next
        }
        taken
    }

    /// Waits up to `wait` for messages, then takes the oldest `max` (like a long poll). A send
    /// that comes between the first look and the wait is not missed: `notify_one` keeps a
    /// permit for the next waiter when nobody waits yet. A wake-up that finds nothing (such a
    /// permit, left by a send whose messages another receiver took without waiting) waits
    /// again, until `wait` is up.
    pub async fn receive(&self, max: usize, wait: Duration) -> Vec<Outgoing> {
        let until = tokio::time::Instant::now() + wait;
        loop {
            let batch = self.take_up_to(max);
            if !batch.is_empty() {
                return batch;
            }
            if tokio::time::timeout_at(until, self.arrived.notified()).await.is_err() {
                return self.take_up_to(max);
            }
        }
    }
}

impl Publisher for MemoryPublisher {
    async fn send_batch(&self, batch: &[Outgoing]) -> Result<Vec<EntryFailure>, SqsError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(SqsError::Call {
                operation: "SendMessageBatch",
                queue_url: "memory".into(),
                detail: "the in-memory queue is set to fail".into(),
            });
        }
        self.sent.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend(batch.iter().cloned());
        self.arrived.notify_one();
        Ok(Vec::new())
    }
}

/// The standard AWS configuration chain (`AWS_REGION`, `AWS_ENDPOINT_URL` for LocalStack,
/// credentials) over an HTTPS client whose TLS is rustls with *ring*, the same crypto the
/// Postgres driver uses. The SDK's default client would bring aws-lc, a C library whose build
/// was the longest single step of a clean build (50 s of its two cores here), for the same TLS.
pub fn aws_config() -> aws_config::ConfigLoader {
    let https = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(https)
}

/// An SQS client from [`aws_config`], with timeouts so that an endpoint that goes away fails a
/// call instead of hanging it.
pub async fn client() -> Client {
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(3))
        .operation_attempt_timeout(Duration::from_secs(25))
        .build();
    let config = aws_config().timeout_config(timeouts).load().await;
    Client::new(&config)
}

/// A FIFO jobs queue and its FIFO dead-letter queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuePair {
    pub queue_url: String,
    pub queue_arn: String,
    pub dlq_url: String,
    pub dlq_arn: String,
}

/// How to create a [`QueuePair`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSpec {
    /// Base name: the queues are `{name}.fifo` and `{name}-dlq.fifo`.
    pub name: String,
    /// Receives before a message moves to the DLQ.
    pub max_receive_count: u32,
    /// Should be at least 6 × the worker's function timeout.
    pub visibility_timeout: Duration,
}

/// Creates the queue pair, or brings existing queues to `spec` (idempotent).
pub async fn ensure_queues(client: &Client, spec: &QueueSpec) -> Result<QueuePair, SqsError> {
    let dlq_attributes = HashMap::from([
        (QueueAttributeName::FifoQueue, "true".to_string()),
        (QueueAttributeName::MessageRetentionPeriod, (14 * 24 * 3600).to_string()),
    ]);
    let dlq_url = ensure_queue(client, &format!("{}-dlq.fifo", spec.name), dlq_attributes).await?;
    let dlq_arn = queue_arn(client, &dlq_url).await?;
    let redrive = serde_json::json!({
        "deadLetterTargetArn": dlq_arn,
        "maxReceiveCount": spec.max_receive_count.to_string(),
    });
    let attributes = HashMap::from([
        (QueueAttributeName::FifoQueue, "true".to_string()),
        (QueueAttributeName::VisibilityTimeout, spec.visibility_timeout.as_secs().to_string()),
        (QueueAttributeName::RedrivePolicy, redrive.to_string()),
    ]);
    let queue_url = ensure_queue(client, &format!("{}.fifo", spec.name), attributes).await?;
    let queue_arn = queue_arn(client, &queue_url).await?;
    Ok(QueuePair { queue_url, queue_arn, dlq_url, dlq_arn })
}

async fn ensure_queue(
    client: &Client,
    name: &str,
    attributes: HashMap<QueueAttributeName, String>,
) -> Result<String, SqsError> {
    let created = client.create_queue().queue_name(name).set_attributes(Some(attributes.clone())).send().await;
    match created {
        Ok(output) => output.queue_url().map(str::to_string).ok_or_else(|| SqsError::Request {
            operation: "CreateQueue",
            detail: format!("no URL returned for {name}"),
        }),
        Err(error) if error.as_service_error().is_some_and(|e| e.is_queue_name_exists()) => {
            // Exists with other attributes: look it up and bring it to the spec.
            let url = queue_url(client, name).await?;
            let mut settable = attributes;
            settable.remove(&QueueAttributeName::FifoQueue);
            client
                .set_queue_attributes()
                .queue_url(&url)
                .set_attributes(Some(settable))
                .send()
                .await
                .map_err(|e| SqsError::call("SetQueueAttributes", &url, e))?;
            Ok(url)
        }
        Err(error) => Err(SqsError::call("CreateQueue", name, error)),
    }
}

/// The ARN of a queue (what Lambda's event records carry as `eventSourceARN`).
pub async fn queue_arn(client: &Client, queue_url: &str) -> Result<String, SqsError> {
    let output = client
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| SqsError::call("GetQueueAttributes", queue_url, e))?;
    output.attributes().and_then(|attributes| attributes.get(&QueueAttributeName::QueueArn)).cloned().ok_or_else(|| {
        SqsError::Request { operation: "GetQueueAttributes", detail: format!("no QueueArn for {queue_url}") }
    })
}

/// Messages on a queue: waiting (visible) and received but not yet deleted (in flight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct QueueDepth {
    pub visible: u64,
    pub in_flight: u64,
}

/// The URL of a queue by name.
pub async fn queue_url(client: &Client, name: &str) -> Result<String, SqsError> {
    client
        .get_queue_url()
        .queue_name(name)
        .send()
        .await
        .map_err(|e| SqsError::call("GetQueueUrl", name, e))?
        .queue_url()
        .map(str::to_string)
        .ok_or_else(|| SqsError::Request { operation: "GetQueueUrl", detail: format!("no URL for {name}") })
}

/// How many messages a queue holds (SQS's approximate counts).
pub async fn queue_depth(client: &Client, queue_url: &str) -> Result<QueueDepth, SqsError> {
    let output = client
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .map_err(|e| SqsError::call("GetQueueAttributes", queue_url, e))?;
    let count = |name: &QueueAttributeName| {
        output.attributes().and_then(|a| a.get(name)).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    Ok(QueueDepth {
        visible: count(&QueueAttributeName::ApproximateNumberOfMessages),
        in_flight: count(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::time::Instant;

    use super::*;
    use crate::job::JobId;

    fn outgoing(ids: std::ops::Range<i64>) -> Vec<Outgoing> {
        ids.map(|id| {
            let message = JobMessage::new(JobId(id), 1);
            Outgoing { message, group_id: format!("g{id}"), dedup_id: format!("d{id}") }
        })
        .collect()
    }

    /// Receivers already waiting when `sent` messages arrive in one send: when each returned
    /// (the clock is paused, so a receiver that was never woken returns at `WAIT` exactly) and
    /// how many messages it took.
    async fn waiting_receivers(receivers: usize, sent: i64) -> Vec<(Duration, usize)> {
        const WAIT: Duration = Duration::from_secs(20);
        let queue = Arc::new(MemoryPublisher::new());
        let start = Instant::now();
        let waiting: Vec<_> = (0..receivers)
            .map(|_| {
                let queue = queue.clone();
                tokio::spawn(async move {
                    let batch = queue.receive(MAX_BATCH, WAIT).await;
                    (start.elapsed(), batch.len())
                })
            })
            .collect();
        tokio::task::yield_now().await; // every receiver is waiting
        queue.send_batch(&outgoing(0..sent)).await.expect("the in-memory queue accepts");
        let mut returned = Vec::new();
        for receiver in waiting {
            returned.push(receiver.await.expect("receiver"));
        }
        returned.sort();
        returned
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_wakes_one_waiting_receiver_and_the_others_keep_waiting() {
        let returned = waiting_receivers(3, 1).await;
        assert_eq!(
            returned,
            [(Duration::ZERO, 1), (Duration::from_secs(20), 0), (Duration::from_secs(20), 0)],
            "one receiver takes the message at once; the others wait out their long poll"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_receiver_woken_with_nothing_to_take_waits_out_its_long_poll() {
        let queue = MemoryPublisher::new();
        queue.send_batch(&outgoing(0..1)).await.expect("the in-memory queue accepts"); // nobody waits
        assert_eq!(queue.take().len(), 1, "taken without waiting: the send's wake-up is left over");
        let start = Instant::now();
        let batch = queue.receive(MAX_BATCH, Duration::from_secs(20)).await;
        assert_eq!((start.elapsed(), batch.len()), (Duration::from_secs(20), 0));
    }

    #[tokio::test(start_paused = true)]
    async fn messages_left_by_one_receiver_wake_the_next_at_once() {
        let returned = waiting_receivers(3, 25).await;
        assert_eq!(returned, [(Duration::ZERO, 5), (Duration::ZERO, 10), (Duration::ZERO, 10)]);
    }
}
