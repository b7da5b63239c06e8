//! The gate's bulk operations on open dead letters, end to end: producers over HTTPS and NATS,
//! a schema corrected and reloaded with SIGHUP, an operator's recheck (preview first) and bulk
//! skip over HTTPS, and a downstream consumer reading the output stream message by message.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::{Value, json};

use crate::aggregates::add_operator_on;
use crate::gate::{
    Certificate, GateFiles, GateProcess, Message, Producer, add_operator, add_producer,
    assert_in_order_once, output_count, publish, read_output,
};
use crate::helpers::poll_until_within;
use crate::https::HttpsClient;

/// `order.shipped` as the producers' old contract had it: no member besides these.
const STRICT_SHIPPED: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "carrier"],
  "properties": {
    "orderId": {"type": "string", "minLength": 1},
    "carrier": {"type": "string", "minLength": 1}
  },
  "additionalProperties": false
}"#;

/// The corrected schema: the `trackingId` the producers now send is allowed.
const FIXED_SHIPPED: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "carrier"],
  "properties": {
    "orderId": {"type": "string", "minLength": 1},
    "carrier": {"type": "string", "minLength": 1},
    "trackingId": {"type": "string"}
  },
  "additionalProperties": false
}"#;

/// Sequence `sequence` of `aggregate`: placed on odd sequences, shipped (with the new
/// `trackingId`) on even ones.
fn message(aggregate: &str, sequence: i64) -> Message {
    let (kind, payload) = if sequence % 2 == 1 {
        (
            "order.placed",
            json!({ "orderId": aggregate, "amount": sequence * 10 }),
        )
    } else {
        (
            "order.shipped",
            json!({ "orderId": aggregate, "carrier": "dhl", "trackingId": format!("t-{aggregate}") }),
        )
    };
    Message {
        aggregate: aggregate.to_owned(),
        sequence,
        message_id: format!("{aggregate}-m{sequence}"),
        kind,
        payload,
    }
}

/// Delivers `message` over HTTPS as `producer`; answers the status.
async fn deliver(
    client: &HttpsClient,
    gate: &GateProcess,
    producer: &Producer,
    message: &Message,
) -> u16 {
    client
        .post(gate.url(&format!("/v1/aggregates/{}/messages", message.aggregate)))
        .bearer_auth(&producer.token)
        .header("Producer-Epoch", producer.epoch.to_string())
        .json(&json!({
            "messageId": message.message_id,
            "sequence": message.sequence,
            "type": message.kind,
            "payload": message.payload,
        }))
        .send()
        .await
        .expect("deliver over HTTPS")
        .status()
        .as_u16()
}

/// A `GET` of `path` as `token`: its JSON body.
async fn read(client: &HttpsClient, gate: &GateProcess, token: &str, path: &str) -> Value {
    client
        .get(gate.url(path))
        .bearer_auth(token)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .unwrap_or(Value::Null)
}

/// `POST /v1/deadletters/{operation}` with `body`: the status and the JSON body.
async fn bulk(
    client: &HttpsClient,
    gate: &str,
    token: &str,
    operation: &str,
    dry_run: bool,
    body: &Value,
) -> (u16, Value) {
    let query = if dry_run { "?dryRun=true" } else { "" };
    let response = client
        .post(format!("{gate}/v1/deadletters/{operation}{query}"))
        .bearer_auth(token)
        .json(body)
        .send()
        .await
        .expect("a bulk call");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The message ids of `list` (`applied`, `failing`, `drained`…) of every aggregate of `answer`,
/// by aggregate.
fn listed(answer: &Value, list: &str) -> BTreeMap<String, Vec<String>> {
    answer["aggregates"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|aggregate| {
            let ids = aggregate[list]
                .as_array()
                .into_iter()
                .flatten()
                .map(|entry| entry["messageId"].as_str().unwrap_or_default().to_owned())
                .collect();
            (
                aggregate["aggregateId"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                ids,
            )
        })
        .collect()
}

/// Waits until each of `aggregates` is blocked with `held` messages held behind it.
async fn wait_blocked_with_held(
    client: &HttpsClient,
    gate: &GateProcess,
    token: &str,
    aggregates: &[String],
    held: i64,
) {
    for aggregate in aggregates {
        let path = format!("/v1/aggregates/{aggregate}");
        poll_until_within(
            &format!("{aggregate} blocked with {held} held"),
            Duration::from_secs(60),
            || read(client, gate, token, &path),
            |view| view["status"] == "blocked" && view["heldCount"] == held,
        )
        .await;
    }
}

/// `/ready`'s configuration generation.
async fn generation(client: &HttpsClient, gate: &GateProcess) -> Option<u64> {
    let response = client.get(gate.url("/ready")).send().await.ok()?;
    response.json::<Value>().await.ok()?["generation"].as_u64()
}

async fn reload_fixed_schema(client: &HttpsClient, files: &GateFiles, gate: &GateProcess) {
    files.write("shipped.json", FIXED_SHIPPED);
    gate.hang_up();
    poll_until_within(
        "the corrected schema reloaded (generation 2)",
        Duration::from_secs(30),
        || generation(client, gate),
        |seen| *seen == Some(2),
    )
    .await;
}

/// 50 aggregates blocked by a schema that lacks `trackingId`, with held successors on NATS;
/// the schema corrected and reloaded; a previewed recheck that applies every blocked message
/// in sequence order and drains behind it; an output that is 1..4 for every aggregate; an audit
/// trail that names the operator and the generation.
async fn recheck_end_to_end(on_postgres: bool) {
    const AGGREGATES: usize = 50;
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let mut files = GateFiles::new(&certificate, &nats);
    files.write("shipped.json", STRICT_SHIPPED);
    let database = on_postgres.then(crate::postgres::fresh_database);
    if on_postgres {
        files = files.on_postgres();
    }
    let env: Vec<(&str, &str)> = database
        .iter()
        .map(|url| ("GATE_DATABASE_URL", url.as_str()))
        .collect();
    let gate = GateProcess::start_with_env(&files.config(), &env);
    let operator = match &database {
        Some(url) => add_operator_on(&["--inbox".into(), url.as_str().into()], "alice"),
        None => add_operator(&files.database(), "alice"),
    };
    let client = certificate.client();
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let js = crate::broker::jetstream_of(&nats).await;

    // Each order: placed (applies) and shipped with trackingId (poison) over HTTPS, then the
    // next two over NATS, held behind the poison.
    let aggregates: Vec<String> = (0..AGGREGATES).map(|i| format!("order-{i}")).collect();
    for aggregate in &aggregates {
        assert_eq!(
            deliver(&client, &gate, &producer, &message(aggregate, 1)).await,
            200
        );
        assert_eq!(
            deliver(&client, &gate, &producer, &message(aggregate, 2)).await,
            422
        );
        for sequence in [3, 4] {
            publish(&js, &producer, &message(aggregate, sequence)).await;
        }
    }
    wait_blocked_with_held(&client, &gate, &operator, &aggregates, 2).await;
    let filter =
        json!({ "type": "order.shipped", "reason": "the shipped schema now allows trackingId" });

    // Before the fix, a preview finds every one still failing, and says why.
    let (status, preview) = bulk(&client, &gate.address, &operator, "recheck", true, &filter).await;
    assert_eq!(status, 200, "{preview}");
    assert_eq!(preview["generation"], 1);
    let failing = listed(&preview, "failing");
    assert_eq!(failing.len(), AGGREGATES, "{preview}");
    let why = preview["aggregates"][0]["failing"][0]["why"]
        .as_str()
        .unwrap_or_default();
    assert!(why.contains("trackingId"), "the schema's error: {why}");
    assert!(listed(&preview, "applied").values().all(Vec::is_empty));

    reload_fixed_schema(&client, &files, &gate).await;

    // A dry run lists all 50 as applying, and writes nothing.
    let (status, preview) = bulk(&client, &gate.address, &operator, "recheck", true, &filter).await;
    assert_eq!(status, 200, "{preview}");
    assert_eq!(
        (
            &preview["dryRun"],
            &preview["generation"],
            &preview["matched"]
        ),
        (&json!(true), &json!(2), &json!(AGGREGATES)),
        "{preview}"
    );
    let would: BTreeMap<String, Vec<String>> = aggregates
        .iter()
        .map(|aggregate| (aggregate.clone(), vec![format!("{aggregate}-m2")]))
        .collect();
    assert_eq!(listed(&preview, "applied"), would);
    assert!(listed(&preview, "failing").values().all(Vec::is_empty));
    let open = read(
        &client,
        &gate,
        &operator,
        "/v1/deadletters?status=open&limit=100",
    )
    .await;
    assert_eq!(
        open["deadLetters"].as_array().map(Vec::len),
        Some(AGGREGATES),
        "the dry run resolved nothing"
    );
    let trail = read(&client, &gate, &operator, "/v1/resolutions?limit=100").await;
    assert_eq!(
        trail["resolutions"],
        json!([]),
        "the dry run audited nothing"
    );
    assert_eq!(
        output_count(&js).await,
        AGGREGATES as u64,
        "only the first of each"
    );

    // The recheck applies each at its sequence and drains its held successors behind it.
    let (status, done) = bulk(&client, &gate.address, &operator, "recheck", false, &filter).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["dryRun"], false);
    assert_eq!(done["next"], Value::Null, "{done}");
    assert_eq!(listed(&done, "applied"), would);
    let drained: BTreeMap<String, Vec<String>> = aggregates
        .iter()
        .map(|aggregate| {
            (
                aggregate.clone(),
                vec![format!("{aggregate}-m3"), format!("{aggregate}-m4")],
            )
        })
        .collect();
    assert_eq!(listed(&done, "drained"), drained);
    for aggregate in done["aggregates"].as_array().into_iter().flatten() {
        let applied = &aggregate["applied"][0];
        assert_eq!(applied["sequence"], 2, "{aggregate}");
        assert!(applied["resolutionId"].as_i64().is_some(), "{aggregate}");
        let sequences: Vec<i64> = aggregate["drained"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|entry| entry["sequence"].as_i64())
            .collect();
        assert_eq!(sequences, [3, 4], "{aggregate}");
    }

    // Read message by message, every aggregate's output is 1..4, the rechecked one as delivered.
    let total = (AGGREGATES * 4) as u64;
    poll_until_within(
        "every message in the output stream",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= total,
    )
    .await;
    let output = read_output(&js).await;
    let expected: BTreeMap<String, i64> = aggregates.iter().map(|a| (a.clone(), 4)).collect();
    assert_in_order_once(&output, &expected);
    let rechecked = &output.by_aggregate["order-7"][1].1;
    assert_eq!(
        rechecked["payload"]["trackingId"], "t-order-7",
        "{rechecked}"
    );
    assert_eq!(rechecked["type"], "order.shipped");

    // The audit trail: one accept per message, naming the operator and the generation.
    let trail = read(&client, &gate, &operator, "/v1/resolutions?limit=100").await;
    let records = trail["resolutions"].as_array().cloned().unwrap_or_default();
    assert_eq!(records.len(), AGGREGATES, "{trail}");
    for record in &records {
        assert_eq!(record["action"], "accept", "{record}");
        assert_eq!(record["operator"], "alice", "{record}");
        assert_eq!(record["sequence"], 2, "{record}");
        let reason = record["reason"].as_str().unwrap_or_default();
        assert!(
            reason.starts_with("the shipped schema now allows trackingId")
                && reason.contains("configuration generation 2"),
            "{reason}"
        );
    }

    // A repeat finds nothing open and changes nothing.
    let (status, again) = bulk(&client, &gate.address, &operator, "recheck", false, &filter).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        (&again["matched"], &again["aggregates"]),
        (&json!(0), &json!([]))
    );
    let trail = read(&client, &gate, &operator, "/v1/resolutions?limit=100").await;
    assert_eq!(
        trail["resolutions"].as_array().map(Vec::len),
        Some(AGGREGATES)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_recheck_on_sqlite_applies_fifty_blocked_messages_in_order_after_a_schema_reload() {
    recheck_end_to_end(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_recheck_on_postgresql_applies_fifty_blocked_messages_in_order_after_a_schema_reload()
{
    recheck_end_to_end(true).await;
}

/// One caller's rechecks, each resuming at the previous answer's `next` until none is left:
/// every answer.
async fn recheck_to_the_end(client: HttpsClient, gate: String, token: String) -> Vec<Value> {
    let mut answers = Vec::new();
    let mut after = 0;
    loop {
        let body = json!({ "reason": "trackingId allowed", "limit": 4, "after": after });
        let (status, answer) = bulk(&client, &gate, &token, "recheck", false, &body).await;
        assert_eq!(status, 200, "{answer}");
        let next = answer["next"].as_i64();
        answers.push(answer);
        match next {
            Some(next) => after = next,
            None => return answers,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_recheck_two_concurrent_callers_resuming_by_limit_apply_each_message_once() {
    const AGGREGATES: usize = 12;
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    files.write("shipped.json", STRICT_SHIPPED);
    let gate = GateProcess::start(&files.config());
    let operator = add_operator(&files.database(), "alice");
    let client = certificate.client();
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let js = crate::broker::jetstream_of(&nats).await;
    let aggregates: Vec<String> = (0..AGGREGATES).map(|i| format!("order-{i}")).collect();
    for aggregate in &aggregates {
        assert_eq!(
            deliver(&client, &gate, &producer, &message(aggregate, 1)).await,
            200
        );
        assert_eq!(
            deliver(&client, &gate, &producer, &message(aggregate, 2)).await,
            422
        );
        publish(&js, &producer, &message(aggregate, 3)).await;
    }
    wait_blocked_with_held(&client, &gate, &operator, &aggregates, 1).await;
    reload_fixed_schema(&client, &files, &gate).await;

    let (first, second) = tokio::join!(
        recheck_to_the_end(client.clone(), gate.address.clone(), operator.clone()),
        recheck_to_the_end(client.clone(), gate.address.clone(), operator.clone()),
    );
    let answers: Vec<&Value> = first.iter().chain(second.iter()).collect();
    assert!(
        answers
            .iter()
            .all(|answer| answer["matched"].as_u64() <= Some(4)),
        "no call acts on more than its limit"
    );
    let mut applied: HashMap<String, usize> = HashMap::new();
    for answer in &answers {
        for ids in listed(answer, "applied").into_values() {
            for id in ids {
                *applied.entry(id).or_default() += 1;
            }
        }
        for aggregate in answer["aggregates"].as_array().into_iter().flatten() {
            assert_eq!(aggregate["failing"], json!([]), "{aggregate}");
        }
    }
    let once: HashMap<String, usize> = aggregates
        .iter()
        .map(|aggregate| (format!("{aggregate}-m2"), 1))
        .collect();
    assert_eq!(
        applied, once,
        "each blocked message applied by exactly one call"
    );

    poll_until_within(
        "every message in the output stream",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= (AGGREGATES * 3) as u64,
    )
    .await;
    let output = read_output(&js).await;
    let expected: BTreeMap<String, i64> = aggregates.iter().map(|a| (a.clone(), 3)).collect();
    assert_in_order_once(&output, &expected);
    let trail = read(&client, &gate, &operator, "/v1/resolutions?limit=100").await;
    assert_eq!(
        trail["resolutions"].as_array().map(Vec::len),
        Some(AGGREGATES)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_recheck_bulk_skip_of_messages_never_valid_leaves_a_marker_per_sequence() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    let gate = GateProcess::start(&files.config());
    let operator = add_operator(&files.database(), "alice");
    let client = certificate.client();
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let js = crate::broker::jetstream_of(&nats).await;

    // Four orders blocked by a message of a type no one configured; a fifth by a negative amount,
    // which the filter leaves alone.
    let aggregates: Vec<String> = (0..5).map(|i| format!("order-{i}")).collect();
    for (index, aggregate) in aggregates.iter().enumerate() {
        assert_eq!(
            deliver(&client, &gate, &producer, &message(aggregate, 1)).await,
            200
        );
        let mut poison = message(aggregate, 2);
        if index < 4 {
            poison.kind = "order.lost";
        } else {
            poison.kind = "order.placed";
            poison.payload = json!({ "orderId": aggregate, "amount": -1 });
        }
        assert_eq!(deliver(&client, &gate, &producer, &poison).await, 422);
        publish(&js, &producer, &message(aggregate, 3)).await;
    }
    wait_blocked_with_held(&client, &gate, &operator, &aggregates, 1).await;
    let filter = json!({
        "reasonContains": "UNKNOWN MESSAGE TYPE",
        "aggregatePrefix": "order-",
        "reason": "order.lost was never a type of ours"
    });

    let (status, preview) = bulk(&client, &gate.address, &operator, "skip", true, &filter).await;
    assert_eq!(status, 200, "{preview}");
    let lost: BTreeMap<String, Vec<String>> = aggregates[..4]
        .iter()
        .map(|aggregate| (aggregate.clone(), vec![format!("{aggregate}-m2")]))
        .collect();
    assert_eq!(listed(&preview, "skipped"), lost);
    assert_eq!(output_count(&js).await, 5, "the dry run wrote nothing");

    let (status, done) = bulk(&client, &gate.address, &operator, "skip", false, &filter).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(listed(&done, "skipped"), lost);
    let drained: BTreeMap<String, Vec<String>> = aggregates[..4]
        .iter()
        .map(|aggregate| (aggregate.clone(), vec![format!("{aggregate}-m3")]))
        .collect();
    assert_eq!(listed(&done, "drained"), drained);

    poll_until_within(
        "the skipped orders' output",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= 5 + 4 * 2,
    )
    .await;
    let output = read_output(&js).await;
    let expected: BTreeMap<String, i64> = aggregates
        .iter()
        .enumerate()
        .map(|(index, aggregate)| (aggregate.clone(), if index < 4 { 3 } else { 1 }))
        .collect();
    assert_in_order_once(&output, &expected);
    for aggregate in &aggregates[..4] {
        let marker = &output.by_aggregate[aggregate][1].1;
        assert_eq!(marker["type"], "gate.skipped", "{marker}");
        assert_eq!(marker["payload"]["operator"], "alice", "{marker}");
    }
    let trail = read(&client, &gate, &operator, "/v1/resolutions?limit=100").await;
    let actions: Vec<&Value> = trail["resolutions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|record| &record["action"])
        .collect();
    assert_eq!(actions, vec![&json!("skip"); 4], "{trail}");
    let untouched = read(&client, &gate, &operator, "/v1/aggregates/order-4").await;
    assert_eq!(untouched["status"], "blocked", "{untouched}");

    // A request that is not a filter is refused before anything is looked at.
    let (status, refused) = bulk(
        &client,
        &gate.address,
        &operator,
        "skip",
        false,
        &json!({ "reason": "x", "limit": 0 }),
    )
    .await;
    assert_eq!(status, 400, "{refused}");
    let (status, _) = bulk(
        &client,
        &gate.address,
        "not-a-token",
        "recheck",
        true,
        &filter,
    )
    .await;
    assert_eq!(status, 401);
}
