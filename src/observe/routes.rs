//! The operator's routes: `GET /live` (the process answers), `GET /ready` (it can serve: the
//! store answers a read and the live settings are valid) and `GET /metrics`.

use axum::Router;
use axum::extract::{FromRef, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use serde_json::json;

use super::metrics::Metrics;
use crate::error::problem_response_with;
use crate::labs::ordered::SharedInbox;
use crate::labs::security::SecurityLab;
use crate::store::Store;

/// The Prometheus text exposition format, version 0.0.4.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

pub fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    SecurityLab: FromRef<S>,
    Metrics: FromRef<S>,
    Store: FromRef<S>,
{
    Router::new()
        .route("/live", get(live))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
}

async fn live() -> &'static str {
    "live"
}

/// One readiness check's result.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "camelCase")]
enum Check {
    Ok,
    Failed,
}

#[derive(Debug, Serialize)]
struct Checks {
    store: Check,
    configuration: Check,
}

/// 200 `{"status":"ready","checks":{…}}` when the store answers a read and the live settings are
/// valid; otherwise 503 problem+json whose `detail` names what is not ready.
async fn ready(State(inbox): State<SharedInbox>, State(security): State<SecurityLab>) -> Response {
    let mut problems = Vec::new();
    let store = match inbox.health().await {
        Ok(_) => Check::Ok,
        Err(error) => {
            tracing::warn!(target: "production_lab::ready", %error, "readiness: the store does not answer a read");
            problems.push("the store does not answer a read".to_owned());
            Check::Failed
        }
    };
    let configuration = match security.configuration_error() {
        None => Check::Ok,
        Some(reason) => {
            problems.push(format!("the live settings are invalid: {reason}"));
            Check::Failed
        }
    };
    let checks = Checks {
        store,
        configuration,
    };
    if problems.is_empty() {
        return (
            StatusCode::OK,
            axum::Json(json!({"status": "ready", "checks": checks})),
        )
            .into_response();
    }
    problem_response_with(
        StatusCode::SERVICE_UNAVAILABLE,
        "Not ready",
        Some(&problems.join("; ")),
        json!({"checks": checks}),
    )
}

/// Every metric in the Prometheus text format; the inbox's gauges are read now.
async fn metrics(
    State(metrics): State<Metrics>,
    State(inbox): State<SharedInbox>,
    State(store): State<Store>,
) -> Response {
    let health = match inbox.health().await {
        Ok(health) => Some(health),
        Err(error) => {
            tracing::warn!(target: "production_lab::metrics", %error, "the inbox's figures could not be read");
            None
        }
    };
    let body = metrics.render(health.as_ref(), store.queue_depth());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROMETHEUS_CONTENT_TYPE),
        )],
        body,
    )
        .into_response()
}
