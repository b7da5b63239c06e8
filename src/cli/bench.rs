//! `production-lab bench …`: the measured figures (release build recommended): each bench prints
//! its figures, writes them as JSON with `--json`, and fails on a wrong end state.

mod gate_store;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use lab_testkit::bench;
use production_lab::config::Synchronous;
use production_lab::inbox::ledger::{self, Ledger};

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
    /// The gate from its NATS input stream to its in-order output stream (a private
    /// nats-server), with `bench broker` beside it in the same run.
    Gate(BenchGateArgs),
    /// The broker door under one aggregate's flood of early messages: how long another
    /// aggregate's message waits, and how fast the flooded one catches up once its gap fills.
    Flood(BenchFloodArgs),
    /// A gate's store under a short retention: its size sampled as millions of messages go
    /// through, bounded after warm-up, and the throughput against retention off.
    Retention(BenchRetentionArgs),
}

#[derive(Args)]
pub struct BenchRetentionArgs {
    /// The gate's store: a SQLite file, or a private PostgreSQL (durable commits).
    #[arg(long, value_enum, default_value = "sqlite")]
    pub backend: Backend,
    /// Messages with retention on [default: 2000000 on SQLite, 1000000 on PostgreSQL, whose
    /// store reaches its window's high-water mark later than its warm-up of 500000 would end].
    #[arg(long)]
    pub messages: Option<usize>,
    /// Messages of the same workload with retention off [default: --messages].
    #[arg(long)]
    pub off_messages: Option<usize>,
    #[arg(long, default_value_t = 10_000)]
    pub aggregates: usize,
    /// Sample the store's size every this many messages.
    #[arg(long, default_value_t = 100_000)]
    pub sample_every: usize,
    /// Messages per delivery call: the gate's input batch ([nats.input] batch).
    #[arg(long, default_value_t = ordering_gate::config::DEFAULT_BATCH as usize)]
    pub batch: usize,
    /// Concurrent consumers, each delivering its share of the aggregates.
    #[arg(long, default_value_t = 4)]
    pub consumers: usize,
    /// How long applied identities, published output rows and closed dead letters are kept.
    #[arg(long, default_value_t = 2_000)]
    pub retention_ms: u64,
    /// Timeline events kept per aggregate (0: every event, as `timeline = "forever"`).
    #[arg(long, default_value_t = 5)]
    pub timeline: u32,
    /// The pruner's rest after a round that found nothing more ([retention] interval_ms).
    #[arg(long, default_value_t = 250)]
    pub prune_interval_ms: u64,
    /// The most rows of each kind one pruning batch deletes ([retention] batch). Above the
    /// gate's default of 500: the pruner sends a batch only after the one before committed, so
    /// at 500 a batch it deletes about as fast as this load applies and its window widens.
    #[arg(long, default_value_t = 2_000)]
    pub prune_batch: usize,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl BenchRetentionArgs {
    fn options(&self) -> bench::retention::RetentionBenchOptions {
        let postgres = self.backend == Backend::Postgres;
        let messages = self
            .messages
            .unwrap_or(if postgres { 1_000_000 } else { 2_000_000 });
        bench::retention::RetentionBenchOptions {
            postgres,
            messages,
            off_messages: self.off_messages.unwrap_or(messages),
            aggregates: self.aggregates,
            sample_every: self.sample_every,
            batch: self.batch,
            consumers: self.consumers,
            retention: bench::retention::RetentionSettings {
                kept_ms: self.retention_ms,
                timeline: self.timeline,
                interval_ms: self.prune_interval_ms,
                batch: self.prune_batch,
            },
        }
    }
}

#[derive(Args)]
pub struct BenchFloodArgs {
    /// Early messages of the flooded aggregate (its sequence 1 is sent after them).
    #[arg(long, default_value_t = 5_000)]
    pub early: usize,
    /// The consumer's --nats-batch.
    #[arg(long, default_value_t = production_lab::broker::DEFAULT_BATCH)]
    pub batch: usize,
    #[arg(long, value_enum, default_value = "full")]
    pub synchronous: Synchronous,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct BenchGateArgs {
    #[arg(long, default_value_t = 64)]
    pub aggregates: usize,
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// The gate's input batch (its consumer's fetch size), and the broker bench's.
    #[arg(long, default_value_t = production_lab::broker::DEFAULT_BATCH)]
    pub batch: usize,
    /// Skip `bench broker` in the same run.
    #[arg(long)]
    pub without_broker: bool,
    /// The gates' store: SQLite, or a private PostgreSQL (durable commits).
    #[arg(long, value_enum, default_value = "sqlite")]
    pub backend: Backend,
    /// Gates on the one store: 1, or 2 with `--backend postgres`.
    #[arg(long, default_value_t = 1)]
    pub gates: usize,
    /// Then run once more offered at half the measured input → output rate, for its p99.
    #[arg(long)]
    pub steady_at_half: bool,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Which store `bench ordered`, `bench gate` and `bench retention` measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The SQLite server (group commit) against one transaction per message.
    Sqlite,
    /// PostgreSQL through one and through two server processes, next to the SQLite server.
    Postgres,
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
    pub backend: Backend,
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
    let (report, path) = runtime.block_on(async {
        anyhow::Ok(match command {
            BenchCommand::Ordered(args) => (ordered(&args).await?, args.json),
            BenchCommand::Broker(args) => {
                let options = bench::broker::BrokerBenchOptions {
                    aggregates: args.aggregates,
                    messages: args.messages,
                    batch: args.batch,
                    synchronous: args.synchronous.into(),
                    concurrency: args.concurrency,
                    baseline: ledger_baseline(),
                };
                (
                    Rendered::of(&bench::broker::run(&options).await?)?,
                    args.json,
                )
            }
            BenchCommand::Flood(args) => {
                let options = bench::flood::FloodBenchOptions {
                    early: args.early,
                    batch: args.batch,
                    synchronous: args.synchronous.into(),
                };
                (
                    Rendered::of(&bench::flood::run(&options).await?)?,
                    args.json,
                )
            }
            BenchCommand::Relay(args) => {
                let options = bench::relay::RelayBenchOptions {
                    aggregates: args.aggregates,
                    messages: args.messages,
                    writers: args.writers,
                    batch: args.batch,
                    lease_pending: args.lease_pending,
                    lease_held: args.lease_held,
                };
                (
                    Rendered::of(&bench::relay::run(&options).await?)?,
                    args.json,
                )
            }
            BenchCommand::Gate(args) => {
                let broker = (!args.without_broker).then(|| bench::broker::BrokerBenchOptions {
                    aggregates: args.aggregates,
                    messages: args.messages,
                    batch: args.batch,
                    synchronous: Synchronous::Full.into(),
                    concurrency: 32,
                    baseline: ledger_baseline(),
                });
                let options = bench::gate::GateBenchOptions {
                    aggregates: args.aggregates,
                    messages: args.messages,
                    batch: args.batch,
                    broker,
                    postgres: args.backend == Backend::Postgres,
                    gates: args.gates,
                    steady_at_half: args.steady_at_half,
                };
                (Rendered::of(&bench::gate::run(&options).await?)?, args.json)
            }
            BenchCommand::Retention(args) => {
                let report =
                    bench::retention::run(&args.options(), &gate_store::GateStoreOpener).await?;
                (Rendered::of(&report)?, args.json)
            }
            BenchCommand::Stampede(args) => {
                let report = bench::stampede::stampede(args.callers).await?;
                (Rendered::of(&report)?, args.json)
            }
        })
    })?;
    println!("{}", report.text);
    if let Some(path) = path {
        std::fs::write(&path, report.json)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `bench ordered` on the backend its arguments name.
async fn ordered(args: &BenchOrderedArgs) -> anyhow::Result<Rendered> {
    let options = bench::ordered::OrderedOptions {
        aggregates: args.aggregates,
        messages: args.messages,
        concurrency: args.concurrency,
        synchronous: args.synchronous.into(),
        server: args.server.clone(),
        baseline: ledger_baseline(),
    };
    match args.backend {
        Backend::Sqlite => Rendered::of(&bench::ordered::ordered(&options).await?),
        Backend::Postgres => Rendered::of(&bench::postgres::ordered_postgres(&options).await?),
    }
}

/// What the raw baseline applies: the server's own handler, the lesson's ledger, with its
/// trigger beside the inbox's tables.
fn ledger_baseline() -> bench::ordered::RawApplication {
    bench::ordered::RawApplication {
        handler: Arc::new(Ledger),
        migrate: ledger::migrate_sqlite,
    }
}

/// A bench's report as printed and as its `--json` file.
struct Rendered {
    text: String,
    json: String,
}

impl Rendered {
    fn of(report: &(impl std::fmt::Display + serde::Serialize)) -> anyhow::Result<Rendered> {
        Ok(Rendered {
            text: report.to_string(),
            json: serde_json::to_string_pretty(report)?,
        })
    }
}
