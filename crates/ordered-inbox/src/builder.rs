//! [`OrderedInbox`]: the way in, one builder per backend.

/// Opens an ordered inbox: `OrderedInbox::sqlite` or `OrderedInbox::postgres` start a
/// builder that takes the application's handler, the bounds and the application's own tables,
/// and whose `open` brings the schema up to date and returns the running inbox.
///
/// ```
/// use ordered_inbox::{Door, Inbox, Limits, OrderedInbox, OrderedMessage, Outcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = tempfile::tempdir()?;
/// // Without a handler of its own, every payload applies and nothing else is written.
/// let inbox = OrderedInbox::sqlite(dir.path().join("inbox.db"))
///     .limits(Limits::default())
///     .open()
///     .await?;
/// let message = OrderedMessage {
///     message_id: "m-1".into(),
///     aggregate_id: "account-1".into(),
///     sequence: 1,
///     payload: serde_json::json!({ "amount": 5 }),
/// };
/// let outcome = inbox.deliver(message, Door::General).await?;
/// assert!(matches!(outcome, Outcome::Applied { sequence: 1, .. }));
/// inbox.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct OrderedInbox {
    _builders_only: (),
}

impl OrderedInbox {
    /// An inbox in the SQLite file at `path` (created if missing), with its writer thread and
    /// group commit; see [`crate::sqlite::builder::SqliteBuilder`].
    #[cfg(feature = "sqlite")]
    pub fn sqlite(path: impl AsRef<std::path::Path>) -> crate::sqlite::builder::SqliteBuilder {
        crate::sqlite::builder::SqliteBuilder::new(path.as_ref())
    }

    /// An inbox in the PostgreSQL database at `url` (`postgres://user@host/database`), shared
    /// by any number of server processes; see [`crate::postgres::builder::PostgresBuilder`].
    #[cfg(feature = "postgres")]
    pub fn postgres(url: impl Into<String>) -> crate::postgres::builder::PostgresBuilder {
        crate::postgres::builder::PostgresBuilder::new(url.into())
    }
}
