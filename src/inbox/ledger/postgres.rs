//! The ledger on PostgreSQL: `apply` through the client of the inbox's open transaction, and
//! the trigger that fills `ordered_inbox.amount`.

use async_trait::async_trait;
use futures_util::future::join_all;
use ordered_inbox::postgres::{PostgresHandler, PostgresInbox};
use ordered_inbox::{ApplyOutcome, HandlerError, OrderedMessage};
use serde_json::Value;
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

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
        Ok(applied(amount, returned_total(&rows)?))
    }

    /// `apply` is one statement, so a group's applies are sent together: PostgreSQL runs
    /// pipelined statements in the order sent, each upsert seeing the totals before it, and
    /// the group's applies cost one round trip.
    async fn apply_many(
        &self,
        client: &Client,
        messages: &[&OrderedMessage],
    ) -> Result<Vec<ApplyOutcome>, HandlerError> {
        // The applies end at the first poison, as the default's do.
        let mut amounts = Vec::with_capacity(messages.len());
        let mut poison = None;
        for message in messages {
            match applicable(message) {
                Ok(amount) => amounts.push(amount),
                Err(outcome) => {
                    poison = Some(outcome);
                    break;
                }
            }
        }
        type Typed<'a> = [(&'a (dyn ToSql + Sync), Type); 2];
        let params: Vec<Typed<'_>> = messages
            .iter()
            .zip(&amounts)
            .map(|(message, amount)| {
                [
                    (&message.aggregate_id as &(dyn ToSql + Sync), Type::TEXT),
                    (amount as &(dyn ToSql + Sync), Type::INT8),
                ]
            })
            .collect();
        let added = params
            .iter()
            .map(|params| client.query_typed(ADD_AMOUNT, params));
        let mut outcomes = Vec::with_capacity(messages.len());
        for (rows, amount) in join_all(added).await.into_iter().zip(&amounts) {
            outcomes.push(applied(*amount, returned_total(&rows?)?));
        }
        outcomes.extend(poison);
        Ok(outcomes)
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
