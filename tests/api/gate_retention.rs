//! Retention through the gate, on both backends: published output and applied identities past
//! `[retention]` are pruned while the gate serves; a pruned id delivered again is stale and
//! applies nothing, the feed answers 410 for the pruned range, and the aggregate's position
//! never moves backwards.

use std::time::Duration;

use serde_json::Value;

use crate::aggregates::add_operator_on;
use crate::gate::{
    Certificate, GateFiles, GateProcess, add_operator, add_producer, deliver_until_decided,
    messages_of,
};
use crate::helpers::poll_until_within;
use crate::https::HttpsClient;

/// A short retention and a fast pruner, appended to the test's config.
const SHORT_RETENTION: &str = "
[retention]
identities = \"1s\"
output = \"1s\"
interval_ms = 100
batch = 3
";

fn with_short_retention(files: GateFiles) -> GateFiles {
    let text = std::fs::read_to_string(files.config()).unwrap();
    files.write("gate.toml", &format!("{text}{SHORT_RETENTION}"));
    files
}

/// `GET path` as `token`: the status and the JSON body.
async fn get(client: &HttpsClient, gate: &GateProcess, token: &str, path: &str) -> (u16, Value) {
    send(client, gate, token, (reqwest::Method::GET, path), None).await
}

async fn pruned_ids_answer_stale_and_the_feed_answers_410_for_the_pruned_range(
    gate: GateProcess,
    operator: String,
    client: HttpsClient,
) {
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let messages = messages_of("order-1", 5);
    for message in &messages[..4] {
        assert_eq!(
            deliver_until_decided(&client, &gate.address, &producer, message).await,
            200
        );
    }
    // Once published and a second old, all four output rows go, the oldest first.
    let (_, gone) = poll_until_within(
        "the feed's first retained sequence passes the four applied",
        Duration::from_secs(60),
        || {
            get(
                &client,
                &gate,
                &operator,
                "/v1/aggregates/order-1/applied?after=0",
            )
        },
        |(status, body)| *status == 410 && body["firstRetained"] == 5,
    )
    .await;
    assert_eq!(gone["after"], 0);
    let (status, _) = get(
        &client,
        &gate,
        &operator,
        "/v1/aggregates/order-1/applied?after=3",
    )
    .await;
    assert_eq!(
        status, 410,
        "after=3 lies before the first retained sequence"
    );
    let (status, feed) = get(
        &client,
        &gate,
        &operator,
        "/v1/aggregates/order-1/applied?after=4",
    )
    .await;
    assert_eq!(
        (status, feed["messages"].as_array().map(Vec::len)),
        (200, Some(0))
    );

    // The identity of the first message goes too (the pruner prunes both in each round): a
    // delivery of it is stale, never applied or a replay, and its position stays.
    let url = gate.url("/v1/aggregates/order-1/messages");
    let (status, answer) = poll_until_within(
        "message 1 answered stale",
        Duration::from_secs(60),
        || async {
            let response = client
                .post(&url)
                .bearer_auth(&producer.token)
                .header("Producer-Epoch", producer.epoch.to_string())
                .json(&serde_json::json!({
                    "messageId": messages[0].message_id,
                    "sequence": messages[0].sequence,
                    "type": messages[0].kind,
                    "payload": messages[0].payload,
                }))
                .send()
                .await
                .expect("an answer");
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        },
        |(status, _)| *status != 200,
    )
    .await;
    assert_eq!(status, 409, "{answer}");
    assert!(answer.to_lowercase().contains("stale"), "{answer}");

    // The position did not move backwards: the next sequence applies, and the feed carries it
    // after the pruned range with no gap.
    assert_eq!(
        deliver_until_decided(&client, &gate.address, &producer, &messages[4]).await,
        200
    );
    let (status, feed) = get(
        &client,
        &gate,
        &operator,
        "/v1/aggregates/order-1/applied?after=4",
    )
    .await;
    assert_eq!(status, 200);
    let sequences: Vec<i64> = feed["messages"]
        .as_array()
        .map(|messages| {
            messages
                .iter()
                .filter_map(|m| m["sequence"].as_i64())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(sequences, [5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_sqlite_pruned_ids_answer_stale_and_the_feed_answers_410_for_the_pruned_range() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = with_short_retention(GateFiles::new(&certificate, &nats));
    let gate = GateProcess::start(&files.config());
    let operator = add_operator(&files.database(), "alice");
    pruned_ids_answer_stale_and_the_feed_answers_410_for_the_pruned_range(
        gate,
        operator,
        certificate.client(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_pruned_ids_answer_stale_and_the_feed_answers_410_for_the_pruned_range() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = with_short_retention(GateFiles::new(&certificate, &nats).on_postgres());
    let database = crate::postgres::fresh_database();
    let gate = GateProcess::start_with_env(&files.config(), &[("GATE_DATABASE_URL", &database)]);
    let operator = add_operator_on(&["--inbox".into(), database.as_str().into()], "alice");
    pruned_ids_answer_stale_and_the_feed_answers_410_for_the_pruned_range(
        gate,
        operator,
        certificate.client(),
    )
    .await;
}

/// A retention that prunes every kind the inbox has: identities, closed dead letters, and the
/// timeline down to its newest event.
const PRUNE_EVERY_KIND: &str = "
[retention]
identities = \"1s\"
dead_letters = \"1s\"
timeline = 1
output = \"1s\"
interval_ms = 100
batch = 3
";

fn pruning_every_kind(files: GateFiles) -> GateFiles {
    let text = std::fs::read_to_string(files.config()).unwrap();
    files.write("gate.toml", &format!("{text}{PRUNE_EVERY_KIND}"));
    files
}

/// `method path` as `token`, with `body` if any: the status and the JSON answer.
async fn send(
    client: &HttpsClient,
    gate: &GateProcess,
    token: &str,
    (method, path): (reqwest::Method, &str),
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = client.request(method, gate.url(path)).bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("a gate answer");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// On `order-1` of `shop`: 1 applied, 2 quarantined and skipped, 3 skipped as a gap, 4 applied,
/// the aggregate given to `depot`, and `shop` revoked: every kind of audit row.
async fn leave_an_audit_trail(
    client: &HttpsClient,
    gate: &GateProcess,
    operator: &str,
    shop: &crate::gate::Producer,
) {
    let messages = messages_of("order-1", 4);
    assert_eq!(
        deliver_until_decided(client, &gate.address, shop, &messages[0]).await,
        200
    );
    let poison = crate::gate::Message {
        kind: "order.placed",
        payload: serde_json::json!({ "orderId": "order-1", "amount": -5 }),
        ..messages_of("order-1", 2).remove(1)
    };
    assert_eq!(
        deliver_until_decided(client, &gate.address, shop, &poison).await,
        422
    );
    let skip = serde_json::json!({ "action": "skip", "expectedLast": 1, "reason": "a test order" });
    let post = reqwest::Method::POST;
    let dead_letter = "/v1/deadletters/resolution?messageId=order-1-m2&producer=shop";
    let (status, body) = send(
        client,
        gate,
        operator,
        (post.clone(), dead_letter),
        Some(skip),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let gap = serde_json::json!({
        "action": "skip", "from": 3, "through": 3, "expectedLast": 2, "reason": "lost upstream"
    });
    let gaps = "/v1/aggregates/order-1/gaps/resolution";
    let (status, body) = send(client, gate, operator, (post.clone(), gaps), Some(gap)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        deliver_until_decided(client, &gate.address, shop, &messages[3]).await,
        200
    );
    let transfer = serde_json::json!({
        "producer": "depot", "expectedOwner": "shop", "expectedLast": 4, "reason": "moved"
    });
    let owner = "/v1/aggregates/order-1/owner";
    let (status, body) = send(client, gate, operator, (post, owner), Some(transfer)).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = send(
        client,
        gate,
        operator,
        (reqwest::Method::DELETE, "/v1/producers/shop"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

async fn the_audit_trail_is_intact_after_pruning(
    gate: GateProcess,
    operator: String,
    client: HttpsClient,
) {
    let shop = add_producer(&client, &gate, &operator, "shop").await;
    add_producer(&client, &gate, &operator, "depot").await;
    leave_an_audit_trail(&client, &gate, &operator, &shop).await;
    let named = "/v1/deadletter?messageId=order-1-m2&producer=shop";
    poll_until_within(
        "the resolved dead letter pruned",
        Duration::from_secs(60),
        || get(&client, &gate, &operator, named),
        |(status, _)| *status == 404,
    )
    .await;

    // Both resolutions stay, whole, in one numbered trail.
    let (status, trail) = get(&client, &gate, &operator, "/v1/resolutions").await;
    assert_eq!(status, 200, "{trail}");
    let rows = trail["resolutions"].as_array().cloned().unwrap_or_default();
    assert_eq!(rows.len(), 2, "{trail}");
    assert_eq!(rows[0]["messageId"], "order-1-m2", "{trail}");
    assert_eq!(rows[0]["operator"], "alice", "{trail}");
    assert_eq!(rows[0]["reason"], "a test order", "{trail}");
    assert_eq!(rows[1]["reason"], "lost upstream", "{trail}");
    // The same resolution request still answers the recorded one; another is refused.
    let skip = serde_json::json!({ "action": "skip", "expectedLast": 1, "reason": "a test order" });
    let dead_letter = "/v1/deadletters/resolution?messageId=order-1-m2&producer=shop";
    let post = (reqwest::Method::POST, dead_letter);
    let (status, repeat) = send(&client, &gate, &operator, post.clone(), Some(skip)).await;
    assert_eq!(status, 200, "{repeat}");
    let other = serde_json::json!({ "action": "skip", "expectedLast": 1, "reason": "another" });
    let (status, refused) = send(&client, &gate, &operator, post, Some(other)).await;
    assert_eq!(status, 409, "{refused}");

    // The timeline keeps the audit events and the resolved dead letter's quarantine.
    let (_, timeline) = get(&client, &gate, &operator, "/v1/aggregates/order-1/timeline").await;
    let kinds: Vec<&str> = timeline["events"]
        .as_array()
        .map(|events| events.iter().filter_map(|e| e["kind"].as_str()).collect())
        .unwrap_or_default();
    for kind in ["quarantined", "skipped", "gap skipped", "owner transferred"] {
        assert!(kinds.contains(&kind), "{kind} kept: {timeline}");
    }
    // The revoked producer is still listed as revoked, and the position is where it was.
    let (_, producers) = get(&client, &gate, &operator, "/v1/producers").await;
    let shop_row = producers["producers"]
        .as_array()
        .and_then(|rows| rows.iter().find(|row| row["name"] == "shop"))
        .cloned()
        .unwrap_or(Value::Null);
    assert!(shop_row["revokedAt"].is_string(), "{producers}");
    let (_, aggregate) = get(&client, &gate, &operator, "/v1/aggregates/order-1").await;
    assert_eq!(aggregate["last"], 4, "{aggregate}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_sqlite_the_audit_trail_is_intact_after_pruning() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = pruning_every_kind(GateFiles::new(&certificate, &nats));
    let gate = GateProcess::start(&files.config());
    let operator = add_operator(&files.database(), "alice");
    the_audit_trail_is_intact_after_pruning(gate, operator, certificate.client()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_the_audit_trail_is_intact_after_pruning() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = pruning_every_kind(GateFiles::new(&certificate, &nats).on_postgres());
    let database = crate::postgres::fresh_database();
    let gate = GateProcess::start_with_env(&files.config(), &[("GATE_DATABASE_URL", &database)]);
    let operator = add_operator_on(&["--inbox".into(), database.as_str().into()], "alice");
    the_audit_trail_is_intact_after_pruning(gate, operator, certificate.client()).await;
}

/// Sends `message` until the gate decides it: applied or a replay (200), or stale (409) once
/// its identity was pruned; a gap (409) is sent again. Any 5xx fails the test.
async fn deliver_through_pruning(
    client: &HttpsClient,
    gate: &str,
    producer: &crate::gate::Producer,
    message: &crate::gate::Message,
) -> u16 {
    let url = format!("{gate}/v1/aggregates/{}/messages", message.aggregate);
    let body = serde_json::json!({
        "messageId": message.message_id,
        "sequence": message.sequence,
        "type": message.kind,
        "payload": message.payload,
    });
    let (status, text) = poll_until_within(
        &format!("{} decided", message.message_id),
        Duration::from_secs(60),
        || async {
            let response = client
                .post(&url)
                .bearer_auth(&producer.token)
                .header("Producer-Epoch", producer.epoch.to_string())
                .json(&body)
                .send()
                .await
                .expect("an answer");
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        },
        |(status, text)| {
            *status >= 500 || *status == 200 || (*status == 409 && text.contains("stale"))
        },
    )
    .await;
    assert!(status < 500, "{}: {status} {text}", message.message_id);
    status
}

async fn concurrent_duplicated_deliveries_while_pruning_apply_each_message_once_in_order(
    gate: GateProcess,
    operator: String,
    client: HttpsClient,
    js: async_nats::jetstream::Context,
) {
    const AGGREGATES: usize = 4;
    const SEQUENCES: i64 = 30;
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let mut senders = tokio::task::JoinSet::new();
    // Two senders per aggregate, each in order: every message is delivered twice, concurrently,
    // while the pruner deletes identities and output rows in batches of three.
    for copy in 0..2 {
        for index in 0..AGGREGATES {
            let (client, address, producer) =
                (client.clone(), gate.address.clone(), producer.clone());
            senders.spawn(async move {
                let messages = messages_of(&format!("order-{index}"), SEQUENCES);
                let mut answers = Vec::new();
                for message in &messages {
                    let status =
                        deliver_through_pruning(&client, &address, &producer, message).await;
                    answers.push((copy, status));
                }
                answers
            });
        }
    }
    let mut applied_or_replayed = 0;
    while let Some(answers) = senders.join_next().await {
        let answers = answers.expect("a sender");
        applied_or_replayed += answers.iter().filter(|(_, s)| *s == 200).count();
    }
    let total = AGGREGATES as i64 * SEQUENCES;
    assert!(
        applied_or_replayed >= total as usize,
        "{applied_or_replayed}"
    );
    let expected: std::collections::BTreeMap<String, i64> = (0..AGGREGATES)
        .map(|index| (format!("order-{index}"), SEQUENCES))
        .collect();
    poll_until_within(
        "every message on the output stream",
        Duration::from_secs(60),
        || crate::gate::output_count(&js),
        |count| *count >= total as u64,
    )
    .await;
    let output = crate::gate::read_output(&js).await;
    crate::gate::assert_in_order_once(&output, &expected);
    for index in 0..AGGREGATES {
        let path = format!("/v1/aggregates/order-{index}");
        let (_, aggregate) = get(&client, &gate, &operator, &path).await;
        assert_eq!(aggregate["last"], SEQUENCES, "{aggregate}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_sqlite_concurrent_duplicated_deliveries_while_pruning_apply_each_message_once_in_order()
{
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = with_short_retention(GateFiles::new(&certificate, &nats));
    let gate = GateProcess::start(&files.config());
    let operator = add_operator(&files.database(), "alice");
    let js = crate::broker::jetstream_of(&nats).await;
    concurrent_duplicated_deliveries_while_pruning_apply_each_message_once_in_order(
        gate,
        operator,
        certificate.client(),
        js,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_concurrent_duplicated_deliveries_while_pruning_apply_each_message_once_in_order()
 {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = with_short_retention(GateFiles::new(&certificate, &nats).on_postgres());
    let database = crate::postgres::fresh_database();
    let gate = GateProcess::start_with_env(&files.config(), &[("GATE_DATABASE_URL", &database)]);
    let operator = add_operator_on(&["--inbox".into(), database.as_str().into()], "alice");
    let js = crate::broker::jetstream_of(&nats).await;
    concurrent_duplicated_deliveries_while_pruning_apply_each_message_once_in_order(
        gate,
        operator,
        certificate.client(),
        js,
    )
    .await;
}
