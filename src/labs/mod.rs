//! One module per lab. Each exposes `routes()`, a router generic over the application's state
//! that asks only for the pieces its handlers extract (`Store: FromRef<S>`, `CacheLab:
//! FromRef<S>` …). Labs with state of their own keep it in a struct (`CacheLab`, `WorkerLab` …)
//! built at start-up from a [`crate::labs::context::StartupContext`]; the application holds one of
//! each and assembles the routes. Labs never depend on the application itself.

pub mod cache;
pub mod context;
pub mod contracts;
pub mod http;
pub mod latch;
pub mod messaging;
pub mod ordered;
pub mod outbox;
pub mod pipeline;
pub mod privacy;
pub mod security;
pub mod sql;
pub mod worker;
