//! Per-aggregate ordering: the pure policy ([`policy`]) and the SQL engine that applies it to
//! the store's rows ([`engine`]). Both HTTP doors (the classroom `/ordered/apply` and the general
//! `/aggregates/{id}/messages`), the operator resolution ([`resolution`]) and the `practice`
//! command decide through [`policy::decide`], so the classroom model and the real consumer cannot
//! drift apart. [`timeline`] records what happened; [`views`] reads the evidence back.

pub mod clock;
pub mod engine;
pub mod policy;
pub mod resolution;
pub mod timeline;
pub mod views;

pub use engine::{Door, OrderedMessage, Outcome, apply, apply_ordered};
pub use policy::{Decision, QuarantineReason, decide};
