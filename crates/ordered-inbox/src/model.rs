//! The typed values the core decides over: a message, the door it came through, an aggregate's
//! position and status, a dead letter's status, the stored enums.

use serde::Serialize;
use serde_json::Value;

/// One ordered message as the consumer receives it: its identity, its place in its aggregate's
/// sequence, and a payload the inbox stores and hands to the application's handler without
/// interpreting it.
///
/// The payload is a JSON value: what brokers and HTTP bodies carry in practice, storable as text
/// in every backend, readable back in the evidence (`payload` of applied messages, dead letters
/// and held messages), and with a canonical form ([`crate::content::canonical_json`]) that makes
/// "the same content" a definite question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderedMessage {
    /// Its identity: the same id always means the same content.
    pub message_id: String,
    /// The aggregate whose sequence it takes.
    pub aggregate_id: String,
    /// Its position in the aggregate's sequence, from 1.
    pub sequence: i64,
    /// The application's content; the inbox does not interpret it.
    pub payload: Value,
}

/// Which way a message came in. The doors share the policy and the tables; they differ in one
/// identity rule, which the seed's classroom contract fixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// The seed's classroom contract: identity is checked against applied messages only, and a
    /// gap writes no state row for an aggregate that has none.
    Classroom,
    /// The general contract: identity also spans dead letters, so an id never changes meaning.
    General,
    /// A broker's consumer: the general contract, except that a message ahead of its turn is
    /// *held* (recorded durably, to apply as soon as its predecessor does) instead of refused as
    /// a gap, since a broker would only deliver it again and again. Identity also spans held
    /// messages: a held id delivered again is recognised, and another id for an already held
    /// sequence is stale (the first held wins).
    Broker,
}

/// Raised when a stored status or kind is not one this build knows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} '{found}' in the store")]
pub struct UnknownValue {
    /// What kind of value it was meant to be.
    pub what: &'static str,
    /// The text found.
    pub found: String,
}

/// Declares a text-backed enum: its stored/serialized spelling, `Display` and `FromStr`.
macro_rules! stored_enum {
    ($(#[$meta:meta])* $name:ident, $what:literal { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The spelling stored in the rows and shown in bodies.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        // By hand rather than derived: the derive would name the variants, not their spellings.
        #[cfg(feature = "openapi")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::schema::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .description(Some($what))
                    .enum_values(Some([$($text),+]))
                    .into()
            }
        }

        #[cfg(feature = "openapi")]
        impl utoipa::ToSchema for $name {}

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::model::UnknownValue;

            fn from_str(text: &str) -> Result<Self, $crate::model::UnknownValue> {
                match text {
                    $($text => Ok($name::$variant),)+
                    other => Err($crate::model::UnknownValue { what: $what, found: other.to_owned() }),
                }
            }
        }
    };
}
pub(crate) use stored_enum;

stored_enum!(
    /// Where an aggregate stands.
    AggregateStatus, "aggregate status" {
        /// Every delivery so far was in order.
        Flowing => "flowing",
        /// A later sequence was refused as a gap since the last apply, or messages are held
        /// for the aggregate until a missing predecessor arrives.
        Waiting => "waiting",
        /// An open dead letter holds the expected sequence.
        Blocked => "blocked",
    }
);

stored_enum!(
    /// A dead letter's lifecycle.
    DeadLetterStatus, "dead letter status" {
        /// It holds its aggregate's expected sequence.
        Open => "open",
        /// An operator resolved it (replace or skip), with an audit row.
        Resolved => "resolved",
        /// Another message (or a skip) took its sequence.
        Superseded => "superseded",
    }
);

stored_enum!(
    /// The kind of a resolution, as the audit row stores it.
    ActionKind, "resolution action" {
        /// A new message under a new id took the dead letter's sequence.
        Replace => "replace",
        /// The dead letter's sequence was passed without a message.
        Skip => "skip",
        /// The dead letter's own message, applied as it was delivered once it passes the check.
        Accept => "accept",
    }
);

/// Why a message at the expected sequence is not applied: the reason the application's handler
/// gave ([`crate::content::Poison`]), stored on the dead letter as it is and shown as a string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct QuarantineReason(String);

impl QuarantineReason {
    /// A reason with this text.
    pub fn new(reason: impl Into<String>) -> QuarantineReason {
        QuarantineReason(reason.into())
    }

    /// The stored spelling.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for QuarantineReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for QuarantineReason {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .description(Some("quarantine reason: the application handler's"))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for QuarantineReason {}

/// An aggregate's last applied sequence, and what the application's handler reports of the
/// aggregate at that point (its `state`; `None` when the handler reports nothing, or for a dry
/// run's replacement, which was not applied).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Position {
    /// The aggregate's last applied sequence.
    pub last: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// What the application's handler shows of the aggregate, if anything.
    pub state: Option<Value>,
}

/// An aggregate's row: position, status and when it entered that status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggregateRow {
    /// The last applied sequence (0 before any).
    pub last: i64,
    /// Where it stands.
    pub status: AggregateStatus,
    /// Unknown only for rows written before the status existed.
    pub since: Option<String>,
}

/// Bounds the store keeps for every aggregate, whatever its clients send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open dead letters one aggregate may hold; a further new poison message is refused
    /// (`QuarantineFull`) rather than stored.
    pub max_open_dead_letters: usize,
    /// Messages one aggregate may hold ahead of its turn ([`Door::Broker`]); a further one is
    /// refused (`HoldFull`), for the broker to deliver again later, rather than stored.
    pub max_held_per_aggregate: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_open_dead_letters: 1000,
            max_held_per_aggregate: 1000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_through_their_stored_spelling() {
        for status in [
            AggregateStatus::Flowing,
            AggregateStatus::Waiting,
            AggregateStatus::Blocked,
        ] {
            assert_eq!(status.as_str().parse::<AggregateStatus>(), Ok(status));
        }
        assert_eq!(
            "superseded".parse::<DeadLetterStatus>(),
            Ok(DeadLetterStatus::Superseded)
        );
        assert!("Open".parse::<DeadLetterStatus>().is_err());
        assert_eq!(
            serde_json::to_string(&QuarantineReason::new("out of stock")).unwrap(),
            "\"out of stock\""
        );
    }
}
