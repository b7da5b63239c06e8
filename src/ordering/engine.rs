//! Applies the ordering policy to the store's rows: `ordered_inbox` (applied messages by id),
//! `aggregate_state` (last sequence, running total, flow status), `deadletters` (quarantined
//! messages and their lifecycle) and the aggregate timeline.
//!
//! Call it inside one write transaction (the store's writer gives each call its own savepoint):
//! the identity check, the sequence check and the write must see the same snapshot, which is what
//! makes concurrent deliveries of the same sequence apply exactly once. Every statement is a
//! primary-key or index seek, prepared once per connection.
//!
//! Both doors run this engine. The classroom door keeps the seed's identity rule (only applied
//! messages are known) and the seed's rows; the general door also knows quarantined messages, so
//! an immutable message id never changes meaning.

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;
use serde_json::json;

use super::policy::{Decision, decide};
use super::timeline::{Observation, StateEvent, Subject, record_event, record_observation};

/// Which route delivered the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// `POST /ordered/apply`: the seed's contract, identity checked against applied messages only,
    /// and no `aggregate_state` row written for a rejected delivery.
    Classroom,
    /// `POST /aggregates/{id}/messages`: identity also spans dead letters.
    General,
}

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

    fn subject(&self) -> Subject<'_> {
        Subject {
            aggregate_id: &self.aggregate_id,
            sequence: Some(self.sequence),
            message_id: Some(&self.message_id),
        }
    }
}

/// How an earlier delivery of the same message was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedRecord {
    pub sequence: i64,
    /// Unknown for messages applied before the timestamps existed.
    pub applied_at: Option<String>,
}

/// The dead letter a quarantined delivery is recorded as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterNote {
    /// `open`, `resolved` or `superseded`.
    pub status: String,
    pub observations: i64,
}

/// What happened to a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Applied {
        sequence: i64,
        total: i64,
        /// Open dead letters at this sequence that the message replaced.
        superseded: Vec<String>,
    },
    /// The same id with the same payload was applied before; nothing changed.
    Replay {
        original: AppliedRecord,
    },
    /// The id is known with a different payload; nothing changed.
    PayloadConflict,
    Gap {
        expected: i64,
    },
    Stale {
        expected: i64,
    },
    /// Recorded as a dead letter (or seen again as one); the aggregate did not advance.
    Quarantined {
        expected: i64,
        reason: String,
        /// `None` when the classroom door re-observed an id whose dead letter holds other content.
        dead_letter: Option<DeadLetterNote>,
    },
}

/// An aggregate's row in `aggregate_state`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggregateState {
    pub last: i64,
    pub total: i64,
    /// `flowing`, `waiting` or `blocked`.
    pub status: String,
}

impl AggregateState {
    fn is(&self, status: &str) -> bool {
        self.status == status
    }
}

/// The aggregate's row, if any message (or quarantine, or general-door gap) touched it.
pub fn aggregate_state(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<Option<AggregateState>> {
    connection
        .prepare_cached(
            "SELECT last_sequence, total, status FROM aggregate_state WHERE aggregate_id = ?1",
        )?
        .query_row([aggregate_id], |row| {
            Ok(AggregateState {
                last: row.get(0)?,
                total: row.get(1)?,
                status: row.get(2)?,
            })
        })
        .optional()
}

/// The aggregate's last applied sequence, 0 before its first message.
pub fn last_sequence(connection: &Connection, aggregate_id: &str) -> rusqlite::Result<i64> {
    Ok(aggregate_state(connection, aggregate_id)?.map_or(0, |state| state.last))
}

/// The classroom contract: identity against applied messages (replay / payload conflict), then
/// the ordering policy.
pub fn apply_ordered(
    connection: &Connection,
    message: &OrderedMessage,
) -> rusqlite::Result<Outcome> {
    apply(connection, message, Door::Classroom, &super::clock::now())
}

/// Decides and records one delivery. `now` stamps every row it writes.
pub fn apply(
    connection: &Connection,
    message: &OrderedMessage,
    door: Door,
    now: &str,
) -> rusqlite::Result<Outcome> {
    let payload = message.canonical_payload();
    if let Some(prior) = applied_message(connection, &message.message_id)? {
        if prior.payload == payload {
            return Ok(Outcome::Replay {
                original: AppliedRecord {
                    sequence: prior.sequence.unwrap_or(message.sequence),
                    applied_at: prior.applied_at,
                },
            });
        }
        return payload_conflict(connection, message, &payload, now);
    }
    if door == Door::General
        && let Some(known) = quarantined_payload(connection, &message.message_id)?
    {
        // A dead letter from before its payload was stored cannot prove it is the same message,
        // so it counts as a conflict: the id must not acquire a second meaning.
        return if known.as_deref() == Some(payload.as_str()) {
            observe_quarantined_again(connection, message, now)
        } else {
            payload_conflict(connection, message, &payload, now)
        };
    }

    let state = aggregate_state(connection, &message.aggregate_id)?;
    let last = state.as_ref().map_or(0, |state| state.last);
    match decide(last, message.sequence, message.amount) {
        Decision::Gap { expected } => {
            if state.as_ref().is_none_or(|state| state.is("flowing")) {
                mark_waiting(connection, &message.aggregate_id, door, now)?;
            }
            let detail = json!({"expected": expected});
            record_observation(
                connection,
                &message.subject(),
                now,
                Observation::Gap,
                &detail,
            )?;
            Ok(Outcome::Gap { expected })
        }
        Decision::Stale { expected } => {
            let detail = json!({"expected": expected});
            record_observation(
                connection,
                &message.subject(),
                now,
                Observation::Stale,
                &detail,
            )?;
            Ok(Outcome::Stale { expected })
        }
        Decision::Quarantine { expected, reason } => quarantine(
            connection,
            message,
            &payload,
            expected,
            reason.as_str(),
            now,
        ),
        Decision::Apply { sequence } => {
            let blocked = state.as_ref().is_some_and(|state| state.is("blocked"));
            apply_next(connection, message, &payload, sequence, blocked, now)
        }
    }
}

struct PriorApplication {
    payload: String,
    sequence: Option<i64>,
    applied_at: Option<String>,
}

fn applied_message(
    connection: &Connection,
    message_id: &str,
) -> rusqlite::Result<Option<PriorApplication>> {
    connection
        .prepare_cached(
            "SELECT payload, sequence, applied_at FROM ordered_inbox WHERE message_id = ?1",
        )?
        .query_row([message_id], |row| {
            Ok(PriorApplication {
                payload: row.get(0)?,
                sequence: row.get(1)?,
                applied_at: row.get(2)?,
            })
        })
        .optional()
}

/// The stored payload of a dead letter with this id: `Some(None)` for one recorded without it.
fn quarantined_payload(
    connection: &Connection,
    message_id: &str,
) -> rusqlite::Result<Option<Option<String>>> {
    connection
        .prepare_cached("SELECT payload FROM deadletters WHERE message_id = ?1")?
        .query_row([message_id], |row| row.get(0))
        .optional()
}

fn payload_conflict(
    connection: &Connection,
    message: &OrderedMessage,
    payload: &str,
    now: &str,
) -> rusqlite::Result<Outcome> {
    let detail = json!({"offered": payload});
    record_observation(
        connection,
        &message.subject(),
        now,
        Observation::PayloadConflict,
        &detail,
    )?;
    Ok(Outcome::PayloadConflict)
}

/// The general door's answer to a quarantined message delivered again: the same verdict, one
/// more observation, no new row.
fn observe_quarantined_again(
    connection: &Connection,
    message: &OrderedMessage,
    now: &str,
) -> rusqlite::Result<Outcome> {
    let (reason, note) = connection
        .prepare_cached(
            "UPDATE deadletters SET observations = observations + 1, last_seen = ?2
              WHERE message_id = ?1
             RETURNING reason, status, observations",
        )?
        .query_row(params![message.message_id, now], |row| {
            Ok((
                row.get::<_, String>(0)?,
                DeadLetterNote {
                    status: row.get(1)?,
                    observations: row.get(2)?,
                },
            ))
        })?;
    let detail = json!({"observations": note.observations, "status": note.status});
    record_observation(
        connection,
        &message.subject(),
        now,
        Observation::QuarantinedAgain,
        &detail,
    )?;
    Ok(Outcome::Quarantined {
        expected: last_sequence(connection, &message.aggregate_id)? + 1,
        reason,
        dead_letter: Some(note),
    })
}

/// Records a poison message at the expected sequence. The aggregate does not advance; it is
/// blocked until a valid message takes the sequence or an operator resolves the dead letter.
fn quarantine(
    connection: &Connection,
    message: &OrderedMessage,
    payload: &str,
    expected: i64,
    reason: &str,
    now: &str,
) -> rusqlite::Result<Outcome> {
    // As in the seed, the aggregate's row exists from its first quarantine on, still at its old
    // last sequence.
    connection
        .prepare_cached(
            "INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
             VALUES (?1, 0, 0, 'blocked', ?2)
             ON CONFLICT(aggregate_id) DO UPDATE SET status = 'blocked',
                                                     status_since = excluded.status_since
              WHERE status <> 'blocked'",
        )?
        .execute(params![message.aggregate_id, now])?;
    // The classroom door may deliver a quarantined id again (its identity rule only knows applied
    // messages); like the seed it keeps one row, counting the repeat if the content matches.
    let note = connection
        .prepare_cached(
            "INSERT INTO deadletters(message_id, reason, aggregate_id, sequence, payload,
                                     first_seen, last_seen, observations, status)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, 1, 'open')
             ON CONFLICT(message_id) DO UPDATE SET observations = observations + 1,
                                                   last_seen = excluded.last_seen
              WHERE payload IS excluded.payload
             RETURNING status, observations",
        )?
        .query_row(
            params![
                message.message_id,
                reason,
                message.aggregate_id,
                message.sequence,
                payload,
                now
            ],
            |row| {
                Ok(DeadLetterNote {
                    status: row.get(0)?,
                    observations: row.get(1)?,
                })
            },
        )
        .optional()?;
    match &note {
        Some(note) if note.observations == 1 => {
            let detail = json!({"reason": reason, "amount": message.amount});
            record_event(
                connection,
                &message.subject(),
                now,
                StateEvent::Quarantined,
                &detail,
            )?;
        }
        _ => {
            let detail = json!({"observations": note.as_ref().map(|n| n.observations)});
            record_observation(
                connection,
                &message.subject(),
                now,
                Observation::QuarantinedAgain,
                &detail,
            )?;
        }
    }
    Ok(Outcome::Quarantined {
        expected,
        reason: reason.to_owned(),
        dead_letter: note,
    })
}

fn mark_waiting(
    connection: &Connection,
    aggregate_id: &str,
    door: Door,
    now: &str,
) -> rusqlite::Result<()> {
    let sql = match door {
        // The seed writes no row for a gap: only an existing row learns it is waiting.
        Door::Classroom => {
            "UPDATE aggregate_state SET status = 'waiting', status_since = ?2
              WHERE aggregate_id = ?1 AND status = 'flowing'"
        }
        Door::General => {
            "INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
             VALUES (?1, 0, 0, 'waiting', ?2)
             ON CONFLICT(aggregate_id) DO UPDATE SET status = 'waiting',
                                                     status_since = excluded.status_since
              WHERE status = 'flowing'"
        }
    };
    connection
        .prepare_cached(sql)?
        .execute(params![aggregate_id, now])?;
    Ok(())
}

/// Applies the next sequence: the inbox row, the advanced state, the superseded dead letters and
/// their timeline events, all in the caller's transaction.
fn apply_next(
    connection: &Connection,
    message: &OrderedMessage,
    payload: &str,
    sequence: i64,
    blocked: bool,
    now: &str,
) -> rusqlite::Result<Outcome> {
    connection
        .prepare_cached(
            "INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, amount, applied_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![
            message.message_id,
            payload,
            message.aggregate_id,
            sequence,
            message.amount,
            now
        ])?;
    let total: i64 = connection
        .prepare_cached(
            "INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
             VALUES (?1, ?2, ?3, 'flowing', ?4)
             ON CONFLICT(aggregate_id) DO UPDATE SET
                 last_sequence = excluded.last_sequence,
                 total = total + excluded.total,
                 status_since = CASE WHEN status = 'flowing' THEN status_since
                                     ELSE excluded.status_since END,
                 status = 'flowing'
             RETURNING total",
        )?
        .query_row(
            params![message.aggregate_id, sequence, message.amount, now],
            |row| row.get(0),
        )?;
    let detail = json!({"amount": message.amount, "total": total});
    record_event(
        connection,
        &message.subject(),
        now,
        StateEvent::Applied,
        &detail,
    )?;
    // Open dead letters only ever sit at the expected sequence, and only a blocked aggregate has
    // any: a flowing one skips the statement.
    let superseded = if blocked {
        supersede_open(
            connection,
            &message.aggregate_id,
            sequence,
            &message.message_id,
            now,
        )?
    } else {
        Vec::new()
    };
    Ok(Outcome::Applied {
        sequence,
        total,
        superseded,
    })
}

/// Marks the open dead letters at `sequence` superseded by `taken_by` (the message applied, or
/// the dead letter whose skip took the sequence) and records each on the timeline.
pub(crate) fn supersede_open(
    connection: &Connection,
    aggregate_id: &str,
    sequence: i64,
    taken_by: &str,
    now: &str,
) -> rusqlite::Result<Vec<String>> {
    let superseded: Vec<String> = connection
        .prepare_cached(
            "UPDATE deadletters SET status = 'superseded', superseded_by = ?3, closed_at = ?4
              WHERE aggregate_id = ?1 AND sequence = ?2 AND status = 'open'
             RETURNING message_id",
        )?
        .query_map(params![aggregate_id, sequence, taken_by, now], |row| {
            row.get(0)
        })?
        .collect::<rusqlite::Result<_>>()?;
    let detail = json!({"by": taken_by});
    for message_id in &superseded {
        let subject = Subject {
            aggregate_id,
            sequence: Some(sequence),
            message_id: Some(message_id),
        };
        record_event(connection, &subject, now, StateEvent::Superseded, &detail)?;
    }
    Ok(superseded)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::schema::migrated_in_memory as migrated;

    fn message(id: &str, aggregate: &str, sequence: i64, amount: i64) -> OrderedMessage {
        OrderedMessage {
            message_id: id.into(),
            aggregate_id: aggregate.into(),
            sequence,
            amount,
        }
    }

    #[test]
    fn the_canonical_payload_keeps_the_seed_spelling() {
        assert_eq!(
            message("m", "demo", 1, 1).canonical_payload(),
            r#"{"AggregateId":"demo","Sequence":1,"Amount":1}"#
        );
    }

    #[test]
    fn identity_spans_dead_letters_only_at_the_general_door() {
        let connection = migrated();
        let poison = message("p", "a", 1, -1);
        assert!(matches!(
            apply(&connection, &poison, Door::General, "t1").unwrap(),
            Outcome::Quarantined { .. }
        ));
        let again = apply(&connection, &poison, Door::General, "t2").unwrap();
        assert_eq!(
            again,
            Outcome::Quarantined {
                expected: 1,
                reason: "negative amount".into(),
                dead_letter: Some(DeadLetterNote {
                    status: "open".into(),
                    observations: 2
                }),
            }
        );
        // Same id, corrected content: the general door refuses to give the id a second meaning,
        assert_eq!(
            apply(&connection, &message("p", "a", 1, 1), Door::General, "t3").unwrap(),
            Outcome::PayloadConflict
        );
        // while the classroom door, like the seed, only knows applied ids.
        assert!(matches!(
            apply(&connection, &message("p", "a", 1, 1), Door::Classroom, "t4").unwrap(),
            Outcome::Applied { sequence: 1, .. }
        ));
    }

    #[test]
    fn a_new_id_at_the_quarantined_sequence_supersedes_the_dead_letter() {
        let connection = migrated();
        apply(&connection, &message("p", "a", 1, -1), Door::General, "t1").unwrap();
        let outcome = apply(&connection, &message("fix", "a", 1, 2), Door::General, "t2").unwrap();
        assert_eq!(
            outcome,
            Outcome::Applied {
                sequence: 1,
                total: 2,
                superseded: vec!["p".into()]
            }
        );
        let (status, by): (String, String) = connection
            .query_row(
                "SELECT status, superseded_by FROM deadletters WHERE message_id = 'p'",
                [],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .unwrap();
        assert_eq!((status.as_str(), by.as_str()), ("superseded", "fix"));
        assert_eq!(
            aggregate_state(&connection, "a").unwrap().unwrap().status,
            "flowing"
        );
    }
}
