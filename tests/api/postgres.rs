//! The ordered inbox in PostgreSQL: the test run's private cluster, and the multi-server faults
//! over real processes and HTTP.
//!
//! One private PostgreSQL serves the whole test binary run: started lazily by the first test that
//! needs it ([`lab_testkit::pg`]: `initdb` into a temp dir, `pg_ctl start` on a free
//! loopback port, as the `postgres` user when the tests run as root), one fresh database per
//! test, and stopped by its watchdog when the test process exits. A test that stops PostgreSQL
//! on purpose starts a cluster of its own. A machine without the server binaries fails these
//! tests with a message naming the Debian package `postgresql`; they are never skipped.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use lab_testkit::pg::{ClusterOptions, PrivateCluster};
use tokio_postgres::{NoTls, SimpleQueryMessage};

static CLUSTER: OnceLock<Result<PrivateCluster, String>> = OnceLock::new();
static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// The test run's shared cluster, started on first use.
pub fn shared_cluster() -> &'static PrivateCluster {
    let cluster = CLUSTER.get_or_init(|| {
        PrivateCluster::start(ClusterOptions::for_tests()).map_err(|error| error.to_string())
    });
    match cluster {
        Ok(cluster) => cluster,
        Err(error) => panic!("cannot start the private PostgreSQL for these tests: {error}"),
    }
}

/// A new, empty database on the shared cluster; returns its URL.
pub fn fresh_database() -> String {
    create_database(shared_cluster())
}

/// A new, empty database on `cluster`; returns its URL.
pub fn create_database(cluster: &PrivateCluster) -> String {
    create_named_database(cluster).1
}

/// A new, empty database on `cluster`; returns its name and loopback URL.
fn create_named_database(cluster: &PrivateCluster) -> (String, String) {
    let number = DATABASES.fetch_add(1, Ordering::Relaxed);
    let name = format!("inbox_{}_{number}", std::process::id());
    let url = cluster
        .create_database(&name)
        .unwrap_or_else(|error| panic!("create database {name}: {error}"));
    (name, url)
}

/// Runs SQL text (one or more statements, no parameters) and returns every row's values as text,
/// as PostgreSQL's simple query protocol gives them. Blocking: it runs on a thread of its own,
/// so it may be called from a test's async body.
pub fn query_text(url: &str, sql: &str) -> Vec<Vec<Option<String>>> {
    let (url, sql) = (url.to_owned(), sql.to_owned());
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the query");
        runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(&url, NoTls)
                .await
                .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
            tokio::spawn(connection);
            let messages = client
                .simple_query(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
            messages
                .into_iter()
                .filter_map(|message| match message {
                    SimpleQueryMessage::Row(row) => Some(
                        (0..row.len())
                            .map(|i| row.get(i).map(str::to_owned))
                            .collect(),
                    ),
                    _ => None,
                })
                .collect()
        })
    })
    .join()
    .expect("the query thread")
}

#[tokio::test]
async fn the_private_cluster_serves_a_database_per_test() {
    let first = fresh_database();
    let second = fresh_database();
    assert_ne!(first, second);
    assert_eq!(query_text(&first, "SELECT 1 + 1"), [[Some("2".to_owned())]]);
}

// ---------------------------------------------------------------------------------------------
// Several servers on one database, over real processes and HTTP.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use lab_testkit::bench::{AggregateStream, amount, workload};
use serde_json::{Value, json};

use crate::aggregates::add_operator_on;
use crate::helpers::{ServerProcess, client, poll_until, settings_dir, status_and_json};

/// `serve --inbox URL` as a process, with its own SQLite file for the other labs.
fn start_server(dir: &Path, name: &str, settings: &Path, url: &str) -> ServerProcess {
    ServerProcess::start(&dir.join(format!("{name}.db")), settings, &["--inbox", url])
}

/// A server the load may send to; `down` once the test killed it.
struct Target {
    address: String,
    down: AtomicBool,
}

/// What the load saw, shared by its clients.
#[derive(Default)]
struct Tally {
    acknowledged: AtomicUsize,
    unavailable: AtomicUsize,
    /// Any 5xx other than 503: must stay zero.
    failed: AtomicUsize,
    transport_errors: AtomicUsize,
    /// 503 answers without a `Retry-After` header: must stay zero.
    without_retry_after: AtomicUsize,
}

/// Sends each stream's messages in order, request `i` of a client through server
/// `(client + i) % servers` (skipping a server that is down). A message counts as acknowledged
/// on `200 applied` or `200 replay`; a 503 is retried after a short pause, a transport error is
/// retried through the next server. Returns the acknowledged (message id, aggregate, amount).
async fn drive(
    index: usize,
    http: reqwest::Client,
    targets: Arc<Vec<Target>>,
    streams: Vec<AggregateStream>,
    tally: Arc<Tally>,
) -> Vec<String> {
    let longest = streams.iter().map(|s| s.messages.len()).max().unwrap_or(0);
    let mut acknowledged = Vec::new();
    let mut request = index;
    for position in 0..longest {
        for stream in &streams {
            let Some(message) = stream.messages.get(position) else {
                continue;
            };
            let body = json!({
                "messageId": message.message_id,
                "sequence": message.sequence,
                "amount": amount(message),
            });
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                assert!(
                    Instant::now() < deadline,
                    "{} was never acknowledged",
                    message.message_id
                );
                request += 1;
                let target = &targets[request % targets.len()];
                if target.down.load(Ordering::SeqCst) {
                    continue;
                }
                let url = format!(
                    "{}/aggregates/{}/messages",
                    target.address, message.aggregate_id
                );
                let response = match http.post(&url).json(&body).send().await {
                    Ok(response) => response,
                    Err(_) => {
                        tally.transport_errors.fetch_add(1, Ordering::SeqCst);
                        continue;
                    }
                };
                let status = response.status().as_u16();
                let retry_after = response.headers().contains_key("retry-after");
                let answer: Value = response.json().await.unwrap_or(Value::Null);
                match status {
                    200 if answer["outcome"] == "applied" || answer["outcome"] == "replay" => {
                        tally.acknowledged.fetch_add(1, Ordering::SeqCst);
                        acknowledged.push(message.message_id.clone());
                        break;
                    }
                    503 => {
                        tally.unavailable.fetch_add(1, Ordering::SeqCst);
                        if !retry_after {
                            tally.without_retry_after.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    500..=599 => {
                        tally.failed.fetch_add(1, Ordering::SeqCst);
                        panic!("{status} for {}: {answer}", message.message_id);
                    }
                    _ => panic!(
                        "unexpected {status} for {} sequence {}: {answer}",
                        message.message_id, message.sequence
                    ),
                }
            }
        }
    }
    acknowledged
}

/// Starts `clients` clients over `streams` (client `i` owns streams `i`, `i + clients`, …).
fn start_load(
    clients: usize,
    targets: &Arc<Vec<Target>>,
    streams: &[AggregateStream],
    tally: &Arc<Tally>,
) -> tokio::task::JoinSet<Vec<String>> {
    let mut owned: Vec<Vec<AggregateStream>> = vec![Vec::new(); clients];
    for (index, stream) in streams.iter().enumerate() {
        owned[index % clients].push(stream.clone());
    }
    let http = client();
    let mut load = tokio::task::JoinSet::new();
    for (index, streams) in owned.into_iter().enumerate() {
        load.spawn(drive(
            index,
            http.clone(),
            targets.clone(),
            streams,
            tally.clone(),
        ));
    }
    load
}

async fn finish_load(mut load: tokio::task::JoinSet<Vec<String>>) -> Vec<String> {
    let mut acknowledged = Vec::new();
    while let Some(done) = load.join_next().await {
        acknowledged.extend(done.expect("a load client"));
    }
    acknowledged
}

fn targets(servers: &[&ServerProcess]) -> Arc<Vec<Target>> {
    Arc::new(
        servers
            .iter()
            .map(|server| Target {
                address: server.address.clone(),
                down: AtomicBool::new(false),
            })
            .collect(),
    )
}

/// The invariants after a load: every acknowledged message is in the inbox exactly once (the
/// primary key makes "once" structural; presence is checked), and every aggregate's `last` is its
/// number of applied rows and `total` their sum, which are what was sent.
fn assert_invariants(url: &str, streams: &[AggregateStream], acknowledged: &[String]) {
    let applied: Vec<String> = query_text(url, "SELECT message_id FROM ordered_inbox")
        .into_iter()
        .filter_map(|row| row.into_iter().next().flatten())
        .collect();
    let mut unique = applied.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), applied.len(), "a message id applied twice");
    for id in acknowledged {
        assert!(
            unique.binary_search(id).is_ok(),
            "acknowledged {id} is missing"
        );
    }
    let rows = query_text(
        url,
        "SELECT a.aggregate_id, a.last_sequence, a.total, COUNT(o.message_id),
                COALESCE(SUM(o.amount), 0), COALESCE(MAX(o.sequence), 0)
           FROM aggregate_state a LEFT JOIN ordered_inbox o USING (aggregate_id)
          GROUP BY a.aggregate_id, a.last_sequence, a.total",
    );
    let by_aggregate: BTreeMap<String, Vec<i64>> = rows
        .into_iter()
        .map(|row| {
            let mut values = row.into_iter().map(Option::unwrap_or_default);
            let id = values.next().unwrap_or_default();
            (id, values.map(|v| v.parse().unwrap()).collect())
        })
        .collect();
    for stream in streams {
        let sent = stream.messages.len() as i64;
        let sum: i64 = stream.messages.iter().map(amount).sum();
        let figures = by_aggregate
            .get(&stream.aggregate_id)
            .unwrap_or_else(|| panic!("{} has no state row", stream.aggregate_id));
        // last, total, applied rows, their sum, their highest sequence
        assert_eq!(
            figures,
            &vec![sent, sum, sent, sum, sent],
            "{}: last, total, rows, sum, max sequence",
            stream.aggregate_id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_with_thirty_two_clients_keep_every_acknowledged_message_exactly_once() {
    let url = fresh_database();
    let (dir, settings) = settings_dir();
    let a = start_server(dir.path(), "a", &settings, &url);
    let b = start_server(dir.path(), "b", &settings, &url);
    let streams = workload(64, 64 * 12);
    let tally = Arc::new(Tally::default());
    let load = start_load(32, &targets(&[&a, &b]), &streams, &tally);
    let acknowledged = finish_load(load).await;
    assert_eq!(acknowledged.len(), 64 * 12);
    assert_eq!(tally.failed.load(Ordering::SeqCst), 0);
    assert_invariants(&url, &streams, &acknowledged);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_deliveries_of_one_sequence_through_two_servers_apply_once() {
    let url = fresh_database();
    let (dir, settings) = settings_dir();
    let a = start_server(dir.path(), "a", &settings, &url);
    let b = start_server(dir.path(), "b", &settings, &url);
    let http = client();
    let post = |server: &ServerProcess, aggregate: &str, id: &str| {
        let request = http
            .post(server.url(&format!("/aggregates/{aggregate}/messages")))
            .json(&json!({"messageId": id, "sequence": 1, "amount": 3}));
        async move { status_and_json(request.send().await.expect("POST")).await }
    };
    for round in 0..4 {
        // Sixteen ids for one sequence: one applies, the others are stale.
        let aggregate = format!("race-{round}");
        let racers = futures_util::future::join_all((0..16).map(|i| {
            let server = if i % 2 == 0 { &a } else { &b };
            post(server, &aggregate, &format!("{aggregate}-racer-{i}"))
        }))
        .await;
        let applied = racers.iter().filter(|(status, _)| *status == 200).count();
        assert_eq!(applied, 1, "{racers:?}");
        assert!(
            racers
                .iter()
                .all(|(status, body)| *status == 200 || body["outcome"] == "stale"),
            "{racers:?}"
        );
        // One id sixteen times: one applies, the others replay.
        let aggregate = format!("same-{round}");
        let same = futures_util::future::join_all((0..16).map(|i| {
            let server = if i % 2 == 0 { &a } else { &b };
            post(server, &aggregate, &format!("{aggregate}-only"))
        }))
        .await;
        let outcomes: Vec<&Value> = same.iter().map(|(_, body)| &body["outcome"]).collect();
        assert!(same.iter().all(|(status, _)| *status == 200), "{same:?}");
        assert_eq!(outcomes.iter().filter(|o| **o == "applied").count(), 1);
        assert_eq!(outcomes.iter().filter(|o| **o == "replay").count(), 15);
        // The same id to two aggregates at once: one meaning only.
        let id = format!("shared-{round}");
        let (first, second) = tokio::join!(
            post(&a, &format!("left-{round}"), &id),
            post(&b, &format!("right-{round}"), &id)
        );
        let mut statuses = [first.0, second.0];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 409], "{first:?} {second:?}");
    }
    let applied = query_text(&url, "SELECT COUNT(*) FROM ordered_inbox");
    assert_eq!(applied, [[Some("12".to_owned())]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_operators_resolving_one_dead_letter_through_two_servers_exactly_one_wins() {
    let url = fresh_database();
    let (dir, settings) = settings_dir();
    let a = start_server(dir.path(), "a", &settings, &url);
    let b = start_server(dir.path(), "b", &settings, &url);
    let token = |name: &str| add_operator_on(&["--inbox".into(), url.as_str().into()], name);
    let (alice, bob) = (token("alice"), token("bob"));
    let http = client();
    for round in 0..4 {
        let aggregate = format!("acct-{round}");
        let poison = format!("poison-{round}");
        for (server, id, sequence, amount) in [(&a, "m-1", 1, 5), (&b, poison.as_str(), 2, -1)] {
            let response = http
                .post(server.url(&format!("/aggregates/{aggregate}/messages")))
                .json(&json!({"messageId": format!("{aggregate}-{id}"), "sequence": sequence, "amount": amount}))
                .send()
                .await
                .unwrap();
            assert!(response.status() == 200 || response.status() == 422);
        }
        let dead_letter = format!("{aggregate}-{poison}");
        let resolve = |server: &ServerProcess, token: &str, body: Value| {
            let request = http
                .post(server.url(&format!("/deadletters/{dead_letter}/resolution")))
                .bearer_auth(token)
                .json(&body);
            async move { status_and_json(request.send().await.expect("POST")).await }
        };
        let (first, second) = tokio::join!(
            resolve(
                &a,
                &alice,
                json!({"action": "replace", "expectedLast": 1, "reason": "confirmed",
                       "replacement": {"messageId": format!("{aggregate}-fix"), "amount": 2}})
            ),
            resolve(
                &b,
                &bob,
                json!({"action": "skip", "expectedLast": 1, "reason": "duplicate"})
            ),
        );
        let mut statuses = [first.0, second.0];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 409], "{first:?} {second:?}");
        let (winner, loser) = if first.0 == 200 {
            (first, second)
        } else {
            (second, first)
        };
        assert_eq!(loser.1["current"]["aggregate"]["last"], 2, "{}", loser.1);
        assert_eq!(
            loser.1["current"]["deadLetter"]["resolution"]["operator"],
            winner.1["operator"]
        );
    }
    assert_eq!(
        query_text(
            &url,
            "SELECT COUNT(*), COUNT(DISTINCT message_id) FROM resolutions"
        ),
        [[Some("4".to_owned()), Some("4".to_owned())]]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_killed_mid_load_the_other_serves_on_and_nothing_acknowledged_is_lost() {
    let url = fresh_database();
    let (dir, settings) = settings_dir();
    let mut a = start_server(dir.path(), "a", &settings, &url);
    let b = start_server(dir.path(), "b", &settings, &url);
    let streams = workload(64, 64 * 12);
    let tally = Arc::new(Tally::default());
    let targets = targets(&[&a, &b]);
    let load = start_load(32, &targets, &streams, &tally);
    poll_until(
        "a quarter of the load acknowledged",
        || async { tally.acknowledged.load(Ordering::SeqCst) },
        |done| *done >= streams.len() * 3,
    )
    .await;
    a.signal("KILL");
    targets[0].down.store(true, Ordering::SeqCst);
    a.exit_status().await;
    let acknowledged = finish_load(load).await;
    assert_eq!(acknowledged.len(), 64 * 12);
    assert_eq!(tally.failed.load(Ordering::SeqCst), 0);
    assert_invariants(&url, &streams, &acknowledged);

    // Everything again through the survivor: every message is a replay.
    let http = client();
    for stream in &streams {
        for message in &stream.messages {
            let (status, body) = status_and_json(
                http.post(b.url(&format!("/aggregates/{}/messages", message.aggregate_id)))
                    .json(&json!({"messageId": message.message_id, "sequence": message.sequence, "amount": amount(message)}))
                    .send()
                    .await
                    .unwrap(),
            )
            .await;
            assert_eq!(
                (status, &body["outcome"]),
                (200, &json!("replay")),
                "{body}"
            );
        }
    }
    assert_invariants(&url, &streams, &acknowledged);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_mid_load_answers_503_never_500_and_nothing_acknowledged_is_lost() {
    // A cluster of its own: stopping the shared one would fail every other test running now.
    let cluster = Arc::new(
        PrivateCluster::start(ClusterOptions::for_tests())
            .unwrap_or_else(|error| panic!("cannot start a private PostgreSQL: {error}")),
    );
    let url = create_database(&cluster);
    let (dir, settings) = settings_dir();
    let a = start_server(dir.path(), "a", &settings, &url);
    let b = start_server(dir.path(), "b", &settings, &url);
    let streams = workload(32, 32 * 12);
    let tally = Arc::new(Tally::default());
    let load = start_load(16, &targets(&[&a, &b]), &streams, &tally);
    poll_until(
        "a quarter of the load acknowledged",
        || async { tally.acknowledged.load(Ordering::SeqCst) },
        |done| *done >= streams.len() * 3,
    )
    .await;
    let stopping = cluster.clone();
    tokio::task::spawn_blocking(move || stopping.stop())
        .await
        .unwrap()
        .expect("pg_ctl stop");
    poll_until(
        "clients answered 503 while PostgreSQL is down",
        || async { tally.unavailable.load(Ordering::SeqCst) },
        |seen| *seen >= 10,
    )
    .await;
    let acknowledged_while_down = tally.acknowledged.load(Ordering::SeqCst);
    let starting = cluster.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .unwrap()
        .expect("pg_ctl start");
    let acknowledged = finish_load(load).await;
    assert_eq!(acknowledged.len(), 32 * 12);
    assert!(tally.acknowledged.load(Ordering::SeqCst) > acknowledged_while_down);
    assert_eq!(
        tally.failed.load(Ordering::SeqCst),
        0,
        "a 5xx other than 503"
    );
    assert_eq!(tally.without_retry_after.load(Ordering::SeqCst), 0);
    assert_invariants(&url, &streams, &acknowledged);
}

#[test]
fn two_servers_starting_together_on_a_fresh_database_migrate_once() {
    let url = fresh_database();
    let (dir, settings) = settings_dir();
    let servers: Vec<ServerProcess> = std::thread::scope(|scope| {
        let starts: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|name| scope.spawn(|| start_server(dir.path(), name, &settings, &url)))
            .collect();
        starts
            .into_iter()
            .map(|start| start.join().expect("a server starts"))
            .collect()
    });
    assert_eq!(servers.len(), 3);
    // One row per migration, each applied exactly once.
    let applied: Vec<Vec<Option<String>>> =
        (1..=ordered_inbox::postgres::schema::current_version())
            .map(|version| vec![Some(version.to_string())])
            .collect();
    assert_eq!(
        query_text(
            &url,
            "SELECT version FROM ordered_inbox_schema ORDER BY version"
        ),
        applied
    );
}

#[tokio::test]
async fn a_server_reaches_postgresql_through_a_unix_socket_directory() {
    let cluster = shared_cluster();
    let (name, tcp_url) = create_named_database(cluster);
    let socket_url = cluster.socket_url(&name);
    let app = crate::helpers::spawn_app_on_with(crate::helpers::Backend::Postgres, |config| {
        config.inbox = Some(socket_url)
    })
    .await;
    let (status, body) = status_and_json(
        app.post_json(
            "/aggregates/sock/messages",
            &json!({"messageId": "s-1", "sequence": 1, "amount": 4}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, &body["outcome"]),
        (200, &json!("applied")),
        "{body}"
    );
    // The same database, seen over TCP.
    assert_eq!(
        query_text(
            &tcp_url,
            "SELECT total FROM aggregate_state WHERE aggregate_id = 'sock'"
        ),
        [[Some("4".to_owned())]]
    );
}

/// The broker door's held successors through the PostgreSQL backend: the same library
/// decisions, written and read back in PostgreSQL (the broker tests run on SQLite).
#[tokio::test]
async fn held_successors_are_held_drained_and_resolved_through_postgresql() {
    use ordered_inbox::postgres::{PostgresInbox, Target};
    use ordered_inbox::resolution::{Action, Mode, ResolutionRequest};
    use ordered_inbox::{BatchDelivery, Door, Inbox, Limits};
    use production_lab::inbox::ledger::views::AggregateView;
    use production_lab::inbox::ledger::{self, Ledger};

    let url = fresh_database();
    let inbox = PostgresInbox::open_with_handler(
        Target::parse(&url).unwrap(),
        Limits::default(),
        std::sync::Arc::new(Ledger),
    )
    .await
    .unwrap();
    let message =
        |id: &str, sequence, amount| ledger::message(id.into(), "held".into(), sequence, amount);
    let ahead = inbox
        .deliver_batch(vec![
            BatchDelivery::anonymous(message("m-3", 3, 3), Door::Broker),
            BatchDelivery::anonymous(message("m-2", 2, -2), Door::Broker),
            BatchDelivery::anonymous(message("m-4", 4, 4), Door::Broker),
        ])
        .await
        .unwrap();
    assert!(
        ahead
            .iter()
            .all(|outcome| matches!(outcome, Ok(ordered_inbox::Outcome::Held { .. }))),
        "{ahead:?}"
    );
    let view = inbox
        .reads()
        .aggregate("held".into())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((view.held_sequences, view.held_count), (vec![2, 3, 4], 3));

    // Sequence 1 applies and drains 2, which is poison: it is quarantined and stops the drain.
    inbox
        .deliver(message("m-1", 1, 1), Door::Broker)
        .await
        .unwrap();
    let view = inbox
        .reads()
        .aggregate("held".into())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(view.summary.last, 1);
    assert_eq!(view.held_sequences, vec![3, 4]);
    assert_eq!(view.open_dead_letters[0].message_id, "m-2");

    // An operator's skip of the poison drains the rest in order.
    ordered_inbox::postgres::operators::add(&url, "alice")
        .await
        .unwrap();
    let skip = ResolutionRequest {
        producer: None,
        dead_letter_id: "m-2".into(),
        operator: "alice".into(),
        action: Action::Skip,
        expected_last: 1,
        reason: "cancelled upstream".into(),
    };
    inbox.resolve(skip, Mode::Commit).await.unwrap();
    let view = AggregateView::from(
        inbox
            .reads()
            .aggregate("held".into())
            .await
            .unwrap()
            .unwrap(),
    );
    assert_eq!((view.summary.last, view.summary.total), (4, 8));
    assert_eq!(view.held_count, 0);
    inbox.close();
}

/// `deliver_batch` with producer claims through the PostgreSQL backend (one transaction per
/// message): each claim is checked on facts read under that message's locks, a claim earlier in
/// the batch binds the rest, a refusal writes nothing and the next message goes on.
#[tokio::test]
async fn a_batch_with_producer_claims_is_checked_message_by_message_in_postgresql() {
    use ordered_inbox::operators::Registry;
    use ordered_inbox::postgres::{PostgresInbox, Target};
    use ordered_inbox::records::{ProducerClaim, ProducerRefusal};
    use ordered_inbox::{BatchDelivery, Door, Inbox, Limits, Outcome, Undelivered};
    use production_lab::inbox::ledger;

    let url = fresh_database();
    let inbox = PostgresInbox::open(Target::parse(&url).unwrap(), Limits::default())
        .await
        .unwrap();
    for name in ["billing", "shipping"] {
        ordered_inbox::postgres::operators::add_to(Registry::Producers, &url, name)
            .await
            .unwrap();
        assert_eq!(inbox.start_session(name.into()).await.unwrap(), Ok(1));
    }
    let by = |id: &str, aggregate: &str, sequence, who: Option<(&str, i64)>| BatchDelivery {
        message: ledger::message(id.into(), aggregate.into(), sequence, 1),
        door: Door::Broker,
        claim: who.map(|(producer, epoch)| ProducerClaim {
            producer: producer.into(),
            epoch,
        }),
    };
    let verdicts = inbox
        .deliver_batch(vec![
            by("m-1", "acct", 1, Some(("billing", 1))),
            by("s-2", "acct", 2, Some(("shipping", 1))),
            by("x-2", "acct", 2, None),
            by("m-2", "acct", 2, Some(("billing", 1))),
            by("m-1", "ship", 1, Some(("shipping", 1))),
            by("m-4", "acct", 4, Some(("billing", 1))),
        ])
        .await
        .unwrap();
    assert!(matches!(
        verdicts[0],
        Ok(Outcome::Applied { sequence: 1, .. })
    ));
    assert_eq!(
        verdicts[1],
        Err(Undelivered::Refused(ProducerRefusal::NotOwner {
            owner: "billing".into()
        }))
    );
    assert_eq!(
        verdicts[2],
        Err(Undelivered::Refused(ProducerRefusal::OwnerRequired))
    );
    assert!(matches!(
        verdicts[3],
        Ok(Outcome::Applied { sequence: 2, .. })
    ));
    assert!(matches!(
        verdicts[4],
        Ok(Outcome::Applied { sequence: 1, .. })
    ));
    // billing's early 4 is held in billing's namespace, under the epoch it was sent under.
    assert_eq!(
        verdicts[5],
        Ok(Outcome::Held {
            expected: 3,
            held: 1,
            repeated: false
        })
    );
    assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(2));
    let fenced = inbox
        .deliver_batch(vec![by("m-3", "acct", 3, Some(("billing", 1)))])
        .await
        .unwrap();
    assert_eq!(
        fenced[0],
        Err(Undelivered::Refused(ProducerRefusal::Fenced {
            offered: 1,
            current_epoch: 2
        }))
    );
    assert_eq!(
        query_text(
            &url,
            "SELECT string_agg(producer || ':' || message_id, ',' ORDER BY aggregate_id, sequence) FROM ordered_inbox"
        ),
        [[Some("billing:m-1,billing:m-2,shipping:m-1".to_owned())]]
    );
    assert_eq!(
        query_text(
            &url,
            "SELECT string_agg(producer || ':' || message_id || ':' || epoch, ',') FROM held_messages"
        ),
        [[Some("billing:m-4:1".to_owned())]]
    );
}

/// The ledger's `ordered_inbox.amount` as an earlier build kept it: a plain column that a
/// `BEFORE INSERT` trigger filled.
const TRIGGER_FILLED_AMOUNT: &str = r#"
ALTER TABLE ordered_inbox DROP COLUMN amount;
ALTER TABLE ordered_inbox ADD COLUMN amount bigint;
UPDATE ordered_inbox SET amount = (payload::jsonb ->> 'Amount')::bigint;
CREATE FUNCTION ledger_amount() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.amount IS NULL AND (NEW.payload::jsonb ->> 'Amount') ~ '^-?[0-9]{1,18}$' THEN
        NEW.amount := (NEW.payload::jsonb ->> 'Amount')::bigint;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER ledger_amount BEFORE INSERT ON ordered_inbox
    FOR EACH ROW EXECUTE FUNCTION ledger_amount();
"#;

async fn deliver_to_acct(
    app: &crate::helpers::TestApp,
    id: &str,
    sequence: i64,
    amount: i64,
) -> u16 {
    let body = json!({"messageId": id, "sequence": sequence, "amount": amount});
    status_and_json(app.post_json("/aggregates/acct/messages", &body).await)
        .await
        .0
}

#[tokio::test]
async fn a_database_whose_amounts_a_trigger_filled_keeps_them_in_a_generated_column() {
    use crate::helpers::{Backend, spawn_app_on};
    let app = spawn_app_on(Backend::Postgres).await;
    assert_eq!(deliver_to_acct(&app, "m-1", 1, 7).await, 200);
    assert_eq!(deliver_to_acct(&app, "m-2", 2, 5).await, 200);
    let url = app.inbox_url.clone().expect("a PostgreSQL inbox");
    let (dir, config) = app.stop().await;
    query_text(&url, TRIGGER_FILLED_AMOUNT);

    let app = crate::helpers::start(dir, config).await;
    assert_eq!(deliver_to_acct(&app, "m-3", 3, 11).await, 200);
    let amounts = query_text(
        &url,
        "SELECT message_id || '=' || amount FROM ordered_inbox ORDER BY sequence",
    );
    assert_eq!(
        amounts,
        [["m-1=7"], ["m-2=5"], ["m-3=11"]].map(|[row]| vec![Some(row.to_owned())])
    );
    let shape = query_text(
        &url,
        "SELECT (SELECT attgenerated FROM pg_attribute
                  WHERE attrelid = 'ordered_inbox'::regclass AND attname = 'amount')
             || (SELECT COUNT(*) FROM pg_trigger WHERE tgname = 'ledger_amount')",
    );
    assert_eq!(shape, [vec![Some("s0".to_owned())]]);
    app.stop().await;
}
