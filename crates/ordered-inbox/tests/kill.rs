//! Crash tests of a handler's own table: the `orders_sqlite` (and `orders_postgres`) example
//! serves as a child process under concurrent load (two clients per order racing the same
//! events, several orders, every unanswered request delivered again), is SIGKILLed once a count
//! of answers is reached, and restarted on the same database while the load goes on. At the
//! crash and at the end, the inbox's rows and the handler's `orders` rows must agree: every
//! acknowledged event has both, no event has one without the other, none is doubled, and each
//! order's sequence has no gap.
//!
//! The examples' binaries are the ones `cargo test` built next to this test's binary
//! (`target/debug/examples/`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

const ORDERS: usize = 6;
const LINES: i64 = 40;
const CLIENTS_PER_ORDER: usize = 2;
/// Answers (over all clients) after which the server is killed: about a third of the load.
const KILL_AT: usize = ORDERS * LINES as usize * CLIENTS_PER_ORDER / 3;
/// Bounds every wait of the test: a start, the load before the kill, the load after it.
const PATIENCE: Duration = Duration::from_secs(120);

/// An order and a sequence: one event of the load.
type Event = (String, i64);

/// One example served as a child process.
struct Served {
    child: Child,
    base: String,
    /// Kept open: the child's later writes to its standard output must not fail.
    _stdout: Lines<BufReader<ChildStdout>>,
}

impl Served {
    /// Starts `example` with `args` on a free loopback port, once it says it is listening.
    async fn start(example: &str, args: &[String]) -> Served {
        let mut child = Command::new(example_binary(example))
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {example}: {error}"));
        let stdout = child.stdout.take().expect("a piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(PATIENCE, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("{example} printed no listening line in time"))
            .unwrap_or_else(|error| panic!("{example}'s stdout: {error}"))
            .unwrap_or_else(|| panic!("{example} exited before it listened"));
        let base = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("{example} printed '{first}', not its listening line"))
            .to_owned();
        Served {
            child,
            base,
            _stdout: lines,
        }
    }

    /// SIGKILL, and waits for the process to be gone.
    async fn kill(mut self) {
        self.child.start_kill().expect("SIGKILL the example");
        self.child
            .wait()
            .await
            .expect("wait for the killed example");
    }
}

/// The example's binary as `cargo test` built it: `target/debug/examples/NAME-HASH` (the newest,
/// and no older than the example's source).
fn example_binary(name: &str) -> PathBuf {
    let test_binary = std::env::current_exe().expect("this test's binary");
    let examples = test_binary
        .parent()
        .and_then(Path::parent)
        .expect("target/debug/deps/")
        .join("examples");
    let built = |entry: &std::fs::DirEntry| {
        let file = entry.file_name().to_string_lossy().into_owned();
        let is_binary = file == name
            || file
                .strip_prefix(&format!("{name}-"))
                .is_some_and(|hash| hash.chars().all(|c| c.is_ascii_hexdigit()));
        let modified = entry.metadata().and_then(|meta| meta.modified()).ok()?;
        is_binary.then_some((modified, entry.path()))
    };
    let newest = std::fs::read_dir(&examples)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|entry| built(&entry))
        .max();
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("examples/{name}.rs"));
    let written = std::fs::metadata(&source)
        .and_then(|meta| meta.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    match newest {
        Some((modified, path)) if modified >= written => path,
        _ => panic!(
            "no build of the example {name} newer than its source in {}: run `cargo test -p ordered-inbox` (it builds the examples), not this test alone",
            examples.display()
        ),
    }
}

/// The load: its clients' shared view of where the server is, and what was acknowledged.
struct Load {
    http: reqwest::Client,
    /// The base URL of the server that runs now; a new value once it was restarted.
    server: watch::Sender<String>,
    acknowledged: Mutex<BTreeSet<Event>>,
    answers: AtomicUsize,
    /// Requests that got no answer (sent again until one came).
    unanswered: AtomicUsize,
    kill_now: Notify,
}

impl Load {
    fn new(base: String) -> Arc<Load> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("an HTTP client");
        Arc::new(Load {
            http,
            server: watch::Sender::new(base),
            acknowledged: Mutex::new(BTreeSet::new()),
            answers: AtomicUsize::new(0),
            unanswered: AtomicUsize::new(0),
            kill_now: Notify::new(),
        })
    }

    fn acknowledged(&self) -> BTreeSet<Event> {
        self.acknowledged.lock().expect("acknowledged").clone()
    }

    /// Each client delivers its order's events in sequence order, the next once the last one
    /// is acknowledged.
    fn spawn_clients(self: &Arc<Load>) -> JoinSet<Result<(), String>> {
        let mut clients = JoinSet::new();
        for order in 0..ORDERS {
            for _ in 0..CLIENTS_PER_ORDER {
                let load = self.clone();
                clients.spawn(async move {
                    for sequence in 1..=LINES {
                        load.deliver(&format!("order-{order}"), sequence).await?;
                    }
                    Ok(())
                });
            }
        }
        clients
    }

    /// Delivers one event until it is acknowledged: an unanswered request waits for the next
    /// server and goes again.
    async fn deliver(&self, order: &str, sequence: i64) -> Result<(), String> {
        let body = json!({
            "messageId": format!("{order}-{sequence}"),
            "sequence": sequence,
            "payload": { "sku": "tea", "quantity": 1 },
        });
        for _ in 0..50 {
            let base = self.server.borrow().clone();
            let url = format!("{base}/orders/{order}/events");
            let answer = match self.http.post(&url).json(&body).send().await {
                Ok(response) => (response.status().as_u16(), response.json::<Value>().await),
                Err(_) => {
                    self.unanswered.fetch_add(1, Ordering::Relaxed);
                    self.next_server(&base).await?;
                    continue;
                }
            };
            match answer {
                (200, Ok(verdict)) if ["applied", "replay"].contains(&outcome(&verdict)) => {
                    self.acknowledge(order, sequence);
                    return Ok(());
                }
                // The store asks for a retry: nothing was recorded.
                (503, _) => continue,
                (status, verdict) => {
                    return Err(format!("{order} #{sequence}: {status} {verdict:?}"));
                }
            }
        }
        Err(format!(
            "{order} #{sequence}: no acknowledgement in 50 attempts"
        ))
    }

    fn acknowledge(&self, order: &str, sequence: i64) {
        let mut acknowledged = self.acknowledged.lock().expect("acknowledged");
        acknowledged.insert((order.to_owned(), sequence));
        drop(acknowledged);
        if self.answers.fetch_add(1, Ordering::Relaxed) + 1 == KILL_AT {
            self.kill_now.notify_one();
        }
    }

    /// Waits until a server other than the one at `base` runs.
    async fn next_server(&self, base: &str) -> Result<(), String> {
        let mut server = self.server.subscribe();
        let restarted = server.wait_for(|now| now != base);
        match tokio::time::timeout(PATIENCE, restarted).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(format!(
                "{base} stopped answering, and no server replaced it"
            )),
        }
    }
}

fn outcome(verdict: &Value) -> &str {
    verdict["outcome"].as_str().unwrap_or_default()
}

/// What the database holds after a crash: the inbox's applied messages and the handler's
/// lines, each as (order, sequence, message id), and each order's last applied sequence.
#[derive(Debug, Default)]
struct Rows {
    inbox: Vec<(String, i64, String)>,
    orders: Vec<(String, i64, String)>,
    last: BTreeMap<String, i64>,
}

impl Rows {
    /// Checks that the inbox and the handler agree, with each other and with `acknowledged`.
    fn check(&self, acknowledged: &BTreeSet<Event>) {
        let inbox = once_each(&self.inbox, "inbox row");
        let orders = once_each(&self.orders, "orders row");
        let without_line: Vec<_> = inbox.difference(&orders).collect();
        let without_inbox_row: Vec<_> = orders.difference(&inbox).collect();
        assert!(
            without_line.is_empty() && without_inbox_row.is_empty(),
            "applied without its line: {without_line:?}; a line without its inbox row: {without_inbox_row:?}"
        );
        let recorded: BTreeSet<Event> = inbox
            .iter()
            .map(|(order, sequence, _)| (order.clone(), *sequence))
            .collect();
        let lost: Vec<_> = acknowledged.difference(&recorded).collect();
        assert!(lost.is_empty(), "acknowledged, but not recorded: {lost:?}");
        for (order, sequence, message_id) in &inbox {
            assert_eq!(message_id, &format!("{order}-{sequence}"));
        }
        self.check_no_gap(&recorded);
    }

    /// Each order's recorded sequences are 1..=last, and its row says `last`.
    fn check_no_gap(&self, recorded: &BTreeSet<Event>) {
        let mut by_order: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for (order, sequence) in recorded {
            by_order.entry(order).or_default().push(*sequence);
        }
        for (order, sequences) in &by_order {
            let last = self.last.get(*order).copied().unwrap_or(0);
            assert_eq!(
                *sequences,
                (1..=last).collect::<Vec<_>>(),
                "{order}: recorded sequences against its last {last}"
            );
        }
    }
}

/// The rows as a set, failing on any that occurs twice.
fn once_each(rows: &[(String, i64, String)], what: &str) -> BTreeSet<(String, i64, String)> {
    let mut seen = BTreeSet::new();
    let mut positions = BTreeSet::new();
    for row in rows {
        assert!(
            positions.insert((row.0.clone(), row.1)),
            "{what} doubled: {row:?}"
        );
        seen.insert(row.clone());
    }
    seen
}

/// Runs the load against `example` (started with `args`), kills it once `KILL_AT` answers came,
/// checks `rows` at the crash, restarts it, finishes the load and checks again.
async fn crash_under_load<F, R>(example: &str, args: &[String], rows: F)
where
    F: Fn() -> R,
    R: Future<Output = Rows>,
{
    let served = Served::start(example, args).await;
    let load = Load::new(served.base.clone());
    let mut clients = load.spawn_clients();
    tokio::time::timeout(PATIENCE, until_kill(&load, &mut clients))
        .await
        .unwrap_or_else(|_| panic!("the load did not reach {KILL_AT} answers in time"));
    served.kill().await;
    let at_crash = load.acknowledged();
    let crashed = rows().await;
    crashed.check(&at_crash);
    println!(
        "{example}: killed after {} answers, with {} events recorded and {} acknowledged",
        load.answers.load(Ordering::Relaxed),
        crashed.inbox.len(),
        at_crash.len()
    );

    let served = Served::start(example, args).await;
    load.server.send_replace(served.base.clone());
    let finished = tokio::time::timeout(PATIENCE, clients.join_all())
        .await
        .expect("the load finished in time");
    for client in finished {
        client.unwrap_or_else(|error| panic!("a client failed: {error}"));
    }
    served.kill().await;
    let everything = load.acknowledged();
    assert_eq!(everything.len(), ORDERS * LINES as usize);
    let rows = rows().await;
    rows.check(&everything);
    assert!(rows.last.values().all(|&last| last == LINES));
    let unanswered = load.unanswered.load(Ordering::Relaxed);
    println!("{example}: {unanswered} requests went unanswered and were sent again");
    assert!(unanswered > 0, "the kill interrupted no request");
}

/// Waits for the kill's count, failing at once if a client fails first.
async fn until_kill(load: &Load, clients: &mut JoinSet<Result<(), String>>) {
    loop {
        tokio::select! {
            () = load.kill_now.notified() => return,
            joined = clients.join_next() => match joined {
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(error))) => panic!("a client failed before the kill: {error}"),
                Some(Err(error)) => panic!("a client panicked: {error}"),
                None => panic!("the load ended before {KILL_AT} answers"),
            },
        }
    }
}

/// The SQLite file's rows, read with a connection of the test's own.
fn sqlite_rows(path: &Path) -> Rows {
    let connection = rusqlite::Connection::open(path).expect("open the database file");
    let triples = |sql: &str| {
        let mut statement = connection.prepare(sql).expect(sql);
        statement
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
            .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
            .expect(sql)
    };
    let inbox = triples("SELECT aggregate_id, sequence, message_id FROM ordered_inbox");
    let orders = triples("SELECT order_id, sequence, message_id FROM orders");
    let mut statement = connection
        .prepare("SELECT aggregate_id, last_sequence FROM aggregate_state")
        .expect("aggregate_state");
    let last = statement
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
        .and_then(Iterator::collect::<rusqlite::Result<BTreeMap<_, _>>>)
        .expect("aggregate_state");
    Rows {
        inbox,
        orders,
        last,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_under_load_loses_no_acknowledged_line_and_doubles_none_on_sqlite() {
    let directory = tempfile::tempdir().expect("a temp directory");
    let path = directory.path().join("orders.db");
    let args = ["--database".to_owned(), path.display().to_string()];
    crash_under_load("orders_sqlite", &args, || async { sqlite_rows(&path) }).await;
}

/// The database's rows, read with a connection of the test's own.
#[cfg(feature = "postgres")]
async fn postgres_rows(url: &str) -> Rows {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect to the private cluster");
    tokio::spawn(connection);
    let rows = async |sql: &str| client.query(sql, &[]).await.expect(sql);
    let triples = |rows: Vec<tokio_postgres::Row>| {
        rows.iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect()
    };
    let inbox = rows("SELECT aggregate_id, sequence, message_id FROM ordered_inbox").await;
    let orders = rows("SELECT order_id, sequence, message_id FROM orders").await;
    let last = rows("SELECT aggregate_id, last_sequence FROM aggregate_state").await;
    Rows {
        inbox: triples(inbox),
        orders: triples(orders),
        last: last.iter().map(|row| (row.get(0), row.get(1))).collect(),
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_under_load_loses_no_acknowledged_line_and_doubles_none_on_postgres() {
    use lab_testkit::pg::{ClusterOptions, PrivateCluster};
    let start = || PrivateCluster::start(ClusterOptions::for_tests());
    let cluster = tokio::task::spawn_blocking(start)
        .await
        .expect("the cluster's start")
        .unwrap_or_else(|error| panic!("a private PostgreSQL cluster: {error}"));
    let url = cluster
        .create_database("orders")
        .unwrap_or_else(|error| panic!("createdb: {error}"));
    let args = ["--database-url".to_owned(), url.clone()];
    let url = url.as_str();
    crash_under_load("orders_postgres", &args, move || postgres_rows(url)).await;
}
