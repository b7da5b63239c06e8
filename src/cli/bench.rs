//! `production-lab bench …`: the measured figures (release build recommended): each bench prints
//! its figures, writes them as JSON with `--json`, and fails on a wrong end state.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use production_lab::bench;
use production_lab::config::Synchronous;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Durable ordered applies over HTTP (group commit) against one transaction per message.
    Ordered(BenchOrderedArgs),
    /// Concurrent callers of the cache's shared key behind the lab gate: one factory run.
    Stampede(BenchStampedeArgs),
    /// NATS JetStream through the inbox (a private nats-server) against a raw consume-and-ack
    /// baseline and the HTTP door.
    Broker(BenchBrokerArgs),
    /// Events from server A's general outbox through `relay` processes and a private
    /// nats-server to server B's ordered inbox, with 1 and 2 relays.
    Relay(BenchRelayArgs),
}

#[derive(Args)]
pub struct BenchRelayArgs {
    #[arg(long, default_value_t = 64)]
    pub aggregates: usize,
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Concurrent writers of A's outbox.
    #[arg(long, default_value_t = 32)]
    pub writers: usize,
    /// Events per lease.
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// The lease-latency phase: events pending in A's outbox.
    #[arg(long, default_value_t = 20_000)]
    pub lease_pending: usize,
    /// The lease-latency phase: how many of the pending events are under live leases (each the
    /// first pending event of its aggregate, with a share of the rest waiting behind it).
    #[arg(long, default_value_t = 1_000)]
    pub lease_held: usize,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct BenchBrokerArgs {
    #[arg(long, default_value_t = 64)]
    pub aggregates: usize,
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// The consumer's --nats-batch.
    #[arg(long, default_value_t = production_lab::broker::DEFAULT_BATCH)]
    pub batch: usize,
    /// The HTTP comparison's concurrent clients.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    #[arg(long, value_enum, default_value = "full")]
    pub synchronous: Synchronous,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct BenchOrderedArgs {
    #[arg(long, default_value_t = 64)]
    pub aggregates: usize,
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    #[arg(long, value_enum, default_value = "full")]
    pub synchronous: Synchronous,
    /// Run this build of production-lab as the server (e.g. the previous commit's release build)
    /// under the same load and measurements; default: this binary.
    #[arg(long)]
    pub server: Option<PathBuf>,
    /// sqlite: group commit against one transaction per message; postgres: a private
    /// PostgreSQL through one and two servers, next to the SQLite server.
    #[arg(long, value_enum, default_value = "sqlite")]
    pub backend: bench::Backend,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct BenchStampedeArgs {
    #[arg(long, default_value_t = 1_000)]
    pub callers: usize,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let (text, json, path) = runtime.block_on(async {
        match command {
            BenchCommand::Ordered(args) => {
                let options = bench::OrderedOptions {
                    aggregates: args.aggregates,
                    messages: args.messages,
                    concurrency: args.concurrency,
                    synchronous: args.synchronous,
                    server: args.server,
                };
                if args.backend == bench::Backend::Postgres {
                    let report = bench::ordered_postgres(&options).await?;
                    return anyhow::Ok((
                        report.to_string(),
                        serde_json::to_string_pretty(&report)?,
                        args.json,
                    ));
                }
                let report = bench::ordered(&options).await?;
                anyhow::Ok((
                    report.to_string(),
                    serde_json::to_string_pretty(&report)?,
                    args.json,
                ))
            }
            BenchCommand::Broker(args) => {
                let options = production_lab::broker::bench::BrokerBenchOptions {
                    aggregates: args.aggregates,
                    messages: args.messages,
                    batch: args.batch,
                    synchronous: args.synchronous,
                    concurrency: args.concurrency,
                };
                let report = production_lab::broker::bench::run(&options).await?;
                anyhow::Ok((
                    report.to_string(),
                    serde_json::to_string_pretty(&report)?,
                    args.json,
                ))
            }
            BenchCommand::Relay(args) => {
                let options = production_lab::relay::bench::RelayBenchOptions {
                    aggregates: args.aggregates,
                    messages: args.messages,
                    writers: args.writers,
                    batch: args.batch,
                    lease_pending: args.lease_pending,
                    lease_held: args.lease_held,
                };
                let report = production_lab::relay::bench::run(&options).await?;
                anyhow::Ok((
                    report.to_string(),
                    serde_json::to_string_pretty(&report)?,
                    args.json,
                ))
            }
            BenchCommand::Stampede(args) => {
                let report = bench::stampede(args.callers).await?;
                anyhow::Ok((
                    report.to_string(),
                    serde_json::to_string_pretty(&report)?,
                    args.json,
                ))
            }
        }
    })?;
    println!("{text}");
    if let Some(path) = path {
        std::fs::write(&path, json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
