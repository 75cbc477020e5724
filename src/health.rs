//! The scheduler's health over HTTP (`ROWQ_HEALTH_LISTEN`), for an orchestrator that runs it as
//! a long-lived service (ECS, Kubernetes, Nomad, a load balancer's target check).
//!
//! The dispatch loop beats each time a claim or a `SendMessageBatch` call completes
//! ([`Health::beat`]) and, at the end of each pass, records what failed in it, if anything
//! ([`Health::pass_ended`]). Two paths answer from those:
//!
//! - `GET /livez`: 200 while the loop turns: a beat within [`Health::stale_after`] (before the
//!   first beat, that long after start). A scheduler whose loop is stuck (a statement that never
//!   returns on a connection the network dropped without a word) answers 503, and an
//!   orchestrator that restarts it on that fixes it. A database or SQS that is down does not make
//!   it fail: the loop goes on trying (and beating), and a restart would not bring either back.
//! - `GET /readyz`: 200 when the loop turns and its last pass claimed and published without an
//!   error: it is dispatching. 503 otherwise, naming the error (and before the first pass ends).
//!
//! Each answers a small JSON object: `{"live":true,"ready":false,"last_beat_ms_ago":120,
//! "error":"..."}`. The server reads one request per connection and closes it; it serves
//! nothing else.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long the loop may go without a beat before `/livez` fails, at the least. The loop beats
/// at least once per poll interval while idle, and once per back-off (10 s at most) while the
/// database or SQS fails.
pub const MIN_STALE_AFTER: Duration = Duration::from_secs(60);

/// How much of a request is read: a request line and a few headers.
const MAX_REQUEST: usize = 2048;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The dispatch loop's last beat and last pass, shared with the health server.
#[derive(Debug)]
pub struct Health {
    started: Instant,
    stale_after: Duration,
    last: Mutex<Last>,
}

#[derive(Debug, Clone, Default)]
struct Last {
    beat: Option<Instant>,
    /// How the last pass ended: `Some(None)` without an error; `None` before the first.
    pass: Option<Option<String>>,
}

/// What the health paths report, at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The loop turns: it beat within `stale_after` (or started less than that ago).
    pub live: bool,
    /// It turns, and its last pass ended without an error.
    pub ready: bool,
    /// Since the last beat; `None` before the first.
    pub since_beat: Option<Duration>,
    /// Why it is not ready: the last pass's error, a stuck loop, or no pass yet.
    pub error: Option<String>,
}

impl Health {
    /// A loop polled at least every `poll_interval` when idle: it is stale after three of
    /// those, and never before [`MIN_STALE_AFTER`].
    pub fn new(poll_interval: Duration) -> Self {
        Health {
            started: Instant::now(),
            stale_after: MIN_STALE_AFTER.max(poll_interval * 3),
            last: Mutex::new(Last::default()),
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Last> {
        self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// A claim or a send completed, well or not: the loop turns.
    pub fn beat(&self) {
        self.last().beat = Some(Instant::now());
    }

    /// A pass ended, with `error` if a claim, a send or a release failed in it.
    pub fn pass_ended(&self, error: Option<String>) {
        let mut last = self.last();
        last.beat = Some(Instant::now());
        last.pass = Some(error);
    }

    pub fn status(&self) -> Status {
        self.status_at(Instant::now())
    }

    fn status_at(&self, now: Instant) -> Status {
        let last = self.last().clone();
        let since_beat = last.beat.map(|at| now.saturating_duration_since(at));
        let live = since_beat.unwrap_or_else(|| now.saturating_duration_since(self.started)) <= self.stale_after;
        let error = last.pass.unwrap_or_else(|| Some("no dispatch pass has ended yet".to_string()));
        let ready = live && error.is_none();
        let error = match (live, since_beat) {
            (false, Some(since)) => Some(format!(
                "the dispatch loop has not completed a claim or send for {} s (more than {} s)",
                since.as_secs(),
                self.stale_after.as_secs()
            )),
            _ => error,
        };
        Status { live, ready, since_beat, error }
    }
}

/// Binds `address` for [`serve`]; the error names the setting.
pub async fn bind(address: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(address).await.map_err(|error| format!("cannot listen on ROWQ_HEALTH_LISTEN={address}: {error}"))
}

/// Answers health requests on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, health: Arc<Health>) {
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "health endpoint listening (/livez, /readyz)");
    }
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let health = health.clone();
                tokio::spawn(async move {
                    if let Err(error) = answer(stream, &health).await {
                        tracing::debug!(error = %error, "health request not answered");
                    }
                });
            }
            Err(error) => {
                // Out of file descriptors, say: wait rather than spin.
                tracing::warn!(error = %error, "health endpoint cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn answer(mut stream: TcpStream, health: &Health) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(256);
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        let mut chunk = [0u8; 512];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < MAX_REQUEST {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            request.extend_from_slice(&chunk[..n]);
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    match read {
        Ok(result) => result?,
        Err(_elapsed) => return Ok(()), // no request in time: close
    }
    let (code, body) = respond(&request, health.status());
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let head_only = request.starts_with(b"HEAD ");
    stream.write_all(head.as_bytes()).await?;
    if !head_only {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}

/// `scheduler --health-check`: asks the scheduler serving on `address` (`ROWQ_HEALTH_LISTEN`;
/// an unspecified IP, `0.0.0.0` or `::`, is asked on loopback) for `path`; its body when it
/// answers 200, else why not. For a container health check that runs a command, in an image
/// without curl.
pub fn check(address: SocketAddr, path: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut target = address;
    if target.ip().is_unspecified() {
        target.set_ip(if target.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    let unanswered = |error: std::io::Error| format!("no health answer on {target}: {error}");
    let mut stream = std::net::TcpStream::connect_timeout(&target, READ_TIMEOUT).map_err(unanswered)?;
    stream.set_read_timeout(Some(READ_TIMEOUT)).map_err(unanswered)?;
    stream.set_write_timeout(Some(READ_TIMEOUT)).map_err(unanswered)?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n").map_err(unanswered)?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(unanswered)?;
    let code = response.split(' ').nth(1).unwrap_or_default();
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    match code {
        "200" => Ok(body.to_string()),
        _ => Err(format!("{path} on {target} answered {code}: {body}")),
    }
}

/// The status code and JSON body for the request `request` (its first bytes).
fn respond(request: &[u8], status: Status) -> (u16, String) {
    let line = request.split(|&b| b == b'\r' || b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split(' ');
    let (method, target) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
    // The path without a query string: `/livez?verbose` is `/livez`.
    let path = target.split('?').next().unwrap_or_default();
    if !matches!(method, "GET" | "HEAD") {
        return (405, r#"{"error":"only GET and HEAD are served"}"#.to_string());
    }
    let ok = match path {
        "/livez" => status.live,
        "/readyz" => status.ready,
        _ => return (404, r#"{"error":"the paths are /livez and /readyz"}"#.to_string()),
    };
    let body = serde_json::json!({
        "live": status.live,
        "ready": status.ready,
        "last_beat_ms_ago": status.since_beat.map(|since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX)),
        "error": status.error,
    });
    (if ok { 200 } else { 503 }, body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health() -> Health {
        Health::new(Duration::from_millis(500))
    }

    #[test]
    fn the_loop_is_live_until_it_misses_beats_and_ready_only_after_a_beat_without_an_error() {
        let health = health();
        assert_eq!(health.stale_after(), MIN_STALE_AFTER);
        let start = health.started;
        let last_beat = || health.last().beat.expect("a beat");
        // Before the first beat: live for as long as a beat may take, never ready.
        let status = health.status_at(start + Duration::from_secs(1));
        assert_eq!((status.live, status.ready, status.since_beat), (true, false, None));
        assert_eq!(status.error.as_deref(), Some("no dispatch pass has ended yet"));
        assert!(!health.status_at(start + MIN_STALE_AFTER + Duration::from_secs(1)).live);

        // A claim completed: live, and not yet ready, as the pass has not ended.
        health.beat();
        let status = health.status_at(last_beat());
        assert_eq!((status.live, status.ready), (true, false));

        health.pass_ended(None);
        let status = health.status_at(last_beat() + Duration::from_secs(2));
        assert_eq!(status, Status { live: true, ready: true, since_beat: Some(Duration::from_secs(2)), error: None });

        // A failed pass is not ready until a pass ends well, whatever beats come between.
        health.pass_ended(Some("SQS is unreachable".into()));
        health.beat();
        let status = health.status_at(last_beat());
        assert_eq!((status.live, status.ready, status.error.as_deref()), (true, false, Some("SQS is unreachable")));

        health.pass_ended(None);
        let stale = health.status_at(last_beat() + MIN_STALE_AFTER + Duration::from_secs(5));
        assert_eq!((stale.live, stale.ready), (false, false));
        assert_eq!(
            stale.error.as_deref(),
            Some("the dispatch loop has not completed a claim or send for 65 s (more than 60 s)")
        );
    }

    #[test]
    fn a_long_poll_interval_waits_three_of_them_before_the_loop_counts_as_stuck() {
        assert_eq!(Health::new(Duration::from_secs(120)).stale_after(), Duration::from_secs(360));
    }

    #[test]
    fn each_path_answers_its_own_question_and_anything_else_is_refused() {
        let failing =
            Status { live: true, ready: false, since_beat: Some(Duration::from_millis(40)), error: Some("x".into()) };
        let (code, body) = respond(b"GET /livez HTTP/1.1\r\nHost: a\r\n\r\n", failing.clone());
        assert_eq!(code, 200);
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body, serde_json::json!({"live": true, "ready": false, "last_beat_ms_ago": 40, "error": "x"}));
        assert_eq!(respond(b"GET /readyz HTTP/1.1\r\n\r\n", failing.clone()).0, 503);
        assert_eq!(respond(b"HEAD /readyz?full HTTP/1.0\r\n\r\n", failing.clone()).0, 503);
        assert_eq!(respond(b"GET / HTTP/1.1\r\n\r\n", failing.clone()).0, 404);
        assert_eq!(respond(b"POST /livez HTTP/1.1\r\n\r\n", failing.clone()).0, 405);
        assert_eq!(respond(b"", failing).0, 405);
        let stuck = Status { live: false, ready: false, since_beat: None, error: None };
        assert_eq!(respond(b"GET /livez HTTP/1.1\r\n\r\n", stuck).0, 503);
    }
}
