//! `production-lab bench broker`: a private nats-server and the lab server as a child process
//! consuming from it; N messages over M aggregates published with async publish (every PubAck
//! awaited), and in the same run:
//!
//! - published → applied: from the first publish until the last row is in the inbox, and each
//!   message's end-to-end latency (its `applied_at`, stamped inside the committing transaction,
//!   minus the wall-clock instant it was handed to the client for publishing);
//! - the baseline: the same messages consumed from a stream of their own and acked, no inbox;
//! - the HTTP door's durable rate: `bench ordered`'s load with the same shape.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};

use super::server::NatsServer;
use super::wire;
use crate::bench::{
    AggregateStream, BenchError, OrderedOptions, ServerUnderTest, percentile, synchronous_name,
    verify_end_state, workload,
};
use crate::config::Synchronous;
use crate::progress::ProgressCounter;

#[derive(Debug, Clone)]
pub struct BrokerBenchOptions {
    pub aggregates: usize,
    pub messages: usize,
    pub batch: usize,
    pub synchronous: Synchronous,
    /// The HTTP comparison's concurrent clients.
    pub concurrency: usize,
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
        match self.server_peak_rss_mib {
            Some(mib) => write!(f, "  server peak RSS: {mib:.1} MiB"),
            None => write!(f, "  server peak RSS: unknown (no /proc)"),
        }
    }
}

/// Waits (ten minutes at most) until the inbox `reader` reads holds `target` applied messages,
/// reporting the count to `counter`; `at` ends the error's sentence (where the inbox is).
pub(crate) async fn wait_until_applied(
    reader: &rusqlite::Connection,
    target: i64,
    counter: &ProgressCounter,
    at: &str,
) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let applied: i64 =
            reader.query_row("SELECT COUNT(*) FROM ordered_inbox", [], |row| row.get(0))?;
        counter.reach(u64::try_from(applied).unwrap_or(0));
        if applied >= target {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Verification(format!(
                "only {applied} of {target} applied{at}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// When each applied message was applied, in milliseconds since the Unix epoch, by message id.
pub(crate) fn applied_at_ms(
    reader: &rusqlite::Connection,
) -> Result<std::collections::HashMap<String, i64>, BenchError> {
    Ok(reader
        .prepare(
            "SELECT message_id,
                    CAST(strftime('%s', applied_at) AS INTEGER) * 1000
                      + CAST(substr(applied_at, 21, 3) AS INTEGER)
               FROM ordered_inbox",
        )?
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?)
}

fn nats_error(error: impl std::fmt::Display) -> BenchError {
    BenchError::Broker(error.to_string())
}

fn epoch_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as i64)
}

/// The messages in the order they are published: position by position across the aggregates,
/// so every aggregate's messages go out in sequence order.
fn interleaved(streams: &[AggregateStream]) -> Vec<&ordered_inbox::OrderedMessage> {
    let longest = streams.iter().map(|s| s.messages.len()).max().unwrap_or(0);
    (0..longest)
        .flat_map(|position| streams.iter().filter_map(move |s| s.messages.get(position)))
        .collect()
}

/// Publishes every message to `PREFIX.AGGREGATE`, awaiting the PubAcks in windows; returns each
/// message's publish instant (epoch ms) in publishing order.
async fn publish(
    context: &jetstream::Context,
    prefix: &str,
    messages: &[&ordered_inbox::OrderedMessage],
) -> Result<Vec<i64>, BenchError> {
    let mut sent = Vec::with_capacity(messages.len());
    for window in messages.chunks(1024) {
        let mut acks = Vec::with_capacity(window.len());
        for message in window {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(wire::MESSAGE_ID_HEADER, message.message_id.as_str());
            let body = json!({
                "messageId": message.message_id,
                "sequence": message.sequence,
                "amount": message.amount,
            });
            sent.push(epoch_millis());
            acks.push(
                context
                    .publish_with_headers(
                        wire::subject_for(prefix, &message.aggregate_id),
                        headers,
                        body.to_string().into(),
                    )
                    .await
                    .map_err(nats_error)?,
            );
        }
        for ack in acks {
            ack.await.map_err(nats_error)?;
        }
    }
    Ok(sent)
}

/// The baseline: the same messages on a stream of their own, consumed by a durable pull consumer
/// in the lab's batch size and acked one by one, no inbox. Messages per second of consume + ack.
async fn baseline(
    context: &jetstream::Context,
    messages: &[&ordered_inbox::OrderedMessage],
    batch: usize,
) -> Result<f64, BenchError> {
    let stream = context
        .get_or_create_stream(StreamConfig {
            name: "BASELINE".to_owned(),
            subjects: vec!["baseline.*".to_owned()],
            storage: StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(nats_error)?;
    publish(context, "baseline", messages).await?;
    let consumer: PullConsumer = stream
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
        .map_err(nats_error)?;
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
        let mut fetched = consumer
            .batch()
            .max_messages(batch)
            .expires(Duration::from_millis(200))
            .messages()
            .await
            .map_err(nats_error)?;
        while let Some(message) = fetched.next().await {
            let message = message.map_err(nats_error)?;
            message.ack_with(AckKind::Ack).await.map_err(nats_error)?;
            consumed += 1;
        }
    }
    context.client().flush().await.map_err(nats_error)?;
    Ok(consumed as f64 / started.elapsed().as_secs_f64())
}

pub async fn run(options: &BrokerBenchOptions) -> Result<BrokerReport, BenchError> {
    if options.aggregates == 0 || options.messages == 0 || options.batch == 0 {
        return Err(BenchError::Verification(
            "aggregates, messages and batch must be positive".to_owned(),
        ));
    }
    let streams = workload(options.aggregates, options.messages);
    let messages = interleaved(&streams);
    let nats = NatsServer::start(None)?;
    let client = nats.connect().await?;
    let context = jetstream::new(client);

    let baseline_per_second = baseline(&context, &messages, options.batch).await?;

    let extra = [
        "--nats".to_owned(),
        nats.url.clone(),
        "--nats-batch".to_owned(),
        options.batch.to_string(),
    ];
    let server = ServerUnderTest::start_with(options.synchronous, 1, &extra)?;
    let reader = rusqlite::Connection::open_with_flags(
        &server.database,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )?;
    reader.busy_timeout(Duration::from_secs(5))?;
    let progress = crate::progress::Progress::start(
        "bench broker: applied from the stream",
        messages.len() as u64,
        "messages",
    );
    let counter = progress.counter();
    let started = Instant::now();
    let sent = publish(&context, "ordered", &messages).await?;
    let published = started.elapsed();
    wait_until_applied(&reader, messages.len() as i64, &counter, "").await?;
    let elapsed = started.elapsed();
    progress.finish();

    let applied = applied_at_ms(&reader)?;
    let mut latencies: Vec<Duration> = messages
        .iter()
        .zip(&sent)
        .filter_map(|(message, sent)| {
            let at = applied.get(&message.message_id)?;
            Some(Duration::from_millis(u64::try_from(at - sent).unwrap_or(0)))
        })
        .collect();
    latencies.sort_unstable();
    drop(reader);

    let status: Value = reqwest::Client::builder()
        .no_proxy()
        .build()?
        .get(format!("{}/broker", server.address))
        .send()
        .await?
        .json()
        .await?;
    let batches = status["counters"]["batches"].as_u64().unwrap_or(0);
    let consumed = status["counters"]["messages"].as_u64().unwrap_or(0);
    let peak = server.peak_rss_kib();
    let stopped = server.stop()?;
    let database = &stopped.database;
    verify_end_state(database, &streams)?;
    drop(nats);

    let http = crate::bench::ordered(&OrderedOptions {
        aggregates: options.aggregates,
        messages: options.messages,
        concurrency: options.concurrency,
        synchronous: options.synchronous,
        server: None,
    })
    .await?;

    Ok(BrokerReport {
        aggregates: options.aggregates,
        messages: options.messages,
        batch: options.batch,
        synchronous: synchronous_name(options.synchronous),
        published_per_second: options.messages as f64 / published.as_secs_f64(),
        inbox_applied_per_second: options.messages as f64 / elapsed.as_secs_f64(),
        baseline_consume_ack_per_second: baseline_per_second,
        http_door_per_second: http.http_messages_per_second,
        p50_ms: percentile(&latencies, 0.50),
        p95_ms: percentile(&latencies, 0.95),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        consumer_batches: batches,
        mean_batch: if batches == 0 {
            0.0
        } else {
            consumed as f64 / batches as f64
        },
        server_peak_rss_mib: peak.map(|kib| kib as f64 / 1024.0),
    })
}
