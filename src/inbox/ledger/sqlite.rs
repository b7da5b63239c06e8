//! The ledger on SQLite: `apply` on the writer's connection, in the inbox's unit, and the
//! trigger that fills `ordered_inbox.amount`.

use ordered_inbox::sqlite::SqliteHandler;
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedMessage};
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;

use super::{Ledger, applicable, applied, state};

/// Adds an amount to the aggregate's total, creating its row if the inbox has not yet (it
/// writes the row's position right after, and keeps the total). Amounts are never negative, so
/// the total only grows; it stops at `i64::MAX` rather than overflow.
const ADD_AMOUNT: &str = "
INSERT INTO aggregate_state(aggregate_id, last_sequence, total) VALUES (?1, 0, ?2)
ON CONFLICT(aggregate_id) DO UPDATE SET
    total = CASE WHEN total > 9223372036854775807 - excluded.total THEN 9223372036854775807
                 ELSE total + excluded.total END
RETURNING total";

const TOTAL: &str = "SELECT total FROM aggregate_state WHERE aggregate_id = ?1";

/// `ordered_inbox.amount`, which the seed's readers (and the console) show, from the stored
/// content the inbox writes: the inbox keeps the column but no longer fills it. The content is
/// the ledger's canonical JSON, whose `Amount` is a whole number.
const AMOUNT_TRIGGER: &str = "
CREATE TRIGGER IF NOT EXISTS ledger_amount AFTER INSERT ON ordered_inbox
WHEN NEW.amount IS NULL
BEGIN
    UPDATE ordered_inbox SET amount = json_extract(NEW.payload, '$.Amount')
     WHERE rowid = NEW.rowid;
END;";

/// The ledger's schema beside the inbox's, after the inbox's migrations (which may rebuild
/// `ordered_inbox`, and its triggers with it): idempotent, run at every start.
pub fn migrate(connection: &Connection) -> rusqlite::Result<()> {
    connection.execute_batch(AMOUNT_TRIGGER)
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
        let total = connection
            .prepare_cached(ADD_AMOUNT)?
            .query_row(params![message.aggregate_id, amount], |row| row.get(0))?;
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
