//! `production-lab serve`: the lesson's Development-only fixture on a loopback address.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use production_lab::Application;
use production_lab::config::{self, Config, Synchronous};
use production_lab::observe::{self, LogFormat};

use super::shutdown_signal;

#[derive(Args)]
pub struct ServeArgs {
    /// The one http://HOST:PORT to listen on; port 0 picks a free port. Loopback only.
    #[arg(long, default_value = config::DEFAULT_URLS)]
    pub urls: String,
    /// The SQLite file (created if missing). Default: a fresh file in the temp directory.
    #[arg(long, alias = "Production:DatabasePath")]
    pub database: Option<PathBuf>,
    /// The runtime settings file.
    #[arg(long, default_value = "runtime-settings.json")]
    pub settings: PathBuf,
    /// Must be Development: the fixture exposes fault controls.
    #[arg(long, env = "LAB_ENVIRONMENT", default_value = "Production")]
    pub environment: String,
    /// The one proxy whose X-Forwarded-For/-Proto are believed.
    #[arg(long, alias = "Production:Proxy", default_value_t = config::DEFAULT_KNOWN_PROXY)]
    pub known_proxy: std::net::IpAddr,
    /// Allowed Host names, ';'-separated, or * for any.
    #[arg(long, alias = "AllowedHosts", default_value = "*")]
    pub allowed_hosts: String,
    /// SQLite synchronous mode of the write connection.
    #[arg(long, value_enum, default_value = "full")]
    pub synchronous: Synchronous,
    /// Open dead letters one aggregate may hold; a further new poison message answers 429.
    #[arg(long, default_value_t = config::DEFAULT_MAX_OPEN_DEAD_LETTERS,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_open_dead_letters: u32,
    /// How log lines are written to stderr: text, or one JSON object per line. LAB_LOG sets
    /// which (e.g. LAB_LOG=info for request lines and the inbox's events; default warn).
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Time a client has to send a request head, from connecting or from its first byte after a
    /// pause (500ms, 10s or 10).
    #[arg(long, value_parser = config::parse_timeout, default_value = "10s")]
    pub header_timeout: std::time::Duration,
    /// Time a client has to send a whole request body, from the end of its head.
    #[arg(long, value_parser = config::parse_timeout, default_value = "30s")]
    pub body_timeout: std::time::Duration,
    /// Time an idle keep-alive connection stays open between requests.
    #[arg(long, value_parser = config::parse_timeout, default_value = "60s")]
    pub keep_alive_timeout: std::time::Duration,
    /// Open connections at most; at the cap the longest-waiting idle one makes room, and when
    /// every one is busy a new one is answered 503 and closed.
    #[arg(long, value_parser = config::parse_max_connections, default_value_t = config::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Bytes of request bodies all connections together may be receiving at once (64MiB, 512KiB
    /// or bytes); past it a new body waits up to a second for room, then answers 503.
    #[arg(long, env = "LAB_REQUEST_BODY_BUDGET", value_parser = config::parse_request_body_budget,
          default_value = "64MiB")]
    pub request_body_budget: usize,
    /// Keep the ordered inbox in PostgreSQL, postgres://USER@127.0.0.1:PORT/DB (loopback or a
    /// Unix socket directory only), shared by every server given the same URL.
    #[arg(long)]
    pub inbox: Option<String>,
    /// Messages one aggregate may hold ahead of its turn (broker deliveries); a further one is
    /// nak'd back to the broker with a delay.
    #[arg(long, default_value_t = config::DEFAULT_MAX_HELD_PER_AGGREGATE,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_held_per_aggregate: u32,
    /// Threads that run requests. Default: one fewer than the cores (at least one), because the
    /// store's writer is a busy thread of its own under write load.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
    #[command(flatten)]
    pub nats: NatsArgs,
}

#[derive(Args)]
pub struct NatsArgs {
    /// Also consume ordered messages from NATS JetStream: nats://HOST:PORT[,nats://…], loopback
    /// only.
    #[arg(long, value_name = "URLS")]
    pub nats: Option<String>,
    /// The JetStream stream (created with file storage if missing).
    #[arg(long, default_value = production_lab::broker::DEFAULT_STREAM)]
    pub nats_stream: String,
    /// Producers publish to PREFIX.AGGREGATE.
    #[arg(long, default_value = production_lab::broker::DEFAULT_SUBJECT_PREFIX)]
    pub nats_subject_prefix: String,
    /// The durable pull consumer's name (with partitions, -pK is appended).
    #[arg(long, default_value = production_lab::broker::DEFAULT_DURABLE)]
    pub nats_durable: String,
    /// How many partitions the NATS server's subject mapping splits aggregates into.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub nats_partitions: u32,
    /// The one partition (0-based) this server consumes.
    #[arg(long, default_value_t = 0)]
    pub nats_partition: u32,
    /// The most messages one fetch, and so one commit, carries.
    #[arg(long, default_value_t = production_lab::broker::DEFAULT_BATCH)]
    pub nats_batch: usize,
    /// The consumer's ack wait in milliseconds: an un-acked message is redelivered after it.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub nats_ack_wait_ms: u64,
    /// The first nak delay in milliseconds (hold full, store failure); it doubles per redelivery
    /// up to 30 s.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(0..=30_000))]
    pub nats_nak_delay_ms: u64,
    /// How often, in milliseconds, the gap notices of aggregates still waiting for a missing
    /// sequence are published again (gaps.PREFIX.AGGREGATE).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub nats_gap_notice_interval_ms: u64,
    /// The most gap notices one tick of that timer publishes.
    #[arg(long, default_value_t = production_lab::broker::DEFAULT_GAP_NOTICES_PER_TICK)]
    pub nats_gap_notices_per_tick: usize,
}

impl NatsArgs {
    fn broker_config(self) -> anyhow::Result<Option<production_lab::broker::BrokerConfig>> {
        let Some(urls) = self.nats else {
            return Ok(None);
        };
        let mut broker = production_lab::broker::loopback_config(&urls)?;
        broker.stream = self.nats_stream;
        broker.subject_prefix = self.nats_subject_prefix;
        broker.durable = self.nats_durable;
        broker.partitions = self.nats_partitions;
        broker.partition = self.nats_partition;
        broker.batch = self.nats_batch;
        broker.ack_wait = std::time::Duration::from_millis(self.nats_ack_wait_ms);
        broker.nak_delay = std::time::Duration::from_millis(self.nats_nak_delay_ms);
        broker.gap_notice_interval =
            std::time::Duration::from_millis(self.nats_gap_notice_interval_ms);
        broker.gap_notices_per_tick = self.nats_gap_notices_per_tick;
        broker.validate()?;
        Ok(Some(broker))
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let worker_threads = args
        .worker_threads
        .map_or_else(default_worker_threads, usize::from);
    observe::init_logging(
        args.log_format,
        tracing_subscriber::EnvFilter::try_from_env("LAB_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
    );
    let config = Config {
        urls: args.urls,
        database: args.database.unwrap_or_else(config::default_database_path),
        settings: args.settings,
        environment: args.environment,
        known_proxy: args.known_proxy,
        allowed_hosts: args.allowed_hosts,
        synchronous: args.synchronous,
        max_open_dead_letters: args.max_open_dead_letters as usize,
        outbox_lease: config::DEFAULT_OUTBOX_LEASE,
        limits: config::ConnectionLimits {
            header_read_timeout: args.header_timeout,
            body_read_timeout: args.body_timeout,
            keep_alive_timeout: args.keep_alive_timeout,
            max_connections: args.max_connections,
            request_body_budget: args.request_body_budget,
        },
        max_held_per_aggregate: args.max_held_per_aggregate as usize,
        nats: args.nats.broker_config()?,
        inbox: args.inbox,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let stop = shutdown_signal()?;
        let application = Application::build(config).await?;
        application
            .run_until_stopped(stop)
            .await
            .context("the server failed")
    })
}

/// One fewer request thread than the cores: with a worker per core, the writer thread and the
/// workers take turns on the same cores, and each turn is a park, a wake and a cold cache (on two
/// cores `bench ordered` measured about a tenth less server CPU per durable apply with one).
fn default_worker_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |cores| cores.get().saturating_sub(1))
        .max(1)
}
