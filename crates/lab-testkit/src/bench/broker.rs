//! `bench broker`: a private nats-server and the lab server as a child process consuming from
//! it (`serve --nats`); N messages over M aggregates published with async publish (every PubAck
//! awaited), and in the same run:
//!
//! - published → applied: from the first publish until the last row is in the inbox, and each
//!   message's end-to-end latency (its `applied_at`, stamped inside the committing transaction,
//!   minus the wall-clock instant it was handed to the client for publishing);
//! - the baseline: the same messages consumed from a stream of their own and acked, no inbox;
//! - the HTTP door's durable rate: `bench ordered`'s load with the same shape.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use ordered_inbox::OrderedMessage;
use serde::Serialize;
use serde_json::Value;

use super::database::{
    applied_at_ms, latencies_between, open_reader, verify_end_state, wait_until_applied,
};
use super::ordered::{OrderedOptions, RawApplication, ordered};
use super::{
    BenchError, http_client, interleaved, max_ms, message_body, mib, percentile, require_positive,
    workload,
};
use crate::nats::{MESSAGE_ID_HEADER, NatsServer, subject_for};
use crate::process::{CpuMeter, CpuSplit};
use crate::progress::Progress;
use crate::server::{ServerUnderTest, Synchronous, synchronous_flag};

#[derive(Debug, Clone)]
pub struct BrokerBenchOptions {
    pub aggregates: usize,
    pub messages: usize,
    pub batch: usize,
    pub synchronous: Synchronous,
    /// The HTTP comparison's concurrent clients.
    pub concurrency: usize,
    /// What the HTTP comparison's raw baseline applies.
    pub baseline: RawApplication,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BrokerReport {
    pub aggregates: usize,
    pub messages: usize,
    pub batch: usize,
    pub synchronous: &'static str,
    pub published_per_second: f64,
    pub inbox_applied_per_second: f64,
    pub baseline_consume_ack_per_second: f64,
    pub http_door_per_second: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Fetched batches the consumer delivered (one inbox call, one commit each).
    pub consumer_batches: u64,
    pub mean_batch: f64,
    pub server_peak_rss_mib: Option<f64>,
    /// Where the CPU of the load through the server went, per message.
    pub cpu_per_message: CpuSplit,
}

impl std::fmt::Display for BrokerReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench broker: {} messages over {} aggregates, batch {}, synchronous={}",
            self.messages, self.aggregates, self.batch, self.synchronous
        )?;
        writeln!(
            f,
            "  published (PubAcks awaited):    {:>10.0} messages/s",
            self.published_per_second
        )?;
        writeln!(
            f,
            "  published -> applied (inbox):   {:>10.0} messages/s",
            self.inbox_applied_per_second
        )?;
        writeln!(
            f,
            "  raw JetStream consume + ack:    {:>10.0} messages/s",
            self.baseline_consume_ack_per_second
        )?;
        writeln!(
            f,
            "  HTTP door (group commit):       {:>10.0} messages/s",
            self.http_door_per_second
        )?;
        writeln!(
            f,
            "  end-to-end ms: p50 {:.1}  p95 {:.1}  p99 {:.1}  max {:.1}",
            self.p50_ms, self.p95_ms, self.p99_ms, self.max_ms
        )?;
        writeln!(
            f,
            "  consumer batches: {} (mean {:.1} messages per commit)",
            self.consumer_batches, self.mean_batch
        )?;
        writeln!(
            f,
            "  CPU per message, published -> applied: {}",
            self.cpu_per_message
        )?;
        match self.server_peak_rss_mib {
            Some(mib) => write!(f, "  server peak RSS: {mib:.1} MiB"),
            None => write!(f, "  server peak RSS: unknown (no /proc)"),
        }
    }
}

fn epoch_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)
        })
}

/// Publishes every message to `PREFIX.AGGREGATE` on the broker door's wire format, awaiting the
/// PubAcks in windows; returns each message's publish instant (epoch ms) by message id.
pub(super) async fn publish(
    context: &jetstream::Context,
    prefix: &str,
    messages: &[&OrderedMessage],
) -> Result<HashMap<String, i64>, BenchError> {
    let mut sent = HashMap::with_capacity(messages.len());
    for window in messages.chunks(1024) {
        let mut acks = Vec::with_capacity(window.len());
        for message in window {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(MESSAGE_ID_HEADER, message.message_id.as_str());
            sent.insert(message.message_id.clone(), epoch_millis());
            acks.push(
                context
                    .publish_with_headers(
                        subject_for(prefix, &message.aggregate_id),
                        headers,
                        message_body(message).to_string().into(),
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

/// The baseline: the same messages on a stream of their own, consumed by a durable pull consumer
/// in the lab's batch size and acked one by one, no inbox. Messages per second of consume + ack.
async fn baseline(
    context: &jetstream::Context,
    messages: &[&OrderedMessage],
    batch: usize,
) -> Result<f64, BenchError> {
    let consumer = baseline_consumer(context).await?;
    publish(context, "baseline", messages).await?;
    let started = Instant::now();
    let mut consumed = 0;
    let deadline = started + Duration::from_secs(600);
    while consumed < messages.len() {
        if Instant::now() > deadline {
            return Err(BenchError::Verification(format!(
                "baseline: only {consumed} of {} consumed",
                messages.len()
            )));
        }
        consumed += fetch_and_ack(&consumer, batch).await?;
    }
    context.client().flush().await.map_err(BenchError::nats)?;
    Ok(consumed as f64 / started.elapsed().as_secs_f64())
}

/// The stream `BASELINE` on `baseline.*` and its durable pull consumer.
async fn baseline_consumer(context: &jetstream::Context) -> Result<PullConsumer, BenchError> {
    let stream = context
        .get_or_create_stream(StreamConfig {
            name: "BASELINE".to_owned(),
            subjects: vec!["baseline.*".to_owned()],
            storage: StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(BenchError::nats)?;
    stream
        .get_or_create_consumer(
            "baseline",
            PullConfig {
                durable_name: Some("baseline".to_owned()),
                ack_policy: AckPolicy::Explicit,
                max_ack_pending: 20_000,
                ..Default::default()
            },
        )
        .await
        .map_err(BenchError::nats)
}

/// One fetch of up to `batch` messages, each acked; how many came.
async fn fetch_and_ack(consumer: &PullConsumer, batch: usize) -> Result<usize, BenchError> {
    let mut fetched = consumer
        .batch()
        .max_messages(batch)
        .expires(Duration::from_millis(200))
        .messages()
        .await
        .map_err(BenchError::nats)?;
    let mut acked = 0;
    while let Some(message) = fetched.next().await {
        let message = message.map_err(BenchError::nats)?;
        message
            .ack_with(AckKind::Ack)
            .await
            .map_err(BenchError::nats)?;
        acked += 1;
    }
    Ok(acked)
}

/// What the consuming server did with the published messages.
struct ConsumedRun {
    /// From the first publish to the last PubAck.
    published: Duration,
    /// From the first publish to the last row in the inbox.
    applied: Duration,
    /// Each message's publish → COMMIT, sorted.
    latencies: Vec<Duration>,
    /// `GET /broker`'s counters: fetched batches and the messages in them.
    batches: u64,
    consumed: u64,
    peak_rss_kib: Option<u64>,
    cpu: CpuSplit,
}

/// Starts a server consuming from `nats`, publishes the messages, waits until all are applied,
/// reads its counters, stops it and verifies its end state.
async fn consume_through_server(
    nats: &NatsServer,
    context: &jetstream::Context,
    options: &BrokerBenchOptions,
    messages: &[&OrderedMessage],
) -> Result<ConsumedRun, BenchError> {
    let server = consuming_server(nats, options.synchronous, options.batch)?;
    let reader = open_reader(&server.database)?;
    let progress = Progress::start(
        "bench broker: applied from the stream",
        messages.len() as u64,
        "messages",
    );
    let meter = CpuMeter::start(nats.pid(), vec![server.pid()]);
    let started = Instant::now();
    let sent = publish(context, "ordered", messages).await?;
    let published = started.elapsed();
    wait_until_applied(&reader, messages.len() as i64, &progress.counter(), "").await?;
    let applied = started.elapsed();
    let cpu = meter.per_message(messages.len());
    progress.finish();
    let latencies = latencies_between(&sent, &applied_at_ms(&reader)?);
    drop(reader);
    let (batches, consumed) = consumer_counters(&server.address).await?;
    let peak_rss_kib = server.peak_rss_kib();
    let stopped = server.stop()?;
    verify_end_state(
        &stopped.database,
        &workload(options.aggregates, options.messages),
    )?;
    Ok(ConsumedRun {
        published,
        applied,
        latencies,
        batches,
        consumed,
        peak_rss_kib,
        cpu,
    })
}

/// A lab server consuming from `nats` (`serve --nats`) in batches of `batch`.
pub(super) fn consuming_server(
    nats: &NatsServer,
    synchronous: Synchronous,
    batch: usize,
) -> Result<ServerUnderTest, BenchError> {
    let extra = [
        "--nats".to_owned(),
        nats.url.clone(),
        "--nats-batch".to_owned(),
        batch.to_string(),
    ];
    Ok(ServerUnderTest::start_with(synchronous, 1, &extra)?)
}

/// `GET /broker`'s counters: the batches the consumer fetched and the messages in them.
async fn consumer_counters(address: &str) -> Result<(u64, u64), BenchError> {
    let counters = broker_counters(address).await?;
    Ok((
        counters["batches"].as_u64().unwrap_or(0),
        counters["messages"].as_u64().unwrap_or(0),
    ))
}

/// `GET /broker`'s `counters` object.
pub(super) async fn broker_counters(address: &str) -> Result<Value, BenchError> {
    let mut status: Value = http_client(1, Duration::from_secs(30))?
        .get(format!("{address}/broker"))
        .send()
        .await?
        .json()
        .await?;
    Ok(status["counters"].take())
}

pub async fn run(options: &BrokerBenchOptions) -> Result<BrokerReport, BenchError> {
    require_positive(
        &[options.aggregates, options.messages, options.batch],
        "aggregates, messages and batch",
    )?;
    let streams = workload(options.aggregates, options.messages);
    let messages = interleaved(&streams);
    let nats = NatsServer::start(None)?;
    let context = jetstream::new(nats.connect().await?);
    let baseline_per_second = baseline(&context, &messages, options.batch).await?;
    let consumed = consume_through_server(&nats, &context, options, &messages).await?;
    drop(nats);
    let http = ordered(&OrderedOptions {
        aggregates: options.aggregates,
        messages: options.messages,
        concurrency: options.concurrency,
        synchronous: options.synchronous,
        server: None,
        baseline: options.baseline.clone(),
    })
    .await?;
    Ok(BrokerReport::new(
        options,
        &consumed,
        baseline_per_second,
        http.http_messages_per_second,
    ))
}

impl BrokerReport {
    fn new(
        options: &BrokerBenchOptions,
        run: &ConsumedRun,
        baseline_per_second: f64,
        http_per_second: f64,
    ) -> BrokerReport {
        let latencies = &run.latencies;
        BrokerReport {
            aggregates: options.aggregates,
            messages: options.messages,
            batch: options.batch,
            synchronous: synchronous_flag(options.synchronous),
            published_per_second: options.messages as f64 / run.published.as_secs_f64(),
            inbox_applied_per_second: options.messages as f64 / run.applied.as_secs_f64(),
            baseline_consume_ack_per_second: baseline_per_second,
            http_door_per_second: http_per_second,
            p50_ms: percentile(latencies, 0.50),
            p95_ms: percentile(latencies, 0.95),
            p99_ms: percentile(latencies, 0.99),
            max_ms: max_ms(latencies),
            consumer_batches: run.batches,
            mean_batch: if run.batches == 0 {
                0.0
            } else {
                run.consumed as f64 / run.batches as f64
            },
            server_peak_rss_mib: mib(run.peak_rss_kib),
            cpu_per_message: run.cpu,
        }
    }
}
