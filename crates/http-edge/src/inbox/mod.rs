//! The inbox's wiring in a server, below every door that delivers to it: the shared handle
//! ([`SharedInbox`], whatever store is underneath), its observing wrapper ([`observed`]: every
//! verdict counted, logged and told to open consoles where it is decided), the feed of committed
//! changes ([`changes`]), the message input the doors parse ([`input`], [`pages`]), the answers
//! every door words alike ([`answers`]), the verdicts every HTTP door answers a delivery with in
//! its own words ([`verdicts`]), and the operator requests and evidence queries it reads alike
//! ([`requests`], [`queries`]).
//!
//! The doors (HTTP routes, the JetStream consumer), the consoles and the operator routes stand on
//! this floor; it knows none of them, nor any application's handler.

pub mod answers;
pub mod changes;
pub mod input;
pub mod observed;
pub mod pages;
pub mod queries;
pub mod requests;
pub mod verdicts;

use std::sync::Arc;

use ordered_inbox::Inbox;

/// The inbox the doors and views use, whatever store is underneath.
pub type SharedInbox = Arc<dyn Inbox>;
