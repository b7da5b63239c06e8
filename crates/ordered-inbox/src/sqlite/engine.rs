//! The SQLite side of every write operation: read the facts, let the core decide, write the
//! decided changes, and run the application's handler at each applied message, all in the
//! caller's unit of the writer (the single writer serializes every aggregate, and the facts and
//! the writes see one snapshot).
//!
//! The handler seam: a plan that applies messages is written inside a savepoint. Before each
//! applied message is recorded, the handler's `apply` runs on the same connection. A poison
//! from `apply` rolls the plan back to the savepoint (the handler's partial writes with it) and
//! the core decides again with that message marked poison, so the quarantine is recorded exactly
//! as a poison from `check` would be; a handler error rolls it back and fails this delivery
//! alone (the rest of its unit, and of its group commit, stands). A plan that applies nothing
//! never calls the handler and needs no savepoint.

use std::convert::Infallible;

use rusqlite::Connection;
use serde_json::Value;

use super::facts::{
    DeliveryRead, delivery_facts, ownership_facts, producer_fact, resolution_facts, transfer_facts,
};
use super::handler::SqliteHandler;
use super::store::StoreError;
use super::views;
use super::writes::write;
use crate::change::{Change, Plan, applies_any};
use crate::content::{ApplyOutcome, Detail, Overruled, Poison};
use crate::delivery::{Context, Outcome, decide_delivery, decide_producer_delivery};
use crate::error::{HandlerError, InboxError};
use crate::inbox::Undelivered;
use crate::model::{Door, Limits, OrderedMessage};
use crate::producers::{TransferRequest, decide_transfer, next_epoch};
use crate::records::{ProducerClaim, ProducerRefusal, ResolutionRecord, TransferRecord};
use crate::resolution::{
    Action, Mode, Refusal, ResolutionError, ResolutionRequest, Resolved, decide_resolution,
};
use crate::views::{CurrentState, TransferConflict};

/// One unit of work's means: the writer's connection, the application's handler, the store's
/// bounds and the time that stamps every row.
#[derive(Clone, Copy)]
pub struct Unit<'a> {
    pub connection: &'a Connection,
    pub handler: &'a dyn SqliteHandler,
    pub limits: &'a Limits,
    pub now: &'a str,
}

/// Decides and records one anonymous delivery, without an ownership check. The inner `Err`:
/// the handler failed, and nothing of the delivery was recorded.
pub fn deliver_in(
    unit: Unit<'_>,
    message: &OrderedMessage,
    door: Door,
) -> Result<Result<Outcome, HandlerError>, StoreError> {
    let facts = delivery_facts(unit.connection, None, message)?.facts;
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
    unit: Unit<'_>,
    message: &OrderedMessage,
    door: Door,
    claim: Option<&ProducerClaim>,
) -> Result<Result<Outcome, Undelivered>, StoreError> {
    let connection = unit.connection;
    let producer = claim.map(|claim| claim.producer.as_str());
    let DeliveryRead { facts, owner } = delivery_facts(connection, producer, message)?;
    let ownership = ownership_facts(connection, &message.aggregate_id, claim, owner)?;
    let run = decided(unit, None, |context| {
        decide_producer_delivery(message, door, claim, &ownership, &facts, context)
    })?;
    Ok(match run {
        Run::Written(plan, report) => Ok(report.outcome(plan.outcome)),
        Run::Refused(refusal) => Err(Undelivered::Refused(refusal)),
        Run::Failed(error) => Err(Undelivered::Handler(error)),
    })
}

/// Checks the preconditions and resolves the dead letter, or (dry run) reports what that would
/// do and writes nothing. The audit row's `before` and `after` carry the handler's `state` of
/// the aggregate (a dry run's replacement is not applied, so its `after` has none).
pub fn resolve_in(
    unit: Unit<'_>,
    request: &ResolutionRequest,
    mode: Mode,
) -> Result<Resolved, ResolutionError> {
    let connection = unit.connection;
    let facts = resolution_facts(connection, request).map_err(StoreError::from)?;
    let home = facts.dead_letter.as_ref().and_then(|d| d.aggregate_id.as_deref());
    let before = match home {
        Some(aggregate_id) => unit
            .handler
            .state(connection, aggregate_id)
            .map_err(handler_failure)?,
        None => None,
    };
    let replaces = matches!(request.action, Action::Replace { .. });
    let states = States {
        before,
        after_the_first_apply: replaces.then_some(home.unwrap_or_default()),
    };
    let run = decided(unit, Some(&states), |context| {
        decide_resolution(request, &facts, mode, context)
    })?;
    match run {
        Run::Written(plan, report) => Ok(recorded(plan.resolved, &states, &report, replaces)),
        Run::Refused(refusal) => Err(refusal_error(connection, request, refusal)),
        Run::Failed(error) => Err(handler_failure(error)),
    }
}

fn handler_failure(error: HandlerError) -> ResolutionError {
    ResolutionError::Store(InboxError::Handler(error))
}

/// The resolution as written: its row's id and the handler's states.
fn recorded(resolved: Resolved, states: &States<'_>, report: &Report, replaces: bool) -> Resolved {
    let stated = |record: ResolutionRecord| {
        let record = states.on(record, report.after.as_ref(), replaces);
        ResolutionRecord {
            resolution_id: report.resolution_id.or(record.resolution_id),
            ..record
        }
    };
    match resolved {
        Resolved::New(record) => Resolved::New(stated(record)),
        Resolved::DryRun(record) => Resolved::DryRun(ResolutionRecord {
            resolution_id: None,
            ..stated(record)
        }),
        repeated @ Resolved::Repeated(_) => repeated,
    }
}

fn refusal_error(
    connection: &Connection,
    request: &ResolutionRequest,
    refusal: Refusal,
) -> ResolutionError {
    match refusal {
        Refusal::NotFound => ResolutionError::NotFound(request.dead_letter_id.clone()),
        Refusal::ReplacementQuarantined(reason) => ResolutionError::ReplacementQuarantined(reason),
        Refusal::Unauthorized => ResolutionError::Unauthorized,
        Refusal::Conflict(kind) => match current_state(
            connection,
            request.producer.as_deref(),
            &request.dead_letter_id,
        ) {
            Ok(current) => ResolutionError::Conflict {
                kind,
                current: Box::new(current),
            },
            Err(error) => ResolutionError::Store(StoreError::from(error).into()),
        },
    }
}

/// The aggregate and the dead letter as they are now, for a refusal's body.
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
    connection: &Connection,
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
enum Run<P, R> {
    /// The plan and what writing it reported.
    Written(P, Report),
    /// The core refused (a producer refusal, a resolution's precondition): nothing written.
    Refused(R),
    /// The handler failed: nothing of the plan was kept.
    Failed(HandlerError),
}

/// What writing a plan learnt from the handler.
#[derive(Default)]
struct Report {
    /// Each applied message's detail, by sequence.
    details: Vec<(i64, Detail)>,
    resolution_id: Option<i64>,
    /// The handler's state of the aggregate right after the plan's first apply.
    after: Option<Value>,
}

impl Report {
    /// The delivery's verdict with the detail its message's `apply` reported.
    fn outcome(mut self, mut outcome: Outcome) -> Outcome {
        if let Outcome::Applied {
            sequence, detail, ..
        } = &mut outcome
            && let Some(index) = self.details.iter().position(|(at, _)| at == sequence)
        {
            *detail = self.details.swap_remove(index).1;
        }
        outcome
    }
}

/// A resolution's states of its aggregate: before it, and whether `after` is read right after
/// the replacement's apply (for the aggregate named) or is `before` (a skip has no effect).
struct States<'a> {
    before: Option<Value>,
    after_the_first_apply: Option<&'a str>,
}

impl States<'_> {
    /// `record` with its `before` and `after` states.
    fn on(&self, mut record: ResolutionRecord, after: Option<&Value>, replaces: bool) -> ResolutionRecord {
        record.before.state = self.before.clone();
        record.after.state = if replaces {
            after.cloned()
        } else {
            self.before.clone()
        };
        record
    }
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
fn decided<P: Plan, R>(
    unit: Unit<'_>,
    states: Option<&States<'_>>,
    mut decide: impl FnMut(Context<'_>) -> Result<P, R>,
) -> Result<Run<P, R>, StoreError> {
    let mut poisoned: Vec<(i64, Poison)> = Vec::new();
    let rounds = unit.limits.max_held_per_aggregate.saturating_add(2);
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
        let guard = Guard::open(unit.connection, applies_any(plan.changes()))?;
        match write_plan(unit, plan.changes(), states)? {
            Ran::Done(report) => {
                guard.keep()?;
                return Ok(Run::Written(plan, report));
            }
            Ran::Poisoned(sequence, poison) => {
                guard.undo()?;
                poisoned.push((sequence, poison));
            }
            Ran::Failed(error) => {
                guard.undo()?;
                return Ok(Run::Failed(error));
            }
        }
    }
    Ok(Run::Failed(HandlerError::new(
        "apply declared more messages poison than the decision applies",
    )))
}

/// Writes `changes` in order; before each applied message is recorded, runs the handler's
/// `apply` for it, and records the message with the detail it reported.
fn write_plan(
    unit: Unit<'_>,
    changes: &[Change],
    states: Option<&States<'_>>,
) -> Result<Ran, StoreError> {
    let mut report = Report::default();
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
                let record = states.on(record.clone(), report.after.as_ref(), replaces);
                write(unit.connection, &Change::RecordResolution(record), &detail)?
            }
            _ => write(unit.connection, change, &detail)?,
        };
        if written.is_some() {
            report.resolution_id = written;
        }
        if let Some(message) = change.applied_message() {
            report.details.push((message.sequence, detail));
        }
    }
    Ok(Ran::Done(report))
}

/// Runs the handler's `apply` for `message`: its detail, or how the plan ends. After a
/// resolution's first apply (its replacement's) the handler's state of the aggregate is noted.
fn apply(
    unit: Unit<'_>,
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

/// The savepoint a plan that applies messages is written in (`open` false: none was needed).
struct Guard<'c> {
    connection: &'c Connection,
    open: bool,
}

impl<'c> Guard<'c> {
    fn open(connection: &'c Connection, needed: bool) -> rusqlite::Result<Guard<'c>> {
        if needed {
            connection.execute_batch("SAVEPOINT handler")?;
        }
        Ok(Guard {
            connection,
            open: needed,
        })
    }

    fn keep(self) -> rusqlite::Result<()> {
        if self.open {
            self.connection.execute_batch("RELEASE handler")?;
        }
        Ok(())
    }

    /// Rolls the plan's writes back. Without a savepoint the handler never ran, so there is
    /// nothing it could have refused; were it to happen, the unit fails and the writer rolls it
    /// back whole.
    fn undo(self) -> Result<(), StoreError> {
        if !self.open {
            return Err(StoreError::Unavailable(
                "a plan without a savepoint cannot be undone".to_owned(),
            ));
        }
        self.connection
            .execute_batch("ROLLBACK TO handler; RELEASE handler")?;
        Ok(())
    }
}
