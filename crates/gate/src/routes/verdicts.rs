//! A delivery's answer for each verdict: what happened, and what the caller can do about it. One
//! serializable type per verdict, so the document shows each body; the decision is the
//! library's.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ordered_inbox::delivery::AppliedRecord;
use ordered_inbox::{DeadLetterNote, DeadLetterStatus, Outcome, ProducerRefusal, QuarantineReason};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

use crate::auth::producer_unauthorized;
use http_edge::error::{problem_response_with, with_retry_after};
use http_edge::inbox::answers::QUARANTINE_FULL_RETRY_AFTER_SECONDS;
use http_edge::inbox::input::Delivered;

/// Each verdict with its status code: 200 applied or replay, 409 gap, stale or payload
/// conflict, 422 quarantined, 429 quarantine full.
pub(super) fn verdict_response(message: &Delivered, outcome: Outcome) -> Response {
    let about = About::of(message);
    match outcome {
        Outcome::Applied {
            sequence,
            superseded,
            ..
        } => answer(StatusCode::OK, applied(about, sequence, superseded)),
        Outcome::Replay { original } => answer(StatusCode::OK, replay(about, original)),
        // Only the broker's door holds; over HTTP an early message stays a 409 gap.
        Outcome::Gap { expected }
        | Outcome::Held { expected, .. }
        | Outcome::HoldFull { expected, .. } => answer(StatusCode::CONFLICT, gap(about, expected)),
        Outcome::Stale {
            expected,
            skipped_by,
        } => answer(StatusCode::CONFLICT, stale(about, expected, skipped_by)),
        Outcome::PayloadConflict => answer(StatusCode::CONFLICT, payload_conflict(about)),
        Outcome::Quarantined {
            expected,
            reason,
            dead_letter,
        } => answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            quarantined(about, expected, reason, dead_letter),
        ),
        Outcome::QuarantineFull {
            expected,
            open,
            limit,
            ..
        } => quarantine_full(about, expected, open, limit),
    }
}

fn answer(status: StatusCode, body: impl Serialize) -> Response {
    (status, axum::Json(body)).into_response()
}

/// The 200 answers of a delivery, for the OpenAPI document.
#[derive(ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub(super) enum DeliveryAccepted<'a> {
    Applied(Applied<'a>),
    Replay(Replay<'a>),
}

/// The JSON 409 answers of a delivery, for the OpenAPI document.
#[derive(ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub(super) enum DeliveryRefused<'a> {
    OutOfOrder(OutOfOrder<'a>),
    PayloadConflict(PayloadConflict<'a>),
}

/// The members every verdict starts with.
#[derive(Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct About<'a> {
    aggregate_id: &'a str,
    message_id: &'a str,
    sequence: i64,
}

impl<'a> About<'a> {
    fn of(message: &'a Delivered) -> About<'a> {
        About {
            aggregate_id: &message.aggregate_id,
            message_id: &message.message_id,
            sequence: message.sequence,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub(super) struct Applied<'a> {
    #[schema(value_type = String, pattern = "^applied$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: About<'a>,
    /// Open dead letters at this sequence that the message replaced.
    superseded: Vec<String>,
}

fn applied(about: About<'_>, sequence: i64, superseded: Vec<String>) -> Applied<'_> {
    Applied {
        outcome: "applied",
        about: About { sequence, ..about },
        superseded,
    }
}

/// The applied message a replay points at.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Original {
    sequence: i64,
    applied_at: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub(super) struct Replay<'a> {
    #[schema(value_type = String, pattern = "^replay$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: About<'a>,
    original: Original,
    retryable: bool,
    action: &'static str,
}

fn replay(about: About<'_>, original: AppliedRecord) -> Replay<'_> {
    Replay {
        outcome: "replay",
        about,
        original: Original {
            sequence: original.sequence,
            applied_at: original.applied_at,
        },
        retryable: false,
        action: "nothing to do: this message was already applied and changed nothing now",
    }
}

/// A gap or a stale sequence: where the message stands against the aggregate.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct OutOfOrder<'a> {
    #[schema(value_type = String, pattern = "^(gap|stale)$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: About<'a>,
    /// The sequence the aggregate needs next.
    expected: i64,
    retryable: bool,
    action: String,
    /// (stale only) The operator's gap resolution that skipped this sequence before it arrived.
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped_by: Option<i64>,
}

fn gap(about: About<'_>, expected: i64) -> OutOfOrder<'_> {
    OutOfOrder {
        outcome: "gap",
        about,
        expected,
        retryable: true,
        action: format!("deliver sequence {expected} first, then retry this message unchanged"),
        skipped_by: None,
    }
}

fn stale(about: About<'_>, expected: i64, skipped_by: Option<i64>) -> OutOfOrder<'_> {
    let sequence = about.sequence;
    let action = match skipped_by {
        Some(resolution) => format!(
            "sequence {sequence} was skipped by an operator's gap resolution {resolution} (GET /v1/resolutions) and is never applied; do not retry"
        ),
        None => format!("sequence {sequence} was already taken by another message; do not retry"),
    };
    OutOfOrder {
        outcome: "stale",
        about,
        expected,
        retryable: false,
        action,
        skipped_by,
    }
}

#[derive(Serialize, ToSchema)]
pub(super) struct PayloadConflict<'a> {
    #[schema(value_type = String, pattern = "^payload conflict$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: About<'a>,
    retryable: bool,
    action: &'static str,
}

fn payload_conflict(about: About<'_>) -> PayloadConflict<'_> {
    PayloadConflict {
        outcome: "payload conflict",
        about,
        retryable: false,
        action: "this message id already carries another type or payload and never changes meaning; send new content under a new message id",
    }
}

#[derive(Serialize, ToSchema)]
struct DeadLetterState {
    status: DeadLetterStatus,
    observations: Option<i64>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct NextStep {
    requires_operator: bool,
    how: String,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct Quarantined<'a> {
    #[schema(value_type = String, pattern = "^quarantined$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: About<'a>,
    expected: i64,
    /// Why it is poison: the type is unknown, or the first error of its schema.
    reason: QuarantineReason,
    retryable: bool,
    dead_letter: DeadLetterState,
    resolution: NextStep,
}

fn quarantined(
    about: About<'_>,
    expected: i64,
    reason: QuarantineReason,
    note: Option<DeadLetterNote>,
) -> Quarantined<'_> {
    let status = note.map_or(DeadLetterStatus::Open, |note| note.status);
    let resolution = if status == DeadLetterStatus::Open {
        NextStep {
            requires_operator: true,
            how: format!(
                "an operator resolves it with POST /v1/deadletters/resolution?messageId= (replace or skip), or a corrected message under a new id takes sequence {expected}"
            ),
        }
    } else {
        NextStep {
            requires_operator: false,
            how: format!("the dead letter is already {status}; nothing to do"),
        }
    };
    Quarantined {
        outcome: "quarantined",
        about,
        expected,
        reason,
        retryable: false,
        dead_letter: DeadLetterState {
            status,
            observations: note.map(|note| note.observations),
        },
        resolution,
    }
}

/// 429: a new poison message for an aggregate whose quarantine is full. Nothing was recorded
/// but one (bounded) timeline observation.
fn quarantine_full(about: About<'_>, expected: i64, open: usize, limit: usize) -> Response {
    let response = problem_response_with(
        StatusCode::TOO_MANY_REQUESTS,
        "Quarantine full",
        Some(&format!(
            "aggregate '{}' already holds {open} open dead letters, the most it keeps ({limit}); this poison message was not recorded. Resolve the open ones, or deliver a valid message for sequence {expected}",
            about.aggregate_id
        )),
        json!({
            "outcome": "quarantine full",
            "aggregateId": about.aggregate_id,
            "messageId": about.message_id,
            "expected": expected,
            "openDeadLetters": open,
            "limit": limit,
            "retryable": false,
        }),
    );
    with_retry_after(response, QUARANTINE_FULL_RETRY_AFTER_SECONDS)
}

/// The answer to a delivery the inbox refused before deciding it: nothing was written.
pub(super) fn refused(message: &Delivered, refusal: ProducerRefusal) -> Response {
    let about = |outcome: &str, key: &str, value: Value| {
        let mut body = json!({
            "outcome": outcome,
            "aggregateId": message.aggregate_id,
            "messageId": message.message_id,
            "retryable": false,
        });
        if let Some(object) = body.as_object_mut() {
            object.insert(key.to_owned(), value);
        }
        body
    };
    let aggregate = &message.aggregate_id;
    let (status, title, detail, extensions) = match refusal {
        ProducerRefusal::Fenced {
            offered,
            current_epoch,
        } => (
            StatusCode::CONFLICT,
            "Fenced",
            format!(
                "epoch {offered} is older than the producer's current epoch {current_epoch}: a newer instance of this producer has taken over; this instance must stop (nothing was applied)"
            ),
            about("fenced", "currentEpoch", json!(current_epoch)),
        ),
        ProducerRefusal::EpochNotIssued {
            offered,
            current_epoch,
        } => (
            StatusCode::BAD_REQUEST,
            "Epoch never issued",
            format!(
                "epoch {offered} was never issued to this producer (its current epoch is {current_epoch}); use the epoch POST /v1/producers/session answered"
            ),
            about("epoch not issued", "currentEpoch", json!(current_epoch)),
        ),
        ProducerRefusal::NoSession => (
            StatusCode::CONFLICT,
            "No producer session",
            "the producer has never started a session: POST /v1/producers/session first".to_owned(),
            about("no session", "currentEpoch", json!(0)),
        ),
        ProducerRefusal::NotOwner { owner } => (
            StatusCode::FORBIDDEN,
            "Not the owner",
            format!(
                "aggregate '{aggregate}' is owned by producer '{owner}'; only its owner may write its sequence (an operator may transfer it)"
            ),
            about("not the owner", "owner", json!(owner)),
        ),
        ProducerRefusal::ClaimRequiresOperator => (
            StatusCode::FORBIDDEN,
            "The aggregate has history and no owner",
            format!(
                "aggregate '{aggregate}' was written before any producer claimed it; only an operator may give it an owner (POST /v1/aggregates/{{id}}/owner)"
            ),
            about("claim requires operator", "owner", Value::Null),
        ),
        ProducerRefusal::Revoked => {
            return producer_unauthorized("the producer was revoked before the delivery");
        }
        ProducerRefusal::OwnerRequired => {
            return producer_unauthorized(format!(
                "aggregate '{aggregate}' is owned by a producer: deliver with its token (Authorization: Bearer TOKEN) and Producer-Epoch"
            ));
        }
    };
    problem_response_with(status, title, Some(&detail), extensions)
}
