//! The decision of one delivery: a pure function from what the store knows (this message id's
//! history, the aggregate's row, its open dead letters, its held messages) to the verdict and the
//! rows to write.
//!
//! Held successors: through [`Door::Broker`] a message ahead of its turn is *held* (a row of its
//! own, in its producer's namespace with the epoch it was sent under) instead of refused as a
//! gap. Whenever a message applies, through any door or a
//! resolution, the held messages that have become next apply after it, in sequence order, in
//! the same plan, each through the ordinary policy: a held poison message is quarantined and
//! stops the drain.
//!
//! A backend reads `DeliveryFacts` and writes `DeliveryPlan::changes` inside one transaction
//! that serializes deliveries to the same aggregate; that is what makes concurrent deliveries of
//! one sequence apply exactly once. Nothing here touches a database.

use crate::change::Change;
use crate::content::{Check, Detail, Poison, same_content};
use crate::facts::{
    AppliedFact, DeliveryFacts, HeldMessage, KnownDeadLetter, OpenDeadLetter, OwnershipFacts,
};
use crate::model::{
    AggregateRow, AggregateStatus, DeadLetterStatus, Door, Limits, OrderedMessage, QuarantineReason,
};
use crate::policy::{Decision, decide};
use crate::producers::{Admission, admit, admit_held};
use crate::records::{AggregateOwner, ProducerClaim, ProducerRefusal};
use crate::rejected::{HeldRejection, reject_held};
use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};

/// What every decision is made with: the store's bounds, the application's check (pure), and
/// the time that stamps every row.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    /// The store's bounds.
    pub limits: &'a Limits,
    /// The application's check.
    pub check: &'a dyn Check,
    /// The time now, in the stored format ([`crate::clock`]).
    pub now: &'a str,
}

/// How an earlier delivery of the same message was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedRecord {
    /// The sequence it applied at.
    pub sequence: i64,
    /// When it applied (unknown for rows written before the column existed).
    pub applied_at: Option<String>,
}

/// The dead letter a quarantined delivery is recorded as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadLetterNote {
    /// The dead letter's status.
    pub status: DeadLetterStatus,
    /// How many times it has been seen.
    pub observations: i64,
}

/// The verdict on a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Applied at the expected sequence, with the handler's writes, in one transaction.
    Applied {
        /// The sequence it applied at.
        sequence: i64,
        /// Open dead letters at this sequence that the message replaced.
        superseded: Vec<String>,
        /// What the handler's `apply` reported. The decision leaves it empty; the backend fills
        /// it in after `apply` ran.
        detail: Detail,
    },
    /// The same id with the same payload was applied before; nothing changed.
    Replay {
        /// The earlier apply.
        original: AppliedRecord,
    },
    /// The id is known with a different payload; nothing changed.
    PayloadConflict,
    /// Ahead of its turn and refused; nothing applied.
    Gap {
        /// The sequence the aggregate waits for.
        expected: i64,
    },
    /// Behind its turn (the sequence was already passed); nothing applied.
    Stale {
        /// The sequence the aggregate waits for.
        expected: i64,
        /// The operator's gap resolution that skipped this sequence (the message arrived after
        /// it), if one did.
        skipped_by: Option<i64>,
    },
    /// Recorded as a dead letter (or seen again as one); the aggregate did not advance.
    Quarantined {
        /// The sequence the aggregate waits for.
        expected: i64,
        /// Why it is poison.
        reason: QuarantineReason,
        /// `None` when the classroom door re-observed an id whose dead letter holds other content.
        dead_letter: Option<DeadLetterNote>,
    },
    /// A new poison message, refused: the aggregate already holds `open` open dead letters, the
    /// most [`Limits::max_open_dead_letters`] allows. Only a bounded observation was written.
    QuarantineFull {
        /// The sequence the aggregate waits for.
        expected: i64,
        /// The aggregate's open dead letters.
        open: usize,
        /// The most it may have.
        limit: usize,
        /// Why the message is poison.
        reason: QuarantineReason,
    },
    /// ([`Door::Broker`] only) Ahead of its turn: recorded as held for its aggregate; it applies
    /// as soon as `expected` and the sequences between do. `held` counts the aggregate's held
    /// messages now. `repeated`: the same message was already held; nothing changed.
    Held {
        /// The sequence the aggregate waits for.
        expected: i64,
        /// How many messages the aggregate holds now.
        held: usize,
        /// Whether it was held already.
        repeated: bool,
    },
    /// ([`Door::Broker`] only) Ahead of its turn, but the aggregate already holds `held`
    /// messages, the most [`Limits::max_held_per_aggregate`] allows: not recorded (but for a
    /// bounded observation); deliver it again later.
    HoldFull {
        /// The sequence the aggregate waits for.
        expected: i64,
        /// How many messages the aggregate holds.
        held: usize,
        /// The most it may hold.
        limit: usize,
    },
}

impl Outcome {
    /// Whether the message itself was recorded: applied, quarantined as a dead letter, or held.
    /// Every other verdict refuses it (a replay only points at the original).
    pub fn records_the_message(&self) -> bool {
        matches!(
            self,
            Outcome::Applied { .. } | Outcome::Quarantined { .. } | Outcome::Held { .. }
        )
    }
}

/// The verdict and the rows that record it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) struct DeliveryPlan {
    /// The verdict.
    pub outcome: Outcome,
    /// The changes that record it, in order.
    pub changes: Vec<Change>,
}

impl crate::change::Plan for DeliveryPlan {
    fn changes(&self) -> &[Change] {
        &self.changes
    }
}

/// Decides one delivery made by `claim`'s producer (`None`: anonymous): first whether it may be
/// decided at all ([`admit`]: epoch fencing and ownership; a refusal writes nothing), then as
/// [`decide_delivery`]. A claim comes first in the changes, with its `claimed` event, and an
/// authenticated delivery stamps its producer's last delivery time.
///
/// Only a delivery whose message is recorded ([`Outcome::records_the_message`]) claims a fresh
/// aggregate. One refused on its merits (a gap, a payload conflict, a full quarantine) writes
/// nothing on the aggregate either: no row, no observation. Either would give it history, and an
/// unowned aggregate with history can only get an owner from an operator, so a refused delivery
/// would squat the id as surely as a claim.
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) fn decide_producer_delivery(
    message: &OrderedMessage,
    door: Door,
    claim: Option<&ProducerClaim>,
    ownership: &OwnershipFacts,
    facts: &DeliveryFacts,
    context: Context<'_>,
) -> Result<DeliveryPlan, ProducerRefusal> {
    let admission = admit(claim, ownership)?;
    let producer = claim.map(|claim| claim.producer.as_str());
    let now = context.now;
    let mut plan = decide_as(producer, claim, message, door, facts, context);
    let mut first = Vec::with_capacity(3);
    match admission {
        Admission::Claim(_) if !plan.outcome.records_the_message() => plan.changes.clear(),
        Admission::Claim(owner) => first.extend(claim_changes(message, owner, now)),
        Admission::Anonymous | Admission::Owner => {}
    }
    if let Some(claim) = claim {
        first.push(Change::TouchProducer {
            producer: claim.producer.clone(),
            aggregate_id: message.aggregate_id.clone(),
            at: now.to_owned(),
        });
    }
    first.append(&mut plan.changes);
    plan.changes = first;
    Ok(plan)
}

/// A claim's rows: the aggregate's owner and the `claimed` event, naming the claiming message.
fn claim_changes(message: &OrderedMessage, owner: AggregateOwner, now: &str) -> [Change; 2] {
    [
        Change::SetOwner {
            aggregate_id: message.aggregate_id.clone(),
            owner: owner.clone(),
            at: now.to_owned(),
        },
        Change::Append(TimelineEntry {
            aggregate_id: message.aggregate_id.clone(),
            at: now.to_owned(),
            kind: TimelineKind::Claimed,
            sequence: Some(message.sequence),
            message_id: Some(message.message_id.clone()),
            detail: TimelineDetail::Claimed {
                producer: owner.producer,
                epoch: owner.epoch,
            },
        }),
    ]
}

/// Decides one anonymous delivery through `door`, stamping every row with `context.now`.
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) fn decide_delivery(
    message: &OrderedMessage,
    door: Door,
    facts: &DeliveryFacts,
    context: Context<'_>,
) -> DeliveryPlan {
    decide_delivery_as(None, message, door, facts, context)
}

/// Decides one delivery whose message id is in `producer`'s namespace (`None`: the anonymous
/// one). The facts about the id (`applied`, `dead_letter`, `held_message`) must be read in that
/// namespace: a message's identity is (producer, message id). Without the epoch a producer's
/// message was sent under ([`decide_producer_delivery`] has it) there is nothing to hold it
/// under, so a producer's early message is a gap here on every door.
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) fn decide_delivery_as(
    producer: Option<&str>,
    message: &OrderedMessage,
    door: Door,
    facts: &DeliveryFacts,
    context: Context<'_>,
) -> DeliveryPlan {
    decide_as(producer, None, message, door, facts, context)
}

/// [`decide_delivery_as`], with the claim a held row keeps (the producer and the epoch) when the
/// delivery has one.
fn decide_as(
    producer: Option<&str>,
    claim: Option<&ProducerClaim>,
    message: &OrderedMessage,
    door: Door,
    facts: &DeliveryFacts,
    context: Context<'_>,
) -> DeliveryPlan {
    let decision = Delivery {
        producer,
        claim,
        message,
        facts,
        payload: context.check.canonical(message),
        context,
        now: context.now,
    };
    if let Some(prior) = &facts.applied {
        let same = same_content(
            Some(&prior.payload),
            prior.aggregate_id.as_deref(),
            prior.sequence,
            message,
            &decision.payload,
        );
        return if same {
            decision.replay(prior)
        } else {
            decision.payload_conflict()
        };
    }
    if door != Door::Classroom
        && let Some(known) = &facts.dead_letter
    {
        // A dead letter from before its payload was stored cannot prove it is the same message,
        // so it counts as a conflict: the id must not acquire a second meaning.
        return if decision.is_known(known) {
            decision.quarantined_again(known)
        } else {
            decision.payload_conflict()
        };
    }
    if door != Door::Classroom
        && let Some(held) = &facts.held_message
    {
        let same = same_content(
            Some(&held.payload),
            Some(&held.message.aggregate_id),
            Some(held.message.sequence),
            message,
            &decision.payload,
        );
        if !same {
            return decision.payload_conflict();
        }
        if door == Door::Broker {
            return decision.held_again();
        }
        // The general door answers a held message as any early one: a gap.
    }
    match decide(decision.before_last(), message, context.check) {
        // A held row keeps its producer and epoch, so that the drain applies it as that producer
        // after checking its admission again; a producer's message without its epoch is a gap.
        Decision::Gap { expected } if door == Door::Broker && decision.may_hold() => {
            decision.hold(expected)
        }
        Decision::Gap { expected } => decision.gap(door, expected),
        Decision::Stale { expected } => decision.stale(expected),
        Decision::Quarantine { expected, poison } => decision.quarantine(expected, poison),
        Decision::Apply { sequence } => decision.apply(sequence),
    }
}

/// One delivery being decided: the message, what is known, and the shared stamps.
struct Delivery<'a> {
    /// The namespace of the message's id (`None`: anonymous).
    producer: Option<&'a str>,
    /// The producer's claim, when the delivery carries one: a held row keeps it.
    claim: Option<&'a ProducerClaim>,
    message: &'a OrderedMessage,
    facts: &'a DeliveryFacts,
    /// The message's canonical content.
    payload: String,
    context: Context<'a>,
    now: &'a str,
}

impl Delivery<'_> {
    /// Whether there is what a held row keeps: an anonymous message, or a producer's claim.
    fn may_hold(&self) -> bool {
        self.producer.is_none() || self.claim.is_some()
    }

    fn before_last(&self) -> i64 {
        self.facts.aggregate.as_ref().map_or(0, |row| row.last)
    }

    /// Whether a dead letter with this id holds this very message. One from before its payload
    /// was stored cannot prove it, so it does not.
    fn is_known(&self, known: &KnownDeadLetter) -> bool {
        same_content(
            known.payload.as_deref(),
            known.aggregate_id.as_deref(),
            known.sequence,
            self.message,
            &self.payload,
        )
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
        Change::PutAggregate {
            aggregate_id: self.message.aggregate_id.clone(),
            row: AggregateRow {
                last: self.before_last(),
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

    /// A sequence already passed: another message took it, or an operator's gap resolution
    /// skipped it (then the verdict and the observation name the resolution).
    fn stale(self, expected: i64) -> DeliveryPlan {
        let skipped_by = self.facts.skipped_by;
        let detail = match skipped_by {
            Some(skipped_by) => TimelineDetail::SkippedLate {
                expected,
                skipped_by,
            },
            None => TimelineDetail::Expected { expected },
        };
        self.observed(
            Outcome::Stale {
                expected,
                skipped_by,
            },
            TimelineKind::Stale,
            detail,
        )
    }

    fn replay(self, prior: &AppliedFact) -> DeliveryPlan {
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
        let expected = self.before_last().saturating_add(1);
        let detail = TimelineDetail::SeenAgain {
            observations,
            status: known.status,
        };
        let changes = vec![
            Change::ObserveDeadLetter {
                producer: self.producer.map(str::to_owned),
                message_id: self.message.message_id.clone(),
                observations,
                at: self.now.to_owned(),
            },
            self.entry(TimelineKind::QuarantinedAgain, detail),
        ];
        DeliveryPlan {
            outcome: Outcome::Quarantined {
                expected,
                reason: known.reason.clone(),
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
        let mut changes = Vec::with_capacity(3);
        if marks_waiting {
            changes.push(self.put_status(AggregateStatus::Waiting));
        }
        changes.push(self.entry(TimelineKind::Gap, TimelineDetail::Expected { expected }));
        // What is missing is told from the lowest sequence refused ahead of it.
        changes.push(Change::NoteGap {
            aggregate_id: self.message.aggregate_id.clone(),
            last: self.before_last(),
            sequence: self.message.sequence,
        });
        DeliveryPlan {
            outcome: Outcome::Gap { expected },
            changes,
        }
    }

    /// A held message delivered again: recognised, nothing new.
    fn held_again(self) -> DeliveryPlan {
        let expected = self.before_last().saturating_add(1);
        DeliveryPlan {
            outcome: Outcome::Held {
                expected,
                held: self.facts.held.len(),
                repeated: true,
            },
            changes: Vec::new(),
        }
    }

    /// Holds a message ahead of its turn, unless its sequence is already held (the first held
    /// wins: this one is stale) or the aggregate holds the most it may.
    fn hold(self, expected: i64) -> DeliveryPlan {
        let sequence = self.message.sequence;
        if self
            .facts
            .held
            .iter()
            .any(|held| held.message.sequence == sequence)
        {
            return self.observed(
                Outcome::Stale {
                    expected,
                    skipped_by: None,
                },
                TimelineKind::Stale,
                TimelineDetail::Expected { expected },
            );
        }
        let count = self.facts.held.len();
        let limit = self.context.limits.max_held_per_aggregate;
        if count >= limit {
            return self.observed(
                Outcome::HoldFull {
                    expected,
                    held: count,
                    limit,
                },
                TimelineKind::HoldFull,
                TimelineDetail::HoldFull { held: count, limit },
            );
        }
        let held = count.saturating_add(1);
        let mut changes = Vec::with_capacity(3);
        if matches!(self.status(), None | Some(AggregateStatus::Flowing)) {
            changes.push(self.put_status(AggregateStatus::Waiting));
        }
        changes.push(Change::InsertHeld {
            claim: self.claim.cloned(),
            message: self.message.clone(),
            payload: self.payload.clone(),
            at: self.now.to_owned(),
        });
        changes.push(self.entry(TimelineKind::Held, TimelineDetail::Held { expected, held }));
        DeliveryPlan {
            outcome: Outcome::Held {
                expected,
                held,
                repeated: false,
            },
            changes,
        }
    }

    /// Records a poison message at the expected sequence. The aggregate does not advance; it is
    /// blocked until a valid message takes the sequence or an operator resolves the dead letter.
    fn quarantine(self, expected: i64, poison: Poison) -> DeliveryPlan {
        let open = self.facts.open_dead_letters.len();
        let limit = self.context.limits.max_open_dead_letters;
        let Poison { reason, detail } = poison;
        if self.facts.dead_letter.is_none() && open >= limit {
            let outcome = Outcome::QuarantineFull {
                expected,
                open,
                limit,
                reason,
            };
            let detail = TimelineDetail::QuarantineFull {
                open_dead_letters: open,
                limit,
            };
            return self.observed(outcome, TimelineKind::QuarantineFull, detail);
        }
        let mut changes = Vec::with_capacity(3);
        // As in the seed, the aggregate's row exists from its first quarantine on, still at its
        // old last sequence.
        if self.status() != Some(AggregateStatus::Blocked) {
            changes.push(self.put_status(AggregateStatus::Blocked));
        }
        if crate::planted::active(crate::planted::Bug::AdvanceOnQuarantine) {
            changes.push(Change::PutAggregate {
                aggregate_id: self.message.aggregate_id.clone(),
                row: AggregateRow {
                    last: expected,
                    status: AggregateStatus::Flowing,
                    since: Some(self.now.to_owned()),
                },
            });
        }
        let note = self.record_dead_letter(&reason, &mut changes);
        changes.push(self.quarantined_entry(note, &reason, detail));
        DeliveryPlan {
            outcome: Outcome::Quarantined {
                expected,
                reason,
                dead_letter: note,
            },
            changes,
        }
    }

    /// The dead letter of a quarantine: a new one, or the known one seen again. The classroom
    /// door may deliver a quarantined id again (its identity rule only knows applied messages);
    /// like the seed it keeps one row, counting the repeat if the content matches. `None`: the
    /// id is a dead letter of other content, and nothing is counted.
    fn record_dead_letter(
        &self,
        reason: &QuarantineReason,
        changes: &mut Vec<Change>,
    ) -> Option<DeadLetterNote> {
        match &self.facts.dead_letter {
            None => {
                changes.push(Change::InsertDeadLetter {
                    producer: self.producer.map(str::to_owned),
                    message: self.message.clone(),
                    payload: self.payload.clone(),
                    reason: reason.clone(),
                    at: self.now.to_owned(),
                });
                Some(DeadLetterNote {
                    status: DeadLetterStatus::Open,
                    observations: 1,
                })
            }
            Some(known) if self.is_known(known) => {
                let observations = known.observations.saturating_add(1);
                changes.push(Change::ObserveDeadLetter {
                    producer: self.producer.map(str::to_owned),
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
        }
    }

    /// The timeline's entry of a quarantine: the first sighting with its reason and the
    /// handler's detail, or a repeat with its count.
    fn quarantined_entry(
        &self,
        note: Option<DeadLetterNote>,
        reason: &QuarantineReason,
        detail: Detail,
    ) -> Change {
        match note {
            Some(note) if note.observations == 1 => self.entry(
                TimelineKind::Quarantined,
                TimelineDetail::Quarantined {
                    reason: reason.clone(),
                    detail,
                },
            ),
            _ => self.entry(
                TimelineKind::QuarantinedAgain,
                TimelineDetail::Repeated {
                    observations: note.map(|note| note.observations),
                },
            ),
        }
    }

    /// Applies the next sequence: the inbox row, the advanced state, the open dead letters at
    /// this sequence superseded by the message, and the held messages it makes next.
    fn apply(self, sequence: i64) -> DeliveryPlan {
        let since = match &self.facts.aggregate {
            Some(row) if row.status == AggregateStatus::Flowing => row.since.clone(),
            _ => Some(self.now.to_owned()),
        };
        let mut changes = vec![Change::InsertApplied {
            producer: self.producer.map(str::to_owned),
            message: self.message.clone(),
            payload: self.payload,
            applied_at: self.now.to_owned(),
        }];
        let superseded = supersede_at(
            &self.message.aggregate_id,
            sequence,
            &self.facts.open_dead_letters,
            &self.message.message_id,
            self.now,
            &mut changes,
        );
        let row = AggregateRow {
            last: sequence,
            status: AggregateStatus::Flowing,
            since,
        };
        let open: Vec<OpenDeadLetter> = self
            .facts
            .open_dead_letters
            .iter()
            .filter(|letter| !superseded.contains(&letter.message_id))
            .cloned()
            .collect();
        let start = DrainStart {
            aggregate_id: &self.message.aggregate_id,
            row,
            after: &self.message.message_id,
            held: &self.facts.held,
            open: &open,
            owner: self.facts.owner.as_ref(),
        };
        let row = drain(start, self.context, &mut changes);
        changes.push(Change::PutAggregate {
            aggregate_id: self.message.aggregate_id.clone(),
            row,
        });
        DeliveryPlan {
            outcome: Outcome::Applied {
                sequence,
                superseded,
                detail: Detail::new(),
            },
            changes,
        }
    }
}

/// Where a drain starts: the aggregate's row right after a message applied (or a skip took a
/// sequence), and what the store knows of its held messages and open dead letters.
pub(crate) struct DrainStart<'a> {
    pub aggregate_id: &'a str,
    pub row: AggregateRow,
    /// The message (or skipped dead letter) whose sequence came last.
    pub after: &'a str,
    pub held: &'a [HeldMessage],
    pub open: &'a [OpenDeadLetter],
    /// The aggregate's owner, against which each held message is admitted.
    pub owner: Option<&'a AggregateOwner>,
}

/// Releases the held messages that have become next, in sequence order, each through the
/// ordinary policy: a valid one applies, a poison one is quarantined (it blocks the aggregate and
/// stops the drain). Each is applied as the producer that delivered it (its rows in that
/// producer's namespace, or the anonymous one), whoever's delivery drains it, and each must pass
/// the admission its own delivery would pass now: the producer still active, its epoch still
/// current, the aggregate still its own (or, anonymous, still unowned).
///
/// First, every held message that can never apply is rejected ([`still_held`]). Returns the
/// aggregate's row afterwards: blocked after a poison, waiting while messages stay held behind a
/// gap, flowing otherwise. The caller writes it.
pub(crate) fn drain(
    start: DrainStart<'_>,
    context: Context<'_>,
    changes: &mut Vec<Change>,
) -> AggregateRow {
    let now = context.now;
    let DrainStart {
        aggregate_id,
        row,
        after,
        held,
        open,
        owner,
    } = start;
    let ordered = still_held(held, owner, row.last, now, changes);
    let mut drain = Draining {
        aggregate_id,
        now,
        row,
        open: open.to_vec(),
        after: after.to_owned(),
        released: 0,
    };
    for next in &ordered {
        match decide(drain.row.last, &next.message, context.check) {
            Decision::Apply { sequence } => drain.apply(next, sequence, changes),
            Decision::Quarantine { poison, .. }
                if drain.open.len() < context.limits.max_open_dead_letters =>
            {
                drain.quarantine(next, poison, changes);
                return drain.row;
            }
            // A gap ends the drain; so does a poison message the full quarantine cannot take
            // (it stays held, and the aggregate waits).
            _ => break,
        }
    }
    let mut row = drain.row;
    if ordered.len() > drain.released && row.status != AggregateStatus::Waiting {
        row.status = AggregateStatus::Waiting;
        row.since = Some(now.to_owned());
    }
    row
}

/// A drain under way: the aggregate's row as the released messages leave it, its open dead
/// letters, the message whose sequence came last and how many were released.
struct Draining<'a> {
    aggregate_id: &'a str,
    now: &'a str,
    row: AggregateRow,
    open: Vec<OpenDeadLetter>,
    after: String,
    released: usize,
}

impl Draining<'_> {
    /// A timeline entry of the aggregate about the held message `held`.
    fn entry(&self, kind: TimelineKind, held: &HeldMessage, detail: TimelineDetail) -> Change {
        Change::Append(TimelineEntry {
            aggregate_id: self.aggregate_id.to_owned(),
            at: self.now.to_owned(),
            kind,
            sequence: Some(held.message.sequence),
            message_id: Some(held.message.message_id.clone()),
            detail,
        })
    }

    /// Releases `next` from the held set, with its `drained` entry.
    fn release(&self, next: &HeldMessage, changes: &mut Vec<Change>) {
        changes.push(Change::ReleaseHeld {
            producer: next.producer().map(str::to_owned),
            message_id: next.message.message_id.clone(),
        });
        changes.push(self.entry(
            TimelineKind::Drained,
            next,
            TimelineDetail::Drained {
                held_at: next.held_at.clone(),
                after: self.after.clone(),
            },
        ));
    }

    /// Applies `next` at `sequence`: it supersedes the open dead letters at that sequence.
    fn apply(&mut self, next: &HeldMessage, sequence: i64, changes: &mut Vec<Change>) {
        let message = &next.message;
        self.release(next, changes);
        changes.push(Change::InsertApplied {
            producer: next.producer().map(str::to_owned),
            message: message.clone(),
            payload: next.payload.clone(),
            applied_at: self.now.to_owned(),
        });
        let superseded = supersede_at(
            self.aggregate_id,
            sequence,
            &self.open,
            &message.message_id,
            self.now,
            changes,
        );
        self.open
            .retain(|letter| !superseded.contains(&letter.message_id));
        self.row.last = sequence;
        self.after = message.message_id.clone();
        self.released += 1;
    }

    /// Quarantines `next`, a poison: a dead letter that blocks the aggregate and ends the drain.
    fn quarantine(&mut self, next: &HeldMessage, poison: Poison, changes: &mut Vec<Change>) {
        self.release(next, changes);
        changes.push(Change::InsertDeadLetter {
            producer: next.producer().map(str::to_owned),
            message: next.message.clone(),
            payload: next.payload.clone(),
            reason: poison.reason.clone(),
            at: self.now.to_owned(),
        });
        changes.push(self.entry(
            TimelineKind::Quarantined,
            next,
            TimelineDetail::Quarantined {
                reason: poison.reason,
                detail: poison.detail,
            },
        ));
        self.row.status = AggregateStatus::Blocked;
        self.row.since = Some(self.now.to_owned());
    }
}

/// The held messages that may still drain after `last`, in sequence order. The others are
/// rejected: one whose sequence is at or below `last` (another message took it while it was
/// held), and one whose admission refuses it now ([`admit_held`]: its producer revoked or fenced,
/// the aggregate another's, or owned while it is anonymous).
fn still_held<'a>(
    held: &'a [HeldMessage],
    owner: Option<&AggregateOwner>,
    last: i64,
    now: &str,
    changes: &mut Vec<Change>,
) -> Vec<&'a HeldMessage> {
    let mut ordered: Vec<&HeldMessage> = held.iter().collect();
    ordered.sort_by_key(|held| held.message.sequence);
    if crate::planted::active(crate::planted::Bug::DrainOutOfOrder) {
        ordered.reverse();
    }
    let mut admissible = Vec::with_capacity(ordered.len());
    for next in ordered {
        let why = if next.message.sequence <= last {
            HeldRejection::Stale {
                expected: last.saturating_add(1),
            }
        } else if let Err(refusal) = admit_held(next, owner) {
            HeldRejection::Refused(refusal)
        } else {
            admissible.push(next);
            continue;
        };
        reject_held(next, &why, now, changes);
    }
    admissible
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
        aggregate_id: aggregate_id.to_owned(),
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
    use crate::content::canonical_json;
    use crate::policy::tests::{NoNegativeQuantity, order as message};

    const LIMITS: Limits = Limits {
        max_open_dead_letters: 1000,
        max_held_per_aggregate: 1000,
    };

    /// The tests' context: the default limits unless given, the tests' check, time `t1`.
    fn within(limits: &Limits) -> Context<'_> {
        Context {
            limits,
            check: &NoNegativeQuantity,
            now: "t1",
        }
    }

    fn context() -> Context<'static> {
        within(&LIMITS)
    }

    fn canonical(message: &OrderedMessage) -> String {
        canonical_json(&message.payload)
    }

    fn poisoned() -> QuarantineReason {
        QuarantineReason::new("negative quantity")
    }

    fn at(last: i64, status: AggregateStatus) -> Option<AggregateRow> {
        Some(AggregateRow {
            last,
            status,
            since: Some("t0".into()),
        })
    }

    fn decide_general(message: &OrderedMessage, facts: &DeliveryFacts) -> DeliveryPlan {
        decide_delivery(message, Door::General, facts, context())
    }

    /// The timeline events the plan records, in order (an applied message carries its own).
    fn kinds(plan: &DeliveryPlan) -> Vec<TimelineKind> {
        plan.changes
            .iter()
            .filter_map(|change| match change {
                Change::Append(entry) => Some(entry.kind),
                Change::InsertApplied { .. } => Some(TimelineKind::Applied),
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
                superseded: vec![],
                detail: Detail::new(),
            }
        );
        let row = put_row(&plan).unwrap();
        assert_eq!((row.last, row.status), (1, AggregateStatus::Flowing));
        assert_eq!(row.since.as_deref(), Some("t1"));
        assert_eq!(kinds(&plan), [TimelineKind::Applied]);
    }

    #[test]
    fn a_flowing_aggregate_keeps_the_time_it_started_flowing() {
        let facts = DeliveryFacts {
            aggregate: at(1, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_general(&message("m-2", 2, 1), &facts);
        assert_eq!(put_row(&plan).unwrap().since.as_deref(), Some("t0"));
    }

    #[test]
    fn a_replay_writes_nothing_and_reports_the_original() {
        let facts = DeliveryFacts {
            applied: Some(AppliedFact {
                aggregate_id: None,
                payload: canonical(&message("m-1", 1, 5)),
                sequence: Some(1),
                applied_at: Some("t0".into()),
            }),
            aggregate: at(3, AggregateStatus::Flowing),
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
            context(),
        );
        assert!(put_row(&classroom).is_none());
        let blocked = DeliveryFacts {
            aggregate: at(1, AggregateStatus::Blocked),
            ..Default::default()
        };
        let plan = decide_general(&message("m-3", 3, 1), &blocked);
        assert!(
            put_row(&plan).is_none(),
            "a blocked aggregate stays blocked"
        );
    }

    #[test]
    fn a_producers_broker_message_ahead_of_its_turn_is_held_under_its_producer_and_epoch() {
        use crate::facts::ProducerFact;
        let claim = ProducerClaim {
            producer: "billing".into(),
            epoch: 1,
        };
        let owned = OwnershipFacts {
            producer: Some(ProducerFact {
                current_epoch: 1,
                active: true,
            }),
            owner: Some(AggregateOwner {
                producer: "billing".into(),
                epoch: 1,
            }),
            history: true,
        };
        let facts = DeliveryFacts {
            aggregate: at(1, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_producer_delivery(
            &message("m-3", 3, 1),
            Door::Broker,
            Some(&claim),
            &owned,
            &facts,
            context(),
        )
        .unwrap();
        assert!(matches!(plan.outcome, Outcome::Held { expected: 2, .. }));
        assert!(
            plan.changes.iter().any(|change| matches!(
                change,
                Change::InsertHeld { claim: Some(held), .. } if *held == claim
            )),
            "{:?}",
            plan.changes
        );
        // The same message anonymously (to an unowned aggregate) is held with no claim.
        let anonymous = decide_broker(&message("m-3", 3, 1), &facts);
        assert!(matches!(anonymous.outcome, Outcome::Held { .. }));
        assert!(
            anonymous
                .changes
                .iter()
                .any(|change| matches!(change, Change::InsertHeld { claim: None, .. }))
        );
        // Through the general door, or without the epoch it was sent under, it is a gap.
        let general = decide_producer_delivery(
            &message("m-3", 3, 1),
            Door::General,
            Some(&claim),
            &owned,
            &facts,
            context(),
        )
        .unwrap();
        assert_eq!(general.outcome, Outcome::Gap { expected: 2 });
        let unclaimed = decide_delivery_as(
            Some("billing"),
            &message("m-3", 3, 1),
            Door::Broker,
            &facts,
            context(),
        );
        assert_eq!(unclaimed.outcome, Outcome::Gap { expected: 2 });
    }

    #[test]
    fn a_claiming_delivery_records_its_owner_first_and_a_refused_one_writes_nothing() {
        use crate::facts::ProducerFact;
        let claim = ProducerClaim {
            producer: "billing".into(),
            epoch: 2,
        };
        let fresh = OwnershipFacts {
            producer: Some(ProducerFact {
                current_epoch: 2,
                active: true,
            }),
            owner: None,
            history: false,
        };
        let plan = decide_producer_delivery(
            &message("m-1", 1, 5),
            Door::General,
            Some(&claim),
            &fresh,
            &DeliveryFacts::default(),
            context(),
        )
        .unwrap();
        assert!(matches!(plan.outcome, Outcome::Applied { sequence: 1, .. }));
        assert!(matches!(
            &plan.changes[0],
            Change::SetOwner { owner, .. } if owner.producer == "billing" && owner.epoch == 2
        ));
        assert!(matches!(&plan.changes[2], Change::TouchProducer { .. }));
        assert_eq!(kinds(&plan), [TimelineKind::Claimed, TimelineKind::Applied]);
        let fenced = OwnershipFacts {
            producer: Some(ProducerFact {
                current_epoch: 3,
                active: true,
            }),
            ..fresh
        };
        assert_eq!(
            decide_producer_delivery(
                &message("m-1", 1, 5),
                Door::General,
                Some(&claim),
                &fenced,
                &DeliveryFacts::default(),
                context()
            ),
            Err(ProducerRefusal::Fenced {
                offered: 2,
                current_epoch: 3
            })
        );
        // Anonymous to an unowned aggregate: exactly the plain decision.
        let anonymous = decide_producer_delivery(
            &message("m-1", 1, 5),
            Door::General,
            None,
            &OwnershipFacts::default(),
            &DeliveryFacts::default(),
            context(),
        );
        assert_eq!(
            anonymous,
            Ok(decide_general(
                &message("m-1", 1, 5),
                &DeliveryFacts::default()
            ))
        );
    }

    /// billing's delivery, under its current epoch 1, to an aggregate without owner or history.
    fn billing_to_a_fresh_aggregate(
        message: &OrderedMessage,
        door: Door,
        facts: &DeliveryFacts,
        limits: &Limits,
    ) -> DeliveryPlan {
        use crate::facts::ProducerFact;
        let fresh = OwnershipFacts {
            producer: Some(ProducerFact {
                current_epoch: 1,
                active: true,
            }),
            owner: None,
            history: false,
        };
        let claim = ProducerClaim {
            producer: "billing".into(),
            epoch: 1,
        };
        decide_producer_delivery(message, door, Some(&claim), &fresh, facts, within(limits))
            .unwrap()
    }

    fn touched_only(plan: &DeliveryPlan) -> bool {
        matches!(
            plan.changes.as_slice(),
            [Change::TouchProducer { producer, aggregate_id, .. }]
                if producer == "billing" && aggregate_id == "a"
        )
    }

    #[test]
    fn a_refused_delivery_to_a_fresh_aggregate_claims_nothing_and_leaves_it_without_history() {
        let gap = billing_to_a_fresh_aggregate(
            &message("m-3", 3, 1),
            Door::General,
            &Default::default(),
            &Limits::default(),
        );
        assert_eq!(gap.outcome, Outcome::Gap { expected: 1 });
        assert!(touched_only(&gap), "{:?}", gap.changes);
        // Through the broker door the same message is held, which records it: it claims.
        let held = billing_to_a_fresh_aggregate(
            &message("m-3", 3, 1),
            Door::Broker,
            &Default::default(),
            &Limits::default(),
        );
        assert!(matches!(held.outcome, Outcome::Held { expected: 1, .. }));
        assert!(
            matches!(held.changes.first(), Some(Change::SetOwner { .. })),
            "{:?}",
            held.changes
        );
        // billing's m-1 was applied to another aggregate: here it is a payload conflict.
        let elsewhere = DeliveryFacts {
            applied: Some(AppliedFact {
                aggregate_id: Some("b".into()),
                payload: canonical(&message("m-1", 1, 1)),
                sequence: Some(1),
                applied_at: Some("t0".into()),
            }),
            ..Default::default()
        };
        let conflict = billing_to_a_fresh_aggregate(
            &message("m-1", 1, 1),
            Door::General,
            &elsewhere,
            &Limits::default(),
        );
        assert_eq!(conflict.outcome, Outcome::PayloadConflict);
        assert!(touched_only(&conflict), "{:?}", conflict.changes);
        // A full quarantine refuses the poison message: nothing recorded, nothing claimed.
        let no_room = Limits {
            max_open_dead_letters: 0,
            ..Limits::default()
        };
        let full = billing_to_a_fresh_aggregate(
            &message("p-1", 1, -1),
            Door::General,
            &DeliveryFacts::default(),
            &no_room,
        );
        assert!(matches!(full.outcome, Outcome::QuarantineFull { .. }));
        assert!(touched_only(&full), "{:?}", full.changes);
    }

    #[test]
    fn a_quarantined_delivery_to_a_fresh_aggregate_claims_it_and_records_its_dead_letter() {
        let plan = billing_to_a_fresh_aggregate(
            &message("p-1", 1, -1),
            Door::General,
            &Default::default(),
            &Limits::default(),
        );
        assert!(matches!(plan.outcome, Outcome::Quarantined { .. }));
        assert!(matches!(
            &plan.changes[0],
            Change::SetOwner { owner, .. } if owner.producer == "billing" && owner.epoch == 1
        ));
        assert_eq!(
            kinds(&plan),
            [TimelineKind::Claimed, TimelineKind::Quarantined]
        );
        assert!(plan.changes.iter().any(|change| matches!(
            change,
            Change::InsertDeadLetter { producer: Some(producer), .. } if producer == "billing"
        )));
    }

    #[test]
    fn only_an_applied_quarantined_or_held_message_is_recorded() {
        let recorded = [
            Outcome::Applied {
                sequence: 1,
                superseded: Vec::new(),
                detail: Detail::new(),
            },
            Outcome::Quarantined {
                expected: 1,
                reason: poisoned(),
                dead_letter: None,
            },
            Outcome::Held {
                expected: 1,
                held: 1,
                repeated: false,
            },
        ];
        let refused = [
            Outcome::Replay {
                original: AppliedRecord {
                    sequence: 1,
                    applied_at: None,
                },
            },
            Outcome::PayloadConflict,
            Outcome::Gap { expected: 1 },
            Outcome::Stale {
                expected: 2,
                skipped_by: None,
            },
            Outcome::QuarantineFull {
                expected: 1,
                open: 1,
                limit: 1,
                reason: poisoned(),
            },
            Outcome::HoldFull {
                expected: 1,
                held: 1,
                limit: 1,
            },
        ];
        assert!(recorded.iter().all(Outcome::records_the_message));
        assert!(!refused.iter().any(Outcome::records_the_message));
    }

    #[test]
    fn a_stale_sequence_is_only_observed() {
        let facts = DeliveryFacts {
            aggregate: at(2, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_general(&message("late", 1, 1), &facts);
        assert_eq!(
            plan.outcome,
            Outcome::Stale {
                expected: 3,
                skipped_by: None
            }
        );
        assert_eq!(kinds(&plan), [TimelineKind::Stale]);
        assert_eq!(plan.changes.len(), 1);
    }

    #[test]
    fn a_poison_message_blocks_without_advancing() {
        let facts = DeliveryFacts {
            aggregate: at(1, AggregateStatus::Flowing),
            ..Default::default()
        };
        let plan = decide_general(&message("p", 2, -1), &facts);
        assert_eq!(
            plan.outcome,
            Outcome::Quarantined {
                expected: 2,
                reason: poisoned(),
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
            payload: Some(canonical(&message("p", 1, -1))),
            aggregate_id: Some("a".into()),
            sequence: Some(1),
            reason: poisoned(),
            status,
            observations: 1,
        }
    }

    #[test]
    fn identity_spans_dead_letters_only_at_the_general_door() {
        let facts = DeliveryFacts {
            dead_letter: Some(known_poison(DeadLetterStatus::Open)),
            aggregate: at(0, AggregateStatus::Blocked),
            open_dead_letters: vec![OpenDeadLetter {
                producer: None,
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
                reason: poisoned(),
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
        let classroom = decide_delivery(&message("p", 1, 1), Door::Classroom, &facts, context());
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
            aggregate: at(0, AggregateStatus::Blocked),
            ..Default::default()
        };
        let classroom = |m: &OrderedMessage| decide_delivery(m, Door::Classroom, &facts, context());
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
            aggregate: at(0, AggregateStatus::Blocked),
            open_dead_letters: vec![
                OpenDeadLetter {
                    producer: None,
                    message_id: "p".into(),
                    sequence: Some(1),
                },
                OpenDeadLetter {
                    producer: None,
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
                superseded: vec!["p".into()],
                detail: Detail::new(),
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
            ..Limits::default()
        };
        let open: Vec<OpenDeadLetter> = ["p", "q"]
            .into_iter()
            .map(|id| OpenDeadLetter {
                producer: None,
                message_id: id.into(),
                sequence: Some(1),
            })
            .collect();
        let facts = DeliveryFacts {
            aggregate: at(0, AggregateStatus::Blocked),
            open_dead_letters: open,
            ..Default::default()
        };
        let refused = decide_delivery(&message("r", 1, -1), Door::General, &facts, within(&limits));
        assert_eq!(
            refused.outcome,
            Outcome::QuarantineFull {
                expected: 1,
                open: 2,
                limit: 2,
                reason: poisoned(),
            }
        );
        assert_eq!(kinds(&refused), [TimelineKind::QuarantineFull]);
        assert_eq!(refused.changes.len(), 1, "nothing but one observation");
        let known = DeliveryFacts {
            dead_letter: Some(known_poison(DeadLetterStatus::Open)),
            ..facts
        };
        let again = decide_delivery(&message("p", 1, -1), Door::General, &known, within(&limits));
        assert!(matches!(again.outcome, Outcome::Quarantined { .. }));
    }

    #[test]
    fn a_producers_rows_carry_its_namespace_and_drained_held_messages_stay_anonymous() {
        let facts = DeliveryFacts {
            aggregate: at(0, AggregateStatus::Waiting),
            held: vec![held("m-2", 2, 1), held("bad-3", 3, -1)],
            ..DeliveryFacts::default()
        };
        let plan = decide_delivery_as(
            Some("billing"),
            &message("m-1", 1, 1),
            Door::General,
            &facts,
            context(),
        );
        let namespaces: Vec<(&str, Option<&str>)> = plan
            .changes
            .iter()
            .filter_map(|change| match change {
                Change::InsertApplied {
                    producer, message, ..
                }
                | Change::InsertDeadLetter {
                    producer, message, ..
                } => Some((message.message_id.as_str(), producer.as_deref())),
                _ => None,
            })
            .collect();
        assert_eq!(
            namespaces,
            [("m-1", Some("billing")), ("m-2", None), ("bad-3", None)]
        );
        let known = DeliveryFacts {
            dead_letter: Some(known_poison(DeadLetterStatus::Open)),
            ..DeliveryFacts::default()
        };
        let again = decide_delivery_as(
            Some("billing"),
            &message("p", 1, -1),
            Door::General,
            &known,
            context(),
        );
        assert!(again.changes.iter().any(|change| matches!(
            change,
            Change::ObserveDeadLetter { producer: Some(p), .. } if p == "billing"
        )));
    }

    /// A message billing held under `epoch`, billing's row now at `current_epoch`.
    fn held_by_billing(
        id: &str,
        sequence: i64,
        epoch: i64,
        current_epoch: i64,
        active: bool,
    ) -> HeldMessage {
        use crate::facts::ProducerFact;
        HeldMessage {
            claim: Some(ProducerClaim {
                producer: "billing".into(),
                epoch,
            }),
            producer_now: Some(ProducerFact {
                current_epoch,
                active,
            }),
            ..held(id, sequence, 1)
        }
    }

    #[test]
    fn a_drain_applies_a_producers_held_message_as_that_producer_after_admitting_it_again() {
        let billing = AggregateOwner {
            producer: "billing".into(),
            epoch: 2,
        };
        let facts = DeliveryFacts {
            aggregate: at(0, AggregateStatus::Waiting),
            held: vec![held_by_billing("m-2", 2, 2, 2, true)],
            owner: Some(billing.clone()),
            ..DeliveryFacts::default()
        };
        let plan = decide_broker(&message("m-1", 1, 1), &facts);
        assert_eq!(applied_ids(&plan), ["m-1", "m-2"]);
        assert!(plan.changes.iter().any(|change| matches!(
            change,
            Change::InsertApplied { producer: Some(p), message, .. }
                if p == "billing" && message.message_id == "m-2"
        )));
        assert!(plan.changes.iter().any(|change| matches!(
            change,
            Change::ReleaseHeld { producer: Some(p), message_id } if p == "billing" && message_id == "m-2"
        )));
        // Sent under epoch 1 while billing is at 2: fenced. Billing revoked: refused. Another
        // producer's, or an anonymous one, on billing's aggregate: refused. None applies.
        for (stale, outcome) in [
            (held_by_billing("m-2", 2, 1, 2, true), "fenced"),
            (held_by_billing("m-2", 2, 2, 2, false), "unauthorized"),
            (held("x-2", 2, 1), "owner required"),
        ] {
            let facts = DeliveryFacts {
                held: vec![stale],
                ..facts.clone()
            };
            let plan = decide_broker(&message("m-1", 1, 1), &facts);
            assert_eq!(applied_ids(&plan), ["m-1"]);
            assert_eq!(rejected_outcomes(&plan).len(), 1, "{:?}", plan.changes);
            assert_eq!(rejected_outcomes(&plan)[0].1, outcome);
        }
        let shipping = DeliveryFacts {
            owner: Some(AggregateOwner {
                producer: "shipping".into(),
                epoch: 1,
            }),
            ..facts
        };
        let plan = decide_broker(&message("s-1", 1, 1), &shipping);
        assert_eq!(rejected_outcomes(&plan)[0].1, "not the owner");
        assert_eq!(applied_ids(&plan), ["s-1"]);
    }

    fn held(id: &str, sequence: i64, quantity: i64) -> HeldMessage {
        let message = message(id, sequence, quantity);
        HeldMessage {
            payload: canonical(&message),
            message,
            held_at: "t0".into(),
            claim: None,
            producer_now: None,
        }
    }

    fn decide_broker(message: &OrderedMessage, facts: &DeliveryFacts) -> DeliveryPlan {
        decide_delivery(message, Door::Broker, facts, context())
    }

    fn released(plan: &DeliveryPlan) -> Vec<String> {
        plan.changes
            .iter()
            .filter_map(|change| match change {
                Change::ReleaseHeld { message_id, .. } => Some(message_id.clone()),
                _ => None,
            })
            .collect()
    }

    fn applied_ids(plan: &DeliveryPlan) -> Vec<String> {
        plan.changes
            .iter()
            .filter_map(|change| match change {
                Change::InsertApplied { message, .. } => Some(message.message_id.clone()),
                _ => None,
            })
            .collect()
    }

    /// The last aggregate row the plan writes (the one that stands after the transaction).
    fn final_row(plan: &DeliveryPlan) -> Option<&AggregateRow> {
        plan.changes.iter().rev().find_map(|change| match change {
            Change::PutAggregate { row, .. } => Some(row),
            _ => None,
        })
    }

    #[test]
    fn the_broker_door_holds_a_message_ahead_of_its_turn() {
        let plan = decide_broker(&message("m-3", 3, 1), &DeliveryFacts::default());
        assert_eq!(
            plan.outcome,
            Outcome::Held {
                expected: 1,
                held: 1,
                repeated: false
            }
        );
        assert_eq!(put_row(&plan).unwrap().status, AggregateStatus::Waiting);
        assert!(plan.changes.iter().any(|change| matches!(
            change,
            Change::InsertHeld { message, at, .. } if message.message_id == "m-3" && at == "t1"
        )));
        assert_eq!(kinds(&plan), [TimelineKind::Held]);
        // The general door keeps its contract: a gap, nothing held.
        let general = decide_general(&message("m-3", 3, 1), &DeliveryFacts::default());
        assert_eq!(general.outcome, Outcome::Gap { expected: 1 });
        // A blocked aggregate stays blocked while it holds successors.
        let blocked = DeliveryFacts {
            aggregate: at(1, AggregateStatus::Blocked),
            ..Default::default()
        };
        let plan = decide_broker(&message("m-3", 3, 1), &blocked);
        assert!(matches!(plan.outcome, Outcome::Held { expected: 2, .. }));
        assert!(put_row(&plan).is_none());
    }

    #[test]
    fn a_held_id_is_recognised_and_its_sequence_belongs_to_the_first_held() {
        let facts = DeliveryFacts {
            aggregate: at(1, AggregateStatus::Waiting),
            held_message: Some(held("m-3", 3, 1)),
            held: vec![held("m-3", 3, 1)],
            ..Default::default()
        };
        let again = decide_broker(&message("m-3", 3, 1), &facts);
        assert_eq!(
            again.outcome,
            Outcome::Held {
                expected: 2,
                held: 1,
                repeated: true
            }
        );
        assert!(again.changes.is_empty(), "nothing new");
        let changed = decide_broker(&message("m-3", 3, 2), &facts);
        assert_eq!(changed.outcome, Outcome::PayloadConflict);
        // The general door sees the same identity, and answers the early message as a gap.
        assert_eq!(
            decide_general(&message("m-3", 3, 2), &facts).outcome,
            Outcome::PayloadConflict
        );
        assert_eq!(
            decide_general(&message("m-3", 3, 1), &facts).outcome,
            Outcome::Gap { expected: 2 }
        );
        let other = DeliveryFacts {
            held_message: None,
            ..facts
        };
        let rival = decide_broker(&message("other-3", 3, 1), &other);
        assert_eq!(
            rival.outcome,
            Outcome::Stale {
                expected: 2,
                skipped_by: None
            }
        );
        assert_eq!(kinds(&rival), [TimelineKind::Stale]);
        assert_eq!(rival.changes.len(), 1, "only an observation");
    }

    #[test]
    fn holding_is_bounded_per_aggregate() {
        let limits = Limits {
            max_held_per_aggregate: 2,
            ..Limits::default()
        };
        let facts = DeliveryFacts {
            aggregate: at(0, AggregateStatus::Waiting),
            held: vec![held("m-2", 2, 1), held("m-3", 3, 1)],
            ..Default::default()
        };
        let plan = decide_delivery(&message("m-4", 4, 1), Door::Broker, &facts, within(&limits));
        assert_eq!(
            plan.outcome,
            Outcome::HoldFull {
                expected: 1,
                held: 2,
                limit: 2
            }
        );
        assert_eq!(kinds(&plan), [TimelineKind::HoldFull]);
        assert_eq!(plan.changes.len(), 1, "only an observation");
    }

    #[test]
    fn the_missing_predecessor_drains_held_successors_in_order() {
        let facts = DeliveryFacts {
            aggregate: at(0, AggregateStatus::Waiting),
            // Stored order is not trusted: the drain sorts by sequence.
            held: vec![held("m-3", 3, 3), held("m-2", 2, 2), held("m-5", 5, 5)],
            ..Default::default()
        };
        for door in [Door::Broker, Door::General] {
            let plan = decide_delivery(&message("m-1", 1, 1), door, &facts, context());
            assert_eq!(
                plan.outcome,
                Outcome::Applied {
                    sequence: 1,
                    superseded: vec![],
                    detail: Detail::new(),
                }
            );
            assert_eq!(applied_ids(&plan), ["m-1", "m-2", "m-3"]);
            assert_eq!(released(&plan), ["m-2", "m-3"]);
            let row = final_row(&plan).unwrap();
            // 5 stays held behind the gap at 4: the aggregate waits.
            assert_eq!((row.last, row.status), (3, AggregateStatus::Waiting));
            assert_eq!(
                kinds(&plan),
                [
                    TimelineKind::Applied,
                    TimelineKind::Drained,
                    TimelineKind::Applied,
                    TimelineKind::Drained,
                    TimelineKind::Applied
                ]
            );
        }
        let everything = DeliveryFacts {
            held: vec![held("m-2", 2, 2)],
            ..facts
        };
        let row = final_row(&decide_broker(&message("m-1", 1, 1), &everything)).cloned();
        assert_eq!(
            row.map(|row| (row.last, row.status)),
            Some((2, AggregateStatus::Flowing))
        );
    }

    #[test]
    fn a_held_poison_is_quarantined_and_stops_the_drain() {
        let facts = DeliveryFacts {
            aggregate: at(0, AggregateStatus::Waiting),
            held: vec![held("m-2", 2, 2), held("bad-3", 3, -1), held("m-4", 4, 4)],
            ..Default::default()
        };
        let plan = decide_broker(&message("m-1", 1, 1), &facts);
        assert_eq!(applied_ids(&plan), ["m-1", "m-2"]);
        assert_eq!(released(&plan), ["m-2", "bad-3"], "m-4 stays held");
        assert!(plan.changes.iter().any(|change| matches!(
            change,
            Change::InsertDeadLetter { message, .. } if message.message_id == "bad-3"
        )));
        let row = final_row(&plan).unwrap();
        assert_eq!((row.last, row.status), (2, AggregateStatus::Blocked));
        assert_eq!(kinds(&plan).last(), Some(&TimelineKind::Quarantined));
    }

    fn rejected_outcomes(plan: &DeliveryPlan) -> Vec<(String, String)> {
        plan.changes
            .iter()
            .filter_map(|change| match change {
                Change::RecordRejected(entry) => Some((
                    entry.message_id.clone().unwrap_or_default(),
                    entry.outcome.clone(),
                )),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_owners_first_message_rejects_the_anonymous_held_successors_instead_of_draining_them() {
        let facts = DeliveryFacts {
            aggregate: at(0, AggregateStatus::Waiting),
            held: vec![held("x-2", 2, 2), held("x-3", 3, 3)],
            owner: Some(AggregateOwner {
                producer: "billing".into(),
                epoch: 1,
            }),
            ..Default::default()
        };
        let plan = decide_delivery_as(
            Some("billing"),
            &message("m-1", 1, 1),
            Door::General,
            &facts,
            context(),
        );
        assert_eq!(applied_ids(&plan), ["m-1"]);
        assert_eq!(released(&plan), ["x-2", "x-3"]);
        assert_eq!(
            rejected_outcomes(&plan),
            [
                ("x-2".to_owned(), "owner required".to_owned()),
                ("x-3".to_owned(), "owner required".to_owned())
            ]
        );
        assert_eq!(
            kinds(&plan),
            [
                TimelineKind::Applied,
                TimelineKind::HeldRejected,
                TimelineKind::HeldRejected
            ]
        );
        let row = final_row(&plan).unwrap();
        assert_eq!(
            (row.last, row.status),
            (1, AggregateStatus::Flowing),
            "nothing stays held"
        );
    }

    #[test]
    fn a_held_message_whose_sequence_another_message_took_is_rejected_as_stale() {
        // bad-2 stayed held (the full quarantine could not take it); g-2 took sequence 2.
        let facts = DeliveryFacts {
            aggregate: at(1, AggregateStatus::Waiting),
            held: vec![held("bad-2", 2, -1), held("m-3", 3, 3)],
            ..Default::default()
        };
        let plan = decide_general(&message("g-2", 2, 2), &facts);
        assert_eq!(applied_ids(&plan), ["g-2", "m-3"]);
        assert_eq!(released(&plan), ["bad-2", "m-3"]);
        assert_eq!(
            rejected_outcomes(&plan),
            [("bad-2".to_owned(), "stale".to_owned())]
        );
        let detail = plan.changes.iter().find_map(|change| match change {
            Change::Append(entry) if entry.kind == TimelineKind::HeldRejected => {
                entry.detail.to_json()
            }
            _ => None,
        });
        assert!(
            detail.is_some_and(|text| text.starts_with(r#"{"outcome":"stale","heldAt":"t0""#)),
            "{:?}",
            plan.changes
        );
        let row = final_row(&plan).unwrap();
        assert_eq!((row.last, row.status), (3, AggregateStatus::Flowing));
    }
}
