//! The feed of committed changes to the inbox: the inbox's wrapper ([`super::observed`])
//! publishes one bounded event per committed change, whatever door, route or consumer made it,
//! and whoever listens (the console's live pages) subscribes. Nobody listening is fine.

use ordered_inbox::Outcome;
use ordered_inbox::records::{GapRecord, ResolutionRecord, TransferRecord};
use serde::Serialize;
use tokio::sync::broadcast;

/// Changes a listener may fall behind by before it is told to reload instead.
pub const EVENTS_KEPT: usize = 64;

/// One committed change to the inbox, as pages receive it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InboxChange {
    pub aggregate_id: String,
    pub message_id: String,
    /// What happened: a delivery's verdict (`applied`, `gap`, `quarantined` …), `resolved`,
    /// `gap resolved` or `owner transferred`.
    pub change: &'static str,
}

/// The feed; cheap to clone (every clone publishes to the same listeners).
#[derive(Clone)]
pub struct InboxChanges {
    sender: broadcast::Sender<InboxChange>,
}

impl Default for InboxChanges {
    fn default() -> Self {
        Self::new()
    }
}

impl InboxChanges {
    pub fn new() -> Self {
        InboxChanges {
            sender: broadcast::Sender::new(EVENTS_KEPT),
        }
    }

    /// Tells every listener.
    pub fn publish(&self, change: InboxChange) {
        let _ = self.sender.send(change);
    }

    /// A new listener, hearing what is published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<InboxChange> {
        self.sender.subscribe()
    }
}

/// The change a delivery's outcome made, if any: a replay writes nothing.
fn delivery_change(outcome: &Outcome) -> Option<&'static str> {
    match outcome {
        Outcome::Applied { .. } => Some("applied"),
        Outcome::Replay { .. } => None,
        Outcome::Gap { .. } => Some("gap"),
        Outcome::Stale { .. } => Some("stale"),
        Outcome::PayloadConflict => Some("payload conflict"),
        Outcome::Quarantined { .. } => Some("quarantined"),
        Outcome::QuarantineFull { .. } => Some("quarantine full"),
        Outcome::Held { .. } => Some("held"),
        Outcome::HoldFull { .. } => Some("hold full"),
    }
}

/// What the inbox's wrapper ([`super::observed::ObservedInbox`]) publishes after a change
/// committed, whatever door, route or consumer made it.
impl InboxChanges {
    /// A committed delivery, if it changed anything.
    pub fn delivered(&self, aggregate_id: &str, message_id: &str, outcome: &Outcome) {
        if let Some(change) = delivery_change(outcome) {
            self.publish(InboxChange {
                aggregate_id: aggregate_id.to_owned(),
                message_id: message_id.to_owned(),
                change,
            });
        }
    }

    /// An operator's new resolution.
    pub fn resolved(&self, record: &ResolutionRecord) {
        self.publish(InboxChange {
            aggregate_id: record.aggregate_id.clone(),
            message_id: record.message_id.clone(),
            change: "resolved",
        });
    }

    /// An operator's new gap resolution (the held successors it drained with it). It names no
    /// message: the skipped range was never delivered.
    pub fn gap_resolved(&self, record: &GapRecord) {
        self.publish(InboxChange {
            aggregate_id: record.aggregate_id.clone(),
            message_id: String::new(),
            change: "gap resolved",
        });
    }

    /// An operator's transfer of an aggregate to another producer.
    pub fn owner_transferred(&self, record: &TransferRecord) {
        self.publish(InboxChange {
            aggregate_id: record.aggregate_id.clone(),
            message_id: String::new(),
            change: "owner transferred",
        });
    }
}
