//! The in-process relay from the output table to JetStream: each pending row is published to
//! `<output prefix>.<encoded aggregate>` with `Nats-Msg-Id: <aggregate>:<sequence>` and body
//! `{"aggregateId","sequence","messageId","type","payload"}`, and marked published once its
//! PubAck came back.
//!
//! One gate of a store publishes at a time: the holder of the store's lease
//! ([`crate::lease`]), renewed at the first round after a third of its term (and after a
//! fence); the other gates stand by and take over once it lapses. Order: within one aggregate strictly in sequence order, sequence n+1
//! published only after n's PubAck; different aggregates are published concurrently. A NATS
//! failure stops that aggregate's run at the failed row (never skipped), the rows acknowledged
//! before it are marked, and the publisher backs off (100 ms doubling to 2 s) and retries.
//!
//! Exactly once and in order, without the duplicate window: every publish carries
//! `Nats-Expected-Last-Subject-Sequence`, the stream sequence of the aggregate's previous output
//! message, so JetStream appends it only if nothing reached the subject since. The publisher
//! keeps that sequence per aggregate from its PubAcks; after a start, a takeover or a fence it
//! reads it from the stream (the subject's last message), and a row that message already covers
//! (a previous holder published it and did not mark it) is marked without being sent again. A
//! holder that outlived its lease unawares (paused, cut off) is refused by the server
//! (`wrong last sequence`, 10071) at its first stale publish: it drops what it knew and stands
//! by, never retrying. `Nats-Msg-Id` is kept; it costs nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream::{Config as StreamConfig, LastRawMessageErrorKind, StorageType};
use futures_util::future::join_all;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::lease::Lease;
use super::output::{OutputEntry, OutputError, OutputStore, PENDING_PER_AGGREGATE};
use http_edge::jetstream::wire;
use http_edge::metrics::Metrics;

/// Rows one round reads and publishes.
pub const BATCH: usize = crate::output::MAX_LIMIT;
/// How often the publisher looks for rows when nobody woke it (more often with a short lease).
pub const INTERVAL: Duration = Duration::from_millis(500);
/// The output stream's duplicate window, when the stream is created here.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// How long a lease lasts unless the configuration says otherwise.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(5);
/// The most aggregates whose last stream sequence is kept; past it the cache starts over (a
/// forgotten aggregate costs one read of its subject's last message).
const MAX_CACHED_AGGREGATES: usize = 100_000;
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_LAST: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error("NATS: {0}")]
    Nats(String),
}

/// The epoch of the lease a publisher holds now (0: it stands by), shared with `/ready` and
/// `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct HeldEpoch(Arc<AtomicI64>);

impl HeldEpoch {
    /// The epoch held, or `None` while the publisher stands by.
    pub fn get(&self) -> Option<i64> {
        Some(self.0.load(Ordering::Relaxed)).filter(|epoch| *epoch > 0)
    }

    fn set(&self, lease: Option<&Lease>) {
        self.0
            .store(lease.map_or(0, |lease| lease.epoch), Ordering::Relaxed);
    }
}

/// The rows this gate's publisher marked published since it started, shared with the lag
/// sampler ([`crate::lag`]), which reads its growth between two samples.
#[derive(Clone, Debug, Default)]
pub struct PublishedRows(Arc<AtomicU64>);

impl PublishedRows {
    /// The rows published so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn add(&self, rows: usize) {
        self.0
            .fetch_add(u64::try_from(rows).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// Publishes the gate's output rows to JetStream while it holds the store's lease, until stopped.
pub struct Publisher {
    output: OutputStore,
    jetstream: jetstream::Context,
    stream: String,
    subject_prefix: String,
    wake: Arc<Notify>,
    /// Where the rows published, the failed rounds and the fences are counted, if anywhere.
    metrics: Option<Metrics>,
    /// This publisher's name in the lease, unique to the process.
    holder: String,
    lease_duration: Duration,
    /// The lease while this publisher holds it.
    lease: Option<Lease>,
    /// When the request that last took or renewed [`Publisher::lease`] was sent: the store's
    /// expiry is at least a term after it.
    renewed_at: Option<Instant>,
    /// [`Publisher::lease`]'s epoch, for the health routes.
    held_epoch: HeldEpoch,
    /// The rows marked published, for the lag's samples.
    published: PublishedRows,
    /// Per aggregate, its subject's last message as this holder left it: the stream sequence
    /// and the row sequence, so that a later round marks (and never sends again) rows the
    /// stream held before this holder's first read.
    last_sequences: HashMap<String, SubjectTail>,
    /// The last round published all it read and read as much as a read answers (in all, or of
    /// one aggregate): rows may be waiting behind them, so the next round starts at once.
    more_pending: bool,
}

/// What one aggregate's run of rows came to: the rows acknowledged (or found in the stream
/// already), in order, the subject's last stream sequence after them, and what stopped the run
/// before its end, if anything did.
struct AggregateRun {
    aggregate_id: String,
    acknowledged: Vec<(String, i64)>,
    last_sequence: Option<SubjectTail>,
    stop: Option<Stop>,
}

/// Why a publish did not go through.
#[derive(Debug)]
enum Stop {
    /// NATS failed or did not answer: retry after a pause.
    Failed(String),
    /// The server refused the publish because the subject moved on: another publisher holds it.
    Fenced(String),
}

/// What the stream says of an aggregate's subject: the stream sequence of its last message
/// (0: none) and that message's row sequence (0: none).
#[derive(Clone, Copy, Debug, PartialEq)]
struct SubjectTail {
    stream_sequence: u64,
    row_sequence: i64,
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
            holder: holder_name(),
            lease_duration: DEFAULT_LEASE,
            lease: None,
            renewed_at: None,
            held_epoch: HeldEpoch::default(),
            published: PublishedRows::default(),
            last_sequences: HashMap::new(),
            more_pending: false,
        }
    }

    /// Counts the rows it publishes, the rounds that fail and its fences into `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Publisher {
        metrics.register_gate_publisher();
        self.metrics = Some(metrics);
        self
    }

    /// Holds the store's lease for `duration` at a time.
    pub fn with_lease(mut self, duration: Duration) -> Publisher {
        self.lease_duration = duration;
        self
    }

    /// Shows the lease this publisher holds in `held` (the gate's handler reads it too).
    pub fn with_held_epoch(mut self, held: HeldEpoch) -> Publisher {
        self.held_epoch = held;
        self
    }

    /// The epoch of the lease it holds, as it changes.
    pub fn held_epoch(&self) -> HeldEpoch {
        self.held_epoch.clone()
    }

    /// The rows it marked published, as they grow.
    pub fn published_rows(&self) -> PublishedRows {
        self.published.clone()
    }

    /// This publisher's name in the lease.
    pub fn holder(&self) -> &str {
        &self.holder
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
        let stream = self
            .jetstream
            .get_or_create_stream(config)
            .await
            .map_err(|error| PublisherError::Nats(format!("stream {}: {error}", self.stream)))?;
        let weak = durability_weaknesses(&stream.cached_info().config);
        if !weak.is_empty() {
            tracing::warn!(
                target: "production_lab::gate",
                stream = %self.stream,
                "the output stream {} can lose rows the gate marked published: {} (see docs/gate.md, Durability of the output stream)",
                self.stream,
                weak.join(", "),
            );
        }
        Ok(())
    }

    /// Publishes until `stop` is cancelled: a round whenever woken or every [`INTERVAL`] (or a
    /// third of the lease, if shorter), and at once again after a round that read a full batch
    /// or an aggregate's full share of one (an aggregate whose backlog outlasted the others'
    /// would otherwise wait for the next wake or tick at every share); after a failure, again
    /// after a growing pause. At the end the lease is given up.
    pub async fn run(mut self, stop: CancellationToken) {
        let tick = INTERVAL.min(self.lease_duration / 3);
        let mut backoff = BACKOFF_FIRST;
        while !stop.is_cancelled() {
            let pause = match self.round().await {
                Ok(_) if self.more_pending => continue,
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
                () = stop.cancelled() => break,
                () = self.wake.notified(), if pause.is_none() => {}
                () = tokio::time::sleep(pause.unwrap_or(tick)) => {}
            }
        }
        self.held_epoch.set(None);
        if let Some(lease) = self.lease.take()
            && let Err(error) = self.output.release_lease(&lease).await
        {
            tracing::warn!(%error, "gate publisher: the lease was not given up");
        }
    }

    /// One round: the lease renewed or taken (without it, nothing more), the pending rows
    /// published (each aggregate's in order, aggregates at once) and the acknowledged ones
    /// marked. The number of rows read, or the first failure.
    pub async fn round(&mut self) -> Result<usize, PublisherError> {
        self.more_pending = false;
        if !self.hold_lease().await? {
            return Ok(0);
        }
        let pending = self.output.pending(BATCH).await?;
        let runs = join_all(by_aggregate(&pending).map(|rows| self.publish_run(rows))).await;
        let mut acknowledged = Vec::with_capacity(pending.len());
        let (mut failure, mut fence) = (None, None);
        if self.last_sequences.len() >= MAX_CACHED_AGGREGATES {
            self.last_sequences.clear();
        }
        for run in runs {
            acknowledged.extend(run.acknowledged);
            match run.last_sequence {
                Some(tail) => self.last_sequences.insert(run.aggregate_id, tail),
                None => self.last_sequences.remove(&run.aggregate_id),
            };
            match run.stop {
                Some(Stop::Failed(reason)) => failure = failure.or(Some(reason)),
                Some(Stop::Fenced(reason)) => fence = fence.or(Some(reason)),
                None => {}
            }
        }
        self.output.mark_published(&acknowledged).await?;
        self.published.add(acknowledged.len());
        if let Some(metrics) = &self.metrics {
            metrics.gate_published(acknowledged.len());
        }
        if let Some(reason) = fence {
            // The lease may still be this gate's (a stale publisher elsewhere moved the subject
            // on): the next round's renewal says, and a holder reads the stream again.
            self.last_sequences.clear();
            self.renewed_at = None;
            self.fenced(&reason);
            return Ok(0);
        }
        match failure {
            Some(reason) => Err(PublisherError::Nats(reason)),
            None => {
                self.more_pending = pending.len() == BATCH
                    || by_aggregate(&pending).any(|rows| rows.len() >= PENDING_PER_AGGREGATE);
                Ok(pending.len())
            }
        }
    }

    /// Renews the lease this publisher holds, or takes it if it lapsed: whether it publishes
    /// this round. A renewal that fails means another gate took over: fenced.
    async fn hold_lease(&mut self) -> Result<bool, PublisherError> {
        if crate::planted::active(crate::planted::PlantedBug::FenceOff) {
            // The planted bug: the lease is still taken and renewed where it can be, but it
            // no longer decides who publishes.
            let _ = self.hold_lease_fenced().await;
            return Ok(true);
        }
        self.hold_lease_fenced().await
    }

    async fn hold_lease_fenced(&mut self) -> Result<bool, PublisherError> {
        if let Some(lease) = &self.lease {
            // A renewal at every round would cost the store a commit each round; a third of
            // the term leaves two thirds of it for the renewal to get through.
            if self
                .renewed_at
                .is_some_and(|at| at.elapsed() < self.lease_duration / 3)
            {
                return Ok(true);
            }
            let asked = Instant::now();
            if self.output.renew_lease(lease, self.lease_duration).await? {
                self.renewed_at = Some(asked);
                return Ok(true);
            }
            self.lease = None;
            self.renewed_at = None;
            self.held_epoch.set(None);
            self.last_sequences.clear();
            self.fenced("another gate took the publisher's lease over");
        }
        let asked = Instant::now();
        self.lease = self
            .output
            .take_lease(&self.holder, self.lease_duration)
            .await?;
        self.renewed_at = self.lease.as_ref().map(|_| asked);
        self.held_epoch.set(self.lease.as_ref());
        if let Some(lease) = &self.lease {
            tracing::info!(holder = %lease.holder, epoch = lease.epoch, "gate publisher: holds the lease and publishes");
            if let Some(metrics) = &self.metrics {
                metrics.gate_publisher_holding(true);
            }
        }
        Ok(self.lease.is_some())
    }

    /// Logs and counts a fence: this publisher stopped publishing for `reason`, and publishes
    /// again only once it holds the lease and read the stream anew.
    fn fenced(&self, reason: &str) {
        tracing::warn!(holder = %self.holder, reason, "gate publisher fenced: it stops publishing and checks the lease again");
        if let Some(metrics) = &self.metrics {
            metrics.gate_publisher_fenced();
            metrics.gate_publisher_holding(self.lease.is_some());
        }
    }

    /// Publishes one aggregate's rows in order, each after the one before it was acknowledged
    /// and each expecting the one before it last on the subject, stopping at the first that was
    /// not acknowledged. Rows the subject's last message covers already are only marked.
    async fn publish_run(&self, rows: &[OutputEntry]) -> AggregateRun {
        let aggregate_id = rows.first().map(|row| row.aggregate_id.clone());
        let mut run = AggregateRun {
            aggregate_id: aggregate_id.unwrap_or_default(),
            acknowledged: Vec::with_capacity(rows.len()),
            last_sequence: None,
            stop: None,
        };
        let tail = match self.last_sequences.get(&run.aggregate_id) {
            Some(&tail) => tail,
            None => match self.subject_tail(&run.aggregate_id).await {
                Ok(tail) => tail,
                Err(reason) => {
                    run.stop = Some(Stop::Failed(reason));
                    return run;
                }
            },
        };
        let mut after = tail;
        for row in rows {
            if row.sequence > after.row_sequence {
                match self.publish(row, after.stream_sequence).await {
                    Ok(stream_sequence) => {
                        after = SubjectTail {
                            stream_sequence,
                            row_sequence: row.sequence,
                        }
                    }
                    Err(stop) => {
                        run.stop = Some(stop);
                        break;
                    }
                }
            }
            run.acknowledged
                .push((row.aggregate_id.clone(), row.sequence));
        }
        // After a failure the last publish may have been stored without its PubAck reaching
        // here: the subject is read again rather than trusted.
        run.last_sequence = Some(after).filter(|_| run.stop.is_none());
        run
    }

    /// The aggregate's subject's last message as the stream holds it now.
    async fn subject_tail(&self, aggregate_id: &str) -> Result<SubjectTail, String> {
        let subject = wire::subject_for(&self.subject_prefix, aggregate_id);
        let stream = self
            .jetstream
            .get_stream_no_info(&self.stream)
            .await
            .map_err(|error| format!("stream {}: {error}", self.stream))?;
        match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(message) => {
                let body: Value = serde_json::from_slice(&message.payload).unwrap_or(Value::Null);
                Ok(SubjectTail {
                    stream_sequence: message.sequence,
                    row_sequence: body["sequence"].as_i64().unwrap_or(0),
                })
            }
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                Ok(SubjectTail {
                    stream_sequence: 0,
                    row_sequence: 0,
                })
            }
            Err(error) => Err(format!(
                "cannot read the last message of {subject}: {error}"
            )),
        }
    }

    /// Publishes one row, expecting the subject's last message at stream sequence `expected`
    /// (0: none), and waits for its PubAck: the row's stream sequence.
    async fn publish(&self, row: &OutputEntry, expected: u64) -> Result<u64, Stop> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(wire::MESSAGE_ID_HEADER, nats_message_id(row).as_str());
        if !crate::planted::active(crate::planted::PlantedBug::FenceOff) {
            headers.insert(
                async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
                expected.to_string().as_str(),
            );
        }
        let subject = wire::subject_for(&self.subject_prefix, &row.aggregate_id);
        let id = nats_message_id(row);
        let refused = |stage: &str, error: jetstream::context::PublishError| {
            let reason = format!("{stage} {id}: {error}");
            if error.kind() == PublishErrorKind::WrongLastSequence {
                Stop::Fenced(reason)
            } else {
                Stop::Failed(reason)
            }
        };
        let body = body(row).map_err(|error| Stop::Failed(format!("the body of {id}: {error}")))?;
        let ack = self
            .jetstream
            .publish_with_headers(subject, headers, body.into())
            .await
            .map_err(|error| refused("cannot publish", error))?
            .await
            .map_err(|error| refused("no PubAck for", error))?;
        Ok(ack.sequence)
    }
}

/// A name for this process's publisher in the lease: its pid and a random part, so that a
/// restarted gate (or one on another host with the same pid) is never taken for an old holder.
fn holder_name() -> String {
    format!("gate-{}-{:016x}", std::process::id(), rand::random::<u64>())
}

/// The published message's id, the same for every copy of one row: `<aggregate>:<sequence>`.
pub fn nats_message_id(row: &OutputEntry) -> String {
    format!("{}:{}", row.aggregate_id, row.sequence)
}

/// The published body: the row without its `appliedAt`, in the order of
/// [`PublishedBody`]'s fields.
pub fn body(row: &OutputEntry) -> Result<Vec<u8>, serde_json::Error> {
    // Serialized from borrowed fields: a `Value` built first would clone every payload.
    serde_json::to_vec(&PublishedBody {
        aggregate_id: &row.aggregate_id,
        sequence: row.sequence,
        message_id: &row.message_id,
        message_type: &row.message_type,
        payload: &row.payload,
    })
}

/// What [`body`] writes.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PublishedBody<'a> {
    aggregate_id: &'a str,
    sequence: i64,
    message_id: &'a str,
    #[serde(rename = "type")]
    message_type: &'a str,
    payload: &'a Value,
}

/// `rows` (in aggregate, sequence order) cut into each aggregate's run.
fn by_aggregate(rows: &[OutputEntry]) -> impl Iterator<Item = &[OutputEntry]> {
    rows.chunk_by(|before, after| before.aggregate_id == after.aggregate_id)
}

/// What makes an output stream lose a row after its PubAck, which is when the gate marks the row
/// published: memory storage (gone with the server's process) and a single replica (gone with
/// its server's disk, or, under the lazy default fsync, with its unsynced writes).
fn durability_weaknesses(config: &StreamConfig) -> Vec<&'static str> {
    let mut weak = Vec::new();
    if config.storage == StorageType::Memory {
        weak.push("memory storage");
    }
    if config.num_replicas <= 1 {
        weak.push("a single replica (3 or more are needed)");
    }
    weak
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn memory_storage_and_a_single_replica_are_named_as_weak() {
        let stream = |storage, num_replicas| StreamConfig {
            storage,
            num_replicas,
            ..StreamConfig::default()
        };
        assert_eq!(
            durability_weaknesses(&stream(StorageType::Memory, 1)),
            ["memory storage", "a single replica (3 or more are needed)"]
        );
        assert_eq!(
            durability_weaknesses(&stream(StorageType::File, 0)),
            ["a single replica (3 or more are needed)"]
        );
        assert!(durability_weaknesses(&stream(StorageType::File, 3)).is_empty());
    }

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
            String::from_utf8(body(&published).expect("a body")).expect("UTF-8"),
            r#"{"aggregateId":"order.1","sequence":3,"messageId":"order.1-3","type":"order.placed","payload":{"n":3}}"#
        );
    }

    #[test]
    fn the_body_is_the_rows_json_with_its_payload_as_stored_whatever_it_holds() {
        let mut tricky = row("order \"1\"\u{e9}", 7);
        tricky.payload = json!({"z": 1, "a": [123456789012345678901234567890_u128, 1.50, null],
                                "text": "line\nbreak \u{1F600}"});
        let expected = json!({
            "aggregateId": tricky.aggregate_id,
            "sequence": tricky.sequence,
            "messageId": tricky.message_id,
            "type": tricky.message_type,
            "payload": tricky.payload,
        });
        assert_eq!(
            String::from_utf8(body(&tricky).expect("a body")).expect("UTF-8"),
            expected.to_string()
        );
    }
}
