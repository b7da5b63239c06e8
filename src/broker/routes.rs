//! The broker door's evidence over HTTP: `GET /broker` (what the consumer did, and the
//! consumer's pending counts as the NATS server reports them), `GET /broker/rejected` (the
//! terminated deliveries, oldest first), and the test-only fault switch
//! `POST /lab/broker/pause-after-commit` (the next batch stops after its COMMIT, before its acks,
//! so that a test can kill the process in that window).

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::BrokerLab;
use crate::error::{AppError, json_response};

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    BrokerLab: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(status))
        .routes(routes!(rejected))
        .routes(routes!(pause_after_commit))
}

/// What the consumer did, as `GET /broker` answers it.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct BrokerStatus {
    stream: String,
    durable: String,
    filter_subject: String,
    partition: u32,
    partitions: u32,
    connected: bool,
    /// The consumer's pending counts as the NATS server reports them (`pending`, `ackPending`),
    /// `{"error": …}` when it could not say, or null before the first fetch.
    #[schema(value_type = Option<Object>)]
    consumer: (),
    #[schema(value_type = Object)]
    counters: (),
}

/// The terminated deliveries, oldest first.
#[derive(ToSchema)]
#[allow(dead_code)]
struct RejectedList {
    /// How many the list keeps.
    kept: usize,
    #[schema(value_type = Vec<Object>)]
    rejected: (),
}

/// The problem when this server consumes no broker.
const NO_CONSUMER: &str = "this server was started without --nats";

fn require_consumer(lab: &BrokerLab) -> Result<&super::BrokerConfig, AppError> {
    lab.config().ok_or_else(|| {
        AppError::problem_with_detail(StatusCode::NOT_FOUND, "No broker consumer", NO_CONSUMER)
    })
}

#[utoipa::path(get, path = "/broker", tag = "broker", responses(
    (status = 200, description = "What the consumer did", body = BrokerStatus),
    (status = 404, description = "This server was started without --nats", body = crate::openapi::Problem, content_type = "application/problem+json"),
))]
async fn status(State(lab): State<BrokerLab>) -> Result<Response, AppError> {
    let config = require_consumer(&lab)?.clone();
    let consumer = match lab.consumer_info().await {
        Some(Ok((pending, ack_pending))) => json!({"pending": pending, "ackPending": ack_pending}),
        Some(Err(error)) => json!({"error": error}),
        None => json!(null),
    };
    Ok(json_response(
        StatusCode::OK,
        json!({
            "stream": config.stream,
            "durable": config.durable_name(),
            "filterSubject": config.filter_subject(),
            "partition": config.partition,
            "partitions": config.partitions,
            "connected": lab.is_connected(),
            "consumer": consumer,
            "counters": lab.counters(),
        }),
    ))
}

#[utoipa::path(get, path = "/broker/rejected", tag = "broker", responses(
    (status = 200, description = "The terminated deliveries, oldest first", body = RejectedList),
    (status = 404, description = "This server was started without --nats", body = crate::openapi::Problem, content_type = "application/problem+json"),
))]
async fn rejected(State(lab): State<BrokerLab>) -> Result<Response, AppError> {
    require_consumer(&lab)?;
    let rejected = lab.rejected();
    Ok(json_response(
        StatusCode::OK,
        json!({"kept": super::REJECTED_KEPT, "rejected": rejected}),
    ))
}

/// The fault switch: the next batch stops after its COMMIT, before its acks.
#[utoipa::path(post, path = "/lab/broker/pause-after-commit", tag = "broker", responses(
    (status = 204, description = "Armed"),
    (status = 404, description = "This server was started without --nats", body = crate::openapi::Problem, content_type = "application/problem+json"),
))]
async fn pause_after_commit(State(lab): State<BrokerLab>) -> Result<StatusCode, AppError> {
    require_consumer(&lab)?;
    lab.arm_pause_after_commit();
    Ok(StatusCode::NO_CONTENT)
}
