//! The HTTP/1.1 connection loop under the router: a header-read timeout, an idle keep-alive
//! timeout, a request-body deadline, a cap on open connections, and graceful shutdown with a
//! bound. `axum::serve` has none of the timeouts, so a client that connects and sends nothing
//! (or half a header, or half a body) kept its socket, and enough of them exhausted the server's
//! file descriptors.
//!
//! Each connection is in one phase at a time:
//!
//! - **head**: from accept, or from the first byte after an idle pause, until the request head is
//!   complete; closed at the header-read deadline (a silent new socket is closed after the
//!   header-read timeout too);
//! - **idle**: after a response, until the next byte arrives; closed after the keep-alive timeout;
//! - **busy**: a request is being served. The connection has no deadline then (a lab may hold a
//!   request on purpose); its body must arrive completely within the body-read timeout.
//!
//! At the cap, a new connection takes the place of the connection that has waited longest in
//! head or idle (as nginx reuses idle keep-alive connections), so sockets that never send a
//! request cannot lock others out. Only when every connection is busy is the new one refused:
//! it is answered `503` problem+json and closed, within a second, never left waiting.
//!
//! Request bodies are buffered whole (at most [`MAX_REQUEST_BODY_BYTES`] each), so many
//! connections sending large bodies at once could take the memory of all of them. A global
//! budget bounds the bytes being received: each body reserves its size (its `Content-Length`, or
//! each chunk as it arrives) before hyper reads it, and gives it back when the body is dropped.
//! A body that does not fit waits up to [`BODY_BUDGET_PATIENCE`] for room, then its request is
//! answered `503` problem+json with `Retry-After`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::body::Bytes;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, StatusCode, header};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tower_http::timeout::DeadlineBody;

use crate::config::ConnectionLimits;
use crate::error::problem_response;

/// The largest request body any route reads; a larger one answers 413.
pub const MAX_REQUEST_BODY_BYTES: usize = 2 * 1024 * 1024;
/// How long a connection refused at the cap may take to send its request head before it is
/// simply closed.
const REFUSAL_TIME: Duration = Duration::from_secs(1);
/// Refused connections being answered at once; beyond this they are closed without an answer.
const MAX_REFUSALS_IN_FLIGHT: usize = 64;
/// Pause after an accept error that is not about one connection (e.g. out of file descriptors),
/// so that the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// How long a request body waits for room in the body budget before its request answers 503:
/// long enough for other bodies of a burst to finish, short enough that the client is told.
pub const BODY_BUDGET_PATIENCE: Duration = Duration::from_secs(1);
/// The log target of the server's own lines.
const TARGET: &str = "production_lab::server";

/// Serves `router` on `listener` until `shutdown` is cancelled, then stops accepting, lets each
/// connection finish its current request (at most `grace`), and closes what is left.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    grace: Duration,
) -> io::Result<()> {
    // The router's bare 404/405 become problems inside `app::router`, within the request-id
    // layer, so that they carry the request's id too.
    // Around the router, not on each route: a route's layers are cloned for every request.
    let router = tower::Layer::layer(
        &axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES),
        router,
    );
    let registry = Arc::new(Registry::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT));
    let connections = TaskTracker::new();
    let closing = CancellationToken::new();
    let shared = Shared {
        limits,
        budget: BodyBudget::new(limits.request_body_budget),
        shutdown: shutdown.clone(),
        closing: closing.clone(),
    };
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    if !is_connection_error(&error) {
                        tracing::warn!(target: "production_lab::server", %error, "accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    }
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        match registry.admit(limits) {
            Some(slot) => {
                connections.spawn(serve_connection(
                    stream,
                    peer,
                    router.clone(),
                    slot,
                    shared.clone(),
                ));
            }
            None => match refusals.clone().try_acquire_owned() {
                Ok(permit) => {
                    let max = limits.max_connections;
                    connections.spawn(async move {
                        refuse(stream, max).await;
                        drop(permit);
                    });
                }
                // Too many refusals at once: close without an answer.
                Err(_) => drop(stream),
            },
        }
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(grace, connections.wait())
        .await
        .is_err()
    {
        closing.cancel();
        connections.wait().await;
    }
    Ok(())
}

/// Errors that concern one connection only (it was reset before it was accepted): accept the
/// next one at once.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// The router with the default body limit around it.
type Routed = <axum::extract::DefaultBodyLimit as tower::Layer<Router>>::Service;

/// What every connection of one server shares.
#[derive(Clone)]
struct Shared {
    limits: ConnectionLimits,
    budget: BodyBudget,
    /// Stop taking requests: finish the current one, then close.
    shutdown: CancellationToken,
    /// The shutdown grace is over: close now.
    closing: CancellationToken,
}

/// One connection, from accept to close.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Routed,
    slot: Slot,
    shared: Shared,
) {
    let Shared {
        limits,
        budget,
        shutdown,
        closing,
    } = shared;
    let phase = slot.phase.clone();
    let io = TokioIo::new(Observed {
        inner: stream,
        phase: phase.clone(),
    });
    let service_phase = phase.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let router = router.clone();
        let phase = service_phase.clone();
        let budget = budget.clone();
        async move {
            let serving = phase.request_started();
            let mut request = request.map(|body| {
                Body::new(DeadlineBody::new(
                    limits.body_read_timeout,
                    Budgeted::new(body, budget),
                ))
            });
            request.extensions_mut().insert(ConnectInfo(peer));
            let response = match router.oneshot(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(response.map(|body| Served {
                body,
                _serving: serving,
            }))
        }
    });
    let connection = http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(io, service);
    let mut connection = std::pin::pin!(connection);
    let expired = phase.expired();
    let mut expired = std::pin::pin!(expired);
    let mut draining = false;
    loop {
        tokio::select! {
            finished = connection.as_mut() => {
                if let Err(error) = finished {
                    tracing::debug!(target: "production_lab::server", %peer, %error, "connection ended with an error");
                }
                break;
            }
            // Dropping the connection closes the socket.
            () = expired.as_mut() => break,
            () = shutdown.cancelled(), if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
            () = closing.cancelled() => break,
        }
    }
    drop(slot);
}

/// Answers a connection over the cap `503` once its request head arrived, then closes it.
async fn refuse(stream: TcpStream, max_connections: usize) {
    let service = service_fn(move |_request: Request<Incoming>| async move {
        let mut response = problem_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "Too many connections",
            Some(&format!(
                "the server already holds its maximum of {max_connections} connections and every one is serving a request; retry shortly"
            )),
        );
        let headers = response.headers_mut();
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        headers.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        Ok::<_, Infallible>(response)
    });
    let connection = http1::Builder::new()
        .header_read_timeout(None)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(REFUSAL_TIME, connection).await;
}

// ---------------------------------------------------------------------------------------------
// Phases and the registry of open connections

#[derive(Debug, Clone, Copy)]
enum State {
    /// Reading a request head: closed at `deadline`.
    Head { since: Instant, deadline: Instant },
    /// Between requests, nothing received yet: closed at `deadline`.
    Idle { since: Instant, deadline: Instant },
    /// Serving a request: no connection deadline.
    Busy,
    /// Closed to make room for a new connection.
    Evicted,
}

/// A connection's phase, shared by its socket (first byte), its service (request start and end),
/// its watchdog and the registry (eviction).
struct Phase {
    state: Mutex<State>,
    changed: Notify,
    limits: ConnectionLimits,
}

impl Phase {
    fn new(limits: ConnectionLimits) -> Self {
        let now = Instant::now();
        Phase {
            state: Mutex::new(State::Head {
                since: now,
                deadline: now + limits.header_read_timeout,
            }),
            changed: Notify::new(),
            limits,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a plain value: a panic elsewhere cannot leave it half written.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Bytes arrived: an idle connection starts reading a head, against the header deadline.
    fn bytes_arrived(&self) {
        let mut state = self.lock();
        if let State::Idle { .. } = *state {
            let now = Instant::now();
            *state = State::Head {
                since: now,
                deadline: now + self.limits.header_read_timeout,
            };
            drop(state);
            self.changed.notify_one();
        }
    }

    /// The request head is complete and the router takes over.
    fn request_started(self: &Arc<Self>) -> Serving {
        {
            let mut state = self.lock();
            if !matches!(*state, State::Evicted) {
                *state = State::Busy;
            }
        }
        self.changed.notify_one();
        Serving {
            phase: self.clone(),
        }
    }

    /// The response was sent (or abandoned): the keep-alive pause begins.
    fn request_finished(&self) {
        {
            let mut state = self.lock();
            if let State::Busy = *state {
                let now = Instant::now();
                *state = State::Idle {
                    since: now,
                    deadline: now + self.limits.keep_alive_timeout,
                };
            }
        }
        self.changed.notify_one();
    }

    /// Marks a waiting connection evicted; `false` when it is serving a request.
    fn evict_if_waiting(&self) -> bool {
        let mut state = self.lock();
        match *state {
            State::Head { .. } | State::Idle { .. } => {
                *state = State::Evicted;
                drop(state);
                self.changed.notify_one();
                true
            }
            State::Busy | State::Evicted => false,
        }
    }

    /// Since when a connection has been waiting, if it is waiting.
    fn waiting_since(&self) -> Option<Instant> {
        match *self.lock() {
            State::Head { since, .. } | State::Idle { since, .. } => Some(since),
            State::Busy | State::Evicted => None,
        }
    }

    /// Resolves when the connection must be closed: its head or idle deadline passed, or it was
    /// evicted.
    async fn expired(&self) {
        loop {
            let deadline = match *self.lock() {
                State::Head { deadline, .. } | State::Idle { deadline, .. } => Some(deadline),
                State::Busy => None,
                State::Evicted => return,
            };
            match deadline {
                Some(deadline) if deadline <= Instant::now() => return,
                Some(deadline) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {}
                        () = self.changed.notified() => {}
                    }
                }
                None => self.changed.notified().await,
            }
        }
    }
}

/// Held by a response body while it is being sent; dropping it ends the request.
struct Serving {
    phase: Arc<Phase>,
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.phase.request_finished();
    }
}

/// The open connections, for the cap.
struct Registry {
    max: usize,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Phase>>>,
}

/// A connection's place in the registry; dropping it frees the place.
struct Slot {
    id: u64,
    phase: Arc<Phase>,
    registry: Arc<Registry>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

impl Registry {
    fn new(max: usize) -> Self {
        Registry {
            max,
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<Phase>>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a new connection: a free one, or the place of the connection that has waited
    /// longest without a request in progress. `None` when every connection is busy.
    fn admit(self: &Arc<Self>, limits: ConnectionLimits) -> Option<Slot> {
        let mut open = self.lock();
        while open.len() >= self.max {
            let oldest = open
                .iter()
                .filter_map(|(id, phase)| phase.waiting_since().map(|since| (since, *id)))
                .min()
                .map(|(_, id)| id)?;
            if let Some(phase) = open.remove(&oldest) {
                // It may have started a request since it was looked at; then it keeps running
                // outside the count, and the loop looks again.
                phase.evict_if_waiting();
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let phase = Arc::new(Phase::new(limits));
        open.insert(id, phase.clone());
        Some(Slot {
            id,
            phase,
            registry: self.clone(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The socket and the response body, observed

/// The TCP stream, reporting the first byte after an idle pause.
struct Observed {
    inner: TcpStream,
    phase: Arc<Phase>,
}

impl AsyncRead for Observed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.phase.bytes_arrived();
        }
        polled
    }
}

impl AsyncWrite for Observed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A response body that ends its request when hyper is done with it.
struct Served {
    body: Body,
    _serving: Serving,
}

impl hyper::body::Body for Served {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

// ---------------------------------------------------------------------------------------------
// The budget of request bodies being received

/// The bytes of request bodies all connections together may be receiving at once.
///
/// Waiting bodies do not queue in the semaphore: tokio's semaphore is fair, so a large body
/// waiting at its head would hold up every smaller one behind it although they fit. Instead a body
/// that does not fit tries again each time bytes are given back, until its patience runs out.
#[derive(Clone)]
struct BodyBudget {
    bytes: Arc<Semaphore>,
    given_back: Arc<Notify>,
    total: usize,
}

/// A request body did not fit in the budget within [`BODY_BUDGET_PATIENCE`].
#[derive(Debug, thiserror::Error)]
#[error(
    "the server is already receiving its budget of {budget} bytes of request bodies (--request-body-budget); retry shortly"
)]
pub struct BodyBudgetExhausted {
    pub budget: usize,
}

impl BodyBudget {
    fn new(total: usize) -> Self {
        let total = total.min(Semaphore::MAX_PERMITS);
        BodyBudget {
            bytes: Arc::new(Semaphore::new(total)),
            given_back: Arc::new(Notify::new()),
            total,
        }
    }

    /// `bytes` of the budget if they fit now.
    fn try_reserve(&self, bytes: u32) -> Option<Reservation> {
        match self.bytes.clone().try_acquire_many_owned(bytes) {
            Ok(permit) => Some(Reservation {
                permit: Some(permit),
                given_back: self.given_back.clone(),
            }),
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => None,
        }
    }

    /// `bytes` of the budget, waiting at most `patience` for other bodies to give theirs back.
    async fn reserve(
        self,
        bytes: u32,
        patience: Duration,
    ) -> Result<Reservation, BodyBudgetExhausted> {
        let deadline = Instant::now() + patience;
        loop {
            // Listen before trying, so that bytes given back in between are not missed.
            let given_back = self.given_back.notified();
            let mut given_back = std::pin::pin!(given_back);
            given_back.as_mut().enable();
            if let Some(reservation) = self.try_reserve(bytes) {
                return Ok(reservation);
            }
            if tokio::time::timeout_at(deadline, given_back).await.is_err() {
                return Err(BodyBudgetExhausted { budget: self.total });
            }
        }
    }
}

/// Bytes held from the budget; dropping it gives them back and wakes the bodies waiting.
struct Reservation {
    permit: Option<OwnedSemaphorePermit>,
    given_back: Arc<Notify>,
}

impl Reservation {
    fn bytes(&self) -> usize {
        self.permit
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits)
    }

    /// Adds `more` to this reservation (both are of the one budget).
    fn merge(&mut self, mut more: Reservation) {
        let Some(other) = more.permit.take() else {
            return;
        };
        match &mut self.permit {
            Some(permit) => permit.merge(other),
            None => self.permit = Some(other),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            drop(permit);
            self.given_back.notify_waiters();
        }
    }
}

type Reserving = Pin<Box<dyn Future<Output = Result<Reservation, BodyBudgetExhausted>> + Send>>;

/// A request body that takes its bytes from the budget before hyper reads them from the socket:
/// its declared length before the first read, and whatever a chunk adds beyond what is reserved
/// (a chunked body) before that chunk is passed on. The bytes go back when the body is dropped.
struct Budgeted {
    inner: Incoming,
    budget: BodyBudget,
    held: Option<Reservation>,
    received: usize,
    started: bool,
    /// A reservation being waited for, and the chunk that needs it.
    waiting: Option<(Reserving, Option<Frame<Bytes>>)>,
    refused: bool,
}

impl Budgeted {
    fn new(inner: Incoming, budget: BodyBudget) -> Self {
        Budgeted {
            inner,
            budget,
            held: None,
            received: 0,
            started: false,
            waiting: None,
            refused: false,
        }
    }

    fn held_bytes(&self) -> usize {
        self.held.as_ref().map_or(0, Reservation::bytes)
    }

    fn hold(&mut self, reservation: Reservation) {
        match &mut self.held {
            Some(held) => held.merge(reservation),
            None => self.held = Some(reservation),
        }
    }

    /// Takes `bytes` from the budget if they fit now.
    fn try_hold(&mut self, bytes: usize) -> bool {
        match self.budget.try_reserve(permits(bytes)) {
            Some(reservation) => {
                self.hold(reservation);
                true
            }
            None => false,
        }
    }

    /// Waits for `bytes` of the budget (at most its patience), then passes `frame` on.
    fn wait_for(&mut self, bytes: usize, frame: Option<Frame<Bytes>>) {
        tracing::debug!(
            target: TARGET,
            bytes,
            "a request body waits for room in the body budget"
        );
        let reserving = self
            .budget
            .clone()
            .reserve(permits(bytes), BODY_BUDGET_PATIENCE);
        self.waiting = Some((Box::pin(reserving), frame));
    }
}

/// Bytes as semaphore permits; a body reserves at most [`MAX_REQUEST_BODY_BYTES`] at once.
fn permits(bytes: usize) -> u32 {
    u32::try_from(bytes.min(MAX_REQUEST_BODY_BYTES)).unwrap_or(u32::MAX)
}

impl hyper::body::Body for Budgeted {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = self.get_mut();
        loop {
            if let Some((reserving, frame)) = &mut this.waiting {
                let reserved = std::task::ready!(reserving.as_mut().poll(cx));
                let frame = frame.take();
                this.waiting = None;
                match reserved {
                    Ok(reservation) => this.hold(reservation),
                    Err(exhausted) => {
                        this.refused = true;
                        return Poll::Ready(Some(Err(Box::new(exhausted))));
                    }
                }
                if let Some(frame) = frame {
                    return Poll::Ready(Some(Ok(frame)));
                }
            }
            if this.refused {
                return Poll::Ready(None);
            }
            if !this.started {
                this.started = true;
                // The declared length, before hyper reads any of it.
                let declared = this
                    .inner
                    .size_hint()
                    .exact()
                    .map_or(0, |length| usize::try_from(length).unwrap_or(usize::MAX))
                    .min(MAX_REQUEST_BODY_BYTES);
                if declared > 0 {
                    if this.try_hold(declared) {
                        tracing::debug!(
                            target: TARGET,
                            bytes = declared,
                            "a request body reserved its length from the body budget"
                        );
                    } else {
                        this.wait_for(declared, None);
                        continue;
                    }
                }
            }
            let frame = match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                Some(Err(error)) => return Poll::Ready(Some(Err(Box::new(error)))),
                None => return Poll::Ready(None),
            };
            if let Some(data) = frame.data_ref() {
                // A chunked body (or one longer than it declared) reserves what it adds, up to
                // the body limit, past which the limit refuses it anyway.
                this.received = this.received.saturating_add(data.len());
                let missing = this
                    .received
                    .min(MAX_REQUEST_BODY_BYTES)
                    .saturating_sub(this.held_bytes());
                if missing > 0 && !this.try_hold(missing) {
                    this.wait_for(missing, Some(frame));
                    continue;
                }
            }
            return Poll::Ready(Some(Ok(frame)));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.waiting.is_none() && (self.refused || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: usize) -> ConnectionLimits {
        ConnectionLimits {
            max_connections,
            ..ConnectionLimits::default()
        }
    }

    #[tokio::test]
    async fn at_the_cap_the_longest_waiting_connection_makes_room() {
        let registry = Arc::new(Registry::new(2));
        let first = registry.admit(limits(2)).expect("room");
        let second = registry.admit(limits(2)).expect("room");
        let _serving = second.phase.request_started();
        let third = registry
            .admit(limits(2))
            .expect("the waiting one is evicted");
        assert!(matches!(*first.phase.lock(), State::Evicted));
        assert!(matches!(*second.phase.lock(), State::Busy));
        // Now both are in use: one busy, one waiting (the third) that can still make room.
        let _serving_third = third.phase.request_started();
        assert!(
            registry.admit(limits(2)).is_none(),
            "every connection is busy"
        );
    }

    #[tokio::test]
    async fn a_small_body_fits_beside_a_large_one_waiting_and_given_back_bytes_wake_it() {
        let budget = BodyBudget::new(100);
        let held = budget.try_reserve(60).expect("room");
        let large = tokio::spawn(budget.clone().reserve(50, Duration::from_secs(30)));
        tokio::task::yield_now().await;
        let small = budget.try_reserve(40).expect("the small body fits at once");
        assert!(!large.is_finished());
        drop(held);
        let large = large.await.expect("the task").expect("room given back");
        assert_eq!((large.bytes(), small.bytes()), (50, 40));
    }

    #[tokio::test]
    async fn a_body_that_never_fits_gives_up_after_its_patience() {
        let budget = BodyBudget::new(10);
        let _held = budget.try_reserve(10).expect("room");
        let refused = budget.clone().reserve(1, Duration::from_millis(20)).await;
        assert_eq!(refused.err().map(|exhausted| exhausted.budget), Some(10));
    }

    #[tokio::test]
    async fn a_finished_request_starts_the_keep_alive_pause_and_bytes_start_a_head() {
        let phase = Arc::new(Phase::new(limits(1)));
        assert!(matches!(*phase.lock(), State::Head { .. }));
        drop(phase.request_started());
        assert!(matches!(*phase.lock(), State::Idle { .. }));
        phase.bytes_arrived();
        assert!(matches!(*phase.lock(), State::Head { .. }));
        // Bytes of a body (while busy) change nothing.
        let serving = phase.request_started();
        phase.bytes_arrived();
        assert!(matches!(*phase.lock(), State::Busy));
        drop(serving);
    }
}
