//! The scheduler's metrics: its queue's gauges ([`QueueGauges`]) as CloudWatch Embedded Metric
//! Format lines on stdout, when `ROWQ_METRICS_NAMESPACE` names a namespace. CloudWatch Logs
//! turns each such line of a Lambda's (or an ECS task's `awslogs`) output into metric values:
//! no SDK call, no permission beyond writing the logs, nothing lost to a metrics agent. The
//! logs themselves go to stderr, so stdout carries only these lines.
//!
//! Only the database knows how long due jobs have waited: a scheduler that stopped, sends that
//! SQS refuses, an in-flight cap that is too low all show as `OldestDuePendingSeconds` growing,
//! and no SQS metric sees a job that was never published.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::json;

use crate::store::admin::QueueGauges;

/// The metric names and units, in the order of [`QueueGauges`]'s fields.
pub const METRICS: [(&str, &str); 4] =
    [("OldestDuePendingSeconds", "Seconds"), ("DuePending", "Count"), ("Dispatched", "Count"), ("Running", "Count")];

/// One EMF line: the gauges of `queue` under `namespace`, with the dimension `Queue`.
pub fn emf_line(namespace: &str, queue: &str, gauges: &QueueGauges, at: SystemTime) -> String {
    let timestamp = at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis());
    let definitions: Vec<_> = METRICS.iter().map(|(name, unit)| json!({"Name": name, "Unit": unit})).collect();
    let values = [
        json!(gauges.oldest_due_pending_secs),
        json!(gauges.due_pending),
        json!(gauges.dispatched),
        json!(gauges.running),
    ];
    let mut line = json!({
        "_aws": {
            "Timestamp": timestamp,
            "CloudWatchMetrics": [{"Namespace": namespace, "Dimensions": [["Queue"]], "Metrics": definitions}],
        },
        "Queue": queue,
    });
    for ((name, _), value) in METRICS.iter().zip(values) {
        line[*name] = value;
    }
    line.to_string()
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

    #[test]
    fn a_line_declares_each_metric_it_carries_under_the_namespace_and_the_queue() {
        let gauges = QueueGauges { oldest_due_pending_secs: 42.5, due_pending: 7, dispatched: 3, running: 2 };
        let at = UNIX_EPOCH + Duration::from_millis(1_764_000_000_123);
        let line: serde_json::Value = serde_json::from_str(&emf_line("rowq/prod", "emails", &gauges, at)).unwrap();
        let aws = &line["_aws"];
        assert_eq!(aws["Timestamp"], 1_764_000_000_123_u64);
        let directive = &aws["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "rowq/prod");
        assert_eq!(directive["Dimensions"], json!([["Queue"]]));
        assert_eq!(line["Queue"], "emails");
        let declared: Vec<(&str, &str)> = directive["Metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["Name"].as_str().unwrap(), m["Unit"].as_str().unwrap()))
            .collect();
        assert_eq!(declared, METRICS);
        // Each declared metric has its value at the top level, as EMF requires.
        assert_eq!(line["OldestDuePendingSeconds"], 42.5);
        assert_eq!(line["DuePending"], 7);
        assert_eq!(line["Dispatched"], 3);
        assert_eq!(line["Running"], 2);
        assert_eq!(line.as_object().unwrap().len(), 2 + METRICS.len(), "{line}");
    }
}
