//! A payload's numbers pass through unchanged, to the last digit: a 30-digit integer, an
//! integer above 2^53 and a decimal with a trailing zero go in through both of the gate's doors
//! (HTTPS and NATS) on both backends, and come out of the applied feed and the output stream as
//! they were written; a change in the last digit under the same message id is a payload
//! conflict. The lab keeps its own contract for `amount`: a 32-bit integer, and any other
//! number is the 400 that names it.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use futures_util::StreamExt;
use lab_testkit::nats::subject_for;
use serde_json::Value;

use crate::aggregates::add_operator_on;
use crate::gate::{
    Certificate, GateFiles, GateProcess, INPUT_PREFIX, OUTPUT_PREFIX, OUTPUT_STREAM, Producer,
    add_producer, output_count,
};
use crate::helpers::{Backend, poll_until_within, spawn_app_on, status_and_json};
use crate::https::HttpsClient;
use crate::on_both_backends;

/// 30 digits: far past what an `f64` holds.
const AMOUNT: &str = "123456789012345678901234567890";
/// [`AMOUNT`] with its last digit changed.
const AMOUNT_LAST_DIGIT_CHANGED: &str = "123456789012345678901234567891";
/// 2^53 + 1: the first integer an `f64` cannot hold.
const REFERENCE: &str = "9007199254740993";
/// A decimal with a trailing zero.
const PRICE: &str = "12.30";

const AGGREGATE: &str = "order-1";

/// A payload whose numbers are written as given (members out of key order, with whitespace).
fn payload(amount: &str, price: &str) -> String {
    format!(
        r#"{{ "price": {price}, "reference": {REFERENCE}, "orderId": "{AGGREGATE}", "amount": {amount} }}"#
    )
}

/// The payload as the gate stores and emits it: members in key order, no whitespace, every
/// number as written.
fn emitted_payload() -> String {
    format!(
        r#"{{"amount":{AMOUNT},"orderId":"{AGGREGATE}","price":{PRICE},"reference":{REFERENCE}}}"#
    )
}

fn message_body(message_id: &str, sequence: i64, payload: &str) -> String {
    format!(
        r#"{{"messageId":"{message_id}","sequence":{sequence},"type":"order.placed","payload":{payload}}}"#
    )
}

/// A gate with a producer and an operator on `backend`, and the NATS server it reads and writes.
struct RunningGate {
    // Dropped in this order: the gate before its files and its NATS server.
    gate: GateProcess,
    client: HttpsClient,
    producer: Producer,
    operator: String,
    js: jetstream::Context,
    _files: GateFiles,
    _nats: lab_testkit::nats::NatsServer,
}

async fn start_gate(backend: Backend) -> RunningGate {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    let (files, gate, operator) = match backend {
        Backend::Sqlite => {
            let gate = GateProcess::start_with_env(&files.config(), &[]);
            let operator = crate::gate::add_operator(&files.database(), "alice");
            (files, gate, operator)
        }
        Backend::Postgres => {
            let files = files.on_postgres();
            let database = crate::postgres::fresh_database();
            let env = [("GATE_DATABASE_URL", database.as_str())];
            let gate = GateProcess::start_with_env(&files.config(), &env);
            let operator = add_operator_on(&["--inbox".into(), database.as_str().into()], "alice");
            (files, gate, operator)
        }
    };
    let client = certificate.client();
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let js = crate::broker::jetstream_of(&nats).await;
    RunningGate {
        gate,
        client,
        producer,
        operator,
        js,
        _files: files,
        _nats: nats,
    }
}

impl RunningGate {
    /// Delivers `body` over HTTPS as the producer: the status and the answer.
    async fn deliver(&self, body: &str) -> (u16, Value) {
        let response = self
            .client
            .post(
                self.gate
                    .url(&format!("/v1/aggregates/{AGGREGATE}/messages")),
            )
            .bearer_auth(&self.producer.token)
            .header("Producer-Epoch", self.producer.epoch.to_string())
            .json_text(body)
            .send()
            .await
            .expect("a delivery");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// Publishes `body` on the input stream as the producer, under the broker's `msg_id`.
    async fn publish(&self, msg_id: &str, body: &str) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        headers.insert(
            "Authorization",
            format!("Bearer {}", self.producer.token).as_str(),
        );
        headers.insert("Producer-Epoch", self.producer.epoch.to_string().as_str());
        self.js
            .publish_with_headers(
                subject_for(INPUT_PREFIX, AGGREGATE),
                headers,
                body.to_owned().into(),
            )
            .await
            .expect("publish")
            .await
            .expect("PubAck");
    }

    /// The applied feed's text, as the operator reads it.
    async fn feed_text(&self) -> String {
        self.read_text(&format!("/v1/aggregates/{AGGREGATE}/applied"))
            .await
    }

    async fn read_text(&self, path: &str) -> String {
        let response = self
            .client
            .get(self.gate.url(path))
            .bearer_auth(&self.operator)
            .send()
            .await
            .expect("a read");
        response.text().await.unwrap_or_default()
    }

    /// Every message body on the output stream, as the text it carries.
    async fn output_texts(&self) -> Vec<String> {
        let mut stream = self.js.get_stream(OUTPUT_STREAM).await.expect("the stream");
        let consumer = stream
            .create_consumer(PullConfig {
                deliver_policy: DeliverPolicy::All,
                filter_subject: format!("{OUTPUT_PREFIX}.>"),
                ..Default::default()
            })
            .await
            .expect("a consumer of the output stream");
        let pending = stream.info().await.map_or(0, |info| info.state.messages);
        let mut messages = consumer
            .fetch()
            .max_messages(usize::try_from(pending).unwrap_or(0))
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .expect("fetch the output");
        let mut texts = Vec::new();
        while let Some(Ok(message)) = messages.next().await {
            texts.push(String::from_utf8_lossy(&message.payload).into_owned());
        }
        texts
    }
}

/// Delivers message 1 over HTTPS and publishes message 2 on NATS, both with the numbers as
/// written, and waits until both are in the applied feed: its text.
async fn apply_one_through_each_door(gate: &RunningGate) -> String {
    let first = message_body("http-1", 1, &payload(AMOUNT, PRICE));
    assert_eq!(gate.deliver(&first).await.0, 200);
    gate.publish(
        "shop/nats-2",
        &message_body("nats-2", 2, &payload(AMOUNT, PRICE)),
    )
    .await;
    poll_until_within(
        "both messages in the applied feed",
        Duration::from_secs(30),
        || gate.feed_text(),
        |text| text.matches("\"messageId\"").count() == 2,
    )
    .await
}

async fn a_payloads_numbers_come_out_of_the_gate_digit_for_digit_from_both_doors(backend: Backend) {
    let gate = start_gate(backend).await;
    let feed = apply_one_through_each_door(&gate).await;
    let emitted = emitted_payload();
    assert_eq!(
        feed.matches(&format!("\"payload\":{emitted}")).count(),
        2,
        "{feed}"
    );

    poll_until_within(
        "both messages on the output stream",
        Duration::from_secs(30),
        || output_count(&gate.js),
        |count| *count >= 2,
    )
    .await;
    let output = gate.output_texts().await;
    assert_eq!(output.len(), 2, "{output:?}");
    for text in &output {
        assert!(text.contains(&format!("\"payload\":{emitted}")), "{text}");
    }
}

async fn a_change_in_the_last_digit_is_a_payload_conflict_on_both_doors(backend: Backend) {
    let gate = start_gate(backend).await;
    apply_one_through_each_door(&gate).await;

    // The same numbers with the members in another order: the same message, whichever door
    // took it first.
    for (message_id, sequence) in [("http-1", 1), ("nats-2", 2)] {
        let reordered = format!(
            r#"{{"payload":{{"amount":{AMOUNT},"orderId":"{AGGREGATE}","reference":{REFERENCE},"price":{PRICE}}},"type":"order.placed","sequence":{sequence},"messageId":"{message_id}"}}"#
        );
        let (status, answer) = gate.deliver(&reordered).await;
        assert_eq!(
            (status, answer["outcome"].as_str()),
            (200, Some("replay")),
            "{message_id}"
        );
    }

    // One digit, or one trailing zero, makes it other content.
    for (message_id, sequence, changed) in [
        ("http-1", 1, payload(AMOUNT_LAST_DIGIT_CHANGED, PRICE)),
        ("http-1", 1, payload(AMOUNT, "12.3")),
        ("nats-2", 2, payload(AMOUNT_LAST_DIGIT_CHANGED, PRICE)),
    ] {
        let (status, answer) = gate
            .deliver(&message_body(message_id, sequence, &changed))
            .await;
        assert_eq!(
            (status, answer["outcome"].as_str()),
            (409, Some("payload conflict")),
            "{message_id}: {changed}"
        );
    }
    // On NATS (a message id the stream has not seen under the producer: the broker would drop
    // a second publish of `shop/nats-2` as a duplicate before the gate saw it).
    gate.publish(
        "shop/http-1",
        &message_body("http-1", 1, &payload(AMOUNT_LAST_DIGIT_CHANGED, PRICE)),
    )
    .await;
    let rejected = poll_until_within(
        "the changed NATS message rejected",
        Duration::from_secs(30),
        || gate.read_text("/v1/rejected"),
        |text| text.contains("payload conflict"),
    )
    .await;
    let rejected: Value = serde_json::from_str(&rejected).expect("a rejected page");
    let entries = rejected["rejected"].as_array().cloned().unwrap_or_default();
    let outcomes: Vec<(&str, &str)> = entries
        .iter()
        .map(|entry| {
            (
                entry["outcome"].as_str().unwrap_or_default(),
                entry["reason"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [(
            "payload conflict",
            "message id 'http-1' already carries other content"
        )],
        "{rejected}"
    );
    // Nothing of the changed content reached the feed.
    let feed = gate.feed_text().await;
    assert!(!feed.contains(AMOUNT_LAST_DIGIT_CHANGED), "{feed}");
    assert_eq!(feed.matches("\"messageId\"").count(), 2, "{feed}");
}

/// A lab delivery of `amount`, written as given: the status and the problem's detail.
async fn lab_delivery(app: &crate::helpers::TestApp, amount: &str) -> (u16, Value) {
    let body = format!(r#"{{"messageId":"m-1","sequence":1,"amount":{amount}}}"#);
    status_and_json(
        app.post_raw("/aggregates/acct/messages", "application/json", &body)
            .await,
    )
    .await
}

async fn the_labs_amount_stays_a_32_bit_integer_and_any_other_number_is_named_in_its_400(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    for (amount, named) in [
        (
            AMOUNT,
            "invalid type: floating point `1.2345678901234568e+29`, expected i32",
        ),
        (
            REFERENCE,
            "invalid value: integer `9007199254740993`, expected i32",
        ),
        (PRICE, "invalid type: floating point `12.3`, expected i32"),
    ] {
        let (status, problem) = lab_delivery(&app, amount).await;
        assert_eq!(
            (status, problem["detail"].as_str()),
            (400, Some(format!("invalid body: {named}").as_str())),
            "{amount}"
        );
    }
    let (status, answer) = lab_delivery(&app, "2147483647").await;
    assert_eq!((status, answer["outcome"].as_str()), (200, Some("applied")));
    let (status, shown) = status_and_json(app.get("/aggregates/acct").await).await;
    assert_eq!(
        (status, shown["total"].as_i64()),
        (200, Some(2147483647)),
        "{shown}"
    );
    assert_eq!(
        app.inbox_rows("SELECT payload FROM ordered_inbox"),
        [r#"{"AggregateId":"acct","Sequence":1,"Amount":2147483647}"#]
    );
}

on_both_backends!(
    a_payloads_numbers_come_out_of_the_gate_digit_for_digit_from_both_doors,
    a_change_in_the_last_digit_is_a_payload_conflict_on_both_doors,
    the_labs_amount_stays_a_32_bit_integer_and_any_other_number_is_named_in_its_400,
);
