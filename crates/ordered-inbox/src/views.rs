//! The evidence as typed values: an aggregate's state, the inventory, dead letters, the timeline
//! and the resolution audit trail. Every backend reads these; they serialize as camelCase with
//! statuses in their stored spelling.

use serde::Serialize;
use serde_json::Value;

use crate::model::{ActionKind, AggregateStatus, DeadLetterStatus, QuarantineReason};
use crate::records::{AggregateOwner, TransferRefusal};
use crate::timeline::TimelineKind;

/// An aggregate's current position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AggregateSummary {
    /// The aggregate.
    pub aggregate_id: String,
    /// Its last applied sequence (0 before any).
    pub last: i64,
    /// The sequence the aggregate needs next.
    pub expected: i64,
    /// Where it stands.
    pub status: AggregateStatus,
    /// When the aggregate entered its status.
    pub since: Option<String>,
    /// What the application's handler reports of the aggregate (its `state`), read in the same
    /// snapshot as the position; absent when it reports nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
}

/// A view that holds aggregate summaries: a backend gives each the handler's `state` of its
/// aggregate in the snapshot it read the view in.
pub trait Summaries {
    /// The summaries found, for the handler's state to be added to each.
    fn summaries(&mut self) -> Vec<&mut AggregateSummary>;
}

impl Summaries for AggregateSummary {
    fn summaries(&mut self) -> Vec<&mut AggregateSummary> {
        vec![self]
    }
}

impl<T: Summaries> Summaries for Option<T> {
    fn summaries(&mut self) -> Vec<&mut AggregateSummary> {
        self.as_mut().map_or_else(Vec::new, Summaries::summaries)
    }
}

impl<T: Summaries> Summaries for Vec<T> {
    fn summaries(&mut self) -> Vec<&mut AggregateSummary> {
        self.iter_mut().flat_map(Summaries::summaries).collect()
    }
}

impl Summaries for AggregateView {
    fn summaries(&mut self) -> Vec<&mut AggregateSummary> {
        vec![&mut self.summary]
    }
}

impl Summaries for InventoryEntry {
    fn summaries(&mut self) -> Vec<&mut AggregateSummary> {
        vec![&mut self.summary]
    }
}

impl Summaries for CurrentState {
    fn summaries(&mut self) -> Vec<&mut AggregateSummary> {
        self.aggregate.summaries()
    }
}

/// An aggregate with the dead letters that hold it up.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AggregateView {
    #[serde(flatten)]
    /// The aggregate's position and status.
    pub summary: AggregateSummary,
    /// The first [`OPEN_DEAD_LETTERS_SHOWN`] open dead letters, the first seen first.
    pub open_dead_letters: Vec<DeadLetterView>,
    /// How many are open in all; more than the list holds when it was cut.
    pub open_dead_letter_count: i64,
    /// Whether the list was cut.
    pub open_dead_letters_truncated: bool,
    /// The sequences held for the aggregate until their predecessors apply, lowest first (at
    /// most [`HELD_SHOWN`]).
    pub held_sequences: Vec<i64>,
    /// How many messages are held in all.
    pub held_count: i64,
    /// What a waiting aggregate is missing (`None` unless it waits): see [`crate::gaps::missing`].
    pub missing: Option<MissingRange>,
    /// Since when it waits (`None` unless it waits).
    pub waiting_since: Option<String>,
}

/// The sequences a waiting aggregate is missing: from the expected one through one below the
/// lowest sequence seen ahead of it since its last apply (`None` when nothing ahead is known).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MissingRange {
    /// The first missing sequence.
    pub from: i64,
    /// The last missing sequence (`None`: nothing ahead is known).
    pub through: Option<i64>,
}

/// The most held sequences [`AggregateView`] lists.
pub const HELD_SHOWN: i64 = 1000;

/// The most open dead letters [`AggregateView`] lists.
pub const OPEN_DEAD_LETTERS_SHOWN: i64 = 1000;

/// One applied message: a row of `ordered_inbox`. Rows recorded before the columns existed may
/// leave the aggregate and sequence unknown.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AppliedMessage {
    /// The producer whose message id this is (absent: the anonymous namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub producer: Option<String>,
    /// Its message id.
    pub message_id: String,
    /// Its aggregate (unknown for rows written before the column existed).
    pub aggregate_id: Option<String>,
    /// Its sequence (unknown for rows written before the column existed).
    pub sequence: Option<i64>,
    /// The canonical content as stored: opaque JSON.
    pub payload: Value,
    /// When it applied (unknown for rows written before the column existed).
    pub applied_at: Option<String>,
}

/// One line of the inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct InventoryEntry {
    #[serde(flatten)]
    /// The aggregate's position and status.
    pub summary: AggregateSummary,
    /// Whole seconds since the aggregate entered its status.
    pub age_seconds: i64,
    /// Its open dead letters.
    pub open_dead_letters: i64,
    /// Messages held for the aggregate until a missing predecessor arrives.
    pub held: i64,
    /// What a waiting aggregate is missing (`None` unless it waits).
    pub missing: Option<MissingRange>,
    /// Since when it waits (`None` unless it waits).
    pub waiting_since: Option<String>,
}

/// The resolution of a dead letter, as its view shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ResolutionSummary {
    /// The audit row's id.
    pub resolution_id: i64,
    /// Replace or skip.
    pub action: ActionKind,
    /// The operator who resolved.
    pub operator: String,
    /// Why, as the operator gave it.
    pub reason: String,
    /// When.
    pub resolved_at: String,
    /// The replacement's message id, for a replace.
    pub replacement_message_id: Option<String>,
}

/// A dead letter with its lifecycle. Rows recorded before the lifecycle columns existed have no
/// sequence, payload or timestamps.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterView {
    /// The producer whose message id this is (absent: the anonymous namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub producer: Option<String>,
    /// Its message id.
    pub message_id: String,
    /// Its aggregate (unknown for early dead letters).
    pub aggregate_id: Option<String>,
    /// Its sequence (unknown for early dead letters).
    pub sequence: Option<i64>,
    /// The canonical payload as stored: opaque JSON.
    pub payload: Option<Value>,
    /// Why it is poison.
    pub reason: QuarantineReason,
    /// When it was first seen.
    pub first_seen: Option<String>,
    /// When it was last seen.
    pub last_seen: Option<String>,
    /// How many times it has been seen.
    pub observations: i64,
    /// Where it is in its lifecycle.
    pub status: DeadLetterStatus,
    /// The message whose application (or skip) took the sequence.
    pub superseded_by: Option<String>,
    /// When it stopped being open.
    pub closed_at: Option<String>,
    /// The resolution that closed it, if an operator did.
    pub resolution: Option<ResolutionSummary>,
}

/// One timeline entry as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TimelineEvent {
    /// The entry's id, in the order entries were written.
    pub id: i64,
    /// When.
    pub at: String,
    /// What happened.
    pub kind: TimelineKind,
    /// The sequence concerned, if any.
    pub sequence: Option<i64>,
    /// The message id concerned, if any.
    pub message_id: Option<String>,
    /// True for a rejection observation (kept only among the newest per aggregate).
    pub observation: bool,
    /// The stored detail object: opaque JSON.
    pub detail: Option<Value>,
}

/// The aggregate and the dead letter as they are now: what a refused resolution shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CurrentState {
    /// The aggregate's summary, if it was recorded.
    pub aggregate: Option<AggregateSummary>,
    /// The dead letter, if it exists.
    pub dead_letter: Option<DeadLetterView>,
}

/// A classroom-style count of one aggregate's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AggregateCounts {
    /// Messages applied.
    pub applied: i64,
    /// Dead letters recorded.
    pub dead_letters: i64,
    /// The last applied sequence.
    pub last: i64,
}

/// What an operator watches across all aggregates, read in one go: how many aggregates are in
/// each status, how many dead letters are open, and how long the longest-blocked aggregate has
/// been blocked. Each figure comes from an index, not from a scan of the rows.
#[derive(Debug, Clone, PartialEq)]
pub struct InboxHealth {
    /// Every status of [`AggregateStatus::ALL`] with its count, zero included.
    pub aggregates: Vec<(AggregateStatus, i64)>,
    /// Dead letters open across all aggregates.
    pub open_dead_letters: i64,
    /// Messages held ahead of their turn (broker door) until their predecessors apply.
    pub held_messages: i64,
    /// Seconds since the longest-blocked aggregate became blocked; `None` when none is.
    pub longest_blocked_seconds: Option<f64>,
    /// Seconds since the longest-waiting aggregate began waiting; `None` when none waits.
    pub longest_waiting_seconds: Option<f64>,
}

/// An aggregate's owner (if any) and last applied sequence: what a transfer is checked against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OwnershipState {
    /// The owner (`None`: unowned).
    pub owner: Option<AggregateOwner>,
    /// The last applied sequence (0 without a row).
    pub last: i64,
}

/// A refused transfer and the ownership as it is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferConflict {
    /// Why the transfer was refused.
    pub refusal: TransferRefusal,
    /// The ownership as it is.
    pub current: OwnershipState,
}

/// A producer as `GET /producers` shows it: never the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ProducerView {
    /// The producer's name.
    pub name: String,
    /// The epoch of its newest session.
    pub current_epoch: i64,
    /// How many aggregates it owns.
    pub owned_aggregates: i64,
    /// When it last delivered, if ever.
    pub last_delivery_at: Option<String>,
    /// When it was registered.
    pub created_at: String,
    /// When it was revoked (`None`: active).
    pub revoked_at: Option<String>,
}

/// Which dead letters to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only dead letters in this status.
    pub status: Option<DeadLetterStatus>,
    /// Only the dead letters of this aggregate.
    pub aggregate_id: Option<String>,
}

/// Where a page starts and how long it may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRequest {
    /// The cursor: the `next` of the previous page, 0 for the first.
    pub after: i64,
    /// The most items on the page.
    pub limit: i64,
}

/// One page of a list, oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    /// The items, oldest first.
    pub items: Vec<T>,
    /// The `after` of the following page; `None` when this page reaches the end.
    pub next: Option<i64>,
}

impl<T> Page<T> {
    /// The same page with each item turned into another value (an application's view of it).
    pub fn map<U>(self, item: impl FnMut(T) -> U) -> Page<U> {
        Page {
            items: self.items.into_iter().map(item).collect(),
            next: self.next,
        }
    }

    /// Builds a page from up to `limit + 1` rows read with their cursor keys: the extra row, if
    /// any, only proves that another page exists.
    pub fn from_rows(mut rows: Vec<(i64, T)>, limit: i64) -> Page<T> {
        let limit = usize::try_from(limit).unwrap_or(0);
        let more = rows.len() > limit;
        rows.truncate(limit);
        let next = if more {
            rows.last().map(|(key, _)| *key)
        } else {
            None
        };
        Page {
            items: rows.into_iter().map(|(_, item)| item).collect(),
            next,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_says_next_only_when_another_row_exists() {
        let full = Page::from_rows(vec![(1, 'a'), (2, 'b'), (5, 'c')], 2);
        assert_eq!((full.items, full.next), (vec!['a', 'b'], Some(2)));
        let last = Page::from_rows(vec![(1, 'a'), (2, 'b')], 2);
        assert_eq!((last.items, last.next), (vec!['a', 'b'], None));
        let empty: Page<char> = Page::from_rows(vec![], 2);
        assert_eq!(empty.next, None);
    }
}
