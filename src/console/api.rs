//! Read-only routes for rows the console shows and no other route lists. Each answers a library
//! view as JSON, exactly as serialized by `ordered-inbox` (an applied message with the ledger's
//! amount, [`crate::inbox::ledger::views`]).
//!
//! - `GET /console/api/aggregates/{aggregateId}/messages?after=&limit=`: the aggregate's applied
//!   messages (`ordered_inbox` rows) in sequence order; `next` is the following page's `after`.
//! - `GET /console/api/deadletters/{messageId}`: one dead letter, with its resolution.
//! - `GET /console/api/deadletter?messageId=`: the same for any id: the console's pages use it,
//!   since a browser drops a path segment `.` or `..` (and `%2E`, `%2E%2E`) before sending.

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::views::DeadLetterView;
use serde::Deserialize;
use serde_json::json;
use utoipa::{IntoParams, IntoResponses, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::http::error::{AppError, Path, Query, json_response};
use crate::inbox::SharedInbox;
use crate::inbox::answers::find_dead_letter;
use crate::inbox::input::validate_aggregate_id;
use crate::inbox::ledger::views::AppliedMessage;
use crate::inbox::pages::{page_body, page_request};

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::with_openapi(DeadLetterSchemas::openapi())
        .routes(routes!(applied_messages))
        .routes(routes!(dead_letter))
        .routes(routes!(dead_letter_named_in_query))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct PageQuery {
    /// The cursor: the `next` of the previous page (a sequence).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// One page of an aggregate's applied messages.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct AppliedPage {
    aggregate_id: String,
    messages: Vec<AppliedMessage>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

#[utoipa::path(get, path = "/console/api/aggregates/{aggregate_id}/messages", tag = "console",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"), PageQuery),
    responses(
        (status = 200, description = "The aggregate's applied messages in sequence order", body = AppliedPage),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn applied_messages(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let page = page_request(query.after, query.limit)?;
    let messages = inbox
        .reads()
        .applied_messages(aggregate_id.clone(), page)
        .await?
        .map(AppliedMessage::from);
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"aggregateId": aggregate_id}), "messages", messages),
    ))
}

/// Whose message id a dead letter is.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct DeadLetterOf {
    /// The producer that delivered it (a message id belongs to its producer); absent for an
    /// anonymous delivery's dead letter.
    #[param(min_length = 1, max_length = 64)]
    producer: Option<String>,
}

/// What a read of one dead letter answers, whichever route names it. The derive refers to
/// [`DeadLetterView`] without registering it: [`DeadLetterSchemas`] does.
#[derive(IntoResponses)]
// Never built: it only describes the answers to the document.
#[allow(dead_code, clippy::large_enum_variant)]
enum DeadLetterResponses {
    #[response(
        status = 200,
        description = "The dead letter with its lifecycle and resolution"
    )]
    Found(DeadLetterView),
    #[response(status = 400)]
    BadRequest(#[ref_response] crate::http::openapi::BadRequest),
    #[response(
        status = 404,
        description = "No dead letter has this message id",
        content_type = "application/problem+json"
    )]
    NotFound(crate::http::openapi::Problem),
    #[response(status = 500)]
    StoreFailed(#[ref_response] crate::http::openapi::StoreFailed),
    #[response(status = 503)]
    StoreUnavailable(#[ref_response] crate::http::openapi::StoreUnavailable),
}

/// The schemas [`DeadLetterResponses`] refers to, for the document's components.
#[derive(OpenApi)]
#[openapi(components(schemas(DeadLetterView)))]
struct DeadLetterSchemas;

#[utoipa::path(get, path = "/console/api/deadletters/{message_id}", tag = "console",
    params(("message_id" = String, Path, min_length = 1, max_length = 100, description = "The dead letter's message id"), DeadLetterOf),
    responses(DeadLetterResponses),
)]
async fn dead_letter(
    State(inbox): State<SharedInbox>,
    Path(message_id): Path<String>,
    Query(of): Query<DeadLetterOf>,
) -> Result<Response, AppError> {
    find_dead_letter(&inbox, message_id, of.producer).await
}

/// A dead letter named in the query: its message id, and its producer when a producer's.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct NamedDeadLetter {
    /// The dead letter's message id (any the doors accept, `.` and `..` included).
    #[param(min_length = 1, max_length = 100)]
    message_id: String,
    /// The producer that delivered it; absent for an anonymous delivery's dead letter.
    #[param(min_length = 1, max_length = 64)]
    producer: Option<String>,
}

#[utoipa::path(
    get,
    path = "/console/api/deadletter",
    tag = "console",
    params(NamedDeadLetter),
    responses(DeadLetterResponses)
)]
async fn dead_letter_named_in_query(
    State(inbox): State<SharedInbox>,
    Query(named): Query<NamedDeadLetter>,
) -> Result<Response, AppError> {
    find_dead_letter(&inbox, named.message_id, named.producer).await
}
