//! The evidence as the lesson's routes have always shown it: the inbox's views with the
//! ledger's figures in them, member for member (`total` right after `last`, an applied
//! message's `amount`, a resolution's `{last, total}` before and after). The totals are the
//! ledger's `state`, which the inbox read in the same snapshot as the rest of each view.

use ordered_inbox::AggregateStatus;
use ordered_inbox::model::{ActionKind, Position as InboxPosition};
use ordered_inbox::views::{self as inbox, DeadLetterView};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::{amount_in, total_in};
// The view's member descriptions name the inbox's bounds.
#[cfg(doc)]
use ordered_inbox::views::{HELD_SHOWN, OPEN_DEAD_LETTERS_SHOWN};

/// An aggregate's current position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AggregateSummary {
    pub aggregate_id: String,
    pub last: i64,
    pub total: i64,
    /// The sequence the aggregate needs next.
    pub expected: i64,
    pub status: AggregateStatus,
    /// When the aggregate entered its status.
    pub since: Option<String>,
}

impl From<inbox::AggregateSummary> for AggregateSummary {
    fn from(summary: inbox::AggregateSummary) -> Self {
        AggregateSummary {
            total: total_in(summary.state.as_ref()),
            aggregate_id: summary.aggregate_id,
            last: summary.last,
            expected: summary.expected,
            status: summary.status,
            since: summary.since,
        }
    }
}

/// An aggregate with the dead letters that hold it up.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AggregateView {
    #[serde(flatten)]
    pub summary: AggregateSummary,
    /// The first [`OPEN_DEAD_LETTERS_SHOWN`] open dead letters, the first seen first.
    pub open_dead_letters: Vec<DeadLetterView>,
    /// How many are open in all; more than the list holds when it was cut.
    pub open_dead_letter_count: i64,
    pub open_dead_letters_truncated: bool,
    /// The sequences held for the aggregate until their predecessors apply, lowest first (at
    /// most [`HELD_SHOWN`]).
    pub held_sequences: Vec<i64>,
    /// How many messages are held in all.
    pub held_count: i64,
    /// What a waiting aggregate is missing; null unless it waits.
    pub missing: Option<inbox::MissingRange>,
    /// Since when it waits; null unless it waits.
    pub waiting_since: Option<String>,
}

impl From<inbox::AggregateView> for AggregateView {
    fn from(view: inbox::AggregateView) -> Self {
        AggregateView {
            summary: view.summary.into(),
            open_dead_letters: view.open_dead_letters,
            open_dead_letter_count: view.open_dead_letter_count,
            open_dead_letters_truncated: view.open_dead_letters_truncated,
            held_sequences: view.held_sequences,
            held_count: view.held_count,
            missing: view.missing,
            waiting_since: view.waiting_since,
        }
    }
}

/// One line of the inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryEntry {
    #[serde(flatten)]
    pub summary: AggregateSummary,
    /// Whole seconds since the aggregate entered its status.
    pub age_seconds: i64,
    pub open_dead_letters: i64,
    /// Messages held for the aggregate until a missing predecessor arrives.
    pub held: i64,
    /// What a waiting aggregate is missing; null unless it waits.
    pub missing: Option<inbox::MissingRange>,
    /// Since when it waits; null unless it waits.
    pub waiting_since: Option<String>,
}

impl From<inbox::InventoryEntry> for InventoryEntry {
    fn from(entry: inbox::InventoryEntry) -> Self {
        InventoryEntry {
            summary: entry.summary.into(),
            age_seconds: entry.age_seconds,
            open_dead_letters: entry.open_dead_letters,
            held: entry.held,
            missing: entry.missing,
            waiting_since: entry.waiting_since,
        }
    }
}

/// One applied message: a row of `ordered_inbox`. Rows recorded by the original lab before the
/// columns existed were backfilled from their payload; a payload that never parsed leaves them
/// unknown.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedMessage {
    /// The producer whose message id this is (absent: the anonymous namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub producer: Option<String>,
    pub message_id: String,
    pub aggregate_id: Option<String>,
    pub sequence: Option<i64>,
    pub amount: Option<i64>,
    /// The canonical payload as stored: opaque JSON.
    pub payload: Value,
    pub applied_at: Option<String>,
}

impl From<inbox::AppliedMessage> for AppliedMessage {
    fn from(message: inbox::AppliedMessage) -> Self {
        AppliedMessage {
            amount: amount_in(&message.payload),
            producer: message.producer,
            message_id: message.message_id,
            aggregate_id: message.aggregate_id,
            sequence: message.sequence,
            payload: message.payload,
            applied_at: message.applied_at,
        }
    }
}

/// The aggregate and the dead letter as they are now: what a refused resolution shows.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CurrentState {
    pub aggregate: Option<AggregateSummary>,
    pub dead_letter: Option<DeadLetterView>,
}

impl From<inbox::CurrentState> for CurrentState {
    fn from(current: inbox::CurrentState) -> Self {
        CurrentState {
            aggregate: current.aggregate.map(AggregateSummary::from),
            dead_letter: current.dead_letter,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Replacement {
    pub message_id: String,
    pub amount: i64,
}

/// An aggregate's last applied sequence and running total.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, ToSchema)]
pub struct Position {
    pub last: i64,
    pub total: i64,
}

impl Position {
    fn of(position: &InboxPosition, total: i64) -> Position {
        Position {
            last: position.last,
            total,
        }
    }
}

/// One audited resolution: who, when, what, why, and the aggregate before and after.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResolutionRecord {
    /// `None` in a dry run, which assigns nothing.
    pub resolution_id: Option<i64>,
    /// The producer whose message id the dead letter is (absent: the anonymous namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub producer: Option<String>,
    pub message_id: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub action: ActionKind,
    pub operator: String,
    pub reason: String,
    pub expected_last: i64,
    pub replacement: Option<Replacement>,
    pub before: Position,
    pub after: Position,
    pub resolved_at: String,
}

impl From<ordered_inbox::records::ResolutionRecord> for ResolutionRecord {
    /// The totals are the ledger's states the audit row kept. A dry run's replacement was not
    /// applied, so it has no state after: its total is the one applying it would reach.
    fn from(record: ordered_inbox::records::ResolutionRecord) -> Self {
        let replacement = record.replacement.map(|replacement| Replacement {
            amount: amount_in(&replacement.payload).unwrap_or_default(),
            message_id: replacement.message_id,
        });
        let before_total = total_in(record.before.state.as_ref());
        let after_total = match &record.after.state {
            Some(state) => total_in(Some(state)),
            None => before_total.saturating_add(replacement.as_ref().map_or(0, |r| r.amount)),
        };
        ResolutionRecord {
            resolution_id: record.resolution_id,
            producer: record.producer,
            message_id: record.message_id,
            aggregate_id: record.aggregate_id,
            sequence: record.sequence,
            action: record.action,
            operator: record.operator,
            reason: record.reason,
            expected_last: record.expected_last,
            replacement,
            before: Position::of(&record.before, before_total),
            after: Position::of(&record.after, after_total),
            resolved_at: record.resolved_at,
        }
    }
}
