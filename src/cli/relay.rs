//! `production-lab relay`: moves events from a service's general outbox (HTTP) to NATS JetStream.

use anyhow::Context;
use clap::Args;
use production_lab::observe::{self, LogFormat};

use super::shutdown_signal;

#[derive(Args)]
pub struct RelayArgs {
    /// The outbox service's root, http://127.0.0.1:PORT (loopback only).
    #[arg(long)]
    pub base: String,
    /// Loopback nats://HOST:PORT[,…] (give every node of a cluster).
    #[arg(long, value_name = "URLS")]
    pub nats: String,
    /// This relay's name in the leases (1..64 of A-Z, a-z, 0-9, '.', '_', '-', '@').
    #[arg(long)]
    pub owner: String,
    #[arg(long, default_value = production_lab::broker::DEFAULT_SUBJECT_PREFIX)]
    pub subject_prefix: String,
    /// Events per lease (1..1000).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// How long a lease lasts; an ack after it is fenced.
    #[arg(long, default_value_t = 10_000)]
    pub lease_ms: u64,
    /// Drain what is pending, print the figures and exit.
    #[arg(long)]
    pub once: bool,
    /// The longest back-off when the outbox is idle.
    #[arg(long, default_value_t = 1_000)]
    pub max_idle_ms: u64,
    /// The most events one gap notice has published again (1..1000).
    #[arg(long, default_value_t = 256)]
    pub resend_max: usize,
    /// Test hook: hold each batch's ack this long after its PubAcks (announced on stderr).
    #[arg(long, hide = true)]
    pub hold_before_ack_ms: Option<u64>,
}

pub fn run(args: RelayArgs) -> anyhow::Result<()> {
    observe::init_logging(
        LogFormat::Text,
        tracing_subscriber::EnvFilter::try_from_env("LAB_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
    );
    let mut options = production_lab::relay::RelayOptions::new(&args.base, &args.nats, &args.owner);
    options.subject_prefix = args.subject_prefix;
    options.batch = args.batch;
    options.lease = std::time::Duration::from_millis(args.lease_ms);
    options.once = args.once;
    options.resend_max = args.resend_max;
    options.max_idle = std::time::Duration::from_millis(args.max_idle_ms);
    options.hold_before_ack = args
        .hold_before_ack_ms
        .map(std::time::Duration::from_millis);
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let report = runtime.block_on(async {
        let signal = shutdown_signal()?;
        let stop = tokio_util::sync::CancellationToken::new();
        let stopper = stop.clone();
        tokio::spawn(async move {
            signal.await;
            stopper.cancel();
        });
        anyhow::Ok(production_lab::relay::run(&options, stop).await?)
    })?;
    println!("relay {}: {report}", args.owner);
    Ok(())
}
