//! The general door: `POST /aggregates/{aggregateId}/messages` for any aggregate, and the evidence
//! of what the consumer accepted: `GET /aggregates/{id}`, `GET /aggregates?status=`,
//! `GET /aggregates/{id}/timeline` and `GET /deadletters`.

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use ordered_inbox::views::DeadLetterFilter;
use ordered_inbox::{AggregateStatus, DeadLetterStatus, Door, OrderedMessage};
use serde::Deserialize;
use serde_json::json;

use super::producers::{producer_claim, refused};
use super::verdicts::verdict_response;
use super::{
    SharedInbox, page_body, page_request, validate_aggregate_id, validate_limit,
    validate_message_id, validate_sequence,
};
use crate::error::{AppError, Json, Path, Query, RequestBody, json_response};

pub(super) fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    Router::new()
        .route("/aggregates", get(inventory))
        .route("/aggregates/{aggregate_id}", get(aggregate))
        .route("/aggregates/{aggregate_id}/messages", post(deliver))
        .route("/aggregates/{aggregate_id}/timeline", get(timeline))
        .route("/deadletters", get(dead_letters))
}

/// A delivery to the general door. The aggregate comes from the path; a body `aggregateId`, if
/// present, must name the same one.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MessageInput {
    message_id: String,
    sequence: i64,
    amount: i32,
    aggregate_id: Option<String>,
}

impl RequestBody for MessageInput {
    const FIELDS: &'static [&'static str] = &["messageId", "sequence", "amount", "aggregateId"];
}

impl MessageInput {
    fn validate(self, aggregate_id: String) -> Result<OrderedMessage, AppError> {
        validate_message_id("messageId", &self.message_id)?;
        validate_sequence("sequence", self.sequence, 1)?;
        if let Some(named) = &self.aggregate_id
            && *named != aggregate_id
        {
            return Err(AppError::bad_request(format!(
                "the body's aggregateId '{named}' differs from the path's '{aggregate_id}'"
            )));
        }
        Ok(OrderedMessage {
            message_id: self.message_id,
            aggregate_id,
            sequence: self.sequence,
            amount: i64::from(self.amount),
        })
    }
}

/// A general-door body for `aggregate_id`, checked exactly as the HTTP door checks it (the
/// aggregate id, then the JSON); the error is the detail a 400 would carry.
pub(crate) fn general_message(aggregate_id: String, body: &[u8]) -> Result<OrderedMessage, String> {
    validate_aggregate_id("aggregateId", &aggregate_id).map_err(|e| e.to_string())?;
    let input: MessageInput = crate::error::parse_body(body).map_err(|e| e.to_string())?;
    input.validate(aggregate_id).map_err(|e| e.to_string())
}

/// A delivery, anonymous or by a producer (`Authorization: Bearer TOKEN` and `Producer-Epoch`):
/// the producer's epoch and the aggregate's owner are checked in the write's own transaction.
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
    Ok(
        match inbox
            .deliver_as(message.clone(), Door::General, claim)
            .await?
        {
            Ok(outcome) => verdict_response(&message, outcome),
            Err(refusal) => refused(&message, refusal),
        },
    )
}

async fn aggregate(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    match inbox.aggregate(aggregate_id.clone()).await? {
        Some(view) => {
            let ownership = inbox.ownership(aggregate_id).await?;
            let mut body = json!(view);
            if let Some(object) = body.as_object_mut() {
                object.insert("owner".to_owned(), json!(ownership.owner));
            }
            Ok(json_response(StatusCode::OK, body))
        }
        None => Err(AppError::problem_with_detail(
            StatusCode::NOT_FOUND,
            "Unknown aggregate",
            format!(
                "no message has been recorded for aggregate '{aggregate_id}'; it expects sequence 1"
            ),
        )),
    }
}

#[derive(Debug, Deserialize)]
struct InventoryQuery {
    status: Option<String>,
    limit: Option<i64>,
}

/// `GET /aggregates?status=blocked|waiting|flowing`: the longest-standing first, with ages.
async fn inventory(
    State(inbox): State<SharedInbox>,
    Query(query): Query<InventoryQuery>,
) -> Result<Response, AppError> {
    let status: AggregateStatus = query
        .status
        .as_deref()
        .and_then(|status| status.parse().ok())
        .ok_or_else(|| AppError::bad_request("status must be blocked, waiting or flowing"))?;
    let limit = validate_limit(query.limit)?;
    let aggregates = inbox.inventory(status, limit).await?;
    Ok(json_response(
        StatusCode::OK,
        json!({"status": status, "aggregates": aggregates}),
    ))
}

#[derive(Debug, Deserialize)]
struct PageQuery {
    after: Option<i64>,
    limit: Option<i64>,
}

/// `GET /aggregates/{id}/timeline?after=&limit=`: oldest first; `next` is the `after` of the
/// following page, or null at the end.
async fn timeline(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let page = page_request(query.after, query.limit)?;
    let events = inbox.timeline(aggregate_id.clone(), page).await?;
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"aggregateId": aggregate_id}), "events", events),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeadLetterQuery {
    status: Option<String>,
    aggregate_id: Option<String>,
    after: Option<i64>,
    limit: Option<i64>,
}

/// `GET /deadletters?status=open|resolved|superseded&aggregateId=&after=&limit=`: in the order
/// they were first recorded; `next` pages on.
async fn dead_letters(
    State(inbox): State<SharedInbox>,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Response, AppError> {
    let status =
        match query.status.as_deref() {
            None => None,
            Some(status) => Some(status.parse::<DeadLetterStatus>().map_err(|_| {
                AppError::bad_request("status must be open, resolved or superseded")
            })?),
        };
    if let Some(aggregate_id) = query.aggregate_id.as_deref() {
        validate_aggregate_id("aggregateId", aggregate_id)?;
    }
    let page = page_request(query.after, query.limit)?;
    let filter = DeadLetterFilter {
        status,
        aggregate_id: query.aggregate_id,
    };
    let listed = inbox.dead_letters(filter, page).await?;
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({}), "deadLetters", listed),
    ))
}
