//! The `production-lab` command line. It only parses arguments and hands over to the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use ordered_inbox::operators::Registry;
use production_lab::config::{self, Config, Synchronous};
use production_lab::labs::contracts::verify;
use production_lab::labs::ordered::practice;
use production_lab::observe::{self, LogFormat};
use production_lab::{Application, bench};

/// mimalloc rather than the system allocator: a delivery allocates and frees a few hundred small
/// blocks across threads (request, JSON, rows, replies), and glibc's malloc, free and
/// consolidation were about 15% of the server's CPU under `bench ordered`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "production-lab",
    version,
    about = "A Development-only loopback lab of production contracts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the lab server on a loopback address.
    Serve(Box<ServeArgs>),
    /// Run the ordering policy over a progression of SEQUENCE:AMOUNT deliveries.
    Practice(PracticeArgs),
    /// Verify the consumer contracts of a fresh fixture over real HTTP.
    VerifyBase(VerifyBaseArgs),
    /// Manage the operators allowed to resolve dead letters.
    Operator {
        #[command(subcommand)]
        command: OperatorCommand,
    },
    /// Manage the producers allowed to write (and own) aggregates on the general door.
    Producer {
        #[command(subcommand)]
        command: ProducerCommand,
    },
    /// Measure the server (release build recommended): prints figures, fails on a wrong result.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Publish one ordered message to NATS JetStream on the broker door's wire format and wait
    /// for its PubAck.
    Publish(PublishArgs),
    /// Move events from a service's general outbox (HTTP) to NATS JetStream: lease, publish with
    /// the event key as Nats-Msg-Id, await the PubAcks, ack with the generations.
    Relay(RelayArgs),
}

#[derive(Args)]
struct RelayArgs {
    /// The outbox service's root, http://127.0.0.1:PORT (loopback only).
    #[arg(long)]
    base: String,
    /// Loopback nats://HOST:PORT[,…] (give every node of a cluster).
    #[arg(long, value_name = "URLS")]
    nats: String,
    /// This relay's name in the leases (1..64 of A-Z, a-z, 0-9, '.', '_', '-', '@').
    #[arg(long)]
    owner: String,
    #[arg(long, default_value = production_lab::broker::DEFAULT_SUBJECT_PREFIX)]
    subject_prefix: String,
    /// Events per lease (1..1000).
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// How long a lease lasts; an ack after it is fenced.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// Drain what is pending, print the figures and exit.
    #[arg(long)]
    once: bool,
    /// The longest back-off when the outbox is idle.
    #[arg(long, default_value_t = 1_000)]
    max_idle_ms: u64,
    /// Test hook: hold each batch's ack this long after its PubAcks (announced on stderr).
    #[arg(long, hide = true)]
    hold_before_ack_ms: Option<u64>,
}

#[derive(Args)]
struct PublishArgs {
    /// Loopback nats://HOST:PORT[,…].
    #[arg(long, value_name = "URLS", default_value = "nats://127.0.0.1:4222")]
    nats: String,
    #[arg(long, default_value = production_lab::broker::DEFAULT_SUBJECT_PREFIX)]
    subject_prefix: String,
    aggregate_id: String,
    message_id: String,
    #[arg(allow_negative_numbers = true)]
    sequence: i64,
    #[arg(allow_negative_numbers = true)]
    amount: i64,
    /// Publish as this registered producer (with --epoch and the token in
    /// PRODUCTION_LAB_PRODUCER_TOKEN): Authorization and Producer-Epoch headers, and
    /// Nats-Msg-Id PRODUCER/MESSAGE_ID.
    #[arg(long, value_name = "NAME", requires = "epoch")]
    producer: Option<String>,
    /// The epoch POST /producers/session answered.
    #[arg(long, value_name = "N", requires = "producer")]
    epoch: Option<i64>,
    /// The producer's token; from the environment only, so that it stays out of `ps`.
    #[arg(
        long = "token",
        env = "PRODUCTION_LAB_PRODUCER_TOKEN",
        hide_env_values = true,
        hide = true
    )]
    token: Option<String>,
}

#[derive(Subcommand)]
enum OperatorCommand {
    /// Register an operator and print their new token once (only its hash is stored).
    Add {
        /// 1..64 letters, digits, '.', '_', '-' or '@'.
        name: String,
        #[command(flatten)]
        database: OperatorDatabase,
    },
    /// List operators with their created and revoked times (never tokens).
    List {
        #[command(flatten)]
        database: OperatorDatabase,
    },
    /// Revoke an operator: their token stops working at once.
    Revoke {
        name: String,
        #[command(flatten)]
        database: OperatorDatabase,
    },
}

#[derive(Subcommand)]
enum ProducerCommand {
    /// Register a producer and print its new token once (only its hash is stored).
    Add {
        /// 1..64 letters, digits, '.', '_', '-' or '@'; never reused after revocation.
        name: String,
        #[command(flatten)]
        database: OperatorDatabase,
    },
    /// List producers with their created and revoked times (never tokens).
    List {
        #[command(flatten)]
        database: OperatorDatabase,
    },
    /// Revoke a producer: its token stops working at once, its deliveries get 401.
    Revoke {
        name: String,
        #[command(flatten)]
        database: OperatorDatabase,
    },
}

#[derive(Args)]
#[group(required = true, multiple = false)]
struct OperatorDatabase {
    /// The server's SQLite file (it must exist).
    #[arg(long, alias = "Production:DatabasePath")]
    database: Option<PathBuf>,
    /// The servers' PostgreSQL inbox, postgres://USER@127.0.0.1:PORT/DB (as given to serve --inbox).
    #[arg(long)]
    inbox: Option<String>,
}

impl OperatorDatabase {
    /// Where the operators live: the SQLite file, or the PostgreSQL inbox.
    fn store(self) -> OperatorStore {
        match (self.inbox, self.database) {
            (Some(url), _) => OperatorStore::Postgres(url),
            (None, Some(path)) => OperatorStore::Sqlite(path),
            // clap's group requires one of the two.
            (None, None) => OperatorStore::Sqlite(PathBuf::new()),
        }
    }
}

enum OperatorStore {
    Sqlite(PathBuf),
    Postgres(String),
}

#[derive(Subcommand)]
enum BenchCommand {
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
struct BenchRelayArgs {
    #[arg(long, default_value_t = 64)]
    aggregates: usize,
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Concurrent writers of A's outbox.
    #[arg(long, default_value_t = 32)]
    writers: usize,
    /// Events per lease.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// The lease-latency phase: events pending in A's outbox.
    #[arg(long, default_value_t = 20_000)]
    lease_pending: usize,
    /// The lease-latency phase: how many of the pending events are under live leases (each the
    /// first pending event of its aggregate, with a share of the rest waiting behind it).
    #[arg(long, default_value_t = 1_000)]
    lease_held: usize,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct BenchBrokerArgs {
    #[arg(long, default_value_t = 64)]
    aggregates: usize,
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// The consumer's --nats-batch.
    #[arg(long, default_value_t = production_lab::broker::DEFAULT_BATCH)]
    batch: usize,
    /// The HTTP comparison's concurrent clients.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[arg(long, value_enum, default_value = "full")]
    synchronous: Synchronous,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct BenchOrderedArgs {
    #[arg(long, default_value_t = 64)]
    aggregates: usize,
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[arg(long, value_enum, default_value = "full")]
    synchronous: Synchronous,
    /// Run this build of production-lab as the server (e.g. the previous commit's release build)
    /// under the same load and measurements; default: this binary.
    #[arg(long)]
    server: Option<PathBuf>,
    /// sqlite: group commit against one transaction per message; postgres: a private
    /// PostgreSQL through one and two servers, next to the SQLite server.
    #[arg(long, value_enum, default_value = "sqlite")]
    backend: bench::Backend,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct BenchStampedeArgs {
    #[arg(long, default_value_t = 1_000)]
    callers: usize,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct ServeArgs {
    /// The one http://HOST:PORT to listen on; port 0 picks a free port. Loopback only.
    #[arg(long, default_value = config::DEFAULT_URLS)]
    urls: String,
    /// The SQLite file (created if missing). Default: a fresh file in the temp directory.
    #[arg(long, alias = "Production:DatabasePath")]
    database: Option<PathBuf>,
    /// The runtime settings file.
    #[arg(long, default_value = "runtime-settings.json")]
    settings: PathBuf,
    /// Must be Development: the fixture exposes fault controls.
    #[arg(long, env = "LAB_ENVIRONMENT", default_value = "Production")]
    environment: String,
    /// The one proxy whose X-Forwarded-For/-Proto are believed.
    #[arg(long, alias = "Production:Proxy", default_value_t = config::DEFAULT_KNOWN_PROXY)]
    known_proxy: std::net::IpAddr,
    /// Allowed Host names, ';'-separated, or * for any.
    #[arg(long, alias = "AllowedHosts", default_value = "*")]
    allowed_hosts: String,
    /// SQLite synchronous mode of the write connection.
    #[arg(long, value_enum, default_value = "full")]
    synchronous: Synchronous,
    /// Open dead letters one aggregate may hold; a further new poison message answers 429.
    #[arg(long, default_value_t = config::DEFAULT_MAX_OPEN_DEAD_LETTERS,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_open_dead_letters: u32,
    /// How log lines are written to stderr: text, or one JSON object per line. LAB_LOG sets
    /// which (e.g. LAB_LOG=info for request lines and the inbox's events; default warn).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Time a client has to send a request head, from connecting or from its first byte after a
    /// pause (500ms, 10s or 10).
    #[arg(long, value_parser = config::parse_timeout, default_value = "10s")]
    header_timeout: std::time::Duration,
    /// Time a client has to send a whole request body, from the end of its head.
    #[arg(long, value_parser = config::parse_timeout, default_value = "30s")]
    body_timeout: std::time::Duration,
    /// Time an idle keep-alive connection stays open between requests.
    #[arg(long, value_parser = config::parse_timeout, default_value = "60s")]
    keep_alive_timeout: std::time::Duration,
    /// Open connections at most; at the cap the longest-waiting idle one makes room, and when
    /// every one is busy a new one is answered 503 and closed.
    #[arg(long, value_parser = config::parse_max_connections, default_value_t = config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Bytes of request bodies all connections together may be receiving at once (64MiB, 512KiB
    /// or bytes); past it a new body waits up to a second for room, then answers 503.
    #[arg(long, env = "LAB_REQUEST_BODY_BUDGET", value_parser = config::parse_request_body_budget,
          default_value = "64MiB")]
    request_body_budget: usize,
    /// Keep the ordered inbox in PostgreSQL, postgres://USER@127.0.0.1:PORT/DB (loopback or a
    /// Unix socket directory only), shared by every server given the same URL.
    #[arg(long)]
    inbox: Option<String>,
    /// Messages one aggregate may hold ahead of its turn (broker deliveries); a further one is
    /// nak'd back to the broker with a delay.
    #[arg(long, default_value_t = config::DEFAULT_MAX_HELD_PER_AGGREGATE,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_held_per_aggregate: u32,
    /// Threads that run requests. Default: one fewer than the cores (at least one), because the
    /// store's writer is a busy thread of its own under write load.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
    #[command(flatten)]
    nats: NatsArgs,
}

#[derive(Args)]
struct NatsArgs {
    /// Also consume ordered messages from NATS JetStream: nats://HOST:PORT[,nats://…], loopback
    /// only.
    #[arg(long, value_name = "URLS")]
    nats: Option<String>,
    /// The JetStream stream (created with file storage if missing).
    #[arg(long, default_value = production_lab::broker::DEFAULT_STREAM)]
    nats_stream: String,
    /// Producers publish to PREFIX.AGGREGATE.
    #[arg(long, default_value = production_lab::broker::DEFAULT_SUBJECT_PREFIX)]
    nats_subject_prefix: String,
    /// The durable pull consumer's name (with partitions, -pK is appended).
    #[arg(long, default_value = production_lab::broker::DEFAULT_DURABLE)]
    nats_durable: String,
    /// How many partitions the NATS server's subject mapping splits aggregates into.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    nats_partitions: u32,
    /// The one partition (0-based) this server consumes.
    #[arg(long, default_value_t = 0)]
    nats_partition: u32,
    /// The most messages one fetch, and so one commit, carries.
    #[arg(long, default_value_t = production_lab::broker::DEFAULT_BATCH)]
    nats_batch: usize,
    /// The consumer's ack wait in milliseconds: an un-acked message is redelivered after it.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    nats_ack_wait_ms: u64,
    /// The first nak delay in milliseconds (hold full, store failure); it doubles per redelivery
    /// up to 30 s.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(0..=30_000))]
    nats_nak_delay_ms: u64,
}

impl NatsArgs {
    fn broker_config(self) -> anyhow::Result<Option<production_lab::broker::BrokerConfig>> {
        let Some(urls) = self.nats else {
            return Ok(None);
        };
        let mut broker = production_lab::broker::BrokerConfig::new(&urls)?;
        broker.stream = self.nats_stream;
        broker.subject_prefix = self.nats_subject_prefix;
        broker.durable = self.nats_durable;
        broker.partitions = self.nats_partitions;
        broker.partition = self.nats_partition;
        broker.batch = self.nats_batch;
        broker.ack_wait = std::time::Duration::from_millis(self.nats_ack_wait_ms);
        broker.nak_delay = std::time::Duration::from_millis(self.nats_nak_delay_ms);
        broker.validate()?;
        Ok(Some(broker))
    }
}

#[derive(Args)]
struct VerifyBaseArgs {
    /// The fixture's root, e.g. http://127.0.0.1:5080/ (http, loopback, no path or user info).
    url: String,
}

#[derive(Args)]
struct PracticeArgs {
    /// The aggregate's last applied sequence before the first delivery.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    last: i64,
    /// Deliveries as SEQUENCE:AMOUNT (default: the lesson's 2:1 1:1 2:-1 3:1 2:1).
    #[arg(allow_negative_numbers = true)]
    steps: Vec<String>,
}

fn main() -> ExitCode {
    // A panic is a bug; still, the user sees one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("production-lab: internal error: {info}")
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) if !error.use_stderr() => {
            // --help and --version: print as clap renders them.
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            // One readable line, like every other start-up refusal; --help has the rest.
            let rendered = error.render().to_string();
            // clap's message may span lines (e.g. the missing arguments under it); keep them,
            // drop the usage and tips that --help repeats.
            let message: Vec<&str> = rendered
                .lines()
                .map(str::trim)
                .take_while(|line| !line.starts_with("Usage:") && !line.starts_with("For more"))
                .filter(|line| !line.is_empty() && !line.starts_with("tip:"))
                .collect();
            eprintln!(
                "production-lab: {} (see --help)",
                message.join(" ").trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            match error.downcast_ref::<verify::VerifyError>() {
                // verify-base starts its line with the seed's words, as the seed's message is.
                Some(refusal) if refusal.starts_with_seed_words() => eprintln!("{refusal}"),
                _ => eprintln!("production-lab: {error:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Bench(command) => run_bench(command),
        Command::Practice(args) => {
            let steps = if args.steps.is_empty() {
                practice::LESSON_PROGRESSION.to_vec()
            } else {
                args.steps
                    .iter()
                    .map(|step| practice::parse_step(step))
                    .collect::<Result<_, _>>()?
            };
            for line in practice::run(args.last, &steps) {
                println!("{line}");
            }
            Ok(())
        }
        Command::VerifyBase(args) => {
            println!("{}", verify::run(&args.url)?);
            Ok(())
        }
        Command::Operator { command } => operator(command),
        Command::Producer { command } => producer(command),
        Command::Relay(args) => relay(args),
        Command::Publish(args) => {
            let message = ordered_inbox::OrderedMessage {
                message_id: args.message_id,
                aggregate_id: args.aggregate_id,
                sequence: args.sequence,
                amount: args.amount,
            };
            let producer = match (args.producer, args.epoch) {
                (Some(producer), Some(epoch)) => Some(production_lab::broker::ProducerHeaders {
                    producer,
                    epoch,
                    token: args.token.context(
                        "--producer needs the producer's token in PRODUCTION_LAB_PRODUCER_TOKEN",
                    )?,
                }),
                _ => None,
            };
            let runtime =
                tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            let published = runtime.block_on(production_lab::broker::publish_one(
                &args.nats,
                &args.subject_prefix,
                &message,
                producer.as_ref(),
            ))?;
            println!(
                "{} -> stream {} sequence {}{}",
                published.subject,
                published.stream,
                published.stream_sequence,
                if published.duplicate {
                    " (duplicate: dropped by the duplicate window)"
                } else {
                    ""
                }
            );
            Ok(())
        }
    }
}

fn operator(command: OperatorCommand) -> anyhow::Result<()> {
    let command = match command {
        OperatorCommand::Add { name, database } => RegistryCommand::Add(name, database),
        OperatorCommand::List { database } => RegistryCommand::List(database),
        OperatorCommand::Revoke { name, database } => RegistryCommand::Revoke(name, database),
    };
    registry(Registry::Operators, command)
}

fn producer(command: ProducerCommand) -> anyhow::Result<()> {
    let command = match command {
        ProducerCommand::Add { name, database } => RegistryCommand::Add(name, database),
        ProducerCommand::List { database } => RegistryCommand::List(database),
        ProducerCommand::Revoke { name, database } => RegistryCommand::Revoke(name, database),
    };
    registry(Registry::Producers, command)
}

/// One `add|list|revoke` command of either registry.
enum RegistryCommand {
    Add(String, OperatorDatabase),
    List(OperatorDatabase),
    Revoke(String, OperatorDatabase),
}

fn registry(registry: Registry, command: RegistryCommand) -> anyhow::Result<()> {
    use ordered_inbox::sqlite::operators::{add_to, list_of, revoke_in};
    match command {
        RegistryCommand::Add(name, database) => {
            let token = match database.store() {
                OperatorStore::Sqlite(path) => add_to(registry, &path, &name)?,
                OperatorStore::Postgres(url) => block_on(
                    ordered_inbox::postgres::operators::add_to(registry, &url, &name),
                )??,
            };
            // The token alone on stdout, so that a script can capture it; the advice on stderr.
            println!("{token}");
            eprintln!(
                "{registry} '{name}' added; this token is shown only once: send it as Authorization: Bearer TOKEN"
            );
        }
        RegistryCommand::List(database) => {
            let records = match database.store() {
                OperatorStore::Sqlite(path) => list_of(registry, &path)?,
                OperatorStore::Postgres(url) => {
                    block_on(ordered_inbox::postgres::operators::list_of(registry, &url))??
                }
            };
            for record in records {
                let state = match &record.revoked_at {
                    Some(revoked_at) => format!("revoked {revoked_at}"),
                    None => "active".to_owned(),
                };
                println!("{}\tcreated {}\t{state}", record.name, record.created_at);
            }
        }
        RegistryCommand::Revoke(name, database) => {
            let revocation = match database.store() {
                OperatorStore::Sqlite(path) => revoke_in(registry, &path, &name)?,
                OperatorStore::Postgres(url) => block_on(
                    ordered_inbox::postgres::operators::revoke_in(registry, &url, &name),
                )??,
            };
            if revocation.already {
                println!("{name} was already revoked at {}", revocation.revoked_at);
            } else {
                println!("{name} revoked at {}", revocation.revoked_at);
            }
        }
    }
    Ok(())
}

/// Runs one future on a small runtime of its own (the operator commands against PostgreSQL).
fn block_on<T>(future: impl std::future::Future<Output = T>) -> anyhow::Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    Ok(runtime.block_on(future))
}

fn run_bench(command: BenchCommand) -> anyhow::Result<()> {
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

fn relay(args: RelayArgs) -> anyhow::Result<()> {
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

fn serve(args: ServeArgs) -> anyhow::Result<()> {
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

/// Registers the SIGINT and SIGTERM handlers at once, so a signal that arrives right after the
/// listening line (a supervisor or a test reacting to it) is not lost to the default action, and
/// returns a future that resolves on either.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
        let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => {},
                _ = terminate.recv() => {},
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
