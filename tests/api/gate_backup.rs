//! Backups under load: a copy of a gate's SQLite store taken by `production-lab gate backup`, and
//! of a PostgreSQL store by `pg_dump` as docs/gate.md shows, while producers deliver; a new gate
//! started on the restored copy carries on with the same output stream (no message twice, none
//! missing); and the command's refusals (an existing path, a PostgreSQL store).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::aggregates::add_operator_on;
use crate::gate::{
    Certificate, GateFiles, GateProcess, PLACED_SCHEMA, Producer, add_operator, add_producer,
    assert_in_order_once, deliver_until_decided, messages_of, output_count, read_output,
};
use crate::helpers::{command, poll_until_within};
use crate::https::HttpsClient;
use crate::postgres::query_text;
use lab_testkit::nats::NatsServer;

/// More messages than a producer of the test sends before it is stopped.
const LONGEST: i64 = 5_000;
/// Messages each aggregate gets past the backup point before the gate is stopped, and again on
/// the restored gate past where the first one stopped.
const PAST_THE_BACKUP: i64 = 10;

/// `production-lab gate backup --config CONFIG --to TARGET` with `extra` arguments and `env`,
/// run to its end: its exit status, stdout and stderr.
async fn run_backup(
    config: &Path,
    target: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (std::process::ExitStatus, String, String) {
    let mut backup = tokio::process::Command::from(command());
    backup
        .args(["gate", "backup", "--config"])
        .arg(config)
        .arg("--to")
        .arg(target)
        .args(extra)
        .envs(env.iter().copied())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(120), backup.output())
        .await
        .expect("the backup finishes within two minutes")
        .expect("run production-lab gate backup");
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Producers, one task per aggregate, each sending its aggregate's messages in order until
/// stopped; `acknowledged[i]` is the last sequence of aggregate `i` the gate answered 200 to.
struct Load {
    acknowledged: Arc<Vec<AtomicI64>>,
    stop: CancellationToken,
    senders: tokio::task::JoinSet<()>,
}

impl Load {
    fn start(client: &HttpsClient, gate: &str, producer: &Producer, aggregates: &[String]) -> Load {
        let acknowledged: Arc<Vec<AtomicI64>> =
            Arc::new(aggregates.iter().map(|_| AtomicI64::new(0)).collect());
        let stop = CancellationToken::new();
        let mut senders = tokio::task::JoinSet::new();
        for (index, aggregate) in aggregates.iter().enumerate() {
            let (client, gate, producer) = (client.clone(), gate.to_owned(), producer.clone());
            let (messages, acknowledged, stop) = (
                messages_of(aggregate, LONGEST),
                acknowledged.clone(),
                stop.clone(),
            );
            senders.spawn(async move {
                for message in &messages {
                    if stop.is_cancelled() {
                        break;
                    }
                    let status = deliver_until_decided(&client, &gate, &producer, message).await;
                    assert_eq!(status, 200, "{}", message.message_id);
                    acknowledged[index].store(message.sequence, Ordering::SeqCst);
                }
            });
        }
        Load {
            acknowledged,
            stop,
            senders,
        }
    }

    /// Each aggregate's last acknowledged sequence now.
    fn acknowledged(&self) -> Vec<i64> {
        self.acknowledged
            .iter()
            .map(|last| last.load(Ordering::SeqCst))
            .collect()
    }

    /// Stops the producers after the message each is sending: every aggregate's last sequence.
    async fn stop(mut self) -> Vec<i64> {
        self.stop.cancel();
        while let Some(sent) = self.senders.join_next().await {
            sent.expect("a producer");
        }
        self.acknowledged()
    }
}

/// Where the test's gates keep their store, and how it is copied and restored.
enum Backed {
    /// A SQLite file, copied by `gate backup` one page per step.
    Sqlite,
    /// A database of the test run's PostgreSQL, copied by `pg_dump` of the tables docs/gate.md
    /// names and restored by `pg_restore` into an empty database, as that page shows.
    Postgres { database: String },
}

/// A copy taken under load, restored where a new gate can start on it.
enum Restored {
    Sqlite { copy: tempfile::TempDir },
    Postgres { database: String },
}

impl Backed {
    /// The gate's files and environment for this store.
    fn files(
        &self,
        certificate: &Certificate,
        nats: &NatsServer,
    ) -> (GateFiles, Vec<(String, String)>) {
        let files = GateFiles::new(certificate, nats);
        match self {
            Backed::Sqlite => (files, Vec::new()),
            Backed::Postgres { database } => (files.on_postgres(), database_env(database)),
        }
    }

    fn add_operator(&self, files: &GateFiles) -> String {
        match self {
            Backed::Sqlite => add_operator(&files.database(), "alice"),
            Backed::Postgres { database } => {
                add_operator_on(&["--inbox".into(), database.into()], "alice")
            }
        }
    }

    /// Takes the copy while the load runs: the SQLite file by the real command, one page per
    /// step so that deliveries commit between its steps; the PostgreSQL tables by `pg_dump`,
    /// one snapshot, restored at once into a new database.
    async fn copy(&self, files: &GateFiles, load: &Load) -> Restored {
        match self {
            Backed::Sqlite => {
                let backups = tempfile::tempdir().expect("a temp dir");
                let copy = backups.path().join("gate-copy.db");
                let before = load.acknowledged();
                let (status, stdout, stderr) = run_backup(
                    &files.config(),
                    &copy,
                    &["--pages-per-step", "1", "--pause-ms", "5"],
                    &[],
                )
                .await;
                let after = load.acknowledged();
                assert!(status.success(), "the backup failed: {stderr}");
                assert!(
                    stdout.trim().lines().count() == 1
                        && stdout.contains(" pages, ")
                        && stdout.contains(" bytes, ")
                        && stdout.trim_end().ends_with(" ms"),
                    "one summary line: {stdout}"
                );
                assert!(
                    after.iter().sum::<i64>() > before.iter().sum::<i64>(),
                    "deliveries were acknowledged while the backup ran: {before:?} {after:?}"
                );
                Restored::Sqlite { copy: backups }
            }
            Backed::Postgres { database } => {
                let dumps = tempfile::tempdir().expect("a temp dir");
                let dump = dumps.path().join("gate.dump");
                let mut arguments = vec![
                    "--format=custom".to_owned(),
                    format!("--file={}", dump.display()),
                ];
                arguments.extend(
                    documented_tables()
                        .iter()
                        .map(|table| format!("--table={table}")),
                );
                arguments.push(database.clone());
                run_postgres_tool("pg_dump", &arguments).await;
                let restored = crate::postgres::fresh_database();
                run_postgres_tool(
                    "pg_restore",
                    &[
                        format!("--dbname={restored}"),
                        "--single-transaction".into(),
                        "--exit-on-error".into(),
                        dump.display().to_string(),
                    ],
                )
                .await;
                Restored::Postgres { database: restored }
            }
        }
    }
}

impl Restored {
    /// Each aggregate's position (`last_sequence`) in the copy, and the output rows marked
    /// published there.
    fn positions_and_published(&self) -> (BTreeMap<String, i64>, i64) {
        const POSITIONS: &str = "SELECT aggregate_id, last_sequence FROM aggregate_state";
        const PUBLISHED: &str = "SELECT count(*) FROM gate_output WHERE published_at IS NOT NULL";
        match self {
            Restored::Sqlite { copy } => {
                let connection = rusqlite::Connection::open(copy.path().join("gate-copy.db"))
                    .expect("open the copy");
                let positions = connection
                    .prepare(POSITIONS)
                    .and_then(|mut statement| {
                        statement
                            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                            .collect::<rusqlite::Result<BTreeMap<String, i64>>>()
                    })
                    .expect("the copy's positions");
                let published = connection
                    .query_row(PUBLISHED, [], |row| row.get(0))
                    .expect("the copy's output cursor");
                (positions, published)
            }
            Restored::Postgres { database } => {
                let number = |text: &Option<String>| {
                    text.as_deref()
                        .and_then(|text| text.parse().ok())
                        .expect("a number")
                };
                let positions = query_text(database, POSITIONS)
                    .iter()
                    .map(|row| (row[0].clone().expect("an aggregate"), number(&row[1])))
                    .collect();
                (positions, number(&query_text(database, PUBLISHED)[0][0]))
            }
        }
    }

    /// A new gate on the copy, with the same streams.
    fn start_gate(&self, certificate: &Certificate, nats: &NatsServer) -> (GateFiles, GateProcess) {
        let files = GateFiles::new(certificate, nats);
        match self {
            Restored::Sqlite { copy } => {
                std::fs::copy(copy.path().join("gate-copy.db"), files.database())
                    .expect("restore the copy");
                let gate = GateProcess::start(&files.config());
                (files, gate)
            }
            Restored::Postgres { database } => {
                let files = files.on_postgres();
                let env = database_env(database);
                let gate = GateProcess::start_with_env(&files.config(), &borrowed(&env));
                (files, gate)
            }
        }
    }
}

fn database_env(database: &str) -> Vec<(String, String)> {
    vec![("GATE_DATABASE_URL".to_owned(), database.to_owned())]
}

fn borrowed(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter()
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .collect()
}

/// The tables docs/gate.md's `pg_dump` command names, in its order.
fn documented_tables() -> Vec<String> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/gate.md"))
        .expect("docs/gate.md");
    page.split_whitespace()
        .filter_map(|word| word.strip_prefix("--table="))
        .map(str::to_owned)
        .collect()
}

/// Runs one of the cluster's own client programs to its end; fails the test if it fails.
async fn run_postgres_tool(program: &str, arguments: &[String]) {
    let path = crate::postgres::shared_cluster().bindir().join(program);
    let output = tokio::process::Command::new(&path)
        .args(arguments)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|error| panic!("run {}: {error}", path.display()));
    assert!(
        output.status.success(),
        "{program} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The gate's `last` for `aggregate`, as an operator reads it.
async fn position(
    client: &HttpsClient,
    gate: &GateProcess,
    operator: &str,
    aggregate: &str,
) -> i64 {
    let response = client
        .get(gate.url(&format!("/v1/aggregates/{aggregate}")))
        .bearer_auth(operator)
        .send()
        .await
        .expect("a gate answer");
    let body: Value = response.json().await.expect("a JSON aggregate");
    body["last"].as_i64().unwrap_or_else(|| panic!("{body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_taken_under_load_lets_a_restored_gate_continue_without_duplicate_or_gap() {
    a_copy_taken_under_load_lets_a_restored_gate_continue(Backed::Sqlite).await;
}

/// The PostgreSQL steps of docs/gate.md, run as written: its table list is every table of the
/// gate's database, and a gate on the restored dump carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pg_dump_of_the_documented_tables_under_load_lets_a_gate_on_the_restored_database_continue()
 {
    let database = crate::postgres::fresh_database();
    a_copy_taken_under_load_lets_a_restored_gate_continue(Backed::Postgres {
        database: database.clone(),
    })
    .await;
    let tables: BTreeSet<String> = query_text(
        &database,
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public'",
    )
    .into_iter()
    .filter_map(|row| row[0].clone())
    .collect();
    let documented: BTreeSet<String> = documented_tables().into_iter().collect();
    assert_eq!(
        documented, tables,
        "docs/gate.md's pg_dump names every table"
    );
}

async fn a_copy_taken_under_load_lets_a_restored_gate_continue(backed: Backed) {
    let nats = crate::broker::start_nats(None);
    let js = crate::broker::jetstream_of(&nats).await;
    let certificate = Certificate::new();
    let client = certificate.client();
    let (files, env) = backed.files(&certificate, &nats);
    let gate = GateProcess::start_with_env(&files.config(), &borrowed(&env));
    let operator = backed.add_operator(&files);
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let aggregates: Vec<String> = (0..4).map(|index| format!("order-{index}")).collect();

    let load = Load::start(&client, &gate.address, &producer, &aggregates);
    poll_until_within(
        "every producer under way",
        Duration::from_secs(60),
        || std::future::ready(load.acknowledged()),
        |acknowledged| acknowledged.iter().all(|last| *last >= 20),
    )
    .await;
    let before = load.acknowledged();
    let copy = backed.copy(&files, &load).await;
    let after = load.acknowledged();
    // More past the backup point, all published by this gate, then it dies.
    poll_until_within(
        "every aggregate past the backup point",
        Duration::from_secs(60),
        || std::future::ready(load.acknowledged()),
        |now| (0..now.len()).all(|i| now[i] >= after[i] + PAST_THE_BACKUP),
    )
    .await;
    let sent = load.stop().await;
    let published: i64 = sent.iter().sum();
    poll_until_within(
        "the first gate published everything it applied",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= published as u64,
    )
    .await;
    drop(gate);

    // The copy: a consistent snapshot between the two reads of the producers' progress (one
    // message each may have committed before its answer came back), an output cursor with it.
    let (copied, marked) = copy.positions_and_published();
    for (index, aggregate) in aggregates.iter().enumerate() {
        let at = copied.get(aggregate).copied().unwrap_or(0);
        assert!(
            before[index] <= at && at <= after[index] + 1,
            "{aggregate} is at {at} in the copy, outside {}..={}",
            before[index],
            after[index] + 1
        );
    }
    assert!(marked > 0, "the copy holds the output cursor");

    // A new gate on the restored copy, with the same streams.
    let (_restored_files, restored) = copy.start_gate(&certificate, &nats);
    let mut expected = BTreeMap::new();
    let mut resend = tokio::task::JoinSet::new();
    for (index, aggregate) in aggregates.iter().enumerate() {
        let at = position(&client, &restored, &operator, aggregate).await;
        assert_eq!(
            Some(&at),
            copied.get(aggregate),
            "the restored gate's position"
        );
        // The producer sends again what the copy forgot, then carries on.
        let last = sent[index] + PAST_THE_BACKUP;
        expected.insert(aggregate.clone(), last);
        let (client, url, producer) = (client.clone(), restored.address.clone(), producer.clone());
        let messages = messages_of(aggregate, last);
        resend.spawn(async move {
            for message in &messages[at as usize..] {
                let status = deliver_until_decided(&client, &url, &producer, message).await;
                assert_eq!(status, 200, "{}", message.message_id);
            }
        });
    }
    while let Some(sent) = resend.join_next().await {
        sent.expect("a producer");
    }
    let total: i64 = expected.values().sum();
    poll_until_within(
        "the restored gate published every message",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= total as u64,
    )
    .await;
    let output = read_output(&js).await;
    assert_in_order_once(&output, &expected);
    assert_eq!(
        output_count(&js).await,
        total as u64,
        "no copy in the stream"
    );
}

/// A gate without TLS or NATS whose store is `store` (a `[store]` line).
fn plain_gate(store: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temp dir");
    std::fs::write(dir.path().join("placed.json"), PLACED_SCHEMA).expect("the schema");
    let config = format!(
        r#"
[listen]
address = "127.0.0.1:0"

[store]
{store}

[types."order.placed"]
schema = "placed.json"
"#
    );
    std::fs::write(dir.path().join("gate.toml"), config).expect("the config");
    dir
}

#[tokio::test]
async fn a_backup_refuses_an_existing_path_and_a_postgres_store() {
    let sqlite = plain_gate("sqlite = \"gate.db\"");
    let _gate = GateProcess::start(&sqlite.path().join("gate.toml"));
    let existing = sqlite.path().join("existing.db");
    std::fs::write(&existing, "an earlier backup").expect("a file in the way");
    let (status, stdout, stderr) =
        run_backup(&sqlite.path().join("gate.toml"), &existing, &[], &[]).await;
    assert!(!status.success(), "{stdout}");
    assert!(
        stderr.contains("existing.db exists already") && stderr.contains("never overwrites"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(&existing).expect("the file in the way"),
        "an earlier backup"
    );
    assert!(!sqlite.path().join(".existing.db.partial").exists());

    let postgres = plain_gate("postgres_url_env = \"GATE_DATABASE_URL\"");
    let target = postgres.path().join("copy.db");
    let (status, stdout, stderr) = run_backup(
        &postgres.path().join("gate.toml"),
        &target,
        &[],
        &[("GATE_DATABASE_URL", "postgres://gate@127.0.0.1:5432/gate")],
    )
    .await;
    assert!(!status.success(), "{stdout}");
    assert!(
        stderr.contains("PostgreSQL")
            && stderr.contains("pg_dump")
            && stderr.contains("docs/gate.md"),
        "{stderr}"
    );
    assert!(!target.exists(), "nothing written for a PostgreSQL store");
}
