//! The HTTP plumbing under every lab route: the shared edge's parts (the connection server and its
//! limits, problem+json and the extractors, the bearer credential, the OpenAPI document's shared
//! parts, the client behind a trusted proxy, the consoles' page plumbing), and the lab's own:
//! entity tags and the two .NET behaviours the seed's contracts depend on (ASP.NET's input rules,
//! `System.Text.Json`'s escaping).

pub use http_edge::{
    REQUEST_ID_HEADER, body_budget, credential, error, forwarded, framing, lingering, openapi,
    pages, producer_epoch, server, tls,
};

pub mod aspnet;
pub mod dotnet_json;
pub mod etag;
