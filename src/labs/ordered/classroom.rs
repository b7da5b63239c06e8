//! The lesson's classroom door: `POST /ordered/apply` for the one aggregate `demo`, sequences
//! 1..10, and `GET /ordered/state`. Same engine and tables as the general door; the seed's bodies,
//! statuses and identity rule.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Router, extract};
use serde::Deserialize;
use serde_json::json;

use crate::app::AppState;
use crate::aspnet::is_blank_or_longer_than;
use crate::error::{AppError, Json, RequestBody, json_response};
use crate::ordering::{OrderedMessage, Outcome, apply_ordered};

pub(super) fn routes() -> Router<AppState> {
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
    State(state): State<AppState>,
    Json(input): Json<OrderedInput>,
) -> Result<Response, AppError> {
    let message = input.validate()?;
    let outcome = state
        .store
        .write(move |connection| apply_ordered(connection, &message).map_err(AppError::from))
        .await?;
    Ok(classroom_response(&outcome))
}

/// The seed's exact status codes and bodies for each outcome.
fn classroom_response(outcome: &Outcome) -> Response {
    match outcome {
        Outcome::Applied { sequence, .. } => json_response(
            StatusCode::OK,
            json!({"outcome": "applied", "sequence": sequence}),
        ),
        Outcome::Replay { .. } => json_response(StatusCode::OK, json!({"outcome": "replay"})),
        Outcome::PayloadConflict => {
            json_response(StatusCode::CONFLICT, json!({"outcome": "payload conflict"}))
        }
        Outcome::Gap { expected } => json_response(
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
    }
}

/// The classroom aggregate's counts and last sequence. The seed took `MAX(last_sequence)` over
/// every aggregate, which was the same thing while `demo` was the only one; now that the general
/// door serves any aggregate, all three numbers describe `demo` alone.
async fn state(
    State(state): State<AppState>,
) -> Result<extract::Json<serde_json::Value>, AppError> {
    let (applied, deadletters, last) = state
        .store
        .read(|connection| {
            connection
                .prepare_cached(
                    "SELECT (SELECT COUNT(*) FROM ordered_inbox WHERE aggregate_id = ?1),
                            (SELECT COUNT(*) FROM deadletters WHERE aggregate_id = ?1),
                            COALESCE((SELECT last_sequence FROM aggregate_state
                                       WHERE aggregate_id = ?1), 0)",
                )?
                .query_row([CLASSROOM_AGGREGATE], |row| {
                    Ok((
                        row.get::<_, i64>(0)?,
                        row.get::<_, i64>(1)?,
                        row.get::<_, i64>(2)?,
                    ))
                })
                .map_err(AppError::from)
        })
        .await?;
    Ok(extract::Json(
        json!({"applied": applied, "deadletters": deadletters, "last": last}),
    ))
}
