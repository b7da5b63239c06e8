//! The command line: one file per subcommand, each with its arguments and its `run`. The
//! binary's own floor, above the library: `main.rs` only parses and dispatches here.

pub mod bench;
pub mod chaos;
pub mod gate;
pub mod practice;
pub mod publish;
pub mod registry;
pub mod relay;
pub mod serve;
pub mod simulate;
pub mod verify_base;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ordered_inbox::operators::Registry;

#[derive(Parser)]
#[command(
    name = "production-lab",
    version,
    about = "A Development-only loopback lab of production contracts"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the lab server on a loopback address.
    Serve(Box<serve::ServeArgs>),
    /// Run the ordering gate: the ordered inbox for any producer's messages over HTTP (/v1) and
    /// NATS JetStream, configured by a TOML file.
    Gate(gate::GateArgs),
    /// Run the ordering policy over a progression of SEQUENCE:AMOUNT deliveries.
    Practice(practice::PracticeArgs),
    /// Verify the consumer contracts of a fresh fixture over real HTTP.
    VerifyBase(verify_base::VerifyBaseArgs),
    /// Manage the operators allowed to resolve dead letters.
    #[command(mut_subcommands = registry::operator_help)]
    Operator {
        #[command(subcommand)]
        command: registry::RegistryCommand,
    },
    /// Manage the producers allowed to write (and own) aggregates on the general door.
    #[command(mut_subcommands = registry::producer_help)]
    Producer {
        #[command(subcommand)]
        command: registry::RegistryCommand,
    },
    /// Measure the server (release build recommended): prints figures, fails on a wrong result.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Publish one ordered message to NATS JetStream on the broker door's wire format and wait
    /// for its PubAck.
    Publish(publish::PublishArgs),
    /// Move events from a service's general outbox (HTTP) to NATS JetStream: lease, publish with
    /// the event key as Nats-Msg-Id, await the PubAcks, ack with the generations.
    Relay(relay::RelayArgs),
    /// Check the ordered inbox against its reference model: seeded histories of deliveries,
    /// resolutions, sessions and crashes on a real store; prints the report, fails on a
    /// divergence.
    Simulate(simulate::SimulateArgs),
    /// Jepsen-style campaigns against the gate across network namespaces: seeded partitions,
    /// pauses and crashes, producers on both doors, an independent checker of the output.
    Chaos(chaos::ChaosArgs),
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Gate(args) => gate::run(args),
        Command::Bench(command) => bench::run(command),
        Command::Practice(args) => practice::run(args),
        Command::VerifyBase(args) => verify_base::run(args),
        Command::Operator { command } => registry::run(Registry::Operators, command),
        Command::Producer { command } => registry::run(Registry::Producers, command),
        Command::Relay(args) => relay::run(args),
        Command::Publish(args) => publish::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::Chaos(args) => chaos::run(args),
    }
}

/// Runs one future on a small runtime of its own (the operator commands against PostgreSQL).
pub fn block_on<T>(future: impl std::future::Future<Output = T>) -> anyhow::Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    Ok(runtime.block_on(future))
}

/// Registers the SIGINT and SIGTERM handlers at once, so a signal that arrives right after the
/// listening line (a supervisor or a test reacting to it) is not lost to the default action, and
/// returns a future that resolves on either.
pub fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
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
