//! The benchmarks `production-lab bench …` runs: figures are printed, never asserted by tests.
//! Each drives real server processes ([`crate::server::ServerUnderTest`]) over loopback HTTP or
//! through a private nats-server, and verifies the end state row by row before it reports.
//!
//! - [`ordered`]: the general ordered route (group commit) against the raw baseline, the same
//!   apply transaction once per message straight through rusqlite;
//! - [`postgres`]: the same load on SQLite, on a private PostgreSQL through one server and
//!   through two, next to [`peer`], the same apply as one PL/pgSQL call per message under
//!   pgbench, with what each load cost PostgreSQL statement by statement ([`statements`]);
//! - [`stampede`]: concurrent callers of the cache's shared key behind the lab gate;
//! - [`broker`]: NATS JetStream through the inbox against a raw consume-and-ack baseline;
//! - [`flood`]: the broker door's fairness and catch-up under one aggregate's flood of early
//!   messages;
//! - [`relay`]: an outbox through `relay` processes and JetStream to another server's inbox;
//! - [`gate`]: the gate from its input stream to its in-order output stream, beside [`broker`];
//! - [`retention`]: a gate's store under a retention policy, its size sampled as millions of
//!   messages go through, against the same load with retention off.

pub mod broker;
mod database;
pub mod flood;
pub mod gate;
pub mod ordered;
pub mod peer;
pub mod postgres;
pub mod relay;
pub mod retention;
pub mod stampede;
pub mod statements;

use std::time::Duration;

use ordered_inbox::OrderedMessage;

pub use database::verify_end_state;

use crate::nats::NatsServerError;
use crate::server::ServerError;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("could not start {0}")]
    Startup(String),
    #[error("verification failed: {0}")]
    Verification(String),
    #[error("HTTP: {0}")]
    Http(#[from] reqwest::Error),
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("store: {0}")]
    Store(#[from] ordered_inbox::sqlite::StoreError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Nats(#[from] NatsServerError),
    #[error("NATS: {0}")]
    Broker(String),
    #[error("gate store: {0}")]
    GateStore(String),
}

impl BenchError {
    /// A JetStream call that failed.
    fn nats(error: impl std::fmt::Display) -> BenchError {
        BenchError::Broker(error.to_string())
    }

    /// A spawned task that panicked or was cancelled.
    fn task(what: &str, error: tokio::task::JoinError) -> BenchError {
        BenchError::Verification(format!("{what} failed: {error}"))
    }
}

/// Refuses a workload with a zero among its sizes; `names` says which sizes they are.
fn require_positive(sizes: &[usize], names: &str) -> Result<(), BenchError> {
    if sizes.contains(&0) {
        return Err(BenchError::Verification(format!(
            "{names} must be positive"
        )));
    }
    Ok(())
}

/// The messages of one aggregate, in sequence order.
#[derive(Debug, Clone)]
pub struct AggregateStream {
    pub aggregate_id: String,
    pub messages: Vec<OrderedMessage>,
}

/// `messages` valid messages spread evenly over `aggregates` aggregates `bench-0`, `bench-1` ….
pub fn workload(aggregates: usize, messages: usize) -> Vec<AggregateStream> {
    (0..aggregates)
        .map(|index| {
            let aggregate_id = format!("bench-{index}");
            let count = messages / aggregates + usize::from(index < messages % aggregates);
            let messages = (1..=count as i64)
                .map(|sequence| ledger_message(&aggregate_id, sequence, sequence % 7 + 1))
                .collect();
            AggregateStream {
                aggregate_id,
                messages,
            }
        })
        .collect()
}

/// Message `AGGREGATE-SEQUENCE` of `aggregate_id` worth `amount`: the payload the lesson's ledger
/// reads, `{"Amount": amount}`.
pub fn ledger_message(aggregate_id: &str, sequence: i64, amount: i64) -> OrderedMessage {
    OrderedMessage {
        message_id: format!("{aggregate_id}-{sequence}"),
        aggregate_id: aggregate_id.to_owned(),
        sequence,
        payload: serde_json::json!({ "Amount": amount }),
    }
}

/// The amount a workload message carries (see [`ledger_message`]).
pub fn amount(message: &OrderedMessage) -> i64 {
    message.payload["Amount"].as_i64().unwrap_or_default()
}

/// The messages position by position across the aggregates, so that every aggregate's messages
/// come in sequence order while the aggregates interleave.
fn interleaved(streams: &[AggregateStream]) -> Vec<&OrderedMessage> {
    let longest = streams.iter().map(|s| s.messages.len()).max().unwrap_or(0);
    (0..longest)
        .flat_map(|position| streams.iter().filter_map(move |s| s.messages.get(position)))
        .collect()
}

/// Stream `i` goes to share `i % shares`: one share per concurrent client.
fn shares(streams: &[AggregateStream], shares: usize) -> Vec<Vec<AggregateStream>> {
    let mut owned: Vec<Vec<AggregateStream>> = vec![Vec::new(); shares.max(1)];
    for (index, stream) in streams.iter().enumerate() {
        owned[index % shares.max(1)].push(stream.clone());
    }
    owned
}

/// A message's body on the general route and on the broker door.
fn message_body(message: &OrderedMessage) -> serde_json::Value {
    serde_json::json!({
        "messageId": message.message_id,
        "sequence": message.sequence,
        "amount": amount(message),
    })
}

/// The nearest-rank percentile of sorted durations, in milliseconds (0 for none).
pub fn percentile(sorted: &[Duration], quantile: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64 * quantile).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

/// The longest of sorted durations, in milliseconds (0 for none).
fn max_ms(sorted: &[Duration]) -> f64 {
    sorted.last().map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// KiB as MiB.
fn mib(kib: Option<u64>) -> Option<f64> {
    kib.map(|kib| kib as f64 / 1024.0)
}

/// The value of the unlabelled series `name` on a Prometheus text page.
fn metric_value(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// A loopback HTTP client (no proxy) with room for `connections` idle keep-alive connections.
fn http_client(connections: usize, timeout: Duration) -> Result<reqwest::Client, BenchError> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(connections)
        .timeout(timeout)
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_spreads_messages_evenly_in_sequence_order() {
        let streams = workload(3, 10);
        let counts: Vec<usize> = streams.iter().map(|s| s.messages.len()).collect();
        assert_eq!(counts, [4, 3, 3]);
        assert!(streams.iter().all(|s| {
            s.messages
                .iter()
                .enumerate()
                .all(|(i, m)| m.sequence == i as i64 + 1 && m.aggregate_id == s.aggregate_id)
        }));
    }

    #[test]
    fn interleaving_keeps_each_aggregate_in_sequence_order() {
        let streams = workload(2, 5);
        let order: Vec<&str> = interleaved(&streams)
            .iter()
            .map(|m| m.message_id.as_str())
            .collect();
        assert_eq!(
            order,
            [
                "bench-0-1",
                "bench-1-1",
                "bench-0-2",
                "bench-1-2",
                "bench-0-3"
            ]
        );
        let owned = shares(&streams, 3);
        assert_eq!(owned.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 0]);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let sorted: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&sorted, 0.50), 50.0);
        assert_eq!(percentile(&sorted, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
        assert_eq!(max_ms(&sorted), 100.0);
    }

    #[test]
    fn a_zero_size_is_refused_with_the_names_of_the_sizes() {
        assert!(require_positive(&[1, 2], "a and b").is_ok());
        let error = require_positive(&[1, 0], "a and b").expect_err("a zero");
        assert_eq!(
            error.to_string(),
            "verification failed: a and b must be positive"
        );
    }
}
