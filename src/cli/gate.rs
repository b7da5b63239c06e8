//! `production-lab gate --config FILE [--check-config]`: the ordering gate, configured by one
//! TOML file. A file with mistakes is refused before anything starts: every mistake on a line of
//! its own on stderr, naming its key, and exit status 2 (as for a bad command line), so that a
//! deploy step (`--check-config`) and a start fail the same way.
//!
//! `production-lab gate backup --config FILE --to PATH`: an online copy of the gate's SQLite
//! store, taken while the gate serves ([`ordering_gate::backup`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use ordering_gate::backup::{self, BackupPace, DEFAULT_PAGES_PER_STEP};
use ordering_gate::config::{ConfigErrors, GateConfig};
use production_lab::observe;

/// The exit status of a refused configuration.
const REFUSED: i32 = 2;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct GateArgs {
    #[command(subcommand)]
    pub command: Option<GateCommand>,
    /// The gate's TOML file; relative paths in it are relative to its directory.
    #[arg(long, value_name = "FILE", required = true)]
    pub config: Option<PathBuf>,
    /// Check the file (its keys, addresses, TLS files, environment variables, schemas), print
    /// `configuration OK: FILE` and exit; a file with mistakes prints each and exits 2.
    #[arg(long)]
    pub check_config: bool,
}

#[derive(Subcommand)]
pub enum GateCommand {
    /// Copy the gate's SQLite store to a new file while the gate serves (SQLite's online
    /// backup); a PostgreSQL store is refused: see docs/gate.md, Backup and restore.
    Backup(BackupArgs),
}

#[derive(Args)]
pub struct BackupArgs {
    /// The gate's TOML file: the store is its `[store] sqlite`.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// The copy's path; refused if it exists.
    #[arg(long, value_name = "PATH")]
    pub to: PathBuf,
    /// Pages copied between two pauses.
    #[arg(long, default_value_t = DEFAULT_PAGES_PER_STEP, value_parser = clap::value_parser!(u32).range(1..))]
    pub pages_per_step: u32,
    /// The pause after each step, in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub pause_ms: u64,
}

pub fn run(args: GateArgs) -> anyhow::Result<()> {
    let config_path = match (args.command, args.config) {
        (Some(GateCommand::Backup(backup)), _) => return run_backup(backup),
        (None, Some(config_path)) => config_path,
        (None, None) => anyhow::bail!("gate needs --config FILE (see --help)"),
    };
    let config = match GateConfig::load(&config_path) {
        Ok(config) => config,
        Err(errors) => refuse(&errors),
    };
    if args.check_config {
        println!("configuration OK: {}", config_path.display());
        return Ok(());
    }
    observe::init_logging(
        config.log.format,
        tracing_subscriber::EnvFilter::try_from_env("GATE_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    // Until SIGTERM or Ctrl+C.
    runtime.block_on(ordering_gate::app::run(config, config_path))
}

/// Copies the store the configuration names and prints the one-line summary.
fn run_backup(args: BackupArgs) -> anyhow::Result<()> {
    let config = match GateConfig::load(&args.config) {
        Ok(config) => config,
        Err(errors) => refuse(&errors),
    };
    let pace = BackupPace {
        pages_per_step: args.pages_per_step,
        pause: Duration::from_millis(args.pause_ms),
    };
    let summary = backup::back_up(&config.store, &args.to, pace)?;
    println!("{summary}");
    Ok(())
}

/// Prints every mistake, one per line, and exits with status 2.
fn refuse(errors: &ConfigErrors) -> ! {
    for error in errors.iter() {
        eprintln!("{error}");
    }
    std::process::exit(REFUSED)
}
