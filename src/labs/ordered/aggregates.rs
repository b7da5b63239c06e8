//! The general door: `POST /aggregates/{aggregateId}/messages` for any aggregate, and the evidence
//! of what the consumer accepted: `GET /aggregates/{id}`, `GET /aggregates?status=`,
//! `GET /aggregates/{id}/timeline` and `GET /deadletters`.

use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use ordered_inbox::views::{DeadLetterView, TimelineEvent};
use ordered_inbox::{AggregateStatus, Door};
use serde::Deserialize;
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::producers::producer_claim;
use super::verdicts::{
    DeliveryAccepted, DeliveryRefused, GeneralDoor, Quarantined, refused, verdict_response,
};
use crate::http::error::{AppError, Json, Path, Query, json_response};
use crate::inbox::SharedInbox;
use crate::inbox::answers::unknown_aggregate;
use crate::inbox::input::{Delivered, MessageInput, validate_aggregate_id};
use crate::inbox::ledger::views::{AggregateView, InventoryEntry};
use crate::inbox::pages::{page_body, validate_limit};
use crate::inbox::queries::{DeadLetterQuery, PageQuery, aggregate_status};

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(inventory))
        .routes(routes!(aggregate))
        .routes(routes!(deliver))
        .routes(routes!(timeline))
        .routes(routes!(dead_letters))
}

/// A delivery, anonymous or by a producer (`Authorization: Bearer TOKEN` and `Producer-Epoch`):
/// the producer's epoch and the aggregate's owner are checked in the write's own transaction.
#[utoipa::path(post, path = "/aggregates/{aggregate_id}/messages", tag = "ordered",
    params(
        ("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"),
        ("producer-epoch" = Option<i64>, Header, minimum = 1, description = "With a producer's token: the epoch POST /producers/session answered"),
    ),
    request_body = MessageInput,
    security((), ("producer" = [])),
    responses(
        (status = 200, description = "Applied (the next sequence), or a replay of an applied id", body = DeliveryAccepted),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 401, description = "A producer's credential is missing, unknown or revoked, or the aggregate's owner must deliver", body = crate::http::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 403, description = "Not the aggregate's owner, or an unowned aggregate with history that only an operator may give an owner", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 409, description = "A gap (deliver `expected` first), a stale sequence or a payload conflict (JSON); or the producer is fenced or has no session (problem). Nothing is applied and nothing claimed: a producer's refused delivery to an aggregate without history writes nothing there; otherwise a gap, stale sequence or payload conflict is recorded as an observation on the timeline (a gap also marks the aggregate waiting)", content(
            (DeliveryRefused = "application/json"),
            (crate::http::openapi::Problem = "application/problem+json"),
        )),
        (status = 422, description = "Quarantined as a dead letter: the aggregate waits for an operator or a corrected message", body = Quarantined),
        (status = 429, description = "The aggregate's quarantine is full: the poison message was not recorded", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn deliver(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    headers: HeaderMap,
    body: Result<Json<MessageInput>, AppError>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    // The request's shape first, as on every JSON route (a delivery's body is no secret), then
    // who sends it.
    let Json(input) = body?;
    let message = input.validate(aggregate_id)?;
    let claim = match producer_claim(&inbox, &headers).await {
        Ok(claim) => claim,
        Err(response) => return Ok(response),
    };
    let delivered = Delivered::of(&message);
    Ok(
        match inbox.deliver_as(message, Door::General, claim).await? {
            Ok(outcome) => verdict_response::<GeneralDoor>(&delivered, outcome),
            Err(refusal) => refused::<GeneralDoor>(&delivered, refusal),
        },
    )
}

#[utoipa::path(get, path = "/aggregates/{aggregate_id}", tag = "ordered",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate")),
    responses(
        (status = 200, description = "The aggregate's position, status and open dead letters", body = AggregateView),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 404, description = "No message was ever recorded for it", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn aggregate(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    match inbox.reads().aggregate(aggregate_id.clone()).await? {
        Some(view) => {
            let ownership = inbox.reads().ownership(aggregate_id).await?;
            let mut body = json!(AggregateView::from(view));
            if let Some(object) = body.as_object_mut() {
                object.insert("owner".to_owned(), json!(ownership.owner));
            }
            Ok(json_response(StatusCode::OK, body))
        }
        None => Err(unknown_aggregate(&aggregate_id)),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct InventoryQuery {
    /// Which aggregates to list.
    #[param(value_type = AggregateStatus, required = true)]
    status: Option<String>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// The aggregates in one status, the longest-standing first.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Inventory {
    status: AggregateStatus,
    aggregates: Vec<InventoryEntry>,
}

/// `GET /aggregates?status=blocked|waiting|flowing`: the longest-standing first, with ages.
#[utoipa::path(get, path = "/aggregates", tag = "ordered", params(InventoryQuery), responses(
    (status = 200, description = "The aggregates in that status, the longest-standing first", body = Inventory),
    (status = 400, response = crate::http::openapi::BadRequest),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn inventory(
    State(inbox): State<SharedInbox>,
    Query(query): Query<InventoryQuery>,
) -> Result<Response, AppError> {
    let status = aggregate_status(query.status.as_deref())?;
    let limit = validate_limit(query.limit)?;
    let aggregates: Vec<InventoryEntry> = inbox
        .reads()
        .inventory(status, limit)
        .await?
        .into_iter()
        .map(InventoryEntry::from)
        .collect();
    Ok(json_response(
        StatusCode::OK,
        json!({"status": status, "aggregates": aggregates}),
    ))
}

/// One page of an aggregate's timeline.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct TimelinePage {
    aggregate_id: String,
    events: Vec<TimelineEvent>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// `GET /aggregates/{id}/timeline?after=&limit=`: oldest first; `next` is the `after` of the
/// following page, or null at the end.
#[utoipa::path(get, path = "/aggregates/{aggregate_id}/timeline", tag = "ordered",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"), PageQuery),
    responses(
        (status = 200, description = "Every change and rejection of the aggregate, oldest first", body = TimelinePage),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn timeline(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let page = query.page()?;
    let events = inbox.reads().timeline(aggregate_id.clone(), page).await?;
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"aggregateId": aggregate_id}), "events", events),
    ))
}

/// One page of dead letters.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct DeadLetterPage {
    dead_letters: Vec<DeadLetterView>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// `GET /deadletters?status=open|resolved|superseded&aggregateId=&after=&limit=`: in the order
/// they were first recorded; `next` pages on.
#[utoipa::path(get, path = "/deadletters", tag = "ordered", params(DeadLetterQuery), responses(
    (status = 200, description = "Dead letters in the order they were first recorded", body = DeadLetterPage),
    (status = 400, response = crate::http::openapi::BadRequest),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn dead_letters(
    State(inbox): State<SharedInbox>,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Response, AppError> {
    let (filter, page) = query.into_parts()?;
    let listed = inbox.reads().dead_letters(filter, page).await?;
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({}), "deadLetters", listed),
    ))
}
