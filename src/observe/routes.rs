//! The operator's routes: `GET /live` (the process answers), `GET /ready` (it can serve: the
//! store answers a read and the live settings are valid), `GET /metrics` and
//! `GET /openapi.json`.

use std::sync::OnceLock;

use axum::extract::{FromRef, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::http::error::problem_response_with;
use crate::inbox::SharedInbox;
use crate::labs::security::SecurityLab;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;

pub use http_edge::metrics::PROMETHEUS_CONTENT_TYPE;

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    SecurityLab: FromRef<S>,
    Metrics: FromRef<S>,
    Store: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(live))
        .routes(routes!(ready))
        .routes(routes!(metrics))
        .routes(routes!(openapi_json))
}

/// The process answers (it says nothing of the store or the settings: see `/ready`).
#[utoipa::path(get, path = "/live", tag = "operating", responses(
    (status = 200, description = "The process answers", body = String, content_type = "text/plain", example = "live"),
))]
async fn live() -> &'static str {
    "live"
}

/// One readiness check's result.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
enum Check {
    Ok,
    Failed,
}

/// What readiness checked.
#[derive(Debug, Serialize, ToSchema)]
struct Checks {
    /// The store answers a read (the inbox's figures).
    store: Check,
    /// The live settings file is valid (as `GET /configuration` would answer 200).
    configuration: Check,
}

/// The server can serve.
#[derive(Serialize, ToSchema)]
struct Ready {
    status: ReadyStatus,
    checks: Checks,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
enum ReadyStatus {
    Ready,
}

/// A problem whose `detail` names what is not ready, with the checks.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct NotReady {
    #[serde(flatten)]
    problem: crate::http::openapi::Problem,
    checks: Checks,
}

/// 200 `{"status":"ready","checks":{…}}` when the store answers a read and the live settings are
/// valid; otherwise 503 problem+json whose `detail` names what is not ready.
#[utoipa::path(get, path = "/ready", tag = "operating", responses(
    (status = 200, description = "The store answers a read and the live settings are valid", body = Ready),
    (status = 503, description = "Not ready: `detail` names the store, the settings or both", body = NotReady, content_type = "application/problem+json"),
))]
async fn ready(State(inbox): State<SharedInbox>, State(security): State<SecurityLab>) -> Response {
    let mut problems = Vec::new();
    let store = match inbox.reads().health().await {
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
        let ready = Ready {
            status: ReadyStatus::Ready,
            checks,
        };
        return (StatusCode::OK, axum::Json(ready)).into_response();
    }
    problem_response_with(
        StatusCode::SERVICE_UNAVAILABLE,
        "Not ready",
        Some(&problems.join("; ")),
        json!({"checks": checks}),
    )
}

/// Every metric in the Prometheus text format; the inbox's gauges are read now.
#[utoipa::path(get, path = "/metrics", tag = "operating", responses(
    (status = 200, description = "Every metric, Prometheus text format 0.0.4", body = String, content_type = "text/plain"),
))]
async fn metrics(
    State(metrics): State<Metrics>,
    State(inbox): State<SharedInbox>,
    State(store): State<Store>,
) -> Response {
    let health = match inbox.reads().health().await {
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

/// The rendered OpenAPI document. It is generated from this build's handlers, so it is the same
/// for every server in the process: the first router built renders it, and later ones find it.
static DOCUMENT: OnceLock<String> = OnceLock::new();

/// Renders `document` for `GET /openapi.json`, unless a router of this process already did.
pub fn publish_document(document: &utoipa::openapi::OpenApi) {
    DOCUMENT.get_or_init(|| {
        document.to_json().unwrap_or_else(|error| {
            tracing::error!(%error, "the OpenAPI document could not be rendered");
            "{}".to_owned()
        })
    });
}

/// This document: OpenAPI 3.1, generated from the handlers.
#[utoipa::path(get, path = "/openapi.json", tag = "operating", responses(
    (status = 200, description = "The OpenAPI 3.1 document of every route", body = Object, content_type = "application/json"),
))]
async fn openapi_json() -> Response {
    let document: &'static str = DOCUMENT.get().map_or("{}", String::as_str);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        document,
    )
        .into_response()
}
