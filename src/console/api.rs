//! Read-only routes for rows the console shows and no other route lists. Each answers a library
//! view as JSON, exactly as serialized by `ordered-inbox`.
//!
//! - `GET /console/api/aggregates/{aggregateId}/messages?after=&limit=`: the aggregate's applied
//!   messages (`ordered_inbox` rows) in sequence order; `next` is the following page's `after`.
//! - `GET /console/api/deadletters/{messageId}`: one dead letter, with its resolution.

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use serde::Deserialize;
use serde_json::json;

use crate::error::{AppError, Path, Query, json_response};
use crate::labs::ordered::{
    SharedInbox, page_body, page_request, validate_aggregate_id, validate_message_id,
};

pub(super) fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    Router::new()
        .route(
            "/console/api/aggregates/{aggregate_id}/messages",
            get(applied_messages),
        )
        .route("/console/api/deadletters/{message_id}", get(dead_letter))
}

#[derive(Debug, Deserialize)]
struct PageQuery {
    after: Option<i64>,
    limit: Option<i64>,
}

async fn applied_messages(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let page = page_request(query.after, query.limit)?;
    let messages = inbox.applied_messages(aggregate_id.clone(), page).await?;
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"aggregateId": aggregate_id}), "messages", messages),
    ))
}

async fn dead_letter(
    State(inbox): State<SharedInbox>,
    Path(message_id): Path<String>,
) -> Result<Response, AppError> {
    validate_message_id("messageId", &message_id)?;
    match inbox.dead_letter(message_id.clone()).await? {
        Some(view) => Ok(json_response(StatusCode::OK, json!(view))),
        None => Err(AppError::problem_with_detail(
            StatusCode::NOT_FOUND,
            "No such dead letter",
            format!("no dead letter has message id '{message_id}'"),
        )),
    }
}
