//! What one load cost the bench's PostgreSQL, statement by statement: the cluster loads
//! `pg_stat_statements` ([`crate::pg::ClusterOptions::statement_statistics`]), and a probe
//! connection resets its counts and reads the WAL position before the load, then reads both
//! after it, for the load's own database.

use serde::Serialize;
use tokio_postgres::NoTls;

use super::BenchError;
use crate::pg::PrivateCluster;

/// How many statements the printed table shows (the JSON holds every one).
const PRINTED_STATEMENTS: usize = 10;

/// A connection to the cluster's `postgres` database that reads the statistics of the others.
pub struct ClusterProbe {
    client: tokio_postgres::Client,
    connection: tokio::task::JoinHandle<()>,
}

/// Where a load started: the WAL position when the statistics were reset.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    wal_position: i64,
}

/// What the cluster spent on one load, per message.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PostgresCost {
    /// Bytes the cluster's WAL advanced during the load (`pg_current_wal_lsn` before and after,
    /// every database's records and the full-page images a checkpoint forces included).
    pub wal_bytes_per_message: f64,
    /// The load database's statements, the costliest first.
    pub statements: Vec<StatementCost>,
}

/// One normalized statement of a load, as `pg_stat_statements` counted it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatementCost {
    /// The statement's text, whitespace collapsed, constants as `$n`.
    pub query: String,
    /// Sent by a client; `false` for one a function ran (the peer's PL/pgSQL body).
    pub top_level: bool,
    pub calls_per_message: f64,
    /// Execution time per message, in microseconds (a `COMMIT`'s includes its WAL flush).
    pub us_per_message: f64,
    /// Its execution time as a share of all the top-level statements' (a nested statement's
    /// time is also its function's).
    pub share: f64,
    pub rows_per_call: f64,
    pub wal_bytes_per_message: f64,
}

impl PostgresCost {
    /// The execution time of the load's top-level statements per message, in microseconds (a
    /// nested statement's time is already its function's).
    pub fn top_level_us_per_message(&self) -> f64 {
        self.statements
            .iter()
            .filter(|statement| statement.top_level)
            .map(|statement| statement.us_per_message)
            .sum()
    }
}

impl ClusterProbe {
    /// Connects to the cluster's `postgres` database and creates the extension's view there.
    pub async fn connect(cluster: &PrivateCluster) -> Result<ClusterProbe, BenchError> {
        let failed = |error: tokio_postgres::Error| {
            BenchError::Startup(format!("the statement statistics: {error}"))
        };
        let (client, connection) = tokio_postgres::connect(&cluster.url("postgres"), NoTls)
            .await
            .map_err(failed)?;
        let connection = tokio::spawn(async move {
            // An error ends the connection; the probe's next query reports it.
            let _ = connection.await;
        });
        client
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await
            .map_err(failed)?;
        Ok(ClusterProbe { client, connection })
    }

    /// Resets the statement statistics and reads the WAL position: call right before a load.
    pub async fn mark(&self) -> Result<Mark, BenchError> {
        self.client
            .execute("SELECT pg_stat_statements_reset()", &[])
            .await
            .map_err(probe_failed)?;
        Ok(Mark {
            wal_position: self.wal_position().await?,
        })
    }

    /// What the cluster spent since `mark` on `messages` messages, the statements those of
    /// `database`.
    pub async fn since(
        &self,
        mark: Mark,
        database: &str,
        messages: u64,
    ) -> Result<PostgresCost, BenchError> {
        let wal = self.wal_position().await? - mark.wal_position;
        let rows = self
            .client
            .query(
                "SELECT s.query, s.toplevel, s.calls, s.total_exec_time, s.rows,
                        s.wal_bytes::float8
                   FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
                  WHERE d.datname = $1
                  ORDER BY s.total_exec_time DESC",
                &[&database],
            )
            .await
            .map_err(probe_failed)?;
        let per_message = |value: f64| value / messages.max(1) as f64;
        let mut statements = Vec::with_capacity(rows.len());
        for row in rows {
            let query: String = row.try_get(0).map_err(probe_failed)?;
            let calls: i64 = row.try_get(2).map_err(probe_failed)?;
            let milliseconds: f64 = row.try_get(3).map_err(probe_failed)?;
            let returned: i64 = row.try_get(4).map_err(probe_failed)?;
            let wal_bytes: f64 = row.try_get(5).map_err(probe_failed)?;
            statements.push(StatementCost {
                query: query.split_whitespace().collect::<Vec<_>>().join(" "),
                top_level: row.try_get(1).map_err(probe_failed)?,
                calls_per_message: per_message(calls as f64),
                us_per_message: per_message(milliseconds * 1000.0),
                share: 0.0,
                rows_per_call: returned as f64 / calls.max(1) as f64,
                wal_bytes_per_message: per_message(wal_bytes),
            });
        }
        let mut cost = PostgresCost {
            wal_bytes_per_message: per_message(wal as f64),
            statements,
        };
        let top_level = cost.top_level_us_per_message();
        if top_level > 0.0 {
            for statement in &mut cost.statements {
                statement.share = statement.us_per_message / top_level;
            }
        }
        Ok(cost)
    }

    async fn wal_position(&self) -> Result<i64, BenchError> {
        let row = self
            .client
            .query_one(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint",
                &[],
            )
            .await
            .map_err(probe_failed)?;
        row.try_get(0).map_err(probe_failed)
    }
}

impl Drop for ClusterProbe {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

fn probe_failed(error: tokio_postgres::Error) -> BenchError {
    BenchError::Verification(format!("the statement statistics: {error}"))
}

impl std::fmt::Display for PostgresCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "           WAL per message: {:.0} B; statements (share of execution time, µs/msg, calls/msg, rows/call, WAL B/msg):",
            self.wal_bytes_per_message
        )?;
        for statement in self.statements.iter().take(PRINTED_STATEMENTS) {
            write!(
                f,
                "\n           {:>5.1}% {:>6.1} µs {:>6.3} {:>6.1} {:>6.0} B  {}{}",
                statement.share * 100.0,
                statement.us_per_message,
                statement.calls_per_message,
                statement.rows_per_call,
                statement.wal_bytes_per_message,
                if statement.top_level { "" } else { "(nested) " },
                shortened(&statement.query, 90),
            )?;
        }
        Ok(())
    }
}

/// `text` cut to at most `limit` characters, an ellipsis marking the cut.
fn shortened(text: &str, limit: usize) -> String {
    if text.chars().count() <= limit {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(limit - 1).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_statement_is_cut_with_an_ellipsis_and_a_short_one_is_kept() {
        assert_eq!(shortened("COMMIT", 90), "COMMIT");
        let long = "SELECT ".repeat(30);
        let cut = shortened(&long, 20);
        assert_eq!(cut.chars().count(), 20);
        assert!(cut.ends_with('…'));
    }
}
