//! Group commit for the worker's two statements: the fences (and the finishes) that
//! concurrent batches of one process ask for at the same moment go to Postgres as one
//! statement.
//!
//! The local runner hands each of its pollers' batches (up to 10 records: the most a FIFO
//! queue delivers) to one shared [`crate::Worker`]. Each batch used to fence and finish in
//! statements of its own: two statements, each with a synchronous commit, per ten jobs, which
//! made the statements' fixed cost, not the rows, most of Postgres's work in a drain. A
//! [`Combiner`] runs at most [`STATEMENTS_IN_FLIGHT`] statements at a time; what arrives while
//! they run waits and then goes in the next one, whole. An idle process waits for nothing: a
//! request that finds a free slot is sent at once. A Lambda instance handles one batch at a
//! time, so there each statement is its own batch's, as before.
//!
//! Requests with the same key (the same job generation delivered to two concurrent batches)
//! are sent once; the answer goes to the first asker, and the other sees its request
//! unanswered — exactly what a losing fence sees. An error (the database went away) goes to
//! every batch of the statement.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot};

/// How many combined statements of one kind run at once. One keeps a whole backlog's batches
/// queuing behind a single statement; two lets Postgres work on one while the answer of the
/// other travels back. More gained nothing measurable on two cores (BENCHMARKS.md).
pub const STATEMENTS_IN_FLIGHT: usize = 2;

/// The most requests in one statement: the fence returns each job's payload (up to 1 MiB).
pub const MAX_REQUESTS: usize = 100;

/// What a statement returns to each of its batches: the answers to that batch's requests, or
/// the statement's error.
pub type Answer<R> = Result<Vec<R>, Arc<sqlx::Error>>;

/// Combines concurrent calls of one statement. Cheap to share; the task that sends the
/// statements ends when the combiner is dropped, after the statements in flight.
pub struct Combiner<Q, R> {
    entries: mpsc::UnboundedSender<Entry<Q, R>>,
}

struct Entry<Q, R> {
    requests: Vec<Q>,
    reply: oneshot::Sender<Answer<R>>,
}

impl<Q: Send + 'static, R: Send + 'static> Combiner<Q, R> {
    /// Starts the task that runs `execute` over the combined requests. An answer is routed to
    /// the batch whose request has the same key. Must be called within a Tokio runtime.
    pub fn spawn<K, F, Fut>(request_key: fn(&Q) -> K, answer_key: fn(&R) -> K, execute: F) -> Self
    where
        K: Eq + Hash + Send + 'static,
        F: Fn(Vec<Q>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<R>, sqlx::Error>> + Send + 'static,
    {
        let (entries, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run(receiver, request_key, answer_key, execute));
        Combiner { entries }
    }

    /// Runs `requests` in the next statement and returns their answers.
    pub async fn call(&self, requests: Vec<Q>) -> Answer<R> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, answer) = oneshot::channel();
        if self.entries.send(Entry { requests, reply }).is_err() {
            return Err(Arc::new(sqlx::Error::WorkerCrashed));
        }
        answer.await.unwrap_or_else(|_| Err(Arc::new(sqlx::Error::WorkerCrashed)))
    }
}

async fn run<Q, R, K, F, Fut>(
    mut receiver: mpsc::UnboundedReceiver<Entry<Q, R>>,
    request_key: fn(&Q) -> K,
    answer_key: fn(&R) -> K,
    execute: F,
) where
    K: Eq + Hash,
    F: Fn(Vec<Q>) -> Fut,
    Fut: Future<Output = Result<Vec<R>, sqlx::Error>>,
{
    let mut in_flight = FuturesUnordered::new();
    let mut waiting: Option<Entry<Q, R>> = None;
    loop {
        tokio::select! {
            biased;
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            entry = next_entry(&mut receiver, &mut waiting), if in_flight.len() < STATEMENTS_IN_FLIGHT => {
                let Some(first) = entry else { break };
                let mut entries = vec![first];
                let mut requests = entries[0].requests.len();
                while requests < MAX_REQUESTS {
                    match receiver.try_recv() {
                        Ok(entry) if requests + entry.requests.len() > MAX_REQUESTS => {
                            waiting = Some(entry);
                            break;
                        }
                        Ok(entry) => {
                            requests += entry.requests.len();
                            entries.push(entry);
                        }
                        Err(_) => break,
                    }
                }
                let mut combined = combine(entries, request_key);
                let requests = std::mem::take(&mut combined.requests);
                in_flight.push(answer(execute(requests), combined, answer_key));
            }
        }
    }
    while in_flight.next().await.is_some() {}
}

/// The entry that did not fit in the last statement, else the next one to arrive.
async fn next_entry<Q, R>(
    receiver: &mut mpsc::UnboundedReceiver<Entry<Q, R>>,
    waiting: &mut Option<Entry<Q, R>>,
) -> Option<Entry<Q, R>> {
    match waiting.take() {
        Some(entry) => Some(entry),
        None => receiver.recv().await,
    }
}

/// The requests of several entries in one list, each key once.
struct Combined<Q, R, K> {
    requests: Vec<Q>,
    /// Which entry asked first for each key.
    asker: HashMap<K, usize>,
    /// Where each entry's answers go.
    replies: Vec<oneshot::Sender<Answer<R>>>,
}

fn combine<Q, R, K: Eq + Hash>(entries: Vec<Entry<Q, R>>, request_key: fn(&Q) -> K) -> Combined<Q, R, K> {
    let mut combined =
        Combined { requests: Vec::new(), asker: HashMap::new(), replies: Vec::with_capacity(entries.len()) };
    for (index, entry) in entries.into_iter().enumerate() {
        for request in entry.requests {
            if let std::collections::hash_map::Entry::Vacant(first) = combined.asker.entry(request_key(&request)) {
                first.insert(index);
                combined.requests.push(request);
            }
        }
        combined.replies.push(entry.reply);
    }
    combined
}

/// Waits for the statement and routes its answers, by key, to who asked.
async fn answer<Q, R, K: Eq + Hash>(
    statement: impl Future<Output = Result<Vec<R>, sqlx::Error>>,
    combined: Combined<Q, R, K>,
    answer_key: fn(&R) -> K,
) {
    let Combined { asker, replies, .. } = combined;
    match statement.await {
        Ok(answers) => {
            let mut routed: Vec<Vec<R>> = replies.iter().map(|_| Vec::new()).collect();
            for answer in answers {
                if let Some(&index) = asker.get(&answer_key(&answer)) {
                    routed[index].push(answer);
                }
            }
            for (reply, answers) in replies.into_iter().zip(routed) {
                let _ = reply.send(Ok(answers)); // the batch gave up waiting: nothing to tell
            }
        }
        Err(error) => {
            let error = Arc::new(error);
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}
