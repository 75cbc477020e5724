//! Logging set-up: JSON lines on Lambda and in production, readable text on a terminal.
//!
//! Field names are stable and dotted, so log queries keep working across releases:
//! `job.id`, `job.kind`, `job.attempt`, `job.dispatch_gen`, `job.from`, `job.to`,
//! `sqs.message_id`, `sqs.group_id`. Payloads and secrets are never logged.
//!
//! `RUST_LOG` takes a level and `target=level` directives (`warn,rowq=debug`), parsed by
//! `tracing_subscriber`'s [`Targets`]: not its `EnvFilter`, whose span and field matching
//! nobody here uses and which compiles a regular-expression engine into every binary.

use tracing::{Level, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
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
    init_with_default(format, Level::INFO);
}

/// [`init`] with another level for when `RUST_LOG` is unset (`rowq demo` keeps quiet).
pub fn init_with_default(format: LogFormat, default: Level) {
    let (filter, rejected) = filter(std::env::var("RUST_LOG").ok().as_deref(), default);
    if subscriber(format, filter).try_init().is_ok()
        && let Some(rejected) = rejected
    {
        tracing::warn!(%default, "{rejected}; using the default");
    }
}

/// Lines in `format` on stderr, through `filter`. The lines layer has no level of its own, so the
/// filter's level is the subscriber's hint to `tracing` and to `log` (which sqlx writes its
/// statement log to): a debug call site is skipped where it is, not built and then dropped.
fn subscriber(format: LogFormat, filter: Targets) -> impl Subscriber + Send + Sync {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let lines = tracing_subscriber::fmt::layer().with_target(false).with_writer(std::io::stderr).with_ansi(ansi);
    let lines = match format {
        LogFormat::Json => lines.json().flatten_event(true).with_current_span(false).boxed(),
        LogFormat::Text => lines.compact().boxed(),
    };
    tracing_subscriber::registry().with(lines).with(filter)
}

/// The filter from `RUST_LOG` when it is set and parses, else `default` everywhere; with what a
/// set `RUST_LOG` was and why it was rejected, to be logged once the subscriber is up.
fn filter(rust_log: Option<&str>, default: Level) -> (Targets, Option<String>) {
    let fallback = || Targets::new().with_default(default);
    match rust_log.map(str::trim).filter(|value| !value.is_empty()) {
        None => (fallback(), None),
        Some(value) => match value.parse::<Targets>() {
            Ok(targets) => (targets, None),
            Err(error) => (fallback(), Some(format!("RUST_LOG={value:?} is not a filter: {error}"))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::filter::LevelFilter;

    #[test]
    fn rust_log_sets_the_level_per_target() {
        let (targets, rejected) = filter(Some("warn,rowq=debug"), Level::INFO);
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
            for format in [LogFormat::Json, LogFormat::Text] {
                let subscriber = subscriber(format, filter(Some(rust_log), Level::INFO).0);
                assert_eq!(subscriber.max_level_hint(), Some(level), "{rust_log}");
            }
        }
    }

    #[test]
    fn an_unset_or_blank_rust_log_takes_the_default() {
        for unset in [None, Some(""), Some("  ")] {
            let (targets, rejected) = filter(unset, Level::ERROR);
            assert_eq!(rejected, None);
            assert!(targets.would_enable("rowq", &Level::ERROR));
            assert!(!targets.would_enable("rowq", &Level::WARN));
        }
    }

    #[test]
    fn a_rust_log_that_does_not_parse_falls_back_and_says_why() {
        let (targets, rejected) = filter(Some("rowq=loud"), Level::INFO);
        assert!(rejected.is_some(), "an invalid level must be reported");
        assert!(rejected.is_some_and(|why| why.contains("\"rowq=loud\"")), "the report names the value");
        assert!(targets.would_enable("rowq", &Level::INFO));
        assert!(!targets.would_enable("rowq", &Level::DEBUG));
    }
}
