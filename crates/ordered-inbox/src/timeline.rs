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
        Applied => "applied",
        Quarantined => "quarantined",
        Superseded => "superseded",
        /// A resolution took a sequence with no effect.
        Skipped => "skipped",
        Resolved => "resolved",
        Gap => "gap",
        Stale => "stale",
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
        expected: i64,
    },
    /// A late arrival of a sequence an operator's gap resolution skipped: the sequence still
    /// required and the resolution that skipped it.
    #[serde(rename_all = "camelCase")]
    SkippedLate {
        expected: i64,
        skipped_by: i64,
    },
    /// A known id offered with other content.
    Offered {
        offered: String,
    },
    /// The general door's repeat of a quarantined message.
    SeenAgain {
        observations: i64,
        status: DeadLetterStatus,
    },
    /// The classroom door's repeat (no count when the stored content differs).
    Repeated {
        observations: Option<i64>,
    },
    /// A poison message recorded: its reason, then the members of the poison's detail.
    Quarantined {
        reason: QuarantineReason,
        #[serde(flatten)]
        detail: Detail,
    },
    #[serde(rename_all = "camelCase")]
    QuarantineFull {
        open_dead_letters: usize,
        limit: usize,
    },
    /// What the handler's `apply` reported (stored as the object itself; an empty one as no
    /// detail at all).
    Applied(Detail),
    Superseded {
        by: String,
    },
    Skipped {
        effect: i64,
        operator: String,
    },
    /// A message held: the sequence still required and how many the aggregate holds now.
    Held {
        expected: i64,
        held: usize,
    },
    /// A held message released: since when it was held, and the message (or skip) whose
    /// sequence made it next.
    #[serde(rename_all = "camelCase")]
    Drained {
        held_at: String,
        after: String,
    },
    HoldFull {
        held: usize,
        limit: usize,
    },
    /// A held message rejected: the rejected list's outcome and reason, and since when it was
    /// held.
    #[serde(rename_all = "camelCase")]
    HeldRejected {
        outcome: String,
        held_at: String,
        reason: String,
    },
    /// The producer that claimed the aggregate and the epoch of its session.
    Claimed {
        producer: String,
        epoch: i64,
    },
    /// An operator's transfer: from whom (none: unowned), to whom, under which epoch, and why.
    Transferred {
        operator: String,
        from: Option<String>,
        to: String,
        epoch: i64,
        reason: String,
    },
    /// An operator's gap resolution: its audit row, the range skipped, who and why.
    #[serde(rename_all = "camelCase")]
    GapSkipped {
        resolution_id: i64,
        from: i64,
        through: i64,
        operator: String,
        reason: String,
    },
    #[serde(rename_all = "camelCase")]
    Resolved {
        resolution_id: i64,
        action: ActionKind,
        operator: String,
        reason: String,
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
    pub aggregate_id: String,
    pub at: String,
    pub kind: TimelineKind,
    pub sequence: Option<i64>,
    pub message_id: Option<String>,
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
