//! What every request goes through before its handler, in one middleware ([`edge`]): a request
//! id, a span and one log line, its count and latency, the application's admission check (a host filter and
//! forwarded headers, say), and the router's bare 404/405 as problems.
//!
//! One layer rather than one per concern: axum clones a route's whole layered service for every
//! request and drops it afterwards, and with seven layers that cloning, boxing and dropping cost
//! more CPU than the handler of a delivery (see docs/performance.md).
//!
//! In order: the request id (a sane `x-request-id` or a new one, echoed in the response header
//! and in every problem+json body as `requestId`); the `request` span (method, route template,
//! request id, client address: the peer, or behind the gate's trusted proxy the address it
//! forwarded); the host filter and forwarded headers; the route; the bare-status problems; the
//! HTTP metrics; the `request finished` line when the response head is ready, with its status
//! and latency; and `X-Content-Type-Options: nosniff` on every response. The raw path and query are never logged or used as a label: they may carry ids or
//! an email; the route template cannot.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tracing::Instrument;

use crate::error::problem_response_with;
use crate::forwarded::{ClientAddress, client_address};
use crate::metrics::{Metrics, UNMATCHED_ROUTE};

pub use crate::REQUEST_ID_HEADER;
/// The problem+json member that carries the request id.
pub const REQUEST_ID_MEMBER: &str = "requestId";
/// The longest request id accepted from a client.
pub const MAX_REQUEST_ID: usize = 128;
/// The log target of the request lines.
pub const TARGET: &str = "production_lab::http";
/// A problem body larger than this is passed on without the `requestId` member.
const MAX_PROBLEM_BODY: usize = 64 * 1024;

/// The request's id, as a request extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(String);

impl RequestId {
    /// The client's `x-request-id` when it sent exactly one and it is sane: 1 to
    /// [`MAX_REQUEST_ID`] characters of `A-Z a-z 0-9 . _ : - + / = @`. Anything else is replaced,
    /// so a log line never carries a client's control characters or an unbounded string.
    pub fn from_request(request: &Request) -> Option<RequestId> {
        let mut values = request.headers().get_all(REQUEST_ID_HEADER).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return None;
        };
        let bytes = value.as_bytes();
        let sane = (1..=MAX_REQUEST_ID).contains(&bytes.len())
            && bytes.iter().all(|b| {
                b.is_ascii_alphanumeric()
                    || matches!(b, b'.' | b'_' | b':' | b'-' | b'+' | b'/' | b'=' | b'@')
            });
        sane.then(|| RequestId(String::from_utf8_lossy(bytes).into_owned()))
    }

    /// A fresh id: 32 hex digits.
    pub fn generate() -> RequestId {
        RequestId(format!("{:032x}", rand::random::<u128>()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A check every request passes before its route, that may answer it instead: a host filter,
/// say, that also reads forwarded headers into the request's extensions.
pub trait Admission: Send + Sync {
    /// The request to route, or the answer that refuses it.
    #[allow(clippy::result_large_err)] // the refusal is the response itself
    fn admit(&self, request: Request) -> Result<Request, Response>;
}

/// The state of [`edge`]: what it needs of the application.
#[derive(Clone)]
pub struct Edge {
    pub metrics: Metrics,
    /// What a request must pass before its route; `None`: every request is admitted.
    pub admission: Option<std::sync::Arc<dyn Admission>>,
    /// The reverse proxy whose right-most forwarded entry names the client in the request's log
    /// lines and rate limits (see [`crate::forwarded`]); `None`: the peer is the client.
    pub trusted_proxy: Option<IpAddr>,
}

/// Middleware: everything a request goes through before its handler (see the module's doc).
pub async fn edge(State(edge): State<Edge>, mut request: Request, next: Next) -> Response {
    let id = RequestId::from_request(&request).unwrap_or_else(RequestId::generate);
    let route = route_of(&request);
    let method = request.method().clone();
    let client = client_of(&request, edge.trusted_proxy);
    let span = tracing::info_span!(
        target: TARGET,
        "request",
        method = %method,
        route = %route,
        request_id = id.as_str(),
        client = client.map(tracing::field::display),
    );
    request.extensions_mut().insert(id.clone());
    if let Some(client) = client {
        request.extensions_mut().insert(ClientAddress(client));
    }
    let started = Instant::now();
    let response = async {
        let admitted = match &edge.admission {
            Some(admission) => admission.admit(request),
            None => Ok(request),
        };
        let response = match admitted {
            Ok(request) => next.run(request).await,
            Err(refusal) => refusal,
        };
        let response = crate::error::bare_status_as_problem(response, &method);
        let took = started.elapsed();
        edge.metrics
            .http_request(&route, &method, response.status(), took);
        log_request_finished(response.status(), took);
        response
    }
    .instrument(span)
    .await;
    let mut response = with_request_id(response, &id).await;
    forbid_sniffing(&mut response);
    response
}

/// The request's client: its peer, or behind `trusted_proxy` the address the proxy forwarded.
fn client_of(request: &Request, trusted_proxy: Option<IpAddr>) -> Option<IpAddr> {
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip());
    client_address(trusted_proxy, peer, request.headers())
}

/// `X-Content-Type-Options: nosniff` on every response (JSON, problem+json, the router's own
/// 404/405, a 413), so that a browser never runs a JSON body that echoes a client's text as a
/// script or a page.
fn forbid_sniffing(response: &mut Response) {
    response
        .headers_mut()
        .entry(header::X_CONTENT_TYPE_OPTIONS)
        .or_insert(HeaderValue::from_static("nosniff"));
}

/// Echoes the request id in the response header, and in the body of a problem.
async fn with_request_id(response: Response, id: &RequestId) -> Response {
    let mut response = if is_problem(&response) {
        with_request_id_member(response, id).await
    } else {
        response
    };
    // Only sane or generated ids get here, and both are valid header values.
    if let Ok(value) = HeaderValue::from_str(id.as_str()) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

/// `request finished` with the status and the latency in milliseconds: at info, or at warn for a
/// 5xx. Called inside the request's span.
fn log_request_finished(status: axum::http::StatusCode, took: Duration) {
    let latency_ms = took.as_secs_f64() * 1000.0;
    let code = status.as_u16();
    if status.is_server_error() {
        tracing::warn!(target: TARGET, status = code, latency_ms, "request finished");
    } else {
        tracing::info!(target: TARGET, status = code, latency_ms, "request finished");
    }
}

fn is_problem(response: &Response) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value.split(';').next().is_some_and(|media| {
                media
                    .trim()
                    .eq_ignore_ascii_case("application/problem+json")
            })
        })
}

/// Adds `"requestId"` to a problem+json body (RFC 9457 allows extension members).
async fn with_request_id_member(response: Response, id: &RequestId) -> Response {
    let (mut parts, body) = response.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_PROBLEM_BODY).await {
        Ok(bytes) => bytes,
        // A problem body too large to rewrite (none is) or one that failed mid-stream: answer
        // with a plain problem of the same status rather than a truncated one.
        Err(_) => {
            let reason = parts.status.canonical_reason().unwrap_or("Error");
            return problem_response_with(
                parts.status,
                reason,
                None,
                json!({ REQUEST_ID_MEMBER: id.as_str() }),
            );
        }
    };
    let body = match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(mut members)) => {
            members.insert(
                REQUEST_ID_MEMBER.to_owned(),
                Value::String(id.as_str().to_owned()),
            );
            Body::from(Value::Object(members).to_string())
        }
        _ => Body::from(bytes),
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, body).into_response()
}

/// The route template a request matched, or [`UNMATCHED_ROUTE`].
fn route_of<B>(request: &axum::http::Request<B>) -> String {
    request
        .extensions()
        .get::<MatchedPath>()
        .map_or(UNMATCHED_ROUTE, MatchedPath::as_str)
        .to_owned()
}
