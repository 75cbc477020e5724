//! rowq's metrics, as CloudWatch Embedded Metric Format lines on stdout, when
//! `ROWQ_METRICS_NAMESPACE` names a namespace: the scheduler's gauges of its queue
//! ([`QueueGauges`], every maintenance interval) and the worker's count of what each batch did
//! ([`Tally`]). CloudWatch Logs turns each such line of a Lambda's (or an ECS task's `awslogs`)
//! output into metric values: no SDK call, no permission beyond writing the logs, nothing lost
//! to a metrics agent. The logs themselves go to stderr, so stdout carries only these lines.
//!
//! Only the database knows how long due jobs have waited: a scheduler that stopped, sends that
//! SQS refuses, an in-flight cap that is too low all show as `OldestDuePendingSeconds` growing,
//! and no SQS metric sees a job that was never published.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::store::admin::QueueGauges;

/// The scheduler's metrics, in the order of [`QueueGauges`]'s fields: name and unit.
pub const GAUGES: [(&str, &str); 4] =
    [("OldestDuePendingSeconds", "Seconds"), ("DuePending", "Count"), ("Dispatched", "Count"), ("Running", "Count")];

/// The worker's metrics, in the order of [`Tally`]'s fields: name and unit.
pub const OUTCOMES: [(&str, &str); 7] = [
    ("JobsSucceeded", "Count"),
    ("JobsRetried", "Count"),
    ("JobsFailed", "Count"),
    ("JobsSuperseded", "Count"),
    ("MessagesStale", "Count"),
    ("MessagesReturned", "Count"),
    ("MessagesMalformed", "Count"),
];

/// What one batch did, for the worker's metrics line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Executions recorded `succeeded`.
    pub succeeded: u32,
    /// Executions recorded as failed with attempts left: back to `pending`, after a backoff.
    pub retried: u32,
    /// Executions recorded `failed`: a permanent error, or no attempt left.
    pub failed: u32,
    /// Executions whose outcome was discarded: the job was rescued or taken over meanwhile.
    pub superseded: u32,
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

/// One EMF line: `values` (in the order of `metrics`) of `queue` under `namespace`, with the
/// dimension `Queue`.
fn line<const N: usize>(
    namespace: &str,
    queue: &str,
    at: SystemTime,
    metrics: &[(&str, &str); N],
    values: [Value; N],
) -> String {
    let timestamp = at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis());
    let definitions: Vec<_> = metrics.iter().map(|(name, unit)| json!({"Name": name, "Unit": unit})).collect();
    let mut line = json!({
        "_aws": {
            "Timestamp": timestamp,
            "CloudWatchMetrics": [{"Namespace": namespace, "Dimensions": [["Queue"]], "Metrics": definitions}],
        },
        "Queue": queue,
    });
    for ((name, _), value) in metrics.iter().zip(values) {
        line[*name] = value;
    }
    line.to_string()
}

/// The scheduler's line: the gauges of `queue`.
pub fn gauges_line(namespace: &str, queue: &str, gauges: &QueueGauges, at: SystemTime) -> String {
    let values = [
        json!(gauges.oldest_due_pending_secs),
        json!(gauges.due_pending),
        json!(gauges.dispatched),
        json!(gauges.running),
    ];
    line(namespace, queue, at, &GAUGES, values)
}

/// The worker's line: what one batch did.
pub fn outcomes_line(namespace: &str, queue: &str, tally: &Tally, at: SystemTime) -> String {
    let values =
        [tally.succeeded, tally.retried, tally.failed, tally.superseded, tally.stale, tally.returned, tally.malformed];
    line(namespace, queue, at, &OUTCOMES, values.map(|count| json!(count)))
}

/// Writes `line` and a newline to stdout in one call, so that no other output splits it.
pub fn print(line: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(format!("{line}\n").as_bytes())?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The parsed line, checked for what EMF requires of any line: the timestamp, one directive
    /// under the namespace with the dimension `Queue`, declaring exactly `metrics`, each with its
    /// value at the top level, and nothing else there.
    fn checked(text: &str, metrics: &[(&str, &str)]) -> Value {
        let line: Value = serde_json::from_str(text).unwrap();
        assert_eq!(line["_aws"]["Timestamp"], 1_764_000_000_123_u64);
        let directive = &line["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "rowq/prod");
        assert_eq!(directive["Dimensions"], json!([["Queue"]]));
        assert_eq!(line["Queue"], "emails");
        let declared: Vec<(&str, &str)> = directive["Metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["Name"].as_str().unwrap(), m["Unit"].as_str().unwrap()))
            .collect();
        assert_eq!(declared, metrics);
        assert!(metrics.iter().all(|(name, _)| line[*name].is_number()), "{line}");
        assert_eq!(line.as_object().unwrap().len(), 2 + metrics.len(), "{line}");
        line
    }

    const AT: Duration = Duration::from_millis(1_764_000_000_123);

    #[test]
    fn a_gauges_line_carries_each_gauge_under_its_name() {
        let gauges = QueueGauges { oldest_due_pending_secs: 42.5, due_pending: 7, dispatched: 3, running: 2 };
        let line = checked(&gauges_line("rowq/prod", "emails", &gauges, UNIX_EPOCH + AT), &GAUGES);
        assert_eq!(line["OldestDuePendingSeconds"], 42.5);
        assert_eq!((&line["DuePending"], &line["Dispatched"], &line["Running"]), (&json!(7), &json!(3), &json!(2)));
    }

    #[test]
    fn an_outcomes_line_carries_each_count_under_its_name() {
        let tally = Tally { succeeded: 1, retried: 2, failed: 3, superseded: 4, stale: 5, returned: 6, malformed: 7 };
        let line = checked(&outcomes_line("rowq/prod", "emails", &tally, UNIX_EPOCH + AT), &OUTCOMES);
        let counts: Vec<u64> = OUTCOMES.iter().map(|(name, _)| line[*name].as_u64().unwrap()).collect();
        assert_eq!(counts, [1, 2, 3, 4, 5, 6, 7]);
    }
}
