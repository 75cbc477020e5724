//! The dead-letter Lambda: marks jobs whose messages were dead-lettered as `failed`.

use rowq::config::{self, WorkerConfig};
use rowq::{entry, telemetry};

fn main() -> Result<(), entry::Error> {
    telemetry::init(config::log_format());
    entry::dlq_handler(WorkerConfig::from_env()?)
}
