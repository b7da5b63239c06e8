//! The evidence, read back from the PostgreSQL rows: the same queries as the SQLite backend's,
//! each seeking an index; lists bounded by the caller's limit and paged by a cursor. A view made
//! of several statements reads them in one REPEATABLE READ snapshot, pipelined.

use futures_util::future::try_join_all;
use futures_util::join;
use serde_json::Value;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::connection::{Client, Counters, Failure};
use super::handler::PostgresHandler;
use super::rows::{json, namespace, optional_json, parsed};
use crate::clock;
use crate::model::{AggregateStatus, DeadLetterStatus, Position, QuarantineReason};
use crate::records::{Replacement, ResolutionRecord};
use crate::views::{
    AggregateCounts, AggregateSummary, AggregateView, AppliedMessage, DeadLetterFilter,
    DeadLetterView, HELD_SHOWN, InboxHealth, InventoryEntry, OPEN_DEAD_LETTERS_SHOWN, Page,
    PageRequest, ProducerView, ResolutionSummary, Summaries, TimelineEvent,
};

const AGGREGATE_SUMMARY: &str = "SELECT aggregate_id, last_sequence, status, status_since
  FROM aggregate_state WHERE aggregate_id = $1";
const OPEN_COUNT: &str =
    "SELECT COUNT(*) FROM deadletters WHERE aggregate_id = $1 AND status = 'open'";
const INVENTORY: &str = "
SELECT a.aggregate_id, a.last_sequence, a.status, a.status_since,
       (SELECT COUNT(*) FROM deadletters d
         WHERE d.aggregate_id = a.aggregate_id AND d.status = 'open'),
       (SELECT COUNT(*) FROM held_messages h WHERE h.aggregate_id = a.aggregate_id),
       (SELECT g.lowest FROM refused_gaps g
         WHERE g.aggregate_id = a.aggregate_id AND g.after_last = a.last_sequence),
       (SELECT MIN(h.sequence) FROM held_messages h WHERE h.aggregate_id = a.aggregate_id)
  FROM aggregate_state a
 WHERE a.status = $1
 ORDER BY a.status_since, a.aggregate_id
 LIMIT $2";
/// The lowest sequence refused as a gap at the aggregate's current last.
const REFUSED_AT_LAST: &str = "
SELECT g.lowest FROM refused_gaps g JOIN aggregate_state a ON a.aggregate_id = g.aggregate_id
 WHERE g.aggregate_id = $1 AND g.after_last = a.last_sequence";
const HELD_SEQUENCES: &str =
    "SELECT sequence FROM held_messages WHERE aggregate_id = $1 ORDER BY sequence LIMIT $2";
const LOWEST_HELD_PAYLOADS: &str = "
SELECT DISTINCT ON (aggregate_id) aggregate_id, message_payload
  FROM held_messages WHERE aggregate_id = ANY($1)
 ORDER BY aggregate_id, sequence";
const HELD_COUNT: &str = "SELECT COUNT(*) FROM held_messages WHERE aggregate_id = $1";
const APPLIED_MESSAGES: &str = "
SELECT message_id, aggregate_id, sequence, payload, applied_at, NULLIF(producer, '')
  FROM ordered_inbox
 WHERE aggregate_id = $1 AND sequence > $2 ORDER BY sequence LIMIT $3";
const DEAD_LETTER_COLUMNS: &str = "
SELECT d.message_id, d.aggregate_id, d.sequence, d.payload, d.reason, d.first_seen, d.last_seen,
       d.observations, d.status, d.superseded_by, d.closed_at,
       r.id, r.action, r.operator, r.reason, r.resolved_at, r.replacement_message_id, d.id,
       NULLIF(d.producer, '')
  FROM deadletters d LEFT JOIN resolutions r ON r.id = d.resolution_id";
const TIMELINE: &str = "
SELECT id, at, kind, sequence, message_id, observation_no IS NOT NULL, detail
  FROM aggregate_timeline
 WHERE aggregate_id = $1 AND id > $2
 ORDER BY id LIMIT $3";
const RESOLUTION_COLUMNS: &str = "
SELECT id, message_id, aggregate_id, sequence, action, operator, reason, expected_last,
       replacement_message_id, replacement_payload, before_last, before_state, after_last,
       after_state, resolved_at, NULLIF(producer, '')
  FROM resolutions";
pub(super) const RESOLUTION_OF: &str = "
SELECT id, message_id, aggregate_id, sequence, action, operator, reason, expected_last,
       replacement_message_id, replacement_payload, before_last, before_state, after_last,
       after_state, resolved_at, NULLIF(producer, '')
  FROM resolutions WHERE message_id = $1 AND producer = $2";
/// Every producer, the first registered first: never tokens.
const PRODUCERS: &str = "
SELECT p.name, p.current_epoch, p.created_at, p.revoked_at,
       (SELECT MAX(d.last_delivery_at) FROM producer_deliveries d WHERE d.producer = p.name),
       (SELECT COUNT(*) FROM aggregate_state a WHERE a.owner = p.name)
  FROM producers p ORDER BY p.created_at, p.name";
const COUNTS: &str = "
SELECT (SELECT COUNT(*) FROM ordered_inbox WHERE aggregate_id = $1),
       (SELECT COUNT(*) FROM deadletters WHERE aggregate_id = $1),
       COALESCE((SELECT last_sequence FROM aggregate_state WHERE aggregate_id = $1), 0)";

/// The operator's figures beside the per-status counts: open dead letters (a range of
/// `ix_deadletters_status_id`), the earliest `status_since` among blocked aggregates (the
/// first entry of that range of `ix_aggregate_state_status`), and the held messages.
const HEALTH: &str = "
SELECT (SELECT COUNT(*) FROM deadletters WHERE status = 'open'),
       (SELECT MIN(status_since) FROM aggregate_state WHERE status = 'blocked'),
       (SELECT COUNT(*) FROM held_messages),
       (SELECT MIN(status_since) FROM aggregate_state WHERE status = 'waiting')";

/// Aggregates per status (`ix_aggregate_state_status` leads with the status).
const STATUS_COUNTS: &str = "SELECT status, COUNT(*) FROM aggregate_state GROUP BY status";

const SNAPSHOT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

pub(super) async fn aggregate_summary(
    client: &Client,
    counters: &Counters,
    aggregate_id: &str,
) -> Result<Option<AggregateSummary>, Failure> {
    let statement = client.prepare_cached(AGGREGATE_SUMMARY).await?;
    let row = client.query_opt(&statement, &[&aggregate_id]).await;
    counters.trip();
    row?.map(|row| summary_from_row(&row)).transpose()
}

pub(super) fn summary_from_row(row: &Row) -> Result<AggregateSummary, Failure> {
    let last: i64 = row.try_get(1)?;
    Ok(AggregateSummary {
        aggregate_id: row.try_get(0)?,
        last,
        expected: last.saturating_add(1),
        status: parsed(row, 2)?,
        since: row.try_get(3)?,
        state: None,
    })
}

/// Gives each of `view`'s summaries the handler's `state` of its aggregate, read through
/// `client` inside the caller's transaction (one snapshot with the summaries), pipelined. The
/// handler's statements are its own: they are not counted as the inbox's round trips.
pub(super) async fn add_states(
    client: &Client,
    handler: &dyn PostgresHandler,
    view: &mut impl Summaries,
) -> Result<(), Failure> {
    let summaries = view.summaries();
    if summaries.is_empty() {
        return Ok(());
    }
    let reads = summaries.into_iter().map(|summary| async move {
        summary.state = handler.state(client, &summary.aggregate_id).await?;
        Ok::<_, crate::error::HandlerError>(())
    });
    try_join_all(reads)
        .await
        .map(|_| ())
        .map_err(Failure::Handler)
}

/// The aggregate with its first open dead letters and their count, and the handler's state of
/// it, in one snapshot.
pub(super) async fn aggregate_view(
    client: &Client,
    counters: &Counters,
    handler: &dyn PostgresHandler,
    aggregate_id: &str,
) -> Result<Option<AggregateView>, Failure> {
    let summary = client.prepare_cached(AGGREGATE_SUMMARY).await?;
    let count = client.prepare_cached(OPEN_COUNT).await?;
    let filter = DeadLetterFilter {
        status: Some(DeadLetterStatus::Open),
        aggregate_id: Some(aggregate_id.to_owned()),
    };
    let page = PageRequest {
        after: 0,
        limit: OPEN_DEAD_LETTERS_SHOWN,
    };
    let (list, list_params) = dead_letter_query(client, &filter, page).await?;
    let list_params: Vec<&(dyn ToSql + Sync)> = list_params
        .iter()
        .map(|value| value.as_ref() as &(dyn ToSql + Sync))
        .collect();
    let by_aggregate: [&(dyn ToSql + Sync); 1] = [&aggregate_id];
    let held = client.prepare_cached(HELD_SEQUENCES).await?;
    let held_count = client.prepare_cached(HELD_COUNT).await?;
    let held_params: [&(dyn ToSql + Sync); 2] = [&aggregate_id, &HELD_SHOWN];
    let refused = client.prepare_cached(REFUSED_AT_LAST).await?;
    let (begin, summary, open, count, held, held_count, refused) = join!(
        client.batch_execute(SNAPSHOT),
        client.query_opt(&summary, &by_aggregate),
        client.query(&list, &list_params),
        client.query_one(&count, &by_aggregate),
        client.query(&held, &held_params),
        client.query_one(&held_count, &by_aggregate),
        client.query_opt(&refused, &by_aggregate),
    );
    counters.trip();
    begin?;
    let refused: Option<i64> = match refused? {
        Some(row) => row.try_get(0)?,
        None => None,
    };
    let held_sequences = held?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<Vec<i64>, _>>()?;
    let held_count: i64 = held_count?.try_get(0)?;
    let mut view = match summary? {
        Some(summary) => {
            let open = dead_letter_page(&open?, page.limit)?;
            let summary = summary_from_row(&summary)?;
            let (missing, waiting_since) =
                crate::gaps::waiting(&summary, refused, held_sequences.first().copied());
            Some(AggregateView {
                missing,
                waiting_since,
                summary,
                open_dead_letters_truncated: open.next.is_some(),
                open_dead_letters: open.items,
                open_dead_letter_count: count?.try_get(0)?,
                held_sequences,
                held_count,
            })
        }
        None => None,
    };
    add_states(client, handler, &mut view).await?;
    commit(client, counters).await?;
    Ok(view)
}

/// Ends a read snapshot.
async fn commit(client: &Client, counters: &Counters) -> Result<(), Failure> {
    let committed = client.batch_execute("COMMIT").await;
    counters.trip();
    Ok(committed?)
}

/// Aggregates in `status`, the longest-standing first, with their age computed here from the
/// stored text (as the SQLite backend's `julianday` difference, rounded to whole seconds), and
/// the handler's state of each in the same snapshot.
pub(super) async fn inventory(
    client: &Client,
    counters: &Counters,
    handler: &dyn PostgresHandler,
    status: AggregateStatus,
    limit: i64,
) -> Result<Vec<InventoryEntry>, Failure> {
    let statement = client.prepare_cached(INVENTORY).await?;
    let parameters: [&(dyn ToSql + Sync); 2] = [&status.as_str(), &limit];
    let (begin, rows) = join!(
        client.batch_execute(SNAPSHOT),
        client.query(&statement, &parameters)
    );
    counters.trip();
    begin?;
    let mut entries = inventory_entries(&rows?)?;
    add_states(client, handler, &mut entries).await?;
    commit(client, counters).await?;
    Ok(entries)
}

fn inventory_entries(rows: &[Row]) -> Result<Vec<InventoryEntry>, Failure> {
    let now = clock::now();
    rows.iter()
        .map(|row| {
            let summary = summary_from_row(row)?;
            let age_seconds = summary
                .since
                .as_deref()
                .map_or(0, |since| clock::seconds_between(since, &now));
            let (missing, waiting_since) =
                crate::gaps::waiting(&summary, row.try_get(6)?, row.try_get(7)?);
            Ok(InventoryEntry {
                summary,
                age_seconds,
                open_dead_letters: row.try_get(4)?,
                held: row.try_get(5)?,
                missing,
                waiting_since,
            })
        })
        .collect()
}

fn dead_letter_from_row(row: &Row) -> Result<DeadLetterView, Failure> {
    let payload: Option<String> = row.try_get(3)?;
    let resolution_id: Option<i64> = row.try_get(11)?;
    let resolution = match resolution_id {
        Some(resolution_id) => Some(ResolutionSummary {
            resolution_id,
            action: parsed(row, 12)?,
            operator: row.try_get(13)?,
            reason: row.try_get(14)?,
            resolved_at: row.try_get(15)?,
            replacement_message_id: row.try_get(16)?,
        }),
        None => None,
    };
    Ok(DeadLetterView {
        producer: row.try_get(18)?,
        message_id: row.try_get(0)?,
        aggregate_id: row.try_get(1)?,
        sequence: row.try_get(2)?,
        payload: optional_json(payload),
        reason: QuarantineReason::new(row.try_get::<_, String>(4)?),
        first_seen: row.try_get(5)?,
        last_seen: row.try_get(6)?,
        observations: row.try_get(7)?,
        status: parsed(row, 8)?,
        superseded_by: row.try_get(9)?,
        closed_at: row.try_get(10)?,
        resolution,
    })
}

pub(super) async fn dead_letter(
    client: &Client,
    counters: &Counters,
    producer: Option<&str>,
    message_id: &str,
) -> Result<Option<DeadLetterView>, Failure> {
    let sql = format!("{DEAD_LETTER_COLUMNS} WHERE d.message_id = $1 AND d.producer = $2");
    let statement = client.prepare_cached(&sql).await?;
    let space = namespace(producer);
    let row = client.query_opt(&statement, &[&message_id, &space]).await;
    counters.trip();
    row?.map(|row| dead_letter_from_row(&row)).transpose()
}

type Params = Vec<Box<dyn ToSql + Sync + Send>>;

/// The statement and parameters of one dead-letter page. Each filter combination has its own
/// statement, so that each can seek its index; only fixed text is joined into the SQL.
async fn dead_letter_query(
    client: &Client,
    filter: &DeadLetterFilter,
    page: PageRequest,
) -> Result<(tokio_postgres::Statement, Params), Failure> {
    let mut params: Params = Vec::with_capacity(4);
    let condition = match (filter.status, &filter.aggregate_id) {
        (Some(status), Some(aggregate_id)) => {
            params.push(Box::new(status.as_str()));
            params.push(Box::new(aggregate_id.clone()));
            "WHERE d.status = $1 AND d.aggregate_id = $2 AND d.id > $3 ORDER BY d.id LIMIT $4"
        }
        (Some(status), None) => {
            params.push(Box::new(status.as_str()));
            "WHERE d.status = $1 AND d.id > $2 ORDER BY d.id LIMIT $3"
        }
        (None, Some(aggregate_id)) => {
            params.push(Box::new(aggregate_id.clone()));
            "WHERE d.aggregate_id = $1 AND d.id > $2 ORDER BY d.id LIMIT $3"
        }
        (None, None) => "WHERE d.id > $1 ORDER BY d.id LIMIT $2",
    };
    params.push(Box::new(page.after));
    params.push(Box::new(page.limit.saturating_add(1)));
    let statement = client
        .prepare_cached(&format!("{DEAD_LETTER_COLUMNS} {condition}"))
        .await?;
    Ok((statement, params))
}

fn dead_letter_page(rows: &[Row], limit: i64) -> Result<Page<DeadLetterView>, Failure> {
    let rows = rows
        .iter()
        .map(|row| Ok((row.try_get::<_, i64>(17)?, dead_letter_from_row(row)?)))
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Page::from_rows(rows, limit))
}

/// Dead letters in the order they were first recorded, after cursor `page.after`.
pub(super) async fn dead_letters(
    client: &Client,
    counters: &Counters,
    filter: &DeadLetterFilter,
    page: PageRequest,
) -> Result<Page<DeadLetterView>, Failure> {
    let (statement, params) = dead_letter_query(client, filter, page).await?;
    let params: Vec<&(dyn ToSql + Sync)> = params
        .iter()
        .map(|value| value.as_ref() as &(dyn ToSql + Sync))
        .collect();
    let rows = client.query(&statement, &params).await;
    counters.trip();
    dead_letter_page(&rows?, page.limit)
}

/// The aggregate's timeline after event `page.after`, oldest first.
pub(super) async fn timeline(
    client: &Client,
    counters: &Counters,
    aggregate_id: &str,
    page: PageRequest,
) -> Result<Page<TimelineEvent>, Failure> {
    let statement = client.prepare_cached(TIMELINE).await?;
    let limit = page.limit.saturating_add(1);
    let rows = client
        .query(&statement, &[&aggregate_id, &page.after, &limit])
        .await;
    counters.trip();
    let rows = rows?
        .iter()
        .map(|row| {
            let detail: Option<String> = row.try_get(6)?;
            let event = TimelineEvent {
                id: row.try_get(0)?,
                at: row.try_get(1)?,
                kind: parsed(row, 2)?,
                sequence: row.try_get(3)?,
                message_id: row.try_get(4)?,
                observation: row.try_get(5)?,
                detail: detail.and_then(|text| serde_json::from_str(&text).ok()),
            };
            Ok((event.id, event))
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

pub(super) fn resolution_from_row(row: &Row) -> Result<ResolutionRecord, Failure> {
    let replacement_id: Option<String> = row.try_get(8)?;
    let replacement_payload: Option<String> = row.try_get(9)?;
    Ok(ResolutionRecord {
        resolution_id: row.try_get(0)?,
        producer: row.try_get(15)?,
        message_id: row.try_get(1)?,
        aggregate_id: row.try_get(2)?,
        sequence: row.try_get(3)?,
        action: parsed(row, 4)?,
        operator: row.try_get(5)?,
        reason: row.try_get(6)?,
        expected_last: row.try_get(7)?,
        replacement: replacement_id.map(|message_id| Replacement {
            message_id,
            payload: optional_json(replacement_payload).unwrap_or(Value::Null),
        }),
        before: Position {
            last: row.try_get(10)?,
            state: optional_json(row.try_get(11)?),
        },
        after: Position {
            last: row.try_get(12)?,
            state: optional_json(row.try_get(13)?),
        },
        resolved_at: row.try_get(14)?,
    })
}

/// The audit trail after resolution `page.after`, oldest first, optionally for one aggregate.
pub(super) async fn resolutions(
    client: &Client,
    counters: &Counters,
    aggregate_id: Option<&str>,
    page: PageRequest,
) -> Result<Page<ResolutionRecord>, Failure> {
    let limit = page.limit.saturating_add(1);
    let rows = match aggregate_id {
        Some(aggregate_id) => {
            let sql = format!(
                "{RESOLUTION_COLUMNS} WHERE aggregate_id = $1 AND id > $2 ORDER BY id LIMIT $3"
            );
            let statement = client.prepare_cached(&sql).await?;
            client
                .query(&statement, &[&aggregate_id, &page.after, &limit])
                .await
        }
        None => {
            let sql = format!("{RESOLUTION_COLUMNS} WHERE id > $1 ORDER BY id LIMIT $2");
            let statement = client.prepare_cached(&sql).await?;
            client.query(&statement, &[&page.after, &limit]).await
        }
    };
    counters.trip();
    let rows = rows?
        .iter()
        .map(|row| {
            let record = resolution_from_row(row)?;
            Ok((record.resolution_id.unwrap_or(0), record))
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

/// Applied messages, dead letters and last sequence of one aggregate.
/// What an operator watches across all aggregates; both statements in one round trip.
pub(super) async fn health(client: &Client, counters: &Counters) -> Result<InboxHealth, Failure> {
    let figures = client.prepare_cached(HEALTH).await?;
    let statuses = client.prepare_cached(STATUS_COUNTS).await?;
    let (row, rows) = join!(
        client.query_one(&figures, &[]),
        client.query(&statuses, &[])
    );
    counters.trip();
    let (row, rows) = (row?, rows?);
    let mut aggregates: Vec<(AggregateStatus, i64)> = AggregateStatus::ALL
        .iter()
        .map(|status| (*status, 0))
        .collect();
    for counted in rows {
        let status: AggregateStatus = parsed(&counted, 0)?;
        let count: i64 = counted.try_get(1)?;
        if let Some(entry) = aggregates.iter_mut().find(|(known, _)| *known == status) {
            entry.1 = count;
        }
    }
    let now = clock::now();
    let longest = |column| -> Result<Option<f64>, Failure> {
        let since: Option<String> = row.try_get(column)?;
        Ok(since.map(|since| clock::seconds_between(&since, &now) as f64))
    };
    Ok(InboxHealth {
        aggregates,
        open_dead_letters: row.try_get(0)?,
        held_messages: row.try_get(2)?,
        longest_blocked_seconds: longest(1)?,
        longest_waiting_seconds: longest(3)?,
    })
}

pub(super) async fn counts(
    client: &Client,
    counters: &Counters,
    aggregate_id: &str,
) -> Result<AggregateCounts, Failure> {
    let statement = client.prepare_cached(COUNTS).await?;
    let row = client.query_one(&statement, &[&aggregate_id]).await;
    counters.trip();
    let row = row?;
    Ok(AggregateCounts {
        applied: row.try_get(0)?,
        dead_letters: row.try_get(1)?,
        last: row.try_get(2)?,
    })
}

/// Each named aggregate's lowest held message's payload as delivered, in one read; aggregates
/// holding nothing are left out.
pub(super) async fn lowest_held_payloads(
    client: &Client,
    counters: &Counters,
    aggregate_ids: &[String],
) -> Result<Vec<(String, String)>, Failure> {
    let statement = client.prepare_cached(LOWEST_HELD_PAYLOADS).await?;
    let rows = client.query(&statement, &[&aggregate_ids]).await;
    counters.trip();
    rows?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect()
}

/// The aggregate's applied messages in sequence order, after sequence `page.after`.
pub(super) async fn applied_messages(
    client: &Client,
    counters: &Counters,
    aggregate_id: &str,
    page: PageRequest,
) -> Result<Page<AppliedMessage>, Failure> {
    let statement = client.prepare_cached(APPLIED_MESSAGES).await?;
    let limit = page.limit.saturating_add(1);
    let rows = client
        .query(&statement, &[&aggregate_id, &page.after, &limit])
        .await;
    counters.trip();
    let rows = rows?
        .iter()
        .map(|row| {
            let message = AppliedMessage {
                producer: row.try_get(5)?,
                message_id: row.try_get(0)?,
                aggregate_id: row.try_get(1)?,
                sequence: row.try_get(2)?,
                payload: json(row.try_get(3)?),
                applied_at: row.try_get(4)?,
            };
            Ok((message.sequence.unwrap_or(0), message))
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

/// Every producer, the first registered first: never tokens.
pub(super) async fn producers(
    client: &Client,
    counters: &Counters,
) -> Result<Vec<ProducerView>, Failure> {
    let statement = client.prepare_cached(PRODUCERS).await?;
    let rows = client.query(&statement, &[]).await;
    counters.trip();
    rows?
        .iter()
        .map(|row| {
            Ok(ProducerView {
                name: row.try_get(0)?,
                current_epoch: row.try_get(1)?,
                created_at: row.try_get(2)?,
                revoked_at: row.try_get(3)?,
                last_delivery_at: row.try_get(4)?,
                owned_aggregates: row.try_get(5)?,
            })
        })
        .collect()
}
