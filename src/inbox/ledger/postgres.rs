//! The ledger on PostgreSQL: `apply` through the client of the inbox's open transaction, and
//! the trigger that fills `ordered_inbox.amount`.

use async_trait::async_trait;
use ordered_inbox::postgres::{PostgresHandler, PostgresInbox};
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedMessage};
use serde_json::Value;
use tokio_postgres::Client;
use tokio_postgres::types::Type;

use super::{Ledger, applicable, applied, state};

/// As on SQLite; PostgreSQL refuses a bigint overflow, so the total stops at its largest.
const ADD_AMOUNT: &str = "
INSERT INTO aggregate_state(aggregate_id, last_sequence, total) VALUES ($1, 0, $2)
ON CONFLICT (aggregate_id) DO UPDATE SET
    total = CASE WHEN aggregate_state.total > 9223372036854775807 - excluded.total
                 THEN 9223372036854775807 ELSE aggregate_state.total + excluded.total END
RETURNING total";

const TOTAL: &str = "SELECT total FROM aggregate_state WHERE aggregate_id = $1";

/// `ordered_inbox.amount` from the stored content, as on SQLite, set before the row is written.
/// Installed under a transaction-scoped advisory lock, so servers starting together on one
/// database do not replace the function at the same time.
const AMOUNT_TRIGGER: &str = r#"
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('production-lab ledger'));
CREATE OR REPLACE FUNCTION ledger_amount() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.amount IS NULL AND (NEW.payload::jsonb ->> 'Amount') ~ '^-?[0-9]{1,18}$' THEN
        NEW.amount := (NEW.payload::jsonb ->> 'Amount')::bigint;
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER ledger_amount BEFORE INSERT ON ordered_inbox
    FOR EACH ROW EXECUTE FUNCTION ledger_amount();
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
        .batch_execute(AMOUNT_TRIGGER)
        .await
        .map_err(|error| HandlerError::from(error).to_string())
}

#[async_trait]
impl PostgresHandler for Ledger {
    async fn apply(
        &self,
        client: &Client,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let amount = match applicable(message) {
            Ok(amount) => amount,
            Err(poison) => return Ok(poison),
        };
        // One round trip: an unnamed statement with its parameter types given.
        let rows = client
            .query_typed(
                ADD_AMOUNT,
                &[(&message.aggregate_id, Type::TEXT), (&amount, Type::INT8)],
            )
            .await?;
        let total: i64 = match rows.first() {
            Some(row) => row.try_get(0)?,
            None => return Err(HandlerError::new("the ledger's total was not returned")),
        };
        Ok(applied(amount, total))
    }

    async fn state(
        &self,
        client: &Client,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let rows = client
            .query_typed(TOTAL, &[(&aggregate_id, Type::TEXT)])
            .await?;
        match rows.first() {
            Some(row) => Ok(Some(state(row.try_get(0)?))),
            None => Ok(None),
        }
    }
}
