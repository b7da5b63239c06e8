//! The publisher's lease: one row in the store (`gate_publisher_lease`: holder, epoch, expiry)
//! saying which gate of the store publishes its output. A gate takes the lease when there is
//! none or when it lapsed, which bumps the epoch; the holder renews it once a third of its term
//! has passed, and a renewal that finds another holder or another epoch means it lost the lease
//! and stands by.
//!
//! Expiry is measured on the store's clock (`clock_timestamp()` on PostgreSQL, the SQLite
//! file's host), never a gate's: gates on different machines share one database but not one
//! clock, and a gate whose clock ran ahead would otherwise think a live lease had lapsed.
//!
//! The lease keeps the gates from contending; it is not what makes the output exactly once.
//! A holder can outlive its lease unawares (paused, cut off), so every publish is also fenced by
//! JetStream ([`crate::publisher`]).

use std::time::Duration;

use tokio_postgres::types::Type;

use super::output::{OutputError, OutputStore, unavailable};

/// The store's clock in milliseconds since the epoch, on SQLite.
const NOW_SQLITE: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
/// The store's clock in milliseconds since the epoch, on PostgreSQL (the statement's own time,
/// not its transaction's).
const NOW_POSTGRES: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// The lease a gate holds: its own name and the epoch it took the lease at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub holder: String,
    pub epoch: i64,
}

/// The statement that takes the lease (`?1`/`$1` holder, `?2`/`$2` duration in ms) when there is
/// none or it lapsed, one epoch past the last, answering the new epoch; no row when another
/// gate holds it.
fn take_sql(now: &str, holder: &str, duration: &str) -> String {
    format!(
        "INSERT INTO gate_publisher_lease AS l (id, holder, epoch, expires_at_ms)
         VALUES (1, {holder}, 1, {now} + {duration})
         ON CONFLICT (id) DO UPDATE
            SET holder = excluded.holder, epoch = l.epoch + 1, expires_at_ms = excluded.expires_at_ms
          WHERE l.expires_at_ms < {now}
         RETURNING epoch"
    )
}

/// The statement that renews the lease (`holder`, `epoch`, duration in ms) for as long as the
/// same holder holds it at the same epoch.
fn renew_sql(now: &str, holder: &str, epoch: &str, duration: &str) -> String {
    format!(
        "UPDATE gate_publisher_lease SET expires_at_ms = {now} + {duration}
          WHERE id = 1 AND holder = {holder} AND epoch = {epoch}"
    )
}

/// The statement that gives the lease up at once (`holder`, `epoch`), so that another gate need
/// not wait out its expiry.
const RELEASE_SQL: &str = "UPDATE gate_publisher_lease SET expires_at_ms = 0
  WHERE id = 1 AND holder = $1 AND epoch = $2";

impl OutputStore {
    /// Takes the publisher's lease for `holder` for `duration` if no gate holds it or its holder
    /// let it lapse: the lease with its new epoch, or `None` while another gate holds it.
    pub async fn take_lease(
        &self,
        holder: &str,
        duration: Duration,
    ) -> Result<Option<Lease>, OutputError> {
        let millis = millis(duration);
        let epoch: Option<i64> = match self {
            OutputStore::Sqlite(store) => {
                let holder = holder.to_owned();
                store
                    .write(move |connection| {
                        let sql = take_sql(NOW_SQLITE, "?1", "?2");
                        let mut statement = connection.prepare_cached(&sql)?;
                        let mut rows = statement.query((&holder, millis))?;
                        Ok::<_, OutputError>(match rows.next()? {
                            Some(row) => Some(row.get(0)?),
                            None => None,
                        })
                    })
                    .await?
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let sql = take_sql(NOW_POSTGRES, "$1", "$2");
                let row = client
                    .query_typed(&sql, &[(&holder, Type::TEXT), (&millis, Type::INT8)])
                    .await?;
                match row.first() {
                    Some(row) => Some(row.try_get(0)?),
                    None => None,
                }
            }
        };
        Ok(epoch.map(|epoch| Lease {
            holder: holder.to_owned(),
            epoch,
        }))
    }

    /// Renews `lease` for `duration`: false when another gate took it over since.
    pub async fn renew_lease(
        &self,
        lease: &Lease,
        duration: Duration,
    ) -> Result<bool, OutputError> {
        let millis = millis(duration);
        let changed = match self {
            OutputStore::Sqlite(store) => {
                let lease = lease.clone();
                store
                    .write(move |connection| {
                        let sql = renew_sql(NOW_SQLITE, "?1", "?2", "?3");
                        let changed = connection.prepare_cached(&sql)?.execute((
                            &lease.holder,
                            lease.epoch,
                            millis,
                        ))?;
                        Ok::<_, OutputError>(changed as u64)
                    })
                    .await?
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let sql = renew_sql(NOW_POSTGRES, "$1", "$2", "$3");
                let statement = client
                    .prepare_typed(&sql, &[Type::TEXT, Type::INT8, Type::INT8])
                    .await?;
                client
                    .execute(&statement, &[&lease.holder, &lease.epoch, &millis])
                    .await?
            }
        };
        Ok(changed == 1)
    }

    /// The epoch of the store's lease as it stands (whoever holds it, lapsed or not), 0 before
    /// any gate took it: what a standby reports.
    pub async fn lease_epoch(&self) -> Result<i64, OutputError> {
        const SQL: &str = "SELECT epoch FROM gate_publisher_lease WHERE id = 1";
        match self {
            OutputStore::Sqlite(store) => {
                store
                    .read(|connection| {
                        let epoch = connection
                            .prepare_cached(SQL)?
                            .query([])?
                            .next()?
                            .map(|row| row.get(0))
                            .transpose()?;
                        Ok::<_, OutputError>(epoch.unwrap_or(0))
                    })
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let rows = client.query_typed(SQL, &[]).await?;
                match rows.first() {
                    Some(row) => Ok(row.try_get(0)?),
                    None => Ok(0),
                }
            }
        }
    }

    /// Gives `lease` up (a gate stopping), unless another gate holds it already.
    pub async fn release_lease(&self, lease: &Lease) -> Result<(), OutputError> {
        match self {
            OutputStore::Sqlite(store) => {
                let lease = lease.clone();
                store
                    .write(move |connection| {
                        let sql = RELEASE_SQL.replace('$', "?");
                        connection
                            .prepare_cached(&sql)?
                            .execute((&lease.holder, lease.epoch))?;
                        Ok::<_, OutputError>(())
                    })
                    .await
            }
            OutputStore::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(unavailable)?;
                let statement = client
                    .prepare_typed(RELEASE_SQL, &[Type::TEXT, Type::INT8])
                    .await?;
                client
                    .execute(&statement, &[&lease.holder, &lease.epoch])
                    .await?;
                Ok(())
            }
        }
    }
}

/// `duration` in whole milliseconds, as the lease's expiry counts.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
