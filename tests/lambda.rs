//! The worker and the DLQ handler as Lambda runs them: their own binaries polling a Lambda
//! Runtime API (the `lambda_runtime` crate's client against a stand-in server here), and what
//! they answer when the database is away.

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lambda_events::event::sqs::SqsEvent;
use rowq::config::DatabaseConfig;
use rowq::store::dispatch::claim_due;
use rowq::store::run::{StartRequest, start};
use rowq::{JobId, JobMessage, JobState, dlq};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::sync::{Mutex, mpsc};

/// What a function process answered for one invocation.
#[derive(Debug)]
enum Answer {
    /// Posted to `/invocation/{id}/response`: the partial batch response.
    Response(Value),
    /// Posted to `/invocation/{id}/error` (or `/init/error`): the function error.
    Error(Value),
}

/// A stand-in for the Runtime API one function process polls: it hands out the events given
/// to [`invoke`](Self::invoke) one at a time, and returns what the process answered.
struct RuntimeApi {
    address: std::net::SocketAddr,
    events: mpsc::UnboundedSender<Value>,
    answers: mpsc::UnboundedReceiver<Answer>,
}

type Pending = Arc<Mutex<mpsc::UnboundedReceiver<Value>>>;

impl RuntimeApi {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (events, pending) = mpsc::unbounded_channel();
        let (answer, answers) = mpsc::unbounded_channel();
        let pending: Pending = Arc::new(Mutex::new(pending));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, pending.clone(), answer.clone()));
            }
        });
        RuntimeApi { address, events, answers }
    }

    /// Invokes `function` with `event` and returns its answer.
    async fn invoke(&mut self, function: &mut Child, event: &SqsEvent) -> Answer {
        self.events.send(serde_json::to_value(event).unwrap()).unwrap();
        match tokio::time::timeout(Duration::from_secs(60), self.answers.recv()).await {
            Ok(Some(answer)) => answer,
            _ => {
                let _ = function.kill().await;
                let mut said = String::new();
                if let Some(mut stderr) = function.stderr.take() {
                    let _ = stderr.read_to_string(&mut said).await;
                }
                panic!("no answer in 60 s; the function said:\n{said}")
            }
        }
    }
}

/// Serves one connection of the runtime's client: requests in turn, each with its body.
async fn serve(stream: TcpStream, pending: Pending, answers: mpsc::UnboundedSender<Answer>) {
    static REQUESTS: AtomicUsize = AtomicUsize::new(0);
    let mut stream = BufReader::new(stream);
    loop {
        let mut request = String::new();
        if stream.read_line(&mut request).await.unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0;
        loop {
            let mut header = String::new();
            stream.read_line(&mut header).await.unwrap();
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        stream.read_exact(&mut body).await.unwrap();
        let path = request.split_whitespace().nth(1).unwrap_or_default();
        let reply = if path.ends_with("/invocation/next") {
            let Some(event) = pending.lock().await.recv().await else { return };
            let event = event.to_string();
            let deadline = SystemTime::now().duration_since(UNIX_EPOCH).unwrap() + Duration::from_secs(30);
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nlambda-runtime-aws-request-id: request-{}\r\n\
                 lambda-runtime-deadline-ms: {}\r\n\
                 lambda-runtime-invoked-function-arn: arn:aws:lambda:us-east-1:000000000000:function:rowq-test\r\n\
                 content-length: {}\r\n\r\n{event}",
                REQUESTS.fetch_add(1, Ordering::Relaxed),
                deadline.as_millis(),
                event.len()
            )
        } else {
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let answer = if path.ends_with("/response") { Answer::Response(body) } else { Answer::Error(body) };
            answers.send(answer).unwrap();
            "HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}".to_string()
        };
        stream.get_mut().write_all(reply.as_bytes()).await.unwrap();
    }
}

/// The function `binary` as Lambda starts it, on `api`, with its database at `database_url`.
fn function(binary: &str, api: &RuntimeApi, database_url: &str) -> Child {
    Command::new(binary)
        .env("AWS_LAMBDA_RUNTIME_API", api.address.to_string())
        .env("AWS_LAMBDA_FUNCTION_NAME", "rowq-test")
        .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128")
        .env("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST")
        .env("DATABASE_URL", database_url)
        .env("ROWQ_LOG_FORMAT", "text")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// An SQS event of `records`: (message id, body), all in one message group, each received 5 times.
fn event(records: &[(&str, String)]) -> SqsEvent {
    common::event(records.iter().map(|(id, body)| common::received(common::record(id, "g", body.clone()), 5)).collect())
}

/// A dispatched job, started too if `started` (as a worker that died with it leaves it), and
/// the body of its message.
async fn dispatched(pool: &PgPool, started: bool) -> (JobId, String) {
    let id = common::enqueue(pool, "noop", json!({})).await;
    let dispatch_gen = claim_due(pool, "default", 1, Duration::from_secs(60)).await.unwrap()[0].dispatch_gen;
    if started {
        start(pool, &[StartRequest { id, dispatch_gen, lease: Duration::from_secs(60) }]).await.unwrap();
    }
    (id, JobMessage::new(id, dispatch_gen).encode())
}

fn failures(ids: &[&str]) -> Value {
    json!({ "batchItemFailures": ids.iter().map(|id| json!({ "itemIdentifier": id })).collect::<Vec<_>>() })
}

/// A batch whose every record goes back because the database cannot be had is answered with
/// a function error: Lambda backs off after one, and not after a response that lists every
/// record. A batch of which something was acknowledged (here a malformed record) keeps its
/// partial response, or the acknowledged records would be delivered again; and with the
/// database back, the same batch runs.
#[tokio::test]
async fn a_lambda_that_hands_back_its_whole_batch_answers_with_a_function_error_so_lambda_backs_off() {
    let pool = common::database().await;
    let (url, outage) = common::database_behind_a_proxy(&pool).await;
    for (binary, ends) in
        [(env!("CARGO_BIN_EXE_worker"), JobState::Succeeded), (env!("CARGO_BIN_EXE_dlq-handler"), JobState::Failed)]
    {
        // The DLQ handler fails a job a worker started (an unstarted one it sends back).
        let started = ends == JobState::Failed;
        let (id, body) = dispatched(&pool, started).await;
        let before = if started { JobState::Running } else { JobState::Dispatched };
        let mut api = RuntimeApi::start().await;
        let mut function = function(binary, &api, &url);
        outage.send_replace(true);

        let partly = event(&[("job", body.clone()), ("garbage", "not a job message".into())]);
        match api.invoke(&mut function, &partly).await {
            Answer::Response(response) => assert_eq!(response, failures(&["job"]), "{binary}"),
            other => panic!("{binary}: the malformed record is acknowledged, so a partial response: {other:?}"),
        }
        let whole = event(&[("job", body)]);
        match api.invoke(&mut function, &whole).await {
            Answer::Error(error) => {
                assert_eq!(error["errorType"], "rowq::BatchHandedBack", "{binary}: {error}");
                assert!(
                    error["errorMessage"].as_str().unwrap().starts_with("every record of the batch (1) handed back")
                );
            }
            other => panic!("{binary}: every record handed back is a function error: {other:?}"),
        }
        assert_eq!(common::job(&pool, id).await.state, before, "{binary}: nothing ran");

        outage.send_replace(false);
        match api.invoke(&mut function, &whole).await {
            Answer::Response(response) => assert_eq!(response, failures(&[]), "{binary}"),
            other => panic!("{binary}: with the database back the batch is handled: {other:?}"),
        }
        assert_eq!(common::job(&pool, id).await.state, ends, "{binary}");
    }
}

/// A listener that takes each connection and closes it at once (a database that cannot be
/// had), counting them.
async fn closing_listener() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            drop(stream);
        }
    });
    (address, accepted)
}

/// The DLQ handler stops at the first record the database could not be reached for and hands
/// the rest back untried: each would wait out the pool's acquire timeout in turn, and ten of
/// them outlast the function's timeout. A malformed record is still acknowledged.
#[tokio::test]
async fn a_dlq_handler_whose_database_cannot_be_reached_hands_the_rest_of_its_batch_back_untried() {
    let (address, connections) = closing_listener().await;
    let config =
        DatabaseConfig { url: format!("postgres://postgres@{address}/nowhere"), pool_size: 2, secret_arn: None };
    let pool = rowq::store::connect_lazy(&config, rowq::store::Session::Worker).unwrap();
    let body = |id: i64| JobMessage::new(JobId(id), 1).encode();
    let batch = event(&[
        ("a", body(1)),
        ("b", body(2)),
        ("garbage", "not a job message".into()),
        ("c", body(3)),
        ("d", body(4)),
    ]);
    let response = dlq::handle_batch(&pool, batch, None).await;
    let failed: Vec<String> = response.batch_item_failures.into_iter().map(|f| f.item_identifier).collect();
    assert_eq!(failed, ["a", "b", "c", "d"]);
    assert_eq!(connections.load(Ordering::SeqCst), 1, "one try at the database, not one per record");
}
