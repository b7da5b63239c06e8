//! The output stream as a downstream reads it, with no de-duplication of any kind: live during
//! the run (an ordered consumer, started again after the last stream sequence it saw whenever it
//! breaks), and in full at the end (every stream sequence fetched one by one).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use futures_util::StreamExt;
use serde_json::Value;

use super::ChaosError;
use super::history::{Event, OutputRead, ReadPhase, Recorder};
use super::topology::{OUTPUT_PREFIX, OUTPUT_STREAM};

/// What the live reader saw so far: the (aggregate, sequence) pairs and the last stream sequence.
#[derive(Clone, Default)]
pub struct LiveView {
    seen: Arc<Mutex<HashSet<(String, i64)>>>,
    last: Arc<AtomicU64>,
}

impl LiveView {
    pub fn contains(&self, aggregate: &str, sequence: i64) -> bool {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&(aggregate.to_owned(), sequence))
    }

    pub fn last_stream_sequence(&self) -> u64 {
        self.last.load(Ordering::Relaxed)
    }
}

/// An output message's body and headers as read.
fn output_read(
    phase: ReadPhase,
    stream_sequence: u64,
    nats_message_id: String,
    payload: &[u8],
    at_ms: u64,
) -> OutputRead {
    let body: Value = serde_json::from_slice(payload).unwrap_or(Value::Null);
    OutputRead {
        phase,
        stream_sequence,
        nats_message_id,
        aggregate: body["aggregateId"].as_str().unwrap_or_default().to_owned(),
        sequence: body["sequence"].as_i64().unwrap_or(0),
        message_id: body["messageId"].as_str().unwrap_or_default().to_owned(),
        message_type: body["type"].as_str().unwrap_or_default().to_owned(),
        payload: body["payload"].clone(),
        at_ms,
    }
}

/// Reads the output stream live until `stop`, recording every message once per stream sequence.
pub async fn read_live(
    js: jetstream::Context,
    recorder: Recorder,
    view: LiveView,
    stop: Arc<AtomicBool>,
) {
    let mut next: u64 = 1;
    while !stop.load(Ordering::Relaxed) {
        let consumer = async {
            let stream = js.get_stream(OUTPUT_STREAM).await?;
            let consumer = stream
                .create_consumer(OrderedConfig {
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: next,
                    },
                    filter_subject: format!("{OUTPUT_PREFIX}.>"),
                    ..Default::default()
                })
                .await?;
            Ok::<_, async_nats::Error>(consumer.messages().await?)
        };
        let mut messages = match tokio::time::timeout(Duration::from_secs(5), consumer).await {
            Ok(Ok(messages)) => messages,
            _ => {
                // The cluster is between leaders: try again shortly.
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        while !stop.load(Ordering::Relaxed) {
            let message = match tokio::time::timeout(Duration::from_secs(1), messages.next()).await
            {
                Err(_) => continue,
                Ok(Some(Ok(message))) => message,
                Ok(_) => break,
            };
            let Ok(info) = message.info() else {
                break;
            };
            let stream_sequence = info.stream_sequence;
            if stream_sequence < next {
                continue;
            }
            next = stream_sequence + 1;
            let id = message
                .headers
                .as_ref()
                .and_then(|headers| headers.get("Nats-Msg-Id"))
                .map(|value| value.as_str().to_owned())
                .unwrap_or_default();
            let read = output_read(
                ReadPhase::Live,
                stream_sequence,
                id,
                &message.payload,
                recorder.now_ms(),
            );
            view.seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert((read.aggregate.clone(), read.sequence));
            view.last.store(stream_sequence, Ordering::Relaxed);
            recorder.record(Event::Read(read));
        }
    }
}

/// The last stream sequence of the output stream.
pub async fn last_sequence(js: &jetstream::Context) -> Result<u64, ChaosError> {
    let mut stream = js
        .get_stream(OUTPUT_STREAM)
        .await
        .map_err(|error| ChaosError::setup("the output stream", error))?;
    let info = stream
        .info()
        .await
        .map_err(|error| ChaosError::setup("the output stream's info", error))?;
    Ok(info.state.last_sequence)
}

/// Reads every message of the output stream, stream sequence by stream sequence, and records
/// each; a sequence the stream no longer has is skipped (the checker finds what is missing).
pub async fn read_everything(
    js: &jetstream::Context,
    recorder: &Recorder,
) -> Result<u64, ChaosError> {
    let last = last_sequence(js).await?;
    let stream = js
        .get_stream(OUTPUT_STREAM)
        .await
        .map_err(|error| ChaosError::setup("the output stream", error))?;
    let mut read = 0;
    for sequence in 1..=last {
        let mut attempts = 0;
        let message = loop {
            attempts += 1;
            match stream.get_raw_message(sequence).await {
                Ok(message) => break Some(message),
                Err(error)
                    if error.kind()
                        == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound =>
                {
                    break None;
                }
                Err(error) if attempts >= 20 => {
                    return Err(ChaosError::setup("reading the output stream", error));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        };
        let Some(message) = message else {
            continue;
        };
        let id = message
            .headers
            .get("Nats-Msg-Id")
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default();
        recorder.record(Event::Read(output_read(
            ReadPhase::Final,
            message.sequence,
            id,
            &message.payload,
            recorder.now_ms(),
        )));
        read += 1;
    }
    Ok(read)
}
