//! The console: `GET /console` and its pages, a browser's view of the ordered inbox's evidence
//! and of the operator's work, on the same server and under the same loopback and environment
//! rules as every route.
//!
//! - Pages are plain HTML, CSS and a little JavaScript compiled into the binary (`assets`); no
//!   build step and no network. The scripts call the same JSON routes a curl user calls; the
//!   console adds no write route of its own.
//! - `api`: read-only routes under `/console/api/` for rows no other route lists.
//! - [`events`]: live updates as server-sent events.
//!
//! Every console response carries a strict Content-Security-Policy (scripts only from this
//! server, no inline script), `X-Content-Type-Options: nosniff` and `Referrer-Policy:
//! no-referrer`. The scripts render whatever came from a request as text, never as markup.

mod api;
mod assets;
pub mod events;

use axum::extract::FromRef;
use axum::http::{HeaderName, HeaderValue, header};
use axum::middleware;
use axum::response::Response;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use events::ConsoleEvents;

use crate::inbox::SharedInbox;

/// The console's Content-Security-Policy: everything from this origin only, so no inline script,
/// no inline style attribute, no third-party anything; no framing, no `<base>`, forms post here.
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
    ConsoleEvents: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(assets::lesson_page))
        .routes(routes!(assets::aggregates_page))
        .routes(routes!(assets::aggregate_page))
        .routes(routes!(assets::dead_letter_page))
        .routes(routes!(assets::labs_page))
        .routes(routes!(assets::asset))
        .routes(routes!(events::events))
        .merge(api::routes())
        .layer(middleware::map_response(protect))
}

/// The headers every console response carries, whatever its status.
async fn protect(mut response: Response) -> Response {
    let headers = response.headers_mut();
    let set = [
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
    ];
    for (name, value) in set {
        headers.insert::<HeaderName>(name, value);
    }
    response
}
