//! The evidence, read back from the rows: an aggregate's state, the blocked/waiting inventory,
//! dead letters, the timeline and the resolution audit trail. Every query seeks an index; lists
//! are bounded by a caller-chosen limit.

use rusqlite::{Connection, OptionalExtension, Row, params};
use serde::Serialize;
use serde_json::Value;

/// An aggregate's current position.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AggregateSummary {
    pub aggregate_id: String,
    pub last: i64,
    pub total: i64,
    /// The sequence the aggregate needs next.
    pub expected: i64,
    /// `flowing`, `waiting` (later sequences were rejected as gaps since the last apply) or
    /// `blocked` (an open dead letter holds the expected sequence).
    pub status: String,
    /// When the aggregate entered its status.
    pub since: Option<String>,
}

/// An aggregate with the dead letters that hold it up.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AggregateView {
    #[serde(flatten)]
    pub summary: AggregateSummary,
    pub open_dead_letters: Vec<DeadLetterView>,
}

/// One line of the blocked/waiting inventory.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryEntry {
    #[serde(flatten)]
    pub summary: AggregateSummary,
    /// Whole seconds since the aggregate entered its status.
    pub age_seconds: i64,
    pub open_dead_letters: i64,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolutionSummary {
    pub resolution_id: i64,
    pub action: String,
    pub operator: String,
    pub reason: String,
    pub resolved_at: String,
    pub replacement_message_id: Option<String>,
}

/// A dead letter with its lifecycle. Rows recorded before the lifecycle columns existed have no
/// sequence, payload or timestamps.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterView {
    pub message_id: String,
    pub aggregate_id: Option<String>,
    pub sequence: Option<i64>,
    /// The canonical payload as stored (a JSON object).
    pub payload: Option<Value>,
    pub reason: String,
    pub first_seen: Option<String>,
    pub last_seen: Option<String>,
    pub observations: i64,
    /// `open`, `resolved` or `superseded`.
    pub status: String,
    /// The message whose application (or skip) took the sequence.
    pub superseded_by: Option<String>,
    pub closed_at: Option<String>,
    pub resolution: Option<ResolutionSummary>,
}

/// One timeline entry.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TimelineEvent {
    pub id: i64,
    pub at: String,
    pub kind: String,
    pub sequence: Option<i64>,
    pub message_id: Option<String>,
    /// True for a rejection observation (kept only among the newest 100 per aggregate).
    pub observation: bool,
    pub detail: Option<Value>,
}

/// An aggregate's last and total at a point of a resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Position {
    pub last: i64,
    pub total: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Replacement {
    pub message_id: String,
    pub amount: i64,
}

/// One audited resolution: who, when, what, why, and the aggregate before and after.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolutionRecord {
    /// `None` in a dry run, which assigns nothing.
    pub resolution_id: Option<i64>,
    pub message_id: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub action: String,
    pub operator: String,
    pub reason: String,
    pub expected_last: i64,
    pub replacement: Option<Replacement>,
    pub before: Position,
    pub after: Position,
    pub resolved_at: String,
}

pub fn aggregate_summary(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Option<AggregateSummary>> {
    connection
        .prepare_cached(
            "SELECT aggregate_id, last_sequence, total, status, status_since
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
        total: row.get(2)?,
        expected: last + 1,
        status: row.get(3)?,
        since: row.get(4)?,
    })
}

pub fn aggregate_view(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Option<AggregateView>> {
    let Some(summary) = aggregate_summary(connection, aggregate_id)? else {
        return Ok(None);
    };
    let open_dead_letters = dead_letters(
        connection,
        &DeadLetterFilter {
            status: Some("open"),
            aggregate_id: Some(aggregate_id),
            limit: 1000,
        },
    )?;
    Ok(Some(AggregateView {
        summary,
        open_dead_letters,
    }))
}

/// Aggregates in `status`, the longest-standing first.
pub fn inventory(
    connection: &Connection,
    status: &str,
    now: &str,
    limit: i64,
) -> rusqlite::Result<Vec<InventoryEntry>> {
    connection
        .prepare_cached(
            "SELECT a.aggregate_id, a.last_sequence, a.total, a.status, a.status_since,
                    CAST(ROUND((julianday(?2) - julianday(a.status_since)) * 86400) AS INTEGER),
                    (SELECT COUNT(*) FROM deadletters d
                      WHERE d.aggregate_id = a.aggregate_id AND d.status = 'open')
               FROM aggregate_state a
              WHERE a.status = ?1
              ORDER BY a.status_since, a.aggregate_id
              LIMIT ?3",
        )?
        .query_map(params![status, now, limit], |row| {
            Ok(InventoryEntry {
                summary: summary_from_row(row)?,
                age_seconds: row.get::<_, Option<i64>>(5)?.unwrap_or(0).max(0),
                open_dead_letters: row.get(6)?,
            })
        })?
        .collect()
}

const DEAD_LETTER_COLUMNS: &str = "
SELECT d.message_id, d.aggregate_id, d.sequence, d.payload, d.reason, d.first_seen, d.last_seen,
       d.observations, d.status, d.superseded_by, d.closed_at,
       r.id, r.action, r.operator, r.reason, r.resolved_at, r.replacement_message_id
  FROM deadletters d LEFT JOIN resolutions r ON r.id = d.resolution_id";

fn dead_letter_from_row(row: &Row<'_>) -> rusqlite::Result<DeadLetterView> {
    let payload: Option<String> = row.get(3)?;
    let resolution_id: Option<i64> = row.get(11)?;
    let resolution = match resolution_id {
        Some(resolution_id) => Some(ResolutionSummary {
            resolution_id,
            action: row.get(12)?,
            operator: row.get(13)?,
            reason: row.get(14)?,
            resolved_at: row.get(15)?,
            replacement_message_id: row.get(16)?,
        }),
        None => None,
    };
    Ok(DeadLetterView {
        message_id: row.get(0)?,
        aggregate_id: row.get(1)?,
        sequence: row.get(2)?,
        payload: payload.map(|text| serde_json::from_str(&text).unwrap_or(Value::String(text))),
        reason: row.get(4)?,
        first_seen: row.get(5)?,
        last_seen: row.get(6)?,
        observations: row.get(7)?,
        status: row.get(8)?,
        superseded_by: row.get(9)?,
        closed_at: row.get(10)?,
        resolution,
    })
}

pub fn dead_letter(
    connection: &Connection,
    message_id: &str,
) -> rusqlite::Result<Option<DeadLetterView>> {
    connection
        .prepare_cached(&format!("{DEAD_LETTER_COLUMNS} WHERE d.message_id = ?1"))?
        .query_row([message_id], dead_letter_from_row)
        .optional()
}

/// Which dead letters to list.
pub struct DeadLetterFilter<'a> {
    pub status: Option<&'a str>,
    pub aggregate_id: Option<&'a str>,
    pub limit: i64,
}

/// Dead letters, the first seen first. Each filter combination has its own statement so that
/// each can seek its index.
pub fn dead_letters(
    connection: &Connection,
    filter: &DeadLetterFilter<'_>,
) -> rusqlite::Result<Vec<DeadLetterView>> {
    let order = "ORDER BY d.first_seen, d.message_id LIMIT ?3";
    let condition = match (filter.status, filter.aggregate_id) {
        (Some(_), Some(_)) => "WHERE d.status = ?1 AND d.aggregate_id = ?2",
        (Some(_), None) => "WHERE d.status = ?1 AND ?2 IS NULL",
        (None, Some(_)) => "WHERE ?1 IS NULL AND d.aggregate_id = ?2",
        (None, None) => "WHERE ?1 IS NULL AND ?2 IS NULL",
    };
    connection
        .prepare_cached(&format!("{DEAD_LETTER_COLUMNS} {condition} {order}"))?
        .query_map(
            params![filter.status, filter.aggregate_id, filter.limit],
            dead_letter_from_row,
        )?
        .collect()
}

/// The aggregate's timeline after event `after`, oldest first.
pub fn timeline(
    connection: &Connection,
    aggregate_id: &str,
    after: i64,
    limit: i64,
) -> rusqlite::Result<Vec<TimelineEvent>> {
    connection
        .prepare_cached(
            "SELECT id, at, kind, sequence, message_id, observation_no IS NOT NULL, detail
               FROM aggregate_timeline
              WHERE aggregate_id = ?1 AND id > ?2
              ORDER BY id LIMIT ?3",
        )?
        .query_map(params![aggregate_id, after, limit], |row| {
            let detail: Option<String> = row.get(6)?;
            Ok(TimelineEvent {
                id: row.get(0)?,
                at: row.get(1)?,
                kind: row.get(2)?,
                sequence: row.get(3)?,
                message_id: row.get(4)?,
                observation: row.get(5)?,
                detail: detail.and_then(|text| serde_json::from_str(&text).ok()),
            })
        })?
        .collect()
}

const RESOLUTION_COLUMNS: &str = "
SELECT id, message_id, aggregate_id, sequence, action, operator, reason, expected_last,
       replacement_message_id, replacement_amount, before_last, before_total, after_last,
       after_total, resolved_at
  FROM resolutions";

fn resolution_from_row(row: &Row<'_>) -> rusqlite::Result<ResolutionRecord> {
    let replacement_id: Option<String> = row.get(8)?;
    let replacement_amount: Option<i64> = row.get(9)?;
    Ok(ResolutionRecord {
        resolution_id: row.get(0)?,
        message_id: row.get(1)?,
        aggregate_id: row.get(2)?,
        sequence: row.get(3)?,
        action: row.get(4)?,
        operator: row.get(5)?,
        reason: row.get(6)?,
        expected_last: row.get(7)?,
        replacement: replacement_id.map(|message_id| Replacement {
            message_id,
            amount: replacement_amount.unwrap_or(0),
        }),
        before: Position {
            last: row.get(10)?,
            total: row.get(11)?,
        },
        after: Position {
            last: row.get(12)?,
            total: row.get(13)?,
        },
        resolved_at: row.get(14)?,
    })
}

/// The resolution of a dead letter, if it has one.
pub fn resolution_of(
    connection: &Connection,
    message_id: &str,
) -> rusqlite::Result<Option<ResolutionRecord>> {
    connection
        .prepare_cached(&format!("{RESOLUTION_COLUMNS} WHERE message_id = ?1"))?
        .query_row([message_id], resolution_from_row)
        .optional()
}

/// The audit trail after resolution `after`, oldest first, optionally for one aggregate.
pub fn resolutions(
    connection: &Connection,
    aggregate_id: Option<&str>,
    after: i64,
    limit: i64,
) -> rusqlite::Result<Vec<ResolutionRecord>> {
    let condition = if aggregate_id.is_some() {
        "WHERE aggregate_id = ?1 AND id > ?2"
    } else {
        "WHERE ?1 IS NULL AND id > ?2"
    };
    connection
        .prepare_cached(&format!(
            "{RESOLUTION_COLUMNS} {condition} ORDER BY id LIMIT ?3"
        ))?
        .query_map(params![aggregate_id, after, limit], resolution_from_row)?
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_aggregate_reads_seek_their_indexes() {
        let connection = crate::schema::migrated_in_memory();
        let statements = [
            format!("{DEAD_LETTER_COLUMNS} WHERE d.status = 'open' AND d.aggregate_id = 'a' ORDER BY d.first_seen, d.message_id"),
            format!("{DEAD_LETTER_COLUMNS} WHERE d.status = 'open' ORDER BY d.first_seen, d.message_id"),
            "SELECT id FROM aggregate_timeline WHERE aggregate_id = 'a' AND id > 0 ORDER BY id".to_owned(),
            "SELECT aggregate_id FROM aggregate_state WHERE status = 'blocked' ORDER BY status_since, aggregate_id".to_owned(),
            "SELECT COUNT(*) FROM deadletters d WHERE d.aggregate_id = 'a' AND d.status = 'open'".to_owned(),
            "SELECT COUNT(*) FROM ordered_inbox WHERE aggregate_id = 'demo'".to_owned(),
        ];
        for sql in statements {
            let mut plan = connection
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .unwrap();
            let details: Vec<String> = plan
                .query_map([], |row| row.get(3))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert!(
                details.iter().all(|d| !d.starts_with("SCAN")),
                "{sql}: {details:?}"
            );
        }
    }
}
