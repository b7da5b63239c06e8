//! `POST /outbox/leases/resend`: a relay answering a gap notice takes an aggregate's events
//! again, sent ones included, from the sequence the consumer is missing, under a lease of its
//! own. The events go back to `pending` under that lease with a new generation, so the ordinary
//! ack marks them sent again, a late ack of the first lease is fenced, and an ordinary lease waits
//! behind them (a later sequence is never handed out while an earlier one is leased).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use rusqlite::params;
use serde::Deserialize;
use serde_json::json;
use utoipa::ToSchema;

use super::{
    Lease, LeasedEvent, MAX_BATCH, MAX_LEASE_MS, MIN_LEASE_MS, now_millis, validate_owner,
};
use crate::http::error::{AppError, Json, RequestBody, json_response};
use crate::inbox::input::{validate_aggregate_id, validate_sequence};
use crate::store::Store;
use crate::telemetry::metrics::Metrics;

/// A relay's claim on one aggregate's events from a sequence on. Names bind case-insensitively.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct ResendInput {
    /// The relay: 1 to 64 characters of A-Z, a-z, 0-9, '.', '_', '-' or '@'.
    #[schema(pattern = "^[A-Za-z0-9._@-]{1,64}$")]
    owner: String,
    /// The aggregate whose events are taken again.
    aggregate_id: String,
    /// The first sequence to take: the one the consumer is missing (1 to 2^53).
    #[schema(minimum = 1)]
    from_sequence: i64,
    /// At most this many events (1 to 1000).
    #[schema(minimum = 1, maximum = 1000)]
    max: i64,
    /// How long the lease lasts, 100 to 600000 ms.
    #[schema(minimum = 100, maximum = 600000)]
    lease_ms: i64,
}

impl RequestBody for ResendInput {
    const FIELDS: &'static [&'static str] =
        &["owner", "aggregateId", "fromSequence", "max", "leaseMs"];
}

/// One of an aggregate's events, as a resend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResendRow {
    pub id: i64,
    pub sequence: i64,
    /// When a pending event's current lease ends; `None` for a sent event or one never leased.
    pub lease_until: Option<i64>,
}

/// Which of `rows` (one aggregate's events from `from` on, in sequence order) a resend at `now`
/// takes, at most `max`: the unbroken run `from`, `from + 1`, … up to the first event under a
/// live lease (that one is on its way already, and its successors must follow it) or the first
/// sequence the outbox does not have. Nothing when the outbox has no event `from`: re-publishing
/// its successors cannot fill the consumer's gap.
pub fn plan_resend(rows: &[ResendRow], from: i64, now: i64, max: usize) -> Vec<i64> {
    rows.iter()
        .zip(from..)
        .take_while(|(row, wanted)| {
            row.sequence == *wanted && row.lease_until.is_none_or(|until| until <= now)
        })
        .take(max)
        .map(|(row, _)| row.id)
        .collect()
}

#[utoipa::path(post, path = "/outbox/leases/resend", tag = "outbox", request_body = ResendInput,
    responses(
        (status = 200, description = "The aggregate's events taken again from fromSequence (possibly none), in sequence order, each with its new generation; they are pending under this lease until acked", body = Lease),
        (status = 400, response = crate::http::openapi::BadRequest),
        (status = 500, response = crate::http::openapi::StoreFailed),
        (status = 503, response = crate::http::openapi::StoreUnavailable),
    ),
)]
pub(super) async fn resend_outbox_events(
    State(store): State<Store>,
    State(metrics): State<Metrics>,
    Json(input): Json<ResendInput>,
) -> Result<Response, AppError> {
    validate_owner(&input.owner)?;
    validate_aggregate_id("aggregateId", &input.aggregate_id)?;
    validate_sequence("fromSequence", input.from_sequence, 1)?;
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
    let max = usize::try_from(input.max).unwrap_or(1);
    let lease = store
        .write(move |connection| {
            // On the writer, inside its transaction: no lease can come between this read and the
            // updates.
            let now = now_millis();
            let until = now.saturating_add(input.lease_ms);
            let rows = aggregate_rows(connection, &input.aggregate_id, input.from_sequence, max)?;
            let chosen = plan_resend(&rows, input.from_sequence, now, max);
            let events = take_again(connection, &input.owner, until, &chosen)?;
            Ok::<_, AppError>(Lease {
                owner: input.owner.clone(),
                lease_until_ms: until,
                events,
            })
        })
        .await?;
    metrics.outbox_leased(lease.events.len());
    Ok(json_response(StatusCode::OK, json!(lease)))
}

/// The aggregate's first `max` events from `from` on (the `UNIQUE(aggregate_id, sequence)` index),
/// with the live lease of the pending ones.
fn aggregate_rows(
    connection: &rusqlite::Connection,
    aggregate_id: &str,
    from: i64,
    max: usize,
) -> rusqlite::Result<Vec<ResendRow>> {
    let limit = i64::try_from(max).unwrap_or(MAX_BATCH);
    connection
        .prepare_cached(
            "SELECT id, sequence, CASE WHEN status = 'pending' THEN lease_until END
               FROM general_outbox
              WHERE aggregate_id = ?1 AND sequence >= ?2
              ORDER BY sequence LIMIT +?3",
        )?
        .query_map(params![aggregate_id, from, limit], |row| {
            Ok(ResendRow {
                id: row.get(0)?,
                sequence: row.get(1)?,
                lease_until: row.get(2)?,
            })
        })?
        .collect()
}

/// Puts each chosen event back to pending under `owner`'s lease with a new generation.
fn take_again(
    connection: &rusqlite::Connection,
    owner: &str,
    until: i64,
    chosen: &[i64],
) -> rusqlite::Result<Vec<LeasedEvent>> {
    let mut update = connection.prepare_cached(
        "UPDATE general_outbox
            SET status = 'pending', sent_at_ms = NULL, owner = ?1, lease_until = ?2,
                generation = generation + 1
          WHERE id = ?3
      RETURNING id, event_key, aggregate_id, sequence, amount, generation",
    )?;
    chosen
        .iter()
        .map(|id| {
            update.query_row(params![owner, until, id], |row| {
                Ok(LeasedEvent {
                    id: row.get(0)?,
                    event_key: row.get(1)?,
                    aggregate_id: row.get(2)?,
                    sequence: row.get(3)?,
                    amount: row.get(4)?,
                    generation: row.get(5)?,
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, sequence: i64, lease_until: Option<i64>) -> ResendRow {
        ResendRow {
            id,
            sequence,
            lease_until,
        }
    }

    #[test]
    fn a_resend_takes_the_unbroken_run_from_the_missing_sequence() {
        let rows = [row(12, 2, None), row(13, 3, None), row(14, 4, Some(50))];
        assert_eq!(plan_resend(&rows, 2, 100, 10), [12, 13, 14]);
        assert_eq!(plan_resend(&rows, 2, 100, 2), [12, 13]);
        let holed = [row(12, 2, None), row(14, 4, None)];
        assert_eq!(plan_resend(&holed, 2, 100, 10), [12]);
    }

    #[test]
    fn a_resend_stops_at_a_live_lease_and_takes_nothing_without_the_missing_sequence() {
        let rows = [row(12, 2, None), row(13, 3, Some(500)), row(14, 4, None)];
        assert_eq!(plan_resend(&rows, 2, 100, 10), [12]);
        let leased_first = [row(12, 2, Some(500)), row(13, 3, None)];
        assert!(plan_resend(&leased_first, 2, 100, 10).is_empty());
        let without_it = [row(13, 3, None), row(14, 4, None)];
        assert!(plan_resend(&without_it, 2, 100, 10).is_empty());
    }
}
