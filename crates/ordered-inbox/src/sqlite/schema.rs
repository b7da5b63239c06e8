//! The inbox's tables in SQLite and their migrations, tracked in the inbox's own table
//! `ordered_inbox_schema`, so that the file's owner keeps `PRAGMA user_version` for its tables.
//!
//! Version 1 is the seed's three tables, exactly as the original lab created them; later versions
//! only add. A file written before the version table existed is recognised by its columns: the
//! original lab's (version 0 or 1 there) has no `ordered_inbox.aggregate_id`, the first release of
//! the general inbox (its `user_version` 2) has it.

use rusqlite::{Connection, OptionalExtension};

/// The seed's inbox tables (version 1).
const SEED_TABLES: &str = "
CREATE TABLE IF NOT EXISTS aggregate_state(aggregate_id TEXT PRIMARY KEY,last_sequence INTEGER NOT NULL,total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ordered_inbox(message_id TEXT PRIMARY KEY,payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS deadletters(message_id TEXT PRIMARY KEY,reason TEXT NOT NULL);
";

/// The general inbox (version 2): every aggregate, dead letters with identity and lifecycle, the
/// per-aggregate timeline, operators and their audited resolutions.
///
/// Rows written by the seed are backfilled: applied messages get their aggregate, sequence and
/// amount from the canonical payload; dead letters get the seed's only aggregate, `demo` (their
/// sequence and payload were never stored, so they stay unknown).
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

/// A stable number per dead letter (version 3), the cursor of `/deadletters` pages: the order
/// they were first recorded in. Existing rows are numbered in their first-seen order.
const DEAD_LETTER_NUMBERS: &str = "
ALTER TABLE deadletters ADD COLUMN id INTEGER;
UPDATE deadletters SET id = numbered.n
  FROM (SELECT message_id, ROW_NUMBER() OVER (ORDER BY first_seen, message_id) AS n
          FROM deadletters) AS numbered
 WHERE numbered.message_id = deadletters.message_id;
CREATE UNIQUE INDEX ix_deadletters_id ON deadletters(id);
CREATE INDEX ix_deadletters_status_id ON deadletters(status, id);
CREATE INDEX ix_deadletters_aggregate_id ON deadletters(aggregate_id, status, id);
CREATE INDEX ix_deadletters_aggregate_all_id ON deadletters(aggregate_id, id);
";

/// Held successors (version 4): messages a broker delivered ahead of their turn, one row each
/// until their predecessor applies and they drain (the row is then deleted; the timeline keeps
/// `held` and `drained`). At most one per (aggregate, sequence): the first held wins.
const HELD_MESSAGES: &str = "
CREATE TABLE held_messages(
    message_id TEXT PRIMARY KEY,
    aggregate_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    amount INTEGER NOT NULL,
    payload TEXT NOT NULL,
    held_at TEXT NOT NULL
);
CREATE UNIQUE INDEX ix_held_messages_aggregate_sequence ON held_messages(aggregate_id, sequence);
";

/// Producers and ownership (version 5): the producers registered on the machine (a token's hash,
/// like operators, plus the epoch of their latest session and when they last delivered), each
/// aggregate's owner and the epoch it was claimed or transferred under, and the audit rows of
/// operators' transfers. Existing aggregates stay unowned.
const PRODUCERS: &str = "
CREATE TABLE producers(
    name TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    revoked_at TEXT,
    current_epoch INTEGER NOT NULL DEFAULT 0,
    last_delivery_at TEXT
);
ALTER TABLE aggregate_state ADD COLUMN owner TEXT REFERENCES producers(name);
ALTER TABLE aggregate_state ADD COLUMN owner_epoch INTEGER;
ALTER TABLE aggregate_state ADD COLUMN owner_since TEXT;
CREATE INDEX ix_aggregate_state_owner ON aggregate_state(owner) WHERE owner IS NOT NULL;
CREATE TABLE ownership_transfers(
    id INTEGER PRIMARY KEY,
    aggregate_id TEXT NOT NULL,
    operator TEXT NOT NULL REFERENCES operators(name),
    from_owner TEXT,
    to_owner TEXT NOT NULL REFERENCES producers(name),
    epoch INTEGER NOT NULL,
    last INTEGER NOT NULL,
    reason TEXT NOT NULL,
    transferred_at TEXT NOT NULL
);
CREATE INDEX ix_ownership_transfers_aggregate ON ownership_transfers(aggregate_id, id);
";

/// A message id belongs to its producer (version 6): `ordered_inbox` and `deadletters` gain a
/// `producer` column (`''`: the anonymous namespace, where every existing row goes) and their
/// identity becomes `(producer, message_id)`; `resolutions`, whose foreign key names the dead
/// letter, follows. `message_id` was each table's PRIMARY KEY, which no `ALTER TABLE` changes, so
/// the three tables are rebuilt following SQLite's procedure for other schema changes (foreign
/// keys off around the transaction, see [`migrate`]): create the new table, copy every column and
/// value, drop the old one, rename the new one, recreate the indexes. There are no views or
/// triggers on them. The new column comes last, so existing columns keep their positions.
const PRODUCER_IDENTITY: &str = "
CREATE TABLE ordered_inbox_v6(
    message_id TEXT,
    payload TEXT NOT NULL,
    aggregate_id TEXT,
    sequence INTEGER,
    amount INTEGER,
    applied_at TEXT,
    producer TEXT NOT NULL DEFAULT '',
    PRIMARY KEY(producer, message_id)
);
INSERT INTO ordered_inbox_v6(message_id, payload, aggregate_id, sequence, amount, applied_at)
SELECT message_id, payload, aggregate_id, sequence, amount, applied_at FROM ordered_inbox;

CREATE TABLE deadletters_v6(
    message_id TEXT,
    reason TEXT NOT NULL,
    aggregate_id TEXT,
    sequence INTEGER,
    payload TEXT,
    first_seen TEXT,
    last_seen TEXT,
    observations INTEGER NOT NULL DEFAULT 1,
    status TEXT NOT NULL DEFAULT 'open',
    superseded_by TEXT,
    closed_at TEXT,
    resolution_id INTEGER,
    id INTEGER,
    producer TEXT NOT NULL DEFAULT '',
    PRIMARY KEY(producer, message_id)
);
INSERT INTO deadletters_v6(message_id, reason, aggregate_id, sequence, payload, first_seen,
                           last_seen, observations, status, superseded_by, closed_at,
                           resolution_id, id)
SELECT message_id, reason, aggregate_id, sequence, payload, first_seen, last_seen, observations,
       status, superseded_by, closed_at, resolution_id, id
  FROM deadletters;

CREATE TABLE resolutions_v6(
    id INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL,
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
    resolved_at TEXT NOT NULL,
    producer TEXT NOT NULL DEFAULT '',
    UNIQUE(producer, message_id),
    FOREIGN KEY(producer, message_id) REFERENCES deadletters(producer, message_id)
);
INSERT INTO resolutions_v6(id, message_id, aggregate_id, sequence, action, operator, reason,
                           expected_last, replacement_message_id, replacement_amount,
                           before_last, before_total, after_last, after_total, resolved_at)
SELECT id, message_id, aggregate_id, sequence, action, operator, reason, expected_last,
       replacement_message_id, replacement_amount, before_last, before_total, after_last,
       after_total, resolved_at
  FROM resolutions;

DROP TABLE resolutions;
DROP TABLE deadletters;
DROP TABLE ordered_inbox;
ALTER TABLE ordered_inbox_v6 RENAME TO ordered_inbox;
ALTER TABLE deadletters_v6 RENAME TO deadletters;
ALTER TABLE resolutions_v6 RENAME TO resolutions;

CREATE UNIQUE INDEX ix_ordered_inbox_aggregate_sequence ON ordered_inbox(aggregate_id, sequence);
CREATE INDEX ix_deadletters_open ON deadletters(aggregate_id, sequence) WHERE status = 'open';
CREATE INDEX ix_deadletters_status ON deadletters(status, first_seen);
CREATE INDEX ix_deadletters_first_seen ON deadletters(first_seen);
CREATE INDEX ix_deadletters_aggregate ON deadletters(aggregate_id, status, first_seen);
CREATE UNIQUE INDEX ix_deadletters_id ON deadletters(id);
CREATE INDEX ix_deadletters_status_id ON deadletters(status, id);
CREATE INDEX ix_deadletters_aggregate_id ON deadletters(aggregate_id, status, id);
CREATE INDEX ix_deadletters_aggregate_all_id ON deadletters(aggregate_id, id);
CREATE INDEX ix_resolutions_aggregate ON resolutions(aggregate_id, id);
";

/// The `applied` event lives on the inbox row (version 7). Every applied message wrote the same
/// facts twice: its `ordered_inbox` row and an `applied` timeline row, whose index entry cost a
/// random B-tree leaf and about 12% of a delivery's instructions. The inbox row now
/// carries the event's number (`event_id`) and the aggregate's total after it (`total_after`),
/// and the timeline view reads applied events from there. Event numbers stay one sequence for
/// both tables, taken from `timeline_ids`, which starts past every number already used.
/// Existing `applied` rows move onto their inbox rows, keeping their numbers, when the inbox row
/// says exactly what they say (time, amount, the detail's text); any other stays where it is.
/// Inbox rows from before the timeline have no event, as before.
const APPLIED_ON_THE_INBOX_ROW: &str = "
ALTER TABLE ordered_inbox ADD COLUMN event_id INTEGER;
ALTER TABLE ordered_inbox ADD COLUMN total_after INTEGER;

CREATE TABLE timeline_ids(
    id INTEGER PRIMARY KEY CHECK (id = 1),
    last_id INTEGER NOT NULL
);
INSERT INTO timeline_ids(id, last_id) SELECT 1, COALESCE(MAX(id), 0) FROM aggregate_timeline;

UPDATE ordered_inbox
   SET event_id = t.id, total_after = json_extract(t.detail, '$.total')
  FROM aggregate_timeline AS t
 WHERE t.kind = 'applied'
   AND t.aggregate_id = ordered_inbox.aggregate_id
   AND t.sequence = ordered_inbox.sequence
   AND t.message_id = ordered_inbox.message_id
   AND t.at = ordered_inbox.applied_at
   AND t.detail = json_object(
           'amount', ordered_inbox.amount,
           'total', CASE WHEN json_valid(t.detail) THEN json_extract(t.detail, '$.total') END);
DELETE FROM aggregate_timeline
 WHERE kind = 'applied'
   AND id IN (SELECT event_id FROM ordered_inbox WHERE event_id IS NOT NULL);
";

/// The rejected list in the store (version 8): deliveries a broker consumer terminated and held
/// messages the inbox rejected, the newest `REJECTED_KEPT` kept (each insert prunes by `id`,
/// which only grows: the oldest rows go first, so the newest id stays and none is reused). The
/// transfers' audit rows count the held messages each transfer rejected.
const REJECTED_DELIVERIES: &str = "
CREATE TABLE rejected_deliveries(
    id INTEGER PRIMARY KEY,
    at TEXT NOT NULL,
    subject TEXT,
    stream_sequence INTEGER,
    delivered INTEGER,
    message_id TEXT,
    aggregate_id TEXT,
    producer TEXT,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL
);
ALTER TABLE ownership_transfers ADD COLUMN held_rejected INTEGER NOT NULL DEFAULT 0;
";

/// The seed's key columns first again: the seed keyed `ordered_inbox` and `deadletters` by
/// `message_id`, and version 6 made their primary key `(producer, message_id)`. The key becomes
/// `(message_id, producer)`, so the seed's key is the first column of the table's key once more (a
/// lookup by message id alone still seeks it). A primary key is changed only by rebuilding the
/// table, as in version 6 (see [`REBUILDS`]): every column and value is copied, each row keeps its
/// rowid, and the indexes are recreated as they were. `resolutions` keeps its key; its foreign
/// key names the dead letter's columns, which the new key still makes unique.
const SEED_KEYS_FIRST: &str = "
CREATE TABLE ordered_inbox_seed_key(
    message_id TEXT,
    payload TEXT NOT NULL,
    aggregate_id TEXT,
    sequence INTEGER,
    amount INTEGER,
    applied_at TEXT,
    producer TEXT NOT NULL DEFAULT '',
    event_id INTEGER,
    total_after INTEGER,
    PRIMARY KEY(message_id, producer)
);
INSERT INTO ordered_inbox_seed_key(rowid, message_id, payload, aggregate_id, sequence, amount,
                                   applied_at, producer, event_id, total_after)
SELECT rowid, message_id, payload, aggregate_id, sequence, amount, applied_at, producer, event_id,
       total_after
  FROM ordered_inbox;

CREATE TABLE deadletters_seed_key(
    message_id TEXT,
    reason TEXT NOT NULL,
    aggregate_id TEXT,
    sequence INTEGER,
    payload TEXT,
    first_seen TEXT,
    last_seen TEXT,
    observations INTEGER NOT NULL DEFAULT 1,
    status TEXT NOT NULL DEFAULT 'open',
    superseded_by TEXT,
    closed_at TEXT,
    resolution_id INTEGER,
    id INTEGER,
    producer TEXT NOT NULL DEFAULT '',
    PRIMARY KEY(message_id, producer)
);
INSERT INTO deadletters_seed_key(rowid, message_id, reason, aggregate_id, sequence, payload,
                                 first_seen, last_seen, observations, status, superseded_by,
                                 closed_at, resolution_id, id, producer)
SELECT rowid, message_id, reason, aggregate_id, sequence, payload, first_seen, last_seen,
       observations, status, superseded_by, closed_at, resolution_id, id, producer
  FROM deadletters;

DROP TABLE deadletters;
DROP TABLE ordered_inbox;
ALTER TABLE ordered_inbox_seed_key RENAME TO ordered_inbox;
ALTER TABLE deadletters_seed_key RENAME TO deadletters;

CREATE UNIQUE INDEX ix_ordered_inbox_aggregate_sequence ON ordered_inbox(aggregate_id, sequence);
CREATE INDEX ix_deadletters_open ON deadletters(aggregate_id, sequence) WHERE status = 'open';
CREATE INDEX ix_deadletters_status ON deadletters(status, first_seen);
CREATE INDEX ix_deadletters_first_seen ON deadletters(first_seen);
CREATE INDEX ix_deadletters_aggregate ON deadletters(aggregate_id, status, first_seen);
CREATE UNIQUE INDEX ix_deadletters_id ON deadletters(id);
CREATE INDEX ix_deadletters_status_id ON deadletters(status, id);
CREATE INDEX ix_deadletters_aggregate_id ON deadletters(aggregate_id, status, id);
CREATE INDEX ix_deadletters_aggregate_all_id ON deadletters(aggregate_id, id);
";

/// Content of the application's own (version 10): the inbox stops keeping the lesson's ledger
/// figures in its rows and keeps what an application's handler gives it instead. Each generic
/// column replaces a ledger one with the same meaning for every existing row (all of them were
/// written by the lesson's ledger, whose canonical content is `{"AggregateId":…,"Sequence":…,
/// "Amount":…}`):
///
/// - `ordered_inbox.applied_detail`: the handler's detail of the `applied` event, replacing
///   `total_after`; an existing event's detail is the one the view showed for it;
/// - `held_messages.message_payload`: the payload as delivered, which a drain hands to the
///   handler, replacing `amount` (an existing row's payload was its canonical content);
/// - `resolutions.replacement_payload`, `before_state`, `after_state`: the replacement's payload
///   and the handler's state of the aggregate before and after, replacing the replacement's
///   amount and the totals.
///
/// `ordered_inbox.amount` and `aggregate_state.total` stay, unwritten by the inbox (a new
/// aggregate row gets 0): they are the seed's and its readers', an application may keep them.
const APPLICATION_CONTENT: &str = "
ALTER TABLE ordered_inbox ADD COLUMN applied_detail TEXT;
UPDATE ordered_inbox SET applied_detail = json_object('amount', amount, 'total', total_after)
 WHERE event_id IS NOT NULL AND total_after IS NOT NULL;
ALTER TABLE ordered_inbox DROP COLUMN total_after;

ALTER TABLE held_messages ADD COLUMN message_payload TEXT;
UPDATE held_messages SET message_payload = payload;
ALTER TABLE held_messages DROP COLUMN amount;

ALTER TABLE resolutions ADD COLUMN replacement_payload TEXT;
ALTER TABLE resolutions ADD COLUMN before_state TEXT;
ALTER TABLE resolutions ADD COLUMN after_state TEXT;
UPDATE resolutions
   SET replacement_payload = CASE WHEN replacement_message_id IS NOT NULL THEN
           json_object('AggregateId', aggregate_id, 'Sequence', sequence,
                       'Amount', replacement_amount) END,
       before_state = json_object('total', before_total),
       after_state = json_object('total', after_total);
ALTER TABLE resolutions DROP COLUMN replacement_amount;
ALTER TABLE resolutions DROP COLUMN before_total;
ALTER TABLE resolutions DROP COLUMN after_total;
";

/// Gaps that never fill (version 11): per aggregate the lowest sequence the general door refused
/// as a gap, and the aggregate's last when it was refused (a note taken at an older last says
/// nothing about now), from which a waiting aggregate's missing range is told; and the audit
/// rows of operators' gap resolutions, numbered in the same sequence as `resolutions` (a new row
/// of either takes one past the highest of both), at most one per (aggregate, first skipped
/// sequence), with the held messages each one drained.
const GAPS: &str = "
CREATE TABLE refused_gaps(
    aggregate_id TEXT PRIMARY KEY,
    after_last INTEGER NOT NULL,
    lowest INTEGER NOT NULL
);
CREATE TABLE gap_resolutions(
    id INTEGER PRIMARY KEY,
    aggregate_id TEXT NOT NULL,
    from_sequence INTEGER NOT NULL,
    through_sequence INTEGER NOT NULL,
    operator TEXT NOT NULL REFERENCES operators(name),
    reason TEXT NOT NULL,
    expected_last INTEGER NOT NULL,
    before_last INTEGER NOT NULL,
    before_state TEXT,
    after_last INTEGER NOT NULL,
    after_state TEXT,
    drained TEXT NOT NULL,
    resolved_at TEXT NOT NULL
);
CREATE UNIQUE INDEX ix_gap_resolutions_aggregate_from ON gap_resolutions(aggregate_id, from_sequence);
CREATE INDEX ix_gap_resolutions_aggregate ON gap_resolutions(aggregate_id, id);
";

/// A held message belongs to its producer (version 12): `held_messages` gains `producer` (`''`:
/// the anonymous namespace, where every existing row goes) and `epoch` (the one the message was
/// sent under; none for an anonymous one), and its identity becomes `(producer, message_id)`.
/// `message_id` was the table's PRIMARY KEY, which no `ALTER TABLE` changes, so the table is
/// rebuilt; no foreign key names it, so an ordinary transaction does.
const HELD_PRODUCERS: &str = "
CREATE TABLE held_messages_v12(
    message_id TEXT NOT NULL,
    aggregate_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    payload TEXT NOT NULL,
    held_at TEXT NOT NULL,
    message_payload TEXT,
    producer TEXT NOT NULL DEFAULT '',
    epoch INTEGER,
    PRIMARY KEY(producer, message_id)
);
INSERT INTO held_messages_v12(message_id, aggregate_id, sequence, payload, held_at,
                              message_payload)
SELECT message_id, aggregate_id, sequence, payload, held_at, message_payload FROM held_messages;
DROP TABLE held_messages;
ALTER TABLE held_messages_v12 RENAME TO held_messages;
CREATE UNIQUE INDEX ix_held_messages_aggregate_sequence ON held_messages(aggregate_id, sequence);
";

/// A resolution may accept a dead letter (version 13): its own message applied as it was
/// delivered, once it passes the check. `resolutions.action` allows `accept` beside `replace` and
/// `skip`. A CHECK constraint is changed only by rebuilding the table (see [`REBUILDS`]): every
/// column and value is copied by name, each row keeps its id, and the index is recreated.
const ACCEPTED_DEAD_LETTERS: &str = "
CREATE TABLE resolutions_v13(
    id INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL,
    aggregate_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    action TEXT NOT NULL CHECK(action IN ('replace', 'skip', 'accept')),
    operator TEXT NOT NULL REFERENCES operators(name),
    reason TEXT NOT NULL,
    expected_last INTEGER NOT NULL,
    replacement_message_id TEXT,
    before_last INTEGER NOT NULL,
    after_last INTEGER NOT NULL,
    resolved_at TEXT NOT NULL,
    producer TEXT NOT NULL DEFAULT '',
    replacement_payload TEXT,
    before_state TEXT,
    after_state TEXT,
    UNIQUE(producer, message_id),
    FOREIGN KEY(producer, message_id) REFERENCES deadletters(producer, message_id)
);
INSERT INTO resolutions_v13(id, message_id, aggregate_id, sequence, action, operator, reason,
                            expected_last, replacement_message_id, before_last, after_last,
                            resolved_at, producer, replacement_payload, before_state, after_state)
SELECT id, message_id, aggregate_id, sequence, action, operator, reason, expected_last,
       replacement_message_id, before_last, after_last, resolved_at, producer,
       replacement_payload, before_state, after_state
  FROM resolutions;
DROP TABLE resolutions;
ALTER TABLE resolutions_v13 RENAME TO resolutions;
CREATE INDEX ix_resolutions_aggregate ON resolutions(aggregate_id, id);
";

/// Resolved dead letters can be pruned (version 14): a resolution row is the audit trail by
/// itself (the message's id, aggregate, sequence, the operator, the reason and the states before
/// and after), so it no longer needs the dead letter it resolved to stay. The foreign key from
/// `resolutions` to `deadletters` goes; a rebuild is the way to drop one (see [`REBUILDS`]).
const SELF_CONTAINED_RESOLUTIONS: &str = "
CREATE TABLE resolutions_v14(
    id INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL,
    aggregate_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    action TEXT NOT NULL CHECK(action IN ('replace', 'skip', 'accept')),
    operator TEXT NOT NULL REFERENCES operators(name),
    reason TEXT NOT NULL,
    expected_last INTEGER NOT NULL,
    replacement_message_id TEXT,
    before_last INTEGER NOT NULL,
    after_last INTEGER NOT NULL,
    resolved_at TEXT NOT NULL,
    producer TEXT NOT NULL DEFAULT '',
    replacement_payload TEXT,
    before_state TEXT,
    after_state TEXT,
    UNIQUE(producer, message_id)
);
INSERT INTO resolutions_v14(id, message_id, aggregate_id, sequence, action, operator, reason,
                            expected_last, replacement_message_id, before_last, after_last,
                            resolved_at, producer, replacement_payload, before_state, after_state)
SELECT id, message_id, aggregate_id, sequence, action, operator, reason, expected_last,
       replacement_message_id, before_last, after_last, resolved_at, producer,
       replacement_payload, before_state, after_state
  FROM resolutions;
DROP TABLE resolutions;
ALTER TABLE resolutions_v14 RENAME TO resolutions;
CREATE INDEX ix_resolutions_aggregate ON resolutions(aggregate_id, id);
";

/// Every migration in order; migration `i` (0-based) brings the inbox to version `i + 1`.
/// Append only: a released migration never changes.
pub const MIGRATIONS: &[&str] = &[
    SEED_TABLES,
    GENERAL_INBOX,
    DEAD_LETTER_NUMBERS,
    HELD_MESSAGES,
    PRODUCERS,
    PRODUCER_IDENTITY,
    APPLIED_ON_THE_INBOX_ROW,
    REJECTED_DELIVERIES,
    SEED_KEYS_FIRST,
    APPLICATION_CONTENT,
    GAPS,
    HELD_PRODUCERS,
    ACCEPTED_DEAD_LETTERS,
    SELF_CONTAINED_RESOLUTIONS,
];

/// The migrations that rebuild tables: they run with foreign keys off, and check them before
/// they commit. Named by their script rather than by position, so that appending a migration
/// never moves an entry here.
const REBUILDS: &[&str] = &[
    PRODUCER_IDENTITY,
    SEED_KEYS_FIRST,
    ACCEPTED_DEAD_LETTERS,
    SELF_CONTAINED_RESOLUTIONS,
];

/// The inbox schema version this build writes.
pub fn current_version() -> i64 {
    MIGRATIONS.len() as i64
}

/// Brings the inbox's tables up to [`current_version`], each step in its own transaction. A file
/// from a newer build is refused rather than guessed at.
pub fn migrate(connection: &mut Connection) -> rusqlite::Result<()> {
    migrate_to(connection, current_version())
}

/// Brings the inbox's tables up to version `target`: the steps of [`migrate`], and for tests a
/// file as an earlier release left it. A file at or past `target` is left as it is (one newer
/// than this build is refused).
fn migrate_to(connection: &mut Connection, target: i64) -> rusqlite::Result<()> {
    let found = found_version(connection)?;
    if found > current_version() {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_MISMATCH),
            Some(format!(
                "the ordered inbox has schema version {found}, newer than this build's {}",
                current_version()
            )),
        ));
    }
    let steps = MIGRATIONS.iter().enumerate().take(target.max(0) as usize);
    for (index, script) in steps.skip(found.max(0) as usize) {
        if REBUILDS.contains(script) {
            rebuild(connection, index, script)?;
            continue;
        }
        let transaction = connection.transaction()?;
        transaction.execute_batch(script)?;
        transaction.execute_batch(
            "CREATE TABLE IF NOT EXISTS ordered_inbox_schema(version INTEGER NOT NULL);
             DELETE FROM ordered_inbox_schema;",
        )?;
        transaction.execute(
            "INSERT INTO ordered_inbox_schema(version) VALUES (?1)",
            [index as i64 + 1],
        )?;
        transaction.commit()?;
    }
    Ok(())
}

/// A migration that rebuilds tables, as SQLite's procedure for schema changes asks: foreign keys
/// off outside the transaction (the pragma is a no-op inside one), the script, a foreign key
/// check that must find nothing, the version, commit; foreign keys back as they were.
fn rebuild(connection: &mut Connection, index: usize, script: &str) -> rusqlite::Result<()> {
    let enforced: bool = connection.query_row("PRAGMA foreign_keys", [], |row| row.get(0))?;
    connection.pragma_update(None, "foreign_keys", false)?;
    let result = (|| {
        let transaction = connection.transaction()?;
        transaction.execute_batch(script)?;
        let violations: i64 = transaction.query_row(
            "SELECT COUNT(*) FROM pragma_foreign_key_check('resolutions')",
            [],
            |row| row.get(0),
        )?;
        if violations > 0 {
            return Err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY),
                Some(format!(
                    "inbox migration {} would leave {violations} foreign key violations",
                    index + 1
                )),
            ));
        }
        transaction.execute_batch(
            "CREATE TABLE IF NOT EXISTS ordered_inbox_schema(version INTEGER NOT NULL);
             DELETE FROM ordered_inbox_schema;",
        )?;
        transaction.execute(
            "INSERT INTO ordered_inbox_schema(version) VALUES (?1)",
            [index as i64 + 1],
        )?;
        transaction.commit()
    })();
    connection.pragma_update(None, "foreign_keys", enforced)?;
    result
}

/// The version recorded, or the one a file from before the version table is at.
pub fn found_version(connection: &Connection) -> rusqlite::Result<i64> {
    if table_exists(connection, "ordered_inbox_schema")? {
        return connection.query_row("SELECT MAX(version) FROM ordered_inbox_schema", [], |row| {
            Ok(row.get::<_, Option<i64>>(0)?.unwrap_or(0))
        });
    }
    if !table_exists(connection, "ordered_inbox")? {
        return Ok(0);
    }
    let general: bool = connection.query_row(
        "SELECT EXISTS(SELECT 1 FROM pragma_table_info('ordered_inbox') WHERE name = 'aggregate_id')",
        [],
        |row| row.get(0),
    )?;
    Ok(if general { 2 } else { 1 })
}

fn table_exists(connection: &Connection, name: &str) -> rusqlite::Result<bool> {
    Ok(connection
        .query_row(
            "SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?1",
            [name],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// A private in-memory database at the current schema, for unit tests of the SQL code.
#[cfg(test)]
pub(crate) fn migrated_in_memory() -> Connection {
    let mut connection = Connection::open_in_memory().expect("open an in-memory database");
    connection
        .pragma_update(None, "foreign_keys", true)
        .expect("foreign keys");
    migrate(&mut connection).expect("migrate an in-memory database");
    connection
}

/// The detail lines of SQLite's plan for `sql` with `params` bound (`SEARCH …`, `SCAN …`), for
/// unit tests that pin which statements seek an index.
#[cfg(test)]
pub(crate) fn query_plan(
    connection: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Vec<String> {
    connection
        .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
        .expect("a statement to explain")
        .query_map(params, |row| row.get(3))
        .expect("its plan")
        .map(|detail| detail.expect("a plan line"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::PageRequest;

    #[test]
    fn a_seed_file_is_recognised_and_upgraded_once() {
        let mut connection = Connection::open_in_memory().unwrap();
        connection.execute_batch(SEED_TABLES).unwrap();
        connection
            .execute_batch(
                "INSERT INTO deadletters VALUES('poison-2','negative amount');
                 INSERT INTO deadletters VALUES('poison-1','negative amount');",
            )
            .unwrap();
        assert_eq!(found_version(&connection).unwrap(), 1);
        migrate(&mut connection).unwrap();
        assert_eq!(found_version(&connection).unwrap(), current_version());
        migrate(&mut connection).unwrap();
        let numbered: Vec<(String, i64)> = connection
            .prepare("SELECT message_id, id FROM deadletters ORDER BY id")
            .unwrap()
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            numbered,
            [("poison-1".to_owned(), 1), ("poison-2".to_owned(), 2)]
        );
    }

    #[test]
    fn version_6_rebuilds_the_identity_tables_with_every_row_anonymous() {
        let mut connection = Connection::open_in_memory().unwrap();
        connection
            .pragma_update(None, "foreign_keys", true)
            .unwrap();
        for script in &MIGRATIONS[..5] {
            connection.execute_batch(script).unwrap();
        }
        connection
            .execute_batch(
                "CREATE TABLE ordered_inbox_schema(version INTEGER NOT NULL);
                 INSERT INTO ordered_inbox_schema VALUES (5);
                 INSERT INTO operators VALUES ('alice', 'h', 't', NULL);
                 INSERT INTO ordered_inbox VALUES ('m-1', '{\"p\":1}', 'a', 1, 1, 't1');
                 INSERT INTO deadletters(message_id, reason, aggregate_id, sequence, payload,
                                         first_seen, last_seen, status, resolution_id, id)
                 VALUES ('bad-2', 'negative amount', 'a', 2, '{}', 't2', 't3', 'resolved', 1, 1);
                 INSERT INTO resolutions VALUES (1, 'bad-2', 'a', 2, 'skip', 'alice', 'why', 1,
                                                 NULL, NULL, 1, 1, 2, 1, 't4');",
            )
            .unwrap();
        migrate(&mut connection).unwrap();
        assert_eq!(found_version(&connection).unwrap(), current_version());
        let foreign_keys: bool = connection
            .query_row("PRAGMA foreign_keys", [], |row| row.get(0))
            .unwrap();
        assert!(foreign_keys, "foreign keys are back on");
        let rows: Vec<String> = connection
            .prepare(
                "SELECT 'i|' || producer || '|' || message_id || '|' || payload || '|' || applied_at
                   FROM ordered_inbox
                 UNION ALL
                 SELECT 'd|' || producer || '|' || message_id || '|' || status || '|' || id
                   FROM deadletters
                 UNION ALL
                 SELECT 'r|' || producer || '|' || message_id || '|' || operator || '|' || id
                   FROM resolutions",
            )
            .unwrap()
            .query_map([], |row| row.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            rows,
            [
                "i||m-1|{\"p\":1}|t1",
                "d||bad-2|resolved|1",
                "r||bad-2|alice|1"
            ]
        );
        // The same id in another namespace is another row; in the same one it is refused.
        connection
            .execute(
                "INSERT INTO ordered_inbox(message_id, payload, producer) VALUES ('m-1', '{}', 'billing')",
                [],
            )
            .unwrap();
        assert!(
            connection
                .execute(
                    "INSERT INTO ordered_inbox(message_id, payload) VALUES ('m-1', '{}')",
                    []
                )
                .is_err()
        );
        // The resolution's foreign key follows the dead letter's new identity.
        assert!(
            connection
                .execute(
                    "INSERT INTO resolutions VALUES (2, 'bad-2', 'a', 2, 'skip', 'alice', 'why', 1,
                                                     NULL, NULL, 1, 1, 2, 1, 't4', 'billing')",
                    []
                )
                .is_err()
        );
        let indexes: i64 = connection
            .query_row(
                "SELECT COUNT(*) FROM sqlite_schema WHERE type = 'index' AND name LIKE 'ix_%'
                   AND tbl_name IN ('ordered_inbox', 'deadletters', 'resolutions')",
                [],
                |row| row.get(0),
            )
            .unwrap();
        assert_eq!(indexes, 10);
    }

    /// The aggregate's timeline through the view, as `id|kind|sequence|message|at|detail`.
    fn timeline_of(connection: &Connection, aggregate: &str) -> Vec<String> {
        let page = crate::sqlite::views::timeline(
            connection,
            aggregate,
            crate::views::PageRequest {
                after: 0,
                limit: 100,
            },
        )
        .unwrap();
        page.items
            .iter()
            .map(|event| {
                format!(
                    "{}|{}|{}|{}|{}|{}",
                    event.id,
                    event.kind.as_str(),
                    event.sequence.unwrap_or(0),
                    event.message_id.as_deref().unwrap_or(""),
                    event.at,
                    event
                        .detail
                        .as_ref()
                        .map(|d| d.to_string())
                        .unwrap_or_default()
                )
            })
            .collect()
    }

    #[test]
    fn version_7_moves_applied_events_onto_their_inbox_rows_with_the_same_numbers() {
        let mut connection = Connection::open_in_memory().unwrap();
        for script in &MIGRATIONS[..5] {
            connection.execute_batch(script).unwrap();
        }
        rebuild(&mut connection, 5, MIGRATIONS[5]).unwrap();
        // A version 6 history: applied rows beside their inbox rows, an event between them,
        // and an applied row whose inbox row is missing.
        connection
            .execute_batch(
                r#"INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, amount,
                                           applied_at)
                 VALUES ('m-1', '{}', 'a', 1, 5, 't1'), ('m-2', '{}', 'a', 2, 2, 't3');
                 INSERT INTO aggregate_timeline(id, aggregate_id, at, kind, sequence, message_id,
                                                detail)
                 VALUES (1, 'a', 't1', 'applied', 1, 'm-1', '{"amount":5,"total":5}'),
                        (2, 'a', 't2', 'quarantined', 2, 'p-2',
                         '{"reason":"negative amount","amount":-1}'),
                        (4, 'a', 't3', 'applied', 2, 'm-2', '{"amount":2,"total":7}'),
                        (5, 'a', 't4', 'applied', 3, 'gone-3', '{"amount":1,"total":8}');"#,
            )
            .unwrap();
        // What version 6's view read: every row of the aggregate's timeline, by id.
        let before: Vec<String> = connection
            .prepare(
                "SELECT id, kind, sequence, message_id, at, detail FROM aggregate_timeline
                  WHERE aggregate_id = 'a' ORDER BY id",
            )
            .unwrap()
            .query_map([], |row| {
                let detail: String = row.get(5)?;
                let detail: serde_json::Value = serde_json::from_str(&detail).unwrap();
                Ok(format!(
                    "{}|{}|{}|{}|{}|{detail}",
                    row.get::<_, i64>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, String>(3)?,
                    row.get::<_, String>(4)?,
                ))
            })
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(before.len(), 4);
        migrate(&mut connection).unwrap();
        assert_eq!(found_version(&connection).unwrap(), current_version());
        assert_eq!(timeline_of(&connection, "a"), before);
        let left: Vec<i64> = connection
            .prepare("SELECT id FROM aggregate_timeline ORDER BY id")
            .unwrap()
            .query_map([], |row| row.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(left, [2, 5], "the moved rows are gone; the orphan stays");
        let next: i64 = connection
            .query_row("SELECT last_id FROM timeline_ids", [], |row| row.get(0))
            .unwrap();
        assert_eq!(next, 5, "new events are numbered past every old one");
    }

    /// Every row of `table` in rowid order, every column as SQLite stores it.
    fn dump(connection: &Connection, table: &str) -> Vec<String> {
        let mut statement = connection
            .prepare(&format!("SELECT rowid, * FROM {table} ORDER BY rowid"))
            .unwrap();
        let columns = statement.column_count();
        statement
            .query_map([], |row| {
                (0..columns)
                    .map(|i| Ok(format!("{:?}", row.get_ref(i)?)))
                    .collect::<rusqlite::Result<Vec<_>>>()
                    .map(|values| values.join("|"))
            })
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    fn strings(connection: &Connection, sql: &str) -> Vec<String> {
        connection
            .prepare(sql)
            .unwrap()
            .query_map([], |row| row.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    fn primary_key(connection: &Connection, table: &str) -> Vec<String> {
        strings(
            connection,
            &format!("SELECT name FROM pragma_table_info('{table}') WHERE pk > 0 ORDER BY pk"),
        )
    }

    /// The version the seed-key rebuild brings a file to.
    fn seed_keys_version() -> i64 {
        let index = MIGRATIONS
            .iter()
            .position(|script| *script == SEED_KEYS_FIRST);
        index.map(|index| index as i64 + 1).unwrap()
    }

    #[test]
    fn each_seed_table_is_keyed_by_the_seeds_key_first() {
        let seed = Connection::open_in_memory().unwrap();
        seed.execute_batch(SEED_TABLES).unwrap();
        let current = migrated_in_memory();
        for table in ["aggregate_state", "ordered_inbox", "deadletters"] {
            let seeds = primary_key(&seed, table);
            let now = primary_key(&current, table);
            assert_eq!(now[..seeds.len()], seeds[..], "{table}: {now:?}");
        }
        assert_eq!(
            primary_key(&current, "deadletters"),
            ["message_id", "producer"]
        );
        assert_eq!(
            primary_key(&current, "ordered_inbox"),
            ["message_id", "producer"]
        );
    }

    #[test]
    fn an_identity_lookup_seeks_the_primary_key_by_message_id_then_producer() {
        let connection = migrated_in_memory();
        for table in ["ordered_inbox", "deadletters"] {
            let by_identity =
                format!("SELECT * FROM {table} WHERE producer = ?1 AND message_id = ?2");
            assert_eq!(
                query_plan(&connection, &by_identity, ["billing", "m-1"]),
                [format!(
                    "SEARCH {table} USING INDEX sqlite_autoindex_{table}_1 (message_id=? AND producer=?)"
                )]
            );
            // Every namespace's row of one id: the key's first column alone.
            let by_id = format!("SELECT producer FROM {table} WHERE message_id = ?1");
            assert_eq!(
                query_plan(&connection, &by_id, ["m-1"]),
                [format!(
                    "SEARCH {table} USING COVERING INDEX sqlite_autoindex_{table}_1 (message_id=?)"
                )]
            );
        }
    }

    #[test]
    fn the_seed_key_rebuild_keeps_every_row_value_and_index() {
        let mut connection = Connection::open_in_memory().unwrap();
        connection
            .pragma_update(None, "foreign_keys", true)
            .unwrap();
        migrate_to(&mut connection, seed_keys_version() - 1).unwrap();
        // Two namespaces with the same ids, a resolution of billing's dead letter, and a row
        // deleted so that rowids have a hole.
        connection
            .execute_batch(
                r#"INSERT INTO operators VALUES ('alice', 'h', 't', NULL);
                 INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, amount,
                                           applied_at, producer, event_id, total_after)
                 VALUES ('m-1', '{"a":1}', 'a', 1, 5, 't1', '', 1, 5),
                        ('gone', '{}', 'a', 9, 1, 't1', '', NULL, NULL),
                        ('m-1', '{"b":1}', 'b', 1, 2, 't2', 'billing', 2, 2),
                        ('old', 'seed payload', NULL, NULL, NULL, NULL, '', NULL, NULL);
                 DELETE FROM ordered_inbox WHERE message_id = 'gone';
                 INSERT INTO deadletters(message_id, reason, aggregate_id, sequence, payload,
                                         first_seen, last_seen, observations, status,
                                         resolution_id, id, producer)
                 VALUES ('p-2', 'negative amount', 'a', 2, '{}', 't3', 't4', 2, 'open', NULL,
                         1, ''),
                        ('p-2', 'negative amount', 'b', 2, '{}', 't3', 't5', 1, 'resolved', 1,
                         2, 'billing');
                 INSERT INTO resolutions VALUES (1, 'p-2', 'b', 2, 'skip', 'alice', 'why', 1,
                                                 NULL, NULL, 1, 2, 2, 2, 't6', 'billing');"#,
            )
            .unwrap();
        let tables = ["ordered_inbox", "deadletters", "resolutions"];
        let rows: Vec<Vec<String>> = tables.iter().map(|t| dump(&connection, t)).collect();
        let index_sql = "SELECT sql FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL
                            AND tbl_name IN ('ordered_inbox', 'deadletters', 'resolutions')
                          ORDER BY name";
        let indexes = strings(&connection, index_sql);
        assert_eq!(indexes.len(), 10);

        migrate_to(&mut connection, seed_keys_version()).unwrap();
        assert_eq!(found_version(&connection).unwrap(), seed_keys_version());
        let after: Vec<Vec<String>> = tables.iter().map(|t| dump(&connection, t)).collect();
        assert_eq!(after, rows);
        assert_eq!(strings(&connection, index_sql), indexes);
        assert_eq!(
            primary_key(&connection, "deadletters"),
            ["message_id", "producer"]
        );
        assert_eq!(
            primary_key(&connection, "ordered_inbox"),
            ["message_id", "producer"]
        );
        let foreign_keys: bool = connection
            .query_row("PRAGMA foreign_keys", [], |row| row.get(0))
            .unwrap();
        assert!(foreign_keys, "foreign keys are back on");
        assert_eq!(strings(&connection, "PRAGMA integrity_check"), ["ok"]);
        // The identity is still one row per (message id, producer), and a resolution still
        // names an existing dead letter.
        let duplicate = "INSERT INTO deadletters(message_id, reason, producer)
                         VALUES ('p-2', 'negative amount', 'billing')";
        assert!(connection.execute(duplicate, []).is_err());
        let orphan = "INSERT INTO resolutions VALUES (2, 'p-2', 'b', 2, 'skip', 'alice', 'why', 1,
                                                      NULL, NULL, 1, 2, 2, 2, 't6', 'shipping')";
        assert!(connection.execute(orphan, []).is_err());
    }

    #[test]
    fn version_10_moves_the_ledgers_figures_into_generic_columns_with_the_same_meaning() {
        let mut connection = Connection::open_in_memory().unwrap();
        connection
            .pragma_update(None, "foreign_keys", true)
            .unwrap();
        migrate_to(&mut connection, seed_keys_version()).unwrap();
        connection
            .execute_batch(
                r#"INSERT INTO operators VALUES ('alice', 'h', 't', NULL);
                 INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, amount,
                                           applied_at, producer, event_id, total_after)
                 VALUES ('m-1', '{"AggregateId":"a","Sequence":1,"Amount":5}', 'a', 1, 5, 't1',
                         '', 1, 5),
                        ('fix-2', '{"AggregateId":"a","Sequence":2,"Amount":3}', 'a', 2, 3, 't3',
                         '', 3, 8),
                        ('old', '{"AggregateId":"demo","Sequence":1,"Amount":1}', 'demo', 1, 1,
                         NULL, '', NULL, NULL);
                 INSERT INTO deadletters(message_id, reason, aggregate_id, sequence, payload,
                                         first_seen, last_seen, observations, status,
                                         resolution_id, id, producer)
                 VALUES ('p-2', 'negative amount', 'a', 2,
                         '{"AggregateId":"a","Sequence":2,"Amount":-1}', 't2', 't2', 1,
                         'resolved', 1, 1, '');
                 INSERT INTO resolutions(id, message_id, aggregate_id, sequence, action, operator,
                                         reason, expected_last, replacement_message_id,
                                         replacement_amount, before_last, before_total,
                                         after_last, after_total, resolved_at, producer)
                 VALUES (1, 'p-2', 'a', 2, 'replace', 'alice', 'fixed', 1, 'fix-2', 3, 1, 5,
                         2, 8, 't3', '');
                 INSERT INTO held_messages(message_id, aggregate_id, sequence, amount, payload,
                                           held_at)
                 VALUES ('m-4', 'a', 4, 2, '{"AggregateId":"a","Sequence":4,"Amount":2}', 't4');"#,
            )
            .unwrap();
        migrate(&mut connection).unwrap();
        assert_eq!(found_version(&connection).unwrap(), current_version());
        assert_eq!(
            strings(
                &connection,
                "SELECT message_id || '|' || IFNULL(applied_detail, 'none') FROM ordered_inbox
                  ORDER BY rowid"
            ),
            [
                r#"m-1|{"amount":5,"total":5}"#,
                r#"fix-2|{"amount":3,"total":8}"#,
                "old|none"
            ]
        );
        let page = PageRequest {
            after: 0,
            limit: 10,
        };
        let events = super::super::views::timeline(&connection, "a", page).unwrap();
        let details: Vec<String> = events
            .items
            .iter()
            .map(|event| format!("{:?}", event.detail))
            .collect();
        assert_eq!(
            details,
            [
                r#"Some(Object {"amount": Number(5), "total": Number(5)})"#,
                r#"Some(Object {"amount": Number(3), "total": Number(8)})"#
            ],
            "the timeline shows what it showed before"
        );
        let record = super::super::views::resolution_of(&connection, None, "p-2")
            .unwrap()
            .unwrap();
        assert_eq!(
            record
                .replacement
                .map(|replacement| replacement.payload.to_string()),
            Some(r#"{"AggregateId":"a","Sequence":2,"Amount":3}"#.to_owned())
        );
        assert_eq!(
            (record.before.state, record.after.state),
            (
                Some(serde_json::json!({"total": 5})),
                Some(serde_json::json!({"total": 8}))
            )
        );
        let held = super::super::facts::held_for(&connection, "a").unwrap();
        assert_eq!(
            held[0].message.payload.to_string(),
            r#"{"AggregateId":"a","Sequence":4,"Amount":2}"#
        );
        assert_eq!(
            held[0].payload,
            r#"{"AggregateId":"a","Sequence":4,"Amount":2}"#
        );
        assert_eq!(strings(&connection, "PRAGMA integrity_check"), ["ok"]);
    }

    #[test]
    fn version_12_keeps_every_held_row_anonymous_and_keys_held_rows_by_producer() {
        let mut connection = Connection::open_in_memory().unwrap();
        let held_producers = MIGRATIONS
            .iter()
            .position(|script| *script == HELD_PRODUCERS)
            .unwrap() as i64;
        migrate_to(&mut connection, held_producers).unwrap();
        connection
            .execute_batch(
                r#"INSERT INTO held_messages(message_id, aggregate_id, sequence, payload,
                                            message_payload, held_at)
                   VALUES ('x-3', 'a', 3, '{"v":3}', '{"v":3}', 't1'),
                          ('x-4', 'a', 4, '{"v":4}', NULL, 't2');"#,
            )
            .unwrap();
        migrate(&mut connection).unwrap();
        assert_eq!(
            strings(
                &connection,
                "SELECT message_id || '|' || aggregate_id || '|' || sequence || '|' || payload
                        || '|' || COALESCE(message_payload, '-') || '|' || held_at || '|'
                        || producer || '|' || COALESCE(epoch, '-')
                   FROM held_messages ORDER BY sequence"
            ),
            [
                r#"x-3|a|3|{"v":3}|{"v":3}|t1||-"#,
                r#"x-4|a|4|{"v":4}|-|t2||-"#
            ]
        );
        assert_eq!(
            primary_key(&connection, "held_messages"),
            ["producer", "message_id"]
        );
        // billing's x-5 is another message than an anonymous x-5; one sequence is still held once.
        connection
            .execute_batch(
                "INSERT INTO held_messages(message_id, aggregate_id, sequence, payload, held_at,
                                           producer, epoch)
                 VALUES ('x-5', 'b', 5, '{}', 't3', 'billing', 1),
                        ('x-5', 'c', 5, '{}', 't3', '', NULL);",
            )
            .unwrap();
        let again = connection.execute(
            "INSERT INTO held_messages(message_id, aggregate_id, sequence, payload, held_at)
             VALUES ('y-3', 'a', 3, '{}', 't4')",
            [],
        );
        assert!(again.is_err(), "(aggregate, sequence) stays unique");
        assert_eq!(strings(&connection, "PRAGMA integrity_check"), ["ok"]);
    }

    #[test]
    fn version_13_keeps_every_resolution_and_allows_an_accepting_one() {
        let mut connection = Connection::open_in_memory().unwrap();
        connection
            .pragma_update(None, "foreign_keys", true)
            .unwrap();
        let accepted = MIGRATIONS
            .iter()
            .position(|script| *script == ACCEPTED_DEAD_LETTERS)
            .unwrap() as i64;
        migrate_to(&mut connection, accepted).unwrap();
        let row = "SELECT id || '|' || message_id || '|' || action || '|' || operator || '|'
                          || reason || '|' || COALESCE(replacement_payload, '-') || '|'
                          || COALESCE(before_state, '-') || '|' || producer
                     FROM resolutions ORDER BY id";
        connection
            .execute_batch(
                r#"INSERT INTO operators VALUES ('alice', 'h', 't', NULL);
                 INSERT INTO deadletters(message_id, reason, aggregate_id, sequence, payload,
                                         status, id, producer)
                 VALUES ('p-2', 'poison', 'a', 2, '{"v":2}', 'resolved', 1, ''),
                        ('p-3', 'poison', 'a', 3, '{"v":3}', 'open', 2, '');
                 INSERT INTO resolutions(id, message_id, aggregate_id, sequence, action, operator,
                                         reason, expected_last, before_last, after_last,
                                         resolved_at, producer, before_state)
                 VALUES (1, 'p-2', 'a', 2, 'skip', 'alice', 'lost', 1, 1, 2, 't1', '',
                         '{"n":1}');"#,
            )
            .unwrap();
        let before = strings(&connection, row);
        migrate(&mut connection).unwrap();
        assert_eq!(strings(&connection, row), before);
        connection
            .execute(
                "INSERT INTO resolutions(id, message_id, aggregate_id, sequence, action, operator,
                                         reason, expected_last, before_last, after_last,
                                         resolved_at, producer)
                 VALUES (2, 'p-3', 'a', 3, 'accept', 'alice', 'fixed', 2, 2, 3, 't2', '')",
                [],
            )
            .unwrap();
        let unknown =
            connection.execute("UPDATE resolutions SET action = 'forget' WHERE id = 2", []);
        assert!(unknown.is_err(), "the action is still checked");
        assert_eq!(
            strings(&connection, "PRAGMA foreign_key_check"),
            Vec::<String>::new()
        );
        assert_eq!(strings(&connection, "PRAGMA integrity_check"), ["ok"]);
    }

    #[test]
    fn a_file_of_every_earlier_version_migrates_with_its_seed_rows() {
        let seed_rows = "SELECT 's|' || aggregate_id || '|' || last_sequence || '|' || total
                           FROM aggregate_state
                         UNION ALL SELECT 'i|' || message_id || '|' || payload FROM ordered_inbox
                         UNION ALL SELECT 'd|' || message_id || '|' || reason FROM deadletters
                         ORDER BY 1";
        for version in 1..current_version() {
            let mut connection = Connection::open_in_memory().unwrap();
            connection
                .pragma_update(None, "foreign_keys", true)
                .unwrap();
            migrate_to(&mut connection, version).unwrap();
            assert_eq!(found_version(&connection).unwrap(), version);
            // Rows in the seed's own columns, as its statements write them.
            connection
                .execute_batch(
                    r#"INSERT INTO aggregate_state(aggregate_id, last_sequence, total)
                       VALUES ('demo', 2, 2);
                     INSERT INTO ordered_inbox(message_id, payload) VALUES
                       ('m-1', '{"AggregateId":"demo","Sequence":1,"Amount":1}'),
                       ('corrected-2', '{"AggregateId":"demo","Sequence":2,"Amount":1}');
                     INSERT INTO deadletters(message_id, reason)
                       VALUES ('poison-2', 'negative amount');"#,
                )
                .unwrap();
            let before = strings(&connection, seed_rows);
            migrate(&mut connection).unwrap();
            assert_eq!(found_version(&connection).unwrap(), current_version());
            assert_eq!(
                strings(&connection, seed_rows),
                before,
                "from version {version}"
            );
            assert_eq!(
                strings(&connection, "PRAGMA foreign_key_check"),
                Vec::<String>::new()
            );
            assert_eq!(
                primary_key(&connection, "deadletters"),
                ["message_id", "producer"],
                "from version {version}"
            );
        }
    }

    #[test]
    fn a_newer_file_is_refused() {
        let mut connection = migrated_in_memory();
        connection
            .execute("UPDATE ordered_inbox_schema SET version = 99", [])
            .unwrap();
        assert!(migrate(&mut connection).is_err());
    }
}
