//! The lease-latency phase of `bench relay`: on a fresh outbox server alone, `POST
//! /outbox/leases` timed while many events are pending behind live leases, and again with only
//! the events it hands out pending.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::write_events;
use crate::bench::{AggregateStream, BenchError, ledger_message, percentile};
use crate::progress::Progress;
use crate::server::{ServerUnderTest, Synchronous};

/// The most events one `POST /outbox/leases` hands out (`max` is 1..1000, docs/relay.md).
pub const OUTBOX_MAX_BATCH: usize = 1000;
/// The shortest lease `POST /outbox/leases` grants (`leaseMs` is 100..600000, docs/relay.md).
pub const OUTBOX_MIN_LEASE_MS: i64 = 100;

/// The largest lease, and the events it finds eligible each time.
const LEASE_MAX: usize = OUTBOX_MAX_BATCH;
/// Timed leases per outbox; each waits out its own shortest lease before the next.
const LEASE_SAMPLES: usize = 200;
/// How long the held events stay leased: longer than the whole phase.
const HOLD_MS: i64 = 600_000;
/// Eligible events per aggregate.
const ELIGIBLE_PER_AGGREGATE: usize = 10;

/// `POST /outbox/leases` on an outbox where `pending` events wait, `held` of them under live
/// leases, each the first pending event of its aggregate with `blocked` more behind it (sorted
/// before the `eligible` ones, so a lease that read every pending row in order would read them all
/// first). Every timed lease asks for `max` and must get exactly the `eligible` events.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseLatency {
    pub pending: usize,
    pub held: usize,
    pub blocked: usize,
    pub eligible: usize,
    pub max: usize,
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// The same leases on an outbox holding only the eligible events.
    pub alone_p50_ms: f64,
    pub alone_p99_ms: f64,
}

/// How the lease-latency phase lays out its pending events: `held` aggregates `held-NNNNN` whose
/// first event is leased for ten minutes, with the `blocked` rest spread behind them, then the
/// `eligible` events over `ready-NNNNN` aggregates (which sort after them).
#[derive(Debug, Clone)]
pub(super) struct LeaseLayout {
    pending: usize,
    held: usize,
    blocked: usize,
    eligible: usize,
}

/// An aggregate's events at `sequences`, each worth 1, keyed `AGGREGATE-SEQUENCE`.
fn stream(aggregate_id: String, sequences: std::ops::RangeInclusive<i64>) -> AggregateStream {
    let messages = sequences
        .map(|sequence| ledger_message(&aggregate_id, sequence, 1))
        .collect();
    AggregateStream {
        aggregate_id,
        messages,
    }
}

impl LeaseLayout {
    pub(super) fn new(pending: usize, held: usize) -> Result<LeaseLayout, BenchError> {
        let eligible = LEASE_MAX;
        if held == 0 || pending < held + eligible {
            return Err(BenchError::Verification(format!(
                "the lease phase needs at least one held event and at least {eligible} pending events besides the held ones (got --lease-pending {pending}, --lease-held {held})"
            )));
        }
        Ok(LeaseLayout {
            pending,
            held,
            blocked: pending - held - eligible,
            eligible,
        })
    }

    fn held_aggregate(index: usize) -> String {
        format!("held-{index:05}")
    }

    /// Each held aggregate's first event.
    fn held_streams(&self) -> Vec<AggregateStream> {
        (0..self.held)
            .map(|index| stream(Self::held_aggregate(index), 1..=1))
            .collect()
    }

    /// Each held aggregate's events after its first: sequences 2 ..= 1 + its share of `blocked`.
    fn blocked_streams(&self) -> Vec<AggregateStream> {
        (0..self.held)
            .map(|index| {
                let share =
                    self.blocked / self.held + usize::from(index < self.blocked % self.held);
                stream(Self::held_aggregate(index), 2..=1 + share as i64)
            })
            .collect()
    }

    fn eligible_streams(&self) -> Vec<AggregateStream> {
        (0..self.eligible.div_ceil(ELIGIBLE_PER_AGGREGATE))
            .map(|index| {
                let count =
                    ELIGIBLE_PER_AGGREGATE.min(self.eligible - index * ELIGIBLE_PER_AGGREGATE);
                stream(format!("ready-{index:05}"), 1..=count as i64)
            })
            .collect()
    }
}

/// One `POST /outbox/leases`: the events it handed out and when their lease ends.
async fn lease(
    http: &reqwest::Client,
    base: &str,
    owner: &str,
    max: usize,
    lease_ms: i64,
) -> Result<(usize, i64), BenchError> {
    let response = http
        .post(format!("{base}/outbox/leases"))
        .json(&json!({"owner": owner, "max": max, "leaseMs": lease_ms}))
        .send()
        .await?;
    let status = response.status();
    let body: serde_json::Value = response.json().await?;
    if status.as_u16() != 200 {
        return Err(BenchError::Verification(format!(
            "POST /outbox/leases answered {status}: {body}"
        )));
    }
    let events = body["events"].as_array().map_or(0, Vec::len);
    let until = body["leaseUntilMs"].as_i64().unwrap_or(0);
    Ok((events, until))
}

fn unix_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)
        })
}

/// The lease-latency phase: [`timed_leases`] on the layout, then on an outbox holding only its
/// eligible events (nothing held, nothing blocked) for comparison.
pub(super) async fn lease_latency(
    layout: &LeaseLayout,
    writers: usize,
) -> Result<LeaseLatency, BenchError> {
    let behind = timed_leases(layout, writers, true).await?;
    let alone = timed_leases(layout, writers, false).await?;
    Ok(LeaseLatency {
        pending: layout.pending,
        held: layout.held,
        blocked: layout.blocked,
        eligible: layout.eligible,
        max: LEASE_MAX,
        samples: behind.len(),
        p50_ms: percentile(&behind, 0.50),
        p99_ms: percentile(&behind, 0.99),
        alone_p50_ms: percentile(&alone, 0.50),
        alone_p99_ms: percentile(&alone, 0.99),
    })
}

/// On a fresh A: with `held`, the layout's events (the held aggregates' first events first,
/// leased for ten minutes, then the rest), else only its eligible ones; then [`LEASE_SAMPLES`]
/// timed leases of [`LEASE_MAX`] for the shortest lease each, one at a time, each after the
/// previous one's lease ended, so that every one meets the same outbox and must hand out exactly
/// the eligible events. The latencies, sorted.
async fn timed_leases(
    layout: &LeaseLayout,
    writers: usize,
    held: bool,
) -> Result<Vec<Duration>, BenchError> {
    let outbox = ServerUnderTest::start(Synchronous::Full, writers)?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let base = outbox.address.clone();
    if held {
        hold_first_events(&http, &base, layout, writers).await?;
        write_events(&http, &base, &layout.blocked_streams(), writers).await?;
    }
    write_events(&http, &base, &layout.eligible_streams(), writers).await?;
    let what = if held {
        "behind live leases"
    } else {
        "with nothing held"
    };
    let latencies = sample_leases(&http, &base, layout.eligible, what).await?;
    outbox.stop()?;
    Ok(latencies)
}

/// [`LEASE_SAMPLES`] leases one after another, each of which must hand out `eligible` events;
/// their latencies, sorted. `what` says where in the error and the progress line.
async fn sample_leases(
    http: &reqwest::Client,
    base: &str,
    eligible: usize,
    what: &str,
) -> Result<Vec<Duration>, BenchError> {
    let progress = Progress::start(
        &format!("bench relay: POST /outbox/leases {what}"),
        LEASE_SAMPLES as u64,
        "leases",
    );
    let counter = progress.counter();
    let mut latencies = Vec::with_capacity(LEASE_SAMPLES);
    for _ in 0..LEASE_SAMPLES {
        let started = Instant::now();
        let (events, until) = lease(http, base, "probe", LEASE_MAX, OUTBOX_MIN_LEASE_MS).await?;
        latencies.push(started.elapsed());
        if events != eligible {
            return Err(BenchError::Verification(format!(
                "a lease {what} handed out {events} events, not the {eligible} eligible ones"
            )));
        }
        counter.add(1);
        // A lease ending exactly now has ended: wait until the clock the server reads is past it.
        let left = until.saturating_sub(unix_millis()).saturating_add(1);
        tokio::time::sleep(Duration::from_millis(u64::try_from(left).unwrap_or(0))).await;
    }
    progress.finish();
    latencies.sort_unstable();
    Ok(latencies)
}

/// Records the held aggregates' first events and leases them to `holder` for ten minutes.
async fn hold_first_events(
    http: &reqwest::Client,
    base: &str,
    layout: &LeaseLayout,
    writers: usize,
) -> Result<(), BenchError> {
    write_events(http, base, &layout.held_streams(), writers).await?;
    let mut held = 0;
    while held < layout.held {
        let (events, _) = lease(http, base, "holder", LEASE_MAX, HOLD_MS).await?;
        if events == 0 {
            return Err(BenchError::Verification(format!(
                "only {held} of {} first events could be held",
                layout.held
            )));
        }
        held += events;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(streams: &[AggregateStream]) -> usize {
        streams.iter().map(|stream| stream.messages.len()).sum()
    }

    #[test]
    fn the_lease_layout_holds_exactly_the_pending_events_asked_for() {
        let layout = LeaseLayout::new(20_000, 1_000).expect("a layout");
        assert_eq!((layout.blocked, layout.eligible), (18_000, LEASE_MAX));
        let blocked = layout.blocked_streams();
        assert_eq!((blocked.len(), events(&blocked)), (1_000, 18_000));
        assert_eq!(events(&layout.eligible_streams()), LEASE_MAX);
        assert_eq!(events(&layout.held_streams()), 1_000);
        // An uneven share: the first aggregates take one more.
        let uneven = LeaseLayout::new(LEASE_MAX + 3 + 5, 3).expect("a layout");
        let shares: Vec<usize> = uneven
            .blocked_streams()
            .iter()
            .map(|stream| stream.messages.len())
            .collect();
        assert_eq!(shares, [2, 2, 1]);
        assert!(
            LeaseLayout::new(LEASE_MAX, 1).is_err(),
            "too few for the eligible ones"
        );
        assert!(LeaseLayout::new(20_000, 0).is_err(), "nothing held");
    }

    #[test]
    fn the_layouts_events_are_keyed_by_aggregate_and_sequence() {
        let layout = LeaseLayout::new(LEASE_MAX + 3, 1).expect("a layout");
        let blocked = layout.blocked_streams();
        let keys: Vec<(&str, i64)> = blocked[0]
            .messages
            .iter()
            .map(|m| (m.message_id.as_str(), m.sequence))
            .collect();
        assert_eq!(keys, [("held-00000-2", 2), ("held-00000-3", 3)]);
    }
}
