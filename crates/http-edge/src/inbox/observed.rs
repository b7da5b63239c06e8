//! The inbox as the handlers and the broker consumer hold it: any backend, wrapped so that every
//! verdict is counted, every domain event is logged where it is decided, and every committed
//! change is told to open console pages, without the callers knowing.
//!
//! Domain events go to the target `production_lab::inbox` at info, with the aggregate id and the
//! message id — never a payload, an amount, an operator's token or a resolution's free-text
//! reason.

use async_trait::async_trait;
use ordered_inbox::gaps::{GapRequest, GapResolutionError, GapResolved};
use ordered_inbox::model::QuarantineReason;
use ordered_inbox::producers::TransferRequest;
use ordered_inbox::records::{ProducerClaim, ProducerRefusal, RejectedDelivery, TransferRecord};
use ordered_inbox::resolution::{Mode, ResolutionError, ResolutionRequest, Resolved};
use ordered_inbox::views::TransferConflict;
use ordered_inbox::{
    BatchDelivery, Door, Inbox, InboxError, InboxReads, OrderedMessage, Outcome, Undelivered,
};

use super::changes::InboxChanges;
use crate::inbox::SharedInbox;
use crate::metrics::{Metrics, door_label, refusal_reason};

/// The log target of the inbox's domain events.
pub const TARGET: &str = "production_lab::inbox";

/// Counts, logs and announces what the wrapped inbox decides; otherwise passes every call
/// through.
pub struct ObservedInbox {
    inner: SharedInbox,
    metrics: Metrics,
    changes: InboxChanges,
}

impl ObservedInbox {
    pub fn new(inner: SharedInbox, metrics: Metrics, changes: InboxChanges) -> ObservedInbox {
        ObservedInbox {
            inner,
            metrics,
            changes,
        }
    }

    /// Counts, logs and announces one delivery the inbox decided, or counts and logs one it
    /// refused before deciding (nothing was written, nothing to announce).
    fn observe(&self, handoff: &Handoff, decided: Result<&Outcome, &ProducerRefusal>) {
        match decided {
            Ok(outcome) => {
                self.metrics
                    .delivery::<InboxError>(handoff.door, Ok(outcome));
                log_delivery(handoff, outcome);
                self.changes
                    .delivered(&handoff.aggregate_id, &handoff.message_id, outcome);
            }
            Err(refusal) => {
                self.metrics.producer_refusal(handoff.door, refusal);
                log_refusal(handoff, refusal);
            }
        }
    }

    /// [`ObservedInbox::observe`] for one delivery of a batch: a handler failure is counted as
    /// a failed delivery (nothing of it was written).
    fn observe_in_batch(&self, handoff: &Handoff, decided: &Result<Outcome, Undelivered>) {
        match decided {
            Ok(outcome) => self.observe(handoff, Ok(outcome)),
            Err(Undelivered::Refused(refusal)) => self.observe(handoff, Err(refusal)),
            Err(Undelivered::Handler(error)) => {
                self.count_failure(handoff.door, &InboxError::Handler(error.clone()));
            }
        }
    }

    /// Counts a delivery the store failed to record.
    fn count_failure(&self, door: Door, error: &InboxError) {
        self.metrics.delivery(door, Err::<&Outcome, _>(error));
    }
}

/// What the wrapper keeps of a delivery while the inner inbox owns the message: the fields its
/// count, its log lines and its announced change name.
struct Handoff {
    door: Door,
    aggregate_id: String,
    message_id: String,
    sequence: i64,
    producer: Option<String>,
}

impl Handoff {
    fn of(message: &OrderedMessage, door: Door, claim: Option<&ProducerClaim>) -> Handoff {
        Handoff {
            door,
            aggregate_id: message.aggregate_id.clone(),
            message_id: message.message_id.clone(),
            sequence: message.sequence,
            producer: claim.map(|claim| claim.producer.clone()),
        }
    }
}

#[async_trait]
impl Inbox for ObservedInbox {
    async fn deliver(&self, message: OrderedMessage, door: Door) -> Result<Outcome, InboxError> {
        let handoff = Handoff::of(&message, door, None);
        let outcome = self.inner.deliver(message, door).await;
        match &outcome {
            Ok(outcome) => self.observe(&handoff, Ok(outcome)),
            Err(error) => self.count_failure(door, error),
        }
        outcome
    }

    async fn deliver_batch(
        &self,
        deliveries: Vec<BatchDelivery>,
    ) -> Result<Vec<Result<Outcome, Undelivered>>, InboxError> {
        let handoffs: Vec<Handoff> = deliveries
            .iter()
            .map(|delivery| Handoff::of(&delivery.message, delivery.door, delivery.claim.as_ref()))
            .collect();
        let outcomes = self.inner.deliver_batch(deliveries).await;
        match &outcomes {
            Ok(outcomes) => {
                for (handoff, decided) in handoffs.iter().zip(outcomes) {
                    self.observe_in_batch(handoff, decided);
                }
            }
            // One transaction: none of them was recorded.
            Err(error) => {
                for handoff in &handoffs {
                    self.count_failure(handoff.door, error);
                }
            }
        }
        outcomes
    }

    async fn resolve(
        &self,
        request: ResolutionRequest,
        mode: Mode,
    ) -> Result<Resolved, ResolutionError> {
        let action = request.action.kind();
        let resolved = self.inner.resolve(request, mode).await;
        self.metrics.resolution(action, resolved.as_ref());
        if let Ok(Resolved::New(record)) = &resolved {
            tracing::info!(
                target: TARGET,
                event = "resolved",
                aggregate_id = %record.aggregate_id,
                message_id = %record.message_id,
                operator = %record.operator,
                action = %record.action,
                sequence = record.sequence,
                "dead letter resolved by an operator"
            );
            self.changes.resolved(record);
        }
        resolved
    }

    async fn resolve_gap(
        &self,
        request: GapRequest,
        mode: Mode,
    ) -> Result<GapResolved, GapResolutionError> {
        let resolved = self.inner.resolve_gap(request, mode).await;
        self.metrics.gap_resolution(resolved.as_ref());
        if let Ok(GapResolved::New(record)) = &resolved {
            tracing::info!(
                target: TARGET,
                event = "gap resolved",
                aggregate_id = %record.aggregate_id,
                operator = %record.operator,
                from = record.range.from,
                through = record.range.through,
                drained = record.drained.len(),
                "gap skipped by an operator"
            );
            self.changes.gap_resolved(record);
        }
        resolved
    }

    async fn prune(
        &self,
        plan: ordered_inbox::retention::PrunePlan,
    ) -> Result<ordered_inbox::retention::Pruned, InboxError> {
        self.inner.prune(plan).await
    }

    async fn deliver_as(
        &self,
        message: OrderedMessage,
        door: Door,
        claim: Option<ProducerClaim>,
    ) -> Result<Result<Outcome, ProducerRefusal>, InboxError> {
        let handoff = Handoff::of(&message, door, claim.as_ref());
        let decided = self.inner.deliver_as(message, door, claim).await;
        match &decided {
            Ok(decided) => self.observe(&handoff, decided.as_ref()),
            Err(error) => self.count_failure(door, error),
        }
        decided
    }

    async fn start_session(
        &self,
        producer: String,
    ) -> Result<Result<i64, ProducerRefusal>, InboxError> {
        let started = self.inner.start_session(producer.clone()).await;
        if let Ok(Ok(epoch)) = &started {
            tracing::info!(
                target: TARGET,
                event = "session_started",
                producer,
                epoch,
                "producer session started; older epochs are fenced"
            );
        }
        started
    }

    async fn transfer_owner(
        &self,
        request: TransferRequest,
    ) -> Result<Result<TransferRecord, TransferConflict>, InboxError> {
        let transferred = self.inner.transfer_owner(request).await;
        if let Ok(Ok(record)) = &transferred {
            tracing::info!(
                target: TARGET,
                event = "owner_transferred",
                aggregate_id = %record.aggregate_id,
                operator = %record.operator,
                from_owner = record.from_owner.as_deref().unwrap_or(""),
                to_owner = %record.to_owner,
                held_rejected = record.held_rejected,
                "aggregate transferred by an operator"
            );
            self.changes.owner_transferred(record);
        }
        transferred
    }

    async fn record_rejected(&self, rejected: Vec<RejectedDelivery>) -> Result<(), InboxError> {
        self.inner.record_rejected(rejected).await
    }

    /// Reads are not observed: the store's own, as they are.
    fn reads(&self) -> &dyn InboxReads {
        self.inner.reads()
    }
}

/// Logs a producer delivery the inbox refused before deciding it (nothing was written): a fenced
/// instance at warn (it must stop), every other refusal at info.
fn log_refusal(handoff: &Handoff, refusal: &ProducerRefusal) {
    let aggregate_id = handoff.aggregate_id.as_str();
    let message_id = handoff.message_id.as_str();
    let producer = handoff.producer.as_deref().unwrap_or("");
    if let ProducerRefusal::Fenced {
        offered,
        current_epoch,
    } = refusal
    {
        tracing::warn!(
            target: TARGET,
            event = "fenced",
            aggregate_id,
            message_id,
            producer,
            offered_epoch = offered,
            current_epoch,
            "delivery from a superseded producer session refused"
        );
    } else {
        tracing::info!(
            target: TARGET,
            event = "producer_refused",
            aggregate_id,
            message_id,
            producer,
            reason = refusal_reason(refusal),
            "producer delivery refused before any decision"
        );
    }
}

/// The domain events of one delivery: a quarantine (or a refused one), a hold (or a refused
/// one), and each dead letter an applied message superseded. The other verdicts log no event of
/// their own.
fn log_delivery(handoff: &Handoff, outcome: &Outcome) {
    let delivery = LoggedDelivery {
        door: door_label(handoff.door),
        aggregate_id: &handoff.aggregate_id,
        message_id: &handoff.message_id,
        sequence: handoff.sequence,
    };
    match outcome {
        Outcome::Quarantined {
            expected,
            reason,
            dead_letter,
        } => delivery.quarantined(*expected, reason, dead_letter.map(|note| note.observations)),
        Outcome::QuarantineFull {
            expected,
            open,
            limit,
            ..
        } => delivery.quarantine_full(*expected, *open, *limit),
        Outcome::Applied { superseded, .. } => delivery.superseded(superseded),
        Outcome::Held {
            expected,
            held,
            repeated: false,
        } => delivery.held(*expected, *held),
        Outcome::HoldFull {
            expected,
            held,
            limit,
        } => delivery.hold_full(*expected, *held, *limit),
        Outcome::Held { repeated: true, .. }
        | Outcome::Replay { .. }
        | Outcome::PayloadConflict
        | Outcome::Gap { .. }
        | Outcome::Stale { .. } => {}
    }
}

/// The fields every domain event of a delivery carries.
struct LoggedDelivery<'a> {
    door: &'static str,
    aggregate_id: &'a str,
    message_id: &'a str,
    sequence: i64,
}

impl LoggedDelivery<'_> {
    fn quarantined(&self, expected: i64, reason: &QuarantineReason, observations: Option<i64>) {
        tracing::info!(
            target: TARGET,
            event = "quarantined",
            door = self.door,
            aggregate_id = self.aggregate_id,
            message_id = self.message_id,
            sequence = self.sequence,
            expected,
            reason = %reason,
            observations,
            "message quarantined as a dead letter; the aggregate waits"
        );
    }

    fn quarantine_full(&self, expected: i64, open: usize, limit: usize) {
        tracing::warn!(
            target: TARGET,
            event = "quarantine_full",
            door = self.door,
            aggregate_id = self.aggregate_id,
            message_id = self.message_id,
            sequence = self.sequence,
            expected,
            open,
            limit,
            "poison message refused: the aggregate's quarantine is full"
        );
    }

    /// One event per dead letter the applied message replaced.
    fn superseded(&self, superseded: &[String]) {
        for dead_letter in superseded {
            tracing::info!(
                target: TARGET,
                event = "superseded",
                door = self.door,
                aggregate_id = self.aggregate_id,
                message_id = %dead_letter,
                superseded_by = self.message_id,
                sequence = self.sequence,
                "dead letter superseded by a message that took its sequence"
            );
        }
    }

    fn held(&self, expected: i64, held: usize) {
        tracing::info!(
            target: TARGET,
            event = "held",
            door = self.door,
            aggregate_id = self.aggregate_id,
            message_id = self.message_id,
            sequence = self.sequence,
            expected,
            held,
            "message held until its predecessors apply"
        );
    }

    fn hold_full(&self, expected: i64, held: usize, limit: usize) {
        tracing::warn!(
            target: TARGET,
            event = "hold_full",
            door = self.door,
            aggregate_id = self.aggregate_id,
            message_id = self.message_id,
            sequence = self.sequence,
            expected,
            held,
            limit,
            "message ahead of its turn refused: the aggregate holds the most it may"
        );
    }
}
