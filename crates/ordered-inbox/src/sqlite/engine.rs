//! The SQLite side of every write operation: read the facts, let the core decide, write the
//! decided changes, and run the application's handler at each applied message, all in the
//! caller's unit of the writer (the single writer serializes every aggregate, and the facts and
//! the writes see one snapshot).
//!
//! The handler seam: before each applied message is recorded, the handler's `apply` runs on the
//! same connection. A plan that applies messages is undone to its start when `apply` declares
//! poison or fails (in the writer's bare attempt by sending the batch to its replay, where the
//! plan runs in a savepoint of its own: see `Guard`). A poison
//! from `apply` rolls the plan back (the handler's partial writes with it) and
//! the core decides again with that message marked poison, so the quarantine is recorded exactly
//! as a poison from `check` would be; a handler error rolls it back and fails this delivery
//! alone (the rest of its unit, and of its group commit, stands). A plan that applies nothing
//! never calls the handler and needs no savepoint.

use std::convert::Infallible;

use rusqlite::Connection;

use super::connection::WriterConnection;
use super::facts::{
    DeliveryRead, delivery_facts, ownership_facts, producer_fact, resolution_facts, transfer_facts,
};
use super::handler::SqliteHandler;
use super::store::StoreError;
use super::views;
use super::writes::write;
use crate::change::{Change, Plan, calls_handler};
use crate::content::{ApplyOutcome, Detail, Poison};
use crate::delivery::{Context, Outcome, decide_delivery, decide_producer_delivery};
use crate::error::{HandlerError, InboxError};
use crate::handling::{Overruled, Report, States, recorded, rounds};
use crate::inbox::Undelivered;
use crate::model::{Door, Limits, OrderedMessage};
use crate::producers::{TransferRequest, decide_transfer, next_epoch};
use crate::records::{ProducerClaim, ProducerRefusal, TransferRecord};
use crate::resolution::{
    Action, Mode, Refusal, ResolutionError, ResolutionRequest, Resolved, decide_resolution,
};
use crate::views::{CurrentState, TransferConflict};

/// One unit of work's means: the writer's connection, the application's handler, the store's
/// bounds and the time that stamps every row.
#[derive(Clone, Copy)]
pub struct Unit<'a, 'c> {
    /// The writer's connection, inside the unit's transaction.
    pub connection: &'a WriterConnection<'c>,
    /// The application's handler.
    pub handler: &'a dyn SqliteHandler,
    /// The store's bounds.
    pub limits: &'a Limits,
    /// The time now, in the stored format ([`crate::clock`]).
    pub now: &'a str,
}

/// Decides and records one anonymous delivery, without an ownership check. The inner `Err`:
/// the handler failed, and nothing of the delivery was recorded.
pub fn deliver_in(
    unit: Unit<'_, '_>,
    message: &OrderedMessage,
    door: Door,
) -> Result<Result<Outcome, HandlerError>, StoreError> {
    let mut facts = delivery_facts(unit.connection, None, message)?.facts;
    facts.skipped_by = super::gaps::skipped_by(unit.connection, message, &facts)?;
    let run = decided(unit, None, |context| {
        Ok::<_, Infallible>(decide_delivery(message, door, &facts, context))
    })?;
    Ok(match run {
        Run::Written(plan, report) => Ok(report.outcome(plan.outcome)),
        Run::Failed(error) => Err(error),
        Run::Refused(never) => match never {},
    })
}

/// Decides and records one delivery made by `claim`'s producer (`None`: anonymous), the
/// ownership facts read in the same unit as the write. A refusal or a handler failure writes
/// nothing.
pub fn deliver_as_in(
    unit: Unit<'_, '_>,
    message: &OrderedMessage,
    door: Door,
    claim: Option<&ProducerClaim>,
) -> Result<Result<Outcome, Undelivered>, StoreError> {
    let connection = unit.connection;
    let producer = claim.map(|claim| claim.producer.as_str());
    let DeliveryRead { mut facts, owner } = delivery_facts(connection, producer, message)?;
    facts.skipped_by = super::gaps::skipped_by(connection, message, &facts)?;
    let ownership = ownership_facts(connection, &message.aggregate_id, claim, owner)?;
    let run = decided(unit, None, |context| {
        decide_producer_delivery(message, door, claim, &ownership, &facts, context)
    })?;
    Ok(match run {
        Run::Written(plan, report) => {
            if matches!(plan.outcome, Outcome::Replay { .. })
                && crate::planted::active(crate::planted::Bug::ApplyReplayTwice)
            {
                let _ = unit.handler.apply(connection, message);
            }
            Ok(report.outcome(plan.outcome))
        }
        Run::Refused(refusal) => Err(Undelivered::Refused(refusal)),
        Run::Failed(error) => Err(Undelivered::Handler(error)),
    })
}

/// Checks the preconditions and resolves the dead letter, or (dry run) reports what that would
/// do and writes nothing. The audit row's `before` and `after` carry the handler's `state` of
/// the aggregate (a dry run's replacement is not applied, so its `after` has none).
pub fn resolve_in(
    unit: Unit<'_, '_>,
    request: &ResolutionRequest,
    mode: Mode,
) -> Result<Resolved, ResolutionError> {
    let connection = unit.connection;
    let facts = resolution_facts(connection, request).map_err(StoreError::from)?;
    let home = facts
        .dead_letter
        .as_ref()
        .and_then(|d| d.aggregate_id.as_deref());
    let before = match home {
        Some(aggregate_id) => unit
            .handler
            .state(connection, aggregate_id)
            .map_err(handler_failure)?,
        None => None,
    };
    // An accepted dead letter's own message applies as a replacement does.
    let replaces = matches!(request.action, Action::Replace { .. } | Action::Accept);
    let states = States {
        before,
        after_the_first_apply: replaces.then_some(home.unwrap_or_default()),
    };
    let run = decided(unit, Some(&states), |context| {
        decide_resolution(request, &facts, mode, context)
    })?;
    match run {
        Run::Written(plan, report) => Ok(recorded(plan.resolved, &states, &report, replaces)),
        Run::Refused(refusal) => Err(refusal_error(unit, request, refusal)),
        Run::Failed(error) => Err(handler_failure(error)),
    }
}

fn handler_failure(error: HandlerError) -> ResolutionError {
    ResolutionError::Store(InboxError::Handler(error))
}

fn refusal_error(
    unit: Unit<'_, '_>,
    request: &ResolutionRequest,
    refusal: Refusal,
) -> ResolutionError {
    match refusal {
        Refusal::NotFound => ResolutionError::NotFound(request.dead_letter_id.clone()),
        Refusal::ReplacementQuarantined(reason) => ResolutionError::ReplacementQuarantined(reason),
        Refusal::Unauthorized => ResolutionError::Unauthorized,
        Refusal::Conflict(kind) => {
            let mut current = match current_state(
                unit.connection,
                request.producer.as_deref(),
                &request.dead_letter_id,
            ) {
                Ok(current) => current,
                Err(error) => return ResolutionError::Store(StoreError::from(error).into()),
            };
            // The handler's state in the same unit as the rows the refusal shows.
            if let Err(error) = views::add_states(unit.connection, unit.handler, &mut current) {
                return handler_failure(error);
            }
            ResolutionError::Conflict {
                kind,
                current: Box::new(current),
            }
        }
    }
}

/// The aggregate and the dead letter as they are now, for a refusal's body (without the
/// handler's state: see [`views::add_states`]).
pub fn current_state(
    connection: &Connection,
    producer: Option<&str>,
    dead_letter_id: &str,
) -> rusqlite::Result<CurrentState> {
    let dead_letter = views::dead_letter(connection, producer, dead_letter_id)?;
    let aggregate = match dead_letter
        .as_ref()
        .and_then(|dead| dead.aggregate_id.as_deref())
    {
        Some(aggregate_id) => views::aggregate_summary(connection, aggregate_id)?,
        None => None,
    };
    Ok(CurrentState {
        aggregate,
        dead_letter,
    })
}

/// Starts a session: the producer's epoch goes one up, in this unit.
pub fn start_session_in(
    connection: &Connection,
    producer: &str,
) -> Result<Result<i64, ProducerRefusal>, StoreError> {
    let Some(fact) = producer_fact(connection, producer)? else {
        return Ok(Err(ProducerRefusal::Revoked));
    };
    let epoch = match next_epoch(fact) {
        Ok(epoch) => epoch,
        Err(refusal) => return Ok(Err(refusal)),
    };
    connection
        .prepare_cached("UPDATE producers SET current_epoch = ?2 WHERE name = ?1")?
        .execute(rusqlite::params![producer, epoch])?;
    Ok(Ok(epoch))
}

/// Checks an operator's transfer and records it: the owner columns, an audit row, a timeline
/// event, and the held messages it made inadmissible rejected. A refusal carries the aggregate's
/// ownership as it is now. A transfer applies no message, so the handler has no part in it.
pub fn transfer_in(
    connection: &WriterConnection<'_>,
    request: &TransferRequest,
    now: &str,
) -> Result<Result<TransferRecord, TransferConflict>, StoreError> {
    let (facts, current) = transfer_facts(
        connection,
        &request.aggregate_id,
        &request.operator,
        &request.producer,
    )?;
    let plan = match decide_transfer(request, &facts, now) {
        Ok(plan) => plan,
        Err(refusal) => return Ok(Err(TransferConflict { refusal, current })),
    };
    for change in &plan.changes {
        write(connection, change, &Detail::new())?;
    }
    Ok(Ok(plan.record))
}

/// How a decision's run ended.
pub(super) enum Run<P, R> {
    /// The plan and what writing it reported.
    Written(P, Report),
    /// The core refused (a producer refusal, a resolution's precondition): nothing written.
    Refused(R),
    /// The handler failed: nothing of the plan was kept.
    Failed(HandlerError),
}

/// How writing one plan ended.
enum Ran {
    Done(Report),
    /// `apply` declared the message at this sequence poison.
    Poisoned(i64, Poison),
    Failed(HandlerError),
}

/// Decides with `decide` and writes the plan, running the handler at each applied message;
/// after a poison from `apply`, decides again with that message poison. Each round marks one
/// more of the plan's messages poison, so the rounds are bounded by the messages one plan can
/// apply (the delivered one and every held one).
pub(super) fn decided<P: Plan, R>(
    unit: Unit<'_, '_>,
    states: Option<&States<'_>>,
    mut decide: impl FnMut(Context<'_>) -> Result<P, R>,
) -> Result<Run<P, R>, StoreError> {
    let mut poisoned: Vec<(i64, Poison)> = Vec::new();
    let rounds = rounds(unit.limits.max_held_per_aggregate);
    while poisoned.len() < rounds {
        let check = Overruled {
            inner: unit.handler,
            poisoned: &poisoned,
        };
        let context = Context {
            limits: unit.limits,
            check: &check,
            now: unit.now,
        };
        let plan = match decide(context) {
            Ok(plan) => plan,
            Err(refusal) => return Ok(Run::Refused(refusal)),
        };
        let guard = Guard::open(unit.connection, calls_handler(plan.changes()))?;
        match write_plan(unit, plan.changes(), states)? {
            Ran::Done(report) => {
                guard.keep()?;
                return Ok(Run::Written(plan, report));
            }
            Ran::Poisoned(sequence, poison) => {
                guard.undo(REPLAY_FOR_POISON)?;
                poisoned.push((sequence, poison));
            }
            Ran::Failed(error) => {
                guard.undo(REPLAY_FOR_FAILURE)?;
                return Ok(Run::Failed(error));
            }
        }
    }
    Ok(Run::Failed(HandlerError::new(
        "apply declared more messages poison than the decision applies",
    )))
}

/// Writes `changes` in order; before each applied message is recorded, runs the handler's
/// `apply` for it, and records the message with the detail it reported. The sequences a
/// resolution skipped go to the handler's `skipped` last, after every apply, so that no poison
/// can roll back to a savepoint taken after them.
fn write_plan(
    unit: Unit<'_, '_>,
    changes: &[Change],
    states: Option<&States<'_>>,
) -> Result<Ran, StoreError> {
    let mut report = Report::default();
    let mut skipped = Vec::new();
    for change in changes {
        let detail = match change.applied_message() {
            Some(message) => match apply(unit, message, states, &mut report) {
                Ok(detail) => detail,
                Err(ended) => return Ok(ended),
            },
            None => Detail::new(),
        };
        let written = match (change, states) {
            (Change::RecordResolution(record), Some(states)) => {
                let replaces = states.after_the_first_apply.is_some();
                let record = states.on(record.as_ref().clone(), report.after.as_ref(), replaces);
                write(
                    unit.connection,
                    &Change::RecordResolution(Box::new(record)),
                    &detail,
                )?
            }
            _ => write(unit.connection, change, &detail)?,
        };
        if let Some(resolution_id) = written {
            report.resolution_id = written;
            skipped.extend(change.skipped(resolution_id));
        }
        if let Some(message) = change.applied_message() {
            report.details.push((message.sequence, detail));
        }
    }
    for sequences in &skipped {
        if let Err(error) = unit.handler.skipped(unit.connection, sequences) {
            return Ok(Ran::Failed(error));
        }
    }
    Ok(Ran::Done(report))
}

/// Runs the handler's `apply` for `message`: its detail, or how the plan ends. After a
/// resolution's first apply (its replacement's) the handler's state of the aggregate is noted.
fn apply(
    unit: Unit<'_, '_>,
    message: &OrderedMessage,
    states: Option<&States<'_>>,
    report: &mut Report,
) -> Result<Detail, Ran> {
    let detail = match unit.handler.apply(unit.connection, message) {
        Ok(ApplyOutcome::Applied { detail }) => detail,
        Ok(ApplyOutcome::Poison(poison)) => return Err(Ran::Poisoned(message.sequence, poison)),
        Err(error) => return Err(Ran::Failed(error)),
    };
    if let Some(aggregate_id) = states.and_then(|states| states.after_the_first_apply)
        && report.details.is_empty()
    {
        report.after = unit
            .handler
            .state(unit.connection, aggregate_id)
            .map_err(Ran::Failed)?;
    }
    Ok(detail)
}

/// Why a unit's bare attempt gives way to the writer's replay, where it runs in savepoints.
const REPLAY_FOR_POISON: &str = "apply declared poison: the batch runs again with savepoints";
const REPLAY_FOR_FAILURE: &str = "apply failed: the batch runs again with savepoints";

/// The savepoint a plan that applies messages is written in (`open` false: none was taken).
///
/// Not in the writer's first, bare attempt of a batch ([`super::store::in_bare_attempt`]): there
/// a plan is written without one, since nearly every `apply` succeeds and a savepoint
/// per delivery costs SQLite a statement journal of every page the delivery first touches; a
/// poison or a failure from `apply` there fails the unit, the writer rolls the attempt back and
/// runs the batch again, and this time the plan's own savepoint undoes exactly its writes.
struct Guard<'c> {
    connection: &'c Connection,
    open: bool,
}

impl<'c> Guard<'c> {
    fn open(connection: &'c Connection, applies: bool) -> rusqlite::Result<Guard<'c>> {
        let open = applies && !super::store::in_bare_attempt();
        if open {
            connection
                .prepare_cached("SAVEPOINT handler")?
                .execute([])?;
        }
        Ok(Guard { connection, open })
    }

    fn keep(self) -> rusqlite::Result<()> {
        if self.open {
            self.connection
                .prepare_cached("RELEASE handler")?
                .execute([])?;
        }
        Ok(())
    }

    /// Rolls the plan's writes back to its savepoint; without one (the bare attempt), fails the
    /// unit with `replay`, so that the writer rolls the attempt back and runs it in savepoints.
    fn undo(self, replay: &str) -> Result<(), StoreError> {
        if !self.open {
            return Err(StoreError::Unavailable(replay.to_owned()));
        }
        self.connection
            .prepare_cached("ROLLBACK TO handler")?
            .execute([])?;
        self.connection
            .prepare_cached("RELEASE handler")?
            .execute([])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rusqlite::params;
    use rusqlite::types::ValueRef;

    use super::super::facts::{DELIVERY_FACTS, HELD_FOR_AGGREGATE, held_for};
    use super::super::testing::{detail, migrated, order as message, orders, skips, unit};
    use super::super::writes::{OBSERVATION_PRUNE, append};
    use crate::model::{DeadLetterStatus, QuarantineReason};
    use crate::records::ResolutionRecord;
    use crate::sqlite::schema::query_plan;
    use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};
    use crate::views::PageRequest;
    use serde_json::json;

    fn deliver_through(
        connection: &Connection,
        message: &OrderedMessage,
        door: Door,
        at: &str,
    ) -> Outcome {
        deliver_in(unit(&WriterConnection::new(connection), at), message, door)
            .unwrap()
            .unwrap()
    }

    fn deliver(connection: &Connection, message: &OrderedMessage, at: &str) -> Outcome {
        deliver_through(connection, message, Door::General, at)
    }

    fn rows(connection: &Connection, sql: &str) -> Vec<String> {
        let mut statement = connection.prepare(sql).unwrap();
        let columns = statement.column_count();
        let mut query = statement.query([]).unwrap();
        let mut rows = Vec::new();
        while let Some(row) = query.next().unwrap() {
            let values: Vec<String> = (0..columns)
                .map(|i| match row.get_ref(i).unwrap() {
                    ValueRef::Null => "NULL".to_owned(),
                    ValueRef::Integer(n) => n.to_string(),
                    ValueRef::Real(x) => x.to_string(),
                    ValueRef::Text(t) | ValueRef::Blob(t) => String::from_utf8_lossy(t).into(),
                })
                .collect();
            rows.push(values.join("|"));
        }
        rows
    }

    fn snapshot(connection: &Connection) -> Vec<String> {
        [
            "aggregate_state",
            "deadletters",
            "ordered_inbox",
            "aggregate_timeline",
            "resolutions",
        ]
        .iter()
        .flat_map(|table| rows(connection, &format!("SELECT * FROM {table}")))
        .collect()
    }

    /// Every event of the aggregate's timeline, walked `limit` at a time, as
    /// `id|kind|sequence|detail`.
    fn walked_timeline(connection: &Connection, aggregate: &str, limit: i64) -> Vec<String> {
        let mut seen = Vec::new();
        let mut after = 0;
        loop {
            let page =
                views::timeline(connection, aggregate, PageRequest { after, limit }).unwrap();
            assert!(page.items.len() <= limit as usize);
            seen.extend(page.items.iter().map(|event| {
                let detail = event
                    .detail
                    .as_ref()
                    .map(|d| d.to_string())
                    .unwrap_or_default();
                format!(
                    "{}|{}|{}|{}",
                    event.id,
                    event.kind.as_str(),
                    event.sequence.unwrap_or(0),
                    detail
                )
            }));
            match page.next {
                Some(next) => after = next,
                None => return seen,
            }
        }
    }

    #[test]
    fn an_applied_event_is_stored_on_its_inbox_row_and_paged_in_order_with_the_others() {
        let connection = migrated();
        deliver(&connection, &message("m-1", "a", 1, 5), "t1");
        deliver(&connection, &message("m-3", "a", 3, 1), "t2"); // a gap
        deliver(&connection, &message("p-2", "a", 2, -1), "t3"); // quarantined
        deliver(&connection, &message("m-2", "a", 2, 2), "t4"); // supersedes p-2, applies
        deliver(&connection, &message("m-3", "a", 3, 3), "t5");
        deliver(&connection, &message("b-1", "b", 1, 7), "t6"); // another aggregate, between
        deliver(&connection, &message("m-4", "a", 4, 4), "t7");
        assert_eq!(
            rows(
                &connection,
                "SELECT COUNT(*) FROM aggregate_timeline WHERE kind = 'applied'"
            ),
            ["0"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id, event_id IS NOT NULL, json_extract(applied_detail, '$.ordered')
                   FROM ordered_inbox WHERE aggregate_id = 'a' ORDER BY sequence"
            ),
            ["m-1|1|5", "m-2|1|7", "m-3|1|10", "m-4|1|14"]
        );
        let whole = walked_timeline(&connection, "a", 100);
        let kinds: Vec<&str> = whole.iter().map(|e| e.split('|').nth(1).unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "applied",
                "gap",
                "quarantined",
                "applied",
                "superseded",
                "applied",
                "applied"
            ]
        );
        assert!(
            whole[0].ends_with(r#"|1|{"quantity":5,"ordered":5}"#),
            "{}",
            whole[0]
        );
        let ids: Vec<i64> = whole
            .iter()
            .map(|e| e.split('|').next().unwrap().parse().unwrap())
            .collect();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "{ids:?}");
        for limit in 1..=4 {
            assert_eq!(
                walked_timeline(&connection, "a", limit),
                whole,
                "pages of {limit}"
            );
        }
        assert_eq!(walked_timeline(&connection, "b", 1).len(), 1);
    }

    #[test]
    fn a_file_without_its_event_counter_refuses_the_write_instead_of_losing_the_event() {
        let connection = migrated();
        connection.execute("DELETE FROM timeline_ids", []).unwrap();
        let refused = deliver_in(
            unit(&WriterConnection::new(&connection), "t1"),
            &message("m-1", "a", 1, 5),
            Door::General,
        );
        assert!(refused.is_err());
    }

    #[test]
    fn a_new_id_at_the_quarantined_sequence_supersedes_the_dead_letter_in_the_rows() {
        let connection = migrated();
        deliver(&connection, &message("p", "a", 1, -1), "t1");
        let outcome = deliver(&connection, &message("fix", "a", 1, 2), "t2");
        assert_eq!(
            outcome,
            Outcome::Applied {
                sequence: 1,
                superseded: vec!["p".into()],
                detail: detail(json!({"quantity": 2, "ordered": 2})),
            }
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT status, superseded_by, closed_at FROM deadletters WHERE message_id = 'p'"
            ),
            ["superseded|fix|t2"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT last_sequence, total, status, status_since FROM aggregate_state"
            ),
            ["1|0|flowing|t2"],
            "the inbox writes 0 into the seed's total and never touches it again"
        );
        assert_eq!(orders(&connection), ["fix|a|2"]);
    }

    #[test]
    fn a_resolution_writes_the_audit_row_and_a_dry_run_writes_nothing() {
        let connection = migrated();
        connection
            .execute(
                "INSERT INTO operators(name, token_hash, created_at) VALUES ('alice', 'h', 't')",
                [],
            )
            .unwrap();
        deliver(&connection, &message("m-1", "a", 1, 5), "t0");
        deliver(&connection, &message("poison-2", "a", 2, -1), "t0");
        let skip = ResolutionRequest {
            producer: None,
            dead_letter_id: "poison-2".into(),
            operator: "alice".into(),
            action: Action::Skip,
            expected_last: 1,
            reason: "duplicate order".into(),
        };
        let before = snapshot(&connection);
        let rehearsal = resolve_in(
            unit(&WriterConnection::new(&connection), "t1"),
            &skip,
            Mode::DryRun,
        )
        .unwrap();
        assert_eq!(snapshot(&connection), before);
        let Resolved::New(record) = resolve_in(
            unit(&WriterConnection::new(&connection), "t1"),
            &skip,
            Mode::Commit,
        )
        .unwrap() else {
            panic!("expected a resolution");
        };
        assert_eq!(record.resolution_id, Some(1));
        assert_eq!(
            rehearsal,
            Resolved::DryRun(ResolutionRecord {
                resolution_id: None,
                ..record.clone()
            })
        );
        assert_eq!(
            views::resolution_of(&connection, None, "poison-2").unwrap(),
            Some(record)
        );
        let event = rows(
            &connection,
            "SELECT kind, detail FROM aggregate_timeline WHERE kind = 'resolved'",
        );
        assert_eq!(
            event,
            [format!(
                "resolved|{}",
                TimelineDetail::Resolved {
                    resolution_id: 1,
                    action: crate::model::ActionKind::Skip,
                    operator: "alice".into(),
                    reason: "duplicate order".into(),
                    replacement_message_id: None
                }
                .to_json()
                .unwrap()
            )]
        );
        let refused = resolve_in(
            unit(&WriterConnection::new(&connection), "t2"),
            &ResolutionRequest {
                reason: "again".into(),
                ..skip
            },
            Mode::Commit,
        )
        .unwrap_err();
        let ResolutionError::Conflict { current, .. } = refused else {
            panic!("expected a conflict, got {refused:?}");
        };
        assert_eq!(current.aggregate.map(|a| a.last), Some(2));
        assert_eq!(
            current.dead_letter.map(|d| d.status),
            Some(DeadLetterStatus::Resolved)
        );
    }

    #[test]
    fn observations_keep_only_the_newest_hundred_per_aggregate() {
        let connection = migrated();
        for sequence in 0..250 {
            let entry = TimelineEntry {
                aggregate_id: "a".into(),
                at: "t".into(),
                kind: TimelineKind::Gap,
                sequence: Some(sequence),
                message_id: Some("m".into()),
                detail: TimelineDetail::Expected { expected: 1 },
            };
            append(&WriterConnection::new(&connection), &entry).unwrap();
        }
        let state_event = TimelineEntry {
            aggregate_id: "b".into(),
            at: "t".into(),
            kind: TimelineKind::Quarantined,
            sequence: None,
            message_id: None,
            detail: TimelineDetail::Quarantined {
                reason: QuarantineReason::new("negative quantity"),
                detail: detail(json!({"quantity": -1})),
            },
        };
        append(&WriterConnection::new(&connection), &state_event).unwrap();
        assert_eq!(
            rows(
                &connection,
                "SELECT COUNT(*), MIN(sequence) FROM aggregate_timeline WHERE aggregate_id = 'a'"
            ),
            ["100|150"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = 'b'"
            ),
            ["1"]
        );
    }

    #[test]
    fn recording_an_observation_never_scans_the_timeline() {
        let connection = migrated();
        for sql in [
            OBSERVATION_PRUNE,
            "SELECT observation_no FROM aggregate_timeline
              WHERE aggregate_id = ?1 AND observation_no IS NOT NULL
              ORDER BY observation_no DESC LIMIT +?2",
        ] {
            let details = query_plan(&connection, sql, params!["a", 1]);
            assert!(
                details.iter().all(|d| !d.starts_with("SCAN")),
                "{details:?}"
            );
        }
    }

    #[test]
    fn held_rows_are_read_without_re_preparing() {
        let connection = migrated();
        // Held out of order, so the sort has something to do.
        for (id, sequence) in [("m-4", 4), ("m-2", 2), ("m-3", 3)] {
            deliver_through(
                &connection,
                &message(id, "a", sequence, 1),
                Door::Broker,
                "t1",
            );
        }
        let next = message("m-5", "a", 5, 1);
        for _ in 0..20 {
            let by_resolution = held_for(&connection, "a").unwrap();
            let by_delivery = delivery_facts(&WriterConnection::new(&connection), None, &next)
                .unwrap()
                .facts
                .held;
            for held in [by_resolution, by_delivery] {
                let sequences: Vec<i64> = held.iter().map(|row| row.message.sequence).collect();
                assert_eq!(sequences, [2, 3, 4]);
            }
        }
        for sql in [HELD_FOR_AGGREGATE, DELIVERY_FACTS] {
            let statement = connection.prepare_cached(sql).unwrap();
            assert_eq!(
                statement.get_status(rusqlite::StatementStatus::RePrepare),
                0,
                "every delivery reads the held rows; a re-prepare per read is a parse per delivery"
            );
        }
    }

    #[test]
    fn the_aggregate_row_and_its_status_index_follow_every_delivery() {
        let connection = migrated();
        let by_status = |status: &str| {
            rows(
                &connection,
                &format!(
                    "SELECT aggregate_id, last_sequence, status_since FROM aggregate_state
                      INDEXED BY ix_aggregate_state_status WHERE status = '{status}'"
                ),
            )
        };
        deliver(&connection, &message("m-1", "a", 1, 5), "t1");
        deliver(&connection, &message("m-2", "a", 2, 3), "t2");
        assert_eq!(by_status("flowing"), ["a|2|t1"]);
        deliver(&connection, &message("m-3", "a", 3, -1), "t3");
        assert_eq!(by_status("blocked"), ["a|2|t3"]);
        assert!(by_status("flowing").is_empty());
        deliver(&connection, &message("m-3b", "a", 3, 4), "t4");
        deliver(&connection, &message("m-4", "a", 4, 1), "t5");
        assert_eq!(by_status("flowing"), ["a|4|t4"]);
        assert_eq!(rows(&connection, "SELECT ordered FROM books"), ["13"]);
        assert!(by_status("blocked").is_empty());
        assert_eq!(rows(&connection, "PRAGMA integrity_check"), ["ok"]);
    }

    #[test]
    fn a_delivery_reads_its_facts_by_index_seeks_only() {
        let connection = migrated();
        let details = query_plan(&connection, DELIVERY_FACTS, params!["", "m-1", "a"]);
        let seeks = details.iter().filter(|d| d.starts_with("SEARCH")).count();
        assert_eq!(seeks, 5, "{details:?}");
        assert!(
            details.iter().all(|d| !d.starts_with("SCAN")),
            "{details:?}"
        );
    }

    #[test]
    fn one_read_finds_every_fact_of_a_delivery() {
        let connection = migrated();
        deliver(&connection, &message("m-1", "a", 1, 1), "t1");
        deliver(&connection, &message("m-3", "a", 3, 1), "t2");
        deliver_through(&connection, &message("m-4", "a", 4, 1), Door::Broker, "t3");
        let applied = delivery_facts(
            &WriterConnection::new(&connection),
            None,
            &message("m-1", "a", 1, 1),
        )
        .unwrap();
        assert_eq!(applied.facts.applied.unwrap().sequence, Some(1));
        assert_eq!(applied.facts.aggregate.unwrap().last, 1);
        let gap = delivery_facts(
            &WriterConnection::new(&connection),
            None,
            &message("m-3", "a", 3, 1),
        )
        .unwrap();
        assert!(gap.facts.applied.is_none());
        assert_eq!(gap.facts.held.len(), 1);
        let held = delivery_facts(
            &WriterConnection::new(&connection),
            None,
            &message("m-4", "a", 4, 1),
        )
        .unwrap();
        assert_eq!(held.facts.held_message.unwrap().message.sequence, 4);
        let producers = delivery_facts(
            &WriterConnection::new(&connection),
            Some("p"),
            &message("m-1", "a", 1, 1),
        )
        .unwrap();
        assert!(producers.facts.applied.is_none() && producers.facts.held_message.is_none());
        assert!(producers.owner.is_none());
    }

    #[test]
    fn held_rows_are_written_by_the_broker_door_and_drained_by_the_predecessor() {
        let connection = migrated();
        let broker =
            |message: &OrderedMessage| deliver_through(&connection, message, Door::Broker, "t1");
        assert!(matches!(
            broker(&message("m-3", "a", 3, 3)),
            Outcome::Held { held: 1, .. }
        ));
        assert!(matches!(
            broker(&message("m-2", "a", 2, 2)),
            Outcome::Held { held: 2, .. }
        ));
        assert!(matches!(
            broker(&message("m-2", "a", 2, 2)),
            Outcome::Held { repeated: true, .. }
        ));
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id, sequence FROM held_messages ORDER BY sequence"
            ),
            ["m-2|2", "m-3|3"]
        );
        assert_eq!(
            rows(&connection, "SELECT status FROM aggregate_state"),
            ["waiting"]
        );
        let view = views::aggregate_view(&connection, "a").unwrap().unwrap();
        assert_eq!((view.held_sequences, view.held_count), (vec![2, 3], 2));
        broker(&message("m-1", "a", 1, 1));
        assert!(rows(&connection, "SELECT * FROM held_messages").is_empty());
        assert_eq!(
            rows(
                &connection,
                "SELECT last_sequence, status FROM aggregate_state"
            ),
            ["3|flowing"]
        );
        assert_eq!(
            orders(&connection),
            ["m-1|a|1", "m-2|a|2", "m-3|a|3"],
            "each drained message went through the handler"
        );
        assert_eq!(rows(&connection, "SELECT ordered FROM books"), ["6"]);
        let timeline = views::timeline(
            &connection,
            "a",
            PageRequest {
                after: 0,
                limit: 50,
            },
        )
        .unwrap()
        .items
        .into_iter()
        .map(|event| format!("{}|{}", event.kind.as_str(), event.sequence.unwrap_or(0)))
        .collect::<Vec<_>>();
        assert_eq!(
            timeline,
            [
                "held|3",
                "held|2",
                "applied|1",
                "drained|2",
                "applied|2",
                "drained|3",
                "applied|3"
            ]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id FROM ordered_inbox ORDER BY sequence"
            ),
            ["m-1", "m-2", "m-3"]
        );
    }

    fn cap(connection: &Connection, aggregate: &str, most: i64) {
        connection
            .execute(
                "INSERT INTO caps(aggregate_id, most) VALUES (?1, ?2)",
                params![aggregate, most],
            )
            .unwrap();
    }

    #[test]
    fn a_poison_from_apply_after_it_wrote_a_row_leaves_no_trace_of_that_row() {
        let connection = migrated();
        cap(&connection, "a", 5);
        deliver(&connection, &message("m-1", "a", 1, 4), "t1");
        let outcome = deliver(&connection, &message("m-2", "a", 2, 3), "t2");
        // Recorded exactly as a poison from the check: a dead letter blocking the aggregate.
        assert_eq!(
            outcome,
            Outcome::Quarantined {
                expected: 2,
                reason: QuarantineReason::new("over the cap"),
                dead_letter: Some(crate::delivery::DeadLetterNote {
                    status: DeadLetterStatus::Open,
                    observations: 1
                }),
            }
        );
        assert_eq!(
            orders(&connection),
            ["m-1|a|4"],
            "m-2's order row was rolled back"
        );
        assert_eq!(rows(&connection, "SELECT ordered FROM books"), ["4"]);
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id, reason, status FROM deadletters"
            ),
            ["m-2|over the cap|open"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT last_sequence, status FROM aggregate_state"
            ),
            ["1|blocked"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT detail FROM aggregate_timeline WHERE kind = 'quarantined'"
            ),
            [r#"{"reason":"over the cap","quantity":3}"#]
        );
        assert_eq!(
            rows(&connection, "SELECT COUNT(*) FROM ordered_inbox"),
            ["1"]
        );
    }

    #[test]
    fn a_handler_error_records_nothing_of_the_delivery_and_a_retry_applies_it_once() {
        let connection = migrated();
        connection
            .execute("INSERT INTO outage(aggregate_id) VALUES ('a')", [])
            .unwrap();
        let before = snapshot(&connection);
        let failed = deliver_in(
            unit(&WriterConnection::new(&connection), "t1"),
            &message("m-1", "a", 1, 2),
            Door::General,
        )
        .unwrap();
        assert_eq!(
            failed,
            Err(HandlerError::new("the order book is unavailable"))
        );
        assert_eq!(
            snapshot(&connection),
            before,
            "no inbox row, no timeline event"
        );
        assert!(
            orders(&connection).is_empty(),
            "the handler's own row is gone too"
        );
        connection.execute("DELETE FROM outage", []).unwrap();
        assert!(matches!(
            deliver(&connection, &message("m-1", "a", 1, 2), "t2"),
            Outcome::Applied { sequence: 1, .. }
        ));
        assert!(matches!(
            deliver(&connection, &message("m-1", "a", 1, 2), "t3"),
            Outcome::Replay { .. }
        ));
        assert_eq!(orders(&connection), ["m-1|a|2"]);
    }

    #[test]
    fn a_poison_from_apply_in_a_drain_quarantines_that_held_message_and_stops_the_drain() {
        let connection = migrated();
        cap(&connection, "a", 3);
        for (id, sequence, quantity) in [("m-2", 2, 5), ("m-3", 3, 1)] {
            let held = deliver_through(
                &connection,
                &message(id, "a", sequence, quantity),
                Door::Broker,
                "t1",
            );
            assert!(matches!(held, Outcome::Held { .. }));
        }
        let first = deliver_through(&connection, &message("m-1", "a", 1, 1), Door::Broker, "t2");
        assert_eq!(
            first,
            Outcome::Applied {
                sequence: 1,
                superseded: vec![],
                detail: detail(json!({"quantity": 1, "ordered": 1})),
            }
        );
        assert_eq!(orders(&connection), ["m-1|a|1"]);
        assert_eq!(
            rows(&connection, "SELECT message_id, reason FROM deadletters"),
            ["m-2|over the cap"]
        );
        assert_eq!(
            rows(&connection, "SELECT message_id FROM held_messages"),
            ["m-3"],
            "the drain stopped at the poison"
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT last_sequence, status FROM aggregate_state"
            ),
            ["1|blocked"]
        );
    }

    fn replace(
        connection: &Connection,
        id: &str,
        quantity: i64,
        at: &str,
    ) -> Result<Resolved, ResolutionError> {
        let request = ResolutionRequest {
            producer: None,
            dead_letter_id: "bad-2".into(),
            operator: "alice".into(),
            action: Action::Replace {
                message_id: id.into(),
                payload: json!({ "quantity": quantity }),
            },
            expected_last: 1,
            reason: "corrected upstream".into(),
        };
        resolve_in(
            unit(&WriterConnection::new(connection), at),
            &request,
            Mode::Commit,
        )
    }

    /// `a` at last 1 (an order of 1), blocked by `bad-2`, with `m-3` (3) held behind it.
    fn blocked_with_a_held_successor() -> Connection {
        let connection = migrated();
        connection
            .execute(
                "INSERT INTO operators(name, token_hash, created_at) VALUES ('alice', 'h', 't')",
                [],
            )
            .unwrap();
        deliver(&connection, &message("m-1", "a", 1, 1), "t0");
        deliver(&connection, &message("bad-2", "a", 2, -1), "t0");
        deliver_through(&connection, &message("m-3", "a", 3, 3), Door::Broker, "t0");
        connection
    }

    #[test]
    fn a_replacement_and_the_drain_after_it_run_the_handler_and_the_audit_row_shows_its_states() {
        let connection = blocked_with_a_held_successor();
        let Resolved::New(record) = replace(&connection, "fix-2", 4, "t1").unwrap() else {
            panic!("expected a resolution");
        };
        assert_eq!(orders(&connection), ["fix-2|a|4", "m-1|a|1", "m-3|a|3"]);
        assert_eq!(record.before.state, Some(json!({"ordered": 1})));
        assert_eq!(
            record.after.state,
            Some(json!({"ordered": 5})),
            "after the replacement, before the drain"
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT replacement_payload, before_state, after_state FROM resolutions"
            ),
            [r#"{"quantity":4}|{"ordered":1}|{"ordered":5}"#]
        );
        assert_eq!(
            views::resolution_of(&connection, None, "bad-2").unwrap(),
            Some(record)
        );
    }

    #[test]
    fn a_replacement_that_apply_finds_poison_is_refused_and_writes_nothing() {
        let connection = blocked_with_a_held_successor();
        cap(&connection, "a", 2);
        let before = snapshot(&connection);
        let refused = replace(&connection, "fix-2", 4, "t1").unwrap_err();
        assert!(
            matches!(&refused, ResolutionError::ReplacementQuarantined(reason) if reason.as_str() == "over the cap"),
            "{refused:?}"
        );
        assert_eq!(snapshot(&connection), before);
        assert_eq!(orders(&connection), ["m-1|a|1"]);
    }

    #[test]
    fn a_skips_audit_row_shows_the_same_state_before_and_after() {
        let connection = blocked_with_a_held_successor();
        let skip = ResolutionRequest {
            producer: None,
            dead_letter_id: "bad-2".into(),
            operator: "alice".into(),
            action: Action::Skip,
            expected_last: 1,
            reason: "cancelled".into(),
        };
        let Resolved::New(record) = resolve_in(
            unit(&WriterConnection::new(&connection), "t1"),
            &skip,
            Mode::Commit,
        )
        .unwrap() else {
            panic!("expected a resolution");
        };
        assert_eq!(record.before.state, Some(json!({"ordered": 1})));
        assert_eq!(record.after.state, record.before.state);
        assert_eq!(
            orders(&connection),
            ["m-1|a|1", "m-3|a|3"],
            "the drain ran the handler"
        );
        assert_eq!(
            skips(&connection),
            ["a|2|1|alice|cancelled"],
            "the handler heard of the skipped sequence, with the resolution's id"
        );
    }

    #[test]
    fn a_replacement_skips_nothing_and_a_dry_run_skip_tells_the_handler_nothing() {
        let connection = blocked_with_a_held_successor();
        let skip = ResolutionRequest {
            producer: None,
            dead_letter_id: "bad-2".into(),
            operator: "alice".into(),
            action: Action::Skip,
            expected_last: 1,
            reason: "cancelled".into(),
        };
        let writer = WriterConnection::new(&connection);
        assert!(matches!(
            resolve_in(unit(&writer, "t1"), &skip, Mode::DryRun),
            Ok(Resolved::DryRun(_))
        ));
        assert!(skips(&connection).is_empty());
        replace(&connection, "fix-2", 4, "t1").unwrap();
        assert!(skips(&connection).is_empty());
    }

    fn accept(connection: &Connection, at: &str) -> Result<Resolved, ResolutionError> {
        let request = ResolutionRequest {
            producer: None,
            dead_letter_id: "big-2".into(),
            operator: "alice".into(),
            action: Action::Accept,
            expected_last: 1,
            reason: "the cap was raised".into(),
        };
        resolve_in(
            unit(&WriterConnection::new(connection), at),
            &request,
            Mode::Commit,
        )
    }

    #[test]
    fn an_accepted_dead_letter_applies_as_delivered_and_drains_its_held_successor() {
        let connection = migrated();
        connection
            .execute(
                "INSERT INTO operators(name, token_hash, created_at) VALUES ('alice', 'h', 't')",
                [],
            )
            .unwrap();
        cap(&connection, "a", 2);
        deliver(&connection, &message("m-1", "a", 1, 1), "t0");
        deliver(&connection, &message("big-2", "a", 2, 4), "t0");
        deliver_through(&connection, &message("m-3", "a", 3, 1), Door::Broker, "t0");
        let before = snapshot(&connection);
        let refused = accept(&connection, "t1").unwrap_err();
        assert!(
            matches!(&refused, ResolutionError::ReplacementQuarantined(reason) if reason.as_str() == "over the cap"),
            "{refused:?}"
        );
        assert_eq!(snapshot(&connection), before, "a refusal writes nothing");

        connection.execute("DELETE FROM caps", []).unwrap();
        let Resolved::New(record) = accept(&connection, "t2").unwrap() else {
            panic!("expected a resolution");
        };
        assert_eq!(record.action, crate::model::ActionKind::Accept);
        assert_eq!(record.replacement, None);
        assert_eq!(record.before.state, Some(json!({"ordered": 1})));
        assert_eq!(record.after.state, Some(json!({"ordered": 5})));
        assert_eq!(orders(&connection), ["big-2|a|4", "m-1|a|1", "m-3|a|1"]);
        assert_eq!(
            rows(
                &connection,
                "SELECT message_id, sequence FROM ordered_inbox ORDER BY sequence"
            ),
            ["m-1|1", "big-2|2", "m-3|3"]
        );
        assert_eq!(
            rows(
                &connection,
                "SELECT status, resolution_id FROM deadletters WHERE message_id = 'big-2'"
            ),
            ["resolved|1"]
        );
        assert_eq!(
            views::resolution_of(&connection, None, "big-2").unwrap(),
            Some(record)
        );
        assert!(skips(&connection).is_empty(), "an accept skips nothing");
        // The same message delivered again is a replay of the applied one now.
        let again = deliver(&connection, &message("big-2", "a", 2, 4), "t3");
        assert!(matches!(again, Outcome::Replay { .. }), "{again:?}");
    }
}
