//! Gaps in SQLite, the rows read: a gap resolution's facts, the skip a late arrival names, and
//! the audit trail of gap resolutions ([`crate::gaps`] decides; `writes` writes the note of a
//! refused gap and the audit row, `views` reads the note, `gap_engine` runs a resolution).

use rusqlite::{Connection, OptionalExtension, Row, params};

use super::handler::SqliteHandler;
use super::rows::{aggregate_from, optional_json, owner_from};
use crate::error::HandlerError;
use crate::facts::{DeliveryFacts, OpenDeadLetter};
use crate::gaps::{AppliedInRange, GapFacts, GapRequest};
use crate::model::{OrderedMessage, Position};
use crate::records::{GapRecord, SequenceRange};
use crate::views::{Page, PageRequest};

const GAP_COLUMNS: &str = "
SELECT id, aggregate_id, from_sequence, through_sequence, operator, reason, expected_last,
       before_last, before_state, after_last, after_state, drained, resolved_at
  FROM gap_resolutions";

/// The gap resolution that skipped `message`'s sequence, read only when the sequence is at or
/// below the aggregate's last (any other is not late).
pub(super) fn skipped_by(
    connection: &Connection,
    message: &OrderedMessage,
    facts: &DeliveryFacts,
) -> rusqlite::Result<Option<i64>> {
    let last = facts.aggregate.as_ref().map_or(0, |row| row.last);
    if message.sequence > last || facts.applied.is_some() {
        return Ok(None);
    }
    Ok(
        covering(connection, &message.aggregate_id, message.sequence)?
            .and_then(|record| record.resolution_id),
    )
}

/// The gap resolution of the aggregate whose range holds `sequence` (ranges never overlap: each
/// starts past the last, which the one before it moved).
fn covering(
    connection: &Connection,
    aggregate_id: &str,
    sequence: i64,
) -> rusqlite::Result<Option<GapRecord>> {
    let found = connection
        .prepare_cached(&format!(
            "{GAP_COLUMNS} WHERE aggregate_id = ?1 AND from_sequence <= ?2
              ORDER BY from_sequence DESC LIMIT 1"
        ))?
        .query_row(params![aggregate_id, sequence], gap_record_from_row)
        .optional()?;
    Ok(found.filter(|record| record.range.contains(sequence)))
}

/// Everything a gap resolution's decision reads, in the writer's unit.
pub(super) fn gap_facts(
    connection: &Connection,
    handler: &dyn SqliteHandler,
    request: &GapRequest,
) -> Result<GapFacts, GapRead> {
    let aggregate_id = request.aggregate_id.as_str();
    let row = connection
        .prepare_cached(
            "SELECT last_sequence, status, status_since, owner, owner_epoch
               FROM aggregate_state WHERE aggregate_id = ?1",
        )?
        .query_row([aggregate_id], |row| {
            Ok((
                aggregate_from(row, 0)?,
                owner_from(row.get(3)?, row.get(4)?),
            ))
        })
        .optional()?;
    let Some((aggregate, owner)) = row else {
        return Ok(GapFacts::default());
    };
    Ok(GapFacts {
        aggregate: Some(aggregate),
        open_dead_letters: open_dead_letters(connection, aggregate_id)?,
        held: super::facts::held_for(connection, aggregate_id)?,
        owner,
        operator_active: super::operators::is_active(connection, &request.operator)?,
        applied_in_range: applied_in_range(connection, aggregate_id, request.range)?,
        recorded: covering(connection, aggregate_id, request.range.from)?,
        state: handler
            .state(connection, aggregate_id)
            .map_err(GapRead::Handler)?,
    })
}

/// Why a gap resolution's facts could not be read.
pub(super) enum GapRead {
    Store(rusqlite::Error),
    Handler(HandlerError),
}

impl From<rusqlite::Error> for GapRead {
    fn from(error: rusqlite::Error) -> Self {
        GapRead::Store(error)
    }
}

fn open_dead_letters(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Vec<OpenDeadLetter>> {
    connection
        .prepare_cached(
            "SELECT message_id, sequence, NULLIF(producer, '') FROM deadletters
              WHERE aggregate_id = ?1 AND status = 'open'",
        )?
        .query_map([aggregate_id], |row| {
            Ok(OpenDeadLetter {
                producer: row.get(2)?,
                message_id: row.get(0)?,
                sequence: row.get(1)?,
            })
        })?
        .collect()
}

/// The lowest applied message inside `range` (a range of the unique index on
/// `(aggregate_id, sequence)`).
fn applied_in_range(
    connection: &Connection,
    aggregate_id: &str,
    range: SequenceRange,
) -> rusqlite::Result<Option<AppliedInRange>> {
    connection
        .prepare_cached(
            "SELECT sequence, message_id FROM ordered_inbox
              WHERE aggregate_id = ?1 AND sequence BETWEEN ?2 AND ?3
              ORDER BY sequence LIMIT 1",
        )?
        .query_row(params![aggregate_id, range.from, range.through], |row| {
            Ok(AppliedInRange {
                sequence: row.get(0)?,
                message_id: row.get(1)?,
            })
        })
        .optional()
}

/// The gap resolutions after number `page.after`, oldest first, optionally for one aggregate.
pub fn gap_resolutions(
    connection: &Connection,
    aggregate_id: Option<&str>,
    page: PageRequest,
) -> rusqlite::Result<Page<GapRecord>> {
    let condition = if aggregate_id.is_some() {
        "WHERE aggregate_id = ?1 AND id > ?2"
    } else {
        "WHERE ?1 IS NULL AND id > ?2"
    };
    let rows = connection
        .prepare_cached(&format!("{GAP_COLUMNS} {condition} ORDER BY id LIMIT +?3"))?
        .query_map(
            params![aggregate_id, page.after, page.limit.saturating_add(1)],
            |row| {
                let record = gap_record_from_row(row)?;
                Ok((record.resolution_id.unwrap_or(0), record))
            },
        )?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

fn gap_record_from_row(row: &Row<'_>) -> rusqlite::Result<GapRecord> {
    let drained: String = row.get(11)?;
    Ok(GapRecord {
        resolution_id: row.get(0)?,
        aggregate_id: row.get(1)?,
        range: SequenceRange {
            from: row.get(2)?,
            through: row.get(3)?,
        },
        operator: row.get(4)?,
        reason: row.get(5)?,
        expected_last: row.get(6)?,
        before: Position {
            last: row.get(7)?,
            state: optional_json(row.get(8)?),
        },
        after: Position {
            last: row.get(9)?,
            state: optional_json(row.get(10)?),
        },
        drained: crate::gaps::drained_from_json(&drained),
        resolved_at: row.get(12)?,
    })
}
