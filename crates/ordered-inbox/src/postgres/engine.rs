//! The PostgreSQL side of the write operations other than deliveries (which the group commit
//! of `batch` writes): lock, read the facts, let the core decide, run the application's handler
//! at each applied message, write the decided changes, all in one transaction (see the `facts`
//! module for the locks). `decided` is shared with the group commit's replay, where each
//! delivery is written alone.
//!
//! Round trips: the statements of one phase are pipelined on the connection: BEGIN, the locks
//! and the fact reads go out in one flight; the writes and COMMIT in the next. A plan that
//! applies a message adds the handler's own round trips: the writes decided before its first
//! applied message go out with a `SAVEPOINT` in the same flight as the handler's first
//! statement. A poison from `apply` rolls back to that savepoint and the core decides again with
//! the message marked poison; a handler error fails the operation (its transaction is rolled
//! back, and it is not retried here).

use futures_util::future::OptionFuture;
use futures_util::join;
use tokio_postgres::types::ToSql;

use super::connection::{Client, Counters, Failure};
use super::facts::{PRODUCER_ROW_LOCKED, resolution_facts, transfer_facts};
use super::handler::{HandlerClient, PostgresHandler};
use super::rows::producer_fact_from_row;
use super::views;
use super::writes::{Write, commit, flush, record_rejected as rejected_write, writes_for};
use crate::change::{Change, Plan};
use crate::content::{ApplyOutcome, Detail, Poison};
use crate::delivery::Context;
use crate::error::HandlerError;
use crate::handling::{Overruled, Report, States, recorded, rounds};
use crate::model::{Limits, OrderedMessage};
use crate::producers::{TransferRequest, decide_transfer, next_epoch};
use crate::records::{ProducerRefusal, RejectedDelivery, TransferRecord};
use crate::resolution::{
    Action, Mode, Refusal, ResolutionError, ResolutionRequest, Resolved, decide_resolution,
};
use crate::views::{CurrentState, TransferConflict};

const SET_EPOCH: &str = "UPDATE producers SET current_epoch = $2 WHERE name = $1";

/// One operation's means: the pooled connection, the backend's counters, the application's
/// handler, the store's bounds and the time that stamps every row.
#[derive(Clone, Copy)]
pub(crate) struct Unit<'a> {
    pub client: &'a Client,
    pub counters: &'a Counters,
    pub handler: &'a dyn PostgresHandler,
    pub limits: &'a Limits,
    pub now: &'a str,
}

/// Checks the preconditions and resolves the dead letter, or (dry run) reports what that would
/// do and writes nothing. The outer `Result` is the store's, the inner the resolution's. The
/// audit row's `before` and `after` carry the handler's `state` of the aggregate.
pub(crate) async fn resolve(
    unit: Unit<'_>,
    request: &ResolutionRequest,
    mode: Mode,
) -> Result<Result<Resolved, ResolutionError>, Failure> {
    let facts = resolution_facts(unit.client, unit.counters, request).await?;
    let home = facts
        .dead_letter
        .as_ref()
        .and_then(|d| d.aggregate_id.as_deref());
    let before = match home {
        Some(aggregate_id) => unit
            .handler
            .state(unit.client, aggregate_id)
            .await
            .map_err(Failure::Handler)?,
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
    })
    .await?;
    match run {
        Run::Written(plan, report, writes) => {
            commit(unit.client, unit.counters, writes).await?;
            Ok(Ok(recorded(plan.resolved, &states, &report, replaces)))
        }
        Run::Refused(refusal) => {
            let refused = refusal_error(unit, request, refusal).await?;
            rollback(unit).await?;
            Ok(Err(refused))
        }
        Run::Failed(error) => Err(Failure::Handler(error)),
    }
}

pub(super) async fn rollback(unit: Unit<'_>) -> Result<(), Failure> {
    unit.client.batch_execute("ROLLBACK").await?;
    unit.counters.trip();
    Ok(())
}

async fn refusal_error(
    unit: Unit<'_>,
    request: &ResolutionRequest,
    refusal: Refusal,
) -> Result<ResolutionError, Failure> {
    Ok(match refusal {
        Refusal::NotFound => ResolutionError::NotFound(request.dead_letter_id.clone()),
        Refusal::ReplacementQuarantined(reason) => ResolutionError::ReplacementQuarantined(reason),
        Refusal::Unauthorized => ResolutionError::Unauthorized,
        Refusal::Conflict(kind) => ResolutionError::Conflict {
            kind,
            current: Box::new(
                current_state(unit, request.producer.as_deref(), &request.dead_letter_id).await?,
            ),
        },
    })
}

/// The aggregate and the dead letter as they are now (inside the locking transaction), for a
/// refusal's body.
async fn current_state(
    unit: Unit<'_>,
    producer: Option<&str>,
    dead_letter_id: &str,
) -> Result<CurrentState, Failure> {
    let (client, counters) = (unit.client, unit.counters);
    let dead_letter = views::dead_letter(client, counters, producer, dead_letter_id).await?;
    let aggregate = match dead_letter
        .as_ref()
        .and_then(|dead| dead.aggregate_id.as_deref())
    {
        Some(aggregate_id) => views::aggregate_summary(client, counters, aggregate_id).await?,
        None => None,
    };
    let mut current = CurrentState {
        aggregate,
        dead_letter,
    };
    views::add_states(client, unit.handler, &mut current).await?;
    Ok(current)
}

/// Starts a session of `producer`: its row locked, the next epoch decided, written, committed.
pub(crate) async fn start_session(
    client: &Client,
    counters: &Counters,
    producer: &str,
) -> Result<Result<i64, ProducerRefusal>, Failure> {
    let read = client.prepare_cached(PRODUCER_ROW_LOCKED).await?;
    let by_name: [&(dyn ToSql + Sync); 1] = [&producer];
    let (begin, row) = join!(
        client.batch_execute("BEGIN"),
        client.query_opt(&read, &by_name)
    );
    counters.trip();
    begin?;
    let decided = match row?.map(|row| producer_fact_from_row(&row)).transpose()? {
        Some(fact) => next_epoch(fact),
        None => Err(ProducerRefusal::Revoked),
    };
    let epoch = match decided {
        Ok(epoch) => epoch,
        Err(refusal) => {
            client.batch_execute("ROLLBACK").await?;
            counters.trip();
            return Ok(Err(refusal));
        }
    };
    let set = client.prepare_cached(SET_EPOCH).await?;
    let by_name_epoch: [&(dyn ToSql + Sync); 2] = [&producer, &epoch];
    let (written, committed) = join!(
        client.execute(&set, &by_name_epoch),
        client.batch_execute("COMMIT"),
    );
    counters.trip();
    written.map_err(Failure::Commit)?;
    committed.map_err(Failure::Commit)?;
    Ok(Ok(epoch))
}

/// An operator's transfer: the aggregate locked as for a delivery, the receiving producer's row
/// shared-locked, the preconditions decided by the core, the owner columns, the audit row, the
/// timeline event and the rejection of the held messages it made inadmissible written and
/// committed; a refusal rolls back with the ownership as it is. A transfer applies no message,
/// so the handler has no part in it.
pub(crate) async fn transfer(
    client: &Client,
    counters: &Counters,
    request: &TransferRequest,
) -> Result<Result<TransferRecord, TransferConflict>, Failure> {
    let (facts, current) = transfer_facts(client, counters, request).await?;
    let now = crate::clock::now();
    let plan = match decide_transfer(request, &facts, &now) {
        Ok(plan) => plan,
        Err(refusal) => {
            client.batch_execute("ROLLBACK").await?;
            counters.trip();
            return Ok(Err(TransferConflict { refusal, current }));
        }
    };
    let mut writes = Vec::with_capacity(plan.changes.len());
    for change in &plan.changes {
        writes_for(client, counters, change, &Detail::new(), &mut writes).await?;
    }
    commit(client, counters, writes).await?;
    Ok(Ok(plan.record))
}

/// Appends entries to the rejected list in one transaction.
pub(crate) async fn record_rejected(
    client: &Client,
    counters: &Counters,
    entries: &[RejectedDelivery],
) -> Result<(), Failure> {
    client.batch_execute("BEGIN").await?;
    counters.trip();
    let mut writes = Vec::with_capacity(entries.len());
    for entry in entries {
        writes.push(rejected_write(client, entry).await?);
    }
    commit(client, counters, writes).await
}

/// How a decision's run ended.
pub(super) enum Run<P, R> {
    /// The plan, what writing it reported, and the writes still to send with COMMIT.
    Written(P, Report, Vec<Write>),
    /// The core refused (a producer refusal, a resolution's precondition): nothing written.
    Refused(R),
    /// The handler failed: the caller rolls the transaction back.
    Failed(HandlerError),
}

/// How writing one plan ended.
enum Ran {
    Done(Report, Vec<Write>),
    /// `apply` declared the message at this sequence poison.
    Poisoned(i64, Poison),
    Failed(HandlerError),
}

/// Decides with `decide` and writes the plan, running the handler at each applied message;
/// after a poison from `apply`, rolls back to the savepoint and decides again with that message
/// poison.
pub(super) async fn decided<P: Plan, R>(
    unit: Unit<'_>,
    states: Option<&States<'_>>,
    decide: impl Fn(Context<'_>) -> Result<P, R>,
) -> Result<Run<P, R>, Failure> {
    let mut poisoned: Vec<(i64, Poison)> = Vec::new();
    while poisoned.len() < rounds(unit.limits.max_held_per_aggregate) {
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
        match write_plan(unit, plan.changes(), states).await? {
            Ran::Done(report, writes) => return Ok(Run::Written(plan, report, writes)),
            Ran::Poisoned(sequence, poison) => {
                unit.client
                    .batch_execute("ROLLBACK TO SAVEPOINT handler")
                    .await?;
                unit.counters.trip();
                poisoned.push((sequence, poison));
            }
            Ran::Failed(error) => return Ok(Run::Failed(error)),
        }
    }
    Ok(Run::Failed(HandlerError::new(
        "apply declared more messages poison than the decision applies",
    )))
}

/// Collects the statements of `changes` in order; at each applied message, sends the ones
/// collected so far (after a `SAVEPOINT`) in the flight of the handler's `apply`, and records
/// the message with the detail it reported. The rest stay pending for COMMIT. The sequences a
/// resolution skipped go to the handler's `skipped` last, after every apply, so that no poison
/// rolls back to a savepoint taken after them.
async fn write_plan(
    unit: Unit<'_>,
    changes: &[Change],
    states: Option<&States<'_>>,
) -> Result<Ran, Failure> {
    let (client, counters) = (unit.client, unit.counters);
    let mut writes = Vec::with_capacity(changes.len() + 2);
    let mut report = Report::default();
    let mut skipped = Vec::new();
    for change in changes {
        let detail = match change.applied_message() {
            Some(message) => match apply(unit, message, states, &mut report, &mut writes).await? {
                Ok(detail) => detail,
                Err(ended) => return Ok(ended),
            },
            None => Detail::new(),
        };
        let numbered = match (change, states) {
            (Change::RecordResolution(record), Some(states)) => {
                let replaces = states.after_the_first_apply.is_some();
                let record = states.on(record.as_ref().clone(), report.after.as_ref(), replaces);
                let change = Change::RecordResolution(Box::new(record));
                writes_for(client, counters, &change, &detail, &mut writes).await?
            }
            _ => writes_for(client, counters, change, &detail, &mut writes).await?,
        };
        if let Some(resolution_id) = numbered {
            report.resolution_id = numbered;
            skipped.extend(change.skipped(resolution_id));
        }
        if let Some(message) = change.applied_message() {
            report.details.push((message.sequence, detail));
        }
    }
    for sequences in &skipped {
        if let Err(error) = unit.handler.skipped(client, sequences).await {
            return Ok(Ran::Failed(error));
        }
    }
    Ok(Ran::Done(report, writes))
}

/// Runs the handler's `apply` for `message`, in one flight with the writes pending before it
/// (sent first, so that the handler sees them) and, before the plan's first apply, the
/// `SAVEPOINT` a poison rolls the plan back to: its detail, or how the plan ends. After a
/// resolution's first apply (its replacement's) the handler's state of the aggregate is noted.
async fn apply(
    unit: Unit<'_>,
    message: &OrderedMessage,
    states: Option<&States<'_>>,
    report: &mut Report,
    writes: &mut Vec<Write>,
) -> Result<Result<Detail, Ran>, Failure> {
    let client: &HandlerClient = unit.client;
    let first = report.details.is_empty();
    let savepoint = OptionFuture::from(first.then(|| client.batch_execute("SAVEPOINT handler")));
    let (savepoint, flushed, applied) = join!(
        savepoint,
        flush(unit.client, unit.counters, writes),
        unit.handler.apply(client, message),
    );
    unit.counters.trip();
    savepoint.transpose()?;
    flushed?;
    let detail = match applied {
        Ok(ApplyOutcome::Applied { detail }) => detail,
        Ok(ApplyOutcome::Poison(poison)) => {
            return Ok(Err(Ran::Poisoned(message.sequence, poison)));
        }
        Err(error) => return Ok(Err(Ran::Failed(error))),
    };
    if let Some(aggregate_id) = states.and_then(|states| states.after_the_first_apply)
        && first
    {
        match unit.handler.state(client, aggregate_id).await {
            Ok(state) => report.after = state,
            Err(error) => return Ok(Err(Ran::Failed(error))),
        }
    }
    Ok(Ok(detail))
}
