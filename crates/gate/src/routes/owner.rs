//! An operator's transfer of an aggregate to another producer: `POST /v1/aggregates/{id}/owner`,
//! checked against the owner and last sequence the operator expects, audited, and recorded on the
//! aggregate's timeline in the same transaction.

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::producers::TransferRequest;
use ordered_inbox::records::{TransferRecord, TransferRefusal};
use ordered_inbox::views::OwnershipState;
use serde::{Deserialize, Deserializer};
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{Operator, operator_revoked};
use http_edge::error::{AppError, Json, Path, RequestBody, json_response, problem_response_with};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::input::{validate_aggregate_id, validate_sequence};
use http_edge::inbox::requests::reason;

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::new().routes(routes!(transfer))
}

/// A present member that may be null: `Some(None)` for null, `None` when it is missing.
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(deserializer).map(Some)
}

/// An operator's transfer of an aggregate. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct TransferInput {
    /// The receiving producer.
    producer: String,
    /// The owner the operator expects now, or null for an unowned aggregate (required).
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>, required = true)]
    expected_owner: Option<Option<String>>,
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    expected_last: i64,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
}

impl RequestBody for TransferInput {
    const FIELDS: &'static [&'static str] =
        &["producer", "expectedOwner", "expectedLast", "reason"];
}

/// A transfer's answer: the audited record.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Transferred {
    #[schema(pattern = "^owner transferred$")]
    outcome: String,
    transfer: TransferRecord,
}

/// A refused transfer: what failed, and the aggregate's owner and last sequence now.
#[derive(ToSchema)]
#[allow(dead_code)]
struct TransferRefused {
    #[serde(flatten)]
    problem: http_edge::openapi::Problem,
    current: OwnershipState,
}

/// `POST /v1/aggregates/{id}/owner`.
#[utoipa::path(post, path = "/v1/aggregates/{aggregate_id}/owner", tag = "operators",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate")),
    request_body = TransferInput,
    security(("operator" = [])),
    responses(
        (status = 200, description = "Transferred, with the audit record", body = Transferred),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 409, description = "The owner or the last sequence is not the expected one, or the receiving producer is unknown or revoked; `current` shows the ownership now", body = TransferRefused, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn transfer(
    Operator(operator): Operator,
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    body: Result<Json<TransferInput>, AppError>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let Json(input) = body?;
    let Some(expected_owner) = input.expected_owner else {
        return Err(AppError::bad_request(
            "expectedOwner is required: the owner you expect, or null for an unowned aggregate",
        ));
    };
    validate_sequence("expectedLast", input.expected_last, 0)?;
    let request = TransferRequest {
        aggregate_id,
        operator,
        producer: input.producer,
        expected_owner,
        expected_last: input.expected_last,
        reason: reason(&input.reason)?,
    };
    Ok(match inbox.transfer_owner(request).await? {
        Ok(record) => json_response(
            StatusCode::OK,
            json!({"outcome": "owner transferred", "transfer": record}),
        ),
        Err(conflict) => transfer_refused(conflict.refusal, &conflict.current),
    })
}

fn transfer_refused(refusal: TransferRefusal, current: &OwnershipState) -> Response {
    let (status, title, detail) = match refusal {
        TransferRefusal::Unauthorized => return operator_revoked(),
        // 422 is kept for quarantined messages: an unknown receiver conflicts with the registry.
        TransferRefusal::UnknownProducer => (
            StatusCode::CONFLICT,
            "No such active producer",
            "the receiving producer is unknown or revoked; nothing was changed",
        ),
        TransferRefusal::OwnerMismatch => (
            StatusCode::CONFLICT,
            "The aggregate is not owned as expected",
            "expectedOwner differs from the aggregate's owner: review the current state and decide again",
        ),
        TransferRefusal::LastMismatch => (
            StatusCode::CONFLICT,
            "The aggregate is not at the expected last sequence",
            "expectedLast differs from the aggregate's last sequence: review the current state and decide again",
        ),
    };
    problem_response_with(status, title, Some(detail), json!({"current": current}))
}
