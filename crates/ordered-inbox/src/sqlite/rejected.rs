//! The rejected list in SQLite (`rejected_deliveries`, inbox schema version 8): an insert that
//! prunes what fell out of the newest [`REJECTED_KEPT`], and the page read by id.

use rusqlite::{Connection, Row, params};

use crate::records::{REJECTED_KEPT, RejectedDelivery};
use crate::views::{Page, PageRequest};

/// Appends one entry and drops the ones that fell out of the newest [`REJECTED_KEPT`]: ids only
/// grow (the oldest go first, so the newest id stays), so they are a range below the new one.
pub(super) fn insert(connection: &Connection, entry: &RejectedDelivery) -> rusqlite::Result<()> {
    connection
        .prepare_cached(
            "INSERT INTO rejected_deliveries(at, subject, stream_sequence, delivered, message_id,
                                             aggregate_id, producer, outcome, reason)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?
        .execute(params![
            entry.at,
            entry.subject,
            entry.stream_sequence,
            entry.delivered,
            entry.message_id,
            entry.aggregate_id,
            entry.producer,
            entry.outcome,
            entry.reason
        ])?;
    let newest = connection.last_insert_rowid();
    connection
        .prepare_cached("DELETE FROM rejected_deliveries WHERE id <= ?1")?
        .execute([newest.saturating_sub(REJECTED_KEPT)])?;
    Ok(())
}

/// Appends entries in order, in the caller's unit.
pub(super) fn record(
    connection: &Connection,
    entries: &[RejectedDelivery],
) -> rusqlite::Result<()> {
    entries
        .iter()
        .try_for_each(|entry| insert(connection, entry))
}

/// The entries after `page.after` (an id), oldest first.
pub(super) fn page(
    connection: &Connection,
    page: PageRequest,
) -> rusqlite::Result<Page<RejectedDelivery>> {
    let rows = connection
        .prepare_cached(
            "SELECT id, at, subject, stream_sequence, delivered, message_id, aggregate_id,
                    producer, outcome, reason
               FROM rejected_deliveries WHERE id > ?1 ORDER BY id LIMIT +?2",
        )?
        .query_map(params![page.after, page.limit.saturating_add(1)], |row| {
            Ok((row.get(0)?, entry_from(row)?))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

fn entry_from(row: &Row<'_>) -> rusqlite::Result<RejectedDelivery> {
    Ok(RejectedDelivery {
        at: row.get(1)?,
        subject: row.get(2)?,
        stream_sequence: row.get(3)?,
        delivered: row.get(4)?,
        message_id: row.get(5)?,
        aggregate_id: row.get(6)?,
        producer: row.get(7)?,
        outcome: row.get(8)?,
        reason: row.get(9)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqlite::schema::migrated_in_memory;

    fn entry(n: i64) -> RejectedDelivery {
        RejectedDelivery {
            at: format!("t{n}"),
            subject: Some("ordered.a".into()),
            stream_sequence: Some(n),
            delivered: Some(1),
            message_id: Some(format!("m-{n}")),
            aggregate_id: Some("a".into()),
            producer: None,
            outcome: "stale".into(),
            reason: "taken".into(),
        }
    }

    #[test]
    fn the_list_keeps_the_newest_entries_and_pages_them_oldest_first() {
        let connection = migrated_in_memory();
        let all: Vec<RejectedDelivery> = (1..=REJECTED_KEPT + 5).map(entry).collect();
        record(&connection, &all).unwrap();
        let count: i64 = connection
            .query_row("SELECT COUNT(*) FROM rejected_deliveries", [], |row| {
                row.get(0)
            })
            .unwrap();
        assert_eq!(count, REJECTED_KEPT);
        let first = page(&connection, PageRequest { after: 0, limit: 2 }).unwrap();
        let ids: Vec<_> = first.items.iter().map(|e| e.message_id.clone()).collect();
        assert_eq!(ids, [Some("m-6".to_owned()), Some("m-7".to_owned())]);
        assert_eq!(first.next, Some(7));
        let last = page(
            &connection,
            PageRequest {
                after: REJECTED_KEPT + 4,
                limit: 10,
            },
        )
        .unwrap();
        assert_eq!(last.items, [entry(REJECTED_KEPT + 5)]);
        assert_eq!(last.next, None);
    }
}
