//! HTTP semantics: a document with entity tags and conditional writes (plus a probe that parks a
//! writer to show the precondition is re-checked inside the write), versioned representations,
//! and an NDJSON stream that completes, reports a failure in-band, or is cut off.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::body::{Body, Bytes};
use axum::extract;
use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::{StreamExt, stream};
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::StartupError;
use crate::http::aspnet::{is_blank_or_longer_than, single_query_value};
use crate::http::error::{AppError, Json, Query, RequestBody, json_response};
use crate::http::etag::{self, IfMatchCondition, version_etag, version_etag_value};
use crate::labs::context::StartupContext;
use crate::store::Store;

/// The http lab's own state: the conditional-write probe, and the shutdown signal that lets its
/// parked writers go.
#[derive(Clone)]
pub struct HttpLab {
    probe: Arc<ConditionProbe>,
    shutdown: CancellationToken,
}

impl HttpLab {
    pub fn new(context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(HttpLab {
            probe: Arc::new(ConditionProbe::default()),
            shutdown: context.shutdown.clone(),
        })
    }

    /// How many `PUT /documents/1` requests are parked by the probe right now. A parked request
    /// whose client went away is dropped by the server and no longer counts.
    pub fn parked_writers(&self) -> usize {
        self.probe.parked.load(Ordering::SeqCst)
    }
}

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
    HttpLab: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(read_document, write_document))
        .routes(routes!(arm_probe))
        .routes(routes!(release_probe))
        .routes(routes!(probe_evidence))
        .routes(routes!(item_v1))
        .routes(routes!(item_v1_extra))
        .routes(routes!(item_v2))
        .routes(routes!(ndjson_stream))
}

/// Whether a writer asked the armed probe to park it since the last arm.
#[derive(ToSchema)]
#[allow(dead_code)]
struct ProbeEvidence {
    entered: bool,
}

// ---------------------------------------------------------------------------------------------
// The race probe
// ---------------------------------------------------------------------------------------------

/// Parks writers that ask for it (`X-Lab-Pause: true`) between their precondition check on the
/// headers and their transaction, so a second writer can change the document in between.
#[derive(Default)]
struct ConditionProbe {
    state: Mutex<ProbeState>,
    /// Requests waiting at the gate right now.
    parked: AtomicUsize,
}

#[derive(Default)]
struct ProbeState {
    /// `None` until the first arm; a cancelled token is a released gate, which lets writers pass.
    gate: Option<CancellationToken>,
    /// A writer asked to pause since the last arm.
    entered: bool,
}

impl ConditionProbe {
    fn lock(&self) -> MutexGuard<'_, ProbeState> {
        // Nothing panics while the lock is held, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the gate and forgets earlier evidence. Re-arming a gate that is still closed keeps
    /// it, so writers already parked there are let go by the next release rather than stranded.
    fn arm(&self) {
        let mut state = self.lock();
        if state
            .gate
            .as_ref()
            .is_none_or(CancellationToken::is_cancelled)
        {
            state.gate = Some(CancellationToken::new());
        }
        state.entered = false;
    }

    fn release(&self) {
        if let Some(gate) = &self.lock().gate {
            gate.cancel();
        }
    }

    fn entered(&self) -> bool {
        self.lock().entered
    }

    /// Waits at the gate if the probe was ever armed and is not released. Never armed: returns at
    /// once and leaves no evidence. Shutdown lets a parked writer go without writing.
    async fn pause(&self, shutdown: &CancellationToken) -> Result<(), AppError> {
        let gate = {
            let mut state = self.lock();
            let Some(gate) = state.gate.clone() else {
                return Ok(());
            };
            state.entered = true;
            gate
        };
        if gate.is_cancelled() {
            return Ok(());
        }
        // Lives in the request's future: if the client disconnects, the server drops the future
        // and this guard with it, so the count falls and the writer never reaches the store.
        let _parked = ParkedWriter::enter(&self.parked);
        tokio::select! {
            () = gate.cancelled() => Ok(()),
            () = shutdown.cancelled() => Err(AppError::problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "The server is shutting down",
            )),
        }
    }
}

/// Counts one parked writer for as long as it exists.
struct ParkedWriter<'a>(&'a AtomicUsize);

impl<'a> ParkedWriter<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        ParkedWriter(count)
    }
}

impl Drop for ParkedWriter<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Arms the probe: from now on a `PUT /documents/1` with `X-Lab-Pause: true` waits between its
/// header check and its transaction until the release.
#[utoipa::path(post, path = "/lab/condition/arm", tag = "http", responses(
    (status = 204, description = "Armed (a closed gate stays closed)"),
))]
async fn arm_probe(State(lab): State<HttpLab>) -> StatusCode {
    lab.probe.arm();
    StatusCode::NO_CONTENT
}

/// Lets every parked writer go.
#[utoipa::path(post, path = "/lab/condition/release", tag = "http", responses(
    (status = 204, description = "Released"),
))]
async fn release_probe(State(lab): State<HttpLab>) -> StatusCode {
    lab.probe.release();
    StatusCode::NO_CONTENT
}

#[utoipa::path(get, path = "/lab/condition/evidence", tag = "http", responses(
    (status = 200, description = "Whether a writer entered the probe since the last arm", body = ProbeEvidence),
))]
async fn probe_evidence(State(lab): State<HttpLab>) -> Response {
    json_response(StatusCode::OK, json!({"entered": lab.probe.entered()}))
}

// ---------------------------------------------------------------------------------------------
// The document
// ---------------------------------------------------------------------------------------------

/// The one document as served: `{"id","body","version"}` in this order.
#[derive(Debug, Serialize, ToSchema)]
struct DocumentView {
    id: i64,
    body: String,
    version: i64,
}

const DOCUMENT_ID: i64 = 1;
const MAX_BODY: usize = 50;

impl DocumentView {
    /// 200 with the document and its entity tag.
    fn into_response_with_etag(self) -> Response {
        let tag = version_etag_value(self.version);
        (StatusCode::OK, [(header::ETAG, tag)], axum::Json(self)).into_response()
    }
}

/// The document with its entity tag; `If-None-Match` with that tag answers 304.
#[utoipa::path(get, path = "/documents/1", tag = "http",
    params(("if-none-match" = Option<String>, Header, pattern = "^[ \\t]*(\\*|(W/)?\"[\\x21\\x23-\\x7E]*\"([ \\t]*,[ \\t]*(W/)?\"[\\x21\\x23-\\x7E]*\")*)[ \\t]*$", description = "Entity tags (`\"v1\"`, `W/\"v1\"`, `*`); anything else answers 400")),
    responses(
        (status = 200, description = "The document", body = DocumentView,
            headers(("etag" = String, description = "The version's strong tag, e.g. \"v1\""))),
        (status = 304, description = "If-None-Match matched the current version",
            headers(("etag" = String))),
        (status = 400, description = "A malformed If-None-Match (the seed's JSON body), or a refused Host (problem)", content(
            (crate::http::openapi::SeedError = "application/json"),
            (crate::http::openapi::Problem = "application/problem+json"),
        )),
        (status = 404, description = "The document row is missing", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn read_document(
    State(store): State<Store>,
    headers: HeaderMap,
) -> Result<Response, AppError> {
    let Ok(if_none_match) = etag::if_none_match(&headers) else {
        // The seed's own body for this case, not a problem document.
        return Ok(json_response(
            StatusCode::BAD_REQUEST,
            json!({"error": "Malformed conditional header"}),
        ));
    };
    let document = store
        .read(|connection| load_document(connection).map_err(AppError::from))
        .await?
        .ok_or_else(document_missing)?;
    if if_none_match.is_some_and(|condition| condition.matches(&version_etag(document.version))) {
        let tag = version_etag_value(document.version);
        return Ok((StatusCode::NOT_MODIFIED, [(header::ETAG, tag)]).into_response());
    }
    Ok(document.into_response_with_etag())
}

fn load_document(connection: &Connection) -> rusqlite::Result<Option<DocumentView>> {
    connection
        .query_row(
            "SELECT body, version FROM documents WHERE id = ?1",
            [DOCUMENT_ID],
            |row| {
                Ok(DocumentView {
                    id: DOCUMENT_ID,
                    body: row.get(0)?,
                    version: row.get(1)?,
                })
            },
        )
        .optional()
}

fn document_missing() -> AppError {
    AppError::problem_with_detail(
        StatusCode::NOT_FOUND,
        "The document does not exist",
        "documents row 1 is missing from the database",
    )
}

/// The document's new body. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
struct DocumentInput {
    /// 1 to 50 characters (UTF-16 code units), not blank.
    #[schema(value_type = String, required = true, min_length = 1, max_length = 50)]
    body: Option<String>,
}

impl RequestBody for DocumentInput {
    const FIELDS: &'static [&'static str] = &["body"];
}

impl DocumentInput {
    fn validate(self) -> Result<String, AppError> {
        let body = self.body.unwrap_or_default();
        // Length counted in UTF-16 code units, as the seed's .NET check counts it.
        if is_blank_or_longer_than(&body, MAX_BODY) {
            return Err(AppError::bad_request(format!(
                "body must be 1 to {MAX_BODY} characters and not blank"
            )));
        }
        Ok(body)
    }
}

/// What the guarded update found.
enum WriteOutcome {
    Written {
        version: i64,
    },
    /// No current version matches the client's `If-Match` (or it changed under the guard).
    PreconditionFailed {
        current: Option<i64>,
    },
}

/// A conditional write: only the version `If-Match` names (re-checked inside the transaction).
#[utoipa::path(put, path = "/documents/1", tag = "http",
    params(
        ("if-match" = String, Header, pattern = "^[ \\t]*(\\*|(W/)?\"[\\x21\\x23-\\x7E]*\"([ \\t]*,[ \\t]*(W/)?\"[\\x21\\x23-\\x7E]*\")*)[ \\t]*$", description = "The ETag from GET /documents/1, or `*` (missing: 428)"),
        ("x-lab-pause" = Option<String>, Header, description = "Exactly `true`, sent once, parks this writer at the armed probe until its release (a lab control); any other value, another letter case or a second header means no pause and is not an error, as in the seed"),
    ),
    request_body = DocumentInput,
    responses(
        (status = 200, description = "Written: the new version", body = DocumentView,
            headers(("etag" = String, description = "The new version's strong tag"))),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 412, description = "If-Match does not name the current version", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 428, description = "If-Match is missing", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, description = "The store is unavailable, or the server shut down while the writer was parked", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    ),
)]
async fn write_document(
    State(store): State<Store>,
    State(lab): State<HttpLab>,
    headers: HeaderMap,
    Json(input): Json<DocumentInput>,
) -> Result<Response, AppError> {
    let body = input.validate()?;
    let condition = etag::if_match(&headers)
        .map_err(|malformed| AppError::bad_request(malformed.to_string()))?
        .ok_or_else(|| {
            AppError::problem_with_detail(
                StatusCode::PRECONDITION_REQUIRED,
                "If-Match is required",
                "send If-Match with the ETag from GET /documents/1, or * for any version",
            )
        })?;
    if pause_requested(&headers) {
        // Parks before the transaction: the version is read only after the release.
        lab.probe.pause(&lab.shutdown).await?;
    }

    let stored = body.clone();
    let outcome = store
        .write(move |connection| guarded_update(connection, &condition, &stored))
        .await?;
    match outcome {
        WriteOutcome::Written { version } => Ok(DocumentView {
            id: DOCUMENT_ID,
            body,
            version,
        }
        .into_response_with_etag()),
        WriteOutcome::PreconditionFailed { current } => Err(precondition_failed(current)),
    }
}

/// Reads the current version, compares the client's tags with it (strong comparison) and
/// updates only that version, all in one transaction: a writer that waited cannot overwrite a
/// version it never saw.
fn guarded_update(
    connection: &Connection,
    condition: &IfMatchCondition,
    body: &str,
) -> Result<WriteOutcome, AppError> {
    let current: Option<i64> = connection
        .query_row(
            "SELECT version FROM documents WHERE id = ?1",
            [DOCUMENT_ID],
            |row| row.get(0),
        )
        .optional()?;
    let Some(current) = current else {
        return Ok(WriteOutcome::PreconditionFailed { current: None });
    };
    if !condition.passes(&version_etag(current)) {
        return Ok(WriteOutcome::PreconditionFailed {
            current: Some(current),
        });
    }
    let written: Option<i64> = connection
        .query_row(
            "UPDATE documents SET body = ?1, version = version + 1
             WHERE id = ?2 AND version = ?3 RETURNING version",
            params![body, DOCUMENT_ID, current],
            |row| row.get(0),
        )
        .optional()?;
    Ok(match written {
        Some(version) => WriteOutcome::Written { version },
        None => WriteOutcome::PreconditionFailed {
            current: Some(current),
        },
    })
}

fn precondition_failed(current: Option<i64>) -> AppError {
    let detail = match current {
        Some(version) => format!(
            "If-Match does not match the current version (ETag \"v{version}\"); GET the document again"
        ),
        None => "the document does not exist".to_owned(),
    };
    AppError::problem_with_detail(
        StatusCode::PRECONDITION_FAILED,
        "Precondition Failed",
        detail,
    )
}

/// `X-Lab-Pause: true` asks the probe to park this writer. As in the seed, which compares the
/// header's values with `"true"` ordinally, anything else means "do not pause" and is never an
/// error: another letter case (`TRUE`), another word, an empty value, or the header sent twice
/// (two values are not the one value `"true"`, even when both are `true`).
fn pause_requested(headers: &HeaderMap) -> bool {
    let mut values = headers.get_all("x-lab-pause").iter();
    matches!(
        (values.next(), values.next()),
        (Some(value), None) if value.as_bytes() == b"true"
    )
}

// ---------------------------------------------------------------------------------------------
// Versioned representations
// ---------------------------------------------------------------------------------------------

// Structs rather than `json!` so the properties keep the seed's order.

#[derive(Serialize, ToSchema)]
struct ItemV1 {
    id: i64,
    name: &'static str,
}

#[derive(Serialize, ToSchema)]
struct ItemV1Extra {
    id: i64,
    name: &'static str,
    state: &'static str,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct ItemV2 {
    id: i64,
    display_name: &'static str,
    state: &'static str,
}

#[utoipa::path(get, path = "/api/v1/item", tag = "http", responses(
    (status = 200, description = "Version 1 of the item", body = ItemV1),
))]
async fn item_v1() -> extract::Json<ItemV1> {
    extract::Json(ItemV1 {
        id: 1,
        name: "rune",
    })
}

/// v1 plus a property: an additive change old clients can ignore.
#[utoipa::path(get, path = "/api/v1/item-extra", tag = "http", responses(
    (status = 200, description = "Version 1 plus a property", body = ItemV1Extra),
))]
async fn item_v1_extra() -> extract::Json<ItemV1Extra> {
    extract::Json(ItemV1Extra {
        id: 1,
        name: "rune",
        state: "active",
    })
}

/// A renamed property is a breaking change, so it lives under v2.
#[utoipa::path(get, path = "/api/v2/item", tag = "http", responses(
    (status = 200, description = "Version 2: `name` renamed to `displayName`", body = ItemV2),
))]
async fn item_v2() -> extract::Json<ItemV2> {
    extract::Json(ItemV2 {
        id: 1,
        display_name: "rune",
        state: "active",
    })
}

// ---------------------------------------------------------------------------------------------
// The NDJSON stream
// ---------------------------------------------------------------------------------------------

/// How `GET /stream` ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamEnding {
    /// Both items, then `{"type":"complete","count":2}`.
    Complete,
    /// Item 1, then an in-band error line, and no completion.
    ControlledFailure,
    /// Item 1, then the connection is cut: no completion and no clean end of the body.
    AbortAfterFirst,
}

/// One step of the stream: a line to send, or the abort.
#[derive(Debug, PartialEq, Eq)]
enum StreamStep {
    Line(String),
    Abort,
}

const NDJSON: &str = "application/x-ndjson";

/// Reads `abortAfter` (only 1 is defined) and `fail` (a boolean). Names bind case-insensitively,
/// as ASP.NET's query binding does; other parameters are ignored.
fn stream_ending(query: &[(String, String)]) -> Result<StreamEnding, AppError> {
    // Both parameters are checked before either decides: a bad one is a 400 whatever the other.
    let abort_after_first = match single_query_value(query, "abortAfter")? {
        None => false,
        Some(text) => match text.trim().parse::<i32>() {
            Ok(1) => true,
            Ok(_) => return Err(AppError::bad_request("abortAfter may only be 1")),
            Err(_) => return Err(AppError::bad_request("abortAfter must be an integer (1)")),
        },
    };
    let fail = match single_query_value(query, "fail")?.map(str::trim) {
        None => false,
        Some(text) if text.eq_ignore_ascii_case("true") => true,
        Some(text) if text.eq_ignore_ascii_case("false") => false,
        Some(_) => return Err(AppError::bad_request("fail must be true or false")),
    };
    // As in the seed, the abort comes right after item 1, before a failure line could be sent.
    Ok(if abort_after_first {
        StreamEnding::AbortAfterFirst
    } else if fail {
        StreamEnding::ControlledFailure
    } else {
        StreamEnding::Complete
    })
}

fn item_line(id: i64) -> String {
    format!("{{\"type\":\"item\",\"id\":{id}}}\n")
}

fn stream_steps(ending: StreamEnding) -> Vec<StreamStep> {
    let mut steps = vec![StreamStep::Line(item_line(1))];
    match ending {
        StreamEnding::AbortAfterFirst => steps.push(StreamStep::Abort),
        StreamEnding::ControlledFailure => steps.push(StreamStep::Line(
            "{\"type\":\"error\",\"code\":\"controlled-failure\"}\n".to_owned(),
        )),
        StreamEnding::Complete => {
            steps.push(StreamStep::Line(item_line(2)));
            steps.push(StreamStep::Line(
                "{\"type\":\"complete\",\"count\":2}\n".to_owned(),
            ));
        }
    }
    steps
}

/// Two items and a completion line, one JSON object per line; or a failure reported in-band; or
/// the connection cut after the first item (a lab control).
#[utoipa::path(get, path = "/stream", tag = "http",
    params(
        ("abortAfter" = Option<i32>, Query, minimum = 1, maximum = 1, description = "1: cut the connection after item 1 (no completion, no clean end)"),
        ("fail" = Option<bool>, Query, description = "true: item 1, then an in-band error line instead of item 2"),
    ),
    responses(
        (status = 200, description = "Newline-delimited JSON: `{\"type\":\"item\",…}` lines, then `complete` or `error`", body = String, content_type = "application/x-ndjson"),
        (status = 400, response = crate::http::openapi::BadRequest),
    ),
)]
async fn ndjson_stream(Query(query): Query<Vec<(String, String)>>) -> Result<Response, AppError> {
    let ending = stream_ending(&query)?;
    let body = stream::iter(stream_steps(ending)).then(|step| async move {
        // One turn of the runtime before each step: hyper flushes what it has buffered when the
        // body is not ready, so every line reaches the socket on its own, and the line before an
        // abort is already sent when the error below tears the connection down.
        tokio::task::yield_now().await;
        match step {
            StreamStep::Line(line) => Ok(Bytes::from(line)),
            // A body error makes hyper drop the connection without the chunked encoding's final
            // chunk: the client sees a truncated body, not a clean end.
            StreamStep::Abort => Err(std::io::Error::other("stream aborted after item 1")),
        }
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(NDJSON))],
        Body::from_stream(body),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn stream_parameters_choose_the_ending() {
        assert_eq!(stream_ending(&query(&[])).unwrap(), StreamEnding::Complete);
        assert_eq!(
            stream_ending(&query(&[("fail", "true")])).unwrap(),
            StreamEnding::ControlledFailure
        );
        assert_eq!(
            stream_ending(&query(&[("Fail", "False")])).unwrap(),
            StreamEnding::Complete
        );
        assert_eq!(
            stream_ending(&query(&[("abortafter", "1"), ("fail", "true")])).unwrap(),
            StreamEnding::AbortAfterFirst
        );
        assert_eq!(
            stream_ending(&query(&[("other", "x")])).unwrap(),
            StreamEnding::Complete
        );
    }

    #[test]
    fn bad_stream_parameters_are_bad_requests() {
        for pairs in [
            &[("abortAfter", "2")][..],
            &[("abortAfter", "0")],
            &[("abortAfter", "one")],
            &[("abortAfter", "")],
            &[("abortAfter", "1"), ("abortAfter", "1")],
            &[("fail", "yes")],
            &[("fail", "")],
            &[("abortAfter", "1"), ("fail", "yes")],
        ] {
            assert!(
                matches!(stream_ending(&query(pairs)), Err(AppError::BadRequest(_))),
                "{pairs:?}"
            );
        }
    }

    #[test]
    fn the_abort_follows_the_first_item_only() {
        assert_eq!(
            stream_steps(StreamEnding::AbortAfterFirst),
            [
                StreamStep::Line("{\"type\":\"item\",\"id\":1}\n".to_owned()),
                StreamStep::Abort
            ]
        );
    }

    #[test]
    fn only_one_exact_true_asks_for_a_pause_and_nothing_else_is_an_error() {
        let mut headers = HeaderMap::new();
        assert!(!pause_requested(&headers));
        headers.insert("x-lab-pause", HeaderValue::from_static("true"));
        assert!(pause_requested(&headers));
        for other in ["false", "soon", "", "TRUE", "True", "FALSE", "true, true"] {
            headers.insert("x-lab-pause", HeaderValue::from_static(other));
            assert!(!pause_requested(&headers), "{other:?}");
        }
        headers.insert("x-lab-pause", HeaderValue::from_static("true"));
        headers.append("x-lab-pause", HeaderValue::from_static("true"));
        assert!(!pause_requested(&headers), "two headers");
    }

    #[tokio::test]
    async fn an_unarmed_probe_never_parks_and_leaves_no_evidence() {
        let probe = ConditionProbe::default();
        probe.pause(&CancellationToken::new()).await.unwrap();
        assert!(!probe.entered());
    }

    /// An armed probe with one writer parked at it (the writer runs as its own task).
    async fn park_one_writer() -> (
        Arc<ConditionProbe>,
        tokio::task::JoinHandle<Result<(), AppError>>,
    ) {
        let probe = Arc::new(ConditionProbe::default());
        probe.arm();
        let parked = {
            let probe = probe.clone();
            tokio::spawn(async move { probe.pause(&CancellationToken::new()).await })
        };
        while probe.parked.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        (probe, parked)
    }

    #[tokio::test]
    async fn a_dropped_parked_writer_is_no_longer_counted() {
        let (probe, parked) = park_one_writer().await;
        assert!(probe.entered());
        parked.abort();
        assert!(parked.await.unwrap_err().is_cancelled());
        assert_eq!(probe.parked.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn rearming_a_closed_gate_keeps_its_parked_writers() {
        let (probe, parked) = park_one_writer().await;
        probe.arm();
        assert!(!probe.entered());
        probe.release();
        parked.await.unwrap().unwrap();
        // Released: later writers pass at once until the next arm.
        probe.pause(&CancellationToken::new()).await.unwrap();
    }

    #[tokio::test]
    async fn shutdown_lets_a_parked_writer_go_without_writing() {
        let probe = ConditionProbe::default();
        probe.arm();
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let error = probe.pause(&shutdown).await.unwrap_err();
        assert!(matches!(
            error,
            AppError::Problem { status, .. } if status == StatusCode::SERVICE_UNAVAILABLE
        ));
    }
}
