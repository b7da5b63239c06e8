//! The general door's answer to each verdict: what happened, and what the caller can do about it.
//! One serializable type per verdict; the wording lives here, the decision in the library.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ordered_inbox::delivery::AppliedRecord;
use ordered_inbox::{DeadLetterNote, DeadLetterStatus, Detail, Outcome, QuarantineReason};
use serde::Serialize;
use utoipa::ToSchema;

use super::quarantine_full;
use crate::inbox::input::Delivered;

/// Each verdict with its status code.
pub(super) fn verdict_response(message: &Delivered, outcome: Outcome) -> Response {
    let about = About {
        aggregate_id: &message.aggregate_id,
        message_id: &message.message_id,
    };
    match outcome {
        Outcome::Applied {
            sequence,
            superseded,
            detail,
        } => {
            let total = applied_total(&detail);
            answer(StatusCode::OK, applied(about, sequence, total, superseded))
        }
        Outcome::Replay { original } => answer(StatusCode::OK, replay(about, original)),
        // Only the broker's door holds; over HTTP an early message stays a 409 gap.
        Outcome::Gap { expected }
        | Outcome::Held { expected, .. }
        | Outcome::HoldFull { expected, .. } => {
            answer(StatusCode::CONFLICT, gap(about, message, expected))
        }
        Outcome::Stale {
            expected,
            skipped_by,
        } => answer(
            StatusCode::CONFLICT,
            stale(about, message, expected, skipped_by),
        ),
        Outcome::PayloadConflict => answer(StatusCode::CONFLICT, payload_conflict(about)),
        Outcome::Quarantined {
            expected,
            reason,
            dead_letter,
        } => answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            quarantined(about, message, expected, reason, dead_letter),
        ),
        Outcome::QuarantineFull {
            expected,
            open,
            limit,
            ..
        } => quarantine_full(message, expected, open, limit),
    }
}

/// The aggregate's total after an applied message: the ledger's detail of its `applied` event.
fn applied_total(detail: &Detail) -> i64 {
    detail
        .get("total")
        .and_then(serde_json::Value::as_i64)
        .unwrap_or_default()
}

/// The 200 answers of a delivery, for the OpenAPI document.
#[derive(ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub(super) enum DeliveryAccepted<'a> {
    Applied(Applied<'a>),
    Replay(Replay<'a>),
}

/// The 409 answers of a delivery, for the OpenAPI document.
#[derive(ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub(super) enum DeliveryRefused<'a> {
    OutOfOrder(OutOfOrder<'a>),
    PayloadConflict(PayloadConflict<'a>),
}

fn answer(status: StatusCode, body: impl Serialize) -> Response {
    (status, axum::Json(body)).into_response()
}

/// The members every verdict starts with.
#[derive(Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct About<'a> {
    aggregate_id: &'a str,
    message_id: &'a str,
}

#[derive(Serialize, ToSchema)]
pub(super) struct Applied<'a> {
    #[schema(value_type = String, pattern = "^applied$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: About<'a>,
    sequence: i64,
    last: i64,
    total: i64,
    superseded: Vec<String>,
}

fn applied(about: About<'_>, sequence: i64, total: i64, superseded: Vec<String>) -> Applied<'_> {
    Applied {
        outcome: "applied",
        about,
        sequence,
        last: sequence,
        total,
        superseded,
    }
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Original {
    outcome: &'static str,
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
            outcome: "applied",
            sequence: original.sequence,
            applied_at: original.applied_at,
        },
        retryable: false,
        action: "nothing to do: this message was already applied and changed nothing now",
    }
}

/// A gap or a stale sequence: where the message stands against the aggregate.
#[derive(Serialize, ToSchema)]
pub(super) struct OutOfOrder<'a> {
    #[schema(value_type = String, pattern = "^(gap|stale)$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: About<'a>,
    sequence: i64,
    expected: i64,
    retryable: bool,
    action: String,
    /// (stale only) The operator's gap resolution that skipped this sequence before it arrived.
    #[serde(rename = "skippedBy", skip_serializing_if = "Option::is_none")]
    skipped_by: Option<i64>,
}

fn gap<'a>(about: About<'a>, message: &Delivered, expected: i64) -> OutOfOrder<'a> {
    OutOfOrder {
        outcome: "gap",
        about,
        sequence: message.sequence,
        expected,
        retryable: true,
        action: format!("deliver sequence {expected} first, then retry this message unchanged"),
        skipped_by: None,
    }
}

fn stale<'a>(
    about: About<'a>,
    message: &Delivered,
    expected: i64,
    skipped_by: Option<i64>,
) -> OutOfOrder<'a> {
    let sequence = message.sequence;
    let action = match skipped_by {
        Some(resolution) => format!(
            "sequence {sequence} was skipped by an operator's gap resolution {resolution} (GET /resolutions) and is never applied; do not retry"
        ),
        None => format!("sequence {sequence} was already taken by another message; do not retry"),
    };
    OutOfOrder {
        outcome: "stale",
        about,
        sequence,
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
        action: "this message id already carries other content and never changes meaning; send new content under a new message id",
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
    sequence: i64,
    expected: i64,
    reason: QuarantineReason,
    retryable: bool,
    dead_letter: DeadLetterState,
    resolution: NextStep,
}

fn quarantined<'a>(
    about: About<'a>,
    message: &Delivered,
    expected: i64,
    reason: QuarantineReason,
    note: Option<DeadLetterNote>,
) -> Quarantined<'a> {
    let status = note.map_or(DeadLetterStatus::Open, |note| note.status);
    let resolution = if status == DeadLetterStatus::Open {
        NextStep {
            requires_operator: true,
            how: format!(
                "an operator resolves it with POST /deadletters/{{messageId}}/resolution (replace or skip), or a corrected message under a new id takes sequence {expected}"
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
        sequence: message.sequence,
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
