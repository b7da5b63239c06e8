//! Benchmarks, run as `production-lab bench …`: figures are printed, never asserted by tests.
//!
//! `bench ordered` starts the real server as a child process on a temp database, drives the
//! general ordered route over keep-alive loopback HTTP, verifies the end state row by row, and
//! measures in the same run the raw baseline: the same apply transaction, one durable
//! transaction per message, straight through rusqlite.
//!
//! `bench ordered --backend postgres` starts a private PostgreSQL ([`crate::pg_cluster`], durable:
//! `fsync` on), drives the same load through one server and through two server processes on one
//! database, verifies the end state through the PostgreSQL inbox, and prints the figures next to
//! the SQLite server's, measured in the same run on the same load.
//!
//! `bench stampede` parks 1,000 concurrent callers on the cache's shared key behind the lab gate,
//! opens it, and checks that exactly one factory ran.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use serde::Serialize;
use serde_json::{Value, json};

use crate::config::Synchronous;
use crate::progress::{Progress, ProgressCounter};
use ordered_inbox::{Door, Limits, OrderedMessage, Outcome};

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("could not start the server under test: {0}")]
    Startup(String),
    #[error("verification failed: {0}")]
    Verification(String),
    #[error("HTTP: {0}")]
    Http(#[from] reqwest::Error),
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Nats(#[from] crate::broker::server::NatsServerError),
    #[error("NATS: {0}")]
    Broker(String),
}

/// The server binary as a child process on a fresh database in its own temp directory.
pub struct ServerUnderTest {
    child: Child,
    pub address: String,
    pub database: PathBuf,
    _dir: tempfile::TempDir,
    /// What the server printed after its listening line.
    output: Arc<std::sync::Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

/// A stopped server: its database file (kept until `dir` is dropped) and what it printed.
pub struct StoppedServer {
    pub database: PathBuf,
    pub dir: tempfile::TempDir,
    pub output: Vec<String>,
}

impl ServerUnderTest {
    /// Starts `serve` on port 0 with the given synchronous mode, room for `clients` connections
    /// at once (all of them may be busy, which the connection cap would answer 503), and waits
    /// for its listening line.
    pub fn start(synchronous: Synchronous, clients: usize) -> Result<ServerUnderTest, BenchError> {
        ServerUnderTest::start_with(synchronous, clients, &[])
    }

    /// Like [`ServerUnderTest::start`], with extra `serve` arguments.
    pub fn start_with(
        synchronous: Synchronous,
        clients: usize,
        extra: &[String],
    ) -> Result<ServerUnderTest, BenchError> {
        ServerUnderTest::start_binary(&std::env::current_exe()?, synchronous, clients, extra)
    }

    /// Like [`ServerUnderTest::start_with`], running `serve` of another build of this binary
    /// (e.g. the previous commit's, to compare two builds back to back under one load).
    pub fn start_binary(
        binary: &Path,
        synchronous: Synchronous,
        clients: usize,
        extra: &[String],
    ) -> Result<ServerUnderTest, BenchError> {
        // The connection cap is named only when its default is too small for the clients, so
        // that a build from before the flag existed can be benched too.
        let cap = clients + 16;
        let cap_args: Vec<String> = if cap > crate::config::DEFAULT_MAX_CONNECTIONS {
            vec!["--max-connections".to_owned(), cap.min(65_536).to_string()]
        } else {
            Vec::new()
        };
        let dir = tempfile::tempdir()?;
        let database = dir.path().join("bench.db");
        let settings = dir.path().join("runtime-settings.json");
        std::fs::write(
            &settings,
            r#"{"Live":{"Label":"bench","Maximum":3,"Secret":"bench-not-a-secret"}}"#,
        )?;
        let mut child = Command::new(binary)
            .arg("serve")
            .args([
                "--urls",
                "http://127.0.0.1:0",
                "--environment",
                "Development",
            ])
            .arg("--database")
            .arg(&database)
            .arg("--settings")
            .arg(&settings)
            .args(["--synchronous", synchronous_name(synchronous)])
            .args(&cap_args)
            .args(extra)
            .env_remove("LAB_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| BenchError::Startup("no stdout".to_owned()))?;
        let mut lines = BufReader::new(stdout).lines();
        let address = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(address) = crate::app::listening_address(&line) {
                        break address.to_owned();
                    }
                }
                _ => {
                    let _ = child.kill();
                    return Err(BenchError::Startup(
                        "the server exited before listening".to_owned(),
                    ));
                }
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe, and keep the lines.
        let output = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = output.clone();
        let reader = std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if let Ok(mut sink) = sink.lock() {
                    sink.push(line);
                }
            }
        });
        Ok(ServerUnderTest {
            child,
            address,
            database,
            _dir: dir,
            output,
            reader: Some(reader),
        })
    }

    /// CPU time (user + system, clock ticks) the server used so far, where /proc tells it.
    pub fn cpu_ticks(&self) -> Option<u64> {
        crate::pg_cluster::process_cpu_ticks(self.child.id())
    }

    /// The server's peak resident set (VmHWM) in KiB, where /proc tells it.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// The server process's CPU time so far and the bytes it caused to be written to storage.
    pub fn usage(&self) -> Option<ProcessUsage> {
        ProcessUsage::read(self.child.id())
    }

    /// SIGTERM and wait (graceful shutdown closes the database cleanly).
    pub fn stop(mut self) -> Result<StoppedServer, BenchError> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.wait();
        // The process is gone, so its stdout is at its end: the reader finishes.
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let output = self
            .output
            .lock()
            .map(|lines| lines.clone())
            .unwrap_or_default();
        let database = self.database.clone();
        // Move the temp dir out so the file outlives the process handle.
        let dir = std::mem::replace(&mut self._dir, tempfile::tempdir()?);
        Ok(StoppedServer {
            database,
            dir,
            output,
        })
    }
}

impl Drop for ServerUnderTest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn synchronous_name(synchronous: Synchronous) -> &'static str {
    match synchronous {
        Synchronous::Normal => "normal",
        Synchronous::Full => "full",
    }
}

/// A process's CPU time (user and system) and storage writes, from `/proc/PID/stat` and
/// `/proc/PID/io`. Linux reports CPU time in `USER_HZ` ticks, which is 100 per second on every
/// architecture the kernel exposes to user space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    pub user_ticks: u64,
    pub system_ticks: u64,
    pub write_bytes: Option<u64>,
}

const USER_HZ: f64 = 100.0;

impl ProcessUsage {
    pub fn read(pid: u32) -> Option<ProcessUsage> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name may hold spaces and parentheses: fields are counted after its ')'.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok();
        let write_bytes = io.as_deref().and_then(|io| {
            io.lines()
                .find_map(|line| line.strip_prefix("write_bytes:"))
                .and_then(|value| value.trim().parse().ok())
        });
        Some(ProcessUsage {
            // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
            user_ticks: fields.get(11)?.parse().ok()?,
            system_ticks: fields.get(12)?.parse().ok()?,
            write_bytes,
        })
    }

    /// What was spent between `earlier` and `self`, per message, in µs of CPU and bytes.
    fn per_message(&self, earlier: &ProcessUsage, messages: usize) -> CostPerMessage {
        let per = |ticks: u64| ticks as f64 / USER_HZ * 1e6 / messages.max(1) as f64;
        CostPerMessage {
            user_us: per(self.user_ticks.saturating_sub(earlier.user_ticks)),
            system_us: per(self.system_ticks.saturating_sub(earlier.system_ticks)),
            storage_bytes: self
                .write_bytes
                .zip(earlier.write_bytes)
                .map(|(now, then)| now.saturating_sub(then) as f64 / messages.max(1) as f64),
        }
    }
}

/// The server's cost of one applied message during the HTTP load.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CostPerMessage {
    pub user_us: f64,
    pub system_us: f64,
    /// Bytes written to storage (WAL, checkpoints), from `/proc/PID/io`; unknown where the
    /// kernel does not account it.
    pub storage_bytes: Option<f64>,
}

/// The messages of one aggregate, in sequence order.
#[derive(Debug, Clone)]
pub struct AggregateStream {
    pub aggregate_id: String,
    pub messages: Vec<OrderedMessage>,
}

/// `messages` valid messages spread evenly over `aggregates` aggregates.
pub fn workload(aggregates: usize, messages: usize) -> Vec<AggregateStream> {
    (0..aggregates)
        .map(|index| {
            let aggregate_id = format!("bench-{index}");
            let count = messages / aggregates + usize::from(index < messages % aggregates);
            let messages = (1..=count as i64)
                .map(|sequence| OrderedMessage {
                    message_id: format!("{aggregate_id}-{sequence}"),
                    aggregate_id: aggregate_id.clone(),
                    sequence,
                    amount: sequence % 7 + 1,
                })
                .collect();
            AggregateStream {
                aggregate_id,
                messages,
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct OrderedOptions {
    pub aggregates: usize,
    pub messages: usize,
    pub concurrency: usize,
    pub synchronous: Synchronous,
    /// The server binary to bench; `None` for this one.
    pub server: Option<PathBuf>,
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
    if options.aggregates == 0 || options.concurrency == 0 || options.messages == 0 {
        return Err(BenchError::Verification(
            "aggregates, messages and concurrency must be positive".to_owned(),
        ));
    }
    let streams = workload(options.aggregates, options.messages);
    let server = match &options.server {
        Some(binary) => {
            ServerUnderTest::start_binary(binary, options.synchronous, options.concurrency, &[])?
        }
        None => ServerUnderTest::start(options.synchronous, options.concurrency)?,
    };
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(options.concurrency)
        .timeout(Duration::from_secs(30))
        .build()?;

    // Client i owns aggregates i, i+c, i+2c … and interleaves them, each in sequence order.
    let mut owned: Vec<Vec<AggregateStream>> = vec![Vec::new(); options.concurrency];
    for (index, stream) in streams.iter().enumerate() {
        owned[index % options.concurrency].push(stream.clone());
    }
    let address = Arc::new(server.address.clone());
    let commits_before = writer_batches(&client, &address).await;
    let client_before = ProcessUsage::read(std::process::id());
    let usage_before = server.usage();
    let progress = Progress::start("bench ordered: HTTP", options.messages as u64, "messages");
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for streams in owned.into_iter().filter(|s| !s.is_empty()) {
        let client = client.clone();
        let address = address.clone();
        let counter = progress.counter();
        clients.spawn(async move { drive_client(&client, &address, streams, &counter).await });
    }
    let mut latencies = Vec::with_capacity(options.messages);
    while let Some(joined) = clients.join_next().await {
        let client_latencies = joined
            .map_err(|e| BenchError::Verification(format!("a client task failed: {e}")))??;
        latencies.extend(client_latencies);
    }
    let elapsed = started.elapsed();
    progress.finish();
    let peak_rss_kib = server.peak_rss_kib();
    let server_cost = server
        .usage()
        .zip(usage_before)
        .map(|(after, before)| after.per_message(&before, options.messages));
    let client_cost = ProcessUsage::read(std::process::id())
        .zip(client_before)
        .map(|(after, before)| after.per_message(&before, options.messages));
    let units_per_commit = writer_batches(&client, &address)
        .await
        .zip(commits_before)
        .and_then(|(after, before)| after.since(&before).units_per_commit());
    let stopped = server.stop()?;
    verify_end_state(&stopped.database, &streams)?;
    let database_bytes = database_size(&stopped.database)?;

    let progress = Progress::start(
        "bench ordered: raw baseline",
        options.messages as u64,
        "messages",
    );
    let raw_per_second = tokio::task::spawn_blocking({
        let streams = streams.clone();
        let synchronous = options.synchronous;
        let counter = progress.counter();
        move || raw_baseline(&streams, synchronous, Some(&counter))
    })
    .await
    .map_err(|e| BenchError::Verification(format!("the raw baseline panicked: {e}")))??;
    progress.finish();

    latencies.sort_unstable();
    let http_per_second = options.messages as f64 / elapsed.as_secs_f64();
    Ok(OrderedReport {
        aggregates: options.aggregates,
        messages: options.messages,
        concurrency: options.concurrency,
        synchronous: synchronous_name(options.synchronous),
        http_messages_per_second: http_per_second,
        raw_messages_per_second: raw_per_second,
        ratio: http_per_second / raw_per_second,
        p50_ms: percentile(&latencies, 0.50),
        p95_ms: percentile(&latencies, 0.95),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        server_peak_rss_mib: peak_rss_kib.map(|kib| kib as f64 / 1024.0),
        server_cost,
        database_bytes_per_message: Some(database_bytes as f64 / options.messages as f64),
        units_per_commit,
        client_cpu_us_per_message: client_cost.map(|cost| cost.user_us + cost.system_us),
    })
}

/// The writer's group commits so far and the deliveries they carried, as the server's
/// `inbox_writer_batch_size` histogram counts them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct WriterBatches {
    commits: f64,
    units: f64,
}

impl WriterBatches {
    /// Reads the histogram's `_count` and `_sum` from a Prometheus text page.
    fn parse(page: &str) -> Option<WriterBatches> {
        let value = |name: &str| {
            page.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|value| value.trim().parse().ok())
        };
        Some(WriterBatches {
            commits: value("inbox_writer_batch_size_count")?,
            units: value("inbox_writer_batch_size_sum")?,
        })
    }

    fn since(&self, earlier: &WriterBatches) -> WriterBatches {
        WriterBatches {
            commits: self.commits - earlier.commits,
            units: self.units - earlier.units,
        }
    }

    fn units_per_commit(&self) -> Option<f64> {
        (self.commits > 0.0).then(|| self.units / self.commits)
    }
}

/// The server's writer batches, or `None` when its `/metrics` page does not have them.
async fn writer_batches(client: &reqwest::Client, address: &str) -> Option<WriterBatches> {
    let response = client.get(format!("{address}/metrics")).send().await.ok()?;
    WriterBatches::parse(&response.text().await.ok()?)
}

/// The database's size in bytes: page count × page size.
fn database_size(database: &Path) -> Result<i64, BenchError> {
    let connection = Connection::open(database)?;
    Ok(connection.query_row(
        "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        [],
        |row| row.get(0),
    )?)
}

/// Sends one client's aggregates' messages, interleaved, each aggregate in order. Anything but
/// `200 applied` is a failure: this load has no gaps, stale or poison messages.
async fn drive_client(
    client: &reqwest::Client,
    address: &str,
    streams: Vec<AggregateStream>,
    progress: &ProgressCounter,
) -> Result<Vec<Duration>, BenchError> {
    let longest = streams.iter().map(|s| s.messages.len()).max().unwrap_or(0);
    let mut latencies = Vec::new();
    for position in 0..longest {
        for stream in &streams {
            let Some(message) = stream.messages.get(position) else {
                continue;
            };
            let url = format!("{address}/aggregates/{}/messages", message.aggregate_id);
            let body = json!({
                "messageId": message.message_id,
                "sequence": message.sequence,
                "amount": message.amount,
            });
            let sent = Instant::now();
            let response = client.post(&url).json(&body).send().await?;
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
    }
    Ok(latencies)
}

/// Every aggregate's last sequence, total and applied rows are exactly what was sent.
pub fn verify_end_state(database: &Path, streams: &[AggregateStream]) -> Result<(), BenchError> {
    let connection = Connection::open(database)?;
    let mut state = connection
        .prepare("SELECT last_sequence, total FROM aggregate_state WHERE aggregate_id = ?1")?;
    let mut applied = connection.prepare(
        "SELECT COUNT(*), COALESCE(SUM(json_extract(payload, '$.Amount')), 0) FROM ordered_inbox
         WHERE json_extract(payload, '$.AggregateId') = ?1",
    )?;
    for stream in streams {
        let expected_last = stream.messages.len() as i64;
        let expected_total: i64 = stream.messages.iter().map(|m| m.amount).sum();
        let (last, total): (i64, i64) = state
            .query_row([&stream.aggregate_id], |row| Ok((row.get(0)?, row.get(1)?)))
            .map_err(|e| {
                BenchError::Verification(format!("{}: no state row ({e})", stream.aggregate_id))
            })?;
        let (rows, sum): (i64, i64) =
            applied.query_row([&stream.aggregate_id], |row| Ok((row.get(0)?, row.get(1)?)))?;
        if (last, total, rows, sum)
            != (expected_last, expected_total, expected_last, expected_total)
        {
            return Err(BenchError::Verification(format!(
                "{}: last {last}, total {total}, {rows} applied rows summing {sum}; expected last and rows {expected_last}, total {expected_total}",
                stream.aggregate_id
            )));
        }
    }
    Ok(())
}

/// The baseline: the general route's apply, one `BEGIN IMMEDIATE … COMMIT` per message, in the HTTP run's
/// interleaving, on a fresh file with the same synchronous setting. Returns messages per second.
pub fn raw_baseline(
    streams: &[AggregateStream],
    synchronous: Synchronous,
    progress: Option<&ProgressCounter>,
) -> Result<f64, BenchError> {
    let dir = tempfile::tempdir()?;
    let mut connection = Connection::open(dir.path().join("raw.db"))?;
    connection.busy_timeout(crate::store::BUSY_TIMEOUT)?;
    connection.query_row("PRAGMA journal_mode=WAL", [], |_| Ok(()))?;
    connection.execute_batch(&format!(
        "PRAGMA synchronous={}; PRAGMA foreign_keys=ON;",
        synchronous.pragma_value()
    ))?;
    crate::store::schema::migrate(&mut connection)?;
    let longest = streams.iter().map(|s| s.messages.len()).max().unwrap_or(0);
    let mut count = 0usize;
    let started = Instant::now();
    for position in 0..longest {
        for message in streams.iter().filter_map(|s| s.messages.get(position)) {
            connection.execute_batch("BEGIN IMMEDIATE")?;
            // Exactly what the general route's write closure runs.
            let outcome = ordered_inbox::sqlite::engine::deliver_in(
                &connection,
                message,
                Door::General,
                &Limits::default(),
                &ordered_inbox::clock::now(),
            )?;
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
    }
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// Which store `bench ordered` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The SQLite server (group commit) against one transaction per message.
    Sqlite,
    /// PostgreSQL through one and through two server processes, next to the SQLite server.
    Postgres,
}

/// The figures of one HTTP load.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadFigures {
    /// Where the ordered inbox was: `sqlite` or `postgres`.
    pub store: &'static str,
    pub servers: usize,
    pub messages_per_second: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Each server's peak resident set.
    pub server_peak_rss_mib: Vec<f64>,
    /// PostgreSQL only: database round trips per inbox operation, as the servers counted them.
    pub round_trips_per_message: Option<f64>,
    /// PostgreSQL only: attempts retried after a serialization failure, deadlock or unique
    /// violation.
    pub retries: Option<u64>,
    /// CPU time the server processes spent per message, in microseconds (user + system).
    pub server_cpu_us_per_message: Option<f64>,
    /// PostgreSQL only: CPU time the database's processes spent per message, in microseconds.
    pub postgres_cpu_us_per_message: Option<f64>,
}

impl std::fmt::Display for LoadFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rss: Vec<String> = self
            .server_peak_rss_mib
            .iter()
            .map(|mib| format!("{mib:.1}"))
            .collect();
        write!(
            f,
            "  {:<8} {} server{}: {:>8.0} msg/s   p50 {:.2}  p95 {:.2}  p99 {:.2}  max {:.2} ms   peak RSS {} MiB",
            self.store,
            self.servers,
            if self.servers == 1 { " " } else { "s" },
            self.messages_per_second,
            self.p50_ms,
            self.p95_ms,
            self.p99_ms,
            self.max_ms,
            rss.join(" + "),
        )?;
        if let (Some(trips), Some(retries)) = (self.round_trips_per_message, self.retries) {
            write!(f, "   {trips:.2} round trips/msg, {retries} retries")?;
        }
        if let Some(server) = self.server_cpu_us_per_message {
            write!(f, "\n           CPU per message: server {server:.0} µs")?;
            if let Some(postgres) = self.postgres_cpu_us_per_message {
                write!(f, ", PostgreSQL {postgres:.0} µs")?;
            }
        }
        Ok(())
    }
}

/// `bench ordered --backend postgres`: the same load on SQLite, on PostgreSQL through one
/// server, and on PostgreSQL through two server processes.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PostgresReport {
    pub aggregates: usize,
    pub messages: usize,
    pub concurrency: usize,
    /// The SQLite server's `synchronous`; PostgreSQL runs with `fsync` on.
    pub synchronous: &'static str,
    pub postgres_bindir: String,
    pub runs: Vec<LoadFigures>,
}

impl std::fmt::Display for PostgresReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench ordered --backend postgres: {} messages over {} aggregates, {} concurrent clients (SQLite synchronous={}, PostgreSQL fsync=on, {})",
            self.messages,
            self.aggregates,
            self.concurrency,
            self.synchronous,
            self.postgres_bindir
        )?;
        let lines: Vec<String> = self.runs.iter().map(ToString::to_string).collect();
        write!(f, "{}", lines.join("\n"))
    }
}

/// Runs one load through `addresses` (client `i` sends to server `i % addresses.len()`).
async fn http_load(
    addresses: &[String],
    streams: &[AggregateStream],
    concurrency: usize,
) -> Result<(Duration, Vec<Duration>), BenchError> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(concurrency)
        .timeout(Duration::from_secs(60))
        .build()?;
    let mut owned: Vec<Vec<AggregateStream>> = vec![Vec::new(); concurrency];
    for (index, stream) in streams.iter().enumerate() {
        owned[index % concurrency].push(stream.clone());
    }
    let total: usize = streams.iter().map(|stream| stream.messages.len()).sum();
    let progress = Progress::start(
        &format!("bench ordered: HTTP to {} server(s)", addresses.len()),
        total as u64,
        "messages",
    );
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for (index, streams) in owned.into_iter().enumerate().filter(|(_, s)| !s.is_empty()) {
        let client = client.clone();
        let address = addresses[index % addresses.len()].clone();
        let counter = progress.counter();
        clients.spawn(async move { drive_client(&client, &address, streams, &counter).await });
    }
    let mut latencies = Vec::new();
    while let Some(joined) = clients.join_next().await {
        latencies.extend(
            joined
                .map_err(|e| BenchError::Verification(format!("a client task failed: {e}")))??,
        );
    }
    let elapsed = started.elapsed();
    progress.finish();
    latencies.sort_unstable();
    Ok((elapsed, latencies))
}

fn figures(
    store: &'static str,
    messages: usize,
    elapsed: Duration,
    latencies: &[Duration],
    rss_kib: Vec<Option<u64>>,
) -> LoadFigures {
    LoadFigures {
        store,
        servers: rss_kib.len(),
        messages_per_second: messages as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(latencies, 0.50),
        p95_ms: percentile(latencies, 0.95),
        p99_ms: percentile(latencies, 0.99),
        max_ms: latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        server_peak_rss_mib: rss_kib
            .into_iter()
            .map(|kib| kib.unwrap_or(0) as f64 / 1024.0)
            .collect(),
        round_trips_per_message: None,
        retries: None,
        server_cpu_us_per_message: None,
        postgres_cpu_us_per_message: None,
    }
}

/// Microseconds of CPU per message from clock ticks spent during a load.
fn cpu_us_per_message(ticks: Option<u64>, messages: usize) -> Option<f64> {
    let seconds = ticks? as f64 / crate::pg_cluster::ticks_per_second();
    Some(seconds * 1e6 / messages as f64)
}

/// The sum of several processes' CPU ticks, or `None` when any is unknown.
fn sum_ticks(ticks: impl IntoIterator<Item = Option<u64>>) -> Option<u64> {
    ticks.into_iter().sum()
}

/// Runs the load on SQLite, then on PostgreSQL through one and through two servers, verifying
/// each end state.
pub async fn ordered_postgres(options: &OrderedOptions) -> Result<PostgresReport, BenchError> {
    if options.aggregates == 0 || options.concurrency == 0 || options.messages == 0 {
        return Err(BenchError::Verification(
            "aggregates, messages and concurrency must be positive".to_owned(),
        ));
    }
    let streams = workload(options.aggregates, options.messages);
    let mut runs = Vec::new();

    let server = ServerUnderTest::start(options.synchronous, options.concurrency)?;
    let cpu_before = server.cpu_ticks();
    let (elapsed, latencies) = http_load(
        std::slice::from_ref(&server.address),
        &streams,
        options.concurrency,
    )
    .await?;
    let server_ticks = server
        .cpu_ticks()
        .zip(cpu_before)
        .map(|(after, before)| after.saturating_sub(before));
    let rss = vec![server.peak_rss_kib()];
    let stopped = server.stop()?;
    verify_end_state(&stopped.database, &streams)?;
    let mut sqlite = figures("sqlite", options.messages, elapsed, &latencies, rss);
    sqlite.server_cpu_us_per_message = cpu_us_per_message(server_ticks, options.messages);
    runs.push(sqlite);

    let cluster =
        crate::pg_cluster::PrivateCluster::start(crate::pg_cluster::ClusterOptions::durable())
            .map_err(|error| BenchError::Startup(format!("private PostgreSQL: {error}")))?;
    for (run, servers) in [(1usize, 1usize), (2, 2)] {
        let url = cluster
            .create_database(&format!("bench_{run}"))
            .map_err(|error| BenchError::Startup(format!("create database: {error}")))?;
        let extra = ["--inbox".to_owned(), url.clone()];
        let started: Vec<ServerUnderTest> = (0..servers)
            .map(|_| ServerUnderTest::start_with(options.synchronous, options.concurrency, &extra))
            .collect::<Result<_, _>>()?;
        let addresses: Vec<String> = started.iter().map(|s| s.address.clone()).collect();
        let servers_before = sum_ticks(started.iter().map(ServerUnderTest::cpu_ticks));
        let postgres_before = cluster.cpu_ticks();
        let (elapsed, latencies) = http_load(&addresses, &streams, options.concurrency).await?;
        // Read before the servers stop: their connections' backends are still alive.
        let postgres_ticks = cluster
            .cpu_ticks()
            .zip(postgres_before)
            .map(|(after, before)| after.saturating_sub(before));
        let server_ticks = sum_ticks(started.iter().map(ServerUnderTest::cpu_ticks))
            .zip(servers_before)
            .map(|(after, before)| after.saturating_sub(before));
        let rss = started.iter().map(ServerUnderTest::peak_rss_kib).collect();
        let mut run_figures = figures("postgres", options.messages, elapsed, &latencies, rss);
        run_figures.server_cpu_us_per_message = cpu_us_per_message(server_ticks, options.messages);
        run_figures.postgres_cpu_us_per_message =
            cpu_us_per_message(postgres_ticks, options.messages);
        let (mut operations, mut round_trips, mut retries) = (0, 0, 0);
        for server in started {
            let stopped = server.stop()?;
            if let Some((ops, trips, again)) = stopped
                .output
                .iter()
                .find_map(|line| crate::app::parse_postgres_figures(line))
            {
                operations += ops;
                round_trips += trips;
                retries += again;
            }
        }
        if operations > 0 {
            run_figures.round_trips_per_message = Some(round_trips as f64 / operations as f64);
            run_figures.retries = Some(retries);
        }
        verify_postgres_end_state(&url, &streams).await?;
        runs.push(run_figures);
    }
    drop(cluster);
    Ok(PostgresReport {
        aggregates: options.aggregates,
        messages: options.messages,
        concurrency: options.concurrency,
        synchronous: synchronous_name(options.synchronous),
        postgres_bindir: crate::pg_cluster::find_bindir()
            .map(|dir| dir.display().to_string())
            .unwrap_or_default(),
        runs,
    })
}

/// Every aggregate's last, total and applied rows in PostgreSQL are exactly what was sent.
async fn verify_postgres_end_state(
    url: &str,
    streams: &[AggregateStream],
) -> Result<(), BenchError> {
    let inbox = ordered_inbox::postgres::PostgresInbox::connect(url, Limits::default())
        .await
        .map_err(|error| BenchError::Verification(error.to_string()))?;
    let failed = |error: ordered_inbox::InboxError| BenchError::Verification(error.to_string());
    for stream in streams {
        let expected_last = stream.messages.len() as i64;
        let expected_total: i64 = stream.messages.iter().map(|m| m.amount).sum();
        let view = ordered_inbox::Inbox::aggregate(&inbox, stream.aggregate_id.clone())
            .await
            .map_err(failed)?
            .ok_or_else(|| {
                BenchError::Verification(format!("{}: no state row", stream.aggregate_id))
            })?;
        let (rows, sum) = inbox
            .applied_totals(stream.aggregate_id.clone())
            .await
            .map_err(failed)?;
        let (last, total) = (view.summary.last, view.summary.total);
        if (last, total, rows, sum)
            != (expected_last, expected_total, expected_last, expected_total)
        {
            return Err(BenchError::Verification(format!(
                "{}: last {last}, total {total}, {rows} applied rows summing {sum}; expected last and rows {expected_last}, total {expected_total}",
                stream.aggregate_id
            )));
        }
    }
    inbox.close();
    Ok(())
}

pub(crate) fn percentile(sorted: &[Duration], quantile: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64 * quantile).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StampedeReport {
    pub callers: usize,
    pub factories: i64,
    pub generations: Vec<i64>,
    pub open_to_last_answer_ms: f64,
    pub server_peak_rss_mib: Option<f64>,
}

impl std::fmt::Display for StampedeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench stampede: {} concurrent GET /cache/shared behind a closed gate",
            self.callers
        )?;
        writeln!(
            f,
            "  factory runs: {} (generations seen: {:?})",
            self.factories, self.generations
        )?;
        writeln!(
            f,
            "  gate opened → last answer: {:.2} ms",
            self.open_to_last_answer_ms
        )?;
        match self.server_peak_rss_mib {
            Some(mib) => write!(f, "  server peak RSS: {mib:.1} MiB"),
            None => write!(f, "  server peak RSS: unknown (no /proc)"),
        }
    }
}

/// Parks `callers` concurrent requests on the shared key behind the closed gate, opens it, and
/// checks that exactly one factory ran and every caller got its generation.
pub async fn stampede(callers: usize) -> Result<StampedeReport, BenchError> {
    let server = ServerUnderTest::start(Synchronous::Full, callers)?;
    let address = server.address.clone();
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(callers)
        .timeout(Duration::from_secs(60))
        .build()?;
    expect_status(&client, &format!("{address}/lab/cache/gate/close"), 204).await?;
    let progress = Progress::start("bench stampede: answered", callers as u64, "callers");
    let mut waiting = tokio::task::JoinSet::new();
    for _ in 0..callers {
        let client = client.clone();
        let url = format!("{address}/cache/shared");
        let counter = progress.counter();
        waiting.spawn(async move {
            let response = client.get(url).send().await?;
            let status = response.status();
            let body: Value = response.json().await?;
            counter.add(1);
            Ok::<_, reqwest::Error>((status, body, Instant::now()))
        });
    }
    // Wait until every caller is parked: the factory started once and the requests are in.
    let stats_url = format!("{address}/cache/stats");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats: Value = client.get(&stats_url).send().await?.json().await?;
        if stats["factories"].as_i64().unwrap_or(0) >= 1 {
            break;
        }
        if Instant::now() > deadline {
            return Err(BenchError::Verification(
                "the factory never started".to_owned(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Give the remaining callers time to connect and join the waiting factory.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let opened = Instant::now();
    expect_status(&client, &format!("{address}/lab/cache/gate/open"), 204).await?;
    let mut generations = Vec::new();
    let mut last_answer = opened;
    while let Some(joined) = waiting.join_next().await {
        let (status, body, at) = joined
            .map_err(|e| BenchError::Verification(format!("a caller task failed: {e}")))??;
        if status != reqwest::StatusCode::OK {
            return Err(BenchError::Verification(format!(
                "a caller got {status} {body}"
            )));
        }
        let generation = body["generation"].as_i64().unwrap_or(-1);
        if !generations.contains(&generation) {
            generations.push(generation);
        }
        last_answer = last_answer.max(at);
    }
    progress.finish();
    let stats: Value = client.get(&stats_url).send().await?.json().await?;
    let factories = stats["factories"].as_i64().unwrap_or(-1);
    let peak = server.peak_rss_kib();
    drop(server);
    if factories != 1 || generations != [1] {
        return Err(BenchError::Verification(format!(
            "expected one factory run and generation [1]; got {factories} runs, generations {generations:?}"
        )));
    }
    Ok(StampedeReport {
        callers,
        factories,
        generations,
        open_to_last_answer_ms: last_answer.duration_since(opened).as_secs_f64() * 1e3,
        server_peak_rss_mib: peak.map(|kib| kib as f64 / 1024.0),
    })
}

async fn expect_status(
    client: &reqwest::Client,
    url: &str,
    expected: u16,
) -> Result<(), BenchError> {
    let status = client.post(url).send().await?.status();
    if status.as_u16() == expected {
        Ok(())
    } else {
        Err(BenchError::Verification(format!(
            "POST {url} answered {status}, expected {expected}"
        )))
    }
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
    fn percentiles_use_the_nearest_rank() {
        let sorted: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&sorted, 0.50), 50.0);
        assert_eq!(percentile(&sorted, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
    }

    #[test]
    fn this_process_usage_is_readable_and_grows_with_work() {
        let before = ProcessUsage::read(std::process::id()).expect("/proc/self/stat");
        let started = Instant::now();
        let mut spin = 0u64;
        while started.elapsed() < Duration::from_millis(60) {
            spin = spin.wrapping_add(std::hint::black_box(1));
        }
        let after = ProcessUsage::read(std::process::id()).expect("/proc/self/stat");
        assert!(spin > 0);
        assert!(after.user_ticks + after.system_ticks > before.user_ticks + before.system_ticks);
    }

    #[test]
    fn costs_are_divided_per_message_in_microseconds() {
        let before = ProcessUsage {
            user_ticks: 100,
            system_ticks: 50,
            write_bytes: Some(1000),
        };
        let after = ProcessUsage {
            user_ticks: 102,
            system_ticks: 53,
            write_bytes: Some(5000),
        };
        let cost = after.per_message(&before, 1000);
        assert_eq!((cost.user_us, cost.system_us), (20.0, 30.0));
        assert_eq!(cost.storage_bytes, Some(4.0));
    }
}
