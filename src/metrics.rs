//! rowq's metrics, as CloudWatch Embedded Metric Format lines on stdout, when
//! `ROWQ_METRICS_NAMESPACE` names a namespace: the scheduler's gauges of its queue
//! ([`QueueGauges`], every maintenance interval) and the worker's count of what each batch did
//! ([`Tally`]): its executions by kind, with how long each ran, and the messages it did not
//! run. CloudWatch Logs turns each such line of a Lambda's (or an ECS task's `awslogs`) output
//! into metric values: no SDK call, no permission beyond writing the logs, nothing lost to a
//! metrics agent. The logs themselves go to stderr, so stdout carries only these lines.
//!
//! Only the database knows how long due jobs have waited: a scheduler that stopped, sends that
//! SQS refuses, an in-flight cap that is too low all show as `OldestClaimableSeconds` growing,
//! and no SQS metric sees a job that was never published.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::store::admin::{KindCount, QueueGauges};

/// The scheduler's metrics, in the order of [`QueueGauges`]'s fields: name and unit.
pub const GAUGES: [(&str, &str); 6] = [
    ("OldestDuePendingSeconds", "Seconds"),
    ("OldestClaimableSeconds", "Seconds"),
    ("DuePending", "Count"),
    ("Dispatched", "Count"),
    ("Running", "Count"),
    ("Paused", "Count"),
];

/// The worker's metrics of one kind's executions in a batch, in the order of [`KindTally`]'s
/// fields: name and unit. Each line of them carries the dimensions `Queue` and `Kind`, and
/// CloudWatch also sums them by `Queue` alone ([`KIND_DIMENSIONS`]).
pub const EXECUTIONS: [(&str, &str); 6] = [
    ("JobsSucceeded", "Count"),
    ("JobsRetried", "Count"),
    ("JobsFailed", "Count"),
    ("JobsSuperseded", "Count"),
    ("JobDuration", "Milliseconds"),
    ("JobWait", "Milliseconds"),
];

/// Where [`EXECUTIONS`]' metrics of one value per execution begin: `JobDuration`, `JobWait`.
const PER_EXECUTION: usize = 4;

/// The worker's metrics of the messages of a batch it did not run, in the order of [`Tally`]'s
/// fields: name and unit. Their line carries the dimension `Queue`.
pub const MESSAGES: [(&str, &str); 3] =
    [("MessagesStale", "Count"), ("MessagesReturned", "Count"), ("MessagesMalformed", "Count")];

/// The DLQ handler's metric, one line per kind a batch failed, with [`KIND_DIMENSIONS`]: jobs it
/// marked `failed` because SQS gave up on their message.
pub const DEAD_LETTERS: [(&str, &str); 1] = [("JobsDeadLettered", "Count")];

/// The DLQ handler's count of the jobs it sent back to be dispatched again, by `Queue`: their
/// message was dead-lettered before any worker started them ([`crate::store::run::dead_letter`]).
pub const SENT_BACK: [(&str, &str); 1] = [("JobsSentBack", "Count")];

/// The dimension sets of a kind's line: each value counts by queue and kind, and by queue.
pub const KIND_DIMENSIONS: [&[&str]; 2] = [&["Queue"], &["Queue", "Kind"]];

/// The `Kind` a worker counts an execution under when it has no handler for the job's kind (the
/// job fails: "unknown job kind"). A kind cannot hold parentheses (`rowq.job_kind`'s check), so
/// this names no real kind; and a worker's `Kind` values are its handlers' kinds and this one,
/// whatever producers write: a kind built from data (`resize_` and a customer id) adds one
/// value, not a metric per row.
pub const UNREGISTERED_KIND: &str = "(unregistered)";

/// The most values EMF takes for one metric in one line: a kind with more executions in a batch
/// (only a standard queue's batches can be that large) has its further durations and waits on
/// further lines.
pub const VALUES_PER_LINE: usize = 100;

/// The most records SQS delivers in one batch, from a FIFO queue.
const SQS_BATCH: usize = 10;

/// What one batch did, for the worker's metrics lines.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// The executions, by kind, in the order their kinds were first counted.
    pub kinds: Vec<KindTally>,
    /// Whether executions go uncounted ([`Tally::messages_only`]).
    skip_executions: bool,
    /// Messages acknowledged without running: a stale generation, or a duplicate.
    pub stale: u32,
    /// Messages reported to SQS as failed, for redelivery: the database was unreachable, or
    /// the invocation had no time left.
    pub returned: u32,
    /// Messages acknowledged and dropped because they are no rowq job message: a body that does
    /// not parse, or no message id. The scheduler never sends one; something else wrote to the
    /// queue.
    pub malformed: u32,
}

/// What a batch's executions of one kind came to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KindTally {
    pub kind: String,
    /// Executions recorded `succeeded`.
    pub succeeded: u32,
    /// Executions recorded as failed with attempts left: back to `pending`, after a backoff.
    pub retried: u32,
    /// Executions recorded `failed`: a permanent error, or no attempt left.
    pub failed: u32,
    /// Executions whose outcome was discarded: the job was rescued or taken over meanwhile.
    pub superseded: u32,
    /// Each of those executions' wait and run time.
    pub timings: Vec<Timing>,
}

/// One execution's times, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timing {
    /// How long its job had been due when it started: from `run_at` to the fence.
    pub waited_ms: f64,
    /// How long its handler ran.
    pub ran_ms: f64,
}

impl Tally {
    /// A tally that counts the messages a batch did not run but none of its executions: what a
    /// worker that reports no metrics keeps, so that its hot path copies no kind and fills no
    /// list of timings that nothing reads.
    pub fn messages_only() -> Self {
        Tally { skip_executions: true, ..Tally::default() }
    }

    /// The count of `kind`'s executions, started at zero by the first of them. Private: every
    /// kind counted has a duration, so its line has a value of each metric.
    fn of_kind(&mut self, kind: &str) -> &mut KindTally {
        let at = match self.kinds.iter().position(|counted| counted.kind == kind) {
            Some(at) => at,
            None => {
                // Room for an SQS batch's timings: one allocation, not four growing to ten.
                let timings = Vec::with_capacity(SQS_BATCH);
                self.kinds.push(KindTally { kind: kind.to_string(), timings, ..KindTally::default() });
                self.kinds.len() - 1
            }
        };
        &mut self.kinds[at]
    }

    /// Counts one execution of `kind` that started `waited_ms` after its job was due and ran for
    /// `ran_for`; `outcome` picks its count. A [`messages_only`](Self::messages_only) tally
    /// counts nothing here.
    pub fn execution(
        &mut self,
        kind: &str,
        waited_ms: f64,
        ran_for: Duration,
        outcome: fn(&mut KindTally) -> &mut u32,
    ) {
        if self.skip_executions {
            return;
        }
        let counted = self.of_kind(kind);
        *outcome(counted) += 1;
        counted.timings.push(Timing { waited_ms: waited_ms.max(0.0), ran_ms: ran_for.as_secs_f64() * 1000.0 });
    }

    /// Whether the batch counted no message that was not run.
    fn no_messages(&self) -> bool {
        (self.stale, self.returned, self.malformed) == (0, 0, 0)
    }
}

/// One EMF line at `at`: `values` of the metrics `metrics` (name and unit) under `namespace`,
/// with the dimensions `dimensions` (name and value), aggregated by each set in `sets`.
fn line(
    namespace: &str,
    at: SystemTime,
    dimensions: &[(&str, &str)],
    sets: &[&[&str]],
    metrics: &[(&str, &str)],
    values: Vec<Value>,
) -> String {
    let timestamp = at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis());
    let definitions: Vec<_> = metrics.iter().map(|(name, unit)| json!({"Name": name, "Unit": unit})).collect();
    let mut line = json!({
        "_aws": {
            "Timestamp": timestamp,
            "CloudWatchMetrics": [{"Namespace": namespace, "Dimensions": sets, "Metrics": definitions}],
        },
    });
    for (name, value) in dimensions {
        line[*name] = json!(value);
    }
    for ((name, _), value) in metrics.iter().zip(values) {
        line[*name] = value;
    }
    line.to_string()
}

/// The scheduler's line: the gauges of `queue`.
pub fn gauges_line(namespace: &str, queue: &str, gauges: &QueueGauges, at: SystemTime) -> String {
    let values = vec![
        json!(gauges.oldest_due_pending_secs),
        json!(gauges.oldest_claimable_secs),
        json!(gauges.due_pending),
        json!(gauges.dispatched),
        json!(gauges.running),
        json!(u8::from(gauges.paused)),
    ];
    line(namespace, at, &[("Queue", queue)], &[&["Queue"]], &GAUGES, values)
}

/// The worker's lines of one batch: one per kind it ran (more for a kind whose values per
/// execution do not fit one line), then one of the messages it did not run, if there were any.
pub fn outcomes_lines(namespace: &str, queue: &str, tally: &Tally, at: SystemTime) -> Vec<String> {
    let mut lines = Vec::new();
    for kind in &tally.kinds {
        let dimensions = [("Queue", queue), ("Kind", kind.kind.as_str())];
        for (n, timings) in kind.timings.chunks(VALUES_PER_LINE).enumerate() {
            let ran: Vec<f64> = timings.iter().map(|t| t.ran_ms).collect();
            let waited: Vec<f64> = timings.iter().map(|t| t.waited_ms).collect();
            let per_execution = [json!(ran), json!(waited)];
            if n == 0 {
                let counts = [kind.succeeded, kind.retried, kind.failed, kind.superseded].map(|count| json!(count));
                let values = counts.into_iter().chain(per_execution).collect();
                lines.push(line(namespace, at, &dimensions, &KIND_DIMENSIONS, &EXECUTIONS, values));
            } else {
                let metrics = &EXECUTIONS[PER_EXECUTION..];
                lines.push(line(namespace, at, &dimensions, &KIND_DIMENSIONS, metrics, per_execution.to_vec()));
            }
        }
    }
    if !tally.no_messages() {
        let values = [tally.stale, tally.returned, tally.malformed].map(|count| json!(count)).to_vec();
        lines.push(line(namespace, at, &[("Queue", queue)], &[&["Queue"]], &MESSAGES, values));
    }
    lines
}

/// The DLQ handler's lines of one batch: how many jobs of each kind it marked `failed`, and, when
/// it sent any back to be dispatched again, how many.
pub fn dead_letters_lines(
    namespace: &str,
    queue: &str,
    by_kind: &[KindCount],
    sent_back: u32,
    at: SystemTime,
) -> Vec<String> {
    let line_of = |counted: &KindCount| {
        let dimensions = [("Queue", queue), ("Kind", counted.kind.as_str())];
        line(namespace, at, &dimensions, &KIND_DIMENSIONS, &DEAD_LETTERS, vec![json!(counted.count)])
    };
    let mut lines: Vec<String> = by_kind.iter().map(line_of).collect();
    if sent_back > 0 {
        lines.push(line(namespace, at, &[("Queue", queue)], &[&["Queue"]], &SENT_BACK, vec![json!(sent_back)]));
    }
    lines
}

/// Writes `lines`, each followed by a newline, to stdout in one call, so that no other output
/// splits them; nothing when there are none. A failed write is a warning: metrics never stop
/// the work they count.
pub fn print(lines: &[String]) {
    if lines.is_empty() {
        return;
    }
    let mut text = String::new();
    for line in lines {
        text.push_str(line);
        text.push('\n');
    }
    let mut out = std::io::stdout().lock();
    if let Err(error) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        tracing::warn!(error = %error, "could not write the metrics lines to stdout");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parsed line, checked for what EMF requires of any line: the timestamp, one directive
    /// under the namespace with the dimension sets `sets`, declaring exactly `metrics`, each with
    /// its value at the top level beside the dimensions' values, and nothing else there.
    fn checked(text: &str, sets: Value, dimensions: &[(&str, &str)], metrics: &[(&str, &str)]) -> Value {
        let line: Value = serde_json::from_str(text).unwrap();
        assert_eq!(line["_aws"]["Timestamp"], 1_764_000_000_123_u64);
        let directive = &line["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "rowq/prod");
        assert_eq!(directive["Dimensions"], sets);
        for (name, value) in dimensions {
            assert_eq!(line[*name], *value, "{line}");
        }
        let declared: Vec<(&str, &str)> = directive["Metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["Name"].as_str().unwrap(), m["Unit"].as_str().unwrap()))
            .collect();
        assert_eq!(declared, metrics);
        assert!(metrics.iter().all(|(name, _)| line[*name].is_number() || line[*name].is_array()), "{line}");
        assert_eq!(line.as_object().unwrap().len(), 1 + dimensions.len() + metrics.len(), "{line}");
        line
    }

    const AT: Duration = Duration::from_millis(1_764_000_000_123);

    #[test]
    fn a_gauges_line_carries_each_gauge_under_its_name() {
        let gauges = QueueGauges {
            oldest_due_pending_secs: 42.5,
            oldest_claimable_secs: 12.5,
            due_pending: 7,
            dispatched: 3,
            running: 2,
            paused: true,
        };
        let text = gauges_line("rowq/prod", "emails", &gauges, UNIX_EPOCH + AT);
        let line = checked(&text, json!([["Queue"]]), &[("Queue", "emails")], &GAUGES);
        assert_eq!((&line["OldestDuePendingSeconds"], &line["OldestClaimableSeconds"]), (&json!(42.5), &json!(12.5)));
        assert_eq!((&line["DuePending"], &line["Dispatched"], &line["Running"]), (&json!(7), &json!(3), &json!(2)));
        assert_eq!(line["Paused"], json!(1));
        let resumed = QueueGauges { paused: false, ..gauges };
        let text = gauges_line("rowq/prod", "emails", &resumed, UNIX_EPOCH + AT);
        assert_eq!(checked(&text, json!([["Queue"]]), &[("Queue", "emails")], &GAUGES)["Paused"], json!(0));
    }

    fn ms(n: u64) -> Duration {
        Duration::from_micros(n * 1000 + 250)
    }

    /// A wait that tells its execution apart from the others: 2n + 0.5 ms.
    fn wait(n: u64) -> f64 {
        n as f64 * 2.0 + 0.5
    }

    #[test]
    fn a_batch_prints_a_line_per_kind_with_each_executions_time_then_one_of_its_messages() {
        let mut tally = Tally { stale: 5, returned: 6, malformed: 7, ..Tally::default() };
        tally.execution("resize", wait(12), ms(12), |kind| &mut kind.succeeded);
        tally.execution("email", wait(3), ms(3), |kind| &mut kind.failed);
        tally.execution("resize", wait(40), ms(40), |kind| &mut kind.retried);
        tally.execution("resize", wait(1), ms(1), |kind| &mut kind.succeeded);
        tally.execution("email", wait(2), ms(2), |kind| &mut kind.superseded);
        let lines = outcomes_lines("rowq/prod", "emails", &tally, UNIX_EPOCH + AT);
        assert_eq!(lines.len(), 3, "{lines:?}");

        let by_kind = json!([["Queue"], ["Queue", "Kind"]]);
        let resize = checked(&lines[0], by_kind.clone(), &[("Queue", "emails"), ("Kind", "resize")], &EXECUTIONS);
        let counts = |line: &Value| EXECUTIONS[..4].iter().map(|(name, _)| line[*name].as_u64()).collect::<Vec<_>>();
        assert_eq!(counts(&resize), [2, 1, 0, 0].map(Some));
        assert_eq!(resize["JobDuration"], json!([12.25, 40.25, 1.25]));
        assert_eq!(resize["JobWait"], json!([24.5, 80.5, 2.5]));
        let email = checked(&lines[1], by_kind, &[("Queue", "emails"), ("Kind", "email")], &EXECUTIONS);
        assert_eq!(counts(&email), [0, 0, 1, 1].map(Some));
        assert_eq!(email["JobDuration"], json!([3.25, 2.25]));
        assert_eq!(email["JobWait"], json!([6.5, 4.5]));

        let messages = checked(&lines[2], json!([["Queue"]]), &[("Queue", "emails")], &MESSAGES);
        assert_eq!(MESSAGES.map(|(name, _)| messages[name].as_u64().unwrap()), [5, 6, 7]);
    }

    #[test]
    fn a_batch_that_ran_every_message_prints_no_messages_line_and_one_that_counted_nothing_prints_none() {
        let mut tally = Tally::default();
        assert_eq!(outcomes_lines("rowq/prod", "emails", &tally, UNIX_EPOCH + AT), Vec::<String>::new());
        tally.execution("resize", wait(1), ms(1), |kind| &mut kind.succeeded);
        let lines = outcomes_lines("rowq/prod", "emails", &tally, UNIX_EPOCH + AT);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("\"Kind\":\"resize\""), "{lines:?}");
    }

    /// A worker that reports no metrics keeps no kinds and no timings on its hot path.
    #[test]
    fn a_messages_only_tally_counts_messages_and_no_execution() {
        let mut tally = Tally::messages_only();
        tally.execution("resize", wait(1), ms(1), |kind| &mut kind.succeeded);
        tally.stale += 1;
        assert!(tally.kinds.is_empty(), "{tally:?}");
        let lines = outcomes_lines("rowq/prod", "emails", &tally, UNIX_EPOCH + AT);
        assert_eq!(lines.len(), 1, "the messages line only: {lines:?}");
        checked(&lines[0], json!([["Queue"]]), &[("Queue", "emails")], &MESSAGES);
    }

    #[test]
    fn a_dead_letters_line_counts_one_kind_by_queue_and_by_kind() {
        let counted = |kind: &str, count| KindCount { kind: kind.to_string(), count };
        let by_kind = [counted("resize", 2), counted("email", 1)];
        let lines = dead_letters_lines("rowq/prod", "emails", &by_kind, 0, UNIX_EPOCH + AT);
        assert_eq!(lines.len(), 2, "{lines:?}");
        let sets = json!([["Queue"], ["Queue", "Kind"]]);
        for (text, counted) in lines.iter().zip(&by_kind) {
            let line = checked(text, sets.clone(), &[("Queue", "emails"), ("Kind", &counted.kind)], &DEAD_LETTERS);
            assert_eq!(line["JobsDeadLettered"], counted.count, "{line}");
        }
    }

    #[test]
    fn jobs_the_dlq_handler_sent_back_are_counted_by_queue_on_a_line_of_their_own() {
        let lines = dead_letters_lines("rowq/prod", "emails", &[], 3, UNIX_EPOCH + AT);
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line = checked(&lines[0], json!([["Queue"]]), &[("Queue", "emails")], &SENT_BACK);
        assert_eq!(line["JobsSentBack"], 3, "{line}");
    }

    /// EMF takes at most 100 values of a metric in a line: a kind's further durations and waits
    /// go on lines of their own, which count nothing twice.
    #[test]
    fn values_beyond_a_lines_hundred_go_on_further_lines() {
        let mut tally = Tally::default();
        for n in 0..230 {
            tally.execution("resize", wait(n), ms(n), |kind| &mut kind.succeeded);
        }
        let lines = outcomes_lines("rowq/prod", "emails", &tally, UNIX_EPOCH + AT);
        assert_eq!(lines.len(), 3, "{lines:?}");
        let dimensions = [("Queue", "emails"), ("Kind", "resize")];
        let sets = json!([["Queue"], ["Queue", "Kind"]]);
        let first = checked(&lines[0], sets.clone(), &dimensions, &EXECUTIONS);
        assert_eq!(first["JobsSucceeded"], 230);
        let further =
            lines[1..].iter().map(|more| checked(more, sets.clone(), &dimensions, &EXECUTIONS[PER_EXECUTION..]));
        let parsed: Vec<Value> = std::iter::once(first).chain(further).collect();
        let values = |name: &str| parsed.iter().map(|line| line[name].as_array().unwrap().clone()).collect::<Vec<_>>();
        let (durations, waits) = (values("JobDuration"), values("JobWait"));
        assert_eq!(durations.iter().map(Vec::len).collect::<Vec<_>>(), [100, 100, 30]);
        assert_eq!(waits.iter().map(Vec::len).collect::<Vec<_>>(), [100, 100, 30]);
        assert_eq!(durations.concat(), (0..230).map(|n| json!(n as f64 + 0.25)).collect::<Vec<_>>());
        assert_eq!(waits.concat(), (0..230).map(|n| json!(wait(n))).collect::<Vec<_>>());
    }
}
