//! The PL/pgSQL peer of `bench ordered --backend postgres`: the same apply written as one
//! server-side function call per message, driven by `pgbench -M prepared` on the same private
//! PostgreSQL in the same run, so that the backend's throughput reads as a ratio to what
//! PostgreSQL does with one commit per message and no server in between.
//!
//! The function runs on the inbox's own tables (migrated by the library): it reads the
//! aggregate's row (locked) and the message id, inserts the inbox row, and updates the
//! position and the total, one transaction per call with `synchronous_commit` on. Each pgbench
//! client owns one aggregate (`:client_id`) and applies its next sequence, so every call
//! applies; the end state is checked (every aggregate's last sequence equals its rows).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use ordered_inbox::Limits;
use ordered_inbox::postgres::PostgresInbox;
use serde::Serialize;

use super::BenchError;
use super::statements::{ClusterProbe, PostgresCost};
use crate::pg::{PrivateCluster, SUPERUSER};
use crate::process::{cpu_us_per_message, ticks_since};

/// How long pgbench runs.
pub const PEER_SECONDS: u32 = 10;

/// How long pgbench's backends may take to end after it exits (an autovacuum worker that
/// started during the load counts too: the wait is for the postmaster's children before it).
const BACKENDS_ENDING: Duration = Duration::from_secs(10);

/// The apply, one call per message: the aggregate's row and the id read, the inbox row
/// inserted, the position and the total written.
const PEER_FUNCTION: &str = r#"
CREATE FUNCTION peer_apply(client integer, amount bigint) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    aggregate text := 'peer-' || client;
    last bigint;
    next bigint;
    id text;
    at text := to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"');
BEGIN
    SELECT last_sequence INTO last FROM aggregate_state WHERE aggregate_id = aggregate FOR UPDATE;
    next := COALESCE(last, 0) + 1;
    id := aggregate || '-' || next;
    IF EXISTS (SELECT 1 FROM ordered_inbox WHERE producer = '' AND message_id = id) THEN
        RETURN 'replay';
    END IF;
    INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, applied_at, producer)
    VALUES (id, json_build_object('AggregateId', aggregate, 'Sequence', next, 'Amount', amount)::text,
            aggregate, next, at, '');
    INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
    VALUES (aggregate, next, amount, 'flowing', at)
    ON CONFLICT (aggregate_id) DO UPDATE SET
        last_sequence = excluded.last_sequence,
        total = aggregate_state.total + excluded.total;
    RETURN 'applied';
END $$;
"#;

const PEER_SCRIPT: &str = "\\set amount random(1, 100)\nSELECT peer_apply(:client_id, :amount);\n";

/// What the peer did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerFigures {
    pub clients: usize,
    pub seconds: u32,
    pub transactions: u64,
    pub transactions_per_second: f64,
    /// CPU time the database's processes spent per transaction, in microseconds.
    pub postgres_cpu_us_per_message: Option<f64>,
    /// WAL and statements per transaction.
    pub postgres_cost: PostgresCost,
}

impl std::fmt::Display for PeerFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "  peer     pgbench -M prepared -c {} -j 2 -T {}, one PL/pgSQL call per message: {:>8.0} tx/s",
            self.clients, self.seconds, self.transactions_per_second
        )?;
        if let Some(postgres) = self.postgres_cpu_us_per_message {
            write!(
                f,
                "\n           CPU per message: PostgreSQL {postgres:.0} µs"
            )?;
        }
        write!(f, "\n{}", self.postgres_cost)
    }
}

/// Runs the peer on a fresh database of `cluster` with `clients` pgbench clients, what it cost
/// the cluster read through `probe`.
pub async fn run_peer(
    cluster: &PrivateCluster,
    probe: &ClusterProbe,
    clients: usize,
) -> Result<PeerFigures, BenchError> {
    let startup = |what: &str, error: &dyn std::fmt::Display| {
        BenchError::Startup(format!("the PL/pgSQL peer: {what}: {error}"))
    };
    let url = cluster
        .create_database("bench_peer")
        .map_err(|error| startup("a database", &error))?;
    let inbox = PostgresInbox::connect(&url, Limits::default())
        .await
        .map_err(|error| startup("the inbox's tables", &error))?;
    {
        let client = inbox
            .pool()
            .get()
            .await
            .map_err(|e| startup("a connection", &e))?;
        client
            .batch_execute(PEER_FUNCTION)
            .await
            .map_err(|error| startup("its function", &error))?;
    }
    let script = tempfile::Builder::new()
        .prefix("peer-")
        .suffix(".sql")
        .tempfile()
        .map_err(|error| startup("its script", &error))?;
    std::fs::write(script.path(), PEER_SCRIPT).map_err(|error| startup("its script", &error))?;
    let mark = probe.mark().await?;
    let children = cluster.child_count();
    let before = cluster.cpu_ticks();
    let output = pgbench(cluster, clients, script.path())?;
    // pgbench's backends end as it exits; read once they are reaped, or their CPU is missed.
    if let Some(children) = children
        && !cluster.wait_for_children(children, BACKENDS_ENDING)
    {
        return Err(BenchError::Verification(format!(
            "pgbench's backends were still running {BACKENDS_ENDING:?} after it exited"
        )));
    }
    let postgres_ticks = ticks_since(cluster.cpu_ticks(), before);
    let (transactions, transactions_per_second) = pgbench_figures(&output)?;
    let postgres_cost = probe.since(mark, "bench_peer", transactions).await?;
    verify_peer(&inbox, transactions).await?;
    inbox.close();
    Ok(PeerFigures {
        clients,
        seconds: PEER_SECONDS,
        transactions,
        transactions_per_second,
        postgres_cpu_us_per_message: cpu_us_per_message(
            postgres_ticks,
            usize::try_from(transactions).unwrap_or(usize::MAX),
        ),
        postgres_cost,
    })
}

/// `pgbench -n -M prepared -c CLIENTS -j 2 -T SECONDS -f SCRIPT`, its standard output.
fn pgbench(cluster: &PrivateCluster, clients: usize, script: &Path) -> Result<String, BenchError> {
    let binary = pgbench_binary(cluster.bindir());
    let output = Command::new(&binary)
        .args(["-n", "-M", "prepared", "-j", "2"])
        .args(["-c", &clients.to_string(), "-T", &PEER_SECONDS.to_string()])
        .args(["-h", "127.0.0.1", "-p", &cluster.port().to_string(), "-U", SUPERUSER])
        .arg("-f")
        .arg(script)
        .arg("bench_peer")
        .stdin(Stdio::null())
        .output()
        .map_err(|error| {
            BenchError::Startup(format!(
                "{} (Debian package postgresql, or postgresql-client for /usr/bin/pgbench): {error}",
                binary.display()
            ))
        })?;
    if !output.status.success() {
        return Err(BenchError::Startup(format!(
            "pgbench failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The cluster's own pgbench, else the one on the path.
fn pgbench_binary(bindir: &Path) -> std::path::PathBuf {
    let own = bindir.join("pgbench");
    if own.exists() { own } else { "pgbench".into() }
}

/// The transactions processed and the rate without the connection time, from pgbench's report.
fn pgbench_figures(output: &str) -> Result<(u64, f64), BenchError> {
    let value = |prefix: &str| {
        output
            .lines()
            .find_map(|line| line.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned)
    };
    let transactions = value("number of transactions actually processed:")
        .and_then(|text| text.split('/').next()?.parse().ok());
    let rate = value("tps =").and_then(|text| text.parse().ok());
    match (transactions, rate) {
        (Some(transactions), Some(rate)) => Ok((transactions, rate)),
        _ => Err(BenchError::Verification(format!(
            "pgbench's report without its figures: {output}"
        ))),
    }
}

/// Every call applied: as many inbox rows as transactions, each aggregate's last sequence its
/// number of rows.
async fn verify_peer(inbox: &PostgresInbox, transactions: u64) -> Result<(), BenchError> {
    let failed = |error: &dyn std::fmt::Display| BenchError::Verification(format!("peer: {error}"));
    let client = inbox.pool().get().await.map_err(|error| failed(&error))?;
    let row = client
        .query_one(
            "SELECT (SELECT COUNT(*) FROM ordered_inbox),
                    (SELECT COALESCE(SUM(last_sequence), 0)::bigint FROM aggregate_state),
                    (SELECT COUNT(*) FROM aggregate_state a WHERE last_sequence <>
                        (SELECT COUNT(*) FROM ordered_inbox o WHERE o.aggregate_id = a.aggregate_id))",
            &[],
        )
        .await
        .map_err(|error| failed(&error))?;
    let (rows, positions, wrong): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    let expected = i64::try_from(transactions).unwrap_or(i64::MAX);
    if rows != expected || positions != expected || wrong != 0 {
        return Err(BenchError::Verification(format!(
            "peer: {transactions} transactions, {rows} rows, positions summing to {positions}, {wrong} aggregates off"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgbench_figures_are_read_from_its_report() {
        let report = "transaction type: peer.sql\nnumber of clients: 32\n\
number of transactions actually processed: 101234\nlatency average = 3.1 ms\n\
initial connection time = 20.5 ms\ntps = 10123.456789 (without initial connection time)\n";
        assert_eq!(pgbench_figures(report).unwrap(), (101_234, 10_123.456_789));
        assert!(pgbench_figures("pgbench: error").is_err());
    }
}
