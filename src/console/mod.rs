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
use axum::middleware;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use events::ConsoleEvents;

use crate::http::pages;
use crate::inbox::SharedInbox;

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
        .layer(middleware::map_response(pages::protect))
}
