//! The PostgreSQL backend: [`PostgresInbox`] implements [`crate::Inbox`] on a shared PostgreSQL
//! database, so that any number of server processes serve one inbox with one authoritative
//! sequence per aggregate.
//!
//! - [`schema`]: the inbox's tables and their versioned migrations, run under an advisory lock;
//! - [`engine`]: facts read, core decision, changes written, in one transaction per operation;
//! - [`views`]: the evidence queries;
//! - [`operators`]: the operator commands on a database;
//! - `rejected`: the rejected list's page.
//!
//! How an operation runs: a connection from a small pool, `BEGIN`, transaction-scoped advisory
//! locks on the aggregate and on the message ids involved (taken before any fact is read, so the
//! facts are those the last writer of this aggregate committed), the facts, the decision of the
//! pure core, the decided changes and `COMMIT`. Statements are prepared once per connection and
//! pipelined: a delivery costs two round trips (BEGIN, locks and facts in one flight; the writes
//! and COMMIT in the next). Serialization failures, deadlocks and unique violations (a
//! concurrent first use of the same id) roll back and are retried here with a bounded number of
//! attempts; a database that is down or restarting is [`InboxError::Unavailable`].
//!
//! Each operation runs in a task of its own, so a caller that goes away (a client disconnect)
//! never leaves a transaction half-way on a pooled connection.

pub mod engine;
pub mod operators;
mod rejected;
pub mod schema;
pub mod views;

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use tokio_postgres::config::Host;

use crate::delivery::Outcome;
use crate::inbox::{BatchDelivery, Inbox, InboxError};
use crate::model::{AggregateStatus, Door, Limits, OrderedMessage, UnknownValue};
use crate::operators::OperatorCheck;
use crate::producers::{ProducerClaim, ProducerRefusal, TransferRecord, TransferRequest};
use crate::rejected::RejectedDelivery;
use crate::resolution::{Mode, ResolutionError, ResolutionRequest, Resolved};
use crate::views::{
    AggregateCounts, AggregateView, AppliedMessage, DeadLetterFilter, DeadLetterView, InboxHealth,
    InventoryEntry, Page, PageRequest, ResolutionRecord, TimelineEvent,
};
use crate::views::{OwnershipState, ProducerView, TransferConflict};

/// Connections each server process keeps to the database at most.
pub const POOL_SIZE: usize = 16;
/// Attempts of one operation when PostgreSQL asks for a retry (serialization failure, deadlock,
/// a unique violation from a concurrent first delivery) or a pooled connection turns out closed.
pub const ATTEMPTS: u32 = 8;
/// How long opening a connection may take before the store counts as unavailable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an operation waits for a free pooled connection.
pub const POOL_WAIT: Duration = Duration::from_secs(10);

/// Why the PostgreSQL inbox could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostgresError {
    #[error(
        "invalid PostgreSQL URL: {0} (expected postgres://USER@127.0.0.1:PORT/DATABASE or a Unix socket directory)"
    )]
    BadUrl(String),
    #[error(
        "refusing to use PostgreSQL at '{0}': only loopback hosts (127.0.0.1, ::1, localhost) or a Unix socket directory are accepted"
    )]
    NotLocal(String),
    #[error("PostgreSQL at {target}: {reason}")]
    Connect { target: String, reason: String },
    #[error(
        "PostgreSQL at {target}: the ordered inbox has schema version {found}, newer than this build's {known}"
    )]
    NewerSchema {
        target: String,
        found: i64,
        known: i64,
    },
}

/// A checked connection target: loopback or a Unix socket directory, never anything else.
#[derive(Clone)]
pub struct Target {
    config: tokio_postgres::Config,
    /// `user@host:port/database`, without any password: safe to print.
    description: String,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

impl Target {
    /// Parses a `postgres://` (or `postgresql://`) URL and insists on a loopback host or a Unix
    /// socket directory. The URL's password, if any, never appears in an error or a description.
    pub fn parse(url: &str) -> Result<Target, PostgresError> {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(PostgresError::BadUrl(
                "it must start with postgres:// or postgresql://".to_owned(),
            ));
        }
        let mut config = tokio_postgres::Config::from_str(url).map_err(|error| {
            // tokio-postgres's messages name the offending part, not the whole URL.
            PostgresError::BadUrl(error.to_string())
        })?;
        let hosts = config.get_hosts();
        if hosts.is_empty() && config.get_hostaddrs().is_empty() {
            return Err(PostgresError::BadUrl(
                "it names no host: give 127.0.0.1, ::1, localhost or a socket directory".to_owned(),
            ));
        }
        for host in hosts {
            match host {
                Host::Tcp(name) if is_loopback_name(name) => {}
                Host::Tcp(name) => return Err(PostgresError::NotLocal(name.clone())),
                Host::Unix(path) if path.is_absolute() => {}
                Host::Unix(path) => {
                    return Err(PostgresError::NotLocal(path.display().to_string()));
                }
            }
        }
        if let Some(address) = config.get_hostaddrs().iter().find(|a| !a.is_loopback()) {
            return Err(PostgresError::NotLocal(address.to_string()));
        }
        // Every statement of the inbox is a key lookup or a keyed write: a generic plan is
        // always the right one, so the server never re-plans a prepared statement.
        let options = match config.get_options() {
            Some(given) => format!("{given} -c plan_cache_mode=force_generic_plan"),
            None => "-c plan_cache_mode=force_generic_plan".to_owned(),
        };
        config
            .connect_timeout(CONNECT_TIMEOUT)
            .application_name("production-lab ordered inbox")
            .options(options);
        let description = describe(&config);
        Ok(Target {
            config,
            description,
        })
    }

    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// Opens one connection outside any pool (migrations, the operator commands); the connection
    /// task runs until the client is dropped.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, PostgresError> {
        let (client, connection) =
            self.config
                .connect(NoTls)
                .await
                .map_err(|error| PostgresError::Connect {
                    target: self.description.clone(),
                    reason: error_text(&error),
                })?;
        tokio::spawn(async move {
            // The connection ends with the client or the server; its error, if any, surfaces
            // on the client's next statement.
            let _ = connection.await;
        });
        Ok(client)
    }
}

fn is_loopback_name(name: &str) -> bool {
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    let literal = name.trim_start_matches('[').trim_end_matches(']');
    literal.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn describe(config: &tokio_postgres::Config) -> String {
    let host = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            Host::Tcp(name) => name.clone(),
            Host::Unix(path) => path.display().to_string(),
        })
        .chain(config.get_hostaddrs().iter().map(IpAddr::to_string))
        .next()
        .unwrap_or_default();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("");
    let database = config.get_dbname().unwrap_or(user);
    format!("{user}@{host}:{port}/{database}")
}

/// The text of a driver error including its cause (tokio-postgres's `Display` of a database
/// error is just "db error").
pub(crate) fn error_text(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => match std::error::Error::source(error) {
            Some(source) => format!("{error}: {source}"),
            None => error.to_string(),
        },
    }
}

/// A failure underneath one attempt of an operation.
#[derive(Debug)]
pub(crate) enum Failure {
    /// A statement failed before COMMIT was sent: the transaction did not commit.
    Db(tokio_postgres::Error),
    /// A statement of the final flight (the writes and COMMIT) failed. A database error there
    /// still means the transaction rolled back; a lost connection leaves its fate unknown.
    Commit(tokio_postgres::Error),
    /// No connection could be had.
    Pool(PoolError),
    /// A stored value this build cannot read.
    Data(String),
}

impl From<tokio_postgres::Error> for Failure {
    fn from(error: tokio_postgres::Error) -> Self {
        Failure::Db(error)
    }
}

impl From<UnknownValue> for Failure {
    fn from(error: UnknownValue) -> Self {
        Failure::Data(error.to_string())
    }
}

/// SQLSTATEs after which the whole operation is tried again: the transaction rolled back, and
/// reading the facts anew decides it correctly.
fn asks_for_retry(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code().map(|code| code.code()),
        Some("40001" | "40P01" | "23505")
    )
}

/// True when the database or the way to it is down, restarting or overloaded.
fn is_unavailable(error: &tokio_postgres::Error) -> bool {
    if error.is_closed() {
        return true;
    }
    match error.code().map(|code| code.code()) {
        // Connection exceptions, insufficient resources, operator intervention (shutdown,
        // cannot connect now), lock not available; and the retry codes once retries ran out.
        Some(code) => {
            code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("57P")
                || matches!(code, "55P03" | "40001" | "40P01" | "25006")
        }
        // No SQLSTATE: an I/O error, a timeout or a closed socket.
        None => true,
    }
}

impl Failure {
    /// Whether another attempt may be made.
    fn retryable(&self) -> bool {
        match self {
            Failure::Db(error) => asks_for_retry(error) || error.is_closed(),
            // A database error in the final flight means COMMIT did not take; a lost
            // connection there may have committed, so it is not retried: the caller learns
            // "unavailable" and its own retry reads the outcome (a replay).
            Failure::Commit(error) => asks_for_retry(error),
            Failure::Pool(_) | Failure::Data(_) => false,
        }
    }

    fn into_inbox_error(self) -> InboxError {
        match self {
            Failure::Db(error) | Failure::Commit(error) => {
                let text = format!("postgres: {}", error_text(&error));
                if is_unavailable(&error) {
                    InboxError::Unavailable(text)
                } else {
                    InboxError::Failed(text)
                }
            }
            Failure::Pool(error) => InboxError::Unavailable(format!("postgres pool: {error}")),
            Failure::Data(text) => InboxError::Failed(text),
        }
    }
}

/// Counters of the backend's work: operations, database round trips and retried attempts.
#[derive(Debug, Default)]
pub struct Counters {
    operations: AtomicU64,
    round_trips: AtomicU64,
    retries: AtomicU64,
}

impl Counters {
    /// One flight of pipelined statements and its answers.
    pub(crate) fn trip(&self) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostgresStats {
    pub operations: u64,
    pub round_trips: u64,
    pub retries: u64,
}

pub(crate) type Client = deadpool_postgres::Client;
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, Failure>> + Send + 'a>>;

/// The ordered inbox in a PostgreSQL database. Cheap to clone: clones share the pool.
#[derive(Clone)]
pub struct PostgresInbox {
    pool: Pool,
    target: Target,
    limits: Limits,
    counters: Arc<Counters>,
}

impl PostgresInbox {
    /// Checks the URL, brings the schema up to date (under an advisory lock, so servers starting
    /// together migrate once) and opens the pool.
    pub async fn connect(url: &str, limits: Limits) -> Result<PostgresInbox, PostgresError> {
        let target = Target::parse(url)?;
        PostgresInbox::open(target, limits).await
    }

    /// As [`PostgresInbox::connect`] for a checked target.
    pub async fn open(target: Target, limits: Limits) -> Result<PostgresInbox, PostgresError> {
        schema::migrate(&target).await?;
        let manager = Manager::from_config(
            target.config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
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
        Ok(PostgresInbox {
            pool,
            target,
            limits,
            counters: Arc::new(Counters::default()),
        })
    }

    /// Where the inbox lives, without credentials.
    pub fn target(&self) -> &Target {
        &self.target
    }

    pub fn stats(&self) -> PostgresStats {
        PostgresStats {
            operations: self.counters.operations.load(Ordering::Relaxed),
            round_trips: self.counters.round_trips.load(Ordering::Relaxed),
            retries: self.counters.retries.load(Ordering::Relaxed),
        }
    }

    /// How many messages of `aggregate_id` are applied and the sum of their amounts: the
    /// evidence a load's verification compares with the aggregate's `last` and `total`.
    pub async fn applied_totals(&self, aggregate_id: String) -> Result<(i64, i64), InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move { views::applied_totals(client, counters, &aggregate_id).await })
        })
        .await
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

/// Ends whatever transaction a failed attempt left open; a connection that cannot even do that
/// is taken out of the pool.
async fn release_after_failure(client: Client) {
    if client.is_closed() || client.batch_execute("ROLLBACK").await.is_err() {
        drop(deadpool_postgres::Object::take(client));
    }
}

#[async_trait]
impl Inbox for PostgresInbox {
    async fn deliver(&self, message: OrderedMessage, door: Door) -> Result<Outcome, InboxError> {
        let limits = self.limits;
        self.run(move |client, counters| {
            let message = message.clone();
            Box::pin(
                async move { engine::deliver(client, counters, &message, door, &limits).await },
            )
        })
        .await
    }

    async fn resolve(
        &self,
        request: ResolutionRequest,
        mode: Mode,
    ) -> Result<Resolved, ResolutionError> {
        let limits = self.limits;
        self.run(move |client, counters| {
            let request = request.clone();
            Box::pin(
                async move { engine::resolve(client, counters, &request, mode, &limits).await },
            )
        })
        .await?
    }

    async fn check_operator(&self, token: Option<String>) -> Result<OperatorCheck, InboxError> {
        self.run(move |client, counters| {
            let token = token.clone();
            Box::pin(async move { operators::check(client, counters, token.as_deref()).await })
        })
        .await
    }

    async fn aggregate(&self, aggregate_id: String) -> Result<Option<AggregateView>, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move { views::aggregate_view(client, counters, &aggregate_id).await })
        })
        .await
    }

    async fn inventory(
        &self,
        status: AggregateStatus,
        limit: i64,
    ) -> Result<Vec<InventoryEntry>, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { views::inventory(client, counters, status, limit).await })
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

    async fn health(&self) -> Result<InboxHealth, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { views::health(client, counters).await })
        })
        .await
    }

    /// One transaction per delivery, in order: each is committed (or, refused, rolled back)
    /// before the next is decided, so `Ok` means all committed, and after an `Err` a prefix may
    /// have (a repeat of any of them is a replay). Unlike SQLite's group commit this is not one
    /// COMMIT for the batch. Each is checked as [`Inbox::deliver_as`] checks one, under the same
    /// locks (the producer's row shared).
    async fn deliver_batch(
        &self,
        deliveries: Vec<BatchDelivery>,
    ) -> Result<Vec<Result<Outcome, ProducerRefusal>>, InboxError> {
        let mut outcomes = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            outcomes.push(
                self.deliver_as(delivery.message, delivery.door, delivery.claim)
                    .await?,
            );
        }
        Ok(outcomes)
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

    async fn deliver_as(
        &self,
        message: OrderedMessage,
        door: Door,
        claim: Option<ProducerClaim>,
    ) -> Result<Result<Outcome, ProducerRefusal>, InboxError> {
        let limits = self.limits;
        self.run(move |client, counters| {
            let message = message.clone();
            let claim = claim.clone();
            Box::pin(async move {
                engine::deliver_as(client, counters, &message, door, claim.as_ref(), &limits).await
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

    async fn ownership(&self, aggregate_id: String) -> Result<OwnershipState, InboxError> {
        self.run(move |client, counters| {
            let aggregate_id = aggregate_id.clone();
            Box::pin(async move { engine::ownership(client, counters, &aggregate_id).await })
        })
        .await
    }

    async fn producers(&self) -> Result<Vec<ProducerView>, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { views::producers(client, counters).await })
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

    async fn rejected(&self, page: PageRequest) -> Result<Page<RejectedDelivery>, InboxError> {
        self.run(move |client, counters| {
            Box::pin(async move { rejected::page(client, counters, page).await })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_and_socket_directories_are_accepted() {
        for url in [
            "postgres://lab@127.0.0.1:5432/inbox",
            "postgresql://lab@localhost/inbox",
            "postgres://lab@[::1]:6000/inbox",
            "postgres://lab@%2Ftmp%2Fpg/inbox",
            "postgres://lab@/inbox?host=/var/run/postgresql",
            "postgres://lab:secret@127.0.0.2:5432/inbox",
        ] {
            let target = Target::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert!(!target.to_string().contains("secret"), "{target}");
        }
        assert_eq!(
            Target::parse("postgres://lab:pw@127.0.0.1:5433/inbox")
                .unwrap()
                .to_string(),
            "lab@127.0.0.1:5433/inbox"
        );
    }

    #[test]
    fn other_hosts_and_other_forms_are_refused_without_echoing_a_password() {
        for url in [
            "postgres://lab:secret@db.example.com/inbox",
            "postgres://lab:secret@10.0.0.5:5432/inbox",
            "postgres://lab:secret@0.0.0.0/inbox",
            "postgres://lab:secret@127.0.0.1,db.example.com/inbox",
            "postgres://lab:secret@/inbox?hostaddr=192.168.1.2",
        ] {
            let error = Target::parse(url).unwrap_err();
            assert!(
                matches!(error, PostgresError::NotLocal(_)),
                "{url}: {error}"
            );
            assert!(!error.to_string().contains("secret"), "{error}");
        }
        for url in [
            "host=127.0.0.1 user=lab",
            "mysql://lab@127.0.0.1/inbox",
            "postgres://lab@/inbox",
        ] {
            assert!(
                matches!(Target::parse(url), Err(PostgresError::BadUrl(_))),
                "{url}"
            );
        }
    }
}
