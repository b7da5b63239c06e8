//! The seam every backend implements: the inbox's operations as one async trait, so the server
//! (or any service) holds an `Arc<dyn Inbox>` and never knows which store is underneath.
//!
//! A backend's contract, for each write operation: read the facts and write the decided changes
//! in one transaction, serialized per aggregate (the SQLite backend's single writer; a row lock on
//! the aggregate in a server database), and answer only after that transaction committed. The
//! decisions themselves come from [`crate::delivery`] and [`crate::resolution`]; a backend adds
//! no rule of its own.

use async_trait::async_trait;

use crate::delivery::Outcome;
use crate::error::HandlerError;
pub use crate::error::InboxError;
use crate::gaps::{GapRequest, GapResolutionError, GapResolved};
use crate::model::{AggregateStatus, Door, OrderedMessage};
use crate::operators::OperatorCheck;
use crate::producers::TransferRequest;
use crate::records::{
    GapRecord, ProducerClaim, ProducerRefusal, RejectedDelivery, ResolutionRecord, TransferRecord,
};
use crate::resolution::{Mode, ResolutionError, ResolutionRequest, Resolved};
use crate::retention::{PrunePlan, Pruned, Retained};
use crate::views::{
    AggregateCounts, AggregateView, AppliedMessage, DeadLetterFilter, DeadLetterView, InboxHealth,
    InventoryEntry, OwnershipState, Page, PageRequest, ProducerView, TimelineEvent,
    TransferConflict,
};

/// Why one delivery of [`Inbox::deliver_batch`] has no verdict. Either way nothing of it was
/// recorded, and the other deliveries of the batch are not affected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Undelivered {
    /// Producer admission refused it (epoch fencing, ownership): deciding it would change nothing.
    #[error(transparent)]
    Refused(ProducerRefusal),
    /// The application's handler failed applying it: delivering it again retries.
    #[error("handler failure: {0}")]
    Handler(HandlerError),
}

/// One delivery of [`Inbox::deliver_batch`]: the message, its door, and the producer that made
/// it (`None`: anonymous).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchDelivery {
    /// The message.
    pub message: OrderedMessage,
    /// The door it came through.
    pub door: Door,
    /// The producer and epoch it was sent under (`None`: anonymous).
    pub claim: Option<ProducerClaim>,
}

impl BatchDelivery {
    /// An anonymous delivery.
    pub fn anonymous(message: OrderedMessage, door: Door) -> BatchDelivery {
        BatchDelivery {
            message,
            door,
            claim: None,
        }
    }
}

/// The ordered inbox's operations.
#[async_trait]
pub trait Inbox: Send + Sync {
    /// Decides and records one anonymous delivery without looking at the aggregate's owner; `Ok`
    /// means committed. For a store whose aggregates have no owners: a door that may meet an
    /// owned aggregate delivers through [`Inbox::deliver_as`], which refuses an anonymous
    /// delivery to it.
    async fn deliver(&self, message: OrderedMessage, door: Door) -> Result<Outcome, InboxError>;

    /// Decides and records deliveries in the order given, each seeing the ones before it, and
    /// answers one verdict per delivery, in that order. A broker consumer hands over what it
    /// fetched together, so that it costs one commit.
    ///
    /// Each delivery is checked as [`Inbox::deliver_as`] checks one (epoch fencing and
    /// ownership for its claim, or anonymous), on facts read in the same transaction as its
    /// write; a refusal or a handler failure (the inner `Err`) writes nothing and does not stop
    /// the ones after it.
    /// The SQLite backend writes them all in ONE unit: `Ok` means all committed, `Err` that none
    /// did. (PostgreSQL commits one transaction per delivery; see its documentation.)
    async fn deliver_batch(
        &self,
        deliveries: Vec<BatchDelivery>,
    ) -> Result<Vec<Result<Outcome, Undelivered>>, InboxError>;

    /// Resolves a dead letter for an authenticated operator, or (dry run) reports what that would
    /// do.
    async fn resolve(
        &self,
        request: ResolutionRequest,
        mode: Mode,
    ) -> Result<Resolved, ResolutionError>;

    /// Resolves a gap for an authenticated operator (`crate::gaps::decide_gap_resolution`),
    /// or (dry run) reports what that would do.
    async fn resolve_gap(
        &self,
        request: GapRequest,
        mode: Mode,
    ) -> Result<GapResolved, GapResolutionError>;

    /// Decides and records one delivery made by `claim`'s producer (`None`: anonymous), with
    /// epoch fencing and ownership checked in the same transaction as the write
    /// (`crate::delivery::decide_producer_delivery`). The inner `Err` is a refusal: nothing was written.
    async fn deliver_as(
        &self,
        message: OrderedMessage,
        door: Door,
        claim: Option<ProducerClaim>,
    ) -> Result<Result<Outcome, ProducerRefusal>, InboxError>;

    /// Starts a new session of `producer`: its epoch goes one up, in one transaction, and every
    /// delivery under an older epoch is fenced from then on.
    async fn start_session(
        &self,
        producer: String,
    ) -> Result<Result<i64, ProducerRefusal>, InboxError>;

    /// An operator's transfer of an aggregate to a producer, checked against its preconditions
    /// and recorded with an audit row and a timeline event, in one transaction; the held
    /// messages it makes inadmissible are rejected in it (`crate::producers::decide_transfer`).
    async fn transfer_owner(
        &self,
        request: TransferRequest,
    ) -> Result<Result<TransferRecord, TransferConflict>, InboxError>;

    /// Appends entries to the rejected list (a broker consumer's own terminations), in one
    /// transaction; the list keeps the newest [`crate::records::REJECTED_KEPT`].
    async fn record_rejected(&self, rejected: Vec<RejectedDelivery>) -> Result<(), InboxError>;

    /// Runs one bounded batch of pruning (see [`crate::retention`]): at most `plan.batch` rows
    /// of each kind, in one transaction of its own (on SQLite, one unit of the writer between
    /// deliveries' group commits). Positions and the audit trail are never touched, so a
    /// delivery concurrent with it is decided as before or after it, never otherwise.
    async fn prune(&self, plan: PrunePlan) -> Result<Pruned, InboxError>;

    /// The reads of the same store.
    fn reads(&self) -> &dyn InboxReads;
}

/// What reads the inbox's evidence: views, audit trails, checks of credentials, health. Reads
/// take no part in the ordering and need no wrapping: a wrapper of [`Inbox`] hands out its
/// store's reads as they are ([`Inbox::reads`]).
#[async_trait]
pub trait InboxReads: Send + Sync {
    /// The gap resolutions' audit rows, oldest first, optionally for one aggregate: numbered in
    /// the same sequence as [`InboxReads::resolutions`], so the two merge into one trail by id.
    async fn gap_resolutions(
        &self,
        aggregate_id: Option<String>,
        page: PageRequest,
    ) -> Result<Page<GapRecord>, InboxError>;

    /// Who `token` belongs to (`None`: no token was offered) and how many operators are active.
    async fn check_operator(&self, token: Option<String>) -> Result<OperatorCheck, InboxError>;

    /// The aggregate's position, status and open dead letters (`None`: never recorded).
    async fn aggregate(&self, aggregate_id: String) -> Result<Option<AggregateView>, InboxError>;

    /// For each aggregate named that holds messages, its lowest held message's payload as
    /// delivered (JSON text): what a waiting aggregate is known to receive after its gap.
    /// Aggregates without held messages are left out.
    async fn lowest_held_payloads(
        &self,
        aggregate_ids: Vec<String>,
    ) -> Result<Vec<(String, String)>, InboxError>;

    /// Aggregates in `status`, the longest-standing first.
    async fn inventory(
        &self,
        status: AggregateStatus,
        limit: i64,
    ) -> Result<Vec<InventoryEntry>, InboxError>;

    /// Dead letters in the order they were first recorded.
    async fn dead_letters(
        &self,
        filter: DeadLetterFilter,
        page: PageRequest,
    ) -> Result<Page<DeadLetterView>, InboxError>;

    /// The aggregate's timeline, oldest first.
    async fn timeline(
        &self,
        aggregate_id: String,
        page: PageRequest,
    ) -> Result<Page<TimelineEvent>, InboxError>;

    /// The audit trail, oldest first, optionally for one aggregate.
    async fn resolutions(
        &self,
        aggregate_id: Option<String>,
        page: PageRequest,
    ) -> Result<Page<ResolutionRecord>, InboxError>;

    /// Applied messages, dead letters and last sequence of one aggregate.
    async fn counts(&self, aggregate_id: String) -> Result<AggregateCounts, InboxError>;

    /// The aggregate's applied messages (its `ordered_inbox` rows) in sequence order, after
    /// sequence `page.after`.
    async fn applied_messages(
        &self,
        aggregate_id: String,
        page: PageRequest,
    ) -> Result<Page<AppliedMessage>, InboxError>;

    /// One dead letter by its identity, with its resolution if it has one: the namespace of the
    /// producer that delivered it (`None`: the anonymous namespace) and its message id.
    async fn dead_letter(
        &self,
        producer: Option<String>,
        message_id: String,
    ) -> Result<Option<DeadLetterView>, InboxError>;

    /// The active producer `token` belongs to (`None`: unknown or revoked).
    async fn check_producer(&self, token: String) -> Result<Option<String>, InboxError>;

    /// The aggregate's owner and last applied sequence.
    async fn ownership(&self, aggregate_id: String) -> Result<OwnershipState, InboxError>;

    /// Every producer, the first registered first (never tokens).
    async fn producers(&self) -> Result<Vec<ProducerView>, InboxError>;

    /// The rejected list, oldest first: the consumer's terminations and the held messages the
    /// inbox rejected (see [`crate::rejected`]).
    async fn rejected(&self, page: PageRequest) -> Result<Page<RejectedDelivery>, InboxError>;

    /// The figures an operator watches across all aggregates (see [`InboxHealth`]). Cheap enough
    /// to call on every metrics scrape and readiness probe: a few indexed reads, no writes. An
    /// `Err` means the store does not answer reads.
    async fn health(&self) -> Result<InboxHealth, InboxError>;

    /// The store's size and its oldest retained row of each kind.
    async fn retained(&self) -> Result<Retained, InboxError>;
}
