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
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::json;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::config::StartupError;
use crate::error::{AppError, Query, json_response, problem_response};
use crate::startup::StartupContext;

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

pub fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    SecurityLab: FromRef<S>,
{
    Router::new()
        .route("/configuration", get(configuration))
        .route("/cors/data", get(cors_data))
        .route("/antiforgery/token", get(antiforgery_token))
        .route("/antiforgery/submit", post(antiforgery_submit))
        .route("/antiforgery/count", get(antiforgery_count))
        .route("/encoded", get(encoded))
        .route("/proxy", get(proxy))
        .route("/canonical", get(canonical))
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

/// Refuses a request whose Host is not allowed (or that has more than one) with a 400 problem.
pub async fn filter_hosts(
    State(lab): State<SecurityLab>,
    request: Request,
    next: Next,
) -> Response {
    if request.headers().get_all(header::HOST).iter().count() > 1 {
        return AppError::bad_request("the request has more than one Host header").into_response();
    }
    let authority = request.uri().authority().map(|a| a.as_str());
    let host = request_host(request.headers(), authority);
    if host
        .as_deref()
        .is_some_and(|host| !hosts::has_valid_port(host))
    {
        return AppError::bad_request(
            "the request's Host has a malformed port: it must be a number from 0 to 65535",
        )
        .into_response();
    }
    if !lab.shared.allowed_hosts.allows(host.as_deref()) {
        return AppError::bad_request(
            "the request's Host is not one of the allowed host names (--allowed-hosts)",
        )
        .into_response();
    }
    next.run(request).await
}

/// Resolves the client's scheme and address (a `ClientOrigin` request extension), believing
/// `X-Forwarded-*` only from the known proxy.
pub async fn apply_forwarded_headers(
    State(lab): State<SecurityLab>,
    mut request: Request,
    next: Next,
) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(address)| address.ip());
    let origin = forwarded::resolve(lab.shared.known_proxy, peer, request.headers());
    request.extensions_mut().insert(origin);
    next.run(request).await
}

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

async fn cors_data() -> Json<serde_json::Value> {
    // The fixture has no authentication; the field shows that CORS grants no identity.
    Json(json!({"value": "public classroom data", "authenticated": false}))
}

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

async fn antiforgery_count(State(lab): State<SecurityLab>) -> Json<serde_json::Value> {
    let count = lab.shared.accepted_submissions.load(Ordering::Relaxed);
    Json(json!({"count": count}))
}

#[derive(Debug, Deserialize)]
struct EncodedQuery {
    name: Option<String>,
}

/// The page allows nothing but itself: no script, style, frame or form, so even a value that
/// escaped encoding could not run; and the browser must not sniff it as anything but HTML.
const ENCODED_PAGE_POLICY: &str =
    "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

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
