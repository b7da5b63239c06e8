//! The applied feed: `GET /v1/aggregates/{id}/applied?after=N&limit=L&waitMs=W`, an aggregate's
//! applied messages as the gate emits them (its output rows), in sequence order, after sequence
//! `after`. With nothing to answer yet and `waitMs` above 0 it waits, up to that long (at most
//! 30 s), for the inbox to commit a change of this aggregate, and reads again: a consumer
//! follows the aggregate with one open request instead of polling.

use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;
use tokio::time::{Instant, timeout_at};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{Access, Reader};
use crate::output::{OutputEntry, OutputStore};
use http_edge::error::{AppError, Path, Query, json_response, problem_response_with};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::changes::InboxChanges;
use http_edge::inbox::input::validate_aggregate_id;
use http_edge::inbox::pages::{page_request, validate_limit};

/// The longest a request may wait for a message to apply.
const MAX_WAIT_MS: u64 = 30_000;

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    Access: FromRef<S>,
    OutputStore: FromRef<S>,
    InboxChanges: FromRef<S>,
{
    OpenApiRouter::new().routes(routes!(applied))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct FeedQuery {
    /// The last sequence already read: the `next` of the previous answer (0 or absent first).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// With nothing after `after` yet, wait up to this many milliseconds for a message to apply
    /// (0 or absent: answer at once).
    #[param(minimum = 0, maximum = 30000)]
    wait_ms: Option<u64>,
}

/// The applied messages after `after`.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct AppliedFeed {
    aggregate_id: String,
    after: i64,
    messages: Vec<OutputEntry>,
    /// The `after` of the next request: the last sequence answered (or `after` when none was).
    next: i64,
}

/// `GET /v1/aggregates/{id}/applied?after=&limit=&waitMs=`.
#[utoipa::path(get, path = "/v1/aggregates/{aggregate_id}/applied", tag = "feed",
    params(("aggregate_id" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The aggregate"), FeedQuery),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "The applied messages after `after`, in sequence order (empty when none applied within waitMs)", body = AppliedFeed),
        (status = 410, description = "`after` lies before the first retained sequence (`firstRetained`): the output before it was pruned"),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn applied(
    _reader: Reader,
    State(output): State<OutputStore>,
    State(changes): State<InboxChanges>,
    Path(aggregate_id): Path<String>,
    Query(query): Query<FeedQuery>,
) -> Result<Response, AppError> {
    validate_aggregate_id("aggregateId", &aggregate_id)?;
    let after = page_request(query.after, None)?.after;
    let limit = usize::try_from(validate_limit(query.limit)?).unwrap_or(1);
    let wait_ms = query.wait_ms.unwrap_or(0);
    if wait_ms > MAX_WAIT_MS {
        return Err(AppError::bad_request(format!(
            "waitMs must be from 0 to {MAX_WAIT_MS}"
        )));
    }
    // Rows at or below `through` were pruned: answering from the first retained one would
    // hide the pruned range from a reader that has not seen it.
    if let Some(through) = output.pruned_through(&aggregate_id).await?
        && after < through
    {
        return Ok(problem_response_with(
            StatusCode::GONE,
            "Pruned",
            Some(&format!(
                "the output of this aggregate through sequence {through} is no longer kept; \
                 the first retained sequence is {}",
                through + 1
            )),
            json!({"aggregateId": aggregate_id, "after": after, "firstRetained": through + 1}),
        ));
    }
    let read = Read {
        output: &output,
        aggregate_id: &aggregate_id,
        after,
        limit,
    };
    // Listening starts before the first read, so a message that applies between that read and
    // the wait still wakes it.
    let listener = changes.subscribe();
    let mut messages = read.once().await?;
    if messages.is_empty() && wait_ms > 0 {
        let deadline = Instant::now() + Duration::from_millis(wait_ms);
        messages = read.when_changed(listener, deadline).await?;
    }
    let next = messages.last().map_or(after, |entry| entry.sequence);
    Ok(json_response(
        StatusCode::OK,
        json!({"aggregateId": aggregate_id, "after": after, "messages": messages, "next": next}),
    ))
}

/// One read of the feed, as often as it takes.
struct Read<'a> {
    output: &'a OutputStore,
    aggregate_id: &'a str,
    after: i64,
    limit: usize,
}

impl Read<'_> {
    async fn once(&self) -> Result<Vec<OutputEntry>, AppError> {
        Ok(self
            .output
            .applied(self.aggregate_id, self.after, self.limit)
            .await?)
    }

    /// Reads again after each committed change of the aggregate (or after falling behind the
    /// feed, which may have hidden one) until a read finds messages or `deadline` passes.
    async fn when_changed(
        &self,
        mut listener: tokio::sync::broadcast::Receiver<http_edge::inbox::changes::InboxChange>,
        deadline: Instant,
    ) -> Result<Vec<OutputEntry>, AppError> {
        loop {
            let woken = match timeout_at(deadline, listener.recv()).await {
                Err(_elapsed) => return Ok(Vec::new()),
                Ok(Ok(change)) => change.aggregate_id == self.aggregate_id,
                Ok(Err(RecvError::Lagged(_))) => true,
                // Nobody can publish any more: nothing will apply while this request waits.
                Ok(Err(RecvError::Closed)) => return Ok(Vec::new()),
            };
            if woken {
                let messages = self.once().await?;
                if !messages.is_empty() {
                    return Ok(messages);
                }
            }
        }
    }
}
