//! Producers on the general door: `POST /producers/session` (a producer's Bearer token) starts a
//! session and answers its new epoch; deliveries carry the token and `Producer-Epoch`, and the
//! inbox fences older epochs and enforces aggregate ownership in the delivery's own transaction;
//! `POST /aggregates/{id}/owner` (an operator's token) transfers an aggregate, audited;
//! `GET /producers` lists producers (never tokens).

use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use ordered_inbox::producers::TransferRequest;
use ordered_inbox::records::{ProducerClaim, TransferRefusal};
use ordered_inbox::views::{OwnershipState, ProducerView};
use serde::{Deserialize, Deserializer};
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::operator::{authenticate, unauthorized};
use super::verdicts::producer_unauthorized;
use crate::http::credential::{Credential, credential};
use crate::http::error::{AppError, Json, Path, RequestBody, json_response, problem_response_with};
use crate::inbox::SharedInbox;
use crate::inbox::input::{validate_aggregate_id, validate_sequence};
use crate::inbox::requests::reason;

/// The header a producer's delivery names its session's epoch in.
pub const PRODUCER_EPOCH: HeaderName = HeaderName::from_static("producer-epoch");

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(list))
        .routes(routes!(session))
        .routes(routes!(transfer))
}

// The bodies below, as the OpenAPI document describes them.

/// A producer's new session.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Session {
    producer: String,
    /// Send it as `Producer-Epoch` with every delivery of this session.
    epoch: i64,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct ProducerList {
    producers: Vec<ProducerView>,
}

/// A transfer's answer: the audited record.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Transferred {
    #[schema(pattern = "^owner transferred$")]
    outcome: String,
    transfer: ordered_inbox::records::TransferRecord,
}

/// A refused transfer: what failed, and the aggregate's owner and last sequence now.
#[derive(ToSchema)]
#[allow(dead_code)]
struct TransferRefused {
    #[serde(flatten)]
    problem: crate::http::openapi::Problem,
    current: OwnershipState,
}

/// An operator's transfer of an aggregate. Names bind case-insensitively.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct TransferBody {
    /// The receiving producer.
    producer: String,
    /// The owner the operator expects now, or null for an unowned aggregate (required).
    #[schema(required = true)]
    expected_owner: Option<String>,
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    expected_last: i64,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
}

/// Who a general-door delivery is made by: `Ok(None)` when it carries no Authorization header
/// (anonymous, today's behaviour), the producer and epoch when it carries a producer's token and
/// a `Producer-Epoch`, or the answer that refuses it.
pub(super) async fn producer_claim(
    inbox: &SharedInbox,
    headers: &HeaderMap,
) -> Result<Option<ProducerClaim>, Response> {
    let token = match credential(headers).map_err(IntoResponse::into_response)? {
        Credential::Missing => return Ok(None),
        Credential::Unusable => {
            return Err(producer_unauthorized(
                "the Authorization header must be Bearer TOKEN with a producer's token".to_owned(),
            ));
        }
        Credential::Bearer(token) => token,
    };
    let producer = inbox
        .reads()
        .check_producer(token)
        .await
        .map_err(|error| AppError::from(error).into_response())?
        .ok_or_else(|| {
            producer_unauthorized(
                "the token is not an active producer's token (unknown or revoked)",
            )
        })?;
    let epoch = epoch_header(headers).map_err(IntoResponse::into_response)?;
    Ok(Some(ProducerClaim { producer, epoch }))
}

/// `Producer-Epoch: N`, exactly one, written as [`crate::http::producer_epoch::parse`] reads it.
fn epoch_header(headers: &HeaderMap) -> Result<i64, AppError> {
    const ADVICE: &str = "a producer's delivery needs one Producer-Epoch header: the epoch POST /producers/session answered";
    let mut values = headers.get_all(&PRODUCER_EPOCH).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(AppError::bad_request(ADVICE));
    };
    value
        .to_str()
        .ok()
        .and_then(crate::http::producer_epoch::parse)
        .ok_or_else(|| {
            AppError::bad_request(format!(
                "{ADVICE}, a whole number from 1 in digits only (no sign, no leading zero)"
            ))
        })
}

/// `POST /producers/session`: the producer's epoch goes one up; every delivery under an older
/// one is fenced from now on.
#[utoipa::path(post, path = "/producers/session", tag = "ordered", security(("producer" = [])), responses(
    (status = 200, description = "The producer's new epoch; older ones are fenced from now on", body = Session),
    (status = 400, response = crate::http::openapi::BadRequest),
    (status = 401, description = "No active producer's token", body = crate::http::openapi::Problem, content_type = "application/problem+json",
        headers(("www-authenticate" = String))),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn session(
    State(inbox): State<SharedInbox>,
    headers: HeaderMap,
) -> Result<Response, AppError> {
    let Credential::Bearer(token) = credential(&headers)? else {
        return Ok(producer_unauthorized(
            "send Authorization: Bearer TOKEN with a producer's token (production-lab producer add NAME --database PATH)".to_owned(),
        ));
    };
    let Some(producer) = inbox.reads().check_producer(token).await? else {
        return Ok(producer_unauthorized(
            "the token is not an active producer's token (unknown or revoked)".to_owned(),
        ));
    };
    Ok(match inbox.start_session(producer.clone()).await? {
        Ok(epoch) => json_response(
            StatusCode::OK,
            json!({"producer": producer, "epoch": epoch}),
        ),
        Err(_) => {
            producer_unauthorized("the producer was revoked before the session started".to_owned())
        }
    })
}

/// `GET /producers`: name, current epoch, owned aggregates, last delivery; never tokens.
#[utoipa::path(get, path = "/producers", tag = "ordered", responses(
    (status = 200, description = "Every producer, the first registered first (never tokens)", body = ProducerList),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn list(State(inbox): State<SharedInbox>) -> Result<Response, AppError> {
    let producers = inbox.reads().producers().await?;
    Ok(json_response(
        StatusCode::OK,
        json!({"producers": producers}),
    ))
}

/// A present member that may be null: `Some(None)` for null, `None` when it is missing.
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(deserializer).map(Some)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TransferInput {
    producer: String,
    #[serde(default, deserialize_with = "present")]
    expected_owner: Option<Option<String>>,
    expected_last: i64,
    reason: String,
}

impl RequestBody for TransferInput {
    const FIELDS: &'static [&'static str] =
        &["producer", "expectedOwner", "expectedLast", "reason"];
}

/// `POST /aggregates/{id}/owner` with an operator's token.
#[utoipa::path(post, path = "/aggregates/{aggregate_id}/owner", tag = "ordered",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate")),
    request_body = TransferBody,
    security(("operator" = [])),
    responses(
        (status = 200, description = "Transferred, with the audit record", body = Transferred),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 401, description = "No operator's token", body = crate::http::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 409, description = "The owner or the last sequence is not the expected one; `current` shows them", body = TransferRefused, content_type = "application/problem+json"),
        (status = 422, description = "The receiving producer is unknown or revoked", body = TransferRefused, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn transfer(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    headers: HeaderMap,
    body: Result<Json<TransferInput>, AppError>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let operator = match authenticate(&inbox, &headers).await {
        Ok(operator) => operator,
        Err(response) => return Ok(response),
    };
    let Json(input) = body?;
    let Some(expected_owner) = input.expected_owner else {
        return Err(AppError::bad_request(
            "expectedOwner is required: the owner you expect, or null for an unowned aggregate",
        ));
    };
    validate_sequence("expectedLast", input.expected_last, 0)?;
    let reason = reason(&input.reason)?;
    let request = TransferRequest {
        aggregate_id,
        operator,
        producer: input.producer,
        expected_owner,
        expected_last: input.expected_last,
        reason,
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
        TransferRefusal::Unauthorized => {
            return unauthorized("the operator's token was revoked before the change".to_owned());
        }
        TransferRefusal::UnknownProducer => (
            StatusCode::UNPROCESSABLE_ENTITY,
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
