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
        Ok(())
    }
}

pub async fn run(options: &RelayBenchOptions) -> Result<RelayReport, BenchError> {
    if options.aggregates == 0 || options.messages == 0 || options.writers == 0 {
        return Err(BenchError::Verification(
            "aggregates, messages and writers must be positive".to_owned(),
        ));
    }
    let mut runs = Vec::new();
    for backlog in [false, true] {
        for relays in [1, 2] {
            runs.push(one_run(options, relays, backlog).await?);
        }
    }
    Ok(RelayReport {
        aggregates: options.aggregates,
        messages: options.messages,
        writers: options.writers,
        batch: options.batch,
        runs,
    })
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
    use super::figure;

    #[test]
    fn the_relay_report_line_gives_its_figures() {
        let line = "published 3200, broker-reported duplicates 5, acked 3200, fenced acks 2, unpublished 0 in 13 batches";
        assert_eq!(figure(line, "broker-reported duplicates"), 5);
        assert_eq!(figure(line, "fenced acks"), 2);
        assert_eq!(figure(line, "published"), 3200);
    }
}
