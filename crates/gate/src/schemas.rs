//! The gate's message types: each type's JSON Schema (draft 2020-12), compiled once at start.
//! A message whose type is unknown, or whose payload its schema refuses, is poison: the reason
//! says which, and for a refusal where in the payload and why (the validator's first error).

use std::collections::HashMap;
use std::time::Duration;

use jsonschema::Validator;
use serde_json::Value;

/// The type of the output row that marks a sequence an operator skipped. No configured type
/// may take this name ([`MessageTypes::compile`]).
pub const SKIPPED_TYPE: &str = "gate.skipped";

/// The longest reason a refusal gives (in characters, the ellipsis included): a dead letter's
/// reason is shown in lists and audit rows, and a validator's message may quote the payload.
pub const MAX_REASON_CHARS: usize = 300;

/// Each configured message type's compiled schema, and how long an aggregate waiting for a
/// message of that type may wait before it counts as overdue (`gap_alert_after_ms`).
#[derive(Debug)]
pub struct MessageTypes {
    validators: HashMap<String, Validator>,
    gap_alerts: HashMap<String, Duration>,
    /// The configuration generation these types belong to (1 as started): what a recheck's
    /// audit row names, read from the same set it validated against.
    generation: u64,
}

impl MessageTypes {
    /// Compiles every `(type name, schema)` as draft 2020-12. The first schema that does not
    /// compile (not a schema, or a `$ref` that cannot be resolved offline), or that takes the
    /// name of the gate's skip marker, is refused as its type name and why.
    pub fn compile(types: Vec<(String, Value)>) -> Result<MessageTypes, (String, String)> {
        let mut validators = HashMap::with_capacity(types.len());
        for (name, schema) in types {
            if name == SKIPPED_TYPE {
                let why = "the gate reserves this type for the marker of a skipped sequence";
                return Err((name, why.to_owned()));
            }
            match jsonschema::draft202012::new(&schema) {
                Ok(validator) => {
                    validators.insert(name, validator);
                }
                Err(error) => {
                    let why = format!("the schema does not compile: {error}");
                    return Err((name, why));
                }
            }
        }
        Ok(MessageTypes {
            validators,
            gap_alerts: HashMap::new(),
            generation: 1,
        })
    }

    /// These types, with each `(type name, gap_alert_after)` given (a later one for the same
    /// type replaces an earlier).
    pub fn with_gap_alerts(mut self, gap_alerts: Vec<(String, Duration)>) -> MessageTypes {
        self.gap_alerts.extend(gap_alerts);
        self
    }

    /// These types, as the configuration's generation `generation`.
    pub fn with_generation(mut self, generation: u64) -> MessageTypes {
        self.generation = generation;
        self
    }

    /// The configuration generation these types belong to.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether any type sets a `gap_alert_after_ms`: without one nothing is ever overdue.
    pub fn has_gap_alerts(&self) -> bool {
        !self.gap_alerts.is_empty()
    }

    /// How long an aggregate whose next known message has `message_type` may wait before it is
    /// overdue; `None`: the type sets no `gap_alert_after_ms` (or is unknown), never overdue.
    pub fn gap_alert_after(&self, message_type: &str) -> Option<Duration> {
        self.gap_alerts.get(message_type).copied()
    }

    /// Whether `payload` is a valid message of `message_type`, or the reason it is poison.
    pub fn validate(&self, message_type: &str, payload: &Value) -> Result<(), String> {
        let Some(validator) = self.validators.get(message_type) else {
            return Err(bounded(format!("unknown message type '{message_type}'")));
        };
        validator.validate(payload).map_err(|error| {
            let path = error.instance_path().to_string();
            let at = if path.is_empty() {
                "at the top level".to_owned()
            } else {
                format!("at '{path}'")
            };
            bounded(format!(
                "payload does not match the schema of '{message_type}': {at}: {error}"
            ))
        })
    }

    /// Whether `message_type` is configured.
    pub fn knows(&self, message_type: &str) -> bool {
        self.validators.contains_key(message_type)
    }

    /// The configured type names, in name order.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.validators.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

/// `reason` cut to [`MAX_REASON_CHARS`] characters on a character boundary, ending in `…` when
/// it was cut.
fn bounded(reason: String) -> String {
    if reason.chars().count() <= MAX_REASON_CHARS {
        return reason;
    }
    let mut cut: String = reason.chars().take(MAX_REASON_CHARS - 1).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn order_placed() -> MessageTypes {
        let schema = json!({
            "type": "object",
            "required": ["orderId", "amount"],
            "properties": {
                "orderId": {"type": "string"},
                "amount": {"type": "integer", "minimum": 0}
            }
        });
        MessageTypes::compile(vec![("order.placed".into(), schema)]).expect("compiles")
    }

    #[test]
    fn a_payload_its_schema_accepts_is_valid() {
        let types = order_placed();
        assert_eq!(
            types.validate("order.placed", &json!({"orderId": "o-1", "amount": 3})),
            Ok(())
        );
    }

    #[test]
    fn an_unknown_type_is_named_in_the_reason() {
        assert_eq!(
            order_placed().validate("order.lost", &json!({})),
            Err("unknown message type 'order.lost'".to_owned())
        );
    }

    #[test]
    fn a_refusal_names_where_and_the_validators_first_error() {
        let reason = order_placed()
            .validate("order.placed", &json!({"orderId": "o-1", "amount": -1}))
            .expect_err("refused");
        assert_eq!(
            reason,
            "payload does not match the schema of 'order.placed': at '/amount': \
             -1 is less than the minimum of 0"
        );
        let missing = order_placed()
            .validate("order.placed", &json!({"orderId": "o-1"}))
            .expect_err("refused");
        assert_eq!(
            missing,
            "payload does not match the schema of 'order.placed': at the top level: \
             \"amount\" is a required property"
        );
    }

    #[test]
    fn draft_2020_12_keywords_apply() {
        let schema = json!({"type": "array", "prefixItems": [{"type": "string"}], "items": false});
        let types = MessageTypes::compile(vec![("pair".into(), schema)]).expect("compiles");
        assert_eq!(types.validate("pair", &json!(["a"])), Ok(()));
        assert!(types.validate("pair", &json!(["a", 1])).is_err());
    }

    #[test]
    fn a_schema_that_does_not_compile_is_refused_naming_its_type() {
        let broken = json!({"type": "integer", "minimum": "five"});
        let (name, why) = MessageTypes::compile(vec![
            ("fine".into(), json!({"type": "object"})),
            ("broken".into(), broken),
        ])
        .expect_err("refused");
        assert_eq!(name, "broken");
        assert!(why.starts_with("the schema does not compile: "), "{why}");
    }

    #[test]
    fn the_skip_markers_type_cannot_be_configured() {
        let (name, why) =
            MessageTypes::compile(vec![("gate.skipped".into(), json!({"type": "object"}))])
                .expect_err("refused");
        assert_eq!(name, "gate.skipped");
        assert_eq!(
            why,
            "the gate reserves this type for the marker of a skipped sequence"
        );
    }

    #[test]
    fn a_remote_reference_is_refused_rather_than_fetched() {
        let remote = json!({"$ref": "https://example.com/schemas/order.json"});
        let (name, _) =
            MessageTypes::compile(vec![("remote".into(), remote)]).expect_err("refused");
        assert_eq!(name, "remote");
    }

    #[test]
    fn a_types_gap_alert_is_its_own_and_a_type_without_one_has_none() {
        let types = order_placed()
            .with_gap_alerts(vec![("order.placed".into(), Duration::from_millis(250))]);
        assert_eq!(
            types.gap_alert_after("order.placed"),
            Some(Duration::from_millis(250))
        );
        assert_eq!(types.gap_alert_after("order.shipped"), None);
        assert_eq!(order_placed().gap_alert_after("order.placed"), None);
    }

    #[test]
    fn a_long_reason_is_cut_on_a_character_boundary_with_an_ellipsis() {
        let schema = json!({"type": "object", "properties": {"note": {"maxLength": 3}}});
        let types = MessageTypes::compile(vec![("t".into(), schema)]).expect("compiles");
        let reason = types
            .validate("t", &json!({"note": "é".repeat(400)}))
            .expect_err("refused");
        assert_eq!(reason.chars().count(), MAX_REASON_CHARS);
        assert!(reason.ends_with('…'), "{reason}");
        assert_eq!(bounded("short".into()), "short");
    }
}
