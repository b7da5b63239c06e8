//! Reading the inbox's SQLite rows into the core's values: stored enums, namespaces, stored
//! JSON, and the columns of each fact. Every other module of the backend reads through these.

use std::str::FromStr;

use rusqlite::Row;
use rusqlite::types::Type;
use serde_json::Value;

use crate::facts::{AppliedFact, HeldMessage, KnownDeadLetter};
use crate::model::{AggregateRow, OrderedMessage, QuarantineReason, UnknownValue};
use crate::records::{AggregateOwner, ProducerClaim};

/// A stored status or kind, read through its `FromStr`.
pub(super) fn parsed<T: FromStr<Err = UnknownValue>>(
    row: &Row<'_>,
    index: usize,
) -> rusqlite::Result<T> {
    let text: String = row.get(index)?;
    text.parse().map_err(|error| {
        rusqlite::Error::FromSqlConversionFailure(index, Type::Text, Box::new(error))
    })
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

/// The owner columns of an aggregate's row: no owner, or the producer and its epoch.
pub(super) fn owner_from(producer: Option<String>, epoch: Option<i64>) -> Option<AggregateOwner> {
    producer.map(|producer| AggregateOwner {
        producer,
        epoch: epoch.unwrap_or(0),
    })
}

/// An aggregate's row from three columns (last, status, since), the first at `first`.
pub(super) fn aggregate_from(row: &Row<'_>, first: usize) -> rusqlite::Result<AggregateRow> {
    Ok(AggregateRow {
        last: row.get(first)?,
        status: parsed(row, first + 1)?,
        since: row.get(first + 2)?,
    })
}

/// An applied message from four columns (payload, sequence, applied_at, aggregate_id), the first
/// at `first`.
pub(super) fn applied_from(row: &Row<'_>, first: usize) -> rusqlite::Result<AppliedFact> {
    Ok(AppliedFact {
        payload: row.get(first)?,
        sequence: row.get(first + 1)?,
        applied_at: row.get(first + 2)?,
        aggregate_id: row.get(first + 3)?,
    })
}

/// A known dead letter from six columns (payload, reason, status, observations, aggregate_id,
/// sequence), the first at `first`.
pub(super) fn dead_letter_from(row: &Row<'_>, first: usize) -> rusqlite::Result<KnownDeadLetter> {
    Ok(KnownDeadLetter {
        payload: row.get(first)?,
        reason: QuarantineReason::new(row.get::<_, String>(first + 1)?),
        status: parsed(row, first + 2)?,
        observations: row.get(first + 3)?,
        aggregate_id: row.get(first + 4)?,
        sequence: row.get(first + 5)?,
    })
}

/// The columns [`held_from`] reads, in its order.
pub(super) const HELD_COLUMNS: &str =
    "message_id, aggregate_id, sequence, payload, message_payload, held_at, producer, epoch";

/// A held message from the eight [`HELD_COLUMNS`], the first at `first`, without its producer's
/// row (`facts::with_producers` reads it). A row from before the delivered payload was kept
/// separately holds it as its canonical content.
pub(super) fn held_from(row: &Row<'_>, first: usize) -> rusqlite::Result<HeldMessage> {
    let payload: String = row.get(first + 3)?;
    let delivered: Option<String> = row.get(first + 4)?;
    let producer: String = row.get(first + 6)?;
    let epoch: Option<i64> = row.get(first + 7)?;
    let claim = match (producer.is_empty(), epoch) {
        (false, Some(epoch)) => Some(ProducerClaim { producer, epoch }),
        _ => None,
    };
    Ok(HeldMessage {
        message: OrderedMessage {
            message_id: row.get(first)?,
            aggregate_id: row.get(first + 1)?,
            sequence: row.get(first + 2)?,
            payload: json(delivered.unwrap_or_else(|| payload.clone())),
        },
        payload,
        held_at: row.get(first + 5)?,
        claim,
        producer_now: None,
    })
}
