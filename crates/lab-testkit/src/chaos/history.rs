//! What a campaign saw, as the checker reads it: every client operation (its invocation and
//! completion times and whether it was acknowledged, refused or left indeterminate), every
//! session, every fault with its window, and every message read from the output stream, live
//! and again in full at the end, with no de-duplication of any kind. Written as JSON lines.

use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Through which door a message was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Door {
    Https,
    Nats,
}

/// How an operation ended, as Jepsen's ok / fail / info.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Acknowledged: HTTPS 200 (applied or replay), or a JetStream PubAck of a new message.
    Ok,
    /// Refused with nothing written (a 4xx verdict such as a gap or a fence).
    Fail,
    /// No answer, an error, a 5xx or a PubAck naming an earlier copy: it may or may not have
    /// been recorded.
    Indeterminate,
}

/// One send of one message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    pub id: u64,
    pub producer: String,
    pub door: Door,
    /// The gate asked, over HTTPS.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub gate: Option<usize>,
    pub epoch: i64,
    pub aggregate: String,
    pub sequence: i64,
    pub message_id: String,
    pub message_type: String,
    pub payload: Value,
    pub invoked_ms: u64,
    pub completed_ms: u64,
    pub outcome: Outcome,
    /// The status and verdict, or the error.
    pub detail: String,
}

/// A producer's session: the epoch it got, if it got one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    pub producer: String,
    pub epoch: Option<i64>,
    pub invoked_ms: u64,
    pub completed_ms: u64,
}

/// A fault as it happened: applied at `start_ms`, healed at `end_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FaultWindow {
    /// Its index in the seed's schedule.
    pub id: usize,
    /// What kind of fault, e.g. `partition gate-postgres`.
    pub kind: String,
    /// What it hit, e.g. `gate 0`.
    pub target: String,
    pub start_ms: u64,
    pub end_ms: u64,
    /// Whether, during it, PostgreSQL or a NATS majority was unavailable to every gate.
    pub breaks_liveness: bool,
}

/// When a message of the output stream was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadPhase {
    Live,
    Final,
}

/// One message of the output stream as read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OutputRead {
    pub phase: ReadPhase,
    pub stream_sequence: u64,
    /// Its `Nats-Msg-Id`.
    pub nats_message_id: String,
    pub aggregate: String,
    pub sequence: i64,
    pub message_id: String,
    pub message_type: String,
    pub payload: Value,
    pub at_ms: u64,
}

/// A gap notice a producer received.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Notice {
    pub producer: String,
    pub aggregate: String,
    pub from: i64,
    pub through: i64,
    pub at_ms: u64,
}

/// One line of the history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Event {
    Op(Operation),
    Session(Session),
    Fault(FaultWindow),
    Read(OutputRead),
    Notice(Notice),
}

/// The history being recorded, shared by every task of a run; clones share it.
#[derive(Clone)]
pub struct Recorder {
    started: Instant,
    events: Arc<Mutex<Vec<Event>>>,
    next_operation: Arc<std::sync::atomic::AtomicU64>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    pub fn new() -> Recorder {
        Recorder {
            started: Instant::now(),
            events: Arc::new(Mutex::new(Vec::new())),
            next_operation: Arc::new(std::sync::atomic::AtomicU64::new(1)),
        }
    }

    /// Milliseconds since the run started.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A fresh operation id.
    pub fn operation_id(&self) -> u64 {
        self.next_operation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    pub fn record(&self, event: Event) {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(event);
    }

    /// Every event so far, in the order recorded.
    pub fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Writes `events` to `path` as JSON lines.
pub fn write_lines(path: &Path, events: &[Event]) -> std::io::Result<()> {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    for event in events {
        serde_json::to_writer(&mut file, event)?;
        file.write_all(b"\n")?;
    }
    file.flush()
}

/// Reads a history written by [`write_lines`].
pub fn read_lines(path: &Path) -> std::io::Result<Vec<Event>> {
    let text = std::fs::read_to_string(path)?;
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).map_err(std::io::Error::other))
        .collect()
}
