//! The application's handler on SQLite: [`SqliteHandler::apply`] runs on the writer thread, in
//! the inbox's own transaction, on the writer's connection.

use rusqlite::Connection;
use serde_json::Value;

use super::connection::WriterConnection;
use crate::content::{AcceptAll, ApplyOutcome, Check};
use crate::error::HandlerError;
use crate::model::OrderedMessage;
use crate::records::SkippedSequences;

/// An application's handler for the SQLite inbox: its pure [`Check`], and what applying a
/// message does to the application's own tables.
///
/// `apply` is called for each message the inbox applies (delivered, drained from the held set,
/// or an operator's replacement), after its check accepted it, on the writer's connection inside
/// the transaction that records it: the inbox's rows and the handler's commit together or not
/// at all. It may read and write any table of the file but the inbox's own, and must act only
/// through `connection` (no transaction statements, nothing outside the database; it derefs to
/// a [`rusqlite::Connection`], and [`WriterConnection::prepared`] keeps a statement of fixed SQL
/// prepared for the writer's life): the writer
/// may run a unit again after another unit of its group failed, and the inbox runs a decision
/// again after `apply` found a poison, each time with the earlier run's writes rolled back.
pub trait SqliteHandler: Check {
    /// Applies `message`: [`ApplyOutcome::Applied`] keeps the handler's writes;
    /// [`ApplyOutcome::Poison`] rolls them back and quarantines the message; an `Err` records
    /// nothing of the delivery (it fails alone, and may be delivered again).
    fn apply(
        &self,
        connection: &WriterConnection<'_>,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError>;

    /// What the application shows of an aggregate in a resolution's audit row (`before` and
    /// `after`), read in the resolution's transaction. `None` by default.
    fn state(
        &self,
        connection: &Connection,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let _ = (connection, aggregate_id);
        Ok(None)
    }

    /// Hears of sequences an operator's resolution skipped (a dead letter's skip, a gap skip),
    /// on the writer's connection inside the resolution's transaction, after the messages it
    /// applies and after its audit row is numbered: an application that emits one row per
    /// sequence can write a marker for each skipped one, so that its downstream sees every
    /// sequence once. The same rules as `apply` hold (act only through `connection`; it may run
    /// again with the earlier run's writes rolled back); an `Err` fails the resolution, nothing
    /// of it recorded. Nothing by default.
    fn skipped(
        &self,
        connection: &WriterConnection<'_>,
        skipped: &SkippedSequences,
    ) -> Result<(), HandlerError> {
        let _ = (connection, skipped);
        Ok(())
    }
}

impl SqliteHandler for AcceptAll {
    fn apply(
        &self,
        _: &WriterConnection<'_>,
        _: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        Ok(ApplyOutcome::applied())
    }
}
