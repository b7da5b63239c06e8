//! Consumer contracts: two response shapes a consumer must tell apart (`GET /contracts/compatible`
//! adds an optional member, `GET /contracts/breaking` changes a member's type), and a counted effect
//! behind two controlled failures (`POST /contracts/change/{before|after}`) whose difference a
//! consumer can only learn by reading state (`GET /contracts/effect`), not from the 503 alone.
//! `production-lab verify-base` (see [`crate::verify`]) drives all of it over HTTP.

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Router, extract};
use serde_json::{Value, json};

use crate::error::{AppError, Path};
use crate::store::Store;

pub fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
{
    Router::new()
        .route("/contracts/compatible", get(compatible))
        .route("/contracts/breaking", get(breaking))
        .route("/contracts/effect", get(effect))
        .route("/contracts/change/{phase}", post(change))
}

async fn compatible() -> extract::Json<Value> {
    extract::Json(json!({"id": 1, "name": "rune", "optional": "new"}))
}

async fn breaking() -> extract::Json<Value> {
    extract::Json(json!({"id": 1, "name": 42}))
}

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
#[derive(Debug, Clone, Copy)]
enum Phase {
    Before,
    After,
}

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
