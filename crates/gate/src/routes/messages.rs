//! Deliveries: `POST /v1/aggregates/{id}/messages` (a producer's token and `Producer-Epoch`, or
//! anonymous when the gate allows it) with a verdict that says what the caller can do, and
//! `POST /v1/producers/session`, which starts a producer's session and answers its epoch.

use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use ordered_inbox::{Door, OrderedMessage};
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::PayloadLimit;
use super::verdicts::{
    DeliveryAccepted, DeliveryRefused, GateDoor, Quarantined, refused, verdict_response,
};
use crate::auth::{Access, DeliveryCredential, active_producer, producer_unauthorized};
use crate::edge::{payload_too_large, refuse_declared_oversize};
use http_edge::credential::{Credential, credential};
use http_edge::error::{AppError, Json, Path, RequestBody, json_response};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::input::{
    Delivered, validate_aggregate_id, validate_message_id, validate_sequence,
};

const MAX_TYPE: usize = 64;

pub(super) fn routes<S>(body_limit: usize) -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    Access: FromRef<S>,
    PayloadLimit: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(deliver))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            PayloadLimit(body_limit),
            refuse_declared_oversize,
        ))
        .routes(routes!(session))
}

/// A gate message. The aggregate comes from the path; a body `aggregateId`, if present, must
/// name the same one. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GateMessageInput {
    /// 1 to 100 characters, not blank, no control characters; never changes meaning.
    #[schema(min_length = 1, max_length = 100)]
    message_id: String,
    #[schema(minimum = 1, maximum = 9007199254740992_i64)]
    sequence: i64,
    /// The message's type: its JSON Schema decides whether the payload is poison.
    #[serde(rename = "type")]
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    message_type: String,
    /// Any JSON value, checked against the type's schema.
    #[schema(value_type = Object)]
    payload: Value,
    #[schema(nullable = false)]
    aggregate_id: Option<String>,
}

impl RequestBody for GateMessageInput {
    const FIELDS: &'static [&'static str] =
        &["messageId", "sequence", "type", "payload", "aggregateId"];
}

impl GateMessageInput {
    /// The inbox's message for `aggregate_id`, its payload the envelope of type and payload; a
    /// 400 naming the member that is wrong.
    pub fn validate(self, aggregate_id: String) -> Result<OrderedMessage, AppError> {
        validate_message_id("messageId", &self.message_id)?;
        validate_sequence("sequence", self.sequence, 1)?;
        validate_type("type", &self.message_type)?;
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
            payload: crate::handler::envelope(&self.message_type, self.payload),
        })
    }
}

/// A message type: 1 to 64 characters of `A-Za-z0-9._:-`.
pub(super) fn validate_type(name: &str, message_type: &str) -> Result<(), AppError> {
    let valid = (1..=MAX_TYPE).contains(&message_type.len())
        && message_type
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(AppError::bad_request(format!(
            "{name} must be 1 to {MAX_TYPE} characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'"
        )))
    }
}

/// A body over the gate's limit: 413 naming the limit the configuration sets.
pub(super) fn within_limit<T>(
    body: Result<Json<T>, AppError>,
    limit: PayloadLimit,
) -> Result<Json<T>, AppError> {
    body.map_err(|error| match error {
        AppError::Problem { status, .. } if status == StatusCode::PAYLOAD_TOO_LARGE => {
            payload_too_large(limit)
        }
        other => other,
    })
}

/// A delivery. The producer's epoch and the aggregate's owner are checked in the write's own
/// transaction; the payload is checked against its type's schema there too.
#[utoipa::path(post, path = "/v1/aggregates/{aggregate_id}/messages", tag = "messages",
    params(
        ("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"),
        ("producer-epoch" = Option<i64>, Header, minimum = 1, description = "With a producer's token: the epoch POST /v1/producers/session answered"),
    ),
    request_body = GateMessageInput,
    security(("producer" = []), ()),
    responses(
        (status = 200, description = "Applied (the next sequence), or a replay of an applied id", body = DeliveryAccepted),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "Anonymous writes are off, a producer's credential is missing, unknown or revoked, or the aggregate's owner must deliver", body = http_edge::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 403, description = "Not the aggregate's owner, or an unowned aggregate with history that only an operator may give an owner", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 409, description = "A gap (deliver `expected` first), a stale sequence or a payload conflict (JSON); or the producer is fenced or has no session (problem)", content(
            (DeliveryRefused = "application/json"),
            (http_edge::openapi::Problem = "application/problem+json"),
        )),
        (status = 413, response = http_edge::openapi::ContentTooLarge),
        (status = 422, description = "Quarantined as a dead letter (its type's schema refuses the payload, or the type is unknown): the aggregate waits for an operator or a corrected message", body = Quarantined),
        (status = 429, description = "The producer is over its rate (Retry-After), or the aggregate's quarantine is full", body = http_edge::openapi::Problem, content_type = "application/problem+json",
            headers(("retry-after" = u64))),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn deliver(
    State(inbox): State<SharedInbox>,
    State(access): State<Access>,
    State(limit): State<PayloadLimit>,
    Path(aggregate_id): Path<String>,
    // Who sends it, from the head: without a valid credential the body is never read.
    credential: DeliveryCredential,
    body: Result<Json<GateMessageInput>, AppError>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let Json(input) = within_limit(body, limit)?;
    let message = input.validate(aggregate_id)?;
    // The producer's budget pays for well-formed deliveries only.
    let claim = match credential.admit(&access) {
        Ok(claim) => claim,
        Err(limited) => return Ok(limited.into_response()),
    };
    let delivered = Delivered::of(&message);
    Ok(
        match inbox.deliver_as(message, Door::General, claim).await? {
            Ok(outcome) => verdict_response::<GateDoor>(&delivered, outcome),
            Err(refusal) => refused::<GateDoor>(&delivered, refusal),
        },
    )
}

/// A producer's new session.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Session {
    producer: String,
    /// Send it as `Producer-Epoch` with every delivery of this session.
    epoch: i64,
}

/// `POST /v1/producers/session`: the producer's epoch goes one up; every delivery under an older
/// one is fenced from now on.
#[utoipa::path(post, path = "/v1/producers/session", tag = "messages", security(("producer" = [])), responses(
    (status = 200, description = "The producer's new epoch; older ones are fenced from now on", body = Session),
    (status = 400, response = http_edge::openapi::BadRequest),
    (status = 401, description = "No active producer's token", body = http_edge::openapi::Problem, content_type = "application/problem+json",
        headers(("www-authenticate" = String))),
    (status = 500, response = http_edge::openapi::StoreFailed),
    (status = 503, response = http_edge::openapi::StoreUnavailable),
))]
async fn session(
    State(inbox): State<SharedInbox>,
    headers: HeaderMap,
) -> Result<Response, AppError> {
    let Credential::Bearer(token) = credential(&headers)? else {
        return Ok(producer_unauthorized(
            "send Authorization: Bearer TOKEN with a producer's token (POST /v1/producers registers one)",
        ));
    };
    let producer = match active_producer(&inbox, token).await {
        Ok(producer) => producer,
        Err(response) => return Ok(response),
    };
    Ok(match inbox.start_session(producer.clone()).await? {
        Ok(epoch) => json_response(
            StatusCode::OK,
            json!({"producer": producer, "epoch": epoch}),
        ),
        Err(_) => producer_unauthorized("the producer was revoked before the session started")
            .into_response(),
    })
}
