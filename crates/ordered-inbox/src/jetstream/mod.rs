//! The NATS JetStream door: a consumer of ordered messages from a durable pull consumer (the lab's
//! `serve --nats`, the gate's `[nats]`), which hands every fetched batch to the ordered inbox in ONE call
//! ([`crate::Inbox::deliver_batch`], one group commit), through [`Door::Broker`]: a
//! message ahead of its turn is held, not bounced. Each message is acked, nak'd or terminated only
//! after that call returned, i.e. after the COMMIT that recorded its fate:
//!
//! | verdict | broker action |
//! |---|---|
//! | applied, replay, held (new or again), quarantined | ack |
//! | stale, payload conflict, malformed, a producer refusal | listed among the inbox's rejected deliveries, then term |
//! | hold full | parked unanswered until the aggregate moves (the `parking` module); nak'd with a back-off delay when parking is full |
//! | quarantine full, a store failure | nak with a back-off delay |
//!
//! A message with `Authorization: Bearer TOKEN` and `Producer-Epoch: N` is delivered with its
//! producer's claim, checked by the inbox in the transaction that writes it (epoch fencing,
//! ownership, its producer's id namespace), as on the HTTP general door; without them it is
//! anonymous. A producer's early message is held like an anonymous one, under its producer and
//! epoch, and admitted again when it drains.
//!
//! When a batch makes an aggregate wait for a missing sequence, and again at an interval while it
//! waits, the consumer publishes a gap notice ([`notices`]) for a producer that can resend.
//!
//! The wire format is in [`wire`], the settings in [`config`]. The evidence ([`ConsumerStatus`])
//! is the servers' to show; a test's fault may stop the consumer after a COMMIT ([`AfterCommit`]).

pub mod config;
pub mod notices;
mod parking;
mod status;
pub mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::delivery::Outcome;
use crate::error::InboxError;
use crate::inbox::{BatchDelivery, Undelivered};
use crate::model::{Door, OrderedMessage};
use crate::records::{ProducerClaim, ProducerRefusal, RejectedDelivery};
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

pub use self::config::StartError;
pub use self::config::{
    BrokerConfig, DEFAULT_ACK_WAIT, DEFAULT_BATCH, DEFAULT_DURABLE, DEFAULT_GAP_NOTICE_INTERVAL,
    DEFAULT_GAP_NOTICES_PER_TICK, DEFAULT_NAK_DELAY, DEFAULT_STREAM, DEFAULT_SUBJECT_PREFIX,
    NatsAccess, NatsAuth, NatsTls,
};
pub use self::status::{AfterCommit, ConsumerObserver, ConsumerStatus, Counters, SharedInbox};

/// Rejected deliveries `GET /broker/rejected` keeps (the oldest go first): the inbox's bound.
pub use crate::records::REJECTED_KEPT;
/// A producer refusal's name in the counters and the rejected list: the `outcome` the HTTP
/// general door answers it with (`unauthorized` and `owner required` are its 401s). The inbox
/// names it, because it also names the refusals of the held messages it rejects.
pub use crate::records::refusal_outcome;

/// The counters' name of a delivery the inbox's handler failed (nak'd, to be delivered again).
pub const HANDLER_FAILED: &str = "handler failed";

/// The counters' and the rejected list's name of a message without a producer's credential that
/// a consumer refusing anonymous writes terminated.
pub const ANONYMOUS_REFUSED: &str = "anonymous refused";

/// The longest back-off a nak asks for.
const MAX_NAK_DELAY: Duration = Duration::from_secs(30);
/// How long one waiting pull request stays open when nothing is pending; it also bounds how long
/// a shutdown waits for the fetch in progress.
const PULL_WAIT: Duration = Duration::from_millis(500);
/// A fetch that has not finished after this long (the server went away mid-request) is given up;
/// what it received is processed.
const FETCH_DEADLINE: Duration = Duration::from_secs(3);

/// Reads a message's body for the aggregate its subject names: the inbox's message, or why it
/// is malformed: each server reads its own body (the lab's general-door JSON, the gate's
/// envelope).
pub type BodyReader = fn(String, &[u8]) -> Result<OrderedMessage, String>;

/// A connected consumer, ready to run.
pub struct Consumer {
    lab: ConsumerStatus,
    config: BrokerConfig,
    client: async_nats::Client,
    consumer: PullConsumer,
    notices: Arc<notices::GapNotifier>,
    body: BodyReader,
    /// Whether a message without a producer's credential is delivered (the lab's door) or
    /// refused (the gate, unless its configuration allows anonymous writes).
    anonymous: bool,
    /// Messages whose aggregate cannot take them yet, kept unanswered until it moves.
    parking: Arc<Mutex<parking::Parking>>,
}

impl Consumer {
    /// A consumer on a client its caller connected (and named): creates the stream and the
    /// durable consumer if missing, and checks that an existing stream takes this consumer's
    /// subjects. Every refusal is one line.
    pub async fn with_client(
        config: BrokerConfig,
        lab: ConsumerStatus,
        client: async_nats::Client,
        body: BodyReader,
    ) -> Result<Consumer, StartError> {
        config.validate()?;
        let refuse = |what: &str, error: &dyn std::fmt::Display| {
            StartError(format!(
                "NATS at {}: {what}: {error}",
                config.urls.join(",")
            ))
        };
        let context = jetstream::new(client.clone());
        let stream = context
            .get_or_create_stream(StreamConfig {
                name: config.stream.clone(),
                subjects: config.stream_subjects(),
                storage: StorageType::File,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .map_err(|error| refuse("cannot create or open the stream", &error))?;
        let durable = config.durable_name();
        let consumer: PullConsumer = stream
            .get_or_create_consumer(
                &durable,
                PullConfig {
                    durable_name: Some(durable.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    filter_subject: config.filter_subject(),
                    max_ack_pending: 20_000,
                    ..Default::default()
                },
            )
            .await
            .map_err(|error| refuse("cannot create or open the durable consumer", &error))?;
        let _ = lab.inner.config.set(config.clone());
        let _ = lab.inner.client.set(client.clone());
        let _ = lab.inner.consumer.set(consumer.clone());
        let notices = Arc::new(notices::GapNotifier::new(
            client.clone(),
            &config,
            lab.clone(),
        ));
        let parking = parking::Parking::new(config.nak_delay, config.ack_wait);
        Ok(Consumer {
            lab,
            config,
            client,
            consumer,
            notices,
            body,
            anonymous: true,
            parking: Arc::new(Mutex::new(parking)),
        })
    }

    /// The consumer's NATS connection, for others to publish on.
    pub fn client(&self) -> async_nats::Client {
        self.client.clone()
    }

    /// The same consumer refusing every message without a producer's credential (listed as
    /// rejected and terminated, never delivered) unless `anonymous`.
    pub fn with_anonymous_writes(self, anonymous: bool) -> Consumer {
        Consumer { anonymous, ..self }
    }

    /// The start-up line that says what is consumed.
    pub fn describe(&self) -> String {
        format!(
            "Consuming NATS JetStream at {}: stream {}, durable consumer {}, subjects {} (partition {} of {})",
            self.config.urls.join(","),
            self.config.stream,
            self.config.durable_name(),
            self.config.filter_subject(),
            self.config.partition,
            self.config.partitions
        )
    }

    /// Fetches and delivers batches until `stop` is cancelled; the batch in hand is finished and
    /// answered first, then the acks are flushed. The gap notices' timer runs beside it.
    pub async fn run(self, inbox: SharedInbox, stop: CancellationToken) {
        let timer_stop = stop.child_token();
        let notices = self.notices.clone();
        let timer = tokio::spawn({
            let (inbox, timer_stop) = (inbox.clone(), timer_stop.clone());
            async move { notices.repeat(inbox, timer_stop).await }
        });
        self.consume(&inbox, &stop).await;
        timer_stop.cancel();
        let _ = timer.await;
    }

    async fn consume(&self, inbox: &SharedInbox, stop: &CancellationToken) {
        let mut failures: u32 = 0;
        while !stop.is_cancelled() {
            self.refresh_parked().await;
            let (batch, retried) = match self.next_batch().await {
                Ok(batch) => {
                    failures = 0;
                    batch
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    self.lab.count(|c| {
                        c.fetch_errors += 1;
                        c.last_error = Some(format!("fetch: {error}"));
                    });
                    tracing::warn!(%error, "broker fetch failed; retrying");
                    let pause = Duration::from_millis(100 * u64::from(failures.min(10)));
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(pause) => continue,
                    }
                }
            };
            if batch.is_empty() {
                continue;
            }
            if !self.handle(inbox, batch, retried, stop).await {
                // The fault switch: stopped between COMMIT and ack, as a crash would.
                return;
            }
        }
        self.release_parked().await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.client.flush()).await;
    }

    /// The parked messages that are due (their aggregate moved, or their back-off ran out), at
    /// most half a batch, ahead of what the broker has pending; without any due, a fetch that
    /// may wait for the next message. With the batch, how many of its first messages are parked
    /// ones tried again.
    async fn next_batch(&self) -> Result<(Vec<jetstream::Message>, usize), async_nats::Error> {
        let limit = (self.config.batch / 2).max(1);
        let mut due = self.parked().take_due(limit);
        let retried = due.len();
        if due.is_empty() {
            return Ok((self.fetch().await?, 0));
        }
        let room = self.config.batch.saturating_sub(due.len()).max(1);
        let request = self.consumer.fetch().max_messages(room);
        match request.messages().await {
            Ok(pending) => {
                // The parked ones are processed even if the fetch breaks off.
                let _ = collect(pending, &mut due).await;
            }
            Err(error) => {
                tracing::warn!(%error, "broker fetch failed; delivering the parked messages that are due")
            }
        }
        Ok((due, retried))
    }

    fn parked(&self) -> std::sync::MutexGuard<'_, parking::Parking> {
        self.parking
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Pushes back the ack deadline of the parked messages that need it.
    async fn refresh_parked(&self) {
        let due = self.parked().due_for_refresh();
        for message in due {
            if let Err(error) = message.ack_with(AckKind::Progress).await {
                self.lab
                    .count(|c| c.last_error = Some(format!("ack progress: {error}")));
            }
        }
    }

    /// The consumer stops: every parked message goes back to the broker at once.
    async fn release_parked(&self) {
        let parked = self.parked().drain();
        for message in parked {
            match message.ack_with(AckKind::Nak(None)).await {
                Ok(()) => self.lab.count(|c| c.nakd += 1),
                Err(error) => self
                    .lab
                    .count(|c| c.last_error = Some(format!("ack: {error}"))),
            }
        }
    }

    /// Whatever is pending now, up to one batch; when nothing is, waits (at most [`PULL_WAIT`])
    /// for one message and then takes whatever else arrived with it.
    async fn fetch(&self) -> Result<Vec<jetstream::Message>, async_nats::Error> {
        let mut messages = Vec::new();
        let request = self.consumer.fetch().max_messages(self.config.batch);
        collect(request.messages().await?, &mut messages).await?;
        if !messages.is_empty() {
            return Ok(messages);
        }
        let waiting = self
            .consumer
            .batch()
            .max_messages(1)
            .expires(PULL_WAIT)
            .messages()
            .await?;
        collect(waiting, &mut messages).await?;
        if messages.is_empty() {
            return Ok(messages);
        }
        let rest = self
            .consumer
            .fetch()
            .max_messages(self.config.batch.saturating_sub(1).max(1))
            .messages()
            .await;
        if let Ok(rest) = rest {
            // What the first one already brought is processed even if this part fails.
            let _ = collect(rest, &mut messages).await;
        }
        Ok(messages)
    }

    /// Delivers one fetched batch (its first `retried` messages parked ones tried again) in one
    /// inbox call, then answers every message. Returns false when the fault switch stopped the
    /// consumer before its acks.
    async fn handle(
        &self,
        inbox: &SharedInbox,
        batch: Vec<jetstream::Message>,
        retried: usize,
        stop: &CancellationToken,
    ) -> bool {
        let mut in_hand = self.read_batch(inbox, &batch, retried).await;
        if crate::planted::active(crate::planted::Bug::AckBeforeCommit) {
            for message in &batch {
                let _ = message.ack().await;
            }
        }
        self.deliver(inbox, &batch, &mut in_hand).await;
        let started_waiting = std::mem::take(&mut in_hand.started_waiting);
        if !self.answer_batch(inbox, batch, in_hand, stop).await {
            return false;
        }
        self.notices.notice_started(inbox, started_waiting).await;
        true
    }

    /// Reads every fetched message into a delivery, or decides its answer at once when it cannot
    /// be delivered (malformed, a token that is no active producer's, a token not checked).
    async fn read_batch(
        &self,
        inbox: &SharedInbox,
        batch: &[jetstream::Message],
        retried: usize,
    ) -> BatchInHand {
        let mut in_hand = BatchInHand {
            actions: Vec::with_capacity(batch.len()),
            positions: vec![None; batch.len()],
            retried,
            ..BatchInHand::default()
        };
        // Token → active producer, looked up once per batch (a read, as the HTTP door's); the
        // delivery's own transaction checks the producer again, so a revocation in between
        // still refuses it.
        let mut holders: HashMap<String, Option<String>> = HashMap::new();
        for (index, message) in batch.iter().enumerate() {
            let action = self
                .read_message(inbox, index, message, &mut holders, &mut in_hand)
                .await;
            in_hand.actions.push(action);
        }
        in_hand
    }

    /// Reads one message: a delivery for the inbox (`None`: its answer waits for the verdict), or
    /// the answer it gets without one.
    async fn read_message(
        &self,
        inbox: &SharedInbox,
        index: usize,
        message: &jetstream::Message,
        holders: &mut HashMap<String, Option<String>>,
        in_hand: &mut BatchInHand,
    ) -> Option<Action> {
        let header_id = wire::delivery_id(
            &header_values(message, wire::MESSAGE_ID_HEADER),
            &header_values(message, wire::RESEND_HEADER),
        )
        .map(str::to_owned);
        let claim = match self
            .claim_of(inbox, message, &header_id, holders, &mut in_hand.rejections)
            .await
        {
            Ok(claim) => claim,
            Err(action) => return Some(action),
        };
        let read = wire::read_delivery(
            &self.config.subject_prefix,
            self.config.partition_token(),
            message.subject.as_str(),
            header_id.as_deref(),
            claim.as_ref().map(|claim| claim.producer.as_str()),
            |aggregate_id| (self.body)(aggregate_id, &message.payload),
        );
        match read {
            Ok(ordered) if index >= in_hand.retried && self.parks_unasked(&ordered) => {
                if let Some(slot) = in_hand.positions.get_mut(index) {
                    *slot = Some((ordered.aggregate_id, ordered.sequence));
                }
                Some(Action::Wait)
            }
            Ok(ordered) => {
                in_hand.deliveries.push(BatchDelivery {
                    message: ordered,
                    door: Door::Broker,
                    claim,
                });
                in_hand.delivered_at.push(index);
                None
            }
            Err(malformed) => {
                in_hand.rejections.push(rejected(
                    message,
                    "malformed",
                    malformed.message_id,
                    malformed.aggregate_id,
                    claim.map(|claim| claim.producer),
                    malformed.reason,
                ));
                self.count_outcome("malformed");
                Some(Action::Term)
            }
        }
    }

    /// The producer claim a message's headers make (`None`: anonymous). A message that cannot be
    /// delivered as it claims gets its answer instead: malformed headers and a token that is no
    /// active producer's are listed and terminated; a token the inbox could not check is nak'd.
    async fn claim_of(
        &self,
        inbox: &SharedInbox,
        message: &jetstream::Message,
        header_id: &Option<String>,
        holders: &mut HashMap<String, Option<String>>,
        rejections: &mut Rejections,
    ) -> Result<Option<ProducerClaim>, Action> {
        let aggregate_of = || {
            let (prefix, partition) = (&self.config.subject_prefix, self.config.partition_token());
            wire::aggregate_of_subject(prefix, partition, message.subject.as_str()).ok()
        };
        let credential = wire::read_credential(
            &header_values(message, wire::AUTHORIZATION_HEADER),
            &header_values(message, wire::PRODUCER_EPOCH_HEADER),
        );
        let credential = match credential {
            Ok(None) if self.anonymous => return Ok(None),
            Ok(None) => {
                rejections.push(rejected(
                    message,
                    ANONYMOUS_REFUSED,
                    header_id.clone(),
                    aggregate_of(),
                    None,
                    "anonymous writes are off: send Authorization: Bearer TOKEN and Producer-Epoch"
                        .to_owned(),
                ));
                self.count_outcome(ANONYMOUS_REFUSED);
                return Err(Action::Term);
            }
            Ok(Some(credential)) => credential,
            Err(reason) => {
                if let Some(observer) = self.lab.inner.observer.get() {
                    observer.producer_headers_malformed();
                }
                rejections.push(rejected(
                    message,
                    "malformed",
                    header_id.clone(),
                    aggregate_of(),
                    None,
                    reason,
                ));
                self.count_outcome("malformed");
                return Err(Action::Term);
            }
        };
        match holder_of(inbox, credential.token, holders).await {
            Ok(Some(producer)) => Ok(Some(ProducerClaim {
                producer,
                epoch: credential.epoch,
            })),
            Ok(None) => {
                let refusal = &ProducerRefusal::Revoked;
                self.refuse(
                    rejections,
                    message,
                    header_id.clone(),
                    aggregate_of(),
                    None,
                    refusal,
                );
                Err(Action::Term)
            }
            // Not knowing who sent it is no verdict: the broker offers it again.
            Err(error) => {
                tracing::error!(%error, "the inbox could not check a broker message's producer token");
                self.count_store_error(&error);
                Err(Action::Nak)
            }
        }
    }

    /// Hands the batch's deliveries to the inbox in one call and turns each verdict into its
    /// answer; when the call fails as a whole, every message still without an answer is nak'd.
    async fn deliver(
        &self,
        inbox: &SharedInbox,
        batch: &[jetstream::Message],
        in_hand: &mut BatchInHand,
    ) {
        let deliveries = std::mem::take(&mut in_hand.deliveries);
        let sent: Vec<(OrderedMessage, Option<String>)> = deliveries
            .iter()
            .map(|delivery| {
                (
                    delivery.message.clone(),
                    delivery.claim.as_ref().map(|claim| claim.producer.clone()),
                )
            })
            .collect();
        let decided = inbox.deliver_batch(deliveries).await;
        // From here on the COMMIT has returned (or failed as a whole).
        let outcomes = match decided {
            Ok(outcomes) => outcomes,
            Err(error) => {
                tracing::error!(%error, "the inbox failed a broker batch; nothing of it committed");
                self.count_store_error(&error);
                for slot in &mut in_hand.actions {
                    slot.get_or_insert(Action::Nak);
                }
                return;
            }
        };
        let delivered_at = std::mem::take(&mut in_hand.delivered_at);
        for ((index, outcome), (ordered, producer)) in
            delivered_at.into_iter().zip(outcomes).zip(sent)
        {
            let Some(message) = batch.get(index) else {
                continue;
            };
            if starts_waiting(&outcome) && !in_hand.started_waiting.contains(&ordered.aggregate_id)
            {
                in_hand.started_waiting.push(ordered.aggregate_id.clone());
            }
            match outcome {
                Ok(Outcome::Applied { .. }) => in_hand.moved.push(ordered.aggregate_id.clone()),
                Ok(Outcome::HoldFull { expected, .. }) => {
                    in_hand.full.push((ordered.aggregate_id.clone(), expected))
                }
                _ => {}
            }
            let action = self.verdict_action(
                message,
                outcome,
                &ordered,
                producer,
                &mut in_hand.rejections,
            );
            // Only a message to park needs its position kept.
            if action == Action::Wait
                && let Some(slot) = in_hand.positions.get_mut(index)
            {
                *slot = Some((ordered.aggregate_id.clone(), ordered.sequence));
            }
            if let Some(slot) = in_hand.actions.get_mut(index) {
                *slot = Some(action);
            }
        }
    }

    /// The answer to one delivered message's verdict, counted, and listed when it is terminated.
    fn verdict_action(
        &self,
        message: &jetstream::Message,
        verdict: Result<Outcome, Undelivered>,
        ordered: &OrderedMessage,
        producer: Option<String>,
        rejections: &mut Rejections,
    ) -> Action {
        match verdict {
            Ok(outcome) => {
                let name = outcome_name(&outcome);
                self.count_outcome(name);
                let action = action_for(&outcome);
                if action == Action::Term {
                    rejections.push(rejected(
                        message,
                        name,
                        Some(ordered.message_id.clone()),
                        Some(ordered.aggregate_id.clone()),
                        producer,
                        termination_reason(&outcome, ordered),
                    ));
                }
                action
            }
            // The handler failed applying it: nothing of it was written, and the rest of the batch
            // stands. A redelivery applies it once the handler can.
            Err(Undelivered::Handler(error)) => {
                tracing::warn!(%error, message_id = %ordered.message_id, "the handler failed a broker delivery; nak'd for redelivery");
                self.count_outcome(HANDLER_FAILED);
                Action::Nak
            }
            // The inbox counted and logged it; the broker lab lists it. Nothing was written, and
            // no redelivery can change that: terminated, never held.
            Err(Undelivered::Refused(refusal)) => {
                rejections.push(rejected(
                    message,
                    refusal_outcome(&refusal),
                    Some(ordered.message_id.clone()),
                    Some(ordered.aggregate_id.clone()),
                    producer,
                    refusal_reason(&refusal, ordered),
                ));
                self.count_outcome(refusal_outcome(&refusal));
                Action::Term
            }
        }
    }

    /// Lists the batch's rejections, then answers every message (one still without an answer is
    /// nak'd), unless the fault switch stops the consumer first: between COMMIT and ack, as a
    /// crash would. Returns false then.
    async fn answer_batch(
        &self,
        inbox: &SharedInbox,
        batch: Vec<jetstream::Message>,
        in_hand: BatchInHand,
        stop: &CancellationToken,
    ) -> bool {
        let mut actions = in_hand.actions;
        self.keep_rejections(inbox, in_hand.rejections, &mut actions)
            .await;
        self.lab.count(|c| {
            c.batches += 1;
            c.messages += batch.len() as u64;
        });
        let after_commit = self.lab.inner.after_commit.get();
        if after_commit.is_some_and(|check| check.stop_before_acks()) {
            self.lab.count(|c| c.paused_after_commit = true);
            tracing::warn!("fault switch: paused after COMMIT, before the acks");
            stop.cancelled().await;
            return false;
        }
        let mut positions = in_hand.positions.into_iter();
        for (message, action) in batch.into_iter().zip(actions) {
            let position = positions.next().flatten();
            match (action.unwrap_or(Action::Nak), position) {
                (Action::Wait, Some((aggregate, sequence))) => {
                    self.park_or_nak(&aggregate, sequence, message).await;
                }
                (action, _) => self.answer(&message, action).await,
            }
        }
        let mut parking = self.parked();
        for (aggregate, expected) in &in_hand.full {
            parking.full(aggregate, *expected);
        }
        for aggregate in &in_hand.moved {
            parking.moved(aggregate);
        }
        true
    }

    /// Whether a newly fetched message goes to parking without asking the inbox: its aggregate
    /// answered `hold full` here and has not moved since, and the message is beyond the
    /// sequence it expects (the expected one itself, and earlier ones, are delivered). This
    /// spares the inbox a flood's verdicts; the parked messages are asked once their aggregate
    /// moves or their back-off runs out.
    fn parks_unasked(&self, message: &OrderedMessage) -> bool {
        self.parked()
            .is_full_before(&message.aggregate_id, message.sequence)
    }

    /// Parks a message its aggregate cannot take yet; when parking is full, nak'd instead.
    async fn park_or_nak(&self, aggregate: &str, sequence: i64, message: jetstream::Message) {
        let parked = self.parked().park(aggregate, sequence, message);
        if let Err(message) = parked {
            self.answer(&message, Action::Nak).await;
        }
    }

    fn count_outcome(&self, name: &'static str) {
        self.lab
            .count(|c| *c.outcomes.entry(name).or_default() += 1);
    }

    fn count_store_error(&self, error: &InboxError) {
        self.lab.count(|c| {
            c.store_errors += 1;
            c.last_error = Some(format!("store: {error}"));
        });
    }

    /// A refusal decided before the inbox was asked (the token is no active producer's):
    /// counted and listed like the inbox's own refusals, then terminated.
    fn refuse(
        &self,
        rejections: &mut Rejections,
        message: &jetstream::Message,
        message_id: Option<String>,
        aggregate_id: Option<String>,
        producer: Option<String>,
        refusal: &ProducerRefusal,
    ) {
        if let Some(observer) = self.lab.inner.observer.get() {
            observer.producer_refusal(refusal);
        }
        self.count_outcome(refusal_outcome(refusal));
        rejections.push(rejected(
            message,
            refusal_outcome(refusal),
            message_id,
            aggregate_id,
            producer,
            "the Authorization token is not an active producer's token (unknown or revoked)"
                .to_owned(),
        ));
    }

    /// Writes the batch's rejections to the inbox's rejected list before any of them is
    /// terminated. If the store cannot take them, the terminations become naks: each comes back
    /// after its back-off, is rejected again and listed then, so that no terminated message is
    /// missing from the list.
    async fn keep_rejections(
        &self,
        inbox: &SharedInbox,
        rejections: Rejections,
        actions: &mut [Option<Action>],
    ) {
        if rejections.0.is_empty() {
            return;
        }
        if let Err(error) = inbox.record_rejected(rejections.0).await {
            tracing::error!(%error, "the inbox could not record a batch's rejected deliveries; they are nak'd instead of terminated");
            self.count_store_error(&error);
            for action in actions.iter_mut() {
                if *action == Some(Action::Term) {
                    *action = Some(Action::Nak);
                }
            }
        }
    }

    async fn answer(&self, message: &jetstream::Message, action: Action) {
        let delivered = message.info().map(|info| info.delivered).unwrap_or(1);
        let kind = match action {
            Action::Ack => AckKind::Ack,
            Action::Term => AckKind::Term,
            Action::Nak | Action::Wait => {
                AckKind::Nak(Some(back_off(self.config.nak_delay, delivered)))
            }
        };
        match message.ack_with(kind).await {
            Ok(()) => self.lab.count(|c| match action {
                Action::Ack => c.acked += 1,
                Action::Term => c.terminated += 1,
                Action::Nak | Action::Wait => c.nakd += 1,
            }),
            // The message is redelivered after the ack wait, and answers replay then.
            Err(error) => self
                .lab
                .count(|c| c.last_error = Some(format!("ack: {error}"))),
        }
    }
}

/// One fetched batch on its way through the consumer.
#[derive(Default)]
struct BatchInHand {
    /// One slot per fetched message, in fetch order: its answer once it is known (`None`: it
    /// was delivered and waits for its verdict).
    actions: Vec<Option<Action>>,
    /// What goes to the inbox in one call.
    deliveries: Vec<BatchDelivery>,
    /// The fetched message's index of each delivery.
    delivered_at: Vec<usize>,
    /// What goes to the rejected list before anything is terminated.
    rejections: Rejections,
    /// The aggregates whose first held message this batch holds, each once: a gap notice each,
    /// once the batch is answered.
    started_waiting: Vec<String>,
    /// One slot per fetched message: its aggregate and sequence, when it is to be parked.
    positions: Vec<Option<(String, i64)>>,
    /// The aggregates a message of this batch was applied to: their parked messages are due.
    moved: Vec<String>,
    /// The aggregates that answered `hold full`, with the sequence each expects.
    full: Vec<(String, i64)>,
    /// How many of the batch's first messages are parked ones tried again.
    retried: usize,
}

/// A verdict that holds an aggregate's first message ahead of its turn: it starts waiting.
fn starts_waiting(verdict: &Result<Outcome, Undelivered>) -> bool {
    matches!(
        verdict,
        Ok(Outcome::Held {
            held: 1,
            repeated: false,
            ..
        })
    )
}

/// The active producer `token` belongs to (`None`: unknown or revoked), asked of the inbox once
/// per batch and remembered in `holders`; a failed check is not remembered.
async fn holder_of(
    inbox: &SharedInbox,
    token: String,
    holders: &mut HashMap<String, Option<String>>,
) -> Result<Option<String>, InboxError> {
    let holder = match holders.get(&token) {
        Some(holder) => Ok(holder.clone()),
        None => inbox.reads().check_producer(token.clone()).await,
    };
    if let Ok(holder) = &holder {
        holders.insert(token, holder.clone());
    }
    holder
}

/// Reads a batch's messages into `into` until it ends, fails, or runs past [`FETCH_DEADLINE`].
async fn collect(
    mut batch: async_nats::jetstream::consumer::pull::Batch,
    into: &mut Vec<jetstream::Message>,
) -> Result<(), async_nats::Error> {
    let deadline = tokio::time::Instant::now() + FETCH_DEADLINE;
    loop {
        match tokio::time::timeout_at(deadline, batch.next()).await {
            Ok(Some(Ok(message))) => into.push(message),
            Ok(Some(Err(error))) if into.is_empty() => return Err(error),
            Ok(Some(Err(_))) | Ok(None) | Err(_) => return Ok(()),
        }
    }
}

/// What to tell the broker about one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Acknowledge: its fate is recorded.
    Ack,
    /// Ask for a redelivery after a back-off.
    Nak,
    /// Terminate: never delivered again.
    Term,
    /// Its aggregate cannot take it yet: parked until the aggregate moves (nak'd when parking
    /// is full).
    Wait,
}

/// The broker action for a committed verdict.
pub fn action_for(outcome: &Outcome) -> Action {
    match outcome {
        Outcome::Applied { .. }
        | Outcome::Replay { .. }
        | Outcome::Held { .. }
        | Outcome::Quarantined { .. } => Action::Ack,
        Outcome::Stale { .. } | Outcome::PayloadConflict => Action::Term,
        // Not recorded: it is tried again once its aggregate moves.
        Outcome::HoldFull { .. } | Outcome::Gap { .. } => Action::Wait,
        // Not recorded: the broker keeps it and offers it again after a delay.
        Outcome::QuarantineFull { .. } => Action::Nak,
    }
}

/// A verdict's name in the counters and the rejected list.
pub fn outcome_name(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Applied { .. } => "applied",
        Outcome::Replay { .. } => "replay",
        Outcome::Held {
            repeated: false, ..
        } => "held",
        Outcome::Held { repeated: true, .. } => "held again",
        Outcome::HoldFull { .. } => "hold full",
        Outcome::Quarantined { .. } => "quarantined",
        Outcome::QuarantineFull { .. } => "quarantine full",
        Outcome::Stale { .. } => "stale",
        Outcome::PayloadConflict => "payload conflict",
        Outcome::Gap { .. } => "gap",
    }
}

fn termination_reason(outcome: &Outcome, message: &OrderedMessage) -> String {
    match outcome {
        Outcome::Stale {
            expected,
            skipped_by: Some(resolution),
        } => format!(
            "sequence {} was skipped by an operator's gap resolution {resolution}; the aggregate expects {expected}",
            message.sequence
        ),
        Outcome::Stale { expected, .. } => format!(
            "sequence {} was already taken (or is held) by another message; the aggregate expects {expected}",
            message.sequence
        ),
        Outcome::PayloadConflict => format!(
            "message id '{}' already carries other content",
            message.message_id
        ),
        other => outcome_name(other).to_owned(),
    }
}

fn refusal_reason(refusal: &ProducerRefusal, message: &OrderedMessage) -> String {
    match refusal {
        ProducerRefusal::OwnerRequired => format!(
            "aggregate '{}' is owned by a producer: an anonymous message cannot write it (publish with its Authorization and Producer-Epoch headers)",
            message.aggregate_id
        ),
        ProducerRefusal::NotOwner { owner } => format!(
            "aggregate '{}' is owned by producer '{owner}'; only its owner may write its sequence",
            message.aggregate_id
        ),
        ProducerRefusal::Fenced { .. } => format!(
            "{refusal}: a newer instance of this producer has taken over; nothing was applied"
        ),
        other => other.to_string(),
    }
}

/// The nak delay for the `delivered`-th attempt: `first`, doubling, at most 30 s.
pub fn back_off(first: Duration, delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 16)).unwrap_or(16);
    first.saturating_mul(1u32 << doublings).min(MAX_NAK_DELAY)
}

/// One batch's rejected deliveries, logged as they are decided and written to the inbox's
/// rejected list together before the batch is answered.
#[derive(Default)]
struct Rejections(Vec<RejectedDelivery>);

impl Rejections {
    fn push(&mut self, rejected: RejectedDelivery) {
        tracing::warn!(
            subject = rejected.subject.as_deref().unwrap_or(""),
            message_id = rejected.message_id.as_deref().unwrap_or(""),
            producer = rejected.producer.as_deref().unwrap_or(""),
            outcome = %rejected.outcome,
            reason = %rejected.reason,
            "broker delivery terminated"
        );
        self.0.push(rejected);
    }
}

fn rejected(
    message: &jetstream::Message,
    outcome: &'static str,
    message_id: Option<String>,
    aggregate_id: Option<String>,
    producer: Option<String>,
    reason: String,
) -> RejectedDelivery {
    let info = message.info().ok();
    RejectedDelivery {
        at: crate::clock::now(),
        subject: Some(message.subject.to_string()),
        stream_sequence: info
            .as_ref()
            .and_then(|info| i64::try_from(info.stream_sequence).ok()),
        delivered: info.as_ref().map(|info| info.delivered),
        message_id,
        aggregate_id,
        producer,
        outcome: outcome.to_owned(),
        reason,
    }
}

/// Every value of a message's header `name`, in any letter case (HTTP's header names are, and
/// these headers mean what the HTTP door's mean; a repeated one must be seen to be refused).
fn header_values<'a>(message: &'a jetstream::Message, name: &str) -> Vec<&'a str> {
    let Some(headers) = message.headers.as_ref() else {
        return Vec::new();
    };
    headers
        .iter()
        .filter(|(key, _)| AsRef::<str>::as_ref(key).eq_ignore_ascii_case(name))
        .flat_map(|(_, values)| values.iter().map(|value| value.as_str()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_name_their_durable_and_filter() {
        let mut config = BrokerConfig::with_checked_urls(vec!["nats://127.0.0.1:4222".to_owned()]);
        assert_eq!(config.filter_subject(), "ordered.*");
        assert_eq!(config.durable_name(), "production-lab");
        config.partitions = 2;
        config.partition = 1;
        assert_eq!(config.stream_subjects(), ["ordered.*.*"]);
        assert_eq!(config.filter_subject(), "ordered.1.*");
        assert_eq!(config.durable_name(), "production-lab-p1");
        config.partition = 2;
        assert!(config.validate().is_err());
    }

    #[test]
    fn verdicts_map_to_broker_actions() {
        assert_eq!(action_for(&Outcome::PayloadConflict), Action::Term);
        assert_eq!(
            action_for(&Outcome::Stale {
                expected: 2,
                skipped_by: None
            }),
            Action::Term
        );
        assert_eq!(
            action_for(&Outcome::Held {
                expected: 1,
                held: 1,
                repeated: true
            }),
            Action::Ack
        );
        assert_eq!(
            action_for(&Outcome::HoldFull {
                expected: 1,
                held: 9,
                limit: 9
            }),
            Action::Wait
        );
        assert_eq!(action_for(&Outcome::Gap { expected: 1 }), Action::Wait);
        assert_eq!(
            action_for(&Outcome::QuarantineFull {
                expected: 1,
                open: 9,
                limit: 9,
                reason: crate::model::QuarantineReason::new("poison"),
            }),
            Action::Nak
        );
        assert_eq!(back_off(Duration::from_secs(1), 1), Duration::from_secs(1));
        assert_eq!(back_off(Duration::from_secs(1), 3), Duration::from_secs(4));
        assert_eq!(back_off(Duration::from_secs(1), 99), MAX_NAK_DELAY);
    }
}
