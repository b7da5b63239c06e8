//! The ordering gate (`production-lab gate --config FILE`): the ordered inbox as a deployable
//! service for any producer's messages, with none of the lab in it. It takes unordered,
//! duplicated, at-least-once deliveries over HTTP (`/v1`) and NATS JetStream and emits each
//! aggregate's messages exactly once and in sequence order, to a JetStream subject and over HTTP,
//! with poison (a payload its type's JSON Schema refuses) quarantined for an audited operator.
//!
//! It stands on the ordered inbox library and on the HTTP edge the lab's fixture shares
//! ([`http_edge`]: the connection server and its TLS, problem+json, the inbox's wiring, the
//! JetStream consumer, the edge middleware). It does not depend on the lab: the compiler keeps it
//! apart.
//!
//! - [`config`]: the TOML file, validated at start, every error naming its key;
//! - [`schemas`]: each message type's compiled JSON Schema;
//! - [`handler`]: the gate's handler in the inbox's transaction (check by schema, write the
//!   output row) on SQLite and PostgreSQL;
//! - [`output`]: the output table (an outbox in the inbox's database) and its reads;
//! - [`publisher`]: the in-process relay from the output table to JetStream, one gate of a
//!   store at a time, fenced by JetStream;
//! - [`lease`]: the store's publisher lease (holder, epoch, expiry);
//! - [`notices`]: on PostgreSQL, the other gates' commits of output rows waking the publisher;
//! - [`auth`]: producer, reader and operator credentials as extractors; producers' rate limits;
//! - [`routes`]: the `/v1` routes and their OpenAPI document;
//! - [`edge`]: what is refused from a request's head (conflicting framing, a declared length
//!   past the limit), unread bodies drained, HSTS and `no-store` on the way out;
//! - [`health`]: `/live`, `/ready` and `/metrics`, without a token;
//! - [`lag`]: the output's lag, sampled every few seconds for the last minutes (`/v1/lag`);
//! - [`overdue`]: which waiting aggregates waited past their successor's type's gap alert;
//! - [`console`]: the operator's console, static pages calling the `/v1` routes with a token;
//! - [`reload`]: the configuration read again on SIGHUP (types, readers' tokens, the TLS
//!   pair), all or nothing, and its generation;
//! - [`planted`]: known bugs the chaos campaign plants (feature `planted-bugs` only);
//! - [`app`]: `GateApplication::build` and its run until SIGTERM;
//! - [`backup`]: an online copy of a SQLite store while the gate serves
//!   (`production-lab gate backup`).

pub mod app;
pub mod auth;
pub mod backup;
pub mod config;
pub mod console;
pub mod edge;
pub mod handler;
pub mod health;
pub mod lag;
pub mod lease;
pub mod notices;
pub mod output;
pub mod overdue;
pub mod planted;
pub mod publisher;
pub mod reload;
pub mod retention;
pub mod routes;
pub mod schemas;
