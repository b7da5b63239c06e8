//! production-lab: the lesson's fixture, a Development-only loopback server that reproduces the
//! "production contracts" teaching lab over real HTTP and real SQLite rows, and the binary that
//! also runs the deployable ordering gate.
//!
//! # Crates
//!
//! The workspace's dependency graph is the architecture; each crate uses only those below it:
//!
//! - [`ordered_inbox`]: the library (decisions, SQLite and PostgreSQL backends); no HTTP.
//! - [`http_edge`]: what both products share between a socket and the inbox: the connection
//!   server and its limits, TLS, problem+json, credentials, request ids and access lines, pages,
//!   OpenAPI glue, metrics, the inbox's wiring, the JetStream consumer.
//! - `ordering_gate` (`crates/gate`): the deployable gate; it does not depend on this crate.
//! - this crate, the lab, with the binary's command line (`src/main.rs`, `src/cli/`), whose `gate`
//!   subcommand runs the gate; the bench workloads and the private services the tests start live
//!   in `lab-testkit`, which the gate does not link.
//!
//! # Layout
//!
//! The lab is built in floors on the edge's; each imports only the floors below it:
//!
//! 1. [`config`]: the fixture's settings and its loopback and Development guards.
//! 2. [`store`]: the labs' SQLite store (the library's single writer) and the labs' schema.
//! 3. [`telemetry`], [`http`]: the edge's metrics and plumbing, with the lab's own entity tags,
//!    ASP.NET input rules and .NET JSON writer.
//! 4. [`inbox`]: the edge's inbox wiring, the lesson's general-door body and its ledger handler.
//! 5. [`labs`]: one module per lab of the lesson, each taking only the state it needs.
//! 6. [`broker`] (the JetStream door with its evidence and fault switch), [`relay`] (the outbox's
//!    publisher), [`console`] (the operator's pages).
//! 7. [`observe`]: the edge middleware with the security lab's admission, and `/live`, `/ready`,
//!    `/metrics`.
//! 8. [`app`]: the application that assembles the floors into one router and its state.

pub mod app;
pub mod broker;
pub mod config;
pub mod console;
pub mod http;
pub mod inbox;
pub mod labs;
pub mod observe;
pub mod relay;
pub mod store;
pub mod telemetry;

pub use app::{AppParts, AppState, Application};
pub use config::Config;
