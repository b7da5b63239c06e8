//! The gate's handler in the inbox's transaction: a message is an envelope
//! `{"type": T, "payload": …}`; its check validates the payload against T's schema (poison
//! otherwise), and applying it writes its output row (`gate_output`) beside the inbox's rows,
//! so both commit together or not at all.
//!
//! A sequence an operator skipped (a dead letter's skip, each sequence of a gap skip) writes an
//! output row too, of type [`SKIPPED_TYPE`], in the resolution's transaction: the output then
//! carries every sequence of an aggregate exactly once, and a downstream tells a deliberate skip
//! from a loss.
//!
//! On PostgreSQL, several gates share the store and one of them publishes. A transaction of a
//! gate that is not publishing notifies the channel [`OUTPUT_CHANNEL`] when it writes output
//! rows, so that the publishing gate sends them at once rather than at its next tick.
//!
//! The applied event's detail is `{"type": T}`, the quarantined event's is `{"reason": …,
//! "type": T}`; the state of an aggregate (a resolution's audit row) is `{"emitted": n}`, the
//! count of its output rows.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use ordered_inbox::content::canonical_json;
use ordered_inbox::postgres::{HandlerClient, PostgresHandler};
use ordered_inbox::records::SkippedSequences;
use ordered_inbox::sqlite::{SqliteHandler, WriterConnection};
use ordered_inbox::{ApplyOutcome, Check, Detail, HandlerError, OrderedMessage, Poison, clock};
use rusqlite::Connection;
use serde_json::{Value, json};
use tokio_postgres::types::Type;

use super::notices::{Announcer, OUTPUT_CHANNEL};
use super::schemas::{MessageTypes, SKIPPED_TYPE};

/// The reason of a message whose payload is not a gate envelope (no door of the gate builds
/// one; a store shared with another application could hold one).
pub const NOT_A_GATE_MESSAGE: &str = "not a gate message";

/// One output row's insert. No `ON CONFLICT`: the inbox applies each (aggregate, sequence)
/// once, so a row already there is a broken invariant, which must fail the delivery (a
/// `HandlerError`, nothing recorded) rather than drop a row.
const SQLITE_INSERT: &str = "
INSERT INTO gate_output(aggregate_id, sequence, message_id, message_type, payload, applied_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)";
const POSTGRES_INSERT: &str = "
INSERT INTO gate_output(aggregate_id, sequence, message_id, message_type, payload, applied_at)
VALUES ($1, $2, $3, $4, $5, $6)";
/// A group's output rows in one statement, each as [`POSTGRES_INSERT`] would write it.
const POSTGRES_INSERT_MANY: &str = "
INSERT INTO gate_output(aggregate_id, sequence, message_id, message_type, payload, applied_at)
SELECT a, s, m, t, p, $6
  FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[]) AS r(a, s, m, t, p)";

/// A skip's marker rows, one per sequence of the range (`?2` through `?3`), in one statement.
const SQLITE_INSERT_SKIPPED: &str = "
WITH RECURSIVE skipped(sequence) AS (
    SELECT ?2 UNION ALL SELECT sequence + 1 FROM skipped WHERE sequence < ?3
)
INSERT INTO gate_output(aggregate_id, sequence, message_id, message_type, payload, applied_at)
SELECT ?1, sequence, ?4 || sequence, ?5, ?6, ?7 FROM skipped";
/// [`SQLITE_INSERT_SKIPPED`] on PostgreSQL.
const POSTGRES_INSERT_SKIPPED: &str = "
INSERT INTO gate_output(aggregate_id, sequence, message_id, message_type, payload, applied_at)
SELECT $1, sequence, $4 || sequence, $5, $6, $7 FROM generate_series($2::bigint, $3::bigint) AS sequence";

/// Notifies [`OUTPUT_CHANNEL`] at commit (not at all on rollback). PostgreSQL folds the same
/// notification sent twice in one transaction into one.
const POSTGRES_NOTIFY_OUTPUT: &str = "SELECT pg_notify($1, $2)";

const SQLITE_EMITTED: &str = "SELECT COUNT(*) FROM gate_output WHERE aggregate_id = ?1";
const POSTGRES_EMITTED: &str = "SELECT COUNT(*) FROM gate_output WHERE aggregate_id = $1";

/// A gate message's payload as the inbox stores it: the envelope of its type and payload.
pub fn envelope(message_type: &str, payload: Value) -> Value {
    json!({ "type": message_type, "payload": payload })
}

/// The type and inner payload of an envelope; `None` for anything else (a member missing, a
/// type that is not a string, or a member besides the two).
pub fn open_envelope(payload: &Value) -> Option<(&str, &Value)> {
    let members = payload.as_object()?;
    if members.len() != 2 {
        return None;
    }
    let message_type = members.get("type")?.as_str()?;
    Some((message_type, members.get("payload")?))
}

/// The message types a configuration reload swaps whole: a check reads the set current at its
/// start and keeps it to its end.
pub type SharedTypes = Arc<ArcSwap<MessageTypes>>;

/// The gate's handler: one value serves every aggregate (its output is in the database).
#[derive(Debug, Clone)]
pub struct GateHandler {
    pub types: SharedTypes,
    /// This gate's announcer, if it runs a publisher: while that does not hold the lease, a
    /// PostgreSQL transaction that writes output rows notifies the gate that holds it.
    announcer: Option<Announcer>,
}

impl GateHandler {
    /// A handler checking against `types`, never replaced.
    pub fn new(types: MessageTypes) -> GateHandler {
        GateHandler::with_shared_types(Arc::new(ArcSwap::from_pointee(types)))
    }

    /// A handler checking against whichever set `types` holds at each check.
    pub fn with_shared_types(types: SharedTypes) -> GateHandler {
        GateHandler {
            types,
            announcer: None,
        }
    }

    /// Announces this gate's output rows to the publishing gate by `announcer`.
    pub fn with_announcer(mut self, announcer: Announcer) -> GateHandler {
        self.announcer = Some(announcer);
        self
    }

    /// Notifies the publishing gate, if another gate's publisher may be the one holding the
    /// lease: one statement in the transaction that wrote output rows.
    async fn announce(&self, client: &HandlerClient) -> Result<(), HandlerError> {
        let Some(payload) = self.announcer.as_ref().and_then(Announcer::payload) else {
            return Ok(());
        };
        let notify = client
            .prepare_typed_cached(POSTGRES_NOTIFY_OUTPUT, &[Type::TEXT, Type::TEXT])
            .await?;
        client.query(&notify, &[&OUTPUT_CHANNEL, &payload]).await?;
        Ok(())
    }
}

impl Check for GateHandler {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        let Some((message_type, payload)) = open_envelope(&message.payload) else {
            return Err(Poison::new(NOT_A_GATE_MESSAGE));
        };
        self.types
            .load()
            .validate(message_type, payload)
            .map_err(|reason| Poison::new(reason).with_detail(type_detail(message_type)))
    }
}

/// `{"type": T}`, the detail of both the applied and the quarantined event.
fn type_detail(message_type: &str) -> Detail {
    let mut detail = Detail::new();
    detail.insert("type".to_owned(), Value::from(message_type));
    detail
}

/// The output row of an applied message.
struct OutputRow<'m> {
    message: &'m OrderedMessage,
    message_type: &'m str,
    payload: String,
}

/// The output row `apply` writes for `message`, or the poison of a message that is not an
/// envelope (the check refused it already; a handler never trusts that alone).
fn output_row(message: &OrderedMessage) -> Result<OutputRow<'_>, ApplyOutcome> {
    match open_envelope(&message.payload) {
        Some((message_type, payload)) => Ok(OutputRow {
            message,
            message_type,
            payload: canonical_json(payload),
        }),
        None => Err(ApplyOutcome::Poison(Poison::new(NOT_A_GATE_MESSAGE))),
    }
}

impl OutputRow<'_> {
    fn applied(&self) -> ApplyOutcome {
        ApplyOutcome::Applied {
            detail: type_detail(self.message_type),
        }
    }
}

/// A skip's marker: the message id prefix (`skip:<resolution id>:`, the sequence follows, so
/// that a marker's id is unique and stable) and the payload, `{"operator", "reason",
/// "resolutionId"}` in canonical JSON.
fn skip_marker(skipped: &SkippedSequences) -> (String, String) {
    let payload = json!({
        "resolutionId": skipped.resolution_id,
        "operator": skipped.operator,
        "reason": skipped.reason,
    });
    (
        format!("skip:{}:", skipped.resolution_id),
        canonical_json(&payload),
    )
}

/// `{"emitted": n}` of an aggregate with output rows; `None` for one without.
fn emitted_state(count: i64) -> Option<Value> {
    (count > 0).then(|| json!({ "emitted": count }))
}

impl SqliteHandler for GateHandler {
    fn apply(
        &self,
        connection: &WriterConnection<'_>,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let row = match output_row(message) {
            Ok(row) => row,
            Err(poison) => return Ok(poison),
        };
        connection.prepared(SQLITE_INSERT)?.execute((
            &message.aggregate_id,
            message.sequence,
            &message.message_id,
            row.message_type,
            &row.payload,
            clock::now(),
        ))?;
        Ok(row.applied())
    }

    fn state(
        &self,
        connection: &Connection,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let count: i64 = connection
            .prepare_cached(SQLITE_EMITTED)?
            .query_row([aggregate_id], |row| row.get(0))?;
        Ok(emitted_state(count))
    }

    fn skipped(
        &self,
        connection: &WriterConnection<'_>,
        skipped: &SkippedSequences,
    ) -> Result<(), HandlerError> {
        let (id_prefix, payload) = skip_marker(skipped);
        connection.prepared(SQLITE_INSERT_SKIPPED)?.execute((
            &skipped.aggregate_id,
            skipped.range.from,
            skipped.range.through,
            &id_prefix,
            SKIPPED_TYPE,
            &payload,
            &skipped.at,
        ))?;
        Ok(())
    }
}

#[async_trait]
impl PostgresHandler for GateHandler {
    async fn apply(
        &self,
        client: &HandlerClient,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let row = match output_row(message) {
            Ok(row) => row,
            Err(poison) => return Ok(poison),
        };
        let now = clock::now();
        let insert = client
            .prepare_typed_cached(
                POSTGRES_INSERT,
                &[
                    Type::TEXT,
                    Type::INT8,
                    Type::TEXT,
                    Type::TEXT,
                    Type::TEXT,
                    Type::TEXT,
                ],
            )
            .await?;
        client
            .execute(
                &insert,
                &[
                    &message.aggregate_id,
                    &message.sequence,
                    &message.message_id,
                    &row.message_type,
                    &row.payload,
                    &now,
                ],
            )
            .await?;
        self.announce(client).await?;
        Ok(row.applied())
    }

    /// A group's output rows in one statement. A message that is not an envelope ends the
    /// applies there, as the default's would: the ones before it are written, it is poison.
    async fn apply_many(
        &self,
        client: &HandlerClient,
        messages: &[&OrderedMessage],
    ) -> Result<Vec<ApplyOutcome>, HandlerError> {
        let mut rows = Vec::with_capacity(messages.len());
        let mut poison = None;
        for message in messages {
            match output_row(message) {
                Ok(row) => rows.push(row),
                Err(outcome) => {
                    poison = Some(outcome);
                    break;
                }
            }
        }
        if !rows.is_empty() {
            insert_many(client, &rows).await?;
            self.announce(client).await?;
        }
        let mut outcomes: Vec<ApplyOutcome> = rows.iter().map(OutputRow::applied).collect();
        outcomes.extend(poison);
        Ok(outcomes)
    }

    async fn state(
        &self,
        client: &HandlerClient,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let emitted = client
            .prepare_typed_cached(POSTGRES_EMITTED, &[Type::TEXT])
            .await?;
        let rows = client.query(&emitted, &[&aggregate_id]).await?;
        match rows.first() {
            Some(row) => Ok(emitted_state(row.try_get(0)?)),
            None => Ok(None),
        }
    }

    async fn skipped(
        &self,
        client: &HandlerClient,
        skipped: &SkippedSequences,
    ) -> Result<(), HandlerError> {
        let (id_prefix, payload) = skip_marker(skipped);
        let insert = client
            .prepare_typed_cached(
                POSTGRES_INSERT_SKIPPED,
                &[
                    Type::TEXT,
                    Type::INT8,
                    Type::INT8,
                    Type::TEXT,
                    Type::TEXT,
                    Type::TEXT,
                    Type::TEXT,
                ],
            )
            .await?;
        client
            .execute(
                &insert,
                &[
                    &skipped.aggregate_id,
                    &skipped.range.from,
                    &skipped.range.through,
                    &id_prefix,
                    &SKIPPED_TYPE,
                    &payload,
                    &skipped.at,
                ],
            )
            .await?;
        self.announce(client).await?;
        Ok(())
    }
}

async fn insert_many(client: &HandlerClient, rows: &[OutputRow<'_>]) -> Result<(), HandlerError> {
    let aggregates: Vec<&str> = rows
        .iter()
        .map(|row| row.message.aggregate_id.as_str())
        .collect();
    let sequences: Vec<i64> = rows.iter().map(|row| row.message.sequence).collect();
    let ids: Vec<&str> = rows
        .iter()
        .map(|row| row.message.message_id.as_str())
        .collect();
    let types: Vec<&str> = rows.iter().map(|row| row.message_type).collect();
    let payloads: Vec<&str> = rows.iter().map(|row| row.payload.as_str()).collect();
    let now = clock::now();
    let insert = client
        .prepare_typed_cached(
            POSTGRES_INSERT_MANY,
            &[
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::TEXT_ARRAY,
                Type::TEXT_ARRAY,
                Type::TEXT_ARRAY,
                Type::TEXT,
            ],
        )
        .await?;
    client
        .execute(
            &insert,
            &[&aggregates, &sequences, &ids, &types, &payloads, &now],
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handler() -> GateHandler {
        let schema = json!({"type": "object", "required": ["orderId"]});
        let types = MessageTypes::compile(vec![("order.placed".into(), schema)]).expect("compiles");
        GateHandler::new(types)
    }

    fn message(payload: Value) -> OrderedMessage {
        OrderedMessage {
            message_id: "m-1".into(),
            aggregate_id: "order-1".into(),
            sequence: 1,
            payload,
        }
    }

    #[test]
    fn an_envelope_opens_to_its_type_and_payload() {
        let sealed = envelope("order.placed", json!({"orderId": "o-1"}));
        assert_eq!(
            open_envelope(&sealed),
            Some(("order.placed", &json!({"orderId": "o-1"})))
        );
        assert_eq!(open_envelope(&json!({"type": "t"})), None);
        assert_eq!(open_envelope(&json!({"type": 1, "payload": {}})), None);
        assert_eq!(
            open_envelope(&json!({"type": "t", "payload": {}, "extra": 1})),
            None
        );
    }

    #[test]
    fn a_payload_that_is_not_an_envelope_is_poison() {
        let poison = handler()
            .check(&message(json!({"Amount": 1})))
            .expect_err("poison");
        assert_eq!(poison.reason.as_str(), NOT_A_GATE_MESSAGE);
    }

    #[test]
    fn a_refused_payload_is_poison_with_its_type_beside_the_reason() {
        let poison = handler()
            .check(&message(envelope("order.placed", json!({}))))
            .expect_err("poison");
        assert!(
            poison.reason.as_str().starts_with(
                "payload does not match the schema of 'order.placed': at the top level: "
            ),
            "{}",
            poison.reason.as_str()
        );
        assert_eq!(
            Value::Object(poison.detail),
            json!({"type": "order.placed"})
        );
        let valid = message(envelope("order.placed", json!({"orderId": "o-1"})));
        assert_eq!(handler().check(&valid), Ok(()));
    }

    #[test]
    fn a_skip_marker_names_its_resolution_in_its_id_and_payload() {
        let skipped = SkippedSequences {
            aggregate_id: "order-1".into(),
            range: ordered_inbox::records::SequenceRange {
                from: 5,
                through: 7,
            },
            resolution_id: 3,
            operator: "alice".into(),
            reason: "lost upstream".into(),
            at: "2026-01-01T00:00:00.000Z".into(),
        };
        assert_eq!(
            skip_marker(&skipped),
            (
                "skip:3:".to_owned(),
                r#"{"operator":"alice","reason":"lost upstream","resolutionId":3}"#.to_owned()
            )
        );
    }

    #[test]
    fn an_aggregate_without_output_has_no_state() {
        assert_eq!(emitted_state(0), None);
        assert_eq!(emitted_state(2), Some(json!({"emitted": 2})));
    }
}
