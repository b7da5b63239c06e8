//! The console's pages and static files, compiled into the binary. Pages are one layout with a
//! page's own `<main>` filled in; nothing from a request is ever written into them (the scripts
//! read the query string themselves and render it as text).

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};

use crate::http::error::AppError;

const LAYOUT: &str = include_str!("assets/layout.html");

/// One page: its name (the nav entry and its script), its title and its `<main>` content.
struct Page {
    name: &'static str,
    title: &'static str,
    main: &'static str,
    /// The nav entry to mark as current.
    nav: &'static str,
}

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

/// The page's HTML: the layout with the page's title, scripts, current nav entry and `<main>`.
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

#[utoipa::path(get, path = "/console", tag = "console", responses(
    (status = 200, description = "The lesson page", body = String, content_type = "text/html"),
))]
pub(super) async fn lesson_page() -> Response {
    render(&LESSON)
}

#[utoipa::path(get, path = "/console/aggregates", tag = "console", responses(
    (status = 200, description = "The aggregates page", body = String, content_type = "text/html"),
))]
pub(super) async fn aggregates_page() -> Response {
    render(&AGGREGATES)
}

#[utoipa::path(get, path = "/console/aggregate", tag = "console", responses(
    (status = 200, description = "One aggregate's page (the id is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn aggregate_page() -> Response {
    render(&AGGREGATE)
}

#[utoipa::path(get, path = "/console/deadletter", tag = "console", responses(
    (status = 200, description = "One dead letter's page (the id is in its query, read by its script)", body = String, content_type = "text/html"),
))]
pub(super) async fn dead_letter_page() -> Response {
    render(&DEAD_LETTER)
}

#[utoipa::path(get, path = "/console/labs", tag = "console", responses(
    (status = 200, description = "The labs page", body = String, content_type = "text/html"),
))]
pub(super) async fn labs_page() -> Response {
    render(&LABS)
}

/// The static files: name, content type, content.
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("assets/console.css"),
    ),
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/console.js"),
    ),
    (
        "lesson.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/lesson.js"),
    ),
    (
        "aggregates.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/aggregates.js"),
    ),
    (
        "aggregate.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/aggregate.js"),
    ),
    (
        "deadletter.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/deadletter.js"),
    ),
    (
        "labs.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/labs.js"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_str!("assets/favicon.svg"),
    ),
];

/// `GET /console/assets/{name}`: one of [`ASSETS`], else 404.
#[utoipa::path(get, path = "/console/assets/{name}", tag = "console",
    params(("name" = String, Path, description = "console.css, console.js, a page's script, favicon.svg")),
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
            // Revalidate each load: a rebuilt server serves new files at the same names.
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
    fn every_page_names_its_script_and_fills_its_main() {
        for page in [&LESSON, &AGGREGATES, &AGGREGATE, &DEAD_LETTER, &LABS] {
            let html = html(page);
            assert!(
                html.contains("aria-current=\"page\""),
                "{} marks its nav entry",
                page.name
            );
            assert!(!html.contains("{{"), "{} leaves a placeholder", page.name);
            let script = format!("/console/assets/{}.js", page.name);
            assert!(html.contains(&script), "{} loads {script}", page.name);
            assert!(
                ASSETS
                    .iter()
                    .any(|(name, _, _)| format!("/console/assets/{name}") == script),
                "{script} is served"
            );
            assert!(
                !page.main.contains("<script"),
                "no inline script in {}",
                page.name
            );
            assert!(
                !page.main.contains("style="),
                "no inline style in {}",
                page.name
            );
        }
    }
}
