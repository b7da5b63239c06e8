//! The answers every door that reads the inbox or resolves in it words the same way (the lab's
//! routes, its console and the gate): the 404 of an unknown aggregate or dead letter, one dead
//! letter read, the 409s of a resolution, and the audit trail's two numbered pages merged into
//! one. Where a door's words differ (the path of its dead-letter resolution), the door passes
//! them in.

use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::gaps::GapConflict;
use ordered_inbox::resolution::ConflictKind;
use ordered_inbox::views::Page;
use serde::Serialize;
use serde_json::{Value, json};

use crate::error::{AppError, json_response, problem_response_with};
use crate::inbox::SharedInbox;
use crate::inbox::input::{identity_words, producer_namespace, validate_message_id};

/// The `Retry-After` of a 429 "quarantine full", in seconds: the quarantine empties only as an
/// operator resolves its dead letters, which takes minutes rather than seconds.
pub const QUARANTINE_FULL_RETRY_AFTER_SECONDS: u32 = 60;

/// The 404 of an aggregate no message was ever recorded for.
pub fn unknown_aggregate(aggregate_id: &str) -> AppError {
    AppError::problem_with_detail(
        StatusCode::NOT_FOUND,
        "Unknown aggregate",
        format!(
            "no message has been recorded for aggregate '{aggregate_id}'; it expects sequence 1"
        ),
    )
}

/// The 404 of a dead letter no message of this identity became.
pub fn no_such_dead_letter(producer: Option<&str>, message_id: &str) -> AppError {
    AppError::problem_with_detail(
        StatusCode::NOT_FOUND,
        "No such dead letter",
        format!(
            "no dead letter has {}",
            identity_words(producer, message_id)
        ),
    )
}

/// One dead letter, named by its message id and its producer (absent for an anonymous
/// delivery's), with its lifecycle and resolution; or the 400 or 404 that says why not.
pub async fn find_dead_letter(
    inbox: &SharedInbox,
    message_id: String,
    producer: Option<String>,
) -> Result<Response, AppError> {
    validate_message_id("messageId", &message_id)?;
    let producer = producer_namespace(producer)?;
    match inbox
        .reads()
        .dead_letter(producer.clone(), message_id.clone())
        .await?
    {
        Some(view) => Ok(json_response(StatusCode::OK, json!(view))),
        None => Err(no_such_dead_letter(producer.as_deref(), &message_id)),
    }
}

/// A resolution's 409: what failed and what to do, then the state it failed against.
pub fn conflict_response(title: &str, detail: &str, current: impl Serialize) -> Response {
    problem_response_with(
        StatusCode::CONFLICT,
        title,
        Some(detail),
        json!({"current": current}),
    )
}

/// The words of a dead letter resolution's 409 where a door says more or less than another.
pub struct DeadLetterConflictWords {
    /// The detail of a dead letter recorded without a sequence or payload.
    pub sequence_unknown: &'static str,
    /// What follows "needs a new id" when the replacement's id is already known (where to give
    /// one), or nothing.
    pub new_id_hint: &'static str,
}

/// The title and detail of a dead letter resolution's 409: what failed, and what the operator
/// can do.
pub fn dead_letter_conflict_words(
    kind: &ConflictKind,
    words: &DeadLetterConflictWords,
) -> (&'static str, String) {
    match kind {
        ConflictKind::AlreadyResolved => (
            "The dead letter is already resolved",
            "a different resolution was recorded for it; only an identical repeat by the same operator answers 200".to_owned(),
        ),
        ConflictKind::NotOpen(status) => (
            "The dead letter is not open",
            format!("it is {status}: another message already took its sequence"),
        ),
        ConflictKind::SequenceUnknown => (
            "The dead letter's sequence is unknown",
            words.sequence_unknown.to_owned(),
        ),
        ConflictKind::ExpectedLastMismatch {
            expected_last,
            last,
        } => expected_last_words(*expected_last, *last),
        ConflictKind::NotNextSequence { sequence, needed } => (
            "The dead letter does not hold the next sequence",
            format!("it holds sequence {sequence}, and the aggregate needs {needed}"),
        ),
        ConflictKind::ReplacementIdUsed { message_id } => (
            "The replacement's message id is already used",
            format!(
                "message id '{message_id}' is already known; a replacement is a new message and needs a new id{}",
                words.new_id_hint
            ),
        ),
    }
}

/// The title and detail of a gap resolution's 409: what failed, and what the operator can do.
/// `dead_letter_route` is how this door names its dead-letter resolution.
pub fn gap_conflict_words(
    conflict: &GapConflict,
    dead_letter_route: &str,
) -> (&'static str, String) {
    match conflict {
        GapConflict::AlreadySkipped {
            resolution_id,
            range,
        } => (
            "The gap is already resolved",
            format!(
                "resolution {} skipped sequences {} through {}; only an identical repeat by the same operator answers 200",
                resolution_id.unwrap_or_default(),
                range.from,
                range.through
            ),
        ),
        GapConflict::AppliedInRange {
            sequence,
            message_id,
        } => (
            "A message took a sequence of the range",
            format!(
                "message '{message_id}' was applied at sequence {sequence}: it is not missing; review the current state and decide again"
            ),
        ),
        GapConflict::ExpectedLastMismatch {
            expected_last,
            last,
        } => expected_last_words(*expected_last, *last),
        GapConflict::NotExpected { from, expected } => (
            "The range does not start at the expected sequence",
            format!("from is {from}, and the aggregate expects sequence {expected}"),
        ),
        GapConflict::DeadLetterOpen { message_id } => (
            "A dead letter holds the first sequence",
            format!(
                "dead letter '{message_id}' holds it: resolve it with POST {dead_letter_route} instead"
            ),
        ),
        GapConflict::HeldInRange {
            sequence,
            message_id,
        } => (
            "A held message lies inside the range",
            format!(
                "message '{message_id}' is held at sequence {sequence}: it is not missing; skip only the sequences below it"
            ),
        ),
    }
}

fn expected_last_words(expected_last: i64, last: i64) -> (&'static str, String) {
    (
        "The aggregate is not at the expected last sequence",
        format!(
            "expectedLast is {expected_last} but the aggregate's last sequence is {last}: review the current state and decide again"
        ),
    )
}

/// Two pages of the one numbered audit trail (dead letters' and gaps' resolutions), read from
/// the same cursor, as one page in number order: another page exists when either had more, or
/// when together they hold more than `limit`.
pub fn merged_trail(
    first: Page<(Option<i64>, Value)>,
    second: Page<(Option<i64>, Value)>,
    limit: i64,
) -> Page<Value> {
    let more = first.next.is_some() || second.next.is_some();
    let mut rows: Vec<(i64, Value)> = first
        .items
        .into_iter()
        .chain(second.items)
        .map(|(id, row)| (id.unwrap_or(0), row))
        .collect();
    rows.sort_by_key(|(id, _)| *id);
    let limit = usize::try_from(limit).unwrap_or(0);
    let more = more || rows.len() > limit;
    rows.truncate(limit);
    Page {
        next: if more {
            rows.last().map(|(id, _)| *id)
        } else {
            None
        },
        items: rows.into_iter().map(|(_, row)| row).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(ids: &[i64], more: bool) -> Page<(Option<i64>, Value)> {
        Page {
            items: ids
                .iter()
                .map(|id| (Some(*id), json!({"resolutionId": id})))
                .collect(),
            next: more.then(|| ids.last().copied().unwrap_or(0)),
        }
    }

    #[test]
    fn two_pages_of_the_trail_merge_in_number_order_and_say_whether_more_follow() {
        let both = merged_trail(page(&[1, 4], false), page(&[2, 3], false), 3);
        let ids: Vec<i64> = both
            .items
            .iter()
            .filter_map(|row| row["resolutionId"].as_i64())
            .collect();
        assert_eq!((ids, both.next), (vec![1, 2, 3], Some(3)));
        let short = merged_trail(page(&[1], true), page(&[2], false), 3);
        assert_eq!(short.next, Some(2));
        let end = merged_trail(page(&[1], false), page(&[], false), 3);
        assert_eq!(end.next, None);
    }
}
