//! A request body answered before it was read, drained after its answer (a lingering close).
//!
//! A server that refuses a request from its head (too large, no credential) and closes the
//! connection with the client's body still arriving makes the kernel reset the connection, and
//! a client still sending its body then reads a reset, or an end of stream, instead of the
//! answer. So a body the handler dropped unread is read and thrown away, at most
//! [`LINGER_BYTES`] within [`LINGER_TIME`], while the answer goes out; its connection is then
//! closed (the answer says `Connection: close`). Waiting connections are evicted first at the
//! connection cap, so a draining one never locks a new one out.
//!
//! A body the client holds back on `Expect: 100-continue` and that was never asked for is not
//! drained: polling it would send `100 Continue` for a body already refused.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use hyper::body::{Body as _, Frame, SizeHint};

use super::body_budget::MAX_REQUEST_BODY_BYTES;

/// The most of an unread body read after its answer: twice the most any route reads, so that a
/// client sending a body just past a limit still reads its 413.
pub const LINGER_BYTES: usize = 2 * MAX_REQUEST_BODY_BYTES;
/// The longest an unread body is read after its answer.
pub const LINGER_TIME: Duration = Duration::from_secs(2);

/// A request body that drains itself when dropped unread; see the module's doc.
pub struct Lingering {
    inner: Option<Body>,
    ended: Arc<AtomicBool>,
    polled: bool,
    expects_continue: bool,
}

/// Whether a [`Lingering`] body was read to its end.
#[derive(Clone)]
pub struct BodyEnd(Arc<AtomicBool>);

impl BodyEnd {
    /// `true` once the body ended (or had nothing to read).
    pub fn reached(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl Lingering {
    /// `body` of a request with `headers`, and a handle that tells whether it was read to its
    /// end.
    pub fn new(body: Body, headers: &HeaderMap) -> (Lingering, BodyEnd) {
        let expects_continue = headers
            .get(header::EXPECT)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        let ended = Arc::new(AtomicBool::new(body.is_end_stream()));
        let lingering = Lingering {
            inner: Some(body),
            ended: ended.clone(),
            polled: false,
            expects_continue,
        };
        (lingering, BodyEnd(ended))
    }
}

impl hyper::body::Body for Lingering {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.polled = true;
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.ended.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let unread = !self.ended.load(Ordering::Acquire) && !inner.is_end_stream();
        let held_back = self.expects_continue && !self.polled;
        if unread
            && !held_back
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(drain(inner));
        }
    }
}

/// Reads and drops `body`, at most [`LINGER_BYTES`] within [`LINGER_TIME`].
async fn drain(mut body: Body) {
    let _ = tokio::time::timeout(LINGER_TIME, async move {
        let mut read = 0usize;
        while read < LINGER_BYTES {
            match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                Some(Ok(frame)) => {
                    read = read.saturating_add(frame.data_ref().map_or(0, Bytes::len));
                }
                Some(Err(_)) | None => return,
            }
        }
    })
    .await;
}
