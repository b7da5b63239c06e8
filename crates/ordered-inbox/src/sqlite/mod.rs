//! The SQLite backend: [`SqliteInbox`] implements [`crate::Inbox`] on a [`Store`], the
//! single-writer SQLite store with group commit that the owner of the file may share for tables
//! of its own.
//!
//! - [`store`]: the writer thread, group commit, read connections;
//! - [`schema`]: the inbox's tables and migrations;
//! - [`handler`]: the application's handler, run in the inbox's transaction;
//! - [`engine`]: facts read, core decision, handler run and changes written, in one unit of
//!   work, for each write operation;
//! - `rows`, `facts`, `writes`: reading rows into values, the facts of each decision, the SQL
//!   of each change;
//! - [`views`]: the evidence queries;
//! - [`operators`]: the operator and producer registry commands on a file;
//! - `rejected`: the rejected list's rows.

pub mod engine;
mod facts;
pub mod handler;
pub mod operators;
mod rejected;
mod rows;
pub mod schema;
pub mod store;
pub mod views;
mod writes;

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;

pub use store::{
    BUSY_TIMEOUT, BatchCommitted, MAX_BATCH, Store, StoreError, StoreStats, Synchronous,
    WriterObserver, is_busy, is_constraint,
};

pub use handler::SqliteHandler;

use crate::clock;
use crate::content::AcceptAll;
use crate::delivery::Outcome;
use crate::inbox::{BatchDelivery, Inbox, InboxError, Undelivered};
use crate::model::{AggregateStatus, Door, Limits, OrderedMessage};
use crate::operators::{OperatorCheck, Registry};
use crate::producers::TransferRequest;
use crate::records::{ProducerClaim, ProducerRefusal, RejectedDelivery, ResolutionRecord, TransferRecord};
use crate::resolution::{Mode, ResolutionError, ResolutionRequest, Resolved};
use crate::views::{
    AggregateCounts, AggregateView, AppliedMessage, DeadLetterFilter, DeadLetterView, InboxHealth,
    InventoryEntry, OwnershipState, Page, PageRequest, ProducerView, TimelineEvent,
    TransferConflict,
};
use engine::Unit;

impl From<StoreError> for ResolutionError {
    fn from(error: StoreError) -> Self {
        ResolutionError::Store(error.into())
    }
}

/// The ordered inbox in a SQLite file, with the application's handler. Cheap to clone.
#[derive(Clone)]
pub struct SqliteInbox {
    store: Store,
    limits: Limits,
    handler: Arc<dyn SqliteHandler>,
}

impl SqliteInbox {
    /// The inbox on a store whose file was migrated with [`schema::migrate`], with the default
    /// handler ([`AcceptAll`]: every payload applies, nothing else is written).
    pub fn new(store: Store, limits: Limits) -> SqliteInbox {
        SqliteInbox::with_handler(store, limits, Arc::new(AcceptAll))
    }

    /// The inbox on a migrated store, running `handler` in its transactions. The handler's own
    /// tables live in the same file: create them in the `migrate` given to [`Store::open`].
    pub fn with_handler(
        store: Store,
        limits: Limits,
        handler: Arc<dyn SqliteHandler>,
    ) -> SqliteInbox {
        SqliteInbox {
            store,
            limits,
            handler,
        }
    }

    /// Opens (creating if needed) a file that holds only the inbox, with the default handler.
    pub fn open(
        path: &Path,
        synchronous: Synchronous,
        limits: Limits,
    ) -> Result<SqliteInbox, StoreError> {
        let store = Store::open(path, synchronous, schema::migrate)?;
        Ok(SqliteInbox::new(store, limits))
    }

    /// Runs `work` as a unit of the writer with this inbox's handler, bounds and the time now.
    async fn write<T, E, F>(&self, work: F) -> Result<T, E>
    where
        F: Fn(Unit<'_>) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
    {
        let handler = self.handler.clone();
        let limits = self.limits;
        self.store
            .write(move |connection| {
                work(Unit {
                    connection,
                    handler: handler.as_ref(),
                    limits: &limits,
                    now: &clock::now(),
                })
            })
            .await
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
        self.write(move |unit| engine::deliver_in(unit, &message, door))
            .await
            .map_err(InboxError::from)?
            .map_err(InboxError::Handler)
    }

    /// One unit of the writer (in one group commit) for the whole batch: any
    /// store failure rolls all of it back. Each delivery reads its ownership facts in that unit,
    /// after the ones before it wrote theirs, so a claim earlier in the batch binds the rest; a
    /// refusal or a handler failure writes nothing of that delivery and the next one goes on.
    async fn deliver_batch(
        &self,
        deliveries: Vec<BatchDelivery>,
    ) -> Result<Vec<Result<Outcome, Undelivered>>, InboxError> {
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        self.write(move |unit| {
            deliveries
                .iter()
                .map(|delivery| {
                    engine::deliver_as_in(
                        unit,
                        &delivery.message,
                        delivery.door,
                        delivery.claim.as_ref(),
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
        self.write(move |unit| engine::resolve_in(unit, &request, mode))
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
        let written = self
            .write(move |unit| engine::deliver_as_in(unit, &message, door, claim.as_ref()))
            .await
            .map_err(InboxError::from)?;
        match written {
            Ok(outcome) => Ok(Ok(outcome)),
            Err(Undelivered::Refused(refusal)) => Ok(Err(refusal)),
            Err(Undelivered::Handler(error)) => Err(InboxError::Handler(error)),
        }
    }

    async fn check_producer(&self, token: String) -> Result<Option<String>, InboxError> {
        self.read(move |connection| operators::holder(connection, Registry::Producers, &token))
            .await
    }

    async fn start_session(
        &self,
        producer: String,
    ) -> Result<Result<i64, ProducerRefusal>, InboxError> {
        self.store
            .write(move |connection| engine::start_session_in(connection, &producer))
            .await
            .map_err(InboxError::from)
    }

    async fn transfer_owner(
        &self,
        request: TransferRequest,
    ) -> Result<Result<TransferRecord, TransferConflict>, InboxError> {
        self.store
            .write(move |connection| engine::transfer_in(connection, &request, &clock::now()))
            .await
            .map_err(InboxError::from)
    }

    async fn ownership(&self, aggregate_id: String) -> Result<OwnershipState, InboxError> {
        self.read(move |connection| facts::ownership_state(connection, &aggregate_id))
            .await
    }

    async fn producers(&self) -> Result<Vec<ProducerView>, InboxError> {
        self.read(views::producers).await
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

