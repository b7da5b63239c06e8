//! The gate's own edge, between the shared edge middleware (request ids, logs, metrics) and its
//! routes ([`gate_edge`]), and the payload routes' check of a declared length
//! ([`refuse_declared_oversize`]). What a request is refused for here is refused from its head,
//! before a byte of its body is read:
//!
//! - a chunked request whose head also declared a `Content-Length` (hyper would read it as
//!   chunked; a proxy in front might frame it by its length): 400 problem+json;
//! - a `Content-Length` larger than the route takes: 413 problem+json (so `Expect: 100-continue`
//!   is answered 413, never `100 Continue`).
//!
//! A body left unread by its answer, whatever refused it (these checks, a credential, a shape),
//! is drained after the answer ([`http_edge::lingering`]) so that a client still sending it
//! reads the answer rather than a reset; the answer then says `Connection: close`.
//!
//! On the way out, HTTPS answers carry `Strict-Transport-Security`, and `/v1` answers
//! `Cache-Control: no-store` (unless a route set its own): they carry a producer's messages, the
//! evidence and the audit trail, which no browser or proxy cache should keep.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use http_edge::body_budget::MAX_REQUEST_BODY_BYTES;
use http_edge::error::{AppError, body_too_large, problem_response};
use http_edge::framing::ConflictingFraming;
use http_edge::lingering::Lingering;

/// The largest request body a delivery or a resolution may carry, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadLimit(pub usize);

/// One year: browsers keep to HTTPS for this long after an answer.
const HSTS: &str = "max-age=31536000";

/// The state of [`gate_edge`].
#[derive(Debug, Clone, Copy)]
pub struct GateEdge {
    /// Whether the gate serves HTTPS itself (behind a proxy that terminates TLS, the proxy
    /// sets `Strict-Transport-Security`).
    pub https: bool,
}

/// Middleware: see the module's doc.
pub async fn gate_edge(State(edge): State<GateEdge>, request: Request, next: Next) -> Response {
    let under_v1 = request.uri().path().starts_with("/v1/");
    let (parts, body) = request.into_parts();
    let (body, body_end) = Lingering::new(body, &parts.headers);
    let request = Request::from_parts(parts, Body::new(body));
    let mut response = match refusal_from_head(&request) {
        Some(refusal) => {
            drop(request);
            refusal
        }
        None => next.run(request).await,
    };
    let headers = response.headers_mut();
    if !body_end.reached() {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    if edge.https {
        headers.insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static(HSTS),
        );
    }
    if under_v1 {
        headers
            .entry(header::CACHE_CONTROL)
            .or_insert(HeaderValue::from_static("no-store"));
    }
    response
}

/// The answer to a request refused whatever its route: conflicting framing, or a declared length
/// past what any route takes.
fn refusal_from_head(request: &Request) -> Option<Response> {
    if request.extensions().get::<ConflictingFraming>().is_some() {
        return Some(problem_response(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            Some(
                "the request has both Content-Length and Transfer-Encoding: send one of them (RFC 9112 §6.3)",
            ),
        ));
    }
    let declared = declared_length(request.headers())?;
    (declared > MAX_REQUEST_BODY_BYTES as u64).then(|| body_too_large().into_response())
}

/// Route middleware of the payload routes: a declared length past the gate's payload limit is
/// answered 413 before the body is read.
pub async fn refuse_declared_oversize(
    State(limit): State<PayloadLimit>,
    request: Request,
    next: Next,
) -> Response {
    match declared_length(request.headers()) {
        Some(declared) if declared > limit.0 as u64 => payload_too_large(limit).into_response(),
        _ => next.run(request).await,
    }
}

/// 413 naming the payload limit the configuration sets.
pub fn payload_too_large(PayloadLimit(limit): PayloadLimit) -> AppError {
    AppError::problem_with_detail(
        StatusCode::PAYLOAD_TOO_LARGE,
        "Content Too Large",
        format!(
            "the request body is larger than the gate's limit of {limit} bytes (limits.max_payload_bytes)"
        ),
    )
}

/// The request's `Content-Length` (hyper refuses a malformed one, or two that differ).
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}
