//! The facts a decision reads in PostgreSQL, under the decision's locks, in its transaction:
//! BEGIN, the locks and every fact go out in one flight.
//!
//! Serialization: before reading any fact, the transaction takes
//! `pg_advisory_xact_lock(hashtextextended(aggregate_id, 0))` (which exists before the aggregate's
//! row does) and locks the aggregate's row `FOR UPDATE` where it exists; then one advisory lock
//! per message identity it reads or writes (`hashtextextended(key, 1)`, the key being the message
//! id in the anonymous namespace and `producer:message_id` in a producer's, see `message_key`),
//! because an identity spans aggregates: the same id sent to two aggregates at once must not get
//! two meanings. A producer's delivery then locks its producer's row `FOR SHARE`: a new session
//! (which updates that row) commits either before the delivery reads the epoch or after the
//! delivery committed; deliveries of one producer to different aggregates do not wait for each
//! other. Locks are taken in one order (the aggregate, then message keys sorted, then the
//! producer's row), and all are released at COMMIT or ROLLBACK. The facts are read after the
//! locks (READ COMMITTED: each statement sees everything committed before it), so they are
//! exactly what the previous writer of the aggregate left. A group of deliveries (`batch`)
//! takes the same locks for all of its aggregates, then all of its identities, each sorted, so
//! groups and single operations share one order.

use futures_util::future::join_all;
use futures_util::join;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

use super::connection::{Client, Counters, Failure};
use super::rows::{
    aggregate_from, applied_from, held_claim, held_from, known_dead_letter_from, namespace,
    open_from_row, owner_from, ownership_from_row, parsed, producer_fact_from_row, producer_now,
};
use super::views;
use crate::facts::{
    DeadLetterFact, DeliveryFacts, HeldMessage, OpenDeadLetter, OwnershipFacts, ProducerFact,
    ResolutionFacts, TransferFacts,
};
use crate::model::{AggregateStatus, OrderedMessage};
use crate::producers::TransferRequest;
use crate::resolution::{Action, ResolutionRequest};
use crate::views::OwnershipState;

/// A producer's facts, read after the delivery's locks: its row, locked `FOR SHARE` until the
/// delivery commits (a session's or a revocation's UPDATE of the row waits for it, or the
/// delivery waits for that UPDATE and reads the new epoch; deliveries of one producer share the
/// lock), and whether the aggregate has any history (only a fresh one can be claimed).
pub(super) const PRODUCER_FACTS: &str = "
WITH p AS (
    SELECT current_epoch, revoked_at IS NULL AS active FROM producers WHERE name = $2 FOR SHARE)
SELECT p.current_epoch, p.active,
       EXISTS(SELECT 1 FROM aggregate_state WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM aggregate_timeline WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM held_messages WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM ordered_inbox WHERE aggregate_id = $1)
    OR EXISTS(SELECT 1 FROM deadletters WHERE aggregate_id = $1)
  FROM (SELECT 1) AS one LEFT JOIN p ON true";
pub(super) const PRODUCER_ROW_LOCKED: &str =
    "SELECT current_epoch, revoked_at IS NULL FROM producers WHERE name = $1 FOR UPDATE";
const PRODUCER_ROW_SHARED: &str =
    "SELECT current_epoch, revoked_at IS NULL FROM producers WHERE name = $1 FOR SHARE";
const OWNERSHIP_LOCKED: &str = "SELECT owner, owner_epoch, last_sequence FROM aggregate_state
  WHERE aggregate_id = $1 FOR UPDATE";
const OWNERSHIP: &str =
    "SELECT owner, owner_epoch, last_sequence FROM aggregate_state WHERE aggregate_id = $1";
const LOCK_AGGREGATE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";
const LOCK_MESSAGE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 1))";
const AGGREGATE_ROW: &str = "SELECT last_sequence, status, status_since, owner, owner_epoch
  FROM aggregate_state WHERE aggregate_id = $1 FOR UPDATE";
const APPLIED_MESSAGE: &str =
    "SELECT payload, sequence, applied_at, aggregate_id FROM ordered_inbox
  WHERE message_id = $1 AND producer = $2";
const KNOWN_DEAD_LETTER: &str =
    "SELECT payload, reason, status, observations, aggregate_id, sequence
  FROM deadletters WHERE message_id = $1 AND producer = $2";
const OPEN_DEAD_LETTERS: &str = "SELECT message_id, sequence, NULLIF(producer, '')
  FROM deadletters WHERE aggregate_id = $1 AND status = 'open' ORDER BY id";
const DEAD_LETTER_HOME: &str =
    "SELECT aggregate_id FROM deadletters WHERE message_id = $1 AND producer = $2";
const DEAD_LETTER_FACT: &str = "SELECT status, aggregate_id, sequence, payload FROM deadletters
  WHERE message_id = $1 AND producer = $2";
/// The held row of this identity, and those of this aggregate, each with its producer's row as
/// it is now, locked `FOR SHARE` until the transaction ends (as a delivery locks its producer's
/// row): a session or a revocation waits for the drain that admits the held message against
/// it, or the drain reads what it wrote.
const HELD_MESSAGE: &str = "SELECT h.message_id, h.aggregate_id, h.sequence, h.payload,
       h.message_payload, h.held_at, h.producer, h.epoch, p.current_epoch, p.active
  FROM held_messages AS h LEFT JOIN LATERAL (
    SELECT current_epoch, revoked_at IS NULL AS active FROM producers
     WHERE name = h.producer AND h.producer <> '' FOR SHARE) p ON true
 WHERE h.message_id = $1 AND h.producer = $2";
pub(super) const HELD_FOR: &str = "SELECT h.message_id, h.aggregate_id, h.sequence, h.payload,
       h.message_payload, h.held_at, h.producer, h.epoch, p.current_epoch, p.active
  FROM held_messages AS h LEFT JOIN LATERAL (
    SELECT current_epoch, revoked_at IS NULL AS active FROM producers
     WHERE name = h.producer AND h.producer <> '' FOR SHARE) p ON true
 WHERE h.aggregate_id = $1 ORDER BY h.sequence";
const OPERATOR_ACTIVE: &str =
    "SELECT EXISTS(SELECT 1 FROM operators WHERE name = $1 AND revoked_at IS NULL)";

/// The advisory-lock key of a message identity: the id itself in the anonymous namespace (as
/// before producers existed), `producer:id` in a producer's. Two identities whose keys collide
/// only wait for each other; the facts are read by identity either way.
pub(super) fn message_key(producer: Option<&str>, message_id: &str) -> String {
    match producer {
        None => message_id.to_owned(),
        Some(producer) => format!("{producer}:{message_id}"),
    }
}

/// The ownership facts of a delivery from its row of [`PRODUCER_FACTS`] (`None`: an anonymous
/// delivery, which reads no producer and no history).
pub(super) fn ownership_facts(
    producer_row: Option<&Row>,
    facts: &DeliveryFacts,
) -> Result<OwnershipFacts, Failure> {
    Ok(match producer_row {
        Some(row) => OwnershipFacts {
            producer: match row.try_get::<_, Option<i64>>(0)? {
                Some(current_epoch) => Some(ProducerFact {
                    current_epoch,
                    active: row.try_get(1)?,
                }),
                None => None,
            },
            history: facts.owner.is_none() && row.try_get::<_, bool>(2)?,
            owner: facts.owner.clone(),
        },
        None => OwnershipFacts {
            producer: None,
            owner: facts.owner.clone(),
            history: false,
        },
    })
}

/// A delivery's row of the group commit's facts (`batch`): each group of columns is null when
/// its row is missing.
pub(super) fn delivery_facts_from_row(
    row: &Row,
    aggregate_id: &str,
) -> Result<DeliveryFacts, Failure> {
    let aggregate = match row.try_get::<_, Option<i64>>(0)? {
        Some(_) => Some(aggregate_from(row, 0)?),
        None => None,
    };
    // A payload and a reason are never null, so they tell whether their row exists.
    let applied = match row.try_get::<_, Option<String>>(3)? {
        Some(_) => Some(applied_from(row, 3)?),
        None => None,
    };
    let dead_letter = match row.try_get::<_, Option<String>>(8)? {
        Some(_) => Some(known_dead_letter_from(row, 7)?),
        None => None,
    };
    // Only a blocked aggregate has open dead letters (as the SQLite backend reads them).
    let blocked = aggregate.as_ref().map(|row| row.status) == Some(AggregateStatus::Blocked);
    let open_dead_letters = if blocked {
        open_from_arrays(row, 13)?
    } else {
        Vec::new()
    };
    // A held row's message id is never null, so it tells whether the row exists.
    let held_message = match row.try_get::<_, Option<String>>(16)? {
        Some(_) => Some(held_from(row, 16)?),
        None => None,
    };
    Ok(DeliveryFacts {
        applied,
        dead_letter,
        aggregate,
        open_dead_letters,
        held_message,
        held: held_from_arrays(row, 26, aggregate_id)?,
        owner: owner_from(row, 35)?,
        // Read apart, and only for a sequence already passed (`gaps::skipped_by`).
        skipped_by: None,
    })
}

/// The open dead letters from the three arrays starting at `first` (ids, sequences, producers).
fn open_from_arrays(row: &Row, first: usize) -> Result<Vec<OpenDeadLetter>, Failure> {
    let ids: Vec<String> = row.try_get::<_, Option<_>>(first)?.unwrap_or_default();
    let sequences: Vec<Option<i64>> = row.try_get::<_, Option<_>>(first + 1)?.unwrap_or_default();
    let producers: Vec<Option<String>> =
        row.try_get::<_, Option<_>>(first + 2)?.unwrap_or_default();
    Ok(ids
        .into_iter()
        .zip(sequences)
        .zip(producers)
        .map(|((message_id, sequence), producer)| OpenDeadLetter {
            producer,
            message_id,
            sequence,
        })
        .collect())
}

/// The aggregate's held messages from the nine arrays starting at column `first` (ids,
/// sequences, canonical contents, delivered payloads, held_at, producers, epochs, and each
/// producer's current epoch and whether it is active), in sequence order.
fn held_from_arrays(
    row: &Row,
    first: usize,
    aggregate_id: &str,
) -> Result<Vec<HeldMessage>, Failure> {
    let ids: Vec<String> = row.try_get::<_, Option<_>>(first)?.unwrap_or_default();
    let sequences: Vec<i64> = row.try_get::<_, Option<_>>(first + 1)?.unwrap_or_default();
    let payloads: Vec<String> = row.try_get::<_, Option<_>>(first + 2)?.unwrap_or_default();
    let delivered: Vec<String> = row.try_get::<_, Option<_>>(first + 3)?.unwrap_or_default();
    let held_at: Vec<String> = row.try_get::<_, Option<_>>(first + 4)?.unwrap_or_default();
    let producers: Vec<String> = row.try_get::<_, Option<_>>(first + 5)?.unwrap_or_default();
    let epochs: Vec<Option<i64>> = row.try_get::<_, Option<_>>(first + 6)?.unwrap_or_default();
    let current: Vec<Option<i64>> = row.try_get::<_, Option<_>>(first + 7)?.unwrap_or_default();
    let active: Vec<Option<bool>> = row.try_get::<_, Option<_>>(first + 8)?.unwrap_or_default();
    let producers = producers
        .into_iter()
        .zip(epochs)
        .zip(current.into_iter().zip(active));
    Ok(ids
        .into_iter()
        .zip(sequences)
        .zip(payloads)
        .zip(delivered)
        .zip(held_at)
        .zip(producers)
        .map(
            |(((((message_id, sequence), payload), delivered), held_at), producer)| {
                let ((producer, epoch), (current_epoch, active)) = producer;
                HeldMessage {
                    message: OrderedMessage {
                        message_id,
                        aggregate_id: aggregate_id.to_owned(),
                        sequence,
                        payload: super::rows::json(delivered),
                    },
                    payload,
                    held_at,
                    claim: held_claim(producer, epoch),
                    producer_now: producer_now(current_epoch, active),
                }
            },
        )
        .collect())
}

/// BEGIN and where the dead letter lives (which decides the aggregate to lock; a dead letter
/// never moves), then the locks and every fact of the resolution in one flight.
pub(super) async fn resolution_facts(
    client: &Client,
    counters: &Counters,
    request: &ResolutionRequest,
) -> Result<ResolutionFacts, Failure> {
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
    locked_resolution_facts(client, counters, request, aggregate_id.as_deref()).await
}

/// Locks the dead letter's aggregate and the message ids involved, then reads every fact the
/// resolution depends on, in one flight.
async fn locked_resolution_facts(
    client: &Client,
    counters: &Counters,
    request: &ResolutionRequest,
    aggregate_id: Option<&str>,
) -> Result<ResolutionFacts, Failure> {
    let statements = ResolutionStatements::prepare(client).await?;
    let replacement_id = match &request.action {
        Action::Replace { message_id, .. } => Some(message_id.as_str()),
        Action::Skip | Action::Accept => None,
    };
    let rows = ResolutionRows::read(
        client,
        counters,
        &statements,
        request,
        aggregate_id,
        replacement_id,
    )
    .await?;
    rows.into_facts(aggregate_id, replacement_id)
}

/// The statements of a resolution's locks and facts, prepared once per connection.
struct ResolutionStatements {
    lock_aggregate: Statement,
    lock_message: Statement,
    dead_letter_fact: Statement,
    aggregate_row: Statement,
    open_dead_letters: Statement,
    operator_active: Statement,
    applied_message: Statement,
    known_dead_letter: Statement,
    recorded: Statement,
    held_message: Statement,
    held_for: Statement,
}

impl ResolutionStatements {
    async fn prepare(client: &Client) -> Result<ResolutionStatements, Failure> {
        Ok(ResolutionStatements {
            lock_aggregate: client.prepare_cached(LOCK_AGGREGATE).await?,
            lock_message: client.prepare_cached(LOCK_MESSAGE).await?,
            dead_letter_fact: client.prepare_cached(DEAD_LETTER_FACT).await?,
            aggregate_row: client.prepare_cached(AGGREGATE_ROW).await?,
            open_dead_letters: client.prepare_cached(OPEN_DEAD_LETTERS).await?,
            operator_active: client.prepare_cached(OPERATOR_ACTIVE).await?,
            applied_message: client.prepare_cached(APPLIED_MESSAGE).await?,
            known_dead_letter: client.prepare_cached(KNOWN_DEAD_LETTER).await?,
            recorded: client.prepare_cached(views::RESOLUTION_OF).await?,
            held_message: client.prepare_cached(HELD_MESSAGE).await?,
            held_for: client.prepare_cached(HELD_FOR).await?,
        })
    }
}

/// The lock keys of a resolution's message ids: the dead letter's and the replacement's, in
/// the dead letter's namespace (the replacement is applied there), sorted and deduplicated.
fn resolution_message_keys(
    producer: Option<&str>,
    dead_letter_id: &str,
    replacement_id: Option<&str>,
) -> Vec<String> {
    let mut message_keys: Vec<String> = std::iter::once(dead_letter_id)
        .chain(replacement_id)
        .map(|id| message_key(producer, id))
        .collect();
    message_keys.sort_unstable();
    message_keys.dedup();
    message_keys
}

/// Takes a resolution's locks: the aggregate first, then the message ids in sorted order. One
/// order for every transaction, so that locks alone never deadlock.
async fn lock_resolution(
    client: &Client,
    statements: &ResolutionStatements,
    aggregate_id: Option<&str>,
    message_keys: &[String],
) -> Vec<Result<u64, tokio_postgres::Error>> {
    let lock_params: Vec<(&Statement, [&(dyn ToSql + Sync); 1])> = aggregate_id
        .iter()
        .map(|id| (&statements.lock_aggregate, [id as &(dyn ToSql + Sync)]))
        .chain(
            message_keys
                .iter()
                .map(|key| (&statements.lock_message, [key as &(dyn ToSql + Sync)])),
        )
        .collect();
    join_all(
        lock_params
            .iter()
            .map(|(statement, params)| client.execute(*statement, params)),
    )
    .await
}

/// The rows a resolution's facts are read from, every answer of the flight checked.
struct ResolutionRows {
    dead_letter: Option<Row>,
    aggregate: Option<Row>,
    open: Vec<Row>,
    active: Row,
    applied: Option<Row>,
    known: Option<Row>,
    recorded: Option<Row>,
    replacement_held: Option<Row>,
    held: Vec<Row>,
}

impl ResolutionRows {
    /// The locks and every read of the resolution, pipelined in one flight.
    async fn read(
        client: &Client,
        counters: &Counters,
        statements: &ResolutionStatements,
        request: &ResolutionRequest,
        aggregate_id: Option<&str>,
        replacement_id: Option<&str>,
    ) -> Result<ResolutionRows, Failure> {
        let producer = request.producer.as_deref();
        let space = namespace(producer);
        let message_keys =
            resolution_message_keys(producer, &request.dead_letter_id, replacement_id);
        let no_aggregate = String::new();
        let aggregate_key = aggregate_id.unwrap_or(&no_aggregate);
        let replacement_key = replacement_id.unwrap_or("");
        let by_dead_letter: [&(dyn ToSql + Sync); 2] = [&request.dead_letter_id, &space];
        let by_aggregate: [&(dyn ToSql + Sync); 1] = [&aggregate_key];
        let by_operator: [&(dyn ToSql + Sync); 1] = [&request.operator];
        let by_replacement: [&(dyn ToSql + Sync); 2] = [&replacement_key, &space];
        let s = statements;
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
            lock_resolution(client, s, aggregate_id, &message_keys),
            client.query_opt(&s.dead_letter_fact, &by_dead_letter),
            client.query_opt(&s.aggregate_row, &by_aggregate),
            client.query(&s.open_dead_letters, &by_aggregate),
            client.query_one(&s.operator_active, &by_operator),
            client.query_opt(&s.applied_message, &by_replacement),
            client.query_opt(&s.known_dead_letter, &by_replacement),
            client.query_opt(&s.recorded, &by_dead_letter),
            client.query_opt(&s.held_message, &by_replacement),
            client.query(&s.held_for, &by_aggregate),
        );
        counters.trip();
        // Every answer is checked, needed or not: an error anywhere aborted the transaction.
        for lock in locks {
            lock?;
        }
        Ok(ResolutionRows {
            dead_letter: dead_letter?,
            aggregate: aggregate?,
            open: open?,
            active: active?,
            applied: applied?,
            known: known?,
            recorded: recorded?,
            replacement_held: replacement_held?,
            held: held?,
        })
    }

    /// The resolution's facts from its rows: the aggregate's only if the dead letter has one,
    /// its open dead letters only while it is blocked, the replacement's only if there is one.
    fn into_facts(
        self,
        aggregate_id: Option<&str>,
        replacement_id: Option<&str>,
    ) -> Result<ResolutionFacts, Failure> {
        let dead_letter = self
            .dead_letter
            .map(|row| -> Result<DeadLetterFact, Failure> {
                Ok(DeadLetterFact {
                    status: parsed(&row, 0)?,
                    aggregate_id: row.try_get(1)?,
                    sequence: row.try_get(2)?,
                    payload: row.try_get(3)?,
                })
            })
            .transpose()?;
        let (aggregate, owner) = match (aggregate_id, self.aggregate) {
            (Some(_), Some(row)) => (Some(aggregate_from(&row, 0)?), owner_from(&row, 3)?),
            _ => (None, None),
        };
        let blocked = aggregate.as_ref().map(|row| row.status) == Some(AggregateStatus::Blocked);
        let open_dead_letters = if blocked {
            self.open
                .iter()
                .map(open_from_row)
                .collect::<Result<_, Failure>>()?
        } else {
            Vec::new()
        };
        let (replacement_applied, replacement_dead_letter, replacement_held) = match replacement_id
        {
            Some(_) => (
                self.applied.map(|row| applied_from(&row, 0)).transpose()?,
                self.known
                    .map(|row| known_dead_letter_from(&row, 0))
                    .transpose()?,
                self.replacement_held
                    .map(|row| held_from(&row, 0))
                    .transpose()?,
            ),
            None => (None, None, None),
        };
        let held = match aggregate_id {
            Some(_) => self
                .held
                .iter()
                .map(|row| held_from(row, 0))
                .collect::<Result<_, Failure>>()?,
            None => Vec::new(),
        };
        Ok(ResolutionFacts {
            dead_letter,
            recorded: self
                .recorded
                .map(|row| views::resolution_from_row(&row))
                .transpose()?,
            aggregate,
            open_dead_letters,
            operator_active: self.active.try_get(0)?,
            replacement_applied,
            replacement_dead_letter,
            replacement_held,
            held,
            owner,
        })
    }
}

/// BEGIN, the aggregate's lock, and a transfer's facts in one flight: the ownership as it is
/// (what a refusal shows), the operator, the receiving producer's row shared-locked, the held
/// messages.
pub(super) async fn transfer_facts(
    client: &Client,
    counters: &Counters,
    request: &TransferRequest,
) -> Result<(TransferFacts, OwnershipState), Failure> {
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
            .map(|row| held_from(row, 0))
            .collect::<Result<_, Failure>>()?,
    };
    Ok((facts, current))
}

/// The aggregate's owner and last applied sequence (unowned and 0 without a row), outside any
/// transaction.
pub(super) async fn ownership(
    client: &Client,
    counters: &Counters,
    aggregate_id: &str,
) -> Result<OwnershipState, Failure> {
    let read = client.prepare_cached(OWNERSHIP).await?;
    let row = client.query_opt(&read, &[&aggregate_id]).await;
    counters.trip();
    Ok(match row? {
        Some(row) => ownership_from_row(&row)?,
        None => OwnershipState::default(),
    })
}
