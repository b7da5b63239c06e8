//! The PostgreSQL side of a delivery and a resolution: lock, read the facts, let the core decide,
//! write the decided changes, all in one transaction.
//!
//! Serialization: before reading any fact, the transaction takes
//! `pg_advisory_xact_lock(hashtextextended(aggregate_id, 0))` (which exists before the aggregate's
//! row does) and locks the aggregate's row `FOR UPDATE` where it exists; then one advisory lock
//! per message identity it reads or writes (`hashtextextended(key, 1)`, the key being the message
//! id in the anonymous namespace and `producer:message_id` in a producer's, see [`message_key`]),
//! because an identity spans aggregates: the same id sent to two aggregates at once must not get
//! two meanings. A producer's delivery then locks its producer's row `FOR SHARE`: a new session
//! (which updates that row) commits either before the delivery reads the epoch or after the
//! delivery committed; deliveries of one producer to different aggregates do not wait for each
//! other. Locks are taken in one order (the aggregate, then message keys sorted,
//! then the producer's row), and all are released at COMMIT or ROLLBACK. The facts are read after the locks (READ COMMITTED: each statement sees everything
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
    decide_producer_delivery,
};
use crate::model::{AggregateRow, AggregateStatus, Door, Limits, OrderedMessage};
use crate::producers::{
    AggregateOwner, OwnershipFacts, ProducerClaim, ProducerFact, ProducerRefusal, TransferFacts,
    TransferRecord, TransferRequest, decide_transfer, next_epoch,
};
use crate::rejected::{REJECTED_KEPT, RejectedDelivery};
use crate::resolution::{
    Action, DeadLetterFact, Mode, Refusal, ResolutionError, ResolutionFacts, ResolutionRequest,
    Resolved, decide_resolution, resolved_event,
};
use crate::timeline::{OBSERVATIONS_KEPT, TimelineEntry};
use crate::views::{CurrentState, ResolutionRecord};
use crate::views::{OwnershipState, TransferConflict};

/// A delivery's locks, in the one order every transaction takes them: the aggregate, then the
/// message id (the target list is evaluated left to right).
const LOCK_DELIVERY: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0)),
       pg_advisory_xact_lock(hashtextextended($2, 1))";
/// A delivery's facts in one statement, read after the locks: the aggregate's row (locked
/// `FOR UPDATE` too, so that a writer from outside the library would also wait) with its owner,
/// this identity (`$3` the namespace, `$2` the id) as an applied message and as a dead letter (and
/// as a held message: only anonymous ids are held), and the aggregate's open dead letters.
const DELIVERY_FACTS: &str = "
WITH aggregate AS (
    SELECT last_sequence, total, status, status_since, owner, owner_epoch FROM aggregate_state
     WHERE aggregate_id = $1 FOR UPDATE),
opened AS (
    SELECT array_agg(message_id ORDER BY id) AS ids, array_agg(sequence ORDER BY id) AS sequences,
           array_agg(NULLIF(producer, '') ORDER BY id) AS producers
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
       held.ids, held.sequences, held.amounts, held.payloads, held.held_at,
       a.owner, a.owner_epoch, opened.producers
  FROM opened
  CROSS JOIN held
  LEFT JOIN aggregate a ON true
  LEFT JOIN ordered_inbox o ON o.producer = $3 AND o.message_id = $2
  LEFT JOIN deadletters d ON d.producer = $3 AND d.message_id = $2
  LEFT JOIN held_messages h ON h.message_id = $2 AND $3 = ''";
/// A producer's facts, read after the delivery's locks: its row, locked `FOR SHARE` until the
/// delivery commits (a session's or a revocation's UPDATE of the row waits for it, or the
/// delivery waits for that UPDATE and reads the new epoch; deliveries of one producer share the
/// lock), and whether the aggregate has any history (only a fresh one can be claimed).
const PRODUCER_FACTS: &str = "
WITH p AS (
    SELECT current_epoch, revoked_at IS NULL AS active FROM producers WHERE name = $2 FOR SHARE)
SELECT p.current_epoch, p.active,
       EXISTS(SELECT 1 FROM aggregate_state WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM aggregate_timeline WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM held_messages WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM ordered_inbox WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM deadletters WHERE aggregate_id = $1)
  FROM (SELECT 1) AS one LEFT JOIN p ON true";
const PRODUCER_ROW_LOCKED: &str =
    "SELECT current_epoch, revoked_at IS NULL FROM producers WHERE name = $1 FOR UPDATE";
const PRODUCER_ROW_SHARED: &str =
    "SELECT current_epoch, revoked_at IS NULL FROM producers WHERE name = $1 FOR SHARE";
const SET_EPOCH: &str = "UPDATE producers SET current_epoch = $2 WHERE name = $1";
const OWNERSHIP_LOCKED: &str = "SELECT owner, owner_epoch, last_sequence FROM aggregate_state
  WHERE aggregate_id = $1 FOR UPDATE";
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
const LOCK_AGGREGATE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";
const LOCK_MESSAGE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 1))";
const AGGREGATE_ROW: &str = "SELECT last_sequence, total, status, status_since, owner, owner_epoch
  FROM aggregate_state WHERE aggregate_id = $1 FOR UPDATE";
const APPLIED_MESSAGE: &str = "SELECT payload, sequence, applied_at FROM ordered_inbox
  WHERE message_id = $1 AND producer = $2";
const KNOWN_DEAD_LETTER: &str = "SELECT payload, reason, status, observations FROM deadletters
  WHERE message_id = $1 AND producer = $2";
const OPEN_DEAD_LETTERS: &str = "SELECT message_id, sequence, NULLIF(producer, '')
  FROM deadletters WHERE aggregate_id = $1 AND status = 'open' ORDER BY id";
const DEAD_LETTER_HOME: &str =
    "SELECT aggregate_id FROM deadletters WHERE message_id = $1 AND producer = $2";
const DEAD_LETTER_FACT: &str = "SELECT status, aggregate_id, sequence FROM deadletters
  WHERE message_id = $1 AND producer = $2";
/// Only anonymous ids are held (the broker door delivers anonymously).
const HELD_MESSAGE: &str = "SELECT message_id, aggregate_id, sequence, amount, payload, held_at
  FROM held_messages WHERE message_id = $1 AND $2 = ''";
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
INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, amount, applied_at,
                          producer)
VALUES ($1, $2, $3, $4, $5, $6, $7)";
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
                        before_last, before_total, after_last, after_total, resolved_at,
                        producer)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)";
const LINK_RESOLUTION: &str =
    "UPDATE deadletters SET resolution_id = $2 WHERE message_id = $1 AND producer = $3";

/// The column value of a namespace: `''` is the anonymous one.
pub(super) fn namespace(producer: Option<&str>) -> &str {
    producer.unwrap_or("")
}

/// The advisory-lock key of a message identity: the id itself in the anonymous namespace (as
/// before producers existed), `producer:id` in a producer's. Two identities whose keys collide
/// only wait for each other; the facts are read by identity either way.
fn message_key(producer: Option<&str>, message_id: &str) -> String {
    match producer {
        None => message_id.to_owned(),
        Some(producer) => format!("{producer}:{message_id}"),
    }
}

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

/// Decides and records one anonymous delivery, without an ownership check
/// ([`crate::Inbox::deliver`]'s contract; the server's doors use [`deliver_as`]): BEGIN, the
/// locks and the facts in one flight; the writes and COMMIT in the next.
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
    let anonymous = namespace(None);
    let by_identity: [&(dyn ToSql + Sync); 3] =
        [&message.aggregate_id, &message.message_id, &anonymous];
    let (begin, locked, facts) = join!(
        client.batch_execute("BEGIN"),
        client.execute(&lock, &keys),
        client.query_one(&read, &by_identity),
    );
    counters.trip();
    begin?;
    locked?;
    let facts = delivery_facts_from_row(&facts?, &message.aggregate_id)?;
    let plan = crate::delivery::decide_delivery(message, door, &facts, limits, &clock::now());
    write_and_commit(client, counters, &plan.changes).await?;
    Ok(plan.outcome)
}

/// Decides and records one delivery made by `claim`'s producer (`None`: anonymous), with epoch
/// fencing and ownership checked on facts read under the delivery's locks (the producer's row
/// locked too): BEGIN, the locks and the facts in one flight; the writes and COMMIT (or, for a
/// refusal, ROLLBACK) in the next.
pub(crate) async fn deliver_as(
    client: &Client,
    counters: &Counters,
    message: &OrderedMessage,
    door: Door,
    claim: Option<&ProducerClaim>,
    limits: &Limits,
) -> Result<Result<Outcome, ProducerRefusal>, Failure> {
    let producer = claim.map(|claim| claim.producer.as_str());
    let lock = client.prepare_cached(LOCK_DELIVERY).await?;
    let read = client.prepare_cached(DELIVERY_FACTS).await?;
    let producer_read = client.prepare_cached(PRODUCER_FACTS).await?;
    let key = message_key(producer, &message.message_id);
    let keys: [&(dyn ToSql + Sync); 2] = [&message.aggregate_id, &key];
    let space = namespace(producer);
    let by_identity: [&(dyn ToSql + Sync); 3] =
        [&message.aggregate_id, &message.message_id, &space];
    let by_producer: [&(dyn ToSql + Sync); 2] = [&message.aggregate_id, &space];
    let producer_facts = futures_util::future::OptionFuture::from(
        claim.map(|_| client.query_one(&producer_read, &by_producer)),
    );
    let (begin, locked, facts, producer_facts) = join!(
        client.batch_execute("BEGIN"),
        client.execute(&lock, &keys),
        client.query_one(&read, &by_identity),
        producer_facts,
    );
    counters.trip();
    begin?;
    locked?;
    let facts = facts?;
    let owner = match facts.try_get::<_, Option<String>>(24)? {
        Some(producer) => Some(AggregateOwner {
            producer,
            epoch: facts.try_get::<_, Option<i64>>(25)?.unwrap_or(0),
        }),
        None => None,
    };
    let facts = delivery_facts_from_row(&facts, &message.aggregate_id)?;
    let ownership = match producer_facts.transpose()? {
        Some(row) => OwnershipFacts {
            producer: match row.try_get::<_, Option<i64>>(0)? {
                Some(current_epoch) => Some(ProducerFact {
                    current_epoch,
                    active: row.try_get(1)?,
                }),
                None => None,
            },
            history: owner.is_none() && row.try_get::<_, bool>(2)?,
            owner,
        },
        None => OwnershipFacts {
            producer: None,
            owner,
            history: false,
        },
    };
    let now = clock::now();
    match decide_producer_delivery(message, door, claim, &ownership, &facts, limits, &now) {
        Ok(plan) => {
            write_and_commit(client, counters, &plan.changes).await?;
            Ok(Ok(plan.outcome))
        }
        Err(refusal) => {
            client.batch_execute("ROLLBACK").await?;
            counters.trip();
            Ok(Err(refusal))
        }
    }
}

/// Starts a session of `producer`: its row locked, the next epoch decided, written, committed.
pub(crate) async fn start_session(
    client: &Client,
    counters: &Counters,
    producer: &str,
) -> Result<Result<i64, ProducerRefusal>, Failure> {
    let read = client.prepare_cached(PRODUCER_ROW_LOCKED).await?;
    let by_name: [&(dyn ToSql + Sync); 1] = [&producer];
    let (begin, row) = join!(
        client.batch_execute("BEGIN"),
        client.query_opt(&read, &by_name)
    );
    counters.trip();
    begin?;
    let decided = match row?.map(|row| producer_fact_from_row(&row)).transpose()? {
        Some(fact) => next_epoch(fact),
        None => Err(ProducerRefusal::Revoked),
    };
    let epoch = match decided {
        Ok(epoch) => epoch,
        Err(refusal) => {
            client.batch_execute("ROLLBACK").await?;
            counters.trip();
            return Ok(Err(refusal));
        }
    };
    let set = client.prepare_cached(SET_EPOCH).await?;
    let by_name_epoch: [&(dyn ToSql + Sync); 2] = [&producer, &epoch];
    let (written, commit) = join!(
        client.execute(&set, &by_name_epoch),
        client.batch_execute("COMMIT"),
    );
    counters.trip();
    written.map_err(Failure::Commit)?;
    commit.map_err(Failure::Commit)?;
    Ok(Ok(epoch))
}

/// An operator's transfer: the aggregate locked as for a delivery, the receiving producer's row
/// shared-locked, the preconditions decided by the core, the owner columns, the audit row, the
/// timeline event and the rejection of the held messages it made inadmissible written and
/// committed; a refusal rolls back with the ownership as it is.
pub(crate) async fn transfer(
    client: &Client,
    counters: &Counters,
    request: &TransferRequest,
) -> Result<Result<TransferRecord, TransferConflict>, Failure> {
    let lock = client.prepare_cached(LOCK_AGGREGATE).await?;
    let state = client.prepare_cached(OWNERSHIP_LOCKED).await?;
    let operator = client.prepare_cached(OPERATOR_ACTIVE).await?;
    let producer = client.prepare_cached(PRODUCER_ROW_SHARED).await?;
    let held_for = client.prepare_cached(HELD_FOR).await?;
    let by_aggregate: [&(dyn ToSql + Sync); 1] = [&request.aggregate_id];
    let by_operator: [&(dyn ToSql + Sync); 1] = [&request.operator];
    let by_producer: [&(dyn ToSql + Sync); 1] = [&request.producer];
    let (begin, locked, state, operator, producer, held) = join!(
        client.batch_execute("BEGIN"),
        client.execute(&lock, &by_aggregate),
        client.query_opt(&state, &by_aggregate),
        client.query_one(&operator, &by_operator),
        client.query_opt(&producer, &by_producer),
        client.query(&held_for, &by_aggregate),
    );
    counters.trip();
    begin?;
    locked?;
    let current = match state? {
        Some(row) => ownership_from_row(&row)?,
        None => OwnershipState::default(),
    };
    let facts = TransferFacts {
        operator_active: operator?.try_get(0)?,
        producer: producer?
            .map(|row| producer_fact_from_row(&row))
            .transpose()?,
        owner: current.owner.clone(),
        last: current.last,
        held: held?
            .iter()
            .map(held_from_row)
            .collect::<Result<_, Failure>>()?,
    };
    let now = clock::now();
    let plan = match decide_transfer(request, &facts, &now) {
        Ok(plan) => plan,
        Err(refusal) => {
            client.batch_execute("ROLLBACK").await?;
            counters.trip();
            return Ok(Err(TransferConflict { refusal, current }));
        }
    };
    write_and_commit(client, counters, &plan.changes).await?;
    Ok(Ok(plan.record))
}

/// Appends entries to the rejected list in one transaction.
pub(crate) async fn record_rejected(
    client: &Client,
    counters: &Counters,
    entries: &[RejectedDelivery],
) -> Result<(), Failure> {
    client.batch_execute("BEGIN").await?;
    counters.trip();
    let changes: Vec<Change> = entries
        .iter()
        .cloned()
        .map(Change::RecordRejected)
        .collect();
    write_and_commit(client, counters, &changes).await?;
    Ok(())
}

/// The aggregate's owner and last applied sequence (unowned and 0 without a row).
pub(crate) async fn ownership(
    client: &Client,
    counters: &Counters,
    aggregate_id: &str,
) -> Result<OwnershipState, Failure> {
    let read = client
        .prepare_cached(
            "SELECT owner, owner_epoch, last_sequence FROM aggregate_state WHERE aggregate_id = $1",
        )
        .await?;
    let row = client.query_opt(&read, &[&aggregate_id]).await;
    counters.trip();
    Ok(match row? {
        Some(row) => ownership_from_row(&row)?,
        None => OwnershipState::default(),
    })
}

fn ownership_from_row(row: &Row) -> Result<OwnershipState, Failure> {
    let owner = match row.try_get::<_, Option<String>>(0)? {
        Some(producer) => Some(AggregateOwner {
            producer,
            epoch: row.try_get::<_, Option<i64>>(1)?.unwrap_or(0),
        }),
        None => None,
    };
    Ok(OwnershipState {
        owner,
        last: row.try_get(2)?,
    })
}

fn producer_fact_from_row(row: &Row) -> Result<ProducerFact, Failure> {
    Ok(ProducerFact {
        current_epoch: row.try_get(0)?,
        active: row.try_get(1)?,
    })
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
        let producers: Vec<Option<String>> = row.try_get::<_, Option<_>>(26)?.unwrap_or_default();
        ids.into_iter()
            .zip(sequences)
            .zip(producers)
            .map(|((message_id, sequence), producer)| OpenDeadLetter {
                producer,
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
        owner: owner_from_columns(row, 24)?,
    })
}

/// The owner columns (producer, epoch) starting at `first`: no owner, or the producer and its
/// epoch.
fn owner_from_columns(row: &Row, first: usize) -> Result<Option<AggregateOwner>, Failure> {
    Ok(match row.try_get::<_, Option<String>>(first)? {
        Some(producer) => Some(AggregateOwner {
            producer,
            epoch: row.try_get::<_, Option<i64>>(first + 1)?.unwrap_or(0),
        }),
        None => None,
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
    let space = namespace(request.producer.as_deref());
    let by_dead_letter: [&(dyn ToSql + Sync); 2] = [&request.dead_letter_id, &space];
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
    // The replacement is applied in the dead letter's namespace.
    let producer = request.producer.as_deref();
    let space = namespace(producer);
    let mut message_keys: Vec<String> = std::iter::once(request.dead_letter_id.as_str())
        .chain(replacement_id)
        .map(|id| message_key(producer, id))
        .collect();
    message_keys.sort_unstable();
    message_keys.dedup();
    let no_aggregate = String::new();
    let aggregate_key = aggregate_id.unwrap_or(&no_aggregate);
    let replacement_key = replacement_id.unwrap_or("");

    // The aggregate first, then the message ids in sorted order: one order for every
    // transaction, so that locks alone never deadlock.
    let lock_params: Vec<(&tokio_postgres::Statement, [&(dyn ToSql + Sync); 1])> = aggregate_id
        .iter()
        .map(|id| (&lock_aggregate, [id as &(dyn ToSql + Sync)]))
        .chain(
            message_keys
                .iter()
                .map(|key| (&lock_message, [key as &(dyn ToSql + Sync)])),
        )
        .collect();
    let locks = join_all(
        lock_params
            .iter()
            .map(|(statement, params)| client.execute(*statement, params)),
    );
    let by_dead_letter: [&(dyn ToSql + Sync); 2] = [&request.dead_letter_id, &space];
    let by_aggregate: [&(dyn ToSql + Sync); 1] = [&aggregate_key];
    let by_operator: [&(dyn ToSql + Sync); 1] = [&request.operator];
    let by_replacement: [&(dyn ToSql + Sync); 2] = [&replacement_key, &space];
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
    let (aggregate, owner) = match (aggregate_id, aggregate) {
        (Some(_), Some(row)) => (
            Some(aggregate_from_row(&row)?),
            owner_from_columns(&row, 4)?,
        ),
        _ => (None, None),
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
        owner,
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
            current: Box::new(
                current_state(
                    client,
                    counters,
                    request.producer.as_deref(),
                    &request.dead_letter_id,
                )
                .await?,
            ),
        },
    })
}

/// The aggregate and the dead letter as they are now (inside the locking transaction), for a
/// refusal's body.
async fn current_state(
    client: &Client,
    counters: &Counters,
    producer: Option<&str>,
    dead_letter_id: &str,
) -> Result<CurrentState, Failure> {
    let dead_letter = views::dead_letter(client, counters, producer, dead_letter_id).await?;
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
            producer,
            message,
            payload,
            applied_at,
        } => {
            let params = vec![
                param(message.message_id.clone()),
                param(payload.clone()),
                param(message.aggregate_id.clone()),
                param(message.sequence),
                param(message.amount),
                param(applied_at.clone()),
                param(namespace(producer.as_deref()).to_owned()),
            ];
            writes.push(write(client, INSERT_APPLIED, params).await?);
        }
        Change::InsertDeadLetter {
            producer,
            message,
            payload,
            reason,
            at,
        } => {
            let params = vec![
                param(message.message_id.clone()),
                param(reason.as_str()),
                param(message.aggregate_id.clone()),
                param(message.sequence),
                param(payload.clone()),
                param(at.clone()),
                param(namespace(producer.as_deref()).to_owned()),
            ];
            writes.push(write(client, INSERT_DEAD_LETTER, params).await?);
        }
        Change::ObserveDeadLetter {
            producer,
            message_id,
            observations,
            at,
        } => {
            let params = vec![
                param(message_id.clone()),
                param(*observations),
                param(at.clone()),
                param(namespace(producer.as_deref()).to_owned()),
            ];
            writes.push(write(client, OBSERVE_DEAD_LETTER, params).await?);
        }
        Change::SupersedeDeadLetters {
            aggregate_id,
            message_ids,
            by,
            at,
        } => {
            let params = vec![
                param(message_ids.clone()),
                param(by.clone()),
                param(at.clone()),
                param(aggregate_id.clone()),
            ];
            writes.push(write(client, SUPERSEDE_DEAD_LETTERS, params).await?);
        }
        Change::ResolveDeadLetter {
            producer,
            message_id,
            at,
        } => {
            let params = vec![
                param(message_id.clone()),
                param(at.clone()),
                param(namespace(producer.as_deref()).to_owned()),
            ];
            writes.push(write(client, RESOLVE_DEAD_LETTER, params).await?);
        }
        Change::SetOwner {
            aggregate_id,
            owner,
            at,
        } => {
            let params = vec![
                param(aggregate_id.clone()),
                param(owner.producer.clone()),
                param(owner.epoch),
                param(at.clone()),
            ];
            writes.push(write(client, SET_OWNER, params).await?);
        }
        Change::TouchProducer {
            producer,
            aggregate_id,
            at,
        } => {
            let params = vec![
                param(producer.clone()),
                param(aggregate_id.clone()),
                param(at.clone()),
            ];
            writes.push(write(client, TOUCH_PRODUCER, params).await?);
        }
        Change::RecordTransfer(record) => {
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
            writes.push(write(client, RECORD_TRANSFER, params).await?);
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
        Change::RecordRejected(entry) => {
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
            writes.push(write(client, RECORD_REJECTED, params).await?);
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
            let link = vec![
                param(record.message_id.clone()),
                param(id),
                param(namespace(record.producer.as_deref()).to_owned()),
            ];
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
        param(namespace(record.producer.as_deref()).to_owned()),
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
        producer: row.try_get(2)?,
        message_id: row.try_get(0)?,
        sequence: row.try_get(1)?,
    })
}

impl From<Failure> for ResolutionError {
    fn from(failure: Failure) -> Self {
        ResolutionError::Store(failure.into_inbox_error())
    }
}
