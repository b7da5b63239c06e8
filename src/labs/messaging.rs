//! Messaging: a transactional outbox whose events are handed out under short leases fenced by a
//! generation, and an idempotent inbox that applies a message's effect once.
//!
//! - `POST /outbox/orders?failBeforeCommit=` writes the order row and its outbox event together.
//! - `POST /outbox/claim/{owner}` leases the oldest claimable event to `one` or `two` for 500 ms
//!   (the seed's lease; [`crate::config::Config::outbox_lease`] changes it).
//! - `POST /outbox/ack/{id}/{owner}?generation=N` marks it sent only for the current lease holder
//!   (`{id}` is a 64-bit integer or the route does not match: 404, as the seed's `{id:long}`).
//! - `POST /inbox/apply?failBeforeCommit=` applies `demo` once; an identical redelivery is a replay.
//! - `GET /messaging/counts` shows the rows behind all of it.
//!
//! Every read-check-write runs in one `Store::write` closure: the single writer serialises them, so
//! two owners can never lease the same event generation and two deliveries never both apply.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract;
use axum::extract::{FromRef, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use rusqlite::{OptionalExtension, params};
use serde::Deserialize;
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::StartupError;
use crate::http::aspnet::{RouteLong, is_blank_or_longer_than, optional_flag};
use crate::http::dotnet_json::ObjectWriter;
use crate::http::error::{
    AppError, ConstrainedPath, Json, Path, Query, RequestBody, json_response,
};
use crate::labs::context::StartupContext;
use crate::store::{Store, StoreError, is_constraint};

/// The messaging lab's own state: how long a claim holds its event.
#[derive(Clone)]
pub struct MessagingLab {
    lease_millis: i64,
}

impl MessagingLab {
    pub fn new(context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(MessagingLab {
            lease_millis: i64::try_from(context.config.outbox_lease.as_millis())
                .unwrap_or(i64::MAX),
        })
    }
}

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
    MessagingLab: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(counts))
        .routes(routes!(create_order))
        .routes(routes!(claim))
        .routes(routes!(ack))
        .routes(routes!(apply_inbox))
}

/// The one order and the one inbox message the classroom fixture accepts.
const CLASSROOM_ID: &str = "demo";
/// The two relay owners that may claim events.
const OWNERS: [&str; 2] = ["one", "two"];

/// [`OWNERS`], for the OpenAPI document.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)]
enum Owner {
    One,
    Two,
}
const MAX_QUANTITY: i32 = 10;
const MAX_AMOUNT: i32 = 10;
const MAX_PAYLOAD: usize = 50;

/// `?failBeforeCommit=true` (the seed's fault switch). Anything but true/false is a 400.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
struct FaultQuery {
    /// The fault switch: do the work, then fail before the commit (503; nothing is kept).
    #[serde(default, deserialize_with = "optional_flag")]
    fail_before_commit: Option<bool>,
}

/// Milliseconds since the Unix epoch, the unit of `outbox.lease_until`.
fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Outbox: create an order with its event

/// The classroom order. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct CreateOrder {
    /// The one classroom order.
    #[schema(value_type = String, required = true, pattern = "^demo$", example = "demo")]
    order_id: Option<String>,
    #[schema(minimum = 1, maximum = 10)]
    quantity: i32,
}

/// The order as created.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct CreatedOrder {
    order_id: String,
    quantity: i32,
}

impl RequestBody for CreateOrder {
    const FIELDS: &'static [&'static str] = &["orderId", "quantity"];
}

/// Why an order was not created: answered as the seed answers each.
#[derive(Debug, thiserror::Error)]
enum CreateOrderError {
    /// The order or its event already exists (a constraint violation).
    #[error("Order or event identity already exists")]
    IdentityExists,
    #[error(transparent)]
    App(#[from] AppError),
}

impl From<StoreError> for CreateOrderError {
    fn from(error: StoreError) -> Self {
        CreateOrderError::App(error.into())
    }
}

impl From<rusqlite::Error> for CreateOrderError {
    fn from(error: rusqlite::Error) -> Self {
        if is_constraint(&error) {
            CreateOrderError::IdentityExists
        } else {
            CreateOrderError::App(error.into())
        }
    }
}

impl IntoResponse for CreateOrderError {
    fn into_response(self) -> Response {
        match self {
            CreateOrderError::IdentityExists => json_response(
                StatusCode::CONFLICT,
                json!({"error": CreateOrderError::IdentityExists.to_string()}),
            ),
            CreateOrderError::App(error) => error.into_response(),
        }
    }
}

/// The order row and its outbox event, in one transaction.
#[utoipa::path(post, path = "/outbox/orders", tag = "messaging", params(FaultQuery), request_body = CreateOrder,
    responses(
        (status = 201, description = "The order and its event were committed together", body = CreatedOrder,
            headers(("location" = String, description = "/outbox/orders/demo"))),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 409, description = "The order or its event already exists", body = crate::http::openapi::SeedError),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, description = "The fault switch (failBeforeCommit=true) rolled the order back, or the store is unavailable", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
async fn create_order(
    State(store): State<Store>,
    Query(fault): Query<FaultQuery>,
    Json(input): Json<CreateOrder>,
) -> Result<Response, CreateOrderError> {
    if input.order_id.as_deref() != Some(CLASSROOM_ID) {
        return Err(AppError::bad_request(format!(
            "orderId must be \"{CLASSROOM_ID}\": the classroom fixture owns one order"
        ))
        .into());
    }
    if !(1..=MAX_QUANTITY).contains(&input.quantity) {
        return Err(
            AppError::bad_request(format!("quantity must be from 1 to {MAX_QUANTITY}")).into(),
        );
    }
    let quantity = input.quantity;
    let fail_before_commit = fault.fail_before_commit == Some(true);
    store
        .write(move |connection| {
            // The order and the event that announces it commit together or not at all.
            connection.execute(
                "INSERT INTO orders(order_id, quantity) VALUES (?1, ?2)",
                params![CLASSROOM_ID, quantity],
            )?;
            connection.execute(
                "INSERT INTO outbox(event_key, aggregate_id, sequence, payload)
                 VALUES (?1, ?2, 1, ?3)",
                params![
                    format!("order-{CLASSROOM_ID}-v1"),
                    CLASSROOM_ID,
                    format!("quantity:{quantity}")
                ],
            )?;
            if fail_before_commit {
                return Err(CreateOrderError::App(AppError::problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Controlled pre-commit failure",
                )));
            }
            Ok(())
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/outbox/orders/{CLASSROOM_ID}"))],
        extract::Json(json!({"orderId": CLASSROOM_ID, "quantity": quantity})),
    )
        .into_response())
}

// ---------------------------------------------------------------------------------------------
// Outbox: claim and acknowledge under a lease

/// One leased event, as the claim answers it.
#[derive(Debug, serde::Serialize, ToSchema)]
struct Claimed {
    id: i64,
    payload: String,
    attempts: i64,
    owner: String,
}

/// Leases the oldest claimable event to `owner`.
#[utoipa::path(post, path = "/outbox/claim/{owner}", tag = "messaging",
    params(("owner" = inline(Owner), Path, description = "The relay claiming")),
    responses(
        (status = 200, description = "The leased event; `attempts` is the lease's fencing token", body = Claimed),
        (status = 204, description = "No event is claimable now"),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn claim(
    State(store): State<Store>,
    State(lab): State<MessagingLab>,
    Path(owner): Path<String>,
) -> Result<Response, AppError> {
    if !OWNERS.contains(&owner.as_str()) {
        return Err(AppError::bad_request(format!(
            "owner must be \"{}\" or \"{}\"",
            OWNERS[0], OWNERS[1]
        )));
    }
    let claimed = store
        .write(move |connection| {
            // The clock is read when the work runs on the writer, not when the request arrived:
            // a lease is measured from the moment it is granted.
            let now = now_millis();
            connection
                .query_row(
                    "UPDATE outbox
                     SET owner = ?1, lease_until = ?2, attempts = attempts + 1
                     WHERE id = (SELECT id FROM outbox
                                 WHERE status = 'pending'
                                   AND (lease_until IS NULL OR lease_until <= ?3)
                                 ORDER BY id LIMIT 1)
                     RETURNING id, payload, attempts",
                    params![owner, now.saturating_add(lab.lease_millis), now],
                    |row| {
                        Ok(Claimed {
                            id: row.get(0)?,
                            payload: row.get(1)?,
                            attempts: row.get(2)?,
                            owner: owner.clone(),
                        })
                    },
                )
                .optional()
                .map_err(AppError::from)
        })
        .await?;
    Ok(match claimed {
        Some(claimed) => (StatusCode::OK, extract::Json(claimed)).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    })
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct AckQuery {
    /// The `attempts` value the claim returned: the fencing token of that lease.
    generation: i64,
}

/// Marks the event sent, only for the current holder of the lease of that generation.
#[utoipa::path(post, path = "/outbox/ack/{id}/{owner}", tag = "messaging",
    params(
        ("id" = i64, Path, description = "The event's id"),
        ("owner" = inline(Owner), Path, description = "The relay that holds the lease"),
        AckQuery,
    ),
    responses(
        (status = 204, description = "Marked sent"),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 404, description = "`id` is not a 64-bit integer: no route matches, as ASP.NET's `{id:long}` constraint answers", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The lease is not (or no longer) this owner's at this generation", body = crate::http::openapi::SeedError),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn ack(
    State(store): State<Store>,
    ConstrainedPath((RouteLong(id), owner)): ConstrainedPath<(RouteLong, String)>,
    Query(AckQuery { generation }): Query<AckQuery>,
) -> Result<Response, AppError> {
    let changed = store
        .write(move |connection| {
            connection
                .execute(
                    "UPDATE outbox SET status = 'sent'
                     WHERE id = ?1 AND owner = ?2 AND status = 'pending'
                       AND lease_until > ?3 AND attempts = ?4",
                    params![id, owner, now_millis(), generation],
                )
                .map_err(AppError::from)
        })
        .await?;
    Ok(if changed == 1 {
        StatusCode::NO_CONTENT.into_response()
    } else {
        json_response(
            StatusCode::CONFLICT,
            json!({"error": "Lease is not currently owned"}),
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Inbox

/// The classroom message. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct InboxInput {
    /// The one classroom message.
    #[schema(value_type = String, required = true, pattern = "^demo$", example = "demo")]
    message_id: Option<String>,
    /// 1 to 50 characters, not blank.
    #[schema(value_type = String, required = true, min_length = 1, max_length = 50)]
    payload: Option<String>,
    #[schema(minimum = 1, maximum = 10)]
    amount: i32,
}

/// Whether this delivery applied the message or found it applied before.
#[derive(ToSchema)]
#[allow(dead_code)]
struct InboxAnswer {
    replay: bool,
}

impl RequestBody for InboxInput {
    const FIELDS: &'static [&'static str] = &["messageId", "payload", "amount"];
}

/// A valid delivery of the classroom message.
struct InboxDelivery {
    /// What two deliveries must share to be the same message, exactly as the seed stores it.
    canonical: String,
    amount: i32,
}

impl InboxInput {
    fn validate(self) -> Result<InboxDelivery, AppError> {
        if self.message_id.as_deref() != Some(CLASSROOM_ID) {
            return Err(AppError::bad_request(format!(
                "messageId must be \"{CLASSROOM_ID}\": the classroom fixture owns one message"
            )));
        }
        let payload = self.payload.unwrap_or_default();
        if is_blank_or_longer_than(&payload, MAX_PAYLOAD) {
            return Err(AppError::bad_request(format!(
                "payload must be 1 to {MAX_PAYLOAD} characters and not blank"
            )));
        }
        if !(1..=MAX_AMOUNT).contains(&self.amount) {
            return Err(AppError::bad_request(format!(
                "amount must be from 1 to {MAX_AMOUNT}"
            )));
        }
        let canonical = ObjectWriter::new()
            .string("Payload", &payload)
            .integer("Amount", i64::from(self.amount))
            .finish();
        Ok(InboxDelivery {
            canonical,
            amount: self.amount,
        })
    }
}

enum InboxOutcome {
    Applied,
    Replay,
    PayloadConflict,
}

/// Applies the classroom message's effect once.
#[utoipa::path(post, path = "/inbox/apply", tag = "messaging", params(FaultQuery), request_body = InboxInput,
    responses(
        (status = 200, description = "Applied now (`replay: false`) or before (`replay: true`)", body = InboxAnswer),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 409, description = "The message id was applied with another payload", body = crate::http::openapi::SeedError),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, description = "The fault switch (failBeforeCommit=true) rolled the effect back, or the store is unavailable", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
async fn apply_inbox(
    State(store): State<Store>,
    Query(fault): Query<FaultQuery>,
    Json(input): Json<InboxInput>,
) -> Result<Response, AppError> {
    let delivery = input.validate()?;
    let fail_before_commit = fault.fail_before_commit == Some(true);
    let outcome = store
        .write(move |connection| {
            let prior: Option<String> = connection
                .query_row(
                    "SELECT payload FROM inbox WHERE message_id = ?1",
                    [CLASSROOM_ID],
                    |row| row.get(0),
                )
                .optional()?;
            if let Some(prior) = prior {
                return Ok(if prior == delivery.canonical {
                    InboxOutcome::Replay
                } else {
                    InboxOutcome::PayloadConflict
                });
            }
            // The identity row and the effect commit together: a redelivery finds the row and
            // adds nothing.
            connection.execute(
                "INSERT INTO inbox(message_id, payload) VALUES (?1, ?2)",
                params![CLASSROOM_ID, delivery.canonical],
            )?;
            connection.execute(
                "UPDATE effects SET total = total + ?1 WHERE id = 1",
                [delivery.amount],
            )?;
            if fail_before_commit {
                return Err(AppError::problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Controlled inbox failure",
                ));
            }
            Ok(InboxOutcome::Applied)
        })
        .await?;
    Ok(match outcome {
        InboxOutcome::Applied => json_response(StatusCode::OK, json!({"replay": false})),
        InboxOutcome::Replay => json_response(StatusCode::OK, json!({"replay": true})),
        InboxOutcome::PayloadConflict => {
            json_response(StatusCode::CONFLICT, json!({"error": "Payload conflict"}))
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Counts

/// The rows behind the lab, members in the seed's order.
#[derive(Debug, serde::Serialize, ToSchema)]
struct Counts {
    orders: i64,
    outbox: i64,
    inbox: i64,
    effects: i64,
}

#[utoipa::path(get, path = "/messaging/counts", tag = "messaging", responses(
    (status = 200, description = "The rows behind the outbox and the inbox", body = Counts),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn counts(State(store): State<Store>) -> Result<extract::Json<Counts>, AppError> {
    let counts = store
        .read(|connection| {
            connection
                .query_row(
                    "SELECT (SELECT COUNT(*) FROM orders),
                            (SELECT COUNT(*) FROM outbox),
                            (SELECT COUNT(*) FROM inbox),
                            (SELECT total FROM effects WHERE id = 1)",
                    [],
                    |row| {
                        Ok(Counts {
                            orders: row.get(0)?,
                            outbox: row.get(1)?,
                            inbox: row.get(2)?,
                            effects: row.get::<_, Option<i64>>(3)?.unwrap_or(0),
                        })
                    },
                )
                .map_err(AppError::from)
        })
        .await?;
    Ok(extract::Json(counts))
}
