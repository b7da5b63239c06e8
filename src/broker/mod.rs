//! The lab's NATS JetStream door: the HTTP edge's consumer ([`http_edge::jetstream`]) with the
//! lesson's general-door JSON, its evidence over HTTP (`GET /broker`, `GET /broker/rejected`), the
//! test-only fault switch (`POST /lab/broker/pause-after-commit`) in [`routes`], and the producer
//! side for walk-throughs ([`publish_one`]).

mod routes;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use ordered_inbox::OrderedMessage;

pub use http_edge::jetstream::*;
pub use routes::routes;

use crate::config::StartupError;
use crate::inbox::ledger;
use crate::telemetry::metrics::Metrics;

/// The lab's broker door: the consumer's evidence and the fault switch that stops it after a
/// COMMIT, before its acks. Cheap to clone.
#[derive(Clone)]
pub struct BrokerLab {
    status: ConsumerStatus,
    pause: Arc<PauseAfterCommit>,
}

/// The fault switch: armed, the next batch stops after its COMMIT, before its acks.
#[derive(Default)]
struct PauseAfterCommit(AtomicBool);

impl AfterCommit for PauseAfterCommit {
    fn stop_before_acks(&self) -> bool {
        self.0.swap(false, Ordering::SeqCst)
    }
}

impl BrokerLab {
    /// The evidence of a consumer whose own refusals are counted in `metrics`.
    pub fn with_metrics(metrics: Metrics) -> BrokerLab {
        let pause = Arc::new(PauseAfterCommit::default());
        let status =
            ConsumerStatus::with_observer(Arc::new(metrics)).with_after_commit(pause.clone());
        BrokerLab { status, pause }
    }

    /// The consumer's evidence, to hand to [`connect_consumer`].
    pub fn status(&self) -> ConsumerStatus {
        self.status.clone()
    }

    /// The consumer's settings, once it connected.
    pub fn config(&self) -> Option<&BrokerConfig> {
        self.status.config()
    }

    /// Whether its NATS connection is up now; `None` before it connected.
    pub fn is_connected(&self) -> Option<bool> {
        self.status.is_connected()
    }

    /// What the consumer did so far.
    pub fn counters(&self) -> Counters {
        self.status.counters()
    }

    /// The consumer's pending and un-acked counts, as the NATS server reports them now.
    pub async fn consumer_info(&self) -> Option<Result<(u64, usize), String>> {
        self.status.consumer_info().await
    }

    /// Arms the fault switch: after the next COMMIT the consumer stops before acking.
    pub fn arm_pause_after_commit(&self) {
        self.pause.0.store(true, Ordering::SeqCst);
    }
}

/// A message's body on the wire, the general door's JSON: `{"messageId","sequence","amount"}`
/// (the amount is the ledger's, from the payload).
pub fn general_body(message: &OrderedMessage) -> serde_json::Value {
    serde_json::json!({
        "messageId": message.message_id,
        "sequence": message.sequence,
        "amount": ledger::amount(message),
    })
}

/// What `production-lab publish` reports for one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub subject: String,
    pub stream: String,
    pub stream_sequence: u64,
    /// JetStream's duplicate window dropped it: an earlier publish had the same id.
    pub duplicate: bool,
}

/// Who publishes a message, for a producer's headers.
#[derive(Clone, PartialEq, Eq)]
pub struct ProducerHeaders {
    pub producer: String,
    pub epoch: i64,
    pub token: String,
}

/// Publishes one message on the wire format (subject, `Nats-Msg-Id` header, general-door body,
/// and a producer's headers when `producer` is given) to loopback `urls` and waits for its
/// PubAck: the producer side, for walk-throughs.
pub async fn publish_one(
    urls: &str,
    prefix: &str,
    message: &OrderedMessage,
    producer: Option<&ProducerHeaders>,
) -> Result<Published, StartupError> {
    let urls = parse_nats_urls(urls)?;
    let failed = |what: &str, error: &dyn std::fmt::Display| {
        StartupError::Broker(format!("NATS at {}: {what}: {error}", urls.join(",")))
    };
    let addresses = server_addresses(&urls).map_err(|error| failed("invalid address", &error))?;
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(3))
        .connect(addresses)
        .await
        .map_err(|error| failed("cannot connect", &error))?;
    let context = jetstream::new(client.clone());
    let subject = wire::subject_for(prefix, &message.aggregate_id);
    let mut headers = async_nats::HeaderMap::new();
    let nats_id = wire::nats_message_id(
        producer.map(|producer| producer.producer.as_str()),
        &message.message_id,
    );
    headers.insert(wire::MESSAGE_ID_HEADER, nats_id.as_str());
    if let Some(producer) = producer {
        headers.insert(
            wire::AUTHORIZATION_HEADER,
            format!("Bearer {}", producer.token).as_str(),
        );
        headers.insert(
            wire::PRODUCER_EPOCH_HEADER,
            producer.epoch.to_string().as_str(),
        );
    }
    let body = general_body(message);
    let ack = context
        .publish_with_headers(subject.clone(), headers, body.to_string().into())
        .await
        .map_err(|error| failed("cannot publish", &error))?
        .await
        .map_err(|error| failed("no PubAck (is a consumer's stream there?)", &error))?;
    let _ = client.flush().await;
    Ok(Published {
        subject,
        stream: ack.stream,
        stream_sequence: ack.sequence,
        duplicate: ack.duplicate,
    })
}
