//! An operator's bulk decisions on open dead letters, chosen by one filter:
//!
//! - `POST /v1/deadletters/recheck[?dryRun=true]` validates each matching dead letter again
//!   against the message types in use (a reload may have corrected a schema) and accepts each
//!   that passes now: its own message is applied as it was delivered, at its sequence, and the
//!   held successors behind it drain in the same transaction;
//! - `POST /v1/deadletters/skip[?dryRun=true]` skips each matching dead letter's sequence, for
//!   messages that will never be valid (each skipped sequence leaves a `gate.skipped` marker in
//!   the output).
//!
//! Each dead letter is its own audited resolution (`accept` or `skip`, naming the operator; an
//! accept's reason names the configuration generation it passed), written by the library in its
//! own transaction, only at the aggregate's next sequence (`expectedLast` is the sequence before
//! it): the library's per-aggregate serialization and its preconditions make a repeated call, or
//! two calls at once, apply nothing twice. A call acts on at most `limit` dead letters; `next`
//! says where the following call resumes.

use std::collections::HashMap;

use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ordered_inbox::clock;
use ordered_inbox::model::DeadLetterStatus;
use ordered_inbox::resolution::{
    Action, ConflictKind, Mode, ResolutionError, ResolutionRequest, Resolved,
};
use ordered_inbox::views::{DeadLetterFilter, DeadLetterView, PageRequest};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::PayloadLimit;
use super::messages::{validate_type, within_limit};
use crate::auth::{Operator, operator_revoked};
use crate::handler::{NOT_A_GATE_MESSAGE, SharedTypes, open_envelope};
use crate::schemas::MessageTypes;
use http_edge::error::{AppError, Json, Query, RequestBody};
use http_edge::inbox::SharedInbox;
use http_edge::inbox::input::validate_aggregate_id;
use http_edge::inbox::requests::{mode, reason};

/// The dead letters one call acts on when the filter gives no `limit`, and the most it may.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 500;
/// The most open dead letters one call looks at to find its matches: a narrow filter over many
/// open dead letters answers with `next` rather than reading them all.
const MAX_SCANNED: usize = 5000;
/// The longest `reasonContains`.
const MAX_REASON_FILTER: usize = 200;
/// The most drained messages one accepted or skipped dead letter reports.
const DRAINED_SHOWN: i64 = 1000;

pub(super) fn routes<S>(body_limit: usize) -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    SharedTypes: FromRef<S>,
    PayloadLimit: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(recheck))
        .routes(routes!(skip))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            PayloadLimit(body_limit),
            crate::edge::refuse_declared_oversize,
        ))
}

/// Which open dead letters a bulk call acts on (all the given conditions hold), how many, and
/// why. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct BulkInput {
    /// Only dead letters whose message is of this type.
    #[serde(rename = "type")]
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    message_type: Option<String>,
    /// Only dead letters of aggregates whose id starts with this.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    aggregate_prefix: Option<String>,
    /// Only dead letters whose reason contains this, ignoring case (1 to 200 characters).
    #[schema(min_length = 1, max_length = 200)]
    reason_contains: Option<String>,
    /// Only dead letters first seen before this instant (RFC 3339).
    #[schema(format = DateTime)]
    opened_before: Option<String>,
    /// The most dead letters this call acts on: 1 to 500, 100 when absent.
    #[schema(minimum = 1, maximum = 500)]
    limit: Option<i64>,
    /// Where to resume: the `next` of the previous call's answer (0 or absent: from the first).
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    after: Option<i64>,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
}

impl RequestBody for BulkInput {
    const FIELDS: &'static [&'static str] = &[
        "type",
        "aggregatePrefix",
        "reasonContains",
        "openedBefore",
        "limit",
        "after",
        "reason",
    ];
}

/// A checked [`BulkInput`].
#[derive(Debug)]
struct Bulk {
    filter: Filter,
    limit: usize,
    after: i64,
    reason: String,
}

/// The conditions a dead letter must meet.
#[derive(Debug, Default)]
struct Filter {
    message_type: Option<String>,
    aggregate_prefix: Option<String>,
    /// Lower-cased.
    reason_contains: Option<String>,
    /// In the stored format, so that text order is time order.
    opened_before: Option<String>,
}

impl BulkInput {
    fn checked(self) -> Result<Bulk, AppError> {
        let reason = reason(&self.reason)?;
        if let Some(message_type) = &self.message_type {
            validate_type("type", message_type)?;
        }
        if let Some(prefix) = &self.aggregate_prefix {
            validate_aggregate_id("aggregatePrefix", prefix)?;
        }
        let reason_contains = match self.reason_contains {
            Some(text) if text.is_empty() || text.chars().count() > MAX_REASON_FILTER => {
                return Err(AppError::bad_request(format!(
                    "reasonContains must be 1 to {MAX_REASON_FILTER} characters"
                )));
            }
            text => text.map(|text| text.to_lowercase()),
        };
        let opened_before = match self.opened_before {
            Some(text) => match clock::stored_instant(&text) {
                Some(instant) => Some(instant),
                None => {
                    return Err(AppError::bad_request(
                        "openedBefore must be an RFC 3339 instant, such as 2026-01-31T09:30:00Z",
                    ));
                }
            },
            None => None,
        };
        let limit = match self.limit {
            None => DEFAULT_LIMIT,
            Some(limit) => usize::try_from(limit)
                .ok()
                .filter(|limit| (1..=MAX_LIMIT).contains(limit))
                .ok_or_else(|| {
                    AppError::bad_request(format!("limit must be from 1 to {MAX_LIMIT}"))
                })?,
        };
        let after = match self.after {
            None => 0,
            Some(after) if after >= 0 => after,
            Some(_) => return Err(AppError::bad_request("after must be 0 or more")),
        };
        Ok(Bulk {
            filter: Filter {
                message_type: self.message_type,
                aggregate_prefix: self.aggregate_prefix,
                reason_contains,
                opened_before,
            },
            limit,
            after,
            reason,
        })
    }
}

impl Filter {
    fn matches(&self, letter: &DeadLetterView) -> bool {
        let aggregate = letter.aggregate_id.as_deref().unwrap_or_default();
        let type_matches = self.message_type.as_deref().is_none_or(|wanted| {
            letter
                .payload
                .as_ref()
                .and_then(open_envelope)
                .is_some_and(|(message_type, _)| message_type == wanted)
        });
        type_matches
            && self
                .aggregate_prefix
                .as_deref()
                .is_none_or(|prefix| aggregate.starts_with(prefix))
            && self
                .reason_contains
                .as_deref()
                .is_none_or(|text| letter.reason.as_str().to_lowercase().contains(text))
            && self.opened_before.as_deref().is_none_or(|before| {
                letter
                    .first_seen
                    .as_deref()
                    .is_some_and(|seen| seen < before)
            })
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct BulkOptions {
    /// Report what the call would do, and write nothing.
    dry_run: Option<bool>,
}

/// One dead letter in a bulk answer.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct BulkMessage {
    /// The producer whose message id it is (absent: the anonymous namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    producer: Option<String>,
    message_id: String,
    sequence: Option<i64>,
    /// The audit row of its resolution (absent in a dry run, and for one not resolved).
    #[serde(skip_serializing_if = "Option::is_none")]
    resolution_id: Option<i64>,
    /// Why it was not resolved (absent for one that was).
    #[serde(skip_serializing_if = "Option::is_none")]
    why: Option<String>,
}

/// A held successor that applied behind a resolved dead letter.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct DrainedEntry {
    message_id: String,
    sequence: Option<i64>,
}

/// What a recheck did for one aggregate (in a dry run: would do).
#[derive(Debug, Default, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct AggregateRecheck {
    aggregate_id: String,
    /// Accepted: passes the message types in use, applied as delivered at its sequence.
    applied: Vec<BulkMessage>,
    /// Still poison, with why.
    failing: Vec<BulkMessage>,
    /// Not resolved now for another reason (not the aggregate's next sequence, or another
    /// resolution took it first), with why.
    conflicts: Vec<BulkMessage>,
    /// The messages applied behind the accepted ones, in sequence order: the held successors
    /// they released (empty in a dry run).
    drained: Vec<DrainedEntry>,
}

/// A recheck's answer.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct RecheckAnswer {
    dry_run: bool,
    /// The configuration generation whose message types the dead letters were checked against.
    generation: u64,
    /// How many dead letters matched the filter and were looked at (at most `limit`).
    matched: usize,
    /// The `after` of the call that goes on where this one stopped; null when it reached the
    /// last open dead letter.
    next: Option<i64>,
    /// Per aggregate, in the order their first dead letter was recorded.
    aggregates: Vec<AggregateRecheck>,
}

/// What a bulk skip did for one aggregate (in a dry run: would do).
#[derive(Debug, Default, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct AggregateSkip {
    aggregate_id: String,
    /// Skipped: the sequence taken without effect, a `gate.skipped` marker in the output.
    skipped: Vec<BulkMessage>,
    /// Not skipped now (not the aggregate's next sequence, or another resolution took it
    /// first), with why.
    conflicts: Vec<BulkMessage>,
    /// The messages applied behind the skipped sequences, in sequence order (empty in a dry
    /// run).
    drained: Vec<DrainedEntry>,
}

/// A bulk skip's answer.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct SkipAnswer {
    dry_run: bool,
    /// How many dead letters matched the filter and were looked at (at most `limit`).
    matched: usize,
    /// The `after` of the call that goes on where this one stopped; null when it reached the
    /// last open dead letter.
    next: Option<i64>,
    /// Per aggregate, in the order their first dead letter was recorded.
    aggregates: Vec<AggregateSkip>,
}

/// `POST /v1/deadletters/recheck[?dryRun=true]`.
#[utoipa::path(post, path = "/v1/deadletters/recheck", tag = "operators",
    params(BulkOptions),
    request_body = BulkInput,
    security(("operator" = [])),
    responses(
        (status = 200, description = "Per aggregate: what was accepted (or, with dryRun, would be), what still fails and why, and what drained", body = RecheckAnswer),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 413, response = http_edge::openapi::ContentTooLarge),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn recheck(
    Operator(operator): Operator,
    State(inbox): State<SharedInbox>,
    State(types): State<SharedTypes>,
    State(limit): State<PayloadLimit>,
    Query(options): Query<BulkOptions>,
    body: Result<Json<BulkInput>, AppError>,
) -> Result<Response, AppError> {
    let Json(input) = within_limit(body, limit)?;
    let bulk = input.checked()?;
    let mode = mode(options.dry_run);
    // One set of types for the whole call: the generation named is the one checked against.
    let types = types.load_full();
    let generation = types.generation();
    let audit = format!(
        "{} (recheck: passes the message types of configuration generation {generation})",
        bulk.reason
    );
    let (letters, next) = candidates(&inbox, &bulk).await?;
    let matched = letters.len();
    let decision = Decision {
        operator: &operator,
        reason: &audit,
        action: Action::Accept,
        mode,
    };
    let walked = match walk(&inbox, &decision, letters, |letter| passes(&types, letter)).await {
        Ok(walked) => walked,
        Err(halted) => return halted.into_result(),
    };
    let aggregates = walked
        .into_iter()
        .map(|mut walked| AggregateRecheck {
            applied: walked.take(&[Outcome::Resolved]),
            failing: walked.take(&[Outcome::StillPoison]),
            conflicts: walked.take(&[Outcome::Conflict]),
            aggregate_id: walked.aggregate_id,
            drained: walked.drained,
        })
        .collect();
    let body = RecheckAnswer {
        dry_run: mode == Mode::DryRun,
        generation,
        matched,
        next,
        aggregates,
    };
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

/// `POST /v1/deadletters/skip[?dryRun=true]`.
#[utoipa::path(post, path = "/v1/deadletters/skip", tag = "operators",
    params(BulkOptions),
    request_body = BulkInput,
    security(("operator" = [])),
    responses(
        (status = 200, description = "Per aggregate: what was skipped (or, with dryRun, would be), what was not and why, and what drained", body = SkipAnswer),
        (status = 400, response = http_edge::openapi::BadRequest),
        (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json",
            headers(("www-authenticate" = String))),
        (status = 413, response = http_edge::openapi::ContentTooLarge),
        (status = 500, response = http_edge::openapi::StoreFailed),
        (status = 503, response = http_edge::openapi::StoreUnavailable),
    ),
)]
async fn skip(
    Operator(operator): Operator,
    State(inbox): State<SharedInbox>,
    State(limit): State<PayloadLimit>,
    Query(options): Query<BulkOptions>,
    body: Result<Json<BulkInput>, AppError>,
) -> Result<Response, AppError> {
    let Json(input) = within_limit(body, limit)?;
    let bulk = input.checked()?;
    let mode = mode(options.dry_run);
    let (letters, next) = candidates(&inbox, &bulk).await?;
    let matched = letters.len();
    let decision = Decision {
        operator: &operator,
        reason: &bulk.reason,
        action: Action::Skip,
        mode,
    };
    let walked = match walk(&inbox, &decision, letters, |_| Ok(())).await {
        Ok(walked) => walked,
        Err(halted) => return halted.into_result(),
    };
    let aggregates = walked
        .into_iter()
        .map(|mut walked| AggregateSkip {
            skipped: walked.take(&[Outcome::Resolved]),
            // A skip applies nothing, so nothing of it can be poison.
            conflicts: walked.take(&[Outcome::StillPoison, Outcome::Conflict]),
            aggregate_id: walked.aggregate_id,
            drained: walked.drained,
        })
        .collect();
    let body = SkipAnswer {
        dry_run: mode == Mode::DryRun,
        matched,
        next,
        aggregates,
    };
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

/// The open dead letters the filter matches, at most `limit`, the first recorded first, and the
/// cursor a following call resumes from (`None`: none are left after them). Each page asks for
/// no more than the matches still wanted, so that every page read is wholly looked at and its
/// cursor is where the next call goes on.
async fn candidates(
    inbox: &SharedInbox,
    bulk: &Bulk,
) -> Result<(Vec<DeadLetterView>, Option<i64>), AppError> {
    let filter = DeadLetterFilter {
        status: Some(DeadLetterStatus::Open),
        aggregate_id: None,
    };
    let mut found = Vec::new();
    let mut after = bulk.after;
    let mut scanned = 0;
    loop {
        let wanted = bulk.limit.saturating_sub(found.len());
        if wanted == 0 || scanned >= MAX_SCANNED {
            return Ok((found, Some(after)));
        }
        let page = PageRequest {
            after,
            limit: i64::try_from(wanted).unwrap_or(i64::MAX),
        };
        let page = inbox.reads().dead_letters(filter.clone(), page).await?;
        scanned += page.items.len();
        found.extend(
            page.items
                .into_iter()
                .filter(|letter| bulk.filter.matches(letter)),
        );
        match page.next {
            Some(next) => after = next,
            None => return Ok((found, None)),
        }
    }
}

/// The dead letters grouped by aggregate, the aggregates in the order of their first dead
/// letter, each one's in sequence order: only the aggregate's next sequence can be resolved,
/// so the lowest goes first.
fn by_aggregate(letters: Vec<DeadLetterView>) -> Vec<(String, Vec<DeadLetterView>)> {
    let mut groups: Vec<(String, Vec<DeadLetterView>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for letter in letters {
        let aggregate = letter.aggregate_id.clone().unwrap_or_default();
        let at = *index.entry(aggregate.clone()).or_insert_with(|| {
            groups.push((aggregate, Vec::new()));
            groups.len() - 1
        });
        if let Some((_, group)) = groups.get_mut(at) {
            group.push(letter);
        }
    }
    for (_, group) in &mut groups {
        group.sort_by_key(|letter| letter.sequence.unwrap_or(i64::MAX));
    }
    groups
}

/// Whether the dead letter's message passes `types` now, or why not.
fn passes(types: &MessageTypes, letter: &DeadLetterView) -> Result<(), String> {
    let Some((message_type, payload)) = letter.payload.as_ref().and_then(open_envelope) else {
        return Err(NOT_A_GATE_MESSAGE.to_owned());
    };
    types.validate(message_type, payload)
}

/// What a bulk call does to each dead letter it resolves.
struct Decision<'a> {
    operator: &'a str,
    /// The audit trail's reason.
    reason: &'a str,
    action: Action,
    mode: Mode,
}

/// Where one dead letter of a bulk call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Resolved (in a dry run: would be).
    Resolved,
    /// Its message is still poison.
    StillPoison,
    /// Not resolved now for another reason.
    Conflict,
}

/// One aggregate's dead letters after a bulk call, in the order they were tried, and the
/// messages the resolved ones released.
struct Walked {
    aggregate_id: String,
    letters: Vec<(Outcome, BulkMessage)>,
    drained: Vec<DrainedEntry>,
}

impl Walked {
    /// Takes the dead letters that ended in one of `outcomes`, in the order they were tried.
    fn take(&mut self, outcomes: &[Outcome]) -> Vec<BulkMessage> {
        let (taken, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.letters)
            .into_iter()
            .partition(|(outcome, _)| outcomes.contains(outcome));
        self.letters = rest;
        taken.into_iter().map(|(_, message)| message).collect()
    }
}

/// Why a bulk call ended before its last dead letter.
enum Halted {
    /// The operator was revoked: the call ends with this answer.
    Refused(Response),
    /// The store failed (what was resolved stays resolved).
    Failed(AppError),
}

impl Halted {
    fn into_result(self) -> Result<Response, AppError> {
        match self {
            Halted::Refused(response) => Ok(response),
            Halted::Failed(error) => Err(error),
        }
    }
}

/// Resolves the dead letters with `decision`, per aggregate and lowest sequence first (only an
/// aggregate's next sequence can be resolved). One that fails `precheck` is still poison, and
/// no resolution is tried for it.
async fn walk(
    inbox: &SharedInbox,
    decision: &Decision<'_>,
    letters: Vec<DeadLetterView>,
    precheck: impl Fn(&DeadLetterView) -> Result<(), String>,
) -> Result<Vec<Walked>, Halted> {
    let mut aggregates = Vec::new();
    for (aggregate_id, letters) in by_aggregate(letters) {
        let mut done = Walked {
            aggregate_id,
            letters: Vec::with_capacity(letters.len()),
            drained: Vec::new(),
        };
        for letter in letters {
            if let Err(why) = precheck(&letter) {
                done.letters
                    .push((Outcome::StillPoison, unresolved(letter, why)));
                continue;
            }
            let ended = match resolve(inbox, decision, letter).await {
                Decided::Resolved(message, sequence) => {
                    drained(inbox, &done.aggregate_id, sequence, &mut done.drained)
                        .await
                        .map_err(Halted::Failed)?;
                    (Outcome::Resolved, message)
                }
                Decided::Rehearsed(message) => (Outcome::Resolved, message),
                Decided::StillPoison(message) => (Outcome::StillPoison, message),
                Decided::Conflict(message) => (Outcome::Conflict, message),
                Decided::Refused(response) => return Err(Halted::Refused(response)),
                Decided::Failed(error) => return Err(Halted::Failed(error)),
            };
            done.letters.push(ended);
        }
        aggregates.push(done);
    }
    Ok(aggregates)
}

/// How one dead letter's resolution ended.
enum Decided {
    /// Written, with the sequence it took.
    Resolved(BulkMessage, i64),
    /// What a dry run would write.
    Rehearsed(BulkMessage),
    /// The message is still poison (for an accept: found so in the transaction).
    StillPoison(BulkMessage),
    /// A precondition failed, or an identical resolution was recorded before.
    Conflict(BulkMessage),
    /// The operator was revoked: the call ends with this answer.
    Refused(Response),
    /// The store failed: the call ends with this error (what was resolved stays resolved).
    Failed(AppError),
}

/// Resolves one dead letter with `decision`, at its sequence: `expectedLast` is the sequence
/// before it, so that it resolves only as the aggregate's next.
async fn resolve(inbox: &SharedInbox, decision: &Decision<'_>, letter: DeadLetterView) -> Decided {
    let Some(sequence) = letter.sequence else {
        let why = "it was recorded without a sequence or payload";
        return Decided::Conflict(unresolved(letter, why.to_owned()));
    };
    let request = ResolutionRequest {
        producer: letter.producer.clone(),
        dead_letter_id: letter.message_id.clone(),
        operator: decision.operator.to_owned(),
        action: decision.action.clone(),
        expected_last: sequence.saturating_sub(1),
        reason: decision.reason.to_owned(),
    };
    match inbox.resolve(request, decision.mode).await {
        Ok(Resolved::New(record)) => {
            let mut message = unresolved(letter, String::new());
            message.why = None;
            message.resolution_id = record.resolution_id;
            Decided::Resolved(message, sequence)
        }
        Ok(Resolved::DryRun(_)) => {
            let mut message = unresolved(letter, String::new());
            message.why = None;
            Decided::Rehearsed(message)
        }
        Ok(Resolved::Repeated(record)) => {
            let why = format!(
                "already resolved by the same operator with the same reason (resolution {})",
                record.resolution_id.unwrap_or_default()
            );
            Decided::Conflict(unresolved(letter, why))
        }
        Err(ResolutionError::ReplacementQuarantined(reason)) => {
            Decided::StillPoison(unresolved(letter, reason.as_str().to_owned()))
        }
        Err(ResolutionError::Conflict { kind, .. }) => {
            let why = conflict_words(&kind);
            Decided::Conflict(unresolved(letter, why))
        }
        Err(ResolutionError::NotFound(_)) => {
            Decided::Conflict(unresolved(letter, "it no longer exists".to_owned()))
        }
        Err(ResolutionError::Unauthorized) => Decided::Refused(operator_revoked()),
        Err(ResolutionError::Store(error)) => Decided::Failed(AppError::from(error)),
    }
}

/// A dead letter of the answer that was not resolved, and why.
fn unresolved(letter: DeadLetterView, why: String) -> BulkMessage {
    BulkMessage {
        producer: letter.producer,
        message_id: letter.message_id,
        sequence: letter.sequence,
        resolution_id: None,
        why: Some(why),
    }
}

/// Why a dead letter could not be resolved now, in the words of a bulk answer.
fn conflict_words(kind: &ConflictKind) -> String {
    match kind {
        ConflictKind::AlreadyResolved => "another resolution was recorded for it first".to_owned(),
        ConflictKind::NotOpen(status) => {
            format!("it is {status}: another message already took its sequence")
        }
        ConflictKind::SequenceUnknown => "it was recorded without a sequence or payload".to_owned(),
        ConflictKind::ExpectedLastMismatch { last, .. } => {
            format!("the aggregate's last sequence is {last}: it is not the next one")
        }
        ConflictKind::NotNextSequence { sequence, needed } => {
            format!("it holds sequence {sequence}, and the aggregate needs {needed}")
        }
        ConflictKind::ReplacementIdUsed { message_id } => {
            format!("message id '{message_id}' is already applied")
        }
    }
}

/// The messages applied after `sequence` (a dead letter this call just resolved), added to
/// `drained`: with its aggregate blocked until then, those are the held successors it released
/// (a delivery that arrives in between would show too).
async fn drained(
    inbox: &SharedInbox,
    aggregate_id: &str,
    sequence: i64,
    drained: &mut Vec<DrainedEntry>,
) -> Result<(), AppError> {
    let page = PageRequest {
        after: sequence,
        limit: DRAINED_SHOWN,
    };
    let applied = inbox
        .reads()
        .applied_messages(aggregate_id.to_owned(), page)
        .await?;
    drained.extend(applied.items.into_iter().map(|message| DrainedEntry {
        message_id: message.message_id,
        sequence: message.sequence,
    }));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ordered_inbox::model::QuarantineReason;
    use serde_json::json;

    fn letter(id: &str, aggregate: &str, sequence: i64, first_seen: &str) -> DeadLetterView {
        DeadLetterView {
            producer: None,
            message_id: id.into(),
            aggregate_id: Some(aggregate.into()),
            sequence: Some(sequence),
            payload: Some(json!({"type": "order.placed", "payload": {"orderId": "o"}})),
            reason: QuarantineReason::new("payload does not match: \"note\" is not allowed"),
            first_seen: Some(first_seen.into()),
            last_seen: Some(first_seen.into()),
            observations: 1,
            status: DeadLetterStatus::Open,
            superseded_by: None,
            closed_at: None,
            resolution: None,
        }
    }

    fn input(members: serde_json::Value) -> Result<Bulk, AppError> {
        let input: BulkInput = serde_json::from_value(members).expect("a body");
        input.checked()
    }

    #[test]
    fn each_condition_of_the_filter_must_hold() {
        let bulk = input(json!({
            "type": "order.placed",
            "aggregatePrefix": "order-",
            "reasonContains": "NOTE",
            "openedBefore": "2026-01-01T00:00:00+01:00",
            "reason": "schema fixed"
        }))
        .expect("valid");
        let early = "2025-12-31T22:59:59.999Z";
        assert!(bulk.filter.matches(&letter("m", "order-1", 2, early)));
        assert!(!bulk.filter.matches(&letter("m", "invoice-1", 2, early)));
        assert!(
            !bulk
                .filter
                .matches(&letter("m", "order-1", 2, "2025-12-31T23:00:00.000Z")),
            "opened at the instant itself is not before it"
        );
        let mut other_type = letter("m", "order-1", 2, early);
        other_type.payload = Some(json!({"type": "order.paid", "payload": {}}));
        assert!(!bulk.filter.matches(&other_type));
        let mut other_reason = letter("m", "order-1", 2, early);
        other_reason.reason = QuarantineReason::new("unknown message type");
        assert!(!bulk.filter.matches(&other_reason));
        let everything = input(json!({"reason": "all"})).expect("valid");
        assert!(everything.filter.matches(&other_reason));
        assert_eq!((everything.limit, everything.after), (DEFAULT_LIMIT, 0));
    }

    #[test]
    fn a_malformed_filter_is_refused() {
        for body in [
            json!({"reason": " "}),
            json!({"reason": "r", "limit": 0}),
            json!({"reason": "r", "limit": 501}),
            json!({"reason": "r", "after": -1}),
            json!({"reason": "r", "type": "no spaces"}),
            json!({"reason": "r", "aggregatePrefix": ""}),
            json!({"reason": "r", "reasonContains": ""}),
            json!({"reason": "r", "openedBefore": "yesterday"}),
        ] {
            assert!(input(body.clone()).is_err(), "{body}");
        }
    }

    #[test]
    fn each_answer_list_keeps_the_order_its_dead_letters_were_tried_in() {
        let message = |id: &str| unresolved(letter(id, "a", 2, "t"), String::new());
        let mut walked = Walked {
            aggregate_id: "a".into(),
            letters: vec![
                (Outcome::Conflict, message("c1")),
                (Outcome::Resolved, message("r1")),
                (Outcome::StillPoison, message("p1")),
                (Outcome::Conflict, message("c2")),
            ],
            drained: Vec::new(),
        };
        let ids = |messages: Vec<BulkMessage>| -> Vec<String> {
            messages.into_iter().map(|m| m.message_id).collect()
        };
        assert_eq!(ids(walked.take(&[Outcome::Resolved])), ["r1"]);
        assert_eq!(
            ids(walked.take(&[Outcome::StillPoison, Outcome::Conflict])),
            ["c1", "p1", "c2"]
        );
        assert!(walked.letters.is_empty(), "every letter is taken once");
    }

    #[test]
    fn the_dead_letters_group_by_aggregate_lowest_sequence_first() {
        let groups = by_aggregate(vec![
            letter("b-3", "b", 3, "t"),
            letter("a-2", "a", 2, "t"),
            letter("b-2", "b", 2, "t"),
        ]);
        let ids: Vec<(String, Vec<String>)> = groups
            .into_iter()
            .map(|(aggregate, letters)| {
                (
                    aggregate,
                    letters
                        .into_iter()
                        .map(|letter| letter.message_id)
                        .collect(),
                )
            })
            .collect();
        assert_eq!(
            ids,
            [
                ("b".to_owned(), vec!["b-2".to_owned(), "b-3".to_owned()]),
                ("a".to_owned(), vec!["a-2".to_owned()]),
            ]
        );
    }
}
