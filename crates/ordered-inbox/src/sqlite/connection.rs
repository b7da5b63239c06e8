//! The writer's connection: a [`rusqlite::Connection`] (it derefs to one) whose statements of
//! fixed SQL are prepared once for the writer's life.
//!
//! rusqlite's `prepare_cached` finds a statement by its SQL text: each use hashes and copies the
//! text on the way out and hashes it again to put the statement back, about 1,500 instructions,
//! and a delivery runs five statements. [`WriterConnection::prepared`] takes the SQL as a
//! `&'static str` and finds its statement by the text's address and length instead, a few
//! comparisons. The set is bounded by the program's SQL literals.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use rusqlite::{Connection, PrepFlags, Statement};

/// A statement's parameters for a given limit, as [`times_prepared_again`] binds them.
#[cfg(any(test, feature = "testing"))]
pub type ParametersFor<'a> = dyn Fn(i64) -> Vec<rusqlite::types::Value> + 'a;

/// Runs `sql` once for each of `limits`, with the parameters `parameters` gives for it, reads
/// every row, and answers how many times SQLite prepared the statement again. SQLite plans with
/// a bare bound `LIMIT ?N` or `OFFSET ?N`'s value and prepares such a statement again at every
/// new bind; a statement run at every batch or round must count 0 here. For tests.
#[cfg(any(test, feature = "testing"))]
pub fn times_prepared_again(
    connection: &Connection,
    sql: &str,
    parameters: &ParametersFor<'_>,
    limits: &[i64],
) -> rusqlite::Result<i32> {
    let mut statement = connection.prepare(sql)?;
    for &limit in limits {
        let mut rows = statement.query(rusqlite::params_from_iter(parameters(limit)))?;
        while rows.next()?.is_some() {}
    }
    Ok(statement.get_status(rusqlite::StatementStatus::RePrepare))
}

/// The writer thread's connection, as every unit of work and the application's handler get it.
pub struct WriterConnection<'c> {
    connection: &'c Connection,
    /// The statements not in use, each with its SQL's address and length.
    idle: RefCell<Vec<(SqlKey, Statement<'c>)>>,
}

/// A `&'static str`'s identity: its address and length (one literal, one statement).
#[derive(Clone, Copy, PartialEq, Eq)]
struct SqlKey(usize, usize);

impl SqlKey {
    fn of(sql: &'static str) -> SqlKey {
        SqlKey(sql.as_ptr() as usize, sql.len())
    }
}

impl<'c> WriterConnection<'c> {
    /// The writer's view of `connection`.
    pub fn new(connection: &'c Connection) -> WriterConnection<'c> {
        WriterConnection {
            connection,
            idle: RefCell::new(Vec::new()),
        }
    }

    /// The statement of `sql`, prepared at its first use and kept for the connection's life;
    /// it goes back when the returned value is dropped. A statement already in use (a nested
    /// use of the same SQL) is prepared again.
    pub fn prepared<'w>(&'w self, sql: &'static str) -> rusqlite::Result<WriterStatement<'w, 'c>> {
        let key = SqlKey::of(sql);
        let found = {
            let mut idle = self.idle.borrow_mut();
            idle.iter()
                .position(|(at, _)| *at == key)
                .map(|index| idle.swap_remove(index).1)
        };
        let statement = match found {
            Some(statement) => statement,
            None => prepare_persistent(self.connection, sql)?,
        };
        Ok(WriterStatement {
            writer: self,
            key,
            statement: Some(statement),
        })
    }
}

/// Prepares a statement that lives as long as its connection. `SQLITE_PREPARE_PERSISTENT` keeps
/// it out of the connection's lookaside memory, which would otherwise be left too small for
/// the cursors and values each run of a statement allocates (they then go to `malloc`).
pub(super) fn prepare_persistent<'c>(
    connection: &'c Connection,
    sql: &str,
) -> rusqlite::Result<Statement<'c>> {
    connection.prepare_with_flags(sql, PrepFlags::SQLITE_PREPARE_PERSISTENT)
}

impl Deref for WriterConnection<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.connection
    }
}

/// A statement of [`WriterConnection::prepared`]; derefs to a [`Statement`].
pub struct WriterStatement<'w, 'c> {
    writer: &'w WriterConnection<'c>,
    key: SqlKey,
    /// `Some` until dropped.
    statement: Option<Statement<'c>>,
}

impl<'c> Deref for WriterStatement<'_, 'c> {
    type Target = Statement<'c>;

    fn deref(&self) -> &Statement<'c> {
        self.statement
            .as_ref()
            .unwrap_or_else(|| unreachable!("a writer statement is taken only when dropped"))
    }
}

impl<'c> DerefMut for WriterStatement<'_, 'c> {
    fn deref_mut(&mut self) -> &mut Statement<'c> {
        self.statement
            .as_mut()
            .unwrap_or_else(|| unreachable!("a writer statement is taken only when dropped"))
    }
}

impl Drop for WriterStatement<'_, '_> {
    fn drop(&mut self) {
        if let Some(mut statement) = self.statement.take() {
            // As rusqlite's cache does: no bound value outlives its use. (Every way of running
            // a statement resets it when it is done.)
            statement.clear_bindings();
            let mut idle = self.writer.idle.borrow_mut();
            if !idle.iter().any(|(at, _)| *at == self.key) {
                idle.push((self.key, statement));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INSERT: &str = "INSERT INTO t(v) VALUES (?1)";
    const COUNT: &str = "SELECT count(*) FROM t";

    fn table() -> Connection {
        let connection = Connection::open_in_memory().unwrap();
        connection.execute_batch("CREATE TABLE t(v)").unwrap();
        connection
    }

    /// The one value of `sql`'s first row, through the writer's statement.
    fn first_value(writer: &WriterConnection<'_>, sql: &'static str) -> i64 {
        writer
            .prepared(sql)
            .unwrap()
            .query_row([], |row| row.get(0))
            .unwrap()
    }

    fn insert_0_1_2(writer: &WriterConnection<'_>) {
        for value in 0..3 {
            writer.prepared(INSERT).unwrap().execute([value]).unwrap();
        }
    }

    #[test]
    fn a_statement_is_prepared_once_and_reused() {
        let connection = table();
        let writer = WriterConnection::new(&connection);
        insert_0_1_2(&writer);
        assert_eq!(first_value(&writer, COUNT), 3);
        let runs = writer
            .prepared(INSERT)
            .unwrap()
            .get_status(rusqlite::StatementStatus::Run);
        assert_eq!(runs, 3, "the three inserts ran one statement");
        assert_eq!(writer.idle.borrow().len(), 2, "one statement per SQL text");
    }

    #[test]
    fn a_nested_use_of_the_same_sql_gets_a_statement_of_its_own() {
        let connection = table();
        let writer = WriterConnection::new(&connection);
        let mut outer = writer.prepared(INSERT).unwrap();
        writer.prepared(INSERT).unwrap().execute([1]).unwrap();
        outer.execute([2]).unwrap();
        drop(outer);
        assert_eq!(writer.idle.borrow().len(), 1);
        assert_eq!(first_value(&writer, "SELECT sum(v) FROM t"), 3);
    }

    #[test]
    fn a_statement_given_back_unfinished_runs_from_the_start_next_time() {
        let connection = table();
        let writer = WriterConnection::new(&connection);
        insert_0_1_2(&writer);
        const VALUES: &str = "SELECT v FROM t ORDER BY v";
        {
            let mut statement = writer.prepared(VALUES).unwrap();
            let mut rows = statement.query([]).unwrap();
            assert!(rows.next().unwrap().is_some());
        }
        assert_eq!(first_value(&writer, VALUES), 0);
    }
}
