//! The job as the rest of the crate sees it: its id, its state, the SQS wire format that
//! carries it, and the error a handler returns.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Primary key of a row in `rowq.jobs`; in SQL the `bigint` it wraps (`store::types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub i64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Mirrors the Postgres enum `rowq.job_state`, whose labels are [`JobState::as_str`]. The
/// arrows of the state machine are the functions of [`crate::store`]; each variant says who
/// moves a job in and out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// In: `INSERT`, a retry after a job error, a rescue, a release after a failed publish,
    /// `rowq retry`. Out: claimed by a scheduler, or cancelled.
    Pending,
    /// In: claimed by a scheduler (`dispatch_gen` + 1, `dispatch_deadline` set).
    /// Out: fenced by a worker, released or rescued back to pending, cancelled, dead-lettered.
    Dispatched,
    /// In: a worker's fence (`attempts` + 1, `run_deadline` set).
    /// Out: finished by that worker, rescued after `run_deadline`, taken over by a
    /// redelivered message after `run_deadline`, dead-lettered.
    Running,
    /// Terminal: the handler succeeded; `result` holds its value.
    Succeeded,
    /// Terminal: attempts used up, a permanent error, an unknown kind, or dead-lettered.
    /// Out only by an explicit `rowq retry`.
    Failed,
    /// Terminal: cancelled while pending or dispatched. Out only by an explicit `rowq retry`
    /// (the undo of a cancel).
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Pending,
        JobState::Dispatched,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Dispatched => "dispatched",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for JobState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobState::ALL.into_iter().find(|state| state.as_str() == s).ok_or_else(|| {
            format!(
                "unknown job state {s:?}: expected one of pending, dispatched, running, succeeded, failed, cancelled"
            )
        })
    }
}

/// The SQS message body. The payload stays in Postgres: the message only names the row and
/// the dispatch generation it was sent for, so a message can never outrun the row's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobMessage {
    pub v: u32,
    pub job_id: JobId,
    pub dispatch_gen: i64,
}

/// Why a message body was not a job message. Such a message is acknowledged and logged:
/// retrying it can never make it valid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MessageError {
    #[error("message body is empty")]
    Empty,
    #[error("message body is {0} bytes, larger than any rowq message (at most {max})", max = JobMessage::MAX_BODY_BYTES)]
    TooLarge(usize),
    #[error("message body is not a rowq job message: {0}")]
    Malformed(String),
    #[error("message body has version {0}, this worker understands version {current}", current = JobMessage::VERSION)]
    UnknownVersion(u32),
    #[error("message body names job id {0}, which is not a valid id")]
    BadJobId(i64),
    #[error("message body names dispatch generation {0}, which is not a valid generation")]
    BadGeneration(i64),
}

impl JobMessage {
    pub const VERSION: u32 = 1;
    /// Generous bound; a real body is about 50 bytes.
    pub const MAX_BODY_BYTES: usize = 1024;

    pub fn new(job_id: JobId, dispatch_gen: i64) -> Self {
        JobMessage { v: Self::VERSION, job_id, dispatch_gen }
    }

    pub fn encode(&self) -> String {
        format!(r#"{{"v":{},"job_id":{},"dispatch_gen":{}}}"#, self.v, self.job_id, self.dispatch_gen)
    }

    pub fn decode(body: &str) -> Result<Self, MessageError> {
        if body.trim().is_empty() {
            return Err(MessageError::Empty);
        }
        if body.len() > Self::MAX_BODY_BYTES {
            return Err(MessageError::TooLarge(body.len()));
        }
        #[derive(Deserialize)]
        struct Version {
            v: u32,
        }
        let version: Version = serde_json::from_str(body).map_err(|e| MessageError::Malformed(e.to_string()))?;
        if version.v != Self::VERSION {
            return Err(MessageError::UnknownVersion(version.v));
        }
        let message: JobMessage = serde_json::from_str(body).map_err(|e| MessageError::Malformed(e.to_string()))?;
        if message.job_id.0 <= 0 {
            return Err(MessageError::BadJobId(message.job_id.0));
        }
        if message.dispatch_gen <= 0 {
            return Err(MessageError::BadGeneration(message.dispatch_gen));
        }
        Ok(message)
    }

    /// `MessageDeduplicationId`: one message per job generation, whoever sends it.
    ///
    /// The row's `created_at` (microseconds) is part of it because SQS drops, for five minutes,
    /// any message whose dedup id it has seen: a job id used again — a recreated table, a
    /// database restored from a backup, a second database on the same queue — would otherwise
    /// have its messages silently dropped and wait for a rescue.
    pub fn dedup_id(&self, created_at: DateTime<Utc>) -> String {
        format!("{}-{}-{}", self.job_id, self.dispatch_gen, created_at.timestamp_micros())
    }
}

/// What a job handler returns when the job did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    /// Worth another attempt (after backoff) while attempts are left.
    #[error("{0}")]
    Retryable(String),
    /// Worth another attempt, while attempts are left, no sooner than the handler says: a
    /// downstream's `Retry-After`, a rate limit's window. Built by [`JobError::retry_after`].
    #[error("{0}")]
    RetryAfter(String, Duration),
    /// Never worth another attempt: the job fails now.
    #[error("{0}")]
    Permanent(String),
}

/// The longest wait a handler may ask for ([`JobError::retry_after`]); a longer one is cut to
/// it. A year: any longer is more likely a unit mistaken (milliseconds read as seconds) than
/// meant, and Postgres's timestamps end where an unbounded one would overflow.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(365 * 24 * 60 * 60);

impl JobError {
    pub fn retryable(message: impl fmt::Display) -> Self {
        JobError::Retryable(message.to_string())
    }

    /// Retries the job `after` from now (exactly: no backoff, no jitter; at most
    /// [`MAX_RETRY_AFTER`]) if attempts are left, and fails it as [`JobError::retryable`] does
    /// if none are. The attempt is spent, as any failed one is.
    pub fn retry_after(message: impl fmt::Display, after: Duration) -> Self {
        JobError::RetryAfter(message.to_string(), after)
    }

    pub fn permanent(message: impl fmt::Display) -> Self {
        JobError::Permanent(message.to_string())
    }

    pub fn is_retryable(&self) -> bool {
        matches!(self, JobError::Retryable(_) | JobError::RetryAfter(..))
    }

    /// The wait the handler asked for, if it named one ([`JobError::retry_after`]), cut to
    /// [`MAX_RETRY_AFTER`] here, however the error was built: the one place the cap is kept.
    pub fn asked_delay(&self) -> Option<Duration> {
        match self {
            JobError::RetryAfter(_, after) => Some((*after).min(MAX_RETRY_AFTER)),
            JobError::Retryable(_) | JobError::Permanent(_) => None,
        }
    }
}

/// A database error inside a handler is worth a retry: the job's own transaction rolled back.
impl From<sqlx::Error> for JobError {
    fn from(error: sqlx::Error) -> Self {
        crate::secret::note(&error);
        JobError::Retryable(format!("database error: {error}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_round_trips_through_its_body() {
        let message = JobMessage::new(JobId(42), 7);
        let body = message.encode();
        assert_eq!(body, r#"{"v":1,"job_id":42,"dispatch_gen":7}"#);
        assert_eq!(JobMessage::decode(&body), Ok(message));
        let via_serde: JobMessage = serde_json::from_str(&body).unwrap();
        assert_eq!(via_serde, message);
    }

    #[test]
    fn dedup_id_is_unique_per_job_generation_and_per_row() {
        let at = DateTime::from_timestamp_micros(1_764_490_000_123_456).unwrap();
        let later = DateTime::from_timestamp_micros(1_764_490_000_123_457).unwrap();
        assert_eq!(JobMessage::new(JobId(42), 7).dedup_id(at), "42-7-1764490000123456");
        assert_ne!(JobMessage::new(JobId(42), 8).dedup_id(at), JobMessage::new(JobId(42), 7).dedup_id(at));
        assert_ne!(JobMessage::new(JobId(4), 27).dedup_id(at), JobMessage::new(JobId(42), 7).dedup_id(at));
        // The same id and generation of another row (a recreated table) is another message.
        assert_ne!(JobMessage::new(JobId(42), 7).dedup_id(later), JobMessage::new(JobId(42), 7).dedup_id(at));
        assert!(JobMessage::new(JobId(i64::MAX), i64::MAX).dedup_id(at).len() <= 128, "SQS allows 128 characters");
    }

    #[test]
    fn malformed_bodies_are_refused_with_a_reason() {
        assert_eq!(JobMessage::decode(""), Err(MessageError::Empty));
        assert!(matches!(JobMessage::decode("Message Body"), Err(MessageError::Malformed(_))));
        assert!(matches!(JobMessage::decode("[1,2]"), Err(MessageError::Malformed(_))));
        assert_eq!(JobMessage::decode(r#"{"v":2,"job_id":1,"dispatch_gen":1}"#), Err(MessageError::UnknownVersion(2)));
        assert!(matches!(JobMessage::decode(r#"{"v":1,"job_id":1}"#), Err(MessageError::Malformed(_))));
        assert!(matches!(
            JobMessage::decode(r#"{"v":1,"job_id":"1","dispatch_gen":1}"#),
            Err(MessageError::Malformed(_))
        ));
        assert_eq!(JobMessage::decode(r#"{"v":1,"job_id":-5,"dispatch_gen":1}"#), Err(MessageError::BadJobId(-5)));
        assert_eq!(JobMessage::decode(r#"{"v":1,"job_id":5,"dispatch_gen":0}"#), Err(MessageError::BadGeneration(0)));
        let huge = format!(r#"{{"v":1,"job_id":1,"dispatch_gen":1,"pad":"{}"}}"#, "x".repeat(5000));
        assert!(matches!(JobMessage::decode(&huge), Err(MessageError::TooLarge(_))));
    }

    #[test]
    fn a_named_wait_is_retryable_and_cut_to_a_year_however_it_was_built() {
        let asked = JobError::retry_after("rate limited", Duration::from_secs(30));
        assert!(asked.is_retryable());
        assert_eq!((asked.to_string(), asked.asked_delay()), ("rate limited".into(), Some(Duration::from_secs(30))));
        assert_eq!(JobError::retry_after("x", Duration::MAX).asked_delay(), Some(MAX_RETRY_AFTER));
        assert_eq!(JobError::RetryAfter("x".into(), Duration::MAX).asked_delay(), Some(MAX_RETRY_AFTER));
        assert_eq!(JobError::retryable("x").asked_delay(), None);
        assert_eq!(JobError::permanent("x").asked_delay(), None);
    }

    #[test]
    fn states_parse_from_their_names() {
        for state in JobState::ALL {
            assert_eq!(state.as_str().parse::<JobState>(), Ok(state));
        }
        assert!("done".parse::<JobState>().is_err());
    }
}
