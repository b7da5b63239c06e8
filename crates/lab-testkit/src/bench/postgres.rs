//! `bench ordered --backend postgres`: a private PostgreSQL ([`crate::pg`], durable: `fsync`
//! on), the same load through one server and through two server processes on one database, the
//! end state verified through the PostgreSQL inbox, and the figures printed next to the SQLite
//! server's, measured in the same run on the same load, and as a ratio to the PL/pgSQL peer
//! ([`super::peer`]) run on the same cluster in the same run.
//!
//! A third PostgreSQL load runs one server at twice the clients, so that its groups are about
//! twice as large: the two one-server loads then split PostgreSQL's CPU per message into a part
//! per group and a part per delivery ([`GroupCost`]).

use std::time::Duration;

use ordered_inbox::Limits;
use serde::Serialize;

use super::database::{expect_stream_state, verify_end_state};
use super::ordered::{OrderedOptions, http_load};
use super::peer::{PeerFigures, run_peer};
use super::statements::{ClusterProbe, PostgresCost};
use super::{AggregateStream, BenchError, max_ms, percentile, require_positive, workload};
use crate::pg::{ClusterOptions, PrivateCluster, find_bindir};
use crate::process::{cpu_us_per_message, ticks_since};
use crate::server::{PostgresFigures, ServerUnderTest, synchronous_flag};

/// The figures of one HTTP load.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadFigures {
    /// Where the ordered inbox was: `sqlite` or `postgres`.
    pub store: &'static str,
    pub servers: usize,
    /// Concurrent HTTP clients across the servers.
    pub clients: usize,
    pub messages_per_second: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Each server's peak resident set.
    pub server_peak_rss_mib: Vec<f64>,
    /// PostgreSQL only: database round trips per inbox operation, as the servers counted them.
    pub round_trips_per_message: Option<f64>,
    /// PostgreSQL only: attempts retried after a serialization failure, deadlock or unique
    /// violation.
    pub retries: Option<u64>,
    /// CPU time the server processes spent per message, in microseconds (user + system).
    pub server_cpu_us_per_message: Option<f64>,
    /// PostgreSQL only: CPU time the database's processes spent per message, in microseconds.
    pub postgres_cpu_us_per_message: Option<f64>,
    /// PostgreSQL only: deliveries per transaction the servers' group commits committed.
    pub deliveries_per_commit: Option<f64>,
    /// PostgreSQL only: groups replayed one delivery at a time.
    pub replays: Option<u64>,
    /// PostgreSQL only: throughput as a multiple of the PL/pgSQL peer's.
    pub ratio_to_peer: Option<f64>,
    /// PostgreSQL only: its CPU per message as a multiple of its CPU per peer transaction.
    pub postgres_cpu_to_peer: Option<f64>,
    /// PostgreSQL only: WAL and statements per message.
    pub postgres_cost: Option<PostgresCost>,
}

impl std::fmt::Display for LoadFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rss: Vec<String> = self
            .server_peak_rss_mib
            .iter()
            .map(|mib| format!("{mib:.1}"))
            .collect();
        write!(
            f,
            "  {:<8} {} server{}, {:>3} clients: {:>8.0} msg/s   p50 {:.2}  p95 {:.2}  p99 {:.2}  max {:.2} ms   peak RSS {} MiB",
            self.store,
            self.servers,
            if self.servers == 1 { " " } else { "s" },
            self.clients,
            self.messages_per_second,
            self.p50_ms,
            self.p95_ms,
            self.p99_ms,
            self.max_ms,
            rss.join(" + "),
        )?;
        if let (Some(trips), Some(retries)) = (self.round_trips_per_message, self.retries) {
            write!(f, "   {trips:.2} round trips/msg, {retries} retries")?;
        }
        if let Some(grouped) = self.deliveries_per_commit {
            write!(f, ", {grouped:.1} deliveries/commit")?;
        }
        if let Some(replays) = self.replays {
            write!(f, ", {replays} replays")?;
        }
        if let Some(ratio) = self.ratio_to_peer {
            write!(f, "   {ratio:.2}x the peer")?;
        }
        if let Some(server) = self.server_cpu_us_per_message {
            write!(f, "\n           CPU per message: server {server:.0} µs")?;
            if let Some(postgres) = self.postgres_cpu_us_per_message {
                write!(f, ", PostgreSQL {postgres:.0} µs")?;
            }
            if let Some(ratio) = self.postgres_cpu_to_peer {
                write!(f, " ({ratio:.2}x the peer's per transaction)")?;
            }
        }
        if let Some(cost) = &self.postgres_cost {
            write!(f, "\n{cost}")?;
        }
        Ok(())
    }
}

/// `bench ordered --backend postgres`: the same load on SQLite, on PostgreSQL through one
/// server, and on PostgreSQL through two server processes.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PostgresReport {
    pub aggregates: usize,
    pub messages: usize,
    pub concurrency: usize,
    /// The SQLite server's `synchronous`; PostgreSQL runs with `fsync` on.
    pub synchronous: &'static str,
    pub postgres_bindir: String,
    /// The PL/pgSQL peer on the same cluster.
    pub peer: PeerFigures,
    pub runs: Vec<LoadFigures>,
    /// PostgreSQL's CPU per message split into a part per group and a part per delivery, from
    /// the two one-server loads; `None` when their groups were too alike to tell them apart.
    pub group_cost: Option<GroupCost>,
}

/// PostgreSQL's CPU per message read as `per_group / deliveries per commit + per_delivery`,
/// the line through the two one-server loads (one at the bench's clients, one at twice as
/// many, whose groups are larger). The same split of the statements' execution time tells how
/// much of each part is inside a statement; the rest is the protocol around the statements,
/// the commit and the cluster's background work.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupCost {
    pub smaller_group: f64,
    pub larger_group: f64,
    pub per_group_us: f64,
    pub per_delivery_us: f64,
    pub statements_per_group_us: f64,
    pub statements_per_delivery_us: f64,
    /// The part per delivery as a multiple of PostgreSQL's CPU per peer transaction.
    pub per_delivery_to_peer: Option<f64>,
}

/// One one-server load's point for [`GroupCost::fit`]: deliveries per commit, PostgreSQL's CPU
/// per message, and its statements' execution time per message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupPoint {
    pub deliveries_per_commit: f64,
    pub cpu_us: f64,
    pub statements_us: f64,
}

impl GroupPoint {
    /// The point of a PostgreSQL load, when it counted its groups, CPU and statements.
    fn of(load: &LoadFigures) -> Option<GroupPoint> {
        Some(GroupPoint {
            deliveries_per_commit: load.deliveries_per_commit?,
            cpu_us: load.postgres_cpu_us_per_message?,
            statements_us: load.postgres_cost.as_ref()?.top_level_us_per_message(),
        })
    }
}

impl GroupCost {
    /// Groups closer in size than this (in deliveries) give no split worth printing: the line
    /// through two nearly equal points is mostly the runs' noise.
    const MIN_SPREAD: f64 = 2.0;

    /// The line through two loads whose groups differ in size; `None` when they do not.
    pub fn fit(a: GroupPoint, b: GroupPoint, peer_cpu_us: Option<f64>) -> Option<GroupCost> {
        let (small, large) = if a.deliveries_per_commit <= b.deliveries_per_commit {
            (a, b)
        } else {
            (b, a)
        };
        if large.deliveries_per_commit - small.deliveries_per_commit < Self::MIN_SPREAD
            || small.deliveries_per_commit <= 0.0
        {
            return None;
        }
        let spread = 1.0 / small.deliveries_per_commit - 1.0 / large.deliveries_per_commit;
        let per_group = |small: f64, large: f64| (small - large) / spread;
        let per_group_us = per_group(small.cpu_us, large.cpu_us);
        let statements_per_group_us = per_group(small.statements_us, large.statements_us);
        let per_delivery_us = small.cpu_us - per_group_us / small.deliveries_per_commit;
        Some(GroupCost {
            smaller_group: small.deliveries_per_commit,
            larger_group: large.deliveries_per_commit,
            per_group_us,
            per_delivery_us,
            statements_per_group_us,
            statements_per_delivery_us: small.statements_us
                - statements_per_group_us / small.deliveries_per_commit,
            per_delivery_to_peer: peer_cpu_us
                .filter(|peer| *peer > 0.0)
                .map(|peer| per_delivery_us / peer),
        })
    }
}

impl std::fmt::Display for GroupCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "  PostgreSQL CPU per message, split by the one-server loads (groups of {:.1} and {:.1}): {:.0} µs per group (statements {:.0} µs) + {:.1} µs per delivery (statements {:.1} µs)",
            self.smaller_group,
            self.larger_group,
            self.per_group_us,
            self.statements_per_group_us,
            self.per_delivery_us,
            self.statements_per_delivery_us,
        )?;
        if let Some(ratio) = self.per_delivery_to_peer {
            write!(
                f,
                "; the part per delivery is {ratio:.2}x the peer's per transaction"
            )?;
        }
        Ok(())
    }
}

impl std::fmt::Display for PostgresReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench ordered --backend postgres: {} messages over {} aggregates, {} concurrent clients (SQLite synchronous={}, PostgreSQL fsync=on, {})",
            self.messages,
            self.aggregates,
            self.concurrency,
            self.synchronous,
            self.postgres_bindir
        )?;
        let lines: Vec<String> = self.runs.iter().map(ToString::to_string).collect();
        writeln!(f, "{}", lines.join("\n"))?;
        match &self.group_cost {
            Some(split) => writeln!(f, "{split}")?,
            None => writeln!(
                f,
                "  PostgreSQL CPU per message, split: the one-server loads' groups were too alike"
            )?,
        }
        write!(f, "{}", self.peer)
    }
}

/// Runs the load on SQLite, then on PostgreSQL through one and through two servers, verifying
/// each end state.
pub async fn ordered_postgres(options: &OrderedOptions) -> Result<PostgresReport, BenchError> {
    require_positive(
        &[options.aggregates, options.messages, options.concurrency],
        "aggregates, messages and concurrency",
    )?;
    let streams = workload(options.aggregates, options.messages);
    let mut runs = vec![sqlite_run(options, &streams).await?];
    let cluster = PrivateCluster::start(ClusterOptions::durable())
        .map_err(|error| BenchError::Startup(format!("a private PostgreSQL: {error}")))?;
    let probe = ClusterProbe::connect(&cluster).await?;
    let peer = run_peer(&cluster, &probe, options.concurrency).await?;
    let doubled = options.concurrency.saturating_mul(2);
    for (run, servers, clients) in [
        (1usize, 1usize, options.concurrency),
        (2, 2, options.concurrency),
        (3, 1, doubled),
    ] {
        let database = format!("bench_{run}");
        let url = cluster
            .create_database(&database)
            .map_err(|error| BenchError::Startup(format!("a database: {error}")))?;
        let load = PostgresLoad {
            cluster: &cluster,
            probe: &probe,
            database: &database,
            url: &url,
        };
        let mut figures = postgres_run(&load, servers, clients, options, &streams).await?;
        figures.ratio_to_peer = Some(figures.messages_per_second / peer.transactions_per_second);
        figures.postgres_cpu_to_peer = figures
            .postgres_cpu_us_per_message
            .zip(peer.postgres_cpu_us_per_message)
            .map(|(inbox, peer)| inbox / peer);
        runs.push(figures);
        verify_postgres_end_state(&url, &streams).await?;
    }
    drop(probe);
    drop(cluster);
    let one_server: Vec<GroupPoint> = runs
        .iter()
        .filter(|load| load.store == "postgres" && load.servers == 1)
        .filter_map(GroupPoint::of)
        .collect();
    let group_cost = match one_server.as_slice() {
        [at_clients, at_double] => {
            GroupCost::fit(*at_clients, *at_double, peer.postgres_cpu_us_per_message)
        }
        _ => None,
    };
    Ok(PostgresReport {
        aggregates: options.aggregates,
        messages: options.messages,
        concurrency: options.concurrency,
        synchronous: synchronous_flag(options.synchronous),
        postgres_bindir: find_bindir()
            .map(|dir| dir.display().to_string())
            .unwrap_or_default(),
        peer,
        runs,
        group_cost,
    })
}

/// The load through one SQLite server, its end state verified.
async fn sqlite_run(
    options: &OrderedOptions,
    streams: &[AggregateStream],
) -> Result<LoadFigures, BenchError> {
    let server = ServerUnderTest::start(options.synchronous, options.concurrency)?;
    let cpu_before = server.cpu_ticks();
    let addresses = std::slice::from_ref(&server.address);
    let (elapsed, latencies) = http_load(
        "bench ordered: HTTP to 1 server(s)",
        addresses,
        streams,
        options.concurrency,
    )
    .await?;
    let server_ticks = ticks_since(server.cpu_ticks(), cpu_before);
    let rss = vec![server.peak_rss_kib()];
    let stopped = server.stop()?;
    verify_end_state(&stopped.database, streams)?;
    let mut sqlite = figures(
        "sqlite",
        options.messages,
        options.concurrency,
        elapsed,
        &latencies,
        rss,
    );
    sqlite.server_cpu_us_per_message = cpu_us_per_message(server_ticks, options.messages);
    Ok(sqlite)
}

/// Where a PostgreSQL load runs: the cluster, its probe, the database's name and URL.
struct PostgresLoad<'a> {
    cluster: &'a PrivateCluster,
    probe: &'a ClusterProbe,
    database: &'a str,
    url: &'a str,
}

/// The load of `clients` clients through `servers` servers on the load's database, with their
/// CPU and the cluster's, its WAL and statements, and the round trips and retries the servers
/// counted.
async fn postgres_run(
    load: &PostgresLoad<'_>,
    servers: usize,
    clients: usize,
    options: &OrderedOptions,
    streams: &[AggregateStream],
) -> Result<LoadFigures, BenchError> {
    let (cluster, url) = (load.cluster, load.url);
    let extra = ["--inbox".to_owned(), url.to_owned()];
    let started: Vec<ServerUnderTest> = (0..servers)
        .map(|_| ServerUnderTest::start_with(options.synchronous, clients, &extra))
        .collect::<Result<_, _>>()?;
    let addresses: Vec<String> = started.iter().map(|s| s.address.clone()).collect();
    let mark = load.probe.mark().await?;
    let servers_before = servers_cpu_ticks(&started);
    let postgres_before = cluster.cpu_ticks();
    let label = format!("bench ordered: HTTP to {servers} server(s), {clients} clients");
    let (elapsed, latencies) = http_load(&label, &addresses, streams, clients).await?;
    // Read before the servers stop: their connections' backends are still alive.
    let postgres_ticks = ticks_since(cluster.cpu_ticks(), postgres_before);
    let server_ticks = ticks_since(servers_cpu_ticks(&started), servers_before);
    let rss = started.iter().map(ServerUnderTest::peak_rss_kib).collect();
    let mut run = figures(
        "postgres",
        options.messages,
        clients,
        elapsed,
        &latencies,
        rss,
    );
    run.server_cpu_us_per_message = cpu_us_per_message(server_ticks, options.messages);
    run.postgres_cpu_us_per_message = cpu_us_per_message(postgres_ticks, options.messages);
    let messages = u64::try_from(options.messages).unwrap_or(u64::MAX);
    run.postgres_cost = Some(load.probe.since(mark, load.database, messages).await?);
    let counted = stop_and_count(started)?;
    if counted.operations > 0 {
        run.round_trips_per_message = Some(counted.round_trips as f64 / counted.operations as f64);
        run.retries = Some(counted.retries);
    }
    if counted.group_commits > 0 {
        run.deliveries_per_commit =
            Some(counted.grouped_deliveries as f64 / counted.group_commits as f64);
        run.replays = Some(counted.replays);
    }
    Ok(run)
}

/// Stops the servers and adds up the figures each printed for its PostgreSQL inbox.
fn stop_and_count(servers: Vec<ServerUnderTest>) -> Result<PostgresFigures, BenchError> {
    let mut sum = PostgresFigures::default();
    for server in servers {
        if let Some(figures) = server.stop()?.postgres_figures() {
            sum.operations += figures.operations;
            sum.round_trips += figures.round_trips;
            sum.retries += figures.retries;
            sum.group_commits += figures.group_commits;
            sum.grouped_deliveries += figures.grouped_deliveries;
            sum.replays += figures.replays;
        }
    }
    Ok(sum)
}

/// The sum of the servers' CPU ticks, or `None` when any is unknown.
fn servers_cpu_ticks(servers: &[ServerUnderTest]) -> Option<u64> {
    servers.iter().map(ServerUnderTest::cpu_ticks).sum()
}

/// A load's figures from its duration, its answers' latencies and its servers' peak RSS.
fn figures(
    store: &'static str,
    messages: usize,
    clients: usize,
    elapsed: Duration,
    latencies: &[Duration],
    rss_kib: Vec<Option<u64>>,
) -> LoadFigures {
    LoadFigures {
        store,
        servers: rss_kib.len(),
        clients,
        messages_per_second: messages as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(latencies, 0.50),
        p95_ms: percentile(latencies, 0.95),
        p99_ms: percentile(latencies, 0.99),
        max_ms: max_ms(latencies),
        server_peak_rss_mib: rss_kib
            .into_iter()
            .map(|kib| kib.unwrap_or(0) as f64 / 1024.0)
            .collect(),
        round_trips_per_message: None,
        retries: None,
        server_cpu_us_per_message: None,
        postgres_cpu_us_per_message: None,
        deliveries_per_commit: None,
        replays: None,
        ratio_to_peer: None,
        postgres_cpu_to_peer: None,
        postgres_cost: None,
    }
}

/// Every aggregate's last, total and applied rows in PostgreSQL are exactly what was sent: the
/// same documented rows [`verify_end_state`] reads in a SQLite file.
async fn verify_postgres_end_state(
    url: &str,
    streams: &[AggregateStream],
) -> Result<(), BenchError> {
    let failed = |error: &dyn std::fmt::Display| BenchError::Verification(error.to_string());
    let inbox = ordered_inbox::postgres::PostgresInbox::connect(url, Limits::default())
        .await
        .map_err(|error| failed(&error))?;
    let client = inbox.pool().get().await.map_err(|error| failed(&error))?;
    for stream in streams {
        let aggregate_id = stream.aggregate_id.as_str();
        let state = client
            .query_opt(
                "SELECT last_sequence, total FROM aggregate_state WHERE aggregate_id = $1",
                &[&aggregate_id],
            )
            .await
            .map_err(|error| failed(&error))?
            .ok_or_else(|| BenchError::Verification(format!("{aggregate_id}: no state row")))?;
        let applied = client
            .query_one(
                "SELECT COUNT(*), COALESCE(SUM((payload::jsonb ->> 'Amount')::bigint), 0)::bigint
                   FROM ordered_inbox WHERE aggregate_id = $1",
                &[&aggregate_id],
            )
            .await
            .map_err(|error| failed(&error))?;
        let (last, total): (i64, i64) = (
            state.try_get(0).map_err(|error| failed(&error))?,
            state.try_get(1).map_err(|error| failed(&error))?,
        );
        let (rows, sum): (i64, i64) = (
            applied.try_get(0).map_err(|error| failed(&error))?,
            applied.try_get(1).map_err(|error| failed(&error))?,
        );
        expect_stream_state(stream, last, total, rows, sum)?;
    }
    drop(client);
    inbox.close();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(deliveries_per_commit: f64, per_group: f64, per_delivery: f64) -> GroupPoint {
        GroupPoint {
            deliveries_per_commit,
            cpu_us: per_group / deliveries_per_commit + per_delivery,
            statements_us: per_group / 4.0 / deliveries_per_commit + per_delivery / 2.0,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn two_group_sizes_split_the_cpu_into_a_part_per_group_and_a_part_per_delivery() {
        let split = GroupCost::fit(
            point(31.5, 440.0, 27.0),
            point(16.0, 440.0, 27.0),
            Some(90.0),
        )
        .expect("groups of 16 and 31.5 are far enough apart");
        assert!(close(split.smaller_group, 16.0) && close(split.larger_group, 31.5));
        assert!(close(split.per_group_us, 440.0), "{split:?}");
        assert!(close(split.per_delivery_us, 27.0), "{split:?}");
        assert!(close(split.statements_per_group_us, 110.0), "{split:?}");
        assert!(close(split.statements_per_delivery_us, 13.5), "{split:?}");
        assert!(
            close(split.per_delivery_to_peer.unwrap_or(0.0), 0.3),
            "{split:?}"
        );
    }

    #[test]
    fn groups_of_nearly_one_size_give_no_split() {
        let alike = GroupCost::fit(point(16.0, 440.0, 27.0), point(17.0, 300.0, 35.0), None);
        assert_eq!(alike, None);
    }
}
