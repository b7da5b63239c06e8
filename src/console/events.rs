//! Live updates for open console pages: `GET /console/events` streams every committed change to
//! the inbox (the feed of [`crate::inbox::changes`]) to each page as server-sent events.
//!
//! Bounds: the feed keeps the last [`EVENTS_KEPT`] changes for each listener (a page that
//! falls further behind gets one `lagged` event and reloads what it shows), at most
//! [`MAX_STREAMS`] streams are open at once (the next one answers 503), and every stream ends
//! when shutdown begins, so an open page never holds the graceful drain.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast};

use tokio_util::sync::CancellationToken;

use crate::http::error::AppError;
pub use crate::inbox::changes::{EVENTS_KEPT, InboxChange, InboxChanges};

/// Event streams open at once, across all clients.
pub const MAX_STREAMS: usize = 16;
/// A comment line this often keeps proxies and the browser from timing the stream out, and lets
/// the server notice a page that went away.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How long a browser waits before it reconnects a dropped stream.
const RECONNECT_AFTER: Duration = Duration::from_secs(2);

/// The console's live streams over the inbox's feed; cheap to clone.
#[derive(Clone)]
pub struct ConsoleEvents {
    changes: InboxChanges,
    streams: Arc<Semaphore>,
    shutdown: CancellationToken,
}

impl ConsoleEvents {
    /// Pages hear what `changes` publishes; streams end when `shutdown` is cancelled.
    pub fn new(changes: InboxChanges, shutdown: CancellationToken) -> Self {
        ConsoleEvents {
            changes,
            streams: Arc::new(Semaphore::new(MAX_STREAMS)),
            shutdown,
        }
    }

    /// A listener's stream, or `None` when [`MAX_STREAMS`] are already open.
    fn open(&self) -> Option<impl Stream<Item = Result<Event, Infallible>> + use<>> {
        let permit = self.streams.clone().try_acquire_owned().ok()?;
        let listener = Listener {
            receiver: self.changes.subscribe(),
            shutdown: self.shutdown.clone(),
            _permit: permit,
            greeted: false,
        };
        Some(futures_util::stream::unfold(
            listener,
            |mut listener| async move {
                let event = listener.next().await?;
                Some((Ok(event), listener))
            },
        ))
    }
}

/// One open stream: its place in the broadcast and its share of the stream cap.
struct Listener {
    receiver: broadcast::Receiver<InboxChange>,
    shutdown: CancellationToken,
    _permit: OwnedSemaphorePermit,
    greeted: bool,
}

impl Listener {
    /// The next event to send, or `None` to end the stream.
    async fn next(&mut self) -> Option<Event> {
        if !self.greeted {
            self.greeted = true;
            // The page loads what it shows once this arrives, so nothing between its first read
            // and its subscription is missed.
            return Some(
                Event::default()
                    .event("hello")
                    .data("live")
                    .retry(RECONNECT_AFTER),
            );
        }
        let received = tokio::select! {
            () = self.shutdown.cancelled() => return None,
            received = self.receiver.recv() => received,
        };
        match received {
            Ok(change) => Some(change_event(&change)),
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                Some(Event::default().event("lagged").data(missed.to_string()))
            }
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

fn change_event(change: &InboxChange) -> Event {
    // A struct of strings always serializes; a failure would only cost the page a reload.
    Event::default()
        .event("change")
        .json_data(change)
        .unwrap_or_else(|_| Event::default().event("lagged").data("0"))
}

/// `GET /console/events`: `text/event-stream` of `hello`, then `change` (JSON) and `lagged`.
/// One server-sent event of `GET /console/events`, as the OpenAPI document describes it.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct ConsoleEvent {
    /// `hello` (first), `change` or `lagged`.
    #[schema(pattern = "^(hello|change|lagged)$")]
    event: String,
    /// `hello`: `live`; `change`: JSON `{aggregateId, messageId, change}`; `lagged`: how many
    /// changes were missed.
    data: String,
    /// The reconnection delay the `hello` event sets, in milliseconds.
    #[schema(required = false)]
    retry: i64,
}

#[utoipa::path(get, path = "/console/events", tag = "console", responses(
    (status = 200, description = "Server-sent events: `hello`, then `change` and `lagged`; open until the client or the server leaves", body = ConsoleEvent, content_type = "text/event-stream"),
    (status = 503, description = "Too many open streams; retry after the Retry-After seconds", body = crate::http::openapi::Problem, content_type = "application/problem+json",
        headers(("retry-after" = String))),
))]
pub async fn events(State(console): State<ConsoleEvents>) -> Response {
    let Some(stream) = console.open() else {
        let mut response = AppError::problem_with_detail(
            StatusCode::SERVICE_UNAVAILABLE,
            "Too many console streams",
            format!("{MAX_STREAMS} console pages are already receiving live updates; close one or retry later"),
        )
        .into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        return response;
    };
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn change(n: usize) -> InboxChange {
        InboxChange {
            aggregate_id: "a".into(),
            message_id: format!("m-{n}"),
            change: "applied",
        }
    }

    /// The text an event puts on the wire.
    fn wire(event: Event) -> String {
        use axum::response::IntoResponse as _;
        let stream = futures_util::stream::iter([Ok::<_, Infallible>(event)]);
        let response = Sse::new(stream).into_response();
        let body = axum::body::to_bytes(response.into_body(), 4096);
        let bytes = futures_util::FutureExt::now_or_never(body)
            .expect("a finished stream is read at once")
            .expect("body");
        String::from_utf8(bytes.to_vec()).expect("utf-8")
    }

    #[tokio::test]
    async fn a_listener_is_greeted_then_hears_changes_and_a_slow_one_is_told_it_lagged() {
        let changes = InboxChanges::new();
        let events = ConsoleEvents::new(changes.clone(), CancellationToken::new());
        let mut stream = Box::pin(events.open().expect("a stream"));
        let hello = wire(stream.next().await.unwrap().unwrap());
        assert!(hello.contains("event: hello"), "{hello}");
        changes.publish(change(1));
        let first = wire(stream.next().await.unwrap().unwrap());
        assert!(first.contains("event: change"), "{first}");
        assert!(
            first.contains(r#"data: {"aggregateId":"a","messageId":"m-1","change":"applied"}"#),
            "{first}"
        );
        for n in 0..EVENTS_KEPT + 5 {
            changes.publish(change(n));
        }
        let lagged = wire(stream.next().await.unwrap().unwrap());
        assert!(lagged.contains("event: lagged\ndata: 5"), "{lagged}");
    }

    #[tokio::test]
    async fn streams_are_capped_and_a_closed_one_frees_its_place() {
        let events = ConsoleEvents::new(InboxChanges::new(), CancellationToken::new());
        let mut open: Vec<_> = (0..MAX_STREAMS)
            .map(|_| Box::pin(events.open().expect("under the cap")))
            .collect();
        assert!(events.open().is_none(), "one more than the cap is refused");
        open.pop();
        assert!(events.open().is_some(), "a dropped stream frees its place");
    }

    #[tokio::test]
    async fn every_stream_ends_when_shutdown_begins() {
        let shutdown = CancellationToken::new();
        let events = ConsoleEvents::new(InboxChanges::new(), shutdown.clone());
        let mut stream = Box::pin(events.open().expect("a stream"));
        let _hello = stream.next().await;
        shutdown.cancel();
        assert!(stream.next().await.is_none());
    }
}
