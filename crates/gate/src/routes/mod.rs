//! The gate's `/v1` routes and their OpenAPI document, built from the handlers' annotations:
//!
//! - `messages`: a producer's delivery and its verdict, a producer's new session;
//! - `views`: the evidence a reader reads (aggregates, timeline, gaps, dead letters, the audit
//!   trail);
//! - `dead_letter`: one dead letter, named in the query;
//! - `rejected`: the NATS deliveries terminated without a verdict;
//! - `feed`: an aggregate's applied messages as the gate emits them, with a long poll;
//! - `resolution`: an operator's audited resolution of a dead letter or a gap;
//! - `bulk`: an operator's recheck (accept what passes the message types in use) or skip of the
//!   open dead letters one filter matches;
//! - `registry`: operators add and revoke producers and operators;
//! - `owner`: an operator's transfer of an aggregate to another producer.
//!
//! Every handler takes only the parts it uses ([`FromRef`] of [`GateState`]); the library
//! decides, these modules word the answers.

mod bulk;
mod dead_letter;
mod feed;
mod messages;
mod owner;
mod registry;
mod rejected;
mod resolution;
mod verdicts;
mod views;

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use ordered_inbox::InboxError;
use utoipa::openapi::OpenApi as Document;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::Access;
use crate::handler::SharedTypes;
use crate::output::{OutputError, OutputStore};
use http_edge::error::AppError;
use http_edge::inbox::SharedInbox;
use http_edge::inbox::changes::InboxChanges;
use http_edge::metrics::Metrics;

pub use messages::GateMessageInput;
pub use registry::RegistryStore;

/// Everything the routes use, and the document they serve. Cheap to clone.
#[derive(Clone)]
pub struct GateState(pub Arc<GateParts>, PublishedDocument);

/// The parts of [`GateState`].
pub struct GateParts {
    /// The inbox, observed (every verdict counted, logged and told to [`GateParts::changes`]).
    pub inbox: SharedInbox,
    /// The output table: what the applied feed reads.
    pub output: OutputStore,
    pub access: Access,
    /// Where producers and operators are registered.
    pub registry: RegistryStore,
    /// The feed of committed changes, which wakes the applied feed's long polls.
    pub changes: InboxChanges,
    pub metrics: Metrics,
    /// The message types in use (reloaded on SIGHUP): the inventory reads their gap alerts.
    pub types: SharedTypes,
    /// The largest request body a delivery or a resolution may carry.
    pub max_payload_bytes: usize,
}

pub use crate::edge::PayloadLimit;

impl FromRef<GateState> for PayloadLimit {
    fn from_ref(state: &GateState) -> PayloadLimit {
        PayloadLimit(state.0.max_payload_bytes)
    }
}

impl GateState {
    pub fn new(parts: GateParts) -> GateState {
        GateState(Arc::new(parts), PublishedDocument::default())
    }

    /// Where this gate's rendered document will be (set by [`finish`]).
    pub fn document(&self) -> PublishedDocument {
        self.1.clone()
    }
}

macro_rules! part_from_state {
    ($($part:ident: $type:ty),+ $(,)?) => {
        $(
            impl FromRef<GateState> for $type {
                fn from_ref(state: &GateState) -> $type {
                    state.0.$part.clone()
                }
            }
        )+
    };
}

part_from_state!(
    inbox: SharedInbox,
    output: OutputStore,
    access: Access,
    registry: RegistryStore,
    changes: InboxChanges,
    metrics: Metrics,
    types: SharedTypes,
);

/// The `/v1` routes with `state`, and the OpenAPI document that describes them (also served at
/// `GET /v1/openapi.json`).
pub fn router(state: GateState) -> (Router, Document) {
    let published = state.1.clone();
    finish(api(state), &published)
}

/// The `/v1` routes with `state`, documented by their annotations: the gate merges its health
/// routes and its console beside them before [`finish`].
pub fn api(state: GateState) -> OpenApiRouter {
    let body_limit = state.0.max_payload_bytes;
    OpenApiRouter::with_openapi(GateDoc::openapi())
        .merge(messages::routes(body_limit))
        .merge(views::routes())
        .merge(dead_letter::routes())
        .merge(rejected::routes())
        .merge(feed::routes())
        .merge(resolution::routes(body_limit))
        .merge(bulk::routes(body_limit))
        .merge(registry::routes())
        .merge(owner::routes())
        .routes(routes!(openapi_json))
        .with_state(state)
}

/// The router and its document, with the shared components and the reader's scheme; the
/// document is what this gate's `GET /v1/openapi.json` answers from now on.
pub fn finish(routes: OpenApiRouter, published: &PublishedDocument) -> (Router, Document) {
    let (router, mut document) = routes.split_for_parts();
    http_edge::openapi::Shared.modify(&mut document);
    ReaderScheme.modify(&mut document);
    let rendered = document.to_json().unwrap_or_else(|error| {
        tracing::error!(%error, "the gate's OpenAPI document could not be rendered");
        "{}".to_owned()
    });
    let _ = published.0.set(rendered);
    (router, document)
}

/// The rendered document of one gate's routes, set once its router is built.
#[derive(Clone, Default)]
pub struct PublishedDocument(Arc<OnceLock<String>>);

impl FromRef<GateState> for PublishedDocument {
    fn from_ref(state: &GateState) -> PublishedDocument {
        state.1.clone()
    }
}

/// This document: OpenAPI 3.1, generated from the handlers.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "operating", responses(
    (status = 200, description = "The OpenAPI 3.1 document of every route of the gate", body = Object, content_type = "application/json"),
))]
async fn openapi_json(State(published): State<PublishedDocument>) -> Response {
    let document = published.0.get().map_or("{}", String::as_str).to_owned();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        document,
    )
        .into_response()
}

/// The root of the gate's document: its info and the components every route refers to.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "production-lab gate",
        description = "The ordered inbox as a service: unordered, duplicated, at-least-once \
            deliveries in; each aggregate's messages out exactly once and in sequence order; \
            poison (a payload its type's JSON Schema refuses) quarantined for an audited \
            operator. Every error is application/problem+json.",
        license(name = "MIT OR Apache-2.0")
    ),
    components(
        schemas(http_edge::openapi::Problem),
        responses(
            http_edge::openapi::BadRequest,
            http_edge::openapi::RequestTimeout,
            http_edge::openapi::ContentTooLarge,
            http_edge::openapi::UnsupportedMediaType,
            http_edge::openapi::StoreUnavailable,
            http_edge::openapi::StoreFailed
        )
    ),
    tags(
        (name = "messages", description = "Deliveries and producer sessions"),
        (name = "evidence", description = "What the inbox holds, for readers and operators"),
        (name = "feed", description = "Each aggregate's applied messages, in order"),
        (name = "operators", description = "Resolutions, producers, operators, ownership"),
        (name = "operating", description = "Health, metrics and this document, without a token"),
        (name = "console", description = "The operator's pages (static; their data comes from /v1 with a token)"),
    )
)]
struct GateDoc;

/// The reader's security scheme, beside the operator's and the producer's.
struct ReaderScheme;

impl Modify for ReaderScheme {
    fn modify(&self, document: &mut Document) {
        let components = document.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "reader",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A reader's token from the gate's configuration ([auth] readers), or an operator's",
                    ))
                    .build(),
            ),
        );
    }
}

/// An output store failure as the answer every route gives a store failure: 503 with
/// `Retry-After` when a retry can clear it, 500 otherwise.
impl From<OutputError> for AppError {
    fn from(error: OutputError) -> Self {
        match error {
            OutputError::Limit(_) => AppError::bad_request(error.to_string()),
            OutputError::Unavailable(reason) => AppError::Inbox(InboxError::Unavailable(reason)),
            OutputError::Failed(reason) => AppError::Inbox(InboxError::Failed(reason)),
        }
    }
}
