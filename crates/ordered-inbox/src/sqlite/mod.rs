//! The SQLite backend: [`SqliteInbox`] implements [`crate::Inbox`] on a [`Store`], the
//! single-writer SQLite store with group commit that the owner of the file may share for tables
//! of its own.
//!
//! - [`store`]: the writer thread, group commit, read connections;
//! - [`schema`]: the inbox's tables and migrations;
//! - [`engine`]: facts read, core decision, changes written, in one unit of work;
//! - [`views`]: the evidence queries;
//! - [`operators`]: the operator commands on a file;
//! - `rejected`: the rejected list's rows.

pub mod engine;
pub mod operators;
pub mod producers;
mod rejected;
pub mod schema;
pub mod store;
pub mod views;

use std::path::Path;

use async_trait::async_trait;

pub use store::{
    BUSY_TIMEOUT, BatchCommitted, MAX_BATCH, Store, StoreError, StoreStats, Synchronous,
    WriterObserver, is_busy, is_constraint,
};

use crate::clock;
use crate::delivery::Outcome;
use crate::inbox::{BatchDelivery, Inbox, InboxError};
use crate::model::{AggregateStatus, Door, Limits, OrderedMessage};
use crate::operators::OperatorCheck;
use crate::producers::{ProducerClaim, ProducerRefusal, TransferRecord, TransferRequest};
use crate::rejected::RejectedDelivery;
use crate::resolution::{Mode, ResolutionError, ResolutionRequest, Resolved};
use crate::views::{
    AggregateCounts, AggregateView, AppliedMessage, DeadLetterFilter, DeadLetterView, InboxHealth,
    InventoryEntry, OwnershipState, Page, PageRequest, ProducerView, ResolutionRecord,
    TimelineEvent, TransferConflict,
};

impl From<StoreError> for ResolutionError {
    fn from(error: StoreError) -> Self {
        ResolutionError::Store(error.into())
    }
}

/// The ordered inbox in a SQLite file. Cheap to clone.
#[derive(Clone)]
pub struct SqliteInbox {
    store: Store,
    limits: Limits,
}

impl SqliteInbox {
    /// The inbox on a store whose file was migrated with [`schema::migrate`].
    pub fn new(store: Store, limits: Limits) -> SqliteInbox {
        SqliteInbox { store, limits }
    }

    /// Opens (creating if needed) a file that holds only the inbox.
    pub fn open(
        path: &Path,
        synchronous: Synchronous,
        limits: Limits,
    ) -> Result<SqliteInbox, StoreError> {
        let store = Store::open(path, synchronous, schema::migrate)?;
        Ok(SqliteInbox::new(store, limits))
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Stops the writer after the work already queued.
    pub async fn shutdown(&self) {
        self.store.shutdown().await;
    }

    async fn read<T, F>(&self, work: F) -> Result<T, InboxError>
    where
        F: FnOnce(&rusqlite::Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.store
            .read(move |connection| work(connection).map_err(StoreError::from))
            .await
            .map_err(InboxError::from)
    }
}

#[async_trait]
impl Inbox for SqliteInbox {
    async fn deliver(&self, message: OrderedMessage, door: Door) -> Result<Outcome, InboxError> {
        let limits = self.limits;
        self.store
            .write(move |connection| {
                engine::deliver_in(connection, &message, door, &limits, &clock::now())
            })
            .await
            .map_err(InboxError::from)
    }

    /// One unit of the writer (in one group commit) for the whole batch: any
    /// store failure rolls all of it back. Each delivery reads its ownership facts in that unit,
    /// after the ones before it wrote theirs, so a claim earlier in the batch binds the rest; a
    /// refusal writes nothing and the next delivery goes on.
    async fn deliver_batch(
        &self,
        deliveries: Vec<BatchDelivery>,
    ) -> Result<Vec<Result<Outcome, ProducerRefusal>>, InboxError> {
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        let limits = self.limits;
        self.store
            .write(move |connection| {
                let now = clock::now();
                deliveries
                    .iter()
                    .map(|delivery| {
                        producers::deliver_as_in(
                            connection,
                            &delivery.message,
                            delivery.door,
                            delivery.claim.as_ref(),
                            &limits,
                            &now,
                        )
                    })
                    .collect::<Result<Vec<_>, StoreError>>()
            })
            .await
            .map_err(InboxError::from)
    }

    async fn resolve(
        &self,
        request: ResolutionRequest,
        mode: Mode,
    ) -> Result<Resolved, ResolutionError> {
        let limits = self.limits;
        self.store
            .write(move |connection| {
                engine::resolve_in(connection, &request, mode, &limits, &clock::now())
            })
            .await
    }

    async fn check_operator(&self, token: Option<String>) -> Result<OperatorCheck, InboxError> {
        self.read(move |connection| operators::check(connection, token.as_deref()))
            .await
    }

    async fn aggregate(&self, aggregate_id: String) -> Result<Option<AggregateView>, InboxError> {
        self.read(move |connection| views::aggregate_view(connection, &aggregate_id))
            .await
    }

    async fn inventory(
        &self,
        status: AggregateStatus,
        limit: i64,
    ) -> Result<Vec<InventoryEntry>, InboxError> {
        self.read(move |connection| views::inventory(connection, status, &clock::now(), limit))
            .await
    }

    async fn dead_letters(
        &self,
        filter: DeadLetterFilter,
        page: PageRequest,
    ) -> Result<Page<DeadLetterView>, InboxError> {
        self.read(move |connection| views::dead_letters(connection, &filter, page))
            .await
    }

    async fn timeline(
        &self,
        aggregate_id: String,
        page: PageRequest,
    ) -> Result<Page<TimelineEvent>, InboxError> {
        self.read(move |connection| views::timeline(connection, &aggregate_id, page))
            .await
    }

    async fn resolutions(
        &self,
        aggregate_id: Option<String>,
        page: PageRequest,
    ) -> Result<Page<ResolutionRecord>, InboxError> {
        self.read(move |connection| views::resolutions(connection, aggregate_id.as_deref(), page))
            .await
    }

    async fn counts(&self, aggregate_id: String) -> Result<AggregateCounts, InboxError> {
        self.read(move |connection| views::counts(connection, &aggregate_id))
            .await
    }

    async fn applied_messages(
        &self,
        aggregate_id: String,
        page: PageRequest,
    ) -> Result<Page<AppliedMessage>, InboxError> {
        self.read(move |connection| views::applied_messages(connection, &aggregate_id, page))
            .await
    }

    async fn dead_letter(
        &self,
        producer: Option<String>,
        message_id: String,
    ) -> Result<Option<DeadLetterView>, InboxError> {
        self.read(move |connection| {
            views::dead_letter(connection, producer.as_deref(), &message_id)
        })
        .await
    }

    async fn deliver_as(
        &self,
        message: OrderedMessage,
        door: Door,
        claim: Option<ProducerClaim>,
    ) -> Result<Result<Outcome, ProducerRefusal>, InboxError> {
        let limits = self.limits;
        self.store
            .write(move |connection| {
                producers::deliver_as_in(
                    connection,
                    &message,
                    door,
                    claim.as_ref(),
                    &limits,
                    &clock::now(),
                )
            })
            .await
            .map_err(InboxError::from)
    }

    async fn check_producer(&self, token: String) -> Result<Option<String>, InboxError> {
        self.read(move |connection| producers::holder(connection, &token))
            .await
    }

    async fn start_session(
        &self,
        producer: String,
    ) -> Result<Result<i64, ProducerRefusal>, InboxError> {
        self.store
            .write(move |connection| producers::start_session_in(connection, &producer))
            .await
            .map_err(InboxError::from)
    }

    async fn transfer_owner(
        &self,
        request: TransferRequest,
    ) -> Result<Result<TransferRecord, TransferConflict>, InboxError> {
        self.store
            .write(move |connection| producers::transfer_in(connection, &request, &clock::now()))
            .await
            .map_err(InboxError::from)
    }

    async fn ownership(&self, aggregate_id: String) -> Result<OwnershipState, InboxError> {
        self.read(move |connection| producers::ownership_state(connection, &aggregate_id))
            .await
    }

    async fn producers(&self) -> Result<Vec<ProducerView>, InboxError> {
        self.read(producers::producers).await
    }

    async fn record_rejected(&self, entries: Vec<RejectedDelivery>) -> Result<(), InboxError> {
        if entries.is_empty() {
            return Ok(());
        }
        self.store
            .write(move |connection| {
                rejected::record(connection, &entries).map_err(StoreError::from)
            })
            .await
            .map_err(InboxError::from)
    }

    async fn rejected(&self, page: PageRequest) -> Result<Page<RejectedDelivery>, InboxError> {
        self.read(move |connection| rejected::page(connection, page))
            .await
    }

    async fn health(&self) -> Result<InboxHealth, InboxError> {
        self.read(move |connection| views::health(connection, &clock::now()))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(id: &str, sequence: i64, amount: i64) -> OrderedMessage {
        OrderedMessage {
            message_id: id.into(),
            aggregate_id: "acct".into(),
            sequence,
            amount,
        }
    }

    #[tokio::test]
    async fn applied_messages_page_in_sequence_order_and_a_dead_letter_reads_by_id() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = SqliteInbox::open(
            &dir.path().join("inbox.db"),
            Synchronous::Normal,
            Limits::default(),
        )
        .unwrap();
        for (id, sequence, amount) in [("m-1", 1, 5), ("m-2", 2, 7), ("bad-3", 3, -1)] {
            inbox
                .deliver(message(id, sequence, amount), Door::General)
                .await
                .unwrap();
        }
        let first = inbox
            .applied_messages("acct".into(), PageRequest { after: 0, limit: 1 })
            .await
            .unwrap();
        assert_eq!(first.items.len(), 1);
        assert_eq!(first.items[0].message_id, "m-1");
        assert_eq!(first.items[0].amount, Some(5));
        assert_eq!(
            first.items[0].payload,
            serde_json::json!({"AggregateId": "acct", "Sequence": 1, "Amount": 5})
        );
        assert_eq!(first.next, Some(1));
        let rest = inbox
            .applied_messages(
                "acct".into(),
                PageRequest {
                    after: 1,
                    limit: 10,
                },
            )
            .await
            .unwrap();
        let ids: Vec<&str> = rest.items.iter().map(|m| m.message_id.as_str()).collect();
        assert_eq!((ids, rest.next), (vec!["m-2"], None));

        let poison = inbox
            .dead_letter(None, "bad-3".into())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(poison.sequence, Some(3));
        assert_eq!(poison.status, crate::DeadLetterStatus::Open);
        assert_eq!(inbox.dead_letter(None, "m-1".into()).await.unwrap(), None);
        inbox.shutdown().await;
    }

    fn message_in_a(id: &str, sequence: i64) -> OrderedMessage {
        OrderedMessage {
            message_id: id.into(),
            aggregate_id: "a".into(),
            sequence,
            amount: 1,
        }
    }

    #[tokio::test]
    async fn a_batch_is_one_unit_of_one_commit_and_each_delivery_sees_the_ones_before() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = SqliteInbox::open(
            &dir.path().join("b.db"),
            Synchronous::Normal,
            Limits::default(),
        )
        .unwrap();
        let before = inbox.store().stats();
        let batch = vec![
            BatchDelivery::anonymous(message_in_a("m-2", 2), Door::Broker),
            BatchDelivery::anonymous(message_in_a("m-1", 1), Door::Broker),
            BatchDelivery::anonymous(message_in_a("m-2", 2), Door::Broker),
        ];
        let outcomes = inbox.deliver_batch(batch).await.unwrap();
        assert!(matches!(outcomes[0], Ok(Outcome::Held { .. })));
        assert!(matches!(
            outcomes[1],
            Ok(Outcome::Applied { sequence: 1, .. })
        ));
        assert!(
            matches!(outcomes[2], Ok(Outcome::Replay { .. })),
            "{:?}",
            outcomes[2]
        );
        let after = inbox.store().stats();
        assert_eq!(
            (after.commits - before.commits, after.units - before.units),
            (1, 1)
        );
        assert_eq!(inbox.counts("a".into()).await.unwrap().last, 2);
        inbox.shutdown().await;
    }
}
