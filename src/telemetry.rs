//! Logging set-up: JSON lines on Lambda and in production, readable text on a terminal.
//!
//! Field names are stable and dotted, so log queries keep working across releases:
//! `job.id`, `job.kind`, `job.attempt`, `job.dispatch_gen`, `job.from`, `job.to`,
//! `sqs.message_id`, `sqs.group_id`. Payloads and secrets are never logged.
//!
//! `RUST_LOG` takes a level and `target=level` directives (`warn,rowq=debug`), parsed by
//! `tracing_subscriber`'s [`Targets`]: not its `EnvFilter`, whose span and field matching
//! nobody here uses and which compiles a regular-expression engine into every binary.

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

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
    let rust_log = std::env::var("RUST_LOG").ok();
    let (filter, rejected) = filter(rust_log.as_deref(), default_filter);
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_max_level(most_verbose(&filter))
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let installed = match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).finish().with(filter).try_init(),
        LogFormat::Text => builder.compact().finish().with(filter).try_init(),
    };
    if let (Ok(()), Some(error)) = (installed, rejected) {
        tracing::warn!(%error, rust_log = rust_log.as_deref().unwrap_or_default(), default = default_filter, "RUST_LOG is not a filter; using the default");
    }
}

/// The most verbose level `filter` lets through anywhere. The subscriber's own level is set to it
/// so that its hint to `tracing` and `log` (which sqlx writes its statement log to) is the
/// filter's: a debug statement is then skipped at its call site, not built and then dropped.
fn most_verbose(filter: &Targets) -> LevelFilter {
    filter.iter().map(|(_, level)| level).chain(filter.default_level()).max().unwrap_or(LevelFilter::OFF)
}

/// The filter from `RUST_LOG` when it is set and parses, else from the default; with the reason
/// a set `RUST_LOG` was rejected, to be logged once the subscriber is up.
fn filter(rust_log: Option<&str>, default_filter: &str) -> (Targets, Option<String>) {
    let default =
        || default_filter.parse::<Targets>().unwrap_or_else(|_| Targets::new().with_default(tracing::Level::INFO));
    match rust_log.map(str::trim).filter(|value| !value.is_empty()) {
        None => (default(), None),
        Some(value) => match value.parse::<Targets>() {
            Ok(targets) => (targets, None),
            Err(error) => (default(), Some(error.to_string())),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    #[test]
    fn rust_log_sets_the_level_per_target() {
        let (targets, rejected) = filter(Some("warn,rowq=debug"), "info");
        assert_eq!(rejected, None);
        assert!(targets.would_enable("rowq::worker", &Level::DEBUG));
        assert!(!targets.would_enable("rowq::worker", &Level::TRACE));
        assert!(targets.would_enable("sqlx::query", &Level::WARN));
        assert!(!targets.would_enable("sqlx::query", &Level::INFO));
    }

    #[test]
    fn the_subscriber_level_is_the_most_verbose_the_filter_lets_through() {
        for (rust_log, level) in [
            ("warn,rowq=debug", LevelFilter::DEBUG),
            ("error", LevelFilter::ERROR),
            ("rowq=trace,sqlx=warn", LevelFilter::TRACE),
            ("off", LevelFilter::OFF),
        ] {
            assert_eq!(most_verbose(&filter(Some(rust_log), "info").0), level, "{rust_log}");
        }
    }

    #[test]
    fn an_unset_or_blank_rust_log_takes_the_default() {
        for unset in [None, Some(""), Some("  ")] {
            let (targets, rejected) = filter(unset, "error");
            assert_eq!(rejected, None);
            assert!(targets.would_enable("rowq", &Level::ERROR));
            assert!(!targets.would_enable("rowq", &Level::WARN));
        }
    }

    #[test]
    fn a_rust_log_that_does_not_parse_falls_back_and_says_why() {
        let (targets, rejected) = filter(Some("rowq=loud"), "info");
        assert!(rejected.is_some(), "an invalid level must be reported");
        assert!(targets.would_enable("rowq", &Level::INFO));
        assert!(!targets.would_enable("rowq", &Level::DEBUG));
    }
}
