//! Versioned schema migrations, tracked in `PRAGMA user_version`.
//!
//! Version 1 is exactly the seed's classroom schema and seed rows. It is written with
//! `IF NOT EXISTS`/`INSERT OR IGNORE` so that a database created by the original lab (which never
//! set `user_version`) upgrades in place. Later versions may only add: the seed's tables and
//! columns keep their names.

use rusqlite::Connection;

/// The seed's classroom schema and rows (migration 1).
const SEED_SCHEMA: &str = "
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
CREATE TABLE IF NOT EXISTS aggregate_state(aggregate_id TEXT PRIMARY KEY,last_sequence INTEGER NOT NULL,total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ordered_inbox(message_id TEXT PRIMARY KEY,payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS deadletters(message_id TEXT PRIMARY KEY,reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents(id INTEGER PRIMARY KEY,body TEXT NOT NULL,version INTEGER NOT NULL);
INSERT OR IGNORE INTO documents VALUES(1,'rune',1);
CREATE TABLE IF NOT EXISTS catalog_cache(id INTEGER PRIMARY KEY,name TEXT NOT NULL,version INTEGER NOT NULL);
INSERT OR IGNORE INTO catalog_cache VALUES(1,'rune',1);
CREATE TABLE IF NOT EXISTS contract_effect(id INTEGER PRIMARY KEY,value INTEGER NOT NULL);
INSERT OR IGNORE INTO contract_effect VALUES(1,0);
CREATE TABLE IF NOT EXISTS pipeline_requests(request_id TEXT PRIMARY KEY,payload TEXT NOT NULL,result_version INTEGER NOT NULL);
";

/// The general ordered inbox (migration 2): every aggregate, dead letters with identity and
/// lifecycle, the per-aggregate timeline, operators and their audited resolutions.
///
/// Additive only. Rows written by the seed are backfilled: applied messages get their aggregate,
/// sequence and amount from the canonical payload; dead letters get the seed's only aggregate,
/// `demo` (their sequence and payload were never stored, so they stay unknown).
const GENERAL_INBOX: &str = "
ALTER TABLE ordered_inbox ADD COLUMN aggregate_id TEXT;
ALTER TABLE ordered_inbox ADD COLUMN sequence INTEGER;
ALTER TABLE ordered_inbox ADD COLUMN amount INTEGER;
ALTER TABLE ordered_inbox ADD COLUMN applied_at TEXT;
UPDATE ordered_inbox
   SET aggregate_id = json_extract(payload, '$.AggregateId'),
       sequence = json_extract(payload, '$.Sequence'),
       amount = json_extract(payload, '$.Amount')
 WHERE json_valid(payload);
CREATE UNIQUE INDEX ix_ordered_inbox_aggregate_sequence ON ordered_inbox(aggregate_id, sequence);

ALTER TABLE aggregate_state ADD COLUMN status TEXT NOT NULL DEFAULT 'flowing';
ALTER TABLE aggregate_state ADD COLUMN status_since TEXT;
UPDATE aggregate_state SET status_since = strftime('%Y-%m-%dT%H:%M:%fZ', 'now');
CREATE INDEX ix_aggregate_state_status ON aggregate_state(status, status_since);

ALTER TABLE deadletters ADD COLUMN aggregate_id TEXT;
ALTER TABLE deadletters ADD COLUMN sequence INTEGER;
ALTER TABLE deadletters ADD COLUMN payload TEXT;
ALTER TABLE deadletters ADD COLUMN first_seen TEXT;
ALTER TABLE deadletters ADD COLUMN last_seen TEXT;
ALTER TABLE deadletters ADD COLUMN observations INTEGER NOT NULL DEFAULT 1;
ALTER TABLE deadletters ADD COLUMN status TEXT NOT NULL DEFAULT 'open';
ALTER TABLE deadletters ADD COLUMN superseded_by TEXT;
ALTER TABLE deadletters ADD COLUMN closed_at TEXT;
ALTER TABLE deadletters ADD COLUMN resolution_id INTEGER;
UPDATE deadletters SET aggregate_id = 'demo' WHERE aggregate_id IS NULL;
CREATE INDEX ix_deadletters_open ON deadletters(aggregate_id, sequence) WHERE status = 'open';
CREATE INDEX ix_deadletters_status ON deadletters(status, first_seen);
CREATE INDEX ix_deadletters_first_seen ON deadletters(first_seen);
CREATE INDEX ix_deadletters_aggregate ON deadletters(aggregate_id, status, first_seen);

CREATE TABLE aggregate_timeline(
    id INTEGER PRIMARY KEY,
    aggregate_id TEXT NOT NULL,
    at TEXT NOT NULL,
    kind TEXT NOT NULL,
    sequence INTEGER,
    message_id TEXT,
    detail TEXT,
    observation_no INTEGER
);
CREATE INDEX ix_timeline_aggregate ON aggregate_timeline(aggregate_id, id);
CREATE UNIQUE INDEX ix_timeline_observations ON aggregate_timeline(aggregate_id, observation_no)
    WHERE observation_no IS NOT NULL;

CREATE TABLE operators(
    name TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    revoked_at TEXT
);

CREATE TABLE resolutions(
    id INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL UNIQUE REFERENCES deadletters(message_id),
    aggregate_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    action TEXT NOT NULL CHECK(action IN ('replace', 'skip')),
    operator TEXT NOT NULL REFERENCES operators(name),
    reason TEXT NOT NULL,
    expected_last INTEGER NOT NULL,
    replacement_message_id TEXT,
    replacement_amount INTEGER,
    before_last INTEGER NOT NULL,
    before_total INTEGER NOT NULL,
    after_last INTEGER NOT NULL,
    after_total INTEGER NOT NULL,
    resolved_at TEXT NOT NULL
);
CREATE INDEX ix_resolutions_aggregate ON resolutions(aggregate_id, id);
";

/// Every migration in order; migration `i` (0-based) brings the file to `user_version = i + 1`.
/// Append only: a released migration never changes.
pub const MIGRATIONS: &[&str] = &[SEED_SCHEMA, GENERAL_INBOX];

/// The schema version this build writes.
pub fn current_version() -> i64 {
    MIGRATIONS.len() as i64
}

/// Brings the file up to [`current_version`], each step in its own transaction. A file from a
/// newer build is refused rather than guessed at.
pub fn migrate(connection: &mut Connection) -> rusqlite::Result<()> {
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

/// A private in-memory database at the current schema, for unit tests of the SQL code.
#[cfg(test)]
pub(crate) fn migrated_in_memory() -> Connection {
    let mut connection = Connection::open_in_memory().expect("open an in-memory database");
    migrate(&mut connection).expect("migrate an in-memory database");
    connection
}
