//! Logging set-up: JSON lines on Lambda and in production, readable text on a terminal.
//!
//! Field names are stable and dotted, so log queries keep working across releases:
//! `job.id`, `job.kind`, `job.attempt`, `job.dispatch_gen`, `job.from`, `job.to`,
//! `sqs.message_id`, `sqs.group_id`. Payloads and secrets are never logged.

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Text,
}

/// Installs the global subscriber. The level comes from `RUST_LOG` (default `info`).
/// Calling it twice is harmless (the second call does nothing).
pub fn init(format: LogFormat) {
    init_with_default(format, "info");
}

/// [`init`] with another level for when `RUST_LOG` is unset (`rowq demo` keeps quiet).
pub fn init_with_default(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
        LogFormat::Text => builder.compact().try_init(),
    };
}
