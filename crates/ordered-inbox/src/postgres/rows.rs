//! Reading the inbox's PostgreSQL rows into the core's values: stored enums, namespaces, stored
//! JSON, and the columns of each fact. Every other module of the backend reads through these.

use serde_json::Value;
use tokio_postgres::Row;

use super::connection::Failure;
use crate::facts::{AppliedFact, HeldMessage, KnownDeadLetter, OpenDeadLetter, ProducerFact};
use crate::model::{AggregateRow, OrderedMessage, QuarantineReason};
use crate::records::{AggregateOwner, ProducerClaim};
use crate::views::OwnershipState;

/// A stored status or kind, read through its `FromStr`.
pub(super) fn parsed<T>(row: &Row, index: usize) -> Result<T, Failure>
where
    T: std::str::FromStr<Err = crate::model::UnknownValue>,
{
    let text: String = row.try_get(index)?;
    Ok(text.parse()?)
}

/// The column value of a namespace: `''` is the anonymous one.
pub(super) fn namespace(producer: Option<&str>) -> &str {
    producer.unwrap_or("")
}

/// Stored JSON text as a value; text that is not JSON (a row written by other means) as a JSON
/// string, so that it is still shown rather than lost.
pub(super) fn json(text: String) -> Value {
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

/// Stored JSON text that may be absent.
pub(super) fn optional_json(text: Option<String>) -> Option<Value> {
    text.map(json)
}

/// An aggregate's row from three columns (last, status, since), the first at `first`.
pub(super) fn aggregate_from(row: &Row, first: usize) -> Result<AggregateRow, Failure> {
    Ok(AggregateRow {
        last: row.try_get(first)?,
        status: parsed(row, first + 1)?,
        since: row.try_get(first + 2)?,
    })
}

/// An applied message from four columns (payload, sequence, applied_at, aggregate_id), the first
/// at `first`.
pub(super) fn applied_from(row: &Row, first: usize) -> Result<AppliedFact, Failure> {
    Ok(AppliedFact {
        payload: row.try_get(first)?,
        sequence: row.try_get(first + 1)?,
        applied_at: row.try_get(first + 2)?,
        aggregate_id: row.try_get(first + 3)?,
    })
}

/// A known dead letter from six columns (payload, reason, status, observations, aggregate_id,
/// sequence), the first at `first`.
pub(super) fn known_dead_letter_from(row: &Row, first: usize) -> Result<KnownDeadLetter, Failure> {
    Ok(KnownDeadLetter {
        payload: row.try_get(first)?,
        reason: QuarantineReason::new(row.try_get::<_, String>(first + 1)?),
        status: parsed(row, first + 2)?,
        observations: row.try_get(first + 3)?,
        aggregate_id: row.try_get(first + 4)?,
        sequence: row.try_get(first + 5)?,
    })
}

pub(super) fn open_from_row(row: &Row) -> Result<OpenDeadLetter, Failure> {
    Ok(OpenDeadLetter {
        producer: row.try_get(2)?,
        message_id: row.try_get(0)?,
        sequence: row.try_get(1)?,
    })
}

/// A held message from the ten [`HELD_COLUMNS`] (message_id, aggregate_id, sequence, payload,
/// message_payload, held_at, producer, epoch, and the producer's current epoch and whether it
/// is active), the first at `first`.
pub(super) fn held_from(row: &Row, first: usize) -> Result<HeldMessage, Failure> {
    let producer: String = row.try_get(first + 6)?;
    Ok(HeldMessage {
        claim: held_claim(producer, row.try_get(first + 7)?),
        producer_now: producer_now(row.try_get(first + 8)?, row.try_get(first + 9)?),
        message: OrderedMessage {
            message_id: row.try_get(first)?,
            aggregate_id: row.try_get(first + 1)?,
            sequence: row.try_get(first + 2)?,
            payload: json(row.try_get(first + 4)?),
        },
        payload: row.try_get(first + 3)?,
        held_at: row.try_get(first + 5)?,
    })
}

/// A held row's claim from its producer column (`''`: anonymous) and epoch.
pub(super) fn held_claim(producer: String, epoch: Option<i64>) -> Option<ProducerClaim> {
    match (producer.is_empty(), epoch) {
        (false, Some(epoch)) => Some(ProducerClaim { producer, epoch }),
        _ => None,
    }
}

/// A held row's producer as it is now, from the joined row's columns (none when it has none).
pub(super) fn producer_now(
    current_epoch: Option<i64>,
    active: Option<bool>,
) -> Option<ProducerFact> {
    current_epoch.map(|current_epoch| ProducerFact {
        current_epoch,
        active: active.unwrap_or(false),
    })
}

/// The owner columns (producer, epoch) starting at `first`: no owner, or the producer and its
/// epoch.
pub(super) fn owner_from(row: &Row, first: usize) -> Result<Option<AggregateOwner>, Failure> {
    Ok(match row.try_get::<_, Option<String>>(first)? {
        Some(producer) => Some(AggregateOwner {
            producer,
            epoch: row.try_get::<_, Option<i64>>(first + 1)?.unwrap_or(0),
        }),
        None => None,
    })
}

/// An aggregate's owner and last sequence from three columns (owner, owner_epoch, last).
pub(super) fn ownership_from_row(row: &Row) -> Result<OwnershipState, Failure> {
    Ok(OwnershipState {
        owner: owner_from(row, 0)?,
        last: row.try_get(2)?,
    })
}

pub(super) fn producer_fact_from_row(row: &Row) -> Result<ProducerFact, Failure> {
    Ok(ProducerFact {
        current_epoch: row.try_get(0)?,
        active: row.try_get(1)?,
    })
}
