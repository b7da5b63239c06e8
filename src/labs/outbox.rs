//! The general outbox: outgoing events for any aggregate, handed to relays under leases fenced by
//! a generation, and acknowledged per event. The classroom's `/outbox/orders`, `/outbox/claim` and
//! `/outbox/ack` ([`super::messaging`]) stay as they are; this door has its own table,
//! `general_outbox` (labs schema version 3).
//!
//! - `POST /outbox/events` records an event (`eventKey` unique: the same key with the same content
//!   is a 200 replay, with other content a 409; one event per aggregate and sequence). In a real
//!   service this row is written in the transaction of the business change; the route stands for
//!   that transaction.
//! - `POST /outbox/leases` leases up to `max` pending events to `owner` for `leaseMs`, in
//!   (aggregateId, sequence) order, each with its generation (the attempt count): see
//!   [`plan_lease`] for which events are eligible.
//! - `POST /outbox/leases/ack` marks events sent, each `acked` or `fenced` ([`ack_verdict`]), all
//!   in one transaction.
//! - `POST /outbox/leases/resend` takes one aggregate's events again from a sequence on, sent
//!   ones included, for a relay answering a consumer's gap notice ([`resend`]).
//! - `GET /outbox/events?status=pending|sent&after=&limit=` lists them with the counts.
//!
//! Every lease and ack runs as one closure on the store's single writer: two concurrent lease
//! calls are serialised, so no event is ever handed to two owners at once, and lock contention
//! cannot arise between them (no 5xx from `SQLITE_BUSY`).

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::Response;
use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::http::error::{AppError, Json, Query, RequestBody, json_response};
use crate::inbox::input::{validate_aggregate_id, validate_message_id, validate_sequence};
use crate::inbox::pages::{page_body, page_request};
use crate::store::Store;
use crate::telemetry::metrics::Metrics;

pub mod resend;

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
    Metrics: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(record_outbox_event, list_outbox_events))
        .routes(routes!(lease_outbox_events))
        .routes(routes!(ack_outbox_leases))
        .routes(routes!(resend::resend_outbox_events))
}

/// The most events one lease or one ack may carry.
pub const MAX_BATCH: i64 = 1000;
/// The shortest and longest lease a relay may ask for.
pub const MIN_LEASE_MS: i64 = 100;
pub const MAX_LEASE_MS: i64 = 600_000;
const MAX_OWNER: usize = 64;

/// Milliseconds since the Unix epoch, the unit of `general_outbox.lease_until`.
fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// The decisions, without a database

/// A pending event as the lease sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRow {
    pub id: i64,
    pub aggregate_id: String,
    pub sequence: i64,
    /// When the current lease ends (ms since the epoch); `None` if never leased.
    pub lease_until: Option<i64>,
}

/// Which of `pending` (every pending event, in (aggregateId, sequence) order) a lease at `now`
/// hands out, at most `max`, in that order.
///
/// Per aggregate, the events are taken from its lowest pending sequence up to the first one that
/// is under a live lease (anyone's, the caller's included): a later sequence is never handed out
/// while an earlier one of its aggregate is pending and leased, so two relays never publish one
/// aggregate's events side by side. Earlier events taken in this same lease do not block their
/// successors: the caller publishes them in order.
pub fn plan_lease<'a>(
    pending: impl IntoIterator<Item = &'a PendingRow>,
    now: i64,
    max: usize,
) -> Vec<i64> {
    let mut planner = LeasePlanner::new(now, max);
    for row in pending {
        if planner.offer(row) == NextRow::Done {
            break;
        }
    }
    planner.chosen
}

/// What [`LeasePlanner::offer`] needs to see next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextRow {
    /// The next pending row in (aggregateId, sequence) order.
    Following,
    /// The first pending row of the next aggregate: the rest of this one is blocked, so a reader
    /// with an index seeks past it rather than reading its rows.
    NextAggregate,
    /// Nothing: `max` are chosen.
    Done,
}

/// [`plan_lease`] one row at a time, so that the store reads only the rows the plan looks at:
/// each aggregate's rows up to the first under a live lease, and no further once `max` are chosen.
pub struct LeasePlanner {
    now: i64,
    max: usize,
    blocked: Option<String>,
    pub chosen: Vec<i64>,
}

impl LeasePlanner {
    pub fn new(now: i64, max: usize) -> LeasePlanner {
        LeasePlanner {
            now,
            max,
            blocked: None,
            chosen: Vec::new(),
        }
    }

    /// Considers the next pending row (in (aggregateId, sequence) order) and says which row it
    /// needs after it.
    pub fn offer(&mut self, row: &PendingRow) -> NextRow {
        if self.chosen.len() >= self.max {
            return NextRow::Done;
        }
        if self.blocked.as_deref() == Some(row.aggregate_id.as_str()) {
            return NextRow::NextAggregate;
        }
        if row.lease_until.is_some_and(|until| until > self.now) {
            self.blocked = Some(row.aggregate_id.clone());
            return NextRow::NextAggregate;
        }
        self.blocked = None;
        self.chosen.push(row.id);
        if self.chosen.len() < self.max {
            NextRow::Following
        } else {
            NextRow::Done
        }
    }
}

/// What one event of an ack comes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AckVerdict {
    /// Marked sent now, or already sent by this owner at this generation (a repeated ack).
    Acked,
    /// Not this lease's to acknowledge: the lease expired, or another lease (a newer generation)
    /// took the event, or it was sent under another lease. Nothing changed.
    Fenced,
    /// No event has this id.
    Unknown,
}

/// The row an ack is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    pub sent: bool,
    pub owner: Option<String>,
    pub generation: i64,
    pub lease_until: Option<i64>,
}

/// The verdict on `owner` acknowledging an event at `generation` at `now`: acked only for the
/// holder of the current lease (same owner, same generation) while it lasts. An expired lease is
/// fenced even if nobody re-leased the event yet: the relay cannot know that, and the event is
/// simply published again under the next lease (the broker's de-duplication and the inbox's
/// identity check absorb the copy). A repeat of an ack that succeeded answers acked again, so a
/// relay whose ack response was lost may retry it.
pub fn ack_verdict(row: Option<&LeaseRow>, owner: &str, generation: i64, now: i64) -> AckVerdict {
    let Some(row) = row else {
        return AckVerdict::Unknown;
    };
    let holder = row.owner.as_deref() == Some(owner) && row.generation == generation;
    if !holder {
        return AckVerdict::Fenced;
    }
    if row.sent || row.lease_until.is_some_and(|until| until > now) {
        AckVerdict::Acked
    } else {
        AckVerdict::Fenced
    }
}

// ---------------------------------------------------------------------------------------------
// POST /outbox/events

/// An outgoing event. Names bind case-insensitively; a member given twice is a 400.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct EventInput {
    /// 1 to 100 characters, not blank, no control characters: the message id the relay publishes
    /// (`Nats-Msg-Id`) and the inbox checks; unique in the outbox.
    #[schema(min_length = 1, max_length = 100)]
    event_key: String,
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    aggregate_id: String,
    #[schema(minimum = 1, maximum = 9007199254740992_i64)]
    sequence: i64,
    amount: i32,
}

impl RequestBody for EventInput {
    const FIELDS: &'static [&'static str] = &["eventKey", "aggregateId", "sequence", "amount"];
}

impl EventInput {
    fn validate(self) -> Result<EventInput, AppError> {
        validate_message_id("eventKey", &self.event_key)?;
        validate_aggregate_id("aggregateId", &self.aggregate_id)?;
        validate_sequence("sequence", self.sequence, 1)?;
        Ok(self)
    }
}

/// An event as the outbox holds it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutboxEvent {
    pub id: i64,
    pub event_key: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub amount: i64,
    /// `pending` or `sent`.
    pub status: String,
    /// The relay of the current (or last) lease.
    pub owner: Option<String>,
    /// Leases so far: the fencing token of the current one.
    pub generation: i64,
    pub lease_until_ms: Option<i64>,
    pub created_at_ms: i64,
    pub sent_at_ms: Option<i64>,
}

const EVENT_COLUMNS: &str = "id, event_key, aggregate_id, sequence, amount, status, owner, \
     generation, lease_until, created_at_ms, sent_at_ms";

fn event_of(row: &rusqlite::Row<'_>) -> rusqlite::Result<OutboxEvent> {
    Ok(OutboxEvent {
        id: row.get(0)?,
        event_key: row.get(1)?,
        aggregate_id: row.get(2)?,
        sequence: row.get(3)?,
        amount: row.get(4)?,
        status: row.get(5)?,
        owner: row.get(6)?,
        generation: row.get(7)?,
        lease_until_ms: row.get(8)?,
        created_at_ms: row.get(9)?,
        sent_at_ms: row.get(10)?,
    })
}

/// The recorded event, and whether it was recorded before (`replay`).
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct Recorded {
    replay: bool,
    event: OutboxEvent,
}

enum RecordOutcome {
    Created(OutboxEvent),
    Replay(OutboxEvent),
    KeyConflict(OutboxEvent),
    SequenceTaken(OutboxEvent),
}

#[utoipa::path(post, path = "/outbox/events", tag = "outbox", request_body = EventInput,
    responses(
        (status = 201, description = "Recorded, pending (`replay: false`)", body = Recorded),
        (status = 200, description = "This key was recorded before with the same content (`replay: true`)", body = Recorded),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 409, description = "The key was recorded with other content, or the aggregate's sequence belongs to another key: nothing changed", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn record_outbox_event(
    State(store): State<Store>,
    Json(input): Json<EventInput>,
) -> Result<Response, AppError> {
    let input = input.validate()?;
    let outcome = store
        .write(move |connection| record_event(connection, &input))
        .await?;
    Ok(outcome.answer())
}

/// Records a new event as pending. An event key already recorded is a replay with the same
/// content and a conflict with other content; an aggregate's sequence already recorded under
/// another key is a conflict too. Nothing is written then.
fn record_event(
    connection: &rusqlite::Connection,
    input: &EventInput,
) -> Result<RecordOutcome, AppError> {
    let prior = connection
        .query_row(
            &format!("SELECT {EVENT_COLUMNS} FROM general_outbox WHERE event_key = ?1"),
            [&input.event_key],
            event_of,
        )
        .optional()?;
    if let Some(prior) = prior {
        let same = prior.aggregate_id == input.aggregate_id
            && prior.sequence == input.sequence
            && prior.amount == i64::from(input.amount);
        return Ok(if same {
            RecordOutcome::Replay(prior)
        } else {
            RecordOutcome::KeyConflict(prior)
        });
    }
    let taken = connection
        .query_row(
            &format!(
                "SELECT {EVENT_COLUMNS} FROM general_outbox
                  WHERE aggregate_id = ?1 AND sequence = ?2"
            ),
            params![input.aggregate_id, input.sequence],
            event_of,
        )
        .optional()?;
    if let Some(taken) = taken {
        return Ok(RecordOutcome::SequenceTaken(taken));
    }
    let event = connection.query_row(
        &format!(
            "INSERT INTO general_outbox(event_key, aggregate_id, sequence, amount, created_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5) RETURNING {EVENT_COLUMNS}"
        ),
        params![
            input.event_key,
            input.aggregate_id,
            input.sequence,
            input.amount,
            now_millis()
        ],
        event_of,
    )?;
    Ok(RecordOutcome::Created(event))
}

impl RecordOutcome {
    /// 201 for a new event, 200 for a replay, 409 problem+json for either conflict.
    fn answer(self) -> Response {
        match self {
            RecordOutcome::Created(event) => json_response(
                StatusCode::CREATED,
                json!({"replay": false, "event": event}),
            ),
            RecordOutcome::Replay(event) => {
                json_response(StatusCode::OK, json!({"replay": true, "event": event}))
            }
            RecordOutcome::KeyConflict(prior) => crate::http::error::problem_response(
                StatusCode::CONFLICT,
                "Event key conflict",
                Some(&format!(
                    "eventKey '{}' was recorded with other content (aggregate '{}', sequence {}, amount {}); an event key never changes meaning",
                    prior.event_key, prior.aggregate_id, prior.sequence, prior.amount
                )),
            ),
            RecordOutcome::SequenceTaken(prior) => crate::http::error::problem_response(
                StatusCode::CONFLICT,
                "Sequence already recorded",
                Some(&format!(
                    "aggregate '{}' already has sequence {} as eventKey '{}'",
                    prior.aggregate_id, prior.sequence, prior.event_key
                )),
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GET /outbox/events

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    /// Only events in this status: `pending` or `sent` (default: both).
    #[param(pattern = "^(pending|sent)$")]
    status: Option<String>,
    /// The cursor: the `next` of the previous page.
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// Events by status.
#[derive(Debug, Serialize, ToSchema)]
pub struct OutboxCounts {
    pub pending: i64,
    pub sent: i64,
}

/// One page of events, oldest first, with the counts of the whole outbox.
#[derive(ToSchema)]
#[allow(dead_code)]
struct EventPage {
    counts: OutboxCounts,
    events: Vec<OutboxEvent>,
    /// The `after` of the following page; null at the end.
    #[schema(required = true)]
    next: Option<i64>,
}

#[utoipa::path(get, path = "/outbox/events", tag = "outbox", params(ListQuery), responses(
    (status = 200, description = "Events in the order they were recorded, and the counts by status", body = EventPage),
    (status = 400, response = crate::http::openapi::BadRequest),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn list_outbox_events(
    State(store): State<Store>,
    Query(query): Query<ListQuery>,
) -> Result<Response, AppError> {
    let status = match query.status.as_deref() {
        None => None,
        Some(status @ ("pending" | "sent")) => Some(status.to_owned()),
        Some(_) => return Err(AppError::bad_request("status must be 'pending' or 'sent'")),
    };
    let page = page_request(query.after, query.limit)?;
    let (counts, events) = store
        .read(move |connection| {
            let counts = connection.query_row(
                "SELECT COALESCE(SUM(status = 'pending'), 0), COALESCE(SUM(status = 'sent'), 0)
                   FROM general_outbox",
                [],
                |row| {
                    Ok(OutboxCounts {
                        pending: row.get(0)?,
                        sent: row.get(1)?,
                    })
                },
            )?;
            let mut statement = connection.prepare(&format!(
                "SELECT {EVENT_COLUMNS} FROM general_outbox
                  WHERE id > ?1 AND (?2 IS NULL OR status = ?2)
                  ORDER BY id LIMIT +?3"
            ))?;
            // One more than asked says whether a next page exists.
            let events = statement
                .query_map(params![page.after, status, page.limit + 1], event_of)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok::<_, AppError>((counts, events))
        })
        .await?;
    let mut events = events;
    let limit = usize::try_from(page.limit).unwrap_or(usize::MAX);
    let next = if events.len() > limit {
        events.truncate(limit);
        events.last().map(|event| event.id)
    } else {
        None
    };
    let page = ordered_inbox::views::Page {
        items: events,
        next,
    };
    Ok(json_response(
        StatusCode::OK,
        page_body(json!({"counts": counts}), "events", page),
    ))
}

// ---------------------------------------------------------------------------------------------
// POST /outbox/leases

/// A relay's claim. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct LeaseInput {
    /// The relay: 1 to 64 characters of A-Z, a-z, 0-9, '.', '_', '-' or '@'.
    #[schema(pattern = "^[A-Za-z0-9._@-]{1,64}$")]
    owner: String,
    /// At most this many events (1 to 1000).
    #[schema(minimum = 1, maximum = 1000)]
    max: i64,
    /// How long the lease lasts, 100 to 600000 ms.
    #[schema(minimum = 100, maximum = 600000)]
    lease_ms: i64,
}

impl RequestBody for LeaseInput {
    const FIELDS: &'static [&'static str] = &["owner", "max", "leaseMs"];
}

fn validate_owner(owner: &str) -> Result<(), AppError> {
    let valid = !owner.is_empty()
        && owner.len() <= MAX_OWNER
        && owner
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'));
    if valid {
        Ok(())
    } else {
        Err(AppError::bad_request(format!(
            "owner must be 1 to {MAX_OWNER} characters of A-Z, a-z, 0-9, '.', '_', '-' or '@'"
        )))
    }
}

/// One leased event: publish it, then acknowledge it with this generation.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeasedEvent {
    pub id: i64,
    pub event_key: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub amount: i64,
    /// The lease's fencing token: the event's attempt count.
    pub generation: i64,
}

/// What a lease handed out, in (aggregateId, sequence) order.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Lease {
    owner: String,
    /// When these leases end (ms since the epoch); an ack after it is fenced.
    lease_until_ms: i64,
    events: Vec<LeasedEvent>,
}

/// The pending rows of aggregates after `?1`, in (aggregateId, sequence) order, from the partial
/// index `ix_general_outbox_pending_by_aggregate` alone (it holds `lease_until`; the id is the
/// rowid).
pub const PENDING_AFTER_AGGREGATE: &str =
    "SELECT id, aggregate_id, sequence, lease_until FROM general_outbox
      WHERE status = 'pending' AND aggregate_id > ?1 ORDER BY aggregate_id, sequence";

/// [`plan_lease`] over the pending rows, read through the index: the rows of an aggregate are
/// read only up to its first event under a live lease, and then the read seeks to the next
/// aggregate. A lease so costs an index seek per aggregate it skips and a step per event it
/// takes, however many events wait behind live leases. Aggregate ids are never empty, so the
/// first seek starts after ''.
fn plan_lease_in(
    connection: &rusqlite::Connection,
    now: i64,
    max: usize,
) -> rusqlite::Result<Vec<i64>> {
    let mut statement = connection.prepare_cached(PENDING_AFTER_AGGREGATE)?;
    let mut planner = LeasePlanner::new(now, max);
    let mut after = String::new();
    'seek: loop {
        let mut rows = statement.query([&after])?;
        while let Some(row) = rows.next()? {
            let pending = PendingRow {
                id: row.get(0)?,
                aggregate_id: row.get(1)?,
                sequence: row.get(2)?,
                lease_until: row.get(3)?,
            };
            match planner.offer(&pending) {
                NextRow::Following => {}
                NextRow::NextAggregate => {
                    after = pending.aggregate_id;
                    continue 'seek;
                }
                NextRow::Done => break 'seek,
            }
        }
        break;
    }
    Ok(planner.chosen)
}

#[utoipa::path(post, path = "/outbox/leases", tag = "outbox", request_body = LeaseInput,
    responses(
        (status = 200, description = "The leased events (possibly none), in (aggregateId, sequence) order, each with its generation", body = Lease),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn lease_outbox_events(
    State(store): State<Store>,
    State(metrics): State<Metrics>,
    Json(input): Json<LeaseInput>,
) -> Result<Response, AppError> {
    validate_owner(&input.owner)?;
    if !(1..=MAX_BATCH).contains(&input.max) {
        return Err(AppError::bad_request(format!(
            "max must be from 1 to {MAX_BATCH}"
        )));
    }
    if !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&input.lease_ms) {
        return Err(AppError::bad_request(format!(
            "leaseMs must be from {MIN_LEASE_MS} to {MAX_LEASE_MS}"
        )));
    }
    let owner = input.owner;
    let max = usize::try_from(input.max).unwrap_or(1);
    let lease_ms = input.lease_ms;
    let lease = store
        .write(move |connection| {
            // Read on the writer, inside its transaction: nothing can lease between this read and
            // the updates below.
            let now = now_millis();
            let until = now.saturating_add(lease_ms);
            let chosen = plan_lease_in(connection, now, max)?;
            let mut update = connection.prepare_cached(
                "UPDATE general_outbox
                    SET owner = ?1, lease_until = ?2, generation = generation + 1
                  WHERE id = ?3
              RETURNING id, event_key, aggregate_id, sequence, amount, generation",
            )?;
            let mut events = Vec::with_capacity(chosen.len());
            for id in chosen {
                events.push(update.query_row(params![owner, until, id], |row| {
                    Ok(LeasedEvent {
                        id: row.get(0)?,
                        event_key: row.get(1)?,
                        aggregate_id: row.get(2)?,
                        sequence: row.get(3)?,
                        amount: row.get(4)?,
                        generation: row.get(5)?,
                    })
                })?);
            }
            Ok::<_, AppError>(Lease {
                owner: owner.clone(),
                lease_until_ms: until,
                events,
            })
        })
        .await?;
    metrics.outbox_leased(lease.events.len());
    Ok(json_response(StatusCode::OK, json!(lease)))
}

// ---------------------------------------------------------------------------------------------
// POST /outbox/leases/ack

/// One event of an ack: its id and the generation its lease answered. Names bind
/// case-insensitively here too, as at the top level.
#[derive(Debug, ToSchema)]
struct AckItem {
    id: i64,
    generation: i64,
}

impl<'de> Deserialize<'de> for AckItem {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        #[derive(Deserialize)]
        struct Exact {
            id: i64,
            generation: i64,
        }
        let object = serde_json::Map::<String, serde_json::Value>::deserialize(deserializer)?;
        let mut normalized = serde_json::Map::new();
        for (key, value) in object {
            let name = ["id", "generation"]
                .iter()
                .find(|field| field.eq_ignore_ascii_case(&key))
                .map_or(key, |field| (*field).to_owned());
            if normalized.insert(name.clone(), value).is_some() {
                return Err(D::Error::custom(format!(
                    "property '{name}' is given more than once"
                )));
            }
        }
        let exact: Exact = serde_json::from_value(serde_json::Value::Object(normalized))
            .map_err(D::Error::custom)?;
        Ok(AckItem {
            id: exact.id,
            generation: exact.generation,
        })
    }
}

/// A relay's acknowledgement of published events. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct AckInput {
    #[schema(pattern = "^[A-Za-z0-9._@-]{1,64}$")]
    owner: String,
    /// 1 to 1000 events, each at most once.
    #[schema(min_items = 1, max_items = 1000)]
    events: Vec<AckItem>,
}

impl RequestBody for AckInput {
    const FIELDS: &'static [&'static str] = &["owner", "events"];
}

/// The verdict on one event.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct AckResult {
    id: i64,
    generation: i64,
    verdict: AckVerdict,
}

/// Every event's verdict, in the request's order, and the tallies.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct AckAnswer {
    acked: usize,
    fenced: usize,
    unknown: usize,
    events: Vec<AckResult>,
}

#[utoipa::path(post, path = "/outbox/leases/ack", tag = "outbox", request_body = AckInput,
    responses(
        (status = 200, description = "Each event acked (now sent) or fenced (not this lease's: nothing changed), in one transaction", body = AckAnswer),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
async fn ack_outbox_leases(
    State(store): State<Store>,
    State(metrics): State<Metrics>,
    Json(input): Json<AckInput>,
) -> Result<Response, AppError> {
    validate_owner(&input.owner)?;
    let count = i64::try_from(input.events.len()).unwrap_or(i64::MAX);
    if !(1..=MAX_BATCH).contains(&count) {
        return Err(AppError::bad_request(format!(
            "events must hold 1 to {MAX_BATCH} events"
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(input.events.len());
    if let Some(repeated) = input.events.iter().find(|item| !seen.insert(item.id)) {
        return Err(AppError::bad_request(format!(
            "event {} is given more than once",
            repeated.id
        )));
    }
    let owner = input.owner;
    let items = input.events;
    let answer = store
        .write(move |connection| {
            let now = now_millis();
            let mut read = connection.prepare_cached(
                "SELECT status, owner, generation, lease_until FROM general_outbox WHERE id = ?1",
            )?;
            let mut mark = connection.prepare_cached(
                "UPDATE general_outbox SET status = 'sent', sent_at_ms = ?2, lease_until = NULL
                  WHERE id = ?1 AND status = 'pending'",
            )?;
            let mut answer = AckAnswer {
                acked: 0,
                fenced: 0,
                unknown: 0,
                events: Vec::with_capacity(items.len()),
            };
            for item in &items {
                let row = read
                    .query_row([item.id], |row| {
                        Ok(LeaseRow {
                            sent: row.get::<_, String>(0)? == "sent",
                            owner: row.get(1)?,
                            generation: row.get(2)?,
                            lease_until: row.get(3)?,
                        })
                    })
                    .optional()?;
                let verdict = ack_verdict(row.as_ref(), &owner, item.generation, now);
                match verdict {
                    AckVerdict::Acked => {
                        mark.execute(params![item.id, now])?;
                        answer.acked += 1;
                    }
                    AckVerdict::Fenced => answer.fenced += 1,
                    AckVerdict::Unknown => answer.unknown += 1,
                }
                answer.events.push(AckResult {
                    id: item.id,
                    generation: item.generation,
                    verdict,
                });
            }
            Ok::<_, AppError>(answer)
        })
        .await?;
    metrics.outbox_acks(answer.acked, answer.fenced, answer.unknown);
    Ok(json_response(StatusCode::OK, json!(answer)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, aggregate: &str, sequence: i64, lease_until: Option<i64>) -> PendingRow {
        PendingRow {
            id,
            aggregate_id: aggregate.to_owned(),
            sequence,
            lease_until,
        }
    }

    #[test]
    fn a_lease_takes_each_aggregate_in_sequence_order_up_to_max() {
        let pending = [
            row(1, "a", 1, None),
            row(2, "a", 2, None),
            row(3, "b", 1, None),
            row(4, "b", 2, None),
        ];
        assert_eq!(plan_lease(&pending, 1000, 10), vec![1, 2, 3, 4]);
        assert_eq!(plan_lease(&pending, 1000, 3), vec![1, 2, 3]);
    }

    #[test]
    fn a_live_lease_blocks_the_later_sequences_of_its_aggregate_only() {
        let pending = [
            row(1, "a", 1, Some(2000)),
            row(2, "a", 2, None),
            row(3, "a", 3, None),
            row(4, "b", 1, None),
        ];
        assert_eq!(plan_lease(&pending, 1000, 10), vec![4]);
    }

    #[test]
    fn an_expired_lease_is_taken_again_with_its_successors() {
        let pending = [row(1, "a", 1, Some(999)), row(2, "a", 2, None)];
        assert_eq!(plan_lease(&pending, 1000, 10), vec![1, 2]);
        // A lease ending exactly now has ended.
        let pending = [row(1, "a", 1, Some(1000))];
        assert_eq!(plan_lease(&pending, 1000, 10), vec![1]);
    }

    #[test]
    fn a_live_lease_in_the_middle_stops_its_aggregate_there() {
        // 1 was sent (absent), 2 expired, 3 is leased (by a relay that took 3 after 2 was
        // re-leased and expired again), 4 waits behind it.
        let pending = [
            row(2, "a", 2, Some(10)),
            row(3, "a", 3, Some(5000)),
            row(4, "a", 4, None),
        ];
        assert_eq!(plan_lease(&pending, 1000, 10), vec![2]);
    }

    #[test]
    fn the_planner_asks_for_the_next_aggregate_once_one_is_blocked() {
        let mut planner = LeasePlanner::new(1000, 2);
        assert_eq!(
            planner.offer(&row(1, "a", 1, Some(2000))),
            NextRow::NextAggregate
        );
        assert_eq!(planner.offer(&row(3, "b", 1, None)), NextRow::Following);
        assert_eq!(planner.offer(&row(4, "b", 2, Some(999))), NextRow::Done);
        assert_eq!(planner.chosen, vec![3, 4]);
    }

    /// A database at the labs' current schema, in memory.
    fn labs_database() -> rusqlite::Connection {
        let mut connection = rusqlite::Connection::open_in_memory().expect("in-memory database");
        crate::store::schema::migrate(&mut connection).expect("migrate");
        connection
    }

    fn insert_event(
        connection: &rusqlite::Connection,
        aggregate: &str,
        sequence: i64,
        lease_until: Option<i64>,
    ) {
        connection
            .execute(
                "INSERT INTO general_outbox(event_key, aggregate_id, sequence, amount, lease_until,
                                            created_at_ms)
                 VALUES (?1, ?2, ?3, 1, ?4, 0)",
                params![
                    format!("{aggregate}-{sequence}"),
                    aggregate,
                    sequence,
                    lease_until
                ],
            )
            .expect("insert an event");
    }

    #[test]
    fn the_lease_reads_pending_rows_from_the_partial_index_without_scanning_or_sorting() {
        let connection = labs_database();
        let details: Vec<String> = connection
            .prepare(&format!("EXPLAIN QUERY PLAN {PENDING_AFTER_AGGREGATE}"))
            .expect("explain")
            .query_map(["a"], |row| row.get(3))
            .expect("the plan")
            .collect::<rusqlite::Result<_>>()
            .expect("plan lines");
        assert_eq!(
            details,
            ["SEARCH general_outbox USING COVERING INDEX \
              ix_general_outbox_pending_by_aggregate (aggregate_id>?)"],
            "one index seek, no SCAN of the table and no sort"
        );
    }

    /// Ten aggregates whose first event is under a live lease with `behind` events waiting after
    /// it, between and after them five free aggregates of three events; the lease's plan, and how
    /// many steps its statement ran.
    fn lease_behind_blocked(behind: i64) -> (Vec<i64>, i32) {
        let connection = labs_database();
        for aggregate in 0..10 {
            let name = format!("b{aggregate}");
            insert_event(&connection, &name, 1, Some(5000));
            for sequence in 2..=behind + 1 {
                insert_event(&connection, &name, sequence, None);
            }
            if aggregate % 2 == 0 {
                for sequence in 1..=3 {
                    insert_event(&connection, &format!("b{aggregate}f"), sequence, None);
                }
            }
        }
        let chosen = plan_lease_in(&connection, 1000, 1000).expect("plan");
        let statement = connection
            .prepare_cached(PENDING_AFTER_AGGREGATE)
            .expect("the cached statement");
        (
            chosen,
            statement.get_status(rusqlite::StatementStatus::VmStep),
        )
    }

    #[test]
    fn a_leases_reads_do_not_grow_with_the_events_blocked_behind_live_leases() {
        let (few_chosen, few_steps) = lease_behind_blocked(1);
        let (many_chosen, many_steps) = lease_behind_blocked(2000);
        assert_eq!(few_chosen.len(), 15, "the free aggregates' events");
        assert_eq!(
            many_chosen.len(),
            15,
            "the same events with more blocked rows"
        );
        assert_eq!(
            few_steps, many_steps,
            "2000 blocked rows per aggregate cost no more steps than 1"
        );
    }

    #[test]
    fn the_lease_through_the_index_chooses_what_the_plan_over_every_pending_row_chooses() {
        let connection = labs_database();
        let now = 1000;
        // Live, expired, never leased and a live lease in the middle, over a few aggregates.
        let leases = [None, Some(now + 1), Some(now - 1), Some(now), None, None];
        for aggregate in 0..6 {
            for sequence in 1..=4 {
                let lease = leases[(aggregate * 4 + sequence as usize) % leases.len()];
                insert_event(&connection, &format!("a{aggregate}"), sequence, lease);
            }
        }
        connection
            .execute(
                "UPDATE general_outbox SET status = 'sent' WHERE sequence = 1 AND aggregate_id = 'a3'",
                [],
            )
            .expect("send one");
        let every_pending: Vec<PendingRow> = connection
            .prepare(
                "SELECT id, aggregate_id, sequence, lease_until FROM general_outbox
                  WHERE status = 'pending' ORDER BY aggregate_id, sequence",
            )
            .expect("prepare")
            .query_map([], |r| {
                Ok(row(
                    r.get(0)?,
                    &r.get::<_, String>(1)?,
                    r.get(2)?,
                    r.get(3)?,
                ))
            })
            .expect("query")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        for max in [1, 3, 7, 100] {
            assert_eq!(
                plan_lease_in(&connection, now, max).expect("plan"),
                plan_lease(&every_pending, now, max),
                "max {max}"
            );
        }
    }

    fn lease(sent: bool, owner: &str, generation: i64, until: Option<i64>) -> LeaseRow {
        LeaseRow {
            sent,
            owner: Some(owner.to_owned()),
            generation,
            lease_until: until,
        }
    }

    #[test]
    fn only_the_live_lease_of_this_owner_and_generation_acks() {
        let live = lease(false, "one", 2, Some(2000));
        assert_eq!(ack_verdict(Some(&live), "one", 2, 1000), AckVerdict::Acked);
        assert_eq!(ack_verdict(Some(&live), "two", 2, 1000), AckVerdict::Fenced);
        assert_eq!(ack_verdict(Some(&live), "one", 1, 1000), AckVerdict::Fenced);
        assert_eq!(ack_verdict(None, "one", 1, 1000), AckVerdict::Unknown);
    }

    #[test]
    fn an_expired_lease_is_fenced_even_before_anyone_re_leases() {
        let expired = lease(false, "one", 2, Some(1000));
        assert_eq!(
            ack_verdict(Some(&expired), "one", 2, 1000),
            AckVerdict::Fenced
        );
    }

    #[test]
    fn a_repeated_ack_of_a_sent_event_answers_acked_to_its_sender_only() {
        let sent = lease(true, "one", 3, None);
        assert_eq!(ack_verdict(Some(&sent), "one", 3, 5000), AckVerdict::Acked);
        assert_eq!(ack_verdict(Some(&sent), "one", 2, 5000), AckVerdict::Fenced);
        assert_eq!(ack_verdict(Some(&sent), "two", 3, 5000), AckVerdict::Fenced);
    }
}
