//! The gate's unauthenticated routes: `GET /live` (the process answers), `GET /ready` (the store
//! answers a read and, with NATS configured, the input's and the output's connections are up) and, when the configuration
//! makes it public, `GET /metrics`. They carry no secret and change nothing, so a load balancer
//! and a scraper need no token. When the metrics are not public, `GET /metrics` asks for a
//! reader's or an operator's token.

use axum::Json;
use axum::extract::{FromRef, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{Access, Reader};
use crate::handler::SharedTypes;
use crate::output::OutputStore;
use crate::overdue::count_overdue;
use crate::publisher::HeldEpoch;
use crate::reload::ConfigGeneration;
use http_edge::error::problem_response_with;
use http_edge::inbox::SharedInbox;
use http_edge::metrics::Metrics;
use http_edge::metrics::PROMETHEUS_CONTENT_TYPE;
use ordered_inbox::sqlite::store::Store;

/// What the health routes read.
#[derive(Clone)]
pub struct Health {
    pub inbox: SharedInbox,
    pub metrics: Metrics,
    /// The SQLite store, for its writer's queue depth (`None` on PostgreSQL).
    pub store: Option<Store>,
    /// The NATS connections, when the gate has them: `/ready` needs both connected.
    pub nats: Option<NatsClients>,
    /// The readers' tokens, for `/metrics` when it is not public.
    pub access: Access,
    /// The configuration's generation, shown by `/ready`.
    pub generation: ConfigGeneration,
    /// The output table, for its backlog and the publisher's lease.
    pub output: OutputStore,
    /// The epoch the publisher holds, when the gate runs one (with NATS).
    pub publisher: Option<HeldEpoch>,
    /// The message types in use: `gate_aggregates_overdue` goes by their gap alerts.
    pub types: SharedTypes,
}

/// The publisher's role and the lease's epoch, as `/ready` and `/metrics` show them: `holder`
/// with the epoch it holds, `standby` with the store's (`None` when the store does not answer),
/// or `absent` (no NATS, no publisher) with 0.
async fn publisher_status(health: &Health) -> (&'static str, Option<i64>) {
    publisher_role(health.publisher.as_ref(), &health.output).await
}

/// [`publisher_status`] of the epoch `held` by this gate's publisher (`None`: no publisher) and
/// the store's lease in `output`; `/v1/lag` shows it too.
pub(crate) async fn publisher_role(
    held: Option<&HeldEpoch>,
    output: &OutputStore,
) -> (&'static str, Option<i64>) {
    let Some(held) = held else {
        return ("absent", Some(0));
    };
    if let Some(epoch) = held.get() {
        return ("holder", Some(epoch));
    }
    match output.lease_epoch().await {
        Ok(epoch) => ("standby", Some(epoch)),
        Err(error) => {
            tracing::warn!(target: "production_lab::gate", %error, "the publisher's lease could not be read");
            ("standby", None)
        }
    }
}

/// The input's and the output's connections, reported apart by `/ready`.
#[derive(Clone)]
pub struct NatsClients {
    pub input: async_nats::Client,
    pub output: async_nats::Client,
}

/// `ok` or `failed` for one connection, noting a failure in `problems`.
fn connection_check(
    client: &async_nats::Client,
    problem: &'static str,
    problems: &mut Vec<&'static str>,
) -> &'static str {
    if client.connection_state() == async_nats::connection::State::Connected {
        "ok"
    } else {
        problems.push(problem);
        "failed"
    }
}

impl FromRef<Health> for Access {
    fn from_ref(health: &Health) -> Access {
        health.access.clone()
    }
}

impl FromRef<Health> for SharedInbox {
    fn from_ref(health: &Health) -> SharedInbox {
        health.inbox.clone()
    }
}

/// `/live`, `/ready`, and `/metrics`: for anyone when `public_metrics`, otherwise for a reader
/// or an operator. Documented.
pub fn routes(health: Health, public_metrics: bool) -> OpenApiRouter {
    let router = OpenApiRouter::new()
        .routes(routes!(live))
        .routes(routes!(ready));
    let router = if public_metrics {
        router.routes(routes!(metrics))
    } else {
        router.routes(routes!(metrics_for_readers))
    };
    router.with_state(health)
}

/// The process answers (it says nothing of the store: see `/ready`).
#[utoipa::path(get, path = "/live", tag = "operating", responses(
    (status = 200, description = "The process answers", body = String, content_type = "text/plain", example = "live"),
))]
async fn live() -> &'static str {
    "live"
}

/// 200 `{"status":"ready","checks":{"store":"ok","nats":…,"natsInput":…,"natsOutput":…},
/// "generation":n,"publisher":{"role":…,"epoch":n}}` (each NATS check `ok` or `absent`), or 503
/// problem+json naming what is not ready. `generation` is the configuration's (1 at start, one
/// more at each reload that took effect); `publisher.role` is `holder`, `standby` or `absent`
/// (no NATS), `epoch` the lease's (the one held, or the store's while standing by).
#[utoipa::path(get, path = "/ready", tag = "operating", responses(
    (status = 200, description = "The store answers a read and, with NATS configured, the input's and the output's connections are up", body = Object, content_type = "application/json"),
    (status = 503, description = "Not ready: `detail` names what is not", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
))]
async fn ready(State(health): State<Health>) -> Response {
    let mut problems = Vec::new();
    let store = match health.inbox.reads().health().await {
        Ok(_) => "ok",
        Err(error) => {
            tracing::warn!(target: "production_lab::gate", %error, "readiness: the store does not answer a read");
            problems.push("the store does not answer a read");
            "failed"
        }
    };
    let (input, output) = match &health.nats {
        None => ("absent", "absent"),
        Some(clients) => (
            connection_check(
                &clients.input,
                "the NATS input is not connected",
                &mut problems,
            ),
            connection_check(
                &clients.output,
                "the NATS output is not connected",
                &mut problems,
            ),
        ),
    };
    // `nats` sums the two up, as before they were reported apart.
    let nats = match (input, output) {
        ("ok", "ok") => "ok",
        ("absent", _) => "absent",
        _ => "failed",
    };
    let checks = json!({
        "store": store,
        "nats": nats,
        "natsInput": input,
        "natsOutput": output,
    });
    let generation = health.generation.current();
    let (role, epoch) = publisher_status(&health).await;
    let publisher = json!({ "role": role, "epoch": epoch });
    if problems.is_empty() {
        return (
            StatusCode::OK,
            Json(json!({
                "status": "ready",
                "checks": checks,
                "generation": generation,
                "publisher": publisher,
            })),
        )
            .into_response();
    }
    problem_response_with(
        StatusCode::SERVICE_UNAVAILABLE,
        "Not ready",
        Some(&problems.join("; ")),
        json!({ "checks": checks, "generation": generation, "publisher": publisher }),
    )
}

/// Every metric in the Prometheus text format; the inbox's gauges are read now.
#[utoipa::path(get, path = "/metrics", tag = "operating", responses(
    (status = 200, description = "Every metric, Prometheus text format 0.0.4", body = String, content_type = "text/plain"),
))]
async fn metrics(State(health): State<Health>) -> Response {
    render_metrics(&health).await
}

/// Every metric, as [`metrics`], for a reader's or an operator's token.
#[utoipa::path(get, path = "/metrics", tag = "operating",
    security(("reader" = []), ("operator" = [])),
    responses(
        (status = 200, description = "Every metric, Prometheus text format 0.0.4", body = String, content_type = "text/plain"),
        (status = 401, description = "No reader's or operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    ))]
async fn metrics_for_readers(_reader: Reader, State(health): State<Health>) -> Response {
    render_metrics(&health).await
}

/// The Prometheus text of every metric, the inbox's gauges read now.
async fn render_metrics(health: &Health) -> Response {
    let figures = match health.inbox.reads().health().await {
        Ok(figures) => Some(figures),
        Err(error) => {
            tracing::warn!(target: "production_lab::gate", %error, "the inbox's figures could not be read");
            None
        }
    };
    if figures.is_some() {
        let types = health.types.load();
        match count_overdue(&health.inbox, &types).await {
            Ok(overdue) => health.metrics.aggregates_overdue(overdue),
            Err(error) => {
                tracing::warn!(target: "production_lab::gate", %error, "the overdue aggregates could not be counted");
            }
        }
    }
    let depth = health.store.as_ref().map_or(0, Store::queue_depth);
    record_output_backlog(health).await;
    if health.publisher.is_some()
        && let (_, Some(epoch)) = publisher_status(health).await
    {
        health.metrics.gate_publisher_epoch(epoch);
    }
    let body = health.metrics.render(figures.as_ref(), depth);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROMETHEUS_CONTENT_TYPE),
        )],
        body,
    )
        .into_response()
}

/// The output's backlog gauges, read now; left as they were when the store does not answer.
async fn record_output_backlog(health: &Health) {
    match health.output.backlog().await {
        Ok(backlog) => {
            let now = ordered_inbox::clock::now();
            let oldest = backlog.oldest_applied_at.map_or(0, |applied_at| {
                ordered_inbox::clock::seconds_between(&applied_at, &now)
            });
            health.metrics.gate_output_backlog(backlog.rows, oldest);
        }
        Err(error) => {
            tracing::warn!(target: "production_lab::gate", %error, "the output's backlog could not be read");
        }
    }
}
