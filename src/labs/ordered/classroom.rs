//! The lesson's classroom door: `POST /ordered/apply` for the one aggregate `demo`, sequences
//! 1..10, and `GET /ordered/state`. Same inbox and tables as the general door; the seed's bodies,
//! statuses and identity rule.

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Router, extract};
use ordered_inbox::views::AggregateCounts;
use ordered_inbox::{Door, OrderedMessage, Outcome};
use serde::Deserialize;
use serde_json::json;

use super::{SharedInbox, quarantine_full};
use crate::aspnet::is_blank_or_longer_than;
use crate::error::{AppError, Json, RequestBody, json_response};

pub(super) fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    Router::new()
        .route("/ordered/apply", post(apply))
        .route("/ordered/state", get(state))
}

/// The classroom body. Every property is required: a missing one is a 400, not a default.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderedInput {
    message_id: Option<String>,
    aggregate_id: Option<String>,
    sequence: i32,
    amount: i32,
}

impl RequestBody for OrderedInput {
    const FIELDS: &'static [&'static str] = &["messageId", "aggregateId", "sequence", "amount"];
}

pub(super) const CLASSROOM_AGGREGATE: &str = "demo";
const MAX_MESSAGE_ID: usize = 20;
const MAX_SEQUENCE: i32 = 10;

impl OrderedInput {
    fn validate(self) -> Result<OrderedMessage, AppError> {
        let message_id = self.message_id.unwrap_or_default();
        // Length counted as .NET counts it (UTF-16 code units), as the seed's check does.
        if is_blank_or_longer_than(&message_id, MAX_MESSAGE_ID) {
            return Err(AppError::bad_request(format!(
                "messageId must be 1 to {MAX_MESSAGE_ID} characters and not blank"
            )));
        }
        if self.aggregate_id.as_deref() != Some(CLASSROOM_AGGREGATE) {
            return Err(AppError::bad_request(format!(
                "aggregateId must be \"{CLASSROOM_AGGREGATE}\": the classroom fixture owns one aggregate"
            )));
        }
        if !(1..=MAX_SEQUENCE).contains(&self.sequence) {
            return Err(AppError::bad_request(format!(
                "sequence must be from 1 to {MAX_SEQUENCE}"
            )));
        }
        Ok(OrderedMessage {
            message_id,
            aggregate_id: CLASSROOM_AGGREGATE.to_owned(),
            sequence: i64::from(self.sequence),
            amount: i64::from(self.amount),
        })
    }
}

async fn apply(
    State(inbox): State<SharedInbox>,
    Json(input): Json<OrderedInput>,
) -> Result<Response, AppError> {
    let message = input.validate()?;
    let outcome = inbox.deliver(message.clone(), Door::Classroom).await?;
    Ok(classroom_response(&message, &outcome))
}

/// The seed's exact status codes and bodies for each outcome.
fn classroom_response(message: &OrderedMessage, outcome: &Outcome) -> Response {
    match outcome {
        Outcome::Applied { sequence, .. } => json_response(
            StatusCode::OK,
            json!({"outcome": "applied", "sequence": sequence}),
        ),
        Outcome::Replay { .. } => json_response(StatusCode::OK, json!({"outcome": "replay"})),
        Outcome::PayloadConflict => {
            json_response(StatusCode::CONFLICT, json!({"outcome": "payload conflict"}))
        }
        // Only the broker's door holds; answered here as what it is to the classroom, a gap.
        Outcome::Gap { expected }
        | Outcome::Held { expected, .. }
        | Outcome::HoldFull { expected, .. } => json_response(
            StatusCode::CONFLICT,
            json!({"outcome": "gap", "expected": expected}),
        ),
        Outcome::Stale { expected } => json_response(
            StatusCode::CONFLICT,
            json!({"outcome": "stale", "expected": expected}),
        ),
        Outcome::Quarantined { expected, .. } => json_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({"outcome": "quarantined", "expected": expected}),
        ),
        Outcome::QuarantineFull {
            expected,
            open,
            limit,
        } => quarantine_full(message, *expected, *open, *limit),
    }
}

/// The classroom aggregate's counts and last sequence. The seed took `MAX(last_sequence)` over
/// every aggregate, which was the same thing while `demo` was the only one; now that the general
/// door serves any aggregate, all three numbers describe `demo` alone.
async fn state(
    State(inbox): State<SharedInbox>,
) -> Result<extract::Json<serde_json::Value>, AppError> {
    let AggregateCounts {
        applied,
        dead_letters,
        last,
    } = inbox.counts(CLASSROOM_AGGREGATE.to_owned()).await?;
    Ok(extract::Json(
        json!({"applied": applied, "deadletters": dead_letters, "last": last}),
    ))
}
