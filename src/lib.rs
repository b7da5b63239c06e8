//! production-lab: a Development-only loopback server that reproduces the "production
//! contracts" teaching lab over real HTTP and real SQLite rows, and the ordered inbox that grew
//! out of its ordering lesson ([`ordered_inbox`], a crate of its own).
//!
//! # Layout
//!
//! The server is built in floors; each imports only the floors below it:
//!
//! 1. [`config`]: every component's settings and the start-up refusals.
//! 2. [`store`]: the labs' SQLite store (the library's single writer) and the labs' schema.
//! 3. [`telemetry`]: the figures every door counts into.
//! 4. [`http`]: the connection server and its limits, problem+json and the extractors, the
//!    bearer credential, OpenAPI, entity tags, the ASP.NET input rules and the .NET JSON writer.
//! 5. [`inbox`]: the shared inbox handle, its observing wrapper, the feed of committed changes and
//!    the message input both doors parse.
//! 6. [`labs`]: one module per lab of the lesson, each taking only the state it needs.
//! 7. [`broker`] (the NATS JetStream door), [`relay`] (the outbox's publisher), [`console`] (the
//!    operator's pages).
//! 8. [`observe`]: the edge middleware (request ids, request lines, HTTP metrics) and `/live`,
//!    `/ready`, `/metrics`.
//! 9. [`app`]: the application that assembles the floors into one router and its state; beside it
//!    [`gate`], the deployable ordering gate, assembled from the same floors with no lab in it.
//!
//! The command line (`src/main.rs` and `src/cli/`) is the binary's, above all of them; the bench
//! workloads and the private services tests start live in the `lab-testkit` crate.

pub mod app;
pub mod broker;
pub mod config;
pub mod console;
pub mod gate;
pub mod http;
pub mod inbox;
pub mod labs;
pub mod observe;
pub mod relay;
pub mod store;
pub mod telemetry;

pub use app::{AppParts, AppState, Application};
pub use config::Config;
