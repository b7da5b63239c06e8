//! The general door: `POST /aggregates/{aggregateId}/messages` for any aggregate, and the evidence
//! of what the consumer accepted: `GET /aggregates/{id}`, `GET /aggregates?status=`,
//! `GET /aggregates/{id}/timeline` and `GET /deadletters`.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use super::{
    validate_after, validate_aggregate_id, validate_limit, validate_message_id, validate_sequence,
};
use crate::app::AppState;
use crate::error::{AppError, Json, Path, Query, RequestBody, json_response};
use crate::ordering::views::{self, DeadLetterFilter};
use crate::ordering::{Door, OrderedMessage, Outcome, apply, clock};

pub(super) fn routes() -> Router<AppState> {
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

async fn deliver(
    State(state): State<AppState>,
    Path(aggregate_id): Path<String>,
    Json(input): Json<MessageInput>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let message = input.validate(aggregate_id)?;
    let (message, outcome) = state
        .store
        .write(move |connection| {
            let outcome = apply(connection, &message, Door::General, &clock::now())?;
            Ok::<_, AppError>((message, outcome))
        })
        .await?;
    Ok(verdict_response(&message, outcome))
}

/// Each verdict with what the caller can do about it.
fn verdict_response(message: &OrderedMessage, outcome: Outcome) -> Response {
    let aggregate_id = &message.aggregate_id;
    let message_id = &message.message_id;
    match outcome {
        Outcome::Applied {
            sequence,
            total,
            superseded,
        } => json_response(
            StatusCode::OK,
            json!({
                "outcome": "applied",
                "aggregateId": aggregate_id,
                "messageId": message_id,
                "sequence": sequence,
                "last": sequence,
                "total": total,
                "superseded": superseded,
            }),
        ),
        Outcome::Replay { original } => json_response(
            StatusCode::OK,
            json!({
                "outcome": "replay",
                "aggregateId": aggregate_id,
                "messageId": message_id,
                "original": {
                    "outcome": "applied",
                    "sequence": original.sequence,
                    "appliedAt": original.applied_at,
                },
                "retryable": false,
                "action": "nothing to do: this message was already applied and changed nothing now",
            }),
        ),
        Outcome::Gap { expected } => json_response(
            StatusCode::CONFLICT,
            json!({
                "outcome": "gap",
                "aggregateId": aggregate_id,
                "messageId": message_id,
                "sequence": message.sequence,
                "expected": expected,
                "retryable": true,
                "action": format!("deliver sequence {expected} first, then retry this message unchanged"),
            }),
        ),
        Outcome::Stale { expected } => json_response(
            StatusCode::CONFLICT,
            json!({
                "outcome": "stale",
                "aggregateId": aggregate_id,
                "messageId": message_id,
                "sequence": message.sequence,
                "expected": expected,
                "retryable": false,
                "action": format!("sequence {} was already taken by another message; do not retry", message.sequence),
            }),
        ),
        Outcome::PayloadConflict => json_response(
            StatusCode::CONFLICT,
            json!({
                "outcome": "payload conflict",
                "aggregateId": aggregate_id,
                "messageId": message_id,
                "retryable": false,
                "action": "this message id already carries other content and never changes meaning; send new content under a new message id",
            }),
        ),
        Outcome::Quarantined {
            expected,
            reason,
            dead_letter,
        } => {
            let status = dead_letter
                .as_ref()
                .map_or("open", |note| note.status.as_str());
            let resolution = if status == "open" {
                json!({
                    "requiresOperator": true,
                    "how": format!(
                        "an operator resolves it with POST /deadletters/{{messageId}}/resolution (replace or skip), or a corrected message under a new id takes sequence {expected}"
                    ),
                })
            } else {
                json!({
                    "requiresOperator": false,
                    "how": format!("the dead letter is already {status}; nothing to do"),
                })
            };
            json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                json!({
                    "outcome": "quarantined",
                    "aggregateId": aggregate_id,
                    "messageId": message_id,
                    "sequence": message.sequence,
                    "expected": expected,
                    "reason": reason,
                    "retryable": false,
                    "deadLetter": {
                        "status": status,
                        "observations": dead_letter.as_ref().map(|note| note.observations),
                    },
                    "resolution": resolution,
                }),
            )
        }
    }
}

async fn aggregate(
    State(state): State<AppState>,
    Path(aggregate_id): Path<String>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let lookup = aggregate_id.clone();
    let view = state
        .store
        .read(move |connection| views::aggregate_view(connection, &lookup).map_err(AppError::from))
        .await?;
    match view {
        Some(view) => Ok(json_response(StatusCode::OK, json!(view))),
        None => Err(AppError::Problem {
            status: StatusCode::NOT_FOUND,
            title: "Unknown aggregate".to_owned(),
            detail: Some(format!(
                "no message has been recorded for aggregate '{aggregate_id}'; it expects sequence 1"
            )),
        }),
    }
}

#[derive(Debug, Deserialize)]
struct InventoryQuery {
    status: Option<String>,
    limit: Option<i64>,
}

/// `GET /aggregates?status=blocked|waiting|flowing`: the longest-standing first, with ages.
async fn inventory(
    State(state): State<AppState>,
    Query(query): Query<InventoryQuery>,
) -> Result<Response, AppError> {
    let status = match query.status.as_deref() {
        Some(status @ ("blocked" | "waiting" | "flowing")) => status.to_owned(),
        _ => {
            return Err(AppError::bad_request(
                "status must be blocked, waiting or flowing",
            ));
        }
    };
    let limit = validate_limit(query.limit)?;
    let listed = status.clone();
    let aggregates = state
        .store
        .read(move |connection| {
            views::inventory(connection, &listed, &clock::now(), limit).map_err(AppError::from)
        })
        .await?;
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
    State(state): State<AppState>,
    Path(aggregate_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let after = validate_after(query.after)?;
    let limit = validate_limit(query.limit)?;
    let lookup = aggregate_id.clone();
    let events = state
        .store
        .read(move |connection| {
            views::timeline(connection, &lookup, after, limit).map_err(AppError::from)
        })
        .await?;
    let next = (events.len() as i64 == limit)
        .then(|| events.last().map(|event| event.id))
        .flatten();
    Ok(json_response(
        StatusCode::OK,
        json!({"aggregateId": aggregate_id, "events": events, "next": next}),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeadLetterQuery {
    status: Option<String>,
    aggregate_id: Option<String>,
    limit: Option<i64>,
}

/// `GET /deadletters?status=open|resolved|superseded&aggregateId=`: the first seen first.
async fn dead_letters(
    State(state): State<AppState>,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Response, AppError> {
    if let Some(status) = query.status.as_deref()
        && !matches!(status, "open" | "resolved" | "superseded")
    {
        return Err(AppError::bad_request(
            "status must be open, resolved or superseded",
        ));
    }
    if let Some(aggregate_id) = query.aggregate_id.as_deref() {
        validate_aggregate_id("aggregateId", aggregate_id)?;
    }
    let limit = validate_limit(query.limit)?;
    let listed: Vec<views::DeadLetterView> = state
        .store
        .read(move |connection| {
            views::dead_letters(
                connection,
                &DeadLetterFilter {
                    status: query.status.as_deref(),
                    aggregate_id: query.aggregate_id.as_deref(),
                    limit,
                },
            )
            .map_err(AppError::from)
        })
        .await?;
    Ok(json_response(
        StatusCode::OK,
        json!({"deadLetters": listed}),
    ))
}
