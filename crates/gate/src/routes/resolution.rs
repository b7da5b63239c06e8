//! An operator's audited decisions: `POST /v1/deadletters/resolution?messageId=[&producer=]`
//! (skip the dead letter's sequence, or replace it with a corrected message of a type and
//! payload) and `POST /v1/aggregates/{id}/gaps/resolution` (go on without sequences that never
//! arrived), each with `dryRun`, the race guard `expectedLast`, and the rule that only an
//! identical repeat by the same operator answers 200 again. The library decides; this module
//! words the answers.

use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ordered_inbox::gaps::{GapResolutionError, GapResolved};
use ordered_inbox::records::{GapRecord, ResolutionRecord};
use ordered_inbox::resolution::{Action, ResolutionError, ResolutionRequest, Resolved};
use ordered_inbox::views::CurrentState;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::PayloadLimit;
use super::messages::{validate_type, within_limit};
use crate::auth::{Operator, operator_revoked};
use http_edge::error::{AppError, Json, Path, Query, RequestBody};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::answers::{
    DeadLetterConflictWords, conflict_response, dead_letter_conflict_words, gap_conflict_words,
    no_such_dead_letter, unknown_aggregate,
};
use http_edge::inbox::input::{
    producer_namespace, validate_aggregate_id, validate_message_id, validate_sequence,
};
use http_edge::inbox::requests::{
    GapResolutionInput, ReplacementShape, dead_letter_action, mode, parse_replacement, reason,
};

pub(super) fn routes<S>(body_limit: usize) -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    PayloadLimit: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(resolve_dead_letter))
        .routes(routes!(resolve_gap))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            PayloadLimit(body_limit),
            crate::edge::refuse_declared_oversize,
        ))
}

/// An operator's decision on a dead letter. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct ResolutionInput {
    #[schema(pattern = "^(skip|replace)$")]
    action: String,
    /// The aggregate's last sequence the operator decided on; a different one answers 409.
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    expected_last: i64,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
    /// (replace only) The corrected message applied at the dead letter's sequence.
    #[serde(default)]
    #[schema(value_type = Option<ReplacementInput>)]
    replacement: Value,
}

impl RequestBody for ResolutionInput {
    const FIELDS: &'static [&'static str] = &["action", "expectedLast", "reason", "replacement"];
}

/// The message applied in a dead letter's place.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct ReplacementInput {
    /// A new message id (default: the dead letter's id followed by `:replaced`).
    #[schema(min_length = 1, max_length = 100)]
    message_id: Option<String>,
    #[serde(rename = "type")]
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    message_type: String,
    #[schema(value_type = Object)]
    payload: Value,
}

impl RequestBody for ReplacementInput {
    const FIELDS: &'static [&'static str] = &["messageId", "type", "payload"];
}

impl ResolutionInput {
    fn into_request(
        self,
        producer: Option<String>,
        dead_letter_id: String,
        operator: String,
    ) -> Result<ResolutionRequest, AppError> {
        validate_sequence("expectedLast", self.expected_last, 0)?;
        let reason = reason(&self.reason)?;
        let action = dead_letter_action(
            &self.action,
            self.replacement,
            &REPLACEMENT_SHAPE,
            |replacement| replacement_of(&replacement, &dead_letter_id),
        )?;
        Ok(ResolutionRequest {
            producer,
            dead_letter_id,
            operator,
            action,
            expected_last: self.expected_last,
            reason,
        })
    }
}

/// What the gate's replacement carries, for the 400s of a missing or a malformed one.
const REPLACEMENT_SHAPE: ReplacementShape = ReplacementShape {
    described: "{\"type\": a message type, \"payload\": its JSON}",
    members: "{\"type\", \"payload\"}",
};

/// A replacement's action: its id (given, or derived from the dead letter's so that an
/// identical repeat names the same one) and its envelope.
fn replacement_of(replacement: &Value, dead_letter_id: &str) -> Result<Action, AppError> {
    let replacement: ReplacementInput = parse_replacement(replacement)?;
    let message_id = replacement
        .message_id
        .unwrap_or_else(|| format!("{dead_letter_id}:replaced"));
    validate_message_id("replacement.messageId", &message_id)?;
    validate_type("replacement.type", &replacement.message_type)?;
    Ok(Action::Replace {
        message_id,
        payload: crate::handler::envelope(&replacement.message_type, replacement.payload),
    })
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct ResolutionOptions {
    /// The dead letter's message id.
    #[param(min_length = 1, max_length = 100)]
    message_id: String,
    /// Report what the resolution would do, and write nothing.
    dry_run: Option<bool>,
    /// The producer whose message id the dead letter is; absent for an anonymous delivery's.
    #[param(min_length = 1, max_length = 64)]
    producer: Option<String>,
}

/// A resolution's body: the outcome, then the audit record's members.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct ResolutionAnswer {
    #[schema(pattern = "^(resolved|dry run)$")]
    outcome: &'static str,
    dry_run: bool,
    #[serde(flatten)]
    record: ResolutionRecord,
}

/// A refused resolution: what failed, and the aggregate and the dead letter as they are now.
#[derive(ToSchema)]
#[allow(dead_code)]
struct ResolutionConflict {
    #[serde(flatten)]
    problem: http_edge::openapi::Problem,
    current: CurrentState,
}

/// `POST /v1/deadletters/resolution?messageId=[&producer=][&dryRun=true]`.
#[utoipa::path(post, path = "/v1/deadletters/resolution", tag = "operators",
    params(ResolutionOptions),
    request_body = ResolutionInput,
    security(("operator" = [])),
    responses(
        (status = 200, description = "Resolved (or, with dryRun, what resolving would do), with the audit record", body = ResolutionAnswer),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 404, description = "No dead letter has this identity", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 409, description = "A precondition failed; `current` shows the aggregate and the dead letter now", body = ResolutionConflict, content_type = "application/problem+json"),
        (status = 413, response = http_edge::openapi::ContentTooLarge),
        (status = 422, description = "The replacement would be quarantined too; nothing changed", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn resolve_dead_letter(
    Operator(operator): Operator,
    State(inbox): State<SharedInbox>,
    State(limit): State<PayloadLimit>,
    Query(options): Query<ResolutionOptions>,
    body: Result<Json<ResolutionInput>, AppError>,
) -> Result<Response, AppError> {
    validate_message_id("messageId", &options.message_id)?;
    let producer = producer_namespace(options.producer)?;
    let Json(input) = within_limit(body, limit)?;
    let request = input.into_request(producer.clone(), options.message_id, operator)?;
    Ok(match inbox.resolve(request, mode(options.dry_run)).await {
        Ok(Resolved::New(record) | Resolved::Repeated(record)) => {
            resolution_answer("resolved", false, record)
        }
        Ok(Resolved::DryRun(record)) => resolution_answer("dry run", true, record),
        Err(error) => resolution_refused(producer.as_deref(), error),
    })
}

fn resolution_answer(outcome: &'static str, dry_run: bool, record: ResolutionRecord) -> Response {
    let body = ResolutionAnswer {
        outcome,
        dry_run,
        record,
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

fn resolution_refused(producer: Option<&str>, error: ResolutionError) -> Response {
    match error {
        ResolutionError::NotFound(message_id) => {
            no_such_dead_letter(producer, &message_id).into_response()
        }
        ResolutionError::Conflict { kind, current } => {
            let (title, detail) = dead_letter_conflict_words(&kind, &CONFLICT_WORDS);
            conflict_response(title, &detail, current)
        }
        ResolutionError::ReplacementQuarantined(reason) => AppError::problem_with_detail(
            StatusCode::UNPROCESSABLE_ENTITY,
            "The replacement would be quarantined",
            format!("the replacement is poison too ({reason}); nothing was changed"),
        )
        .into_response(),
        ResolutionError::Unauthorized => operator_revoked(),
        ResolutionError::Store(error) => AppError::from(error).into_response(),
    }
}

/// How the gate words the dead letter conflicts where its words differ from the lab's.
const CONFLICT_WORDS: DeadLetterConflictWords = DeadLetterConflictWords {
    sequence_unknown: "it was recorded without a sequence or payload; send a corrected message under a new id instead",
    new_id_hint: " (replacement.messageId)",
};

/// The most sequences one gap skip may name: each leaves a `gate.skipped` marker row in the
/// output, all written in the resolution's one transaction.
pub(crate) const MAX_SKIPPED_SEQUENCES: i64 = 10_000;

/// How a gap's 409 names the gate's dead-letter resolution.
const DEAD_LETTER_ROUTE: &str = "/v1/deadletters/resolution?messageId=";

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct GapResolutionOptions {
    /// Report what the resolution would do (what would drain), and write nothing.
    dry_run: Option<bool>,
}

/// A gap resolution's body: the outcome, then the audit record's members.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct GapResolutionAnswer {
    #[schema(pattern = "^(resolved|dry run)$")]
    outcome: &'static str,
    dry_run: bool,
    #[serde(flatten)]
    record: GapRecord,
}

/// A refused gap resolution: what failed, and the aggregate as it is now.
#[derive(ToSchema)]
#[allow(dead_code)]
struct GapResolutionConflict {
    #[serde(flatten)]
    problem: http_edge::openapi::Problem,
    current: Option<ordered_inbox::views::AggregateView>,
}

/// `POST /v1/aggregates/{id}/gaps/resolution[?dryRun=true]`.
#[utoipa::path(post, path = "/v1/aggregates/{aggregate_id}/gaps/resolution", tag = "operators",
    params(
        ("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"),
        GapResolutionOptions,
    ),
    request_body = GapResolutionInput,
    security(("operator" = [])),
    responses(
        (status = 200, description = "Resolved (or, with dryRun, what resolving would do), with the audit record and what drained", body = GapResolutionAnswer),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 404, description = "No message was ever recorded for the aggregate", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 409, description = "A precondition failed; `current` shows the aggregate now", body = GapResolutionConflict, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn resolve_gap(
    Operator(operator): Operator,
    State(inbox): State<SharedInbox>,
    State(limit): State<PayloadLimit>,
    Path(aggregate_id): Path<String>,
    Query(options): Query<GapResolutionOptions>,
    body: Result<Json<GapResolutionInput>, AppError>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let Json(input) = within_limit(body, limit)?;
    let request = input.into_request(aggregate_id.clone(), operator)?;
    let skipped = request.range.through.saturating_sub(request.range.from) + 1;
    if skipped > MAX_SKIPPED_SEQUENCES {
        return Err(AppError::bad_request(format!(
            "from through through names {skipped} sequences; one gap skip takes at most \
             {MAX_SKIPPED_SEQUENCES}, because each leaves a gate.skipped marker in the output: \
             skip a longer gap in parts"
        )));
    }
    Ok(
        match inbox.resolve_gap(request, mode(options.dry_run)).await {
            Ok(GapResolved::New(record) | GapResolved::Repeated(record)) => {
                gap_answer("resolved", false, record)
            }
            Ok(GapResolved::DryRun(record)) => gap_answer("dry run", true, record),
            Err(error) => gap_refused(&inbox, &aggregate_id, error).await?,
        },
    )
}

fn gap_answer(outcome: &'static str, dry_run: bool, record: GapRecord) -> Response {
    let body = GapResolutionAnswer {
        outcome,
        dry_run,
        record,
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

async fn gap_refused(
    inbox: &SharedInbox,
    aggregate_id: &str,
    error: GapResolutionError,
) -> Result<Response, AppError> {
    Ok(match error {
        GapResolutionError::NotFound(aggregate_id) => {
            unknown_aggregate(&aggregate_id).into_response()
        }
        GapResolutionError::Conflict(conflict) => {
            let current = inbox.reads().aggregate(aggregate_id.to_owned()).await?;
            let (title, detail) = gap_conflict_words(&conflict, DEAD_LETTER_ROUTE);
            conflict_response(title, &detail, current)
        }
        GapResolutionError::Unauthorized => operator_revoked(),
        GapResolutionError::Store(error) => AppError::from(error).into_response(),
    })
}
