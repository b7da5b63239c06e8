//! A NATS JetStream pull consumer in front of the ordered inbox on SQLite. Order events are
//! published to `orders.{order}` as `{"messageId", "sequence", "payload": {"sku", "quantity"}}`;
//! the consumer hands each fetched batch to the inbox in one `deliver_batch` (one commit) through
//! the broker's door, which holds an event that is ahead of its turn until its predecessor
//! arrives, and the handler writes each applied line into the `orders` table in that commit.
//! Each message is answered only after the COMMIT: acked once recorded, nak'd when the handler
//! failed (it comes back), terminated when it can never be recorded.
//!
//! ```sh
//! # Checks itself on a private nats-server (Debian package `nats-server`): publishes shuffled
//! # events with duplicates and a poison one, consumes until each is answered, checks the table.
//! cargo run -p ordered-inbox --example jetstream_orders
//! # Consumes the stream ORDERS of the server at URL until Ctrl+C.
//! cargo run -p ordered-inbox --example jetstream_orders -- --nats nats://127.0.0.1:4222 --database orders.db
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, Message, stream};
use futures_util::StreamExt;
use ordered_inbox::sqlite::{SqliteHandler, SqliteInbox, StoreError, WriterConnection};
use ordered_inbox::{
    ApplyOutcome, BatchDelivery, Check, Door, HandlerError, Inbox, OrderedInbox, OrderedMessage,
    Outcome, Poison, Undelivered,
};
use rusqlite::Connection;
use serde::Deserialize;
use serde_json::json;

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
// The consumer: one batch, one commit, then the answers.

/// What a message of the stream carries; its order is the subject's last token.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    message_id: String,
    sequence: i64,
    payload: serde_json::Value,
}

const SUBJECTS: &str = "orders.*";
const BATCH: usize = 64;
/// How long a nak'd message waits before it is delivered again.
const REDELIVERY: Duration = Duration::from_secs(1);

/// Fetches, delivers and answers batches until `done` says so (after a batch) or the process is
/// stopped, and counts its answers.
async fn consume(
    consumer: &PullConsumer,
    inbox: &SqliteInbox,
    done: impl Fn(&Answered) -> bool,
) -> Result<Answered, Failure> {
    let mut answered = Answered::default();
    while !done(&answered) {
        let batch = consumer
            .batch()
            .max_messages(BATCH)
            .expires(Duration::from_secs(1));
        let messages: Vec<Message> = batch
            .messages()
            .await?
            .filter_map(async |message| message.ok())
            .collect()
            .await;
        let kinds = deliver(inbox, &messages).await;
        for (message, kind) in messages.iter().zip(kinds) {
            answered.count(&kind);
            if let Err(error) = message.ack_with(kind).await {
                // Not fatal: the stream delivers it again after its ack wait, and the inbox
                // answers that delivery as a replay.
                eprintln!("jetstream_orders: an answer was lost: {error}");
            }
        }
    }
    Ok(answered)
}

/// Delivers the batch's readable messages in one call and decides each message's answer.
async fn deliver(inbox: &SqliteInbox, messages: &[Message]) -> Vec<AckKind> {
    let read: Vec<Option<OrderedMessage>> = messages.iter().map(ordered).collect();
    let deliveries = read.iter().flatten().cloned();
    let deliveries = deliveries.map(|message| BatchDelivery::anonymous(message, Door::Broker));
    // `Ok` once the batch committed; an `Err` committed none of it.
    let mut answers = match inbox.deliver_batch(deliveries.collect()).await {
        Ok(verdicts) => verdicts.iter().map(answer).collect(),
        Err(_) => Vec::new(),
    }
    .into_iter();
    let answer = |read: &Option<OrderedMessage>| match read {
        // Unreadable: it never will be.
        None => AckKind::Term,
        Some(_) => answers.next().unwrap_or(AckKind::Nak(Some(REDELIVERY))),
    };
    read.iter().map(answer).collect()
}

fn ordered(message: &Message) -> Option<OrderedMessage> {
    let order = message.subject.as_str().strip_prefix("orders.")?;
    let event: Event = serde_json::from_slice(&message.payload).ok()?;
    Some(OrderedMessage {
        message_id: event.message_id,
        aggregate_id: order.to_owned(),
        sequence: event.sequence,
        payload: event.payload,
    })
}

fn answer(verdict: &Result<Outcome, Undelivered>) -> AckKind {
    match verdict {
        // Recorded: applied, applied before, held for its turn, or a dead letter.
        Ok(
            Outcome::Applied { .. }
            | Outcome::Replay { .. }
            | Outcome::Held { .. }
            | Outcome::Quarantined { .. },
        ) => AckKind::Ack,
        // Never recordable as it is.
        Ok(Outcome::Stale { .. } | Outcome::PayloadConflict) | Err(Undelivered::Refused(_)) => {
            AckKind::Term
        }
        // Not recorded now (a bound was reached, or the handler failed): it comes back.
        Ok(Outcome::Gap { .. } | Outcome::HoldFull { .. } | Outcome::QuarantineFull { .. })
        | Err(Undelivered::Handler(_)) => AckKind::Nak(Some(REDELIVERY)),
    }
}

#[derive(Debug, Default)]
struct Answered {
    acked: usize,
    terminated: usize,
    nakd: usize,
}

impl Answered {
    fn count(&mut self, kind: &AckKind) {
        match kind {
            AckKind::Ack => self.acked += 1,
            AckKind::Term => self.terminated += 1,
            _ => self.nakd += 1,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Plumbing: the inbox, the stream and its durable consumer, and the self-check.

type Failure = Box<dyn std::error::Error + Send + Sync>;

async fn open_inbox(path: &Path) -> Result<SqliteInbox, StoreError> {
    OrderedInbox::sqlite(path)
        .handler(OrderLines)
        .migrate(|connection| connection.execute_batch(ORDERS_TABLE))
        .open()
        .await
}

async fn open_consumer(client: async_nats::Client) -> Result<PullConsumer, Failure> {
    let stream = jetstream::new(client)
        .get_or_create_stream(stream::Config {
            name: "ORDERS".to_owned(),
            subjects: vec![SUBJECTS.to_owned()],
            ..Default::default()
        })
        .await?;
    let config = pull::Config {
        durable_name: Some("orders-inbox".to_owned()),
        ack_policy: AckPolicy::Explicit,
        ..Default::default()
    };
    Ok(stream
        .get_or_create_consumer("orders-inbox", config)
        .await?)
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
    let inbox = open_inbox(&database.unwrap_or_else(|| directory.path().join("orders.db"))).await?;
    let outcome = match nats {
        Some(url) => consume_until_stopped(&url, &inbox).await,
        None => check_itself(&inbox).await,
    };
    inbox.shutdown().await;
    outcome
}

async fn consume_until_stopped(url: &str, inbox: &SqliteInbox) -> Result<(), Failure> {
    let consumer = open_consumer(async_nats::connect(url).await?).await?;
    println!("consuming {SUBJECTS} at {url}");
    tokio::select! {
        consumed = consume(&consumer, inbox, |_| false) => consumed.map(|_| ()),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}

/// Publishes three orders' events shuffled, with duplicates and a poison line, consumes until
/// every message is answered and checks the table.
async fn check_itself(inbox: &SqliteInbox) -> Result<(), Failure> {
    let server = tokio::task::spawn_blocking(|| lab_testkit::nats::NatsServer::start(None));
    let server = server.await??;
    let client = server.connect().await?;
    let consumer = open_consumer(client.clone()).await?;

    let mut events = Vec::new();
    for order in ["order-1", "order-2", "order-3"] {
        for sequence in 1..=5 {
            // order-2's third line is poison: its dead letter blocks order-2 from there on.
            let quantity = if (order, sequence) == ("order-2", 3) {
                0
            } else {
                sequence
            };
            let payload = json!({ "sku": "tea", "quantity": quantity });
            let event = json!({ "messageId": format!("{order}-{sequence}"), "sequence": sequence, "payload": payload });
            events.push((format!("orders.{order}"), event.to_string()));
        }
    }
    // Without a `Nats-Msg-Id` header the stream keeps duplicates: the inbox recognises them.
    events.extend(events.clone().into_iter().step_by(2));
    rand::seq::SliceRandom::shuffle(events.as_mut_slice(), &mut rand::rng());
    let context = jetstream::new(client);
    for (subject, event) in &events {
        context
            .publish(subject.clone(), event.clone().into())
            .await?
            .await?;
    }

    let all_acked = |answered: &Answered| answered.acked >= events.len();
    let consumed = tokio::time::timeout(
        Duration::from_secs(60),
        consume(&consumer, inbox, all_acked),
    );
    let answered = consumed
        .await
        .map_err(|_| "not every message was acked in time")??;
    if answered.acked != events.len() || answered.terminated + answered.nakd > 0 {
        return Err(format!("{} published, answered {answered:?}", events.len()).into());
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
