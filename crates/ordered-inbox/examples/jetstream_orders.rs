//! A NATS JetStream pull consumer in front of the ordered inbox on SQLite, with the library's
//! consumer ([`ordered_inbox::jetstream`], feature `jetstream`). Order events are published to
//! `orders.{order}` as `{"messageId", "sequence", "payload": {"sku", "quantity"}}` with the
//! message id in `Nats-Msg-Id`; the consumer hands each fetched batch to the inbox in one
//! `deliver_batch` (one commit) through the broker's door, which holds an event that is ahead of
//! its turn until its predecessor arrives, and the handler writes each applied line into the
//! `orders` table in that commit. Each message is answered only after the COMMIT: acked once
//! recorded, nak'd when the handler failed (it comes back), terminated when it can never be
//! recorded. All this program writes is the handler, the body reader and the settings.
//!
//! ```sh
//! # Checks itself on a private nats-server (Debian package `nats-server`): publishes shuffled
//! # events with duplicates and a poison one, consumes until each is answered, checks the table.
//! cargo run -p ordered-inbox --features jetstream --example jetstream_orders
//! # Consumes the stream ORDERS of the server at URL until Ctrl+C.
//! cargo run -p ordered-inbox --features jetstream --example jetstream_orders -- --nats nats://127.0.0.1:4222 --database orders.db
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use ordered_inbox::jetstream::{BrokerConfig, Consumer, ConsumerStatus, SharedInbox, wire};
use ordered_inbox::sqlite::{SqliteHandler, SqliteInbox, StoreError, WriterConnection};
use ordered_inbox::{ApplyOutcome, Check, HandlerError, OrderedInbox, OrderedMessage, Poison};
use rusqlite::Connection;
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------------------------------------
// The handler: a line needs a positive quantity, and applying it writes it.

struct OrderLines;

impl Check for OrderLines {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        match message.payload["quantity"].as_i64() {
            Some(quantity) if quantity > 0 => Ok(()),
            _ => Err(Poison::new("no quantity")),
        }
    }
}

impl SqliteHandler for OrderLines {
    fn apply(
        &self,
        connection: &WriterConnection<'_>,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        connection.execute(
            "INSERT INTO orders(order_id, sequence, message_id, sku, quantity)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            (
                &message.aggregate_id,
                message.sequence,
                &message.message_id,
                message.payload["sku"].as_str().unwrap_or_default(),
                message.payload["quantity"].as_i64().unwrap_or_default(),
            ),
        )?;
        Ok(ApplyOutcome::applied())
    }
}

const ORDERS_TABLE: &str = "
CREATE TABLE IF NOT EXISTS orders(order_id TEXT NOT NULL, sequence INTEGER NOT NULL,
                                  message_id TEXT NOT NULL, sku TEXT NOT NULL,
                                  quantity INTEGER NOT NULL);";

// ---------------------------------------------------------------------------------------------
// The consumer: the library's, reading this program's events.

/// What a message of the stream carries; its order is the subject's last token.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    message_id: String,
    sequence: i64,
    payload: serde_json::Value,
}

/// An event's body for the order its subject names, or why it is malformed (it is terminated).
fn read_event(order: String, body: &[u8]) -> Result<OrderedMessage, String> {
    let event: Event = serde_json::from_slice(body).map_err(|error| error.to_string())?;
    Ok(OrderedMessage {
        message_id: event.message_id,
        aggregate_id: order,
        sequence: event.sequence,
        payload: event.payload,
    })
}

/// The stream ORDERS on `orders.*`, consumed by the durable `orders-inbox`.
fn settings(url: &str) -> BrokerConfig {
    let mut settings = BrokerConfig::with_checked_urls(vec![url.to_owned()]);
    settings.stream = "ORDERS".to_owned();
    settings.subject_prefix = "orders".to_owned();
    settings.durable = "orders-inbox".to_owned();
    settings
}

/// Runs the library's consumer on `client` until `stop` is cancelled; its evidence is `status`.
async fn consume(
    client: async_nats::Client,
    url: &str,
    inbox: SharedInbox,
    status: ConsumerStatus,
    stop: CancellationToken,
) -> Result<(), Failure> {
    let consumer = Consumer::with_client(settings(url), status, client, read_event).await?;
    consumer.run(inbox, stop).await;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Plumbing: the inbox and the self-check.

type Failure = Box<dyn std::error::Error + Send + Sync>;

async fn open_inbox(path: &Path) -> Result<SqliteInbox, StoreError> {
    OrderedInbox::sqlite(path)
        .handler(OrderLines)
        .migrate(|connection| connection.execute_batch(ORDERS_TABLE))
        .open()
        .await
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("jetstream_orders: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Failure> {
    // `cargo test` runs this with its own arguments (filters, flags): only ours count.
    let mut args = std::env::args().skip(1);
    let (mut nats, mut database) = (None, None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--nats" => nats = Some(args.next().ok_or("--nats URL")?),
            "--database" => database = Some(PathBuf::from(args.next().ok_or("--database PATH")?)),
            _ => {}
        }
    }
    let directory = tempfile::tempdir()?;
    let path = database.unwrap_or_else(|| directory.path().join("orders.db"));
    let inbox = Arc::new(open_inbox(&path).await?);
    let outcome = match nats {
        Some(url) => consume_until_stopped(&url, inbox.clone()).await,
        None => check_itself(inbox.clone()).await,
    };
    inbox.shutdown().await;
    outcome
}

async fn consume_until_stopped(url: &str, inbox: Arc<SqliteInbox>) -> Result<(), Failure> {
    let client = async_nats::connect(url).await?;
    let stop = CancellationToken::new();
    let consumer = consume(client, url, inbox, ConsumerStatus::default(), stop.clone());
    println!("consuming orders.* at {url}");
    tokio::select! {
        consumed = consumer => consumed,
        _ = tokio::signal::ctrl_c() => {
            stop.cancel();
            Ok(())
        }
    }
}

/// Three orders' events, shuffled, with duplicates (sent under the resend header, which
/// JetStream does not de-duplicate on, so that the inbox recognises them) and a poison line.
fn events() -> Vec<(String, String, String, bool)> {
    let mut events = Vec::new();
    for order in ["order-1", "order-2", "order-3"] {
        for sequence in 1..=5 {
            // order-2's third line is poison: its dead letter blocks order-2 from there on.
            let quantity = if (order, sequence) == ("order-2", 3) {
                0
            } else {
                sequence
            };
            let id = format!("{order}-{sequence}");
            let payload = json!({ "sku": "tea", "quantity": quantity });
            let event = json!({ "messageId": id, "sequence": sequence, "payload": payload });
            events.push((
                wire::subject_for("orders", order),
                id,
                event.to_string(),
                false,
            ));
        }
    }
    let again = events
        .clone()
        .into_iter()
        .step_by(2)
        .map(|(s, i, e, _)| (s, i, e, true));
    events.extend(again.collect::<Vec<_>>());
    rand::seq::SliceRandom::shuffle(events.as_mut_slice(), &mut rand::rng());
    events
}

/// Publishes the events, consumes until every message is acked and checks the table.
async fn check_itself(inbox: Arc<SqliteInbox>) -> Result<(), Failure> {
    let server = tokio::task::spawn_blocking(|| lab_testkit::nats::NatsServer::start(None));
    let server = server.await??;
    let client = server.connect().await?;
    let (status, stop) = (ConsumerStatus::default(), CancellationToken::new());
    // The consumer creates the stream before anything is published.
    let consumer = Consumer::with_client(
        settings(&server.url),
        status.clone(),
        client.clone(),
        read_event,
    )
    .await?;
    let running = tokio::spawn(consumer.run(inbox.clone() as SharedInbox, stop.clone()));
    let events = events();
    let context = jetstream::new(client);
    for (subject, id, event, resent) in &events {
        let mut headers = async_nats::HeaderMap::new();
        let header = if *resent {
            wire::RESEND_HEADER
        } else {
            wire::MESSAGE_ID_HEADER
        };
        headers.insert(header, id.as_str());
        context
            .publish_with_headers(subject.clone(), headers, event.clone().into())
            .await?
            .await?;
    }
    let answered = async {
        while status.counters().acked < events.len() as u64 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let in_time = tokio::time::timeout(Duration::from_secs(60), answered).await;
    stop.cancel();
    running.await?;
    let counters = status.counters();
    if in_time.is_err() || counters.terminated + counters.nakd > 0 {
        return Err(format!("{} published, answered {counters:?}", events.len()).into());
    }
    let lines = inbox
        .store()
        .read(|connection| lines(connection).map_err(StoreError::from));
    let lines = lines.await?;
    let expected: Vec<String> = ["order-1", "order-2", "order-3"]
        .into_iter()
        .flat_map(|order| {
            let applied = if order == "order-2" { 1..=2 } else { 1..=5 };
            applied.map(move |sequence| format!("{order} #{sequence}"))
        })
        .collect();
    if lines != expected {
        return Err(format!("the orders table holds {lines:?}, expected {expected:?}").into());
    }
    println!(
        "{} messages acked after their commit, every line applied once, in order",
        events.len()
    );
    Ok(())
}

fn lines(connection: &Connection) -> rusqlite::Result<Vec<String>> {
    let sql = "SELECT order_id, sequence FROM orders ORDER BY rowid";
    let mut statement = connection.prepare(sql)?;
    let rows = statement.query_map([], |row| {
        Ok(format!(
            "{} #{}",
            row.get::<_, String>(0)?,
            row.get::<_, i64>(1)?
        ))
    })?;
    let mut lines = rows.collect::<rusqlite::Result<Vec<_>>>()?;
    // Orders commit interleaved; within an order, `rowid` is the order of application.
    lines.sort_by(|a, b| a.split(" #").next().cmp(&b.split(" #").next()));
    Ok(lines)
}
