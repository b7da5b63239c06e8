//! The worker lab: requests hand work to one background task through a bounded queue of four.
//! A full queue answers 429 at once instead of letting requests pile up; each item runs in a
//! scope of its own that is always disposed; a client that disconnects cancels its item; and
//! shutdown answers what is still queued before the process exits.
//!
//! Routes: `POST /worker`, `GET /worker/evidence`, `POST /lab/worker/gate/{close|open}`,
//! `GET /lab/worker/queue`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::StartupError;
use crate::http::error::{AppError, Json, Path, RequestBody, with_retry_after};
use crate::labs::context::StartupContext;
use crate::labs::latch::WorkLatch;

/// How many items may wait for the worker (the one it holds is not counted), as the seed's.
pub const QUEUE_CAPACITY: usize = 4;
/// The pretend work each item does once it has passed the gate.
const PROCESSING_DELAY: Duration = Duration::from_millis(20);
const MAX_VALUE: i32 = 10;

/// The worker lab's own state: the queue's sending side, the scope counters and the gate.
#[derive(Clone)]
pub struct WorkerLab {
    queue: mpsc::Sender<WorkItem>,
    evidence: Arc<ScopeEvidence>,
    gate: WorkLatch,
}

impl WorkerLab {
    /// Creates the queue and starts the worker on the shared task tracker; it stops when
    /// shutdown begins (or when every sender is gone).
    pub fn new(context: &StartupContext<'_>) -> Result<Self, StartupError> {
        let (queue, items) = mpsc::channel(QUEUE_CAPACITY);
        let evidence = Arc::new(ScopeEvidence::default());
        let gate = WorkLatch::default();
        let worker = Worker {
            items,
            evidence: evidence.clone(),
            gate: gate.clone(),
            shutdown: context.shutdown.clone(),
        };
        context.tasks.spawn(worker.run());
        Ok(WorkerLab {
            queue,
            evidence,
            gate,
        })
    }

    /// The scope counters right now.
    pub fn evidence(&self) -> ScopeCounts {
        self.evidence.counts()
    }
}

/// Counts of per-item scopes. At rest `created == disposed` and `live == 0`.
#[derive(Default)]
struct ScopeEvidence {
    created: AtomicU64,
    disposed: AtomicU64,
    live: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScopeCounts {
    pub created: u64,
    pub disposed: u64,
    pub live: u64,
}

impl ScopeEvidence {
    fn counts(&self) -> ScopeCounts {
        ScopeCounts {
            created: self.created.load(Ordering::SeqCst),
            disposed: self.disposed.load(Ordering::SeqCst),
            live: self.live.load(Ordering::SeqCst),
        }
    }
}

/// One item's scope. Disposal is its `Drop`, so it happens on every path out of the work:
/// success, cancellation, shutdown, even a panic.
struct ItemScope {
    id: u64,
    evidence: Arc<ScopeEvidence>,
}

impl ItemScope {
    fn create(evidence: &Arc<ScopeEvidence>) -> Self {
        evidence.live.fetch_add(1, Ordering::SeqCst);
        let id = evidence.created.fetch_add(1, Ordering::SeqCst) + 1;
        ItemScope {
            id,
            evidence: evidence.clone(),
        }
    }

    /// The work itself: wait for the lab gate, pretend to be busy, double the value.
    async fn process(&self, value: i32, gate: &WorkLatch) -> WorkReceipt {
        gate.passed().await;
        tokio::time::sleep(PROCESSING_DELAY).await;
        WorkReceipt {
            value: value * 2,
            scope_id: self.id,
        }
    }
}

impl Drop for ItemScope {
    fn drop(&mut self) {
        self.evidence.live.fetch_sub(1, Ordering::SeqCst);
        self.evidence.disposed.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct WorkReceipt {
    value: i32,
    scope_id: u64,
}

/// Why an accepted item produced no receipt.
#[derive(Debug, Clone, Copy, thiserror::Error)]
enum WorkFailure {
    #[error("the client went away")]
    Cancelled,
    #[error("the worker is shutting down")]
    ShuttingDown,
}

/// A queued request: its value, its request's cancellation, and where to send the answer.
struct WorkItem {
    value: i32,
    cancelled: CancellationToken,
    reply: oneshot::Sender<Result<WorkReceipt, WorkFailure>>,
}

struct Worker {
    items: mpsc::Receiver<WorkItem>,
    evidence: Arc<ScopeEvidence>,
    gate: WorkLatch,
    shutdown: CancellationToken,
}

impl Worker {
    async fn run(mut self) {
        loop {
            let item = tokio::select! {
                biased;
                () = self.shutdown.cancelled() => break,
                item = self.items.recv() => match item {
                    Some(item) => item,
                    None => return,
                },
            };
            self.handle(item).await;
        }
        // Shutdown: refuse new items, then answer every queued one so no request waits forever.
        self.items.close();
        while let Ok(item) = self.items.try_recv() {
            let _ = item.reply.send(Err(WorkFailure::ShuttingDown));
        }
    }

    async fn handle(&self, item: WorkItem) {
        let WorkItem {
            value,
            cancelled,
            reply,
        } = item;
        let scope = ItemScope::create(&self.evidence);
        let outcome = tokio::select! {
            biased;
            () = self.shutdown.cancelled() => Err(WorkFailure::ShuttingDown),
            () = cancelled.cancelled() => Err(WorkFailure::Cancelled),
            receipt = scope.process(value, &self.gate) => Ok(receipt),
        };
        // Dispose before answering, so a client that has its answer sees the scope counted.
        drop(scope);
        if let Err(failure) = &outcome {
            tracing::info!(target: "production_lab::worker", %failure, "work item not completed");
        }
        // Nobody may be listening any more (the client went away); that is fine.
        let _ = reply.send(outcome);
    }
}

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    WorkerLab: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(enqueue))
        .routes(routes!(evidence))
        .routes(routes!(set_gate))
        .routes(routes!(queue_state))
}

/// One item of work. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
struct WorkRequest {
    #[schema(minimum = 1, maximum = 10)]
    value: i32,
}

impl RequestBody for WorkRequest {
    const FIELDS: &'static [&'static str] = &["value"];
}

/// Hands the value to the background worker and answers with its result.
#[utoipa::path(post, path = "/worker", tag = "worker", request_body = WorkRequest, responses(
    (status = 200, description = "The doubled value and the scope that computed it", body = WorkReceipt),
    (status = 400, response = crate::http::openapi::BadRequest),
    (status = 429, description = "Four items already wait for the worker: try again later", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    (status = 503, description = "The worker is shutting down", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
))]
async fn enqueue(
    State(lab): State<WorkerLab>,
    Json(input): Json<WorkRequest>,
) -> Result<Response, AppError> {
    if !(1..=MAX_VALUE).contains(&input.value) {
        return Err(AppError::bad_request(format!(
            "value must be from 1 to {MAX_VALUE}"
        )));
    }
    // If the client disconnects, hyper drops this future, the guard drops with it and the token
    // tells the worker to abandon the item.
    let cancelled = CancellationToken::new();
    let _cancel_on_disconnect = cancelled.clone().drop_guard();
    let (reply, answer) = oneshot::channel();
    let item = WorkItem {
        value: input.value,
        cancelled,
        reply,
    };
    match lab.queue.try_send(item) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            let full = AppError::problem_with_detail(
                StatusCode::TOO_MANY_REQUESTS,
                "The work queue is full",
                format!(
                    "{QUEUE_CAPACITY} items are already waiting for the worker; try again later"
                ),
            );
            // An item takes the worker well under a second.
            return Ok(with_retry_after(full.into_response(), 1));
        }
        Err(TrySendError::Closed(_)) => return Err(shutting_down()),
    }
    match answer.await {
        Ok(Ok(receipt)) => Ok(axum::Json(receipt).into_response()),
        // The worker stopped (shutdown) before or while handling the item.
        Ok(Err(_)) | Err(_) => Err(shutting_down()),
    }
}

fn shutting_down() -> AppError {
    AppError::problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "The worker is shutting down",
    )
}

#[utoipa::path(get, path = "/worker/evidence", tag = "worker", operation_id = "worker_evidence", responses(
    (status = 200, description = "Scopes created, disposed and live", body = ScopeCounts),
))]
async fn evidence(State(lab): State<WorkerLab>) -> Response {
    axum::Json(lab.evidence()).into_response()
}

/// Closes or opens the gate the worker waits at before each item (a lab control).
#[utoipa::path(post, path = "/lab/worker/gate/{action}", tag = "worker", operation_id = "worker_set_gate",
    params(("action" = inline(crate::labs::latch::GateAction), Path, description = "`close` holds the work until `open`")),
    responses(
        (status = 204, description = "The gate is in that position"),
        (status = 400, response = crate::http::openapi::BadRequest),
    ),
)]
async fn set_gate(
    State(lab): State<WorkerLab>,
    Path(action): Path<String>,
) -> Result<Response, AppError> {
    lab.gate.apply(&action)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Serialize, ToSchema)]
struct QueueState {
    capacity: usize,
    queued: usize,
    gate: &'static str,
}

/// For learners filling the queue: how many items wait, of how many, and the gate's position.
#[utoipa::path(get, path = "/lab/worker/queue", tag = "worker", responses(
    (status = 200, description = "Items waiting, the queue's capacity, and the gate's position", body = QueueState),
))]
async fn queue_state(State(lab): State<WorkerLab>) -> Response {
    let queue = &lab.queue;
    axum::Json(QueueState {
        capacity: queue.max_capacity(),
        // Permits come back when the worker takes an item, so this counts only waiting items.
        queued: queue.max_capacity().saturating_sub(queue.capacity()),
        gate: if lab.gate.is_open() { "open" } else { "closed" },
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_is_disposed_when_dropped() {
        let evidence = Arc::new(ScopeEvidence::default());
        let first = ItemScope::create(&evidence);
        let second = ItemScope::create(&evidence);
        assert_eq!((first.id, second.id), (1, 2));
        assert_eq!(
            evidence.counts(),
            ScopeCounts {
                created: 2,
                disposed: 0,
                live: 2
            }
        );
        drop(first);
        drop(second);
        assert_eq!(
            evidence.counts(),
            ScopeCounts {
                created: 2,
                disposed: 2,
                live: 0
            }
        );
    }
}
