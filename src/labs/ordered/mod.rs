//! Ordered delivery, two doors onto one inbox ([`ordered_inbox`]):
//!
//! - [`classroom`]: the lesson's `POST /ordered/apply` and `GET /ordered/state`, unchanged;
//! - [`aggregates`]: the general inbox `POST /aggregates/{id}/messages` for any aggregate, with
//!   verdicts that say what the caller can do, and the evidence (aggregate state, blocked/waiting
//!   inventory, timeline, dead letters);
//! - [`resolution`]: operator-approved poison resolution and its audit trail;
//! - [`producers`]: producer sessions (epochs, fencing), aggregate ownership and its transfer.
//!
//! The handlers take only the inbox ([`SharedInbox`]): the library decides, this module words the
//! answers.

mod aggregates;
mod classroom;
mod producers;
mod resolution;
mod verdicts;

use std::sync::Arc;

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::views::{Page, PageRequest};
use ordered_inbox::{Inbox, OrderedMessage};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa_axum::router::OpenApiRouter;

use crate::error::{AppError, problem_response_with};

pub(crate) use aggregates::general_message;

/// The inbox the handlers use, whatever store is underneath.
pub type SharedInbox = Arc<dyn Inbox>;

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::new()
        .merge(classroom::routes())
        .merge(aggregates::routes())
        .merge(resolution::routes())
        .merge(producers::routes())
}

/// The largest sequence the general door accepts: 2^53, the largest integer every JSON client
/// represents exactly.
pub const MAX_SEQUENCE: i64 = 1 << 53;
const MAX_AGGREGATE_ID: usize = 64;
const MAX_MESSAGE_ID: usize = 100;
/// Rows a list answers with when the caller gives no `limit`, and the most it may ask for.
const DEFAULT_LIMIT: i64 = 100;
const MAX_LIMIT: i64 = 1000;

/// An aggregate id: 1..64 characters of `A-Za-z0-9._:-`, but not `.` or `..`: clients normalise
/// those path segments away, so such an aggregate could be written once and never reached again.
pub(crate) fn validate_aggregate_id(name: &str, aggregate_id: &str) -> Result<(), AppError> {
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
pub(crate) fn producer_namespace(producer: Option<String>) -> Result<Option<String>, AppError> {
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
pub(crate) fn identity_words(producer: Option<&str>, message_id: &str) -> String {
    match producer {
        None => format!("message id '{message_id}'"),
        Some(producer) => format!("message id '{message_id}' of producer '{producer}'"),
    }
}

pub(crate) fn validate_message_id(name: &str, message_id: &str) -> Result<(), AppError> {
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

pub(crate) fn validate_sequence(name: &str, sequence: i64, minimum: i64) -> Result<(), AppError> {
    if (minimum..=MAX_SEQUENCE).contains(&sequence) {
        Ok(())
    } else {
        Err(AppError::bad_request(format!(
            "{name} must be a whole number from {minimum} to {MAX_SEQUENCE} (2^53)"
        )))
    }
}

fn validate_limit(limit: Option<i64>) -> Result<i64, AppError> {
    let limit = limit.unwrap_or(DEFAULT_LIMIT);
    if (1..=MAX_LIMIT).contains(&limit) {
        Ok(limit)
    } else {
        Err(AppError::bad_request(format!(
            "limit must be from 1 to {MAX_LIMIT}"
        )))
    }
}

/// A page request from `after` (a cursor: the `next` of the previous page) and `limit`.
pub(crate) fn page_request(
    after: Option<i64>,
    limit: Option<i64>,
) -> Result<PageRequest, AppError> {
    let after = match after {
        None => 0,
        Some(after) if after >= 0 => after,
        Some(_) => return Err(AppError::bad_request("after must be 0 or more")),
    };
    Ok(PageRequest {
        after,
        limit: validate_limit(limit)?,
    })
}

/// One page of a list as the body shows it: the items under `name`, then `next`, the `after` of
/// the following page (null at the end), and any fields the route adds first.
pub(crate) fn page_body<T: Serialize>(mut head: Value, name: &str, page: Page<T>) -> Value {
    if let Some(body) = head.as_object_mut() {
        body.insert(name.to_owned(), json!(page.items));
        body.insert("next".to_owned(), json!(page.next));
    }
    head
}

/// 429: a new poison message for an aggregate whose quarantine is full. Nothing was recorded
/// but one (bounded) timeline observation.
fn quarantine_full(message: &OrderedMessage, expected: i64, open: usize, limit: usize) -> Response {
    problem_response_with(
        StatusCode::TOO_MANY_REQUESTS,
        "Quarantine full",
        Some(&format!(
            "aggregate '{}' already holds {open} open dead letters, the most it keeps ({limit}); this poison message was not recorded. Resolve the open ones, or deliver a valid message for sequence {expected}",
            message.aggregate_id
        )),
        json!({
            "outcome": "quarantine full",
            "aggregateId": message.aggregate_id,
            "messageId": message.message_id,
            "expected": expected,
            "openDeadLetters": open,
            "limit": limit,
            "retryable": false,
        }),
    )
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

    #[test]
    fn a_page_body_ends_with_its_cursor() {
        let page = Page {
            items: vec![1, 2],
            next: Some(2),
        };
        let body = page_body(json!({"aggregateId": "a"}), "events", page);
        assert_eq!(
            body,
            json!({"aggregateId": "a", "events": [1, 2], "next": 2})
        );
    }
}
