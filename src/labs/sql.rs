//! SQL labs: SQLite's real behaviour with NULLs, constraints, query plans, WAL snapshots and a
//! stale writer's `SQLITE_BUSY_SNAPSHOT`.
//!
//! The snapshot and retry labs need two real connections to one file, so they open their own
//! (`Store::open_connection`) on the blocking pool instead of using the shared writer. Their write
//! transactions are single short statements: the store's writer waits for them (it retries
//! `BEGIN IMMEDIATE`), and they wait at most the busy timeout for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use rusqlite::{Connection, TransactionBehavior, ffi};
use serde::Serialize;
use tokio::sync::{Mutex, OwnedMutexGuard};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::http::error::AppError;
use crate::store::{BUSY_TIMEOUT, Store, StoreError, is_busy, is_constraint};

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Store: FromRef<S>,
{
    OpenApiRouter::new()
        .routes(routes!(nulls))
        .routes(routes!(plans))
        .routes(routes!(null_check))
        .routes(routes!(snapshot))
        .routes(routes!(retry))
        .layer(Extension(CountersTurn::default()))
}

/// One turn at the `counters` row for the labs that reset and change it: two runs at once would
/// spoil each other's figures.
#[derive(Clone, Default)]
struct CountersTurn(Arc<Mutex<()>>);

impl CountersTurn {
    async fn take(&self) -> OwnedMutexGuard<()> {
        self.0.clone().lock_owned().await
    }
}

/// Runs a lab on the blocking pool, holding the counters turn until the lab has finished, even if
/// the client has gone away and the request's future was dropped.
async fn run_with_turn<T, F>(turn: &CountersTurn, lab: F) -> Result<T, AppError>
where
    F: FnOnce() -> Result<T, AppError> + Send + 'static,
    T: Send + 'static,
{
    let held = turn.take().await;
    tokio::task::spawn_blocking(move || {
        let result = lab();
        drop(held);
        result
    })
    .await
    .unwrap_or_else(|_| Err(AppError::Store(StoreError::Panicked)))
}

fn counter_value(connection: &Connection) -> rusqlite::Result<i64> {
    connection.query_row("SELECT value FROM counters WHERE id = 1", [], |row| {
        row.get(0)
    })
}

fn set_counter(connection: &Connection, value: i64) -> rusqlite::Result<()> {
    connection.execute("UPDATE counters SET value = ?1 WHERE id = 1", [value])?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// NULLs and constraints
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct NullFigures {
    /// `amount = NULL` is never true: NULL compares as unknown.
    equals_null: i64,
    is_null: i64,
    all: i64,
    /// `COUNT(amount)` skips NULLs.
    known: i64,
    /// `SUM` skips NULLs (and is NULL itself when nothing is known).
    sum: Option<i64>,
}

#[utoipa::path(get, path = "/sql/nulls", tag = "sql", responses(
    (status = 200, description = "How NULL compares, counts and sums", body = NullFigures),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn nulls(State(store): State<Store>) -> Result<Json<NullFigures>, AppError> {
    let figures = store
        .read(|connection| {
            connection
                .query_row(
                    "SELECT (SELECT COUNT(*) FROM sql_values WHERE amount = NULL),
                            (SELECT COUNT(*) FROM sql_values WHERE amount IS NULL),
                            (SELECT COUNT(*) FROM sql_values),
                            (SELECT COUNT(amount) FROM sql_values),
                            (SELECT SUM(amount) FROM sql_values)",
                    [],
                    |row| {
                        Ok(NullFigures {
                            equals_null: row.get(0)?,
                            is_null: row.get(1)?,
                            all: row.get(2)?,
                            known: row.get(3)?,
                            sum: row.get(4)?,
                        })
                    },
                )
                .map_err(AppError::from)
        })
        .await?;
    Ok(Json(figures))
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct NullCheck {
    /// `CHECK(amount > 0)` lets NULL through: the check is unknown, not false.
    check_allowed_null: bool,
    not_null_rejected: bool,
}

/// Inserts NULL under a CHECK and under a NOT NULL, then undoes both inserts whatever happened:
/// the lab observes the constraints and leaves the rows as they were.
#[utoipa::path(post, path = "/lab/sql/null-check", tag = "sql", responses(
    (status = 200, description = "What CHECK and NOT NULL did with a NULL (both inserts are undone)", body = NullCheck),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn null_check(State(store): State<Store>) -> Result<Json<NullCheck>, AppError> {
    let outcome = store
        .write(|connection| {
            connection.execute_batch("SAVEPOINT null_check")?;
            let observed = observe_null_constraints(connection);
            connection.execute_batch("ROLLBACK TO null_check; RELEASE null_check")?;
            observed
        })
        .await?;
    Ok(Json(outcome))
}

fn observe_null_constraints(connection: &Connection) -> Result<NullCheck, AppError> {
    let check_allowed_null =
        accepted(connection.execute("INSERT INTO sql_values(amount) VALUES(NULL)", []))?;
    let not_null_accepted =
        accepted(connection.execute("INSERT INTO sql_required(amount) VALUES(NULL)", []))?;
    Ok(NullCheck {
        check_allowed_null,
        not_null_rejected: !not_null_accepted,
    })
}

/// True if the insert went in, false if a constraint refused it; any other failure is an error.
fn accepted(insert: rusqlite::Result<usize>) -> Result<bool, AppError> {
    match insert {
        Ok(_) => Ok(true),
        Err(error) if is_constraint(&error) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Query plans
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
struct Plans {
    /// The books ordered by the composite index: price, then id.
    ids: Vec<i64>,
    composite: Vec<String>,
    expression: Vec<String>,
    collated: Vec<String>,
    partial: Vec<String>,
}

#[utoipa::path(get, path = "/sql/plans", tag = "sql", responses(
    (status = 200, description = "The books by the composite index, and four query plans as this SQLite words them", body = Plans),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn plans(State(store): State<Store>) -> Result<Json<Plans>, AppError> {
    let plans = store
        .read(|connection| read_plans(connection).map_err(AppError::from))
        .await?;
    Ok(Json(plans))
}

fn read_plans(connection: &Connection) -> rusqlite::Result<Plans> {
    let mut books = connection
        .prepare("SELECT id, price FROM products WHERE category = ?1 ORDER BY price, id")?;
    let ids = books
        .query_map(["books"], |row| row.get(0))?
        .collect::<rusqlite::Result<Vec<i64>>>()?;
    Ok(Plans {
        ids,
        composite: query_plan(
            connection,
            "SELECT id,price FROM products WHERE category='books' ORDER BY price,id",
        )?,
        expression: query_plan(
            connection,
            "SELECT id FROM products WHERE lower(name)='rune'",
        )?,
        collated: query_plan(
            connection,
            "SELECT id FROM products WHERE name='rune' COLLATE NOCASE",
        )?,
        partial: query_plan(
            connection,
            "SELECT id,price FROM products WHERE active=1 ORDER BY price",
        )?,
    })
}

/// The `detail` column (the fourth) of `EXPLAIN QUERY PLAN`, as this build's SQLite words it.
fn query_plan(connection: &Connection, sql: &str) -> rusqlite::Result<Vec<String>> {
    let mut explain = connection.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
    explain
        .query_map([], |row| row.get(3))?
        .collect::<rusqlite::Result<Vec<String>>>()
}

// ---------------------------------------------------------------------------------------------
// Snapshots and the stale writer
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
struct SnapshotFigures {
    before: i64,
    during: i64,
    after: i64,
}

/// A deferred read transaction keeps seeing the value it first read while another connection
/// commits a new one; a fresh connection sees the new value. Leaves the counter at 20.
#[utoipa::path(post, path = "/lab/sql/snapshot", tag = "sql", responses(
    (status = 200, description = "A read transaction's snapshot across another connection's commit", body = SnapshotFigures),
    (status = 500, response = crate::http::openapi::StoreFailed),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn snapshot(
    State(store): State<Store>,
    Extension(turn): Extension<CountersTurn>,
) -> Result<Json<SnapshotFigures>, AppError> {
    run_with_turn(&turn, move || read_through_a_commit(&store))
        .await
        .map(Json)
}

fn read_through_a_commit(store: &Store) -> Result<SnapshotFigures, AppError> {
    let mut first = store.open_connection()?;
    set_counter(&first, 10)?;
    let reader = first.transaction_with_behavior(TransactionBehavior::Deferred)?;
    // The first read inside the transaction fixes its snapshot.
    let before = counter_value(&reader)?;
    set_counter(&store.open_connection()?, 20)?;
    let during = counter_value(&reader)?;
    reader.commit()?;
    let after = counter_value(&store.open_connection()?)?;
    Ok(SnapshotFigures {
        before,
        during,
        after,
    })
}

#[derive(Debug, Serialize, ToSchema)]
struct RetryOutcome {
    /// The stale attempt and the fresh one.
    attempts: i64,
    /// SQLite's primary result code of the stale attempt (5, SQLITE_BUSY).
    error: i32,
    /// Its extended code (517, SQLITE_BUSY_SNAPSHOT).
    extended: i32,
    /// The counter after the fresh transaction's increment.
    value: i64,
}

/// How long to wait between stale attempts that met the write lock rather than the snapshot.
const LOCK_RETRY_PAUSE: Duration = Duration::from_millis(5);

/// A deferred transaction reads the counter, another connection commits a new value, and the
/// first one's write is refused with `SQLITE_BUSY_SNAPSHOT`: its snapshot is stale and waiting
/// cannot help. It rolls back and a fresh transaction reads again and increments. Leaves 21.
#[utoipa::path(post, path = "/lab/sql/retry", tag = "sql", responses(
    (status = 200, description = "A stale writer refused with SQLITE_BUSY_SNAPSHOT, then a fresh transaction", body = RetryOutcome),
    (status = 500, description = "The store failed, or the fixture did not meet the stale-writer boundary", body = crate::http::openapi::Problem, content_type = "application/problem+json"),
    (status = 503, response = crate::http::openapi::StoreUnavailable),
))]
async fn retry(
    State(store): State<Store>,
    Extension(turn): Extension<CountersTurn>,
) -> Result<Json<RetryOutcome>, AppError> {
    run_with_turn(&turn, move || retry_after_stale_write(&store))
        .await
        .map(Json)
}

fn retry_after_stale_write(store: &Store) -> Result<RetryOutcome, AppError> {
    let mut first = store.open_connection()?;
    set_counter(&first, 10)?;
    let stale = first.transaction_with_behavior(TransactionBehavior::Deferred)?;
    let seen = counter_value(&stale)?;
    set_counter(&store.open_connection()?, 20)?;
    let refused = stale_write(&stale, seen + 1);
    // Rolls back (and ignores an already-ended transaction).
    stale.finish()?;
    let Some((error, extended)) = refused? else {
        return Err(AppError::problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Fixture did not encounter the expected stale-writer boundary",
        ));
    };

    let mut fresh = store.open_connection()?;
    let transaction = fresh.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let value = counter_value(&transaction)? + 1;
    set_counter(&transaction, value)?;
    transaction.commit()?;
    Ok(RetryOutcome {
        attempts: 2,
        error,
        extended,
        value,
    })
}

/// Tries the stale transaction's write. `Some((code, extended))` when SQLite refused it as a
/// stale snapshot, `None` if it was (unexpectedly) accepted.
///
/// A transaction that already reads does not consult the busy handler when it asks for the
/// write lock, so while the store's writer holds that lock the answer is a plain SQLITE_BUSY
/// that says nothing about the snapshot. That is ordinary traffic, not the boundary: try again
/// until the lock is free, within the busy timeout.
fn stale_write(connection: &Connection, value: i64) -> Result<Option<(i32, i32)>, AppError> {
    let deadline = Instant::now() + BUSY_TIMEOUT;
    loop {
        match set_counter(connection, value) {
            Ok(()) => return Ok(None),
            Err(rusqlite::Error::SqliteFailure(failure, _))
                if failure.extended_code == ffi::SQLITE_BUSY_SNAPSHOT =>
            {
                return Ok(Some((failure.extended_code & 0xff, failure.extended_code)));
            }
            Err(error) if is_busy(&error) && Instant::now() < deadline => {
                std::thread::sleep(LOCK_RETRY_PAUSE);
            }
            Err(error) => return Err(error.into()),
        }
    }
}
