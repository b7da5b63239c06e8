//! # ordered-inbox
//!
//! A per-aggregate ordered inbox in front of an application's own handler: each aggregate's
//! messages apply in sequence order, exactly once, and the application's handler runs for each
//! of them inside the inbox's own transaction, so the inbox's rows and the application's rows
//! commit together or not at all. It keeps its state in a SQLite file or a PostgreSQL database,
//! beside the application's own tables.
//!
//! A message is an identity (`message_id`), a position (`aggregate_id`, `sequence`) and a JSON
//! payload the inbox does not interpret ([`OrderedMessage`]).
//!
//! ## A handler of one's own, opened with the builder
//!
//! An order book: an order with a negative quantity is poison (the pure [`Check`]), and applying
//! an order writes the application's `orders` table in the inbox's transaction
//! ([`sqlite::SqliteHandler::apply`]), reporting a short detail that the timeline shows.
//! [`OrderedInbox::sqlite`] opens the inbox with it: the inbox's migrations, then the
//! application's own, in one file.
//!
//! ```
//! use ordered_inbox::sqlite::{SqliteHandler, StoreError, WriterConnection};
//! use ordered_inbox::{
//!     ApplyOutcome, Check, Door, HandlerError, Inbox, Limits, OrderedInbox, OrderedMessage,
//!     Outcome, Poison,
//! };
//! use rusqlite::Connection;
//! use serde_json::json;
//!
//! struct OrderBook;
//!
//! impl Check for OrderBook {
//!     fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
//!         match message.payload["quantity"].as_i64() {
//!             Some(quantity) if quantity > 0 => Ok(()),
//!             _ => Err(Poison::new("no quantity")),
//!         }
//!     }
//! }
//!
//! impl SqliteHandler for OrderBook {
//!     fn apply(
//!         &self,
//!         connection: &WriterConnection<'_>,
//!         message: &OrderedMessage,
//!     ) -> Result<ApplyOutcome, HandlerError> {
//!         let sku = message.payload["sku"].as_str().unwrap_or_default();
//!         let quantity = message.payload["quantity"].as_i64().unwrap_or_default();
//!         // `prepared`: a statement of fixed SQL, prepared once for the writer's life.
//!         connection
//!             .prepared(
//!                 "INSERT INTO orders(message_id, customer, sku, quantity)
//!                  VALUES (?1, ?2, ?3, ?4)",
//!             )?
//!             .execute((&message.message_id, &message.aggregate_id, sku, quantity))?;
//!         let lines: i64 = connection.query_row(
//!             "SELECT COUNT(*) FROM orders WHERE customer = ?1",
//!             [&message.aggregate_id],
//!             |row| row.get(0),
//!         )?;
//!         let detail = json!({ "lines": lines });
//!         Ok(ApplyOutcome::Applied { detail: detail.as_object().cloned().unwrap_or_default() })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let inbox = OrderedInbox::sqlite(dir.path().join("shop.db"))
//!     .handler(OrderBook)
//!     .limits(Limits::default())
//!     // The application's own tables, in the same file; run at every open, after the inbox's.
//!     .migrate(|connection| {
//!         connection.execute_batch(
//!             "CREATE TABLE IF NOT EXISTS orders(message_id TEXT PRIMARY KEY, customer TEXT,
//!                                                sku TEXT, quantity INTEGER)",
//!         )
//!     })
//!     .open()
//!     .await?;
//! let order = |id: &str, sequence, quantity| OrderedMessage {
//!     message_id: id.into(),
//!     aggregate_id: "customer-7".into(),
//!     sequence,
//!     payload: json!({ "sku": "tea", "quantity": quantity }),
//! };
//!
//! let first = inbox.deliver(order("o-1", 1, 2), Door::General).await?;
//! assert!(matches!(first, Outcome::Applied { sequence: 1, ref detail, .. } if detail["lines"] == 1));
//! // Delivered again: a replay, and the handler does not run twice.
//! let again = inbox.deliver(order("o-1", 1, 2), Door::General).await?;
//! assert!(matches!(again, Outcome::Replay { .. }));
//! // Ahead of its turn: a gap; nothing applies, nothing is written to `orders`.
//! assert_eq!(inbox.deliver(order("o-3", 3, 1), Door::General).await?, Outcome::Gap { expected: 2 });
//! // Poison: a dead letter that blocks the customer's sequence.
//! let poison = inbox.deliver(order("o-2", 2, 0), Door::General).await?;
//! assert!(matches!(poison, Outcome::Quarantined { expected: 2, ref reason, .. } if reason.as_str() == "no quantity"));
//!
//! let count = |connection: &Connection| {
//!     connection.query_row("SELECT COUNT(*) FROM orders", [], |row| row.get(0))
//! };
//! let orders: i64 = inbox.store().read(move |connection| count(connection).map_err(StoreError::from)).await?;
//! assert_eq!(orders, 1);
//! inbox.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! On PostgreSQL the same check goes with a `postgres::PostgresHandler`, whose `apply` gets the
//! client inside the open transaction (a `postgres::HandlerClient`, with a statement cache per
//! connection), and `OrderedInbox::postgres(url).handler(..).migrate(sql).open()` opens it
//! (`postgres::builder::PostgresBuilder`). Handlers may also define what "the same content"
//! means ([`Check::canonical`], see [`content`]); the default is the payload's canonical JSON.
//!
//! ## Guarantees
//!
//! - **Order per aggregate.** An aggregate's messages apply in sequence order, one after the
//!   other; aggregates are independent. One ahead of its turn is a *gap*, one behind it is
//!   *stale*; neither applies.
//! - **Exactly once.** The handler's `apply` runs in the inbox's transaction, so a message's
//!   inbox row and the application's rows commit together or not at all; a message delivered
//!   again is a *replay* and the handler does not run again.
//! - **Identity.** A message id never changes meaning, across applied messages, dead letters and
//!   held messages alike: the same id with other content is a conflict
//!   ([`Outcome::PayloadConflict`]) and changes nothing.
//! - **Dead letters.** A poison message (the handler says why) at the expected sequence becomes
//!   a *dead letter* and blocks its aggregate until a corrected message under a new id takes the
//!   sequence or an *operator* resolves it (skip or replace), with an audit row.
//! - **Held messages through the broker's door.** Through [`Door::Broker`] a message ahead of
//!   its turn is *held* rather than refused: recorded, and applied (or quarantined) in sequence
//!   order in the same transaction as the predecessor that makes it next, whichever door or
//!   resolution that came through. A batch of deliveries ([`Inbox::deliver_batch`]) costs one
//!   transaction.
//! - **Evidence.** Every change and every rejection is on the aggregate's *timeline*; the
//!   views read back aggregates, the inventory, dead letters and the audit trail.
//!
//! ## Feature flags
//!
//! - `sqlite` (on by default): the [`sqlite`] backend, one file with a group-commit writer.
//! - `postgres`: the `postgres` backend, one database shared by several server processes,
//!   with TLS to a server on another host.
//! - `openapi`: JSON Schema descriptions (utoipa `ToSchema`) of the views and statuses, for a
//!   server that publishes an OpenAPI document of its answers.
//! - `jetstream`: the `jetstream` module's consumer, which hands each fetched batch of a JetStream
//!   pull consumer to [`Inbox::deliver_batch`] through the broker's door and acks, naks or
//!   terminates each message only after the COMMIT that recorded its fate.
//! - `testing`: for testing only. Makes the pure core's decisions (`decide_delivery`,
//!   `decide_resolution`, …), their facts and their change plans public, for a simulator's or a
//!   property test's direct calls; never for a real build.
//! - `planted-bugs`: for testing only. Makes the `planted` module public, whose known bugs a
//!   simulator's tests plant one at a time to show that they are caught; never for a real
//!   build.
//!
//! ## Examples
//!
//! `examples/` holds three programs that `cargo test` builds and runs: run without arguments,
//! each checks itself against real services and exits non-zero on a mismatch.
//!
//! - `orders_sqlite`: an axum service, `POST /orders/{order}/events`, whose handler writes each
//!   order line into the application's `orders` table in the inbox's SQLite transaction; a
//!   poison from `check`, and one from `apply` after it wrote its row (the row goes with the
//!   savepoint). `cargo run -p ordered-inbox --example orders_sqlite`; with
//!   `-- --listen ADDR --database PATH` it serves.
//! - `orders_postgres`: the same door and check on PostgreSQL, `apply` writing through the
//!   client of the inbox's open transaction. `--database-url URL`, or a private cluster.
//! - `jetstream_orders`: a JetStream pull consumer that hands each fetched batch to
//!   [`Inbox::deliver_batch`] through the broker's door and acks each message after the COMMIT
//!   (a nak for a handler failure, a termination for a rejection), on a private nats-server or
//!   `--nats URL`.
//!
//! The crash tests (`tests/kill.rs`) SIGKILL the two order services under concurrent load and
//! restart them on the same database: every acknowledged event has its inbox row and its
//! `orders` row, none has one without the other, and none is doubled.
//!
//! ## Layout
//!
//! The crate is a functional core with storage behind one seam. Its modules import one way,
//! from the decisions down to the values they share:
//!
//! - [`OrderedInbox`]: the way in, a builder per backend.
//! - [`model`], [`error`]: the typed values (messages, doors, statuses, stored enums, limits)
//!   and the failures.
//! - [`content`]: what the application says about content: [`Check`], [`Poison`],
//!   [`ApplyOutcome`], the canonical form, the default handler [`AcceptAll`].
//! - [`records`], [`timeline`], `facts`, `change`: what the decisions write and read: the
//!   audit and ownership records, the timeline's entries, the facts a backend reads, the change
//!   plan a backend writes (the last two public only with `testing`).
//! - [`policy`]: the ordering rule for one sequence against the last applied one.
//! - [`rejected`], [`producers`]: held messages that may no longer apply; who may write an
//!   aggregate's sequence (producer sessions and epochs, ownership and its transfer).
//! - [`delivery`], [`resolution`]: the decisions of a delivery and of an operator's resolution:
//!   facts in, verdict and changes out.
//! - [`views`]: the evidence read back (aggregate, inventory, dead letters, audit trail).
//! - [`retention`]: what a store keeps and for how long; the cut-offs of a batch of pruning.
//! - [`operators`]: tokens and names of the people who may resolve.
//! - [`inbox`]: the [`Inbox`] trait every backend implements (async; a backend reads facts,
//!   writes the decided changes and runs the handler in one transaction serialized per
//!   aggregate).
//! - [`sqlite`] (feature `sqlite`, on by default): one writer thread with group commit (a
//!   savepoint per unit only when a unit fails), read connections, the inbox's schema.
//! - `postgres` (feature `postgres`): for several server processes on one database: a
//!   connection pool, one transaction per operation serialized per aggregate by advisory and
//!   row locks, pipelined prepared statements, versioned migrations.
//! - `jetstream` (feature `jetstream`): the JetStream consumer that acks after the COMMIT.
//! - [`clock`]: the stored timestamp format.
//!
//! The two backends are the only modules that know SQL; neither holds an ordering rule. Nothing
//! here speaks HTTP: verdicts, conflicts and refusals are enums, and a server words them. Nor
//! does anything here know what a payload means: that is the handler's.

#![warn(missing_docs)]

#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod builder;
#[cfg(feature = "testing")]
pub mod change;
#[cfg(not(feature = "testing"))]
mod change;
pub mod clock;
pub mod content;
pub mod delivery;
pub mod error;
#[cfg(feature = "testing")]
pub mod facts;
#[cfg(not(feature = "testing"))]
mod facts;
pub mod gaps;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod handling;
pub mod inbox;
#[cfg(feature = "jetstream")]
pub mod jetstream;
pub mod model;
pub mod operators;
#[cfg(feature = "planted-bugs")]
pub mod planted;
#[cfg(not(feature = "planted-bugs"))]
mod planted;
pub mod policy;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod producers;
pub mod records;
pub mod rejected;
pub mod resolution;
pub mod retention;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod timeline;
pub mod views;

#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use builder::OrderedInbox;
pub use content::{AcceptAll, ApplyOutcome, Check, Detail, Poison};
pub use delivery::Outcome;
pub use error::{HandlerError, InboxError};
pub use inbox::{BatchDelivery, Inbox, InboxReads, Undelivered};
pub use model::{AggregateStatus, Door, Limits, OrderedMessage};
