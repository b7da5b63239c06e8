//! Gap notices: the consumer tells whoever can resend that an aggregate waits for a missing
//! sequence. Published with core NATS on `gaps.PREFIX.AGGREGATE` ([`wire::gap_subject_for`]):
//! when a batch makes an aggregate start waiting, and again by one timer, every
//! `gap_notice_interval`, for the aggregates still waiting, at most `gap_notices_per_tick` each
//! time. Every notice is computed from the aggregate's view read after the COMMIT, so an aggregate
//! that flows again gets none.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::model::AggregateStatus;
use tokio_util::sync::CancellationToken;

use super::config::BrokerConfig;
use super::status::{ConsumerStatus, SharedInbox};
use super::wire;

/// The most waiting aggregates one tick reads (the longest-waiting first) to choose its notices
/// from: a bound on the tick's work however many aggregates wait.
const INVENTORY_READ: i64 = 1_000;

/// Publishes the gap notices of one consumer.
pub struct GapNotifier {
    client: async_nats::Client,
    subject_prefix: String,
    interval: std::time::Duration,
    per_tick: usize,
    lab: ConsumerStatus,
    /// When each waiting aggregate was last noticed, so that each tick notices the ones noticed
    /// longest ago first. Only aggregates of the last inventory read (and those noticed since)
    /// are kept.
    noticed: Mutex<HashMap<String, Instant>>,
}

impl GapNotifier {
    /// A notifier publishing on `client` under `config`'s subject prefix, counting in `lab`.
    pub fn new(
        client: async_nats::Client,
        config: &BrokerConfig,
        lab: ConsumerStatus,
    ) -> GapNotifier {
        GapNotifier {
            client,
            subject_prefix: config.subject_prefix.clone(),
            interval: config.gap_notice_interval,
            per_tick: config.gap_notices_per_tick,
            lab,
            noticed: Mutex::new(HashMap::new()),
        }
    }

    /// Notices the aggregates a batch made start waiting (at most one tick's worth; the timer
    /// notices the rest).
    pub async fn notice_started(&self, inbox: &SharedInbox, aggregates: Vec<String>) {
        for aggregate_id in aggregates.into_iter().take(self.per_tick) {
            self.notice(inbox, aggregate_id).await;
        }
    }

    /// Every interval until `stop`, a tick: the notices of the aggregates still waiting.
    pub async fn repeat(&self, inbox: SharedInbox, stop: CancellationToken) {
        let mut timer = tokio::time::interval(self.interval);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick of an interval is immediate; the batch path covers the start.
        timer.tick().await;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = timer.tick() => self.tick(&inbox).await,
            }
        }
    }

    /// Reads the waiting aggregates and notices those noticed longest ago (never first), at most
    /// `per_tick`.
    async fn tick(&self, inbox: &SharedInbox) {
        let waiting = match inbox
            .reads()
            .inventory(AggregateStatus::Waiting, INVENTORY_READ)
            .await
        {
            Ok(waiting) => waiting,
            Err(error) => {
                tracing::warn!(%error, "gap notices: cannot read the waiting aggregates");
                return;
            }
        };
        let due = self.due(
            waiting
                .into_iter()
                .filter(|entry| entry.held > 0)
                .map(|entry| entry.summary.aggregate_id),
        );
        for aggregate_id in due {
            self.notice(inbox, aggregate_id).await;
        }
    }

    /// The `per_tick` of `waiting` noticed longest ago; forgets the aggregates not among them.
    fn due(&self, waiting: impl Iterator<Item = String>) -> Vec<String> {
        let Ok(mut noticed) = self.noticed.lock() else {
            return Vec::new();
        };
        let mut candidates: Vec<(Option<Instant>, String)> = waiting
            .map(|aggregate_id| (noticed.get(&aggregate_id).copied(), aggregate_id))
            .collect();
        *noticed = candidates
            .iter()
            .filter_map(|(at, aggregate_id)| at.map(|at| (aggregate_id.clone(), at)))
            .collect();
        candidates.sort();
        candidates
            .into_iter()
            .take(self.per_tick)
            .map(|(_, aggregate_id)| aggregate_id)
            .collect()
    }

    /// Publishes the aggregate's notice if its view, read now, still calls for one.
    async fn notice(&self, inbox: &SharedInbox, aggregate_id: String) {
        let view = match inbox.reads().aggregate(aggregate_id.clone()).await {
            Ok(view) => view,
            Err(error) => {
                tracing::warn!(%error, aggregate_id, "gap notice: cannot read the aggregate");
                return;
            }
        };
        let Some(notice) = view.as_ref().and_then(wire::GapNotice::of_view) else {
            return;
        };
        let subject = wire::gap_subject_for(&self.subject_prefix, &aggregate_id);
        let body = serde_json::json!(notice).to_string();
        match self.client.publish(subject, body.into()).await {
            Ok(()) => {
                if let Ok(mut noticed) = self.noticed.lock() {
                    noticed.insert(aggregate_id, Instant::now());
                }
                self.lab.count(|c| c.gap_notices += 1);
            }
            // The next tick tries again.
            Err(error) => tracing::warn!(%error, aggregate_id, "gap notice not published"),
        }
    }
}
