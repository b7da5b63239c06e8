//! Gaps in SQLite: the note of the lowest sequence refused as a gap, a gap resolution's facts,
//! its audit row, the skip a late arrival names, and the missing range the views show
//! ([`crate::gaps`] decides; this only reads and writes rows).

use rusqlite::{Connection, OptionalExtension, Row, params};
use serde_json::Value;

use super::engine::{Run, Unit, decided};
use super::rows::{aggregate_from, optional_json, owner_from};
use super::store::StoreError;
use crate::error::HandlerError;
use crate::error::InboxError;
use crate::facts::{DeliveryFacts, OpenDeadLetter};
use crate::gaps::{
    AppliedInRange, GapFacts, GapRequest, GapResolutionError, GapResolved, decide_gap_resolution,
};
use crate::model::{OrderedMessage, Position};
use crate::records::{GapRecord, SequenceRange};
use crate::resolution::Mode;
use crate::views::{Page, PageRequest};

/// The next number of an audit row, gap or dead letter: one past the highest of both tables, so
/// that one trail lists both in order.
pub(super) const NEXT_RESOLUTION_ID: &str = "
SELECT 1 + MAX(COALESCE((SELECT MAX(id) FROM resolutions), 0),
               COALESCE((SELECT MAX(id) FROM gap_resolutions), 0))";

/// Keeps the lowest sequence refused as a gap at this last; a note taken at another last is
/// replaced (in an update every column reads the row's old values).
const NOTE_GAP: &str = "
INSERT INTO refused_gaps(aggregate_id, after_last, lowest) VALUES (?1, ?2, ?3)
ON CONFLICT(aggregate_id) DO UPDATE SET
    lowest = CASE WHEN after_last = excluded.after_last THEN MIN(lowest, excluded.lowest)
                  ELSE excluded.lowest END,
    after_last = excluded.after_last";

const GAP_COLUMNS: &str = "
SELECT id, aggregate_id, from_sequence, through_sequence, operator, reason, expected_last,
       before_last, before_state, after_last, after_state, drained, resolved_at
  FROM gap_resolutions";

pub(super) fn note_gap(
    connection: &Connection,
    aggregate_id: &str,
    last: i64,
    sequence: i64,
) -> rusqlite::Result<()> {
    connection
        .prepare_cached(NOTE_GAP)?
        .execute(params![aggregate_id, last, sequence])?;
    Ok(())
}

/// The audit row and its `gap skipped` event. Returns the row's number.
pub(super) fn record(connection: &Connection, record: &GapRecord) -> rusqlite::Result<i64> {
    let id: i64 = connection
        .prepare_cached(NEXT_RESOLUTION_ID)?
        .query_row([], |row| row.get(0))?;
    let state = |state: &Option<Value>| state.as_ref().map(ToString::to_string);
    connection
        .prepare_cached(
            "INSERT INTO gap_resolutions(id, aggregate_id, from_sequence, through_sequence,
                                         operator, reason, expected_last, before_last,
                                         before_state, after_last, after_state, drained,
                                         resolved_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
        )?
        .execute(params![
            id,
            record.aggregate_id,
            record.range.from,
            record.range.through,
            record.operator,
            record.reason,
            record.expected_last,
            record.before.last,
            state(&record.before.state),
            record.after.last,
            state(&record.after.state),
            serde_json::to_string(&record.drained).unwrap_or_else(|_| "[]".to_owned()),
            record.resolved_at,
        ])?;
    super::writes::append(connection, &crate::gaps::gap_skipped_event(record, id))?;
    Ok(id)
}

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

/// Checks the preconditions and resolves the gap, or (dry run) reports what that would do and
/// writes nothing: the facts, the core's decision, the audit row and the drain through the
/// handler, in this unit of the writer.
pub fn resolve_gap_in(
    unit: Unit<'_>,
    request: &GapRequest,
    mode: Mode,
) -> Result<GapResolved, GapResolutionError> {
    let store = |error: rusqlite::Error| GapResolutionError::Store(StoreError::from(error).into());
    let handler = |error: HandlerError| GapResolutionError::Store(InboxError::Handler(error));
    let facts = gap_facts(unit, request).map_err(|read| match read {
        GapRead::Store(error) => store(error),
        GapRead::Handler(error) => handler(error),
    })?;
    let run = decided(unit, None, |context| {
        decide_gap_resolution(request, &facts, mode, context)
    })
    .map_err(|error| GapResolutionError::Store(error.into()))?;
    match run {
        Run::Written(plan, report) => Ok(plan.resolved.numbered(report.resolution_id)),
        Run::Refused(refusal) => Err(GapResolutionError::refused(request, refusal)),
        Run::Failed(error) => Err(handler(error)),
    }
}

/// Everything a gap resolution's decision reads, in the writer's unit.
pub(super) fn gap_facts(unit: Unit<'_>, request: &GapRequest) -> Result<GapFacts, GapRead> {
    let connection = unit.connection;
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
        state: unit
            .handler
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

/// The lowest sequence refused as a gap at the aggregate's current last, if any.
pub(super) fn refused_at(
    connection: &Connection,
    aggregate_id: &str,
    last: i64,
) -> rusqlite::Result<Option<i64>> {
    connection
        .prepare_cached(
            "SELECT lowest FROM refused_gaps WHERE aggregate_id = ?1 AND after_last = ?2",
        )?
        .query_row(params![aggregate_id, last], |row| row.get(0))
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
        .prepare_cached(&format!("{GAP_COLUMNS} {condition} ORDER BY id LIMIT ?3"))?
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
