//! The SQLite side of a delivery and a resolution: read the facts, let the core decide, write the
//! decided changes. Call these inside one write transaction (the store's writer runs each unit so
//! that its failure rolls back only its own changes): the facts and the writes then see one
//! snapshot, and the single writer serializes every aggregate. Every statement is a primary-key or index seek, prepared once per
//! connection.

use std::str::FromStr;

use rusqlite::types::Type;
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::store::StoreError;
use super::views;
use crate::delivery::{
    AppliedMessage, Change, DeliveryFacts, HeldMessage, KnownDeadLetter, OpenDeadLetter, Outcome,
    decide_delivery,
};
use crate::model::{AggregateRow, AggregateStatus, Door, Limits, OrderedMessage, UnknownValue};
use crate::producers::AggregateOwner;
use crate::resolution::{
    DeadLetterFact, Mode, Refusal, ResolutionError, ResolutionFacts, ResolutionRequest, Resolved,
    decide_resolution, resolved_event,
};
use crate::timeline::{OBSERVATIONS_KEPT, TimelineDetail, TimelineEntry, TimelineKind};
use crate::views::{CurrentState, ResolutionRecord};

/// Decides and records one delivery. `now` stamps every row it writes.
pub fn deliver_in(
    connection: &Connection,
    message: &OrderedMessage,
    door: Door,
    limits: &Limits,
    now: &str,
) -> Result<Outcome, StoreError> {
    let facts = delivery_facts(connection, None, message)?.facts;
    let plan = decide_delivery(message, door, &facts, limits, now);
    write_changes(connection, &plan.changes)?;
    Ok(plan.outcome)
}

/// Checks the preconditions and resolves the dead letter, or (dry run) reports what that would
/// do and writes nothing.
pub fn resolve_in(
    connection: &Connection,
    request: &ResolutionRequest,
    mode: Mode,
    limits: &Limits,
    now: &str,
) -> Result<Resolved, ResolutionError> {
    let facts = resolution_facts(connection, request).map_err(StoreError::from)?;
    let plan = match decide_resolution(request, &facts, limits, mode, now) {
        Ok(plan) => plan,
        Err(refusal) => return Err(refusal_error(connection, request, refusal)),
    };
    let resolution_id = write_changes(connection, &plan.changes).map_err(StoreError::from)?;
    Ok(match plan.resolved {
        Resolved::New(record) => Resolved::New(ResolutionRecord {
            resolution_id,
            ..record
        }),
        other => other,
    })
}

fn refusal_error(
    connection: &Connection,
    request: &ResolutionRequest,
    refusal: Refusal,
) -> ResolutionError {
    match refusal {
        Refusal::NotFound => ResolutionError::NotFound(request.dead_letter_id.clone()),
        Refusal::ReplacementQuarantined(reason) => ResolutionError::ReplacementQuarantined(reason),
        Refusal::Unauthorized => ResolutionError::Unauthorized,
        Refusal::Conflict(kind) => match current_state(
            connection,
            request.producer.as_deref(),
            &request.dead_letter_id,
        ) {
            Ok(current) => ResolutionError::Conflict {
                kind,
                current: Box::new(current),
            },
            Err(error) => ResolutionError::Store(StoreError::from(error).into()),
        },
    }
}

/// The aggregate and the dead letter as they are now, for a refusal's body.
pub fn current_state(
    connection: &Connection,
    producer: Option<&str>,
    dead_letter_id: &str,
) -> rusqlite::Result<CurrentState> {
    let dead_letter = views::dead_letter(connection, producer, dead_letter_id)?;
    let aggregate = match dead_letter
        .as_ref()
        .and_then(|dead| dead.aggregate_id.as_deref())
    {
        Some(aggregate_id) => views::aggregate_summary(connection, aggregate_id)?,
        None => None,
    };
    Ok(CurrentState {
        aggregate,
        dead_letter,
    })
}

/// A stored status or kind, read through its `FromStr`.
pub(super) fn parsed<T: FromStr<Err = UnknownValue>>(
    row: &Row<'_>,
    index: usize,
) -> rusqlite::Result<T> {
    let text: String = row.get(index)?;
    text.parse().map_err(|error| {
        rusqlite::Error::FromSqlConversionFailure(index, Type::Text, Box::new(error))
    })
}

/// The column value of a namespace: `''` is the anonymous one.
pub(super) fn namespace(producer: Option<&str>) -> &str {
    producer.unwrap_or("")
}

/// A delivery's facts and the owner of its aggregate, as one read found them.
pub(super) struct DeliveryRead {
    pub facts: DeliveryFacts,
    pub owner: Option<AggregateOwner>,
}

/// The facts of a delivery whose id is in `producer`'s namespace (`None`: anonymous). Held
/// messages are anonymous (only the broker door holds), so a producer's id is never held.
///
/// One statement reads every seek's rows ([`DELIVERY_FACTS`]); only a blocked aggregate needs a
/// second for its open dead letters.
pub(super) fn delivery_facts(
    connection: &Connection,
    producer: Option<&str>,
    message: &OrderedMessage,
) -> rusqlite::Result<DeliveryRead> {
    let mut read = DeliveryRead {
        facts: DeliveryFacts::default(),
        owner: None,
    };
    let mut statement = connection.prepare_cached(DELIVERY_FACTS)?;
    let mut rows = statement.query(params![
        namespace(producer),
        message.message_id,
        message.aggregate_id
    ])?;
    while let Some(row) = rows.next()? {
        let facts = &mut read.facts;
        match row.get(0)? {
            FACT_AGGREGATE => {
                facts.aggregate = Some(aggregate_from(row, 1)?);
                read.owner = owner_from(row.get(5)?, row.get(6)?);
                facts.owner = read.owner.clone();
            }
            FACT_APPLIED => facts.applied = Some(applied_from(row, 1)?),
            FACT_DEAD_LETTER => facts.dead_letter = Some(dead_letter_from(row, 1)?),
            FACT_HELD_ID => facts.held_message = Some(held_from(row, 1)?),
            _ => facts.held.push(held_from(row, 1)?),
        }
    }
    read.facts
        .held
        .sort_unstable_by_key(|row| row.message.sequence);
    read.facts.open_dead_letters =
        open_dead_letters(connection, &message.aggregate_id, &read.facts.aggregate)?;
    Ok(read)
}

/// The owner columns of an aggregate's row: no owner, or the producer and its epoch.
pub(super) fn owner_from(producer: Option<String>, epoch: Option<i64>) -> Option<AggregateOwner> {
    producer.map(|producer| AggregateOwner {
        producer,
        epoch: epoch.unwrap_or(0),
    })
}

const FACT_AGGREGATE: i64 = 0;
const FACT_APPLIED: i64 = 1;
const FACT_DEAD_LETTER: i64 = 2;
const FACT_HELD_ID: i64 = 3;

/// Every seek a delivery needs, as one statement whose first column says which fact a row is:
/// the aggregate's row (0), the id applied (1), the id quarantined (2), the id held (3; anonymous
/// ids only) and the aggregate's held messages (4, sorted by the caller: an `ORDER BY` here would
/// be re-prepared on every run). One statement instead of five: each statement's cache lookup,
/// binding, stepping and reset cost more than its index seek.
const DELIVERY_FACTS: &str = "
SELECT 0, last_sequence, total, status, status_since, owner, owner_epoch
  FROM aggregate_state WHERE aggregate_id = ?3
UNION ALL
SELECT 1, payload, sequence, applied_at, NULL, NULL, NULL
  FROM ordered_inbox WHERE producer = ?1 AND message_id = ?2
UNION ALL
SELECT 2, payload, reason, status, observations, NULL, NULL
  FROM deadletters WHERE producer = ?1 AND message_id = ?2
UNION ALL
SELECT 3, message_id, aggregate_id, sequence, amount, payload, held_at
  FROM held_messages WHERE ?1 = '' AND message_id = ?2
UNION ALL
SELECT 4, message_id, aggregate_id, sequence, amount, payload, held_at
  FROM held_messages WHERE aggregate_id = ?3";

fn resolution_facts(
    connection: &Connection,
    request: &ResolutionRequest,
) -> rusqlite::Result<ResolutionFacts> {
    let producer = request.producer.as_deref();
    let dead_letter = connection
        .prepare_cached(
            "SELECT status, aggregate_id, sequence FROM deadletters
              WHERE producer = ?1 AND message_id = ?2",
        )?
        .query_row(
            params![namespace(producer), request.dead_letter_id],
            |row| {
                Ok(DeadLetterFact {
                    status: parsed(row, 0)?,
                    aggregate_id: row.get(1)?,
                    sequence: row.get(2)?,
                })
            },
        )
        .optional()?;
    let aggregate = match dead_letter.as_ref().and_then(|d| d.aggregate_id.as_deref()) {
        Some(aggregate_id) => aggregate_row(connection, aggregate_id)?,
        None => None,
    };
    let open_dead_letters = match dead_letter.as_ref().and_then(|d| d.aggregate_id.as_deref()) {
        Some(aggregate_id) => open_dead_letters(connection, aggregate_id, &aggregate)?,
        None => Vec::new(),
    };
    let (replacement_applied, replacement_dead_letter, replacement_held) = match &request.action {
        crate::Action::Replace { message_id, .. } => (
            applied_message(connection, producer, message_id)?,
            known_dead_letter(connection, producer, message_id)?,
            match producer {
                None => held_message(connection, message_id)?,
                Some(_) => None,
            },
        ),
        crate::Action::Skip => (None, None, None),
    };
    let (held, owner) = match dead_letter.as_ref().and_then(|d| d.aggregate_id.as_deref()) {
        Some(aggregate_id) => (
            held_for(connection, aggregate_id)?,
            super::producers::ownership_state(connection, aggregate_id)?.owner,
        ),
        None => (Vec::new(), None),
    };
    Ok(ResolutionFacts {
        recorded: views::resolution_of(connection, producer, &request.dead_letter_id)?,
        operator_active: super::operators::is_active(connection, &request.operator)?,
        dead_letter,
        aggregate,
        open_dead_letters,
        replacement_applied,
        replacement_dead_letter,
        replacement_held,
        held,
        owner,
    })
}

fn aggregate_row(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Option<AggregateRow>> {
    connection
        .prepare_cached(
            "SELECT last_sequence, total, status, status_since
               FROM aggregate_state WHERE aggregate_id = ?1",
        )?
        .query_row([aggregate_id], |row| aggregate_from(row, 0))
        .optional()
}

/// An aggregate's row from four columns (last, total, status, since), the first at `first`.
fn aggregate_from(row: &Row<'_>, first: usize) -> rusqlite::Result<AggregateRow> {
    Ok(AggregateRow {
        last: row.get(first)?,
        total: row.get(first + 1)?,
        status: parsed(row, first + 2)?,
        since: row.get(first + 3)?,
    })
}

/// Only a blocked aggregate has open dead letters, so only a blocked one is asked.
fn open_dead_letters(
    connection: &Connection,
    aggregate_id: &str,
    aggregate: &Option<AggregateRow>,
) -> rusqlite::Result<Vec<OpenDeadLetter>> {
    if aggregate.as_ref().map(|row| row.status) != Some(AggregateStatus::Blocked) {
        return Ok(Vec::new());
    }
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

fn applied_message(
    connection: &Connection,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Option<AppliedMessage>> {
    connection
        .prepare_cached(
            "SELECT payload, sequence, applied_at FROM ordered_inbox
              WHERE producer = ?1 AND message_id = ?2",
        )?
        .query_row(params![namespace(producer), message_id], |row| {
            applied_from(row, 0)
        })
        .optional()
}

/// An applied message from three columns (payload, sequence, applied_at), the first at `first`.
fn applied_from(row: &Row<'_>, first: usize) -> rusqlite::Result<AppliedMessage> {
    Ok(AppliedMessage {
        payload: row.get(first)?,
        sequence: row.get(first + 1)?,
        applied_at: row.get(first + 2)?,
    })
}

/// The columns [`held_from_row`] reads, in its order.
const HELD_BY_MESSAGE_ID: &str = "SELECT message_id, aggregate_id, sequence, amount, payload, \
     held_at FROM held_messages WHERE message_id = ?1";

fn held_from_row(row: &Row<'_>) -> rusqlite::Result<HeldMessage> {
    held_from(row, 0)
}

/// A held message from six columns in [`HELD_BY_MESSAGE_ID`]'s order, the first at `first`.
fn held_from(row: &Row<'_>, first: usize) -> rusqlite::Result<HeldMessage> {
    Ok(HeldMessage {
        message: OrderedMessage {
            message_id: row.get(first)?,
            aggregate_id: row.get(first + 1)?,
            sequence: row.get(first + 2)?,
            amount: row.get(first + 3)?,
        },
        payload: row.get(first + 4)?,
        held_at: row.get(first + 5)?,
    })
}

fn held_message(
    connection: &Connection,
    message_id: &str,
) -> rusqlite::Result<Option<HeldMessage>> {
    connection
        .prepare_cached(HELD_BY_MESSAGE_ID)?
        .query_row([message_id], held_from_row)
        .optional()
}

/// The aggregate's held messages (a seek on its unique index), in sequence order.
///
/// Sorted here rather than with `ORDER BY`: SQLite re-prepares that statement on every run
/// (`held_rows_are_read_without_re_preparing` shows it), which cost more than the delivery's own
/// writes. The rows are few: at most `Limits::max_held_per_aggregate`.
pub(super) fn held_for(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Vec<HeldMessage>> {
    let mut held: Vec<HeldMessage> = connection
        .prepare_cached(HELD_FOR_AGGREGATE)?
        .query_map([aggregate_id], held_from_row)?
        .collect::<rusqlite::Result<_>>()?;
    held.sort_unstable_by_key(|row| row.message.sequence);
    Ok(held)
}

const HELD_FOR_AGGREGATE: &str = "SELECT message_id, aggregate_id, sequence, amount, payload, \
     held_at FROM held_messages WHERE aggregate_id = ?1";

fn known_dead_letter(
    connection: &Connection,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Option<KnownDeadLetter>> {
    connection
        .prepare_cached(
            "SELECT payload, reason, status, observations FROM deadletters
              WHERE producer = ?1 AND message_id = ?2",
        )?
        .query_row(params![namespace(producer), message_id], |row| {
            dead_letter_from(row, 0)
        })
        .optional()
}

/// A known dead letter from four columns (payload, reason, status, observations), the first at
/// `first`.
fn dead_letter_from(row: &Row<'_>, first: usize) -> rusqlite::Result<KnownDeadLetter> {
    Ok(KnownDeadLetter {
        payload: row.get(first)?,
        reason: parsed(row, first + 1)?,
        status: parsed(row, first + 2)?,
        observations: row.get(first + 3)?,
    })
}

/// Writes the decided changes in order. Returns the id of the resolution row, if one was written.
pub(super) fn write_changes(
    connection: &Connection,
    changes: &[Change],
) -> rusqlite::Result<Option<i64>> {
    let mut resolution_id = None;
    let mut changes = changes.iter().peekable();
    while let Some(change) = changes.next() {
        match change {
            Change::PutAggregate { aggregate_id, row } => {
                put_aggregate(connection, aggregate_id, row)?;
            }
            Change::InsertApplied {
                producer,
                message,
                payload,
                applied_at,
            } => {
                // The plan's next entry is this message's `applied` event: it is stored on the
                // row (schema version 7) instead of as a timeline row of its own.
                let total_after = changes
                    .peek()
                    .and_then(|next| applied_total(next, message, applied_at));
                if total_after.is_some() {
                    changes.next();
                    advance_event_counter(connection)?;
                }
                connection
                    .prepare_cached(
                        "INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence,
                                                   amount, applied_at, producer, event_id,
                                                   total_after)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7,
                                 CASE WHEN ?8 IS NOT NULL
                                      THEN (SELECT last_id FROM timeline_ids WHERE id = 1) END,
                                 ?8)",
                    )?
                    .execute(params![
                        message.message_id,
                        payload,
                        message.aggregate_id,
                        message.sequence,
                        message.amount,
                        applied_at,
                        namespace(producer.as_deref()),
                        total_after
                    ])?;
            }
            Change::InsertDeadLetter {
                producer,
                message,
                payload,
                reason,
                at,
            } => {
                connection
                    .prepare_cached(
                        "INSERT INTO deadletters(id, message_id, reason, aggregate_id, sequence,
                                                 payload, first_seen, last_seen, observations,
                                                 status, producer)
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
                        namespace(producer.as_deref())
                    ])?;
            }
            Change::ObserveDeadLetter {
                producer,
                message_id,
                observations,
                at,
            } => {
                connection
                    .prepare_cached(
                        "UPDATE deadletters SET observations = ?2, last_seen = ?3
                          WHERE producer = ?4 AND message_id = ?1",
                    )?
                    .execute(params![
                        message_id,
                        observations,
                        at,
                        namespace(producer.as_deref())
                    ])?;
            }
            Change::SupersedeDeadLetters {
                aggregate_id,
                message_ids,
                by,
                at,
            } => {
                let mut statement = connection.prepare_cached(
                    "UPDATE deadletters SET status = 'superseded', superseded_by = ?2,
                                            closed_at = ?3
                      WHERE aggregate_id = ?4 AND message_id = ?1 AND status = 'open'",
                )?;
                for message_id in message_ids {
                    statement.execute(params![message_id, by, at, aggregate_id])?;
                }
            }
            Change::ResolveDeadLetter {
                producer,
                message_id,
                at,
            } => {
                connection
                    .prepare_cached(
                        "UPDATE deadletters SET status = 'resolved', closed_at = ?2
                          WHERE producer = ?3 AND message_id = ?1",
                    )?
                    .execute(params![message_id, at, namespace(producer.as_deref())])?;
            }
            Change::InsertHeld {
                message,
                payload,
                at,
            } => {
                connection
                    .prepare_cached(
                        "INSERT INTO held_messages(message_id, aggregate_id, sequence, amount,
                                                   payload, held_at)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    )?
                    .execute(params![
                        message.message_id,
                        message.aggregate_id,
                        message.sequence,
                        message.amount,
                        payload,
                        at
                    ])?;
            }
            Change::ReleaseHeld { message_id } => {
                connection
                    .prepare_cached("DELETE FROM held_messages WHERE message_id = ?1")?
                    .execute([message_id])?;
            }
            Change::RecordRejected(entry) => super::rejected::insert(connection, entry)?,
            Change::SetOwner {
                aggregate_id,
                owner,
                at,
            } => {
                connection
                    .prepare_cached(
                        "INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status,
                                                     status_since, owner, owner_epoch, owner_since)
                         VALUES (?1, 0, 0, 'flowing', ?4, ?2, ?3, ?4)
                         ON CONFLICT(aggregate_id) DO UPDATE SET
                             owner = excluded.owner,
                             owner_epoch = excluded.owner_epoch,
                             owner_since = excluded.owner_since",
                    )?
                    .execute(params![aggregate_id, owner.producer, owner.epoch, at])?;
            }
            // The single writer serializes every delivery: one row per producer costs nothing.
            Change::TouchProducer { producer, at, .. } => {
                connection
                    .prepare_cached("UPDATE producers SET last_delivery_at = ?2 WHERE name = ?1")?
                    .execute(params![producer, at])?;
            }
            Change::RecordTransfer(record) => {
                connection
                    .prepare_cached(
                        "INSERT INTO ownership_transfers(aggregate_id, operator, from_owner,
                                                         to_owner, epoch, last, reason,
                                                         transferred_at, held_rejected)
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
            }
            Change::Append(entry) => append(connection, entry)?,
            Change::RecordResolution(record) => {
                let id = record_resolution(connection, record)?;
                append(connection, &resolved_event(record, id))?;
                resolution_id = Some(id);
            }
        }
    }
    Ok(resolution_id)
}

/// The total after `message`, when `change` is exactly its `applied` event: the one the timeline
/// view derives from the inbox row (same aggregate, sequence, id, time and amount).
fn applied_total(change: &Change, message: &OrderedMessage, applied_at: &str) -> Option<i64> {
    let Change::Append(entry) = change else {
        return None;
    };
    let TimelineDetail::Applied { amount, total } = entry.detail else {
        return None;
    };
    let same = entry.kind == TimelineKind::Applied
        && entry.aggregate_id == message.aggregate_id
        && entry.sequence == Some(message.sequence)
        && entry.message_id.as_deref() == Some(message.message_id.as_str())
        && entry.at == applied_at
        && amount == message.amount;
    same.then_some(total)
}

/// Takes the next number of a timeline event; the insert that follows reads it as
/// `(SELECT last_id FROM timeline_ids WHERE id = 1)`. Timeline rows and applied inbox rows share
/// one sequence, so the view can merge them in the order they happened. (Not `RETURNING`: SQLite
/// collects returned rows in a temporary B-tree, which cost more than the insert it numbers.)
/// A file whose counter row is gone fails the write rather than store events without numbers.
fn advance_event_counter(connection: &Connection) -> rusqlite::Result<()> {
    let changed = connection
        .prepare_cached("UPDATE timeline_ids SET last_id = last_id + 1 WHERE id = 1")?
        .execute([])?;
    match changed {
        1 => Ok(()),
        other => Err(rusqlite::Error::StatementChangedRows(other)),
    }
}

/// Writes the aggregate's row. Most deliveries only move its position (the status and the time
/// it began unchanged): those update the two columns in place, one seek and no index entry
/// rewritten, where the upsert also replaced the row's entry in the status index every time.
fn put_aggregate(
    connection: &Connection,
    aggregate_id: &str,
    row: &AggregateRow,
) -> rusqlite::Result<()> {
    let moved = connection
        .prepare_cached(
            "UPDATE aggregate_state SET last_sequence = ?2, total = ?3
              WHERE aggregate_id = ?1 AND status = ?4 AND status_since IS ?5",
        )?
        .execute(params![
            aggregate_id,
            row.last,
            row.total,
            row.status.as_str(),
            row.since
        ])?;
    if moved == 1 {
        return Ok(());
    }
    connection
        .prepare_cached(
            "INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(aggregate_id) DO UPDATE SET
                 last_sequence = excluded.last_sequence,
                 total = excluded.total,
                 status = excluded.status,
                 status_since = excluded.status_since",
        )?
        .execute(params![
            aggregate_id,
            row.last,
            row.total,
            row.status.as_str(),
            row.since
        ])?;
    Ok(())
}

fn record_resolution(connection: &Connection, record: &ResolutionRecord) -> rusqlite::Result<i64> {
    let (replacement_id, replacement_amount) = match &record.replacement {
        Some(replacement) => (
            Some(replacement.message_id.as_str()),
            Some(replacement.amount),
        ),
        None => (None, None),
    };
    let id: i64 = connection
        .prepare_cached(
            "INSERT INTO resolutions(message_id, aggregate_id, sequence, action, operator, reason,
                                     expected_last, replacement_message_id, replacement_amount,
                                     before_last, before_total, after_last, after_total,
                                     resolved_at, producer)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
             RETURNING id",
        )?
        .query_row(
            params![
                record.message_id,
                record.aggregate_id,
                record.sequence,
                record.action.as_str(),
                record.operator,
                record.reason,
                record.expected_last,
                replacement_id,
                replacement_amount,
                record.before.last,
                record.before.total,
                record.after.last,
                record.after.total,
                record.resolved_at,
                namespace(record.producer.as_deref()),
            ],
            |row| row.get(0),
        )?;
    connection
        .prepare_cached(
            "UPDATE deadletters SET resolution_id = ?2 WHERE producer = ?3 AND message_id = ?1",
        )?
        .execute(params![
            record.message_id,
            id,
            namespace(record.producer.as_deref())
        ])?;
    Ok(id)
}

/// Appends a timeline entry. An observation is numbered per aggregate and the ones that fell out
/// of the newest [`OBSERVATIONS_KEPT`] are dropped; both statements seek the partial index on
/// `(aggregate_id, observation_no)`, so the cost does not grow with the history.
fn append(connection: &Connection, entry: &TimelineEntry) -> rusqlite::Result<()> {
    let detail = entry.detail.to_json();
    advance_event_counter(connection)?;
    if !entry.kind.is_observation() {
        connection
            .prepare_cached(
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
    let number: i64 = connection.prepare_cached(OBSERVATION_INSERT)?.query_row(
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
            .prepare_cached(OBSERVATION_PRUNE)?
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

#[cfg(test)]
mod tests {
    use super::*;

    use rusqlite::types::ValueRef;

    use crate::model::{DeadLetterStatus, QuarantineReason};
    use crate::resolution::Action;
    use crate::sqlite::schema::{migrated_in_memory as migrated, query_plan};
    use crate::timeline::{TimelineDetail, TimelineKind};
    use crate::views::PageRequest;

    fn message(id: &str, aggregate: &str, sequence: i64, amount: i64) -> OrderedMessage {
        OrderedMessage {
            message_id: id.into(),
            aggregate_id: aggregate.into(),
            sequence,
            amount,
        }
    }

    fn deliver(connection: &Connection, message: &OrderedMessage, at: &str) -> Outcome {
        deliver_in(connection, message, Door::General, &Limits::default(), at).unwrap()
    }

    fn rows(connection: &Connection, sql: &str) -> Vec<String> {
        let mut statement = connection.prepare(sql).unwrap();
        let columns = statement.column_count();
        let mut query = statement.query([]).unwrap();
        let mut rows = Vec::new();
        while let Some(row) = query.next().unwrap() {
            let values: Vec<String> = (0..columns)
                .map(|i| match row.get_ref(i).unwrap() {
                    ValueRef::Null => "NULL".to_owned(),
                    ValueRef::Integer(n) => n.to_string(),
                    ValueRef::Real(x) => x.to_string(),
                    ValueRef::Text(t) | ValueRef::Blob(t) => String::from_utf8_lossy(t).into(),
                })
                .collect();
            rows.push(values.join("|"));
        }
        rows
    }

    fn snapshot(connection: &Connection) -> Vec<String> {
        [
            "aggregate_state",
            "deadletters",
            "ordered_inbox",
            "aggregate_timeline",
            "resolutions",
        ]
        .iter()
        .flat_map(|table| rows(connection, &format!("SELECT * FROM {table}")))
        .collect()
    }

    /// Every event of the aggregate's timeline, walked `limit` at a time, as
    /// `id|kind|sequence|detail`.
    fn walked_timeline(connection: &Connection, aggregate: &str, limit: i64) -> Vec<String> {
        let mut seen = Vec::new();
        let mut after = 0;
        loop {
            let page =
                views::timeline(connection, aggregate, PageRequest { after, limit }).unwrap();
            assert!(page.items.len() <= limit as usize);
            seen.extend(page.items.iter().map(|event| {
                let detail = event
                    .detail
                    .as_ref()
                    .map(|d| d.to_string())
                    .unwrap_or_default();
                format!(
                    "{}|{}|{}|{}",
                    event.id,
                    event.kind.as_str(),
                    event.sequence.unwrap_or(0),
                    detail
                )
            }));
            match page.next {
                Some(next) => after = next,
                None => return seen,
            }
        }
    }

    #[test]
    fn an_applied_event_is_stored_on_its_inbox_row_and_paged_in_order_with_the_others() {
        let connection = migrated();
        deliver(&connection, &message("m-1", "a", 1, 5), "t1");
        deliver(&connection, &message("m-3", "a", 3, 1), "t2"); // a gap
        deliver(&connection, &message("p-2", "a", 2, -1), "t3"); // quarantined
        deliver(&connection, &message("m-2", "a", 2, 2), "t4"); // supersedes p-2, applies
        deliver(&connection, &message("m-3", "a", 3, 3), "t5");
        deliver(&connection, &message("b-1", "b", 1, 7), "t6"); // another aggregate, between
        deliver(&connection, &message("m-4", "a", 4, 4), "t7");
        assert_eq!(
            rows(
                &connection,
                "SELECT COUNT(*) FROM aggregate_timeline WHERE kind = 'applied'"
            ),
            ["0"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id, event_id IS NOT NULL, total_after FROM ordered_inbox
                  WHERE aggregate_id = 'a' ORDER BY sequence"
            ),
            ["m-1|1|5", "m-2|1|7", "m-3|1|10", "m-4|1|14"]
        );
        let whole = walked_timeline(&connection, "a", 100);
        let kinds: Vec<&str> = whole.iter().map(|e| e.split('|').nth(1).unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "applied",
                "gap",
                "quarantined",
                "applied",
                "superseded",
                "applied",
                "applied"
            ]
        );
        assert!(
            whole[0].ends_with(r#"|1|{"amount":5,"total":5}"#),
            "{}",
            whole[0]
        );
        let ids: Vec<i64> = whole
            .iter()
            .map(|e| e.split('|').next().unwrap().parse().unwrap())
            .collect();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "{ids:?}");
        for limit in 1..=4 {
            assert_eq!(
                walked_timeline(&connection, "a", limit),
                whole,
                "pages of {limit}"
            );
        }
        assert_eq!(walked_timeline(&connection, "b", 1).len(), 1);
    }

    #[test]
    fn a_file_without_its_event_counter_refuses_the_write_instead_of_losing_the_event() {
        let connection = migrated();
        connection.execute("DELETE FROM timeline_ids", []).unwrap();
        let refused = deliver_in(
            &connection,
            &message("m-1", "a", 1, 5),
            Door::General,
            &Limits::default(),
            "t1",
        );
        assert!(refused.is_err());
    }

    #[test]
    fn a_new_id_at_the_quarantined_sequence_supersedes_the_dead_letter_in_the_rows() {
        let connection = migrated();
        deliver(&connection, &message("p", "a", 1, -1), "t1");
        let outcome = deliver(&connection, &message("fix", "a", 1, 2), "t2");
        assert_eq!(
            outcome,
            Outcome::Applied {
                sequence: 1,
                total: 2,
                superseded: vec!["p".into()]
            }
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT status, superseded_by, closed_at FROM deadletters WHERE message_id = 'p'"
            ),
            ["superseded|fix|t2"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT last_sequence, total, status, status_since FROM aggregate_state"
            ),
            ["1|2|flowing|t2"]
        );
    }

    #[test]
    fn a_resolution_writes_the_audit_row_and_a_dry_run_writes_nothing() {
        let connection = migrated();
        connection
            .execute(
                "INSERT INTO operators(name, token_hash, created_at) VALUES ('alice', 'h', 't')",
                [],
            )
            .unwrap();
        deliver(&connection, &message("m-1", "a", 1, 5), "t0");
        deliver(&connection, &message("poison-2", "a", 2, -1), "t0");
        let skip = ResolutionRequest {
            producer: None,
            dead_letter_id: "poison-2".into(),
            operator: "alice".into(),
            action: Action::Skip,
            expected_last: 1,
            reason: "duplicate order".into(),
        };
        let before = snapshot(&connection);
        let limits = Limits::default();
        let rehearsal = resolve_in(&connection, &skip, Mode::DryRun, &limits, "t1").unwrap();
        assert_eq!(snapshot(&connection), before);
        let Resolved::New(record) =
            resolve_in(&connection, &skip, Mode::Commit, &limits, "t1").unwrap()
        else {
            panic!("expected a resolution");
        };
        assert_eq!(record.resolution_id, Some(1));
        assert_eq!(
            rehearsal,
            Resolved::DryRun(ResolutionRecord {
                resolution_id: None,
                ..record.clone()
            })
        );
        assert_eq!(
            views::resolution_of(&connection, None, "poison-2").unwrap(),
            Some(record)
        );
        let event = rows(
            &connection,
            "SELECT kind, detail FROM aggregate_timeline WHERE kind = 'resolved'",
        );
        assert_eq!(
            event,
            [format!(
                "resolved|{}",
                TimelineDetail::Resolved {
                    resolution_id: 1,
                    action: crate::ActionKind::Skip,
                    operator: "alice".into(),
                    reason: "duplicate order".into(),
                    replacement_message_id: None
                }
                .to_json()
            )]
        );
        let refused = resolve_in(
            &connection,
            &ResolutionRequest {
                reason: "again".into(),
                ..skip
            },
            Mode::Commit,
            &limits,
            "t2",
        )
        .unwrap_err();
        let ResolutionError::Conflict { current, .. } = refused else {
            panic!("expected a conflict, got {refused:?}");
        };
        assert_eq!(current.aggregate.map(|a| a.last), Some(2));
        assert_eq!(
            current.dead_letter.map(|d| d.status),
            Some(DeadLetterStatus::Resolved)
        );
    }

    #[test]
    fn observations_keep_only_the_newest_hundred_per_aggregate() {
        let connection = migrated();
        for sequence in 0..250 {
            let entry = TimelineEntry {
                aggregate_id: "a".into(),
                at: "t".into(),
                kind: TimelineKind::Gap,
                sequence: Some(sequence),
                message_id: Some("m".into()),
                detail: TimelineDetail::Expected { expected: 1 },
            };
            append(&connection, &entry).unwrap();
        }
        let state_event = TimelineEntry {
            aggregate_id: "b".into(),
            at: "t".into(),
            kind: TimelineKind::Quarantined,
            sequence: None,
            message_id: None,
            detail: TimelineDetail::Quarantined {
                reason: QuarantineReason::NegativeAmount,
                amount: -1,
            },
        };
        append(&connection, &state_event).unwrap();
        assert_eq!(
            rows(
                &connection,
                "SELECT COUNT(*), MIN(sequence) FROM aggregate_timeline WHERE aggregate_id = 'a'"
            ),
            ["100|150"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = 'b'"
            ),
            ["1"]
        );
    }

    #[test]
    fn recording_an_observation_never_scans_the_timeline() {
        let connection = migrated();
        for sql in [
            OBSERVATION_PRUNE,
            "SELECT observation_no FROM aggregate_timeline
              WHERE aggregate_id = ?1 AND observation_no IS NOT NULL
              ORDER BY observation_no DESC LIMIT ?2",
        ] {
            let details = query_plan(&connection, sql, params!["a", 1]);
            assert!(
                details.iter().all(|d| !d.starts_with("SCAN")),
                "{details:?}"
            );
        }
    }

    #[test]
    fn held_rows_are_read_without_re_preparing() {
        let connection = migrated();
        // Held out of order, so the sort has something to do.
        for (id, sequence) in [("m-4", 4), ("m-2", 2), ("m-3", 3)] {
            deliver_in(
                &connection,
                &message(id, "a", sequence, 1),
                Door::Broker,
                &Limits::default(),
                "t1",
            )
            .unwrap();
        }
        let next = message("m-5", "a", 5, 1);
        for _ in 0..20 {
            let by_resolution = held_for(&connection, "a").unwrap();
            let by_delivery = delivery_facts(&connection, None, &next).unwrap().facts.held;
            for held in [by_resolution, by_delivery] {
                let sequences: Vec<i64> = held.iter().map(|row| row.message.sequence).collect();
                assert_eq!(sequences, [2, 3, 4]);
            }
        }
        for sql in [HELD_FOR_AGGREGATE, DELIVERY_FACTS] {
            let statement = connection.prepare_cached(sql).unwrap();
            assert_eq!(
                statement.get_status(rusqlite::StatementStatus::RePrepare),
                0,
                "every delivery reads the held rows; a re-prepare per read is a parse per delivery"
            );
        }
    }

    #[test]
    fn the_aggregate_row_and_its_status_index_follow_every_delivery() {
        let connection = migrated();
        let by_status = |status: &str| {
            rows(
                &connection,
                &format!(
                    "SELECT aggregate_id, last_sequence, total, status_since FROM aggregate_state
                      INDEXED BY ix_aggregate_state_status WHERE status = '{status}'"
                ),
            )
        };
        deliver(&connection, &message("m-1", "a", 1, 5), "t1");
        deliver(&connection, &message("m-2", "a", 2, 3), "t2");
        assert_eq!(by_status("flowing"), ["a|2|8|t1"]);
        deliver(&connection, &message("m-3", "a", 3, -1), "t3");
        assert_eq!(by_status("blocked"), ["a|2|8|t3"]);
        assert!(by_status("flowing").is_empty());
        deliver(&connection, &message("m-3b", "a", 3, 4), "t4");
        deliver(&connection, &message("m-4", "a", 4, 1), "t5");
        assert_eq!(by_status("flowing"), ["a|4|13|t4"]);
        assert!(by_status("blocked").is_empty());
        assert_eq!(rows(&connection, "PRAGMA integrity_check"), ["ok"]);
    }

    #[test]
    fn a_delivery_reads_its_facts_by_index_seeks_only() {
        let connection = migrated();
        let details = query_plan(&connection, DELIVERY_FACTS, params!["", "m-1", "a"]);
        let seeks = details.iter().filter(|d| d.starts_with("SEARCH")).count();
        assert_eq!(seeks, 5, "{details:?}");
        assert!(
            details.iter().all(|d| !d.starts_with("SCAN")),
            "{details:?}"
        );
    }

    #[test]
    fn one_read_finds_every_fact_of_a_delivery() {
        let connection = migrated();
        deliver(&connection, &message("m-1", "a", 1, 1), "t1");
        deliver(&connection, &message("m-3", "a", 3, 1), "t2");
        deliver_in(
            &connection,
            &message("m-4", "a", 4, 1),
            Door::Broker,
            &Limits::default(),
            "t3",
        )
        .unwrap();
        let applied = delivery_facts(&connection, None, &message("m-1", "a", 1, 1)).unwrap();
        assert_eq!(applied.facts.applied.unwrap().sequence, Some(1));
        assert_eq!(applied.facts.aggregate.unwrap().last, 1);
        let gap = delivery_facts(&connection, None, &message("m-3", "a", 3, 1)).unwrap();
        assert!(gap.facts.applied.is_none());
        assert_eq!(gap.facts.held.len(), 1);
        let held = delivery_facts(&connection, None, &message("m-4", "a", 4, 1)).unwrap();
        assert_eq!(held.facts.held_message.unwrap().message.sequence, 4);
        let producers = delivery_facts(&connection, Some("p"), &message("m-1", "a", 1, 1)).unwrap();
        assert!(producers.facts.applied.is_none() && producers.facts.held_message.is_none());
        assert!(producers.owner.is_none());
    }

    #[test]
    fn held_rows_are_written_by_the_broker_door_and_drained_by_the_predecessor() {
        let connection = migrated();
        let broker = |message: &OrderedMessage| {
            deliver_in(&connection, message, Door::Broker, &Limits::default(), "t1").unwrap()
        };
        assert!(matches!(
            broker(&message("m-3", "a", 3, 3)),
            Outcome::Held { held: 1, .. }
        ));
        assert!(matches!(
            broker(&message("m-2", "a", 2, 2)),
            Outcome::Held { held: 2, .. }
        ));
        assert!(matches!(
            broker(&message("m-2", "a", 2, 2)),
            Outcome::Held { repeated: true, .. }
        ));
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id, sequence FROM held_messages ORDER BY sequence"
            ),
            ["m-2|2", "m-3|3"]
        );
        assert_eq!(
            rows(&connection, "SELECT status FROM aggregate_state"),
            ["waiting"]
        );
        let view = views::aggregate_view(&connection, "a").unwrap().unwrap();
        assert_eq!((view.held_sequences, view.held_count), (vec![2, 3], 2));
        broker(&message("m-1", "a", 1, 1));
        assert!(rows(&connection, "SELECT * FROM held_messages").is_empty());
        assert_eq!(
            rows(
                &connection,
                "SELECT last_sequence, total, status FROM aggregate_state"
            ),
            ["3|6|flowing"]
        );
        let timeline = views::timeline(
            &connection,
            "a",
            PageRequest {
                after: 0,
                limit: 50,
            },
        )
        .unwrap()
        .items
        .into_iter()
        .map(|event| format!("{}|{}", event.kind.as_str(), event.sequence.unwrap_or(0)))
        .collect::<Vec<_>>();
        assert_eq!(
            timeline,
            [
                "held|3",
                "held|2",
                "applied|1",
                "drained|2",
                "applied|2",
                "drained|3",
                "applied|3"
            ]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id FROM ordered_inbox ORDER BY sequence"
            ),
            ["m-1", "m-2", "m-3"]
        );
    }
}
