//! One dead letter, for a reader: `GET /v1/deadletter?messageId=[&producer=]`, the record with
//! its lifecycle and resolution. The id is named in the query, not the path: a message id may be
//! `.` or `..`, which a browser drops from a path before sending, so the console could not
//! address such a dead letter by path.

use axum::extract::{FromRef, State};
use axum::response::Response;
use ordered_inbox::views::DeadLetterView;
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{Access, Reader};
use http_edge::error::{AppError, Query};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::answers::find_dead_letter;

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    Access: FromRef<S>,
{
    OpenApiRouter::new().routes(routes!(dead_letter))
}

/// A dead letter's identity: its message id, and its producer when a producer delivered it.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct NamedDeadLetter {
    /// The dead letter's message id (any the doors accept, `.` and `..` included).
    #[param(min_length = 1, max_length = 100)]
    message_id: String,
    /// The producer whose message id it is; absent for an anonymous delivery's dead letter.
    #[param(min_length = 1, max_length = 64)]
    producer: Option<String>,
}

/// `GET /v1/deadletter?messageId=[&producer=]`.
#[utoipa::path(get, path = "/v1/deadletter", tag = "evidence", params(NamedDeadLetter),
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "The dead letter with its lifecycle and resolution", body = DeadLetterView),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No dead letter has this identity", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ))]
async fn dead_letter(
    _reader: Reader,
    State(inbox): State<SharedInbox>,
    Query(named): Query<NamedDeadLetter>,
) -> Result<Response, AppError> {
    find_dead_letter(&inbox, named.message_id, named.producer).await
}
