//! An aggregate's history. State events (applied, quarantined, superseded, skipped, resolved,
//! held, drained) are append-only and written in the same transaction as the change they
//! describe; rejection observations (gap, stale, payload conflict, a quarantined message seen
//! again, a full quarantine, a full hold, a held message rejected) are numbered per aggregate
//! and only the newest [`OBSERVATIONS_KEPT`] stay, so a flood of bad deliveries cannot grow the
//! store without bound.

use serde::Serialize;

use crate::content::Detail;
use crate::model::{ActionKind, DeadLetterStatus, QuarantineReason, stored_enum};

/// Rejection observations kept per aggregate.
pub const OBSERVATIONS_KEPT: i64 = 100;

stored_enum!(
    /// What a timeline entry records.
    TimelineKind, "timeline kind" {
        /// A message applied.
        Applied => "applied",
        /// A poison message recorded as a dead letter.
        Quarantined => "quarantined",
        /// An open dead letter whose sequence another message took.
        Superseded => "superseded",
        /// A resolution took a sequence with no effect.
        Skipped => "skipped",
        /// An operator resolved a dead letter, with an audit row.
        Resolved => "resolved",
        /// A message ahead of its turn refused.
        Gap => "gap",
        /// A message behind its turn refused.
        Stale => "stale",
        /// A known id offered with other content.
        PayloadConflict => "payload conflict",
        /// A quarantined message delivered again, unchanged.
        QuarantinedAgain => "quarantined again",
        /// A new poison message refused because the aggregate's quarantine is full.
        QuarantineFull => "quarantine full",
        /// A message ahead of its turn recorded to apply later ([`crate::Door::Broker`]).
        Held => "held",
        /// A held message released because its predecessor applied (an `applied` or
        /// `quarantined` event for it follows).
        Drained => "drained",
        /// A message ahead of its turn refused because the aggregate holds the most it may.
        HoldFull => "hold full",
        /// A producer's first delivery to an aggregate without history made it the owner.
        Claimed => "claimed",
        /// An operator gave the aggregate another owner, with an audit row.
        OwnerTransferred => "owner transferred",
        /// A held message left the held set without applying: it may no longer write the
        /// aggregate, or another message took its sequence (it is on the rejected list too).
        HeldRejected => "held rejected",
        /// An operator went on without a range of sequences that never arrived, with an audit
        /// row ([`crate::gaps`]).
        GapSkipped => "gap skipped",
    }
);

impl TimelineKind {
    /// Observations record a rejection and are pruned; state events are kept for good.
    pub fn is_observation(self) -> bool {
        matches!(
            self,
            TimelineKind::Gap
                | TimelineKind::Stale
                | TimelineKind::PayloadConflict
                | TimelineKind::QuarantinedAgain
                | TimelineKind::QuarantineFull
                | TimelineKind::HoldFull
                | TimelineKind::HeldRejected
        )
    }
}

/// The `detail` of an entry, stored as a JSON object with exactly these members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum TimelineDetail {
    /// Gap and stale: the sequence still required.
    Expected {
        /// The sequence still required.
        expected: i64,
    },
    /// A late arrival of a sequence an operator's gap resolution skipped: the sequence still
    /// required and the resolution that skipped it.
    #[serde(rename_all = "camelCase")]
    SkippedLate {
        /// The sequence still required.
        expected: i64,
        /// The gap resolution that skipped it.
        skipped_by: i64,
    },
    /// A known id offered with other content.
    Offered {
        /// The canonical content offered.
        offered: String,
    },
    /// The general door's repeat of a quarantined message.
    SeenAgain {
        /// How many times it has been seen.
        observations: i64,
        /// The dead letter's status.
        status: DeadLetterStatus,
    },
    /// The classroom door's repeat (no count when the stored content differs).
    Repeated {
        /// How many times it has been seen, when the content matches.
        observations: Option<i64>,
    },
    /// A poison message recorded: its reason, then the members of the poison's detail.
    Quarantined {
        /// Why it is poison.
        reason: QuarantineReason,
        #[serde(flatten)]
        /// What else the handler reported.
        detail: Detail,
    },
    #[serde(rename_all = "camelCase")]
    /// A poison message not recorded: the aggregate has as many open dead letters as it may.
    QuarantineFull {
        /// The aggregate's open dead letters.
        open_dead_letters: usize,
        /// The most it may have.
        limit: usize,
    },
    /// What the handler's `apply` reported (stored as the object itself; an empty one as no
    /// detail at all).
    Applied(Detail),
    /// An open dead letter whose sequence another message took.
    Superseded {
        /// The message id that took it.
        by: String,
    },
    /// An operator skipped a dead letter's sequence.
    Skipped {
        /// Always 0: a skip changes nothing but the position; kept in the stored format.
        effect: i64,
        /// The operator who skipped it.
        operator: String,
    },
    /// A message held: the sequence still required and how many the aggregate holds now.
    Held {
        /// The sequence still required.
        expected: i64,
        /// How many messages the aggregate holds now.
        held: usize,
    },
    /// A held message released: since when it was held, and the message (or skip) whose
    /// sequence made it next.
    #[serde(rename_all = "camelCase")]
    Drained {
        /// When it was held.
        held_at: String,
        /// The message id (or skipped dead letter) whose sequence made it next.
        after: String,
    },
    /// A message not held: the aggregate holds as many as it may.
    HoldFull {
        /// How many messages the aggregate holds.
        held: usize,
        /// The most it may hold.
        limit: usize,
    },
    /// A held message rejected: the rejected list's outcome and reason, and since when it was
    /// held.
    #[serde(rename_all = "camelCase")]
    HeldRejected {
        /// The rejected list's outcome.
        outcome: String,
        /// When it was held.
        held_at: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The producer that claimed the aggregate and the epoch of its session.
    Claimed {
        /// The producer.
        producer: String,
        /// The epoch of its session.
        epoch: i64,
    },
    /// An operator's transfer: from whom (none: unowned), to whom, under which epoch, and why.
    Transferred {
        /// The operator.
        operator: String,
        /// The owner before (`None`: unowned).
        from: Option<String>,
        /// The owner from now on.
        to: String,
        /// The epoch it owns the aggregate from.
        epoch: i64,
        /// Why, as the operator gave it.
        reason: String,
    },
    /// An operator's gap resolution: its audit row, the range skipped, who and why.
    #[serde(rename_all = "camelCase")]
    GapSkipped {
        /// The resolution's audit row.
        resolution_id: i64,
        /// The first sequence skipped.
        from: i64,
        /// The last sequence skipped.
        through: i64,
        /// The operator who resolved.
        operator: String,
        /// Why, as the operator gave it.
        reason: String,
    },
    #[serde(rename_all = "camelCase")]
    /// An operator's resolution of a dead letter: its audit row, the action, who and why.
    Resolved {
        /// The resolution's audit row.
        resolution_id: i64,
        /// Replace or skip.
        action: ActionKind,
        /// The operator who resolved.
        operator: String,
        /// Why, as the operator gave it.
        reason: String,
        /// The replacement's message id, for a replace.
        replacement_message_id: Option<String>,
    },
}

impl TimelineDetail {
    /// The stored text: `None` for an applied event without a detail.
    pub fn to_json(&self) -> Option<String> {
        match self {
            TimelineDetail::Applied(detail) => TimelineDetail::applied_json(detail),
            other => Some(serde_json::to_string(other).unwrap_or_default()),
        }
    }

    /// The stored text of `Applied(detail)`, from the borrowed detail (the writer stores it
    /// at every apply).
    pub fn applied_json(detail: &Detail) -> Option<String> {
        (!detail.is_empty()).then(|| serde_json::to_string(detail).unwrap_or_default())
    }
}

/// One entry to append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimelineEntry {
    /// The aggregate.
    pub aggregate_id: String,
    /// When.
    pub at: String,
    /// What happened.
    pub kind: TimelineKind,
    /// The sequence concerned, if any.
    pub sequence: Option<i64>,
    /// The message id concerned, if any.
    pub message_id: Option<String>,
    /// Its detail.
    pub detail: TimelineDetail,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_keep_the_stored_member_names_and_order() {
        let cases = [
            (
                TimelineDetail::Expected { expected: 2 },
                r#"{"expected":2}"#,
            ),
            (
                TimelineDetail::SeenAgain {
                    observations: 2,
                    status: DeadLetterStatus::Open,
                },
                r#"{"observations":2,"status":"open"}"#,
            ),
            (
                TimelineDetail::Repeated { observations: None },
                r#"{"observations":null}"#,
            ),
            (
                TimelineDetail::Quarantined {
                    reason: QuarantineReason::new("out of stock"),
                    detail: serde_json::json!({"sku": "x", "asked": 3})
                        .as_object()
                        .cloned()
                        .unwrap(),
                },
                r#"{"reason":"out of stock","sku":"x","asked":3}"#,
            ),
            (
                TimelineDetail::Resolved {
                    resolution_id: 1,
                    action: ActionKind::Skip,
                    operator: "alice".into(),
                    reason: "r".into(),
                    replacement_message_id: None,
                },
                r#"{"resolutionId":1,"action":"skip","operator":"alice","reason":"r","replacementMessageId":null}"#,
            ),
        ];
        for (detail, text) in cases {
            assert_eq!(detail.to_json().as_deref(), Some(text));
        }
    }

    #[test]
    fn an_applied_event_stores_the_handlers_detail_or_nothing() {
        let detail = serde_json::json!({"sku": "x"})
            .as_object()
            .cloned()
            .unwrap();
        assert_eq!(
            TimelineDetail::Applied(detail).to_json().as_deref(),
            Some(r#"{"sku":"x"}"#)
        );
        assert_eq!(TimelineDetail::Applied(Detail::new()).to_json(), None);
    }

    #[test]
    fn only_rejections_are_observations() {
        assert!(TimelineKind::Gap.is_observation());
        assert!(TimelineKind::QuarantineFull.is_observation());
        assert!(TimelineKind::HoldFull.is_observation());
        assert!(TimelineKind::HeldRejected.is_observation());
        assert!(!TimelineKind::Held.is_observation());
        assert!(!TimelineKind::Drained.is_observation());
        assert!(!TimelineKind::Applied.is_observation());
        assert!(!TimelineKind::Resolved.is_observation());
    }
}
