//! An HTTP service of one's own in front of the ordered inbox on SQLite. Each order's lines
//! arrive as events, `POST /orders/{order}/events` with `{"messageId", "sequence", "payload":
//! {"sku", "quantity"}}`; the inbox applies each order's events once and in sequence order, and
//! the handler writes each line into the application's `orders` table in the inbox's own
//! transaction: the inbox's row and the line commit together or not at all.
//!
//! ```sh
//! # Checks itself: serves on an ephemeral loopback port with a temp file, sends itself shuffled,
//! # repeated and poison deliveries over HTTP, checks the verdicts and the table; exits 0.
//! cargo run -p ordered-inbox --example orders_sqlite
//! # Serves until Ctrl+C, printing `listening on http://ADDR` once it accepts connections.
//! cargo run -p ordered-inbox --example orders_sqlite -- --listen 127.0.0.1:8080 --database orders.db
//! curl -i localhost:8080/orders/order-1/events -H 'content-type: application/json' \
//!      -d '{"messageId":"m-1","sequence":1,"payload":{"sku":"tea","quantity":2}}'
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use ordered_inbox::sqlite::{SqliteHandler, SqliteInbox, Store, StoreError, Synchronous, schema};
use ordered_inbox::{
    ApplyOutcome, Check, Detail, Door, HandlerError, Inbox, InboxError, Limits, OrderedMessage,
    Outcome, Poison,
};
use rusqlite::Connection;
use serde::Deserialize;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// The handler: what an order line is, and what applying one writes.

/// An order holds at most this many units; a line past it is poison.
const MAX_UNITS: i64 = 1000;

/// The application's table. No unique key on purpose: the inbox alone keeps a line from being
/// written twice (the crate's crash tests check that it does, across a SIGKILL).
const ORDERS_TABLE: &str = "
CREATE TABLE IF NOT EXISTS orders(
    order_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    message_id TEXT NOT NULL,
    sku TEXT NOT NULL,
    quantity INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS ix_orders_order ON orders(order_id, sequence);";

struct OrderLines;

/// One line of an order, read from an event's payload.
struct Line<'a> {
    sku: &'a str,
    quantity: i64,
}

fn line(message: &OrderedMessage) -> Result<Line<'_>, Poison> {
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

impl SqliteHandler for OrderLines {
    /// Runs in the inbox's transaction, after `check` accepted the message.
    fn apply(
        &self,
        connection: &Connection,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let line = match line(message) {
            Ok(line) => line,
            Err(poison) => return Ok(ApplyOutcome::Poison(poison)),
        };
        connection.execute(
            "INSERT INTO orders(order_id, sequence, message_id, sku, quantity)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            (
                &message.aggregate_id,
                message.sequence,
                &message.message_id,
                line.sku,
                line.quantity,
            ),
        )?;
        let units = units_of(connection, &message.aggregate_id)?;
        if units > MAX_UNITS {
            // Poison from what the tables say: the inbox rolls back to its savepoint, so the
            // line just written goes too, and quarantines the message.
            let detail = detail(json!({ "units": units, "limit": MAX_UNITS }));
            let poison = Poison::new("over the order limit").with_detail(detail);
            return Ok(ApplyOutcome::Poison(poison));
        }
        // Shown on the `applied` event of the order's timeline.
        let detail = detail(json!({ "units": units }));
        Ok(ApplyOutcome::Applied { detail })
    }

    /// What an operator's resolution records of the order before and after it.
    fn state(&self, connection: &Connection, order: &str) -> Result<Option<Value>, HandlerError> {
        Ok(Some(json!({ "units": units_of(connection, order)? })))
    }
}

fn units_of(connection: &Connection, order: &str) -> rusqlite::Result<i64> {
    connection.query_row(
        "SELECT COALESCE(SUM(quantity), 0) FROM orders WHERE order_id = ?1",
        [order],
        |row| row.get(0),
    )
}

fn detail(value: Value) -> Detail {
    value.as_object().cloned().unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// The HTTP door: one route, the inbox's verdict as the answer.

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    message_id: String,
    sequence: i64,
    payload: Value,
}

fn router(inbox: SqliteInbox) -> Router {
    Router::new()
        .route("/orders/{order}/events", post(post_event))
        .with_state(inbox)
}

async fn post_event(
    State(inbox): State<SqliteInbox>,
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
        // Nothing was recorded: the client delivers the same event again.
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
        Outcome::Gap { expected } => (
            StatusCode::CONFLICT,
            json!({ "outcome": "gap", "expected": expected }),
        ),
        Outcome::Stale { expected } => (
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
        // Only the broker's door holds messages.
        Outcome::Held { expected, .. } | Outcome::HoldFull { expected, .. } => (
            StatusCode::CONFLICT,
            json!({ "outcome": "gap", "expected": expected }),
        ),
    };
    (status, Json(body))
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body =
        json!({ "title": status.canonical_reason(), "status": status.as_u16(), "detail": detail });
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
// Plumbing: one file for the inbox's tables and the application's, the server, the self-check.

type Failure = Box<dyn std::error::Error + Send + Sync>;

fn open_inbox(path: &std::path::Path) -> Result<SqliteInbox, StoreError> {
    let store = Store::open(path, Synchronous::Full, |connection| {
        schema::migrate(connection)?;
        connection.execute_batch(ORDERS_TABLE)
    })?;
    Ok(SqliteInbox::with_handler(
        store,
        Limits::default(),
        Arc::new(OrderLines),
    ))
}

#[tokio::main]
async fn main() -> ExitCode {
    let outcome = match Args::parse(std::env::args().skip(1)) {
        Ok(Args {
            listen: Some(listen),
            database,
        }) => serve(listen, database).await,
        // `cargo test` runs this with its own arguments (filters, flags): they are not ours.
        Ok(Args { listen: None, .. }) => check_itself().await,
        Err(error) => Err(error),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("orders_sqlite: {error}");
            ExitCode::FAILURE
        }
    }
}

struct Args {
    listen: Option<SocketAddr>,
    database: Option<PathBuf>,
}

impl Args {
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, Failure> {
        let mut parsed = Args {
            listen: None,
            database: None,
        };
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--listen" => parsed.listen = Some(args.next().ok_or("--listen ADDR")?.parse()?),
                "--database" => {
                    parsed.database = Some(args.next().ok_or("--database PATH")?.into())
                }
                _ => {}
            }
        }
        Ok(parsed)
    }
}

/// Serves until Ctrl+C (or SIGKILL: every answered delivery is already committed).
async fn serve(listen: SocketAddr, database: Option<PathBuf>) -> Result<(), Failure> {
    let directory = tempfile::tempdir()?;
    let path = database.unwrap_or_else(|| directory.path().join("orders.db"));
    let inbox = open_inbox(&path)?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router(inbox.clone()))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    inbox.shutdown().await;
    Ok(())
}

/// Delivers a script of events to itself over HTTP and checks each verdict and the table.
async fn check_itself() -> Result<(), Failure> {
    let directory = tempfile::tempdir()?;
    let inbox = open_inbox(&directory.path().join("orders.db"))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(axum::serve(listener, router(inbox.clone())).into_future());
    let client = reqwest::Client::builder().no_proxy().build()?;

    let tea = |quantity: i64| json!({ "sku": "tea", "quantity": quantity });
    // (order, message id, sequence, payload) and the status and outcome it must get.
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
        let url = format!("{base}/orders/{order}/events");
        let response = client.post(&url).json(&body).send().await?;
        let got = (response.status().as_u16(), verdict(&response.json().await?));
        if got != (*status, outcome.to_string()) {
            return Err(format!("{message_id}: expected {status} {outcome}, got {got:?}").into());
        }
    }
    let malformed = client
        .post(format!("{base}/orders/order-1/events"))
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

    // The lines applied, once each, in order; the poison ones left nothing (the one `apply`
    // refused had written its line before it said so).
    let lines = inbox
        .store()
        .read(|connection| {
            let mut statement = connection.prepare(
                "SELECT order_id, sequence, message_id, quantity FROM orders
                 ORDER BY order_id, sequence, rowid",
            )?;
            let rows = statement.query_map([], |row| {
                Ok(format!(
                    "{} #{} {} x{}",
                    row.get::<_, String>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, i64>(3)?
                ))
            })?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .map_err(StoreError::from)
        })
        .await?;
    let expected = [
        "order-1 #1 o1-1 x2",
        "order-1 #2 o1-2 x1",
        "order-1 #3 o1-3b x4",
        "order-2 #1 o2-1 x3",
    ];
    if lines != expected {
        return Err(format!("the orders table holds {lines:?}, expected {expected:?}").into());
    }
    server.abort();
    inbox.shutdown().await;
    println!(
        "orders_sqlite: {} deliveries, every verdict and line as expected",
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
