//! The ledger on SQLite: `apply` on the writer's connection, in the inbox's unit, and the
//! virtual column `ordered_inbox.amount`.

use std::cell::Cell;

use ordered_inbox::sqlite::{SqliteHandler, WriterConnection};
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedMessage};
use rusqlite::functions::FunctionFlags;
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;

use super::{Ledger, applicable, applied, state};

/// The aggregate's new total, on the row the facts already read (the inbox writes the row's
/// position right after, and keeps the total), in one statement prepared for the writer's life:
/// `ledger_add` (see [`register_functions`]) adds the amount and hands the new total back to
/// `apply` on the way.
/// Reading the total first cost a statement of its own; `… RETURNING` cost more than both, as
/// SQLite collects the returned rows in a temporary table first.
const ADD_TOTAL: &str =
    "UPDATE aggregate_state SET total = ledger_add(total, ?2) WHERE aggregate_id = ?1";
/// The row of an aggregate's first apply, which the inbox has not written yet.
const FIRST_TOTAL: &str =
    "INSERT INTO aggregate_state(aggregate_id, last_sequence, total) VALUES (?1, 0, ?2)";

const TOTAL: &str = "SELECT total FROM aggregate_state WHERE aggregate_id = ?1";

/// `ordered_inbox.amount`, which the seed's readers (and the console) show: a virtual column
/// computed from the stored content. The inbox keeps the column but no longer fills it (a
/// trigger filling it cost each insert an update and a statement journal).
///
/// SQLite computes a table's generated columns at every insert, so the expression is on each
/// delivery's path: it reads the integer after the key `"Amount":` rather than parsing the JSON
/// (`json_extract` was a fifth of the ledger's cost per delivery). That is the same value for
/// every row the ledger writes or ever wrote: the stored content is the ledger's own
/// serialization, `{"AggregateId":…,"Sequence":…,"Amount":N}` (the seed's rows, from before the
/// library, are `{"MessageId":…,"AggregateId":…,"Sequence":…,"Amount":N}`), where `"Amount":`
/// appears once, as that key (inside a JSON string a quote is escaped, so the text cannot occur
/// there), and `N` is a whole number; without the key it is NULL, as `json_extract` was.
/// `tests::the_amount_column_reads_what_json_extract_reads` holds the two side by side.
const AMOUNT_EXPRESSION: &str =
    r#"CAST(substr(payload, nullif(instr(payload, '"Amount":'), 0) + 9) AS INTEGER)"#;

/// Replaces whatever `amount` is (a plain column with a trigger, or an earlier expression).
fn amount_column() -> String {
    format!(
        "DROP TRIGGER IF EXISTS ledger_amount;
         ALTER TABLE ordered_inbox DROP COLUMN amount;
         ALTER TABLE ordered_inbox ADD COLUMN amount INTEGER
             GENERATED ALWAYS AS ({AMOUNT_EXPRESSION}) VIRTUAL;"
    )
}

/// The ledger's schema beside the inbox's, after the inbox's migrations (which may rebuild
/// `ordered_inbox`, and its columns with it): idempotent, run at every start, in one
/// transaction; and its function `ledger_add` on `connection`, which must be the writer's (the
/// store runs its migrations on the connection its writer then keeps, where `apply` runs).
pub fn migrate(connection: &Connection) -> rusqlite::Result<()> {
    register_functions(connection)?;
    // `hidden` is 2 for a virtual generated column; the table's text holds its expression.
    let current: bool = connection.query_row(
        "SELECT hidden = 2 AND instr((SELECT sql FROM sqlite_master WHERE name = 'ordered_inbox'), ?1)
           FROM pragma_table_xinfo('ordered_inbox') WHERE name = 'amount'",
        [AMOUNT_EXPRESSION],
        |row| row.get(0),
    )?;
    if current {
        return Ok(());
    }
    connection.execute_batch(&format!("BEGIN IMMEDIATE; {} COMMIT;", amount_column()))
}

thread_local! {
    /// The total `ledger_add` computed last on this thread: SQLite runs a statement's functions
    /// on the thread that steps it, and the writer steps one statement at a time.
    static ADDED: Cell<Option<i64>> = const { Cell::new(None) };
}

/// `ledger_add(total, amount)`: the total plus the amount, stopping at `i64::MAX` rather than
/// overflowing (amounts are never negative, so the total only grows), noted for `apply`.
/// Registered on the writer's connection by [`migrate`], which runs on it.
fn register_functions(connection: &Connection) -> rusqlite::Result<()> {
    connection.create_scalar_function(
        "ledger_add",
        2,
        FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DIRECTONLY,
        |context| {
            let total = context
                .get::<i64>(0)?
                .saturating_add(context.get::<i64>(1)?);
            ADDED.set(Some(total));
            Ok(total)
        },
    )
}

impl SqliteHandler for Ledger {
    fn apply(
        &self,
        connection: &WriterConnection<'_>,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let amount = match applicable(message) {
            Ok(amount) => amount,
            Err(poison) => return Ok(poison),
        };
        ADDED.set(None);
        let updated = connection
            .prepared(ADD_TOTAL)?
            .execute(params![message.aggregate_id, amount])?;
        let total = if updated == 0 {
            connection
                .prepared(FIRST_TOTAL)?
                .execute(params![message.aggregate_id, amount])?;
            amount
        } else {
            ADDED
                .take()
                .ok_or_else(|| HandlerError::new("ledger_add did not report the new total"))?
        };
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

#[cfg(test)]
mod tests {
    use ordered_inbox::Check;
    use serde_json::json;

    use super::*;

    fn ledger_content(aggregate_id: &str, amount: i64) -> String {
        let message = OrderedMessage {
            message_id: "m-1".into(),
            aggregate_id: aggregate_id.into(),
            sequence: 3,
            payload: json!({ "Amount": amount }),
        };
        Ledger.canonical(&message)
    }

    #[test]
    fn the_amount_column_reads_what_json_extract_reads() {
        let connection = Connection::open_in_memory().unwrap();
        let mut contents: Vec<String> = [
            "acct-1",
            r#"x"Amount":7"#,
            r#"x\"Amount"#,
            "\"Amount\"",
            "Amount\":9,\"",
            "ünï\u{1F600}",
            "",
        ]
        .iter()
        .flat_map(|id| [0, 1, 20, i64::MAX].map(|amount| ledger_content(id, amount)))
        .collect();
        contents.extend(
            [
                r#"{"MessageId":"m-1","AggregateId":"demo","Sequence":1,"Amount":1}"#,
                r#"{"MessageId":"m-2","AggregateId":"demo","Sequence":2,"Amount": -3 }"#,
                r#"{"MessageId":"m-3","AggregateId":"demo","Sequence":3}"#,
                "{}",
            ]
            .map(str::to_owned),
        );
        let sql = format!(
            "SELECT {AMOUNT_EXPRESSION}, json_extract(payload, '$.Amount') FROM (SELECT ?1 AS payload)"
        );
        for content in &contents {
            let (ours, extracted): (Option<i64>, Option<i64>) = connection
                .query_row(&sql, [content], |row| Ok((row.get(0)?, row.get(1)?)))
                .unwrap();
            assert_eq!(ours, extracted, "{content}");
        }
        assert!(contents.iter().filter(|c| c.contains("Amount")).count() > 20);
    }

    #[test]
    fn migrate_replaces_an_earlier_amount_column_and_keeps_the_values() {
        let connection = Connection::open_in_memory().unwrap();
        connection
            .execute_batch(
                r#"CREATE TABLE ordered_inbox(message_id TEXT PRIMARY KEY, payload TEXT NOT NULL);
                   ALTER TABLE ordered_inbox ADD COLUMN amount INTEGER
                       GENERATED ALWAYS AS (json_extract(payload, '$.Amount')) VIRTUAL;
                   INSERT INTO ordered_inbox(message_id, payload)
                       VALUES ('m-1', '{"AggregateId":"a","Sequence":1,"Amount":20}');"#,
            )
            .unwrap();
        migrate(&connection).unwrap();
        migrate(&connection).unwrap();
        let (table, amount): (String, i64) = connection
            .query_row(
                "SELECT (SELECT sql FROM sqlite_master WHERE name = 'ordered_inbox'), amount
                   FROM ordered_inbox",
                [],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .unwrap();
        assert!(table.contains(AMOUNT_EXPRESSION), "{table}");
        assert!(!table.contains("json_extract"), "{table}");
        assert_eq!(amount, 20);
    }

    #[test]
    fn apply_adds_the_amount_in_one_statement_and_answers_the_new_total() {
        let connection = Connection::open_in_memory().unwrap();
        connection
            .execute_batch(
                "CREATE TABLE aggregate_state(aggregate_id TEXT PRIMARY KEY,
                     last_sequence INTEGER NOT NULL, total INTEGER NOT NULL DEFAULT 0);",
            )
            .unwrap();
        register_functions(&connection).unwrap();
        let writer = WriterConnection::new(&connection);
        let message = |amount: i64| OrderedMessage {
            message_id: format!("m-{amount}"),
            aggregate_id: "acct".into(),
            sequence: 1,
            payload: json!({ "Amount": amount }),
        };
        let total_of = |outcome: ApplyOutcome| match outcome {
            ApplyOutcome::Applied { detail } => detail["total"].as_i64(),
            ApplyOutcome::Poison(poison) => panic!("{poison:?}"),
        };
        assert_eq!(
            total_of(Ledger.apply(&writer, &message(5)).unwrap()),
            Some(5)
        );
        assert_eq!(
            total_of(Ledger.apply(&writer, &message(7)).unwrap()),
            Some(12)
        );
        assert_eq!(
            total_of(Ledger.apply(&writer, &message(i64::MAX)).unwrap()),
            Some(i64::MAX)
        );
        let stored: i64 = connection
            .query_row("SELECT total FROM aggregate_state", [], |row| row.get(0))
            .unwrap();
        assert_eq!(stored, i64::MAX);
    }
}
