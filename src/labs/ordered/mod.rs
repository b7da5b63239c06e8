//! Ordered delivery, two doors onto one inbox ([`ordered_inbox`]):
//!
//! - `classroom`: the lesson's `POST /ordered/apply` and `GET /ordered/state`, unchanged;
//! - `aggregates`: the general inbox `POST /aggregates/{id}/messages` for any aggregate, with
//!   verdicts that say what the caller can do, and the evidence (aggregate state, blocked/waiting
//!   inventory, timeline, dead letters);
//! - `resolution`: operator-approved poison resolution and its audit trail;
//! - `gaps`: what a waiting aggregate is missing, and an operator's audited skip of it;
//! - `producers`: producer sessions (epochs, fencing), aggregate ownership and its transfer.
//!
//! The handlers take only the inbox ([`crate::inbox::SharedInbox`]): the library decides, this module words the
//! answers.

mod aggregates;
mod classroom;
mod gaps;
mod operator;
pub mod practice;
mod producers;
mod resolution;
mod verdicts;

use axum::extract::FromRef;
use utoipa_axum::router::OpenApiRouter;

use crate::inbox::SharedInbox;

pub fn routes<S>() -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
    SharedInbox: FromRef<S>,
{
    OpenApiRouter::new()
        .merge(classroom::routes())
        .merge(aggregates::routes())
        .merge(resolution::routes())
        .merge(gaps::routes())
        .merge(producers::routes())
}
