//! `bench ordered`: the real server as a child process on a temp database, the general ordered
//! route driven over keep-alive loopback HTTP, the end state verified row by row, and in the
//! same run the raw baseline: the same apply transaction, one durable transaction per message,
//! straight through rusqlite.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ordered_inbox::sqlite::engine::Unit;
use ordered_inbox::sqlite::{SqliteHandler, WriterConnection};
use ordered_inbox::{AcceptAll, Door, Limits, Outcome};
use rusqlite::Connection;
use serde::Serialize;
use serde_json::Value;

use super::database::{database_size, verify_end_state};
use super::{
    AggregateStream, BenchError, http_client, interleaved, max_ms, message_body, mib, percentile,
    require_positive, shares, workload,
};
use crate::process::{CostPerMessage, ProcessUsage};
use crate::progress::{Progress, ProgressCounter};
use crate::server::{ServerUnderTest, Synchronous, synchronous_flag};

#[derive(Debug, Clone)]
pub struct OrderedOptions {
    pub aggregates: usize,
    pub messages: usize,
    pub concurrency: usize,
    pub synchronous: Synchronous,
    /// The server binary to bench; `None` for the running one.
    pub server: Option<PathBuf>,
    /// What the raw baseline applies: the server's own handler.
    pub baseline: RawApplication,
}

/// The application the raw baseline runs in each transaction, as the server does: its handler,
/// and the migration of the tables (or triggers) it keeps beside the inbox's.
#[derive(Clone)]
pub struct RawApplication {
    pub handler: Arc<dyn SqliteHandler>,
    pub migrate: fn(&Connection) -> rusqlite::Result<()>,
}

impl RawApplication {
    /// The inbox alone: every message applies and nothing else is written.
    pub fn inbox_only() -> RawApplication {
        RawApplication {
            handler: Arc::new(AcceptAll),
            migrate: |_| Ok(()),
        }
    }
}

impl std::fmt::Debug for RawApplication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawApplication").finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OrderedReport {
    pub aggregates: usize,
    pub messages: usize,
    pub concurrency: usize,
    pub synchronous: &'static str,
    pub http_messages_per_second: f64,
    pub raw_messages_per_second: f64,
    pub ratio: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub server_peak_rss_mib: Option<f64>,
    /// The server process's CPU and storage writes per applied message.
    pub server_cost: Option<CostPerMessage>,
    /// The database file's bytes per applied message after the load (page count × page size).
    pub database_bytes_per_message: Option<f64>,
    /// Deliveries per group commit during the load, from the server's `/metrics` (unknown for a
    /// build without the writer's batch histogram).
    pub units_per_commit: Option<f64>,
    /// This process's CPU per message during the load: the load generator shares the cores.
    pub client_cpu_us_per_message: Option<f64>,
}

impl std::fmt::Display for OrderedReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench ordered: {} messages over {} aggregates, {} concurrent clients, synchronous={}",
            self.messages, self.aggregates, self.concurrency, self.synchronous
        )?;
        writeln!(
            f,
            "  HTTP (group commit):   {:>10.0} messages/s",
            self.http_messages_per_second
        )?;
        writeln!(
            f,
            "  raw (one tx/message):  {:>10.0} messages/s",
            self.raw_messages_per_second
        )?;
        writeln!(f, "  ratio HTTP/raw:        {:>10.2}", self.ratio)?;
        writeln!(
            f,
            "  latency ms: p50 {:.2}  p95 {:.2}  p99 {:.2}  max {:.2}",
            self.p50_ms, self.p95_ms, self.p99_ms, self.max_ms
        )?;
        match self.server_peak_rss_mib {
            Some(mib) => writeln!(f, "  server peak RSS:       {mib:>10.1} MiB")?,
            None => writeln!(f, "  server peak RSS:       unknown (no /proc)")?,
        }
        match self.server_cost {
            Some(cost) => writeln!(
                f,
                "  server CPU/message:    {:>10.1} µs (user {:.1} + system {:.1})",
                cost.user_us + cost.system_us,
                cost.user_us,
                cost.system_us
            )?,
            None => writeln!(f, "  server CPU/message:    unknown (no /proc)")?,
        }
        let written = self
            .server_cost
            .and_then(|cost| cost.storage_bytes)
            .map_or("unknown".to_owned(), |bytes| format!("{bytes:.0} B"));
        let file = self
            .database_bytes_per_message
            .map_or("unknown".to_owned(), |bytes| format!("{bytes:.0} B"));
        writeln!(
            f,
            "  storage/message:       {written:>10} written, {file} of database file"
        )?;
        let unknown = |figure: Option<f64>, unit: &str| {
            figure.map_or("unknown".to_owned(), |value| format!("{value:.1}{unit}"))
        };
        write!(
            f,
            "  per group commit:      {:>10} deliveries; bench client CPU/message {}",
            unknown(self.units_per_commit, ""),
            unknown(self.client_cpu_us_per_message, " µs")
        )
    }
}

/// Runs the HTTP load, verifies the end state, then runs the raw baseline.
pub async fn ordered(options: &OrderedOptions) -> Result<OrderedReport, BenchError> {
    require_positive(
        &[options.aggregates, options.messages, options.concurrency],
        "aggregates, messages and concurrency",
    )?;
    let streams = workload(options.aggregates, options.messages);
    let server = match &options.server {
        Some(binary) => {
            ServerUnderTest::start_binary(binary, options.synchronous, options.concurrency, &[])?
        }
        None => ServerUnderTest::start(options.synchronous, options.concurrency)?,
    };
    let load = measured_load(&server, &streams, options.concurrency).await?;
    let stopped = server.stop()?;
    verify_end_state(&stopped.database, &streams)?;
    let database_bytes = database_size(&stopped.database)?;
    let raw_per_second =
        timed_raw_baseline(&streams, options.synchronous, &options.baseline).await?;
    Ok(OrderedReport::new(
        options,
        &load,
        raw_per_second,
        database_bytes,
    ))
}

/// One HTTP load on one server and what it cost the server and this process.
struct MeasuredLoad {
    elapsed: Duration,
    /// Sorted.
    latencies: Vec<Duration>,
    peak_rss_kib: Option<u64>,
    server_cost: Option<CostPerMessage>,
    client_cost: Option<CostPerMessage>,
    units_per_commit: Option<f64>,
}

/// [`http_load`] on `server`, with its usage, this process's usage and the server's writer
/// batches read before and after.
async fn measured_load(
    server: &ServerUnderTest,
    streams: &[AggregateStream],
    concurrency: usize,
) -> Result<MeasuredLoad, BenchError> {
    let messages: usize = streams.iter().map(|stream| stream.messages.len()).sum();
    let metrics = http_client(1, Duration::from_secs(30))?;
    let commits_before = writer_batches(&metrics, &server.address).await;
    let client_before = ProcessUsage::read(std::process::id());
    let usage_before = server.usage();
    let addresses = std::slice::from_ref(&server.address);
    let (elapsed, latencies) =
        http_load("bench ordered: HTTP", addresses, streams, concurrency).await?;
    let cost_since = |after: Option<ProcessUsage>, before: Option<ProcessUsage>| {
        after
            .zip(before)
            .map(|(after, before)| after.per_message(&before, messages))
    };
    Ok(MeasuredLoad {
        elapsed,
        latencies,
        peak_rss_kib: server.peak_rss_kib(),
        server_cost: cost_since(server.usage(), usage_before),
        client_cost: cost_since(ProcessUsage::read(std::process::id()), client_before),
        units_per_commit: writer_batches(&metrics, &server.address)
            .await
            .zip(commits_before)
            .and_then(|(after, before)| after.since(&before).units_per_commit()),
    })
}

impl OrderedReport {
    fn new(
        options: &OrderedOptions,
        load: &MeasuredLoad,
        raw_per_second: f64,
        database_bytes: i64,
    ) -> OrderedReport {
        let http_per_second = options.messages as f64 / load.elapsed.as_secs_f64();
        OrderedReport {
            aggregates: options.aggregates,
            messages: options.messages,
            concurrency: options.concurrency,
            synchronous: synchronous_flag(options.synchronous),
            http_messages_per_second: http_per_second,
            raw_messages_per_second: raw_per_second,
            ratio: http_per_second / raw_per_second,
            p50_ms: percentile(&load.latencies, 0.50),
            p95_ms: percentile(&load.latencies, 0.95),
            p99_ms: percentile(&load.latencies, 0.99),
            max_ms: max_ms(&load.latencies),
            server_peak_rss_mib: mib(load.peak_rss_kib),
            server_cost: load.server_cost,
            database_bytes_per_message: Some(database_bytes as f64 / options.messages as f64),
            units_per_commit: load.units_per_commit,
            client_cpu_us_per_message: load.client_cost.map(|cost| cost.user_us + cost.system_us),
        }
    }
}

/// The writer's group commits so far and the deliveries they carried, as the server's
/// `inbox_writer_batch_size` histogram counts them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct WriterBatches {
    commits: f64,
    units: f64,
}

impl WriterBatches {
    /// Reads the histogram's `_count` and `_sum` from a Prometheus text page.
    pub(super) fn parse(page: &str) -> Option<WriterBatches> {
        Some(WriterBatches {
            commits: super::metric_value(page, "inbox_writer_batch_size_count")?,
            units: super::metric_value(page, "inbox_writer_batch_size_sum")?,
        })
    }

    fn since(&self, earlier: &WriterBatches) -> WriterBatches {
        WriterBatches {
            commits: self.commits - earlier.commits,
            units: self.units - earlier.units,
        }
    }

    pub(super) fn units_per_commit(&self) -> Option<f64> {
        (self.commits > 0.0).then(|| self.units / self.commits)
    }
}

/// The server's writer batches, or `None` when its `/metrics` page does not have them.
async fn writer_batches(client: &reqwest::Client, address: &str) -> Option<WriterBatches> {
    let response = client.get(format!("{address}/metrics")).send().await.ok()?;
    WriterBatches::parse(&response.text().await.ok()?)
}

/// Runs one load through `addresses`: `concurrency` clients over keep-alive connections, client
/// `i` owning aggregates `i`, `i + concurrency` … and sending to server `i % addresses.len()`.
/// The elapsed time and every request's latency, sorted.
pub(super) async fn http_load(
    label: &str,
    addresses: &[String],
    streams: &[AggregateStream],
    concurrency: usize,
) -> Result<(Duration, Vec<Duration>), BenchError> {
    let client = http_client(concurrency, Duration::from_secs(60))?;
    let total: usize = streams.iter().map(|stream| stream.messages.len()).sum();
    let progress = Progress::start(label, total as u64, "messages");
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for (index, streams) in shares(streams, concurrency)
        .into_iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
    {
        let client = client.clone();
        let address = addresses[index % addresses.len()].clone();
        let counter = progress.counter();
        clients.spawn(async move { drive_client(&client, &address, streams, &counter).await });
    }
    let mut latencies = Vec::with_capacity(total);
    while let Some(joined) = clients.join_next().await {
        latencies.extend(joined.map_err(|e| BenchError::task("a client task", e))??);
    }
    let elapsed = started.elapsed();
    progress.finish();
    latencies.sort_unstable();
    Ok((elapsed, latencies))
}

/// Sends one client's aggregates' messages, interleaved, each aggregate in order. Anything but
/// `200 applied` is a failure: this load has no gaps, stale or poison messages.
async fn drive_client(
    client: &reqwest::Client,
    address: &str,
    streams: Vec<AggregateStream>,
    progress: &ProgressCounter,
) -> Result<Vec<Duration>, BenchError> {
    let mut latencies = Vec::new();
    for message in interleaved(&streams) {
        let url = format!("{address}/aggregates/{}/messages", message.aggregate_id);
        let sent = Instant::now();
        let response = client
            .post(&url)
            .json(&message_body(message))
            .send()
            .await?;
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        latencies.push(sent.elapsed());
        if status != reqwest::StatusCode::OK || answer["outcome"] != "applied" {
            return Err(BenchError::Verification(format!(
                "{} sequence {}: unexpected answer {status} {answer}",
                message.aggregate_id, message.sequence
            )));
        }
        progress.add(1);
    }
    Ok(latencies)
}

/// [`raw_baseline`] off the async runtime, with its progress.
async fn timed_raw_baseline(
    streams: &[AggregateStream],
    synchronous: Synchronous,
    application: &RawApplication,
) -> Result<f64, BenchError> {
    let total: usize = streams.iter().map(|stream| stream.messages.len()).sum();
    let progress = Progress::start("bench ordered: raw baseline", total as u64, "messages");
    let per_second = tokio::task::spawn_blocking({
        let streams = streams.to_vec();
        let counter = progress.counter();
        let application = application.clone();
        move || raw_baseline(&streams, synchronous, &application, Some(&counter))
    })
    .await
    .map_err(|e| BenchError::task("the raw baseline", e))??;
    progress.finish();
    Ok(per_second)
}

/// The baseline: the general route's apply with the application's handler, one
/// `BEGIN IMMEDIATE … COMMIT` per message, in the HTTP run's interleaving, on a fresh file with
/// the inbox's and the application's tables and the same synchronous setting. Returns messages
/// per second.
pub fn raw_baseline(
    streams: &[AggregateStream],
    synchronous: Synchronous,
    application: &RawApplication,
    progress: Option<&ProgressCounter>,
) -> Result<f64, BenchError> {
    let dir = tempfile::tempdir()?;
    let connection = raw_connection(&dir.path().join("raw.db"), synchronous, application)?;
    let connection = WriterConnection::new(&connection);
    let limits = Limits::default();
    let mut count = 0usize;
    let started = Instant::now();
    for message in interleaved(streams) {
        connection.execute_batch("BEGIN IMMEDIATE")?;
        // Exactly what the general route's write closure runs.
        let unit = Unit {
            connection: &connection,
            handler: application.handler.as_ref(),
            limits: &limits,
            now: &ordered_inbox::clock::now(),
        };
        let outcome = ordered_inbox::sqlite::engine::deliver_in(unit, message, Door::General)?
            .map_err(|error| BenchError::Verification(format!("raw baseline: {error}")))?;
        connection.execute_batch("COMMIT")?;
        if !matches!(outcome, Outcome::Applied { .. }) {
            return Err(BenchError::Verification(format!(
                "raw baseline: {} sequence {} was {outcome:?}",
                message.aggregate_id, message.sequence
            )));
        }
        count += 1;
        if let Some(progress) = progress {
            progress.add(1);
        }
    }
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// A connection set up as the server's writer is (WAL, `synchronous`, foreign keys, its busy
/// timeout) on a file holding the inbox's tables.
fn raw_connection(
    path: &std::path::Path,
    synchronous: Synchronous,
    application: &RawApplication,
) -> Result<Connection, BenchError> {
    let mut connection = Connection::open(path)?;
    connection.busy_timeout(ordered_inbox::sqlite::BUSY_TIMEOUT)?;
    connection.query_row("PRAGMA journal_mode=WAL", [], |_| Ok(()))?;
    connection.execute_batch(&format!(
        "PRAGMA synchronous={}; PRAGMA foreign_keys=ON;",
        synchronous.pragma_value()
    ))?;
    ordered_inbox::sqlite::schema::migrate(&mut connection)?;
    (application.migrate)(&connection)?;
    Ok(connection)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writer_batches_are_read_from_the_metrics_page() {
        let before = WriterBatches::parse(
            "# TYPE inbox_writer_batch_size histogram\n\
             inbox_writer_batch_size_bucket{le=\"1\"} 3\n\
             inbox_writer_batch_size_sum 12\n\
             inbox_writer_batch_size_count 4\n",
        )
        .unwrap();
        let after = WriterBatches {
            commits: 14.0,
            units: 212.0,
        };
        assert_eq!(after.since(&before).units_per_commit(), Some(20.0));
        assert_eq!(WriterBatches::parse("http_requests_total 3\n"), None);
        assert_eq!(before.since(&before).units_per_commit(), None);
    }

    #[test]
    fn the_raw_baseline_applies_every_message_of_the_workload() {
        let streams = workload(3, 30);
        let per_second = raw_baseline(
            &streams,
            Synchronous::Normal,
            &RawApplication::inbox_only(),
            None,
        )
        .expect("the raw baseline");
        assert!(per_second > 0.0);
    }
}
