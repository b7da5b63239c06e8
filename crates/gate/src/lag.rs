//! The output's lag as the gate itself sees it: a background task reads the output's backlog
//! and this gate's published rows every [`SAMPLE_EVERY`], and keeps the last [`SAMPLES_KEPT`]
//! intervals in memory (ten minutes), each as the rows that entered the output, the rows
//! published and the backlog at its end. `GET /v1/lag` answers them with the lag now (the
//! unpublished rows, the oldest one's age, the publisher's role), for a reader or an operator.
//!
//! Rows entering the output are not counted where they are written (an applied message's row is
//! written inside the inbox's transaction, which may roll back or be replayed, and the held
//! messages a delivery drains are applied with it): an interval's applied rows are its
//! published rows plus the backlog's growth, which the backlog's count (capped at
//! [`BACKLOG_COUNT_CAP`]) tells exactly while it stays below the cap.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{FromRef, State};
use serde::Serialize;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{Access, Reader};
use crate::health::publisher_role;
use crate::output::{BACKLOG_COUNT_CAP, OutputStore};
use crate::publisher::{HeldEpoch, PublishedRows};
use http_edge::error::AppError;
use http_edge::inbox::SharedInbox;

/// How often the sampler reads the output.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// The intervals kept: ten minutes at [`SAMPLE_EVERY`].
pub const SAMPLES_KEPT: usize = 120;

/// One interval between two readings of the output.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LagSample {
    /// When the interval ended (the gate's clock, UTC).
    pub at: String,
    /// How long the interval lasted.
    pub seconds: f64,
    /// Rows that entered the output in the interval; null when the backlog read at its cap at
    /// either end, so that its growth is not known.
    #[schema(required = true, minimum = 0)]
    pub applied: Option<u64>,
    /// Rows this gate's publisher marked published in the interval (0 on a gate standing by or
    /// without NATS).
    #[schema(minimum = 0)]
    pub published: u64,
    /// `applied` per second; null with `applied`.
    #[schema(required = true, minimum = 0)]
    pub applied_per_second: Option<f64>,
    /// `published` per second.
    #[schema(minimum = 0)]
    pub published_per_second: f64,
    /// The unpublished rows at the interval's end, counted up to 10000 (10000 means 10000 or
    /// more).
    #[schema(minimum = 0, maximum = 10000)]
    pub backlog: i64,
}

/// A reading of the output: when, this gate's published rows so far, the backlog then.
#[derive(Debug, Clone, Copy)]
struct Reading {
    at: Instant,
    published: u64,
    backlog: i64,
}

/// The samples kept, shared by the sampler and the route. Cheap to clone.
#[derive(Clone, Default)]
pub struct LagSamples(Arc<Mutex<Ring>>);

#[derive(Default)]
struct Ring {
    last: Option<Reading>,
    /// Applied rows an earlier interval read as fewer than none: the backlog was read while
    /// the publisher marked rows it had not counted yet. The next interval owes them back, so
    /// that the intervals add up to what entered the output.
    owed: i64,
    samples: VecDeque<LagSample>,
}

impl LagSamples {
    /// Records a reading taken at `at` (`stamp` in the gate's clock format): from the second
    /// one on, each reading closes an interval.
    fn record(&self, at: Instant, stamp: String, published: u64, backlog: i64) {
        let reading = Reading {
            at,
            published,
            backlog,
        };
        let mut ring = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(last) = ring.last.replace(reading) else {
            return;
        };
        let seconds = reading.at.duration_since(last.at).as_secs_f64().max(0.001);
        let published = reading.published.saturating_sub(last.published);
        let known = last.backlog < BACKLOG_COUNT_CAP && reading.backlog < BACKLOG_COUNT_CAP;
        let applied = if known {
            let grown = i64::try_from(published).unwrap_or(i64::MAX) + reading.backlog
                - last.backlog
                - ring.owed;
            ring.owed = (-grown).max(0);
            Some(u64::try_from(grown).unwrap_or(0))
        } else {
            ring.owed = 0;
            None
        };
        let rate = |rows: u64| rounded(rows as f64 / seconds);
        let sample = LagSample {
            at: stamp,
            seconds: rounded(seconds),
            applied,
            published,
            applied_per_second: applied.map(rate),
            published_per_second: rate(published),
            backlog: reading.backlog,
        };
        if ring.samples.len() == SAMPLES_KEPT {
            ring.samples.pop_front();
        }
        ring.samples.push_back(sample);
    }

    /// The samples kept, the oldest first.
    pub fn samples(&self) -> Vec<LagSample> {
        let ring = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        ring.samples.iter().cloned().collect()
    }
}

/// A figure to the thousandth, as the answer shows it.
fn rounded(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

/// Reads the output every [`SAMPLE_EVERY`] (the first time at once) into `samples` until `stop`;
/// a read the store refuses is logged and skipped (the next interval spans the gap).
pub async fn sample(
    samples: LagSamples,
    output: OutputStore,
    published: PublishedRows,
    stop: CancellationToken,
) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        let read = tokio::select! {
            () = stop.cancelled() => return,
            read = output.backlog() => read,
        };
        match read {
            Ok(backlog) => samples.record(
                Instant::now(),
                ordered_inbox::clock::now(),
                published.get(),
                backlog.rows,
            ),
            Err(error) => {
                tracing::warn!(target: "production_lab::gate", %error, "the lag sample could not read the output's backlog");
            }
        }
    }
}

/// What `GET /v1/lag` reads.
#[derive(Clone)]
pub struct LagState {
    pub samples: LagSamples,
    pub output: OutputStore,
    /// The epoch this gate's publisher holds, when it runs one (with NATS).
    pub publisher: Option<HeldEpoch>,
    pub access: Access,
    pub inbox: SharedInbox,
}

impl FromRef<LagState> for Access {
    fn from_ref(state: &LagState) -> Access {
        state.access.clone()
    }
}

impl FromRef<LagState> for SharedInbox {
    fn from_ref(state: &LagState) -> SharedInbox {
        state.inbox.clone()
    }
}

/// `GET /v1/lag`, documented.
pub fn routes(state: LagState) -> OpenApiRouter {
    OpenApiRouter::new().routes(routes!(lag)).with_state(state)
}

/// The publisher's role and the lease's epoch, as `/ready` shows them.
#[derive(Serialize, ToSchema)]
struct PublisherRole {
    /// `holder` (it publishes), `standby` (another gate of the store does) or `absent` (no NATS).
    #[schema(pattern = "^(holder|standby|absent)$")]
    role: &'static str,
    /// The lease's epoch: the one held, or the store's while standing by (null when the store
    /// does not answer), 0 without a publisher.
    #[schema(required = true)]
    epoch: Option<i64>,
}

/// The output's lag now and over the last minutes.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Lag {
    /// Output rows applied but not yet published, counted up to 10000 (10000 means 10000 or
    /// more).
    #[schema(minimum = 0, maximum = 10000)]
    unpublished_rows: i64,
    /// Seconds since the oldest unpublished row was applied (0: none waits).
    #[schema(minimum = 0)]
    oldest_unpublished_seconds: i64,
    publisher: PublisherRole,
    /// Seconds between two samples.
    #[schema(minimum = 1)]
    sample_every_seconds: u64,
    /// The intervals of the last minutes (at most 120), the oldest first; empty until the
    /// second reading after the gate started.
    samples: Vec<LagSample>,
}

/// The output's lag: the unpublished rows and the oldest one's age, read now; the publisher's
/// role; and the gate's samples of the last ten minutes (applied and published rows per second,
/// the backlog).
#[utoipa::path(get, path = "/v1/lag", tag = "operating",
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "The lag now and the samples of the last minutes", body = Lag),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ))]
async fn lag(_reader: Reader, State(state): State<LagState>) -> Result<Json<Lag>, AppError> {
    let backlog = state.output.backlog().await?;
    let now = ordered_inbox::clock::now();
    let oldest = backlog.oldest_applied_at.map_or(0, |applied_at| {
        ordered_inbox::clock::seconds_between(&applied_at, &now).max(0)
    });
    let (role, epoch) = publisher_role(state.publisher.as_ref(), &state.output).await;
    Ok(Json(Lag {
        unpublished_rows: backlog.rows,
        oldest_unpublished_seconds: oldest,
        publisher: PublisherRole { role, epoch },
        sample_every_seconds: SAMPLE_EVERY.as_secs(),
        samples: state.samples.samples(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(start: Instant, seconds: u64) -> Instant {
        start + Duration::from_secs(seconds)
    }

    #[test]
    fn the_first_reading_opens_an_interval_and_the_next_closes_it_with_its_rates() {
        let samples = LagSamples::default();
        let start = Instant::now();
        samples.record(start, "t0".into(), 0, 0);
        assert!(samples.samples().is_empty());
        samples.record(at(start, 5), "t1".into(), 10, 5);
        let [sample] = samples.samples().try_into().unwrap();
        assert_eq!(sample.at, "t1");
        assert_eq!(sample.applied, Some(15));
        assert_eq!(sample.published, 10);
        assert_eq!(sample.applied_per_second, Some(3.0));
        assert_eq!(sample.published_per_second, 2.0);
        assert_eq!(sample.backlog, 5);
    }

    #[test]
    fn a_backlog_read_short_of_the_publishers_count_is_owed_by_the_next_interval() {
        let samples = LagSamples::default();
        let start = Instant::now();
        samples.record(start, "t0".into(), 0, 10);
        // The publisher counted 4 rows the backlog read had still held: -4 + 0 applied.
        samples.record(at(start, 5), "t1".into(), 0, 6);
        samples.record(at(start, 10), "t2".into(), 4, 6);
        let applied: Vec<_> = samples.samples().iter().map(|s| s.applied).collect();
        assert_eq!(applied, [Some(0), Some(0)]);
        samples.record(at(start, 15), "t3".into(), 10, 6);
        assert_eq!(samples.samples()[2].applied, Some(6));
    }

    #[test]
    fn a_backlog_at_its_cap_leaves_the_applied_rows_unknown() {
        let samples = LagSamples::default();
        let start = Instant::now();
        samples.record(start, "t0".into(), 0, 9_000);
        samples.record(at(start, 5), "t1".into(), 0, BACKLOG_COUNT_CAP);
        let [sample] = samples.samples().try_into().unwrap();
        assert_eq!(sample.applied, None);
        assert_eq!(sample.applied_per_second, None);
    }

    #[test]
    fn the_ring_keeps_the_last_ten_minutes() {
        let samples = LagSamples::default();
        let start = Instant::now();
        for step in 0..=(SAMPLES_KEPT as u64 + 5) {
            samples.record(at(start, step * 5), format!("t{step}"), step, 0);
        }
        let kept = samples.samples();
        assert_eq!(kept.len(), SAMPLES_KEPT);
        assert_eq!(kept[0].at, "t6");
        assert_eq!(kept[SAMPLES_KEPT - 1].at, format!("t{}", SAMPLES_KEPT + 5));
    }
}
