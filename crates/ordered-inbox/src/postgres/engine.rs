//! The PostgreSQL side of a delivery and a resolution: lock, read the facts, let the core decide,
//! write the decided changes, all in one transaction.
//!
//! Serialization: before reading any fact, the transaction takes
//! `pg_advisory_xact_lock(hashtextextended(aggregate_id, 0))` (which exists before the aggregate's
//! row does) and locks the aggregate's row `FOR UPDATE` where it exists; then one advisory lock
//! per message id it reads or writes (`hashtextextended(message_id, 1)`), because a message id is
//! global: the same id sent to two aggregates at once must not get two meanings. Locks are taken
//! in one order (the aggregate, then message ids sorted), and all are released at COMMIT or
//! ROLLBACK. The facts are read after the locks (READ COMMITTED: each statement sees everything
//! committed before it), so they are exactly what the previous writer of the aggregate left.
//!
//! Round trips: the statements of one phase are pipelined on the connection: BEGIN, the locks
//! and the fact reads go out in one flight; the writes and COMMIT in the next. A delivery is two
//! round trips and, for an apply, seven statements (BEGIN, one for both locks, one for every
//! fact, three writes, COMMIT); a resolution three or four round trips (it reads where its dead
//! letter lives first, and numbers its audit row before the writes).

use futures_util::future::join_all;
use futures_util::join;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::views;
use super::{Client, Counters, Failure};
use crate::clock;
use crate::delivery::{
    AppliedMessage, Change, DeliveryFacts, HeldMessage, KnownDeadLetter, OpenDeadLetter, Outcome,
    decide_delivery,
};
use crate::model::{AggregateRow, AggregateStatus, Door, Limits, OrderedMessage};
use crate::resolution::{
    Action, DeadLetterFact, Mode, Refusal, ResolutionError, ResolutionFacts, ResolutionRequest,
    Resolved, decide_resolution, resolved_event,
};
use crate::timeline::{OBSERVATIONS_KEPT, TimelineEntry};
use crate::views::{CurrentState, ResolutionRecord};

/// A delivery's locks, in the one order every transaction takes them: the aggregate, then the
/// message id (the target list is evaluated left to right).
const LOCK_DELIVERY: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0)),
       pg_advisory_xact_lock(hashtextextended($2, 1))";
/// A delivery's facts in one statement, read after the locks: the aggregate's row (locked
/// `FOR UPDATE` too, so that a writer from outside the library would also wait), this id as an
/// applied message and as a dead letter, and the aggregate's open dead letters.
const DELIVERY_FACTS: &str = "
WITH aggregate AS (
    SELECT last_sequence, total, status, status_since FROM aggregate_state
     WHERE aggregate_id = $1 FOR UPDATE),
opened AS (
    SELECT array_agg(message_id ORDER BY id) AS ids, array_agg(sequence ORDER BY id) AS sequences
      FROM deadletters WHERE aggregate_id = $1 AND status = 'open'),
held AS (
    SELECT array_agg(message_id ORDER BY sequence) AS ids,
           array_agg(sequence ORDER BY sequence) AS sequences,
           array_agg(amount ORDER BY sequence) AS amounts,
           array_agg(payload ORDER BY sequence) AS payloads,
           array_agg(held_at ORDER BY sequence) AS held_at
      FROM held_messages WHERE aggregate_id = $1)
SELECT a.last_sequence, a.total, a.status, a.status_since,
       o.payload, o.sequence, o.applied_at,
       d.payload, d.reason, d.status, d.observations,
       opened.ids, opened.sequences,
       h.message_id, h.aggregate_id, h.sequence, h.amount, h.payload, h.held_at,
       held.ids, held.sequences, held.amounts, held.payloads, held.held_at
  FROM opened
  CROSS JOIN held
  LEFT JOIN aggregate a ON true
  LEFT JOIN ordered_inbox o ON o.message_id = $2
  LEFT JOIN deadletters d ON d.message_id = $2
  LEFT JOIN held_messages h ON h.message_id = $2";
const LOCK_AGGREGATE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";
const LOCK_MESSAGE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 1))";
const AGGREGATE_ROW: &str = "SELECT last_sequence, total, status, status_since
  FROM aggregate_state WHERE aggregate_id = $1 FOR UPDATE";
const APPLIED_MESSAGE: &str =
    "SELECT payload, sequence, applied_at FROM ordered_inbox WHERE message_id = $1";
const KNOWN_DEAD_LETTER: &str =
    "SELECT payload, reason, status, observations FROM deadletters WHERE message_id = $1";
const OPEN_DEAD_LETTERS: &str = "SELECT message_id, sequence FROM deadletters
  WHERE aggregate_id = $1 AND status = 'open' ORDER BY id";
const DEAD_LETTER_HOME: &str = "SELECT aggregate_id FROM deadletters WHERE message_id = $1";
const DEAD_LETTER_FACT: &str =
    "SELECT status, aggregate_id, sequence FROM deadletters WHERE message_id = $1";
const HELD_MESSAGE: &str = "SELECT message_id, aggregate_id, sequence, amount, payload, held_at
  FROM held_messages WHERE message_id = $1";
const HELD_FOR: &str = "SELECT message_id, aggregate_id, sequence, amount, payload, held_at
  FROM held_messages WHERE aggregate_id = $1 ORDER BY sequence";
const INSERT_HELD: &str = "
INSERT INTO held_messages(message_id, aggregate_id, sequence, amount, payload, held_at)
VALUES ($1, $2, $3, $4, $5, $6)";
const RELEASE_HELD: &str = "DELETE FROM held_messages WHERE message_id = $1";
const OPERATOR_ACTIVE: &str =
    "SELECT EXISTS(SELECT 1 FROM operators WHERE name = $1 AND revoked_at IS NULL)";

const PUT_AGGREGATE: &str = "
INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (aggregate_id) DO UPDATE SET
    last_sequence = excluded.last_sequence,
    total = excluded.total,
    status = excluded.status,
    status_since = excluded.status_since";
const INSERT_APPLIED: &str = "
INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, amount, applied_at)
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
                        last_seen, observations, status)
SELECT value, $1, $2, $3, $4, $5, $6, $6, 1, 'open' FROM numbered";
const OBSERVE_DEAD_LETTER: &str =
    "UPDATE deadletters SET observations = $2, last_seen = $3 WHERE message_id = $1";
const SUPERSEDE_DEAD_LETTERS: &str = "
UPDATE deadletters SET status = 'superseded', superseded_by = $2, closed_at = $3
 WHERE message_id = ANY($1) AND status = 'open'";
const RESOLVE_DEAD_LETTER: &str =
    "UPDATE deadletters SET status = 'resolved', closed_at = $2 WHERE message_id = $1";
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
   SET value = GREATEST(value, (SELECT COALESCE(MAX(id), 0) FROM resolutions)) + 1
 WHERE name = 'resolutions'
RETURNING value";
const INSERT_RESOLUTION: &str = "
INSERT INTO resolutions(id, message_id, aggregate_id, sequence, action, operator, reason,
                        expected_last, replacement_message_id, replacement_amount,
                        before_last, before_total, after_last, after_total, resolved_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)";
const LINK_RESOLUTION: &str = "UPDATE deadletters SET resolution_id = $2 WHERE message_id = $1";

/// A statement parameter owned by a pending write.
type Param = Box<dyn ToSql + Sync + Send>;

fn param<T: ToSql + Sync + Send + 'static>(value: T) -> Param {
    Box::new(value)
}

/// One statement of the final flight.
struct Write {
    statement: tokio_postgres::Statement,
    params: Vec<Param>,
}

async fn write(client: &Client, sql: &str, params: Vec<Param>) -> Result<Write, Failure> {
    Ok(Write {
        statement: client.prepare_cached(sql).await?,
        params,
    })
}

/// Decides and records one delivery: BEGIN, the locks and the facts in one flight; the writes
/// and COMMIT in the next.
pub(crate) async fn deliver(
    client: &Client,
    counters: &Counters,
    message: &OrderedMessage,
    door: Door,
    limits: &Limits,
) -> Result<Outcome, Failure> {
    let lock = client.prepare_cached(LOCK_DELIVERY).await?;
    let read = client.prepare_cached(DELIVERY_FACTS).await?;
    let keys: [&(dyn ToSql + Sync); 2] = [&message.aggregate_id, &message.message_id];
    let (begin, locked, facts) = join!(
        client.batch_execute("BEGIN"),
        client.execute(&lock, &keys),
        client.query_one(&read, &keys),
    );
    counters.trip();
    begin?;
    locked?;
    let facts = delivery_facts_from_row(&facts?, &message.aggregate_id)?;
    let plan = decide_delivery(message, door, &facts, limits, &clock::now());
    write_and_commit(client, counters, &plan.changes).await?;
    Ok(plan.outcome)
}

/// The one row of [`DELIVERY_FACTS`]: each group of columns is null when its row is missing.
fn delivery_facts_from_row(row: &Row, aggregate_id: &str) -> Result<DeliveryFacts, Failure> {
    let aggregate = match row.try_get::<_, Option<i64>>(0)? {
        Some(last) => Some(AggregateRow {
            last,
            total: row.try_get(1)?,
            status: parsed(row, 2)?,
            since: row.try_get(3)?,
        }),
        None => None,
    };
    let applied = match row.try_get::<_, Option<String>>(4)? {
        Some(payload) => Some(AppliedMessage {
            payload,
            sequence: row.try_get(5)?,
            applied_at: row.try_get(6)?,
        }),
        None => None,
    };
    // A dead letter's reason is never null, so it tells whether the row exists.
    let dead_letter = match row.try_get::<_, Option<String>>(8)? {
        Some(reason) => Some(KnownDeadLetter {
            payload: row.try_get(7)?,
            reason: reason.parse()?,
            status: parsed(row, 9)?,
            observations: row.try_get(10)?,
        }),
        None => None,
    };
    // Only a blocked aggregate has open dead letters (as the SQLite backend reads them).
    let blocked = aggregate.as_ref().map(|row| row.status) == Some(AggregateStatus::Blocked);
    let open_dead_letters = if blocked {
        let ids: Vec<String> = row.try_get::<_, Option<_>>(11)?.unwrap_or_default();
        let sequences: Vec<Option<i64>> = row.try_get::<_, Option<_>>(12)?.unwrap_or_default();
        ids.into_iter()
            .zip(sequences)
            .map(|(message_id, sequence)| OpenDeadLetter {
                message_id,
                sequence,
            })
            .collect()
    } else {
        Vec::new()
    };
    // A held row's message id is never null, so it tells whether the row exists.
    let held_message = match row.try_get::<_, Option<String>>(13)? {
        Some(message_id) => Some(HeldMessage {
            message: OrderedMessage {
                message_id,
                aggregate_id: row.try_get(14)?,
                sequence: row.try_get(15)?,
                amount: row.try_get(16)?,
            },
            payload: row.try_get(17)?,
            held_at: row.try_get(18)?,
        }),
        None => None,
    };
    Ok(DeliveryFacts {
        applied,
        dead_letter,
        aggregate,
        open_dead_letters,
        held_message,
        held: held_from_arrays(row, 19, aggregate_id)?,
    })
}

/// The aggregate's held messages from the five arrays of [`DELIVERY_FACTS`] starting at column
/// `first` (ids, sequences, amounts, payloads, held_at), in sequence order.
fn held_from_arrays(
    row: &Row,
    first: usize,
    aggregate_id: &str,
) -> Result<Vec<HeldMessage>, Failure> {
    let ids: Vec<String> = row.try_get::<_, Option<_>>(first)?.unwrap_or_default();
    let sequences: Vec<i64> = row.try_get::<_, Option<_>>(first + 1)?.unwrap_or_default();
    let amounts: Vec<i64> = row.try_get::<_, Option<_>>(first + 2)?.unwrap_or_default();
    let payloads: Vec<String> = row.try_get::<_, Option<_>>(first + 3)?.unwrap_or_default();
    let held_at: Vec<String> = row.try_get::<_, Option<_>>(first + 4)?.unwrap_or_default();
    Ok(ids
        .into_iter()
        .zip(sequences)
        .zip(amounts)
        .zip(payloads)
        .zip(held_at)
        .map(
            |((((message_id, sequence), amount), payload), held_at)| HeldMessage {
                message: OrderedMessage {
                    message_id,
                    aggregate_id: aggregate_id.to_owned(),
                    sequence,
                    amount,
                },
                payload,
                held_at,
            },
        )
        .collect())
}

fn held_from_row(row: &Row) -> Result<HeldMessage, Failure> {
    Ok(HeldMessage {
        message: OrderedMessage {
            message_id: row.try_get(0)?,
            aggregate_id: row.try_get(1)?,
            sequence: row.try_get(2)?,
            amount: row.try_get(3)?,
        },
        payload: row.try_get(4)?,
        held_at: row.try_get(5)?,
    })
}

/// Checks the preconditions and resolves the dead letter, or (dry run) reports what that would
/// do and writes nothing. The outer `Result` is the store's, the inner the resolution's.
pub(crate) async fn resolve(
    client: &Client,
    counters: &Counters,
    request: &ResolutionRequest,
    mode: Mode,
    limits: &Limits,
) -> Result<Result<Resolved, ResolutionError>, Failure> {
    // Where the dead letter lives decides which aggregate to lock; a dead letter never moves.
    let home = client.prepare_cached(DEAD_LETTER_HOME).await?;
    let by_dead_letter: [&(dyn ToSql + Sync); 1] = [&request.dead_letter_id];
    let (begin, home) = join!(
        client.batch_execute("BEGIN"),
        client.query_opt(&home, &by_dead_letter),
    );
    counters.trip();
    begin?;
    let aggregate_id: Option<String> = match home? {
        Some(row) => row.try_get(0)?,
        None => None,
    };
    let facts = resolution_facts(client, counters, request, aggregate_id.as_deref()).await?;
    let plan = match decide_resolution(request, &facts, limits, mode, &clock::now()) {
        Ok(plan) => plan,
        Err(refusal) => {
            let refused = refusal_error(client, counters, request, refusal).await?;
            client.batch_execute("ROLLBACK").await?;
            counters.trip();
            return Ok(Err(refused));
        }
    };
    let resolution_id = write_and_commit(client, counters, &plan.changes).await?;
    Ok(Ok(match plan.resolved {
        Resolved::New(record) => Resolved::New(ResolutionRecord {
            resolution_id,
            ..record
        }),
        other => other,
    }))
}

/// Locks the dead letter's aggregate and the message ids involved, then reads every fact the
/// resolution depends on, in one flight.
async fn resolution_facts(
    client: &Client,
    counters: &Counters,
    request: &ResolutionRequest,
    aggregate_id: Option<&str>,
) -> Result<ResolutionFacts, Failure> {
    let lock_aggregate = client.prepare_cached(LOCK_AGGREGATE).await?;
    let lock_message = client.prepare_cached(LOCK_MESSAGE).await?;
    let dead_letter_fact = client.prepare_cached(DEAD_LETTER_FACT).await?;
    let aggregate_row = client.prepare_cached(AGGREGATE_ROW).await?;
    let open_dead_letters = client.prepare_cached(OPEN_DEAD_LETTERS).await?;
    let operator_active = client.prepare_cached(OPERATOR_ACTIVE).await?;
    let applied_message = client.prepare_cached(APPLIED_MESSAGE).await?;
    let known_dead_letter = client.prepare_cached(KNOWN_DEAD_LETTER).await?;
    let recorded = client.prepare_cached(views::RESOLUTION_OF).await?;
    let held_message = client.prepare_cached(HELD_MESSAGE).await?;
    let held_for = client.prepare_cached(HELD_FOR).await?;

    let replacement_id = match &request.action {
        Action::Replace { message_id, .. } => Some(message_id.as_str()),
        Action::Skip => None,
    };
    let mut message_ids: Vec<&str> = std::iter::once(request.dead_letter_id.as_str())
        .chain(replacement_id)
        .collect();
    message_ids.sort_unstable();
    message_ids.dedup();
    let no_aggregate = String::new();
    let aggregate_key = aggregate_id.unwrap_or(&no_aggregate);
    let replacement_key = replacement_id.unwrap_or("");

    // The aggregate first, then the message ids in sorted order: one order for every
    // transaction, so that locks alone never deadlock.
    let lock_params: Vec<(&tokio_postgres::Statement, [&(dyn ToSql + Sync); 1])> = aggregate_id
        .iter()
        .map(|id| (&lock_aggregate, [id as &(dyn ToSql + Sync)]))
        .chain(
            message_ids
                .iter()
                .map(|id| (&lock_message, [id as &(dyn ToSql + Sync)])),
        )
        .collect();
    let locks = join_all(
        lock_params
            .iter()
            .map(|(statement, params)| client.execute(*statement, params)),
    );
    let by_dead_letter: [&(dyn ToSql + Sync); 1] = [&request.dead_letter_id];
    let by_aggregate: [&(dyn ToSql + Sync); 1] = [&aggregate_key];
    let by_operator: [&(dyn ToSql + Sync); 1] = [&request.operator];
    let by_replacement: [&(dyn ToSql + Sync); 1] = [&replacement_key];
    let (
        locks,
        dead_letter,
        aggregate,
        open,
        active,
        applied,
        known,
        recorded,
        replacement_held,
        held,
    ) = join!(
        locks,
        client.query_opt(&dead_letter_fact, &by_dead_letter),
        client.query_opt(&aggregate_row, &by_aggregate),
        client.query(&open_dead_letters, &by_aggregate),
        client.query_one(&operator_active, &by_operator),
        client.query_opt(&applied_message, &by_replacement),
        client.query_opt(&known_dead_letter, &by_replacement),
        client.query_opt(&recorded, &by_dead_letter),
        client.query_opt(&held_message, &by_replacement),
        client.query(&held_for, &by_aggregate),
    );
    counters.trip();
    // Every answer is checked, needed or not: an error anywhere aborted the transaction.
    for lock in locks {
        lock?;
    }
    let (dead_letter, aggregate, open, active, applied, known, recorded) = (
        dead_letter?,
        aggregate?,
        open?,
        active?,
        applied?,
        known?,
        recorded?,
    );
    let (replacement_held, held) = (replacement_held?, held?);
    let dead_letter = dead_letter
        .map(|row| -> Result<DeadLetterFact, Failure> {
            Ok(DeadLetterFact {
                status: parsed(&row, 0)?,
                aggregate_id: row.try_get(1)?,
                sequence: row.try_get(2)?,
            })
        })
        .transpose()?;
    let aggregate = match aggregate_id {
        Some(_) => aggregate.map(|row| aggregate_from_row(&row)).transpose()?,
        None => None,
    };
    let blocked = aggregate.as_ref().map(|row| row.status) == Some(AggregateStatus::Blocked);
    let open_dead_letters = if blocked {
        open.iter()
            .map(open_from_row)
            .collect::<Result<_, Failure>>()?
    } else {
        Vec::new()
    };
    let (replacement_applied, replacement_dead_letter, replacement_held) = match replacement_id {
        Some(_) => (
            applied.map(|row| applied_from_row(&row)).transpose()?,
            known
                .map(|row| known_dead_letter_from_row(&row))
                .transpose()?,
            replacement_held
                .map(|row| held_from_row(&row))
                .transpose()?,
        ),
        None => (None, None, None),
    };
    let held = match aggregate_id {
        Some(_) => held
            .iter()
            .map(held_from_row)
            .collect::<Result<_, Failure>>()?,
        None => Vec::new(),
    };
    Ok(ResolutionFacts {
        dead_letter,
        recorded: recorded
            .map(|row| views::resolution_from_row(&row))
            .transpose()?,
        aggregate,
        open_dead_letters,
        operator_active: active.try_get(0)?,
        replacement_applied,
        replacement_dead_letter,
        replacement_held,
        held,
    })
}

async fn refusal_error(
    client: &Client,
    counters: &Counters,
    request: &ResolutionRequest,
    refusal: Refusal,
) -> Result<ResolutionError, Failure> {
    Ok(match refusal {
        Refusal::NotFound => ResolutionError::NotFound(request.dead_letter_id.clone()),
        Refusal::ReplacementQuarantined(reason) => ResolutionError::ReplacementQuarantined(reason),
        Refusal::Unauthorized => ResolutionError::Unauthorized,
        Refusal::Conflict(kind) => ResolutionError::Conflict {
            kind,
            current: Box::new(current_state(client, counters, &request.dead_letter_id).await?),
        },
    })
}

/// The aggregate and the dead letter as they are now (inside the locking transaction), for a
/// refusal's body.
async fn current_state(
    client: &Client,
    counters: &Counters,
    dead_letter_id: &str,
) -> Result<CurrentState, Failure> {
    let dead_letter = views::dead_letter(client, counters, None, dead_letter_id).await?;
    let aggregate = match dead_letter
        .as_ref()
        .and_then(|dead| dead.aggregate_id.as_deref())
    {
        Some(aggregate_id) => views::aggregate_summary(client, counters, aggregate_id).await?,
        None => None,
    };
    Ok(CurrentState {
        aggregate,
        dead_letter,
    })
}

/// Writes the decided changes and commits, pipelined in one flight (a resolution's audit row is
/// numbered one flight earlier). Returns the id of the resolution row, if one was written.
async fn write_and_commit(
    client: &Client,
    counters: &Counters,
    changes: &[Change],
) -> Result<Option<i64>, Failure> {
    let mut writes = Vec::with_capacity(changes.len() + 2);
    let mut resolution_id = None;
    for change in changes {
        writes_for(client, counters, change, &mut writes, &mut resolution_id).await?;
    }
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
    let (written, commit) = join!(
        join_all(
            writes
                .iter()
                .zip(&params)
                .map(|(write, params)| client.execute(&write.statement, params))
        ),
        client.batch_execute("COMMIT"),
    );
    counters.trip();
    // After a failed write PostgreSQL answers COMMIT with a rollback: the first error is the
    // operation's, and nothing of it was kept.
    for result in written {
        result.map_err(Failure::Commit)?;
    }
    commit.map_err(Failure::Commit)?;
    Ok(resolution_id)
}

/// The statements that record one change. Exhaustive on purpose: a new kind of change does not
/// compile until it is written here.
async fn writes_for(
    client: &Client,
    counters: &Counters,
    change: &Change,
    writes: &mut Vec<Write>,
    resolution_id: &mut Option<i64>,
) -> Result<(), Failure> {
    match change {
        Change::PutAggregate { aggregate_id, row } => {
            let params = vec![
                param(aggregate_id.clone()),
                param(row.last),
                param(row.total),
                param(row.status.as_str()),
                param(row.since.clone()),
            ];
            writes.push(write(client, PUT_AGGREGATE, params).await?);
        }
        Change::InsertApplied {
            message,
            payload,
            applied_at,
            ..
        } => {
            let params = vec![
                param(message.message_id.clone()),
                param(payload.clone()),
                param(message.aggregate_id.clone()),
                param(message.sequence),
                param(message.amount),
                param(applied_at.clone()),
            ];
            writes.push(write(client, INSERT_APPLIED, params).await?);
        }
        Change::InsertDeadLetter {
            message,
            payload,
            reason,
            at,
            ..
        } => {
            let params = vec![
                param(message.message_id.clone()),
                param(reason.as_str()),
                param(message.aggregate_id.clone()),
                param(message.sequence),
                param(payload.clone()),
                param(at.clone()),
            ];
            writes.push(write(client, INSERT_DEAD_LETTER, params).await?);
        }
        Change::ObserveDeadLetter {
            message_id,
            observations,
            at,
            ..
        } => {
            let params = vec![
                param(message_id.clone()),
                param(*observations),
                param(at.clone()),
            ];
            writes.push(write(client, OBSERVE_DEAD_LETTER, params).await?);
        }
        Change::SupersedeDeadLetters {
            message_ids,
            by,
            at,
            ..
        } => {
            let params = vec![
                param(message_ids.clone()),
                param(by.clone()),
                param(at.clone()),
            ];
            writes.push(write(client, SUPERSEDE_DEAD_LETTERS, params).await?);
        }
        Change::ResolveDeadLetter { message_id, at, .. } => {
            let params = vec![param(message_id.clone()), param(at.clone())];
            writes.push(write(client, RESOLVE_DEAD_LETTER, params).await?);
        }
        // Producers (sessions, ownership, transfers) live in the SQLite inbox only so far: a
        // PostgreSQL inbox knows no producer, so no decision it reads facts for asks for these.
        Change::SetOwner { .. } | Change::TouchProducer { .. } | Change::RecordTransfer(_) => {
            return Err(Failure::Data(
                "producer ownership is not kept in a PostgreSQL inbox".to_owned(),
            ));
        }
        Change::InsertHeld {
            message,
            payload,
            at,
        } => {
            let params = vec![
                param(message.message_id.clone()),
                param(message.aggregate_id.clone()),
                param(message.sequence),
                param(message.amount),
                param(payload.clone()),
                param(at.clone()),
            ];
            writes.push(write(client, INSERT_HELD, params).await?);
        }
        Change::ReleaseHeld { message_id } => {
            writes.push(write(client, RELEASE_HELD, vec![param(message_id.clone())]).await?);
        }
        Change::Append(entry) => writes.push(append(client, entry).await?),
        Change::RecordResolution(record) => {
            let next = client.prepare_cached(NEXT_RESOLUTION_ID).await?;
            let id: i64 = client
                .query_one(&next, &[])
                .await
                .map_err(Failure::Db)?
                .try_get(0)?;
            counters.trip();
            writes.push(write(client, INSERT_RESOLUTION, resolution_params(record, id)).await?);
            let link = vec![param(record.message_id.clone()), param(id)];
            writes.push(write(client, LINK_RESOLUTION, link).await?);
            writes.push(append(client, &resolved_event(record, id)).await?);
            *resolution_id = Some(id);
        }
    }
    Ok(())
}

fn resolution_params(record: &ResolutionRecord, id: i64) -> Vec<Param> {
    let (replacement_id, replacement_amount) = match &record.replacement {
        Some(replacement) => (
            Some(replacement.message_id.clone()),
            Some(replacement.amount),
        ),
        None => (None, None),
    };
    vec![
        param(id),
        param(record.message_id.clone()),
        param(record.aggregate_id.clone()),
        param(record.sequence),
        param(record.action.as_str()),
        param(record.operator.clone()),
        param(record.reason.clone()),
        param(record.expected_last),
        param(replacement_id),
        param(replacement_amount),
        param(record.before.last),
        param(record.before.total),
        param(record.after.last),
        param(record.after.total),
        param(record.resolved_at.clone()),
    ]
}

/// A timeline entry: a state event as it is, an observation numbered and pruned.
async fn append(client: &Client, entry: &TimelineEntry) -> Result<Write, Failure> {
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

/// A stored status or kind, read through its `FromStr`.
pub(super) fn parsed<T>(row: &Row, index: usize) -> Result<T, Failure>
where
    T: std::str::FromStr<Err = crate::model::UnknownValue>,
{
    let text: String = row.try_get(index)?;
    Ok(text.parse()?)
}

fn aggregate_from_row(row: &Row) -> Result<AggregateRow, Failure> {
    Ok(AggregateRow {
        last: row.try_get(0)?,
        total: row.try_get(1)?,
        status: parsed(row, 2)?,
        since: row.try_get(3)?,
    })
}

fn applied_from_row(row: &Row) -> Result<AppliedMessage, Failure> {
    Ok(AppliedMessage {
        payload: row.try_get(0)?,
        sequence: row.try_get(1)?,
        applied_at: row.try_get(2)?,
    })
}

fn known_dead_letter_from_row(row: &Row) -> Result<KnownDeadLetter, Failure> {
    Ok(KnownDeadLetter {
        payload: row.try_get(0)?,
        reason: parsed(row, 1)?,
        status: parsed(row, 2)?,
        observations: row.try_get(3)?,
    })
}

fn open_from_row(row: &Row) -> Result<OpenDeadLetter, Failure> {
    Ok(OpenDeadLetter {
        message_id: row.try_get(0)?,
        sequence: row.try_get(1)?,
    })
}

impl From<Failure> for ResolutionError {
    fn from(failure: Failure) -> Self {
        ResolutionError::Store(failure.into_inbox_error())
    }
}
