//! The order service of `orders_sqlite` on PostgreSQL: the same door and the same check, and a
//! handler whose `apply` writes the `orders` table through `tokio_postgres`, with the client of
//! the inbox's open transaction.
//!
//! ```sh
//! # Checks itself on a private cluster (Debian package `postgresql`), or on the database given.
//! cargo run -p ordered-inbox --example orders_postgres
//! cargo run -p ordered-inbox --example orders_postgres -- \
//!     --database-url postgres://postgres@127.0.0.1:5432/orders
//! # Serves until Ctrl+C, printing `listening on http://ADDR` once it accepts connections.
//! cargo run -p ordered-inbox --example orders_postgres -- \
//!     --listen 127.0.0.1:8080 --database-url postgres://postgres@127.0.0.1:5432/orders
//! ```

mod orders;

use std::sync::Arc;

use async_trait::async_trait;
use lab_testkit::pg::{ClusterOptions, PrivateCluster};
use ordered_inbox::postgres::{HandlerClient, PostgresHandler, PostgresInbox};
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedInbox, OrderedMessage};
use orders::{Failure, OrderLines, line, verdict_on};
use serde_json::{Value, json};
use tokio_postgres::Client;

// ---------------------------------------------------------------------------------------------
// The handler: what applying an order line writes, inside the inbox's transaction.

#[async_trait]
impl PostgresHandler for OrderLines {
    async fn apply(
        &self,
        client: &HandlerClient,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let line = match line(message) {
            Ok(line) => line,
            Err(poison) => return Ok(ApplyOutcome::Poison(poison)),
        };
        client
            .execute(
                "INSERT INTO orders(order_id, sequence, message_id, sku, quantity)
                 VALUES ($1, $2, $3, $4, $5)",
                &[
                    &message.aggregate_id,
                    &message.sequence,
                    &message.message_id,
                    &line.sku,
                    &line.quantity,
                ],
            )
            .await?;
        // Poison past the order's limit, from what the table says (see `verdict_on`).
        Ok(verdict_on(units_of(client, &message.aggregate_id).await?))
    }

    /// What an operator's resolution records of the order before and after it.
    async fn state(
        &self,
        client: &HandlerClient,
        order: &str,
    ) -> Result<Option<Value>, HandlerError> {
        Ok(Some(json!({ "units": units_of(client, order).await? })))
    }
}

async fn units_of(client: &Client, order: &str) -> Result<i64, tokio_postgres::Error> {
    let sum = "SELECT COALESCE(SUM(quantity), 0)::bigint FROM orders WHERE order_id = $1";
    client.query_one(sum, &[&order]).await?.try_get(0)
}

/// The application's table. No unique key on purpose: the inbox alone keeps a line from being
/// written twice (the crate's crash tests check that it does, across a SIGKILL).
const ORDERS_TABLE: &str = "
CREATE TABLE IF NOT EXISTS orders(
    order_id text NOT NULL,
    sequence bigint NOT NULL,
    message_id text NOT NULL,
    sku text NOT NULL,
    quantity bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS ix_orders_order ON orders(order_id, sequence);";

// ---------------------------------------------------------------------------------------------
// Plumbing: the inbox's tables and the application's in one database.

async fn open_inbox(url: &str) -> Result<PostgresInbox, Failure> {
    let inbox = OrderedInbox::postgres(url)
        .handler(OrderLines)
        .migrate(ORDERS_TABLE)
        .open()
        .await?;
    Ok(inbox)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    orders::exit("orders_postgres", run().await)
}

async fn run() -> Result<(), Failure> {
    let args = orders::Args::parse("--database-url")?;
    // Without a database, a private cluster that lives as long as this process.
    let (url, _cluster) = match args.database {
        Some(url) => (url, None),
        None => {
            let start = || PrivateCluster::start(ClusterOptions::for_tests());
            let cluster = tokio::task::spawn_blocking(start).await??;
            (cluster.url("postgres"), Some(cluster))
        }
    };
    let inbox = open_inbox(&url).await?;
    let outcome = match args.listen {
        Some(listen) => orders::serve(Arc::new(inbox.clone()), listen).await,
        None => orders::check_itself(Arc::new(inbox.clone()), async || lines(&inbox).await).await,
    };
    inbox.close();
    outcome
}

async fn lines(inbox: &PostgresInbox) -> Result<Vec<String>, Failure> {
    let rows = inbox
        .pool()
        .get()
        .await?
        .query(orders::LINES_QUERY, &[])
        .await?;
    let text = |row: &tokio_postgres::Row| -> Result<String, tokio_postgres::Error> {
        let (order, message_id): (String, String) = (row.try_get(0)?, row.try_get(2)?);
        Ok(orders::line_text(
            &order,
            row.try_get(1)?,
            &message_id,
            row.try_get(3)?,
        ))
    };
    Ok(rows.iter().map(text).collect::<Result<_, _>>()?)
}
