//! The inbox's wiring in the lab: the shared wiring of the HTTP edge (the handle, its observing
//! wrapper, the change feed, the message input, the answers and queries every door words alike),
//! and the lesson's ledger, the handler the inbox runs for every applied message ([`ledger`]).

pub use http_edge::inbox::{SharedInbox, answers, changes, observed, pages, queries, requests};

pub mod input;
pub mod ledger;
