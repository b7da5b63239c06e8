//! Gaps that never fill, decided purely: what an aggregate that waits is missing, and an
//! operator's audited decision to go on without it.
//!
//! An aggregate waits when something arrived ahead of its expected sequence: a message the
//! broker door holds, or one the general door refused as a gap. If the expected message was lost
//! upstream it never comes, and nothing but a resend moves the aggregate. [`missing`] tells the
//! range (from the expected sequence to one below the lowest sequence seen ahead of it since the
//! last apply); `decide_gap_resolution` is the operator's way past it, with the same authority,
//! audit, race guard (`expectedLast`), dry run and identical-repeat rule as a dead letter's
//! resolution ([`crate::resolution`]):
//!
//! - the range is recorded as skipped (an audit row and a `gap skipped` event), with no effect;
//! - the position moves to the range's end;
//! - every held successor that is now next drains, in order, through the same policy as any
//!   delivery ([`crate::delivery`]), in the same plan.
//!
//! A skipped sequence that arrives later is stale, naming the resolution (see
//! `crate::facts::DeliveryFacts::skipped_by`). The preconditions are checked against facts
//! read in the transaction the changes are written in, so of a late message and a skip racing
//! for one sequence exactly one wins, and the other is refused naming it.

use serde_json::Value;

use crate::change::Change;
use crate::delivery::{Context, DrainStart, drain};
use crate::error::InboxError;
use crate::facts::{HeldMessage, OpenDeadLetter};
use crate::model::{AggregateRow, AggregateStatus, Position};
use crate::records::{AggregateOwner, DrainOutcome, DrainedMessage, GapRecord, SequenceRange};
use crate::resolution::Mode;
use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};
use crate::views::{AggregateSummary, MissingRange};

/// What a waiting aggregate is missing: from its expected sequence through one below the lowest
/// sequence seen ahead of it since its last apply (`refused`: the lowest the general door refused
/// as a gap at this last; `lowest_held`: the lowest the broker door holds). `None` for an
/// aggregate that does not wait; `through` is `None` when nothing ahead is known (an aggregate
/// that started waiting before the store noted what it refused).
pub fn missing(
    row: &AggregateRow,
    refused: Option<i64>,
    lowest_held: Option<i64>,
) -> Option<MissingRange> {
    if row.status != AggregateStatus::Waiting {
        return None;
    }
    let from = row.last.saturating_add(1);
    let ahead = [refused, lowest_held]
        .into_iter()
        .flatten()
        .filter(|sequence| *sequence > from)
        .min();
    Some(MissingRange {
        from,
        through: ahead.map(|sequence| sequence - 1),
    })
}

/// What a summarized aggregate misses ([`missing`]) and since when it waits.
pub fn waiting(
    summary: &AggregateSummary,
    refused: Option<i64>,
    lowest_held: Option<i64>,
) -> (Option<MissingRange>, Option<String>) {
    let row = AggregateRow {
        last: summary.last,
        status: summary.status,
        since: summary.since.clone(),
    };
    match missing(&row, refused, lowest_held) {
        Some(missing) => (Some(missing), row.since),
        None => (None, None),
    }
}

/// One gap resolution request, from an authenticated operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapRequest {
    /// The aggregate waiting for the missing sequences.
    pub aggregate_id: String,
    /// The operator who resolves, as named in the registry.
    pub operator: String,
    /// The sequences to go on without: `from` must be the expected one.
    pub range: SequenceRange,
    /// The last applied sequence the operator saw; the resolution is refused if it moved.
    pub expected_last: i64,
    /// Why the sequences are skipped, for the audit row.
    pub reason: String,
}

/// An applied message of the aggregate inside the requested range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedInRange {
    /// The sequence it took.
    pub sequence: i64,
    /// Its message id.
    pub message_id: String,
}

/// What the store knows that a gap resolution depends on, read in its transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) struct GapFacts {
    /// The aggregate's row (`None`: the store never recorded it).
    pub aggregate: Option<AggregateRow>,
    /// The aggregate's open dead letters.
    pub open_dead_letters: Vec<OpenDeadLetter>,
    /// The aggregate's held messages, in sequence order.
    pub held: Vec<HeldMessage>,
    /// The aggregate's owner (`None`: unowned).
    pub owner: Option<AggregateOwner>,
    /// Whether the operator is still active (not revoked since authentication).
    pub operator_active: bool,
    /// The lowest applied message of the aggregate inside the requested range, if any.
    pub applied_in_range: Option<AppliedInRange>,
    /// The recorded gap resolution of the aggregate whose range holds the requested `from`.
    pub recorded: Option<GapRecord>,
    /// What the application's handler reports of the aggregate now (its `state`).
    pub state: Option<Value>,
}

/// Why a gap resolution's precondition failed. The server words each one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GapConflict {
    /// Another resolution already skipped `from`.
    AlreadySkipped {
        /// That resolution's id, if known.
        resolution_id: Option<i64>,
        /// The range it skipped.
        range: SequenceRange,
    },
    /// A message took a sequence of the range: it was not missing after all.
    AppliedInRange {
        /// The sequence taken.
        sequence: i64,
        /// The message that took it.
        message_id: String,
    },
    /// The aggregate's last applied sequence is not the one the operator saw.
    ExpectedLastMismatch {
        /// The last applied sequence the operator saw.
        expected_last: i64,
        /// The aggregate's last applied sequence now.
        last: i64,
    },
    /// `from` is not the sequence the aggregate expects.
    NotExpected {
        /// The range's first sequence.
        from: i64,
        /// The sequence the aggregate expects.
        expected: i64,
    },
    /// A dead letter holds `from`: that is a dead letter's resolution.
    DeadLetterOpen {
        /// The dead letter's message id.
        message_id: String,
    },
    /// A held message lies inside the range: it is not missing.
    HeldInRange {
        /// The held message's sequence.
        sequence: i64,
        /// Its message id.
        message_id: String,
    },
}

/// A refused gap resolution, decided from the facts alone. Nothing is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GapRefusal {
    /// The store never recorded the aggregate.
    NotFound,
    /// A precondition failed.
    Conflict(GapConflict),
    /// The operator was revoked after authenticating.
    Unauthorized,
}

/// Why a gap resolution was refused, or a store failure.
#[derive(Debug, thiserror::Error)]
pub enum GapResolutionError {
    #[error("no aggregate '{0}' was ever recorded")]
    /// The aggregate was never recorded.
    NotFound(String),
    #[error("a gap resolution precondition failed: {0:?}")]
    /// A precondition failed; nothing was written.
    Conflict(GapConflict),
    #[error("the operator's token is no longer valid")]
    /// The operator is unknown or revoked.
    Unauthorized,
    #[error(transparent)]
    /// The store failed.
    Store(#[from] InboxError),
}

impl GapResolutionError {
    /// The error of a refusal of `request`.
    pub fn refused(request: &GapRequest, refusal: GapRefusal) -> GapResolutionError {
        match refusal {
            GapRefusal::NotFound => GapResolutionError::NotFound(request.aggregate_id.clone()),
            GapRefusal::Conflict(conflict) => GapResolutionError::Conflict(conflict),
            GapRefusal::Unauthorized => GapResolutionError::Unauthorized,
        }
    }
}

/// What a gap resolution did, or would do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GapResolved {
    /// Resolved now, as recorded.
    New(GapRecord),
    /// The same operator sent the same resolution before: its original record, nothing changed.
    Repeated(GapRecord),
    /// What the resolution would do; nothing was written.
    DryRun(GapRecord),
}

impl GapResolved {
    /// The resolution's audit record, new or earlier.
    pub fn record(&self) -> &GapRecord {
        match self {
            GapResolved::New(record)
            | GapResolved::Repeated(record)
            | GapResolved::DryRun(record) => record,
        }
    }

    /// The resolution with the id the store assigned its audit row (a new one only).
    pub fn numbered(self, resolution_id: Option<i64>) -> GapResolved {
        match self {
            GapResolved::New(record) => GapResolved::New(GapRecord {
                resolution_id: resolution_id.or(record.resolution_id),
                ..record
            }),
            other => other,
        }
    }
}

/// The decided gap resolution and its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapPlan {
    /// The answer.
    pub resolved: GapResolved,
    /// The changes that record it, in order.
    pub changes: Vec<Change>,
}

impl crate::change::Plan for GapPlan {
    fn changes(&self) -> &[Change] {
        &self.changes
    }
}

/// Decides a gap resolution. With [`Mode::DryRun`] the plan carries no changes and the record
/// no id (what would drain is still told).
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) fn decide_gap_resolution(
    request: &GapRequest,
    facts: &GapFacts,
    mode: Mode,
    context: Context<'_>,
) -> Result<GapPlan, GapRefusal> {
    let row = facts.aggregate.as_ref().ok_or(GapRefusal::NotFound)?;
    if let Some(recorded) = &facts.recorded {
        return repeat_of_recorded(request, recorded);
    }
    check_preconditions(request, facts, row)?;
    if !facts.operator_active {
        return Err(GapRefusal::Unauthorized);
    }
    let mut drained_changes = Vec::new();
    let after_drain = drain_after_skip(request, facts, context, &mut drained_changes);
    let record = GapRecord {
        resolution_id: None,
        aggregate_id: request.aggregate_id.clone(),
        range: request.range,
        operator: request.operator.clone(),
        reason: request.reason.clone(),
        expected_last: request.expected_last,
        before: Position {
            last: row.last,
            state: facts.state.clone(),
        },
        // The skip's own step has no effect: the handler's state is what it was.
        after: Position {
            last: request.range.through,
            state: facts.state.clone(),
        },
        drained: drained(&drained_changes),
        resolved_at: context.now.to_owned(),
    };
    Ok(match mode {
        Mode::DryRun => GapPlan {
            resolved: GapResolved::DryRun(record),
            changes: Vec::new(),
        },
        Mode::Commit => {
            let mut changes = Vec::with_capacity(drained_changes.len() + 2);
            changes.push(Change::RecordGapResolution(Box::new(record.clone())));
            changes.append(&mut drained_changes);
            changes.push(Change::PutAggregate {
                aggregate_id: request.aggregate_id.clone(),
                row: after_drain,
            });
            GapPlan {
                resolved: GapResolved::New(record),
                changes,
            }
        }
    })
}

/// The `gap skipped` timeline event of a recorded gap resolution (its id assigned by the store).
pub fn gap_skipped_event(record: &GapRecord, resolution_id: i64) -> TimelineEntry {
    TimelineEntry {
        aggregate_id: record.aggregate_id.clone(),
        at: record.resolved_at.clone(),
        kind: TimelineKind::GapSkipped,
        sequence: Some(record.range.from),
        message_id: None,
        detail: TimelineDetail::GapSkipped {
            resolution_id,
            from: record.range.from,
            through: record.range.through,
            operator: record.operator.clone(),
            reason: record.reason.clone(),
        },
    }
}

/// A resolution already skipped `from`: an identical repeat by the same operator answers with
/// the original record; anything else is a conflict naming it.
fn repeat_of_recorded(request: &GapRequest, recorded: &GapRecord) -> Result<GapPlan, GapRefusal> {
    let same = recorded.operator == request.operator
        && recorded.range == request.range
        && recorded.expected_last == request.expected_last
        && recorded.reason == request.reason;
    if same {
        return Ok(GapPlan {
            resolved: GapResolved::Repeated(recorded.clone()),
            changes: Vec::new(),
        });
    }
    Err(GapRefusal::Conflict(GapConflict::AlreadySkipped {
        resolution_id: recorded.resolution_id,
        range: recorded.range,
    }))
}

/// The range must hold only sequences that never arrived, starting at the expected one, and the
/// operator must have decided on the aggregate's current last.
fn check_preconditions(
    request: &GapRequest,
    facts: &GapFacts,
    row: &AggregateRow,
) -> Result<(), GapRefusal> {
    let conflict = |kind| Err(GapRefusal::Conflict(kind));
    let range = request.range;
    // The winner of a race for the range's first sequence is named before the position is
    // compared: it is what the operator needs to know.
    if let Some(applied) = &facts.applied_in_range {
        return conflict(GapConflict::AppliedInRange {
            sequence: applied.sequence,
            message_id: applied.message_id.clone(),
        });
    }
    if request.expected_last != row.last {
        return conflict(GapConflict::ExpectedLastMismatch {
            expected_last: request.expected_last,
            last: row.last,
        });
    }
    let expected = row.last.saturating_add(1);
    if range.from != expected {
        return conflict(GapConflict::NotExpected {
            from: range.from,
            expected,
        });
    }
    if let Some(letter) = facts
        .open_dead_letters
        .iter()
        .find(|letter| letter.sequence == Some(range.from))
    {
        return conflict(GapConflict::DeadLetterOpen {
            message_id: letter.message_id.clone(),
        });
    }
    if let Some(held) = facts
        .held
        .iter()
        .find(|held| range.contains(held.message.sequence))
    {
        return conflict(GapConflict::HeldInRange {
            sequence: held.message.sequence,
            message_id: held.message.message_id.clone(),
        });
    }
    Ok(())
}

/// Moves the position to the range's end and drains the held successors that became next, as
/// after any apply. Returns the aggregate's row after the drain.
fn drain_after_skip(
    request: &GapRequest,
    facts: &GapFacts,
    context: Context<'_>,
    changes: &mut Vec<Change>,
) -> AggregateRow {
    let range = request.range;
    let after = format!("skip of {}..{}", range.from, range.through);
    let start = DrainStart {
        aggregate_id: &request.aggregate_id,
        row: AggregateRow {
            last: range.through,
            status: AggregateStatus::Flowing,
            since: Some(context.now.to_owned()),
        },
        after: &after,
        held: &facts.held,
        open: &facts.open_dead_letters,
        owner: facts.owner.as_ref(),
    };
    drain(start, context, changes)
}

/// The messages a drain applied or quarantined, in order.
fn drained(changes: &[Change]) -> Vec<DrainedMessage> {
    changes
        .iter()
        .filter_map(|change| match change {
            Change::InsertApplied { message, .. } => Some((message, DrainOutcome::Applied)),
            Change::InsertDeadLetter { message, .. } => Some((message, DrainOutcome::Quarantined)),
            _ => None,
        })
        .map(|(message, outcome)| DrainedMessage {
            sequence: message.sequence,
            message_id: message.message_id.clone(),
            outcome,
        })
        .collect()
}

/// The drained messages of a stored audit row (the JSON of its record's `drained`); an entry
/// this build cannot read is left out rather than failing the whole trail.
pub fn drained_from_json(text: &str) -> Vec<DrainedMessage> {
    let Ok(Value::Array(entries)) = serde_json::from_str::<Value>(text) else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|entry| {
            Some(DrainedMessage {
                sequence: entry["sequence"].as_i64()?,
                message_id: entry["messageId"].as_str()?.to_owned(),
                outcome: entry["outcome"].as_str()?.parse().ok()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::{AcceptAll, canonical_json};
    use crate::model::{Limits, OrderedMessage};
    use serde_json::json;

    struct NoNegatives;

    impl crate::content::Check for NoNegatives {
        fn check(&self, message: &OrderedMessage) -> Result<(), crate::content::Poison> {
            match message.payload["amount"].as_i64() {
                Some(amount) if amount < 0 => Err(crate::content::Poison::new("negative")),
                _ => Ok(()),
            }
        }
    }

    fn context<'a>(limits: &'a Limits, check: &'a dyn crate::content::Check) -> Context<'a> {
        Context {
            limits,
            check,
            now: "t9",
        }
    }

    fn held(id: &str, sequence: i64, amount: i64) -> HeldMessage {
        let message = OrderedMessage {
            message_id: id.into(),
            aggregate_id: "a".into(),
            sequence,
            payload: json!({"amount": amount}),
        };
        HeldMessage {
            payload: canonical_json(&message.payload),
            message,
            held_at: "t1".into(),
            claim: None,
            producer_now: None,
        }
    }

    fn waiting_at_4() -> GapFacts {
        GapFacts {
            aggregate: Some(AggregateRow {
                last: 4,
                status: AggregateStatus::Waiting,
                since: Some("t1".into()),
            }),
            held: vec![held("m-6", 6, 6), held("m-7", 7, 7), held("m-8", 8, 8)],
            operator_active: true,
            state: Some(json!({"total": 10})),
            ..GapFacts::default()
        }
    }

    fn skip(from: i64, through: i64, expected_last: i64) -> GapRequest {
        GapRequest {
            aggregate_id: "a".into(),
            operator: "alice".into(),
            range: SequenceRange { from, through },
            expected_last,
            reason: "lost upstream".into(),
        }
    }

    fn decide(request: &GapRequest, facts: &GapFacts, mode: Mode) -> Result<GapPlan, GapRefusal> {
        decide_gap_resolution(
            request,
            facts,
            mode,
            context(&Limits::default(), &AcceptAll),
        )
    }

    fn conflict(result: Result<GapPlan, GapRefusal>) -> GapConflict {
        match result {
            Err(GapRefusal::Conflict(conflict)) => conflict,
            other => panic!("expected a conflict, got {other:?}"),
        }
    }

    #[test]
    fn a_waiting_aggregate_misses_up_to_the_lowest_sequence_seen_ahead() {
        let row = AggregateRow {
            last: 4,
            status: AggregateStatus::Waiting,
            since: None,
        };
        let range = |from, through| Some(MissingRange { from, through });
        assert_eq!(missing(&row, None, Some(6)), range(5, Some(5)));
        assert_eq!(missing(&row, Some(9), Some(7)), range(5, Some(6)));
        assert_eq!(missing(&row, Some(8), None), range(5, Some(7)));
        assert_eq!(missing(&row, None, None), range(5, None));
        let flowing = AggregateRow {
            status: AggregateStatus::Flowing,
            ..row.clone()
        };
        assert_eq!(missing(&flowing, Some(8), Some(6)), None);
        let blocked = AggregateRow {
            status: AggregateStatus::Blocked,
            ..row
        };
        assert_eq!(missing(&blocked, None, Some(6)), None);
    }

    #[test]
    fn a_skip_records_the_range_then_drains_every_held_successor_in_order() {
        let plan = decide(&skip(5, 5, 4), &waiting_at_4(), Mode::Commit).unwrap();
        let GapResolved::New(record) = &plan.resolved else {
            panic!("expected a new resolution: {:?}", plan.resolved);
        };
        assert_eq!((record.before.last, record.after.last), (4, 5));
        assert_eq!(record.after.state, Some(json!({"total": 10})));
        let drained: Vec<(i64, &str)> = record
            .drained
            .iter()
            .map(|message| (message.sequence, message.message_id.as_str()))
            .collect();
        assert_eq!(drained, [(6, "m-6"), (7, "m-7"), (8, "m-8")]);
        assert!(matches!(
            plan.changes.first(),
            Some(Change::RecordGapResolution(_))
        ));
        let applied: Vec<i64> = plan
            .changes
            .iter()
            .filter_map(|change| change.applied_message().map(|message| message.sequence))
            .collect();
        assert_eq!(applied, [6, 7, 8]);
        let Some(Change::PutAggregate { row, .. }) = plan.changes.last() else {
            panic!("the aggregate's row comes last: {:?}", plan.changes);
        };
        assert_eq!((row.last, row.status), (8, AggregateStatus::Flowing));
    }

    #[test]
    fn a_held_poison_successor_is_quarantined_and_stops_the_drain() {
        let facts = GapFacts {
            held: vec![held("m-6", 6, 6), held("bad-7", 7, -1), held("m-8", 8, 8)],
            ..waiting_at_4()
        };
        let plan = decide_gap_resolution(
            &skip(5, 5, 4),
            &facts,
            Mode::Commit,
            context(&Limits::default(), &NoNegatives),
        )
        .unwrap();
        let outcomes: Vec<(i64, DrainOutcome)> = plan
            .resolved
            .record()
            .drained
            .iter()
            .map(|message| (message.sequence, message.outcome))
            .collect();
        assert_eq!(
            outcomes,
            [(6, DrainOutcome::Applied), (7, DrainOutcome::Quarantined)]
        );
        let Some(Change::PutAggregate { row, .. }) = plan.changes.last() else {
            panic!("the aggregate's row comes last");
        };
        assert_eq!((row.last, row.status), (6, AggregateStatus::Blocked));
    }

    #[test]
    fn drained_messages_read_back_from_their_stored_json() {
        let plan = decide(&skip(5, 5, 4), &waiting_at_4(), Mode::Commit).unwrap();
        let record = plan.resolved.record();
        let text = serde_json::to_string(&record.drained).unwrap();
        assert_eq!(drained_from_json(&text), record.drained);
        assert_eq!(drained_from_json("not json"), []);
    }

    #[test]
    fn a_dry_run_tells_what_would_drain_and_writes_nothing() {
        let plan = decide(&skip(5, 5, 4), &waiting_at_4(), Mode::DryRun).unwrap();
        assert!(plan.changes.is_empty());
        let GapResolved::DryRun(record) = &plan.resolved else {
            panic!("expected a dry run");
        };
        assert_eq!(record.resolution_id, None);
        assert_eq!(record.drained.len(), 3);
    }

    #[test]
    fn the_range_must_start_at_the_expected_sequence_of_the_position_decided_on() {
        assert_eq!(
            conflict(decide(&skip(5, 5, 3), &waiting_at_4(), Mode::Commit)),
            GapConflict::ExpectedLastMismatch {
                expected_last: 3,
                last: 4
            }
        );
        assert_eq!(
            conflict(decide(&skip(6, 6, 4), &waiting_at_4(), Mode::Commit)),
            GapConflict::NotExpected {
                from: 6,
                expected: 5
            }
        );
    }

    #[test]
    fn a_range_over_a_held_applied_or_quarantined_sequence_is_refused() {
        assert_eq!(
            conflict(decide(&skip(5, 6, 4), &waiting_at_4(), Mode::Commit)),
            GapConflict::HeldInRange {
                sequence: 6,
                message_id: "m-6".into()
            }
        );
        let raced = GapFacts {
            applied_in_range: Some(AppliedInRange {
                sequence: 5,
                message_id: "late-5".into(),
            }),
            ..waiting_at_4()
        };
        assert_eq!(
            conflict(decide(&skip(5, 5, 4), &raced, Mode::Commit)),
            GapConflict::AppliedInRange {
                sequence: 5,
                message_id: "late-5".into()
            }
        );
        let blocked = GapFacts {
            open_dead_letters: vec![OpenDeadLetter {
                producer: None,
                message_id: "poison-5".into(),
                sequence: Some(5),
            }],
            ..waiting_at_4()
        };
        assert_eq!(
            conflict(decide(&skip(5, 5, 4), &blocked, Mode::Commit)),
            GapConflict::DeadLetterOpen {
                message_id: "poison-5".into()
            }
        );
    }

    #[test]
    fn an_identical_repeat_answers_the_original_and_anything_else_names_it() {
        let first = decide(&skip(5, 5, 4), &waiting_at_4(), Mode::Commit).unwrap();
        let recorded = GapRecord {
            resolution_id: Some(3),
            ..first.resolved.record().clone()
        };
        let after = GapFacts {
            aggregate: Some(AggregateRow {
                last: 8,
                status: AggregateStatus::Flowing,
                since: Some("t9".into()),
            }),
            held: Vec::new(),
            recorded: Some(recorded.clone()),
            ..waiting_at_4()
        };
        let repeat = decide(&skip(5, 5, 4), &after, Mode::Commit).unwrap();
        assert_eq!(repeat.resolved, GapResolved::Repeated(recorded));
        assert!(repeat.changes.is_empty());
        let other = GapRequest {
            reason: "another reason".into(),
            ..skip(5, 5, 4)
        };
        assert_eq!(
            conflict(decide(&other, &after, Mode::Commit)),
            GapConflict::AlreadySkipped {
                resolution_id: Some(3),
                range: SequenceRange {
                    from: 5,
                    through: 5
                }
            }
        );
    }

    #[test]
    fn a_late_arrival_of_a_skipped_sequence_is_stale_and_names_the_skip() {
        let facts = crate::facts::DeliveryFacts {
            aggregate: Some(AggregateRow {
                last: 8,
                status: AggregateStatus::Flowing,
                since: None,
            }),
            skipped_by: Some(3),
            ..Default::default()
        };
        let late = held("late-5", 5, 5).message;
        let limits = Limits::default();
        for door in [crate::model::Door::General, crate::model::Door::Broker] {
            let plan =
                crate::delivery::decide_delivery(&late, door, &facts, context(&limits, &AcceptAll));
            assert_eq!(
                plan.outcome,
                crate::delivery::Outcome::Stale {
                    expected: 9,
                    skipped_by: Some(3)
                }
            );
            let [Change::Append(entry)] = plan.changes.as_slice() else {
                panic!("one observation: {:?}", plan.changes);
            };
            assert_eq!(
                entry.detail.to_json().as_deref(),
                Some(r#"{"expected":9,"skippedBy":3}"#)
            );
        }
    }

    #[test]
    fn a_gap_refused_by_the_general_door_is_noted_for_the_missing_range() {
        let facts = crate::facts::DeliveryFacts {
            aggregate: waiting_at_4().aggregate,
            ..Default::default()
        };
        let early = held("m-7", 7, 7).message;
        let limits = Limits::default();
        let plan = crate::delivery::decide_delivery(
            &early,
            crate::model::Door::General,
            &facts,
            context(&limits, &AcceptAll),
        );
        assert!(plan.changes.contains(&Change::NoteGap {
            aggregate_id: "a".into(),
            last: 4,
            sequence: 7
        }));
    }

    #[test]
    fn a_revoked_operator_or_an_unknown_aggregate_is_refused() {
        let revoked = GapFacts {
            operator_active: false,
            ..waiting_at_4()
        };
        assert_eq!(
            decide(&skip(5, 5, 4), &revoked, Mode::Commit),
            Err(GapRefusal::Unauthorized)
        );
        assert_eq!(
            decide(&skip(1, 1, 0), &GapFacts::default(), Mode::Commit),
            Err(GapRefusal::NotFound)
        );
    }
}
