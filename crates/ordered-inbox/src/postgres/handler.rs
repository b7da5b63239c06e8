//! The application's handler on PostgreSQL: [`PostgresHandler::apply`] runs on the operation's
//! pooled connection, inside the transaction that records the message.

use async_trait::async_trait;
use serde_json::Value;

use crate::content::{AcceptAll, ApplyOutcome, Check};
use crate::error::HandlerError;
use crate::model::OrderedMessage;
use crate::records::SkippedSequences;

/// The client a handler is given: the pooled connection of the inbox's open transaction. It
/// dereferences to [`tokio_postgres::Client`] for every query, and keeps a cache of prepared
/// statements per connection (`prepare_cached`, `prepare_typed_cached`): a handler's statement
/// prepared once is planned once per connection, where `query_typed` or a query by text is
/// parsed and planned again at every call (for a statement of a few joins, planning can cost
/// more than running it).
pub type HandlerClient = deadpool_postgres::ClientWrapper;

/// An application's handler for the PostgreSQL inbox: its pure [`Check`], and what applying a
/// message does to the application's own tables.
///
/// `apply` is called for each message the inbox applies (delivered, drained from the held set,
/// or an operator's replacement), after its check accepted it, with the client
/// ([`HandlerClient`]) of the open transaction that records it (the aggregate and the message
/// ids locked): the inbox's rows and the handler's commit together or not at all. It may read and write any table but the
/// inbox's own, and must act only through `client`, without transaction statements (no
/// `COMMIT`, `ROLLBACK` or `SAVEPOINT` of its own): the inbox rolls its writes back to a
/// savepoint when it returns a poison and decides again, and retries a whole operation after a
/// serialization failure or a deadlock, so `apply` may run more than once for one delivery,
/// each time with the earlier run's writes gone.
#[async_trait]
pub trait PostgresHandler: Check {
    /// Applies `message`: [`ApplyOutcome::Applied`] keeps the handler's writes;
    /// [`ApplyOutcome::Poison`] rolls them back and quarantines the message; an `Err` rolls the
    /// whole delivery back (it fails alone, and may be delivered again).
    async fn apply(
        &self,
        client: &HandlerClient,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError>;

    /// Applies `messages` in the order given, each as [`PostgresHandler::apply`] would, each
    /// seeing the writes of the ones before it: the outcomes in that order, ending at the first
    /// that is not [`ApplyOutcome::Applied`] (the rest are not applied). The inbox's group commit
    /// calls it once for the applied messages of a whole batch, before it writes the batch's
    /// own rows; a poison or an error among them sends the batch to its replay, where each
    /// message is applied alone with `apply` in a savepoint of its own. The default applies one
    /// after another; a handler whose `apply` is a single statement may send them all at once
    /// (pipelined statements run in the order sent), which makes a batch's applies one round
    /// trip, and fall back on [`apply_one_by_one`] for a batch it does not cover.
    async fn apply_many(
        &self,
        client: &HandlerClient,
        messages: &[&OrderedMessage],
    ) -> Result<Vec<ApplyOutcome>, HandlerError> {
        apply_one_by_one(self, client, messages).await
    }

    /// What the application shows of an aggregate in a resolution's audit row (`before` and
    /// `after`), read in the resolution's transaction. `None` by default.
    async fn state(
        &self,
        client: &HandlerClient,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let _ = (client, aggregate_id);
        Ok(None)
    }

    /// Hears of sequences an operator's resolution skipped (a dead letter's skip, a gap skip),
    /// with the client of the resolution's open transaction, after the messages it applies and
    /// after its audit row is numbered: an application that emits one row per sequence can
    /// write a marker for each skipped one, so that its downstream sees every sequence once.
    /// The same rules as `apply` hold (act only through `client`, no transaction statements; it
    /// may run again after a retry); an `Err` rolls the resolution back. Nothing by default.
    async fn skipped(
        &self,
        client: &HandlerClient,
        skipped: &SkippedSequences,
    ) -> Result<(), HandlerError> {
        let _ = (client, skipped);
        Ok(())
    }
}

/// [`PostgresHandler::apply_many`]'s default: `handler`'s `apply` for each message in turn,
/// ending at the first outcome that is not [`ApplyOutcome::Applied`].
pub async fn apply_one_by_one<H: PostgresHandler + ?Sized>(
    handler: &H,
    client: &HandlerClient,
    messages: &[&OrderedMessage],
) -> Result<Vec<ApplyOutcome>, HandlerError> {
    let mut outcomes = Vec::with_capacity(messages.len());
    for message in messages {
        let outcome = handler.apply(client, message).await?;
        let applied = matches!(outcome, ApplyOutcome::Applied { .. });
        outcomes.push(outcome);
        if !applied {
            break;
        }
    }
    Ok(outcomes)
}

#[async_trait]
impl PostgresHandler for AcceptAll {
    async fn apply(
        &self,
        _: &HandlerClient,
        _: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        Ok(ApplyOutcome::applied())
    }
}
