//! The OpenAPI 3.1 document at `GET /openapi.json`, generated from the handlers.
//!
//! Every route is registered through `utoipa_axum`'s `routes!`, which takes the path and the
//! methods from the handler's `#[utoipa::path]` annotation: the router is built from the document's
//! own entries, so the two cannot drift. What every operation shares (a problem+json 400 for a
//! refused Host or a malformed request, the `x-request-id` header) is added once, here.

use serde::Serialize;
use utoipa::openapi::path::{Operation, Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Header, OpenApi as Document, Ref, RefOr, Required, Type};
use utoipa::{Modify, OpenApi, ToResponse, ToSchema};

/// The media type of every error answer.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem: how every error of this server answers. Some carry extension members
/// that say more (the 409 of a resolution carries `current`, a full quarantine its counts).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
pub struct Problem {
    /// A URI naming the kind of problem: the status's section of RFC 9110 or RFC 6585.
    #[serde(rename = "type")]
    kind: String,
    /// A short summary of the problem.
    title: String,
    /// The HTTP status code.
    #[schema(minimum = 400, maximum = 599)]
    status: u16,
    /// What is wrong, in a sentence; absent when the title says it all.
    #[schema(required = false)]
    detail: String,
    /// The request's id, as echoed in the `x-request-id` response header.
    request_id: String,
}

/// A refusal in the seed's own shape, not a problem document: the classroom contracts keep it.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct SeedError {
    error: String,
}

/// The request's shape is wrong (its body, a field, a header, the path or the query), or its
/// Host is not one of the allowed host names; `detail` says which.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
#[allow(dead_code)]
pub struct BadRequest(Problem);

/// The body did not arrive within the body-read timeout; the connection is closed.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
#[allow(dead_code)]
pub struct RequestTimeout(Problem);

/// The body is larger than the server's limit (2 MiB).
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
#[allow(dead_code)]
pub struct ContentTooLarge(Problem);

/// The JSON body names a charset other than UTF-8.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
#[allow(dead_code)]
pub struct UnsupportedMediaType(Problem);

/// The store is temporarily unavailable (its writer is busy past its retries, or stopping);
/// a retry can succeed.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
#[allow(dead_code)]
pub struct StoreUnavailable(Problem);

/// The store failed underneath the request; the detail stays in the server's log.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
#[allow(dead_code)]
pub struct StoreFailed(Problem);

/// The root of the document: its info and the components every lab refers to. The labs' paths
/// are merged in by the router (the lab's `app::api_router`, the gate's `routes::finish`).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "production-lab",
        description = "A Development-only loopback fixture with fault switches that reproduces a \
            production-contracts teaching lab over real HTTP and real SQLite rows. Every error is \
            application/problem+json with a requestId member; every response carries x-request-id.",
        license(name = "MIT OR Apache-2.0")
    ),
    components(
        schemas(Problem),
        responses(
            BadRequest,
            RequestTimeout,
            ContentTooLarge,
            UnsupportedMediaType,
            StoreUnavailable,
            StoreFailed
        )
    ),
    tags(
        (name = "operating", description = "Liveness, readiness, metrics and this document"),
        (name = "ordered", description = "The ordered inbox: the classroom door, the general door, evidence, resolution"),
        (name = "sql", description = "SQLite's NULLs, query plans, snapshots and busy retry"),
        (name = "messaging", description = "Transactional outbox with leases, idempotent inbox"),
        (name = "outbox", description = "The general outbox: events for any aggregate, leased to relays by generation, acked or fenced"),
        (name = "http", description = "Entity tags, conditional writes, versions, NDJSON"),
        (name = "cache", description = "Stampede protection and invalidation after commit"),
        (name = "security", description = "Live configuration, CORS, antiforgery, encoding, forwarded headers"),
        (name = "privacy", description = "Redacted logs and bounded metric labels"),
        (name = "worker", description = "A bounded background queue"),
        (name = "contracts", description = "Consumer contracts and failures around a commit"),
        (name = "pipeline", description = "An idempotent conditional pipeline"),
        (name = "broker", description = "The NATS JetStream consumer's evidence (404 without --nats)"),
        (name = "console", description = "The browser console: pages, files, live events, read-only views"),
    )
)]
pub struct ApiDoc;

/// Adds what every operation shares: a `400` problem (the host filter runs before any route,
/// and most routes validate their input) unless the operation documents its own; for an
/// operation with a body, what reading any body can answer (408, 413, 415); and the
/// `x-request-id` request header and response header.
pub struct Shared;

impl Modify for Shared {
    fn modify(&self, document: &mut Document) {
        let components = document.components.get_or_insert_with(Default::default);
        for (name, description) in [
            (
                "operator",
                "An operator's token (production-lab operator add NAME)",
            ),
            (
                "producer",
                "A producer's token (production-lab producer add NAME)",
            ),
        ] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .description(Some(description))
                        .build(),
                ),
            );
        }
        for item in document.paths.paths.values_mut() {
            for operation in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ]
            .into_iter()
            .flatten()
            {
                share(operation);
            }
        }
    }
}

fn share(operation: &mut Operation) {
    let mut shared = vec![("400", "BadRequest")];
    if operation.request_body.is_some() {
        shared.extend([
            ("408", "RequestTimeout"),
            ("413", "ContentTooLarge"),
            ("415", "UnsupportedMediaType"),
        ]);
    }
    for (status, response) in shared {
        operation
            .responses
            .responses
            .entry(status.to_owned())
            .or_insert_with(|| RefOr::Ref(Ref::from_response_name(response)));
    }
    let request_id = request_id_header();
    let parameters = operation.parameters.get_or_insert_with(Vec::new);
    let named = |parameter: &RefOr<Parameter>| match parameter {
        RefOr::T(parameter) => parameter.name == request_id.name,
        RefOr::Ref(_) => false,
    };
    if !parameters.iter().any(named) {
        parameters.push(RefOr::T(request_id));
    }
    for response in operation.responses.responses.values_mut() {
        if let RefOr::T(response) = response {
            response.headers.insert(
                crate::REQUEST_ID_HEADER.as_str().to_owned(),
                RefOr::T(
                    Header::builder()
                        .schema(Some(utoipa::openapi::schema::Object::with_type(
                            Type::String,
                        )))
                        .description(Some(
                            "The request's id: the client's when it was sane, else a new one",
                        ))
                        .build(),
                ),
            );
        }
    }
}

fn request_id_header() -> Parameter {
    ParameterBuilder::new()
        .name(crate::REQUEST_ID_HEADER.as_str())
        .parameter_in(ParameterIn::Header)
        .required(Required::False)
        .description(Some(
            "Correlates the request's log lines; kept when 1 to 128 characters of A-Z a-z 0-9 . _ : - + / = @, else replaced by a generated one",
        ))
        .schema(Some(utoipa::openapi::schema::Object::with_type(Type::String)))
        .build()
}
