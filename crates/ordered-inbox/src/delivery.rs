//! The decision of one delivery: a pure function from what the store knows (this message id's
//! history, the aggregate's row, its open dead letters) to the verdict and the rows to write.
//!
//! A backend reads [`DeliveryFacts`] and writes [`DeliveryPlan::changes`] inside one transaction
//! that serializes deliveries to the same aggregate; that is what makes concurrent deliveries of
//! one sequence apply exactly once. Nothing here touches a database.

use crate::model::{
    AggregateRow, AggregateStatus, DeadLetterStatus, Door, Limits, OrderedMessage, Position,
    QuarantineReason,
};
use crate::policy::{Decision, decide};
use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};

/// An applied message with this id, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMessage {
    /// The canonical payload.
    pub payload: String,
    /// Unknown for rows written before the column existed.
    pub sequence: Option<i64>,
    pub applied_at: Option<String>,
}

/// A dead letter with this id, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownDeadLetter {
    /// Unknown for dead letters recorded before payloads were kept.
    pub payload: Option<String>,
    pub reason: QuarantineReason,
    pub status: DeadLetterStatus,
    pub observations: i64,
}

/// An open dead letter of the aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenDeadLetter {
    pub message_id: String,
    /// Unknown for dead letters recorded before sequences were kept.
    pub sequence: Option<i64>,
}

/// What the store knows that a delivery's verdict depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveryFacts {
    pub applied: Option<AppliedMessage>,
    pub dead_letter: Option<KnownDeadLetter>,
    pub aggregate: Option<AggregateRow>,
    /// Every open dead letter of the aggregate; only a blocked aggregate has any, so a backend
    /// may leave this empty for one that is not blocked.
    pub open_dead_letters: Vec<OpenDeadLetter>,
}

/// How an earlier delivery of the same message was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedRecord {
    pub sequence: i64,
    pub applied_at: Option<String>,
}

/// The dead letter a quarantined delivery is recorded as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadLetterNote {
    pub status: DeadLetterStatus,
    pub observations: i64,
}

/// The verdict on a delivery.
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
        reason: QuarantineReason,
        /// `None` when the classroom door re-observed an id whose dead letter holds other content.
        dead_letter: Option<DeadLetterNote>,
    },
    /// A new poison message, refused: the aggregate already holds `open` open dead letters, the
    /// most [`Limits::max_open_dead_letters`] allows. Only a bounded observation was written.
    QuarantineFull {
        expected: i64,
        open: usize,
        limit: usize,
    },
}

/// One row change. Values are absolute (computed from the facts), so a backend writes them as
/// they are; the transaction's per-aggregate serialization keeps them true.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Insert or overwrite the aggregate's row.
    PutAggregate {
        aggregate_id: String,
        row: AggregateRow,
    },
    InsertApplied {
        message: OrderedMessage,
        payload: String,
        applied_at: String,
    },
    InsertDeadLetter {
        message: OrderedMessage,
        payload: String,
        reason: QuarantineReason,
        at: String,
    },
    /// A dead letter seen again: its count becomes `observations`.
    ObserveDeadLetter {
        message_id: String,
        observations: i64,
        at: String,
    },
    /// Open dead letters whose sequence `by` took.
    SupersedeDeadLetters {
        message_ids: Vec<String>,
        by: String,
        at: String,
    },
    /// The dead letter an operator resolves; the audit row follows as [`Change::RecordResolution`].
    ResolveDeadLetter { message_id: String, at: String },
    /// Append a timeline entry (an observation is numbered and pruned by the backend).
    Append(TimelineEntry),
    /// Insert the audit row, link it from the dead letter, and append its `resolved` event
    /// (whose detail carries the id the store assigns).
    RecordResolution(crate::views::ResolutionRecord),
}

/// The verdict and the rows that record it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryPlan {
    pub outcome: Outcome,
    pub changes: Vec<Change>,
}

/// Decides one delivery through `door`, stamping every row with `now`.
pub fn decide_delivery(
    message: &OrderedMessage,
    door: Door,
    facts: &DeliveryFacts,
    limits: &Limits,
    now: &str,
) -> DeliveryPlan {
    let decision = Delivery {
        message,
        facts,
        payload: message.canonical_payload(),
        now,
    };
    if let Some(prior) = &facts.applied {
        return if prior.payload == decision.payload {
            decision.replay(prior)
        } else {
            decision.payload_conflict()
        };
    }
    if door == Door::General
        && let Some(known) = &facts.dead_letter
    {
        // A dead letter from before its payload was stored cannot prove it is the same message,
        // so it counts as a conflict: the id must not acquire a second meaning.
        return if known.payload.as_deref() == Some(decision.payload.as_str()) {
            decision.quarantined_again(known)
        } else {
            decision.payload_conflict()
        };
    }
    match decide(decision.before().last, message.sequence, message.amount) {
        Decision::Gap { expected } => decision.gap(door, expected),
        Decision::Stale { expected } => decision.observed(
            Outcome::Stale { expected },
            TimelineKind::Stale,
            TimelineDetail::Expected { expected },
        ),
        Decision::Quarantine { expected, reason } => decision.quarantine(expected, reason, limits),
        Decision::Apply { sequence } => decision.apply(sequence),
    }
}

/// One delivery being decided: the message, what is known, and the shared stamps.
struct Delivery<'a> {
    message: &'a OrderedMessage,
    facts: &'a DeliveryFacts,
    payload: String,
    now: &'a str,
}

impl Delivery<'_> {
    fn before(&self) -> Position {
        self.facts
            .aggregate
            .as_ref()
            .map(AggregateRow::position)
            .unwrap_or_default()
    }

    fn status(&self) -> Option<AggregateStatus> {
        self.facts.aggregate.as_ref().map(|row| row.status)
    }

    fn entry(&self, kind: TimelineKind, detail: TimelineDetail) -> Change {
        Change::Append(TimelineEntry {
            aggregate_id: self.message.aggregate_id.clone(),
            at: self.now.to_owned(),
            kind,
            sequence: Some(self.message.sequence),
            message_id: Some(self.message.message_id.clone()),
            detail,
        })
    }

    fn put_status(&self, status: AggregateStatus) -> Change {
        let before = self.before();
        Change::PutAggregate {
            aggregate_id: self.message.aggregate_id.clone(),
            row: AggregateRow {
                last: before.last,
                total: before.total,
                status,
                since: Some(self.now.to_owned()),
            },
        }
    }

    /// A verdict that changes nothing but one observation.
    fn observed(
        self,
        outcome: Outcome,
        kind: TimelineKind,
        detail: TimelineDetail,
    ) -> DeliveryPlan {
        DeliveryPlan {
            changes: vec![self.entry(kind, detail)],
            outcome,
        }
    }

    fn replay(self, prior: &AppliedMessage) -> DeliveryPlan {
        DeliveryPlan {
            outcome: Outcome::Replay {
                original: AppliedRecord {
                    sequence: prior.sequence.unwrap_or(self.message.sequence),
                    applied_at: prior.applied_at.clone(),
                },
            },
            changes: Vec::new(),
        }
    }

    fn payload_conflict(self) -> DeliveryPlan {
        let detail = TimelineDetail::Offered {
            offered: self.payload.clone(),
        };
        self.observed(
            Outcome::PayloadConflict,
            TimelineKind::PayloadConflict,
            detail,
        )
    }

    /// The general door's answer to a quarantined message delivered again: the same verdict, one
    /// more observation, no new row.
    fn quarantined_again(self, known: &KnownDeadLetter) -> DeliveryPlan {
        let observations = known.observations.saturating_add(1);
        let expected = self.before().last.saturating_add(1);
        let detail = TimelineDetail::SeenAgain {
            observations,
            status: known.status,
        };
        let changes = vec![
            Change::ObserveDeadLetter {
                message_id: self.message.message_id.clone(),
                observations,
                at: self.now.to_owned(),
            },
            self.entry(TimelineKind::QuarantinedAgain, detail),
        ];
        DeliveryPlan {
            outcome: Outcome::Quarantined {
                expected,
                reason: known.reason,
                dead_letter: Some(DeadLetterNote {
                    status: known.status,
                    observations,
                }),
            },
            changes,
        }
    }

    fn gap(self, door: Door, expected: i64) -> DeliveryPlan {
        // The seed writes no row for a gap: through its door only an existing row learns it is
        // waiting. The general door records the aggregate from its first delivery on.
        let marks_waiting = matches!(
            (door, self.status()),
            (_, Some(AggregateStatus::Flowing)) | (Door::General, None)
        );
        let mut changes = Vec::with_capacity(2);
        if marks_waiting {
            changes.push(self.put_status(AggregateStatus::Waiting));
        }
        changes.push(self.entry(TimelineKind::Gap, TimelineDetail::Expected { expected }));
        DeliveryPlan {
            outcome: Outcome::Gap { expected },
            changes,
        }
    }

    /// Records a poison message at the expected sequence. The aggregate does not advance; it is
    /// blocked until a valid message takes the sequence or an operator resolves the dead letter.
    fn quarantine(self, expected: i64, reason: QuarantineReason, limits: &Limits) -> DeliveryPlan {
        let open = self.facts.open_dead_letters.len();
        if self.facts.dead_letter.is_none() && open >= limits.max_open_dead_letters {
            let detail = TimelineDetail::QuarantineFull {
                open_dead_letters: open,
                limit: limits.max_open_dead_letters,
            };
            let outcome = Outcome::QuarantineFull {
                expected,
                open,
                limit: limits.max_open_dead_letters,
            };
            return self.observed(outcome, TimelineKind::QuarantineFull, detail);
        }
        let mut changes = Vec::with_capacity(3);
        // As in the seed, the aggregate's row exists from its first quarantine on, still at its
        // old last sequence.
        if self.status() != Some(AggregateStatus::Blocked) {
            changes.push(self.put_status(AggregateStatus::Blocked));
        }
        // The classroom door may deliver a quarantined id again (its identity rule only knows
        // applied messages); like the seed it keeps one row, counting the repeat if the content
        // matches.
        let note = match &self.facts.dead_letter {
            None => {
                changes.push(Change::InsertDeadLetter {
                    message: self.message.clone(),
                    payload: self.payload.clone(),
                    reason,
                    at: self.now.to_owned(),
                });
                Some(DeadLetterNote {
                    status: DeadLetterStatus::Open,
                    observations: 1,
                })
            }
            Some(known) if known.payload.as_deref() == Some(self.payload.as_str()) => {
                let observations = known.observations.saturating_add(1);
                changes.push(Change::ObserveDeadLetter {
                    message_id: self.message.message_id.clone(),
                    observations,
                    at: self.now.to_owned(),
                });
                Some(DeadLetterNote {
                    status: known.status,
                    observations,
                })
            }
            Some(_) => None,
        };
        changes.push(match note {
            Some(note) if note.observations == 1 => self.entry(
                TimelineKind::Quarantined,
                TimelineDetail::Quarantined {
                    reason,
                    amount: self.message.amount,
                },
            ),
            _ => self.entry(
                TimelineKind::QuarantinedAgain,
                TimelineDetail::Repeated {
                    observations: note.map(|note| note.observations),
                },
            ),
        });
        DeliveryPlan {
            outcome: Outcome::Quarantined {
                expected,
                reason,
                dead_letter: note,
            },
            changes,
        }
    }

    /// Applies the next sequence: the inbox row, the advanced state, and the open dead letters at
    /// this sequence superseded by the message.
    fn apply(self, sequence: i64) -> DeliveryPlan {
        let before = self.before();
        let total = before.total.saturating_add(self.message.amount);
        let since = match &self.facts.aggregate {
            Some(row) if row.status == AggregateStatus::Flowing => row.since.clone(),
            _ => Some(self.now.to_owned()),
        };
        let mut changes = vec![
            Change::InsertApplied {
                message: self.message.clone(),
                payload: self.payload.clone(),
                applied_at: self.now.to_owned(),
            },
            Change::PutAggregate {
                aggregate_id: self.message.aggregate_id.clone(),
                row: AggregateRow {
                    last: sequence,
                    total,
                    status: AggregateStatus::Flowing,
                    since,
                },
            },
            self.entry(
                TimelineKind::Applied,
                TimelineDetail::Applied {
                    amount: self.message.amount,
                    total,
                },
            ),
        ];
        let superseded = supersede_at(
            &self.message.aggregate_id,
            sequence,
            &self.facts.open_dead_letters,
            &self.message.message_id,
            self.now,
            &mut changes,
        );
        DeliveryPlan {
            outcome: Outcome::Applied {
                sequence,
                total,
                superseded,
            },
            changes,
        }
    }
}

/// Supersedes the open dead letters at `sequence` by `taken_by` (the message applied, or the dead
/// letter whose skip took the sequence): one row change and one timeline event each. Returns
/// their ids.
pub(crate) fn supersede_at(
    aggregate_id: &str,
    sequence: i64,
    open: &[OpenDeadLetter],
    taken_by: &str,
    now: &str,
    changes: &mut Vec<Change>,
) -> Vec<String> {
    let superseded: Vec<String> = open
        .iter()
        .filter(|letter| letter.sequence == Some(sequence))
        .map(|letter| letter.message_id.clone())
        .collect();
    if superseded.is_empty() {
        return superseded;
    }
    changes.push(Change::SupersedeDeadLetters {
        message_ids: superseded.clone(),
        by: taken_by.to_owned(),
        at: now.to_owned(),
    });
    for message_id in &superseded {
        changes.push(Change::Append(TimelineEntry {
            aggregate_id: aggregate_id.to_owned(),
            at: now.to_owned(),
            kind: TimelineKind::Superseded,
            sequence: Some(sequence),
            message_id: Some(message_id.clone()),
            detail: TimelineDetail::Superseded {
                by: taken_by.to_owned(),
            },
        }));
    }
    superseded
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(id: &str, sequence: i64, amount: i64) -> OrderedMessage {
        OrderedMessage {
            message_id: id.into(),
            aggregate_id: "a".into(),
            sequence,
            amount,
        }
    }

    fn at(last: i64, total: i64, status: AggregateStatus) -> Option<AggregateRow> {
        Some(AggregateRow {
            last,
            total,
            status,
            since: Some("t0".into()),
        })
    }

    fn decide_general(message: &OrderedMessage, facts: &DeliveryFacts) -> DeliveryPlan {
        decide_delivery(message, Door::General, facts, &Limits::default(), "t1")
    }

    fn kinds(plan: &DeliveryPlan) -> Vec<TimelineKind> {
        plan.changes
            .iter()
            .filter_map(|change| match change {
                Change::Append(entry) => Some(entry.kind),
                _ => None,
            })
            .collect()
    }

    fn put_row(plan: &DeliveryPlan) -> Option<&AggregateRow> {
        plan.changes.iter().find_map(|change| match change {
            Change::PutAggregate { row, .. } => Some(row),
            _ => None,
        })
    }

    #[test]
    fn the_first_message_applies_and_starts_a_flowing_aggregate() {
        let plan = decide_general(&message("m-1", 1, 5), &DeliveryFacts::default());
        assert_eq!(
            plan.outcome,
            Outcome::Applied {
                sequence: 1,
                total: 5,
                superseded: vec![]
            }
        );
        let row = put_row(&plan).unwrap();
        assert_eq!(
            (row.last, row.total, row.status),
            (1, 5, AggregateStatus::Flowing)
        );
        assert_eq!(row.since.as_deref(), Some("t1"));
        assert_eq!(kinds(&plan), [TimelineKind::Applied]);
    }

    #[test]
    fn a_flowing_aggregate_keeps_the_time_it_started_flowing() {
        let facts = DeliveryFacts {
            aggregate: at(1, 5, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_general(&message("m-2", 2, 1), &facts);
        assert_eq!(put_row(&plan).unwrap().since.as_deref(), Some("t0"));
    }

    #[test]
    fn a_replay_writes_nothing_and_reports_the_original() {
        let facts = DeliveryFacts {
            applied: Some(AppliedMessage {
                payload: message("m-1", 1, 5).canonical_payload(),
                sequence: Some(1),
                applied_at: Some("t0".into()),
            }),
            aggregate: at(3, 9, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_general(&message("m-1", 1, 5), &facts);
        assert!(plan.changes.is_empty());
        assert_eq!(
            plan.outcome,
            Outcome::Replay {
                original: AppliedRecord {
                    sequence: 1,
                    applied_at: Some("t0".into())
                }
            }
        );
        let changed = decide_general(&message("m-1", 1, 6), &facts);
        assert_eq!(changed.outcome, Outcome::PayloadConflict);
        assert_eq!(kinds(&changed), [TimelineKind::PayloadConflict]);
    }

    #[test]
    fn a_gap_marks_a_flowing_aggregate_waiting_and_the_classroom_writes_no_new_row() {
        let plan = decide_general(&message("m-3", 3, 1), &DeliveryFacts::default());
        assert_eq!(plan.outcome, Outcome::Gap { expected: 1 });
        assert_eq!(put_row(&plan).unwrap().status, AggregateStatus::Waiting);
        let classroom = decide_delivery(
            &message("m-3", 3, 1),
            Door::Classroom,
            &DeliveryFacts::default(),
            &Limits::default(),
            "t1",
        );
        assert!(put_row(&classroom).is_none());
        let blocked = DeliveryFacts {
            aggregate: at(1, 1, AggregateStatus::Blocked),
            ..Default::default()
        };
        let plan = decide_general(&message("m-3", 3, 1), &blocked);
        assert!(
            put_row(&plan).is_none(),
            "a blocked aggregate stays blocked"
        );
    }

    #[test]
    fn a_stale_sequence_is_only_observed() {
        let facts = DeliveryFacts {
            aggregate: at(2, 2, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_general(&message("late", 1, 1), &facts);
        assert_eq!(plan.outcome, Outcome::Stale { expected: 3 });
        assert_eq!(kinds(&plan), [TimelineKind::Stale]);
        assert_eq!(plan.changes.len(), 1);
    }

    #[test]
    fn a_poison_message_blocks_without_advancing() {
        let facts = DeliveryFacts {
            aggregate: at(1, 5, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_general(&message("p", 2, -1), &facts);
        assert_eq!(
            plan.outcome,
            Outcome::Quarantined {
                expected: 2,
                reason: QuarantineReason::NegativeAmount,
                dead_letter: Some(DeadLetterNote {
                    status: DeadLetterStatus::Open,
                    observations: 1
                })
            }
        );
        let row = put_row(&plan).unwrap();
        assert_eq!((row.last, row.status), (1, AggregateStatus::Blocked));
        assert!(
            plan.changes
                .iter()
                .any(|change| matches!(change, Change::InsertDeadLetter { .. }))
        );
        assert_eq!(kinds(&plan), [TimelineKind::Quarantined]);
    }

    fn known_poison(status: DeadLetterStatus) -> KnownDeadLetter {
        KnownDeadLetter {
            payload: Some(message("p", 1, -1).canonical_payload()),
            reason: QuarantineReason::NegativeAmount,
            status,
            observations: 1,
        }
    }

    #[test]
    fn identity_spans_dead_letters_only_at_the_general_door() {
        let facts = DeliveryFacts {
            dead_letter: Some(known_poison(DeadLetterStatus::Open)),
            aggregate: at(0, 0, AggregateStatus::Blocked),
            open_dead_letters: vec![OpenDeadLetter {
                message_id: "p".into(),
                sequence: Some(1),
            }],
            ..Default::default()
        };
        let again = decide_general(&message("p", 1, -1), &facts);
        assert_eq!(
            again.outcome,
            Outcome::Quarantined {
                expected: 1,
                reason: QuarantineReason::NegativeAmount,
                dead_letter: Some(DeadLetterNote {
                    status: DeadLetterStatus::Open,
                    observations: 2
                }),
            }
        );
        assert_eq!(kinds(&again), [TimelineKind::QuarantinedAgain]);
        // Same id, corrected content: the general door refuses to give the id a second meaning,
        let corrected = decide_general(&message("p", 1, 1), &facts);
        assert_eq!(corrected.outcome, Outcome::PayloadConflict);
        // while the classroom door, like the seed, only knows applied ids.
        let classroom = decide_delivery(
            &message("p", 1, 1),
            Door::Classroom,
            &facts,
            &Limits::default(),
            "t1",
        );
        assert!(matches!(
            classroom.outcome,
            Outcome::Applied { sequence: 1, .. }
        ));
    }

    #[test]
    fn a_legacy_dead_letter_without_payload_never_matches() {
        let facts = DeliveryFacts {
            dead_letter: Some(KnownDeadLetter {
                payload: None,
                ..known_poison(DeadLetterStatus::Open)
            }),
            ..Default::default()
        };
        let plan = decide_general(&message("p", 1, -1), &facts);
        assert_eq!(plan.outcome, Outcome::PayloadConflict);
    }

    #[test]
    fn the_classroom_counts_a_repeat_only_when_the_content_matches() {
        let facts = DeliveryFacts {
            dead_letter: Some(known_poison(DeadLetterStatus::Open)),
            aggregate: at(0, 0, AggregateStatus::Blocked),
            ..Default::default()
        };
        let classroom = |m: &OrderedMessage| {
            decide_delivery(m, Door::Classroom, &facts, &Limits::default(), "t1")
        };
        let same = classroom(&message("p", 1, -1));
        assert!(matches!(
            same.outcome,
            Outcome::Quarantined {
                dead_letter: Some(DeadLetterNote {
                    observations: 2,
                    ..
                }),
                ..
            }
        ));
        let other = classroom(&message("p", 1, -2));
        assert!(matches!(
            other.outcome,
            Outcome::Quarantined {
                dead_letter: None,
                ..
            }
        ));
        assert_eq!(kinds(&other), [TimelineKind::QuarantinedAgain]);
    }

    #[test]
    fn a_new_id_at_the_quarantined_sequence_supersedes_the_dead_letters() {
        let facts = DeliveryFacts {
            aggregate: at(0, 0, AggregateStatus::Blocked),
            open_dead_letters: vec![
                OpenDeadLetter {
                    message_id: "p".into(),
                    sequence: Some(1),
                },
                OpenDeadLetter {
                    message_id: "legacy".into(),
                    sequence: None,
                },
            ],
            ..Default::default()
        };
        let plan = decide_general(&message("fix", 1, 2), &facts);
        assert_eq!(
            plan.outcome,
            Outcome::Applied {
                sequence: 1,
                total: 2,
                superseded: vec!["p".into()]
            }
        );
        assert_eq!(
            kinds(&plan),
            [TimelineKind::Applied, TimelineKind::Superseded]
        );
        assert_eq!(put_row(&plan).unwrap().since.as_deref(), Some("t1"));
    }

    #[test]
    fn a_full_quarantine_refuses_a_new_poison_id_but_still_counts_a_known_one() {
        let limits = Limits {
            max_open_dead_letters: 2,
        };
        let open: Vec<OpenDeadLetter> = ["p", "q"]
            .into_iter()
            .map(|id| OpenDeadLetter {
                message_id: id.into(),
                sequence: Some(1),
            })
            .collect();
        let facts = DeliveryFacts {
            aggregate: at(0, 0, AggregateStatus::Blocked),
            open_dead_letters: open,
            ..Default::default()
        };
        let refused = decide_delivery(&message("r", 1, -1), Door::General, &facts, &limits, "t1");
        assert_eq!(
            refused.outcome,
            Outcome::QuarantineFull {
                expected: 1,
                open: 2,
                limit: 2
            }
        );
        assert_eq!(kinds(&refused), [TimelineKind::QuarantineFull]);
        assert_eq!(refused.changes.len(), 1, "nothing but one observation");
        let known = DeliveryFacts {
            dead_letter: Some(known_poison(DeadLetterStatus::Open)),
            ..facts
        };
        let again = decide_delivery(&message("p", 1, -1), Door::General, &known, &limits, "t1");
        assert!(matches!(again.outcome, Outcome::Quarantined { .. }));
    }
}
