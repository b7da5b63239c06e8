//! The idempotent conditional pipeline: `POST /pipeline?failAfterCommit=` updates document 1 only
//! when `If-Match` names its current version, and records an idempotency receipt and an outbox
//! event in the same transaction, so a retry of a lost success is answered from the receipt
//! instead of being applied twice. `GET /pipeline/state` shows the rows behind it.
//!
//! The order of the checks is the contract: body, idempotency key, `If-Match` syntax, `If-Match`
//! presence; then, inside one write, the receipt (replay or conflict), the tag (412), the write.

use axum::extract;
use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::http::aspnet::optional_flag;
use crate::http::dotnet_json::ObjectWriter;
use crate::http::error::{AppError, Json, Query, RequestBody, json_response};
use crate::http::etag::{IfMatchCondition, if_match, version_etag, version_etag_value};
use crate::store::{Store, is_constraint};

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(run_pipeline))
        .routes(routes!(pipeline_state))
}

/// The idempotency keys the classroom fixture accepts.
const REQUEST_KEYS: [&str; 2] = ["demo", "second"];

/// [`REQUEST_KEYS`], for the OpenAPI document.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)]
enum RequestKey {
    Demo,
    Second,
}
const IDEMPOTENCY_KEY: &str = "idempotency-key";
const MAX_QUANTITY: i32 = 10;

/// Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct PipelineInput {
    #[schema(minimum = 1, maximum = 10)]
    quantity: i32,
}

impl RequestBody for PipelineInput {
    const FIELDS: &'static [&'static str] = &["quantity"];
}

#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct PipelineQuery {
    /// The fault switch: commit, then answer 503 as if the success were lost.
    #[serde(default, deserialize_with = "optional_flag")]
    fail_after_commit: Option<bool>,
}

/// A request that passed every check that needs no database.
struct PipelineRequest {
    request_id: &'static str,
    quantity: i32,
    condition: IfMatchCondition,
    /// The receipt's payload, exactly as the seed stores it: what a retry must repeat.
    receipt: String,
}

/// A success or a replay, members in the seed's order: `{"version":2,"replay":false}`.
#[derive(Debug, Serialize, ToSchema)]
struct PipelineAnswer {
    version: i64,
    replay: bool,
}

/// What the write decided.
enum PipelineOutcome {
    Applied {
        version: i64,
    },
    Replay {
        version: i64,
    },
    /// The key was used before with another request, or the document moved on since.
    ReceiptConflict,
    Stale {
        current: i64,
    },
}

fn idempotency_key(headers: &HeaderMap) -> Result<&'static str, AppError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let key = match (values.next(), values.next()) {
        (Some(value), None) => value.to_str().ok(),
        _ => None,
    };
    key.and_then(|key| REQUEST_KEYS.iter().copied().find(|known| *known == key))
        .ok_or_else(|| {
            AppError::bad_request(format!(
                "send one Idempotency-Key header: \"{}\" or \"{}\"",
                REQUEST_KEYS[0], REQUEST_KEYS[1]
            ))
        })
}

fn validate(input: PipelineInput, headers: &HeaderMap) -> Result<PipelineRequest, AppError> {
    if !(1..=MAX_QUANTITY).contains(&input.quantity) {
        return Err(AppError::bad_request(format!(
            "quantity must be from 1 to {MAX_QUANTITY}"
        )));
    }
    let request_id = idempotency_key(headers)?;
    let condition = if_match(headers)
        .map_err(|error| AppError::bad_request(error.to_string()))?
        .ok_or_else(|| {
            AppError::problem_with_detail(
                StatusCode::PRECONDITION_REQUIRED,
                "Precondition Required",
                "send If-Match with the document's current entity tag (see GET /pipeline/state)",
            )
        })?;
    let receipt = ObjectWriter::new()
        .integer("Quantity", i64::from(input.quantity))
        .string("condition", condition.canonical())
        .finish();
    Ok(PipelineRequest {
        request_id,
        quantity: input.quantity,
        condition,
        receipt,
    })
}

/// The receipt check, the tag check and the write, on one snapshot: two requests carrying the
/// same tag cannot both pass, and a retry cannot slip in between a success and its receipt.
fn decide_and_write(
    connection: &rusqlite::Connection,
    request: &PipelineRequest,
) -> Result<PipelineOutcome, AppError> {
    let saved: Option<(String, i64)> = connection
        .query_row(
            "SELECT payload, result_version FROM pipeline_requests WHERE request_id = ?1",
            [request.request_id],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?;
    let current: i64 =
        connection.query_row("SELECT version FROM documents WHERE id = 1", [], |row| {
            row.get(0)
        })?;
    if let Some((payload, version)) = saved {
        return Ok(if payload == request.receipt && version == current {
            PipelineOutcome::Replay { version }
        } else {
            PipelineOutcome::ReceiptConflict
        });
    }
    if !request.condition.passes(&version_etag(current)) {
        return Ok(PipelineOutcome::Stale { current });
    }
    let next = current + 1;
    connection.execute(
        "UPDATE documents SET body = ?1, version = ?2 WHERE id = 1 AND version = ?3",
        params![format!("quantity:{}", request.quantity), next, current],
    )?;
    let recorded = connection
        .execute(
            "INSERT INTO pipeline_requests(request_id, payload, result_version) VALUES (?1, ?2, ?3)",
            params![request.request_id, request.receipt, next],
        )
        .and_then(|_| {
            connection.execute(
                "INSERT INTO outbox(event_key, aggregate_id, sequence, payload)
                 VALUES (?1, 'document-1', ?2, ?3)",
                params![format!("document-1-v{next}"), next, request.receipt],
            )
        });
    match recorded {
        Ok(_) => Ok(PipelineOutcome::Applied { version: next }),
        // Returning an error rolls the document update back with it.
        Err(error) if is_constraint(&error) => Err(AppError::problem(
            StatusCode::CONFLICT,
            format!("A receipt or an event for version {next} already exists"),
        )),
        Err(error) => Err(error.into()),
    }
}

/// Updates document 1 only when `If-Match` names its version, with an idempotency receipt and an
/// outbox event in the same transaction.
#[utoipa::path(post, path = "/pipeline", tag = "pipeline",
    params(
        PipelineQuery,
        ("idempotency-key" = inline(RequestKey), Header, description = "The request's idempotency key"),
        ("if-match" = String, Header, pattern = "^[ \\t]*(\\*|(W/)?\"[\\x21\\x23-\\x7E]*\"([ \\t]*,[ \\t]*(W/)?\"[\\x21\\x23-\\x7E]*\")*)[ \\t]*$", description = "The document's current entity tag, see GET /pipeline/state (missing: 428)"),
    ),
    request_body = PipelineInput,
    responses(
        (status = 200, description = "Applied (`replay: false`, with the new ETag) or answered from the receipt (`replay: true`)", body = PipelineAnswer,
            headers(("etag" = Option<String>, description = "The new version's tag, when applied"))),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 409, description = "The key was used with another request or the receipt is no longer current (the seed's JSON body), or a receipt or event for the version already exists (problem)", content(
            (crate::http::openapi::SeedError = "application/json"),
            (crate::http::openapi::Problem = "application/problem+json"),
        )),
        (status = 412, description = "If-Match does not name the current version", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 428, description = "If-Match is missing", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, description = "The fault switch (failAfterCommit=true): committed, but answered as lost; or the store is unavailable", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
async fn run_pipeline(
    State(store): State<Store>,
    Query(query): Query<PipelineQuery>,
    headers: HeaderMap,
    Json(input): Json<PipelineInput>,
) -> Result<Response, AppError> {
    let request = validate(input, &headers)?;
    let outcome = store
        .write(move |connection| decide_and_write(connection, &request))
        .await?;
    Ok(match outcome {
        PipelineOutcome::Applied { .. } if query.fail_after_commit == Some(true) => {
            // Committed, but the caller is told otherwise: an exact retry finds the receipt.
            return Err(AppError::problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "Controlled lost-success response after commit",
            ));
        }
        PipelineOutcome::Applied { version } => (
            StatusCode::OK,
            [(header::ETAG, version_etag_value(version))],
            extract::Json(PipelineAnswer {
                version,
                replay: false,
            }),
        )
            .into_response(),
        PipelineOutcome::Replay { version } => (
            StatusCode::OK,
            extract::Json(PipelineAnswer {
                version,
                replay: true,
            }),
        )
            .into_response(),
        PipelineOutcome::ReceiptConflict => json_response(
            StatusCode::CONFLICT,
            json!({"error": "Request changed or the saved receipt is no longer current"}),
        ),
        PipelineOutcome::Stale { current } => {
            return Err(AppError::problem_with_detail(
                StatusCode::PRECONDITION_FAILED,
                "Precondition Failed",
                format!("If-Match does not match the document's current entity tag \"v{current}\""),
            ));
        }
    })
}

/// The rows behind the pipeline, members in the seed's order.
#[derive(Debug, Serialize, ToSchema)]
struct PipelineState {
    version: i64,
    requests: i64,
    events: i64,
}

#[utoipa::path(get, path = "/pipeline/state", tag = "pipeline", responses(
    (status = 200, description = "The document's version, and the receipts and events recorded", body = PipelineState),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn pipeline_state(
    State(store): State<Store>,
) -> Result<extract::Json<PipelineState>, AppError> {
    let pipeline = store
        .read(|connection| {
            connection
                .query_row(
                    "SELECT (SELECT version FROM documents WHERE id = 1),
                            (SELECT COUNT(*) FROM pipeline_requests),
                            (SELECT COUNT(*) FROM outbox)",
                    [],
                    |row| {
                        Ok(PipelineState {
                            version: row.get(0)?,
                            requests: row.get(1)?,
                            events: row.get(2)?,
                        })
                    },
                )
                .map_err(AppError::from)
        })
        .await?;
    Ok(extract::Json(pipeline))
}
