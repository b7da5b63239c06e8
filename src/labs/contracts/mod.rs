//! Consumer contracts: two response shapes a consumer must tell apart (`GET /contracts/compatible`
//! adds an optional member, `GET /contracts/breaking` changes a member's type), and a counted effect
//! behind two controlled failures (`POST /contracts/change/{before|after}`) whose difference a
//! consumer can only learn by reading state (`GET /contracts/effect`), not from the 503 alone.
//! `production-lab verify-base` (see [`crate::labs::contracts::verify`]) drives all of it over HTTP.

pub mod verify;

use axum::extract;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::http::error::{AppError, Path};
use crate::store::Store;

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(compatible))
        .routes(routes!(breaking))
        .routes(routes!(effect))
        .routes(routes!(change))
}

/// The base shape plus an optional member: a compatible change.
#[derive(ToSchema)]
#[allow(dead_code)]
struct CompatibleItem {
    id: i64,
    name: String,
    optional: String,
}

/// `name` changed type: a breaking change.
#[derive(ToSchema)]
#[allow(dead_code)]
struct BreakingItem {
    id: i64,
    name: i64,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct Effect {
    /// How many changes were committed.
    value: i64,
}

#[utoipa::path(get, path = "/contracts/compatible", tag = "contracts", responses(
    (status = 200, description = "The base shape with an added optional member", body = CompatibleItem),
))]
async fn compatible() -> extract::Json<Value> {
    extract::Json(json!({"id": 1, "name": "rune", "optional": "new"}))
}

#[utoipa::path(get, path = "/contracts/breaking", tag = "contracts", responses(
    (status = 200, description = "`name` is a number here: a breaking change", body = BreakingItem),
))]
async fn breaking() -> extract::Json<Value> {
    extract::Json(json!({"id": 1, "name": 42}))
}

#[utoipa::path(get, path = "/contracts/effect", tag = "contracts", responses(
    (status = 200, description = "The counted effect", body = Effect),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn effect(State(store): State<Store>) -> Result<extract::Json<Value>, AppError> {
    let value: i64 = store
        .read(|connection| {
            connection
                .query_row(
                    "SELECT value FROM contract_effect WHERE id = 1",
                    [],
                    |row| row.get(0),
                )
                .map_err(AppError::from)
        })
        .await?;
    Ok(extract::Json(json!({"value": value})))
}

/// Where the controlled failure happens relative to the commit.
#[derive(Debug, Clone, Copy, ToSchema)]
#[schema(rename_all = "lowercase")]
enum Phase {
    Before,
    After,
}

/// A change that always answers 503, deliberately: `before` fails before the commit (nothing
/// changed), `after` after it (the effect was counted). Only `GET /contracts/effect` tells them
/// apart.
#[utoipa::path(post, path = "/contracts/change/{phase}", tag = "contracts",
    params(("phase" = inline(Phase), Path, description = "Where the controlled failure happens")),
    responses(
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 503, description = "Always, by design: a controlled failure before or after the commit", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
async fn change(
    State(store): State<Store>,
    Path(phase): Path<String>,
) -> Result<Response, AppError> {
    let phase = match phase.as_str() {
        "before" => Phase::Before,
        "after" => Phase::After,
        _ => {
            return Err(AppError::bad_request(
                "phase must be \"before\" (fail before commit) or \"after\" (fail after commit)",
            ));
        }
    };
    store
        .write(move |connection| {
            connection.execute(
                "UPDATE contract_effect SET value = value + 1 WHERE id = 1",
                [],
            )?;
            match phase {
                // The error rolls the increment back: nothing happened.
                Phase::Before => Err(AppError::problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Controlled failure before commit",
                )),
                Phase::After => Ok(()),
            }
        })
        .await?;
    // Committed, yet answered as a failure: the caller cannot tell from the status alone.
    Err(AppError::problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Controlled uncertain response after commit",
    ))
}
