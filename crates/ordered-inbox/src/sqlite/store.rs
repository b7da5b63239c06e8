//! The SQLite store: one writer thread that owns the only write connection and commits every
//! request waiting at that moment in one transaction (group commit), plus a small pool of
//! read-only connections.
//!
//! Why one writer: SQLite admits one writer at a time anyway. Letting every request open its own
//! write transaction turns contention into `SQLITE_BUSY` errors and 5xx answers; a single owner of
//! the write connection turns it into a queue instead. One request's failure rolls back only its
//! own changes, and every request is answered only after the shared COMMIT has returned, so an
//! answer never reports work that a crash could still lose.
//!
//! How a failure stays private without a savepoint per request: a batch first runs every unit in
//! the bare transaction. Nearly always all succeed, and the batch commits. When one fails, the
//! whole attempt is rolled back and the batch runs again with each unit in its own SAVEPOINT
//! (`run_batch`). A savepoint around every unit cost about 7% of a delivery's instructions:
//! SQLite copies each page the unit first touches into the statement journal.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::{Connection, ErrorCode, OpenFlags, Statement};
use tokio::sync::oneshot;

use super::connection::{WriterConnection, prepare_persistent};

/// SQLite's busy timeout on every connection, as the seed's `DefaultTimeout = 1`.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(1);
/// The most requests one commit may carry; bounds the latency a batch adds to its last member.
pub const MAX_BATCH: usize = 256;
/// How many times the writer retries `BEGIN IMMEDIATE` (each waiting up to the busy timeout)
/// while a side connection of the SQL labs holds the write lock.
const BEGIN_ATTEMPTS: u32 = 10;
/// Prepared statements the writer keeps (all labs together use a few dozen).
const WRITER_STATEMENT_CACHE: usize = 128;
/// The writer's page cache, in KiB. Every delivery seeks a random leaf of each message-id
/// index; with SQLite's default 2 MiB those leaves fall out of the cache once the inbox passes a
/// few MiB, and each miss is a WAL lookup and a `pread`. A bound, not an allocation: pages are
/// cached as they are read.
const WRITER_CACHE_KIB: u32 = 16 * 1024;
/// Idle read connections kept for reuse.
const READ_POOL_SIZE: usize = 8;

#[derive(Debug, thiserror::Error)]
/// A failure of the store.
pub enum StoreError {
    #[error("sqlite: {0}")]
    /// SQLite refused or failed a statement.
    Sqlite(#[from] rusqlite::Error),
    /// The writer could not take or commit a transaction, or has stopped.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A unit of work panicked; its changes were rolled back.
    #[error("a store operation panicked")]
    Panicked,
}

impl StoreError {
    /// True for conditions a retry can clear: lock contention past the busy timeout, a stopped
    /// writer.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Sqlite(error) => is_busy(error),
            StoreError::Unavailable(_) => true,
            StoreError::Panicked => false,
        }
    }
}

impl From<StoreError> for crate::error::InboxError {
    fn from(error: StoreError) -> Self {
        if error.is_retryable() {
            crate::error::InboxError::Unavailable(error.to_string())
        } else {
            crate::error::InboxError::Failed(error.to_string())
        }
    }
}

/// SQLite's `synchronous` setting for the write connection. FULL is the durable default: a
/// committed transaction survives a power cut; NORMAL in WAL mode may lose the last ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synchronous {
    /// A commit may be lost on a power cut, never corrupted (in WAL mode).
    Normal,
    /// A commit survives a power cut.
    Full,
}

impl Synchronous {
    /// The value of `PRAGMA synchronous`.
    pub fn pragma_value(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        }
    }
}

/// True for SQLITE_BUSY and SQLITE_LOCKED (and their extended codes).
pub fn is_busy(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

/// True for a constraint violation (SQLITE_CONSTRAINT, the seed's error code 19).
pub fn is_constraint(error: &rusqlite::Error) -> bool {
    error.sqlite_error_code() == Some(ErrorCode::ConstraintViolation)
}

/// What the writer thread reports after each group transaction it committed. The library keeps
/// no metrics of its own: the owner of the store passes an observer at open and records what it
/// needs (a histogram, a log line) in its own recorder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchCommitted {
    /// The units of work the transaction carried (1..=[`MAX_BATCH`]).
    pub units: usize,
    /// From `BEGIN IMMEDIATE` to the end of `COMMIT`: what the batch added to its members' wait.
    pub transaction: Duration,
    /// The `COMMIT` statement alone: with `synchronous=FULL`, mostly the fsync.
    pub commit: Duration,
    /// A unit failed, so the batch ran a second time with each unit in its own savepoint.
    pub replayed: bool,
}

/// Called on the writer thread after every committed batch; it must return quickly (it delays
/// the next batch).
pub trait WriterObserver: Send + Sync {
    /// Called on the writer thread after `batch` committed.
    fn batch_committed(&self, batch: BatchCommitted);
}

/// A cheap handle to the store; clones share the writer and the read pool.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    writer: mpsc::Sender<WriterMessage>,
    writer_thread: Mutex<Option<JoinHandle<()>>>,
    readers: Mutex<Vec<Connection>>,
    stats: Arc<WriterStats>,
}

/// Counters of the writer's work, for benchmarks, tests and metrics.
#[derive(Default)]
struct WriterStats {
    commits: AtomicU64,
    units: AtomicU64,
    /// Units sent to the writer and not yet taken into a batch.
    queued: AtomicU64,
    replayed: AtomicU64,
    observer: Option<Arc<dyn WriterObserver>>,
}

/// How many group transactions were committed and how many units of work they carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreStats {
    /// Transactions committed.
    pub commits: u64,
    /// Units of work they carried.
    pub units: u64,
    /// Batches run a second time, each unit in its own savepoint, because a unit failed.
    pub replayed: u64,
}

enum WriterMessage {
    Work(Box<dyn WriteJob>),
    /// Work that may wait up to this long for another unit to share its commit.
    Patient(Box<dyn WriteJob>, Duration),
    Stop,
}

trait WriteJob: Send {
    /// Runs the work in the open transaction and keeps its outcome; returns whether the outcome
    /// is a success (whether its changes may be kept). Runs again if the batch is replayed.
    fn run(&mut self, connection: &WriterConnection<'_>) -> bool;
    /// Records `error` as the outcome without running (its savepoint could not be opened).
    fn fail(&mut self, error: StoreError);
    /// Answers with the last outcome once the batch has committed (`Ok`), or with the error
    /// that kept it from committing.
    fn answer(self: Box<Self>, commit: Result<(), StoreError>);
}

struct TypedJob<F, T, E> {
    work: F,
    outcome: Option<Result<T, E>>,
    reply: oneshot::Sender<Result<T, E>>,
}

impl<F, T, E> WriteJob for TypedJob<F, T, E>
where
    F: FnMut(&WriterConnection<'_>) -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: From<StoreError> + Send + 'static,
{
    fn run(&mut self, connection: &WriterConnection<'_>) -> bool {
        let outcome = catch_unwind(AssertUnwindSafe(|| (self.work)(connection)))
            .unwrap_or_else(|_| Err(E::from(StoreError::Panicked)));
        let succeeded = outcome.is_ok();
        self.outcome = Some(outcome);
        succeeded
    }

    fn fail(&mut self, error: StoreError) {
        self.outcome = Some(Err(E::from(error)));
    }

    fn answer(self: Box<Self>, commit: Result<(), StoreError>) {
        let answer = match (commit, self.outcome) {
            (Ok(()), Some(outcome)) => outcome,
            (Ok(()), None) => Err(E::from(StoreError::Unavailable(
                "the work was not run".to_owned(),
            ))),
            (Err(error), _) => Err(E::from(error)),
        };
        // The caller may have gone away (client disconnect); the work's fate is already
        // decided by the commit, so there is nobody left to tell.
        let _ = self.reply.send(answer);
    }
}

impl Store {
    /// Opens (creating if needed) the database file, runs `migrate` on the write connection and
    /// starts the writer thread. The owner of the file passes every migration it needs: its own
    /// tables' and the inbox's ([`super::schema::migrate`]).
    pub fn open(
        path: &Path,
        synchronous: Synchronous,
        migrate: impl FnOnce(&mut Connection) -> rusqlite::Result<()>,
    ) -> Result<Store, StoreError> {
        Store::open_observed(path, synchronous, migrate, None)
    }

    /// [`Store::open`] with an observer the writer thread calls after every committed batch.
    pub fn open_observed(
        path: &Path,
        synchronous: Synchronous,
        migrate: impl FnOnce(&mut Connection) -> rusqlite::Result<()>,
        observer: Option<Arc<dyn WriterObserver>>,
    ) -> Result<Store, StoreError> {
        let mut connection = Connection::open(path)?;
        connection.busy_timeout(BUSY_TIMEOUT)?;
        // journal_mode cannot change inside a transaction, so it comes before the migrations.
        let mode: String = connection.query_row("PRAGMA journal_mode=WAL", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Unavailable(format!(
                "could not switch the journal to WAL (got {mode})"
            )));
        }
        connection.execute_batch(&format!(
            "PRAGMA synchronous={}; PRAGMA foreign_keys=ON; PRAGMA cache_size=-{};",
            synchronous.pragma_value(),
            WRITER_CACHE_KIB
        ))?;
        migrate(&mut connection)?;
        // Every lab's writes share this one connection's statement cache; rusqlite's default of
        // 16 would make the labs evict each other's prepared statements under mixed load.
        connection.set_prepared_statement_cache_capacity(WRITER_STATEMENT_CACHE);

        let (sender, receiver) = mpsc::channel();
        let stats = Arc::new(WriterStats {
            observer,
            ..WriterStats::default()
        });
        let writer_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("store-writer".to_owned())
            .spawn(move || writer_loop(connection, receiver, &writer_stats))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the writer thread: {e}")))?;
        Ok(Store {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                writer: sender,
                writer_thread: Mutex::new(Some(thread)),
                readers: Mutex::new(Vec::new()),
                stats,
            }),
        })
    }

    /// Commits so far and the units of work they carried (units / commits = mean batch size).
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            commits: self.inner.stats.commits.load(Ordering::Relaxed),
            units: self.inner.stats.units.load(Ordering::Relaxed),
            replayed: self.inner.stats.replayed.load(Ordering::Relaxed),
        }
    }

    /// Units of work sent to the writer and not yet taken into a transaction.
    pub fn queue_depth(&self) -> u64 {
        self.inner.stats.queued.load(Ordering::Relaxed)
    }

    /// The database file's path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `work` on the writer thread in the current group transaction. `Ok` keeps its
    /// changes, `Err` rolls back only this work. Resolves after the group's COMMIT, so `Ok` means
    /// durable. Dropping the returned future does not cancel the work: it is applied or not as a
    /// whole, whether anyone is still waiting or not.
    ///
    /// `work` may run more than once: when another unit of its group fails, the group is rolled
    /// back and run again (see the module's doc), and only the last run's outcome counts. So it
    /// must act only through the connection, never on anything outside the transaction.
    pub async fn write<F, T, E>(&self, work: F) -> Result<T, E>
    where
        F: FnMut(&WriterConnection<'_>) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
    {
        self.send(work, None).await
    }

    /// [`Store::write`] for work whose caller can wait: when nothing else is waiting for the
    /// writer, the work waits up to `within` for another unit, and shares its commit. Two
    /// commits in a row write every page both touched twice to the WAL, and each pays its own
    /// sync; work that touches the pages the next unit will (the gate's marks of the rows its
    /// inbox just wrote) costs little beside it.
    pub async fn write_with_company<F, T, E>(&self, within: Duration, work: F) -> Result<T, E>
    where
        F: FnMut(&WriterConnection<'_>) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
    {
        self.send(work, Some(within)).await
    }

    async fn send<F, T, E>(&self, work: F, patience: Option<Duration>) -> Result<T, E>
    where
        F: FnMut(&WriterConnection<'_>) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Box::new(TypedJob {
            work,
            outcome: None,
            reply,
        });
        let message = match patience {
            Some(within) => WriterMessage::Patient(job, within),
            None => WriterMessage::Work(job),
        };
        let queued = &self.inner.stats.queued;
        queued.fetch_add(1, Ordering::Relaxed);
        if self.inner.writer.send(message).is_err() {
            queued.fetch_sub(1, Ordering::Relaxed);
            return Err(E::from(StoreError::Unavailable(
                "the writer has stopped".to_owned(),
            )));
        }
        answer.await.unwrap_or_else(|_| {
            Err(E::from(StoreError::Unavailable(
                "the writer stopped before answering".to_owned(),
            )))
        })
    }

    /// Runs `work` on a pooled read-only connection on the blocking thread pool.
    pub async fn read<F, T, E>(&self, work: F) -> Result<T, E>
    where
        F: FnOnce(&Connection) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
    {
        let store = self.clone();
        let joined = tokio::task::spawn_blocking(move || {
            let connection = store.take_reader().map_err(E::from)?;
            let result = work(&connection);
            store.return_reader(connection);
            result
        })
        .await;
        joined.unwrap_or_else(|_| Err(E::from(StoreError::Panicked)))
    }

    fn take_reader(&self) -> Result<Connection, StoreError> {
        let pooled = self
            .inner
            .readers
            .lock()
            .ok()
            .and_then(|mut pool| pool.pop());
        match pooled {
            Some(connection) => Ok(connection),
            None => {
                let connection = self.open_connection()?;
                connection.pragma_update(None, "query_only", true)?;
                Ok(connection)
            }
        }
    }

    fn return_reader(&self, connection: Connection) {
        // A reader left inside a transaction (work that returned early) would pin an old
        // snapshot; drop it instead of pooling it.
        if !connection.is_autocommit() {
            return;
        }
        if let Ok(mut pool) = self.inner.readers.lock()
            && pool.len() < READ_POOL_SIZE
        {
            pool.push(connection);
        }
    }

    /// A new connection of its own to the same file (busy timeout 1 s, foreign keys on), for labs
    /// that demonstrate SQLite's behaviour across two connections. It is not the writer's
    /// connection: keep its write transactions short.
    pub fn open_connection(&self) -> Result<Connection, StoreError> {
        let connection = Connection::open_with_flags(
            &self.inner.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_URI
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        connection.busy_timeout(BUSY_TIMEOUT)?;
        connection.pragma_update(None, "foreign_keys", true)?;
        Ok(connection)
    }

    /// Stops the writer after the work already queued, and waits for its thread to close the
    /// connection. Later writes answer 503.
    pub async fn shutdown(&self) {
        let _ = self.inner.writer.send(WriterMessage::Stop);
        let thread = self
            .inner
            .writer_thread
            .lock()
            .ok()
            .and_then(|mut slot| slot.take());
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

fn writer_loop(
    connection: Connection,
    receiver: mpsc::Receiver<WriterMessage>,
    stats: &WriterStats,
) {
    let mut control = match TransactionControl::prepare(&connection) {
        Ok(control) => control,
        Err(error) => return refuse_all(&receiver, stats, &error),
    };
    let writer = WriterConnection::new(&connection);
    let mut stopping = false;
    while !stopping {
        let Ok(first) = receiver.recv() else { break };
        let mut group = Group::new(&stats.queued);
        if !group.take(first) {
            break;
        }
        // Take everything already waiting: these share the commit below.
        stopping = !group.take_waiting(&receiver);
        let room = group.batch.len() < MAX_BATCH;
        if let Some(within) = group.patience.filter(|_| !stopping && room) {
            // Only patient work so far: it waits a little for company.
            if let Ok(message) = receiver.recv_timeout(within) {
                stopping = !group.take(message) || !group.take_waiting(&receiver);
            }
        }
        run_batch(&writer, &mut control, group.batch, stats);
    }
    // Dropping the connection here closes it (and checkpoints the WAL when it is the last one).
}

/// The units one commit will carry, as the writer gathers them.
struct Group<'s> {
    batch: Vec<Box<dyn WriteJob>>,
    /// While every unit so far is patient: the shortest wait any of them allows.
    patience: Option<Duration>,
    /// The units sent and not yet taken, which each take counts down.
    queued: &'s AtomicU64,
}

impl<'s> Group<'s> {
    fn new(queued: &'s AtomicU64) -> Group<'s> {
        Group {
            batch: Vec::new(),
            patience: None,
            queued,
        }
    }

    /// Adds the unit a message brings; false when the message asks the writer to stop.
    fn take(&mut self, message: WriterMessage) -> bool {
        if !matches!(message, WriterMessage::Stop) {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
        match message {
            WriterMessage::Work(job) => {
                self.batch.push(job);
                self.patience = None;
            }
            WriterMessage::Patient(job, within) => {
                self.patience = match self.patience {
                    Some(shortest) => Some(shortest.min(within)),
                    None if self.batch.is_empty() => Some(within),
                    None => None,
                };
                self.batch.push(job);
            }
            WriterMessage::Stop => return false,
        }
        true
    }

    /// Adds what is already waiting, up to [`MAX_BATCH`] units; false when a stop came.
    fn take_waiting(&mut self, receiver: &mpsc::Receiver<WriterMessage>) -> bool {
        while self.batch.len() < MAX_BATCH {
            match receiver.try_recv() {
                Ok(message) => {
                    if !self.take(message) {
                        return false;
                    }
                }
                Err(_) => break,
            }
        }
        true
    }
}

/// Answers every unit until the store stops: the writer could not prepare its statements.
fn refuse_all(
    receiver: &mpsc::Receiver<WriterMessage>,
    stats: &WriterStats,
    error: &rusqlite::Error,
) {
    while let Ok(WriterMessage::Work(job) | WriterMessage::Patient(job, _)) = receiver.recv() {
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        job.answer(Err(StoreError::Unavailable(format!(
            "the writer could not prepare its statements: {error}"
        ))));
    }
}

/// The transaction-control statements, prepared once for the writer's life. Through the
/// statement cache every use hashed the SQL text on the way out and back in and moved the
/// statement through the cache's LRU list, and a batch runs two of them for each unit.
struct TransactionControl<'c> {
    begin: Statement<'c>,
    savepoint: Statement<'c>,
    release: Statement<'c>,
    rollback_to: Statement<'c>,
    commit: Statement<'c>,
    rollback: Statement<'c>,
}

impl<'c> TransactionControl<'c> {
    fn prepare(connection: &'c Connection) -> rusqlite::Result<TransactionControl<'c>> {
        Ok(TransactionControl {
            begin: prepare_persistent(connection, "BEGIN IMMEDIATE")?,
            savepoint: prepare_persistent(connection, "SAVEPOINT work")?,
            release: prepare_persistent(connection, "RELEASE work")?,
            rollback_to: prepare_persistent(connection, "ROLLBACK TO work")?,
            commit: prepare_persistent(connection, "COMMIT")?,
            rollback: prepare_persistent(connection, "ROLLBACK")?,
        })
    }
}

fn run(statement: &mut Statement<'_>) -> Result<(), rusqlite::Error> {
    statement.execute([]).map(drop)
}

/// Runs one group transaction and answers every unit in it: first every unit in the bare
/// transaction, and only if one fails, again with each unit in its own savepoint.
fn run_batch(
    connection: &WriterConnection<'_>,
    control: &mut TransactionControl<'_>,
    mut batch: Vec<Box<dyn WriteJob>>,
    stats: &WriterStats,
) {
    let units = batch.len() as u64;
    let began = Instant::now();
    if let Err(error) = begin_immediate(&mut control.begin) {
        let reason = error.to_string();
        return answer_all(batch, || {
            StoreError::Unavailable(format!("could not begin a write transaction: {reason}"))
        });
    }
    // `all` stops at the first failure: the units after it have not run yet.
    let bare = BareAttempt::start();
    let replayed = !batch.iter_mut().all(|job| job.run(connection));
    drop(bare);
    if replayed {
        stats.replayed.fetch_add(1, Ordering::Relaxed);
        if let Err(reason) = run_in_savepoints(connection, control, &mut batch) {
            return answer_all(batch, || StoreError::Unavailable(reason.clone()));
        }
    }
    let committing = Instant::now();
    match run(&mut control.commit) {
        Ok(()) => {
            // Counted before anyone is answered, so an answered caller sees its commit counted.
            stats.commits.fetch_add(1, Ordering::Relaxed);
            stats.units.fetch_add(units, Ordering::Relaxed);
            if let Some(observer) = &stats.observer {
                observer.batch_committed(BatchCommitted {
                    units: units as usize,
                    transaction: began.elapsed(),
                    commit: committing.elapsed(),
                    replayed,
                });
            }
            batch.into_iter().for_each(|job| job.answer(Ok(())));
        }
        Err(error) => {
            let reason = error.to_string();
            let _ = run(&mut control.rollback);
            answer_all(batch, || {
                StoreError::Unavailable(format!("commit failed: {reason}"))
            });
        }
    }
}

thread_local! {
    /// Whether this writer thread is running a batch's first, bare attempt ([`run_batch`]).
    static BARE_ATTEMPT: Cell<bool> = const { Cell::new(false) };
}

/// True while the writer runs a batch's first attempt, every unit in the bare transaction. A unit
/// that would take a savepoint of its own to undo part of its work (the handler seam does, around
/// a plan whose `apply` may declare poison) need not then: any failure sends the whole batch to
/// the replay ([`run_in_savepoints`]), where it may. Outside the writer's first attempt (its
/// replay, or a caller running a unit on a connection of its own) this is false.
pub(crate) fn in_bare_attempt() -> bool {
    BARE_ATTEMPT.with(Cell::get)
}

/// Marks the writer thread as in a batch's bare attempt until dropped.
struct BareAttempt;

impl BareAttempt {
    fn start() -> BareAttempt {
        BARE_ATTEMPT.with(|bare| bare.set(true));
        BareAttempt
    }
}

impl Drop for BareAttempt {
    fn drop(&mut self) {
        BARE_ATTEMPT.with(|bare| bare.set(false));
    }
}

/// Rolls the failed attempt back and runs the batch again in a new transaction, each unit in its
/// own savepoint, so a failing unit's changes go and the others' stay. On `Err` (why every unit
/// must be refused) the transaction has been rolled back.
fn run_in_savepoints(
    connection: &WriterConnection<'_>,
    control: &mut TransactionControl<'_>,
    batch: &mut [Box<dyn WriteJob>],
) -> Result<(), String> {
    // A failure such as SQLITE_FULL may have rolled the transaction back already.
    let rolled_back = if connection.is_autocommit() {
        Ok(())
    } else {
        run(&mut control.rollback)
    };
    let restarted = rolled_back
        .and_then(|()| begin_immediate(&mut control.begin))
        .map_err(|error| format!("could not restart the write transaction: {error}"));
    if let Err(reason) = restarted {
        let _ = run(&mut control.rollback);
        return Err(reason);
    }
    for (index, job) in batch.iter_mut().enumerate() {
        if let Err(error) = run(&mut control.savepoint) {
            job.fail(StoreError::Sqlite(error));
            continue;
        }
        let lost = index == 0 && crate::planted::active(crate::planted::Bug::LoseReplayedUnit);
        let closed = if job.run(connection) && !lost {
            run(&mut control.release)
        } else {
            run(&mut control.rollback_to).and_then(|()| run(&mut control.release))
        };
        if let Err(error) = closed {
            // Nothing in a transaction of unknown state may be committed.
            let _ = run(&mut control.rollback);
            return Err(format!(
                "the batch was rolled back: a savepoint could not be closed: {error}"
            ));
        }
    }
    Ok(())
}

/// Answers every unit of a batch that did not commit.
fn answer_all(batch: Vec<Box<dyn WriteJob>>, error: impl Fn() -> StoreError) {
    for job in batch {
        job.answer(Err(error()));
    }
}

fn begin_immediate(begin: &mut Statement<'_>) -> Result<(), rusqlite::Error> {
    let mut attempt = 1;
    loop {
        match run(begin) {
            Err(error) if is_busy(&error) && attempt < BEGIN_ATTEMPTS => attempt += 1,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db"), Synchronous::Normal, |c| {
            c.execute_batch(
                "CREATE TABLE counters(id INTEGER PRIMARY KEY, value INTEGER NOT NULL);
                 INSERT INTO counters VALUES(1, 10);
                 CREATE TABLE effects(id INTEGER PRIMARY KEY, tally INTEGER NOT NULL);
                 INSERT INTO effects VALUES(1, 0);",
            )
        })
        .unwrap();
        (dir, store)
    }

    /// The seeded `counters` value and `effects` tally, which the tests below change.
    async fn counter_and_effects(store: &Store) -> (i64, i64) {
        store
            .read(|c| {
                c.query_row(
                    "SELECT (SELECT value FROM counters WHERE id=1), (SELECT tally FROM effects WHERE id=1)",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .map_err(StoreError::from)
            })
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_failed_unit_rolls_back_only_itself() {
        let (_dir, store) = temp_store();
        let failing = store.write(|c| {
            c.execute("UPDATE counters SET value = 99 WHERE id = 1", [])?;
            Err::<(), StoreError>(StoreError::Unavailable("deliberate".into()))
        });
        let succeeding = store.write(|c| {
            c.execute("UPDATE effects SET tally = 7 WHERE id = 1", [])?;
            Ok::<(), StoreError>(())
        });
        let (failed, succeeded) = tokio::join!(failing, succeeding);
        assert!(failed.is_err());
        succeeded.unwrap();
        let (value, tally) = counter_and_effects(&store).await;
        assert_eq!((value, tally), (10, 7));
    }

    #[tokio::test]
    async fn units_queued_together_share_one_commit_and_fail_independently() {
        let (_dir, store) = temp_store();
        let before = store.stats();
        // The first unit holds the writer, so the next three queue up behind it and are taken
        // into one group transaction together.
        let (release, holder) = hold_writer(&store).await;
        let first = store.write(|c| {
            c.execute("UPDATE counters SET value = value + 1 WHERE id = 1", [])?;
            Ok::<(), StoreError>(())
        });
        let failing = store.write(|c| {
            c.execute("UPDATE counters SET value = 1000 WHERE id = 1", [])?;
            c.execute("UPDATE effects SET tally = 1000 WHERE id = 1", [])?;
            Err::<(), StoreError>(StoreError::Unavailable("deliberate".into()))
        });
        let last = store.write(|c| {
            c.execute("UPDATE effects SET tally = tally + 5 WHERE id = 1", [])?;
            Ok::<(), StoreError>(())
        });
        let (first, failing, last, ()) = tokio::join!(first, failing, last, async {
            wait_for_queue(&store, 3).await;
            release.send(()).unwrap();
        });
        holder.await.unwrap().unwrap();
        first.unwrap();
        assert!(failing.is_err());
        last.unwrap();
        let after = store.stats();
        assert_eq!(after.units - before.units, 4);
        assert_eq!(
            after.commits - before.commits,
            2,
            "three queued units, one commit"
        );
        assert_eq!(
            after.replayed - before.replayed,
            1,
            "the failure replayed its batch"
        );
        let (value, tally) = counter_and_effects(&store).await;
        assert_eq!((value, tally), (11, 5));
    }

    #[tokio::test]
    async fn patient_work_shares_the_commit_of_work_sent_while_it_waits() {
        let (_dir, store) = temp_store();
        let before = store.stats();
        let (release, holder) = hold_writer(&store).await;
        let patient = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .write_with_company(Duration::from_secs(30), |c| {
                        c.execute("UPDATE effects SET tally = tally + 1 WHERE id = 1", [])?;
                        Ok::<(), StoreError>(())
                    })
                    .await
            })
        };
        wait_for_queue(&store, 1).await;
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();
        // Taken by the writer, which nothing else keeps busy: alone, it would commit now.
        wait_until_taken(&store).await;
        count_up(&store).await;
        patient.await.unwrap().unwrap();
        let after = store.stats();
        assert_eq!(after.units - before.units, 3);
        assert_eq!(
            after.commits - before.commits,
            2,
            "the holder's, then one for both"
        );
        assert_eq!(counter_and_effects(&store).await, (11, 1));
    }

    #[tokio::test]
    async fn patient_work_alone_commits_once_its_wait_is_over_and_ordinary_work_never_waits() {
        let (_dir, store) = temp_store();
        let before = store.stats();
        store
            .write_with_company(Duration::from_millis(20), |c| {
                c.execute("UPDATE effects SET tally = tally + 1 WHERE id = 1", [])?;
                Ok::<(), StoreError>(())
            })
            .await
            .unwrap();
        assert_eq!(store.stats().commits - before.commits, 1);
        // Ordinary work behind the writer's turn is not held for company: each commits alone.
        for _ in 0..3 {
            count_up(&store).await;
        }
        assert_eq!(store.stats().commits - before.commits, 4);
        assert_eq!(counter_and_effects(&store).await, (13, 1));
    }

    /// An ordinary unit that adds one to the seeded counter.
    async fn count_up(store: &Store) {
        store
            .write(|c| {
                c.execute("UPDATE counters SET value = value + 1 WHERE id = 1", [])?;
                Ok::<(), StoreError>(())
            })
            .await
            .unwrap();
    }

    /// Holds the writer until the returned sender is used, so the units sent meanwhile queue up
    /// and share the next batch.
    async fn hold_writer(store: &Store) -> (std::sync::mpsc::Sender<()>, HolderTask) {
        let (started, wait_started) = std::sync::mpsc::channel();
        let (release, wait_release) = std::sync::mpsc::channel::<()>();
        let holding = store.clone();
        let holder = tokio::spawn(async move {
            holding
                .write(move |_| {
                    let _ = started.send(());
                    let _ = wait_release.recv();
                    Ok::<(), StoreError>(())
                })
                .await
        });
        tokio::task::spawn_blocking(move || wait_started.recv())
            .await
            .unwrap()
            .unwrap();
        (release, holder)
    }

    type HolderTask = tokio::task::JoinHandle<Result<(), StoreError>>;

    /// A unit that counts its runs and reports whether it ran inside the writer's savepoint
    /// (`ROLLBACK TO work` is refused outside one); `fails` makes it end in an error.
    fn probe(
        store: &Store,
        runs: &Arc<AtomicU64>,
        fails: bool,
    ) -> tokio::task::JoinHandle<Result<bool, StoreError>> {
        let store = store.clone();
        let runs = runs.clone();
        tokio::spawn(async move {
            store
                .write(move |c| {
                    runs.fetch_add(1, Ordering::Relaxed);
                    let in_savepoint = c.execute_batch("ROLLBACK TO work").is_ok();
                    c.execute("UPDATE effects SET tally = tally + 1 WHERE id = 1", [])?;
                    if fails {
                        return Err(StoreError::Unavailable("deliberate".into()));
                    }
                    Ok(in_savepoint)
                })
                .await
        })
    }

    /// Waits until at least `depth` units are queued for the writer.
    async fn wait_for_queue(store: &Store, depth: u64) {
        wait_for_depth(store, &format!("{depth} units queued"), |queued| {
            queued >= depth
        })
        .await;
    }

    /// Waits until the writer took every unit queued (the queue is empty).
    async fn wait_until_taken(store: &Store) {
        wait_for_depth(store, "the queued units taken", |queued| queued == 0).await;
    }

    async fn wait_for_depth(store: &Store, what: &str, done: impl Fn(u64) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(store.queue_depth()) {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_batch_whose_units_all_succeed_runs_each_once_without_a_savepoint() {
        let (_dir, store) = temp_store();
        let (release, holder) = hold_writer(&store).await;
        let runs = Arc::new(AtomicU64::new(0));
        let units = [
            probe(&store, &runs, false),
            probe(&store, &runs, false),
            probe(&store, &runs, false),
        ];
        wait_for_queue(&store, 3).await;
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();
        for unit in units {
            assert!(!unit.await.unwrap().unwrap(), "ran inside a savepoint");
        }
        assert_eq!(runs.load(Ordering::Relaxed), 3);
        assert_eq!(store.stats().replayed, 0);
        assert_eq!(counter_and_effects(&store).await, (10, 3));
    }

    #[tokio::test]
    async fn a_failing_unit_replays_its_batch_in_savepoints_and_only_the_replay_counts() {
        let (_dir, store) = temp_store();
        let (release, holder) = hold_writer(&store).await;
        let (before, during, after) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let first = probe(&store, &before, false);
        wait_for_queue(&store, 1).await;
        let failing = probe(&store, &during, true);
        wait_for_queue(&store, 2).await;
        let last = probe(&store, &after, false);
        wait_for_queue(&store, 3).await;
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();
        assert!(
            first.await.unwrap().unwrap(),
            "the replay runs in a savepoint"
        );
        assert!(failing.await.unwrap().is_err());
        assert!(last.await.unwrap().unwrap());
        // The first unit ran in the failed attempt and again in the replay; the last one had
        // not run yet when the failure stopped the attempt.
        let counts = [&before, &during, &after].map(|runs| runs.load(Ordering::Relaxed));
        assert_eq!(counts, [2, 2, 1]);
        assert_eq!(store.stats().replayed, 1);
        // Each kept unit added 1 once; the failing unit's addition and the attempt's are gone.
        assert_eq!(counter_and_effects(&store).await, (10, 2));
    }

    /// Keeps every report the writer thread sends.
    #[derive(Default)]
    struct Reports(Mutex<Vec<BatchCommitted>>);

    impl WriterObserver for Reports {
        fn batch_committed(&self, batch: BatchCommitted) {
            self.0.lock().unwrap().push(batch);
        }
    }

    #[tokio::test]
    async fn the_observer_hears_each_committed_batch_with_its_size_and_the_queue_drains() {
        let dir = tempfile::tempdir().unwrap();
        let reports = Arc::new(Reports::default());
        let store = Store::open_observed(
            &dir.path().join("t.db"),
            Synchronous::Normal,
            |c| c.execute_batch("CREATE TABLE t(v INTEGER)"),
            Some(reports.clone()),
        )
        .unwrap();
        // A unit that holds the writer, so the next three queue up and share one commit.
        let (release, holder) = hold_writer(&store).await;
        let insert = |store: &Store| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .write(|c| Ok::<_, StoreError>(c.execute("INSERT INTO t VALUES (1)", [])?))
                    .await
            })
        };
        let queued = [insert(&store), insert(&store), insert(&store)];
        wait_for_queue(&store, 3).await;
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();
        for unit in queued {
            unit.await.unwrap().unwrap();
        }
        assert_eq!(store.queue_depth(), 0);
        let sizes: Vec<usize> = reports.0.lock().unwrap().iter().map(|b| b.units).collect();
        assert_eq!(sizes, [1, 3]);
        let last = reports.0.lock().unwrap()[1];
        assert!(last.commit <= last.transaction);
    }

    #[tokio::test]
    async fn a_panicking_unit_is_an_error_not_a_dead_writer() {
        let (_dir, store) = temp_store();
        let result: Result<(), StoreError> = store.write(|_| panic!("boom")).await;
        assert!(matches!(result, Err(StoreError::Panicked)));
        let after: Result<i64, StoreError> = store
            .write(|c| Ok(c.query_row("SELECT 41 + 1", [], |r| r.get(0))?))
            .await;
        assert_eq!(after.unwrap(), 42);
    }

    #[tokio::test]
    async fn writes_after_shutdown_are_unavailable() {
        let (_dir, store) = temp_store();
        store.shutdown().await;
        let result: Result<(), StoreError> = store.write(|_| Ok(())).await;
        assert!(matches!(result, Err(StoreError::Unavailable(_))));
    }
}
