//! Operator-approved poison resolution over HTTP: `POST /deadletters/{messageId}/resolution`
//! (Bearer token of an operator registered with `production-lab operator add`) and the audit trail
//! `GET /resolutions`.

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    problem_with, validate_after, validate_aggregate_id, validate_limit, validate_message_id,
    validate_sequence,
};
use crate::app::AppState;
use crate::error::{AppError, Json, Path, Query, RequestBody, json_response, parse_body};
use crate::operators;
use crate::ordering::clock;
use crate::ordering::resolution::{Action, ResolutionError, ResolutionRequest, Resolved, resolve};
use crate::ordering::views::{self, ResolutionRecord};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/deadletters/{message_id}/resolution",
            post(resolve_dead_letter),
        )
        .route("/resolutions", get(audit_trail))
}

const MAX_REASON: usize = 500;
const UNAUTHORIZED_TITLE: &str = "Operator authentication required";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ResolutionInput {
    action: String,
    expected_last: i64,
    reason: String,
    #[serde(default)]
    replacement: Value,
}

impl RequestBody for ResolutionInput {
    const FIELDS: &'static [&'static str] = &["action", "expectedLast", "reason", "replacement"];
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReplacementInput {
    message_id: String,
    amount: i32,
}

impl RequestBody for ReplacementInput {
    const FIELDS: &'static [&'static str] = &["messageId", "amount"];
}

impl ResolutionInput {
    fn into_request(
        self,
        dead_letter_id: String,
        operator: String,
    ) -> Result<ResolutionRequest, AppError> {
        validate_sequence("expectedLast", self.expected_last, 0)?;
        let reason = self.reason.trim();
        if reason.is_empty() || reason.chars().count() > MAX_REASON {
            return Err(AppError::bad_request(format!(
                "reason must say why, in 1 to {MAX_REASON} characters"
            )));
        }
        let action = match (self.action.as_str(), self.replacement) {
            ("skip", Value::Null) => Action::Skip,
            ("skip", _) => {
                return Err(AppError::bad_request(
                    "a skip takes no replacement: it records the sequence as taken with no effect",
                ));
            }
            ("replace", Value::Null) => {
                return Err(AppError::bad_request(
                    "replace needs a replacement: {\"messageId\": a new id, \"amount\": a 32-bit integer}",
                ));
            }
            ("replace", replacement @ Value::Object(_)) => {
                let replacement: ReplacementInput = parse_body(replacement.to_string().as_bytes())
                    .map_err(|error| match error {
                        AppError::BadRequest(detail) => {
                            AppError::bad_request(format!("replacement: {detail}"))
                        }
                        other => other,
                    })?;
                validate_message_id("replacement.messageId", &replacement.message_id)?;
                Action::Replace {
                    message_id: replacement.message_id,
                    amount: i64::from(replacement.amount),
                }
            }
            ("replace", _) => {
                return Err(AppError::bad_request(
                    "replacement must be an object {\"messageId\", \"amount\"}",
                ));
            }
            _ => return Err(AppError::bad_request("action must be replace or skip")),
        };
        Ok(ResolutionRequest {
            dead_letter_id,
            operator,
            action,
            expected_last: self.expected_last,
            reason: reason.to_owned(),
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ResolutionOptions {
    dry_run: Option<bool>,
}

/// What the Authorization header offered.
enum Credential {
    Missing,
    /// Present but not `Bearer TOKEN`.
    Unusable,
    Bearer(String),
}

fn credential(headers: &HeaderMap) -> Result<Credential, AppError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Ok(Credential::Missing);
    };
    if values.next().is_some() {
        // Which one would count is a guess that a proxy might make differently.
        return Err(AppError::bad_request(
            "send one Authorization header: two are an ambiguous credential",
        ));
    }
    let text = value.to_str().map_err(|_| {
        AppError::bad_request("the Authorization header must be visible ASCII text")
    })?;
    let mut parts = text.trim().splitn(2, ' ');
    let scheme = parts.next().unwrap_or_default();
    let token = parts.next().unwrap_or_default().trim();
    if scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() {
        Ok(Credential::Bearer(token.to_owned()))
    } else {
        Ok(Credential::Unusable)
    }
}

/// 401 with a `WWW-Authenticate` challenge; nothing was changed.
fn unauthorized(detail: String) -> Response {
    let mut response = AppError::Problem {
        status: StatusCode::UNAUTHORIZED,
        title: UNAUTHORIZED_TITLE.to_owned(),
        detail: Some(detail),
    }
    .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"production-lab\""),
    );
    response
}

/// The operator a request acts for, or the 401 that explains what is missing.
async fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<String, Response> {
    let credential = credential(headers).map_err(IntoResponse::into_response)?;
    let token = match &credential {
        Credential::Bearer(token) => Some(token.clone()),
        Credential::Missing | Credential::Unusable => None,
    };
    let (operator, active) = state
        .store
        .read(move |connection| {
            let operator = match &token {
                Some(token) => operators::authenticate(connection, token)?,
                None => None,
            };
            Ok::<_, AppError>((operator, operators::active_count(connection)?))
        })
        .await
        .map_err(IntoResponse::into_response)?;
    if let Some(operator) = operator {
        return Ok(operator);
    }
    let detail = if active == 0 {
        format!(
            "no operator is registered yet: run `{}` on the server's database file, then send Authorization: Bearer TOKEN with the printed token",
            operators::ADD_HINT
        )
    } else {
        match credential {
            Credential::Missing => {
                "send Authorization: Bearer TOKEN with an operator's token".to_owned()
            }
            Credential::Unusable => {
                "the Authorization header must be Bearer TOKEN with an operator's token".to_owned()
            }
            Credential::Bearer(_) => "the token is not an active operator's token".to_owned(),
        }
    };
    Err(unauthorized(detail))
}

/// `POST /deadletters/{messageId}/resolution[?dryRun=true]`.
async fn resolve_dead_letter(
    State(state): State<AppState>,
    Path(dead_letter_id): Path<String>,
    Query(options): Query<ResolutionOptions>,
    headers: HeaderMap,
    body: Result<Json<ResolutionInput>, AppError>,
) -> Result<Response, AppError> {
    validate_message_id("messageId", &dead_letter_id)?;
    // Authority comes before the body is even looked at: an unauthenticated caller learns nothing.
    let operator = match authenticate(&state, &headers).await {
        Ok(operator) => operator,
        Err(response) => return Ok(response),
    };
    let Json(input) = body?;
    let request = input.into_request(dead_letter_id, operator)?;
    let dry_run = options.dry_run.unwrap_or(false);
    let resolved = state
        .store
        .write(move |connection| resolve(connection, &request, dry_run, &clock::now()))
        .await;
    Ok(match resolved {
        Ok(Resolved::New(record) | Resolved::Repeated(record)) => {
            json_response(StatusCode::OK, resolution_body("resolved", false, &record))
        }
        Ok(Resolved::DryRun(record)) => {
            json_response(StatusCode::OK, resolution_body("dry run", true, &record))
        }
        Err(error) => refusal(error),
    })
}

fn resolution_body(outcome: &str, dry_run: bool, record: &ResolutionRecord) -> Value {
    let mut body = json!({"outcome": outcome, "dryRun": dry_run});
    if let (Some(body), Ok(Value::Object(record))) =
        (body.as_object_mut(), serde_json::to_value(record))
    {
        body.extend(record);
    }
    body
}

fn refusal(error: ResolutionError) -> Response {
    match error {
        ResolutionError::NotFound(message_id) => AppError::Problem {
            status: StatusCode::NOT_FOUND,
            title: "No such dead letter".to_owned(),
            detail: Some(format!("no dead letter has message id '{message_id}'")),
        }
        .into_response(),
        ResolutionError::Conflict {
            title,
            detail,
            current,
        } => problem_with(
            StatusCode::CONFLICT,
            title,
            &detail,
            json!({"current": current}),
        ),
        ResolutionError::ReplacementQuarantined { reason } => AppError::Problem {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            title: "The replacement would be quarantined".to_owned(),
            detail: Some(format!(
                "the ordering policy rejects the replacement too ({reason}); nothing was changed"
            )),
        }
        .into_response(),
        ResolutionError::Unauthorized => {
            unauthorized("the operator's token was revoked before the change".to_owned())
        }
        ResolutionError::Store(error) => AppError::Store(error).into_response(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AuditQuery {
    aggregate_id: Option<String>,
    after: Option<i64>,
    limit: Option<i64>,
}

/// `GET /resolutions?aggregateId=&after=&limit=`: who resolved what, when, why, and the
/// aggregate's last before and after, oldest first.
async fn audit_trail(
    State(state): State<AppState>,
    Query(query): Query<AuditQuery>,
) -> Result<Response, AppError> {
    if let Some(aggregate_id) = query.aggregate_id.as_deref() {
        validate_aggregate_id("aggregateId", aggregate_id)?;
    }
    let after = validate_after(query.after)?;
    let limit = validate_limit(query.limit)?;
    let records = state
        .store
        .read(move |connection| {
            views::resolutions(connection, query.aggregate_id.as_deref(), after, limit)
                .map_err(AppError::from)
        })
        .await?;
    let next = (records.len() as i64 == limit)
        .then(|| records.last().and_then(|record| record.resolution_id))
        .flatten();
    Ok(json_response(
        StatusCode::OK,
        json!({"resolutions": records, "next": next}),
    ))
}
