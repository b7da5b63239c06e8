//! The ledger on PostgreSQL: `apply` through the client of the inbox's open transaction, and
//! the generated column `ordered_inbox.amount`.

use std::collections::HashMap;

use async_trait::async_trait;
use ordered_inbox::postgres::{HandlerClient, PostgresHandler, PostgresInbox, apply_one_by_one};
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedMessage};
use serde_json::Value;
use tokio_postgres::types::Type;

use super::{Ledger, applicable, applied, state};

/// As on SQLite; PostgreSQL refuses a bigint overflow, so the total stops at its largest.
const ADD_AMOUNT: &str = "
INSERT INTO aggregate_state(aggregate_id, last_sequence, total) VALUES ($1, 0, $2)
ON CONFLICT (aggregate_id) DO UPDATE SET
    total = CASE WHEN aggregate_state.total > 9223372036854775807 - excluded.total
                 THEN 9223372036854775807 ELSE aggregate_state.total + excluded.total END
RETURNING total";

/// A group's amounts added to their aggregates' totals in one statement; answers each
/// aggregate's total before it (the CTEs share one snapshot: `before` does not see the upsert).
const ADD_AMOUNTS: &str = "
WITH amounts AS (
    SELECT id, SUM(amount) AS added FROM unnest($1::text[], $2::bigint[]) AS a(id, amount)
     GROUP BY id),
before AS (
    SELECT aggregate_id, total FROM aggregate_state
     WHERE aggregate_id IN (SELECT id FROM amounts)),
upserted AS (
    INSERT INTO aggregate_state(aggregate_id, last_sequence, total)
    SELECT id, 0, LEAST(added, 9223372036854775807)::bigint FROM amounts
    ON CONFLICT (aggregate_id) DO UPDATE SET
        total = CASE WHEN aggregate_state.total > 9223372036854775807 - excluded.total
                     THEN 9223372036854775807 ELSE aggregate_state.total + excluded.total END)
SELECT m.id, COALESCE(b.total, 0) FROM amounts m LEFT JOIN before b ON b.aggregate_id = m.id";

const TOTAL: &str = "SELECT total FROM aggregate_state WHERE aggregate_id = $1";

/// `ordered_inbox.amount` from the stored content, as on SQLite: a stored generated column,
/// computed by PostgreSQL as the row is written (a `BEFORE INSERT` trigger filling it cost each
/// applied row a PL/pgSQL call, about a third of the row's insert). Every row the ledger ever
/// wrote carries its amount in its content, so the values are the same; the column moves to
/// the end of the row (nothing reads the table by position). Installed under a
/// transaction-scoped advisory lock and only when the column is not generated yet, so servers
/// starting together on one database convert it once.
const AMOUNT_COLUMN: &str = r#"
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('production-lab ledger'));
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                    WHERE attrelid = 'ordered_inbox'::regclass AND attname = 'amount'
                      AND attgenerated = 's') THEN
        DROP TRIGGER IF EXISTS ledger_amount ON ordered_inbox;
        DROP FUNCTION IF EXISTS ledger_amount();
        ALTER TABLE ordered_inbox DROP COLUMN amount;
        ALTER TABLE ordered_inbox ADD COLUMN amount bigint GENERATED ALWAYS AS (
            CASE WHEN (payload::jsonb ->> 'Amount') ~ '^-?[0-9]{1,18}$'
                 THEN (payload::jsonb ->> 'Amount')::bigint END) STORED;
    END IF;
END $$;
COMMIT;
"#;

/// The ledger's schema beside the inbox's (after the inbox's migrations): idempotent, run at
/// every start.
pub async fn install(inbox: &PostgresInbox) -> Result<(), String> {
    let client = inbox
        .pool()
        .get()
        .await
        .map_err(|error| error.to_string())?;
    client
        .batch_execute(AMOUNT_COLUMN)
        .await
        .map_err(|error| HandlerError::from(error).to_string())
}

/// The total `ADD_AMOUNT` returned.
fn returned_total(rows: &[tokio_postgres::Row]) -> Result<i64, HandlerError> {
    match rows.first() {
        Some(row) => Ok(row.try_get(0)?),
        None => Err(HandlerError::new("the ledger's total was not returned")),
    }
}

#[async_trait]
impl PostgresHandler for Ledger {
    async fn apply(
        &self,
        client: &HandlerClient,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let amount = match applicable(message) {
            Ok(amount) => amount,
            Err(poison) => return Ok(poison),
        };
        let add = client
            .prepare_typed_cached(ADD_AMOUNT, &[Type::TEXT, Type::INT8])
            .await?;
        let rows = client
            .query(&add, &[&message.aggregate_id, &amount])
            .await?;
        Ok(applied(amount, returned_total(&rows)?))
    }

    /// A group's applies in one statement: each aggregate's amounts added at once, and each
    /// message's total worked out from the total before (read by the same statement) in the
    /// group's order, as the upserts one by one would have left it (amounts are never
    /// negative once `check` passed them, so the cap at the largest bigint is the same).
    async fn apply_many(
        &self,
        client: &HandlerClient,
        messages: &[&OrderedMessage],
    ) -> Result<Vec<ApplyOutcome>, HandlerError> {
        // The applies end at the first poison, as the default's do.
        let mut amounts = Vec::with_capacity(messages.len());
        let mut poison = None;
        for message in messages {
            match applicable(message) {
                Ok(amount) if amount >= 0 => amounts.push(amount),
                Ok(_) => return apply_one_by_one(self, client, messages).await,
                Err(outcome) => {
                    poison = Some(outcome);
                    break;
                }
            }
        }
        let aggregates: Vec<&str> = messages[..amounts.len()]
            .iter()
            .map(|message| message.aggregate_id.as_str())
            .collect();
        // Prepared once per connection: planning this statement cost more than running it.
        let add = client
            .prepare_typed_cached(ADD_AMOUNTS, &[Type::TEXT_ARRAY, Type::INT8_ARRAY])
            .await?;
        let rows = client.query(&add, &[&aggregates, &amounts]).await?;
        let mut totals: HashMap<String, i64> = HashMap::with_capacity(rows.len());
        for row in &rows {
            totals.insert(row.try_get(0)?, row.try_get(1)?);
        }
        let mut outcomes = Vec::with_capacity(messages.len());
        for (aggregate, amount) in aggregates.iter().zip(&amounts) {
            let Some(total) = totals.get_mut(*aggregate) else {
                return Err(HandlerError::new("the ledger's total was not returned"));
            };
            *total = total.saturating_add(*amount);
            outcomes.push(applied(*amount, *total));
        }
        outcomes.extend(poison);
        Ok(outcomes)
    }

    async fn state(
        &self,
        client: &HandlerClient,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let total = client.prepare_typed_cached(TOTAL, &[Type::TEXT]).await?;
        let rows = client.query(&total, &[&aggregate_id]).await?;
        match rows.first() {
            Some(row) => Ok(Some(state(row.try_get(0)?))),
            None => Ok(None),
        }
    }
}
