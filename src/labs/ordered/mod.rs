//! Ordered delivery, two doors onto one inbox ([`ordered_inbox`]):
//!
//! - `classroom`: the lesson's `POST /ordered/apply` and `GET /ordered/state`, unchanged;
//! - `aggregates`: the general inbox `POST /aggregates/{id}/messages` for any aggregate, with
//!   verdicts that say what the caller can do, and the evidence (aggregate state, blocked/waiting
//!   inventory, timeline, dead letters);
//! - `resolution`: operator-approved poison resolution and its audit trail;
//! - `gaps`: what a waiting aggregate is missing, and an operator's audited skip of it;
//! - `producers`: producer sessions (epochs, fencing), aggregate ownership and its transfer.
//!
//! The handlers take only the inbox ([`crate::inbox::SharedInbox`]): the library decides, this module words the
//! answers.

mod aggregates;
mod classroom;
mod gaps;
mod operator;
pub mod practice;
mod producers;
mod resolution;
mod verdicts;

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;

use crate::http::error::{problem_response_with, with_retry_after};
use crate::inbox::SharedInbox;
use crate::inbox::answers::QUARANTINE_FULL_RETRY_AFTER_SECONDS;
use crate::inbox::input::Delivered;

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::new()
        .merge(classroom::routes())
        .merge(aggregates::routes())
        .merge(resolution::routes())
        .merge(gaps::routes())
        .merge(producers::routes())
}

/// 429: a new poison message for an aggregate whose quarantine is full. Nothing was recorded
/// but one (bounded) timeline observation.
fn quarantine_full(message: &Delivered, expected: i64, open: usize, limit: usize) -> Response {
    let response = problem_response_with(
        StatusCode::TOO_MANY_REQUESTS,
        "Quarantine full",
        Some(&format!(
            "aggregate '{}' already holds {open} open dead letters, the most it keeps ({limit}); this poison message was not recorded. Resolve the open ones, or deliver a valid message for sequence {expected}",
            message.aggregate_id
        )),
        json!({
            "outcome": "quarantine full",
            "aggregateId": message.aggregate_id,
            "messageId": message.message_id,
            "expected": expected,
            "openDeadLetters": open,
            "limit": limit,
            "retryable": false,
        }),
    );
    with_retry_after(response, QUARANTINE_FULL_RETRY_AFTER_SECONDS)
}
