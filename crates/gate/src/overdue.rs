//! Which waiting aggregates are overdue. A waiting aggregate's next message is the missing one,
//! so its type is unknown; the alert goes by the type of its lowest held successor (the held
//! rows keep the delivered envelope, `{"type", "payload"}`). The aggregate is overdue when it
//! has waited (since `waitingSince`) longer than that type's `gap_alert_after_ms`. A type that
//! sets none, an aggregate holding nothing, or a held row whose type cannot be read: never
//! overdue.

use std::collections::HashSet;
use std::time::Duration;

use ordered_inbox::views::InventoryEntry;
use ordered_inbox::{AggregateStatus, InboxError, clock};

use super::schemas::MessageTypes;
use http_edge::inbox::SharedInbox;

/// The most waiting aggregates (the longest-waiting first) a metrics scrape reads to count the
/// overdue: the count stops there.
pub const MAX_WAITING_COUNTED: i64 = 1000;

/// The ids of the `entries` that are overdue now.
pub async fn overdue_among(
    inbox: &SharedInbox,
    types: &MessageTypes,
    entries: &[InventoryEntry],
) -> Result<HashSet<String>, InboxError> {
    let waiting: Vec<(&str, &str)> = entries
        .iter()
        .filter_map(|entry| {
            let since = entry.waiting_since.as_deref()?;
            Some((entry.summary.aggregate_id.as_str(), since))
        })
        .collect();
    if waiting.is_empty() || !types.has_gap_alerts() {
        return Ok(HashSet::new());
    }
    let ids = waiting.iter().map(|(id, _)| (*id).to_owned()).collect();
    let successors = inbox.reads().lowest_held_payloads(ids).await?;
    let now = clock::now();
    let overdue = successors
        .into_iter()
        .filter(|(aggregate_id, payload)| {
            let Some(after) = successor_type(payload).and_then(|kind| types.gap_alert_after(&kind))
            else {
                return false;
            };
            waiting
                .iter()
                .find(|(id, _)| id == aggregate_id)
                .is_some_and(|(_, since)| waited_longer(since, &now, after))
        })
        .map(|(aggregate_id, _)| aggregate_id)
        .collect();
    Ok(overdue)
}

/// How many of the first [`MAX_WAITING_COUNTED`] waiting aggregates are overdue now.
pub async fn count_overdue(inbox: &SharedInbox, types: &MessageTypes) -> Result<usize, InboxError> {
    if !types.has_gap_alerts() {
        return Ok(0);
    }
    let waiting = inbox
        .reads()
        .inventory(AggregateStatus::Waiting, MAX_WAITING_COUNTED)
        .await?;
    Ok(overdue_among(inbox, types, &waiting).await?.len())
}

/// The `type` of a held message's delivered envelope.
fn successor_type(payload: &str) -> Option<String> {
    let envelope: serde_json::Value = serde_json::from_str(payload).ok()?;
    envelope.get("type")?.as_str().map(str::to_owned)
}

fn waited_longer(since: &str, now: &str, after: Duration) -> bool {
    let after = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
    clock::millis_between(since, now).is_some_and(|waited| waited > after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_successors_type_is_read_from_its_envelope() {
        assert_eq!(
            successor_type(r#"{"type":"order.placed","payload":{}}"#),
            Some("order.placed".to_owned())
        );
        assert_eq!(successor_type(r#"{"payload":{}}"#), None);
        assert_eq!(successor_type("not json"), None);
    }

    #[test]
    fn only_a_wait_longer_than_the_alert_is_overdue() {
        let since = "2025-01-01T00:00:00.000Z";
        let after = Duration::from_millis(1000);
        assert!(!waited_longer(since, "2025-01-01T00:00:01.000Z", after));
        assert!(waited_longer(since, "2025-01-01T00:00:01.001Z", after));
        assert!(!waited_longer("garbage", "2025-01-01T00:00:09.000Z", after));
    }
}
