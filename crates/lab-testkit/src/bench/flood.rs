//! `bench flood`: the broker door's fairness and catch-up under one aggregate's flood of early
//! messages. A private nats-server and the lab server consuming from it (`serve --nats`):
//!
//! 1. the flood: sequences 2..=N+1 of one aggregate, published while its sequence 1 is missing,
//!    so that every one of them arrives ahead of its turn (more than the aggregate may hold);
//! 2. during the flood, one message of another aggregate every tenth of the flood: how long each
//!    waits from its publish to its COMMIT (`applied_at`);
//! 3. the missing sequence 1: how long until the flooded aggregate has applied all N+1.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use ordered_inbox::OrderedMessage;
use rusqlite::Connection;
use serde::Serialize;

use super::database::{applied_at_ms, latencies_between, open_reader};
use super::{BenchError, ledger_message, max_ms, percentile, require_positive};
use crate::nats::NatsServer;
use crate::server::{Synchronous, synchronous_flag};

const FLOODED: &str = "flooded";
const OTHER: &str = "other";
/// How many messages of the other aggregate go out during the flood.
const OTHERS: usize = 10;

#[derive(Debug, Clone)]
pub struct FloodBenchOptions {
    /// Early messages of the flooded aggregate.
    pub early: usize,
    pub batch: usize,
    pub synchronous: Synchronous,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FloodReport {
    pub early: usize,
    pub batch: usize,
    pub synchronous: &'static str,
    /// From the flood's first publish to its last PubAck.
    pub flood_published_ms: f64,
    /// Publish → COMMIT of the other aggregate's messages sent during the flood.
    pub other_p50_ms: f64,
    pub other_max_ms: f64,
    /// From the missing sequence's publish until the flooded aggregate applied everything.
    pub catch_up_ms: f64,
    pub catch_up_per_second: f64,
    /// `GET /broker`'s counters at the end.
    pub nakd: u64,
    pub messages_fetched: u64,
}

impl std::fmt::Display for FloodReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench flood: {} early messages for one aggregate, batch {}, synchronous={}",
            self.early, self.batch, self.synchronous
        )?;
        writeln!(
            f,
            "  flood published (PubAcks awaited):  {:>9.0} ms",
            self.flood_published_ms
        )?;
        writeln!(
            f,
            "  another aggregate's message waits:  p50 {:.0} ms, max {:.0} ms ({OTHERS} sent during the flood)",
            self.other_p50_ms, self.other_max_ms
        )?;
        writeln!(
            f,
            "  catch-up after the missing sequence: {:>9.0} ms ({:.0} messages/s)",
            self.catch_up_ms, self.catch_up_per_second
        )?;
        write!(
            f,
            "  consumer: {} messages fetched, {} nak'd",
            self.messages_fetched, self.nakd
        )
    }
}

pub async fn run(options: &FloodBenchOptions) -> Result<FloodReport, BenchError> {
    require_positive(&[options.early, options.batch], "early and batch")?;
    let nats = NatsServer::start(None)?;
    let context = jetstream::new(nats.connect().await?);
    let server = super::broker::consuming_server(&nats, options.synchronous, options.batch)?;
    let reader = open_reader(&server.database)?;
    let (flood, others) = flood_and_others(options.early);

    let started = Instant::now();
    let mut sent = std::collections::HashMap::new();
    for (chunk, other) in flood.chunks(options.early.div_ceil(OTHERS)).zip(&others) {
        sent.extend(
            super::broker::publish(&context, "ordered", &chunk.iter().collect::<Vec<_>>()).await?,
        );
        sent.extend(super::broker::publish(&context, "ordered", &[other]).await?);
    }
    let flood_published = started.elapsed();
    wait_for_last(&reader, OTHER, others.len() as i64).await?;
    let waits = latencies_between(
        &others
            .iter()
            .filter_map(|m| Some((m.message_id.clone(), *sent.get(&m.message_id)?)))
            .collect(),
        &applied_at_ms(&reader)?,
    );

    let missing = ledger_message(FLOODED, 1, 1);
    let catch_up_started = Instant::now();
    super::broker::publish(&context, "ordered", &[&missing]).await?;
    wait_for_last(&reader, FLOODED, options.early as i64 + 1).await?;
    let catch_up = catch_up_started.elapsed();
    drop(reader);

    let counters = super::broker::broker_counters(&server.address).await?;
    server.stop()?;
    Ok(FloodReport {
        early: options.early,
        batch: options.batch,
        synchronous: synchronous_flag(options.synchronous),
        flood_published_ms: flood_published.as_secs_f64() * 1000.0,
        other_p50_ms: percentile(&waits, 0.5),
        other_max_ms: max_ms(&waits),
        catch_up_ms: catch_up.as_secs_f64() * 1000.0,
        catch_up_per_second: (options.early + 1) as f64 / catch_up.as_secs_f64(),
        nakd: counters["nakd"].as_u64().unwrap_or(0),
        messages_fetched: counters["messages"].as_u64().unwrap_or(0),
    })
}

/// The flooded aggregate's sequences 2..=early+1, and the other aggregate's 1..=OTHERS.
fn flood_and_others(early: usize) -> (Vec<OrderedMessage>, Vec<OrderedMessage>) {
    let flood = (2..=early as i64 + 1)
        .map(|sequence| ledger_message(FLOODED, sequence, 1))
        .collect();
    let others = (1..=OTHERS as i64)
        .map(|sequence| ledger_message(OTHER, sequence, 1))
        .collect();
    (flood, others)
}

/// Waits (five minutes at most) until `aggregate` has applied through `last`.
async fn wait_for_last(reader: &Connection, aggregate: &str, last: i64) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let applied: i64 = reader.query_row(
            "SELECT COALESCE(MAX(last_sequence), 0) FROM aggregate_state WHERE aggregate_id = ?1",
            [aggregate],
            |row| row.get(0),
        )?;
        if applied >= last {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Verification(format!(
                "{aggregate}: applied through {applied} of {last} after five minutes"
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
