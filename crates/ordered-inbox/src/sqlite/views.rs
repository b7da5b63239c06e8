//! The evidence, read back from the SQLite rows. Every query seeks an index; lists are bounded by
//! the caller's limit and paged by a cursor.

use rusqlite::{Connection, OptionalExtension, Row, params};
use serde_json::Value;

use super::handler::SqliteHandler;
use super::rows::{json, namespace, optional_json, parsed};
use crate::error::HandlerError;
use crate::model::{AggregateStatus, Position, QuarantineReason};
use crate::records::{Replacement, ResolutionRecord};
use crate::timeline::TimelineKind;
use crate::views::{
    AggregateCounts, AggregateSummary, AggregateView, AppliedMessage, DeadLetterFilter,
    DeadLetterView, HELD_SHOWN, InboxHealth, InventoryEntry, OPEN_DEAD_LETTERS_SHOWN, Page,
    PageRequest, ProducerView, ResolutionSummary, Summaries, TimelineEvent,
};

/// The aggregate's summary row (`None`: never recorded).
pub fn aggregate_summary(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Option<AggregateSummary>> {
    connection
        .prepare_cached(
            "SELECT aggregate_id, last_sequence, status, status_since
               FROM aggregate_state WHERE aggregate_id = ?1",
        )?
        .query_row([aggregate_id], summary_from_row)
        .optional()
}

fn summary_from_row(row: &Row<'_>) -> rusqlite::Result<AggregateSummary> {
    let last: i64 = row.get(1)?;
    Ok(AggregateSummary {
        aggregate_id: row.get(0)?,
        last,
        expected: last.saturating_add(1),
        status: parsed(row, 2)?,
        since: row.get(3)?,
        state: None,
    })
}

/// Gives each of `view`'s summaries the handler's `state` of its aggregate, read on the same
/// connection: inside the caller's transaction, one snapshot with the summaries.
pub fn add_states(
    connection: &Connection,
    handler: &dyn SqliteHandler,
    view: &mut impl Summaries,
) -> Result<(), HandlerError> {
    for summary in view.summaries() {
        summary.state = handler.state(connection, &summary.aggregate_id)?;
    }
    Ok(())
}

/// The aggregate's view: its summary and open dead letters (`None`: never recorded).
pub fn aggregate_view(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Option<AggregateView>> {
    let Some(summary) = aggregate_summary(connection, aggregate_id)? else {
        return Ok(None);
    };
    let filter = DeadLetterFilter {
        status: Some(crate::model::DeadLetterStatus::Open),
        aggregate_id: Some(aggregate_id.to_owned()),
    };
    let page = PageRequest {
        after: 0,
        limit: OPEN_DEAD_LETTERS_SHOWN,
    };
    let open = dead_letters(connection, &filter, page)?;
    let open_dead_letter_count = open_count(connection, aggregate_id)?;
    let held_sequences = connection
        .prepare_cached(
            "SELECT sequence FROM held_messages WHERE aggregate_id = ?1 ORDER BY sequence LIMIT +?2",
        )?
        .query_map(params![aggregate_id, HELD_SHOWN], |row| row.get(0))?
        .collect::<rusqlite::Result<Vec<i64>>>()?;
    let held_count = connection
        .prepare_cached("SELECT COUNT(*) FROM held_messages WHERE aggregate_id = ?1")?
        .query_row([aggregate_id], |row| row.get(0))?;
    let refused = refused_at(connection, aggregate_id, summary.last)?;
    let (missing, waiting_since) =
        crate::gaps::waiting(&summary, refused, held_sequences.first().copied());
    Ok(Some(AggregateView {
        missing,
        waiting_since,
        summary,
        open_dead_letters_truncated: open.next.is_some(),
        open_dead_letters: open.items,
        open_dead_letter_count,
        held_sequences,
        held_count,
    }))
}

fn open_count(connection: &Connection, aggregate_id: &str) -> rusqlite::Result<i64> {
    connection
        .prepare_cached(
            "SELECT COUNT(*) FROM deadletters WHERE aggregate_id = ?1 AND status = 'open'",
        )?
        .query_row([aggregate_id], |row| row.get(0))
}

/// The lowest sequence refused as a gap at the aggregate's current last, if any.
fn refused_at(
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

/// Aggregates in `status`, the longest-standing first.
pub fn inventory(
    connection: &Connection,
    status: AggregateStatus,
    now: &str,
    limit: i64,
) -> rusqlite::Result<Vec<InventoryEntry>> {
    connection
        .prepare_cached(
            "SELECT a.aggregate_id, a.last_sequence, a.status, a.status_since,
                    CAST(ROUND((julianday(?2) - julianday(a.status_since)) * 86400) AS INTEGER),
                    (SELECT COUNT(*) FROM deadletters d
                      WHERE d.aggregate_id = a.aggregate_id AND d.status = 'open'),
                    (SELECT COUNT(*) FROM held_messages h WHERE h.aggregate_id = a.aggregate_id),
                    (SELECT g.lowest FROM refused_gaps g
                      WHERE g.aggregate_id = a.aggregate_id AND g.after_last = a.last_sequence),
                    (SELECT MIN(h.sequence) FROM held_messages h
                      WHERE h.aggregate_id = a.aggregate_id)
               FROM aggregate_state a
              WHERE a.status = ?1
              ORDER BY a.status_since, a.aggregate_id
              LIMIT +?3",
        )?
        .query_map(params![status.as_str(), now, limit], |row| {
            let summary = summary_from_row(row)?;
            let (missing, waiting_since) = crate::gaps::waiting(&summary, row.get(7)?, row.get(8)?);
            Ok(InventoryEntry {
                summary,
                age_seconds: row.get::<_, Option<i64>>(4)?.unwrap_or(0).max(0),
                open_dead_letters: row.get(5)?,
                held: row.get(6)?,
                missing,
                waiting_since,
            })
        })?
        .collect()
}

/// The operator's figures: one count per status (each a range of `ix_aggregate_state_status`),
/// the open dead letters (a range of `ix_deadletters_status_id`), the held messages (the whole
/// of `ix_held_messages_aggregate_sequence`, as small as the holds are), and the earliest
/// `status_since` among blocked aggregates (the first entry of that range of
/// `ix_aggregate_state_status`).
pub fn health(connection: &Connection, now: &str) -> rusqlite::Result<InboxHealth> {
    let mut aggregates = Vec::with_capacity(AggregateStatus::ALL.len());
    let mut count =
        connection.prepare_cached("SELECT COUNT(*) FROM aggregate_state WHERE status = ?1")?;
    for status in AggregateStatus::ALL {
        aggregates.push((
            *status,
            count.query_row([status.as_str()], |row| row.get(0))?,
        ));
    }
    let open_dead_letters = connection
        .prepare_cached("SELECT COUNT(*) FROM deadletters WHERE status = 'open'")?
        .query_row([], |row| row.get(0))?;
    let held_messages = connection
        .prepare_cached("SELECT COUNT(*) FROM held_messages")?
        .query_row([], |row| row.get(0))?;
    let longest = |status: AggregateStatus| {
        connection
            .prepare_cached(
                "SELECT (julianday(?1) - julianday(MIN(status_since))) * 86400
                   FROM aggregate_state WHERE status = ?2 AND status_since IS NOT NULL",
            )?
            .query_row(params![now, status.as_str()], |row| {
                row.get::<_, Option<f64>>(0)
            })
            .map(|seconds| seconds.map(|seconds| seconds.max(0.0)))
    };
    Ok(InboxHealth {
        aggregates,
        open_dead_letters,
        held_messages,
        longest_blocked_seconds: longest(AggregateStatus::Blocked)?,
        longest_waiting_seconds: longest(AggregateStatus::Waiting)?,
    })
}

const DEAD_LETTER_COLUMNS: &str = "
SELECT d.message_id, d.aggregate_id, d.sequence, d.payload, d.reason, d.first_seen, d.last_seen,
       d.observations, d.status, d.superseded_by, d.closed_at,
       r.id, r.action, r.operator, r.reason, r.resolved_at, r.replacement_message_id, d.id,
       NULLIF(d.producer, '')
  FROM deadletters d LEFT JOIN resolutions r ON r.id = d.resolution_id";

fn dead_letter_from_row(row: &Row<'_>) -> rusqlite::Result<DeadLetterView> {
    let payload: Option<String> = row.get(3)?;
    let resolution_id: Option<i64> = row.get(11)?;
    let resolution = match resolution_id {
        Some(resolution_id) => Some(ResolutionSummary {
            resolution_id,
            action: parsed(row, 12)?,
            operator: row.get(13)?,
            reason: row.get(14)?,
            resolved_at: row.get(15)?,
            replacement_message_id: row.get(16)?,
        }),
        None => None,
    };
    Ok(DeadLetterView {
        producer: row.get(18)?,
        message_id: row.get(0)?,
        aggregate_id: row.get(1)?,
        sequence: row.get(2)?,
        payload: optional_json(payload),
        reason: QuarantineReason::new(row.get::<_, String>(4)?),
        first_seen: row.get(5)?,
        last_seen: row.get(6)?,
        observations: row.get(7)?,
        status: parsed(row, 8)?,
        superseded_by: row.get(9)?,
        closed_at: row.get(10)?,
        resolution,
    })
}

/// One dead letter by its identity: `producer`'s namespace (`None`: anonymous) and message id.
pub fn dead_letter(
    connection: &Connection,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Option<DeadLetterView>> {
    connection
        .prepare_cached(&format!(
            "{DEAD_LETTER_COLUMNS} WHERE d.producer = ?1 AND d.message_id = ?2"
        ))?
        .query_row(
            params![namespace(producer), message_id],
            dead_letter_from_row,
        )
        .optional()
}

/// Dead letters in the order they were first recorded, after cursor `page.after`. Each filter
/// combination has its own statement so that each can seek its index.
pub fn dead_letters(
    connection: &Connection,
    filter: &DeadLetterFilter,
    page: PageRequest,
) -> rusqlite::Result<Page<DeadLetterView>> {
    let condition = match (filter.status, &filter.aggregate_id) {
        (Some(_), Some(_)) => "WHERE d.status = ?1 AND d.aggregate_id = ?2",
        (Some(_), None) => "WHERE d.status = ?1 AND ?2 IS NULL",
        (None, Some(_)) => "WHERE ?1 IS NULL AND d.aggregate_id = ?2",
        (None, None) => "WHERE ?1 IS NULL AND ?2 IS NULL",
    };
    let rows = connection
        .prepare_cached(&format!(
            "{DEAD_LETTER_COLUMNS} {condition} AND d.id > ?3 ORDER BY d.id LIMIT +?4"
        ))?
        .query_map(
            params![
                filter.status.map(|status| status.as_str()),
                filter.aggregate_id,
                page.after,
                page.limit.saturating_add(1)
            ],
            |row| Ok((row.get::<_, i64>(17)?, dead_letter_from_row(row)?)),
        )?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

/// The aggregate's timeline after event `page.after`, oldest first: its timeline rows merged
/// with the `applied` events its inbox rows carry (schema versions 7 and 10), by event number.
pub fn timeline(
    connection: &Connection,
    aggregate_id: &str,
    page: PageRequest,
) -> rusqlite::Result<Page<TimelineEvent>> {
    let wanted = page.limit.saturating_add(1);
    let mut events = recorded_events(connection, aggregate_id, page.after, wanted)?;
    events.extend(applied_events(
        connection,
        aggregate_id,
        page.after,
        wanted,
    )?);
    events.sort_unstable_by_key(|(id, _)| *id);
    Ok(Page::from_rows(events, page.limit))
}

/// The aggregate's timeline rows after event `after`: every kind but `applied`.
fn recorded_events(
    connection: &Connection,
    aggregate_id: &str,
    after: i64,
    wanted: i64,
) -> rusqlite::Result<Vec<(i64, TimelineEvent)>> {
    connection
        .prepare_cached(
            "SELECT id, at, kind, sequence, message_id, observation_no IS NOT NULL, detail
               FROM aggregate_timeline
              WHERE aggregate_id = ?1 AND id > ?2
              ORDER BY id LIMIT +?3",
        )?
        .query_map(params![aggregate_id, after, wanted], |row| {
            let detail: Option<String> = row.get(6)?;
            let event = TimelineEvent {
                id: row.get(0)?,
                at: row.get(1)?,
                kind: parsed(row, 2)?,
                sequence: row.get(3)?,
                message_id: row.get(4)?,
                observation: row.get(5)?,
                detail: detail.and_then(|text| serde_json::from_str(&text).ok()),
            };
            Ok((event.id, event))
        })?
        .collect()
}

/// The aggregate's `applied` events after event `after`, from its inbox rows.
fn applied_events(
    connection: &Connection,
    aggregate_id: &str,
    after: i64,
    wanted: i64,
) -> rusqlite::Result<Vec<(i64, TimelineEvent)>> {
    let from = first_sequence_applied_after(connection, aggregate_id, after)?;
    connection
        .prepare_cached(
            "SELECT event_id, applied_at, sequence, message_id, applied_detail
               FROM ordered_inbox
              WHERE aggregate_id = ?1 AND sequence >= ?2 AND event_id > ?3
              ORDER BY sequence LIMIT +?4",
        )?
        .query_map(params![aggregate_id, from, after, wanted], |row| {
            let detail: Option<String> = row.get(4)?;
            let event = TimelineEvent {
                id: row.get(0)?,
                at: row.get(1)?,
                kind: TimelineKind::Applied,
                sequence: row.get(2)?,
                message_id: row.get(3)?,
                observation: false,
                detail: detail.and_then(|text| serde_json::from_str(&text).ok()),
            };
            Ok((event.id, event))
        })?
        .collect()
}

/// The first sequence whose inbox row carries an event after `after`. One aggregate's applied
/// events are numbered in sequence order (each applies the sequence after the last, and rows
/// from before the timeline, without a number, come first), so a binary search over the
/// `(aggregate_id, sequence)` index finds it in a few dozen seeks however long the history.
fn first_sequence_applied_after(
    connection: &Connection,
    aggregate_id: &str,
    after: i64,
) -> rusqlite::Result<i64> {
    if after <= 0 {
        return Ok(i64::MIN);
    }
    let (lowest, highest): (Option<i64>, Option<i64>) = connection
        .prepare_cached(
            "SELECT (SELECT MIN(sequence) FROM ordered_inbox WHERE aggregate_id = ?1),
                    (SELECT MAX(sequence) FROM ordered_inbox WHERE aggregate_id = ?1)",
        )?
        .query_row([aggregate_id], |row| Ok((row.get(0)?, row.get(1)?)))?;
    let (Some(mut low), Some(highest)) = (lowest, highest) else {
        return Ok(i64::MIN);
    };
    let mut probe = connection.prepare_cached(
        "SELECT event_id FROM ordered_inbox
          WHERE aggregate_id = ?1 AND sequence >= ?2 ORDER BY sequence LIMIT 1",
    )?;
    // Invariant: the first row at or after `high` is after `after`, or there is none.
    let mut high = highest.saturating_add(1);
    while low < high {
        let middle = low + (high - low) / 2;
        let event: Option<Option<i64>> = probe
            .query_row(params![aggregate_id, middle], |row| row.get(0))
            .optional()?;
        let is_after = match event {
            None => true,
            Some(number) => number.is_some_and(|number| number > after),
        };
        if is_after {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    Ok(low)
}

const RESOLUTION_COLUMNS: &str = "
SELECT id, message_id, aggregate_id, sequence, action, operator, reason, expected_last,
       replacement_message_id, replacement_payload, before_last, before_state, after_last,
       after_state, resolved_at, NULLIF(producer, '')
  FROM resolutions";

fn resolution_from_row(row: &Row<'_>) -> rusqlite::Result<ResolutionRecord> {
    let replacement_id: Option<String> = row.get(8)?;
    let replacement_payload: Option<String> = row.get(9)?;
    Ok(ResolutionRecord {
        resolution_id: row.get(0)?,
        producer: row.get(15)?,
        message_id: row.get(1)?,
        aggregate_id: row.get(2)?,
        sequence: row.get(3)?,
        action: parsed(row, 4)?,
        operator: row.get(5)?,
        reason: row.get(6)?,
        expected_last: row.get(7)?,
        replacement: replacement_id.map(|message_id| Replacement {
            message_id,
            payload: optional_json(replacement_payload).unwrap_or(Value::Null),
        }),
        before: Position {
            last: row.get(10)?,
            state: optional_json(row.get(11)?),
        },
        after: Position {
            last: row.get(12)?,
            state: optional_json(row.get(13)?),
        },
        resolved_at: row.get(14)?,
    })
}

/// The resolution of a dead letter, if it has one.
pub fn resolution_of(
    connection: &Connection,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Option<ResolutionRecord>> {
    connection
        .prepare_cached(&format!(
            "{RESOLUTION_COLUMNS} WHERE producer = ?1 AND message_id = ?2"
        ))?
        .query_row(
            params![namespace(producer), message_id],
            resolution_from_row,
        )
        .optional()
}

/// The audit trail after resolution `page.after`, oldest first, optionally for one aggregate.
pub fn resolutions(
    connection: &Connection,
    aggregate_id: Option<&str>,
    page: PageRequest,
) -> rusqlite::Result<Page<ResolutionRecord>> {
    let condition = if aggregate_id.is_some() {
        "WHERE aggregate_id = ?1 AND id > ?2"
    } else {
        "WHERE ?1 IS NULL AND id > ?2"
    };
    let rows = connection
        .prepare_cached(&format!(
            "{RESOLUTION_COLUMNS} {condition} ORDER BY id LIMIT +?3"
        ))?
        .query_map(
            params![aggregate_id, page.after, page.limit.saturating_add(1)],
            |row| {
                let record = resolution_from_row(row)?;
                Ok((record.resolution_id.unwrap_or(0), record))
            },
        )?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

/// The aggregate's applied messages after sequence `page.after`, in sequence order (the unique
/// index on `(aggregate_id, sequence)` serves both the seek and the order).
pub fn applied_messages(
    connection: &Connection,
    aggregate_id: &str,
    page: PageRequest,
) -> rusqlite::Result<Page<AppliedMessage>> {
    let rows = connection
        .prepare_cached(
            "SELECT message_id, aggregate_id, sequence, payload, applied_at,
                    NULLIF(producer, '')
               FROM ordered_inbox
              WHERE aggregate_id = ?1 AND sequence > ?2
              ORDER BY sequence LIMIT +?3",
        )?
        .query_map(
            params![aggregate_id, page.after, page.limit.saturating_add(1)],
            |row| {
                let message = AppliedMessage {
                    producer: row.get(5)?,
                    message_id: row.get(0)?,
                    aggregate_id: row.get(1)?,
                    sequence: row.get(2)?,
                    payload: json(row.get(3)?),
                    applied_at: row.get(4)?,
                };
                Ok((message.sequence.unwrap_or(0), message))
            },
        )?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

/// Applied messages, dead letters and last sequence of one aggregate.
/// Each named aggregate's lowest held message's payload as delivered (a seek on the unique
/// index per aggregate); aggregates holding nothing are left out.
pub fn lowest_held_payloads(
    connection: &Connection,
    aggregate_ids: &[String],
) -> rusqlite::Result<Vec<(String, String)>> {
    let mut statement = connection.prepare_cached(
        "SELECT COALESCE(message_payload, payload) FROM held_messages
          WHERE aggregate_id = ?1 ORDER BY sequence LIMIT 1",
    )?;
    let mut payloads = Vec::new();
    for aggregate_id in aggregate_ids {
        let payload: Option<String> = statement
            .query_row([aggregate_id], |row| row.get(0))
            .optional()?;
        if let Some(payload) = payload {
            payloads.push((aggregate_id.clone(), payload));
        }
    }
    Ok(payloads)
}

/// How many messages the aggregate applied and dead-lettered, and its last sequence.
pub fn counts(connection: &Connection, aggregate_id: &str) -> rusqlite::Result<AggregateCounts> {
    connection
        .prepare_cached(
            "SELECT (SELECT COUNT(*) FROM ordered_inbox WHERE aggregate_id = ?1),
                    (SELECT COUNT(*) FROM deadletters WHERE aggregate_id = ?1),
                    COALESCE((SELECT last_sequence FROM aggregate_state
                               WHERE aggregate_id = ?1), 0)",
        )?
        .query_row([aggregate_id], |row| {
            Ok(AggregateCounts {
                applied: row.get(0)?,
                dead_letters: row.get(1)?,
                last: row.get(2)?,
            })
        })
}

/// Every producer, the first registered first: never tokens.
pub fn producers(connection: &Connection) -> rusqlite::Result<Vec<ProducerView>> {
    connection
        .prepare_cached(
            "SELECT p.name, p.current_epoch, p.created_at, p.revoked_at, p.last_delivery_at,
                    (SELECT COUNT(*) FROM aggregate_state a WHERE a.owner = p.name)
               FROM producers p ORDER BY p.created_at, p.name",
        )?
        .query_map([], |row| {
            Ok(ProducerView {
                name: row.get(0)?,
                current_epoch: row.get(1)?,
                created_at: row.get(2)?,
                revoked_at: row.get(3)?,
                last_delivery_at: row.get(4)?,
                owned_aggregates: row.get(5)?,
            })
        })?
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqlite::WriterConnection;
    use crate::sqlite::schema::query_plan;

    #[test]
    fn per_aggregate_reads_seek_their_indexes() {
        let connection = crate::sqlite::schema::migrated_in_memory();
        let statements = [
            format!("{DEAD_LETTER_COLUMNS} WHERE d.status = 'open' AND d.aggregate_id = 'a' AND d.id > 0 ORDER BY d.id"),
            format!("{DEAD_LETTER_COLUMNS} WHERE d.status = 'open' AND d.id > 0 ORDER BY d.id"),
            format!("{DEAD_LETTER_COLUMNS} WHERE d.aggregate_id = 'a' AND d.id > 0 ORDER BY d.id"),
            format!("{DEAD_LETTER_COLUMNS} WHERE d.id > 0 ORDER BY d.id"),
            "SELECT id FROM aggregate_timeline WHERE aggregate_id = 'a' AND id > 0 ORDER BY id".to_owned(),
            "SELECT aggregate_id FROM aggregate_state WHERE status = 'blocked' ORDER BY status_since, aggregate_id".to_owned(),
            "SELECT COUNT(*) FROM deadletters d WHERE d.aggregate_id = 'a' AND d.status = 'open'".to_owned(),
            "SELECT message_id, sequence FROM deadletters WHERE aggregate_id = 'a' AND status = 'open'".to_owned(),
            "SELECT COUNT(*) FROM ordered_inbox WHERE aggregate_id = 'demo'".to_owned(),
            "SELECT sequence FROM held_messages WHERE aggregate_id = 'a' ORDER BY sequence".to_owned(),
            "SELECT COUNT(*) FROM held_messages h WHERE h.aggregate_id = 'a'".to_owned(),
            "SELECT message_id FROM ordered_inbox WHERE aggregate_id = 'a' AND sequence > 0 ORDER BY sequence".to_owned(),
            // The applied events of the timeline: the page and the binary search's probes.
            "SELECT event_id, applied_detail FROM ordered_inbox WHERE aggregate_id = 'a' AND sequence >= 3 AND event_id > 9 ORDER BY sequence LIMIT 5".to_owned(),
            "SELECT event_id FROM ordered_inbox WHERE aggregate_id = 'a' AND sequence >= 3 ORDER BY sequence LIMIT 1".to_owned(),
            "SELECT (SELECT MIN(sequence) FROM ordered_inbox WHERE aggregate_id = 'a'), (SELECT MAX(sequence) FROM ordered_inbox WHERE aggregate_id = 'a')".to_owned(),
            "SELECT COUNT(*) FROM aggregate_state WHERE status = 'waiting'".to_owned(),
            "SELECT COUNT(*) FROM deadletters WHERE status = 'open'".to_owned(),
            "SELECT MIN(status_since) FROM aggregate_state WHERE status = 'blocked' AND status_since IS NOT NULL".to_owned(),
            // A message's identity, (producer, message id), in every table that has one.
            "SELECT payload FROM ordered_inbox WHERE producer = 'billing' AND message_id = 'm'".to_owned(),
            "SELECT payload FROM deadletters WHERE producer = '' AND message_id = 'm'".to_owned(),
            format!("{DEAD_LETTER_COLUMNS} WHERE d.producer = 'billing' AND d.message_id = 'm'"),
            format!("{RESOLUTION_COLUMNS} WHERE producer = 'billing' AND message_id = 'm'"),
            "UPDATE deadletters SET status = 'superseded' WHERE aggregate_id = 'a' AND message_id = 'm' AND status = 'open'".to_owned(),
        ];
        for sql in statements {
            let details = query_plan(&connection, &sql, []);
            assert!(
                // A select of scalar subqueries reads SQLite's one constant row.
                details
                    .iter()
                    .all(|d| !d.starts_with("SCAN") || d == "SCAN CONSTANT ROW"),
                "{sql}: {details:?}"
            );
        }
    }

    #[test]
    fn health_counts_every_status_the_open_dead_letters_and_the_longest_block() {
        use crate::model::Door;
        use crate::sqlite::testing::{migrated, order, unit};
        let connection = migrated();
        let empty = health(&connection, "2026-01-01T00:10:00.000Z").unwrap();
        assert_eq!(
            empty.aggregates,
            [
                (AggregateStatus::Flowing, 0),
                (AggregateStatus::Waiting, 0),
                (AggregateStatus::Blocked, 0)
            ]
        );
        assert_eq!(
            (empty.open_dead_letters, empty.longest_blocked_seconds),
            (0, None)
        );

        let deliver = |id: &str, aggregate: &str, sequence, quantity, at: &str| {
            let message = order(id, aggregate, sequence, quantity);
            crate::sqlite::engine::deliver_in(
                unit(&WriterConnection::new(&connection), at),
                &message,
                Door::General,
            )
            .unwrap()
            .unwrap();
        };
        deliver("f1", "flowing", 1, 1, "2026-01-01T00:00:00.000Z");
        deliver("w1", "waiting", 1, 1, "2026-01-01T00:00:00.000Z");
        deliver("w3", "waiting", 3, 1, "2026-01-01T00:00:00.000Z");
        deliver("b1", "blocked-early", 1, -1, "2026-01-01T00:01:00.000Z");
        deliver("b1b", "blocked-early", 1, -2, "2026-01-01T00:02:00.000Z");
        deliver("c1", "blocked-late", 1, -1, "2026-01-01T00:05:00.000Z");
        // Through the broker door a message ahead of its turn is held (the aggregate waits).
        let ahead = order("h2", "holding", 2, 1);
        crate::sqlite::engine::deliver_in(
            unit(
                &WriterConnection::new(&connection),
                "2026-01-01T00:06:00.000Z",
            ),
            &ahead,
            Door::Broker,
        )
        .unwrap()
        .unwrap();

        let figures = health(&connection, "2026-01-01T00:10:00.000Z").unwrap();
        assert_eq!(
            figures.aggregates,
            [
                (AggregateStatus::Flowing, 1),
                (AggregateStatus::Waiting, 2),
                (AggregateStatus::Blocked, 2)
            ]
        );
        assert_eq!(figures.open_dead_letters, 3);
        assert_eq!(figures.held_messages, 1);
        let longest = figures.longest_blocked_seconds.unwrap();
        assert!((longest - 540.0).abs() < 0.01, "{longest}");
    }
}
