//! # ordered-inbox
//!
//! A per-aggregate ordered inbox: each aggregate's messages apply in sequence order, exactly once;
//! a message ahead of its turn is a *gap*, one behind it is *stale*; a poison message at the
//! expected sequence becomes a *dead letter* and blocks its aggregate (never advances it) until a
//! corrected message under a new id takes the sequence or an *operator* resolves it, with an audit
//! row. A message id never changes meaning, across applied messages, dead letters and held messages
//! alike. Every change and every rejection is on the aggregate's *timeline*.
//!
//! Through a broker's door ([`Door::Broker`]) a message ahead of its turn is *held* rather than
//! refused: recorded, and applied (or quarantined) in sequence order in the same transaction as
//! the predecessor that makes it next, whichever door or resolution that came through. A batch of
//! deliveries ([`Inbox::deliver_batch`]) costs one transaction.
//!
//! ## Layout
//!
//! The crate is a functional core with storage behind one seam:
//!
//! - [`model`]: the typed values: messages, doors, statuses, positions, limits.
//! - [`policy`]: the ordering rule for one sequence against the last applied one.
//! - [`delivery`]: the decision of one delivery: facts in, verdict and row changes out.
//! - [`resolution`]: the decision of an operator's resolution, the same way.
//! - [`timeline`]: what the timeline records and the bound on rejection observations.
//! - [`views`]: the evidence read back (aggregate, inventory, dead letters, audit trail).
//! - [`operators`]: tokens and names of the people who may resolve.
//! - [`producers`]: who may write an aggregate's sequence: producer sessions and epochs
//!   (fencing), aggregate ownership and its transfer.
//! - [`rejected`]: the rejected list: deliveries a broker consumer terminated and held messages
//!   that may no longer apply, kept in the store, bounded.
//! - [`inbox`]: the [`Inbox`] trait every backend implements (async; a backend reads facts and
//!   writes the decided changes in one transaction serialized per aggregate).
//! - [`sqlite`] (feature `sqlite`, on by default): the SQLite backend: one writer thread with
//!   group commit (a savepoint per unit only when a unit fails), read connections, the inbox's schema and migrations.
//! - [`postgres`] (feature `postgres`): the PostgreSQL backend, for several server processes on
//!   one database: a connection pool, one transaction per operation serialized per aggregate by
//!   advisory and row locks, pipelined prepared statements, versioned migrations.
//!
//! The two backends are the only modules that know SQL; neither holds an ordering rule.
//! - [`clock`]: the stored timestamp format.
//!
//! Nothing here speaks HTTP: verdicts, conflicts and refusals are enums, and a server words them.
//!
//! ## Example
//!
//! ```
//! use ordered_inbox::sqlite::{SqliteInbox, Synchronous, operators};
//! use ordered_inbox::{Action, Door, Inbox, Limits, Mode, OrderedMessage, Outcome, ResolutionRequest};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("inbox.db");
//! let inbox = SqliteInbox::open(&path, Synchronous::Full, Limits::default())?;
//! let message = |id: &str, sequence, amount| OrderedMessage {
//!     message_id: id.into(),
//!     aggregate_id: "account-7".into(),
//!     sequence,
//!     amount,
//! };
//!
//! let first = inbox.deliver(message("m-1", 1, 10), Door::General).await?;
//! assert!(matches!(first, Outcome::Applied { sequence: 1, total: 10, .. }));
//! let early = inbox.deliver(message("m-3", 3, 5), Door::General).await?;
//! assert_eq!(early, Outcome::Gap { expected: 2 });
//! let poison = inbox.deliver(message("bad-2", 2, -1), Door::General).await?;
//! assert!(matches!(poison, Outcome::Quarantined { expected: 2, .. }));
//!
//! // An operator, registered out of band, skips the poison record: no effect, last moves to 2.
//! operators::add(&path, "alice")?;
//! let skip = ResolutionRequest {
//!     producer: None, // an anonymous delivery's dead letter
//!     dead_letter_id: "bad-2".into(),
//!     operator: "alice".into(),
//!     action: Action::Skip,
//!     expected_last: 1,
//!     reason: "the order was cancelled upstream".into(),
//! };
//! inbox.resolve(skip, Mode::Commit).await?;
//!
//! let next = inbox.deliver(message("m-3", 3, 5), Door::General).await?;
//! assert!(matches!(next, Outcome::Applied { sequence: 3, total: 15, .. }));
//! inbox.shutdown().await;
//! # Ok(())
//! # }
//! ```

pub mod change;
pub mod clock;
pub mod content;
pub mod delivery;
pub mod error;
pub mod facts;
pub mod inbox;
pub mod model;
pub mod operators;
pub mod policy;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod producers;
pub mod records;
pub mod rejected;
pub mod resolution;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod timeline;
pub mod views;

pub use change::Change;
pub use content::{AcceptAll, ApplyOutcome, Check, Detail, Poison, canonical_json};
pub use delivery::{
    Context, DeadLetterNote, DeliveryPlan, Outcome, decide_delivery, decide_delivery_as,
    decide_producer_delivery,
};
pub use error::{HandlerError, InboxError};
pub use facts::{DeliveryFacts, HeldMessage, OwnershipFacts, ProducerFact};
pub use inbox::{BatchDelivery, Inbox, Undelivered};
pub use model::{
    ActionKind, AggregateStatus, DeadLetterStatus, Door, Limits, OrderedMessage, Position,
    QuarantineReason,
};
pub use producers::{TransferPlan, TransferRequest};
pub use records::{
    AggregateOwner, ProducerClaim, ProducerRefusal, REJECTED_KEPT, RejectedDelivery, Replacement,
    ResolutionRecord, TransferRecord, TransferRefusal,
};
pub use rejected::HeldRejection;
pub use resolution::{
    Action, ConflictKind, Mode, ResolutionError, ResolutionRequest, Resolved, decide_resolution,
};
