//! Pruning in PostgreSQL: each kind's bounded batch is one statement, its own transaction on a
//! pooled connection of its own, so it holds row locks only on the rows it deletes and never
//! waits behind (or holds up) a delivery's aggregate lock (see [`crate::retention`]).
//!
//! Applied identities go oldest first by `applied_at` (version 9's index). A delivery that reads
//! an identity as a prune deletes it sees it or not, as before or after the prune: either way
//! its aggregate's position, which is never pruned, keeps it from applying twice.

use super::connection::{Client, Counters, Failure};
use crate::retention::{PrunePlan, Pruned, Retained};

const PRUNE_IDENTITIES: &str = "
DELETE FROM ordered_inbox
 WHERE (producer, message_id) IN (
       SELECT producer, message_id FROM ordered_inbox
        WHERE applied_at < $1
        ORDER BY applied_at
        LIMIT $2)";

const PRUNE_DEAD_LETTERS: &str = "
DELETE FROM deadletters
 WHERE (producer, message_id) IN (
       SELECT producer, message_id FROM deadletters
        WHERE status IN ('resolved', 'superseded') AND closed_at < $1
        LIMIT $2)";

const TIMELINE_AGGREGATES: &str = "
SELECT aggregate_id FROM aggregate_state WHERE aggregate_id > $1 ORDER BY aggregate_id LIMIT $2";

/// One statement for every listed aggregate: the newest `$2` events of each stay whatever their
/// kind; older ones go but for the events of the audit trail and the quarantine of a resolved
/// dead letter. A statement per aggregate cost the pruner a round trip and a transaction each,
/// which capped the identities it pruned per second below what a busy gate applies.
const COMPACT_TIMELINE: &str = "
DELETE FROM aggregate_timeline
 WHERE id IN (
       SELECT ranked.id
         FROM (SELECT t.id, t.kind, t.message_id,
                      row_number() OVER (PARTITION BY t.aggregate_id ORDER BY t.id DESC) AS newer
                 FROM aggregate_timeline AS t
                WHERE t.aggregate_id = ANY($1)) AS ranked
        WHERE ranked.newer > $2
          AND ranked.kind NOT IN ('resolved', 'skipped', 'owner transferred', 'gap skipped')
          AND NOT (ranked.kind = 'quarantined'
                   AND EXISTS (SELECT 1 FROM resolutions AS r
                                WHERE r.message_id = ranked.message_id))
        LIMIT $3)";

const RETAINED: &str = "
SELECT (SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0)::bigint
          FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.relkind = 'r' AND n.nspname = current_schema()
           AND c.relname IN ('aggregate_state', 'ordered_inbox', 'deadletters',
                             'aggregate_timeline', 'resolutions', 'gap_resolutions',
                             'held_messages', 'ownership_transfers', 'rejected_deliveries',
                             'refused_gaps', 'producers', 'operators')),
       (SELECT MIN(applied_at) FROM ordered_inbox),
       (SELECT MIN(closed_at) FROM deadletters WHERE status IN ('resolved', 'superseded')),
       (SELECT at FROM aggregate_timeline ORDER BY id LIMIT 1)";

/// Aggregates whose timeline one batch compacts, out of the plan's batch.
const AGGREGATES_PER_BATCH_DIVISOR: usize = 8;

/// Runs one batch of `plan`, each kind in a statement (a transaction) of its own.
pub(super) async fn prune(
    client: &Client,
    counters: &Counters,
    plan: &PrunePlan,
) -> Result<Pruned, Failure> {
    let limit = i64::try_from(plan.batch).unwrap_or(i64::MAX);
    let mut pruned = Pruned::default();
    if let Some(before) = &plan.identities_before {
        let statement = client.prepare_cached(PRUNE_IDENTITIES).await?;
        pruned.identities = client.execute(&statement, &[before, &limit]).await?;
        counters.trip();
    }
    if let Some(before) = &plan.dead_letters_before {
        let statement = client.prepare_cached(PRUNE_DEAD_LETTERS).await?;
        pruned.dead_letters = client.execute(&statement, &[before, &limit]).await?;
        counters.trip();
    }
    if let Some(keep) = plan.timeline_keep {
        let aggregates = (plan.batch / AGGREGATES_PER_BATCH_DIVISOR).max(1);
        let after = plan.timeline_after.clone().unwrap_or_default();
        let listed = client.prepare_cached(TIMELINE_AGGREGATES).await?;
        let rows = client
            .query(&listed, &[&after, &(aggregates as i64)])
            .await?;
        counters.trip();
        let names = rows
            .iter()
            .map(|row| row.try_get::<_, String>(0))
            .collect::<Result<Vec<_>, _>>()?;
        let compact = client.prepare_cached(COMPACT_TIMELINE).await?;
        // At least the newest event stays, as the statement per aggregate kept it.
        let kept = i64::from(keep.max(1));
        // Bounded like the statement per aggregate was in sum: a listed aggregate brings what
        // it grew since the pruner's last pass over it.
        let events = limit.saturating_mul(AGGREGATES_PER_BATCH_DIVISOR as i64);
        pruned.timeline = client.execute(&compact, &[&names, &kept, &events]).await?;
        counters.trip();
        pruned.timeline_cursor = if names.len() < aggregates {
            None
        } else {
            names.last().cloned()
        };
    }
    pruned.more = pruned.filled(plan.batch) || pruned.timeline_cursor.is_some();
    Ok(pruned)
}

/// The inbox's tables' size and the oldest retained row of each kind.
pub(super) async fn retained(client: &Client, counters: &Counters) -> Result<Retained, Failure> {
    let statement = client.prepare_cached(RETAINED).await?;
    let row = client.query_one(&statement, &[]).await?;
    counters.trip();
    let bytes: i64 = row.try_get(0)?;
    Ok(Retained {
        bytes: u64::try_from(bytes).unwrap_or(0),
        oldest_identity: row.try_get(1)?,
        oldest_dead_letter: row.try_get(2)?,
        oldest_timeline: row.try_get(3)?,
    })
}
