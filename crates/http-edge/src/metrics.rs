//! The application's metrics, in the Prometheus text format at `GET /metrics`.
//!
//! Every figure goes through the `metrics` facade into a recorder this application owns
//! (`metrics::with_local_recorder`), never a process-global one: the test binary runs many
//! servers in one process, and each must count only its own traffic.
//!
//! Labels come from enums and route templates only (door, verdict, action, outcome, status,
//! route, method, status class), never from ids, names or payloads, so the number of series is
//! bounded whatever the clients send.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::http::{Method, StatusCode};
use metrics::{Counter, Histogram, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use ordered_inbox::gaps::{GapResolutionError, GapResolved};
use ordered_inbox::model::ActionKind;
use ordered_inbox::records::ProducerRefusal;
use ordered_inbox::resolution::{ResolutionError, Resolved};
use ordered_inbox::sqlite::{BatchCommitted, WriterObserver};
use ordered_inbox::views::InboxHealth;
use ordered_inbox::{AggregateStatus, Door, Outcome};

/// The Prometheus text exposition format, version 0.0.4.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

pub const DELIVERIES: &str = "inbox_deliveries_total";
pub const RESOLUTIONS: &str = "inbox_resolutions_total";
pub const PRODUCER_REFUSALS: &str = "inbox_producer_refusals_total";
pub const AGGREGATES: &str = "inbox_aggregates";
pub const OPEN_DEAD_LETTERS: &str = "inbox_dead_letters_open";
pub const HELD_MESSAGES: &str = "inbox_held_messages";
pub const LONGEST_BLOCKED: &str = "inbox_longest_blocked_seconds";
pub const LONGEST_WAITING: &str = "inbox_longest_waiting_seconds";
pub const STORE_READABLE: &str = "inbox_store_readable";
pub const BATCH_SIZE: &str = "inbox_writer_batch_size";
pub const COMMIT_SECONDS: &str = "inbox_writer_commit_seconds";
pub const TRANSACTION_SECONDS: &str = "inbox_writer_transaction_seconds";
pub const QUEUE_DEPTH: &str = "inbox_writer_queue_depth";
pub const REPLAYED_BATCHES: &str = "inbox_writer_replayed_batches_total";
pub const OUTBOX_LEASED: &str = "outbox_leased_total";
pub const OUTBOX_ACKS: &str = "outbox_acks_total";
pub const HTTP_REQUESTS: &str = "http_requests_total";
pub const GATE_PUBLISHED: &str = "gate_output_published_total";
pub const GATE_PUBLISH_FAILURES: &str = "gate_publish_failures_total";
pub const GATE_OUTPUT_NOTIFICATIONS: &str = "gate_output_notifications_total";
pub const GATE_CONFIG_GENERATION: &str = "gate_config_generation";
pub const GATE_PUBLISHER_HOLDING: &str = "gate_publisher_holding";
pub const GATE_PUBLISHER_FENCED: &str = "gate_publisher_fenced_total";
pub const GATE_PUBLISHER_EPOCH: &str = "gate_publisher_epoch";
pub const GATE_OUTPUT_UNPUBLISHED: &str = "gate_output_unpublished_rows";
pub const GATE_OUTPUT_OLDEST_UNPUBLISHED: &str = "gate_output_oldest_unpublished_seconds";
pub const GATE_AGGREGATES_OVERDUE: &str = "gate_aggregates_overdue";
pub const HTTP_DURATION: &str = "http_request_duration_seconds";
pub const STORE_PRUNED: &str = "store_pruned_rows_total";
pub const STORE_BYTES: &str = "store_size_bytes";
pub const STORE_OLDEST_RETAINED: &str = "store_oldest_retained_seconds";
/// The kinds of rows retention prunes, as the `kind` label spells them.
pub const RETAINED_KINDS: &[&str] = &["identities", "timeline", "dead_letters", "output"];

/// The route label of a request that matched no route (404s, and refusals before routing).
pub const UNMATCHED_ROUTE: &str = "unmatched";

const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// What `GET /metrics` says of each series (`# HELP`, and `# UNIT` where there is one).
const DESCRIPTIONS: &[Description] = &[
    Description::counter(
        DELIVERIES,
        "Deliveries decided by the ordered inbox, by door and verdict",
    ),
    Description::counter(
        RESOLUTIONS,
        "Operator resolutions of dead letters and gaps, by action and outcome",
    ),
    Description::counter(
        PRODUCER_REFUSALS,
        "Producer deliveries refused before any decision, by reason (fenced: an older epoch)",
    ),
    Description::gauge(AGGREGATES, "Aggregates in each status, read at scrape time"),
    Description::gauge(OPEN_DEAD_LETTERS, "Open dead letters, read at scrape time"),
    Description::gauge(
        HELD_MESSAGES,
        "Messages held ahead of their turn (broker door), read at scrape time",
    ),
    Description::gauge(
        LONGEST_BLOCKED,
        "How long the longest-blocked aggregate has been blocked (0 when none is)",
    )
    .in_seconds(),
    Description::gauge(
        LONGEST_WAITING,
        "How long the longest-waiting aggregate has waited for a missing sequence (0 when none waits)",
    )
    .in_seconds(),
    Description::gauge(
        STORE_READABLE,
        "1 when the scrape could read the inbox's figures from the store, else 0",
    ),
    Description::histogram(
        BATCH_SIZE,
        "Units of work committed together by the store's writer (group commit)",
    ),
    Description::histogram(
        COMMIT_SECONDS,
        "Duration of the writer's COMMIT statement (with synchronous=full, the fsync)",
    )
    .in_seconds(),
    Description::histogram(
        TRANSACTION_SECONDS,
        "Duration of a group transaction, from BEGIN IMMEDIATE to the end of COMMIT",
    )
    .in_seconds(),
    Description::counter(
        REPLAYED_BATCHES,
        "Group transactions run a second time, each unit in its own savepoint, because a unit failed",
    ),
    Description::gauge(
        QUEUE_DEPTH,
        "Units of work waiting for the store's writer, read at scrape time",
    ),
    Description::counter(
        HTTP_REQUESTS,
        "HTTP requests answered, by route template, method and status class",
    ),
    Description::histogram(
        HTTP_DURATION,
        "Time from a request's arrival to its response head, by route template and method",
    )
    .in_seconds(),
    Description::counter(
        OUTBOX_LEASED,
        "General outbox events handed to relays under a lease (each lease of an event counts)",
    ),
    Description::counter(
        OUTBOX_ACKS,
        "General outbox acknowledgements per event, by verdict (acked, fenced, unknown)",
    ),
    Description::gauge(
        GATE_CONFIG_GENERATION,
        "The gate's configuration generation: 1 at start, one more at each reload that took effect",
    ),
    Description::counter(
        GATE_PUBLISHED,
        "Gate output rows acknowledged by JetStream and marked published",
    ),
    Description::counter(
        GATE_PUBLISH_FAILURES,
        "Gate publisher rounds that ended on a failure (NATS or the store), each retried after a pause",
    ),
    Description::counter(
        GATE_OUTPUT_NOTIFICATIONS,
        "Notifications that another gate of the PostgreSQL store committed output rows, each waking this gate's publisher",
    ),
    Description::gauge(
        GATE_PUBLISHER_HOLDING,
        "1 while this gate holds its store's publisher lease and publishes, 0 while it stands by",
    ),
    Description::gauge(
        GATE_AGGREGATES_OVERDUE,
        "Waiting aggregates past their held successor's type's gap_alert_after_ms (of the first 1000 waiting), read at scrape time",
    ),
    Description::counter(
        GATE_PUBLISHER_FENCED,
        "Times this gate's publisher was fenced: its lease taken over or a publish refused as stale",
    ),
    Description::gauge(
        GATE_PUBLISHER_EPOCH,
        "The epoch of the store's publisher lease: the one this gate holds, or while it stands by the store's (0: never taken), read at scrape time",
    ),
    Description::gauge(
        GATE_OUTPUT_UNPUBLISHED,
        "Gate output rows applied but not yet published, counted up to 10000 (10000 means 10000 or more), read at scrape time",
    ),
    Description::counter(
        STORE_PRUNED,
        "Rows the retention policy pruned, by kind (identities, timeline, dead_letters, output)",
    ),
    Description::gauge(
        STORE_BYTES,
        "The store's size: the SQLite file and its WAL, or PostgreSQL's inbox tables, read after each pruning round",
    ),
    Description::gauge(
        STORE_OLDEST_RETAINED,
        "Seconds since the oldest retained row of each kind was written (identities: applied; dead_letters: closed), read after each pruning round",
    ),
    Description::gauge(
        GATE_OUTPUT_OLDEST_UNPUBLISHED,
        "Seconds since the oldest unpublished gate output row was applied (0: none waits), read at scrape time",
    ),
];

/// One series' description for the recorder.
struct Description {
    kind: SeriesKind,
    name: &'static str,
    unit: Option<Unit>,
    text: &'static str,
}

#[derive(Clone, Copy)]
enum SeriesKind {
    Counter,
    Gauge,
    Histogram,
}

impl Description {
    const fn counter(name: &'static str, text: &'static str) -> Description {
        Description::of(SeriesKind::Counter, name, text)
    }

    const fn gauge(name: &'static str, text: &'static str) -> Description {
        Description::of(SeriesKind::Gauge, name, text)
    }

    const fn histogram(name: &'static str, text: &'static str) -> Description {
        Description::of(SeriesKind::Histogram, name, text)
    }

    const fn of(kind: SeriesKind, name: &'static str, text: &'static str) -> Description {
        Description {
            kind,
            name,
            unit: None,
            text,
        }
    }

    const fn in_seconds(self) -> Description {
        Description {
            unit: Some(Unit::Seconds),
            ..self
        }
    }

    /// Hands the description to the current recorder (see [`Metrics::with`]).
    fn describe(&self) {
        metrics::with_recorder(|recorder| {
            let (name, text) = (self.name.into(), self.text.into());
            match self.kind {
                SeriesKind::Counter => recorder.describe_counter(name, self.unit, text),
                SeriesKind::Gauge => recorder.describe_gauge(name, self.unit, text),
                SeriesKind::Histogram => recorder.describe_histogram(name, self.unit, text),
            }
        });
    }
}

/// A zero for every labelled counter series that can exist (the deliveries' series are
/// registered with the handles [`Metrics`] keeps), in the current recorder.
fn register_zero_counters() {
    metrics::counter!(OUTBOX_LEASED).increment(0);
    for verdict in ["acked", "fenced", "unknown"] {
        metrics::counter!(OUTBOX_ACKS, "verdict" => verdict).increment(0);
    }
    for reason in REFUSAL_REASONS.into_iter().chain([MALFORMED_HEADERS]) {
        metrics::counter!(PRODUCER_REFUSALS, "reason" => reason).increment(0);
    }
    for action in ActionKind::ALL {
        for outcome in ResolutionOutcome::ALL {
            metrics::counter!(RESOLUTIONS, "action" => action.as_str(), "outcome" => outcome.label())
                .increment(0);
        }
    }
    for outcome in ResolutionOutcome::OF_GAPS {
        metrics::counter!(RESOLUTIONS, "action" => GAP_SKIP, "outcome" => outcome.label())
            .increment(0);
    }
}

/// The `action` label of a gap resolution: an operator goes on without a missing range.
const GAP_SKIP: &str = "skip_gap";

/// This application's recorder and the handles it renders. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    /// The HTTP series by route template, registered on a route's first request: every request
    /// records into them, and looking a labelled series up in the recorder (building its key,
    /// hashing it, allocating the route label) cost more than the recording. Bounded by the
    /// routes × methods × status classes.
    http: RwLock<HashMap<String, RouteSeries>>,
    /// Every door's counter of every verdict, registered at start (each delivery counts into
    /// one; looking it up in the recorder cost more than the increment).
    deliveries: Vec<(Door, Verdict, Counter)>,
}

/// One route's request counters (by method and status class) and latency histograms (by method).
#[derive(Default)]
struct RouteSeries {
    requests: Vec<(&'static str, &'static str, Counter)>,
    durations: Vec<(&'static str, Histogram)>,
}

impl RouteSeries {
    fn find(&self, method: &str, class: &str) -> Option<(&Counter, &Histogram)> {
        let counter = self
            .requests
            .iter()
            .find(|(m, c, _)| *m == method && *c == class)?;
        let histogram = self.durations.iter().find(|(m, _)| *m == method)?;
        Some((&counter.2, &histogram.1))
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let builder = [BATCH_SIZE]
            .into_iter()
            .map(|name| (name, BATCH_BUCKETS))
            .chain(
                [COMMIT_SECONDS, TRANSACTION_SECONDS, HTTP_DURATION]
                    .into_iter()
                    .map(|name| (name, SECONDS_BUCKETS)),
            )
            .fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
                builder
                    .set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)
                    .expect("only an empty bucket list is refused, and these are constants")
            });
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        let deliveries = metrics::with_local_recorder(&recorder, || {
            [Door::Classroom, Door::General, Door::Broker]
                .into_iter()
                .flat_map(|door| Verdict::ALL.map(|verdict| (door, verdict)))
                .map(|(door, verdict)| {
                    let counter = metrics::counter!(
                        DELIVERIES,
                        "door" => door_label(door),
                        "verdict" => verdict.label()
                    );
                    // Zero from the start, so that a rate over a verdict that has not happened
                    // yet is 0 rather than absent.
                    counter.increment(0);
                    (door, verdict, counter)
                })
                .collect()
        });
        let metrics = Metrics {
            inner: Arc::new(Inner {
                recorder,
                handle,
                http: RwLock::new(HashMap::new()),
                deliveries,
            }),
        };
        metrics.describe_and_register();
        metrics
    }

    /// Runs `record` with this application's recorder as the current one.
    fn with<T>(&self, record: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.inner.recorder, record)
    }

    /// Descriptions, and a zero for every counter series that can exist, so that a rate over a
    /// verdict that has not happened yet is 0 rather than absent.
    fn describe_and_register(&self) {
        self.with(|| {
            for description in DESCRIPTIONS {
                description.describe();
            }
            register_zero_counters();
        });
    }

    /// Counts one delivery; `Err` is counted as the verdict `failed`.
    pub fn delivery<E>(&self, door: Door, outcome: Result<&Outcome, &E>) {
        let verdict = match outcome {
            Ok(outcome) => Verdict::of(outcome),
            Err(_) => Verdict::Failed,
        };
        let counted = self
            .inner
            .deliveries
            .iter()
            .find(|(d, v, _)| *d == door && *v == verdict);
        if let Some((_, _, counter)) = counted {
            counter.increment(1);
        }
    }

    /// Counts one resolution request that reached the inbox.
    pub fn resolution(&self, action: ActionKind, result: Result<&Resolved, &ResolutionError>) {
        let outcome = ResolutionOutcome::of(result);
        self.with(|| {
            metrics::counter!(RESOLUTIONS, "action" => action.as_str(), "outcome" => outcome.label())
                .increment(1);
        });
    }

    /// Counts one gap resolution request that reached the inbox.
    pub fn gap_resolution(&self, result: Result<&GapResolved, &GapResolutionError>) {
        let outcome = ResolutionOutcome::of_gap(result);
        self.with(|| {
            metrics::counter!(RESOLUTIONS, "action" => GAP_SKIP, "outcome" => outcome.label())
                .increment(1);
        });
    }

    /// Counts one producer delivery the inbox refused (nothing was written).
    pub fn producer_refusal(&self, door: Door, refusal: &ProducerRefusal) {
        let reason = refusal_reason(refusal);
        self.with(|| {
            metrics::counter!(PRODUCER_REFUSALS, "reason" => reason).increment(1);
            metrics::counter!(DELIVERIES, "door" => door_label(door), "verdict" => Verdict::Refused.label())
                .increment(1);
        });
    }

    /// Counts the events one lease handed out.
    pub fn outbox_leased(&self, events: usize) {
        self.with(|| metrics::counter!(OUTBOX_LEASED).increment(events as u64));
    }

    /// Counts one ack call's verdicts.
    pub fn outbox_acks(&self, acked: usize, fenced: usize, unknown: usize) {
        self.with(|| {
            for (verdict, count) in [("acked", acked), ("fenced", fenced), ("unknown", unknown)] {
                metrics::counter!(OUTBOX_ACKS, "verdict" => verdict).increment(count as u64);
            }
        });
    }

    /// The gate publisher's counters at zero: only a process that runs one shows them.
    pub fn register_gate_publisher(&self) {
        self.with(|| {
            metrics::counter!(GATE_PUBLISHED).increment(0);
            metrics::counter!(GATE_PUBLISH_FAILURES).increment(0);
            metrics::counter!(GATE_PUBLISHER_FENCED).increment(0);
            metrics::counter!(GATE_OUTPUT_NOTIFICATIONS).increment(0);
            metrics::gauge!(GATE_PUBLISHER_HOLDING).set(0.0);
        });
    }

    /// Rows of `kind` (one of [`RETAINED_KINDS`]) the retention policy pruned.
    pub fn pruned(&self, kind: &'static str, rows: u64) {
        self.with(|| metrics::counter!(STORE_PRUNED, "kind" => kind).increment(rows));
    }

    /// The store's size and, per kind, the age of its oldest retained row (`None`: none).
    pub fn retained(&self, bytes: u64, ages: &[(&'static str, Option<f64>)]) {
        self.with(|| {
            metrics::gauge!(STORE_BYTES).set(bytes as f64);
            for (kind, age) in ages {
                metrics::gauge!(STORE_OLDEST_RETAINED, "kind" => *kind).set(age.unwrap_or(0.0));
            }
        });
    }

    /// How many waiting aggregates are overdue, as a scrape just counted them.
    pub fn aggregates_overdue(&self, overdue: usize) {
        self.with(|| metrics::gauge!(GATE_AGGREGATES_OVERDUE).set(overdue as f64));
    }

    /// The gate's configuration generation now in use.
    pub fn config_generation(&self, generation: u64) {
        self.with(|| metrics::gauge!(GATE_CONFIG_GENERATION).set(generation as f64));
    }

    /// Shows whether this gate holds the store's publisher lease (1) or stands by (0).
    pub fn gate_publisher_holding(&self, holding: bool) {
        self.with(|| metrics::gauge!(GATE_PUBLISHER_HOLDING).set(if holding { 1.0 } else { 0.0 }));
    }

    /// Shows the epoch of the store's publisher lease, as this gate holds or sees it.
    pub fn gate_publisher_epoch(&self, epoch: i64) {
        self.with(|| metrics::gauge!(GATE_PUBLISHER_EPOCH).set(epoch as f64));
    }

    /// Shows the gate output's backlog: the unpublished rows (capped) and the oldest one's age.
    pub fn gate_output_backlog(&self, rows: i64, oldest_seconds: i64) {
        self.with(|| {
            metrics::gauge!(GATE_OUTPUT_UNPUBLISHED).set(rows as f64);
            metrics::gauge!(GATE_OUTPUT_OLDEST_UNPUBLISHED).set(oldest_seconds as f64);
        });
    }

    /// Counts one time this gate's publisher found itself fenced: its lease taken over, or a
    /// publish refused because another publisher had appended to the subject since.
    pub fn gate_publisher_fenced(&self) {
        self.with(|| metrics::counter!(GATE_PUBLISHER_FENCED).increment(1));
    }

    /// Counts the gate's output rows one publisher round got acknowledged and marked.
    pub fn gate_published(&self, rows: usize) {
        self.with(|| metrics::counter!(GATE_PUBLISHED).increment(rows as u64));
    }

    /// Counts one notification that another gate of the store committed output rows.
    pub fn gate_output_notification(&self) {
        self.with(|| metrics::counter!(GATE_OUTPUT_NOTIFICATIONS).increment(1));
    }

    /// Counts one publisher round that ended on a failure.
    pub fn gate_publish_failed(&self) {
        self.with(|| metrics::counter!(GATE_PUBLISH_FAILURES).increment(1));
    }

    /// Counts one broker message refused for malformed producer headers (terminated, never
    /// handed to the inbox). The HTTP door answers those 400, which its request metrics count;
    /// the broker door has no status code, so it counts them with the producer refusals.
    pub fn producer_headers_malformed(&self) {
        self.with(|| {
            metrics::counter!(PRODUCER_REFUSALS, "reason" => MALFORMED_HEADERS).increment(1);
        });
    }

    /// Counts one answered HTTP request. `route` is a route template (or [`UNMATCHED_ROUTE`]).
    pub fn http_request(&self, route: &str, method: &Method, status: StatusCode, took: Duration) {
        let method = method_label(method);
        let class = status_class(status);
        let record = |counter: &Counter, histogram: &Histogram| {
            counter.increment(1);
            histogram.record(took.as_secs_f64());
        };
        if let Ok(series) = self.inner.http.read()
            && let Some((counter, histogram)) =
                series.get(route).and_then(|s| s.find(method, class))
        {
            return record(counter, histogram);
        }
        let (counter, histogram) = self.with(|| {
            let route = route.to_owned();
            (
                metrics::counter!(
                    HTTP_REQUESTS,
                    "route" => route.clone(),
                    "method" => method,
                    "status" => class
                ),
                metrics::histogram!(HTTP_DURATION, "route" => route, "method" => method),
            )
        });
        record(&counter, &histogram);
        // A poisoned lock only loses the shortcut: the series are in the recorder either way.
        if let Ok(mut series) = self.inner.http.write() {
            let route = series.entry(route.to_owned()).or_default();
            if !route
                .requests
                .iter()
                .any(|(m, c, _)| *m == method && *c == class)
            {
                route.requests.push((method, class, counter));
            }
            if !route.durations.iter().any(|(m, _)| *m == method) {
                route.durations.push((method, histogram));
            }
        }
    }

    /// The observer the store's writer thread reports each committed batch to.
    pub fn writer_observer(&self) -> Arc<dyn WriterObserver> {
        self.with(|| {
            Arc::new(WriterMetrics {
                batch_size: metrics::histogram!(BATCH_SIZE),
                commit: metrics::histogram!(COMMIT_SECONDS),
                transaction: metrics::histogram!(TRANSACTION_SECONDS),
                replayed: metrics::counter!(REPLAYED_BATCHES),
            })
        })
    }

    /// Sets the gauges read at scrape time and renders every metric. `health` is `None` when the
    /// store could not be read.
    pub fn render(&self, health: Option<&InboxHealth>, queue_depth: u64) -> String {
        self.with(|| {
            metrics::gauge!(QUEUE_DEPTH).set(queue_depth as f64);
            metrics::gauge!(STORE_READABLE).set(if health.is_some() { 1.0 } else { 0.0 });
            if let Some(health) = health {
                for (status, count) in &health.aggregates {
                    metrics::gauge!(AGGREGATES, "status" => status_label(*status))
                        .set(*count as f64);
                }
                metrics::gauge!(OPEN_DEAD_LETTERS).set(health.open_dead_letters as f64);
                metrics::gauge!(HELD_MESSAGES).set(health.held_messages as f64);
                metrics::gauge!(LONGEST_BLOCKED).set(health.longest_blocked_seconds.unwrap_or(0.0));
                metrics::gauge!(LONGEST_WAITING).set(health.longest_waiting_seconds.unwrap_or(0.0));
            }
        });
        self.inner.handle.render()
    }

    /// Moves recorded histogram samples into their buckets. Rendering does it too; this keeps
    /// memory flat when nobody scrapes (every sample is held until then).
    pub fn upkeep(&self) {
        self.inner.handle.run_upkeep();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Records the writer's batches into this application's histograms (handles registered once, so
/// the writer thread never needs the recorder).
struct WriterMetrics {
    batch_size: Histogram,
    commit: Histogram,
    transaction: Histogram,
    replayed: Counter,
}

impl WriterObserver for WriterMetrics {
    fn batch_committed(&self, batch: BatchCommitted) {
        self.batch_size.record(batch.units as f64);
        self.commit.record(batch.commit.as_secs_f64());
        self.transaction.record(batch.transaction.as_secs_f64());
        if batch.replayed {
            self.replayed.increment(1);
        }
    }
}

/// A delivery's verdict as a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Applied,
    Replay,
    PayloadConflict,
    Gap,
    Stale,
    Quarantined,
    QuarantineFull,
    Held,
    HoldFull,
    /// A producer's delivery refused before any decision (fenced, not the owner …).
    Refused,
    /// The store failed; no verdict was reached.
    Failed,
}

impl Verdict {
    pub const ALL: [Verdict; 11] = [
        Verdict::Applied,
        Verdict::Replay,
        Verdict::PayloadConflict,
        Verdict::Gap,
        Verdict::Stale,
        Verdict::Quarantined,
        Verdict::QuarantineFull,
        Verdict::Held,
        Verdict::HoldFull,
        Verdict::Refused,
        Verdict::Failed,
    ];

    pub fn of(outcome: &Outcome) -> Verdict {
        match outcome {
            Outcome::Applied { .. } => Verdict::Applied,
            Outcome::Replay { .. } => Verdict::Replay,
            Outcome::PayloadConflict => Verdict::PayloadConflict,
            Outcome::Gap { .. } => Verdict::Gap,
            Outcome::Stale { .. } => Verdict::Stale,
            Outcome::Quarantined { .. } => Verdict::Quarantined,
            Outcome::QuarantineFull { .. } => Verdict::QuarantineFull,
            Outcome::Held { .. } => Verdict::Held,
            Outcome::HoldFull { .. } => Verdict::HoldFull,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Verdict::Applied => "applied",
            Verdict::Replay => "replay",
            Verdict::PayloadConflict => "payload_conflict",
            Verdict::Gap => "gap",
            Verdict::Stale => "stale",
            Verdict::Quarantined => "quarantined",
            Verdict::QuarantineFull => "quarantine_full",
            Verdict::Held => "held",
            Verdict::HoldFull => "hold_full",
            Verdict::Refused => "refused",
            Verdict::Failed => "failed",
        }
    }
}

/// What became of a resolution request, as a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResolutionOutcome {
    Resolved,
    Repeated,
    DryRun,
    NotFound,
    Conflict,
    ReplacementQuarantined,
    Unauthorized,
    Failed,
}

impl ResolutionOutcome {
    const ALL: [ResolutionOutcome; 8] = [
        ResolutionOutcome::Resolved,
        ResolutionOutcome::Repeated,
        ResolutionOutcome::DryRun,
        ResolutionOutcome::NotFound,
        ResolutionOutcome::Conflict,
        ResolutionOutcome::ReplacementQuarantined,
        ResolutionOutcome::Unauthorized,
        ResolutionOutcome::Failed,
    ];

    /// The outcomes a gap resolution can have: it carries no replacement to quarantine.
    const OF_GAPS: [ResolutionOutcome; 7] = [
        ResolutionOutcome::Resolved,
        ResolutionOutcome::Repeated,
        ResolutionOutcome::DryRun,
        ResolutionOutcome::NotFound,
        ResolutionOutcome::Conflict,
        ResolutionOutcome::Unauthorized,
        ResolutionOutcome::Failed,
    ];

    fn of_gap(result: Result<&GapResolved, &GapResolutionError>) -> ResolutionOutcome {
        match result {
            Ok(GapResolved::New(_)) => ResolutionOutcome::Resolved,
            Ok(GapResolved::Repeated(_)) => ResolutionOutcome::Repeated,
            Ok(GapResolved::DryRun(_)) => ResolutionOutcome::DryRun,
            Err(GapResolutionError::NotFound(_)) => ResolutionOutcome::NotFound,
            Err(GapResolutionError::Conflict(_)) => ResolutionOutcome::Conflict,
            Err(GapResolutionError::Unauthorized) => ResolutionOutcome::Unauthorized,
            Err(GapResolutionError::Store(_)) => ResolutionOutcome::Failed,
        }
    }

    fn of(result: Result<&Resolved, &ResolutionError>) -> ResolutionOutcome {
        match result {
            Ok(Resolved::New(_)) => ResolutionOutcome::Resolved,
            Ok(Resolved::Repeated(_)) => ResolutionOutcome::Repeated,
            Ok(Resolved::DryRun(_)) => ResolutionOutcome::DryRun,
            Err(ResolutionError::NotFound(_)) => ResolutionOutcome::NotFound,
            Err(ResolutionError::Conflict { .. }) => ResolutionOutcome::Conflict,
            Err(ResolutionError::ReplacementQuarantined(_)) => {
                ResolutionOutcome::ReplacementQuarantined
            }
            Err(ResolutionError::Unauthorized) => ResolutionOutcome::Unauthorized,
            Err(ResolutionError::Store(_)) => ResolutionOutcome::Failed,
        }
    }

    fn label(self) -> &'static str {
        match self {
            ResolutionOutcome::Resolved => "resolved",
            ResolutionOutcome::Repeated => "repeated",
            ResolutionOutcome::DryRun => "dry_run",
            ResolutionOutcome::NotFound => "not_found",
            ResolutionOutcome::Conflict => "conflict",
            ResolutionOutcome::ReplacementQuarantined => "replacement_quarantined",
            ResolutionOutcome::Unauthorized => "unauthorized",
            ResolutionOutcome::Failed => "failed",
        }
    }
}

/// The refusal label of a broker message whose producer headers are malformed.
const MALFORMED_HEADERS: &str = "malformed_headers";

/// Every label of [`refusal_reason`].
const REFUSAL_REASONS: [&str; 7] = [
    "fenced",
    "epoch_not_issued",
    "no_session",
    "revoked",
    "not_owner",
    "owner_required",
    "claim_requires_operator",
];

pub fn refusal_reason(refusal: &ProducerRefusal) -> &'static str {
    match refusal {
        ProducerRefusal::Fenced { .. } => "fenced",
        ProducerRefusal::EpochNotIssued { .. } => "epoch_not_issued",
        ProducerRefusal::NoSession => "no_session",
        ProducerRefusal::Revoked => "revoked",
        ProducerRefusal::NotOwner { .. } => "not_owner",
        ProducerRefusal::OwnerRequired => "owner_required",
        ProducerRefusal::ClaimRequiresOperator => "claim_requires_operator",
    }
}

pub fn door_label(door: Door) -> &'static str {
    match door {
        Door::Classroom => "classroom",
        Door::General => "general",
        Door::Broker => "broker",
    }
}

fn status_label(status: AggregateStatus) -> &'static str {
    status.as_str()
}

/// The standard methods by name; any other token a client invents is `other`.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => "other",
    }
}

fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// The JetStream consumer counts what it refuses itself like the inbox's own refusals.
impl ordered_inbox::jetstream::ConsumerObserver for Metrics {
    fn producer_headers_malformed(&self) {
        Metrics::producer_headers_malformed(self);
    }

    fn producer_refusal(&self, refusal: &ProducerRefusal) {
        Metrics::producer_refusal(self, Door::Broker, refusal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_instances_count_apart_and_render_histograms_with_buckets() {
        let first = Metrics::new();
        let second = Metrics::new();
        first.delivery::<()>(Door::General, Ok(&Outcome::Gap { expected: 2 }));
        first.http_request(
            "/aggregates/{aggregate_id}/messages",
            &Method::POST,
            StatusCode::CONFLICT,
            Duration::from_millis(3),
        );
        let rendered = first.render(None, 0);
        assert!(
            rendered.contains(r#"inbox_deliveries_total{door="general",verdict="gap"} 1"#),
            "{rendered}"
        );
        assert!(
            rendered.contains(r#"http_request_duration_seconds_bucket{route="/aggregates/{aggregate_id}/messages",method="POST",le="0.005"} 1"#),
            "{rendered}"
        );
        let other = second.render(None, 0);
        assert!(
            other.contains(r#"inbox_deliveries_total{door="general",verdict="gap"} 0"#),
            "{other}"
        );
    }

    #[test]
    fn each_route_method_and_status_class_counts_in_its_own_series() {
        let metrics = Metrics::new();
        let answers = [
            (Method::GET, StatusCode::OK),
            (Method::GET, StatusCode::OK),
            (Method::GET, StatusCode::NOT_FOUND),
            (Method::POST, StatusCode::OK),
        ];
        for route in ["/a", "/b"] {
            for (method, status) in &answers {
                metrics.http_request(route, method, *status, Duration::from_millis(1));
            }
        }
        let rendered = metrics.render(None, 0);
        for route in ["/a", "/b"] {
            for (method, status, count) in
                [("GET", "2xx", 2), ("GET", "4xx", 1), ("POST", "2xx", 1)]
            {
                let line = format!(
                    r#"http_requests_total{{route="{route}",method="{method}",status="{status}"}} {count}"#
                );
                assert!(rendered.contains(&line), "{line} in {rendered}");
            }
            let durations =
                format!(r#"http_request_duration_seconds_count{{route="{route}",method="GET"}} 3"#);
            assert!(rendered.contains(&durations), "{durations} in {rendered}");
        }
    }

    #[test]
    fn invented_methods_share_one_label() {
        let method = Method::from_bytes(b"BREW").unwrap();
        assert_eq!(method_label(&method), "other");
        assert_eq!(status_class(StatusCode::from_u16(599).unwrap()), "5xx");
    }
}
