//! What an operator can watch: metrics (`GET /metrics`), request and domain-event logs (text or
//! JSON), and readiness (`GET /ready`).
//!
//! - [`http`]: the edge middleware: request ids, the request span and line, the HTTP metrics;
//! - [`routes`]: `/live`, `/ready`, `/metrics`.
//!
//! The figures themselves are kept in [`crate::telemetry::metrics`], a floor below every door that
//! counts into them; the inbox's verdicts are counted and logged by [`crate::inbox::observed`].

pub use http_edge::observe::{LogFormat, Metrics, http, init_logging, spawn_upkeep};
pub mod routes;
