//! The SQLite backend: [`SqliteInbox`] implements [`crate::Inbox`] on a [`Store`], the
//! single-writer SQLite store with group commit that the owner of the file may share for tables
//! of its own. [`crate::OrderedInbox::sqlite`] opens one ([`builder::SqliteBuilder`]).
//!
//! - [`builder`]: how an inbox is opened: its handler, bounds and the application's tables;
//! - [`store`]: the writer thread, group commit, read connections;
//! - [`connection`]: the writer's connection, with statements prepared once for its life;
//! - [`schema`]: the inbox's tables and migrations;
//! - [`handler`]: the application's handler, run in the inbox's transaction;
//! - [`engine`]: facts read, core decision, handler run and changes written, in one unit of
//!   work, for each write operation;
//! - `rows`, `facts`, `writes`: reading rows into values, the facts of each decision, the SQL
//!   of each change;
//! - [`views`]: the evidence queries;
//! - [`operators`]: the operator and producer registry commands on a file;
//! - `rejected`: the rejected list's rows.

pub mod builder;
pub mod connection;
pub mod engine;
mod facts;
mod gap_engine;
pub mod gaps;
pub mod handler;
pub mod operators;
mod rejected;
mod retention;
mod rows;
pub mod schema;
pub mod store;
#[cfg(test)]
pub(crate) mod testing;
pub mod views;
mod writes;

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;

pub use store::{
    BUSY_TIMEOUT, BatchCommitted, MAX_BATCH, Store, StoreError, StoreStats, Synchronous,
    WriterObserver, is_busy, is_constraint,
};

pub use connection::{WriterConnection, WriterStatement};
pub use handler::SqliteHandler;

use crate::clock;
use crate::content::AcceptAll;
use crate::delivery::Outcome;
use crate::gaps::{GapRequest, GapResolutionError, GapResolved};
use crate::inbox::{BatchDelivery, Inbox, InboxError, InboxReads, Undelivered};
use crate::model::{AggregateStatus, Door, Limits, OrderedMessage};
use crate::operators::{OperatorCheck, Registry};
use crate::producers::TransferRequest;
use crate::records::{
    GapRecord, ProducerClaim, ProducerRefusal, RejectedDelivery, ResolutionRecord, TransferRecord,
};
use crate::resolution::{Mode, ResolutionError, ResolutionRequest, Resolved};
use crate::retention::{PrunePlan, Pruned, Retained};
use crate::views::{
    AggregateCounts, AggregateView, AppliedMessage, DeadLetterFilter, DeadLetterView, InboxHealth,
    InventoryEntry, OwnershipState, Page, PageRequest, ProducerView, Summaries, TimelineEvent,
    TransferConflict,
};
use engine::Unit;

impl From<StoreError> for GapResolutionError {
    fn from(error: StoreError) -> Self {
        GapResolutionError::Store(error.into())
    }
}

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
        F: Fn(Unit<'_, '_>) -> Result<T, E> + Send + 'static,
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

    /// The store the inbox lives in, for the application's own reads and writes.
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

    /// Reads the summaries `work` finds, each with the handler's `state` of its aggregate, in
    /// one read transaction: the inbox's rows and the handler's tables as of one snapshot.
    async fn read_stated<T, F>(&self, work: F) -> Result<T, InboxError>
    where
        F: FnOnce(&rusqlite::Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Summaries + Send + 'static,
    {
        let handler = self.handler.clone();
        self.store
            .read(move |connection| {
                let snapshot = connection
                    .unchecked_transaction()
                    .map_err(StoreError::from)?;
                let mut found = work(&snapshot).map_err(StoreError::from)?;
                views::add_states(&snapshot, handler.as_ref(), &mut found)
                    .map_err(InboxError::Handler)?;
                snapshot.commit().map_err(StoreError::from)?;
                Ok(found)
            })
            .await
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

    async fn resolve_gap(
        &self,
        request: GapRequest,
        mode: Mode,
    ) -> Result<GapResolved, GapResolutionError> {
        self.write(move |unit| gap_engine::resolve_gap_in(unit, &request, mode))
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

    async fn prune(&self, plan: PrunePlan) -> Result<Pruned, InboxError> {
        self.store
            .write(move |connection| retention::prune(connection, &plan).map_err(StoreError::from))
            .await
            .map_err(InboxError::from)
    }

    fn reads(&self) -> &dyn InboxReads {
        self
    }
}

#[async_trait]
impl InboxReads for SqliteInbox {
    async fn gap_resolutions(
        &self,
        aggregate_id: Option<String>,
        page: PageRequest,
    ) -> Result<Page<GapRecord>, InboxError> {
        self.read(move |connection| {
            gaps::gap_resolutions(connection, aggregate_id.as_deref(), page)
        })
        .await
    }

    async fn check_operator(&self, token: Option<String>) -> Result<OperatorCheck, InboxError> {
        self.read(move |connection| operators::check(connection, token.as_deref()))
            .await
    }

    async fn aggregate(&self, aggregate_id: String) -> Result<Option<AggregateView>, InboxError> {
        self.read_stated(move |connection| views::aggregate_view(connection, &aggregate_id))
            .await
    }

    async fn inventory(
        &self,
        status: AggregateStatus,
        limit: i64,
    ) -> Result<Vec<InventoryEntry>, InboxError> {
        self.read_stated(move |connection| {
            views::inventory(connection, status, &clock::now(), limit)
        })
        .await
    }

    async fn lowest_held_payloads(
        &self,
        aggregate_ids: Vec<String>,
    ) -> Result<Vec<(String, String)>, InboxError> {
        self.read(move |connection| views::lowest_held_payloads(connection, &aggregate_ids))
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

    async fn check_producer(&self, token: String) -> Result<Option<String>, InboxError> {
        self.read(move |connection| operators::holder(connection, Registry::Producers, &token))
            .await
    }

    async fn ownership(&self, aggregate_id: String) -> Result<OwnershipState, InboxError> {
        self.read(move |connection| facts::ownership_state(connection, &aggregate_id))
            .await
    }

    async fn producers(&self) -> Result<Vec<ProducerView>, InboxError> {
        self.read(views::producers).await
    }

    async fn rejected(&self, page: PageRequest) -> Result<Page<RejectedDelivery>, InboxError> {
        self.read(move |connection| rejected::page(connection, page))
            .await
    }

    async fn health(&self) -> Result<InboxHealth, InboxError> {
        self.read(move |connection| views::health(connection, &clock::now()))
            .await
    }

    async fn retained(&self) -> Result<Retained, InboxError> {
        let path = self.store.path().to_owned();
        self.read(move |connection| retention::retained(connection, &path))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{AggregateOwner, TransferRefusal};
    use crate::sqlite::operators::add_to;
    use crate::sqlite::testing::{ORDER_TABLES, Orders, order};

    fn message(id: &str, sequence: i64, quantity: i64) -> OrderedMessage {
        order(id, "acct", sequence, quantity)
    }

    /// An inbox whose file holds the order book too, with the order book's handler.
    fn order_book(path: &Path) -> SqliteInbox {
        let store = Store::open(path, Synchronous::Normal, |connection| {
            schema::migrate(connection)?;
            connection.execute_batch(ORDER_TABLES)
        })
        .unwrap();
        SqliteInbox::with_handler(store, Limits::default(), Arc::new(Orders))
    }

    /// Runs one statement on the order book's file through the writer (an outage begins or ends).
    async fn execute(inbox: &SqliteInbox, sql: &'static str) {
        inbox
            .store()
            .write(move |connection| connection.execute(sql, []).map_err(StoreError::from))
            .await
            .unwrap();
    }

    async fn scalar(inbox: &SqliteInbox, sql: &'static str) -> i64 {
        inbox
            .store()
            .read(move |connection| {
                connection
                    .query_row(sql, [], |row| row.get(0))
                    .map_err(StoreError::from)
            })
            .await
            .unwrap()
    }

    /// Prunes every applied identity there is now, in batches of `batch`.
    async fn prune_all_identities(inbox: &SqliteInbox, batch: usize) -> u64 {
        let retention = crate::retention::Retention {
            identities: Some(std::time::Duration::ZERO),
            timeline: None,
            dead_letters: None,
        };
        // A cut-off just past now: every identity applied so far is older.
        let now = clock::format_millis(
            clock::millis_between("1970-01-01T00:00:00.000Z", &clock::now()).unwrap() + 1,
        );
        let mut total = 0;
        loop {
            let plan = crate::retention::plan_batch(&retention, &now, None, batch);
            let pruned = inbox.prune(plan).await.unwrap();
            total += pruned.identities;
            if !pruned.more {
                return total;
            }
        }
    }

    #[tokio::test]
    async fn a_pruned_identity_answers_stale_on_both_doors_and_its_position_stays() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = order_book(&dir.path().join("inbox.db"));
        for sequence in 1..=5 {
            let id = format!("m-{sequence}");
            inbox
                .deliver(message(&id, sequence, 1), Door::General)
                .await
                .unwrap();
        }
        assert_eq!(prune_all_identities(&inbox, 2).await, 5);
        assert_eq!(
            scalar(&inbox, "SELECT COUNT(*) FROM ordered_inbox").await,
            0
        );
        for door in [Door::General, Door::Broker] {
            let again = inbox.deliver(message("m-3", 3, 1), door).await.unwrap();
            assert!(
                matches!(again, Outcome::Stale { expected: 6, .. }),
                "{door:?}: {again:?}"
            );
        }
        assert_eq!(scalar(&inbox, "SELECT COUNT(*) FROM orders").await, 5);
        assert_eq!(
            scalar(
                &inbox,
                "SELECT last_sequence FROM aggregate_state WHERE aggregate_id = 'acct'"
            )
            .await,
            5
        );
        let next = inbox
            .deliver(message("m-6", 6, 1), Door::General)
            .await
            .unwrap();
        assert!(
            matches!(next, Outcome::Applied { sequence: 6, .. }),
            "{next:?}"
        );
    }

    #[tokio::test]
    async fn pruning_concurrent_with_deliveries_applies_every_sequence_once() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = Arc::new(order_book(&dir.path().join("inbox.db")));
        let deliveries = (0..4).map(|aggregate| {
            let inbox = inbox.clone();
            tokio::spawn(async move {
                for sequence in 1..=200 {
                    let message = order(
                        &format!("a{aggregate}-{sequence}"),
                        &format!("acct-{aggregate}"),
                        sequence,
                        1,
                    );
                    // Each message twice: the second is a replay or, once pruned, stale.
                    for _ in 0..2 {
                        let outcome = inbox.deliver(message.clone(), Door::General).await.unwrap();
                        assert!(
                            matches!(
                                outcome,
                                Outcome::Applied { .. }
                                    | Outcome::Replay { .. }
                                    | Outcome::Stale { .. }
                            ),
                            "{outcome:?}"
                        );
                    }
                }
            })
        });
        let deliveries: Vec<_> = deliveries.collect();
        let mut pruned = 0;
        while !deliveries.iter().all(|task| task.is_finished()) {
            pruned += prune_all_identities(&inbox, 7).await;
            tokio::task::yield_now().await;
        }
        for task in deliveries {
            task.await.unwrap();
        }
        pruned += prune_all_identities(&inbox, 7).await;
        assert_eq!(pruned, 800);
        assert_eq!(scalar(&inbox, "SELECT COUNT(*) FROM orders").await, 800);
        assert_eq!(
            scalar(&inbox, "SELECT COUNT(DISTINCT message_id) FROM orders").await,
            800
        );
        assert_eq!(
            scalar(&inbox, "SELECT SUM(last_sequence) FROM aggregate_state").await,
            800
        );
    }

    #[tokio::test]
    async fn compaction_keeps_the_newest_events_of_an_aggregate() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = order_book(&dir.path().join("inbox.db"));
        // Ten stale observations and a gap: timeline rows of their own.
        inbox
            .deliver(message("m-1", 1, 1), Door::General)
            .await
            .unwrap();
        for n in 0..10 {
            inbox
                .deliver(message(&format!("s-{n}"), 1, 1), Door::General)
                .await
                .unwrap();
        }
        let before = scalar(&inbox, "SELECT COUNT(*) FROM aggregate_timeline").await;
        assert!(before >= 10, "{before}");
        let retention = crate::retention::Retention {
            identities: None,
            timeline: Some(3),
            dead_letters: None,
        };
        let mut cursor = None;
        loop {
            let plan = crate::retention::plan_batch(&retention, &clock::now(), cursor, 8);
            let pruned = inbox.prune(plan).await.unwrap();
            cursor = pruned.timeline_cursor;
            if !pruned.more {
                break;
            }
        }
        assert_eq!(
            scalar(&inbox, "SELECT COUNT(*) FROM aggregate_timeline").await,
            3
        );
        assert_eq!(
            scalar(
                &inbox,
                "SELECT COUNT(*) FROM aggregate_timeline
                  WHERE id >= (SELECT MAX(id) - 2 FROM aggregate_timeline)"
            )
            .await,
            3
        );
        let retained = inbox.retained().await.unwrap();
        assert!(retained.bytes > 0);
        assert!(retained.oldest_identity.is_some());
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
        for (id, sequence, quantity) in [("m-1", 1, 5), ("m-2", 2, 7)] {
            inbox
                .deliver(message(id, sequence, quantity), Door::General)
                .await
                .unwrap();
        }
        let first = inbox
            .applied_messages("acct".into(), PageRequest { after: 0, limit: 1 })
            .await
            .unwrap();
        assert_eq!(first.items.len(), 1);
        assert_eq!(first.items[0].message_id, "m-1");
        assert_eq!(first.items[0].sequence, Some(1));
        assert_eq!(first.items[0].payload, serde_json::json!({"quantity": 5}));
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

        inbox.shutdown().await;
        // The order book's handler finds a negative quantity poison.
        let books = order_book(&dir.path().join("orders.db"));
        books
            .deliver(message("m-1", 1, 5), Door::General)
            .await
            .unwrap();
        books
            .deliver(message("bad-2", 2, -1), Door::General)
            .await
            .unwrap();
        let poison = books
            .dead_letter(None, "bad-2".into())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(poison.sequence, Some(2));
        assert_eq!(poison.status, crate::model::DeadLetterStatus::Open);
        assert_eq!(poison.reason.as_str(), "negative quantity");
        assert_eq!(books.dead_letter(None, "m-1".into()).await.unwrap(), None);
        books.shutdown().await;
    }

    fn message_in_a(id: &str, sequence: i64) -> OrderedMessage {
        order(id, "a", sequence, 1)
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

    fn in_aggregate(id: &str, aggregate: &str, sequence: i64) -> OrderedMessage {
        order(id, aggregate, sequence, 1)
    }

    fn claim(producer: &str, epoch: i64) -> Option<ProducerClaim> {
        Some(ProducerClaim {
            producer: producer.into(),
            epoch,
        })
    }

    #[tokio::test]
    async fn a_claim_a_fence_and_a_transfer_are_written_in_the_delivery_unit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let inbox = SqliteInbox::open(&path, Synchronous::Normal, Limits::default()).unwrap();
        let billing_token = add_to(Registry::Producers, &path, "billing").unwrap();
        add_to(Registry::Producers, &path, "shipping").unwrap();
        crate::sqlite::operators::add(&path, "alice").unwrap();
        assert_eq!(
            inbox
                .check_producer(billing_token)
                .await
                .unwrap()
                .as_deref(),
            Some("billing")
        );
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(1));
        assert_eq!(inbox.start_session("shipping".into()).await.unwrap(), Ok(1));

        let first = inbox
            .deliver_as(
                in_aggregate("m-1", "acct", 1),
                Door::General,
                claim("billing", 1),
            )
            .await
            .unwrap();
        assert!(matches!(first, Ok(Outcome::Applied { sequence: 1, .. })));
        let state = inbox.ownership("acct".into()).await.unwrap();
        assert_eq!(
            state.owner,
            Some(AggregateOwner {
                producer: "billing".into(),
                epoch: 1
            })
        );
        assert_eq!(
            inbox
                .deliver_as(
                    in_aggregate("m-1", "acct", 2),
                    Door::General,
                    claim("shipping", 1)
                )
                .await
                .unwrap(),
            Err(ProducerRefusal::NotOwner {
                owner: "billing".into()
            })
        );
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(2));
        assert_eq!(
            inbox
                .deliver_as(
                    in_aggregate("m-2", "acct", 2),
                    Door::General,
                    claim("billing", 1)
                )
                .await
                .unwrap(),
            Err(ProducerRefusal::Fenced {
                offered: 1,
                current_epoch: 2
            })
        );
        assert_eq!(inbox.counts("acct".into()).await.unwrap().last, 1);

        let request = TransferRequest {
            aggregate_id: "acct".into(),
            operator: "alice".into(),
            producer: "shipping".into(),
            expected_owner: Some("billing".into()),
            expected_last: 0,
            reason: "billing retired".into(),
        };
        let stale = inbox.transfer_owner(request.clone()).await.unwrap();
        assert_eq!(
            stale.map_err(|conflict| (conflict.refusal, conflict.current.last)),
            Err((TransferRefusal::LastMismatch, 1))
        );
        let record = inbox
            .transfer_owner(TransferRequest {
                expected_last: 1,
                ..request
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(record.from_owner.as_deref(), Some("billing"));
        assert_eq!(
            inbox
                .deliver_as(
                    in_aggregate("m-2", "acct", 2),
                    Door::General,
                    claim("billing", 2)
                )
                .await
                .unwrap(),
            Err(ProducerRefusal::NotOwner {
                owner: "shipping".into()
            })
        );
        let listed = inbox.producers().await.unwrap();
        let counts: Vec<(&str, i64, i64)> = listed
            .iter()
            .map(|p| (p.name.as_str(), p.current_epoch, p.owned_aggregates))
            .collect();
        assert_eq!(counts, [("billing", 2, 0), ("shipping", 1, 1)]);
        assert!(listed[0].last_delivery_at.is_some());
        inbox.shutdown().await;
    }

    #[tokio::test]
    async fn a_batch_checks_each_claim_in_its_unit_and_a_refusal_never_stops_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.db");
        let inbox = SqliteInbox::open(&path, Synchronous::Normal, Limits::default()).unwrap();
        add_to(Registry::Producers, &path, "billing").unwrap();
        add_to(Registry::Producers, &path, "shipping").unwrap();
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(1));
        assert_eq!(inbox.start_session("shipping".into()).await.unwrap(), Ok(1));
        let by = |message: OrderedMessage, who: Option<ProducerClaim>| BatchDelivery {
            message,
            door: Door::Broker,
            claim: who,
        };
        let before = inbox.store().stats();
        let verdicts = inbox
            .deliver_batch(vec![
                // billing claims `acct` with its first message; the rest of the batch sees it.
                by(in_aggregate("m-1", "acct", 1), claim("billing", 1)),
                by(in_aggregate("s-2", "acct", 2), claim("shipping", 1)),
                by(in_aggregate("x-2", "acct", 2), None),
                by(in_aggregate("m-2", "acct", 2), claim("billing", 1)),
                // the same id, another producer, another aggregate: another message.
                by(in_aggregate("m-1", "ship", 1), claim("shipping", 1)),
                // a producer's message ahead of its turn is held, under its epoch.
                by(in_aggregate("m-4", "acct", 4), claim("billing", 1)),
            ])
            .await
            .unwrap();
        let after = inbox.store().stats();
        assert_eq!(
            after.commits - before.commits,
            1,
            "one COMMIT for the batch"
        );
        assert!(matches!(
            verdicts[0],
            Ok(Outcome::Applied { sequence: 1, .. })
        ));
        assert_eq!(
            verdicts[1],
            Err(Undelivered::Refused(ProducerRefusal::NotOwner {
                owner: "billing".into()
            }))
        );
        assert_eq!(
            verdicts[2],
            Err(Undelivered::Refused(ProducerRefusal::OwnerRequired))
        );
        assert!(matches!(
            verdicts[3],
            Ok(Outcome::Applied { sequence: 2, .. })
        ));
        assert!(matches!(
            verdicts[4],
            Ok(Outcome::Applied { sequence: 1, .. })
        ));
        assert_eq!(
            verdicts[5],
            Ok(Outcome::Held {
                expected: 3,
                held: 1,
                repeated: false
            })
        );
        let acct = inbox.aggregate("acct".into()).await.unwrap().unwrap();
        assert_eq!((acct.summary.last, acct.held_count), (2, 1));

        // A new session fences the older epoch for every message of a later batch.
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(2));
        let verdicts = inbox
            .deliver_batch(vec![
                by(in_aggregate("m-3", "acct", 3), claim("billing", 1)),
                by(in_aggregate("m-3b", "acct", 3), claim("billing", 2)),
            ])
            .await
            .unwrap();
        assert_eq!(
            verdicts[0],
            Err(Undelivered::Refused(ProducerRefusal::Fenced {
                offered: 1,
                current_epoch: 2
            }))
        );
        assert!(matches!(
            verdicts[1],
            Ok(Outcome::Applied { sequence: 3, .. })
        ));
        assert_eq!(inbox.counts("acct".into()).await.unwrap().last, 3);
        // The held m-4 was sent under epoch 1: the drain after 3 refuses it as fenced.
        let acct = inbox.aggregate("acct".into()).await.unwrap().unwrap();
        assert_eq!((acct.summary.last, acct.held_count), (3, 0));
        let rejected = inbox
            .rejected(PageRequest {
                after: 0,
                limit: 10,
            })
            .await
            .unwrap()
            .items;
        assert!(
            rejected
                .iter()
                .any(|entry| entry.message_id.as_deref() == Some("m-4")
                    && entry.producer.as_deref() == Some("billing")
                    && entry.outcome == "fenced"),
            "{rejected:?}"
        );
        inbox.shutdown().await;
    }

    #[tokio::test]
    async fn a_handler_error_in_one_delivery_of_a_batch_leaves_the_others_applied_and_it_applies_once_when_retried()
     {
        let dir = tempfile::tempdir().unwrap();
        let inbox = order_book(&dir.path().join("o.db"));
        execute(&inbox, "INSERT INTO outage(aggregate_id) VALUES ('b')").await;
        let batch = |ids: [(&str, &str); 3]| {
            ids.map(|(id, aggregate)| {
                BatchDelivery::anonymous(order(id, aggregate, 1, 2), Door::Broker)
            })
            .to_vec()
        };
        let before = inbox.store().stats();
        let verdicts = inbox
            .deliver_batch(batch([("a-1", "a"), ("b-1", "b"), ("c-1", "c")]))
            .await
            .unwrap();
        assert!(matches!(verdicts[0], Ok(Outcome::Applied { .. })));
        assert_eq!(
            verdicts[1],
            Err(Undelivered::Handler(crate::HandlerError::new(
                "the order book is unavailable"
            )))
        );
        assert!(matches!(verdicts[2], Ok(Outcome::Applied { .. })));
        let after = inbox.store().stats();
        assert_eq!(
            (
                after.commits - before.commits,
                after.replayed - before.replayed
            ),
            (1, 1),
            "one commit: the failure sent the bare attempt to the replay, where it stayed inside its delivery"
        );
        assert_eq!(
            scalar(
                &inbox,
                "SELECT COUNT(*) FROM orders WHERE aggregate_id = 'b'"
            )
            .await,
            0
        );
        assert_eq!(inbox.counts("b".into()).await.unwrap().applied, 0);
        assert_eq!(scalar(&inbox, "SELECT COUNT(*) FROM orders").await, 2);

        execute(&inbox, "DELETE FROM outage").await;
        let retried = inbox
            .deliver_batch(batch([("a-1", "a"), ("b-1", "b"), ("c-1", "c")]))
            .await
            .unwrap();
        assert!(matches!(retried[0], Ok(Outcome::Replay { .. })));
        assert!(matches!(
            retried[1],
            Ok(Outcome::Applied { sequence: 1, .. })
        ));
        assert!(matches!(retried[2], Ok(Outcome::Replay { .. })));
        assert_eq!(
            scalar(
                &inbox,
                "SELECT COUNT(*) FROM orders WHERE aggregate_id = 'b'"
            )
            .await,
            1
        );
        assert_eq!(scalar(&inbox, "SELECT COUNT(*) FROM orders").await, 3);
        inbox.shutdown().await;
    }

    #[tokio::test]
    async fn a_handler_error_fails_a_single_delivery_without_failing_its_group_commit() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = order_book(&dir.path().join("g.db"));
        execute(&inbox, "INSERT INTO outage(aggregate_id) VALUES ('b')").await;
        let (failed, applied) = tokio::join!(
            inbox.deliver(order("b-1", "b", 1, 1), Door::General),
            inbox.deliver(order("a-1", "a", 1, 1), Door::General),
        );
        assert_eq!(
            failed,
            Err(InboxError::Handler(crate::HandlerError::new(
                "the order book is unavailable"
            )))
        );
        assert!(matches!(applied, Ok(Outcome::Applied { .. })));
        // The failure sent its batch's bare attempt to the replay once (whether or not the two
        // deliveries shared a batch); the other delivery applied either way.
        assert_eq!(inbox.store().stats().replayed, 1);
        assert_eq!(scalar(&inbox, "SELECT COUNT(*) FROM orders").await, 1);
        inbox.shutdown().await;
    }

    /// SQLite prepares a statement again at every bind of a bare `LIMIT ?N` or `OFFSET ?N` (it
    /// plans with the value), so every statement of this backend writes its bound as `+?N`.
    #[test]
    fn no_statement_of_the_sqlite_backend_binds_a_bare_limit_or_offset() {
        let directory = concat!(env!("CARGO_MANIFEST_DIR"), "/src/sqlite");
        let mut read = 0;
        for entry in std::fs::read_dir(directory).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|extension| extension != "rs") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            read += 1;
            // The statements the backend runs: not its tests' own, nor its comments.
            let code = source.split("\nmod tests {").next().unwrap_or(&source);
            let lines = code.lines().enumerate();
            for (number, line) in lines.filter(|(_, line)| !line.trim_start().starts_with("//")) {
                assert!(
                    !["LIMIT ?", "OFFSET ?"]
                        .iter()
                        .any(|bare| line.contains(bare)),
                    "{}:{}: {line}",
                    path.display(),
                    number + 1
                );
            }
        }
        assert!(read >= 10, "only {read} files read in {directory}");
    }

    #[test]
    fn a_limit_written_as_an_expression_is_prepared_once_whatever_it_is_bound_to() {
        let connection = rusqlite::Connection::open_in_memory().unwrap();
        connection
            .execute_batch(
                "CREATE TABLE t(id INTEGER PRIMARY KEY); INSERT INTO t VALUES (1), (2), (3);",
            )
            .unwrap();
        let limited: Vec<i64> = connection
            .prepare("SELECT id FROM t ORDER BY id LIMIT +?1")
            .unwrap()
            .query_map([2], |row| row.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            limited,
            [1, 2],
            "the expression limits as the bare parameter does"
        );
        let limit = |limit: i64| vec![limit.into()];
        let again = |sql| connection::times_prepared_again(&connection, sql, &limit, &[1, 2, 3]);
        assert_eq!(again("SELECT id FROM t ORDER BY id LIMIT +?1"), Ok(0));
        assert!(
            again("SELECT id FROM t ORDER BY id LIMIT ?1").is_ok_and(|count| count >= 1),
            "a bare limit is prepared again at a new bind"
        );
    }
}
