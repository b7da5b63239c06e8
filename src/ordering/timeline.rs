//! The per-aggregate history in `aggregate_timeline`: state events (applied, quarantined,
//! superseded, skipped, resolved) are append-only and written in the same transaction as the
//! state they describe; rejection observations (gap, stale, payload conflict, a quarantined
//! message seen again) are numbered per aggregate and only the newest [`OBSERVATIONS_KEPT`] stay,
//! so a flood of bad deliveries cannot grow the file without bound.

use rusqlite::{Connection, params};
use serde_json::Value;

/// Rejection observations kept per aggregate.
pub const OBSERVATIONS_KEPT: i64 = 100;

/// Something that changed an aggregate's state or a dead letter's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateEvent {
    Applied,
    Quarantined,
    Superseded,
    /// A resolution took a sequence with no effect.
    Skipped,
    Resolved,
}

impl StateEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            StateEvent::Applied => "applied",
            StateEvent::Quarantined => "quarantined",
            StateEvent::Superseded => "superseded",
            StateEvent::Skipped => "skipped",
            StateEvent::Resolved => "resolved",
        }
    }
}

/// A delivery that changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    Gap,
    Stale,
    PayloadConflict,
    /// A quarantined message delivered again, unchanged.
    QuarantinedAgain,
}

impl Observation {
    pub fn as_str(self) -> &'static str {
        match self {
            Observation::Gap => "gap",
            Observation::Stale => "stale",
            Observation::PayloadConflict => "payload conflict",
            Observation::QuarantinedAgain => "quarantined again",
        }
    }
}

/// Where an event happened: the aggregate, the sequence and the message it concerns.
pub struct Subject<'a> {
    pub aggregate_id: &'a str,
    pub sequence: Option<i64>,
    pub message_id: Option<&'a str>,
}

/// Appends a state event. Call it in the same write as the change it records.
pub fn record_event(
    connection: &Connection,
    subject: &Subject<'_>,
    at: &str,
    event: StateEvent,
    detail: &Value,
) -> rusqlite::Result<()> {
    connection
        .prepare_cached(
            "INSERT INTO aggregate_timeline(aggregate_id, at, kind, sequence, message_id, detail)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![
            subject.aggregate_id,
            at,
            event.as_str(),
            subject.sequence,
            subject.message_id,
            detail_text(detail),
        ])?;
    Ok(())
}

/// Appends a rejection observation and drops the ones that fell out of the newest
/// [`OBSERVATIONS_KEPT`]. Both statements seek the partial index on
/// `(aggregate_id, observation_no)`: the cost does not grow with the history.
pub fn record_observation(
    connection: &Connection,
    subject: &Subject<'_>,
    at: &str,
    observation: Observation,
    detail: &Value,
) -> rusqlite::Result<()> {
    let number: i64 = connection.prepare_cached(OBSERVATION_INSERT)?.query_row(
        params![
            subject.aggregate_id,
            at,
            observation.as_str(),
            subject.sequence,
            subject.message_id,
            detail_text(detail),
        ],
        |row| row.get(0),
    )?;
    if number > OBSERVATIONS_KEPT {
        connection
            .prepare_cached(OBSERVATION_PRUNE)?
            .execute(params![subject.aggregate_id, number - OBSERVATIONS_KEPT])?;
    }
    Ok(())
}

const OBSERVATION_INSERT: &str = "
INSERT INTO aggregate_timeline(aggregate_id, at, kind, sequence, message_id, detail, observation_no)
VALUES (?1, ?2, ?3, ?4, ?5, ?6,
        COALESCE((SELECT observation_no FROM aggregate_timeline
                   WHERE aggregate_id = ?1 AND observation_no IS NOT NULL
                   ORDER BY observation_no DESC LIMIT 1), 0) + 1)
RETURNING observation_no";

const OBSERVATION_PRUNE: &str = "
DELETE FROM aggregate_timeline
 WHERE aggregate_id = ?1 AND observation_no IS NOT NULL AND observation_no <= ?2";

fn detail_text(detail: &Value) -> Option<String> {
    (!detail.is_null()).then(|| detail.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use crate::schema::migrated_in_memory as migrated;

    fn plan(connection: &Connection, sql: &str) -> Vec<String> {
        let mut statement = connection
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .unwrap();
        statement
            .query_map(params!["a", 1], |row| row.get::<_, String>(3))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    #[test]
    fn observations_keep_only_the_newest_hundred_per_aggregate() {
        let connection = migrated();
        for sequence in 0..250 {
            let subject = Subject {
                aggregate_id: "a",
                sequence: Some(sequence),
                message_id: Some("m"),
            };
            record_observation(&connection, &subject, "t", Observation::Gap, &json!({})).unwrap();
        }
        let other = Subject {
            aggregate_id: "b",
            sequence: None,
            message_id: None,
        };
        record_observation(&connection, &other, "t", Observation::Stale, &Value::Null).unwrap();
        record_event(&connection, &other, "t", StateEvent::Applied, &Value::Null).unwrap();
        let (kept, oldest): (i64, i64) = connection
            .query_row(
                "SELECT COUNT(*), MIN(sequence) FROM aggregate_timeline WHERE aggregate_id = 'a'",
                [],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .unwrap();
        assert_eq!((kept, oldest), (100, 150));
        let others: i64 = connection
            .query_row(
                "SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = 'b'",
                [],
                |row| row.get(0),
            )
            .unwrap();
        assert_eq!(others, 2);
    }

    #[test]
    fn recording_an_observation_never_scans_the_timeline() {
        let connection = migrated();
        let prune = plan(&connection, OBSERVATION_PRUNE);
        assert!(prune.iter().all(|d| !d.starts_with("SCAN")), "{prune:?}");
        let insert = plan(
            &connection,
            "SELECT observation_no FROM aggregate_timeline
              WHERE aggregate_id = ?1 AND observation_no IS NOT NULL
              ORDER BY observation_no DESC LIMIT ?2",
        );
        assert!(
            insert
                .iter()
                .any(|d| d.contains("ix_timeline_observations")),
            "{insert:?}"
        );
        assert!(insert.iter().all(|d| !d.starts_with("SCAN")), "{insert:?}");
    }
}
