//! The one integration-test binary: every test talks to a real server over loopback HTTP with a
//! fresh SQLite file. One module per lab.

mod browser;
mod helpers;
mod https;
mod postgres;

mod aggregates;
mod broker;
mod cache;
mod chaos;
mod connections;
mod console;
mod contracts;
mod crash;
mod gap_notices;
mod gaps;
mod gate;
mod gate_backup;
mod gate_config;
mod gate_console;
mod gate_core;
mod gate_edge;
mod gate_netns;
mod gate_recheck;
mod gate_reload;
mod gate_remote;
mod gate_retention;
mod gate_routes;
mod held;
mod http;
mod ledger;
mod messaging;
mod openapi;
mod operating;
mod ordered;
mod payload_numbers;
mod pipeline;
mod privacy;
mod producers;
mod relay;
mod requests;
mod security;
mod sql;
mod startup;
mod testkit;
mod worker;
