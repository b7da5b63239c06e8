//! The one error type handlers return, rendered as RFC 9457 `application/problem+json`, and the
//! request extractors whose rejections become problems: 400 for the request's shape (never axum's
//! default 415/422), 415 only for a charset other than UTF-8, 413 for a body over the limit, 408
//! for a body that did not arrive in time.

use axum::extract::rejection::{BytesRejection, FailedToBufferBody, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use ordered_inbox::InboxError;

use ordered_inbox::sqlite::store::StoreError;

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
    /// The request did not arrive in time: 408, and the connection is closed, since the rest of
    /// a late body could otherwise be read as the next request.
    #[error("{0}")]
    RequestTimeout(String),
    /// The server is already receiving its budget of request bodies: 503 with `Retry-After`,
    /// and the connection is closed, since the unread body could otherwise be read as the next
    /// request.
    #[error("{0}")]
    BodyBudgetExhausted(String),
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
            AppError::RequestTimeout(detail) => {
                let mut response = problem_response(
                    StatusCode::REQUEST_TIMEOUT,
                    "Request Timeout",
                    Some(&detail),
                );
                response.headers_mut().insert(
                    header::CONNECTION,
                    axum::http::HeaderValue::from_static("close"),
                );
                response
            }
            AppError::BodyBudgetExhausted(detail) => {
                let mut response = problem_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Too many request bodies at once",
                    Some(&detail),
                );
                let headers = response.headers_mut();
                // By then, bodies that waited as long as this one have had their answer.
                let retry_after = crate::body_budget::BODY_BUDGET_PATIENCE.as_secs().max(1);
                headers.insert(header::RETRY_AFTER, header::HeaderValue::from(retry_after));
                headers.insert(
                    header::CONNECTION,
                    axum::http::HeaderValue::from_static("close"),
                );
                response
            }
            AppError::Store(error) => store_failure(error.is_retryable(), &error),
            AppError::Inbox(InboxError::Handler(error)) => handler_failure(&error),
            AppError::Inbox(error) => {
                let retryable = matches!(error, InboxError::Unavailable(_));
                store_failure(retryable, &error)
            }
        }
    }
}

/// `response` with `Retry-After: seconds`: every 429 says when to come back.
pub fn with_retry_after(mut response: Response, seconds: u32) -> Response {
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, header::HeaderValue::from(seconds));
    response
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

/// 503 with `Retry-After`: the inbox's handler (the ledger) failed applying the delivery, so
/// nothing of it was recorded, and delivering it again retries. Never a 4xx: the message itself
/// was acceptable (a poison would have been quarantined). The cause goes to the server log only.
fn handler_failure(error: &ordered_inbox::HandlerError) -> Response {
    tracing::error!(target: "production_lab::store", %error, "the inbox's handler failed");
    let mut response = problem_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "The message could not be applied",
        Some("the ledger failed applying it and nothing of it was recorded; deliver it again"),
    );
    response.headers_mut().insert(
        header::RETRY_AFTER,
        header::HeaderValue::from(STORE_RETRY_AFTER_SECONDS),
    );
    response
}

/// The router's own bare 404 (no route) and 405 (method not allowed, with its `Allow` header)
/// become problem+json like every other error. Responses that carry a body already are left
/// alone. `method` is the request's.
pub fn bare_status_as_problem(response: Response, method: &axum::http::Method) -> Response {
    let status = response.status();
    if response.headers().contains_key(header::CONTENT_TYPE)
        || !matches!(
            status,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED
        )
    {
        return response;
    }
    let (title, detail) = if status == StatusCode::NOT_FOUND {
        return no_route().into_response();
    } else {
        let allowed = response
            .headers()
            .get(header::ALLOW)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_owned();
        (
            "Method Not Allowed",
            format!("this route does not answer {method}; it answers {allowed}"),
        )
    };
    let mut problem = problem_response(status, title, Some(&detail));
    if let Some(allow) = response.headers().get(header::ALLOW) {
        problem.headers_mut().insert(header::ALLOW, allow.clone());
    }
    problem
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
        if let Some(charset) = charset_other_than_utf8(content_type) {
            return Err(AppError::Problem {
                status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
                title: "Unsupported Media Type".to_owned(),
                detail: Some(format!(
                    "a JSON body must be UTF-8; the Content-Type names charset '{}'",
                    shortened(&charset)
                )),
            });
        }
        let bytes = axum::body::Bytes::from_request(request, state)
            .await
            .map_err(body_rejection)?;
        parse_body(&bytes).map(Json)
    }
}

/// 413: a body past the most the server reads of any body.
pub fn body_too_large() -> AppError {
    AppError::Problem {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        title: "Content Too Large".to_owned(),
        detail: Some(format!(
            "the request body is larger than the limit of {} bytes",
            crate::body_budget::MAX_REQUEST_BODY_BYTES
        )),
    }
}

/// Why a body could not be read: too large (413), not complete within the body-read timeout
/// (408, and the connection is closed), no room in the server's body budget (503), or anything
/// else the client broke (400).
fn body_rejection(rejection: BytesRejection) -> AppError {
    if let BytesRejection::FailedToBufferBody(FailedToBufferBody::LengthLimitError(_)) = rejection {
        return body_too_large();
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&rejection);
    while let Some(error) = cause {
        if error.is::<tower_http::timeout::TimeoutError>() {
            return AppError::RequestTimeout(
                "the request body did not arrive within the body-read timeout".to_owned(),
            );
        }
        if let Some(exhausted) = error.downcast_ref::<crate::body_budget::BodyBudgetExhausted>() {
            return AppError::BodyBudgetExhausted(exhausted.to_string());
        }
        cause = error.source();
    }
    AppError::bad_request(rejection.body_text())
}

fn is_json_content_type(value: &str) -> bool {
    let media = value.split(';').next().unwrap_or("").trim();
    media.eq_ignore_ascii_case("application/json")
        || (media.len() > 5
            && media[..media.len() - 5].contains('/')
            && media[media.len() - 5..].eq_ignore_ascii_case("+json"))
}

/// The `charset` parameter of a media type when it names anything but UTF-8 (any letter case,
/// quoted or not). JSON text exchanged between systems is UTF-8 (RFC 8259 §8.1), and reading
/// UTF-16 as UTF-8 would bind another value than the client sent.
fn charset_other_than_utf8(content_type: &str) -> Option<String> {
    content_type
        .split(';')
        .skip(1)
        .filter_map(|parameter| parameter.split_once('='))
        .filter(|(name, _)| name.trim().eq_ignore_ascii_case("charset"))
        .map(|(_, value)| value.trim().trim_matches('"').to_owned())
        .find(|charset| !charset.eq_ignore_ascii_case("utf-8"))
}

/// Parses a body: JSON object without repeated members, case-insensitive property names, then
/// the typed value.
pub fn parse_body<T: RequestBody>(bytes: &[u8]) -> Result<T, AppError> {
    // The top level's names are spelled as `T` spells them while the text is read, so the
    // object is built once.
    let value = parse_unique(bytes, T::FIELDS)?;
    if !value.is_object() {
        return Err(AppError::bad_request("the body must be a JSON object"));
    }
    serde_json::from_value(value).map_err(|error| shape_error::<T>(bytes, error))
}

/// The 400 of a body whose members do not fit `T`, in the words serde_json uses when it reads
/// `T` from text: read from a [`Value`], whose numbers keep their written text, a number that
/// does not fit its member says only "invalid number", where the text names the number and
/// what the member expects (`floating point `1.5`, expected i32`). Only a refused body pays
/// for reading it twice.
fn shape_error<T: RequestBody>(bytes: &[u8], read_from_value: serde_json::Error) -> AppError {
    let text = match parse_unique(bytes, T::FIELDS) {
        Ok(value) => value.to_string(),
        Err(error) => return error,
    };
    // The text is the value's, which `T` just refused, so reading it fails too.
    let message = serde_json::from_str::<T>(&text)
        .err()
        .unwrap_or(read_from_value)
        .to_string();
    // The position is in the rewritten text, not in the client's.
    let reason = message
        .rsplit_once(" at line ")
        .map_or(message.as_str(), |(reason, _)| reason);
    AppError::bad_request(format!("invalid body: {reason}"))
}

/// Parses JSON text into a value, refusing an object that names one member twice, exactly or in
/// another letter case, at any depth. serde_json alone keeps the last of two equal keys, while a
/// proxy or a log that reads the first would see another message than the one applied.
pub fn parse_unique_members(bytes: &[u8]) -> Result<Value, AppError> {
    parse_unique(bytes, &[])
}

/// [`parse_unique_members`], with the top-level names that match one of `fields` in another
/// letter case spelled as in `fields`.
fn parse_unique(bytes: &[u8], fields: &'static [&'static str]) -> Result<Value, AppError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let parsed =
        serde::de::DeserializeSeed::deserialize(UniqueMembersVisitor { fields }, &mut deserializer)
            .and_then(|value| deserializer.end().map(|()| value));
    match parsed {
        Ok(value) => Ok(value),
        Err(error) if error.classify() == serde_json::error::Category::Data => {
            // Only the repeated-member check (and a number's text serde_json itself scanned,
            // which always parses) raises a data error while building a `Value`.
            let message = error.to_string();
            let reason = message
                .rsplit_once(" at line ")
                .map_or(message.as_str(), |(reason, _)| reason);
            Err(AppError::bad_request(format!(
                "{reason} (line {}, column {})",
                error.line(),
                error.column()
            )))
        }
        Err(error) => Err(AppError::bad_request(format!(
            "the body is not valid JSON (line {}, column {})",
            error.line(),
            error.column()
        ))),
    }
}

/// A JSON value whose objects never repeat a member name (compared case-insensitively).
struct UniqueMembers(Value);

impl<'de> serde::Deserialize<'de> for UniqueMembers {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(UniqueMembersVisitor { fields: &[] })
            .map(UniqueMembers)
    }
}

/// Builds a [`UniqueMembers`] value; an object's names that match one of `fields` in another
/// letter case are spelled as in `fields` (only the top level has any).
struct UniqueMembersVisitor {
    fields: &'static [&'static str],
}

impl<'de> serde::de::DeserializeSeed<'de> for UniqueMembersVisitor {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueMembersVisitor {
    type Value = Value;

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        // JSON text has no NaN or infinity, so this is always a number.
        Ok(serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_owned()))
    }

    fn visit_string<E>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(UniqueMembers(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        let mut first = true;
        // A B-tree: a body's objects are small, and it needs neither hashing nor a random seed,
        // while a large object still costs log n per name.
        let mut folded_names = std::collections::BTreeSet::new();
        while let Some(mut name) = map.next_key::<String>()? {
            if std::mem::take(&mut first) && name == NUMBER_TOKEN {
                return written_number(&mut map);
            }
            if !folded_names.insert(folded(&name)) {
                return Err(serde::de::Error::custom(format!(
                    "property '{}' is given more than once",
                    shortened(&name)
                )));
            }
            if let Some(field) = self.fields.iter().find(|f| f.eq_ignore_ascii_case(&name)) {
                name.clear();
                name.push_str(field);
            }
            let UniqueMembers(value) = map.next_value()?;
            object.insert(name, value);
        }
        Ok(Value::Object(object))
    }
}

/// The one member name of the map serde_json's reader hands over for a number that it keeps as
/// written (`arbitrary_precision`: a fraction, an exponent, or an integer beyond 64 bits); the
/// member's value is the number's text. serde_json's own `Value` reads the same name so: an
/// object of that one member in a client's JSON reads as a number too, as it does there.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// The number whose text is the value of the map's [`NUMBER_TOKEN`] member, every digit kept.
fn written_number<'de, A: serde::de::MapAccess<'de>>(map: &mut A) -> Result<Value, A::Error> {
    let text: String = map.next_value()?;
    text.parse::<serde_json::Number>()
        .map(Value::Number)
        .map_err(serde::de::Error::custom)
}

/// A name in lower case, for comparing names case-insensitively; ASCII names (nearly all) skip
/// the Unicode tables.
fn folded(name: &str) -> String {
    if name.is_ascii() {
        name.to_ascii_lowercase()
    } else {
        name.chars().flat_map(char::to_lowercase).collect()
    }
}

/// A client-chosen name, cut to a length that fits a problem detail.
fn shortened(name: &str) -> String {
    const MAX_CHARS: usize = 64;
    if name.chars().count() <= MAX_CHARS {
        name.to_owned()
    } else {
        let mut short: String = name.chars().take(MAX_CHARS).collect();
        short.push('…');
        short
    }
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

/// The 404 of a path that no route matches.
pub fn no_route() -> AppError {
    AppError::Problem {
        status: StatusCode::NOT_FOUND,
        title: "Not Found".to_owned(),
        detail: Some("no route matches this path".to_owned()),
    }
}

/// A path whose typed values are route constraints, as ASP.NET's `{id:long}` is: a value that
/// does not bind means the route does not match, so the answer is the same 404 as for an
/// unknown path (and comes before any other check of the request).
#[derive(Debug)]
pub struct ConstrainedPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ConstrainedPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(ConstrainedPath(value)),
            Err(_) => Err(no_route()),
        }
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
    fn a_bodys_numbers_keep_every_digit_as_written() {
        let text = r#"{"a":123456789012345678901234567890,"b":[12.30,9007199254740993],"c":{"d":1.5e-7,"e":-0}}"#;
        let value = parse_unique_members(text.as_bytes()).unwrap();
        assert_eq!(value.to_string(), text);
    }

    #[test]
    fn a_number_that_does_not_fit_its_member_is_named_as_the_text_reader_names_it() {
        let detail = |amount: &str| {
            let body = format!(r#"{{"messageId":"a","amount":{amount}}}"#);
            match parse_body::<Probe>(body.as_bytes()) {
                Err(AppError::BadRequest(detail)) => detail,
                other => panic!("not a bad request: {other:?}"),
            }
        };
        assert_eq!(
            detail("2.5"),
            "invalid body: invalid type: floating point `2.5`, expected i32"
        );
        assert_eq!(
            detail("123456789012345678901234567890"),
            "invalid body: invalid type: floating point `1.2345678901234568e+29`, expected i32"
        );
        assert_eq!(
            detail("9007199254740993"),
            "invalid body: invalid value: integer `9007199254740993`, expected i32"
        );
    }

    #[test]
    fn a_repeated_member_is_refused_at_any_depth_and_in_any_case() {
        for body in [
            &br#"{"messageId":"d","amount":-5,"amount":5}"#[..],
            br#"{"messageId":"d","amount":-5,"Amount":5}"#,
            br#"{"messageId":"d","amount":1,"x":{"a":1,"A":2}}"#,
            br#"{"messageId":"d","amount":1,"x":[{"b":1,"b":1}]}"#,
            br#"{"messageId":"d","amount":1,"extra":1,"EXTRA":2}"#,
            "{\"messageId\":\"d\",\"amount\":1,\"\u{c4}rger\":1,\"\u{e4}RGER\":2}".as_bytes(),
        ] {
            let error = parse_body::<Probe>(body).expect_err("a repeated member");
            let AppError::BadRequest(detail) = error else {
                panic!("not a bad request")
            };
            assert!(detail.contains("more than once"), "{detail}");
        }
        let nested = parse_unique_members(br#"{"a":{"b":[1,2.5,true,null,"s"]},"c":-3}"#)
            .expect("a document without repeats");
        assert_eq!(nested["a"]["b"][1], 2.5);
        assert_eq!(nested["c"], -3);
    }

    #[test]
    fn only_top_level_names_are_spelled_as_the_body_type_spells_them() {
        let value = parse_unique(br#"{"MESSAGEID":"a","x":{"AMOUNT":1}}"#, Probe::FIELDS).unwrap();
        assert_eq!(value["messageId"], "a");
        assert_eq!(value["x"]["AMOUNT"], 1);
        assert!(value.get("MESSAGEID").is_none());
        assert!(matches!(
            parse_body::<Probe>(br#"{"messageId":"a","amount":1} x"#),
            Err(AppError::BadRequest(detail)) if detail.contains("not valid JSON")
        ));
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

    #[test]
    fn only_utf8_is_an_acceptable_charset() {
        assert_eq!(charset_other_than_utf8("application/json"), None);
        assert_eq!(
            charset_other_than_utf8("application/json; charset=utf-8"),
            None
        );
        assert_eq!(
            charset_other_than_utf8("application/json;CHARSET=\"UTF-8\""),
            None
        );
        assert_eq!(
            charset_other_than_utf8("application/json; charset=utf-16").as_deref(),
            Some("utf-16")
        );
        assert_eq!(
            charset_other_than_utf8("application/json; charset=utf-8; charset=latin1").as_deref(),
            Some("latin1")
        );
    }
}
