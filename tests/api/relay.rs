//! From one service's outbox to another's ordered inbox over a real broker: the general outbox's
//! routes, and `production-lab relay` between server A (the outbox) and server B (`serve --nats`),
//! all real processes with a private `nats-server` (Debian package `nats-server`), or a
//! three-node JetStream cluster on loopback that loses a node.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use lab_testkit::nats::{NatsServer, nats_binary};
use production_lab::broker::wire;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::helpers::{
    ServerProcess, TestApp, assert_bad_request, client, command, poll_until, poll_until_within,
    settings_dir, spawn_app, status_and_json,
};

// ---------------------------------------------------------------------------------------------
// Helpers

/// A private nats-server; a missing binary fails the test with the Debian package's name.
fn start_nats() -> NatsServer {
    NatsServer::start(None).unwrap_or_else(|error| panic!("{error}"))
}

fn event(aggregate: &str, sequence: i64) -> Value {
    json!({
        "eventKey": format!("{aggregate}-{sequence}"),
        "aggregateId": aggregate,
        "sequence": sequence,
        "amount": sequence % 5 + 1,
    })
}

fn expected_total(per: i64) -> i64 {
    (1..=per).map(|s| s % 5 + 1).sum()
}

fn aggregate_names(prefix: &str, aggregates: usize) -> Vec<String> {
    (0..aggregates).map(|a| format!("{prefix}-{a}")).collect()
}

/// Writes `per` events to each aggregate of A's outbox, each aggregate in sequence order, the
/// aggregates concurrently.
async fn write_events(base: &str, aggregates: &[String], per: i64) {
    write_sequences(base, aggregates, 1..=per).await;
}

/// Writes the events `sequences` of each aggregate to A's outbox, each aggregate in sequence
/// order, the aggregates concurrently.
async fn write_sequences(
    base: &str,
    aggregates: &[String],
    sequences: std::ops::RangeInclusive<i64>,
) {
    let mut writers = Vec::new();
    for aggregate in aggregates {
        let url = format!("{base}/outbox/events");
        let aggregate = aggregate.clone();
        let sequences = sequences.clone();
        writers.push(tokio::spawn(async move {
            let http = client();
            for sequence in sequences {
                let response = http
                    .post(&url)
                    .json(&event(&aggregate, sequence))
                    .send()
                    .await
                    .expect("POST /outbox/events");
                assert_eq!(response.status(), 201, "{aggregate}-{sequence}");
            }
        }));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
}

/// `GET /outbox/events` of `base`: the counts and the first page.
async fn outbox_page(base: &str, query: &str) -> Value {
    let response = client()
        .get(format!("{base}/outbox/events{query}"))
        .send()
        .await
        .expect("GET /outbox/events");
    let (status, body) = status_and_json(response).await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn outbox_counts(base: &str) -> (i64, i64) {
    let page = outbox_page(base, "?limit=1").await;
    (
        page["counts"]["pending"].as_i64().unwrap_or(-1),
        page["counts"]["sent"].as_i64().unwrap_or(-1),
    )
}

/// Every event of A's outbox, paging through.
async fn all_events(base: &str) -> Vec<Value> {
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let page = outbox_page(base, &format!("?after={after}&limit=1000")).await;
        events.extend(page["events"].as_array().cloned().unwrap_or_default());
        match page["next"].as_i64() {
            Some(next) => after = next,
            None => return events,
        }
    }
}

/// `aggregate_id → (last, total, applied rows, held rows)` in B's database.
fn aggregates_in(database: &Path) -> BTreeMap<String, (i64, i64, i64, i64)> {
    let db = rusqlite::Connection::open(database).expect("open B's database");
    db.busy_timeout(Duration::from_secs(5))
        .expect("busy timeout");
    let mut statement = db
        .prepare(
            "SELECT a.aggregate_id, a.last_sequence, a.total,
                    (SELECT COUNT(*) FROM ordered_inbox i WHERE i.aggregate_id = a.aggregate_id),
                    (SELECT COUNT(*) FROM held_messages h WHERE h.aggregate_id = a.aggregate_id)
               FROM aggregate_state a",
        )
        .expect("prepare");
    statement
        .query_map([], |row| {
            Ok((
                row.get(0)?,
                (row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?),
            ))
        })
        .expect("query")
        .map(|row| row.expect("row"))
        .collect()
}

/// [`write_events`] on a task of its own, for tests that kill something while A is written.
fn write_events_meanwhile(
    base: &str,
    aggregates: &[String],
    per: i64,
) -> tokio::task::JoinHandle<()> {
    let base = base.to_owned();
    let aggregates = aggregates.to_vec();
    tokio::spawn(async move { write_events(&base, &aggregates, per).await })
}

fn applied_rows(database: &Path) -> i64 {
    let db = rusqlite::Connection::open(database).expect("open B's database");
    db.busy_timeout(Duration::from_secs(5))
        .expect("busy timeout");
    db.query_row("SELECT COUNT(*) FROM ordered_inbox", [], |row| row.get(0))
        .expect("count")
}

/// Waits until B has applied `count` rows.
async fn applied_at_b(database: &Path, count: i64, within: Duration) {
    poll_until_within(
        &format!("B applied {count} events"),
        within,
        || std::future::ready(applied_rows(database)),
        |applied| *applied >= count,
    )
    .await;
}

/// B ends with every aggregate at `per`, the right total, one row per event, nothing held.
fn assert_applied_once(database: &Path, aggregates: &[String], per: i64) {
    let found = aggregates_in(database);
    for aggregate in aggregates {
        assert_eq!(
            found.get(aggregate),
            Some(&(per, expected_total(per), per, 0)),
            "{aggregate}: (last, total, applied rows, held rows)"
        );
    }
}

/// B's stream, as B created it (or as the test did before B started).
async fn stream_messages(context: &jetstream::Context) -> u64 {
    let mut stream = context.get_stream("ORDERED").await.expect("the stream");
    stream.info().await.expect("stream info").state.messages
}

/// A `production-lab relay` child process; its stdout and stderr lines are collected.
struct Relay {
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
}

fn collect(pipe: impl std::io::Read + Send + 'static) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if let Ok(mut sink) = sink.lock() {
                sink.push(line);
            }
        }
    });
    lines
}

impl Relay {
    fn start(base: &str, nats: &str, owner: &str, extra: &[&str]) -> Relay {
        let mut child = command()
            .args(["relay", "--base", base, "--nats", nats, "--owner", owner])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the relay");
        let stdout = collect(child.stdout.take().expect("stdout"));
        let stderr = collect(child.stderr.take().expect("stderr"));
        Relay {
            child,
            stdout,
            stderr,
        }
    }

    fn stderr_text(&self) -> String {
        self.stderr.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    /// Waits for a stderr line containing `needle`.
    async fn said(&self, needle: &str, within: Duration) -> String {
        let lines = self.stderr.clone();
        poll_until_within(
            &format!("the relay says '{needle}'"),
            within,
            || {
                std::future::ready(
                    lines
                        .lock()
                        .ok()
                        .and_then(|l| l.iter().find(|line| line.contains(needle)).cloned()),
                )
            },
            Option::is_some,
        )
        .await
        .unwrap_or_default()
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits for the process to exit; returns its exit code and its report line (stdout).
    async fn finish(&mut self, within: Duration) -> (Option<i32>, String) {
        let child = &mut self.child;
        let status = poll_until_within(
            "the relay exits",
            within,
            || std::future::ready(child.try_wait().ok().flatten()),
            Option::is_some,
        )
        .await
        .expect("exited");
        // The reader threads end with the process's pipes.
        let stdout = poll_until(
            "the relay's report line is read",
            || std::future::ready(self.stdout.lock().map(|l| l.join("\n")).unwrap_or_default()),
            |text| text.contains("published"),
        )
        .await;
        (status.code(), stdout)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The number after `label ` in a relay's report.
fn figure(report: &str, label: &str) -> u64 {
    lab_testkit::bench::relay::report_figure(report, label)
        .unwrap_or_else(|| panic!("no '{label}' in {report:?}"))
}

/// Server A (the outbox) and server B (consuming `nats`), both real processes.
struct Pair {
    _dir: TempDir,
    settings: PathBuf,
    a: ServerProcess,
    b: ServerProcess,
    b_database: PathBuf,
    b_args: Vec<String>,
}

impl Pair {
    fn start(nats: &str) -> Pair {
        let (dir, settings) = settings_dir();
        let a = ServerProcess::start(&dir.path().join("a.db"), &settings, &[]);
        let b_database = dir.path().join("b.db");
        let b_args: Vec<String> = ["--nats", nats, "--nats-ack-wait-ms", "2000"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let b = start_b(&b_database, &settings, &b_args);
        Pair {
            _dir: dir,
            settings,
            a,
            b,
            b_database,
            b_args,
        }
    }

    fn restart_b(&mut self) {
        self.b = start_b(&self.b_database, &self.settings, &self.b_args);
    }
}

fn start_b(database: &Path, settings: &Path, args: &[String]) -> ServerProcess {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ServerProcess::start(database, settings, &args)
}

// ---------------------------------------------------------------------------------------------
// The outbox's routes

async fn post(app: &TestApp, path: &str, body: &Value) -> (u16, Value) {
    status_and_json(app.post_json(path, body).await).await
}

#[tokio::test]
async fn an_event_is_recorded_once_and_the_same_key_with_other_content_is_refused() {
    let app = spawn_app().await;
    let (status, created) = post(&app, "/outbox/events", &event("acct", 1)).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["replay"], false);
    assert_eq!(created["event"]["status"], "pending");
    assert_eq!(created["event"]["generation"], 0);

    let (status, replay) = post(&app, "/outbox/events", &event("acct", 1)).await;
    assert_eq!((status, replay["replay"].clone()), (200, json!(true)));
    assert_eq!(replay["event"]["id"], created["event"]["id"]);

    let mut changed = event("acct", 1);
    changed["amount"] = json!(9);
    let (status, problem) = post(&app, "/outbox/events", &changed).await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["title"], "Event key conflict");

    let mut other_key = event("acct", 1);
    other_key["eventKey"] = json!("another-key");
    let (status, problem) = post(&app, "/outbox/events", &other_key).await;
    assert_eq!(
        (status, problem["title"].clone()),
        (409, json!("Sequence already recorded"))
    );
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM general_outbox"),
        1,
        "nothing else was recorded"
    );
}

#[tokio::test]
async fn an_event_is_validated_as_on_the_inboxs_general_door() {
    let app = spawn_app().await;
    let cases = [
        (
            json!({"eventKey": " ", "aggregateId": "a", "sequence": 1, "amount": 1}),
            "eventKey",
        ),
        (
            json!({"eventKey": "k", "aggregateId": "a b", "sequence": 1, "amount": 1}),
            "aggregateId",
        ),
        (
            json!({"eventKey": "k", "aggregateId": "..", "sequence": 1, "amount": 1}),
            "aggregateId",
        ),
        (
            json!({"eventKey": "k", "aggregateId": "a", "sequence": 0, "amount": 1}),
            "sequence",
        ),
        (
            json!({"eventKey": "k", "aggregateId": "a", "sequence": 1}),
            "amount",
        ),
        (
            json!({"eventKey": "k", "aggregateId": "a", "sequence": 1, "amount": 1.5}),
            "invalid",
        ),
    ];
    for (body, named) in cases {
        let problem = assert_bad_request(app.post_json("/outbox/events", &body).await).await;
        assert!(
            problem["detail"].as_str().unwrap_or("").contains(named),
            "{body} → {problem}"
        );
    }
    let twice = r#"{"eventKey":"k","aggregateId":"a","sequence":1,"amount":1,"AMOUNT":2}"#;
    let problem = assert_bad_request(
        app.post_raw("/outbox/events", "application/json", twice)
            .await,
    )
    .await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or("")
            .contains("more than once"),
        "{problem}"
    );
    assert_eq!(app.scalar("SELECT COUNT(*) FROM general_outbox"), 0);
    let response = client()
        .get(app.url("/outbox/events?status=lost"))
        .send()
        .await
        .expect("GET");
    assert_bad_request(response).await;
}

#[tokio::test]
async fn a_lease_never_hands_out_a_later_sequence_while_an_earlier_one_is_leased_elsewhere() {
    let app = spawn_app().await;
    for aggregate in ["a", "b"] {
        for sequence in 1..=3 {
            let (status, _) = post(&app, "/outbox/events", &event(aggregate, sequence)).await;
            assert_eq!(status, 201);
        }
    }
    let lease = |owner: &str, max: i64| json!({"owner": owner, "max": max, "leaseMs": 60_000});
    let (status, one) = post(&app, "/outbox/leases", &lease("one", 2)).await;
    assert_eq!(status, 200, "{one}");
    let keys = |lease: &Value| -> Vec<String> {
        lease["events"]
            .as_array()
            .map(|events| {
                events
                    .iter()
                    .map(|e| {
                        format!(
                            "{}@{}",
                            e["eventKey"].as_str().unwrap_or(""),
                            e["generation"]
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(keys(&one), ["a-1@1", "a-2@1"]);
    // a-3 waits behind a-2, which "one" holds: "two" gets only b's events.
    let (_, two) = post(&app, "/outbox/leases", &lease("two", 10)).await;
    assert_eq!(keys(&two), ["b-1@1", "b-2@1", "b-3@1"]);
    let (_, three) = post(&app, "/outbox/leases", &lease("three", 10)).await;
    assert_eq!(keys(&three), Vec::<String>::new(), "{three}");

    let problem = assert_bad_request(
        app.post_json(
            "/outbox/leases",
            &json!({"owner": "x", "max": 0, "leaseMs": 1000}),
        )
        .await,
    )
    .await;
    assert!(problem["detail"].as_str().unwrap_or("").contains("max"));
    let problem = assert_bad_request(
        app.post_json(
            "/outbox/leases",
            &json!({"owner": "x y", "max": 1, "leaseMs": 1000}),
        )
        .await,
    )
    .await;
    assert!(problem["detail"].as_str().unwrap_or("").contains("owner"));
}

#[tokio::test]
async fn an_ack_is_acked_only_for_the_live_lease_and_fenced_after_a_newer_generation() {
    let app = spawn_app().await;
    for sequence in 1..=2 {
        post(&app, "/outbox/events", &event("a", sequence)).await;
    }
    // A short lease, so that it expires and is taken again.
    let (_, first) = post(
        &app,
        "/outbox/leases",
        &json!({"owner": "one", "max": 10, "leaseMs": 100}),
    )
    .await;
    let ids: Vec<i64> = first["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["id"].as_i64())
        .collect();
    assert_eq!(ids.len(), 2);
    let second = poll_until(
        "the expired lease is taken by another relay",
        || async {
            post(
                &app,
                "/outbox/leases",
                &json!({"owner": "two", "max": 10, "leaseMs": 60_000}),
            )
            .await
            .1
        },
        |lease| lease["events"].as_array().is_some_and(|e| e.len() == 2),
    )
    .await;
    assert_eq!(second["events"][0]["generation"], 2);

    let ack = |owner: &str, generation: i64| json!({"owner": owner, "events": ids.iter().map(|id| json!({"id": id, "generation": generation})).collect::<Vec<_>>()});
    let (status, stale) = post(&app, "/outbox/leases/ack", &ack("one", 1)).await;
    assert_eq!(status, 200, "{stale}");
    assert_eq!(
        (stale["acked"].clone(), stale["fenced"].clone()),
        (json!(0), json!(2))
    );
    assert_eq!(stale["events"][0]["verdict"], "fenced");
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM general_outbox WHERE status = 'sent'"),
        0
    );

    // Names bind case-insensitively inside the events too.
    let upper = json!({"Owner": "two", "Events": [{"ID": ids[0], "Generation": 2}]});
    let (status, first_only) = post(&app, "/outbox/leases/ack", &upper).await;
    assert_eq!(
        (status, first_only["acked"].clone()),
        (200, json!(1)),
        "{first_only}"
    );
    let (_, current) = post(&app, "/outbox/leases/ack", &ack("two", 2)).await;
    assert_eq!(
        (current["acked"].clone(), current["fenced"].clone()),
        (json!(2), json!(0))
    );
    // The same ack again (its answer lost): acked again, nothing changes.
    let (_, again) = post(&app, "/outbox/leases/ack", &ack("two", 2)).await;
    assert_eq!(again["acked"], 2);
    let (_, late) = post(&app, "/outbox/leases/ack", &ack("one", 1)).await;
    assert_eq!(
        late["fenced"], 2,
        "the old lease stays fenced after the send"
    );

    let sent = outbox_page(&app.url(""), "?status=sent").await;
    assert_eq!(sent["counts"], json!({"pending": 0, "sent": 2}));
    assert_eq!(sent["events"][0]["owner"], "two");
    assert_eq!(sent["events"][0]["generation"], 2);

    let metrics = app.get("/metrics").await.text().await.expect("metrics");
    for series in [
        r#"outbox_acks_total{verdict="acked"} 5"#,
        r#"outbox_acks_total{verdict="fenced"} 4"#,
        "outbox_leased_total 4",
    ] {
        assert!(metrics.contains(series), "{series} in\n{metrics}");
    }

    let twice = json!({"owner": "two", "events": [{"id": ids[0], "generation": 2}, {"id": ids[0], "generation": 2}]});
    assert_bad_request(app.post_json("/outbox/leases/ack", &twice).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_leases_never_hand_one_event_to_two_owners_and_never_fail() {
    let app = spawn_app().await;
    let aggregates = aggregate_names("c", 20);
    write_events(&app.url(""), &aggregates, 20).await;
    let mut calls = Vec::new();
    for owner in 0..16 {
        let url = app.url("/outbox/leases");
        calls.push(tokio::spawn(async move {
            let response = client()
                .post(url)
                .json(&json!({"owner": format!("o{owner}"), "max": 50, "leaseMs": 60_000}))
                .send()
                .await
                .expect("lease");
            let (status, body) = status_and_json(response).await;
            (owner, status, body)
        }));
    }
    let mut seen = HashSet::new();
    let mut owner_of_aggregate = BTreeMap::new();
    let mut leased = 0;
    for call in calls {
        let (owner, status, body) = call.await.expect("lease call");
        assert_eq!(status, 200, "no lease call fails under contention: {body}");
        for event in body["events"].as_array().expect("events") {
            leased += 1;
            assert!(
                seen.insert(event["id"].as_i64().expect("id")),
                "event {event} was handed to two owners"
            );
            let aggregate = event["aggregateId"].as_str().expect("aggregate").to_owned();
            let first = owner_of_aggregate.entry(aggregate).or_insert(owner);
            assert_eq!(
                *first, owner,
                "one aggregate's events went to two relays: {event}"
            );
        }
    }
    assert!(leased >= 50, "the leases handed out events: {leased}");
}

/// The event keys of a lease's answer, in its order.
fn leased_keys(lease: &Value) -> Vec<String> {
    lease["events"]
        .as_array()
        .map(|events| {
            events
                .iter()
                .filter_map(|e| e["eventKey"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Adds `sequences` of `aggregate` straight to the table, as the services' own transactions
/// would have committed them.
fn insert_outbox_events(app: &TestApp, aggregate: &str, sequences: std::ops::RangeInclusive<i64>) {
    let mut db = app.db();
    let transaction = db.transaction().expect("begin");
    for sequence in sequences {
        let event = event(aggregate, sequence);
        transaction
            .execute(
                "INSERT INTO general_outbox(event_key, aggregate_id, sequence, amount, created_at_ms)
                 VALUES (?1, ?2, ?3, ?4, 0)",
                rusqlite::params![
                    event["eventKey"].as_str(),
                    aggregate,
                    sequence,
                    event["amount"].as_i64()
                ],
            )
            .expect("insert an event");
    }
    transaction.commit().expect("commit");
}

#[tokio::test]
async fn with_thousands_of_events_blocked_behind_live_leases_a_lease_hands_out_exactly_the_eligible_ones()
 {
    let app = spawn_app().await;
    // The even aggregates' first events, leased for ten minutes by "holder".
    let blocked: Vec<String> = (0..40).step_by(2).map(|a| format!("acct-{a:02}")).collect();
    let free: Vec<String> = (1..40).step_by(2).map(|a| format!("acct-{a:02}")).collect();
    for aggregate in &blocked {
        insert_outbox_events(&app, aggregate, 1..=1);
    }
    let hold = json!({"owner": "holder", "max": 1000, "leaseMs": 600_000});
    let (status, held) = post(&app, "/outbox/leases", &hold).await;
    assert_eq!((status, leased_keys(&held).len()), (200, 20), "{held}");
    // 150 events wait behind each held one; the odd aggregates have three events each.
    for aggregate in &blocked {
        insert_outbox_events(&app, aggregate, 2..=151);
    }
    for aggregate in &free {
        insert_outbox_events(&app, aggregate, 1..=3);
    }
    let free_keys: Vec<String> = free
        .iter()
        .flat_map(|aggregate| (1..=3).map(move |sequence| format!("{aggregate}-{sequence}")))
        .collect();

    let lease = |owner: &str, max: i64| json!({"owner": owner, "max": max, "leaseMs": 600_000});
    let (_, first) = post(&app, "/outbox/leases", &lease("first", 4)).await;
    assert_eq!(leased_keys(&first), free_keys[..4], "{first}");
    // acct-03's third event waits behind its second, which "first" holds.
    let (_, second) = post(&app, "/outbox/leases", &lease("second", 1000)).await;
    assert_eq!(leased_keys(&second), free_keys[6..], "{second}");
    let (_, nothing) = post(&app, "/outbox/leases", &lease("third", 1000)).await;
    assert_eq!(leased_keys(&nothing), Vec::<String>::new(), "{nothing}");

    // Once the holder's first event of acct-00 is sent, its 150 successors are eligible.
    let ack =
        json!({"owner": "holder", "events": [{"id": held["events"][0]["id"], "generation": 1}]});
    let (_, acked) = post(&app, "/outbox/leases/ack", &ack).await;
    assert_eq!(acked["acked"], 1, "{acked}");
    let (_, after_ack) = post(&app, "/outbox/leases", &lease("fourth", 1000)).await;
    let expected: Vec<String> = (2..=151)
        .map(|sequence| format!("acct-00-{sequence}"))
        .collect();
    assert_eq!(leased_keys(&after_ack), expected);
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM general_outbox WHERE status = 'pending'"),
        20 * 151 + 20 * 3 - 1
    );
}

// ---------------------------------------------------------------------------------------------
// The relay between two real servers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_carries_32_aggregates_of_100_events_to_the_inbox_once_and_stops_on_sigterm() {
    let nats = start_nats();
    let pair = Pair::start(&nats.url);
    let aggregates = aggregate_names("acct", 32);
    let mut relay = Relay::start(&pair.a.address, &nats.url, "one", &[]);
    write_events(&pair.a.address, &aggregates, 100).await;
    applied_at_b(&pair.b_database, 3200, Duration::from_secs(60)).await;
    assert_applied_once(&pair.b_database, &aggregates, 100);
    let counts = poll_until(
        "A's outbox all sent",
        || outbox_counts(&pair.a.address),
        |counts| counts.0 == 0,
    )
    .await;
    assert_eq!(counts, (0, 3200));
    relay.signal("TERM");
    let (code, report) = relay.finish(Duration::from_secs(10)).await;
    assert_eq!(code, Some(0), "{report}\n{}", relay.stderr_text());
    assert_eq!(figure(&report, "published"), 3200, "{report}");
    assert_eq!(figure(&report, "acked"), 3200);
    assert_eq!(figure(&report, "fenced acks"), 0);
    let context = jetstream::new(nats.connect().await.expect("connect"));
    assert_eq!(
        stream_messages(&context).await,
        3200,
        "each event once in the stream"
    );
}

/// A nats-server whose anonymous clients may publish anything but receive nothing on reply
/// inboxes: every PubAck (and every "no responders") is dropped before it reaches the relay.
const PUBACKS_NEVER_ARRIVE: &str = "authorization {
  users = [
    { user: relay, password: unused,
      permissions: { publish: \">\", subscribe: { deny: \"_INBOX.>\" } } }
  ]
}
no_auth_user: relay
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_pubacks_never_come_is_given_up_after_one_timeout_per_attempt_not_one_per_event()
 {
    let nats =
        NatsServer::start(Some(PUBACKS_NEVER_ARRIVE)).unwrap_or_else(|error| panic!("{error}"));
    let (dir, settings) = settings_dir();
    let a = ServerProcess::start(&dir.path().join("a.db"), &settings, &[]);
    // All 64 events are in the outbox before the relay starts, so its first lease is one batch
    // of 64.
    write_events(&a.address, &aggregate_names("lost", 4), 16).await;
    let mut relay = Relay::start(&a.address, &nats.url, "one", &["--batch", "64"]);
    // Five attempts with a 2 s timeout each and pauses of 0.2 to 1.6 s come to about 13 s; a
    // timeout per event would be 64 x 2 s for the first attempt alone.
    poll_until_within(
        "the relay gives the batch up and leaves it pending",
        Duration::from_secs(45),
        || std::future::ready(relay.stderr_text()),
        |said| said.contains("64 events got no PubAck"),
    )
    .await;
    assert_eq!(outbox_counts(&a.address).await, (64, 0), "nothing acked");
    // SIGTERM lets a batch under way finish its attempts (another 13 s at most) first.
    relay.signal("TERM");
    let (code, report) = relay.finish(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{report}\n{}", relay.stderr_text());
    assert_eq!(figure(&report, "published"), 0, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_batch_finishes_and_acks_it_before_the_relay_exits_zero() {
    let nats = start_nats();
    let pair = Pair::start(&nats.url);
    let aggregates = aggregate_names("t", 2);
    write_events(&pair.a.address, &aggregates, 5).await;
    let mut relay = Relay::start(
        &pair.a.address,
        &nats.url,
        "one",
        &["--hold-before-ack-ms", "1500"],
    );
    relay
        .said(
            "holding the ack of 10 PubAcked events",
            Duration::from_secs(20),
        )
        .await;
    relay.signal("TERM");
    let (code, report) = relay.finish(Duration::from_secs(10)).await;
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(
        figure(&report, "acked"),
        10,
        "the batch in hand was acked: {report}"
    );
    assert_eq!(outbox_counts(&pair.a.address).await, (0, 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_after_its_pubacks_is_replaced_the_broker_drops_the_copies_and_the_late_ack_is_fenced()
 {
    let nats = start_nats();
    let pair = Pair::start(&nats.url);
    let aggregates = aggregate_names("k", 8);
    write_events(&pair.a.address, &aggregates, 20).await;

    // Relay one publishes all 160, gets every PubAck, and is killed before its ack.
    let first = Relay::start(
        &pair.a.address,
        &nats.url,
        "one",
        &[
            "--lease-ms",
            "1000",
            "--batch",
            "1000",
            "--hold-before-ack-ms",
            "60000",
        ],
    );
    first
        .said(
            "holding the ack of 160 PubAcked events",
            Duration::from_secs(20),
        )
        .await;
    first.signal("KILL");
    drop(first);
    applied_at_b(&pair.b_database, 160, Duration::from_secs(20)).await;
    assert_eq!(
        outbox_counts(&pair.a.address).await,
        (160, 0),
        "nothing acked"
    );

    // Relay two leases them once the leases expired, with generation 2, and re-publishes them:
    // JetStream's duplicate window drops every copy.
    let mut second = Relay::start(&pair.a.address, &nats.url, "two", &["--once"]);
    let (code, report) = second.finish(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{report}\n{}", second.stderr_text());
    assert_eq!(figure(&report, "published"), 160, "{report}");
    assert_eq!(figure(&report, "broker-reported duplicates"), 160);
    assert_eq!(figure(&report, "acked"), 160);
    let events = all_events(&pair.a.address).await;
    assert!(
        events
            .iter()
            .all(|e| e["status"] == "sent" && e["owner"] == "two" && e["generation"] == 2),
        "every event sent by the second lease: {:?}",
        events.first()
    );
    let context = jetstream::new(nats.connect().await.expect("connect"));
    assert_eq!(
        stream_messages(&context).await,
        160,
        "no copy in the stream"
    );
    assert_applied_once(&pair.b_database, &aggregates, 20);

    // A relay that comes back to its batch after its leases were taken over is fenced: relay
    // "one" again, holding its ack past its lease while "two" takes the events over.
    let late = aggregate_names("late", 2);
    write_events(&pair.a.address, &late, 5).await;
    let mut first = Relay::start(
        &pair.a.address,
        &nats.url,
        "one",
        &[
            "--lease-ms",
            "500",
            "--batch",
            "1000",
            "--hold-before-ack-ms",
            "3000",
        ],
    );
    first
        .said(
            "holding the ack of 10 PubAcked events",
            Duration::from_secs(20),
        )
        .await;
    let mut second = Relay::start(&pair.a.address, &nats.url, "two", &["--once"]);
    let (code, report) = second.finish(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(figure(&report, "acked"), 10, "{report}");
    first.said("fenced 10", Duration::from_secs(20)).await;
    first.signal("TERM");
    let (code, report) = first.finish(Duration::from_secs(10)).await;
    assert_eq!(code, Some(0));
    assert_eq!(figure(&report, "fenced acks"), 10, "{report}");
    assert_eq!(figure(&report, "acked"), 0);
    applied_at_b(&pair.b_database, 170, Duration::from_secs(20)).await;
    assert_applied_once(&pair.b_database, &late, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_at_once_publish_every_event_once_and_keep_each_aggregates_order() {
    let nats = start_nats();
    let pair = Pair::start(&nats.url);
    let aggregates = aggregate_names("two", 16);
    let mut one = Relay::start(&pair.a.address, &nats.url, "one", &["--batch", "32"]);
    let mut two = Relay::start(&pair.a.address, &nats.url, "two", &["--batch", "32"]);
    write_events(&pair.a.address, &aggregates, 50).await;
    applied_at_b(&pair.b_database, 800, Duration::from_secs(60)).await;
    poll_until(
        "A's outbox all sent",
        || outbox_counts(&pair.a.address),
        |counts| *counts == (0, 800),
    )
    .await;
    one.signal("TERM");
    two.signal("TERM");
    let (_, report_one) = one.finish(Duration::from_secs(10)).await;
    let (_, report_two) = two.finish(Duration::from_secs(10)).await;
    assert_eq!(
        figure(&report_one, "acked") + figure(&report_two, "acked"),
        800,
        "every row acked once: {report_one} / {report_two}"
    );
    assert_eq!(
        figure(&report_one, "published") + figure(&report_two, "published"),
        800,
        "no event published twice"
    );
    assert_eq!(
        figure(&report_one, "fenced acks") + figure(&report_two, "fenced acks"),
        0
    );
    assert!(
        figure(&report_one, "acked") > 0 && figure(&report_two, "acked") > 0,
        "both relays worked: {report_one} / {report_two}"
    );
    assert_applied_once(&pair.b_database, &aggregates, 50);

    // In the stream itself each aggregate's events are in sequence order.
    let context = jetstream::new(nats.connect().await.expect("connect"));
    let stream = context.get_stream("ORDERED").await.expect("stream");
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for position in 1..=800 {
        let message = stream
            .get_raw_message(position)
            .await
            .expect("stored message");
        let body: Value = serde_json::from_slice(&message.payload).expect("JSON body");
        let aggregate =
            wire::aggregate_of_subject("ordered", None, &message.subject).expect("subject");
        let sequence = body["sequence"].as_i64().expect("sequence");
        let previous = last.insert(aggregate.clone(), sequence).unwrap_or(0);
        assert_eq!(
            sequence,
            previous + 1,
            "{aggregate}: stream position {position} holds {sequence} after {previous}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_killed_mid_stream_finishes_after_a_restart_and_applies_each_event_once() {
    let nats = start_nats();
    let mut pair = Pair::start(&nats.url);
    let aggregates = aggregate_names("b", 32);
    let _relay = Relay::start(&pair.a.address, &nats.url, "one", &["--batch", "64"]);
    let writing = write_events_meanwhile(&pair.a.address, &aggregates, 50);
    // Part of the stream.
    applied_at_b(&pair.b_database, 200, Duration::from_secs(30)).await;
    pair.b.signal("KILL");
    let _ = pair.b.exit_status().await;
    let at_kill = applied_rows(&pair.b_database);
    assert!(at_kill < 1600, "killed mid-stream ({at_kill} applied)");
    pair.restart_b();
    writing.await.expect("writers");
    applied_at_b(&pair.b_database, 1600, Duration::from_secs(60)).await;
    assert_applied_once(&pair.b_database, &aggregates, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_duplicate_window_a_re_published_event_is_caught_by_the_inboxs_identity_check() {
    let nats = start_nats();
    let context = jetstream::new(nats.connect().await.expect("connect"));
    // The stream B expects, created first with a 100 ms duplicate window (B opens it as it is).
    context
        .get_or_create_stream(StreamConfig {
            name: "ORDERED".to_owned(),
            subjects: vec!["ordered.*".to_owned()],
            storage: StorageType::File,
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await
        .expect("create the stream");
    let pair = Pair::start(&nats.url);
    let aggregates = aggregate_names("w", 2);
    write_events(&pair.a.address, &aggregates, 5).await;
    let first = Relay::start(
        &pair.a.address,
        &nats.url,
        "one",
        &["--lease-ms", "1000", "--hold-before-ack-ms", "60000"],
    );
    first
        .said(
            "holding the ack of 10 PubAcked events",
            Duration::from_secs(20),
        )
        .await;
    first.signal("KILL");
    drop(first);
    applied_at_b(&pair.b_database, 10, Duration::from_secs(20)).await;
    // The second relay can lease them only after the 1 s lease: far past the 100 ms window.
    let mut second = Relay::start(&pair.a.address, &nats.url, "two", &["--once"]);
    let (code, report) = second.finish(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(figure(&report, "published"), 10, "{report}");
    assert_eq!(
        figure(&report, "broker-reported duplicates"),
        0,
        "past its window the broker keeps the copies"
    );
    assert_eq!(
        stream_messages(&context).await,
        20,
        "every event twice in the stream"
    );
    let status = poll_until(
        "B answered every copy as a replay",
        || async {
            let response = client()
                .get(pair.b.url("/broker"))
                .send()
                .await
                .expect("GET /broker");
            status_and_json(response).await.1
        },
        |status| status["counters"]["outcomes"]["replay"] == 10,
    )
    .await;
    assert_eq!(status["counters"]["outcomes"]["applied"], 10, "{status}");
    assert_applied_once(&pair.b_database, &aggregates, 5);
}

#[test]
fn a_relay_aimed_off_loopback_is_refused_with_one_line() {
    for (base, nats) in [
        ("http://10.1.2.3:5080", "nats://127.0.0.1:4222"),
        ("http://127.0.0.1:5080", "nats://10.1.2.3:4222"),
    ] {
        let output = command()
            .args([
                "relay", "--base", base, "--nats", nats, "--owner", "x", "--once",
            ])
            .output()
            .expect("run the relay");
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains("loopback"), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_lease_the_outbox_refuses_exits_at_once_saying_why() {
    let nats = start_nats();
    let app = spawn_app().await;
    let mut relay = Relay::start(&app.url(""), &nats.url, "not a name", &[]);
    let child = &mut relay.child;
    let status = poll_until(
        "the relay exits",
        || std::future::ready(child.try_wait().ok().flatten()),
        Option::is_some,
    )
    .await;
    assert!(status.is_some_and(|status| !status.success()));
    let said = relay.said("owner must be", Duration::from_secs(5)).await;
    assert!(said.contains("400"), "{said}");
}

// ---------------------------------------------------------------------------------------------
// A three-node JetStream cluster that loses a node

/// Three `nats-server` processes with cluster routes on loopback, JetStream on each.
struct NatsCluster {
    dir: TempDir,
    nodes: Vec<Option<Child>>,
    /// (client, cluster, monitoring) ports per node.
    ports: Vec<(u16, u16, u16)>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free port")
}

impl NatsCluster {
    fn start() -> NatsCluster {
        let binary = nats_binary().unwrap_or_else(|error| panic!("{error}"));
        let dir = tempfile::tempdir().expect("temp dir");
        let ports: Vec<(u16, u16, u16)> = (0..3)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let routes: Vec<String> = ports
            .iter()
            .map(|(_, cluster, _)| format!("nats-route://127.0.0.1:{cluster}"))
            .collect();
        for (index, (client, cluster, monitor)) in ports.iter().enumerate() {
            let store = dir.path().join(format!("store-{index}"));
            let config = format!(
                "server_name: n{index}\nlisten: 127.0.0.1:{client}\nhttp: 127.0.0.1:{monitor}\n\
                 jetstream {{ store_dir: \"{}\" }}\n\
                 cluster {{\n  name: lab\n  listen: 127.0.0.1:{cluster}\n  routes: [{}]\n}}\n",
                store.display(),
                routes.join(", ")
            );
            std::fs::write(dir.path().join(format!("n{index}.conf")), config).expect("config");
        }
        let mut cluster = NatsCluster {
            dir,
            nodes: Vec::new(),
            ports,
        };
        let _ = binary;
        for index in 0..3 {
            let child = cluster.spawn(index);
            cluster.nodes.push(Some(child));
        }
        cluster
    }

    fn spawn(&self, index: usize) -> Child {
        std::process::Command::new(nats_binary().unwrap_or_else(|error| panic!("{error}")))
            .arg("-c")
            .arg(self.dir.path().join(format!("n{index}.conf")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server")
    }

    fn urls(&self) -> String {
        self.ports
            .iter()
            .map(|(client, _, _)| format!("nats://127.0.0.1:{client}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.nodes[index].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn restart(&mut self, index: usize) {
        self.kill(index);
        self.nodes[index] = Some(self.spawn(index));
    }

    /// The node's own JetStream figures (`/jsz` of its monitoring port).
    async fn jsz(&self, index: usize) -> Option<Value> {
        let response = client()
            .get(format!("http://127.0.0.1:{}/jsz", self.ports[index].2))
            .send()
            .await
            .ok()?;
        response.json().await.ok()
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for index in 0..self.nodes.len() {
            self.kill(index);
        }
    }
}

/// The index of the node that leads the stream `ORDERED` (named `n0` … `n2`), once one does.
async fn stream_leader(context: &jetstream::Context) -> usize {
    let leader = poll_until_within(
        "the stream has a leader",
        Duration::from_secs(30),
        || async {
            let mut stream = context.get_stream("ORDERED").await.ok()?;
            let info = stream.info().await.ok()?;
            info.cluster
                .as_ref()?
                .leader
                .clone()
                .filter(|name| !name.is_empty())
        },
        Option::is_some,
    )
    .await
    .unwrap_or_default();
    leader
        .trim_start_matches('n')
        .parse()
        .expect("a node name n0..n2")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_losing_a_node_mid_run_still_applies_every_event_exactly_once() {
    let mut cluster = NatsCluster::start();
    let urls = cluster.urls();
    let ports: Vec<u16> = cluster.ports.iter().map(|(client, _, _)| *client).collect();
    poll_until(
        "every node accepts clients",
        || {
            std::future::ready(
                ports
                    .iter()
                    .all(|port| std::net::TcpStream::connect(("127.0.0.1", *port)).is_ok()),
            )
        },
        |listening| *listening,
    )
    .await;
    let addresses: Vec<async_nats::ServerAddr> = urls
        .split(',')
        .map(|url| url.parse().expect("address"))
        .collect();
    let nats_client = async_nats::ConnectOptions::new()
        .max_reconnects(None)
        .connect(addresses)
        .await
        .expect("connect to the cluster");
    let context = jetstream::new(nats_client);
    // The stream B expects, with three replicas; retried until the cluster has a meta leader.
    let stream_config = StreamConfig {
        name: "ORDERED".to_owned(),
        subjects: vec!["ordered.*".to_owned()],
        storage: StorageType::File,
        duplicate_window: Duration::from_secs(120),
        num_replicas: 3,
        ..Default::default()
    };
    poll_until_within(
        "the cluster elects a leader and creates the stream with 3 replicas",
        Duration::from_secs(30),
        || async {
            context
                .get_or_create_stream(stream_config.clone())
                .await
                .is_ok()
        },
        |created| *created,
    )
    .await;

    let pair = Pair::start(&urls);
    let aggregates = aggregate_names("cl", 32);
    let mut relay = Relay::start(&pair.a.address, &urls, "one", &["--batch", "64"]);
    // The first half of every aggregate before the node is lost, the second half only after:
    // the loss is mid-run by construction, however fast the relay and B are on a loaded
    // machine.
    write_sequences(&pair.a.address, &aggregates, 1..=25).await;
    applied_at_b(&pair.b_database, 200, Duration::from_secs(30)).await;
    // Kill the stream's leader: the hardest node to lose. Under load an election may be under
    // way, with no leader for a moment: wait until one is named.
    let victim = stream_leader(&context).await;
    cluster.kill(victim);
    assert!(
        applied_rows(&pair.b_database) < 1600,
        "the node was lost mid-run"
    );

    write_sequences(&pair.a.address, &aggregates, 26..=50).await;
    // A's outbox and the relay's last give-up beside B's rows, so that a stall names its hop:
    // the relay's (events pending) or B's consumer's (all sent, fewer applied).
    poll_until_within(
        "B applied 1600 events (B's applied rows, A's outbox pending and sent, the relay's last give-up)",
        Duration::from_secs(90),
        || async {
            let applied = applied_rows(&pair.b_database);
            let said = relay.stderr_text();
            let given_up = said.lines().rfind(|line| line.contains("stay pending"));
            let given_up = given_up.unwrap_or_default().to_owned();
            (applied, outbox_counts(&pair.a.address).await, given_up)
        },
        |(applied, _, _)| *applied >= 1600,
    )
    .await;
    poll_until_within(
        "A's outbox all sent",
        Duration::from_secs(30),
        || outbox_counts(&pair.a.address),
        |counts| *counts == (0, 1600),
    )
    .await;
    assert_applied_once(&pair.b_database, &aggregates, 50);

    // The node comes back and catches up: its own store holds every message.
    cluster.restart(victim);
    let jsz = poll_until_within(
        "the restarted node caught up with the stream",
        Duration::from_secs(30),
        || cluster.jsz(victim),
        |jsz| {
            jsz.as_ref()
                .is_some_and(|jsz| jsz["messages"].as_u64() == Some(1600))
        },
    )
    .await;
    assert_eq!(jsz.as_ref().map(|j| j["streams"].clone()), Some(json!(1)));
    relay.signal("TERM");
    let (code, report) = relay.finish(Duration::from_secs(10)).await;
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(figure(&report, "acked"), 1600, "{report}");
}
