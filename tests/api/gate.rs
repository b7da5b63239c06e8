//! The gate end to end: the real `production-lab gate` process over TLS (a self-signed
//! certificate made here, on 127.0.0.1), a private nats-server for its input and output streams,
//! producers over HTTP and NATS, an operator, and a downstream consumer of the output stream.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use futures_util::StreamExt;
use lab_testkit::nats::{NatsServer, subject_for};
use rand::seq::SliceRandom;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::aggregates::add_operator_on;
use crate::helpers::{command, poll_until_within};
use crate::https::HttpsClient;

/// The output stream's subjects and name, and the input's, as the test's config sets them.
pub(crate) const OUTPUT_PREFIX: &str = "gate.out";
pub(crate) const OUTPUT_STREAM: &str = "GATE_OUT";
pub(crate) const INPUT_PREFIX: &str = "gate.in";
const INPUT_STREAM: &str = "GATE_IN";

pub(crate) const PLACED_SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "amount"],
  "properties": {
    "orderId": {"type": "string", "minLength": 1},
    "amount": {"type": "integer", "minimum": 0}
  }
}"#;

pub(crate) const SHIPPED_SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "carrier"],
  "properties": {
    "orderId": {"type": "string", "minLength": 1},
    "carrier": {"type": "string", "minLength": 1}
  }
}"#;

/// A self-signed certificate for 127.0.0.1 and localhost, and an HTTPS client that trusts only
/// it.
pub(crate) struct Certificate {
    pub(crate) certificate_pem: String,
    pub(crate) key_pem: String,
}

impl Certificate {
    pub(crate) fn new() -> Certificate {
        let made = rcgen::generate_simple_self_signed(vec![
            "127.0.0.1".to_owned(),
            "localhost".to_owned(),
        ])
        .expect("make a self-signed certificate");
        Certificate {
            certificate_pem: made.cert.pem(),
            key_pem: made.signing_key.serialize_pem(),
        }
    }

    pub(crate) fn client(&self) -> HttpsClient {
        HttpsClient::trusting(&self.certificate_pem)
    }
}

/// The gate's directory: its configuration, schemas, certificate and database.
pub(crate) struct GateFiles {
    dir: TempDir,
}

impl GateFiles {
    pub(crate) fn new(certificate: &Certificate, nats: &NatsServer) -> GateFiles {
        let dir = tempfile::tempdir().expect("a temp dir");
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("placed.json", PLACED_SCHEMA);
        write("shipped.json", SHIPPED_SCHEMA);
        write("cert.pem", &certificate.certificate_pem);
        write("key.pem", &certificate.key_pem);
        write(
            "gate.toml",
            &format!(
                r#"
[listen]
address = "127.0.0.1:0"

[tls]
certificate = "cert.pem"
key = "key.pem"

[store]
sqlite = "gate.db"

[nats]
urls = ["{url}"]

[nats.input]
stream = "{INPUT_STREAM}"
subject_prefix = "{INPUT_PREFIX}"
durable = "gate"

[nats.output]
stream = "{OUTPUT_STREAM}"
subject_prefix = "{OUTPUT_PREFIX}"

[types."order.placed"]
schema = "placed.json"

[types."order.shipped"]
schema = "shipped.json"
"#,
                url = nats.url
            ),
        );
        GateFiles { dir }
    }

    /// The same files with the store in the PostgreSQL database whose URL is in
    /// `GATE_DATABASE_URL`.
    pub(crate) fn on_postgres(self) -> GateFiles {
        let text = std::fs::read_to_string(self.config()).unwrap();
        let text = text.replace(
            "sqlite = \"gate.db\"",
            "postgres_url_env = \"GATE_DATABASE_URL\"",
        );
        std::fs::write(self.config(), text).unwrap();
        self
    }

    pub(crate) fn config(&self) -> PathBuf {
        self.dir.path().join("gate.toml")
    }

    /// Writes (or replaces) the file `name` in the gate's directory.
    pub(crate) fn write(&self, name: &str, text: &str) {
        std::fs::write(self.dir.path().join(name), text).expect("a gate file");
    }

    /// The same files with `[publisher] lease_ms` set.
    fn with_lease_ms(self, lease_ms: u64) -> GateFiles {
        let text = std::fs::read_to_string(self.config()).unwrap();
        let text = format!("{text}\n[publisher]\nlease_ms = {lease_ms}\n");
        std::fs::write(self.config(), text).unwrap();
        self
    }

    /// What the gate logged so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gate.log")).unwrap_or_default()
    }

    pub(crate) fn database(&self) -> PathBuf {
        self.dir.path().join("gate.db")
    }
}

/// A running `production-lab gate --config FILE`.
pub(crate) struct GateProcess {
    child: Child,
    /// `https://127.0.0.1:PORT`
    pub(crate) address: String,
}

impl GateProcess {
    /// Starts the gate on `config`; its log lines go to `gate.log` beside the file (a pipe no
    /// one reads would fill and stall the gate).
    pub(crate) fn start(config: &Path) -> GateProcess {
        GateProcess::start_with_env(config, &[])
    }

    /// [`GateProcess::start`] with environment variables for the process.
    pub(crate) fn start_with_env(config: &Path, env: &[(&str, &str)]) -> GateProcess {
        let mut gate = command();
        gate.envs(env.iter().copied());
        GateProcess::start_command(gate, config)
    }

    /// [`GateProcess::start`] with `program` as the `production-lab` binary: a command that
    /// runs it (such as `ip netns exec NS production-lab`), its environment set.
    pub(crate) fn start_command(mut program: std::process::Command, config: &Path) -> GateProcess {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(config.with_file_name("gate.log"))
            .expect("the gate's log file");
        let mut child = program
            .arg("gate")
            .arg("--config")
            .arg(config)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn the gate");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let address = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(address) = lab_testkit::server::listening_address(&line) {
                        break address.to_owned();
                    }
                }
                _ => {
                    let _ = child.wait();
                    let log = std::fs::read_to_string(config.with_file_name("gate.log"));
                    panic!(
                        "the gate exited before listening: {}",
                        log.unwrap_or_default()
                    );
                }
            }
        };
        // Keep reading so that the gate never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
        GateProcess { child, address }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    /// Sends SIGHUP, a supervisor's "reload".
    pub(crate) fn hang_up(&self) {
        self.signal("HUP");
    }

    /// Whether the process has not exited.
    pub(crate) fn is_running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to the gate's process.
    pub(crate) fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal}");
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for GateProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Adds an operator to the gate's registry with the existing command and returns its token.
pub(crate) fn add_operator(database: &Path, name: &str) -> String {
    add_operator_on(&["--database".into(), database.into()], name)
}

/// One producer: its name, token and session epoch.
#[derive(Clone)]
pub(crate) struct Producer {
    pub(crate) name: String,
    pub(crate) token: String,
    pub(crate) epoch: i64,
}

pub(crate) async fn add_producer(
    client: &HttpsClient,
    gate: &GateProcess,
    operator: &str,
    name: &str,
) -> Producer {
    let added = client
        .post(gate.url("/v1/producers"))
        .bearer_auth(operator)
        .json(&json!({ "name": name }))
        .send()
        .await
        .expect("add a producer");
    assert_eq!(
        added.status(),
        201,
        "{}",
        added.text().await.unwrap_or_default()
    );
    let token = added.json::<Value>().await.unwrap()["token"]
        .as_str()
        .expect("the producer's token")
        .to_owned();
    let session = client
        .post(gate.url("/v1/producers/session"))
        .bearer_auth(&token)
        .send()
        .await
        .expect("start a session");
    assert_eq!(session.status(), 200);
    let epoch = session.json::<Value>().await.unwrap()["epoch"]
        .as_i64()
        .expect("an epoch");
    Producer {
        name: name.to_owned(),
        token,
        epoch,
    }
}

/// One message of the workload.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub(crate) aggregate: String,
    pub(crate) sequence: i64,
    pub(crate) message_id: String,
    pub(crate) kind: &'static str,
    pub(crate) payload: Value,
}

impl Message {
    fn body(&self) -> Value {
        json!({
            "messageId": self.message_id,
            "sequence": self.sequence,
            "type": self.kind,
            "payload": self.payload,
        })
    }
}

/// `sequences` messages for `aggregate`: placed first, then shipped and placed in turn.
pub(crate) fn messages_of(aggregate: &str, sequences: i64) -> Vec<Message> {
    (1..=sequences)
        .map(|sequence| {
            let (kind, payload) = if sequence % 2 == 1 {
                (
                    "order.placed",
                    json!({ "orderId": aggregate, "amount": sequence * 10 }),
                )
            } else {
                (
                    "order.shipped",
                    json!({ "orderId": aggregate, "carrier": "dhl" }),
                )
            };
            Message {
                aggregate: aggregate.to_owned(),
                sequence,
                message_id: format!("{aggregate}-m{sequence}"),
                kind,
                payload,
            }
        })
        .collect()
}

/// Delivers `message` over HTTPS until the gate has decided it (applied, a replay, or
/// quarantined); an early one is answered 409 gap and sent again, as a sloppy producer's retry.
pub(crate) async fn deliver_until_decided(
    client: &HttpsClient,
    gate: &str,
    producer: &Producer,
    message: &Message,
) -> u16 {
    let url = format!("{gate}/v1/aggregates/{}/messages", message.aggregate);
    poll_until_within(
        &format!("{} decided", message.message_id),
        Duration::from_secs(60),
        || async {
            client
                .post(&url)
                .bearer_auth(&producer.token)
                .header("Producer-Epoch", producer.epoch.to_string())
                .json(&message.body())
                .send()
                .await
                .map(|response| response.status().as_u16())
                .unwrap_or(0)
        },
        |status| matches!(status, 200 | 422),
    )
    .await
}

/// Publishes `message` on the gate's input stream as `producer`.
pub(crate) async fn publish(js: &jetstream::Context, producer: &Producer, message: &Message) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        "Nats-Msg-Id",
        format!("{}/{}", producer.name, message.message_id).as_str(),
    );
    headers.insert(
        "Authorization",
        format!("Bearer {}", producer.token).as_str(),
    );
    headers.insert("Producer-Epoch", producer.epoch.to_string().as_str());
    js.publish_with_headers(
        subject_for(INPUT_PREFIX, &message.aggregate),
        headers,
        message.body().to_string().into(),
    )
    .await
    .expect("publish")
    .await
    .expect("PubAck");
}

/// What a downstream consumer read from the output stream: per aggregate the sequences in the
/// order they arrived, with their bodies, and every `Nats-Msg-Id`.
#[derive(Debug, Default)]
pub(crate) struct Output {
    pub(crate) by_aggregate: BTreeMap<String, Vec<(i64, Value)>>,
    ids: Vec<String>,
}

/// Reads the whole output stream from its start with an ordered view of it.
pub(crate) async fn read_output(js: &jetstream::Context) -> Output {
    let Ok(mut stream) = js.get_stream(OUTPUT_STREAM).await else {
        return Output::default();
    };
    let pending = stream
        .info()
        .await
        .map(|info| info.state.messages)
        .unwrap_or(0);
    let mut output = Output::default();
    if pending == 0 {
        return output;
    }
    let consumer = stream
        .create_consumer(PullConfig {
            deliver_policy: DeliverPolicy::All,
            filter_subject: format!("{OUTPUT_PREFIX}.>"),
            ..Default::default()
        })
        .await
        .expect("a consumer of the output stream");
    let mut messages = consumer
        .fetch()
        .max_messages(pending as usize)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch the output");
    while let Some(Ok(message)) = messages.next().await {
        let id = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Nats-Msg-Id"))
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default();
        let body: Value = serde_json::from_slice(&message.payload).expect("an output body");
        let aggregate = body["aggregateId"].as_str().unwrap_or_default().to_owned();
        let sequence = body["sequence"].as_i64().unwrap_or_default();
        assert_eq!(
            id,
            format!("{aggregate}:{sequence}"),
            "the output's Nats-Msg-Id"
        );
        output.ids.push(id);
        output
            .by_aggregate
            .entry(aggregate)
            .or_default()
            .push((sequence, body));
        let _ = message.ack().await;
    }
    output
}

/// Every aggregate's output is exactly 1..=n in order, with no id twice.
pub(crate) fn assert_in_order_once(output: &Output, expected: &BTreeMap<String, i64>) {
    let distinct: HashSet<&String> = output.ids.iter().collect();
    assert_eq!(
        distinct.len(),
        output.ids.len(),
        "a duplicate in the output stream"
    );
    for (aggregate, last) in expected {
        let sequences: Vec<i64> = output
            .by_aggregate
            .get(aggregate)
            .map(|entries| entries.iter().map(|(sequence, _)| *sequence).collect())
            .unwrap_or_default();
        assert_eq!(
            sequences,
            (1..=*last).collect::<Vec<_>>(),
            "the output of {aggregate}"
        );
    }
}

/// `gate_output_published_total` on the gate's `/metrics`, if the scrape has it.
async fn published_rows(client: &HttpsClient, gate: &GateProcess) -> Option<u64> {
    scraped(client, gate, "gate_output_published_total")
        .await
        .map(|count| count as u64)
}

/// A series without labels on the gate's `/metrics`, if the scrape has it.
async fn scraped(client: &HttpsClient, gate: &GateProcess, series: &str) -> Option<f64> {
    let text = client
        .get(gate.url("/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// Whether the gate holds its store's publisher lease, as its `/metrics` says.
async fn holds_the_lease(client: &HttpsClient, gate: &GateProcess) -> bool {
    scraped(client, gate, "gate_publisher_holding").await == Some(1.0)
}

pub(crate) async fn output_count(js: &jetstream::Context) -> u64 {
    match js.get_stream(OUTPUT_STREAM).await {
        Ok(mut stream) => stream
            .info()
            .await
            .map(|info| info.state.messages)
            .unwrap_or(0),
        Err(_) => 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_sloppy_producers_over_https_and_nats_come_out_once_and_in_order_after_an_operator_replaces_a_poison()
 {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    let gate = GateProcess::start(&files.config());
    assert!(
        gate.address.starts_with("https://127.0.0.1:"),
        "{}",
        gate.address
    );
    let client = certificate.client();
    let operator = add_operator(&files.database(), "alice");
    let mut producers = Vec::new();
    for name in ["billing", "shop", "warehouse"] {
        producers.push(add_producer(&client, &gate, &operator, name).await);
    }
    let js = crate::broker::jetstream_of(&nats).await;

    // Six orders of eight messages, two orders per producer; order-2's third message fails its
    // schema (a negative amount).
    let mut expected = BTreeMap::new();
    let mut work = Vec::new();
    for index in 0..6 {
        let aggregate = format!("order-{index}");
        let producer = producers[index % 3].clone();
        let mut messages = messages_of(&aggregate, 8);
        if index == 2 {
            messages[2].payload = json!({ "orderId": aggregate, "amount": -5 });
        }
        expected.insert(aggregate, 8);
        for message in messages {
            work.push((producer.clone(), message));
        }
    }
    // Shuffled and duplicated; odd sequences over NATS (held when early), even over HTTPS
    // (retried when early).
    let mut sends: Vec<_> = work.iter().chain(work.iter()).cloned().collect();
    sends.shuffle(&mut rand::rng());
    let mut http = tokio::task::JoinSet::new();
    for (producer, message) in sends {
        if message.sequence % 2 == 1 {
            publish(&js, &producer, &message).await;
        } else {
            let (client, gate) = (client.clone(), gate.address.clone());
            http.spawn(
                async move { deliver_until_decided(&client, &gate, &producer, &message).await },
            );
        }
    }

    // The poison is quarantined with the schema's first error; the operator replaces it.
    let dead = poll_until_within(
        "order-2's third message quarantined",
        Duration::from_secs(30),
        || async {
            let response = client
                .get(gate.url("/v1/deadletters"))
                .bearer_auth(&operator)
                .send()
                .await
                .unwrap();
            response.json::<Value>().await.unwrap_or(Value::Null)
        },
        |page| {
            page["deadLetters"]
                .as_array()
                .is_some_and(|items| !items.is_empty())
        },
    )
    .await;
    let dead = &dead["deadLetters"][0];
    assert_eq!(dead["messageId"], "order-2-m3", "{dead}");
    let reason = dead["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("/amount"),
        "the schema's error names the path: {reason}"
    );
    // order-2 is the third producer's.
    assert_eq!(dead["producer"], "warehouse", "{dead}");
    let resolved = client
        .post(gate.url("/v1/deadletters/resolution?messageId=order-2-m3&producer=warehouse"))
        .bearer_auth(&operator)
        .json(&json!({
            "action": "replace",
            "expectedLast": 2,
            "reason": "the amount was a refund: corrected",
            "replacement": { "type": "order.placed", "payload": { "orderId": "order-2", "amount": 5 } }
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resolved.status(),
        200,
        "{}",
        resolved.text().await.unwrap_or_default()
    );

    while let Some(status) = http.join_next().await {
        let status = status.expect("a producer task");
        assert!(matches!(status, 200 | 422), "a delivery answered {status}");
    }
    let total: i64 = expected.values().sum();
    poll_until_within(
        "every message in the output stream",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= total as u64,
    )
    .await;
    let output = read_output(&js).await;
    assert_in_order_once(&output, &expected);
    // Each row out is counted once as published, once its mark is written.
    poll_until_within(
        "every output row counted as published",
        Duration::from_secs(10),
        || published_rows(&client, &gate),
        |count| *count == Some(total as u64),
    )
    .await;
    let replaced = &output.by_aggregate["order-2"][2].1;
    assert_eq!(
        replaced["payload"]["amount"], 5,
        "the replacement is what comes out: {replaced}"
    );
    assert_eq!(replaced["type"], "order.placed");

    // Nothing of the lab is there, even for an operator.
    for (method, path) in [
        ("POST", "/ordered/apply"),
        ("GET", "/ordered/state"),
        ("GET", "/lab/cache"),
        ("POST", "/outbox/ack/1"),
        ("GET", "/aggregates/order-1"),
        ("GET", "/console/labs"),
        ("GET", "/console/events"),
        ("GET", "/console/assets/lesson.js"),
    ] {
        let response = client
            .request(method.parse().unwrap(), gate.url(path))
            .bearer_auth(&operator)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404, "{method} {path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gate_killed_mid_load_and_restarted_still_emits_every_accepted_message_once_and_in_order()
{
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    let gate = GateProcess::start(&files.config());
    let client = certificate.client();
    let operator = add_operator(&files.database(), "alice");
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let js = crate::broker::jetstream_of(&nats).await;

    // Four orders of 60 messages, each order sent in sequence by its own task; the gate is
    // killed once a third of them were acknowledged.
    let expected: BTreeMap<String, i64> = (0..4).map(|i| (format!("order-{i}"), 60)).collect();
    let acknowledged = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut senders = tokio::task::JoinSet::new();
    for aggregate in expected.keys() {
        let (client, url, producer) = (client.clone(), gate.address.clone(), producer.clone());
        let (messages, acknowledged) = (messages_of(aggregate, 60), acknowledged.clone());
        senders.spawn(async move {
            for message in &messages {
                let answered = client
                    .post(format!(
                        "{url}/v1/aggregates/{}/messages",
                        message.aggregate
                    ))
                    .bearer_auth(&producer.token)
                    .header("Producer-Epoch", producer.epoch.to_string())
                    .json(&message.body())
                    .send()
                    .await;
                match answered {
                    Ok(response) if response.status() == 200 => {
                        acknowledged.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    // The gate is gone: this producer stops here and resends after the restart.
                    _ => break,
                }
            }
        });
    }
    poll_until_within(
        "a third of the messages acknowledged",
        Duration::from_secs(60),
        || async { acknowledged.load(std::sync::atomic::Ordering::SeqCst) },
        |count| *count >= 80,
    )
    .await;
    gate.kill();
    while senders.join_next().await.is_some() {}
    let before_restart = acknowledged.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        before_restart < 240,
        "the kill came before the end of the load"
    );

    // The producers resend everything from the start: what was applied is a replay.
    let gate = GateProcess::start(&files.config());
    for aggregate in expected.keys() {
        for message in messages_of(aggregate, 60) {
            let status = deliver_until_decided(&client, &gate.address, &producer, &message).await;
            assert_eq!(status, 200, "{}", message.message_id);
        }
    }
    poll_until_within(
        "every message in the output stream",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= 240,
    )
    .await;
    let output = read_output(&js).await;
    assert_in_order_once(&output, &expected);
}

#[tokio::test]
async fn a_gate_off_loopback_without_tls_refuses_to_start_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("placed.json"), PLACED_SCHEMA).unwrap();
    std::fs::write(
        dir.path().join("gate.toml"),
        "[listen]\naddress = \"0.0.0.0:0\"\n\n[types.\"order.placed\"]\nschema = \"placed.json\"\n",
    )
    .unwrap();
    let output = command()
        .arg("gate")
        .arg("--config")
        .arg(dir.path().join("gate.toml"))
        .output()
        .expect("run the gate");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("tls"), "{stderr}");
    assert!(
        !dir.path().join("gate.db").exists(),
        "nothing was created: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_nats_message_is_refused_and_listed_while_anonymous_writes_are_off() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    let gate = GateProcess::start(&files.config());
    let client = certificate.client();
    let operator = add_operator(&files.database(), "alice");
    let js = crate::broker::jetstream_of(&nats).await;
    let message = &messages_of("order-anon", 1)[0];
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", message.message_id.as_str());
    js.publish_with_headers(
        subject_for(INPUT_PREFIX, &message.aggregate),
        headers,
        message.body().to_string().into(),
    )
    .await
    .expect("publish")
    .await
    .expect("PubAck");

    let listed = poll_until_within(
        "the anonymous message in the rejected list",
        Duration::from_secs(20),
        || async {
            let response = client
                .get(gate.url("/v1/rejected"))
                .bearer_auth(&operator)
                .send()
                .await
                .unwrap();
            response.json::<Value>().await.unwrap_or(Value::Null)
        },
        |page| {
            page["rejected"]
                .as_array()
                .is_some_and(|items| !items.is_empty())
        },
    )
    .await;
    let entry = &listed["rejected"][0];
    assert_eq!(entry["outcome"], "anonymous refused", "{entry}");
    assert_eq!(entry["aggregateId"], "order-anon", "{entry}");
    let aggregate = client
        .get(gate.url("/v1/aggregates/order-anon"))
        .bearer_auth(&operator)
        .send()
        .await
        .unwrap();
    assert_eq!(aggregate.status(), 404, "nothing was written for it");
    assert_eq!(output_count(&js).await, 0, "nothing came out");
}

/// `GET path` on the gate as `token`: the answer's JSON (null when it is none).
async fn gate_json(client: &HttpsClient, gate: &GateProcess, token: &str, path: &str) -> Value {
    let response = client.get(gate.url(path)).bearer_auth(token).send().await;
    match response {
        Ok(response) => response.json::<Value>().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_held_nats_message_fenced_before_its_drain_is_listed_and_never_emitted() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    let gate = GateProcess::start(&files.config());
    let client = certificate.client();
    let operator = add_operator(&files.database(), "alice");
    let billing = add_producer(&client, &gate, &operator, "billing").await;
    let js = crate::broker::jetstream_of(&nats).await;
    let messages = messages_of("order-f", 3);
    publish(&js, &billing, &messages[0]).await;
    publish(&js, &billing, &messages[2]).await;
    let path = "/v1/aggregates/order-f";
    poll_until_within(
        "order-f holds 3",
        Duration::from_secs(20),
        || gate_json(&client, &gate, &operator, path),
        |view| view["heldSequences"] == json!([3]),
    )
    .await;

    // A new instance of billing: its 2 applies, and the drain refuses the 3 epoch 1 sent.
    let session = client
        .post(gate.url("/v1/producers/session"))
        .bearer_auth(&billing.token)
        .send()
        .await
        .expect("start a session");
    assert_eq!(session.status(), 200);
    let newer = Producer {
        epoch: billing.epoch + 1,
        ..billing.clone()
    };
    publish(&js, &newer, &messages[1]).await;
    let listed = poll_until_within(
        "the held 3 in the rejected list",
        Duration::from_secs(20),
        || gate_json(&client, &gate, &operator, "/v1/rejected"),
        |page| {
            page["rejected"]
                .as_array()
                .is_some_and(|items| !items.is_empty())
        },
    )
    .await;
    let entry = &listed["rejected"][0];
    assert_eq!(
        (&entry["outcome"], &entry["producer"], &entry["messageId"]),
        (&json!("fenced"), &json!("billing"), &json!("order-f-m3")),
        "{entry}"
    );
    let view = gate_json(&client, &gate, &operator, path).await;
    assert_eq!(
        (&view["last"], &view["heldSequences"]),
        (&json!(2), &json!([])),
        "{view}"
    );
    poll_until_within(
        "1 and 2 in the output stream",
        Duration::from_secs(20),
        || output_count(&js),
        |count| *count >= 2,
    )
    .await;
    let output = read_output(&js).await;
    assert_in_order_once(&output, &BTreeMap::from([("order-f".to_owned(), 2)]));
}

#[tokio::test]
async fn sigterm_lets_the_gate_finish_and_exit_cleanly() {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats);
    let mut gate = GateProcess::start(&files.config());
    let client = certificate.client();
    let live = client.get(gate.url("/live")).send().await.unwrap();
    assert_eq!(live.status(), 200);
    let status = std::process::Command::new("kill")
        .args(["-TERM", &gate.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    let exited = poll_until_within(
        "the gate exits after SIGTERM",
        Duration::from_secs(15),
        || {
            let exited = gate.child.try_wait().ok().flatten();
            async move { exited }
        },
        Option::is_some,
    )
    .await;
    assert!(exited.is_some_and(|status| status.success()), "{exited:?}");
}

/// Two gates on one fresh PostgreSQL database and one nats-server, and the producer `shop`.
struct TwoGates {
    files: GateFiles,
    first: GateProcess,
    second: GateProcess,
    client: HttpsClient,
    producer: Producer,
    js: jetstream::Context,
    /// Kept for its process: dropping it stops the server.
    _nats: NatsServer,
}

async fn two_gates_on_postgresql() -> TwoGates {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats).on_postgres();
    let database = crate::postgres::fresh_database();
    let env = [("GATE_DATABASE_URL", database.as_str())];
    let first = GateProcess::start_with_env(&files.config(), &env);
    let second = GateProcess::start_with_env(&files.config(), &env);
    let operator = add_operator_on(&["--inbox".into(), database.as_str().into()], "alice");
    let client = certificate.client();
    let producer = add_producer(&client, &first, &operator, "shop").await;
    let js = crate::broker::jetstream_of(&nats).await;
    TwoGates {
        files,
        first,
        second,
        client,
        producer,
        js,
        _nats: nats,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gates_on_one_postgresql_database_emit_one_output_once_and_in_order() {
    let gates = two_gates_on_postgresql().await;
    let (client, js) = (&gates.client, &gates.js);
    let (first, second) = (&gates.first, &gates.second);

    // Four orders of 30 messages, shuffled, each sent to one gate or the other until decided.
    let expected: BTreeMap<String, i64> = (0..4).map(|i| (format!("order-{i}"), 30)).collect();
    let mut sends: Vec<Message> = expected
        .keys()
        .flat_map(|aggregate| messages_of(aggregate, 30))
        .collect();
    sends.shuffle(&mut rand::rng());
    let mut senders = tokio::task::JoinSet::new();
    for (index, message) in sends.into_iter().enumerate() {
        let gate = if index % 2 == 0 { first } else { second };
        let (client, url) = (client.clone(), gate.address.clone());
        let producer = gates.producer.clone();
        senders
            .spawn(async move { deliver_until_decided(&client, &url, &producer, &message).await });
    }
    while let Some(status) = senders.join_next().await {
        assert_eq!(status.expect("a sender"), 200);
    }
    poll_until_within(
        "every message in the output stream",
        Duration::from_secs(60),
        || output_count(js),
        |count| *count >= 120,
    )
    .await;
    let output = read_output(js).await;
    assert_in_order_once(&output, &expected);
    assert_eq!(output.ids.len(), 120, "nothing more than the 120 rows");
    // The second gate found the store installed: its start logged no notice of it.
    let log = gates.files.log();
    assert!(!log.contains("NOTICE"), "{log}");
    // One gate of the store published; the other stood by.
    let counts = [
        published_rows(client, first)
            .await
            .expect("the first's count"),
        published_rows(client, second)
            .await
            .expect("the second's count"),
    ];
    assert!(
        counts.contains(&0) && counts.iter().sum::<u64>() >= 120,
        "published by each gate: {counts:?}"
    );
    let holding = [
        holds_the_lease(client, first).await,
        holds_the_lease(client, second).await,
    ];
    assert_eq!(
        holding.iter().filter(|held| **held).count(),
        1,
        "{holding:?}"
    );
    // `/ready` names the holder and the standby, both at the holder's epoch.
    let mut statuses = [
        publisher_status(client, first).await,
        publisher_status(client, second).await,
    ];
    statuses.sort();
    assert_eq!(
        [statuses[0].0.as_str(), statuses[1].0.as_str()],
        ["holder", "standby"],
        "{statuses:?}"
    );
    assert!(
        statuses[0].1 >= 1 && statuses[0].1 == statuses[1].1,
        "{statuses:?}"
    );
}

/// Two gates on one PostgreSQL database: each message the standby applies is announced to the
/// publishing gate through PostgreSQL (`NOTIFY`), which counts the notifications and publishes
/// the messages; the publishing gate's own applies announce nothing to the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_gates_applies_are_announced_to_the_publishing_gate_through_postgresql() {
    let gates = two_gates_on_postgresql().await;
    let (client, js) = (&gates.client, &gates.js);
    let holder = lease_holder(client, [&gates.first, &gates.second]).await;
    let standby = if std::ptr::eq(holder, &gates.first) {
        &gates.second
    } else {
        &gates.first
    };
    const NOTIFICATIONS: &str = "gate_output_notifications_total";
    assert_eq!(scraped(client, holder, NOTIFICATIONS).await, Some(0.0));

    let through =
        |gate: &GateProcess| (client.clone(), gate.address.clone(), gates.producer.clone());
    deliver_five_in_order(through(standby), "order-1", js, 5).await;
    poll_until_within(
        "the publishing gate heard of them",
        Duration::from_secs(30),
        || scraped(client, holder, NOTIFICATIONS),
        |heard| heard.is_some_and(|count| count >= 1.0),
    )
    .await;

    deliver_five_in_order(through(holder), "order-2", js, 10).await;
    let expected: BTreeMap<String, i64> = [("order-1".to_owned(), 5), ("order-2".to_owned(), 5)]
        .into_iter()
        .collect();
    assert_in_order_once(&read_output(js).await, &expected);
    assert_eq!(scraped(client, standby, NOTIFICATIONS).await, Some(0.0));
    assert!(holds_the_lease(client, holder).await);
}

/// Delivers `aggregate`'s sequences 1 to 5 in order through the gate at `url` as `producer`,
/// then waits until the output stream holds `total` messages.
async fn deliver_five_in_order(
    (client, url, producer): (HttpsClient, String, Producer),
    aggregate: &str,
    js: &jetstream::Context,
    total: u64,
) {
    for message in messages_of(aggregate, 5) {
        assert_eq!(
            deliver_until_decided(&client, &url, &producer, &message).await,
            200
        );
    }
    poll_until_within(
        &format!("{total} messages in the output stream"),
        Duration::from_secs(30),
        || output_count(js),
        |count| *count >= total,
    )
    .await;
}

/// Sends `sequences` of each aggregate in `expected`'s keys to `gates` in turn, every
/// aggregate's in order, the aggregates at once, each until decided.
async fn deliver_range(
    client: &HttpsClient,
    gates: &[&GateProcess],
    producer: &Producer,
    aggregates: &[String],
    sequences: std::ops::RangeInclusive<i64>,
) {
    let mut senders = tokio::task::JoinSet::new();
    for (index, aggregate) in aggregates.iter().enumerate() {
        let messages: Vec<Message> = messages_of(aggregate, *sequences.end())
            .into_iter()
            .filter(|message| sequences.contains(&message.sequence))
            .collect();
        let url = gates[index % gates.len()].address.clone();
        let (client, producer) = (client.clone(), producer.clone());
        senders.spawn(async move {
            for message in &messages {
                assert_eq!(
                    deliver_until_decided(&client, &url, &producer, message).await,
                    200
                );
            }
        });
    }
    while let Some(sent) = senders.join_next().await {
        sent.expect("a sender");
    }
}

/// Every gate in `gates` until one holds the lease: that one.
async fn lease_holder<'a>(client: &HttpsClient, gates: [&'a GateProcess; 2]) -> &'a GateProcess {
    let holder = poll_until_within(
        "one gate holds the publisher's lease",
        Duration::from_secs(30),
        || async {
            for (index, gate) in gates.iter().enumerate() {
                if holds_the_lease(client, gate).await {
                    return Some(index);
                }
            }
            None
        },
        Option::is_some,
    )
    .await;
    gates[holder.unwrap_or_default()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publishing_gate_paused_past_its_lease_is_fenced_and_adds_no_duplicate_when_it_resumes() {
    let nats = crate::broker::start_nats(None);
    let js = crate::broker::jetstream_of(&nats).await;
    // A duplicate window shorter than the pause: it cannot be what drops a stale copy.
    js.create_stream(jetstream::stream::Config {
        name: OUTPUT_STREAM.to_owned(),
        subjects: vec![format!("{OUTPUT_PREFIX}.>")],
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .expect("the output stream");
    let certificate = Certificate::new();
    let database = crate::postgres::fresh_database();
    let env = [("GATE_DATABASE_URL", database.as_str())];
    let files = [0, 1].map(|_| {
        GateFiles::new(&certificate, &nats)
            .on_postgres()
            .with_lease_ms(1000)
    });
    let gates = [
        GateProcess::start_with_env(&files[0].config(), &env),
        GateProcess::start_with_env(&files[1].config(), &env),
    ];
    let operator = add_operator_on(&["--inbox".into(), database.as_str().into()], "alice");
    let client = certificate.client();
    let producer = add_producer(&client, &gates[0], &operator, "shop").await;
    let aggregates: Vec<String> = (0..4).map(|i| format!("order-{i}")).collect();
    let wait_for_output = |count: u64| {
        poll_until_within(
            "the output stream holds the rows",
            Duration::from_secs(60),
            || output_count(&js),
            move |held| *held >= count,
        )
    };

    deliver_range(
        &client,
        &[&gates[0], &gates[1]],
        &producer,
        &aggregates,
        1..=10,
    )
    .await;
    wait_for_output(40).await;
    let stale = lease_holder(&client, [&gates[0], &gates[1]]).await;
    let (stale_files, standby) = if std::ptr::eq(stale, &gates[0]) {
        (&files[0], &gates[1])
    } else {
        (&files[1], &gates[0])
    };
    stale.signal("STOP");
    deliver_range(&client, &[standby], &producer, &aggregates, 11..=20).await;
    poll_until_within(
        "the standby gate takes the lease over",
        Duration::from_secs(30),
        || holds_the_lease(&client, standby),
        |held| *held,
    )
    .await;
    wait_for_output(80).await;
    stale.signal("CONT");
    poll_until_within(
        "the resumed gate logs that it was fenced",
        Duration::from_secs(30),
        || std::future::ready(stale_files.log()),
        |log| log.contains("gate publisher fenced"),
    )
    .await;
    poll_until_within(
        "the resumed gate stands by",
        Duration::from_secs(30),
        || holds_the_lease(&client, stale),
        |held| !*held,
    )
    .await;
    deliver_range(
        &client,
        &[&gates[0], &gates[1]],
        &producer,
        &aggregates,
        21..=25,
    )
    .await;
    wait_for_output(100).await;
    let expected: BTreeMap<String, i64> = aggregates.iter().map(|a| (a.clone(), 25)).collect();
    let output = read_output(&js).await;
    assert_in_order_once(&output, &expected);
    assert_eq!(output_count(&js).await, 100, "no copy in the stream");
}

/// A loopback gate without `[tls]` or `[nats]`: one message type, one reader, `extra` appended
/// to the file. Answers its directory and its config's path.
fn plain_gate_files(extra: &str) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temp dir");
    std::fs::write(dir.path().join("placed.json"), PLACED_SCHEMA).expect("the schema");
    let config = dir.path().join("gate.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[listen]
address = "127.0.0.1:0"

[store]
sqlite = "gate.db"

[auth]
readers = [{{ name = "dashboard", token = "{PLAIN_READER_TOKEN}" }}]

[types."order.placed"]
schema = "placed.json"
{extra}"#
        ),
    )
    .expect("the config");
    (dir, config)
}

const PLAIN_READER_TOKEN: &str = "reader-token-of-the-plain-gate";

#[tokio::test]
async fn metrics_that_are_not_public_answer_a_readers_or_an_operators_token_and_401_without() {
    let (dir, config) = plain_gate_files("\n[metrics]\npublic = false\n");
    let gate = GateProcess::start(&config);
    let operator = add_operator(&dir.path().join("gate.db"), "alice");
    let http = crate::helpers::client();
    let scrape = |token: Option<&str>| {
        let request = http.get(gate.url("/metrics"));
        match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
        .send()
    };
    let anonymous = scrape(None).await.expect("GET /metrics");
    assert_eq!(anonymous.status(), 401);
    assert!(anonymous.headers().contains_key("www-authenticate"));
    let wrong = scrape(Some("not-a-token")).await.expect("GET /metrics");
    assert_eq!(wrong.status(), 401);
    for token in [PLAIN_READER_TOKEN, operator.as_str()] {
        let response = scrape(Some(token)).await.expect("GET /metrics");
        assert_eq!(response.status(), 200);
        let text = response.text().await.expect("the metrics");
        assert!(text.contains("inbox_resolutions_total"), "{text}");
    }
}

impl GateFiles {
    /// The same files serving plain HTTP on loopback behind `trusted_proxy`.
    fn behind_proxy(self, trusted_proxy: &str) -> GateFiles {
        let text = std::fs::read_to_string(self.config()).unwrap();
        let text = text
            .replace(
                "address = \"127.0.0.1:0\"",
                &format!("address = \"127.0.0.1:0\"\ntrusted_proxy = \"{trusted_proxy}\""),
            )
            .replace("[tls]\ncertificate = \"cert.pem\"\nkey = \"key.pem\"\n", "");
        std::fs::write(self.config(), text).unwrap();
        self
    }

    /// The `client` of the gate's `request finished` line for the request with `request_id`,
    /// once it is logged.
    async fn logged_client(&self, request_id: &str) -> Value {
        let line = poll_until_within(
            "the request's line in the gate's log",
            Duration::from_secs(10),
            || {
                let line = self
                    .log()
                    .lines()
                    .filter_map(|line| serde_json::from_str::<Value>(line).ok())
                    .find(|line| {
                        line["span"]["request_id"] == request_id
                            && line["fields"]["message"] == "request finished"
                    });
                std::future::ready(line)
            },
            Option::is_some,
        )
        .await;
        line.map_or(Value::Null, |line| line["span"]["client"].clone())
    }
}

/// A `GET /live` from this test (peer 127.0.0.1) saying it was forwarded for
/// 198.51.100.7; the header value names an address, no traffic goes there.
async fn forwarded_request(gate: &GateProcess, request_id: &str) {
    let response = crate::helpers::client()
        .get(gate.url("/live"))
        .header("x-request-id", request_id)
        .header("x-forwarded-for", "203.0.113.99, 198.51.100.7")
        .send()
        .await
        .expect("the gate answers");
    assert_eq!(response.status(), 200);
}

mod behind_a_proxy {
    use super::*;

    #[tokio::test]
    async fn the_trusted_proxys_rightmost_forwarded_entry_is_the_client_in_the_access_log_and_another_peers_header_is_ignored()
     {
        let nats = crate::broker::start_nats(None);
        let certificate = Certificate::new();
        let trusted = GateFiles::new(&certificate, &nats).behind_proxy("127.0.0.1");
        let gate = GateProcess::start(&trusted.config());
        assert!(gate.url("").starts_with("http://"), "{}", gate.url(""));
        forwarded_request(&gate, "through-the-proxy").await;
        assert_eq!(
            trusted.logged_client("through-the-proxy").await,
            "198.51.100.7"
        );
        gate.kill();

        let elsewhere = GateFiles::new(&certificate, &nats).behind_proxy("127.0.0.2");
        let gate = GateProcess::start(&elsewhere.config());
        forwarded_request(&gate, "not-the-proxy").await;
        assert_eq!(elsewhere.logged_client("not-the-proxy").await, "127.0.0.1");
    }

    /// An anonymous delivery of `sequence` to `aggregate`, forwarded by this test (the trusted
    /// proxy) for `client`: its status.
    async fn anonymous_delivery(
        gate: &GateProcess,
        client: &str,
        aggregate: &str,
        sequence: i64,
    ) -> u16 {
        let body = json!({
            "messageId": format!("{aggregate}-m{sequence}"),
            "sequence": sequence,
            "type": "order.placed",
            "payload": {"orderId": aggregate, "amount": 5},
        });
        crate::helpers::client()
            .post(gate.url(&format!("/v1/aggregates/{aggregate}/messages")))
            .header("x-forwarded-for", client)
            .json(&body)
            .send()
            .await
            .expect("the gate answers")
            .status()
            .as_u16()
    }

    #[tokio::test]
    async fn behind_the_trusted_proxy_each_forwarded_client_has_its_own_anonymous_budget() {
        let nats = crate::broker::start_nats(None);
        let certificate = Certificate::new();
        let files = GateFiles::new(&certificate, &nats).behind_proxy("127.0.0.1");
        let text = std::fs::read_to_string(files.config()).unwrap();
        let text = format!(
            "{text}\n[auth]\nanonymous_writes = true\n\n[limits]\nproducer_rate_per_second = 1\nproducer_burst = 1\n"
        );
        std::fs::write(files.config(), text).unwrap();
        let gate = GateProcess::start(&files.config());
        assert_eq!(
            anonymous_delivery(&gate, "198.51.100.7", "a-1", 1).await,
            200
        );
        assert_eq!(
            anonymous_delivery(&gate, "198.51.100.7", "a-1", 2).await,
            429,
            "the same client, over its burst"
        );
        assert_eq!(
            anonymous_delivery(&gate, "198.51.100.8", "a-2", 1).await,
            200,
            "another client behind the same proxy"
        );
    }

    #[tokio::test]
    async fn a_gate_whose_output_stream_has_a_single_replica_warns_at_start() {
        let nats = crate::broker::start_nats(None);
        let certificate = Certificate::new();
        let files = GateFiles::new(&certificate, &nats);
        let _gate = GateProcess::start(&files.config());
        let warning = files
            .log()
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .find(|line| line["fields"]["stream"] == OUTPUT_STREAM)
            .unwrap_or_else(|| panic!("no warning naming the stream in:\n{}", files.log()));
        assert_eq!(warning["level"], "WARN", "{warning}");
        let message = warning["fields"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("a single replica"), "{message}");
        assert!(!message.contains("memory storage"), "{message}");
    }
}

/// `/ready`'s publisher member: its role and epoch.
async fn publisher_status(client: &HttpsClient, gate: &GateProcess) -> (String, i64) {
    let body = match client.get(gate.url("/ready")).send().await {
        Ok(response) => response.json::<Value>().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let role = body["publisher"]["role"].as_str().unwrap_or_default();
    (
        role.to_owned(),
        body["publisher"]["epoch"].as_i64().unwrap_or(-1),
    )
}

/// Runs `sql` on the gate's SQLite file beside the running gate.
fn execute_on(database: &Path, sql: &str) {
    let connection = rusqlite::Connection::open(database).expect("the gate's file");
    connection
        .busy_timeout(Duration::from_secs(10))
        .expect("a busy timeout");
    connection
        .execute_batch(sql)
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_gate_shows_its_output_backlog_growing_and_it_drains_to_zero_once_it_holds_the_lease()
 {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats).with_lease_ms(1000);
    let gate = GateProcess::start(&files.config());
    let client = certificate.client();
    let operator = add_operator(&files.database(), "alice");
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let status = poll_until_within(
        "the gate holds the lease",
        Duration::from_secs(20),
        || publisher_status(&client, &gate),
        |(role, _)| role == "holder",
    )
    .await;
    assert_eq!(status.1, 1, "the first lease of the store");
    assert_eq!(
        scraped(&client, &gate, "gate_publisher_epoch").await,
        Some(1.0)
    );

    // Another gate (none runs) takes the lease for an hour: this one stands by and publishes
    // nothing.
    execute_on(
        &files.database(),
        "UPDATE gate_publisher_lease SET holder = 'elsewhere', epoch = 2,
                expires_at_ms = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) + 3600000",
    );
    poll_until_within(
        "the gate stands by at the other's epoch",
        Duration::from_secs(20),
        || publisher_status(&client, &gate),
        |status| *status == ("standby".to_owned(), 2),
    )
    .await;
    for message in messages_of("order-lag", 3) {
        assert_eq!(
            deliver_until_decided(&client, &gate.address, &producer, &message).await,
            200
        );
    }
    assert_eq!(
        scraped(&client, &gate, "gate_output_unpublished_rows").await,
        Some(3.0)
    );
    poll_until_within(
        "the oldest waiting row ages",
        Duration::from_secs(20),
        || scraped(&client, &gate, "gate_output_oldest_unpublished_seconds"),
        |age| age.is_some_and(|seconds| seconds >= 1.0),
    )
    .await;
    assert_eq!(
        scraped(&client, &gate, "gate_publisher_epoch").await,
        Some(2.0)
    );

    // The other lets its lease lapse: this gate takes it at the next epoch and publishes.
    execute_on(
        &files.database(),
        "UPDATE gate_publisher_lease SET expires_at_ms = 0",
    );
    poll_until_within(
        "the backlog drains",
        Duration::from_secs(30),
        || scraped(&client, &gate, "gate_output_unpublished_rows"),
        |rows| *rows == Some(0.0),
    )
    .await;
    assert_eq!(
        scraped(&client, &gate, "gate_output_oldest_unpublished_seconds").await,
        Some(0.0)
    );
    assert_eq!(
        publisher_status(&client, &gate).await,
        ("holder".to_owned(), 3)
    );
    assert_eq!(
        scraped(&client, &gate, "gate_publisher_epoch").await,
        Some(3.0)
    );
}

/// The sums of `/v1/lag`'s samples: (applied, published), each sample's rates checked against
/// its rows and its seconds on the way.
fn lag_sums(lag: &Value) -> (u64, u64) {
    let samples = lag["samples"].as_array().expect("the samples");
    let mut sums = (0, 0);
    for sample in samples {
        let seconds = sample["seconds"].as_f64().expect("the interval's seconds");
        assert!(seconds > 0.0, "{sample}");
        let applied = sample["applied"]
            .as_u64()
            .expect("the applied rows (below the cap)");
        let published = sample["published"].as_u64().expect("the published rows");
        for (rows, rate) in [
            (applied, &sample["appliedPerSecond"]),
            (published, &sample["publishedPerSecond"]),
        ] {
            let rate = rate.as_f64().expect("a rate");
            assert!(
                (rate * seconds - rows as f64).abs() < 0.05,
                "{rate}/s over {seconds} s is not {rows} rows: {sample}"
            );
        }
        sums = (sums.0 + applied, sums.1 + published);
    }
    sums
}

/// The backlog of the last sample of `/v1/lag`, if there is one.
fn last_backlog(lag: &Value) -> Option<i64> {
    lag["samples"].as_array()?.last()?["backlog"].as_i64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gates_lag_samples_count_the_rows_applied_while_it_stands_by_and_published_once_it_holds_the_lease()
 {
    let nats = crate::broker::start_nats(None);
    let certificate = Certificate::new();
    let files = GateFiles::new(&certificate, &nats).with_lease_ms(1000);
    let gate = GateProcess::start(&files.config());
    let client = certificate.client();
    let operator = add_operator(&files.database(), "alice");
    let producer = add_producer(&client, &gate, &operator, "shop").await;
    let unauthorized = client.get(gate.url("/v1/lag")).send().await.unwrap();
    assert_eq!(unauthorized.status(), 401);
    poll_until_within(
        "the gate holds the lease",
        Duration::from_secs(20),
        || publisher_status(&client, &gate),
        |(role, _)| role == "holder",
    )
    .await;
    // Another gate (none runs) holds the lease for an hour: the rows applied now wait.
    execute_on(
        &files.database(),
        "UPDATE gate_publisher_lease SET holder = 'elsewhere', epoch = 2,
                expires_at_ms = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) + 3600000",
    );
    poll_until_within(
        "the gate stands by",
        Duration::from_secs(20),
        || publisher_status(&client, &gate),
        |(role, _)| role == "standby",
    )
    .await;
    for message in messages_of("order-lagging", 4) {
        assert_eq!(
            deliver_until_decided(&client, &gate.address, &producer, &message).await,
            200
        );
    }
    let waiting = poll_until_within(
        "a sample shows the four waiting rows",
        Duration::from_secs(30),
        || gate_json(&client, &gate, &operator, "/v1/lag"),
        |lag| last_backlog(lag) == Some(4),
    )
    .await;
    assert_eq!(waiting["unpublishedRows"], 4, "{waiting}");
    assert_eq!(
        waiting["publisher"],
        json!({"role": "standby", "epoch": 2}),
        "{waiting}"
    );
    assert_eq!(waiting["sampleEverySeconds"], 5);
    assert_eq!(lag_sums(&waiting), (4, 0), "{waiting}");

    // The other lets its lease lapse: this gate publishes the four rows.
    execute_on(
        &files.database(),
        "UPDATE gate_publisher_lease SET expires_at_ms = 0",
    );
    let drained = poll_until_within(
        "a sample shows the backlog drained",
        Duration::from_secs(30),
        || gate_json(&client, &gate, &operator, "/v1/lag"),
        |lag| last_backlog(lag) == Some(0),
    )
    .await;
    assert_eq!(drained["unpublishedRows"], 0, "{drained}");
    assert_eq!(drained["oldestUnpublishedSeconds"], 0, "{drained}");
    assert_eq!(drained["publisher"]["role"], "holder", "{drained}");
    assert_eq!(lag_sums(&drained), (4, 4), "{drained}");
    let js = crate::broker::jetstream_of(&nats).await;
    assert_eq!(output_count(&js).await, 4);
}
