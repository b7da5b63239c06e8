//! The HTTP plumbing under every route: the connection server and its limits, the one error type
//! (problem+json) and the extractors whose rejections become problems, the bearer credential,
//! the OpenAPI document's shared parts, the client behind a trusted proxy, the consoles' page plumbing, entity tags, and the two .NET behaviours the seed's
//! contracts depend on (ASP.NET's input rules, `System.Text.Json`'s escaping).
//!
//! Nothing here knows a lab, the inbox or a door: those floors stand on this one.

pub mod aspnet;
pub mod body_budget;
pub mod credential;
pub mod dotnet_json;
pub mod error;
pub mod etag;
pub mod forwarded;
pub mod framing;
pub mod lingering;
pub mod openapi;
pub mod pages;
pub mod producer_epoch;
pub mod server;
pub mod tls;

use axum::http::HeaderName;

/// The request id every answer carries (taken from the request when it sent a usable one).
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
