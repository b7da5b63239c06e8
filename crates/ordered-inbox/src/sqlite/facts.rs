//! The facts a decision reads in SQLite, in the decision's own unit: a delivery's (one
//! statement of index seeks), a resolution's, a producer's and a transfer's.

use rusqlite::{Connection, OptionalExtension, params};

use super::connection::WriterConnection;
use super::rows::{
    HELD_COLUMNS, aggregate_from, applied_from, dead_letter_from, held_from, namespace, owner_from,
    parsed,
};
use super::views;
use crate::facts::{
    AppliedFact, DeadLetterFact, DeliveryFacts, HeldMessage, KnownDeadLetter, OpenDeadLetter,
    OwnershipFacts, ProducerFact, ResolutionFacts, TransferFacts,
};
use crate::model::{AggregateRow, AggregateStatus, OrderedMessage};
use crate::records::{AggregateOwner, ProducerClaim};
use crate::resolution::{Action, ResolutionRequest};
use crate::views::OwnershipState;

/// A delivery's facts and the owner of its aggregate, as one read found them.
pub(super) struct DeliveryRead {
    pub facts: DeliveryFacts,
    pub owner: Option<AggregateOwner>,
}

/// The facts of a delivery whose id is in `producer`'s namespace (`None`: anonymous).
///
/// One statement reads every seek's rows ([`DELIVERY_FACTS`]); only a blocked aggregate needs a
/// second for its open dead letters.
pub(super) fn delivery_facts(
    connection: &WriterConnection<'_>,
    producer: Option<&str>,
    message: &OrderedMessage,
) -> rusqlite::Result<DeliveryRead> {
    let mut read = DeliveryRead {
        facts: DeliveryFacts::default(),
        owner: None,
    };
    let mut statement = connection.prepared(DELIVERY_FACTS)?;
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
                read.owner = owner_from(row.get(4)?, row.get(5)?);
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
    with_producers(connection, &mut read.facts.held)?;
    if let Some(held) = read.facts.held_message.as_mut() {
        with_producers(connection, std::slice::from_mut(held))?;
    }
    read.facts.open_dead_letters =
        open_dead_letters(connection, &message.aggregate_id, &read.facts.aggregate)?;
    Ok(read)
}

const FACT_AGGREGATE: i64 = 0;
const FACT_APPLIED: i64 = 1;
const FACT_DEAD_LETTER: i64 = 2;
const FACT_HELD_ID: i64 = 3;

/// Every seek a delivery needs, as one statement whose first column says which fact a row is:
/// the aggregate's row (0), the id applied (1), the id quarantined (2), the id held (3) and the
/// aggregate's held messages (4, sorted by the caller: an `ORDER BY` here would be re-prepared
/// on every run), each held row with its producer's row as it is now. One statement instead of five: each statement's cache lookup,
/// binding, stepping and reset cost more than its index seek.
pub(super) const DELIVERY_FACTS: &str = "
SELECT 0, last_sequence, status, status_since, owner, owner_epoch, NULL, NULL, NULL
  FROM aggregate_state WHERE aggregate_id = ?3
UNION ALL
SELECT 1, payload, sequence, applied_at, aggregate_id, NULL, NULL, NULL, NULL
  FROM ordered_inbox WHERE producer = ?1 AND message_id = ?2
UNION ALL
SELECT 2, payload, reason, status, observations, aggregate_id, sequence, NULL, NULL
  FROM deadletters WHERE producer = ?1 AND message_id = ?2
UNION ALL
SELECT 3, message_id, aggregate_id, sequence, payload, message_payload, held_at, producer, epoch
  FROM held_messages WHERE producer = ?1 AND message_id = ?2
UNION ALL
SELECT 4, message_id, aggregate_id, sequence, payload, message_payload, held_at, producer, epoch
  FROM held_messages WHERE aggregate_id = ?3";

/// The facts of a resolution: the dead letter, its aggregate (row, open dead letters, held
/// messages, owner), the operator, and what is known of the replacement's id.
pub(super) fn resolution_facts(
    connection: &Connection,
    request: &ResolutionRequest,
) -> rusqlite::Result<ResolutionFacts> {
    let producer = request.producer.as_deref();
    let dead_letter = dead_letter_fact(connection, producer, &request.dead_letter_id)?;
    let home = dead_letter.as_ref().and_then(|d| d.aggregate_id.clone());
    let aggregate = match home.as_deref() {
        Some(aggregate_id) => aggregate_row(connection, aggregate_id)?,
        None => None,
    };
    let (open_dead_letters, held, owner) = match home.as_deref() {
        Some(aggregate_id) => (
            open_dead_letters(connection, aggregate_id, &aggregate)?,
            held_for(connection, aggregate_id)?,
            ownership_state(connection, aggregate_id)?.owner,
        ),
        None => (Vec::new(), Vec::new(), None),
    };
    let (replacement_applied, replacement_dead_letter, replacement_held) = match &request.action {
        Action::Replace { message_id, .. } => (
            applied_message(connection, producer, message_id)?,
            known_dead_letter(connection, producer, message_id)?,
            held_message(connection, producer, message_id)?,
        ),
        Action::Skip | Action::Accept => (None, None, None),
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

fn dead_letter_fact(
    connection: &Connection,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Option<DeadLetterFact>> {
    connection
        .prepare_cached(
            "SELECT status, aggregate_id, sequence, payload FROM deadletters
              WHERE producer = ?1 AND message_id = ?2",
        )?
        .query_row(params![namespace(producer), message_id], |row| {
            Ok(DeadLetterFact {
                status: parsed(row, 0)?,
                aggregate_id: row.get(1)?,
                sequence: row.get(2)?,
                payload: row.get(3)?,
            })
        })
        .optional()
}

fn aggregate_row(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Option<AggregateRow>> {
    connection
        .prepare_cached(
            "SELECT last_sequence, status, status_since
               FROM aggregate_state WHERE aggregate_id = ?1",
        )?
        .query_row([aggregate_id], |row| aggregate_from(row, 0))
        .optional()
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
) -> rusqlite::Result<Option<AppliedFact>> {
    connection
        .prepare_cached(
            "SELECT payload, sequence, applied_at, aggregate_id FROM ordered_inbox
              WHERE producer = ?1 AND message_id = ?2",
        )?
        .query_row(params![namespace(producer), message_id], |row| {
            applied_from(row, 0)
        })
        .optional()
}

fn known_dead_letter(
    connection: &Connection,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Option<KnownDeadLetter>> {
    connection
        .prepare_cached(
            "SELECT payload, reason, status, observations, aggregate_id, sequence
               FROM deadletters WHERE producer = ?1 AND message_id = ?2",
        )?
        .query_row(params![namespace(producer), message_id], |row| {
            dead_letter_from(row, 0)
        })
        .optional()
}

fn held_message(
    connection: &Connection,
    producer: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Option<HeldMessage>> {
    let held = connection
        .prepare_cached(&format!(
            "SELECT {HELD_COLUMNS} FROM held_messages WHERE producer = ?1 AND message_id = ?2"
        ))?
        .query_row(params![namespace(producer), message_id], |row| {
            held_from(row, 0)
        })
        .optional()?;
    let mut held: Vec<HeldMessage> = held.into_iter().collect();
    with_producers(connection, &mut held)?;
    Ok(held.pop())
}

/// Reads each held message's producer row as it is now (one read per producer; anonymous
/// messages have none): a drain admits the message against it.
pub(super) fn with_producers(
    connection: &Connection,
    held: &mut [HeldMessage],
) -> rusqlite::Result<()> {
    let mut known: Vec<(String, Option<ProducerFact>)> = Vec::new();
    for message in held.iter_mut() {
        let Some(producer) = message.producer().map(str::to_owned) else {
            continue;
        };
        let fact = match known.iter().find(|(name, _)| *name == producer) {
            Some((_, fact)) => *fact,
            None => {
                let fact = producer_fact(connection, &producer)?;
                known.push((producer, fact));
                fact
            }
        };
        message.producer_now = fact;
    }
    Ok(())
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
        .query_map([aggregate_id], |row| held_from(row, 0))?
        .collect::<rusqlite::Result<_>>()?;
    held.sort_unstable_by_key(|row| row.message.sequence);
    with_producers(connection, &mut held)?;
    Ok(held)
}

/// Kept literal (not built from [`HELD_COLUMNS`]) so that the statement cache sees one text.
pub(super) const HELD_FOR_AGGREGATE: &str = "SELECT message_id, aggregate_id, sequence, payload, \
     message_payload, held_at, producer, epoch FROM held_messages WHERE aggregate_id = ?1";

pub(super) fn producer_fact(
    connection: &Connection,
    name: &str,
) -> rusqlite::Result<Option<ProducerFact>> {
    connection
        .prepare_cached("SELECT current_epoch, revoked_at IS NULL FROM producers WHERE name = ?1")?
        .query_row([name], |row| {
            Ok(ProducerFact {
                current_epoch: row.get(0)?,
                active: row.get(1)?,
            })
        })
        .optional()
}

/// The ownership facts of a delivery to an aggregate whose owner the delivery's read found.
pub(super) fn ownership_facts(
    connection: &Connection,
    aggregate_id: &str,
    claim: Option<&ProducerClaim>,
    owner: Option<AggregateOwner>,
) -> rusqlite::Result<OwnershipFacts> {
    let producer = match claim {
        Some(claim) => producer_fact(connection, &claim.producer)?,
        None => None,
    };
    // Only a claim asks whether the aggregate has history: anonymous deliveries and deliveries
    // to an owned aggregate skip the query.
    let history = claim.is_some() && owner.is_none() && has_history(connection, aggregate_id)?;
    Ok(OwnershipFacts {
        producer,
        owner,
        history,
    })
}

fn has_history(connection: &Connection, aggregate_id: &str) -> rusqlite::Result<bool> {
    connection
        .prepare_cached(
            "SELECT EXISTS(SELECT 1 FROM aggregate_state WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM aggregate_timeline WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM held_messages WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM ordered_inbox WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM deadletters WHERE aggregate_id = ?1)",
        )?
        .query_row([aggregate_id], |row| row.get(0))
}

/// The facts of an operator's transfer, and the ownership as it is now (what a refusal shows).
pub(super) fn transfer_facts(
    connection: &Connection,
    aggregate_id: &str,
    operator: &str,
    producer: &str,
) -> rusqlite::Result<(TransferFacts, OwnershipState)> {
    let state = ownership_state(connection, aggregate_id)?;
    let facts = TransferFacts {
        operator_active: super::operators::is_active(connection, operator)?,
        producer: producer_fact(connection, producer)?,
        owner: state.owner.clone(),
        last: state.last,
        held: held_for(connection, aggregate_id)?,
    };
    Ok((facts, state))
}

/// The aggregate's owner and last applied sequence (unowned and 0 without a row).
pub(super) fn ownership_state(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<OwnershipState> {
    let row = connection
        .prepare_cached(
            "SELECT owner, owner_epoch, last_sequence FROM aggregate_state WHERE aggregate_id = ?1",
        )?
        .query_row([aggregate_id], |row| {
            Ok((owner_from(row.get(0)?, row.get(1)?), row.get::<_, i64>(2)?))
        })
        .optional()?;
    Ok(match row {
        Some((owner, last)) => OwnershipState { owner, last },
        None => OwnershipState::default(),
    })
}
