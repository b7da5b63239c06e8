//! What the benches read from a server's SQLite file (its documented tables): the end state
//! they verify, the file's size, and when each message was applied.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags};

use super::{AggregateStream, BenchError};
use crate::progress::ProgressCounter;

/// Every aggregate's last sequence, total and applied rows are exactly what was sent.
pub fn verify_end_state(database: &Path, streams: &[AggregateStream]) -> Result<(), BenchError> {
    let connection = Connection::open(database)?;
    let mut state = connection
        .prepare("SELECT last_sequence, total FROM aggregate_state WHERE aggregate_id = ?1")?;
    let mut applied = connection.prepare(
        "SELECT COUNT(*), COALESCE(SUM(json_extract(payload, '$.Amount')), 0) FROM ordered_inbox
         WHERE json_extract(payload, '$.AggregateId') = ?1",
    )?;
    for stream in streams {
        let (last, total): (i64, i64) = state
            .query_row([&stream.aggregate_id], |row| Ok((row.get(0)?, row.get(1)?)))
            .map_err(|e| {
                BenchError::Verification(format!("{}: no state row ({e})", stream.aggregate_id))
            })?;
        let (rows, sum): (i64, i64) =
            applied.query_row([&stream.aggregate_id], |row| Ok((row.get(0)?, row.get(1)?)))?;
        expect_stream_state(stream, last, total, rows, sum)?;
    }
    Ok(())
}

/// An aggregate ends at its last sequence and the sum of its amounts, one applied row per
/// message: `last`, `total`, `rows` and `sum` are what the store holds.
pub(super) fn expect_stream_state(
    stream: &AggregateStream,
    last: i64,
    total: i64,
    rows: i64,
    sum: i64,
) -> Result<(), BenchError> {
    let expected_last = stream.messages.len() as i64;
    let expected_total: i64 = stream.messages.iter().map(super::amount).sum();
    if (last, total, rows, sum) == (expected_last, expected_total, expected_last, expected_total) {
        return Ok(());
    }
    Err(BenchError::Verification(format!(
        "{}: last {last}, total {total}, {rows} applied rows summing {sum}; expected last and rows {expected_last}, total {expected_total}",
        stream.aggregate_id
    )))
}

/// The database's size in bytes: page count × page size.
pub(super) fn database_size(database: &Path) -> Result<i64, BenchError> {
    let connection = Connection::open(database)?;
    Ok(connection.query_row(
        "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        [],
        |row| row.get(0),
    )?)
}

/// A read-only connection to a running server's database.
pub(super) fn open_reader(database: &Path) -> Result<Connection, BenchError> {
    let reader = Connection::open_with_flags(database, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    reader.busy_timeout(Duration::from_secs(5))?;
    Ok(reader)
}

/// Waits (ten minutes at most) until the inbox `reader` reads holds `target` applied messages,
/// reporting the count to `counter`; `at` ends the error's sentence (where the inbox is).
pub(super) async fn wait_until_applied(
    reader: &Connection,
    target: i64,
    counter: &ProgressCounter,
    at: &str,
) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let applied: i64 =
            reader.query_row("SELECT COUNT(*) FROM ordered_inbox", [], |row| row.get(0))?;
        counter.reach(u64::try_from(applied).unwrap_or(0));
        if applied >= target {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Verification(format!(
                "only {applied} of {target} applied{at}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// When each applied message was applied, in milliseconds since the Unix epoch, by message id.
pub(super) fn applied_at_ms(reader: &Connection) -> Result<HashMap<String, i64>, BenchError> {
    Ok(reader
        .prepare(
            "SELECT message_id,
                    CAST(strftime('%s', applied_at) AS INTEGER) * 1000
                      + CAST(substr(applied_at, 21, 3) AS INTEGER)
               FROM ordered_inbox",
        )?
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?)
}

/// Each latency from a start (epoch ms, by key) to its applied instant, sorted; keys missing on
/// either side are left out.
pub(super) fn latencies_between(
    started: &HashMap<String, i64>,
    applied: &HashMap<String, i64>,
) -> Vec<Duration> {
    let mut latencies: Vec<Duration> = started
        .iter()
        .filter_map(|(key, started)| {
            let at = applied.get(key)?;
            Some(Duration::from_millis(
                u64::try_from(at - started).unwrap_or(0),
            ))
        })
        .collect();
    latencies.sort_unstable();
    latencies
}
