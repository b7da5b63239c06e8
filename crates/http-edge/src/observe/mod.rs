//! What every request goes through and what an operator watches of it: the edge middleware
//! ([`http`]: request ids, the request span and line, the HTTP metrics), the log format, and the
//! upkeep that keeps the metric recorder's memory flat.

pub mod http;

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use crate::metrics::Metrics;

/// How the server writes its log lines (stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event, with the span's fields in front.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields`, and the `span` with
    /// the request's method, route and request id.
    Json,
}

/// Installs the process's log subscriber: `filter` is a tracing filter (`LAB_LOG`), e.g. `info`.
/// Called once by each server command; the tests start servers without it.
pub fn init_logging(format: LogFormat, filter: tracing_subscriber::EnvFilter) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}

/// How often histogram samples are folded into their buckets when nobody scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Keeps the recorder's memory flat between scrapes, until shutdown.
pub fn spawn_upkeep(metrics: Metrics, tasks: &TaskTracker, shutdown: CancellationToken) {
    tasks.spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = every.tick() => metrics.upkeep(),
            }
        }
    });
}
