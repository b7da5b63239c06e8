//! What both consoles (the lab's and the gate's) serve their pages with: one layout with a
//! page's own `<main>` filled in, the static files compiled into the binary (the ones both
//! share, [`SHARED_ASSETS`], beside each console's own), and the headers every console response
//! carries. Nothing from a request is ever written into a page (the
//! scripts read the query string themselves and render it as text).

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};

use crate::error::AppError;

/// Everything from this origin only: no inline script, no inline style attribute, no
/// third-party anything; no framing, no `<base>`, forms post here.
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The content type of a console's scripts.
pub const JAVASCRIPT: &str = "text/javascript; charset=utf-8";

/// One page: its name (its script, `{name}.js`), its title, its `<main>` content and the nav
/// entry to mark as current.
pub struct Page {
    pub name: &'static str,
    pub title: &'static str,
    pub main: &'static str,
    pub nav: &'static str,
}

/// A static file: its name under `/console/assets/`, its content type and its content.
pub type Asset = (&'static str, &'static str, &'static str);

/// The page's HTML: `layout` with the page's title, script, current nav entry and `<main>`.
pub fn html(layout: &str, page: &Page) -> String {
    let current = format!("data-nav=\"{}\"", page.nav);
    layout
        .replace("{{title}}", page.title)
        .replace("{{page}}", page.name)
        .replace(&current, &format!("{current} aria-current=\"page\""))
        .replace("{{main}}", page.main)
}

/// The page as a response, revalidated at each load.
pub fn render(layout: &str, page: &Page) -> Response {
    let mut response = Html(html(layout, page)).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The file `name` of [`SHARED_ASSETS`] or of a console's own `assets`, else 404.
pub fn asset(assets: &[Asset], name: &str) -> Result<Response, AppError> {
    let Some((_, content_type, body)) = SHARED_ASSETS
        .iter()
        .chain(assets)
        .find(|(known, _, _)| *known == name)
    else {
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

/// The headers every console response carries, whatever its status (a `map_response` layer).
pub async fn protect(mut response: Response) -> Response {
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

/// What a console's own test checks of each of its pages: it marks its nav entry, leaves no
/// placeholder, loads the shared helpers before its own script (which `assets` serves) and
/// holds no inline script or style; and that its files do not shadow the shared ones.
pub fn assert_well_formed(layout: &str, pages: &[&Page], assets: &[Asset]) {
    for (shared, _, _) in SHARED_ASSETS {
        assert!(
            !assets.iter().any(|(name, _, _)| name == shared),
            "{shared} is served from the shared files only"
        );
    }
    for page in pages {
        let html = html(layout, page);
        let common = html.find("/console/assets/common.js");
        let own = html.find(&format!("/console/assets/{}.js", page.name));
        assert!(
            common.is_some_and(|common| own.is_some_and(|own| common < own)),
            "{} loads common.js before its own script",
            page.name
        );
        assert!(
            html.contains("aria-current=\"page\""),
            "{} marks its nav entry",
            page.name
        );
        assert!(!html.contains("{{"), "{} leaves a placeholder", page.name);
        let script = format!("{}.js", page.name);
        assert!(
            html.contains(&format!("/console/assets/{script}")),
            "{} loads {script}",
            page.name
        );
        assert!(
            SHARED_ASSETS
                .iter()
                .chain(assets)
                .any(|(name, _, _)| *name == script),
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

/// The stylesheet both consoles share, served as `console.css`.
pub const CONSOLE_CSS: &str = include_str!("console.css");
/// The icon both consoles share, served as `favicon.svg`.
pub const FAVICON_SVG: &str = include_str!("favicon.svg");
/// The script helpers both consoles share (`ConsoleCommon`), served as `common.js` and loaded
/// by each layout before the console's own helpers.
pub const COMMON_JS: &str = include_str!("common.js");

/// The files every console serves under `/console/assets/` beside its own.
pub const SHARED_ASSETS: &[Asset] = &[
    ("console.css", "text/css; charset=utf-8", CONSOLE_CSS),
    ("favicon.svg", "image/svg+xml", FAVICON_SVG),
    ("common.js", JAVASCRIPT, COMMON_JS),
];
