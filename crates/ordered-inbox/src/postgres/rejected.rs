//! The rejected list in PostgreSQL (`rejected_deliveries`, inbox schema version 4 there): the page
//! read by id. Entries are written by the engine ([`super::engine::record_rejected`] and the
//! changes of drains and transfers).

use tokio_postgres::Row;

use super::connection::{Client, Counters, Failure};
use crate::records::RejectedDelivery;
use crate::views::{Page, PageRequest};

const PAGE: &str = "SELECT id, at, subject, stream_sequence, delivered, message_id, aggregate_id,
       producer, outcome, reason
  FROM rejected_deliveries WHERE id > $1 ORDER BY id LIMIT $2";

/// The entries after `page.after` (an id), oldest first.
pub(super) async fn page(
    client: &Client,
    counters: &Counters,
    page: PageRequest,
) -> Result<Page<RejectedDelivery>, Failure> {
    let statement = client.prepare_cached(PAGE).await?;
    let limit = page.limit.saturating_add(1);
    let rows = client.query(&statement, &[&page.after, &limit]).await;
    counters.trip();
    let rows = rows?
        .iter()
        .map(|row| Ok((row.try_get(0)?, entry_from(row)?)))
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Page::from_rows(rows, page.limit))
}

fn entry_from(row: &Row) -> Result<RejectedDelivery, Failure> {
    Ok(RejectedDelivery {
        at: row.try_get(1)?,
        subject: row.try_get(2)?,
        stream_sequence: row.try_get(3)?,
        delivered: row.try_get(4)?,
        message_id: row.try_get(5)?,
        aggregate_id: row.try_get(6)?,
        producer: row.try_get(7)?,
        outcome: row.try_get(8)?,
        reason: row.try_get(9)?,
    })
}
