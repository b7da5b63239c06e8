//! Applies the ordering policy to the store's rows: `ordered_inbox` (applied messages by id),
//! `aggregate_state` (last sequence and running total) and `deadletters` (quarantined ids).
//!
//! Call it inside one write transaction (the store's writer gives each call its own savepoint):
//! the identity check, the sequence check and the write must see the same snapshot, which is what
//! makes concurrent deliveries of the same sequence apply exactly once.

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

use super::policy::{Decision, QuarantineReason, decide};

/// One ordered message as the consumer receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderedMessage {
    pub message_id: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub amount: i64,
}

/// The stored form of a message's meaning, with the seed's property names and order:
/// `{"AggregateId":"demo","Sequence":1,"Amount":1}`.
#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct CanonicalPayload<'a> {
    aggregate_id: &'a str,
    sequence: i64,
    amount: i64,
}

impl OrderedMessage {
    /// The canonical payload two deliveries must share to be the same message.
    pub fn canonical_payload(&self) -> String {
        serde_json::to_string(&CanonicalPayload {
            aggregate_id: &self.aggregate_id,
            sequence: self.sequence,
            amount: self.amount,
        })
        .unwrap_or_default()
    }
}

/// What happened to a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Applied {
        sequence: i64,
    },
    /// The same id with the same payload was applied before; nothing changed.
    Replay,
    /// The id was applied before with a different payload; nothing changed.
    PayloadConflict,
    Gap {
        expected: i64,
    },
    Stale {
        expected: i64,
    },
    /// Recorded as a dead letter; the aggregate did not advance.
    Quarantined {
        expected: i64,
        reason: QuarantineReason,
    },
}

/// The aggregate's last applied sequence, 0 before its first message.
pub fn last_sequence(connection: &Connection, aggregate_id: &str) -> rusqlite::Result<i64> {
    Ok(connection
        .query_row(
            "SELECT last_sequence FROM aggregate_state WHERE aggregate_id = ?1",
            [aggregate_id],
            |row| row.get(0),
        )
        .optional()?
        .unwrap_or(0))
}

/// The classroom contract: identity first (replay / payload conflict), then the ordering
/// policy. Gap, stale, replay and conflict write nothing.
pub fn apply_ordered(
    connection: &Connection,
    message: &OrderedMessage,
) -> rusqlite::Result<Outcome> {
    let payload = message.canonical_payload();
    let prior: Option<String> = connection
        .query_row(
            "SELECT payload FROM ordered_inbox WHERE message_id = ?1",
            [&message.message_id],
            |row| row.get(0),
        )
        .optional()?;
    if let Some(prior) = prior {
        return Ok(if prior == payload {
            Outcome::Replay
        } else {
            Outcome::PayloadConflict
        });
    }
    let last = last_sequence(connection, &message.aggregate_id)?;
    match decide(last, message.sequence, message.amount) {
        Decision::Gap { expected } => Ok(Outcome::Gap { expected }),
        Decision::Stale { expected } => Ok(Outcome::Stale { expected }),
        Decision::Quarantine { expected, reason } => {
            // As in the seed, the aggregate's row exists from its first quarantine on, still at
            // its old last sequence.
            connection.execute(
                "INSERT OR IGNORE INTO aggregate_state(aggregate_id, last_sequence, total) VALUES (?1, 0, 0)",
                [&message.aggregate_id],
            )?;
            connection.execute(
                "INSERT OR IGNORE INTO deadletters(message_id, reason) VALUES (?1, ?2)",
                params![message.message_id, reason.as_str()],
            )?;
            Ok(Outcome::Quarantined { expected, reason })
        }
        Decision::Apply { sequence } => {
            connection.execute(
                "INSERT INTO ordered_inbox(message_id, payload) VALUES (?1, ?2)",
                params![message.message_id, payload],
            )?;
            connection.execute(
                "INSERT INTO aggregate_state(aggregate_id, last_sequence, total) VALUES (?1, ?2, ?3)
                 ON CONFLICT(aggregate_id) DO UPDATE SET last_sequence = excluded.last_sequence,
                                                         total = total + excluded.total",
                params![message.aggregate_id, sequence, message.amount],
            )?;
            Ok(Outcome::Applied { sequence })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canonical_payload_keeps_the_seed_spelling() {
        let message = OrderedMessage {
            message_id: "m".into(),
            aggregate_id: "demo".into(),
            sequence: 1,
            amount: 1,
        };
        assert_eq!(
            message.canonical_payload(),
            r#"{"AggregateId":"demo","Sequence":1,"Amount":1}"#
        );
    }
}
