//! Logging: `tracing` to stderr, as text or JSON lines, filtered by `RUST_LOG` (default `info`);
//! and [`traces`]: OpenTelemetry spans over OTLP (`[telemetry]`), a request's or message's
//! [`span::Trace`] and its phases, what the exporter drops ([`export`]).

mod export;
pub mod span;
pub mod traces;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber. Calling it twice is harmless (the second call is ignored).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
