//! The budget of request bodies being received. Bodies are buffered whole (at most
//! [`MAX_REQUEST_BODY_BYTES`] each), so many connections sending large bodies at once could take
//! the memory of all of them: each body reserves its size (its `Content-Length`, or each chunk as
//! it arrives) before hyper reads it, and gives it back when the body is dropped. A body that does
//! not fit waits up to [`BODY_BUDGET_PATIENCE`] for room, then its request is answered `503`
//! problem+json with `Retry-After`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio::time::Instant;

pub use crate::limits::MAX_REQUEST_BODY_BYTES;

/// How long a request body waits for room in the body budget before its request answers 503:
/// long enough for other bodies of a burst to finish, short enough that the client is told.
pub const BODY_BUDGET_PATIENCE: Duration = Duration::from_secs(1);
/// The log target of the budget's lines: the connection server's.
const TARGET: &str = "production_lab::server";

/// The bytes of request bodies all connections together may be receiving at once.
///
/// Waiting bodies do not queue in the semaphore: tokio's semaphore is fair, so a large body
/// waiting at its head would hold up every smaller one behind it although they fit. Instead a body
/// that does not fit tries again each time bytes are given back, until its patience runs out.
#[derive(Clone)]
pub(crate) struct BodyBudget {
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
    pub(crate) fn new(total: usize) -> Self {
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
pub(crate) struct Budgeted {
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
    pub(crate) fn new(inner: Incoming, budget: BodyBudget) -> Self {
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
}
