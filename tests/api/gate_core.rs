//! The gate's core over real parts: the ordered inbox on a real SQLite file or a private
//! PostgreSQL database with the gate's handler (schemas decide poison, `apply` writes the output
//! row in the inbox's transaction), the output table's reads, and the publisher against a real
//! nats-server, read back by a consumer of the output stream.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::{self};
use futures_util::StreamExt;
use lab_testkit::nats::subject_for;
use ordered_inbox::gaps::{GapRequest, GapResolved};
use ordered_inbox::postgres::{PostgresInbox, Target};
use ordered_inbox::records::SequenceRange;
use ordered_inbox::resolution::{Action, Mode, ResolutionRequest, Resolved};
use ordered_inbox::sqlite::{SqliteInbox, Store, Synchronous, schema};
use ordered_inbox::{BatchDelivery, Door, Inbox, InboxError, Limits, OrderedMessage, Outcome};
use ordering_gate::handler::{GateHandler, envelope};
use ordering_gate::output::{self, OutputEntry, OutputError, OutputStore};
use ordering_gate::publisher::{Publisher, body};
use ordering_gate::schemas::MessageTypes;
use production_lab::telemetry::metrics::Metrics;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::sync::Notify;
use tokio_postgres::types::{FromSql, Type};
use tokio_util::sync::CancellationToken;

use crate::broker::{jetstream_of, start_nats};
use crate::helpers::{Backend, poll_until, poll_until_within};
use crate::on_both_backends;
use crate::postgres::{fresh_database, query_text};

const PLACED: &str = "order.placed";
const OUTPUT_STREAM: &str = "GATE_CORE_OUT";
const OUTPUT_PREFIX: &str = "gate.core.out";

/// The inbox with the gate's handler on one backend, and its output.
struct Gate {
    inbox: Arc<dyn Inbox>,
    output: OutputStore,
    /// Where the rows are, for a test that reaches past the gate into them.
    database: Database,
}

enum Database {
    Sqlite {
        _dir: TempDir,
        path: std::path::PathBuf,
    },
    Postgres {
        url: String,
    },
}

fn handler() -> GateHandler {
    let schema = json!({
        "type": "object",
        "required": ["orderId", "amount"],
        "properties": {
            "orderId": {"type": "string"},
            "amount": {"type": "integer", "minimum": 0}
        }
    });
    let types = MessageTypes::compile(vec![(PLACED.to_owned(), schema)]).expect("the schema");
    GateHandler::new(types)
}

async fn open_gate(backend: Backend) -> Gate {
    match backend {
        Backend::Sqlite => {
            let dir = tempfile::tempdir().expect("a temp dir");
            let path = dir.path().join("gate.db");
            let store = Store::open(&path, Synchronous::Full, |connection| {
                schema::migrate(connection)?;
                output::migrate_sqlite(connection)
            })
            .expect("the gate's SQLite file");
            let inbox =
                SqliteInbox::with_handler(store.clone(), Limits::default(), Arc::new(handler()));
            Gate {
                inbox: Arc::new(inbox),
                output: OutputStore::sqlite(store),
                database: Database::Sqlite { _dir: dir, path },
            }
        }
        Backend::Postgres => {
            let url = fresh_database();
            let target = Target::parse(&url).expect("the database's URL");
            let inbox =
                PostgresInbox::open_with_handler(target, Limits::default(), Arc::new(handler()))
                    .await
                    .expect("the gate's PostgreSQL inbox");
            output::install_postgres(&inbox)
                .await
                .expect("the output table");
            Gate {
                output: OutputStore::postgres(&inbox),
                inbox: Arc::new(inbox),
                database: Database::Postgres { url },
            }
        }
    }
}

impl Gate {
    /// Runs SQL text on the gate's database, past the gate.
    fn execute(&self, sql: &str) {
        match &self.database {
            Database::Sqlite { path, .. } => rusqlite::Connection::open(path)
                .and_then(|connection| connection.execute_batch(sql))
                .unwrap_or_else(|error| panic!("{sql}: {error}")),
            Database::Postgres { url } => {
                query_text(url, sql);
            }
        }
    }

    async fn applied_sequences(&self, aggregate: &str, after: i64, limit: usize) -> Vec<i64> {
        sequences(
            &self
                .output
                .applied(aggregate, after, limit)
                .await
                .expect("applied"),
        )
    }

    /// The lease's expiry on the store's clock, read past the gate.
    fn lease_expiry(&self) -> i64 {
        const EXPIRY: &str = "SELECT expires_at_ms FROM gate_publisher_lease";
        match &self.database {
            Database::Sqlite { path, .. } => rusqlite::Connection::open(path)
                .and_then(|connection| connection.query_row(EXPIRY, [], |row| row.get(0)))
                .expect("the lease's expiry"),
            Database::Postgres { url } => query_text(url, EXPIRY)[0][0]
                .as_deref()
                .and_then(|text| text.parse().ok())
                .expect("the lease's expiry"),
        }
    }

    /// The rows in `gate_output`, read past the gate.
    fn output_rows(&self) -> u64 {
        const COUNT: &str = "SELECT COUNT(*) FROM gate_output";
        match &self.database {
            Database::Sqlite { path, .. } => rusqlite::Connection::open(path)
                .and_then(|connection| connection.query_row(COUNT, [], |row| row.get::<_, i64>(0)))
                .map(|count| count.unsigned_abs())
                .expect("the output's rows"),
            Database::Postgres { url } => query_text(url, COUNT)[0][0]
                .as_deref()
                .and_then(|count| count.parse().ok())
                .expect("the output's rows"),
        }
    }

    async fn pending_count(&self) -> usize {
        self.output.pending(1000).await.expect("pending").len()
    }
}

fn sequences(entries: &[OutputEntry]) -> Vec<i64> {
    entries.iter().map(|entry| entry.sequence).collect()
}

fn placed(aggregate: &str, sequence: i64, payload: Value) -> OrderedMessage {
    typed(aggregate, sequence, PLACED, payload)
}

fn typed(aggregate: &str, sequence: i64, message_type: &str, payload: Value) -> OrderedMessage {
    OrderedMessage {
        message_id: format!("{aggregate}-m{sequence}"),
        aggregate_id: aggregate.to_owned(),
        sequence,
        payload: envelope(message_type, payload),
    }
}

fn order(sequence: i64) -> Value {
    json!({"orderId": format!("o-{sequence}"), "amount": sequence})
}

async fn deliver(gate: &Gate, message: OrderedMessage) -> Result<Outcome, InboxError> {
    gate.inbox.deliver(message, Door::General).await
}

async fn a_valid_message_applies_and_its_output_row_commits_with_it(backend: Backend) {
    let gate = open_gate(backend).await;
    let outcome = deliver(&gate, placed("order-1", 1, order(1)))
        .await
        .expect("delivered");
    let Outcome::Applied { detail, .. } = outcome else {
        panic!("applied: {outcome:?}");
    };
    assert_eq!(Value::Object(detail), json!({"type": PLACED}));
    let entries = gate
        .output
        .applied("order-1", 0, 10)
        .await
        .expect("applied");
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert_eq!(
        (
            entry.aggregate_id.as_str(),
            entry.sequence,
            entry.message_id.as_str()
        ),
        ("order-1", 1, "order-1-m1")
    );
    assert_eq!(
        (entry.message_type.as_str(), &entry.payload),
        (PLACED, &order(1))
    );
    assert_eq!(entry.applied_at.len(), 24, "{}", entry.applied_at);
    assert_eq!(
        sequences(&gate.output.pending(10).await.expect("pending")),
        [1]
    );
}

async fn an_output_row_already_there_fails_the_delivery_and_records_nothing(backend: Backend) {
    let gate = open_gate(backend).await;
    // A row the inbox never wrote, at the sequence it is about to apply: the insert must fail
    // the delivery rather than keep the old row and lose the new message's.
    gate.execute(
        "INSERT INTO gate_output(aggregate_id, sequence, message_id, message_type, payload, applied_at)
         VALUES ('order-1', 1, 'planted', 'order.placed', '{}', '2026-01-01T00:00:00.000Z')",
    );
    let outcome = deliver(&gate, placed("order-1", 1, order(1))).await;
    assert!(
        matches!(outcome, Err(InboxError::Handler(_))),
        "{outcome:?}"
    );
    let view = gate
        .inbox
        .reads()
        .aggregate("order-1".into())
        .await
        .expect("the view");
    let last = view.map(|view| view.summary.last).unwrap_or(0);
    assert_eq!(last, 0, "the inbox did not advance");
    let entries = gate
        .output
        .applied("order-1", 0, 10)
        .await
        .expect("applied");
    assert_eq!(entries[0].message_id, "planted");
}

async fn a_schema_invalid_message_is_quarantined_with_the_validators_first_error_and_no_output(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let refused = json!({"orderId": "o-1", "amount": -5});
    let outcome = deliver(&gate, placed("order-1", 1, refused))
        .await
        .expect("delivered");
    let Outcome::Quarantined { reason, .. } = outcome else {
        panic!("quarantined: {outcome:?}");
    };
    assert_eq!(
        reason.as_str(),
        "payload does not match the schema of 'order.placed': at '/amount': \
         -5 is less than the minimum of 0"
    );
    assert!(gate.applied_sequences("order-1", 0, 10).await.is_empty());
    assert_eq!(gate.pending_count().await, 0);
}

async fn an_unknown_type_at_the_expected_sequence_is_poison(backend: Backend) {
    let gate = open_gate(backend).await;
    let outcome = deliver(&gate, typed("order-1", 1, "order.lost", json!({})))
        .await
        .expect("delivered");
    let Outcome::Quarantined { reason, .. } = outcome else {
        panic!("quarantined: {outcome:?}");
    };
    assert_eq!(reason.as_str(), "unknown message type 'order.lost'");
    assert_eq!(gate.pending_count().await, 0);
}

async fn messages_delivered_three_one_two_come_out_as_one_two_three(backend: Backend) {
    let gate = open_gate(backend).await;
    for sequence in [3, 1, 2] {
        let delivery =
            BatchDelivery::anonymous(placed("order-1", sequence, order(sequence)), Door::Broker);
        let outcomes = gate
            .inbox
            .deliver_batch(vec![delivery])
            .await
            .expect("delivered");
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    }
    assert_eq!(gate.applied_sequences("order-1", 0, 10).await, [1, 2, 3]);
    assert_eq!(gate.applied_sequences("order-1", 1, 10).await, [2, 3]);
    assert_eq!(gate.applied_sequences("order-1", 0, 1).await, [1]);
    assert_eq!(
        sequences(&gate.output.pending(10).await.expect("pending")),
        [1, 2, 3]
    );
    let payloads: Vec<Value> = gate
        .output
        .applied("order-1", 0, 10)
        .await
        .expect("applied")
        .into_iter()
        .map(|entry| entry.payload)
        .collect();
    assert_eq!(payloads, [order(1), order(2), order(3)]);
    assert_eq!(
        gate.output.applied("order-1", 0, 0).await,
        Err(OutputError::Limit(0))
    );
    assert_eq!(
        gate.output.pending(1001).await,
        Err(OutputError::Limit(1001))
    );
}

async fn the_pending_rows_span_every_aggregate_rather_than_the_first_ones_backlog(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    for sequence in 1..=40 {
        let delivery =
            BatchDelivery::anonymous(placed("order-a", sequence, order(sequence)), Door::Broker);
        gate.inbox
            .deliver_batch(vec![delivery])
            .await
            .expect("delivered");
    }
    let delivery = BatchDelivery::anonymous(placed("order-b", 1, order(1)), Door::Broker);
    gate.inbox
        .deliver_batch(vec![delivery])
        .await
        .expect("delivered");
    let pending = gate.output.pending(1000).await.expect("pending");
    let of = |aggregate: &str| {
        pending
            .iter()
            .filter(|entry| entry.aggregate_id == aggregate)
            .map(|entry| entry.sequence)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        of("order-a"),
        (1..=ordering_gate::output::PENDING_PER_AGGREGATE as i64).collect::<Vec<_>>()
    );
    assert_eq!(of("order-b"), [1]);
}

/// Rows written past the gate: `aggregate`'s sequences `from..=to`, published or waiting.
fn rows(gate: &Gate, aggregate: &str, from: i64, to: i64, published: bool) {
    let published = if published { "'now'" } else { "NULL" };
    let rows = match gate.database {
        Database::Sqlite { .. } => format!(
            "WITH RECURSIVE n(i) AS (SELECT {from} UNION ALL SELECT i + 1 FROM n WHERE i < {to})
             INSERT INTO gate_output
             SELECT '{aggregate}', i, 'm-' || i, '{PLACED}', '{{}}', 'now', {published} FROM n"
        ),
        Database::Postgres { .. } => format!(
            "INSERT INTO gate_output
             SELECT '{aggregate}', i, 'm-' || i, '{PLACED}', '{{}}', 'now', {published}
               FROM generate_series({from}, {to}) AS i;
             ANALYZE gate_output"
        ),
    };
    gate.execute(&rows);
}

/// How much of the table one pending read of at most 1,000 rows touches: on SQLite the virtual
/// machine's steps, on PostgreSQL the rows its scans of `gate_output` read (kept or filtered).
fn pending_read_cost(gate: &Gate) -> u64 {
    match &gate.database {
        Database::Sqlite { path, .. } => sqlite_steps(path, output::PENDING_SQLITE, [1000]),
        Database::Postgres { url } => {
            postgres_rows_read(url, &output::PENDING_POSTGRES.replace("$1", "1000"))
        }
    }
}

/// The SQLite virtual machine's steps in one run of `sql` on the file at `path`, which answers
/// (or deletes) at least one row.
fn sqlite_steps(path: &std::path::Path, sql: &str, parameters: impl rusqlite::Params) -> u64 {
    let connection = rusqlite::Connection::open(path).expect("the gate's file");
    let mut statement = connection.prepare(sql).expect("prepare");
    let rows = statement
        .query_map(parameters, |_| Ok(()))
        .expect("query")
        .count();
    assert!(rows > 0, "no row from {sql}");
    statement.get_status(rusqlite::StatementStatus::VmStep) as u64
}

/// The rows of `gate_output` one run of `sql`, sent as text, reads on PostgreSQL.
fn postgres_rows_read(url: &str, sql: &str) -> u64 {
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}");
    let text = query_text(url, &explain)[0][0].clone().expect("a plan");
    let plan: Value = serde_json::from_str(&text).expect("the plan's JSON");
    rows_read_of(&plan[0]["Plan"], "gate_output")
}

/// The rows the plan's scans of `table` read: returned plus filtered out, in every loop.
fn rows_read_of(node: &Value, table: &str) -> u64 {
    let number = |key: &str| node[key].as_f64().unwrap_or_default();
    let own = if node["Relation Name"] == table {
        ((number("Actual Rows") + number("Rows Removed by Filter")) * number("Actual Loops")) as u64
    } else {
        0
    };
    let children = node["Plans"].as_array().map_or(0, |plans| {
        plans.iter().map(|plan| rows_read_of(plan, table)).sum()
    });
    own + children
}

async fn a_pending_read_costs_the_same_whatever_backlog_stands_behind_its_answer(backend: Backend) {
    let gate = open_gate(backend).await;
    rows(&gate, "order-a", 1, 40, false);
    rows(&gate, "order-b", 1, 3, false);
    rows(&gate, "order-c", 20_001, 20_002, false);
    let first = pending_read_cost(&gate);
    // Behind the answer: order-a's backlog grows; before it: order-c's published history.
    rows(&gate, "order-a", 41, 20_000, false);
    rows(&gate, "order-c", 1, 20_000, true);
    let then = pending_read_cost(&gate);
    let pending = gate.output.pending(1000).await.expect("pending");
    assert_eq!(pending.len(), output::PENDING_PER_AGGREGATE + 3 + 2);
    assert!(
        then <= first + 10,
        "behind 20,000 waiting and 20,000 published rows a read cost {then}, before them {first}"
    );
}

/// The planner's statistics can say that no row waits while thousands do: the table swings
/// between all published and a backlog faster than `ANALYZE` follows it. A pending read must
/// cost the same with such statistics as with fresh ones.
async fn a_pending_read_costs_what_it_answers_when_the_statistics_say_nothing_waits(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    backlog_behind_stale_statistics(&gate, 20, 3);
    let with_stale_statistics = pending_read_cost(&gate);
    gate.execute("ANALYZE gate_output");
    let with_fresh_statistics = pending_read_cost(&gate);
    assert_eq!(gate.pending_count().await, 1000);
    assert!(
        with_stale_statistics <= 2 * with_fresh_statistics,
        "a read cost {with_stale_statistics} when the statistics said nothing waits, \
         {with_fresh_statistics} with fresh ones"
    );
}

/// The publisher's mark reads the rows it marks and no other, whatever waits beside them and
/// whatever the statistics say: with a plan that read every waiting row, a round cost seconds
/// behind a backlog of 20,000 rows.
#[tokio::test]
async fn marking_a_round_published_reads_only_its_rows_whatever_waits_and_whatever_the_statistics_say()
 {
    let gate = open_gate(Backend::Postgres).await;
    let Database::Postgres { url } = &gate.database else {
        unreachable!("opened on PostgreSQL");
    };
    backlog_behind_stale_statistics(&gate, 100, 3);
    let with_stale_statistics = mark_cost(url, 1..=200).await;
    gate.execute("ANALYZE gate_output");
    let with_fresh_statistics = mark_cost(url, 501..=700).await;
    let marked = query_text(
        url,
        "SELECT COUNT(*) FROM gate_output WHERE sequence = 101 AND published_at IS NOT NULL",
    );
    assert_eq!(marked[0][0].as_deref(), Some("400"));
    for (statistics, cost) in [
        ("stale", with_stale_statistics),
        ("fresh", with_fresh_statistics),
    ] {
        assert!(
            cost <= 2 * 200,
            "marking 200 rows beside 2,800 more waiting read {cost} rows ({statistics} statistics)"
        );
    }
}

/// A vacuum that cuts a pruned table's empty tail locks out every delivery for that moment;
/// the gate's store keeps those pages for reuse instead.
#[tokio::test]
async fn the_tables_pruning_empties_keep_their_freed_pages_on_postgres() {
    let gate = open_gate(Backend::Postgres).await;
    let Database::Postgres { url } = &gate.database else {
        unreachable!("opened on PostgreSQL");
    };
    let kept = query_text(
        url,
        "SELECT relname FROM pg_class
          WHERE reloptions @> ARRAY['vacuum_truncate=false'] ORDER BY relname",
    );
    let kept: Vec<&str> = kept.iter().filter_map(|row| row[0].as_deref()).collect();
    assert_eq!(
        kept,
        [
            "aggregate_timeline",
            "deadletters",
            "gate_output",
            "ordered_inbox"
        ]
    );
}

/// The rows of `gate_output` one [`output::MARK_POSTGRES`] reads (kept or filtered) to mark
/// sequence 101 of the aggregates `aggregates` published, sent as the gate sends it: its arrays
/// bound as parameters.
async fn mark_cost(url: &str, aggregates: std::ops::RangeInclusive<i64>) -> u64 {
    let ids: Vec<String> = aggregates.map(|a| format!("order-{a}")).collect();
    let sequences = vec![101_i64; ids.len()];
    rows_read_with_parameters(
        url,
        output::MARK_POSTGRES,
        &[
            (&ids, Type::TEXT_ARRAY),
            (&sequences, Type::INT8_ARRAY),
            (&"now", Type::TEXT),
        ],
    )
    .await
}

/// The rows of `gate_output` one run of `sql` reads (kept or filtered), its parameters bound as
/// the gate binds them, so that the planner sees what it sees in the gate.
async fn rows_read_with_parameters(
    url: &str,
    sql: &str,
    parameters: &[(&(dyn tokio_postgres::types::ToSql + Sync), Type)],
) -> u64 {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}");
    let rows = client
        .query_typed(&explain, parameters)
        .await
        .expect("the statement's plan");
    let JsonText(text) = rows[0].get(0);
    let plan: Value = serde_json::from_str(&text).expect("the plan's JSON");
    rows_read_of(&plan[0]["Plan"], "gate_output")
}

/// What one prune of at most `batch` rows touches, as [`pending_read_cost`] counts it; every
/// row is older than its cut-off. Answers the cost and the rows deleted.
async fn prune_cost(gate: &Gate, batch: i64) -> (u64, u64) {
    let before = "~";
    let deleted_before = gate.output_rows();
    let cost = match &gate.database {
        Database::Sqlite { path, .. } => sqlite_steps(path, output::PRUNE_SQLITE, (before, batch)),
        Database::Postgres { url } => {
            rows_read_with_parameters(
                url,
                output::PRUNE_POSTGRES,
                &[(&before, Type::TEXT), (&batch, Type::INT8)],
            )
            .await
        }
    };
    (cost, deleted_before - gate.output_rows())
}

/// A prune batch reads what it deletes and never the table, whether the statistics say that
/// nothing was published (every row published since they were taken) or that everything was (a
/// backlog since).
async fn a_prune_batch_costs_what_it_deletes_whatever_the_statistics_say(backend: Backend) {
    let gate = open_gate(backend).await;
    statistics_only_by_hand(&gate);
    grid(&gate, 1_000, 1, 20, false);
    gate.execute("ANALYZE gate_output");
    gate.execute("UPDATE gate_output SET published_at = 'now'");
    let (nothing_published_said, deleted) = prune_cost(&gate, 100).await;
    assert_eq!(deleted, 100);
    gate.execute("ANALYZE gate_output");
    grid(&gate, 1_000, 21, 23, false);
    let (everything_published_said, deleted) = prune_cost(&gate, 100).await;
    assert_eq!(deleted, 100);
    gate.execute("ANALYZE gate_output");
    let table = gate.output_rows();
    let (fresh, deleted) = prune_cost(&gate, 100).await;
    assert_eq!(deleted, 100);
    assert!(
        fresh < table,
        "a prune of 100 rows cost {fresh}, as much as a read of the table's {table} rows"
    );
    for (statistics, cost) in [
        ("that nothing was published", nothing_published_said),
        ("that everything was published", everything_published_said),
    ] {
        assert!(
            cost <= 2 * fresh,
            "a prune of 100 rows cost {cost} with statistics saying {statistics}, \
             {fresh} with fresh ones"
        );
    }
}

/// A `json` value as its text.
struct JsonText(String);

impl<'a> FromSql<'a> for JsonText {
    fn from_sql(
        _: &Type,
        raw: &'a [u8],
    ) -> Result<JsonText, Box<dyn std::error::Error + Sync + Send>> {
        Ok(JsonText(std::str::from_utf8(raw)?.to_owned()))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSON
    }
}

/// 1,000 aggregates with `published` rows each, analyzed, then `waiting` more rows each that
/// the statistics do not know of: they say that nothing waits.
fn backlog_behind_stale_statistics(gate: &Gate, published: i64, waiting: i64) {
    statistics_only_by_hand(gate);
    grid(gate, 1_000, 1, published, true);
    gate.execute("ANALYZE gate_output");
    grid(gate, 1_000, published + 1, published + waiting, false);
}

/// Autovacuum off for `gate_output` on PostgreSQL, so that no automatic `ANALYZE` corrects the
/// statistics a test left stale on purpose.
fn statistics_only_by_hand(gate: &Gate) {
    if let Database::Postgres { .. } = gate.database {
        gate.execute("ALTER TABLE gate_output SET (autovacuum_enabled = false)");
    }
}

/// Rows written past the gate, without `ANALYZE`: sequences `from..=to` of each of `aggregates`
/// aggregates, published or waiting.
fn grid(gate: &Gate, aggregates: i64, from: i64, to: i64, published: bool) {
    let published = if published { "'now'" } else { "NULL" };
    let values =
        format!("'order-' || a, s, 'm-' || a || '-' || s, '{PLACED}', '{{}}', 'now', {published}");
    let rows = match gate.database {
        Database::Sqlite { .. } => format!(
            "WITH RECURSIVE
               ag(a) AS (SELECT 1 UNION ALL SELECT a + 1 FROM ag WHERE a < {aggregates}),
               sq(s) AS (SELECT {from} UNION ALL SELECT s + 1 FROM sq WHERE s < {to})
             INSERT INTO gate_output SELECT {values} FROM ag, sq"
        ),
        Database::Postgres { .. } => format!(
            "INSERT INTO gate_output SELECT {values}
               FROM generate_series(1, {aggregates}) AS a, generate_series({from}, {to}) AS s"
        ),
    };
    gate.execute(&rows);
}

/// How much of the table one run of `sql` (`$1` bound to `parameter`, if given) touches, as
/// [`pending_read_cost`] counts it.
fn read_cost(gate: &Gate, sql: &str, parameter: Option<i64>) -> u64 {
    match &gate.database {
        Database::Sqlite { path, .. } => sqlite_steps(
            path,
            &sql.replace('$', "?"),
            rusqlite::params_from_iter(parameter),
        ),
        Database::Postgres { url } => {
            let sql = match parameter {
                Some(parameter) => sql.replace("$1", &parameter.to_string()),
                None => sql.to_owned(),
            };
            postgres_rows_read(url, &sql)
        }
    }
}

/// The two reads of [`OutputStore::backlog`]: what each costs.
fn backlog_read_costs(gate: &Gate) -> (u64, u64) {
    (
        read_cost(gate, output::BACKLOG_COUNT, Some(output::BACKLOG_COUNT_CAP)),
        read_cost(gate, output::OLDEST_UNPUBLISHED, None),
    )
}

async fn the_backlog_read_stops_at_its_cap_and_finds_the_oldest_row_whatever_waits_behind(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let cap = output::BACKLOG_COUNT_CAP;
    rows(&gate, "order-a", 1, cap + 5, false);
    gate.execute(&format!(
        "INSERT INTO gate_output VALUES
           ('order-z', 1, 'm-1', '{PLACED}', '{{}}', '2020-01-01T00:00:00.000Z', NULL)"
    ));
    let backlog = gate.output.backlog().await.expect("backlog");
    assert_eq!(backlog.rows, cap, "counted up to the cap, not past it");
    assert_eq!(
        backlog.oldest_applied_at.as_deref(),
        Some("2020-01-01T00:00:00.000Z")
    );
    let (count_before, oldest_before) = backlog_read_costs(&gate);
    // Behind the cap: twice as many rows wait, and as many again were published.
    rows(&gate, "order-a", cap + 6, 3 * cap, false);
    rows(&gate, "order-c", 1, 2 * cap, true);
    let (count_then, oldest_then) = backlog_read_costs(&gate);
    assert!(
        count_then <= count_before + 10,
        "behind {} waiting rows the count cost {count_then}, before them {count_before}",
        3 * cap
    );
    assert!(
        oldest_then <= oldest_before + 10,
        "behind {} waiting rows the oldest's read cost {oldest_then}, before them {oldest_before}",
        3 * cap
    );
}

async fn the_backlog_shows_rows_waiting_while_no_publisher_runs_and_none_once_published(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    deliver_orders(&gate, "order-1", 3).await;
    let first = gate.output.applied("order-1", 0, 1).await.expect("applied");
    let backlog = gate.output.backlog().await.expect("backlog");
    assert_eq!(backlog.rows, 3);
    assert_eq!(backlog.oldest_applied_at, Some(first[0].applied_at.clone()));
    assert_eq!(gate.output.lease_epoch().await.expect("the lease"), 0);

    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let wake = Arc::new(Notify::new());
    let publisher = publisher_of(&gate, &js, wake.clone());
    let held = publisher.held_epoch();
    assert_eq!(held.get(), None, "it holds nothing before it runs");
    publisher.ensure_stream().await.expect("the output stream");
    let stop = CancellationToken::new();
    let running = tokio::spawn(publisher.run(stop.clone()));
    wake.notify_one();
    let drained = poll_until(
        "the backlog drains",
        || async { gate.output.backlog().await.expect("backlog") },
        |backlog| backlog.rows == 0,
    )
    .await;
    assert_eq!(drained.oldest_applied_at, None);
    assert_eq!(held.get(), Some(1));
    assert_eq!(gate.output.lease_epoch().await.expect("the lease"), 1);
    stop.cancel();
    running.await.expect("the publisher stops");
    assert_eq!(held.get(), None, "a stopped publisher holds nothing");
}

async fn a_batch_with_a_poison_in_it_writes_the_output_of_exactly_the_applied_messages(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let refused = json!({"orderId": "o-3"});
    let batch = [
        placed("a", 1, order(1)),
        placed("a", 2, order(2)),
        placed("b", 1, order(1)),
        placed("a", 3, refused),
        placed("b", 2, order(2)),
    ]
    .into_iter()
    .map(|message| BatchDelivery::anonymous(message, Door::Broker))
    .collect();
    let outcomes = gate.inbox.deliver_batch(batch).await.expect("delivered");
    assert!(
        matches!(outcomes[3], Ok(Outcome::Quarantined { .. })),
        "{outcomes:?}"
    );
    assert_eq!(gate.applied_sequences("a", 0, 10).await, [1, 2]);
    assert_eq!(gate.applied_sequences("b", 0, 10).await, [1, 2]);
    assert_eq!(gate.pending_count().await, 4);
}

/// A publisher of the gate's output to `js`, running until the token is cancelled.
async fn start_publisher(gate: &Gate, js: &jetstream::Context) -> (CancellationToken, Arc<Notify>) {
    start_counted_publisher(gate, js, None).await
}

fn publisher_of(gate: &Gate, js: &jetstream::Context, wake: Arc<Notify>) -> Publisher {
    Publisher::new(
        gate.output.clone(),
        js.clone(),
        OUTPUT_STREAM.to_owned(),
        OUTPUT_PREFIX.to_owned(),
        wake,
    )
}

/// A publisher run in the background (counting into `metrics` when given), after it made sure
/// of the output stream.
async fn start_counted_publisher(
    gate: &Gate,
    js: &jetstream::Context,
    metrics: Option<Metrics>,
) -> (CancellationToken, Arc<Notify>) {
    let wake = Arc::new(Notify::new());
    let mut publisher = publisher_of(gate, js, wake.clone());
    if let Some(metrics) = metrics {
        publisher = publisher.with_metrics(metrics);
    }
    publisher.ensure_stream().await.expect("the output stream");
    let stop = CancellationToken::new();
    tokio::spawn(publisher.run(stop.clone()));
    (stop, wake)
}

/// Everything in the output stream from its start: each message's `Nats-Msg-Id` and body.
async fn read_output(js: &jetstream::Context) -> Vec<(String, Value)> {
    let mut stream = js
        .get_stream(OUTPUT_STREAM)
        .await
        .expect("the output stream");
    let count = stream.info().await.expect("stream info").state.messages as usize;
    if count == 0 {
        return Vec::new();
    }
    let consumer = stream
        .create_consumer(PullConfig {
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .expect("a consumer of the output stream");
    let mut messages = consumer
        .fetch()
        .max_messages(count)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch the output");
    let mut read = Vec::with_capacity(count);
    while let Some(Ok(message)) = messages.next().await {
        let id = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Nats-Msg-Id"))
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default();
        let body = serde_json::from_slice(&message.payload).expect("a JSON body");
        read.push((id, body));
    }
    read
}

async fn stream_count(js: &jetstream::Context) -> u64 {
    let mut stream = js
        .get_stream(OUTPUT_STREAM)
        .await
        .expect("the output stream");
    stream.info().await.expect("stream info").state.messages
}

/// The ids a consumer read, of one aggregate, in the order read.
fn ids_of(read: &[(String, Value)], aggregate: &str) -> Vec<String> {
    read.iter()
        .filter(|(_, body)| body["aggregateId"] == aggregate)
        .map(|(id, _)| id.clone())
        .collect()
}

async fn deliver_orders(gate: &Gate, aggregate: &str, count: i64) {
    for sequence in 1..=count {
        let outcome = deliver(gate, placed(aggregate, sequence, order(sequence))).await;
        assert!(
            matches!(outcome, Ok(Outcome::Applied { .. })),
            "{outcome:?}"
        );
    }
}

async fn the_publisher_publishes_each_aggregates_rows_in_order_with_their_ids(backend: Backend) {
    let gate = open_gate(backend).await;
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let (stop, wake) = start_publisher(&gate, &js).await;
    // A dot in an aggregate is encoded in the subject, and kept in the body and the id.
    deliver_orders(&gate, "order.1", 3).await;
    deliver_orders(&gate, "order-2", 2).await;
    wake.notify_one();
    poll_until(
        "every row marked published",
        || gate.pending_count(),
        |n| *n == 0,
    )
    .await;
    let read = read_output(&js).await;
    assert_eq!(read.len(), 5, "{read:?}");
    assert_eq!(
        ids_of(&read, "order.1"),
        ["order.1:1", "order.1:2", "order.1:3"]
    );
    assert_eq!(ids_of(&read, "order-2"), ["order-2:1", "order-2:2"]);
    let (_, first) = &read
        .iter()
        .find(|(id, _)| id == "order.1:1")
        .expect("order.1's first");
    assert_eq!(
        first,
        &json!({"aggregateId": "order.1", "sequence": 1, "messageId": "order.1-m1",
                "type": PLACED, "payload": order(1)})
    );
    let subjects = js.get_stream(OUTPUT_STREAM).await.expect("stream");
    let last = subjects
        .get_last_raw_message_by_subject("gate.core.out.order%2E1")
        .await
        .expect("the encoded subject holds order.1's rows");
    let body: Value = serde_json::from_slice(&last.payload).expect("a JSON body");
    assert_eq!(
        body["sequence"], 3,
        "order.1's last row is on its encoded subject"
    );
    stop.cancel();
}

async fn a_restarted_publisher_sends_unmarked_rows_again_and_the_consumer_sees_each_once(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let (stop, wake) = start_publisher(&gate, &js).await;
    deliver_orders(&gate, "order-1", 3).await;
    wake.notify_one();
    poll_until(
        "every row marked published",
        || gate.pending_count(),
        |n| *n == 0,
    )
    .await;
    stop.cancel();
    // What a crash between the PubAcks and the mark leaves: published rows not marked.
    gate.execute("UPDATE gate_output SET published_at = NULL");
    assert_eq!(gate.pending_count().await, 3);
    let (stop, _) = start_publisher(&gate, &js).await;
    poll_until(
        "the rows published again and marked",
        || gate.pending_count(),
        |n| *n == 0,
    )
    .await;
    stop.cancel();
    assert_eq!(stream_count(&js).await, 3, "JetStream dropped the copies");
    let read = read_output(&js).await;
    assert_eq!(
        ids_of(&read, "order-1"),
        ["order-1:1", "order-1:2", "order-1:3"]
    );
}

#[tokio::test]
async fn the_publisher_carries_on_in_order_after_the_nats_server_restarts() {
    let gate = open_gate(Backend::Sqlite).await;
    let mut nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let (stop, wake) = start_publisher(&gate, &js).await;
    deliver_orders(&gate, "order-1", 2).await;
    wake.notify_one();
    poll_until(
        "the first rows published",
        || gate.pending_count(),
        |n| *n == 0,
    )
    .await;
    nats.restart().expect("nats-server restarts");
    for sequence in 3..=4 {
        let outcome = deliver(&gate, placed("order-1", sequence, order(sequence))).await;
        assert!(
            matches!(outcome, Ok(Outcome::Applied { .. })),
            "{outcome:?}"
        );
    }
    wake.notify_one();
    poll_until_within(
        "the later rows published after the restart",
        Duration::from_secs(20),
        || gate.pending_count(),
        |n| *n == 0,
    )
    .await;
    stop.cancel();
    let read = read_output(&js).await;
    assert_eq!(
        ids_of(&read, "order-1"),
        ["order-1:1", "order-1:2", "order-1:3", "order-1:4"]
    );
}

/// A counter's value in `metrics`' scrape text.
fn counted(metrics: &Metrics, series: &str) -> u64 {
    metrics
        .render(None, 0)
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in the scrape"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_counts_the_rows_it_publishes_and_the_rounds_that_fail() {
    let gate = open_gate(Backend::Sqlite).await;
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let metrics = Metrics::new();
    let (stop, wake) = start_counted_publisher(&gate, &js, Some(metrics.clone())).await;
    // Without its stream a publish finds no responder: the round fails and the row waits.
    js.delete_stream(OUTPUT_STREAM)
        .await
        .expect("the output stream deleted");
    deliver_orders(&gate, "order-1", 2).await;
    wake.notify_one();
    poll_until(
        "a failed round counted",
        || std::future::ready(counted(&metrics, "gate_publish_failures_total")),
        |failed| *failed >= 1,
    )
    .await;
    assert_eq!(counted(&metrics, "gate_output_published_total"), 0);
    assert_eq!(gate.pending_count().await, 2);
    publisher_of(&gate, &js, wake.clone())
        .ensure_stream()
        .await
        .expect("the output stream again");
    poll_until(
        "both rows counted as published",
        || std::future::ready(counted(&metrics, "gate_output_published_total")),
        |published| *published == 2,
    )
    .await;
    assert_eq!(gate.pending_count().await, 0);
    stop.cancel();
}

async fn the_publishers_lease_goes_to_one_gate_until_it_lapses_and_a_takeover_bumps_the_epoch(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let lease = Duration::from_secs(60);
    let first = gate
        .output
        .take_lease("first", lease)
        .await
        .expect("take")
        .expect("a free lease is taken");
    assert_eq!(first.epoch, 1);
    assert_eq!(
        gate.output.take_lease("second", lease).await.expect("take"),
        None
    );
    assert!(gate.output.renew_lease(&first, lease).await.expect("renew"));
    // The holder stopped renewing and its lease ran out.
    gate.execute("UPDATE gate_publisher_lease SET expires_at_ms = 0");
    let second = gate
        .output
        .take_lease("second", lease)
        .await
        .expect("take")
        .expect("a lapsed lease is taken over");
    assert_eq!(second.epoch, 2);
    assert!(
        !gate.output.renew_lease(&first, lease).await.expect("renew"),
        "the old holder's renewal fails once another holds the lease"
    );
    gate.output.release_lease(&first).await.expect("release");
    assert_eq!(
        gate.output.take_lease("third", lease).await.expect("take"),
        None
    );
    gate.output.release_lease(&second).await.expect("release");
    let third = gate.output.take_lease("third", lease).await.expect("take");
    assert_eq!(
        third.map(|lease| lease.epoch),
        Some(3),
        "a released lease is free at once"
    );
}

/// A holder renews its lease at the first round after a third of its term, not at every round:
/// each renewal is a commit of the store. Rounds in quick succession leave the expiry as it
/// was; a holder that keeps running rounds under a short lease keeps it, at one epoch.
async fn a_holder_renews_its_lease_once_a_third_of_its_term_passed_rather_than_at_every_round(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let mut patient =
        publisher_of(&gate, &js, Arc::new(Notify::new())).with_lease(Duration::from_secs(60));
    patient.ensure_stream().await.expect("the output stream");
    assert_eq!(patient.round().await.expect("a round"), 0);
    let taken = gate.lease_expiry();
    deliver_orders(&gate, "order-1", 2).await;
    assert_eq!(patient.round().await.expect("a round"), 2);
    for _ in 0..5 {
        assert_eq!(patient.round().await.expect("a round"), 0);
    }
    assert_eq!(
        gate.lease_expiry(),
        taken,
        "rounds within a third of the term renew nothing"
    );

    gate.execute("UPDATE gate_publisher_lease SET expires_at_ms = 0");
    let short = Duration::from_millis(600);
    let hurried = publisher_of(&gate, &js, Arc::new(Notify::new())).with_lease(short);
    let held = hurried.held_epoch();
    let hurried = tokio::sync::Mutex::new(hurried);
    assert_eq!(hurried.lock().await.round().await.expect("a round"), 0);
    assert_eq!(held.get(), Some(2), "the lapsed lease is taken over");
    let first = gate.lease_expiry();
    // Three terms of rounds: a holder that renewed only at its takeover would lose the lease.
    poll_until_within(
        "the holder renewed its lease past three terms after taking it",
        Duration::from_secs(20),
        || async {
            hurried.lock().await.round().await.expect("a round");
            assert_eq!(held.get(), Some(2), "the holder never lost its lease");
            gate.lease_expiry()
        },
        |expiry| *expiry > first + 3 * 600,
    )
    .await;
}

/// The publish a stale publisher makes is refused by JetStream, whatever the lease row says:
/// the store is made to hand the lease back to a publisher that missed another's publishes.
async fn a_publisher_that_missed_anothers_publishes_is_refused_by_the_server_and_reads_the_stream_again(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let metrics = Metrics::new();
    let mut stale = publisher_of(&gate, &js, Arc::new(Notify::new())).with_metrics(metrics.clone());
    let mut other = publisher_of(&gate, &js, Arc::new(Notify::new()));
    stale.ensure_stream().await.expect("the output stream");
    deliver_orders(&gate, "order-1", 3).await;
    assert_eq!(stale.round().await.expect("a round"), 3);
    assert_eq!(
        other.round().await.expect("a round"),
        0,
        "the other stands by"
    );
    gate.execute("UPDATE gate_publisher_lease SET expires_at_ms = 0");
    for sequence in 4..=5 {
        deliver(&gate, placed("order-1", sequence, order(sequence)))
            .await
            .expect("applied");
    }
    assert_eq!(
        other.round().await.expect("a round"),
        2,
        "the other took over"
    );
    assert_eq!(stream_count(&js).await, 5);
    // The lease back with the first publisher, which still believes order-1 ends at 3.
    gate.execute(&format!(
        "UPDATE gate_publisher_lease SET holder = '{}', epoch = 1, expires_at_ms = 9000000000000000",
        stale.holder()
    ));
    deliver(&gate, placed("order-1", 6, order(6)))
        .await
        .expect("applied");
    assert_eq!(stale.round().await.expect("a fenced round"), 0);
    assert_eq!(counted(&metrics, "gate_publisher_fenced_total"), 1);
    assert_eq!(stream_count(&js).await, 5, "the stale publish was refused");
    assert_eq!(gate.pending_count().await, 1);
    // Its next round reads the subject's last message and carries on after it.
    assert_eq!(stale.round().await.expect("a round"), 1);
    let read = read_output(&js).await;
    assert_eq!(
        ids_of(&read, "order-1"),
        [
            "order-1:1",
            "order-1:2",
            "order-1:3",
            "order-1:4",
            "order-1:5",
            "order-1:6"
        ]
    );
}

/// A store behind its output stream, as a store restored from a copy is: the stream holds
/// `order-1`'s first rows, which the store has as waiting. They were published long enough ago
/// that the stream's duplicate window no longer knows their ids (here they carry none), so only
/// the publisher's reading of the subject keeps them from going out twice; and the backlog is
/// larger than an aggregate's share of a round, so the rows the stream holds span several rounds.
async fn a_publisher_behind_its_stream_marks_what_the_stream_holds_and_publishes_only_what_follows(
    backend: Backend,
) {
    let share = output::PENDING_PER_AGGREGATE as i64;
    let (held, total) = (2 * share + 3, 3 * share + 5);
    let gate = open_gate(backend).await;
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let mut publisher = publisher_of(&gate, &js, Arc::new(Notify::new()));
    publisher.ensure_stream().await.expect("the output stream");
    deliver_orders(&gate, "order-1", total).await;
    deliver_orders(&gate, "order-2", total).await;
    let earlier = gate
        .output
        .applied("order-1", 0, held as usize)
        .await
        .expect("applied");
    for row in &earlier {
        js.publish(
            subject_for(OUTPUT_PREFIX, "order-1"),
            body(row).expect("a body").into(),
        )
        .await
        .expect("publish")
        .await
        .expect("PubAck");
    }
    let mut rounds = 0;
    while gate.pending_count().await > 0 {
        publisher.round().await.expect("a round");
        rounds += 1;
        assert!(rounds <= 20, "the backlog never drained");
    }
    assert!(rounds > 2, "order-1's backlog took {rounds} rounds");
    let read = read_output(&js).await;
    let sequences_of = |aggregate: &str| -> Vec<i64> {
        read.iter()
            .filter(|(_, body)| body["aggregateId"] == aggregate)
            .filter_map(|(_, body)| body["sequence"].as_i64())
            .collect()
    };
    let every: Vec<i64> = (1..=total).collect();
    assert_eq!(
        sequences_of("order-1"),
        every,
        "order-1 once each, in order"
    );
    assert_eq!(
        sequences_of("order-2"),
        every,
        "order-2 once each, in order"
    );
    assert_eq!(read.len() as i64, 2 * total, "no copy in the stream");
    let sent_by_the_publisher: Vec<String> = ids_of(&read, "order-1")
        .into_iter()
        .filter(|id| !id.is_empty())
        .collect();
    let following: Vec<String> = (held + 1..=total)
        .map(|sequence| format!("order-1:{sequence}"))
        .collect();
    assert_eq!(
        sent_by_the_publisher, following,
        "only what follows is sent"
    );
}

on_both_backends!(
    a_valid_message_applies_and_its_output_row_commits_with_it,
    an_output_row_already_there_fails_the_delivery_and_records_nothing,
    a_schema_invalid_message_is_quarantined_with_the_validators_first_error_and_no_output,
    an_unknown_type_at_the_expected_sequence_is_poison,
    messages_delivered_three_one_two_come_out_as_one_two_three,
    the_pending_rows_span_every_aggregate_rather_than_the_first_ones_backlog,
    a_pending_read_costs_the_same_whatever_backlog_stands_behind_its_answer,
    a_pending_read_costs_what_it_answers_when_the_statistics_say_nothing_waits,
    a_prune_batch_costs_what_it_deletes_whatever_the_statistics_say,
    the_backlog_read_stops_at_its_cap_and_finds_the_oldest_row_whatever_waits_behind,
    the_backlog_shows_rows_waiting_while_no_publisher_runs_and_none_once_published,
    a_batch_with_a_poison_in_it_writes_the_output_of_exactly_the_applied_messages,
    the_publisher_publishes_each_aggregates_rows_in_order_with_their_ids,
    a_restarted_publisher_sends_unmarked_rows_again_and_the_consumer_sees_each_once,
    a_dead_letters_skip_and_a_gap_skip_of_three_come_out_on_the_output_stream_as_markers_in_order,
    the_publishers_lease_goes_to_one_gate_until_it_lapses_and_a_takeover_bumps_the_epoch,
    a_publisher_that_missed_anothers_publishes_is_refused_by_the_server_and_reads_the_stream_again,
    a_holder_renews_its_lease_once_a_third_of_its_term_passed_rather_than_at_every_round,
    a_publisher_behind_its_stream_marks_what_the_stream_holds_and_publishes_only_what_follows,
);

/// `order-1` with 1 applied, 2 quarantined and skipped by the operator, 3..=5 skipped as a gap
/// and 6 applied: the two resolutions' ids.
async fn skip_a_dead_letter_and_a_gap_of_three(gate: &Gate) -> (i64, i64) {
    gate.execute(
        "INSERT INTO operators(name, token_hash, created_at) VALUES ('alice', 'hash', 't')",
    );
    deliver_orders(gate, "order-1", 1).await;
    let poison = placed("order-1", 2, json!({"orderId": "o-2", "amount": -5}));
    let outcome = deliver(gate, poison).await;
    assert!(
        matches!(outcome, Ok(Outcome::Quarantined { .. })),
        "{outcome:?}"
    );
    let skip = ResolutionRequest {
        producer: None,
        dead_letter_id: "order-1-m2".into(),
        operator: "alice".into(),
        action: Action::Skip,
        expected_last: 1,
        reason: "a test order".into(),
    };
    let Ok(Resolved::New(skipped)) = gate.inbox.resolve(skip, Mode::Commit).await else {
        panic!("the dead letter skipped");
    };
    let outcome = deliver(gate, placed("order-1", 6, order(6))).await;
    assert!(matches!(outcome, Ok(Outcome::Gap { .. })), "{outcome:?}");
    let gap = GapRequest {
        aggregate_id: "order-1".into(),
        operator: "alice".into(),
        range: SequenceRange {
            from: 3,
            through: 5,
        },
        expected_last: 2,
        reason: "lost upstream".into(),
    };
    let Ok(GapResolved::New(gap_skipped)) = gate.inbox.resolve_gap(gap, Mode::Commit).await else {
        panic!("the gap skipped");
    };
    deliver_orders_from(gate, "order-1", 6, 6).await;
    let ids = (skipped.resolution_id, gap_skipped.resolution_id);
    (ids.0.expect("an id"), ids.1.expect("an id"))
}

async fn deliver_orders_from(gate: &Gate, aggregate: &str, from: i64, through: i64) {
    for sequence in from..=through {
        let outcome = deliver(gate, placed(aggregate, sequence, order(sequence))).await;
        assert!(
            matches!(outcome, Ok(Outcome::Applied { .. })),
            "{outcome:?}"
        );
    }
}

async fn a_dead_letters_skip_and_a_gap_skip_of_three_come_out_on_the_output_stream_as_markers_in_order(
    backend: Backend,
) {
    let gate = open_gate(backend).await;
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    let (stop, wake) = start_publisher(&gate, &js).await;
    let (dead_letter_skip, gap_skip) = skip_a_dead_letter_and_a_gap_of_three(&gate).await;
    // A late message for a skipped sequence is still stale.
    let late = deliver(&gate, placed("order-1", 4, order(4))).await;
    assert!(matches!(late, Ok(Outcome::Stale { .. })), "{late:?}");
    wake.notify_one();
    poll_until(
        "every row marked published",
        || gate.pending_count(),
        |n| *n == 0,
    )
    .await;
    stop.cancel();
    let read = read_output(&js).await;
    assert_eq!(
        ids_of(&read, "order-1"),
        [
            "order-1:1",
            "order-1:2",
            "order-1:3",
            "order-1:4",
            "order-1:5",
            "order-1:6"
        ]
    );
    let bodies: Vec<&Value> = read.iter().map(|(_, body)| body).collect();
    let types: Vec<&str> = bodies
        .iter()
        .map(|body| body["type"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        types,
        [
            PLACED,
            "gate.skipped",
            "gate.skipped",
            "gate.skipped",
            "gate.skipped",
            PLACED
        ]
    );
    assert_eq!(
        bodies[1],
        &json!({"aggregateId": "order-1", "sequence": 2,
                "messageId": format!("skip:{dead_letter_skip}:2"), "type": "gate.skipped",
                "payload": {"resolutionId": dead_letter_skip, "operator": "alice",
                            "reason": "a test order"}})
    );
    for (index, sequence) in [(2, 3), (3, 4), (4, 5)] {
        assert_eq!(
            bodies[index]["messageId"],
            format!("skip:{gap_skip}:{sequence}")
        );
        assert_eq!(
            bodies[index]["payload"],
            json!({"resolutionId": gap_skip, "operator": "alice", "reason": "lost upstream"})
        );
    }
    assert_eq!(
        gate.applied_sequences("order-1", 0, 1000).await,
        [1, 2, 3, 4, 5, 6]
    );
}
