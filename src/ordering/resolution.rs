//! Operator-approved poison resolution. The quarantine branch never advances an aggregate; this is
//! the one deliberate way past a poison message other than a corrected message under a new id:
//!
//! - `replace` applies a new, valid message at the dead letter's sequence through the same engine
//!   and policy as any delivery;
//! - `skip` records an explicit skip event at that sequence: zero effect, last advances by one.
//!
//! Everything happens in the caller's one write: the preconditions (the dead letter is open, holds
//! `last + 1`, and `expectedLast` is the current last) are checked against the same snapshot the
//! change is made in, so of two operators racing with the same `expectedLast` exactly one wins.
//! A dry run performs the very same steps inside a nested savepoint and rolls them back.

use rusqlite::{Connection, params};
use serde_json::{Value, json};

use super::engine::{self, Door, OrderedMessage, Outcome};
use super::timeline::{StateEvent, Subject, record_event};
use super::views::{self, Position, ResolutionRecord};
use crate::store::StoreError;

/// What the operator decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Replace { message_id: String, amount: i64 },
    Skip,
}

impl Action {
    pub fn as_str(&self) -> &'static str {
        match self {
            Action::Replace { .. } => "replace",
            Action::Skip => "skip",
        }
    }
}

/// One resolution request, from an authenticated operator.
#[derive(Debug, Clone)]
pub struct ResolutionRequest {
    pub dead_letter_id: String,
    pub operator: String,
    pub action: Action,
    pub expected_last: i64,
    pub reason: String,
}

/// What a resolution call did.
#[derive(Debug, Clone)]
pub enum Resolved {
    /// Resolved now.
    New(ResolutionRecord),
    /// The same operator sent the same resolution before: its original result, nothing changed.
    Repeated(ResolutionRecord),
    /// What the resolution would do; nothing was written.
    DryRun(ResolutionRecord),
}

/// Why a resolution was refused. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum ResolutionError {
    #[error("no dead letter has message id '{0}'")]
    NotFound(String),
    /// A precondition failed: 409 with the current state.
    #[error("{title}: {detail}")]
    Conflict {
        title: &'static str,
        detail: String,
        current: Value,
    },
    /// The replacement itself would be quarantined by the policy.
    #[error("the replacement would be quarantined: {reason}")]
    ReplacementQuarantined { reason: String },
    /// The operator's token stopped being valid before the change.
    #[error("the operator's token is no longer valid")]
    Unauthorized,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<rusqlite::Error> for ResolutionError {
    fn from(error: rusqlite::Error) -> Self {
        ResolutionError::Store(StoreError::Sqlite(error))
    }
}

const DRY_RUN_SAVEPOINT: &str = "resolution_dry_run";

/// Checks the preconditions and resolves the dead letter, or (with `dry_run`) reports what that
/// would do and leaves every row as it was.
pub fn resolve(
    connection: &Connection,
    request: &ResolutionRequest,
    dry_run: bool,
    now: &str,
) -> Result<Resolved, ResolutionError> {
    let dead_letter = views::dead_letter(connection, &request.dead_letter_id)?
        .ok_or_else(|| ResolutionError::NotFound(request.dead_letter_id.clone()))?;
    let current = |connection: &Connection| current_state(connection, &request.dead_letter_id);
    match dead_letter.status.as_str() {
        "resolved" => {
            return match views::resolution_of(connection, &dead_letter.message_id)? {
                Some(original) if same_request(&original, request) => {
                    Ok(Resolved::Repeated(original))
                }
                _ => Err(ResolutionError::Conflict {
                    title: "The dead letter is already resolved",
                    detail: "a different resolution was recorded for it; only an identical repeat by the same operator answers 200".to_owned(),
                    current: current(connection)?,
                }),
            };
        }
        "open" => {}
        _ => {
            return Err(ResolutionError::Conflict {
                title: "The dead letter is not open",
                detail: format!(
                    "it is {}: another message already took its sequence",
                    dead_letter.status
                ),
                current: current(connection)?,
            });
        }
    }
    let (Some(aggregate_id), Some(sequence)) = (dead_letter.aggregate_id, dead_letter.sequence)
    else {
        return Err(ResolutionError::Conflict {
            title: "The dead letter's sequence is unknown",
            detail: "it was recorded by an earlier version that kept no sequence or payload; send a corrected message under a new id instead".to_owned(),
            current: current(connection)?,
        });
    };
    let before = engine::aggregate_state(connection, &aggregate_id)?.map_or(
        Position { last: 0, total: 0 },
        |state| Position {
            last: state.last,
            total: state.total,
        },
    );
    if request.expected_last != before.last {
        return Err(ResolutionError::Conflict {
            title: "The aggregate is not at the expected last sequence",
            detail: format!(
                "expectedLast is {} but the aggregate's last sequence is {}: review the current state and decide again",
                request.expected_last, before.last
            ),
            current: current(connection)?,
        });
    }
    if sequence != before.last + 1 {
        return Err(ResolutionError::Conflict {
            title: "The dead letter does not hold the next sequence",
            detail: format!(
                "it holds sequence {sequence}, and the aggregate needs {}",
                before.last + 1
            ),
            current: current(connection)?,
        });
    }
    let target = Target {
        aggregate_id: &aggregate_id,
        sequence,
        before,
    };
    if !dry_run {
        return Ok(Resolved::New(perform(connection, request, &target, now)?));
    }
    connection.execute_batch(&format!("SAVEPOINT {DRY_RUN_SAVEPOINT}"))?;
    let rehearsal = perform(connection, request, &target, now);
    connection.execute_batch(&format!(
        "ROLLBACK TO {DRY_RUN_SAVEPOINT}; RELEASE {DRY_RUN_SAVEPOINT}"
    ))?;
    let mut record = rehearsal?;
    record.resolution_id = None;
    Ok(Resolved::DryRun(record))
}

/// The dead letter's aggregate and sequence, checked to be next.
struct Target<'a> {
    aggregate_id: &'a str,
    sequence: i64,
    before: Position,
}

impl<'a> Target<'a> {
    /// The timeline subject of an event about this dead letter at its sequence.
    fn subject(&self, dead_letter_id: &'a str) -> Subject<'a> {
        Subject {
            aggregate_id: self.aggregate_id,
            sequence: Some(self.sequence),
            message_id: Some(dead_letter_id),
        }
    }
}

/// The change itself: the dead letter closes, the sequence is taken (replacement or skip), the
/// audit row and the timeline events are written, all in the caller's transaction.
fn perform(
    connection: &Connection,
    request: &ResolutionRequest,
    target: &Target<'_>,
    now: &str,
) -> Result<ResolutionRecord, ResolutionError> {
    if !operator_is_active(connection, &request.operator)? {
        return Err(ResolutionError::Unauthorized);
    }
    // Closed first, so that the replacement does not supersede the very dead letter it resolves.
    connection
        .prepare_cached(
            "UPDATE deadletters SET status = 'resolved', closed_at = ?2 WHERE message_id = ?1",
        )?
        .execute(params![request.dead_letter_id, now])?;
    match &request.action {
        Action::Replace { message_id, amount } => {
            let replacement = OrderedMessage {
                message_id: message_id.clone(),
                aggregate_id: target.aggregate_id.to_owned(),
                sequence: target.sequence,
                amount: *amount,
            };
            match engine::apply(connection, &replacement, Door::General, now)? {
                Outcome::Applied { .. } => {}
                Outcome::Quarantined { reason, .. } => {
                    return Err(ResolutionError::ReplacementQuarantined { reason });
                }
                Outcome::Replay { .. } | Outcome::PayloadConflict => {
                    return Err(ResolutionError::Conflict {
                        title: "The replacement's message id is already used",
                        detail: format!(
                            "message id '{message_id}' is already known; a replacement is a new message and needs a new id"
                        ),
                        current: current_state(connection, &request.dead_letter_id)?,
                    });
                }
                Outcome::Gap { .. } | Outcome::Stale { .. } => {
                    // The preconditions make the dead letter's sequence the next one.
                    return Err(ResolutionError::Conflict {
                        title: "The dead letter does not hold the next sequence",
                        detail: "the policy did not accept the replacement at this sequence"
                            .to_owned(),
                        current: current_state(connection, &request.dead_letter_id)?,
                    });
                }
            }
        }
        Action::Skip => {
            let advanced = connection
                .prepare_cached(
                    "UPDATE aggregate_state
                        SET last_sequence = ?2, status = 'flowing', status_since = ?3
                      WHERE aggregate_id = ?1 AND last_sequence = ?2 - 1",
                )?
                .execute(params![target.aggregate_id, target.sequence, now])?;
            if advanced != 1 {
                return Err(ResolutionError::Conflict {
                    title: "The dead letter does not hold the next sequence",
                    detail: "the aggregate moved while the skip was prepared".to_owned(),
                    current: current_state(connection, &request.dead_letter_id)?,
                });
            }
            let subject = target.subject(&request.dead_letter_id);
            record_event(
                connection,
                &subject,
                now,
                StateEvent::Skipped,
                &json!({"effect": 0, "operator": request.operator}),
            )?;
            engine::supersede_open(
                connection,
                target.aggregate_id,
                target.sequence,
                &request.dead_letter_id,
                now,
            )?;
        }
    }
    let after = engine::aggregate_state(connection, target.aggregate_id)?.map_or(
        Position { last: 0, total: 0 },
        |state| Position {
            last: state.last,
            total: state.total,
        },
    );
    let (replacement_id, replacement_amount) = match &request.action {
        Action::Replace { message_id, amount } => (Some(message_id.as_str()), Some(*amount)),
        Action::Skip => (None, None),
    };
    let resolution_id: i64 = connection
        .prepare_cached(
            "INSERT INTO resolutions(message_id, aggregate_id, sequence, action, operator, reason,
                                     expected_last, replacement_message_id, replacement_amount,
                                     before_last, before_total, after_last, after_total,
                                     resolved_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
             RETURNING id",
        )?
        .query_row(
            params![
                request.dead_letter_id,
                target.aggregate_id,
                target.sequence,
                request.action.as_str(),
                request.operator,
                request.reason,
                request.expected_last,
                replacement_id,
                replacement_amount,
                target.before.last,
                target.before.total,
                after.last,
                after.total,
                now,
            ],
            |row| row.get(0),
        )?;
    connection
        .prepare_cached("UPDATE deadletters SET resolution_id = ?2 WHERE message_id = ?1")?
        .execute(params![request.dead_letter_id, resolution_id])?;
    let subject = target.subject(&request.dead_letter_id);
    record_event(
        connection,
        &subject,
        now,
        StateEvent::Resolved,
        &json!({
            "resolutionId": resolution_id,
            "action": request.action.as_str(),
            "operator": request.operator,
            "reason": request.reason,
            "replacementMessageId": replacement_id,
        }),
    )?;
    // Read back from the row, so that a later identical repeat answers byte for byte the same.
    views::resolution_of(connection, &request.dead_letter_id)?.ok_or_else(|| {
        ResolutionError::Store(StoreError::Unavailable(
            "the resolution row was not readable after insert".to_owned(),
        ))
    })
}

fn operator_is_active(connection: &Connection, name: &str) -> rusqlite::Result<bool> {
    connection
        .prepare_cached(
            "SELECT EXISTS(SELECT 1 FROM operators WHERE name = ?1 AND revoked_at IS NULL)",
        )?
        .query_row([name], |row| row.get(0))
}

fn same_request(original: &ResolutionRecord, request: &ResolutionRequest) -> bool {
    let replacement = match &request.action {
        Action::Replace { message_id, amount } => Some((message_id.as_str(), *amount)),
        Action::Skip => None,
    };
    original.operator == request.operator
        && original.action == request.action.as_str()
        && original.expected_last == request.expected_last
        && original.reason == request.reason
        && original
            .replacement
            .as_ref()
            .map(|r| (r.message_id.as_str(), r.amount))
            == replacement
}

/// The aggregate and the dead letter as they are now, for a 409's body.
pub fn current_state(connection: &Connection, dead_letter_id: &str) -> rusqlite::Result<Value> {
    let dead_letter = views::dead_letter(connection, dead_letter_id)?;
    let aggregate = match dead_letter
        .as_ref()
        .and_then(|dead| dead.aggregate_id.as_deref())
    {
        Some(aggregate_id) => views::aggregate_summary(connection, aggregate_id)?,
        None => None,
    };
    Ok(json!({"aggregate": aggregate, "deadLetter": dead_letter}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> Connection {
        let connection = crate::schema::migrated_in_memory();
        connection
            .execute(
                "INSERT INTO operators(name, token_hash, created_at) VALUES ('alice', 'h', 't')",
                [],
            )
            .unwrap();
        for (id, sequence, amount) in [("m-1", 1, 5), ("poison-2", 2, -1)] {
            let message = OrderedMessage {
                message_id: id.into(),
                aggregate_id: "a".into(),
                sequence,
                amount,
            };
            engine::apply(&connection, &message, Door::General, "t0").unwrap();
        }
        connection
    }

    fn skip(expected_last: i64) -> ResolutionRequest {
        ResolutionRequest {
            dead_letter_id: "poison-2".into(),
            operator: "alice".into(),
            action: Action::Skip,
            expected_last,
            reason: "duplicate order".into(),
        }
    }

    fn snapshot(connection: &Connection) -> Vec<String> {
        let mut rows = Vec::new();
        for table in [
            "aggregate_state",
            "deadletters",
            "ordered_inbox",
            "aggregate_timeline",
            "resolutions",
        ] {
            let mut statement = connection
                .prepare(&format!("SELECT * FROM {table}"))
                .unwrap();
            let columns = statement.column_count();
            let mut query = statement.query([]).unwrap();
            while let Some(row) = query.next().unwrap() {
                let values: Vec<String> = (0..columns)
                    .map(|i| format!("{:?}", row.get_ref(i).unwrap()))
                    .collect();
                rows.push(format!("{table}: {}", values.join("|")));
            }
        }
        rows
    }

    #[test]
    fn a_dry_run_reports_the_real_result_and_changes_nothing() {
        let connection = setup();
        let before = snapshot(&connection);
        let Resolved::DryRun(rehearsal) = resolve(&connection, &skip(1), true, "t1").unwrap()
        else {
            panic!("expected a dry run");
        };
        assert_eq!(snapshot(&connection), before);
        let Resolved::New(real) = resolve(&connection, &skip(1), false, "t1").unwrap() else {
            panic!("expected a resolution");
        };
        assert_eq!(
            ResolutionRecord {
                resolution_id: None,
                ..real.clone()
            },
            rehearsal
        );
        assert_eq!(real.after, Position { last: 2, total: 5 });
    }

    #[test]
    fn a_stale_expected_last_is_refused_with_the_current_state() {
        let connection = setup();
        let refused = resolve(&connection, &skip(0), false, "t1").unwrap_err();
        let ResolutionError::Conflict { current, .. } = refused else {
            panic!("expected a conflict, got {refused:?}");
        };
        assert_eq!(current["aggregate"]["last"], 1);
        assert_eq!(current["deadLetter"]["status"], "open");
    }
}
