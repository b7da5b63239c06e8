//! The in-process relay from the output table to JetStream: each pending row is published to
//! `<output prefix>.<encoded aggregate>` with `Nats-Msg-Id: <aggregate>:<sequence>` and body
//! `{"aggregateId","sequence","messageId","type","payload"}`, and marked published once its
//! PubAck came back.
//!
//! Order: within one aggregate strictly in sequence order, sequence n+1 published only after
//! n's PubAck; different aggregates are published concurrently. A NATS failure stops that
//! aggregate's run at the failed row (never skipped), the rows acknowledged before it are
//! marked, and the publisher backs off (100 ms doubling to 2 s) and retries from there.
//!
//! At least once, and a consumer sees each row once: a row published but not yet marked when
//! the process dies (or when the mark fails) is published again by the next publisher with the
//! same `Nats-Msg-Id`, and JetStream drops that copy inside the stream's duplicate window
//! (two minutes, set when the stream is created here). A copy published again after the window
//! is a second stream message; the consumer's own identity check is the last line there.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use futures_util::future::join_all;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::output::{OutputEntry, OutputError, OutputStore};
use crate::broker::wire;
use crate::telemetry::metrics::Metrics;

/// Rows one round reads and publishes.
pub const BATCH: usize = crate::gate::output::MAX_LIMIT;
/// How often the publisher looks for rows when nobody woke it.
pub const INTERVAL: Duration = Duration::from_millis(500);
/// The output stream's duplicate window: a copy of a row published again inside it is dropped.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_LAST: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error("NATS: {0}")]
    Nats(String),
}

/// Publishes the gate's output rows to JetStream until stopped.
pub struct Publisher {
    output: OutputStore,
    jetstream: jetstream::Context,
    stream: String,
    subject_prefix: String,
    wake: Arc<Notify>,
    /// Where the rows published and the failed rounds are counted, if anywhere.
    metrics: Option<Metrics>,
}

/// What one aggregate's run of rows came to: the rows acknowledged, in order, and the failure
/// that stopped the run before its end, if one did.
struct AggregateRun {
    acknowledged: Vec<(String, i64)>,
    failure: Option<String>,
}

impl Publisher {
    /// A publisher of `output` to `stream` under `subject_prefix`. `wake` is poked (with
    /// `notify_one`, which keeps the permit while the publisher is busy) after each delivery.
    pub fn new(
        output: OutputStore,
        jetstream: jetstream::Context,
        stream: String,
        subject_prefix: String,
        wake: Arc<Notify>,
    ) -> Publisher {
        Publisher {
            output,
            jetstream,
            stream,
            subject_prefix,
            wake,
            metrics: None,
        }
    }

    /// Counts the rows it publishes and the rounds that fail into `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Publisher {
        metrics.register_gate_publisher();
        self.metrics = Some(metrics);
        self
    }

    /// Creates the output stream (subjects `<prefix>.>`, duplicate window two minutes) unless
    /// a stream of that name exists already, which is taken as it is.
    pub async fn ensure_stream(&self) -> Result<(), PublisherError> {
        let config = StreamConfig {
            name: self.stream.clone(),
            subjects: vec![format!("{}.>", self.subject_prefix)],
            duplicate_window: DUPLICATE_WINDOW,
            storage: StorageType::File,
            ..StreamConfig::default()
        };
        self.jetstream
            .get_or_create_stream(config)
            .await
            .map_err(|error| PublisherError::Nats(format!("stream {}: {error}", self.stream)))?;
        Ok(())
    }

    /// Publishes until `stop` is cancelled: a round whenever woken or every [`INTERVAL`], and
    /// at once again after a full round; after a failure, again after a growing pause.
    pub async fn run(self, stop: CancellationToken) {
        let mut backoff = BACKOFF_FIRST;
        while !stop.is_cancelled() {
            let pause = match self.round().await {
                Ok(published) if published == BATCH => continue,
                Ok(_) => {
                    backoff = BACKOFF_FIRST;
                    None
                }
                Err(error) => {
                    if let Some(metrics) = &self.metrics {
                        metrics.gate_publish_failed();
                    }
                    tracing::warn!(%error, retry_in_ms = backoff.as_millis(), "gate publisher");
                    let pause = backoff;
                    backoff = (backoff * 2).min(BACKOFF_LAST);
                    Some(pause)
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.wake.notified(), if pause.is_none() => {}
                () = tokio::time::sleep(pause.unwrap_or(INTERVAL)) => {}
            }
        }
    }

    /// One round: the pending rows published (each aggregate's in order, aggregates at once)
    /// and the acknowledged ones marked. The number of rows read, or the first failure.
    pub async fn round(&self) -> Result<usize, PublisherError> {
        let pending = self.output.pending(BATCH).await?;
        let runs = join_all(by_aggregate(&pending).map(|rows| self.publish_run(rows))).await;
        let mut acknowledged = Vec::with_capacity(pending.len());
        let mut failure = None;
        for run in runs {
            acknowledged.extend(run.acknowledged);
            failure = failure.or(run.failure);
        }
        self.output.mark_published(&acknowledged).await?;
        if let Some(metrics) = &self.metrics {
            metrics.gate_published(acknowledged.len());
        }
        match failure {
            Some(reason) => Err(PublisherError::Nats(reason)),
            None => Ok(pending.len()),
        }
    }

    /// Publishes one aggregate's rows in order, each after the one before it was acknowledged,
    /// stopping at the first that was not.
    async fn publish_run(&self, rows: &[OutputEntry]) -> AggregateRun {
        let mut run = AggregateRun {
            acknowledged: Vec::with_capacity(rows.len()),
            failure: None,
        };
        for row in rows {
            if let Err(reason) = self.publish(row).await {
                run.failure = Some(reason);
                break;
            }
            run.acknowledged
                .push((row.aggregate_id.clone(), row.sequence));
        }
        run
    }

    /// Publishes one row and waits for its PubAck.
    async fn publish(&self, row: &OutputEntry) -> Result<(), String> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(wire::MESSAGE_ID_HEADER, nats_message_id(row).as_str());
        let subject = wire::subject_for(&self.subject_prefix, &row.aggregate_id);
        let id = || format!("{}:{}", row.aggregate_id, row.sequence);
        self.jetstream
            .publish_with_headers(subject, headers, body(row).to_string().into())
            .await
            .map_err(|error| format!("cannot publish {}: {error}", id()))?
            .await
            .map_err(|error| format!("no PubAck for {}: {error}", id()))?;
        Ok(())
    }
}

/// The published message's id, the same for every copy of one row: `<aggregate>:<sequence>`.
pub fn nats_message_id(row: &OutputEntry) -> String {
    format!("{}:{}", row.aggregate_id, row.sequence)
}

/// The published body: the row without its `appliedAt`.
pub fn body(row: &OutputEntry) -> Value {
    json!({
        "aggregateId": row.aggregate_id,
        "sequence": row.sequence,
        "messageId": row.message_id,
        "type": row.message_type,
        "payload": row.payload,
    })
}

/// `rows` (in aggregate, sequence order) cut into each aggregate's run.
fn by_aggregate(rows: &[OutputEntry]) -> impl Iterator<Item = &[OutputEntry]> {
    rows.chunk_by(|before, after| before.aggregate_id == after.aggregate_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(aggregate: &str, sequence: i64) -> OutputEntry {
        OutputEntry {
            aggregate_id: aggregate.into(),
            sequence,
            message_id: format!("{aggregate}-{sequence}"),
            message_type: "order.placed".into(),
            payload: json!({"n": sequence}),
            applied_at: "2026-01-01T00:00:00.000Z".into(),
        }
    }

    #[test]
    fn pending_rows_are_cut_into_each_aggregates_run_in_order() {
        let rows = [
            row("a", 1),
            row("a", 2),
            row("b", 1),
            row("c", 4),
            row("c", 5),
        ];
        let runs: Vec<Vec<(String, i64)>> = by_aggregate(&rows)
            .map(|run| {
                run.iter()
                    .map(|row| (row.aggregate_id.clone(), row.sequence))
                    .collect()
            })
            .collect();
        assert_eq!(
            runs,
            vec![
                vec![("a".into(), 1), ("a".into(), 2)],
                vec![("b".into(), 1)],
                vec![("c".into(), 4), ("c".into(), 5)],
            ]
        );
    }

    #[test]
    fn the_published_body_and_id_name_the_row() {
        let published = row("order.1", 3);
        assert_eq!(nats_message_id(&published), "order.1:3");
        assert_eq!(
            body(&published).to_string(),
            r#"{"aggregateId":"order.1","sequence":3,"messageId":"order.1-3","type":"order.placed","payload":{"n":3}}"#
        );
    }
}
