//! The evidence, for a reader (a configured reader's token or an operator's): the aggregates (in
//! a status, or all of them), one aggregate with its open dead letters and held sequences, its
//! timeline, what a waiting aggregate is missing, the dead letters, and the audit trail of
//! resolutions. Payloads are the stored envelopes (`{"type", "payload"}`), as the producer sent
//! them.

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::AggregateStatus;
use ordered_inbox::records::{GapRecord, ResolutionRecord};
use ordered_inbox::views::{AggregateView, DeadLetterView, InventoryEntry, Page, TimelineEvent};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{Access, Reader};
use crate::handler::SharedTypes;
use crate::overdue::overdue_among;
use http_edge::error::{AppError, Path, Query, json_response};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::answers::{merged_trail, unknown_aggregate};
use http_edge::inbox::input::validate_aggregate_id;
use http_edge::inbox::pages::{page_body, validate_limit};
use http_edge::inbox::queries::{
    AuditQuery, DeadLetterQuery, Gaps, PageQuery, aggregate_status, gaps_of,
};

/// The deepest `after` an inventory page may start at: each page reads the ones before it.
const MAX_INVENTORY_OFFSET: i64 = 10_000;

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    Access: FromRef<S>,
    SharedTypes: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(inventory))
        .routes(routes!(aggregate))
        .routes(routes!(timeline))
        .routes(routes!(gaps))
        .routes(routes!(dead_letters))
        .routes(routes!(resolutions))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct InventoryQuery {
    /// Which aggregates to list; absent: all of them, blocked then waiting then flowing.
    #[param(value_type = Option<AggregateStatus>)]
    status: Option<String>,
    /// How many of the list to pass over: the `next` of the previous page (0 or absent first).
    #[param(minimum = 0, maximum = 10000)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// The aggregates in one status (or in every status), the longest-standing first.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Inventory {
    /// The status asked for; null when every aggregate is listed.
    #[schema(required = true)]
    status: Option<AggregateStatus>,
    aggregates: Vec<GateInventoryEntry>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// An aggregate of the inventory, and whether it is overdue.
#[derive(Serialize, ToSchema)]
struct GateInventoryEntry {
    #[serde(flatten)]
    entry: InventoryEntry,
    /// Whether it waits longer than its lowest held successor's type's `gap_alert_after_ms`
    /// allows (false when that type sets none, or when nothing is held).
    overdue: bool,
}

/// The order of the list without a status: what needs an operator first.
const EVERY_STATUS: [AggregateStatus; 3] = [
    AggregateStatus::Blocked,
    AggregateStatus::Waiting,
    AggregateStatus::Flowing,
];

/// `GET /v1/aggregates?status=blocked|waiting|flowing&after=&limit=`; without `status`, every
/// aggregate: the blocked, then the waiting, then the flowing.
#[utoipa::path(get, path = "/v1/aggregates", tag = "evidence", params(InventoryQuery),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "The aggregates in that status (without one: blocked, then waiting, then flowing), each status the longest-standing first", body = Inventory),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ))]
async fn inventory(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    State(types): State<SharedTypes>,
    Query(query): Query<InventoryQuery>,
) -> Result<Response, AppError> {
    let status = match query.status.as_deref() {
        None => None,
        given => Some(aggregate_status(given)?),
    };
    let after = query.after.unwrap_or(0);
    if !(0..=MAX_INVENTORY_OFFSET).contains(&after) {
        return Err(AppError::bad_request(format!(
            "after must be from 0 to {MAX_INVENTORY_OFFSET}"
        )));
    }
    let limit = validate_limit(query.limit)?;
    // One more than the page, to know whether another page exists.
    let wanted = after + limit + 1;
    let mut aggregates = match status {
        Some(status) => inbox.reads().inventory(status, wanted).await?,
        None => every_aggregate(&inbox, wanted).await?,
    };
    let skipped = usize::try_from(after).unwrap_or(usize::MAX);
    aggregates.drain(..skipped.min(aggregates.len()));
    let overdue = overdue_among(&inbox, &types.load(), &aggregates).await?;
    let entries = aggregates.into_iter().map(|entry| GateInventoryEntry {
        overdue: overdue.contains(&entry.summary.aggregate_id),
        entry,
    });
    let page = Page::from_rows(
        (after + 1..)
            .zip(entries)
            .collect::<Vec<(i64, GateInventoryEntry)>>(),
        limit,
    );
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"status": status}), "aggregates", page),
    ))
}

/// The first `wanted` aggregates of every status, in [`EVERY_STATUS`] order: a status is read
/// only when the ones before it fall short.
async fn every_aggregate(
    inbox: &SharedInbox,
    wanted: i64,
) -> Result<Vec<InventoryEntry>, AppError> {
    let mut aggregates = Vec::new();
    for status in EVERY_STATUS {
        let missing = wanted - i64::try_from(aggregates.len()).unwrap_or(i64::MAX);
        if missing <= 0 {
            break;
        }
        aggregates.extend(inbox.reads().inventory(status, missing).await?);
    }
    Ok(aggregates)
}

/// `GET /v1/aggregates/{id}`: the position, status, open dead letters, held sequences, what a
/// waiting aggregate is missing, and the owner.
#[utoipa::path(get, path = "/v1/aggregates/{aggregate_id}", tag = "evidence",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate")),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "The aggregate's position, status and open dead letters", body = AggregateView),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No message was ever recorded for it", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn aggregate(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let Some(view) = inbox.reads().aggregate(aggregate_id.clone()).await? else {
        return Err(unknown_aggregate(&aggregate_id));
    };
    let ownership = inbox.reads().ownership(aggregate_id).await?;
    let mut body = json!(view);
    if let Some(object) = body.as_object_mut() {
        object.insert("owner".to_owned(), json!(ownership.owner));
    }
    Ok(json_response(StatusCode::OK, body))
}

/// One page of an aggregate's timeline.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct TimelinePage {
    aggregate_id: String,
    events: Vec<TimelineEvent>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// `GET /v1/aggregates/{id}/timeline?after=&limit=`: every change and rejection, oldest first.
#[utoipa::path(get, path = "/v1/aggregates/{aggregate_id}/timeline", tag = "evidence",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"), PageQuery),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "Every change and rejection of the aggregate, oldest first", body = TimelinePage),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn timeline(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let page = query.page()?;
    let events = inbox.reads().timeline(aggregate_id.clone(), page).await?;
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"aggregateId": aggregate_id}), "events", events),
    ))
}

/// `GET /v1/aggregates/{id}/gaps`: the missing range, for a producer that can resend it.
#[utoipa::path(get, path = "/v1/aggregates/{aggregate_id}/gaps", tag = "evidence",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate")),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "What the aggregate is missing (null unless it waits)", body = Gaps),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No message was ever recorded for it", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn gaps(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    Path(aggregate_id): Path<String>,
) -> Result<Response, AppError> {
    gaps_of(&inbox, aggregate_id).await
}

/// One page of dead letters.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct DeadLetterPage {
    dead_letters: Vec<DeadLetterView>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// `GET /v1/deadletters?status=open|resolved|superseded&aggregateId=&after=&limit=`: in the
/// order they were first recorded.
#[utoipa::path(get, path = "/v1/deadletters", tag = "evidence", params(DeadLetterQuery),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "Dead letters in the order they were first recorded", body = DeadLetterPage),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ))]
async fn dead_letters(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Response, AppError> {
    let (filter, page) = query.into_parts()?;
    let listed = inbox.reads().dead_letters(filter, page).await?;
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({}), "deadLetters", listed),
    ))
}

/// One row of the audit trail: a dead letter's resolution (`messageId`, `sequence`) or a gap's
/// (`range`, `drained`).
#[derive(ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum AuditEntry {
    DeadLetter(ResolutionRecord),
    Gap(GapRecord),
}

/// One page of the audit trail.
#[derive(ToSchema)]
#[allow(dead_code)]
struct AuditPage {
    resolutions: Vec<AuditEntry>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// `GET /v1/resolutions?aggregateId=&after=&limit=`: who resolved what, when, why, and the
/// aggregate before and after, oldest first; dead letters' and gaps' in one numbered trail.
#[utoipa::path(get, path = "/v1/resolutions", tag = "evidence", params(AuditQuery),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "The audit trail, oldest first", body = AuditPage),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ))]
async fn resolutions(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    Query(query): Query<AuditQuery>,
) -> Result<Response, AppError> {
    let (aggregate_id, page) = query.into_parts()?;
    let dead_letters = inbox
        .reads()
        .resolutions(aggregate_id.clone(), page)
        .await?
        .map(|record| (record.resolution_id, json!(record)));
    let gaps = inbox
        .reads()
        .gap_resolutions(aggregate_id, page)
        .await?
        .map(|record| (record.resolution_id, json!(record)));
    Ok(json_response(
        StatusCode::OK,
        page_body(
            json!({}),
            "resolutions",
            merged_trail(dead_letters, gaps, page.limit),
        ),
    ))
}
