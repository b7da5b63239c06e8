//! The change plan: the rows a decision writes, as values. The core decides them; a backend
//! writes each one as it is, in order, in the decision's transaction.

use crate::model::{ActionKind, AggregateRow, OrderedMessage, QuarantineReason};
use crate::records::{
    AggregateOwner, GapRecord, ProducerClaim, RejectedDelivery, ResolutionRecord, SequenceRange,
    SkippedSequences, TransferRecord,
};
use crate::timeline::TimelineEntry;

/// One row change. Values are absolute (computed from the facts), so a backend writes them as
/// they are, in order; the transaction's per-aggregate serialization keeps them true.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Insert or overwrite the aggregate's row.
    PutAggregate {
        /// The aggregate.
        aggregate_id: String,
        /// Its row as it is to be.
        row: AggregateRow,
    },
    /// An applied message, its id in `producer`'s namespace (`None`: the anonymous one), with its
    /// canonical content as `payload`, and its `applied` event. The backend calls the
    /// application handler's `apply` for it first, in the same transaction, and records the
    /// event with the detail `apply` returned.
    InsertApplied {
        /// The namespace of the message id (`None`: the anonymous one).
        producer: Option<String>,
        /// The message as delivered.
        message: OrderedMessage,
        /// Its canonical content.
        payload: String,
        /// When it applied.
        applied_at: String,
    },
    /// A new dead letter, its id in `producer`'s namespace (`None`: the anonymous one).
    InsertDeadLetter {
        /// The namespace of the message id (`None`: the anonymous one).
        producer: Option<String>,
        /// The message as delivered.
        message: OrderedMessage,
        /// Its canonical content.
        payload: String,
        /// Why it is poison.
        reason: QuarantineReason,
        /// When it was quarantined.
        at: String,
    },
    /// A dead letter seen again: its count becomes `observations`.
    ObserveDeadLetter {
        /// The namespace of the message id (`None`: the anonymous one).
        producer: Option<String>,
        /// The dead letter's message id.
        message_id: String,
        /// How many times it has been seen, this time included.
        observations: i64,
        /// When it was seen again.
        at: String,
    },
    /// The aggregate's open dead letters with these ids (whatever their namespace: all of them
    /// wait for the same sequence), whose sequence `by` took.
    SupersedeDeadLetters {
        /// The aggregate.
        aggregate_id: String,
        /// The dead letters' message ids.
        message_ids: Vec<String>,
        /// The message id that took their sequence.
        by: String,
        /// When.
        at: String,
    },
    /// The dead letter an operator resolves; the audit row follows as [`Change::RecordResolution`].
    ResolveDeadLetter {
        /// The namespace of the message id (`None`: the anonymous one).
        producer: Option<String>,
        /// The dead letter's message id.
        message_id: String,
        /// When it was resolved.
        at: String,
    },
    /// Insert one held message: a plain row keyed by its producer (`claim`'s, `None`: the
    /// anonymous namespace) and `message.message_id`, with the epoch it was sent under, its
    /// aggregate, sequence, the payload as delivered, its canonical content `payload` and `at`
    /// (when it was held). At most one message is held per (aggregate, sequence); the core never
    /// asks for a second.
    InsertHeld {
        /// The producer and epoch it was delivered under (`None`: anonymous).
        claim: Option<ProducerClaim>,
        /// The message as delivered.
        message: OrderedMessage,
        /// Its canonical content.
        payload: String,
        /// When it was held.
        at: String,
    },
    /// Delete the held message row with this id in `producer`'s namespace: it was drained (applied or quarantined, which
    /// the changes that follow record; the `drained` timeline event keeps the evidence), or
    /// rejected ([`Change::RecordRejected`] and a `held rejected` event follow).
    ReleaseHeld {
        /// The namespace of the message id (`None`: the anonymous one).
        producer: Option<String>,
        /// The held message's id.
        message_id: String,
    },
    /// Insert an entry of the rejected list and prune the list to the newest
    /// [`crate::records::REJECTED_KEPT`].
    RecordRejected(RejectedDelivery),
    /// Append a timeline entry (an observation is numbered and pruned by the backend).
    Append(TimelineEntry),
    /// Insert the audit row, link it from the dead letter, and append its `resolved` event
    /// (whose detail carries the id the store assigns).
    RecordResolution(Box<ResolutionRecord>),
    /// Record `owner` as the aggregate's owner (a claim or a transfer): the aggregate's owner
    /// columns, created with the aggregate's row if it has none yet (last 0, flowing).
    SetOwner {
        /// The aggregate.
        aggregate_id: String,
        /// Its owner from now on.
        owner: AggregateOwner,
        /// When it became the owner.
        at: String,
    },
    /// Stamp the producer's last delivery time (a delivery to `aggregate_id`: a backend may keep
    /// the time per aggregate, so that one producer's deliveries to different aggregates never
    /// write the same row).
    TouchProducer {
        /// The producer.
        producer: String,
        /// The aggregate it delivered to.
        aggregate_id: String,
        /// When it delivered.
        at: String,
    },
    /// Insert the transfer's audit row (the `owner transferred` event follows as an
    /// [`Change::Append`]).
    RecordTransfer(TransferRecord),
    /// A delivery at `sequence` was refused as a gap while the aggregate's last was `last`: the
    /// backend keeps, per aggregate, the lowest such sequence since that last (a note taken at
    /// another last is replaced), from which the missing range is told ([`crate::gaps`]).
    NoteGap {
        /// The aggregate.
        aggregate_id: String,
        /// Its last applied sequence when the gap was seen.
        last: i64,
        /// The sequence delivered ahead of its turn.
        sequence: i64,
    },
    /// Insert a gap resolution's audit row and append its `gap skipped` event (whose detail
    /// carries the id the store assigns, from the same numbers as [`Change::RecordResolution`]).
    RecordGapResolution(Box<GapRecord>),
}

impl Change {
    /// The message this change applies, if it is an [`Change::InsertApplied`].
    pub fn applied_message(&self) -> Option<&OrderedMessage> {
        match self {
            Change::InsertApplied { message, .. } => Some(message),
            _ => None,
        }
    }

    /// The sequences this change's resolution skips, once the store numbered its audit row
    /// `resolution_id`: a dead letter's skip takes its sequence, a gap resolution its range; a
    /// replacement or any other change skips none.
    pub fn skipped(&self, resolution_id: i64) -> Option<SkippedSequences> {
        let (aggregate_id, range, operator, reason, at) = match self {
            Change::RecordResolution(record) if record.action == ActionKind::Skip => (
                &record.aggregate_id,
                SequenceRange {
                    from: record.sequence,
                    through: record.sequence,
                },
                &record.operator,
                &record.reason,
                &record.resolved_at,
            ),
            Change::RecordGapResolution(record) => (
                &record.aggregate_id,
                record.range,
                &record.operator,
                &record.reason,
                &record.resolved_at,
            ),
            _ => return None,
        };
        Some(SkippedSequences {
            aggregate_id: aggregate_id.clone(),
            range,
            resolution_id,
            operator: operator.clone(),
            reason: reason.clone(),
            at: at.clone(),
        })
    }

    /// Whether writing this change may skip sequences (see [`Change::skipped`]).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    fn skips(&self) -> bool {
        match self {
            Change::RecordResolution(record) => record.action == ActionKind::Skip,
            Change::RecordGapResolution(_) => true,
            _ => false,
        }
    }
}

/// A decision's outcome with the changes that record it: what a backend writes.
pub trait Plan {
    /// The changes to write, in order.
    fn changes(&self) -> &[Change];
}

/// Whether writing `changes` calls the application's handler: a change applies a message, or a
/// resolution skips sequences (the handler hears of them).
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // only the SQLite writer asks
pub fn calls_handler(changes: &[Change]) -> bool {
    changes
        .iter()
        .any(|change| change.applied_message().is_some() || change.skips())
}
