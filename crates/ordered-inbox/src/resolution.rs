//! Operator-approved poison resolution, decided purely. The quarantine never advances an
//! aggregate; this is the one deliberate way past a poison message other than a corrected message
//! under a new id:
//!
//! - `replace` applies a new, valid message at the dead letter's sequence through the same
//!   delivery decision as any message;
//! - `skip` takes the sequence with an explicit skip event: zero effect, last advances by one;
//! - `accept` applies the dead letter's own message, as it was delivered (its stored content),
//!   through the same delivery decision: for a message that was poison only by the rule of its
//!   day (a schema since corrected), it passes the check now and takes its own sequence.
//!
//! Every way, held messages that become next drain after it in the same plan (see
//! [`crate::delivery`]); the audit row's `after` is the resolution's own step, the drained
//! messages are on the timeline after it.
//!
//! The preconditions (the dead letter is open, holds `last + 1`, `expectedLast` is the current
//! last, the operator is still active) are checked against facts read in the same transaction the
//! changes are written in, so of two operators racing with the same `expectedLast` exactly one
//! wins. A dry run is the same decision with its changes left unwritten.

use serde_json::Value;

use crate::change::Change;
use crate::delivery::{Context, DrainStart, Outcome, decide_delivery_as, drain, supersede_at};
use crate::error::InboxError;
use crate::facts::{DeadLetterFact, DeliveryFacts, OpenDeadLetter, ResolutionFacts};
use crate::model::{
    ActionKind, AggregateRow, AggregateStatus, DeadLetterStatus, Door, OrderedMessage, Position,
    QuarantineReason,
};
use crate::records::{Replacement, ResolutionRecord};
use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};
use crate::views::CurrentState;

/// What the operator decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Apply a new message, under a new id, at the dead letter's sequence.
    Replace {
        /// The new message id.
        message_id: String,
        /// The new payload.
        payload: Value,
    },
    /// Go on without the dead letter's sequence.
    Skip,
    /// Apply the dead letter's own message, as it was delivered, at its sequence: it must pass
    /// the check now.
    Accept,
}

impl Action {
    /// The kind, as the audit row stores it.
    pub fn kind(&self) -> ActionKind {
        match self {
            Action::Replace { .. } => ActionKind::Replace,
            Action::Skip => ActionKind::Skip,
            Action::Accept => ActionKind::Accept,
        }
    }

    fn replacement(&self) -> Option<Replacement> {
        match self {
            Action::Replace {
                message_id,
                payload,
            } => Some(Replacement {
                message_id: message_id.clone(),
                payload: payload.clone(),
            }),
            Action::Skip | Action::Accept => None,
        }
    }
}

/// One resolution request, from an authenticated operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolutionRequest {
    /// The namespace of the dead letter's message id: the producer that delivered it (`None`:
    /// an anonymous delivery). A replacement is applied in the same namespace.
    pub producer: Option<String>,
    /// The dead letter's message id.
    pub dead_letter_id: String,
    /// The operator who resolves, as named in the registry.
    pub operator: String,
    /// Replace or skip.
    pub action: Action,
    /// The last applied sequence the operator saw; the resolution is refused if it moved.
    pub expected_last: i64,
    /// Why, for the audit row.
    pub reason: String,
}

/// Whether to write the resolution or only report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Write the resolution.
    Commit,
    /// Decide it and answer what it would do; write nothing.
    DryRun,
}

/// What a resolution did, or would do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    /// Resolved now.
    New(ResolutionRecord),
    /// The same operator sent the same resolution before: its original record, nothing changed.
    Repeated(ResolutionRecord),
    /// What the resolution would do; nothing was written.
    DryRun(ResolutionRecord),
}

/// Why a precondition failed. The server words each one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConflictKind {
    /// A different resolution was recorded for the dead letter.
    AlreadyResolved,
    /// Another message already took the dead letter's sequence.
    NotOpen(DeadLetterStatus),
    /// An early dead letter with no stored sequence or payload (or, to accept it, a stored
    /// payload that is not JSON).
    SequenceUnknown,
    /// The aggregate's last applied sequence is not the one the operator saw.
    ExpectedLastMismatch {
        /// The last applied sequence the operator saw.
        expected_last: i64,
        /// The aggregate's last applied sequence now.
        last: i64,
    },
    /// The dead letter's sequence is not the aggregate's next one.
    NotNextSequence {
        /// The dead letter's sequence.
        sequence: i64,
        /// The aggregate's next sequence.
        needed: i64,
    },
    /// The replacement's message id is already known.
    ReplacementIdUsed {
        /// That id.
        message_id: String,
    },
}

/// A refused resolution, decided from the facts alone. Nothing is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No dead letter has the id.
    NotFound,
    /// A precondition failed.
    Conflict(ConflictKind),
    /// The replacement itself is poison (its check, or its handler's `apply`); for `accept`,
    /// the dead letter's own message still is.
    ReplacementQuarantined(QuarantineReason),
    /// The operator was revoked after authenticating.
    Unauthorized,
}

/// Why a resolution was refused: [`Refusal`] with the current state a conflict shows, or a
/// store failure.
#[derive(Debug, thiserror::Error)]
pub enum ResolutionError {
    #[error("no dead letter has message id '{0}'")]
    /// No dead letter has the id.
    NotFound(String),
    #[error("a resolution precondition failed: {kind:?}")]
    /// A precondition failed; nothing was written.
    Conflict {
        /// Which one.
        kind: ConflictKind,
        /// The dead letter and its aggregate as they are now.
        current: Box<CurrentState>,
    },
    #[error("the replacement would be quarantined: {0}")]
    /// The replacement itself is poison; nothing was written.
    ReplacementQuarantined(QuarantineReason),
    #[error("the operator's token is no longer valid")]
    /// The operator is unknown or revoked.
    Unauthorized,
    #[error(transparent)]
    /// The store failed.
    Store(#[from] InboxError),
}

/// The decided resolution and its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolutionPlan {
    /// The answer.
    pub resolved: Resolved,
    /// The changes that record it, in order.
    pub changes: Vec<Change>,
}

impl crate::change::Plan for ResolutionPlan {
    fn changes(&self) -> &[Change] {
        &self.changes
    }
}

/// Decides a resolution. With [`Mode::DryRun`] the plan carries no changes and the record no id.
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) fn decide_resolution(
    request: &ResolutionRequest,
    facts: &ResolutionFacts,
    mode: Mode,
    context: Context<'_>,
) -> Result<ResolutionPlan, Refusal> {
    let now = context.now;
    let Some(dead_letter) = facts.dead_letter.as_ref() else {
        // A resolved dead letter pruned by a retention leaves its resolution: the same request
        // still repeats it, and any other is refused as on the dead letter itself.
        return match facts.recorded {
            Some(_) => repeat_of_recorded(request, facts),
            None => Err(Refusal::NotFound),
        };
    };
    match dead_letter.status {
        DeadLetterStatus::Open => {}
        DeadLetterStatus::Resolved => return repeat_of_recorded(request, facts),
        status => return Err(Refusal::Conflict(ConflictKind::NotOpen(status))),
    }
    let (Some(aggregate_id), Some(sequence)) = (&dead_letter.aggregate_id, dead_letter.sequence)
    else {
        return Err(Refusal::Conflict(ConflictKind::SequenceUnknown));
    };
    let target = check_target(request, facts, aggregate_id, sequence)?;
    if !facts.operator_active {
        return Err(Refusal::Unauthorized);
    }
    let mut changes = vec![Change::ResolveDeadLetter {
        producer: request.producer.clone(),
        message_id: request.dead_letter_id.clone(),
        at: now.to_owned(),
    }];
    let after = match &request.action {
        Action::Replace {
            message_id,
            payload,
        } => replace(&target, facts, message_id, payload, context, &mut changes)?,
        Action::Skip => skip(&target, &request.operator, facts, context, &mut changes),
        Action::Accept => {
            let message = delivered(dead_letter, aggregate_id, sequence, &target)?;
            let facts = facts_without_itself(&target, facts);
            apply_at(&target, &message, &facts, context, &mut changes)?
        }
    };
    let record = ResolutionRecord {
        resolution_id: None,
        producer: request.producer.clone(),
        message_id: request.dead_letter_id.clone(),
        aggregate_id: aggregate_id.clone(),
        sequence,
        action: request.action.kind(),
        operator: request.operator.clone(),
        reason: request.reason.clone(),
        expected_last: request.expected_last,
        replacement: request.action.replacement(),
        before: Position {
            last: target.before,
            state: None,
        },
        after: Position {
            last: after,
            state: None,
        },
        resolved_at: now.to_owned(),
    };
    Ok(match mode {
        Mode::DryRun => ResolutionPlan {
            resolved: Resolved::DryRun(record),
            changes: Vec::new(),
        },
        Mode::Commit => {
            changes.push(Change::RecordResolution(Box::new(record.clone())));
            ResolutionPlan {
                resolved: Resolved::New(record),
                changes,
            }
        }
    })
}

/// The `resolved` timeline event of a recorded resolution (its id assigned by the store).
pub fn resolved_event(record: &ResolutionRecord, resolution_id: i64) -> TimelineEntry {
    TimelineEntry {
        aggregate_id: record.aggregate_id.clone(),
        at: record.resolved_at.clone(),
        kind: TimelineKind::Resolved,
        sequence: Some(record.sequence),
        message_id: Some(record.message_id.clone()),
        detail: TimelineDetail::Resolved {
            resolution_id,
            action: record.action,
            operator: record.operator.clone(),
            reason: record.reason.clone(),
            replacement_message_id: record
                .replacement
                .as_ref()
                .map(|replacement| replacement.message_id.clone()),
        },
    }
}

/// An already resolved dead letter: an identical repeat by the same operator answers with the
/// original record; anything else is a conflict.
fn repeat_of_recorded(
    request: &ResolutionRequest,
    facts: &ResolutionFacts,
) -> Result<ResolutionPlan, Refusal> {
    match &facts.recorded {
        Some(original) if same_request(original, request) => Ok(ResolutionPlan {
            resolved: Resolved::Repeated(original.clone()),
            changes: Vec::new(),
        }),
        _ => Err(Refusal::Conflict(ConflictKind::AlreadyResolved)),
    }
}

fn same_request(original: &ResolutionRecord, request: &ResolutionRequest) -> bool {
    original.operator == request.operator
        && original.action == request.action.kind()
        && original.expected_last == request.expected_last
        && original.reason == request.reason
        && original.replacement == request.action.replacement()
}

/// The dead letter's aggregate and sequence, checked to be next.
struct Target<'a> {
    producer: Option<&'a str>,
    dead_letter_id: &'a str,
    aggregate_id: &'a str,
    sequence: i64,
    /// The aggregate's last applied sequence.
    before: i64,
}

fn check_target<'a>(
    request: &'a ResolutionRequest,
    facts: &ResolutionFacts,
    aggregate_id: &'a str,
    sequence: i64,
) -> Result<Target<'a>, Refusal> {
    let before = facts.aggregate.as_ref().map_or(0, |row| row.last);
    if request.expected_last != before {
        return Err(Refusal::Conflict(ConflictKind::ExpectedLastMismatch {
            expected_last: request.expected_last,
            last: before,
        }));
    }
    let needed = before.saturating_add(1);
    if sequence != needed {
        return Err(Refusal::Conflict(ConflictKind::NotNextSequence {
            sequence,
            needed,
        }));
    }
    Ok(Target {
        producer: request.producer.as_deref(),
        dead_letter_id: &request.dead_letter_id,
        aggregate_id,
        sequence,
        before,
    })
}

/// The other open dead letters: the one being resolved is closed first, so that the replacement
/// or the skip does not supersede it.
/// Identity is (producer, message id): an open dead letter with the same id in another
/// namespace is another one.
fn others_open(facts: &ResolutionFacts, target: &Target<'_>) -> Vec<OpenDeadLetter> {
    facts
        .open_dead_letters
        .iter()
        .filter(|letter| {
            letter.message_id != target.dead_letter_id
                || letter.producer.as_deref() != target.producer
        })
        .cloned()
        .collect()
}

/// Applies the replacement through the ordinary delivery decision. Returns the last sequence
/// after it.
fn replace(
    target: &Target<'_>,
    facts: &ResolutionFacts,
    message_id: &str,
    payload: &Value,
    context: Context<'_>,
    changes: &mut Vec<Change>,
) -> Result<i64, Refusal> {
    let replacement = OrderedMessage {
        message_id: message_id.to_owned(),
        aggregate_id: target.aggregate_id.to_owned(),
        sequence: target.sequence,
        payload: payload.clone(),
    };
    let delivery_facts = DeliveryFacts {
        applied: facts.replacement_applied.clone(),
        dead_letter: facts.replacement_dead_letter.clone(),
        aggregate: facts.aggregate.clone(),
        open_dead_letters: others_open(facts, target),
        held_message: facts.replacement_held.clone(),
        held: facts.held.clone(),
        owner: facts.owner.clone(),
        skipped_by: None,
    };
    apply_at(target, &replacement, &delivery_facts, context, changes)
}

/// The dead letter's own message as it was delivered: its stored content at its position. A
/// dead letter without a stored payload (or one that is not JSON) cannot show what it was.
fn delivered(
    dead_letter: &DeadLetterFact,
    aggregate_id: &str,
    sequence: i64,
    target: &Target<'_>,
) -> Result<OrderedMessage, Refusal> {
    let payload = dead_letter
        .payload
        .as_deref()
        .and_then(|text| serde_json::from_str(text).ok())
        .ok_or(Refusal::Conflict(ConflictKind::SequenceUnknown))?;
    Ok(OrderedMessage {
        message_id: target.dead_letter_id.to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        sequence,
        payload,
    })
}

/// What an accepted dead letter's delivery decision knows: its id is neither applied nor held
/// (an id never has two meanings), and its own dead letter is closed by this resolution, so the
/// decision sees the aggregate as a first delivery of the message at its sequence would.
fn facts_without_itself(target: &Target<'_>, facts: &ResolutionFacts) -> DeliveryFacts {
    DeliveryFacts {
        applied: None,
        dead_letter: None,
        aggregate: facts.aggregate.clone(),
        open_dead_letters: others_open(facts, target),
        held_message: None,
        held: facts.held.clone(),
        owner: facts.owner.clone(),
        skipped_by: None,
    }
}

/// Applies `message` at the target's sequence through the ordinary delivery decision (which
/// drains the held successors it makes next). Returns the last sequence after it.
fn apply_at(
    target: &Target<'_>,
    message: &OrderedMessage,
    delivery_facts: &DeliveryFacts,
    context: Context<'_>,
    changes: &mut Vec<Change>,
) -> Result<i64, Refusal> {
    let plan = decide_delivery_as(
        target.producer,
        message,
        Door::General,
        delivery_facts,
        context,
    );
    match plan.outcome {
        Outcome::Applied { sequence, .. } => {
            changes.extend(plan.changes);
            Ok(sequence)
        }
        Outcome::Quarantined { reason, .. } | Outcome::QuarantineFull { reason, .. } => {
            Err(Refusal::ReplacementQuarantined(reason))
        }
        Outcome::Replay { .. } | Outcome::PayloadConflict => {
            Err(Refusal::Conflict(ConflictKind::ReplacementIdUsed {
                message_id: message.message_id.clone(),
            }))
        }
        // The target was checked to be the next sequence, so the policy cannot see a gap or a
        // stale sequence here (nor hold, through the general door); answer as the precondition
        // would.
        Outcome::Gap { expected }
        | Outcome::Stale { expected, .. }
        | Outcome::Held { expected, .. }
        | Outcome::HoldFull { expected, .. } => {
            Err(Refusal::Conflict(ConflictKind::NotNextSequence {
                sequence: target.sequence,
                needed: expected,
            }))
        }
    }
}

/// Takes the sequence with no effect, superseding any other open dead letter there, and drains
/// the held messages that become next. Returns the last sequence after it.
fn skip(
    target: &Target<'_>,
    operator: &str,
    facts: &ResolutionFacts,
    context: Context<'_>,
    changes: &mut Vec<Change>,
) -> i64 {
    let now = context.now;
    changes.push(Change::Append(TimelineEntry {
        aggregate_id: target.aggregate_id.to_owned(),
        at: now.to_owned(),
        kind: TimelineKind::Skipped,
        sequence: Some(target.sequence),
        message_id: Some(target.dead_letter_id.to_owned()),
        detail: TimelineDetail::Skipped {
            effect: 0,
            operator: operator.to_owned(),
        },
    }));
    let mut open = others_open(facts, target);
    let superseded = supersede_at(
        target.aggregate_id,
        target.sequence,
        &open,
        target.dead_letter_id,
        now,
        changes,
    );
    open.retain(|letter| !superseded.contains(&letter.message_id));
    let start = DrainStart {
        aggregate_id: target.aggregate_id,
        row: AggregateRow {
            last: target.sequence,
            status: AggregateStatus::Flowing,
            since: Some(now.to_owned()),
        },
        after: target.dead_letter_id,
        held: &facts.held,
        open: &open,
        owner: facts.owner.as_ref(),
    };
    let row = drain(start, context, changes);
    changes.push(Change::PutAggregate {
        aggregate_id: target.aggregate_id.to_owned(),
        row,
    });
    target.sequence
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::canonical_json;
    use crate::facts::{AppliedFact, DeadLetterFact, HeldMessage};
    use crate::model::Limits;
    use crate::policy::tests::NoNegativeQuantity;
    use crate::records::AggregateOwner;
    use serde_json::json;

    fn position(last: i64) -> Position {
        Position { last, state: None }
    }

    fn context(limits: &Limits) -> Context<'_> {
        Context {
            limits,
            check: &NoNegativeQuantity,
            now: "t1",
        }
    }

    fn request(action: Action, expected_last: i64) -> ResolutionRequest {
        ResolutionRequest {
            producer: None,
            dead_letter_id: "poison-2".into(),
            operator: "alice".into(),
            action,
            expected_last,
            reason: "duplicate order".into(),
        }
    }

    /// `a` at last 1, blocked by `poison-2` at sequence 2 (and `other-2` beside it).
    fn blocked() -> ResolutionFacts {
        ResolutionFacts {
            dead_letter: Some(DeadLetterFact {
                status: DeadLetterStatus::Open,
                aggregate_id: Some("a".into()),
                sequence: Some(2),
                payload: Some(r#"{"quantity":2}"#.into()),
            }),
            recorded: None,
            aggregate: Some(AggregateRow {
                last: 1,
                status: AggregateStatus::Blocked,
                since: Some("t0".into()),
            }),
            open_dead_letters: ["poison-2", "other-2"]
                .into_iter()
                .map(|id| OpenDeadLetter {
                    producer: None,
                    message_id: id.into(),
                    sequence: Some(2),
                })
                .collect(),
            operator_active: true,
            replacement_applied: None,
            replacement_dead_letter: None,
            replacement_held: None,
            held: Vec::new(),
            owner: None,
        }
    }

    fn decide(
        request: &ResolutionRequest,
        facts: &ResolutionFacts,
        mode: Mode,
    ) -> Result<ResolutionPlan, Refusal> {
        decide_resolution(request, facts, mode, context(&Limits::default()))
    }

    fn superseded(plan: &ResolutionPlan) -> Vec<String> {
        plan.changes
            .iter()
            .find_map(|change| match change {
                Change::SupersedeDeadLetters { message_ids, .. } => Some(message_ids.clone()),
                _ => None,
            })
            .unwrap_or_default()
    }

    #[test]
    fn a_skip_advances_by_one_with_no_effect_and_supersedes_the_others() {
        let plan = decide(&request(Action::Skip, 1), &blocked(), Mode::Commit).unwrap();
        let Resolved::New(record) = &plan.resolved else {
            panic!("expected a new resolution");
        };
        assert_eq!(record.before, position(1));
        assert_eq!(record.after, position(2));
        assert_eq!(superseded(&plan), ["other-2"]);
        assert!(matches!(
            plan.changes.first(),
            Some(Change::ResolveDeadLetter { .. })
        ));
        assert!(matches!(
            plan.changes.last(),
            Some(Change::RecordResolution(_))
        ));
    }

    #[test]
    fn a_replacement_goes_through_the_delivery_decision() {
        let replace = Action::Replace {
            message_id: "fixed-2".into(),
            payload: json!({"quantity": 3}),
        };
        let plan = decide(&request(replace, 1), &blocked(), Mode::Commit).unwrap();
        let Resolved::New(record) = &plan.resolved else {
            panic!("expected a new resolution");
        };
        assert_eq!(record.after, position(2));
        assert!(
            plan.changes
                .iter()
                .any(|change| matches!(change, Change::InsertApplied { .. }))
        );
        assert_eq!(superseded(&plan), ["other-2"]);

        let poison = Action::Replace {
            message_id: "fixed-2".into(),
            payload: json!({"quantity": -3}),
        };
        assert_eq!(
            decide(&request(poison, 1), &blocked(), Mode::Commit),
            Err(Refusal::ReplacementQuarantined(QuarantineReason::new(
                "negative quantity"
            )))
        );
        let used = ResolutionFacts {
            replacement_applied: Some(AppliedFact {
                payload: "{}".into(),
                aggregate_id: None,
                sequence: Some(1),
                applied_at: None,
            }),
            ..blocked()
        };
        let again = Action::Replace {
            message_id: "m-1".into(),
            payload: json!({"quantity": 3}),
        };
        assert_eq!(
            decide(&request(again, 1), &used, Mode::Commit),
            Err(Refusal::Conflict(ConflictKind::ReplacementIdUsed {
                message_id: "m-1".into()
            }))
        );
    }

    #[test]
    fn a_dry_run_decides_the_same_and_writes_nothing() {
        let real = decide(&request(Action::Skip, 1), &blocked(), Mode::Commit).unwrap();
        let rehearsal = decide(&request(Action::Skip, 1), &blocked(), Mode::DryRun).unwrap();
        assert!(rehearsal.changes.is_empty());
        let (Resolved::New(real), Resolved::DryRun(rehearsal)) =
            (real.resolved, rehearsal.resolved)
        else {
            panic!("expected a resolution and a dry run");
        };
        assert_eq!(real, rehearsal);
    }

    #[test]
    fn each_precondition_refuses_with_its_own_kind() {
        assert_eq!(
            decide(&request(Action::Skip, 0), &blocked(), Mode::Commit),
            Err(Refusal::Conflict(ConflictKind::ExpectedLastMismatch {
                expected_last: 0,
                last: 1
            }))
        );
        let missing = ResolutionFacts {
            dead_letter: None,
            ..blocked()
        };
        assert_eq!(
            decide(&request(Action::Skip, 1), &missing, Mode::Commit),
            Err(Refusal::NotFound)
        );
        let mut superseded = blocked();
        if let Some(letter) = superseded.dead_letter.as_mut() {
            letter.status = DeadLetterStatus::Superseded;
        }
        assert_eq!(
            decide(&request(Action::Skip, 1), &superseded, Mode::Commit),
            Err(Refusal::Conflict(ConflictKind::NotOpen(
                DeadLetterStatus::Superseded
            )))
        );
        let mut legacy = blocked();
        if let Some(letter) = legacy.dead_letter.as_mut() {
            letter.sequence = None;
        }
        assert_eq!(
            decide(&request(Action::Skip, 1), &legacy, Mode::Commit),
            Err(Refusal::Conflict(ConflictKind::SequenceUnknown))
        );
        let mut behind = blocked();
        if let Some(letter) = behind.dead_letter.as_mut() {
            letter.sequence = Some(4);
        }
        assert_eq!(
            decide(&request(Action::Skip, 1), &behind, Mode::Commit),
            Err(Refusal::Conflict(ConflictKind::NotNextSequence {
                sequence: 4,
                needed: 2
            }))
        );
        let revoked = ResolutionFacts {
            operator_active: false,
            ..blocked()
        };
        assert_eq!(
            decide(&request(Action::Skip, 1), &revoked, Mode::Commit),
            Err(Refusal::Unauthorized)
        );
    }

    #[test]
    fn only_an_identical_repeat_of_a_recorded_resolution_answers_again() {
        let first = decide(&request(Action::Skip, 1), &blocked(), Mode::Commit).unwrap();
        let Resolved::New(record) = first.resolved else {
            panic!("expected a resolution");
        };
        let mut resolved = blocked();
        if let Some(letter) = resolved.dead_letter.as_mut() {
            letter.status = DeadLetterStatus::Resolved;
        }
        resolved.recorded = Some(ResolutionRecord {
            resolution_id: Some(7),
            ..record
        });
        let repeat = decide(&request(Action::Skip, 1), &resolved, Mode::Commit).unwrap();
        assert!(repeat.changes.is_empty());
        assert!(matches!(
            repeat.resolved,
            Resolved::Repeated(ResolutionRecord {
                resolution_id: Some(7),
                ..
            })
        ));
        let different = ResolutionRequest {
            reason: "another reason".into(),
            ..request(Action::Skip, 1)
        };
        assert_eq!(
            decide(&different, &resolved, Mode::Commit),
            Err(Refusal::Conflict(ConflictKind::AlreadyResolved))
        );
    }

    #[test]
    fn a_pruned_dead_letters_resolution_still_answers_its_repeat_and_refuses_any_other() {
        let first = decide(&request(Action::Skip, 1), &blocked(), Mode::Commit).unwrap();
        let Resolved::New(record) = first.resolved else {
            panic!("expected a resolution");
        };
        let pruned = ResolutionFacts {
            dead_letter: None,
            recorded: Some(ResolutionRecord {
                resolution_id: Some(7),
                ..record
            }),
            ..blocked()
        };
        let repeat = decide(&request(Action::Skip, 1), &pruned, Mode::Commit).unwrap();
        assert!(repeat.changes.is_empty());
        assert!(matches!(repeat.resolved, Resolved::Repeated(_)));
        assert_eq!(
            decide(&request(Action::Skip, 0), &pruned, Mode::Commit),
            Err(Refusal::Conflict(ConflictKind::AlreadyResolved))
        );
        let never = ResolutionFacts {
            dead_letter: None,
            ..blocked()
        };
        assert_eq!(
            decide(&request(Action::Skip, 1), &never, Mode::Commit),
            Err(Refusal::NotFound)
        );
    }

    fn held_at(id: &str, sequence: i64, quantity: i64) -> HeldMessage {
        let message = crate::policy::tests::order(id, sequence, quantity);
        HeldMessage {
            payload: canonical_json(&message.payload),
            message,
            held_at: "t0".into(),
            claim: None,
            producer_now: None,
        }
    }

    fn drained(plan: &ResolutionPlan) -> (Vec<String>, Option<AggregateRow>) {
        let released = plan
            .changes
            .iter()
            .filter_map(|change| match change {
                Change::ReleaseHeld { message_id, .. } => Some(message_id.clone()),
                _ => None,
            })
            .collect();
        let row = plan.changes.iter().rev().find_map(|change| match change {
            Change::PutAggregate { row, .. } => Some(row.clone()),
            _ => None,
        });
        (released, row)
    }

    #[test]
    fn a_resolution_drains_the_held_successors_it_unblocks() {
        let facts = ResolutionFacts {
            held: vec![
                held_at("m-3", 3, 3),
                held_at("m-4", 4, 4),
                held_at("m-6", 6, 6),
            ],
            ..blocked()
        };
        let skip = decide(&request(Action::Skip, 1), &facts, Mode::Commit).unwrap();
        let (released, row) = drained(&skip);
        assert_eq!(released, ["m-3", "m-4"]);
        let row = row.unwrap();
        assert_eq!((row.last, row.status), (4, AggregateStatus::Waiting));
        let Resolved::New(record) = &skip.resolved else {
            panic!("expected a resolution");
        };
        assert_eq!(record.after, position(2), "the skip's own step");

        let replace = Action::Replace {
            message_id: "fixed-2".into(),
            payload: json!({"quantity": 1}),
        };
        let plan = decide(&request(replace, 1), &facts, Mode::Commit).unwrap();
        let (released, row) = drained(&plan);
        assert_eq!(released, ["m-3", "m-4"]);
        assert_eq!(row.map(|row| row.last), Some(4));
        // A dry run drains nothing.
        assert!(
            decide(&request(Action::Skip, 1), &facts, Mode::DryRun)
                .unwrap()
                .changes
                .is_empty()
        );
    }

    #[test]
    fn a_skip_rejects_the_held_anonymous_successors_of_an_owned_aggregate() {
        let held = |id: &str, sequence| {
            let message = OrderedMessage {
                message_id: id.into(),
                aggregate_id: "a".into(),
                sequence,
                payload: json!({"quantity": 1}),
            };
            HeldMessage {
                payload: canonical_json(&message.payload),
                message,
                held_at: "t0".into(),
                claim: None,
                producer_now: None,
            }
        };
        let facts = ResolutionFacts {
            held: vec![held("x-3", 3), held("x-4", 4)],
            owner: Some(AggregateOwner {
                producer: "billing".into(),
                epoch: 1,
            }),
            ..blocked()
        };
        let plan = decide_resolution(
            &request(Action::Skip, 1),
            &facts,
            Mode::Commit,
            context(&Limits::default()),
        )
        .unwrap();
        assert!(
            !plan
                .changes
                .iter()
                .any(|change| matches!(change, Change::InsertApplied { .. })),
            "no held message applies: {:?}",
            plan.changes
        );
        let rejected: Vec<&str> = plan
            .changes
            .iter()
            .filter_map(|change| match change {
                Change::RecordRejected(entry) => entry.message_id.as_deref(),
                _ => None,
            })
            .collect();
        assert_eq!(rejected, ["x-3", "x-4"]);
        let row = plan.changes.iter().rev().find_map(|change| match change {
            Change::PutAggregate { row, .. } => Some(row),
            _ => None,
        });
        assert_eq!(
            row.map(|row| (row.last, row.status)),
            Some((2, AggregateStatus::Flowing))
        );
    }

    #[test]
    fn an_accepted_dead_letter_applies_its_own_message_and_drains_behind_it() {
        let facts = ResolutionFacts {
            held: vec![held_at("m-3", 3, 3), held_at("m-4", 4, 4)],
            ..blocked()
        };
        let plan = decide(&request(Action::Accept, 1), &facts, Mode::Commit).unwrap();
        let Resolved::New(record) = &plan.resolved else {
            panic!("expected a resolution");
        };
        assert_eq!(record.action, ActionKind::Accept);
        assert_eq!(record.replacement, None);
        assert_eq!((record.before.last, record.after.last), (1, 2));
        let applied: Vec<(&str, i64, &Value)> = plan
            .changes
            .iter()
            .filter_map(|change| match change {
                Change::InsertApplied { message, .. } => Some((
                    message.message_id.as_str(),
                    message.sequence,
                    &message.payload,
                )),
                _ => None,
            })
            .collect();
        assert_eq!(
            applied,
            [
                ("poison-2", 2, &json!({"quantity": 2})),
                ("m-3", 3, &json!({"quantity": 3})),
                ("m-4", 4, &json!({"quantity": 4})),
            ],
            "its own id and content first, then the held successors"
        );
        assert_eq!(superseded(&plan), ["other-2"]);
        let (released, row) = drained(&plan);
        assert_eq!(released, ["m-3", "m-4"]);
        assert_eq!(
            row.map(|row| (row.last, row.status)),
            Some((4, AggregateStatus::Flowing))
        );
    }

    #[test]
    fn a_dead_letter_still_poison_or_without_its_content_is_not_accepted() {
        let mut still = blocked();
        if let Some(letter) = still.dead_letter.as_mut() {
            letter.payload = Some(r#"{"quantity":-2}"#.into());
        }
        assert_eq!(
            decide(&request(Action::Accept, 1), &still, Mode::Commit),
            Err(Refusal::ReplacementQuarantined(QuarantineReason::new(
                "negative quantity"
            )))
        );
        for payload in [None, Some("not json".to_owned())] {
            let mut unknown = blocked();
            if let Some(letter) = unknown.dead_letter.as_mut() {
                letter.payload = payload;
            }
            assert_eq!(
                decide(&request(Action::Accept, 1), &unknown, Mode::Commit),
                Err(Refusal::Conflict(ConflictKind::SequenceUnknown))
            );
        }
        let rehearsal = decide(&request(Action::Accept, 1), &blocked(), Mode::DryRun).unwrap();
        assert!(rehearsal.changes.is_empty());
        assert!(matches!(rehearsal.resolved, Resolved::DryRun(_)));
    }
}
