//! Per-aggregate ordering: the pure policy ([`policy`]) and the SQL engine that applies it to
//! the store's rows ([`engine`]). The HTTP routes and the `practice` command both decide through
//! [`policy::decide`], so the classroom model and the real consumer cannot drift apart.

pub mod engine;
pub mod policy;

pub use engine::{OrderedMessage, Outcome, apply_ordered};
pub use policy::{Decision, QuarantineReason, decide};
