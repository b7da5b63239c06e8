//! What `bench retention` reads beside the gate's store, on its own connection: the store's size
//! while the load runs, and its rows once it stopped. The same statements on both backends, but
//! for the size: a SQLite file and its WAL, or PostgreSQL's tables with their indexes and TOAST.

use std::collections::HashMap;
use std::path::PathBuf;

use rusqlite::Connection;
use serde::Serialize;

use super::super::BenchError;
use super::super::database::open_reader;

/// Where a phase's store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A SQLite file (its WAL beside it).
    Sqlite(PathBuf),
    /// A PostgreSQL database, by URL.
    Postgres(String),
}

/// The store's size at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreSize {
    /// SQLite: the file and its WAL; PostgreSQL: the tables with their indexes and TOAST.
    pub bytes: u64,
    /// SQLite: the file alone.
    pub file_bytes: Option<u64>,
    /// SQLite: the WAL alone.
    pub wal_bytes: Option<u64>,
    /// SQLite: the pages in use, `(page_count - freelist_count) × page_size`.
    pub live_bytes: Option<u64>,
}

/// The rows a stopped store holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreRows {
    /// Applied identities (`ordered_inbox`).
    pub identities: u64,
    /// Output rows (`gate_output`).
    pub output: u64,
    /// Output rows not yet published.
    pub unpublished: u64,
    /// Timeline events (`aggregate_timeline`).
    pub timeline: u64,
    /// Messages still held.
    pub held: u64,
    /// Every aggregate's last applied sequence.
    #[serde(skip)]
    pub positions: HashMap<String, u64>,
}

/// Every table of the database's schema: the inbox's and the gate's.
const POSTGRES_SIZE: &str = "
SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0)::bigint
  FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE c.relkind = 'r' AND n.nspname = current_schema()";

const COUNTS: [&str; 5] = [
    "SELECT COUNT(*) FROM ordered_inbox",
    "SELECT COUNT(*) FROM gate_output",
    "SELECT COUNT(*) FROM gate_output WHERE published_at IS NULL",
    "SELECT COUNT(*) FROM aggregate_timeline",
    "SELECT COUNT(*) FROM held_messages",
];

const POSITIONS: &str = "SELECT aggregate_id, last_sequence FROM aggregate_state";

/// A connection of the bench's own to the store.
pub enum Probe {
    Sqlite {
        path: PathBuf,
        connection: Connection,
    },
    Postgres {
        client: tokio_postgres::Client,
    },
}

impl Probe {
    /// Connects to the store at `location` (which the gate's store created).
    pub async fn connect(location: &StoreLocation) -> Result<Probe, BenchError> {
        match location {
            StoreLocation::Sqlite(path) => Ok(Probe::Sqlite {
                path: path.clone(),
                connection: open_reader(path)?,
            }),
            StoreLocation::Postgres(url) => {
                let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
                    .await
                    .map_err(postgres_failure)?;
                tokio::spawn(connection);
                Ok(Probe::Postgres { client })
            }
        }
    }

    /// The store's size now.
    pub async fn size(&mut self) -> Result<StoreSize, BenchError> {
        match self {
            Probe::Sqlite { path, connection } => {
                let file = std::fs::metadata(&*path)?.len();
                let mut wal = path.as_os_str().to_owned();
                wal.push("-wal");
                let wal = std::fs::metadata(&wal).map(|meta| meta.len()).unwrap_or(0);
                let live: i64 = connection.query_row(
                    "SELECT (page_count - freelist_count) * page_size
                       FROM pragma_page_count(), pragma_freelist_count(), pragma_page_size()",
                    [],
                    |row| row.get(0),
                )?;
                Ok(StoreSize {
                    bytes: file + wal,
                    file_bytes: Some(file),
                    wal_bytes: Some(wal),
                    live_bytes: Some(u64::try_from(live).unwrap_or(0)),
                })
            }
            Probe::Postgres { client } => {
                let bytes: i64 = client
                    .query_one(POSTGRES_SIZE, &[])
                    .await
                    .map_err(postgres_failure)?
                    .try_get(0)
                    .map_err(postgres_failure)?;
                Ok(StoreSize {
                    bytes: u64::try_from(bytes).unwrap_or(0),
                    ..StoreSize::default()
                })
            }
        }
    }

    /// The rows the store holds (read once the load and the pruner stopped).
    pub async fn rows(&mut self) -> Result<StoreRows, BenchError> {
        let mut counts = [0u64; COUNTS.len()];
        let positions: Vec<(String, i64)> = match self {
            Probe::Sqlite { connection, .. } => {
                for (count, sql) in counts.iter_mut().zip(COUNTS) {
                    let rows: i64 = connection.query_row(sql, [], |row| row.get(0))?;
                    *count = u64::try_from(rows).unwrap_or(0);
                }
                connection
                    .prepare(POSITIONS)?
                    .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                    .collect::<rusqlite::Result<_>>()?
            }
            Probe::Postgres { client } => {
                for (count, sql) in counts.iter_mut().zip(COUNTS) {
                    let row = client.query_one(sql, &[]).await.map_err(postgres_failure)?;
                    let rows: i64 = row.try_get(0).map_err(postgres_failure)?;
                    *count = u64::try_from(rows).unwrap_or(0);
                }
                client
                    .query(POSITIONS, &[])
                    .await
                    .map_err(postgres_failure)?
                    .iter()
                    .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                    .collect::<Result<_, tokio_postgres::Error>>()
                    .map_err(postgres_failure)?
            }
        };
        let [identities, output, unpublished, timeline, held] = counts;
        Ok(StoreRows {
            identities,
            output,
            unpublished,
            timeline,
            held,
            positions: positions
                .into_iter()
                .map(|(aggregate, last)| (aggregate, u64::try_from(last).unwrap_or(0)))
                .collect(),
        })
    }
}

fn postgres_failure(error: tokio_postgres::Error) -> BenchError {
    BenchError::Verification(format!("postgres: {error}"))
}

/// What the gate's pruner counted (`store_pruned_rows_total{kind}` on its metrics page).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PrunedRows {
    pub identities: u64,
    pub output: u64,
    pub timeline: u64,
    pub dead_letters: u64,
}

impl PrunedRows {
    /// The counts on a Prometheus text page (zero for a kind it does not have).
    pub fn parse(page: &str) -> PrunedRows {
        let count = |kind: &str| {
            let prefix = format!("store_pruned_rows_total{{kind=\"{kind}\"}} ");
            page.lines()
                .find_map(|line| line.strip_prefix(&prefix))
                .and_then(|value| value.trim().parse::<f64>().ok())
                .map_or(0, |value| value as u64)
        };
        PrunedRows {
            identities: count("identities"),
            output: count("output"),
            timeline: count("timeline"),
            dead_letters: count("dead_letters"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pruned_counts_are_read_by_kind_from_the_metrics_page() {
        let page = "# TYPE store_pruned_rows_total counter\n\
                    store_pruned_rows_total{kind=\"identities\"} 1500\n\
                    store_pruned_rows_total{kind=\"timeline\"} 12\n\
                    store_pruned_rows_total{kind=\"output\"} 1499\n\
                    store_size_bytes 4096\n";
        assert_eq!(
            PrunedRows::parse(page),
            PrunedRows {
                identities: 1500,
                output: 1499,
                timeline: 12,
                dead_letters: 0,
            }
        );
        assert_eq!(PrunedRows::parse(""), PrunedRows::default());
    }
}
