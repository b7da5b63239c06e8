//! What the application says about a message's content: whether it is acceptable ([`Check`],
//! pure), what "the same content" means (its canonical form), and what applying it did
//! ([`ApplyOutcome`]). The backends' handler traits (`sqlite::SqliteHandler`,
//! `postgres::PostgresHandler`) add `apply`, which runs inside the inbox's own transaction.
//!
//! The inbox never interprets a payload: ordering, identity, held messages, dead letters and
//! resolution only need to know whether a message is poison (and why), and whether two
//! deliveries of one id carry the same content.
//!
//! ## The canonical form
//!
//! Two deliveries of one message id are the same message when they name the same aggregate and
//! sequence and their canonical content is equal; otherwise the second is a payload conflict.
//! The stored `payload` column of applied messages, dead letters and held messages holds that
//! canonical content, so it is also what the evidence shows. By default
//! ([`canonical_json`]) it is the payload's JSON text with:
//!
//! - object members sorted by key (bytewise) at every depth, duplicates already resolved by the
//!   parser (the last one wins);
//! - no insignificant whitespace;
//! - strings as `serde_json` escapes them (only `"`, `\` and control characters; no `\u`
//!   escapes for other characters);
//! - numbers exactly as written: the crate reads JSON with `serde_json`'s `arbitrary_precision`,
//!   so a number keeps its text, every digit of it, however long. Two numbers are one content
//!   only when they are written alike: `12.30` and `12.3` are two contents (a decimal reader
//!   such as .NET's `decimal` keeps the scale, so they are not the same to every consumer),
//!   and so are `1e2` and `100`, and `0` and `-0`; a change in the 30th digit of a 30-digit
//!   integer is a change of content. Only the exponent's spelling is one form: `1E2`, `1e2` and
//!   `1e+2` are all `1e+2` (the letter's case and the `+` are notation in JSON's grammar, as
//!   whitespace is). A producer that sends one message again sends the same number text, which
//!   a serializer does for the same value.
//!
//! A handler may define its own equivalence by overriding [`Check::canonical`]: whatever text it
//! returns is what is stored and compared (for example a fixed member order that an older
//! store already holds byte for byte, or a form without a member that does not change the
//! message's meaning, such as a trace id).

use serde_json::{Map, Value};

use crate::model::{OrderedMessage, QuarantineReason};

/// A short JSON object the handler attaches to an event: to the `applied` event (what applying
/// did), or to the `quarantined` event beside its reason. Empty: nothing to show.
pub type Detail = Map<String, Value>;

/// The handler's verdict that a message is poison: the reason its dead letter stores and shows,
/// and an optional detail for its `quarantined` event (whose detail is `{"reason": …}` followed
/// by this object's members).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poison {
    /// Why the message is poison, as the dead letter keeps it.
    pub reason: QuarantineReason,
    /// What else the handler reports; the timeline's entry shows it.
    pub detail: Detail,
}

impl Poison {
    /// A poison with `reason` and no detail.
    pub fn new(reason: impl Into<String>) -> Poison {
        Poison {
            reason: QuarantineReason::new(reason),
            detail: Detail::new(),
        }
    }

    /// The same poison with `detail` for its `quarantined` event.
    pub fn with_detail(self, detail: Detail) -> Poison {
        Poison { detail, ..self }
    }
}

/// The pure half of an application's handler: decides from the message alone. The inbox calls
/// it for every message at its aggregate's expected sequence (delivered, drained from the held
/// set, or an operator's replacement), before anything is written, and for a dry run.
pub trait Check: Send + Sync {
    /// Whether the message may apply (`Ok`), or is poison. Must not look at anything but the
    /// message: the decision is replayed, and it runs for dry runs too.
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        let _ = message;
        Ok(())
    }

    /// The content two deliveries of one id must share to be the same message, and the text the
    /// store keeps as the message's payload. See the module's documentation for the default.
    fn canonical(&self, message: &OrderedMessage) -> String {
        canonical_json(&message.payload)
    }
}

/// What `apply` did with a message the check accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// Applied: the handler's writes stand, and the `applied` event carries `detail`.
    Applied {
        /// What the handler reports of the apply.
        detail: Detail,
    },
    /// Poison after all, from what the handler read in its tables: its writes for this message
    /// are rolled back and the message is quarantined exactly as a poison from [`Check::check`].
    Poison(Poison),
}

impl ApplyOutcome {
    /// Applied with nothing to show.
    pub fn applied() -> ApplyOutcome {
        ApplyOutcome::Applied {
            detail: Detail::new(),
        }
    }
}

/// The default handler: every payload is acceptable, applying writes nothing. For tests,
/// examples, and an inbox used only for its ordering and evidence.
#[derive(Debug, Clone, Copy, Default)]
pub struct AcceptAll;

impl Check for AcceptAll {}

/// The default canonical form of a payload (see the module's documentation).
pub fn canonical_json(payload: &Value) -> String {
    // Serializing a `Value` cannot fail: its keys are strings and its numbers finite.
    serde_json::to_string(&sorted(payload)).unwrap_or_default()
}

/// `value` with every object's members in key order.
fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(members) => {
            let mut keys: Vec<&String> = members.keys().collect();
            keys.sort_unstable();
            Value::Object(
                keys.into_iter()
                    .map(|key| (key.clone(), sorted(&members[key])))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// Whether a stored message (its canonical content and, where the row kept them, its aggregate
/// and sequence) is the same message as `offered`, whose canonical content is `canonical`.
pub(crate) fn same_content(
    stored: Option<&str>,
    aggregate_id: Option<&str>,
    sequence: Option<i64>,
    offered: &OrderedMessage,
    canonical: &str,
) -> bool {
    stored == Some(canonical)
        && aggregate_id.is_none_or(|aggregate| aggregate == offered.aggregate_id)
        && sequence.is_none_or(|sequence| sequence == offered.sequence)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_canonical_form_sorts_keys_at_every_depth_and_drops_whitespace() {
        let payload: Value = serde_json::from_str(
            r#"{ "b": [ {"z": 1, "a": "x"} ], "a": { "d": null, "c": true } }"#,
        )
        .unwrap();
        assert_eq!(
            canonical_json(&payload),
            r#"{"a":{"c":true,"d":null},"b":[{"a":"x","z":1}]}"#
        );
    }

    #[test]
    fn numbers_keep_every_digit_as_written() {
        let text = |raw: &str| canonical_json(&serde_json::from_str(raw).unwrap());
        for written in [
            "123456789012345678901234567890",
            "-123456789012345678901234567890",
            "9007199254740993",
            "12.30",
            "1.50e-7",
            "-0",
            "0.1000000000000000000000001",
        ] {
            assert_eq!(text(written), written);
        }
        // The exponent's letter and its `+` are spelling: one form for each.
        for written in ["1e2", "1E2", "1e+2", "1E+2"] {
            assert_eq!(text(written), "1e+2");
        }
        assert_eq!(
            text(r#"{ "b": 12.30, "a": [ 9007199254740993 ] }"#),
            r#"{"a":[9007199254740993],"b":12.30}"#
        );
    }

    #[test]
    fn numbers_are_one_content_only_when_they_are_written_alike() {
        let text = |raw: &str| canonical_json(&serde_json::from_str(raw).unwrap());
        assert_ne!(
            text("123456789012345678901234567890"),
            text("123456789012345678901234567891")
        );
        assert_ne!(text("9007199254740993"), text("9007199254740992"));
        assert_ne!(text("12.30"), text("12.3"));
        assert_ne!(text("1e2"), text("100"));
        assert_eq!(text("1E2"), text("1e+2"));
        assert_ne!(text("1"), text("1.0"));
        assert_eq!(text(r#"{"a": 12.30}"#), text(r#"{ "a" : 12.30 }"#));
    }

    #[test]
    fn the_same_content_needs_the_same_aggregate_and_sequence_where_they_are_known() {
        let offered = OrderedMessage {
            message_id: "m".into(),
            aggregate_id: "a".into(),
            sequence: 2,
            payload: json!({"sku": "x"}),
        };
        let canonical = canonical_json(&offered.payload);
        assert!(same_content(
            Some(&canonical),
            Some("a"),
            Some(2),
            &offered,
            &canonical
        ));
        assert!(same_content(
            Some(&canonical),
            None,
            None,
            &offered,
            &canonical
        ));
        assert!(!same_content(
            Some(&canonical),
            Some("b"),
            Some(2),
            &offered,
            &canonical
        ));
        assert!(!same_content(
            Some(&canonical),
            Some("a"),
            Some(3),
            &offered,
            &canonical
        ));
        assert!(!same_content(
            None,
            Some("a"),
            Some(2),
            &offered,
            &canonical
        ));
    }
}
