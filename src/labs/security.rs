//! The security lab: live configuration, CORS, antiforgery, HTML encoding, forwarded headers
//! from a known proxy, canonical URLs and host filtering.
//!
//! Everything here is per application (no statics): the test suite runs many servers in one
//! process, each with its own settings file, key, counter and policy.

mod antiforgery;
mod forwarded;
mod hosts;
mod live;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{ConnectInfo, FromRef, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::json;
use tower_http::cors::{AllowOrigin, CorsLayer};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::StartupError;
use crate::http::error::{AppError, Query, json_response, problem_response};
use crate::labs::context::StartupContext;

use antiforgery::Antiforgery;
use forwarded::ClientOrigin;
use hosts::AllowedHosts;
pub use live::WatchEvidence;
use live::{LiveConfiguration, SettingsWatch};

/// The one origin the classroom CORS policy grants.
pub const CLASSROOM_ORIGIN: &str = "https://client.example";
/// Where canonical URLs point, whatever Host a request arrived with.
const PUBLIC_BASE: &str = "https://public.example.test";

/// The security lab's own state; cheap to clone.
#[derive(Clone)]
pub struct SecurityLab {
    shared: Arc<Shared>,
}

struct Shared {
    live: Arc<LiveConfiguration>,
    /// Keeps the settings watch running for as long as the application lives.
    _watch: SettingsWatch,
    antiforgery: Antiforgery,
    accepted_submissions: AtomicU64,
    known_proxy: IpAddr,
    allowed_hosts: AllowedHosts,
}

impl SecurityLab {
    pub fn new(context: &StartupContext<'_>) -> Result<Self, StartupError> {
        let config = context.config;
        let allowed_hosts = AllowedHosts::parse(&config.allowed_hosts).map_err(|reason| {
            StartupError::AllowedHosts {
                value: config.allowed_hosts.clone(),
                reason,
            }
        })?;
        let live = Arc::new(LiveConfiguration::new(
            config.settings.clone(),
            context.settings.clone(),
        ));
        let watch = live::watch(live.clone()).map_err(|reason| StartupError::Settings {
            path: config.settings.display().to_string(),
            reason,
        })?;
        Ok(SecurityLab {
            shared: Arc::new(Shared {
                live,
                _watch: watch,
                antiforgery: Antiforgery::with_ephemeral_key(),
                accepted_submissions: AtomicU64::new(0),
                known_proxy: config.known_proxy,
                allowed_hosts,
            }),
        })
    }
}

impl SecurityLab {
    /// What the settings watch did so far: reloads asked for, reads, ignored events.
    pub fn settings_watch(&self) -> WatchEvidence {
        self.shared.live.evidence()
    }

    /// Why the live settings file is rejected right now (the same reason `GET /configuration`
    /// answers 503 with); `None` while it is valid.
    pub fn configuration_error(&self) -> Option<String> {
        self.shared.live.status().error.clone()
    }
}

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SecurityLab: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(configuration))
        .routes(routes!(cors_data))
        .routes(routes!(antiforgery_token))
        .routes(routes!(antiforgery_submit))
        .routes(routes!(antiforgery_count))
        .routes(routes!(encoded))
        .routes(routes!(proxy))
        .routes(routes!(canonical))
}

// The bodies below, as the OpenAPI document describes them.

/// The last valid live settings; the secret itself is never shown.
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct ConfigurationView {
    label: String,
    #[schema(minimum = 1, maximum = 10)]
    maximum: i64,
    has_secret: bool,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct CorsData {
    value: String,
    /// Always false: CORS grants no identity.
    authenticated: bool,
}

#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct AntiforgeryToken {
    /// Send it back in the `x-csrf-token` header, with the cookie.
    request_token: String,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct SubmissionAccepted {
    /// Submissions accepted so far.
    accepted: u64,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct SubmissionRefused {
    error: String,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct SubmissionCount {
    count: u64,
}

/// The client as the server believes it.
#[derive(ToSchema)]
#[allow(dead_code)]
struct ProxyView {
    /// `http`, or `X-Forwarded-Proto` from the known proxy.
    scheme: String,
    /// The peer, or `X-Forwarded-For`'s right-most entry from the known proxy.
    remote: Option<String>,
    /// The Host the request arrived with.
    host: Option<String>,
}

#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct CanonicalView {
    /// The Host the request arrived with (never used for the link).
    observed_host: Option<String>,
    /// Built from configuration only.
    url: String,
}

// The middleware that wraps every route (and the 404 fallback): host filtering, forwarded
// headers, CORS. The application stacks them, outermost first in that order. Antiforgery is
// checked by the endpoint that needs it (`POST /antiforgery/submit`), as the seed's endpoint
// validates explicitly.

/// The classroom CORS policy. The layer answers every preflight itself with 200 and always lists
/// the configured methods and headers; a browser grants a preflight only when the origin is
/// echoed in Access-Control-Allow-Origin and the asked method and headers are in those lists.
pub fn cors_policy() -> CorsLayer {
    CorsLayer::new()
        .allow_origin(AllowOrigin::list([HeaderValue::from_static(
            CLASSROOM_ORIGIN,
        )]))
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::CONTENT_TYPE])
        .allow_credentials(false)
}

/// The request's Host: the `Host` header, else the URI's authority (HTTP/2). Read from the
/// connection's own request line and headers only — never from `X-Forwarded-Host`.
fn request_host(headers: &HeaderMap, request_authority: Option<&str>) -> Option<String> {
    headers
        .get(header::HOST)
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
        .or_else(|| request_authority.map(ToOwned::to_owned))
}

/// The edge admits every request through the security lab (see [`admit`]).
impl http_edge::observe::http::Admission for SecurityLab {
    #[allow(clippy::result_large_err)] // the refusal is the response itself
    fn admit(&self, request: Request) -> Result<Request, Response> {
        admit(self, request)
    }
}

/// What the edge does for the security lab before any handler runs, as in the seed: refuses a
/// request whose Host is not allowed (or that has more than one) with a 400 problem, then records
/// where the request came from (`ClientOrigin`, believing forwarded headers only from the
/// known proxy).
#[allow(clippy::result_large_err)] // the refusal is the response itself
pub fn admit(lab: &SecurityLab, mut request: Request) -> Result<Request, Response> {
    if let Some(refusal) = host_refusal(lab, &request) {
        return Err(refusal.into_response());
    }
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(address)| address.ip());
    let origin = forwarded::resolve(lab.shared.known_proxy, peer, request.headers());
    request.extensions_mut().insert(origin);
    Ok(request)
}

fn host_refusal(lab: &SecurityLab, request: &Request) -> Option<AppError> {
    if request.headers().get_all(header::HOST).iter().count() > 1 {
        return Some(AppError::bad_request(
            "the request has more than one Host header",
        ));
    }
    let authority = request.uri().authority().map(|a| a.as_str());
    let host = request_host(request.headers(), authority);
    if host
        .as_deref()
        .is_some_and(|host| !hosts::has_valid_port(host))
    {
        return Some(AppError::bad_request(
            "the request's Host has a malformed port: it must be a number from 0 to 65535",
        ));
    }
    if !lab.shared.allowed_hosts.allows(host.as_deref()) {
        return Some(AppError::bad_request(
            "the request's Host is not one of the allowed host names (--allowed-hosts)",
        ));
    }
    None
}

#[utoipa::path(get, path = "/configuration", tag = "security", responses(
    (status = 200, description = "The settings file is valid: its values", body = ConfigurationView),
    (status = 503, description = "The settings file on disk is invalid; `detail` names the field", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
))]
async fn configuration(State(lab): State<SecurityLab>) -> Response {
    let status = lab.shared.live.status();
    match &status.error {
        Some(reason) => problem_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "Current configuration is invalid",
            Some(reason),
        ),
        None => {
            let settings = &status.last_good;
            json_response(
                StatusCode::OK,
                json!({
                    "label": settings.label,
                    "maximum": settings.maximum,
                    "hasSecret": !settings.secret.is_empty(),
                }),
            )
        }
    }
}

/// Classroom data readable cross-origin from `https://client.example` only.
#[utoipa::path(get, path = "/cors/data", tag = "security", responses(
    (status = 200, description = "Public classroom data", body = CorsData),
))]
async fn cors_data() -> Json<serde_json::Value> {
    // The fixture has no authentication; the field shows that CORS grants no identity.
    Json(json!({"value": "public classroom data", "authenticated": false}))
}

/// A request token, and its cookie when the client has none yet.
#[utoipa::path(get, path = "/antiforgery/token", tag = "security", responses(
    (status = 200, description = "The request token (the cookie is set alongside)", body = AntiforgeryToken,
        headers(("set-cookie" = String, description = "ProductionLab.Csrf, when the request had none"))),
    (status = 500, description = "The cookie could not be written", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
))]
async fn antiforgery_token(State(lab): State<SecurityLab>, headers: HeaderMap) -> Response {
    let issued = lab.shared.antiforgery.issue(&headers);
    let mut response = Json(json!({"requestToken": issued.request_token})).into_response();
    let response_headers = response.headers_mut();
    // A token must never be served from a cache to someone else.
    response_headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response_headers.insert(
        header::X_FRAME_OPTIONS,
        HeaderValue::from_static("SAMEORIGIN"),
    );
    if let Some(cookie) = issued.set_cookie {
        match HeaderValue::from_str(&cookie) {
            Ok(value) => {
                response_headers.insert(header::SET_COOKIE, value);
            }
            // Base64url tokens are always a valid header value; refuse rather than hand out a
            // request token without its cookie.
            Err(_) => {
                return AppError::problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Could not issue an antiforgery cookie",
                )
                .into_response();
            }
        }
    }
    response
}

/// Accepts a submission only with the antiforgery cookie and its request token.
#[utoipa::path(post, path = "/antiforgery/submit", tag = "security",
    params(
        ("x-csrf-token" = String, Header, description = "The request token from GET /antiforgery/token"),
        ("ProductionLab.Csrf" = String, Cookie, description = "The cookie GET /antiforgery/token set"),
    ),
    responses(
        (status = 200, description = "Accepted", body = SubmissionAccepted),
        (status = 400, description = "The token or the cookie is missing or does not match (the seed's JSON body), or a refused Host (problem)", content(
            (SubmissionRefused = "application/json"),
            (crate::http::openapi::Problem = "application/problem+json"),
        )),
    ),
)]
async fn antiforgery_submit(State(lab): State<SecurityLab>, headers: HeaderMap) -> Response {
    let lab = &lab.shared;
    if let Err(reason) = lab.antiforgery.validate(&headers) {
        tracing::debug!(target: "production_lab::antiforgery", %reason, "submission refused");
        return json_response(
            StatusCode::BAD_REQUEST,
            json!({"error": "Antiforgery validation failed"}),
        );
    }
    let accepted = lab.accepted_submissions.fetch_add(1, Ordering::Relaxed) + 1;
    json_response(StatusCode::OK, json!({"accepted": accepted}))
}

#[utoipa::path(get, path = "/antiforgery/count", tag = "security", responses(
    (status = 200, description = "Submissions accepted so far", body = SubmissionCount),
))]
async fn antiforgery_count(State(lab): State<SecurityLab>) -> Json<serde_json::Value> {
    let count = lab.shared.accepted_submissions.load(Ordering::Relaxed);
    Json(json!({"count": count}))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct EncodedQuery {
    /// Any text: it is HTML-encoded into the page.
    name: Option<String>,
}

/// The page allows nothing but itself: no script, style, frame or form, so even a value that
/// escaped encoding could not run; and the browser must not sniff it as anything but HTML.
const ENCODED_PAGE_POLICY: &str =
    "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

#[utoipa::path(get, path = "/encoded", tag = "security", params(EncodedQuery), responses(
    (status = 200, description = "A page with `name` encoded as text", body = String, content_type = "text/html",
        headers(
            ("content-security-policy" = String, description = "Nothing but the page itself"),
            ("x-content-type-options" = String, description = "nosniff"),
        )),
))]
async fn encoded(Query(query): Query<EncodedQuery>) -> impl IntoResponse {
    (
        [
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(ENCODED_PAGE_POLICY),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        Html(encoded_page(query.name.as_deref().unwrap_or(""))),
    )
}

/// The page with `name` as text in a `<p>`. Quotes and `/` are encoded too (not only `& < >`), so
/// the same encoded value would also be safe inside a quoted attribute.
fn encoded_page(name: &str) -> String {
    format!(
        "<!doctype html><html><body><p>{}</p></body></html>",
        html_escape::encode_safe(name)
    )
}

/// The scheme and client address, believing `X-Forwarded-*` only from the known proxy.
#[utoipa::path(get, path = "/proxy", tag = "security",
    params(
        ("x-forwarded-for" = Option<String>, Header, description = "Believed only from the known proxy"),
        ("x-forwarded-proto" = Option<String>, Header, description = "Believed only from the known proxy"),
    ),
    responses((status = 200, description = "The client as the server believes it", body = ProxyView)),
)]
async fn proxy(Extension(origin): Extension<ClientOrigin>, request: Request) -> Response {
    let host = request_host(
        request.headers(),
        request.uri().authority().map(|a| a.as_str()),
    );
    json_response(
        StatusCode::OK,
        json!({
            "scheme": origin.scheme,
            "remote": origin.remote.map(|ip| ip.to_string()),
            "host": host,
        }),
    )
}

/// A canonical link built from configuration, whatever Host the request carried.
#[utoipa::path(get, path = "/canonical", tag = "security", responses(
    (status = 200, description = "The canonical URL and the observed Host", body = CanonicalView),
))]
async fn canonical(request: Request) -> Json<serde_json::Value> {
    let host = request_host(
        request.headers(),
        request.uri().authority().map(|a| a.as_str()),
    );
    // Built from configuration only: a hostile Host must never reach a link or a redirect.
    Json(json!({"observedHost": host, "url": format!("{PUBLIC_BASE}/items/7")}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_text_is_encoded_for_text_and_attributes() {
        let page = encoded_page(r#"<script>alert("x&y")</script> 'é'"#);
        assert_eq!(
            page,
            "<!doctype html><html><body><p>&lt;script&gt;alert(&quot;x&amp;y&quot;)&lt;&#x2F;script&gt; &#x27;é&#x27;</p></body></html>"
        );
    }
}
