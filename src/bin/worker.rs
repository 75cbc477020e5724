//! The worker Lambda: runs the built-in job kinds (`noop`, `echo`, `sleep`, `fail`).
//! Your own worker registers your handlers the same way and calls `run_lambda`.

use rowq::config::{self, WorkerConfig};
use rowq::{Registry, Worker, secret, store, telemetry, worker};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    telemetry::init(config::log_format());
    let mut config = WorkerConfig::from_env()?;
    secret::resolve(&mut config.database).await?;
    let pool = store::connect_lazy(&config.database)?;
    worker::run_lambda(Worker::new(pool, Registry::builtin(), config)).await
}
