//! Two gates, a PostgreSQL and a three-node NATS cluster on hosts of their own: network
//! namespaces around a bridge (lab_testkit::netns, the deployment built by
//! lab_testkit::chaos::topology), addresses from 10.213.0.0/16 that exist inside them only. PostgreSQL serves TLS with a CA the test makes and asks for SCRAM; the NATS
//! servers serve TLS, know the gates by nkeys and the producers by a password, and sync every
//! write (`sync_interval: always`, a current nats-server). Each gate reaches PostgreSQL over a
//! link of its own, so that one can be cut alone. The producers and the downstream reader run
//! on a client host of their own, on a thread that entered its namespace.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::consumer::DeliverPolicy;
use futures_util::StreamExt;
use lab_testkit::chaos::topology::{
    self as lab, Authority, GateFiles, Hosts, INPUT_PREFIX, NatsSync, OUTPUT_PREFIX, OUTPUT_STREAM,
    gate_command,
};
use lab_testkit::nats::subject_for;
use lab_testkit::netns::{Host, Topology, enter};
use lab_testkit::pg::ClusterOptions;
use rand::RngExt;
use rand::seq::SliceRandom;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::aggregates::add_operator_on;
use crate::gate::{GateProcess, Producer, add_producer};
use crate::helpers::{binary, poll_until_within};
use crate::https::HttpsClient;

const AGGREGATES_PER_PRODUCER: usize = 3;
/// The output stream's duplicate window: shorter than the publishing gate's pause, so that it
/// cannot be what keeps a stale copy out.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(5);
const PAUSE: Duration = Duration::from_secs(7);
const CUT: Duration = Duration::from_secs(15);

fn start_gate(topology: &Topology, host: &Host, files: &GateFiles) -> GateProcess {
    let program = gate_command(topology, host, Path::new(binary()), files);
    GateProcess::start_command(program, &files.config)
}

/// One message of the workload.
#[derive(Debug, Clone)]
struct Message {
    aggregate: String,
    sequence: i64,
    message_id: String,
    kind: &'static str,
    payload: Value,
}

impl Message {
    fn new(aggregate: &str, sequence: i64) -> Message {
        let (kind, payload) = if sequence % 2 == 1 {
            (
                "order.placed",
                json!({ "orderId": aggregate, "amount": sequence }),
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
    }

    fn body(&self) -> Value {
        json!({
            "messageId": self.message_id,
            "sequence": self.sequence,
            "type": self.kind,
            "payload": self.payload,
        })
    }
}

/// Everything a producer needs to send: both gates' URLs, the HTTPS client, JetStream.
#[derive(Clone)]
struct Senders {
    gates: [String; 2],
    https: HttpsClient,
    js: jetstream::Context,
    /// Bounds the connections open at once.
    permits: Arc<Semaphore>,
}

impl Senders {
    /// Sends `message` over HTTPS until a gate answers 200 (applied or a replay), trying the
    /// gates in turn from a random one: an early message is answered 409 gap and sent again, a
    /// gate that does not answer within two seconds (paused, cut from its store) is left for
    /// the other.
    async fn over_https(&self, producer: &Producer, message: &Message) {
        let mut turn = rand::rng().random_range(0..2usize);
        let started = Instant::now();
        loop {
            let url = format!(
                "{}/v1/aggregates/{}/messages",
                self.gates[turn % 2],
                message.aggregate
            );
            turn += 1;
            let status = {
                let _permit = self.permits.acquire().await.expect("a permit");
                let request = self
                    .https
                    .post(&url)
                    .bearer_auth(&producer.token)
                    .header("Producer-Epoch", producer.epoch.to_string())
                    .json(&message.body())
                    .send();
                match tokio::time::timeout(Duration::from_secs(2), request).await {
                    Ok(Ok(response)) => response.status().as_u16(),
                    _ => 0,
                }
            };
            match status {
                200 => return,
                409 | 0 | 500..=599 => {}
                other => panic!("{} answered {other}", message.message_id),
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "{} never applied over HTTPS",
                message.message_id
            );
            // The next try's pace, not a wait for a fact: the answer decides.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Publishes `message` to the input stream until JetStream acknowledges it.
    async fn over_nats(&self, producer: &Producer, message: &Message) {
        let started = Instant::now();
        loop {
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
            let acked = match self
                .js
                .publish_with_headers(
                    subject_for(INPUT_PREFIX, &message.aggregate),
                    headers,
                    message.body().to_string().into(),
                )
                .await
            {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            };
            if acked {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{} never acknowledged by JetStream",
                message.message_id
            );
        }
    }
}

/// Sends `sequences` of every producer's aggregates, shuffled, each message twice (over HTTPS
/// to either gate or over NATS, at random), all at once; returns when every copy was
/// acknowledged.
async fn deliver(
    senders: &Senders,
    producers: &[(Producer, Vec<String>)],
    sequences: std::ops::RangeInclusive<i64>,
) {
    let mut sends: Vec<(Producer, Message)> = Vec::new();
    for (producer, aggregates) in producers {
        for aggregate in aggregates {
            for sequence in sequences.clone() {
                let message = Message::new(aggregate, sequence);
                sends.push((producer.clone(), message.clone()));
                sends.push((producer.clone(), message));
            }
        }
    }
    sends.shuffle(&mut rand::rng());
    let mut tasks = tokio::task::JoinSet::new();
    for (producer, message) in sends {
        let senders = senders.clone();
        let over_nats = rand::rng().random_bool(0.5);
        tasks.spawn(async move {
            if over_nats {
                senders.over_nats(&producer, &message).await;
            } else {
                senders.over_https(&producer, &message).await;
            }
        });
    }
    while let Some(sent) = tasks.join_next().await {
        sent.expect("a sender");
    }
}

async fn holds_the_lease(client: &HttpsClient, gate: &GateProcess) -> bool {
    let scrape = client.get(gate.url("/metrics")).send();
    let Ok(Ok(response)) = tokio::time::timeout(Duration::from_secs(2), scrape).await else {
        return false;
    };
    response
        .text()
        .await
        .unwrap_or_default()
        .lines()
        .any(|line| {
            line.strip_prefix("gate_publisher_holding ")
                .is_some_and(|value| value.trim() == "1")
        })
}

/// The index of the gate holding the publisher's lease, once one does.
async fn holder(client: &HttpsClient, gates: &[GateProcess; 2], not: Option<usize>) -> usize {
    poll_until_within(
        "a gate holds the publisher's lease",
        Duration::from_secs(45),
        || async {
            for (index, gate) in gates.iter().enumerate() {
                if Some(index) != not && holds_the_lease(client, gate).await {
                    return Some(index);
                }
            }
            None
        },
        Option::is_some,
    )
    .await
    .expect("a holder")
}

/// One message of the output stream as read: its stream sequence, `Nats-Msg-Id` and body.
#[derive(Debug)]
struct Emitted {
    id: String,
    body: Value,
}

/// The whole output stream, message by message from its first, with no de-duplication of any
/// kind: an ordered consumer, read until it has the stream's count.
async fn read_everything(js: &jetstream::Context) -> Vec<Emitted> {
    let mut stream = js
        .get_stream(OUTPUT_STREAM)
        .await
        .expect("the output stream");
    let count = stream.info().await.expect("its info").state.messages as usize;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            deliver_policy: DeliverPolicy::All,
            filter_subject: format!("{OUTPUT_PREFIX}.>"),
            ..Default::default()
        })
        .await
        .expect("an ordered consumer");
    let mut messages = consumer.messages().await.expect("its messages");
    let mut emitted = Vec::with_capacity(count);
    while emitted.len() < count {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("the next output message within 10 s")
            .expect("the consumer goes on")
            .expect("an output message");
        let id = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Nats-Msg-Id"))
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default();
        let body = serde_json::from_slice(&message.payload).expect("an output body");
        emitted.push(Emitted { id, body });
    }
    emitted
}

async fn output_count(js: &jetstream::Context) -> u64 {
    match js.get_stream(OUTPUT_STREAM).await {
        Ok(mut stream) => stream.info().await.map_or(0, |info| info.state.messages),
        Err(_) => 0,
    }
}

#[test]
fn across_network_namespaces_a_paused_publisher_and_a_gate_cut_from_postgresql_leave_every_acknowledged_message_once_and_in_order()
 {
    let mut topology = Topology::new().unwrap_or_else(|e| panic!("{e}"));
    let hosts = lab::hosts(&mut topology, 0).unwrap_or_else(|e| panic!("{e}"));
    let topology = &topology;
    let hosts = &hosts;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                enter(&hosts.client).unwrap_or_else(|e| panic!("{e}"));
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(4)
                    .enable_all()
                    .build()
                    .expect("a runtime")
                    .block_on(scenario(topology, hosts));
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    });
}

async fn scenario(topology: &Topology, hosts: &Hosts) {
    let authority = Authority::new().unwrap_or_else(|e| panic!("{e}"));
    let nats_dir = tempfile::tempdir().expect("a temp dir");
    let gate_key = nkeys::KeyPair::new_user();
    let seed = gate_key.seed().expect("the gates' seed");
    let cluster = lab::postgres(hosts, &authority, ClusterOptions::for_tests())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _nats = lab::nats_cluster(
        topology,
        hosts,
        &authority,
        nats_dir.path(),
        &gate_key.public_key(),
        NatsSync::Always,
        &[],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let ca = nats_dir.path().join("ca.pem");
    let js = lab::producer_jetstream(hosts, &ca)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    lab::create_streams(&js, DUPLICATE_WINDOW)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let https_names: Vec<String> = hosts
        .gates
        .iter()
        .map(|host| host.address.to_string())
        .collect();
    let https = authority
        .server(&https_names)
        .unwrap_or_else(|e| panic!("{e}"));
    let files: Vec<GateFiles> = (0..2)
        .map(|index| {
            let postgres_address = hosts
                .postgres_address_for(index)
                .unwrap_or_else(|e| panic!("{e}"));
            lab::gate_files(
                &hosts.gates[index],
                &postgres_address,
                hosts,
                &authority,
                &https,
                &seed,
            )
            .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    let gates = [
        start_gate(topology, &hosts.gates[0], &files[0]),
        start_gate(topology, &hosts.gates[1], &files[1]),
    ];
    let https_client = HttpsClient::trusting(&authority.ca_pem);
    let operator = add_operator_on(
        &["--inbox".into(), cluster.socket_url("gate").into()],
        "alice",
    );
    let mut producers = Vec::new();
    for index in 0..4 {
        let producer = add_producer(
            &https_client,
            &gates[index % 2],
            &operator,
            &format!("shop-{index}"),
        )
        .await;
        let aggregates: Vec<String> = (0..AGGREGATES_PER_PRODUCER)
            .map(|k| format!("order-{index}-{k}"))
            .collect();
        producers.push((producer, aggregates));
    }
    let senders = Senders {
        gates: [gates[0].url(""), gates[1].url("")],
        https: https_client.clone(),
        js: js.clone(),
        permits: Arc::new(Semaphore::new(48)),
    };

    deliver(&senders, &producers, 1..=10).await;

    // The publishing gate is paused past the output's duplicate window while deliveries go on;
    // the other takes the lease over.
    let paused = holder(&https_client, &gates, None).await;
    let other = 1 - paused;
    gates[paused].signal("STOP");
    let stopped = Instant::now();
    let during_pause = deliver(&senders, &producers, 11..=20);
    let takeover = async {
        holder(&https_client, &gates, Some(paused)).await;
        tokio::time::sleep(PAUSE.saturating_sub(stopped.elapsed())).await;
    };
    tokio::join!(during_pause, takeover);
    assert!(stopped.elapsed() > DUPLICATE_WINDOW);
    gates[paused].signal("CONT");

    // The other gate, now publishing, is cut from PostgreSQL; the resumed one takes over.
    topology
        .set_link(&hosts.store_links[other], false)
        .unwrap_or_else(|e| panic!("{e}"));
    let cut = Instant::now();
    let during_cut = deliver(&senders, &producers, 21..=30);
    let restore = async {
        holder(&https_client, &gates, Some(other)).await;
        tokio::time::sleep(CUT.saturating_sub(cut.elapsed())).await;
        topology
            .set_link(&hosts.store_links[other], true)
            .unwrap_or_else(|e| panic!("{e}"));
    };
    tokio::join!(during_cut, restore);

    deliver(&senders, &producers, 31..=40).await;
    let total = (producers.len() * AGGREGATES_PER_PRODUCER * 40) as u64;
    poll_until_within(
        "the output stream holds every message",
        Duration::from_secs(60),
        || output_count(&js),
        |count| *count >= total,
    )
    .await;

    let emitted = read_everything(&js).await;
    assert_eq!(
        emitted.len() as u64,
        total,
        "no message twice, none missing"
    );
    let mut by_aggregate: BTreeMap<String, Vec<(i64, String)>> = BTreeMap::new();
    for message in &emitted {
        let aggregate = message.body["aggregateId"].as_str().unwrap_or_default();
        let sequence = message.body["sequence"].as_i64().unwrap_or_default();
        assert_eq!(
            message.id,
            format!("{aggregate}:{sequence}"),
            "its Nats-Msg-Id"
        );
        by_aggregate.entry(aggregate.to_owned()).or_default().push((
            sequence,
            message.body["messageId"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        ));
    }
    for (_, aggregates) in &producers {
        for aggregate in aggregates {
            // Every message was acknowledged (a 200 or a PubAck) before the reading: each is
            // there at its sequence, once, in order.
            let expected: Vec<(i64, String)> = (1..=40)
                .map(|sequence| (sequence, format!("{aggregate}-m{sequence}")))
                .collect();
            assert_eq!(
                by_aggregate.get(aggregate),
                Some(&expected),
                "the output of {aggregate}"
            );
        }
    }
    drop(gates);
}
