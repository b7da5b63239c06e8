//! http-edge: what the lab's fixture and the ordering gate share between a socket and the ordered
//! inbox. Both products stand on it; it knows neither of them.
//!
//! # Layout
//!
//! Each floor imports only the floors above it in this list:
//!
//! 1. [`limits`], [`startup`]: a server's connection limits and flags, the inbox's default
//!    bounds, and the one-line start-up refusals.
//! 2. [`metrics`]: the metric registry every door counts into.
//! 3. [`error`] (problem+json, the extractors whose rejections become problems), [`credential`]
//!    (the bearer credential), [`producer_epoch`], [`forwarded`] (the client behind a trusted
//!    proxy), [`openapi`] (the document's shared parts), [`pages`] (pages and their security
//!    headers).
//! 4. [`server`] with [`tls`], [`body_budget`], [`framing`] and [`lingering`]: the connection
//!    server, its limits, and what is refused from a request's head.
//! 5. [`observe`]: the edge middleware (request ids, access lines, HTTP metrics), the log format.
//! 6. [`inbox`]: the shared inbox handle, its observing wrapper, the change feed, the message
//!    input and the answers every door words alike.
//! 7. [`jetstream`]: how a server connects the library's JetStream consumer (TLS, credentials,
//!    reconnects) and words its refusals.

pub mod body_budget;
pub mod credential;
pub mod error;
pub mod forwarded;
pub mod framing;
pub mod inbox;
pub mod jetstream;
pub mod limits;
pub mod lingering;
pub mod metrics;
pub mod observe;
pub mod openapi;
pub mod pages;
pub mod producer_epoch;
pub mod server;
pub mod startup;
pub mod tls;

use axum::http::HeaderName;

/// The request id every answer carries (taken from the request when it sent a usable one).
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
