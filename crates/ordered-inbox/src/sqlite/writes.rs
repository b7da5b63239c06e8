//! The SQL of each [`Change`]: one short function per variant, and [`write`], which picks it.
//! Every statement is a primary-key or index seek, prepared once per connection.

use rusqlite::params;

use super::connection::WriterConnection;
use super::rows::namespace;
use crate::change::Change;
use crate::content::Detail;
use crate::gaps::gap_skipped_event;
use crate::model::{AggregateRow, OrderedMessage, QuarantineReason};
use crate::records::{AggregateOwner, GapRecord, ProducerClaim, ResolutionRecord, TransferRecord};
use crate::resolution::resolved_event;
use crate::timeline::{OBSERVATIONS_KEPT, TimelineDetail, TimelineEntry};

/// Writes one change. `detail` is what the handler's `apply` reported, for an
/// [`Change::InsertApplied`]. Returns the id of the resolution row, if the change wrote one.
/// Exhaustive on purpose: a new kind of change does not compile until it is written here.
pub(super) fn write(
    connection: &WriterConnection<'_>,
    change: &Change,
    detail: &Detail,
) -> rusqlite::Result<Option<i64>> {
    match change {
        Change::InsertApplied { .. }
        | Change::InsertDeadLetter { .. }
        | Change::ObserveDeadLetter { .. } => write_message(connection, change, detail),
        Change::PutAggregate { aggregate_id, row } => put_aggregate(connection, aggregate_id, row),
        Change::SupersedeDeadLetters {
            aggregate_id,
            message_ids,
            by,
            at,
        } => supersede_dead_letters(connection, aggregate_id, message_ids, by, at),
        Change::ResolveDeadLetter {
            producer,
            message_id,
            at,
        } => resolve_dead_letter(connection, producer.as_deref(), message_id, at),
        Change::InsertHeld {
            claim,
            message,
            payload,
            at,
        } => insert_held(connection, claim.as_ref(), message, payload, at),
        Change::ReleaseHeld {
            producer,
            message_id,
        } => release_held(connection, producer.as_deref(), message_id),
        Change::RecordRejected(entry) => super::rejected::insert(connection, entry),
        Change::Append(entry) => append(connection, entry),
        Change::RecordResolution(record) => return record_resolution(connection, record).map(Some),
        Change::SetOwner {
            aggregate_id,
            owner,
            at,
        } => set_owner(connection, aggregate_id, owner, at),
        Change::TouchProducer { producer, at, .. } => touch_producer(connection, producer, at),
        Change::RecordTransfer(record) => record_transfer(connection, record),
        Change::NoteGap {
            aggregate_id,
            last,
            sequence,
        } => note_gap(connection, aggregate_id, *last, *sequence),
        Change::RecordGapResolution(record) => {
            return record_gap_resolution(connection, record).map(Some);
        }
    }?;
    Ok(None)
}

/// Writes a change of one message's own row: applied, a new dead letter, or one seen again.
/// [`write`] routes only these three here.
fn write_message(
    connection: &WriterConnection<'_>,
    change: &Change,
    detail: &Detail,
) -> rusqlite::Result<()> {
    match change {
        Change::InsertApplied {
            producer,
            message,
            payload,
            applied_at,
        } => insert_applied(
            connection,
            producer.as_deref(),
            message,
            payload,
            applied_at,
            detail,
        ),
        Change::InsertDeadLetter {
            producer,
            message,
            payload,
            reason,
            at,
        } => insert_dead_letter(
            connection,
            producer.as_deref(),
            message,
            payload,
            reason,
            at,
        ),
        Change::ObserveDeadLetter {
            producer,
            message_id,
            observations,
            at,
        } => observe_dead_letter(
            connection,
            producer.as_deref(),
            message_id,
            *observations,
            at,
        ),
        other => unreachable!("not a message's own row: {other:?}"),
    }
}

/// Writes the aggregate's row. Most deliveries only move its position (the status and the time
/// it began unchanged): those update the one column in place, one seek and no index entry
/// rewritten, where the upsert also replaced the row's entry in the status index every time.
/// A new row gets 0 in the seed's `total` column, which the inbox does not own (an
/// application's handler may); an existing row keeps it.
fn put_aggregate(
    connection: &WriterConnection<'_>,
    aggregate_id: &str,
    row: &AggregateRow,
) -> rusqlite::Result<()> {
    let moved = connection
        .prepared(
            "UPDATE aggregate_state SET last_sequence = ?2
              WHERE aggregate_id = ?1 AND status = ?3 AND status_since IS ?4",
        )?
        .execute(params![
            aggregate_id,
            row.last,
            row.status.as_str(),
            row.since
        ])?;
    if moved == 1 {
        return Ok(());
    }
    connection
        .prepared(
            "INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
             VALUES (?1, ?2, 0, ?3, ?4)
             ON CONFLICT(aggregate_id) DO UPDATE SET
                 last_sequence = excluded.last_sequence,
                 status = excluded.status,
                 status_since = excluded.status_since",
        )?
        .execute(params![
            aggregate_id,
            row.last,
            row.status.as_str(),
            row.since
        ])?;
    Ok(())
}

/// The applied message's row, carrying its `applied` event (schema version 7): the event's
/// number and the handler's detail (schema version 10), rather than a timeline row of its own.
fn insert_applied(
    connection: &WriterConnection<'_>,
    producer: Option<&str>,
    message: &OrderedMessage,
    payload: &str,
    applied_at: &str,
    detail: &Detail,
) -> rusqlite::Result<()> {
    advance_event_counter(connection)?;
    let detail = TimelineDetail::applied_json(detail);
    connection
        .prepared(
            "INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, applied_at,
                                       producer, event_id, applied_detail)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, (SELECT last_id FROM timeline_ids WHERE id = 1), ?7)",
        )?
        .execute(params![
            message.message_id,
            payload,
            message.aggregate_id,
            message.sequence,
            applied_at,
            namespace(producer),
            detail
        ])?;
    Ok(())
}

fn insert_dead_letter(
    connection: &WriterConnection<'_>,
    producer: Option<&str>,
    message: &OrderedMessage,
    payload: &str,
    reason: &QuarantineReason,
    at: &str,
) -> rusqlite::Result<()> {
    connection
        .prepared(
            "INSERT INTO deadletters(id, message_id, reason, aggregate_id, sequence, payload,
                                     first_seen, last_seen, observations, status, producer)
             VALUES ((SELECT IFNULL(MAX(id), 0) + 1 FROM deadletters),
                     ?1, ?2, ?3, ?4, ?5, ?6, ?6, 1, 'open', ?7)",
        )?
        .execute(params![
            message.message_id,
            reason.as_str(),
            message.aggregate_id,
            message.sequence,
            payload,
            at,
            namespace(producer)
        ])?;
    Ok(())
}

fn observe_dead_letter(
    connection: &WriterConnection<'_>,
    producer: Option<&str>,
    message_id: &str,
    observations: i64,
    at: &str,
) -> rusqlite::Result<()> {
    connection
        .prepared(
            "UPDATE deadletters SET observations = ?2, last_seen = ?3
              WHERE producer = ?4 AND message_id = ?1",
        )?
        .execute(params![message_id, observations, at, namespace(producer)])?;
    Ok(())
}

fn supersede_dead_letters(
    connection: &WriterConnection<'_>,
    aggregate_id: &str,
    message_ids: &[String],
    by: &str,
    at: &str,
) -> rusqlite::Result<()> {
    let mut statement = connection.prepared(
        "UPDATE deadletters SET status = 'superseded', superseded_by = ?2, closed_at = ?3
          WHERE aggregate_id = ?4 AND message_id = ?1 AND status = 'open'",
    )?;
    for message_id in message_ids {
        statement.execute(params![message_id, by, at, aggregate_id])?;
    }
    Ok(())
}

fn resolve_dead_letter(
    connection: &WriterConnection<'_>,
    producer: Option<&str>,
    message_id: &str,
    at: &str,
) -> rusqlite::Result<()> {
    connection
        .prepared(
            "UPDATE deadletters SET status = 'resolved', closed_at = ?2
              WHERE producer = ?3 AND message_id = ?1",
        )?
        .execute(params![message_id, at, namespace(producer)])?;
    Ok(())
}

/// A held message: its canonical content, and the payload as delivered, which a drain hands
/// to the handler.
fn insert_held(
    connection: &WriterConnection<'_>,
    claim: Option<&ProducerClaim>,
    message: &OrderedMessage,
    payload: &str,
    at: &str,
) -> rusqlite::Result<()> {
    connection
        .prepared(
            "INSERT INTO held_messages(producer, epoch, message_id, aggregate_id, sequence,
                                       payload, message_payload, held_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?
        .execute(params![
            namespace(claim.map(|claim| claim.producer.as_str())),
            claim.map(|claim| claim.epoch),
            message.message_id,
            message.aggregate_id,
            message.sequence,
            payload,
            message.payload.to_string(),
            at
        ])?;
    Ok(())
}

fn release_held(
    connection: &WriterConnection<'_>,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<()> {
    connection
        .prepared("DELETE FROM held_messages WHERE producer = ?1 AND message_id = ?2")?
        .execute(params![namespace(producer), message_id])?;
    Ok(())
}

/// The aggregate's owner columns, with the aggregate's row if it has none yet (last 0,
/// flowing; 0 in the seed's `total`, as [`put_aggregate`] writes).
fn set_owner(
    connection: &WriterConnection<'_>,
    aggregate_id: &str,
    owner: &AggregateOwner,
    at: &str,
) -> rusqlite::Result<()> {
    connection
        .prepared(
            "INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since,
                                         owner, owner_epoch, owner_since)
             VALUES (?1, 0, 0, 'flowing', ?4, ?2, ?3, ?4)
             ON CONFLICT(aggregate_id) DO UPDATE SET
                 owner = excluded.owner,
                 owner_epoch = excluded.owner_epoch,
                 owner_since = excluded.owner_since",
        )?
        .execute(params![aggregate_id, owner.producer, owner.epoch, at])?;
    Ok(())
}

/// The single writer serializes every delivery: one row per producer costs nothing.
fn touch_producer(
    connection: &WriterConnection<'_>,
    producer: &str,
    at: &str,
) -> rusqlite::Result<()> {
    connection
        .prepared("UPDATE producers SET last_delivery_at = ?2 WHERE name = ?1")?
        .execute(params![producer, at])?;
    Ok(())
}

fn record_transfer(
    connection: &WriterConnection<'_>,
    record: &TransferRecord,
) -> rusqlite::Result<()> {
    connection
        .prepared(
            "INSERT INTO ownership_transfers(aggregate_id, operator, from_owner, to_owner, epoch,
                                             last, reason, transferred_at, held_rejected)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?
        .execute(params![
            record.aggregate_id,
            record.operator,
            record.from_owner,
            record.to_owner,
            record.epoch,
            record.last,
            record.reason,
            record.transferred_at,
            i64::try_from(record.held_rejected).unwrap_or(i64::MAX)
        ])?;
    Ok(())
}

/// The audit row, its link from the dead letter, and its `resolved` event (whose detail carries
/// the id the row got). Returns that id.
fn record_resolution(
    connection: &WriterConnection<'_>,
    record: &ResolutionRecord,
) -> rusqlite::Result<i64> {
    let replacement = record.replacement.as_ref();
    let state = |state: &Option<serde_json::Value>| state.as_ref().map(ToString::to_string);
    let id: i64 = connection
        .prepare_cached(&format!(
            "INSERT INTO resolutions(id, message_id, aggregate_id, sequence, action, operator,
                                         reason, expected_last, replacement_message_id,
                                         replacement_payload, before_last, before_state,
                                         after_last, after_state, resolved_at, producer)
                 VALUES (({}), ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
                 RETURNING id",
            NEXT_RESOLUTION_ID
        ))?
        .query_row(
            params![
                record.message_id,
                record.aggregate_id,
                record.sequence,
                record.action.as_str(),
                record.operator,
                record.reason,
                record.expected_last,
                replacement.map(|replacement| replacement.message_id.as_str()),
                replacement.map(|replacement| replacement.payload.to_string()),
                record.before.last,
                state(&record.before.state),
                record.after.last,
                state(&record.after.state),
                record.resolved_at,
                namespace(record.producer.as_deref()),
            ],
            |row| row.get(0),
        )?;
    connection
        .prepared(
            "UPDATE deadletters SET resolution_id = ?2 WHERE producer = ?3 AND message_id = ?1",
        )?
        .execute(params![
            record.message_id,
            id,
            namespace(record.producer.as_deref())
        ])?;
    append(connection, &resolved_event(record, id))?;
    Ok(id)
}

/// The next number of an audit row, gap or dead letter: one past the highest of both tables, so
/// that one trail lists both in order.
const NEXT_RESOLUTION_ID: &str = "
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

fn note_gap(
    connection: &WriterConnection<'_>,
    aggregate_id: &str,
    last: i64,
    sequence: i64,
) -> rusqlite::Result<()> {
    connection
        .prepared(NOTE_GAP)?
        .execute(params![aggregate_id, last, sequence])?;
    Ok(())
}

/// The audit row and its `gap skipped` event. Returns the row's number.
fn record_gap_resolution(
    connection: &WriterConnection<'_>,
    record: &GapRecord,
) -> rusqlite::Result<i64> {
    let id: i64 = connection
        .prepared(NEXT_RESOLUTION_ID)?
        .query_row([], |row| row.get(0))?;
    let state = |state: &Option<serde_json::Value>| state.as_ref().map(ToString::to_string);
    connection
        .prepared(
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
    append(connection, &gap_skipped_event(record, id))?;
    Ok(id)
}

/// Takes the next number of a timeline event; the insert that follows reads it as
/// `(SELECT last_id FROM timeline_ids WHERE id = 1)`. Timeline rows and applied inbox rows share
/// one sequence, so the view can merge them in the order they happened. (Not `RETURNING`: SQLite
/// collects returned rows in a temporary B-tree, which cost more than the insert it numbers.)
/// A file whose counter row is gone fails the write rather than store events without numbers.
fn advance_event_counter(connection: &WriterConnection<'_>) -> rusqlite::Result<()> {
    let changed = connection
        .prepared("UPDATE timeline_ids SET last_id = last_id + 1 WHERE id = 1")?
        .execute([])?;
    match changed {
        1 => Ok(()),
        other => Err(rusqlite::Error::StatementChangedRows(other)),
    }
}

/// Appends a timeline entry. An observation is numbered per aggregate and the ones that fell out
/// of the newest [`OBSERVATIONS_KEPT`] are dropped; both statements seek the partial index on
/// `(aggregate_id, observation_no)`, so the cost does not grow with the history.
pub(super) fn append(
    connection: &WriterConnection<'_>,
    entry: &TimelineEntry,
) -> rusqlite::Result<()> {
    let detail = entry.detail.to_json();
    advance_event_counter(connection)?;
    if !entry.kind.is_observation() {
        connection
            .prepared(
                "INSERT INTO aggregate_timeline(id, aggregate_id, at, kind, sequence, message_id,
                                                detail)
                 VALUES ((SELECT last_id FROM timeline_ids WHERE id = 1), ?1, ?2, ?3, ?4, ?5, ?6)",
            )?
            .execute(params![
                entry.aggregate_id,
                entry.at,
                entry.kind.as_str(),
                entry.sequence,
                entry.message_id,
                detail,
            ])?;
        return Ok(());
    }
    let number: i64 = connection.prepared(OBSERVATION_INSERT)?.query_row(
        params![
            entry.aggregate_id,
            entry.at,
            entry.kind.as_str(),
            entry.sequence,
            entry.message_id,
            detail,
        ],
        |row| row.get(0),
    )?;
    if number > OBSERVATIONS_KEPT {
        connection
            .prepared(OBSERVATION_PRUNE)?
            .execute(params![entry.aggregate_id, number - OBSERVATIONS_KEPT])?;
    }
    Ok(())
}

pub(super) const OBSERVATION_INSERT: &str = "
INSERT INTO aggregate_timeline(id, aggregate_id, at, kind, sequence, message_id, detail,
                               observation_no)
VALUES ((SELECT last_id FROM timeline_ids WHERE id = 1), ?1, ?2, ?3, ?4, ?5, ?6,
        COALESCE((SELECT observation_no FROM aggregate_timeline
                   WHERE aggregate_id = ?1 AND observation_no IS NOT NULL
                   ORDER BY observation_no DESC LIMIT 1), 0) + 1)
RETURNING observation_no";

pub(super) const OBSERVATION_PRUNE: &str = "
DELETE FROM aggregate_timeline
 WHERE aggregate_id = ?1 AND observation_no IS NOT NULL AND observation_no <= ?2";
