//! `bench gate`: a private nats-server and the gate as a child process (`gate --config FILE`,
//! SQLite, loopback), N messages over M aggregates published to its input stream (every PubAck
//! awaited), and a downstream consumer of its output stream; in the same run, `bench broker`'s
//! figures for the lab's broker door on the same nats-server build.
//!
//! - input → output: from the first publish until the last message is read from the output
//!   stream, and each message's latency (read from the output, minus the instant it was handed
//!   to the client for publishing);
//! - the output is verified message by message: every aggregate's sequences exactly 1..n in
//!   order, no `Nats-Msg-Id` twice.
//!
//! With `--backend postgres` the store is a private PostgreSQL (durable commits, loopback) and
//! `--gates 2` runs two gates on it: both apply from the one durable consumer, one publishes.
//! `--steady-at-half` then runs the workload once more on a fresh store and streams, offered
//! at a steady rate of half the burst's input → output rate, for the latency of a gate that
//! keeps up.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use ordered_inbox::OrderedMessage;
use serde::Serialize;
use serde_json::{Value, json};

use super::broker::{BrokerBenchOptions, BrokerReport};
use super::{BenchError, interleaved, max_ms, mib, percentile, require_positive, workload};
use crate::nats::{MESSAGE_ID_HEADER, NatsServer, subject_for};
use crate::pg::{ClusterOptions, PrivateCluster};
use crate::process::{CpuMeter, CpuSplit};
use crate::progress::Progress;
use crate::server::ServerUnderTest;

const INPUT_STREAM: &str = "GATE_IN";
const INPUT_PREFIX: &str = "gate.in";
const OUTPUT_STREAM: &str = "GATE_OUT";
const OUTPUT_PREFIX: &str = "gate.out";
pub(super) const MESSAGE_TYPE: &str = "bench.event";

/// The schema of the bench's one message type.
pub(super) const SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["amount"],
  "properties": { "amount": { "type": "integer", "minimum": 0 } }
}"#;

#[derive(Debug, Clone)]
pub struct GateBenchOptions {
    pub aggregates: usize,
    pub messages: usize,
    /// The gate's input batch (its consumer's fetch size).
    pub batch: usize,
    /// `bench broker` beside it in the same run, with these options.
    pub broker: Option<BrokerBenchOptions>,
    /// The store: a private PostgreSQL rather than SQLite.
    pub postgres: bool,
    /// Gates on the one store (more than one needs PostgreSQL).
    pub gates: usize,
    /// A second run offered at half the first's input → output rate.
    pub steady_at_half: bool,
}

/// A run offered at a steady rate.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SteadyReport {
    pub offered_per_second: f64,
    pub input_to_output_per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GateReport {
    pub aggregates: usize,
    pub messages: usize,
    pub batch: usize,
    pub backend: &'static str,
    pub gates: usize,
    pub published_per_second: f64,
    pub input_to_output_per_second: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub gate_peak_rss_mib: Option<f64>,
    /// Where the burst's CPU went, per message (on PostgreSQL its own CPU is not counted).
    pub cpu_per_message: CpuSplit,
    /// The first gate's SQLite writer during the burst (`None` on PostgreSQL).
    pub writer: Option<WriterFigures>,
    /// The second run at half the rate, if asked for.
    pub steady: Option<SteadyReport>,
    /// `bench broker` in the same run.
    pub broker: Option<BrokerReport>,
}

impl std::fmt::Display for GateReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench gate: {} messages over {} aggregates, input batch {}, {}, {} gate(s)",
            self.messages, self.aggregates, self.batch, self.backend, self.gates
        )?;
        writeln!(
            f,
            "  published (PubAcks awaited):    {:>10.0} messages/s",
            self.published_per_second
        )?;
        writeln!(
            f,
            "  input -> in-order output:       {:>10.0} messages/s",
            self.input_to_output_per_second
        )?;
        writeln!(
            f,
            "  input -> output ms: p50 {:.1}  p95 {:.1}  p99 {:.1}  max {:.1}",
            self.p50_ms, self.p95_ms, self.p99_ms, self.max_ms
        )?;
        writeln!(f, "  CPU per message: {}", self.cpu_per_message)?;
        if let Some(writer) = &self.writer {
            writeln!(f, "  store writer: {writer}")?;
        }
        match self.gate_peak_rss_mib {
            Some(mib) => writeln!(f, "  gate peak RSS: {mib:.1} MiB")?,
            None => writeln!(f, "  gate peak RSS: unknown (no /proc)")?,
        }
        if let Some(steady) = &self.steady {
            writeln!(
                f,
                "  offered steadily at {:.0}/s: output {:.0}/s, ms p50 {:.1}  p99 {:.1}  max {:.1}",
                steady.offered_per_second,
                steady.input_to_output_per_second,
                steady.p50_ms,
                steady.p99_ms,
                steady.max_ms
            )?;
        }
        match &self.broker {
            Some(broker) => write!(f, "\n{broker}"),
            None => Ok(()),
        }
    }
}

pub async fn run(options: &GateBenchOptions) -> Result<GateReport, BenchError> {
    require_positive(
        &[options.aggregates, options.messages, options.batch],
        "aggregates, messages and batch",
    )?;
    if options.gates == 0 || (options.gates > 1 && !options.postgres) {
        return Err(BenchError::Startup(
            "--gates: 1, or 2 with --backend postgres (gates share a PostgreSQL store)".to_owned(),
        ));
    }
    let streams = workload(options.aggregates, options.messages);
    let messages = interleaved(&streams);
    let Measured {
        run,
        gate_peak_rss_mib,
        cpu_per_message,
        writer,
    } = once(options, &messages, None).await?;
    let steady = if options.steady_at_half {
        let offered = options.messages as f64 / run.output.as_secs_f64() / 2.0;
        let steady = once(options, &messages, Some(offered)).await?.run;
        Some(SteadyReport {
            offered_per_second: offered,
            input_to_output_per_second: options.messages as f64 / steady.output.as_secs_f64(),
            p50_ms: percentile(&steady.latencies, 0.50),
            p99_ms: percentile(&steady.latencies, 0.99),
            max_ms: max_ms(&steady.latencies),
        })
    } else {
        None
    };
    let broker = match &options.broker {
        Some(broker) => Some(super::broker::run(broker).await?),
        None => None,
    };
    let latencies = &run.latencies;
    Ok(GateReport {
        aggregates: options.aggregates,
        messages: options.messages,
        batch: options.batch,
        backend: if options.postgres {
            "PostgreSQL (fsync on)"
        } else {
            "SQLite, synchronous=full"
        },
        gates: options.gates,
        published_per_second: options.messages as f64 / run.published.as_secs_f64(),
        input_to_output_per_second: options.messages as f64 / run.output.as_secs_f64(),
        p50_ms: percentile(latencies, 0.50),
        p95_ms: percentile(latencies, 0.95),
        p99_ms: percentile(latencies, 0.99),
        max_ms: max_ms(latencies),
        gate_peak_rss_mib,
        cpu_per_message,
        writer,
        steady,
        broker,
    })
}

/// What one run measured beside its timings.
struct Measured {
    run: GateRun,
    gate_peak_rss_mib: Option<f64>,
    cpu_per_message: CpuSplit,
    writer: Option<WriterFigures>,
}

/// One run on a fresh nats-server, store and gates: `messages` published (at `rate` per
/// second, or as fast as the PubAcks come), the output read and verified. Answers the run, the
/// first gate's peak RSS and writer, and where the CPU went.
async fn once(
    options: &GateBenchOptions,
    messages: &[&OrderedMessage],
    rate: Option<f64>,
) -> Result<Measured, BenchError> {
    let nats = NatsServer::start(None)?;
    let context = jetstream::new(nats.connect().await?);
    let cluster = if options.postgres {
        Some(
            PrivateCluster::start(ClusterOptions::durable())
                .map_err(|error| BenchError::Startup(format!("a private PostgreSQL: {error}")))?,
        )
    } else {
        None
    };
    let url = match &cluster {
        Some(cluster) => Some(
            cluster
                .create_database("gate")
                .map_err(|error| BenchError::Startup(format!("a database: {error}")))?,
        ),
        None => None,
    };
    let mut gates = Vec::with_capacity(options.gates);
    for _ in 0..options.gates {
        gates.push(start_gate(&nats, options.batch, url.as_deref())?);
    }
    let writer_of_first = || async {
        match gates.first() {
            Some(gate) if !options.postgres => WriterFigures::scrape(&gate.address).await,
            _ => Ok(None),
        }
    };
    let writer_before = writer_of_first().await?;
    let meter = CpuMeter::start(nats.pid(), gates.iter().map(ServerUnderTest::pid).collect());
    let run = through_the_gate(&context, messages, rate).await;
    let cpu = meter.per_message(messages.len());
    let writer = writer_of_first()
        .await?
        .zip(writer_before)
        .map(|(after, before)| after.since(&before));
    let gate_peak_rss_mib = gates.first().and_then(|gate| mib(gate.peak_rss_kib()));
    for gate in gates {
        gate.stop()?;
    }
    drop(cluster);
    Ok(Measured {
        run: run?,
        gate_peak_rss_mib,
        cpu_per_message: cpu,
        writer,
    })
}

/// The gate of this binary on a fresh directory: its config, its schema, its SQLite file, or
/// the PostgreSQL database at `postgres` (loopback, plain TCP).
fn start_gate(
    nats: &NatsServer,
    batch: usize,
    postgres: Option<&str>,
) -> Result<ServerUnderTest, BenchError> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("event.json"), SCHEMA)?;
    let config = dir.path().join("gate.toml");
    let mut text = config_text(&nats.url, batch);
    if postgres.is_some() {
        text = text.replace(
            "sqlite = \"gate.db\"",
            "postgres_url_env = \"GATE_DATABASE_URL\"",
        );
    }
    std::fs::write(&config, text)?;
    let database = dir.path().join("gate.db");
    let arguments = ["gate".into(), "--config".into(), config.into_os_string()];
    let env: Vec<(&str, &str)> = postgres
        .map(|url| ("GATE_DATABASE_URL", url))
        .into_iter()
        .collect();
    Ok(ServerUnderTest::start_command_with_env(
        &std::env::current_exe()?,
        &arguments,
        &env,
        dir,
        database,
    )?)
}

/// A loopback gate on SQLite that takes anonymous writes (the bench measures ordering, not
/// credentials), with the input and output streams on `nats`.
fn config_text(nats: &str, batch: usize) -> String {
    format!(
        r#"[listen]
address = "127.0.0.1:0"

[store]
sqlite = "gate.db"

[auth]
anonymous_writes = true

[nats]
urls = ["{nats}"]

[nats.input]
stream = "{INPUT_STREAM}"
subject_prefix = "{INPUT_PREFIX}"
durable = "gate"
batch = {batch}

[nats.output]
stream = "{OUTPUT_STREAM}"
subject_prefix = "{OUTPUT_PREFIX}"

[types."{MESSAGE_TYPE}"]
schema = "event.json"
"#
    )
}

/// What one run through the gate measured.
struct GateRun {
    published: Duration,
    output: Duration,
    latencies: Vec<Duration>,
}

/// Publishes the messages while a downstream consumer reads the output; verifies the output.
async fn through_the_gate(
    context: &jetstream::Context,
    messages: &[&OrderedMessage],
    rate: Option<f64>,
) -> Result<GateRun, BenchError> {
    let expected: HashMap<String, i64> = last_sequences(messages);
    let reader = tokio::spawn(read_output(context.clone(), messages.len()));
    let started = Instant::now();
    let sent = publish(context, messages, rate).await?;
    let published = started.elapsed();
    let arrivals = reader
        .await
        .map_err(|error| BenchError::task("the output's reader", error))??;
    let output = started.elapsed();
    verify_output(&arrivals, &expected)?;
    let mut latencies: Vec<Duration> = arrivals
        .iter()
        .filter_map(|arrival| {
            let sent = sent.get(&(arrival.aggregate_id.clone(), arrival.sequence))?;
            Some(arrival.at.saturating_duration_since(*sent))
        })
        .collect();
    latencies.sort_unstable();
    Ok(GateRun {
        published,
        output,
        latencies,
    })
}

fn last_sequences(messages: &[&OrderedMessage]) -> HashMap<String, i64> {
    let mut last = HashMap::new();
    for message in messages {
        let entry = last.entry(message.aggregate_id.clone()).or_insert(0);
        *entry = (*entry).max(message.sequence);
    }
    last
}

/// Publishes every message anonymously on the gate's input, awaiting the PubAcks in windows;
/// each message's publish instant by (aggregate, sequence). With `rate`, message `i` is handed
/// over at `i / rate` seconds from the start, not before.
async fn publish(
    context: &jetstream::Context,
    messages: &[&OrderedMessage],
    rate: Option<f64>,
) -> Result<HashMap<(String, i64), Instant>, BenchError> {
    let mut sent = HashMap::with_capacity(messages.len());
    let started = tokio::time::Instant::now();
    let mut index = 0usize;
    // At a steady rate the PubAcks are awaited in small windows, so that waiting for them
    // does not bunch the offer up.
    let window_size = if rate.is_some() { 16 } else { 1024 };
    for window in messages.chunks(window_size) {
        let mut acks = Vec::with_capacity(window.len());
        for message in window {
            if let Some(rate) = rate {
                tokio::time::sleep_until(started + Duration::from_secs_f64(index as f64 / rate))
                    .await;
            }
            index += 1;
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(MESSAGE_ID_HEADER, message.message_id.as_str());
            let body = json!({
                "messageId": message.message_id,
                "sequence": message.sequence,
                "type": MESSAGE_TYPE,
                "payload": { "amount": super::amount(message) },
            });
            sent.insert(
                (message.aggregate_id.clone(), message.sequence),
                Instant::now(),
            );
            acks.push(
                context
                    .publish_with_headers(
                        subject_for(INPUT_PREFIX, &message.aggregate_id),
                        headers,
                        body.to_string().into(),
                    )
                    .await
                    .map_err(BenchError::nats)?,
            );
        }
        for ack in acks {
            ack.await.map_err(BenchError::nats)?;
        }
    }
    Ok(sent)
}

/// One message read from the output stream.
struct Arrival {
    aggregate_id: String,
    sequence: i64,
    nats_id: String,
    at: Instant,
}

/// Reads `count` messages from the output stream (created by the gate) as they come.
async fn read_output(
    context: jetstream::Context,
    count: usize,
) -> Result<Vec<Arrival>, BenchError> {
    let stream = wait_for_stream(&context).await?;
    let consumer = stream
        .create_consumer(PullConfig {
            deliver_policy: DeliverPolicy::All,
            filter_subject: format!("{OUTPUT_PREFIX}.>"),
            max_ack_pending: 20_000,
            ..Default::default()
        })
        .await
        .map_err(BenchError::nats)?;
    let progress = Progress::start("bench gate: in-order output", count as u64, "messages");
    let counter = progress.counter();
    let mut messages = consumer.messages().await.map_err(BenchError::nats)?;
    let mut arrivals = Vec::with_capacity(count);
    let deadline = Instant::now() + Duration::from_secs(600);
    while arrivals.len() < count {
        let next = tokio::time::timeout_at(deadline.into(), messages.next()).await;
        let Ok(Some(message)) = next else {
            return Err(BenchError::Verification(format!(
                "only {} of {count} messages reached the output",
                arrivals.len()
            )));
        };
        let message = message.map_err(BenchError::nats)?;
        arrivals.push(arrival_of(&message)?);
        counter.add(1);
        message
            .ack_with(AckKind::Ack)
            .await
            .map_err(BenchError::nats)?;
    }
    progress.finish();
    Ok(arrivals)
}

async fn wait_for_stream(
    context: &jetstream::Context,
) -> Result<jetstream::stream::Stream, BenchError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match context.get_stream(OUTPUT_STREAM).await {
            Ok(stream) => return Ok(stream),
            Err(error) if Instant::now() > deadline => return Err(BenchError::nats(error)),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn arrival_of(message: &jetstream::Message) -> Result<Arrival, BenchError> {
    let body: Value = serde_json::from_slice(&message.payload)
        .map_err(|error| BenchError::Verification(format!("an output body: {error}")))?;
    let nats_id = message
        .headers
        .as_ref()
        .and_then(|headers| headers.get(MESSAGE_ID_HEADER))
        .map(|value| value.as_str().to_owned())
        .unwrap_or_default();
    Ok(Arrival {
        aggregate_id: body["aggregateId"].as_str().unwrap_or_default().to_owned(),
        sequence: body["sequence"].as_i64().unwrap_or_default(),
        nats_id,
        at: Instant::now(),
    })
}

/// Every aggregate's output is 1..=last in order, and no `Nats-Msg-Id` came twice.
fn verify_output(arrivals: &[Arrival], expected: &HashMap<String, i64>) -> Result<(), BenchError> {
    let mut ids = HashSet::with_capacity(arrivals.len());
    let mut next: HashMap<&str, i64> = HashMap::new();
    for arrival in arrivals {
        if !ids.insert(arrival.nats_id.as_str()) {
            return Err(BenchError::Verification(format!(
                "{} came out twice",
                arrival.nats_id
            )));
        }
        let want = next.entry(arrival.aggregate_id.as_str()).or_insert(1);
        if arrival.sequence != *want {
            return Err(BenchError::Verification(format!(
                "{} came out as sequence {} where {} was next",
                arrival.aggregate_id, arrival.sequence, want
            )));
        }
        *want += 1;
    }
    for (aggregate, last) in expected {
        let reached = next.get(aggregate.as_str()).map_or(0, |next| next - 1);
        if reached != *last {
            return Err(BenchError::Verification(format!(
                "{aggregate} came out through {reached}, not {last}"
            )));
        }
    }
    Ok(())
}

/// The first gate's SQLite writer during a run, from its `/metrics` (the histograms of its
/// group commits): how many transactions carried the input's batches and the publisher's
/// marks, and how long they took.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WriterFigures {
    pub commits: u64,
    pub units: u64,
    pub transaction_ms: f64,
    pub commit_ms: f64,
}

impl WriterFigures {
    /// `None` when the gate's metrics hold no writer histogram.
    async fn scrape(address: &str) -> Result<Option<WriterFigures>, BenchError> {
        let text = super::http_client(1, Duration::from_secs(30))?
            .get(format!("{address}/metrics"))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        Ok(WriterFigures::parse(&text))
    }

    fn parse(page: &str) -> Option<WriterFigures> {
        let value = |name: &str| super::metric_value(page, name);
        Some(WriterFigures {
            commits: value("inbox_writer_batch_size_count")? as u64,
            units: value("inbox_writer_batch_size_sum")? as u64,
            transaction_ms: value("inbox_writer_transaction_seconds_sum")? * 1e3,
            commit_ms: value("inbox_writer_commit_seconds_sum")? * 1e3,
        })
    }

    /// What the writer did since `earlier`.
    fn since(&self, earlier: &WriterFigures) -> WriterFigures {
        WriterFigures {
            commits: self.commits.saturating_sub(earlier.commits),
            units: self.units.saturating_sub(earlier.units),
            transaction_ms: self.transaction_ms - earlier.transaction_ms,
            commit_ms: self.commit_ms - earlier.commit_ms,
        }
    }
}

impl std::fmt::Display for WriterFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per_commit = |ms: f64| ms / self.commits.max(1) as f64;
        write!(
            f,
            "{} commits of {} units, {:.2} ms per transaction, of which COMMIT {:.2} ms",
            self.commits,
            self.units,
            per_commit(self.transaction_ms),
            per_commit(self.commit_ms)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gates_writer_is_read_from_its_metrics_page_and_counted_since_a_reading() {
        let page = |commits: u64, seconds: f64| {
            format!(
                "inbox_writer_batch_size_sum {}\ninbox_writer_batch_size_count {commits}\n\
                 inbox_writer_transaction_seconds_sum {seconds}\n\
                 inbox_writer_commit_seconds_sum {}\n",
                commits * 2,
                seconds / 2.0
            )
        };
        let before = WriterFigures::parse(&page(1, 0.01)).expect("a writer");
        let after = WriterFigures::parse(&page(11, 0.11)).expect("a writer");
        let during = after.since(&before);
        assert_eq!((during.commits, during.units), (10, 20));
        assert!((during.transaction_ms - 100.0).abs() < 1e-6, "{during:?}");
        assert!((during.commit_ms - 50.0).abs() < 1e-6, "{during:?}");
        assert_eq!(
            during.to_string(),
            "10 commits of 20 units, 10.00 ms per transaction, of which COMMIT 5.00 ms"
        );
        assert_eq!(WriterFigures::parse("http_requests_total 3\n"), None);
    }
}
