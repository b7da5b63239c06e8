//! The privacy lab: an observation logs `Handled {operation} for {identity}` and counts
//! `production.operations` with a bounded `operation` label; the raw email reaches neither.
//!
//! Both signals go through the ordinary facades — a `tracing` event and a `metrics` counter —
//! but into this application's own subscriber and recorder (`tracing::dispatcher::with_default`,
//! `metrics::with_local_recorder`), never process-global ones: the test suite runs many servers
//! in one process, and each must see only its own evidence.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{FromRef, State};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::StartupError;
use crate::http::error::Query;
use crate::labs::context::StartupContext;

/// The log category (tracing target) the evidence keeps, named as in the seed.
pub const PRIVACY_TARGET: &str = "ProductionPrivacy";
pub const OPERATIONS_METRIC: &str = "production.operations";
const OPERATION_LABEL: &str = "operation";
/// How many privacy log lines the evidence keeps.
pub const EVIDENCE_CAPACITY: usize = 32;

/// The only operation labels that can exist: anything else a client sends becomes `other`, so
/// the metric's label set stays bounded whatever the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    Quote,
    Search,
    Other,
}

impl Operation {
    /// Exact, case-sensitive match, as the seed's.
    fn classify(raw: Option<&str>) -> Operation {
        match raw {
            Some("quote") => Operation::Quote,
            Some("search") => Operation::Search,
            _ => Operation::Other,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Operation::Quote => "quote",
            Operation::Search => "search",
            Operation::Other => "other",
        }
    }
}

/// The privacy lab's own log and metrics; cheap to clone.
#[derive(Clone)]
pub struct PrivacyLab {
    /// A subscriber of this application's own: the evidence layer and nothing else.
    log: tracing::Dispatch,
    messages: Arc<Mutex<VecDeque<String>>>,
    metrics: Arc<OperationRecorder>,
}

impl PrivacyLab {
    pub fn new(_context: &StartupContext<'_>) -> Result<Self, StartupError> {
        let messages = Arc::new(Mutex::new(VecDeque::with_capacity(EVIDENCE_CAPACITY)));
        let layer = EvidenceLayer {
            messages: messages.clone(),
        };
        Ok(PrivacyLab {
            log: tracing::Dispatch::new(tracing_subscriber::registry().with(layer)),
            messages,
            metrics: Arc::new(OperationRecorder::default()),
        })
    }

    /// Logs and counts one observation. Only the bounded label and the word `redacted` or
    /// `anonymous` are passed on; the email itself is never handed to either facade.
    fn record(&self, operation: Operation, identity: &'static str) {
        metrics::with_local_recorder(self.metrics.as_ref(), || {
            metrics::counter!(OPERATIONS_METRIC, OPERATION_LABEL => operation.label()).increment(1);
        });
        tracing::dispatcher::with_default(&self.log, || {
            tracing::info!(
                target: PRIVACY_TARGET,
                operation = operation.label(),
                identity,
                "Handled {} for {}",
                operation.label(),
                identity
            );
        });
    }

    fn messages(&self) -> Vec<String> {
        let messages = self.messages.lock().unwrap_or_else(PoisonError::into_inner);
        messages.iter().cloned().collect()
    }
}

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    PrivacyLab: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(observe))
        .routes(routes!(evidence))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct ObserveQuery {
    /// An email: it reaches neither the log nor the metric, only the word `redacted`.
    email: Option<String>,
    /// `quote` or `search`; anything else is counted as `other`.
    operation: Option<String>,
}

/// What was logged and counted for the observation.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Observation {
    /// `quote`, `search` or `other`.
    operation: String,
    /// `redacted` when an email was given, else `anonymous`.
    identity: String,
}

/// The lab's own log lines and metric labels.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct PrivacyEvidence {
    /// The last 32 privacy log lines.
    messages: Vec<String>,
    /// The operation labels counted so far.
    metric_labels: Vec<String>,
}

// Not derived: a Debug print of the query would show the email.
impl fmt::Debug for ObserveQuery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObserveQuery")
            .field("email", &self.email.as_ref().map(|_| "<redacted>"))
            .field("operation", &self.operation)
            .finish()
    }
}

#[utoipa::path(get, path = "/privacy/observe", tag = "privacy", params(ObserveQuery), responses(
    (status = 200, description = "Logged and counted, with the email redacted", body = Observation),
))]
async fn observe(
    State(privacy): State<PrivacyLab>,
    Query(query): Query<ObserveQuery>,
) -> axum::Json<Value> {
    let operation = Operation::classify(query.operation.as_deref());
    let identity = match query.email.as_deref() {
        Some(email) if !email.is_empty() => "redacted",
        _ => "anonymous",
    };
    privacy.record(operation, identity);
    axum::Json(json!({"operation": operation.label(), "identity": identity}))
}

#[utoipa::path(get, path = "/privacy/evidence", tag = "privacy", operation_id = "privacy_evidence", responses(
    (status = 200, description = "The lab's log lines and metric labels", body = PrivacyEvidence),
))]
async fn evidence(State(privacy): State<PrivacyLab>) -> axum::Json<Value> {
    axum::Json(json!({
        "messages": privacy.messages(),
        "metricLabels": privacy.metrics.labels(),
    }))
}

/// Keeps the last [`EVIDENCE_CAPACITY`] messages of the privacy target and prints each to the
/// console, as the seed's log provider does; events of other targets are not its business.
struct EvidenceLayer {
    messages: Arc<Mutex<VecDeque<String>>>,
}

impl<S: Subscriber> Layer<S> for EvidenceLayer {
    fn on_event(&self, event: &Event<'_>, _context: Context<'_, S>) {
        if event.metadata().target() != PRIVACY_TARGET {
            return;
        }
        let mut visitor = MessageVisitor::default();
        event.record(&mut visitor);
        let Some(message) = visitor.message else {
            return;
        };
        println!("{message}");
        let mut messages = self.messages.lock().unwrap_or_else(PoisonError::into_inner);
        if messages.len() == EVIDENCE_CAPACITY {
            messages.pop_front();
        }
        messages.push_back(message);
    }
}

#[derive(Default)]
struct MessageVisitor {
    message: Option<String>,
}

impl Visit for MessageVisitor {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            // The message is `format_args!`, whose Debug is its plain text.
            self.message = Some(format!("{value:?}"));
        }
    }
}

/// This application's metrics recorder: counts `production.operations` per `operation` label and
/// ignores every other metric.
#[derive(Default)]
struct OperationRecorder {
    counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
}

impl OperationRecorder {
    /// The labels seen so far, in ordinal order.
    fn labels(&self) -> Vec<String> {
        let counters = self.counters.lock().unwrap_or_else(PoisonError::into_inner);
        counters
            .iter()
            .filter(|(_, count)| count.load(Ordering::Relaxed) > 0)
            .map(|(label, _)| label.clone())
            .collect()
    }
}

impl Recorder for OperationRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() != OPERATIONS_METRIC {
            return Counter::noop();
        }
        let Some(label) = key
            .labels()
            .find(|label| label.key() == OPERATION_LABEL)
            .map(|label| label.value().to_owned())
        else {
            return Counter::noop();
        };
        let mut counters = self.counters.lock().unwrap_or_else(PoisonError::into_inner);
        // `AtomicU64` is a `CounterFn`, so the handle increments the shared cell directly.
        Counter::from_arc(counters.entry(label).or_default().clone())
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lab() -> PrivacyLab {
        let messages = Arc::new(Mutex::new(VecDeque::new()));
        PrivacyLab {
            log: tracing::Dispatch::new(tracing_subscriber::registry().with(EvidenceLayer {
                messages: messages.clone(),
            })),
            messages,
            metrics: Arc::new(OperationRecorder::default()),
        }
    }

    #[test]
    fn operations_outside_the_known_set_become_other() {
        assert_eq!(Operation::classify(Some("quote")), Operation::Quote);
        assert_eq!(Operation::classify(Some("search")), Operation::Search);
        assert_eq!(Operation::classify(Some("Quote")), Operation::Other);
        assert_eq!(Operation::classify(Some("a@b.example")), Operation::Other);
        assert_eq!(Operation::classify(None), Operation::Other);
    }

    #[test]
    fn two_labs_keep_separate_evidence() {
        let first = lab();
        let second = lab();
        first.record(Operation::Quote, "redacted");
        second.record(Operation::Search, "anonymous");
        assert_eq!(first.messages(), ["Handled quote for redacted"]);
        assert_eq!(first.metrics.labels(), ["quote"]);
        assert_eq!(second.messages(), ["Handled search for anonymous"]);
        assert_eq!(second.metrics.labels(), ["search"]);
        first.record(Operation::Quote, "anonymous");
        let counts = first.metrics.counters.lock().unwrap();
        assert_eq!(counts["quote"].load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_evidence_keeps_the_last_32_messages() {
        let lab = lab();
        for _ in 0..EVIDENCE_CAPACITY {
            lab.record(Operation::Other, "anonymous");
        }
        lab.record(Operation::Quote, "redacted");
        let messages = lab.messages();
        assert_eq!(messages.len(), EVIDENCE_CAPACITY);
        assert_eq!(
            messages.last().map(String::as_str),
            Some("Handled quote for redacted")
        );
    }
}
