//! `bench relay`: server A (the general outbox), server B (`serve --nats`, the ordered inbox)
//! and a private nats-server, all child processes; N events over M aggregates are written to
//! A's outbox by concurrent writers (each aggregate in sequence order) while 1 (then 2)
//! `production-lab relay` processes move them to JetStream and B applies them. Measured per run:
//! events per second from the first outbox write to the last inbox COMMIT, and each event's
//! latency from its outbox row (`created_at_ms`, stamped in A's transaction) to its inbox row
//! (`applied_at`, stamped in B's committing transaction). Then the same with the events written
//! first and the relays started afterwards (a backlog): the relays' own rate, from their start
//! to the last inbox COMMIT (latency there is mostly waiting, so it is not printed). Every run is
//! verified: B's aggregates end at the right last sequence and total with one row per event,
//! A's outbox is all sent.
//!
//! Last, on A alone, the latency of `POST /outbox/leases` while many events are pending behind
//! live leases, and for comparison with only the events it hands out pending (`lease`).

mod lease;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::database::{
    applied_at_ms, latencies_between, open_reader, verify_end_state, wait_until_applied,
};
use super::{
    AggregateStream, BenchError, interleaved, max_ms, percentile, require_positive, workload,
};
use crate::nats::NatsServer;
use crate::progress::Progress;
use crate::server::{ServerUnderTest, Synchronous, terminate};

pub use lease::{LeaseLatency, OUTBOX_MAX_BATCH, OUTBOX_MIN_LEASE_MS};

#[derive(Debug, Clone)]
pub struct RelayBenchOptions {
    pub aggregates: usize,
    pub messages: usize,
    /// Concurrent writers of the outbox.
    pub writers: usize,
    /// Events per lease.
    pub batch: usize,
    /// The lease-latency phase: pending events in all, and how many of them are under live leases.
    pub lease_pending: usize,
    pub lease_held: usize,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RelayRun {
    pub relays: usize,
    /// `live`: written while the relays run (the latency is meaningful); `backlog`: everything
    /// written first, then the relays started (the relays' own rate; latency includes the wait).
    pub mode: &'static str,
    pub written_per_second: f64,
    pub end_to_end_per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub broker_duplicates: u64,
    pub fenced_acks: u64,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RelayReport {
    pub aggregates: usize,
    pub messages: usize,
    pub writers: usize,
    pub batch: usize,
    pub runs: Vec<RelayRun>,
    pub lease: LeaseLatency,
}

impl std::fmt::Display for RelayReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench relay: {} events over {} aggregates, {} outbox writers, lease batch {}",
            self.messages, self.aggregates, self.writers, self.batch
        )?;
        for run in &self.runs {
            if run.mode == "backlog" {
                writeln!(
                    f,
                    "  {} relay(s), backlog: relays started -> last inbox COMMIT {:>7.0} events/s; broker duplicates {}, fenced acks {}",
                    run.relays, run.end_to_end_per_second, run.broker_duplicates, run.fenced_acks
                )?;
            } else {
                writeln!(
                    f,
                    "  {} relay(s), live:    written {:>5.0}/s, first outbox write -> last inbox COMMIT {:>5.0} events/s; outbox row -> inbox COMMIT ms p50 {:.1} p99 {:.1} max {:.1}; broker duplicates {}, fenced acks {}",
                    run.relays,
                    run.written_per_second,
                    run.end_to_end_per_second,
                    run.p50_ms,
                    run.p99_ms,
                    run.max_ms,
                    run.broker_duplicates,
                    run.fenced_acks
                )?;
            }
        }
        let lease = &self.lease;
        writeln!(
            f,
            "  lease latency: POST /outbox/leases {{max {}}} with {} pending, {} under live leases and {} waiting behind them, {} eligible (all handed out each time): ms p50 {:.2} p99 {:.2} over {} leases; with only the {} eligible pending: p50 {:.2} p99 {:.2}",
            lease.max,
            lease.pending,
            lease.held,
            lease.blocked,
            lease.eligible,
            lease.p50_ms,
            lease.p99_ms,
            lease.samples,
            lease.eligible,
            lease.alone_p50_ms,
            lease.alone_p99_ms
        )?;
        Ok(())
    }
}

pub async fn run(options: &RelayBenchOptions) -> Result<RelayReport, BenchError> {
    require_positive(
        &[options.aggregates, options.messages, options.writers],
        "aggregates, messages and writers",
    )?;
    let layout = lease::LeaseLayout::new(options.lease_pending, options.lease_held)?;
    let mut runs = Vec::new();
    for backlog in [false, true] {
        for relays in [1, 2] {
            runs.push(one_run(options, relays, backlog).await?);
        }
    }
    let lease = lease::lease_latency(&layout, options.writers).await?;
    Ok(RelayReport {
        aggregates: options.aggregates,
        messages: options.messages,
        writers: options.writers,
        batch: options.batch,
        runs,
        lease,
    })
}

/// Records the streams' events in A's outbox (`POST /outbox/events`, each message's id as the
/// event key) with `writers` concurrent clients: writer `k` writes the streams `k`,
/// `k + writers` …, interleaved, each in sequence order, as a service writes one aggregate's
/// changes one after another.
async fn write_events(
    http: &reqwest::Client,
    base: &str,
    streams: &[AggregateStream],
    writers: usize,
) -> Result<(), BenchError> {
    let mut tasks = Vec::new();
    for writer in 0..writers.max(1) {
        let mine: Vec<AggregateStream> = streams
            .iter()
            .skip(writer)
            .step_by(writers.max(1))
            .cloned()
            .collect();
        let http = http.clone();
        let url = format!("{base}/outbox/events");
        tasks.push(tokio::spawn(async move {
            for message in interleaved(&mine) {
                let body = serde_json::json!({
                    "eventKey": message.message_id,
                    "aggregateId": message.aggregate_id,
                    "sequence": message.sequence,
                    "amount": crate::bench::amount(message),
                });
                let status = http.post(&url).json(&body).send().await?.status();
                if status.as_u16() != 201 {
                    return Err(BenchError::Verification(format!(
                        "POST /outbox/events answered {status}"
                    )));
                }
            }
            Ok::<_, BenchError>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| BenchError::task("a writer", e))??;
    }
    Ok(())
}

/// A relay child process, stopped with SIGTERM; its last stdout line is its report.
struct RelayProcess {
    child: Child,
}

impl RelayProcess {
    fn stop(mut self) -> Result<String, BenchError> {
        terminate(&mut self.child, Duration::from_secs(15))?;
        let mut text = String::new();
        if let Some(mut stdout) = self.child.stdout.take() {
            std::io::Read::read_to_string(&mut stdout, &mut text)?;
        }
        Ok(text)
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The number after `label ` in a relay's report line (`published N, broker-reported duplicates
/// N, acked N, fenced acks N, …`), if the line has one.
pub fn report_figure(report: &str, label: &str) -> Option<u64> {
    report
        .split(label)
        .nth(1)
        .and_then(|rest| rest.trim_start().split([',', ' ']).next())
        .and_then(|number| number.parse().ok())
}

/// `relays` processes of `production-lab relay` (the running binary) from `outbox` to `nats`.
fn spawn_relays(
    relays: usize,
    outbox: &str,
    nats: &str,
    batch: usize,
) -> Result<Vec<RelayProcess>, BenchError> {
    let mut processes = Vec::new();
    for index in 0..relays {
        let child = Command::new(std::env::current_exe()?)
            .args(["relay", "--base", outbox, "--nats", nats])
            .args(["--owner", &format!("bench-{index}")])
            .args(["--batch", &batch.to_string()])
            .env_remove("LAB_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        processes.push(RelayProcess { child });
    }
    Ok(processes)
}

/// Stops the relays; the broker's duplicates and the fenced acks they reported, summed (0 for a
/// relay killed before its report).
fn stop_relays(processes: Vec<RelayProcess>) -> Result<(u64, u64), BenchError> {
    let (mut duplicates, mut fenced) = (0, 0);
    for process in processes {
        let report = process.stop()?;
        duplicates += report_figure(&report, "broker-reported duplicates").unwrap_or(0);
        fenced += report_figure(&report, "fenced acks").unwrap_or(0);
    }
    Ok((duplicates, fenced))
}

/// When each event of A's stopped outbox was recorded (epoch ms, by event key); every event must
/// be sent.
fn outbox_created_at(database: &Path) -> Result<HashMap<String, i64>, BenchError> {
    let source = rusqlite::Connection::open(database)?;
    let pending: i64 = source.query_row(
        "SELECT COUNT(*) FROM general_outbox WHERE status <> 'sent'",
        [],
        |row| row.get(0),
    )?;
    if pending != 0 {
        return Err(BenchError::Verification(format!(
            "{pending} outbox events are not sent"
        )));
    }
    Ok(source
        .prepare("SELECT event_key, created_at_ms FROM general_outbox")?
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?)
}

/// The processes of one run: the nats-server, B consuming from it, A holding the outbox.
struct RelayRig {
    nats: NatsServer,
    consumer: ServerUnderTest,
    outbox: ServerUnderTest,
}

impl RelayRig {
    fn start(writers: usize, relays: usize) -> Result<RelayRig, BenchError> {
        let nats = NatsServer::start(None)?;
        let consumer = ServerUnderTest::start_with(
            Synchronous::Full,
            1,
            &["--nats".to_owned(), nats.url.clone()],
        )?;
        let outbox = ServerUnderTest::start(Synchronous::Full, writers + relays)?;
        Ok(RelayRig {
            nats,
            consumer,
            outbox,
        })
    }

    fn spawn_relays(&self, relays: usize, batch: usize) -> Result<Vec<RelayProcess>, BenchError> {
        spawn_relays(relays, &self.outbox.address, &self.nats.url, batch)
    }
}

/// One run: the events written to A, `relays` relays started before (live) or after (backlog)
/// the writing, until B applied every event; then the relays, A and B stopped and verified.
async fn one_run(
    options: &RelayBenchOptions,
    relays: usize,
    backlog: bool,
) -> Result<RelayRun, BenchError> {
    let streams = workload(options.aggregates, options.messages);
    let rig = RelayRig::start(options.writers, relays)?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let mode = if backlog { "backlog" } else { "live" };
    let mut processes = if backlog {
        Vec::new()
    } else {
        rig.spawn_relays(relays, options.batch)?
    };
    let progress = Progress::start(
        &format!("bench relay ({relays} relay(s), {mode}): applied at B"),
        options.messages as u64,
        "events",
    );
    let mut started = Instant::now();
    write_events(&http, &rig.outbox.address, &streams, options.writers).await?;
    let written = started.elapsed();
    if backlog {
        started = Instant::now();
        processes = rig.spawn_relays(relays, options.batch)?;
    }
    let reader = open_reader(&rig.consumer.database)?;
    let target = options.messages as i64;
    wait_until_applied(&reader, target, &progress.counter(), " at B").await?;
    let elapsed = started.elapsed();
    progress.finish();
    let applied = applied_at_ms(&reader)?;
    drop(reader);
    let (broker_duplicates, fenced_acks) = stop_relays(processes)?;
    let created = outbox_created_at(&rig.outbox.stop()?.database)?;
    let latencies = latencies_between(&created, &applied);
    verify_end_state(&rig.consumer.stop()?.database, &streams)?;
    drop(rig.nats);
    Ok(RelayRun {
        relays,
        mode,
        written_per_second: options.messages as f64 / written.as_secs_f64(),
        end_to_end_per_second: options.messages as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: max_ms(&latencies),
        broker_duplicates,
        fenced_acks,
    })
}

#[cfg(test)]
mod tests {
    use super::report_figure;

    #[test]
    fn the_relay_report_line_gives_its_figures() {
        let line = "published 3200, broker-reported duplicates 5, acked 3200, fenced acks 2, unpublished 0 in 13 batches";
        assert_eq!(report_figure(line, "broker-reported duplicates"), Some(5));
        assert_eq!(report_figure(line, "fenced acks"), Some(2));
        assert_eq!(report_figure(line, "published"), Some(3200));
        assert_eq!(report_figure("killed", "fenced acks"), None);
    }
}
