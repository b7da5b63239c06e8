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
//! Request bodies are buffered whole, within a global budget of bytes being received
//! ([`super::body_budget`]).
//!
//! The bytes of each request head are kept as they arrive, so that a chunked request whose head
//! also declared a `Content-Length` (which hyper reads as chunked, dropping the length) carries
//! [`super::framing::ConflictingFraming`] for the router to refuse.
//!
//! Over TLS ([`serve_tls`]) a connection's handshake is part of its first head phase: it takes a
//! place in the count at accept, must finish (with the request head after it) within the
//! header-read timeout, and can be evicted like any waiting connection. A failed handshake
//! closes the socket with a debug line only: it is a client's problem, not the server's.

use std::collections::HashMap;
use std::convert::Infallible;
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
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tower_http::timeout::DeadlineBody;

use super::body_budget::{BodyBudget, Budgeted, MAX_REQUEST_BODY_BYTES};
use super::framing::{ConflictingFraming, HeadRecord};
use super::tls::ReloadingTls;
use crate::error::problem_response;
use crate::limits::ConnectionLimits;

/// How long in-flight requests and background work may run on after a shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How long a connection refused at the cap may take to send its request head before it is
/// simply closed.
const REFUSAL_TIME: Duration = Duration::from_secs(1);
/// Refused connections being answered at once; beyond this they are closed without an answer.
const MAX_REFUSALS_IN_FLIGHT: usize = 64;
/// Pause after an accept error that is not about one connection (e.g. out of file descriptors),
/// so that the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Serves `router` on `listener` until `shutdown` is cancelled, then stops accepting, lets each
/// connection finish its current request (at most `grace`), and closes what is left.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    grace: Duration,
) -> io::Result<()> {
    serve_with(listener, router, limits, shutdown, grace, None).await
}

/// [`serve`] over TLS: each accepted connection shakes hands with the configuration `tls` holds
/// at its accept, within the header-read timeout and in the same connection count, then goes
/// through the same phases. A failed handshake closes the socket.
pub async fn serve_tls(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    grace: Duration,
    tls: ReloadingTls,
) -> io::Result<()> {
    serve_with(listener, router, limits, shutdown, grace, Some(tls)).await
}

async fn serve_with(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    grace: Duration,
    tls: Option<ReloadingTls>,
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
        // The configuration current now: a reload reaches new connections only.
        let acceptor = tls.as_ref().map(ReloadingTls::acceptor);
        match registry.admit(limits) {
            Some(slot) => {
                connections.spawn(open_connection(
                    stream,
                    acceptor,
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
                        refuse(stream, acceptor, max).await;
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

/// One connection from accept: its TLS handshake first when there is one, bounded by the
/// connection's head deadline (and so by eviction and shutdown too), then its requests.
async fn open_connection(
    stream: TcpStream,
    acceptor: Option<TlsAcceptor>,
    peer: SocketAddr,
    router: Routed,
    slot: Slot,
    shared: Shared,
) {
    let Some(acceptor) = acceptor else {
        return serve_connection(stream, peer, router, slot, shared).await;
    };
    let phase = slot.phase.clone();
    let handshake = tokio::select! {
        handshake = acceptor.accept(stream) => handshake,
        () = phase.expired() => {
            tracing::debug!(target: "production_lab::server", %peer, "TLS handshake not finished in time");
            return;
        }
        () = shared.shutdown.cancelled() => return,
    };
    match handshake {
        Ok(stream) => serve_connection(stream, peer, router, slot, shared).await,
        Err(error) => {
            tracing::debug!(target: "production_lab::server", %peer, %error, "TLS handshake failed");
        }
    }
}

/// One connection's requests, until it closes.
async fn serve_connection<S>(
    stream: S,
    peer: SocketAddr,
    router: Routed,
    slot: Slot,
    shared: Shared,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
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
            let head = phase.take_head();
            let serving = phase.request_started();
            let mut request = request.map(|body| {
                Body::new(DeadlineBody::new(
                    limits.body_read_timeout,
                    Budgeted::new(body, budget),
                ))
            });
            request.extensions_mut().insert(ConnectInfo(peer));
            // hyper keeps `Transfer-Encoding` and drops a `Content-Length` beside it.
            if request.headers().contains_key(header::TRANSFER_ENCODING) && head.declares_length() {
                request.extensions_mut().insert(ConflictingFraming);
            }
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

/// Answers a connection over the cap `503` once its request head arrived (after its TLS
/// handshake, when there is one), then closes it; all within [`REFUSAL_TIME`].
async fn refuse(stream: TcpStream, acceptor: Option<TlsAcceptor>, max_connections: usize) {
    let _ = tokio::time::timeout(REFUSAL_TIME, async move {
        match acceptor {
            None => answer_refusal(stream, max_connections).await,
            Some(acceptor) => {
                if let Ok(stream) = acceptor.accept(stream).await {
                    answer_refusal(stream, max_connections).await;
                }
            }
        }
    })
    .await;
}

async fn answer_refusal<S>(stream: S, max_connections: usize)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
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
    let _ = connection.await;
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
    /// The bytes received while reading the current request's head.
    head: Mutex<HeadRecord>,
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
            head: Mutex::new(HeadRecord::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a plain value: a panic elsewhere cannot leave it half written.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `bytes` arrived: an idle connection starts reading a head, against the header deadline;
    /// while a head is being read they are kept.
    fn bytes_arrived(&self, bytes: &[u8]) {
        let mut state = self.lock();
        match *state {
            State::Idle { .. } => {
                let now = Instant::now();
                *state = State::Head {
                    since: now,
                    deadline: now + self.limits.header_read_timeout,
                };
                drop(state);
                self.changed.notify_one();
            }
            State::Head { .. } => drop(state),
            State::Busy | State::Evicted => return,
        }
        self.lock_head().record(bytes);
    }

    fn lock_head(&self) -> MutexGuard<'_, HeadRecord> {
        // Plain bytes: a panic elsewhere cannot leave them half written.
        self.head
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The bytes kept of the head hyper just parsed; the next head starts a new record.
    fn take_head(&self) -> HeadRecord {
        std::mem::take(&mut *self.lock_head())
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

/// The connection's stream (TCP, or TLS over it), reporting the first byte after an idle pause.
struct Observed<S> {
    inner: S,
    phase: Arc<Phase>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Observed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.phase.bytes_arrived(&buf.filled()[before..]);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Observed<S> {
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
    async fn a_finished_request_starts_the_keep_alive_pause_and_bytes_start_a_head() {
        let phase = Arc::new(Phase::new(limits(1)));
        assert!(matches!(*phase.lock(), State::Head { .. }));
        drop(phase.request_started());
        assert!(matches!(*phase.lock(), State::Idle { .. }));
        phase.bytes_arrived(b"GET / HTTP/1.1\r\n");
        assert!(matches!(*phase.lock(), State::Head { .. }));
        // Bytes of a body (while busy) change nothing, and are not kept as a head.
        let serving = phase.request_started();
        phase.bytes_arrived(b"Content-Length: 1\r\n\r\n");
        assert!(matches!(*phase.lock(), State::Busy));
        drop(serving);
        phase.bytes_arrived(b"Host: a\r\n\r\n");
        assert!(
            !phase.take_head().declares_length(),
            "only bytes that arrived while a head was read are kept"
        );
    }
}
