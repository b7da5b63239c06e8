//! The console's pages and static files, compiled into the binary. Pages are one layout with a
//! page's own `<main>` filled in; nothing from a request is ever written into them (the scripts
//! read the query string themselves and render it as text). The stylesheet, the icon and the
//! script helpers both consoles share are http-edge's ([`pages::SHARED_ASSETS`]).

use axum::extract::Path;
use axum::response::Response;

use http_edge::error::AppError;
use http_edge::pages::{self, Asset, JAVASCRIPT, Page, render};

const LAYOUT: &str = include_str!("assets/layout.html");

const SIGN_IN: Page = Page {
    name: "signin",
    title: "Aggregates",
    main: include_str!("assets/signin.html"),
    nav: "aggregates",
};
const AGGREGATE: Page = Page {
    name: "aggregate",
    title: "Aggregate",
    main: include_str!("assets/aggregate.html"),
    nav: "aggregates",
};
const DEAD_LETTER: Page = Page {
    name: "deadletter",
    title: "Dead letter",
    main: include_str!("assets/deadletter.html"),
    nav: "aggregates",
};
const RECHECK: Page = Page {
    name: "recheck",
    title: "Recheck dead letters",
    main: include_str!("assets/recheck.html"),
    nav: "recheck",
};
const PRODUCERS: Page = Page {
    name: "producers",
    title: "Producers and operators",
    main: include_str!("assets/producers.html"),
    nav: "producers",
};

/// `GET /console`: sign-in, then the inventory of aggregates.
#[utoipa::path(get, path = "/console", tag = "console", responses(
    (status = 200, description = "The sign-in page, then the inventory of aggregates", body = String, content_type = "text/html"),
))]
pub(super) async fn sign_in_page() -> Response {
    render(LAYOUT, &SIGN_IN)
}

/// `GET /console/aggregate?id=`: one aggregate (its script reads the id).
#[utoipa::path(get, path = "/console/aggregate", tag = "console", responses(
    (status = 200, description = "One aggregate's page (the id is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn aggregate_page() -> Response {
    render(LAYOUT, &AGGREGATE)
}

/// `GET /console/deadletter?messageId=&producer=`: one dead letter (its script reads the id).
#[utoipa::path(get, path = "/console/deadletter", tag = "console", responses(
    (status = 200, description = "One dead letter's page (its identity is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn dead_letter_page() -> Response {
    render(LAYOUT, &DEAD_LETTER)
}

/// `GET /console/recheck`: an operator's recheck or bulk skip of open dead letters.
#[utoipa::path(get, path = "/console/recheck", tag = "console", responses(
    (status = 200, description = "The recheck and bulk skip of open dead letters: a filter, a preview, then the run", body = String, content_type = "text/html"),
))]
pub(super) async fn recheck_page() -> Response {
    render(LAYOUT, &RECHECK)
}

/// `GET /console/producers`: the registry of producers and operators.
#[utoipa::path(get, path = "/console/producers", tag = "console", responses(
    (status = 200, description = "The registry of producers and operators", body = String, content_type = "text/html"),
))]
pub(super) async fn producers_page() -> Response {
    render(LAYOUT, &PRODUCERS)
}

/// The console's own static files (name, content type, content), beside the shared ones.
const ASSETS: &[Asset] = &[
    ("gate.js", JAVASCRIPT, include_str!("assets/gate.js")),
    ("signin.js", JAVASCRIPT, include_str!("assets/signin.js")),
    (
        "aggregate.js",
        JAVASCRIPT,
        include_str!("assets/aggregate.js"),
    ),
    (
        "deadletter.js",
        JAVASCRIPT,
        include_str!("assets/deadletter.js"),
    ),
    (
        "producers.js",
        JAVASCRIPT,
        include_str!("assets/producers.js"),
    ),
    ("recheck.js", JAVASCRIPT, include_str!("assets/recheck.js")),
];

/// `GET /console/assets/{name}`: a shared file or one of [`ASSETS`], else 404.
#[utoipa::path(get, path = "/console/assets/{name}", tag = "console",
    params(("name" = String, Path, description = "console.css, common.js, gate.js, a page's script, favicon.svg")),
    responses(
        (status = 200, description = "The file", content(
            (String = "text/css"), (String = "text/javascript"), (String = "image/svg+xml"),
        )),
        (status = 404, description = "The console has no such file", body = http_edge::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
pub(super) async fn asset(Path(name): Path<String>) -> Result<Response, AppError> {
    pages::asset(ASSETS, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_names_its_script_and_fills_its_main_without_inline_code() {
        pages::assert_well_formed(
            LAYOUT,
            &[&SIGN_IN, &AGGREGATE, &DEAD_LETTER, &RECHECK, &PRODUCERS],
            ASSETS,
        );
    }
}
