//! A delivery's answer over HTTP, for every door that takes one: what happened, and what the
//! caller can do about it. One serializable type per verdict, so each door's OpenAPI document
//! shows each body; the decision is the library's.
//!
//! The doors answer with one vocabulary and differ only where their contracts do: the routes
//! their advice names, and the members a verdict opens with (a [`Door`] says both). A door names
//! the bodies in its route annotations through aliases, e.g.
//! `type Quarantined<'a> = verdicts::Quarantined<'a, MyDoor>`, so each component keeps its
//! plain name (`Quarantined`, not `Quarantined_MyDoor`).

use std::borrow::Cow;
use std::marker::PhantomData;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ordered_inbox::delivery::{AppliedRecord, DeadLetterNote};
use ordered_inbox::model::{DeadLetterStatus, QuarantineReason};
use ordered_inbox::records::ProducerRefusal;
use ordered_inbox::{Detail, Outcome};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::openapi::schema::{OneOfBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::answers::QUARANTINE_FULL_RETRY_AFTER_SECONDS;
use super::input::Delivered;
use crate::error::{problem_response_with, with_retry_after};

/// The routes and phrases a door's advice names.
pub struct Words {
    /// Where a stale sequence's skipping resolution is read, e.g. `GET /v1/resolutions`.
    pub resolutions: &'static str,
    /// How an operator resolves a dead letter, e.g. `POST /v1/deadletters/resolution?messageId=`.
    pub resolve_dead_letter: &'static str,
    /// What a payload conflict's message id already carries, e.g. `another type or payload`.
    pub conflicting_content: &'static str,
    /// Where a producer starts a session, e.g. `POST /v1/producers/session`.
    pub start_session: &'static str,
    /// Where an operator gives an aggregate an owner, e.g. `POST /v1/aggregates/{id}/owner`.
    pub transfer_owner: &'static str,
}

/// A door that answers deliveries: its words and the members its verdicts open with. Each
/// member type is a component of the door's document under its own name.
pub trait Door: ToSchema + 'static {
    const WORDS: Words;
    /// The members every verdict starts with (`aggregateId`, `messageId`, ...).
    type About<'a>: Serialize + ToSchema;
    /// The members a gap, stale or quarantined verdict starts with: the message's place.
    type Placed<'a>: Serialize + ToSchema;
    /// The members an applied verdict starts with.
    type Applied<'a>: Serialize + ToSchema;
    /// The applied message a replay points at.
    type Original: Serialize + ToSchema;

    fn about(message: &Delivered) -> Self::About<'_>;
    fn placed(message: &Delivered) -> Self::Placed<'_>;
    /// `sequence` is the applied one; `detail` the ledger's detail of its `applied` event.
    fn applied<'a>(message: &'a Delivered, sequence: i64, detail: &Detail) -> Self::Applied<'a>;
    fn original(record: AppliedRecord) -> Self::Original;
}

/// Each verdict with its status code: 200 applied or replay, 409 gap, stale or payload
/// conflict, 422 quarantined, 429 quarantine full.
pub fn verdict_response<D: Door>(message: &Delivered, outcome: Outcome) -> Response {
    match outcome {
        Outcome::Applied {
            sequence,
            superseded,
            detail,
        } => answer(
            StatusCode::OK,
            Applied::<D> {
                outcome: "applied",
                about: D::applied(message, sequence, &detail),
                superseded,
            },
        ),
        Outcome::Replay { original } => answer(StatusCode::OK, replay::<D>(message, original)),
        // Only the broker's door holds; over HTTP an early message stays a 409 gap.
        Outcome::Gap { expected }
        | Outcome::Held { expected, .. }
        | Outcome::HoldFull { expected, .. } => {
            answer(StatusCode::CONFLICT, gap::<D>(message, expected))
        }
        Outcome::Stale {
            expected,
            skipped_by,
        } => answer(
            StatusCode::CONFLICT,
            stale::<D>(message, expected, skipped_by),
        ),
        Outcome::PayloadConflict => answer(StatusCode::CONFLICT, payload_conflict::<D>(message)),
        Outcome::Quarantined {
            expected,
            reason,
            dead_letter,
        } => answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            quarantined::<D>(message, expected, reason, dead_letter),
        ),
        Outcome::QuarantineFull {
            expected,
            open,
            limit,
            ..
        } => quarantine_full(message, expected, open, limit),
    }
}

fn answer(status: StatusCode, body: impl Serialize) -> Response {
    (status, axum::Json(body)).into_response()
}

#[derive(Serialize, ToSchema)]
pub struct Applied<'a, D: Door> {
    #[schema(value_type = String, pattern = "^applied$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: D::Applied<'a>,
    /// Open dead letters at this sequence that the message replaced.
    superseded: Vec<String>,
}

#[derive(Serialize, ToSchema)]
pub struct Replay<'a, D: Door> {
    #[schema(value_type = String, pattern = "^replay$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: D::About<'a>,
    original: D::Original,
    retryable: bool,
    action: &'static str,
}

fn replay<D: Door>(message: &Delivered, original: AppliedRecord) -> Replay<'_, D> {
    Replay {
        outcome: "replay",
        about: D::about(message),
        original: D::original(original),
        retryable: false,
        action: "nothing to do: this message was already applied and changed nothing now",
    }
}

/// A gap or a stale sequence: where the message stands against the aggregate.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutOfOrder<'a, D: Door> {
    #[schema(value_type = String, pattern = "^(gap|stale)$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: D::Placed<'a>,
    /// The sequence the aggregate needs next.
    expected: i64,
    retryable: bool,
    action: String,
    /// (stale only) The operator's gap resolution that skipped this sequence before it arrived.
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped_by: Option<i64>,
}

fn gap<D: Door>(message: &Delivered, expected: i64) -> OutOfOrder<'_, D> {
    OutOfOrder {
        outcome: "gap",
        about: D::placed(message),
        expected,
        retryable: true,
        action: format!("deliver sequence {expected} first, then retry this message unchanged"),
        skipped_by: None,
    }
}

fn stale<D: Door>(
    message: &Delivered,
    expected: i64,
    skipped_by: Option<i64>,
) -> OutOfOrder<'_, D> {
    let sequence = message.sequence;
    let resolutions = D::WORDS.resolutions;
    let action = match skipped_by {
        Some(resolution) => format!(
            "sequence {sequence} was skipped by an operator's gap resolution {resolution} ({resolutions}) and is never applied; do not retry"
        ),
        None => format!("sequence {sequence} was already taken by another message; do not retry"),
    };
    OutOfOrder {
        outcome: "stale",
        about: D::placed(message),
        expected,
        retryable: false,
        action,
        skipped_by,
    }
}

#[derive(Serialize, ToSchema)]
pub struct PayloadConflict<'a, D: Door> {
    #[schema(value_type = String, pattern = "^payload conflict$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: D::About<'a>,
    retryable: bool,
    action: String,
}

fn payload_conflict<D: Door>(message: &Delivered) -> PayloadConflict<'_, D> {
    PayloadConflict {
        outcome: "payload conflict",
        about: D::about(message),
        retryable: false,
        action: format!(
            "this message id already carries {} and never changes meaning; send new content under a new message id",
            D::WORDS.conflicting_content
        ),
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
pub struct Quarantined<'a, D: Door> {
    #[schema(value_type = String, pattern = "^quarantined$")]
    outcome: &'static str,
    #[serde(flatten)]
    about: D::Placed<'a>,
    expected: i64,
    /// Why it is poison: the type is unknown, or the first error of its schema.
    reason: QuarantineReason,
    retryable: bool,
    dead_letter: DeadLetterState,
    resolution: NextStep,
}

fn quarantined<D: Door>(
    message: &Delivered,
    expected: i64,
    reason: QuarantineReason,
    note: Option<DeadLetterNote>,
) -> Quarantined<'_, D> {
    let status = note.map_or(DeadLetterStatus::Open, |note| note.status);
    let resolution = if status == DeadLetterStatus::Open {
        NextStep {
            requires_operator: true,
            how: format!(
                "an operator resolves it with {} (replace or skip), or a corrected message under a new id takes sequence {expected}",
                D::WORDS.resolve_dead_letter
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
        about: D::placed(message),
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
pub fn quarantine_full(message: &Delivered, expected: i64, open: usize, limit: usize) -> Response {
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

/// The answer to a delivery the inbox refused before deciding it: nothing was written.
pub fn refused<D: Door>(message: &Delivered, refusal: ProducerRefusal) -> Response {
    let aggregate = &message.aggregate_id;
    match refusal_problem(aggregate, refusal, &D::WORDS) {
        Ok((status, title, detail, outcome, (key, value))) => {
            let mut body = json!({
                "outcome": outcome,
                "aggregateId": message.aggregate_id,
                "messageId": message.message_id,
                "retryable": false,
            });
            if let Some(object) = body.as_object_mut() {
                object.insert(key.to_owned(), value);
            }
            problem_response_with(status, title, Some(&detail), body)
        }
        Err(detail) => producer_unauthorized(detail),
    }
}

/// A refusal's problem: status, title, detail, `outcome` and the member that says where the
/// producer stands; or, for a refusal about the credential, the detail of its 401.
type RefusalProblem = (
    StatusCode,
    &'static str,
    String,
    &'static str,
    (&'static str, Value),
);

fn refusal_problem(
    aggregate: &str,
    refusal: ProducerRefusal,
    words: &Words,
) -> Result<RefusalProblem, String> {
    let start_session = words.start_session;
    Ok(match refusal {
        ProducerRefusal::Fenced {
            offered,
            current_epoch,
        } => (
            StatusCode::CONFLICT,
            "Fenced",
            format!(
                "epoch {offered} is older than the producer's current epoch {current_epoch}: a newer instance of this producer has taken over; this instance must stop (nothing was applied)"
            ),
            "fenced",
            ("currentEpoch", json!(current_epoch)),
        ),
        ProducerRefusal::EpochNotIssued {
            offered,
            current_epoch,
        } => (
            StatusCode::BAD_REQUEST,
            "Epoch never issued",
            format!(
                "epoch {offered} was never issued to this producer (its current epoch is {current_epoch}); use the epoch {start_session} answered"
            ),
            "epoch not issued",
            ("currentEpoch", json!(current_epoch)),
        ),
        ProducerRefusal::NoSession => (
            StatusCode::CONFLICT,
            "No producer session",
            format!("the producer has never started a session: {start_session} first"),
            "no session",
            ("currentEpoch", json!(0)),
        ),
        ProducerRefusal::NotOwner { owner } => (
            StatusCode::FORBIDDEN,
            "Not the owner",
            format!(
                "aggregate '{aggregate}' is owned by producer '{owner}'; only its owner may write its sequence (an operator may transfer it)"
            ),
            "not the owner",
            ("owner", json!(owner)),
        ),
        ProducerRefusal::ClaimRequiresOperator => (
            StatusCode::FORBIDDEN,
            "The aggregate has history and no owner",
            format!(
                "aggregate '{aggregate}' was written before any producer claimed it; only an operator may give it an owner ({})",
                words.transfer_owner
            ),
            "claim requires operator",
            ("owner", Value::Null),
        ),
        ProducerRefusal::Revoked => {
            return Err("the producer was revoked before the delivery".to_owned());
        }
        ProducerRefusal::OwnerRequired => {
            return Err(format!(
                "aggregate '{aggregate}' is owned by a producer: deliver with its token (Authorization: Bearer TOKEN) and Producer-Epoch"
            ));
        }
    })
}

/// 401 for a producer: what its credential lacks; nothing was changed.
pub fn producer_unauthorized(detail: impl Into<String>) -> Response {
    crate::credential::unauthorized("Producer authentication required", detail.into())
}

/// The 200 answers of a delivery, for the OpenAPI document: one of two components.
pub struct DeliveryAccepted<D>(PhantomData<D>);

/// The JSON 409 answers of a delivery, for the OpenAPI document: one of two components.
pub struct DeliveryRefused<D>(PhantomData<D>);

/// `oneOf` the two components `A` and `B`, described; named as `A` and `B` themselves are,
/// without the door's name a derived generic would append.
fn one_of<A: ToSchema, B: ToSchema>(description: &str) -> RefOr<Schema> {
    OneOfBuilder::new()
        .item(Ref::from_schema_name(A::name()))
        .item(Ref::from_schema_name(B::name()))
        .description(Some(description))
        .into()
}

fn components_of<A: ToSchema, B: ToSchema>(schemas: &mut Vec<(String, RefOr<Schema>)>) {
    schemas.push((A::name().into_owned(), A::schema()));
    A::schemas(schemas);
    schemas.push((B::name().into_owned(), B::schema()));
    B::schemas(schemas);
}

impl<D: Door> PartialSchema for DeliveryAccepted<D> {
    fn schema() -> RefOr<Schema> {
        one_of::<Applied<'static, D>, Replay<'static, D>>(
            "The 200 answers of a delivery, for the OpenAPI document.",
        )
    }
}

impl<D: Door> ToSchema for DeliveryAccepted<D> {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("DeliveryAccepted")
    }

    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        components_of::<Applied<'static, D>, Replay<'static, D>>(schemas);
    }
}

impl<D: Door> PartialSchema for DeliveryRefused<D> {
    fn schema() -> RefOr<Schema> {
        one_of::<OutOfOrder<'static, D>, PayloadConflict<'static, D>>(
            "The JSON 409 answers of a delivery, for the OpenAPI document.",
        )
    }
}

impl<D: Door> ToSchema for DeliveryRefused<D> {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("DeliveryRefused")
    }

    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        components_of::<OutOfOrder<'static, D>, PayloadConflict<'static, D>>(schemas);
    }
}
