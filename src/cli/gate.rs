//! `production-lab gate --config FILE [--check-config]`: the ordering gate, configured by one
//! TOML file. A file with mistakes is refused before anything starts: every mistake on a line of
//! its own on stderr, naming its key, and exit status 2 (as for a bad command line), so that a
//! deploy step (`--check-config`) and a start fail the same way.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ordering_gate::config::{ConfigErrors, GateConfig};
use production_lab::observe;

/// The exit status of a refused configuration.
const REFUSED: i32 = 2;

#[derive(Args)]
pub struct GateArgs {
    /// The gate's TOML file; relative paths in it are relative to its directory.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Check the file (its keys, addresses, TLS files, environment variables, schemas), print
    /// `configuration OK: FILE` and exit; a file with mistakes prints each and exits 2.
    #[arg(long)]
    pub check_config: bool,
}

pub fn run(args: GateArgs) -> anyhow::Result<()> {
    let config = match GateConfig::load(&args.config) {
        Ok(config) => config,
        Err(errors) => refuse(&errors),
    };
    if args.check_config {
        println!("configuration OK: {}", args.config.display());
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
    runtime.block_on(ordering_gate::app::run(config, args.config))
}

/// Prints every mistake, one per line, and exits with status 2.
fn refuse(errors: &ConfigErrors) -> ! {
    for error in errors.iter() {
        eprintln!("{error}");
    }
    std::process::exit(REFUSED)
}
