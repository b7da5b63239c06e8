//! The broker door's evidence over HTTP: `GET /broker` (what the consumer did, and the
//! consumer's pending counts as the NATS server reports them), `GET /broker/rejected` (the
//! terminated deliveries and the held messages the inbox rejected, oldest first, paged, kept in
//! the inbox's store), and the test-only fault switch
//! `POST /lab/broker/pause-after-commit` (the next batch stops after its COMMIT, before its acks,
//! so that a test can kill the process in that window).

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::records::RejectedDelivery;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{BrokerConfig, BrokerLab, wire};
use crate::http::error::{AppError, Query, json_response};
use crate::inbox::SharedInbox;
use crate::inbox::pages::{page_body, page_request};

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    BrokerLab: FromRef<S>,
    SharedInbox: FromRef<S>,
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

/// One page of the rejected list, oldest first.
#[derive(ToSchema)]
#[allow(dead_code)]
struct RejectedList {
    /// How many the list keeps: the newest; older ones are pruned.
    kept: i64,
    rejected: Vec<Rejected>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

/// One rejected delivery: a terminated one, or a held message the inbox rejected because it may
/// no longer apply.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Rejected {
    at: String,
    /// The subject it arrived on; for a held message the inbox rejected, the subject its
    /// aggregate's messages arrive on at this consumer.
    subject: String,
    stream_sequence: Option<i64>,
    delivered: Option<i64>,
    message_id: Option<String>,
    aggregate_id: Option<String>,
    /// The producer whose token the message carried, once known (absent: anonymous, or the
    /// token was not an active producer's).
    #[serde(skip_serializing_if = "Option::is_none")]
    producer: Option<String>,
    /// `malformed`, `stale`, `payload conflict`, or a producer refusal (`owner required`,
    /// `not the owner`, `fenced`, …).
    outcome: String,
    reason: String,
}

impl Rejected {
    fn of(entry: RejectedDelivery, config: &BrokerConfig) -> Rejected {
        let subject = entry.subject.unwrap_or_else(|| {
            subject_of_aggregate(config, entry.aggregate_id.as_deref().unwrap_or(""))
        });
        Rejected {
            at: entry.at,
            subject,
            stream_sequence: entry.stream_sequence,
            delivered: entry.delivered,
            message_id: entry.message_id,
            aggregate_id: entry.aggregate_id,
            producer: entry.producer,
            outcome: entry.outcome,
            reason: entry.reason,
        }
    }
}

/// The stored subject of an aggregate's messages at this consumer: `PREFIX.TOKEN`, or
/// `PREFIX.K.TOKEN` when the stream maps subjects to partitions.
fn subject_of_aggregate(config: &BrokerConfig, aggregate_id: &str) -> String {
    match config.partition_token() {
        Some(partition) => format!(
            "{}.{partition}.{}",
            config.subject_prefix,
            wire::encode_aggregate(aggregate_id)
        ),
        None => wire::subject_for(&config.subject_prefix, aggregate_id),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct RejectedQuery {
    /// The cursor: the `next` of the previous page (0 or absent for the first).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
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
    (status = 404, description = "This server was started without --nats", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
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

/// `GET /broker/rejected?after=&limit=`: oldest first; `next` is the `after` of the following
/// page, or null at the end.
#[utoipa::path(get, path = "/broker/rejected", tag = "broker", params(RejectedQuery), responses(
    (status = 200, description = "The terminated deliveries and the held messages the inbox rejected, oldest first", body = RejectedList),
    (status = 400, response = crate::http::openapi::BadRequest),
    (status = 404, description = "This server was started without --nats", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn rejected(
    State(lab): State<BrokerLab>,
    State(inbox): State<SharedInbox>,
    Query(query): Query<RejectedQuery>,
) -> Result<Response, AppError> {
    let config = require_consumer(&lab)?;
    let page = page_request(query.after, query.limit)?;
    let listed = inbox.reads().rejected(page).await?;
    let listed = ordered_inbox::views::Page {
        items: listed
            .items
            .into_iter()
            .map(|entry| Rejected::of(entry, config))
            .collect(),
        next: listed.next,
    };
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"kept": super::REJECTED_KEPT}), "rejected", listed),
    ))
}

/// The fault switch: the next batch stops after its COMMIT, before its acks.
#[utoipa::path(post, path = "/lab/broker/pause-after-commit", tag = "broker", responses(
    (status = 204, description = "Armed"),
    (status = 404, description = "This server was started without --nats", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
))]
async fn pause_after_commit(State(lab): State<BrokerLab>) -> Result<StatusCode, AppError> {
    require_consumer(&lab)?;
    lab.arm_pause_after_commit();
    Ok(StatusCode::NO_CONTENT)
}
