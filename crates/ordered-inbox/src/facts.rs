//! What the store knows that a decision depends on, as a backend reads it in the decision's own
//! transaction: this message id's history, the aggregate's row, its open dead letters and held
//! messages, its owner and the producer's epoch, the dead letter a resolution targets.

use crate::model::{AggregateRow, DeadLetterStatus, OrderedMessage, QuarantineReason};
use crate::records::{AggregateOwner, ProducerClaim, ResolutionRecord};

/// An applied message with this id, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedFact {
    /// The canonical content.
    pub payload: String,
    /// Unknown for rows written before the columns existed.
    pub aggregate_id: Option<String>,
    /// Unknown for rows written before the columns existed.
    pub sequence: Option<i64>,
    /// Unknown for rows written before the columns existed.
    pub applied_at: Option<String>,
}

/// A dead letter with this id, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownDeadLetter {
    /// Unknown for dead letters recorded before payloads were kept.
    pub payload: Option<String>,
    /// Unknown for dead letters recorded before sequences were kept.
    pub aggregate_id: Option<String>,
    /// Unknown for dead letters recorded before sequences were kept.
    pub sequence: Option<i64>,
    /// Why it is poison.
    pub reason: QuarantineReason,
    /// Its status.
    pub status: DeadLetterStatus,
    /// How many times it has been seen.
    pub observations: i64,
}

/// An open dead letter of the aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenDeadLetter {
    /// The namespace of its message id: the producer that delivered it (`None`: anonymous).
    pub producer: Option<String>,
    /// Its message id.
    pub message_id: String,
    /// Unknown for dead letters recorded before sequences were kept.
    pub sequence: Option<i64>,
}

/// A message held for its aggregate until its predecessor applies, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldMessage {
    /// The message as it was delivered, payload included.
    pub message: OrderedMessage,
    /// The canonical content.
    pub payload: String,
    /// When it was held.
    pub held_at: String,
    /// The producer that delivered it and the epoch it was sent under (`None`: anonymous). Its
    /// id is in that producer's namespace, and a drain applies it as that producer.
    pub claim: Option<ProducerClaim>,
    /// That producer's row as the store holds it now, read with the held row (`None`: anonymous,
    /// or the producer is unknown): a drain admits the message against it, as a delivery would
    /// be admitted now.
    pub producer_now: Option<ProducerFact>,
}

impl HeldMessage {
    /// The namespace of its id (`None`: anonymous).
    pub fn producer(&self) -> Option<&str> {
        self.claim.as_ref().map(|claim| claim.producer.as_str())
    }
}

/// What the store knows that a delivery's verdict depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveryFacts {
    /// An applied message with the delivered id.
    pub applied: Option<AppliedFact>,
    /// A dead letter with the delivered id.
    pub dead_letter: Option<KnownDeadLetter>,
    /// The aggregate's row (`None`: none yet).
    pub aggregate: Option<AggregateRow>,
    /// Every open dead letter of the aggregate; only a blocked aggregate has any, so a backend
    /// may leave this empty for one that is not blocked.
    pub open_dead_letters: Vec<OpenDeadLetter>,
    /// This message id (in the delivery's namespace), if it is held (for whichever aggregate).
    pub held_message: Option<HeldMessage>,
    /// The aggregate's held messages, in sequence order (at most
    /// [`crate::Limits::max_held_per_aggregate`]). Read them for every door: any apply may
    /// release them.
    pub held: Vec<HeldMessage>,
    /// The aggregate's owner: a held message drains only if its delivery would be admitted now.
    pub owner: Option<AggregateOwner>,
    /// The gap resolution that skipped this message's sequence, if one did: a late arrival is
    /// stale and names it. A backend need only read it for a sequence at or below the
    /// aggregate's last.
    pub skipped_by: Option<i64>,
}

/// The producer's row as the store holds it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerFact {
    /// The last epoch a session was issued (0: no session yet).
    pub current_epoch: i64,
    /// False once the producer was revoked.
    pub active: bool,
}

/// What the store knows that a producer's right to write depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnershipFacts {
    /// The claiming producer's row (`None`: unknown, or the delivery is anonymous).
    pub producer: Option<ProducerFact>,
    /// The aggregate's owner, if it has one.
    pub owner: Option<AggregateOwner>,
    /// Whether the aggregate has any history (a state row, an applied message, a dead letter, a
    /// held message or a timeline event): only an aggregate without one can be claimed by a
    /// delivery.
    pub history: bool,
}

/// What a transfer's decision depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferFacts {
    /// Whether the operator is registered and not revoked.
    pub operator_active: bool,
    /// The receiving producer's row (`None`: unknown).
    pub producer: Option<ProducerFact>,
    /// The aggregate's owner (`None`: unowned).
    pub owner: Option<AggregateOwner>,
    /// The aggregate's last applied sequence (0 without a row).
    pub last: i64,
    /// The aggregate's held messages: the transfer rejects those its new owner makes
    /// inadmissible.
    pub held: Vec<HeldMessage>,
}

/// The dead letter being resolved, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterFact {
    /// Its status.
    pub status: DeadLetterStatus,
    /// Unknown for dead letters recorded before sequences were kept.
    pub aggregate_id: Option<String>,
    /// Unknown for dead letters recorded before sequences were kept.
    pub sequence: Option<i64>,
    /// The message's stored content (its canonical form), which an accepting resolution applies;
    /// unknown for dead letters recorded before payloads were kept.
    pub payload: Option<String>,
}

/// What the store knows that a resolution depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolutionFacts {
    /// The dead letter (`None`: unknown).
    pub dead_letter: Option<DeadLetterFact>,
    /// The recorded resolution, when the dead letter is already resolved.
    pub recorded: Option<ResolutionRecord>,
    /// The dead letter's aggregate.
    pub aggregate: Option<AggregateRow>,
    /// The aggregate's open dead letters, while it is blocked.
    pub open_dead_letters: Vec<OpenDeadLetter>,
    /// Whether the operator is still active (not revoked since authentication).
    pub operator_active: bool,
    /// What is known of the replacement's message id.
    pub replacement_applied: Option<AppliedFact>,
    /// A dead letter with the replacement's message id.
    pub replacement_dead_letter: Option<KnownDeadLetter>,
    /// A held message with the replacement's message id.
    pub replacement_held: Option<HeldMessage>,
    /// The aggregate's held messages, in sequence order: the resolution drains those it makes
    /// next.
    pub held: Vec<HeldMessage>,
    /// The aggregate's owner: a held message drains only if its delivery would be admitted now.
    pub owner: Option<AggregateOwner>,
}
