//! Gaps that never fill, over HTTP: `GET /aggregates/{id}/gaps` (what a waiting aggregate is
//! missing, for a producer that can resend it) and an operator's audited decision to go on
//! without it, `POST /aggregates/{id}/gaps/resolution[?dryRun=true]`, with the same authority,
//! race guard, dry run and identical-repeat rule as a dead letter's resolution. The library
//! decides ([`ordered_inbox::gaps`]); this module words the answers.

use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use ordered_inbox::gaps::{GapResolutionError, GapResolved};
use ordered_inbox::records::{DrainedMessage, GapRecord};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, IntoResponses, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::operator::authenticate;
use crate::http::error::{AppError, Json, Path, Query};
use crate::inbox::SharedInbox;
use crate::inbox::answers::{conflict_response, gap_conflict_words, unknown_aggregate};
use crate::inbox::input::validate_aggregate_id;
use crate::inbox::ledger::total_in;
use crate::inbox::ledger::views::{AggregateView, Position};
use crate::inbox::queries::{Gaps, gaps_of};
use crate::inbox::requests::{GapResolutionInput, mode};

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::with_openapi(GapSchemas::openapi())
        .routes(routes!(gaps))
        .routes(routes!(resolve_gap))
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
    gaps_of(&inbox, aggregate_id).await
}

/// How a gap's 409 names the lab's dead-letter resolution.
const DEAD_LETTER_ROUTE: &str = "/deadletters/{messageId}/resolution";

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
        let position = |position: &ordered_inbox::model::Position| Position {
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
    let aggregate_id = request.aggregate_id.clone();
    Ok(
        match inbox.resolve_gap(request, mode(options.dry_run)).await {
            Ok(GapResolved::New(record) | GapResolved::Repeated(record)) => {
                answer("resolved", false, record)
            }
            Ok(GapResolved::DryRun(record)) => answer("dry run", true, record),
            Err(error) => refusal(&inbox, &aggregate_id, error).await?,
        },
    )
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
                .reads()
                .aggregate(aggregate_id.to_owned())
                .await?
                .map(AggregateView::from);
            let (title, detail) = gap_conflict_words(&conflict, DEAD_LETTER_ROUTE);
            conflict_response(title, &detail, current)
        }
        GapResolutionError::Unauthorized => super::operator::unauthorized(
            "the operator's token was revoked before the change".to_owned(),
        ),
        GapResolutionError::Store(error) => AppError::from(error).into_response(),
    })
}
