//! The scheduler: claims due rows and publishes them to SQS FIFO until SIGTERM/SIGINT.
//! `scheduler --once` runs one drain pass and exits; `ROWQ_DRAIN_SECS` bounds a run. Started by
//! the Lambda service (an EventBridge schedule), each invocation is one bounded drain.
//! `scheduler --health-check` asks a running scheduler's `/livez` (`ROWQ_HEALTH_LISTEN`) and
//! exits 0 if it answered 200, for a container health check.

use anyhow::Context;
use rowq::config::{self, SchedulerConfig};
use rowq::{entry, telemetry};

fn main() -> anyhow::Result<()> {
    telemetry::init(config::log_format());
    if std::env::args().any(|arg| arg == "--health-check") {
        return entry::health_check().map_err(|error| anyhow::anyhow!(error));
    }
    let once = std::env::args().any(|arg| arg == "--once");
    let config = SchedulerConfig::from_env().context("invalid scheduler configuration")?;
    entry::scheduler(config, once).map_err(|error| anyhow::anyhow!(error))
}
