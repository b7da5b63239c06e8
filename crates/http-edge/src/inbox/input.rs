//! The message input both doors parse: the general door's JSON body (`POST
//! /aggregates/{id}/messages`) and the broker door's message payload are one shape, checked by one
//! set of rules (aggregate id, message id, sequence), so a message means the same whichever way it
//! came in.

use ordered_inbox::OrderedMessage;

use crate::error::AppError;

/// The largest sequence the general door accepts: 2^53, the largest integer every JSON client
/// represents exactly.
pub const MAX_SEQUENCE: i64 = 1 << 53;
const MAX_AGGREGATE_ID: usize = 64;
const MAX_MESSAGE_ID: usize = 100;

/// An aggregate id: 1..64 characters of `A-Za-z0-9._:-`, but not `.` or `..`: clients normalise
/// those path segments away, so such an aggregate could be written once and never reached again.
pub fn validate_aggregate_id(name: &str, aggregate_id: &str) -> Result<(), AppError> {
    if matches!(aggregate_id, "." | "..") {
        return Err(AppError::bad_request(format!(
            "{name} must not be '.' or '..': URL paths drop those segments"
        )));
    }
    let valid = !aggregate_id.is_empty()
        && aggregate_id.len() <= MAX_AGGREGATE_ID
        && aggregate_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(AppError::bad_request(format!(
            "{name} must be 1 to {MAX_AGGREGATE_ID} characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'"
        )))
    }
}

/// A message id: 1..100 characters, not blank, no control characters.
/// The namespace a `?producer=` names: a registered producer's name, checked for shape only
/// (an unknown one simply finds no dead letter).
pub fn producer_namespace(producer: Option<String>) -> Result<Option<String>, AppError> {
    match producer {
        None => Ok(None),
        Some(name) => {
            ordered_inbox::operators::validate_name(
                ordered_inbox::operators::Registry::Producers,
                &name,
            )
            .map_err(|error| AppError::bad_request(format!("producer: {error}")))?;
            Ok(Some(name))
        }
    }
}

/// A message identity in words, for a problem's detail: an anonymous delivery's id alone, a
/// producer's with its producer.
pub fn identity_words(producer: Option<&str>, message_id: &str) -> String {
    match producer {
        None => format!("message id '{message_id}'"),
        Some(producer) => format!("message id '{message_id}' of producer '{producer}'"),
    }
}

pub fn validate_message_id(name: &str, message_id: &str) -> Result<(), AppError> {
    let length = message_id.chars().count();
    let valid = (1..=MAX_MESSAGE_ID).contains(&length)
        && !message_id.trim().is_empty()
        && !message_id.chars().any(char::is_control);
    if valid {
        Ok(())
    } else {
        Err(AppError::bad_request(format!(
            "{name} must be 1 to {MAX_MESSAGE_ID} characters, not blank, without control characters"
        )))
    }
}

pub fn validate_sequence(name: &str, sequence: i64, minimum: i64) -> Result<(), AppError> {
    if (minimum..=MAX_SEQUENCE).contains(&sequence) {
        Ok(())
    } else {
        Err(AppError::bad_request(format!(
            "{name} must be a whole number from {minimum} to {MAX_SEQUENCE} (2^53)"
        )))
    }
}

/// What an answer to a delivery says of its message: its aggregate, id and sequence. The route
/// keeps these and hands the message itself (its payload with it) to the inbox.
pub struct Delivered {
    pub aggregate_id: String,
    pub message_id: String,
    pub sequence: i64,
}

impl Delivered {
    pub fn of(message: &OrderedMessage) -> Delivered {
        Delivered {
            aggregate_id: message.aggregate_id.clone(),
            message_id: message.message_id.clone(),
            sequence: message.sequence,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregate_ids_are_short_and_url_safe() {
        for good in [
            "a",
            "acct-1",
            "tenant:42.orders_x",
            "...",
            ".a",
            &"z".repeat(64),
        ] {
            assert!(validate_aggregate_id("aggregateId", good).is_ok(), "{good}");
        }
        for bad in ["", ".", "..", "has space", "slash/x", "ü", &"z".repeat(65)] {
            assert!(validate_aggregate_id("aggregateId", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn message_ids_count_characters_not_bytes() {
        assert!(validate_message_id("messageId", &"é".repeat(100)).is_ok());
        assert!(validate_message_id("messageId", &"é".repeat(101)).is_err());
        assert!(validate_message_id("messageId", " ").is_err());
        assert!(validate_message_id("messageId", "a\nb").is_err());
    }

    #[test]
    fn sequences_stop_at_two_to_the_fifty_third() {
        assert!(validate_sequence("sequence", MAX_SEQUENCE, 1).is_ok());
        assert!(validate_sequence("sequence", MAX_SEQUENCE + 1, 1).is_err());
        assert!(validate_sequence("sequence", 0, 1).is_err());
    }
}
