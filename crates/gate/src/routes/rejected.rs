//! `GET /v1/rejected`, for a reader: the NATS deliveries the gate terminated without a verdict
//! (malformed, anonymous while anonymous writes are off, a producer refused) and the held messages
//! the inbox rejected, oldest first, in a bounded list. Over HTTP a refusal is the answer itself;
//! on the broker a terminated message has no one to answer, so it is kept here.

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{Access, Reader};
use http_edge::error::{AppError, Query, json_response};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::pages::{page_body, page_request};

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    Access: FromRef<S>,
{
    OpenApiRouter::new().routes(routes!(rejected))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct RejectedQuery {
    /// The `next` of the previous page (0 or absent first).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// One page of the rejected list.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct RejectedPage {
    /// How many entries the list keeps (the oldest go first).
    kept: usize,
    rejected: Vec<RejectedEntry>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// One rejected delivery.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct RejectedEntry {
    at: String,
    /// The subject it arrived on (null: a held message the inbox rejected).
    subject: Option<String>,
    stream_sequence: Option<i64>,
    /// How many times the broker had delivered it.
    delivered: Option<i64>,
    message_id: Option<String>,
    aggregate_id: Option<String>,
    /// The producer whose token it carried (null: anonymous, or not known).
    producer: Option<String>,
    /// `malformed`, `anonymous refused`, `stale`, `payload conflict` or a producer refusal.
    outcome: String,
    reason: String,
}

impl From<ordered_inbox::records::RejectedDelivery> for RejectedEntry {
    fn from(entry: ordered_inbox::records::RejectedDelivery) -> RejectedEntry {
        RejectedEntry {
            at: entry.at,
            subject: entry.subject,
            stream_sequence: entry.stream_sequence,
            delivered: entry.delivered,
            message_id: entry.message_id,
            aggregate_id: entry.aggregate_id,
            producer: entry.producer,
            outcome: entry.outcome,
            reason: entry.reason,
        }
    }
}

/// `GET /v1/rejected?after=&limit=`: oldest first.
#[utoipa::path(get, path = "/v1/rejected", tag = "evidence", params(RejectedQuery),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "The terminated deliveries and the held messages the inbox rejected, oldest first", body = RejectedPage),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ))]
async fn rejected(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    Query(query): Query<RejectedQuery>,
) -> Result<Response, AppError> {
    let page = page_request(query.after, query.limit)?;
    let listed = inbox.reads().rejected(page).await?;
    let listed = ordered_inbox::views::Page {
        items: listed.items.into_iter().map(RejectedEntry::from).collect(),
        next: listed.next,
    };
    Ok(json_response(
        StatusCode::OK,
        page_body(
            json!({ "kept": http_edge::jetstream::REJECTED_KEPT }),
            "rejected",
            listed,
        ),
    ))
}
