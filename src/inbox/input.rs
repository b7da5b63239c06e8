//! The message input the doors parse: the HTTP edge's checks of ids and sequences, and the
//! lesson's general-door body, whose amount becomes the ledger's payload.

use ordered_inbox::OrderedMessage;
use serde::Deserialize;
use utoipa::ToSchema;

pub use http_edge::inbox::input::*;

use crate::http::error::{AppError, RequestBody};

/// A delivery to the general door. The aggregate comes from the path; a body `aggregateId`, if
/// present, must name the same one. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageInput {
    /// 1 to 100 characters, not blank, no control characters; never changes meaning.
    #[schema(min_length = 1, max_length = 100)]
    message_id: String,
    #[schema(minimum = 1, maximum = 9007199254740992_i64)]
    sequence: i64,
    /// A negative amount is poison: it is quarantined.
    amount: i32,
    #[schema(nullable = false)]
    aggregate_id: Option<String>,
}

impl RequestBody for MessageInput {
    const FIELDS: &'static [&'static str] = &["messageId", "sequence", "amount", "aggregateId"];
}

impl MessageInput {
    pub fn validate(self, aggregate_id: String) -> Result<OrderedMessage, AppError> {
        validate_message_id("messageId", &self.message_id)?;
        validate_sequence("sequence", self.sequence, 1)?;
        if let Some(named) = &self.aggregate_id
            && *named != aggregate_id
        {
            return Err(AppError::bad_request(format!(
                "the body's aggregateId '{named}' differs from the path's '{aggregate_id}'"
            )));
        }
        Ok(super::ledger::message(
            self.message_id,
            aggregate_id,
            self.sequence,
            i64::from(self.amount),
        ))
    }
}

/// A general-door body for `aggregate_id`, checked exactly as the HTTP door checks it (the
/// aggregate id, then the JSON); the error is the detail a 400 would carry.
pub fn general_message(aggregate_id: String, body: &[u8]) -> Result<OrderedMessage, String> {
    validate_aggregate_id("aggregateId", &aggregate_id).map_err(|e| e.to_string())?;
    let input: MessageInput = crate::http::error::parse_body(body).map_err(|e| e.to_string())?;
    input.validate(aggregate_id).map_err(|e| e.to_string())
}
