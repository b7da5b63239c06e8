//! Producers that behave like real clients of the gate, each on a host of its own: a session
//! and its epoch (and, now and then, a new instance's session that fences the old epoch),
//! messages of short-lived aggregates sent over both doors (HTTPS to either gate, NATS to the
//! input stream), some ahead of their turn, some twice, every send retried with a growing pause
//! until acknowledged, and resends of what a gap notice or a new session says is missing.
//!
//! Every send is one operation of the history, with its outcome as the producer saw it.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream;
use futures_util::StreamExt;
use hyper::Method;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::nats::subject_for;

use super::history::{Door, Event, Notice, Operation, Outcome, Recorder, Session};
use super::https::HttpsClient;
use super::topology::{GAP_SUBJECTS, INPUT_PREFIX};

/// How long one HTTPS exchange or one PubAck may take before the send is indeterminate.
const SEND_TIMEOUT: Duration = Duration::from_secs(3);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_LAST: Duration = Duration::from_secs(2);
/// Sends in flight at once, per producer.
const IN_FLIGHT: usize = 12;
/// Aggregates a producer writes at once.
const ACTIVE_AGGREGATES: usize = 3;

/// Where a campaign is: producing, finishing what was started, or stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Producing = 0,
    Finishing = 1,
    Stopped = 2,
}

/// The phase shared by the campaign and its producers.
#[derive(Clone, Default)]
pub struct SharedPhase(Arc<AtomicU8>);

impl SharedPhase {
    pub fn get(&self) -> Phase {
        match self.0.load(Ordering::Relaxed) {
            0 => Phase::Producing,
            1 => Phase::Finishing,
            _ => Phase::Stopped,
        }
    }

    pub fn set(&self, phase: Phase) {
        self.0.store(phase as u8, Ordering::Relaxed);
    }
}

/// What a producer is given.
#[derive(Clone)]
pub struct ProducerSetup {
    pub index: usize,
    pub name: String,
    pub token: String,
    /// A token that may read the gate's views (the campaign's operator).
    pub reader_token: String,
    pub gates: Vec<String>,
    pub https: HttpsClient,
    pub seed: u64,
    /// Whether this producer starts a new session (a new instance) once during the run.
    pub restarts: bool,
}

/// One message of the workload: its content is fixed by its aggregate and sequence.
#[derive(Debug, Clone)]
struct Message {
    aggregate: String,
    sequence: i64,
    message_id: String,
    kind: &'static str,
    payload: Value,
}

impl Message {
    fn new(aggregate: &str, sequence: i64, salt: u64) -> Message {
        let (kind, payload) = if sequence % 2 == 1 {
            let amount = (salt.wrapping_mul(31).wrapping_add(sequence as u64)) % 100_000;
            (
                "order.placed",
                json!({ "orderId": aggregate, "amount": amount }),
            )
        } else {
            let carriers = ["dhl", "ups", "gls", "dpd"];
            let carrier = carriers[(salt as usize + sequence as usize) % carriers.len()];
            (
                "order.shipped",
                json!({ "orderId": aggregate, "carrier": carrier }),
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

/// One aggregate of a producer: how long it will be and how far it got.
struct Aggregate {
    id: String,
    length: i64,
    /// The next sequence to introduce.
    next: i64,
    salt: u64,
}

/// A producer's state, shared by its tasks.
struct State {
    epoch: i64,
    aggregates: HashMap<String, Aggregate>,
    /// Aggregates still being written, in order of creation.
    active: Vec<String>,
    created: usize,
    /// Sequences with a send task in progress.
    sending: BTreeSet<(String, i64)>,
    /// Sequences acknowledged over HTTPS (applied or replay): no resend needed ever.
    confirmed: BTreeSet<(String, i64)>,
    rng: StdRng,
}

/// A running producer.
pub struct Producer {
    setup: ProducerSetup,
    js: jetstream::Context,
    recorder: Recorder,
    phase: SharedPhase,
    state: Mutex<State>,
    permits: Semaphore,
}

/// Why a send is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reason {
    /// The message's first sends, over either door.
    Fresh,
    /// A second copy, sent once.
    Duplicate,
    /// A gap notice or a new session said it is missing: over HTTPS, whose answer says.
    Resend,
}

impl Producer {
    pub fn new(
        setup: ProducerSetup,
        js: jetstream::Context,
        recorder: Recorder,
        phase: SharedPhase,
    ) -> Arc<Producer> {
        let rng = StdRng::seed_from_u64(setup.seed ^ ((setup.index as u64 + 1) << 32));
        Arc::new(Producer {
            setup,
            js,
            recorder,
            phase,
            state: Mutex::new(State {
                epoch: 0,
                aggregates: HashMap::new(),
                active: Vec::new(),
                created: 0,
                sending: BTreeSet::new(),
                confirmed: BTreeSet::new(),
                rng,
            }),
            permits: Semaphore::new(IN_FLIGHT),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn random_gate(&self) -> usize {
        self.state().rng.random_range(0..self.setup.gates.len())
    }

    /// Runs the producer until the campaign stops it: a session, then messages until the
    /// campaign finishes, then every started send retried until acknowledged (or stopped).
    pub async fn run(self: Arc<Self>, client: async_nats::Client, restart_at: Duration) {
        self.new_session().await;
        let (resend, mut resends) = tokio::sync::mpsc::unbounded_channel();
        let notices = tokio::spawn(self.clone().answer_notices(client, resend));
        let started = tokio::time::Instant::now();
        let mut restarted = !self.setup.restarts;
        let mut tasks = tokio::task::JoinSet::new();
        while self.phase.get() == Phase::Producing {
            if !restarted && started.elapsed() >= restart_at {
                restarted = true;
                self.new_session().await;
                self.resend_after_session(&mut tasks).await;
            }
            while let Ok(message) = resends.try_recv() {
                self.spawn_send(&mut tasks, message, Reason::Resend);
            }
            let Ok(permit) = self.permits.acquire().await else {
                break;
            };
            drop(permit);
            for (message, reason) in self.next_sends() {
                self.spawn_send(&mut tasks, message, reason);
            }
            while tasks.try_join_next().is_some() {}
            let pace = Duration::from_millis(self.state().rng.random_range(10..40));
            tokio::time::sleep(pace).await;
        }
        // Finishing: what was begun is retried until acknowledged, and what a notice says is
        // missing is sent again; new messages no more.
        loop {
            while let Ok(message) = resends.try_recv() {
                self.spawn_send(&mut tasks, message, Reason::Resend);
            }
            if tasks.is_empty() {
                break;
            }
            tokio::select! {
                _ = tasks.join_next() => {}
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
        notices.abort();
    }

    /// Whether every send this producer began has ended.
    pub fn idle(&self) -> bool {
        self.state().sending.is_empty()
    }

    fn spawn_send(
        self: &Arc<Self>,
        tasks: &mut tokio::task::JoinSet<()>,
        message: Message,
        reason: Reason,
    ) {
        let key = (message.aggregate.clone(), message.sequence);
        if reason != Reason::Duplicate && !self.state().sending.insert(key) {
            return;
        }
        let producer = self.clone();
        tasks.spawn(async move { producer.send_until_acknowledged(message, reason).await });
    }

    /// The messages to send next: the next sequence of an active aggregate, sometimes the one
    /// after it first (out of order), sometimes an earlier one again (a duplicate).
    fn next_sends(&self) -> Vec<(Message, Reason)> {
        let mut guard = self.state();
        let state = &mut *guard;
        while state.active.len() < ACTIVE_AGGREGATES {
            let id = format!("{}-o{}", self.setup.name, state.created);
            state.created += 1;
            let length = state.rng.random_range(3..14);
            let salt = state.rng.random_range(0..u64::from(u32::MAX));
            state.active.push(id.clone());
            state.aggregates.insert(
                id.clone(),
                Aggregate {
                    id,
                    length,
                    next: 1,
                    salt,
                },
            );
        }
        let active = state.active.len();
        let pick = state.rng.random_range(0..active);
        let id = state.active[pick].clone();
        let roll: f64 = state.rng.random_range(0.0..1.0);
        let Some(aggregate) = state.aggregates.get_mut(&id) else {
            return Vec::new();
        };
        let mut sends = Vec::new();
        if roll < 0.1 && aggregate.next > 1 {
            let sequence = aggregate.next - 1;
            sends.push((
                Message::new(&aggregate.id, sequence, aggregate.salt),
                Reason::Duplicate,
            ));
        } else if roll < 0.25 && aggregate.next < aggregate.length {
            let first = aggregate.next;
            sends.push((
                Message::new(&aggregate.id, first + 1, aggregate.salt),
                Reason::Fresh,
            ));
            sends.push((
                Message::new(&aggregate.id, first, aggregate.salt),
                Reason::Fresh,
            ));
            aggregate.next += 2;
        } else {
            sends.push((
                Message::new(&aggregate.id, aggregate.next, aggregate.salt),
                Reason::Fresh,
            ));
            aggregate.next += 1;
        }
        if aggregate.next > aggregate.length {
            state.active.retain(|active| *active != id);
        }
        sends
    }

    /// Sends `message` until it is acknowledged (a duplicate: once), with a growing pause
    /// between tries; gives up only when the campaign stops.
    async fn send_until_acknowledged(self: Arc<Self>, message: Message, reason: Reason) {
        let mut backoff = BACKOFF_FIRST;
        loop {
            if self.phase.get() == Phase::Stopped {
                break;
            }
            let door = match reason {
                Reason::Resend => Door::Https,
                _ if self.state().rng.random_bool(0.5) => Door::Nats,
                _ => Door::Https,
            };
            let outcome = {
                let _permit = self.permits.acquire().await;
                match door {
                    Door::Https => self.over_https(&message).await,
                    Door::Nats => self.over_nats(&message).await,
                }
            };
            if outcome == Outcome::Ok || reason == Reason::Duplicate {
                break;
            }
            let jitter = self.state().rng.random_range(0.5..1.5);
            tokio::time::sleep(backoff.mul_f64(jitter)).await;
            backoff = (backoff * 2).min(BACKOFF_LAST);
        }
        if reason != Reason::Duplicate {
            self.state()
                .sending
                .remove(&(message.aggregate.clone(), message.sequence));
        }
    }

    fn operation(
        &self,
        message: &Message,
        door: Door,
        gate: Option<usize>,
        epoch: i64,
    ) -> Operation {
        Operation {
            id: self.recorder.operation_id(),
            producer: self.setup.name.clone(),
            door,
            gate,
            epoch,
            aggregate: message.aggregate.clone(),
            sequence: message.sequence,
            message_id: message.message_id.clone(),
            message_type: message.kind.to_owned(),
            payload: message.payload.clone(),
            invoked_ms: self.recorder.now_ms(),
            completed_ms: 0,
            outcome: Outcome::Indeterminate,
            detail: String::new(),
        }
    }

    fn complete(&self, mut op: Operation, outcome: Outcome, detail: String) -> Outcome {
        op.completed_ms = self.recorder.now_ms();
        op.outcome = outcome;
        op.detail = detail;
        self.recorder.record(Event::Op(op));
        outcome
    }

    /// One HTTPS delivery to a gate chosen at random.
    async fn over_https(&self, message: &Message) -> Outcome {
        let gate = self.random_gate();
        let epoch = self.state().epoch;
        let op = self.operation(message, Door::Https, Some(gate), epoch);
        let url = format!(
            "{}/v1/aggregates/{}/messages",
            self.setup.gates[gate], message.aggregate
        );
        let headers = [
            ("authorization", format!("Bearer {}", self.setup.token)),
            ("producer-epoch", epoch.to_string()),
        ];
        let answer = self
            .setup
            .https
            .send(
                Method::POST,
                &url,
                &headers,
                Some(&message.body()),
                SEND_TIMEOUT,
            )
            .await;
        let (outcome, detail) = match answer {
            Ok(answer) => {
                let verdict = answer.json()["outcome"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let detail = format!("{} {verdict}", answer.status);
                match answer.status {
                    200 => {
                        self.state()
                            .confirmed
                            .insert((message.aggregate.clone(), message.sequence));
                        (Outcome::Ok, detail)
                    }
                    400..=499 => (Outcome::Fail, detail),
                    _ => (Outcome::Indeterminate, detail),
                }
            }
            Err(error) => (Outcome::Indeterminate, format!("no answer: {error}")),
        };
        self.complete(op, outcome, detail)
    }

    /// One publish to the input stream, awaiting its PubAck.
    async fn over_nats(&self, message: &Message) -> Outcome {
        let epoch = self.state().epoch;
        let op = self.operation(message, Door::Nats, None, epoch);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "Nats-Msg-Id",
            format!("{}/{}", self.setup.name, message.message_id).as_str(),
        );
        headers.insert(
            "Authorization",
            format!("Bearer {}", self.setup.token).as_str(),
        );
        headers.insert("Producer-Epoch", epoch.to_string().as_str());
        let publish = async {
            self.js
                .publish_with_headers(
                    subject_for(INPUT_PREFIX, &message.aggregate),
                    headers,
                    message.body().to_string().into(),
                )
                .await?
                .await
        };
        let (outcome, detail) = match tokio::time::timeout(SEND_TIMEOUT, publish).await {
            Ok(Ok(ack)) if ack.duplicate => (
                Outcome::Indeterminate,
                format!("PubAck {} names an earlier copy", ack.sequence),
            ),
            Ok(Ok(ack)) => (Outcome::Ok, format!("PubAck {}", ack.sequence)),
            Ok(Err(error)) => (Outcome::Indeterminate, format!("no PubAck: {error}")),
            Err(_) => (Outcome::Indeterminate, "no PubAck in time".to_owned()),
        };
        self.complete(op, outcome, detail)
    }

    /// A new session, as a new instance of the producer starts: retried until a gate answers.
    async fn new_session(&self) {
        loop {
            if self.phase.get() == Phase::Stopped {
                return;
            }
            let gate = self.random_gate();
            let invoked_ms = self.recorder.now_ms();
            let answer = self
                .setup
                .https
                .send(
                    Method::POST,
                    &format!("{}/v1/producers/session", self.setup.gates[gate]),
                    &[("authorization", format!("Bearer {}", self.setup.token))],
                    None,
                    SEND_TIMEOUT,
                )
                .await;
            let epoch = match &answer {
                Ok(answer) if answer.status == 200 => answer.json()["epoch"].as_i64(),
                _ => None,
            };
            self.recorder.record(Event::Session(Session {
                producer: self.setup.name.clone(),
                epoch,
                invoked_ms,
                completed_ms: self.recorder.now_ms(),
            }));
            if let Some(epoch) = epoch {
                let mut state = self.state();
                state.epoch = state.epoch.max(epoch);
                return;
            }
            tokio::time::sleep(BACKOFF_LAST).await;
        }
    }

    /// After a new session: every message of the aggregates begun so far that the gate has not
    /// applied (by its position, read from a gate) and no HTTPS answer confirmed is sent again,
    /// since the old epoch's messages still in the input stream will be fenced.
    async fn resend_after_session(self: &Arc<Self>, tasks: &mut tokio::task::JoinSet<()>) {
        let aggregates: Vec<(String, i64, u64)> = {
            let state = self.state();
            state
                .aggregates
                .values()
                .map(|aggregate| (aggregate.id.clone(), aggregate.next, aggregate.salt))
                .collect()
        };
        for (id, next, salt) in aggregates {
            let position = self.position(&id).await.unwrap_or(0);
            for sequence in position + 1..next {
                let confirmed = self.state().confirmed.contains(&(id.clone(), sequence));
                if !confirmed {
                    self.spawn_send(tasks, Message::new(&id, sequence, salt), Reason::Resend);
                }
            }
        }
    }

    /// The aggregate's last applied sequence, as a gate reads it.
    async fn position(&self, aggregate: &str) -> Option<i64> {
        for _ in 0..3 {
            let gate = self.random_gate();
            let answer = self
                .setup
                .https
                .send(
                    Method::GET,
                    &format!("{}/v1/aggregates/{aggregate}", self.setup.gates[gate]),
                    &[(
                        "authorization",
                        format!("Bearer {}", self.setup.reader_token),
                    )],
                    None,
                    SEND_TIMEOUT,
                )
                .await;
            match answer {
                Ok(answer) if answer.status == 200 => return answer.json()["last"].as_i64(),
                Ok(answer) if answer.status == 404 => return Some(0),
                _ => {}
            }
        }
        None
    }

    /// Passes on to `resend` what the gates' gap notices say this producer's aggregates miss.
    async fn answer_notices(
        self: Arc<Self>,
        client: async_nats::Client,
        resend: tokio::sync::mpsc::UnboundedSender<Message>,
    ) {
        let Ok(mut notices) = client.subscribe(GAP_SUBJECTS).await else {
            return;
        };
        while let Some(notice) = notices.next().await {
            let body: Value = serde_json::from_slice(&notice.payload).unwrap_or(Value::Null);
            let aggregate = body["aggregateId"].as_str().unwrap_or_default().to_owned();
            let (Some(from), Some(through)) = (
                body["missing"]["from"].as_i64(),
                body["missing"]["through"].as_i64(),
            ) else {
                continue;
            };
            let known = {
                let state = self.state();
                state
                    .aggregates
                    .get(&aggregate)
                    .map(|known| (known.next, known.salt))
            };
            let Some((next, salt)) = known else {
                continue;
            };
            self.recorder.record(Event::Notice(Notice {
                producer: self.setup.name.clone(),
                aggregate: aggregate.clone(),
                from,
                through,
                at_ms: self.recorder.now_ms(),
            }));
            for sequence in from..=through.min(next - 1) {
                let _ = resend.send(Message::new(&aggregate, sequence, salt));
            }
        }
    }
}
