//! The gate's console: `GET /console` and its pages, a browser's view of the gate's evidence and
//! of an operator's work. The pages are static (plain HTML, CSS and a little JavaScript compiled
//! into the binary) and load without a token; every piece of data comes from the gate's own
//! `/v1` JSON routes, called by the scripts with the token the user pasted at sign-in
//! (`Authorization: Bearer`, kept in the tab's `sessionStorage` only, never in a URL or a
//! cookie). So the pages hold nothing a token would guard, and the `/v1` routes decide who may
//! read and who may resolve, exactly as for a curl user.
//!
//! Every console response carries a strict Content-Security-Policy (scripts only from this
//! server, no inline script), `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer`
//! and `X-Frame-Options: DENY`. The scripts render whatever came from a request as text, never
//! as markup.

mod assets;

use axum::middleware;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use http_edge::pages;

/// The console's pages and static files, documented, each response with [`pages::protect`]'s
/// headers.
pub fn routes() -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(assets::sign_in_page))
        .routes(routes!(assets::aggregate_page))
        .routes(routes!(assets::dead_letter_page))
        .routes(routes!(assets::recheck_page))
        .routes(routes!(assets::producers_page))
        .routes(routes!(assets::asset))
        .layer(middleware::map_response(pages::protect))
}
