//! The registry of producers and operators, for an operator: `GET/POST /v1/producers`,
//! `DELETE /v1/producers/{name}`, and the same for `/v1/operators`. A new member's token is
//! answered once, with the 201, and only its hash is stored; a revoked name is never reused, so
//! the audit trail names one member.

use std::path::PathBuf;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use ordered_inbox::InboxError;
use ordered_inbox::operators::{OperatorError, OperatorRecord, Registry, Revocation};
use ordered_inbox::postgres::Target;
use ordered_inbox::views::ProducerView;
use serde::Deserialize;
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::Operator;
use http_edge::error::{AppError, Json, Path, RequestBody, json_response};
use http_edge::inbox::SharedInbox;

/// Where the inbox keeps its producers and operators: its SQLite file or its PostgreSQL
/// database.
#[derive(Debug, Clone)]
pub enum RegistryStore {
    Sqlite(PathBuf),
    /// The store's checked target (any host, with its TLS and password).
    Postgres(Box<Target>),
}

impl RegistryStore {
    /// Registers `name` and answers its new token.
    async fn add(&self, registry: Registry, name: String) -> Result<String, OperatorError> {
        match self {
            RegistryStore::Sqlite(path) => {
                let path = path.clone();
                blocking(move || ordered_inbox::sqlite::operators::add_to(registry, &path, &name))
                    .await
            }
            RegistryStore::Postgres(target) => {
                ordered_inbox::postgres::operators::add_to(registry, target.as_ref(), &name).await
            }
        }
    }

    async fn list(&self, registry: Registry) -> Result<Vec<OperatorRecord>, OperatorError> {
        match self {
            RegistryStore::Sqlite(path) => {
                let path = path.clone();
                blocking(move || ordered_inbox::sqlite::operators::list_of(registry, &path)).await
            }
            RegistryStore::Postgres(target) => {
                ordered_inbox::postgres::operators::list_of(registry, target.as_ref()).await
            }
        }
    }

    async fn revoke(&self, registry: Registry, name: String) -> Result<Revocation, OperatorError> {
        match self {
            RegistryStore::Sqlite(path) => {
                let path = path.clone();
                blocking(move || {
                    ordered_inbox::sqlite::operators::revoke_in(registry, &path, &name)
                })
                .await
            }
            RegistryStore::Postgres(target) => {
                ordered_inbox::postgres::operators::revoke_in(registry, target.as_ref(), &name)
                    .await
            }
        }
    }
}

/// Runs a command of the SQLite file off the async threads (it waits for the writer's
/// transactions).
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, OperatorError> + Send + 'static,
) -> Result<T, OperatorError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|error| {
            Err(OperatorError::Store {
                path: "the registry".to_owned(),
                reason: error.to_string(),
            })
        })
}

pub(super) fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    RegistryStore: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(list_producers, add_producer))
        .routes(routes!(revoke_producer))
        .routes(routes!(list_operators, add_operator))
        .routes(routes!(revoke_operator))
}

/// A new member. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
struct NewMember {
    /// 1 to 64 letters, digits, '.', '_', '-' or '@'; never reused.
    #[schema(pattern = "^[A-Za-z0-9._@-]{1,64}$")]
    name: String,
}

impl RequestBody for NewMember {
    const FIELDS: &'static [&'static str] = &["name"];
}

/// A new member and its token, shown this once.
#[derive(ToSchema)]
#[allow(dead_code)]
struct Added {
    name: String,
    /// Send it as `Authorization: Bearer TOKEN`; it is not stored and is never shown again.
    token: String,
}

/// A revocation.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct Revoked {
    name: String,
    revoked_at: String,
    /// True when the member had been revoked before (nothing changed).
    already_revoked: bool,
}

/// A member as a listing shows it: never the token.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct Member {
    name: String,
    created_at: String,
    revoked_at: Option<String>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct ProducerList {
    producers: Vec<ProducerView>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct OperatorList {
    operators: Vec<Member>,
}

/// `GET /v1/producers`: name, current epoch, owned aggregates, last delivery; never tokens.
#[utoipa::path(get, path = "/v1/producers", tag = "operators", security(("operator" = [])), responses(
    (status = 200, description = "Every producer, the first registered first (never tokens)", body = ProducerList),
    (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 500, response = http_edge::openapi::StoreFailed),
    (status = 503, response = http_edge::openapi::StoreUnavailable),
))]
async fn list_producers(
    _operator: Operator,
    State(inbox): State<SharedInbox>,
) -> Result<Response, AppError> {
    let producers = inbox.reads().producers().await?;
    Ok(json_response(
        StatusCode::OK,
        json!({"producers": producers}),
    ))
}

/// `POST /v1/producers {name}`: registers a producer; its token is answered once.
#[utoipa::path(post, path = "/v1/producers", tag = "operators", request_body = NewMember,
    security(("operator" = [])), responses(
    (status = 201, description = "Registered; the token is shown this once", body = Added),
    (status = 400, response = http_edge::openapi::BadRequest),
    (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 409, description = "The name is taken, or was revoked and is never reused", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 500, response = http_edge::openapi::StoreFailed),
    (status = 503, response = http_edge::openapi::StoreUnavailable),
))]
async fn add_producer(
    _operator: Operator,
    State(registry): State<RegistryStore>,
    body: Result<Json<NewMember>, AppError>,
) -> Result<Response, AppError> {
    add(&registry, Registry::Producers, body).await
}

/// `DELETE /v1/producers/{name}`: the producer's token stops working at once.
#[utoipa::path(delete, path = "/v1/producers/{name}", tag = "operators",
    params(("name" = String, Path, description = "The producer")),
    security(("operator" = [])), responses(
    (status = 200, description = "Revoked (or already revoked)", body = Revoked),
    (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 404, description = "No producer has this name", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 500, response = http_edge::openapi::StoreFailed),
    (status = 503, response = http_edge::openapi::StoreUnavailable),
))]
async fn revoke_producer(
    _operator: Operator,
    State(registry): State<RegistryStore>,
    Path(name): Path<String>,
) -> Result<Response, AppError> {
    revoke(&registry, Registry::Producers, name).await
}

/// `GET /v1/operators`: every operator, the first registered first; never tokens.
#[utoipa::path(get, path = "/v1/operators", tag = "operators", security(("operator" = [])), responses(
    (status = 200, description = "Every operator, the first registered first (never tokens)", body = OperatorList),
    (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 500, response = http_edge::openapi::StoreFailed),
    (status = 503, response = http_edge::openapi::StoreUnavailable),
))]
async fn list_operators(
    _operator: Operator,
    State(registry): State<RegistryStore>,
) -> Result<Response, AppError> {
    let operators: Vec<_> = registry
        .list(Registry::Operators)
        .await
        .map_err(refused)?
        .into_iter()
        .map(|record| {
            json!({"name": record.name, "createdAt": record.created_at, "revokedAt": record.revoked_at})
        })
        .collect();
    Ok(json_response(
        StatusCode::OK,
        json!({"operators": operators}),
    ))
}

/// `POST /v1/operators {name}`: registers an operator; its token is answered once.
#[utoipa::path(post, path = "/v1/operators", tag = "operators", request_body = NewMember,
    security(("operator" = [])), responses(
    (status = 201, description = "Registered; the token is shown this once", body = Added),
    (status = 400, response = http_edge::openapi::BadRequest),
    (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 409, description = "The name is taken, or was revoked and is never reused", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 500, response = http_edge::openapi::StoreFailed),
    (status = 503, response = http_edge::openapi::StoreUnavailable),
))]
async fn add_operator(
    _operator: Operator,
    State(registry): State<RegistryStore>,
    body: Result<Json<NewMember>, AppError>,
) -> Result<Response, AppError> {
    add(&registry, Registry::Operators, body).await
}

/// `DELETE /v1/operators/{name}`: the operator's token stops working at once; past
/// resolutions keep the name.
#[utoipa::path(delete, path = "/v1/operators/{name}", tag = "operators",
    params(("name" = String, Path, description = "The operator")),
    security(("operator" = [])), responses(
    (status = 200, description = "Revoked (or already revoked)", body = Revoked),
    (status = 401, description = "No active operator's token", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 404, description = "No operator has this name", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    (status = 500, response = http_edge::openapi::StoreFailed),
    (status = 503, response = http_edge::openapi::StoreUnavailable),
))]
async fn revoke_operator(
    _operator: Operator,
    State(registry): State<RegistryStore>,
    Path(name): Path<String>,
) -> Result<Response, AppError> {
    revoke(&registry, Registry::Operators, name).await
}

async fn add(
    registry: &RegistryStore,
    kind: Registry,
    body: Result<Json<NewMember>, AppError>,
) -> Result<Response, AppError> {
    let Json(member) = body?;
    let token = registry
        .add(kind, member.name.clone())
        .await
        .map_err(refused)?;
    Ok(json_response(
        StatusCode::CREATED,
        json!({"name": member.name, "token": token}),
    ))
}

async fn revoke(
    registry: &RegistryStore,
    kind: Registry,
    name: String,
) -> Result<Response, AppError> {
    let revocation = registry.revoke(kind, name.clone()).await.map_err(refused)?;
    Ok(json_response(
        StatusCode::OK,
        json!({"name": name, "revokedAt": revocation.revoked_at, "alreadyRevoked": revocation.already}),
    ))
}

/// A refused registry command in the words of its error: the caller's (400, 404, 409), or the
/// store's (503 with `Retry-After`, the cause in the log only).
fn refused(error: OperatorError) -> AppError {
    match error {
        OperatorError::InvalidName(..) => AppError::bad_request(error.to_string()),
        OperatorError::AlreadyExists(..) | OperatorError::NameRetired { .. } => {
            AppError::problem_with_detail(StatusCode::CONFLICT, "Name taken", error.to_string())
        }
        OperatorError::Unknown(..) => {
            AppError::problem_with_detail(StatusCode::NOT_FOUND, "No such name", error.to_string())
        }
        OperatorError::MissingDatabase(_) | OperatorError::Store { .. } => {
            AppError::Inbox(InboxError::Unavailable(error.to_string()))
        }
    }
}
