//! Pruning in SQLite: one bounded batch per writer unit, so that deliveries queued behind it
//! wait no longer than behind a group commit of theirs (see [`crate::retention`]).
//!
//! Applied identities go oldest first by rowid: one writer inserts them in time order, so the
//! front of the table is the oldest and a prune reads only the rows it deletes, without an index
//! on `applied_at` that every delivery would pay for. SQLite reuses the pages freed for the rows
//! written next, so a store under a steady load with a retention keeps a steady size.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension, params};

use crate::retention::{PrunePlan, Pruned, Retained};

use super::connection::WriterConnection;

/// Aggregates whose timeline one batch compacts, out of the plan's batch: each is an indexed
/// seek and a delete of what grew since the last round.
const AGGREGATES_PER_BATCH_DIVISOR: usize = 8;

// Every limit and offset below is written `+?N`, an expression, not a bare parameter: SQLite
// plans with a bare parameter's value there and then marks the statement to be prepared again
// whenever that parameter is bound again, which is at every execution. These statements are
// prepared once per connection and run at every pruning batch.

/// The oldest `?2` identities by rowid, those applied before `?1`. The window is the oldest
/// rows by rowid, so a prune that finds nothing old enough reads `?2` rows, never the table. A
/// row from before timestamps were kept (no `applied_at`) is older than any other.
const PRUNE_IDENTITIES: &str = "DELETE FROM ordered_inbox
  WHERE rowid IN (SELECT rowid FROM ordered_inbox ORDER BY rowid LIMIT +?2)
    AND (applied_at IS NULL OR applied_at < ?1)";

/// At most `?2` dead letters closed before `?1`. A resolution row stays: it is the audit trail
/// by itself.
const PRUNE_DEAD_LETTERS: &str = "DELETE FROM deadletters
  WHERE rowid IN (
        SELECT rowid FROM deadletters
         WHERE status IN ('resolved', 'superseded') AND closed_at < ?1
         LIMIT +?2)";

/// The next `?2` aggregates after `?1`, whose timelines a batch compacts.
const TIMELINE_AGGREGATES: &str = "SELECT aggregate_id FROM aggregate_state
  WHERE aggregate_id > ?1 ORDER BY aggregate_id LIMIT +?2";

/// At most `?3` events of aggregate `?1` beyond its newest `?2 + 1`. The newest stay whatever
/// their kind; older ones go but for the events of the audit trail and the quarantine of a
/// resolved dead letter.
const COMPACT_TIMELINE: &str = "DELETE FROM aggregate_timeline
  WHERE id IN (
        SELECT t.id FROM aggregate_timeline AS t
         WHERE t.aggregate_id = ?1
           AND t.id < (SELECT id FROM aggregate_timeline
                        WHERE aggregate_id = ?1
                        ORDER BY id DESC LIMIT 1 OFFSET +?2)
           AND t.kind NOT IN ('resolved', 'skipped', 'owner transferred', 'gap skipped')
           AND NOT (t.kind = 'quarantined'
                    AND EXISTS (SELECT 1 FROM resolutions AS r
                                 WHERE r.message_id = t.message_id))
         LIMIT +?3)";

/// Runs one batch of `plan` in the writer's transaction.
pub(crate) fn prune(
    connection: &WriterConnection<'_>,
    plan: &PrunePlan,
) -> rusqlite::Result<Pruned> {
    let limit = i64::try_from(plan.batch).unwrap_or(i64::MAX);
    let mut pruned = Pruned::default();
    if let Some(before) = &plan.identities_before {
        pruned.identities = connection
            .prepared(PRUNE_IDENTITIES)?
            .execute(params![before, limit])? as u64;
    }
    if let Some(before) = &plan.dead_letters_before {
        pruned.dead_letters = connection
            .prepared(PRUNE_DEAD_LETTERS)?
            .execute(params![before, limit])? as u64;
    }
    if let Some(keep) = plan.timeline_keep {
        let aggregates = (plan.batch / AGGREGATES_PER_BATCH_DIVISOR).max(1);
        let after = plan.timeline_after.clone().unwrap_or_default();
        let names: Vec<String> = connection
            .prepared(TIMELINE_AGGREGATES)?
            .query_map(params![after, aggregates as i64], |row| row.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        for name in &names {
            pruned.timeline += connection.prepared(COMPACT_TIMELINE)?.execute(params![
                name,
                i64::from(keep.saturating_sub(1)),
                limit
            ])? as u64;
        }
        pruned.timeline_cursor = if names.len() < aggregates {
            None
        } else {
            names.last().cloned()
        };
    }
    pruned.more = pruned.filled(plan.batch) || pruned.timeline_cursor.is_some();
    Ok(pruned)
}

/// The store's size and the oldest retained row of each kind.
pub(crate) fn retained(connection: &Connection, path: &Path) -> rusqlite::Result<Retained> {
    let pages: i64 = connection.query_row("PRAGMA page_count", [], |row| row.get(0))?;
    let page_size: i64 = connection.query_row("PRAGMA page_size", [], |row| row.get(0))?;
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal_bytes = std::fs::metadata(&wal).map(|meta| meta.len()).unwrap_or(0);
    let oldest = |sql: &str| -> rusqlite::Result<Option<String>> {
        Ok(connection
            .query_row(sql, [], |row| row.get::<_, Option<String>>(0))
            .optional()?
            .flatten())
    };
    Ok(Retained {
        bytes: u64::try_from(pages.saturating_mul(page_size)).unwrap_or(0) + wal_bytes,
        oldest_identity: oldest("SELECT applied_at FROM ordered_inbox ORDER BY rowid LIMIT 1")?,
        oldest_dead_letter: oldest(
            "SELECT MIN(closed_at) FROM deadletters WHERE status IN ('resolved', 'superseded')",
        )?,
        oldest_timeline: oldest("SELECT at FROM aggregate_timeline ORDER BY id LIMIT 1")?,
    })
}

#[cfg(test)]
mod tests {
    use rusqlite::types::Value;

    use super::*;
    use crate::sqlite::connection::{ParametersFor, times_prepared_again};
    use crate::timeline::TimelineKind;

    /// Each statement of a pruning batch, run again and again with its limits bound anew as the
    /// pruner binds them, is prepared once: a statement SQLite prepared again at every batch
    /// spent more on its planning than on its rows.
    #[test]
    fn a_pruning_statement_is_prepared_once_however_often_its_limits_are_bound() {
        let connection = crate::sqlite::schema::migrated_in_memory();
        let text = |text: &str| Value::Text(text.to_owned());
        let runs: [(&str, &ParametersFor<'_>); 4] = [
            (PRUNE_IDENTITIES, &|limit| vec![text("9"), limit.into()]),
            (PRUNE_DEAD_LETTERS, &|limit| vec![text("9"), limit.into()]),
            (TIMELINE_AGGREGATES, &|limit| vec![text(""), limit.into()]),
            (COMPACT_TIMELINE, &|limit| {
                vec![text("a"), 4.into(), limit.into()]
            }),
        ];
        for (sql, parameters) in runs {
            assert_eq!(
                times_prepared_again(&connection, sql, parameters, &[500, 500, 2000]),
                Ok(0),
                "prepared again: {sql}"
            );
        }
    }

    #[test]
    fn the_kinds_compaction_keeps_are_spelled_as_stored() {
        for kind in [
            TimelineKind::Resolved,
            TimelineKind::Skipped,
            TimelineKind::OwnerTransferred,
            TimelineKind::GapSkipped,
            TimelineKind::Quarantined,
        ] {
            assert!(
                include_str!("retention.rs").contains(&format!("'{}'", kind.as_str())),
                "{kind}"
            );
        }
    }
}
