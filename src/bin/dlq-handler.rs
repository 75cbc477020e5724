//! The dead-letter Lambda: marks jobs whose messages were dead-lettered as `failed`.

use rowq::config::{self, WorkerConfig};
use rowq::{dlq, store, telemetry};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    telemetry::init(config::log_format());
    let config = WorkerConfig::from_env()?;
    let pool = store::connect_lazy(&config.database)?;
    dlq::run_lambda(pool).await
}
