//! The console's pages and static files, compiled into the binary. Pages are one layout with a
//! page's own `<main>` filled in; nothing from a request is ever written into them (the scripts
//! read the query string themselves and render it as text).

use axum::extract::Path;
use axum::response::Response;

use crate::http::error::AppError;
use crate::http::pages::{self, Asset, JAVASCRIPT, Page, render};

const LAYOUT: &str = include_str!("assets/layout.html");

const LESSON: Page = Page {
    name: "lesson",
    title: "The lesson",
    main: include_str!("assets/lesson.html"),
    nav: "lesson",
};
const AGGREGATES: Page = Page {
    name: "aggregates",
    title: "Aggregates",
    main: include_str!("assets/aggregates.html"),
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
const LABS: Page = Page {
    name: "labs",
    title: "Labs at a glance",
    main: include_str!("assets/labs.html"),
    nav: "labs",
};

#[utoipa::path(get, path = "/console", tag = "console", responses(
    (status = 200, description = "The lesson page", body = String, content_type = "text/html"),
))]
pub(super) async fn lesson_page() -> Response {
    render(LAYOUT, &LESSON)
}

#[utoipa::path(get, path = "/console/aggregates", tag = "console", responses(
    (status = 200, description = "The aggregates page", body = String, content_type = "text/html"),
))]
pub(super) async fn aggregates_page() -> Response {
    render(LAYOUT, &AGGREGATES)
}

#[utoipa::path(get, path = "/console/aggregate", tag = "console", responses(
    (status = 200, description = "One aggregate's page (the id is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn aggregate_page() -> Response {
    render(LAYOUT, &AGGREGATE)
}

#[utoipa::path(get, path = "/console/deadletter", tag = "console", responses(
    (status = 200, description = "One dead letter's page (the id is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn dead_letter_page() -> Response {
    render(LAYOUT, &DEAD_LETTER)
}

#[utoipa::path(get, path = "/console/labs", tag = "console", responses(
    (status = 200, description = "The labs page", body = String, content_type = "text/html"),
))]
pub(super) async fn labs_page() -> Response {
    render(LAYOUT, &LABS)
}

/// The console's own static files (name, content type, content), beside the shared ones
/// ([`pages::SHARED_ASSETS`]: the stylesheet, the icon and `common.js`).
const ASSETS: &[Asset] = &[
    ("console.js", JAVASCRIPT, include_str!("assets/console.js")),
    ("lesson.js", JAVASCRIPT, include_str!("assets/lesson.js")),
    (
        "aggregates.js",
        JAVASCRIPT,
        include_str!("assets/aggregates.js"),
    ),
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
    ("labs.js", JAVASCRIPT, include_str!("assets/labs.js")),
];

/// `GET /console/assets/{name}`: a shared file or one of [`ASSETS`], else 404.
#[utoipa::path(get, path = "/console/assets/{name}", tag = "console",
    params(("name" = String, Path, description = "console.css, common.js, console.js, a page's script, favicon.svg")),
    responses(
        (status = 200, description = "The file", content(
            (String = "text/css"), (String = "text/javascript"), (String = "image/svg+xml"),
        )),
        (status = 404, description = "The console has no such file", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
pub(super) async fn asset(Path(name): Path<String>) -> Result<Response, AppError> {
    pages::asset(ASSETS, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_names_its_script_and_fills_its_main() {
        pages::assert_well_formed(
            LAYOUT,
            &[&LESSON, &AGGREGATES, &AGGREGATE, &DEAD_LETTER, &LABS],
            ASSETS,
        );
    }
}
