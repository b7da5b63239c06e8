//! `bench retention`: that a gate's store stays bounded under a retention policy, and what the
//! pruning costs the deliveries. In this process, on a fresh store of the gate's own making
//! ([`GateStores`], which `production-lab` implements with the gate's handler, output table and
//! pruner), on SQLite or a private PostgreSQL:
//!
//! - consumers deliver N messages over M aggregates through the broker door in batches, as the
//!   gate's input does (each batch one call, so that the SQLite writer group-commits them), a
//!   tenth of them one place early (held, then drained);
//! - beside them, the output rows are marked published in batches, as the gate's publisher does
//!   once JetStream acknowledged them (no NATS here: the mark is the store's side of it);
//! - with retention on, the gate's pruner runs as the gate runs it, a bounded batch at a time;
//! - every `sample_every` messages, the store's size, the interval's throughput and what the
//!   pruner deleted so far.
//!
//! The same workload runs twice on fresh stores: retention off, then on. The on run's size after
//! its warm-up (a quarter of the run, or longer if the oldest rows had not yet fallen out of the
//! window) must stay within ±10% of its size when the warm-up ended; its throughput is set
//! against the off run's. Both runs are verified: every aggregate ends at its last sequence with
//! nothing held or unpublished, and the rows retained plus the rows pruned are the messages.

mod probe;
mod report;
mod workload;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ordered_inbox::{BatchDelivery, Door, Inbox, Outcome, Undelivered};
use serde::Serialize;
use tokio::sync::{Notify, mpsc};

pub use probe::{PrunedRows, StoreLocation, StoreRows, StoreSize};
use report::mebibytes;
pub use report::{PhaseReport, RetentionReport, SizeBound, SizeSample};

use super::gate::{MESSAGE_TYPE, SCHEMA};
use super::ordered::WriterBatches;
use super::{BenchError, require_positive};
use crate::pg::{ClusterOptions, PrivateCluster};
use probe::Probe;
use workload::{Share, aggregate_counts, arrives_early};

/// The size after the warm-up stays within this fraction of its size when the warm-up ended.
pub const TOLERANCE: f64 = 0.10;
/// The warm-up lasts at least this fraction of the run.
pub const WARM_UP_FRACTION: f64 = 0.25;
/// How often autovacuum visits each database of the bench's PostgreSQL: its default of a
/// minute is nothing beside a retention of days, but most of a run beside one of seconds.
const AUTOVACUUM_NAPTIME_SECONDS: u32 = 1;
/// Rows one publishing round marks at most: the gate's publisher's round.
const PUBLISH_BATCH: usize = 1000;

/// The gate's policy for the run with retention on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RetentionSettings {
    /// Applied identities, published output rows and closed dead letters are kept this long.
    pub kept_ms: u64,
    /// Timeline events kept per aggregate (0: every event).
    pub timeline: u32,
    /// The pruner's rest after a round that found nothing more (`[retention] interval_ms`).
    pub interval_ms: u64,
    /// The most rows of each kind one pruning batch deletes (`[retention] batch`).
    pub batch: usize,
}

impl RetentionSettings {
    pub fn kept(&self) -> Duration {
        Duration::from_millis(self.kept_ms)
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }
}

/// Opens a fresh gate store as the gate opens its own: `production-lab` implements it with the
/// gate's code (this crate does not depend on the gate).
#[async_trait]
pub trait GateStores: Send + Sync {
    /// The store at `location` (created and migrated), taking messages of `message_type` whose
    /// payload `schema` (JSON Schema text) describes, with the gate's pruner running by
    /// `retention` (`None`: no pruner, everything kept).
    async fn open(
        &self,
        location: &StoreLocation,
        retention: Option<RetentionSettings>,
        message_type: &str,
        schema: &str,
    ) -> Result<Arc<dyn GateStoreUnderTest>, String>;
}

/// A gate store open for the bench.
#[async_trait]
pub trait GateStoreUnderTest: Send + Sync {
    /// The inbox the gate's doors deliver to.
    fn inbox(&self) -> Arc<dyn Inbox>;

    /// Marks at most `limit` unpublished output rows published, as the gate's publisher does
    /// once JetStream acknowledged them; answers how many it marked.
    async fn publish(&self, limit: usize) -> Result<usize, String>;

    /// The gate's metrics page (Prometheus text): the pruner's counts, the writer's batches.
    fn metrics_page(&self) -> String;

    /// Stops the pruner and closes the store.
    async fn close(&self);
}

#[derive(Debug, Clone)]
pub struct RetentionBenchOptions {
    /// A private PostgreSQL rather than a SQLite file.
    pub postgres: bool,
    /// Messages of the run with retention on.
    pub messages: usize,
    /// Messages of the run with retention off.
    pub off_messages: usize,
    pub aggregates: usize,
    /// A size sample every this many messages.
    pub sample_every: usize,
    /// Messages per delivery call (the gate's input batch).
    pub batch: usize,
    /// Concurrent consumers, each with its share of the aggregates.
    pub consumers: usize,
    pub retention: RetentionSettings,
}

/// Runs the workload with retention off, then on, each on a fresh store.
pub async fn run(
    options: &RetentionBenchOptions,
    stores: &dyn GateStores,
) -> Result<RetentionReport, BenchError> {
    require_positive(
        &[
            options.messages,
            options.off_messages,
            options.aggregates,
            options.sample_every,
            options.batch,
            options.consumers,
            options.retention.batch,
        ],
        "messages, off messages, aggregates, sample-every, batch, consumers and prune batch",
    )?;
    let cluster = if options.postgres {
        let cluster = PrivateCluster::start(ClusterOptions {
            statement_statistics: false,
            ..ClusterOptions::durable()
        })
        .map_err(|error| BenchError::Startup(format!("a private PostgreSQL: {error}")))?;
        prepare_cluster(&cluster).await?;
        Some(cluster)
    } else {
        None
    };
    let mut phases = Vec::new();
    for (name, retention, messages) in [
        ("retention_off", None, options.off_messages),
        ("retention_on", Some(options.retention), options.messages),
    ] {
        let dir = tempfile::tempdir()?;
        let location = match &cluster {
            Some(cluster) => StoreLocation::Postgres(
                cluster
                    .create_database(name)
                    .map_err(|error| BenchError::Startup(format!("a database: {error}")))?,
            ),
            None => StoreLocation::Sqlite(dir.path().join(format!("{name}.db"))),
        };
        let run = Run {
            stores,
            location: &location,
            retention,
            options,
            messages,
        };
        phases.push(run.measure().await?);
        if let Some(cluster) = &cluster {
            drop_database(cluster, name).await?;
        }
    }
    let on = phases.pop();
    let off = phases.pop();
    match (off, on) {
        (Some(off), Some(on)) => Ok(RetentionReport::new(options, off, on)),
        _ => Err(BenchError::Verification("a run is missing".into())),
    }
}

/// Sets the cluster's `autovacuum_naptime` to [`AUTOVACUUM_NAPTIME_SECONDS`], keeps its
/// checkpoints out of the phases (a phase writes about 2 GB of WAL, under `max_wal_size`, in
/// well under the timeout), logs them, and reloads its configuration. With the defaults a
/// checkpoint fell inside a phase, at a different point of each, and the full-page images
/// written after it changed the rate from one sample to the next, and with it the time window's
/// rows; the bench's own `CHECKPOINT` between the phases is then the only one.
async fn prepare_cluster(cluster: &PrivateCluster) -> Result<(), BenchError> {
    let naptime = format!("ALTER SYSTEM SET autovacuum_naptime = {AUTOVACUUM_NAPTIME_SECONDS}");
    execute_each(
        cluster,
        &[
            &naptime,
            "ALTER SYSTEM SET max_wal_size = '8GB'",
            "ALTER SYSTEM SET checkpoint_timeout = '1h'",
            "ALTER SYSTEM SET log_checkpoints = on",
            "SELECT pg_reload_conf()",
        ],
    )
    .await
}

/// Drops a phase's database once it is measured and checkpoints, so that neither autovacuum's
/// work on it nor the flush of its pages (half a million rows inserted without retention)
/// falls into the next phase.
async fn drop_database(cluster: &PrivateCluster, name: &str) -> Result<(), BenchError> {
    let drop = format!("DROP DATABASE \"{name}\" WITH (FORCE)");
    execute_each(cluster, &[&drop, "CHECKPOINT"]).await
}

/// Runs each statement on the cluster's `postgres` database as a message of its own: some
/// (`DROP DATABASE`) refuse the transaction block a multi-statement message is.
async fn execute_each(cluster: &PrivateCluster, statements: &[&str]) -> Result<(), BenchError> {
    let failed = |error: tokio_postgres::Error| BenchError::Startup(format!("postgres: {error}"));
    let (client, connection) =
        tokio_postgres::connect(&cluster.url("postgres"), tokio_postgres::NoTls)
            .await
            .map_err(failed)?;
    tokio::spawn(connection);
    for statement in statements {
        client.batch_execute(statement).await.map_err(failed)?;
    }
    Ok(())
}

/// One run on one fresh store.
struct Run<'a> {
    stores: &'a dyn GateStores,
    location: &'a StoreLocation,
    retention: Option<RetentionSettings>,
    options: &'a RetentionBenchOptions,
    messages: usize,
}

impl Run<'_> {
    fn label(&self) -> &'static str {
        if self.retention.is_some() {
            "bench retention: on"
        } else {
            "bench retention: off"
        }
    }

    /// Delivers the run's messages while publishing and sampling, then verifies the store.
    async fn measure(&self) -> Result<PhaseReport, BenchError> {
        let store = self
            .stores
            .open(self.location, self.retention, MESSAGE_TYPE, SCHEMA)
            .await
            .map_err(BenchError::GateStore)?;
        let outcome = self.load(&store).await;
        store.close().await;
        let (mut probe, mut phase) = outcome?;
        let page = store.metrics_page();
        phase.pruned = PrunedRows::parse(&page);
        phase.units_per_commit =
            WriterBatches::parse(&page).and_then(|batches| batches.units_per_commit());
        phase.retained = probe.rows().await?;
        self.verify(&phase)?;
        Ok(phase)
    }

    /// The load, the publisher and the sampler, until every message is delivered and every
    /// output row published.
    async fn load(
        &self,
        store: &Arc<dyn GateStoreUnderTest>,
    ) -> Result<(Probe, PhaseReport), BenchError> {
        let probe = Probe::connect(self.location).await?;
        let counts = aggregate_counts(self.options.aggregates, self.messages);
        let (triggers, triggered) = mpsc::unbounded_channel();
        let tally = Tally {
            delivered: Arc::new(AtomicU64::new(0)),
            every: self.options.sample_every as u64,
            triggers,
            wake: Arc::new(Notify::new()),
        };
        let finished = Arc::new(AtomicBool::new(false));
        let mut background = tokio::task::JoinSet::new();
        let started = Instant::now();
        let sampler = Sampler {
            probe,
            store: store.clone(),
            started,
            label: self.label(),
            total: self.messages as u64,
            samples: Vec::new(),
        };
        let sampling = tokio::spawn(sampler.run(triggered));
        background.spawn(publish_until_finished(
            store.clone(),
            tally.wake.clone(),
            finished.clone(),
        ));
        let mut consumers = tokio::task::JoinSet::new();
        for consumer in 0..self.options.consumers {
            let share = Share::of(&counts, consumer, self.options.consumers, MESSAGE_TYPE);
            consumers.spawn(consume(
                store.inbox(),
                share,
                self.options.batch,
                tally.clone(),
            ));
        }
        while let Some(joined) = consumers.join_next().await {
            joined.map_err(|error| BenchError::task("a consumer", error))??;
        }
        let seconds = started.elapsed().as_secs_f64();
        finished.store(true, Ordering::SeqCst);
        tally.wake.notify_one();
        drop(tally);
        let mut published = 0;
        while let Some(joined) = background.join_next().await {
            published += joined.map_err(|error| BenchError::task("the publisher", error))??;
        }
        let mut sampler = sampling
            .await
            .map_err(|error| BenchError::task("the sampler", error))??;
        if sampler.samples.last().map(|sample| sample.messages) != Some(self.messages as u64) {
            sampler
                .take(self.messages as u64, started.elapsed())
                .await?;
        }
        let messages = self.messages as u64;
        Ok((
            sampler.probe,
            PhaseReport {
                retention: self.retention.is_some(),
                messages,
                seconds,
                messages_per_second: messages as f64 / seconds,
                samples: sampler.samples,
                pruned: PrunedRows::default(),
                retained: StoreRows::default(),
                published,
                units_per_commit: None,
            },
        ))
    }

    /// Every aggregate at its last sequence, nothing held or unpublished, and every message's
    /// identity and output row either retained or counted by the pruner.
    fn verify(&self, phase: &PhaseReport) -> Result<(), BenchError> {
        let failed = |what: String| {
            Err(BenchError::Verification(format!(
                "{}: {what}",
                self.label()
            )))
        };
        let retained = &phase.retained;
        for (aggregate_id, count) in aggregate_counts(self.options.aggregates, self.messages) {
            let last = retained.positions.get(&aggregate_id).copied().unwrap_or(0);
            if last != count {
                return failed(format!("{aggregate_id} ends at {last}, not {count}"));
            }
        }
        if retained.held != 0 || retained.unpublished != 0 {
            return failed(format!(
                "{} messages still held, {} output rows unpublished",
                retained.held, retained.unpublished
            ));
        }
        let messages = phase.messages;
        let identities = retained.identities + phase.pruned.identities;
        let output = retained.output + phase.pruned.output;
        if identities != messages || output != messages {
            return failed(format!(
                "{identities} identities and {output} output rows retained or pruned for {messages} messages"
            ));
        }
        Ok(())
    }
}

/// What the consumers count together, and whom they tell.
#[derive(Clone)]
struct Tally {
    delivered: Arc<AtomicU64>,
    every: u64,
    /// A sample is due: the messages delivered, and when.
    triggers: mpsc::UnboundedSender<(u64, Instant)>,
    /// The publisher: output rows are waiting.
    wake: Arc<Notify>,
}

impl Tally {
    fn add(&self, delivered: u64) {
        let total = self.delivered.fetch_add(delivered, Ordering::SeqCst) + delivered;
        if total / self.every != (total - delivered) / self.every {
            let _ = self.triggers.send((total, Instant::now()));
        }
        self.wake.notify_one();
    }
}

/// Delivers a consumer's share through the broker door, a batch per call, each answered after
/// its COMMIT. An early message must be held and every other one applied.
async fn consume(
    inbox: Arc<dyn Inbox>,
    mut share: Share,
    batch: usize,
    tally: Tally,
) -> Result<(), BenchError> {
    loop {
        let messages = share.next_batch(batch);
        if messages.is_empty() {
            return Ok(());
        }
        let sent: Vec<(String, u64)> = messages
            .iter()
            .map(|message| (message.aggregate_id.clone(), message.sequence as u64))
            .collect();
        let deliveries = messages
            .into_iter()
            .map(|message| BatchDelivery::anonymous(message, Door::Broker))
            .collect();
        let outcomes = inbox
            .deliver_batch(deliveries)
            .await
            .map_err(|error| BenchError::GateStore(error.to_string()))?;
        for ((aggregate_id, sequence), outcome) in sent.iter().zip(&outcomes) {
            expect_outcome(aggregate_id, *sequence, outcome)?;
        }
        tally.add(sent.len() as u64);
    }
}

fn expect_outcome(
    aggregate_id: &str,
    sequence: u64,
    outcome: &Result<Outcome, Undelivered>,
) -> Result<(), BenchError> {
    let expected = match outcome {
        Ok(Outcome::Applied { .. }) => !arrives_early(sequence),
        Ok(Outcome::Held {
            repeated: false, ..
        }) => arrives_early(sequence),
        _ => false,
    };
    if expected {
        return Ok(());
    }
    Err(BenchError::Verification(format!(
        "{aggregate_id} sequence {sequence}: {outcome:?}"
    )))
}

/// Marks output rows published, a round of at most [`PUBLISH_BATCH`] at a time, waiting for
/// the consumers when none is left, until they finished and none is left. Answers the rows
/// marked.
async fn publish_until_finished(
    store: Arc<dyn GateStoreUnderTest>,
    wake: Arc<Notify>,
    finished: Arc<AtomicBool>,
) -> Result<u64, BenchError> {
    let mut published = 0u64;
    loop {
        // Read before the round: once set, every delivery committed before the round began.
        let last_round = finished.load(Ordering::SeqCst);
        let marked = store
            .publish(PUBLISH_BATCH)
            .await
            .map_err(BenchError::GateStore)?;
        published += marked as u64;
        if marked == 0 {
            if last_round {
                return Ok(published);
            }
            wake.notified().await;
        }
    }
}

/// Takes the size samples the consumers ask for, printing each on stderr as it goes.
struct Sampler {
    probe: Probe,
    store: Arc<dyn GateStoreUnderTest>,
    started: Instant,
    label: &'static str,
    total: u64,
    samples: Vec<SizeSample>,
}

impl Sampler {
    async fn run(
        mut self,
        mut triggered: mpsc::UnboundedReceiver<(u64, Instant)>,
    ) -> Result<Sampler, BenchError> {
        eprintln!("{}: 0/{} messages", self.label, self.total);
        while let Some((messages, at)) = triggered.recv().await {
            self.take(messages, at.duration_since(self.started)).await?;
        }
        Ok(self)
    }

    async fn take(&mut self, messages: u64, elapsed: Duration) -> Result<(), BenchError> {
        let size = self.probe.size().await?;
        let (before, then) = self
            .samples
            .last()
            .map_or((0, 0.0), |last| (last.messages, last.elapsed_seconds));
        let elapsed_seconds = elapsed.as_secs_f64();
        let sample = SizeSample {
            messages,
            elapsed_seconds,
            interval_per_second: messages.saturating_sub(before) as f64
                / (elapsed_seconds - then).max(1e-9),
            size,
            pruned: PrunedRows::parse(&self.store.metrics_page()),
        };
        eprintln!(
            "{}: {}/{} messages, {:.1} s, {:.0} msg/s, {}",
            self.label,
            messages,
            self.total,
            elapsed_seconds,
            sample.interval_per_second,
            mebibytes(sample.size.bytes)
        );
        self.samples.push(sample);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_early_message_must_be_held_and_any_other_applied() {
        let applied = Ok(Outcome::Applied {
            sequence: 5,
            superseded: Vec::new(),
            detail: Default::default(),
        });
        let held = Ok(Outcome::Held {
            expected: 5,
            held: 1,
            repeated: false,
        });
        assert!(expect_outcome("a", 5, &applied).is_ok());
        assert!(expect_outcome("a", 6, &held).is_ok());
        assert!(expect_outcome("a", 6, &applied).is_err());
        assert!(expect_outcome("a", 5, &held).is_err());
        assert!(expect_outcome("a", 7, &Ok(Outcome::PayloadConflict)).is_err());
    }
}
