//! Operator-approved poison resolution over HTTP: `POST /deadletters/{messageId}/resolution`
//! (Bearer token of an operator registered with `production-lab operator add`), the same with the
//! id in the query (`POST /deadletters/resolution?messageId=`) for ids a path cannot carry, and
//! the audit trail `GET /resolutions`.

use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use ordered_inbox::resolution::{Action, ResolutionError, ResolutionRequest, Resolved};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::{IntoParams, IntoResponses, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::operator::{authenticate, unauthorized};
use crate::http::error::{AppError, Json, Path, Query, RequestBody, json_response};
use crate::inbox::SharedInbox;
use crate::inbox::answers::{
    DeadLetterConflictWords, conflict_response, dead_letter_conflict_words, merged_trail,
    no_such_dead_letter,
};
use crate::inbox::input::{validate_message_id, validate_sequence};
use crate::inbox::ledger::views::{CurrentState, ResolutionRecord};
use crate::inbox::ledger::{self};
use crate::inbox::pages::page_body;
use crate::inbox::queries::AuditQuery;
use crate::inbox::requests::{
    ReplacementShape, dead_letter_action, mode, parse_replacement, reason,
};

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::with_openapi(ResolutionSchemas::openapi())
        .routes(routes!(resolve_dead_letter))
        .routes(routes!(resolve_dead_letter_named_in_query))
        .routes(routes!(audit_trail))
}

/// An operator's decision on a dead letter. Names bind case-insensitively.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ResolutionInput {
    action: String,
    expected_last: i64,
    reason: String,
    #[serde(default)]
    replacement: Value,
}

/// [`ResolutionInput`] as the OpenAPI document describes it: a replacement or a skip.
#[derive(ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum ResolutionDecision {
    Replace(ReplaceDecision),
    Skip(SkipDecision),
}

/// Apply `replacement` in the dead letter's place.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct ReplaceDecision {
    #[schema(pattern = "^replace$", example = "replace")]
    action: String,
    /// The aggregate's last sequence the operator decided on; a different one answers 409.
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    expected_last: i64,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
    replacement: ReplacementInput,
}

/// Take the dead letter's sequence with no effect.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct SkipDecision {
    #[schema(pattern = "^skip$", example = "skip")]
    action: String,
    /// The aggregate's last sequence the operator decided on; a different one answers 409.
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    expected_last: i64,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
}

impl RequestBody for ResolutionInput {
    const FIELDS: &'static [&'static str] = &["action", "expectedLast", "reason", "replacement"];
}

/// The message applied in the dead letter's place: a new id.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct ReplacementInput {
    #[schema(min_length = 1, max_length = 100)]
    message_id: String,
    amount: i32,
}

impl RequestBody for ReplacementInput {
    const FIELDS: &'static [&'static str] = &["messageId", "amount"];
}

/// What the lesson's replacement carries, for the 400s of a missing or a malformed one.
const REPLACEMENT_SHAPE: ReplacementShape = ReplacementShape {
    described: "{\"messageId\": a new id, \"amount\": a 32-bit integer}",
    members: "{\"messageId\", \"amount\"}",
};

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
            |replacement| {
                let replacement: ReplacementInput = parse_replacement(&replacement)?;
                validate_message_id("replacement.messageId", &replacement.message_id)?;
                Ok(Action::Replace {
                    message_id: replacement.message_id,
                    payload: ledger::payload(i64::from(replacement.amount)),
                })
            },
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

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct ResolutionOptions {
    /// Report what the resolution would do, and write nothing.
    dry_run: Option<bool>,
    /// The producer whose message id the dead letter is (a message id belongs to its producer);
    /// absent for a dead letter of an anonymous delivery.
    #[param(min_length = 1, max_length = 64)]
    producer: Option<String>,
}

/// A refused resolution: what failed, and the aggregate and the dead letter as they are now.
#[derive(ToSchema)]
#[allow(dead_code)]
struct ResolutionConflict {
    #[serde(flatten)]
    problem: crate::http::openapi::Problem,
    current: CurrentState,
}

/// What a resolution answers, whichever route names the dead letter. The derive refers to
/// [`ResolutionAnswer`] and [`ResolutionConflict`] without registering them: [`ResolutionSchemas`]
/// does.
#[derive(IntoResponses)]
// Never built: it only describes the answers to the document.
#[allow(dead_code, clippy::large_enum_variant)]
enum ResolutionResponses {
    #[response(
        status = 200,
        description = "Resolved (or, with dryRun, what resolving would do), with the audit record"
    )]
    Resolved(ResolutionAnswer),
    #[response(status = 400)]
    BadRequest(#[ref_response] crate::http::openapi::BadRequest),
    #[response(
        status = 401,
        description = "No operator's token: none was sent, it is not active, or no operator is registered yet",
        content_type = "application/problem+json",
        headers(("www-authenticate" = String, description = "Bearer realm=\"production-lab\""))
    )]
    Unauthorized(crate::http::openapi::Problem),
    #[response(
        status = 404,
        description = "No dead letter has this message id",
        content_type = "application/problem+json"
    )]
    NotFound(crate::http::openapi::Problem),
    #[response(
        status = 409,
        description = "A precondition failed; `current` shows the aggregate and the dead letter now",
        content_type = "application/problem+json"
    )]
    Conflict(ResolutionConflict),
    #[response(
        status = 422,
        description = "The replacement would be quarantined too; nothing changed",
        content_type = "application/problem+json"
    )]
    ReplacementQuarantined(crate::http::openapi::Problem),
    #[response(status = 500)]
    StoreFailed(#[ref_response] crate::http::openapi::StoreFailed),
    #[response(status = 503)]
    StoreUnavailable(#[ref_response] crate::http::openapi::StoreUnavailable),
}

/// The schemas [`ResolutionResponses`] refers to, for the document's components.
#[derive(OpenApi)]
#[openapi(components(schemas(ResolutionAnswer, ResolutionConflict)))]
struct ResolutionSchemas;

/// `POST /deadletters/{messageId}/resolution[?dryRun=true]`.
#[utoipa::path(post, path = "/deadletters/{message_id}/resolution", tag = "ordered",
    params(
        ("message_id" = String, Path, min_length = 1, max_length = 100, description = "The dead letter's message id"),
        ResolutionOptions,
    ),
    request_body = ResolutionDecision,
    security(("operator" = [])),
    responses(ResolutionResponses),
)]
async fn resolve_dead_letter(
    State(inbox): State<SharedInbox>,
    Path(dead_letter_id): Path<String>,
    Query(options): Query<ResolutionOptions>,
    headers: HeaderMap,
    body: Result<Json<ResolutionInput>, AppError>,
) -> Result<Response, AppError> {
    resolve(inbox, dead_letter_id, options, headers, body).await
}

/// [`ResolutionOptions`] with the dead letter's message id.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct NamedResolutionOptions {
    /// The dead letter's message id.
    #[param(min_length = 1, max_length = 100)]
    message_id: String,
    /// Report what the resolution would do, and write nothing.
    dry_run: Option<bool>,
    /// The producer whose message id the dead letter is; absent for an anonymous delivery's.
    #[param(min_length = 1, max_length = 64)]
    producer: Option<String>,
}

/// `POST /deadletters/resolution?messageId=[&dryRun=true]`: the same resolution for any id,
/// including `.` and `..`, which every URL parser (a browser's too, even as `%2E`) drops from a
/// path.
#[utoipa::path(post, path = "/deadletters/resolution", tag = "ordered",
    params(NamedResolutionOptions),
    request_body = ResolutionDecision,
    security(("operator" = [])),
    responses(ResolutionResponses),
)]
async fn resolve_dead_letter_named_in_query(
    State(inbox): State<SharedInbox>,
    Query(named): Query<NamedResolutionOptions>,
    headers: HeaderMap,
    body: Result<Json<ResolutionInput>, AppError>,
) -> Result<Response, AppError> {
    let options = ResolutionOptions {
        dry_run: named.dry_run,
        producer: named.producer,
    };
    resolve(inbox, named.message_id, options, headers, body).await
}

async fn resolve(
    inbox: SharedInbox,
    dead_letter_id: String,
    options: ResolutionOptions,
    headers: HeaderMap,
    body: Result<Json<ResolutionInput>, AppError>,
) -> Result<Response, AppError> {
    validate_message_id("messageId", &dead_letter_id)?;
    // Authority comes before the body is even looked at: an unauthenticated caller learns nothing.
    let operator = match authenticate(&inbox, &headers).await {
        Ok(operator) => operator,
        Err(response) => return Ok(response),
    };
    let producer = crate::inbox::input::producer_namespace(options.producer)?;
    let Json(input) = body?;
    let request = input.into_request(producer.clone(), dead_letter_id, operator)?;
    Ok(match inbox.resolve(request, mode(options.dry_run)).await {
        Ok(Resolved::New(record) | Resolved::Repeated(record)) => {
            resolution_answer("resolved", false, record.into())
        }
        Ok(Resolved::DryRun(record)) => resolution_answer("dry run", true, record.into()),
        Err(error) => refusal(producer.as_deref(), error),
    })
}

/// A resolution's body: the outcome, then the audit record's members.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct ResolutionAnswer {
    outcome: &'static str,
    dry_run: bool,
    #[serde(flatten)]
    record: ResolutionRecord,
}

fn resolution_answer(outcome: &'static str, dry_run: bool, record: ResolutionRecord) -> Response {
    let body = ResolutionAnswer {
        outcome,
        dry_run,
        record,
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

fn refusal(producer: Option<&str>, error: ResolutionError) -> Response {
    match error {
        ResolutionError::NotFound(message_id) => {
            no_such_dead_letter(producer, &message_id).into_response()
        }
        ResolutionError::Conflict { kind, current } => {
            let (title, detail) = dead_letter_conflict_words(&kind, &CONFLICT_WORDS);
            conflict_response(title, &detail, CurrentState::from(*current))
        }
        ResolutionError::ReplacementQuarantined(reason) => AppError::problem_with_detail(
            StatusCode::UNPROCESSABLE_ENTITY,
            "The replacement would be quarantined",
            format!(
                "the ordering policy rejects the replacement too ({reason}); nothing was changed"
            ),
        )
        .into_response(),
        ResolutionError::Unauthorized => {
            unauthorized("the operator's token was revoked before the change".to_owned())
        }
        ResolutionError::Store(error) => AppError::from(error).into_response(),
    }
}

/// How the lab words the dead letter conflicts where its words differ from the gate's.
const CONFLICT_WORDS: DeadLetterConflictWords = DeadLetterConflictWords {
    sequence_unknown: "it was recorded by an earlier version that kept no sequence or payload; send a corrected message under a new id instead",
    new_id_hint: "",
};

/// One page of the audit trail.
#[derive(ToSchema)]
#[allow(dead_code)]
struct AuditPage {
    resolutions: Vec<AuditEntry>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// One row of the audit trail: a dead letter's resolution (`messageId`, `sequence`) or a gap's
/// (`from`, `through`, `drained`).
#[derive(ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum AuditEntry {
    DeadLetter(ResolutionRecord),
    Gap(super::gaps::GapResolutionRecord),
}

/// `GET /resolutions?aggregateId=&after=&limit=`: who resolved what, when, why, and the
/// aggregate's last before and after, oldest first.
#[utoipa::path(get, path = "/resolutions", tag = "ordered", params(AuditQuery), responses(
    (status = 200, description = "The audit trail, oldest first", body = AuditPage),
    (status = 400, response = crate::http::openapi::BadRequest),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn audit_trail(
    State(inbox): State<SharedInbox>,
    Query(query): Query<AuditQuery>,
) -> Result<Response, AppError> {
    let (aggregate_id, page) = query.into_parts()?;
    let dead_letters = inbox
        .reads()
        .resolutions(aggregate_id.clone(), page)
        .await?
        .map(|record| (record.resolution_id, json!(ResolutionRecord::from(record))));
    let gaps = inbox
        .reads()
        .gap_resolutions(aggregate_id, page)
        .await?
        .map(|record| {
            let id = record.resolution_id;
            (id, json!(super::gaps::GapResolutionRecord::from(record)))
        });
    Ok(json_response(
        StatusCode::OK,
        page_body(
            json!({}),
            "resolutions",
            merged_trail(dead_letters, gaps, page.limit),
        ),
    ))
}
