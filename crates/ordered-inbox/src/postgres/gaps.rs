//! Gaps in PostgreSQL: the same rows as the SQLite backend's (`sqlite::gaps`), under the
//! aggregate's advisory lock that every delivery to it takes first, so that a gap resolution and
//! a late message for the same sequence are serialized and exactly one of them wins.

use futures_util::join;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::connection::{Client, Counters, Failure};
use super::engine::{Run, Unit, decided, rollback};
use super::rows::{aggregate_from, held_from, open_from_row, optional_json, owner_from};
use super::writes::{NEXT_RESOLUTION_ID, Param, Write, append, param, write};
use crate::facts::DeliveryFacts;
use crate::gaps::{
    AppliedInRange, GapFacts, GapRequest, GapResolutionError, GapResolved, decide_gap_resolution,
    drained_from_json, gap_skipped_event,
};
use crate::model::{OrderedMessage, Position};
use crate::records::{GapRecord, SequenceRange};
use crate::resolution::Mode;
use crate::views::{Page, PageRequest};

/// The lowest sequence refused as a gap at the aggregate's current last.
pub(super) const REFUSED_AT_LAST: &str = "
SELECT g.lowest FROM refused_gaps g JOIN aggregate_state a ON a.aggregate_id = g.aggregate_id
 WHERE g.aggregate_id = $1 AND g.after_last = a.last_sequence";
/// Keeps the lowest sequence refused as a gap at this last; a note taken at another last is
/// replaced (every assignment reads the row's old values).
const NOTE_GAP: &str = "
INSERT INTO refused_gaps(aggregate_id, after_last, lowest) VALUES ($1, $2, $3)
ON CONFLICT (aggregate_id) DO UPDATE SET
    lowest = CASE WHEN refused_gaps.after_last = excluded.after_last
                  THEN LEAST(refused_gaps.lowest, excluded.lowest) ELSE excluded.lowest END,
    after_last = excluded.after_last";
const INSERT_GAP_RESOLUTION: &str = "
INSERT INTO gap_resolutions(id, aggregate_id, from_sequence, through_sequence, operator, reason,
                            expected_last, before_last, before_state, after_last, after_state,
                            drained, resolved_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)";
const GAP_COLUMNS: &str = "
SELECT id, aggregate_id, from_sequence, through_sequence, operator, reason, expected_last,
       before_last, before_state, after_last, after_state, drained, resolved_at
  FROM gap_resolutions";
const COVERING: &str = "
SELECT id, aggregate_id, from_sequence, through_sequence, operator, reason, expected_last,
       before_last, before_state, after_last, after_state, drained, resolved_at
  FROM gap_resolutions WHERE aggregate_id = $1 AND from_sequence <= $2
 ORDER BY from_sequence DESC LIMIT 1";
const LOCK_AGGREGATE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";
const AGGREGATE_ROW: &str = "SELECT last_sequence, status, status_since, owner, owner_epoch
  FROM aggregate_state WHERE aggregate_id = $1 FOR UPDATE";
const OPEN_DEAD_LETTERS: &str = "SELECT message_id, sequence, NULLIF(producer, '')
  FROM deadletters WHERE aggregate_id = $1 AND status = 'open' ORDER BY id";
const HELD_FOR: &str =
    "SELECT message_id, aggregate_id, sequence, payload, message_payload, held_at
  FROM held_messages WHERE aggregate_id = $1 ORDER BY sequence";
const OPERATOR_ACTIVE: &str =
    "SELECT EXISTS(SELECT 1 FROM operators WHERE name = $1 AND revoked_at IS NULL)";
const APPLIED_IN_RANGE: &str = "SELECT sequence, message_id FROM ordered_inbox
  WHERE aggregate_id = $1 AND sequence BETWEEN $2 AND $3 ORDER BY sequence LIMIT 1";

pub(super) async fn note_gap(
    client: &Client,
    aggregate_id: &str,
    last: i64,
    sequence: i64,
) -> Result<Write, Failure> {
    let params = vec![param(aggregate_id.to_owned()), param(last), param(sequence)];
    write(client, NOTE_GAP, params).await
}

/// The audit row (numbered one round trip ahead, from the resolutions' counter) and its
/// `gap skipped` event. Returns the row's number.
pub(super) async fn record(
    client: &Client,
    counters: &Counters,
    record: &GapRecord,
    writes: &mut Vec<Write>,
) -> Result<i64, Failure> {
    let next = client.prepare_cached(NEXT_RESOLUTION_ID).await?;
    let id: i64 = client
        .query_one(&next, &[])
        .await
        .map_err(Failure::Db)?
        .try_get(0)?;
    counters.trip();
    writes.push(write(client, INSERT_GAP_RESOLUTION, record_params(record, id)).await?);
    writes.push(append(client, &gap_skipped_event(record, id)).await?);
    Ok(id)
}

fn record_params(record: &GapRecord, id: i64) -> Vec<Param> {
    let state = |state: &Option<serde_json::Value>| state.as_ref().map(ToString::to_string);
    vec![
        param(id),
        param(record.aggregate_id.clone()),
        param(record.range.from),
        param(record.range.through),
        param(record.operator.clone()),
        param(record.reason.clone()),
        param(record.expected_last),
        param(record.before.last),
        param(state(&record.before.state)),
        param(record.after.last),
        param(state(&record.after.state)),
        param(serde_json::to_string(&record.drained).unwrap_or_else(|_| "[]".to_owned())),
        param(record.resolved_at.clone()),
    ]
}

/// The gap resolution that skipped `message`'s sequence, read (under the delivery's locks) only
/// when the sequence is at or below the aggregate's last.
pub(super) async fn skipped_by(
    unit: Unit<'_>,
    message: &OrderedMessage,
    facts: &DeliveryFacts,
) -> Result<Option<i64>, Failure> {
    let last = facts.aggregate.as_ref().map_or(0, |row| row.last);
    if message.sequence > last || facts.applied.is_some() {
        return Ok(None);
    }
    let record = covering(unit.client, &message.aggregate_id, message.sequence).await?;
    unit.counters.trip();
    Ok(record.and_then(|record| record.resolution_id))
}

async fn covering(
    client: &Client,
    aggregate_id: &str,
    sequence: i64,
) -> Result<Option<GapRecord>, Failure> {
    let statement = client.prepare_cached(COVERING).await?;
    let row = client
        .query_opt(&statement, &[&aggregate_id, &sequence])
        .await?;
    let record = row.map(|row| gap_record_from_row(&row)).transpose()?;
    Ok(record.filter(|record| record.range.contains(sequence)))
}

/// Checks the preconditions and resolves the gap, or (dry run) reports what that would do: the
/// aggregate locked, the facts, the core's decision, the audit row and the drain through the
/// handler, committed together; a refusal rolls back.
pub(crate) async fn resolve_gap(
    unit: Unit<'_>,
    request: &GapRequest,
    mode: Mode,
) -> Result<Result<GapResolved, GapResolutionError>, Failure> {
    let facts = gap_facts(unit, request).await?;
    let run = decided(unit, None, |context| {
        decide_gap_resolution(request, &facts, mode, context)
    })
    .await?;
    match run {
        Run::Written(plan, report, writes) => {
            super::writes::commit(unit.client, unit.counters, writes).await?;
            Ok(Ok(plan.resolved.numbered(report.resolution_id)))
        }
        Run::Refused(refusal) => {
            rollback(unit).await?;
            Ok(Err(GapResolutionError::refused(request, refusal)))
        }
        Run::Failed(error) => Err(Failure::Handler(error)),
    }
}

/// BEGIN, the aggregate's lock and every fact in one flight, then the handler's state.
async fn gap_facts(unit: Unit<'_>, request: &GapRequest) -> Result<GapFacts, Failure> {
    let client = unit.client;
    let lock = client.prepare_cached(LOCK_AGGREGATE).await?;
    let aggregate_row = client.prepare_cached(AGGREGATE_ROW).await?;
    let open = client.prepare_cached(OPEN_DEAD_LETTERS).await?;
    let held = client.prepare_cached(HELD_FOR).await?;
    let active = client.prepare_cached(OPERATOR_ACTIVE).await?;
    let applied = client.prepare_cached(APPLIED_IN_RANGE).await?;
    let covering_from = client.prepare_cached(COVERING).await?;
    let aggregate_id = request.aggregate_id.as_str();
    let range = request.range;
    let by_aggregate: [&(dyn ToSql + Sync); 1] = [&aggregate_id];
    let by_operator: [&(dyn ToSql + Sync); 1] = [&request.operator];
    let by_range: [&(dyn ToSql + Sync); 3] = [&aggregate_id, &range.from, &range.through];
    let by_from: [&(dyn ToSql + Sync); 2] = [&aggregate_id, &range.from];
    let (begin, locked, row, open, held, active, applied, recorded) = join!(
        client.batch_execute("BEGIN"),
        client.execute(&lock, &by_aggregate),
        client.query_opt(&aggregate_row, &by_aggregate),
        client.query(&open, &by_aggregate),
        client.query(&held, &by_aggregate),
        client.query_one(&active, &by_operator),
        client.query_opt(&applied, &by_range),
        client.query_opt(&covering_from, &by_from),
    );
    unit.counters.trip();
    begin?;
    locked?;
    let Some(row) = row? else {
        return Ok(GapFacts::default());
    };
    let recorded = recorded?
        .map(|row| gap_record_from_row(&row))
        .transpose()?
        .filter(|record| record.range.contains(range.from));
    Ok(GapFacts {
        aggregate: Some(aggregate_from(&row, 0)?),
        owner: owner_from(&row, 3)?,
        open_dead_letters: open?.iter().map(open_from_row).collect::<Result<_, _>>()?,
        held: held?
            .iter()
            .map(|row| held_from(row, 0))
            .collect::<Result<_, _>>()?,
        operator_active: active?.try_get(0)?,
        applied_in_range: applied?
            .map(|row| {
                Ok::<_, Failure>(AppliedInRange {
                    sequence: row.try_get(0)?,
                    message_id: row.try_get(1)?,
                })
            })
            .transpose()?,
        recorded,
        state: unit
            .handler
            .state(client, aggregate_id)
            .await
            .map_err(Failure::Handler)?,
    })
}

/// The gap resolutions after number `page.after`, oldest first, optionally for one aggregate.
pub(super) async fn gap_resolutions(
    client: &Client,
    counters: &Counters,
    aggregate_id: Option<&str>,
    page: PageRequest,
) -> Result<Page<GapRecord>, Failure> {
    let sql = format!(
        "{GAP_COLUMNS} WHERE ($1::text IS NULL OR aggregate_id = $1) AND id > $2
          ORDER BY id LIMIT $3"
    );
    let statement = client.prepare_cached(&sql).await?;
    let limit = page.limit.saturating_add(1);
    let rows = client
        .query(&statement, &[&aggregate_id, &page.after, &limit])
        .await;
    counters.trip();
    let rows = rows?
        .iter()
        .map(|row| {
            let record = gap_record_from_row(row)?;
            Ok((record.resolution_id.unwrap_or(0), record))
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

fn gap_record_from_row(row: &Row) -> Result<GapRecord, Failure> {
    let drained: String = row.try_get(11)?;
    Ok(GapRecord {
        resolution_id: row.try_get(0)?,
        aggregate_id: row.try_get(1)?,
        range: SequenceRange {
            from: row.try_get(2)?,
            through: row.try_get(3)?,
        },
        operator: row.try_get(4)?,
        reason: row.try_get(5)?,
        expected_last: row.try_get(6)?,
        before: Position {
            last: row.try_get(7)?,
            state: optional_json(row.try_get(8)?),
        },
        after: Position {
            last: row.try_get(9)?,
            state: optional_json(row.try_get(10)?),
        },
        drained: drained_from_json(&drained),
        resolved_at: row.try_get(12)?,
    })
}
