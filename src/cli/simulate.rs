//! `production-lab simulate`: seeded histories of the ordered inbox against its reference model
//! (see `lab_testkit::simulate`), on a SQLite file or a PostgreSQL database, with crashes of a
//! child process hosting the inbox (this binary again, with `--host`). Prints the report; exits
//! non-zero when the inbox and the model diverged.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use lab_testkit::pg::{ClusterOptions, PrivateCluster};
use lab_testkit::simulate::campaign::{self, Campaign, Report, Store};
use lab_testkit::simulate::history::Shape;
use lab_testkit::simulate::host::{self, HostProgram};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SimulatedBackend {
    Sqlite,
    Postgres,
}

#[derive(Args)]
pub struct SimulateArgs {
    /// How many seeds to run.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// The first seed; the seeds run are SEED, SEED+1, … A history is a pure function of its
    /// seed, so the same `--seeds N --seed S` runs the same histories again.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, value_enum, default_value_t = SimulatedBackend::Sqlite)]
    backend: SimulatedBackend,
    /// PostgreSQL: this database (a `postgres://` URL on loopback) instead of a private cluster.
    #[arg(long)]
    database_url: Option<String>,
    /// Every Nth seed's history crashes the inbox's process (0: none).
    #[arg(long, default_value_t = 20)]
    crash_every: u64,
    /// Steps per history.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Histories run at once.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// (internal) Host the inbox for a campaign on the backend given as JSON.
    #[arg(long, hide = true)]
    host: Option<String>,
}

pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    if let Some(backend) = &args.host {
        return runtime
            .block_on(host::serve(backend))
            .map_err(anyhow::Error::msg);
    }
    let directory = tempfile::tempdir().context("cannot make a directory for the databases")?;
    let cluster;
    let store = match (args.backend, &args.database_url) {
        (SimulatedBackend::Sqlite, _) => Store::Sqlite(directory.path().to_owned()),
        (SimulatedBackend::Postgres, Some(url)) => Store::Postgres(url.clone()),
        (SimulatedBackend::Postgres, None) => {
            cluster = PrivateCluster::start(ClusterOptions::for_tests())?;
            Store::Postgres(cluster.create_database("simulate")?)
        }
    };
    let program = std::env::current_exe().context("cannot find this program")?;
    let campaign = Campaign {
        first_seed: args.seed,
        seeds: args.seeds,
        store,
        shape: Shape {
            steps: args.steps,
            ..Shape::default()
        },
        crash_every: args.crash_every,
        host: Some(HostProgram {
            program,
            arguments: vec!["simulate".to_owned(), "--host".to_owned()],
        }),
        workers: args.workers,
        progress: true,
    };
    let report = runtime
        .block_on(campaign::run(campaign))
        .map_err(anyhow::Error::msg)?;
    print!("{}", render(&report));
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if !report.failures.is_empty() {
        bail!(
            "the inbox diverged from the model in {} seed(s)",
            report.failures.len()
        );
    }
    Ok(())
}

/// The report as lines of text.
fn render(report: &Report) -> String {
    let f = &report.faults;
    let mut text = format!(
        "simulate {}: seeds {}..{} ({} run), {} steps, {} crashes, {:.1} s, {:.0} seeds/s\n\
         faults: {} deliveries ({} poison, {} duplicates, {} out of order) in {} batches and \
         alone; {} resolutions and {} gap skips ({} with a stale expectedLast); {} sessions, \
         {} fenced deliveries; {} transfers ({} naming a stale owner or position, {} with a \
         crash around them); {} crash points\n",
        report.backend,
        report.first_seed,
        report.first_seed + report.seeds.saturating_sub(1),
        report.seeds_run,
        report.steps,
        report.crashes,
        report.seconds,
        report.seeds_per_second(),
        f.deliveries,
        f.poison,
        f.duplicates,
        f.out_of_order,
        f.batches,
        f.resolutions,
        f.gap_skips,
        f.stale_resolutions,
        f.sessions,
        f.fenced,
        f.transfers,
        f.stale_transfers,
        f.crashed_transfers,
        f.crashes,
    );
    for failure in &report.failures {
        text.push_str(&format!(
            "DIVERGED seed {} step {}: {}\n  reproduce: production-lab simulate --seeds 1 --seed {} --backend {}\n  shrunk history:\n",
            failure.seed, failure.step, failure.what, failure.seed, report.backend
        ));
        for step in &failure.shrunk {
            text.push_str(&format!("    {step}\n"));
        }
    }
    if report.failures.is_empty() {
        text.push_str(
            "no divergence: every verdict and every stored state agreed with the model\n",
        );
    }
    text
}
