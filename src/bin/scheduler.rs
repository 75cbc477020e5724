//! The scheduler: claims due rows and publishes them to SQS FIFO until SIGTERM/SIGINT.
//! `scheduler --once` runs one drain pass and exits; `ROWQ_DRAIN_SECS` bounds a run. Started by
//! the Lambda service (an EventBridge schedule), each invocation is one bounded drain.

use anyhow::Context;
use rowq::config::{self, SchedulerConfig};
use rowq::{entry, telemetry};

fn main() -> anyhow::Result<()> {
    telemetry::init(config::log_format());
    let once = std::env::args().any(|arg| arg == "--once");
    let config = SchedulerConfig::from_env().context("invalid scheduler configuration")?;
    entry::scheduler(config, once).map_err(|error| anyhow::anyhow!(error))
}
