//! `production-lab chaos`: Jepsen-style campaigns against the gate's deployment across network
//! namespaces (see `lab_testkit::chaos`): seeded faults, producers on both doors, the output
//! read live and in full, an independent checker. Prints each run's report; exits non-zero when
//! a run found a violation. Needs root (network namespaces), PostgreSQL and a current
//! nats-server.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use lab_testkit::chaos::{self, Plant, RunOptions, RunReport};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlantArg {
    /// The gates' publisher without its fence (needs a build with `--features planted-bugs`).
    FenceOff,
    /// The gates' NATS input acked before its COMMIT (needs `--features planted-bugs`).
    AckBeforeCommit,
    /// NATS with its default lazy fsync, its stores on lazy file systems, and a nemesis that
    /// kills a majority of its nodes with a power loss (forgetting what they did not sync).
    LazyFsync,
}

impl From<PlantArg> for Plant {
    fn from(plant: PlantArg) -> Plant {
        match plant {
            PlantArg::FenceOff => Plant::FenceOff,
            PlantArg::AckBeforeCommit => Plant::AckBeforeCommit,
            PlantArg::LazyFsync => Plant::LazyFsync,
        }
    }
}

#[derive(Args)]
pub struct ChaosArgs {
    /// The first seed: it fixes the fault schedule and the producers' choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds of traffic and faults per run (setup, healing and the final reading come on top).
    #[arg(long, default_value_t = 180)]
    duration: u64,
    /// Runs, on seeds SEED, SEED+1, …
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// Where each run's history (`history-SEED.jsonl`) and the reports (`report.json`, written
    /// again after each run) go.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print the reports as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Plant a known bug, to see the checker catch it.
    #[arg(long, value_enum)]
    plant: Option<PlantArg>,
    /// The NATS stores on lazy file systems and majority kills with a power loss, NATS syncing
    /// every write (`sync_interval: always`): the control run of `--plant lazy-fsync`.
    #[arg(long)]
    power_loss: bool,
    /// Play only these faults of the seed's schedule (ids as a report prints them), to replay
    /// a shortened schedule.
    #[arg(long, value_delimiter = ',')]
    faults: Option<Vec<usize>>,
    /// Producers, each on a host of its own.
    #[arg(long, default_value_t = 3)]
    producers: usize,
    /// Stop at the first run with a violation.
    #[arg(long)]
    stop_on_violation: bool,
    /// After a run with a violation, replay its seed with fewer faults while a violation
    /// persists, at most this many replays.
    #[arg(long, default_value_t = 0)]
    shrink: usize,
    /// Print each seed's fault schedule and exit: nothing is built or run.
    #[arg(long)]
    schedule: bool,
}

pub fn run(args: ChaosArgs) -> anyhow::Result<()> {
    let plant = args.plant.map(Plant::from);
    if plant.is_some_and(Plant::in_the_gate) && !cfg!(feature = "planted-bugs") {
        bail!(
            "--plant {} needs a gate built with the bug: cargo build --release --features planted-bugs",
            plant.map_or("", Plant::name)
        );
    }
    if args.schedule {
        for seed in args.seed..args.seed + args.runs {
            let faults = chaos::nemesis::schedule(
                seed,
                Duration::from_secs(args.duration),
                args.producers.max(1),
                chaos::lazy_stores(plant, args.power_loss),
            );
            println!("seed {seed}: {} faults", faults.len());
            for fault in faults {
                println!("  {fault}");
            }
        }
        return Ok(());
    }
    let gate_binary = std::env::current_exe().context("cannot find this program")?;
    let mut reports: Vec<RunReport> = Vec::new();
    let mut failed = Vec::new();
    for seed in args.seed..args.seed + args.runs {
        let options = RunOptions {
            seed,
            duration: Duration::from_secs(args.duration),
            gate_binary: gate_binary.clone(),
            producers: args.producers.max(1),
            plant,
            power_loss: args.power_loss,
            only_faults: args.faults.clone(),
            dir: args.dir.clone(),
            verbose: !args.json,
        };
        let report = chaos::run(&options).with_context(|| format!("chaos seed {seed}"))?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", chaos::render(&report));
        }
        let passed = report.passed();
        if !passed && args.shrink > 0 {
            let shortened = chaos::shorten(&options, &report, args.shrink)
                .with_context(|| format!("replaying chaos seed {seed}"))?;
            println!(
                "  shortened by {} replays ({} failed): seed {seed} fails with {} fault(s):",
                shortened.replays,
                shortened.failed_replays,
                shortened.faults.len()
            );
            for fault in &shortened.faults {
                println!("    {fault}");
            }
            println!("  replay: {}", report.replay_command(&shortened.faults));
        }
        reports.push(report);
        write_reports(args.dir.as_deref(), &reports)?;
        if !passed {
            failed.push(seed);
            if args.stop_on_violation {
                break;
            }
        }
    }
    if !failed.is_empty() {
        bail!("violations in seed(s) {failed:?}");
    }
    Ok(())
}

/// Writes the reports of the runs so far to `dir/report.json`, after each run, so that a
/// campaign stopped or failed half-way keeps what its finished runs found; the file is replaced
/// whole (written beside it, then renamed), never left half-written.
fn write_reports(dir: Option<&std::path::Path>, reports: &[RunReport]) -> anyhow::Result<()> {
    let Some(dir) = dir else {
        return Ok(());
    };
    let path = dir.join("report.json");
    let partial = dir.join(".report.json.partial");
    std::fs::write(&partial, serde_json::to_string_pretty(reports)?)
        .with_context(|| format!("cannot write {}", partial.display()))?;
    std::fs::rename(&partial, &path).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reports_file_is_replaced_whole_after_each_run() {
        let dir = tempfile::tempdir().expect("a temp dir");
        std::fs::write(dir.path().join("report.json"), "the last campaign's").expect("a file");
        write_reports(Some(dir.path()), &[]).expect("written");
        let written = std::fs::read_to_string(dir.path().join("report.json")).expect("read");
        assert_eq!(written, "[]");
        assert!(!dir.path().join(".report.json.partial").exists());
        write_reports(None, &[]).expect("nothing to write without --dir");
    }
}
