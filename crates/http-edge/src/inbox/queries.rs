//! The evidence's queries as every door that lists it reads them (the lab's routes and the
//! gate's): a page of a timeline, the dead letters by status and aggregate, the audit trail by
//! aggregate, an inventory's status; and what a waiting aggregate is missing, answered alike.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ordered_inbox::AggregateStatus;
use ordered_inbox::model::DeadLetterStatus;
use ordered_inbox::views::{DeadLetterFilter, MissingRange, PageRequest};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::error::AppError;
use crate::inbox::SharedInbox;
use crate::inbox::answers::unknown_aggregate;
use crate::inbox::input::validate_aggregate_id;
use crate::inbox::pages::page_request;

/// A page of an aggregate's timeline.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// The cursor: the `next` of the previous page (0 or absent for the first).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

impl PageQuery {
    pub fn page(&self) -> Result<PageRequest, AppError> {
        page_request(self.after, self.limit)
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterQuery {
    /// Only dead letters in this status.
    #[param(value_type = Option<DeadLetterStatus>)]
    status: Option<String>,
    /// Only this aggregate's.
    #[param(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    aggregate_id: Option<String>,
    /// The cursor: the `next` of the previous page.
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

impl DeadLetterQuery {
    /// The filter and the page asked for, or the 400 of the first member that is wrong.
    pub fn into_parts(self) -> Result<(DeadLetterFilter, PageRequest), AppError> {
        let status = self
            .status
            .as_deref()
            .map(|status| {
                status.parse::<DeadLetterStatus>().map_err(|_| {
                    AppError::bad_request("status must be open, resolved or superseded")
                })
            })
            .transpose()?;
        let aggregate_id = checked_aggregate(self.aggregate_id)?;
        let page = page_request(self.after, self.limit)?;
        Ok((
            DeadLetterFilter {
                status,
                aggregate_id,
            },
            page,
        ))
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
pub struct AuditQuery {
    /// Only this aggregate's resolutions.
    #[param(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    aggregate_id: Option<String>,
    /// The cursor: the `next` of the previous page.
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

impl AuditQuery {
    /// The aggregate (if one) and the page asked for, or the 400 of the first one wrong.
    pub fn into_parts(self) -> Result<(Option<String>, PageRequest), AppError> {
        let aggregate_id = checked_aggregate(self.aggregate_id)?;
        Ok((aggregate_id, page_request(self.after, self.limit)?))
    }
}

fn checked_aggregate(aggregate_id: Option<String>) -> Result<Option<String>, AppError> {
    if let Some(aggregate_id) = aggregate_id.as_deref() {
        validate_aggregate_id("aggregateId", aggregate_id)?;
    }
    Ok(aggregate_id)
}

/// An inventory's `status`, or the 400 that names the ones there are.
pub fn aggregate_status(status: Option<&str>) -> Result<AggregateStatus, AppError> {
    status
        .and_then(|status| status.parse().ok())
        .ok_or_else(|| AppError::bad_request("status must be blocked, waiting or flowing"))
}

/// What a waiting aggregate is missing.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Gaps {
    aggregate_id: String,
    /// From the expected sequence through one below the lowest seen ahead of it since the last
    /// apply; null unless the aggregate waits (`through` null when nothing ahead is known).
    missing: Option<MissingRange>,
    waiting_since: Option<String>,
    /// The sequences held ahead of the gap, lowest first.
    held_sequences: Vec<i64>,
}

/// The missing range of `aggregate_id`, for a producer that can resend it; or the 400 or 404
/// that says why not.
pub async fn gaps_of(inbox: &SharedInbox, aggregate_id: String) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let Some(view) = inbox.reads().aggregate(aggregate_id.clone()).await? else {
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
