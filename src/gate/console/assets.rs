//! The console's pages and static files, compiled into the binary. Pages are one layout with a
//! page's own `<main>` filled in; nothing from a request is ever written into them (the scripts
//! read the query string themselves and render it as text). The stylesheet and the icon are the
//! lab console's files, included as they are: static text, no route of the lab's.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};

use crate::http::error::AppError;

const LAYOUT: &str = include_str!("assets/layout.html");

/// One page: its name (its script), its title, its `<main>` content and its nav entry.
struct Page {
    name: &'static str,
    title: &'static str,
    main: &'static str,
    nav: &'static str,
}

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
const PRODUCERS: Page = Page {
    name: "producers",
    title: "Producers and operators",
    main: include_str!("assets/producers.html"),
    nav: "producers",
};

/// The page's HTML: the layout with the page's title, script, current nav entry and `<main>`.
fn html(page: &Page) -> String {
    let current = format!("data-nav=\"{}\"", page.nav);
    LAYOUT
        .replace("{{title}}", page.title)
        .replace("{{page}}", page.name)
        .replace(&current, &format!("{current} aria-current=\"page\""))
        .replace("{{main}}", page.main)
}

fn render(page: &Page) -> Response {
    let mut response = Html(html(page)).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// `GET /console`: sign-in, then the inventory of aggregates.
#[utoipa::path(get, path = "/console", tag = "console", responses(
    (status = 200, description = "The sign-in page, then the inventory of aggregates", body = String, content_type = "text/html"),
))]
pub(super) async fn sign_in_page() -> Response {
    render(&SIGN_IN)
}

/// `GET /console/aggregate?id=`: one aggregate (its script reads the id).
#[utoipa::path(get, path = "/console/aggregate", tag = "console", responses(
    (status = 200, description = "One aggregate's page (the id is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn aggregate_page() -> Response {
    render(&AGGREGATE)
}

/// `GET /console/deadletter?messageId=&producer=`: one dead letter (its script reads the id).
#[utoipa::path(get, path = "/console/deadletter", tag = "console", responses(
    (status = 200, description = "One dead letter's page (its identity is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn dead_letter_page() -> Response {
    render(&DEAD_LETTER)
}

/// `GET /console/producers`: the registry of producers and operators.
#[utoipa::path(get, path = "/console/producers", tag = "console", responses(
    (status = 200, description = "The registry of producers and operators", body = String, content_type = "text/html"),
))]
pub(super) async fn producers_page() -> Response {
    render(&PRODUCERS)
}

const JAVASCRIPT: &str = "text/javascript; charset=utf-8";

/// The static files: name, content type, content.
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("../../console/assets/console.css"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_str!("../../console/assets/favicon.svg"),
    ),
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
];

/// `GET /console/assets/{name}`: one of [`ASSETS`], else 404.
#[utoipa::path(get, path = "/console/assets/{name}", tag = "console",
    params(("name" = String, Path, description = "console.css, gate.js, a page's script, favicon.svg")),
    responses(
        (status = 200, description = "The file", content(
            (String = "text/css"), (String = "text/javascript"), (String = "image/svg+xml"),
        )),
        (status = 404, description = "The console has no such file", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
pub(super) async fn asset(Path(name): Path<String>) -> Result<Response, AppError> {
    let Some((_, content_type, body)) = ASSETS.iter().find(|(known, _, _)| *known == name) else {
        return Err(AppError::problem_with_detail(
            StatusCode::NOT_FOUND,
            "No such console file",
            "the console serves only the files it was built with",
        ));
    };
    Ok((
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            // Revalidate each load: a rebuilt gate serves new files at the same names.
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        *body,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_names_its_script_and_fills_its_main_without_inline_code() {
        for page in [&SIGN_IN, &AGGREGATE, &DEAD_LETTER, &PRODUCERS] {
            let html = html(page);
            assert!(html.contains("aria-current=\"page\""), "{}", page.name);
            assert!(!html.contains("{{"), "{} leaves a placeholder", page.name);
            let script = format!("{}.js", page.name);
            assert!(
                html.contains(&format!("/console/assets/{script}")),
                "{} loads {script}",
                page.name
            );
            assert!(ASSETS.iter().any(|(name, _, _)| *name == script));
            assert!(
                !page.main.contains("<script"),
                "inline script in {}",
                page.name
            );
            assert!(
                !page.main.contains("style="),
                "inline style in {}",
                page.name
            );
        }
    }
}
