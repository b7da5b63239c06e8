//! The ledger on SQLite: `apply` on the writer's connection, in the inbox's unit, and the
//! virtual column `ordered_inbox.amount`.

use ordered_inbox::sqlite::SqliteHandler;
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedMessage};
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;

use super::{Ledger, applicable, applied, state};

/// The aggregate's new total, on the row the facts already read (the inbox writes the row's
/// position right after, and keeps the total). Two plain statements: SQLite collects the row of
/// an `… RETURNING` in a temporary table, which cost more than the read and the write together.
const SET_TOTAL: &str = "UPDATE aggregate_state SET total = ?2 WHERE aggregate_id = ?1";
/// The row of an aggregate's first apply, which the inbox has not written yet.
const FIRST_TOTAL: &str =
    "INSERT INTO aggregate_state(aggregate_id, last_sequence, total) VALUES (?1, 0, ?2)";

const TOTAL: &str = "SELECT total FROM aggregate_state WHERE aggregate_id = ?1";

/// `ordered_inbox.amount`, which the seed's readers (and the console) show: a virtual column
/// computed from the stored content, the ledger's canonical JSON, whose `Amount` is a whole
/// number. The inbox keeps the column but no longer fills it; computed when read, it costs a
/// delivery nothing (a trigger filling it cost each insert an update and a statement journal).
/// Every row the ledger ever wrote carries its amount in its content, so the values are the same.
const AMOUNT_COLUMN: &str = "
DROP TRIGGER IF EXISTS ledger_amount;
ALTER TABLE ordered_inbox DROP COLUMN amount;
ALTER TABLE ordered_inbox ADD COLUMN amount INTEGER
    GENERATED ALWAYS AS (json_extract(payload, '$.Amount')) VIRTUAL;";

/// The ledger's schema beside the inbox's, after the inbox's migrations (which may rebuild
/// `ordered_inbox`, and its columns with it): idempotent, run at every start, in one
/// transaction.
pub fn migrate(connection: &Connection) -> rusqlite::Result<()> {
    // `hidden` is 2 for a virtual generated column.
    let generated: bool = connection.query_row(
        "SELECT hidden = 2 FROM pragma_table_xinfo('ordered_inbox') WHERE name = 'amount'",
        [],
        |row| row.get(0),
    )?;
    if generated {
        return Ok(());
    }
    connection.execute_batch(&format!("BEGIN IMMEDIATE; {AMOUNT_COLUMN} COMMIT;"))
}

impl SqliteHandler for Ledger {
    fn apply(
        &self,
        connection: &Connection,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let amount = match applicable(message) {
            Ok(amount) => amount,
            Err(poison) => return Ok(poison),
        };
        let current: Option<i64> = connection
            .prepare_cached(TOTAL)?
            .query_row([&message.aggregate_id], |row| row.get(0))
            .optional()?;
        // Amounts are never negative, so the total only grows; it stops at `i64::MAX` rather
        // than overflow.
        let total = current.unwrap_or(0).saturating_add(amount);
        let write = if current.is_some() {
            SET_TOTAL
        } else {
            FIRST_TOTAL
        };
        connection
            .prepare_cached(write)?
            .execute(params![message.aggregate_id, total])?;
        Ok(applied(amount, total))
    }

    fn state(
        &self,
        connection: &Connection,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let total: Option<i64> = connection
            .prepare_cached(TOTAL)?
            .query_row([aggregate_id], |row| row.get(0))
            .optional()?;
        Ok(total.map(state))
    }
}
