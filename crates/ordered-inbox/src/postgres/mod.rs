//! The PostgreSQL backend: [`PostgresInbox`] implements [`crate::Inbox`] on a shared PostgreSQL
//! database, so that any number of server processes serve one inbox with one authoritative
//! sequence per aggregate. [`crate::OrderedInbox::postgres`] opens one
//! ([`builder::PostgresBuilder`]).
//!
//! - [`builder`]: how an inbox is opened: its handler, bounds, access and the application's
//!   tables;
//! - [`schema`]: the inbox's tables and their versioned migrations, run under an advisory lock;
//! - [`handler`]: the application's handler, run in the operation's transaction;
//! - `writer`, `batch`: the group commit of deliveries: one queue, its writer task, one
//!   transaction per group (locks in one global order, the facts of the group in one
//!   statement, the core's decisions in arrival order, the handler's applies in one call, the
//!   rows set-based, one COMMIT; a failing delivery replayed alone in a savepoint);
//! - [`engine`]: the other write operations (resolutions, sessions, transfers, the rejected
//!   list): locks and facts read, core decision, handler run and changes written, in one
//!   transaction per operation;
//! - `rows`, `facts`, `writes`: reading rows into values, the locks and facts of each decision,
//!   the statements of each change;
//! - [`views`]: the evidence queries;
//! - [`operators`]: the operator and producer registry commands on a database;
//! - `rejected`: the rejected list's page.
//!
//! How a delivery runs: every delivery of the process (`deliver`, `deliver_as`, a broker's
//! `deliver_batch`) goes to the writer's queue; a writer takes everything waiting into one
//! transaction on a pooled connection and answers each caller after its COMMIT. Other write
//! operations take a connection of their own: `BEGIN`, transaction-scoped advisory locks on the
//! aggregate and on the message ids involved (taken before any fact is read, so the facts are
//! those the last writer of this aggregate committed), the facts, the decision of the pure
//! core, the decided changes and `COMMIT`. Statements are prepared once per connection and
//! pipelined. Serialization failures, deadlocks and unique violations (a concurrent first use
//! of the same id) roll back and are retried here with a bounded number of attempts; a database
//! that is down or restarting is [`InboxError::Unavailable`].
//!
//! Each operation and each group runs in a task of its own, so a caller that goes away (a
//! client disconnect) never leaves a transaction half-way on a pooled connection.

mod batch;
pub mod builder;
mod connection;
pub mod engine;
mod error;
mod facts;
mod gap_engine;
mod gaps;
pub mod handler;
pub mod operators;
mod rejected;
mod retention;
mod rows;
pub mod schema;
pub mod tls;
pub mod views;
mod writer;
mod writes;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{ManagerConfig, Pool, RecyclingMethod, Runtime};

pub use connection::{
    ATTEMPTS, CONNECT_TIMEOUT, Counters, Listening, POOL_SIZE, POOL_WAIT, PostgresError,
    PostgresStats, Target,
};
pub use handler::{HandlerClient, PostgresHandler, apply_one_by_one};
pub use tls::{ClientCertificate, Remote, SslMode};
pub use writer::{GROUP_CAP, WRITERS};

use connection::{Client, Failure, release_after_failure};

use crate::content::AcceptAll;
use crate::delivery::Outcome;
use crate::gaps::{GapRequest, GapResolutionError, GapResolved};
use crate::inbox::{BatchDelivery, Inbox, InboxError, InboxReads, Undelivered};
use crate::model::{AggregateStatus, Door, Limits, OrderedMessage};
use crate::operators::OperatorCheck;
use crate::producers::TransferRequest;
use crate::records::{
    GapRecord, ProducerClaim, ProducerRefusal, RejectedDelivery, ResolutionRecord, TransferRecord,
};
use crate::resolution::{Mode, ResolutionError, ResolutionRequest, Resolved};
use crate::retention::{PrunePlan, Pruned, Retained};
use crate::views::{
    AggregateCounts, AggregateView, AppliedMessage, DeadLetterFilter, DeadLetterView, InboxHealth,
    InventoryEntry, OwnershipState, Page, PageRequest, ProducerView, TimelineEvent,
    TransferConflict,
};
use batch::{Answer, Delivery};
use engine::Unit;
use writer::{Resources, Writer};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, Failure>> + Send + 'a>>;

/// The ordered inbox in a PostgreSQL database, with the application's handler. Cheap to clone:
/// clones share the pool.
#[derive(Clone)]
pub struct PostgresInbox {
    pool: Pool,
    target: Target,
    limits: Limits,
    counters: Arc<Counters>,
    handler: Arc<dyn PostgresHandler>,
    /// The group commit's queue (every delivery goes through it).
    writer: Arc<Writer>,
}

impl PostgresInbox {
    /// Checks the URL, brings the schema up to date (under an advisory lock, so servers starting
    /// together migrate once) and opens the pool.
    pub async fn connect(url: &str, limits: Limits) -> Result<PostgresInbox, PostgresError> {
        let target = Target::parse(url)?;
        PostgresInbox::open(target, limits).await
    }

    /// As [`PostgresInbox::connect`] for a checked target, with the default handler
    /// ([`AcceptAll`]).
    pub async fn open(target: Target, limits: Limits) -> Result<PostgresInbox, PostgresError> {
        PostgresInbox::open_with_handler(target, limits, Arc::new(AcceptAll)).await
    }

    /// As [`PostgresInbox::open`], running `handler` in the inbox's transactions. The handler's
    /// own tables live in the same database; the application creates them.
    pub async fn open_with_handler(
        target: Target,
        limits: Limits,
        handler: Arc<dyn PostgresHandler>,
    ) -> Result<PostgresInbox, PostgresError> {
        schema::migrate(&target).await?;
        PostgresInbox::start(target, limits, handler)
    }

    /// The pool and the group commit's writer on a database whose schema is up to date.
    fn start(
        target: Target,
        limits: Limits,
        handler: Arc<dyn PostgresHandler>,
    ) -> Result<PostgresInbox, PostgresError> {
        let manager = target.manager(ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        });
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(POOL_WAIT))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|error| PostgresError::Connect {
                target: target.description.clone(),
                reason: error.to_string(),
            })?;
        let counters = Arc::new(Counters::default());
        let writer = Writer::start(Resources {
            pool: pool.clone(),
            counters: counters.clone(),
            handler: handler.clone(),
            limits,
        });
        Ok(PostgresInbox {
            pool,
            target,
            limits,
            counters,
            handler,
            writer: Arc::new(writer),
        })
    }

    /// Where the inbox lives, without credentials.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The counters of operations, round trips, retries and group commits so far.
    pub fn stats(&self) -> PostgresStats {
        PostgresStats {
            operations: self.counters.operations.load(Ordering::Relaxed),
            round_trips: self.counters.round_trips.load(Ordering::Relaxed),
            retries: self.counters.retries.load(Ordering::Relaxed),
            group_commits: self.counters.group_commits.load(Ordering::Relaxed),
            grouped_deliveries: self.counters.grouped_deliveries.load(Ordering::Relaxed),
            replays: self.counters.replays.load(Ordering::Relaxed),
        }
    }

    /// The connection pool, for an application's own reads of its tables (a load's
    /// verification, its views) beside the inbox's.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Runs `work` as an operation with this inbox's handler, bounds and the time now.
    async fn write<T, F>(&self, work: F) -> Result<T, InboxError>
    where
        T: Send + 'static,
        F: for<'c> Fn(Unit<'c>) -> BoxFuture<'c, T> + Send + Sync + 'static,
    {
        let handler = self.handler.clone();
        let limits = self.limits;
        let work = Arc::new(work);
        self.run(move |client, counters| {
            let handler = handler.clone();
            let work = work.clone();
            Box::pin(async move {
                let now = crate::clock::now();
                let unit = Unit {
                    client,
                    counters,
                    handler: handler.as_ref(),
                    limits: &limits,
                    now: &now,
                };
                work(unit).await
            })
        })
        .await
    }

    /// One delivery through the group commit.
    async fn deliver_alone(
        &self,
        delivery: Delivery,
    ) -> Result<Result<Outcome, ProducerRefusal>, InboxError> {
        let answers: Vec<Answer> = self.writer.submit(vec![delivery]).await?;
        answers
            .into_iter()
            .next()
            .unwrap_or_else(|| Err(InboxError::Failed("a delivery went unanswered".into())))
    }

    /// Closes the pool: idle connections are dropped, later operations are unavailable.
    pub fn close(&self) {
        self.pool.close();
    }

    /// Runs `work` on a pooled connection in a task of its own, retrying what PostgreSQL asks to
    /// retry. `work` must end its transaction (COMMIT or ROLLBACK) when it succeeds; after a
    /// failure the connection is rolled back, or dropped if that fails too.
    async fn run<T, F>(&self, work: F) -> Result<T, InboxError>
    where
        T: Send + 'static,
        F: for<'c> Fn(&'c Client, &'c Counters) -> BoxFuture<'c, T> + Send + Sync + 'static,
    {
        let pool = self.pool.clone();
        let counters = self.counters.clone();
        let task = tokio::spawn(async move {
            counters.operations.fetch_add(1, Ordering::Relaxed);
            let mut attempt = 1;
            loop {
                let client = pool.get().await.map_err(Failure::Pool);
                let failure = match client {
                    Ok(client) => match work(&client, &counters).await {
                        Ok(value) => return Ok(value),
                        Err(failure) => {
                            release_after_failure(client).await;
                            failure
                        }
                    },
                    Err(failure) => failure,
                };
                if attempt >= ATTEMPTS || !failure.retryable() {
                    return Err(failure.into_inbox_error());
                }
                counters.retries.fetch_add(1, Ordering::Relaxed);
                attempt += 1;
                // A short random pause, growing with the attempts, so that the transactions
                // that collided do not collide again in lock step.
                let ceiling = 2u64 << attempt.min(6);
                let pause = rand::random_range(1..=ceiling);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
        });
        task.await
            .map_err(|error| InboxError::Failed(format!("inbox task: {error}")))?
    }
}

#[async_trait]
impl Inbox for PostgresInbox {
    async fn deliver(&self, message: OrderedMessage, door: Door) -> Result<Outcome, InboxError> {
        let delivery = Delivery {
            message,
            door,
            claim: None,
            admitted_by_owner: false,
        };
        match self.deliver_alone(delivery).await? {
            Ok(outcome) => Ok(outcome),
            // Without an ownership check nothing refuses a delivery.
            Err(refusal) => Err(InboxError::Failed(format!("refused: {refusal}"))),
        }
    }

    /// In a group commit with whatever else this server delivers at the moment, as one job:
    /// decided in order, each seeing the ones before it, all in one transaction. `Ok` means every
    /// delivery has its verdict and all of them committed; a delivery whose handler failed is
    /// rolled back alone (`Undelivered::Handler`), the others stand. After an `Err` (the database
    /// could not be reached, or a delivery failed in the store) any of them may have committed:
    /// a repeat of one that did is a replay. Each is checked as [`Inbox::deliver_as`] checks
    /// one, under the same locks (the producer's row shared).
    async fn deliver_batch(
        &self,
        deliveries: Vec<BatchDelivery>,
    ) -> Result<Vec<Result<Outcome, Undelivered>>, InboxError> {
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        let deliveries = deliveries
            .into_iter()
            .map(|delivery| Delivery {
                message: delivery.message,
                door: delivery.door,
                claim: delivery.claim,
                admitted_by_owner: true,
            })
            .collect();
        let answers = self.writer.submit(deliveries).await?;
        answers
            .into_iter()
            .map(|answer| match answer {
                Ok(Ok(outcome)) => Ok(Ok(outcome)),
                Ok(Err(refusal)) => Ok(Err(Undelivered::Refused(refusal))),
                Err(InboxError::Handler(error)) => Ok(Err(Undelivered::Handler(error))),
                Err(other) => Err(other),
            })
            .collect()
    }

    async fn resolve(
        &self,
        request: ResolutionRequest,
        mode: Mode,
    ) -> Result<Resolved, ResolutionError> {
        let request = Arc::new(request);
        self.write(move |unit| {
            let request = request.clone();
            Box::pin(async move { engine::resolve(unit, &request, mode).await })
        })
        .await?
    }

    async fn resolve_gap(
        &self,
        request: GapRequest,
        mode: Mode,
    ) -> Result<GapResolved, GapResolutionError> {
        let request = Arc::new(request);
        self.write(move |unit| {
            let request = request.clone();
            Box::pin(async move { gap_engine::resolve_gap(unit, &request, mode).await })
        })
        .await?
    }

    async fn deliver_as(
        &self,
        message: OrderedMessage,
        door: Door,
        claim: Option<ProducerClaim>,
    ) -> Result<Result<Outcome, ProducerRefusal>, InboxError> {
        let delivery = Delivery {
            message,
            door,
            claim,
            admitted_by_owner: true,
        };
        self.deliver_alone(delivery).await
    }

    async fn start_session(
        &self,
        producer: String,
    ) -> Result<Result<i64, ProducerRefusal>, InboxError> {
        self.run(move |client, counters| {
            let producer = producer.clone();
            Box::pin(async move { engine::start_session(client, counters, &producer).await })
        })
        .await
    }

    async fn transfer_owner(
        &self,
        request: TransferRequest,
    ) -> Result<Result<TransferRecord, TransferConflict>, InboxError> {
        self.run(move |client, counters| {
            let request = request.clone();
            Box::pin(async move { engine::transfer(client, counters, &request).await })
        })
        .await
    }

    async fn record_rejected(&self, entries: Vec<RejectedDelivery>) -> Result<(), InboxError> {
        if entries.is_empty() {
            return Ok(());
        }
        self.run(move |client, counters| {
            let entries = entries.clone();
            Box::pin(async move { engine::record_rejected(client, counters, &entries).await })
        })
        .await
    }

    async fn prune(&self, plan: PrunePlan) -> Result<Pruned, InboxError> {
        self.run(move |client, counters| {
            let plan = plan.clone();
            Box::pin(async move { retention::prune(client, counters, &plan).await })
        })
        .await
    }

    fn reads(&self) -> &dyn InboxReads {
        self
    }
}

#[async_trait]
impl InboxReads for PostgresInbox {
    async fn gap_resolutions(
        &self,
        aggregate_id: Option<String>,
        page: PageRequest,
    ) -> Result<Page<GapRecord>, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move {
                gaps::gap_resolutions(client, counters, aggregate_id.as_deref(), page).await
            })
        })
        .await
    }

    async fn check_operator(&self, token: Option<String>) -> Result<OperatorCheck, InboxError> {
        self.run(move |client, counters| {
            let token = token.clone();
            Box::pin(async move { operators::check(client, counters, token.as_deref()).await })
        })
        .await
    }

    async fn aggregate(&self, aggregate_id: String) -> Result<Option<AggregateView>, InboxError> {
        let handler = self.handler.clone();
        self.run(move |client, counters| {
            let (aggregate_id, handler) = (aggregate_id.clone(), handler.clone());
            Box::pin(async move {
                views::aggregate_view(client, counters, handler.as_ref(), &aggregate_id).await
            })
        })
        .await
    }

    async fn inventory(
        &self,
        status: AggregateStatus,
        limit: i64,
    ) -> Result<Vec<InventoryEntry>, InboxError> {
        let handler = self.handler.clone();
        self.run(move |client, counters| {
            let handler = handler.clone();
            Box::pin(async move {
                views::inventory(client, counters, handler.as_ref(), status, limit).await
            })
        })
        .await
    }

    async fn lowest_held_payloads(
        &self,
        aggregate_ids: Vec<String>,
    ) -> Result<Vec<(String, String)>, InboxError> {
        self.run(move |client, counters| {
            let aggregate_ids = aggregate_ids.clone();
            Box::pin(
                async move { views::lowest_held_payloads(client, counters, &aggregate_ids).await },
            )
        })
        .await
    }

    async fn dead_letters(
        &self,
        filter: DeadLetterFilter,
        page: PageRequest,
    ) -> Result<Page<DeadLetterView>, InboxError> {
        self.run(move |client, counters| {
            let filter = filter.clone();
            Box::pin(async move { views::dead_letters(client, counters, &filter, page).await })
        })
        .await
    }

    async fn timeline(
        &self,
        aggregate_id: String,
        page: PageRequest,
    ) -> Result<Page<TimelineEvent>, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move { views::timeline(client, counters, &aggregate_id, page).await })
        })
        .await
    }

    async fn resolutions(
        &self,
        aggregate_id: Option<String>,
        page: PageRequest,
    ) -> Result<Page<ResolutionRecord>, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move {
                views::resolutions(client, counters, aggregate_id.as_deref(), page).await
            })
        })
        .await
    }

    async fn counts(&self, aggregate_id: String) -> Result<AggregateCounts, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move { views::counts(client, counters, &aggregate_id).await })
        })
        .await
    }

    async fn applied_messages(
        &self,
        aggregate_id: String,
        page: PageRequest,
    ) -> Result<Page<AppliedMessage>, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(
                async move { views::applied_messages(client, counters, &aggregate_id, page).await },
            )
        })
        .await
    }

    async fn dead_letter(
        &self,
        producer: Option<String>,
        message_id: String,
    ) -> Result<Option<DeadLetterView>, InboxError> {
        self.run(move |client, counters| {
            let producer = producer.clone();
            let message_id = message_id.clone();
            Box::pin(async move {
                views::dead_letter(client, counters, producer.as_deref(), &message_id).await
            })
        })
        .await
    }

    async fn check_producer(&self, token: String) -> Result<Option<String>, InboxError> {
        self.run(move |client, counters| {
            let token = token.clone();
            Box::pin(async move { operators::producer(client, counters, &token).await })
        })
        .await
    }

    async fn ownership(&self, aggregate_id: String) -> Result<OwnershipState, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move { facts::ownership(client, counters, &aggregate_id).await })
        })
        .await
    }

    async fn producers(&self) -> Result<Vec<ProducerView>, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { views::producers(client, counters).await })
        })
        .await
    }

    async fn rejected(&self, page: PageRequest) -> Result<Page<RejectedDelivery>, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { rejected::page(client, counters, page).await })
        })
        .await
    }

    async fn health(&self) -> Result<InboxHealth, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { views::health(client, counters).await })
        })
        .await
    }

    async fn retained(&self) -> Result<Retained, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { retention::retained(client, counters).await })
        })
        .await
    }
}
