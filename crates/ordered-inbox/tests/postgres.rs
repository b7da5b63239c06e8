//! The PostgreSQL backend with an application's handler, against a private PostgreSQL cluster
//! (`initdb` into a temp directory, `pg_ctl` on a free loopback port; as root every step runs as
//! the `postgres` system user). The order book's handler writes its own tables in the inbox's
//! transaction.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;

use async_trait::async_trait;
use ordered_inbox::postgres::{
    HandlerClient, PostgresError, PostgresHandler, PostgresInbox, Target,
};
use ordered_inbox::resolution::{Action, Mode, ResolutionError, ResolutionRequest, Resolved};
use ordered_inbox::{
    ApplyOutcome, BatchDelivery, Check, Door, HandlerError, Inbox, InboxError, Limits,
    OrderedInbox, OrderedMessage, Outcome, Poison, Undelivered,
};
use serde_json::{Value, json};
use tokio_postgres::Client;

/// A private cluster, stopped and removed when dropped (also while a failed test unwinds).
struct Cluster {
    bindir: PathBuf,
    root: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl Cluster {
    fn start() -> Cluster {
        let bindir = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL server binaries (Debian package postgresql)")
            .filter_map(|entry| entry.ok().map(|entry| entry.path().join("bin")))
            .filter(|bin| bin.join("initdb").exists())
            .max()
            .expect("an initdb under /usr/lib/postgresql/*/bin");
        let root = tempfile::Builder::new()
            .prefix("ordered-inbox-pg-")
            .tempdir()
            .unwrap()
            .keep();
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).trim() == "0");
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster = Cluster {
            bindir,
            root,
            port,
            as_postgres,
        };
        if as_postgres {
            run(Command::new("chown")
                .arg("postgres:postgres")
                .arg(&cluster.root));
        }
        let data = cluster.root.join("data");
        run(cluster.server("initdb").arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ]));
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={} -c fsync=off",
            cluster.root.display()
        );
        run(cluster
            .server("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(cluster.root.join("server.log"))
            .args(["-o", &options, "-w", "-t", "60", "start"]));
        cluster
    }

    fn server(&self, binary: &str) -> Command {
        let path = self.bindir.join(binary);
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self
            .server("pg_ctl")
            .arg("-D")
            .arg(self.root.join("data"))
            .args(["stop", "-m", "immediate", "-w"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn run(command: &mut Command) {
    let output = command.stdin(Stdio::null()).output().unwrap();
    assert!(
        output.status.success(),
        "{command:?}: {} {}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

const ORDER_TABLES: &str = "
CREATE TABLE orders(message_id text PRIMARY KEY, aggregate_id text NOT NULL, quantity bigint NOT NULL);
CREATE TABLE books(aggregate_id text PRIMARY KEY, ordered bigint NOT NULL);
CREATE TABLE caps(aggregate_id text PRIMARY KEY, most bigint NOT NULL);
CREATE TABLE outage(aggregate_id text PRIMARY KEY);";

/// The order book: a negative quantity is poison; applying writes the order, then fails while
/// the aggregate has an outage, finds it poison when it would pass the aggregate's cap, and
/// otherwise adds it to the book.
struct Orders;

impl Check for Orders {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        match message.payload["quantity"].as_i64() {
            Some(quantity) if quantity >= 0 => Ok(()),
            _ => Err(Poison::new("negative quantity")),
        }
    }
}

#[async_trait]
impl PostgresHandler for Orders {
    async fn apply(
        &self,
        client: &HandlerClient,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        let quantity = message.payload["quantity"].as_i64().unwrap_or(0);
        client
            .execute(
                "INSERT INTO orders(message_id, aggregate_id, quantity) VALUES ($1, $2, $3)",
                &[&message.message_id, &message.aggregate_id, &quantity],
            )
            .await?;
        let outage = client
            .query_opt(
                "SELECT 1 FROM outage WHERE aggregate_id = $1",
                &[&message.aggregate_id],
            )
            .await?;
        if outage.is_some() {
            return Err(HandlerError::new("the order book is unavailable"));
        }
        let over: bool = client
            .query_one(
                "SELECT EXISTS(SELECT 1 FROM caps c LEFT JOIN books b USING (aggregate_id)
                                WHERE c.aggregate_id = $1 AND COALESCE(b.ordered, 0) + $2 > c.most)",
                &[&message.aggregate_id, &quantity],
            )
            .await?
            .get(0);
        if over {
            return Ok(ApplyOutcome::Poison(Poison::new("over the cap")));
        }
        let ordered: i64 = client
            .query_one(
                "INSERT INTO books(aggregate_id, ordered) VALUES ($1, $2)
                 ON CONFLICT (aggregate_id) DO UPDATE SET ordered = books.ordered + excluded.ordered
                 RETURNING ordered",
                &[&message.aggregate_id, &quantity],
            )
            .await?
            .get(0);
        let detail = json!({"quantity": quantity, "ordered": ordered});
        Ok(ApplyOutcome::Applied {
            detail: detail.as_object().cloned().unwrap_or_default(),
        })
    }

    async fn state(
        &self,
        client: &HandlerClient,
        aggregate_id: &str,
    ) -> Result<Option<Value>, HandlerError> {
        let ordered: Option<i64> = client
            .query_opt(
                "SELECT ordered FROM books WHERE aggregate_id = $1",
                &[&aggregate_id],
            )
            .await?
            .map(|row| row.get(0));
        Ok(Some(json!({"ordered": ordered.unwrap_or(0)})))
    }
}

fn order(id: &str, aggregate: &str, sequence: i64, quantity: i64) -> OrderedMessage {
    OrderedMessage {
        message_id: id.into(),
        aggregate_id: aggregate.into(),
        sequence,
        payload: json!({ "quantity": quantity }),
    }
}

async fn texts(client: &Client, sql: &str) -> Vec<String> {
    client
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test]
async fn the_handler_writes_its_tables_in_the_inbox_transaction_on_postgres() {
    let cluster = Cluster::start();
    let target = Target::parse(&cluster.url()).unwrap();
    let client = target.connect().await.unwrap();
    client.batch_execute(ORDER_TABLES).await.unwrap();
    let inbox = PostgresInbox::open_with_handler(target, Limits::default(), Arc::new(Orders))
        .await
        .unwrap();

    // Applied, with the handler's detail on the verdict and the timeline; a replay runs nothing.
    let first = inbox
        .deliver(order("m-1", "a", 1, 4), Door::General)
        .await
        .unwrap();
    let Outcome::Applied { detail, .. } = &first else {
        panic!("expected an apply, got {first:?}");
    };
    assert_eq!(
        Value::Object(detail.clone()),
        json!({"quantity": 4, "ordered": 4})
    );
    let again = inbox
        .deliver(order("m-1", "a", 1, 4), Door::General)
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Replay { .. }));
    assert_eq!(
        texts(
            &client,
            "SELECT detail FROM aggregate_timeline WHERE kind = 'applied'"
        )
        .await,
        [r#"{"quantity":4,"ordered":4}"#]
    );

    // A poison from apply after it wrote its row: no trace of the row, the message quarantined.
    client
        .execute("INSERT INTO caps VALUES ('a', 5)", &[])
        .await
        .unwrap();
    let capped = inbox
        .deliver(order("m-2", "a", 2, 3), Door::General)
        .await
        .unwrap();
    assert!(
        matches!(&capped, Outcome::Quarantined { reason, .. } if reason.as_str() == "over the cap"),
        "{capped:?}"
    );
    assert_eq!(
        texts(&client, "SELECT message_id FROM orders ORDER BY message_id").await,
        ["m-1"]
    );
    assert_eq!(
        texts(
            &client,
            "SELECT reason FROM deadletters WHERE message_id = 'm-2'"
        )
        .await,
        ["over the cap"]
    );

    // A replacement goes through the handler; the audit row carries its states.
    client.execute("DELETE FROM caps", &[]).await.unwrap();
    client
        .batch_execute("INSERT INTO operators VALUES ('alice', 'h', 't', NULL)")
        .await
        .unwrap();
    let held = inbox
        .deliver_as(order("m-3", "a", 3, 1), Door::Broker, None)
        .await
        .unwrap();
    assert!(matches!(held, Ok(Outcome::Held { .. })), "{held:?}");
    let request = ResolutionRequest {
        producer: None,
        dead_letter_id: "m-2".into(),
        operator: "alice".into(),
        action: Action::Replace {
            message_id: "fix-2".into(),
            payload: json!({"quantity": 1}),
        },
        expected_last: 1,
        reason: "smaller order".into(),
    };
    let Resolved::New(record) = inbox.resolve(request, Mode::Commit).await.unwrap() else {
        panic!("expected a resolution");
    };
    assert_eq!(
        (record.before.state, record.after.state),
        (Some(json!({"ordered": 4})), Some(json!({"ordered": 5})))
    );
    assert_eq!(
        texts(&client, "SELECT message_id FROM orders ORDER BY message_id").await,
        ["fix-2", "m-1", "m-3"],
        "the replacement and the held message it released went through the handler"
    );
    assert_eq!(
        texts(
            &client,
            "SELECT replacement_payload || '|' || before_state || '|' || after_state FROM resolutions"
        )
        .await,
        [r#"{"quantity":1}|{"ordered":4}|{"ordered":5}"#]
    );

    // A handler error fails its delivery alone; the retry applies it once.
    client
        .execute("INSERT INTO outage VALUES ('b')", &[])
        .await
        .unwrap();
    let batch = || {
        vec![
            BatchDelivery::anonymous(order("b-1", "b", 1, 1), Door::Broker),
            BatchDelivery::anonymous(order("c-1", "c", 1, 1), Door::Broker),
        ]
    };
    let verdicts = inbox.deliver_batch(batch()).await.unwrap();
    assert!(
        matches!(verdicts[0], Err(Undelivered::Handler(_))),
        "{verdicts:?}"
    );
    assert!(matches!(verdicts[1], Ok(Outcome::Applied { .. })));
    assert_eq!(
        texts(
            &client,
            "SELECT message_id FROM ordered_inbox WHERE aggregate_id = 'b'"
        )
        .await,
        Vec::<String>::new()
    );
    let single = inbox.deliver(order("b-1", "b", 1, 1), Door::General).await;
    assert!(matches!(single, Err(InboxError::Handler(_))), "{single:?}");
    client.execute("DELETE FROM outage", &[]).await.unwrap();
    let retried = inbox.deliver_batch(batch()).await.unwrap();
    assert!(matches!(retried[0], Ok(Outcome::Applied { .. })));
    assert!(matches!(retried[1], Ok(Outcome::Replay { .. })));
    assert_eq!(
        texts(
            &client,
            "SELECT message_id FROM orders WHERE aggregate_id = 'b'"
        )
        .await,
        ["b-1"]
    );

    // A replacement that apply finds poison is refused and leaves nothing.
    inbox
        .deliver(order("bad-2", "c", 2, -1), Door::General)
        .await
        .unwrap();
    client
        .execute("INSERT INTO caps VALUES ('c', 1)", &[])
        .await
        .unwrap();
    let refused = inbox
        .resolve(
            ResolutionRequest {
                producer: None,
                dead_letter_id: "bad-2".into(),
                operator: "alice".into(),
                action: Action::Replace {
                    message_id: "fix-c".into(),
                    payload: json!({"quantity": 2}),
                },
                expected_last: 1,
                reason: "corrected".into(),
            },
            Mode::Commit,
        )
        .await;
    assert!(
        matches!(&refused, Err(ResolutionError::ReplacementQuarantined(reason)) if reason.as_str() == "over the cap"),
        "{refused:?}"
    );
    assert_eq!(
        texts(
            &client,
            "SELECT message_id FROM orders WHERE aggregate_id = 'c'"
        )
        .await,
        ["c-1"]
    );
    assert_eq!(
        texts(
            &client,
            "SELECT status FROM deadletters WHERE message_id = 'bad-2'"
        )
        .await,
        ["open"]
    );
    inbox.close();
}

const TALLY_TABLE: &str = "
CREATE TABLE tally(aggregate_id text NOT NULL, message_id text NOT NULL, sequence bigint NOT NULL);
CREATE TABLE tally_counts(aggregate_id text PRIMARY KEY, applied bigint NOT NULL);";

/// A handler that logs every apply (no key: a doubled apply shows as a second row) and counts
/// the applies per aggregate, the count being its detail: it equals the sequence only if every
/// apply saw the ones before it.
struct Tally;

impl Check for Tally {
    fn check(&self, _: &OrderedMessage) -> Result<(), Poison> {
        Ok(())
    }
}

#[async_trait]
impl PostgresHandler for Tally {
    async fn apply(
        &self,
        client: &HandlerClient,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        client
            .execute(
                "INSERT INTO tally VALUES ($1, $2, $3)",
                &[
                    &message.aggregate_id,
                    &message.message_id,
                    &message.sequence,
                ],
            )
            .await?;
        let applied: i64 = client
            .query_one(
                "INSERT INTO tally_counts VALUES ($1, 1) ON CONFLICT (aggregate_id)
                 DO UPDATE SET applied = tally_counts.applied + 1 RETURNING applied",
                &[&message.aggregate_id],
            )
            .await?
            .get(0);
        let detail = json!({ "applied": applied });
        Ok(ApplyOutcome::Applied {
            detail: detail.as_object().cloned().unwrap_or_default(),
        })
    }
}

/// Two inboxes on one database stand for two servers.
async fn two_inboxes(
    cluster: &Cluster,
    tables: &str,
    handler: Arc<dyn PostgresHandler>,
) -> (Client, PostgresInbox, PostgresInbox) {
    let target = Target::parse(&cluster.url()).unwrap();
    let client = target.connect().await.unwrap();
    client.batch_execute(tables).await.unwrap();
    let open =
        || PostgresInbox::open_with_handler(target.clone(), Limits::default(), handler.clone());
    let (first, second) = (open().await.unwrap(), open().await.unwrap());
    (client, first, second)
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_clients_over_two_inboxes_hammering_four_aggregates_apply_every_sequence_once() {
    const AGGREGATES: usize = 4;
    const SEQUENCES: i64 = 40;
    let cluster = Cluster::start();
    let (client, first, second) = two_inboxes(&cluster, TALLY_TABLE, Arc::new(Tally)).await;
    // Sixteen clients per aggregate, half through each inbox, all sending the same sequences at
    // once: many deliveries of one aggregate and of one id in flight together.
    let clients: Vec<_> = (0..64)
        .map(|number| {
            let inbox = if number % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            let aggregate = format!("agg-{}", number % AGGREGATES);
            tokio::spawn(async move {
                let mut applied = Vec::new();
                for sequence in 1..=SEQUENCES {
                    let message = OrderedMessage {
                        message_id: format!("{aggregate}-{sequence}"),
                        aggregate_id: aggregate.clone(),
                        sequence,
                        payload: json!({ "n": sequence }),
                    };
                    match inbox.deliver_as(message, Door::General, None).await {
                        Ok(Ok(Outcome::Applied { detail, .. })) => {
                            assert_eq!(
                                Value::Object(detail),
                                json!({ "applied": sequence }),
                                "{aggregate} {sequence}: the apply saw exactly the ones before it"
                            );
                            applied.push((aggregate.clone(), sequence));
                        }
                        Ok(Ok(Outcome::Replay { .. })) => {}
                        other => panic!("{aggregate} {sequence}: {other:?}"),
                    }
                }
                applied
            })
        })
        .collect();
    let mut applied: Vec<(String, i64)> = Vec::new();
    for client in clients {
        applied.extend(client.await.unwrap());
    }
    applied.sort();
    let expected: Vec<(String, i64)> = (0..AGGREGATES)
        .flat_map(|a| (1..=SEQUENCES).map(move |s| (format!("agg-{a}"), s)))
        .collect();
    assert_eq!(
        applied, expected,
        "each message answered applied exactly once"
    );
    assert_eq!(
        texts(
            &client,
            "SELECT aggregate_id || ':' || last_sequence FROM aggregate_state ORDER BY 1"
        )
        .await,
        (0..AGGREGATES)
            .map(|a| format!("agg-{a}:{SEQUENCES}"))
            .collect::<Vec<_>>()
    );
    let expected_rows = i64::try_from(AGGREGATES).unwrap() * SEQUENCES;
    for table in ["tally", "ordered_inbox"] {
        assert_eq!(
            count(
                &client,
                &format!("SELECT COUNT(DISTINCT (aggregate_id, sequence)) FROM {table}")
            )
            .await,
            expected_rows,
            "{table}: no sequence skipped"
        );
        assert_eq!(
            count(&client, &format!("SELECT COUNT(*) FROM {table}")).await,
            expected_rows,
            "{table}: no sequence doubled"
        );
    }
    let stats = [first.stats(), second.stats()];
    let (commits, grouped) = stats.iter().fold((0, 0), |(c, g), s| {
        (c + s.group_commits, g + s.grouped_deliveries)
    });
    assert!(
        grouped > commits,
        "deliveries arriving together share a commit: {stats:?}"
    );
    first.close();
    second.close();
}

#[tokio::test]
async fn a_group_with_a_failing_and_a_poisoned_delivery_keeps_the_rest_and_the_failed_one_applies_once_when_retried()
 {
    let cluster = Cluster::start();
    let (client, inbox, _) = two_inboxes(&cluster, ORDER_TABLES, Arc::new(Orders)).await;
    client
        .batch_execute("INSERT INTO outage VALUES ('b'); INSERT INTO caps VALUES ('c', 1)")
        .await
        .unwrap();
    let group = || {
        [
            order("a-1", "a", 1, 1),
            order("a-2", "a", 2, 2),
            order("b-1", "b", 1, 1),
            order("c-1", "c", 1, 5),
            order("a-3", "a", 3, 3),
            order("d-1", "d", 1, 1),
        ]
        .into_iter()
        .map(|message| BatchDelivery::anonymous(message, Door::Broker))
        .collect::<Vec<_>>()
    };
    let verdicts = inbox.deliver_batch(group()).await.unwrap();
    let applied =
        |verdict: &Result<Outcome, Undelivered>| matches!(verdict, Ok(Outcome::Applied { .. }));
    assert!(
        [0, 1, 4, 5].iter().all(|index| applied(&verdicts[*index])),
        "{verdicts:?}"
    );
    assert!(
        matches!(verdicts[2], Err(Undelivered::Handler(_))),
        "{verdicts:?}"
    );
    assert!(
        matches!(&verdicts[3], Ok(Outcome::Quarantined { reason, .. }) if reason.as_str() == "over the cap"),
        "{verdicts:?}"
    );
    assert_eq!(inbox.stats().replays, 1, "the group was replayed once");
    assert_eq!(
        texts(&client, "SELECT message_id FROM orders ORDER BY message_id").await,
        ["a-1", "a-2", "a-3", "d-1"],
        "neither the failed nor the poisoned delivery left an order"
    );
    assert_eq!(
        texts(
            &client,
            "SELECT aggregate_id || ':' || ordered FROM books ORDER BY 1"
        )
        .await,
        ["a:6", "d:1"]
    );

    client.execute("DELETE FROM outage", &[]).await.unwrap();
    let retried = inbox.deliver_batch(group()).await.unwrap();
    assert!(applied(&retried[2]), "{retried:?}");
    assert!(
        [0, 1, 4, 5]
            .iter()
            .all(|index| matches!(retried[*index], Ok(Outcome::Replay { .. }))),
        "{retried:?}"
    );
    assert_eq!(
        texts(
            &client,
            "SELECT message_id FROM ordered_inbox ORDER BY message_id"
        )
        .await,
        ["a-1", "a-2", "a-3", "b-1", "d-1"],
        "the failed delivery applied once, the others were not doubled"
    );
    assert_eq!(
        count(
            &client,
            "SELECT COUNT(*) FROM orders WHERE aggregate_id = 'b'"
        )
        .await,
        1
    );
    inbox.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_inboxes_groups_over_overlapping_aggregates_in_opposite_orders_finish_without_deadlock()
{
    const ROUNDS: i64 = 30;
    let cluster = Cluster::start();
    let (client, first, second) = two_inboxes(&cluster, TALLY_TABLE, Arc::new(Tally)).await;
    let aggregates = ["w", "x", "y", "z"];
    // Each round, one inbox delivers sequence 2r-1 of every aggregate in one order and the other
    // 2r in the opposite order; through the broker door an early one is held and drains behind.
    let group = |sequence: i64, reversed: bool| {
        let mut ids: Vec<&str> = aggregates.to_vec();
        if reversed {
            ids.reverse();
        }
        ids.into_iter()
            .map(|aggregate| {
                let message = OrderedMessage {
                    message_id: format!("{aggregate}-{sequence}"),
                    aggregate_id: aggregate.to_owned(),
                    sequence,
                    payload: json!({}),
                };
                BatchDelivery::anonymous(message, Door::Broker)
            })
            .collect::<Vec<_>>()
    };
    let load = async {
        for round in 1..=ROUNDS {
            let (odd, even) = tokio::join!(
                first.deliver_batch(group(2 * round - 1, false)),
                second.deliver_batch(group(2 * round, true)),
            );
            for verdict in odd.unwrap().into_iter().chain(even.unwrap()) {
                assert!(
                    matches!(verdict, Ok(Outcome::Applied { .. } | Outcome::Held { .. })),
                    "{verdict:?}"
                );
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(120), load)
        .await
        .expect("the groups finished");
    assert_eq!(
        texts(
            &client,
            "SELECT aggregate_id || ':' || last_sequence FROM aggregate_state ORDER BY 1"
        )
        .await,
        aggregates
            .iter()
            .map(|aggregate| format!("{aggregate}:{}", 2 * ROUNDS))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        count(&client, "SELECT COUNT(*) FROM tally").await,
        4 * 2 * ROUNDS
    );
    assert_eq!(
        (first.stats().retries, second.stats().retries),
        (0, 0),
        "no deadlock to detect and retry: the locks are taken in one order"
    );
    first.close();
    second.close();
}

#[tokio::test]
async fn the_builder_opens_a_database_with_the_inbox_and_the_application_tables_and_runs_the_handler()
 {
    let cluster = Cluster::start();
    // Run at every open, so written to be run again.
    let tables = ORDER_TABLES.replace("CREATE TABLE ", "CREATE TABLE IF NOT EXISTS ");
    let open = || {
        OrderedInbox::postgres(cluster.url())
            .handler(Orders)
            .limits(Limits::default())
            .migrate(tables.clone())
            .open()
    };
    let inbox = open().await.unwrap();
    let applied = inbox.deliver(order("m-1", "a", 1, 4), Door::General).await;
    assert!(
        matches!(&applied, Ok(Outcome::Applied { detail, .. }) if detail["ordered"] == 4),
        "{applied:?}"
    );
    inbox.close();

    // Opened again: both migrations run again without harm, and the database remembers.
    let inbox = open().await.unwrap();
    let again = inbox.deliver(order("m-1", "a", 1, 4), Door::General).await;
    assert!(matches!(again, Ok(Outcome::Replay { .. })), "{again:?}");
    let client = inbox.target().connect().await.unwrap();
    assert_eq!(
        texts(&client, "SELECT message_id FROM orders").await,
        ["m-1"]
    );
    inbox.close();
}

#[tokio::test]
async fn the_builder_refuses_a_failing_application_migration_and_a_host_beyond_loopback() {
    let cluster = Cluster::start();
    let broken = OrderedInbox::postgres(cluster.url())
        .migrate("CREATE TABLE broken(")
        .open()
        .await;
    assert!(
        matches!(&broken, Err(PostgresError::Connect { reason, .. }) if reason.contains("application's tables")),
        "{:?}",
        broken.err()
    );
    let remote = OrderedInbox::postgres("postgres://inbox@db.example.com/inbox")
        .open()
        .await;
    assert!(remote.is_err(), "a host beyond loopback needs `remote`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_servers_accepting_one_dead_letter_at_once_apply_it_once_and_drain_behind_it() {
    let cluster = Cluster::start();
    let (client, first, second) = two_inboxes(&cluster, ORDER_TABLES, Arc::new(Orders)).await;
    client
        .batch_execute(
            "INSERT INTO operators VALUES ('alice', 'h', 't', NULL);
             INSERT INTO caps VALUES ('a', 5);",
        )
        .await
        .unwrap();
    first
        .deliver(order("m-1", "a", 1, 4), Door::General)
        .await
        .unwrap();
    let capped = first
        .deliver(order("m-2", "a", 2, 3), Door::General)
        .await
        .unwrap();
    assert!(matches!(&capped, Outcome::Quarantined { .. }), "{capped:?}");
    let held = first
        .deliver_as(order("m-3", "a", 3, 1), Door::Broker, None)
        .await
        .unwrap();
    assert!(matches!(held, Ok(Outcome::Held { .. })), "{held:?}");
    let accept = || ResolutionRequest {
        producer: None,
        dead_letter_id: "m-2".into(),
        operator: "alice".into(),
        action: Action::Accept,
        expected_last: 1,
        reason: "the cap was raised".into(),
    };
    let refused = first.resolve(accept(), Mode::Commit).await;
    assert!(
        matches!(&refused, Err(ResolutionError::ReplacementQuarantined(reason)) if reason.as_str() == "over the cap"),
        "{refused:?}"
    );
    assert_eq!(
        texts(
            &client,
            "SELECT status FROM deadletters WHERE message_id = 'm-2'"
        )
        .await,
        ["open"],
        "a refused accept writes nothing"
    );

    client.execute("DELETE FROM caps", &[]).await.unwrap();
    let (one, other) = tokio::join!(
        first.resolve(accept(), Mode::Commit),
        second.resolve(accept(), Mode::Commit)
    );
    let outcomes = [one.unwrap(), other.unwrap()];
    let new = outcomes
        .iter()
        .filter(|resolved| matches!(resolved, Resolved::New(_)))
        .count();
    let repeated = outcomes
        .iter()
        .filter(|resolved| matches!(resolved, Resolved::Repeated(_)))
        .count();
    assert_eq!((new, repeated), (1, 1), "{outcomes:?}");
    assert_eq!(
        texts(&client, "SELECT message_id FROM orders ORDER BY message_id").await,
        ["m-1", "m-2", "m-3"],
        "the accepted message and the held one behind it, each applied once"
    );
    assert_eq!(
        texts(
            &client,
            "SELECT message_id || '|' || sequence FROM ordered_inbox WHERE aggregate_id = 'a'
              ORDER BY sequence"
        )
        .await,
        ["m-1|1", "m-2|2", "m-3|3"]
    );
    assert_eq!(
        texts(
            &client,
            "SELECT action || '|' || operator || '|' || before_state || '|' || after_state
               FROM resolutions"
        )
        .await,
        [r#"accept|alice|{"ordered":4}|{"ordered":7}"#]
    );
    first.close();
    second.close();
}

#[tokio::test]
async fn compaction_keeps_each_aggregates_newest_events_and_its_audit_events_on_postgres() {
    let cluster = Cluster::start();
    let (client, inbox, _) = two_inboxes(&cluster, ORDER_TABLES, Arc::new(Orders)).await;
    // Five aggregates, each applied once, then ten stale observations: timeline rows of their
    // own. The fifth's oldest events include an audit event, which compaction keeps.
    let audit = "INSERT INTO aggregate_timeline(aggregate_id, observation_no, kind, at)
                 VALUES ('e', -1, 'gap skipped', '2026-01-01T00:00:00.000Z')";
    for aggregate in ["a", "b", "c", "d", "e"] {
        let first = format!("{aggregate}-1");
        inbox
            .deliver(order(&first, aggregate, 1, 1), Door::General)
            .await
            .unwrap();
        if aggregate == "e" {
            client.execute(audit, &[]).await.unwrap();
        }
        for n in 0..10 {
            let stale = format!("{aggregate}-stale-{n}");
            inbox
                .deliver(order(&stale, aggregate, 1, 1), Door::General)
                .await
                .unwrap();
        }
    }
    let retention = ordered_inbox::retention::Retention {
        identities: None,
        timeline: Some(3),
        dead_letters: None,
    };
    // Sixteen rows a batch list two aggregates per compaction: the cursor walks them.
    let now = ordered_inbox::clock::now();
    let mut cursor = None;
    loop {
        let plan = ordered_inbox::retention::plan_batch(&retention, &now, cursor, 16);
        let pruned = inbox.prune(plan).await.unwrap();
        cursor = pruned.timeline_cursor;
        if !pruned.more {
            break;
        }
    }
    for aggregate in ["a", "b", "c", "d"] {
        let all =
            format!("SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = '{aggregate}'");
        let newest_three = format!(
            "SELECT COUNT(*) FROM aggregate_timeline
              WHERE aggregate_id = '{aggregate}'
                AND id >= (SELECT MAX(id) FROM aggregate_timeline
                            WHERE aggregate_id = '{aggregate}') - 2"
        );
        assert_eq!(count(&client, &all).await, 3, "{aggregate}");
        assert_eq!(count(&client, &newest_three).await, 3, "{aggregate}");
    }
    let kept = "SELECT kind FROM aggregate_timeline WHERE aggregate_id = 'e' ORDER BY id";
    let kinds = texts(&client, kept).await;
    assert_eq!(kinds.len(), 4, "{kinds:?}");
    assert_eq!(kinds[0], "gap skipped", "{kinds:?}");
}
