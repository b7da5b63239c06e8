//! The statements of each [`Change`] in PostgreSQL: one short function per variant, and
//! [`writes_for`], which picks it. Writes are collected and pipelined: [`flush`] sends what is
//! pending in one flight (before the handler's `apply`, which must see them), [`commit`] sends
//! the rest with COMMIT.

use futures_util::future::join_all;
use futures_util::join;
use tokio_postgres::types::ToSql;

use super::connection::{Client, Counters, Failure};
use super::rows::namespace;
use crate::change::Change;
use crate::content::Detail;
use crate::gaps::gap_skipped_event;
use crate::model::{AggregateRow, OrderedMessage, QuarantineReason};
use crate::records::{
    AggregateOwner, GapRecord, ProducerClaim, REJECTED_KEPT, RejectedDelivery, ResolutionRecord,
    TransferRecord,
};
use crate::resolution::resolved_event;
use crate::timeline::{OBSERVATIONS_KEPT, TimelineDetail, TimelineEntry, TimelineKind};

/// A new row gets 0 in the seed's `total` column, which the inbox does not own (an
/// application's handler may); an existing row keeps it.
const PUT_AGGREGATE: &str = "
INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
VALUES ($1, $2, 0, $3, $4)
ON CONFLICT (aggregate_id) DO UPDATE SET
    last_sequence = excluded.last_sequence,
    status = excluded.status,
    status_since = excluded.status_since";
const INSERT_APPLIED: &str = "
INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, applied_at, producer)
VALUES ($1, $2, $3, $4, $5, $6)";
/// Dead letters are numbered in commit order (the cursor of `/deadletters` pages): the counter
/// row stays locked until COMMIT, so a number is never handed out ahead of an earlier one's
/// commit. Rows written by other means are respected through `MAX(id)`.
const INSERT_DEAD_LETTER: &str = "
WITH numbered AS (
    UPDATE ordered_inbox_counters
       SET value = GREATEST(value, (SELECT COALESCE(MAX(id), 0) FROM deadletters)) + 1
     WHERE name = 'deadletters'
 RETURNING value)
INSERT INTO deadletters(id, message_id, reason, aggregate_id, sequence, payload, first_seen,
                        last_seen, observations, status, producer)
SELECT value, $1, $2, $3, $4, $5, $6, $6, 1, 'open', $7 FROM numbered";
const OBSERVE_DEAD_LETTER: &str = "UPDATE deadletters SET observations = $2, last_seen = $3
  WHERE message_id = $1 AND producer = $4";
const SUPERSEDE_DEAD_LETTERS: &str = "
UPDATE deadletters SET status = 'superseded', superseded_by = $2, closed_at = $3
 WHERE aggregate_id = $4 AND message_id = ANY($1) AND status = 'open'";
const RESOLVE_DEAD_LETTER: &str = "UPDATE deadletters SET status = 'resolved', closed_at = $2
  WHERE message_id = $1 AND producer = $3";
const INSERT_HELD: &str = "
INSERT INTO held_messages(message_id, aggregate_id, sequence, payload, message_payload, held_at,
                          producer, epoch)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
const RELEASE_HELD: &str = "DELETE FROM held_messages WHERE message_id = $1 AND producer = $2";
const SET_OWNER: &str = "
INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since, owner,
                            owner_epoch, owner_since)
VALUES ($1, 0, 0, 'flowing', $4, $2, $3, $4)
ON CONFLICT (aggregate_id) DO UPDATE SET
    owner = excluded.owner,
    owner_epoch = excluded.owner_epoch,
    owner_since = excluded.owner_since";
/// The last delivery time per (producer, aggregate): the aggregate's lock already serializes
/// this row, and the producer's row is only share-locked by deliveries, so one producer's
/// deliveries to different aggregates run in parallel.
const TOUCH_PRODUCER: &str = "
INSERT INTO producer_deliveries(producer, aggregate_id, last_delivery_at) VALUES ($1, $2, $3)
ON CONFLICT (producer, aggregate_id) DO UPDATE SET last_delivery_at = excluded.last_delivery_at";
const RECORD_TRANSFER: &str = "
INSERT INTO ownership_transfers(aggregate_id, operator, from_owner, to_owner, epoch, last, reason,
                                transferred_at, held_rejected)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";
/// An entry of the rejected list, numbered in commit order as dead letters are (the counter row
/// stays locked until COMMIT), and the entries that fell out of the newest `$10` dropped in the
/// same statement (the DELETE sees the table as it was before the insert).
const RECORD_REJECTED: &str = "
WITH numbered AS (
    UPDATE ordered_inbox_counters SET value = value + 1 WHERE name = 'rejected'
 RETURNING value),
inserted AS (
    INSERT INTO rejected_deliveries(id, at, subject, stream_sequence, delivered, message_id,
                                    aggregate_id, producer, outcome, reason)
    SELECT value, $1, $2, $3, $4, $5, $6, $7, $8, $9 FROM numbered
 RETURNING id)
DELETE FROM rejected_deliveries AS r USING inserted WHERE r.id <= inserted.id - $10";
const APPEND_EVENT: &str = "
INSERT INTO aggregate_timeline(aggregate_id, at, kind, sequence, message_id, detail)
VALUES ($1, $2, $3, $4, $5, $6)";
/// Numbers an observation per aggregate and drops the ones that fell out of the newest
/// [`OBSERVATIONS_KEPT`], in one statement; both parts seek the partial index on
/// `(aggregate_id, observation_no)`.
const APPEND_OBSERVATION: &str = "
WITH numbered AS (
    INSERT INTO aggregate_timeline(aggregate_id, at, kind, sequence, message_id, detail,
                                   observation_no)
    VALUES ($1, $2, $3, $4, $5, $6,
            COALESCE((SELECT MAX(observation_no) FROM aggregate_timeline
                       WHERE aggregate_id = $1 AND observation_no IS NOT NULL), 0) + 1)
    RETURNING observation_no)
DELETE FROM aggregate_timeline AS t USING numbered
 WHERE t.aggregate_id = $1 AND t.observation_no IS NOT NULL
   AND t.observation_no <= numbered.observation_no - $7";
/// Resolutions are numbered like dead letters (commit order), one round trip ahead of the
/// writes because the `resolved` event's detail carries the number.
const NEXT_RESOLUTION_ID: &str = "
UPDATE ordered_inbox_counters
   SET value = GREATEST(value, (SELECT COALESCE(MAX(id), 0) FROM resolutions),
                        (SELECT COALESCE(MAX(id), 0) FROM gap_resolutions)) + 1
 WHERE name = 'resolutions'
RETURNING value";
const INSERT_RESOLUTION: &str = "
INSERT INTO resolutions(id, message_id, aggregate_id, sequence, action, operator, reason,
                        expected_last, replacement_message_id, replacement_payload,
                        before_last, before_state, after_last, after_state, resolved_at,
                        producer)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)";
const LINK_RESOLUTION: &str =
    "UPDATE deadletters SET resolution_id = $2 WHERE message_id = $1 AND producer = $3";

/// A statement parameter owned by a pending write.
pub(super) type Param = Box<dyn ToSql + Sync + Send>;

pub(super) fn param<T: ToSql + Sync + Send + 'static>(value: T) -> Param {
    Box::new(value)
}

/// One statement waiting to be sent.
pub(super) struct Write {
    statement: tokio_postgres::Statement,
    params: Vec<Param>,
}

pub(super) async fn write(
    client: &Client,
    sql: &str,
    params: Vec<Param>,
) -> Result<Write, Failure> {
    Ok(Write {
        statement: client.prepare_cached(sql).await?,
        params,
    })
}

/// The statements that record one change, appended to `writes`; `detail` is what the handler's
/// `apply` reported, for an [`Change::InsertApplied`]. Returns the id of the resolution row, if
/// the change numbers one (that costs a round trip of its own). Exhaustive on purpose: a new
/// kind of change does not compile until it is written here.
pub(super) async fn writes_for(
    client: &Client,
    counters: &Counters,
    change: &Change,
    detail: &Detail,
    writes: &mut Vec<Write>,
) -> Result<Option<i64>, Failure> {
    let write = match change {
        Change::InsertApplied { .. }
        | Change::InsertDeadLetter { .. }
        | Change::ObserveDeadLetter { .. } => message_write(client, change, detail, writes).await?,
        Change::PutAggregate { aggregate_id, row } => {
            put_aggregate(client, aggregate_id, row).await?
        }
        Change::SupersedeDeadLetters {
            aggregate_id,
            message_ids,
            by,
            at,
        } => supersede_dead_letters(client, aggregate_id, message_ids, by, at).await?,
        Change::ResolveDeadLetter {
            producer,
            message_id,
            at,
        } => resolve_dead_letter(client, producer.as_deref(), message_id, at).await?,
        Change::SetOwner {
            aggregate_id,
            owner,
            at,
        } => set_owner(client, aggregate_id, owner, at).await?,
        Change::TouchProducer {
            producer,
            aggregate_id,
            at,
        } => touch_producer(client, producer, aggregate_id, at).await?,
        Change::RecordTransfer(record) => record_transfer(client, record).await?,
        Change::InsertHeld {
            claim,
            message,
            payload,
            at,
        } => insert_held(client, claim.as_ref(), message, payload, at).await?,
        Change::ReleaseHeld {
            producer,
            message_id,
        } => release_held(client, producer.as_deref(), message_id).await?,
        Change::RecordRejected(entry) => record_rejected(client, entry).await?,
        Change::Append(entry) => append(client, entry).await?,
        Change::RecordResolution(record) => {
            return record_resolution(client, counters, record, writes)
                .await
                .map(Some);
        }
        Change::NoteGap {
            aggregate_id,
            last,
            sequence,
        } => note_gap(client, aggregate_id, *last, *sequence).await?,
        Change::RecordGapResolution(record) => {
            return record_gap_resolution(client, counters, record, writes)
                .await
                .map(Some);
        }
    };
    writes.push(write);
    Ok(None)
}

/// The last statement of a change of one message's own row (applied, a new dead letter, or one
/// seen again); an applied message's row goes to `writes` first, its `applied` event is
/// returned. [`writes_for`] routes only these three here.
async fn message_write(
    client: &Client,
    change: &Change,
    detail: &Detail,
    writes: &mut Vec<Write>,
) -> Result<Write, Failure> {
    match change {
        Change::InsertApplied {
            producer,
            message,
            payload,
            applied_at,
        } => {
            let inserted =
                insert_applied(client, producer.as_deref(), message, payload, applied_at);
            writes.push(inserted.await?);
            applied_event(client, message, applied_at, detail).await
        }
        Change::InsertDeadLetter {
            producer,
            message,
            payload,
            reason,
            at,
        } => insert_dead_letter(client, producer.as_deref(), message, payload, reason, at).await,
        Change::ObserveDeadLetter {
            producer,
            message_id,
            observations,
            at,
        } => observe_dead_letter(client, producer.as_deref(), message_id, *observations, at).await,
        other => unreachable!("not a message's own row: {other:?}"),
    }
}

async fn put_aggregate(
    client: &Client,
    aggregate_id: &str,
    row: &AggregateRow,
) -> Result<Write, Failure> {
    let params = vec![
        param(aggregate_id.to_owned()),
        param(row.last),
        param(row.status.as_str()),
        param(row.since.clone()),
    ];
    write(client, PUT_AGGREGATE, params).await
}

async fn insert_applied(
    client: &Client,
    producer: Option<&str>,
    message: &OrderedMessage,
    payload: &str,
    applied_at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(message.message_id.clone()),
        param(payload.to_owned()),
        param(message.aggregate_id.clone()),
        param(message.sequence),
        param(applied_at.to_owned()),
        param(namespace(producer).to_owned()),
    ];
    write(client, INSERT_APPLIED, params).await
}

/// The applied message's `applied` event, with the handler's detail.
async fn applied_event(
    client: &Client,
    message: &OrderedMessage,
    applied_at: &str,
    detail: &Detail,
) -> Result<Write, Failure> {
    let entry = TimelineEntry {
        aggregate_id: message.aggregate_id.clone(),
        at: applied_at.to_owned(),
        kind: TimelineKind::Applied,
        sequence: Some(message.sequence),
        message_id: Some(message.message_id.clone()),
        detail: TimelineDetail::Applied(detail.clone()),
    };
    append(client, &entry).await
}

async fn insert_dead_letter(
    client: &Client,
    producer: Option<&str>,
    message: &OrderedMessage,
    payload: &str,
    reason: &QuarantineReason,
    at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(message.message_id.clone()),
        param(reason.as_str().to_owned()),
        param(message.aggregate_id.clone()),
        param(message.sequence),
        param(payload.to_owned()),
        param(at.to_owned()),
        param(namespace(producer).to_owned()),
    ];
    write(client, INSERT_DEAD_LETTER, params).await
}

async fn observe_dead_letter(
    client: &Client,
    producer: Option<&str>,
    message_id: &str,
    observations: i64,
    at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(message_id.to_owned()),
        param(observations),
        param(at.to_owned()),
        param(namespace(producer).to_owned()),
    ];
    write(client, OBSERVE_DEAD_LETTER, params).await
}

async fn supersede_dead_letters(
    client: &Client,
    aggregate_id: &str,
    message_ids: &[String],
    by: &str,
    at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(message_ids.to_vec()),
        param(by.to_owned()),
        param(at.to_owned()),
        param(aggregate_id.to_owned()),
    ];
    write(client, SUPERSEDE_DEAD_LETTERS, params).await
}

async fn resolve_dead_letter(
    client: &Client,
    producer: Option<&str>,
    message_id: &str,
    at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(message_id.to_owned()),
        param(at.to_owned()),
        param(namespace(producer).to_owned()),
    ];
    write(client, RESOLVE_DEAD_LETTER, params).await
}

async fn set_owner(
    client: &Client,
    aggregate_id: &str,
    owner: &AggregateOwner,
    at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(aggregate_id.to_owned()),
        param(owner.producer.clone()),
        param(owner.epoch),
        param(at.to_owned()),
    ];
    write(client, SET_OWNER, params).await
}

async fn touch_producer(
    client: &Client,
    producer: &str,
    aggregate_id: &str,
    at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(producer.to_owned()),
        param(aggregate_id.to_owned()),
        param(at.to_owned()),
    ];
    write(client, TOUCH_PRODUCER, params).await
}

async fn record_transfer(client: &Client, record: &TransferRecord) -> Result<Write, Failure> {
    let params = vec![
        param(record.aggregate_id.clone()),
        param(record.operator.clone()),
        param(record.from_owner.clone()),
        param(record.to_owner.clone()),
        param(record.epoch),
        param(record.last),
        param(record.reason.clone()),
        param(record.transferred_at.clone()),
        param(i64::try_from(record.held_rejected).unwrap_or(i64::MAX)),
    ];
    write(client, RECORD_TRANSFER, params).await
}

/// A held message: its canonical content, and the payload as delivered, which a drain hands
/// to the handler.
async fn insert_held(
    client: &Client,
    claim: Option<&ProducerClaim>,
    message: &OrderedMessage,
    payload: &str,
    at: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(message.message_id.clone()),
        param(message.aggregate_id.clone()),
        param(message.sequence),
        param(payload.to_owned()),
        param(message.payload.to_string()),
        param(at.to_owned()),
        param(namespace(claim.map(|claim| claim.producer.as_str())).to_owned()),
        param(claim.map(|claim| claim.epoch)),
    ];
    write(client, INSERT_HELD, params).await
}

async fn release_held(
    client: &Client,
    producer: Option<&str>,
    message_id: &str,
) -> Result<Write, Failure> {
    let params = vec![
        param(message_id.to_owned()),
        param(namespace(producer).to_owned()),
    ];
    write(client, RELEASE_HELD, params).await
}

pub(super) async fn record_rejected(
    client: &Client,
    entry: &RejectedDelivery,
) -> Result<Write, Failure> {
    let params = vec![
        param(entry.at.clone()),
        param(entry.subject.clone()),
        param(entry.stream_sequence),
        param(entry.delivered),
        param(entry.message_id.clone()),
        param(entry.aggregate_id.clone()),
        param(entry.producer.clone()),
        param(entry.outcome.clone()),
        param(entry.reason.clone()),
        param(REJECTED_KEPT),
    ];
    write(client, RECORD_REJECTED, params).await
}

/// The next audit row's number, shared by dead letters' and gaps' resolutions, taken one round
/// trip ahead of the row.
async fn next_resolution_id(client: &Client, counters: &Counters) -> Result<i64, Failure> {
    let next = client.prepare_cached(NEXT_RESOLUTION_ID).await?;
    let id: i64 = client
        .query_one(&next, &[])
        .await
        .map_err(Failure::Db)?
        .try_get(0)?;
    counters.trip();
    Ok(id)
}

/// A handler's state of an aggregate as the audit row stores it: JSON text, or NULL.
fn state_text(state: &Option<serde_json::Value>) -> Option<String> {
    state.as_ref().map(ToString::to_string)
}

/// The audit row (numbered one round trip ahead), its link from the dead letter and its
/// `resolved` event. Returns the row's number.
async fn record_resolution(
    client: &Client,
    counters: &Counters,
    record: &ResolutionRecord,
    writes: &mut Vec<Write>,
) -> Result<i64, Failure> {
    let id = next_resolution_id(client, counters).await?;
    writes.push(write(client, INSERT_RESOLUTION, resolution_params(record, id)).await?);
    let link = vec![
        param(record.message_id.clone()),
        param(id),
        param(namespace(record.producer.as_deref()).to_owned()),
    ];
    writes.push(write(client, LINK_RESOLUTION, link).await?);
    writes.push(append(client, &resolved_event(record, id)).await?);
    Ok(id)
}

fn resolution_params(record: &ResolutionRecord, id: i64) -> Vec<Param> {
    let replacement = record.replacement.as_ref();
    vec![
        param(id),
        param(record.message_id.clone()),
        param(record.aggregate_id.clone()),
        param(record.sequence),
        param(record.action.as_str()),
        param(record.operator.clone()),
        param(record.reason.clone()),
        param(record.expected_last),
        param(replacement.map(|replacement| replacement.message_id.clone())),
        param(replacement.map(|replacement| replacement.payload.to_string())),
        param(record.before.last),
        param(state_text(&record.before.state)),
        param(record.after.last),
        param(state_text(&record.after.state)),
        param(record.resolved_at.clone()),
        param(namespace(record.producer.as_deref()).to_owned()),
    ]
}

/// A timeline entry: a state event as it is, an observation numbered and pruned.
pub(super) async fn append(client: &Client, entry: &TimelineEntry) -> Result<Write, Failure> {
    let mut params = vec![
        param(entry.aggregate_id.clone()),
        param(entry.at.clone()),
        param(entry.kind.as_str()),
        param(entry.sequence),
        param(entry.message_id.clone()),
        param(entry.detail.to_json()),
    ];
    if entry.kind.is_observation() {
        params.push(param(OBSERVATIONS_KEPT));
        write(client, APPEND_OBSERVATION, params).await
    } else {
        write(client, APPEND_EVENT, params).await
    }
}

/// Sends `writes` in one pipelined flight and waits for their answers; the first failure is the
/// operation's.
pub(super) async fn flush(
    client: &Client,
    counters: &Counters,
    writes: &mut Vec<Write>,
) -> Result<(), Failure> {
    let pending = std::mem::take(writes);
    if pending.is_empty() {
        return Ok(());
    }
    let written = execute_all(client, &pending).await;
    counters.trip();
    for result in written {
        result?;
    }
    Ok(())
}

/// Sends `writes` and COMMIT in one flight. After a failed write PostgreSQL answers COMMIT with a
/// rollback: the first error is the operation's, and nothing of it was kept.
pub(super) async fn commit(
    client: &Client,
    counters: &Counters,
    writes: Vec<Write>,
) -> Result<(), Failure> {
    let (written, committed) = join!(execute_all(client, &writes), client.batch_execute("COMMIT"));
    counters.trip();
    for result in written {
        result.map_err(Failure::Commit)?;
    }
    committed.map_err(Failure::Commit)?;
    Ok(())
}

pub(super) async fn execute_all(
    client: &Client,
    writes: &[Write],
) -> Vec<Result<u64, tokio_postgres::Error>> {
    let params: Vec<Vec<&(dyn ToSql + Sync)>> = writes
        .iter()
        .map(|write| {
            write
                .params
                .iter()
                .map(|value| value.as_ref() as &(dyn ToSql + Sync))
                .collect()
        })
        .collect();
    join_all(
        writes
            .iter()
            .zip(&params)
            .map(|(write, params)| client.execute(&write.statement, params)),
    )
    .await
}

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
async fn note_gap(
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
async fn record_gap_resolution(
    client: &Client,
    counters: &Counters,
    record: &GapRecord,
    writes: &mut Vec<Write>,
) -> Result<i64, Failure> {
    let id = next_resolution_id(client, counters).await?;
    writes.push(
        write(
            client,
            INSERT_GAP_RESOLUTION,
            gap_resolution_params(record, id),
        )
        .await?,
    );
    writes.push(append(client, &gap_skipped_event(record, id)).await?);
    Ok(id)
}

fn gap_resolution_params(record: &GapRecord, id: i64) -> Vec<Param> {
    vec![
        param(id),
        param(record.aggregate_id.clone()),
        param(record.range.from),
        param(record.range.through),
        param(record.operator.clone()),
        param(record.reason.clone()),
        param(record.expected_last),
        param(record.before.last),
        param(state_text(&record.before.state)),
        param(record.after.last),
        param(state_text(&record.after.state)),
        param(serde_json::to_string(&record.drained).unwrap_or_else(|_| "[]".to_owned())),
        param(record.resolved_at.clone()),
    ]
}
