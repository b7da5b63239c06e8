//! The lesson's ledger: the one handler the server runs inside its ordered inbox. Each
//! aggregate keeps a running total of the amounts applied to it (`aggregate_state.total`, the
//! seed's column); a message's payload is `{"Amount": n}`, and a negative amount is poison.
//!
//! - [`Ledger`]'s [`Check`]: `negative amount` (detail `{"amount": n}`) and the seed's stored
//!   content `{"AggregateId":…,"Sequence":…,"Amount":…}`;
//! - `sqlite`, `postgres`: `apply` adds the amount to the total in the inbox's transaction
//!   (detail `{"amount":n,"total":t}`), `state` reads `{"total": t}`; and the schema that fills
//!   `ordered_inbox.amount` for the seed's readers;
//! - [`views`]: the evidence as the lesson's routes show it, with the totals and amounts.

mod postgres;
mod sqlite;
pub mod views;

use ordered_inbox::content::canonical_json;
use ordered_inbox::{ApplyOutcome, Check, Detail, OrderedMessage, Poison};
use serde::Serialize;
use serde_json::{Value, json};

pub use postgres::install as install_postgres;
pub use sqlite::migrate as migrate_sqlite;

/// The reason of the ledger's poison, as dead letters store it.
pub const NEGATIVE_AMOUNT: &str = "negative amount";

/// The reason for a payload without a whole `Amount` (no door builds one).
pub const NO_AMOUNT: &str = "no amount";

/// The lesson's ledger handler. One value serves every aggregate: its state is in the database.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ledger;

/// The payload the ledger reads: `{"Amount": amount}`.
pub fn payload(amount: i64) -> Value {
    json!({ "Amount": amount })
}

/// A message of `amount` for the ledger, as both doors and the broker's wire format build it.
pub fn message(
    message_id: String,
    aggregate_id: String,
    sequence: i64,
    amount: i64,
) -> OrderedMessage {
    OrderedMessage {
        message_id,
        aggregate_id,
        sequence,
        payload: payload(amount),
    }
}

/// The amount a ledger payload carries: `{"Amount": n}`, or the full envelope a legacy held
/// message or replacement stored, which has it too.
pub fn amount_in(payload: &Value) -> Option<i64> {
    payload.get("Amount").and_then(Value::as_i64)
}

/// [`amount_in`] of a message's payload.
pub fn amount(message: &OrderedMessage) -> Option<i64> {
    amount_in(&message.payload)
}

/// The seed's stored content of a message: `{"AggregateId":"demo","Sequence":1,"Amount":1}`.
#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct SeedContent<'a> {
    aggregate_id: &'a str,
    sequence: i64,
    amount: i64,
}

impl Check for Ledger {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        match amount(message) {
            Some(amount) if amount >= 0 => Ok(()),
            Some(amount) => {
                Err(Poison::new(NEGATIVE_AMOUNT).with_detail(detail(json!({ "amount": amount }))))
            }
            None => Err(Poison::new(NO_AMOUNT)),
        }
    }

    fn canonical(&self, message: &OrderedMessage) -> String {
        let Some(amount) = amount(message) else {
            return canonical_json(&message.payload);
        };
        let content = SeedContent {
            aggregate_id: &message.aggregate_id,
            sequence: message.sequence,
            amount,
        };
        // A struct of a string and two integers always serializes.
        serde_json::to_string(&content).unwrap_or_default()
    }
}

/// Names the ledger's reasons in the OpenAPI document: the inbox describes a quarantine reason
/// as any string its handler gives; this server's handler gives one.
pub fn describe_reasons(document: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    let reason = ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some("quarantine reason"))
        .enum_values(Some([NEGATIVE_AMOUNT]))
        .into();
    if let Some(components) = document.components.as_mut() {
        components
            .schemas
            .insert("QuarantineReason".to_owned(), reason);
    }
}

/// What applying `amount` did: the `applied` event's detail `{"amount":a,"total":t}`.
fn applied(amount: i64, total: i64) -> ApplyOutcome {
    // Built member by member at its final size: every apply builds one.
    let mut detail = Detail::with_capacity(2);
    detail.insert("amount".to_owned(), amount.into());
    detail.insert("total".to_owned(), total.into());
    ApplyOutcome::Applied { detail }
}

/// The ledger's state of an aggregate: `{"total": t}`.
fn state(total: i64) -> Value {
    json!({ "total": total })
}

/// The total a ledger state carries (0 for none: an aggregate the ledger never wrote).
pub fn total_in(state: Option<&Value>) -> i64 {
    state
        .and_then(|state| state.get("total"))
        .and_then(Value::as_i64)
        .unwrap_or_default()
}

fn detail(object: Value) -> Detail {
    match object {
        Value::Object(members) => members,
        _ => Detail::new(),
    }
}

/// The amount `apply` adds: the check let only whole amounts through, so another payload is
/// poison here too.
fn applicable(message: &OrderedMessage) -> Result<i64, ApplyOutcome> {
    amount(message).ok_or_else(|| ApplyOutcome::Poison(Poison::new(NO_AMOUNT)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo(sequence: i64, amount: i64) -> OrderedMessage {
        message("m".into(), "demo".into(), sequence, amount)
    }

    #[test]
    fn the_stored_content_keeps_the_seed_spelling() {
        assert_eq!(
            Ledger.canonical(&demo(1, 1)),
            r#"{"AggregateId":"demo","Sequence":1,"Amount":1}"#
        );
    }

    #[test]
    fn a_negative_amount_is_poison_with_the_amount_beside_the_reason() {
        let poison = Ledger.check(&demo(2, -1)).expect_err("poison");
        assert_eq!(poison.reason.as_str(), NEGATIVE_AMOUNT);
        assert_eq!(Value::Object(poison.detail), json!({"amount": -1}));
        assert_eq!(Ledger.check(&demo(2, 0)), Ok(()));
    }

    #[test]
    fn an_applied_detail_names_the_amount_then_the_total() {
        let ApplyOutcome::Applied { detail } = applied(5, 12) else {
            panic!("applied");
        };
        assert_eq!(
            serde_json::to_string(&detail).unwrap(),
            r#"{"amount":5,"total":12}"#
        );
        assert_eq!(total_in(Some(&state(12))), 12);
        assert_eq!(total_in(None), 0);
    }

    #[test]
    fn a_legacy_envelope_carries_its_amount_too() {
        let envelope = json!({"AggregateId": "demo", "Sequence": 2, "Amount": 7});
        assert_eq!(amount_in(&envelope), Some(7));
        assert_eq!(amount_in(&json!({"amount": 7})), None);
    }
}
