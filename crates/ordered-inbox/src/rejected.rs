//! The rejected list: deliveries a broker consumer terminated (malformed, stale, a payload
//! conflict, a producer refusal) and held messages that left the held set without applying. It
//! lives in the inbox's store, so it survives a restart, and it is bounded: each insert prunes
//! what fell out of the newest [`crate::records::REJECTED_KEPT`].
//!
//! A held message is rejected by the core, in the transaction that decides it: a drain or a
//! transfer that finds it may no longer write its aggregate (its producer was revoked or fenced,
//! the aggregate is another's now, or an anonymous one's aggregate has an owner now), or whose
//! sequence another message took while it was held.

use crate::change::Change;
use crate::facts::HeldMessage;
use crate::records::{ProducerRefusal, RejectedDelivery, refusal_outcome};
use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};

/// Why a held message left the held set without applying.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeldRejection {
    /// Producer admission refuses it now, as it would refuse its delivery now.
    Refused(ProducerRefusal),
    /// Another message took its sequence while it was held; the aggregate expects `expected`.
    Stale {
        /// The sequence the aggregate waits for.
        expected: i64,
    },
}

impl HeldRejection {
    /// The name the rejected list and the timeline give it.
    pub fn outcome(&self) -> &'static str {
        match self {
            HeldRejection::Refused(refusal) => refusal_outcome(refusal),
            HeldRejection::Stale { .. } => "stale",
        }
    }

    fn reason(&self, held: &HeldMessage) -> String {
        let sequence = held.message.sequence;
        match self {
            HeldRejection::Refused(ProducerRefusal::OwnerRequired) => format!(
                "held for sequence {sequence} while aggregate '{}' had no owner; it has an owner now, and an anonymous message cannot write it (publish it with the owner's Authorization and Producer-Epoch headers)",
                held.message.aggregate_id
            ),
            HeldRejection::Refused(refusal) => {
                format!("held for sequence {sequence}, refused now: {refusal}")
            }
            HeldRejection::Stale { expected } => format!(
                "sequence {sequence} was taken by another message while this one was held; the aggregate expects {expected}"
            ),
        }
    }
}

/// What rejecting a held message writes: its held row deleted, an entry of the rejected list,
/// and a `held rejected` observation on its aggregate's timeline.
pub(crate) fn reject_held(
    held: &HeldMessage,
    why: &HeldRejection,
    now: &str,
    changes: &mut Vec<Change>,
) {
    let message = &held.message;
    let reason = why.reason(held);
    let producer = held.producer().map(str::to_owned);
    changes.push(Change::ReleaseHeld {
        producer: producer.clone(),
        message_id: message.message_id.clone(),
    });
    changes.push(Change::RecordRejected(RejectedDelivery {
        at: now.to_owned(),
        subject: None,
        stream_sequence: None,
        delivered: None,
        message_id: Some(message.message_id.clone()),
        aggregate_id: Some(message.aggregate_id.clone()),
        producer,
        outcome: why.outcome().to_owned(),
        reason: reason.clone(),
    }));
    changes.push(Change::Append(TimelineEntry {
        aggregate_id: message.aggregate_id.clone(),
        at: now.to_owned(),
        kind: TimelineKind::HeldRejected,
        sequence: Some(message.sequence),
        message_id: Some(message.message_id.clone()),
        detail: TimelineDetail::HeldRejected {
            outcome: why.outcome().to_owned(),
            held_at: held.held_at.clone(),
            reason,
        },
    }));
}
