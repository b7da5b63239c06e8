//! The labs' schema migrations, tracked in `PRAGMA user_version`; the ordered inbox's tables are
//! the ordered-inbox library's, migrated by it ([`ordered_inbox::sqlite::schema`]) and tracked in
//! its own table.
//!
//! Version 1 is exactly the seed's classroom schema and seed rows. It is written with
//! `IF NOT EXISTS`/`INSERT OR IGNORE` so that a database created by the original lab (which never
//! set `user_version`) upgrades in place. Later versions may only add: the seed's tables and
//! columns keep their names.

use rusqlite::Connection;

/// The seed's classroom schema and rows for the labs (migration 1). The seed's three inbox
/// tables (`aggregate_state`, `ordered_inbox`, `deadletters`) are the library's.
const SEED_LABS: &str = "
CREATE TABLE IF NOT EXISTS sql_values(id INTEGER PRIMARY KEY, amount INTEGER CHECK(amount > 0));
CREATE TABLE IF NOT EXISTS sql_required(amount INTEGER NOT NULL CHECK(amount > 0));
INSERT OR IGNORE INTO sql_values VALUES(1,NULL),(2,NULL),(3,1),(4,2),(5,3);
CREATE TABLE IF NOT EXISTS products(id INTEGER PRIMARY KEY,name TEXT NOT NULL,category TEXT NOT NULL,price INTEGER NOT NULL CHECK(price>=0),active INTEGER NOT NULL CHECK(active IN(0,1)));
INSERT OR IGNORE INTO products VALUES(1,'Rune','books',30,1),(2,'rune','books',10,1),(3,'Sword','books',20,0),(4,'Shield','gear',20,1),(5,'RUNE','gear',15,0);
CREATE INDEX IF NOT EXISTS ix_products_category_price_id ON products(category,price,id);
CREATE INDEX IF NOT EXISTS ix_products_active_price ON products(price) WHERE active=1;
CREATE INDEX IF NOT EXISTS ix_products_lower_name ON products(lower(name));
CREATE TABLE IF NOT EXISTS counters(id INTEGER PRIMARY KEY,value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters VALUES(1,10);
CREATE TABLE IF NOT EXISTS orders(order_id TEXT PRIMARY KEY,quantity INTEGER NOT NULL CHECK(quantity BETWEEN 1 AND 10));
CREATE TABLE IF NOT EXISTS outbox(id INTEGER PRIMARY KEY AUTOINCREMENT,event_key TEXT UNIQUE NOT NULL,aggregate_id TEXT NOT NULL,sequence INTEGER NOT NULL,payload TEXT NOT NULL,status TEXT NOT NULL DEFAULT 'pending',owner TEXT,lease_until INTEGER,attempts INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS inbox(message_id TEXT PRIMARY KEY,payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS effects(id INTEGER PRIMARY KEY,total INTEGER NOT NULL);
INSERT OR IGNORE INTO effects VALUES(1,0);
CREATE TABLE IF NOT EXISTS documents(id INTEGER PRIMARY KEY,body TEXT NOT NULL,version INTEGER NOT NULL);
INSERT OR IGNORE INTO documents VALUES(1,'rune',1);
CREATE TABLE IF NOT EXISTS catalog_cache(id INTEGER PRIMARY KEY,name TEXT NOT NULL,version INTEGER NOT NULL);
INSERT OR IGNORE INTO catalog_cache VALUES(1,'rune',1);
CREATE TABLE IF NOT EXISTS contract_effect(id INTEGER PRIMARY KEY,value INTEGER NOT NULL);
INSERT OR IGNORE INTO contract_effect VALUES(1,0);
CREATE TABLE IF NOT EXISTS pipeline_requests(request_id TEXT PRIMARY KEY,payload TEXT NOT NULL,result_version INTEGER NOT NULL);
";

/// Migration 2 was the general ordered inbox. Its tables now belong to the ordered-inbox library,
/// which migrates them itself and recognises a file this migration already upgraded; for the
/// labs it is empty, and it keeps its number so that files at version 2 stay current.
const INBOX_MOVED: &str = "";

/// Migration 3: the general outbox ([`crate::labs::outbox`]). Its own table, so that the
/// classroom's `outbox` (shared with the pipeline lab) keeps its rows and meaning. One event per
/// key and per (aggregate, sequence); the index serves the lease's ordered scan of pending events.
const GENERAL_OUTBOX: &str = "
CREATE TABLE general_outbox(
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  event_key TEXT NOT NULL UNIQUE,
  aggregate_id TEXT NOT NULL,
  sequence INTEGER NOT NULL CHECK(sequence >= 1),
  amount INTEGER NOT NULL,
  status TEXT NOT NULL DEFAULT 'pending' CHECK(status IN ('pending','sent')),
  owner TEXT,
  lease_until INTEGER,
  generation INTEGER NOT NULL DEFAULT 0,
  created_at_ms INTEGER NOT NULL,
  sent_at_ms INTEGER,
  UNIQUE(aggregate_id, sequence)
);
CREATE INDEX ix_general_outbox_pending ON general_outbox(status, aggregate_id, sequence);
";

/// Migration 4: the index a lease walks. Only pending rows, in (aggregate, sequence) order, with
/// `lease_until` in the entry, so that a lease reads an aggregate's first pending event from the
/// index alone and, when that event is under a live lease, seeks past the whole aggregate instead
/// of reading the rows waiting behind it. It replaces migration 3's index, which held sent rows
/// too and needed the table row for `lease_until`.
const OUTBOX_LEASE_INDEX: &str = "
CREATE INDEX ix_general_outbox_pending_by_aggregate
  ON general_outbox(aggregate_id, sequence, lease_until) WHERE status = 'pending';
DROP INDEX ix_general_outbox_pending;
";

/// Every migration in order; migration `i` (0-based) brings the file to `user_version = i + 1`.
/// Append only: a released migration never changes.
pub const MIGRATIONS: &[&str] = &[SEED_LABS, INBOX_MOVED, GENERAL_OUTBOX, OUTBOX_LEASE_INDEX];

/// The schema version this build writes.
pub fn current_version() -> i64 {
    MIGRATIONS.len() as i64
}

/// Brings the labs' tables and then the inbox's up to date.
pub fn migrate(connection: &mut Connection) -> rusqlite::Result<()> {
    migrate_labs(connection)?;
    ordered_inbox::sqlite::schema::migrate(connection)
}

/// Brings the labs' tables up to [`current_version`], each step in its own transaction. A file
/// from a newer build is refused rather than guessed at.
fn migrate_labs(connection: &mut Connection) -> rusqlite::Result<()> {
    let found: i64 = connection.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    if found > current_version() {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_MISMATCH),
            Some(format!(
                "the database has schema version {found}, newer than this build's {}",
                current_version()
            )),
        ));
    }
    for (index, script) in MIGRATIONS.iter().enumerate().skip(found.max(0) as usize) {
        let transaction = connection.transaction()?;
        transaction.execute_batch(script)?;
        transaction.pragma_update(None, "user_version", index as i64 + 1)?;
        transaction.commit()?;
    }
    Ok(())
}
