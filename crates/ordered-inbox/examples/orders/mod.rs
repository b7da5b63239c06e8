//! What the two order services (`orders_sqlite`, `orders_postgres`) share: what an order line is
//! (the pure half of their handler), the HTTP door, the command line and the self-check. The
//! door holds an `Arc<dyn Inbox>`: it never knows which backend is underneath.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use ordered_inbox::{
    ApplyOutcome, Check, Door, Inbox, InboxError, OrderedMessage, Outcome, Poison,
};
use serde::Deserialize;
use serde_json::{Value, json};

pub type Failure = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// An order line, and the handler's pure check of it.

/// An order holds at most this many units; a line past it is poison.
pub const MAX_UNITS: i64 = 1000;

/// The handler of both services: its `Check` is here, its `apply` is each backend's.
pub struct OrderLines;

/// One line of an order, read from an event's payload `{"sku": "tea", "quantity": 2}`.
pub struct Line<'a> {
    pub sku: &'a str,
    pub quantity: i64,
}

pub fn line(message: &OrderedMessage) -> Result<Line<'_>, Poison> {
    let sku = message.payload["sku"]
        .as_str()
        .filter(|sku| !sku.is_empty());
    let quantity = message.payload["quantity"].as_i64().filter(|&q| q > 0);
    match (sku, quantity) {
        (None, _) => Err(Poison::new("no sku")),
        (_, None) => Err(Poison::new("no quantity")),
        (Some(sku), Some(quantity)) => Ok(Line { sku, quantity }),
    }
}

impl Check for OrderLines {
    /// Pure: looks at the payload only.
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        line(message).map(|_| ())
    }
}

/// What `apply` says once it wrote a line and read the order's units: applied, with the units
/// on the timeline's `applied` event, or poison past the limit. A poison rolls the handler's
/// writes back to the inbox's savepoint, so the line just written goes with it.
pub fn verdict_on(units: i64) -> ApplyOutcome {
    let detail = |value: Value| value.as_object().cloned().unwrap_or_default();
    if units > MAX_UNITS {
        let poison = Poison::new("over the order limit");
        let detail = detail(json!({ "units": units, "limit": MAX_UNITS }));
        ApplyOutcome::Poison(poison.with_detail(detail))
    } else {
        let detail = detail(json!({ "units": units }));
        ApplyOutcome::Applied { detail }
    }
}

// ---------------------------------------------------------------------------------------------
// The HTTP door: `POST /orders/{order}/events`, the inbox's verdict as the answer.

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    message_id: String,
    sequence: i64,
    payload: Value,
}

pub fn router(inbox: Arc<dyn Inbox>) -> Router {
    Router::new()
        .route("/orders/{order}/events", post(post_event))
        .with_state(inbox)
}

async fn post_event(
    State(inbox): State<Arc<dyn Inbox>>,
    Path(order): Path<String>,
    body: Result<Json<Event>, JsonRejection>,
) -> Response {
    let event = match body {
        Ok(Json(event)) if !event.message_id.is_empty() => event,
        Ok(_) => return problem(StatusCode::BAD_REQUEST, "messageId is empty"),
        Err(rejection) => return problem(StatusCode::BAD_REQUEST, &rejection.body_text()),
    };
    let message = OrderedMessage {
        message_id: event.message_id,
        aggregate_id: order,
        sequence: event.sequence,
        payload: event.payload,
    };
    match inbox.deliver(message, Door::General).await {
        Ok(outcome) => answer(&outcome).into_response(),
        // Nothing was recorded, neither the inbox's rows nor the handler's: deliver it again.
        Err(InboxError::Handler(error)) => unavailable(&error.to_string()),
        Err(InboxError::Unavailable(error) | InboxError::Failed(error)) => unavailable(&error),
    }
}

/// A verdict as a status and a body. 200: applied, or applied before (a replay); 409: refused
/// as it is (ahead of its turn, stale, or another payload under a known id); 422: quarantined.
fn answer(outcome: &Outcome) -> (StatusCode, Json<Value>) {
    let (status, body) = match outcome {
        Outcome::Applied {
            sequence, detail, ..
        } => (
            StatusCode::OK,
            json!({ "outcome": "applied", "sequence": sequence, "detail": detail }),
        ),
        Outcome::Replay { original } => (
            StatusCode::OK,
            json!({ "outcome": "replay", "sequence": original.sequence }),
        ),
        Outcome::Stale { expected, .. } => (
            StatusCode::CONFLICT,
            json!({ "outcome": "stale", "expected": expected }),
        ),
        Outcome::PayloadConflict => (
            StatusCode::CONFLICT,
            json!({ "outcome": "payload conflict" }),
        ),
        Outcome::Quarantined {
            expected, reason, ..
        }
        | Outcome::QuarantineFull {
            expected, reason, ..
        } => (
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({ "outcome": "quarantined", "expected": expected, "reason": reason.as_str() }),
        ),
        // Only a broker's door holds messages ahead of their turn; this one refuses them.
        Outcome::Gap { expected }
        | Outcome::Held { expected, .. }
        | Outcome::HoldFull { expected, .. } => (
            StatusCode::CONFLICT,
            json!({ "outcome": "gap", "expected": expected }),
        ),
    };
    (status, Json(body))
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let title = status.canonical_reason();
    let body = json!({ "title": title, "status": status.as_u16(), "detail": detail });
    let content_type = [(header::CONTENT_TYPE, "application/problem+json")];
    (status, content_type, body.to_string()).into_response()
}

fn unavailable(detail: &str) -> Response {
    let mut response = problem(StatusCode::SERVICE_UNAVAILABLE, detail);
    let retry = header::HeaderValue::from_static("1");
    response.headers_mut().insert(header::RETRY_AFTER, retry);
    response
}

// ---------------------------------------------------------------------------------------------
// The command line, serving, and the self-check `cargo test` runs.

pub struct Args {
    pub listen: Option<SocketAddr>,
    /// The value of the database flag (`--database PATH`, `--database-url URL`).
    pub database: Option<String>,
}

impl Args {
    /// `--listen ADDR` and `database_flag VALUE`. Anything else is ignored: `cargo test` runs an
    /// example with its own arguments (filters, flags).
    pub fn parse(database_flag: &str) -> Result<Args, Failure> {
        let mut parsed = Args {
            listen: None,
            database: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            if arg == "--listen" {
                parsed.listen = Some(args.next().ok_or("--listen ADDR")?.parse()?);
            } else if arg == database_flag {
                parsed.database = Some(args.next().ok_or(format!("{database_flag} VALUE"))?);
            }
        }
        Ok(parsed)
    }
}

/// Serves until Ctrl+C. Every answered delivery is already committed, so a SIGKILL loses
/// nothing that was acknowledged.
pub async fn serve(inbox: Arc<dyn Inbox>, listen: SocketAddr) -> Result<(), Failure> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router(inbox))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Serves on an ephemeral loopback port, delivers a script of events to itself over HTTP and
/// checks each verdict, then the lines `read_lines` finds in the `orders` table.
pub async fn check_itself(
    inbox: Arc<dyn Inbox>,
    read_lines: impl AsyncFnOnce() -> Result<Vec<String>, Failure>,
) -> Result<(), Failure> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}/orders", listener.local_addr()?);
    let server = tokio::spawn(axum::serve(listener, router(inbox)).into_future());
    let client = reqwest::Client::builder().no_proxy().build()?;

    let tea = |quantity: i64| json!({ "sku": "tea", "quantity": quantity });
    // (order, message id, sequence, payload) and the status and outcome it must get: shuffled,
    // repeated, poison for the check, poison for `apply`, a correction, a conflict.
    #[rustfmt::skip]
    let script = [
        ("order-1", "o1-2", 2, tea(1), 409, "gap"),
        ("order-2", "o2-1", 1, tea(3), 200, "applied"),
        ("order-1", "o1-1", 1, tea(2), 200, "applied"),
        ("order-1", "o1-1", 1, tea(2), 200, "replay"),
        ("order-1", "o1-2", 2, tea(1), 200, "applied"),
        ("order-1", "o1-3", 3, tea(0), 422, "quarantined: no quantity"),
        ("order-1", "o1-3b", 3, tea(4), 200, "applied"),
        ("order-1", "o1-4", 4, tea(5000), 422, "quarantined: over the order limit"),
        ("order-1", "o1-1", 1, tea(9), 409, "payload conflict"),
    ];
    for (order, message_id, sequence, payload, status, outcome) in &script {
        let body = json!({ "messageId": message_id, "sequence": sequence, "payload": payload });
        let response = client
            .post(format!("{base}/{order}/events"))
            .json(&body)
            .send()
            .await?;
        let got = (response.status().as_u16(), verdict(&response.json().await?));
        if got != (*status, outcome.to_string()) {
            return Err(format!("{message_id}: expected {status} {outcome}, got {got:?}").into());
        }
    }
    let malformed = client
        .post(format!("{base}/order-1/events"))
        .header(header::CONTENT_TYPE.as_str(), "application/json")
        .body(r#"{"messageId": "o1-5", "sequence": "five"}"#)
        .send()
        .await?;
    if malformed.status() != StatusCode::BAD_REQUEST.as_u16() {
        return Err(format!(
            "a malformed event: expected 400, got {}",
            malformed.status()
        )
        .into());
    }
    server.abort();

    // The lines applied, once each, in order; the poison ones left nothing (the one `apply`
    // refused had written its line before it said so).
    let lines = read_lines().await?;
    let expected = [
        "order-1 #1 o1-1 x2",
        "order-1 #2 o1-2 x1",
        "order-1 #3 o1-3b x4",
        "order-2 #1 o2-1 x3",
    ];
    if lines != expected {
        return Err(format!("the orders table holds {lines:?}, expected {expected:?}").into());
    }
    println!(
        "{} deliveries: every verdict and line as expected",
        script.len() + 1
    );
    Ok(())
}

/// An answer's outcome, with its reason when it has one.
fn verdict(body: &Value) -> String {
    match (body["outcome"].as_str(), body["reason"].as_str()) {
        (Some(outcome), Some(reason)) => format!("{outcome}: {reason}"),
        (outcome, _) => outcome.unwrap_or("no outcome").to_owned(),
    }
}

/// The query both backends answer with the table's lines, as `check_itself` compares them.
pub const LINES_QUERY: &str = "SELECT order_id, sequence, message_id, quantity FROM orders
                               ORDER BY order_id, sequence, message_id";

pub fn line_text(order: &str, sequence: i64, message_id: &str, quantity: i64) -> String {
    format!("{order} #{sequence} {message_id} x{quantity}")
}

/// The exit status of a run, with its failure on stderr.
pub fn exit(example: &str, outcome: Result<(), Failure>) -> std::process::ExitCode {
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{example}: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}
