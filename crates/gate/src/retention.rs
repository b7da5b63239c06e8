//! The gate's pruner: applies `[retention]` to its store, one bounded batch at a time, so that
//! deliveries are never held behind it for longer than behind a group commit. On SQLite each
//! batch is one unit of the writer, and the next is sent only after it committed, so at most one
//! batch shares any group commit with deliveries; on PostgreSQL each is a short transaction on a
//! pooled connection of its own. A round runs batches until none fills up, reports the store's
//! size and the age of the oldest retained row of each kind, then rests for `interval_ms`.

use std::time::Duration;

use ordered_inbox::clock;
use ordered_inbox::retention::{cut_off, plan_batch};
use tokio_util::sync::CancellationToken;

use crate::config::GateRetention;
use crate::output::OutputStore;
use http_edge::inbox::SharedInbox;
use http_edge::metrics::{Metrics, RETAINED_KINDS};

/// How long the pruner waits after a round that failed (the store was unavailable).
const AFTER_FAILURE: Duration = Duration::from_secs(1);

/// The store's pruner.
pub struct Pruner {
    pub inbox: SharedInbox,
    pub output: OutputStore,
    pub retention: GateRetention,
    pub metrics: Metrics,
}

impl Pruner {
    /// Prunes round after round until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        for kind in RETAINED_KINDS {
            self.metrics.pruned(kind, 0);
        }
        let mut cursor = None;
        loop {
            let rest = match self.round(&mut cursor, &stop).await {
                Ok(()) => self.retention.interval,
                Err(error) => {
                    tracing::warn!(target: "production_lab::gate", "retention: {error}");
                    AFTER_FAILURE
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(rest) => {}
            }
        }
    }

    /// Batches until none fills up (or `stop`), then the figures.
    async fn round(
        &self,
        cursor: &mut Option<String>,
        stop: &CancellationToken,
    ) -> Result<(), String> {
        let batch = self.retention.batch;
        let prunes_inbox = self.retention.inbox.prunes();
        while !stop.is_cancelled() {
            let now = clock::now();
            let mut more = false;
            if prunes_inbox {
                let plan = plan_batch(&self.retention.inbox, &now, cursor.take(), batch);
                let pruned = self
                    .inbox
                    .prune(plan)
                    .await
                    .map_err(|error| error.to_string())?;
                self.metrics.pruned("identities", pruned.identities);
                self.metrics.pruned("timeline", pruned.timeline);
                self.metrics.pruned("dead_letters", pruned.dead_letters);
                more |= pruned.more;
                *cursor = pruned.timeline_cursor;
            }
            if let Some(keep) = self.retention.output {
                let deleted = self
                    .output
                    .prune(cut_off(&now, keep), batch)
                    .await
                    .map_err(|error| error.to_string())?;
                self.metrics.pruned("output", deleted);
                more |= deleted >= batch as u64;
            }
            if !more {
                break;
            }
        }
        self.report().await
    }

    async fn report(&self) -> Result<(), String> {
        let retained = self
            .inbox
            .reads()
            .retained()
            .await
            .map_err(|error| error.to_string())?;
        let output = self
            .output
            .oldest()
            .await
            .map_err(|error| error.to_string())?;
        let now = clock::now();
        let age = |since: &Option<String>| {
            since
                .as_deref()
                .map(|since| clock::seconds_between(since, &now) as f64)
        };
        self.metrics.retained(
            retained.bytes,
            &[
                ("identities", age(&retained.oldest_identity)),
                ("timeline", age(&retained.oldest_timeline)),
                ("dead_letters", age(&retained.oldest_dead_letter)),
                ("output", age(&output)),
            ],
        );
        Ok(())
    }
}
