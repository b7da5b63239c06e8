//! `production-lab bench relay`: server A (the general outbox), server B (`serve --nats`, the
//! ordered inbox) and a private nats-server, all child processes; N events over M aggregates are
//! written to A's outbox by concurrent writers (each aggregate in sequence order) while 1 (then
//! 2) `production-lab relay` processes move them to JetStream and B applies them. Measured per
//! run: events per second from the first outbox write to the last inbox COMMIT, and each event's
//! latency from its outbox row (`created_at_ms`, stamped in A's transaction) to its inbox row
//! (`applied_at`, stamped in B's committing transaction). Then the same with the events written
//! first and the relays started afterwards (a backlog): the relays' own rate, from their start to
//! the last inbox COMMIT (latency there is mostly waiting, so it is not printed). Every run is
//! verified: B's aggregates end at the right last sequence and total with one row per event, A's
//! outbox is all sent.
//!
//! Last, on A alone, the latency of `POST /outbox/leases` while many events are pending behind
//! live leases, and for comparison with only the events it hands out pending ([`lease_latency`]).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use crate::bench::{BenchError, ServerUnderTest, percentile, verify_end_state, workload};
use crate::broker::bench::{applied_at_ms, wait_until_applied};
use crate::broker::server::NatsServer;
use crate::config::Synchronous;

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

/// `POST /outbox/leases` on an outbox where `pending` events wait, `held` of them under live
/// leases, each the first pending event of its aggregate with `blocked` more behind it (sorted
/// before the `eligible` ones, so a lease that read every pending row in order would read them all
/// first). Every timed lease asks for `max` and must get exactly the `eligible` events.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseLatency {
    pub pending: usize,
    pub held: usize,
    pub blocked: usize,
    pub eligible: usize,
    pub max: usize,
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// The same leases on an outbox holding only the eligible events.
    pub alone_p50_ms: f64,
    pub alone_p99_ms: f64,
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
    if options.aggregates == 0 || options.messages == 0 || options.writers == 0 {
        return Err(BenchError::Verification(
            "aggregates, messages and writers must be positive".to_owned(),
        ));
    }
    let layout = LeaseLayout::new(options.lease_pending, options.lease_held)?;
    let mut runs = Vec::new();
    for backlog in [false, true] {
        for relays in [1, 2] {
            runs.push(one_run(options, relays, backlog).await?);
        }
    }
    let lease = lease_latency(&layout, options.writers).await?;
    Ok(RelayReport {
        aggregates: options.aggregates,
        messages: options.messages,
        writers: options.writers,
        batch: options.batch,
        runs,
        lease,
    })
}

/// The largest lease, and the events it finds eligible each time.
const LEASE_MAX: usize = crate::labs::outbox::MAX_BATCH as usize;
/// Timed leases per outbox; each waits out its own 100 ms lease before the next.
const LEASE_SAMPLES: usize = 200;
const LEASE_PROBE_MS: i64 = crate::labs::outbox::MIN_LEASE_MS;
/// Eligible events per aggregate.
const ELIGIBLE_PER_AGGREGATE: usize = 10;

/// How the lease-latency phase lays out its pending events: `held` aggregates `held-NNNNN` whose
/// first event is leased for ten minutes, with the `blocked` rest spread behind them, then the
/// `eligible` events over `ready-NNNNN` aggregates (which sort after them).
#[derive(Debug, Clone)]
struct LeaseLayout {
    pending: usize,
    held: usize,
    blocked: usize,
    eligible: usize,
}

impl LeaseLayout {
    fn new(pending: usize, held: usize) -> Result<LeaseLayout, BenchError> {
        let eligible = LEASE_MAX;
        if held == 0 || pending < held + eligible {
            return Err(BenchError::Verification(format!(
                "the lease phase needs at least one held event and at least {eligible} pending events besides the held ones (got --lease-pending {pending}, --lease-held {held})"
            )));
        }
        Ok(LeaseLayout {
            pending,
            held,
            blocked: pending - held - eligible,
            eligible,
        })
    }

    fn held_aggregate(index: usize) -> String {
        format!("held-{index:05}")
    }

    /// Each held aggregate's events after its first: sequences 2 ..= 1 + its share of `blocked`.
    fn blocked_streams(&self) -> Vec<(String, std::ops::RangeInclusive<u64>)> {
        (0..self.held)
            .map(|index| {
                let share =
                    self.blocked / self.held + usize::from(index < self.blocked % self.held);
                (Self::held_aggregate(index), 2..=1 + share as u64)
            })
            .collect()
    }

    fn eligible_streams(&self) -> Vec<(String, std::ops::RangeInclusive<u64>)> {
        (0..self.eligible.div_ceil(ELIGIBLE_PER_AGGREGATE))
            .map(|index| {
                let count =
                    ELIGIBLE_PER_AGGREGATE.min(self.eligible - index * ELIGIBLE_PER_AGGREGATE);
                (format!("ready-{index:05}"), 1..=count as u64)
            })
            .collect()
    }
}

/// Records each stream's sequences in order, the streams spread over `writers` concurrent
/// clients.
async fn record_streams(
    http: &reqwest::Client,
    base: &str,
    streams: Vec<(String, std::ops::RangeInclusive<u64>)>,
    writers: usize,
) -> Result<(), BenchError> {
    let mut tasks = Vec::new();
    for writer in 0..writers.max(1) {
        let mine: Vec<_> = streams
            .iter()
            .skip(writer)
            .step_by(writers.max(1))
            .cloned()
            .collect();
        let http = http.clone();
        let url = format!("{base}/outbox/events");
        tasks.push(tokio::spawn(async move {
            for (aggregate, sequences) in mine {
                for sequence in sequences {
                    let body = json!({
                        "eventKey": format!("{aggregate}-{sequence}"),
                        "aggregateId": aggregate,
                        "sequence": sequence,
                        "amount": 1,
                    });
                    let status = http.post(&url).json(&body).send().await?.status();
                    if status.as_u16() != 201 {
                        return Err(BenchError::Verification(format!(
                            "POST /outbox/events answered {status}"
                        )));
                    }
                }
            }
            Ok::<_, BenchError>(())
        }));
    }
    for task in tasks {
        task.await
            .map_err(|error| BenchError::Verification(format!("a writer failed: {error}")))??;
    }
    Ok(())
}

/// One `POST /outbox/leases`: the events it handed out and when their lease ends.
async fn lease(
    http: &reqwest::Client,
    base: &str,
    owner: &str,
    max: usize,
    lease_ms: i64,
) -> Result<(usize, i64), BenchError> {
    let response = http
        .post(format!("{base}/outbox/leases"))
        .json(&json!({"owner": owner, "max": max, "leaseMs": lease_ms}))
        .send()
        .await?;
    let status = response.status();
    let body: serde_json::Value = response.json().await?;
    if status.as_u16() != 200 {
        return Err(BenchError::Verification(format!(
            "POST /outbox/leases answered {status}: {body}"
        )));
    }
    let events = body["events"].as_array().map_or(0, Vec::len);
    let until = body["leaseUntilMs"].as_i64().unwrap_or(0);
    Ok((events, until))
}

fn unix_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)
        })
}

/// The lease-latency phase: [`timed_leases`] on the layout, then on an outbox holding only its
/// eligible events (nothing held, nothing blocked) for comparison.
async fn lease_latency(layout: &LeaseLayout, writers: usize) -> Result<LeaseLatency, BenchError> {
    let behind = timed_leases(layout, writers, true).await?;
    let alone = timed_leases(layout, writers, false).await?;
    Ok(LeaseLatency {
        pending: layout.pending,
        held: layout.held,
        blocked: layout.blocked,
        eligible: layout.eligible,
        max: LEASE_MAX,
        samples: behind.len(),
        p50_ms: percentile(&behind, 0.50),
        p99_ms: percentile(&behind, 0.99),
        alone_p50_ms: percentile(&alone, 0.50),
        alone_p99_ms: percentile(&alone, 0.99),
    })
}

/// On a fresh A: with `held`, the layout's events (the held aggregates' first events first,
/// leased for ten minutes, then the rest), else only its eligible ones; then [`LEASE_SAMPLES`]
/// timed leases of [`LEASE_MAX`] for 100 ms each, one at a time, each after the previous one's
/// lease ended, so that every one meets the same outbox and must hand out exactly the eligible
/// events. The latencies, sorted.
async fn timed_leases(
    layout: &LeaseLayout,
    writers: usize,
    held: bool,
) -> Result<Vec<Duration>, BenchError> {
    let outbox = ServerUnderTest::start(Synchronous::Full, writers)?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let base = outbox.address.clone();
    if held {
        hold_first_events(&http, &base, layout, writers).await?;
        record_streams(&http, &base, layout.blocked_streams(), writers).await?;
    }
    record_streams(&http, &base, layout.eligible_streams(), writers).await?;

    let what = if held {
        "behind live leases"
    } else {
        "with nothing held"
    };
    let progress = crate::progress::Progress::start(
        &format!("bench relay: POST /outbox/leases {what}"),
        LEASE_SAMPLES as u64,
        "leases",
    );
    let counter = progress.counter();
    let mut latencies = Vec::with_capacity(LEASE_SAMPLES);
    for _ in 0..LEASE_SAMPLES {
        let started = Instant::now();
        let (events, until) = lease(&http, &base, "probe", LEASE_MAX, LEASE_PROBE_MS).await?;
        latencies.push(started.elapsed());
        if events != layout.eligible {
            return Err(BenchError::Verification(format!(
                "a lease {what} handed out {events} events, not the {} eligible ones",
                layout.eligible
            )));
        }
        counter.add(1);
        // A lease ending exactly now has ended: wait until the clock the server reads is past it.
        let left = until.saturating_sub(unix_millis()).saturating_add(1);
        tokio::time::sleep(Duration::from_millis(u64::try_from(left).unwrap_or(0))).await;
    }
    progress.finish();
    outbox.stop()?;
    latencies.sort_unstable();
    Ok(latencies)
}

/// Records the held aggregates' first events and leases them to `holder` for ten minutes.
async fn hold_first_events(
    http: &reqwest::Client,
    base: &str,
    layout: &LeaseLayout,
    writers: usize,
) -> Result<(), BenchError> {
    let heads = (0..layout.held)
        .map(|index| (LeaseLayout::held_aggregate(index), 1..=1))
        .collect();
    record_streams(http, base, heads, writers).await?;
    let mut held = 0;
    while held < layout.held {
        let (events, _) = lease(http, base, "holder", LEASE_MAX, 600_000).await?;
        if events == 0 {
            return Err(BenchError::Verification(format!(
                "only {held} of {} first events could be held",
                layout.held
            )));
        }
        held += events;
    }
    Ok(())
}

/// A relay child process, stopped with SIGTERM; its last stdout line is its report.
struct RelayProcess {
    child: Child,
}

impl RelayProcess {
    fn stop(mut self) -> Result<String, BenchError> {
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

/// The number after `label ` in a relay's report line, if the line has one.
pub fn report_figure(report: &str, label: &str) -> Option<u64> {
    report
        .split(label)
        .nth(1)
        .and_then(|rest| rest.trim_start().split([',', ' ']).next())
        .and_then(|number| number.parse().ok())
}

/// [`report_figure`], 0 when the line lacks it (a relay killed before its report).
fn figure(report: &str, label: &str) -> u64 {
    report_figure(report, label).unwrap_or(0)
}

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

async fn one_run(
    options: &RelayBenchOptions,
    relays: usize,
    backlog: bool,
) -> Result<RelayRun, BenchError> {
    let streams = workload(options.aggregates, options.messages);
    let nats = NatsServer::start(None)?;
    let consumer = ServerUnderTest::start_with(
        Synchronous::Full,
        1,
        &["--nats".to_owned(), nats.url.clone()],
    )?;
    let outbox = ServerUnderTest::start(Synchronous::Full, options.writers + relays)?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let mode = if backlog { "backlog" } else { "live" };
    let mut processes = if backlog {
        Vec::new()
    } else {
        spawn_relays(relays, &outbox.address, &nats.url, options.batch)?
    };
    let progress = crate::progress::Progress::start(
        &format!("bench relay ({relays} relay(s), {mode}): applied at B"),
        options.messages as u64,
        "events",
    );
    let counter = progress.counter();
    let started = Instant::now();
    // Writer k writes the aggregates k, k + writers, …, each in sequence order, as a service
    // writes one aggregate's changes one after another.
    let mut writers = Vec::new();
    for writer in 0..options.writers {
        let mine: Vec<_> = streams
            .iter()
            .skip(writer)
            .step_by(options.writers)
            .cloned()
            .collect();
        let http = http.clone();
        let url = format!("{}/outbox/events", outbox.address);
        writers.push(tokio::spawn(async move {
            let longest = mine.iter().map(|s| s.messages.len()).max().unwrap_or(0);
            for position in 0..longest {
                for stream in &mine {
                    let Some(message) = stream.messages.get(position) else {
                        continue;
                    };
                    let status = http
                        .post(&url)
                        .json(&json!({
                            "eventKey": message.message_id,
                            "aggregateId": message.aggregate_id,
                            "sequence": message.sequence,
                            "amount": message.amount,
                        }))
                        .send()
                        .await?
                        .status();
                    if status.as_u16() != 201 {
                        return Err(BenchError::Verification(format!(
                            "POST /outbox/events answered {status}"
                        )));
                    }
                }
            }
            Ok::<_, BenchError>(())
        }));
    }
    for writer in writers {
        writer
            .await
            .map_err(|error| BenchError::Verification(format!("a writer failed: {error}")))??;
    }
    let written = started.elapsed();
    let started = if backlog {
        let relay_started = Instant::now();
        processes = spawn_relays(relays, &outbox.address, &nats.url, options.batch)?;
        relay_started
    } else {
        started
    };
    let reader = rusqlite::Connection::open_with_flags(
        &consumer.database,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )?;
    reader.busy_timeout(Duration::from_secs(5))?;
    wait_until_applied(&reader, options.messages as i64, &counter, " at B").await?;
    let elapsed = started.elapsed();
    progress.finish();

    let applied = applied_at_ms(&reader)?;
    drop(reader);
    let mut duplicates = 0;
    let mut fenced = 0;
    for process in processes {
        let report = process.stop()?;
        duplicates += figure(&report, "broker-reported duplicates");
        fenced += figure(&report, "fenced acks");
    }
    let outbox = outbox.stop()?;
    let source = rusqlite::Connection::open(&outbox.database)?;
    let (pending, created): (i64, HashMap<String, i64>) = {
        let pending = source.query_row(
            "SELECT COUNT(*) FROM general_outbox WHERE status <> 'sent'",
            [],
            |row| row.get(0),
        )?;
        let created = source
            .prepare("SELECT event_key, created_at_ms FROM general_outbox")?
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        (pending, created)
    };
    if pending != 0 {
        return Err(BenchError::Verification(format!(
            "{pending} outbox events are not sent"
        )));
    }
    let mut latencies: Vec<Duration> = created
        .iter()
        .filter_map(|(key, created)| {
            let at = applied.get(key)?;
            Some(Duration::from_millis(
                u64::try_from(at - created).unwrap_or(0),
            ))
        })
        .collect();
    latencies.sort_unstable();
    let consumer = consumer.stop()?;
    verify_end_state(&consumer.database, &streams)?;
    drop(nats);
    Ok(RelayRun {
        relays,
        mode,
        written_per_second: options.messages as f64 / written.as_secs_f64(),
        end_to_end_per_second: options.messages as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        broker_duplicates: duplicates,
        fenced_acks: fenced,
    })
}

#[cfg(test)]
mod tests {
    use super::{LEASE_MAX, LeaseLayout, figure};

    fn events(streams: &[(String, std::ops::RangeInclusive<u64>)]) -> usize {
        streams
            .iter()
            .map(|(_, sequences)| sequences.clone().count())
            .sum()
    }

    #[test]
    fn the_lease_layout_holds_exactly_the_pending_events_asked_for() {
        let layout = LeaseLayout::new(20_000, 1_000).expect("a layout");
        assert_eq!((layout.blocked, layout.eligible), (18_000, LEASE_MAX));
        let blocked = layout.blocked_streams();
        assert_eq!((blocked.len(), events(&blocked)), (1_000, 18_000));
        assert_eq!(events(&layout.eligible_streams()), LEASE_MAX);
        // An uneven share: the first aggregates take one more.
        let uneven = LeaseLayout::new(LEASE_MAX + 3 + 5, 3).expect("a layout");
        let shares: Vec<usize> = uneven
            .blocked_streams()
            .iter()
            .map(|(_, sequences)| sequences.clone().count())
            .collect();
        assert_eq!(shares, [2, 2, 1]);
        assert!(
            LeaseLayout::new(LEASE_MAX, 1).is_err(),
            "too few for the eligible ones"
        );
        assert!(LeaseLayout::new(20_000, 0).is_err(), "nothing held");
    }

    #[test]
    fn the_relay_report_line_gives_its_figures() {
        let line = "published 3200, broker-reported duplicates 5, acked 3200, fenced acks 2, unpublished 0 in 13 batches";
        assert_eq!(figure(line, "broker-reported duplicates"), 5);
        assert_eq!(figure(line, "fenced acks"), 2);
        assert_eq!(figure(line, "published"), 3200);
    }
}
