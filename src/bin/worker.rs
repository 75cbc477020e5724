//! The worker Lambda: runs the built-in job kinds (`noop`, `echo`, `sleep`, `fail`).
//! Your own worker registers your handlers the same way (see `rowq::entry`).

use rowq::config::{self, WorkerConfig};
use rowq::{Registry, entry, telemetry};

fn main() -> Result<(), entry::Error> {
    telemetry::init(config::log_format());
    entry::worker(WorkerConfig::from_env()?, Registry::builtin())
}
