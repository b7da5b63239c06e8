//! The one error type handlers return, rendered as RFC 9457 `application/problem+json`, and the
//! request extractors whose rejections become 400 problems (never axum's default 415/422).

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use ordered_inbox::InboxError;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The request's shape is wrong: body, field, header, path or query. Always 400.
    #[error("{0}")]
    BadRequest(String),
    /// A deliberate problem answer with a chosen status (a fault switch, 428, 503 …).
    #[error("{title}")]
    Problem {
        status: StatusCode,
        title: String,
        detail: Option<String>,
    },
    /// The store failed underneath the request: 503 when the writer is gone or SQLite is busy
    /// past its retries, 500 otherwise. The detail stays in the server log.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The ordered inbox's store failed, likewise.
    #[error(transparent)]
    Inbox(#[from] InboxError),
}

impl AppError {
    pub fn bad_request(detail: impl Into<String>) -> Self {
        AppError::BadRequest(detail.into())
    }

    pub fn problem(status: StatusCode, title: impl Into<String>) -> Self {
        AppError::Problem {
            status,
            title: title.into(),
            detail: None,
        }
    }

    /// A problem answer with a `detail` sentence saying what is wrong.
    pub fn problem_with_detail(
        status: StatusCode,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        AppError::Problem {
            status,
            title: title.into(),
            detail: Some(detail.into()),
        }
    }
}

impl From<rusqlite::Error> for AppError {
    fn from(error: rusqlite::Error) -> Self {
        AppError::Store(StoreError::Sqlite(error))
    }
}

/// Builds a problem+json response like ASP.NET's `Results.Problem`.
pub fn problem_response(status: StatusCode, title: &str, detail: Option<&str>) -> Response {
    problem_response_with(status, title, detail, Value::Null)
}

/// A problem response with extension members (RFC 9457 §3.2), e.g. a 409's current state.
/// `extensions` is merged into the body when it is a JSON object.
pub fn problem_response_with(
    status: StatusCode,
    title: &str,
    detail: Option<&str>,
    extensions: Value,
) -> Response {
    let mut body = json!({
        "type": problem_type(status),
        "title": title,
        "status": status.as_u16(),
    });
    if let Some(map) = body.as_object_mut() {
        if let Some(detail) = detail {
            map.insert("detail".to_owned(), Value::String(detail.to_owned()));
        }
        if let Value::Object(extensions) = extensions {
            map.extend(extensions);
        }
    }
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

/// The `type` URI ASP.NET would link: the status's own section of RFC 9110 (15.5.x for 4xx,
/// 15.6.x for 5xx), RFC 6585 for the statuses it defines, else the status class's section.
fn problem_type(status: StatusCode) -> String {
    let code = status.as_u16();
    let rfc9110 =
        |section: String| format!("https://tools.ietf.org/html/rfc9110#section-15.{section}");
    match code {
        400..=417 => rfc9110(format!("5.{}", code - 399)),
        421..=422 => rfc9110(format!("5.{}", code - 401)),
        426 => rfc9110("5.22".to_owned()),
        428 => "https://tools.ietf.org/html/rfc6585#section-3".to_owned(),
        429 => "https://tools.ietf.org/html/rfc6585#section-4".to_owned(),
        431 => "https://tools.ietf.org/html/rfc6585#section-5".to_owned(),
        500..=505 => rfc9110(format!("6.{}", code - 499)),
        _ => rfc9110(format!("{}", code / 100 + 1)),
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        match self {
            AppError::BadRequest(detail) => {
                problem_response(StatusCode::BAD_REQUEST, "Bad Request", Some(&detail))
            }
            AppError::Problem {
                status,
                title,
                detail,
            } => problem_response(status, &title, detail.as_deref()),
            AppError::Store(error) => store_failure(error.is_retryable(), &error),
            AppError::Inbox(error) => {
                let retryable = matches!(error, InboxError::Unavailable(_));
                store_failure(retryable, &error)
            }
        }
    }
}

/// How long a client is asked to wait before retrying after a 503 store answer, in seconds.
pub const STORE_RETRY_AFTER_SECONDS: u32 = 1;

/// 503 with `Retry-After` for a failure a retry can clear (lock contention, a stopped writer, a
/// PostgreSQL that is down or restarting), 500 otherwise. The detail goes to the server log only.
fn store_failure(retryable: bool, error: &dyn std::fmt::Display) -> Response {
    tracing::error!(target: "production_lab::store", %error, "store failure");
    if retryable {
        let mut response = problem_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "The store is temporarily unavailable",
            None,
        );
        response.headers_mut().insert(
            header::RETRY_AFTER,
            header::HeaderValue::from(STORE_RETRY_AFTER_SECONDS),
        );
        response
    } else {
        problem_response(StatusCode::INTERNAL_SERVER_ERROR, "The store failed", None)
    }
}

/// Request bodies whose property names bind case-insensitively, as ASP.NET's do
/// (`messageId`, `MessageId` and `MESSAGEID` all fill `message_id`).
pub trait RequestBody: DeserializeOwned {
    /// The serialized (camelCase) names of the body's top-level properties.
    const FIELDS: &'static [&'static str];
}

/// A JSON body extractor: 400 problem for a wrong content type, broken JSON, a missing or
/// mistyped property, or two spellings of one property.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T, S> FromRequest<S> for Json<T>
where
    T: RequestBody,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let content_type = request
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("");
        if !is_json_content_type(content_type) {
            return Err(AppError::bad_request(
                "expected a JSON body with Content-Type: application/json",
            ));
        }
        let bytes = axum::body::Bytes::from_request(request, state)
            .await
            .map_err(|rejection| AppError::bad_request(rejection.body_text()))?;
        parse_body(&bytes).map(Json)
    }
}

fn is_json_content_type(value: &str) -> bool {
    let media = value.split(';').next().unwrap_or("").trim();
    media.eq_ignore_ascii_case("application/json")
        || (media.len() > 5
            && media[..media.len() - 5].contains('/')
            && media[media.len() - 5..].eq_ignore_ascii_case("+json"))
}

/// Parses a body: JSON object, case-insensitive property names, then the typed value.
pub fn parse_body<T: RequestBody>(bytes: &[u8]) -> Result<T, AppError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        AppError::bad_request(format!(
            "the body is not valid JSON (line {}, column {})",
            e.line(),
            e.column()
        ))
    })?;
    let Value::Object(object) = value else {
        return Err(AppError::bad_request("the body must be a JSON object"));
    };
    let mut normalized = Map::new();
    for (key, value) in object {
        let name = T::FIELDS
            .iter()
            .find(|field| field.eq_ignore_ascii_case(&key))
            .map(|field| (*field).to_owned())
            .unwrap_or(key);
        if normalized.insert(name.clone(), value).is_some() {
            return Err(AppError::bad_request(format!(
                "property '{name}' is given more than once"
            )));
        }
    }
    serde_json::from_value(Value::Object(normalized))
        .map_err(|e| AppError::bad_request(format!("invalid body: {e}")))
}

/// `axum::extract::Path` whose rejection is a 400 problem.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(AppError))]
pub struct Path<T>(pub T);

impl From<PathRejection> for AppError {
    fn from(rejection: PathRejection) -> Self {
        AppError::bad_request(rejection.body_text())
    }
}

/// `axum::extract::Query` whose rejection is a 400 problem.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(AppError))]
pub struct Query<T>(pub T);

impl From<QueryRejection> for AppError {
    fn from(rejection: QueryRejection) -> Self {
        AppError::bad_request(rejection.body_text())
    }
}

/// A JSON response with an explicit status, for contract bodies that are not problems
/// (`409 {"outcome":"gap"}` and the like).
pub fn json_response(status: StatusCode, body: Value) -> Response {
    (status, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        message_id: String,
        amount: i32,
    }
    impl RequestBody for Probe {
        const FIELDS: &'static [&'static str] = &["messageId", "amount"];
    }

    #[test]
    fn property_names_bind_case_insensitively() {
        let probe: Probe = parse_body(br#"{"MessageId":"a","AMOUNT":2}"#).unwrap();
        assert_eq!((probe.message_id.as_str(), probe.amount), ("a", 2));
    }

    #[test]
    fn shape_errors_are_bad_requests() {
        for body in [
            &br#"{"messageId":"a"}"#[..],
            br#"{"messageId":"a","amount":"2"}"#,
            br#"{"messageId":"a","amount":2.5}"#,
            br#"{"messageId":"a","amount":99999999999}"#,
            br#"{"messageId":"a","MessageId":"b","amount":1}"#,
            br#"[1]"#,
            br#"{"messageId":"#,
        ] {
            assert!(
                matches!(parse_body::<Probe>(body), Err(AppError::BadRequest(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn problem_types_link_the_status_own_section() {
        let type_of = |code: u16| problem_type(StatusCode::from_u16(code).unwrap());
        let rfc9110 = "https://tools.ietf.org/html/rfc9110#section-15.";
        assert_eq!(type_of(400), format!("{rfc9110}5.1"));
        assert_eq!(type_of(409), format!("{rfc9110}5.10"));
        assert_eq!(type_of(412), format!("{rfc9110}5.13"));
        assert_eq!(type_of(421), format!("{rfc9110}5.20"));
        assert_eq!(type_of(422), format!("{rfc9110}5.21"));
        assert_eq!(type_of(426), format!("{rfc9110}5.22"));
        assert_eq!(type_of(500), format!("{rfc9110}6.1"));
        assert_eq!(type_of(503), format!("{rfc9110}6.4"));
        assert_eq!(type_of(451), format!("{rfc9110}5"));
        assert_eq!(
            type_of(429),
            "https://tools.ietf.org/html/rfc6585#section-4"
        );
    }

    #[test]
    fn json_media_types() {
        assert!(is_json_content_type("application/json"));
        assert!(is_json_content_type("application/json; charset=utf-8"));
        assert!(is_json_content_type("application/problem+json"));
        assert!(!is_json_content_type("text/plain"));
        assert!(!is_json_content_type(""));
        assert!(!is_json_content_type("+json"));
    }
}
