//! The SQLite tests' application: an order book whose handler writes its own tables in the
//! inbox's transaction.
//!
//! - `orders(message_id, aggregate_id, quantity)`: one row per applied order;
//! - `books(aggregate_id, ordered)`: the quantity ordered so far per aggregate, which the
//!   applied event's detail and the audit row's states show;
//! - `caps(aggregate_id, most)`: an order that would take the aggregate's book past `most` is
//!   poison, found by `apply` from what it reads (after it already wrote the order's row);
//! - `outage(aggregate_id)`: while it names the aggregate, `apply` fails (after it already wrote
//!   the order's row);
//! - `skips(aggregate_id, sequence, resolution_id, operator, reason)`: one row per sequence an
//!   operator's resolution skipped, which `skipped` writes.

use rusqlite::{Connection, OptionalExtension, params};
use serde_json::{Value, json};

use super::connection::WriterConnection;
use super::engine::Unit;
use super::handler::SqliteHandler;
use crate::content::{ApplyOutcome, Check, Detail, Poison};
use crate::error::HandlerError;
use crate::model::{Limits, OrderedMessage};
use crate::records::SkippedSequences;

/// The order book's tables.
pub(crate) const ORDER_TABLES: &str = "
CREATE TABLE IF NOT EXISTS orders(message_id TEXT PRIMARY KEY, aggregate_id TEXT NOT NULL,
                                  quantity INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS books(aggregate_id TEXT PRIMARY KEY, ordered INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS caps(aggregate_id TEXT PRIMARY KEY, most INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS outage(aggregate_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS skips(aggregate_id TEXT NOT NULL, sequence INTEGER NOT NULL,
                                 resolution_id INTEGER NOT NULL, operator TEXT NOT NULL,
                                 reason TEXT NOT NULL, PRIMARY KEY(aggregate_id, sequence));
";

/// The order book's handler: a negative quantity is poison ([`Check`]); applying writes the
/// order and the book's new figure.
pub(crate) struct Orders;

impl Check for Orders {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        match message.payload["quantity"].as_i64() {
            Some(quantity) if quantity >= 0 => Ok(()),
            _ => Err(Poison::new("negative quantity")),
        }
    }
}

impl SqliteHandler for Orders {
    fn apply(
        &self,
        connection: &WriterConnection<'_>,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let quantity = message.payload["quantity"].as_i64().unwrap_or(0);
        connection.execute(
            "INSERT INTO orders(message_id, aggregate_id, quantity) VALUES (?1, ?2, ?3)",
            params![message.message_id, message.aggregate_id, quantity],
        )?;
        let outage = connection
            .query_row(
                "SELECT 1 FROM outage WHERE aggregate_id = ?1",
                [&message.aggregate_id],
                |_| Ok(()),
            )
            .optional()?;
        if outage.is_some() {
            return Err(HandlerError::new("the order book is unavailable"));
        }
        let over_the_cap: bool = connection.query_row(
            "SELECT EXISTS(SELECT 1 FROM caps c LEFT JOIN books b USING (aggregate_id)
                            WHERE c.aggregate_id = ?1 AND IFNULL(b.ordered, 0) + ?2 > c.most)",
            params![message.aggregate_id, quantity],
            |row| row.get(0),
        )?;
        if over_the_cap {
            return Ok(ApplyOutcome::Poison(
                Poison::new("over the cap").with_detail(detail(json!({"quantity": quantity}))),
            ));
        }
        let ordered: i64 = connection.query_row(
            "INSERT INTO books(aggregate_id, ordered) VALUES (?1, ?2)
             ON CONFLICT(aggregate_id) DO UPDATE SET ordered = ordered + excluded.ordered
             RETURNING ordered",
            params![message.aggregate_id, quantity],
            |row| row.get(0),
        )?;
        Ok(ApplyOutcome::Applied {
            detail: detail(json!({"quantity": quantity, "ordered": ordered})),
        })
    }

    fn state(
        &self,
        connection: &Connection,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let ordered: Option<i64> = connection
            .query_row(
                "SELECT ordered FROM books WHERE aggregate_id = ?1",
                [aggregate_id],
                |row| row.get(0),
            )
            .optional()?;
        Ok(Some(json!({"ordered": ordered.unwrap_or(0)})))
    }

    fn skipped(
        &self,
        connection: &WriterConnection<'_>,
        skipped: &SkippedSequences,
    ) -> Result<(), HandlerError> {
        for sequence in skipped.range.from..=skipped.range.through {
            connection.execute(
                "INSERT INTO skips(aggregate_id, sequence, resolution_id, operator, reason)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    skipped.aggregate_id,
                    sequence,
                    skipped.resolution_id,
                    skipped.operator,
                    skipped.reason
                ],
            )?;
        }
        Ok(())
    }
}

/// The sequences the order book heard were skipped:
/// `aggregate_id|sequence|resolution_id|operator|reason`, in order.
pub(crate) fn skips(connection: &Connection) -> Vec<String> {
    let mut statement = connection
        .prepare(
            "SELECT aggregate_id, sequence, resolution_id, operator, reason FROM skips
              ORDER BY aggregate_id, sequence",
        )
        .expect("prepare");
    statement
        .query_map([], |row| {
            Ok(format!(
                "{}|{}|{}|{}|{}",
                row.get::<_, String>(0)?,
                row.get::<_, i64>(1)?,
                row.get::<_, i64>(2)?,
                row.get::<_, String>(3)?,
                row.get::<_, String>(4)?
            ))
        })
        .expect("query")
        .collect::<rusqlite::Result<_>>()
        .expect("rows")
}

pub(crate) fn detail(value: Value) -> Detail {
    match value {
        Value::Object(members) => members,
        _ => Detail::new(),
    }
}

/// An order of `quantity` for aggregate `aggregate`.
pub(crate) fn order(id: &str, aggregate: &str, sequence: i64, quantity: i64) -> OrderedMessage {
    OrderedMessage {
        message_id: id.into(),
        aggregate_id: aggregate.into(),
        sequence,
        payload: json!({ "quantity": quantity }),
    }
}

/// A private in-memory database with the inbox's schema and the order book's tables.
pub(crate) fn migrated() -> Connection {
    let connection = super::schema::migrated_in_memory();
    connection
        .execute_batch(ORDER_TABLES)
        .expect("create the order book's tables");
    connection
}

pub(crate) const LIMITS: Limits = Limits {
    max_open_dead_letters: 1000,
    max_held_per_aggregate: 1000,
};

/// A unit on `connection` with the order book's handler, stamped `now`.
pub(crate) fn unit<'a, 'c>(connection: &'a WriterConnection<'c>, now: &'a str) -> Unit<'a, 'c> {
    Unit {
        connection,
        handler: &Orders,
        limits: &LIMITS,
        now,
    }
}

/// The order book's rows: `message_id|aggregate_id|quantity`, by message id.
pub(crate) fn orders(connection: &Connection) -> Vec<String> {
    let mut statement = connection
        .prepare("SELECT message_id, aggregate_id, quantity FROM orders ORDER BY message_id")
        .expect("prepare");
    statement
        .query_map([], |row| {
            Ok(format!(
                "{}|{}|{}",
                row.get::<_, String>(0)?,
                row.get::<_, String>(1)?,
                row.get::<_, i64>(2)?
            ))
        })
        .expect("query")
        .collect::<rusqlite::Result<_>>()
        .expect("rows")
}
