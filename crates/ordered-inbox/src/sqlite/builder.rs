//! [`SqliteBuilder`]: how an inbox on a SQLite file is opened, from
//! [`crate::OrderedInbox::sqlite`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rusqlite::Connection;

use super::{SqliteHandler, SqliteInbox, Store, StoreError, Synchronous, WriterObserver, schema};
use crate::content::AcceptAll;
use crate::model::Limits;

/// The application's migration of its own tables, run after the inbox's.
type Migration = Box<dyn FnOnce(&mut Connection) -> rusqlite::Result<()> + Send>;

/// Opens an ordered inbox in a SQLite file: the handler, the bounds, the durability and the
/// application's own tables, then [`SqliteBuilder::open`]. Made by
/// [`crate::OrderedInbox::sqlite`].
///
/// Unless told otherwise the inbox runs [`AcceptAll`] (every payload applies, nothing else is
/// written), with [`Limits::default`] and [`Synchronous::Full`] (a commit survives a power
/// cut).
#[must_use = "a builder opens nothing until `open` is awaited"]
pub struct SqliteBuilder {
    path: PathBuf,
    handler: Arc<dyn SqliteHandler>,
    limits: Limits,
    synchronous: Synchronous,
    migration: Option<Migration>,
    observer: Option<Arc<dyn WriterObserver>>,
}

impl SqliteBuilder {
    pub(crate) fn new(path: &Path) -> SqliteBuilder {
        SqliteBuilder {
            path: path.to_owned(),
            handler: Arc::new(AcceptAll),
            limits: Limits::default(),
            synchronous: Synchronous::Full,
            migration: None,
            observer: None,
        }
    }

    /// The application's handler: its check, and what applying a message writes in the
    /// inbox's transaction.
    pub fn handler(self, handler: impl SqliteHandler + 'static) -> SqliteBuilder {
        self.shared_handler(Arc::new(handler))
    }

    /// As [`SqliteBuilder::handler`], for a handler the application also keeps.
    pub fn shared_handler(mut self, handler: Arc<dyn SqliteHandler>) -> SqliteBuilder {
        self.handler = handler;
        self
    }

    /// The bounds the inbox keeps for every aggregate.
    pub fn limits(mut self, limits: Limits) -> SqliteBuilder {
        self.limits = limits;
        self
    }

    /// SQLite's `synchronous` setting for the writer's connection.
    pub fn synchronous(mut self, synchronous: Synchronous) -> SqliteBuilder {
        self.synchronous = synchronous;
        self
    }

    /// The application's own tables: `migrate` runs on the writer's connection when the file
    /// is opened, after the inbox's migrations, before any work. It must be idempotent (it runs
    /// at every open).
    pub fn migrate(
        mut self,
        migrate: impl FnOnce(&mut Connection) -> rusqlite::Result<()> + Send + 'static,
    ) -> SqliteBuilder {
        self.migration = Some(Box::new(migrate));
        self
    }

    /// An observer the writer thread calls after every committed batch.
    pub fn observer(mut self, observer: Arc<dyn WriterObserver>) -> SqliteBuilder {
        self.observer = Some(observer);
        self
    }

    /// Opens (creating if needed) the file, brings the inbox's tables and then the
    /// application's up to date, and starts the writer. The file's opening and migrations run
    /// on the blocking pool, not on the caller's task.
    pub async fn open(self) -> Result<SqliteInbox, StoreError> {
        let SqliteBuilder {
            path,
            handler,
            limits,
            synchronous,
            migration,
            observer,
        } = self;
        let migrate = move |connection: &mut Connection| {
            schema::migrate(connection)?;
            match migration {
                Some(migration) => migration(connection),
                None => Ok(()),
            }
        };
        let opening = tokio::task::spawn_blocking(move || {
            Store::open_observed(&path, synchronous, migrate, observer)
        });
        let store = opening
            .await
            .map_err(|error| StoreError::Unavailable(format!("opening the store: {error}")))??;
        Ok(SqliteInbox::with_handler(store, limits, handler))
    }
}

#[cfg(test)]
mod tests {
    use crate::OrderedInbox;
    use crate::delivery::Outcome;
    use crate::inbox::Inbox;
    use crate::model::{Door, Limits};
    use crate::sqlite::testing::{ORDER_TABLES, Orders, order, orders};
    use crate::sqlite::{StoreError, Synchronous};

    #[tokio::test]
    async fn the_builder_opens_a_file_with_the_inbox_and_the_application_tables_and_runs_the_handler()
     {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shop.db");
        let open = || {
            OrderedInbox::sqlite(&path)
                .handler(Orders)
                .limits(Limits::default())
                .synchronous(Synchronous::Normal)
                .migrate(|connection| connection.execute_batch(ORDER_TABLES))
                .open()
        };
        let inbox = open().await.unwrap();
        let applied = inbox.deliver(order("m-1", "a", 1, 4), Door::General).await;
        assert!(
            matches!(applied, Ok(Outcome::Applied { sequence: 1, .. })),
            "{applied:?}"
        );
        inbox.shutdown().await;

        // Opened again: both migrations run again without harm, and the file remembers.
        let inbox = open().await.unwrap();
        let again = inbox.deliver(order("m-1", "a", 1, 4), Door::General).await;
        assert!(matches!(again, Ok(Outcome::Replay { .. })), "{again:?}");
        let rows = inbox
            .store()
            .read(|connection| Ok::<_, StoreError>(orders(connection)))
            .await
            .unwrap();
        assert_eq!(rows, ["m-1|a|4"]);
        inbox.shutdown().await;
    }

    #[tokio::test]
    async fn a_failing_application_migration_opens_no_inbox() {
        let dir = tempfile::tempdir().unwrap();
        let opened = OrderedInbox::sqlite(dir.path().join("shop.db"))
            .handler(Orders)
            .migrate(|connection| connection.execute_batch("CREATE TABLE broken("))
            .open()
            .await;
        assert!(
            matches!(opened, Err(StoreError::Sqlite(_))),
            "{:?}",
            opened.err()
        );
    }

    #[tokio::test]
    async fn without_a_handler_every_payload_applies() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = OrderedInbox::sqlite(dir.path().join("inbox.db"))
            .open()
            .await
            .unwrap();
        let applied = inbox.deliver(order("m-1", "a", 1, -1), Door::General).await;
        assert!(
            matches!(applied, Ok(Outcome::Applied { sequence: 1, .. })),
            "{applied:?}"
        );
        inbox.shutdown().await;
    }
}
