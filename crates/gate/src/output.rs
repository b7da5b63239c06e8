//! The gate's output: an outbox in the inbox's own database. The handler's `apply` writes one
//! row per applied message into `gate_output` inside the inbox's transaction, so a message is
//! applied and its output row exists together or not at all; the publisher relays the rows not
//! yet published, and the applied feed reads them back in sequence order.
//!
//! `payload` holds the inner payload's canonical JSON (the envelope's `payload`, not the
//! envelope), `applied_at` the inbox's clock format, `published_at` stays NULL until JetStream
//! acknowledged the row. A partial index of the unpublished rows keeps the publisher's read of
//! them as short as its answer.

use std::sync::Arc;

use ordered_inbox::postgres::PostgresInbox;
use ordered_inbox::sqlite::{Store, StoreError};
use rusqlite::Connection;
use serde::Serialize;
use serde_json::Value;
use tokio_postgres::types::Type;

/// The most rows one read answers.
pub const MAX_LIMIT: usize = 1000;

/// The most rows of one aggregate one read of the pending rows answers.
pub const PENDING_PER_AGGREGATE: usize = 16;

/// What [`OutputStore::pending`] runs on SQLite (`?1`: the limit): at most
/// [`PENDING_PER_AGGREGATE`] rows of each aggregate, so that a round spans many aggregates,
/// which the publisher sends at once, rather than the first aggregates' whole backlogs, which
/// it must send one acknowledgement after another. Every step is an index seek on the
/// unpublished rows: the next aggregate with any (a recursive walk that stops after `limit`
/// aggregates), then that aggregate's rows up to its 16th, so an aggregate's backlog behind
/// them is never read (numbering every unpublished row, as a window function does, read the
/// whole backlog at every round). `CROSS JOIN` keeps the walk the outer loop and `INDEXED BY`
/// keeps both reads of rows on the partial index: without them SQLite may scan every
/// unpublished row for the join, or an aggregate's published history for its 16th row. The
/// final limit is written `+?1`, an expression: SQLite plans with a bare `?1`'s value there, and
/// prepares such a statement again whenever `?1` is bound again, which is at every round.
pub const PENDING_SQLITE: &str = "
WITH RECURSIVE pending_aggregate(id, n) AS (
    SELECT (SELECT aggregate_id FROM gate_output WHERE published_at IS NULL
             ORDER BY aggregate_id LIMIT 1), 1
    UNION ALL
    SELECT (SELECT aggregate_id FROM gate_output
             WHERE published_at IS NULL AND aggregate_id > pending_aggregate.id
             ORDER BY aggregate_id LIMIT 1), n + 1
      FROM pending_aggregate WHERE id IS NOT NULL AND n < ?1
)
SELECT o.aggregate_id, o.sequence, o.message_id, o.message_type, o.payload, o.applied_at
  FROM pending_aggregate a CROSS JOIN gate_output o INDEXED BY gate_output_unpublished
 WHERE o.aggregate_id = a.id AND o.published_at IS NULL
   AND o.sequence <= COALESCE(
           (SELECT g.sequence FROM gate_output g INDEXED BY gate_output_unpublished
             WHERE g.aggregate_id = a.id AND g.published_at IS NULL
             ORDER BY g.sequence LIMIT 1 OFFSET 15),
           9223372036854775807)
 ORDER BY o.aggregate_id, o.sequence LIMIT +?1";

/// [`PENDING_SQLITE`] on PostgreSQL (`$1`: the limit), each aggregate's rows in a `LATERAL`
/// read of its first 16.
pub const PENDING_POSTGRES: &str = "
WITH RECURSIVE pending_aggregate(id, n) AS (
    SELECT (SELECT aggregate_id FROM gate_output WHERE published_at IS NULL
             ORDER BY aggregate_id LIMIT 1), 1::bigint
    UNION ALL
    SELECT (SELECT aggregate_id FROM gate_output
             WHERE published_at IS NULL AND aggregate_id > pending_aggregate.id
             ORDER BY aggregate_id LIMIT 1), n + 1
      FROM pending_aggregate WHERE id IS NOT NULL AND n < $1
)
SELECT o.aggregate_id, o.sequence, o.message_id, o.message_type, o.payload, o.applied_at
  FROM pending_aggregate a CROSS JOIN LATERAL (
       SELECT * FROM gate_output
        WHERE aggregate_id = a.id AND published_at IS NULL
        ORDER BY sequence LIMIT 16) o
 ORDER BY o.aggregate_id, o.sequence LIMIT $1";

/// Marks the rows `($1[i], $2[i])` published at `$3`; a row already marked keeps its first
/// time. The statement does not say `published_at IS NULL`: that condition lets PostgreSQL
/// answer the join from the partial index of the waiting rows, reading every waiting row for
/// each round (a hash join), or for each marked row when its statistics said that no row
/// waited (a nested loop: 6.7 s for a round of 1,000 behind 22,000 waiting rows). Without it
/// the primary key answers, one seek per row.
pub const MARK_POSTGRES: &str = "UPDATE gate_output
    SET published_at = COALESCE(published_at, $3)
   FROM unnest($1::text[], $2::bigint[]) AS m(a, s)
  WHERE aggregate_id = m.a AND sequence = m.s";

/// How long a round's marks wait on SQLite for the inbox's next batch to share its commit:
/// they touch the pages the batch writes (each aggregate's newest rows), so that together
/// they write them once, and a round's marks need no commit and sync of their own. The
/// publisher waits for them before its next read, so an idle gate's next round starts up to
/// this much later.
pub const MARK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(5);

/// The most unpublished rows [`OutputStore::backlog`] counts: past it the count reads "this
/// many or more", so that a scrape never reads a whole backlog.
pub const BACKLOG_COUNT_CAP: i64 = 10_000;

/// [`OutputStore::backlog`]'s count (`$1`: the cap, `+$1` for the reason [`PENDING_SQLITE`]
/// gives), never past the cap. The order makes the
/// partial index `gate_output_waiting_age` the plan on both backends: a scan of the table
/// stopping at the cap would still read every published row it met on the way.
///
/// That index's condition adds `applied_at > ''`, true of every row, which only the reads by
/// age name, so that no other read can use the index. With `published_at IS NULL` alone,
/// PostgreSQL took it for [`PENDING_POSTGRES`]'s seeks whenever its statistics said that no row
/// waited (the table swings between all published and a backlog faster than `ANALYZE` follows),
/// and sorted every waiting row at each step of the walk: seconds a read behind 25,000 rows.
pub const BACKLOG_COUNT: &str = "SELECT COUNT(*) FROM (SELECT 1 FROM gate_output
  WHERE published_at IS NULL AND applied_at > '' ORDER BY applied_at LIMIT +$1) AS bounded";

/// The oldest unpublished row's `applied_at`: the first entry of the partial index
/// `gate_output_waiting_age`, one seek on both backends.
pub const OLDEST_UNPUBLISHED: &str = "SELECT applied_at FROM gate_output
  WHERE published_at IS NULL AND applied_at > '' ORDER BY applied_at LIMIT 1";

/// What [`OutputStore::prune`] runs on SQLite (`?1`: the cut-off time, `?2`: the batch): at
/// most a batch of published rows applied before the cut-off, the oldest first, read from the
/// partial index `gate_output_published_age`; answers each row deleted. `+?2`, as in
/// [`PENDING_SQLITE`], keeps it prepared once.
pub const PRUNE_SQLITE: &str = "DELETE FROM gate_output
  WHERE (aggregate_id, sequence) IN (
        SELECT aggregate_id, sequence FROM gate_output
         WHERE published_at IS NOT NULL AND applied_at < ?1
         ORDER BY applied_at LIMIT +?2)
 RETURNING aggregate_id, sequence";

/// [`PRUNE_SQLITE`] on PostgreSQL (`$1`, `$2`), which also records per aggregate the highest
/// sequence it deleted in `gate_output_pruned` and answers the rows deleted.
pub const PRUNE_POSTGRES: &str = "WITH gone AS (
     DELETE FROM gate_output
      WHERE (aggregate_id, sequence) IN (
            SELECT aggregate_id, sequence FROM gate_output
             WHERE published_at IS NOT NULL AND applied_at < $1
             ORDER BY applied_at LIMIT $2)
     RETURNING aggregate_id, sequence),
 highest AS (
     INSERT INTO gate_output_pruned(aggregate_id, through)
     SELECT aggregate_id, MAX(sequence) FROM gone GROUP BY aggregate_id
     ON CONFLICT (aggregate_id) DO UPDATE
        SET through = GREATEST(gate_output_pruned.through, EXCLUDED.through))
 SELECT COUNT(*) FROM gone";

/// The tables on SQLite, beside the inbox's: the output, and the one row of the publisher's
/// lease ([`crate::lease`]). Idempotent.
const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS gate_output(
    aggregate_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    message_id TEXT NOT NULL,
    message_type TEXT NOT NULL,
    payload TEXT NOT NULL,
    applied_at TEXT NOT NULL,
    published_at TEXT,
    PRIMARY KEY(aggregate_id, sequence)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS gate_output_unpublished
    ON gate_output(aggregate_id, sequence) WHERE published_at IS NULL;
DROP INDEX IF EXISTS gate_output_unpublished_age;
CREATE INDEX IF NOT EXISTS gate_output_waiting_age
    ON gate_output(applied_at) WHERE published_at IS NULL AND applied_at > '';
CREATE TABLE IF NOT EXISTS gate_publisher_lease(
    id INTEGER PRIMARY KEY CHECK (id = 1),
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS gate_output_published_age
    ON gate_output(applied_at) WHERE published_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS gate_output_pruned(
    aggregate_id TEXT PRIMARY KEY,
    through INTEGER NOT NULL
);";

/// The tables on PostgreSQL, installed under a transaction-scoped advisory lock so that gates
/// starting together on one database do not race on the catalog.
const POSTGRES_SCHEMA: &str = "
BEGIN;
-- A start on an installed store would log each `IF [NOT] EXISTS` that found nothing to do.
SET LOCAL client_min_messages = warning;
SELECT pg_advisory_xact_lock(hashtext('production-lab gate output'));
CREATE TABLE IF NOT EXISTS gate_output(
    aggregate_id TEXT NOT NULL,
    sequence BIGINT NOT NULL,
    message_id TEXT NOT NULL,
    message_type TEXT NOT NULL,
    payload TEXT NOT NULL,
    applied_at TEXT NOT NULL,
    published_at TEXT,
    PRIMARY KEY(aggregate_id, sequence)
);
CREATE INDEX IF NOT EXISTS gate_output_unpublished
    ON gate_output(aggregate_id, sequence) WHERE published_at IS NULL;
DROP INDEX IF EXISTS gate_output_unpublished_age;
CREATE INDEX IF NOT EXISTS gate_output_waiting_age
    ON gate_output(applied_at) WHERE published_at IS NULL AND applied_at > '';
CREATE TABLE IF NOT EXISTS gate_publisher_lease(
    id INTEGER PRIMARY KEY CHECK (id = 1),
    holder TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS gate_output_published_age
    ON gate_output(applied_at) WHERE published_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS gate_output_pruned(
    aggregate_id TEXT PRIMARY KEY,
    through BIGINT NOT NULL
);
-- Freed pages are reused in place, as the inbox's pruned tables do (see its migrations); set
-- once, since the lock it takes waits for a running vacuum.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_class WHERE oid = 'gate_output'::regclass
                     AND reloptions @> ARRAY['vacuum_truncate=false']) THEN
        ALTER TABLE gate_output SET (vacuum_truncate = false);
    END IF;
END
$$;
COMMIT;";

const COLUMNS: &str = "aggregate_id, sequence, message_id, message_type, payload, applied_at";

/// The rows applied but not yet published, as a scrape reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backlog {
    /// The unpublished rows, at most [`BACKLOG_COUNT_CAP`] (which means that many or more).
    pub rows: i64,
    /// The oldest unpublished row's `applied_at`, if there is one.
    pub oldest_applied_at: Option<String>,
}

/// A row of the output: one applied message as the gate emits it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutputEntry {
    pub aggregate_id: String,
    pub sequence: i64,
    pub message_id: String,
    #[serde(rename = "type")]
    pub message_type: String,
    pub payload: Value,
    pub applied_at: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputError {
    /// A read asked for no rows or for more than [`MAX_LIMIT`].
    #[error("limit must be between 1 and {MAX_LIMIT}, got {0}")]
    Limit(usize),
    /// The database cannot be reached now; a retry may succeed.
    #[error("output store unavailable: {0}")]
    Unavailable(String),
    /// Any other failure of the database, or a stored row that does not read back.
    #[error("output store failure: {0}")]
    Failed(String),
}

impl From<StoreError> for OutputError {
    fn from(error: StoreError) -> Self {
        if error.is_retryable() {
            OutputError::Unavailable(error.to_string())
        } else {
            OutputError::Failed(error.to_string())
        }
    }
}

impl From<rusqlite::Error> for OutputError {
    fn from(error: rusqlite::Error) -> Self {
        OutputError::from(StoreError::from(error))
    }
}

impl From<tokio_postgres::Error> for OutputError {
    fn from(error: tokio_postgres::Error) -> Self {
        // tokio-postgres's `Display` of a database error is only "db error": name its cause.
        match error.as_db_error() {
            Some(db) => {
                OutputError::Failed(format!("postgres: {} ({})", db.message(), db.code().code()))
            }
            None if error.is_closed() => OutputError::Unavailable(format!("postgres: {error}")),
            None => OutputError::Failed(format!("postgres: {error}")),
        }
    }
}

/// Creates the output table on SQLite, after the inbox's migrations, in one transaction.
/// Idempotent: run at every start.
pub fn migrate_sqlite(connection: &mut Connection) -> rusqlite::Result<()> {
    let transaction = connection.transaction()?;
    transaction.execute_batch(SQLITE_SCHEMA)?;
    transaction.commit()
}

/// Creates the output table on PostgreSQL, after the inbox's migrations. Idempotent.
pub async fn install_postgres(inbox: &PostgresInbox) -> Result<(), OutputError> {
    let client = inbox.pool().get().await.map_err(unavailable)?;
    client.batch_execute(POSTGRES_SCHEMA).await?;
    Ok(())
}

/// The output table's reads and the publisher's marks, on the inbox's own database.
#[derive(Clone)]
pub enum OutputStore {
    /// The inbox's SQLite store: reads on its read pool, marks through its writer.
    Sqlite(Store),
    /// The PostgreSQL inbox, whose connection pool the reads and marks share.
    Postgres(Arc<PostgresInbox>),
}

impl OutputStore {
    /// The output of the SQLite inbox on `store`.
    pub fn sqlite(store: Store) -> OutputStore {
        OutputStore::Sqlite(store)
    }

    /// The output of the PostgreSQL `inbox`, sharing its pool.
    pub fn postgres(inbox: &PostgresInbox) -> OutputStore {
        OutputStore::Postgres(Arc::new(inbox.clone()))
    }

    /// The applied messages of `aggregate_id` after sequence `after`, in sequence order, at
    /// most `limit` (1..=[`MAX_LIMIT`]).
    pub async fn applied(
        &self,
        aggregate_id: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<OutputEntry>, OutputError> {
        let limit = bounded(limit)?;
        let sql_sqlite = format!(
            "SELECT {COLUMNS} FROM gate_output WHERE aggregate_id = ?1 AND sequence > ?2
              ORDER BY sequence LIMIT +?3"
        );
        let sql_postgres = format!(
            "SELECT {COLUMNS} FROM gate_output WHERE aggregate_id = $1 AND sequence > $2
              ORDER BY sequence LIMIT $3"
        );
        match self {
            OutputStore::Sqlite(store) => {
                let aggregate_id = aggregate_id.to_owned();
                store
                    .read(move |connection| {
                        sqlite_entries(connection, &sql_sqlite, (aggregate_id, after, limit))
                    })
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let rows = client
                    .query_typed(
                        &sql_postgres,
                        &[
                            (&aggregate_id, Type::TEXT),
                            (&after, Type::INT8),
                            (&limit, Type::INT8),
                        ],
                    )
                    .await?;
                rows.iter().map(postgres_entry).collect()
            }
        }
    }

    /// Rows not yet published, in (aggregate, sequence) order: the first
    /// [`PENDING_PER_AGGREGATE`] of each aggregate, at most `limit` (1..=[`MAX_LIMIT`]) in all.
    /// The read costs what it answers, whatever the backlog behind it ([`PENDING_SQLITE`]).
    pub async fn pending(&self, limit: usize) -> Result<Vec<OutputEntry>, OutputError> {
        let limit = bounded(limit)?;
        match self {
            OutputStore::Sqlite(store) => {
                store
                    .read(move |connection| sqlite_entries(connection, PENDING_SQLITE, [limit]))
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let rows = client
                    .query_typed(PENDING_POSTGRES, &[(&limit, Type::INT8)])
                    .await?;
                rows.iter().map(postgres_entry).collect()
            }
        }
    }

    /// The unpublished rows counted up to [`BACKLOG_COUNT_CAP`] and the oldest one's time: two
    /// index reads whose cost the cap bounds, whatever the backlog.
    pub async fn backlog(&self) -> Result<Backlog, OutputError> {
        match self {
            OutputStore::Sqlite(store) => {
                store
                    .read(|connection| {
                        let count = BACKLOG_COUNT.replace('$', "?");
                        let rows: i64 = connection
                            .prepare_cached(&count)?
                            .query_row([BACKLOG_COUNT_CAP], |row| row.get(0))?;
                        let oldest = connection
                            .prepare_cached(OLDEST_UNPUBLISHED)?
                            .query([])?
                            .next()?
                            .map(|row| row.get(0))
                            .transpose()?;
                        Ok::<_, OutputError>(Backlog {
                            rows,
                            oldest_applied_at: oldest,
                        })
                    })
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let count = client
                    .query_typed(BACKLOG_COUNT, &[(&BACKLOG_COUNT_CAP, Type::INT8)])
                    .await?;
                let rows = match count.first() {
                    Some(row) => row.try_get(0)?,
                    None => 0,
                };
                let oldest = client.query_typed(OLDEST_UNPUBLISHED, &[]).await?;
                let oldest_applied_at = match oldest.first() {
                    Some(row) => Some(row.try_get(0)?),
                    None => None,
                };
                Ok(Backlog {
                    rows,
                    oldest_applied_at,
                })
            }
        }
    }

    /// Marks the rows `(aggregate_id, sequence)` published now. A row already marked keeps its
    /// first time; a row that does not exist is no error.
    pub async fn mark_published(&self, rows: &[(String, i64)]) -> Result<(), OutputError> {
        if rows.is_empty() {
            return Ok(());
        }
        let now = ordered_inbox::clock::now();
        match self {
            OutputStore::Sqlite(store) => {
                let rows = rows.to_vec();
                store
                    .write_with_company(MARK_PATIENCE, move |connection| {
                        sqlite_mark(connection, &rows, &now)
                    })
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let (aggregates, sequences): (Vec<&str>, Vec<i64>) = rows
                    .iter()
                    .map(|(aggregate, sequence)| (aggregate.as_str(), *sequence))
                    .unzip();
                let client = inbox.pool().get().await.map_err(unavailable)?;
                client
                    .query_typed(
                        MARK_POSTGRES,
                        &[
                            (&aggregates, Type::TEXT_ARRAY),
                            (&sequences, Type::INT8_ARRAY),
                            (&now, Type::TEXT),
                        ],
                    )
                    .await?;
                Ok(())
            }
        }
    }
}

impl OutputStore {
    /// Deletes at most `batch` published rows applied before `before` (a stored timestamp), the
    /// oldest first, and records per aggregate the highest sequence deleted, so that the feed
    /// can tell a reader who asks for a pruned range (see [`OutputStore::pruned_through`]).
    /// Unpublished rows are never deleted. On SQLite one writer unit; on PostgreSQL one
    /// transaction on a connection of its own. Answers the rows deleted.
    pub async fn prune(&self, before: String, batch: usize) -> Result<u64, OutputError> {
        let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        match self {
            OutputStore::Sqlite(store) => {
                store
                    .write(move |connection| sqlite_prune(connection, &before, batch))
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let mut client = inbox.pool().get().await.map_err(unavailable)?;
                let transaction = client.transaction().await?;
                let deleted = transaction
                    .query_typed(
                        PRUNE_POSTGRES,
                        &[(&before, Type::TEXT), (&batch, Type::INT8)],
                    )
                    .await?;
                transaction.commit().await?;
                let count: i64 = match deleted.first() {
                    Some(row) => row.try_get(0)?,
                    None => 0,
                };
                Ok(u64::try_from(count).unwrap_or(0))
            }
        }
    }

    /// The highest sequence of `aggregate_id` whose output row was pruned (`None`: none was).
    pub async fn pruned_through(&self, aggregate_id: &str) -> Result<Option<i64>, OutputError> {
        let aggregate_id = aggregate_id.to_owned();
        match self {
            OutputStore::Sqlite(store) => {
                store
                    .read(move |connection| {
                        let through = connection
                            .prepare_cached(
                                "SELECT through FROM gate_output_pruned WHERE aggregate_id = ?1",
                            )?
                            .query([&aggregate_id])?
                            .next()?
                            .map(|row| row.get(0))
                            .transpose()?;
                        Ok::<_, OutputError>(through)
                    })
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let rows = client
                    .query_typed(
                        "SELECT through FROM gate_output_pruned WHERE aggregate_id = $1",
                        &[(&aggregate_id, Type::TEXT)],
                    )
                    .await?;
                match rows.first() {
                    Some(row) => Ok(Some(row.try_get(0)?)),
                    None => Ok(None),
                }
            }
        }
    }

    /// The oldest retained output row's applied time (`None`: the output is empty).
    pub async fn oldest(&self) -> Result<Option<String>, OutputError> {
        const OLDEST: &str = "SELECT MIN(applied_at) FROM gate_output";
        match self {
            OutputStore::Sqlite(store) => {
                store
                    .read(|connection| {
                        let oldest: Option<String> = connection
                            .prepare_cached(OLDEST)?
                            .query_row([], |row| row.get(0))?;
                        Ok::<_, OutputError>(oldest)
                    })
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let rows = client.query_typed(OLDEST, &[]).await?;
                match rows.first() {
                    Some(row) => Ok(row.try_get(0)?),
                    None => Ok(None),
                }
            }
        }
    }
}

fn sqlite_prune(connection: &Connection, before: &str, batch: i64) -> Result<u64, OutputError> {
    let mut highest: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
    let mut deleted = 0u64;
    {
        let mut statement = connection.prepare_cached(PRUNE_SQLITE)?;
        let mut rows = statement.query((before, batch))?;
        while let Some(row) = rows.next()? {
            let aggregate: String = row.get(0)?;
            let sequence: i64 = row.get(1)?;
            let entry = highest.entry(aggregate).or_insert(sequence);
            *entry = (*entry).max(sequence);
            deleted += 1;
        }
    }
    let mut record = connection.prepare_cached(
        "INSERT INTO gate_output_pruned(aggregate_id, through) VALUES (?1, ?2)
         ON CONFLICT(aggregate_id) DO UPDATE SET through = MAX(through, excluded.through)",
    )?;
    for (aggregate, through) in &highest {
        record.execute((aggregate, through))?;
    }
    Ok(deleted)
}

/// `limit` as the statements take it, refused outside 1..=[`MAX_LIMIT`].
fn bounded(limit: usize) -> Result<i64, OutputError> {
    match i64::try_from(limit) {
        Ok(bounded) if (1..=MAX_LIMIT).contains(&limit) => Ok(bounded),
        _ => Err(OutputError::Limit(limit)),
    }
}

/// The pool's failure to hand out a connection: the database is down or every connection busy.
pub(crate) fn unavailable(error: impl std::fmt::Display) -> OutputError {
    OutputError::Unavailable(error.to_string())
}

fn sqlite_entries(
    connection: &Connection,
    sql: &str,
    parameters: impl rusqlite::Params,
) -> Result<Vec<OutputEntry>, OutputError> {
    let mut statement = connection.prepare_cached(sql)?;
    let rows = statement.query_map(parameters, |row| {
        Ok(StoredRow {
            aggregate_id: row.get(0)?,
            sequence: row.get(1)?,
            message_id: row.get(2)?,
            message_type: row.get(3)?,
            payload: row.get(4)?,
            applied_at: row.get(5)?,
        })
    })?;
    let mut entries = Vec::new();
    for row in rows {
        entries.push(row?.entry()?);
    }
    Ok(entries)
}

fn sqlite_mark(
    connection: &Connection,
    rows: &[(String, i64)],
    now: &str,
) -> Result<(), OutputError> {
    let mut statement = connection.prepare_cached(
        "UPDATE gate_output SET published_at = ?3
          WHERE aggregate_id = ?1 AND sequence = ?2 AND published_at IS NULL",
    )?;
    for (aggregate, sequence) in rows {
        statement.execute((aggregate, sequence, now))?;
    }
    Ok(())
}

fn postgres_entry(row: &tokio_postgres::Row) -> Result<OutputEntry, OutputError> {
    StoredRow {
        aggregate_id: row.try_get(0)?,
        sequence: row.try_get(1)?,
        message_id: row.try_get(2)?,
        message_type: row.try_get(3)?,
        payload: row.try_get(4)?,
        applied_at: row.try_get(5)?,
    }
    .entry()
}

/// A row as stored: the payload still text.
struct StoredRow {
    aggregate_id: String,
    sequence: i64,
    message_id: String,
    message_type: String,
    payload: String,
    applied_at: String,
}

impl StoredRow {
    fn entry(self) -> Result<OutputEntry, OutputError> {
        let payload = serde_json::from_str(&self.payload).map_err(|error| {
            OutputError::Failed(format!(
                "the output row {}:{} holds no JSON payload: {error}",
                self.aggregate_id, self.sequence
            ))
        })?;
        Ok(OutputEntry {
            aggregate_id: self.aggregate_id,
            sequence: self.sequence,
            message_id: self.message_id,
            message_type: self.message_type,
            payload,
            applied_at: self.applied_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The condition of the index by age, which only the reads by age name.
    const WAITING_BY_AGE: &str = "published_at IS NULL AND applied_at > ''";

    #[test]
    fn the_pending_statements_take_as_many_rows_of_an_aggregate_as_the_constant_says() {
        let offset = format!("LIMIT 1 OFFSET {}", PENDING_PER_AGGREGATE - 1);
        let limit = format!("ORDER BY sequence LIMIT {})", PENDING_PER_AGGREGATE);
        assert!(PENDING_SQLITE.contains(&offset), "{PENDING_SQLITE}");
        assert!(PENDING_POSTGRES.contains(&limit), "{PENDING_POSTGRES}");
    }

    #[test]
    fn only_the_reads_by_age_name_the_condition_of_the_index_by_age() {
        for schema in [SQLITE_SCHEMA, POSTGRES_SCHEMA] {
            let index = format!("gate_output(applied_at) WHERE {WAITING_BY_AGE};");
            assert!(schema.contains(&index), "{schema}");
        }
        assert!(BACKLOG_COUNT.contains(WAITING_BY_AGE), "{BACKLOG_COUNT}");
        assert!(
            OLDEST_UNPUBLISHED.contains(WAITING_BY_AGE),
            "{OLDEST_UNPUBLISHED}"
        );
        assert!(
            !PENDING_POSTGRES.contains("applied_at >"),
            "{PENDING_POSTGRES}"
        );
    }

    /// The publisher's read, the backlog's count and the pruner's batch, run again and again
    /// with their limits bound anew, are prepared once: SQLite prepares a statement again at
    /// every execution when it planned with a bound limit's value.
    #[test]
    fn the_sqlite_statements_run_at_every_round_are_prepared_once() {
        use ordered_inbox::sqlite::connection::{ParametersFor, times_prepared_again};
        use rusqlite::types::Value;

        let connection = Connection::open_in_memory().expect("a database");
        connection.execute_batch(SQLITE_SCHEMA).expect("the tables");
        connection
            .execute_batch(
                "INSERT INTO gate_output VALUES
                   ('a', 1, 'm-1', 't', '{}', '2026-01-01', NULL),
                   ('a', 2, 'm-2', 't', '{}', '2026-01-01', '2026-01-02')",
            )
            .expect("rows");
        let backlog_count = BACKLOG_COUNT.replace('$', "?");
        let runs: [(&str, &ParametersFor<'_>); 3] = [
            (PENDING_SQLITE, &|limit| vec![limit.into()]),
            (&backlog_count, &|limit| vec![limit.into()]),
            (PRUNE_SQLITE, &|limit| {
                vec![Value::Text("2000".to_owned()), limit.into()]
            }),
        ];
        for (sql, parameters) in runs {
            assert_eq!(
                times_prepared_again(&connection, sql, parameters, &[1000, 1000, 500]),
                Ok(0),
                "prepared again: {sql}"
            );
        }
    }

    #[test]
    fn a_read_takes_between_one_and_a_thousand_rows() {
        assert_eq!(bounded(1), Ok(1));
        assert_eq!(bounded(MAX_LIMIT), Ok(1000));
        assert_eq!(bounded(0), Err(OutputError::Limit(0)));
        assert_eq!(bounded(1001), Err(OutputError::Limit(1001)));
    }

    #[test]
    fn an_entry_names_its_type_as_type_in_camel_case() {
        let entry = OutputEntry {
            aggregate_id: "order-1".into(),
            sequence: 2,
            message_id: "m-2".into(),
            message_type: "order.placed".into(),
            payload: serde_json::json!({"amount": 5}),
            applied_at: "2026-01-01T00:00:00.000Z".into(),
        };
        assert_eq!(
            serde_json::to_string(&entry).unwrap(),
            r#"{"aggregateId":"order-1","sequence":2,"messageId":"m-2","type":"order.placed","payload":{"amount":5},"appliedAt":"2026-01-01T00:00:00.000Z"}"#
        );
    }
}
