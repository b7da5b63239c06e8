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
    let response = client
        .get(gate.url(path))
        .bearer_auth(token)
        .send()
        .await
        .expect("a gate answer");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
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
