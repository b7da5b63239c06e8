//! production-lab: a Development-only loopback server that reproduces the "production
//! contracts" teaching lab over real HTTP and real SQLite rows.

pub mod app;
pub mod aspnet;
pub mod bench;
pub mod broker;
pub mod config;
pub mod console;
pub mod dotnet_json;
pub mod error;
pub mod etag;
pub mod labs;
pub mod observe;
pub mod openapi;
pub mod pg_cluster;
pub mod practice;
pub mod producer_epoch;
pub mod progress;
pub mod relay;
pub mod schema;
pub mod server;
pub mod startup;
pub mod store;
pub mod verify;

pub use app::{AppParts, AppState, Application};
pub use config::Config;
