//! Group commit for the worker's statements: the fences and the finishes that concurrent
//! batches of one process ask for at the same moment go to Postgres as one statement
//! (`store::run::step`).
//!
//! The local runner hands each of its pollers' batches (up to 10 records: the most a FIFO
//! queue delivers) to one shared [`crate::Worker`]. Each batch used to fence and finish in
//! statements of its own: two statements, each with a synchronous commit, per ten jobs, which
//! made the statements' fixed cost, not the rows, most of Postgres's work in a drain. A
//! [`Combiner`] runs at most [`STATEMENTS_IN_FLIGHT`] statements at a time; what arrives while
//! they run waits and then goes in the next one, whole. Before a statement leaves a busy
//! combiner, the batches that are about to ask (answered by the statement before, and already
//! running) get a few turns to join it ([`GATHER_TURNS`]). An idle one waits for nothing: a
//! request that finds it idle is sent at once. A Lambda instance handles one batch at a time,
//! so there each statement is its own batch's, as before. The worker runs one combiner per lane
//! of pollers ([`crate::worker::LANES`]), so that two chains of statements run out of phase.
//!
//! Requests with the same key (the same job generation delivered to two concurrent batches)
//! are sent once; the answer goes to the first asker, and the other sees its request
//! unanswered — exactly what a losing fence sees. An error (the database went away) goes to
//! every batch of the statement, and so does a panic inside it, as an error: the combiner
//! keeps serving the next batches.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// How many combined statements of one combiner run at once. One keeps a whole backlog's
/// batches queuing behind a single statement; two lets Postgres work on one while the answer of
/// the other travels back. More cost CPU per job on two cores and gained no throughput, with
/// fences and finishes in separate queues and again in one (BENCHMARKS.md). Since the pollers
/// came to move in lock-step (their next fence going with their last finish), the second slot
/// is rarely used; the worker's second lane is what runs a second chain
/// ([`crate::worker::LANES`]).
pub const STATEMENTS_IN_FLIGHT: usize = 2;

/// The most requests in one statement: one batch's finish and the next batch's fence for each
/// of ten pollers (`EventSource::run`). The fence returns each job's payload (up to 1 MiB):
/// those of jobs this process is about to run, which it holds while they run anyway. At 100,
/// eight pollers' finishes and fences (160 requests) went in two statements with a commit
/// each: 520–531 WAL flushes in a drain of 20,000 jobs, against 275–282 at 200 (BENCHMARKS.md,
/// round 22).
pub const MAX_REQUESTS: usize = 200;

/// How many times the combiner lets the other ready tasks run, while no request is waiting,
/// before it sends a statement. The batches a statement answers come straight back with their
/// next request — the finish, when the handler is fast; the fence of the next batch — but they
/// are woken by that answer in the same instant the combiner is, and without these turns the
/// next statement left with whichever request reached the queue first: the rest missed it by
/// microseconds and waited for a whole statement more. With 8 pollers a statement held 26
/// requests instead of ~40, and each extra statement is a synchronous commit: worker statements
/// per 20,000 jobs ~1,550 → ~1,000, CPU per job −12% and throughput +12% on average over nine
/// interleaved pairs (BENCHMARKS.md).
///
/// The turns are taken only while the combiner is busy: a statement is in flight, or one was
/// answered less than [`GATHER_WINDOW`] ago. A request that reaches an idle combiner — the
/// fence of a job that arrived on a quiet queue — has no batch behind it to wait for, and each
/// turn is a trip through the runtime's I/O driver, which let whatever else was ready run
/// first: on the pickup path the three turns were ~0.08 ms of insert→start at p50 (in-memory
/// latency / floor p50 1.51–1.54 with them, 1.38–1.48 without, four interleaved runs of three
/// pairs each, BENCHMARKS.md).
pub const GATHER_TURNS: usize = 3;

/// How long after a statement's answer the combiner still counts as busy. The batches that
/// answer wakes come back within microseconds when their handlers are fast; a request later
/// than this came from a batch the combiner did not just answer.
pub const GATHER_WINDOW: Duration = Duration::from_millis(1);

/// What a statement returns to each of its batches: the answers to that batch's requests, or
/// the statement's error.
pub type Answer<R> = Result<Vec<R>, Arc<sqlx::Error>>;

/// Combines concurrent calls of one statement; share it by reference. The task that sends
/// the statements ends when the combiner is dropped, after the statements in flight.
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
    let mut last_answer: Option<Instant> = None;
    loop {
        tokio::select! {
            biased;
            Some(()) = in_flight.next(), if !in_flight.is_empty() => last_answer = Some(Instant::now()),
            entry = next_entry(&mut receiver, &mut waiting), if in_flight.len() < STATEMENTS_IN_FLIGHT => {
                let Some(first) = entry else { break };
                let mut entries = vec![first];
                let mut requests = entries[0].requests.len();
                let busy = !in_flight.is_empty() || last_answer.is_some_and(|at| at.elapsed() < GATHER_WINDOW);
                let mut turns = if busy { GATHER_TURNS } else { 0 };
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
                        Err(TryRecvError::Empty) if turns > 0 => {
                            turns -= 1;
                            tokio::task::yield_now().await;
                        }
                        Err(_) => break,
                    }
                }
                let (requests, routes) = combine(entries, request_key);
                // A statement that panicked fails its batches, not the worker: the task goes on.
                let statement = AssertUnwindSafe(execute(requests)).catch_unwind().map(|result| {
                    result.unwrap_or_else(|_| Err(sqlx::Error::Protocol("the combined statement panicked".into())))
                });
                in_flight.push(answer(statement, routes, answer_key));
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

/// Where the answers of one statement go.
struct Routes<R, K> {
    /// Which entry asked first for each key.
    asker: HashMap<K, usize>,
    /// Where each entry's answers go.
    replies: Vec<oneshot::Sender<Answer<R>>>,
}

/// The requests of several entries in one list, each key once, and where their answers go.
fn combine<Q, R, K: Eq + Hash>(entries: Vec<Entry<Q, R>>, request_key: fn(&Q) -> K) -> (Vec<Q>, Routes<R, K>) {
    let mut requests = Vec::new();
    let mut routes = Routes { asker: HashMap::new(), replies: Vec::with_capacity(entries.len()) };
    for (index, entry) in entries.into_iter().enumerate() {
        for request in entry.requests {
            if let std::collections::hash_map::Entry::Vacant(first) = routes.asker.entry(request_key(&request)) {
                first.insert(index);
                requests.push(request);
            }
        }
        routes.replies.push(entry.reply);
    }
    (requests, routes)
}

/// Waits for the statement and routes its answers, by key, to who asked.
async fn answer<R, K: Eq + Hash>(
    statement: impl Future<Output = Result<Vec<R>, sqlx::Error>>,
    routes: Routes<R, K>,
    answer_key: fn(&R) -> K,
) {
    let Routes { asker, replies } = routes;
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

#[cfg(test)]
mod tests {
    use super::*;

    type Sizes = Arc<std::sync::Mutex<Vec<usize>>>;

    /// A statement that answers each request with itself, and fails or panics when asked to.
    fn echo() -> Combiner<i32, i32> {
        echo_counting(Sizes::default())
    }

    /// [`echo`], recording how many requests each statement had.
    fn echo_counting(sizes: Sizes) -> Combiner<i32, i32> {
        Combiner::spawn(
            |q: &i32| *q,
            |r: &i32| *r,
            move |requests: Vec<i32>| {
                sizes.lock().unwrap().push(requests.len());
                async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if requests.contains(&-1) {
                        return Err(sqlx::Error::PoolClosed);
                    }
                    assert!(!requests.contains(&-2), "asked to panic");
                    Ok(requests)
                }
            },
        )
    }

    #[tokio::test]
    async fn each_caller_gets_the_answers_to_its_own_requests_and_a_repeated_one_goes_to_the_first() {
        let combiner = echo();
        let (a, b, c) = tokio::join!(combiner.call(vec![1, 2]), combiner.call(vec![3, 2]), combiner.call(vec![4]));
        assert_eq!((a.unwrap(), b.unwrap(), c.unwrap()), (vec![1, 2], vec![3], vec![4]));
        assert!(combiner.call(Vec::new()).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_error_reaches_every_caller_of_the_statement_and_a_panic_does_not_stop_the_combiner() {
        let combiner = echo();
        // On this single-threaded runtime both calls are queued before the task runs: one statement.
        let (first, second) = tokio::join!(combiner.call(vec![1]), combiner.call(vec![-1]));
        assert!(matches!(*first.unwrap_err(), sqlx::Error::PoolClosed));
        assert!(matches!(*second.unwrap_err(), sqlx::Error::PoolClosed));

        let panicked = combiner.call(vec![-2]).await.unwrap_err();
        assert!(panicked.to_string().contains("panicked"), "{panicked}");
        assert_eq!(combiner.call(vec![8]).await.unwrap(), vec![8], "still serving after a panic");
    }

    /// Two callers, the second one turn late, as a batch is that was answered in the same
    /// instant as the combiner woke for the first: on this single-threaded runtime the combiner
    /// runs between the two.
    async fn one_late(combiner: &Combiner<i32, i32>, first: i32, second: i32) {
        let late = async {
            tokio::task::yield_now().await;
            combiner.call(vec![second]).await
        };
        let answers = tokio::join!(combiner.call(vec![first]), late);
        assert_eq!((answers.0.unwrap(), answers.1.unwrap()), (vec![first], vec![second]));
    }

    // The clock is paused: it moves only by the statements' sleeps and the tests' own.
    #[tokio::test(start_paused = true)]
    async fn a_request_made_while_a_busy_combiner_gathers_the_next_statement_goes_in_it() {
        let sizes = Sizes::default();
        let combiner = echo_counting(sizes.clone());
        combiner.call(vec![0]).await.unwrap(); // answered just now: the combiner is busy
        one_late(&combiner, 1, 2).await;
        assert_eq!(*sizes.lock().unwrap(), vec![1, 2], "the late request waited for a statement of its own");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_finds_the_combiner_idle_leaves_at_once() {
        let sizes = Sizes::default();
        let combiner = echo_counting(sizes.clone());
        one_late(&combiner, 1, 2).await; // nothing answered yet
        combiner.call(vec![3]).await.unwrap();
        tokio::time::sleep(GATHER_WINDOW * 2).await; // answered, but no longer just now
        one_late(&combiner, 4, 5).await;
        assert_eq!(*sizes.lock().unwrap(), vec![1, 1, 1, 1, 1], "an idle combiner waited for a request");
    }

    #[tokio::test]
    async fn requests_beyond_the_statement_limit_wait_for_the_next_statement() {
        let sizes = Sizes::default();
        let combiner = echo_counting(sizes.clone());
        let big: Vec<i32> = (0..MAX_REQUESTS as i32 - 5).collect();
        let more: Vec<i32> = (1000..1010).collect();
        let (a, b, c) = tokio::join!(combiner.call(vec![500]), combiner.call(big.clone()), combiner.call(more.clone()));
        let answers = [a, b, c].map(|answer| answer.map_err(|error| error.to_string()));
        assert_eq!(answers, [Ok(vec![500]), Ok(big), Ok(more)]);
        assert_eq!(*sizes.lock().unwrap(), vec![MAX_REQUESTS - 4, 10], "the third caller did not fit in the first");
    }
}
