//! How long a store keeps what it no longer needs to decide deliveries, and the bounded batch of
//! pruning a backend runs at a time.
//!
//! What decides a delivery's order is the aggregate's position (its last applied sequence),
//! which is never pruned: a message whose identity was pruned is behind its aggregate's position
//! when it comes again, so it answers *stale* and applies nothing. What pruning gives up is the
//! telling apart of a *replay* (same id, same content) from a *payload conflict* (same id, other
//! content): only within the retention is an old id recognised.
//!
//! - Applied identities (`ordered_inbox` rows, with their `applied` timeline events): pruned
//!   once applied longer ago than [`Retention::identities`].
//! - Timeline state events: beyond the newest [`Retention::timeline`] per aggregate, compacted;
//!   events an audit row refers to (resolutions, gap skips, transfers, and the quarantine of a
//!   resolved dead letter) are kept.
//! - Closed dead letters (resolved or superseded): pruned once closed longer ago than
//!   [`Retention::dead_letters`]. A resolution's row stays: it is the audit trail by itself
//!   (message id, aggregate, sequence, operator, reason, states before and after), and the same
//!   resolution request still repeats it.
//! - The audit trail (resolutions, gap resolutions, transfers, operators and producers with
//!   their revocations) and every aggregate's position are never pruned.
//!
//! The decision here is pure: from a policy and the time, the cut-offs of one batch
//! ([`plan_batch`]); a backend deletes at most [`PrunePlan::batch`] rows of each kind per call
//! ([`crate::Inbox::prune`]), so pruning never holds the writer (or a lock) for long.

use std::time::Duration;

use serde::Serialize;

use crate::clock;

/// Rows of each kind one prune call deletes at most, unless the caller asks otherwise: small
/// enough that a batch costs the SQLite writer about as much as a group commit of deliveries.
pub const DEFAULT_BATCH: usize = 500;

/// What a store keeps. `None` keeps that kind for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Applied identities are pruned once applied longer ago than this.
    pub identities: Option<Duration>,
    /// Timeline state events kept per aggregate (the newest), beside those an audit row refers
    /// to.
    pub timeline: Option<u32>,
    /// Closed dead letters are pruned once closed longer ago than this.
    pub dead_letters: Option<Duration>,
}

impl Retention {
    /// Applied identities for seven days; the timeline and dead letters for good.
    pub const DEFAULT_IDENTITIES: Duration = Duration::from_secs(7 * 24 * 60 * 60);

    /// Keeps everything: what a store without a policy does.
    pub fn keep_everything() -> Retention {
        Retention {
            identities: None,
            timeline: None,
            dead_letters: None,
        }
    }

    /// Whether this policy ever prunes anything.
    pub fn prunes(&self) -> bool {
        self.identities.is_some() || self.timeline.is_some() || self.dead_letters.is_some()
    }
}

impl Default for Retention {
    fn default() -> Retention {
        Retention {
            identities: Some(Retention::DEFAULT_IDENTITIES),
            timeline: None,
            dead_letters: None,
        }
    }
}

/// One batch of pruning, as a backend runs it: stored timestamps to compare against, and the
/// most rows of each kind to delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrunePlan {
    /// Applied identities with `applied_at` before this go (`None`: keep them).
    pub identities_before: Option<String>,
    /// Closed dead letters with `closed_at` before this go (`None`: keep them).
    pub dead_letters_before: Option<String>,
    /// Timeline state events kept per aggregate (`None`: no compaction).
    pub timeline_keep: Option<u32>,
    /// Compaction continues with the aggregates after this one (`None`: from the first).
    pub timeline_after: Option<String>,
    /// The most rows of each kind (and aggregates compacted) this batch touches.
    pub batch: usize,
}

/// What one batch pruned.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pruned {
    /// Applied identities deleted.
    pub identities: u64,
    /// Timeline events deleted.
    pub timeline: u64,
    /// Dead letters deleted.
    pub dead_letters: u64,
    /// The last aggregate the batch compacted (`None`: it reached the end, start over next
    /// round).
    pub timeline_cursor: Option<String>,
    /// Whether a kind filled its batch, so that more may be waiting.
    pub more: bool,
}

/// The oldest retained row of each kind and the store's size, for an operator's gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Retained {
    /// The store's size in bytes (the SQLite file and its WAL; PostgreSQL's inbox tables).
    pub bytes: u64,
    /// When the oldest retained identity was applied.
    pub oldest_identity: Option<String>,
    /// When the oldest retained closed dead letter was closed.
    pub oldest_dead_letter: Option<String>,
    /// When the oldest retained timeline event was recorded.
    pub oldest_timeline: Option<String>,
}

/// The cut-offs of one batch at `now` (a stored timestamp): `retention` back from it.
pub fn plan_batch(
    retention: &Retention,
    now: &str,
    timeline_after: Option<String>,
    batch: usize,
) -> PrunePlan {
    PrunePlan {
        identities_before: retention.identities.map(|keep| cut_off(now, keep)),
        dead_letters_before: retention.dead_letters.map(|keep| cut_off(now, keep)),
        timeline_keep: retention.timeline,
        timeline_after: retention.timeline.and(timeline_after),
        batch: batch.max(1),
    }
}

/// The stored timestamp `keep` before `now`; an unreadable `now` prunes nothing (the cut-off is
/// the earliest instant).
pub fn cut_off(now: &str, keep: Duration) -> String {
    let millis = clock::millis_between("1970-01-01T00:00:00.000Z", now).unwrap_or(i64::MIN);
    let keep = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
    clock::format_millis(millis.saturating_sub(keep))
}

impl Pruned {
    /// Whether a count filled the batch: another batch may find more at once.
    pub fn filled(&self, batch: usize) -> bool {
        let batch = batch as u64;
        self.identities >= batch || self.dead_letters >= batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_offs_lie_the_retention_back_from_now() {
        let retention = Retention {
            identities: Some(Duration::from_secs(60)),
            timeline: Some(10),
            dead_letters: Some(Duration::from_secs(3600)),
        };
        let plan = plan_batch(
            &retention,
            "2026-01-01T01:00:00.000Z",
            Some("a".into()),
            100,
        );
        assert_eq!(
            plan.identities_before.as_deref(),
            Some("2026-01-01T00:59:00.000Z")
        );
        assert_eq!(
            plan.dead_letters_before.as_deref(),
            Some("2026-01-01T00:00:00.000Z")
        );
        assert_eq!(plan.timeline_keep, Some(10));
        assert_eq!(plan.timeline_after.as_deref(), Some("a"));
        assert_eq!(plan.batch, 100);
    }

    #[test]
    fn keeping_everything_plans_no_cut_off() {
        let plan = plan_batch(
            &Retention::keep_everything(),
            &clock::now(),
            Some("a".into()),
            0,
        );
        assert_eq!(plan.identities_before, None);
        assert_eq!(plan.dead_letters_before, None);
        assert_eq!(plan.timeline_keep, None);
        assert_eq!(plan.timeline_after, None);
        assert_eq!(plan.batch, 1);
        assert!(!Retention::keep_everything().prunes());
    }

    #[test]
    fn an_unreadable_now_prunes_nothing() {
        let retention = Retention::default();
        let plan = plan_batch(&retention, "not a time", None, 10);
        let cut = plan.identities_before.unwrap_or_default();
        assert!(cut.as_str() < "0000", "{cut}");
    }
}
