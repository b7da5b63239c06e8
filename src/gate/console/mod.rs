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

use axum::http::{HeaderName, HeaderValue, header};
use axum::middleware;
use axum::response::Response;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Everything from this origin only: no inline script, no inline style attribute, no
/// third-party anything; no framing, no `<base>`, forms post here.
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The console's pages and static files, documented, each response with [`protect`]'s headers.
pub fn routes() -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(assets::sign_in_page))
        .routes(routes!(assets::aggregate_page))
        .routes(routes!(assets::dead_letter_page))
        .routes(routes!(assets::producers_page))
        .routes(routes!(assets::asset))
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
