//! [`PostgresBuilder`]: how an inbox in a PostgreSQL database is opened, from
//! [`crate::OrderedInbox::postgres`].

use std::sync::Arc;

use super::{PostgresError, PostgresHandler, PostgresInbox, Remote, Target, schema};
use crate::content::AcceptAll;
use crate::model::Limits;

/// Opens an ordered inbox in a PostgreSQL database: the handler, the bounds, how to reach the
/// server and the application's own tables, then [`PostgresBuilder::open`]. Made by
/// [`crate::OrderedInbox::postgres`].
///
/// Unless told otherwise the inbox runs [`AcceptAll`] (every payload applies, nothing else is
/// written), with [`Limits::default`], on a server on this host (loopback or a Unix socket,
/// [`Target::parse`]).
#[must_use = "a builder opens nothing until `open` is awaited"]
pub struct PostgresBuilder {
    url: String,
    remote: Option<Remote>,
    handler: Arc<dyn PostgresHandler>,
    limits: Limits,
    tables: Option<String>,
}

impl PostgresBuilder {
    pub(crate) fn new(url: String) -> PostgresBuilder {
        PostgresBuilder {
            url,
            remote: None,
            handler: Arc::new(AcceptAll),
            limits: Limits::default(),
            tables: None,
        }
    }

    /// The application's handler: its check, and what applying a message writes in the
    /// inbox's transaction.
    pub fn handler(self, handler: impl PostgresHandler + 'static) -> PostgresBuilder {
        self.shared_handler(Arc::new(handler))
    }

    /// As [`PostgresBuilder::handler`], for a handler the application also keeps.
    pub fn shared_handler(mut self, handler: Arc<dyn PostgresHandler>) -> PostgresBuilder {
        self.handler = handler;
        self
    }

    /// The bounds the inbox keeps for every aggregate.
    pub fn limits(mut self, limits: Limits) -> PostgresBuilder {
        self.limits = limits;
        self
    }

    /// A server that may be on another host, reached as `remote` says (TLS, certificates,
    /// password): the URL is read with [`Target::parse_remote`].
    pub fn remote(mut self, remote: Remote) -> PostgresBuilder {
        self.remote = Some(remote);
        self
    }

    /// The application's own tables: SQL statements run when the inbox opens, after the
    /// inbox's migrations and under the same advisory lock, in one implicit transaction. They
    /// must be idempotent (`CREATE TABLE IF NOT EXISTS`: they run at every open).
    pub fn migrate(mut self, tables: impl Into<String>) -> PostgresBuilder {
        self.tables = Some(tables.into());
        self
    }

    /// Checks the URL, brings the inbox's tables and then the application's up to date, opens
    /// the pool and starts the group commit's writer.
    pub async fn open(self) -> Result<PostgresInbox, PostgresError> {
        let target = match &self.remote {
            Some(remote) => Target::parse_remote(&self.url, remote)?,
            None => Target::parse(&self.url)?,
        };
        schema::migrate_with(&target, self.tables.as_deref()).await?;
        PostgresInbox::start(target, self.limits, self.handler)
    }
}
