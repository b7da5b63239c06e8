//! The lesson's classroom door: `POST /ordered/apply` for the one aggregate `demo`, sequences
//! 1..10, and `GET /ordered/state`. Same inbox and tables as the general door; the seed's bodies,
//! statuses and identity rule. The door is anonymous, so once a producer owns `demo` (claimed
//! through the general door) it answers 401 as the general door answers an anonymous delivery.

use axum::extract;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::views::AggregateCounts;
use ordered_inbox::{Door, OrderedMessage, Outcome};
use serde::Deserialize;
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::verdicts::{GeneralDoor, quarantine_full, refused};
use crate::http::aspnet::is_blank_or_longer_than;
use crate::http::error::{AppError, Json, RequestBody, json_response};
use crate::inbox::SharedInbox;
use crate::inbox::input::Delivered;

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(apply))
        .routes(routes!(state))
}

/// The classroom body. Every property is required: a missing one is a 400, not a default.
/// Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct OrderedInput {
    /// 1 to 20 characters (UTF-16 code units), not blank.
    #[schema(value_type = String, required = true, min_length = 1, max_length = 20)]
    message_id: Option<String>,
    /// The one classroom aggregate.
    #[schema(value_type = String, required = true, pattern = "^demo$", example = "demo")]
    aggregate_id: Option<String>,
    #[schema(minimum = 1, maximum = 10)]
    sequence: i32,
    /// A negative amount is poison: it is quarantined.
    amount: i32,
}

/// A classroom answer, in the seed's shape: the outcome, with the sequence applied or the one
/// expected next.
#[derive(ToSchema)]
#[allow(dead_code)]
struct ClassroomAnswer {
    #[schema(inline)]
    outcome: ClassroomOutcome,
    /// The applied sequence (`applied` only).
    #[schema(required = false)]
    sequence: i64,
    /// The sequence the aggregate needs next (`gap`, `stale`, `quarantined`).
    #[schema(required = false)]
    expected: i64,
}

#[derive(ToSchema)]
#[allow(dead_code)]
enum ClassroomOutcome {
    #[schema(rename = "applied")]
    Applied,
    #[schema(rename = "replay")]
    Replay,
    #[schema(rename = "payload conflict")]
    PayloadConflict,
    #[schema(rename = "gap")]
    Gap,
    #[schema(rename = "stale")]
    Stale,
    #[schema(rename = "quarantined")]
    Quarantined,
}

/// The classroom aggregate's rows, in the seed's names.
#[derive(ToSchema)]
#[allow(dead_code)]
struct ClassroomState {
    applied: i64,
    deadletters: i64,
    last: i64,
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
        Ok(crate::inbox::ledger::message(
            message_id,
            CLASSROOM_AGGREGATE.to_owned(),
            i64::from(self.sequence),
            i64::from(self.amount),
        ))
    }
}

/// The lesson's door: one aggregate `demo`, sequences 1..10, the seed's answers.
#[utoipa::path(post, path = "/ordered/apply", tag = "ordered", request_body = OrderedInput,
    responses(
        (status = 200, description = "`applied` (the next sequence) or `replay` (a known id, same content)", body = ClassroomAnswer),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 401, description = "A producer owns `demo`: only its owner writes it, through the general door with its token and epoch; nothing changed", body = crate::http::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 409, description = "`gap`, `stale` or `payload conflict`: nothing changed", body = ClassroomAnswer),
        (status = 422, description = "`quarantined`: a dead letter was recorded; the aggregate did not advance", body = ClassroomAnswer),
        (status = 429, description = "The aggregate's quarantine is full: the poison message was not recorded", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn apply(
    State(inbox): State<SharedInbox>,
    Json(input): Json<OrderedInput>,
) -> Result<Response, AppError> {
    let message = input.validate()?;
    // Anonymous, with the owner checked in the write's transaction like any delivery.
    let delivered = Delivered::of(&message);
    Ok(
        match inbox.deliver_as(message, Door::Classroom, None).await? {
            Ok(outcome) => classroom_response(&delivered, &outcome),
            Err(refusal) => refused::<GeneralDoor>(&delivered, refusal),
        },
    )
}

/// The seed's exact status codes and bodies for each outcome.
fn classroom_response(message: &Delivered, outcome: &Outcome) -> Response {
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
        Outcome::Stale { expected, .. } => json_response(
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
            ..
        } => quarantine_full(message, *expected, *open, *limit),
    }
}

/// The classroom aggregate's counts and last sequence. The seed took `MAX(last_sequence)` over
/// every aggregate, which was the same thing while `demo` was the only one; now that the general
/// door serves any aggregate, all three numbers describe `demo` alone.
#[utoipa::path(get, path = "/ordered/state", tag = "ordered", responses(
    (status = 200, description = "The classroom aggregate's applied messages, dead letters and last sequence", body = ClassroomState),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn state(
    State(inbox): State<SharedInbox>,
) -> Result<extract::Json<serde_json::Value>, AppError> {
    let AggregateCounts {
        applied,
        dead_letters,
        last,
    } = inbox.reads().counts(CLASSROOM_AGGREGATE.to_owned()).await?;
    Ok(extract::Json(
        json!({"applied": applied, "deadletters": dead_letters, "last": last}),
    ))
}
