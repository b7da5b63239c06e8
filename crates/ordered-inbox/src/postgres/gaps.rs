//! Gaps in PostgreSQL, the rows read: the same as the SQLite backend's (`sqlite::gaps`), a gap
//! resolution's facts under the aggregate's advisory lock that every delivery to it takes first,
//! so that a gap resolution and a late message for the same sequence are serialized and exactly
//! one of them wins (`writes` writes the note and the audit row, `views` reads the note,
//! `gap_engine` runs a resolution).

use futures_util::join;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::connection::{Client, Counters, Failure};
use super::facts::HELD_FOR;
use super::handler::PostgresHandler;
use super::rows::{aggregate_from, held_from, open_from_row, optional_json, owner_from};
use crate::facts::DeliveryFacts;
use crate::gaps::{AppliedInRange, GapFacts, GapRequest, drained_from_json};
use crate::model::{OrderedMessage, Position};
use crate::records::{GapRecord, SequenceRange};
use crate::views::{Page, PageRequest};

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
const OPERATOR_ACTIVE: &str =
    "SELECT EXISTS(SELECT 1 FROM operators WHERE name = $1 AND revoked_at IS NULL)";
const APPLIED_IN_RANGE: &str = "SELECT sequence, message_id FROM ordered_inbox
  WHERE aggregate_id = $1 AND sequence BETWEEN $2 AND $3 ORDER BY sequence LIMIT 1";

/// The gap resolution that skipped `message`'s sequence, read (under the delivery's locks) only
/// when the sequence is at or below the aggregate's last.
pub(super) async fn skipped_by(
    client: &Client,
    counters: &Counters,
    message: &OrderedMessage,
    facts: &DeliveryFacts,
) -> Result<Option<i64>, Failure> {
    let last = facts.aggregate.as_ref().map_or(0, |row| row.last);
    if message.sequence > last || facts.applied.is_some() {
        return Ok(None);
    }
    let record = covering(client, &message.aggregate_id, message.sequence).await?;
    counters.trip();
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

/// BEGIN, the aggregate's lock and every fact in one flight, then the handler's state.
pub(super) async fn gap_facts(
    client: &Client,
    counters: &Counters,
    handler: &dyn PostgresHandler,
    request: &GapRequest,
) -> Result<GapFacts, Failure> {
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
    counters.trip();
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
        state: handler
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
