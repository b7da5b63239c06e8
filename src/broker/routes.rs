//! The broker door's evidence over HTTP: `GET /broker` (what the consumer did, and the
//! consumer's pending counts as the NATS server reports them), `GET /broker/rejected` (the
//! terminated deliveries, oldest first), and the test-only fault switch
//! `POST /lab/broker/pause-after-commit` (the next batch stops after its COMMIT, before its acks,
//! so that a test can kill the process in that window).

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::json;

use super::BrokerLab;
use crate::error::{AppError, json_response};

pub fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    BrokerLab: FromRef<S>,
{
    Router::new()
        .route("/broker", get(status))
        .route("/broker/rejected", get(rejected))
        .route("/lab/broker/pause-after-commit", post(pause_after_commit))
}

fn require_consumer(lab: &BrokerLab) -> Result<&super::BrokerConfig, AppError> {
    lab.config().ok_or_else(|| {
        AppError::problem_with_detail(
            StatusCode::NOT_FOUND,
            "No broker consumer",
            "this server was started without --nats",
        )
    })
}

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

async fn rejected(State(lab): State<BrokerLab>) -> Result<Response, AppError> {
    require_consumer(&lab)?;
    let rejected = lab.rejected();
    Ok(json_response(
        StatusCode::OK,
        json!({"kept": super::REJECTED_KEPT, "rejected": rejected}),
    ))
}

async fn pause_after_commit(State(lab): State<BrokerLab>) -> Result<StatusCode, AppError> {
    require_consumer(&lab)?;
    lab.arm_pause_after_commit();
    Ok(StatusCode::NO_CONTENT)
}
