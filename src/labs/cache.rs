//! The cache lab: a catalog row read through an in-process cache and invalidated only after its
//! write has committed, and a shared value whose concurrent callers all wait on one factory run
//! (stampede protection), with a lab gate that holds the factory so the stampede can be watched.
//!
//! Routes: `GET|POST /cache/catalog`, `GET /cache/shared`, `GET /cache/stats`,
//! `POST /lab/cache/gate/{close|open}`, `POST /lab/cache/reset`.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use moka::future::Cache;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::StartupError;
use crate::http::aspnet::{is_blank_or_longer_than, query_flag};
use crate::http::error::{AppError, Json, Path, Query, RequestBody};
use crate::labs::context::StartupContext;
use crate::labs::latch::WorkLatch;
use crate::store::Store;

/// How long a loaded value stays fresh, as the seed's one-minute expiration.
pub const TIME_TO_LIVE: Duration = Duration::from_secs(60);
/// The longest catalog name, counted in UTF-16 code units as .NET counts string length.
const MAX_NAME: usize = 30;

/// The cache lab's own state: two read-through entries, their counters and the factory gate.
#[derive(Clone)]
pub struct CacheLab {
    catalog: CoalescedEntry<CatalogView>,
    shared: CoalescedEntry<SharedView>,
    probe: Arc<CacheProbe>,
}

impl CacheLab {
    pub fn new(context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(CacheLab {
            catalog: CoalescedEntry::new(context.tasks.clone(), context.shutdown.clone()),
            shared: CoalescedEntry::new(context.tasks.clone(), context.shutdown.clone()),
            probe: Arc::new(CacheProbe::default()),
        })
    }

    /// The callers of `GET /cache/shared`: how many wait for the value right now, and how many
    /// were dropped before their answer (their client went away and the server dropped the
    /// request). Tests wait on these instead of on time.
    pub fn shared_callers(&self) -> CallerCounts {
        self.shared.callers.counts()
    }
}

/// Callers of one cache entry, see [`CacheLab::shared_callers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallerCounts {
    pub waiting: u64,
    pub dropped: u64,
}

#[derive(Default)]
struct CallerEvidence {
    waiting: AtomicU64,
    dropped: AtomicU64,
}

impl CallerEvidence {
    fn counts(&self) -> CallerCounts {
        CallerCounts {
            waiting: self.waiting.load(Ordering::SeqCst),
            dropped: self.dropped.load(Ordering::SeqCst),
        }
    }
}

/// One caller inside [`CoalescedEntry::get_or_load`]. It lives in the request's future, so when
/// the server drops that future (the client went away) its `Drop` counts the caller as dropped.
struct Caller<'a> {
    evidence: &'a CallerEvidence,
    answered: bool,
}

impl<'a> Caller<'a> {
    fn arrive(evidence: &'a CallerEvidence) -> Self {
        evidence.waiting.fetch_add(1, Ordering::SeqCst);
        Caller {
            evidence,
            answered: false,
        }
    }

    fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Caller<'_> {
    fn drop(&mut self) {
        self.evidence.waiting.fetch_sub(1, Ordering::SeqCst);
        if !self.answered {
            self.evidence.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// What the lab counts: catalog rows read by the factory, and shared-factory runs.
#[derive(Default)]
struct CacheProbe {
    reads: AtomicU64,
    factories: AtomicU64,
    gate: WorkLatch,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct CatalogView {
    name: String,
    version: i64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct SharedView {
    value: &'static str,
    generation: u64,
}

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
    CacheLab: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(read_catalog, write_catalog))
        .routes(routes!(read_shared))
        .routes(routes!(stats))
        .routes(routes!(set_gate))
        .routes(routes!(reset))
}

/// The catalog row, read through the cache.
#[utoipa::path(get, path = "/cache/catalog", tag = "cache", responses(
    (status = 200, description = "The catalog row, from the cache or freshly read", body = CatalogView),
    (status = 503, description = "The row could not be loaded, or the server is shutting down", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
))]
async fn read_catalog(
    State(store): State<Store>,
    State(lab): State<CacheLab>,
) -> Result<Response, AppError> {
    let probe = lab.probe.clone();
    let view = lab
        .catalog
        .get_or_load(move || load_catalog(store, probe))
        .await?;
    Ok(axum::Json(view).into_response())
}

/// The catalog factory: one counted read of the row.
async fn load_catalog(store: Store, probe: Arc<CacheProbe>) -> Result<CatalogView, LoadFailure> {
    probe.reads.fetch_add(1, Ordering::SeqCst);
    store
        .read(|connection| {
            connection
                .query_row(
                    "SELECT name, version FROM catalog_cache WHERE id = 1",
                    [],
                    |row| {
                        Ok(CatalogView {
                            name: row.get(0)?,
                            version: row.get(1)?,
                        })
                    },
                )
                .map_err(AppError::from)
        })
        .await
        .map_err(|error: AppError| {
            tracing::error!(target: "production_lab::cache", %error, "catalog load failed");
            LoadFailure::Unavailable
        })
}

/// The catalog's new name. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
struct CatalogInput {
    /// 1 to 30 characters (UTF-16 code units), not blank.
    #[schema(value_type = String, required = true, min_length = 1, max_length = 30)]
    name: Option<String>,
}

impl RequestBody for CatalogInput {
    const FIELDS: &'static [&'static str] = &["name"];
}

/// Writes the row, and only after the commit drops the cached copy.
#[utoipa::path(post, path = "/cache/catalog", tag = "cache",
    params(("failBeforeCommit" = Option<bool>, Query, description = "The fault switch: fail before the commit (503; the row and the cached copy stay)")),
    request_body = CatalogInput,
    responses(
        (status = 204, description = "Written; the cached copy was dropped after the commit"),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 500, description = "The store failed, or the catalog row is missing", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 503, description = "The fault switch (failBeforeCommit=true) rolled the write back, or the store is unavailable", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
async fn write_catalog(
    State(store): State<Store>,
    State(lab): State<CacheLab>,
    Query(query): Query<Vec<(String, String)>>,
    Json(input): Json<CatalogInput>,
) -> Result<Response, AppError> {
    let fail_before_commit = query_flag(&query, "failBeforeCommit")?.unwrap_or(false);
    let name = input.name.unwrap_or_default();
    if is_blank_or_longer_than(&name, MAX_NAME) {
        return Err(AppError::bad_request(format!(
            "name must be 1 to {MAX_NAME} characters and not blank"
        )));
    }
    store
        .write(move |connection| {
            let changed = connection.execute(
                "UPDATE catalog_cache SET name = ?1, version = version + 1 WHERE id = 1",
                [&name],
            )?;
            if changed != 1 {
                return Err(AppError::problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "The catalog row is missing",
                ));
            }
            if fail_before_commit {
                // Err rolls back this work: the row and the cached value stay as they were.
                return Err(AppError::problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Controlled cache-write rollback",
                ));
            }
            Ok(())
        })
        .await?;
    // Only now is the new row durable, so only now may the cached copy go.
    lab.catalog.invalidate().await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A shared value whose concurrent callers share one factory run (held while the lab gate is
/// closed).
#[utoipa::path(get, path = "/cache/shared", tag = "cache", responses(
    (status = 200, description = "The value and the factory run that made it", body = SharedView),
    (status = 503, description = "The value could not be made, or the server is shutting down", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
))]
async fn read_shared(State(lab): State<CacheLab>) -> Result<Response, AppError> {
    let probe = lab.probe.clone();
    let view = lab
        .shared
        .get_or_load(move || async move {
            let generation = probe.factories.fetch_add(1, Ordering::SeqCst) + 1;
            probe.gate.passed().await;
            Ok(SharedView {
                value: "shared",
                generation,
            })
        })
        .await?;
    Ok(axum::Json(view).into_response())
}

/// The counters, in the contract's property order.
#[derive(Serialize, ToSchema)]
struct CacheStats {
    reads: u64,
    factories: u64,
}

#[utoipa::path(get, path = "/cache/stats", tag = "cache", responses(
    (status = 200, description = "Catalog rows read by the factory, and shared-factory runs", body = CacheStats),
))]
async fn stats(State(lab): State<CacheLab>) -> Response {
    let probe = &lab.probe;
    axum::Json(CacheStats {
        reads: probe.reads.load(Ordering::SeqCst),
        factories: probe.factories.load(Ordering::SeqCst),
    })
    .into_response()
}

/// Closes or opens the gate that holds the shared value's factory (a lab control).
#[utoipa::path(post, path = "/lab/cache/gate/{action}", tag = "cache", operation_id = "cache_set_gate",
    params(("action" = inline(crate::labs::latch::GateAction), Path, description = "`close` holds the work until `open`")),
    responses(
        (status = 204, description = "The gate is in that position"),
        (status = 400, response = crate::http::openapi::BadRequest),
    ),
)]
async fn set_gate(
    State(lab): State<CacheLab>,
    Path(action): Path<String>,
) -> Result<Response, AppError> {
    lab.probe.gate.apply(&action)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Drops the cached shared value, so the next read runs the factory again.
#[utoipa::path(post, path = "/lab/cache/reset", tag = "cache", responses(
    (status = 204, description = "Dropped"),
))]
async fn reset(State(lab): State<CacheLab>) -> Response {
    lab.shared.invalidate().await;
    StatusCode::NO_CONTENT.into_response()
}

/// Why a read-through value could not be produced. Never cached: the next caller tries again.
#[derive(Debug, Clone, thiserror::Error)]
enum LoadFailure {
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("the value could not be loaded")]
    Unavailable,
    #[error("the value's factory panicked")]
    Panicked,
}

impl From<LoadFailure> for AppError {
    fn from(failure: LoadFailure) -> Self {
        let title = match failure {
            LoadFailure::ShuttingDown => "The server is shutting down",
            LoadFailure::Unavailable | LoadFailure::Panicked => "The value could not be loaded",
        };
        AppError::problem(StatusCode::SERVICE_UNAVAILABLE, title)
    }
}

type FlightResult<V> = Result<V, LoadFailure>;

/// One logical cache entry, read through a moka cache whose concurrent callers share one factory
/// run.
///
/// moka 0.12's `try_get_with` already makes concurrent callers of one key wait for a single
/// init future, but it runs that future *inside the first caller's own future*, and it does not
/// know about invalidation. The seed's .NET `HybridCache` keeps one factory run going for all
/// waiters whoever leaves, so two gaps are closed here:
/// - If the caller that runs the init future disconnects, the server drops its future, moka
///   cancels the init with it and lets the next waiter run its own init: a second factory run.
///   So the factory runs as a task of its own (a *flight*, tracked for shutdown) and every init
///   future only joins the flight of its epoch: a disconnect neither cancels the run nor starts a
///   second one. The flight also inserts its value itself, so a value finished while no caller
///   was waiting is not lost.
/// - `invalidate` removes what is cached now, but an init future that is still running inserts
///   its (old) value afterwards. So the moka key is an *epoch* that every invalidation moves on:
///   a late value lands under an epoch nobody reads any more, and the next read starts a fresh
///   flight.
///
/// Every read goes through `try_get_with`: moka does not coalesce it with `get_with` callers of
/// the same key, so mixing the two would allow two runs at once.
struct CoalescedEntry<V> {
    cache: Cache<u64, V>,
    epoch: Arc<AtomicU64>,
    flight: Arc<Mutex<Option<Flight<V>>>>,
    flight_ids: Arc<AtomicU64>,
    callers: Arc<CallerEvidence>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

// By hand: a derive would require `V: Clone` for the handle itself.
impl<V> Clone for CoalescedEntry<V> {
    fn clone(&self) -> Self {
        CoalescedEntry {
            cache: self.cache.clone(),
            epoch: self.epoch.clone(),
            flight: self.flight.clone(),
            flight_ids: self.flight_ids.clone(),
            callers: self.callers.clone(),
            tasks: self.tasks.clone(),
            shutdown: self.shutdown.clone(),
        }
    }
}

/// A running factory: the epoch it loads for and its result, shared by every caller that joins.
struct Flight<V> {
    id: u64,
    epoch: u64,
    result: Shared<BoxFuture<'static, FlightResult<V>>>,
}

impl<V> CoalescedEntry<V>
where
    V: Clone + Send + Sync + 'static,
{
    fn new(tasks: TaskTracker, shutdown: CancellationToken) -> Self {
        CoalescedEntry {
            cache: Cache::builder().time_to_live(TIME_TO_LIVE).build(),
            epoch: Arc::new(AtomicU64::new(0)),
            flight: Arc::new(Mutex::new(None)),
            flight_ids: Arc::new(AtomicU64::new(0)),
            callers: Arc::new(CallerEvidence::default()),
            tasks,
            shutdown,
        }
    }

    /// The cached value, or the result of the one factory run that all concurrent callers share.
    async fn get_or_load<F, Fut>(&self, factory: F) -> FlightResult<V>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = FlightResult<V>> + Send + 'static,
    {
        let caller = Caller::arrive(&self.callers);
        let epoch = self.epoch.load(Ordering::SeqCst);
        let result = self
            .cache
            .try_get_with(epoch, self.join_or_start(epoch, factory))
            .await
            .map_err(|failure| (*failure).clone());
        caller.answered();
        result
    }

    /// Drops the cached value; the next read starts a new factory run even if one is running now.
    async fn invalidate(&self) {
        let previous = self.epoch.fetch_add(1, Ordering::SeqCst);
        self.cache.invalidate(&previous).await;
    }

    /// moka's init future: joins the running flight of this epoch, or starts one.
    async fn join_or_start<F, Fut>(&self, epoch: u64, factory: F) -> FlightResult<V>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = FlightResult<V>> + Send + 'static,
    {
        if let Some(running) = self.running_flight(epoch) {
            return running.await;
        }
        // A flight of this epoch may have finished (and inserted) between moka's own look-up and
        // here; only moka's single init runner for the key starts flights, so this check holds.
        if let Some(value) = self.cache.get(&epoch).await {
            return Ok(value);
        }
        self.start_flight(epoch, factory).await
    }

    fn running_flight(&self, epoch: u64) -> Option<Shared<BoxFuture<'static, FlightResult<V>>>> {
        let slot = self.flight.lock().unwrap_or_else(PoisonError::into_inner);
        slot.as_ref()
            .filter(|flight| flight.epoch == epoch)
            .map(|flight| flight.result.clone())
    }

    fn start_flight<F, Fut>(
        &self,
        epoch: u64,
        factory: F,
    ) -> Shared<BoxFuture<'static, FlightResult<V>>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = FlightResult<V>> + Send + 'static,
    {
        let mut slot = self.flight.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(flight) = slot.as_ref().filter(|flight| flight.epoch == epoch) {
            return flight.result.clone();
        }
        let id = self.flight_ids.fetch_add(1, Ordering::SeqCst);
        let work = factory();
        let entry = self.clone();
        // Spawned while the slot is locked, so the flight cannot finish (and clear the slot)
        // before it has been stored there.
        let task = self.tasks.spawn(async move {
            let result = tokio::select! {
                () = entry.shutdown.cancelled() => Err(LoadFailure::ShuttingDown),
                outcome = AssertUnwindSafe(work).catch_unwind() => {
                    outcome.unwrap_or(Err(LoadFailure::Panicked))
                }
            };
            if let Ok(value) = &result
                && entry.epoch.load(Ordering::SeqCst) == epoch
            {
                entry.cache.insert(epoch, value.clone()).await;
            }
            entry.finish_flight(id);
            result
        });
        let result = async move { task.await.unwrap_or(Err(LoadFailure::Panicked)) }
            .boxed()
            .shared();
        *slot = Some(Flight {
            id,
            epoch,
            result: result.clone(),
        });
        result
    }

    /// Clears the slot if it still holds this flight (a newer epoch may have replaced it).
    fn finish_flight(&self, id: u64) {
        let mut slot = self.flight.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|flight| flight.id == id) {
            *slot = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One coalesced entry whose factory counts its runs and waits at a closed gate.
    struct GatedLoads {
        entry: CoalescedEntry<u64>,
        runs: Arc<AtomicU64>,
        gate: WorkLatch,
    }

    impl GatedLoads {
        fn new() -> Self {
            let gate = WorkLatch::default();
            gate.apply("close").unwrap();
            GatedLoads {
                entry: CoalescedEntry::new(TaskTracker::new(), CancellationToken::new()),
                runs: Arc::new(AtomicU64::new(0)),
                gate,
            }
        }

        /// One caller of the entry; its factory's result is the run's number.
        fn load(&self) -> impl Future<Output = FlightResult<u64>> + Send + 'static {
            let (entry, runs, gate) = (self.entry.clone(), self.runs.clone(), self.gate.clone());
            async move {
                entry
                    .get_or_load(move || async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        gate.passed().await;
                        Ok(run)
                    })
                    .await
            }
        }
    }

    #[tokio::test]
    async fn an_invalidation_during_a_running_factory_forces_a_new_run() {
        let fixture = GatedLoads::new();
        let (entry, runs, gate) = (&fixture.entry, &fixture.runs, &fixture.gate);
        let first = tokio::spawn(fixture.load());
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        entry.invalidate().await;
        gate.apply("open").unwrap();
        assert_eq!(first.await.unwrap().unwrap(), 1);
        // The first run finished after the invalidation: its value must not be served.
        assert_eq!(fixture.load().await.unwrap(), 2);
        assert_eq!(fixture.load().await.unwrap(), 2);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_cancelled_caller_neither_stops_the_flight_nor_starts_another() {
        let fixture = GatedLoads::new();
        let (entry, runs, gate) = (&fixture.entry, &fixture.runs, &fixture.gate);
        // The first caller runs moka's init future; the second waits behind it.
        let runner = tokio::spawn(fixture.load());
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let waiter = tokio::spawn(fixture.load());
        while entry.callers.counts().waiting < 2 {
            tokio::task::yield_now().await;
        }
        runner.abort();
        assert!(runner.await.unwrap_err().is_cancelled());
        assert_eq!(
            entry.callers.counts(),
            CallerCounts {
                waiting: 1,
                dropped: 1
            }
        );
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        gate.apply("open").unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), 1);
        assert_eq!(fixture.load().await.unwrap(), 1);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(
            entry.callers.counts(),
            CallerCounts {
                waiting: 0,
                dropped: 1
            },
            "answered callers are not counted as dropped"
        );
    }
}
