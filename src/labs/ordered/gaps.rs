//! Gaps that never fill, over HTTP: `GET /aggregates/{id}/gaps` (what a waiting aggregate is
//! missing, for a producer that can resend it) and an operator's audited decision to go on
//! without it, `POST /aggregates/{id}/gaps/resolution[?dryRun=true]`, with the same authority,
//! race guard, dry run and identical-repeat rule as a dead letter's resolution. The library
//! decides ([`ordered_inbox::gaps`]); this module words the answers.

use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use ordered_inbox::views::MissingRange;
use ordered_inbox::{
    DrainedMessage, GapConflict, GapRecord, GapRequest, GapResolutionError, GapResolved, Mode,
    SequenceRange,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, IntoResponses, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::operator::{MAX_REASON, authenticate};
use crate::http::error::{AppError, Json, Path, Query, RequestBody, problem_response_with};
use crate::inbox::SharedInbox;
use crate::inbox::input::{validate_aggregate_id, validate_sequence};
use crate::inbox::ledger::total_in;
use crate::inbox::ledger::views::{AggregateView, Position};

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::with_openapi(GapSchemas::openapi())
        .routes(routes!(gaps))
        .routes(routes!(resolve_gap))
}

/// What a waiting aggregate is missing.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Gaps {
    aggregate_id: String,
    /// From the expected sequence through one below the lowest seen ahead of it since the last
    /// apply; null unless the aggregate waits (`through` null when nothing ahead is known).
    missing: Option<MissingRange>,
    waiting_since: Option<String>,
    /// The sequences held ahead of the gap, lowest first.
    held_sequences: Vec<i64>,
}

/// `GET /aggregates/{aggregateId}/gaps`: the missing range, for a producer that can resend it.
#[utoipa::path(get, path = "/aggregates/{aggregate_id}/gaps", tag = "ordered",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate")),
    responses(
        (status = 200, description = "What the aggregate is missing (null unless it waits)", body = Gaps),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 404, description = "No message was ever recorded for it", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn gaps(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let Some(view) = inbox.aggregate(aggregate_id.clone()).await? else {
        return Err(unknown_aggregate(&aggregate_id));
    };
    let body = Gaps {
        aggregate_id,
        missing: view.missing,
        waiting_since: view.waiting_since,
        held_sequences: view.held_sequences,
    };
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

fn unknown_aggregate(aggregate_id: &str) -> AppError {
    AppError::problem_with_detail(
        StatusCode::NOT_FOUND,
        "Unknown aggregate",
        format!(
            "no message has been recorded for aggregate '{aggregate_id}'; it expects sequence 1"
        ),
    )
}

/// An operator's decision on a gap: skip `from` through `through`. Names bind
/// case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct GapResolutionInput {
    #[schema(pattern = "^skip$", example = "skip")]
    action: String,
    /// The aggregate's expected sequence: the first one that never arrived.
    #[schema(minimum = 1, maximum = 9007199254740992_i64)]
    from: i64,
    /// The last sequence to go on without (at least `from`).
    #[schema(minimum = 1, maximum = 9007199254740992_i64)]
    through: i64,
    /// The aggregate's last sequence the operator decided on; a different one answers 409.
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    expected_last: i64,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
}

impl RequestBody for GapResolutionInput {
    const FIELDS: &'static [&'static str] =
        &["action", "from", "through", "expectedLast", "reason"];
}

impl GapResolutionInput {
    fn into_request(self, aggregate_id: String, operator: String) -> Result<GapRequest, AppError> {
        if self.action != "skip" {
            return Err(AppError::bad_request(
                "action must be skip: a gap resolution goes on without the missing sequences",
            ));
        }
        validate_sequence("from", self.from, 1)?;
        validate_sequence("through", self.through, 1)?;
        if self.through < self.from {
            return Err(AppError::bad_request(format!(
                "through ({}) must be at least from ({})",
                self.through, self.from
            )));
        }
        validate_sequence("expectedLast", self.expected_last, 0)?;
        let reason = self.reason.trim();
        if reason.is_empty() || reason.chars().count() > MAX_REASON {
            return Err(AppError::bad_request(format!(
                "reason must say why, in 1 to {MAX_REASON} characters"
            )));
        }
        Ok(GapRequest {
            aggregate_id,
            operator,
            range: SequenceRange {
                from: self.from,
                through: self.through,
            },
            expected_last: self.expected_last,
            reason: reason.to_owned(),
        })
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct GapResolutionOptions {
    /// Report what the resolution would do (what would drain), and write nothing.
    dry_run: Option<bool>,
}

/// A gap resolution's audit record as the lesson shows it: positions with the ledger's totals.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct GapResolutionRecord {
    /// Null in a dry run, which assigns nothing.
    resolution_id: Option<i64>,
    aggregate_id: String,
    #[schema(pattern = "^skip$")]
    action: &'static str,
    /// The first and the last sequence skipped.
    from: i64,
    through: i64,
    operator: String,
    reason: String,
    expected_last: i64,
    before: Position,
    /// After the skip's own step (no effect); what drained after it is `drained`.
    after: Position,
    /// The held successors that drained after the skip, in order.
    drained: Vec<DrainedMessage>,
    resolved_at: String,
}

impl From<GapRecord> for GapResolutionRecord {
    fn from(record: GapRecord) -> Self {
        let position = |position: &ordered_inbox::Position| Position {
            last: position.last,
            total: total_in(position.state.as_ref()),
        };
        GapResolutionRecord {
            resolution_id: record.resolution_id,
            action: "skip",
            from: record.range.from,
            through: record.range.through,
            before: position(&record.before),
            after: position(&record.after),
            aggregate_id: record.aggregate_id,
            operator: record.operator,
            reason: record.reason,
            expected_last: record.expected_last,
            drained: record.drained,
            resolved_at: record.resolved_at,
        }
    }
}

/// A gap resolution's body: the outcome, then the audit record's members.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct GapResolutionAnswer {
    #[schema(pattern = "^(resolved|dry run)$")]
    outcome: &'static str,
    dry_run: bool,
    #[serde(flatten)]
    record: GapResolutionRecord,
}

/// A refused gap resolution: what failed, and the aggregate as it is now.
#[derive(ToSchema)]
#[allow(dead_code)]
struct GapResolutionConflict {
    #[serde(flatten)]
    problem: crate::http::openapi::Problem,
    current: Option<AggregateView>,
}

#[derive(IntoResponses)]
// Never built: it only describes the answers to the document.
#[allow(dead_code)]
enum GapResolutionResponses {
    #[response(
        status = 200,
        description = "Resolved (or, with dryRun, what resolving would do), with the audit record and what drained"
    )]
    Resolved(GapResolutionAnswer),
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
        description = "No message was ever recorded for the aggregate",
        content_type = "application/problem+json"
    )]
    NotFound(crate::http::openapi::Problem),
    #[response(
        status = 409,
        description = "A precondition failed; `current` shows the aggregate now",
        content_type = "application/problem+json"
    )]
    Conflict(GapResolutionConflict),
    #[response(status = 500)]
    StoreFailed(#[ref_response] crate::http::openapi::StoreFailed),
    #[response(status = 503)]
    StoreUnavailable(#[ref_response] crate::http::openapi::StoreUnavailable),
}

/// The schemas [`GapResolutionResponses`] refers to, for the document's components.
#[derive(OpenApi)]
#[openapi(components(schemas(GapResolutionAnswer, GapResolutionConflict)))]
struct GapSchemas;

/// `POST /aggregates/{aggregateId}/gaps/resolution[?dryRun=true]`.
#[utoipa::path(post, path = "/aggregates/{aggregate_id}/gaps/resolution", tag = "ordered",
    params(
        ("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"),
        GapResolutionOptions,
    ),
    request_body = GapResolutionInput,
    security(("operator" = [])),
    responses(GapResolutionResponses),
)]
async fn resolve_gap(
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    Query(options): Query<GapResolutionOptions>,
    headers: HeaderMap,
    body: Result<Json<GapResolutionInput>, AppError>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    // Authority comes before the body is even looked at: an unauthenticated caller learns nothing.
    let operator = match authenticate(&inbox, &headers).await {
        Ok(operator) => operator,
        Err(response) => return Ok(response),
    };
    let Json(input) = body?;
    let request = input.into_request(aggregate_id, operator)?;
    let mode = if options.dry_run.unwrap_or(false) {
        Mode::DryRun
    } else {
        Mode::Commit
    };
    let aggregate_id = request.aggregate_id.clone();
    Ok(match inbox.resolve_gap(request, mode).await {
        Ok(GapResolved::New(record) | GapResolved::Repeated(record)) => {
            answer("resolved", false, record)
        }
        Ok(GapResolved::DryRun(record)) => answer("dry run", true, record),
        Err(error) => refusal(&inbox, &aggregate_id, error).await?,
    })
}

fn answer(outcome: &'static str, dry_run: bool, record: GapRecord) -> Response {
    let body = GapResolutionAnswer {
        outcome,
        dry_run,
        record: record.into(),
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

async fn refusal(
    inbox: &SharedInbox,
    aggregate_id: &str,
    error: GapResolutionError,
) -> Result<Response, AppError> {
    Ok(match error {
        GapResolutionError::NotFound(aggregate_id) => {
            unknown_aggregate(&aggregate_id).into_response()
        }
        GapResolutionError::Conflict(conflict) => {
            let current = inbox
                .aggregate(aggregate_id.to_owned())
                .await?
                .map(AggregateView::from);
            let (title, detail) = conflict_words(&conflict);
            problem_response_with(
                StatusCode::CONFLICT,
                title,
                Some(&detail),
                json!({"current": current}),
            )
        }
        GapResolutionError::Unauthorized => super::operator::unauthorized(
            "the operator's token was revoked before the change".to_owned(),
        ),
        GapResolutionError::Store(error) => AppError::from(error).into_response(),
    })
}

/// The title and detail of a 409: what failed, and what the operator can do.
fn conflict_words(conflict: &GapConflict) -> (&'static str, String) {
    match conflict {
        GapConflict::AlreadySkipped {
            resolution_id,
            range,
        } => (
            "The gap is already resolved",
            format!(
                "resolution {} skipped sequences {} through {}; only an identical repeat by the same operator answers 200",
                resolution_id.unwrap_or_default(),
                range.from,
                range.through
            ),
        ),
        GapConflict::AppliedInRange {
            sequence,
            message_id,
        } => (
            "A message took a sequence of the range",
            format!(
                "message '{message_id}' was applied at sequence {sequence}: it is not missing; review the current state and decide again"
            ),
        ),
        GapConflict::ExpectedLastMismatch {
            expected_last,
            last,
        } => (
            "The aggregate is not at the expected last sequence",
            format!(
                "expectedLast is {expected_last} but the aggregate's last sequence is {last}: review the current state and decide again"
            ),
        ),
        GapConflict::NotExpected { from, expected } => (
            "The range does not start at the expected sequence",
            format!("from is {from}, and the aggregate expects sequence {expected}"),
        ),
        GapConflict::DeadLetterOpen { message_id } => (
            "A dead letter holds the first sequence",
            format!(
                "dead letter '{message_id}' holds it: resolve it with POST /deadletters/{{messageId}}/resolution instead"
            ),
        ),
        GapConflict::HeldInRange {
            sequence,
            message_id,
        } => (
            "A held message lies inside the range",
            format!(
                "message '{message_id}' is held at sequence {sequence}: it is not missing; skip only the sequences below it"
            ),
        ),
    }
}
