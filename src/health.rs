//! Health over HTTP (`ROWQ_HEALTH_LISTEN`) for an orchestrator that runs the scheduler, or
//! `rowq work`, as a long-lived service (ECS, Kubernetes, Nomad).
//!
//! Each loop has a [`Health`]: it beats each time a step of the loop completes (a claim or a
//! `SendMessageBatch` call of the scheduler; a receive or a batch of an event source's pollers)
//! and records how each kind of step last ended ([`Health::record`]). A loop run by several
//! pollers at once (an event source's) keeps a beat per poller. Two paths answer from those,
//! over every loop of the process:
//!
//! - `GET /livez`: 200 while every loop turns: a beat of each of its pollers within its
//!   [`Health::stale_after`] (before a poller's first beat, that long after the loop began). A loop that is
//!   stuck (a statement that never returns on a connection the network dropped without a
//!   word; a handler that blocks the thread), or one poller of it, answers 503, and an
//!   orchestrator that restarts it on that fixes it: one poller stuck of four would otherwise
//!   go on unseen, its share of the work never done. A database or SQS that is down does not
//!   make it fail: the loop goes on trying (and beating), and a restart would not bring
//!   either back.
//! - `GET /readyz`: 200 when every loop turns and the last of each kind of step succeeded: it
//!   is dispatching, or receiving and recording outcomes. 503 otherwise, naming the errors (and
//!   before any step has completed).
//!
//! Before its loop runs, a process can say what it is doing ([`Health::starting`]: the
//! scheduler connects to the database, then applies the migrations, the endpoint already
//! served): live, not ready, the step named. A migration can take long (an index built
//! concurrently on a large table, waiting for the transactions open before it), and a restart
//! would only begin it again: an orchestrator's start period (ECS allows 300 s at most) need not
//! cover it. The loop's own clock starts when it runs ([`Health::running`]).
//!
//! Each answers a small JSON object: `{"live":true,"ready":false,"last_beat_ms_ago":120,
//! "error":"..."}`. The server reads one request per connection and closes it; it serves
//! nothing else.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long a loop may go without a beat before `/livez` fails, at the least. The scheduler's
/// loop beats at least once per poll interval while idle, and once per back-off (10 s at most)
/// while the database or SQS fails; a poller once per long poll, or per batch.
pub const MIN_STALE_AFTER: Duration = Duration::from_secs(60);

/// How much of a request is read: a request line and a few headers.
const MAX_REQUEST: usize = 2048;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// One loop's last beats, and how each kind of its steps last ended, shared with the server.
#[derive(Debug)]
pub struct Health {
    /// What the loop is, in the errors: `dispatch`, `queue rowq-jobs.fifo`.
    label: String,
    stale_after: Duration,
    last: Mutex<Last>,
}

#[derive(Debug, Clone)]
struct Last {
    /// What the process does before the loop runs: live, not ready, this named.
    starting: Option<&'static str>,
    /// When the loop began to run: a poller that has not beaten yet counts from here.
    since: Instant,
    /// Each poller's last beat: one for a loop of one poller (the scheduler's).
    beats: Vec<Option<Instant>>,
    /// Each kind of step recorded, with the error its last one ended with.
    steps: Vec<(&'static str, Option<String>)>,
}

/// What the health paths report, at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Every loop turns: each beat within its `stale_after` (or started less than that ago).
    pub live: bool,
    /// Every loop turns, and the last of each kind of its steps succeeded.
    pub ready: bool,
    /// Since the oldest of the loops' last beats; `None` while one has not beaten yet.
    pub since_beat: Option<Duration>,
    /// Why it is not ready, loop by loop: a failed step, a stuck loop, nothing done yet.
    pub error: Option<String>,
}

impl Last {
    fn beat(&mut self, poller: usize) {
        if poller >= self.beats.len() {
            self.beats.resize(poller + 1, None);
        }
        self.beats[poller] = Some(Instant::now());
    }
}

impl Health {
    /// A loop named `label` that counts as stuck after `stale_after` without a beat (never
    /// less than [`MIN_STALE_AFTER`]).
    pub fn new(label: impl Into<String>, stale_after: Duration) -> Self {
        Health {
            label: label.into(),
            stale_after: stale_after.max(MIN_STALE_AFTER),
            last: Mutex::new(Last { starting: None, since: Instant::now(), beats: vec![None], steps: Vec::new() }),
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Last> {
        self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// The process is doing `what` before the loop runs (`"applying migrations"`): live for as
    /// long as it takes, not ready.
    pub fn starting(&self, what: &'static str) {
        self.last().starting = Some(what);
    }

    /// The loop runs: after [`Health::starting`], its pollers have [`Health::stale_after`] from
    /// now for their first beats.
    pub fn running(&self) {
        let mut last = self.last();
        if last.starting.take().is_some() {
            last.since = Instant::now();
        }
    }

    /// The loop is run by `pollers` pollers (0 to `pollers - 1`), each of which must beat.
    pub fn set_pollers(&self, pollers: usize) {
        self.last().beats.resize(pollers.max(1), None);
    }

    /// A step of the loop's one poller completed, well or not: the loop turns.
    pub fn beat(&self) {
        self.last().beat(0);
    }

    /// A step of kind `step` of the loop's one poller ended: [`Health::record_by`] poller 0.
    pub fn record(&self, step: &'static str, error: Option<String>) {
        self.record_by(0, step, error);
    }

    /// A step of kind `step` ended, by `poller`, with `error` if it failed; that poller beats
    /// too. Ready needs the last of every kind recorded, by any poller, to have ended well: a
    /// poller's empty receive does not clear the error of its last batch.
    pub fn record_by(&self, poller: usize, step: &'static str, error: Option<String>) {
        let mut last = self.last();
        last.beat(poller);
        match last.steps.iter_mut().find(|(kind, _)| *kind == step) {
            Some(slot) => slot.1 = error,
            None => last.steps.push((step, error)),
        }
    }

    pub fn status(&self) -> Status {
        self.status_at(Instant::now())
    }

    fn status_at(&self, now: Instant) -> Status {
        let last = self.last().clone();
        if let Some(what) = last.starting {
            let error = Some(format!("{}: {what}", self.label));
            return Status { live: true, ready: false, since_beat: None, error };
        }
        // How long each poller has gone without a beat (without one yet: since the loop began).
        let ages: Vec<Duration> =
            last.beats.iter().map(|beat| now.saturating_duration_since(beat.unwrap_or(last.since))).collect();
        // The poller that has gone longest; the first of them on a tie.
        let (oldest, longest) =
            ages.iter().copied().enumerate().fold((0, Duration::ZERO), |a, b| if b.1 > a.1 { b } else { a });
        let live = longest <= self.stale_after;
        let since_beat = last.beats.iter().all(Option::is_some).then_some(longest);
        let failed: Vec<String> = last.steps.iter().filter_map(|(_, error)| error.clone()).collect();
        let (longest_s, stale_s) = (longest.as_secs(), self.stale_after.as_secs());
        let error = if !live && last.beats.len() > 1 {
            let stuck = ages.iter().filter(|age| **age > self.stale_after).count();
            let pollers = last.beats.len();
            Some(format!(
                "{stuck} of {pollers} pollers stuck: poller {oldest} has completed nothing for {longest_s} s (more than {stale_s} s)"
            ))
        } else if !live && last.beats[0].is_some() {
            Some(format!("nothing has completed for {longest_s} s (more than {stale_s} s): the loop is stuck"))
        } else if last.steps.is_empty() {
            Some("nothing has completed yet".to_string())
        } else if !failed.is_empty() {
            Some(failed.join("; "))
        } else {
            None
        };
        let ready = live && error.is_none();
        Status { live, ready, since_beat, error: error.map(|error| format!("{}: {error}", self.label)) }
    }
}

/// The status of a process of several loops: live and ready when each is; the errors of all.
pub fn combined(loops: &[Arc<Health>]) -> Status {
    let statuses: Vec<Status> = loops.iter().map(|health| health.status()).collect();
    let errors: Vec<&str> = statuses.iter().filter_map(|status| status.error.as_deref()).collect();
    Status {
        live: statuses.iter().all(|status| status.live),
        ready: statuses.iter().all(|status| status.ready),
        since_beat: statuses
            .iter()
            .map(|status| status.since_beat)
            .collect::<Option<Vec<_>>>()
            .and_then(|since| since.into_iter().max()),
        error: (!errors.is_empty()).then(|| errors.join("; ")),
    }
}

/// The health endpoint, served in a task of its own until this is dropped.
#[derive(Debug)]
pub struct Server(tokio::task::JoinHandle<()>);

impl Drop for Server {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves `loops` on `address` (`ROWQ_HEALTH_LISTEN`), if it is set: bound before this returns,
/// so that an address in use stops the process at start, with the setting's name.
pub async fn start(address: Option<SocketAddr>, loops: Vec<Arc<Health>>) -> Result<Option<Server>, String> {
    let Some(address) = address else { return Ok(None) };
    let listener = TcpListener::bind(address)
        .await
        .map_err(|error| format!("cannot listen on ROWQ_HEALTH_LISTEN={address}: {error}"))?;
    Ok(Some(Server(tokio::spawn(serve(listener, loops)))))
}

/// Answers health requests on `listener`, from `loops`, until the task is dropped.
async fn serve(listener: TcpListener, loops: Vec<Arc<Health>>) {
    let loops: Arc<[Arc<Health>]> = loops.into();
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "health endpoint listening (/livez, /readyz)");
    }
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let loops = loops.clone();
                tokio::spawn(async move {
                    if let Err(error) = answer(stream, &loops).await {
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

async fn answer(mut stream: TcpStream, loops: &[Arc<Health>]) -> std::io::Result<()> {
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
    let (code, body) = respond(&request, combined(loops));
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

/// What the health endpoint answered: the status code, the head (status line and headers) and
/// the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub code: u16,
    pub head: String,
    pub body: String,
}

/// `scheduler --health-check`, `rowq work --health-check`: asks the process serving on
/// `address` (`ROWQ_HEALTH_LISTEN`) for `path`; its body when it answers 200, else why not. For
/// a container health check that runs a command, in an image without curl.
pub fn check(address: SocketAddr, path: &str) -> Result<String, String> {
    let answer = ask(address, path)?;
    match answer.code {
        200 => Ok(answer.body),
        code => Err(format!("{path} on {address} answered {code}: {}", answer.body)),
    }
}

/// `GET path` of the health endpoint on `address` (an unspecified IP, `0.0.0.0` or `::`, is
/// asked on loopback), waiting 5 s at most for each step; `Err` when nothing answers.
pub fn ask(address: SocketAddr, path: &str) -> Result<Answer, String> {
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
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let code = head.split(' ').nth(1).and_then(|code| code.parse().ok());
    let code = code.ok_or_else(|| format!("no HTTP answer on {target}: {:?}", head))?;
    Ok(Answer { code, head: head.to_string(), body: body.to_string() })
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

    fn last_beat(health: &Health) -> Instant {
        health.last().beats[0].expect("a beat")
    }

    #[test]
    fn a_loop_is_live_until_it_misses_beats_and_ready_once_each_kind_of_step_last_ended_well() {
        let health = Health::new("dispatch", Duration::from_secs(1));
        assert_eq!(health.stale_after(), MIN_STALE_AFTER);
        let start = health.last().since;
        // Before the first beat: live for as long as a beat may take, never ready.
        let status = health.status_at(start + Duration::from_secs(1));
        assert_eq!((status.live, status.ready, status.since_beat), (true, false, None));
        assert_eq!(status.error.as_deref(), Some("dispatch: nothing has completed yet"));
        assert!(!health.status_at(start + MIN_STALE_AFTER + Duration::from_secs(1)).live);

        // A step completed, none recorded yet: live, not ready.
        health.beat();
        let status = health.status_at(last_beat(&health));
        assert_eq!((status.live, status.ready), (true, false));

        health.record("pass", None);
        let status = health.status_at(last_beat(&health) + Duration::from_secs(2));
        assert_eq!(status, Status { live: true, ready: true, since_beat: Some(Duration::from_secs(2)), error: None });

        // A failed step is not ready until a step of its kind ends well, whatever else ends well.
        health.record("batch", Some("3 of 10 messages handed back".into()));
        health.record("receive", None);
        health.beat();
        let status = health.status_at(last_beat(&health));
        assert_eq!((status.live, status.ready), (true, false));
        assert_eq!(status.error.as_deref(), Some("dispatch: 3 of 10 messages handed back"));
        health.record("batch", None);
        assert!(health.status_at(last_beat(&health)).ready);

        let stale = health.status_at(last_beat(&health) + MIN_STALE_AFTER + Duration::from_secs(5));
        assert_eq!((stale.live, stale.ready), (false, false));
        assert_eq!(
            stale.error.as_deref(),
            Some("dispatch: nothing has completed for 65 s (more than 60 s): the loop is stuck")
        );
    }

    #[test]
    fn one_stuck_poller_of_several_fails_liveness_while_the_others_turn() {
        let health = Health::new("queue jobs.fifo", MIN_STALE_AFTER);
        health.set_pollers(3);
        let start = health.last().since;
        health.record_by(0, "receive", None);
        health.record_by(2, "receive", None);
        // Poller 1 has not beaten yet: live until a beat is overdue, and no age to report.
        let status = health.status_at(start + Duration::from_secs(1));
        assert_eq!((status.live, status.ready, status.since_beat), (true, true, None));

        // Pollers 0 and 2 go on turning (their last beats 62 s after the start); poller 1
        // never completes a step.
        let turning = start + Duration::from_secs(62);
        for poller in [0, 2] {
            health.last().beats[poller] = Some(turning);
        }
        let status = health.status_at(turning + Duration::from_secs(3));
        assert_eq!((status.live, status.ready, status.since_beat), (false, false, None));
        assert_eq!(
            status.error.as_deref(),
            Some("queue jobs.fifo: 1 of 3 pollers stuck: poller 1 has completed nothing for 65 s (more than 60 s)")
        );

        // Once it beats, the oldest of the three beats is the loop's age.
        health.last().beats[1] = Some(turning + Duration::from_secs(10));
        let status = health.status_at(turning + Duration::from_secs(15));
        assert_eq!(status, Status { live: true, ready: true, since_beat: Some(Duration::from_secs(15)), error: None });
    }

    #[test]
    fn a_process_starting_is_live_and_not_ready_however_long_it_takes_then_its_loop_has_its_own_time() {
        let health = Health::new("dispatch", MIN_STALE_AFTER);
        health.starting("applying migrations");
        let hours_later = health.last().since + Duration::from_secs(3 * 3600);
        let status = health.status_at(hours_later);
        assert_eq!(
            status,
            Status { live: true, ready: false, since_beat: None, error: Some("dispatch: applying migrations".into()) }
        );
        // The loop runs: its first beat is due within stale_after of now, not of the start.
        let before = Instant::now();
        health.running();
        let since = health.last().since;
        assert!(since >= before, "the loop's clock starts when it runs");
        let status = health.status_at(since + Duration::from_secs(30));
        assert_eq!((status.live, status.ready), (true, false));
        assert_eq!(status.error.as_deref(), Some("dispatch: nothing has completed yet"));
        assert!(!health.status_at(since + MIN_STALE_AFTER + Duration::from_secs(1)).live);
        // Running again (the scheduler's loop restarting) keeps the clock.
        health.running();
        assert_eq!(health.last().since, since);
    }

    #[test]
    fn a_loop_that_may_take_longer_waits_that_long_before_it_counts_as_stuck() {
        assert_eq!(Health::new("queue q.fifo", Duration::from_secs(360)).stale_after(), Duration::from_secs(360));
    }

    #[test]
    fn a_process_of_several_loops_is_ready_when_each_is_and_names_what_fails_in_each() {
        let jobs = Arc::new(Health::new("queue jobs.fifo", MIN_STALE_AFTER));
        let dead_letters = Arc::new(Health::new("queue dlq.fifo", MIN_STALE_AFTER));
        let both = [jobs.clone(), dead_letters.clone()];
        jobs.record("receive", None);
        let status = combined(&both);
        assert_eq!((status.live, status.ready, status.since_beat), (true, false, None));
        assert_eq!(status.error.as_deref(), Some("queue dlq.fifo: nothing has completed yet"));
        dead_letters.record("receive", None);
        assert_eq!(combined(&both).error, None);
        assert!(combined(&both).ready);
        jobs.record("receive", Some("ReceiveMessage failed".into()));
        dead_letters.record("batch", Some("the database is unreachable".into()));
        let status = combined(&both);
        assert_eq!((status.live, status.ready), (true, false));
        assert_eq!(
            status.error.as_deref(),
            Some("queue jobs.fifo: ReceiveMessage failed; queue dlq.fifo: the database is unreachable")
        );
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
