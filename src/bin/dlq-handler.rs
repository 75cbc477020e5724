//! The dead-letter Lambda: marks jobs whose messages were dead-lettered as `failed`.

use rowq::config::{self, WorkerConfig};
use rowq::{dlq, secret, store, telemetry};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    telemetry::init(config::log_format());
    let mut config = WorkerConfig::from_env()?;
    secret::resolve(&mut config.database).await?;
    let pool = store::connect_lazy(&config.database)?;
    dlq::run_lambda(pool).await
}
