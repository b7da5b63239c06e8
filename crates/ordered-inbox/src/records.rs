//! The records the core writes and the evidence reads back: who owns an aggregate and who may
//! write it, the audit rows of transfers and resolutions, the rejected list's entries. Shared by
//! the decisions (which produce them) and the views (which show them), so they sit below both.

use serde::Serialize;
use serde_json::Value;

use crate::model::{ActionKind, Position, stored_enum};

/// The authenticated producer a delivery was made by, and the epoch of its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerClaim {
    /// The producer.
    pub producer: String,
    /// The epoch of its session the message was sent under.
    pub epoch: i64,
}

/// Who owns an aggregate, and the epoch under which it was claimed (or transferred).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AggregateOwner {
    /// The producer that owns the aggregate.
    pub producer: String,
    /// The epoch from which it owns it.
    pub epoch: i64,
}

/// Why a delivery was not even decided: nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProducerRefusal {
    /// A newer session of this producer exists: this instance must stop.
    #[error("fenced: epoch {offered} is older than the producer's current epoch {current_epoch}")]
    Fenced {
        /// The epoch offered.
        offered: i64,
        /// The producer's current epoch.
        current_epoch: i64,
    },
    /// The epoch was never issued (higher than the current one, or below 1).
    #[error("epoch {offered} was never issued (current epoch {current_epoch})")]
    EpochNotIssued {
        /// The epoch offered.
        offered: i64,
        /// The producer's current epoch.
        current_epoch: i64,
    },
    /// The producer never started a session.
    #[error("the producer has no session: start one first")]
    NoSession,
    /// The producer is unknown or was revoked.
    #[error("the producer is not active")]
    Revoked,
    /// The aggregate belongs to another producer.
    #[error("the aggregate is owned by '{owner}'")]
    NotOwner {
        /// The owner.
        owner: String,
    },
    /// An anonymous delivery to an owned aggregate.
    #[error("the aggregate is owned by a producer: deliver with its credentials")]
    OwnerRequired,
    /// An authenticated delivery to an unowned aggregate that already has history: only an
    /// operator may give it an owner.
    #[error("the aggregate has history and no owner: an operator must assign it")]
    ClaimRequiresOperator,
}

/// A producer refusal's name: the `outcome` a server's general door answers it with (`unauthorized`
/// and `owner required` are its 401s), and the one the rejected list shows.
pub fn refusal_outcome(refusal: &ProducerRefusal) -> &'static str {
    match refusal {
        ProducerRefusal::Fenced { .. } => "fenced",
        ProducerRefusal::EpochNotIssued { .. } => "epoch not issued",
        ProducerRefusal::NoSession => "no session",
        ProducerRefusal::Revoked => "unauthorized",
        ProducerRefusal::NotOwner { .. } => "not the owner",
        ProducerRefusal::OwnerRequired => "owner required",
        ProducerRefusal::ClaimRequiresOperator => "claim requires operator",
    }
}

/// Why a transfer was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferRefusal {
    /// The operator is unknown or revoked.
    Unauthorized,
    /// The producer is unknown or revoked.
    UnknownProducer,
    /// The owner is not the one expected.
    OwnerMismatch,
    /// The last sequence is not the one expected.
    LastMismatch,
}

/// The recorded transfer: the audit row's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TransferRecord {
    /// The aggregate.
    pub aggregate_id: String,
    /// The operator who transferred it.
    pub operator: String,
    /// The owner before (`None`: unowned).
    pub from_owner: Option<String>,
    /// The owner from now on.
    pub to_owner: String,
    /// The receiving producer's current epoch: its owner epoch from now on.
    pub epoch: i64,
    /// The aggregate's last applied sequence at the transfer.
    pub last: i64,
    /// Why, as the operator gave it.
    pub reason: String,
    /// When.
    pub transferred_at: String,
    /// How many held messages the transfer made inadmissible: they were rejected with it.
    pub held_rejected: usize,
}

/// Rejected deliveries the store keeps (the newest; older ones are pruned as new ones arrive).
pub const REJECTED_KEPT: i64 = 1000;

/// One entry of the rejected list, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectedDelivery {
    /// When it was rejected.
    pub at: String,
    /// The subject it arrived on (`None`: a held message the store rejected; the store never
    /// knew its subject).
    pub subject: Option<String>,
    /// The broker's sequence of the message in its stream, if known.
    pub stream_sequence: Option<i64>,
    /// How many times the broker had delivered it.
    pub delivered: Option<i64>,
    /// Its message id, if it could be read.
    pub message_id: Option<String>,
    /// Its aggregate, if it could be read.
    pub aggregate_id: Option<String>,
    /// The producer whose token the message carried (`None`: anonymous, or not known).
    pub producer: Option<String>,
    /// `malformed`, `stale`, `payload conflict`, or a producer refusal ([`refusal_outcome`]).
    pub outcome: String,
    /// Why, in words.
    pub reason: String,
}

/// An operator's replacement of a dead letter: a new message id at its sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Replacement {
    /// The replacement's message id.
    pub message_id: String,
    /// The replacement's payload, as the operator gave it.
    pub payload: Value,
}

/// One audited resolution: who, when, what, why, and the aggregate before and after.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ResolutionRecord {
    /// `None` in a dry run, which assigns nothing.
    pub resolution_id: Option<i64>,
    /// The producer whose message id the dead letter is (absent: the anonymous namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub producer: Option<String>,
    /// The dead letter's message id.
    pub message_id: String,
    /// Its aggregate.
    pub aggregate_id: String,
    /// The sequence it held.
    pub sequence: i64,
    /// Replace or skip.
    pub action: ActionKind,
    /// The operator who resolved.
    pub operator: String,
    /// Why, as the operator gave it.
    pub reason: String,
    /// The last applied sequence the operator saw.
    pub expected_last: i64,
    /// The replacement message, for a replace.
    pub replacement: Option<Replacement>,
    /// The aggregate before the resolution, and after its own step (the replacement applied or
    /// the sequence skipped; held messages drained after it are on the timeline).
    pub before: Position,
    /// The aggregate after the resolution and the messages it drained.
    pub after: Position,
    /// When.
    pub resolved_at: String,
}

/// A range of an aggregate's sequences, both ends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SequenceRange {
    /// The first sequence.
    pub from: i64,
    /// The last sequence, included.
    pub through: i64,
}

impl SequenceRange {
    /// Whether `sequence` lies in the range.
    pub fn contains(&self, sequence: i64) -> bool {
        (self.from..=self.through).contains(&sequence)
    }
}

/// Sequences an operator's resolution took without a message: a dead letter's skip (one
/// sequence) or a gap skip (its whole range). The backends hand it to the application's handler
/// in the resolution's transaction, after its audit row is numbered, so that an application can
/// mark the hole where a downstream would otherwise see a loss.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedSequences {
    /// The aggregate.
    pub aggregate_id: String,
    /// Every sequence of it was skipped, in order.
    pub range: SequenceRange,
    /// The resolution's audit row.
    pub resolution_id: i64,
    /// The operator who resolved.
    pub operator: String,
    /// Why, as the operator gave it.
    pub reason: String,
    /// When the resolution was made (the inbox's clock format).
    pub at: String,
}

/// What happened to one held message that a gap resolution made next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DrainedMessage {
    /// Its sequence.
    pub sequence: i64,
    /// Its message id.
    pub message_id: String,
    /// Applied or quarantined.
    pub outcome: DrainOutcome,
}

stored_enum!(
    /// How a drained held message ended.
    DrainOutcome, "drain outcome" {
        /// A held message applied.
        Applied => "applied",
        /// A held poison message: it blocks the aggregate, and the drain stops there.
        Quarantined => "quarantined",
    }
);

/// One audited gap resolution: an operator went on without the sequences `range` of an
/// aggregate, which were never delivered. Numbered in the same sequence as the dead letters'
/// resolutions, so that one audit trail lists both in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct GapRecord {
    /// `None` in a dry run, which assigns nothing.
    pub resolution_id: Option<i64>,
    /// The aggregate.
    pub aggregate_id: String,
    /// The sequences skipped.
    pub range: SequenceRange,
    /// The operator who resolved.
    pub operator: String,
    /// Why, as the operator gave it.
    pub reason: String,
    /// The last applied sequence the operator saw.
    pub expected_last: i64,
    /// The aggregate before the resolution, and after its own step (the range skipped, with no
    /// effect); the held messages drained after it are `drained`.
    pub before: Position,
    /// The aggregate after the skip and the messages it drained.
    pub after: Position,
    /// The held successors the skip made next, in the order they drained.
    pub drained: Vec<DrainedMessage>,
    /// When.
    pub resolved_at: String,
}
