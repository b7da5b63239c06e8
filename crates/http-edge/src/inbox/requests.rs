//! An operator's requests as every door that takes them reads them (the lab's routes and the
//! gate's): the stated reason, `dryRun`, a gap resolution's body, and a dead letter
//! resolution's action. What a replacement carries differs by door (the lesson's amount, the
//! gate's type and payload), so the door passes in how to read one and how to name its members.

use ordered_inbox::gaps::GapRequest;
use ordered_inbox::records::SequenceRange;
use ordered_inbox::resolution::{Action, Mode};
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::error::{AppError, RequestBody, parse_body};
use crate::inbox::input::validate_sequence;

/// The longest reason an operator may give, in characters.
pub const MAX_REASON: usize = 500;

/// An operator's stated reason, trimmed, or the 400 that says what it must be.
pub fn reason(text: &str) -> Result<String, AppError> {
    let reason = text.trim();
    if reason.is_empty() || reason.chars().count() > MAX_REASON {
        return Err(AppError::bad_request(format!(
            "reason must say why, in 1 to {MAX_REASON} characters"
        )));
    }
    Ok(reason.to_owned())
}

/// `dryRun` as a resolution's mode.
pub fn mode(dry_run: Option<bool>) -> Mode {
    if dry_run.unwrap_or(false) {
        Mode::DryRun
    } else {
        Mode::Commit
    }
}

/// An operator's decision on a gap: skip `from` through `through`. Names bind
/// case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GapResolutionInput {
    #[schema(pattern = "^skip$", example = "skip")]
    action: String,
    /// The aggregate's expected sequence: the first one that never arrived.
    #[schema(minimum = 1, maximum = 9007199254740992_i64)]
    from: i64,
    /// The last sequence to go on without (at least `from`).
    #[schema(minimum = 1, maximum = 9007199254740992_i64)]
    through: i64,
    /// The aggregate's last sequence the operator decided on; a different one answers 409.
    #[schema(minimum = 0, maximum = 9007199254740992_i64)]
    expected_last: i64,
    /// Why, for the audit trail: 1 to 500 characters, not blank.
    #[schema(min_length = 1, max_length = 500, pattern = "\\S")]
    reason: String,
}

impl RequestBody for GapResolutionInput {
    const FIELDS: &'static [&'static str] =
        &["action", "from", "through", "expectedLast", "reason"];
}

impl GapResolutionInput {
    /// The request of `operator` on `aggregate_id`, or the 400 that names what is wrong, checked
    /// in the body's order.
    pub fn into_request(
        self,
        aggregate_id: String,
        operator: String,
    ) -> Result<GapRequest, AppError> {
        if self.action != "skip" {
            return Err(AppError::bad_request(
                "action must be skip: a gap resolution goes on without the missing sequences",
            ));
        }
        validate_sequence("from", self.from, 1)?;
        validate_sequence("through", self.through, 1)?;
        if self.through < self.from {
            return Err(AppError::bad_request(format!(
                "through ({}) must be at least from ({})",
                self.through, self.from
            )));
        }
        validate_sequence("expectedLast", self.expected_last, 0)?;
        Ok(GapRequest {
            aggregate_id,
            operator,
            range: SequenceRange {
                from: self.from,
                through: self.through,
            },
            expected_last: self.expected_last,
            reason: reason(&self.reason)?,
        })
    }
}

/// How a door names what its replacement carries, for the 400s of a missing or a malformed one.
pub struct ReplacementShape {
    /// The members with what each holds, e.g. `{"type": a message type, "payload": its JSON}`.
    pub described: &'static str,
    /// The members' names alone, e.g. `{"type", "payload"}`.
    pub members: &'static str,
}

/// A dead letter resolution's action from its `action` and `replacement`: a skip carries no
/// replacement, a replace an object that `replace` reads; anything else is the 400 that says so.
pub fn dead_letter_action(
    action: &str,
    replacement: Value,
    shape: &ReplacementShape,
    replace: impl FnOnce(Value) -> Result<Action, AppError>,
) -> Result<Action, AppError> {
    match (action, replacement) {
        ("skip", Value::Null) => Ok(Action::Skip),
        ("skip", _) => Err(AppError::bad_request(
            "a skip takes no replacement: it records the sequence as taken with no effect",
        )),
        ("replace", Value::Null) => Err(AppError::bad_request(format!(
            "replace needs a replacement: {}",
            shape.described
        ))),
        ("replace", replacement @ Value::Object(_)) => replace(replacement),
        ("replace", _) => Err(AppError::bad_request(format!(
            "replacement must be an object {}",
            shape.members
        ))),
        _ => Err(AppError::bad_request("action must be replace or skip")),
    }
}

/// A replacement object read by the body's rules, its 400s prefixed `replacement: ` so that
/// they name where in the body the fault is.
pub fn parse_replacement<T: RequestBody>(replacement: &Value) -> Result<T, AppError> {
    parse_body(replacement.to_string().as_bytes()).map_err(|error| match error {
        AppError::BadRequest(detail) => AppError::bad_request(format!("replacement: {detail}")),
        other => other,
    })
}
