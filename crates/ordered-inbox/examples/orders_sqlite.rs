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
//!
//! The order line's pure check and the HTTP door are in `orders/mod.rs`, shared with
//! `orders_postgres`.

mod orders;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ordered_inbox::sqlite::{SqliteHandler, SqliteInbox, StoreError, WriterConnection};
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedInbox, OrderedMessage};
use orders::{Failure, OrderLines, line, verdict_on};
use rusqlite::Connection;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// The handler: what applying an order line writes, on the writer's connection, inside the
// inbox's transaction.

impl SqliteHandler for OrderLines {
    fn apply(
        &self,
        connection: &WriterConnection<'_>,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let line = match line(message) {
            Ok(line) => line,
            Err(poison) => return Ok(ApplyOutcome::Poison(poison)),
        };
        // A statement of fixed SQL, prepared once for the writer's life.
        connection
            .prepared(
                "INSERT INTO orders(order_id, sequence, message_id, sku, quantity)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute((
                &message.aggregate_id,
                message.sequence,
                &message.message_id,
                line.sku,
                line.quantity,
            ))?;
        // Poison past the order's limit, from what the table says (see `verdict_on`).
        Ok(verdict_on(units_of(connection, &message.aggregate_id)?))
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

// ---------------------------------------------------------------------------------------------
// Plumbing: one file for the inbox's tables and the application's.

async fn open_inbox(path: &Path) -> Result<SqliteInbox, StoreError> {
    OrderedInbox::sqlite(path)
        .handler(OrderLines)
        .migrate(|connection| connection.execute_batch(ORDERS_TABLE))
        .open()
        .await
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    orders::exit("orders_sqlite", run().await)
}

async fn run() -> Result<(), Failure> {
    let args = orders::Args::parse("--database")?;
    let directory = tempfile::tempdir()?;
    let path = args
        .database
        .map_or_else(|| directory.path().join("orders.db"), PathBuf::from);
    let inbox = open_inbox(&path).await?;
    let outcome = match args.listen {
        Some(listen) => orders::serve(Arc::new(inbox.clone()), listen).await,
        None => orders::check_itself(Arc::new(inbox.clone()), async || lines(&inbox).await).await,
    };
    inbox.shutdown().await;
    outcome
}

async fn lines(inbox: &SqliteInbox) -> Result<Vec<String>, Failure> {
    let read = |connection: &Connection| {
        let mut statement = connection.prepare(orders::LINES_QUERY)?;
        let lines = statement.query_map([], |row| {
            let (order, message_id): (String, String) = (row.get(0)?, row.get(2)?);
            Ok(orders::line_text(
                &order,
                row.get(1)?,
                &message_id,
                row.get(3)?,
            ))
        })?;
        lines.collect::<rusqlite::Result<Vec<_>>>()
    };
    let lines = inbox
        .store()
        .read(move |connection| read(connection).map_err(StoreError::from));
    Ok(lines.await?)
}
