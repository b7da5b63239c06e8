//! The NATS JetStream door against a real `nats-server` (Debian package `nats-server`): each test
//! starts a private server (`-js -a 127.0.0.1 -p -1`, its own store directory, the port read from
//! its ports file, a config file when the test needs subject mappings) and stops it at the end.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;
use lab_testkit::bench::amount;
use lab_testkit::nats::{NatsServer, partition_config};
use ordered_inbox::OrderedMessage;
use production_lab::broker::{BrokerConfig, loopback_config, wire};
use serde_json::{Value, json};

use crate::helpers::{
    Backend, ServerProcess, TestApp, client, command, poll_until, poll_until_within, settings_dir,
    spawn_app_on_with, spawn_app_with, status_and_json,
};
use crate::producers::{add_producer, epoch, producer_command};

/// A private nats-server; a missing binary fails the test with the Debian package's name.
pub(crate) fn start_nats(config: Option<&str>) -> NatsServer {
    NatsServer::start(config).unwrap_or_else(|error| panic!("{error}"))
}

pub(crate) async fn jetstream_of(nats: &NatsServer) -> jetstream::Context {
    jetstream::new(nats.connect().await.expect("connect to nats-server"))
}

/// Publishes `body` on `subject` with `headers` and waits for its PubAck.
pub(crate) async fn publish_acked(
    js: &jetstream::Context,
    subject: String,
    headers: async_nats::HeaderMap,
    body: String,
) -> jetstream::publish::PublishAck {
    js.publish_with_headers(subject, headers, body.into())
        .await
        .expect("publish")
        .await
        .expect("PubAck")
}

/// One ordered message on the broker door's wire format, sent as `producer` (`None`:
/// anonymous): its subject, its headers (`Nats-Msg-Id`, and a producer's token and epoch) and
/// its JSON body.
fn on_wire(
    producer: As<'_>,
    aggregate: &str,
    message_id: &str,
    sequence: i64,
    amount: i64,
) -> (String, async_nats::HeaderMap, String) {
    let mut headers = async_nats::HeaderMap::new();
    let name = producer.map(|(name, _, _)| name);
    headers.insert(
        wire::MESSAGE_ID_HEADER,
        wire::nats_message_id(name, message_id).as_str(),
    );
    if let Some((_, token, epoch)) = producer {
        headers.insert(
            wire::AUTHORIZATION_HEADER,
            format!("Bearer {token}").as_str(),
        );
        headers.insert(wire::PRODUCER_EPOCH_HEADER, epoch.to_string().as_str());
    }
    let body = json!({"messageId": message_id, "sequence": sequence, "amount": amount});
    (
        wire::subject_for("ordered", aggregate),
        headers,
        body.to_string(),
    )
}

/// Publishes one ordered message as `producer` (`None`: anonymous) and waits for its PubAck.
pub(crate) async fn publish_ordered(
    js: &jetstream::Context,
    producer: As<'_>,
    aggregate: &str,
    message_id: &str,
    sequence: i64,
    amount: i64,
) -> jetstream::publish::PublishAck {
    let (subject, headers, body) = on_wire(producer, aggregate, message_id, sequence, amount);
    publish_acked(js, subject, headers, body).await
}

fn message(aggregate: &str, sequence: i64, amount: i64) -> OrderedMessage {
    lab_testkit::bench::ledger_message(aggregate, sequence, amount)
}

/// Publishes one anonymous message on the wire format and waits for its PubAck.
async fn publish(
    js: &jetstream::Context,
    message: &OrderedMessage,
) -> jetstream::publish::PublishAck {
    publish_ordered(
        js,
        None,
        &message.aggregate_id,
        &message.message_id,
        message.sequence,
        amount(message),
    )
    .await
}

async fn publish_raw(
    js: &jetstream::Context,
    subject: &str,
    header_id: Option<&str>,
    body: String,
) -> jetstream::publish::PublishAck {
    let mut headers = async_nats::HeaderMap::new();
    if let Some(id) = header_id {
        headers.insert(wire::MESSAGE_ID_HEADER, id);
    }
    publish_acked(js, subject.to_owned(), headers, body).await
}

/// Publishes all, each awaited for its PubAck concurrently (in windows of 512).
async fn publish_all(js: &jetstream::Context, messages: &[OrderedMessage]) -> usize {
    let mut duplicates = 0;
    for window in messages.chunks(512) {
        let mut acks = Vec::with_capacity(window.len());
        for message in window {
            let (subject, headers, body) = on_wire(
                None,
                &message.aggregate_id,
                &message.message_id,
                message.sequence,
                amount(message),
            );
            acks.push(
                js.publish_with_headers(subject, headers, body.into())
                    .await
                    .expect("publish"),
            );
        }
        for ack in acks {
            if ack.await.expect("PubAck").duplicate {
                duplicates += 1;
            }
        }
    }
    duplicates
}

/// A deterministic shuffle (xorshift), so a failure can be replayed.
fn shuffle<T>(items: &mut [T], mut seed: u64) {
    for i in (1..items.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        items.swap(i, (seed % (i as u64 + 1)) as usize);
    }
}

/// `aggregates` × `per` messages (amount = sequence % 5 + 1), every aggregate out of order.
fn shuffled_workload(prefix: &str, aggregates: usize, per: i64, seed: u64) -> Vec<OrderedMessage> {
    let mut all: Vec<OrderedMessage> = (0..aggregates)
        .flat_map(|a| (1..=per).map(move |s| message(&format!("{prefix}.{a}"), s, s % 5 + 1)))
        .collect();
    shuffle(&mut all, seed);
    all
}

fn expected_total(per: i64) -> i64 {
    (1..=per).map(|s| s % 5 + 1).sum()
}

/// A consumer on SQLite whose un-acked messages come again after 5 s, with `adjust` applied.
pub(crate) async fn spawn_consumer(
    nats: &NatsServer,
    adjust: impl FnOnce(&mut BrokerConfig),
) -> TestApp {
    let mut broker = loopback_config(&nats.url).unwrap();
    broker.ack_wait = Duration::from_secs(5);
    adjust(&mut broker);
    spawn_app_with(move |config| config.nats = Some(broker)).await
}

async fn broker_status(app_url: &str) -> Value {
    let response = client()
        .get(format!("{app_url}/broker"))
        .send()
        .await
        .expect("GET /broker");
    let (status, body) = status_and_json(response).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// Waits until the consumer has nothing pending and nothing un-acked.
async fn drained_consumer(app_url: &str, timeout: Duration) -> Value {
    poll_until_within(
        "the consumer has nothing pending",
        timeout,
        || broker_status(app_url),
        |status| status["consumer"]["pending"] == 0 && status["consumer"]["ackPending"] == 0,
    )
    .await
}

/// `aggregate_id → (last, total, applied rows, held rows)` of one database.
fn aggregates_in(database: &Path) -> BTreeMap<String, (i64, i64, i64, i64)> {
    let db = rusqlite::Connection::open(database).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    let mut statement = db
        .prepare(
            "SELECT a.aggregate_id, a.last_sequence, a.total,
                    (SELECT COUNT(*) FROM ordered_inbox i WHERE i.aggregate_id = a.aggregate_id),
                    (SELECT COUNT(*) FROM held_messages h WHERE h.aggregate_id = a.aggregate_id)
               FROM aggregate_state a",
        )
        .unwrap();
    statement
        .query_map([], |row| {
            Ok((
                row.get(0)?,
                (row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?),
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

fn applied_rows(database: &Path) -> i64 {
    let db = rusqlite::Connection::open(database).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    db.query_row("SELECT COUNT(*) FROM ordered_inbox", [], |row| row.get(0))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shuffled_duplicated_deliveries_apply_exactly_once_and_in_order() {
    const AGGREGATES: usize = 64;
    const PER: i64 = 200;
    let nats = start_nats(None);
    let app = spawn_consumer(&nats, |_| {}).await;
    let js = jetstream_of(&nats).await;
    let mut messages = shuffled_workload("acct", AGGREGATES, PER, 0x5eed);
    // Some published twice: JetStream's duplicate window drops the second copy.
    let again: Vec<OrderedMessage> = messages.iter().step_by(97).cloned().collect();
    messages.extend(again.iter().cloned());
    let duplicates = publish_all(&js, &messages).await;
    assert_eq!(
        duplicates,
        again.len(),
        "the broker dropped every re-publish"
    );

    let total = AGGREGATES as i64 * PER;
    poll_until_within(
        "every message applied",
        Duration::from_secs(240),
        || async { applied_rows(&app.database) },
        |rows| *rows == total,
    )
    .await;
    let state = aggregates_in(&app.database);
    assert_eq!(state.len(), AGGREGATES);
    for (aggregate, figures) in &state {
        assert_eq!(
            *figures,
            (PER, expected_total(PER), PER, 0),
            "{aggregate}: last, total, applied rows, held rows"
        );
    }
    // Applied in order: within each aggregate, the rows were inserted in sequence order.
    let out_of_order = app.scalar(
        "SELECT COUNT(*) FROM ordered_inbox a JOIN ordered_inbox b
           ON a.aggregate_id = b.aggregate_id AND a.sequence < b.sequence AND a.rowid > b.rowid",
    );
    assert_eq!(
        out_of_order, 0,
        "an aggregate applied a later sequence first"
    );
    let status = drained_consumer(&app.address, Duration::from_secs(30)).await;
    let outcomes = &status["counters"]["outcomes"];
    // Each delivery applied at once or was held (and applied when it drained); nothing else.
    let held = outcomes["held"].as_i64().unwrap_or(0);
    assert!(held > 0, "{status}");
    assert_eq!(
        outcomes["applied"].as_i64().unwrap_or(0) + held,
        total,
        "{status}"
    );
    assert_eq!(outcomes.as_object().map(|o| o.len()), Some(2), "{status}");
    assert_eq!(status["counters"]["acked"], total, "{status}");
    assert!(app.scalar("SELECT COUNT(*) FROM aggregate_timeline WHERE kind = 'drained'") > 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_commit_and_ack_is_redelivered_and_answers_replay() {
    let nats = start_nats(None);
    let (dir, settings) = settings_dir();
    let database = dir.path().join("lab.db");
    let args = ["--nats", &nats.url, "--nats-ack-wait-ms", "1000"];
    let server = ServerProcess::start(&database, &settings, &args);
    let js = jetstream_of(&nats).await;
    publish(&js, &message("k", 1, 5)).await;
    poll_until(
        "the first message applied and acked",
        || broker_status(&server.address),
        |status| status["counters"]["acked"] == 1,
    )
    .await;
    let armed = client()
        .post(server.url("/lab/broker/pause-after-commit"))
        .send()
        .await
        .unwrap();
    assert_eq!(armed.status(), 204);
    publish(&js, &message("k", 2, 7)).await;
    poll_until(
        "the consumer paused after its COMMIT",
        || broker_status(&server.address),
        |status| status["counters"]["pausedAfterCommit"] == true,
    )
    .await;
    assert_eq!(
        aggregates_in(&database)["k"],
        (2, 12, 2, 0),
        "committed before the kill"
    );
    server.signal("KILL");
    drop(server);

    let server = ServerProcess::start(&database, &settings, &args);
    let status = poll_until(
        "the un-acked message redelivered, answered replay and acked",
        || broker_status(&server.address),
        |status| status["counters"]["outcomes"]["replay"] == 1 && status["counters"]["acked"] == 1,
    )
    .await;
    assert_eq!(
        status["counters"]["outcomes"]["applied"],
        Value::Null,
        "{status}"
    );
    drained_consumer(&server.address, Duration::from_secs(10)).await;
    assert_eq!(
        aggregates_in(&database)["k"],
        (2, 12, 2, 0),
        "the effect happened once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_batch_in_hand_and_exits_zero() {
    let nats = start_nats(None);
    let (dir, settings) = settings_dir();
    let database = dir.path().join("lab.db");
    let args = [
        "--nats",
        &nats.url,
        "--nats-ack-wait-ms",
        "2000",
        "--nats-batch",
        "16",
    ];
    let mut server = ServerProcess::start(&database, &settings, &args);
    let js = jetstream_of(&nats).await;
    let messages = shuffled_workload("t", 4, 100, 7);
    publish_all(&js, &messages).await;
    poll_until(
        "some messages applied",
        || async { applied_rows(&database) },
        |rows| *rows > 0,
    )
    .await;
    server.signal("TERM");
    let exit = server.exit_status().await;
    assert!(exit.success(), "exit status {exit}");
    drop(server);

    let server = ServerProcess::start(&database, &settings, &args);
    poll_until_within(
        "the next run finishes the stream",
        Duration::from_secs(60),
        || async { applied_rows(&database) },
        |rows| *rows == 400,
    )
    .await;
    drained_consumer(&server.address, Duration::from_secs(20)).await;
    for figures in aggregates_in(&database).values() {
        assert_eq!(*figures, (100, expected_total(100), 100, 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_reconnects_after_the_nats_server_restarts() {
    let mut nats = start_nats(None);
    let app = spawn_consumer(&nats, |config| config.ack_wait = Duration::from_secs(2)).await;
    let messages = shuffled_workload("r", 8, 100, 11);
    let (first, second) = messages.split_at(messages.len() / 2);
    publish_all(&jetstream_of(&nats).await, first).await;
    poll_until(
        "the consumer started on the first half",
        || async { applied_rows(&app.database) },
        |rows| *rows > 0,
    )
    .await;
    nats.restart().expect("nats-server restarts");
    publish_all(&jetstream_of(&nats).await, second).await;
    poll_until_within(
        "every message applied after the restart",
        Duration::from_secs(90),
        || async { applied_rows(&app.database) },
        |rows| *rows == 800,
    )
    .await;
    drained_consumer(&app.address, Duration::from_secs(30)).await;
    for figures in aggregates_in(&app.database).values() {
        assert_eq!(*figures, (100, expected_total(100), 100, 0));
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_blocks_its_aggregate_with_successors_held_until_a_skip_drains_them() {
    let nats = start_nats(None);
    let app = spawn_consumer(&nats, |_| {}).await;
    let js = jetstream_of(&nats).await;
    let mut messages = shuffled_workload("ok", 4, 20, 3);
    let poisoned: Vec<OrderedMessage> = (1..=8)
        .map(|s| message("p.1", s, if s == 4 { -1 } else { s }))
        .collect();
    messages.extend(poisoned.iter().rev().cloned());
    shuffle(&mut messages, 99);
    publish_all(&js, &messages).await;
    poll_until_within(
        "the healthy aggregates finished",
        Duration::from_secs(60),
        || async { applied_rows(&app.database) },
        |rows| *rows == 80 + 3,
    )
    .await;
    drained_consumer(&app.address, Duration::from_secs(20)).await;
    let (status, view) = status_and_json(app.get("/aggregates/p.1").await).await;
    assert_eq!(status, 200);
    assert_eq!(view["status"], "blocked", "{view}");
    assert_eq!(view["last"], 3);
    assert_eq!(view["heldSequences"], json!([5, 6, 7, 8]), "{view}");
    let (_, blocked) = status_and_json(app.get("/aggregates?status=blocked").await).await;
    assert_eq!(blocked["aggregates"][0]["held"], 4, "{blocked}");

    let token = ordered_inbox::sqlite::operators::add(&app.database, "alice").unwrap();
    let skip = app
        .client
        .post(app.url("/deadletters/p.1-4/resolution"))
        .bearer_auth(&token)
        .json(&json!({"action": "skip", "expectedLast": 3, "reason": "cancelled upstream"}))
        .send()
        .await
        .unwrap();
    let (status, body) = status_and_json(skip).await;
    assert_eq!(status, 200, "{body}");
    let (_, view) = status_and_json(app.get("/aggregates/p.1").await).await;
    assert_eq!(
        (
            view["status"].clone(),
            view["last"].clone(),
            view["total"].clone()
        ),
        (json!("flowing"), json!(8), json!(1 + 2 + 3 + 5 + 6 + 7 + 8)),
        "{view}"
    );
    assert_eq!(view["heldSequences"], json!([]));
    let drained = app.rows(
        "SELECT sequence FROM aggregate_timeline
          WHERE aggregate_id = 'p.1' AND kind = 'drained'
            AND id > (SELECT id FROM aggregate_timeline WHERE aggregate_id = 'p.1' AND kind = 'skipped')
          ORDER BY id",
        |row| row.get::<_, i64>(0),
    );
    assert_eq!(drained, [5, 6, 7, 8], "drained in order after the skip");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_deliveries_are_terminated_listed_and_never_stop_the_consumer() {
    let nats = start_nats(None);
    let app = spawn_consumer(&nats, |_| {}).await;
    let js = jetstream_of(&nats).await;
    let good = |id: &str, sequence: i64| {
        json!({"messageId": id, "sequence": sequence, "amount": 1}).to_string()
    };
    publish_raw(&js, "ordered.m", Some("m-1"), "{\"messageId\":".to_owned()).await;
    publish_raw(&js, "ordered.m", Some("m-2"), good("other-id", 1)).await;
    publish_raw(
        &js,
        "ordered.m",
        Some("m-3"),
        json!({"messageId": "m-3"}).to_string(),
    )
    .await;
    publish_raw(&js, "ordered.m%zz", Some("m-4"), good("m-4", 1)).await;
    publish_raw(&js, "ordered.m", None, good("m-5", 1)).await;
    publish_raw(&js, "ordered.m", Some("ok-1"), good("ok-1", 1)).await;
    // A stale sequence and a payload conflict are terminated too.
    publish_raw(&js, "ordered.m", Some("late-1"), good("late-1", 1)).await;
    let (status, _) = status_and_json(
        app.post_json(
            "/aggregates/n/messages",
            &json!({"messageId": "c-1", "sequence": 1, "amount": 1}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 200);
    publish_raw(
        &js,
        "ordered.n",
        Some("c-1"),
        json!({"messageId": "c-1", "sequence": 1, "amount": 2}).to_string(),
    )
    .await;
    publish_raw(&js, "ordered.m", Some("ok-2"), good("ok-2", 2)).await;

    let listed = poll_until(
        "the rejected deliveries listed",
        || async {
            let (_, body) = status_and_json(app.get("/broker/rejected").await).await;
            body["rejected"].as_array().cloned().unwrap_or_default()
        },
        |rejected| rejected.len() == 7,
    )
    .await;
    let outcomes: HashMap<String, usize> = listed.iter().fold(HashMap::new(), |mut counts, r| {
        *counts
            .entry(r["outcome"].as_str().unwrap_or("").to_owned())
            .or_default() += 1;
        counts
    });
    assert_eq!(outcomes["malformed"], 5, "{listed:?}");
    assert_eq!(outcomes["stale"], 1, "{listed:?}");
    assert_eq!(outcomes["payload conflict"], 1, "{listed:?}");
    assert!(
        listed
            .iter()
            .all(|r| r["reason"].as_str().is_some_and(|s| !s.is_empty()))
    );
    let undecodable = listed
        .iter()
        .find(|r| r["subject"] == "ordered.m%zz")
        .expect("the undecodable subject is listed");
    assert_eq!(undecodable["aggregateId"], Value::Null);
    let status = drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(status["counters"]["terminated"], 7, "{status}");
    let (_, view) = status_and_json(app.get("/aggregates/m").await).await;
    assert_eq!(
        (view["last"].clone(), view["total"].clone()),
        (json!(2), json!(2))
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_two_partitions_apply_every_message_once_between_them() {
    let nats = start_nats(Some(&partition_config("ordered", 2)));
    let apps = [
        spawn_consumer(&nats, |c| {
            c.partitions = 2;
            c.partition = 0;
        })
        .await,
        spawn_consumer(&nats, |c| {
            c.partitions = 2;
            c.partition = 1;
        })
        .await,
    ];
    let messages = shuffled_workload("part", 16, 30, 5);
    publish_all(&jetstream_of(&nats).await, &messages).await;
    poll_until_within(
        "every message applied by one partition or the other",
        Duration::from_secs(60),
        || async {
            apps.iter()
                .map(|app| applied_rows(&app.database))
                .sum::<i64>()
        },
        |rows| *rows == 16 * 30,
    )
    .await;
    let [zero, one] = &apps;
    let first = aggregates_in(&zero.database);
    let second = aggregates_in(&one.database);
    assert!(
        !first.is_empty() && !second.is_empty(),
        "both partitions got work"
    );
    assert_eq!(first.len() + second.len(), 16);
    for (aggregate, figures) in first.iter().chain(second.iter()) {
        assert_eq!(*figures, (30, expected_total(30), 30, 0), "{aggregate}");
    }
    assert!(
        first
            .keys()
            .all(|aggregate| !second.contains_key(aggregate)),
        "an aggregate appears in both databases"
    );
    for app in &apps {
        drained_consumer(&app.address, Duration::from_secs(10)).await;
    }
    for app in apps {
        app.stop().await;
    }
}

#[test]
fn a_nats_url_off_loopback_is_refused_at_start_with_one_line() {
    let (_dir, settings) = settings_dir();
    let output = crate::helpers::command()
        .args([
            "serve",
            "--environment",
            "Development",
            "--urls",
            "http://127.0.0.1:0",
        ])
        .arg("--settings")
        .arg(&settings)
        .args(["--nats", "nats://10.1.2.3:4222"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("loopback"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_hold_limit_messages_wait_in_the_consumer_and_apply_in_order_once_their_aggregate_moves()
 {
    let nats = start_nats(None);
    let mut broker = loopback_config(&nats.url).unwrap();
    // Parked messages outlive several ack waits: progress acks keep them from redelivery.
    broker.ack_wait = Duration::from_secs(1);
    broker.nak_delay = Duration::from_millis(200);
    let app = spawn_app_with(move |config| {
        config.nats = Some(broker);
        config.max_held_per_aggregate = 2;
    })
    .await;
    let js = jetstream_of(&nats).await;
    for sequence in (2..=41).rev() {
        publish(&js, &message("flood", sequence, 1)).await;
    }
    publish(&js, &message("other", 1, 7)).await;
    aggregate_at(&app, "other", 1).await;
    // 38 over the limit, tried again after 0.2 s, 0.4 s, 0.8 s and 1.6 s without their
    // aggregate moving: three seconds parked, three ack waits.
    let status = poll_until_within(
        "the flood's early messages tried again while their aggregate does not move",
        Duration::from_secs(20),
        || broker_status(&app.address),
        |status| {
            status["counters"]["outcomes"]["hold full"]
                .as_i64()
                .unwrap_or(0)
                >= 38 * 5
        },
    )
    .await;
    assert_eq!(status["counters"]["outcomes"]["held"], 2, "{status}");
    assert_eq!(status["counters"]["nakd"], 0, "{status}");
    let (_, view) = status_and_json(app.get("/aggregates/flood").await).await;
    assert_eq!(view["heldSequences"], json!([40, 41]), "{view}");
    // Fetched after the aggregate answered hold full: parked without asking the inbox.
    for sequence in 42..=45 {
        publish(&js, &message("flood", sequence, 1)).await;
    }

    publish(&js, &message("flood", 1, 1)).await;
    aggregate_at(&app, "flood", 45).await;
    let status = drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(status["counters"]["nakd"], 0, "{status}");
    let consumer_info = js
        .get_stream("ORDERED")
        .await
        .expect("the stream")
        .consumer_info(loopback_config(&nats.url).unwrap().durable_name())
        .await
        .expect("the consumer");
    assert_eq!(consumer_info.num_redelivered, 0, "{consumer_info:?}");
    let applied = app.inbox_rows(
        // A rowid table: rows in the order they were inserted, i.e. applied.
        "SELECT sequence FROM ordered_inbox WHERE aggregate_id = 'flood' ORDER BY rowid",
    );
    let in_order: Vec<String> = (1..=45).map(|sequence| sequence.to_string()).collect();
    assert_eq!(applied, in_order);
    assert_eq!(aggregates_in(&app.database)["flood"], (45, 45, 45, 0));
    app.stop().await;
}

// Producers on the broker door: a message may carry `Authorization: Bearer TOKEN` and
// `Producer-Epoch: N`; it is then checked as a general-door delivery is (epoch, ownership, its
// producer's id namespace) in the transaction that writes it, and a refusal is terminated.

/// Who publishes: a producer's name (for its `Nats-Msg-Id`), token and epoch.
pub(crate) type As<'a> = Option<(&'a str, &'a str, i64)>;

/// A producer registered with the inbox and holding a session: what its broker messages carry.
struct ProducerSession {
    name: &'static str,
    token: String,
    epoch: i64,
}

impl ProducerSession {
    async fn start(app: &TestApp, name: &'static str) -> ProducerSession {
        let token = add_producer(app, name);
        let epoch = epoch(app, &token).await;
        ProducerSession { name, token, epoch }
    }

    fn on_wire(&self) -> As<'_> {
        Some((self.name, self.token.as_str(), self.epoch))
    }
}

/// Publishes one message of amount 1 as `producer` (`None`: anonymous) and waits for its
/// PubAck.
async fn publish_as(
    js: &jetstream::Context,
    producer: As<'_>,
    aggregate: &str,
    message_id: &str,
    sequence: i64,
) -> jetstream::publish::PublishAck {
    publish_ordered(js, producer, aggregate, message_id, sequence, 1).await
}

/// Settings whose messages come back quickly: an un-acked one after 5 s, a nak'd one (a ledger
/// failure) or a parked one (a full hold) without a sign of movement after 50 ms.
pub(crate) fn quick_redelivery(nats: &NatsServer) -> BrokerConfig {
    let mut broker = loopback_config(&nats.url).expect("a loopback NATS URL");
    broker.ack_wait = Duration::from_secs(5);
    broker.nak_delay = Duration::from_millis(50);
    broker
}

/// A consumer on `backend` with [`quick_redelivery`].
pub(crate) async fn spawn_consumer_on(nats: &NatsServer, backend: Backend) -> TestApp {
    let broker = quick_redelivery(nats);
    spawn_app_on_with(backend, move |config| config.nats = Some(broker)).await
}

async fn rejected_list(app: &TestApp) -> Vec<Value> {
    let (_, body) = status_and_json(app.get("/broker/rejected").await).await;
    body["rejected"].as_array().cloned().unwrap_or_default()
}

/// Waits until `aggregate`'s last applied sequence is `last`, and answers its view.
async fn aggregate_at(app: &TestApp, aggregate: &str, last: i64) -> Value {
    poll_until(
        &format!("{aggregate} at sequence {last}"),
        || async { status_and_json(app.get(&format!("/aggregates/{aggregate}")).await).await },
        |(status, view)| *status == 200 && view["last"] == last,
    )
    .await
    .1
}

fn applied_by(app: &TestApp, aggregate: &str) -> Vec<String> {
    app.inbox_rows(&format!(
        "SELECT message_id, producer FROM ordered_inbox WHERE aggregate_id = '{aggregate}' ORDER BY sequence"
    ))
}

/// The value of one series in `GET /metrics` (0 when absent).
async fn metric(app: &TestApp, series: &str) -> f64 {
    let text = app
        .get("/metrics")
        .await
        .text()
        .await
        .expect("the metrics text");
    crate::operating::series(&text)
        .get(series)
        .copied()
        .unwrap_or(0.0)
}

async fn a_producers_broker_messages_claim_its_aggregate_and_apply_in_its_namespace(
    backend: Backend,
) {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, backend).await;
    let js = jetstream_of(&nats).await;
    let session = ProducerSession::start(&app, "billing").await;
    let billing = session.on_wire();

    publish_as(&js, billing, "acct", "m-1", 1).await;
    // Ahead of its turn: a producer's message is held in its namespace, under its epoch, and
    // drains as billing's right after m-2.
    publish_as(&js, billing, "acct", "m-3", 3).await;
    publish_as(&js, billing, "acct", "m-2", 2).await;
    let view = aggregate_at(&app, "acct", 3).await;
    assert_eq!(view["owner"], json!({"producer": "billing", "epoch": 1}));
    assert_eq!(view["heldCount"], 0, "{view}");
    assert_eq!(
        applied_by(&app, "acct"),
        ["m-1|billing", "m-2|billing", "m-3|billing"]
    );
    let (_, timeline) = status_and_json(app.get("/aggregates/acct/timeline").await).await;
    assert_eq!(timeline["events"][0]["kind"], "claimed", "{timeline}");
    let status = drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(status["counters"]["terminated"], 0, "{status}");
    // m-3 was decided before m-2 applied: held and acked, never nak'd.
    assert_eq!(status["counters"]["nakd"], 0, "{status}");
    assert_eq!(status["counters"]["outcomes"]["held"], 1, "{status}");
    let kinds: Vec<String> = timeline["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|event| {
            format!(
                "{} {}",
                event["kind"].as_str().unwrap_or(""),
                event["sequence"]
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "claimed 1",
            "applied 1",
            "held 3",
            "applied 2",
            "drained 3",
            "applied 3"
        ],
        "{timeline}"
    );
    assert!(rejected_list(&app).await.is_empty());
    app.stop().await;
}

async fn another_producers_and_anonymous_broker_messages_to_an_owned_aggregate_are_terminated(
    backend: Backend,
) {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, backend).await;
    let js = jetstream_of(&nats).await;
    let billing_session = ProducerSession::start(&app, "billing").await;
    let shipping_session = ProducerSession::start(&app, "shipping").await;
    let (billing, shipping) = (billing_session.on_wire(), shipping_session.on_wire());
    publish_as(&js, billing, "acct", "m-1", 1).await;
    aggregate_at(&app, "acct", 1).await;

    publish_as(&js, shipping, "acct", "s-2", 2).await;
    publish_as(&js, None, "acct", "x-2", 2).await;
    // Neither stops the owner's next message nor anybody's other aggregate.
    publish_as(&js, billing, "acct", "m-2", 2).await;
    publish_as(&js, None, "free", "f-1", 1).await;

    let rejected = poll_until(
        "two refusals listed",
        || rejected_list(&app),
        |list| list.len() == 2,
    )
    .await;
    let by_outcome = |outcome: &str| {
        rejected
            .iter()
            .find(|r| r["outcome"] == outcome)
            .unwrap_or_else(|| panic!("no '{outcome}' in {rejected:?}"))
            .clone()
    };
    let not_owner = by_outcome("not the owner");
    assert_eq!(
        (&not_owner["producer"], &not_owner["messageId"]),
        (&json!("shipping"), &json!("s-2"))
    );
    assert!(
        not_owner["reason"]
            .as_str()
            .is_some_and(|r| r.contains("'billing'")),
        "{not_owner}"
    );
    let anonymous = by_outcome("owner required");
    assert_eq!(anonymous["messageId"], "x-2");
    assert_eq!(anonymous.get("producer"), None, "{anonymous}");

    let view = aggregate_at(&app, "acct", 2).await;
    assert_eq!(view["heldCount"], 0, "a refusal is never held: {view}");
    assert_eq!(applied_by(&app, "acct"), ["m-1|billing", "m-2|billing"]);
    aggregate_at(&app, "free", 1).await;
    let status = drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(status["counters"]["terminated"], 2, "{status}");
    assert_eq!(
        status["counters"]["outcomes"]["not the owner"], 1,
        "{status}"
    );
    assert_eq!(
        metric(&app, r#"inbox_producer_refusals_total{reason="not_owner"}"#).await,
        1.0
    );
    assert_eq!(
        metric(
            &app,
            r#"inbox_producer_refusals_total{reason="owner_required"}"#
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &app,
            r#"inbox_deliveries_total{door="broker",verdict="refused"}"#
        )
        .await,
        2.0
    );
    app.stop().await;
}

async fn an_old_epoch_broker_message_after_a_new_session_is_fenced_and_never_applied(
    backend: Backend,
) {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, backend).await;
    let js = jetstream_of(&nats).await;
    let token = add_producer(&app, "billing");
    let old = Some(("billing", token.as_str(), epoch(&app, &token).await));
    publish_as(&js, old, "acct", "a-1", 1).await;
    aggregate_at(&app, "acct", 1).await;

    // Instance B starts; instance A keeps publishing what it believes comes next.
    let new = Some(("billing", token.as_str(), epoch(&app, &token).await));
    publish_as(&js, old, "acct", "a-2", 2).await;
    publish_as(&js, old, "acct", "a-3", 3).await;
    publish_as(&js, new, "acct", "b-2", 2).await;

    let rejected = poll_until(
        "both old-epoch messages fenced",
        || rejected_list(&app),
        |list| list.len() == 2,
    )
    .await;
    assert!(
        rejected.iter().all(|r| r["outcome"] == "fenced"
            && r["producer"] == "billing"
            && r["reason"]
                .as_str()
                .is_some_and(|reason| reason.contains("current epoch 2"))),
        "{rejected:?}"
    );
    aggregate_at(&app, "acct", 2).await;
    assert_eq!(applied_by(&app, "acct"), ["a-1|billing", "b-2|billing"]);
    let status = drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(status["counters"]["outcomes"]["fenced"], 2, "{status}");
    app.stop().await;
}

async fn the_same_message_id_from_two_producers_via_the_broker_applies_both(backend: Backend) {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, backend).await;
    let js = jetstream_of(&nats).await;
    let billing_session = ProducerSession::start(&app, "billing").await;
    let shipping_session = ProducerSession::start(&app, "shipping").await;
    let (billing, shipping) = (billing_session.on_wire(), shipping_session.on_wire());
    // Each producer's Nats-Msg-Id names it: JetStream's duplicate window keeps both.
    assert!(!publish_as(&js, billing, "acct-b", "m-1", 1).await.duplicate);
    assert!(
        !publish_as(&js, shipping, "acct-s", "m-1", 1)
            .await
            .duplicate
    );
    aggregate_at(&app, "acct-b", 1).await;
    aggregate_at(&app, "acct-s", 1).await;
    assert_eq!(applied_by(&app, "acct-b"), ["m-1|billing"]);
    assert_eq!(applied_by(&app, "acct-s"), ["m-1|shipping"]);
    // Each producer re-sending its own id is its own replay.
    assert!(publish_as(&js, billing, "acct-b", "m-1", 1).await.duplicate);
    let status = drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(status["counters"]["outcomes"]["applied"], 2, "{status}");
    assert_eq!(status["counters"]["terminated"], 0, "{status}");
    app.stop().await;
}

/// The ledger fails one message of a batch (a trigger of the test's refuses its write of `h`'s
/// total; `other`'s first message only inserts one): that message is nak'd with nothing of it
/// written, the rest of the batch applies, and the redelivery applies it once the ledger can.
async fn a_ledger_failure_is_nakd_and_applies_once_when_redelivered(backend: Backend) {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, backend).await;
    let js = jetstream_of(&nats).await;
    publish(&js, &message("h", 1, 4)).await;
    aggregate_at(&app, "h", 1).await;
    crate::ledger::close_the_ledger(&app);

    publish(&js, &message("h", 2, 3)).await;
    publish(&js, &message("other", 1, 5)).await;
    let status = poll_until(
        "the ledger's failure counted",
        || broker_status(&app.address),
        |status| {
            status["counters"]["outcomes"][production_lab::broker::HANDLER_FAILED]
                .as_i64()
                .unwrap_or(0)
                >= 1
        },
    )
    .await;
    assert!(
        status["counters"]["nakd"].as_i64().unwrap_or(0) >= 1,
        "{status}"
    );
    assert_eq!(aggregate_at(&app, "other", 1).await["total"], 5);
    let (_, held_up) = status_and_json(app.get("/aggregates/h").await).await;
    assert_eq!(
        (held_up["last"].clone(), held_up["total"].clone()),
        (json!(1), json!(4))
    );
    assert_eq!(applied_by(&app, "h"), ["h-1|"]);

    crate::ledger::reopen_the_ledger(&app);
    let view = aggregate_at(&app, "h", 2).await;
    assert_eq!(view["total"], 7, "{view}");
    drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(applied_by(&app, "h"), ["h-1|", "h-2|"]);
    app.stop().await;
}

crate::on_both_backends!(
    a_producers_broker_messages_claim_its_aggregate_and_apply_in_its_namespace,
    another_producers_and_anonymous_broker_messages_to_an_owned_aggregate_are_terminated,
    an_old_epoch_broker_message_after_a_new_session_is_fenced_and_never_applied,
    the_same_message_id_from_two_producers_via_the_broker_applies_both,
    a_ledger_failure_is_nakd_and_applies_once_when_redelivered,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tokens_and_malformed_producer_headers_are_terminated_with_their_reason() {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, Backend::Sqlite).await;
    let js = jetstream_of(&nats).await;
    let token = add_producer(&app, "billing");
    let current = epoch(&app, &token).await;
    let raw = |id: &str, headers: &[(&str, &str)]| {
        let mut map = async_nats::HeaderMap::new();
        map.insert(wire::MESSAGE_ID_HEADER, id);
        for (name, value) in headers {
            map.append(*name, *value);
        }
        let body = json!({"messageId": id.rsplit('/').next(), "sequence": 1, "amount": 1});
        (map, body.to_string())
    };
    let epoch_text = current.to_string();
    let bearer = format!("Bearer {token}");
    let cases = [
        // an unknown token
        raw(
            "nobody/u-1",
            &[
                ("Authorization", "Bearer not-a-token"),
                ("Producer-Epoch", "1"),
            ],
        ),
        // an epoch without a token
        raw("e-1", &[("Producer-Epoch", "1")]),
        // a token without an epoch
        raw("billing/t-1", &[("Authorization", &bearer)]),
        // two epochs
        raw(
            "billing/d-1",
            &[
                ("Authorization", &bearer),
                ("Producer-Epoch", &epoch_text),
                ("Producer-Epoch", &epoch_text),
            ],
        ),
        // a producer's message under its bare id (it would share JetStream's window)
        raw(
            "b-1",
            &[("authorization", &bearer), ("producer-epoch", &epoch_text)],
        ),
    ];
    for (headers, body) in cases {
        publish_acked(&js, "ordered.h".to_owned(), headers, body).await;
    }
    let rejected = poll_until(
        "five refusals listed",
        || rejected_list(&app),
        |list| list.len() == 5,
    )
    .await;
    let outcomes: Vec<&str> = rejected
        .iter()
        .map(|r| r["outcome"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        outcomes,
        [
            "unauthorized",
            "malformed",
            "malformed",
            "malformed",
            "malformed"
        ],
        "{rejected:?}"
    );
    assert!(
        rejected.iter().all(|r| r["reason"]
            .as_str()
            .is_some_and(|reason| !reason.is_empty() && !reason.contains(&token))),
        "{rejected:?}"
    );
    assert_eq!(rejected[4]["producer"], "billing", "{rejected:?}");
    assert_eq!(applied_rows(&app.database), 0);
    assert_eq!(
        metric(&app, r#"inbox_producer_refusals_total{reason="revoked"}"#).await,
        1.0
    );
    assert_eq!(
        metric(
            &app,
            r#"inbox_producer_refusals_total{reason="malformed_headers"}"#
        )
        .await,
        3.0,
        "the bare Nats-Msg-Id is a malformed message, not malformed headers"
    );
    // A revoked producer's token is no active producer's any more.
    let revoked = producer_command(&["revoke", "billing"], &app);
    assert!(revoked.status.success());
    publish_as(&js, Some(("billing", &token, current)), "h", "r-1", 1).await;
    poll_until(
        "the revoked producer's message refused",
        || rejected_list(&app),
        |list| list.len() == 6,
    )
    .await;
    let status = drained_consumer(&app.address, Duration::from_secs(10)).await;
    assert_eq!(status["counters"]["terminated"], 6, "{status}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publish_command_sends_a_producers_headers_with_the_token_from_the_environment() {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, Backend::Sqlite).await;
    let token = add_producer(&app, "billing");
    let current = epoch(&app, &token).await.to_string();
    let publish = |token: Option<&str>| {
        let mut publish = command();
        publish.args([
            "publish",
            "--nats",
            &nats.url,
            "--producer",
            "billing",
            "--epoch",
            &current,
            "cli",
            "m-1",
            "1",
            "5",
        ]);
        publish.env_remove("PRODUCTION_LAB_PRODUCER_TOKEN");
        if let Some(token) = token {
            publish.env("PRODUCTION_LAB_PRODUCER_TOKEN", token);
        }
        publish.output().expect("run publish")
    };
    let without = publish(None);
    assert!(!without.status.success());
    assert!(
        String::from_utf8_lossy(&without.stderr).contains("PRODUCTION_LAB_PRODUCER_TOKEN"),
        "{}",
        String::from_utf8_lossy(&without.stderr)
    );
    let with = publish(Some(&token));
    assert!(
        with.status.success(),
        "{}",
        String::from_utf8_lossy(&with.stderr)
    );
    let view = aggregate_at(&app, "cli", 1).await;
    assert_eq!(view["owner"]["producer"], "billing", "{view}");
    assert_eq!(applied_by(&app, "cli"), ["m-1|billing"]);
    app.stop().await;
}
